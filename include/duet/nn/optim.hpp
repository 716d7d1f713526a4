// Optimisers and learning-rate schedules (MindSpore's nn.SGD, nn.Adam, AdamW and nn.*LR).
//
// An optimiser updates its parameters from the gradients the last backward pass on this
// thread left in them (step()), or from a list of gradients (operator(), as MindSpore calls
// optimisers). Its state (momentum, Adam's moments) is made once, so steps do not allocate.
// state() and set_global_step expose that state for checkpoints (duet::save_checkpoint(net,
// path, optimizer)), which is how training resumes. A step whose gradients hold a NaN or an
// infinity changes nothing, and is refused (a duet::ValueError) or skipped and counted
// (.on_nonfinite, NonFiniteGradient).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <numbers>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend.hpp"
#include "../detail/finite.hpp"
#include "../error.hpp"
#include "../parallel.hpp"
#include "../parameter.hpp"
#include "../print.hpp"
#include "../tensor.hpp"
#include "../threads.hpp"

namespace duet::nn {

// The learning rate at global step t (0 for the first step).
using LearningRateSchedule = std::function<double(std::int64_t step)>;

// A constant rate or a schedule, so that `.learning_rate = 1e-3` and
// `.learning_rate = CosineDecayLR{...}` both read naturally.
class LearningRate {
 public:
  LearningRate(double constant)
      : schedule_([constant](std::int64_t) { return constant; }) {}  // NOLINT: implicit by design
  template <class F>
  requires std::is_invocable_r_v<double, F, std::int64_t> LearningRate(F schedule)
      : schedule_(std::move(schedule)) {}  // NOLINT: implicit by design
  double at(std::int64_t step) const { return schedule_(step); }

 private:
  LearningRateSchedule schedule_;
};

namespace detail {
// A schedule's step count divides: 0 would make every rate NaN, which the optimiser would then
// report as a bad learning rate rather than naming the field.
inline void require_steps(const char* schedule, const char* field, std::int64_t steps) {
  if (steps <= 0) {
    throw ValueError(std::string("nn::") + schedule + ": " + field + " must be positive, got " + std::to_string(steps));
  }
}
}  // namespace detail

// min_lr + (max_lr - min_lr) · (1 + cos(π · min(t, decay_steps) / decay_steps)) / 2.
struct CosineDecayLR {
  double min_lr;
  double max_lr;
  std::int64_t decay_steps;
  double operator()(std::int64_t t) const {
    detail::require_steps("CosineDecayLR", "decay_steps", decay_steps);
    const double p = static_cast<double>(std::min(t, decay_steps)) / static_cast<double>(decay_steps);
    return min_lr + (max_lr - min_lr) * (1 + std::cos(std::numbers::pi * p)) / 2;
  }
};

// lr · decay_rate^(t / decay_steps), the exponent floored if is_stair.
struct ExponentialDecayLR {
  double learning_rate;
  double decay_rate;
  std::int64_t decay_steps;
  bool is_stair = false;
  double operator()(std::int64_t t) const {
    detail::require_steps("ExponentialDecayLR", "decay_steps", decay_steps);
    double p = static_cast<double>(t) / static_cast<double>(decay_steps);
    if (is_stair) p = std::floor(p);
    return learning_rate * std::pow(decay_rate, p);
  }
};

// values[i] while t < milestones[i]; the last value after the last milestone.
struct PiecewiseConstantLR {
  std::vector<std::int64_t> milestones;
  std::vector<double> values;
  double operator()(std::int64_t t) const {
    if (values.empty() || values.size() < milestones.size()) {
      throw ValueError("nn::PiecewiseConstantLR: values must hold one rate per milestone (and one for after the "
                       "last), got " + std::to_string(values.size()) + " for " + std::to_string(milestones.size()) +
                       " milestones");
    }
    for (std::size_t i = 0; i < milestones.size(); ++i) {
      if (t < milestones[i]) return values.at(i);
    }
    return values.back();
  }
};

// lr · min(t, warmup_steps) / warmup_steps: MindSpore's WarmUpLR, whose first step (t = 0)
// has rate 0, so that a schedule ported from MindSpore gives the same numbers.
struct WarmUpLR {
  double learning_rate;
  std::int64_t warmup_steps;
  double operator()(std::int64_t t) const {
    detail::require_steps("WarmUpLR", "warmup_steps", warmup_steps);
    return learning_rate * static_cast<double>(std::min(t, warmup_steps)) / static_cast<double>(warmup_steps);
  }
};

namespace detail {
// PyTorch's names of the optimisers' fields, there only so that writing them says duet's names
// (MindSpore's) instead of "no matching constructor" without a word about the field.
struct TorchLr {
  TorchLr() = default;
  template <class V>
  TorchLr(const V&) {  // NOLINT: implicit, as a designated initializer converts
    static_assert(sizeof(V) == 0,
                  "duet::nn: the learning rate is .learning_rate (MindSpore's name), not PyTorch's .lr: "
                  "{.learning_rate = 1e-3}");
  }
};
struct TorchBetas {
  TorchBetas() = default;
  template <class V>
  TorchBetas(std::initializer_list<V>) {  // NOLINT: implicit, as a designated initializer converts
    static_assert(sizeof(V) == 0,
                  "duet::nn::Adam: PyTorch's betas=(b1, b2) are two fields, MindSpore's: {.beta1 = b1, .beta2 = b2}");
  }
};
}  // namespace detail

// Which parameters an optimiser's weight decay applies to, by name and shape, as PyTorch's
// parameter groups are mostly used: `[](std::string_view, const Shape& s) { return s.rank() >= 2; }`
// decays the weight matrices and kernels, not the biases or the norms' scales.
using DecayFilter = std::function<bool(std::string_view name, const Shape& shape)>;

// Parameters with a learning rate or weight decay of their own (PyTorch's param_groups,
// MindSpore's group_params): a pretrained backbone at a tenth of the head's rate,
//   nn::Adam adam({{.params = net.backbone.parameters(), .learning_rate = 1e-4},
//                  {.params = net.head.parameters()}},
//                 {.learning_rate = 1e-3});
// What a group leaves unset is the optimiser's setting; .decays still chooses, in every group,
// the parameters its weight decay applies to.
template <ElementType T>
struct BasicParameterGroup {
  std::vector<NamedParameter<T>> params;
  [[no_unique_address]] detail::TorchLr lr{};  // refused: PyTorch's 'lr'
  std::optional<LearningRate> learning_rate{};
  std::optional<double> weight_decay{};
};
using ParameterGroup = BasicParameterGroup<float>;

// What an optimiser is given: a network's parameters (net.parameters(), whose names .decays and
// checkpoints go by), groups of them, or parameters without names.
template <ElementType T>
struct ParametersToTrain {
  ParametersToTrain(const std::vector<NamedParameter<T>>& params) : groups(1) {  // NOLINT: implicit by design
    groups.front().params = params;
  }
  ParametersToTrain(std::vector<BasicParameterGroup<T>> g) : groups(std::move(g)) {}  // NOLINT
  ParametersToTrain(std::vector<BasicParameter<T>*> params) : unnamed(std::move(params)) {}  // NOLINT
  // A network of another element type: said here, where it is one line, rather than as the
  // optimiser's "no matching function" with its candidates.
  template <ElementType U>
    requires(!std::is_same_v<U, T>)
  ParametersToTrain(const std::vector<NamedParameter<U>>&) {  // NOLINT
    static_assert(std::is_same_v<U, T>,
                  "duet::nn: the optimiser's element type is not the parameters' (nn::Adam, nn::AdamW and nn::SGD "
                  "are for float): for a network of double write nn::BasicAdam<double> (AdamW: "
                  "nn::BasicAdam<double, true>) or nn::BasicSGD<double>");
  }

