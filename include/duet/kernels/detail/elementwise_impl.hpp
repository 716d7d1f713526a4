// One instruction set's elementwise kernels (kernels/elementwise.hpp), written on its Vec<T>,
// load, store, load_first, store_first, exp and the reductions of simd/detail/math.hpp. No
// include guard and no includes: elementwise.hpp includes it once per set, inside that set's
// namespace and target region.

// The lanes of a row of n from i on: a whole vector, or the tail, whose load reads nothing
// past n and holds zero in the lanes past it. (Plain loops over these, not a helper taking a
// lambda: GCC does not give a lambda the target of its region.)
template <class T>
int lanes_from(index_t i, index_t n) {
  return n - i < lanes<T> ? static_cast<int>(n - i) : lanes<T>;
}

template <class T>
Vec<T> load_lanes(const T* x, int count) {
  return count == lanes<T> ? load(x) : load_first(x, count);
}

template <class T>
void store_lanes(T* y, Vec<T> v, int count) {
  if (count == lanes<T>) store<T>(y, v);
  else store_first<T>(y, v, count);
}

template <class T>
void exp_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, exp<T>(load_lanes(x + i, count)), count);
  }
}

// x σ(a) = x / (1 + e^-a), and its derivative σ(a) + x a' σ(a) (1 - σ(a)) as
// (1 + x a' (1 - σ(a))) / (1 + e^-a), 1 - σ(a) as e^-a / (1 + e^-a): written as quotients, they
// keep their digits where σ(a) is subnormal (a below -87 for float) but the result is not, and
// where σ(a) is near 1. a is overwritten.
template <int N, class T>
void times_sigmoid(Vec<T> (&x)[N], Vec<T> (&a)[N]) {
  DUET_EACH_VECTOR(j) a[j] = -a[j];
  exp<N, T>(a);
  DUET_EACH_VECTOR(j) x[j] = x[j] / (T(1) + a[j]);
}
template <int N, class T>
void times_sigmoid_derivative(Vec<T> (&x)[N], Vec<T> (&a)[N], const Vec<T> (&da)[N]) {
  DUET_EACH_VECTOR(j) a[j] = -a[j];
  exp<N, T>(a);
  DUET_EACH_VECTOR(j) {
    const Vec<T> e = a[j];
    const Vec<T> complement = e < std::numeric_limits<T>::infinity() ? e / (T(1) + e) : splat(T(1));
    x[j] = (T(1) + x[j] * da[j] * complement) / (T(1) + e);
  }
}

// An activation (kernels::Activation) on N vectors, for code written once outside the sets
// (kernels::activation, N = 1) and for map_step (N = 8). Never inlined, and by reference: its
// arithmetic is compiled once per set, type and N, so a map of one function, a chain of them
// and a single value get the same bits whatever arithmetic surrounds the call (a compiler
// contracts a·b + c across inlined code).
template <Activation F, int N, class T>
[[gnu::noinline, gnu::flatten]] void activation_step(Target, Vec<T> (&v)[N]) {
  // GELU's tanh form: 0.5 (1 + tanh u) is σ(2u), u = √(2/π) (x + 0.044715 x³).
  constexpr T two_sqrt_2_over_pi = T(1.59576912160573071176);
  constexpr T cubic = T(0.044715);
  Vec<T> a[N];
  if constexpr (F == Activation::exp) {
    // Subnormal results count as zero, as fn::exp_array's (and the optimisers') do.
    DUET_EACH_VECTOR(j) a[j] = v[j];
    exp<N, T>(a);
    DUET_EACH_VECTOR(j) v[j] = v[j] < lowest_normal_exponent<T> ? Vec<T>{} : a[j];
  } else if constexpr (F == Activation::sigmoid) {
    sigmoid<N, T>(v);
  } else if constexpr (F == Activation::tanh) {
    tanh<N, T>(v);
  } else if constexpr (F == Activation::silu) {
    DUET_EACH_VECTOR(j) a[j] = v[j];
    times_sigmoid<N, T>(v, a);
  } else if constexpr (F == Activation::silu_derivative) {
    Vec<T> one[N];
    DUET_EACH_VECTOR(j) a[j] = v[j], one[j] = splat(T(1));
    times_sigmoid_derivative<N, T>(v, a, one);
  } else if constexpr (F == Activation::gelu) {
    normal_cdf<N, T>(v, a);
    DUET_EACH_VECTOR(j) v[j] = v[j] * a[j];
  } else if constexpr (F == Activation::gelu_derivative) {
    // Φ(x) + x φ(x), φ(x) = e^(-x²/2) / √(2π).
    Vec<T> phi[N];
    normal_cdf<N, T>(v, a);
    DUET_EACH_VECTOR(j) phi[j] = T(-0.5) * v[j] * v[j];
    exp<N, T>(phi);
    DUET_EACH_VECTOR(j) v[j] = a[j] + T(0.39894228040143267794) * v[j] * phi[j];
  } else if constexpr (F == Activation::gelu_tanh) {
    DUET_EACH_VECTOR(j) a[j] = two_sqrt_2_over_pi * (v[j] + cubic * v[j] * v[j] * v[j]);
    times_sigmoid<N, T>(v, a);
  } else if constexpr (F == Activation::gelu_tanh_derivative) {
    Vec<T> da[N];
    DUET_EACH_VECTOR(j) {
      const Vec<T> x2 = v[j] * v[j];
      a[j] = two_sqrt_2_over_pi * (v[j] + cubic * x2 * v[j]);
      da[j] = two_sqrt_2_over_pi * (T(1) + T(3) * cubic * x2);
    }
    times_sigmoid_derivative<N, T>(v, a, da);
  } else if constexpr (F == Activation::erf) {
    erf<N, T>(v);
  } else if constexpr (F == Activation::erf_derivative) {
    // 2 / √π e^(-x²).
    DUET_EACH_VECTOR(j) a[j] = -(v[j] * v[j]);
    exp<N, T>(a);
    DUET_EACH_VECTOR(j) v[j] = T(1.12837916709551257390) * a[j];
  }
}

