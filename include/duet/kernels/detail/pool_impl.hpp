// One instruction set's max pooling over 2x2 windows at stride 2 (kernels/pool.hpp), written on
// the set's Vec<T>, lanes<T>, load, store and splat. No include guard and no includes: pool.hpp
// includes it once per set, inside that set's namespace and target region.

// The left (even) or right (odd) element of each of the L windows of two that 2L consecutive
// values, a then b, hold; and back: the 2L values from the left and right elements.
template <class T, int... I>
Vec<T> left_taps(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, (2 * I)...);
}
template <class T, int... I>
Vec<T> right_taps(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, (2 * I + 1)...);
}
template <class T, int... I>
Vec<T> pairs_low(Vec<T> left, Vec<T> right, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(left, right, (I % 2 * lanes<T> + I / 2)...);
}
template <class T, int... I>
Vec<T> pairs_high(Vec<T> left, Vec<T> right, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(left, right, (I % 2 * lanes<T> + (lanes<T> + I) / 2)...);
}

// The lanes of 2n consecutive values from p: whole vectors, or the first n of them (zero after).
template <class T>
void load_pairs(const T* p, index_t n, Vec<T>& a, Vec<T>& b) {
  constexpr int L = lanes<T>;
  if (n == L) {
    a = load(p);
    b = load(p + L);
  } else {
    const auto count = static_cast<int>(2 * n);
    a = load_first(p, std::min(count, L));
    b = count > L ? load_first(p + L, count - L) : Vec<T>{};
  }
}

template <class T>
void store_pairs(T* p, index_t n, Vec<T> a, Vec<T> b) {
  constexpr int L = lanes<T>;
  if (n == L) {
    store<T>(p, a);
    store<T>(p + L, b);
  } else {
    const auto count = static_cast<int>(2 * n);
    store_first<T>(p, a, std::min(count, L));
    if (count > L) store_first<T>(p + L, b, count - L);
  }
}

// The four taps, in row-major order, of the n (at most L) windows from output column ow on.
template <class T>
struct Windows {
  Vec<T> tap[4];
  Windows(const T* row0, const T* row1, index_t n) {
    constexpr auto all = std::make_integer_sequence<int, lanes<T>>{};
    Vec<T> a0, b0, a1, b1;
    load_pairs(row0, n, a0, b0);
    load_pairs(row1, n, a1, b1);
    tap[0] = left_taps<T>(a0, b0, all);
    tap[1] = right_taps<T>(a0, b0, all);
    tap[2] = left_taps<T>(a1, b1, all);
    tap[3] = right_taps<T>(a1, b1, all);
  }
};

// The lanes where v takes over as the window's maximum from best: a larger value, or the first
// NaN (ops/pool.hpp's takes_max).
template <class T>
auto takes_max(Vec<T> v, Vec<T> best) {
  return (v > best) | ((v != v) & (best == best));
}

// ops/pool.hpp's rules: MaxPoolKind::combine (a NaN wins the forward's value) and takes_max
// (the first NaN, or else the first maximal tap, takes the gradient).
template <class T>
void max_pool_2x2_step(Target, const T* x, index_t planes, index_t H, index_t W, index_t OH, index_t OW, T* y) {
  constexpr int L = lanes<T>;
  for (index_t p = 0; p < planes; ++p) {
    for (index_t oh = 0; oh < OH; ++oh) {
      const T* row0 = x + (p * H + 2 * oh) * W;
      T* out = y + (p * OH + oh) * OW;
      for (index_t ow = 0; ow < OW; ow += L) {
        const index_t n = std::min<index_t>(L, OW - ow);
        const Windows<T> w(row0 + 2 * ow, row0 + W + 2 * ow, n);
        Vec<T> m = w.tap[0];
        for (int t = 1; t < 4; ++t) m = ((w.tap[t] > m) | (w.tap[t] != w.tap[t])) ? w.tap[t] : m;
        if (n == L) store<T>(out + ow, m);
        else store_first<T>(out + ow, m, static_cast<int>(n));
      }
    }
  }
}