  std::vector<BasicParameterGroup<T>> groups;
  std::vector<BasicParameter<T>*> unnamed;
};

// What an optimiser does with a gradient holding a NaN or an infinity (.on_nonfinite). Either
// way the step changes nothing: no parameter, no moment or momentum, not the step count. Applied,
// such a gradient would make every weight NaN for good, the loss printing nan from then on with
// no word of where it began.
enum class NonFiniteGradient {
  raise,  // a duet::ValueError naming the parameter and its first bad element (the default)
  skip,   // skip the step and count it (skipped_steps()), said once on std::cerr: for loss scaling
};

// One kind of state an optimiser keeps per parameter ("moment1"): tensors[i] belongs to
// parameters()[i] and has its shape.
template <ElementType T>
struct OptimizerSlot {
  std::string_view name;
  std::vector<BasicTensor<T>>* tensors;
};

template <ElementType T>
class BasicOptimizer {
 public:
  // lr is the rate of the groups that set none.
  BasicOptimizer(const ParametersToTrain<T>& given, const LearningRate& lr);
  BasicOptimizer(const BasicOptimizer&) = delete;
  BasicOptimizer& operator=(const BasicOptimizer&) = delete;
  virtual ~BasicOptimizer() = default;

  // Updates every parameter the calling thread's last backward pass reached.
  void step() {
    if (const auto bad = step_unless_nonfinite(false)) on_nonfinite(*bad);
  }

  // step() for nn::TrainOneStepCell, which skips and counts such steps itself: the gradients
  // are checked unless they are known to be finite (clipping measured them), and one that is
  // not changes nothing and is returned, for the caller to say.
  std::optional<std::string> step_unless_nonfinite(bool known_finite);

  // MindSpore's optimizer(grads): one gradient per parameter, in order.
  void operator()(const std::vector<BasicTensor<T>>& grads);

  const std::vector<BasicParameter<T>*>& parameters() const { return params_; }
  std::int64_t global_step() const { return global_step_; }
  // How many steps a non-finite gradient skipped (.on_nonfinite = NonFiniteGradient::skip).
  std::int64_t skipped_steps() const { return skipped_steps_; }
  // The rate the next step uses, in a parameter group (the first, or the only one).
  double learning_rate(std::size_t group = 0) const;
  std::size_t group_count() const { return groups_.size(); }

