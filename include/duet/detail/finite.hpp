// Finiteness checks: DebugLevel::debug's check of an operation's output, shared by graph mode's
// evaluator and PIJit's replay, and the optimisers' check of the gradients they are given
// (nn::BasicOptimizer), which nn::TrainOneStepCell's check of its loss shares.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../error.hpp"
#include "../shape.hpp"

namespace duet::detail {

// The index of the first NaN or infinity among values[0, n), or -1 if there is none.
//
// An optimiser runs this over every gradient before each step, a pass of its own (an update
// fused with it could not leave everything as it was on failure: earlier elements and
// parameters would already be written). So the common case, all finite, is made cheap: blocks of
// a fixed length OR together a bit that is set exactly when an element's exponent is all ones
// (its exponent field plus one carries into the sign bit), integer operations that g++ and clang
// vectorise at -O2 on any x86-64 or AArch64 (std::isfinite per element, with a branch, does not
// vectorise); the element is looked for only in a block that has one. The optimisers run it on
// the threads their updates use; benchmarks/optim.cpp measures it against the update it guards.
template <class T>
index_t first_nonfinite(const T* values, index_t n) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    using Bits = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint64_t>;
    constexpr auto exponent = static_cast<Bits>(std::is_same_v<T, float> ? 0x7f800000u : 0x7ff0000000000000u);
    constexpr Bits one = exponent & (~exponent + 1);  // the exponent field's lowest bit
    constexpr Bits sign = ~(~Bits{0} >> 1);
    constexpr index_t block = 256;
    for (index_t b = 0; b < n; b += block) {
      Bits any = 0;
      if (n - b >= block) {
        for (index_t i = 0; i < block; ++i) any |= (std::bit_cast<Bits>(values[b + i]) & exponent) + one;
      } else {
        for (index_t i = b; i < n; ++i) any |= (std::bit_cast<Bits>(values[i]) & exponent) + one;
      }
      if ((any & sign) == 0) continue;
      for (index_t i = b;; ++i) {
        if (!std::isfinite(values[i])) return i;
      }
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    for (index_t i = 0; i < n; ++i) {
      if (!std::isfinite(values[i])) return i;
    }
  }
  return -1;
}

// How a value first_nonfinite found reads in a message.
template <class T>
const char* nonfinite_kind(T value) {
  return std::isnan(value) ? "NaN" : "infinite";
}

template <class T>
void check_finite(const T* values, const Shape& shape, const std::string& context) {
  const index_t i = first_nonfinite(values, shape.numel());
  if (i >= 0) {
    throw ValueError(context + "output element " + std::to_string(i) + " of " + to_string(shape) + " is " +
                     nonfinite_kind(values[i]));
  }
}

}  // namespace duet::detail