template <class T>
void max_pool_2x2_backward_step(Target, const T* dy, const T* x, index_t planes, index_t H, index_t W, index_t OH,
                                index_t OW, T* dx) {
  constexpr int L = lanes<T>;
  constexpr auto all = std::make_integer_sequence<int, L>{};
  for (index_t p = 0; p < planes; ++p) {
    for (index_t oh = 0; oh < OH; ++oh) {
      const T* row0 = x + (p * H + 2 * oh) * W;
      T* d0 = dx + (p * H + 2 * oh) * W;
      const T* g = dy + (p * OH + oh) * OW;
      for (index_t ow = 0; ow < OW; ow += L) {
        const index_t n = std::min<index_t>(L, OW - ow);
        const Windows<T> w(row0 + 2 * ow, row0 + W + 2 * ow, n);
        Vec<T> best = w.tap[0];
        Vec<T> at{};
        for (int t = 1; t < 4; ++t) {
          const auto take = takes_max<T>(w.tap[t], best);
          best = take ? w.tap[t] : best;
          at = take ? splat(static_cast<T>(t)) : at;
        }
        // 0 + dy, as the general loop's sum onto a zero.
        const Vec<T> grad = Vec<T>{} + (n == L ? load(g + ow) : load_first(g + ow, static_cast<int>(n)));
        Vec<T> d[4];
        for (int t = 0; t < 4; ++t) d[t] = at == splat(static_cast<T>(t)) ? grad : Vec<T>{};
        store_pairs(d0 + 2 * ow, n, pairs_low<T>(d[0], d[1], all), pairs_high<T>(d[0], d[1], all));
        store_pairs(d0 + W + 2 * ow, n, pairs_low<T>(d[2], d[3], all), pairs_high<T>(d[2], d[3], all));
      }
      std::fill(d0 + 2 * OW, d0 + W, T(0));
      std::fill(d0 + W + 2 * OW, d0 + 2 * W, T(0));
    }
    std::fill(dx + (p * H + 2 * OH) * W, dx + (p + 1) * H * W, T(0));
  }
}

// A window's rows of the input at column stride S (1 or 2), copied into a buffer between
// fillers standing for the padding, so that a vector of L windows reads each tap with one load
// (S = 1) or two and a shuffle (S = 2), border windows included: max pooling's and the
// average's forward, output row by output row. All the rows are copied before the taps are
// read: a load that straddles stores still in flight waits for them, a quarter of max
// pooling's gradient's time when each row was copied just before its taps.
template <int S, class T>
struct PaddedRows {
  static constexpr int L = lanes<T>;
  const PoolShape& s;
  index_t chunks;  // of L output columns
  index_t length;  // of a row in the buffer, as far as the taps read
  index_t copied;  // columns of the input in a row
  T* rows;         // KH x length

  PaddedRows(const PoolShape& shape, T filler, T* buffer)
      : s(shape),
        chunks((s.OW + L - 1) / L),
        length(S * chunks * L + s.KW),
        copied(std::min(s.W, length - s.pad_left)),
        rows(buffer) {
    for (index_t k = 0; k < s.KH; ++k) {
      std::fill(rows + k * length, rows + k * length + s.pad_left, filler);
      std::fill(rows + k * length + s.pad_left + copied, rows + (k + 1) * length, filler);
    }
  }

  // Input rows [from, from + count) of plane xp into the buffer's rows 0, 1, ...
  void copy(const T* xp, index_t from, index_t count) {
    for (index_t k = 0; k < count; ++k) {
      const T* source = xp + (from + k) * s.W;
      T* target = rows + k * length + s.pad_left;
      for (index_t j = 0; j < copied; j += L) {
        const auto n = static_cast<int>(std::min<index_t>(L, copied - j));
        if (n == L)
          store<T>(target + j, load(source + j));
        else
          store_first<T>(target + j, load_first(source + j, n), n);
      }
    }
  }

  // Tap (k, kw) of the L windows of chunk c: buffer row k.
  Vec<T> tap(index_t k, index_t c, index_t kw) const {
    const T* taps = rows + k * length + S * c * L + kw;
    if constexpr (S == 1)
      return load(taps);
    else
      return left_taps<T>(load(taps), load(taps + L), std::make_integer_sequence<int, L>{});
  }
};

// y (the first n of a vector) at out.
template <class T>
void store_outputs(T* out, Vec<T> y, index_t n) {
  if (n >= lanes<T>)
    store<T>(out, y);
  else
    store_first<T>(out, y, static_cast<int>(n));
}

