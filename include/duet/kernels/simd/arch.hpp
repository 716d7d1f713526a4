// The one place where the instruction sets differ: per set, the vector width, the tile height
// and the few operations GCC's vector extensions do not spell (FMA, masked memory access, the
// group broadcast, the square root, a vector kept in a register). Everything else in a kernel
// is written once, on Vec<T>, and compiled once per set, in the set's namespace
// (detail::baseline, detail::avx2, detail::avx512) and between its DUET_BEGIN_... and
// DUET_END_ISA (as kernels/gemm.hpp does with detail/gemm_impl.hpp); so are exp and the
// reductions (detail/math.hpp).
//
// Each set's code is compiled for its target whatever -march the program has, by a target
// region: GCC's `#pragma GCC target`, clang's `#pragma clang attribute push(target)`. Templates
// defined in a region keep its target when instantiated. Code outside the regions (the
// dispatch, the public functions) never handles a vector wider than the baseline's, so no
// vector crosses a call between functions of different targets (-Wpsabi).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DUET_X86_KERNELS 1
#else
#define DUET_X86_KERNELS 0
#endif

// The baseline's region sets no target, only what every region has: under GCC, a program
// built without optimisation (-O0, CMake's Debug) still gets its kernels at -O2, by the
// optimize pragma. At -O0 every vector operation went through memory and the seed network
// trained 50 times slower (an epoch 85 s instead of 1.7), which makes a Debug build useless
// for debugging a training run; the kernels are not what such a user steps through. clang has
// no pragma that raises the level: its -O0 builds keep slow kernels.
//
// Every region also computes arithmetic exactly as written: no a·b + c contracted into an FMA,
// which both compilers do wherever the target has one (g++ by default in C++, even under
// -std=c++20; clang within an expression). The kernels call FMA where they mean it, and the
// build's flags then do not change their code: a program built by the README's g++ command and
// the same program built with CMake (whose duet::duet passes -ffp-contract=off), or against
// duet::kernels compiled by it, differed in the last bits (136 of 192 logits, up to 1.2e-7);
// and the optimisers' updates give the bits of their scalar formula (kernels/optim.hpp).
#if defined(__clang__)
#define DUET_BEGIN_BASELINE _Pragma("float_control(push)") _Pragma("clang fp contract(off)")
#define DUET_END_BASELINE _Pragma("float_control(pop)")
#define DUET_BEGIN_AVX2 \
  DUET_BEGIN_BASELINE _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
// A _Pragma takes one string literal, which clang-format must not split.
// clang-format off
#define DUET_BEGIN_AVX512 \
  DUET_BEGIN_BASELINE \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512dq,avx512bw,avx512vl,avx2,fma\"))), apply_to = function)")
// clang-format on
#define DUET_END_ISA _Pragma("clang attribute pop") DUET_END_BASELINE
#else
#ifdef __OPTIMIZE__
#define DUET_DETAIL_OPTIMIZE_KERNELS
#else
#define DUET_DETAIL_OPTIMIZE_KERNELS _Pragma("GCC optimize(\"O2\")")
#endif
#define DUET_BEGIN_BASELINE \
  _Pragma("GCC push_options") DUET_DETAIL_OPTIMIZE_KERNELS _Pragma("GCC optimize(\"fp-contract=off\")")
#define DUET_END_BASELINE _Pragma("GCC pop_options")
#define DUET_BEGIN_AVX2 DUET_BEGIN_BASELINE _Pragma("GCC target(\"avx2,fma\")")
#define DUET_BEGIN_AVX512 DUET_BEGIN_BASELINE _Pragma("GCC target(\"avx512f,avx512dq,avx512bw,avx512vl,avx2,fma\")")
#define DUET_END_ISA _Pragma("GCC pop_options")
#endif

// Loops written for the compiler to vectorise (pooling's rows of strided taps): GCC 12's -O2
// weighs vectorisation by its "very cheap" cost model, which refuses a loop that needs
// permutes or a remainder, so at -O2 they ran scalar (max pooling 3x3/2 four times slower than
// at -O3); clang's -O2 vectorises them as they are.
#if defined(__clang__)
#define DUET_BEGIN_VECTORIZED
#define DUET_END_VECTORIZED
#else
#define DUET_BEGIN_VECTORIZED \
  _Pragma("GCC push_options") _Pragma("GCC optimize(\"tree-vectorize\", \"vect-cost-model=dynamic\")")
#define DUET_END_VECTORIZED _Pragma("GCC pop_options")
#endif

// for (int j = 0; j < N; ++j), unrolled: a step of detail/math.hpp's functions on each of their
// N vectors.
#define DUET_EACH_VECTOR(j) _Pragma("GCC unroll 8") for (int j = 0; j < N; ++j)

