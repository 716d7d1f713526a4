#include "support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace tests_kernels_gemm {

using namespace duet;

namespace {

// Shapes across the kernel's boundaries: the vector width (2 to 16 lanes), groups of 4 k, tiles
// of 3 or 6 rows, K blocks (256 or 512) and M blocks (about 160 rows when K is 800).
struct Case {
  index_t m, k, n;
};

std::vector<Case> cases() {
  std::vector<Case> c = {{0, 7, 5},     {1, 1, 1},     {1, 784, 512}, {1, 17, 10},   {2, 3, 1},      {5, 16, 16},
                         {6, 64, 64},   {7, 65, 63},   {13, 257, 129}, {64, 784, 512}, {64, 512, 10}, {241, 255, 513},
                         {300, 129, 17}, {3, 800, 800}, {250, 1, 33},  {1, 800, 1}};
  std::mt19937 gen(42);
  // Random shapes, kept to about 20M multiply-adds each so the naive reference stays quick.
  while (c.size() < 60) {
    const auto m = static_cast<index_t>(gen() % 301);
    const auto k = static_cast<index_t>(1 + gen() % 800);
    const auto n = static_cast<index_t>(1 + gen() % 800);
    if (m * k * n <= 20'000'000) c.push_back({m, k, n});
  }
  return c;
}

template <class T>
std::vector<T> random_values(std::size_t count, std::mt19937& gen) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<T> v(count);
  for (T& x : v) x = static_cast<T>(u(gen));
  return v;
}

// a bᵀ in plain loops in double precision.
template <class T>
std::vector<double> naive_product(const T* a, index_t m, index_t k, const T* b, index_t n) {
  std::vector<double> c(static_cast<std::size_t>(m * n));
  for (index_t i = 0; i < m; ++i) {
    for (index_t j = 0; j < n; ++j) {
      double s = 0;
      for (index_t p = 0; p < k; ++p) s += static_cast<double>(a[i * k + p]) * static_cast<double>(b[j * k + p]);
      c[static_cast<std::size_t>(i * n + j)] = s;
    }
  }
  return c;
}

// The reference's epilogue on its product: the bias, then ReLU.
template <class T>
std::vector<double> epilogue(std::vector<double> c, index_t n, const T* bias, bool relu) {
  for (std::size_t i = 0; i < c.size(); ++i) {
    double& s = c[i];
    if (bias != nullptr) s += static_cast<double>(bias[i % static_cast<std::size_t>(n)]);
    if (relu && !std::isnan(s)) s = std::max(s, 0.0);
  }
  return c;
}

// One shape's operands and their product in double precision, made once and checked under
// every instruction set: the naive loops, run for each set and each epilogue, were most of
// these cases' time under the sanitizers. a begins one element into its buffer, so it is not
// aligned the way a tensor's first element is (a view need not be).
template <class T>
struct Problem {
  index_t m, k, n;
  std::vector<T> a_storage, b, bias;
  std::vector<double> product;
  const T* a() const { return a_storage.data() + 1; }
};

template <class T>
Problem<T> problem(index_t m, index_t k, index_t n, std::mt19937& gen) {
  Problem<T> p{m, k, n, random_values<T>(static_cast<std::size_t>(m * k + 1), gen),
               random_values<T>(static_cast<std::size_t>(n * k), gen), random_values<T>(static_cast<std::size_t>(n), gen), {}};
  p.product = naive_product(p.a(), m, k, p.b.data(), n);
  return p;
}

template <class T>
std::vector<double> as_double(const T* p, std::size_t count) {
  return std::vector<double>(p, p + count);
}

template <class T>
constexpr double tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-12;

