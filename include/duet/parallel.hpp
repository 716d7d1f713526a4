// Data parallelism's settings (MindSpore's set_auto_parallel_context) and the interface through
// which a training step, an optimiser and an evaluation reach the runtime that
// duet/distributed.hpp provides. This header needs no MPI: a program that never includes
// distributed.hpp has no runtime, and asking for DATA_PARALLEL without one is an error.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iostream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "data.hpp"
#include "detail/hash.hpp"
#include "error.hpp"
#include "kernels/elementwise.hpp"
#include "parameter.hpp"
#include "tensor.hpp"

namespace duet {

// MindSpore's ParallelMode: STAND_ALONE (one process) and DATA_PARALLEL (every rank holds the
// whole network and a shard of each batch). The other MindSpore modes split the network itself.
enum class ParallelMode : unsigned char { STAND_ALONE, DATA_PARALLEL };

// Fields left empty keep their current value, as ContextConfig's do.
struct AutoParallelConfig {
  std::optional<ParallelMode> parallel_mode = std::nullopt;
  // true: the update uses the mean of the ranks' gradients (weighted by their samples, so it is
  // the gradient of the global batch's mean loss); false: their sum (MindSpore's default).
  std::optional<bool> gradients_mean = std::nullopt;
};

struct AutoParallelContext {
  ParallelMode parallel_mode = ParallelMode::STAND_ALONE;
  bool gradients_mean = false;
};

namespace detail {
inline std::atomic<ParallelMode>& parallel_mode() {
  static std::atomic<ParallelMode> mode{ParallelMode::STAND_ALONE};
  return mode;
}
inline std::atomic<bool>& gradients_mean() {
  static std::atomic<bool> mean{false};
  return mean;
}
// Whether a program has set the parallel mode: STAND_ALONE left as it starts, with ranks joined,
// is more often forgotten than meant.
inline std::atomic<bool>& parallel_mode_chosen() {
  static std::atomic<bool> chosen{false};
  return chosen;
}
}  // namespace detail

inline void set_auto_parallel_context(const AutoParallelConfig& config) {
  if (config.parallel_mode) {
    if (*config.parallel_mode != ParallelMode::STAND_ALONE && *config.parallel_mode != ParallelMode::DATA_PARALLEL) {
      throw ValueError("duet::set_auto_parallel_context: parallel_mode must be STAND_ALONE or DATA_PARALLEL");
    }
    detail::parallel_mode().store(*config.parallel_mode, std::memory_order_relaxed);
    detail::parallel_mode_chosen().store(true, std::memory_order_relaxed);
  }
  if (config.gradients_mean) detail::gradients_mean().store(*config.gradients_mean, std::memory_order_relaxed);
}

inline AutoParallelContext get_auto_parallel_context() {
  return {detail::parallel_mode().load(std::memory_order_relaxed),
          detail::gradients_mean().load(std::memory_order_relaxed)};
}

namespace detail {

// A tensor's values as bytes, for fnv1a.
template <class E>
std::string_view tensor_bytes(const BasicTensor<E>& t) {
  return {reinterpret_cast<const char*>(t.data()), static_cast<std::size_t>(t.numel()) * sizeof(E)};
}

// A gradient a rank contributes to an all-reduce.
struct GradientView {
  const float* data = nullptr;  // nullptr: none this step
  index_t size = 0;
};

// The two streams of collectives: those of training steps, and those a program makes between
// steps (train::evaluate's checks and sums, distributed::all_reduce_sum). Each is ordered on its
// own, so that ranks at different points (one evaluating, one still in a step) each wait on
// their own and stop with duet's timeout, instead of meeting in a collective of another shape,
// which MPI reports as a truncated message or, shapes alike, completes with mixed values.
enum class Stream { steps, between_steps };

// What duet/distributed.hpp implements over MPI. Every call is collective: all ranks make it,
// in the same order, or it fails with a duet::Error after the runtime's timeout.
class DataParallelRuntime {
 public:
  DataParallelRuntime() = default;
  DataParallelRuntime(const DataParallelRuntime&) = delete;
  DataParallelRuntime& operator=(const DataParallelRuntime&) = delete;
  virtual ~DataParallelRuntime() = default;

