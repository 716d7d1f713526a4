// Optimisers against the update rules written out by hand, and learning-rate schedules.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "support.hpp"

namespace tests_nn_optim {

using namespace duet;
using duet_test::ModeGuard;

namespace {

// A one-parameter problem: the gradient of the parameter is given directly.
struct Single {
  nn::Parameter p{Tensor({3}, {1.0f, -2.0f, 0.5f})};
  std::vector<nn::Parameter*> params() { return {&p}; }
};

const std::vector<Tensor> gradients{Tensor({3}, {0.5f, 0.25f, -1.0f}), Tensor({3}, {-0.1f, 0.2f, 0.3f}),
                                    Tensor({3}, {1.0f, 1.0f, 1.0f})};

}  // namespace

TEST_CASE("SGD with momentum, dampening, weight decay and Nesterov follows the rule written out") {
  for (bool nesterov : {false, true}) {
    Single s;
    nn::SGD sgd(s.params(), {.learning_rate = 0.1,
                             .momentum = 0.9,
                             .dampening = nesterov ? 0.0 : 0.2,
                             .weight_decay = 0.01,
                             .nesterov = nesterov});
    std::vector<double> p{1.0, -2.0, 0.5}, buf(3);
    for (std::size_t step = 0; step < gradients.size(); ++step) {
      sgd({gradients[step]});
      for (std::size_t i = 0; i < 3; ++i) {
        const double d = gradients[step].data()[i] + 0.01 * p[i];
        buf[i] = step == 0 ? d : 0.9 * buf[i] + (1 - (nesterov ? 0.0 : 0.2)) * d;
        p[i] -= 0.1 * (nesterov ? d + 0.9 * buf[i] : buf[i]);
        CHECK(s.p.data()[i] == doctest::Approx(p[i]).epsilon(1e-6));
      }
    }
    CHECK(sgd.global_step() == 3);
  }
}

TEST_CASE("Adam and AdamW follow the rule written out, bias correction included") {
  for (bool decoupled : {false, true}) {
    Single s;
    const double wd = 0.05;
    std::vector<double> p{1.0, -2.0, 0.5}, m(3), v(3);
    auto check = [&](auto& opt) {
      for (std::size_t step = 0; step < gradients.size(); ++step) {
        opt({gradients[step]});
        const double t = static_cast<double>(step + 1);
        for (std::size_t i = 0; i < 3; ++i) {
          if (decoupled) p[i] *= 1 - 0.01 * wd;
          const double g = gradients[step].data()[i] + (decoupled ? 0.0 : wd * p[i]);
          m[i] = 0.9 * m[i] + 0.1 * g;
          v[i] = 0.999 * v[i] + 0.001 * g * g;
          const double m_hat = m[i] / (1 - std::pow(0.9, t));
          const double v_hat = v[i] / (1 - std::pow(0.999, t));
          p[i] -= 0.01 * m_hat / (std::sqrt(v_hat) + 1e-8);
          CHECK(s.p.data()[i] == doctest::Approx(p[i]).epsilon(1e-5));
        }
      }
    };
    if (decoupled) {
      nn::AdamW opt(s.params(), {.learning_rate = 0.01, .weight_decay = wd});
      check(opt);
    } else {
      nn::Adam opt(s.params(), {.learning_rate = 0.01, .weight_decay = wd});
      check(opt);
    }
  }
  CHECK(nn::AdamW::default_config().weight_decay == 0.01);
  CHECK(nn::Adam::default_config().weight_decay == 0.0);
}

TEST_CASE("step() applies the gradients the last backward pass left in the parameters") {
  nn::Dense<2, 1> dense;
  dense.weight.set_data(Tensor({1, 2}, {1.0f, 1.0f}));
  dense.bias.set_data(Tensor({1}, {0.0f}));
  nn::SGD sgd(dense.parameters(), {.learning_rate = 0.5});
  const Tensor x({1, 2}, {2.0f, 3.0f});
  auto vg = value_and_grad(dense, dense.parameters());
  vg(x);  // d/dW sum(x Wᵀ + b) = x, d/db = 1
  sgd.step();
  CHECK(dense.weight(0, 0) == doctest::Approx(1.0 - 0.5 * 2.0));
  CHECK(dense.weight(0, 1) == doctest::Approx(1.0 - 0.5 * 3.0));
  CHECK(dense.bias(0) == doctest::Approx(-0.5));
}

TEST_CASE("step() with no gradient of its parameters is a ValueError and changes nothing") {
  nn::Dense<2, 1> dense;
  nn::SGD sgd(dense.parameters(), {.learning_rate = 0.5});
  const Tensor before = dense.weight.clone();
  // A thread that ran no backward pass (PyTorch's optimizer.step() before loss.backward()): this
  // read null gradients before.
  std::string first;
  std::thread([&] {
    try {
      sgd.step();
    } catch (const ValueError& e) {
      first = e.what();
    }
  }).join();
  CHECK(first ==
        "nn::SGD.step(): no backward pass has run on this thread, so there is no gradient to apply; take them first, "
        "duet::value_and_grad(net, optimizer.parameters()), or train with nn::TrainOneStepCell");
  // Another network's backward pass.
  nn::Dense<2, 1> other;
  value_and_grad(other, other.parameters())(Tensor({1, 2}, {2.0f, 3.0f}));
  CHECK_THROWS_WITH_AS(
      sgd.step(), doctest::Contains("nn::SGD.step(): the thread's last backward pass reached none of its 2 parameters"),
      ValueError);
  CHECK(sgd.global_step() == 0);
  CHECK(dense.weight(0, 0) == before(0, 0));
  CHECK(dense.weight(0, 1) == before(0, 1));
}

TEST_CASE("learning-rate schedules") {
  const nn::CosineDecayLR cosine{.min_lr = 0.01, .max_lr = 0.1, .decay_steps = 4};
  CHECK(cosine(0) == doctest::Approx(0.1));
  CHECK(cosine(2) == doctest::Approx(0.055));
  CHECK(cosine(4) == doctest::Approx(0.01));
  CHECK(cosine(9) == doctest::Approx(0.01));
  const nn::ExponentialDecayLR exponential{.learning_rate = 0.1, .decay_rate = 0.5, .decay_steps = 2, .is_stair = true};
  CHECK(exponential(3) == doctest::Approx(0.05));
  const nn::PiecewiseConstantLR piecewise{.milestones = {2, 5}, .values = {0.1, 0.05, 0.01}};
  CHECK(piecewise(1) == 0.1);
  CHECK(piecewise(4) == 0.05);
  CHECK(piecewise(7) == 0.01);
  const nn::WarmUpLR warmup{.learning_rate = 0.1, .warmup_steps = 4};
  CHECK(warmup(0) == 0.0);  // as MindSpore's
  CHECK(warmup(1) == doctest::Approx(0.025));
  CHECK(warmup(10) == doctest::Approx(0.1));

  Single s;
  nn::SGD sgd(s.params(), {.learning_rate = piecewise});
  CHECK(sgd.learning_rate() == 0.1);
  sgd({gradients[0]});
  sgd({gradients[1]});
  CHECK(sgd.learning_rate() == 0.05);
}

TEST_CASE("invalid optimiser settings and gradient lists are rejected") {
  Single s;
  CHECK_THROWS_AS(nn::Adam(s.params(), {.beta1 = 1.0}), ValueError);
  CHECK_THROWS_AS(nn::SGD(s.params(), {.momentum = 0.0, .nesterov = true}), ValueError);
  nn::SGD sgd(s.params());
  CHECK_THROWS_AS(sgd(std::vector<Tensor>{}), ValueError);
  CHECK_THROWS_AS(sgd(std::vector<Tensor>{zeros({4})}), ShapeError);
  CHECK(s.p(0) == 1.0f);  // untouched by the refused steps
}

namespace {

// A cell whose DUET_CELL_MEMBERS forgets its layer: it has no parameters to train.
struct Forgetful : nn::Cell<Forgetful> {
  nn::Flatten flatten;
  nn::Dense<4, 2> fc;
  DUET_CELL_MEMBERS(flatten);
  auto construct(auto x) { return fc(flatten(x)); }
};

template <class F>
std::string value_error_of(F&& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  FAIL("expected a duet::ValueError");
  return {};
}

}  // namespace

TEST_CASE("an invalid hyper-parameter is a ValueError naming the optimiser, the option and the value") {
  Single s;
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(value_error_of([&] { nn::Adam(s.params(), {.learning_rate = -1.0}); }) ==
        "nn::Adam: learning_rate must be >= 0, got -1");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.learning_rate = nan}); }) ==
        "nn::SGD: learning_rate must be finite and >= 0, got nan");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.momentum = -0.5}); }) == "nn::SGD: momentum must be >= 0, got -0.5");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.momentum = 0.0, .nesterov = true}); }) ==
        "nn::SGD: momentum must be > 0 with nesterov, got 0");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.dampening = -0.1}); }) ==
        "nn::SGD: dampening must be >= 0, got -0.1");
  // Nesterov's momentum has no dampened form (helper-90: it was taken).
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.momentum = 0.9, .dampening = 0.5, .nesterov = true}); }) ==
        "nn::SGD: dampening must be 0 with nesterov, got 0.5");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.weight_decay = -1e-4}); }) ==
        "nn::SGD: weight_decay must be >= 0, got -1e-04");
  CHECK(value_error_of([&] { nn::Adam(s.params(), {.beta1 = 1.0}); }) == "nn::Adam: beta1 must be in [0, 1), got 1");
  CHECK(value_error_of([&] { nn::Adam(s.params(), {.beta2 = -0.1}); }) ==
        "nn::Adam: beta2 must be in [0, 1), got -0.1");
  CHECK(value_error_of([&] { nn::Adam(s.params(), {.eps = 0.0}); }) == "nn::Adam: eps must be > 0, got 0");
  CHECK(value_error_of([&] { nn::AdamW(s.params(), {.weight_decay = -0.01}); }) ==
        "nn::AdamW: weight_decay must be >= 0, got -0.01");
  CHECK(value_error_of([&] { nn::Adam(s.params(), {.eps = std::numeric_limits<double>::infinity()}); }) ==
        "nn::Adam: eps must be finite and > 0, got inf");

  // MindSpore accepts momentum above 1 (it diverges, but is not malformed) and a rate of 0.
  CHECK_NOTHROW(nn::SGD(s.params(), {.learning_rate = 0.0, .momentum = 2.0}));

  // A schedule that turns negative is refused at the step that would use it, before any update.
  nn::SGD sgd(s.params(), {.learning_rate = nn::PiecewiseConstantLR{{1}, {0.1, -0.1}}});
  sgd({gradients[0]});
  const float after_one_step = s.p(0);
  CHECK(value_error_of([&] { sgd({gradients[1]}); }) == "nn::SGD: learning_rate must be >= 0, got -0.1 at step 1");
  CHECK(s.p(0) == after_one_step);
  CHECK(sgd.global_step() == 1);
}

