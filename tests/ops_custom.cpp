// The README's user-written operation and layer (examples/custom_operation.hpp), checked the
// way duet's own are: the gate through the gradient harness, the scale's parameter gradient
// against finite differences in both modes.
#include "../examples/custom_operation.hpp"
#include "ops_harness.hpp"

namespace tests_ops_custom {

namespace {

using namespace duet_test::ops;

// Listed like a library operation, so that the harness requires its cases.
const bool gate_listed = duet::ops::list_operations({"gate"});

const bool gate_cases = add_cases([](std::multimap<std::string, Case>& m) {
  const auto reference = [](double a, double b) { return a / (1 + std::exp(-b)); };
  for (const std::vector<Shape>& p : std::vector<std::vector<Shape>>{{{3, 4}, {3, 4}}, {{3, 4}, {4}}}) {
    m.emplace("gate", make_case<2>(p, [](const auto& a, const auto& b) { return custom::gate(a, b); }, reference));
  }
});

struct Scaled : duet::nn::Cell<Scaled> {
  custom::Scale<4> scale;
  DUET_CELL_MEMBERS(scale);
  auto construct(auto x) { return scale(x) * scale(x); }  // the parameter read twice
};

struct ScaledOnce : duet::nn::Cell<ScaledOnce> {
  custom::Scale<4> scale;
  DUET_CELL_MEMBERS(scale);
  auto construct(auto x) { return scale(x); }
};

}  // namespace

TEST_CASE("ops: a user's layer with its own parameter trains in both modes, with the gradient finite differences give") {
  duet_test::ModeGuard guard;
  Scaled net;
  net.scale.weight.set_data(duet::Tensor({4}, {0.5f, -1.0f, 2.0f, 1.5f}));
  const duet::Tensor x = duet::randn({3, 4}, 3);
  std::vector<std::vector<duet::Tensor>> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    grads.push_back(duet::value_and_grad(net, net.parameters())(x).grads);
  }
  REQUIRE(grads[0].size() == 1);
  CHECK(std::equal(grads[0][0].data(), grads[0][0].data() + 4, grads[1][0].data()));
  // d/dw_j of sum_i (x_ij w_j)^2 = 2 w_j sum_i x_ij^2, in double.
  for (duet::index_t j = 0; j < 4; ++j) {
    double sum = 0;
    for (duet::index_t i = 0; i < 3; ++i) sum += double(x(i, j)) * double(x(i, j));
    CHECK(grads[0][0](j) == doctest::Approx(2 * double(net.scale.weight(j)) * sum).epsilon(1e-5));
  }
  // The same layer called twice is two values to capture, so the capture is ambiguous (README,
  // "Shared values in graph mode") and graph_ir shows the trace that runs, where the parameter is
  // a constant operand of each product. Called once, the static graph reads it as a Parameter.
  const std::string traced = duet::graph_ir(net, duet::shape<duet::dyn, 4>).optimized.text;
  CHECK(traced.find("runs as a traced graph (PIJit)") != std::string::npos);
  CHECK(traced.find("%1 = Constant : [4]") != std::string::npos);
  CHECK(traced.find("%2 = Mul(%0, %1) : [2, 4]") != std::string::npos);
  ScaledOnce once;
  CHECK(duet::graph_ir(once, duet::shape<duet::dyn, 4>).optimized.text.find("Parameter") != std::string::npos);
}

}  // namespace tests_ops_custom
