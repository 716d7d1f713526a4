// Wrappers that turn a network into something to train (MindSpore's nn.WithLossCell and
// nn.TrainOneStepCell).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../autodiff.hpp"
#include "../cell.hpp"
#include "../detail/finite.hpp"
#include "../ops/clip.hpp"
#include "../parallel.hpp"
#include "../random.hpp"

namespace duet::nn {

// loss_fn(backbone(data), label). The backbone is transparent to naming, so the parameters
// keep the names they have in the backbone alone ("dense_relu_sequential.0.weight"), and a
// checkpoint of either loads into the other. It runs in the backbone's mode if that is fixed.
template <class Backbone, class Loss>
class WithLossCell
    : public Cell<WithLossCell<Backbone, Loss>, detail::fixed_mode_of<Backbone>(), typename Backbone::value_type> {
  using T = typename Backbone::value_type;

 public:
  // A backbone built at run time, or with a construct of tensors (PyNative only), cannot be
  // captured into a graph, so neither can this cell.
  static constexpr bool capturable = !RuntimeBuilt<Backbone> && !NonGenericConstruct<Backbone>;

  WithLossCell(Backbone& backbone, Loss& loss_fn) : backbone_(backbone), loss_fn_(loss_fn) {}

  template <class X, class Y>
  auto construct(const X& data, const Y& label) {
    return loss_fn_(backbone_(data), label);
  }

  Backbone& backbone() { return backbone_; }
  Loss& loss_fn() { return loss_fn_; }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    static_assert(std::is_same_v<typename Loss::value_type, T>,
                  "duet::nn::WithLossCell: the loss's element type is not the network's (nn::CrossEntropyLoss and the "
                  "other short names are for float): for a network of double write "
                  "nn::BasicCrossEntropyLoss<Reduction::mean, double>, nn::BasicMSELoss<Reduction::mean, double>, ...");
    visit("", backbone_);
    if constexpr (std::is_same_v<typename Loss::value_type, T>) visit("loss_fn", loss_fn_);
  }
  std::string type_name() const override { return "nn::WithLossCell"; }

 private:
  Backbone& backbone_;
  Loss& loss_fn_;
};

// What a training step does besides forward, backward and update.
struct TrainOneStepConfig {
  // Clip the gradients to this global norm before the update (ops::clip_by_global_norm over
  // every gradient the optimiser reads); none if empty.
  std::optional<double> clip_global_norm{};
  // Clamp each gradient element to [-clip_grad_value, clip_grad_value] before the update
  // (PyTorch's clip_grad_value_); with clip_global_norm too, the values first, then the norm.
  std::optional<double> clip_grad_value{};
};

// One training step per call: forward, loss, backward and the optimiser's update. In graph
// mode the first three are one compiled graph run by one evaluator call; the update follows
// in the same call, over the gradients that run left in the parameters.
//
// In DATA_PARALLEL (duet/distributed.hpp) the first step first gives every rank rank 0's
// parameters and optimiser state, and each step all-reduces the gradients before the update, in both modes, so
// that every rank applies the same update (from the second step on, each as soon as backward
// has finished it: duet::detail::OverlappedReduction); the loss returned is then the global
// batch's.
template <class NetWithLoss, class Optimizer>
class TrainOneStepCell {
  using T = typename NetWithLoss::value_type;

 public:
  TrainOneStepCell(NetWithLoss& net_with_loss, Optimizer& optimizer, TrainOneStepConfig config = {})
      : net_with_loss_(net_with_loss), grad_(net_with_loss, {}, std::nullopt), optimizer_(optimizer), config_(config) {
    if (config_.clip_global_norm) ops::detail::check_clip_norm(*config_.clip_global_norm);
    if (config_.clip_grad_value) ops::detail::check_clip_value(*config_.clip_grad_value);
    // Cells start in evaluation (MindSpore's default); a training step that ran BatchNorm on
    // its moving statistics and Dropout as the identity would train quietly wrong. MindSpore's
    // Model.train sets the network to training before its steps; a step made here does too.
    net_with_loss.set_train(true);
    net_with_loss.ensure_named();
    for (const auto& [path, cell] : net_with_loss.cells_and_names()) {
      if (cell->depends_on_phase()) phase_layers_.push_back(cell);
    }
  }

