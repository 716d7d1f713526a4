// Batch normalisation (include/duet/nn/batchnorm.hpp) and the train/eval switch it needs
// (set_train, graph mode's two forms, train::evaluate): the BatchNorm cases of the gradient
// harness in both phases, each value against plain loops in double; gamma and beta's gradients
// against finite differences; the moving statistics against MindSpore's update, the same in
// both modes; evaluation with the moving statistics; the forms graph mode keeps and refuses;
// checkpoints; errors; and a network with BatchNorm and Dropout trained in both modes.
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>

#include <duet/io/safetensors.hpp>

#include "ops_harness.hpp"

namespace tests_ops_batchnorm {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using duet::graph::Phase;

// Channel c's (mean, biased variance) of x [N, C, ...], in double.
std::pair<double, double> reference_statistics(const D& x, index_t c) {
  const index_t channels = x.shape()[1];
  const index_t spatial = x.numel() / (x.shape()[0] * channels);
  double mean = 0;
  double count = 0;
  for (index_t n = 0; n < x.shape()[0]; ++n) {
    for (index_t s = 0; s < spatial; ++s) {
      mean += x.data()[(n * channels + c) * spatial + s];
      count += 1;
    }
  }
  mean /= count;
  double var = 0;
  for (index_t n = 0; n < x.shape()[0]; ++n) {
    for (index_t s = 0; s < spatial; ++s) {
      const double d = x.data()[(n * channels + c) * spatial + s] - mean;
      var += d * d;
    }
  }
  return {mean, var / count};
}

// PyTorch's and MindSpore's formula: (x - mean) / sqrt(var + eps) · gamma + beta per channel,
// with the batch's statistics in training and the moving ones in evaluation.
template <class Layer>
D batch_norm_reference(const D& x, const Layer& bn, Phase phase) {
  const index_t channels = x.shape()[1];
  const index_t spatial = x.numel() / (x.shape()[0] * channels);
  D y = duet::zeros<double>(x.shape());
  for (index_t c = 0; c < channels; ++c) {
    auto [mean, var] = reference_statistics(x, c);
    if (phase == Phase::eval) {
      mean = bn.moving_mean.data()[c];
      var = bn.moving_variance.data()[c];
    }
    for (index_t n = 0; n < x.shape()[0]; ++n) {
      for (index_t s = 0; s < spatial; ++s) {
        const index_t i = (n * channels + c) * spatial + s;
        y.data()[i] = (x.data()[i] - mean) / std::sqrt(var + bn.eps()) * bn.gamma.data()[c] + bn.beta.data()[c];
      }
    }
  }
  return y;
}

// A layer with every parameter away from its initial value, so that each matters.
template <class Layer>
void randomize(Layer& bn, std::uint64_t seed) {
  const index_t c = bn.num_features();
  bn.gamma.set_data(random_input({c}, 0.5, 1.5, seed));
  bn.beta.set_data(random_input({c}, -1.0, 1.0, seed + 1));
  bn.moving_mean.set_data(random_input({c}, -0.5, 0.5, seed + 2));
  bn.moving_variance.set_data(random_input({c}, 0.5, 2.0, seed + 3));
}

template <class Layer>
void add_batch_norm_case(std::multimap<std::string, Case>& m, const Shape& shape, Phase phase, std::uint64_t seed) {
  auto bn = std::make_shared<Layer>(shape[1]);
  randomize(*bn, seed);
  bn->set_train(phase == Phase::train);
  Case c = case_of<1>({shape}, [bn](const auto& x) { return (*bn)(x); }, -2.0, 2.0);
  c.reference = [bn, phase](const std::vector<D>& xs) { return batch_norm_reference(xs[0], *bn, phase); };
  m.emplace("BatchNorm", std::move(c));
}

const bool batchnorm_cases = add_cases([](std::multimap<std::string, Case>& m) {
  for (Phase phase : {Phase::train, Phase::eval}) {
    add_batch_norm_case<duet::nn::BatchNorm1d<duet::dyn, double>>(m, {5, 3}, phase, 200);
    add_batch_norm_case<duet::nn::BatchNorm1d<duet::dyn, double>>(m, {3, 2, 4}, phase, 210);
    add_batch_norm_case<duet::nn::BatchNorm2d<duet::dyn, double>>(m, {2, 3, 2, 3}, phase, 220);
  }
});

template <auto Setting>
struct NormNet : duet::nn::Cell<NormNet<Setting>, Setting, double> {
  duet::nn::Dense<4, 3, double> fc;
  duet::nn::BatchNorm1d<3, double> bn;
  DUET_CELL_MEMBERS(fc, bn);
  auto construct(auto x) { return bn(fc(x)); }
};

bool same_bits(const D& a, const D& b) {
  return a.shape() == b.shape() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

}  // namespace

TEST_CASE("nn::BatchNorm: gamma and beta's gradients match finite differences in both phases, the same in both modes") {
  duet_test::ModeGuard guard;
  duet::set_seed(4);
  NormNet<duet::CONTEXT_MODE> net;
  randomize(net.bn, 40);
  duet::nn::BasicMSELoss<duet::Reduction::mean, double> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  const D x = random_input({6, 4}, -1, 1, 9);
  const D target = random_input({6, 3}, -1, 1, 10);
  for (bool training : {true, false}) {
    CAPTURE(training);
    net.set_train(training);
    std::vector<std::vector<D>> grads;
    for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      duet::set_context({.mode = mode});
      grads.push_back(duet::value_and_grad(with_loss, net.parameters())(x, target).grads);
    }
    REQUIRE(grads[0].size() == grads[1].size());
    for (std::size_t p = 0; p < grads[0].size(); ++p) CHECK(same_bits(grads[0][p], grads[1][p]));
    auto loss_value = [&] {
      duet::set_context({.mode = duet::PYNATIVE_MODE});
      return with_loss(x, target).item();
    };
    const auto params = net.parameters();
    REQUIRE(params.size() == 6);  // fc.weight, fc.bias, bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance
    for (std::size_t p = 0; p < params.size(); ++p) {
      auto& value = *params[p].parameter;
      if (!value.requires_grad) continue;  // the moving statistics: not trained
      for (index_t j = 0; j < value.numel(); ++j) {
        const double fd = finite_difference(value, j, loss_value);
        INFO(params[p].name, "[", j, "]");
        CHECK(std::abs(grads[0][p].data()[j] - fd) <= 1e-7 + 1e-6 * std::abs(fd));
      }
    }
  }
}

