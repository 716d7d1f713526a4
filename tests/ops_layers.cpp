// Layers and losses (include/duet/nn/normalization.hpp, include/duet/nn/loss.hpp): their cases
// in the gradient harness, each value against plain loops in double that write out PyTorch's
// formula, and what the harness does not cover (LayerNorm's parameter gradients, errors,
// training through WithLossCell in both modes).
#include <limits>

#include "ops_harness.hpp"

namespace tests_ops_layers {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using duet::Reduction;
using Labels = duet::BasicTensor<std::int32_t>;

Labels labels_of(std::initializer_list<std::int32_t> values) {
  Labels l({static_cast<index_t>(values.size())});
  std::copy(values.begin(), values.end(), l.data());
  return l;
}

// Per-element (or per-row) losses as the reduction R gives them.
D reduced(const std::vector<double>& per, const Shape& none_shape, Reduction r, double count) {
  if (r == Reduction::none) {
    D out = duet::zeros<double>(none_shape);
    std::copy(per.begin(), per.end(), out.data());
    return out;
  }
  double total = 0;
  for (double v : per) total += v;
  D out = duet::zeros<double>(Shape{});
  out.data()[0] = r == Reduction::sum ? total : count == 0 ? 0.0 : total / count;
  return out;
}

// PyTorch's torch.nn.LayerNorm over the last axis: (x - E[x]) / sqrt(Var[x] + eps) · γ + β,
// Var the biased variance.
D layer_norm_reference(const D& x, const D& gamma, const D& beta, double eps) {
  const index_t n = gamma.numel();
  D y = duet::zeros<double>(x.shape());
  for (index_t r = 0; r < x.numel() / n; ++r) {
    double mean = 0, var = 0;
    for (index_t j = 0; j < n; ++j) mean += x.data()[r * n + j] / static_cast<double>(n);
    for (index_t j = 0; j < n; ++j) {
      const double d = x.data()[r * n + j] - mean;
      var += d * d / static_cast<double>(n);
    }
    for (index_t j = 0; j < n; ++j) {
      y.data()[r * n + j] = (x.data()[r * n + j] - mean) / std::sqrt(var + eps) * gamma.data()[j] + beta.data()[j];
    }
  }
  return y;
}

// PyTorch's formulas of the pointwise losses, one element at a time.
double l1(double x, double y) { return std::abs(x - y); }
double smooth_l1(double x, double y, double beta) {
  const double d = std::abs(x - y);
  return d < beta ? 0.5 * d * d / beta : d - 0.5 * beta;
}
double kl_div(double x, double y) { return y == 0 ? 0.0 : y * (std::log(y) - x); }
// torch.nn.functional.binary_cross_entropy, its logs clamped at -100.
double bce(double x, double y) {
  return -(y * std::max(std::log(x), -100.0) + (1 - y) * std::max(std::log(1 - x), -100.0));
}
double bce_with_logits(double x, double y) {
  const double s = 1 / (1 + std::exp(-x));
  return -(y * std::log(s) + (1 - y) * std::log(1 - s));
}

// torch.nn.functional.cross_entropy / nll_loss with label_smoothing ε, classes on the last
// axis: per row -Σ_c q_c lp_c, lp = log_softmax(z) (or z itself for NLL), q the one-hot class
// or the distribution p, smoothed to (1 - ε) q + ε / C. Rows labelled ignore_index give 0 and
// do not count in the mean.
struct ClassLossReference {
  bool logits;
  double smoothing;
  Reduction r;
  std::int32_t ignore_index = -100;