// Runs every combination of bias and ReLU on one shape, under the instruction set that is active.
template <index_t K, index_t N, class T>
void check_shape(const Problem<T>& p) {
  const index_t m = p.m, k = p.k, n = p.n;
  CAPTURE(m);
  CAPTURE(k);
  CAPTURE(n);
  const T* a = p.a();
  const std::vector<T>& b = p.b;
  const std::vector<T>& bias = p.bias;
  std::vector<T> c_storage(static_cast<std::size_t>(m * n + 2), T(7));
  T* c = c_storage.data() + 1;
  const auto size = static_cast<std::size_t>(m * n);
  for (bool with_bias : {false, true}) {
    CAPTURE(with_bias);
    const T* bp = with_bias ? bias.data() : nullptr;
    kernels::gemm<K, N>(a, m, k, b.data(), n, bp, c);
    CHECK(duet_test::relative_difference(as_double(c, size), epilogue(p.product, n, bp, false)) <= tolerance<T>);
    kernels::gemm<K, N, fn::Relu>(a, m, k, b.data(), n, bp, c);
    CHECK(duet_test::relative_difference(as_double(c, size), epilogue(p.product, n, bp, true)) <= tolerance<T>);
    // The compile-time sizes do not change the sums, where they unroll the small layers' loop
    // too: nn::Dense<In, Out> runs gemm<dyn, dyn> beyond those sizes in both modes
    // (backend::dense_depends_on_sizes), and a small static layer agrees with the same layer
    // loaded from ONNX, whose sizes are known at run time.
    std::vector<T> dynamic(size);
    kernels::gemm<dyn, dyn, fn::Relu>(a, m, k, b.data(), n, bp, dynamic.data());
    CHECK(std::equal(dynamic.begin(), dynamic.end(), c));
    // With the weight packed beforehand (JitLevel::O2): the same bits.
    const kernels::PackedWeight<T> packed(b.data(), n, k);
    std::vector<T> from_packed(size);
    kernels::gemm<K, N, fn::Relu>(a, m, k, b.data(), n, bp, from_packed.data(), &packed);
    CHECK(std::equal(from_packed.begin(), from_packed.end(), c));
    // Fused, the epilogue gives the bits that separate bias and ReLU passes give (PyNative).
    std::vector<T> product(size);
    kernels::gemm<K, N>(a, m, k, b.data(), n, nullptr, product.data());
    bool same = true;
    for (std::size_t i = 0; i < size; ++i) {
      const T biased = with_bias ? product[i] + bias[i % static_cast<std::size_t>(n)] : product[i];
      same = same && c[i] == fn::Relu::apply(biased);
    }
    CHECK(same);
  }
  CHECK(c_storage.front() == T(7));  // nothing written outside c
  CHECK(c_storage.back() == T(7));
}

}  // namespace

TEST_CASE_TEMPLATE("kernels::gemm matches a double-precision reference on many shapes" * duet_test::every_isa, T, float, double) {
  std::mt19937 gen(7);
  for (const Case& s : cases()) {
    const Problem<T> p = problem<T>(s.m, s.k, s.n, gen);
    duet_test::for_each_isa([&] { check_shape<dyn, dyn, T>(p); });
  }
}

TEST_CASE_TEMPLATE("kernels::gemm with compile-time sizes, small and large" * duet_test::every_isa, T, float, double) {
  std::mt19937 gen(8);
  auto check = [&]<index_t K, index_t N>(index_t m, index_t k, index_t n) {
    const Problem<T> p = problem<T>(m, k, n, gen);
    duet_test::for_each_isa([&] { check_shape<K, N, T>(p); });
  };
  for (index_t m : {0, 1, 2, 3, 17, 64}) {
    check.template operator()<4, 4>(m, 4, 4);
    check.template operator()<3, 5>(m, 3, 5);
    check.template operator()<8, 8>(m, 8, 8);
    check.template operator()<16, 16>(m, 16, 16);
    check.template operator()<17, 33>(m, 17, 33);
    check.template operator()<784, 512>(m, 784, 512);
    check.template operator()<512, 10>(m, 512, 10);
    check.template operator()<dyn, 10>(m, 512, 10);
    check.template operator()<784, dyn>(m, 784, 20);
  }
}

// The blocked product's tiles are MR rows high, and an M block that ends on a few rows ends on a
// shorter tile: each row's sums are the same chains in either, so its bits do not depend on the
// rows computed with it (a batch, its shards, one row taken out of it).
TEST_CASE_TEMPLATE("kernels::gemm, blocked: a row's bits whatever tile it falls in" * duet_test::every_isa, T, float,
                   double) {
  std::mt19937 gen(12);
  const index_t m = 64, k = 100, n = 80;
  const Problem<T> p = problem<T>(m, k, n, gen);
  duet_test::for_each_isa([&] {
    std::vector<T> all(static_cast<std::size_t>(m * n));
    kernels::gemm<dyn, dyn, fn::Relu>(p.a(), m, k, p.b.data(), n, p.bias.data(), all.data());
    for (index_t first = 0; first < m; first += 5) {
      for (index_t rows : {2, 3, 4, 5, 6, 7, 12, 13}) {
        if (first + rows > m) continue;
        CAPTURE(first);
        CAPTURE(rows);
        std::vector<T> part(static_cast<std::size_t>(rows * n));
        kernels::gemm<dyn, dyn, fn::Relu>(p.a() + first * k, rows, k, p.b.data(), n, p.bias.data(), part.data());
        CHECK(std::equal(part.begin(), part.end(), all.begin() + first * n));
      }
    }
  });
}

