// jit: results equal to PyNative at every level and execution mode, and every caching rule.
#include "support.hpp"

#include "../examples/custom_operation.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

namespace tests_jit {

using namespace duet;
using duet_test::ModeGuard;
using duet_test::SeedNetwork;

namespace {

template <JitConfig Config>
void check_config_matches_pynative() {
  SeedNetwork<PYNATIVE_MODE> eager;
  auto run = [&](auto x) { return eager(x); };
  auto compiled = jit<Config>(run);
  for (index_t batch : {1, 7, 64}) {
    const Tensor x = randn({batch, 1, 28, 28}, static_cast<std::uint64_t>(batch));
    const auto expected = duet_test::values_of(eager(x));
    CHECK(duet_test::relative_difference(duet_test::values_of(compiled(x)), expected) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("jit gives PyNative's results at every jit_level and exec_mode") {
  check_config_matches_pynative<JitConfig{.jit_level = O0}>();
  check_config_matches_pynative<JitConfig{.jit_level = O1}>();
  check_config_matches_pynative<JitConfig{.jit_level = O2}>();
  check_config_matches_pynative<JitConfig{.exec_mode = ExecMode::sink}>();
  check_config_matches_pynative<JitConfig{.exec_mode = ExecMode::no_sink}>();
  check_config_matches_pynative<JitConfig{.jit_level = O0, .exec_mode = ExecMode::no_sink}>();
  check_config_matches_pynative<JitConfig{.debug_level = DebugLevel::debug}>();
}

TEST_CASE("a jitted function runs as a graph whatever the context, the plain function stays dynamic") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<> net;
  auto run = [&](auto x) { return net(x); };
  auto run_with_jit = jit(run);
  // A hook works in the dynamic function and is refused, not skipped, in the compiled one.
  std::size_t calls = 0;
  auto handle = net.flatten.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++calls; });
  run(ones({1, 1, 28, 28}));
  CHECK(calls == 1);
  CHECK_THROWS_AS(run_with_jit(ones({1, 1, 28, 28})), ModeError);
  handle.remove();
  CHECK(run_with_jit(ones({1, 1, 28, 28})).shape() == Shape{1, 10});
}

TEST_CASE("jit_level changes the graph: O0 runs kernel by kernel, O1 fuses") {
  SeedNetwork<> net;
  const std::string o0 = graph_ir<JitConfig{.jit_level = O0}>(net).optimized.text;
  const std::string o1 = graph_ir<JitConfig{.jit_level = O1}>(net).optimized.text;
  CHECK(o0.find("BiasAdd(%2)") != std::string::npos);
  CHECK(o0.find("ReLU(%3)") != std::string::npos);
  CHECK(o0.find("[view of %0]") != std::string::npos);  // Flatten is an alias at every level
  CHECK(o1.find("MatMul + BiasAdd + ReLU(%1)") != std::string::npos);
}

TEST_CASE("O1 fuses a chain of elementwise functions into one pass") {
  auto f = jit([](auto x) { return ops::relu(ops::relu(x)); });
  const Tensor x({4}, {-1.0f, 2.0f, -3.0f, 4.0f});
  const Tensor y = f(x);
  CHECK(y(0) == 0.0f);
  CHECK(y(3) == 4.0f);
  auto captured = ops::relu(ops::relu(graph::input<float, graph::AnyShape>()));
  using G = decltype(passes::optimize(captured))::graph_type;
  static_assert(G::size == 2);
  static_assert(std::is_same_v<graph::node_at<G, 1>::op_type, ops::MapOp<fn::Relu, fn::Relu>>);
}

TEST_CASE("compile once per signature: new shape and new dtype recompile, the same signature does not") {
  auto f = jit([](auto x) { return ops::relu(x); }, {.name = "relu"});
  CHECK(f.compile_count() == 0);
  f(ones({2, 3}));
  f(ones({2, 3}));
  CHECK(f.compile_count() == 1);
  f(ones({4, 3}));
  CHECK(f.compile_count() == 2);
  f(ones<double>({4, 3}));
  CHECK(f.compile_count() == 3);
  f(ones({2, 3}));  // still cached
  CHECK(f.compile_count() == 3);
  const auto log = jit_compile_log();
  REQUIRE(log.size() >= 3);
  CHECK(log[log.size() - 3] == "relu: compile #1: first call");
  CHECK(log[log.size() - 2] == "relu: compile #2: argument 0 shape [2, 3] -> [4, 3]");
  CHECK(log[log.size() - 1] == "relu: compile #3: argument 0 dtype Float32 -> Float64");
}

TEST_CASE("non-tensor arguments are part of the signature unless wrapped in mutable_") {
  nn::Dense<3, 3> dense;
  auto f = jit([&](auto x, int repeats) {
    (void)repeats;
    return dense(x);
  });
  const Tensor x = ones({1, 3});
  f(x, 1);
  f(x, 1);
  CHECK(f.compile_count() == 1);
  f(x, 2);
  CHECK(f.compile_count() == 2);
  auto g = jit([&](auto x, int scale) {  // the function sees the value, unwrapped
    (void)scale;
    return dense(x);
  });
  g(x, mutable_(1));
  g(x, mutable_(5));
  CHECK(g.compile_count() == 1);
}

TEST_CASE("hash_args: a change of a free variable recompiles at the next call") {
  int version = 1;
  auto f = jit([](auto x) { return ops::relu(x); }, {.hash_args = {hash_arg(version)}, .name = "versioned"});
  f(ones({2}));
  f(ones({2}));
  CHECK(f.compile_count() == 1);
  version = 2;
  f(ones({2}));
  CHECK(f.compile_count() == 2);
  CHECK(jit_compile_log().back() == "versioned: compile #2: hash_args[0] changed");
}

TEST_CASE("compile_once: a re-created jitted function reuses the compiled form") {
  auto make = [](bool once) { return jit([](auto x) { return ops::relu(x); }, {.compile_once = once}); };
  const std::uint64_t before = jit_compile_count();
  for (int i = 0; i < 3; ++i) make(true)(ones({5}));
  CHECK(jit_compile_count() - before == 1);
  for (int i = 0; i < 3; ++i) make(false)(ones({5}));
  CHECK(jit_compile_count() - before == 4);
}

TEST_CASE("input_signature fixes what the function accepts, a dynamic dimension is one compiled form") {
  SeedNetwork<> net;
  auto f = jit([&](auto x) { return net(x); }, {.input_signature = {{float32, {dyn, 1, 28, 28}}}});
  f(ones({1, 1, 28, 28}));
  f(ones({17, 1, 28, 28}));
  f(ones({64, 1, 28, 28}));
  CHECK(f.compile_count() == 1);
  CHECK_THROWS_WITH_AS(f(ones({2, 1, 28, 27})),
                       doctest::Contains("input_signature says tensor 0 is Float32 [?, 1, 28, 28], got Float32 [2, 1, 28, 27]"),
                       ShapeError);
  // Another dtype or another number of tensors needs a function that would accept them.
  auto first = jit([](const auto& x, const auto&...) { return ops::relu(x); }, {.input_signature = {{float32, {dyn, 3}}}});
  CHECK(first(ones({2, 3})).shape() == Shape{2, 3});
  CHECK_THROWS_AS(first(ones<double>({2, 3})), ShapeError);
  CHECK_THROWS_AS(first(ones({2, 3}), ones({1})), ValueError);
}

TEST_CASE("set_context({.jit_enabled = false}) runs every jitted function as plain PyNative") {
  ModeGuard guard;
  SeedNetwork<> net;
  auto f = jit([&](auto x) { return net(x); });
  std::size_t calls = 0;
  net.flatten.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++calls; });
  set_context({.jit_enabled = false});
  const Tensor y = f(ones({2, 1, 28, 28}));
  set_context({.jit_enabled = true});
  CHECK(calls == 1);  // the hook ran: no graph was made
  CHECK(f.compile_count() == 0);
  CHECK(y.shape() == Shape{2, 10});
}

