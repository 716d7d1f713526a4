// Arithmetic (include/duet/ops/arithmetic.hpp): its cases in the gradient harness, and what
// the harness does not cover (operators on every kind of tensor, errors).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops_harness.hpp"

namespace tests_ops_arithmetic {

namespace {

using namespace duet_test::ops;
using duet_test::ops::D;

const bool arithmetic_cases = add_cases([](std::multimap<std::string, Case>& m) {
  auto add = [&](std::string name, Case c) { m.emplace(std::move(name), std::move(c)); };
  // Arithmetic, same shapes and broadcast along leading, trailing and middle axes.
  const std::vector<std::vector<Shape>> pairs = {
      {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 1}, {1, 4}}, {{2, 3, 4}, {3, 1}}, {{}, {2, 3}}};
  for (const auto& p : pairs) {
    add("add", make_case<2>(p, [](const auto& a, const auto& b) { return a + b; }, std::plus<>{}));
    add("sub", make_case<2>(p, [](const auto& a, const auto& b) { return a - b; }, std::minus<>{}));
    add("mul", make_case<2>(p, [](const auto& a, const auto& b) { return a * b; }, std::multiplies<>{}));
    add("div", make_case<2>(p, [](const auto& a, const auto& b) { return a / b; }, std::divides<>{}, 0.5, 2.0));
    add("maximum", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::maximum(a, b); },
                                [](double a, double b) { return std::max(a, b); }));
    add("minimum", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::minimum(a, b); },
                                [](double a, double b) { return std::min(a, b); }));
    add("pow", make_case<2>(p, [](const auto& a, const auto& b) { return duet::ops::pow(a, b); },
                            [](double a, double b) { return std::pow(a, b); }, 0.5, 2.0));
  }
  const std::vector<Shape> one = {{3, 4}};
  add("neg", make_case<1>(one, [](const auto& a) { return -a; }, [](double a, double) { return -a; }));
  add("add_scalar", make_case<1>(one, [](const auto& a) { return a + 1.5; }, [](double a, double) { return a + 1.5; }));
  add("sub_scalar", make_case<1>(one, [](const auto& a) { return a - 1.5; }, [](double a, double) { return a - 1.5; }));
  add("mul_scalar", make_case<1>(one, [](const auto& a) { return a * 1.5; }, [](double a, double) { return a * 1.5; }));
  add("div_scalar", make_case<1>(one, [](const auto& a) { return a / 1.5; }, [](double a, double) { return a / 1.5; }));
  add("scalar_sub", make_case<1>(one, [](const auto& a) { return 1.5 - a; }, [](double a, double) { return 1.5 - a; }));
  add("scalar_div", make_case<1>(one, [](const auto& a) { return 1.5 / a; }, [](double a, double) { return 1.5 / a; },
                                 0.5, 2.0));
  add("pow_scalar", make_case<1>(one, [](const auto& a) { return duet::ops::pow(a, 3.0); },
                                 [](double a, double) { return std::pow(a, 3.0); }));
  add("scalar_pow", make_case<1>(one, [](const auto& a) { return duet::ops::pow(2.0, a); },
                                 [](double a, double) { return std::pow(2.0, a); }));
  // broadcast_to: the harness's own broadcasting loop is the reference (the identity per element).
  const auto same = [](double a, double) { return a; };
  add("broadcast_to", make_case<1>({{3, 1}}, [](const auto& a) { return duet::ops::broadcast_to<2, 3, 4>(a); }, same));
  add("broadcast_to", make_case<1>({{1, 4}}, [](const auto& a) { return duet::ops::broadcast_to<5, -1>(a); }, same));
  add("broadcast_to", make_case<1>({{2, 1, 3}}, [](const auto& a) { return duet::ops::broadcast_to<-1, 4, -1>(a); }, same));
  add("broadcast_to", make_case<1>({{}}, [](const auto& a) { return duet::ops::broadcast_to<2, 3>(a); }, same));
  add("broadcast_to", make_case<1>({{3, 4}}, [](const auto& a) { return duet::ops::broadcast_to<3, 4>(a); }, same));
  });

}  // namespace

namespace {

// The network a new user wrote with a two-input Add of their own, whose second branch got a
// zero gradient and no error: now with the built-in +.
template <auto Setting>
struct TwoBranch : duet::nn::Cell<TwoBranch<Setting>, Setting, double> {
  duet::nn::Dense<4, 3, double> fc_a;
  duet::nn::Dense<4, 3, double> fc_b;
  DUET_CELL_MEMBERS(fc_a, fc_b);
  auto construct(auto x) { return fc_a(x) + fc_b(x) * fc_b(x); }
};

}  // namespace

