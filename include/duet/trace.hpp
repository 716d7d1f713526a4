// The recording half of PIJit: while a trace is active, every eager operation appends a step
// (the op, the values it reads and the value it makes), so a network built at run time can be
// captured by running it once. pijit.hpp optimises and replays the trace.
#pragma once

#include <array>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "error.hpp"
#include "graph.hpp"
#include "interchange.hpp"
#include "ops/evaluation_norm.hpp"
#include "parameter.hpp"
#include "tensor.hpp"

namespace duet {
namespace fn {
struct Relu;
struct LeakyRelu;
}  // namespace fn
namespace ops {
template <class Layer>
struct BiasAddOp;
template <class... Fns>
struct MapOp;
}  // namespace ops
}  // namespace duet

namespace duet::pijit {

class Trace;

// The trace recording on this thread, if any. Eager operations check it once each.
inline Trace*& active_trace() {
  thread_local Trace* trace = nullptr;
  return trace;
}

// A value of the trace: an input of the traced function, a constant it read (a tensor the trace
// did not make, held by handle), or what a step makes.
struct Value {
  enum class Kind : unsigned char { input, constant, computed, view };
  Kind kind = Kind::computed;
  Shape shape;
  std::size_t element_size = 0;
  DType dtype = DType::float32;        // what the elements are (an exporter writes them so)
  std::size_t input = 0;               // Kind::input: which argument
  std::size_t view_of = 0;             // Kind::view: the value whose memory it shares
  std::size_t view_bytes = 0;          // Kind::view: where in that memory it begins
  std::shared_ptr<const void> handle;  // Kind::constant, or any kind in a trace that keeps values:
  const void* data = nullptr;          // keeps the tensor's storage alive, and its elements
  std::string cell;                    // in a trace that keeps values: the cell running when it was made
};

// What a step is as the epilogue of the step before it, for fusion after the trace (pijit.hpp).
// A trace holds its steps behind this interface, and no code sees a producer's type and its
// consumer's together, so each step states once what kind of epilogue its op would be, and the
// producer's own rule (accepts_epilogue) is asked about that kind: the rules read a consumer's
// kind (its layer's bias; elementwise functions, with parameters or without), never which
// functions it runs. Nothing is compiled per pair of op types.
struct EpilogueRole {
  enum class Kind : unsigned char { none, bias, functions, normalization };
  Kind kind = Kind::none;
  bool parameterless = false;   // Kind::functions: none holds a parameter (LeakyReLU's alpha)
  const void* layer = nullptr;  // Kind::bias: whose bias
  // Kind::normalization: an ops::EvaluationNorm<T> of the trace's element type, the BatchNorm
  // at evaluation that the product before it may fold in.
  std::shared_ptr<const void> norm{};
};

class Step {
 public:
  virtual ~Step() = default;
  // data[v] is value v's memory; views are resolved before.
  virtual void run(void* const* data, const std::vector<Value>& values) const = 0;
  virtual EpilogueRole as_epilogue() const { return {}; }
  // This step with `next` (writing `output`) taken into its own kernel, when its op takes it
  // so (a product its layer's bias); null otherwise.
  virtual std::unique_ptr<Step> absorb(const EpilogueRole& /*next*/, std::size_t /*output*/) const { return nullptr; }
  // Whether its op takes elementwise functions (of the role's kind) as epilogue, which then run
  // in place on its output (pijit.hpp's EpilogueChain).
  virtual bool takes_functions(bool /*parameterless*/) const { return false; }
  // Whether it rounds differently from the steps it replaced (a BatchNorm folded into a
  // convolution's weight): its results agree with theirs within a tolerance, not bit for bit.
  virtual bool rounds_differently() const { return false; }
  // This step reading its weight packed between calls (JitLevel O1 and O2), if it has a weight.
  virtual std::unique_ptr<Step> with_packed_weight() const = 0;
  virtual bool is_view() const = 0;
  virtual bool runs_kernel() const = 0;
  // What graph_ir prints for it: the operation's name, and who runs it (empty if nobody else).
  virtual std::string op_name() const = 0;
  virtual std::string label() const = 0;
  // What it is in ONNX's vocabulary (interchange.hpp), for io::export_onnx; empty if its op
  // does not say.
  virtual ops::Interchange interchange(std::span<const Shape> /*in*/) const { return {}; }