  D operator()(const D& z, const Labels* sparse, const D* dense) const {
    const index_t classes = z.shape().back();
    const index_t rows = z.numel() / classes;
    std::vector<double> per;
    double counted = 0;
    for (index_t i = 0; i < rows; ++i) {
      std::vector<double> lp(static_cast<std::size_t>(classes));
      double m = -INFINITY, s = 0;
      for (index_t c = 0; c < classes; ++c) m = std::max(m, z.data()[i * classes + c]);
      for (index_t c = 0; c < classes; ++c) s += std::exp(z.data()[i * classes + c] - m);
      for (index_t c = 0; c < classes; ++c) {
        lp[static_cast<std::size_t>(c)] = z.data()[i * classes + c] - (logits ? m + std::log(s) : 0.0);
      }
      if (sparse != nullptr && sparse->data()[i] == ignore_index) {
        per.push_back(0.0);
        continue;
      }
      double loss = 0;
      for (index_t c = 0; c < classes; ++c) {
        const double target = sparse != nullptr ? (sparse->data()[i] == c ? 1.0 : 0.0) : dense->data()[i * classes + c];
        loss -= ((1 - smoothing) * target + smoothing / static_cast<double>(classes)) * lp[static_cast<std::size_t>(c)];
      }
      per.push_back(loss);
      ++counted;
    }
    Shape rows_shape;
    for (int a = 0; a + 1 < z.shape().rank(); ++a) rows_shape.push_back(z.shape()[a]);
    return reduced(per, rows_shape, r, counted);
  }
};

template <Reduction R>
void add_loss_cases(std::multimap<std::string, Case>& m) {
  auto pointwise = [&](std::string name, auto f, auto element, double lo, double hi) {
    const std::vector<Shape> shapes = {{3, 4}, {3, 4}};
    Case c = case_of<2>(shapes, f, lo, hi);
    c.reference = [element](const std::vector<D>& xs) {
      std::vector<double> per;
      for (index_t j = 0; j < xs[0].numel(); ++j) per.push_back(element(xs[0].data()[j], xs[1].data()[j]));
      return reduced(per, xs[0].shape(), R, static_cast<double>(xs[0].numel()));
    };
    m.emplace(std::move(name), std::move(c));
  };
  pointwise("l1_loss", [](const auto& x, const auto& y) { return duet::ops::l1_loss<R>(x, y); }, l1, -2.0, 2.0);
  pointwise("smooth_l1_loss", [](const auto& x, const auto& y) { return duet::ops::smooth_l1_loss<R>(x, y, 0.7); },
            [](double x, double y) { return smooth_l1(x, y, 0.7); }, -2.0, 2.0);
  // Targets must be probabilities (positive) for log y.
  pointwise("kl_div", [](const auto& x, const auto& y) { return duet::ops::kl_div<R>(x, y); }, kl_div, 0.1, 2.0);
  // Probabilities on both sides, away from 0 and 1 where the logs' clamps would bend the slope.
  pointwise("binary_cross_entropy", [](const auto& x, const auto& y) { return duet::ops::binary_cross_entropy<R>(x, y); },
            bce, 0.05, 0.95);
  pointwise("binary_cross_entropy_with_logits",
            [](const auto& x, const auto& y) { return duet::ops::binary_cross_entropy_with_logits<R>(x, y); },
            bce_with_logits, -2.0, 2.0);

  // Class losses: sparse labels (one of them ignored), with and without label smoothing.
  const Labels labels = labels_of({1, 3, -100, 0});
  const Labels labels_3d = labels_of({2, 0, 1, 1, 2, 0}).reshape({2, 3});
  for (double eps : {0.0, 0.2}) {
    const duet::ops::CrossEntropyOptions options{.label_smoothing = eps};
    for (bool logits : {false, true}) {
      const ClassLossReference ref{logits, eps, R};
      // Graph capture needs each function generic and free of run-time branches: one per loss.
      auto add = [&](const Shape& shape, const Labels& l) {
        auto cross_entropy = [options](const auto& z, const auto& y) { return duet::ops::cross_entropy<R>(z, y, options); };
        auto nll = [options](const auto& z, const auto& y) { return duet::ops::nll_loss<R>(z, y, options); };
        Case c = logits ? case_of<1>({shape}, cross_entropy, -2.0, 2.0, l) : case_of<1>({shape}, nll, -2.0, 2.0, l);
        c.reference = [ref, l](const std::vector<D>& xs) { return ref(xs[0], &l, nullptr); };
        m.emplace(logits ? "cross_entropy" : "nll_loss", std::move(c));
      };
      add({4, 5}, labels);
      add({2, 3, 3}, labels_3d);
    }
    // Dense targets: both inputs differentiated.
    Case c = case_of<2>({{3, 4}, {3, 4}}, [options](const auto& z, const auto& p) {
      return duet::ops::cross_entropy<R>(z, p, options);
    }, -2.0, 2.0);
    c.reference = [ref = ClassLossReference{true, eps, R}](const std::vector<D>& xs) {
      return ref(xs[0], nullptr, &xs[1]);
    };
    m.emplace("cross_entropy", std::move(c));
  }
}

const bool layer_cases = add_cases([](std::multimap<std::string, Case>& m) {
  add_loss_cases<Reduction::none>(m);
  add_loss_cases<Reduction::mean>(m);
  add_loss_cases<Reduction::sum>(m);
  // KLDivLoss's batchmean: the sum over the size of axis 0 (MindSpore's), on 2-D and 3-D inputs.
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 3, 2}}) {
    Case c = case_of<2>({shape, shape}, [](const auto& x, const auto& y) { return duet::ops::kl_div<Reduction::batchmean>(x, y); },
                        0.1, 2.0);
    c.reference = [](const std::vector<D>& xs) {
      std::vector<double> per;
      for (index_t j = 0; j < xs[0].numel(); ++j) per.push_back(kl_div(xs[0].data()[j], xs[1].data()[j]));
      return reduced(per, xs[0].shape(), Reduction::mean, static_cast<double>(xs[0].shape()[0]));
    };
    m.emplace("kl_div", std::move(c));
  }
  // LayerNorm with gamma and beta away from their ones and zeros, so that both matter.
  for (const Shape& shape : {Shape{3, 5}, Shape{2, 3, 4}}) {
    const index_t n = shape.back();
    auto norm = std::make_shared<duet::nn::LayerNorm<duet::dyn, double>>(n, 1e-5);
    norm->gamma.set_data(random_input({n}, 0.5, 1.5, 100));
    norm->beta.set_data(random_input({n}, -1.0, 1.0, 101));
    Case c = case_of<1>({shape}, [norm](const auto& x) { return (*norm)(x); }, -2.0, 2.0);
    c.reference = [norm](const std::vector<D>& xs) { return layer_norm_reference(xs[0], norm->gamma, norm->beta, 1e-5); };
    m.emplace("LayerNorm", std::move(c));
  }
});

}  // namespace

