#include <cmath>
#include <cstdint>
#include <vector>

#include "support.hpp"

namespace tests_initializer {

using namespace duet;
using duet_test::ModeGuard;
namespace init = duet::initializer;

namespace {

// Sample statistics in double precision.
struct Moments {
  double n = 0, mean = 0, variance = 0, min = 0, max = 0;
};

template <class T>
Moments moments_of(const BasicTensor<T>& t) {
  Moments m;
  m.n = static_cast<double>(t.numel());
  m.min = m.max = static_cast<double>(t.data()[0]);
  for (T v : t.values()) {
    m.mean += static_cast<double>(v);
    m.min = std::min(m.min, static_cast<double>(v));
    m.max = std::max(m.max, static_cast<double>(v));
  }
  m.mean /= m.n;
  for (T v : t.values()) m.variance += (static_cast<double>(v) - m.mean) * (static_cast<double>(v) - m.mean);
  m.variance /= m.n;
  return m;
}

// Every tolerance is 5 standard deviations of the statistic for the sample size: the fixed
// seeds make the tests deterministic, and a wrong bound or scale moves a statistic by far more.
constexpr double sigmas = 5;

// U(-b, b): mean 0 (sd b / sqrt(3n)), variance b²/3 (sd b² sqrt(4 / (45 n))), every value in
// [-b, b], and both ends reached to within 40 / n of b (missed with probability e^-20).
template <class T>
void check_uniform(const BasicTensor<T>& t, double b) {
  const Moments m = moments_of(t);
  CHECK(std::abs(m.mean) < sigmas * b / std::sqrt(3 * m.n));
  CHECK(std::abs(m.variance - b * b / 3) < sigmas * b * b * std::sqrt(4 / (45 * m.n)));
  CHECK(m.min >= -b);
  CHECK(m.max <= b);
  CHECK(m.max > b * (1 - 40 / m.n));
  CHECK(m.min < -b * (1 - 40 / m.n));
}

// N(mean, sigma²): sample mean (sd sigma / sqrt(n)), variance (sd sigma² sqrt(2 / n)), and the
// share within one sigma of the mean, 0.682689 (sd sqrt(p (1 - p) / n)): a uniform of the same
// variance would have 0.577.
template <class T>
void check_normal(const BasicTensor<T>& t, double mean, double sigma) {
  const Moments m = moments_of(t);
  CHECK(std::abs(m.mean - mean) < sigmas * sigma / std::sqrt(m.n));
  CHECK(std::abs(m.variance - sigma * sigma) < sigmas * sigma * sigma * std::sqrt(2 / m.n));
  double within = 0;
  for (T v : t.values()) within += std::abs(static_cast<double>(v) - mean) < sigma ? 1 : 0;
  const double p = 0.682689492137;
  CHECK(std::abs(within / m.n - p) < sigmas * std::sqrt(p * (1 - p) / m.n));
}

// MindSpore's _calculate_fan_in_and_fan_out, as its Python reads.
init::Fans mindspore_fans(const std::vector<index_t>& shape) {
  index_t receptive_field_size = 1;
  for (std::size_t i = 2; i < shape.size(); ++i) receptive_field_size *= shape[i];
  return {shape[1] * receptive_field_size, shape[0] * receptive_field_size};
}

template <class T>
bool same_values(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  if (!(a.shape() == b.shape())) return false;
  for (index_t i = 0; i < a.numel(); ++i) {
    if (a.data()[i] != b.data()[i]) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("initializer: fan_in and fan_out follow MindSpore for 2-D and higher-rank weights") {
  CHECK(init::fan_in_and_fan_out({512, 784}) == init::Fans{784, 512});
  const std::vector<std::vector<index_t>> shapes{{512, 784}, {4, 3, 2}, {8, 3, 5, 5}, {16, 8, 3, 3, 3}, {1, 1}};
  for (const auto& dims : shapes) {
    Shape s;
    for (index_t d : dims) s.push_back(d);
    CAPTURE(to_string(s));
    CHECK(init::fan_in_and_fan_out(s) == mindspore_fans(dims));
  }
  CHECK(init::fan_in_and_fan_out({8, 3, 5, 5}) == init::Fans{75, 200});
  CHECK_THROWS_WITH_AS(init::fan_in_and_fan_out({10}),
                       "initializer::fan_in_and_fan_out: fan_in and fan_out are computed for a concrete shape of at "
                       "least 2 dimensions, got [10]",
                       ValueError);
  CHECK_THROWS_AS(init::fan_in_and_fan_out(Shape{}), ValueError);
  CHECK_THROWS_AS(init::fan_in_and_fan_out({dyn, 3}), ValueError);
}

TEST_CASE("initializer: gains are MindSpore's") {
  using init::Nonlinearity;
  CHECK(init::calculate_gain(Nonlinearity::linear) == 1);
  CHECK(init::calculate_gain(Nonlinearity::sigmoid) == 1);
  CHECK(init::calculate_gain(Nonlinearity::tanh) == 5.0 / 3);
  CHECK(init::calculate_gain(Nonlinearity::relu) == std::sqrt(2.0));
  CHECK(init::calculate_gain(Nonlinearity::leaky_relu) == std::sqrt(2.0 / (1 + 0.01 * 0.01)));
  CHECK(init::calculate_gain(Nonlinearity::leaky_relu, 0.2) == std::sqrt(2.0 / 1.04));
  CHECK(init::calculate_gain(Nonlinearity::leaky_relu, 0) == std::sqrt(2.0));
}

TEST_CASE("initializer: Normal and Uniform have MindSpore's defaults and their distributions") {
  set_seed(1);
  check_normal(init::initializer(init::Normal{}, {1000, 200}), 0, 0.01);
  check_normal(init::initializer<double>(init::Normal{.sigma = 0.5, .mean = 2}, {200000}), 2, 0.5);
  check_uniform(init::initializer(init::Uniform{}, {1000, 200}), 0.07);
  check_uniform(init::initializer<double>(init::Uniform{3}, {400, 500}), 3);
}

TEST_CASE("initializer: XavierUniform, HeUniform and HeNormal scale by the fans of the shape") {
  set_seed(2);
  using init::FanMode;
  using init::Nonlinearity;
  // [out, in, k]: fan_in 300 * 4, fan_out 150 * 4.
  check_uniform(init::initializer(init::XavierUniform{}, {150, 300, 4}), std::sqrt(6.0 / (1200 + 600)));
  check_uniform(init::initializer(init::XavierUniform{.gain = 2}, {500, 400}), 2 * std::sqrt(6.0 / 900));
  // MindSpore's default negative_slope is 0: leaky_relu's gain is sqrt(2).
  check_uniform(init::initializer(init::HeUniform{}, {64, 3, 5, 5}), std::sqrt(2.0) * std::sqrt(3.0 / 75));
  check_uniform(init::initializer(init::HeUniform{.mode = FanMode::fan_out, .nonlinearity = Nonlinearity::relu},
                                  {64, 3, 5, 5}),
                std::sqrt(2.0) * std::sqrt(3.0 / (64 * 25)));
  check_normal(init::initializer(init::HeNormal{}, {500, 400}), 0, std::sqrt(2.0) / std::sqrt(400.0));
  check_normal(init::initializer<double>(
                   init::HeNormal{.negative_slope = 0.2, .mode = FanMode::fan_out}, {500, 400}),
               0, std::sqrt(2.0 / 1.04) / std::sqrt(500.0));
  check_normal(init::initializer(init::HeNormal{.nonlinearity = Nonlinearity::tanh}, {80, 10, 250}), 0,
               (5.0 / 3) / std::sqrt(2500.0));
}

TEST_CASE("initializer: Zero, One and Constant fill exactly, integer tensors too") {
  const auto check_all = [](const auto& t, double v) {
    for (auto x : t.values()) CHECK(static_cast<double>(x) == v);
  };
  check_all(init::initializer(init::Zero{}, {3, 4}), 0);
  check_all(init::initializer(init::One{}, {3, 4}), 1);
  check_all(init::initializer(init::Constant{0.25}, {5}), 0.25);
  check_all(init::initializer<double>(init::Constant{1e300}, {2}), 1e300);
  check_all(init::initializer<std::int32_t>(init::Constant{-7}, {6}), -7);
  check_all(init::initializer<std::uint8_t>(init::Constant{255}, {6}), 255);
  check_all(init::initializer<std::int64_t>(init::One{}, {2, 2}), 1);
  // The random ones fill floating-point tensors only: for an integer tensor they do not compile.
  static_assert(init::Initializer<init::Constant, std::int32_t>);
  static_assert(init::Initializer<init::Zero, std::uint8_t>);
  static_assert(!init::Initializer<init::HeNormal, std::int32_t>);
  static_assert(!init::Initializer<init::Uniform, std::int64_t>);
  static_assert(init::Initializer<init::XavierUniform, double>);
}

TEST_CASE("initializer: the same seed gives the same values, constants draw nothing") {
  set_seed(11);
  const auto a = init::initializer(init::HeNormal{}, {64, 32});
  const auto a2 = init::initializer(init::XavierUniform{}, {64, 32});
  set_seed(11);
  const auto b = init::initializer(init::HeNormal{}, {64, 32});
  const auto b2 = init::initializer(init::XavierUniform{}, {64, 32});
  CHECK(same_values(a, b));
  CHECK(same_values(a2, b2));
  set_seed(12);
  CHECK(!same_values(a, init::initializer(init::HeNormal{}, {64, 32})));

  // A generator of one's own: the global one does not move.
  Generator g1(5), g2(5);
  Tensor x({10, 10}), y({10, 10});
  set_seed(3);
  init::initialize(x, init::Uniform{}, g1);
  const auto next = uniform({4});
  init::initialize(y, init::Uniform{}, g2);
  CHECK(same_values(x, y));
  set_seed(3);
  CHECK(same_values(next, uniform({4})));

  // Zero, One and Constant leave the generator where it was, so choosing a zero bias does not
  // change the weights drawn after it.
  set_seed(3);
  Tensor z({8});
  init::initialize(z, init::Zero{});
  init::initialize(z, init::Constant{2});
  CHECK(same_values(next, uniform({4})));
}

TEST_CASE("initializer: initialize writes a parameter in place and moves its version") {
  nn::Parameter p(Tensor({6, 4}));
  const float* before = p.data();
  const auto version = p.version();
  init::initialize(p, init::XavierUniform{});
  CHECK(p.data() == before);
  CHECK(p.version() != version);
  const double bound = std::sqrt(6.0 / 10);
  for (float v : p.values()) CHECK(std::abs(v) <= bound);
}

TEST_CASE("initializer: nn::Dense's default is MindSpore's, bit for bit what it always drew") {
  // Before initialisers were options, Dense drew U(-1/sqrt(in), 1/sqrt(in)) for the weight, then
  // for the bias, from the global generator.
  const auto old_dense = [](index_t in, index_t out, std::uint64_t seed) {
    Generator gen(seed);
    const float bound = 1.0f / std::sqrt(static_cast<float>(in));
    auto w = uniform<float>({out, in}, -bound, bound, gen);
    auto b = uniform<float>({out}, -bound, bound, gen);
    return std::pair{w, b};
  };
  for (const auto& sizes : std::vector<std::pair<index_t, index_t>>{{784, 512}, {512, 512}, {3, 7}, {20, 10}}) {
    const index_t in = sizes.first;
    const index_t out = sizes.second;
    CAPTURE(in);
    set_seed(3);
    nn::Dense<> dense(in, out);
    const auto [w, b] = old_dense(in, out, 3);
    CHECK(same_values(dense.weight, w));
    CHECK(same_values(dense.bias, b));
    // ... which is HeUniform(negative_slope = sqrt(5)) then Uniform(1 / sqrt(in)), as MindSpore's nn.Dense.
    set_seed(3);
    const auto he = init::initializer(init::HeUniform{.negative_slope = std::sqrt(5.0)}, {out, in});
    const auto bias = init::initializer(init::Uniform{1 / std::sqrt(static_cast<double>(in))}, {out});
    CHECK(same_values(dense.weight, he));
    CHECK(same_values(dense.bias, bias));
  }
  set_seed(4);
  nn::Dense<dyn, dyn, double> d(30, 6);
  Generator gen(4);
  const double bound = 1.0 / std::sqrt(30.0);
  CHECK(same_values(d.weight, uniform<double>({6, 30}, -bound, bound, gen)));
  CHECK(same_values(d.bias, uniform<double>({6}, -bound, bound, gen)));
}

TEST_CASE("initializer: nn::Dense takes weight_init and bias_init, drawn in that order") {
  set_seed(8);
  nn::Dense<784, 512> fc{{.weight_init = init::HeNormal{}, .bias_init = init::Zero{}}};
  check_normal(fc.weight, 0, std::sqrt(2.0) / 28);
  for (float v : fc.bias.values()) CHECK(v == 0);
  set_seed(8);
  CHECK(same_values(fc.weight, init::initializer(init::HeNormal{}, {512, 784})));

  set_seed(9);
  nn::Dense<> runtime(30, 20, {.weight_init = init::Normal{0.1}});
  set_seed(9);
  const auto w = init::initializer(init::Normal{0.1}, {20, 30});
  const auto b = init::initializer(init::Uniform{1 / std::sqrt(30.0)}, {20});
  CHECK(same_values(runtime.weight, w));
  CHECK(same_values(runtime.bias, b));

  nn::Dense<4, 2> only_bias{{.bias_init = init::Constant{0.5}}};
  for (float v : only_bias.bias.values()) CHECK(v == 0.5f);
}

namespace {
// A user's initialiser: 0, 1, 2, ... times a step. Dense and initialize take it as they take
// the built-in ones.
struct Ramp {
  double step = 1;
  std::string name() const { return "Ramp"; }
  template <std::floating_point T>
  void fill(BasicTensor<T>& t, Generator&) const {
    for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<T>(static_cast<double>(i) * step);
  }
};
}  // namespace

TEST_CASE("initializer: a user's initialiser works wherever the built-in ones do") {
  nn::Dense<3, 2> dense{{.weight_init = Ramp{0.5}, .bias_init = Ramp{}}};
  CHECK(dense.weight(1, 2) == 2.5f);
  CHECK(dense.bias(1) == 1.0f);
  Tensor t({4});
  init::initialize(t, Ramp{2});
  CHECK(t(3) == 6.0f);
  static_assert(init::Initializer<Ramp, float> && !init::Initializer<Ramp, std::int32_t>);
}

namespace {
template <auto M = CONTEXT_MODE>
struct InitNet : nn::Cell<InitNet<M>, M> {
  nn::Dense<16, 32> fc1{{.weight_init = init::HeNormal{.nonlinearity = init::Nonlinearity::relu},
                         .bias_init = init::Zero{}}};
  nn::ReLU relu;
  nn::Dense<32, 32> fc2{{.weight_init = init::HeUniform{.mode = init::FanMode::fan_out}}};
  nn::ReLU relu2;
  nn::Dense<32, 4> fc3{{.weight_init = init::XavierUniform{}, .bias_init = init::Constant{0.1}}};
  DUET_CELL_MEMBERS(fc1, relu, fc2, relu2, fc3);

  auto construct(auto x) { return fc3(relu2(fc2(relu(fc1(x))))); }
};

template <class Net>
std::vector<std::vector<float>> parameter_values(Net& net) {
  std::vector<std::vector<float>> out;
  for (const auto& p : net.parameters()) out.emplace_back(p.parameter->data(), p.parameter->data() + p.parameter->numel());
  return out;
}
}  // namespace

TEST_CASE("initializer: a network built in either mode gets the same weights and gives the same output") {
  ModeGuard guard;
  const Tensor x = randn({5, 16}, 21);
  set_context({.mode = PYNATIVE_MODE});
  set_seed(17);
  InitNet<> eager;
  const Tensor eager_out = eager(x);
  set_context({.mode = GRAPH_MODE});
  set_seed(17);
  InitNet<> graph;
  const Tensor graph_out = graph(x);
  CHECK(parameter_values(eager) == parameter_values(graph));
  CHECK(same_values(eager_out, graph_out));

  // Cells whose mode is fixed, built under the opposite context.
  set_seed(17);
  InitNet<GRAPH_MODE> fixed_graph;
  set_context({.mode = PYNATIVE_MODE});
  set_seed(17);
  InitNet<PYNATIVE_MODE> fixed_eager;
  CHECK(parameter_values(fixed_graph) == parameter_values(eager));
  CHECK(parameter_values(fixed_eager) == parameter_values(eager));
  CHECK(same_values(fixed_graph(x), eager_out));
  CHECK(same_values(fixed_eager(x), eager_out));
}

TEST_CASE("initializer: bad arguments are ValueErrors naming the initialiser") {
  Tensor t({4, 3});
  CHECK_THROWS_WITH_AS(init::initialize(t, init::Normal{.sigma = -1}),
                       "initializer::Normal(sigma=-1, mean=0): sigma must be finite and at least 0, got -1",
                       ValueError);
  CHECK_THROWS_WITH_AS(init::initialize(t, init::Normal{.mean = NAN}),
                       "initializer::Normal(sigma=0.01, mean=nan): mean must be a finite number, got nan", ValueError);
  CHECK_THROWS_WITH_AS(init::initialize(t, init::Uniform{-0.5}),
                       "initializer::Uniform(scale=-0.5): scale must be finite and at least 0, got -0.5", ValueError);
  CHECK_THROWS_AS(init::initialize(t, init::Uniform{INFINITY}), ValueError);
  CHECK_THROWS_WITH_AS(init::initialize(t, init::XavierUniform{.gain = INFINITY}),
                       "initializer::XavierUniform(gain=inf): gain must be a finite number, got inf", ValueError);
  CHECK_THROWS_WITH_AS(init::initialize(t, init::HeUniform{.negative_slope = NAN}),
                       "initializer::HeUniform(negative_slope=nan, mode=fan_in, nonlinearity=leaky_relu): "
                       "negative_slope must be a finite number, got nan",
                       ValueError);
  Tensor bias({3});
  CHECK_THROWS_WITH_AS(init::initialize(bias, init::HeNormal{}),
                       "initializer::HeNormal(negative_slope=0, mode=fan_in, nonlinearity=leaky_relu): fan_in and "
                       "fan_out are computed for a concrete shape of at least 2 dimensions, got [3]",
                       ValueError);
  Tensor empty({0, 5});
  CHECK_THROWS_WITH_AS(init::initialize(empty, init::HeUniform{.mode = init::FanMode::fan_out}),
                       "initializer::HeUniform(negative_slope=0, mode=fan_out, nonlinearity=leaky_relu): fan_out is 0 "
                       "for shape [0, 5]",
                       ValueError);
  CHECK_NOTHROW(init::initialize(empty, init::XavierUniform{}));  // fan_in + fan_out is 5: nothing to draw
}

TEST_CASE("initializer: Constant refuses a value the tensor's type cannot hold") {
  BasicTensor<std::int32_t> i({3});
  CHECK_THROWS_WITH_AS(init::initialize(i, init::Constant{0.5}),
                       "initializer::Constant(value=0.5): a tensor of Int32 cannot hold 0.5 exactly", ValueError);
  CHECK_THROWS_AS(init::initialize(i, init::Constant{3e9}), ValueError);
  BasicTensor<std::uint8_t> u({3});
  CHECK_THROWS_AS(init::initialize(u, init::Constant{256}), ValueError);
  CHECK_THROWS_AS(init::initialize(u, init::Constant{-1}), ValueError);
  Tensor f({3});
  CHECK_THROWS_WITH_AS(init::initialize(f, init::Constant{1e39}),
                       "initializer::Constant(value=1e+39): a tensor of Float32 cannot hold 1e+39 (not finite, or out "
                       "of its range)",
                       ValueError);
  CHECK_THROWS_AS(init::initialize(f, init::Constant{NAN}), ValueError);
}

TEST_CASE("initializer: nn::Dense names itself and the option when an initialiser fails") {
  CHECK_THROWS_WITH_AS((nn::Dense<4, 3>{{.bias_init = init::HeUniform{}}}),
                       "nn::Dense<4, 3> bias_init: initializer::HeUniform(negative_slope=0, mode=fan_in, "
                       "nonlinearity=leaky_relu): fan_in and fan_out are computed for a concrete shape of at least 2 "
                       "dimensions, got [3]",
                       ValueError);
  CHECK_THROWS_WITH_AS((nn::Dense<>(4, 3, {.weight_init = init::Normal{.sigma = -2}})),
                       "nn::Dense<dyn, dyn> weight_init: initializer::Normal(sigma=-2, mean=0): sigma must be finite "
                       "and at least 0, got -2",
                       ValueError);
}

}  // namespace tests_initializer