  // Replaces the rate (a number or a schedule) of every group, or of one: PyTorch's
  // param_groups[g]['lr'] = v, and a ReduceLROnPlateau of one's own,
  // adam.set_learning_rate(adam.learning_rate() * 0.1). Refused as at construction, changing nothing.
  void set_learning_rate(const LearningRate& lr) {
    for (std::size_t g = 0; g < groups_.size(); ++g) set_learning_rate(lr, g);
  }
  void set_learning_rate(const LearningRate& lr, std::size_t group);
  // The group of parameters()[i].
  std::size_t group_of(std::size_t i) const { return group_of_[i]; }

  // What the optimiser is, as checkpoints record it: "nn::Adam".
  virtual std::string_view type_name() const = 0;
  // Its state besides the step count, by kind (MindSpore names them "moment1", "moment2", ...).
  virtual std::vector<OptimizerSlot<T>> state() = 0;
  // Where a resumed run continues: the step count drives bias correction and schedules.
  void set_global_step(std::int64_t step);

 protected:
  // A bad hyper-parameter is refused where it is written, not found later as a loss that
  // diverges or never moves: "nn::Adam: learning_rate must be >= 0, got -1". Every optimiser
  // checks its options through this, from its constructor (type_name() names it there).
  // The options are given as doubles and applied in T: a rate of 1e39 is a finite double but an
  // infinite float, and its first step wrote inf into every weight.
  void require_option(std::string_view option, double value, bool valid, std::string_view rule,
                      std::string_view when = {}) const;
  static bool holds_in_T(double value) {
    return std::isfinite(value) && std::abs(value) <= static_cast<double>(std::numeric_limits<T>::max());
  }
  // A schedule is a function, so its rate is checked at every step as well as at construction.
  void require_learning_rate() const;

  // The weight decay of each group: its own, or the optimiser's `fallback`, checked as an option.
  std::vector<double> group_weight_decays(double fallback) const;

  // Computes what is shared by all parameters this step.
  virtual void begin_step() = 0;
  virtual void update(std::size_t i, const T* grad) = 0;

  // Per parameter, whether weight decay applies to it: empty when to all (no filter).
  std::vector<bool> decay_mask(const DecayFilter& decays) const;

  // A zero state tensor per parameter (moments, momentum buffers).
  std::vector<BasicTensor<T>> zero_state() const;

  std::vector<BasicParameter<T>*> params_;
  std::vector<std::string> names_;  // params_' names, when the optimizer was given them
  std::vector<std::uint32_t> group_of_;  // params_' groups
  std::int64_t global_step_ = 0;
  NonFiniteGradient on_nonfinite_ = NonFiniteGradient::raise;  // set by each optimiser's config

 private:
  // Every gradient the step would apply, checked before anything changes (a parameter updated
  // before a later one's NaN were found could not be put back): the first NaN or infinity, said
  // with the parameter's name and the element's index, or nothing.
  template <class Applied, class Grad>
  std::optional<std::string> first_nonfinite_gradient(const Applied& applied, const Grad& grad) const {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!applied(i)) continue;
      const T* g = grad(i);
      const index_t k = first_nonfinite_on_threads(g, params_[i]->numel());
      if (k < 0) continue;
      // A weight already infinite (an earlier update overflowed it) makes such gradients: said,
      // since the gradient is then not where the trouble began. Looked at only on this path.
      const T* w = params_[i]->data();
      const index_t bad_weight = duet::detail::first_nonfinite(w, params_[i]->numel());
      return "the gradient of parameter #" + std::to_string(i) + (names_.empty() ? "" : " '" + names_[i] + "'") +
             " is " + duet::detail::nonfinite_kind(g[k]) + " at element " + std::to_string(k) + " of " +
             to_string(params_[i]->shape()) +
             (bad_weight < 0 ? ""
                             : std::string(", and the parameter itself is already ") +
                                   duet::detail::nonfinite_kind(w[bad_weight]) + " at element " +
                                   std::to_string(bad_weight) + " (an update that overflowed, or an assignment)");
    }
    return std::nullopt;
  }

  // A large gradient is checked on the threads its update runs on: on one, the check would be
  // a larger share of the step the more threads shorten the update.
  static index_t first_nonfinite_on_threads(const T* g, index_t n);

  // A step refused or skipped (what: first_nonfinite_gradient's), having changed nothing.
  void on_nonfinite(const std::string& what);

  std::int64_t skipped_steps_ = 0;

  // Freezing works both ways, as a PyTorch user expects. A parameter whose requires_grad is
  // cleared after the optimiser was made stays where it is (and keeps its state), as PyTorch
  // skips a parameter without a gradient: the update loops test the flag. One that had no
  // requires_grad when the optimiser was made is not among those it trains, and setting the
  // flag later cannot add it: that is refused, rather than leaving it untrained in silence, and
  // so is a step with every parameter frozen (PyTorch's backward would have refused it).
  void require_left_out_frozen() const;

  // Gradients are matched to parameters by position and shape, so another network's of the
  // same shapes, or a list in another order (groups reorder the parameters), would be applied
  // to the wrong parameters, and training would go on, wrong. Those value_and_grad returned
  // know whose they are (BasicTensor::gradient_of, kept by copies and in-place changes); others
  // (made by the program: ops::clip_by_value's) are taken as they come.
  void require_own_gradients(const std::vector<BasicTensor<T>>& grads) const;

  // In DATA_PARALLEL an update must use gradients all-reduced across the ranks (nn::TrainOneStepCell
  // does it), or each rank would move its parameters its own way, with no error anywhere.
  // Outside it, with ranks joined by distributed::init(), that is what happens, and what a
  // program that forgot both set_auto_parallel_context and GradReducer does: said once on
  // std::cerr, unless the program set STAND_ALONE itself (ranks that each train their own
  // network on purpose).
  // A step applies what the thread's last backward pass wrote: before any, or after one that
  // reached none of these parameters (another network's), it would change nothing but the
  // step count (before 2026-12-07 a step before any backward pass read null gradients).
  void require_gradient_from(std::uint64_t pass) const;

  void require_all_reduced(std::uint64_t pass, const char* call);

  // The first update from distributed::GradReducer's gradients: every rank updates the same
  // parameters from the same gradients, so states that differ (a checkpoint's optimiser state
  // loaded on some ranks only; nn::TrainOneStepCell gives every rank rank 0's itself) would move
  // them apart from this step on, with the same losses printed everywhere.
  void require_same_state_on_every_rank();

  struct Group {
    LearningRate learning_rate;
    std::optional<double> weight_decay;  // unset: the optimiser's
  };
  std::vector<Group> groups_;

  // Parameter j of group g must not come earlier, in its group or another: PyTorch refuses it
  // too (which group's rate would it take?).
  static void require_in_one_group(const std::vector<BasicParameterGroup<T>>& groups, std::size_t g, std::size_t j);

  std::vector<NamedParameter<T>> left_out_;
  bool ranks_checked_ = false;
  bool warned_unreduced_ = false;

  // Whether grads are those distributed::GradReducer returned since the last backward pass
  // (their elements, since the vector may have been copied).
  static bool is_all_reduced_set(const std::vector<BasicTensor<T>>& grads);
};

