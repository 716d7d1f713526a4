// Elementwise functions, where, comparisons (include/duet/ops/math.hpp) and the activations
// (include/duet/nn/activation.hpp): their cases in the gradient harness, and what the harness
// does not cover (cells in both modes, fusion into a product, training through it, NaN).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops_harness.hpp"

namespace tests_ops_math {

namespace {

using namespace duet_test::ops;
using duet_test::ops::D;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

const bool math_cases = add_cases([](std::multimap<std::string, Case>& m) {
  auto add = [&](std::string name, Case c) { m.emplace(std::move(name), std::move(c)); };
  const std::vector<Shape> one = {{3, 4}};
  auto unary = [&](std::string name, auto f, double (*reference)(double), double lo = -2.0, double hi = 2.0) {
    add(std::move(name), make_case<1>(one, f, [reference](double a, double) { return reference(a); }, lo, hi));
  };
  // Domains where each is smooth: log, sqrt and rsqrt on positives, abs on either side of 0.
  unary("exp", [](const auto& a) { return duet::ops::exp(a); }, [](double a) { return std::exp(a); });
  unary("log", [](const auto& a) { return duet::ops::log(a); }, [](double a) { return std::log(a); }, 0.2, 3.0);
  unary("log1p", [](const auto& a) { return duet::ops::log1p(a); }, [](double a) { return std::log1p(a); }, -0.8, 3.0);
  unary("expm1", [](const auto& a) { return duet::ops::expm1(a); }, [](double a) { return std::expm1(a); });
  unary("sin", [](const auto& a) { return duet::ops::sin(a); }, [](double a) { return std::sin(a); }, -4.0, 4.0);
  unary("cos", [](const auto& a) { return duet::ops::cos(a); }, [](double a) { return std::cos(a); }, -4.0, 4.0);
  unary("erf", [](const auto& a) { return duet::ops::erf(a); }, [](double a) { return std::erf(a); }, -3.0, 3.0);
  unary("sqrt", [](const auto& a) { return duet::ops::sqrt(a); }, [](double a) { return std::sqrt(a); }, 0.2, 3.0);
  unary("rsqrt", [](const auto& a) { return duet::ops::rsqrt(a); }, [](double a) { return 1.0 / std::sqrt(a); }, 0.2,
        3.0);
  unary("abs", [](const auto& a) { return duet::ops::abs(a); }, [](double a) { return std::fabs(a); }, 0.1, 2.0);
  unary("abs", [](const auto& a) { return duet::ops::abs(a); }, [](double a) { return std::fabs(a); }, -2.0, -0.1);
  unary("square", [](const auto& a) { return duet::ops::square(a); }, [](double a) { return a * a; });
  unary("clip_by_value", [](const auto& a) { return duet::ops::clip_by_value(a, -0.5, 0.8); },
        [](double a) { return std::min(std::max(a, -0.5), 0.8); });

  unary("relu", [](const auto& a) { return duet::ops::relu(a); }, [](double a) { return std::max(a, 0.0); });
  unary("sigmoid", [](const auto& a) { return duet::ops::sigmoid(a); }, sigmoid, -6.0, 6.0);
  unary("tanh", [](const auto& a) { return duet::ops::tanh(a); }, [](double a) { return std::tanh(a); });
  unary("gelu", [](const auto& a) { return duet::ops::gelu(a); },
        [](double a) { return 0.5 * a * (1.0 + std::erf(a / std::sqrt(2.0))); }, -4.0, 4.0);
  unary("gelu_tanh", [](const auto& a) { return duet::ops::gelu<true>(a); },
        [](double a) {
          const double pi = std::acos(-1.0);
          return 0.5 * a * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (a + 0.044715 * a * a * a)));
        },
        -4.0, 4.0);
  unary("silu", [](const auto& a) { return duet::ops::silu(a); }, [](double a) { return a * sigmoid(a); }, -4.0, 4.0);
  unary("leaky_relu", [](const auto& a) { return duet::ops::leaky_relu(a, 0.1); },
        [](double a) { return a > 0 ? a : 0.1 * a; });
  unary("leaky_relu", [](const auto& a) { return duet::ops::leaky_relu(a); },
        [](double a) { return a > 0 ? a : 0.2 * a; });
  unary("elu", [](const auto& a) { return duet::ops::elu(a, 0.7); },
        [](double a) { return a > 0 ? a : 0.7 * std::expm1(a); });
  // beta 1.5 and threshold 2 put the linear part (x > 4/3) inside the domain.
  unary("softplus", [](const auto& a) { return duet::ops::softplus(a, 1.5, 2.0); },
        [](double a) { return 1.5 * a > 2.0 ? a : std::log1p(std::exp(1.5 * a)) / 1.5; });
  unary("softplus", [](const auto& a) { return duet::ops::softplus(a); },
        [](double a) { return std::log1p(std::exp(a)); }, -6.0, 6.0);

