// Cells: the network model of both modes.
//
// BasicDynamicCell is the runtime-polymorphic interface PyNative mode runs on: a virtual
// forward, a name, forward hooks, children and parameters. Networks can be assembled from it
// at run time. Cell<Derived, Mode> is what a user derives from: it writes one generic
// construct(x), which PyNative calls with tensors (each sub-cell runs at once, through the
// virtual interface) and graph mode calls with a symbolic tensor (each sub-cell appends nodes,
// and the finished graph is optimised and evaluated in one call).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/hana/accessors.hpp>
#include <boost/hana/concept/struct.hpp>
#include <boost/hana/first.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/second.hpp>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "context.hpp"
#include "detail/demangle.hpp"
#include "detail/reflect.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "jit.hpp"
#include "jit_config.hpp"
#include "parameter.hpp"
#include "passes.hpp"
#include "pipeline.hpp"
#include "tape.hpp"
#include "tensor.hpp"
#include "trace.hpp"

namespace duet::nn {

namespace hana = boost::hana;

template <ElementType T>
class BasicDynamicCell;

// Called after a cell's forward in PyNative mode with the cell, its input and its output.
template <ElementType T>
using BasicForwardHook =
    std::function<void(const BasicDynamicCell<T>& cell, const BasicTensor<T>& input, const BasicTensor<T>& output)>;
using ForwardHook = BasicForwardHook<float>;

// Called while a PyNative backward pass goes through the cell, with the gradient of its input
// through the cell alone (PyTorch's grad_input: not what a skip connection around it adds) and
// of its output. grad_input is an empty tensor, shape [0], where the input takes no gradient
// (PyTorch's None): the network's input, unless its gradient is asked for, or a parameter
// passed as the input (read its gradient from the parameter). The hook is not called when
// no gradient reaches the cell's output.
template <ElementType T>
using BasicBackwardHook = std::function<void(const BasicDynamicCell<T>& cell, const BasicTensor<T>& grad_input,
                                             const BasicTensor<T>& grad_output)>;
using BackwardHook = BasicBackwardHook<float>;

namespace detail {
// Naming a tree of cells happens once, on first use; the lock makes concurrent first calls safe.
inline std::mutex& naming_mutex() {
  static std::mutex m;
  return m;
}

// The cell whose construct is running on this thread, and the bytes of its object. A cell
// that construct calls and that lies inside those bytes is a member: it must be registered
// (DUET_CELL_MEMBERS), or its parameters would be neither trained nor saved. Frames live on
// the call stack, so keeping track costs no allocation.
template <ElementType T>
class RunningCell final : public duet::detail::RunningConstruct {
 public:
  RunningCell(BasicDynamicCell<T>& cell, const void* object, std::size_t size)
      : cell_(cell), begin_(static_cast<const char*>(object)), end_(begin_ + size), outer_(innermost_) {
    innermost_ = this;
  }
  RunningCell(const RunningCell&) = delete;
  RunningCell& operator=(const RunningCell&) = delete;
  ~RunningCell() { innermost_ = outer_; }
  std::string where() const override { return cell_.type_name() + "::construct"; }

  static RunningCell* innermost() { return innermost_; }
  BasicDynamicCell<T>& cell() const { return cell_; }
  bool holds(const void* p) const {
    const std::less<const void*> before;
    return !before(p, begin_) && before(p, end_);
  }

 private:
  BasicDynamicCell<T>& cell_;
  const char* begin_;
  const char* end_;
  RunningCell* outer_;
  static inline thread_local RunningCell* innermost_ = nullptr;
};
}  // namespace detail

namespace detail {
// Set on a thread while duet::summary runs a network once: every cell then runs eagerly,
// whatever its mode, and reports each call here, so that each layer's output is seen. (A
// forward hook would be refused inside a graph, and would change the cells.)
template <ElementType T>
inline thread_local const BasicForwardHook<T>* call_observer = nullptr;
}  // namespace detail

// Where a cell's hooks are: the cell moves them, and this pointer, to the object it is moved
// into, so that a handle taken before the move still finds its hook.
template <ElementType T>
using HookOwner = std::shared_ptr<BasicDynamicCell<T>*>;

// Removes the hook it was returned for (MindSpore's handle.remove()), from the cell it was
// registered on wherever that cell was moved since (returned from a function, put in a
// std::vector or a container cell), as PyTorch's handle removes it from its module. Once the
// cell is destroyed its hooks are gone with it, and remove() has nothing left to do.
template <ElementType T>
class BasicHookHandle {
 public:
  BasicHookHandle() = default;
  BasicHookHandle(const HookOwner<T>& owner, long id) : owner_(owner), id_(id) {}
  void remove() {
    if (const HookOwner<T> owner = owner_.lock()) (*owner)->remove_hook(id_);
    owner_.reset();
  }

 private:
  std::weak_ptr<BasicDynamicCell<T>*> owner_;
  long id_ = 0;
};
// A float network's handle by name, as users keep them (std::vector<nn::HookHandle>), like
// ForwardHook beside BasicForwardHook.
using HookHandle = BasicHookHandle<float>;

template <ElementType T>
class BasicDynamicCell {
 public:
  using value_type = T;
  using ChildVisitor = std::function<void(std::string_view name, BasicDynamicCell& child)>;
  using ParameterVisitor = std::function<void(std::string_view name, BasicParameter<T>& parameter)>;

  BasicDynamicCell() = default;
  BasicDynamicCell(const BasicDynamicCell&) = delete;
  BasicDynamicCell& operator=(const BasicDynamicCell&) = delete;
  // Movable so that containers can take cells by value; a moved cell keeps its hooks, and
  // HookHandles taken before the move remove them from it.
  BasicDynamicCell(BasicDynamicCell&& other) noexcept
      : name_(std::move(other.name_)),
        named_(other.named_.load()),
        training_(other.training_.load()),
        phase_chosen_(other.phase_chosen_.load()),
        hooks_(std::exchange(other.hooks_, {})),
        backward_hooks_(std::exchange(other.backward_hooks_, {})),
        last_hook_id_(other.last_hook_id_),
        hook_owner_(std::move(other.hook_owner_)) {
    if (hook_owner_ != nullptr) *hook_owner_ = this;
  }
  BasicDynamicCell& operator=(BasicDynamicCell&&) = delete;
  virtual ~BasicDynamicCell();

  // The cell on x, in its mode. A call that throws leaves what its layers change (BatchNorm's
  // moving statistics, Dropout's draws) as it was.
  BasicTensor<T> operator()(const BasicTensor<T>& x);
  // The cell on int32 indices (token ids), for a cell whose input holds them: an nn::Embedding,
  // a Cell that declares `using input_value_type = std::int32_t;`, a DynamicSequentialCell whose
  // first cell is one (other_input_type() is then "Int32"). Any other cell refuses them with a
  // duet::ValueError: indices are never read as values of T.
  BasicTensor<T> operator()(const BasicTensor<std::int32_t>& ids) requires(!std::is_same_v<T, std::int32_t>);
  // Any other element type: said here, as nn::Cell says it, instead of both overloads' reasons.
  template <ElementType U>
  requires(!std::is_same_v<U, T> && !std::is_same_v<U, std::int32_t>) BasicTensor<T>
  operator()(const BasicTensor<U>&) {
    static_assert(std::is_same_v<U, T>,
                  "duet::nn::DynamicCell: called with a tensor of another element type than the cell's own: a "
                  "network of int32 indices (nn::Embedding first) takes a duet::BasicTensor<std::int32_t> (int64 "
                  "ids are converted to int32 first); other values are converted to the cell's type");
    return {};  // of the cell's type, so that nothing after it adds errors
  }
  // A generic function that calls this cell, asked by graph capture whether it can be captured
  // (value_and_grad or jit of `[&](auto x) { return loss(net(x)); }`): a cell built at run time
  // has no construct to capture, so on a symbolic tensor it gives a real tensor's type, which
  // tells graph::Capturable that the function runs on real tensors, as one taking `const
  // Tensor&` does. Never run: nothing captures such a function.
  template <graph::Symbolic S>
  BasicTensor<T> operator()(const S&) {
    throw ModeError(label() +
                    ": a cell built at run time cannot be captured in a static graph; the function "
                    "calling it is captured only if its result does not depend on this cell's output");
  }

