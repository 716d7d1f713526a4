#include "support.hpp"

using namespace duet;
using duet_test::ModeGuard;

TEST_CASE("SequentialCell runs its cells in order and gives access to each") {
  ModeGuard guard;
  nn::SequentialCell seq(nn::Dense<>(4, 3), nn::ReLU{}, nn::Dense<3, 2>{});
  static_assert(decltype(seq)::size() == 3);
  CHECK(seq.get<0>().out_channels() == 3);
  const Tensor x = randn({5, 4}, 1);
  const Tensor eager = seq(x);
  set_context({.mode = GRAPH_MODE});
  const Tensor graph = seq(x);
  const auto expected =
      duet_test::reference_forward(duet_test::values_of(x), 5,
                                   {duet_test::layer_of(seq.get<0>().weight, seq.get<0>().bias, true),
                                    duet_test::layer_of(seq.get<2>().weight, seq.get<2>().bias, false)});
  CHECK(duet_test::relative_difference(duet_test::values_of(eager), expected) <= 1e-5);
  CHECK(duet_test::relative_difference(duet_test::values_of(graph), expected) <= 1e-5);
}

TEST_CASE("DynamicSequentialCell holds any DynamicCell, static ones included, and names them by index") {
  nn::DynamicSequentialCell net;
  net.append(nn::Dense<4, 4>{});
  net.append(std::make_unique<nn::ReLU>());
  auto& inner = net.append(nn::SequentialCell<nn::Dense<4, 2>>{});
  const auto cells = net.cells_and_names();
  REQUIRE(cells.size() == 5);
  CHECK(cells[3].first == "2");
  CHECK(cells[4].first == "2.0");
  CHECK(cells[4].second == &inner.get<0>());
  CHECK(net(ones({3, 4})).shape() == Shape{3, 2});
  CHECK_THROWS_WITH_AS(net[3], "nn::DynamicSequentialCell: index 3 is out of range for 3 cells", IndexError);
}
