// Shared work in graph capture (include/duet/graph.hpp, merge_from) and the one order in which
// both modes add up the gradients reaching a value (tape.hpp, autodiff.hpp): a value several
// operations read is captured once, and its gradient is bit for bit PyNative's.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_sharing {

using namespace duet;
using duet_test::ModeGuard;

namespace {

template <class T>
bool same_bits(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return a.shape() == b.shape() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

// The value and every gradient value_and_grad gives in `mode`: with the input's first when
// with_input, else the parameters' alone (a training step's path).
template <class Net, class T>
ValueAndGrads<T> gradients_in(Mode mode, Net& net, const BasicTensor<T>& x, bool with_input) {
  set_context({.mode = mode});
  if (with_input) return value_and_grad(net, net.parameters(), 0)(x);
  return value_and_grad(net, net.parameters())(x);
}

// Forward and every gradient, both ways of asking for them, bit for bit in both modes.
template <class Net, class T>
void check_modes_agree(Net& net, const BasicTensor<T>& x) {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  const BasicTensor<T> eager = net(x);
  set_context({.mode = GRAPH_MODE});
  CHECK(same_bits(eager, net(x)));
  for (bool with_input : {true, false}) {
    CAPTURE(with_input);
    const auto pynative = gradients_in(PYNATIVE_MODE, net, x, with_input);
    const auto graph = gradients_in(GRAPH_MODE, net, x, with_input);
    CHECK(same_bits(pynative.value, graph.value));
    REQUIRE(pynative.grads.size() == graph.grads.size());
    for (std::size_t i = 0; i < graph.grads.size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(pynative.grads[i], graph.grads[i]));
    }
  }
}

template <class Net>
using captured_graph = typename decltype(std::declval<Net&>()(graph::input<float, graph::AnyShape>()))::graph_type;

template <class Net>
std::string captured_dump(Net& net) {
  net.ensure_named();
  return graph::dump(net(graph::input<typename Net::value_type, graph::AnyShape>()), "net").text;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// How many lines of the compile log say `what`.
std::ptrdiff_t logged(const std::string& what) {
  const auto log = jit_compile_log();
  return std::count_if(log.begin(), log.end(), [&](const std::string& line) { return line.find(what) != std::string::npos; });
}

// stem, then Readers' function of its output s, then head.
template <class Readers>
struct StemHead : nn::Cell<StemHead<Readers>> {
  nn::Dense<16, 16> stem;
  nn::Dense<16, 4> head;
  DUET_CELL_MEMBERS(stem, head);
  auto construct(auto x) { return head(Readers{}(stem(x))); }
};

struct TwoReaders {
  auto operator()(const auto& s) const { return s + s * 2.0f; }
};
using Residual = StemHead<TwoReaders>;

// x + f(x), stacked: without shared work captured once, 2^8 copies of the first block.
struct Block : nn::Cell<Block> {
  nn::Dense<16, 16> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return x + ops::tanh(fc(x)); }
};

struct Stacked : nn::Cell<Stacked> {
  Block b0, b1, b2, b3, b4, b5, b6, b7;
  DUET_CELL_MEMBERS(b0, b1, b2, b3, b4, b5, b6, b7);
  auto construct(auto x) {
    auto x1 = b0(x);
    auto x2 = b1(x1);
    auto x3 = b2(x2);
    auto x4 = b3(x3);
    auto x5 = b4(x4);
    auto x6 = b5(x5);
    auto x7 = b6(x6);
    return b7(x7);
  }
};

// s read by three operations, then by four (one reading it twice): the sums of their
// gradients, in an order operand evaluation does not change.
struct ThreeReaders {
  auto operator()(const auto& s) const { return ops::exp(s * 0.25f) + ops::sigmoid(s) + s; }
};
struct FourReaders {
  auto operator()(const auto& s) const { return ops::sigmoid(s) + s * s + ops::tanh(s); }
};

// Two layers of one type on one input: their captures have one type, and which layer is
// which is known at run time only.
struct Attention : nn::Cell<Attention, CONTEXT_MODE, double> {
  nn::Dense<6, 6, double> wq;
  nn::Dense<6, 6, double> wk;
  DUET_CELL_MEMBERS(wq, wk);
  auto construct(auto x) { return ops::matmul(wq(x), wk(x), ops::transpose_b); }
};

struct TwoScalars : nn::Cell<TwoScalars> {
  nn::Dense<16, 16> stem;
  DUET_CELL_MEMBERS(stem);
  auto construct(auto x) {
    auto s = stem(x);
    return s * 2.0f + s * 3.0f;
  }
};

// h = x + p, with p the cell's own parameter, read by operations whose graphs hold p at other
// places (u + h puts x * 2 before it): merged all the same, as h = x + 1 would be.
struct ParameterState : nn::Cell<ParameterState> {
  nn::Parameter p{uniform<float>({4}, -1.0f, 1.0f, 21)};
  DUET_CELL_MEMBERS(p);
  auto construct(auto x) {
    const auto h = x + p;
    const auto u = x * 2.0f;
    const auto v = u + h;
    const auto w = v * h;
    return w * h;
  }
};

// Two branches of different operations, each scaled by its own parameter: s2 is read where s1
// is in the other branch's graph, after a node the two graphs do not share.
struct ScaledBranches : nn::Cell<ScaledBranches> {
  nn::Dense<4, 8> fc;
  nn::Parameter s1{uniform<float>({8}, 0.5f, 1.5f, 23)};
  nn::Parameter s2{uniform<float>({8}, 0.5f, 1.5f, 24)};
  DUET_CELL_MEMBERS(fc, s1, s2);
  auto construct(auto x) {
    const auto h = fc(x);
    return ops::relu(h) * s1 + ops::tanh(h) * s2;
  }
};

// Two parameters read by equal expressions, x * s1 and x * s2: one node type, two values.
struct ScaledTwice : nn::Cell<ScaledTwice> {
  nn::Parameter s1{uniform<float>({4}, 0.5f, 1.5f, 25)};
  nn::Parameter s2{uniform<float>({4}, 0.5f, 1.5f, 26)};
  DUET_CELL_MEMBERS(s1, s2);
  auto construct(auto x) { return ops::relu(x * s1) + x * s2; }
};

// Values of parameters alone read twice: an angle by sin and by cos (trainable frequencies of a
// position encoding), a broadcast state by a product and a sum (helper-74).
struct Angles : nn::Cell<Angles, CONTEXT_MODE, double> {
  nn::BasicParameter<double> pos{uniform<double>({4, 1}, 0.0, 3.0, 28)};
  nn::BasicParameter<double> freq{uniform<double>({1, 2}, 0.01, 1.0, 29)};
  nn::BasicParameter<double> h0{uniform<double>({1, 4}, -0.5, 0.5, 30)};
  DUET_CELL_MEMBERS(pos, freq, h0);
  auto construct(auto x) {  // x [batch, 4, 4]
    const auto angle = pos * freq;
    const auto pe = ops::concat<-1>(ops::sin(angle), ops::cos(angle));
    const auto h = ops::broadcast_to<4, 4>(h0);
    return ops::sum(ops::square(x * pe + h) * h);
  }
};

// Two layers of one type on one input (a PyTorch user's wq, wk), then Dropout: a traced
// network whose phase switches (helper-76).
struct TracedWithDropout : nn::Cell<TracedWithDropout> {
  nn::Dense<4, 4> a, b;
  nn::Dropout drop{0.5};
  nn::Dense<4, 1> out;
  DUET_CELL_MEMBERS(a, b, drop, out);
  auto construct(auto x) { return out(drop(a(x) * b(x))); }
};

// Layers called on values of parameters alone: learned queries through a projection (DETR's
// object queries), once as they are and once through tanh (helper-74).
struct Queries : nn::Cell<Queries, CONTEXT_MODE, double> {
  nn::BasicParameter<double> q{uniform<double>({2, 6}, -1.0, 1.0, 40)};
  nn::Dense<6, 6, double> wq;
  DUET_CELL_MEMBERS(q, wq);
  auto construct(auto x) {  // x [batch, 2, 6]
    return ops::sum(ops::square(x * wq(ops::tanh(q)) + wq(q)));
  }
};

// A recurrence over Steps slices of x from a learned initial state h0, reading the state twice
// per step (h + tanh(...)), the way a GRU does: each step's graph meets the state's at another
// place than its own.
template <int Steps>
struct Recurrent : nn::Cell<Recurrent<Steps>> {
  nn::Dense<1, 4> ih;
  nn::Dense<4, 4> hh;
  nn::Parameter h0{uniform<float>({1, 4}, -0.5f, 0.5f, 22)};
  DUET_CELL_MEMBERS(ih, hh, h0);
  template <int t>
  auto unroll(const auto& x, const auto& h) {
    if constexpr (t == Steps) {
      return h;
    } else {
      const auto xt = ops::slice(x, ops::ints<0, t>, ops::ints<-1, 1>);
      return unroll<t + 1>(x, h + ops::tanh(ih(xt) + hh(h)) * 0.5f);
    }
  }
  auto construct(auto x) {
    const auto zero = ops::sum(x, ops::axes<1>, ops::keep_dims) * 0.0f;
    return unroll<0>(x, zero + h0);
  }
};

}  // namespace

