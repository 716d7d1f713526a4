// A training step given a bad batch fails as a whole: it throws a duet::Error (or, for NaN
// and Inf inputs, returns a non-finite loss) and leaves the network's parameters and the
// optimiser's state as they were. The optimiser's moments are private, so its state is
// compared through what it does next: one more valid step must give the parameters a twin
// that never saw the bad batch gets. A network with BatchNorm and Dropout checks that the
// state forward passes change (moving statistics, masks' generator) is kept too.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_bad_input {

using namespace duet;
using duet_test::ModeGuard;

namespace {

using Labels = BasicTensor<std::int32_t>;
using Loss = nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean>;

// The seed network with the layers whose forward pass changes state.
struct NormalizedNetwork : nn::Cell<NormalizedNetwork> {
  nn::Flatten flatten;
  nn::Dense<784, 32> fc1;
  nn::BatchNorm1d<32> bn;
  nn::ReLU relu;
  nn::Dropout drop{0.25};
  nn::Dense<32, 10> fc2;
  DUET_CELL_MEMBERS(flatten, fc1, bn, relu, drop, fc2);
  auto construct(auto x) { return fc2(drop(relu(bn(fc1(flatten(x)))))); }
};

// NormalizedNetwork whose last layer, sized at run time, expects 33 features: a call fails
// there, after BatchNorm and Dropout ran (PyNative runs them one by one).
struct LateMismatchNetwork : nn::Cell<LateMismatchNetwork> {
  nn::Flatten flatten;
  nn::Dense<784, 32> fc1;
  nn::BatchNorm1d<32> bn;
  nn::ReLU relu;
  nn::Dropout drop{0.25};
  nn::Dense<> fc2{33, 10};
  DUET_CELL_MEMBERS(flatten, fc1, bn, relu, drop, fc2);
  auto construct(auto x) { return fc2(drop(relu(bn(fc1(flatten(x)))))); }
};

// A network with its loss, optimiser and training step; the same seed gives the same trainer.
template <class Net>
struct BasicTrainer {
  Net net;
  Loss loss;
  nn::WithLossCell<Net, Loss> with_loss{net, loss};
  nn::Adam adam{net.parameters(), {.learning_rate = 0.01}};
  nn::TrainOneStepCell<nn::WithLossCell<Net, Loss>, nn::Adam> step{with_loss, adam};

  // Every parameter, BatchNorm's moving statistics included.
  std::vector<std::vector<float>> parameter_values() {
    std::vector<std::vector<float>> values;
    for (const auto& [name, p] : net.parameters()) values.emplace_back(p->data(), p->data() + p->numel());
    return values;
  }
};
using Trainer = BasicTrainer<duet_test::SeedNetwork<>>;

// Bitwise, so that NaNs compare equal to themselves and -0 differs from 0.
bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

Tensor images(index_t rows, std::uint64_t seed) { return randn({rows, 1, 28, 28}, seed); }

Labels labels(index_t rows) {
  Labels y(Shape{rows});
  for (index_t i = 0; i < rows; ++i) y(i) = static_cast<std::int32_t>((3 * i + 1) % 10);
  return y;
}

// Runs `bad` (which must make a's step fail or go non-finite) between valid steps of a and of
// its twin b, in each mode, and checks a ends where b does.
template <class Net = duet_test::SeedNetwork<>, class Bad>
void check_leaves_training_state_unchanged(Bad bad) {
  for (const Mode mode : {GRAPH_MODE, PYNATIVE_MODE}) {
    INFO(std::string(mode == GRAPH_MODE ? "graph mode" : "PyNative mode"));
    ModeGuard guard;
    set_context({.mode = mode});
    set_seed(7);
    BasicTrainer<Net> a;
    set_seed(7);
    BasicTrainer<Net> b;
    // A first step gives Adam moments, so a step taken on bad data would move the parameters.
    a.step(images(4, 1), labels(4));
    b.step(images(4, 1), labels(4));
    const auto before = a.parameter_values();
    const std::int64_t step_before = a.adam.global_step();

    bad(a);
    CHECK(same_bits(a.parameter_values(), before));
    CHECK(a.adam.global_step() == step_before);

    const float loss_a = a.step(images(6, 2), labels(6)).item();
    const float loss_b = b.step(images(6, 2), labels(6)).item();
    CHECK(loss_a == loss_b);
    CHECK(a.adam.global_step() == b.adam.global_step());
    CHECK(same_bits(a.parameter_values(), b.parameter_values()));
  }
}

}  // namespace

TEST_CASE("a batch of the wrong feature size or rank is a ShapeError and changes nothing") {
  check_leaves_training_state_unchanged([](Trainer& t) {
    CHECK_THROWS_AS(t.step(randn({4, 1, 28, 27}, 3), labels(4)), ShapeError);
    CHECK_THROWS_AS(t.step(randn({4, 785}, 3), labels(4)), ShapeError);
    CHECK_THROWS_AS(t.step(randn({784}, 3), labels(1)), ShapeError);
  });
}

TEST_CASE("labels of the wrong shape are a ShapeError and change nothing") {
  check_leaves_training_state_unchanged([](Trainer& t) {
    CHECK_THROWS_AS(t.step(images(4, 3), labels(5)), ShapeError);
    CHECK_THROWS_AS(t.step(images(4, 3), labels(3)), ShapeError);
    CHECK_THROWS_AS(t.step(images(4, 3), Labels(Shape{4, 1})), ShapeError);
  });
}

TEST_CASE("a label below 0 or not below the class count is a ValueError naming it and changes nothing") {
  check_leaves_training_state_unchanged([](Trainer& t) {
    Labels y = labels(4);
    y(2) = 10;
    CHECK_THROWS_WITH_AS(t.step(images(4, 3), y), doctest::Contains("label 10 of sample 2"), ValueError);
    y(2) = -1;
    CHECK_THROWS_WITH_AS(t.step(images(4, 3), y), doctest::Contains("label -1 of sample 2"), ValueError);
  });
}

