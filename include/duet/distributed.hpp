// Data-parallel training over MPI (MindSpore's mindspore.communication on CPU, PyTorch's DDP):
//
//   duet::distributed::init();
//   duet::set_auto_parallel_context({.parallel_mode = duet::ParallelMode::DATA_PARALLEL, .gradients_mean = true});
//   data::DataLoader loader(data, 32, {.shuffle = true, .seed = 1,
//                                      .num_shards = duet::distributed::get_group_size(),
//                                      .shard_id = duet::distributed::get_rank()});
//   ... nn::TrainOneStepCell as in one process ...
//
// run with `mpirun -np N program`. Not part of duet/duet.hpp: only programs that include this
// header need MPI (CMake target duet::distributed).
//
// Every collective waits at most the timeout (InitConfig::timeout_seconds, else the
// environment variable DUET_DISTRIBUTED_TIMEOUT, else 60 s) and then throws
// duet::distributed::CommunicationError: a rank that died, hangs or skipped a step stops the
// others instead of hanging them. An exception that leaves main on any rank (the terminate
// handler init() installs) prints it and aborts every rank with MPI_Abort; a program that
// catches a duet::Error itself calls duet::distributed::abort.
#pragma once

// duet uses MPI's C interface; the deprecated C++ bindings do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "detail/demangle.hpp"
#include "error.hpp"
#include "kernels/elementwise.hpp"
#include "parallel.hpp"
#include "parameter.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace duet::distributed {

// A collective that failed or did not complete in time.
class CommunicationError : public Error {
 public:
  using Error::Error;
};

struct InitConfig {
  // How long a collective may wait for the other ranks; empty: DUET_DISTRIBUTED_TIMEOUT, else 60.
  std::optional<double> timeout_seconds = std::nullopt;
  // Gradients and parameters travel in buffers of about this size, each its own collective.
  std::size_t bucket_bytes = std::size_t{4} << 20;
  // nn::TrainOneStepCell starts summing gradients while backward still runs (from its second
  // step: the first counts each gradient's writes). false: after backward, as GradReducer does.
  bool overlap_backward = true;
};

namespace detail {

// Where each parameter's elements go in the buffers of one collective each: parameters in
// order, a bucket closed before it would pass the size (a parameter larger alone has its own).
struct Bucket {
  std::size_t first = 0;  // parameters [first, last)
  std::size_t last = 0;
  index_t elements = 0;
};

inline std::vector<Bucket> plan_buckets(const std::vector<index_t>& sizes, std::size_t bucket_bytes) {
  const auto limit = static_cast<index_t>(std::max<std::size_t>(bucket_bytes / sizeof(float), 1));
  std::vector<Bucket> buckets;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (buckets.empty() || (buckets.back().elements > 0 && buckets.back().elements + sizes[i] > limit)) {
      buckets.push_back({i, i, 0});
    }
    buckets.back().last = i + 1;
    buckets.back().elements += sizes[i];
  }
  return buckets;
}

class MpiRuntime final : public duet::detail::DataParallelRuntime {
 public:
  // comm carries the training steps' collectives, between_steps_comm the others
  // (duet::detail::Stream): a rank that stops training early and evaluates while another still
  // trains must not have the two collectives matched with each other (MPI fails that inside,
  // with its own message, or mixes the data); apart, both time out with duet's.
  MpiRuntime(MPI_Comm comm, MPI_Comm between_steps_comm, double timeout_seconds, std::size_t bucket_bytes, bool overlap)
      : comm_(comm), between_steps_comm_(between_steps_comm), timeout_seconds_(timeout_seconds), bucket_bytes_(bucket_bytes),
        overlap_(overlap) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  int rank() const override { return rank_; }
  int group_size() const override { return size_; }
  double timeout_seconds() const { return timeout_seconds_; }
  MPI_Comm communicator() const { return comm_; }

