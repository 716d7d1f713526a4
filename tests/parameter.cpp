// Parameter::derived keeps a form computed from the values until they may have changed
// (set_data: tests/cell.cpp); operations on a cell's parameters alone (nn::ParameterResult) in
// both modes.
#include "support.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace tests_parameter {

using namespace duet;

namespace {

// A derived form that records the values it was made from.
struct Sum {
  float total = 0;
};

Sum sum_of(const nn::Parameter& p) {
  Sum s;
  for (float v : std::as_const(p).values()) s.total += v;
  return s;
}

// A learned temperature, a difference of two parameters and weight tying: each an operation
// on parameters alone, next to the input's operations.
struct Tied : nn::Cell<Tied> {
  nn::Parameter embed{randn({5, 3}, 11)};
  nn::Parameter log_scale{Tensor({1}, {0.2f})};
  nn::Parameter shift_a{Tensor({5}, {0.1f, -0.2f, 0.3f, 0.0f, 0.5f})};
  nn::Parameter shift_b{Tensor({5}, {0.4f, 0.1f, -0.1f, 0.2f, 0.0f})};
  DUET_CELL_MEMBERS(embed, log_scale, shift_a, shift_b);
  auto construct(auto x) {
    auto h = ops::matmul(x, embed);
    return ops::matmul(h, ops::transpose<1, 0>(embed)) * ops::exp(log_scale * 2.f) + (shift_a - shift_b);
  }
};

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(float)) == 0;
}

// sum(net(x)) in double, by the network's own forward in PyNative mode.
double summed_output(Tied& net, const Tensor& x) {
  const Tensor y = net(x);
  double total = 0;
  for (const float v : y.values()) total += v;
  return total;
}

}  // namespace

TEST_CASE("operations on parameters alone: both modes give the same bits, forward and gradients, and the gradients of finite differences") {
  duet_test::ModeGuard guard;
  Tied net;
  const Tensor x = randn({4, 5}, 3);
  std::vector<Tensor> outputs;
  std::vector<std::vector<Tensor>> grads;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    outputs.push_back(net(x));
    grads.push_back(value_and_grad(net, net.parameters())(x).grads);
  }
  // A static graph: each parameter node appended where it is read, none merged with another.
  const std::string ir = graph_ir(net, shape<dyn, 5>).optimized.text;
  CHECK(ir.find("traced") == std::string::npos);
  CHECK(ir.find("Exp(") != std::string::npos);
  CHECK(same_bits(outputs[0], outputs[1]));
  REQUIRE(grads[0].size() == 4);
  for (std::size_t i = 0; i < 4; ++i) CHECK(same_bits(grads[0][i], grads[1][i]));
  for (const Tensor& g : grads[1]) CHECK(std::isfinite(g.values()[0]));

  // Central differences of sum(net(x)), one element of each parameter.
  set_context({.mode = PYNATIVE_MODE});
  const std::vector<nn::Parameter*> params{&net.embed, &net.log_scale, &net.shift_a, &net.shift_b};
  for (std::size_t i = 0; i < params.size(); ++i) {
    nn::Parameter& p = *params[i];
    const float saved = p.data()[1 % p.numel()];
    const float h = 1e-2f;
    p.data()[1 % p.numel()] = saved + h;
    const double up = summed_output(net, x);
    p.data()[1 % p.numel()] = saved - h;
    const double down = summed_output(net, x);
    p.data()[1 % p.numel()] = saved;
    CAPTURE(i);
    CHECK(grads[1][i].values()[static_cast<std::size_t>(1 % p.numel())] == doctest::Approx((up - down) / (2 * h)).epsilon(2e-3));
  }
}

TEST_CASE("operations on parameters alone: graph mode reads the parameters at each call, and trains them") {
  duet_test::ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  Tied net;
  const Tensor x = randn({4, 5}, 3);
  const Tensor before = net(x);
  net.log_scale.set_data(Tensor({1}, {-0.4f}));
  const Tensor graph_after = net(x);
  set_context({.mode = PYNATIVE_MODE});
  CHECK(same_bits(graph_after, net(x)));
  CHECK_FALSE(same_bits(before, graph_after));

  // A training step in graph mode moves every parameter, the temperature too.
  set_context({.mode = GRAPH_MODE});
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
  nn::TrainOneStepCell step(with_loss, sgd);
  const float scale = net.log_scale.values()[0];
  const Tensor embed = net.embed.clone();
  step(x, zeros({4, 5}));
  CHECK(net.log_scale.values()[0] != scale);
  CHECK_FALSE(same_bits(embed, net.embed));
}

