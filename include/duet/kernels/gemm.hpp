// The dense-layer product with its epilogue fused: C[m, n] = Fns(Σ_k A[m, k]·B[n, k] + bias[n]).
//
// A is the input [M, K] and B the weight [N, K], both row-major, so each output is a dot
// product of two contiguous rows. Four paths, chosen by shape:
//  - small layers (K·N <= 64, as Dense<4, 4>): plain loops, which the compiler unrolls
//    completely where the sizes are constants; packing, or a loop over vectors, would cost
//    more than the arithmetic. The same sums whether the sizes are constants or not.
//  - one row (batch 1): a GEMV. Every weight is used once, so the time is the time to stream
//    B from memory; it reads B in place, front to back, and a shuffle tree sums L rows'
//    vectors into one vector of L results for the epilogue.
//  - fewer than 16 outputs (a classifier's 10 classes): dot products along k, a tile of a few
//    rows of A by 5 rows of B, both read in place, each output's lanes summed at the end, so
//    that every lane of every FMA counts; the blocked product below spreads a vector over the
//    outputs, and 10 of them left 6 lanes of 16 idle (as oneDNN 2.6's brgemm does, a tile of
//    16 rows x 1 vector, 10 lanes of it masked in). The sums go to C with the bias added, then
//    one pass over that small output applies the functions, if any: the product is compiled
//    once per instruction set, not once per epilogue. On the Xeon (AVX-512) 1.2-1.4x oneDNN's
//    speed. Its ceiling is the tile's: the lanes of 15 sums folded every tile (k = 512) hold it
//    to 83 % of the FMA peak with its data in L1 (91 % at k = 2048). M on the lanes instead
//    would need A transposed on every call, which took longer than this product.
//  - otherwise: a GEMM in the style of BLIS. The weight is packed into panels of W = NV·L
//    columns (its rows: a layer's outputs), each [k, W], the weight transposed, so that the
//    micro-kernel's tile of MR rows x NV vectors of C takes, for each k, NV vectors of B and
//    MR values of A broadcast from memory, A read in place: MR x NV FMAs that hold whole sums,
//    one chain per output in the order of k. After the last K block the epilogue runs on the
//    tile's registers before the one store, so the output never takes a second pass. Before
//    2026-12-07 the tile multiplied groups of 4 consecutive k (a vector of B held 4 values of
//    each of L/4 rows, A's 4 broadcast as a 128-bit group) and folded the partial sums after
//    every K block: on the AMD EPYC Zen 5 that tile's loop ran at 89-93 % of the FMA peak
//    with its data in L1, the outer product's at 96 %, and the product at 0.95-0.97x
//    oneDNN's speed at batch 256.
// Every path adds the bias to the finished sum and then applies the functions, in the order
// separate BiasAdd and map kernels would: fused and unfused evaluation agree to the bit.
// gemm_kn, the product with B stored as [k, n], runs the same tile on B's rows in place.
// The GEMM gives whole panels of columns to each thread (threads.hpp) when the product is large
// enough to share: every element's sum is the same code in the same order on any thread, so
// the bits do not depend on the number of threads. The GEMV stays on one: it is bound by
// reading the weight, and waking a second thread costs more than the time it could save there.
//
// The GEMV and the GEMM exist once per instruction set (AVX-512, AVX2 + FMA, baseline), in
// detail/gemm_impl.hpp, compiled once per set below; each call runs the set chosen at
// run time (simd/isa.hpp, duet::kernel_isa()). The sets differ in vector width, tile height and
// FMA, so their results differ in the last bits; under one set, every mode computes the same
// bits. A PackedWeight is packed for one set, and only that set reads it.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#if __has_include(<unistd.h>)
#include <unistd.h>
#endif

#include "../config.hpp"
#include "../error.hpp"
#include "../memory.hpp"
#include "../threads.hpp"
#include "detail/halves.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"
#include "simd/isa.hpp"