TEST_CASE("an optimiser of no parameters is a ValueError that names the likely cause") {
  Forgetful forgetful;
  const std::string hint =
      "optimizer: got no parameters; are its sub-cells and parameters registered? A Cell lists them in "
      "DUET_CELL_MEMBERS(...); a class deriving from nn::DynamicCell overrides for_each_child and "
      "for_each_own_parameter";
  CHECK(value_error_of([&] { nn::Adam adam(forgetful.parameters()); }) == hint);
  CHECK(value_error_of([&] { nn::SGD sgd(std::vector<nn::Parameter*>{}); }) == hint);
  nn::Dense<2, 2> frozen;
  for (const auto& p : frozen.parameters()) p.parameter->requires_grad = false;
  CHECK(value_error_of([&] { nn::AdamW adamw(frozen.parameters()); }) ==
        "optimizer: got 2 parameters, none with requires_grad, so there is nothing to train");
}

TEST_CASE("an optimiser exposes its state by slot, and its step can be set to resume") {
  Single s;
  nn::Adam adam(s.params());
  const auto adam_state = adam.state();
  REQUIRE(adam_state.size() == 2);
  CHECK(adam_state[0].name == "moment1");
  CHECK(adam_state[1].name == "moment2");
  REQUIRE(adam_state[0].tensors->size() == 1);
  CHECK((*adam_state[0].tensors)[0].shape() == s.p.shape());
  CHECK(adam.type_name() == "nn::Adam");
  CHECK(nn::AdamW(s.params()).type_name() == "nn::AdamW");

  nn::SGD plain(s.params());
  CHECK(plain.state().empty());
  nn::SGD momentum(s.params(), {.learning_rate = nn::PiecewiseConstantLR{{2, 5}, {0.1, 0.05, 0.01}}, .momentum = 0.9});
  REQUIRE(momentum.state().size() == 1);
  CHECK(momentum.state()[0].name == "momentum");
  CHECK(momentum.type_name() == "nn::SGD");

  // The step drives the schedule (and Adam's bias correction).
  momentum.set_global_step(5);
  CHECK(momentum.global_step() == 5);
  CHECK(momentum.learning_rate() == 0.01);
  CHECK(value_error_of([&] { momentum.set_global_step(-1); }) == "nn::SGD: global step -1 is negative");
  CHECK(momentum.global_step() == 5);
}

