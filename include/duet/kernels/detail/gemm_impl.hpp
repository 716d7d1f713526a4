// One instruction set's dense-layer kernels: the algorithm gemm.hpp describes, written once on
// the set's Vec<T>, lanes<T>, MR, NV, load, store, fma, broadcast, load_first and store_first
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

// to[cols, rows] = from[rows, cols]ᵀ, from's rows ldf apart and to's ldt: L x L tiles transposed
// in registers (transpose_blocks on single lanes), the last rows (fewer than L) as a tile whose
// missing rows are zeros and whose columns are stored in part, the columns past the last whole
// tile one element at a time. A narrow layer's weight (10 rows) is all last rows: one element
// at a time, its packing took longer than its product.
template <class T>
void transpose_step(Target, const T* from, index_t ldf, index_t rows, index_t cols, T* to, index_t ldt) {
  constexpr int L = lanes<T>;
  const index_t cols_full = cols / L * L;
  for (index_t r = 0; r < rows; r += L) {
    const int count = static_cast<int>(std::min<index_t>(L, rows - r));
    for (index_t c = 0; c < cols_full; c += L) {
      Vec<T> v[L];
      for (int i = 0; i < L; ++i) v[i] = i < count ? load(from + (r + i) * ldf + c) : Vec<T>{};
      transpose_blocks<1, T>(v);
      if (count == L) {
        for (int i = 0; i < L; ++i) store<T>(to + (c + i) * ldt + r, v[i]);
      } else {
        for (int i = 0; i < L; ++i) store_first<T>(to + (c + i) * ldt + r, v[i], count);
      }
    }
    for (index_t c = cols_full; c < cols; ++c) {
      for (index_t i = r; i < r + count; ++i) to[c * ldt + i] = from[i * ldf + c];
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
    apply_all<Vec<T>, Fns...>(s);
    store_first<T>(c + j0, s, cols);
  }
}

// ---- Narrow layers ---------------------------------------------------------------------------

// One vector of k for the narrow tile: acc[i·C + j] += A[i][p..] · B[j][p..], lane by lane.
// Partial: the last count (< L) values of k, the other lanes zero in A and B alike.
template <bool Partial, int R, int C, class T>
[[gnu::always_inline]] inline void dot_step(Vec<T> (&acc)[R * C], const T* const (&ar)[R], const T* const (&br)[C],
                                            index_t p, int count) {
  Vec<T> av[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) av[i] = Partial ? load_first(ar[i] + p, count) : load(ar[i] + p);
#pragma GCC unroll 8
  for (int j = 0; j < C; ++j) {
    Vec<T> bv = Partial ? load_first(br[j] + p, count) : load(br[j] + p);
    keep_in_register<T>(bv);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i * C + j] = fma<T>(av[i], bv, acc[i * C + j]);
  }
}

// C tile (rows x cols, at most dot_rows x dot_cols) = A·Bᵀ from rows of A and B, both [., k],
// read in place: each output a chain of FMAs along k, lane by lane, then its lanes summed by
// sum_lanes, the same tree for every output wherever it sits in the tile. Past the last row
// (or column), the last one again, computed and not stored. The bias (if any) is added to each
// sum as it is stored, the add the epilogue of tile() makes. Never inlined, as tile().
template <class T>
[[gnu::noinline]] void dot_tile(const T* a, index_t k, int rows, const T* b, int cols, const T* bias, T* c,
                                index_t ldc) {
  constexpr int L = lanes<T>;
  constexpr int R = dot_rows;
  constexpr int C = dot_cols;
  const T* ar[R];
  const T* br[C];
  for (int i = 0; i < R; ++i) ar[i] = a + std::min(i, rows - 1) * k;
  for (int j = 0; j < C; ++j) br[j] = b + std::min(j, cols - 1) * k;
  Vec<T> acc[R * C] = {};
  const index_t k_full = k / L * L;
  for (index_t p = 0; p < k_full; p += L) dot_step<false, R, C, T>(acc, ar, br, p, L);
  if (k_full < k) dot_step<true, R, C, T>(acc, ar, br, k_full, static_cast<int>(k - k_full));
  constexpr int groups = (R * C + L - 1) / L;
  T sums[groups * L];
#pragma GCC unroll 4
  for (int g = 0; g < groups; ++g) {
    Vec<T> v[L];
#pragma GCC unroll 16
    for (int q = 0; q < L; ++q) v[q] = g * L + q < R * C ? acc[std::min(g * L + q, R * C - 1)] : Vec<T>{};
    store<T>(sums + g * L, sum_lanes<T>(v));
  }
  for (int i = 0; i < rows; ++i, c += ldc) {
    for (int j = 0; j < cols; ++j) c[j] = bias != nullptr ? sums[i * C + j] + bias[j] : sums[i * C + j];
  }
}