TEST_CASE("sharing: a value two operations read is captured once, and both modes agree bit for bit") {
  set_seed(11);
  Residual net;
  static_assert(captured_graph<Residual>::size == 7, "input, stem (2), mul, add, head (2)");
  const std::string dump = captured_dump(net);
  CHECK(count(dump, "'stem'") == 2);  // its MatMul and BiasAdd, once each
  CHECK(dump.find("ambiguous") == std::string::npos);
  // Fusion leaves s, which two operations read, a value of its own: the stem's product takes
  // its bias as epilogue, and nothing after it.
  const std::string optimized = graph_ir(net).optimized.text;
  CHECK(count(optimized, "'stem'") == 1);
  CHECK(count(optimized, "MatMul + BiasAdd(%0)") == 1);
  check_modes_agree(net, uniform<float>({8, 16}, -1.0f, 1.0f, 3));
}

TEST_CASE("sharing: eight stacked residual blocks give a graph linear in their number") {
  set_seed(12);
  Stacked net;
  static_assert(captured_graph<Stacked>::size == 1 + 8 * 4, "input, then MatMul, BiasAdd, Tanh, Add per block");
  check_modes_agree(net, uniform<float>({8, 16}, -1.0f, 1.0f, 4));
}

TEST_CASE("sharing: a value with three and with four gradient contributions, bit for bit in both modes") {
  set_seed(13);
  StemHead<ThreeReaders> three;
  check_modes_agree(three, uniform<float>({8, 16}, -1.0f, 1.0f, 5));
  StemHead<FourReaders> four;
  check_modes_agree(four, uniform<float>({8, 16}, -1.0f, 1.0f, 6));
}