namespace duet::kernels::detail {

template <class T, int Bytes>
struct VectorOf {
  typedef T type __attribute__((vector_size(Bytes)));
};

// One SIMD register of Bytes bytes of T, as a GCC vector: arithmetic, comparisons and the
// functions' apply() work on it directly.
template <class T, int Bytes>
using Vector = typename VectorOf<T, Bytes>::type;

// Subnormal inputs and results treated as zero (x86's MXCSR FTZ and DAZ) on this thread while
// it lives; the caller's setting is restored after. On x86 an operation that reads or makes a
// subnormal costs a microcode assist of a hundred cycles or more, and an optimiser's state makes
// them for good: where a gradient stays 0, m shrinks by β1 each step until rounding holds it at a
// few times the smallest subnormal (0.9·k·2^-149 rounds back to k·2^-149 for k < 5; v likewise
// for k < 500). TensorFlow flushes them in all its CPU threads for the same reason.
class FlushSubnormals {
 public:
#if DUET_X86_KERNELS
  FlushSubnormals() noexcept : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
#else
  FlushSubnormals() noexcept = default;
#endif
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

#if DUET_X86_KERNELS
 private:
  unsigned saved_;
#endif
};

}  // namespace duet::kernels::detail

// ---- Baseline: 16-byte vectors in plain C++, which the compiler maps onto SSE2 (or NEON) ----

DUET_BEGIN_BASELINE
namespace duet::kernels::detail::baseline {

inline constexpr int vector_bytes = 16;
// p · 2^k in one instruction (scale_by_power_of_2): AVX-512's alone.
inline constexpr bool scales_in_one_step = false;
// The products' tile (gemm_impl.hpp): MR x NV accumulators, NV vectors of B, a broadcast and a
// product (no FMA) in 16 registers (4 x 2 and 2 x 4 were slower).
inline constexpr int MR = 3;
inline constexpr int NV = 3;
// The narrow layers' tile (gemm_impl.hpp): dot_rows rows of A by dot_cols rows of B, a vector of
// each, with a product beside the accumulators.
inline constexpr int dot_rows = 2;
inline constexpr int dot_cols = 5;
#include "detail/vector.hpp"

// The first n lanes from p (0 < n <= lanes), zero in the others; never touches p[n] and on.
template <class T>
[[gnu::always_inline]] inline Vec<T> load_first(const T* p, int n) {
  Vec<T> v{};
  std::memcpy(&v, p, static_cast<std::size_t>(n) * sizeof(T));
  return v;
}

template <class T>
[[gnu::always_inline]] inline void store_first(T* p, Vec<T> v, int n) {
  std::memcpy(p, &v, static_cast<std::size_t>(n) * sizeof(T));
}

// a·b + c. Not fused here (the baseline has no FMA): two roundings.
template <class T>
[[gnu::always_inline]] inline Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
  return a * b + c;
}

// *p in every lane.
template <class T>
[[gnu::always_inline]] inline Vec<T> broadcast(const T* p) {
  Vec<T> v{};
  for (int i = 0; i < lanes<T>; ++i) v[i] = *p;
  return v;
}

// v kept in a register for its next uses (the wider sets' keep_in_register): without FMA,
// nothing to fold a load into.
template <class T>
[[gnu::always_inline]] inline void keep_in_register(Vec<T>&) {}

// Correctly rounded, as std::sqrt, without its call into libm for errno.
template <class T>
[[gnu::always_inline]] inline Vec<T> sqrt(Vec<T> v) {
#if DUET_X86_KERNELS
  if constexpr (std::is_same_v<T, float>) return _mm_sqrt_ps(v);
  else return _mm_sqrt_pd(v);
#else
  for (int i = 0; i < lanes<T>; ++i) v[i] = __builtin_sqrt(v[i]);
  return v;
#endif
}

#include "detail/math.hpp"

}  // namespace duet::kernels::detail::baseline
DUET_END_BASELINE

#if DUET_X86_KERNELS

// ---- AVX2 + FMA: 32-byte vectors ------------------------------------------------------------

DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {

inline constexpr int vector_bytes = 32;
inline constexpr bool scales_in_one_step = false;
// 16 registers: 6 x 2 accumulators, 2 vectors of B and a broadcast.
inline constexpr int MR = 6;
inline constexpr int NV = 2;
// 2 x 5 accumulators, 2 vectors of A and one of B.
inline constexpr int dot_rows = 2;
inline constexpr int dot_cols = 5;
#include "detail/vector.hpp"

// All ones in the lanes below n, as AVX2's masked loads and stores want.
template <class T>
__m256i lane_mask(int n) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  } else {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
  }
}

template <class T>
[[gnu::always_inline]] inline Vec<T> load_first(const T* p, int n) {
  if constexpr (std::is_same_v<T, float>) return _mm256_maskload_ps(p, lane_mask<T>(n));
  else return _mm256_maskload_pd(p, lane_mask<T>(n));
}