  std::vector<std::size_t> inputs;
  std::size_t output = 0;
  // The part of the traced function that recorded it (Trace::locate), which an error replaying
  // it names; empty for none.
  std::string where;
};

template <class Op, class T>
class OpStep;

namespace detail {
template <class Op, class T>
std::unique_ptr<Step> fused(const Op& op, const Step& from, std::size_t output) {
  auto s = std::make_unique<OpStep<Op, T>>(op);
  s->inputs = from.inputs;
  s->output = output;
  s->where = from.where;
  return s;
}

template <class X>
inline constexpr bool is_bias_add_v = false;
template <class L>
inline constexpr bool is_bias_add_v<ops::BiasAddOp<L>> = true;

// Op's own epilogue rule, asked of consumer C.
template <class Op, class C>
inline constexpr bool accepts_epilogue = requires { requires Op::template accepts_epilogue<C>; };
}  // namespace detail

template <class Op, class T>
class OpStep final : public Step {
 public:
  explicit OpStep(const Op& op) : op_(op) {}

  void run(void* const* data, const std::vector<Value>& values) const override {
    if constexpr (graph::runs_kernel<Op>()) run_kernel(data, values);
  }

  // The layer's own bias add, if the op's rule takes it: the rule names the type, and two
  // layers may share one, so the layer is compared too.
  std::unique_ptr<Step> absorb(const EpilogueRole& next, std::size_t output) const override {
    if constexpr (requires { typename Op::layer_type::value_type; }) {
      using Bias = ops::BiasAddOp<typename Op::layer_type>;
      if constexpr (detail::accepts_epilogue<Op, Bias>) {
        if (next.kind == EpilogueRole::Kind::bias && next.layer == op_.layer) {
          const auto with_bias = op_.absorb(Bias{op_.layer});
          return detail::fused<std::remove_cvref_t<decltype(with_bias)>, T>(with_bias, *this, output);
        }
      }
    }
    if constexpr (requires(const ops::EvaluationNorm<T>& norm) { op_.absorb(norm); }) {
      if (next.kind == EpilogueRole::Kind::normalization) {
        const auto folded = op_.absorb(*static_cast<const ops::EvaluationNorm<T>*>(next.norm.get()));
        return detail::fused<std::remove_cvref_t<decltype(folded)>, T>(folded, *this, output);
      }
    }
    (void)next;
    (void)output;
    return nullptr;
  }

  // A one-function MapOp of the kind asked stands for any: the rules read only the kind.
  bool takes_functions(bool parameterless) const override {
    return parameterless ? detail::accepts_epilogue<Op, ops::MapOp<fn::Relu>>
                         : detail::accepts_epilogue<Op, ops::MapOp<fn::LeakyRelu>>;
  }

  std::unique_ptr<Step> with_packed_weight() const override {
    if constexpr (requires { op_.with_packed_weight(); }) {
      return detail::fused<decltype(op_.with_packed_weight()), T>(op_.with_packed_weight(), *this, output);
    } else {
      return nullptr;
    }
  }

  EpilogueRole as_epilogue() const override {
    if constexpr (requires { Op::elementwise_functions; }) {
      return {EpilogueRole::Kind::functions, Op::parameterless, nullptr};
    } else if constexpr (detail::is_bias_add_v<Op>) {
      return {EpilogueRole::Kind::bias, false, op_.layer};
    } else if constexpr (requires { { op_.evaluation_norm() } -> std::same_as<ops::EvaluationNorm<T>>; }) {
      return {EpilogueRole::Kind::normalization, false, nullptr,
              std::make_shared<const ops::EvaluationNorm<T>>(op_.evaluation_norm())};
    } else {
      return {};
    }
  }

  bool rounds_differently() const override {
    if constexpr (requires { Op::folds; }) return Op::folds;
    else return false;
  }

  bool is_view() const override { return Op::is_view; }
  bool runs_kernel() const override { return graph::runs_kernel<Op>(); }
  std::string op_name() const override { return Op::op_name(); }
  std::string label() const override { return op_.label() == Op::op_name() ? std::string() : op_.label(); }
  ops::Interchange interchange(std::span<const Shape> in) const override {
    if constexpr (requires { op_.interchange(in); }) return op_.interchange(in);
    else return {};
  }

