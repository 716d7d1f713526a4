#include "support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace tests_kernels_elementwise {

using namespace duet;

namespace {

// Lengths around every vector width (2 to 16 lanes), for the tails.
const std::vector<index_t> lengths = {1, 2, 3, 4, 5, 7, 8, 9, 10, 15, 16, 17, 31, 33, 100, 1001};

template <class T>
using Bits = std::conditional_t<std::is_same_v<T, float>, std::int32_t, std::int64_t>;

template <class T>
T from_bits(Bits<T> b) {
  T x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

template <class T>
Bits<T> bits_of(T x) {
  Bits<T> b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// How many representable values apart two non-negative results are (+inf one past the largest
// finite value).
template <class T>
std::int64_t ulps_apart(T a, T b) {
  const auto d = static_cast<std::int64_t>(bits_of(a)) - static_cast<std::int64_t>(bits_of(b));
  return d < 0 ? -d : d;
}

// The arguments exp is tested on: every stride-th value of the type between the bounds (so
// that every binade is sampled, near zero as densely as near the ends), the bounds' neighbours,
// and the points where the result overflows, turns subnormal and underflows.
template <class T>
std::vector<T> exp_arguments(T lowest, T highest, std::int64_t stride) {
  std::vector<T> x;
  for (T bound : {lowest, highest}) {
    const auto top = static_cast<std::int64_t>(bits_of(bound));
    const Bits<T> sign = bound < 0 ? std::numeric_limits<Bits<T>>::min() : 0;
    for (std::int64_t b = 0; b <= (top & std::numeric_limits<Bits<T>>::max()); b += stride) {
      x.push_back(from_bits<T>(static_cast<Bits<T>>(b | sign)));
    }
    x.push_back(bound);
    x.push_back(std::nextafter(bound, T(0)));
  }
  const T overflow = std::log(std::numeric_limits<T>::max());
  const T subnormal = std::log(std::numeric_limits<T>::min());
  const T underflow = std::log(std::numeric_limits<T>::denorm_min());
  for (T edge : {overflow, subnormal, underflow}) {
    T y = edge;
    for (int i = 0; i < 64; ++i) y = std::nextafter(y, -std::numeric_limits<T>::infinity());
    for (int i = 0; i < 128; ++i, y = std::nextafter(y, std::numeric_limits<T>::infinity())) x.push_back(y);
  }
  return x;
}

template <class T>
void check_exp(T lowest, T highest, std::int64_t stride) {
  const std::vector<T> x = exp_arguments(lowest, highest, stride);
  duet_test::for_each_isa([&] {
    std::vector<T> y(x.size());
    kernels::exp(x.data(), static_cast<index_t>(x.size()), y.data());
    std::int64_t worst = 0;
    T worst_at = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::int64_t d = ulps_apart(y[i], std::exp(x[i]));
      if (d > worst) {
        worst = d;
        worst_at = x[i];
      }
    }
    CAPTURE(worst_at);
    CHECK(worst <= 2);
    MESSAGE(kernel_isa(), ": exp within ", worst, " ulp of std::exp on ", x.size(), " arguments");
  });
}

TEST_CASE("kernels::exp is within 2 ulp of std::exp over float's range, under every instruction set" * duet_test::every_isa) {
  check_exp<float>(-104.0f, 89.0f, 509);
}

TEST_CASE("kernels::exp is within 2 ulp of std::exp over double's range, under every instruction set" * duet_test::every_isa) {
  check_exp<double>(-746.0, 710.0, (std::int64_t(1) << 41) + 12345);
}

// The recurrent cells' activations: tanh within 2 ulp of std::tanh, and the sigmoid within 2 ulp
// of 1 / (1 + e^-x) in long double wherever the result is a normal number (below that it is 0,
// as the scalar formula on float's e^x gives), on a grid over the range where neither saturates
// and over tiny arguments; tanh odd to the bit.
template <class T>
void check_activations() {
  std::vector<T> x;
  for (int i = 0; i < 300000; ++i) x.push_back(static_cast<T>(i) * T(1e-4));
  for (T v = T(1e-30); v < T(1e-2); v *= T(1.37)) x.push_back(v);
  std::vector<T> negative;
  for (const T v : x) negative.push_back(-v);
  const auto n = static_cast<index_t>(x.size());
  duet_test::for_each_isa([&] {
    std::vector<T> t(x.size()), t_negative(x.size()), s(x.size()), s_negative(x.size());
    kernels::tanh(x.data(), n, t.data());
    kernels::tanh(negative.data(), n, t_negative.data());
    kernels::sigmoid(x.data(), n, s.data());
    kernels::sigmoid(negative.data(), n, s_negative.data());
    std::int64_t worst_tanh = 0, worst_sigmoid = 0;
    bool odd = true;
    const auto sigmoid_ulps = [](T y, T v) -> std::int64_t {
      const auto reference = static_cast<T>(1.0L / (1.0L + std::exp(-static_cast<long double>(v))));
      return reference < std::numeric_limits<T>::min() ? 0 : ulps_apart(y, reference);
    };
    for (std::size_t i = 0; i < x.size(); ++i) {
      worst_tanh = std::max(worst_tanh, ulps_apart(t[i], std::tanh(x[i])));
      odd = odd && bits_of(t_negative[i]) == bits_of(-t[i]);
      worst_sigmoid = std::max({worst_sigmoid, sigmoid_ulps(s[i], x[i]), sigmoid_ulps(s_negative[i], negative[i])});
    }
    CHECK(worst_tanh <= 2);
    CHECK(worst_sigmoid <= 2);
    CHECK(odd);
    MESSAGE(kernel_isa(), ": tanh within ", worst_tanh, " ulp, sigmoid within ", worst_sigmoid, " ulp");
    constexpr T inf = std::numeric_limits<T>::infinity();
    const std::vector<T> special = {inf, -inf, std::numeric_limits<T>::quiet_NaN(), T(-0.0), T(1000), T(-1000)};
    std::vector<T> ts(special.size()), ss(special.size());
    kernels::tanh(special.data(), static_cast<index_t>(special.size()), ts.data());
    kernels::sigmoid(special.data(), static_cast<index_t>(special.size()), ss.data());
    CHECK((ts[0] == T(1) && ts[1] == T(-1) && std::isnan(ts[2]) && ts[3] == T(0) && std::signbit(ts[3]) &&
           ts[4] == T(1) && ts[5] == T(-1)));
    CHECK((ss[0] == T(1) && ss[1] == T(0) && std::isnan(ss[2]) && ss[3] == T(0.5) && ss[4] == T(1) && ss[5] == T(0)));
  });
}

TEST_CASE_TEMPLATE("kernels::tanh and kernels::sigmoid: within 2 ulp, odd, saturated, NaN kept" * duet_test::every_isa, T,
                   float, double) {
  check_activations<T>();
}

// The activation layers' vector forms (kernels::activation, which fn::Gelu, fn::Silu, ... apply)
// against long double on a grid over [-20, 20], dense near 0, under every set. err is the
// distance from the reference in units of eps · scale, where scale is the reference's
// magnitude for a function and the sum of the magnitudes of the derivative's terms for a
// derivative (whose sum cancels: GELU's is 0 near x = -0.75). Allowed: a few units, plus what
// rounding costs where an exponential's argument is large: GELU's lower tail is erfc(z)
// for z = |x| / √2, whose relative error is 2z² times z's (the rounding of 1 / √2 and of
// the product) plus z² times that of the exponent's -z² + Q: 1.5 x² in all. The tanh form's
// tail is e^a for a = 2u, which moves by |a| times a's relative error, a few ulp from its
// constants and products.
// F applied by kernels::map over y[0, n), or with n = 0 by kernels::activation to y[0] alone
// (a small layer's scalar path).
template <class T>
void apply_activation(kernels::Activation f, T* y, index_t n) {
  const auto run = [&]<kernels::Activation F>() {
    if (n == 0)
      kernels::activation<F>(*y);
    else
      kernels::map<kernels::ActivationFunction<F>>(y, n, y);
  };
  using A = kernels::Activation;
  switch (f) {
    case A::exp:
      return run.template operator()<A::exp>();
    case A::sigmoid:
      return run.template operator()<A::sigmoid>();
    case A::tanh:
      return run.template operator()<A::tanh>();
    case A::silu:
      return run.template operator()<A::silu>();
    case A::silu_derivative:
      return run.template operator()<A::silu_derivative>();
    case A::gelu:
      return run.template operator()<A::gelu>();
    case A::gelu_derivative:
      return run.template operator()<A::gelu_derivative>();
    case A::gelu_tanh:
      return run.template operator()<A::gelu_tanh>();
    case A::gelu_tanh_derivative:
      return run.template operator()<A::gelu_tanh_derivative>();
    case A::erf:
      return run.template operator()<A::erf>();
    case A::erf_derivative:
      return run.template operator()<A::erf_derivative>();
  }
}

struct ActivationCase {
  kernels::Activation f;
  const char* name;
  long double (*reference)(long double);
  long double (*scale)(long double);
  double (*allowed)(double);
  long double (*sigmoid_factor)(long double) = [](long double) { return 1.0L; };  // σ(a) of x σ(a)
};

long double normal_cdf(long double x) { return 0.5L * std::erfc(-x / std::sqrt(2.0L)); }
long double normal_pdf(long double x) {
  return std::exp(-0.5L * x * x) / std::sqrt(2 * 3.14159265358979323846264338327950288L);
}
long double gelu_tanh_u(long double x) { return 0.79788456080286535588L * (x + 0.044715L * x * x * x); }
long double sigmoid_of(long double x) { return 1 / (1 + std::exp(-x)); }

const ActivationCase activation_cases[] = {
    {kernels::Activation::gelu, "gelu", [](long double x) { return x * normal_cdf(x); },
     [](long double x) { return std::fabs(x * normal_cdf(x)); }, [](double x) { return 4 + 1.5 * x * x; }},
    {kernels::Activation::gelu_derivative, "gelu'", [](long double x) { return normal_cdf(x) + x * normal_pdf(x); },
     [](long double x) { return normal_cdf(x) + std::fabs(x * normal_pdf(x)); },
     [](double x) { return 4 + 1.5 * x * x; }},
    // 0.5 (1 + tanh u) as σ(2u) and 0.5 (1 - tanh² u) as 2σ(2u)(1 - σ(2u)): long double's
    // 1 + tanh u keeps no digit of the lower tail either.
    {kernels::Activation::gelu_tanh, "gelu(tanh)", [](long double x) { return x * sigmoid_of(2 * gelu_tanh_u(x)); },
     [](long double x) { return std::fabs(x * sigmoid_of(2 * gelu_tanh_u(x))); },
     [](double x) { return 4 + 8 * std::fabs(static_cast<double>(gelu_tanh_u(x))); },
     [](long double x) { return sigmoid_of(2 * gelu_tanh_u(x)); }},
    {kernels::Activation::gelu_tanh_derivative, "gelu(tanh)'",
     [](long double x) {
       const long double s = sigmoid_of(2 * gelu_tanh_u(x));
       return s + x * 2 * s * (1 - s) * 0.79788456080286535588L * (1 + 3 * 0.044715L * x * x);
     },
     [](long double x) {
       const long double s = sigmoid_of(2 * gelu_tanh_u(x));
       return s + std::fabs(x * 2 * s * (1 - s) * 0.79788456080286535588L * (1 + 3 * 0.044715L * x * x));
     },
     [](double x) { return 8 + 8 * std::fabs(static_cast<double>(gelu_tanh_u(x))); },
     [](long double x) { return sigmoid_of(2 * gelu_tanh_u(x)); }},
    {kernels::Activation::silu, "silu", [](long double x) { return x * sigmoid_of(x); },
     [](long double x) { return std::fabs(x * sigmoid_of(x)); }, [](double x) { return 4 + std::fabs(x); }, sigmoid_of},
    {kernels::Activation::silu_derivative, "silu'",
     [](long double x) { return sigmoid_of(x) * (1 + x * (1 - sigmoid_of(x))); },
     [](long double x) { return sigmoid_of(x) * (1 + std::fabs(x * (1 - sigmoid_of(x)))); },
     [](double x) { return 4 + std::fabs(x); }, sigmoid_of},
    {kernels::Activation::erf, "erf", [](long double x) { return std::erf(x); },
     [](long double x) { return std::fabs(std::erf(x)); }, [](double) { return 2.0; }},
    {kernels::Activation::erf_derivative, "erf'",
     [](long double x) { return 1.12837916709551257390L * std::exp(-x * x); },
     [](long double x) { return 1.12837916709551257390L * std::exp(-x * x); }, [](double x) { return 4 + 2 * x * x; }},
};

template <class T>
void check_activation_forms() {
  std::vector<T> x;
  for (int i = -200000; i <= 200000; ++i) x.push_back(static_cast<T>(i) * T(1e-4));
  for (T v = T(1e-30); v < T(1e-2); v *= T(1.37)) x.push_back(v), x.push_back(-v);
  const auto n = static_cast<index_t>(x.size());
  for (const ActivationCase& c : activation_cases) {
    const std::string name = c.name;
    CAPTURE(name);
    duet_test::for_each_isa([&] {
      std::vector<T> y(x.size());
      std::copy(x.begin(), x.end(), y.begin());
      apply_activation<T>(c.f, y.data(), n);
      double worst = 0;
      T worst_at = 0;
      bool lanes_agree = true;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const long double reference = c.reference(x[i]);
        const long double scale = c.scale(x[i]);
        // A subnormal result, or one of x σ(a) where σ(a) is subnormal: e^-a has overflowed,
        // and x / (1 + e^-a) is 0.
        if (std::min(scale, c.sigmoid_factor(x[i])) < std::numeric_limits<T>::min()) continue;
        const double err = static_cast<double>(std::fabs(static_cast<long double>(y[i]) - reference) /
                                               (scale * std::numeric_limits<T>::epsilon()));
        const double excess = err / c.allowed(static_cast<double>(x[i]));
        if (excess > worst) worst = excess, worst_at = x[i];
        if (i % 997 == 0) {
          T one = x[i];
          apply_activation<T>(c.f, &one, 0);
          lanes_agree = lanes_agree && bits_of(one) == bits_of(y[i]);
        }
      }
      CAPTURE(worst_at);
      CHECK(worst <= 1);
      CHECK(lanes_agree);
      MESSAGE(kernel_isa(), ": ", name, " at most ", worst, " of its allowance (at ", worst_at, ")");
    });
  }
}

TEST_CASE_TEMPLATE("kernels::activation: GELU, SiLU, erf and their derivatives against long double" *
                       duet_test::every_isa,
                   T, float, double) {
  check_activation_forms<T>();
}

TEST_CASE_TEMPLATE("kernels::activation: infinities, NaN and signed zeros" * duet_test::every_isa, T, float, double) {
  constexpr T inf = std::numeric_limits<T>::infinity();
  duet_test::for_each_isa([&] {
    const auto at = [](kernels::Activation f, T v) {
      apply_activation<T>(f, &v, 0);
      return v;
    };
    CHECK(at(kernels::Activation::erf, inf) == T(1));
    CHECK(at(kernels::Activation::erf, -inf) == T(-1));
    CHECK(at(kernels::Activation::erf, T(6)) == T(1));
    CHECK(std::signbit(at(kernels::Activation::erf, T(-0.0))));
    CHECK(at(kernels::Activation::gelu, inf) == inf);
    CHECK(at(kernels::Activation::gelu, T(-40)) == T(0));
    CHECK(at(kernels::Activation::gelu_tanh, T(-40)) == T(0));
    CHECK(at(kernels::Activation::silu, T(-1000)) == T(0));
    CHECK(at(kernels::Activation::gelu_derivative, T(40)) == T(1));
    CHECK(at(kernels::Activation::exp, std::is_same_v<T, float> ? T(-88) : T(-709)) == T(0));  // subnormal: flushed
    for (const ActivationCase& c : activation_cases) {
      const std::string name = c.name;
      CAPTURE(name);
      CHECK(std::isnan(at(c.f, std::numeric_limits<T>::quiet_NaN())));
    }
  });
}

TEST_CASE_TEMPLATE("kernels::exp: overflow, underflow, infinities and NaN" * duet_test::every_isa, T, float, double) {
  constexpr T inf = std::numeric_limits<T>::infinity();
  const std::vector<T> x = {T(1000), inf, T(-1000), -inf, std::numeric_limits<T>::quiet_NaN(), T(0), T(-0.0)};
  duet_test::for_each_isa([&] {
    std::vector<T> y(x.size());
    kernels::exp(x.data(), static_cast<index_t>(x.size()), y.data());
    CHECK(y[0] == inf);
    CHECK(y[1] == inf);
    CHECK(y[2] == T(0));
    CHECK(y[3] == T(0));
    CHECK(std::isnan(y[4]));
    CHECK(y[5] == T(1));
    CHECK(y[6] == T(1));
  });
}

TEST_CASE("kernels: zero lengths read and write nothing" * duet_test::every_isa) {
  float guard = 5;
  duet_test::for_each_isa([&] {
    kernels::exp(&guard, 0, &guard);
    kernels::map<fn::Relu>(&guard, 0, &guard);
    CHECK(guard == 5);
    CHECK(kernels::sum(&guard, 0) == 0);
  });
}

template <class T>
std::vector<T> random_values(index_t n, double lo, double hi, std::mt19937& gen) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (T& x : v) x = static_cast<T>(u(gen));
  return v;
}