// Max pooling (Forward: y, the windows' maxima) or its gradient (dx from dy), any window at
// column stride S (1 or 2) whose rows, padded, fit the buffer (pool_rows_take,
// kernels/pool.hpp), from PaddedRows with -inf standing for the padding, which neither changes
// a maximum nor is ever taken (every window's search begins at its first tap inside the input,
// with -inf as the maximum so far). The gradient's tap is its offset k · W + kw from the
// window's first row inside the input, held as a T (exact), then turned into its element's
// place; each dy goes there in output order, and an input row is zeroed just before the first
// output row whose windows reach it.
template <int S, bool Forward, class T>
void max_pool_rows(const T* dy, const T* x, const PoolShape& s, T* out) {
  constexpr int L = lanes<T>;
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  alignas(64) T buffer[pool_buffer];
  alignas(64) T place[pool_buffer];
  PaddedRows<S, T> rows(s, minus_inf, buffer);
  for (index_t p = 0; p < s.planes; ++p) {
    const T* xp = x + p * s.H * s.W;
    index_t zeroed = 0;  // rows of the plane's dx
    for (index_t oh = 0; oh < s.OH; ++oh) {
      const index_t first = oh * s.SH - s.pad_top;  // input row of window row 0
      const index_t lo = std::max<index_t>(0, -first);
      const index_t hi = std::min<index_t>(s.KH, s.H - first);
      if (!Forward && zeroed < first + hi) {
        std::fill(out + (p * s.H + zeroed) * s.W, out + (p * s.H + first + hi) * s.W, T(0));
        zeroed = first + hi;
      }
      rows.copy(xp, first + lo, hi - lo);
      for (index_t c = 0; c < rows.chunks; ++c) {
        // Window ow's first tap inside the input: column pad_left - ow · S of row 0 where the
        // window begins in the padding, else 0.
        const Vec<T> column = splat(static_cast<T>(c * L * S)) + lane_index<T>() * splat(T(S));
        const Vec<T> start = splat(static_cast<T>(s.pad_left)) - column;
        Vec<T> m = splat(minus_inf);
        Vec<T> at = start > Vec<T>{} ? start : Vec<T>{};
        for (index_t k = 0; k < hi - lo; ++k) {
          Vec<T> offset = splat(static_cast<T>(k * s.W));
          for (index_t kw = 0; kw < s.KW; ++kw) {
            const Vec<T> v = rows.tap(k, c, kw);
            if constexpr (Forward) {
              m = ((v > m) | (v != v)) ? v : m;
            } else {
              const auto take = takes_max<T>(v, m);
              m = take ? v : m;
              at = take ? offset : at;
              offset += splat(T(1));
            }
          }
        }
        if constexpr (Forward)
          store_outputs(out + (p * s.OH + oh) * s.OW + c * L, m, s.OW - c * L);
        else
          store<T>(place + c * L, at + column);
      }
      if constexpr (!Forward) {
        const index_t origin = (p * s.H + first + lo) * s.W - s.pad_left;  // of the places
        const T* g = dy + (p * s.OH + oh) * s.OW;
        for (index_t ow = 0; ow < s.OW; ++ow) out[origin + static_cast<index_t>(place[ow])] += g[ow];
      }
    }
    if constexpr (!Forward) std::fill(out + (p * s.H + zeroed) * s.W, out + (p + 1) * s.H * s.W, T(0));
  }
}

template <class T>
void max_pool_step(Target, const T* x, const PoolShape& s, T* y) {
  if (s.SW == 1)
    max_pool_rows<1, true>(static_cast<const T*>(nullptr), x, s, y);
  else
    max_pool_rows<2, true>(static_cast<const T*>(nullptr), x, s, y);
}

template <class T>
void max_pool_backward_step(Target, const T* dy, const T* x, const PoolShape& s, T* dx) {
  if (s.SW == 1)
    max_pool_rows<1, false>(dy, x, s, dx);
  else
    max_pool_rows<2, false>(dy, x, s, dx);
}

// The columns of output column ow's window inside the input, [begin, end).
inline std::pair<index_t, index_t> window_columns(const PoolShape& s, index_t ow) {
  const index_t c0 = ow * s.SW - s.pad_left;
  return {std::max<index_t>(0, c0), std::min(s.W, c0 + s.KW)};
}

// The divisors of an output row's averages, L at a time from output column c: the window's
// size if count_padding, else rows (of the window inside the input) times columns[ow] (its
// columns inside the input, as a T; exact, as their product).
template <class T>
Vec<T> average_counts(const PoolShape& s, bool count_padding, index_t rows, const T* columns, index_t c) {
  return count_padding ? splat(static_cast<T>(s.KH * s.KW)) : splat(static_cast<T>(rows)) * load(columns + c);
}

// columns[ow] of average_counts for output columns [0, n), 1 past OW.
template <class T>
void window_widths(const PoolShape& s, index_t n, T* columns) {
  for (index_t ow = 0; ow < n; ++ow) {
    const auto [begin, end] = window_columns(s, ow);
    columns[ow] = ow < s.OW ? static_cast<T>(end - begin) : T(1);
  }
}