TEST_CASE("ops: the second branch of a two-branch network gets the gradient finite differences give") {
  duet_test::ModeGuard guard;
  duet::set_seed(5);
  TwoBranch<duet::CONTEXT_MODE> net;
  duet::nn::BasicMSELoss<duet::Reduction::mean, double> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  const D x = random_input({5, 4}, -1, 1, 1);
  const D target = random_input({5, 3}, -1, 1, 2);
  auto loss_value = [&] {
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return with_loss(x, target).item();
  };
  std::vector<std::vector<D>> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto vg = duet::value_and_grad(with_loss, net.parameters());
    grads.push_back(vg(x, target).grads);
  }
  // parameters(): fc_a.weight, fc_a.bias, fc_b.weight, fc_b.bias.
  REQUIRE(grads[0].size() == 4);
  for (std::size_t p = 0; p < 4; ++p) {
    CHECK(std::equal(grads[0][p].data(), grads[0][p].data() + grads[0][p].numel(), grads[1][p].data()));
  }
  const auto params = net.parameters();
  for (std::size_t p : {std::size_t{1}, std::size_t{3}}) {
    auto& value = *params[p].parameter;
    for (duet::index_t j = 0; j < value.numel(); ++j) {
      const double fd = finite_difference(value, j, loss_value);
      INFO(params[p].name, "[", j, "]");
      CHECK(fd != 0.0);
      CHECK(grads[0][p].data()[j] == doctest::Approx(fd).epsilon(1e-6));
    }
  }
}

TEST_CASE("ops: operators take tensors, static tensors and numbers, and say which shapes do not broadcast") {
  const duet::Tensor a = duet::full<float>({2, 3}, 2.0f);
  const auto s = duet::ones(duet::shape<3>);
  const duet::Tensor y = a * s + 1.0f;
  CHECK(y.shape() == Shape{2, 3});
  CHECK(y(1, 2) == 3.0f);
  const duet::Tensor z = 1.0f / (-a);
  CHECK(z(0, 0) == -0.5f);
  try {
    static_cast<void>(a + duet::ones({4}));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) ==
          "Add expects inputs whose shapes broadcast together (numpy's rule: sizes equal or 1, aligned at the last "
          "axis), got [2, 3] and [4]");
  }
}

namespace {
// A column per sample widened to the hidden size, its batch any size.
struct Widen : duet::nn::Cell<Widen, duet::CONTEXT_MODE, double> {
  duet::nn::Dense<3, 1, double> fc;
  duet::nn::BasicParameter<double> w{duet::uniform<double>({4}, -1.0, 1.0, 9)};
  DUET_CELL_MEMBERS(fc, w);
  auto construct(auto x) { return duet::ops::sum(duet::ops::tanh(duet::ops::broadcast_to<-1, 4>(fc(x))) * w); }
};
}  // namespace

TEST_CASE("ops::broadcast_to: shapes, errors that name the target, and a network of any batch in both modes") {
  const duet::Tensor column = duet::Tensor({3, 1}, {1.f, 2.f, 3.f});
  const duet::Tensor wide = duet::ops::broadcast_to<2, -1, 4>(column);
  REQUIRE(wide.shape() == Shape{2, 3, 4});
  CHECK(wide(1, 2, 3) == 3.0f);
  CHECK(wide(0, 1, 0) == 2.0f);
  // Static shapes: a dynamic batch kept by -1.
  const duet::StaticTensor<float, duet::dyn, 1> batch(duet::ones({5, 1}));
  const auto b = duet::ops::broadcast_to<-1, 4>(batch);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(b)>, duet::StaticTensor<float, duet::dyn, 4>>);
  CHECK(b.tensor().shape() == Shape{5, 4});
  CHECK_THROWS_WITH_AS(static_cast<void>(duet::ops::broadcast_to<3, 4>(duet::ones({2, 4}))),
                       "ops::broadcast_to<3, 4> expects an input that broadcasts to its shape (numpy's rule: each size "
                       "equal to the target's or 1, aligned at the last axis; a -1 keeps a size the input has), got [2, 4]",
                       duet::ShapeError);
  CHECK_THROWS_AS(static_cast<void>(duet::ops::broadcast_to<-1, 4>(duet::ones({4}))), duet::ShapeError);  // -1 on a new axis
  CHECK_THROWS_AS(static_cast<void>(duet::ops::broadcast_to<4>(duet::ones({2, 4}))), duet::ShapeError);   // fewer axes

  for (const duet::index_t n : {5, 7}) {
    const D x = random_input({n, 3}, -1.0, 1.0, 10);
    std::vector<std::vector<D>> grads;
    for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      duet_test::ModeGuard guard;
      duet::set_context({.mode = mode});
      duet::set_seed(11);
      Widen net;
      grads.push_back(duet::value_and_grad(net, net.parameters())(x).grads);
    }
    CHECK(same_bits(grads[0], grads[1]));
  }
}

