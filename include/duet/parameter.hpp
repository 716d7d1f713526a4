// Parameters: the tensors a cell learns.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include "detail/node_id.hpp"
#include "tensor.hpp"

namespace duet {
namespace detail {
// The backward pass running on this thread; gradient kernels pass it to grad_for_write.
inline std::uint64_t& current_backward_pass() {
  thread_local std::uint64_t pass = 0;
  return pass;
}

// The parameters whose gradient the calling thread's backward pass has written, in the order
// first written: what a training step checks against its network's registered parameters.
// Cleared, not freed, by each new pass, so training does not allocate once warm.
inline std::vector<const void*>& written_in_pass() {
  thread_local std::vector<const void*> written;
  return written;
}

// Told of a backward pass's gradient writes as they happen, on the thread that runs it: which
// parameter a kernel is about to write (grad_for_write), and that every kernel called so far
// has finished (an op that writes parameters' gradients asks for their buffers first and
// computes after, so only its end says they are written). A data-parallel training step
// starts summing the gradients that are final while backward goes on.
class GradientObserver {
 public:
  virtual void will_write(const void* parameter) = 0;
  virtual void writes_done() = 0;

 protected:
  ~GradientObserver() = default;
};

inline GradientObserver*& gradient_observer() {
  thread_local GradientObserver* observer = nullptr;
  return observer;
}

// Called at the end of each op that writes parameters' gradients. One that does not call it
// only makes its gradients known as final later (at the next op's call, or the pass's end).
inline void gradient_writes_done() {
  if (GradientObserver* observer = gradient_observer()) observer->writes_done();
}

// Makes the calling thread's next backward pass, unique in the program.
inline std::uint64_t begin_backward_pass() {
  static std::atomic<std::uint64_t> last{0};
  written_in_pass().clear();
  return current_backward_pass() = last.fetch_add(1, std::memory_order_relaxed) + 1;
}

// State that a forward pass changes (BatchNorm's moving statistics, Dropout's generator) and
// that a training step must leave as it was when it fails: such a step throws after the
// forward ran (a loss refusing its labels) or skips its update (a loss that is not finite).
// The owner saves its state the first time a step changes it and puts it back if the step
// does not commit; saving into buffers kept from step to step allocates nothing once warm.
class StepState {
 public:
  virtual void save_for_step() = 0;
  virtual void restore_step() = 0;

 protected:
  ~StepState() = default;
};

struct StepLog {
  int depth = 0;  // nested steps (a TrainOneStepCell's gradient) commit with the outermost
  std::vector<StepState*> saved;
};
inline StepLog& step_log() {
  thread_local StepLog log;
  return log;
}

// Called before a forward pass changes `state`. Outside a step (state changed by a kernel run
// outside any cell's call) the change is final at once, as the run itself is.
inline void will_change(StepState& state) {
  StepLog& log = step_log();
  if (log.depth == 0 || std::ranges::find(log.saved, &state) != log.saved.end()) return;
  state.save_for_step();
  log.saved.push_back(&state);
}

// One training step on this thread (value_and_grad's call, TrainOneStepCell's): every
// StepState it changes is put back when it ends without commit(), by an exception or not.
class StepScope {
 public:
  StepScope() { ++step_log().depth; }
  StepScope(const StepScope&) = delete;
  StepScope& operator=(const StepScope&) = delete;
  ~StepScope() {
    StepLog& log = step_log();
    if (--log.depth > 0) return;
    if (!committed_) {
      for (auto it = log.saved.rbegin(); it != log.saved.rend(); ++it) (*it)->restore_step();
    }
    log.saved.clear();
  }
  void commit() { committed_ = true; }

 private:
  bool committed_ = false;
};

// Runs a cell's forward call as one step of its own when no step is open: a call that throws
// (a shape error at a later layer, a label out of range in the loss) after BatchNorm or Dropout
// ran leaves their state as it was, as a failed training step does.
template <class F>
auto all_or_nothing(F&& call) {
  StepScope scope;
  auto result = std::forward<F>(call)();
  scope.commit();
  return result;
}
}  // namespace detail

namespace nn {

// A tensor a cell owns and an optimiser updates. It is a tensor (prints, indexes, feeds
// kernels) whose shape is fixed once made: set_data copies values in, never rebinds, so the
// graphs and views that refer to it stay valid.
template <ElementType T>
class BasicParameter : public BasicTensor<T> {
 public:
  BasicParameter() = default;
  explicit BasicParameter(BasicTensor<T> value) : BasicTensor<T>(std::move(value)) {}

