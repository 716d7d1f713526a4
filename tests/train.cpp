// train::evaluate (include/duet/train.hpp) over loaders other than data::DataLoader: a
// user-written one of three-channel float images, and one of double images for a double
// network, in both modes, against the loss and accuracy taken batch by batch by hand; rows
// labelled ignore_index, sum-reduced losses and an empty loader.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "support.hpp"

namespace tests_train {

namespace {

using duet::index_t;
using duet::Shape;
using Labels = duet::BasicTensor<std::int32_t>;

template <duet::ElementType T>
struct Classifier : duet::nn::Cell<Classifier<T>, duet::CONTEXT_MODE, T> {
  duet::nn::BasicFlatten<T> flatten;
  duet::nn::Dense<12, 8, T> fc1;
  duet::nn::BatchNorm1d<8, T> bn;
  duet::nn::BasicReLU<T> relu;
  duet::nn::Dense<8, 3, T> fc2;
  DUET_CELL_MEMBERS(flatten, fc1, bn, relu, fc2);
  auto construct(auto x) { return fc2(relu(bn(fc1(flatten(x))))); }
};

// What a user's loader gives: images [B, 3, 2, 2] of element type T.
template <duet::ElementType T>
struct ColourBatch {
  duet::BasicTensor<T> images;
  Labels labels;
};

template <duet::ElementType T>
std::vector<ColourBatch<T>> colour_batches() {
  std::vector<ColourBatch<T>> batches;
  for (const index_t size : {4, 4, 3}) {
    ColourBatch<T> b{duet::uniform(Shape{size, 3, 2, 2}, T(-1), T(1), static_cast<std::uint64_t>(size * 7 + batches.size())),
                     Labels(Shape{size})};
    for (index_t i = 0; i < size; ++i) b.labels(i) = static_cast<std::int32_t>((i + static_cast<index_t>(batches.size())) % 3);
    batches.push_back(std::move(b));
  }
  return batches;
}

template <duet::ElementType T>
void check_evaluates_colour_batches() {
  duet_test::ModeGuard guard;
  std::vector<duet::train::Metrics> results;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    duet::set_seed(5);
    Classifier<T> net;
    duet::nn::BasicSoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean, T> loss;
    net.set_train(true);
    auto batches = colour_batches<T>();
    const duet::train::Metrics m = duet::train::evaluate(net, loss, batches);
    CHECK(net.training());  // given back its setting

    net.set_train(false);
    double loss_sum = 0;
    index_t correct = 0;
    for (const auto& b : batches) {
      const duet::BasicTensor<T> logits = net(b.images);
      loss_sum += static_cast<double>(loss(logits, b.labels).item()) * static_cast<double>(b.labels.numel());
      for (index_t r = 0; r < logits.dim(0); ++r) {
        index_t best = 0;
        for (index_t c = 1; c < 3; ++c) best = logits(r, c) > logits(r, best) ? c : best;
        correct += best == b.labels(r) ? 1 : 0;
      }
    }
    CHECK(m.samples == 11);
    CHECK(m.loss == loss_sum / 11);
    CHECK(m.accuracy == static_cast<double>(correct) / 11);
    results.push_back(m);
  }
  CHECK(results[0].loss == results[1].loss);
  CHECK(results[0].accuracy == results[1].accuracy);
}

}  // namespace

static_assert(duet::train::ClassificationLoader<duet::data::DataLoader>);
static_assert(duet::train::ClassificationLoader<std::vector<ColourBatch<float>>>);
static_assert(!duet::train::ClassificationLoader<std::vector<duet::Tensor>>);

TEST_CASE("train::evaluate takes a user-written loader of three-channel float images, the same in both modes") {
  check_evaluates_colour_batches<float>();
}

TEST_CASE("train::evaluate takes a loader of double images for a double network") {
  check_evaluates_colour_batches<double>();
}

