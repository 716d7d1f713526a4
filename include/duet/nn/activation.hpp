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
#include <type_traits>
#include <utility>

#include <unsupported/Eigen/SpecialFunctions>  // erf, for backend::Eigen's GELU and ops::erf

#include "../cell.hpp"
#include "../eager.hpp"
#include "../error.hpp"
#include "../kernels/elementwise.hpp"

namespace duet {

namespace fn {

// e^a, elementwise, 0 where it is below the smallest normal number. Eigen's vectorised exp
// clamps its argument at ln(2^-128) and so gives 2.9e-39 (float) for any a below -88.72, a
// masked logit of -1e9 included, while its scalar path (a tensor's tail) gives std::exp's
// subnormal or 0: softmax over a padding mask left every masked position a little weight, which
// depended on the row's length. Subnormal results count as zero here, as in the optimisers'
// kernels, on every path alike.
template <class A>
auto exp_array(const A& a) {
  using T = typename A::Scalar;
  return (a < kernels::lowest_normal_exponent<T>).select(T(0), a.exp());
}

// Whether Fn means something on integer tensors (ReLU, abs, square, clip_by_value): the others
// (exp, sigmoid, GELU, ...) would truncate every result, and ops::MapOp refuses them there.
template <class Fn>
inline constexpr bool on_integers = requires { requires Fn::on_integers; };

// Whether Fn's derivative is computed from its input (Fn::grad_array(dy, x)) rather than from
// its output (Fn::grad_array(dy, y)), as for log or abs, whose input the output does not give.
template <class Fn>
inline constexpr bool grad_from_input = requires { requires Fn::grad_from_input; };

struct Relu {
  static constexpr std::string_view name = "ReLU";
  static constexpr bool on_integers = true;
  static ops::InterchangeNode interchange() { return {"Relu", {}, {}}; }
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
  // The same select on one value or one SIMD vector (kernels::map_grad), in place on dy as
  // apply_in_place is on v. Eigen's select above runs one element at a time, with a branch:
  // LeNet-5's two ReLU gradients were a quarter of its training step.
  template <class V>
  static void grad_in_place(V& dy, const V& y) {
    dy = y <= V{} ? V{} : dy;
  }
};

// The functions deriving from kernels::ActivationFunction are computed by kernels::activation
// on the instruction set chosen at run time: a product applies that vector form in its
// registers, the map kernel over memory and a small layer to each value, with the same bits,
// so graph mode's fused product and PyNative's separate map agree. Their Eigen array forms are
// backend::Eigen's.
template <kernels::Activation A>
using KernelActivation = kernels::ActivationFunction<A>;

// For a function differentiated from its input by kernels::activation (Fn::kernel_derivative,
// which kernels::map_grad runs eight vectors at a time): dy times the derivative at x, on a
// value or a vector.
template <class Fn, class V>
void multiply_by_derivative(V& dy, const V& x) {
  V d = x;
  kernels::activation<Fn::kernel_derivative>(d);
  dy = dy * d;
}

// The activations below without a vector form (LeakyReLU, ELU, softplus) run as Eigen's map
// after the finished product rather than in its registers (backend::Native::dense). Those
// differentiated from their output (sigmoid, tanh, LeakyReLU, ELU, softplus) also fuse into a
// product in a graph being trained; GELU and SiLU need their input, and stay nodes of their own
// there.

// 1 / (1 + exp(-x)); derivative y (1 - y).
struct Sigmoid : KernelActivation<kernels::Activation::sigmoid> {
  static constexpr std::string_view name = "Sigmoid";
  static ops::InterchangeNode interchange() { return {"Sigmoid", {}, {}}; }
  template <class A>
  static auto array(const A& a) {
    return a.logistic();
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * (y * (S(1) - y));
  }
  template <class V>
  static void grad_in_place(V& dy, const V& y) {
    dy = dy * (y * (1 - y));
  }
};

// Derivative 1 - y², as (1 - y)(1 + y): exact where y is near ±1, and nothing for a compiler to
// contract into an FMA differently in a product's backward pass and a map's.
struct Tanh : KernelActivation<kernels::Activation::tanh> {
  static constexpr std::string_view name = "Tanh";
  static ops::InterchangeNode interchange() { return {"Tanh", {}, {}}; }
  template <class A>
  static auto array(const A& a) {
    return a.tanh();
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * ((S(1) - y) * (S(1) + y));
  }
  template <class V>
  static void grad_in_place(V& dy, const V& y) {
    dy = dy * ((1 - y) * (1 + y));
  }
};

// x Φ(x), Φ the standard normal distribution: exactly, 0.5 x (1 + erf(x / √2)), or with
// Approximate, 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))) (MindSpore's approximate=True,
// PyTorch's approximate='tanh').
template <bool Approximate>
struct Gelu : KernelActivation<Approximate ? kernels::Activation::gelu_tanh : kernels::Activation::gelu> {
  static constexpr std::string_view name = Approximate ? "GELU(tanh)" : "GELU(erf)";
  static constexpr bool grad_from_input = true;
  static constexpr double sqrt_2_over_pi = 0.7978845608028654;
  static constexpr double inv_sqrt_2 = 0.7071067811865476;
  static constexpr double inv_sqrt_2pi = 0.3989422804014327;
  static constexpr double cubic = 0.044715;

