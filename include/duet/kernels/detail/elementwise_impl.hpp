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

template <class T>
void tanh_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, tanh<T>(load_lanes(x + i, count)), count);
  }
}

template <class T>
void sigmoid_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, sigmoid<T>(load_lanes(x + i, count)), count);
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

// sums[j] (+)= Σ_r x[r, j] over cols columns of rows ld apart, a vector of columns at a time down
// the rows: x₀ + ((x₁ + x₂) + (x₃ + x₄)) + ..., the rows past the last group of four one by one. The
// groups keep two additions in flight; the order is the same for every column and set.
template <class T>
void column_sums_step(Target, const T* x, index_t rows, index_t cols, index_t ld, T* sums, bool accumulate) {
  const index_t groups_end = (rows - 1) & ~index_t{3};
  for (index_t j = 0; j < cols; j += lanes<T>) {
    const int count = lanes_from<T>(j, cols);
    const T* column = x + j;
    Vec<T> s = load_lanes(column, count);
    index_t r = 1;
    for (; r < groups_end; r += 4) {
      s = s + ((load_lanes(column + r * ld, count) + load_lanes(column + (r + 1) * ld, count)) +
               (load_lanes(column + (r + 2) * ld, count) + load_lanes(column + (r + 3) * ld, count)));
    }
    for (; r < rows; ++r) s = s + load_lanes(column + r * ld, count);
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
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> v = load_lanes(x + i, count);
    apply_all<Vec<T>, Fns...>(v);
    store_lanes<T>(y + i, v, count);
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
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> d = load_lanes(dy + i, count);
    Fn::grad_in_place(d, load_lanes(y + i, count));
    store_lanes<T>(dx + i, d, count);
  }
}