  // Unique for the life of the program, unlike the address: what caches of compiled plans key on.
  std::uint64_t id() const { return id_; }

  // Path from the root the cell was first used under ("dense_relu_sequential.0"); "" for it.
  const std::string& name() const { return name_; }
  // What the cell is: "nn::Dense<784, 512, float>".
  virtual std::string type_name() const = 0;
  // What print(model) and duet::summary show after the type, as PyTorch's extra_repr: the sizes
  // a layer whose type leaves them to run time was built with ("4, 8" for nn::Dense<>(4, 8)),
  // empty where the type says them all.
  virtual std::string extra_repr() const { return {}; }
  // "nn::Dense<dyn, dyn>(4, 8)", "nn::Dense<784, 512>": the type, then extra_repr() if any.
  std::string repr() const {
    const std::string extra = extra_repr();
    return extra.empty() ? type_name() : type_name() + "(" + extra + ")";
  }
  // "nn::Dense<784, 512, float> 'dense_relu_sequential.0'": how errors name a cell.
  std::string label() const { return name_.empty() ? type_name() : type_name() + " '" + name_ + "'"; }

  virtual void for_each_child(const ChildVisitor&) {}
  virtual void for_each_own_parameter(const ParameterVisitor&) {}

  // All parameters of the tree, named by path ("dense_relu_sequential.0.weight").
  std::vector<NamedParameter<T>> parameters();

  // This cell and all below it, depth first, with their paths (MindSpore's cells_and_names).
  std::vector<std::pair<std::string, BasicDynamicCell*>> cells_and_names();

  BasicHookHandle<T> register_forward_hook(BasicForwardHook<T> hook);

  // Backward hooks run while a PyNative gradient (value_and_grad, grad, TrainOneStepCell)
  // goes back through this cell.
  BasicHookHandle<T> register_backward_hook(BasicBackwardHook<T> hook);

  // A hook takes tensors of T, so a cell whose input holds other values could never call it:
  // refused where it is registered rather than at the cell's first call.
  void refuse_hook_on_other_input_type() const;

  void remove_hook(long id);

  // This cell, or the first cell below it, that has a forward or backward hook; nullptr if none.
  BasicDynamicCell* hooked_cell();
  bool has_hooks_in_tree() { return hooked_cell() != nullptr; }

  // Who holds the hook an error refuses: "it", or "nn::Dense<1568, 10> 'fc' in it", so that a
  // user finds the hook among many cells.
  std::string hook_holder();

  // MindSpore's Cell.set_train(mode=True): this cell and every cell below it are set to train
  // (true) or to evaluate (false). Only layers that differ between the two read it (BatchNorm
  // uses batch statistics and updates its moving ones in training, Dropout drops only in
  // training). As in MindSpore, a cell starts in evaluation (training() is false): call
  // set_train() before training a network that has such layers. A cell built at run time is
  // traced again after a switch (its trace holds the phase's operations); a Cell's two graph
  // forms are both kept (pipeline::in_requested_phase).
  BasicDynamicCell& set_train(bool mode = true);
  bool training() const { return training_.load(std::memory_order_relaxed); }

  // PyTorch's module.requires_grad_(flag), a sub-tree at a time: every parameter of this cell
  // and the cells below it is frozen (false) or trained (true), `net.backbone.set_requires_grad(false)`
  // to fine-tune the head. A parameter its layer never trains (BatchNorm's moving statistics;
  // gamma and beta without affine) stays frozen. What freezing means for an optimiser made
  // before or after is the parameter's flag's (nn/optim.hpp).
  BasicDynamicCell& set_requires_grad(bool flag);
  // Whether this cell's parameter p is one it never trains (set_requires_grad leaves it frozen).
  virtual bool never_trains(const BasicParameter<T>&) const { return false; }

  // PyTorch's names for this layer's parameters where they are not its own with the last part
  // renamed (io::TensorNames::pytorch): {path below this cell, PyTorch's path}. Only the layer
  // knows them: nn::MultiheadAttention's in_proj.weight is PyTorch's in_proj_weight, a Dense
  // that a user named in_proj keeps in_proj.weight.
  virtual std::vector<std::pair<std::string_view, std::string_view>> pytorch_parameter_names() const { return {}; }

  // The element type of this cell's input when it is not T (nn::Embedding's int32 indices, as
  // `using input_value_type` declares), empty otherwise.
  virtual std::string_view other_input_type() const { return {}; }

  // What a temporary switch (train::evaluate) gives back to each cell: its setting, and
  // whether anybody chose it, so that the switch does not count as a choice.
  struct PhaseSetting {
    bool training;
    bool chosen;
  };
  PhaseSetting phase_setting() const { return {training(), phase_chosen_.load(std::memory_order_relaxed)}; }
  void restore_phase_setting(PhaseSetting setting) {
    training_.store(setting.training, std::memory_order_relaxed);
    phase_chosen_.store(setting.chosen, std::memory_order_relaxed);
    structure_changed();
  }

  // Whether the cell computes differently in training and evaluation (BatchNorm, Dropout).
  virtual bool depends_on_phase() const { return false; }

  // A gradient through such a cell that nobody set_train-ed is almost always a training loop
  // that forgot set_train(true): it trains on the moving statistics with Dropout off, and
  // nothing fails. Says so on `out` (std::cerr), once per cell for the program's life. Calling
  // set_train(false) says evaluation is meant (fine-tuning with BatchNorm frozen) and silences
  // it. value_and_grad and grad call this on their first call.
  void warn_if_phase_unchosen(std::ostream& out);

  // Gives this cell and all below it their paths, if no call or parent has done so yet.
  void ensure_named() {
    if (named_.load(std::memory_order_acquire)) return;
    std::lock_guard lock(detail::naming_mutex());
    if (!named_.load(std::memory_order_relaxed)) assign_names("");
  }

  // What graph mode keys the trace of this tree on: every cell's structure version, mixed in
  // the order of the tree, so that any change below (an append, a set_train, a cell replaced)
  // gives another key and a change to another network none. A counter for the whole program
  // made every network built at run time trace again whenever any cell changed, and a network
  // served after freeze_compiles() threw when another model was loaded (helper-91).
  std::uint64_t structure_key();

  // A jitted form of this network kept with it, made by make() on the first request for type F:
  // for a form that belongs to the network rather than to the caller that asked for it (a
  // gradient function's traced step: value_and_grad is made anew on every step as often as
  // once, and each would trace the network again). It lives as long as the cell; a moved cell
  // starts without.
  template <class F, class Make>
  F& kept_form(Make&& make) {
    return forms_.get<F>(std::forward<Make>(make));
  }

 protected:
  virtual BasicTensor<T> forward(const BasicTensor<T>& x) = 0;
  // forward on int32 indices, for a cell whose input holds them (operator() on ids).
  virtual BasicTensor<T> forward_ids(const BasicTensor<std::int32_t>&);

  // Refuses an input the cell can never take, before graph mode looks for a form for its shape:
  // a bad request then reads as one (a ShapeError), not as a compile that freeze_compiles
  // forbids (helper-85, serving an ONNX model).
  virtual void check_input_shape(const Shape&) const {}

  // Whether graph mode traces this cell when it is called from outside any other (PIJit): a
  // cell built at run time has no construct to capture. Cell<...> captures its construct instead.
  virtual bool traced_in_graph_mode() const { return true; }

  // A cell built at run time whose structure changes after it has run (layers added, removed or
  // replaced) calls this, so that graph mode traces it again instead of replaying the old one.
  void structure_changed() { structure_version_.fetch_add(1, std::memory_order_acq_rel); }

