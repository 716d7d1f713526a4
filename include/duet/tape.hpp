// The PyNative half of autodiff: a tape that records each operation as it runs, then walks
// back over the records calling each operation's gradient op, the same op graph mode
// appends to its backward graph.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "error.hpp"
#include "graph.hpp"
#include "ops/parameter.hpp"
#include "parameter.hpp"
#include "tensor.hpp"
#include "trace.hpp"

namespace duet {

namespace detail {
template <class Backend, class Op, class First, class... Rest>
auto run_into_new(const Op& op, const BasicTensor<First>& first, const BasicTensor<Rest>&... rest);
}  // namespace detail

namespace ops {

// The sum of two gradients reaching one value.
struct GradAddOp : Primitive<GradAddOp> {
  static constexpr int arity = 2;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::add(a.in<T>(0), a.in<T>(1), a.in_shape(0).numel(), a.out<T>());
  }
  static std::string op_name() { return "GradAdd"; }
};

}  // namespace ops

namespace autodiff {

class Tape;
template <class T>
class CellRecord;

// The tape recording on this thread, if any. Eager operations check it once each.
inline Tape*& active_tape() {
  thread_local Tape* tape = nullptr;
  return tape;
}

class Entry {
 public:
  virtual ~Entry() = default;
  virtual void backward(Tape& tape) = 0;
  // Appends the entries of the values it reads, in the order it reads them.
  virtual void append_inputs(const Tape&, std::vector<std::size_t>&) const {}
};

// An entry whose value can receive a gradient.
template <class T>
class ValueEntry : public Entry {
 public:
  // Gradients from several readers add up, through an op that a trace records. Never in place:
  // the first may alias another value.
  void accumulate(BasicTensor<T> g) { (cells_.empty() ? whole_ : cells_.back()).add(std::move(g)); }
  const BasicTensor<T>* grad() const { return whole_.has ? &whole_.grad : nullptr; }

  // While a hooked cell that reads this value runs backward, what its records send is kept
  // apart from what the rest sends (a skip connection around it), so that its hook sees the
  // gradient through the cell alone, PyTorch's grad_input; cells within it are kept apart again.
  void open_cell() { cells_.emplace_back(); }
  // What the cell's records sent, an empty tensor if nothing, now added to the rest.
  BasicTensor<T> close_cell() {
    Sum cell = std::move(cells_.back());
    cells_.pop_back();
    if (!cell.has) return {};
    (cells_.empty() ? whole_ : cells_.back()).add(cell.grad);
    return cell.grad;
  }
  // Everything sent so far, what open cells keep apart included; false if nothing.
  bool sent_so_far(BasicTensor<T>& out) const {
    Sum total = whole_;
    for (const Sum& cell : cells_) {
      if (cell.has) total.add(cell.grad);
    }
    out = total.grad;
    return total.has;
  }

 private:
  struct Sum {
    BasicTensor<T> grad;
    bool has = false;
    void add(BasicTensor<T> g);
  };
  Sum whole_;
  std::vector<Sum> cells_;
};

// A value the caller differentiates with respect to (an input of grad_position).
template <class T>
class LeafEntry final : public ValueEntry<T> {
 public:
  void backward(Tape&) override {}
};

class Tape {
 public:
  Tape() : generation_(next_generation()) {}
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  // Tracks x (the handle given, and copies made from it afterwards) as a leaf.
  template <class T>
  void watch(BasicTensor<T>& x) {
    add(std::make_unique<LeafEntry<T>>(), x);
  }

  // A handle on p's values that the tape tracks: what reaches it in backward is added to p's
  // gradient, as a layer's gradient kernel adds to its weight's.
  template <class T>
  BasicTensor<T> watch_parameter(const nn::BasicParameter<T>& p);

  // A gradient was taken (duet::grad, value_and_grad) while this tape recorded: its result is
  // a constant here, as PyTorch's is without create_graph=True. Said if nothing else reaches
  // the output, the one sign of a gradient of a gradient (WGAN-GP's penalty), which duet has not.
  void note_gradient_within() { gradient_within_ = true; }

  template <class T>
  bool tracks(const BasicTensor<T>& x) const {
    return index_of(x.tape_id()) < entries_.size();
  }

  // The entry x is, entries_.size() if none.
  template <class T>
  std::size_t position_of(const BasicTensor<T>& x) const {
    return index_of(x.tape_id());
  }

  template <class T>
  ValueEntry<T>* entry_of(const BasicTensor<T>& x) const {
    const std::size_t i = index_of(x.tape_id());
    return i < entries_.size() ? static_cast<ValueEntry<T>*>(entries_[i].get()) : nullptr;
  }

  // Called by every eager operation while this tape is active.
  template <class Op, class Out, class... In>
  void record(const Op& op, BasicTensor<Out>& y, const BasicTensor<In>&... x);

  // Records a cell call, for its backward hooks, and its end once its output is known.
  template <class T, class Hook>
  CellRecord<T>* begin_cell(const BasicTensor<T>& input, Hook hook);
  template <class T>
  void end_cell(CellRecord<T>* cell, const BasicTensor<T>& output);