namespace duet::kernels {

namespace detail {

// Fns in order, in place on a value or a vector of any set's width (by reference: see
// fn::Relu::apply_in_place).
template <class V, class... Fns>
void apply_all(V& v) {
  (Fns::apply_in_place(v), ...);
}

// ---- Small layers ----------------------------------------------------------------------------

// k·n <= 64: one chain per output, in k order (a balanced tree measured slower on chains of
// Dense<4, 4> layers, where each layer waits on the last one's stores). With K and N known at
// compile time the compiler unrolls it completely; with sizes known only at run time the same
// loop gives the same sums, so that a small layer's bits do not depend on whether its sizes
// were constants (a static Dense<16, 3> and the same layer loaded from ONNX agree).
template <index_t K, index_t N, class T, class... Fns>
void dense_small(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
  const index_t depth = K != dyn ? K : k;
  const index_t width = N != dyn ? N : n;
  for (index_t i = 0; i < m; ++i, a += depth, c += width) {
    for (index_t j = 0; j < width; ++j) {
      T s = T(0);
      for (index_t q = 0; q < depth; ++q) s += a[q] * b[j * depth + q];
      if (bias != nullptr) s += bias[j];
      apply_all<T, Fns...>(s);
      c[j] = s;
    }
  }
}

// Cache blocking. A K block of a panel of B (kc x W: up to 256 KiB) comes from L2 (at 21 bytes
// a cycle for AVX-512's tile, within what L2 delivers) and every tile down the M block reuses it;
// an M block keeps the rows of A that every panel meets (MC x K) within half of the core's L2
// (m_block_bytes), and each M block packs B again (or reads its packed panels from beyond L2), a
// cost spread over MC rows. Measured on the seed's gradients and a 64-channel convolution,
// 16 KiB K blocks (in L1) were 5-15 % slower, from the partial sums they add to C. On the seed's forward layers (Xeon,
// AVX-512), 64 KiB blocks (784 as 4 x 196) ran at 88-93 % of the FMA peak and one block over all of K (256 KiB) at
// 92-96 %: every K block after the first stores and reloads the C tile and restarts the tile's loop, and a 64 KiB block
// does not stay in a 48 KiB L1 either (benchmarks/gemm.cpp, gemm/tile/*: 97 % in L1).
inline constexpr index_t panel_block_bytes = 256 * 1024;

// Half of a core's L2, as the system reports it, read once; half of 1 MiB where it reports none.
// A fixed 512 KiB suited the AMD EPYC's 1 MiB L2 and held the Xeon's 784 x 512 layer at batch
// 256 to two M blocks of 128 rows, each reading (or packing) the whole weight again; with half
// of its 2 MiB, one block of 256 rows reads it once: the fastest iteration from 94.1-94.2 to
// 95.6-96.2 % of the FMA peak with the weight packed beforehand, 86 to 91-92 % packing it on
// every call (AVX-512). The blocking of M changes no sum: every element is one chain along k.
inline index_t m_block_bytes() {
  static const index_t bytes = [] {
    long l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return l2 >= 64 * 1024 ? static_cast<index_t>(l2 / 2) : index_t{512 * 1024};
  }();
  return bytes;
}

// Splits extent into the fewest blocks of at most limit, of equal size rounded up to a multiple
// of step: 784 in blocks of 256 becomes 4 x 196 rather than 3 x 256 + 16.
inline index_t balanced_block(index_t extent, index_t limit, index_t step) {
  const index_t blocks = (extent + limit - 1) / limit;
  const index_t size = (extent + blocks - 1) / blocks;
  return (size + step - 1) / step * step;
}

// B packed once, whole, in the panels the blocked product would otherwise pack on every call,
// for one instruction set's kernels (by default those active when it is made). Panel p (rows
// p·W .. p·W + W of B, W the set's panel width) is B's rows transposed, [k, W], so the K block at
// k0 of a panel is the k0·W-th element on: the product reads exactly what it reads after
// packing, and gives the same bits.
template <class T>
class PackedWeight {
 public:
  PackedWeight(const T* b, index_t n, index_t k, Isa isa = active_isa());

  index_t rows() const { return n_; }
  index_t depth() const { return k_; }
  Isa isa() const { return isa_; }
  const T* panel(index_t j0, index_t k0) const { return elements() + (j0 / width_ * k_ + k0) * width_; }