  // Returns the loss of the batch, before the update. A step that fails or skips its update
  // changes nothing, not even BatchNorm's moving statistics or Dropout's generator. An
  // empty batch is refused: it has no gradient, yet an update would still advance the
  // optimiser (its step count, and momentum moving the parameters). A batch whose loss is NaN
  // or infinite (NaN or Inf inputs, or a model that diverged), or whose gradient is (an
  // operation's gradient overflowed), skips the update, which would write NaN into every
  // parameter and moment for good; the caller sees the loss. Whatever the optimiser's
  // .on_nonfinite, a step skips such an update and counts it here (skipped_steps()).
  template <class... X>
  BasicTensor<T> operator()(const X&... xs) {
    if (((tensor_of(xs).numel() == 0) || ...)) {
      throw ValueError("nn::TrainOneStepCell: the batch is empty; a training step needs at least one sample");
    }
    // A manual validation pass (net.set_train(false)) not undone: the step would train with
    // BatchNorm on its moving statistics and Dropout off, quietly, so it refuses instead. A
    // frozen layer kept in evaluation is meant (PyTorch's fine-tuning recipe: freeze the
    // backbone, then model.train(); backbone.eval()): nothing trains it, and its BatchNorm
    // keeps the statistics it was trained with.
    for (BasicDynamicCell<T>* layer : phase_layers_) {
      if (!layer->training() && !frozen(*layer)) {
        throw ModeError("nn::TrainOneStepCell: " + layer->label() +
                        " is set to evaluate (set_train(false) since this step was made), so the step would "
                        "train with BatchNorm on its moving statistics and Dropout off; call set_train(true) on "
                        "the network before training again (duet::train::evaluate puts the setting back itself). "
                        "A layer frozen with set_requires_grad(false) may stay in evaluation");
      }
    }
    duet::detail::StepScope step;
    duet::detail::DataParallelRuntime* parallel = duet::detail::training_runtime("nn::TrainOneStepCell");
    if (parallel != nullptr && !parameters_broadcast_) {
      if constexpr (std::same_as<T, float>) {
        start_data_parallel(*parallel, xs...);
      } else {
        throw ModeError("nn::TrainOneStepCell: DATA_PARALLEL trains float networks only");
      }
      parameters_broadcast_ = true;
    }
    BasicTensor<T> loss;
    if constexpr (std::same_as<T, float>) {
      if (parallel != nullptr && parallel->overlaps_backward()) {
        loss = overlapped_step(*parallel, xs...);
      } else {
        loss = grad_.value_and_parameter_grads(xs...);
      }
    } else {
      loss = grad_.value_and_parameter_grads(xs...);
    }
    if (weights_checked_) {
      autodiff::detail::check_weights_reached(optimizer_.parameters(), nullptr, "nn::TrainOneStepCell");
    } else {
      autodiff::detail::check_weights_reached(optimizer_.parameters(), &net_with_loss_, "nn::TrainOneStepCell");
      weights_checked_ = true;
    }
    if constexpr (std::same_as<T, float>) {
      // Before the finiteness check: a NaN on one rank must skip the update on all of them.
      if (parallel != nullptr) all_reduce(*parallel, loss, xs...);
      overlapped_.reset();
    }
    if (duet::detail::first_nonfinite(loss.data(), loss.numel()) >= 0) return skipped(loss, "the loss is not finite");
    // Clipping reads the gradients backward left, the same in both modes, so both clip alike.
    // A gradient whose norm is not finite skips the update, as a NaN loss does; the norm is
    // kept for the caller to see (last_global_norm). A parameter frozen after the optimiser
    // was made still gets a gradient, which the update skips: so does the norm, as PyTorch's
    // clip_grad_norm_ sees only the gradients of what it trains.
    // Clamping a NaN leaves it NaN: such a gradient skips the update too. A finite loss can
    // still have a gradient that is not (an operation whose gradient overflowed): unclipped, the
    // optimiser's own check finds it and the step skips it too; clipped, the clipping found it.
    const bool clipped = config_.clip_global_norm || config_.clip_grad_value;
    if (clipped) {
      const std::uint64_t pass = duet::detail::current_backward_pass();
      std::vector<BasicTensor<T>*> grads;
      for (BasicParameter<T>* p : optimizer_.parameters()) {
        if (p->requires_grad && p->has_grad_from(pass)) grads.push_back(&p->grad);
      }
      if (config_.clip_grad_value && !ops::detail::clamp_in_place(grads, *config_.clip_grad_value)) {
        return skipped(loss, "a gradient is not finite");
      }
      if (config_.clip_global_norm) {
        last_global_norm_ = ops::detail::clip_in_place(grads, *config_.clip_global_norm);
        if (!std::isfinite(last_global_norm_)) return skipped(loss, "the gradients' global norm is not finite");
      }
    }
    if constexpr (requires { optimizer_.step_unless_nonfinite(clipped); }) {
      if (const auto bad = optimizer_.step_unless_nonfinite(clipped)) return skipped(loss, *bad);
    } else {
      optimizer_.step();
    }
    step.commit();
    return loss;
  }

