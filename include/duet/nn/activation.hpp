// Activation layers and the elementwise functions behind them.
//
// An elementwise function is a type with a name and an Eigen array form. The same type is a
// graph node of its own (ops::MapOp<Fn>, what PyNative runs) or, after fuse_epilogues, a
// step in a product's epilogue: the function is written once and used both ways.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"

namespace duet {

namespace fn {

// Whether Fn's derivative is computed from its input (Fn::grad_array(dy, x)) rather than from
// its output (Fn::grad_array(dy, y)), as for log or abs, whose input the output does not give.
template <class Fn>
inline constexpr bool grad_from_input = requires { requires Fn::grad_from_input; };

struct Relu {
  static constexpr std::string_view name = "ReLU";
  // NaN stays NaN, as IEEE and numpy's maximum say; a plain max(x, 0) would turn it into 0.
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    return a.binaryExpr(A::Constant(a.rows(), a.cols(), S(0)),
                        ::Eigen::internal::scalar_max_op<S, S, ::Eigen::PropagateNaN>());
  }
  // The same on one value or one SIMD vector, for kernels that apply it in registers. NaN
  // compares false, so it passes through. In place, by reference: a kernel compiled for
  // AVX-512 hands over its vector without passing a 64-byte value into code compiled for
  // another instruction set, which has another calling convention (-Wpsabi).
  template <class V>
  static void apply_in_place(V& v) {
    v = v < V{} ? V{} : v;
  }
  template <class V>
  static V apply(V v) {
    apply_in_place(v);
    return v;
  }
  // dy · relu'(x), from y = relu(x): zero where y <= 0. A NaN output passes dy through, as
  // PyTorch does, so a NaN is not silently hidden from the gradient.
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return (y <= S(0)).select(Y::Constant(y.rows(), y.cols(), S(0)), dy);
  }
};

}  // namespace fn

namespace ops {

template <class Fn>
struct MapGradOp;

// Fns applied elementwise, in order, in one pass. Capture makes one per function; O1 fuses
// chains (relu(tanh(x)) is one MapOp<Tanh, Relu>), and products absorb them as epilogues.
template <class... Fns>
struct MapOp : Primitive<MapOp<Fns...>> {
  static_assert(sizeof...(Fns) >= 1);
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;

  // The functions' parameters (LeakyReLU's alpha), if they have any. They are values held
  // by the node rather than template arguments: a float cannot be one under clang 14, and
  // nn::LeakyReLU(alpha) takes its alpha at run time, as MindSpore's does.
  std::tuple<Fns...> fns{};
  MapOp() = default;
  explicit MapOp(std::tuple<Fns...> f) : fns(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::map(fns, a.in<T>(), a.in_shape().numel(), a.out<T>());
  }

  template <class C>
  static constexpr bool accepts_epilogue = requires { C::elementwise_functions; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return MapOp<Fns..., Gs...>{std::tuple_cat(fns, next.fns)};
  }
  static constexpr auto elementwise_functions = sizeof...(Fns);

  // A single function is differentiated from its output; a fused chain would need the values
  // between its functions, which it never stores.
  static constexpr bool differentiable = sizeof...(Fns) == 1;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return MapGradOp<Fns...>{std::get<0>(fns)};
  }

  static std::string op_name() {
    std::string s;
    ((s += (s.empty() ? "" : " + ") + std::string(Fns::name)), ...);
    return s;
  }
};

// dx = dy · Fn'(x), from dy and the forward output y (or its input x, fn::grad_from_input).
template <class Fn>
struct MapGradOp : Primitive<MapGradOp<Fn>> {
  static constexpr std::array reads{graph::Operand::grad,
                                    fn::grad_from_input<Fn> ? graph::Operand::input0 : graph::Operand::output};
  static constexpr int arity = 2;

  Fn fn{};
  MapGradOp() = default;
  explicit MapGradOp(Fn f) : fn(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::map_grad(fn, a.in<T>(0), a.in<T>(1), a.in_shape().numel(), a.out<T>());
  }

  static std::string op_name() { return std::string(Fn::name) + "Grad"; }
};

template <class X>
auto relu(X&& x) {
  return apply(MapOp<fn::Relu>{}, std::forward<X>(x));
}

}  // namespace ops

namespace nn {

// max(x, 0), elementwise (MindSpore's nn.ReLU).
template <ElementType T>
class BasicReLU : public Cell<BasicReLU<T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return ops::relu(std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::ReLU"; }
};

using ReLU = BasicReLU<float>;

}  // namespace nn
}  // namespace duet