 private:
  T* elements() const { return reinterpret_cast<T*>(storage_.data()); }

  Isa isa_;
  index_t width_ = 0;
  index_t n_;
  index_t k_;
  ::duet::detail::Storage storage_;
};

}  // namespace detail

}  // namespace duet::kernels

// The product once per instruction set, each in its namespace and target region.
#define DUET_KERNEL_BODY "gemm_impl.hpp"
#include "detail/per_isa.hpp"

namespace duet::kernels {

// Whether gemm<K, N> takes the small layers' loop unrolled: the one place where the
// compile-time sizes change the product's code (not its sums: gemm<dyn, dyn> runs the same
// loop at those sizes).
template <index_t K, index_t N>
inline constexpr bool unrolls = K != dyn && N != dyn && K * N <= 64;

namespace detail {

// f(Kernels) with the kernels of isa: the one switch from the run-time choice to code
// compiled for it. Only pointers and sizes cross it.
template <class F>
decltype(auto) with_kernels(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f(avx512::Kernels{});
    case Isa::avx2: return f(avx2::Kernels{});
    case Isa::baseline: break;
  }
  return f(baseline::Kernels{});
}

template <class T>
PackedWeight<T>::PackedWeight(const T* b, index_t n, index_t k, Isa isa) : isa_(isa), n_(n), k_(k) {
  with_kernels(isa_, [&]<class K>(K) {
    width_ = K::template panel_width_of<T>;
    storage_ = ::duet::detail::Storage(static_cast<std::size_t>((n + width_ - 1) / width_ * width_ * k) * sizeof(T));
    K::pack(b, n, k, elements());
  });
}

enum class Path : unsigned char { none, small, gemv, narrow, blocked };

// Layers with fewer outputs take the narrow product: a vector of AVX-512 floats.
inline constexpr index_t narrow_outputs = 16;

template <index_t K, index_t N>
Path path_of(index_t m, index_t k, index_t n) {
  if constexpr (unrolls<K, N>) {
    return Path::small;
  } else {
    // k == 0 (no K block for the blocked path to finish on) is small too: bias and Fns.
    if (k * n <= 64) return Path::small;
    if (m == 1) return Path::gemv;
    if (m == 0) return Path::none;
    return n < narrow_outputs ? Path::narrow : Path::blocked;
  }
}

}  // namespace detail

// An elementwise function the kernels can apply in registers: Fn::apply(v) on a scalar and on
// a SIMD vector of the same element type.
template <class Fn, class T>
concept VectorFunction =
    requires(T& s, detail::Vector<T, 16>& v16, detail::Vector<T, 32>& v32, detail::Vector<T, 64>& v64) {
      Fn::apply_in_place(s);
      Fn::apply_in_place(v16);
      Fn::apply_in_place(v32);
      Fn::apply_in_place(v64);
    };

template <class T, class... Fns>
inline constexpr bool gemm_supports =
    (std::is_same_v<T, float> || std::is_same_v<T, double>) && (VectorFunction<Fns, T> && ...);

template <class T>
using PackedWeight = detail::PackedWeight<T>;

// A PackedWeight as a type of its own for each set's Kernels, for caches that keep one form
// per type (nn::BasicParameter::derived).
template <class T, class Kernels>
struct PackedWeightFor : PackedWeight<T> {
  using PackedWeight<T>::PackedWeight;
};

// Whether gemm on these sizes reads a packed weight when given one: the blocked product does;
// a GEMV and the narrow product read the weight's rows in place, and small layers run plain
// loops.
template <index_t K = dyn, index_t N = dyn>
bool reads_packed_weight(index_t m, index_t k, index_t n) {
  return detail::path_of<K, N>(m, k, n) == detail::Path::blocked;
}

// c[m, n] = Fns(Σ_k a[m, k] · b[n, k] + bias[n]), each Fn applied in order; bias may be null.
// a is [m, k], b is [n, k] (a weight as [out, in]) and c is [m, n], all row-major and dense;
// no alignment is assumed. K and N are k and n when known at compile time, dyn otherwise.
// packed_b, if given, is PackedWeight(b, n, k), and saves packing b again; one packed for
// another instruction set (before a set_kernel_isa) has another layout, and is not read.
// After the first call on a thread for a given size, no heap allocation.
template <index_t K = dyn, index_t N = dyn, class... Fns, class T>
  requires gemm_supports<T, Fns...>
