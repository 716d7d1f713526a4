#include "support.hpp"

namespace tests_backend {

using namespace duet;
using duet_test::SeedNetwork;

namespace {

// A backend that replaces the dense kernel alone and counts its calls: proof that one
// operation's kernel swaps without touching capture or passes.
int dense_calls = 0;
struct CountingBackend : DefaultBackend {
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense(const T* x, index_t rows, index_t in, const T* w, index_t out, const Epilogue<T, Fns...>& e, T* y) {
    ++dense_calls;
    DefaultBackend::dense<In, Out>(x, rows, in, w, out, e, y);
  }
};

}  // namespace

TEST_CASE("a backend deriving from another swaps one kernel, the graph is unchanged") {
  SeedNetwork<> net;
  auto program = passes::optimize(net(graph::input<float, graph::AnyShape>()));
  const Tensor x = randn({4, 1, 28, 28}, 1);
  dense_calls = 0;
  const Tensor counted = evaluate<CountingBackend>(program, x);
  // The graph reads packed weights (O1); the replaced dense() still runs, not the base's
  // dense_packed, which would bypass it.
  static_assert(std::is_same_v<graph::node_at<decltype(program)::graph_type, 2>::op_type,
                               ops::PackedMatMulOp<nn::Dense<784, 512>, true, fn::Relu>>);
  static_assert(backend::packs_as_dense<DefaultBackend, 784, 512, float, fn::Relu>());
  static_assert(!backend::packs_as_dense<CountingBackend, 784, 512, float, fn::Relu>());
  CHECK(dense_calls == 3);
  const Tensor plain = evaluate(program, x);
  CHECK(duet_test::relative_difference(duet_test::values_of(counted), duet_test::values_of(plain)) == 0);
}

TEST_CASE("backend::Eigen::dense applies bias then each epilogue function") {
  const float x[2] = {1, -2};
  const float w[4] = {1, 0, 0, 1};  // identity
  const float b[2] = {0.5f, 0.5f};
  float y[2];
  backend::Eigen::dense<2, 2>(x, 1, 2, w, 2, Epilogue<float, fn::Relu>{b}, y);
  CHECK(y[0] == 1.5f);
  CHECK(y[1] == 0.0f);
  backend::Eigen::dense<dyn, dyn>(x, 1, 2, w, 2, Epilogue<float>{}, y);
  CHECK(y[1] == -2.0f);
}

}  // namespace tests_backend
