// Elementwise functions (MindSpore's ops.exp, log, log1p, expm1, sin, cos, sqrt, rsqrt, abs,
// square, clip_by_value), where, and the comparisons that build its condition, in both modes.
//
// The unary functions are fn:: types run by ops::MapOp (nn/activation.hpp), like the
// activations: chains of them fuse into one pass, and into the epilogue of the product before
// them, in graph mode. Each is differentiated from its output where the output gives the
// derivative (exp, sqrt, rsqrt), from its input otherwise (fn::grad_from_input: log, abs,
// square, clip_by_value); a product cannot take the latter as an epilogue in a graph being
// trained (passes.hpp's absorbs), so there they stay nodes of their own.
//
// Out of a function's domain the result is IEEE's, never an error, as in numpy and PyTorch:
// log(x < 0) and sqrt(x < 0) are NaN, log(0) is -inf, rsqrt(0) is inf, and NaN propagates
// through every function here (clip_by_value too).
//
// Comparisons make UInt8 tensors of 0 and 1 (duet has no bool), with numpy broadcasting
// between two tensors, or against a number. They have no gradient: their output carries none,
// so a gradient never flows back through them, and differentiating a function that uses one
// (to build a where's condition) is no error.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "../eager.hpp"
#include "../nn/activation.hpp"
#include "../operation.hpp"
#include "arithmetic.hpp"

namespace duet {

namespace fn {

struct Exp : KernelActivation<kernels::Activation::exp> {
  static constexpr std::string_view name = "Exp";
  static ops::InterchangeNode interchange() { return {"Exp", {}, {}}; }
  template <class A>
  static auto array(const A& a) {
    return exp_array(a);
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    return dy * y;
  }
  template <class V>
  static void grad_in_place(V& dy, const V& y) {
    dy = dy * y;
  }
};

// log(x): NaN for x < 0, -inf at 0.
struct Log {
  static constexpr std::string_view name = "Log";
  static ops::InterchangeNode interchange() { return {"Log", {}, {}}; }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.log();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    return dy / x;
  }
};

// log(1 + x), exact for small x where log(1 + x) rounds 1 + x first; NaN below -1.
struct Log1p {
  static constexpr std::string_view name = "Log1p";
  static ops::Interchange interchange() {
    using In = ops::InterchangeInput;
    return {{"Add", {In::operand(0), In::number(1.0)}, {}}, {"Log", {In::node(0)}, {}}};
  }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.log1p();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    return dy / (x + S(1));
  }
};

// e^x - 1, exact for small x where e^x - 1 cancels.
struct Expm1 {
  static constexpr std::string_view name = "Expm1";
  static ops::Interchange interchange() {
    using In = ops::InterchangeInput;
    return {{"Exp", {In::operand(0)}, {}}, {"Sub", {In::node(0), In::number(1.0)}, {}}};
  }
  template <class A>
  static auto array(const A& a) {
    return a.expm1();
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * (y + S(1));
  }
};

// sin and cos (a sinusoidal position encoding computed in construct); inf gives NaN.
struct Sin {
  static constexpr std::string_view name = "Sin";
  static ops::InterchangeNode interchange() { return {"Sin", {}, {}}; }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.sin();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    return dy * x.cos();
  }
};

struct Cos {
  static constexpr std::string_view name = "Cos";
  static ops::InterchangeNode interchange() { return {"Cos", {}, {}}; }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.cos();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    return -(dy * x.sin());
  }
};

// erf(x) = 2/√π ∫₀ˣ e^(-t²) dt (torch.erf, MindSpore's ops.erf); derivative 2/√π e^(-x²).
struct Erf : KernelActivation<kernels::Activation::erf> {
  static constexpr std::string_view name = "Erf";
  static ops::InterchangeNode interchange() { return {"Erf", {}, {}}; }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.erf();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    return dy * (S(1.12837916709551257390) * (-x.square()).exp());
  }
  static constexpr kernels::Activation kernel_derivative = kernels::Activation::erf_derivative;
  template <class V>
  static void grad_in_place(V& dy, const V& x) {
    multiply_by_derivative<Erf>(dy, x);
  }
};

