// One instruction set's optimiser updates (kernels/optim.hpp), written on its Vec<T>, load,
// store, load_first, store_first and sqrt (simd/arch.hpp). No include guard and no includes:
// optim.hpp includes it once per set (per_isa.hpp), inside that set's namespace and target
// region, which fuses no a·b + c (simd/arch.hpp).

// Adam on one vector of values, as the scalar formula writes it (AdamCoefficients).
template <class T>
[[gnu::always_inline]] inline void adam_lanes(Vec<T>& p, Vec<T> g, Vec<T>& m, Vec<T>& v, const AdamCoefficients<T>& c) {
  const Vec<T> grad = g + c.l2 * p;
  m = c.beta1 * m + (T(1) - c.beta1) * grad;
  v = c.beta2 * v + (T(1) - c.beta2) * grad * grad;
  p = p * c.decay - c.step * m / (sqrt<T>(v) + c.eps);
}

template <class T>
void adam_step(Target, T* p, const T* g, T* m, T* v, index_t n, const AdamCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    Vec<T> mv = load(m + i);
    Vec<T> vv = load(v + i);
    adam_lanes<T>(pv, load(g + i), mv, vv, c);
    store<T>(p + i, pv);
    store<T>(m + i, mv);
    store<T>(v + i, vv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    Vec<T> mv = load_first(m + i, rest);
    Vec<T> vv = load_first(v + i, rest);
    adam_lanes<T>(pv, load_first(g + i, rest), mv, vv, c);
    store_first<T>(p + i, pv, rest);
    store_first<T>(m + i, mv, rest);
    store_first<T>(v + i, vv, rest);
  }
}

// SGD on one vector of values (SgdCoefficients); buf is untouched without momentum.
template <class T>
[[gnu::always_inline]] inline void sgd_lanes(Vec<T>& p, Vec<T> g, Vec<T>& buf, const SgdCoefficients<T>& c) {
  const Vec<T> d = g + c.weight_decay * p;
  if (!c.with_momentum) {
    p -= c.learning_rate * d;
    return;
  }
  buf = c.first_step ? d : c.momentum * buf + c.keep * d;
  p -= c.learning_rate * (c.nesterov ? d + c.momentum * buf : buf);
}

template <class T>
void sgd_step(Target, T* p, const T* g, T* buf, index_t n, const SgdCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  Vec<T> bv{};
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    if (c.with_momentum) bv = load(buf + i);
    sgd_lanes<T>(pv, load(g + i), bv, c);
    store<T>(p + i, pv);
    if (c.with_momentum) store<T>(buf + i, bv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    if (c.with_momentum) bv = load_first(buf + i, rest);
    sgd_lanes<T>(pv, load_first(g + i, rest), bv, c);
    store_first<T>(p + i, pv, rest);
    if (c.with_momentum) store_first<T>(buf + i, bv, rest);
  }
}