// c[m, n] = a·bᵀ + bias, no functions (epilogue() after it), b [n, k] read in place: the
// product of a layer with fewer outputs than an AVX-512 vector has lanes. The blocked tile
// spreads a vector over the outputs, and 10 outputs left 6 of 16 lanes idle (oneDNN's brgemm
// does the same with a masked 16 x 1-vector tile); along k, every lane of every FMA is used,
// against a sum of lanes per output at the end. Threads take whole tiles of rows.
template <class T>
void dot_product(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
  constexpr index_t R = dot_rows;
  const index_t tiles = (m + R - 1) / R;
  ::duet::detail::parallel_blocks(
      tiles, ::duet::detail::useful_threads(m * n * k, tiles), [&](index_t t0, index_t t1, int) {
        for (index_t i0 = t0 * R; i0 < std::min(m, t1 * R); i0 += R) {
          const int rows = static_cast<int>(std::min(R, m - i0));
          for (index_t j0 = 0; j0 < n; j0 += dot_cols) {
            dot_tile(a + i0 * k, k, rows, b + j0 * k, static_cast<int>(std::min<index_t>(dot_cols, n - j0)),
                     bias == nullptr ? nullptr : bias + j0, c + i0 * n + j0, n);
          }
        }
      });
}

// c[i, :] = Fns(c[i, :]): the functions of dot_product's epilogue, in a pass over its small
// output, so that the product is compiled once whatever the functions; a layer without them
// (a classifier's 10 outputs, the bias added in dot_tile) takes no pass, which was 11 % of the
// 512 x 10 product at batch 64 (Xeon, AVX-512). Each vector gets the code (and the bits) of a
// vector's epilogue in tile().
template <class T, class... Fns>
void epilogue(T* c, index_t m, index_t n) {
  constexpr int L = lanes<T>;
  for (index_t i = 0; i < m; ++i, c += n) {
    for (index_t j = 0; j < n; j += L) {
      const int count = static_cast<int>(std::min<index_t>(L, n - j));
      Vec<T> v = load_first(c + j, count);
      apply_all<Vec<T>, Fns...>(v);
      store_first<T>(c + j, v, count);
    }
  }
}

// ---- The tile ---------------------------------------------------------------------------------