TEST_CASE("duet::print inside a graph prints the live value, at every level") {
  std::ostringstream out;
  auto f = jit<JitConfig{.jit_level = O2}>([&](auto x) { return ops::relu(print(x, "before", out)); });
  const Tensor y = f(Tensor({3}, {-1.0f, 0.5f, 2.0f}));
  CHECK(out.str() == "before: [-1.   0.5  2. ]\n");
  CHECK(y(0) == 0.0f);
  out.str("");
  f(Tensor({1}, {7.0f}));
  CHECK(out.str() == "before: [7.]\n");
  std::ostringstream eager;
  print(Tensor({2}, {1.0f, 2.0f}), "now", eager);
  CHECK(eager.str() == "now: [1. 2.]\n");
}

TEST_CASE("LAX: a host callback is a graph break that runs eagerly between compiled parts") {
  nn::Dense<3, 3> dense;
  auto clamp = [](const Tensor& t) {
    Tensor out = t.clone();
    for (float& v : out.values()) v = std::min(v, 0.25f);  // a branch on values: host code
    return out;
  };
  auto f = jit([&](auto x) { return ops::relu(dense(host(clamp, dense(x)))); });
  const Tensor x = randn({4, 3}, 1);
  const auto expected = duet_test::values_of(ops::relu(dense(clamp(dense(x)))));
  CHECK(duet_test::relative_difference(duet_test::values_of(f(x)), expected) <= 1e-6);
  CHECK(f(x).shape() == Shape{4, 3});
}