TEST_CASE("ops: on static tensors outside construct, the result keeps the static shape the rule gives") {
  const auto a = duet::full<float>(duet::shape<2, 3>, 2.0f);
  const auto b = duet::ones(duet::shape<3>);
  const auto y = duet::ops::exp(a * b - 1.0f);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(y)>, duet::StaticTensor<float, 2, 3>>);
  const auto s = duet::ops::sum(y, duet::ops::axes<1>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(s)>, duet::StaticTensor<float, 2>>);
  CHECK(s(1) == doctest::Approx(3 * std::exp(1.0)));
  const auto p = duet::ops::matmul(a, duet::ones(duet::shape<3, 4>));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(p)>, duet::StaticTensor<float, 2, 4>>);
  CHECK(p(0, 3) == 6.0f);
  // A dynamic batch stays dynamic, and a plain tensor operand makes the result a plain tensor.
  const duet::StaticTensor<float, duet::dyn, 3> batch(duet::ones({5, 3}));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(batch + b)>, duet::StaticTensor<float, duet::dyn, 3>>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(a + duet::ones({3}))>, duet::Tensor>);
}

TEST_CASE("ops: an elementwise chain fuses into one pass in graph mode and gives PyNative's values bit for bit") {
  duet_test::ModeGuard guard;
  auto f = [](const auto& x, const auto& w, const auto& b) { return duet::ops::relu(x * w + b) - x / b; };
  const duet::Tensor x = duet::randn({37, 300}, 1), w = duet::randn({300}, 2), b = duet::randn({37, 1}, 3);
  auto compiled = duet::jit(f);
  const duet::Tensor fused = compiled(x, w, b);
  duet::set_context({.mode = duet::PYNATIVE_MODE});
  const duet::Tensor eager = f(x, w, b);
  REQUIRE(fused.shape() == eager.shape());
  // Multiplies and adds in one kernel could become fused multiply-adds and round once: the
  // kernel stores each step, so they do not.
  CHECK(std::equal(fused.data(), fused.data() + fused.numel(), eager.data()));
  CHECK(std::count_if(eager.data(), eager.data() + eager.numel(), [](float v) { return v != 0; }) > 1000);
  using duet::graph::AnyShape;
  const auto program = duet::passes::fuse_epilogues(
      f(duet::graph::input<float, AnyShape, 0>(), duet::graph::input<float, AnyShape, 1>(),
        duet::graph::input<float, AnyShape, 2>()));
  const std::string text = duet::graph::dump(program, "chain").text;
  INFO(text);
  CHECK(text.find("Elementwise Sub(Add(Mul(a, b), c) + ReLU") == std::string::npos);  // an epilogue ends a chain
  CHECK(text.find("Elementwise Add(Mul(a, b), c) + ReLU(%0, %1, %2)") != std::string::npos);
}

// helper-87: with NaN on one side, maximum and minimum gave the other side's gradient by the
// order of the arguments; PyTorch gives both the whole gradient, in either order.
TEST_CASE("ops::maximum, ops::minimum: NaN propagates from either side, and the gradient reaches both sides") {
  duet_test::ModeGuard guard;
  const duet::Tensor a({4}, {1.f, 2.f, 3.f, 4.f});
  const duet::Tensor z({4}, {NAN, 0.f, 5.f, NAN});
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    CAPTURE(mode);
    const auto grad_of = [&](auto f) {
      return duet_test::values_of(duet::grad([f](const auto& x, const auto& y) { return duet::ops::sum(f(x, y)); })(a, z));
    };
    const auto max_first = grad_of([](const auto& x, const auto& y) { return duet::ops::maximum(x, y); });
    const auto max_second = grad_of([](const auto& x, const auto& y) { return duet::ops::maximum(y, x); });
    const auto min_first = grad_of([](const auto& x, const auto& y) { return duet::ops::minimum(x, y); });
    const auto min_second = grad_of([](const auto& x, const auto& y) { return duet::ops::minimum(y, x); });
    CHECK(max_first == std::vector<double>{1, 1, 0, 1});
    CHECK(max_second == max_first);
    CHECK(min_first == std::vector<double>{1, 0, 1, 1});
    CHECK(min_second == min_first);
    const duet::Tensor m = duet::ops::maximum(z, a);
    CHECK(std::isnan(m(0)));
    CHECK(m(1) == 2.f);
    CHECK(std::isnan(duet::ops::minimum(a, z)(3)));
  }
}

// helper-87: integer division by zero, and INT_MIN / -1, ended the process with SIGFPE.
TEST_CASE("ops::div on integers truncates toward zero, and a zero divisor or an overflow is a ValueError") {
  using I = duet::BasicTensor<std::int32_t>;
  const I a({4}, {-7, 7, -8, 9});
  const I b({4}, {2, 2, -3, 4});
  const I q = a / b;
  CHECK(std::vector<std::int32_t>(q.data(), q.data() + 4) == std::vector<std::int32_t>{-3, 3, 2, 2});
  CHECK_THROWS_WITH_AS(a / I({4}, {1, 0, 1, 1}), "duet::ops::div: integer division by zero", duet::ValueError);
  CHECK_THROWS_WITH_AS(a / 0, "duet::ops::div: integer division by zero", duet::ValueError);
  CHECK_THROWS_WITH_AS(I({1}, {std::numeric_limits<std::int32_t>::min()}) / -1,
                       "duet::ops::div: integer division overflows (-2147483648 / -1)", duet::ValueError);
}

}  // namespace tests_ops_arithmetic