  // ONNX has no Gelu before opset 20. The exact form is written as torch.onnx.export writes it
  // (Div, Erf, Add, Mul, Mul), which io::load_onnx reads back as one GELU; the tanh form as
  // its formula, node by node.
  static ops::Interchange interchange() {
    using In = ops::InterchangeInput;
    const auto node = [](const char* op, In a, In b) { return ops::InterchangeNode{op, {std::move(a), std::move(b)}, {}}; };
    const In x = In::operand(0);
    if constexpr (Approximate) {
      return {node("Mul", x, x), node("Mul", In::node(0), x), node("Mul", In::node(1), In::number(cubic)),
              node("Add", x, In::node(2)), node("Mul", In::node(3), In::number(sqrt_2_over_pi)),
              {"Tanh", {In::node(4)}, {}}, node("Add", In::node(5), In::number(1)), node("Mul", x, In::node(6)),
              node("Mul", In::node(7), In::number(0.5))};
    } else {
      return {node("Div", x, In::number(1.4142135623730951)), {"Erf", {In::node(0)}, {}},
              node("Add", In::node(1), In::number(1)), node("Mul", x, In::node(2)),
              node("Mul", In::node(3), In::number(0.5))};
    }
  }

  template <class A>
  static auto inner(const A& a) {
    using S = typename A::Scalar;
    return S(sqrt_2_over_pi) * (a + S(cubic) * a.cube());
  }
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    if constexpr (Approximate) return S(0.5) * a * (S(1) + inner(a).tanh());
    else return S(0.5) * a * (S(1) + (a * S(inv_sqrt_2)).erf());
  }
  // Φ(x) + x φ(x), or for the tanh form with t = tanh(u(x)):
  // 0.5 (1 + t) + 0.5 x (1 - t²) u'(x), u'(x) = √(2/π) (1 + 3 · 0.044715 x²).
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    if constexpr (Approximate) {
      const auto t = inner(x).tanh();
      return dy * (S(0.5) * (S(1) + t) +
                   S(0.5) * x * (S(1) - t.square()) * (S(sqrt_2_over_pi) * (S(1) + S(3 * cubic) * x.square())));
    } else {
      return dy * (S(0.5) * (S(1) + (x * S(inv_sqrt_2)).erf()) + S(inv_sqrt_2pi) * x * (S(-0.5) * x.square()).exp());
    }
  }
  static constexpr kernels::Activation kernel_derivative =
      Approximate ? kernels::Activation::gelu_tanh_derivative : kernels::Activation::gelu_derivative;
  template <class V>
  static void grad_in_place(V& dy, const V& x) {
    multiply_by_derivative<Gelu>(dy, x);
  }
};

// x · sigmoid(x) (MindSpore's SiLU, also called swish); derivative s (1 + x (1 - s)).
struct Silu : KernelActivation<kernels::Activation::silu> {
  static constexpr std::string_view name = "SiLU";
  static constexpr bool grad_from_input = true;
  static ops::Interchange interchange() {
    using In = ops::InterchangeInput;
    return {{"Sigmoid", {In::operand(0)}, {}}, {"Mul", {In::operand(0), In::node(0)}, {}}};
  }
  template <class A>
  static auto array(const A& a) {
    return a * a.logistic();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    const auto s = x.logistic();
    return dy * (s * (S(1) + x * (S(1) - s)));
  }
  static constexpr kernels::Activation kernel_derivative = kernels::Activation::silu_derivative;
  template <class V>
  static void grad_in_place(V& dy, const V& x) {
    multiply_by_derivative<Silu>(dy, x);
  }
};

// The activations with a parameter keep it as a member; ops::leaky_relu and friends check it.
// Their derivative is read off the output, which tells which side of 0 the input was on only
// for alpha >= 0: a negative alpha is refused where the function is made.
inline void check_alpha(double alpha, const std::string& who) {
  if (!(alpha >= 0)) {
    throw ValueError(who + ": alpha must be at least 0 (its gradient is taken from its output), got " +
                     std::to_string(alpha));
  }
}

