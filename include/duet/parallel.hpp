// Data parallelism's settings (MindSpore's set_auto_parallel_context) and the interface through
// which a training step, an optimiser and an evaluation reach the runtime that
// duet/distributed.hpp provides. This header needs no MPI: a program that never includes
// distributed.hpp has no runtime, and asking for DATA_PARALLEL without one is an error.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
  // Replaces the gradients backward pass `pass` left in params by their mean over the ranks,
  // each rank weighted by `samples` (or by their sum), and loss by the samples-weighted mean of
  // the ranks' losses. A parameter some rank's pass reached gets a gradient on every rank.
  virtual void all_reduce_gradients(const std::vector<nn::Parameter*>& params, std::uint64_t pass, Tensor& loss,
                                    double samples, bool mean) = 0;
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