TEST_CASE("AdamW decays by 0.01 when the config leaves weight_decay unset, as PyTorch's, even with other fields set") {
  // The same parameter after the same steps from an unset and an explicit weight_decay.
  const auto same_steps = []<class Optimizer>(nn::AdamConfig unset, nn::AdamConfig explicit_decay) {
    Single a, b;
    Optimizer first(a.params(), unset);
    Optimizer second(b.params(), explicit_decay);
    for (const Tensor& g : gradients) {
      first({g});
      second({g});
    }
    return std::equal(a.p.data(), a.p.data() + 3, b.p.data());
  };
  CHECK(same_steps.operator()<nn::AdamW>({.learning_rate = 0.01}, {.learning_rate = 0.01, .weight_decay = 0.01}));
  CHECK(same_steps.operator()<nn::Adam>({.learning_rate = 0.01}, {.learning_rate = 0.01, .weight_decay = 0.0}));
  CHECK_FALSE(same_steps.operator()<nn::AdamW>({.learning_rate = 0.01}, {.learning_rate = 0.01, .weight_decay = 0.0}));
}

TEST_CASE("weight decay applies to the parameters .decays chooses, by name and shape, in Adam, AdamW and SGD") {
  // Zero gradients: only weight decay moves a parameter.
  nn::Dense<3, 2> layer;
  const auto matrices = [](std::string_view, const Shape& shape) { return shape.rank() >= 2; };
  const std::vector<Tensor> zero{zeros({2, 3}), zeros({2})};
  const auto moved = [&](auto& optimizer) {
    const std::vector<float> weight(layer.weight.data(), layer.weight.data() + 6);
    const std::vector<float> bias(layer.bias.data(), layer.bias.data() + 2);
    optimizer(zero);
    return std::pair{!std::equal(weight.begin(), weight.end(), layer.weight.data()),
                     !std::equal(bias.begin(), bias.end(), layer.bias.data())};
  };
  layer.bias.set_data(Tensor({2}, {0.5f, -0.5f}));
  nn::AdamW adamw(layer.parameters(), {.learning_rate = 0.1, .decays = matrices});
  CHECK(moved(adamw) == std::pair{true, false});
  nn::SGD sgd(layer.parameters(), {.learning_rate = 0.1, .weight_decay = 0.1, .decays = matrices});
  CHECK(moved(sgd) == std::pair{true, false});
  nn::Adam adam(layer.parameters(), {.learning_rate = 0.1, .weight_decay = 0.1,
                                     .decays = [](std::string_view name, const Shape&) { return name == "bias"; }});
  CHECK(moved(adam) == std::pair{false, true});
  // Without names there is nothing to choose by.
  CHECK(value_error_of([&] { nn::AdamW(std::vector<nn::Parameter*>{&layer.weight}, {.decays = matrices}); }) ==
        "nn::AdamW: .decays chooses parameters by name, and the optimizer was given parameters without names; pass "
        "net.parameters()");
}