  BasicParameter(const BasicParameter&) = delete;
  BasicParameter& operator=(const BasicParameter&) = delete;
  BasicParameter(BasicParameter&&) noexcept = default;
  BasicParameter& operator=(BasicParameter&&) noexcept = default;
  ~BasicParameter() = default;

  // As a tensor's, on the parameter itself: in construct, an operation on parameters alone.
  DUET_DETAIL_TENSOR_METHODS

  // MindSpore's Parameter.set_data: the new values must have this parameter's shape.
  void set_data(const BasicTensor<T>& value) {
    if (!(value.shape() == this->shape())) {
      throw ShapeError("duet::nn::Parameter::set_data: parameter has shape " + to_string(this->shape()) + ", got " +
                       to_string(value.shape()));
    }
    std::copy_n(value.data(), value.numel(), this->data());
  }

  // Where a gradient kernel writes this parameter's gradient in backward pass `pass`: the
  // first write of a pass assigns (*accumulate = false), later ones add, for a parameter used
  // twice. The buffer is made on the first pass and kept, so training does not allocate.
  T* grad_for_write(std::uint64_t pass, bool* accumulate) const {
    if (!(grad.shape() == this->shape())) grad = BasicTensor<T>(this->shape());
    *accumulate = grad_pass_ == pass;
    if (!*accumulate && pass == duet::detail::current_backward_pass()) duet::detail::written_in_pass().push_back(this);
    if (duet::detail::GradientObserver* observer = duet::detail::gradient_observer()) observer->will_write(this);
    grad_pass_ = pass;
    return grad.data();
  }

  // grad_for_write for a kernel that only adds into the gradient: zeroed on the pass's first
  // write, kept for a later one (a layer used twice).
  T* grad_for_add(std::uint64_t pass) const {
    bool accumulate = false;
    T* g = grad_for_write(pass, &accumulate);
    if (!accumulate) std::fill_n(g, this->numel(), T(0));
    return g;
  }

  // Forgets the gradient of backward pass `pass`, as if it had not reached this parameter.
  void forget_grad(std::uint64_t pass) const {
    if (grad_pass_ == pass) grad_pass_ = 0;
  }

  // Whether backward pass `pass` wrote this parameter's gradient (it did not reach it otherwise).
  // Pass 0 is none (a thread that ran no backward pass yet), which wrote nothing.
  bool has_grad_from(std::uint64_t pass) const { return pass != 0 && grad_pass_ == pass; }

  // A form of the values a kernel computes from them and keeps (the pre-packed weight of an
  // inference graph, the weight with a BatchNorm folded in): make() runs on first use, and again
  // whenever the values, or any of the tensors in `also` that the form is made from too, may
  // have changed since (version(), which optimisers, set_data, checkpoint loading and any
  // non-const access move), so a stale form is never returned. One form per parameter; safe
  // from several threads, and a returned form outlives a concurrent remake.
  template <class Form, class Make>
  std::shared_ptr<const Form> derived(Make&& make, std::initializer_list<const BasicTensor<T>*> also = {}) const {
    // The bookkeeping, which does not depend on Form, is compiled once per T (derived_form).
    const auto made = [](const void* m) -> std::shared_ptr<const void> {
      return std::make_shared<const Form>((*static_cast<std::remove_reference_t<Make>*>(const_cast<void*>(m)))());
    };
    return std::static_pointer_cast<const Form>(derived_form(typeid(Form), also, std::addressof(make), made));
  }

  bool requires_grad = true;

  // The gradient from the last backward pass that reached this parameter; empty before.
  // Gradients are bookkeeping, not the parameter's value: kernels holding a const layer write them.
  mutable BasicTensor<T> grad;

 private:
  mutable std::uint64_t grad_pass_ = 0;

  // A tensor a form was made from, as it was then.
  struct Seen {
    BasicTensor<T> values;  // a handle: the block cannot be reused for other values meanwhile
    std::uint64_t version = 0;
  };
  struct DerivedForm {
    std::mutex mutex;
    Seen source;
    std::vector<Seen> also;
    std::type_index type = typeid(void);
    std::shared_ptr<const void> form;

