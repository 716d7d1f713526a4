#include <cstddef>
#include <type_traits>

#include "support.hpp"

namespace tests_passes {

using namespace duet;
using duet_test::SeedNetwork;

TEST_CASE("fuse_epilogues folds bias adds and ReLUs into the products") {
  SeedNetwork<> net;
  auto optimized = passes::fuse_epilogues(net(graph::input<float, StaticShape<dyn, 1, 28, 28>>()));
  using G = decltype(optimized)::graph_type;
  static_assert(G::size == 5);
  static_assert(decltype(optimized)::output == 4);
  static_assert(std::is_same_v<graph::node_at<G, 1>, graph::Node<ops::FlattenOp, 0>>);
  static_assert(
      std::is_same_v<graph::node_at<G, 2>, graph::Node<ops::MatMulOp<nn::Dense<784, 512>, true, fn::Relu>, 1>>);
  static_assert(
      std::is_same_v<graph::node_at<G, 3>, graph::Node<ops::MatMulOp<nn::Dense<512, 512>, true, fn::Relu>, 2>>);
  static_assert(std::is_same_v<graph::node_at<G, 4>, graph::Node<ops::MatMulOp<nn::Dense<512, 10>, true>, 3>>);
  static_assert(G::shapes[4] == Shape{dyn, 10});
  CHECK(graph::get<3>(optimized.graph).op.layer == &net.dense_relu_sequential.get<2>());
}

TEST_CASE("O1 and O2 pack the weights of an inference graph, not of a graph being trained (they change every step)") {
  SeedNetwork<> net;
  auto captured = net(graph::input<float, graph::AnyShape>());
  constexpr JitConfig o1{.jit_level = O1};
  constexpr JitConfig o2{.jit_level = O2};
  using Inference = decltype(passes::optimize<o1>(captured))::graph_type;
  using Training = decltype(passes::optimize<o1, true>(captured))::graph_type;
  static_assert(std::is_same_v<graph::node_at<Inference, 2>::op_type,
                               ops::PackedMatMulOp<nn::Dense<784, 512>, true, fn::Relu>>);
  static_assert(std::is_same_v<graph::node_at<Inference, 4>::op_type, ops::PackedMatMulOp<nn::Dense<512, 10>, true>>);
  static_assert(std::is_same_v<graph::node_at<Training, 2>::op_type, ops::MatMulOp<nn::Dense<784, 512>, true, fn::Relu>>);
  static_assert(std::is_same_v<decltype(passes::optimize<o2>(captured)), decltype(passes::optimize<o1>(captured))>);
  static_assert(std::is_same_v<decltype(passes::optimize<o2, true>(captured)), decltype(passes::optimize<o1, true>(captured))>);
  static_assert(std::is_same_v<graph::node_at<decltype(passes::optimize<JitConfig{.jit_level = O0}>(captured))::graph_type,
                                              2>::op_type,
                               ops::MatMulOp<nn::Dense<784, 512>>>);
  CHECK(graph::get<2>(passes::optimize<o1>(captured).graph).op.layer == &net.dense_relu_sequential.get<0>());
}

TEST_CASE("a value read twice is not fused away, and the output is never fused into a later node") {
  using namespace graph;
  nn::Dense<4, 4> dense;
  auto x = input<float, StaticShape<dyn, 4>>();
  auto product = append(ops::MatMulOp<nn::Dense<4, 4>>{&dense}, x);
  // Program output is the product itself; a ReLU after it reads it too.
  auto relu = append(ops::MapOp<fn::Relu>{}, product);
  using G = decltype(relu)::graph_type;
  auto optimized = passes::fuse_epilogues(Sym<G, 1>{relu.graph});
  using O = decltype(optimized)::graph_type;
  static_assert(O::size == 3);
  static_assert(std::is_same_v<node_at<O, 1>::op_type, ops::MatMulOp<nn::Dense<4, 4>>>);
  static_assert(decltype(optimized)::output == 1);
}

template <std::size_t N, class X>
auto relus(const X& x) {
  if constexpr (N == 0) return x;
  else return relus<N - 1>(graph::append(ops::MapOp<fn::Relu>{}, x));
}

TEST_CASE("a chain of 40 elementwise functions fuses into operations of at most 17 functions") {
  auto chain = relus<40>(graph::input<float, StaticShape<2, 3>>());
  auto optimized = passes::fuse_epilogues(chain);
  using O = decltype(optimized)::graph_type;
  static_assert(O::size == 4);
  static_assert(graph::node_at<O, 1>::op_type::elementwise_functions == 17);
  static_assert(graph::node_at<O, 2>::op_type::elementwise_functions == 17);
  static_assert(graph::node_at<O, 3>::op_type::elementwise_functions == 6);
  const Tensor x = randn({2, 3}, 4);
  const Tensor once = evaluate(graph::append(ops::MapOp<fn::Relu>{}, graph::input<float, StaticShape<2, 3>>()), x);
  CHECK(duet_test::values_of(evaluate(optimized, x)) == duet_test::values_of(once));
  CHECK(duet_test::values_of(evaluate(chain, x)) == duet_test::values_of(once));
}

TEST_CASE("user_counts counts readers and the output") {
  SeedNetwork<> net;
  auto captured = net(graph::input<float, graph::AnyShape>());
  using S = decltype(captured);
  constexpr auto users = passes::user_counts<S::graph_type, S::output>();
  static_assert(users[0] == 1 && users[4] == 1 && users[9] == 1);
  CHECK(users.size() == 10);
}

TEST_CASE("buffer plan: views alias, the output writes into the result, slots are reused") {
  SeedNetwork<> net;
  auto optimized = passes::optimize(net(graph::input<float, graph::AnyShape>()));
  using S = decltype(optimized);
  constexpr auto plan = graph::plan_buffers<S::graph_type, S::output>();
  static_assert(plan.storage[0] == graph::Storage::input);
  static_assert(plan.storage[1] == graph::Storage::view && plan.root[1] == 0);
  static_assert(plan.storage[2] == graph::Storage::slot && plan.storage[3] == graph::Storage::slot);
  static_assert(plan.slot[2] != plan.slot[3]);
  static_assert(plan.storage[4] == graph::Storage::output);
  static_assert(plan.slot_count == 2);

  auto captured = net(graph::input<float, graph::AnyShape>());
  using C = decltype(captured);
  constexpr auto unfused = graph::plan_buffers<C::graph_type, C::output>();
  // Nine nodes' values live in two slots: each is free again once its reader has run.
  static_assert(unfused.slot_count == 2);
}

}  // namespace tests_passes