// One k for a tile: acc[i][j] += A[i][p], broadcast, times vector j of row p of B. Partial: the
// tile's last column (cols) ends before its last vector does, and B is not read past it.
template <bool Partial, int V, int R, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[R][V], const T* const (&ar)[R], index_t p, const T* bp,
                                             int cols) {
  constexpr int L = lanes<T>;
  Vec<T> bv[V];
#pragma GCC unroll 4
  for (int j = 0; j < V; ++j) {
    if constexpr (Partial) {
      const int count = std::min(L, cols - j * L);
      bv[j] = count <= 0 ? Vec<T>{} : count == L ? load(bp + j * L) : load_first(bp + j * L, count);
    } else {
      bv[j] = load(bp + j * L);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const Vec<T> av = broadcast(ar[i] + p);
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[i][j] = fma<T>(av, bv[j], acc[i][j]);
  }
}

// C tile (rows x cols, at most R x V·L) from R rows of A and depth rows of B as [k, n], rows
// ldb apart: the outer-product tile, whose accumulators hold finished sums. Adds to C unless
// first; bias and Fns after the last K block (last). Never inlined: inlined into a large caller,
// GCC 12 stored every accumulator at every step (2.5x slower).
// Each accumulator takes its FMAs in the order of k, in one chain, or in halves (halves.hpp):
// a chain per leaf, each leaf's sums then added to the partial sums it completes, kept in
// partials (R·V vectors for each level). The loops over the tile are unrolled by pragma here
// and in tile_step: GCC keeps an array in registers only where every index is a constant, and
// left to itself it kept these loops rolled, kept acc in memory and stored all of it at every
// step; at -O2, where GCC 12 unrolls nothing by itself, the same.
template <class T, int V, int R, class... Fns>
[[gnu::noinline]] void tile(index_t depth, bool halves, T* partials, const T* a, index_t lda, int rows, const T* b,
                            index_t ldb, int cols, T* c, index_t ldc, bool first, bool last, const T* bias) {
  constexpr int L = lanes<T>;
  // Past the last row, repeat it: the extra tile rows are computed but never stored.
  const T* ar[R];
  for (int i = 0; i < R; ++i) ar[i] = a + std::min(i, rows - 1) * lda;
  // Zeros, though every K block starts by zeroing it: GCC's -Wmaybe-uninitialized cannot see
  // that the first block always comes (a warning in users' -O0 -Wall builds, which compile the
  // kernels at -O2).
  Vec<T> acc[R][V] = {};
  HalvesLeaves leaves(depth, halves);
  index_t p0 = 0;
  index_t p1 = 0;
  int merges = 0;
  int kept = 0;
  for (bool more = leaves.next(p0, p1, merges); more;) {
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[i][j] = Vec<T>{};
    }
    const T* bp = b + p0 * ldb;
    if (cols == V * L) {
      // Four k per trip: AVX2's tile has 12 FMAs a k, and the loop's own 3 additions and branch
      // each k share ports with them (256-bit FMAs issue on 2 ports, 512-bit ones on another as
      // well). Xeon, fastest iteration: AVX2's tile alone from 94-95 to 95.5 % of the peak, its
      // products from 90.3-90.9 to 92.6-94.2 %; AVX-512's products 0.3-1 % faster. The same sums.
#pragma GCC unroll 4
      for (index_t p = p0; p < p1; ++p, bp += ldb) tile_step<false, V, R, T>(acc, ar, p, bp, cols);
    } else {
      for (index_t p = p0; p < p1; ++p, bp += ldb) tile_step<true, V, R, T>(acc, ar, p, bp, cols);
    }
    for (; merges > 0; --merges) {
      const T* left = partials + --kept * R * V * L;
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j) acc[i][j] = load(left + (i * V + j) * L) + acc[i][j];
      }
    }
    more = leaves.next(p0, p1, merges);
    if (more) {
      T* left = partials + kept++ * R * V * L;
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j) store<T>(left + (i * V + j) * L, acc[i][j]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i, c += ldc) {
    if (i >= rows) continue;
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {
      const int count = std::min(L, cols - j * L);
      if (count <= 0) continue;
      Vec<T> v = acc[i][j];
      if (count == L) {
        if (!first) v += load(c + j * L);
        if (last) {
          if (bias != nullptr) v += load(bias + j * L);
          apply_all<Vec<T>, Fns...>(v);
        }
        store<T>(c + j * L, v);
      } else {
        if (!first) v += load_first(c + j * L, count);
        if (last) {
          if (bias != nullptr) v += load_first(bias + j * L, count);
          apply_all<Vec<T>, Fns...>(v);
        }
        store_first<T>(c + j * L, v, count);
      }
    }
  }
}