    DerivedForm() = default;
    // A moved parameter makes its forms again; the mutex cannot move.
    DerivedForm(DerivedForm&&) noexcept {}
    DerivedForm& operator=(DerivedForm&&) noexcept {
      form.reset();
      source = Seen{};
      also.clear();
      return *this;
    }
    DerivedForm(const DerivedForm&) = delete;
    DerivedForm& operator=(const DerivedForm&) = delete;
    ~DerivedForm() = default;
  };
  mutable DerivedForm derived_;

  std::shared_ptr<const void> derived_form(std::type_index type, std::initializer_list<const BasicTensor<T>*> also,
                                           const void* make, std::shared_ptr<const void> (*made)(const void*)) const;
};

template <ElementType T>
std::shared_ptr<const void> BasicParameter<T>::derived_form(std::type_index type,
                                                            std::initializer_list<const BasicTensor<T>*> also,
                                                            const void* make,
                                                            std::shared_ptr<const void> (*made)(const void*)) const {
  DerivedForm& d = derived_;
  std::lock_guard lock(d.mutex);
  const BasicTensor<T>& values = *this;
  // The same first element means the same block: the handles kept stop that block from being reused.
  const auto same = [](const Seen& seen, const BasicTensor<T>& now) {
    return seen.values.data() == now.data() && seen.values.shape() == now.shape() && seen.version == now.version();
  };
  bool current = d.form != nullptr && d.type == type && same(d.source, values) && d.also.size() == also.size();
  for (std::size_t i = 0; current && i < also.size(); ++i) current = same(d.also[i], *also.begin()[i]);
  if (!current) {
    d.form.reset();  // frees the old form before the new one is made, not after
    d.form = made(make);
    d.type = type;
    d.source = {values, values.version()};
    d.also.clear();
    for (const BasicTensor<T>* t : also) d.also.push_back({*t, t->version()});
  }
  return d.form;
}

using Parameter = BasicParameter<float>;

template <class X>
inline constexpr bool is_parameter_v = false;
template <class T>
inline constexpr bool is_parameter_v<BasicParameter<T>> = true;

// What an operation on a cell's parameters alone gives (ops::exp(log_scale), a transposed
// weight): its value, computed at once as any operation's (a recording tape records it), and
// the operation and operands it came from. A graph captured around it cannot read a value
// computed before it runs (the parameters change between calls), so capture makes it again
// from the operation and nodes that read the parameters when the graph runs (eager.hpp,
// graph_operand), and graph mode trains the parameters through it as PyNative mode does.
template <ElementType T, class Op, class... Operands>
class ParameterResult : public BasicTensor<T> {
 public:
  ParameterResult(BasicTensor<T> value, const Op& op, const Operands&... operands)
      : BasicTensor<T>(std::move(value)), op(op), operands(operands...) {}

  DUET_DETAIL_TENSOR_METHODS

  Op op;
  std::tuple<Operands...> operands;  // each a `const BasicParameter<U>*` or a ParameterResult
  // Its node's id wherever capture makes it again: one value, however many operations read it
  // (`x * h + h`), so that the copies merge into one node, as PyNative computes it once.
  std::uint64_t node_id = graph::new_node_id();
};

template <class X>
inline constexpr bool is_parameter_result_v = false;
template <class T, class Op, class... Operands>
inline constexpr bool is_parameter_result_v<ParameterResult<T, Op, Operands...>> = true;

// Made from parameters only, so that capture can make it again.
template <class X>
inline constexpr bool is_parameter_made_v = is_parameter_v<X> || is_parameter_result_v<X>;

template <ElementType T>
struct NamedParameter {
  std::string name;
  BasicParameter<T>* parameter;
};

namespace detail {
// What a cell with no parameters most likely lacks, for the errors that find one empty.
inline constexpr const char* unregistered_members_hint =
    "are its sub-cells and parameters registered? A Cell lists them in DUET_CELL_MEMBERS(...); a class "
    "deriving from nn::DynamicCell overrides for_each_child and for_each_own_parameter";
}  // namespace detail

}  // namespace nn
}  // namespace duet