 private:
  // Instantiated only for ops with a kernel: views have none.
  void run_kernel(void* const* data, const std::vector<Value>& values) const {
    std::array<const void*, Op::arity> in{};
    std::array<Shape, Op::arity> shapes{};
    for (std::size_t k = 0; k < static_cast<std::size_t>(Op::arity); ++k) {
      in[k] = data[inputs[k]];
      shapes[k] = values[inputs[k]].shape;
    }
    op_.template run<DefaultBackend, T>(graph::KernelArgs{in.data(), shapes.data(), data[output], values[output].shape});
  }

  Op op_;
};

// Begins a new backward pass on the replaying thread, where the traced one began one.
class BackwardPassStep final : public Step {
 public:
  void run(void* const*, const std::vector<Value>&) const override { duet::detail::begin_backward_pass(); }
  std::unique_ptr<Step> with_packed_weight() const override { return nullptr; }
  bool is_view() const override { return false; }
  bool runs_kernel() const override { return true; }
  std::string op_name() const override { return "BeginBackwardPass"; }
  std::string label() const override { return {}; }
};

// A trace as text, one line per step in graph_ir's form ("%3 = MatMul(%0) : [1, 6]  nn::Dense<6, 6> 'wq'"),
// each input or constant on a line of its own before its first reader.
inline std::string describe(const std::vector<Value>& values, const std::vector<std::unique_ptr<Step>>& steps,
                            std::size_t output) {
  std::string text;
  std::vector<bool> shown(values.size(), false);
  const auto show_source = [&](std::size_t v) {
    const Value& value = values[v];
    if (shown[v] || (value.kind != Value::Kind::input && value.kind != Value::Kind::constant)) return;
    shown[v] = true;
    text += "  %" + std::to_string(v) + " = " +
            (value.kind == Value::Kind::input ? "Input " + std::to_string(value.input) : std::string("Constant")) +
            " : " + to_string(value.shape) + "\n";
  };
  for (const auto& step : steps) {
    for (std::size_t v : step->inputs) show_source(v);
    std::string args;
    for (std::size_t v : step->inputs) args += (args.empty() ? "%" : ", %") + std::to_string(v);
    const std::string who = step->label();
    text += "  %" + std::to_string(step->output) + " = " + step->op_name() + (args.empty() ? "" : "(" + args + ")") +
            " : " + to_string(values[step->output].shape) + (who.empty() ? "" : "  " + who) + "\n";
  }
  show_source(output);
  return text + "  return %" + std::to_string(output) + "\n";
}

class Trace {
 public:
  Trace() : generation_(next_generation()) {}

  // Marks x (this handle and copies made from it afterwards) as input k.
  template <class T>
  void add_input(BasicTensor<T>& x, std::size_t k) {
    Value v;
    v.kind = Value::Kind::input;
    v.shape = x.shape();
    v.element_size = sizeof(T);
    v.dtype = dtype_of<T>;
    v.input = k;
    add(std::move(v), x);
  }

  // A sink (an op that makes no value: a parameter's gradient written in place) is a step of a
  // training step's trace only; in any other it is a graph break.
  template <class Op, class T, class... In>
  void record(const Op& op, BasicTensor<T>& y, const BasicTensor<In>&... x) {
    if constexpr (graph::is_sink<Op>()) {
      if (!parameter_gradients_) mark_broken("calls " + op.label() + ", which makes no value");
    }
    // A host callback is C++ the replay would run on values it never saw made: the caller runs
    // eagerly instead, so that it is a plain call every time.
    if constexpr (graph::is_host_op<Op>()) {
      std::string what = Op::allowed_break ? "calls duet::host, a host callback marked allowed_break, at "
                                           : "calls duet::host, a host callback, at ";
      what += op.where.to_string();
      if (host_call_.empty() || (!Op::allowed_break && !unmarked_host_call_)) host_call_ = what;
      unmarked_host_call_ = unmarked_host_call_ || !Op::allowed_break;
      mark_broken(what);
    }
    auto step = std::make_unique<OpStep<Op, T>>(op);
    (step->inputs.push_back(value_of(x)), ...);
    std::size_t view_offset_bytes = 0;
    if constexpr (Op::is_view) {
      view_offset_bytes = static_cast<std::size_t>(view_offset(op, values_[step->inputs[0]].shape)) * sizeof(T);
    }
    keep(std::move(step), y, graph::is_sink<Op>(), Op::is_view, view_offset_bytes);
  }