// The M block is sized from the L2 the system reports (half of it: 2 to 5 blocks of these 700
// rows of 800 values on a 1 or 2 MiB L2), so the rows that share a block differ from one machine
// to the next; a slice of a few rows is a block of its own. Every sum is one chain along k
// whatever the block, so a machine's L2 must not change a result's bits.
TEST_CASE_TEMPLATE("kernels::gemm, blocked: a row's bits whatever M block it falls in" * duet_test::every_isa, T, float,
                   double) {
  std::mt19937 gen(13);
  const index_t m = 700, k = 800, n = 80;
  const Problem<T> p = problem<T>(m, k, n, gen);
  duet_test::for_each_isa([&] {
    std::vector<T> all(static_cast<std::size_t>(m * n));
    kernels::gemm<dyn, dyn, fn::Relu>(p.a(), m, k, p.b.data(), n, p.bias.data(), all.data());
    const index_t rows = 13;
    for (index_t first = 0; first + rows <= m; first += 29) {
      CAPTURE(first);
      std::vector<T> part(static_cast<std::size_t>(rows * n));
      kernels::gemm<dyn, dyn, fn::Relu>(p.a() + first * k, rows, k, p.b.data(), n, p.bias.data(), part.data());
      CHECK(std::equal(part.begin(), part.end(), all.begin() + first * n));
    }
  });
}

// Fewer outputs than an AVX-512 vector of floats: the narrow product, its tile's edges in rows
// (batches not a multiple of its rows) and in k (not a multiple of any set's lanes), and its
// epilogue pass. Each row's bits are the same whatever rows are computed with it, and on any
// number of threads.
TEST_CASE_TEMPLATE("kernels::gemm with fewer than 16 outputs: the reference's values, a row's bits alone" *
                       duet_test::every_isa,
                   T, float, double) {
  std::mt19937 gen(11);
  for (index_t n = 1; n < 16; ++n) {
    for (index_t m : {2, 3, 5, 65, 131}) {
      for (index_t k : {1, 7, 17, 100, 515}) {
        const Problem<T> p = problem<T>(m, k, n, gen);
        duet_test::for_each_isa([&] {
          check_shape<dyn, dyn, T>(p);
          std::vector<T> all(static_cast<std::size_t>(m * n));
          kernels::gemm<dyn, dyn, fn::Relu>(p.a(), m, k, p.b.data(), n, p.bias.data(), all.data());
          std::vector<T> two(static_cast<std::size_t>(2 * n));
          bool same = true;
          for (index_t i = 0; i + 2 <= m; i += 3) {
            kernels::gemm<dyn, dyn, fn::Relu>(p.a() + i * k, 2, k, p.b.data(), n, p.bias.data(), two.data());
            same = same && std::equal(two.begin(), two.end(), all.begin() + i * n);
          }
          CHECK(same);
        });
      }
    }
  }
  // Large enough to share the threads: the same bits on one thread and on two.
  const index_t m = 600, k = 1000, n = 10;
  const Problem<T> p = problem<T>(m, k, n, gen);
  duet_test::for_each_isa([&] {
    const int saved = get_num_threads();
    std::vector<T> one(static_cast<std::size_t>(m * n)), two(one.size());
    set_num_threads(1);
    kernels::gemm<dyn, dyn, fn::Relu>(p.a(), m, k, p.b.data(), n, p.bias.data(), one.data());
    set_num_threads(2);
    kernels::gemm<dyn, dyn, fn::Relu>(p.a(), m, k, p.b.data(), n, p.bias.data(), two.data());
    set_num_threads(saved);
    CHECK(one == two);
    CHECK(duet_test::relative_difference(as_double(one.data(), one.size()),
                                         epilogue(p.product, n, p.bias.data(), true)) <= tolerance<T>);
  });
}

