// Arithmetic: + - * / and the other binary elementwise functions, with numpy broadcasting,
// between tensors and with scalars, in both modes (MindSpore's ops.add, ops.mul, ...).
//
// A binary function is a type with apply(a, b) and the partial derivative of each argument,
// partial<K>(a, b). One operation, BroadcastOp<Fn>, runs any of them: its shape rule is
// numpy's, its kernel walks the output once, and the gradient of input K is that partial
// times the incoming gradient, summed over the axes input K was broadcast along (so that it
// has input K's shape). With a scalar the same functions run in ScalarOp, which keeps the
// scalar in the operation rather than in a tensor.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../eager.hpp"
#include "../operation.hpp"

namespace duet {

namespace fn {

struct Add {
  static constexpr std::string_view name = "Add";
  template <class T>
  static T apply(T a, T b) {
    return a + b;
  }
  template <int K, class T>
  static T partial(T, T) {
    return T(1);
  }
};

struct Sub {
  static constexpr std::string_view name = "Sub";
  template <class T>
  static T apply(T a, T b) {
    return a - b;
  }
  template <int K, class T>
  static T partial(T, T) {
    return K == 0 ? T(1) : T(-1);
  }
};

struct Mul {
  static constexpr std::string_view name = "Mul";
  template <class T>
  static T apply(T a, T b) {
    return a * b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    return K == 0 ? b : a;
  }
};

struct Div {
  static constexpr std::string_view name = "Div";
  template <class T>
  static T apply(T a, T b) {
    return a / b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    return K == 0 ? T(1) / b : -a / (b * b);
  }
};

// Ties send half the gradient each way, as PyTorch does: the derivative there is undefined,
// and any other choice makes maximum(x, x) differ from x.
struct Maximum {
  static constexpr std::string_view name = "Maximum";
  template <class T>
  static T apply(T a, T b) {
    return a != a || a > b ? a : b;  // NaN propagates from either side
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if (a == b) return T(0.5);
    return (K == 0) == (a > b) ? T(1) : T(0);
  }
};

struct Minimum {
  static constexpr std::string_view name = "Minimum";
  template <class T>
  static T apply(T a, T b) {
    return a != a || a < b ? a : b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if (a == b) return T(0.5);
    return (K == 0) == (a < b) ? T(1) : T(0);
  }
};

// a^b. d/db = a^b · log a, which is NaN for a < 0 as the real power is; at a = 0 it is 0
// where the power itself is (b > 0), as PyTorch defines it.
struct Pow {
  static constexpr std::string_view name = "Pow";
  template <class T>
  static T apply(T a, T b) {
    return static_cast<T>(std::pow(a, b));
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if constexpr (K == 0) {
      return b == T(0) ? T(0) : static_cast<T>(b * std::pow(a, b - T(1)));
    } else {
      return a == T(0) && b > T(0) ? T(0) : static_cast<T>(std::pow(a, b) * std::log(a));
    }
  }
};

}  // namespace fn

namespace ops {

// numpy's broadcasting of two shapes, aligned at their last axes: each pair of sizes must be
// equal or one of them 1. A dynamic size matches anything, and unknown leading axes stay
// unknown.
constexpr ShapeResult broadcast_shapes(const Shape& a, const Shape& b) {
  const int rank = std::max(a.rank(), b.rank());
  std::array<index_t, max_rank> dims{};
  bool ok = true;
  for (int i = 1; i <= rank; ++i) {
    const index_t da = i <= a.rank() ? a[-i] : (a.leading_unknown() ? dyn : 1);
    const index_t db = i <= b.rank() ? b[-i] : (b.leading_unknown() ? dyn : 1);
    index_t d = da;
    if (da == db || db == 1) d = da;
    else if (da == 1) d = db;
    else if (da == dyn) d = db;
    else if (db == dyn) d = da;
    else ok = false;
    dims[static_cast<std::size_t>(rank - i)] = d;
  }
  Shape out = a.leading_unknown() || b.leading_unknown() ? Shape::any() : Shape{};
  for (int i = 0; i < rank; ++i) out.push_back(dims[static_cast<std::size_t>(i)]);
  // Which input to blame: the one of lower rank, or the second.
  if (!ok) return fault(out, ShapeFault::broadcast, 0, b.rank() <= a.rank() ? 1 : 0);
  return {out};
}

namespace detail {

// Where each output element reads an input broadcast to the output's shape: the input's
// strides in the output's axes, 0 along broadcast axes.
inline std::array<index_t, max_rank> broadcast_strides(const Shape& in, const Shape& out) {
  std::array<index_t, max_rank> strides{};
  index_t stride = 1;
  for (int i = 1; i <= out.rank(); ++i) {
    const std::size_t axis = static_cast<std::size_t>(out.rank() - i);
    if (i <= in.rank() && in[-i] != 1) {
      strides[axis] = stride;
    }
    if (i <= in.rank()) stride *= in[-i];
  }
  return strides;
}

// Calls f(i, ia, ib) for each output element i, with the elements ia and ib of the inputs it
// reads, in the order of the output.
template <class F>
void for_each_broadcast(const Shape& a, const Shape& b, const Shape& out, F&& f) {
  const index_t n = out.numel();
  if (n == 0) return;
  if (a == out && b == out) {
    for (index_t i = 0; i < n; ++i) f(i, i, i);
    return;
  }
  const auto sa = broadcast_strides(a, out);
  const auto sb = broadcast_strides(b, out);
  const int rank = out.rank();
  const index_t inner = rank == 0 ? 1 : out[-1];
  const index_t ia_step = rank == 0 ? 0 : sa[static_cast<std::size_t>(rank - 1)];
  const index_t ib_step = rank == 0 ? 0 : sb[static_cast<std::size_t>(rank - 1)];
  std::array<index_t, max_rank> index{};
  index_t oa = 0, ob = 0;
  for (index_t i = 0; i < n; i += inner) {
    for (index_t j = 0; j < inner; ++j) f(i + j, oa + j * ia_step, ob + j * ib_step);
    // The odometer over the outer axes, last first.
    for (int axis = rank - 2; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      oa += sa[ax];
      ob += sb[ax];
      if (index[ax] < out[axis]) break;
      oa -= sa[ax] * index[ax];
      ob -= sb[ax] * index[ax];
      index[ax] = 0;
    }
  }
}

}  // namespace detail

template <class Fn, int K>
struct BroadcastGradOp;

// Fn(a, b) elementwise, a and b broadcast to a common shape.
template <class Fn>
struct BroadcastOp : Primitive<BroadcastOp<Fn>> {
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_shapes(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* out = a.out<T>();
    detail::for_each_broadcast(a.in_shape(0), a.in_shape(1), a.output_shape,
                               [&](index_t i, index_t ia, index_t ib) { out[i] = Fn::apply(x[ia], y[ib]); });
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return BroadcastGradOp<Fn, static_cast<int>(K)>{};
  }