  void broadcast_parameters(const std::vector<nn::NamedParameter<float>>& params) override {
    check_same_network(params);
    std::vector<index_t> sizes;
    for (const auto& p : params) sizes.push_back(p.parameter->numel());
    const std::vector<Bucket> buckets = plan_buckets(sizes, bucket_bytes_);
    std::vector<std::vector<float>> buffers(buckets.size());
    std::vector<MPI_Request> requests(buckets.size(), MPI_REQUEST_NULL);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      buffers[b].resize(static_cast<std::size_t>(buckets[b].elements));
      if (rank_ == 0) {
        float* to = buffers[b].data();
        for (std::size_t i = buckets[b].first; i < buckets[b].last; ++i) {
          const nn::Parameter& p = *params[i].parameter;
          to = std::copy_n(p.data(), p.numel(), to);
        }
      }
      check(MPI_Ibcast(buffers[b].data(), static_cast<int>(buckets[b].elements), MPI_FLOAT, 0, comm_, &requests[b]),
            "broadcasting the parameters");
    }
    wait(requests, "broadcasting the parameters from rank 0");
    if (rank_ == 0) return;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const float* from = buffers[b].data();
      for (std::size_t i = buckets[b].first; i < buckets[b].last; ++i) {
        nn::Parameter& p = *params[i].parameter;
        // Non-const data() moves the version, so packed weights are made again.
        std::copy_n(from, p.numel(), p.data());
        from += p.numel();
      }
    }
  }

  // The step's weights, losses and the has-it flags go first, in a collective of their own:
  // from them every rank knows its share of the mean (its weight over the sum) and which
  // gradients every rank has, so all start the same collectives. A gradient every rank has, of
  // 64 KB or more, is summed where it is to end (write(i)): this rank's share of it written
  // there in one pass (none when it is there already and the share is 1), then reduced in
  // place, in a collective of its own. The rest are packed into buckets in backward order (the
  // last parameters' gradients are the first done), each started as soon as it is packed, and
  // copied out after. Packing and unpacking the seed network's 2.68 MB took 13 % of a rank's
  // step. Scaling before the sum gives, for shares that are powers of two (equal batches over
  // 2^k ranks), the bits of scaling after it.
  void all_reduce_gradients(std::span<const duet::detail::GradientView> grads, std::span<double> values, bool mean,
                            const std::function<float*(std::size_t)>& write) override {
    // [values..., has it per gradient]
    std::vector<double> meta(values.begin(), values.end());
    for (const duet::detail::GradientView& g : grads) meta.push_back(g.data != nullptr ? 1 : 0);
    MPI_Request meta_request = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, meta.data(), static_cast<int>(meta.size()), MPI_DOUBLE, MPI_SUM, comm_,
                         &meta_request),
          "all-reducing the step's weights and losses");
    wait(std::span(&meta_request, 1), "all-reducing the step's weights and losses");
    const double total = meta[0];
    const auto share = static_cast<float>(!mean ? values[0] : total > 0 ? values[0] / total : 0.0);
    const std::size_t flags = values.size();
    std::copy_n(meta.begin(), values.size(), values.begin());

    std::vector<float*> targets(grads.size(), nullptr);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (meta[flags + i] > 0) targets[i] = write(i);
    }
    constexpr index_t direct_elements = (64 << 10) / sizeof(float);
    std::vector<MPI_Request> requests;
    std::vector<std::size_t> bucketed;  // indices, in backward order
    for (std::size_t i = grads.size(); i-- > 0;) {
      const duet::detail::GradientView& g = grads[i];
      if (meta[flags + i] < size_ || g.size < direct_elements) {
        bucketed.push_back(i);
        continue;
      }
      if (targets[i] != g.data || share != 1) kernels::scale(g.data, g.size, share, targets[i]);
      requests.push_back(MPI_REQUEST_NULL);
      check(MPI_Iallreduce(MPI_IN_PLACE, targets[i], static_cast<int>(g.size), MPI_FLOAT, MPI_SUM, comm_,
                           &requests.back()),
            "all-reducing the gradients");
    }

    std::vector<index_t> sizes;
    for (const std::size_t i : bucketed) sizes.push_back(grads[i].size);
    const std::vector<Bucket> buckets = plan_buckets(sizes, bucket_bytes_);
    gradient_buffers_.resize(buckets.size());
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      std::vector<float>& buffer = gradient_buffers_[b];
      buffer.resize(static_cast<std::size_t>(buckets[b].elements));
      float* to = buffer.data();
      for (std::size_t k = buckets[b].first; k < buckets[b].last; ++k) {
        const duet::detail::GradientView& g = grads[bucketed[k]];
        if (g.data != nullptr) {
          kernels::scale(g.data, g.size, share, to);
        } else {
          std::fill_n(to, g.size, 0.0f);
        }
        to += g.size;
      }
      requests.push_back(MPI_REQUEST_NULL);
      check(MPI_Iallreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(buffer.size()), MPI_FLOAT, MPI_SUM, comm_,
                           &requests.back()),
            "all-reducing the gradients");
    }
    wait(requests, "all-reducing the gradients");

    for (std::size_t b = 0; b < buckets.size(); ++b) {
      const float* from = gradient_buffers_[b].data();
      for (std::size_t k = buckets[b].first; k < buckets[b].last; ++k) {
        const std::size_t i = bucketed[k];
        if (targets[i] != nullptr) std::copy_n(from, grads[i].size, targets[i]);
        from += grads[i].size;
      }
    }
  }

  bool same_on_every_rank(std::uint64_t hash, duet::detail::Stream stream) override {
    std::uint64_t bounds[2] = {hash, ~hash};  // max of h and of ~h: equal hashes iff max(h) == ~max(~h)
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, bounds, 2, MPI_UINT64_T, MPI_MAX, communicator(stream), &request),
          "comparing hashes");
    wait(std::span(&request, 1), "comparing the ranks' hashes");
    return bounds[0] == ~bounds[1];
  }

  void start_sum(float* data, index_t n) override {
    started_.push_back(MPI_REQUEST_NULL);
    check(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_, &started_.back()),
          "all-reducing the gradients");
  }

  void start_sum(std::span<double> values) override {
    started_.push_back(MPI_REQUEST_NULL);
    check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_SUM, comm_,
                         &started_.back()),
          "all-reducing the step's values");
  }

  void test_sums() override {
    int done = 0;
    check(MPI_Testall(static_cast<int>(started_.size()), started_.data(), &done, MPI_STATUSES_IGNORE),
          "all-reducing the gradients");
  }

  void wait_sums(std::string_view what) override {
    wait(started_, what);
    started_.clear();
  }

  bool overlaps_backward() const override { return overlap_ && size_ > 1; }
  std::size_t bucket_bytes() const override { return bucket_bytes_; }

  void all_reduce_sum(std::span<double> values, duet::detail::Stream stream) override {
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, MPI_SUM,
                         communicator(stream), &request),
          "summing values over the ranks");
    wait(std::span(&request, 1), "summing values over the ranks");
  }

 private:
  std::string where() const {
    return "duet::distributed (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + "): ";
  }

  void check(int code, std::string_view what) const {
    if (code == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(code, text, &length);
    throw CommunicationError(where() + std::string(what) + " failed: " + std::string(text, static_cast<std::size_t>(length)));
  }

  // MPI_Wait cannot give up; polling with a deadline can. Each MPI_Testall also moves the
  // collective on (a large all-reduce goes in segments, each sent from inside a call), so the
  // loop yields the core between calls instead of sleeping: a 50 us sleep made a 2.7 MB
  // all-reduce several times slower.
  void wait(std::span<MPI_Request> requests, std::string_view what) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds_);
    for (;;) {
      int done = 0;
      check(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE), what);
      if (done != 0) return;
      if (std::chrono::steady_clock::now() > deadline) {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, "%g", timeout_seconds_);
        throw CommunicationError(
            where() + std::string(what) + " did not complete within " + seconds +
            " s: another rank stopped, died or took another path (fewer steps: a loader of another "
            "batch size or length there; or a call every rank must make, such as train::evaluate "
            "or distributed::all_reduce_sum, made on some ranks only); the timeout is "
            "InitConfig::timeout_seconds or DUET_DISTRIBUTED_TIMEOUT");
      }
      std::this_thread::yield();
    }
  }

  static std::string describe(const nn::NamedParameter<float>& p) {
    return "'" + p.name + "' " + to_string(p.parameter->shape());
  }

  // Compares hashes of the ranks' parameter lists; when they differ, every rank learns the
  // first difference of the first rank that differs from rank 0, and all throw alike.
  void check_same_network(const std::vector<nn::NamedParameter<float>>& params) {
    std::string text;
    for (const auto& p : params) text += describe(p) + "\n";
    if (same_on_every_rank(duet::detail::fnv1a(text), duet::detail::Stream::steps)) return;
    MPI_Request request = MPI_REQUEST_NULL;

    // Rank 0's list, to each rank.
    unsigned long long length = text.size();
    check(MPI_Ibcast(&length, 1, MPI_UNSIGNED_LONG_LONG, 0, comm_, &request), "comparing the networks");
    wait(std::span(&request, 1), "comparing the ranks' networks");
    std::string reference = rank_ == 0 ? text : std::string(static_cast<std::size_t>(length), '\0');
    check(MPI_Ibcast(reference.data(), static_cast<int>(length), MPI_CHAR, 0, comm_, &request), "comparing the networks");
    wait(std::span(&request, 1), "comparing the ranks' networks");
    std::vector<std::string> expected;
    for (std::size_t from = 0, to; (to = reference.find('\n', from)) != std::string::npos; from = to + 1) {
      expected.push_back(reference.substr(from, to - from));
    }
    std::string difference;
    for (std::size_t i = 0; difference.empty() && i < std::max(expected.size(), params.size()); ++i) {
      const std::string mine = i < params.size() ? describe(params[i]) : "no parameter";
      const std::string zeros = i < expected.size() ? expected[i] : "no parameter";
      if (mine != zeros) {
        difference = "rank " + std::to_string(rank_) + " has " + mine + " as parameter " + std::to_string(i) +
                     " where rank 0 has " + zeros;
      }
    }
    // Every rank's difference (empty when it matches rank 0), to every rank.
    int mine_length = static_cast<int>(difference.size());
    std::vector<int> lengths(static_cast<std::size_t>(size_));
    check(MPI_Iallgather(&mine_length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm_, &request), "comparing the networks");
    wait(std::span(&request, 1), "comparing the ranks' networks");
    std::vector<int> offsets(lengths.size(), 0);
    for (std::size_t r = 1; r < lengths.size(); ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
    std::string all(static_cast<std::size_t>(offsets.back() + lengths.back()), '\0');
    check(MPI_Iallgatherv(difference.data(), mine_length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                          MPI_CHAR, comm_, &request),
          "comparing the networks");
    wait(std::span(&request, 1), "comparing the ranks' networks");
    for (std::size_t r = 0; r < lengths.size(); ++r) {
      if (lengths[r] > 0) {
        throw ValueError(where() + "the ranks' networks differ: " +
                         all.substr(static_cast<std::size_t>(offsets[r]), static_cast<std::size_t>(lengths[r])));
      }
    }
    // Equal lists with different hashes cannot happen; fail loudly rather than train apart.
    throw ValueError(where() + "the ranks' networks hash differently, yet list the same parameters");
  }

  MPI_Comm communicator(duet::detail::Stream stream) const {
    return stream == duet::detail::Stream::steps ? comm_ : between_steps_comm_;
  }

  MPI_Comm comm_;
  MPI_Comm between_steps_comm_;
  int rank_ = 0;
  int size_ = 1;
  double timeout_seconds_;
  std::size_t bucket_bytes_;
  bool overlap_;
  std::vector<MPI_Request> started_;  // start_sum's, until wait_sums
  std::vector<std::vector<float>> gradient_buffers_;  // kept, so steps do not allocate them again
};

