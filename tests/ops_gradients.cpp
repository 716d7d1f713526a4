// The gradient harness: every operation duet lists (ops::catalogue()) runs here in both modes,
// its outputs checked against an independent loop where it has one, the gradient of every
// input against central finite differences in double precision, and the two modes against
// each other bit for bit. The cases come from tests/ops_<family>.cpp; a listed operation
// without a case fails the harness.
#include "ops_harness.hpp"

namespace tests_ops_gradients {

using namespace duet_test::ops;

TEST_CASE("ops: every listed operation has a case in the gradient harness") {
  const auto& all = registry();
  for (std::string_view name : duet::ops::catalogue()) {
    INFO("operation ", name);
    CHECK(all.count(std::string(name)) > 0);
  }
  // Not a structured binding: INFO captures name, and clang 14 cannot capture a binding.
  for (const auto& entry : all) {
    const std::string& name = entry.first;
    INFO("case ", name);
    CHECK(std::find(duet::ops::catalogue().begin(), duet::ops::catalogue().end(), name) !=
          duet::ops::catalogue().end());
  }
}

TEST_CASE("ops: gradients of every input match finite differences, and the modes agree bit for bit") {
  std::uint64_t seed = 1;
  for (const auto& entry : registry()) {
    const std::string& name = entry.first;
    const Case& c = entry.second;
    std::vector<D> xs;
    for (const Shape& s : c.shapes) xs.push_back(random_input(s, c.lo, c.hi, seed++));
    if (c.value_in_mode) {
      INFO(name, ": no gradient; the value in both modes against an independent loop");
      const D pynative = c.value_in_mode(xs, duet::PYNATIVE_MODE);
      const D graph = c.value_in_mode(xs, duet::GRAPH_MODE);
      const D expected = c.reference(xs);
      REQUIRE(pynative.shape() == expected.shape());
      REQUIRE(graph.shape() == expected.shape());
      CHECK(std::equal(pynative.data(), pynative.data() + pynative.numel(), expected.data()));
      CHECK(std::equal(graph.data(), graph.data() + graph.numel(), expected.data()));
      continue;
    }
    const D y = c.value(xs);
    if (c.reference) {
      INFO(name, ": the value against an independent loop, input shape ", duet::to_string(c.shapes[0]));
      const D expected = c.reference(xs);
      REQUIRE(y.shape() == expected.shape());
      for (duet::index_t j = 0; j < y.numel(); ++j) CHECK(y.data()[j] == doctest::Approx(expected.data()[j]).epsilon(1e-12));
    }
    if (c.elementwise) {
      INFO(name, ": the value against an independent loop");
      const D expected = reference_elementwise(xs, y.shape(), c.elementwise);
      for (duet::index_t j = 0; j < y.numel(); ++j) CHECK(y.data()[j] == doctest::Approx(expected.data()[j]).epsilon(1e-12));
    }
    if (c.reference) {
      INFO(name, ": the value against plain loops");
      const D expected = c.reference(xs);
      REQUIRE(y.shape() == expected.shape());
      for (duet::index_t j = 0; j < y.numel(); ++j) CHECK(y.data()[j] == doctest::Approx(expected.data()[j]).epsilon(1e-12));
    }
    const D w = random_input(y.shape(), -1.0, 1.0, seed++);
    for (std::size_t k = 0; k < xs.size(); ++k) {
      INFO(name, ": input ", k, " of shapes ", duet::to_string(c.shapes[0]),
           c.shapes.size() > 1 ? " and " + duet::to_string(c.shapes[1]) : std::string());
      const auto pynative = c.gradient(xs, w, duet::PYNATIVE_MODE, k);
      const auto graph = c.gradient(xs, w, duet::GRAPH_MODE, k);
      // Both modes: the same value and the same gradient, bit for bit.
      REQUIRE(pynative[0].shape() == graph[0].shape());
      REQUIRE(pynative[1].shape() == xs[k].shape());
      REQUIRE(graph[1].shape() == xs[k].shape());
      CHECK(std::equal(pynative[0].data(), pynative[0].data() + pynative[0].numel(), graph[0].data()));
      CHECK(std::equal(pynative[1].data(), pynative[1].data() + pynative[1].numel(), graph[1].data()));
      // Central differences of sum(w * f(x)) along each element of input k.
      const double h = 1e-6;
      for (duet::index_t j = 0; j < xs[k].numel(); ++j) {
        std::vector<D> plus = xs, minus = xs;
        plus[k] = xs[k].clone();
        minus[k] = xs[k].clone();
        plus[k].data()[j] += h;
        minus[k].data()[j] -= h;
        const double fd = (dot(w, c.value(plus)) - dot(w, c.value(minus))) / (2 * h);
        const double analytic = pynative[1].data()[j];
        CHECK(std::abs(analytic - fd) <= 1e-6 + 1e-6 * std::abs(fd));
      }
    }
  }
}

}  // namespace tests_ops_gradients
