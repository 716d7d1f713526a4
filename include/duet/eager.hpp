// PyNative evaluation of one operation: run its shape rule, allocate its output from the
// pool, call its kernel. The graph evaluator uses the same rule and the same kernel, which is
// why the two modes agree.
#pragma once

#include <array>
#include <tuple>
#include <type_traits>
#include <utility>

#include "backend.hpp"
#include "diagnostics.hpp"
#include "graph.hpp"
#include "parameter.hpp"
#include "tape.hpp"
#include "trace.hpp"
#include "tensor.hpp"

namespace duet {

namespace detail {

template <class Op, std::size_t N>
Shape checked_output_shape(const Op& op, const std::array<Shape, N>& in) {
  const ShapeResult r = op.infer(in);
  if (!r.ok()) {
    const std::string label = op.label();
    std::string message = describe_fault(r, label, in);
    if constexpr (!names_its_layer<Op>) message += called_in(label, RunningConstruct::innermost_where());
    throw ShapeError(message);
  }
  return r.shape;
}

template <class Backend, class Op, class First, class... Rest>
auto run_into_new(const Op& op, const BasicTensor<First>& first, const BasicTensor<Rest>&... rest) {
  using T = graph::op_value_t<Op, First>;
  const std::array<Shape, 1 + sizeof...(Rest)> shapes{first.shape(), rest.shape()...};
  const Shape out_shape = checked_output_shape(op, shapes);
  const std::array<const void*, 1 + sizeof...(Rest)> in{first.data(), rest.data()...};
  BasicTensor<T> y;
  if constexpr (Op::is_view) {
    if constexpr (graph::runs_kernel<Op>()) {
      op.template run<Backend, T>(graph::KernelArgs{in.data(), shapes.data(), nullptr, out_shape});
    }
    y = first.view(view_offset(op, shapes[0]), out_shape);
  } else if constexpr (graph::is_sink<Op>()) {
    op.template run<Backend, T>(graph::KernelArgs{in.data(), shapes.data(), nullptr, out_shape});
    if (pijit::Trace* trace = pijit::active_trace()) trace->record(op, y, first, rest...);
    return y;
  } else {
    y = BasicTensor<T>::uninitialized(out_shape);
    op.template run<Backend, T>(graph::KernelArgs{in.data(), shapes.data(), y.data(), out_shape});
  }
  // The trace first: the tape keeps a copy of y, which must already be the trace's value.
  if (pijit::Trace* trace = pijit::active_trace()) trace->record(op, y, first, rest...);
  if (autodiff::Tape* tape = autodiff::active_tape()) tape->record(op, y, first, rest...);
  return y;
}

}  // namespace detail

template <class Backend = DefaultBackend, class Op, class T>
auto run_eager(const Op& op, const BasicTensor<T>& x) {
  return detail::run_into_new<Backend>(op, x);
}

// A temporary nobody else holds is overwritten in place by elementwise operations, unless a
// tape or a trace records: their records keep the values they read.
template <class Backend = DefaultBackend, class Op, class T>
auto run_eager(const Op& op, BasicTensor<T>&& x) {
  if constexpr (Op::is_elementwise) {
    if (x.use_count() == 1 && autodiff::active_tape() == nullptr && pijit::active_trace() == nullptr) {
      const std::array<Shape, 1> shapes{x.shape()};
      const Shape out_shape = detail::checked_output_shape(op, shapes);
      const void* in[1] = {x.data()};
      op.template run<Backend, T>(graph::KernelArgs{in, shapes.data(), x.data(), out_shape});
      return std::move(x);
    }
  }
  return detail::run_into_new<Backend>(op, static_cast<const BasicTensor<T>&>(x));
}

namespace detail {

// An operand of an operation that runs now: a parameter is tracked by the recording tape (its
// gradient goes to the parameter), any other tensor is itself.
template <class X>
decltype(auto) eager_operand(const X& x) {
  if constexpr (nn::is_parameter_v<X>) {
    if (autodiff::Tape* tape = autodiff::active_tape()) return tape->watch_parameter(x);
    return BasicTensor<typename X::value_type>(x);
  } else {
    return tensor_of(x);
  }
}

// What an operand a ParameterResult keeps stands for: the parameter, or the result itself.
template <class P>
const P& recipe_source(const P* parameter) {
  return *parameter;
}
template <class R>
const R& recipe_source(const R& result) {
  return result;
}

// A result of operations on parameters alone, captured after `anchor`'s graph: each operand
// after the one before it, so that every parameter node is appended, none merged
// (graph::parameter_after says why), then the operation on them.
template <class A, class X>
auto parameter_result_after(const A& anchor, const X& x) {
  if constexpr (nn::is_parameter_v<X>) {
    return graph::parameter_after(anchor, x);
  } else {
    const auto made_after = [](const auto& self, const auto& last, const auto& first, const auto&... rest) {
      auto made = parameter_result_after(last, recipe_source(first));
      if constexpr (sizeof...(rest) == 0) return std::tuple(made);
      else return std::tuple_cat(std::tuple(made), self(self, made, rest...));
    };
    auto y = std::apply(
        [&](const auto&... o) {
          return std::apply([&](const auto&... made) { return graph::append(x.op, made...); },
                            made_after(made_after, anchor, o...));
        },
        x.operands);
    y.ids.back() = x.node_id;
    return y;
  }
}

// An operand of an operation being captured, whose first symbolic operand is `anchor`: a
// parameter becomes a node appended to anchor's graph, and a result of operations on
// parameters alone those operations on such nodes. Appended, not a graph of its own merged:
// as the first operand (`scale * x`) that graph came first, its node before the inputs, and
// graph mode read the input in the parameter's place (a wrong result, no error), or met a
// later parameter there (a false ambiguous capture).
template <class A, class X>
decltype(auto) graph_operand(const A& anchor, const X& x) {
  if constexpr (nn::is_parameter_v<X> || nn::is_parameter_result_v<X>) return parameter_result_after(anchor, x);
  else return (x);
}

// The first symbolic one of xs.
template <class X, class... Rest>
const auto& first_symbolic(const X& x, const Rest&... rest) {
  if constexpr (graph::Symbolic<X>) return x;
  else return first_symbolic(rest...);
}

// What a ParameterResult keeps of an operand: a parameter by address (it is a cell's member,
// and capture reads it live), a result whole.
template <class X>
auto recipe_operand(const X& x) {
  if constexpr (nn::is_parameter_v<X>) return &x;
  else return x;
}

// An operation on parameters alone, run now: its value, with how to make it again.
template <class Op, class... X>
auto run_on_parameters(const Op& op, const X&... xs) {
  auto y = run_into_new<DefaultBackend>(op, eager_operand(xs)...);
  using T = typename decltype(y)::value_type;
  return nn::ParameterResult<T, Op, decltype(recipe_operand(xs))...>(std::move(y), op, recipe_operand(xs)...);
}

template <class X>
struct StaticOperand {
  static constexpr Shape shape = X::static_shape;
};

// An operation on static tensors outside construct: its rule is checked at compile time, as in
// construct, and the result is a StaticTensor of the shape the rule gives.
template <class Op, class... X>
auto run_static(const Op& op, const X&... xs) {
  diagnostic::report_static_fault<Op, StaticOperand<X>...>();
  auto y = run_into_new<DefaultBackend>(op, tensor_of(xs)...);
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, sizeof...(X)>{X::static_shape...});
  if constexpr (r.ok() && !r.shape.leading_unknown()) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return StaticTensor<typename decltype(y)::value_type, r.shape[static_cast<int>(I)]...>(std::move(y));
    }
    (std::make_index_sequence<static_cast<std::size_t>(r.shape.rank())>{});
  } else {
    return y;
  }
}