template <ElementType T>
BasicOptimizer<T>::BasicOptimizer(const ParametersToTrain<T>& given, const LearningRate& lr) {
  if (given.groups.empty()) {
    params_ = given.unnamed;
    group_of_.assign(params_.size(), 0);
    groups_.push_back({lr, std::nullopt});
  }
  std::size_t count = params_.size();
  const auto& groups = given.groups;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const BasicParameterGroup<T>& group = groups[g];
    if (group.params.empty() && groups.size() > 1) {
      throw ValueError("optimizer: parameter group " + std::to_string(g) + " has no parameters");
    }
    groups_.push_back({group.learning_rate.value_or(lr), group.weight_decay});
    for (std::size_t j = 0; j < group.params.size(); ++j) {
      require_in_one_group(groups, g, j);
      const NamedParameter<T>& p = group.params[j];
      ++count;
      if (p.parameter->requires_grad) {
        params_.push_back(p.parameter);
        names_.push_back(p.name);
        group_of_.push_back(static_cast<std::uint32_t>(g));
      } else {
        left_out_.push_back(p);
      }
    }
  }
  if (params_.empty()) {
    throw ValueError(count == 0 ? std::string("optimizer: got no parameters; ") + detail::unregistered_members_hint
                                : "optimizer: got " + std::to_string(count) +
                                      " parameters, none with requires_grad, so there is nothing to train");
  }
}

template <ElementType T>
std::optional<std::string> BasicOptimizer<T>::step_unless_nonfinite(bool known_finite) {
  const std::uint64_t pass = duet::detail::current_backward_pass();
  require_all_reduced(pass, ".step()");
  require_learning_rate();
  require_left_out_frozen();
  require_gradient_from(pass);
  const auto applied = [&](std::size_t i) { return params_[i]->requires_grad && params_[i]->has_grad_from(pass); };
  const auto grad = [&](std::size_t i) { return params_[i]->grad.data(); };
  if (!known_finite) {
    if (auto bad = first_nonfinite_gradient(applied, grad)) return bad;
  }
  begin_step();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (applied(i)) update(i, grad(i));
  }
  ++global_step_;
  return std::nullopt;
}

template <ElementType T>
void BasicOptimizer<T>::operator()(const std::vector<BasicTensor<T>>& grads) {
  const bool all_reduced = is_all_reduced_set(grads);
  if (!all_reduced) require_all_reduced(duet::detail::current_backward_pass(), "(grads)");
  if (grads.size() != params_.size()) {
    // helper-90 took them over net.parameters(), which also lists what no optimiser trains.
    throw ValueError("optimizer: got " + std::to_string(grads.size()) + " gradients for " +
                     std::to_string(params_.size()) +
                     " parameters; take them with respect to the optimizer's own, value_and_grad(net, "
                     "optimizer.parameters()): net.parameters() also lists what it does not train (BatchNorm's "
                     "moving statistics, parameters frozen when it was made)");
  }
  require_own_gradients(grads);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!(grads[i].shape() == params_[i]->shape())) {
      throw ShapeError("optimizer: gradient " + std::to_string(i) + " has shape " + to_string(grads[i].shape()) +
                       ", its parameter " + to_string(params_[i]->shape()));
    }
  }
  require_learning_rate();
  require_left_out_frozen();
  if (all_reduced && !ranks_checked_) {
    require_same_state_on_every_rank();
    ranks_checked_ = true;
  }
  const auto applied = [&](std::size_t i) { return params_[i]->requires_grad && grads[i].gradient_reached(); };
  const auto grad = [&](std::size_t i) { return grads[i].data(); };
  if (const auto bad = first_nonfinite_gradient(applied, grad)) {
    on_nonfinite(*bad);
    return;
  }
  begin_step();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (applied(i)) update(i, grad(i));
  }
  ++global_step_;
}