  static std::string op_name() { return std::string(Fn::name); }
};

// d/d input K of Fn(a, b): dy · partial_K(a, b), summed over the axes input K was broadcast
// along.
template <class Fn, int K>
struct BroadcastGradOp : Primitive<BroadcastGradOp<Fn, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* d = a.out<T>();
    const Shape& target = a.in_shape(1 + K);
    const Shape& out = a.in_shape(0);
    if (target == out) {
      detail::for_each_broadcast(a.in_shape(1), a.in_shape(2), out, [&](index_t i, index_t ia, index_t ib) {
        d[i] = dy[i] * Fn::template partial<K>(x[ia], y[ib]);
      });
      return;
    }
    std::fill_n(d, target.numel(), T(0));
    detail::for_each_broadcast(a.in_shape(1), a.in_shape(2), out, [&](index_t i, index_t ia, index_t ib) {
      d[K == 0 ? ia : ib] += dy[i] * Fn::template partial<K>(x[ia], y[ib]);
    });
  }

  static std::string op_name() { return std::string(Fn::name) + "Grad" + std::to_string(K); }
};

template <class Fn, bool ScalarFirst>
struct ScalarGradOp;

// Fn(x, s) (or Fn(s, x) if ScalarFirst) elementwise, s a number the operation holds.
template <class Fn, bool ScalarFirst>
struct ScalarOp : Primitive<ScalarOp<Fn, ScalarFirst>> {
  static constexpr int arity = 1;
  double scalar;
  ScalarOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* out = a.out<T>();
    const T s = static_cast<T>(scalar);
    const index_t n = a.in_shape().numel();
    for (index_t i = 0; i < n; ++i) out[i] = ScalarFirst ? Fn::apply(s, x[i]) : Fn::apply(x[i], s);
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ScalarGradOp<Fn, ScalarFirst>{scalar};
  }

  static std::string op_name() { return std::string(Fn::name) + (ScalarFirst ? "(scalar, x)" : "(x, scalar)"); }
};