namespace {
struct Halving : nn::Cell<Halving> {
  nn::Dense<3, 3> fc;
  DUET_CELL_MEMBERS(fc);
  static constexpr unsigned break_line = __LINE__ + 2;
  auto construct(auto v) {
    return host<allowed_break>([](const Tensor& t) { return t * 0.5f; }, fc(v));
  }
};
}  // namespace

TEST_CASE("graph breaks are listed where they are called, COMPATIBLE runs the ones marked allowed_break") {
  nn::Dense<3, 3> dense;
  auto halve = [](const Tensor& t) { return t * 0.5f; };
  auto lax = jit([&](auto x) { return host(halve, dense(x)); });
  auto compatible = jit<JitConfig{.jit_syntax_level = JitSyntaxLevel::compatible}>(
      [&](auto x) { return host<allowed_break>(halve, dense(x)); });
  const Tensor x = randn({4, 3}, 2);
  const auto expected = duet_test::values_of(halve(dense(x)));
  CHECK(duet_test::values_of(lax(x)) == expected);
  CHECK(duet_test::values_of(compatible(x)) == expected);
  CHECK(JitConfig::parse("O1", "auto", "COMPATIBLE").jit_syntax_level == JitSyntaxLevel::compatible);
  CHECK_THROWS_WITH_AS(JitConfig::parse("O1", "auto", "LOOSE"),
                       doctest::Contains("jit_syntax_level must be STRICT, COMPATIBLE or LAX, got 'LOOSE'"), ValueError);

  // graph_ir names each break and the line that calls it.
  Halving net;
  const std::string text = graph_ir(net).captured.text;
  CAPTURE(text);
  CHECK(text.find("= Host(%2) : [..., 3]  [output]  duet::host<allowed_break> at " + std::string(__FILE__) + ":" +
                  std::to_string(Halving::break_line) + "\n") != std::string::npos);
  // A trace (PIJit) breaks there, and its compile log says where.
  const unsigned traced_line = __LINE__ + 1;
  auto traced = jit([&](const Tensor& v) { return host(halve, dense(v)); }, {.mode = JitMode::PIJit, .name = "breaks"});
  CHECK(duet_test::values_of(traced(x)) == expected);
  const auto log = jit_compile_log();
  CHECK(std::any_of(log.begin(), log.end(), [&](const std::string& line) {
    return line.find("breaks: compile #1: first call (graph break, runs eagerly: the function calls duet::host, a host "
                     "callback, at " + std::string(__FILE__) + ":" + std::to_string(traced_line) + ")") !=
           std::string::npos;
  }));
}

