#include <cstddef>
#include <cstdint>
#include <set>
#include <type_traits>
#include <utility>

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

  // Dense<100, 10> on [?, 784] would not compile captured directly; quietly it gives a shape
  // nothing is known of (so that nothing after it breaks on the same mistake), and
  // first_rejection names what a report would say.
  const auto guessed = graph::quietly(direct, [&](const auto& q) { return does_not_fit(q); });
  using G = decltype(guessed)::graph_type;
  static_assert(G::shapes[decltype(guessed)::output] == Shape::any());
  static_assert(std::is_same_v<graph::first_rejection<G>,
                               diagnostic::rejected<nn::Dense<100, 10>, diagnostic::last_dimension_must_be<100>,
                                                    diagnostic::input_shape<dyn, 512>>>);
}

namespace deep {
// A graph of an input and 300 ReLUs, and a SequentialCell of 300 ReLUs, as types.
template <std::size_t... I>
auto relu_graph(std::index_sequence<I...>)
    -> graph::Graph<graph::Node<graph::InputOp<0, StaticShape<2, 3>, float>>,
                    graph::Node<ops::MapOp<fn::Relu>, I>...>;
template <std::size_t... I>
auto relu_cells(std::index_sequence<I...>) -> nn::SequentialCell<std::conditional_t<I >= 0, nn::ReLU, void>...>;
using Graph = decltype(relu_graph(std::make_index_sequence<300>{}));
}  // namespace deep

// A loop over a graph's nodes or a chain's cells that is a fold, one operand each, does not
// compile with clang beyond 256 of them (it nests a fold's operands): a network of 128 Dense +
// ReLU pairs has 385 nodes. These are the compile-time loops such networks go through.
// (tools/compile_bench.sh -c clang++ deep128 compiles the whole network.)
TEST_CASE("compile-time loops over a graph and a chain take more nodes than a fold could") {
  static_assert(deep::Graph::shapes[300] == Shape{2, 3});
  static_assert(std::is_void_v<graph::first_rejection<deep::Graph>>);
  static_assert(passes::user_counts<deep::Graph, 300>()[150] == 1);
  static_assert([] {
    std::size_t visited = 0;
    graph::for_each_index<deep::Graph::size>([&](auto i) { visited += decltype(i)::value == visited; });
    return visited;
  }() == 301);
  static_assert(decltype(deep::relu_cells(std::make_index_sequence<300>{}))::size() == 300);
  CHECK(graph::phase_of_graph<deep::Graph>() == graph::Phase::train);
}

namespace {
// A cell that gives back its input: spliced, its output is the value it continues.
struct PassThrough : nn::Cell<PassThrough> {
  auto construct(auto x) { return x; }
};
// A residual block: its input is read twice, by the branch and by the add.
struct Residual : nn::Cell<Residual> {
  nn::Dense<8, 8> fc;
  nn::ReLU relu;
  DUET_CELL_MEMBERS(fc, relu);
  auto construct(auto x) { return relu(fc(x)) + x; }
};
}  // namespace

TEST_CASE("a cell captured apart and spliced gives the graph appending its operations would give") {
  const auto x = graph::input<float, StaticShape<dyn, 8>>();
  Residual block;
  nn::Dense<8, 8> fc2;
  // By hand, operation by operation on x's graph: what appending makes.
  const auto by_operations = block.relu(block.fc(x)) + x;
  const auto by_cell = block(x);
  static_assert(std::is_same_v<decltype(by_cell), decltype(by_operations)>);
  CHECK(graph::get<1>(by_cell.graph).op.layer == &block.fc);
  CHECK(by_cell.ids[0] == by_operations.ids[0]);
  CHECK(by_cell.ids[1] != by_cell.ids[2]);
  CHECK(by_cell.ambiguity.empty());

  // Spliced after a longer graph, the block's nodes follow it, reading its output.
  const auto y = fc2(x);
  const auto z = block(y);
  using G = decltype(z)::graph_type;
  static_assert(G::size == decltype(y)::graph_type::size + 4);
  static_assert(graph::node_at<G, 3>::args[0] == decltype(y)::output);
  static_assert(std::is_same_v<graph::node_at<G, G::size - 1>, graph::Node<ops::BroadcastOp<fn::Add>, G::size - 2, 2>>);
  CHECK(graph::get<3>(z.graph).op.layer == &block.fc);

  // A cell that returns its input adds nothing, and its output is the value it continues.
  PassThrough pass;
  const auto p = pass(y);
  static_assert(std::is_same_v<decltype(p), decltype(y)>);
  CHECK(p.ids == y.ids);
}

TEST_CASE("a deep SequentialCell is captured as one chain, each node reading the one before") {
  using Pair = nn::SequentialCell<nn::Dense<4, 4>, nn::ReLU>;
  nn::SequentialCell<Pair, Pair, Pair, Pair, Pair, Pair, Pair, Pair> net;
  const auto y = net(graph::input<float, StaticShape<dyn, 4>>());
  using G = decltype(y)::graph_type;
  static_assert(G::size == 1 + 8 * 3);
  static_assert(decltype(y)::output == G::size - 1);
  static_assert([]<std::size_t... I>(std::index_sequence<I...>) {
    return ((graph::node_at<G, I + 1>::args[0] == I) && ...);
  }(std::make_index_sequence<G::size - 1>{}));
  CHECK(graph::get<22>(y.graph).op.layer == &net.get<7>().get<0>());
  // Every node has its own id.
  std::set<std::uint64_t> ids(y.ids.begin() + 1, y.ids.end());
  CHECK(ids.size() == G::size - 1);
}

}  // namespace tests_graph