inline std::unique_ptr<MpiRuntime>& runtime_storage() {
  static std::unique_ptr<MpiRuntime> runtime;
  return runtime;
}

inline MpiRuntime& runtime(std::string_view who) {
  MpiRuntime* r = runtime_storage().get();
  if (r == nullptr) {
    throw ModeError("duet::distributed::" + std::string(who) + ": call duet::distributed::init() first");
  }
  return *r;
}

inline double timeout_from_environment() {
  const char* env = std::getenv("DUET_DISTRIBUTED_TIMEOUT");
  if (env == nullptr) return 60.0;
  char* end = nullptr;
  const double seconds = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(seconds > 0)) {
    throw ValueError("duet::distributed::init: DUET_DISTRIBUTED_TIMEOUT must be a positive number of seconds, got '" +
                     std::string(env) + "'");
  }
  return seconds;
}

// Finalises MPI when the program ends normally.
struct Finalizer {
  Finalizer() = default;
  Finalizer(const Finalizer&) = delete;
  Finalizer& operator=(const Finalizer&) = delete;
  ~Finalizer() {
    duet::detail::data_parallel_runtime().store(nullptr, std::memory_order_release);
    runtime_storage().reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized == 0) MPI_Finalize();
  }
};

}  // namespace detail

// Prints message on stderr and ends every rank (MPI_Abort), with exit status `code`.
[[noreturn]] inline void abort(std::string_view message, int code = 1) {
  std::fprintf(stderr, "%.*s\n", static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized != 0) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// MindSpore's init(): joins the ranks mpirun started (one process alone is a group of 1).
// Calling it again changes nothing.
inline void init(const InitConfig& config = {}) {
  if (detail::runtime_storage() != nullptr) return;
  const double timeout = config.timeout_seconds ? *config.timeout_seconds : detail::timeout_from_environment();
  if (!(timeout > 0)) throw ValueError("duet::distributed::init: timeout_seconds must be positive");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) {
#ifdef OPEN_MPI
    // Open MPI's nonblocking all-reduce (libnbc) takes a binomial tree below 4 ranks and for any
    // in-place call, which each of duet's is: the whole buffer goes to one rank and back. Its
    // ring sends each rank's share once each way; with 2 ranks on this project's machine an
    // MPI_Iallreduce of the seed network's 2.68 MB took 0.7 ms instead of 1.7 (duet's whole
    // gradient all-reduce: benchmarks/allreduce.cpp).
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", 0);
    // Between ranks of one machine, Open MPI's shared-memory transport (vader) moves a message
    // above 4 KB with one copy by the kernel (CMA, process_vm_readv), which pins the other
    // process's pages per call; on this project's virtual machines that costs more than the copy
    // saved: through the shared buffers instead, the seed network's all-reduce took 0.42 ms
    // instead of 0.59 (MPI_Allreduce's own 0.29 instead of 0.47), and 2 ranks' epoch at batch
    // 64 went from 0.86x to 1.0x one process's speed (README, "Data parallelism"). Either
    // choice of the user's own in the environment stands.
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 0);
#endif
    // Training steps may run on any thread, one at a time; duet's kernel threads never call MPI.
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
      throw CommunicationError("duet::distributed::init: MPI_Init_thread failed");
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      throw CommunicationError("duet::distributed::init: this MPI cannot be called from more than one thread "
                               "(MPI_THREAD_SERIALIZED), which training steps on other threads need");
    }
  }
  static detail::Finalizer finalizer;
  MPI_Comm comms[2] = {MPI_COMM_NULL, MPI_COMM_NULL};
  for (MPI_Comm& comm : comms) {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    // Errors come back as codes, which become CommunicationError, instead of aborting in MPI.
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  }
  detail::runtime_storage() = std::make_unique<detail::MpiRuntime>(comms[0], comms[1], timeout, config.bucket_bytes,
                                                                config.overlap_backward);
  duet::detail::data_parallel_runtime().store(detail::runtime_storage().get(), std::memory_order_release);
  // An exception leaving main would otherwise end this rank alone, and the others would wait
  // for it until their timeout.
  std::set_terminate([] {
    std::string what = "an unknown exception";
    if (const std::exception_ptr e = std::current_exception()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = duet::detail::readable_type_name(typeid(x)) + ": " + x.what();
      } catch (...) {
      }
    }
    int rank = 0;
    int size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    abort("duet::distributed: rank " + std::to_string(rank) + " of " + std::to_string(size) + " stopped: " + what +
          "; aborting all ranks");
  });
}