// x for x > 0, alpha x otherwise; the derivative at 0 is alpha, as PyTorch's.
struct LeakyRelu {
  static constexpr std::string_view name = "LeakyReLU";
  ops::InterchangeNode interchange() const { return {"LeakyRelu", {}, {ops::InterchangeAttribute::of_real("alpha", alpha)}}; }
  double alpha = 0.2;
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    return (a > S(0)).select(a, a * static_cast<S>(alpha));
  }
  template <class G, class Y>
  auto grad_array(const G& dy, const Y& y) const {
    using S = typename Y::Scalar;
    return (y > S(0)).select(dy, dy * static_cast<S>(alpha));
  }
};

// x for x > 0, alpha (exp(x) - 1) otherwise; the derivative there is y + alpha.
struct Elu {
  static constexpr std::string_view name = "ELU";
  ops::InterchangeNode interchange() const { return {"Elu", {}, {ops::InterchangeAttribute::of_real("alpha", alpha)}}; }
  double alpha = 1.0;
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    return (a > S(0)).select(a, static_cast<S>(alpha) * a.expm1());
  }
  template <class G, class Y>
  auto grad_array(const G& dy, const Y& y) const {
    using S = typename Y::Scalar;
    return (y > S(0)).select(dy, dy * (y + static_cast<S>(alpha)));
  }
};

// log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (MindSpore's and
// PyTorch's softplus, which turn linear there to keep exp from overflowing). The derivative,
// sigmoid(beta x) or 1 on the linear side, comes from the input: the output cannot tell the
// sides apart just below the threshold, where log1p(exp(beta x)) already exceeds it.
struct Softplus {
  static constexpr std::string_view name = "Softplus";
  static constexpr bool grad_from_input = true;
  double beta = 1.0;
  double threshold = 20.0;
  // ONNX's Softplus, log(1 + exp(x)), has no threshold: past 20 the two differ by less than
  // exp(-20) of x. A beta other than 1 scales around it.
  ops::Interchange interchange() const {
    using In = ops::InterchangeInput;
    if (beta == 1.0) return {{"Softplus", {In::operand(0)}, {}}};
    return {{"Mul", {In::operand(0), In::number(beta)}, {}}, {"Softplus", {In::node(0)}, {}},
            {"Div", {In::node(1), In::number(beta)}, {}}};
  }
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    const S b = static_cast<S>(beta);
    return (a * b > static_cast<S>(threshold)).select(a, (a * b).exp().log1p() / b);
  }
  template <class G, class X>
  auto grad_array(const G& dy, const X& x) const {
    using S = typename X::Scalar;
    const S b = static_cast<S>(beta);
    return (x * b > static_cast<S>(threshold)).select(dy, dy * (x * b).logistic());
  }
};

}  // namespace fn

namespace ops {

template <class Fn>
struct MapGradOp;

// Whether an elementwise function says what it is in ONNX (MapOp::interchange).
template <class Fn>
inline constexpr bool has_interchange = requires(const Fn& f) { f.interchange(); };

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
    static_assert(std::is_floating_point_v<T> || (fn::on_integers<Fns> && ...),
                  "duet::ops: exp, log, sqrt, sin, cos, erf, sigmoid, tanh, GELU, SiLU, ELU, LeakyReLU and softplus take "
                  "floating-point tensors (on an integer tensor each result would be truncated to an integer): cast "
                  "first, ops::cast<float>(x) (duet/ops/cast.hpp); ReLU, abs, square and clip_by_value also take "
                  "integers");
    Backend::map(fns, a.in<T>(), a.in_shape().numel(), a.out<T>());
  }

  template <class C>
  static constexpr bool accepts_epilogue = requires { C::elementwise_functions; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return MapOp<Fns..., Gs...>{std::tuple_cat(fns, next.fns)};
  }
  static constexpr auto elementwise_functions = sizeof...(Fns);
  // Whether the functions have no parameters, so that an op keeping only their types (the
  // arithmetic ops' epilogues) runs them as this one does.
  static constexpr bool parameterless = (std::is_empty_v<Fns> && ...);

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
    ((s += s.empty() ? "" : " + ", s += Fns::name), ...);
    return s;
  }

  // ONNX: each function says what it is (fn::Relu::interchange), as one node reading its
  // input or as nodes reading operand 0 (GELU's erf form); empty if one does not.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr ((has_interchange<Fns> && ...)) {
      Interchange nodes;
      const auto add = [&](auto part) {
        const InterchangeInput in = nodes.empty() ? InterchangeInput::operand(0) : InterchangeInput::node(nodes.size() - 1);
        if constexpr (std::is_same_v<decltype(part), InterchangeNode>) {
          part.inputs = {InterchangeInput::operand(0)};
          append_interchange(nodes, {std::move(part)}, in);
        } else {
          append_interchange(nodes, std::move(part), in);
        }
      };
      std::apply([&](const auto&... f) { (add(f.interchange()), ...); }, fns);
      return nodes;
    } else {
      return {};
    }
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