// A class keyed on the operation, not its operands' graphs, so that a mistake is reported once,
// not again for each capture of construct (each phase's input is another type).
template <class Op>
inline constexpr bool operands_readable_during_capture = false;
template <class Op>
struct real_tensor_during_capture {
  static_assert(operands_readable_during_capture<Op>,
                "duet: an operation mixes a symbolic tensor (graph capture) and a real one; pass "
                "every tensor the graph reads as an input of the captured function. A cell's own "
                "parameters, and what operations on them alone make (ops::exp(log_scale)), may be "
                "operands next to a symbolic tensor; a tensor made from anything else in construct "
                "(duet::zeros, a member Tensor, Tensor::reshape of a parameter) is a value of the capture, "
                "not of each call: make it an nn::Parameter of the cell, reach it through ops:: "
                "(ops::reshape), or fix the cell to PyNative mode (nn::Cell<Net, PYNATIVE_MODE>). A function given to "
                "value_and_grad or jit that calls a cell built at run time (nn::DynamicSequentialCell) takes "
                "`const duet::Tensor&`, not `auto`");
};
}  // namespace detail

// The one entry point layers use: on symbolic tensors it records the operation in the graph,
// on static tensors it checks the shapes at compile time and runs it now, on other tensors it
// runs it now. A cell's parameter may be an operand in either mode, and so may what operations
// on parameters alone give (nn::ParameterResult).
template <class Op, class X>
auto apply(const Op& op, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return graph::append(op, x);
  } else if constexpr (is_static_tensor_v<std::remove_cvref_t<X>>) {
    return detail::run_static(op, x);
  } else if constexpr (nn::is_parameter_made_v<std::remove_cvref_t<X>>) {
    return detail::run_on_parameters(op, x);
  } else {
    return run_eager(op, std::forward<X>(x));
  }
}

template <class Op, class A, class B, class... C>
auto apply(const Op& op, const A& a, const B& b, const C&... c) {
  constexpr bool any_symbolic = graph::Symbolic<A> || graph::Symbolic<B> || (graph::Symbolic<C> || ...);
  if constexpr (any_symbolic) {
    constexpr bool readable = (graph::Symbolic<A> || nn::is_parameter_made_v<A>)&&(graph::Symbolic<B> ||
                                                                                 nn::is_parameter_made_v<B>)&&(
        (graph::Symbolic<C> || nn::is_parameter_made_v<C>)&&...);
    if constexpr (!readable) static_cast<void>(sizeof(detail::real_tensor_during_capture<Op>));
    // After the assertion, a symbolic operand stands for the result, so that the mistake is
    // reported once, not again by every operation after it.
    if constexpr (!readable && graph::Symbolic<A>) return a;
    else if constexpr (!readable) return b;
    else {
      const auto& anchor = detail::first_symbolic(a, b, c...);
      return graph::append(op, detail::graph_operand(anchor, a), detail::graph_operand(anchor, b),
                           detail::graph_operand(anchor, c)...);
    }
  } else if constexpr (is_static_tensor_v<A> && is_static_tensor_v<B> && (is_static_tensor_v<C> && ...)) {
    return detail::run_static(op, a, b, c...);
  } else if constexpr (nn::is_parameter_made_v<A> && nn::is_parameter_made_v<B> && (nn::is_parameter_made_v<C> && ...)) {
    return detail::run_on_parameters(op, a, b, c...);
  } else {
    return detail::run_into_new<DefaultBackend>(op, detail::eager_operand(a), detail::eager_operand(b),
                                                detail::eager_operand(c)...);
  }
}

}  // namespace duet