template <class T>
constexpr double tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-13;

// log Σ e^z in double, from the maximum.
template <class T>
double reference_lse(const std::vector<T>& z) {
  double m = -std::numeric_limits<double>::infinity();
  for (T x : z) m = std::max(m, static_cast<double>(x));
  double s = 0;
  for (T x : z) s += std::exp(static_cast<double>(x) - m);
  return m + std::log(s);
}

TEST_CASE_TEMPLATE("kernels: a row's softmax cross-entropy and its gradient against double precision" * duet_test::every_isa, T, float,
                   double) {
  std::mt19937 gen(3);
  for (index_t n : lengths) {
    CAPTURE(n);
    // Logits of magnitude 1e4 would overflow e^z without the maximum taken out first.
    for (double range : {1.0, 30.0, 1e4}) {
      CAPTURE(range);
      const auto z = random_values<T>(n, -range, range, gen);
      auto p = random_values<T>(n, 0, 1, gen);
      const double lse = reference_lse(z);
      const index_t label = n / 2;
      const double scale = 0.25;
      duet_test::for_each_isa([&] {
        const T got_lse = kernels::log_sum_exp(z.data(), n);
        CHECK(std::abs(static_cast<double>(got_lse) - lse) <= tolerance<T> * std::max(1.0, std::abs(lse)));
        // The rest from the kernel's lse: given it, the rounding of lse itself (1e-3 at 1e4 in
        // float) is not the kernels' to undo.
        const auto at = static_cast<double>(got_lse);
        double mass = 0, ce = 0, ce_magnitude = 0;
        std::vector<double> sparse(z.size()), dense(z.size());
        for (std::size_t i = 0; i < z.size(); ++i) {
          mass += static_cast<double>(p[i]);
          ce += static_cast<double>(p[i]) * (at - static_cast<double>(z[i]));
          ce_magnitude += static_cast<double>(p[i]) * (std::abs(at) + std::abs(static_cast<double>(z[i])));
        }
        for (std::size_t i = 0; i < z.size(); ++i) {
          const double softmax = std::exp(static_cast<double>(z[i]) - at);
          sparse[i] = (softmax - (static_cast<index_t>(i) == label ? 1.0 : 0.0)) * scale;
          dense[i] = (softmax * mass - static_cast<double>(p[i])) * scale;
        }
        CHECK(std::abs(static_cast<double>(kernels::sum(p.data(), n)) - mass) <= tolerance<T> * std::max(1.0, mass));
        const T got_ce = kernels::cross_entropy(z.data(), p.data(), n, got_lse);
        CHECK(std::abs(static_cast<double>(got_ce) - ce) <= tolerance<T> * ce_magnitude);
        std::vector<T> d(z.size() + 1, T(7));
        kernels::softmax_grad(z.data(), n, got_lse, label, T(scale), d.data());
        CHECK(duet_test::relative_difference(std::vector<double>(d.begin(), d.end() - 1), sparse) <= tolerance<T>);
        CHECK(d.back() == T(7));
        kernels::softmax_grad(z.data(), p.data(), n, got_lse, static_cast<T>(mass), T(scale), d.data());
        CHECK(duet_test::relative_difference(std::vector<double>(d.begin(), d.end() - 1), dense) <= tolerance<T>);
        CHECK(d.back() == T(7));
      });
    }
  }
}