namespace {

template <auto Setting>
struct NormNet : duet::nn::Cell<NormNet<Setting>, Setting, double> {
  duet::nn::Dense<4, 5, double> fc;
  duet::nn::LayerNorm<5, double> norm;
  DUET_CELL_MEMBERS(fc, norm);
  auto construct(auto x) { return norm(fc(x)); }
};

}  // namespace

TEST_CASE("nn::LayerNorm: gamma and beta's gradients match finite differences, the same in both modes") {
  duet_test::ModeGuard guard;
  duet::set_seed(4);
  NormNet<duet::CONTEXT_MODE> net;
  net.norm.gamma.set_data(random_input({5}, 0.5, 1.5, 7));
  net.norm.beta.set_data(random_input({5}, -1.0, 1.0, 8));
  duet::nn::BasicMSELoss<Reduction::mean, double> loss;
  const D x = random_input({6, 4}, -1, 1, 9);
  const D target = random_input({6, 5}, -1, 1, 10);
  REQUIRE(net.parameters().size() == 4);  // fc.weight, fc.bias, norm.gamma, norm.beta
  check_parameter_grads(net, loss, x, target);
}

TEST_CASE("nn::LayerNorm: MindSpore's parameters and epsilon, static and run-time sizes, errors") {
  duet::nn::LayerNorm<4> fixed;
  duet::nn::LayerNorm<> sized(4);
  const auto params = fixed.parameters();
  REQUIRE(params.size() == 2);
  CHECK(params[0].name == "gamma");
  CHECK(params[1].name == "beta");
  CHECK(fixed.epsilon() == 1e-7);
  CHECK(std::all_of(fixed.gamma.data(), fixed.gamma.data() + 4, [](float v) { return v == 1.0f; }));
  CHECK(std::all_of(fixed.beta.data(), fixed.beta.data() + 4, [](float v) { return v == 0.0f; }));
  // Rows far from zero, spread little: the two-pass variance keeps them apart in float.
  duet::Tensor x({2, 4});
  const float row[] = {10000.0f, 10001.0f, 10002.0f, 10003.0f};
  for (index_t i = 0; i < 8; ++i) x.data()[i] = row[i % 4] + (i < 4 ? 0.0f : -20000.0f);
  const duet::Tensor y = fixed(x);
  const duet::Tensor z = sized(x);
  CHECK(std::equal(y.data(), y.data() + 8, z.data()));
  const double expected[] = {-1.3416407864998738, -0.4472135954999579, 0.4472135954999579, 1.3416407864998738};
  for (index_t i = 0; i < 8; ++i) CHECK(y.data()[i] == doctest::Approx(expected[i % 4]).epsilon(1e-5));
  try {
    static_cast<void>(sized(duet::ones({2, 5})));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "nn::LayerNorm<dyn> expects an input whose last dimension is 4, got [2, 5]");
  }
  CHECK_THROWS_AS(duet::nn::LayerNorm<>(0), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::LayerNorm<4>(5), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::LayerNorm<4>(4, 0.0), duet::ValueError);
}

namespace {

template <auto Setting>
struct Head : duet::nn::Cell<Head<Setting>, Setting, double> {
  duet::nn::Dense<4, 3, double> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

// Probabilities, for nn::BCELoss.
struct SigmoidHead : duet::nn::Cell<SigmoidHead, duet::CONTEXT_MODE, double> {
  duet::nn::Dense<4, 3, double> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return duet::ops::sigmoid(fc(x)); }
};

}  // namespace

