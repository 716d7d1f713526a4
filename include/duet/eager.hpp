// PyNative evaluation of one operation: run its shape rule, allocate its output from the
// pool, call its kernel. The graph evaluator uses the same rule and the same kernel, which is
// why the two modes agree.
#pragma once

#include <array>
#include <utility>

#include "backend.hpp"
#include "diagnostics.hpp"
#include "graph.hpp"
#include "tensor.hpp"

namespace duet {

namespace detail {
template <class Op, class T>
Shape checked_output_shape(const Op& op, const BasicTensor<T>& x) {
  const std::array<Shape, 1> in{x.shape()};
  const ShapeResult r = op.infer(in);
  if (!r.ok()) throw ShapeError(describe_fault(r, op.label(), in));
  return r.shape;
}
}  // namespace detail

template <class Backend = DefaultBackend, class Op, class T>
BasicTensor<T> run_eager(const Op& op, const BasicTensor<T>& x) {
  const Shape out_shape = detail::checked_output_shape(op, x);
  if constexpr (Op::is_view) {
    return x.reshape(out_shape);
  } else {
    auto y = BasicTensor<T>::uninitialized(out_shape);
    const T* in[1] = {x.data()};
    op.template run<Backend>(in, &x.shape(), y.data(), out_shape);
    return y;
  }
}

// A temporary nobody else holds is overwritten in place by elementwise operations.
template <class Backend = DefaultBackend, class Op, class T>
BasicTensor<T> run_eager(const Op& op, BasicTensor<T>&& x) {
  if constexpr (Op::is_elementwise) {
    if (x.use_count() == 1) {
      const Shape out_shape = detail::checked_output_shape(op, x);
      const T* in[1] = {x.data()};
      op.template run<Backend>(in, &x.shape(), x.data(), out_shape);
      return std::move(x);
    }
  }
  return run_eager<Backend>(op, static_cast<const BasicTensor<T>&>(x));
}

// The one entry point layers use: on a symbolic tensor it records the operation in the graph,
// on a real tensor it runs it now.
template <class Op, class X>
auto apply(const Op& op, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return graph::append(op, x);
  } else {
    return run_eager(op, std::forward<X>(x));
  }
}

}  // namespace duet