TEST_CASE("parameter groups: each group's rate and weight decay, the same bits as an optimiser per group") {
  set_seed(5);
  nn::Dense<3, 2> body, head;
  nn::Dense<3, 2> body_alone, head_alone;
  for (auto [from, to] : {std::pair{&body, &body_alone}, std::pair{&head, &head_alone}}) {
    to->weight.set_data(from->weight);
    to->bias.set_data(from->bias);
  }
  const std::vector<Tensor> body_grads{randn({2, 3}, 1), randn({2}, 2)};
  const std::vector<Tensor> head_grads{randn({2, 3}, 3), randn({2}, 4)};
  std::vector<Tensor> both = body_grads;
  both.insert(both.end(), head_grads.begin(), head_grads.end());
  const auto same = [](nn::Dense<3, 2>& a, nn::Dense<3, 2>& b) {
    return std::equal(a.weight.data(), a.weight.data() + 6, b.weight.data()) &&
           std::equal(a.bias.data(), a.bias.data() + 2, b.bias.data());
  };
  // Three steps of the grouped optimiser and of one per group, from the same gradients.
  const auto same_after_steps = [&](auto& grouped, auto& for_body, auto& for_head) {
    for (int step = 0; step < 3; ++step) {
      grouped(both);
      for_body(body_grads);
      for_head(head_grads);
    }
    return same(body, body_alone) && same(head, head_alone);
  };
  SUBCASE("AdamW: the body at its own rate, decay and a schedule, the head at the optimiser's") {
    const auto schedule = nn::CosineDecayLR{.min_lr = 0.001, .max_lr = 0.05, .decay_steps = 4};
    nn::AdamW grouped({{.params = body.parameters(), .learning_rate = schedule, .weight_decay = 0.2},
                       {.params = head.parameters()}},
                      {.learning_rate = 0.01});
    nn::AdamW for_body(body_alone.parameters(), {.learning_rate = schedule, .weight_decay = 0.2});
    nn::AdamW for_head(head_alone.parameters(), {.learning_rate = 0.01});
    CHECK(grouped.group_count() == 2);
    CHECK(grouped.learning_rate(0) == schedule(0));
    CHECK(grouped.learning_rate(1) == 0.01);
    CHECK(grouped.group_of(1) == 0);
    CHECK(grouped.group_of(2) == 1);
    CHECK(same_after_steps(grouped, for_body, for_head));
  }
  SUBCASE("SGD with momentum, .decays applying within each group") {
    const auto matrices = [](std::string_view, const Shape& shape) { return shape.rank() >= 2; };
    nn::SGD grouped({{.params = body.parameters(), .learning_rate = 0.5, .weight_decay = 0.1},
                     {.params = head.parameters(), .weight_decay = 0.0}},
                    {.learning_rate = 0.05, .momentum = 0.9, .weight_decay = 0.3, .decays = matrices});
    nn::SGD for_body(body_alone.parameters(), {.learning_rate = 0.5, .momentum = 0.9, .weight_decay = 0.1, .decays = matrices});
    nn::SGD for_head(head_alone.parameters(), {.learning_rate = 0.05, .momentum = 0.9});
    CHECK(same_after_steps(grouped, for_body, for_head));
  }
}

TEST_CASE("parameter groups: a parameter in two groups, an empty group or a bad group setting is a ValueError") {
  nn::Dense<3, 2> body, head;
  CHECK(value_error_of([&] {
          nn::Adam({{.params = body.parameters()}, {.params = {body.parameters()[1]}}});
        }) == "optimizer: parameter 'bias' is in parameter group 0 and in group 1; give each parameter to one group");
  CHECK(value_error_of([&] {
          nn::Adam({{.params = {body.parameters()[0], body.parameters()[0]}}});
        }) == "optimizer: parameter 'weight' is in parameter group 0 twice; give each parameter to one group");
  CHECK(value_error_of([&] { nn::Adam({{.params = body.parameters()}, {}}); }) ==
        "optimizer: parameter group 1 has no parameters");
  CHECK(value_error_of([&] {
          nn::SGD({{.params = body.parameters()}, {.params = head.parameters(), .learning_rate = -1.0}});
        }) == "nn::SGD: learning_rate of parameter group 1 must be >= 0, got -1");
  CHECK(value_error_of([&] {
          nn::AdamW({{.params = body.parameters(), .weight_decay = -0.5}, {.params = head.parameters()}});
        }) == "nn::AdamW: weight_decay of parameter group 0 must be >= 0, got -0.5");
  nn::Adam adam({{.params = body.parameters()}, {.params = head.parameters()}});
  CHECK(value_error_of([&] { (void)adam.learning_rate(2); }) ==
        "nn::Adam: parameter group 2 does not exist (it has 2)");
  // A schedule of one group turning negative is found at the step, before any update.
  const Tensor weight_before = body.weight.clone();
  nn::SGD later({{.params = body.parameters()},
                 {.params = head.parameters(), .learning_rate = [](std::int64_t t) { return t == 0 ? 0.1 : -0.1; }}});
  const std::vector<Tensor> grads{ones({2, 3}), ones({2}), ones({2, 3}), ones({2})};
  later(grads);
  const Tensor after_one = body.weight.clone();
  CHECK(value_error_of([&] { later(grads); }) ==
        "nn::SGD: learning_rate of parameter group 1 must be >= 0, got -0.1 at step 1");
  CHECK(std::equal(after_one.data(), after_one.data() + 6, body.weight.data()));
  CHECK_FALSE(std::equal(weight_before.data(), weight_before.data() + 6, body.weight.data()));
}

