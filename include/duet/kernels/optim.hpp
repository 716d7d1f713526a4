// Optimiser updates (nn::Adam, nn::AdamW, nn::SGD), one pass over each parameter.
//
// An update reads the parameter, its gradient and the optimiser's state and writes parameter
// and state back: 28 bytes per float for Adam, for a few operations, one of them a square root
// and one a division. It runs near memory speed only if those two are vector instructions
// (benchmarks/optim.cpp compares it with a streaming pass over the same bytes); a scalar loop
// is bound by std::sqrt and the division instead. Even as vectors they share one unit and
// bound Adam on data in L2, so Adam's rule is written with one of each (AdamCoefficients).
//
// Written once (detail/optim_impl.hpp) on the vectors of each instruction set, compiled per set
// below and chosen at run time like the matrix product (simd/isa.hpp, duet::kernel_isa()). The
// tail is one masked vector through the same code, not a scalar loop. Every set computes each
// element with the operations of the scalar formula in its order, unfused (every kernel region is: simd/arch.hpp),
// and IEEE's +, -, ·, / and sqrt are correctly rounded: every set gives the bits of that
// formula evaluated in T, on any CPU and for any tail (tests/kernels_optim.cpp), except that
// on x86 subnormal inputs and results count as zero (detail::FlushSubnormals says why):
// the moments of weights whose gradients stay zero sink to subnormals and stay there, and
// flushing them took Adam from 25 % to 15 % of a Fashion-MNIST epoch of the seed network. Large
// parameters are cut into ranges for several threads (threads.hpp); elementwise, that changes
// no bit.
#pragma once

#include "../config.hpp"
#include "../threads.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"

namespace duet::kernels {

// Adam's scalars for one step, in T: m = β1·m + (1 - β1)·g', v = β2·v + (1 - β2)·g'·g' with
// g' = g + l2·p, then p = p·decay - step·m / (sqrt(v) + eps). With c1 = 1 - β1^t and
// c2 = 1 - β2^t, PyTorch's lr·(m / c1) / (sqrt(v) / sqrt(c2) + ε) is this with
// step = lr·sqrt(c2) / c1 and eps = ε·sqrt(c2), both computed once in double: one division
// per element instead of two, as accurate (four roundings in T either way, each within half
// an ulp), though not the same bits.
template <class T>
struct AdamCoefficients {
  T beta1;
  T beta2;
  T eps;    // ε·sqrt(1 - β2^t)
  T l2;     // L2 weight decay (Adam), added to the gradient
  T decay;  // 1 - lr·weight_decay (AdamW's decoupled decay), else 1
  T step;   // lr·sqrt(1 - β2^t) / (1 - β1^t)
};

// SGD's scalars for one step: d = g + weight_decay·p; without momentum p -= lr·d; with it
// buf = d on the first step and momentum·buf + keep·d after, and p -= lr·buf (or, Nesterov,
// lr·(d + momentum·buf)).
template <class T>
struct SgdCoefficients {
  T learning_rate;
  T weight_decay;
  T momentum;
  T keep;  // 1 - dampening
  bool with_momentum;
  bool nesterov;
  bool first_step;
};

}  // namespace duet::kernels

#define DUET_KERNEL_BODY "optim_impl.hpp"
#include "detail/per_isa.hpp"

namespace duet::kernels {

// One Adam step on n values: p, m and v updated in place from g. No alignment is assumed.
template <class T>
void adam_update(T* p, const T* g, T* m, T* v, index_t n, const AdamCoefficients<T>& c) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, 4, [&](index_t i0, index_t i1) {
    const detail::FlushSubnormals flush;
    detail::with_target(isa, [&](auto target) { adam_step(target, p + i0, g + i0, m + i0, v + i0, i1 - i0, c); });
  });
}

// One SGD step on n values; momentum is read and written only with_momentum.
template <class T>
void sgd_update(T* p, const T* g, T* momentum, index_t n, const SgdCoefficients<T>& c) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, 2, [&](index_t i0, index_t i1) {
    const detail::FlushSubnormals flush;
    detail::with_target(isa, [&](auto target) {
      sgd_step(target, p + i0, g + i0, c.with_momentum ? momentum + i0 : momentum, i1 - i0, c);
    });
  });
}

}  // namespace duet::kernels
