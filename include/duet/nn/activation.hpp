// Activation layers and the elementwise functions behind them.
//
// An elementwise function is a type with a name and an Eigen array form. The same type is a
// graph node of its own (ops::MapOp<Fn>, what PyNative runs) or, after fuse_epilogues, a
// step in a product's epilogue: the function is written once and used both ways.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"

namespace duet {

namespace fn {

struct Relu {
  static constexpr std::string_view name = "ReLU";
  // NaN stays NaN, as IEEE and numpy's maximum say; a plain max(x, 0) would turn it into 0.
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    return a.binaryExpr(A::Constant(a.rows(), a.cols(), S(0)),
                        ::Eigen::internal::scalar_max_op<S, S, ::Eigen::PropagateNaN>());
  }
};

}  // namespace fn

namespace ops {

template <class Fn>
struct MapOp {
  using layer_type = MapOp;
  using fn_type = Fn;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const T* const* in, const Shape* in_shapes, T* out, const Shape&) const {
    Backend::template map<Fn>(in[0], in_shapes[0].numel(), out);
  }

  static std::string op_name() { return std::string(Fn::name); }
  std::string label() const { return op_name(); }
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