namespace {

// A PyTorch model's normalisation layers, their eps set by name in braces as members.
template <auto Setting>
struct TorchNorms : duet::nn::Cell<TorchNorms<Setting>, Setting, double> {
  duet::nn::LayerNorm<4, double> norm{{.epsilon = 1e-5}};
  duet::nn::GroupNorm<2, 4, double> group{{.eps = 1e-3}};
  duet::nn::BatchNorm2d<4, double> bn{{.eps = 1e-3, .momentum = 0.99, .affine = false}};
  DUET_CELL_MEMBERS(norm, group, bn);
  auto construct(auto x) { return bn(group(norm(x))); }
};

}  // namespace

TEST_CASE("normalisation layers take eps by name in braces (PyTorch's LayerNorm eps 1e-5), the same in both modes") {
  TorchNorms<duet::PYNATIVE_MODE> eager;
  TorchNorms<duet::GRAPH_MODE> graph;
  CHECK(eager.norm.epsilon() == 1e-5);
  CHECK(eager.group.epsilon() == 1e-3);
  CHECK((eager.bn.eps() == 1e-3 && eager.bn.momentum() == 0.99 && !eager.bn.gamma.requires_grad));
  CHECK(duet::nn::LayerNorm<>(4, {.epsilon = 1e-5}).epsilon() == 1e-5);
  CHECK(duet::nn::GroupNorm<>(2, 4, {.eps = 1e-3}).epsilon() == 1e-3);
  CHECK(duet::nn::BatchNorm1d<>(4, {.momentum = 0.5}).momentum() == 0.5);
  CHECK_THROWS_AS(duet::nn::LayerNorm<4>({.epsilon = 0}), duet::ValueError);
  // A row of small spread, where eps 1e-5 and MindSpore's 1e-7 differ by more than rounding.
  D x({2, 4, 3, 4});
  for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = 0.003 * std::sin(1.3 * double(i));
  const D y = eager.norm(x);
  const D expected = layer_norm_reference(x, eager.norm.gamma, eager.norm.beta, 1e-5);
  double worst = 0;
  for (index_t i = 0; i < y.numel(); ++i) worst = std::max(worst, std::abs(y.data()[i] - expected.data()[i]));
  CHECK(worst < 1e-12);
  const D mindspore = layer_norm_reference(x, eager.norm.gamma, eager.norm.beta, 1e-7);
  CHECK(std::abs(y.data()[0] - mindspore.data()[0]) > 1e-3);
  const D a = eager(x);
  const D b = graph(x);
  CHECK(std::equal(a.data(), a.data() + a.numel(), b.data()));
}

TEST_CASE("losses: in WithLossCell, the same parameter gradients in both modes") {
  duet::set_seed(6);
  Head<duet::CONTEXT_MODE> net;
  const D x = random_input({5, 4}, -1, 1, 30);
  const D target = random_input({5, 3}, 0.1, 1, 31);
  const Labels classes = labels_of({0, 2, 1, 1, -100});
  auto check = [&](auto& loss, const auto& y) {
    const auto grads = parameter_grads_in_both_modes(net, loss, x, y);
    CHECK(same_bits(grads[0], grads[1]));
    double norm = 0;
    for (const D& g : grads[0]) norm += dot(g, g);
    CHECK(norm > 0);  // a gradient reached the parameters
  };
  duet::nn::BasicPointwiseLoss<duet::fn::L1Loss, Reduction::mean, double> l1;
  duet::nn::BasicPointwiseLoss<duet::fn::SmoothL1Loss, Reduction::sum, double> smooth({.beta = 0.5});
  duet::nn::BasicPointwiseLoss<duet::fn::KLDivLoss, Reduction::mean, double> kl;
  duet::nn::BasicPointwiseLoss<duet::fn::KLDivLoss, Reduction::batchmean, double> kl_batchmean;
  duet::nn::BasicPointwiseLoss<duet::fn::BCEWithLogitsLoss, Reduction::mean, double> bce;
  duet::nn::BasicNLLLoss<Reduction::mean, double> nll;
  duet::nn::BasicCrossEntropyLoss<Reduction::mean, double> ce({.label_smoothing = 0.1});
  check(l1, target);
  check(smooth, target);
  check(kl, target);
  check(kl_batchmean, target);
  check(bce, target);
  check(nll, classes);
  check(ce, classes);
  check(ce, target);
  SigmoidHead probabilities;
  duet::nn::BasicPointwiseLoss<duet::fn::BCELoss, Reduction::mean, double> bce_on_probabilities;
  const auto grads = parameter_grads_in_both_modes(probabilities, bce_on_probabilities, x, target);
  CHECK(same_bits(grads[0], grads[1]));
  CHECK(dot(grads[0][0], grads[0][0]) > 0);
}

