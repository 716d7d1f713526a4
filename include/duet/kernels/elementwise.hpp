// Elementwise kernels and the row reductions of softmax cross-entropy: exp, log-sum-exp, the
// softmax gradient of a row, sums, a scaled copy, and a map of vector functions (fn::Relu).
//
// Written once (detail/elementwise_impl.hpp) on the vectors of each instruction set, compiled
// per set below and chosen at run time (simd/isa.hpp, duet::kernel_isa()); a row's tail is one
// masked vector through the same code. exp is simd/detail/math.hpp's, within 2 ulp of std::exp,
// so no element calls libm; a row's logarithm is one std::log. Sums run lane by lane and then
// fold in a fixed tree, so they are not the scalar left-to-right sums, and a set with wider
// vectors (or FMA) can differ from another in the last bits of a loss or a gradient; under one
// set every call gives the same bits, which is what makes graph and PyNative mode agree.
// map() applies Fns::apply_in_place, the code a product's fused epilogue runs, so a map and an
// epilogue give the same bits. Large maps, scalings and column sums share the threads
// (threads.hpp), in ranges of whole elements or columns.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../config.hpp"
#include "gemm.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"

namespace duet::kernels {
// The functions activation() applies: elementwise layers' formulas on simd/detail/math.hpp's
// exp, tanh, sigmoid, erf and normal distribution, and the derivatives of those differentiated
// from their input. GELU is x Φ(x), exactly or with Φ(x) ≈ σ(2 √(2/π) (x + 0.044715 x³)), which
// is 0.5 (1 + tanh(√(2/π) (x + 0.044715 x³))); SiLU is x σ(x).
enum class Activation {
  exp,
  sigmoid,
  tanh,
  silu,
  silu_derivative,
  gelu,
  gelu_derivative,
  gelu_tanh,
  gelu_tanh_derivative,
  erf,
  erf_derivative
};

// ln of the smallest normal number: e^x below it is subnormal, which Activation::exp and
// fn::exp_array count as zero (a masked logit of -1e9 gets exactly no weight).
template <class T>
inline constexpr T lowest_normal_exponent = std::is_same_v<T, float> ? T(-87.33654475f) : T(-708.39641853226408);
}  // namespace duet::kernels

#define DUET_KERNEL_BODY "elementwise_impl.hpp"
#include "detail/per_isa.hpp"

