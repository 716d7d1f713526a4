// Max pooling's kernels over 2x2 windows at stride 2 that tile the input (LeNet-5's and most
// CNNs' pooling), once per instruction set: a vector of L outputs reads 2L values of each of
// the window's two rows and splits them into left and right taps by shuffles. ops/pool.hpp's
// general loops rely on the compiler to vectorise a strided compare-and-select, which g++ 12
// does at -O3 with -march=native and not at -O2 or for the baseline alone; here every build
// gets the set the machine has (simd/isa.hpp). The rules are ops/pool.hpp's, to the bit: the
// taps in row-major order, a NaN winning the value (MaxPoolKind::combine) and the first NaN, or
// else the first maximal tap, taking the gradient (takes_max), dx = 0 + dy there and zero
// elsewhere, including the rows and columns no window covers.
#pragma once

#include <algorithm>
#include <utility>

#include "../shape.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"
#include "simd/isa.hpp"

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

}  // namespace duet::kernels
