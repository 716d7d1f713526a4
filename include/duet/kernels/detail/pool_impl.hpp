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

// Max pooling (Forward: y, the windows' maxima) or its gradient (dx from dy), any window at
// column stride S (1 or 2) whose rows, padded, fit the buffer (max_pool_takes,
// kernels/pool.hpp). Output row by output row: the window's rows of the input are copied into
// the buffer between -inf's standing for the padding, which neither changes a maximum nor is
// ever taken (every window's search begins at its first tap inside the input, with -inf as the
// maximum so far), so that a vector of L windows reads each tap with one load (S = 1) or two
// and a shuffle (S = 2), border windows included. All the rows are copied before the search
// reads them: a load that straddles stores still in flight waits for them, a quarter of the
// gradient's time when each row was copied just before its taps. The gradient's tap is its
// offset k · W + kw from the window's first row inside the input, held as a T (exact), then
// turned into its element's place; each dy goes there in output order, and an input row is
// zeroed just before the first output row whose windows reach it.
template <int S, bool Forward, class T>
void max_pool_rows(const T* dy, const T* x, const PoolShape& s, T* out) {
  constexpr int L = lanes<T>;
  constexpr auto all = std::make_integer_sequence<int, L>{};
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  const index_t chunks = (s.OW + L - 1) / L;
  const index_t row_length = S * chunks * L + s.KW;  // of a row in the buffer, as far as the taps read
  const index_t copied = std::min(s.W, row_length - s.pad_left);
  alignas(64) T rows[max_pool_buffer];
  alignas(64) T place[max_pool_buffer];
  for (index_t k = 0; k < s.KH; ++k) {
    std::fill(rows + k * row_length, rows + k * row_length + s.pad_left, minus_inf);
    std::fill(rows + k * row_length + s.pad_left + copied, rows + (k + 1) * row_length, minus_inf);
  }
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
      for (index_t k = 0; k < hi - lo; ++k) {
        const T* source = xp + (first + lo + k) * s.W;
        T* target = rows + k * row_length + s.pad_left;
        for (index_t j = 0; j < copied; j += L) {
          const auto n = static_cast<int>(std::min<index_t>(L, copied - j));
          if (n == L)
            store<T>(target + j, load(source + j));
          else
            store_first<T>(target + j, load_first(source + j, n), n);
        }
      }
      for (index_t c = 0; c < chunks; ++c) {
        // Window ow's first tap inside the input: column pad_left - ow · S of row 0 where the
        // window begins in the padding, else 0.
        const Vec<T> column = splat(static_cast<T>(c * L * S)) + lane_index<T>() * splat(T(S));
        const Vec<T> start = splat(static_cast<T>(s.pad_left)) - column;
        Vec<T> m = splat(minus_inf);
        Vec<T> at = start > Vec<T>{} ? start : Vec<T>{};
        for (index_t k = 0; k < hi - lo; ++k) {
          const T* taps = rows + k * row_length + S * c * L;
          Vec<T> offset = splat(static_cast<T>(k * s.W));
          for (index_t kw = 0; kw < s.KW; ++kw) {
            Vec<T> v;
            if constexpr (S == 1)
              v = load(taps + kw);
            else
              v = left_taps<T>(load(taps + kw), load(taps + kw + L), all);
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
        if constexpr (Forward) {
          T* y = out + (p * s.OH + oh) * s.OW + c * L;
          if (c * L + L <= s.OW)
            store<T>(y, m);
          else
            store_first<T>(y, m, static_cast<int>(s.OW - c * L));
        } else {
          store<T>(place + c * L, at + column);
        }
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
