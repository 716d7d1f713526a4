// ops::cast<T>(x): x's values converted to element type T (MindSpore's ops.cast, PyTorch's
// x.to(dtype), x.float()).
//
// A comparison's UInt8 mask to float, to count or weigh the positions it keeps (a mean over
// the non-padded positions: sum(h * mask) / sum(mask)); int32 positions to float, for a
// position encoding; float to double and back. Conversions are C++'s static_cast: a floating
// value into an integer type is truncated toward zero, and one the type cannot hold is
// undefined there, so it is refused (a ValueError naming the value), as full_like refuses one.
//
// Between floating-point types the gradient is the incoming one cast back; from an integer type
// there is none (the input has none), and to one there is none to pass on.
#pragma once

#include <array>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "../dtype.hpp"
#include "../eager.hpp"
#include "../error.hpp"
#include "../operation.hpp"

namespace duet::ops {

template <class From, class To>
struct CastOp : Primitive<CastOp<From, To>> {
  using value_type = To;
  static constexpr int arity = 1;
  // As the gradient of the cast the other way, it reads the incoming gradient only.
  static constexpr std::array reads{graph::Operand::grad};

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const From* x = a.in<From>();
    T* y = a.out<T>();
    const index_t n = a.output_shape.numel();
    for (index_t i = 0; i < n; ++i) {
      if constexpr (std::is_floating_point_v<From> && std::is_integral_v<T>) {
        // Truncated toward zero, the range checked on the truncated value.
        const From t = std::trunc(x[i]);
        if (!(t >= static_cast<From>(std::numeric_limits<T>::min()) && t <= static_cast<From>(std::numeric_limits<T>::max()))) {
          throw ValueError(label() + ": " + std::to_string(x[i]) + " does not fit the type it is cast to (" +
                           std::string(name_of(dtype_of<T>)) + ")");
        }
      }
      y[i] = static_cast<T>(x[i]);
    }
  }

  static Interchange interchange(std::span<const Shape>) {
    return {{"Cast", {InterchangeInput::operand(0)}, {InterchangeAttribute::of("to", onnx_type_code(dtype_of<To>))}}};
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    if constexpr (std::is_floating_point_v<From> && std::is_floating_point_v<To>) return CastOp<To, From>{};
    else return NoGradient{};
  }

  static std::string op_name() {
    return "Cast<" + std::string(name_of(dtype_of<From>)) + ", " + std::string(name_of(dtype_of<To>)) + ">";
  }
  static std::string label() { return "ops::cast<" + std::string(name_of(dtype_of<To>)) + ">"; }
};

template <ElementType To, class X>
auto cast(X&& x) {
  using From = typename std::remove_cvref_t<X>::value_type;
  return apply(CastOp<From, To>{}, std::forward<X>(x));
}

inline const bool cast_listed = list_operations({"cast"});

}  // namespace duet::ops
