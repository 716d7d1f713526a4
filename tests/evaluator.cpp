#include "support.hpp"

namespace tests_evaluator {

using namespace duet;
using duet_test::SeedNetwork;

TEST_CASE("evaluate runs an optimised graph on a tensor, equal to the naive reference") {
  SeedNetwork<> net;
  auto program = passes::optimize(net(graph::input<float, graph::AnyShape>()));
  for (index_t batch : {1, 3, 64}) {
    const Tensor x = randn({batch, 1, 28, 28}, static_cast<std::uint64_t>(batch));
    const Tensor y = evaluate(program, x);
    CHECK(y.shape() == Shape{batch, 10});
    const auto expected = duet_test::reference_forward(duet_test::values_of(x), batch, duet_test::layers_of(net));
    CHECK(duet_test::relative_difference(duet_test::values_of(y), expected) <= 1e-5);
  }
}

TEST_CASE("the unoptimised graph evaluates to the same values, node by node") {
  SeedNetwork<> net;
  auto captured = net(graph::input<float, graph::AnyShape>());
  const Tensor x = randn({5, 1, 28, 28}, 9);
  const auto a = duet_test::values_of(evaluate(captured, x));
  const auto b = duet_test::values_of(evaluate(passes::optimize(captured), x));
  CHECK(duet_test::relative_difference(a, b) <= 1e-6);
}

TEST_CASE("a graph that only reshapes returns a view of its input") {
  auto program = ops::flatten(graph::input<float, graph::AnyShape>());
  const Tensor x = randn({2, 3, 4}, 1);
  const Tensor y = evaluate(program, x);
  CHECK(y.shape() == Shape{2, 12});
  CHECK(y.shares_storage_with(x));
}

TEST_CASE("an input that does not fit the graph's static pattern is rejected") {
  SeedNetwork<> net;
  auto program = passes::optimize(net(graph::input<float, StaticShape<dyn, 1, 28, 28>>()));
  CHECK_THROWS_WITH_AS(evaluate(program, ones({2, 1, 28, 27})),
                       "duet: graph input 0 must have shape [?, 1, 28, 28], got [2, 1, 28, 27]", ShapeError);
}

TEST_CASE("a zero batch gives an empty output") {
  SeedNetwork<> net;
  auto program = passes::optimize(net(graph::input<float, graph::AnyShape>()));
  const Tensor y = evaluate(program, zeros({0, 1, 28, 28}));
  CHECK(y.shape() == Shape{0, 10});
}

}  // namespace tests_evaluator
