#include <cmath>

#include "support.hpp"

namespace tests_nn_dense {

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

TEST_CASE("Dense<In, Out> beyond the sizes the GEMM unrolls is Dense<> with its sizes in its type") {
  // So a network's Dense layers of every such size share one cell's code (compile time,
  // tools/compile_costs.md); the small ones the GEMM unrolls are cells of their own.
  static_assert(std::is_base_of_v<nn::Dense<>, nn::Dense<20, 16>>);
  static_assert(std::is_base_of_v<nn::Dense<dyn, dyn, double, false>, nn::Dense<20, 16, double, false>>);
  static_assert(!std::is_base_of_v<nn::Dense<>, nn::Dense<8, 8>>);
  static_assert(!std::is_base_of_v<nn::Dense<>, nn::Dense<dyn, 16>>);
  ModeGuard guard;
  set_seed(9);
  nn::Dense<20, 16> sized;
  set_seed(9);
  nn::Dense<> runtime(20, 16);
  CHECK(duet_test::values_of(sized.weight) == duet_test::values_of(runtime.weight));
  CHECK(duet_test::values_of(sized.bias) == duet_test::values_of(runtime.bias));
  CHECK(sized.type_name() == "nn::Dense<20, 16>");
  CHECK(runtime.type_name() == "nn::Dense<dyn, dyn>");
  CHECK(nn::Dense<20, 16, double, false>().type_name() == "nn::Dense<20, 16, Float64, no bias>");
  const Tensor x = randn({5, 20}, 4);
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    const Tensor a = sized(x);
    const Tensor b = runtime(x);
    CHECK(duet_test::values_of(a) == duet_test::values_of(b));
    const auto s = sized(StaticTensor<float, 5, 20>(x));
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(s)>, StaticTensor<float, 5, 16>>);
    CHECK(duet_test::values_of(s.tensor()) == duet_test::values_of(b));
  }
  CHECK_THROWS_WITH_AS((nn::Dense<20, 16>(21, 16)),
                       "nn::Dense<20, 16>: cannot be built with in_channels 21 and out_channels 16", ValueError);
}

TEST_CASE("Dense without a bias (MindSpore's has_bias=False): x · weightᵀ in both modes, saved without a bias") {
  ModeGuard guard;
  set_seed(3);
  nn::Dense<8, 4> with_bias;
  set_seed(3);
  nn::Dense<8, 4, float, false> no_bias;  // the same weight: it is drawn first
  CHECK(duet_test::values_of(no_bias.weight) == duet_test::values_of(with_bias.weight));
  REQUIRE(no_bias.parameters().size() == 1);
  CHECK(no_bias.type_name() == "nn::Dense<8, 4, Float32, no bias>");

  nn::Dense<3, 2, float, false> dense;
  dense.weight.set_data(Tensor({2, 3}, {1, 2, 3, 4, 5, 6}));
  const Tensor x({2, 3}, {1, 0, -1, 2, 1, 0});
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    const Tensor y = dense(x);
    CHECK(y(0, 0) == 1 - 3);
    CHECK(y(0, 1) == 4 - 6);
    CHECK(y(1, 0) == 2 + 2);
    CHECK(y(1, 1) == 8 + 5);
  }
  const auto path = std::filesystem::temp_directory_path() / "duet_dense_no_bias.ckpt";
  save_checkpoint(dense, path);
  const CheckpointInfo info = checkpoint_info(path);
  REQUIRE(info.parameters.size() == 1);
  CHECK(info.parameters[0].name == "weight");
  nn::Dense<3, 2, float, false> loaded;
  load_checkpoint(path, loaded);
  CHECK(duet_test::values_of(loaded.weight) == duet_test::values_of(dense.weight));
  nn::Dense<3, 2> biased;
  CHECK_THROWS_AS(load_checkpoint(path, biased), FormatError);  // strict: its bias is missing
  std::filesystem::remove(path);
  CHECK_THROWS_WITH_AS((nn::Dense<3, 2, float, false>({.bias_init = initializer::Zero{}})),
                       "nn::Dense<3, 2, Float32, no bias>: bias_init is given, but the layer has no bias (HasBias = false)",
                       ValueError);
}

namespace {
template <class Activation>
struct NoBiasNet : nn::Cell<NoBiasNet<Activation>> {
  nn::Dense<6, 5, float, false> fc{};
  Activation act{};
  nn::Dense<5, 3> out{};
  DUET_CELL_MEMBERS(fc, act, out);
  template <class X>
  auto construct(X&& x) {
    return out(act(fc(std::forward<X>(x))));
  }
};
}  // namespace

TEST_CASE("Dense without a bias takes its activation as the product's epilogue, in graph mode and in a trace") {
  ModeGuard guard;
  set_seed(7);
  NoBiasNet<nn::Sigmoid> net;
  const GraphIR ir = graph_ir(net, shape<dyn, 6>);
  CHECK(ir.optimized.text.find("MatMul + Sigmoid(%0)") != std::string::npos);
  const Tensor x = randn({11, 6}, 8);
  const Tensor target = randn({11, 3}, 9);
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  set_context({.mode = PYNATIVE_MODE});
  const auto expected = value_and_grad(with_loss, net.parameters())(x, target);
  set_context({.mode = GRAPH_MODE});
  const auto got = value_and_grad(with_loss, net.parameters())(x, target);
  CHECK(got.value.item() == expected.value.item());
  REQUIRE(got.grads.size() == 3);  // fc.weight, out.weight, out.bias
  for (std::size_t i = 0; i < got.grads.size(); ++i) {
    CHECK(duet_test::values_of(got.grads[i]) == duet_test::values_of(expected.grads[i]));
  }

  // Sized at run time, in a network built at run time: PIJit replays it with PyNative's values.
  set_context({.mode = PYNATIVE_MODE});
  nn::DynamicSequentialCell dynamic;
  dynamic.append(nn::Dense<dyn, dyn, float, false>(6, 5));
  dynamic.append(nn::GELU{});
  dynamic.append(nn::Dense<>(5, 3));
  auto f = jit([&](const Tensor& v) { return dynamic(v); }, {.mode = JitMode::PIJit, .name = "no bias"});
  for (int call = 0; call < 2; ++call) CHECK(duet_test::values_of(f(x)) == duet_test::values_of(dynamic(x)));
}

}  // namespace tests_nn_dense