template <ElementType T>
double BasicOptimizer<T>::learning_rate(std::size_t group) const {
  if (group >= groups_.size()) {
    throw ValueError(std::string(type_name()) + ": parameter group " + std::to_string(group) +
                     " does not exist (it has " + std::to_string(groups_.size()) + ")");
  }
  return groups_[group].learning_rate.at(global_step_);
}

template <ElementType T>
void BasicOptimizer<T>::set_learning_rate(const LearningRate& lr, std::size_t group) {
  static_cast<void>(learning_rate(group));  // the group exists
  const double now = lr.at(global_step_);
  require_option(groups_.size() > 1 ? "learning_rate of parameter group " + std::to_string(group) : "learning_rate",
                 now, now >= 0, ">= 0");
  groups_[group].learning_rate = lr;
}

template <ElementType T>
void BasicOptimizer<T>::set_global_step(std::int64_t step) {
  if (step < 0) throw ValueError(std::string(type_name()) + ": global step " + std::to_string(step) + " is negative");
  global_step_ = step;
}

template <ElementType T>
void BasicOptimizer<T>::require_option(std::string_view option, double value, bool valid, std::string_view rule,
                                       std::string_view when) const {
  if (valid && holds_in_T(value)) return;
  const std::string range =
      !std::isfinite(value) ? "finite and "
      : holds_in_T(value)   ? ""
                            : "at most " + duet::detail::chars_of(static_cast<double>(std::numeric_limits<T>::max())) +
                                " in magnitude (" + std::string(name_of(dtype_of<T>)) + "'s largest) and ";
  throw ValueError(std::string(type_name()) + ": " + std::string(option) + " must be " + range + std::string(rule) +
                   ", got " + duet::detail::chars_of(value) + std::string(when));
}

template <ElementType T>
void BasicOptimizer<T>::require_learning_rate() const {
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const double lr = learning_rate(g);
    if (lr >= 0 && holds_in_T(lr)) continue;  // the step's text is made only for the error: no allocation
    require_option(groups_.size() > 1 ? "learning_rate of parameter group " + std::to_string(g) : "learning_rate", lr,
                   false, ">= 0", global_step_ == 0 ? "" : " at step " + std::to_string(global_step_));
  }
}

template <ElementType T>
std::vector<double> BasicOptimizer<T>::group_weight_decays(double fallback) const {
  std::vector<double> out;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const double wd = groups_[g].weight_decay.value_or(fallback);
    require_option(groups_.size() > 1 ? "weight_decay of parameter group " + std::to_string(g) : "weight_decay", wd,
                   wd >= 0, ">= 0");
    out.push_back(wd);
  }
  return out;
}

template <ElementType T>
std::vector<bool> BasicOptimizer<T>::decay_mask(const DecayFilter& decays) const {
  if (!decays) return {};
  if (names_.empty()) {
    throw ValueError(std::string(type_name()) +
                     ": .decays chooses parameters by name, and the optimizer was given parameters without "
                     "names; pass net.parameters()");
  }
  std::vector<bool> mask;
  for (std::size_t i = 0; i < params_.size(); ++i) mask.push_back(decays(names_[i], params_[i]->shape()));
  return mask;
}

template <ElementType T>
std::vector<BasicTensor<T>> BasicOptimizer<T>::zero_state() const {
  std::vector<BasicTensor<T>> state;
  state.reserve(params_.size());
  for (const auto* p : params_) state.emplace_back(p->shape());
  return state;
}

template <ElementType T>
index_t BasicOptimizer<T>::first_nonfinite_on_threads(const T* g, index_t n) {
  std::atomic<index_t> first{n};
  duet::detail::parallel_elements(n, 1, [&](index_t i0, index_t i1) {
    const index_t k = duet::detail::first_nonfinite(g + i0, i1 - i0);
    if (k < 0) return;
    index_t seen = first.load(std::memory_order_relaxed);
    while (i0 + k < seen && !first.compare_exchange_weak(seen, i0 + k, std::memory_order_relaxed)) {
    }
  });
  return first.load(std::memory_order_relaxed) == n ? -1 : first.load(std::memory_order_relaxed);
}

