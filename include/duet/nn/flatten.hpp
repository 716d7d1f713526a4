// Reshaping layers. They move no data: in both modes their output is a view of their input.
#pragma once

#include <array>
#include <string>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../ops/shape.hpp"

namespace duet {
namespace ops {

// [N, d1, d2, ...] -> [N, d1 * d2 * ...].
struct FlattenOp : Primitive<FlattenOp> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    if (x.leading_unknown()) return {Shape{dyn, dyn}};
    // A rank-1 input is one sample without its batch dimension; flattening it as a batch of
    // one-element samples would only surface, puzzlingly, at the next layer.
    if (x.rank() < 2) return fault(Shape{1, x.numel()}, ShapeFault::batch_dimension, 2);
    return {Shape{x[0], x.numel_from(1)}};
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Flatten"; }
  std::string label() const { return "nn::Flatten"; }
  Interchange interchange(std::span<const Shape>) const {
    return {{"Flatten", {InterchangeInput::operand(0)}, {InterchangeAttribute::of("axis", 1)}}};
  }
};

template <class X>
auto flatten(X&& x) {
  return apply(FlattenOp{}, std::forward<X>(x));
}

}  // namespace ops

namespace nn {

// Keeps the first (batch) axis and merges the rest (MindSpore's nn.Flatten).
template <ElementType T>
class BasicFlatten : public Cell<BasicFlatten<T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return ops::flatten(std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::Flatten"; }
};

using Flatten = BasicFlatten<float>;

}  // namespace nn
}  // namespace duet