// Average pooling's forward (kernels/pool.hpp's avg_pool) at column stride S, from PaddedRows
// with -0 standing for the padding: addition's identity to the bit, so that a window's sum
// from -0 over all its taps in row-major order is ops/pool.hpp's, from its first tap inside
// the input; then divided by its count.
template <int S, class T>
void avg_pool_rows(const T* x, const PoolShape& s, bool count_padding, T* y) {
  constexpr int L = lanes<T>;
  alignas(64) T buffer[pool_buffer];
  alignas(64) T columns[pool_buffer];
  PaddedRows<S, T> rows(s, -T(0), buffer);
  window_widths(s, rows.chunks * L, columns);
  for (index_t p = 0; p < s.planes; ++p) {
    const T* xp = x + p * s.H * s.W;
    for (index_t oh = 0; oh < s.OH; ++oh) {
      const index_t first = oh * s.SH - s.pad_top;
      const index_t lo = std::max<index_t>(0, -first);
      const index_t hi = std::min<index_t>(s.KH, s.H - first);
      rows.copy(xp, first + lo, hi - lo);
      for (index_t c = 0; c < rows.chunks; ++c) {
        Vec<T> sum = splat(-T(0));
        for (index_t k = 0; k < hi - lo; ++k) {
          for (index_t kw = 0; kw < s.KW; ++kw) sum += rows.tap(k, c, kw);
        }
        const Vec<T> count = average_counts(s, count_padding, hi - lo, columns, c * L);
        store_outputs(y + (p * s.OH + oh) * s.OW + c * L, sum / count, s.OW - c * L);
      }
    }
  }
}

template <class T>
void avg_pool_step(Target, const T* x, const PoolShape& s, bool count_padding, T* y) {
  if (s.SW == 1)
    avg_pool_rows<1>(x, s, count_padding, y);
  else
    avg_pool_rows<2>(x, s, count_padding, y);
}

// Average pooling's gradient (kernels/pool.hpp's avg_pool_backward) as a gather: dx row by dx
// row, N vectors of columns at a time, each element summed once in registers and stored once,
// where ops/pool.hpp's loops zero dx and then add dy / count into it window tap by window tap.
// The order of the additions is theirs, to the bit: from +0, the output rows whose windows
// reach the row in ascending order; for each, the windows inside the input's columns by their
// tap kw in ascending order, then the border's windows (meeting the padding) in ascending
// output column. For a vector of columns the inside windows' terms come from the output row's
// shares spread over input columns: share ow at column KW - 1 + ow · SW, -0 (addition's
// identity, to the bit) at every other, so tap kw of every column is one load, at any stride,
// the columns no window reaches with that tap adding -0. A border window adds its share to its
// own columns and -0 to the others, in the blocks of columns that hold the border's. The
// shares of a window's height of output rows and the next are kept, each made (divided) once,
// in a ring of KH + 1 by output row: made a row ahead, their stores are done before the loads
// of the first row that reads them, which otherwise waited for the scalar stores they straddle
// (three quarters of the time at 4 lanes, 28 columns and 3x3/2).
template <class T>
struct AvgPoolGradient {
  static constexpr int L = lanes<T>;
  const PoolShape& s;
  bool count_padding;
  InnerColumns inner;
  index_t share_length;   // of an output row, in whole vectors
  index_t spread_length;  // of an output row's shares spread over the input's columns, in whole vectors
  index_t left_end;       // columns [0, left_end) and [right_begin, W) meet border windows
  index_t right_begin;
  T* columns;    // of each window inside the input, as a T (1 past OW)
  index_t ring;  // rows
  T* shares;     // ring rows of share_length
  T* spread;     // ring rows of spread_length

  AvgPoolGradient(const PoolShape& shape, bool counts, T* buffer)
      : s(shape),
        count_padding(counts),
        inner(inner_columns(s.W, s.OW, s.KW, s.SW, s.pad_left)),
        share_length((s.OW + L - 1) / L * L),
        spread_length(((s.W + L - 1) / L * L + s.pad_left + s.KW - 1 + L - 1) / L * L),
        left_end(inner.begin > 0 ? window_columns(s, inner.begin - 1).second : 0),
        right_begin(inner.end < s.OW ? window_columns(s, inner.end).first : s.W),
        columns(buffer),
        ring(s.KH + 1),
        shares(columns + share_length),
        spread(shares + ring * share_length) {
    window_widths(s, share_length, columns);
  }

