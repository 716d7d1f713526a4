// The dense-layer product with its epilogue fused: C[m, n] = Fns(Σ_k A[m, k]·B[n, k] + bias[n]).
//
// A is the input [M, K] and B the weight [N, K], both row-major, so each output is a dot
// product of two contiguous rows. Three paths, chosen by shape:
//  - small static layers (K·N <= 64, as Dense<4, 4>): plain loops the compiler unrolls
//    completely; packing, or a loop over vectors, would cost more than the arithmetic.
//  - one row (batch 1): a GEMV. Every weight is used once, so the time is the time to stream
//    B from memory; it reads B in place, front to back, and a shuffle tree sums L rows'
//    vectors into one vector of L results for the epilogue.
//  - otherwise: a GEMM in the style of BLIS, with a twist that makes packing cheap. The
//    micro-kernel works on groups of KG = 4 consecutive k: one vector of B holds KG values of
//    each of L/KG rows of B, and is multiplied by the same KG values of a row of A, broadcast
//    (one load). Packing B into that layout moves whole KG-blocks, half the shuffles of a
//    full transpose; A is read in place. A tile of MR rows x L columns of C lives in MR x KG
//    registers for a K block; a short shuffle tree then folds each row's KG vectors into one
//    vector of L sums, and after the last K block the epilogue runs on that vector before
//    the one store, so the output never takes a second pass.
// Every path adds the bias to the finished sum and then applies the functions, in the order
// separate BiasAdd and map kernels would: fused and unfused evaluation agree to the bit.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "../config.hpp"
#include "../error.hpp"
#include "../memory.hpp"

namespace duet::kernels {

namespace detail {

#if defined(__AVX512F__)
inline constexpr int vector_bytes = 64;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int vector_bytes = 32;
#else
inline constexpr int vector_bytes = 16;
#endif

template <class T>
struct VectorOf {
  typedef T type __attribute__((vector_size(vector_bytes)));
};

// One SIMD register of T, as a GCC vector: arithmetic, comparisons and the functions'
// apply() work on it directly; intrinsics are needed only for FMA and masked memory access.
template <class T>
using Vec = typename VectorOf<T>::type;

template <class T>
inline constexpr int lanes = vector_bytes / static_cast<int>(sizeof(T));

// The k-group: a vector of B holds KG consecutive k of L / KG rows. A tile row then takes KG
// vectors (L columns), which fold into exactly one vector of results.
template <class T>
inline constexpr int KG = std::min(4, lanes<T>);

// Tile rows: MR x KG accumulators, KG vectors of B and a broadcast fit the register file (32
// registers with AVX-512, 16 otherwise).
inline constexpr int MR = vector_bytes == 64 ? 6 : 3;

template <class T>
Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// All ones in the lanes below n, as AVX2's masked loads and stores want.
template <class T>
__m256i lane_mask(int n) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  } else {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
  }
}
#endif

// The first n lanes from p (0 < n <= lanes), zero in the others; never touches p[n] and on.
template <class T>
Vec<T> load_first(const T* p, int n) {
#if defined(__AVX512F__)
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(mask, p);
  else return _mm512_maskz_loadu_pd(static_cast<__mmask8>(mask), p);
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) return _mm256_maskload_ps(p, lane_mask<T>(n));
  else return _mm256_maskload_pd(p, lane_mask<T>(n));
#else
  Vec<T> v{};
  std::memcpy(&v, p, static_cast<std::size_t>(n) * sizeof(T));
  return v;
#endif
}

template <class T>
void store_first(T* p, Vec<T> v, int n) {
#if defined(__AVX512F__)
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p, mask, v);
  else _mm512_mask_storeu_pd(p, static_cast<__mmask8>(mask), v);
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) _mm256_maskstore_ps(p, lane_mask<T>(n), v);
  else _mm256_maskstore_pd(p, lane_mask<T>(n), v);
#else
  std::memcpy(p, &v, static_cast<std::size_t>(n) * sizeof(T));
#endif
}

