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
          const auto take = (w.tap[t] > best) | ((w.tap[t] != w.tap[t]) & (best == best));
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
