// Data parallelism's settings (MindSpore's set_auto_parallel_context) and the interface through
// which a training step, an optimiser and an evaluation reach the runtime that
// duet/distributed.hpp provides. This header needs no MPI: a program that never includes
// distributed.hpp has no runtime, and asking for DATA_PARALLEL without one is an error.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend.hpp"
#include "error.hpp"
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
}  // namespace detail

inline void set_auto_parallel_context(const AutoParallelConfig& config) {
  if (config.parallel_mode) {
    if (*config.parallel_mode != ParallelMode::STAND_ALONE && *config.parallel_mode != ParallelMode::DATA_PARALLEL) {
      throw ValueError("duet::set_auto_parallel_context: parallel_mode must be STAND_ALONE or DATA_PARALLEL");
    }
    detail::parallel_mode().store(*config.parallel_mode, std::memory_order_relaxed);
  }
  if (config.gradients_mean) detail::gradients_mean().store(*config.gradients_mean, std::memory_order_relaxed);
}

inline AutoParallelContext get_auto_parallel_context() {
  return {detail::parallel_mode().load(std::memory_order_relaxed),
          detail::gradients_mean().load(std::memory_order_relaxed)};
}

namespace detail {

// 64-bit FNV-1a, continuing from h: what ranks compare in one collective (their networks'
// descriptions, their first batches) is hashed first.
inline std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h = 14695981039346656037ull) {
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// A gradient a rank contributes to an all-reduce.
struct GradientView {
  const float* data = nullptr;  // nullptr: none this step
  index_t size = 0;
};

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
  virtual bool same_on_every_rank(std::uint64_t hash) = 0;
  // Each value becomes its sum over the ranks.
  virtual void all_reduce_sum(std::span<double> values) = 0;
};

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
inline void all_reduce_step(DataParallelRuntime& runtime, std::span<const GradientView> grads,
                            const std::function<float*(std::size_t)>& write, std::span<float> loss,
                            const std::vector<nn::Parameter*>& buffers, const BatchShare& share, bool gradients_mean) {
  const bool weighted = gradients_mean && !share.summed;
  const double loss_weight = share.summed ? 1.0 : share.counted_rows;
  // [gradient weight, loss weight, rows, weighted losses..., weighted buffers...]
  std::vector<double> values{weighted ? share.counted_rows : 1.0, loss_weight, share.rows};
  for (const float l : loss) values.push_back(static_cast<double>(l) * loss_weight);
  for (const nn::Parameter* b : buffers) {
    for (const float v : b->values()) values.push_back(static_cast<double>(v) * share.rows);
  }
  runtime.all_reduce_gradients(grads, values, weighted, write);
  const double counted = values[1];
  std::size_t k = 3;
  for (float& l : loss) {
    const double sum = values[k++];
    l = static_cast<float>(share.summed ? sum : counted > 0 ? sum / counted : 0.0);
  }
  for (nn::Parameter* b : buffers) {
    // Non-const data() moves the version, so what was made from the old values is made again.
    for (float& v : b->values()) {
      v = static_cast<float>(values[k++] / values[2]);
    }
  }
}

// The runtime a training step of `who` synchronises through, or nullptr when it trains alone.
// Either half of the set-up without the other is refused: each rank would train on its own.
inline DataParallelRuntime* training_runtime(std::string_view who) {
  DataParallelRuntime* runtime = data_parallel_runtime().load(std::memory_order_acquire);
  const bool data_parallel = parallel_mode().load(std::memory_order_relaxed) == ParallelMode::DATA_PARALLEL;
  if (data_parallel && runtime == nullptr) {
    throw ModeError(std::string(who) +
                    ": the parallel mode is DATA_PARALLEL but no rank group exists; include <duet/distributed.hpp> "
                    "and call duet::distributed::init() first");
  }
  if (!data_parallel && runtime != nullptr && runtime->group_size() > 1) {
    throw ModeError(std::string(who) + ": duet::distributed::init() joined " + std::to_string(runtime->group_size()) +
                    " ranks but the parallel mode is STAND_ALONE, so each rank would train its own network; call "
                    "duet::set_auto_parallel_context({.parallel_mode = duet::ParallelMode::DATA_PARALLEL})");
  }
  return data_parallel ? runtime : nullptr;
}

}  // namespace detail
}  // namespace duet
