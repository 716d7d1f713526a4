// Operations that change how the gradient flows, not the value.
//
// stop_gradient(x): x itself, through which no gradient passes (MindSpore's
// ops.stop_gradient, PyTorch's x.detach()). A target computed by the network itself (a
// target network's output, a running statistic, the straight-through estimator's
// `x + stop_gradient(q - x)`) is held constant by it. The output is a view of x (no copy,
// no kernel); the operation says `stops_gradient`, which both modes' differentiation read:
// the gradient ends there on purpose instead of being refused as a lost one (a NoGradient
// input that depends on what is differentiated is an error everywhere else), PyNative's tape
// does not record it, and graph mode's backward graph has no edge through it. A loss that
// depends on the parameters only through it therefore depends on nothing being
// differentiated: the parameters' gradients are zero in both modes, as in MindSpore.
#pragma once

#include <span>
#include <string>
#include <utility>

#include "../eager.hpp"
#include "../operation.hpp"

namespace duet::ops {

struct StopGradientOp : Primitive<StopGradientOp> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool stops_gradient = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }

  static std::string op_name() { return "StopGradient"; }
  std::string label() const { return "ops::stop_gradient"; }
  Interchange interchange(std::span<const Shape>) const {
    return {{"Identity", {InterchangeInput::operand(0)}, {}}};
  }
};

template <class X>
auto stop_gradient(X&& x) {
  return apply(StopGradientOp{}, std::forward<X>(x));
}

inline const bool gradient_control_listed = list_operations({"stop_gradient"});

}  // namespace duet::ops