// MindSpore's get_rank(): this process's number, 0 .. get_group_size() - 1.
inline int get_rank() { return detail::runtime("get_rank").rank(); }
// MindSpore's get_group_size(): how many processes train together.
inline int get_group_size() { return detail::runtime("get_group_size").group_size(); }

struct GradReducerConfig {
  // true: the mean of the ranks' gradients, each weighted by the rows its loss averaged (the
  // global batch's gradient); false: their sum (MindSpore's mean=False).
  bool mean = true;
};

// MindSpore's nn.DistributedGradReducer, for training loops written by hand (GANs, gradient
// accumulation):
//
//   duet::distributed::GradReducer reducer(net.parameters(), {.mean = true});
//   auto out = value_and_grads(x, y);
//   out.grads = reducer(out.grads, rows);   // before anything that reads them
//   optimizer(out.grads);
//
// Constructing it gives every rank rank 0's parameters (checking that the networks match), as
// nn::TrainOneStepCell's first step does. Each call all-reduces the gradients of the
// parameters with requires_grad (in order: value_and_grad's), with the same buckets as
// TrainOneStepCell, and averages the parameters nothing trains (BatchNorm's moving statistics)
// over the ranks in the same collective (their plain mean). In DATA_PARALLEL, optimizer(grads)
// accepts the vector returned (or a copy), until the next backward pass, and refuses any other.
class GradReducer {
 public:
  explicit GradReducer(const std::vector<nn::NamedParameter<float>>& params, GradReducerConfig config = {})
      : runtime_(detail::runtime("GradReducer")), config_(config) {
    runtime_.broadcast_parameters(params);
    for (const auto& p : params) {
      if (p.parameter->requires_grad) {
        trained_.push_back(p);
      } else {
        buffers_.push_back(p.parameter);
      }
    }
  }

