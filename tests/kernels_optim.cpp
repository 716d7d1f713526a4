#include "support.hpp"

#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace tests_kernels_optim {

using namespace duet;

namespace {

// Lengths around every vector width (2 to 16 lanes) and two vectors' worth, for the tails.
const std::vector<index_t> lengths = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 100, 1001};

// Marks the elements past n, which a kernel must leave alone.
template <class T>
constexpr T guard = T(12345);

template <class T>
std::vector<T> values(index_t n, double lo, double hi, std::mt19937& gen) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n) + 3, guard<T>);
  for (index_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<T>(u(gen));
  return v;
}

template <class T>
bool guards_intact(const std::vector<T>& v, index_t n) {
  return std::all_of(v.begin() + n, v.end(), [](T x) { return x == guard<T>; });
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
constexpr double tolerance = std::is_same_v<T, float> ? 2e-6 : 1e-14;

// The first n values, in double.
template <class T>
std::vector<double> head(const std::vector<T>& v, index_t n) {
  return std::vector<double>(v.begin(), v.begin() + n);
}

struct AdamState {
  std::vector<double> p, m, v;
};

// The formula of kernels::AdamCoefficients in double, from the same inputs and coefficients.
template <class T>
AdamState adam_reference(const std::vector<T>& p, const std::vector<T>& g, const std::vector<T>& m,
                         const std::vector<T>& v, index_t n, const kernels::AdamCoefficients<T>& c) {
  AdamState s{head(p, n), head(m, n), head(v, n)};
  const double b1 = c.beta1, b2 = c.beta2;
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
    const double grad = static_cast<double>(g[i]) + static_cast<double>(c.l2) * s.p[i];
    s.m[i] = b1 * s.m[i] + (1 - b1) * grad;
    s.v[i] = b2 * s.v[i] + (1 - b2) * grad * grad;
    s.p[i] = s.p[i] * static_cast<double>(c.decay) -
             static_cast<double>(c.step) * s.m[i] / (std::sqrt(s.v[i]) + static_cast<double>(c.eps));
  }
  return s;
}

template <class T>
void check_adam(const kernels::AdamCoefficients<T>& c) {
  std::mt19937 gen(7);
  for (index_t n : lengths) {
    CAPTURE(n);
    const auto p0 = values<T>(n, -1, 1, gen);
    const auto g = values<T>(n, -1e-2, 1e-2, gen);
    const auto m0 = values<T>(n, -1e-2, 1e-2, gen);
    const auto v0 = values<T>(n, 0, 1e-4, gen);
    const AdamState expected = adam_reference(p0, g, m0, v0, n, c);
    std::vector<std::vector<T>> first;  // p, m, v from the first set
    duet_test::for_each_isa([&] {
      auto p = p0, m = m0, v = v0;
      kernels::adam_update(p.data(), g.data(), m.data(), v.data(), n, c);
      CHECK(duet_test::relative_difference(head(p, n), expected.p) <= tolerance<T>);
      CHECK(duet_test::relative_difference(head(m, n), expected.m) <= tolerance<T>);
      CHECK(duet_test::relative_difference(head(v, n), expected.v) <= tolerance<T>);
      CHECK((guards_intact(p, n) && guards_intact(m, n) && guards_intact(v, n)));
      // Unfused, in the scalar formula's order: every set gives the same bits.
      if (first.empty()) {
        first = {p, m, v};
      } else {
        CHECK(same_bits(p, first[0]));
        CHECK(same_bits(m, first[1]));
        CHECK(same_bits(v, first[2]));
      }
    });
  }
}

TEST_CASE_TEMPLATE("kernels::adam_update follows Adam's formula under every instruction set" * duet_test::every_isa, T, float, double) {
  // lr 1e-3 at step 3 (bias corrections 1 - 0.9³ and 1 - 0.999³).
  const double b1 = 0.9, b2 = 0.999, lr = 1e-3;
  const double root = std::sqrt(1 - b2 * b2 * b2);
  const auto step = static_cast<T>(lr * root / (1 - b1 * b1 * b1));
  const auto eps = static_cast<T>(1e-8 * root);
  SUBCASE("Adam with L2 weight decay") { check_adam<T>({T(0.9), T(0.999), eps, T(0.01), T(1), step}); }
  SUBCASE("AdamW's decoupled decay") {
    check_adam<T>({T(0.9), T(0.999), eps, T(0), static_cast<T>(1 - lr * 0.01), step});
  }
}

