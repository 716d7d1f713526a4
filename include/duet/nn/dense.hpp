// Fully connected layers: nn::Dense and the operations it captures as (MatMul, BiasAdd).
#pragma once

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "../backend.hpp"
#include "../cell.hpp"
#include "../eager.hpp"
#include "../random.hpp"
#include "activation.hpp"

namespace duet {
namespace ops {

template <class Layer>
struct BiasAddOp;

// x · Wᵀ over the last axis of x, then the epilogue: the bias if Bias, then each Fn. Capture
// makes it with an empty epilogue; fuse_epilogues grows it.
template <class Layer, bool Bias = false, class... Fns>
struct MatMulOp {
  using layer_type = Layer;
  using T = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  const Layer* layer;

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

  template <class Backend>
  void run(const T* const* in, const Shape* in_shapes, T* out, const Shape&) const {
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : in_shapes[0].numel() / in_channels;
    Backend::template dense<Layer::in_static, Layer::out_static>(
        in[0], rows, in_channels, layer->weight.data(), layer->out_channels(),
        Epilogue<T, Fns...>{Bias ? layer->bias.data() : nullptr}, out);
  }

  // Takes this layer's bias first, then any elementwise function.
  template <class C>
  static constexpr bool accepts_epilogue =
      (std::is_same_v<C, BiasAddOp<Layer>> && !Bias && sizeof...(Fns) == 0) || requires { typename C::fn_type; };
  auto absorb(const BiasAddOp<Layer>&) const { return MatMulOp<Layer, true, Fns...>{layer}; }
  template <class Fn>
  auto absorb(const MapOp<Fn>&) const {
    return MatMulOp<Layer, Bias, Fns..., Fn>{layer};
  }

  static std::string op_name() {
    std::string s = "MatMul";
    if (Bias) s += " + BiasAdd";
    ((s += " + " + std::string(Fns::name)), ...);
    return s;
  }
  std::string label() const { return layer->label(); }
};

// x + bias over the last axis, bias being the layer's.
template <class Layer>
struct BiasAddOp {
  using layer_type = Layer;
  using T = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = true;

  const Layer* layer;

  static constexpr ShapeResult rule(index_t out, const Shape& x) {
    if (x.rank() > 0 && out != dyn && x.back() != dyn && x.back() != out) {
      return fault(x, ShapeFault::last_dimension, out);
    }
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::out_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->out_channels(), in[0]); }

  template <class Backend>
  void run(const T* const* in, const Shape* in_shapes, T* out, const Shape&) const {
    const index_t cols = layer->out_channels();
    Backend::add_bias(in[0], cols == 0 ? 0 : in_shapes[0].numel() / cols, cols, layer->bias.data(), out);
  }

  static std::string op_name() { return "BiasAdd"; }
  std::string label() const { return layer->label(); }
};

}  // namespace ops

namespace nn {

// y = x · weightᵀ + bias over the last axis of x (MindSpore's nn.Dense). In and Out are
// compile-time sizes, or duet::dyn for sizes given to the constructor at run time.
template <index_t In = dyn, index_t Out = dyn, ElementType T = float>
class Dense : public Cell<Dense<In, Out, T>, CONTEXT_MODE, T> {
  static_assert(In == dyn || In > 0, "nn::Dense<In, Out>: In must be positive (or duet::dyn)");
  static_assert(Out == dyn || Out > 0, "nn::Dense<In, Out>: Out must be positive (or duet::dyn)");

 public:
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;

  BasicParameter<T> weight;  // [out_channels, in_channels]
  BasicParameter<T> bias;    // [out_channels]
  DUET_CELL_MEMBERS(weight, bias);

  Dense()
    requires(In != dyn && Out != dyn)
      : Dense(In, Out) {}

  // MindSpore 2.x's default initialisation, from the global generator (set_seed): weight
  // HeUniform(a = sqrt(5)), which is U(-1/sqrt(in), 1/sqrt(in)); bias U(-1/sqrt(in), 1/sqrt(in)).
  Dense(index_t in_channels, index_t out_channels) : in_(in_channels), out_(out_channels) {
    if ((In != dyn && in_channels != In) || (Out != dyn && out_channels != Out) || in_channels <= 0 ||
        out_channels <= 0) {
      throw ValueError(type_name() + ": cannot be built with in_channels " + std::to_string(in_channels) +
                       " and out_channels " + std::to_string(out_channels));
    }
    const T bound = T(1) / std::sqrt(static_cast<T>(in_channels));
    with_global_generator([&](Generator& gen) {
      weight = BasicParameter<T>(uniform<T>({out_channels, in_channels}, -bound, bound, gen));
      bias = BasicParameter<T>(uniform<T>({out_channels}, -bound, bound, gen));
    });
  }

  index_t in_channels() const {
    if constexpr (In != dyn) return In;
    else return in_;
  }
  index_t out_channels() const {
    if constexpr (Out != dyn) return Out;
    else return out_;
  }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::BiasAddOp<Dense>{this}, apply(ops::MatMulOp<Dense>{this}, std::forward<X>(x)));
  }

  std::string type_name() const override {
    std::string s = "nn::Dense<" + size_name(In) + ", " + size_name(Out);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  static std::string size_name(index_t n) { return n == dyn ? "dyn" : std::to_string(n); }

  index_t in_;
  index_t out_;
};

}  // namespace nn
}  // namespace duet