TEST_CASE("sharing: two layers of one type on one input run traced in graph mode, equal to PyNative and to finite differences") {
  ModeGuard guard;
  set_seed(14);
  Attention net;
  const std::string dump = captured_dump(net);
  CHECK(dump.find("ambiguous capture") != std::string::npos);
  CHECK(dump.find("'wq'") != std::string::npos);
  CHECK(dump.find("'wk'") != std::string::npos);
  const BasicTensor<double> x = uniform<double>({5, 6}, -1.0, 1.0, 7);
  check_modes_agree(net, x);
  check_modes_agree(net, x);  // again: nothing more is logged
  // Each path that runs instead is said once, and why only in the first of them.
  CHECK(logged("Attention::construct: runs as a traced graph (PIJit)") == 1);
  CHECK(logged("Attention::construct: runs forward and backward in PyNative mode") == 1);
  CHECK(logged("Attention::construct: runs forward and backward as a traced graph (PIJit)") == 1);
  CHECK(logged("'wq' and nn::Dense<6, 6, Float64> 'wk' are one operation type on the same inputs, but two values") == 1);
  CHECK(logged("Attention::construct: runs forward and backward in PyNative mode, not as a static graph: its capture is "
               "ambiguous, as logged above") == 1);

  // d(sum of scores)/d(wq.weight) by central differences, against graph mode's.
  set_context({.mode = GRAPH_MODE});
  const auto analytic = value_and_grad(net, net.parameters())(x);
  const auto total = [&] {
    EagerScope eager;
    const BasicTensor<double> y = net(x);
    double s = 0;
    for (index_t i = 0; i < y.numel(); ++i) s += y.data()[i];
    return s;
  };
  const auto parameters = net.parameters();
  REQUIRE(analytic.grads.size() == parameters.size());
  for (std::size_t p = 0; p < parameters.size(); ++p) {
    double* w = parameters[p].parameter->data();
    for (index_t i = 0; i < parameters[p].parameter->numel(); i += 5) {
      const double saved = w[i];
      w[i] = saved + 1e-6;
      const double up = total();
      w[i] = saved - 1e-6;
      const double down = total();
      w[i] = saved;
      CHECK(analytic.grads[p].data()[i] == doctest::Approx((up - down) / 2e-6).epsilon(1e-6));
    }
  }
}