  bool has_own_hooks() const { return !hooks_.empty() || !backward_hooks_.empty(); }

  // Refuses a call from the construct of a cell that holds this one as a member without
  // registering it. Once this cell was found registered, later calls only read a flag.
  void check_registered();

 protected:
  // A call's observers around run(), which gives the cell's output on x: a PIJit trace's
  // note, backward hooks (on a recording tape), forward hooks, duet::summary's observer.
  // On int32 indices (x a BasicTensor<std::int32_t>) hooks, which take tensors of T, are
  // refused, and duet::summary's observer is given an empty input.
  template <class X, class Run>
  auto observed_call(const X& x, Run run) {
    constexpr bool ids = std::is_same_v<X, BasicTensor<std::int32_t>> && !std::is_same_v<T, std::int32_t>;
    if constexpr (ids) {
      if (has_own_hooks()) refuse_hook_on_other_input_type();
    }
    const BasicForwardHook<T>* observer = detail::call_observer<T>;
    const pijit::TracedCell traced([this] { return label(); });
    if (pijit::Trace* trace = traced.trace()) {
      trace->note_cell([this] { return has_hooks_in_tree(); });
      if (!hooks_.empty() || !backward_hooks_.empty()) trace->mark_broken("has a hook, which sees values in PyNative mode only");
    }
    autodiff::Tape* tape = backward_hooks_.empty() || ids ? nullptr : autodiff::active_tape();
    autodiff::CellRecord<T>* recorded = nullptr;
    if constexpr (!ids) {
      if (tape != nullptr) {
        recorded = tape->begin_cell(x, [this](const BasicTensor<T>& grad_input, const BasicTensor<T>& grad_output) {
          run_hooks(backward_hooks_, grad_input, grad_output);
        });
      }
    }
    auto y = run();
    if (recorded != nullptr) tape->end_cell(recorded, y);
    if constexpr (ids) {
      if (observer != nullptr) (*observer)(*this, BasicTensor<T>{}, y);
    } else {
      run_hooks(hooks_, x, y);
      if (observer != nullptr) (*observer)(*this, x, y);
    }
    return y;
  }

 private:
  // operator()'s call: hooks, then forward in this cell's mode. X is T, or int32 for indices.
  template <class X>
  BasicTensor<T> call(const BasicTensor<X>& x) {
    check_registered();
    ensure_named();
    check_input_shape(x.shape());
    if (detail::call_observer<T> == nullptr && effective_mode(CONTEXT_MODE) == GRAPH_MODE &&
        autodiff::active_tape() == nullptr && pijit::active_trace() == nullptr && traced_in_graph_mode()) {
      return graph_form<X>()(x, structure_key());
    }
    return observed_call(x, [&] {
      if constexpr (std::is_same_v<X, T>)
        return forward(x);
      else
        return forward_ids(x);
    });
  }

  // Graph mode for a cell built at run time: PIJit at the default JitConfig, traced on the first
  // call for each input shape and structure, replayed after. Its second argument is the tree's
  // structure_key: a network changed since the trace is traced again. One form per input type.
  template <class X>
  struct GraphCall {
    BasicDynamicCell* cell;
    BasicTensor<T> operator()(const BasicTensor<X>& x, std::uint64_t /*structure*/) const { return (*cell)(x); }
  };
  template <class X>
  using GraphForm = JitFunction<JitConfig{}, GraphCall<X>>;

  template <class X>
  GraphForm<X>& graph_form() {
    return forms_.get<GraphForm<X>>([this] {
      return GraphForm<X>(GraphCall<X>{this},
                          {.mode = JitMode::PIJit, .name = label() + " in graph mode (argument 1: its structure)"});
    });
  }

  // A hook may remove itself (a one-shot hook) or others, or register more: a call runs the
  // hooks registered when it began that are still registered, in order, each kept alive while
  // it runs.
  template <class Hook, class... Tensors>
  void run_hooks(const std::vector<std::pair<long, std::shared_ptr<const Hook>>>& hooks, const Tensors&... tensors) {
    const long last = last_hook_id_;
    for (long done = 0;;) {
      const auto next = std::find_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.first > done; });
      if (next == hooks.end() || next->first > last) return;
      done = next->first;
      const std::shared_ptr<const Hook> hook = next->second;
      (*hook)(*this, tensors...);
    }
  }

  // Made at the first hook, so that a cell without hooks allocates nothing for them.
  const HookOwner<T>& hook_owner() {
    if (hook_owner_ == nullptr) hook_owner_ = std::make_shared<BasicDynamicCell*>(this);
    return hook_owner_;
  }

  bool is_ancestor_of(const BasicDynamicCell& cell);

  void assign_names(const std::string& path);

  // A child named "" is transparent: its own children take their names from the path itself.
  static std::string join(const std::string& path, std::string_view child) {
    if (child.empty()) return path;
    return path.empty() ? std::string(child) : path + "." + std::string(child);
  }

  void collect_parameters(const std::string& path, std::vector<NamedParameter<T>>& out);

  void collect_cells(const std::string& path, std::vector<std::pair<std::string, BasicDynamicCell*>>& out);

  std::uint64_t id_ = duet::detail::new_plan_owner();
  std::string name_;
  std::atomic<bool> named_{false};
  std::atomic<bool> registered_{false};  // found registered with the cell whose construct called it
  std::atomic<bool> training_{false};    // MindSpore's Cell.training, false until set_train
  std::atomic<bool> phase_chosen_{false};  // set_train was called on it or above it
  std::atomic<std::uint64_t> structure_version_{0};  // structure_changed()
  std::atomic<bool> phase_warned_{false};  // warn_if_phase_unchosen said so already
  std::vector<std::pair<long, std::shared_ptr<const BasicForwardHook<T>>>> hooks_;  // by id, ascending
  std::vector<std::pair<long, std::shared_ptr<const BasicBackwardHook<T>>>> backward_hooks_;
  long last_hook_id_ = 0;
  HookOwner<T> hook_owner_;  // what HookHandles find this cell's hooks through

 protected:
  duet::detail::OwnForms forms_;  // this cell's jitted forms: graph_form, Cell's traced_form, kept_form's
};

template <ElementType T>
BasicDynamicCell<T>::~BasicDynamicCell() {
  duet::detail::live_hook_count().fetch_sub(static_cast<long>(hooks_.size() + backward_hooks_.size()));
}

template <ElementType T>
BasicTensor<T> BasicDynamicCell<T>::operator()(const BasicTensor<T>& x) {
  return duet::detail::all_or_nothing([&] { return call(x); });
}

template <ElementType T>
BasicTensor<T> BasicDynamicCell<T>::operator()(const BasicTensor<std::int32_t>& ids) requires(
    !std::is_same_v<T, std::int32_t>) {
  return duet::detail::all_or_nothing([&] { return call(ids); });
}

template <ElementType T>
std::vector<NamedParameter<T>> BasicDynamicCell<T>::parameters() {
  std::vector<NamedParameter<T>> out;
  collect_parameters("", out);
  return out;
}

template <ElementType T>
std::vector<std::pair<std::string, BasicDynamicCell<T>*>> BasicDynamicCell<T>::cells_and_names() {
  std::vector<std::pair<std::string, BasicDynamicCell*>> out;
  collect_cells("", out);
  return out;
}

template <ElementType T>
BasicHookHandle<T> BasicDynamicCell<T>::register_forward_hook(BasicForwardHook<T> hook) {
  refuse_hook_on_other_input_type();
  hooks_.emplace_back(++last_hook_id_, std::make_shared<const BasicForwardHook<T>>(std::move(hook)));
  duet::detail::live_hook_count().fetch_add(1);
  return BasicHookHandle<T>(hook_owner(), last_hook_id_);
}