// The same on one value, in lane 0: the bits of any lane of activation_step.
template <Activation F, class T>
T activation_value(Target, T x) {
  Vec<T> v[1] = {splat(x)};
  activation_step<F, 1, T>(Target{}, v);
  return v[0][0];
}

// y[i] = F(x[i]), eight vectors at a time, then the rest one at a time (the last masked).
template <Activation F, class T>
void activation_map_step(Target, const T* x, index_t n, T* y) {
  constexpr int group = 8;  // measured on Zen 5: GELU 76 us on [256, 512] four at a time, 42 eight
  index_t i = 0;
  for (; i + group * lanes<T> <= n; i += group * lanes<T>) {
    Vec<T> v[group];
    for (int j = 0; j < group; ++j) v[j] = load(x + i + j * lanes<T>);
    activation_step<F, group, T>(Target{}, v);
    for (int j = 0; j < group; ++j) store<T>(y + i + j * lanes<T>, v[j]);
  }
  for (; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> v[1] = {load_lanes(x + i, count)};
    activation_step<F, 1, T>(Target{}, v);
    store_lanes<T>(y + i, v[0], count);
  }
}

template <class T>
void scale_step(Target, const T* x, index_t n, T a, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, a * load_lanes(x + i, count), count);
  }
}

template <class T>
T sum_step(Target, const T* x, index_t n) {
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) s += load_lanes(x + i, lanes_from<T>(i, n));
  return reduce_lanes<false, T>(s);
}

// Σ_r x[r, j] for r in [r0, r1), a vector of columns at once: x₀ + ((x₁ + x₂) + (x₃ + x₄)) + ...,
// the rows past the last group of four one by one. The groups keep two additions in flight.
template <class T>
Vec<T> column_run(const T* column, index_t r0, index_t r1, index_t ld, int count) {
  const index_t groups_end = r0 + ((r1 - r0 - 1) & ~index_t{3});
  Vec<T> s = load_lanes(column + r0 * ld, count);
  index_t r = r0 + 1;
  for (; r < groups_end; r += 4) {
    s = s + ((load_lanes(column + r * ld, count) + load_lanes(column + (r + 1) * ld, count)) +
             (load_lanes(column + (r + 2) * ld, count) + load_lanes(column + (r + 3) * ld, count)));
  }
  for (; r < r1; ++r) s = s + load_lanes(column + r * ld, count);
  return s;
}

