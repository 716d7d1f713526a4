// Training helpers: evaluation of a network over a data set, and a terminal progress bar.
#pragma once

#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <ostream>
#include <ranges>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cell.hpp"
#include "config.hpp"
#include "data.hpp"
#include "parallel.hpp"
#include "tensor.hpp"

namespace duet::train {

struct Metrics {
  double loss = 0;      // mean over samples
  double accuracy = 0;  // top-1, in [0, 1]; NaN where the targets are values, not class indices
  index_t samples = 0;  // those counted: not those whose label is the loss's ignore_index
};

// How many rows of logits have their largest value at the row's label; rows labelled `ignored`
// do not count. The classes are on the last axis, as the class losses take them: logits [B, C]
// with labels [B], a sequence model's [B, L, C] with labels [B, L], one row per token.
template <ElementType T>
index_t correct_predictions(const BasicTensor<T>& logits, const BasicTensor<std::int32_t>& labels,
                            std::optional<std::int32_t> ignored = std::nullopt) {
  const Shape& shape = logits.shape();
  Shape row_shape;
  for (int i = 0; i + 1 < shape.rank(); ++i) row_shape.push_back(shape[i]);
  if (shape.rank() < 2 || labels.shape() != row_shape) {
    throw ShapeError(
        "duet::train::correct_predictions: expects logits with the classes on their last axis and class "
        "labels of their shape without it, got logits " +
        to_string(shape) + " and labels " + to_string(labels.shape()));
  }
  const index_t classes = shape[shape.rank() - 1];
  const index_t rows = labels.numel();
  index_t correct = 0;
  for (index_t r = 0; r < rows; ++r) {
    if (labels.data()[r] == ignored) continue;
    const T* row = logits.data() + r * classes;
    index_t best = 0;
    for (index_t c = 1; c < classes; ++c) {
      if (row[c] > row[best]) best = c;
    }
    correct += best == labels.data()[r] ? 1 : 0;
  }
  return correct;
}

namespace detail {
// Sets a network to evaluation (set_train(false)) for its life, then gives every cell in it
// back its own setting, even when the evaluation throws.
template <class Net>
class EvaluationScope {
 public:
  explicit EvaluationScope(Net& net) {
    for (auto& [path, cell] : net.cells_and_names()) saved_.emplace_back(cell, cell->phase_setting());
    net.set_train(false);
  }
  EvaluationScope(const EvaluationScope&) = delete;
  EvaluationScope& operator=(const EvaluationScope&) = delete;
  ~EvaluationScope() {
    for (auto& [cell, setting] : saved_) cell->restore_phase_setting(setting);
  }