template <ElementType T>
BasicHookHandle<T> BasicDynamicCell<T>::register_backward_hook(BasicBackwardHook<T> hook) {
  refuse_hook_on_other_input_type();
  backward_hooks_.emplace_back(++last_hook_id_, std::make_shared<const BasicBackwardHook<T>>(std::move(hook)));
  duet::detail::live_hook_count().fetch_add(1);
  return BasicHookHandle<T>(hook_owner(), last_hook_id_);
}

template <ElementType T>
void BasicDynamicCell<T>::refuse_hook_on_other_input_type() const {
  if (const std::string_view other = other_input_type(); !other.empty()) {
    throw ModeError(label() + ": hooks take tensors of its element type (" + std::string(name_of(dtype_of<T>)) +
                    "), and its input holds " + std::string(other) +
                    " values; hook the cell after it (the first that takes its output)");
  }
}

template <ElementType T>
void BasicDynamicCell<T>::remove_hook(long id) {
  const auto before = hooks_.size() + backward_hooks_.size();
  std::erase_if(hooks_, [id](const auto& h) { return h.first == id; });
  std::erase_if(backward_hooks_, [id](const auto& h) { return h.first == id; });
  duet::detail::live_hook_count().fetch_sub(static_cast<long>(before - hooks_.size() - backward_hooks_.size()));
}

template <ElementType T>
BasicDynamicCell<T>* BasicDynamicCell<T>::hooked_cell() {
  if (duet::detail::live_hook_count().load() == 0) return nullptr;
  if (!hooks_.empty() || !backward_hooks_.empty()) return this;
  BasicDynamicCell* found = nullptr;
  for_each_child([&](std::string_view, BasicDynamicCell& c) {
    if (found == nullptr) found = c.hooked_cell();
  });
  return found;
}

template <ElementType T>
std::string BasicDynamicCell<T>::hook_holder() {
  BasicDynamicCell* hooked = hooked_cell();
  if (hooked == this || hooked == nullptr) return "it";
  ensure_named();
  return hooked->label() + " in it";
}

template <ElementType T>
BasicDynamicCell<T>& BasicDynamicCell<T>::set_train(bool mode) {
  for (auto& [path, cell] : cells_and_names()) {
    cell->training_.store(mode, std::memory_order_relaxed);
    cell->phase_chosen_.store(true, std::memory_order_relaxed);
    cell->structure_changed();
  }
  return *this;
}

template <ElementType T>
BasicDynamicCell<T>& BasicDynamicCell<T>::set_requires_grad(bool flag) {
  for (auto& named : cells_and_names()) {
    const BasicDynamicCell* cell = named.second;
    named.second->for_each_own_parameter([&](std::string_view, BasicParameter<T>& p) {
      if (!cell->never_trains(p)) p.requires_grad = flag;
    });
  }
  return *this;
}

template <ElementType T>
void BasicDynamicCell<T>::warn_if_phase_unchosen(std::ostream& out) {
  for (auto& [path, cell] : cells_and_names()) {
    if (!cell->depends_on_phase() || cell->phase_chosen_.load(std::memory_order_relaxed) ||
        cell->phase_warned_.exchange(true)) {
      continue;
    }
    out << "duet: warning: a gradient is taken through " << cell->label()
        << ", which nobody set to train or evaluate, so it runs in evaluation (BatchNorm on its moving "
           "statistics, Dropout as the identity); call set_train(true) on the network to train it, or "
           "set_train(false) if evaluation is meant\n";
  }
}

template <ElementType T>
std::uint64_t BasicDynamicCell<T>::structure_key() {
  std::uint64_t key = structure_version_.load(std::memory_order_acquire);
  for_each_child([&key](std::string_view, BasicDynamicCell& child) {
    key = (key ^ child.structure_key()) * 0x100000001B3u + 0x9E3779B97F4A7C15u;
  });
  return key;
}

template <ElementType T>
BasicTensor<T> BasicDynamicCell<T>::forward_ids(const BasicTensor<std::int32_t>&) {
  const std::string_view other = other_input_type();
  throw ValueError(
      label() + " takes " +
      (other.empty() ? "tensors of " + std::string(name_of(dtype_of<T>)) : std::string(other) + " values") +
      ", got a tensor of " + std::string(name_of(DType::int32)) + " (indices)");
}

template <ElementType T>
void BasicDynamicCell<T>::check_registered() {
  const detail::RunningCell<T>* parent = detail::RunningCell<T>::innermost();
  if (parent == nullptr || registered_.load(std::memory_order_relaxed) || &parent->cell() == this ||
      !parent->holds(this)) {
    return;
  }
  if (!parent->cell().is_ancestor_of(*this)) {
    const std::string lost = parameters().empty() ? "set_train and the network's hooks would not reach it"
                                                  : "its parameters would be neither trained nor saved";
    throw ValueError(parent->cell().label() + " calls a member " + type_name() +
                     " that is not registered with it, so " + lost + "; list the member in DUET_CELL_MEMBERS(...)");
  }
  registered_.store(true, std::memory_order_relaxed);
}

template <ElementType T>
bool BasicDynamicCell<T>::is_ancestor_of(const BasicDynamicCell& cell) {
  bool found = false;
  for_each_child(
      [&](std::string_view, BasicDynamicCell& c) { found = found || &c == &cell || c.is_ancestor_of(cell); });
  return found;
}

template <ElementType T>
void BasicDynamicCell<T>::assign_names(const std::string& path) {
  name_ = path;
  for_each_child([&](std::string_view child, BasicDynamicCell& c) { c.assign_names(join(path, child)); });
  named_.store(true, std::memory_order_release);
}

template <ElementType T>
void BasicDynamicCell<T>::collect_parameters(const std::string& path, std::vector<NamedParameter<T>>& out) {
  for_each_own_parameter([&](std::string_view n, BasicParameter<T>& p) { out.push_back({join(path, n), &p}); });
  for_each_child([&](std::string_view n, BasicDynamicCell& c) { c.collect_parameters(join(path, n), out); });
}

template <ElementType T>
void BasicDynamicCell<T>::collect_cells(const std::string& path,
                                        std::vector<std::pair<std::string, BasicDynamicCell*>>& out) {
  out.emplace_back(path, this);
  for_each_child([&](std::string_view n, BasicDynamicCell& c) { c.collect_cells(join(path, n), out); });
}

using DynamicCell = BasicDynamicCell<float>;

// PyTorch's print(model): the cell's type, then each child by name, indented, a cell with
// children opening a parenthesis as nn.Module's repr does. What each holds and outputs:
// duet::summary. Visiting children is not const (training visits them to change them);
// printing only reads.
template <ElementType T>
std::ostream& operator<<(std::ostream& os, const BasicDynamicCell<T>& cell) {
  const auto print = [&os](const auto& self, BasicDynamicCell<T>& at, const std::string& indent) -> void {
    os << at.repr();
    bool opened = false;
    at.for_each_child([&](std::string_view name, BasicDynamicCell<T>& child) {
      if (!std::exchange(opened, true)) os << "(\n";
      os << indent << "  (" << name << "): ";
      self(self, child, indent + "  ");
      os << "\n";
    });
    if (opened) os << indent << ")";
  };
  print(print, const_cast<BasicDynamicCell<T>&>(cell), "");
  return os;
}

template <class X>
concept DynamicCellType = std::is_base_of_v<BasicDynamicCell<typename X::value_type>, X>;

namespace detail {
template <class X>
inline constexpr bool is_std_array = false;
template <class X, std::size_t N>
inline constexpr bool is_std_array<std::array<X, N>> = true;
}  // namespace detail

// A cell built at run time: a DynamicCell with a forward of its own (a DynamicSequentialCell, or
// a class deriving from DynamicCell), not a Cell<...> with a generic construct. Graph capture
// cannot call it.
template <class C>
concept RuntimeBuilt = DynamicCellType<std::remove_cvref_t<C>> && !requires { std::remove_cvref_t<C>::mode; };