TEST_CASE("cross_entropy and nll_loss of a masked class (a logit of -inf): PyTorch's finite value, in both modes") {
  // helper-89: without label smoothing the other classes' log-probabilities were still summed,
  // times 0, and 0 · -inf made the loss NaN, so TrainOneStepCell skipped every step of a
  // network that masks with -inf. torch.nn.functional.cross_entropy in float64 (python3-torch
  // 1.13, Debian 12): the mean loss and d/dz.
  constexpr double inf = std::numeric_limits<double>::infinity();
  const D z({3, 4}, std::vector<double>{-inf, 2, 0, 1, 0.5, -inf, -inf, 3, 1, 2, 3, -inf});
  const Labels labels({3}, {1, 3, 0});
  const double torch_loss = 0.9647005543937702;
  const std::vector<double> torch_dz{0.0, -0.1115863480750594, 0.030010191056793478, 0.08157615701826587,
                                     0.025286060007081182, 0.0, 0.0, -0.025286060007081147,
                                     -0.30332314227653984, 0.08157615701826587, 0.2217469852582739, 0.0};
  duet_test::ModeGuard guard;
  std::vector<D> dzs;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const auto r = duet::value_and_grad([](const auto& v, const auto& l) { return duet::ops::cross_entropy(v, l); }, 0)(z, labels);
    CHECK(r.value.item() == doctest::Approx(torch_loss).epsilon(1e-14));
    for (index_t i = 0; i < 12; ++i) CHECK(r.grads[0].data()[i] == doctest::Approx(torch_dz[static_cast<std::size_t>(i)]).epsilon(1e-13));
    const auto nll = duet::jit([](const auto& v, const auto& l) { return duet::ops::nll_loss(duet::ops::log_softmax(v), l); })(z, labels);
    CHECK(nll.item() == doctest::Approx(torch_loss).epsilon(1e-14));
    dzs.push_back(r.grads[0]);
  }
  CHECK(same_bits(std::vector<D>{dzs[0]}, std::vector<D>{dzs[1]}));
}

TEST_CASE("nn::BCELoss: PyTorch's value and input gradient, at 0 and 1 too, in both modes") {
  // torch.nn.functional.binary_cross_entropy in float64 (python3-torch 1.13, Debian 12) on
  // these inputs: the mean loss, then d/dx per element. At x = 0 and 1 the target's gradient
  // is where the two differ (PyTorch ±inf, duet the clamped loss's slope, ±100 / 6).
  const D x({6}, std::vector<double>{0.0, 1e-30, 0.3, 0.7, 1 - 1e-9, 1.0});
  const D y({6}, std::vector<double>{1.0, 0.2, 0.5, 0.9, 0.0, 0.3});
  const double torch_loss = 34.293417504550398;
  const std::vector<double> torch_dx{-166666667332.63382, -33333333466.526764, -0.15873015873015875,
                                     -0.15873015873015878, 166666671.38032204, 116666667132.84364};
  auto f = [](const auto& p, const auto& t) { return duet::ops::binary_cross_entropy(p, t); };
  duet_test::ModeGuard guard;
  std::vector<D> dxs;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const auto r = duet::value_and_grad(f, 0)(x, y);
    CHECK(r.value.item() == doctest::Approx(torch_loss).epsilon(1e-14));
    for (index_t i = 0; i < 6; ++i) CHECK(r.grads[0].data()[i] == doctest::Approx(torch_dx[static_cast<std::size_t>(i)]).epsilon(1e-14));
    const D dy = duet::value_and_grad(f, 1)(x, y).grads[0];
    CHECK(dy.data()[0] == doctest::Approx(100.0 / 6));
    CHECK(dy.data()[5] == doctest::Approx(-100.0 / 6));
    dxs.push_back(r.grads[0]);
  }
  CHECK(same_bits(std::vector<D>{dxs[0]}, std::vector<D>{dxs[1]}));
}