  Optimizer& optimizer() { return optimizer_; }
  // The global norm of the last step's gradients before clipping; NaN before the first step.
  // A step without clip_global_norm measures none, and asking is an error rather than a 0 that
  // reads as gradients of zero.
  double last_global_norm() const {
    if (!config_.clip_global_norm) {
      throw ModeError("nn::TrainOneStepCell::last_global_norm: this step clips no global norm, so it measures none; "
                      "make it with {.clip_global_norm = c} (PyTorch's clip_grad_norm_ returns the norm it clips "
                      "by), or take value_and_grad's gradients and ops::global_norm(grads)");
    }
    return last_global_norm_;
  }
  // How many steps skipped their update (a loss, a gradient or a gradient norm not finite).
  std::int64_t skipped_steps() const { return skipped_steps_; }

 private:
  // A layer with parameters, none of which trains (BatchNorm's moving statistics never do).
  static bool frozen(BasicDynamicCell<T>& layer) {
    const std::vector<NamedParameter<T>> params = layer.parameters();
    return !params.empty() && std::ranges::none_of(params, [](const NamedParameter<T>& p) { return p.parameter->requires_grad; });
  }

  // A skipped update keeps the parameters finite, but a network that diverged, or a loss
  // written without the clamp PyTorch's BCELoss has (log of a saturated sigmoid), would skip
  // every step and train on in silence: the first skip is said on std::cerr.
  BasicTensor<T> skipped(const BasicTensor<T>& loss, std::string_view what) {
    if (skipped_steps_++ == 0) {
      std::cerr << "duet: warning: nn::TrainOneStepCell: " << what << " (loss " << loss.values()[0]
                << "), so this step skipped its update, as every such step will (said once; "
                   "skipped_steps() counts them)\n";
    }
    return loss;
  }

  // The first data-parallel step: every rank gets rank 0's parameters and optimiser state, and
  // a loader that gives every rank the same batches (not sharded) is refused: the ranks would
  // repeat one another.
  template <class... X>
  void start_data_parallel(duet::detail::DataParallelRuntime& parallel, const X&... xs) {
    const std::vector<NamedParameter<float>> params = net_with_loss_.parameters();
    parallel.broadcast_parameters(params);
    broadcast_optimizer_state(parallel, params);
    broadcast_generators(parallel);
    for (const auto& p : params) {
      if (!p.parameter->requires_grad) buffers_.push_back(p.parameter);
    }
    std::uint64_t hash = duet::detail::fnv1a({});
    ((hash = duet::detail::fnv1a(duet::detail::tensor_bytes(tensor_of(xs)), hash)), ...);
    duet::detail::require_sharded_data(parallel, hash, true, "nn::TrainOneStepCell", "DATA_PARALLEL, but the first batch is");
  }

