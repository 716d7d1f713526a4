// softmax and log_softmax along one axis (MindSpore's ops.softmax(x, axis=-1),
// ops.log_softmax, nn.Softmax(axis), nn.LogSoftmax(axis)), in both modes.
//
// The axis is a member of the operation, not a template argument as the reductions' axes are:
// the output has the input's shape whatever the axis, so graph mode needs it only when the
// kernel runs, and nn::Softmax(axis) takes it at run time as MindSpore's does. Its range is
// checked against the input's rank where the rule runs on concrete shapes (ShapeError).
//
// Numerically stable: each slice has its maximum m subtracted before exp, so the largest term
// is exp(0) = 1 and logits of 1000 give no inf or NaN; log_softmax is x - m - log Σ exp(x - m),
// never the log of a rounded-to-zero probability. Gradients come from the output y:
//   softmax:     dx = y · (dy - Σ dy·y)
//   log_softmax: dx = dy - exp(y) · Σ dy
// The kernels use the reductions' layout ([outer, axis, inner]): a contiguous slice per row
// when the axis is the last one (Eigen's vectorised exp and sums), otherwise a row of `inner`
// elements at a time along the axis, with the running maximum and sum in a per-thread scratch
// row that stops growing once it has the largest size seen (no allocation per call once warm).
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "../cell.hpp"
#include "../nn/activation.hpp"
#include "reduction.hpp"

namespace duet {
namespace ops {

namespace detail {

// [outer, size, inner] around one axis of a concrete shape.
struct AxisLayout {
  index_t outer = 0;
  index_t size = 0;
  index_t inner = 0;
};

inline AxisLayout axis_layout(const Shape& s, int axis) {
  const int a = axis < 0 ? axis + s.rank() : axis;
  AxisLayout l{1, s[a], s.numel_from(a + 1)};
  for (int i = 0; i < a; ++i) l.outer *= s[i];
  return l;
}

template <class T>
T* scratch_row(index_t n) {
  thread_local std::vector<T> row;
  if (row.size() < static_cast<std::size_t>(n)) row.resize(static_cast<std::size_t>(n));
  return row.data();
}

template <class Self>
struct AxisMember {
  int axis = -1;

  ShapeResult infer(std::span<const Shape> in) const {
    const Shape& x = in[0];
    if (!x.leading_unknown() && (axis >= x.rank() || axis < -x.rank())) {
      return fault(x, ShapeFault::min_rank, axis < 0 ? -axis : axis + 1);
    }
    return {x};
  }
  std::string label() const { return Self::op_name() + "(axis=" + std::to_string(axis) + ")"; }
};

}  // namespace detail

template <bool Log>
struct SoftmaxGradOp;

template <bool Log>
struct SoftmaxOp : Primitive<SoftmaxOp<Log>>, detail::AxisMember<SoftmaxOp<Log>> {
  using detail::AxisMember<SoftmaxOp<Log>>::infer;
  using detail::AxisMember<SoftmaxOp<Log>>::label;
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using detail::ArrayMap;
    using detail::ConstArrayMap;
    const auto l = detail::axis_layout(a.in_shape(), this->axis);
    const T* x = a.in<T>();
    T* y = a.out<T>();
    if (l.size == 0 || l.inner == 0) return;
    const index_t block = l.size * l.inner;
    if (l.inner == 1) {
      for (index_t o = 0; o < l.outer; ++o) {
        const ConstArrayMap<T> xs(x + o * block, l.size);
        ArrayMap<T> ys(y + o * block, l.size);
        const T m = xs.template maxCoeff<::Eigen::PropagateNaN>();
        ys = fn::exp_array(xs - m);
        const T s = ys.sum();
        if constexpr (Log) ys = xs - m - std::log(s);
        else ys /= s;
      }
      return;
    }
    T* scratch = detail::scratch_row<T>(2 * l.inner);
    ArrayMap<T> m(scratch, l.inner), s(scratch + l.inner, l.inner);
    for (index_t o = 0; o < l.outer; ++o) {
      const T* xb = x + o * block;
      T* yb = y + o * block;
      auto row = [&](index_t r) { return ConstArrayMap<T>(xb + r * l.inner, l.inner); };
      auto out = [&](index_t r) { return ArrayMap<T>(yb + r * l.inner, l.inner); };
      m = row(0);
      for (index_t r = 1; r < l.size; ++r) m = m.binaryExpr(row(r), ::Eigen::internal::scalar_max_op<T, T, ::Eigen::PropagateNaN>());
      s.setZero();
      for (index_t r = 0; r < l.size; ++r) {
        auto yr = out(r);
        yr = fn::exp_array(row(r) - m);
        s += yr;
      }
      if constexpr (Log) {
        s = m + s.log();
        for (index_t r = 0; r < l.size; ++r) out(r) = row(r) - s;
      } else {
        for (index_t r = 0; r < l.size; ++r) out(r) /= s;
      }
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return SoftmaxGradOp<Log>{{}, {this->axis}};
  }