  // where, its condition made by each comparison from the inputs themselves: the condition
  // gets no gradient, and no perturbation of finite differences flips it.
  const std::vector<std::vector<Shape>> pairs = {{{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 1}, {1, 4}}, {{}, {2, 3}}};
  for (const auto& p : pairs) {
    add("where", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::greater(a, b), a * a, b); },
                              [](double a, double b) { return a > b ? a * a : b; }));
    add("greater", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::greater(a, b), a, b); },
                                [](double a, double b) { return a > b ? a : b; }));
    add("less", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::less(a, b), a, b); },
                             [](double a, double b) { return a < b ? a : b; }));
    add("greater_equal",
        make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::greater_equal(a, b), a, b); },
                     [](double a, double b) { return a >= b ? a : b; }));
    add("less_equal",
        make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::less_equal(a, b), a, b); },
                     [](double a, double b) { return a <= b ? a : b; }));
    add("equal", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::equal(a, b), a, b); },
                              [](double a, double b) { return a == b ? a : b; }));
    add("not_equal",
        make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::not_equal(a, b), a, b); },
                     [](double a, double b) { return a != b ? a : b; }));
  }
  // Against numbers, on either side, and a condition broadcast against both branches.
  add("greater", make_case<2>({{3, 4}, {3, 4}},
                              [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::greater(a, 0.5), a, b); },
                              [](double a, double b) { return a > 0.5 ? a : b; }));
  add("less", make_case<2>({{3, 4}, {3, 4}},
                           [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::less(0.5, a), a, b); },
                           [](double a, double b) { return 0.5 < a ? a : b; }));
  add("where", make_case<2>({{3, 1}, {3, 4}},
                            [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::less_equal(a, 0.0), a, b); },
                            [](double a, double b) { return a <= 0.0 ? a : b; }));
  // tril and triu: square, wide and tall matrices, a batch of them, diagonals above and below.
  const auto triangle = [](bool lower, duet::index_t k) {
    return [lower, k](const std::vector<D>& xs) {
      D y = xs[0].clone();
      const Shape& s = y.shape();
      const duet::index_t rows = s[s.rank() - 2], cols = s[s.rank() - 1];
      for (duet::index_t e = 0; e < y.numel(); ++e) {
        const duet::index_t i = (e / cols) % rows, j = e % cols;
        if (lower ? j - i > k : j - i < k) y.data()[e] = 0;
      }
      return y;
    };
  };
  for (const Shape& s : std::vector<Shape>{{4, 4}, {3, 5}, {5, 3}, {2, 3, 4}}) {
    for (const duet::index_t k : {0, 1, -1}) {
      add("tril", make_case_with_reference<1>({s}, [k](const auto& a) { return duet::ops::tril(a, k); }, triangle(true, k)));
      add("triu", make_case_with_reference<1>({s}, [k](const auto& a) { return duet::ops::triu(a, k); }, triangle(false, k)));
    }
  }
  // With a value written outside the triangle (tril(scores, 0, -1e9) is a causal mask); its gradient is 0 there.
  const auto filled_triangle = [](bool lower, duet::index_t k, double value) {
    return [lower, k, value](const std::vector<D>& xs) {
      D y = xs[0].clone();
      const Shape& s = y.shape();
      const duet::index_t rows = s[s.rank() - 2], cols = s[s.rank() - 1];
      for (duet::index_t e = 0; e < y.numel(); ++e) {
        const duet::index_t i = (e / cols) % rows, j = e % cols;
        if (lower ? j - i > k : j - i < k) y.data()[e] = value;
      }
      return y;
    };
  };
  add("tril",
      make_case_with_reference<1>(
          {{2, 4, 4}}, [](const auto& a) { return duet::ops::tril(a, 0, -3.5); }, filled_triangle(true, 0, -3.5)));
  add("triu",
      make_case_with_reference<1>(
          {{3, 5}}, [](const auto& a) { return duet::ops::triu(a, -1, 2.5); }, filled_triangle(false, -1, 2.5)));
  // A number for either branch (PyTorch's masked_fill), the tensor broadcast against the condition.
  for (const auto& p : std::vector<std::vector<Shape>>{{{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 1}, {1, 4}}}) {
    add("where", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::greater(a, 0.0), -3.0, b); },
                              [](double a, double b) { return a > 0 ? -3.0 : b; }));
    add("where", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::where(duet::ops::greater(a, 0.0), b, 2.5); },
                              [](double a, double b) { return a > 0 ? b : 2.5; }));
  }
});

}  // namespace