  // Rank 0's moments and step count, as its parameters: a checkpoint is saved by rank 0 alone,
  // and resumed there alone it would leave the other ranks' moments at zero, each rank then
  // updating the same weights its own way from the first step on, with the same losses printed.
  void broadcast_optimizer_state(duet::detail::DataParallelRuntime& parallel,
                                 const std::vector<NamedParameter<float>>& params) {
    const std::vector<BasicParameter<float>*>& order = optimizer_.parameters();
    const auto name_of = [&](std::size_t i) {
      const auto named = std::ranges::find(params, order[i], &NamedParameter<float>::parameter);
      return named != params.end() ? named->name : "parameter " + std::to_string(i);
    };
    // The state's tensors moved into parameters for broadcast_parameters (which also refuses
    // ranks whose optimisers differ), then back.
    const auto slots = optimizer_.state();
    std::vector<BasicParameter<float>> held;
    std::vector<NamedParameter<float>> named;
    for (const auto& slot : slots) {
      for (std::size_t i = 0; i < slot.tensors->size(); ++i) {
        held.emplace_back(std::move((*slot.tensors)[i]));
        named.push_back({std::string(slot.name) + "." + name_of(i), nullptr});
      }
    }
    for (std::size_t k = 0; k < held.size(); ++k) named[k].parameter = &held[k];
    const auto put_back = [&] {
      std::size_t k = 0;
      for (const auto& slot : slots) {
        for (BasicTensor<float>& tensor : *slot.tensors) tensor = std::move(static_cast<BasicTensor<float>&>(held[k++]));
      }
    };
    try {
      parallel.broadcast_parameters(named);
    } catch (...) {
      put_back();
      throw;
    }
    put_back();
    double step[] = {parallel.rank() == 0 ? static_cast<double>(optimizer_.global_step()) : 0.0};
    parallel.all_reduce_sum(step, duet::detail::Stream::steps);
    optimizer_.set_global_step(static_cast<std::int64_t>(step[0]));
  }

  // Rank 0's Dropout generators, for the same reason: resumed on rank 0 alone, the other ranks
  // would draw the masks of freshly built layers, not those the run that saved it would have.
  // Each travels as a parameter "generator.<path>" of its state's 16-bit pieces (exact in
  // floats) through broadcast_parameters, which also refuses ranks whose Dropout layers differ.
  void broadcast_generators(duet::detail::DataParallelRuntime& parallel) {
    constexpr int words = 4 + 1;  // the xoshiro words, then the pending draw's bits
    constexpr index_t pieces = 4 * words + 1;  // and the pending flag
    const auto generators = duet::detail::named_generators(net_with_loss_);
    std::vector<BasicParameter<float>> held;
    held.reserve(generators.size());
    std::vector<NamedParameter<float>> named;
    for (const auto& [name, generator] : generators) {
      const GeneratorState state = generator->state();
      std::uint64_t bits[words] = {state.words[0], state.words[1], state.words[2], state.words[3],
                                   std::bit_cast<std::uint64_t>(state.spare)};
      BasicTensor<float> t = zeros<float>({pieces});
      for (int w = 0; w < words; ++w) {
        for (int piece = 0; piece < 4; ++piece) t.data()[4 * w + piece] = static_cast<float>((bits[w] >> (16 * piece)) & 0xFFFF);
      }
      t.data()[pieces - 1] = state.has_spare ? 1.0f : 0.0f;
      held.emplace_back(std::move(t));
      named.push_back({name, nullptr});
    }
    for (std::size_t i = 0; i < held.size(); ++i) named[i].parameter = &held[i];
    parallel.broadcast_parameters(named);
    for (std::size_t i = 0; i < held.size(); ++i) {
      const float* v = held[i].data();
      std::uint64_t bits[words] = {};
      for (int w = 0; w < words; ++w) {
        for (int piece = 0; piece < 4; ++piece) bits[w] |= static_cast<std::uint64_t>(v[4 * w + piece]) << (16 * piece);
      }
      GeneratorState state{{bits[0], bits[1], bits[2], bits[3]}, v[pieces - 1] != 0, std::bit_cast<double>(bits[4])};
      generators[i].generator->set_state(state);
    }
  }

  // What this rank's batch weighs in the global batch.
  template <class... X>
  duet::detail::BatchShare batch_share(const X&... xs) const {
    const auto inputs = std::forward_as_tuple(xs...);
    const index_t rows = tensor_of(std::get<0>(inputs)).dim(0);
    duet::detail::BatchShare share{.summed = false, .counted_rows = static_cast<double>(rows),
                                   .rows = static_cast<double>(rows)};
    if constexpr (requires { net_with_loss_.loss_fn(); } && sizeof...(X) == 2) {
      share = duet::detail::batch_share(net_with_loss_.loss_fn(), tensor_of(std::get<1>(inputs)), rows,
                                        "nn::TrainOneStepCell");
    }
    return share;
  }