namespace detail {
// Eigen's vectorised sqrt under EIGEN_FAST_MATH (its default) refines the processor's
// reciprocal-root estimate once: not correctly rounded (sqrt(4) came out below 2), and not the
// same bits on Intel and AMD, whose estimates differ. IEEE's root is one instruction per lane;
// a scalar functor keeps it without naming any instruction set here.
struct RoundedSqrt {
  template <class T>
  T operator()(T v) const {
    return std::sqrt(v);
  }
};
}  // namespace detail

// sqrt(x): NaN for x < 0; its derivative 1 / (2 sqrt(x)) is inf at 0, as PyTorch's.
struct Sqrt {
  static constexpr std::string_view name = "Sqrt";
  static ops::InterchangeNode interchange() { return {"Sqrt", {}, {}}; }
  template <class A>
  static auto array(const A& a) {
    return a.unaryExpr(detail::RoundedSqrt{});
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy / (S(2) * y);
  }
};

// The root ops::std takes of a variance: sqrt's value, and a gradient of 0 where the variance
// is 0 (a constant group), as PyTorch's std gives; sqrt's infinite one there, times the
// variance's zero gradient, made every input of the group NaN.
struct StdRoot : Sqrt {
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return (y == S(0)).select(S(0), dy / (S(2) * y));
  }
};

// 1 / sqrt(x), as a division of the correctly rounded root: Eigen's rsqrt may take the
// processor's estimate, whose bits differ between a vector and a scalar and between vendors.
struct Rsqrt {
  static constexpr std::string_view name = "Rsqrt";
  static ops::Interchange interchange() {
    return {{"Sqrt", {ops::InterchangeInput::operand(0)}, {}}, {"Reciprocal", {ops::InterchangeInput::node(0)}, {}}};
  }
  template <class A>
  static auto array(const A& a) {
    return a.unaryExpr(detail::RoundedSqrt{}).inverse();
  }
  // d/dx x^(-1/2) = -y³ / 2.
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * (S(-0.5) * y.cube());
  }
};

// |x|; its derivative at 0 is taken as 0, as PyTorch's (sign(x) · dy).
struct Abs {
  static constexpr std::string_view name = "Abs";
  static constexpr bool on_integers = true;
  static ops::InterchangeNode interchange() { return {"Abs", {}, {}}; }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.abs();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    return dy * x.sign();
  }
};

struct Square {
  static constexpr std::string_view name = "Square";
  static constexpr bool on_integers = true;
  static ops::Interchange interchange() {
    return {{"Mul", {ops::InterchangeInput::operand(0), ops::InterchangeInput::operand(0)}, {}}};
  }
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.square();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    return dy * (S(2) * x);
  }
};

// min(max(x, lo), hi), so hi wherever lo > hi, as MindSpore's and PyTorch's; NaN stays NaN.
// The gradient passes where lo <= x <= hi (PyTorch's clamp: bounds included), from the input,
// since the output cannot tell a clipped value from one equal to a bound.
struct ClipByValue {
  static constexpr std::string_view name = "ClipByValue";
  static constexpr bool on_integers = true;
  static constexpr bool grad_from_input = true;
  double lo = 0;
  double hi = 0;
  // ONNX's Clip also gives max wherever min > max.
  ops::Interchange interchange() const {
    using In = ops::InterchangeInput;
    return {{"Clip", {In::operand(0), In::number(lo), In::number(hi)}, {}}};
  }
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    return a
        .binaryExpr(A::Constant(a.rows(), a.cols(), static_cast<S>(lo)),
                    ::Eigen::internal::scalar_max_op<S, S, ::Eigen::PropagateNaN>())
        .binaryExpr(A::Constant(a.rows(), a.cols(), static_cast<S>(hi)),
                    ::Eigen::internal::scalar_min_op<S, S, ::Eigen::PropagateNaN>());
  }
  template <class G, class X>
  auto grad_array(const G& dy, const X& x) const {
    using S = typename X::Scalar;
    return (x >= static_cast<S>(lo) && x <= static_cast<S>(hi)).select(dy, G::Zero(dy.rows(), dy.cols()));
  }
};