using namespace duet;
using duet_test::ModeGuard;

namespace {

// Every activation cell after a product, in one network: each product takes its activation as
// its epilogue in graph mode.
template <auto Setting>
struct ActivationNet : nn::Cell<ActivationNet<Setting>, Setting> {
  nn::SequentialCell<nn::Dense<6, 8>, nn::Sigmoid, nn::Dense<8, 8>, nn::Tanh, nn::Dense<8, 8>, nn::GELU,
                     nn::Dense<8, 8>, nn::GELUExact, nn::Dense<8, 8>, nn::SiLU, nn::Dense<8, 8>, nn::LeakyReLU,
                     nn::Dense<8, 8>, nn::ELU, nn::Dense<8, 8>, nn::Softplus, nn::Dense<8, 3>>
      seq;
  DUET_CELL_MEMBERS(seq);
  auto construct(auto x) { return seq(x); }
};

template <class T>
bool same_bits(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return a.shape() == b.shape() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

// f on tensors, eagerly (PyNative) or compiled (graph mode).
template <class F, class... X>
auto in_mode(Mode m, F f, const X&... x) {
  set_context({.mode = m});
  if (m == GRAPH_MODE) return jit(f)(x...);
  return f(x...);
}

}  // namespace

TEST_CASE("activation cells in a SequentialCell: the same output and gradients, bit for bit, in both modes") {
  ModeGuard guard;
  set_seed(3);
  ActivationNet<CONTEXT_MODE> net;
  const Tensor x = uniform<float>({37, 6}, -2.0f, 2.0f);
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  const Tensor target = uniform<float>({37, 3}, -1.0f, 1.0f);
  std::vector<Tensor> outputs;
  std::vector<std::vector<Tensor>> grads;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    outputs.push_back(net(x));
    grads.push_back(value_and_grad(with_loss, net.parameters())(x, target).grads);
  }
  CHECK(same_bits(outputs[0], outputs[1]));
  REQUIRE(grads[0].size() == 18);
  for (std::size_t p = 0; p < grads[0].size(); ++p) {
    INFO("parameter ", net.parameters()[p].name);
    CHECK(same_bits(grads[0][p], grads[1][p]));
    CHECK(std::any_of(grads[0][p].data(), grads[0][p].data() + grads[0][p].numel(), [](float g) { return g != 0.0f; }));
  }
}

TEST_CASE("graph_ir: each product takes the activation after it as its epilogue") {
  ActivationNet<GRAPH_MODE> net;
  const GraphIR ir = graph_ir(net, shape<dyn, 6>);
  const std::string& text = ir.optimized.text;
  INFO(text);
  for (const char* fused : {"MatMul + BiasAdd + Sigmoid(", "MatMul + BiasAdd + Tanh(", "MatMul + BiasAdd + GELU(tanh)(",
                            "MatMul + BiasAdd + GELU(erf)(", "MatMul + BiasAdd + SiLU(", "MatMul + BiasAdd + LeakyReLU(",
                            "MatMul + BiasAdd + ELU(", "MatMul + BiasAdd + Softplus("}) {
    CHECK(text.find(fused) != std::string::npos);
  }
}

namespace {

template <auto Setting, class Act>
struct DenseAct : nn::Cell<DenseAct<Setting, Act>, Setting> {
  nn::Dense<5, 16> fc1;
  Act act;
  nn::Dense<16, 2> fc2;
  DUET_CELL_MEMBERS(fc1, act, fc2);
  auto construct(auto x) { return fc2(act(fc1(x))); }
};

// Trains the network for a few Adam steps in the given mode; returns the losses and the
// final weights.
template <class Act>
std::pair<std::vector<float>, std::vector<Tensor>> train_in(Mode mode) {
  set_context({.mode = mode});
  set_seed(11);
  DenseAct<CONTEXT_MODE, Act> net;
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 1e-2});
  nn::TrainOneStepCell step(with_loss, adam);
  Generator gen(4);
  const Tensor x = uniform<float>({32, 5}, -2.0f, 2.0f, gen);
  const Tensor target = uniform<float>({32, 2}, -1.0f, 1.0f, gen);
  std::vector<float> losses;
  for (int i = 0; i < 20; ++i) losses.push_back(step(x, target).item());
  std::vector<Tensor> weights;
  for (const auto& p : net.parameters()) weights.push_back(p.parameter->clone());
  return {losses, weights};
}

}  // namespace