void gemm(const T* a, index_t m, index_t k, const T* b, index_t n, std::type_identity_t<const T*> bias, T* c,
          const PackedWeight<std::type_identity_t<T>>* packed_b = nullptr) {
  const Isa isa = active_isa();
  switch (detail::path_of<K, N>(m, k, n)) {
    case detail::Path::small:
      detail::dense_small<K, N, T, Fns...>(a, m, k, b, n, bias, c);
      break;
    case detail::Path::gemv:
      detail::with_kernels(isa, [&]<class Kernels>(Kernels) { Kernels::template gemv_rows<T, Fns...>(a, m, k, b, n, bias, c); });
      break;
    case detail::Path::narrow:
      detail::with_kernels(
          isa, [&]<class Kernels>(Kernels) { Kernels::template narrow<T, Fns...>(a, m, k, b, n, bias, c); });
      break;
    case detail::Path::blocked:
      if (packed_b != nullptr && (packed_b->rows() != n || packed_b->depth() != k)) {
        throw ShapeError("duet::kernels::gemm: a weight packed as [" + std::to_string(packed_b->rows()) + ", " +
                            std::to_string(packed_b->depth()) + "] for a product with [" + std::to_string(n) + ", " +
                            std::to_string(k) + "]");
      }
      if (packed_b != nullptr && packed_b->isa() != isa) packed_b = nullptr;
      detail::with_kernels(isa, [&]<class Kernels>(Kernels) {
        Kernels::template blocked<T, Fns...>(a, m, k, b, n, bias, c, packed_b);
      });
      break;
    case detail::Path::none:
      break;
  }
}

// to[cols, rows] = from[rows, cols]ᵀ, both row-major: the copy an operand takes where a product
// needs it the other way round (a convolution's weight, a layer's output gradient). In tiles
// of a vector's lanes square, transposed in registers: a layer's [256, 512] output gradient
// took 100-146 us one element at a time in 32 x 32 blocks, on one thread between the
// training step's products. Threads take strips of 64 rows (whole tiles of every set), each
// writing its own part of every row of `to`.
template <class T>
void transpose(const T* from, index_t rows, index_t cols, T* to) {
  if (rows == 0 || cols == 0) return;
  constexpr index_t strip = 64;
  const index_t strips = (rows + strip - 1) / strip;
  const Isa isa = active_isa();
  ::duet::detail::parallel_blocks(
      strips, ::duet::detail::useful_threads(rows * cols * ::duet::detail::pass_work, strips), [&](index_t s0, index_t s1, int) {
        const index_t r0 = s0 * strip;
        const index_t r1 = std::min(rows, s1 * strip);
        detail::with_target(isa, [&](auto target) { transpose_step(target, from + r0 * cols, cols, r1 - r0, cols, to + r0, rows); });
      });
}

// c[m, n] (+)= Σ_k a[m, k] · b[k, n]: b stored the other way round from gemm's, [k, n] row-major,
// as an image's patches, a layer's weight under its input gradient and its input under its
// weight gradient are, with neither bias nor functions; accumulate adds to c instead of
// writing it. gemm's tile reads the rows of b in place, as they are what gemm packs a weight
// into. Every element is summed in the order of k, or, with halves, in halves (detail/halves.hpp:
// a sum over a batch's rows, the same as the sum of its halves'), the same at any m and on
// any thread (one row alone too: gemm_kn has no GEMV path). No heap allocation.
template <class T>
  requires gemm_supports<T>
  void gemm_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate = false,
               bool halves = false) {
    if (m == 0 || n == 0) return;
    if (k == 0) {
      if (!accumulate) std::fill_n(c, m * n, T(0));
      return;
    }
    detail::with_kernels(active_isa(),
                         [&]<class Kernels>(Kernels) { Kernels::blocked_kn(a, m, k, b, n, c, accumulate, halves); });
  }

}  // namespace duet::kernels