TEST_CASE("an empty batch is a ValueError and changes nothing, its forward pass and loss are fine") {
  check_leaves_training_state_unchanged([](Trainer& t) {
    CHECK_THROWS_AS(t.step(images(0, 3), labels(0)), ValueError);
    const Tensor logits = t.net(images(0, 3));
    CHECK(logits.shape() == Shape{0, 10});
    // The mean over no samples is defined as 0, not 0/0.
    CHECK(t.loss(logits, labels(0)).item() == 0.0f);
  });
}

TEST_CASE("NaN or Inf in a batch gives a non-finite loss, no exception, and changes nothing") {
  check_leaves_training_state_unchanged([](Trainer& t) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      Tensor x = images(4, 3);
      x(1, 0, 5, 5) = bad;
      const Tensor loss = t.step(x, labels(4));
      CHECK(!std::isfinite(loss.item()));
      // Rows are independent: the others' logits stay finite.
      const Tensor logits = t.net(x);
      for (index_t c = 0; c < 10; ++c) {
        CHECK(std::isfinite(logits(0, c)));
        CHECK(std::isfinite(logits(2, c)));
      }
    }
  });
}

TEST_CASE("a step that throws after BatchNorm and Dropout ran leaves their moving statistics and masks as they were") {
  using Normalized = BasicTrainer<NormalizedNetwork>;
  check_leaves_training_state_unchanged<NormalizedNetwork>([](Normalized& t) {
    Labels y = labels(4);
    y(2) = 10;
    CHECK_THROWS_AS(t.step(images(4, 3), y), ValueError);
    CHECK_THROWS_AS(t.step(images(4, 3), labels(3)), ShapeError);
  });
}

TEST_CASE("a forward call that throws after BatchNorm and Dropout ran leaves them as they were") {
  // Found by a new user: PyNative's layers ran one by one and kept their changes when a later
  // one threw, and a network's loss that threw kept them in both modes.
  for (const Mode mode : {GRAPH_MODE, PYNATIVE_MODE}) {
    INFO(std::string(mode == GRAPH_MODE ? "graph mode" : "PyNative mode"));
    ModeGuard guard;
    set_context({.mode = mode});
    LateMismatchNetwork net;
    net.set_train(true);
    const std::vector<float> mean_before(net.bn.moving_mean.data(), net.bn.moving_mean.data() + 32);
    const GeneratorState masks_before = net.drop.generator().state();
    CHECK_THROWS_AS(net(images(4, 3)), ShapeError);
    CHECK(std::vector<float>(net.bn.moving_mean.data(), net.bn.moving_mean.data() + 32) == mean_before);
    CHECK(net.drop.generator().state() == masks_before);
  }
  check_leaves_training_state_unchanged<NormalizedNetwork>([](BasicTrainer<NormalizedNetwork>& t) {
    t.net.set_train(true);
    Labels y = labels(4);
    y(1) = 10;
    CHECK_THROWS_AS(t.with_loss(images(4, 3), y), ValueError);
  });
}

TEST_CASE("a step whose loss is not finite skips its update and leaves BatchNorm and Dropout as they were") {
  using Normalized = BasicTrainer<NormalizedNetwork>;
  check_leaves_training_state_unchanged<NormalizedNetwork>([](Normalized& t) {
    Tensor x = images(4, 3);
    x(1, 0, 5, 5) = std::numeric_limits<float>::quiet_NaN();
    CHECK(!std::isfinite(t.step(x, labels(4)).item()));
  });
}

TEST_CASE("a skipped update is said once on std::cerr and counted") {
  ModeGuard guard;
  for (const Mode mode : {GRAPH_MODE, PYNATIVE_MODE}) {
    set_context({.mode = mode});
    Trainer t;
    Tensor x = images(4, 3);
    x(1, 0, 5, 5) = std::numeric_limits<float>::infinity();
    std::ostringstream said;
    std::streambuf* const cerr = std::cerr.rdbuf(said.rdbuf());
    t.step(x, labels(4));
    const std::string first = said.str();
    t.step(x, labels(4));
    t.step(images(4, 3), labels(4));
    std::cerr.rdbuf(cerr);
    CHECK(first.find("duet: warning: nn::TrainOneStepCell: the loss is not finite (loss ") == 0);
    CHECK(said.str() == first);  // once
    CHECK(t.step.skipped_steps() == 2);
  }
}

TEST_CASE("value_and_grad that throws leaves BatchNorm and Dropout as they were, one that succeeds moves them") {
  check_leaves_training_state_unchanged<NormalizedNetwork>([](BasicTrainer<NormalizedNetwork>& t) {
    auto step = value_and_grad(t.with_loss, t.net.parameters());
    Labels y = labels(4);
    y(0) = -1;
    CHECK_THROWS_AS(step(images(4, 3), y), ValueError);
  });
  // The same call given good labels changes them: the test above would notice a layer that
  // never moved its statistics.
  ModeGuard guard;
  for (const Mode mode : {GRAPH_MODE, PYNATIVE_MODE}) {
    set_context({.mode = mode});
    BasicTrainer<NormalizedNetwork> t;
    t.net.set_train(true);
    const auto before = t.parameter_values();
    Generator masks_before = t.net.drop.generator();
    auto step = value_and_grad(t.with_loss, t.net.parameters());
    step(images(4, 3), labels(4));
    CHECK(!same_bits(t.parameter_values(), before));
    CHECK(t.net.drop.generator().next() != masks_before.next());
  }
}

}  // namespace tests_bad_input