  virtual int rank() const = 0;
  virtual int group_size() const = 0;
  // Checks that every rank has parameters of the same names and shapes (ValueError naming the
  // first difference otherwise), then gives every rank rank 0's values.
  virtual void broadcast_parameters(const std::vector<nn::NamedParameter<float>>& params) = 0;
  // One step's reduction. `values` are summed over the ranks first, in one collective;
  // values[0] is this rank's weight. Then each gradient (data nullptr: this rank has none,
  // counted as zeros) times the weight, divided by the summed weight when `mean` (zeros when
  // that is 0), is summed over the ranks, in collectives started in reverse order (backward's),
  // into write(i), for each gradient i that some rank has.
  virtual void all_reduce_gradients(std::span<const GradientView> grads, std::span<double> values, bool mean,
                                    const std::function<float*(std::size_t)>& write) = 0;
  // Whether `hash` is the same on every rank.
  virtual bool same_on_every_rank(std::uint64_t hash, Stream stream) = 0;
  // Nonblocking sums over the ranks, in place, each a collective of its own that every rank
  // starts in the same order (OverlappedReduction's). test_sums moves the started ones on
  // without waiting; wait_sums waits for all of them, within the timeout.
  virtual void start_sum(float* data, index_t n) = 0;
  virtual void start_sum(std::span<double> values) = 0;
  virtual void test_sums() = 0;
  virtual void wait_sums(std::string_view what) = 0;
  // Whether training steps sum their gradients while backward runs (OverlappedReduction), and
  // in buffers of about how many bytes.
  virtual bool overlaps_backward() const = 0;
  virtual std::size_t bucket_bytes() const = 0;
  // Each value becomes its sum over the ranks.
  virtual void all_reduce_sum(std::span<double> values, Stream stream) = 0;
};

// Where the ranks' params first differ, if they do ("'fc1.weight'", or their names and shapes):
// every rank gets the same answer, in two collectives when none differs (names and shapes,
// then values), one more per parameter up to the first that does otherwise.
template <class T>
std::optional<std::string> first_difference_between_ranks(DataParallelRuntime& runtime,
                                                          const std::vector<nn::NamedParameter<T>>& params, Stream stream) {
  std::string names;
  for (const auto& p : params) names += p.name + to_string(p.parameter->shape()) + "\n";
  if (!runtime.same_on_every_rank(fnv1a(names), stream)) return "the parameters' names or shapes";
  std::uint64_t hash = fnv1a({});
  for (const auto& p : params) hash = fnv1a(tensor_bytes<T>(*p.parameter), hash);
  if (runtime.same_on_every_rank(hash, stream)) return std::nullopt;
  for (const auto& p : params) {
    if (!runtime.same_on_every_rank(fnv1a(tensor_bytes<T>(*p.parameter)), stream)) return "'" + p.name + "'";
  }
  return std::nullopt;  // unreachable: the whole hash differed, so one part does
}

// The first data-parallel step's check that the ranks train on different data: `hash` is of
// what this rank computes from (`what`: its first batch, its first gradients); equal on every
// rank, the ranks would repeat one another. With `telling` false (gradients all zero) equal
// hashes prove nothing. Then that their sharded loaders cut their shards from one epoch order
// (data::detail::served_order; none on every rank passes too). `who` names the caller.
DUET_DETAIL_COMPILED void require_sharded_data(DataParallelRuntime& runtime, std::uint64_t hash, bool telling,
                                               std::string_view who, std::string_view what);

// Set by duet::distributed::init().
inline std::atomic<DataParallelRuntime*>& data_parallel_runtime() {
  static std::atomic<DataParallelRuntime*> runtime{nullptr};
  return runtime;
}

// The backward pass whose gradients the runtime last all-reduced on this thread: an optimiser
// step in DATA_PARALLEL over any other pass would update each rank differently.
inline std::uint64_t& all_reduced_backward_pass() {
  thread_local std::uint64_t pass = 0;
  return pass;
}

// The gradients distributed::GradReducer last returned on this thread, and the backward pass
// then current: optimizer(grads) accepts them in DATA_PARALLEL until the next backward pass.
struct ReducedGradients {
  std::uint64_t pass = 0;
  std::vector<const float*> data;
};
inline ReducedGradients& all_reduced_gradient_set() {
  thread_local ReducedGradients set;
  return set;
}

// What a rank's batch weighs in the global batch's loss (DATA_PARALLEL).
struct BatchShare {
  // Reduction::sum: the ranks' losses and gradients add up, as the one batch's would.
  bool summed = false;
  // Otherwise: the rows the loss averaged (those not ignored); each rank's loss and gradient
  // count in proportion to them.
  double counted_rows = 0;
  // The batch's rows, by which the ranks' moving statistics are averaged.
  double rows = 0;
};

// The label a loss leaves out (nn::CrossEntropyLoss's and nn::NLLLoss's ignore_index), if any.
template <class Loss>
std::optional<std::int32_t> ignored_label(const Loss& loss) {
  if constexpr (requires { loss.options().ignore_index; }) return loss.options().ignore_index;
  else return std::nullopt;
}

// The share of `loss` (a loss cell) over a batch of `rows` with these labels. Losses state
// their reduction (a static member `reduction`); one that does not, such as a cell of the
// user's own, is taken to average the batch's rows.
template <class Loss, class Labels>
BatchShare batch_share(const Loss& loss, const Labels& labels, index_t rows, std::string_view who) {
  BatchShare share{.summed = false, .counted_rows = static_cast<double>(rows), .rows = static_cast<double>(rows)};
  if constexpr (requires { Loss::reduction; }) {
    if (Loss::reduction == Reduction::none) {
      throw ModeError(std::string(who) + ": " + loss.label() +
                      " has Reduction::none; combining batches (or the ranks' shares of one) needs a loss reduced "
                      "to one number (Reduction::mean or Reduction::sum)");
    }
    share.summed = Loss::reduction == Reduction::sum;
  }
  if constexpr (std::same_as<Labels, BasicTensor<std::int32_t>>) {
    if (const std::optional<std::int32_t> ignored = ignored_label(loss)) {
      share.counted_rows = static_cast<double>(std::ranges::count_if(labels.values(), [&](std::int32_t l) { return l != *ignored; }));
    }
  }
  return share;
}

// The reduction a data-parallel step makes, shared by nn::TrainOneStepCell and
// distributed::GradReducer: gradients (see DataParallelRuntime::all_reduce_gradients), `loss`
// (each element becomes the global batch's: the ranks' sum, or their mean weighted by counted
// rows), and `buffers`, the parameters nothing trains (BatchNorm's moving statistics), which
// become their mean over the ranks weighted by rows. Parameters equal on every rank, such as
// frozen weights, stay exactly as they are: the sums are in double, where n * x is exact.
// With gradients_mean the gradients are the global batch's; without, their sum over the ranks
// (MindSpore's default).
// [gradient weight, loss weight, rows, weighted losses..., weighted buffers...]: what a step's
// ranks sum besides the gradients (all_reduce_step).
DUET_DETAIL_COMPILED std::vector<double> step_values(std::span<const float> loss,
                                                     const std::vector<nn::Parameter*>& buffers,
                                                     const BatchShare& share, bool weighted);

// The losses and buffers from step_values summed over the ranks.
DUET_DETAIL_COMPILED void apply_step_values(std::span<const double> values, std::span<float> loss,
                                            const std::vector<nn::Parameter*>& buffers, const BatchShare& share);

DUET_DETAIL_COMPILED void all_reduce_step(DataParallelRuntime& runtime, std::span<const GradientView> grads,
                                          const std::function<float*(std::size_t)>& write, std::span<float> loss,
                                          const std::vector<nn::Parameter*>& buffers, const BatchShare& share,
                                          bool gradients_mean);

// Counts each parameter's gradient writes in a backward pass: what OverlappedReduction needs
// to know when a gradient is final. index maps a parameter to its place in the optimiser's list.
class GradientWriteCounter final : public GradientObserver {
 public:
  GradientWriteCounter(const std::unordered_map<const void*, std::size_t>& index, std::vector<int>& writes)
      : index_(index), writes_(writes) {
    writes_.assign(index_.size(), 0);
  }
  void will_write(const void* parameter) override {
    if (const auto it = index_.find(parameter); it != index_.end()) ++writes_[it->second];
  }
  void writes_done() override {}