template <class T>
[[gnu::always_inline]] inline void store_first(T* p, Vec<T> v, int n) {
  if constexpr (std::is_same_v<T, float>) _mm256_maskstore_ps(p, lane_mask<T>(n), v);
  else _mm256_maskstore_pd(p, lane_mask<T>(n), v);
}

// a·b + c with one rounding. Spelled out because -std=c++20 (unlike gnu++20) stops GCC from
// contracting a * b + c, which would halve the throughput of the micro-kernel.
template <class T>
[[gnu::always_inline]] inline Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
  if constexpr (std::is_same_v<T, float>) return _mm256_fmadd_ps(a, b, c);
  else return _mm256_fmadd_pd(a, b, c);
}

// From memory in one instruction that uses no vector port: `Vec<T>{} + *p` loaded the value
// into a register and broadcast it from there, a shuffle beside every few FMAs.
template <class T>
[[gnu::always_inline]] inline Vec<T> broadcast(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_broadcast_ss(p);
  else return _mm256_broadcast_sd(p);
}

// v kept in a register for its next uses: a vector of B that several FMAs of a tile take,
// GCC 12 otherwise folds its load into each of them as a memory operand (the narrow tile's 15
// FMAs, gemm_impl.hpp, then took 18 loads, and ran 20 % slower on AVX-512, bound by them). An
// empty asm statement that may change v, so the compiler cannot go back to memory for it.
template <class T>
[[gnu::always_inline]] inline void keep_in_register(Vec<T>& v) {
  __asm__("" : "+x"(v));
}

template <class T>
[[gnu::always_inline]] inline Vec<T> sqrt(Vec<T> v) {
  if constexpr (std::is_same_v<T, float>) return _mm256_sqrt_ps(v);
  else return _mm256_sqrt_pd(v);
}

#include "detail/math.hpp"

}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

// ---- AVX-512 (F, DQ, BW, VL): 64-byte vectors ---------------------------------------------

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {

inline constexpr int vector_bytes = 64;
inline constexpr bool scales_in_one_step = true;
// 32 registers: 6 x 4 accumulators, 4 vectors of B and a broadcast.
inline constexpr int MR = 6;
inline constexpr int NV = 4;
// 3 x 5 accumulators (and a zero: 16, what one sum of lanes folds), 3 vectors of A, one of B.
inline constexpr int dot_rows = 3;
inline constexpr int dot_cols = 5;
#include "detail/vector.hpp"

template <class T>
[[gnu::always_inline]] inline Vec<T> load_first(const T* p, int n) {
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(mask, p);
  else return _mm512_maskz_loadu_pd(static_cast<__mmask8>(mask), p);
}

template <class T>
[[gnu::always_inline]] inline void store_first(T* p, Vec<T> v, int n) {
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p, mask, v);
  else _mm512_mask_storeu_pd(p, static_cast<__mmask8>(mask), v);
}

template <class T>
[[gnu::always_inline]] inline Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
  if constexpr (std::is_same_v<T, float>) return _mm512_fmadd_ps(a, b, c);
  else return _mm512_fmadd_pd(a, b, c);
}

// From memory in one instruction, as AVX2's.
template <class T>
[[gnu::always_inline]] inline Vec<T> broadcast(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_set1_ps(*p);
  else return _mm512_set1_pd(*p);
}

// As AVX2's; "v" takes any of the 32 registers.
template <class T>
[[gnu::always_inline]] inline void keep_in_register(Vec<T>& v) {
  __asm__("" : "+v"(v));
}

// The zero-masking form, with every lane selected: the plain one starts from
// _mm512_undefined_ps, which GCC 12 reports as uninitialised (PR105593).
template <class T>
[[gnu::always_inline]] inline Vec<T> sqrt(Vec<T> v) {
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_sqrt_ps(0xFFFF, v);
  else return _mm512_maskz_sqrt_pd(0xFF, v);
}

// p · 2^k for whole numbers k, rounded once, overflowing to inf and underflowing through the
// subnormals to 0 (VSCALEFPS): exp's last step (detail/math.hpp), which the other sets build
// from two halves of 2^k in ten instructions, with the same result.
template <class T>
[[gnu::always_inline]] inline Vec<T> scale_by_power_of_2(Vec<T> p, Vec<T> k) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_maskz_scalef_ps(0xFFFF, p, k);
  else
    return _mm512_maskz_scalef_pd(0xFF, p, k);
}

#include "detail/math.hpp"

}  // namespace duet::kernels::detail::avx512
DUET_END_ISA

#else

// Elsewhere only the baseline is built; the dispatch never selects the other names.
namespace duet::kernels::detail {
namespace avx2 = baseline;
namespace avx512 = baseline;
}  // namespace duet::kernels::detail

#endif