TEST_CASE_TEMPLATE("training through a Dense and an activation is the same in both modes, and learns", Act, nn::GELU,
                   nn::GELUExact, nn::SiLU, nn::Sigmoid, nn::Tanh, nn::LeakyReLU, nn::ELU, nn::Softplus) {
  ModeGuard guard;
  const auto [pynative_losses, pynative_weights] = train_in<Act>(PYNATIVE_MODE);
  const auto [graph_losses, graph_weights] = train_in<Act>(GRAPH_MODE);
  CHECK(pynative_losses == graph_losses);
  for (std::size_t p = 0; p < pynative_weights.size(); ++p) CHECK(same_bits(pynative_weights[p], graph_weights[p]));
  CHECK(pynative_losses.back() < 0.8f * pynative_losses.front());
}

TEST_CASE("a product in a graph being trained takes only activations whose gradient its output gives") {
  using Sigmoid = ops::MatMulOp<nn::Dense<5, 16>, true, fn::Sigmoid>;
  using Gelu = ops::MatMulOp<nn::Dense<5, 16>, true, fn::Gelu<true>>;
  static_assert(passes::absorbs<ops::MatMulOp<nn::Dense<5, 16>, true>, ops::MapOp<fn::Sigmoid>, true>);
  static_assert(!passes::absorbs<ops::MatMulOp<nn::Dense<5, 16>, true>, ops::MapOp<fn::Gelu<true>>, true>);
  static_assert(!passes::absorbs<ops::MatMulOp<nn::Dense<5, 16>, true>, ops::MapOp<fn::Silu>, true>);
  static_assert(passes::absorbs<ops::MatMulOp<nn::Dense<5, 16>, true>, ops::MapOp<fn::Gelu<true>>, false>);
  static_assert(DifferentiableOperation<Sigmoid> && !DifferentiableOperation<Gelu>);
  CHECK(Sigmoid::op_name() == "MatMul + BiasAdd + Sigmoid");
}

TEST_CASE("a chain of functions fuses into one pass in graph mode and computes PyNative's bits") {
  ModeGuard guard;
  auto chain = [](const auto& x) { return ops::softplus(ops::tanh(ops::exp(ops::square(x))), 2.0); };
  const Tensor x = uniform<float>({3001}, -1.5f, 1.5f);
  set_context({.mode = PYNATIVE_MODE});
  const Tensor eager = chain(x);
  auto fused = jit(chain);
  const Tensor compiled = fused(x);
  CHECK(same_bits(eager, compiled));
  // The four added later, through the whole-array and the vector-and-tail paths alike.
  auto trig = [](const auto& v) { return ops::log1p(ops::square(ops::sin(v * 3.0f))) + ops::expm1(ops::cos(v)); };
  const Tensor trig_eager = trig(x);
  CHECK(same_bits(trig_eager, jit(trig)(x)));
  for (index_t i = 0; i < x.numel(); i += 250) {
    const double v = x.data()[i];
    CHECK(trig_eager.data()[i] == doctest::Approx(std::log1p(std::pow(std::sin(v * 3), 2)) + std::expm1(std::cos(v))).epsilon(1e-5));
  }
}

TEST_CASE("a broadcasting product fused with exp, sin, log1p: PyNative's bits, rows shorter than a vector") {
  // The epilogue ran per row of the broadcast, each row shorter than a vector taking Eigen's
  // scalar path, while PyNative maps the whole output: 122 of 512 elements of exp(x * w)
  // differed by an ulp (helper-74).
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  for (const Shape& shape : {Shape{256, 2}, Shape{333, 3}, Shape{2, 700}}) {
    CAPTURE(to_string(shape));
    const Tensor x = uniform<float>(shape, -1.5f, 1.5f, 21);
    const Tensor w = uniform<float>({1, shape[1]}, 0.5f, 1.5f, 22);
    const auto fused = [](const auto& a, const auto& b) {
      return ops::exp(a * b) + ops::sin(ops::log1p(ops::abs(a + b)));
    };
    CHECK(same_bits(fused(x, w), jit(fused)(x, w)));
    const auto epilogue = [](const auto& a, const auto& b) { return ops::expm1(ops::cos(a - b)); };
    CHECK(same_bits(epilogue(x, w), jit(epilogue)(x, w)));
  }
}

