// Max pooling's kernels, forward and gradient, once per instruction set: over 2x2 windows at
// stride 2 that tile the input (LeNet-5's and most CNNs' pooling), a vector of L outputs reads
// 2L values of each of the window's two rows and splits them into left and right taps by
// shuffles; over any other window at column stride 1 or 2 (ResNet's 3x3/2 pad 1, 3x3/1 pad 1),
// L windows at a time from a padded copy of their rows. ops/pool.hpp's general
// loops rely on the compiler to vectorise a strided compare-and-select, which g++ 12 does at
// -O3 with -march=native and not at -O2 or for the baseline alone; here every build gets the
// set the machine has (simd/isa.hpp). The rules are ops/pool.hpp's, to the bit: the taps in
// row-major order, a NaN winning the value (MaxPoolKind::combine) and the first NaN, or else
// the first maximal tap, taking the gradient (takes_max), dx = 0 + dy there, the dy of windows
// that choose the same element added in output order, and zero elsewhere, including the rows
// and columns no window covers.
#pragma once

#include <algorithm>
#include <limits>
#include <utility>

#include "../shape.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"
#include "simd/isa.hpp"

namespace duet::kernels {

// A max pooling's input planes [H, W], output planes [OH, OW] and window: kernel KH x KW,
// stride SH x SW, padding pad_top and pad_left before the first row and column (no window all
// padding).
struct PoolShape {
  index_t planes, H, W, OH, OW, KH, KW, SH, SW, pad_top, pad_left;
};

// The elements of max_pool's and max_pool_backward's buffers on the stack: a window's rows of
// the input, padded, and an output row.
inline constexpr index_t max_pool_buffer = 4096;

}  // namespace duet::kernels

#define DUET_KERNEL_BODY "pool_impl.hpp"
#include "detail/per_isa.hpp"

namespace duet::kernels {

// y[p, oh, ow] = max of x[p, 2oh + {0, 1}, 2ow + {0, 1}] over `planes` planes of [H, W], with
// 2 · OH <= H and 2 · OW <= W.
template <class T>
void max_pool_2x2(const T* x, index_t planes, index_t H, index_t W, index_t OH, index_t OW, T* y) {
  detail::with_target(active_isa(), [&](auto target) { max_pool_2x2_step(target, x, planes, H, W, OH, OW, y); });
}

// dx of max_pool_2x2: each dy to its window's maximal tap, zero elsewhere.
template <class T>
void max_pool_2x2_backward(const T* dy, const T* x, index_t planes, index_t H, index_t W, index_t OH, index_t OW, T* dx) {
  detail::with_target(active_isa(),
                      [&](auto target) { max_pool_2x2_backward_step(target, dy, x, planes, H, W, OH, OW, dx); });
}

// Whether max_pool and max_pool_backward take s: column stride 1 or 2, a window's padded rows
// the buffer holds (with the widest set's vectors) and taps T holds exactly.
template <class T>
bool max_pool_takes(const PoolShape& s) {
  constexpr index_t widest = 64 / sizeof(T);
  const index_t row = s.SW * ((s.OW + widest - 1) / widest) * widest + s.KW;
  return (s.SW == 1 || s.SW == 2) && s.KH * row <= max_pool_buffer && s.pad_left < row &&
         s.KH * s.W + row <= (index_t{1} << std::numeric_limits<T>::digits);
}

// Max pooling where max_pool_takes(s): each window's maximum, a NaN if it holds one.
template <class T>
void max_pool(const T* x, const PoolShape& s, T* y) {
  detail::with_target(active_isa(), [&](auto target) { max_pool_step(target, x, s, y); });
}

// dx of max pooling where max_pool_takes(s): each dy to its window's first maximal element
// (the first NaN, if any), summed in output order where windows share one.
template <class T>
void max_pool_backward(const T* dy, const T* x, const PoolShape& s, T* dx) {
  detail::with_target(active_isa(), [&](auto target) { max_pool_backward_step(target, dy, x, s, dx); });
}

}  // namespace duet::kernels
