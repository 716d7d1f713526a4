// Gradients in both modes against central finite differences in double precision, and the
// two modes against each other.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support.hpp"

namespace tests_autodiff {

using namespace duet;
using duet_test::ModeGuard;

namespace {

using Tensor64 = BasicTensor<double>;

template <class T>
double sum_of(const BasicTensor<T>& t) {
  double s = 0;
  for (index_t i = 0; i < t.numel(); ++i) s += static_cast<double>(t.data()[i]);
  return s;
}

// Compares every gradient value_and_grad gives (the first input's, then each parameter's)
// with central differences of the sum of fn's output, sampling up to 40 entries of each.
template <class Fn, class... X>
void check_against_finite_differences(Fn& fn, std::vector<nn::BasicParameter<double>*> params, Tensor64 x,
                                      const X&... rest) {
  auto vg = value_and_grad(fn, params, 0);
  const auto analytic = vg(x, rest...);
  const auto value = [&] {
    EagerScope eager;
    return sum_of(BasicTensor<double>(fn(x, rest...)));
  };
  std::vector<double*> targets{x.data()};
  std::vector<index_t> sizes{x.numel()};
  for (auto* p : params) {
    targets.push_back(p->data());
    sizes.push_back(p->numel());
  }
  REQUIRE(analytic.grads.size() == targets.size());
  const double h = 1e-6;
  for (std::size_t t = 0; t < targets.size(); ++t) {
    REQUIRE(analytic.grads[t].numel() == sizes[t]);
    const index_t stride = std::max<index_t>(1, sizes[t] / 40);
    for (index_t i = 0; i < sizes[t]; i += stride) {
      double& v = targets[t][i];
      const double saved = v;
      v = saved + h;
      const double up = value();
      v = saved - h;
      const double down = value();
      v = saved;
      const double numeric = (up - down) / (2 * h);
      CHECK(analytic.grads[t].data()[i] == doctest::Approx(numeric).epsilon(1e-5).scale(1.0));
    }
  }
}

template <bool Sparse, Reduction R>
struct Classifier : nn::Cell<Classifier<Sparse, R>, CONTEXT_MODE, double> {
  nn::BasicFlatten<double> flatten;
  nn::Dense<12, 7, double> hidden;
  nn::BasicReLU<double> relu;
  nn::Dense<7, 5, double> out;
  nn::BasicSoftmaxCrossEntropyWithLogits<Sparse, R, double> loss;
  DUET_CELL_MEMBERS(flatten, hidden, relu, out, loss);
  auto construct(auto x, auto labels) { return loss(out(relu(hidden(flatten(x)))), labels); }
  std::vector<nn::BasicParameter<double>*> params() { return {&hidden.weight, &hidden.bias, &out.weight, &out.bias}; }
};

template <Reduction R>
struct Regressor : nn::Cell<Regressor<R>, CONTEXT_MODE, double> {
  nn::Dense<6, 4, double> hidden;
  nn::BasicReLU<double> relu;
  nn::Dense<4, 3, double> out;
  nn::BasicMSELoss<R, double> loss;
  DUET_CELL_MEMBERS(hidden, relu, out, loss);
  auto construct(auto x, auto target) { return loss(out(relu(hidden(x))), target); }
  std::vector<nn::BasicParameter<double>*> params() { return {&hidden.weight, &hidden.bias, &out.weight, &out.bias}; }
};

const BasicTensor<std::int32_t> sparse_labels({5}, {0, 4, 2, 2, 1});

Tensor64 one_hot_like_distribution() {
  Tensor64 p = uniform<double>({5, 5}, 0.0, 1.0, 77);
  for (index_t r = 0; r < 5; ++r) {
    double s = 0;
    for (index_t c = 0; c < 5; ++c) s += p(r, c);
    for (index_t c = 0; c < 5; ++c) p(r, c) /= s;
  }
  return p;
}

template <class Net, class... X>
void check_in_both_modes(Net& net, const Tensor64& x, const X&... rest) {
  ModeGuard guard;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(static_cast<int>(m));
    set_context({.mode = m});
    check_against_finite_differences(net, net.params(), x.clone(), rest...);
  }
}

}  // namespace