TEST_CASE("losses: MindSpore's documented values and defaults, and errors that name the loss") {
  duet::Tensor logits({3});
  duet::Tensor labels({3});
  for (index_t i = 0; i < 3; ++i) {
    logits.data()[i] = static_cast<float>(i + 1);
    labels.data()[i] = i == 2 ? 2.0f : static_cast<float>(i + 1);
  }
  // nn.SmoothL1Loss() on [1, 2, 3] and [1, 2, 2]: [0, 0, 0.5], no reduction by default.
  duet::nn::SmoothL1Loss<> smooth;
  const duet::Tensor s = smooth(logits, labels);
  REQUIRE(s.shape() == Shape{3});
  CHECK(s(0) == 0.0f);
  CHECK(s(2) == 0.5f);
  // nn.L1Loss() (mean by default): |3 - 2| / 3.
  CHECK(duet::nn::L1Loss<>()(logits, labels).item() == doctest::Approx(1.0 / 3));
  // BCEWithLogits stays finite where log(sigmoid(x)) would not: x = -100, y = 1 gives 100.
  duet::Tensor big({1});
  big.data()[0] = -100.0f;
  duet::Tensor one = duet::ones({1});
  CHECK(duet::nn::BCEWithLogitsLoss<>()(big, one).item() == doctest::Approx(100.0));
  // nn.BCELoss on probabilities: -log 0.5 at 0.5; a probability of 0 for a target of 1 costs 100
  // (the clamped log), not infinity; logits where probabilities belong are refused.
  duet::Tensor even({1});
  even.data()[0] = 0.5f;
  CHECK(duet::nn::BCELoss<>()(even, one).item() == doctest::Approx(std::log(2.0)));
  const duet::Tensor zero = duet::zeros<float>({1});
  CHECK(duet::nn::BCELoss<>()(zero, one).item() == doctest::Approx(100.0));
  CHECK_THROWS_WITH_AS(duet::nn::BCELoss<>()(big, one), doctest::Contains("nn::BCEWithLogitsLoss"), duet::ValueError);
  CHECK_THROWS_WITH_AS(duet::jit([](const auto& p, const auto& y) { return duet::ops::binary_cross_entropy(p, y); })(big, one),
                       doctest::Contains("probabilities in [0, 1]"), duet::ValueError);
  // Cross-entropy with label smoothing on uniform logits: log(C) whatever ε.
  const duet::Tensor uniform = duet::zeros<float>({2, 4});
  CHECK(duet::nn::CrossEntropyLoss<>({.label_smoothing = 0.3})(uniform, labels_of({1, 3})).item() ==
        doctest::Approx(std::log(4.0)));
  try {
    static_cast<void>(duet::nn::NLLLoss<>()(uniform, labels_of({1, 4})));
    FAIL("no error");
  } catch (const duet::ValueError& e) {
    CHECK(std::string(e.what()) ==
          "nn::NLLLoss: label 4 of sample 1 is outside [0, 4) and is not ignore_index (-100)");
  }
  try {
    static_cast<void>(duet::nn::L1Loss<>()(uniform, labels));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "nn::L1Loss expects inputs of matching shapes, got [2, 4] and [3]");
  }
  // KLDivLoss 'batchmean': the sum over axis 0's size, here 2 rows; a scalar has no axis 0.
  const duet::Tensor half = duet::Tensor({2, 2}, {0.5f, 0.5f, 0.5f, 0.5f});
  const duet::Tensor log_quarter = duet::Tensor({2, 2}, {std::log(0.25f), std::log(0.25f), std::log(0.25f), std::log(0.25f)});
  CHECK(duet::nn::KLDivLoss<Reduction::batchmean>()(log_quarter, half).item() == doctest::Approx(std::log(2.0)));
  CHECK(duet::nn::KLDivLoss<Reduction::mean>()(log_quarter, half).item() == doctest::Approx(std::log(2.0) / 2));
  CHECK_THROWS_AS(duet::nn::KLDivLoss<Reduction::batchmean>()(duet::ones(Shape{}), duet::ones(Shape{})), duet::ShapeError);
  CHECK_THROWS_AS(duet::nn::SmoothL1Loss<>({.beta = -1.0}), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::CrossEntropyLoss<>({.label_smoothing = 1.5}), duet::ValueError);
}