TEST_CASE("an optimiser refuses value_and_grad's gradients of other parameters, also of the same shapes") {
  set_seed(6);
  nn::Dense<3, 2> mine, other;
  const Tensor x = randn({4, 3}, 7);
  const auto loss_of = [](nn::Dense<3, 2>& net) {
    return value_and_grad([&net](const Tensor& in) { return ops::sum(ops::square(net(in))); }, net.parameters());
  };
  nn::Adam adam(mine.parameters());
  auto of_other = loss_of(other);
  CHECK(value_error_of([&] { adam(of_other(x).grads); }) ==
        "nn::Adam(grads): gradient 0 is value_and_grad's gradient of another parameter than this optimizer's #0 'weight' "
        "(another network's, of the same shape?), so the update would move the wrong parameters; take the gradients "
        "with respect to the parameters the optimizer was made over, in its order "
        "(value_and_grad(net, optimizer.parameters()))");
  // Groups in another order than the network's: the gradients must follow the optimizer's.
  nn::SGD reordered({{.params = {mine.parameters()[1]}}, {.params = {mine.parameters()[0]}}});
  auto of_mine = loss_of(mine);
  auto result = of_mine(x);
  CHECK_NOTHROW(reordered(std::vector{result.grads[1].clone(), result.grads[0].clone()}));  // copies: taken as they come
  CHECK(value_error_of([&] { reordered(of_mine(x).grads); }) ==
        "nn::SGD(grads): gradient 0 is of the optimizer's parameter #1 'weight', not of its #0 'bias', so the update "
        "would move the wrong parameters; take the gradients with respect to the parameters the optimizer was made "
        "over, in its order (value_and_grad(net, optimizer.parameters()))");
  // Not only the last list value_and_grad returned: an earlier one, one gradient replaced by
  // another network's, two of one shape swapped (helper-79's three ways past a check of the
  // last list alone).
  auto earlier = of_other(x).grads;
  auto latest = of_mine(x).grads;
  CHECK(value_error_of([&] { adam(earlier); }).find("gradient 0 is value_and_grad's gradient of another") !=
        std::string::npos);
  auto mixed = latest;
  mixed[1] = earlier[1];
  CHECK(value_error_of([&] { adam(mixed); }).find("gradient 1 is value_and_grad's gradient of another") !=
        std::string::npos);
  nn::Dense<3, 3> first, second;
  auto pair_grads = value_and_grad([&](const Tensor& in) { return ops::sum(first(second(in))); },
                                   std::vector<nn::Parameter*>{&first.weight, &second.weight})(x).grads;
  nn::SGD pair(std::vector<nn::Parameter*>{&first.weight, &second.weight});
  CHECK(value_error_of([&] { pair(std::vector{pair_grads[1], pair_grads[0]}); }) ==
        "nn::SGD(grads): gradient 0 is of the optimizer's parameter #1, not of its #0, so the update would move the "
        "wrong parameters; take the gradients with respect to the parameters the optimizer was made over, in its "
        "order (value_and_grad(net, optimizer.parameters()))");
  // Changed in place (clipped), still its own: accepted.
  auto own = of_mine(x).grads;
  for (float& v : own[0].values()) v = std::clamp(v, -0.1f, 0.1f);
  const Tensor before = mine.weight.clone();
  adam(own);
  CHECK_FALSE(std::equal(before.data(), before.data() + 6, mine.weight.data()));
}

TEST_CASE("set_learning_rate changes a group's rate, or every group's, between steps, and a bad one changes nothing") {
  Single s;
  nn::SGD sgd(s.params(), {.learning_rate = 0.1});
  sgd({gradients[0]});
  sgd.set_learning_rate(sgd.learning_rate() * 0.5);  // a plateau's cut
  CHECK(sgd.learning_rate() == 0.05);
  const std::vector<float> before(s.p.data(), s.p.data() + 3);
  sgd({gradients[1]});
  for (std::size_t i = 0; i < 3; ++i) CHECK(s.p.data()[i] == doctest::Approx(before[i] - 0.05f * gradients[1].data()[i]));
  CHECK(value_error_of([&] { sgd.set_learning_rate(-1.0); }) == "nn::SGD: learning_rate must be >= 0, got -1");
  CHECK(sgd.learning_rate() == 0.05);
  nn::Dense<3, 2> body, head;
  nn::Adam adam({{.params = body.parameters()}, {.params = head.parameters()}}, {.learning_rate = 0.01});
  adam.set_learning_rate(nn::WarmUpLR{.learning_rate = 0.1, .warmup_steps = 10}, 1);
  CHECK(adam.learning_rate(0) == 0.01);
  CHECK(adam.learning_rate(1) == 0.0);
  CHECK(value_error_of([&] { adam.set_learning_rate(0.1, 2); }) == "nn::Adam: parameter group 2 does not exist (it has 2)");
}