  // Seeds d(output)/d(output) = 1 and runs the gradient of every record the output depends
  // on, in backward_order.
  template <class T>
  void backward(const BasicTensor<T>& output);

 private:
  // The records `from` depends on, as graph capture lays out a program's nodes: a depth-first
  // post-order from the output, each record's inputs left to right, reversed. Walking them
  // so, the gradients reaching one value add up in the order graph mode's backward graph adds
  // them (autodiff::build_backward walks the captured nodes last first), whatever order C++
  // evaluated the operands of an expression in (g++ and clang++ differ). With a cell's
  // backward hook, the records keep the order they were made in: the hook runs once every
  // record made after its cell was entered has run, and hooks run in PyNative mode only.
  std::vector<std::size_t> backward_order(std::size_t from) const;

  static std::uint64_t next_generation() {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  std::size_t index_of(std::uint64_t id) const {
    return (id >> 32) == (generation_ & 0xFFFFFFFFu) && id != 0 ? static_cast<std::size_t>((id & 0xFFFFFFFFu) - 1)
                                                                : entries_.size();
  }

  template <class T>
  void add(std::unique_ptr<Entry> e, BasicTensor<T>& value) {
    entries_.push_back(std::move(e));
    value.set_tape_id(((generation_ & 0xFFFFFFFFu) << 32) | entries_.size());
  }

  std::uint64_t generation_;
  std::vector<std::unique_ptr<Entry>> entries_;
  bool has_cell_hooks_ = false;
  bool gradient_within_ = false;
};

// Makes a tape the active one for its lifetime (nested scopes restore the outer tape).
class Recording {
 public:
  explicit Recording(Tape* tape) : outer_(std::exchange(active_tape(), tape)) {}
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
  ~Recording() { active_tape() = outer_; }

 private:
  Tape* outer_;
};

template <class T>
void ValueEntry<T>::Sum::add(BasicTensor<T> g) {
  if (!has) {
    grad = std::move(g);
    has = true;
    return;
  }
  grad = duet::detail::run_into_new<DefaultBackend>(ops::GradAddOp{}, grad, g);
}

// One recorded operation: the op, the handles of its inputs and output, and the gradient of
// its output once readers have sent theirs.
template <class Op, class Out, class... In>
class OpEntry final : public ValueEntry<Out> {
 public:
  OpEntry(const Op& op, const BasicTensor<Out>& y, const BasicTensor<In>&... x) : op_(op), output_(y), inputs_(x...) {}

  void append_inputs(const Tape& tape, std::vector<std::size_t>& out) const override {
    std::apply([&](const auto&... x) { ((tape.tracks(x) ? out.push_back(tape.position_of(x)) : void()), ...); },
               inputs_);
  }

  void backward(Tape& tape) override {
    const BasicTensor<Out>* g = this->grad();
    if (g == nullptr) return;
    bool parameters_written = false;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (input_backward<K>(tape, *g, parameters_written), ...);
    }(std::index_sequence_for<In...>{});
    if constexpr (has_parameters<Op>()) {
      if (!parameters_written) run_grad(op_.parameter_grad_op(), *g);
    }
  }

 private:
  template <std::size_t K>
  void input_backward(Tape& tape, const BasicTensor<Out>& g, bool& parameters_written) const {
    if constexpr (input_has_gradient<Op, K>()) {
      const auto& x = std::get<K>(inputs_);
      if (!tape.tracks(x)) return;
      tape.entry_of(x)->accumulate(run_grad(op_.template grad_op<K>(), g));
      parameters_written = parameters_written || K == 0;
    } else if constexpr (loses_gradient<Op, std::tuple_element_t<K, std::tuple<In...>>, Out>) {
      if (tape.tracks(std::get<K>(inputs_))) throw ValueError(lost_gradient_message(op_.label(), K));
    }
  }

  template <graph::Operand O>
  const auto& operand(const BasicTensor<Out>& g) const {
    if constexpr (O == graph::Operand::grad)
      return g;
    else if constexpr (O == graph::Operand::output)
      return output_;
    else
      return std::get<static_cast<std::size_t>(O) - 1>(inputs_);
  }

  template <class GradOp>
  auto run_grad(const GradOp& gop, const BasicTensor<Out>& g) const {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return duet::detail::run_into_new<DefaultBackend>(gop, operand<GradOp::reads[I]>(g)...);
    }
    (std::make_index_sequence<GradOp::reads.size()>{});
  }

  Op op_;
  BasicTensor<Out> output_;
  std::tuple<BasicTensor<In>...> inputs_;
};

// The output of an operation that has no gradient (argmax), computed from something being
// differentiated: harmless unless a gradient reaches it, which is refused.
template <class Out>
class RefusedEntry final : public ValueEntry<Out> {
 public:
  explicit RefusedEntry(std::string label) : label_(std::move(label)) {}
  void backward(Tape&) override {
    if (this->grad() != nullptr) {
      throw ValueError("duet::grad: " + label_ + " is not differentiable, but a gradient flows through it");
    }
  }

 private:
  std::string label_;
};