TEST_CASE_TEMPLATE("kernels::map applies the functions' vector form, in place or not" * duet_test::every_isa, T, float, double) {
  std::mt19937 gen(5);
  for (index_t n : lengths) {
    CAPTURE(n);
    auto x = random_values<T>(n, -1, 1, gen);
    x[0] = std::numeric_limits<T>::quiet_NaN();
    if (n > 1) x.back() = T(-0.0);
    duet_test::for_each_isa([&] {
      std::vector<T> y(x.size() + 1, T(7));
      kernels::map<fn::Relu>(x.data(), n, y.data());
      bool same = std::isnan(y[0]);
      for (std::size_t i = 1; i < x.size(); ++i) {
        const double expected = std::max(static_cast<double>(x[i]), 0.0);
        same = same && static_cast<double>(y[i]) == expected &&
               std::signbit(y[i]) == std::signbit(fn::Relu::apply(x[i]));
      }
      CHECK(same);
      CHECK(y.back() == T(7));
      auto in_place = x;
      kernels::map<fn::Relu>(in_place.data(), n, in_place.data());
      CHECK(std::memcmp(in_place.data(), y.data(), x.size() * sizeof(T)) == 0);
    });
  }
}

// ReLU's gradient in registers (backend::Native::map_grad): Eigen's select's bits, the
// backend's other path, for NaN, -0 and zero outputs and any tail; in place or not.
TEST_CASE_TEMPLATE("kernels::map_grad gives the bits of Eigen's select" * duet_test::every_isa, T, float, double) {
  static_assert(kernels::VectorGradient<fn::Relu, T>);
  static_assert(!kernels::VectorGradient<fn::Elu, T>);
  std::mt19937 gen(4);
  for (index_t n : {1, 3, 8, 17, 64, 100}) {
    CAPTURE(n);
    std::vector<T> y = random_values<T>(n, -1, 1, gen), dy = random_values<T>(n, -2, 2, gen);
    y[0] = std::numeric_limits<T>::quiet_NaN();
    if (n > 2) y[1] = T(-0.0), y[2] = T(0), dy[2] = T(-0.0);
    std::vector<T> expected(y.size());
    backend::Eigen::map_grad<fn::Relu>(dy.data(), y.data(), n, expected.data());
    duet_test::for_each_isa([&] {
      std::vector<T> dx(y.size() + 1, T(7));
      kernels::map_grad<fn::Relu>(dy.data(), y.data(), n, dx.data());
      CHECK(std::memcmp(dx.data(), expected.data(), y.size() * sizeof(T)) == 0);
      CHECK(dx.back() == T(7));
      auto in_place = dy;
      kernels::map_grad<fn::Relu>(in_place.data(), y.data(), n, in_place.data());
      CHECK(std::memcmp(in_place.data(), expected.data(), y.size() * sizeof(T)) == 0);
    });
  }
}