template <class Fn, bool ScalarFirst>
struct ScalarGradOp : Primitive<ScalarGradOp<Fn, ScalarFirst>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;
  double scalar;
  ScalarGradOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    T* d = a.out<T>();
    const T s = static_cast<T>(scalar);
    const index_t n = a.in_shape(1).numel();
    for (index_t i = 0; i < n; ++i) {
      d[i] = dy[i] * (ScalarFirst ? Fn::template partial<1>(s, x[i]) : Fn::template partial<0>(x[i], s));
    }
  }

  static std::string op_name() { return std::string(Fn::name) + "ScalarGrad"; }
};

inline const bool arithmetic_listed =
    list_operations({"add", "sub", "mul", "div", "maximum", "minimum", "pow", "neg", "add_scalar", "sub_scalar",
                     "mul_scalar", "div_scalar", "scalar_sub", "scalar_div", "pow_scalar", "scalar_pow"});

// What may stand on either side of an arithmetic operator: a tensor, a static tensor, or a
// symbolic tensor in construct.
template <class X>
concept TensorLike = is_tensor_v<std::remove_cvref_t<X>> || is_static_tensor_v<std::remove_cvref_t<X>> ||
                     graph::Symbolic<X>;

template <class S>
concept Scalar = std::is_arithmetic_v<std::remove_cvref_t<S>>;

// A static tensor's BasicTensor, anything else as it is.
template <class X>
decltype(auto) operand(const X& x) {
  if constexpr (is_static_tensor_v<X>) return tensor_of(x);
  else return (x);
}

// Fn(a, b) for any mix of tensors and numbers (two numbers are not an operation).
template <class Fn, class A, class B>
auto binary(const A& a, const B& b) {
  if constexpr (Scalar<A>) {
    return apply(ScalarOp<Fn, true>{static_cast<double>(a)}, operand(b));
  } else if constexpr (Scalar<B>) {
    return apply(ScalarOp<Fn, false>{static_cast<double>(b)}, operand(a));
  } else {
    static_assert(std::is_same_v<typename std::remove_cvref_t<A>::value_type, typename std::remove_cvref_t<B>::value_type>,
                  "duet::ops: both operands of an arithmetic operation must have the same element type");
    return apply(BroadcastOp<Fn>{}, a, b);
  }
}

template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto add(const A& a, const B& b) {
  return binary<fn::Add>(a, b);
}
template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto sub(const A& a, const B& b) {
  return binary<fn::Sub>(a, b);
}
template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto mul(const A& a, const B& b) {
  return binary<fn::Mul>(a, b);
}
template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto div(const A& a, const B& b) {
  return binary<fn::Div>(a, b);
}
template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto maximum(const A& a, const B& b) {
  return binary<fn::Maximum>(a, b);
}
template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto minimum(const A& a, const B& b) {
  return binary<fn::Minimum>(a, b);
}
template <class A, class B>
  requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>))
auto pow(const A& a, const B& b) {
  return binary<fn::Pow>(a, b);
}

template <class X>
  requires TensorLike<X>
auto neg(const X& x) {
  return binary<fn::Mul>(x, -1);
}

}  // namespace ops

// The operators, found by argument-dependent lookup on duet's tensors and graph::Sym.
#define DUET_DETAIL_ARITHMETIC_OPERATOR(op, function)                                                   \
  template <class A, class B>                                                                          \
    requires((ops::TensorLike<A> || ops::Scalar<A>) && (ops::TensorLike<B> || ops::Scalar<B>) &&       \
             (ops::TensorLike<A> || ops::TensorLike<B>))                                               \
  auto operator op(const A& a, const B& b) {                                                           \
    return ops::function(a, b);                                                                        \
  }
DUET_DETAIL_ARITHMETIC_OPERATOR(+, add)
DUET_DETAIL_ARITHMETIC_OPERATOR(-, sub)
DUET_DETAIL_ARITHMETIC_OPERATOR(*, mul)
DUET_DETAIL_ARITHMETIC_OPERATOR(/, div)

template <class X>
  requires ops::TensorLike<X>
auto operator-(const X& x) {
  return ops::neg(x);
}

namespace graph {
using duet::operator+;
using duet::operator-;
using duet::operator*;
using duet::operator/;
}  // namespace graph

#undef DUET_DETAIL_ARITHMETIC_OPERATOR

}  // namespace duet