// a·b + c with one rounding. Spelled out because -std=c++20 (unlike gnu++20) stops GCC from
// contracting a * b + c, which would halve the throughput of the micro-kernel.
template <class T>
Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) return _mm512_fmadd_ps(a, b, c);
  else return _mm512_fmadd_pd(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) return _mm256_fmadd_ps(a, b, c);
  else return _mm256_fmadd_pd(a, b, c);
#else
  return a * b + c;
#endif
}

// A[p .. p + KG) in every group of KG lanes.
template <class T>
Vec<T> broadcast_group(const T* p) {
#if defined(__AVX512F__)
  // The zero-masking forms, with every lane selected: the plain ones start from
  // _mm512_undefined_ps, which GCC 12 reports as uninitialised (PR105593).
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_broadcast_f32x4(0xFFFF, _mm_loadu_ps(p));
  else return _mm512_maskz_broadcast_f64x4(0xFF, _mm256_loadu_pd(p));
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
  else return load(p);
#else
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = p[i % KG<T>];
  return v;
#endif
}

template <class T, class... Fns>
T apply_all(T v) {
  ((v = Fns::apply(v)), ...);
  return v;
}

// ---- Shuffles, written once for every vector width ---------------------------------------

// The perfect shuffle on blocks of B lanes: blocks of a and b, alternately, from the low (or
// high) halves.
template <int B, class T, int... I>
Vec<T> interleave_low(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + I / (2 * B) * B + I % B)...);
}

template <int B, class T, int... I>
Vec<T> interleave_high(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + L / 2 + I / (2 * B) * B + I % B)...);
}

// Transposes Q x Q blocks of B lanes (Q = L / B): block g of r[i] goes to block i of r[g].
// This and the folds below take arrays of registers by pointer; always inlined, so that the
// arrays stay in registers instead of going through memory.
template <int B, class T>
[[gnu::always_inline]] inline void transpose_blocks(Vec<T>* r) {
  constexpr int Q = lanes<T> / B;
  constexpr auto all = std::make_integer_sequence<int, lanes<T>>{};
  for (int round = 1; round < Q; round *= 2) {
    Vec<T> t[Q];
    for (int i = 0; i < Q / 2; ++i) {
      t[2 * i] = interleave_low<B, T>(r[i], r[i + Q / 2], all);
      t[2 * i + 1] = interleave_high<B, T>(r[i], r[i + Q / 2], all);
    }
    std::copy(t, t + Q, r);
  }
}

// Lanes [0, L/2) of the result sum pairs of W-lane groups of a, lanes [L/2, L) those of b:
// one step of a reduction tree that keeps the partial sums of both vectors, in order.
template <int W, class T, int... I>
Vec<T> fold_pair(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int H = lanes<T> / 2;
  constexpr auto from = [](int r, int shift) { return (r < H ? 0 : 2 * H) + (r % H) / W * 2 * W + r % W + shift; };
  return __builtin_shufflevector(a, b, from(I, 0)...) + __builtin_shufflevector(a, b, from(I, W)...);
}

template <int W, class T>
[[gnu::always_inline]] inline void fold_level(Vec<T>* v, int count) {
  for (int i = 0; i < count; ++i) v[i] = fold_pair<W, T>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, lanes<T>>{});
  if constexpr (W > 1) fold_level<W / 2, T>(v, count / 2);
}

// Lane i of the result is the sum of the lanes of v[i]; v is clobbered.
template <class T>
Vec<T> sum_lanes(Vec<T> (&v)[lanes<T>]) {
  fold_level<lanes<T> / 2, T>(v, lanes<T> / 2);
  return v[0];
}

// ---- Small static layers -------------------------------------------------------------------

template <index_t K, index_t N, class T, class... Fns>
void dense_unrolled(const T* a, index_t m, const T* b, const T* bias, T* c) {
  for (index_t i = 0; i < m; ++i, a += K, c += N) {
    for (index_t j = 0; j < N; ++j) {
      // One chain per output, in k order: a balanced tree measured slower on chains of
      // Dense<4, 4> layers, where each layer waits on the last one's stores.
      T s = T(0);
      for (index_t k = 0; k < K; ++k) s += a[k] * b[j * K + k];
      if (bias != nullptr) s += bias[j];
      c[j] = apply_all<T, Fns...>(s);
    }
  }
}