// A layer's bias gradient (backend::Native::column_sums): every column summed in one order,
// x0 + ((x1 + x2) + (x3 + x4)) + ..., the rows past the last group of four one by one, whatever
// the set and the build (Eigen's colwise sum, which it replaces, orders the sums by its packet
// width, so by the build's -march, and the rows' count); within the rounding bound of a double
// sum; accumulating adds to what is there; nothing written past cols.
TEST_CASE_TEMPLATE("kernels::column_sums: one order of sums for every column, set and build" * duet_test::every_isa, T,
                   float, double) {
  std::mt19937 gen(12);
  for (index_t rows : {1, 2, 4, 5, 6, 9, 16, 17, 33, 50, 64, 255, 256}) {
    for (index_t cols : {1, 3, 10, 16, 17, 100, 512}) {
      CAPTURE(rows);
      CAPTURE(cols);
      const std::vector<T> x = random_values<T>(rows * cols, -100, 100, gen);
      std::vector<T> ordered(static_cast<std::size_t>(cols));
      for (index_t j = 0; j < cols; ++j) {
        const auto at = [&](index_t i) { return x[static_cast<std::size_t>(i * cols + j)]; };
        // Halves down to 16 rows, each run x₀ + ((x₁ + x₂) + (x₃ + x₄)) + ...
        const auto sum = [&](const auto& self, index_t r0, index_t r1) -> T {
          if (r1 - r0 > 16) {
            const index_t mid = r0 + (r1 - r0 + 1) / 2;
            return self(self, r0, mid) + self(self, mid, r1);
          }
          T s = at(r0);
          index_t r = r0 + 1;
          for (; r < r0 + ((r1 - r0 - 1) & ~index_t{3}); r += 4)
            s = s + ((at(r) + at(r + 1)) + (at(r + 2) + at(r + 3)));
          for (; r < r1; ++r) s = s + at(r);
          return s;
        };
        ordered[static_cast<std::size_t>(j)] = sum(sum, 0, rows);
      }
      duet_test::for_each_isa([&] {
        std::vector<T> sums(ordered.size() + 1, T(7));
        kernels::column_sums(x.data(), rows, cols, sums.data(), false);
        CHECK(std::memcmp(sums.data(), ordered.data(), ordered.size() * sizeof(T)) == 0);
        CHECK(sums.back() == T(7));
        for (index_t j = 0; j < cols; ++j) {
          double exact = 0;
          for (index_t r = 0; r < rows; ++r) exact += static_cast<double>(x[static_cast<std::size_t>(r * cols + j)]);
          // Each of the rows - 1 additions rounds by at most half an ulp of a sum below 100 · rows.
          const double bound = static_cast<double>(rows) * 100 * static_cast<double>(rows) *
                               static_cast<double>(std::numeric_limits<T>::epsilon());
          CHECK(std::abs(static_cast<double>(sums[static_cast<std::size_t>(j)]) - exact) <= bound);
        }
        kernels::column_sums(x.data(), rows, cols, sums.data(), true);
        for (index_t j = 0; j < cols; ++j) {
          const auto k = static_cast<std::size_t>(j);
          CHECK(sums[k] == ordered[k] + ordered[k]);
        }
      });
    }
  }
}