TEST_CASE("nn::BatchNorm: the moving statistics follow MindSpore's momentum, the same bits in both modes") {
  duet_test::ModeGuard guard;
  const D x1 = random_input({4, 2, 3}, -1, 3, 50);
  const D x2 = random_input({4, 2, 3}, -2, 1, 51);
  std::vector<D> means;
  std::vector<D> variances;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::nn::BatchNorm1d<2, double> bn(2, 1e-5, 0.8);
    bn.set_train();
    static_cast<void>(bn(x1));
    // One step from the initial zeros and ones: 0.8 · initial + 0.2 · batch, the variance unbiased.
    for (index_t c = 0; c < 2; ++c) {
      const auto [mean, var] = reference_statistics(x1, c);
      CHECK(bn.moving_mean.data()[c] == doctest::Approx(0.2 * mean).epsilon(1e-12));
      CHECK(bn.moving_variance.data()[c] == doctest::Approx(0.8 + 0.2 * var * 12.0 / 11.0).epsilon(1e-12));
    }
    static_cast<void>(bn(x2));
    means.push_back(bn.moving_mean.clone());
    variances.push_back(bn.moving_variance.clone());
    // Evaluation leaves them alone.
    bn.set_train(false);
    static_cast<void>(bn(x2));
    CHECK(same_bits(bn.moving_mean, means.back()));
  }
  CHECK(same_bits(means[0], means[1]));
  CHECK(same_bits(variances[0], variances[1]));
}

namespace {

// Counts its captures: graph mode runs construct once per form it captures.
template <auto Setting>
struct Counted : duet::nn::Cell<Counted<Setting>, Setting> {
  duet::nn::Dense<4, 3> fc;
  duet::nn::BatchNorm1d<3> bn;
  duet::nn::Dropout drop{0.5};
  DUET_CELL_MEMBERS(fc, bn, drop);
  int constructs = 0;
  auto construct(auto x) {
    ++constructs;
    return drop(bn(fc(x)));
  }
};

std::vector<float> values(const duet::Tensor& t) { return {t.data(), t.data() + t.numel()}; }

}  // namespace

