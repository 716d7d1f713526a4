// Fully connected layers: nn::Dense and the operations it captures as (MatMul, BiasAdd).
#pragma once

#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../backend.hpp"
#include "../cell.hpp"
#include "../eager.hpp"
#include "../initializer.hpp"
#include "../random.hpp"
#include "activation.hpp"

namespace duet {
namespace ops {

template <class Layer>
struct BiasAddOp;
template <class Layer, bool Bias, class... Fns>
struct PackedMatMulOp;
template <class Layer, bool Bias, bool InputGrad, class... Fns>
struct DenseGradOp;
template <class Layer, bool InputGrad>
struct BiasAddGradOp;

namespace detail {
// The sizes a layer's products are compiled for: its run-time form's, dyn where an
// nn::Dense<In, Out> shares the code of nn::Dense<> (backend::dense_depends_on_sizes).
template <class Layer>
using DenseKernel = std::remove_pointer_t<decltype(nn::detail::runtime_form(std::declval<Layer*>()))>;
}  // namespace detail

// x · Wᵀ over the last axis of x, then the epilogue: the bias if Bias, then each Fn. Capture
// makes it with an empty epilogue; fuse_epilogues grows it.
template <class Layer, bool Bias = false, class... Fns>
struct MatMulOp : Primitive<MatMulOp<Layer, Bias, Fns...>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  std::tuple<Fns...> fns{};  // the epilogue functions' parameters (fn::LeakyRelu's alpha)
  MatMulOp(const Layer* l) : layer(l) {}
  MatMulOp(const Layer* l, std::tuple<Fns...> f) : layer(l), fns(std::move(f)) {}

  static constexpr ShapeResult rule(index_t in, index_t out, const Shape& x) {
    Shape y = x;
    if (x.rank() == 0) {
      y.push_back(out);
      return x.leading_unknown() ? ShapeResult{y} : fault(y, ShapeFault::min_rank, 1);
    }
    y = x.with_back(out);
    if (in != dyn && x.back() != dyn && x.back() != in) return fault(y, ShapeFault::last_dimension, in);
    return {y};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return rule(Layer::in_static, Layer::out_static, in[0]);
  }
  ShapeResult infer(std::span<const Shape> in) const {
    return rule(layer->in_channels(), layer->out_channels(), in[0]);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    product<Backend, T, false>(a);
  }

  // The same product with the weight kept pre-packed between calls (inference graphs at O1 and O2).
  auto with_packed_weight() const { return PackedMatMulOp<Layer, Bias, Fns...>{{layer, fns}}; }

  // Takes this layer's bias first (if it has one), then any elementwise functions.
  template <class C>
  static constexpr bool accepts_epilogue =
      (std::is_same_v<C, BiasAddOp<Layer>> && Layer::has_bias && !Bias && sizeof...(Fns) == 0) ||
      requires { C::elementwise_functions; };
  auto absorb(const BiasAddOp<Layer>&) const { return MatMulOp<Layer, true, Fns...>{layer, fns}; }
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return MatMulOp<Layer, Bias, Fns..., Gs...>{layer, std::tuple_cat(fns, next.fns)};
  }

  // Its gradient op differentiates an activation epilogue from the forward output, so it can
  // do so for one function whose derivative the output gives.
  static constexpr bool differentiable = sizeof...(Fns) == 0 || (sizeof...(Fns) == 1 && (!fn::grad_from_input<Fns> && ...));
  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return DenseGradOp<Layer, Bias, true, Fns...>{layer, fns};
  }
  auto parameter_grad_op() const { return DenseGradOp<Layer, Bias, false, Fns...>{layer, fns}; }

  static std::string op_name() { return with_epilogue("MatMul"); }
  std::string label() const { return layer->label(); }

  // ONNX: Gemm(x, W, transB = 1) on a matrix; on other ranks a MatMul by Wᵀ. Only the plain
  // product: PyNative, which export_onnx traces, runs the epilogue as ops of their own.
  Interchange interchange(std::span<const Shape> in) const {
    if constexpr (Bias || sizeof...(Fns) > 0) {
      return {};
    } else {
      using I = InterchangeInput;
      if (in[0].rank() == 2) {
        return {{"Gemm", {I::operand(0), I::of_parameter(&layer->weight)}, {InterchangeAttribute::of("transB", 1)}}};
      }
      return {{"Transpose", {I::of_parameter(&layer->weight)}, {InterchangeAttribute::of("perm", std::vector<std::int64_t>{1, 0})}},
              {"MatMul", {I::operand(0), I::node(0)}, {}}};
    }
  }

 protected:
  // Built in a local, not a by-value parameter: g++ 12 at -O1 and above warns (-Warray-bounds,
  // a false positive) on the inlined move of a returned parameter string.
  static std::string with_epilogue(const char* product) {
    std::string s = product;
    if (Bias) s += " + BiasAdd";
    ((s += " + ", s += Fns::name), ...);
    return s;
  }

  template <class Backend, class T, bool PackedWeight>
  void product(const graph::KernelArgs& a) const {
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : a.in_shape().numel() / in_channels;
    const T* bias = nullptr;
    if constexpr (Bias) bias = layer->bias.data();
    const Epilogue<T, Fns...> epilogue{bias, fns};
    constexpr index_t In = detail::DenseKernel<Layer>::in_static;
    constexpr index_t Out = detail::DenseKernel<Layer>::out_static;
    if constexpr (PackedWeight && backend::packs_as_dense<Backend, In, Out, T, Fns...>()) {
      Backend::template dense_packed<In, Out>(a.in<T>(), rows, in_channels, layer->weight, layer->out_channels(),
                                              epilogue, a.out<T>());
    } else {
      Backend::template dense<In, Out>(a.in<T>(), rows, in_channels, layer->weight.data(), layer->out_channels(),
                                       epilogue, a.out<T>());
    }
  }
};