namespace {

// PyTorch's torch.nn.GroupNorm: each group of channels of each sample normalised over its
// channels and positions with the biased variance, then γ[c] · x̂ + β[c].
D group_norm_reference(const D& x, index_t groups, const D& gamma, const D& beta, double eps) {
  const index_t n = x.shape()[0], c = x.shape()[1], s = x.shape().numel_from(2), cg = c / groups;
  D y = duet::zeros<double>(x.shape());
  for (index_t i = 0; i < n; ++i) {
    for (index_t g = 0; g < groups; ++g) {
      double mean = 0, var = 0;
      const double count = static_cast<double>(cg * s);
      for (index_t ch = g * cg; ch < (g + 1) * cg; ++ch) {
        for (index_t j = 0; j < s; ++j) mean += x.data()[(i * c + ch) * s + j] / count;
      }
      for (index_t ch = g * cg; ch < (g + 1) * cg; ++ch) {
        for (index_t j = 0; j < s; ++j) var += std::pow(x.data()[(i * c + ch) * s + j] - mean, 2) / count;
      }
      for (index_t ch = g * cg; ch < (g + 1) * cg; ++ch) {
        for (index_t j = 0; j < s; ++j) {
          const index_t at = (i * c + ch) * s + j;
          y.data()[at] = (x.data()[at] - mean) / std::sqrt(var + eps) * gamma.data()[ch] + beta.data()[ch];
        }
      }
    }
  }
  return y;
}

Labels indices_of(const Shape& shape, std::int32_t vocab, std::uint64_t seed) {
  duet::Generator gen(seed);
  const D u = duet::uniform<double>(shape, 0.0, static_cast<double>(vocab), gen);
  Labels idx(shape);
  for (index_t i = 0; i < idx.numel(); ++i) idx.data()[i] = std::min(vocab - 1, static_cast<std::int32_t>(u.data()[i]));
  return idx;
}

const bool group_norm_embedding_cases = add_cases([](std::multimap<std::string, Case>& m) {
  // GroupNorm with gamma and beta away from their ones and zeros: images, sequences, vectors.
  for (const auto& [shape, groups] : {std::pair{Shape{2, 6, 3, 2}, index_t{3}}, std::pair{Shape{3, 4, 5}, index_t{2}},
                                      std::pair{Shape{2, 4}, index_t{2}}}) {
    const index_t channels = shape[1];
    auto norm = std::make_shared<duet::nn::GroupNorm<duet::dyn, duet::dyn, double>>(groups, channels);
    norm->gamma.set_data(random_input({channels}, 0.5, 1.5, 200));
    norm->beta.set_data(random_input({channels}, -1.0, 1.0, 201));
    Case c = case_of<1>({shape}, [norm](const auto& x) { return (*norm)(x); }, -2.0, 2.0);
    c.reference = [norm, g = groups](const std::vector<D>& xs) {
      return group_norm_reference(xs[0], g, norm->gamma, norm->beta, 1e-5);
    };
    m.emplace("GroupNorm", std::move(c));
  }
  // Embedding: its input has no gradient, so the harness checks its value in both modes against
  // a plain lookup (the table's gradient is checked below), indices read more than once.
  auto table = std::make_shared<duet::nn::Embedding<7, 3, double>>();
  const Labels idx = indices_of({4, 5}, 7, 202);
  Case c;
  c.reference = [table, idx](const std::vector<D>&) {
    D y = duet::zeros<double>(Shape{4, 5, 3});
    for (index_t i = 0; i < 20; ++i) {
      for (index_t j = 0; j < 3; ++j) y.data()[i * 3 + j] = table->embedding_table(idx.data()[i], j);
    }
    return y;
  };
  c.value_in_mode = [table, idx](const std::vector<D>&, duet::Mode mode) {
    duet::set_context({.mode = mode});
    auto lookup = [table](const auto& i) { return (*table)(i); };
    const D y = mode == duet::GRAPH_MODE ? duet::jit(lookup)(idx) : lookup(idx);
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return y;
  };
  m.emplace("Embedding", std::move(c));
});

template <auto Setting>
struct GroupNormNet : duet::nn::Cell<GroupNormNet<Setting>, Setting, double> {
  using input_value_type = std::int32_t;
  duet::nn::Embedding<6, 8, double> embedding;  // [N, 3] -> [N, 3, 8]
  duet::nn::GroupNorm<2, 4, double> norm;        // on [N, 4, 6]
  duet::nn::BasicFlatten<double> flatten;
  duet::nn::Dense<24, 2, double> fc;
  DUET_CELL_MEMBERS(embedding, norm, flatten, fc);
  auto construct(auto x) { return fc(flatten(norm(duet::ops::reshape<-1, 4, 6>(embedding(x))))); }
};

}  // namespace