TEST_CASE("set_train: graph mode keeps a training and an evaluation form, runs the one asked for, never a stale one") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::uniform(Shape{6, 4}, -1.0f, 1.0f, std::uint64_t{60});
  // PyNative's outputs, the reference: train, eval, train again (the second draws a new mask).
  std::vector<std::vector<float>> expected;
  {
    duet::set_seed(61);
    Counted<duet::PYNATIVE_MODE> net;
    CHECK(!net.training());  // MindSpore's default
    net.set_train();
    CHECK((net.training() && net.bn.training() && net.drop.training()));
    expected.push_back(values(net(x)));
    net.set_train(false);
    CHECK(!net.bn.training());
    expected.push_back(values(net(x)));
    net.set_train();
    expected.push_back(values(net(x)));
    net.set_train(false);
    expected.push_back(values(net(x)));  // the moving statistics of two training calls
  }
  duet::set_context({.mode = duet::GRAPH_MODE});
  duet::set_seed(61);
  Counted<duet::CONTEXT_MODE> net;
  net.set_train();
  CHECK(values(net(x)) == expected[0]);
  net.set_train(false);
  CHECK(values(net(x)) == expected[1]);
  net.set_train();
  CHECK(values(net(x)) == expected[2]);
  net.set_train(false);
  CHECK(values(net(x)) == expected[3]);
  CHECK(net.constructs == 2);  // one capture per form, both kept
  // One layer switched alone: the network's layers no longer agree on one form, and it is
  // refused rather than run with a layer in the other's phase; the error names both layers
  // (either may be the one switched), whichever comes first.
  net.set_train();
  const std::string one_phase =
      " (set_train); graph mode captures a network in one phase, which all its layers must share: call set_train "
      "on the whole network, or run it in PyNative mode";
  net.bn.set_train(false);
  try {
    static_cast<void>(net(x));
    FAIL("no error");
  } catch (const duet::ModeError& e) {
    CHECK(std::string(e.what()) == "nn::BatchNorm1d<3> 'bn' is set to evaluate and nn::Dropout 'drop' to train" + one_phase);
  }
  net.set_train();
  net.drop.set_train(false);
  try {
    static_cast<void>(net(x));
    FAIL("no error");
  } catch (const duet::ModeError& e) {
    CHECK(std::string(e.what()) == "nn::BatchNorm1d<3> 'bn' is set to train and nn::Dropout 'drop' to evaluate" + one_phase);
  }
  // PyNative mode runs each layer as it is set: the mask of no dropout on training's batch statistics.
  duet::set_context({.mode = duet::PYNATIVE_MODE});
  const duet::Tensor h = net.fc(x);
  net.bn.set_train(false);
  const duet::Tensor pass = net.bn(h);  // the moving statistics as they are: both calls below leave them
  net.bn.set_train();
  CHECK(values(net(x)) != values(pass));
  const duet::Tensor batch = net.bn(h);
  CHECK(values(net(x)) == values(batch));
}

TEST_CASE("set_train: grad and jit differentiate and run the form the layers ask for") {
  duet_test::ModeGuard guard;
  duet::set_seed(62);
  Counted<duet::CONTEXT_MODE> net;
  const duet::Tensor x = duet::uniform(Shape{6, 4}, -1.0f, 1.0f, std::uint64_t{63});
  for (bool training : {false, true}) {
    CAPTURE(training);
    std::vector<std::vector<float>> outputs;
    std::vector<std::vector<float>> grads;
    for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      duet::set_context({.mode = mode});
      net.set_train(training);
      net.drop.reseed(64);
      const duet::Tensor y = net(x);
      net.drop.reseed(64);
      const duet::Tensor jitted = duet::jit([&](const auto& in) { return net(in); })(x);
      CHECK(values(jitted) == values(y));
      net.drop.reseed(64);
      outputs.push_back(values(y));
      grads.push_back(values(duet::grad(net)(x)));
    }
    CHECK(outputs[0] == outputs[1]);
    CHECK(grads[0] == grads[1]);
  }
}

namespace {
// What `body` writes on std::cerr.
template <class F>
std::string cerr_of(F body) {
  std::ostringstream captured;
  std::streambuf* const original = std::cerr.rdbuf(captured.rdbuf());
  try {
    body();
  } catch (...) {
    std::cerr.rdbuf(original);
    throw;
  }
  std::cerr.rdbuf(original);
  return captured.str();
}
}  // namespace