  // Every value a step makes stays readable (Value::data) for the trace's life, as PyNative
  // computed it: duet::compare_modes reads them against graph mode's. A trace to replay keeps
  // none, since replay computes them again.
  void keep_values() { keep_values_ = true; }

  // A backward pass begins (parameters' gradients are assigned afresh from here): a step, so
  // that each replay begins its own.
  void record_backward_pass() {
    differentiates_ = true;
    auto step = std::make_unique<BackwardPassStep>();
    step->output = values_.size();
    values_.push_back(Value{});
    steps_.push_back(std::move(step));
  }

  // The traced function is a whole training step, whose parameters' gradients are written in
  // place by its gradient ops: those are steps to replay, not breaks.
  void allow_parameter_gradients() { parameter_gradients_ = true; }

  // Whether the traced function differentiates (a backward pass began in it): its weights are
  // then those being trained, written between calls.
  bool differentiates() const { return differentiates_; }

  // Whether a tensor of this trace id is one of the trace's values.
  bool knows(std::uint64_t trace_id) const {
    return trace_id != 0 && (trace_id >> 32) == (generation_ & 0xFFFFFFFFu) && (trace_id & 0xFFFFFFFFu) <= values_.size();
  }

  // The value a tensor is, or nothing if the trace never saw it.
  template <class T>
  std::size_t find(const BasicTensor<T>& x) const {
    const std::uint64_t id = x.trace_id();
    if ((id >> 32) != (generation_ & 0xFFFFFFFFu) || id == 0) return values_.size();
    return static_cast<std::size_t>((id & 0xFFFFFFFFu) - 1);
  }

  // A cell ran during the trace; its check says whether it has hooks now.
  void note_cell(std::function<bool()> has_hooks) { cells_.push_back(std::move(has_hooks)); }

  // The steps recorded from now on are those of `where` (an ONNX node of io::OnnxModel), which
  // an error replaying one names, as the traced call's error did; empty for none.
  const std::string& location() const { return where_; }
  void locate(std::string where) { where_ = std::move(where); }

  // The cells whose forward is running, innermost last: what a graph break is blamed on.
  void enter_cell(std::string label) { running_.push_back(std::move(label)); }
  void leave_cell() { running_.pop_back(); }

  // The trace cannot be replayed, because the running cell does `what`; the first reason stays.
  void mark_broken(const std::string& what) {
    if (broken_.empty()) broken_ = (running_.empty() ? std::string("the function") : running_.back()) + " " + what;
  }
  std::vector<std::function<bool()>>& cells() { return cells_; }

  std::vector<Value>& values() { return values_; }
  const std::vector<Value>& values() const { return values_; }
  std::vector<std::unique_ptr<Step>>& steps() { return steps_; }
  const std::vector<std::unique_ptr<Step>>& steps() const { return steps_; }
  // Why the trace cannot be replayed, or empty.
  const std::string& broken() const { return broken_; }
  // The host callback the traced function called (an unmarked one first), for the jit syntax
  // level to refuse; empty if none.
  const std::string& host_call() const { return host_call_; }
  bool unmarked_host_call() const { return unmarked_host_call_; }

