#include <type_traits>

#include "support.hpp"

namespace tests_graph {

using namespace duet;
using duet_test::SeedNetwork;

TEST_CASE("construct on a symbolic input captures a flat list of nodes with inferred shapes") {
  SeedNetwork<> net;
  auto captured = net(graph::input<float, StaticShape<dyn, 1, 28, 28>>());
  using G = decltype(captured)::graph_type;
  static_assert(G::size == 10);
  static_assert(decltype(captured)::output == 9);
  static_assert(G::shapes[0] == Shape{dyn, 1, 28, 28});
  static_assert(G::shapes[1] == Shape{dyn, 784});
  static_assert(G::shapes[2] == Shape{dyn, 512});
  static_assert(G::shapes[9] == Shape{dyn, 10});
  static_assert(std::is_same_v<graph::node_at<G, 1>, graph::Node<ops::FlattenOp, 0>>);
  static_assert(std::is_same_v<graph::node_at<G, 2>::op_type, ops::MatMulOp<nn::Dense<784, 512>>>);
  static_assert(std::is_same_v<graph::node_at<G, 4>, graph::Node<ops::MapOp<fn::Relu>, 3>>);
  // The nodes point at the cells that made them: parameters are read live.
  CHECK(graph::get<2>(captured.graph).op.layer == &net.dense_relu_sequential.get<0>());
}

TEST_CASE("a runtime tensor's shape is unknown at capture, everything after the first Dense is static") {
  SeedNetwork<> net;
  auto captured = net(graph::input<float, graph::AnyShape>());
  using G = decltype(captured)::graph_type;
  static_assert(G::shapes[0] == Shape::any());
  static_assert(G::shapes[1] == Shape{dyn, dyn});
  static_assert(G::shapes[2] == Shape{dyn, 512});
  static_assert(G::shapes[9] == Shape{dyn, 10});
}

TEST_CASE("fits: a concrete shape against a pattern") {
  static_assert(graph::fits(Shape{dyn, 784}, Shape{3, 784}));
  static_assert(!graph::fits(Shape{dyn, 784}, Shape{3, 785}));
  static_assert(!graph::fits(Shape{dyn, 784}, Shape{784}));
  static_assert(graph::fits(Shape::any(), Shape{1, 2, 3}));
  static_assert(graph::fits(Shape::any(), Shape{}));
}

TEST_CASE("quietly: the graph a capture would give, without reporting a broken shape rule") {
  nn::Dense<784, 512> fits;
  nn::Dense<100, 10> does_not_fit;
  const auto x = graph::input<float, StaticShape<dyn, 784>>();

  const auto direct = fits(x);
  const auto quiet = graph::quietly(x, [&](const auto& q) { return fits(q); });
  static_assert(std::is_same_v<decltype(quiet), decltype(direct)>);
  CHECK(graph::get<1>(quiet.graph).op.layer == &fits);
  static_assert(std::is_void_v<graph::first_rejection<decltype(direct)::graph_type>>);

  // Dense<100, 10> on [?, 784] would not compile captured directly; quietly it gives the rule's
  // best guess, and first_rejection names what a report would say.
  const auto guessed = graph::quietly(direct, [&](const auto& q) { return does_not_fit(q); });
  using G = decltype(guessed)::graph_type;
  static_assert(G::shapes[decltype(guessed)::output] == Shape{dyn, 10});
  static_assert(std::is_same_v<graph::first_rejection<G>,
                               diagnostic::rejected<nn::Dense<100, 10>, diagnostic::last_dimension_must_be<100>,
                                                    diagnostic::input_shape<dyn, 512>>>);
}

}  // namespace tests_graph