// A panel that one vector holds (gemm_kn's product with few columns, the last panel of a
// layer whose outputs are not a multiple of W) takes a tile of one vector, whose others' FMAs
// would be wasted, and twice the rows (3-10 % faster than MR rows on 10 outputs). It loads a
// value of A for every FMA, which bounds it; gemm's narrow layers take dot_product instead.
template <class T>
int tile_rows(int cols) {
  return NV > 1 && cols <= lanes<T> ? 2 * MR : MR;
}

// The last tile of an M block that holds at most short_rows rows takes a tile of that height:
// batch 64 ends on 4 rows, and the 6-row tile spent the time of 66 rows on them (3 % of the
// product); the 4-row tile ran the seed's 784 x 512 and 512 x 512 layers at batch 64 from 93-94
// to 96-97 % of the FMA peak (Xeon, AVX-512). Every sum is the same chain in either tile.
inline constexpr int short_rows = MR * 2 / 3;

template <class T, class... Fns>
void tile_of(int cols, index_t depth, bool halves, T* partials, const T* a, index_t lda, int rows, const T* b,
             index_t ldb, T* c, index_t ldc, bool first, bool last, const T* bias) {
  if (NV > 1 && cols <= lanes<T>) {
    tile<T, 1, 2 * MR, Fns...>(depth, halves, partials, a, lda, rows, b, ldb, cols, c, ldc, first, last, bias);
  } else if (rows <= short_rows) {
    tile<T, NV, short_rows, Fns...>(depth, halves, partials, a, lda, rows, b, ldb, cols, c, ldc, first, last, bias);
  } else {
    tile<T, NV, MR, Fns...>(depth, halves, partials, a, lda, rows, b, ldb, cols, c, ldc, first, last, bias);
  }
}

// The partial sums a tile keeps for a sum in halves over depth k, as elements.
template <class T>
index_t tile_partials(bool halves, index_t depth) {
  return halves ? halves_depth(depth) * std::max(NV, 2) * MR * lanes<T> : 0;
}

// Where the blocked product reads B's K block [k0, k0 + depth) of the panel at column j0 from,
// as rows ldb apart: B stored as [k, n], read in place; or a weight [n, k], from its
// PackedWeight or packed into the thread's scratch (each panel [k, W], the weight transposed).
template <class T>
struct PanelSource {
  const T* b;
  index_t n;
  index_t k;
  bool kn;                           // b is [k, n]
  const PackedWeight<T>* packed;     // b is [n, k], packed beforehand
  T* scratch;                        // b is [n, k], packed here, panel by panel

  std::pair<const T*, index_t> block(index_t j0, index_t k0, index_t depth, int cols) const {
    constexpr index_t W = NV * lanes<T>;
    if (kn) return {b + k0 * n + j0, n};
    if (packed != nullptr) return {packed->panel(j0, k0), W};
    transpose_step(Target{}, b + j0 * k + k0, k, cols, depth, scratch, W);
    return {scratch, W};
  }
};

// Panels [p0, p1) of C (columns p0·W .. p1·W, W = NV·L), every row: the blocked product's work
// for one thread. Each element is one chain of FMAs in the order of k within a K block, the
// blocks added to C in order, whatever the thread, tile or m; or, in halves, one K block
// summed as halves.hpp says. A K block keeps a panel's rows of B (kc x W) in L2 across the M
// block's tiles, and an M block keeps A's rows (mc x k) in half of it; C's panel of the M block
// stays there across the K blocks.
template <class T, class... Fns>
void gemm_panels(index_t p0, index_t p1, const T* a, index_t m, index_t k, const PanelSource<T>& source, index_t n,
                 const T* bias, T* c, bool accumulate, bool halves, T* partials, index_t kc, index_t mc) {
  constexpr index_t W = NV * lanes<T>;
  const index_t n1 = std::min(n, p1 * W);
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = p0 * W; j0 < n1; j0 += W) {
      const int cols = static_cast<int>(std::min(W, n - j0));
      const int rows = tile_rows<T>(cols);
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const auto [bp, ldb] = source.block(j0, k0, depth, cols);
        for (index_t i0 = m0; i0 < m1; i0 += rows) {
          tile_of<T, Fns...>(cols, depth, halves, partials, a + i0 * k + k0, k,
                             static_cast<int>(std::min<index_t>(rows, m1 - i0)), bp, ldb, c + i0 * n + j0, n,
                             k0 == 0 && !accumulate, k0 + depth == k, bias == nullptr ? nullptr : bias + j0);
        }
      }
    }
  }
}