 private:
  const std::unordered_map<const void*, std::size_t>& index_;
  std::vector<int>& writes_;
};

// Sets the calling thread's gradient observer for its lifetime.
class GradientObserverScope {
 public:
  explicit GradientObserverScope(GradientObserver* observer) : saved_(gradient_observer()) {
    gradient_observer() = observer;
  }
  GradientObserverScope(const GradientObserverScope&) = delete;
  GradientObserverScope& operator=(const GradientObserverScope&) = delete;
  ~GradientObserverScope() { gradient_observer() = saved_; }

 private:
  GradientObserver* saved_;
};

// One data-parallel step's reduction, its gradients summed while backward still runs (the
// issue's overlap, PyTorch DDP's buckets): all_reduce_step's result, bit for bit where the
// shares are powers of two. The optimiser's parameters are planned once, in reverse order
// (backward's), into units: each gradient of 64 KB or more alone, summed in place in the
// parameter's gradient; runs of smaller ones packed into buckets of the runtime's size. Every
// rank starts the units in that order, each once all its gradients are final: a gradient is
// final when an op that wrote it has ended (gradient_writes_done) and it has been written as
// many times as in the step that recorded the counts (GradientWriteCounter, the first). The
// weights' sum comes first, started before backward: it gives each rank its share of the mean.
// Losses, moving statistics and which gradients each rank wrote follow backward, in a small
// sum of their own; a gradient no rank wrote stays unwritten, as all_reduce_step leaves it.
class OverlappedReduction final : public GradientObserver {
 public:
  struct Unit {
    std::size_t first = 0;  // positions [first, last) in backward order
    std::size_t last = 0;
    bool in_place = false;
    index_t elements = 0;
  };