// The comparisons: each names the one with its operands swapped (a number on the left), and
// ONNX's operator for it.
struct Greater;
struct Less;
struct GreaterEqual;
struct LessEqual;
struct Greater {
  static constexpr std::string_view name = "Greater";
  static constexpr std::string_view onnx = "Greater";
  using swapped = Less;
  template <class T>
  static bool apply(T a, T b) {
    return a > b;
  }
};
struct Less {
  static constexpr std::string_view name = "Less";
  static constexpr std::string_view onnx = "Less";
  using swapped = Greater;
  template <class T>
  static bool apply(T a, T b) {
    return a < b;
  }
};
struct GreaterEqual {
  static constexpr std::string_view name = "GreaterEqual";
  static constexpr std::string_view onnx = "GreaterOrEqual";
  using swapped = LessEqual;
  template <class T>
  static bool apply(T a, T b) {
    return a >= b;
  }
};
struct LessEqual {
  static constexpr std::string_view name = "LessEqual";
  static constexpr std::string_view onnx = "LessOrEqual";
  using swapped = GreaterEqual;
  template <class T>
  static bool apply(T a, T b) {
    return a <= b;
  }
};
struct Equal {
  static constexpr std::string_view name = "Equal";
  static constexpr std::string_view onnx = "Equal";
  using swapped = Equal;
  template <class T>
  static bool apply(T a, T b) {
    return a == b;
  }
};
struct NotEqual {
  static constexpr std::string_view name = "NotEqual";
  static constexpr std::string_view onnx = "Equal";  // then Not
  static constexpr bool negated = true;
  using swapped = NotEqual;
  template <class T>
  static bool apply(T a, T b) {
    return a != b;
  }
};

}  // namespace fn

namespace ops {

namespace detail {
// A comparison of operand 0 with b in ONNX: its operator (NotEqual is Not of Equal), whose bool
// is cast to the uint8 duet holds.
template <class Fn>
Interchange compare_interchange(InterchangeInput b) {
  using In = InterchangeInput;
  Interchange nodes{{std::string(Fn::onnx), {In::operand(0), std::move(b)}, {}}};
  if constexpr (requires { Fn::negated; }) nodes.push_back({"Not", {In::node(0)}, {}});
  nodes.push_back({"Cast", {In::node(nodes.size() - 1)}, {InterchangeAttribute::of("to", onnx_type_code(DType::uint8))}});
  return nodes;
}

// ONNX's Where reads a bool condition: duet's uint8 one is cast first (node 0), then
// Where(node 0, x, y).
inline Interchange where_interchange(InterchangeInput x, InterchangeInput y) {
  using In = InterchangeInput;
  return {{"Cast", {In::operand(0)}, {InterchangeAttribute::of("to", onnx_bool_code)}},
          {"Where", {In::node(0), std::move(x), std::move(y)}, {}}};
}
}  // namespace detail

// Fn(a, b) as 0 or 1, a and b of element type In broadcast together (numpy's rule).
template <class Fn, class In>
struct CompareOp : Primitive<CompareOp<Fn, In>> {
  using value_type = std::uint8_t;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_shapes(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* x = a.in<In>(0);
    const In* y = a.in<In>(1);
    T* out = a.out<T>();
    detail::for_each_broadcast(a.in_shape(0), a.in_shape(1), a.output_shape,
                               [&](index_t i, index_t ia, index_t ib) { out[i] = Fn::apply(x[ia], y[ib]); });
  }

  template <std::size_t K>
    requires(K < 2)
  NoGradient grad_op() const {
    return {};
  }

  static Interchange interchange(std::span<const Shape>) {
    return detail::compare_interchange<Fn>(InterchangeInput::operand(1));
  }