TEST_CASE("set_train: a gradient through BatchNorm or Dropout that nobody set_train-ed warns once per layer") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::uniform(Shape{6, 4}, -1.0f, 1.0f, std::uint64_t{65});
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    Counted<duet::CONTEXT_MODE> forgot;
    // evaluate() switches phases for a while; that is not the user's choice.
    duet::train::detail::EvaluationScope<Counted<duet::CONTEXT_MODE>>{forgot};
    auto g = duet::grad(forgot);
    const std::string first = cerr_of([&] { g(x); });
    CHECK(first.find("duet: warning: a gradient is taken through nn::BatchNorm1d<3> 'bn', which nobody set to "
                     "train or evaluate, so it runs in evaluation") != std::string::npos);
    CHECK(first.find("nn::Dropout 'drop'") != std::string::npos);
    CHECK(first.find("set_train(false) if evaluation is meant") != std::string::npos);
    CHECK(first.find("nn::Dense") == std::string::npos);  // the same either phase: no warning
    // Once per layer, also for another gradient of it.
    CHECK(cerr_of([&] { g(x); }).empty());
    CHECK(cerr_of([&] { duet::grad(forgot)(x); }).empty());

    // Frozen BatchNorm on purpose, and a training loop that remembered: silent.
    Counted<duet::CONTEXT_MODE> frozen;
    frozen.set_train(false);
    CHECK(cerr_of([&] { duet::grad(frozen)(x); }).empty());
    Counted<duet::CONTEXT_MODE> training;
    training.set_train(true);
    CHECK(cerr_of([&] { duet::grad(training)(x); }).empty());
  }
}

TEST_CASE("set_train: training again after a validation that did not set_train(true) warns once") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::uniform(Shape{6, 4}, -1.0f, 1.0f, std::uint64_t{66});
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    Counted<duet::CONTEXT_MODE> net;
    auto g = duet::grad(net);
    net.set_train(true);
    CHECK(cerr_of([&] { g(x); }).empty());
    net.set_train(false);  // a validation pass...
    static_cast<void>(net(x));
    const std::string forgot = cerr_of([&] { g(x); });  // ...and back to training without set_train(true)
    CHECK(forgot.find("duet: warning: a gradient is taken through nn::BatchNorm1d<3> 'bn', set to evaluate, after "
                      "earlier gradients with it in training") != std::string::npos);
    CHECK(forgot.find("call set_train(true) on the network before the next step") != std::string::npos);
    CHECK(cerr_of([&] { g(x); }).empty());  // once
    net.set_train(true);
    CHECK(cerr_of([&] { g(x); }).empty());

    // Frozen from the start (fine-tuning with BatchNorm on its statistics): silent.
    Counted<duet::CONTEXT_MODE> frozen;
    frozen.set_train(false);
    auto f = duet::grad(frozen);
    CHECK(cerr_of([&] { f(x); f(x); }).empty());
  }
}

TEST_CASE("nn::BatchNorm: evaluation normalises with the moving statistics, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({3, 2, 2, 2}, -2, 2, 70);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::nn::BatchNorm2d<2, double> bn;
    randomize(bn, 71);
    const D y = bn(x);  // a new cell is in evaluation
    const D expected = batch_norm_reference(x, bn, Phase::eval);
    for (index_t i = 0; i < y.numel(); ++i) CHECK(y.data()[i] == doctest::Approx(expected.data()[i]).epsilon(1e-12));
    // What a convolution before it would absorb: y = x · scale + shift per channel.
    const auto affine = bn.evaluation_affine();
    for (index_t i = 0; i < y.numel(); ++i) {
      const auto c = static_cast<std::size_t>((i / 4) % 2);
      CHECK(y.data()[i] == doctest::Approx(x.data()[i] * affine.scale[c] + affine.shift[c]).epsilon(1e-12));
    }
  }
}