TEST_CASE("DEBUG names the node and the function, and checks every node for NaN and infinity") {
  nn::Dense<2, 2> dense;
  auto debug = jit<JitConfig{.debug_level = DebugLevel::debug}>([&](auto x) { return dense(x); }, {.name = "net"});
  auto release = jit([&](auto x) { return dense(x); }, {.name = "net"});
  const Tensor bad({1, 2}, {std::numeric_limits<float>::infinity(), 1.0f});
  CHECK((std::isinf(release(bad)(0, 0)) || std::isnan(release(bad)(0, 0))));
  CHECK_THROWS_WITH_AS(debug(bad), doctest::Contains("duet (debug): in net, node %1 (PackedMatMul + BiasAdd): output element 0 of [1, 2] is"),
                       ValueError);
  CHECK_THROWS_WITH_AS(debug(ones({1, 3})),
                       "duet (debug): in net, node %1 (PackedMatMul + BiasAdd): nn::Dense<2, 2> expects an input whose last "
                       "dimension is 2, got [1, 3]",
                       ShapeError);
}

// helper-104: value_and_grad ran a debug cell's training graph at the default level, so a NaN
// in training passed in silence until the optimiser refused its gradient, naming no node.
struct DebugLogNet : nn::Cell<DebugLogNet, JitConfig{.debug_level = DebugLevel::debug}> {
  nn::Dense<2, 1> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return ops::mean(ops::log(fc(x) - 10.0f)); }
};

TEST_CASE("DEBUG names the node in value_and_grad's training graph too, as in a forward call") {
  DebugLogNet net;
  const Tensor x = ones({3, 2});
  const std::string said =
      "duet (debug): in tests_jit::DebugLogNet::construct, node %3 (Log): output element 0 of [3, 1] is NaN";
  CHECK_THROWS_WITH_AS(net(x), said.c_str(), ValueError);
  CHECK_THROWS_WITH_AS(value_and_grad(net, net.parameters())(x), said.c_str(), ValueError);
}

// DEBUG was not applied under PIJit: a replay ran unchecked, in silence.
TEST_CASE("DEBUG under PIJit: the traced call checks its result, each replay every step, an eager break its result") {
  nn::Dense<> dense(2, 2);
  // Positive weights: both outputs of bad are +inf, whatever the generator drew before.
  dense.weight.set_data(Tensor({2, 2}, {0.5f, 0.25f, 1.0f, 0.75f}));
  const Tensor bad({1, 2}, {std::numeric_limits<float>::infinity(), 1.0f});
  const Tensor good({1, 2}, {0.5f, 1.0f});
  auto traced = jit<JitConfig{.debug_level = DebugLevel::debug}>([&](const Tensor& v) { return ops::relu(dense(v)); },
                                                                 {.mode = JitMode::PIJit, .name = "traced net"});
  CHECK_THROWS_WITH_AS(traced(bad),
                       doctest::Contains("duet (debug): in traced net, the result of a call run under its trace: "
                                         "output element 0 of [1, 2] is infinite"),
                       ValueError);
  CHECK(std::isfinite(traced(good)(0, 0)));  // the trace was kept: a replay
  CHECK_THROWS_WITH_AS(traced(bad),
                       doctest::Contains("duet (debug): in traced net, replayed step 0 (PackedMatMul + BiasAdd + "
                                         "ReLU): output element 0 of [1, 2] is infinite"),
                       ValueError);
  auto release =
      jit([&](const Tensor& v) { return ops::relu(dense(v)); }, {.mode = JitMode::PIJit, .name = "unchecked"});
  release(good);
  CHECK_NOTHROW(release(bad));
  auto breaks = jit<JitConfig{.debug_level = DebugLevel::debug}>(
      [&](const Tensor& v) { return host([](const Tensor& t) { return t; }, dense(v)); },
      {.mode = JitMode::PIJit, .name = "breaking net"});
  breaks(good);
  CHECK_THROWS_WITH_AS(breaks(bad),
                       doctest::Contains("duet (debug): in breaking net, the result of a call run eagerly (a graph "
                                         "break): output element"),
                       ValueError);
}