TEST_CASE_TEMPLATE("kernels::gemm: NaN goes through the product, the bias and ReLU" * duet_test::every_isa, T, float, double) {
  duet_test::for_each_isa([] {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    std::mt19937 gen(9);
    for (const Case& s : std::vector<Case>{{1, 40, 37}, {2, 3, 3}, {50, 300, 70}, {7, 41, 10}}) {
      CAPTURE(s.m);
      std::vector<T> a = random_values<T>(static_cast<std::size_t>(s.m * s.k), gen);
      const std::vector<T> b = random_values<T>(static_cast<std::size_t>(s.n * s.k), gen);
      std::vector<T> bias = random_values<T>(static_cast<std::size_t>(s.n), gen);
      a[static_cast<std::size_t>(s.k - 1)] = nan;  // row 0: every output NaN
      bias[1] = nan;                               // column 1: every output NaN
      std::vector<T> c(static_cast<std::size_t>(s.m * s.n));
      kernels::gemm<dyn, dyn, fn::Relu>(a.data(), s.m, s.k, b.data(), s.n, bias.data(), c.data());
      for (index_t i = 0; i < s.m; ++i) {
        for (index_t j = 0; j < s.n; ++j) {
          const T y = c[static_cast<std::size_t>(i * s.n + j)];
          if (i == 0 || j == 1) CHECK(std::isnan(y));
          else CHECK(y >= T(0));
        }
      }
    }
    // The unrolled path for small static layers: NaN · 0 is NaN too.
    const T x[2] = {nan, 1};
    const T w[4] = {1, 0, 0, -1};
    T y[2];
    kernels::gemm<2, 2, fn::Relu>(x, 1, 2, w, 2, nullptr, y);
    CHECK(std::isnan(y[0]));
    CHECK(std::isnan(y[1]));
  });
}

TEST_CASE_TEMPLATE("kernels::gemm_kn: b stored as [k, n], the reference's values, the same bits for a row alone" * duet_test::every_isa, T, float, double) {
  std::mt19937 gen(9);
  for (const Case& s : cases()) {
    CAPTURE(s.m);
    CAPTURE(s.k);
    CAPTURE(s.n);
    const Problem<T> p = problem<T>(s.m, s.k, s.n, gen);
    std::vector<T> bt(p.b.size());  // [k, n]
    for (index_t j = 0; j < s.n; ++j) {
      for (index_t q = 0; q < s.k; ++q) bt[static_cast<std::size_t>(q * s.n + j)] = p.b[static_cast<std::size_t>(j * s.k + q)];
    }
    const auto size = static_cast<std::size_t>(s.m * s.n);
    duet_test::for_each_isa([&] {
      std::vector<T> c_storage(size + 2, T(7));
      T* c = c_storage.data() + 1;
      kernels::gemm_kn(p.a(), s.m, s.k, bt.data(), s.n, c);
      CHECK(duet_test::relative_difference(as_double(c, size), p.product) <= tolerance<T>);
      CHECK(c_storage.front() == T(7));
      CHECK(c_storage.back() == T(7));
      // Each row's sums do not depend on the rows beside it or the tile it falls in: the last
      // row alone gives the same bits. Added to what c holds, the sums come after it.
      if (s.m > 1) {
        std::vector<T> alone(static_cast<std::size_t>(s.n));
        kernels::gemm_kn(p.a() + (s.m - 1) * s.k, 1, s.k, bt.data(), s.n, alone.data());
        CHECK(std::equal(alone.begin(), alone.end(), c + (s.m - 1) * s.n));
      }
      std::vector<T> added(size, T(0.5));
      kernels::gemm_kn(p.a(), s.m, s.k, bt.data(), s.n, added.data(), true);
      std::vector<T> expected(size);
      for (std::size_t i = 0; i < size; ++i) expected[i] = T(0.5) + c[i];
      CHECK(duet_test::relative_difference(as_double(added.data(), size), as_double(expected.data(), size)) <= tolerance<T>);
    });
  }
}