namespace {
// Parameters as the first operand next to the input (helper-87's scale * x + shift): graph
// mode captured scale's node before the input and read the input in its place.
struct ScaleFirst : nn::Cell<ScaleFirst> {
  nn::Parameter scale{Tensor({1, 4}, {1.f, 2.f, 3.f, 4.f})};
  nn::Parameter shift{Tensor({1, 4}, {10.f, 20.f, 30.f, 40.f})};
  DUET_CELL_MEMBERS(scale, shift);
  auto construct(auto x) { return ops::maximum(scale * x + shift, shift - x * scale) / scale; }
};
struct ScaleOnly : nn::Cell<ScaleOnly> {
  nn::Parameter scale{Tensor({1, 4}, {1.f, 2.f, 3.f, 4.f})};
  DUET_CELL_MEMBERS(scale);
  auto construct(auto x) { return scale * x * 2.f; }
};
// Inside another cell's capture, where the wrong graph was spliced.
struct Outer : nn::Cell<Outer> {
  ScaleOnly inner;
  DUET_CELL_MEMBERS(inner);
  auto construct(auto x) { return inner(x) + x; }
};
}  // namespace

TEST_CASE("a parameter as the first operand next to the input: the same values and gradients in both modes") {
  duet_test::ModeGuard guard;
  ScaleFirst net;
  const Tensor x({2, 4}, {0.5f, 0.f, 5.f, 7.f, -1.f, -2.f, -30.f, 4.f});
  std::vector<Tensor> outputs;
  std::vector<std::vector<Tensor>> grads;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    outputs.push_back(net(x));
    grads.push_back(value_and_grad([&](const auto& in) { return ops::sum(net(in)); }, net.parameters())(x).grads);
  }
  // max(s x + b, b - x s) / s, by hand.
  const std::vector<double> expected{10.5, 10, 15, 17, 11, 12, 40, 14};
  CHECK(duet_test::values_of(outputs[0]) == expected);
  CHECK(same_bits(outputs[0], outputs[1]));
  REQUIRE(grads[1].size() == 2);
  for (std::size_t i = 0; i < 2; ++i) CHECK(same_bits(grads[0][i], grads[1][i]));
  // d/d shift = 1/s on each row; nothing is zero.
  CHECK(duet_test::values_of(grads[1][1]) == std::vector<double>{2, 1, static_cast<double>(2.f / 3.f), 0.5});
  // A static graph, the input first: no traced fallback, no false ambiguity between the two.
  const std::string ir = graph_ir(net, shape<dyn, 4>).optimized.text;
  CHECK(ir.find("traced") == std::string::npos);
  CHECK(ir.find("%0 = Input 0") != std::string::npos);

  // One parameter alone, in a cell inside another: there the graph was static and read x for
  // the parameter (2 x² + x).
  Outer outer;
  set_context({.mode = GRAPH_MODE});
  CHECK(duet_test::values_of(outer(x)) == std::vector<double>{1.5, 0, 35, 63, -3, -10, -210, 36});
}

TEST_CASE("operations on parameters alone, outside a network: a tensor, recorded by a tape") {
  nn::Parameter p(Tensor({2}, {0.5f, -1.0f}));
  const auto e = ops::exp(p * 2.f);
  const Tensor t = e;
  CHECK(t.values()[0] == doctest::Approx(std::exp(1.0)));
  CHECK(e.shape() == Shape{2});
  const auto result = value_and_grad([&](const Tensor& x) { return ops::sum(x * ops::exp(p)); },
                                     std::vector<nn::Parameter*>{&p})(ones({2}));
  REQUIRE(result.grads.size() == 1);
  CHECK(result.grads[0].values()[1] == doctest::Approx(std::exp(-1.0)));
}

TEST_CASE("Parameter::derived is made once, and again after any write to the values") {
  nn::Parameter p(ones({2, 2}));
  int makes = 0;
  const auto make = [&] {
    ++makes;
    return sum_of(p);
  };
  const auto first = p.derived<Sum>(make);
  CHECK(first->total == 4.0f);
  CHECK(p.derived<Sum>(make) == first);
  CHECK(makes == 1);

  p.set_data(full({2, 2}, 2.0f));
  CHECK(p.derived<Sum>(make)->total == 8.0f);
  CHECK(first->total == 4.0f);  // a form handed out stays as it was

  Tensor alias = p;  // shares the elements
  alias(0, 0) = 12.0f;
  CHECK(p.derived<Sum>(make)->total == 18.0f);

  p = nn::Parameter(zeros({2, 2}));
  CHECK(p.derived<Sum>(make)->total == 0.0f);
  CHECK(makes == 4);
  CHECK(p.derived<Sum>(make)->total == 0.0f);
  CHECK(makes == 4);
}

TEST_CASE("Parameter::derived: a form of another type replaces the one kept") {
  nn::Parameter p(ones({3}));
  CHECK(p.derived<Sum>([&] { return sum_of(p); })->total == 3.0f);
  CHECK(*p.derived<std::string>([] { return std::string("packed"); }) == "packed");
  CHECK(p.derived<Sum>([&] { return sum_of(p); })->total == 3.0f);
}

}  // namespace tests_parameter