  static std::string op_name() { return Log ? "LogSoftmax" : "Softmax"; }
  // ONNX's (opset 13 on) takes one axis, as this does.
  Interchange interchange(std::span<const Shape>) const {
    return {{op_name(), {InterchangeInput::operand(0)}, {InterchangeAttribute::of("axis", this->axis)}}};
  }
};

template <bool Log>
struct SoftmaxGradOp : Primitive<SoftmaxGradOp<Log>>, detail::AxisMember<SoftmaxGradOp<Log>> {
  using detail::AxisMember<SoftmaxGradOp<Log>>::infer;
  using detail::AxisMember<SoftmaxGradOp<Log>>::label;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::output};
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using detail::ArrayMap;
    using detail::ConstArrayMap;
    const auto l = detail::axis_layout(a.in_shape(), this->axis);
    const T* dy = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* dx = a.out<T>();
    if (l.size == 0 || l.inner == 0) return;
    const index_t block = l.size * l.inner;
    if (l.inner == 1) {
      for (index_t o = 0; o < l.outer; ++o) {
        const ConstArrayMap<T> g(dy + o * block, l.size), ys(y + o * block, l.size);
        ArrayMap<T> d(dx + o * block, l.size);
        if constexpr (Log) d = g - fn::exp_array(ys) * g.sum();
        else d = ys * (g - (g * ys).sum());
      }
      return;
    }
    ArrayMap<T> s(detail::scratch_row<T>(l.inner), l.inner);
    for (index_t o = 0; o < l.outer; ++o) {
      auto g = [&](index_t r) { return ConstArrayMap<T>(dy + o * block + r * l.inner, l.inner); };
      auto ys = [&](index_t r) { return ConstArrayMap<T>(y + o * block + r * l.inner, l.inner); };
      auto d = [&](index_t r) { return ArrayMap<T>(dx + o * block + r * l.inner, l.inner); };
      s.setZero();
      for (index_t r = 0; r < l.size; ++r) {
        if constexpr (Log) s += g(r);
        else s += g(r) * ys(r);
      }
      for (index_t r = 0; r < l.size; ++r) {
        if constexpr (Log) d(r) = g(r) - fn::exp_array(ys(r)) * s;
        else d(r) = ys(r) * (g(r) - s);
      }
    }
  }

  static std::string op_name() { return Log ? "LogSoftmaxGrad" : "SoftmaxGrad"; }
};

inline const bool softmax_listed = list_operations({"softmax", "log_softmax"});

template <TensorLike X>
auto softmax(const X& x, int axis = -1) {
  return apply(SoftmaxOp<false>{{}, {axis}}, x);
}
template <TensorLike X>
auto log_softmax(const X& x, int axis = -1) {
  return apply(SoftmaxOp<true>{{}, {axis}}, x);
}

}  // namespace ops

namespace nn {

// MindSpore's nn.Softmax(axis=-1) and nn.LogSoftmax(axis=-1).
template <bool Log, ElementType T>
class BasicSoftmax : public Cell<BasicSoftmax<Log, T>, CONTEXT_MODE, T> {
 public:
  explicit BasicSoftmax(int axis = -1) : axis_(axis) {}
  template <class X>
  auto construct(X&& x) {
    if constexpr (Log) return ops::log_softmax(std::forward<X>(x), axis_);
    else return ops::softmax(std::forward<X>(x), axis_);
  }
  std::string type_name() const override { return Log ? "nn::LogSoftmax" : "nn::Softmax"; }

 private:
  int axis_;
};

using Softmax = BasicSoftmax<false, float>;
using LogSoftmax = BasicSoftmax<true, float>;

}  // namespace nn
}  // namespace duet
