// One instruction set's dense-layer kernels: the algorithm gemm.hpp describes, written once on
// the set's Vec<T>, lanes<T>, KG<T>, MR, load, store, fma, load_first, store_first and broadcast_group
// (simd/arch.hpp). No include guard and no includes: gemm.hpp includes it once per set, inside
// that set's namespace and target region, so each copy is compiled for its set.

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
#pragma GCC unroll 4
  for (int round = 1; round < Q; round *= 2) {
    Vec<T> t[Q];
#pragma GCC unroll 8
    for (int i = 0; i < Q / 2; ++i) {
      t[2 * i] = interleave_low<B, T>(r[i], r[i + Q / 2], all);
      t[2 * i + 1] = interleave_high<B, T>(r[i], r[i + Q / 2], all);
    }
#pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) r[i] = t[i];
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
#pragma GCC unroll 8
  for (int i = 0; i < count; ++i) v[i] = fold_pair<W, T>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, lanes<T>>{});
  if constexpr (W > 1) fold_level<W / 2, T>(v, count / 2);
}

// Lane i of the result is the sum of the lanes of v[i]; v is clobbered.
template <class T>
Vec<T> sum_lanes(Vec<T> (&v)[lanes<T>]) {
  fold_level<lanes<T> / 2, T>(v, lanes<T> / 2);
  return v[0];
}

// ---- Transposition ---------------------------------------------------------------------------

// to[cols, rows] = from[rows, cols]ᵀ, to's rows ldt apart: L x L tiles transposed in registers
// (transpose_blocks on single lanes), the rows and columns past the last whole tile one element
// at a time.
template <class T>
void transpose_step(Target, const T* from, index_t rows, index_t cols, T* to, index_t ldt) {
  constexpr int L = lanes<T>;
  const index_t rows_full = rows / L * L;
  const index_t cols_full = cols / L * L;
  for (index_t r = 0; r < rows_full; r += L) {
    for (index_t c = 0; c < cols_full; c += L) {
      Vec<T> v[L];
      for (int i = 0; i < L; ++i) v[i] = load(from + (r + i) * cols + c);
      transpose_blocks<1, T>(v);
      for (int i = 0; i < L; ++i) store<T>(to + (c + i) * ldt + r, v[i]);
    }
    for (index_t c = cols_full; c < cols; ++c) {
      for (index_t i = r; i < r + L; ++i) to[c * ldt + i] = from[i * cols + c];
    }
  }
  for (index_t r = rows_full; r < rows; ++r) {
    for (index_t c = 0; c < cols; ++c) to[c * ldt + r] = from[r * cols + c];
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
    apply_all<Vec<T>, Fns...>(s);
    store_first<T>(c + j0, s, cols);
  }
}

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
#pragma GCC unroll 16
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

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
// The MR broadcasts first, then each vector of B once, for every row: MR x KG accumulators, MR
// broadcasts and one vector of B are all the registers it holds (16 for AVX2's 3 x 4, 31 of
// AVX-512's 32 for 6 x 4). Holding the KG vectors of B instead needed one register more than
// AVX2 has, and the accumulator spilled to the stack put a store and a load in its chain of
// FMAs (AVX2 with clang: 38% of the FMA peak, now 80-95%).
// Each accumulator still takes its FMAs in the order of k: the order between them changes no
// bit. The loops over the tile are unrolled by pragma here and in micro_kernel's store loop:
// GCC keeps an array in registers only where every index is a constant, and left to itself it
// kept these loops rolled, kept acc in memory and stored all of it at every step (with the
// register fix alone, GCC's AVX2 product stayed at 25% of the peak; with both, 60-80%, level
// with OpenBLAS on the same machine; benchmarks/gemm.cpp). The broadcasts' loop too: at -O2,
// where GCC 12 unrolls nothing by itself, it went through the stack, and the seed layers'
// product ran at 166 GFLOP/s against -O3's 224 (AVX-512).
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> av[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av[i] = broadcast_group<T>(group);
    } else {
      av[i] = broadcast_group<T>(ar[i] + p);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) {
    const Vec<T> bv = load(bp + j * lanes<T>);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = fma<T>(av[i], bv, acc[i][j]);
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
  const index_t whole = depth / G * G;
  for (index_t p = 0; p < whole; p += G, bp += G * L) tile_step<false, T>(acc, ar, p, bp, 0);
  // The last, partial group: A is not read past depth (its row may end there).
  if (whole < depth) tile_step<true, T>(acc, ar, whole, bp, static_cast<std::size_t>(depth - whole));
  // A fixed trip count, unrolled, so that every index of acc is a constant (see tile_step).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i, c += ldc) {
    if (i >= rows) continue;
    fold_level<G / 2, T>(acc[i], G / 2);
    Vec<T> v = acc[i][0];
    if (cols == L) {
      if (!first) v += load(c);
      if (last) {
        if (bias != nullptr) v += load(bias);
        apply_all<Vec<T>, Fns...>(v);
      }
      store<T>(c, v);
    } else {
      if (!first) v += load_first(c, cols);
      if (last) {
        if (bias != nullptr) v += load_first(bias, cols);
        apply_all<Vec<T>, Fns...>(v);
      }
      store_first<T>(c, v, cols);
    }
  }
}