  static std::string op_name() { return std::string(Fn::name); }
};

// Fn(x, s) as 0 or 1, s a number the operation holds (converted to In, as the comparison
// would be made in In).
template <class Fn, class In>
struct CompareScalarOp : Primitive<CompareScalarOp<Fn, In>> {
  using value_type = std::uint8_t;
  static constexpr int arity = 1;
  double scalar;
  CompareScalarOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* x = a.in<In>();
    T* out = a.out<T>();
    const In s = static_cast<In>(scalar);
    const index_t n = a.in_shape().numel();
    for (index_t i = 0; i < n; ++i) out[i] = Fn::apply(x[i], s);
  }

  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }

  Interchange interchange(std::span<const Shape>) const {
    return detail::compare_interchange<Fn>(InterchangeInput::number_of(scalar, dtype_of<In>));
  }

  static std::string op_name() { return std::string(Fn::name) + "(x, scalar)"; }
};

namespace detail {

// Calls f(i, i0, i1, i2) for each element i of out, with the elements of three inputs of
// these shapes broadcast to it.
template <class F>
void for_each_broadcast3(const std::array<Shape, 3>& in, const Shape& out, F&& f) {
  const index_t n = out.numel();
  if (in[0] == out && in[1] == out && in[2] == out) {
    for (index_t i = 0; i < n; ++i) f(i, i, i, i);
    return;
  }
  const std::array strides{broadcast_strides(in[0], out), broadcast_strides(in[1], out),
                           broadcast_strides(in[2], out)};
  std::array<index_t, max_rank> index{};
  std::array<index_t, 3> at{};
  for (index_t i = 0; i < n; ++i) {
    f(i, at[0], at[1], at[2]);
    for (int axis = out.rank() - 1; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      for (std::size_t k = 0; k < 3; ++k) at[k] += strides[k][ax];
      if (index[ax] < out[axis]) break;
      for (std::size_t k = 0; k < 3; ++k) at[k] -= strides[k][ax] * index[ax];
      index[ax] = 0;
    }
  }
}

}  // namespace detail

template <class T, int K>
struct WhereGradOp;

// cond ? a : b elementwise, the three broadcast together; cond is UInt8, true where not 0.
template <class T>
struct WhereOp : Primitive<WhereOp<T>> {
  using value_type = T;
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    // A broadcast fault names the culprit (input) and the input it does not broadcast with
    // (expected).
    const ShapeResult ab = broadcast_shapes(in[1], in[2]);
    if (!ab.ok()) return fault(ab.shape, ShapeFault::broadcast, ab.input == 0 ? 2 : 1, 1 + ab.input);
    const ShapeResult all = broadcast_shapes(in[0], ab.shape);
    if (!all.ok()) return fault(all.shape, ShapeFault::broadcast, in[1].rank() >= in[2].rank() ? 1 : 2, 0);
    return all;
  }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const std::uint8_t* c = a.in<std::uint8_t>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* out = a.out<T>();
    detail::for_each_broadcast3({a.in_shape(0), a.in_shape(1), a.in_shape(2)}, a.output_shape,
                                [&](index_t i, index_t ic, index_t ia, index_t ib) { out[i] = c[ic] != 0 ? x[ia] : y[ib]; });
  }

  template <std::size_t K>
    requires(K < 3)
  auto grad_op() const {
    if constexpr (K == 0) return NoGradient{};
    else return WhereGradOp<T, static_cast<int>(K)>{};
  }

  static Interchange interchange(std::span<const Shape>) {
    return detail::where_interchange(InterchangeInput::operand(1), InterchangeInput::operand(2));
  }

  static std::string op_name() { return "Select"; }
};