TEST_CASE("nn::BatchNorm: MindSpore's parameter names and defaults, checkpoints and safetensors keep the moving statistics") {
  duet_test::ModeGuard guard;
  duet::nn::BatchNorm2d<3> bn;
  CHECK(bn.type_name() == "nn::BatchNorm2d<3>");
  CHECK(duet::nn::BatchNorm1d<>(5).type_name() == "nn::BatchNorm1d<dyn>");
  CHECK(bn.eps() == 1e-5);
  CHECK(bn.momentum() == 0.9);
  const auto params = bn.parameters();
  REQUIRE(params.size() == 4);
  CHECK(params[0].name == "gamma");
  CHECK(params[1].name == "beta");
  CHECK(params[2].name == "moving_mean");
  CHECK(params[3].name == "moving_variance");
  CHECK((bn.gamma.requires_grad && bn.beta.requires_grad));
  CHECK((!bn.moving_mean.requires_grad && !bn.moving_variance.requires_grad));
  duet::nn::BatchNorm2d<3> frozen(3, 1e-5, 0.9, false);
  CHECK((!frozen.gamma.requires_grad && !frozen.beta.requires_grad));

  duet::set_seed(80);
  NormNet<duet::CONTEXT_MODE> net;
  net.set_train();
  const D x = random_input({5, 4}, -1, 1, 81);
  static_cast<void>(net(x));  // moves the moving statistics away from zeros and ones
  duet_test::TempDir dir;
  duet::save_checkpoint(net, dir.path / "net.ckpt");
  duet::io::save_safetensors(net, dir.path / "net.safetensors");
  for (const char* file : {"net.ckpt", "net.safetensors"}) {
    CAPTURE(file);
    duet::set_seed(82);
    NormNet<duet::CONTEXT_MODE> loaded;
    if (std::string(file) == "net.ckpt")
      static_cast<void>(duet::load_checkpoint(dir.path / file, loaded));
    else
      static_cast<void>(duet::io::load_safetensors(dir.path / file, loaded));
    CHECK(same_bits(loaded.bn.moving_mean, net.bn.moving_mean));
    CHECK(same_bits(loaded.bn.moving_variance, net.bn.moving_variance));
    CHECK(same_bits(loaded.bn.gamma, net.bn.gamma));
    CHECK(same_bits(loaded.fc.weight, net.fc.weight));
    // The loaded network evaluates as the saved one.
    net.set_train(false);
    CHECK(same_bits(loaded(x), net(x)));
    net.set_train();
  }
  const auto names = net.parameters();
  CHECK(names[4].name == "bn.moving_mean");
  CHECK(names[5].name == "bn.moving_variance");
}

TEST_CASE("nn::BatchNorm: errors name the layer, its rule and the input") {
  duet_test::ModeGuard guard;
  duet::nn::BatchNorm2d<> bn(3);
  duet::nn::BatchNorm1d<4> bn1;
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const duet::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    CHECK(message([&] { return bn(duet::ones({2, 4, 5, 5})); }) ==
          "nn::BatchNorm2d<dyn> expects an input whose dimension 1 (channels) is 3, got [2, 4, 5, 5]");
    CHECK(message([&] { return bn(duet::ones({2, 3, 5})); }) == "nn::BatchNorm2d<dyn> expects an input of rank at least 4, got [2, 3, 5]");
    CHECK(message([&] { return bn1(duet::ones({2, 4, 5, 5})); }) == "nn::BatchNorm1d<4> expects an input of rank 3, got [2, 4, 5, 5]");
    bn1.set_train();
    CHECK(message([&] { return bn1(duet::ones({1, 4})); }) ==
          "nn::BatchNorm1d<4> in training needs more than one value per channel to take batch statistics, got an "
          "input of shape [1, 4] (set_train(false) to normalise with the moving statistics)");
    CHECK(bn1.moving_variance(0) == 1.0f);  // the failed call changed nothing
    bn1.set_train(false);
    CHECK(bn1(duet::ones({1, 4})).shape() == Shape{1, 4});
  }
  CHECK_THROWS_AS(duet::nn::BatchNorm2d<>(0), duet::ValueError);
  CHECK(message([] { duet::nn::BatchNorm2d<3> b(4); }) == "nn::BatchNorm2d<3>: cannot be built with num_features 4");
  CHECK(message([] { duet::nn::BatchNorm2d<3> b(3, 0.0); }) == "nn::BatchNorm2d<3>: eps must be > 0, got 0.000000");
  CHECK_THROWS_AS(duet::nn::BatchNorm2d<3>(3, 1e-5, 1.5), duet::ValueError);
  // Static shapes are checked when the network compiles (tests/compile_fail/batchnorm_channels.cpp).
  const auto y = bn(duet::ones(duet::shape<2, 3, 4, 4>));
  CHECK(y.shape() == Shape{2, 3, 4, 4});
}

