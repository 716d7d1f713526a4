// DebugLevel::debug's check of an operation's output, shared by graph mode's evaluator and
// PIJit's replay: the first NaN or infinity, named with what made it.
#pragma once

#include <cmath>
#include <string>
#include <type_traits>

#include "../error.hpp"
#include "../shape.hpp"

namespace duet::detail {

template <class T>
void check_finite(const T* values, const Shape& shape, const std::string& context) {
  if constexpr (std::is_floating_point_v<T>) {
    for (index_t i = 0; i < shape.numel(); ++i) {
      if (!std::isfinite(values[i])) {
        throw ValueError(context + "output element " + std::to_string(i) + " of " + to_string(shape) + " is " +
                         (std::isnan(values[i]) ? "NaN" : "infinite"));
      }
    }
  }
}

}  // namespace duet::detail