namespace duet::kernels {

template <class T>
concept VectorElement = std::is_same_v<T, float> || std::is_same_v<T, double>;

// y[i] = e^x[i]; y may be x.
template <VectorElement T>
void exp(const T* x, index_t n, T* y) {
  detail::with_target(active_isa(), [&](auto target) { exp_step(target, x, n, y); });
}

// v = F(v) on one value or one vector of any set's width, on the set chosen at run time or the
// one the vector's width names, with the bits of every lane alike: the vector form of the
// activation layers (fn::Sigmoid::apply_in_place), which map() runs on a chain of functions
// (one alone it runs eight vectors at a time, activation_map_step, with the same bits). No
// call into libm: PyNative's sigmoid and GELU were Eigen's forms,
// vectorised only for the build's instruction set (without -march, sigmoid took 77 us and GELU
// 123 us on [256, 512] against 16 and 20 with -march=native).
template <Activation F, class V>
void activation(V& v) {
  if constexpr (VectorElement<V>) {
    v = detail::with_target(active_isa(), [&](auto target) { return activation_value<F, V>(target, v); });
  } else {
    using T = std::remove_cvref_t<decltype(v[0])>;
    V group[1] = {v};
    activation_step<F, 1, T>(typename detail::TargetOfWidth<sizeof(V)>::type{}, group);
    v = group[0];
  }
}

// Σ x[i].
template <VectorElement T>
T sum(const T* x, index_t n) {
  return detail::with_target(active_isa(), [&](auto target) { return sum_step(target, x, n); });
}

// log Σ e^x[i], after subtracting the maximum, so that 1e4 neither overflows nor is lost.
template <VectorElement T>
T log_sum_exp(const T* x, index_t n) {
  return detail::with_target(active_isa(), [&](auto target) { return log_sum_exp_step(target, x, n); });
}

// Σ p[i] (lse - z[i]): the cross-entropy of a row of logits z against a distribution p.
template <VectorElement T>
T cross_entropy(const T* z, const T* p, index_t n, T lse) {
  return detail::with_target(active_isa(), [&](auto target) { return cross_entropy_step(target, z, p, n, lse); });
}

// d[i] = (e^(z[i] - lse) - [i == label]) · scale: the gradient of a row's sparse softmax
// cross-entropy, times the gradient flowing in.
template <VectorElement T>
void softmax_grad(const T* z, index_t n, T lse, index_t label, T scale, T* d) {
  detail::with_target(active_isa(), [&](auto target) { softmax_grad_step(target, z, n, lse, label, scale, d); });
}

// d[i] = (e^(z[i] - lse) · mass - p[i]) · scale, mass = Σ p: the same against a distribution.
template <VectorElement T>
void softmax_grad(const T* z, const T* p, index_t n, T lse, T mass, T scale, T* d) {
  detail::with_target(active_isa(), [&](auto target) { softmax_grad_step(target, z, p, n, lse, mass, scale, d); });
}

// Each element, or each column of a sum, is computed by the same code whatever thread takes it
// (threads.hpp's pass_work says when a pass is shared): no bit depends on the thread count.

// sums[j] (+)= Σ_r x[r, j], x row-major [rows, cols] with rows >= 1: a layer's bias gradient,
// each column summed in the one order column_sums_step gives, whatever the set and the build,
// in halves (detail/halves.hpp), so that a batch's sums are its halves' sums.
// Threads take strips of whole columns.
template <VectorElement T>
void column_sums(const T* x, index_t rows, index_t cols, T* sums, bool accumulate) {
  constexpr index_t strip = 64;  // columns: whole vectors of every set
  const index_t strips = (cols + strip - 1) / strip;
  const Isa isa = active_isa();
  ::duet::detail::parallel_blocks(strips, ::duet::detail::useful_threads(rows * cols * ::duet::detail::pass_work, strips),
                                  [&](index_t s0, index_t s1, int) {
                                    const index_t j0 = s0 * strip;
                                    const index_t j1 = std::min(cols, s1 * strip);
                                    detail::with_target(isa, [&](auto target) {
                                      column_sums_step(target, x + j0, rows, j1 - j0, cols, sums + j0, accumulate);
                                    });
                                  });
}

// y[r, j] = x[r, j] + bias[j], x and y row-major [rows, cols]; y may be x. PyNative's BiasAdd,
// which Eigen's rowwise sum ran element by element in a build at -O2 (a tenth of the seed
// network's forward at batch 256). Threads take whole rows.
template <VectorElement T>
void add_bias(const T* x, index_t rows, index_t cols, const T* bias, T* y) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_blocks(rows, ::duet::detail::useful_threads(rows * cols * ::duet::detail::pass_work, rows),
                                  [&](index_t r0, index_t r1, int) {
                                    detail::with_target(isa, [&](auto target) {
                                      add_bias_step(target, x + r0 * cols, r1 - r0, cols, bias, y + r0 * cols);
                                    });
                                  });
}

// y[i] = a·x[i]; y may be x.
template <VectorElement T>
void scale(const T* x, index_t n, T a, T* y) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, ::duet::detail::pass_work, [&](index_t i0, index_t i1) {
    detail::with_target(isa, [&](auto target) { scale_step(target, x + i0, i1 - i0, a, y + i0); });
  });
}

// y[i] = Fns(x[i]), the functions applied in order; y may be x.
template <class... Fns, class T>
  requires gemm_supports<T, Fns...>