TEST_CASE("Dense, ReLU, Flatten and SoftmaxCrossEntropyWithLogits (sparse) against finite differences") {
  set_seed(1);
  const Tensor64 x = randn<double>({5, 3, 4}, 3);
  Classifier<true, Reduction::mean> mean;
  check_in_both_modes(mean, x, sparse_labels);
  Classifier<true, Reduction::sum> sum;
  check_in_both_modes(sum, x, sparse_labels);
  Classifier<true, Reduction::none> none;
  check_in_both_modes(none, x, sparse_labels);
}

TEST_CASE("SoftmaxCrossEntropyWithLogits with distributions as labels against finite differences") {
  set_seed(2);
  const Tensor64 x = randn<double>({5, 3, 4}, 4);
  const Tensor64 p = one_hot_like_distribution();
  Classifier<false, Reduction::mean> mean;
  check_in_both_modes(mean, x, p);
  Classifier<false, Reduction::none> none;
  check_in_both_modes(none, x, p);
}

TEST_CASE("MSELoss against finite differences, every reduction") {
  set_seed(3);
  const Tensor64 x = randn<double>({5, 6}, 5);
  const Tensor64 target = randn<double>({5, 3}, 6);
  Regressor<Reduction::mean> mean;
  check_in_both_modes(mean, x, target);
  Regressor<Reduction::sum> sum;
  check_in_both_modes(sum, x, target);
  Regressor<Reduction::none> none;
  check_in_both_modes(none, x, target);
}

TEST_CASE("the seed network's gradients agree between modes within 1e-5 relative") {
  ModeGuard guard;
  duet_test::SeedNetwork<> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  auto vg = value_and_grad(with_loss, net.parameters(), 0);
  const Tensor x = randn({16, 1, 28, 28}, 8);
  BasicTensor<std::int32_t> labels({16});
  for (index_t i = 0; i < 16; ++i) labels(i) = static_cast<std::int32_t>(i % 10);
  set_context({.mode = PYNATIVE_MODE});
  const auto eager = vg(x, labels);
  set_context({.mode = GRAPH_MODE});
  const auto graph = vg(x, labels);
  CHECK(eager.value.item() == doctest::Approx(graph.value.item()).epsilon(1e-6));
  REQUIRE(eager.grads.size() == 7);
  for (std::size_t i = 0; i < eager.grads.size(); ++i) {
    CHECK(duet_test::relative_difference(duet_test::values_of(graph.grads[i]), duet_test::values_of(eager.grads[i])) <=
          1e-5);
  }
}

TEST_CASE("grad: of a function of tensors, and an input the output does not depend on") {
  ModeGuard guard;
  nn::Dense<3, 2, double> dense;
  auto f = [&](const auto& x, const auto& unused) {
    (void)unused;
    return dense(x);
  };
  const Tensor64 x = randn<double>({4, 3}, 1);
  const Tensor64 y = randn<double>({2}, 2);
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    const Tensor64 dx = grad(f)(x, y);
    // d sum(x · Wᵀ + b)/dx[r][i] = sum_o W[o][i].
    for (index_t r = 0; r < 4; ++r) {
      for (index_t i = 0; i < 3; ++i) CHECK(dx(r, i) == doctest::Approx(dense.weight(0, i) + dense.weight(1, i)));
    }
    const auto grads = value_and_grad(f, std::vector<nn::BasicParameter<double>*>{&dense.bias}, 1)(x, y).grads;
    REQUIRE(grads.size() == 2);
    for (double g : grads[0].values()) CHECK(g == 0.0);  // the unused input
    for (double g : grads[1].values()) CHECK(g == 4.0);  // the bias, summed over 4 rows
  }
}