// Whether graph capture can call a cell's construct. A cell that calls one built at run time
// (WithLossCell over a DynamicSequentialCell, say) says it cannot, with a static member
// `capturable = false`: it then runs on real tensors in every mode.
template <class C>
constexpr bool capturable_construct() {
  if constexpr (requires { C::capturable; }) return C::capturable;
  else return true;
}

template <class C, class X>
concept HasConstruct = requires(C& cell, X x) {
  cell.construct(x);
};

// Whether construct takes these tensors: asked without instantiating its body.
template <class C, class... X>
concept ConstructTakes = requires(C& cell, const X&... x) {
  cell.construct(x...);
};

// construct is one plain function, `Tensor construct(const Tensor&)`, not a template: it takes
// real tensors only. (Asked without calling it, so that no construct body is instantiated.)
template <class C>
concept NonGenericConstruct = requires { &C::construct; };

namespace detail {
// The path of a parameter of the cell tree (graph::detail::ParameterNamer), empty if not in it.
template <ElementType T>
std::string parameter_name_in(void* cell, const void* parameter) {
  for (const NamedParameter<T>& p : static_cast<BasicDynamicCell<T>*>(cell)->parameters()) {
    if (p.parameter == parameter) return p.name;
  }
  return {};
}

// What construct is given for an argument of a call on real tensors: a value of parameters
// alone as itself, so that operations on it reach the parameters (the tape watches them), any
// other tensor as a tensor.
template <class X>
decltype(auto) operand_of(const X& x) {
  if constexpr (nn::is_parameter_made_v<X>) return (x);
  else return tensor_of(x);
}

// Names C through the operator's own template parameters, so that a constraint on it is asked
// when the operator is considered, not when Cell<Derived> is instantiated: clang 14 checks a
// non-dependent concept at the base's instantiation, while Derived is still incomplete, and
// keeps that answer ("no construct").
template <class C, class...>
struct deferred {
  using type = C;
};

template <auto Setting>
constexpr Mode mode_of_setting() {
  using S = std::remove_cvref_t<decltype(Setting)>;
  static_assert(std::is_same_v<S, Mode> || std::is_same_v<S, JitConfig>,
                "duet::nn::Cell<Derived, Setting>: Setting is a Mode (GRAPH_MODE, PYNATIVE_MODE, CONTEXT_MODE) "
                "or a JitConfig");
  if constexpr (std::is_same_v<S, JitConfig>) return GRAPH_MODE;
  else return Setting;
}
// Keyed on the cell, so that the mistake is said once, not again for each capture of construct
// (each phase's input is another type).
template <class Derived>
inline constexpr bool construct_takes_what_it_is_given = false;
template <class Derived>
struct construct_not_taking {
  static_assert(construct_takes_what_it_is_given<Derived>,
                "duet::nn::Cell: construct does not take the tensors this cell is called with (their number or "
                "kinds; the cell is the construct_takes_what_it_is_given<...> below): a layer takes what its "
                "construct does (nn::GRU x or x, h0; nn::LSTM x or x, h0, c0), and a training step "
                "(nn::TrainOneStepCell) and value_and_grad pass on every tensor they are given, so a loss cell "
                "whose construct takes the input and the target is called with both (step(x, y), "
                "value_and_grad(net_with_loss, weights)(x, y))");
};

// Keyed on the cell, not on its call's operand types, so that the mistake is said once, not
// again for each capture of construct (each phase's input is another type).
template <class Derived>
inline constexpr bool real_tensor_readable_during_capture = false;
template <class Derived>
struct real_tensor_in_captured_call {
  static_assert(real_tensor_readable_during_capture<Derived>,
                "duet::nn::Cell: called with a symbolic tensor (graph capture) and a real one. construct, or a "
                "function given to value_and_grad or jit, is captured as a graph, and a tensor that is not one of "
                "its inputs (made in construct with duet::randn or duet::ones, a cell's result on such a tensor, a "
                "tensor a lambda captures) would be read once, when capturing, not at each call: pass it as an "
                "input ([](auto logits, auto y) { return loss(logits, y); }), draw noise with ops::randn_like of "
                "an input, or fix the cell to PyNative mode (nn::Cell<Net, PYNATIVE_MODE>)");
};

// False: the cell-and-type pair an assertion names when a cell is called with U values it does
// not declare (Cell's operator()).
template <class C, class U>
inline constexpr bool cell_takes_element_type = false;

// Whether cell C declares (input_value_type) that its input holds U values.
template <class C, class U>
constexpr bool declares_input_value_type() {
  if constexpr (requires { typename C::input_value_type; }) return std::is_same_v<typename C::input_value_type, U>;
  else return false;
}

template <auto Setting>
constexpr JitConfig jit_config_of_setting() {
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(Setting)>, JitConfig>) return Setting;
  else return JitConfig{};
}

// How graph mode compiles network Net: its own JitConfig (nn::Cell<Net, JitConfig{...}>), else
// the default one (a cell that follows the context, a network built at run time).
template <class Net>
constexpr JitConfig graph_config_of() {
  if constexpr (requires { Net::jit_config; }) return Net::jit_config;
  else return JitConfig{};
}
}  // namespace detail

// What a user's network derives from. Setting fixes how the cell runs whatever the context:
// GRAPH_MODE or PYNATIVE_MODE, or a JitConfig (graph mode compiled that way: MindSpore's
// @jit on construct); CONTEXT_MODE, the default, follows set_context at each call.
template <class Derived, auto Setting = CONTEXT_MODE, ElementType T = float>
class Cell : public BasicDynamicCell<T> {
  static constexpr Mode M = detail::mode_of_setting<Setting>();

 public:
  static constexpr Mode mode = M;
  static constexpr JitConfig jit_config = detail::jit_config_of_setting<Setting>();

  // Checked here, once per cell type and where the cell is made, rather than as "cannot convert
  // Sym<...> to const Tensor&" inside the capture. A CONTEXT_MODE cell is refused too: the
  // context may choose graph mode when it runs.
  Cell() {
    static_assert(M == PYNATIVE_MODE || !NonGenericConstruct<Derived>,
                  "duet::nn::Cell: graph mode calls construct with symbolic tensors, so construct must be "
                  "generic: auto construct(auto x) { ... }; a construct taking duet::Tensor runs only in a "
                  "duet::nn::Cell<Net, duet::PYNATIVE_MODE>");
  }

  // One tensor in: the DynamicCell call (hooks, then forward in this cell's mode).
  BasicTensor<T> operator()(const BasicTensor<T>& x) {
    static_assert(HasConstruct<Derived, BasicTensor<T>>,
                  "duet::nn::Cell: called with one tensor, but construct does not take one: a cell defines "
                  "construct(x), generic over its input (auto construct(auto x) { ... }); one whose construct takes "
                  "several (a network with its loss, a sampler with its noise) is called with all of them, and "
                  "duet::summary, io::export_onnx and containers of cells take cells of one input");
    return BasicDynamicCell<T>::operator()(x);
  }

  // Graph capture: construct appends this cell's nodes to the graph its inputs belong to.
  template <graph::Symbolic... S>
    requires(sizeof...(S) >= 1 && capturable_construct<typename detail::deferred<Derived, S...>::type>() &&
             !NonGenericConstruct<typename detail::deferred<Derived, S...>::type>)
  auto operator()(const S&... xs) {
    if constexpr (!takes_symbolic<S...>()) {
      (void)sizeof(detail::construct_not_taking<Derived>);
      return std::get<0>(std::tie(xs...));  // so that nothing after it adds errors
    } else if constexpr (captured_apart<S...>()) {
      check_capture();
      return graph::spliced(xs..., run_construct(graph::continuation<S...>()));
    } else {
      check_capture();
      return run_construct(xs...);
    }
  }