  // Forward and backward with the gradients' sums started as they become final
  // (duet::detail::OverlappedReduction), from the second step on; the first counts how often
  // backward writes each gradient.
  template <class... X>
  BasicTensor<float> overlapped_step(duet::detail::DataParallelRuntime& parallel, const X&... xs) {
    const std::vector<BasicParameter<float>*>& params = optimizer_.parameters();
    if (!writes_recorded_) {
      if (gradient_index_.empty()) {
        std::vector<index_t> sizes;
        for (std::size_t i = 0; i < params.size(); ++i) {
          gradient_index_.emplace(params[i], i);
          sizes.push_back(params[i]->numel());
        }
        units_ = duet::detail::OverlappedReduction::plan(sizes, parallel.bucket_bytes());
      }
      std::vector<int> writes;
      duet::detail::GradientWriteCounter counter(gradient_index_, writes);
      BasicTensor<float> loss;
      {
        const duet::detail::GradientObserverScope scope(&counter);
        loss = grad_.value_and_parameter_grads(xs...);
      }
      writes_ = std::move(writes);
      writes_recorded_ = true;
      return loss;
    }
    const duet::detail::BatchShare share = batch_share(xs...);
    const bool weighted = get_auto_parallel_context().gradients_mean && !share.summed;
    overlapped_.emplace(parallel, params, gradient_index_, writes_, units_, overlap_buffers_, overlap_weights_,
                        weighted ? share.counted_rows : 1.0, weighted);
    const duet::detail::GradientObserverScope scope(&*overlapped_);
    return grad_.value_and_parameter_grads(xs...);
  }

  // The gradients backward left, the loss and the moving statistics become the global batch's.
  template <class... X>
  void all_reduce(duet::detail::DataParallelRuntime& parallel, BasicTensor<float>& loss, const X&... xs) {
    if (loss.numel() != 1) {
      throw ModeError("nn::TrainOneStepCell: DATA_PARALLEL combines the ranks' losses, which needs each reduced to "
                      "one number; this loss has shape " + to_string(loss.shape()));
    }
    const duet::detail::BatchShare share = batch_share(xs...);
    if (overlapped_) {
      const bool weighted = get_auto_parallel_context().gradients_mean && !share.summed;
      std::vector<double> values = duet::detail::step_values(loss.values(), buffers_, share, weighted);
      overlapped_->finish(values);
      duet::detail::apply_step_values(values, loss.values(), buffers_, share);
      duet::detail::all_reduced_backward_pass() = duet::detail::current_backward_pass();
      return;
    }
    const std::uint64_t pass = duet::detail::current_backward_pass();
    const std::vector<BasicParameter<float>*>& params = optimizer_.parameters();
    std::vector<duet::detail::GradientView> grads;
    grads.reserve(params.size());
    for (const BasicParameter<float>* p : params) {
      grads.push_back({p->has_grad_from(pass) ? p->grad.data() : nullptr, p->numel()});
    }
    duet::detail::all_reduce_step(
        parallel, grads,
        [&](std::size_t i) {
          bool accumulate = false;
          return params[i]->grad_for_write(pass, &accumulate);
        },
        loss.values(), buffers_, share, get_auto_parallel_context().gradients_mean);
    duet::detail::all_reduced_backward_pass() = pass;
  }

  NetWithLoss& net_with_loss_;
  GradFunction<NetWithLoss&, void, InputGradient::none> grad_;
  Optimizer& optimizer_;
  TrainOneStepConfig config_;
  double last_global_norm_ = std::numeric_limits<double>::quiet_NaN();
  std::int64_t skipped_steps_ = 0;
  bool parameters_broadcast_ = false;
  bool weights_checked_ = false;  // the network's parameters against those its first step wrote
  std::vector<BasicDynamicCell<T>*> phase_layers_;  // BatchNorm, Dropout: they must still train
  std::vector<BasicParameter<float>*> buffers_;  // parameters nothing trains: moving statistics
  // DATA_PARALLEL with overlap_backward: the optimiser's parameters' places, their units, how
  // often the first step's backward wrote each gradient, the sums' storage, this step's sums.
  std::unordered_map<const void*, std::size_t> gradient_index_;
  std::vector<duet::detail::OverlappedReduction::Unit> units_;
  std::vector<int> writes_;
  bool writes_recorded_ = false;
  std::vector<std::vector<float>> overlap_buffers_;
  std::vector<double> overlap_weights_;
  std::optional<duet::detail::OverlappedReduction> overlapped_;
};

}  // namespace duet::nn