  // grads: one per trained parameter, in order. rows: what this rank's gradient weighs in the
  // mean: the rows its loss averaged (those not ignored); equal on every rank, the mean is
  // MindSpore's (the sum divided by the group size). A loss with Reduction::sum needs
  // {.mean = false}: the one batch's gradient is then the ranks' sum.
  std::vector<Tensor> operator()(const std::vector<Tensor>& grads, double rows = 1) {
    if (grads.size() != trained_.size()) {
      throw ValueError("duet::distributed::GradReducer: got " + std::to_string(grads.size()) + " gradients for " +
                       std::to_string(trained_.size()) + " trained parameters");
    }
    if (!(rows >= 0) || !std::isfinite(rows)) {
      throw ValueError("duet::distributed::GradReducer: rows must be a finite number >= 0, got " + std::to_string(rows));
    }
    std::vector<duet::detail::GradientView> views;
    std::vector<Tensor> reduced;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!(grads[i].shape() == trained_[i].parameter->shape())) {
        throw ShapeError("duet::distributed::GradReducer: gradient " + std::to_string(i) + " has shape " +
                         to_string(grads[i].shape()) + ", its parameter " + to_string(trained_[i].parameter->shape()));
      }
      views.push_back({grads[i].data(), grads[i].numel()});
      reduced.push_back(Tensor::uninitialized(grads[i].shape()));  // every rank has it: all_reduce_step writes it
    }
    if (!checked_) {
      check_first_reduction(grads);
      checked_ = true;
    }
    duet::detail::all_reduce_step(
        runtime_, views, [&](std::size_t i) { return reduced[i].data(); }, {}, buffers_,
        {.summed = !config_.mean, .counted_rows = rows, .rows = 1}, config_.mean);
    duet::detail::ReducedGradients& set = duet::detail::all_reduced_gradient_set();
    set.pass = duet::detail::current_backward_pass();
    set.data.clear();
    for (const Tensor& g : reduced) set.data.push_back(g.data());
    return reduced;
  }

 private:
  // What nn::TrainOneStepCell's first step finds for its own loop, found for a loop of the
  // user's: ranks whose trained parameters changed apart after the reducer gave them rank 0's (a
  // checkpoint loaded on some ranks only; buffers such as BatchNorm's moving statistics move
  // apart in every forward pass, and the reduction averages them) would each train a network of
  // their own, and ranks
  // whose gradients are equal (a loader that is not sharded) would repeat one another; neither
  // shows anywhere else. Gradients that are all zero prove nothing and pass.
  void check_first_reduction(const std::vector<Tensor>& grads) {
    if (const auto where = duet::detail::first_difference_between_ranks(runtime_, trained_, duet::detail::Stream::steps)) {
      throw ValueError("duet::distributed::GradReducer: the ranks' parameters differ (" + *where +
                       " first) at the first reduction, although making the reducer gave every rank rank 0's: some "
                       "rank changed them since (a checkpoint loaded on some ranks only?); load it on every rank, or "
                       "before making the reducer");
    }
    std::uint64_t hash = duet::detail::fnv1a({});
    bool zero = true;
    for (const Tensor& g : grads) {
      hash = duet::detail::fnv1a(duet::detail::tensor_bytes(g), hash);
      zero = zero && std::ranges::all_of(g.values(), [](float v) { return v == 0; });
    }
    duet::detail::require_sharded_data(runtime_, hash, !zero, "duet::distributed::GradReducer", "the first gradients are");
  }

  detail::MpiRuntime& runtime_;
  GradReducerConfig config_;
  std::vector<nn::NamedParameter<float>> trained_;
  std::vector<nn::Parameter*> buffers_;
  bool checked_ = false;
};

// Each value becomes its sum over the ranks (for metrics a program gathers itself).
inline void all_reduce_sum(std::span<double> values) {
  detail::runtime("all_reduce_sum").all_reduce_sum(values, duet::detail::Stream::between_steps);
}

}  // namespace duet::distributed