  // A value of parameters alone: a parameter, or what operations on parameters alone make
  // (ops::broadcast_to(h0), a learned query). construct runs on it as it is, so that its result
  // is such a value too, which a graph capture makes again at each call, next to the symbolic
  // inputs (`fc(queries) + x`); both modes run its operations now, with the same kernels. A
  // construct that makes anything else of it gives a tensor, as on any tensor.
  // (Whether construct takes one tensor is asked in the body: clang 14 answers a constraint
  // that does not depend on P while Derived is still incomplete, and keeps the answer.)
  template <class P>
    requires(nn::is_parameter_made_v<P> && std::is_same_v<typename P::value_type, T>)
  auto operator()(const P& x) {
    if constexpr (!HasConstruct<Derived, BasicTensor<T>>) {
      return (*this)(static_cast<const BasicTensor<T>&>(x));  // which says what construct lacks
    } else if constexpr (!nn::is_parameter_made_v<decltype(std::declval<Cell&>().run_construct(x))>) {
      return (*this)(static_cast<const BasicTensor<T>&>(x));
    } else {
      return duet::detail::all_or_nothing([&] {
        this->check_registered();
        this->ensure_named();
        return this->observed_call(x, [&] {
          EagerScope eager;
          return run_construct(x);
        });
      });
    }
  }

  // Whether construct takes these symbolic inputs, asked of the types it is then called with
  // (one input: a continuation of its own), so that asking instantiates nothing more.
  template <class... S>
  static constexpr bool takes_symbolic() {
    if constexpr (sizeof...(S) == 1) return ConstructTakes<Derived, decltype(graph::continuation<S...>())>;
    else return ConstructTakes<Derived, S...>;
  }

  // Whether a call on one symbolic input is captured on an input of its own and spliced after
  // the input's graph: appending each of its operations to that graph would copy the graph
  // once per operation.
  template <class... S>
  static constexpr bool captured_apart() {
    if constexpr (sizeof...(S) == 1) {
      return graph::Symbolic<decltype(std::declval<Derived&>().construct(graph::continuation<S...>()))>;
    } else {
      return false;
    }
  }

  // A statically shaped input: both modes check it against the layers at compile time and
  // return a StaticTensor of the inferred output shape.
  template <index_t... D>
  auto operator()(const StaticTensor<T, D...>& x) {
    using Captured = decltype(std::declval<Derived&>().construct(graph::input<T, StaticShape<D...>>()));
    if constexpr (M != PYNATIVE_MODE) {
      if (runs_as_graph()) {
        this->check_registered();
        this->ensure_named();
        return to_static_tensor<Captured>(
            duet::detail::all_or_nothing([&] { return run_graph<StaticShape<D...>>(x.tensor()); }));
      }
    }
    return to_static_tensor<Captured>((*this)(x.tensor()));
  }

  // One tensor of the element type the cell declares its input has, when that is not T:
  // `using input_value_type = std::int32_t;` in nn::Embedding and in a network that begins with
  // one (any other cell given a tensor of another type does not compile: its operations would
  // read the elements as T's). construct runs in this cell's mode, as for a tensor of T. Its
  // hooks take tensors of T, so a hook on this cell is refused where it is registered.
  template <ElementType U>
    requires(!std::is_same_v<U, T> && detail::declares_input_value_type<Derived, U>() &&
             HasConstruct<Derived, BasicTensor<U>>)
  auto operator()(const BasicTensor<U>& x) {
    auto y = duet::detail::all_or_nothing([&] {
      this->check_registered();
      this->ensure_named();
      return run_other_input(x);
    });
    // duet::summary observes this call too (its input, of another element type, is not passed).
    if constexpr (std::is_same_v<decltype(y), BasicTensor<T>>) {
      if (const BasicForwardHook<T>* observer = detail::call_observer<T>) (*observer)(*this, BasicTensor<T>{}, y);
    }
    return y;
  }

  // A tensor of another element type that the cell does not declare: said here, instead of
  // every overload's reasons (int64 ids in a torch.long habit, indices without a declaration, a
  // double tensor for a float network).
  template <ElementType U>
    requires(!std::is_same_v<U, T> && !detail::declares_input_value_type<Derived, U>())
  BasicTensor<T> operator()(const BasicTensor<U>&) {
    static_assert(detail::cell_takes_element_type<Derived, U>,
                  "duet::nn::Cell: called with a tensor of another element type than the cell's own (its "
                  "parameters' and construct's): a layer inside a network gets the network's type as its last "
                  "template argument (nn::Dense<In, Out, double>); a network of int32 indices (nn::Embedding "
                  "first) declares `using input_value_type = std::int32_t;` (int64 ids are converted to int32 "
                  "first); other values are converted to the cell's type");
    return {};  // of the cell's type, so that nothing after it adds errors
  }

  // A symbolic tensor and a real one: construct is being captured (graph mode, or a function
  // given to value_and_grad or jit), and the real tensor is not one of the capture's inputs. It
  // would be read once, when capturing, and be a constant of every later call: noise drawn with
  // duet::randn in construct, a target a lambda closes over. Said here, once, rather than as
  // every overload's reasons. (A value of parameters alone is not such a tensor.)
  template <class... X>
    requires(sizeof...(X) >= 2 && (graph::Symbolic<X> || ...) &&
             ((!graph::Symbolic<X> && !nn::is_parameter_made_v<X>) || ...))
  decltype(auto) operator()(const X&... xs) {
    (void)sizeof(detail::real_tensor_in_captured_call<Derived>);
    const auto first_symbolic = [](const auto& self, const auto& x, const auto&... rest) -> decltype(auto) {
      if constexpr (graph::Symbolic<decltype(x)>) return (x);
      else return self(self, rest...);
    };
    return first_symbolic(first_symbolic, xs...);  // so that nothing after it adds errors
  }

  // Symbolic tensors beside values of parameters alone (a learned initial state given to a
  // recurrent layer, rnn(x, h0)): construct appends its nodes, and capture makes the
  // parameters' values again at each run, as an operation's own would.
  template <class... X>
    requires(sizeof...(X) >= 2 && (graph::Symbolic<X> || ...) && !(graph::Symbolic<X> && ...) &&
             ((graph::Symbolic<X> || nn::is_parameter_made_v<X>) && ...))
  auto operator()(const X&... xs) {
    check_capture();
    return run_construct(xs...);
  }

  // Cells whose construct takes several tensors (a network with its loss, say). They are not
  // DynamicCells of one input, so they run no forward hooks of their own. (Values of
  // parameters alone among them, as above.)
  template <class... X>
  requires(sizeof...(X) >= 2 && ((is_tensor_v<X> || is_static_tensor_v<X> || nn::is_parameter_made_v<X>)&&...))
  auto operator()(const X&... xs) {
    return duet::detail::all_or_nothing([&] {
      this->check_registered();
      this->ensure_named();
      // (Nested: asking Capturable compiles construct on symbolic tensors, which a cell fixed to
      // PyNative mode need not take.)
      if constexpr (M != PYNATIVE_MODE) {
        if constexpr (can_capture() && graph::Capturable<Derived&, X...>) {
          if (runs_as_graph()) return run_graph<typename graph::pattern_of<X>::type...>(tensor_of(xs)...);
        } else {
          // construct calls a cell built at run time, so it cannot be captured: it runs on the
          // tensors, and each cell it calls follows the mode itself (graph mode traces that one).
          if (runs_as_graph()) return run_construct(detail::operand_of(xs)...);
        }
      }
      EagerScope eager;
      return run_construct(detail::operand_of(xs)...);
    });
  }

  // Whether construct takes tensors X... (asked by value_and_grad and the training step, so
  // that a call that cannot work is said once, before anything is compiled for it).
  template <class... X>
  static constexpr bool construct_takes() {
    return ConstructTakes<Derived, X...>;
  }

  std::string type_name() const override { return duet::detail::readable_type_name(typeid(Derived)); }
  std::string_view other_input_type() const override {
    if constexpr (takes_other_input()) return name_of(dtype_of<typename Derived::input_value_type>);
    return {};
  }

 protected:
  bool traced_in_graph_mode() const override { return false; }