// ---- One row ---------------------------------------------------------------------------------

template <class T, class... Fns>
void gemv(const T* a, index_t k, const T* b, index_t n, const T* bias, T* c) {
  constexpr int L = lanes<T>;
  const index_t k_pairs = k / (2 * L) * (2 * L);
  const index_t k_full = k / L * L;
  const int k_rest = static_cast<int>(k - k_full);
  for (index_t j0 = 0; j0 < n; j0 += L) {
    const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
    Vec<T> acc[L] = {};
    // Row after row, so that B is read front to back as one stream, which the hardware
    // prefetcher follows best (blocks of rows side by side were slower); two accumulators per
    // row, and the next rows' independent chains, keep the FMA latency hidden.
    for (int r = 0; r < cols; ++r) {
      const T* w = b + (j0 + r) * k;
      Vec<T> even{};
      Vec<T> odd{};
      index_t p = 0;
      for (; p < k_pairs; p += 2 * L) {
        even = fma<T>(load(w + p), load(a + p), even);
        odd = fma<T>(load(w + p + L), load(a + p + L), odd);
      }
      if (p < k_full) even = fma<T>(load(w + p), load(a + p), even);
      if (k_rest != 0) odd = fma<T>(load_first(w + k_full, k_rest), load_first(a + k_full, k_rest), odd);
      acc[r] = even + odd;
    }
    Vec<T> s = sum_lanes<T>(acc);
    if (bias != nullptr) s += load_first(bias + j0, cols);
    store_first<T>(c + j0, apply_all<Vec<T>, Fns...>(s), cols);
  }
}

// ---- Blocked GEMM ----------------------------------------------------------------------------

// Cache blocking. A K block is 2 KiB of a row, so the packed panel of B (L rows: 32 KiB of
// floats), which every tile down the panel reuses, stays in a 32 KiB L1 or, when the rows of A
// streaming past evict it, comes from L2 at 21 bytes a cycle, well within what L2 delivers. An
// M block keeps the rows of A that every panel meets (MC x K) within half of a 1 MiB L2; each
// M block packs B again, a cost spread over MC rows. Measured on the seed layers, 1 KiB and
// 4 KiB K blocks were a few percent slower.
inline constexpr index_t KC_bytes = 2048;
inline constexpr index_t MC_bytes = 512 * 1024;

// The panel of B for one tile (L rows from src, zero past rows, and depth k, zero-padded to a
// whole group): vector j of group g holds, in block q, B[j·Q + q][g·KG .. g·KG + KG).
template <class T>
void pack_panel(const T* src, index_t ld, int rows, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int Q = L / KG<T>;
  for (int j = 0; j < KG<T>; ++j) {
    for (index_t p0 = 0; p0 < depth; p0 += L) {
      const int count = static_cast<int>(std::min<index_t>(L, depth - p0));
      Vec<T> r[Q];
      for (int q = 0; q < Q; ++q) {
        const int row = j * Q + q;
        const T* from = src + row * ld + p0;
        r[q] = row >= rows ? Vec<T>{} : count == L ? load(from) : load_first(from, count);
      }
      transpose_blocks<KG<T>, T>(r);
      const index_t group0 = p0 / KG<T>;
      for (int g = 0; g * KG<T> < count; ++g) store<T>(dst + ((group0 + g) * KG<T> + j) * L, r[g]);
    }
  }
}