// Panels [p0, p1) of C (columns p0·L .. p1·L), every row: the blocked product's work for one
// thread. panel: scratch for one packed panel of B, unless packed.
template <class T, class... Fns>
void gemm_panels(index_t p0, index_t p1, const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                 const PackedWeight<T>* packed, index_t kc, index_t mc, T* panel) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t n1 = std::min(n, p1 * L);
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = p0 * L; j0 < n1; j0 += L) {
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

// The product on as many threads as it can use (threads.hpp), each taking whole panels of
// columns, so that every element of C is summed by the same code in the same order whatever
// the number of threads.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  const index_t panels = (n + L - 1) / L;
  const int threads = ::duet::detail::useful_threads(m * n * k, panels);
  const index_t panel_elements = packed != nullptr ? 0 : kc * L;
  ::duet::detail::Storage scratch(static_cast<std::size_t>(threads * panel_elements * size));
  T* panels_scratch = reinterpret_cast<T*>(scratch.data());
  ::duet::detail::parallel_blocks(panels, threads, [&](index_t p0, index_t p1, int slot) {
    gemm_panels<T, Fns...>(p0, p1, a, m, k, b, n, bias, c, packed, kc, mc,
                           panels_scratch + slot * panel_elements);
  });
}

// ---- B stored as [k, n] -----------------------------------------------------------------------