// sums[j] (+)= Σ_r x[r, j] over cols columns of rows ld apart, in halves (halves.hpp), each
// leaf a column_run; the order is the same for every column and set.
template <class T>
void column_sums_step(Target, const T* x, index_t rows, index_t cols, index_t ld, T* sums, bool accumulate) {
  for (index_t j = 0; j < cols; j += lanes<T>) {
    const int count = lanes_from<T>(j, cols);
    Vec<T> left[halves_levels];
    int kept = 0;
    Vec<T> s{};
    HalvesLeaves leaves(rows, true);
    index_t r0 = 0;
    index_t r1 = 0;
    int merges = 0;
    for (bool more = leaves.next(r0, r1, merges); more;) {
      s = column_run(x + j, r0, r1, ld, count);
      for (; merges > 0; --merges) s = left[--kept] + s;
      more = leaves.next(r0, r1, merges);
      if (more) left[kept++] = s;
    }
    if (accumulate) s = load_lanes(sums + j, count) + s;
    store_lanes<T>(sums + j, s, count);
  }
}

template <class T>
T log_sum_exp_step(Target, const T* x, index_t n) {
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  Vec<T> top = splat(lowest);
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    top = max<T>(top, first_or<T>(load_lanes(x + i, count), count, lowest));
  }
  const T m = reduce_lanes<true, T>(top);
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += first_or<T>(exp<T>(load_lanes(x + i, count) - m), count, T(0));
  }
  return m + std::log(reduce_lanes<false, T>(s));
}

template <class T>
T cross_entropy_step(Target, const T* z, const T* p, index_t n, T lse) {
  Vec<T> s{};
  // Past n, p's lanes are zero, and so is what they add.
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += load_lanes(p + i, count) * (lse - load_lanes(z + i, count));
  }
  return reduce_lanes<false, T>(s);
}

template <class T>
void softmax_grad_step(Target, const T* z, index_t n, T lse, index_t label, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    const Vec<T> one_hot = lane_index<T>() == static_cast<T>(label - i) ? splat(T(1)) : Vec<T>{};
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) - one_hot) * scale, count);
  }
}

template <class T>
void softmax_grad_step(Target, const T* z, const T* p, index_t n, T lse, T mass, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) * mass - load_lanes(p + i, count)) * scale, count);
  }
}

template <class T, class... Fns>
void map_step(Target, const T* x, index_t n, T* y) {
  if constexpr (sizeof...(Fns) == 1 && (requires { Fns::kernel_activation; } && ...)) {
    activation_map_step<Fns::kernel_activation..., T>(Target{}, x, n, y);
  } else {
    for (index_t i = 0; i < n; i += lanes<T>) {
      const int count = lanes_from<T>(i, n);
      Vec<T> v = load_lanes(x + i, count);
      apply_all<Vec<T>, Fns...>(v);
      store_lanes<T>(y + i, v, count);
    }
  }
}

// out[i] = Fn(a[i], b[i]); an input that does not run (ARuns, BRuns false) is its first element
// at every i.
template <class T, class Fn, bool ARuns, bool BRuns>
void binary_step(Target, const T* a, const T* b, index_t n, T* out) {
  const Vec<T> a0 = splat(*a);
  const Vec<T> b0 = splat(*b);
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> v = ARuns ? load_lanes(a + i, count) : a0;
    Fn::apply_in_place(v, BRuns ? load_lanes(b + i, count) : b0);
    store_lanes<T>(out + i, v, count);
  }
}

// y[r, j] = x[r, j] + bias[j], rows of cols.
template <class T>
void add_bias_step(Target, const T* x, index_t rows, index_t cols, const T* bias, T* y) {
  for (index_t r = 0; r < rows; ++r, x += cols, y += cols) {
    for (index_t j = 0; j < cols; j += lanes<T>) {
      const int count = lanes_from<T>(j, cols);
      store_lanes<T>(y + j, load_lanes(x + j, count) + load_lanes(bias + j, count), count);
    }
  }
}

template <class T, class Fn>
void map_grad_step(Target, const T* dy, const T* y, index_t n, T* dx) {
  index_t i = 0;
  if constexpr (requires { Fn::kernel_derivative; }) {
    // dy times the derivative kernels::activation computes from the input (y here), as
    // Fn::grad_in_place does, eight vectors at a time (activation_map_step).
    constexpr int group = 8;
    for (; i + group * lanes<T> <= n; i += group * lanes<T>) {
      Vec<T> d[group];
      for (int j = 0; j < group; ++j) d[j] = load(y + i + j * lanes<T>);
      activation_step<Fn::kernel_derivative, group, T>(Target{}, d);
      for (int j = 0; j < group; ++j) store<T>(dx + i + j * lanes<T>, load(dy + i + j * lanes<T>) * d[j]);
    }
  }
  for (; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> d = load_lanes(dy + i, count);
    Fn::grad_in_place(d, load_lanes(y + i, count));
    store_lanes<T>(dx + i, d, count);
  }
}