TEST_CASE("a schedule whose step count is not positive, or whose values are too few, names the field") {
  Single s;
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.learning_rate = nn::ExponentialDecayLR{0.1, 0.9, 0}}); }) ==
        "nn::ExponentialDecayLR: decay_steps must be positive, got 0");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.learning_rate = nn::CosineDecayLR{0.0, 0.1, -5}}); }) ==
        "nn::CosineDecayLR: decay_steps must be positive, got -5");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.learning_rate = nn::WarmUpLR{0.1, 0}}); }) ==
        "nn::WarmUpLR: warmup_steps must be positive, got 0");
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.learning_rate = nn::PiecewiseConstantLR{{10, 20}, {}}}); }) ==
        "nn::PiecewiseConstantLR: values must hold one rate per milestone (and one for after the last), got 0 for 2 "
        "milestones");
}

TEST_CASE("optimizer(grads) leaves a parameter with no gradient as it is, weight decay and momentum included") {
  // helper-90: a layer the loss never reads, and a frozen one, moved under weight decay and
  // momentum when the update came from value_and_grad's list, where step() and TrainOneStepCell
  // left them (PyTorch skips a parameter whose grad is None).
  set_seed(3);
  nn::Dense<3, 2> used, unused, frozen;
  const Tensor x = randn({4, 3}, 5);
  std::vector<nn::Parameter*> all{&used.weight, &unused.weight, &frozen.weight};
  nn::SGD sgd(all, {.learning_rate = 0.1, .momentum = 0.9, .weight_decay = 0.1});
  nn::AdamW adamw(all);
  frozen.weight.requires_grad = false;  // after the optimisers were made: they keep it, and skip it
  auto vg = value_and_grad([&](const Tensor& in) { return ops::sum(ops::square(used(in) + frozen(in))); }, all);
  const Tensor unused_before = unused.weight.clone(), frozen_before = frozen.weight.clone();
  const Tensor used_before = used.weight.clone();
  for (int step = 0; step < 3; ++step) {
    auto grads = vg(x).grads;
    CHECK(grads[0].gradient_reached());
    CHECK_FALSE(grads[1].gradient_reached());  // not read: zeros, marked
    CHECK_FALSE(grads[2].gradient_reached());  // frozen: zeros too, so out of any norm
    CHECK(std::ranges::all_of(grads[2].values(), [](float v) { return v == 0.0f; }));
    sgd(grads);
    adamw(ops::clip_by_global_norm(grads, 0.5));  // the clipped list keeps the marks
  }
  CHECK(std::equal(unused_before.data(), unused_before.data() + 6, unused.weight.data()));
  CHECK(std::equal(frozen_before.data(), frozen_before.data() + 6, frozen.weight.data()));
  CHECK_FALSE(std::equal(used_before.data(), used_before.data() + 6, used.weight.data()));
}