TEST_CASE("value_and_grad: a grad_position chosen at run time (std::optional), or None (std::nullopt)") {
  ModeGuard guard;
  nn::Dense<3, 2, double> dense;
  auto f = [&](const auto& x) { return dense(x); };
  const Tensor64 x = randn<double>({4, 3}, 1);
  const std::vector<nn::BasicParameter<double>*> bias{&dense.bias};
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    for (const std::optional<std::size_t> position : {std::optional<std::size_t>{}, std::optional<std::size_t>{0}}) {
      const auto grads = value_and_grad(f, bias, position)(x).grads;
      REQUIRE(grads.size() == (position ? 2u : 1u));
      if (position) CHECK(std::ranges::equal(grads[0].values(), grad(f)(x).values()));
      for (double g : grads.back().values()) CHECK(g == 4.0);
    }
    CHECK(value_and_grad(f, bias, std::nullopt)(x).grads.size() == 1);
    CHECK(value_and_grad(f, std::optional<std::size_t>{})(x).grads.empty());
  }
}
namespace {
// WGAN-GP's gradient penalty, written as in PyTorch: the critic's gradient with respect to its
// input, inside the loss, then differentiated with respect to the critic's weights.
struct Critic : nn::Cell<Critic, PYNATIVE_MODE> {
  nn::Dense<2, 1> fc;
  DUET_CELL_MEMBERS(fc);
  Tensor construct(const Tensor& x) { return fc(x); }
};
struct Penalty : nn::Cell<Penalty, PYNATIVE_MODE> {
  Critic& critic;
  explicit Penalty(Critic& c) : critic(c) {}
  DUET_CELL_MEMBERS(critic);
  Tensor construct(const Tensor& x) {
    const Tensor g = duet::grad([this](const Tensor& a) { return ops::sum(critic(a)); })(x);
    return ops::mean(ops::square(ops::sqrt(ops::sum(ops::square(g), ops::axes<1>)) - 1.0f));
  }
};
}  // namespace

TEST_CASE("a gradient of a gradient (WGAN-GP's penalty) is refused, and the message says why") {
  Critic critic;
  Penalty penalty(critic);
  const Tensor x = randn({4, 2}, 1);
  CHECK_THROWS_WITH_AS(value_and_grad(penalty, penalty.parameters())(x),
                       doctest::Contains("A gradient was taken inside it (duet::grad or value_and_grad): that gradient "
                                         "is a constant to this one, as torch.autograd.grad's is without "
                                         "create_graph=True; duet has no gradient of a gradient"),
                       ValueError);
  // A loss that reaches nothing, with no gradient inside, says only that.
  CHECK_THROWS_WITH_AS(value_and_grad([](const Tensor& a) { return ops::sum(ops::stop_gradient(a)); })(x),
                       duet::nothing_differentiated_message, ValueError);
}

TEST_CASE("gradients of a parameter used twice add up") {
  ModeGuard guard;
  nn::Dense<2, 2, double> dense;
  auto twice = [&](const auto& x) { return dense(dense(x)); };
  const Tensor64 x = randn<double>({3, 2}, 4);
  std::vector<nn::BasicParameter<double>*> params{&dense.weight, &dense.bias};
  set_context({.mode = PYNATIVE_MODE});
  const auto eager = value_and_grad(twice, params, 0)(x);
  set_context({.mode = GRAPH_MODE});
  const auto graph = value_and_grad(twice, params, 0)(x);
  const auto h = 1e-6;
  for (index_t i = 0; i < 4; ++i) {
    double& w = dense.weight.data()[i];
    const double saved = w;
    w = saved + h;
    const double up = sum_of(BasicTensor<double>(twice(x)));
    w = saved - h;
    const double down = sum_of(BasicTensor<double>(twice(x)));
    w = saved;
    CHECK(eager.grads[1].data()[i] == doctest::Approx((up - down) / (2 * h)).epsilon(1e-6));
    CHECK(graph.grads[1].data()[i] == doctest::Approx(eager.grads[1].data()[i]).epsilon(1e-12));
  }
}