TEST_CASE("jit on construct: a cell with a JitConfig runs as one graph among dynamic cells") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<JitConfig{}> compiled;
  nn::Dense<10, 2> head;
  std::size_t head_calls = 0;
  head.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++head_calls; });
  const Tensor x = randn({2, 1, 28, 28}, 4);
  const Tensor logits = compiled(x);
  head(logits);
  CHECK(head_calls == 1);  // the cell after it stays dynamic
  const auto expected = duet_test::reference_forward(duet_test::values_of(x), 2, duet_test::layers_of(compiled));
  CHECK(duet_test::relative_difference(duet_test::values_of(logits), expected) <= 1e-5);
  compiled.flatten.register_forward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  CHECK_THROWS_AS(compiled(x), ModeError);  // it is a graph, whatever the context
}

TEST_CASE("PIJit traces a network built at run time, replays it, and re-traces on a new shape") {
  set_seed(4);
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  const std::vector<index_t> widths{12, 9, 7, 4};  // as a config file would give them
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    net.append(nn::Dense<>(widths[i], widths[i + 1]));
    if (i + 2 < widths.size()) net.append(nn::ReLU{});
  }
  auto f = jit([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit, .name = "traced"});
  for (index_t batch : {3, 3, 3, 8, 3}) {
    const Tensor x = randn({batch, 3, 4}, static_cast<std::uint64_t>(batch) + 1);
    CHECK(duet_test::relative_difference(duet_test::values_of(f(x)), duet_test::values_of(net(x))) <= 1e-6);
  }
  CHECK(f.compile_count() == 2);  // batch 3, then batch 8
  // The replay does not go through the cells; once one of them has a hook, the function runs
  // eagerly again, so the hook is honoured rather than skipped.
  std::size_t calls = 0;
  net[1].register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++calls; });
  f(randn({3, 3, 4}, 9));
  CHECK(calls == 1);
}

// helper-85 served an ONNX model through PIJit with a dynamic batch in the signature: traced at
// batch 1, a batch of 5 came back as one row, silently. A replay runs at its traced shapes, so
// a dynamic dimension is a trace per size there (the signature still checks the rest).
TEST_CASE("PIJit with a dynamic dimension in its signature traces each size it meets, and every row comes back") {
  set_seed(5);
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  net.append(nn::Dense<>(12, 4));
  auto f = jit([&](const Tensor& x) { return net(x); },
               {.mode = JitMode::PIJit, .input_signature = {{float32, {dyn, 3, 4}}}, .name = "served"});
  for (index_t batch : {1, 5, 1, 7}) {
    const Tensor x = randn({batch, 3, 4}, static_cast<std::uint64_t>(batch) + 20);
    const Tensor y = f(x);
    CHECK(y.shape() == Shape{batch, 4});
    CHECK(duet_test::relative_difference(duet_test::values_of(y), duet_test::values_of(net(x))) <= 1e-6);
  }
  CHECK(f.compile_count() == 3);  // batches 1, 5 and 7
  CHECK_THROWS_WITH_AS(f(randn({2, 3, 5}, 1)), doctest::Contains("input_signature says tensor 0 is Float32 [?, 3, 4]"),
                       ShapeError);
}

namespace {
// The last compile log line of the jitted function `name`.
std::string log_line_of(const std::string& name) {
  const auto log = jit_compile_log();
  const auto it = std::find_if(log.rbegin(), log.rend(), [&](const std::string& l) { return l.rfind(name + ":", 0) == 0; });
  REQUIRE(it != log.rend());
  return *it;
}

// A user's elementwise function, x / (1 + |x|), differentiated from its input: nothing of
// duet's names it, yet products take it as epilogue by its kind, as they take GELU.
struct Softsign {
  static constexpr std::string_view name = "Softsign";
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    return a / (S(1) + a.abs());
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    return dy / (S(1) + x.abs()).square();
  }
};

// The same layers as a cell, for graph mode's compiled form: sized at run time too, since a
// product of sizes known at compile time runs other kernels, with other bits.
template <class Act>
struct DenseAct : nn::Cell<DenseAct<Act>> {
  nn::Dense<> fc1{12, 10};
  Act act;
  nn::Dense<> fc2{10, 4};
  DUET_CELL_MEMBERS(fc1, act, fc2);
  auto construct(auto x) { return fc2(act(fc1(x))); }
};