// A layer's weight gradient sums over the batch's rows (k here) in halves, so that 2 ranks, each
// summing its half, and one process get the same bits (kernels/detail/halves.hpp).
TEST_CASE_TEMPLATE("kernels::gemm_kn in halves: a sum over k is the sum of its halves' sums, to the bit" *
                       duet_test::every_isa,
                   T, float, double) {
  std::mt19937 gen(11);
  for (const Case s : {Case{64, 64, 784}, Case{7, 17, 5}, Case{13, 32, 100}, Case{10, 50, 33}, Case{512, 256, 70},
                       Case{3, 1000, 20}, Case{6, 65, 64}}) {
    CAPTURE(s.m);
    CAPTURE(s.k);
    CAPTURE(s.n);
    const index_t h = (s.k + 1) / 2;
    const std::vector<T> a = random_values<T>(static_cast<std::size_t>(s.m * s.k), gen);
    const std::vector<T> b = random_values<T>(static_cast<std::size_t>(s.k * s.n), gen);  // [k, n]
    std::vector<T> left(static_cast<std::size_t>(s.m * h));
    std::vector<T> right(static_cast<std::size_t>(s.m * (s.k - h)));
    for (index_t i = 0; i < s.m; ++i) {
      for (index_t q = 0; q < s.k; ++q) {
        const T v = a[static_cast<std::size_t>(i * s.k + q)];
        if (q < h)
          left[static_cast<std::size_t>(i * h + q)] = v;
        else
          right[static_cast<std::size_t>(i * (s.k - h) + q - h)] = v;
      }
    }
    std::vector<double> reference(static_cast<std::size_t>(s.m * s.n));
    for (index_t i = 0; i < s.m; ++i) {
      for (index_t j = 0; j < s.n; ++j) {
        for (index_t q = 0; q < s.k; ++q) {
          reference[static_cast<std::size_t>(i * s.n + j)] +=
              static_cast<double>(a[static_cast<std::size_t>(i * s.k + q)]) *
              static_cast<double>(b[static_cast<std::size_t>(q * s.n + j)]);
        }
      }
    }
    const auto size = static_cast<std::size_t>(s.m * s.n);
    duet_test::for_each_isa([&] {
      std::vector<T> whole(size), first(size), second(size);
      kernels::gemm_kn(a.data(), s.m, s.k, b.data(), s.n, whole.data(), false, true);
      kernels::gemm_kn(left.data(), s.m, h, b.data(), s.n, first.data(), false, true);
      kernels::gemm_kn(right.data(), s.m, s.k - h, b.data() + h * s.n, s.n, second.data(), false, true);
      bool halves = true;
      for (std::size_t i = 0; i < size; ++i) halves = halves && whole[i] == first[i] + second[i];
      CHECK(halves);
      CHECK(duet_test::relative_difference(as_double(whole.data(), size), reference) <= tolerance<T>);
      // Added to what c holds, the sums come after it.
      std::vector<T> added(size, T(0.5));
      kernels::gemm_kn(a.data(), s.m, s.k, b.data(), s.n, added.data(), true, true);
      bool after = true;
      for (std::size_t i = 0; i < size; ++i) after = after && added[i] == T(0.5) + whole[i];
      CHECK(after);
    });
  }
}

TEST_CASE_TEMPLATE("kernels::transpose: every element in its place, whole tiles and edges" * duet_test::every_isa, T, float,
                   double) {
  duet_test::for_each_isa([] {
    for (index_t rows : {0, 1, 3, 7, 8, 9, 16, 17, 33, 256}) {
      for (index_t cols : {1, 4, 10, 16, 31, 64, 784}) {
        std::vector<T> from(static_cast<std::size_t>(rows * cols));
        for (std::size_t i = 0; i < from.size(); ++i) from[i] = static_cast<T>(i) + T(0.5);
        std::vector<T> to(from.size(), T(-1));
        kernels::transpose(from.data(), rows, cols, to.data());
        bool placed = true;
        for (index_t r = 0; r < rows; ++r) {
          for (index_t c = 0; c < cols; ++c) placed = placed && to[c * rows + r] == from[r * cols + c];
        }
        INFO("rows ", rows, ", cols ", cols);
        CHECK(placed);
      }
    }
  });
}

TEST_CASE("kernels::gemm_kn with k = 0 writes zeros") {
  std::vector<float> c(6, 7.0f);
  kernels::gemm_kn<float>(nullptr, 2, 0, nullptr, 3, c.data());
  CHECK(std::all_of(c.begin(), c.end(), [](float v) { return v == 0.0f; }));
}