TEST_CASE("log1p and expm1 keep the digits log(1 + x) and exp(x) - 1 lose near 0") {
  const Tensor tiny({2}, {1e-10f, -3e-9f});
  CHECK(ops::log1p(tiny)(0) == doctest::Approx(1e-10).epsilon(1e-6));
  CHECK(ops::expm1(tiny)(1) == doctest::Approx(-3e-9).epsilon(1e-6));
  CHECK(ops::log(1.0f + tiny)(0) == 0.0f);  // what they replace: 1 + 1e-10 rounds to 1
}

TEST_CASE("sqrt and rsqrt are IEEE's correctly rounded root in both modes, the same bits on every processor") {
  // Eigen's default vectorised root is an estimate refined once, whose bits differ between
  // Intel and AMD: on one of them sqrt(4) was not 2.
  ModeGuard guard;
  std::vector<float> values;
  for (int i = 0; i <= 300; ++i) values.push_back(float(i * i));
  const Tensor spread = uniform<float>({4000}, 0.0f, 1.0e4f);
  for (std::int64_t i = 0; i < spread.numel(); ++i) values.push_back(spread(i));
  for (float tiny : {1e-38f, 1e-40f, 3e-45f}) values.push_back(tiny);
  const auto n = static_cast<std::int64_t>(values.size());
  const Tensor x({n}, values);
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    const Tensor root = in_mode(m, [](const auto& v) { return ops::sqrt(v); }, x);
    const Tensor inverse = in_mode(m, [](const auto& v) { return ops::rsqrt(v); }, x);
    std::int64_t wrong_root = 0, wrong_inverse = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      wrong_root += root(i) != std::sqrt(x(i));
      wrong_inverse += inverse(i) != 1.0f / std::sqrt(x(i));
    }
    CHECK(wrong_root == 0);
    CHECK(wrong_inverse == 0);
    CHECK(root(2) == 2.0f);
  }
}

TEST_CASE("out of their domain the functions give IEEE's answer, in both modes, never an error") {
  ModeGuard guard;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tensor x({4}, {-1.0f, 0.0f, nan, 4.0f});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    const Tensor log = in_mode(m, [](const auto& v) { return ops::log(v); }, x);
    CHECK(std::isnan(log(0)));
    CHECK(log(1) == -inf);
    CHECK(std::isnan(log(2)));
    const Tensor root = in_mode(m, [](const auto& v) { return ops::sqrt(v); }, x);
    CHECK(std::isnan(root(0)));
    CHECK(root(3) == 2.0f);
    CHECK(in_mode(m, [](const auto& v) { return ops::rsqrt(v); }, x)(1) == inf);
    const Tensor clipped = in_mode(m, [](const auto& v) { return ops::clip_by_value(v, -0.5, 0.5); }, x);
    CHECK(clipped(0) == -0.5f);
    CHECK(std::isnan(clipped(2)));
    CHECK(clipped(3) == 0.5f);
    const Tensor all = in_mode(
        m,
        [](const auto& v) {
          return ops::sigmoid(v) + ops::tanh(v) + ops::gelu(v) + ops::gelu<true>(v) + ops::silu(v) + ops::leaky_relu(v) +
                 ops::elu(v) + ops::softplus(v) + ops::exp(v) + ops::abs(v) + ops::square(v);
        },
        x);
    CHECK(std::isnan(all(2)));
  }
  // Saturation, not overflow: sigmoid of ±100 is 1 and e^-100, softplus of 1000 is 1000.
  const Tensor big({2}, {100.0f, -100.0f});
  CHECK(ops::sigmoid(big)(0) == 1.0f);
  CHECK(ops::sigmoid(big)(1) < 1e-40f);  // e^-100, a subnormal float
  CHECK(ops::softplus(Tensor({1}, {1000.0f}))(0) == 1000.0f);
  CHECK(ops::tanh(big)(1) == -1.0f);
}

TEST_CASE("abs has derivative 0 at 0, and clip_by_value passes the gradient at its bounds") {
  ModeGuard guard;
  const Tensor x({3}, {-2.0f, 0.0f, 3.0f});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    const Tensor g = grad([](const auto& v) { return ops::abs(v) * 1.0f; })(x);
    CHECK(g(0) == -1.0f);
    CHECK(g(1) == 0.0f);
    CHECK(g(2) == 1.0f);
    const Tensor c = grad([](const auto& v) { return ops::clip_by_value(v, 0.0, 3.0) * 1.0f; })(x);
    CHECK(c(0) == 0.0f);
    CHECK(c(1) == 1.0f);
    CHECK(c(2) == 1.0f);
  }
}