template <class Act>
nn::DynamicSequentialCell dense_act_network() {
  set_seed(21);
  nn::DynamicSequentialCell net;
  net.append(nn::Dense<>(12, 10));
  net.append(Act{});
  net.append(nn::Dense<>(10, 4));
  return net;
}

// Dense, Act, Dense built at run time: PIJit at O1 and O2 replays PackedMatMul + BiasAdd + Act as
// one step, with the bits of PyNative and of graph mode (the same layers as a cell), forward;
// a traced training step (O1) fuses Act where its gradient reads the output the fused step
// writes, and gives PyNative's and graph mode's loss and gradients.
template <class Act>
void check_fused_activation(const std::string& name, bool grad_from_output) {
  CAPTURE(name);
  ModeGuard guard;
  auto net = dense_act_network<Act>();
  set_seed(21);
  DenseAct<Act> cell;
  for (std::size_t i = 0; i < 4; ++i) {
    REQUIRE(duet_test::values_of(*cell.parameters()[i].parameter) == duet_test::values_of(*net.parameters()[i].parameter));
  }
  const Tensor x = randn({13, 12}, 30);  // 13 rows: a tail after the vectors of every width
  set_context({.mode = PYNATIVE_MODE});
  const auto expected = duet_test::values_of(net(x));
  set_context({.mode = GRAPH_MODE});
  CHECK(duet_test::values_of(cell(x)) == expected);
  set_context({.mode = PYNATIVE_MODE});
  auto o1 = jit<JitConfig{.jit_level = O1}>([&](const Tensor& v) { return net(v); }, {.mode = JitMode::PIJit, .name = "o1 " + name});
  auto o2 = jit<JitConfig{.jit_level = O2}>([&](const Tensor& v) { return net(v); }, {.mode = JitMode::PIJit, .name = "o2 " + name});
  for (int call = 0; call < 3; ++call) {  // the trace, then replays
    CHECK(duet_test::values_of(o1(x)) == expected);
    CHECK(duet_test::values_of(o2(x)) == expected);
  }
  CHECK(log_line_of("o1 " + name) == "o1 " + name + ": compile #1: first call (traced 5 operations, replays 2 steps: PackedMatMul + BiasAdd + " + name + "; PackedMatMul + BiasAdd)");
  CHECK(log_line_of("o2 " + name) == "o2 " + name + ": compile #1: first call (traced 5 operations, replays 2 steps: PackedMatMul + BiasAdd + " + name + "; PackedMatMul + BiasAdd)");

  nn::MSELoss<> loss;
  nn::WithLossCell traced_loss(net, loss);
  nn::WithLossCell graph_loss(cell, loss);
  const Tensor target = randn({13, 4}, 32);
  const auto pynative = value_and_grad(traced_loss, net.parameters())(x, target);
  set_context({.mode = GRAPH_MODE});
  const auto graph = value_and_grad(graph_loss, cell.parameters())(x, target);
  const std::size_t log_before = jit_compile_log().size();
  auto traced = value_and_grad(traced_loss, net.parameters());
  for (int call = 0; call < 2; ++call) {  // the trace, then its replay
    const auto got = traced(x, target);
    CHECK(got.value.item() == pynative.value.item());
    CHECK(got.value.item() == graph.value.item());
    REQUIRE(got.grads.size() == 4);
    for (std::size_t i = 0; i < got.grads.size(); ++i) {
      CAPTURE(i);
      CHECK(duet_test::values_of(got.grads[i]) == duet_test::values_of(pynative.grads[i]));
      CHECK(duet_test::values_of(got.grads[i]) == duet_test::values_of(graph.grads[i]));
    }
  }
  const auto log = jit_compile_log();
  REQUIRE(log.size() == log_before + 1);
  // A gradient read off the input reads the bias add's value, which then stays a value.
  CHECK(log.back().find(grad_from_output ? "MatMul + BiasAdd + " + name + ";" : "MatMul + BiasAdd; " + name + ";") !=
        std::string::npos);
  // A training step writes its weights every step: packing them would be one more pass each.
  CHECK(log.back().find("Packed") == std::string::npos);
}
}  // namespace