TEST_CASE("kernels::gemm refuses a weight packed for another shape") {
  const std::vector<float> a(2 * 16, 1.0f);
  const std::vector<float> b(16 * 16, 1.0f);
  std::vector<float> c(2 * 16);
  const kernels::PackedWeight<float> packed(b.data(), 16, 15);
  CHECK(kernels::reads_packed_weight(2, 16, 16));
  CHECK_FALSE(kernels::reads_packed_weight(1, 16, 16));  // one row: a GEMV reads the weight in place
  CHECK_FALSE(kernels::reads_packed_weight(2, 16, 15));  // under 16 outputs: so does the narrow product
  CHECK_FALSE(kernels::reads_packed_weight(8, 8, 8));    // at most 64 weights: a plain loop, at any size
  CHECK_FALSE(kernels::reads_packed_weight<4, 4>(8, 4, 4));
  CHECK_THROWS_WITH_AS(kernels::gemm(a.data(), 2, 16, b.data(), 16, nullptr, c.data(), &packed),
                       "duet::kernels::gemm: a weight packed as [16, 15] for a product with [16, 16]", ShapeError);
}

TEST_CASE("kernels::gemm with k = 0: an empty sum, so the output is the epilogue of zero" * duet_test::every_isa) {
  duet_test::for_each_isa([] {
    const float bias[3] = {-1, 0, 2};
    float c[6] = {7, 7, 7, 7, 7, 7};
    kernels::gemm<dyn, dyn, fn::Relu>(bias, 2, 0, bias, 3, bias, c);
    for (int i = 0; i < 6; ++i) CHECK(c[i] == std::max(bias[i % 3], 0.0f));
  });
}

TEST_CASE("fn::Relu::apply: max(x, 0) on scalars and on the kernel's vectors, NaN kept") {
  CHECK(fn::Relu::apply(-2.0f) == 0.0f);
  CHECK(fn::Relu::apply(3.0) == 3.0);
  CHECK(std::isnan(fn::Relu::apply(std::nanf(""))));
  CHECK(fn::Relu::apply(std::numeric_limits<float>::infinity()) == std::numeric_limits<float>::infinity());
  // In place on the widest vector a kernel has (AVX-512's), as the kernels apply it.
  using V = kernels::detail::Vector<float, 64>;
  V r{};
  r[0] = -1.0f;
  r[1] = std::nanf("");
  r[2] = 5.0f;
  fn::Relu::apply_in_place(r);
  const float first = r[0], second = r[1], third = r[2];  // doctest binds references, which lanes cannot
  CHECK(first == 0.0f);
  CHECK(std::isnan(second));
  CHECK(third == 5.0f);
}

TEST_CASE("backend::Native computes what backend::Eigen does, through the epilogue") {
  const float x[2] = {1, -2};
  const float w[4] = {1, 0, 0, 1};
  const float b[2] = {0.5f, 0.5f};
  float y[2];
  backend::Native::dense<2, 2>(x, 1, 2, w, 2, Epilogue<float, fn::Relu>{b}, y);
  CHECK(y[0] == 1.5f);
  CHECK(y[1] == 0.0f);
  backend::Native::dense<dyn, dyn>(x, 1, 2, w, 2, Epilogue<float>{}, y);
  CHECK(y[1] == -2.0f);
  // An element type the kernel does not take goes to Eigen.
  const std::int32_t xi[2] = {3, -4};
  const std::int32_t wi[4] = {1, 0, 0, 1};
  std::int32_t yi[2];
  backend::Native::dense<dyn, dyn>(xi, 1, 2, wi, 2, Epilogue<std::int32_t, fn::Relu>{}, yi);
  CHECK(yi[0] == 3);
  CHECK(yi[1] == 0);
}

TEST_CASE("graph mode and PyNative agree bit for bit under each instruction set" * duet_test::every_isa) {
  duet_test::ModeGuard guard;
  duet_test::SeedNetwork<> net;
  duet_test::for_each_isa([&] {
    for (index_t batch : {1, 7, 64}) {
      CAPTURE(batch);
      const Tensor x = randn({batch, 1, 28, 28}, static_cast<std::uint64_t>(batch));
      set_context({.mode = PYNATIVE_MODE});
      const std::vector<double> eager = duet_test::values_of(net(x));
      set_context({.mode = GRAPH_MODE});
      const std::vector<double> graph = duet_test::values_of(net(x));
      CHECK(eager == graph);
      const auto reference = duet_test::reference_forward(duet_test::values_of(x), batch, duet_test::layers_of(net));
      CHECK(duet_test::relative_difference(graph, reference) <= 1e-5);
    }
  });
}