// The gradient all-reduce's packing (distributed.hpp): each element one IEEE product, so the
// bits of the scalar loop under every set, in place or not, nothing written past n.
TEST_CASE_TEMPLATE("kernels::scale multiplies as the scalar loop does, in place or not" * duet_test::every_isa, T, float,
                   double) {
  std::mt19937 gen(9);
  const T a = T(1) / T(3);
  for (index_t n : lengths) {
    CAPTURE(n);
    const auto x = random_values<T>(n, -1e3, 1e3, gen);
    duet_test::for_each_isa([&] {
      std::vector<T> y(x.size() + 1, T(7));
      kernels::scale(x.data(), n, a, y.data());
      bool same = true;
      for (std::size_t i = 0; i < x.size(); ++i) same = same && y[i] == x[i] * a;
      CHECK(same);
      CHECK(y.back() == T(7));
      auto in_place = x;
      kernels::scale(in_place.data(), n, a, in_place.data());
      CHECK(std::memcmp(in_place.data(), y.data(), x.size() * sizeof(T)) == 0);
    });
  }
}

// Binary operations (ops/arithmetic.hpp) on the kernels' vectors: every element the bits of the
// scalar Fn::apply, NaN from either side and signed zeros included, for a run or a broadcast
// value on each side, in place or not, nothing written past n; 70,001 elements are shared
// between threads.
template <class Fn, class T>
void check_binary(std::mt19937& gen) {
  std::vector<index_t> sizes = lengths;
  sizes.push_back(70001);
  for (index_t n : sizes) {
    auto a = random_values<T>(n, -1e3, 1e3, gen);
    auto b = random_values<T>(n, -1e3, 1e3, gen);
    a[0] = std::numeric_limits<T>::quiet_NaN();
    b[static_cast<std::size_t>(n / 2)] = std::numeric_limits<T>::quiet_NaN();
    a[static_cast<std::size_t>(n - 1)] = T(-0.0);
    b[static_cast<std::size_t>(n - 1)] = T(0.0);
    for (int runs = 0; runs < 4; ++runs) {
      const bool a_runs = (runs & 1) != 0;
      const bool b_runs = (runs & 2) != 0;
      CAPTURE(n);
      CAPTURE(a_runs);
      CAPTURE(b_runs);
      duet_test::for_each_isa([&] {
        std::vector<T> y(a.size() + 1, T(7));
        kernels::binary<Fn>(a.data(), a_runs, b.data(), b_runs, n, y.data());
        bool same = true;
        for (std::size_t i = 0; i < a.size(); ++i) {
          same = same && bits_of(y[i]) == bits_of(Fn::apply(a[a_runs ? i : 0], b[b_runs ? i : 0]));
        }
        CHECK(same);
        CHECK(y.back() == T(7));
        if (a_runs) {
          auto in_place = a;
          kernels::binary<Fn>(in_place.data(), true, b.data(), b_runs, n, in_place.data());
          CHECK(std::memcmp(in_place.data(), y.data(), a.size() * sizeof(T)) == 0);
        }
      });
    }
  }
}