template <class X>
auto sigmoid(X&& x) {
  return apply(MapOp<fn::Sigmoid>{}, std::forward<X>(x));
}
template <class X>
auto tanh(X&& x) {
  return apply(MapOp<fn::Tanh>{}, std::forward<X>(x));
}
// MindSpore's ops.gelu(x, approximate='none'): gelu(x) is the exact (erf) form,
// gelu<true>(x) the tanh form. A template argument: the two are different graph nodes.
template <bool Approximate = false, class X>
auto gelu(X&& x) {
  return apply(MapOp<fn::Gelu<Approximate>>{}, std::forward<X>(x));
}
template <class X>
auto silu(X&& x) {
  return apply(MapOp<fn::Silu>{}, std::forward<X>(x));
}
template <class X>
auto leaky_relu(X&& x, double alpha = 0.2) {
  fn::check_alpha(alpha, "ops::leaky_relu");
  return apply(MapOp<fn::LeakyRelu>{std::tuple{fn::LeakyRelu{alpha}}}, std::forward<X>(x));
}
template <class X>
auto elu(X&& x, double alpha = 1.0) {
  fn::check_alpha(alpha, "ops::elu");
  return apply(MapOp<fn::Elu>{std::tuple{fn::Elu{alpha}}}, std::forward<X>(x));
}
template <class X>
auto softplus(X&& x, double beta = 1.0, double threshold = 20.0) {
  if (!(beta > 0)) throw ValueError("ops::softplus: beta must be positive, got " + std::to_string(beta));
  return apply(MapOp<fn::Softplus>{std::tuple{fn::Softplus{beta, threshold}}}, std::forward<X>(x));
}

inline const bool activations_listed =
    list_operations({"relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu", "leaky_relu", "elu", "softplus"});

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

// An activation layer: Fn elementwise, with Fn's parameters given to the constructor
// (nn::LeakyReLU(0.1), nn::Softplus(2.0, 10.0)), checked as the ops:: functions check them.
template <class Fn, ElementType T = float>
class Activation : public Cell<Activation<Fn, T>, CONTEXT_MODE, T> {
 public:
  Activation() = default;
  template <class P, class... Ps>
    requires(std::is_arithmetic_v<P> && (std::is_arithmetic_v<Ps> && ...))
  explicit Activation(P p, Ps... ps) : fn_{with_parameters(p, ps...)} {
    if constexpr (requires { fn_.alpha; }) fn::check_alpha(fn_.alpha, "nn::" + std::string(Fn::name));
    if constexpr (requires { fn_.beta; }) {
      if (!(fn_.beta > 0)) throw ValueError(type_name() + ": beta must be positive, got " + std::to_string(fn_.beta));
    }
  }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::MapOp<Fn>{std::tuple{fn_}}, std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::" + std::string(Fn::name); }

 private:
  template <class... Ps>
  static Fn with_parameters(Ps... ps) {
    static_assert(!std::is_empty_v<Fn>,
                  "duet::nn: ReLU, Sigmoid, Tanh, SiLU, GELU and GELUExact take no argument; MindSpore's "
                  "nn.GELU(approximate=False) is nn::GELUExact, and nn::GELU is the tanh form (approximate=True)");
    if constexpr (std::is_empty_v<Fn>) return Fn{};
    else return Fn{static_cast<double>(ps)...};
  }

  Fn fn_{};
};

// MindSpore's activation cells.
using Sigmoid = Activation<fn::Sigmoid>;
using Tanh = Activation<fn::Tanh>;
using GELU = Activation<fn::Gelu<true>>;  // MindSpore's nn.GELU(approximate=True), its default
using GELUExact = Activation<fn::Gelu<false>>;  // nn.GELU(approximate=False)
using SiLU = Activation<fn::Silu>;
using LeakyReLU = Activation<fn::LeakyRelu>;  // alpha 0.2 by default, as MindSpore's
using ELU = Activation<fn::Elu>;              // alpha 1.0
using Softplus = Activation<fn::Softplus>;    // beta 1, threshold 20

}  // namespace nn
}  // namespace duet