// C tile (rows x cols, at most MR x L) from MR rows of A, read in place, and a packed panel of
// B. Adds to C unless first; bias and Fns only after the last K block (last). Never inlined:
// inlined into a large caller, GCC 12 stored every accumulator at every step (2.5x slower).
template <class T, class... Fns>
[[gnu::noinline]] void micro_kernel(index_t depth, const T* a, index_t lda, int rows, const T* bp, T* c, index_t ldc, int cols,
                  bool first, bool last, const T* bias) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  // Past the last row, repeat it: the extra tile rows are computed but never stored.
  const T* ar[MR];
  for (int i = 0; i < MR; ++i) ar[i] = a + std::min(i, rows - 1) * lda;
  Vec<T> acc[MR][G] = {};
  const auto step = [&](index_t p, auto&& group_of_row) {
    Vec<T> bv[G];
    for (int j = 0; j < G; ++j) bv[j] = load(bp + j * L);
    for (int i = 0; i < MR; ++i) {
      const Vec<T> av = group_of_row(ar[i] + p);
      for (int j = 0; j < G; ++j) acc[i][j] = fma<T>(av, bv[j], acc[i][j]);
    }
    bp += G * L;
  };
  const index_t whole = depth / G * G;
  for (index_t p = 0; p < whole; p += G) step(p, [](const T* x) { return broadcast_group<T>(x); });
  if (whole < depth) {
    // The last, partial group: A is not read past depth (its row may end there).
    step(whole, [rest = static_cast<std::size_t>(depth - whole)](const T* x) {
      T group[KG<T>] = {};
      std::memcpy(group, x, rest * sizeof(T));
      return broadcast_group<T>(group);
    });
  }
  for (int i = 0; i < MR && i < rows; ++i, c += ldc) {
    fold_level<G / 2, T>(acc[i], G / 2);
    Vec<T> v = acc[i][0];
    if (cols == L) {
      if (!first) v += load(c);
      if (last) {
        if (bias != nullptr) v += load(bias);
        v = apply_all<Vec<T>, Fns...>(v);
      }
      store<T>(c, v);
    } else {
      if (!first) v += load_first(c, cols);
      if (last) {
        if (bias != nullptr) v += load_first(bias, cols);
        v = apply_all<Vec<T>, Fns...>(v);
      }
      store_first<T>(c, v, cols);
    }
  }
}

// Splits extent into the fewest blocks of at most limit, of equal size rounded up to a multiple
// of step: 784 in blocks of 256 becomes 4 x 196 rather than 3 x 256 + 16.
inline index_t balanced_block(index_t extent, index_t limit, index_t step) {
  const index_t blocks = (extent + limit - 1) / limit;
  const index_t size = (extent + blocks - 1) / blocks;
  return (size + step - 1) / step * step;
}

// B packed once, whole, in the panels gemm_blocked would otherwise pack on every call. Panel
// p (rows p·L .. p·L + L of B) holds the whole depth, rounded up to a group, in pack_panel's
// layout, so the K block at k0 of a panel is the k0·L-th element on: the product reads exactly
// what it reads after packing, and gives the same bits.
template <class T>
class PackedWeight {
 public:
  PackedWeight(const T* b, index_t n, index_t k)
      : storage_(static_cast<std::size_t>((n + lanes<T> - 1) / lanes<T> * padded(k) * lanes<T>) * sizeof(T)), n_(n), k_(k) {
    for (index_t j0 = 0; j0 < n; j0 += lanes<T>) {
      pack_panel(b + j0 * k, k, static_cast<int>(std::min<index_t>(lanes<T>, n - j0)), k, elements() + offset(j0, 0));
    }
  }

  index_t rows() const { return n_; }
  index_t depth() const { return k_; }
  const T* end() const { return panel(n_ + lanes<T> - 1, 0); }
  const T* panel(index_t j0, index_t k0) const { return elements() + offset(j0, k0); }

 private:
  static index_t padded(index_t k) { return (k + KG<T> - 1) / KG<T> * KG<T>; }
  index_t offset(index_t j0, index_t k0) const { return (j0 / lanes<T>) * padded(k_) * lanes<T> + k0 * lanes<T>; }
  T* elements() const { return reinterpret_cast<T*>(storage_.data()); }

  ::duet::detail::Storage storage_;
  index_t n_;
  index_t k_;
};