// MatMulOp whose weight the backend keeps packed from call to call, repacking it only after
// the weight is written: what a layer that runs many times between updates wants. The result
// is bit for bit MatMulOp's.
template <class Layer, bool Bias, class... Fns>
struct PackedMatMulOp : MatMulOp<Layer, Bias, Fns...> {
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    this->template product<Backend, T, true>(a);
  }

  static std::string op_name() { return MatMulOp<Layer, Bias, Fns...>::with_epilogue("PackedMatMul"); }
};

// x + bias over the last axis, bias being the layer's.
template <class Layer>
struct BiasAddOp : Primitive<BiasAddOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;

  const Layer* layer;
  BiasAddOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult rule(index_t out, const Shape& x) {
    if (x.rank() > 0 && out != dyn && x.back() != dyn && x.back() != out) {
      return fault(x, ShapeFault::last_dimension, out);
    }
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::out_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->out_channels(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const index_t cols = layer->out_channels();
    Backend::add_bias(a.in<T>(), cols == 0 ? 0 : a.in_shape().numel() / cols, cols, layer->bias.data(), a.out<T>());
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return BiasAddGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return BiasAddGradOp<Layer, false>{layer}; }

  static std::string op_name() { return "BiasAdd"; }
  std::string label() const { return layer->label(); }

  Interchange interchange(std::span<const Shape>) const {
    return {{"Add", {InterchangeInput::operand(0), InterchangeInput::of_parameter(&layer->bias)}, {}}};
  }
};

// The gradient of MatMulOp<Layer, Bias, Fns...>: from dy (and y, when Fns need it) it makes
// dW, db and, if InputGrad, dx. The activation mask and the bias sum are taken in the same
// kernel as the products, as the forward fused them.
template <class Layer, bool Bias, bool InputGrad, class... Fns>
struct DenseGradOp : Primitive<DenseGradOp<Layer, Bias, InputGrad, Fns...>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr auto reads = [] {
    if constexpr (sizeof...(Fns) == 0)
      return std::array{graph::Operand::grad, graph::Operand::input0};
    else
      return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
  }();
  static constexpr int arity = static_cast<int>(reads.size());  // dy, x[, y]
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  std::tuple<Fns...> fns;
  DenseGradOp(const Layer* l, std::tuple<Fns...> f) : layer(l), fns(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    bool accumulate_w = false;
    bool accumulate_b = false;
    T* dw = layer->weight.grad_for_write(pass, &accumulate_w);
    T* db = nullptr;
    if constexpr (Bias) db = layer->bias.grad_for_write(pass, &accumulate_b);
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : a.in_shape(1).numel() / in_channels;
    using Kernel = detail::DenseKernel<Layer>;
    Backend::template dense_backward<Kernel::in_static, Kernel::out_static, T, Fns...>(DenseBackwardArgs<T>{
        a.in<T>(0), a.in<T>(1), sizeof...(Fns) == 0 ? nullptr : a.in<T>(2), rows, in_channels, layer->weight.data(),
        layer->out_channels(), InputGrad ? a.out<T>() : nullptr, dw, accumulate_w, db, accumulate_b}, fns);
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() {
    std::string s = "MatMulGrad";
    if (Bias) s += " + BiasGrad";
    ((s += " + " + std::string(Fns::name) + "Grad"), ...);
    if (!InputGrad) s += " (parameters only)";
    return s;
  }
  std::string label() const { return layer->label(); }
};

