// Gradient clipping (include/duet/ops/clip.hpp): MindSpore's numbers, the clipped norm, and
// training with clipping in both modes, through TrainOneStepCell and through value_and_grad.
#include <cmath>
#include <cstdint>
#include <vector>

#include "support.hpp"

namespace tests_ops_clip {

using namespace duet;
using duet_test::ModeGuard;

namespace {

Tensor tensor_of_values(const Shape& shape, std::vector<float> values) {
  Tensor t(shape);
  std::copy(values.begin(), values.end(), t.data());
  return t;
}

template <auto Setting>
struct ClipNet : nn::Cell<ClipNet<Setting>, Setting> {
  nn::Dense<6, 8> fc1;
  nn::ReLU relu;
  nn::Dense<8, 3> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);
  auto construct(auto x) { return fc2(relu(fc1(x))); }
};
using Net = ClipNet<CONTEXT_MODE>;

struct Batch {
  Tensor x = randn({16, 6}, 21);
  BasicTensor<std::int32_t> y{Shape{16}};
  Batch() {
    for (index_t i = 0; i < 16; ++i) y(i) = static_cast<std::int32_t>((i * 7) % 3);
    // Large inputs: large gradients, which the clipping below cuts.
    for (float& v : x.values()) v *= 20;
  }
};

// The network seeded alike in every run, its loss and an SGD over its parameters.
struct Seeded {
  Seeded() { set_seed(8); }
};
struct Training : Seeded {
  Net net;
  nn::CrossEntropyLoss<> loss{{.label_smoothing = 0.1}};
  nn::WithLossCell<Net, nn::CrossEntropyLoss<>> with_loss{net, loss};
  nn::SGD sgd{net.parameters(), {.learning_rate = 0.5}};
};

// Losses of `steps` TrainOneStepCell steps with gradients clipped to clip_norm, and the norm
// of the clipped gradients at each step (from what the optimiser read).
struct Run {
  std::vector<float> losses;
  std::vector<double> norms_before;
  std::vector<double> norms_after;
  std::vector<float> weights;
};

Run train_clipped(Mode mode, const Batch& data, double clip_norm) {
  ModeGuard guard;
  set_context({.mode = mode});
  Training t;
  nn::TrainOneStepCell step(t.with_loss, t.sgd, {.clip_global_norm = clip_norm});
  Run run;
  for (int s = 0; s < 6; ++s) {
    run.losses.push_back(step(data.x, data.y).item());
    run.norms_before.push_back(step.last_global_norm());
    std::vector<Tensor> grads;
    for (auto* p : t.sgd.parameters()) grads.push_back(p->grad);
    run.norms_after.push_back(ops::global_norm(grads));
  }
  run.weights.assign(t.net.fc2.weight.data(), t.net.fc2.weight.data() + t.net.fc2.weight.numel());
  return run;
}

}  // namespace

TEST_CASE("ops::clip_by_global_norm: MindSpore's example, and a list within the norm is left as it is") {
  const std::vector<Tensor> x = {tensor_of_values({2, 2}, {2, 3, 1, 2}), tensor_of_values({2, 2}, {1, 4, 3, 1})};
  const auto clipped = ops::clip_by_global_norm(x, 1.0);
  // Σ x² = 45: each value is divided by sqrt(45) (MindSpore prints 2.98142403e-01 for the first).
  REQUIRE(clipped.size() == 2);
  CHECK(clipped[0](0, 0) == doctest::Approx(0.298142403));
  CHECK(clipped[0](0, 1) == doctest::Approx(0.447213590));
  CHECK(clipped[1](0, 1) == doctest::Approx(0.596284807));
  CHECK(ops::global_norm(clipped) == doctest::Approx(1.0));
  CHECK(x[0](0, 0) == 2.0f);  // the input is not changed
  const auto same = ops::clip_by_global_norm(x, 10.0);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(std::equal(same[i].data(), same[i].data() + 4, x[i].data()));
  }
  CHECK_THROWS_AS(ops::clip_by_global_norm(x, 0.0), ValueError);
  CHECK_THROWS_AS(ops::clip_by_global_norm(x, -1.0), ValueError);
}

