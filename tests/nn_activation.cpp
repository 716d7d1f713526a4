#include <cmath>
#include <limits>

#include "support.hpp"

namespace tests_nn_activation {

using namespace duet;
using duet_test::ModeGuard;

TEST_CASE("ReLU is max(x, 0) in both modes and keeps NaN and infinities as IEEE says") {
  ModeGuard guard;
  const float inf = std::numeric_limits<float>::infinity();
  const Tensor x({6}, {-1.5f, 0.0f, 2.0f, std::nanf(""), inf, -inf});
  nn::ReLU relu;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    const Tensor y = relu(x);
    CHECK(y(0) == 0.0f);
    CHECK(y(1) == 0.0f);
    CHECK(y(2) == 2.0f);
    CHECK(std::isnan(y(3)));
    CHECK(y(4) == inf);
    CHECK(y(5) == 0.0f);
    CHECK(x(0) == -1.5f);  // the input is untouched
  }
}

TEST_CASE("ops::relu on a temporary nobody else holds works in place, on a shared tensor it copies") {
  Tensor shared = full({4}, -1.0f);
  const Tensor fresh = ops::relu(shared);
  CHECK_FALSE(fresh.shares_storage_with(shared));
  CHECK(shared(0) == -1.0f);

  Tensor temp = full({4}, -1.0f);
  const float* where = temp.data();
  const Tensor in_place = ops::relu(std::move(temp));
  CHECK(in_place.data() == where);
  CHECK(in_place(0) == 0.0f);
}

namespace {
struct DenseRelu : nn::Cell<DenseRelu> {
  nn::Dense<2, 2> dense;
  nn::ReLU relu;
  DUET_CELL_MEMBERS(dense, relu);
  auto construct(auto x) { return relu(dense(x)); }
};
}  // namespace

TEST_CASE("a product's fused ReLU epilogue also keeps NaN") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  DenseRelu net;
  const Tensor y = net(Tensor({1, 2}, {std::nanf(""), 1.0f}));
  CHECK(std::isnan(y(0, 0)));
  CHECK(std::isnan(y(0, 1)));
}

}  // namespace tests_nn_activation