  // Before a call on symbolic tensors. Hooks cannot run inside a graph: refused here rather
  // than silently dropped.
  void check_capture() {
    if (this->has_hooks_in_tree()) {
      throw ModeError(this->label() + " is captured into a graph (graph mode or jit), but " + this->hook_holder() +
                      " has a hook; hooks see intermediate values in PyNative mode only");
    }
    this->check_registered();
  }

  template <class Captured>
  static auto to_static_tensor(BasicTensor<T> y) {
    constexpr Shape s = Captured::shape;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return StaticTensor<T, s[static_cast<int>(I)]...>(std::move(y));
    }
    (std::make_index_sequence<static_cast<std::size_t>(s.rank())>{});
  }

 public:
  // A std::array of cells or parameters is PyTorch's nn.ModuleList / nn.ParameterList: each
  // element is registered under the array's name and its index ("blocks.0.weight").
  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    for_each_member([&](std::string_view name, auto& member) {
      for_each_element(name, member, [&](std::string_view element_name, auto& element) {
        using Member = std::remove_cvref_t<decltype(element)>;
        if constexpr (DynamicCellType<Member>) {
          static_assert(std::is_same_v<typename Member::value_type, T>,
                        "duet::nn::Cell: a member layer's element type is not the cell's (a float layer in a network "
                        "of double?): give every layer the network's type, its last template argument "
                        "(nn::Dense<In, Out, double>, nn::LSTM<In, Hidden, double>)");
          if constexpr (std::is_same_v<typename Member::value_type, T>) visit(element_name, element);
        }
      });
    });
  }

  void for_each_own_parameter(const typename BasicDynamicCell<T>::ParameterVisitor& visit) override {
    for_each_member([&](std::string_view name, auto& member) {
      for_each_element(name, member, [&](std::string_view element_name, auto& element) {
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(element)>, BasicParameter<T>>)
          visit(element_name, element);
      });
    });
  }

  // The program a graph-mode call with inputs like xs runs in phase P: the one captured by the
  // first such call and kept, with the values construct read then as its constants.
  // duet::compare_modes reads it, so that it compares what graph mode really runs.
  template <graph::Phase P, class... Patterns, class... Ts>
  const auto& graph_program(const BasicTensor<Ts>&... xs) {
    this->check_registered();
    this->ensure_named();
    return captured<P, Patterns...>(xs...);
  }

 protected:
  // A PyNative grad records the operations as they run; a graph would be one opaque call to
  // its tape. Under a recording tape, a graph-mode cell therefore runs its construct eagerly:
  // the same numbers, and gradients that reach its parameters. So does a cell duet::summary
  // observes, so that the call of each cell inside it is seen, and one a PIJit trace runs
  // through, whose replay would otherwise read the graph's output as a constant.
  static bool runs_as_graph() {
    return effective_mode(M) == GRAPH_MODE && autodiff::active_tape() == nullptr &&
           detail::call_observer<T> == nullptr && pijit::active_trace() == nullptr;
  }

  BasicTensor<T> forward(const BasicTensor<T>& x) override {
    if constexpr (takes_other_input()) {
      // construct is written for its own input type (ops::gather on the indices, say): compiled
      // for tensors of T it could fail to compile, and it could never run on them. Said as
      // nn::Embedding says it.
      using U = typename Derived::input_value_type;
      throw ValueError(this->label() + " takes " +
                       (std::is_same_v<U, std::int32_t> ? std::string("int32 indices")
                                                        : std::string(name_of(dtype_of<U>)) + " values") +
                       ", got a tensor of " + std::string(name_of(dtype_of<T>)));
    } else if constexpr (!HasConstruct<Derived, BasicTensor<T>>) {
      throw ModeError(this->label() + ": construct takes several inputs, and this call (duet::summary, a container of "
                      "cells, a call through nn::DynamicCell) gives it one; call the cell with all of them (duet::summary "
                      "with a shape for each: summary(net, {{2, 4}, {2, 3}}))");
    } else if constexpr (!std::is_convertible_v<decltype(std::declval<Derived&>().construct(x)), BasicTensor<T>>) {
      // Said here, where every call of a cell goes, rather than as "no type named value_type"
      // in the capture and the trace.
      // A tensor of another element type comes from a layer of another type, refused where
      // construct called it.
      using Result = std::remove_cvref_t<decltype(std::declval<Derived&>().construct(x))>;
      static_assert(std::is_convertible_v<Result, BasicTensor<T>> || is_tensor_v<Result>,
                    "duet::nn::Cell: construct must return one tensor; for several results (PyTorch's "
                    "`return out, mu, logvar`) return ops::concat<-1>(out, mu, logvar) and take them apart with "
                    "ops::split<-1, ...>, or give the cell a method per result that calls its layers");
      return {};
    } else {
      if constexpr (can_capture() && construct_captures() && !runs_alone_as_its_operation()) {
        if (runs_as_graph()) return run_graph<graph::AnyShape>(x);
      } else if constexpr (can_capture()) {
        if (runs_as_graph()) refuse_hooks_in_graph();
      }
      EagerScope eager;
      return run_construct(x);
    }
  }

  // Indices through the run-time interface (a DynamicSequentialCell that begins with this
  // cell, a DynamicCell&): as the call on them above, for a cell that declares int32 input.
  BasicTensor<T> forward_ids(const BasicTensor<std::int32_t>& ids) override {
    if constexpr (detail::declares_input_value_type<Derived, std::int32_t>() && !std::is_same_v<T, std::int32_t>) {
      if constexpr (HasConstruct<Derived, BasicTensor<std::int32_t>>) {
        if constexpr (std::is_convertible_v<decltype(run_other_input(ids)), BasicTensor<T>>)
          return run_other_input(ids);
      }
    }
    return BasicDynamicCell<T>::forward_ids(ids);
  }

 private:
  Derived& derived() { return static_cast<Derived&>(*this); }

  // Whether construct takes tensors of another element type than the cell's (`using
  // input_value_type`: nn::Embedding's indices).
  static constexpr bool takes_other_input() {
    if constexpr (requires { typename Derived::input_value_type; })
      return !std::is_same_v<typename Derived::input_value_type, T>;
    else
      return false;
  }

  // construct on a tensor of the element type the cell declares for its input, in its mode.
  template <class U>
  auto run_other_input(const BasicTensor<U>& x) {
    if constexpr (can_capture()) {
      if (runs_as_graph()) return run_graph<graph::AnyShape>(x);
    }
    EagerScope eager;
    return run_construct(x);
  }

  // Whether calls may run as a graph. A non-generic construct never does: the constructor
  // reports it, and nothing else should.
  static constexpr bool can_capture() { return M != PYNATIVE_MODE && !NonGenericConstruct<Derived>; }

  // construct, with this cell as the one whose members the cells it calls are checked against.
  template <class... X>
  auto run_construct(X&&... xs) {
    const detail::RunningCell<T> running(*this, &derived(), sizeof(Derived));
    if constexpr ((graph::Symbolic<std::remove_cvref_t<X>> || ...)) {
      const graph::detail::NamingParameters naming(static_cast<BasicDynamicCell<T>*>(this), &detail::parameter_name_in<T>);
      return derived().construct(std::forward<X>(xs)...);
    } else {
      return derived().construct(std::forward<X>(xs)...);
    }
  }

  void refuse_hooks_in_graph() {
    if (this->has_hooks_in_tree()) {
      throw ModeError(this->label() + " runs in graph mode, but " + this->hook_holder() +
                      " has a hook; hooks see intermediate values in PyNative mode only "
                      "(set_context({.mode = PYNATIVE_MODE}))");
    }
  }

  // Whether construct captures on one input: one that calls a cell built at run time gives a
  // real tensor (BasicDynamicCell's call on a symbolic one), and runs on real tensors in every
  // mode, as one declaring `capturable = false` does; the cells it calls follow the mode. Asked
  // of run_graph's own input type, so that nothing more is compiled.
  static constexpr bool construct_captures() {
    if constexpr (!can_capture())
      return false;
    else
      return !is_tensor_v<decltype(std::declval<Derived&>().construct(
          graph::input<T, graph::pattern_in_phase<graph::Phase::train, graph::AnyShape>, 0>()))>;
  }

  // Whether this cell, called alone on one tensor in graph mode, would run a graph of one
  // operation that graph mode runs as PyNative mode does: no neighbour to fuse with, no weight
  // to keep packed (the one pass a single node can take). The operation itself is then that
  // call, the same kernel and bits, and the cell carries no graph form of its own: a virtual
  // forward's form is compiled with the cell's type whether or not anything calls it alone
  // (tools/compile_costs.md, 2026-12-05). A cell that fixes graph mode or a JitConfig keeps its
  // graph. The capture asked here is the one run_graph's would make (same input type), so a
  // cell that keeps its form compiles its construct once.
  static constexpr bool runs_alone_as_its_operation() {
    if constexpr (M != CONTEXT_MODE || NonGenericConstruct<Derived>) {
      return false;  // the constructor's assertion says why a non-generic construct is refused
    } else {
      using Captured = decltype(std::declval<Derived&>().construct(
          graph::input<T, graph::pattern_in_phase<graph::Phase::train, graph::AnyShape>, 0>()));
      if constexpr (!graph::Symbolic<Captured>) {
        return false;
      } else {
        using G = typename Captured::graph_type;
        if constexpr (G::size != 2) return false;
        else return !requires(const graph::node_at<G, 1>& node) { node.op.with_packed_weight(); };
      }
    }
  }

  // Capture, optimise, run, in the phase the network's layers are set to. Capture and passes
  // cost nothing at run time (they are types); the plan for the inputs' shapes is kept per
  // thread and form, so repeated shapes skip planning.
  template <class... Patterns, class... Ts>
  auto run_graph(const BasicTensor<Ts>&... xs) {
    refuse_hooks_in_graph();
    return pipeline::in_requested_phase(
        [&](auto phase) -> const auto& { return captured<decltype(phase)::value, Patterns...>(xs...); },
        [&](const auto& program) {
          if (!program.ambiguity.empty()) return traced_form<std::remove_cvref_t<decltype(program)>, Ts...>()(xs...);
          return pipeline::execute<jit_config>(
              this->id(), program, [this] { return this->type_name() + "::construct"; }, xs...);
        });
  }

  // construct is captured once per cell, thread and phase, as MindSpore compiles it once per
  // phase: on a small network capturing costs as much as running. Values construct reads while
  // it is captured are constants of the graph. A cell's id is never reused, and a moved cell
  // gets a new one, so the program's references to this cell and its members stay valid.
  template <graph::Phase P, class... Patterns, class... Ts>
  const auto& captured(const BasicTensor<Ts>&...) {
    return pipeline::captured_once(this->id(), [&] {
      auto program =
          pipeline::compile<jit_config, false, pipeline::Input<Ts, graph::pattern_in_phase<P, Patterns>>...>(
              [&](const auto&... in) { return run_construct(in...); });
      if (!program.ambiguity.empty()) {
        duet::detail::log_ambiguous_capture(this->type_name() + "::construct", program.ambiguity.str(),
                                            "as a traced graph (PIJit)");
      }
      return program;
    });
  }

  // Graph mode when capture cannot make the graph (graph::Sym::ambiguity): construct
  // traced on tensors (PIJit) on the first call for each input shape, and replayed after. The
  // trace knows each value at run time, which the captured graph's types cannot. One form per
  // phase (Program: the phase's capture), as captured graphs are: a trace holds the operations
  // of the phase it was made in (Dropout's, BatchNorm's), which a replay in the other refuses.
  template <class Program, class... Ts>
  auto& traced_form() {
    using R = BasicTensor<typename decltype(run_construct(std::declval<const BasicTensor<Ts>&>()...))::value_type>;
    using Form = JitFunction<jit_config, duet::detail::ErasedCall<R, BasicTensor<Ts>...>>;
    struct InPhase : Form {
      explicit InPhase(Form&& form) : Form(std::move(form)) {}
    };
    return this->forms_.template get<InPhase>([this] {
      return Form({this, [](void* self, const BasicTensor<Ts>&... xs) {
                     return R(static_cast<Cell*>(self)->run_construct(xs...));
                   }},
                  {.mode = JitMode::PIJit, .name = this->type_name() + "::construct, traced"});
    });
  }

  // f(name, member), or for a std::array member f("name.i", element) for each element.
  template <class Member, class F>
  static void for_each_element(std::string_view name, Member& member, F&& f) {
    if constexpr (detail::is_std_array<Member>) {
      for (std::size_t i = 0; i < member.size(); ++i) f(std::string(name) + "." + std::to_string(i), member[i]);
    } else {
      f(name, member);
    }
  }

  template <class F>
  void for_each_member(F&& f) {
    if constexpr (hana::Struct<Derived>::value) {
      hana::for_each(hana::accessors<Derived>(), [&](auto accessor) {
        f(std::string_view(hana::to<const char*>(hana::first(accessor))), hana::second(accessor)(derived()));
      });
    }
  }
};