template <class T>
void check_sgd(const kernels::SgdCoefficients<T>& c) {
  std::mt19937 gen(11);
  for (index_t n : lengths) {
    CAPTURE(n);
    const auto p0 = values<T>(n, -1, 1, gen);
    const auto g = values<T>(n, -1, 1, gen);
    const auto buf0 = values<T>(n, -1, 1, gen);
    std::vector<double> p_expected = head(p0, n), buf_expected = head(buf0, n);
    for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
      const double d = static_cast<double>(g[i]) + static_cast<double>(c.weight_decay) * p_expected[i];
      if (!c.with_momentum) {
        p_expected[i] -= static_cast<double>(c.learning_rate) * d;
        continue;
      }
      buf_expected[i] =
          c.first_step ? d : static_cast<double>(c.momentum) * buf_expected[i] + static_cast<double>(c.keep) * d;
      p_expected[i] -= static_cast<double>(c.learning_rate) *
                       (c.nesterov ? d + static_cast<double>(c.momentum) * buf_expected[i] : buf_expected[i]);
    }
    std::vector<std::vector<T>> first;
    duet_test::for_each_isa([&] {
      auto p = p0, buf = buf0;
      kernels::sgd_update(p.data(), g.data(), buf.data(), n, c);
      CHECK(duet_test::relative_difference(head(p, n), p_expected) <= tolerance<T>);
      CHECK(duet_test::relative_difference(head(buf, n), buf_expected) <= tolerance<T>);
      CHECK((guards_intact(p, n) && guards_intact(buf, n)));
      if (first.empty()) {
        first = {p, buf};
      } else {
        CHECK(same_bits(p, first[0]));
        CHECK(same_bits(buf, first[1]));
      }
    });
  }
}

TEST_CASE_TEMPLATE("kernels::sgd_update follows SGD's formula under every instruction set" * duet_test::every_isa, T, float, double) {
  SUBCASE("plain, with weight decay") { check_sgd<T>({T(0.1), T(0.01), T(0), T(1), false, false, false}); }
  SUBCASE("momentum, first step") { check_sgd<T>({T(0.1), T(0), T(0.9), T(0.8), true, false, true}); }
  SUBCASE("momentum with dampening") { check_sgd<T>({T(0.1), T(0.01), T(0.9), T(0.8), true, false, false}); }
  SUBCASE("Nesterov") { check_sgd<T>({T(0.1), T(0.01), T(0.9), T(1), true, true, false}); }
}

TEST_CASE("kernels::sgd_update without momentum needs no momentum buffer" * duet_test::every_isa) {
  std::vector<float> p = {1, 2, 3}, g = {1, 1, 1};
  duet_test::for_each_isa([&] {
    auto q = p;
    const kernels::SgdCoefficients<float> plain{0.5f, 0, 0, 1, false, false, false};
    kernels::sgd_update(q.data(), g.data(), static_cast<float*>(nullptr), 3, plain);
    CHECK(q == std::vector<float>{0.5f, 1.5f, 2.5f});
  });
}

// Where a weight's gradient stays 0, its moments shrink towards the smallest subnormal and,
// under IEEE rounding, stay a few units above it for good (0.9 * 3 units rounds back to 3),
// costing a microcode assist per operation each step on x86. There the kernels flush them to 0
// and leave the caller's floating-point control as it was.
TEST_CASE_TEMPLATE("kernels::adam_update and sgd_update flush subnormal state on x86" * duet_test::every_isa, T, float,
                   double) {
  const T tiny = std::numeric_limits<T>::denorm_min();
  const kernels::AdamCoefficients<T> adam{T(0.9), T(0.999), T(1e-8), T(0), T(1), T(1e-3)};
  const kernels::SgdCoefficients<T> sgd{T(0.1), T(0), T(0.9), T(1), true, false, false};
  duet_test::for_each_isa([&] {
#if DUET_X86_KERNELS
    const unsigned control = _mm_getcsr();
#endif
    // The second element's gradient is itself subnormal.
    std::vector<T> p = {T(0.5), T(0.25)}, g = {T(0), 7 * tiny}, m = {3 * tiny, 3 * tiny}, v = {300 * tiny, 300 * tiny};
    kernels::adam_update(p.data(), g.data(), m.data(), v.data(), 2, adam);
    std::vector<T> q = {T(0.5), T(0.25)}, buf = {3 * tiny, 3 * tiny};
    kernels::sgd_update(q.data(), g.data(), buf.data(), 2, sgd);
#if DUET_X86_KERNELS
    CHECK(_mm_getcsr() == control);
    CHECK(m == std::vector<T>{0, 0});
    CHECK(v == std::vector<T>{0, 0});
    CHECK(buf == std::vector<T>{0, 0});
#else
    CHECK(m[0] == 3 * tiny);
    CHECK(v[0] == 300 * tiny);
    CHECK(buf[0] == 3 * tiny);
#endif
    CHECK(p == std::vector<T>{T(0.5), T(0.25)});
    CHECK(q == std::vector<T>{T(0.5), T(0.25)});
  });
}

}  // namespace

}  // namespace tests_kernels_optim