TEST_CASE("PIJit fuses each activation into the product before it by the product's own rule, bit for bit") {
  check_fused_activation<nn::GELU>("GELU(tanh)", false);
  check_fused_activation<nn::GELUExact>("GELU(erf)", false);
  check_fused_activation<nn::Sigmoid>("Sigmoid", true);
  check_fused_activation<nn::Tanh>("Tanh", true);
  check_fused_activation<nn::ReLU>("ReLU", true);
  check_fused_activation<nn::SiLU>("SiLU", false);
  check_fused_activation<nn::Activation<Softsign>>("Softsign", false);
}

TEST_CASE("PIJit: an op without an epilogue rule, or whose rule refuses, stays a step, with PyNative's bits") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  set_seed(22);
  nn::Dense<> dense(12, 10);
  const Tensor x = randn({13, 12}, 33);
  const Tensor b = randn({10}, 34);
  const auto check = [&](const std::string& name, auto f, const std::string& steps) {
    CAPTURE(name);
    auto jitted = jit(f, {.mode = JitMode::PIJit, .name = name});
    for (int call = 0; call < 2; ++call) CHECK(duet_test::values_of(jitted(x)) == duet_test::values_of(f(x)));
    CHECK(log_line_of(name).find("steps: " + steps + ")") != std::string::npos);
  };
  // Softmax is no elementwise function: no product takes it.
  check("softmax", [&](const Tensor& v) { return ops::softmax(dense(v)); }, "PackedMatMul + BiasAdd; Softmax");
  // Multiplying by a number has no epilogue rule: the ReLU after it runs on its own.
  check("scalar", [&](const Tensor& v) { return ops::relu(v * 2.0f); }, "Mul(x, scalar); ReLU");
  // The README's user-written gate takes a function without parameters, as duet's binary ops
  // do, and refuses LeakyReLU, whose alpha it could not keep.
  check("gate", [&](const Tensor& v) { return ops::tanh(custom::gate(dense(v), b)); }, "PackedMatMul + BiasAdd; Gate + Tanh");
  check("gate leaky", [&](const Tensor& v) { return ops::leaky_relu(custom::gate(dense(v), b), 0.1); },
        "PackedMatMul + BiasAdd; Gate; LeakyReLU");
  // A value another step reads too is kept.
  check("twice", [&](const Tensor& v) {
    const Tensor y = dense(v);
    return ops::sigmoid(y) * y;
  }, "PackedMatMul + BiasAdd; Sigmoid; Mul");
  // Functions after functions: the product takes each in turn.
  check("chain", [&](const Tensor& v) { return ops::exp(ops::leaky_relu(dense(v), 0.1)); }, "PackedMatMul + BiasAdd + LeakyReLU + Exp");
}

TEST_CASE("PIJit: a function whose result no duet operation made runs eagerly, correctly") {
  auto f = jit(
      [](const Tensor& x) {
        Tensor y = x.clone();  // raw C++, invisible to the trace
        for (float& v : y.values()) v *= 2;
        return y;
      },
      {.mode = JitMode::PIJit, .name = "untraceable"});
  CHECK(f(Tensor({2}, {1.0f, 2.0f}))(1) == 4.0f);
  CHECK(f(Tensor({2}, {3.0f, 4.0f}))(0) == 6.0f);
  CHECK(jit_compile_log().back().find("graph break, runs eagerly") != std::string::npos);
}