namespace {

// A small classifier with both layers that differ between training and evaluation.
template <auto Setting>
struct Classifier : duet::nn::Cell<Classifier<Setting>, Setting> {
  duet::nn::Flatten flatten;
  duet::nn::Dense<8, 16> fc1;
  duet::nn::BatchNorm1d<16> bn;
  duet::nn::ReLU relu;
  duet::nn::Dropout drop{0.25};
  duet::nn::Dense<16, 3> fc2;
  DUET_CELL_MEMBERS(flatten, fc1, bn, relu, drop, fc2);
  auto construct(auto x) { return fc2(drop(relu(bn(fc1(flatten(x)))))); }
};

}  // namespace

TEST_CASE("nn::BatchNorm + nn::Dropout: a network trains with the same losses in both modes, and evaluate uses eval") {
  duet_test::ModeGuard guard;
  duet::BasicTensor<std::uint8_t> images{Shape{24, 2, 4}};
  duet::BasicTensor<std::int32_t> labels{Shape{24}};
  for (index_t i = 0; i < 24; ++i) {
    labels(i) = static_cast<std::int32_t>(i % 3);
    for (index_t j = 0; j < 8; ++j) {
      images.data()[i * 8 + j] = static_cast<std::uint8_t>((i % 3) * 60 + (i * 37 + j * 11) % 90);
    }
  }
  struct Run {
    std::vector<float> losses;
    std::vector<float> moving_mean;
    std::vector<float> logits;
    duet::train::Metrics metrics;
  };
  std::vector<Run> runs;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    duet::set_seed(90);
    Classifier<duet::CONTEXT_MODE> net;
    duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
    duet::nn::WithLossCell with_loss(net, loss);
    duet::nn::Adam adam(net.parameters(), {.learning_rate = 1e-2});
    duet::nn::TrainOneStepCell step(with_loss, adam);
    duet::data::DataLoader loader(duet::data::ImageDataset(images, labels, 3), 8);
    Run run;
    // Cells start in evaluation; a training step puts its network in training.
    CHECK(net.training());
    for (int epoch = 0; epoch < 3; ++epoch) {
      for (const duet::data::Batch& batch : loader) run.losses.push_back(step(batch.images, batch.labels).item());
    }
    run.moving_mean = values(net.bn.moving_mean);
    const duet::Tensor moving_before = net.bn.moving_mean.clone();
    run.metrics = duet::train::evaluate(net, loss, loader);
    // evaluate ran in evaluation: the moving statistics are as training left them, and each
    // cell is back in training.
    CHECK(values(net.bn.moving_mean) == values(moving_before));
    CHECK((net.training() && net.bn.training() && net.drop.training()));
    net.set_train(false);
    const duet::data::Batch first = *loader.begin();
    run.logits = values(net(first.images));
    runs.push_back(run);
  }
  CHECK(runs[0].losses == runs[1].losses);
  CHECK(runs[0].moving_mean == runs[1].moving_mean);
  CHECK(runs[0].logits == runs[1].logits);
  CHECK(runs[0].metrics.loss == runs[1].metrics.loss);
  CHECK(runs[0].metrics.accuracy == runs[1].metrics.accuracy);
  CHECK(runs[0].losses.back() < runs[0].losses.front());  // it learns
  CHECK(runs[0].metrics.samples == 24);
}

TEST_CASE("set_train: a network built at run time is traced again after a switch, and agrees with PyNative") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::uniform(Shape{6, 4}, -1.0f, 1.0f, std::uint64_t{100});
  std::vector<std::vector<float>> outputs[2];
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::set_seed(101);
    duet::nn::DynamicSequentialCell net;
    net.append(duet::nn::Dense<4, 3>());
    net.append(duet::nn::BatchNorm1d<3>());
    net.append(duet::nn::Dropout(0.5));
    auto& out = outputs[mode == duet::GRAPH_MODE ? 1 : 0];
    for (bool training : {true, false, true, true, false}) {
      net.set_train(training);
      out.push_back(values(net(x)));
    }
  }
  CHECK(outputs[0] == outputs[1]);
  CHECK(outputs[1][2] != outputs[1][3]);  // a new mask per training call, also when replayed
}

}  // namespace tests_ops_batchnorm