TEST_CASE("softmax cross-entropy is stable for logits of magnitude 1e4") {
  ModeGuard guard;
  const Tensor z({2, 3}, {1e4f, -1e4f, 0.0f, -1e4f, -1e4f, 1e4f});
  const BasicTensor<std::int32_t> labels({2}, {0, 1});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    nn::SoftmaxCrossEntropyWithLogits<true> loss;
    const Tensor l = loss(z, labels);
    CHECK(l(0) == doctest::Approx(0.0));
    CHECK(l(1) == doctest::Approx(2e4).epsilon(1e-6));
    const Tensor dz =
        grad([](const auto& logits, const auto& y) { return ops::softmax_cross_entropy<true>(logits, y); })(z, labels);
    for (float v : dz.values()) CHECK(std::isfinite(v));
  }
}

TEST_CASE("out-of-range labels are a duet error, not a crash") {
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  CHECK_THROWS_WITH_AS(loss(zeros({2, 3}), BasicTensor<std::int32_t>({2}, {0, 3})),
                       "nn::SoftmaxCrossEntropyWithLogits: label 3 of sample 1 is outside [0, 3)", ValueError);
  CHECK_THROWS_WITH_AS(loss(zeros({2, 3}), BasicTensor<std::int32_t>({3}, {0, 1, 2})),
                       "nn::SoftmaxCrossEntropyWithLogits expects class labels of shape [2]: the logits' [2, 3] "
                       "without the last axis, which holds the classes (PyTorch's [N, C, d...] logits are [N, d..., "
                       "C] here), got [3]",
                       ShapeError);
  // Distributions have the logits' shape.
  nn::SoftmaxCrossEntropyWithLogits<false, Reduction::mean> dense;
  CHECK_THROWS_WITH_AS(dense(zeros({2, 3}), zeros({2, 4})),
                       "nn::SoftmaxCrossEntropyWithLogits expects labels of the logits' shape [2, 3], a distribution "
                       "over the classes (the last axis) per row, got [2, 4] (class indices are int32)",
                       ShapeError);
  nn::CrossEntropyLoss<> cross_entropy;
  CHECK_THROWS_WITH_AS(cross_entropy(zeros({8, 16, 38}), BasicTensor<std::int32_t>({128})),
                       "nn::CrossEntropyLoss expects class labels of shape [8, 16]: the logits' [8, 16, 38] without "
                       "the last axis, which holds the classes (PyTorch's [N, C, d...] logits are [N, d..., C] here), "
                       "got [128]",
                       ShapeError);
}

namespace {
// a * b, whose author declared input 1 without a gradient.
struct HalfProductGrad : ops::Primitive<HalfProductGrad> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input1};
  static constexpr int arity = 2;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.output_shape.numel(); ++i) a.out<T>()[i] = a.in<T>(0)[i] * a.in<T>(1)[i];
  }
  static std::string op_name() { return "HalfProductGrad"; }
};
struct HalfProduct : ops::Primitive<HalfProduct> {
  static constexpr int arity = 2;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.output_shape.numel(); ++i) a.out<T>()[i] = a.in<T>(0)[i] * a.in<T>(1)[i];
  }
  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    if constexpr (K == 0) return HalfProductGrad{};
    else return ops::NoGradient{};
  }
  static std::string op_name() { return "HalfProduct"; }
};
}  // namespace

TEST_CASE("grad: a gradient that reaches an input declared ops::NoGradient is a ValueError, not a zero") {
  ModeGuard guard;
  const auto f = [](const auto& a, const auto& b) { return ops::sum(apply(HalfProduct{}, a, b)); };
  const Tensor a = ones({2, 2}) * 3.0f;
  const Tensor b = ones({2, 2});
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    try {
      static_cast<void>(grad(f, 1)(a, b));
      FAIL("no error");
    } catch (const ValueError& e) {
      CHECK(std::string(e.what()) ==
            "duet::grad: HalfProduct has no gradient for input 1 (its grad_op<1>() is ops::NoGradient), but that "
            "input depends on what is differentiated: its gradient would be a silent zero");
    }
    // Input 0's gradient is given, and input 1 not differentiated: no error.
    const Tensor da = grad(f, 0)(a, b);
    CHECK(da.data()[0] == 1.0f);
  }
}

}  // namespace tests_autodiff