TEST_CASE("sharing: a traced network switches between training and evaluation in graph mode as in PyNative") {
  ModeGuard guard;
  const Tensor x = randn({8, 4}, 1);
  std::vector<std::vector<std::vector<double>>> outputs;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    set_seed(1);
    TracedWithDropout net;
    std::vector<std::vector<double>> got;
    for (bool training : {true, false, true, false}) {
      net.set_train(training);
      got.push_back(duet_test::values_of(net(x)));
    }
    CHECK(got[1] == got[3]);  // evaluation is the identity
    CHECK(got[0] != got[2]);  // each training call draws its own masks
    outputs.push_back(got);
  }
  CHECK(outputs[0] == outputs[1]);
}

TEST_CASE("sharing: s * 2 + s * 3 is five times s in both modes") {
  ModeGuard guard;
  set_seed(15);
  TwoScalars net;
  const BasicTensor<float> x = uniform<float>({4, 16}, -1.0f, 1.0f, 8);
  set_context({.mode = PYNATIVE_MODE});
  const BasicTensor<float> s = net.stem(x);
  const BasicTensor<float> eager = net(x);
  set_context({.mode = GRAPH_MODE});
  const BasicTensor<float> graph = net(x);
  CHECK(same_bits(eager, graph));
  for (index_t i = 0; i < s.numel(); ++i) CHECK(graph.data()[i] == doctest::Approx(5.0 * s.data()[i]).epsilon(1e-6));
  check_modes_agree(net, x);
}

TEST_CASE("sharing: a value of parameters alone read twice is one node, and its gradients are PyNative's bits") {
  Angles net;
  const std::string dump = captured_dump(net);
  CHECK(dump.find("ambiguous") == std::string::npos);
  CHECK(count(dump, "= Parameter") == 3);
  CHECK(count(dump, "BroadcastTo") == 1);
  CHECK(count(dump, "Mul(%") == 3);  // pos * freq once, x * pe, and the product by h
  const BasicTensor<double> x = uniform<double>({3, 4, 4}, -1.0, 1.0, 31);
  std::vector<std::vector<BasicTensor<double>>> grads;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    ModeGuard guard;
    set_context({.mode = mode});
    grads.push_back(value_and_grad(net, net.parameters())(x).grads);
  }
  REQUIRE(grads[0].size() == 3);
  for (std::size_t k = 0; k < 3; ++k) CHECK(duet_test::values_of(grads[0][k]) == duet_test::values_of(grads[1][k]));
}

TEST_CASE("sharing: a layer called on a value of parameters alone is captured, bit for bit and against finite differences") {
  ModeGuard guard;
  Queries net;
  const std::string dump = captured_dump(net);
  CHECK(dump.find("ambiguous") == std::string::npos);
  CHECK(count(dump, "= Tanh(%") == 1);
  CHECK(count(dump, "nn::Dense<6, 6, Float64> 'wq'") == 4);  // each call's product and bias, in the graph
  const BasicTensor<double> x = uniform<double>({3, 2, 6}, -1.0, 1.0, 41);
  check_modes_agree(net, x);

  set_context({.mode = GRAPH_MODE});
  const auto analytic = value_and_grad(net, std::vector<nn::BasicParameter<double>*>{&net.q})(x);
  const auto loss = [&] {
    set_context({.mode = PYNATIVE_MODE});
    const double y = net(x).data()[0];
    set_context({.mode = GRAPH_MODE});
    return y;
  };
  for (index_t i = 0; i < net.q.numel(); ++i) {
    const double saved = net.q.data()[i];
    net.q.data()[i] = saved + 1e-6;
    const double up = loss();
    net.q.data()[i] = saved - 1e-6;
    const double down = loss();
    net.q.data()[i] = saved;
    CHECK(analytic.grads[0].data()[i] == doctest::Approx((up - down) / 2e-6).epsilon(1e-6));
  }

  // PyNative mode's forward hooks see each call on the parameters' values.
  set_context({.mode = PYNATIVE_MODE});
  std::vector<std::vector<double>> seen;
  auto handle = net.wq.register_forward_hook(
      [&](const nn::BasicDynamicCell<double>&, const BasicTensor<double>& in, const BasicTensor<double>&) {
        seen.push_back(duet_test::values_of(in));
      });
  (void)net(x);
  REQUIRE(seen.size() == 2);  // in the order the compiler evaluates the operands of +
  CHECK(std::ranges::count(seen, duet_test::values_of(net.q)) == 1);
  handle.remove();
}