  // Units of parameters of these sizes, in backward order (the last parameter first).
  static std::vector<Unit> plan(const std::vector<index_t>& sizes, std::size_t bucket_bytes);

  // writes: each parameter's gradient writes in the recorded step; buffers and weights: the
  // sums' storage, kept by the caller between steps (a step that throws leaves its sums to the
  // runtime, which may still write them). `weight` is this rank's weight in the mean
  // (BatchShare).
  OverlappedReduction(DataParallelRuntime& runtime, const std::vector<nn::BasicParameter<float>*>& params,
                      const std::unordered_map<const void*, std::size_t>& index, const std::vector<int>& writes,
                      const std::vector<Unit>& units, std::vector<std::vector<float>>& buffers,
                      std::vector<double>& weights, double weight, bool mean);

  void will_write(const void* parameter) override;

  void writes_done() override;

  // After backward, with no observer set: starts what is left, sums `values` (step_values'
  // losses and buffers) with which gradients each rank wrote, and leaves the sums in the
  // parameters' gradients.
  void finish(std::vector<double>& values);

 private:
  std::size_t position(std::size_t k) const { return params_.size() - 1 - k; }

  void start_ready();

  void start(const Unit& unit, std::vector<float>& buffer);

  DataParallelRuntime& runtime_;
  const std::vector<nn::BasicParameter<float>*>& params_;
  const std::unordered_map<const void*, std::size_t>& index_;
  const std::vector<int>& writes_;
  const std::vector<Unit>& units_;
  std::vector<std::vector<float>>& buffers_;
  std::vector<double>& weights_;  // this rank's weight, then (summed) the ranks'
  bool mean_;
  double weight_;
  float share_ = 1;
  std::vector<int> count_;
  std::vector<bool> final_;
  std::vector<bool> sent_;
  std::vector<std::size_t> written_;
  std::size_t started_ = 0;
};

// The runtime a training step of `who` synchronises through, or nullptr when it trains alone.
// Either half of the set-up without the other is refused: each rank would train on its own.
DUET_DETAIL_COMPILED DataParallelRuntime* training_runtime(std::string_view who);

}  // namespace detail
}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/parallel_impl.hpp"
#endif