// A parameter read directly by operations: its gradient goes to the parameter.
template <class T>
class ParameterEntry final : public ValueEntry<T> {
 public:
  explicit ParameterEntry(const nn::BasicParameter<T>* p) : parameter_(p) {}
  void backward(Tape&) override {
    if (const BasicTensor<T>* g = this->grad()) {
      duet::detail::run_into_new<DefaultBackend>(ops::ParameterGradOp<T>{parameter_}, *g);
    }
  }

 private:
  const nn::BasicParameter<T>* parameter_;
};

template <class T>
BasicTensor<T> Tape::watch_parameter(const nn::BasicParameter<T>& p) {
  BasicTensor<T> handle = p;
  add(std::make_unique<ParameterEntry<T>>(&p), handle);
  return handle;
}

// A cell call, recorded before the cell's own records and ended after them (CellEnd), so that
// walking back the end comes first and keeps the input's gradient from the cell's records apart.
template <class T>
class CellRecord : public Entry {
 public:
  explicit CellRecord(const BasicTensor<T>& input) : input_(input) {}

  void open(Tape& tape) {
    if (ValueEntry<T>* in = tape.entry_of(input_)) {
      in->open_cell();
      opened_ = true;
    }
  }

  BasicTensor<T> output;

 protected:
  BasicTensor<T> input_;
  bool opened_ = false;
};

template <class T>
class CellEnd final : public Entry {
 public:
  explicit CellEnd(CellRecord<T>* cell) : cell_(cell) {}
  void backward(Tape& tape) override { cell_->open(tape); }

 private:
  CellRecord<T>* cell_;
};

// After the cell's own records have run backward, its hook sees both gradients: the input's
// through the cell, empty where the input takes none (PyTorch's None), and the output's.
template <class T, class Hook>
class CellEntry final : public CellRecord<T> {
 public:
  CellEntry(const BasicTensor<T>& input, Hook hook) : CellRecord<T>(input), hook_(std::move(hook)) {}

  void backward(Tape& tape) override {
    ValueEntry<T>* in = tape.entry_of(this->input_);
    const BasicTensor<T> through = this->opened_ ? in->close_cell() : BasicTensor<T>();
    const ValueEntry<T>* out = tape.entry_of(this->output);
    if (out == nullptr) return;
    // A cell that gives its very input back (a construct returning x) passes on all that reached it,
    // what a cell around it keeps apart included.
    if (out == in) {
      BasicTensor<T> whole;
      if (out->sent_so_far(whole)) hook_(whole, whole);
      return;
    }
    if (out->grad() != nullptr) hook_(through, *out->grad());
  }

 private:
  Hook hook_;
};

template <class Op, class Out, class... In>
void Tape::record(const Op& op, BasicTensor<Out>& y, const BasicTensor<In>&... x) {
  static_cast<void>(sizeof(diagnostic::check_operation<Op>));
  if constexpr (DifferentiableOperation<Op>) {
    // The output depends on what is differentiated through any input the operation does not
    // cut (graph mode's connected_to_differentiated).
    const bool reads_differentiated = [&]<std::size_t... K>(std::index_sequence<K...>) {
      return ((tracks(x) && !cuts_gradient<Op, K>()) || ...);
    }(std::index_sequence_for<In...>{});
    if (!reads_differentiated && !has_parameters<Op>()) return;
    add(std::make_unique<OpEntry<Op, Out, In...>>(op, y, x...), y);
  } else if ((tracks(x) || ...)) {
    add(std::make_unique<RefusedEntry<Out>>(op.label()), y);
  }
}

template <class T, class Hook>
CellRecord<T>* Tape::begin_cell(const BasicTensor<T>& input, Hook hook) {
  auto entry = std::make_unique<CellEntry<T, Hook>>(input, std::move(hook));
  CellRecord<T>* cell = entry.get();
  entries_.push_back(std::move(entry));
  has_cell_hooks_ = true;
  return cell;
}

template <class T>
void Tape::end_cell(CellRecord<T>* cell, const BasicTensor<T>& output) {
  cell->output = output;
  entries_.push_back(std::make_unique<CellEnd<T>>(cell));
}

template <class T>
void Tape::backward(const BasicTensor<T>& output) {
  ValueEntry<T>* seed = entry_of(output);
  if (seed == nullptr) {
    throw ValueError(std::string(nothing_differentiated_message) +
                     (gradient_within_ ? ". A gradient was taken inside it (duet::grad or value_and_grad): that gradient is a "
                                         "constant to this one, as torch.autograd.grad's is without create_graph=True; "
                                         "duet has no gradient of a gradient (a WGAN-GP penalty, double backward)"
                                       : ""));
  }
  seed->accumulate(full<T>(output.shape(), T(1)));
  Recording off(nullptr);
  detail::begin_backward_pass();
  if (pijit::Trace* trace = pijit::active_trace()) trace->record_backward_pass();
  for (std::size_t i : backward_order(index_of(output.tape_id()))) entries_[i]->backward(*this);
}

}  // namespace autodiff
}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/tape_impl.hpp"
#endif