 private:
  using DynamicCell = nn::BasicDynamicCell<typename Net::value_type>;
  std::vector<std::pair<DynamicCell*, typename DynamicCell::PhaseSetting>> saved_;
};
}  // namespace detail

// What evaluate reads: a range of batches (a range-for over it runs one pass), each with
// `images`, what the network takes (any shape, channel count or element type), and `labels`,
// the class indices [B] as BasicTensor<std::int32_t>, or with `inputs` and `targets` so
// (a data::TensorDataset's batches of class indices). data::DataLoader is one; so is a
// std::vector of such structs. An EvaluationLoader's `targets` may also be values the loss
// compares the output with (a regression's), of which there is no accuracy.
template <class B>
concept ImageBatch = requires(B batch) {
  batch.images;
  { batch.labels } -> std::convertible_to<const BasicTensor<std::int32_t>&>;
};
template <class B>
concept ClassIndexBatch = requires(B batch) {
  batch.inputs;
  { batch.targets } -> std::convertible_to<const BasicTensor<std::int32_t>&>;
};
template <class B>
concept TargetBatch = requires(B batch) {
  batch.inputs;
  { tensor_of(batch.targets) };
};
template <class L>
concept ClassificationLoader =
    std::ranges::input_range<L> && (ImageBatch<std::ranges::range_reference_t<L>> ||
                                    ClassIndexBatch<std::ranges::range_reference_t<L>>);
template <class L>
concept EvaluationLoader = ClassificationLoader<L> || (std::ranges::input_range<L> &&
                                                       TargetBatch<std::ranges::range_reference_t<L>>);

namespace detail {
template <class B>
auto inputs_and_labels(const B& batch) {
  if constexpr (ImageBatch<const B&>) return std::tie(batch.images, batch.labels);
  else return std::tie(batch.inputs, batch.targets);
}

// The batches evaluate reads. A range-for over a DataLoader starts its next epoch, so
// evaluating on the training loader between epochs would take the next epoch's order, and the
// training loop's next pass would start the one after it: the loader's epochs, and a run
// resumed with start_epoch, would no longer be what training saw. A copy rewound to the
// loader's current epoch leaves the loader where it was (copies share the images).
template <class Loader>
decltype(auto) one_pass(Loader&& loader) {
  if constexpr (data::is_data_loader_v<std::remove_cvref_t<Loader>>) {
    std::remove_cvref_t<Loader> pass = loader;
    pass.start_epoch(loader.epoch());
    return pass;
  } else {
    return std::forward<Loader>(loader);
  }
}
}  // namespace detail

// One pass over the loader (a DataLoader's current epoch, which it leaves as it was for the
// training loop's next pass, or a temporary range): mean loss per sample and, for class
// indices, accuracy of net (NaN for a regression's targets: a 0 would read as a result, and
// an accuracy of values means nothing). loss_fn reduces by mean (each batch weighs the rows it counted)
// or sum; rows whose label is its ignore_index (nn::CrossEntropyLoss, nn::NLLLoss) count in
// neither, as they do not in training. A loader with no sample is an error. A cell runs in evaluation meanwhile
// (MindSpore's Model.eval sets set_train(False)): Dropout passes its input through, BatchNorm
// uses its moving statistics and leaves them as they are; each cell's setting is restored after.
// A sharded loader's metrics are summed over the ranks (duet/distributed.hpp), so that every
// rank returns the whole data set's; ranks whose networks differ are refused.
template <class Net, class Loss, class Loader>
  requires EvaluationLoader<Loader>
Metrics evaluate(Net& net, Loss& loss_fn, Loader&& loader) {
  duet::detail::DataParallelRuntime* runtime = nullptr;
  if constexpr (requires { loader.options().num_shards; }) {
    if (loader.options().num_shards > 1) {
      runtime = duet::detail::data_parallel_runtime().load(std::memory_order_acquire);
      if (runtime == nullptr) {
        throw ModeError("duet::train::evaluate: the loader is shard " + std::to_string(loader.options().shard_id) +
                        " of " + std::to_string(loader.options().num_shards) +
                        ", but no rank group exists to sum the shards' metrics; call duet::distributed::init()");
      }
      // Metrics summed over ranks whose networks differ describe no network, and look like a result.
      if (const auto where = duet::detail::first_difference_between_ranks(*runtime, net.parameters(), duet::detail::Stream::between_steps)) {
        throw ModeError("duet::train::evaluate: the ranks' networks differ (" + *where +
                        " first), so the sum of their metrics would describe no network. Ranks agree from "
                        "nn::TrainOneStepCell's first step (which gives every rank rank 0's parameters) when every "
                        "step reduces the gradients over the ranks (set_auto_parallel_context(DATA_PARALLEL), or "
                        "distributed::GradReducer in a loop of your own); before that step, build the network "
                        "with the same seed on every rank");
      }
    }
  }
  constexpr bool classifies = ClassificationLoader<Loader>;
  const detail::EvaluationScope<Net> evaluation(net);
  Metrics m;
  double loss_sum = 0;
  index_t correct = 0;
  const auto take = [&](const auto& batch) {
    const auto& [inputs, labels] = detail::inputs_and_labels(batch);
    const auto output = net(inputs);
    const auto& logits = tensor_of(output);
    const index_t rows = classifies ? labels.numel() : tensor_of(labels).dim(0);
    const duet::detail::BatchShare share = duet::detail::batch_share(loss_fn, labels, rows, "duet::train::evaluate");
    const auto loss = static_cast<double>(loss_fn(logits, labels).item());
    loss_sum += share.summed ? loss : loss * share.counted_rows;
    if constexpr (classifies) correct += correct_predictions(logits, labels, duet::detail::ignored_label(loss_fn));
    m.samples += static_cast<index_t>(share.counted_rows);
  };
  for (const auto& batch : detail::one_pass(std::forward<Loader>(loader))) take(batch);
  if (runtime != nullptr) {
    // A last global batch shorter than the ranks is no epoch's batch, but its samples are the
    // data set's: a sharded evaluation of 501 samples on 2 ranks counted 500 (helper-92).
    if constexpr (requires { loader.left_out(); }) {
      if (const auto rest = loader.left_out()) take(*rest);
    }
    double sums[] = {loss_sum, static_cast<double>(correct), static_cast<double>(m.samples)};
    runtime->all_reduce_sum(sums, duet::detail::Stream::between_steps);
    loss_sum = sums[0];
    correct = static_cast<index_t>(sums[1]);
    m.samples = static_cast<index_t>(sums[2]);
  }
  // Loss 0 and accuracy 0 would read as a result.
  if (m.samples == 0) {
    throw ValueError("duet::train::evaluate: the loader gave no sample to evaluate (an empty data set or epoch, or "
                     "every label is the loss's ignore_index)");
  }
  m.loss = loss_sum / static_cast<double>(m.samples);
  m.accuracy = classifies ? static_cast<double>(correct) / static_cast<double>(m.samples)
                          : std::numeric_limits<double>::quiet_NaN();
  return m;
}

// Anything else: one error that says what a loader is, rather than a failed constraint.
template <class Net, class Loss, class Loader>
Metrics evaluate(Net&, Loss&, Loader&&) {
  static_assert(EvaluationLoader<Loader>,
                "duet::train::evaluate: the loader must be a range of batches with .images (the network's input) "
                "and .labels (BasicTensor<std::int32_t>), or .inputs and .targets (a data::TensorDataset's: "
                "class indices, or values to regress), see duet::train::EvaluationLoader");
  return {};
}

// "epoch 2/5 [##########..........]  469/938  loss 0.4127  21034 ex/s  ETA 0:04", redrawn in
// place at most ten times a second, so drawing never costs training time.
class ProgressBar {
 public:
  ProgressBar(std::ostream& out, std::string title, index_t total)
      : out_(out), title_(std::move(title)), total_(total), start_(Clock::now()), last_draw_(start_) {}

  void update(index_t done, double loss, index_t examples);

  // Ends the bar's line.
  void finish() { out_ << '\n'; }

 private:
  using Clock = std::chrono::steady_clock;
  std::ostream& out_;
  std::string title_;
  index_t total_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
};

}  // namespace duet::train

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/train_impl.hpp"
#endif
