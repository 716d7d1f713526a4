// Layers and losses (include/duet/nn/normalization.hpp, include/duet/nn/loss.hpp): their cases
// in the gradient harness, each value against plain loops in double that write out PyTorch's
// formula, and what the harness does not cover (LayerNorm's parameter gradients, errors,
// training through WithLossCell in both modes).
#include "ops_harness.hpp"

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
