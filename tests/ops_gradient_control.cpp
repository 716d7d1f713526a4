// stop_gradient (include/duet/ops/gradient_control.hpp): its value in the gradient harness
// (its gradient is not the function's slope by design, so finite differences do not apply),
// and here the gradients it gives against closed forms in both modes, a target network held
// still while training, and the refusal of a loss it cuts off from every parameter.
#include "ops_harness.hpp"

namespace tests_ops_gradient_control {

namespace {

using namespace duet_test::ops;
using duet::index_t;
namespace nn = duet::nn;
namespace ops = duet::ops;

const bool gradient_control_cases = add_cases([](std::multimap<std::string, Case>& m) {
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 3, 2}}) {
    m.emplace("stop_gradient", make_value_case({shape}, [](const auto& x) { return ops::stop_gradient(x); },
                                               [](const std::vector<D>& xs) { return xs[0].clone(); }));
  }
});

// The gradient of sum(w * f(x)) with respect to x in one mode.
template <class F>
D gradient_in(duet::Mode mode, F f, const D& w, const D& x) {
  duet_test::ModeGuard guard;
  duet::set_context({.mode = mode});
  auto loss = [f](const auto& w_, const auto& x_) { return f(x_) * w_; };
  return duet::value_and_grad(loss, 1)(w, x).grads[0];
}

bool same_bits(const D& a, const D& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), sizeof(double) * static_cast<std::size_t>(a.numel())) == 0;
}

// A network learning to match a target network held still by stop_gradient (a DQN's target
// network, BYOL's target branch): its loss is one number. The target has no bias: two layers
// of one type on one input would be an ambiguous capture (README, "Shared values in graph mode").
struct Chase : nn::Cell<Chase, duet::CONTEXT_MODE, double> {
  nn::Dense<3, 4, double> online;
  nn::Dense<3, 4, double, false> target;
  DUET_CELL_MEMBERS(online, target);
  auto construct(auto x) { return ops::sum(ops::square(online(x) - ops::stop_gradient(target(x)))); }
};

// A loss that reaches its parameters only through stop_gradient.
struct CutOff : nn::Cell<CutOff, duet::CONTEXT_MODE, double> {
  nn::Dense<3, 4, double> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return ops::sum(ops::stop_gradient(fc(x))); }
};

std::vector<double> values_of(const nn::BasicParameter<double>& p) { return {p.data(), p.data() + p.numel()}; }

}  // namespace

TEST_CASE("stop_gradient: d/dx sum(w * x * stop_gradient(x)) is w * x, not 2 w * x, the same bits in both modes") {
  const D x = random_input({3, 5}, -2.0, 2.0, 1);
  const D w = random_input({3, 5}, -1.0, 1.0, 2);
  const auto f = [](const auto& v) { return v * ops::stop_gradient(v); };
  const D pynative = gradient_in(duet::PYNATIVE_MODE, f, w, x);
  const D graph = gradient_in(duet::GRAPH_MODE, f, w, x);
  CHECK(same_bits(pynative, graph));
  for (index_t i = 0; i < x.numel(); ++i) CHECK(pynative.data()[i] == w.data()[i] * x.data()[i]);
}

TEST_CASE("stop_gradient: the straight-through estimator x + stop_gradient(relu(x) - x) has relu's value and slope 1") {
  const D x = random_input({4, 3}, -2.0, 2.0, 3);
  const D w = random_input({4, 3}, -1.0, 1.0, 4);
  const auto f = [](const auto& v) { return v + ops::stop_gradient(ops::relu(v) - v); };
  const D y = f(x);
  for (index_t i = 0; i < x.numel(); ++i) CHECK(y.data()[i] == std::max(x.data()[i], 0.0));
  const D pynative = gradient_in(duet::PYNATIVE_MODE, f, w, x);
  const D graph = gradient_in(duet::GRAPH_MODE, f, w, x);
  CHECK(same_bits(pynative, graph));
  for (index_t i = 0; i < x.numel(); ++i) CHECK(pynative.data()[i] == w.data()[i]);
}

TEST_CASE("stop_gradient: training moves the online network and leaves the target's parameters as they were, in both modes") {
  const D x = random_input({6, 3}, -1.0, 1.0, 5);
  std::vector<std::vector<std::vector<double>>> after;  // per mode: each parameter's values
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    duet::set_seed(7);
    Chase net;
    const std::vector<double> target_weight = values_of(net.target.weight);
    const std::vector<double> online_weight = values_of(net.online.weight);
    nn::BasicSGD<double> sgd(net.parameters(), {.learning_rate = 0.05});
    nn::TrainOneStepCell step(net, sgd);
    const double first = step(x).item();
    double last = first;
    for (int i = 0; i < 20; ++i) last = step(x).item();
    CHECK(last < 0.5 * first);                                // the online network chases the target
    CHECK(values_of(net.target.weight) == target_weight);     // which stays where it was
    CHECK(values_of(net.online.weight) != online_weight);
    std::vector<std::vector<double>> params;
    for (const auto& p : net.parameters()) params.push_back(values_of(*p.parameter));
    after.push_back(std::move(params));
  }
  CHECK(after[0] == after[1]);
}

TEST_CASE("stop_gradient: a loss that reaches no parameter but through it is refused in both modes, not trained on zeros") {
  const D x = random_input({2, 3}, -1.0, 1.0, 8);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    INFO("mode ", mode == duet::GRAPH_MODE ? "graph" : "pynative");
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    CutOff net;
    nn::BasicSGD<double> sgd(net.parameters(), {.learning_rate = 0.1});
    nn::TrainOneStepCell step(net, sgd);
    CHECK_THROWS_WITH_AS(step(x), doctest::Contains("does not depend on anything being differentiated"), duet::ValueError);
    // The input asked for, cut off the same way.
    CHECK_THROWS_WITH_AS(gradient_in(mode, [](const auto& v) { return ops::stop_gradient(v) * 2.0; }, x, x),
                         doctest::Contains("stop_gradient"), duet::ValueError);
  }
}

TEST_CASE("stop_gradient: a view in graph mode, the same network in both modes for compare_modes") {
  duet::set_seed(9);
  Chase net;
  const D x = random_input({5, 3}, -1.0, 1.0, 10);
  const std::string dump = duet::graph_ir(net, duet::shape<duet::dyn, 3>).captured.text;
  CHECK(dump.find("StopGradient") != std::string::npos);
  const duet::ModeReport report = duet::compare_modes(net, x);
  CHECK(report.agree());
  CHECK(report.notes.empty());
  CHECK(report.values_compared >= 4);
}

}  // namespace tests_ops_gradient_control