// d/d a (K = 1) or d/d b (K = 2) of where(cond, a, b): dy where the condition picks that
// input, 0 elsewhere, summed over the axes the input was broadcast along.
template <class T, int K>
struct WhereGradOp : Primitive<WhereGradOp<T, K>> {
  using value_type = T;
  // a and b are read for their shapes only.
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1,
                                    graph::Operand::input2};
  static constexpr int arity = 4;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const U* dy = a.in<U>(0);
    const std::uint8_t* c = a.in<std::uint8_t>(1);
    U* d = a.out<U>();
    const Shape& target = a.in_shape(1 + K);
    const Shape& out = a.in_shape(0);
    const bool picks = K == 1;
    const bool summed = !(target == out);
    if (summed) std::fill_n(d, target.numel(), U(0));
    detail::for_each_broadcast3({a.in_shape(1), a.in_shape(2), a.in_shape(3)}, out,
                                [&](index_t i, index_t ic, index_t ia, index_t ib) {
                                  const U g = (c[ic] != 0) == picks ? dy[i] : U(0);
                                  if (summed) d[K == 1 ? ia : ib] += g;
                                  else d[i] = g;
                                });
  }

  static std::string op_name() { return "SelectGrad" + std::to_string(K); }
};

template <class T, bool ScalarIsX>
struct WhereScalarGradOp;

// where(condition, x, y) with x (ScalarIsX) or y a number: PyTorch's masked_fill(mask, value)
// is where(mask, value, x). Inputs: the condition and the tensor, broadcast together.
template <class T, bool ScalarIsX>
struct WhereScalarOp : Primitive<WhereScalarOp<T, ScalarIsX>> {
  using value_type = T;
  static constexpr int arity = 2;
  double value;
  WhereScalarOp(double v) : value(v) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_shapes(in[0], in[1]); }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const std::uint8_t* c = a.in<std::uint8_t>(0);
    const T* t = a.in<T>(1);
    const T v = static_cast<T>(value);
    T* out = a.out<T>();
    detail::for_each_broadcast3({a.in_shape(0), a.in_shape(1), a.in_shape(1)}, a.output_shape,
                                [&](index_t i, index_t ic, index_t it, index_t) {
                                  out[i] = (c[ic] != 0) == ScalarIsX ? v : t[it];
                                });
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    if constexpr (K == 0) return NoGradient{};
    else return WhereScalarGradOp<T, ScalarIsX>{};
  }

  Interchange interchange(std::span<const Shape>) const {
    const auto number = InterchangeInput::number_of(value, dtype_of<T>);
    const auto tensor = InterchangeInput::operand(1);
    return ScalarIsX ? detail::where_interchange(number, tensor) : detail::where_interchange(tensor, number);
  }

  static std::string op_name() { return ScalarIsX ? "SelectScalarX" : "SelectScalarY"; }
};

// d/d tensor of where with a number: dy where the condition picks the tensor, 0 elsewhere,
// summed over the axes the tensor was broadcast along.
template <class T, bool ScalarIsX>
struct WhereScalarGradOp : Primitive<WhereScalarGradOp<T, ScalarIsX>> {
  using value_type = T;
  // The tensor is read for its shape only.
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[2]}; }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const U* dy = a.in<U>(0);
    const std::uint8_t* c = a.in<std::uint8_t>(1);
    U* d = a.out<U>();
    const Shape& target = a.in_shape(2);
    const Shape& out = a.in_shape(0);
    const bool summed = !(target == out);
    if (summed) std::fill_n(d, target.numel(), U(0));
    detail::for_each_broadcast3({a.in_shape(1), target, target}, out, [&](index_t i, index_t ic, index_t it, index_t) {
      const U g = (c[ic] != 0) == ScalarIsX ? U(0) : dy[i];
      if (summed) d[it] += g;
      else d[i] = g;
    });
  }

  static std::string op_name() { return ScalarIsX ? "SelectScalarXGrad" : "SelectScalarYGrad"; }
};