template <ElementType T>
void BasicOptimizer<T>::on_nonfinite(const std::string& what) {
  if (on_nonfinite_ == NonFiniteGradient::raise) {
    throw ValueError(std::string(type_name()) + ": " + what + " (step " + std::to_string(global_step_) +
                     "), so the step changed nothing: no parameter, no optimiser state (if the loss was finite, "
                     "the gradient of an operation overflowed); to skip such steps instead, as loss scaling does, "
                     "make the optimizer with "
                     "{.on_nonfinite = nn::NonFiniteGradient::skip}");
  }
  // Skipping hides a network that diverged as well as an overflow the loss scale will fix:
  // the first is said, and the count is there for the program to watch.
  if (skipped_steps_++ == 0) {
    std::cerr << "duet: warning: " << type_name() << ": " << what
              << ", so this step skipped its update, as every such step will (said once; skipped_steps() counts "
                 "them)\n";
  }
}

template <ElementType T>
void BasicOptimizer<T>::require_left_out_frozen() const {
  if (std::ranges::none_of(params_, [](const BasicParameter<T>* p) { return p->requires_grad; })) {
    throw ValueError(std::string(type_name()) + ": all " + std::to_string(params_.size()) +
                     " of its parameters have requires_grad = false (frozen since the optimizer was made), so the "
                     "step would change nothing; unfreeze some, or make an optimizer over the ones to train");
  }
  for (const auto& p : left_out_) {
    if (!p.parameter->requires_grad) continue;
    throw ValueError(std::string(type_name()) + ": parameter '" + p.name +
                     "' had requires_grad = false when the optimizer was made, so it is not among the parameters "
                     "it trains, and has requires_grad = true now; make the optimizer after unfreezing it");
  }
}

template <ElementType T>
void BasicOptimizer<T>::require_own_gradients(const std::vector<BasicTensor<T>>& grads) const {
  const auto parameter = [this](std::size_t i) {
    return "#" + std::to_string(i) + (names_.empty() ? std::string() : " '" + names_[i] + "'");
  };
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const void* of = grads[i].gradient_of();
    if (of == nullptr || of == params_[i]) continue;
    const auto found = std::ranges::find(params_, of);
    throw ValueError(
        std::string(type_name()) + "(grads): gradient " + std::to_string(i) +
        (found == params_.end()
             ? " is value_and_grad's gradient of another parameter than this optimizer's " + parameter(i) +
                   " (another network's, of the same shape?)"
             : " is of the optimizer's parameter " + parameter(static_cast<std::size_t>(found - params_.begin())) +
                   ", not of its " + parameter(i)) +
        ", so the update would move the wrong parameters; take the gradients with respect to the "
        "parameters the optimizer was made over, in its order (value_and_grad(net, optimizer.parameters()))");
  }
}

template <ElementType T>
void BasicOptimizer<T>::require_gradient_from(std::uint64_t pass) const {
  if (std::ranges::any_of(params_, [&](const BasicParameter<T>* p) { return p->has_grad_from(pass); })) return;
  throw ValueError(std::string(type_name()) + ".step(): " +
                   (pass == 0 ? std::string("no backward pass has run on this thread")
                              : "the thread's last backward pass reached none of its " +
                                    std::to_string(params_.size()) + " parameters (another network's gradients?)") +
                   ", so there is no gradient to apply; take them first, duet::value_and_grad(net, "
                   "optimizer.parameters()), or train with nn::TrainOneStepCell");
}

template <ElementType T>
void BasicOptimizer<T>::require_all_reduced(std::uint64_t pass, const char* call) {
  if (duet::detail::all_reduced_backward_pass() == pass) return;
  if (duet::detail::parallel_mode().load(std::memory_order_relaxed) == ParallelMode::DATA_PARALLEL) {
    throw ModeError(std::string(type_name()) + call +
                    ": DATA_PARALLEL, but the gradients of the last backward pass were not all-reduced across the "
                    "ranks; train with nn::TrainOneStepCell, or pass them through duet::distributed::GradReducer");
  }
  const duet::detail::DataParallelRuntime* runtime =
      duet::detail::data_parallel_runtime().load(std::memory_order_acquire);
  if (runtime != nullptr && runtime->group_size() > 1 && !warned_unreduced_ &&
      !duet::detail::parallel_mode_chosen().load(std::memory_order_relaxed)) {
    warned_unreduced_ = true;
    std::cerr << "duet: warning: rank " << runtime->rank() << " of " << runtime->group_size() << ": " << type_name()
              << " updates from gradients that were not all-reduced across the ranks (the parallel mode is "
                 "STAND_ALONE), so each rank trains a network of its own; for data parallelism call "
                 "duet::set_auto_parallel_context({.parallel_mode = duet::ParallelMode::DATA_PARALLEL, "
                 ".gradients_mean = true}), or pass the gradients through duet::distributed::GradReducer; if "
                 "that is meant, set the parallel mode to STAND_ALONE yourself\n";
  }
}