 private:
  static std::uint64_t next_generation() {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  // A tensor the trace did not make is a constant: read through its handle at every replay.
  template <class T>
  std::size_t value_of(const BasicTensor<T>& x) {
    const std::size_t v = find(x);
    if (v < values_.size()) return v;
    Value c;
    c.kind = Value::Kind::constant;
    c.shape = x.shape();
    c.element_size = sizeof(T);
    c.dtype = dtype_of<T>;
    auto handle = std::make_shared<BasicTensor<T>>(x);
    c.data = handle->data();
    c.handle = std::move(handle);
    values_.push_back(std::move(c));
    return values_.size() - 1;
  }

  std::size_t root_of(std::size_t v) const {
    while (values_[v].kind == Value::Kind::view) v = values_[v].view_of;
    return v;
  }

  // The op-independent half of record, compiled once per element type rather than per op.
  template <class T>
  void keep(std::unique_ptr<Step> step, BasicTensor<T>& y, bool sink, bool view, std::size_t view_offset_bytes) {
    Value v;
    v.element_size = sink ? 0 : sizeof(T);
    v.dtype = dtype_of<T>;
    v.shape = sink ? Shape{} : y.shape();
    if (view) {
      v.kind = Value::Kind::view;
      v.view_of = root_of(step->inputs[0]);
      const Value& in = values_[step->inputs[0]];
      v.view_bytes = (in.kind == Value::Kind::view ? in.view_bytes : 0) + view_offset_bytes;
    }
    if (!sink && keep_values_) {
      auto handle = std::make_shared<BasicTensor<T>>(y);
      v.data = handle->data();
      v.handle = std::move(handle);
      if (!running_.empty()) v.cell = running_.back();
    }
    step->output = values_.size();
    step->where = where_;
    add(std::move(v), y);
    steps_.push_back(std::move(step));
  }

  template <class T>
  void add(Value v, BasicTensor<T>& tensor) {
    values_.push_back(std::move(v));
    tensor.set_trace_id(((generation_ & 0xFFFFFFFFu) << 32) | values_.size());
  }

  std::uint64_t generation_;
  std::vector<Value> values_;
  std::vector<std::unique_ptr<Step>> steps_;
  std::vector<std::function<bool()>> cells_;
  std::vector<std::string> running_;
  std::string host_call_;
  bool unmarked_host_call_ = false;
  std::string broken_;
  std::string where_;
  bool parameter_gradients_ = false;
  bool differentiates_ = false;
  bool keep_values_ = false;
};

// Names a cell as running in the active trace, if any, for its lifetime.
class TracedCell {
 public:
  template <class Label>
  explicit TracedCell(Label&& label) : trace_(active_trace()) {
    if (trace_ != nullptr) trace_->enter_cell(label());
  }
  TracedCell(const TracedCell&) = delete;
  TracedCell& operator=(const TracedCell&) = delete;
  ~TracedCell() {
    if (trace_ != nullptr) trace_->leave_cell();
  }
  Trace* trace() const { return trace_; }

 private:
  Trace* trace_;
};

// Locates the active trace's steps, if a trace is active, at `where` for its lifetime.
class TracedLocation {
 public:
  explicit TracedLocation(const std::string& where) : trace_(active_trace()) {
    if (trace_ == nullptr) return;
    outer_ = trace_->location();
    trace_->locate(where);
  }
  TracedLocation(const TracedLocation&) = delete;
  TracedLocation& operator=(const TracedLocation&) = delete;
  ~TracedLocation() {
    if (trace_ != nullptr) trace_->locate(std::move(outer_));
  }

 private:
  Trace* trace_;
  std::string outer_;
};

// A tensor of the trace (an input, a constant it read, or what a step made) read or written
// element by element by the traced C++: `if (ops::sum(x).item() > 0)` took one branch when
// traced, and a replay would take it again whatever the value (helper-91); the caller runs
// eagerly instead, as for a host callback.
inline void break_on_host_access(std::uint64_t trace_id) {
  Trace* trace = active_trace();
  if (trace == nullptr || !trace->knows(trace_id)) return;
  trace->mark_broken("reads a tensor's value in C++ (item() or an element), which a replay would not read again; "
                     "to branch on a value, run the network in PyNative mode or compute with ops::where");
}

// Makes a trace the active one for its lifetime.
class Tracing {
 public:
  explicit Tracing(Trace* trace)
      : outer_(std::exchange(active_trace(), trace)),
        outer_hook_(std::exchange(duet::detail::host_access_hook(), &break_on_host_access)) {}
  Tracing(const Tracing&) = delete;
  Tracing& operator=(const Tracing&) = delete;
  ~Tracing() {
    active_trace() = outer_;
    duet::detail::host_access_hook() = outer_hook_;
  }

 private:
  Trace* outer_;
  duet::detail::HostAccessHook outer_hook_;
};

}  // namespace duet::pijit
