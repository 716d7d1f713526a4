// Run-time shape errors: a duet exception naming the layer and the shapes, in both modes.
#include "support.hpp"

namespace tests_errors {

using namespace duet;
using duet_test::ModeGuard;
using duet_test::SeedNetwork;

TEST_CASE("a wrong input size is a ShapeError that names the layer and both shapes, in both modes") {
  ModeGuard guard;
  SeedNetwork<> net;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    CHECK_THROWS_WITH_AS(net(ones({64, 1, 28, 27})),
                         "nn::Dense<784, 512> 'dense_relu_sequential.0' expects an input whose last dimension is "
                         "784, got [64, 756]",
                         ShapeError);
  }
}

TEST_CASE("a runtime-sized layer reports its own sizes") {
  ModeGuard guard;
  nn::SequentialCell seq(nn::Dense<>(6, 3), nn::ReLU{}, nn::Dense<>(4, 2));
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    CHECK_THROWS_WITH_AS(seq(ones({2, 6})),
                         "nn::Dense<dyn, dyn> '2' expects an input whose last dimension is 4, got [2, 3]", ShapeError);
  }
}

TEST_CASE("Flatten needs a batch axis, Dense needs at least one axis") {
  ModeGuard guard;
  nn::Flatten flatten;
  nn::Dense<1, 1> dense;
  SeedNetwork<> net;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    CHECK_THROWS_WITH_AS(flatten(Tensor(Shape{}, {1.0f})),
                         "nn::Flatten expects an input of rank at least 2 whose first dimension is the batch, got []: "
                         "the batch dimension is missing",
                         ShapeError);
    // One sample without its batch dimension is refused by Flatten itself, not made [784, 1].
    CHECK_THROWS_WITH_AS(net(ones({784})),
                         "nn::Flatten expects an input of rank at least 2 whose first dimension is the batch, got "
                         "[784]: the batch dimension is missing",
                         ShapeError);
    CHECK(net(ones({1, 784})).shape() == Shape{1, 10});
    CHECK(flatten(ones({3, 1})).shape() == Shape{3, 1});
    CHECK_THROWS_WITH_AS(dense(Tensor(Shape{}, {1.0f})), "nn::Dense<1, 1> expects an input of rank at least 1, got []",
                         ShapeError);
  }
}

// An operation construct calls itself names no layer: the error says whose construct it is in.
struct ShiftedDense : nn::Cell<ShiftedDense> {
  nn::Dense<4, 6> fc;
  nn::Parameter shift{Tensor({5}, {1, 2, 3, 4, 5})};
  DUET_CELL_MEMBERS(fc, shift);
  auto construct(auto x) { return ops::relu(fc(x) + shift); }
};

TEST_CASE("an operation of construct that cannot take its shapes names the construct, in both modes") {
  ModeGuard guard;
  ShiftedDense net;
  const std::string shapes =
      " expects inputs whose shapes broadcast together (numpy's rule: sizes equal or 1, aligned at the last axis), "
      "got [3, 6] and [5] (in tests_errors::ShiftedDense::construct)";
  set_context({.mode = PYNATIVE_MODE});
  CHECK_THROWS_WITH_AS(net(ones({3, 4})), ("Add" + shapes).c_str(), ShapeError);
  set_context({.mode = GRAPH_MODE});
  CHECK_THROWS_WITH_AS(net(ones({3, 4})), ("Add + ReLU" + shapes).c_str(), ShapeError);  // fused, as graph_ir shows
  // Outside any construct there is nothing to add.
  CHECK_THROWS_WITH_AS(ones({3, 6}) + ones({5}),
                       "Add expects inputs whose shapes broadcast together (numpy's rule: sizes equal or 1, aligned at "
                       "the last axis), got [3, 6] and [5]",
                       ShapeError);
}

TEST_CASE("a failed call leaves the parameters as they were") {
  ModeGuard guard;
  SeedNetwork<> net;
  const Tensor before = net.dense_relu_sequential.get<0>().weight.clone();
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    CHECK_THROWS_AS(net(ones({1, 100})), ShapeError);
  }
  const auto& after = net.dense_relu_sequential.get<0>().weight;
  for (index_t i = 0; i < before.numel(); ++i) REQUIRE(before.data()[i] == after.data()[i]);
}

}  // namespace tests_errors