// The gradient of BiasAddOp: db is the column sum of dy, and dx is dy itself (a view).
template <class Layer, bool InputGrad>
struct BiasAddGradOp : Primitive<BiasAddGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr bool is_view = InputGrad;
  static constexpr bool has_side_effects = true;
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  BiasAddGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[0] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    bool accumulate = false;
    T* db = layer->bias.grad_for_write(duet::detail::current_backward_pass(), &accumulate);
    const index_t cols = layer->out_channels();
    Backend::bias_grad(a.in<T>(), cols == 0 ? 0 : a.in_shape().numel() / cols, cols, db, accumulate);
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() { return InputGrad ? "BiasAddGrad" : "BiasAddGrad (parameters only)"; }
  std::string label() const { return layer->label(); }
};

}  // namespace ops

namespace nn {

// nn::Dense's initialisers (MindSpore's weight_init, bias_init): any duet::initializer, or a
// user's; left unset, MindSpore's defaults. (MindSpore's has_bias is a template argument of
// nn::Dense: it decides which nodes the layer captures.)
template <ElementType T>
struct DenseOptions {
  std::optional<initializer::AnyInitializer<T>> weight_init = std::nullopt;
  std::optional<initializer::AnyInitializer<T>> bias_init = std::nullopt;
};

namespace detail {
// A Dense layer's parameters, the checkpoint entries: weight and, if it has one, bias.
template <ElementType T, bool HasBias>
struct DenseParameters {
  BasicParameter<T> weight;  // [out_channels, in_channels]
  BasicParameter<T> bias;    // [out_channels]
  DUET_CELL_MEMBERS(weight, bias);
};
template <ElementType T>
struct DenseParameters<T, false> {
  BasicParameter<T> weight;
  DUET_CELL_MEMBERS(weight);
};

// A Dense's weight, then its bias, from the global generator (set_seed); `fixed` holds its
// compile-time sizes (dyn where none). Unset options are MindSpore 2.x's defaults: weight
// HeUniform(negative_slope = sqrt(5)) and bias Uniform(1/sqrt(in)), both U(-1/sqrt(in),
// 1/sqrt(in)), drawn here as that Uniform so that the bound is T's 1/sqrt(in) for every T.
// Not a member of Dense: compiled once per element type, not once per layer size.
template <ElementType T, bool HasBias>
void initialize_dense(DenseParameters<T, HasBias>& parameters, const BasicDynamicCell<T>& cell,
                      std::array<index_t, 2> fixed, std::array<index_t, 2> sizes, const DenseOptions<T>& options) {
  const index_t in_channels = sizes[0], out_channels = sizes[1];  // not a structured binding: clang 14 cannot capture one
  if ((fixed[0] != dyn && in_channels != fixed[0]) || (fixed[1] != dyn && out_channels != fixed[1]) ||
      in_channels <= 0 || out_channels <= 0) {
    throw ValueError(cell.type_name() + ": cannot be built with in_channels " + std::to_string(in_channels) +
                     " and out_channels " + std::to_string(out_channels));
  }
  const initializer::Uniform mindspore_default{static_cast<double>(T(1) / std::sqrt(static_cast<T>(in_channels)))};
  if (!HasBias && options.bias_init) {
    throw ValueError(cell.type_name() + ": bias_init is given, but the layer has no bias (HasBias = false)");
  }
  const initializer::AnyInitializer<T> weight_init = options.weight_init.value_or(mindspore_default);
  auto weight_value = BasicTensor<T>::uninitialized({out_channels, in_channels});
  with_global_generator([&](Generator& gen) {
    initializer::initialize_option(weight_value, weight_init, gen, cell.type_name(), "weight_init");
    if constexpr (HasBias) {
      auto bias_value = BasicTensor<T>::uninitialized({out_channels});
      initializer::initialize_option(bias_value, options.bias_init.value_or(mindspore_default), gen, cell.type_name(),
                                     "bias_init");
      parameters.bias = BasicParameter<T>(std::move(bias_value));
    }
  });
  parameters.weight = BasicParameter<T>(std::move(weight_value));
}
}  // namespace detail

// y = x · weightᵀ + bias over the last axis of x (MindSpore's nn.Dense). In and Out are
// compile-time sizes, or duet::dyn for sizes given to the constructor at run time. HasBias
// false is MindSpore's has_bias=False: no bias parameter, y = x · weightᵀ.
//
// Dense<In, Out> is Dense<> with the sizes in its type (SizedLayer): graph capture checks the
// input against them while the program compiles, and the layer otherwise runs Dense<>'s code,
// compiled once for all sizes. Except where the sizes change the product's code, and so
// possibly its bits (small layers the GEMM unrolls, backend::dense_depends_on_sizes): such a
// layer is a cell of its own, as a partly dyn one is.
template <index_t In = dyn, index_t Out = dyn, ElementType T = float, bool HasBias = true>
class Dense : public Cell<Dense<In, Out, T, HasBias>, CONTEXT_MODE, T>, public detail::DenseParameters<T, HasBias> {
  static_assert(In == dyn || In > 0, "nn::Dense<In, Out>: In must be positive (or duet::dyn)");
  static_assert(Out == dyn || Out > 0, "nn::Dense<In, Out>: Out must be positive (or duet::dyn)");