TEST_CASE("sharing: an ambiguous capture names the parameters it could not tell apart") {
  ScaledTwice net;
  const std::string dump = captured_dump(net);
  CHECK(dump.find("Parameter 's1' and Parameter 's2' are one operation type on the same inputs, but two values") !=
        std::string::npos);
  check_modes_agree(net, uniform<float>({3, 4}, -1.0f, 1.0f, 27));
  CHECK(logged("ScaledTwice::construct: runs as a traced graph (PIJit)") == 1);
  CHECK(logged("Parameter 's1' and Parameter 's2'") == 1);
}

TEST_CASE("sharing: a jitted function whose capture is ambiguous runs in PyNative mode, and says so") {
  auto f = jit([](auto x) { return x * 2.0f + x * 3.0f; }, {.name = "ambiguous scalars"});
  const BasicTensor<float> x = uniform<float>({3, 4}, -1.0f, 1.0f, 9);
  const BasicTensor<float> y = f(x);
  for (index_t i = 0; i < x.numel(); ++i) CHECK(y.data()[i] == doctest::Approx(5.0 * x.data()[i]).epsilon(1e-6));
  CHECK(logged("ambiguous scalars: runs in PyNative mode") == 1);
}

TEST_CASE("sharing: a value computed from a parameter read in construct is captured once") {
  set_seed(16);
  ParameterState net;
  // 11 nodes when merged by place alone: the parameter and h captured again.
  static_assert(captured_graph<ParameterState>::size == 7, "input, mul, parameter, add (h), add, mul, mul");
  const std::string dump = captured_dump(net);
  CHECK(count(dump, "Parameter") == 1);
  CHECK(dump.find("ambiguous") == std::string::npos);
  check_modes_agree(net, uniform<float>({3, 4}, -1.0f, 1.0f, 17));
}

TEST_CASE("sharing: two branches each scaled by its own parameter are a static graph") {
  // A parameter met another of its type by place alone, though the nodes before it differed:
  // an ambiguous capture, run traced.
  set_seed(20);
  ScaledBranches net;
  const std::string dump = captured_dump(net);
  CHECK(count(dump, "Parameter") == 2);
  CHECK(dump.find("ambiguous") == std::string::npos);
  check_modes_agree(net, uniform<float>({3, 4}, -1.0f, 1.0f, 25));
}

TEST_CASE("sharing: a recurrence over a learned initial state grows linearly with its steps") {
  // Merged by place alone, each step doubled the graph (16, 35 and 70 nodes here, where now
  // 14, 23 and 32), and a GRU of 12 steps did not compile in 9.6 GB.
  constexpr std::size_t one = captured_graph<Recurrent<1>>::size;
  constexpr std::size_t two = captured_graph<Recurrent<2>>::size;
  constexpr std::size_t three = captured_graph<Recurrent<3>>::size;
  static_assert(three - two == two - one && two - one == 9,
                "a slice, ih's and hh's MatMul and BiasAdd, Add, Tanh, Mul and Add per step");
  set_seed(18);
  Recurrent<3> net;
  const std::string dump = captured_dump(net);
  CHECK(count(dump, "Parameter") == 1);
  CHECK(dump.find("ambiguous") == std::string::npos);
  check_modes_agree(net, uniform<float>({5, 3}, -1.0f, 1.0f, 19));
}

}  // namespace tests_sharing