template <ElementType T>
void BasicOptimizer<T>::require_same_state_on_every_rank() {
  duet::detail::DataParallelRuntime* runtime = duet::detail::data_parallel_runtime().load(std::memory_order_acquire);
  if (runtime == nullptr || runtime->group_size() == 1) return;
  const auto slot_hash = [](const OptimizerSlot<T>& slot) {
    std::uint64_t hash = duet::detail::fnv1a(slot.name);
    for (const BasicTensor<T>& t : *slot.tensors) hash = duet::detail::fnv1a(duet::detail::tensor_bytes(t), hash);
    return hash;
  };
  const std::vector<OptimizerSlot<T>> slots = state();
  std::uint64_t hash = duet::detail::fnv1a_of(global_step_);
  for (const OptimizerSlot<T>& slot : slots) hash = duet::detail::fnv1a_of(slot_hash(slot), hash);
  constexpr auto stream = duet::detail::Stream::steps;
  if (runtime->same_on_every_rank(hash, stream)) return;
  std::string where = "the step count, " + std::to_string(global_step_) + " on rank " + std::to_string(runtime->rank());
  if (runtime->same_on_every_rank(duet::detail::fnv1a_of(global_step_), stream)) {
    for (const OptimizerSlot<T>& slot : slots) {
      if (!runtime->same_on_every_rank(slot_hash(slot), stream)) {
        where = "'" + std::string(slot.name) + "'";
        break;
      }
    }
  }
  throw ValueError(std::string(type_name()) + ": the ranks' optimiser states differ (" + where +
                   " first) at the first update from distributed::GradReducer's gradients, so each rank would move "
                   "the same parameters its own way; load a checkpoint's optimiser state on every rank "
                   "(nn::TrainOneStepCell gives every rank rank 0's itself)");
}

template <ElementType T>
void BasicOptimizer<T>::require_in_one_group(const std::vector<BasicParameterGroup<T>>& groups, std::size_t g,
                                             std::size_t j) {
  const NamedParameter<T>& p = groups[g].params[j];
  for (std::size_t earlier = 0; earlier <= g; ++earlier) {
    const auto& params = groups[earlier].params;
    const std::size_t end = earlier == g ? j : params.size();
    for (std::size_t k = 0; k < end; ++k) {
      if (params[k].parameter != p.parameter) continue;
      throw ValueError("optimizer: parameter '" + p.name + "' is in parameter group " + std::to_string(earlier) +
                       (earlier == g ? " twice" : " and in group " + std::to_string(g)) +
                       "; give each parameter to one group");
    }
  }
}

template <ElementType T>
bool BasicOptimizer<T>::is_all_reduced_set(const std::vector<BasicTensor<T>>& grads) {
  if constexpr (std::same_as<T, float>) {
    const duet::detail::ReducedGradients& set = duet::detail::all_reduced_gradient_set();
    return set.pass == duet::detail::current_backward_pass() && !grads.empty() &&
           std::ranges::equal(grads, set.data, [](const Tensor& g, const float* d) { return g.data() == d; });
  } else {
    return false;
  }
}

struct SGDConfig {
  [[no_unique_address]] detail::TorchLr lr{};  // refused: PyTorch's lr
  LearningRate learning_rate = 0.1;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  DecayFilter decays = {};  // which parameters weight_decay applies to; unset: all
  NonFiniteGradient on_nonfinite = NonFiniteGradient::raise;  // a NaN or infinite gradient
};

template <ElementType T = float, class Backend = DefaultBackend>
class BasicSGD final : public BasicOptimizer<T> {
 public:
  // Groups written in place, `nn::SGD sgd({{.params = ...}, {.params = ...}})`: without this
  // overload the braces could also make a BasicSGD to copy, and the call would be ambiguous.
  explicit BasicSGD(std::initializer_list<BasicParameterGroup<T>> groups, SGDConfig config = {})
      : BasicSGD(std::vector(groups), std::move(config)) {}
  explicit BasicSGD(const ParametersToTrain<T>& params, SGDConfig config = {});

  std::string_view type_name() const override { return "nn::SGD"; }
  // Without momentum, SGD keeps nothing but the step count.
  std::vector<OptimizerSlot<T>> state() override {
    if (momentum_.empty()) return {};
    return {{"momentum", &momentum_}};
  }

 private:
  void begin_step() override;
  void update(std::size_t i, const T* grad) override {
    BasicParameter<T>& p = *this->params_[i];
    const auto& step = steps_[this->group_of_[i]];
    Backend::sgd_update(p.data(), grad, momentum_.empty() ? nullptr : momentum_[i].data(), p.numel(),
                        decays_.empty() || decays_[i] ? step.decayed : step.undecayed);
  }

  SGDConfig config_;
  std::vector<double> weight_decays_;  // per group
  std::vector<BasicTensor<T>> momentum_;
  std::vector<bool> decays_;
  struct GroupStep {
    SgdStep decayed;
    SgdStep undecayed;  // for the parameters .decays leaves out
  };
  std::vector<GroupStep> steps_;
};

template <ElementType T, class Backend>
BasicSGD<T, Backend>::BasicSGD(const ParametersToTrain<T>& params, SGDConfig config)
    : BasicOptimizer<T>(params, config.learning_rate), config_(std::move(config)) {
  // As MindSpore's nn.SGD: momentum may exceed 1 (it diverges, but is not refused).
  this->require_learning_rate();
  this->require_option("momentum", config_.momentum, config_.momentum >= 0, ">= 0");
  this->require_option("momentum", config_.momentum, !config_.nesterov || config_.momentum > 0, "> 0 with nesterov");
  // Nesterov's momentum has no dampened form; PyTorch and MindSpore refuse the pair too.
  this->require_option("dampening", config_.dampening,
                       config_.dampening >= 0 && (!config_.nesterov || config_.dampening == 0),
                       config_.nesterov ? "0 with nesterov" : ">= 0");
  weight_decays_ = this->group_weight_decays(config_.weight_decay);
  steps_.resize(weight_decays_.size());
  if (config_.momentum > 0) momentum_ = this->zero_state();
  decays_ = this->decay_mask(config_.decays);
  this->on_nonfinite_ = config_.on_nonfinite;
}