TEST_CASE("TrainOneStepCell clips to clip_global_norm, with the same losses in both modes") {
  const Batch data;
  const Run eager = train_clipped(PYNATIVE_MODE, data, 0.25);
  const Run graph = train_clipped(GRAPH_MODE, data, 0.25);
  CHECK(eager.losses == graph.losses);
  CHECK(eager.weights == graph.weights);
  CHECK(eager.norms_before == graph.norms_before);
  for (std::size_t s = 0; s < eager.losses.size(); ++s) {
    INFO("step ", s);
    CHECK(eager.norms_before[s] > 0.25);  // the clipping acts on every step
    CHECK(eager.norms_after[s] == doctest::Approx(0.25).epsilon(1e-5));
  }
  // Clipping changes the training: without it the steps differ.
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  Training t;
  nn::TrainOneStepCell step(t.with_loss, t.sgd);
  static_cast<void>(step(data.x, data.y));
  CHECK(step(data.x, data.y).item() != eager.losses[1]);
  CHECK_THROWS_AS(nn::TrainOneStepCell(t.with_loss, t.sgd, {.clip_global_norm = 0.0}), ValueError);
  // A step that clips nothing measures no norm: asking is an error, not a 0 (helper-81).
  CHECK_THROWS_WITH_AS(step.last_global_norm(), doctest::Contains("this step clips no global norm"), ModeError);
  nn::TrainOneStepCell clipping(t.with_loss, t.sgd, {.clip_global_norm = 1.0});
  CHECK(std::isnan(clipping.last_global_norm()));  // before its first step
}

TEST_CASE("clip_by_global_norm on value_and_grad's gradients, then the optimiser: the same in both modes") {
  const Batch data;
  std::vector<std::vector<float>> losses;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    ModeGuard guard;
    set_context({.mode = mode});
    Training t;
    auto vg = value_and_grad(t.with_loss, t.sgd.parameters());
    std::vector<float> run;
    for (int s = 0; s < 4; ++s) {
      auto [value, grads] = vg(data.x, data.y);
      const auto clipped = ops::clip_by_global_norm(grads, 0.5);
      CHECK(ops::global_norm(clipped) == doctest::Approx(0.5).epsilon(1e-5));
      t.sgd(clipped);
      run.push_back(value.item());
    }
    losses.push_back(run);
  }
  CHECK(losses[0] == losses[1]);
}

TEST_CASE("TrainOneStepCell clips each gradient to clip_grad_value, as clip_grad_value_ then the update") {
  const Batch data;
  const double bound = 0.01;
  std::vector<std::vector<float>> weights;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    ModeGuard guard;
    set_context({.mode = mode});
    Training t;
    nn::TrainOneStepCell step(t.with_loss, t.sgd, {.clip_grad_value = bound});
    for (int s = 0; s < 3; ++s) static_cast<void>(step(data.x, data.y));
    weights.emplace_back(t.net.fc2.weight.data(), t.net.fc2.weight.data() + t.net.fc2.weight.numel());
  }
  CHECK(weights[0] == weights[1]);
  // By hand: the gradients clamped, then the optimiser, from the same start.
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  Training t;
  auto vg = value_and_grad(t.with_loss, t.sgd.parameters());
  bool clamped = false;
  for (int s = 0; s < 3; ++s) {
    std::vector<Tensor> grads;
    for (const Tensor& g : vg(data.x, data.y).grads) {
      grads.push_back(ops::clip_by_value(g, -bound, bound));
      clamped = clamped || ops::max(ops::abs(g)).item() > bound;
    }
    t.sgd(grads);
  }
  CHECK(clamped);  // the bound acts
  CHECK(std::vector<float>(t.net.fc2.weight.data(), t.net.fc2.weight.data() + t.net.fc2.weight.numel()) == weights[0]);
  CHECK_THROWS_WITH_AS(nn::TrainOneStepCell(t.with_loss, t.sgd, {.clip_grad_value = -1.0}),
                       "nn::TrainOneStepCell: clip_grad_value must be positive and finite, got -1.000000", ValueError);
}

}  // namespace tests_ops_clip