// packed: B already packed, or null to pack each panel as it is reached.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  ::duet::detail::Storage scratch(packed != nullptr ? 0 : static_cast<std::size_t>(kc * L * size));
  T* panel = reinterpret_cast<T*>(scratch.data());
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = 0; j0 < n; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else pack_panel(b + j0 * k + k0, k, cols, depth, panel);
        // A packed panel comes from L3 or memory, and its first tile would wait for it. The
        // panels lie in the order they are used, so each tile fetches a slice of the next one
        // into L2, and it is there when wanted.
        const std::byte* ahead = nullptr;
        index_t ahead_bytes = 0;
        index_t slice = 0;
        if (packed != nullptr) {
          ahead = reinterpret_cast<const std::byte*>(bp + (depth + KG<T> - 1) / KG<T> * KG<T> * L);
          ahead_bytes = std::min<index_t>(reinterpret_cast<const std::byte*>(packed->end()) - ahead, kc * L * size);
          const index_t tiles = (m1 - m0 + MR - 1) / MR;
          slice = (ahead_bytes + tiles - 1) / tiles;
        }
        index_t fetched = 0;
        for (index_t i0 = m0; i0 < m1; i0 += MR) {
          micro_kernel<T, Fns...>(depth, a + i0 * k + k0, k, static_cast<int>(std::min<index_t>(MR, m1 - i0)), bp,
                                  c + i0 * n + j0, n, cols, k0 == 0, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

enum class Path : unsigned char { none, unrolled, gemv, blocked };

template <index_t K, index_t N>
Path path_of(index_t m, index_t k, index_t n) {
  if constexpr (K != dyn && N != dyn && K * N <= 64) {
    return Path::unrolled;
  } else {
    // k == 0 has no K block for the blocked path to finish on; the GEMV gives bias and Fns.
    if (m == 1 || k == 0) return Path::gemv;
    return m > 0 && n > 0 ? Path::blocked : Path::none;
  }
}

}  // namespace detail

// An elementwise function the kernels can apply in registers: Fn::apply(v) on a scalar and on
// a SIMD vector of the same element type.
template <class Fn, class T>
concept VectorFunction = requires(T s, detail::Vec<T> v) {
  { Fn::apply(s) } -> std::same_as<T>;
  { Fn::apply(v) } -> std::same_as<detail::Vec<T>>;
};

template <class T, class... Fns>
inline constexpr bool gemm_supports =
    (std::is_same_v<T, float> || std::is_same_v<T, double>) && (VectorFunction<Fns, T> && ...);

template <class T>
using PackedWeight = detail::PackedWeight<T>;

// Whether gemm on these sizes reads a packed weight when given one: the blocked product does;
// a GEMV reads every weight once, in place, and small static layers are unrolled.
template <index_t K = dyn, index_t N = dyn>
bool reads_packed_weight(index_t m, index_t k, index_t n) {
  return detail::path_of<K, N>(m, k, n) == detail::Path::blocked;
}

// c[m, n] = Fns(Σ_k a[m, k] · b[n, k] + bias[n]), each Fn applied in order; bias may be null.
// a is [m, k], b is [n, k] (a weight as [out, in]) and c is [m, n], all row-major and dense;
// no alignment is assumed. K and N are k and n when known at compile time, dyn otherwise.
// packed_b, if given, is PackedWeight(b, n, k), and saves packing b again.
// After the first call on a thread for a given size, no heap allocation.
template <index_t K = dyn, index_t N = dyn, class... Fns, class T>
  requires gemm_supports<T, Fns...>
void gemm(const T* a, index_t m, index_t k, const T* b, index_t n, std::type_identity_t<const T*> bias, T* c,
          const PackedWeight<std::type_identity_t<T>>* packed_b = nullptr) {
  switch (detail::path_of<K, N>(m, k, n)) {
    case detail::Path::unrolled:
      if constexpr (K != dyn && N != dyn) detail::dense_unrolled<K, N, T, Fns...>(a, m, b, bias, c);
      break;
    case detail::Path::gemv:
      for (index_t i = 0; i < m; ++i) detail::gemv<T, Fns...>(a + i * k, k, b, n, bias, c + i * n);
      break;
    case detail::Path::blocked:
      if (packed_b != nullptr && (packed_b->rows() != n || packed_b->depth() != k)) {
        throw ShapeError("duet::kernels::gemm: a weight packed as [" + std::to_string(packed_b->rows()) + ", " +
                            std::to_string(packed_b->depth()) + "] for a product with [" + std::to_string(n) + ", " +
                            std::to_string(k) + "]");
      }
      detail::gemm_blocked<T, Fns...>(a, m, k, b, n, bias, c, packed_b);
      break;
    case detail::Path::none:
      break;
  }
}

}  // namespace duet::kernels