template <ElementType T, class Backend>
void BasicSGD<T, Backend>::begin_step() {
  for (std::size_t g = 0; g < steps_.size(); ++g) {
    steps_[g].decayed = SgdStep{this->learning_rate(g), config_.momentum, config_.dampening,
                                weight_decays_[g],      config_.nesterov, this->global_step_ == 0};
    steps_[g].undecayed = steps_[g].decayed;
    steps_[g].undecayed.weight_decay = 0;
  }
}

struct AdamConfig {
  [[no_unique_address]] detail::TorchLr lr{};  // refused: PyTorch's lr
  LearningRate learning_rate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  [[no_unique_address]] detail::TorchBetas betas{};  // refused: PyTorch's betas
  double eps = 1e-8;
  // Unset: 0.01 for AdamW, 0 for Adam (PyTorch's defaults), also when other fields are set.
  std::optional<double> weight_decay = std::nullopt;
  DecayFilter decays = {};  // which parameters weight_decay applies to; unset: all
  NonFiniteGradient on_nonfinite = NonFiniteGradient::raise;  // a NaN or infinite gradient
};

template <ElementType T = float, bool Decoupled = false, class Backend = DefaultBackend>
class BasicAdam final : public BasicOptimizer<T> {
 public:
  // Groups written in place (see BasicSGD).
  explicit BasicAdam(std::initializer_list<BasicParameterGroup<T>> groups, AdamConfig config = {})
      : BasicAdam(std::vector(groups), std::move(config)) {}
  explicit BasicAdam(const ParametersToTrain<T>& params, AdamConfig config = {});

  // AdamW decays weights by default (0.01, as PyTorch's AdamW); Adam does not.
  static AdamConfig default_config() {
    AdamConfig c;
    c.weight_decay = Decoupled ? 0.01 : 0.0;
    return c;
  }

  std::string_view type_name() const override { return Decoupled ? "nn::AdamW" : "nn::Adam"; }
  std::vector<OptimizerSlot<T>> state() override { return {{"moment1", &m_}, {"moment2", &v_}}; }

 private:
  void begin_step() override;
  void update(std::size_t i, const T* grad) override {
    BasicParameter<T>& p = *this->params_[i];
    const auto& step = steps_[this->group_of_[i]];
    Backend::adam_update(p.data(), grad, m_[i].data(), v_[i].data(), p.numel(),
                         decays_.empty() || decays_[i] ? step.decayed : step.undecayed);
  }

  AdamConfig config_;
  std::vector<double> weight_decays_;  // per group
  std::vector<bool> decays_;
  std::vector<BasicTensor<T>> m_;
  std::vector<BasicTensor<T>> v_;
  struct GroupStep {
    AdamStep decayed;
    AdamStep undecayed;  // for the parameters .decays leaves out
  };
  std::vector<GroupStep> steps_;
};

template <ElementType T, bool Decoupled, class Backend>
BasicAdam<T, Decoupled, Backend>::BasicAdam(const ParametersToTrain<T>& params, AdamConfig config)
    : BasicOptimizer<T>(params, config.learning_rate),
      config_(std::move(config)),
      weight_decays_(
          this->group_weight_decays(config_.weight_decay.value_or(default_config().weight_decay.value_or(0)))),
      m_(this->zero_state()),
      v_(this->zero_state()),
      steps_(weight_decays_.size()) {
  this->require_learning_rate();
  this->require_option("beta1", config_.beta1, config_.beta1 >= 0 && config_.beta1 < 1, "in [0, 1)");
  this->require_option("beta2", config_.beta2, config_.beta2 >= 0 && config_.beta2 < 1, "in [0, 1)");
  this->require_option("eps", config_.eps, config_.eps > 0, "> 0");
  decays_ = this->decay_mask(config_.decays);
  this->on_nonfinite_ = config_.on_nonfinite;
}

template <ElementType T, bool Decoupled, class Backend>
void BasicAdam<T, Decoupled, Backend>::begin_step() {
  const auto t = static_cast<double>(this->global_step_ + 1);
  for (std::size_t g = 0; g < steps_.size(); ++g) {
    steps_[g].decayed = AdamStep{this->learning_rate(g),
                                 config_.beta1,
                                 config_.beta2,
                                 config_.eps,
                                 weight_decays_[g],
                                 Decoupled,
                                 1 - std::pow(config_.beta1, t),
                                 1 - std::pow(config_.beta2, t)};
    steps_[g].undecayed = steps_[g].decayed;
    steps_[g].undecayed.weight_decay = 0;
  }
}

using SGD = BasicSGD<float>;
using Adam = BasicAdam<float, false>;
using AdamW = BasicAdam<float, true>;

}  // namespace duet::nn