TEST_CASE("train::evaluate leaves rows labelled ignore_index out of loss and accuracy, and takes a temporary range") {
  duet_test::ModeGuard guard;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    duet::set_seed(5);
    Classifier<float> net;
    duet::nn::CrossEntropyLoss<> mean_loss({.ignore_index = 1});
    duet::nn::CrossEntropyLoss<duet::Reduction::sum> sum_loss({.ignore_index = 1});
    const duet::train::Metrics mean = duet::train::evaluate(net, mean_loss, colour_batches<float>());
    const duet::train::Metrics sum = duet::train::evaluate(net, sum_loss, colour_batches<float>());

    net.set_train(false);
    double loss_sum = 0;
    index_t correct = 0;
    index_t counted = 0;
    for (const auto& b : colour_batches<float>()) {
      const duet::Tensor logits = net(b.images);
      loss_sum += static_cast<double>(sum_loss(logits, b.labels).item());
      for (index_t r = 0; r < logits.dim(0); ++r) {
        if (b.labels(r) == 1) continue;
        ++counted;
        index_t best = 0;
        for (index_t c = 1; c < 3; ++c) best = logits(r, c) > logits(r, best) ? c : best;
        correct += best == b.labels(r) ? 1 : 0;
      }
    }
    CHECK(counted == 7);  // 11 rows, 4 labelled 1
    for (const duet::train::Metrics& m : {mean, sum}) {
      CHECK(m.samples == counted);
      CHECK(m.loss == doctest::Approx(loss_sum / 7).epsilon(1e-6));
      CHECK(m.accuracy == static_cast<double>(correct) / 7);
    }
  }
}

namespace {
struct Regressor : duet::nn::Cell<Regressor> {
  duet::nn::Dense<4, 8> fc1;
  duet::nn::BatchNorm1d<8> bn;
  duet::nn::Dense<8, 2> fc2;
  DUET_CELL_MEMBERS(fc1, bn, fc2);
  auto construct(auto x) { return fc2(duet::ops::tanh(bn(fc1(x)))); }
};
}  // namespace

static_assert(duet::train::EvaluationLoader<duet::data::BasicDataLoader<duet::data::TensorDataset<float, float>>>);
static_assert(!duet::train::ClassificationLoader<duet::data::BasicDataLoader<duet::data::TensorDataset<float, float>>>);

TEST_CASE("train::evaluate takes a regression's loader: the mean loss per sample, no accuracy, both modes the same") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::randn({13, 4}, 3);
  const duet::Tensor y = duet::randn({13, 2}, 4);
  std::vector<double> losses;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    duet::set_seed(5);
    Regressor net;
    net.set_train(true);  // as training leaves it
    duet::nn::MSELoss<> mean_loss;
    duet::nn::MSELoss<duet::Reduction::sum> sum_loss;
    duet::data::BasicDataLoader loader(duet::data::TensorDataset(x, y), 5);  // batches of 5, 5 and 3
    const duet::train::Metrics mean = duet::train::evaluate(net, mean_loss, loader);
    const duet::train::Metrics sum = duet::train::evaluate(net, sum_loss, loader);
    CHECK(net.training());

    net.set_train(false);
    const duet::Tensor out = net(x);
    double squares = 0;
    for (index_t i = 0; i < out.numel(); ++i) {
      const double d = static_cast<double>(out.data()[i]) - static_cast<double>(y.data()[i]);
      squares += d * d;
    }
    CHECK(mean.samples == 13);
    CHECK(sum.samples == 13);
    CHECK(mean.loss == doctest::Approx(squares / 26).epsilon(1e-6));  // per element, as MSELoss's mean
    CHECK(sum.loss == doctest::Approx(squares / 13).epsilon(1e-6));   // per sample
    CHECK(std::isnan(mean.accuracy));
    CHECK(std::isnan(sum.accuracy));
    losses.push_back(mean.loss);
  }
  CHECK(losses[0] == losses[1]);
}

TEST_CASE("train::evaluate refuses a loader with nothing to evaluate") {
  Classifier<float> net;
  duet::nn::CrossEntropyLoss<> loss({.ignore_index = 0});
  CHECK_THROWS_WITH_AS(duet::train::evaluate(net, loss, std::vector<ColourBatch<float>>{}),
                       doctest::Contains("the loader gave no sample to evaluate"), duet::ValueError);
  std::vector<ColourBatch<float>> ignored = colour_batches<float>();
  for (auto& b : ignored) std::ranges::fill(b.labels.values(), 0);
  CHECK_THROWS_WITH_AS(duet::train::evaluate(net, loss, ignored),
                       doctest::Contains("every label is the loss's ignore_index"), duet::ValueError);
}

}  // namespace tests_train