TEST_CASE("a weight packed under another instruction set is not read: the product packs for its own" * duet_test::every_isa) {
  std::mt19937 gen(10);
  const index_t m = 20, k = 70, n = 40;
  const std::vector<float> a = random_values<float>(static_cast<std::size_t>(m * k), gen);
  const std::vector<float> b = random_values<float>(static_cast<std::size_t>(n * k), gen);
  duet_test::for_each_isa([&] {
    const kernels::PackedWeight<float> packed(b.data(), n, k);
    CHECK(packed.isa() == kernels::active_isa());
    std::vector<float> expected(static_cast<std::size_t>(m * n));
    kernels::gemm(a.data(), m, k, b.data(), n, nullptr, expected.data(), &packed);
    duet_test::for_each_isa([&] {
      std::vector<float> fresh(static_cast<std::size_t>(m * n)), with_other(static_cast<std::size_t>(m * n));
      kernels::gemm(a.data(), m, k, b.data(), n, nullptr, fresh.data());
      kernels::gemm(a.data(), m, k, b.data(), n, nullptr, with_other.data(), &packed);
      CHECK(with_other == fresh);
    });
  });
}

TEST_CASE("DUET_ISA names the kernels to start with, kernel_isa and set_kernel_isa" * duet_test::every_isa) {
  using kernels::Isa;
  CHECK(kernels::detail::initial_isa(nullptr) == kernels::best_supported_isa());
  CHECK(kernels::detail::initial_isa("") == kernels::best_supported_isa());
  CHECK(kernels::detail::initial_isa("baseline") == Isa::baseline);
  CHECK_THROWS_WITH_AS(kernels::detail::initial_isa("sse9"),
                       "DUET_ISA=sse9: unknown instruction set 'sse9' (expected avx512, avx2 or baseline)", ValueError);
  const kernels::Isa saved = kernels::active_isa();
  for (Isa isa : kernels::all_isas) {
    const std::string name(kernels::isa_name(isa));
    CAPTURE(name);
    if (kernels::cpu_supports(isa)) {
      CHECK(kernels::detail::initial_isa(name.c_str()) == isa);
      set_kernel_isa(name);
      CHECK(kernel_isa() == name);
    } else {
      // A set this CPU lacks is refused, not replaced by another one.
      CHECK_THROWS_AS(kernels::detail::initial_isa(name.c_str()), ValueError);
      CHECK_THROWS_AS(set_kernel_isa(name), ValueError);
    }
  }
  CHECK_THROWS_AS(set_kernel_isa("AVX2"), ValueError);
  kernels::set_active_isa(saved);
}

TEST_CASE("backend::Native keeps a weight packed for the instruction set that runs, repacking after a switch" * duet_test::every_isa) {
  const index_t rows = 16, in = 40, out = 24;
  const nn::Parameter w(randn({out, in}, 11));
  const Tensor x = randn({rows, in}, 12);
  duet_test::for_each_isa([&] {
    std::vector<float> unpacked(static_cast<std::size_t>(rows * out)), packed(unpacked.size());
    backend::Native::dense<dyn, dyn>(x.data(), rows, in, w.data(), out, Epilogue<float>{}, unpacked.data());
    backend::Native::dense_packed<dyn, dyn>(x.data(), rows, in, w, out, Epilogue<float>{}, packed.data());
    CHECK(packed == unpacked);
    // The form the product read is this set's, kept: asking for it again does not pack.
    kernels::detail::with_kernels(kernels::active_isa(), [&]<class Kernels>(Kernels) {
      using Packed = kernels::PackedWeightFor<float, Kernels>;
      bool packed_again = false;
      const auto form = w.derived<Packed>([&] {
        packed_again = true;
        return Packed(w.data(), out, in);
      });
      CHECK_FALSE(packed_again);
      CHECK(form->isa() == kernels::active_isa());
    });
  });
}

}  // namespace tests_kernels_gemm
