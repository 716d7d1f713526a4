#include <cmath>

#include "support.hpp"

using namespace duet;
using duet_test::ModeGuard;

TEST_CASE("Dense initialises as MindSpore 2.x: weight and bias in U(-1/sqrt(in), 1/sqrt(in))") {
  set_seed(0);
  nn::Dense<400, 300> dense;
  CHECK(dense.weight.shape() == Shape{300, 400});
  CHECK(dense.bias.shape() == Shape{300});
  const float bound = 1.0f / 20.0f;
  double sum = 0, sum_sq = 0;
  for (float w : dense.weight.values()) {
    CHECK(std::abs(w) <= bound);
    sum += w;
    sum_sq += double(w) * w;
  }
  const double n = 120000;
  CHECK(sum / n == doctest::Approx(0).epsilon(1e-3));
  // The variance of U(-b, b) is b^2 / 3.
  CHECK(sum_sq / n == doctest::Approx(bound * bound / 3.0).epsilon(0.02));
  for (float b : dense.bias.values()) CHECK(std::abs(b) <= bound);
}

TEST_CASE("Dense draws its weights from the global generator: the same seed, the same layer") {
  set_seed(5);
  nn::Dense<8, 4> a;
  set_seed(5);
  nn::Dense<> b(8, 4);
  for (index_t i = 0; i < a.weight.numel(); ++i) CHECK(a.weight.data()[i] == b.weight.data()[i]);
  for (index_t i = 0; i < a.bias.numel(); ++i) CHECK(a.bias.data()[i] == b.bias.data()[i]);
  nn::Dense<8, 4> c;
  CHECK(c.weight(0, 0) != a.weight(0, 0));
}

TEST_CASE("Dense computes x · weightᵀ + bias over the last axis, for any leading dimensions") {
  ModeGuard guard;
  nn::Dense<3, 2> dense;
  dense.weight.set_data(Tensor({2, 3}, {1, 2, 3, 4, 5, 6}));
  dense.bias.set_data(Tensor({2}, {0.5f, -1}));
  const Tensor x({2, 1, 3}, {1, 0, -1, 2, 1, 0});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    const Tensor y = dense(x);
    CHECK(y.shape() == Shape{2, 1, 2});
    CHECK(y(0, 0, 0) == 1 - 3 + 0.5f);
    CHECK(y(0, 0, 1) == 4 - 6 - 1);
    CHECK(y(1, 0, 0) == 2 + 2 + 0.5f);
    CHECK(y(1, 0, 1) == 8 + 5 - 1);
  }
}

TEST_CASE("Dense with runtime sizes and in float64") {
  ModeGuard guard;
  nn::Dense<dyn, dyn, double> dense(3, 2);
  CHECK(dense.type_name() == "nn::Dense<dyn, dyn, Float64>");
  CHECK(dense.in_channels() == 3);
  const auto x = ones<double>({4, 3});
  const auto eager = dense(x);
  set_context({.mode = GRAPH_MODE});
  const auto graph = dense(x);
  for (index_t i = 0; i < eager.numel(); ++i) CHECK(eager.data()[i] == doctest::Approx(graph.data()[i]).epsilon(1e-12));
  CHECK_THROWS_AS(nn::Dense<>(0, 3), ValueError);
  CHECK_THROWS_WITH_AS((nn::Dense<4, 2>(5, 2)),
                       "nn::Dense<4, 2>: cannot be built with in_channels 5 and out_channels 2", ValueError);
}