TEST_CASE("nn::GroupNorm and nn::Embedding: gamma, beta and the table's gradients match finite differences, the same in both modes") {
  duet_test::ModeGuard guard;
  duet::set_seed(11);
  GroupNormNet<duet::CONTEXT_MODE> net;
  net.norm.gamma.set_data(random_input({4}, 0.5, 1.5, 12));
  net.norm.beta.set_data(random_input({4}, -1.0, 1.0, 13));
  net.embedding.embedding_table.set_data(random_input({6, 8}, -1.0, 1.0, 14));
  duet::nn::BasicMSELoss<Reduction::mean, double> loss;
  // Index 5 appears twice and index 0 never: its rows' gradients add, and row 0's is zero.
  Labels x({3, 3});
  const std::int32_t values[] = {5, 1, 2, 3, 5, 4, 1, 3, 2};
  std::copy(values, values + 9, x.data());
  const D target = random_input({3, 2}, -1, 1, 15);
  const auto params = net.parameters();
  REQUIRE(params.size() == 5);  // embedding.embedding_table, norm.gamma, norm.beta, fc.weight, fc.bias
  CHECK(params[0].name == "embedding.embedding_table");
  CHECK(params[1].name == "norm.gamma");
  CHECK(params[2].name == "norm.beta");
  const std::vector<D> grads = check_parameter_grads(net, loss, x, target);
  for (index_t j = 0; j < 8; ++j) CHECK(grads[0].data()[j] == 0.0);  // row 0, never looked up
}

TEST_CASE("nn::GroupNorm: MindSpore's parameters and eps, static and run-time sizes, errors") {
  duet::nn::GroupNorm<2, 4> fixed;
  duet::nn::GroupNorm<> sized(2, 4);
  const auto params = fixed.parameters();
  REQUIRE(params.size() == 2);
  CHECK(params[0].name == "gamma");
  CHECK(params[1].name == "beta");
  CHECK(fixed.epsilon() == 1e-5);
  const duet::Tensor x = duet::randn({2, 4, 3, 3}, 5);
  const duet::Tensor y = fixed(x);
  const duet::Tensor z = sized(x);
  CHECK(std::equal(y.data(), y.data() + y.numel(), z.data()));
  // A static shape goes through with its channels checked while compiling.
  static_assert(std::is_same_v<decltype(fixed(duet::ones(duet::shape<2, 4, 3, 3>))), duet::StaticTensor<float, 2, 4, 3, 3>>);
  try {
    static_cast<void>(sized(duet::ones({2, 6, 3})));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "nn::GroupNorm<dyn, dyn> expects an input whose dimension 1 (channels) is 4, got [2, 6, 3]");
  }
  CHECK_THROWS_AS(static_cast<void>(fixed(duet::ones({4}))), duet::ShapeError);
  CHECK_THROWS_AS(duet::nn::GroupNorm<>(3, 4), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::GroupNorm<>(0, 4), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::GroupNorm<>(2, 4, 0.0), duet::ValueError);
}

TEST_CASE("nn::Embedding: MindSpore's table and initialiser, padding_idx, and an out-of-range index in both modes") {
  duet_test::ModeGuard guard;
  duet::set_seed(3);
  duet::nn::Embedding<10, 4> embedding({.padding_idx = 2});
  const auto params = embedding.parameters();
  REQUIRE(params.size() == 1);
  CHECK(params[0].name == "embedding_table");
  CHECK(embedding.embedding_table.shape() == Shape{10, 4});
  // MindSpore's 'normal': Normal(sigma=0.01).
  double sum_sq = 0;
  for (index_t i = 0; i < 40; ++i) sum_sq += embedding.embedding_table.data()[i] * embedding.embedding_table.data()[i];
  CHECK(std::sqrt(sum_sq / 36) < 0.03);
  for (index_t j = 0; j < 4; ++j) CHECK(embedding.embedding_table(2, j) == 0.0f);
  Labels idx({2, 3});
  const std::int32_t good[] = {0, 9, 2, 2, 5, 1};
  std::copy(good, good + 6, idx.data());
  const duet::Tensor y = embedding(idx);
  REQUIRE(y.shape() == Shape{2, 3, 4});
  for (index_t j = 0; j < 4; ++j) CHECK(y(0, 1, j) == embedding.embedding_table(9, j));
  idx.data()[4] = 10;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto lookup = duet::jit([&](const auto& i) { return embedding(i); });
    try {
      static_cast<void>(mode == duet::GRAPH_MODE ? lookup(idx) : embedding(idx));
      FAIL("no error");
    } catch (const duet::IndexError& e) {
      CHECK(std::string(e.what()) ==
            "nn::Embedding<10, 4>: index 10 (element 4 of the indices) is out of range [0, 10)");
    }
  }
  idx.data()[4] = -1;
  CHECK_THROWS_AS(static_cast<void>(embedding(idx)), duet::IndexError);
  try {
    static_cast<void>(embedding(duet::ones({2})));
    FAIL("no error");
  } catch (const duet::ValueError& e) {
    CHECK(std::string(e.what()) == "nn::Embedding<10, 4> takes int32 indices, got a tensor of Float32");
  }
  CHECK_THROWS_AS(duet::nn::Embedding<>(0, 4), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::Embedding<>(4, 4, {.padding_idx = 4}), duet::ValueError);
}

}  // namespace tests_ops_layers