namespace {

// A network whose parameters are named by their paths ("fc2.weight").
struct TwoLayers : nn::Cell<TwoLayers> {
  nn::Dense<3, 4> fc1;
  nn::Dense<4, 2> fc2;
  DUET_CELL_MEMBERS(fc1, fc2);
  auto construct(auto x) { return fc2(ops::relu(fc1(x))); }
};

// Every value of the network's parameters and of the optimiser's state, and its step count.
template <class Optimizer>
std::vector<float> everything(TwoLayers& net, Optimizer& optimizer) {
  std::vector<float> out;
  for (const auto& p : net.parameters())
    out.insert(out.end(), p.parameter->data(), p.parameter->data() + p.parameter->numel());
  for (const auto& slot : optimizer.state()) {
    for (const Tensor& t : *slot.tensors) out.insert(out.end(), t.data(), t.data() + t.numel());
  }
  out.push_back(static_cast<float>(optimizer.global_step()));
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Seed {
  explicit Seed(std::uint64_t seed) { set_seed(seed); }
};

// The network and its optimiser twice from one seed: one pair to see bad gradients, the other
// never to. One step is taken first, so that momentum and moments are not zero.
template <class Optimizer>
struct Twins {
  template <class Make>
  explicit Twins(const Make& make)
      : optimizer(make(net.parameters())), reference_optimizer(make(reference.parameters())) {
    step_both();
  }
  std::vector<Tensor> grads() { return value_and_grad(with_loss, optimizer->parameters())(x, y).grads; }
  void step_both() {
    (*optimizer)(grads());
    (*reference_optimizer)(value_and_grad(reference_with_loss, reference_optimizer->parameters())(x, y).grads);
  }
  std::vector<float> now() { return everything(net, *optimizer); }
  bool as_reference() { return same_bits(now(), everything(reference, *reference_optimizer)); }

  const Tensor x = randn({5, 3}, 11);
  const Tensor y = randn({5, 2}, 12);
  nn::MSELoss<> loss;
  Seed seed{4};
  TwoLayers net;
  Seed same_seed{4};
  TwoLayers reference;
  nn::WithLossCell<TwoLayers, nn::MSELoss<>> with_loss{net, loss};
  nn::WithLossCell<TwoLayers, nn::MSELoss<>> reference_with_loss{reference, loss};
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<Optimizer> reference_optimizer;
};

// A NaN in one element of one gradient, through optimizer(grads), and an infinity through
// step(): each refused naming the parameter and the element, nothing changed; then the next
// steps are bit for bit those of a run that never saw them.
template <class Make>
void check_nonfinite_changes_nothing(const Make& make, const std::string& type) {
  Twins<typename std::invoke_result_t<Make, std::vector<nn::NamedParameter<float>>>::element_type> t(make);
  const std::vector<float> before = t.now();

  auto grads = t.grads();
  grads[2].values()[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK(value_error_of([&] { (*t.optimizer)(grads); }) ==
        type +
            ": the gradient of parameter #2 'fc2.weight' is NaN at element 5 of [2, 4] (step 1), so the step "
            "changed nothing: no parameter, no optimiser state (if the loss was finite, the gradient of an "
            "operation overflowed); to skip such steps instead, as loss scaling does, make the optimizer with "
            "{.on_nonfinite = "
            "nn::NonFiniteGradient::skip}");
  CHECK(same_bits(t.now(), before));

  static_cast<void>(t.grads());
  t.net.fc1.bias.grad.values()[3] = -std::numeric_limits<float>::infinity();
  CHECK(value_error_of([&] {
          t.optimizer->step();
        }).starts_with(type + ": the gradient of parameter #1 'fc1.bias' is infinite at element 3 of [4] (step 1)"));
  CHECK(same_bits(t.now(), before));
  CHECK(t.optimizer->skipped_steps() == 0);  // refused, not skipped

  for (int step = 0; step < 2; ++step) t.step_both();
  CHECK(t.as_reference());
  CHECK(t.optimizer->global_step() == 3);
}

}  // namespace

TEST_CASE("a NaN or infinite gradient is a ValueError naming parameter and element, and changes nothing") {
  using Params = std::vector<nn::NamedParameter<float>>;
  check_nonfinite_changes_nothing([](const Params& p) { return std::make_unique<nn::SGD>(p, nn::SGDConfig{}); },
                                  "nn::SGD");
  check_nonfinite_changes_nothing(
      [](const Params& p) {
        return std::make_unique<nn::SGD>(p, nn::SGDConfig{.momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
      },
      "nn::SGD");
  check_nonfinite_changes_nothing(
      [](const Params& p) { return std::make_unique<nn::Adam>(p, nn::AdamConfig{.weight_decay = 0.01}); }, "nn::Adam");
  check_nonfinite_changes_nothing([](const Params& p) { return std::make_unique<nn::AdamW>(p); }, "nn::AdamW");
}

namespace {

// One sample whose loss, (w·x)² = 2.25e38, is a float and whose weight gradient, 2·w·x·x, is not:
// a gradient that overflows while the loss stays finite.
struct Overflow {
  nn::Dense<1, 1> net;
  nn::MSELoss<> loss;
  nn::WithLossCell<nn::Dense<1, 1>, nn::MSELoss<>> with_loss{net, loss};
  const Tensor x = Tensor({1, 1}, {1.5e19f});
  const Tensor y = zeros({1, 1});
  Overflow() {
    net.weight.set_data(Tensor({1, 1}, {1.0f}));
    net.bias.set_data(zeros({1}));
  }
};

}  // namespace

// helper-104: a rate of 1e39, a finite double, was taken; its first step wrote inf into the
// float weights in silence, and the next was refused for a NaN gradient, with no word of why.
TEST_CASE("a rate too large for the parameters' type is refused, and a NaN gradient of an infinite weight says so") {
  Single s;
  CHECK(value_error_of([&] { nn::SGD(s.params(), {.learning_rate = 1e39}); }) ==
        "nn::SGD: learning_rate must be at most 3.4028234663852886e+38 in magnitude (Float32's largest) and >= 0, got "
        "1e+39");
  CHECK_NOTHROW(nn::SGD(s.params(), {.learning_rate = 1e38}));
  s.p.data()[1] = std::numeric_limits<float>::infinity();
  nn::SGD sgd(s.params());
  CHECK(
      value_error_of([&] {
        sgd({Tensor({3}, {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f})});
      })
          .starts_with("nn::SGD: the gradient of parameter #0 is NaN at element 1 of [3], and the parameter itself is "
                       "already infinite at element 1 (an update that overflowed, or an assignment) (step 0), so the "
                       "step changed nothing"));
}

TEST_CASE("a gradient that overflows is refused alike in both modes, also clipped, and TrainOneStepCell skips it") {
  ModeGuard guard;
  std::vector<std::string> said;
  for (const Mode mode : {GRAPH_MODE, PYNATIVE_MODE}) {
    set_context({.mode = mode});
    Overflow o;
    nn::Adam adam(o.net.parameters());
    auto vg = value_and_grad(o.with_loss, adam.parameters());
    auto result = vg(o.x, o.y);  // not a structured binding: clang 14 does not capture one
    const std::vector<Tensor>& grads = result.grads;
    CHECK(std::isfinite(result.value.item()));
    said.push_back(value_error_of([&] { adam(grads); }));
    CHECK(said.back().starts_with(
        "nn::Adam: the gradient of parameter #0 'weight' is infinite at element 0 of [1, 1] (step 0)"));
    // Clipped by the global norm, MindSpore's way: the infinity becomes NaN (inf · 0), still refused.
    CHECK(value_error_of([&] {
            adam(ops::clip_by_global_norm(grads, 1.0));
          }).starts_with("nn::Adam: the gradient of parameter #0 'weight' is NaN at element 0 of [1, 1]"));
    CHECK(adam.global_step() == 0);
    CHECK(o.net.weight.data()[0] == 1.0f);

    // TrainOneStepCell skips it, with the optimiser's words, and counts it; checked once.
    std::ostringstream cerr_text;
    std::streambuf* const cerr = std::cerr.rdbuf(cerr_text.rdbuf());
    nn::TrainOneStepCell step(o.with_loss, adam);
    const float loss = step(o.x, o.y).item();
    step(o.x, o.y);
    std::cerr.rdbuf(cerr);
    CHECK((std::isfinite(loss) && loss > 2e38f));
    std::ostringstream printed;
    printed << loss;
    CHECK(step.skipped_steps() == 2);
    CHECK(adam.skipped_steps() == 0);
    CHECK(adam.global_step() == 0);
    CHECK(o.net.weight.data()[0] == 1.0f);
    CHECK(o.net.bias.data()[0] == 0.0f);
    CHECK(cerr_text.str() ==
          "duet: warning: nn::TrainOneStepCell: the gradient of parameter #0 'weight' is infinite at element 0 of [1, "
          "1] (loss " +
              printed.str() +
              "), so this step skipped its update, as every such step will (said once; skipped_steps() "
              "counts them)\n");
    // Clipped by value, the clamp finds the infinity (TrainOneStepCell's own check, not repeated by
    // the optimiser) and the step skips it as well.
    std::cerr.rdbuf(cerr_text.rdbuf());
    nn::TrainOneStepCell clipped(o.with_loss, adam, {.clip_grad_value = 1.0});
    clipped(o.x, o.y);
    std::cerr.rdbuf(cerr);
    CHECK(clipped.skipped_steps() == 1);
    CHECK(adam.global_step() == 0);
    CHECK(o.net.weight.data()[0] == 1.0f);
  }
  CHECK(said[0] == said[1]);
}

TEST_CASE("on_nonfinite = skip skips such steps, counts them and says the first once, for loss scaling") {
  Twins<nn::SGD> t([](const std::vector<nn::NamedParameter<float>>& p) {
    return std::make_unique<nn::SGD>(p, nn::SGDConfig{.momentum = 0.9, .on_nonfinite = nn::NonFiniteGradient::skip});
  });
  const std::vector<float> before = t.now();
  std::ostringstream said;
  std::streambuf* const cerr = std::cerr.rdbuf(said.rdbuf());
  for (int bad = 0; bad < 2; ++bad) {
    auto grads = t.grads();
    grads[3].values()[1] = std::numeric_limits<float>::infinity();
    (*t.optimizer)(grads);
  }
  static_cast<void>(t.grads());
  t.net.fc1.weight.grad.values()[0] = std::numeric_limits<float>::quiet_NaN();
  t.optimizer->step();
  std::cerr.rdbuf(cerr);
  CHECK(said.str() ==
        "duet: warning: nn::SGD: the gradient of parameter #3 'fc2.bias' is infinite at element 1 of [2], so this step "
        "skipped its update, as every such step will (said once; skipped_steps() counts them)\n");
  CHECK(t.optimizer->skipped_steps() == 3);
  CHECK(same_bits(t.now(), before));
  t.step_both();
  CHECK(t.as_reference());
}

TEST_CASE("a large gradient, checked on two threads, is said at its first bad element") {
  const int threads = get_num_threads();
  set_num_threads(2);
  const index_t n = index_t{1} << 20;
  nn::Parameter p(zeros({n}));
  nn::SGD sgd(std::vector<nn::Parameter*>{&p});
  Tensor g = zeros({n});
  g.data()[900000] = std::numeric_limits<float>::quiet_NaN();
  g.data()[700001] = std::numeric_limits<float>::infinity();  // in the second thread's half
  const std::string said = value_error_of([&] { sgd({g}); });
  set_num_threads(threads);
  CHECK(said.starts_with("nn::SGD: the gradient of parameter #0 is infinite at element 700001 of [1048576] (step 0)"));
  CHECK(std::ranges::all_of(p.values(), [](float v) { return v == 0.0f; }));
}

TEST_CASE("first_nonfinite finds the first NaN or infinity in any block and its tail, in float and double") {
  for (const index_t n : {1, 7, 255, 256, 257, 1000}) {
    std::vector<float> f(static_cast<std::size_t>(n), 1.0f);
    std::vector<double> d(static_cast<std::size_t>(n), -2.0);
    f.back() = std::numeric_limits<float>::max();
    d.back() = std::numeric_limits<double>::denorm_min();
    CHECK(duet::detail::first_nonfinite(f.data(), n) == -1);
    CHECK(duet::detail::first_nonfinite(d.data(), n) == -1);
    for (const index_t at : {index_t{0}, n / 2, n - 1}) {
      f.assign(f.size(), 1.0f);
      d.assign(d.size(), -2.0);
      f[static_cast<std::size_t>(at)] = -std::numeric_limits<float>::infinity();
      d[static_cast<std::size_t>(at)] = std::numeric_limits<double>::quiet_NaN();
      if (at + 1 < n) f.back() = std::numeric_limits<float>::quiet_NaN();  // a later one: the first is found
      CHECK(duet::detail::first_nonfinite(f.data(), n) == at);
      CHECK(duet::detail::first_nonfinite(d.data(), n) == at);
    }
  }
}

}  // namespace tests_nn_optim