TEST_CASE("comparisons make UInt8 0/1 with broadcasting and ties, against tensors and numbers") {
  ModeGuard guard;
  const Tensor a({2, 3}, {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f});
  const Tensor b({3}, {2.0f, 2.0f, 7.0f});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    const auto gt = in_mode(m, [](const auto& p, const auto& q) { return ops::greater(p, q); }, a, b);
    const auto ge = in_mode(m, [](const auto& p, const auto& q) { return ops::greater_equal(p, q); }, a, b);
    const auto eq = in_mode(m, [](const auto& p, const auto& q) { return ops::equal(p, q); }, a, b);
    const auto ne = in_mode(m, [](const auto& p, const auto& q) { return ops::not_equal(p, q); }, a, b);
    const auto lt = in_mode(m, [](const auto& p, const auto& q) { return ops::less(p, q); }, a, b);
    const auto le = in_mode(m, [](const auto& p, const auto& q) { return ops::less_equal(p, q); }, a, b);
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(gt)>, BasicTensor<std::uint8_t>>);
    const std::vector<int> expect_gt{0, 0, 0, 1, 1, 0}, expect_ge{0, 1, 0, 1, 1, 0}, expect_eq{0, 1, 0, 0, 0, 0};
    for (index_t i = 0; i < 6; ++i) {
      CHECK(gt.data()[i] == expect_gt[static_cast<std::size_t>(i)]);
      CHECK(ge.data()[i] == expect_ge[static_cast<std::size_t>(i)]);
      CHECK(eq.data()[i] == expect_eq[static_cast<std::size_t>(i)]);
      CHECK(ne.data()[i] == 1 - expect_eq[static_cast<std::size_t>(i)]);
      CHECK(lt.data()[i] == 1 - expect_ge[static_cast<std::size_t>(i)]);
      CHECK(le.data()[i] == 1 - expect_gt[static_cast<std::size_t>(i)]);
    }
  }
  const BasicTensor<std::uint8_t> left = ops::greater(3.0f, a);  // 3 > a
  const BasicTensor<std::uint8_t> right = ops::less(a, 3.0f);
  CHECK(std::equal(left.data(), left.data() + 6, right.data()));
  CHECK(left.data()[1] == 1);
  CHECK(left.data()[2] == 0);
}

TEST_CASE("a comparison under a PyNative tape or in a differentiated graph is no error: its output carries no gradient") {
  ModeGuard guard;
  const Tensor x({4}, {-1.0f, 2.0f, -3.0f, 4.0f});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    // |x| written with where: the gradient reaches x through both branches, not the condition.
    const Tensor g = grad([](const auto& v) { return ops::where(ops::greater(v, 0.0f), v, -v) * 1.0f; })(x);
    CHECK(g(0) == -1.0f);
    CHECK(g(1) == 1.0f);
    CHECK(g(2) == -1.0f);
    CHECK(g(3) == 1.0f);
  }
}

TEST_CASE("where and comparisons name the shapes that do not broadcast") {
  try {
    static_cast<void>(ops::where(ops::greater(ones({2, 3}), 0.0f), ones({4}), ones({4})));
    FAIL("no error");
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("Select") != std::string::npos);
    CHECK(std::string(e.what()).find("[2, 3]") != std::string::npos);
    CHECK(std::string(e.what()).find("[4]") != std::string::npos);
  }
  CHECK_THROWS_AS(static_cast<void>(ops::less(ones({2, 3}), ones({2}))), ShapeError);
}

TEST_CASE("activations with a parameter check it where they are made") {
  CHECK_THROWS_AS(static_cast<void>(ops::leaky_relu(ones({2}), -0.1)), ValueError);
  CHECK_THROWS_AS(nn::ELU(-1.0), ValueError);
  CHECK_THROWS_AS(nn::Softplus(0.0), ValueError);
  nn::LeakyReLU leaky(0.5);
  CHECK(leaky(Tensor({2}, {-2.0f, 2.0f}))(0) == -1.0f);
  CHECK(leaky.type_name() == "nn::LeakyReLU");
  nn::Softplus soft(2.0, 1.0);  // linear above x = 0.5
  CHECK(soft(Tensor({1}, {0.75f}))(0) == 0.75f);
}

}  // namespace tests_ops_math