TEST_CASE_TEMPLATE("kernels::binary gives the scalar function's bits" * duet_test::every_isa, T, float, double) {
  std::mt19937 gen(10);
  check_binary<fn::Add, T>(gen);
  check_binary<fn::Sub, T>(gen);
  check_binary<fn::Mul, T>(gen);
  check_binary<fn::Div, T>(gen);
  check_binary<fn::Maximum, T>(gen);
  check_binary<fn::Minimum, T>(gen);
}

// PyNative's bias addition: each element one IEEE sum, so the scalar loop's bits under every
// set, for row lengths around every vector width and rows enough to share the threads, in
// place or not, nothing written past the rows.
TEST_CASE_TEMPLATE("kernels::add_bias adds the bias to every row as the scalar loop does" * duet_test::every_isa, T, float,
                   double) {
  std::mt19937 gen(11);
  for (index_t cols : lengths) {
    for (index_t rows : {index_t{1}, index_t{3}, 70001 / cols + 1}) {
      CAPTURE(cols);
      CAPTURE(rows);
      const auto x = random_values<T>(rows * cols, -1e3, 1e3, gen);
      const auto bias = random_values<T>(cols, -1e3, 1e3, gen);
      duet_test::for_each_isa([&] {
        std::vector<T> y(x.size() + 1, T(7));
        kernels::add_bias(x.data(), rows, cols, bias.data(), y.data());
        bool same = true;
        for (std::size_t i = 0; i < x.size(); ++i) same = same && y[i] == x[i] + bias[i % static_cast<std::size_t>(cols)];
        CHECK(same);
        CHECK(y.back() == T(7));
        auto in_place = x;
        kernels::add_bias(in_place.data(), rows, cols, bias.data(), in_place.data());
        CHECK(std::memcmp(in_place.data(), y.data(), x.size() * sizeof(T)) == 0);
      });
    }
  }
}

}  // namespace

}  // namespace tests_kernels_elementwise