// The product on as many threads as it can use (threads.hpp), each taking whole panels of
// columns, so that every element of C is summed by the same code in the same order whatever
// the number of threads. In halves the K extent is one block, whose halves are then the same
// at every k.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, PanelSource<T> source, index_t n, const T* bias, T* c,
                  bool accumulate, bool halves) {
  constexpr index_t W = NV * lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = halves ? k : balanced_block(k, panel_block_bytes / (W * size), 1);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, m_block_bytes() / (k * size)), MR);
  const index_t panels = (n + W - 1) / W;
  const int threads = ::duet::detail::useful_threads(m * n * k, panels);
  const bool packs = !source.kn && source.packed == nullptr;
  const index_t packing_elements = packs ? kc * W : 0;
  const index_t scratch_elements = packing_elements + tile_partials<T>(halves, kc);
  ::duet::detail::Storage scratch(static_cast<std::size_t>(threads * scratch_elements * size));
  T* scratch_of_all = reinterpret_cast<T*>(scratch.data());
  ::duet::detail::parallel_blocks(panels, threads, [&](index_t p0, index_t p1, int slot) {
    PanelSource<T> own = source;
    T* mine = scratch_of_all + slot * scratch_elements;
    own.scratch = mine;
    gemm_panels<T, Fns...>(p0, p1, a, m, k, own, n, bias, c, accumulate, halves, mine + packing_elements, kc, mc);
  });
}

// The entry points gemm(), gemm_kn() and PackedWeight dispatch to (with_kernels in gemm.hpp).
// Defined outside the class, so that they are not inline: a program built with
// DUET_PRECOMPILED_KERNELS declares them extern (duet/precompiled_kernels.hpp), and an inline
// function would be compiled again wherever it is called.
struct Kernels {
  template <class T>
  static constexpr int panel_width_of = NV * lanes<T>;

  template <class T, class... Fns>
  static void gemv_rows(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c);

  template <class T, class... Fns>
  static void blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                      const PackedWeight<T>* packed);

  template <class T, class... Fns>
  static void narrow(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c);

  template <class T>
  static void blocked_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate, bool halves);

  // Every panel of b ([n, k]) into dst, transposed: panel p, [k, W], at p·k·W.
  template <class T>
  static void pack(const T* b, index_t n, index_t k, T* dst);
};

template <class T, class... Fns>
void Kernels::gemv_rows(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
  for (index_t i = 0; i < m; ++i) gemv<T, Fns...>(a + i * k, k, b, n, bias, c + i * n);
}

template <class T, class... Fns>
void Kernels::blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                      const PackedWeight<T>* packed) {
  gemm_blocked<T, Fns...>(a, m, k, PanelSource<T>{b, n, k, false, packed, nullptr}, n, bias, c, false, false);
}

template <class T, class... Fns>
void Kernels::narrow(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
  dot_product(a, m, k, b, n, bias, c);
  if constexpr (sizeof...(Fns) > 0) epilogue<T, Fns...>(c, m, n);
}

template <class T>
void Kernels::blocked_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate, bool halves) {
  gemm_blocked<T>(a, m, k, PanelSource<T>{b, n, k, true, nullptr, nullptr}, n, nullptr, c, accumulate, halves);
}

template <class T>
void Kernels::pack(const T* b, index_t n, index_t k, T* dst) {
  constexpr index_t W = NV * lanes<T>;
  for (index_t j0 = 0; j0 < n; j0 += W)
    transpose_step(Target{}, b + j0 * k, k, std::min(W, n - j0), k, dst + j0 * k, W);
}