void map(const T* x, index_t n, T* y) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, ::duet::detail::pass_work, [&](index_t i0, index_t i1) {
    detail::with_target(isa, [&](auto target) { map_step<T, Fns...>(target, x + i0, i1 - i0, y + i0); });
  });
}

// activation<F> as a function for map(). fn::Sigmoid and the other layers activation() computes
// derive from it; products map their output with them (backend::Native::in_registers).
template <Activation F>
struct ActivationFunction {
  static constexpr Activation kernel_activation = F;
  template <class V>
  static void apply_in_place(V& v) {
    activation<F>(v);
  }
};

// y[i] = tanh x[i] and y[i] = 1 / (1 + e^-x[i]); y may be x. A recurrent cell's gates, a row at
// a time.
template <VectorElement T>
void tanh(const T* x, index_t n, T* y) {
  map<ActivationFunction<Activation::tanh>>(x, n, y);
}
template <VectorElement T>
void sigmoid(const T* x, index_t n, T* y) {
  map<ActivationFunction<Activation::sigmoid>>(x, n, y);
}

// A binary function the kernels can apply in registers: Fn::apply_in_place(a, b) on a scalar and
// on a SIMD vector of the same element type (fn::Add, fn::Mul, fn::Maximum, ...), lane by lane
// with the scalar's bits.
template <class Fn, class T>
concept VectorBinary = VectorElement<T> && requires(T& s, detail::Vector<T, 16>& v16, detail::Vector<T, 32>& v32,
                                                     detail::Vector<T, 64>& v64) {
  Fn::apply_in_place(s, s);
  Fn::apply_in_place(v16, v16);
  Fn::apply_in_place(v32, v32);
  Fn::apply_in_place(v64, v64);
};

// out[i] = Fn(a[i], b[i]) for i < n (n >= 1), where an input that does not run (a_runs or b_runs
// false) is its first element at every i: a broadcast row, or a scalar. out may be a or b.
// Without it, a binary operation's loop was vectorised only where the compiler chose to, for
// the build's instruction set: at -O2 not at all, and the fused gelu(x * w + b) took twice -O3's
// time.
template <class Fn, class T>
  requires VectorBinary<Fn, T>
void binary(const T* a, bool a_runs, const T* b, bool b_runs, index_t n, T* out) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, ::duet::detail::pass_work, [&](index_t i0, index_t i1) {
    const T* x = a_runs ? a + i0 : a;
    const T* y = b_runs ? b + i0 : b;
    detail::with_target(isa, [&](auto target) {
      if (a_runs && b_runs) binary_step<T, Fn, true, true>(target, x, y, i1 - i0, out + i0);
      else if (a_runs) binary_step<T, Fn, true, false>(target, x, y, i1 - i0, out + i0);
      else if (b_runs) binary_step<T, Fn, false, true>(target, x, y, i1 - i0, out + i0);
      else binary_step<T, Fn, false, false>(target, x, y, i1 - i0, out + i0);
    });
  });
}

// A function whose gradient, from its output, the kernels can take in registers:
// Fn::grad_in_place(dy, y) on a scalar and on a SIMD vector of the same element type.
template <class Fn, class T>
concept VectorGradient = VectorElement<T> && requires(T& s, detail::Vector<T, 16>& v16, detail::Vector<T, 32>& v32,
                                                       detail::Vector<T, 64>& v64) {
  Fn::grad_in_place(s, s);
  Fn::grad_in_place(v16, v16);
  Fn::grad_in_place(v32, v32);
  Fn::grad_in_place(v64, v64);
};

// dx[i] = dy[i] · Fn'(x[i]), from y = Fn(x); dx may be dy.
template <class Fn, class T>
  requires VectorGradient<Fn, T>
void map_grad(const T* dy, const T* y, index_t n, T* dx) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, ::duet::detail::pass_work, [&](index_t i0, index_t i1) {
    detail::with_target(isa, [&](auto target) { map_grad_step<T, Fn>(target, dy + i0, y + i0, i1 - i0, dx + i0); });
  });
}

}  // namespace duet::kernels
