// Tensors made in construct from another's shape: zeros_like, ones_like, full_like
// (MindSpore's ops.zeros_like, ops.ones_like, ops.full_like).
//
// Within construct a batch size is known only from a tensor of that batch, so a constant of
// the batch's shape is made from one: a recurrent cell's zero state, `ops::zeros_like(x)`, or
// a learned initial state h0 of shape [1, hidden] broadcast to the batch,
// `h0 + ops::zeros_like(x)` with x [batch, hidden] (numpy broadcasting; h0's gradient is
// summed over the batch). `x * 0` is not the same: inf or NaN in x makes NaN.
//
// The output does not depend on the input's values, so no gradient is due to the input: the
// operations say `stops_gradient` (operation.hpp), and an input that depends on what is
// differentiated gets nothing from them, without the refusal a lost gradient meets.
// Differentiation uses the same operation for the ones that start backward and the zeros of
// an input the output does not depend on.
#pragma once

#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "../eager.hpp"
#include "../error.hpp"
#include "../operation.hpp"

namespace duet::ops {

enum class Fill { zeros, ones, value };

template <Fill F>
struct FillLikeOp : Primitive<FillLikeOp<F>> {
  static constexpr int arity = 1;
  static constexpr bool stops_gradient = true;
  double value = F == Fill::ones ? 1.0 : 0.0;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    // Into an integer type, a value it cannot hold would be undefined behaviour: refused.
    if constexpr (std::is_integral_v<T>) {
      if (!(value >= static_cast<double>(std::numeric_limits<T>::min()) &&
            value <= static_cast<double>(std::numeric_limits<T>::max()))) {
        throw ValueError(label() + ": " + std::to_string(value) + " does not fit the tensor's integer type");
      }
    }
    Backend::fill(a.out<T>(), a.output_shape.numel(), static_cast<T>(value));
  }

  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }

  static std::string op_name() { return F == Fill::zeros ? "ZerosLike" : F == Fill::ones ? "OnesLike" : "FullLike"; }
  std::string label() const {
    return F == Fill::zeros ? "ops::zeros_like" : F == Fill::ones ? "ops::ones_like" : "ops::full_like";
  }
};

template <class X>
auto zeros_like(X&& x) {
  return apply(FillLikeOp<Fill::zeros>{}, std::forward<X>(x));
}

template <class X>
auto ones_like(X&& x) {
  return apply(FillLikeOp<Fill::ones>{}, std::forward<X>(x));
}

// The value converted to x's element type, as MindSpore's fill_value is (truncated into an
// integer type; one it cannot hold is a ValueError).
template <class X>
auto full_like(X&& x, double value) {
  FillLikeOp<Fill::value> op;
  op.value = value;
  return apply(op, std::forward<X>(x));
}

inline const bool creation_listed = list_operations({"zeros_like", "ones_like", "full_like"});

}  // namespace duet::ops