// A layer whose sizes are template arguments (nn::Conv2d<1, 6, 5>, nn::BatchNorm2d<16>), as its
// run-time sized form Runtime (nn::Conv2d<>, nn::BatchNorm2d<>) with those sizes in its type.
// Captured into a graph it appends what Layer::sized_construct makes, an operation whose
// static shape rule checks the network while the program compiles; everywhere else (PyNative
// mode, a call alone in graph mode) it is Runtime. So a network's layers of one kind share one
// cell's code whatever their sizes: the PyNative operations with their gradients and traces,
// the cell's own graph forms. As a cell type each, examples/resnet_fashion.cpp's 7 sizes of
// convolution took a fifth of its compile time.
template <class Layer, class Runtime>
class SizedLayer : public Runtime {
  using T = typename Runtime::value_type;

 public:
  using Runtime::Runtime;

  BasicTensor<T> operator()(const BasicTensor<T>& x) { return Runtime::operator()(x); }

  // Captured on an input of its own and spliced after x's graph, as Cell's calls are.
  template <graph::Symbolic S>
  auto operator()(const S& x) {
    this->check_capture();
    return graph::spliced(x, static_cast<Layer*>(this)->sized_construct(graph::continuation<S>()));
  }

  // A static shape is checked against the sizes in the type while the program compiles.
  template <index_t... D>
  auto operator()(const StaticTensor<T, D...>& x) {
    using Captured = decltype(std::declval<Layer&>().sized_construct(graph::input<T, StaticShape<D...>>()));
    return Runtime::template to_static_tensor<Captured>(Runtime::operator()(x.tensor()));
  }
};

namespace detail {
// An operation's layer as its run-time sized form (SizedLayer), whose functions the operation's
// kernels and descriptions call, so that they are compiled once for all sizes; any other layer
// (ONNX import's description of a node, say) as itself.
template <class Layer>
auto* runtime_form(Layer* layer) {
  if constexpr (requires { typename std::remove_const_t<Layer>::runtime_type; }) {
    using R = typename std::remove_const_t<Layer>::runtime_type;
    return static_cast<std::conditional_t<std::is_const_v<Layer>, const R, R>*>(layer);
  } else {
    return layer;
  }
}

// The mode a callable's type fixes: a cell's own (a JitConfig fixes GRAPH_MODE), and
// CONTEXT_MODE for a cell that follows the context or for anything that is not a cell.
template <class F>
constexpr Mode fixed_mode_of() {
  using C = std::remove_cvref_t<F>;
  if constexpr (requires { requires std::same_as<std::remove_cv_t<decltype(C::mode)>, Mode>; }) return C::mode;
  else return CONTEXT_MODE;
}
}  // namespace detail

}  // namespace duet::nn