 public:
  using runtime_type = Dense;
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;
  static constexpr bool has_bias = HasBias;
  using detail::DenseParameters<T, HasBias>::weight;

  using Options = DenseOptions<T>;

  Dense() requires(In != dyn && Out != dyn) : Dense(In, Out) {}
  // nn::Dense<784, 512> fc{{.weight_init = initializer::HeNormal{}, .bias_init = initializer::Zero{}}};
  explicit Dense(Options options) requires(In != dyn && Out != dyn) : Dense(In, Out, std::move(options)) {}

  Dense(index_t in_channels, index_t out_channels, Options options = {})
      : Dense(in_channels, out_channels, std::move(options), {In, Out}) {}

 protected:
  // A Dense<In, Out>'s: sized holds the sizes its type fixes, which it checks and is named by.
  Dense(index_t in_channels, index_t out_channels, Options options, std::array<index_t, 2> sized)
      : in_(in_channels), out_(out_channels), sized_(sized) {
    detail::initialize_dense<T, HasBias>(*this, *this, sized, {in_channels, out_channels}, options);
  }

 public:
  index_t in_channels() const {
    if constexpr (In != dyn)
      return In;
    else
      return in_;
  }
  index_t out_channels() const {
    if constexpr (Out != dyn)
      return Out;
    else
      return out_;
  }

  template <class X>
  auto construct(X&& x) {
    return captured_as(this, std::forward<X>(x));
  }

  std::string type_name() const override {
    std::string s = "nn::Dense<" + size_name(sized_[0]) + ", " + size_name(sized_[1]);
    if constexpr (!std::is_same_v<T, float> || !HasBias) s += ", " + std::string(name_of(dtype_of<T>));
    if constexpr (!HasBias) s += ", no bias";
    return s + ">";
  }
  std::string extra_repr() const override {
    return sized_[0] != dyn && sized_[1] != dyn ? std::string{} : std::to_string(in_) + ", " + std::to_string(out_);
  }

 protected:
  // The operations of a Dense typed on layer: this one, or a Dense<In, Out> deriving from it.
  template <class Layer, class X>
  static auto captured_as(Layer* layer, X&& x) {
    if constexpr (HasBias) return apply(ops::BiasAddOp<Layer>{layer}, apply(ops::MatMulOp<Layer>{layer}, std::forward<X>(x)));
    else return apply(ops::MatMulOp<Layer>{layer}, std::forward<X>(x));
  }

 private:
  static std::string size_name(index_t n) { return n == dyn ? "dyn" : std::to_string(n); }

  index_t in_;
  index_t out_;
  std::array<index_t, 2> sized_;
};

template <index_t In, index_t Out, ElementType T, bool HasBias>
  requires(In > 0 && Out > 0 && !backend::dense_depends_on_sizes<DefaultBackend, In, Out, T>())
class Dense<In, Out, T, HasBias> : public SizedLayer<Dense<In, Out, T, HasBias>, Dense<dyn, dyn, T, HasBias>> {
  using Runtime = Dense<dyn, dyn, T, HasBias>;
  using Sized = SizedLayer<Dense, Runtime>;

 public:
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;
  using Options = DenseOptions<T>;

  Dense() : Dense(In, Out) {}
  explicit Dense(Options options) : Dense(In, Out, std::move(options)) {}
  Dense(index_t in_channels, index_t out_channels, Options options = {})
      : Sized(in_channels, out_channels, std::move(options), {In, Out}) {}

  template <graph::Symbolic S>
  auto sized_construct(const S& x) {
    return Runtime::captured_as(this, x);
  }
};

}  // namespace nn
}  // namespace duet