  // Output row oh's shares, from its dy (g), into the ring.
  void make_row(const T* g, index_t oh) {
    const index_t first = oh * s.SH - s.pad_top;
    const index_t rows = std::min(s.KH, s.H - first) - std::max<index_t>(0, -first);
    T* share = shares + oh % ring * share_length;
    for (index_t c = 0; c < share_length; c += L) {
      const Vec<T> count = average_counts(s, count_padding, rows, columns, c);
      const auto n = static_cast<int>(std::min<index_t>(L, s.OW - c));
      store<T>(share + c, (n == L ? load(g + c) : load_first(g + c, n)) / count);
    }
    T* row = spread + oh % ring * spread_length;
    for (index_t j = 0; j < spread_length; j += L) store<T>(row + j, splat(-T(0)));
    for (index_t ow = inner.begin; ow < inner.end; ++ow) row[s.KW - 1 + ow * s.SW] = share[ow];
  }

  // dx's columns [j, j + N · L) of a row that output rows [oh_begin, oh_end) reach, the first in
  // the ring's slot `slot`.
  template <int N>
  [[gnu::always_inline]] void gather(index_t oh_begin, index_t oh_end, index_t slot, index_t j, T* out) const {
    Vec<T> sum[N];
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) sum[n] = Vec<T>{};
    const bool borders = j < left_end || j + N * L > right_begin;
    for (index_t oh = oh_begin; oh < oh_end; ++oh, slot = slot + 1 == ring ? 0 : slot + 1) {
      const T* taps = spread + slot * spread_length + j + s.pad_left + s.KW - 1;
      for (index_t kw = 0; kw < s.KW; ++kw) {
#pragma GCC unroll 8
        for (int n = 0; n < N; ++n) sum[n] += load(taps - kw + n * L);
      }
      if (borders) {
        const T* share = shares + slot * share_length;
        for (index_t ow = 0; ow < inner.begin; ++ow) add_border<N>(sum, share[ow], ow, j);
        for (index_t ow = inner.end; ow < s.OW; ++ow) add_border<N>(sum, share[ow], ow, j);
      }
    }
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) store_outputs(out + j + n * L, sum[n], s.W - j - n * L);
  }

  template <int N>
  [[gnu::always_inline]] void add_border(Vec<T> (&sum)[N], T share, index_t ow, index_t j) const {
    const auto [begin, end] = window_columns(s, ow);
#pragma GCC unroll 8
    for (int n = 0; n < N; ++n) {
      const index_t first = j + n * L;
      if (begin < first + L && end > first) {
        const Vec<T> column = splat(static_cast<T>(first)) + lane_index<T>();
        const auto inside = (column >= splat(static_cast<T>(begin))) & (column < splat(static_cast<T>(end)));
        sum[n] += inside ? splat(share) : splat(-T(0));
      }
    }
  }
};

template <class T>
void avg_pool_backward_step(Target, const T* dy, const PoolShape& s, bool count_padding, T* dx) {
  constexpr int L = lanes<T>;
  alignas(64) T buffer[pool_buffer];
  AvgPoolGradient<T> gradient(s, count_padding, buffer);
  const index_t chunks = (s.W + L - 1) / L;
  for (index_t p = 0; p < s.planes; ++p) {
    const T* dyp = dy + p * s.OH * s.OW;
    T* dxp = dx + p * s.H * s.W;
    index_t made = 0;  // output rows whose shares are in the ring, one past those row r reads
    for (index_t r = 0; r < s.H; ++r) {
      // The output rows whose windows hold row r: [oh_begin, oh_end).
      const index_t oh_end = std::min(s.OH, (r + s.pad_top) / s.SH + 1);
      const index_t reach = r + s.pad_top - s.KH + 1;  // the first window row at or past it
      const index_t oh_begin = reach <= 0 ? 0 : (reach + s.SH - 1) / s.SH;
      for (; made < std::min(s.OH, oh_end + 1); ++made) gradient.make_row(dyp + made * s.OW, made);
      const index_t slot = oh_begin % gradient.ring;
      T* out = dxp + r * s.W;
      index_t c = 0;
      for (; c + 4 <= chunks; c += 4) gradient.template gather<4>(oh_begin, oh_end, slot, c * L, out);
      if (c + 2 <= chunks) {
        gradient.template gather<2>(oh_begin, oh_end, slot, c * L, out);
        c += 2;
      }
      if (c < chunks) gradient.template gather<1>(oh_begin, oh_end, slot, c * L, out);
    }
  }
}