// torch.tril / triu (MindSpore's ops.tril, ops.triu): the matrices of the last two axes with
// the elements above (Lower: kept on and below) or below (upper) diagonal k set to `value`
// (0 unless given), the diagonal k above the main one (k < 0 below it): tril(scores, 0,
// -inf) is a causal attention mask at any length, in one pass. Its gradient is dy with the
// same elements set to 0 (the same operation, value 0).
template <bool Lower>
struct TriangleOp : Primitive<TriangleOp<Lower>> {
  // As its own gradient operation it reads the incoming gradient.
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  index_t k;
  double value = 0;
  TriangleOp(index_t diagonal, double fill = 0) : k(diagonal), value(fill) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if (!in[0].leading_unknown() && in[0].rank() < 2) return fault(in[0], ShapeFault::min_rank, 2);
    return {in[0]};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const Shape& s = a.in_shape();
    const index_t rows = s[s.rank() - 2], cols = s[s.rank() - 1];
    const T* x = a.in<T>();
    T* y = a.out<T>();
    const T fill = static_cast<T>(value);
    for (index_t m = 0, n = rows == 0 || cols == 0 ? 0 : s.numel() / (rows * cols); m < n; ++m) {
      for (index_t i = 0; i < rows; ++i, x += cols, y += cols) {
        for (index_t j = 0; j < cols; ++j) y[j] = (Lower ? j - i <= k : j - i >= k) ? x[j] : fill;
      }
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return TriangleOp{k};
  }

  static std::string op_name() { return Lower ? "Tril" : "Triu"; }
};

inline const bool math_listed =
    list_operations({"exp",   "log",           "log1p",      "expm1",         "sin",   "cos",         "erf",     "sqrt",
                     "rsqrt", "abs",           "square",     "clip_by_value", "where", "masked_fill", "greater", "less",
                     "equal", "greater_equal", "less_equal", "not_equal",     "tril",  "triu"});

template <class X>
  requires TensorLike<X>
auto exp(const X& x) {
  return apply(MapOp<fn::Exp>{}, x);
}
template <class X>
  requires TensorLike<X>
auto log(const X& x) {
  return apply(MapOp<fn::Log>{}, x);
}
template <class X>
  requires TensorLike<X>
auto log1p(const X& x) {
  return apply(MapOp<fn::Log1p>{}, x);
}
template <class X>
  requires TensorLike<X>
auto expm1(const X& x) {
  return apply(MapOp<fn::Expm1>{}, x);
}
template <class X>
  requires TensorLike<X>
auto sin(const X& x) {
  return apply(MapOp<fn::Sin>{}, x);
}
template <class X>
  requires TensorLike<X>
auto cos(const X& x) {
  return apply(MapOp<fn::Cos>{}, x);
}
template <class X>
  requires TensorLike<X>
auto erf(const X& x) {
  return apply(MapOp<fn::Erf>{}, x);
}
template <class X>
  requires TensorLike<X>
auto sqrt(const X& x) {
  return apply(MapOp<fn::Sqrt>{}, x);
}
template <class X>
  requires TensorLike<X>
auto rsqrt(const X& x) {
  return apply(MapOp<fn::Rsqrt>{}, x);
}
template <class X>
  requires TensorLike<X>
auto abs(const X& x) {
  return apply(MapOp<fn::Abs>{}, x);
}
template <class X>
  requires TensorLike<X>
auto square(const X& x) {
  return apply(MapOp<fn::Square>{}, x);
}
// MindSpore's ops.clip_by_value(x, clip_value_min, clip_value_max), with number bounds.
template <class X>
  requires TensorLike<X>
auto clip_by_value(const X& x, double clip_value_min, double clip_value_max) {
  return apply(MapOp<fn::ClipByValue>{std::tuple{fn::ClipByValue{clip_value_min, clip_value_max}}}, x);
}

// Fn(a, b) as UInt8 0/1, between two tensors (broadcast) or a tensor and a number.
template <class Fn, class A, class B>
auto compare(const A& a, const B& b) {
  if constexpr (Scalar<A>) {
    return apply(CompareScalarOp<typename Fn::swapped, typename B::value_type>{static_cast<double>(a)}, b);
  } else if constexpr (Scalar<B>) {
    return apply(CompareScalarOp<Fn, typename A::value_type>{static_cast<double>(b)}, a);
  } else {
    static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                  "duet::ops: both operands of a comparison must have the same element type");
    return apply(CompareOp<Fn, typename A::value_type>{}, a, b);
  }
}