// One k for a tile of the product from B as [k, n]: acc[i][j] += A[i][p], broadcast, times
// vector j of row p of B. Partial: the tile's last columns end within it, and B is not read
// past them (cols of NV_KN·L).
template <bool Partial, class T>
[[gnu::always_inline]] inline void kn_step(Vec<T> (&acc)[MR_KN][NV_KN], const T* const (&ar)[MR_KN], index_t p,
                                           const T* bp, int cols) {
  constexpr int L = lanes<T>;
  Vec<T> bv[NV_KN];
#pragma GCC unroll 4
  for (int j = 0; j < NV_KN; ++j) {
    if constexpr (Partial) {
      const int count = std::min(L, cols - j * L);
      bv[j] = count <= 0 ? Vec<T>{} : load_first(bp + j * L, count);
    } else {
      bv[j] = load(bp + j * L);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR_KN; ++i) {
    const Vec<T> av = Vec<T>{} + ar[i][p];
#pragma GCC unroll 4
    for (int j = 0; j < NV_KN; ++j) acc[i][j] = fma<T>(av, bv[j], acc[i][j]);
  }
}

// C tile (rows x cols, at most MR_KN x NV_KN·L) from MR_KN rows of A and depth rows of B as
// [k, n], both read in place: the classic outer-product tile, whose accumulators hold finished
// sums, so that no fold follows (gemm's tile folds KG partial sums per output: a quarter of its
// time when k is a batch of 64, as in a weight gradient). Adds to C unless first.
template <class T>
[[gnu::noinline]] void kn_kernel(index_t depth, const T* a, index_t lda, int rows, const T* b, index_t ldb, int cols, T* c,
                                 index_t ldc, bool first) {
  constexpr int L = lanes<T>;
  const T* ar[MR_KN];
  for (int i = 0; i < MR_KN; ++i) ar[i] = a + std::min(i, rows - 1) * lda;
  Vec<T> acc[MR_KN][NV_KN] = {};
  if (cols == NV_KN * L) {
    for (index_t p = 0; p < depth; ++p, b += ldb) kn_step<false, T>(acc, ar, p, b, cols);
  } else {
    for (index_t p = 0; p < depth; ++p, b += ldb) kn_step<true, T>(acc, ar, p, b, cols);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR_KN; ++i, c += ldc) {
    if (i >= rows) continue;
#pragma GCC unroll 4
    for (int j = 0; j < NV_KN; ++j) {
      const int count = std::min(L, cols - j * L);
      if (count <= 0) continue;
      Vec<T> v = acc[i][j];
      if (count == L) {
        if (!first) v += load(c + j * L);
        store<T>(c + j * L, v);
      } else {
        if (!first) v += load_first(c + j * L, count);
        store_first<T>(c + j * L, v, count);
      }
    }
  }
}

// c[m, n] (+)= a[m, k] · b[k, n] on as many threads as it can use, each taking whole panels of
// NV_KN·L columns. Every element is one chain of FMAs in the order of k within a K block, the
// blocks added to C in order, whatever the thread, tile or m. K blocks keep a panel's rows of
// B (kc x NV_KN·L) in L2 across the M block's tiles, and M blocks keep A's block in half of it.
template <class T>
void gemm_kn_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate) {
  constexpr index_t W = NV_KN * lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KN_panel_bytes / (W * size), 1);
  const index_t mc = balanced_block(m, std::max<index_t>(MR_KN, MC_bytes / (kc * size)), MR_KN);
  const index_t panels = (n + W - 1) / W;
  const int threads = ::duet::detail::useful_threads(m * n * k, panels);
  ::duet::detail::parallel_blocks(panels, threads, [&](index_t p0, index_t p1, int) {
    const index_t n1 = std::min(n, p1 * W);
    for (index_t k0 = 0; k0 < k; k0 += kc) {
      const index_t depth = std::min(kc, k - k0);
      for (index_t m0 = 0; m0 < m; m0 += mc) {
        const index_t m1 = std::min(m, m0 + mc);
        for (index_t j0 = p0 * W; j0 < n1; j0 += W) {
          const int cols = static_cast<int>(std::min(W, n - j0));
          for (index_t i0 = m0; i0 < m1; i0 += MR_KN) {
            kn_kernel<T>(depth, a + i0 * k + k0, k, static_cast<int>(std::min<index_t>(MR_KN, m1 - i0)), b + k0 * n + j0, n,
                         cols, c + i0 * n + j0, n, k0 == 0 && !accumulate);
          }
        }
      }
    }
  });
}

// The entry points gemm() and PackedWeight dispatch to (with_kernels in gemm.hpp).
struct Kernels {
  template <class T>
  static constexpr int lanes_of = lanes<T>;
  template <class T>
  static constexpr int group_of = KG<T>;

  template <class T, class... Fns>
  static void gemv_rows(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
    for (index_t i = 0; i < m; ++i) gemv<T, Fns...>(a + i * k, k, b, n, bias, c + i * n);
  }

  template <class T, class... Fns>
  static void blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                      const PackedWeight<T>* packed) {
    gemm_blocked<T, Fns...>(a, m, k, b, n, bias, c, packed);
  }

  template <class T>
  static void blocked_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate) {
    gemm_kn_blocked<T>(a, m, k, b, n, c, accumulate);
  }

  // Every panel of b ([n, k]) into dst, panel after panel, panel_size elements apart.
  template <class T>
  static void pack(const T* b, index_t n, index_t k, index_t panel_size, T* dst) {
    for (index_t j0 = 0; j0 < n; j0 += lanes<T>) {
      pack_panel(b + j0 * k, k, static_cast<int>(std::min<index_t>(lanes<T>, n - j0)), k, dst + j0 / lanes<T> * panel_size);
    }
  }
};