TEST_CASE("PIJit: a branch on a value read in C++ breaks the trace, and a mutable_ value traces again") {
  // helper-91: both were replayed as traced, in silence. The branch: item() of a value the
  // trace made (an input, read by an element, too).
  auto branch = jit(
      [](const Tensor& x) {
        if (ops::sum(x).item() > 0) return x * 2.0f;
        return x * -3.0f;
      },
      {.mode = JitMode::PIJit, .name = "branch"});
  CHECK(branch(Tensor({2}, {1.0f, 2.0f}))(1) == 4.0f);
  CHECK(jit_compile_log().back().find("graph break, runs eagerly: the function reads a tensor's value in C++") !=
        std::string::npos);
  CHECK(branch(Tensor({2}, {-1.0f, -2.0f}))(1) == 6.0f);
  auto by_element = jit([](const Tensor& x) { return x(0) > 0 ? x * 2.0f : x * -3.0f; }, {.mode = JitMode::PIJit});
  CHECK(by_element(Tensor({2}, {1.0f, 2.0f}))(1) == 4.0f);
  CHECK(by_element(Tensor({2}, {-1.0f, -2.0f}))(1) == 6.0f);
  // Values of tensors the trace never saw are C++'s own: read freely, the trace replays.
  const Tensor scale({1}, {5.0f});
  auto reads_other = jit([&](const Tensor& x) { return x * scale.item(); }, {.mode = JitMode::PIJit});
  reads_other(ones({2}));
  CHECK(jit_compile_log().back().find("traced 1 operations") != std::string::npos);
  // mutable_: PSJit reads it as an input; a replay has it in its operations, so PIJit keys on it.
  auto scaled = jit([](const Tensor& x, float s) { return x * s; }, {.mode = JitMode::PIJit});
  const Tensor x = ones({3});
  CHECK(scaled(x, mutable_(2.0f))(0) == 2.0f);
  CHECK(scaled(x, mutable_(3.0f))(0) == 3.0f);
  CHECK(scaled(x, mutable_(2.0f))(0) == 2.0f);
}

TEST_CASE("PIJit applies the jit syntax level to the host callbacks its trace meets") {
  // helper-91: strict and compatible ran a host callback as a graph break under PIJit, as lax does.
  const auto doubled = [](const Tensor& x) {
    return host(
        [](const Tensor& v) {
          Tensor y = v.clone();
          for (float& e : y.values()) e *= 2;
          return y;
        },
        x);
  };
  auto strict =
      jit<JitConfig{.jit_syntax_level = JitSyntaxLevel::strict}>(doubled, {.mode = JitMode::PIJit, .name = "strict"});
  CHECK_THROWS_WITH_AS(strict(ones({2})),
                       doctest::Contains("strict: JitSyntaxLevel::strict: the function calls duet::host"), ModeError);
  CHECK_THROWS_AS(strict(ones({2})), ModeError);  // every call, not only the first
  auto compatible = jit<JitConfig{.jit_syntax_level = JitSyntaxLevel::compatible}>(doubled, {.mode = JitMode::PIJit});
  CHECK_THROWS_WITH_AS(compatible(ones({2})), doctest::Contains("write duet::host<duet::allowed_break>"), ModeError);
  auto lax = jit(doubled, {.mode = JitMode::PIJit});
  CHECK(lax(ones({2}))(0) == 2.0f);
}

TEST_CASE("a function of duet::Tensor cannot be a static graph: PSJit says so and names PIJit") {
  nn::Dense<2, 2> dense;
  auto f = jit([&](const Tensor& x) { return dense(x); });
  CHECK_THROWS_WITH_AS(f(ones({1, 2})), doctest::Contains("jit it with {.mode = JitMode::PIJit}"), ValueError);
}

TEST_CASE("grad and value_and_grad go through a jitted function, in both modes") {
  ModeGuard guard;
  nn::Dense<3, 2> dense;
  auto plain = [&](auto x) { return ops::relu(dense(x)); };
  auto jitted = jit(plain);
  const Tensor x = randn({4, 3}, 2);
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    const auto expected = value_and_grad(plain, dense.parameters(), 0)(x);
    const auto got = value_and_grad(jitted, dense.parameters(), 0)(x);
    CHECK(duet_test::relative_difference(duet_test::values_of(got.value), duet_test::values_of(expected.value)) <= 1e-6);
    REQUIRE(got.grads.size() == 3);
    REQUIRE(expected.grads.size() == 3);
    for (std::size_t i = 0; i < got.grads.size(); ++i) {
      CHECK(duet_test::relative_difference(duet_test::values_of(got.grads[i]), duet_test::values_of(expected.grads[i])) <=
            1e-6);
    }
  }
  CHECK(jitted.compile_count() == 0);  // differentiated where it was called, never compiled alone
}

}  // namespace tests_jit