#define DUET_DETAIL_COMPARISON(function, Fn)                                                             \
  template <class A, class B>                                                                          \
    requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>)) \
  auto function(const A& a, const B& b) {                                                              \
    return compare<fn::Fn>(a, b);                                                                      \
  }
DUET_DETAIL_COMPARISON(greater, Greater)
DUET_DETAIL_COMPARISON(less, Less)
DUET_DETAIL_COMPARISON(greater_equal, GreaterEqual)
DUET_DETAIL_COMPARISON(less_equal, LessEqual)
DUET_DETAIL_COMPARISON(equal, Equal)
DUET_DETAIL_COMPARISON(not_equal, NotEqual)
#undef DUET_DETAIL_COMPARISON

// MindSpore's ops.where(condition, x, y): x where condition is not 0, y elsewhere, the three
// broadcast together. The condition gets no gradient; x and y get dy where each is chosen.
template <class C, class A, class B>
  requires(TensorLike<C> && TensorLike<A> && TensorLike<B>)
auto where(const C& condition, const A& x, const B& y) {
  static_assert(std::is_same_v<typename C::value_type, std::uint8_t>,
                "duet::ops::where: the condition is a UInt8 tensor, as the comparisons (ops::greater, ...) make");
  static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                "duet::ops::where: x and y must have the same element type");
  return apply(WhereOp<typename A::value_type>{}, condition, x, y);
}

// value, written outside the triangle kept, is 0 by default (torch's tril and triu).
template <class X, class S = int>
requires(TensorLike<X>&& Scalar<S>) auto tril(const X& x, index_t diagonal = 0, S value = 0) {
  static_assert(!truncates<S, X>, DUET_DETAIL_TRUNCATION_MESSAGE);
  return apply(TriangleOp<true>{diagonal, static_cast<double>(value)}, x);
}
template <class X, class S = int>
requires(TensorLike<X>&& Scalar<S>) auto triu(const X& x, index_t diagonal = 0, S value = 0) {
  static_assert(!truncates<S, X>, DUET_DETAIL_TRUNCATION_MESSAGE);
  return apply(TriangleOp<false>{diagonal, static_cast<double>(value)}, x);
}

// A number on either side: where(mask, -1e9f, scores) is PyTorch's scores.masked_fill(mask, -1e9).
template <class C, class A, class S>
  requires(TensorLike<C> && TensorLike<A> && Scalar<S>)
auto where(const C& condition, const A& x, S y) {
  static_assert(std::is_same_v<typename C::value_type, std::uint8_t>,
                "duet::ops::where: the condition is a UInt8 tensor, as the comparisons (ops::greater, ...) make");
  static_assert(!truncates<S, A>, DUET_DETAIL_TRUNCATION_MESSAGE);
  return apply(WhereScalarOp<typename A::value_type, false>{static_cast<double>(y)}, condition, x);
}
template <class C, class S, class B>
  requires(TensorLike<C> && Scalar<S> && TensorLike<B>)
auto where(const C& condition, S x, const B& y) {
  static_assert(std::is_same_v<typename C::value_type, std::uint8_t>,
                "duet::ops::where: the condition is a UInt8 tensor, as the comparisons (ops::greater, ...) make");
  static_assert(!truncates<S, B>, DUET_DETAIL_TRUNCATION_MESSAGE);
  return apply(WhereScalarOp<typename B::value_type, true>{static_cast<double>(x)}, condition, y);
}

// PyTorch's x.masked_fill(mask, value): value where the UInt8 mask is not 0, x elsewhere, the
// mask and x broadcast together (torch's out-of-place form broadcasts both ways).
template <class X, class M, class S>
requires(TensorLike<X>&& TensorLike<M>&& Scalar<S>) auto masked_fill(const X& x, const M& mask, S value) {
  return where(mask, value, x);
}

}  // namespace ops
}  // namespace duet
