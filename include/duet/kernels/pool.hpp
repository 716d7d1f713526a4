// Pooling's kernels, once per instruction set. Max pooling, forward and gradient: over 2x2
// windows at stride 2 that tile the input (LeNet-5's and most CNNs' pooling), a vector of L
// outputs reads 2L values of each of the window's two rows and splits them into left and right
// taps by shuffles; over any other window at column stride 1 or 2 (ResNet's 3x3/2 pad 1, 3x3/1
// pad 1), L windows at a time from a padded copy of their rows. Average pooling: the forward
// likewise from a padded copy, the gradient at any stride as a gather, L input columns at a
// time (detail/pool_impl.hpp says how). ops/pool.hpp's general loops rely on the compiler to
// vectorise strided taps, which g++ 12 does at -O3 with -march=native and not at -O2 or for the
// baseline alone; here every build gets the set the machine has (simd/isa.hpp). The rules are
// ops/pool.hpp's, to the bit. Max pooling: the taps in row-major order, a NaN winning the value
// (MaxPoolKind::combine) and the first NaN, or else the first maximal tap, taking the gradient
// (takes_max), dx = 0 + dy there, the dy of windows that choose the same element added in
// output order, and zero elsewhere, including the rows and columns no window covers. Average
// pooling: the same additions in the same order as its loops (avg_pool2d_backward).
#pragma once

#include <algorithm>
#include <limits>
#include <utility>

#include "../shape.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"
#include "simd/isa.hpp"

namespace duet::kernels {

// A pooling's input planes [H, W], output planes [OH, OW] and window: kernel KH x KW, stride
// SH x SW, padding pad_top and pad_left before the first row and column (no window all
// padding).
struct PoolShape {
  index_t planes, H, W, OH, OW, KH, KW, SH, SW, pad_top, pad_left;
};

// The output columns [begin, end) whose windows lie inside the input's columns (none of the
// padding): the others are the border's, before begin and from end on.
struct InnerColumns {
  index_t begin, end;
};

constexpr InnerColumns inner_columns(index_t W, index_t OW, index_t KW, index_t SW, index_t pad_left) {
  const index_t begin = std::min(OW, (pad_left + SW - 1) / SW);
  const index_t last_start = W + pad_left - KW;  // of a window ending at the last column
  return {begin, std::max(begin, last_start < 0 ? index_t{0} : std::min(OW, last_start / SW + 1))};
}

// The elements of the pooling kernels' buffers on the stack: a window's rows of the input,
// padded, and an output row (max pooling); the shares of dy for a window's height of output
// rows, spread over input columns (the average's gradient).
inline constexpr index_t pool_buffer = 4096;

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

// Whether max_pool, max_pool_backward and avg_pool take s: column stride 1 or 2, a window's
// padded rows the buffer holds (with the widest set's vectors) and taps T holds exactly.
template <class T>
bool pool_rows_take(const PoolShape& s) {
  constexpr index_t widest = 64 / sizeof(T);
  const index_t row = s.SW * ((s.OW + widest - 1) / widest) * widest + s.KW;
  return (s.SW == 1 || s.SW == 2) && s.KH * row <= pool_buffer && s.pad_left < row &&
         s.KH * s.W + row <= (index_t{1} << std::numeric_limits<T>::digits);
}

// Max pooling where pool_rows_take(s): each window's maximum, a NaN if it holds one.
template <class T>
void max_pool(const T* x, const PoolShape& s, T* y) {
  detail::with_target(active_isa(), [&](auto target) { max_pool_step(target, x, s, y); });
}

// dx of max pooling where pool_rows_take(s): each dy to its window's first maximal element
// (the first NaN, if any), summed in output order where windows share one.
template <class T>
void max_pool_backward(const T* dy, const T* x, const PoolShape& s, T* dx) {
  detail::with_target(active_isa(), [&](auto target) { max_pool_backward_step(target, dy, x, s, dx); });
}

// Average pooling where pool_rows_take(s): each window's sum from its first element inside the
// input in row-major order, divided by the window's size if count_padding, else by its
// elements inside the input (ops/pool.hpp's pool2d_forward, to the bit).
template <class T>
void avg_pool(const T* x, const PoolShape& s, bool count_padding, T* y) {
  detail::with_target(active_isa(), [&](auto target) { avg_pool_step(target, x, s, count_padding, y); });
}

// Whether avg_pool_backward takes s, at any stride: the buffer holds a window's height and one
// of output rows' shares, spread over the input's columns padded (with the widest set's
// vectors). The columns and divisors a T then holds are below pool_buffer, exact.
template <class T>
bool avg_pool_backward_takes(const PoolShape& s) {
  constexpr index_t widest = 64 / sizeof(T);
  const index_t shares = (s.OW + widest - 1) / widest * widest;
  const index_t spread = ((s.W + widest - 1) / widest * widest + s.pad_left + s.KW - 1 + widest - 1) / widest * widest;
  return (s.KH + 2) * shares + (s.KH + 1) * spread <= pool_buffer;
}

// dx of average pooling where avg_pool_backward_takes(s): dy / count added over each window,
// count the window's size if count_padding, else its elements inside the input; each element
// summed from +0 in ops/pool.hpp's order (avg_pool2d_backward), to the bit.
template <class T>
void avg_pool_backward(const T* dy, const PoolShape& s, bool count_padding, T* dx) {
  detail::with_target(active_isa(), [&](auto target) { avg_pool_backward_step(target, dy, s, count_padding, dx); });
}

}  // namespace duet::kernels
