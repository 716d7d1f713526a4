#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "../examples/network.hpp"
#include "support.hpp"

namespace tests_summary {

using namespace duet;
using duet_test::ModeGuard;

namespace {

// What summary prints, and checks that it returns the same.
template <class Net>
std::string summary_text(Net& net, const Shape& input) {
  std::ostringstream out;
  const Summary s = summary(net, input, out);
  CHECK(s.text() == out.str());
  return out.str();
}

const std::string seed_network_summary = R"(Summary of SeedNetwork<CONTEXT_MODE> for an input of [64, 1, 28, 28]
==========================================================================
Layer (type)                                        Output Shape   Param #
==========================================================================
SeedNetwork<CONTEXT_MODE>                           [64, 10]            --
  flatten (nn::Flatten)                             [64, 784]            0
  dense_relu_sequential (nn::SequentialCell)        [64, 10]            --
    dense_relu_sequential.0 (nn::Dense<784, 512>)   [64, 512]      401,920
    dense_relu_sequential.1 (nn::ReLU)              [64, 512]            0
    dense_relu_sequential.2 (nn::Dense<512, 512>)   [64, 512]      262,656
    dense_relu_sequential.3 (nn::ReLU)              [64, 512]            0
    dense_relu_sequential.4 (nn::Dense<512, 10>)    [64, 10]         5,130
==========================================================================
Total params: 669,706
Trainable params: 669,706
Non-trainable params: 0
Params size: 2,678,824 bytes (2.55 MiB)
)";

// A cell built at run time with parameters of its own besides its children's: a non-trainable
// one it keeps (as a batch norm keeps its moving mean).
struct Block : nn::DynamicCell {
  nn::Dense<> fc;
  nn::ReLU act;
  nn::Parameter calibration;

  Block(index_t in, index_t out) : fc(in, out), calibration(Tensor({out})) { calibration.requires_grad = false; }

  void for_each_child(const ChildVisitor& visit) override {
    visit("fc", fc);
    visit("act", act);
  }
  void for_each_own_parameter(const ParameterVisitor& visit) override { visit("calibration", calibration); }
  std::string type_name() const override { return "Block"; }

 protected:
  Tensor forward(const Tensor& x) override { return act(fc(x)); }
};

nn::DynamicSequentialCell runtime_built() {
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  net.append(Block(784, 128));
  net.append(nn::Dense<>(128, 10));
  return net;
}

const std::string runtime_built_summary = R"(Summary of nn::DynamicSequentialCell for an input of [8, 1, 28, 28]
=================================================================
Layer (type)                               Output Shape   Param #
=================================================================
nn::DynamicSequentialCell                  [8, 10]             --
  0 (nn::Flatten)                          [8, 784]             0
  1 (Block)                                [8, 128]           128
    1.fc (nn::Dense<dyn, dyn>(784, 128))   [8, 128]       100,480
    1.act (nn::ReLU)                       [8, 128]             0
  2 (nn::Dense<dyn, dyn>(128, 10))         [8, 10]          1,290
=================================================================
Total params: 101,898
Trainable params: 101,770
Non-trainable params: 128
Params size: 407,592 bytes (0.39 MiB)
)";

template <class Net>
std::vector<std::pair<std::vector<float>, std::uint64_t>> parameter_state(Net& net) {
  std::vector<std::pair<std::vector<float>, std::uint64_t>> out;
  for (const auto& p : net.parameters()) {
    const nn::Parameter& param = *p.parameter;
    out.emplace_back(std::vector<float>(param.data(), param.data() + param.numel()), param.version());
  }
  return out;
}

}  // namespace

TEST_CASE("summary: the seed network, the same in both modes") {
  ModeGuard guard;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    Network net;
    CHECK(summary_text(net, {64, 1, 28, 28}) == seed_network_summary);
  }
}

TEST_CASE("summary: a runtime-built network, the same in both modes") {
  ModeGuard guard;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    auto net = runtime_built();
    CHECK(summary_text(net, {8, 1, 28, 28}) == runtime_built_summary);
  }
}

// print(model): the tree of cells, with no run; const cells print too.
TEST_CASE("summary: a network printed with operator<< shows its tree of cells") {
  std::ostringstream seed;
  const Network net;
  seed << net;
  CHECK(seed.str() == R"(SeedNetwork<CONTEXT_MODE>(
  (flatten): nn::Flatten
  (dense_relu_sequential): nn::SequentialCell(
    (0): nn::Dense<784, 512>
    (1): nn::ReLU
    (2): nn::Dense<512, 512>
    (3): nn::ReLU
    (4): nn::Dense<512, 10>
  )
))");
  std::ostringstream runtime;
  auto built = runtime_built();
  runtime << built;
  CHECK(runtime.str() == R"(nn::DynamicSequentialCell(
  (0): nn::Flatten
  (1): Block(
    (fc): nn::Dense<dyn, dyn>(784, 128)
    (act): nn::ReLU
  )
  (2): nn::Dense<dyn, dyn>(128, 10)
))");
  std::ostringstream leaf;
  leaf << nn::Dense<4, 3>{};
  CHECK(leaf.str() == "nn::Dense<4, 3>");
}

// A layer whose type leaves its sizes to run time shows the sizes it was built with, as
// PyTorch's print(model) shows Linear(in_features=4, ...); one whose type has them, nothing more.
TEST_CASE("summary: layers sized at run time print their sizes") {
  const auto repr = [](const auto& cell) {
    std::ostringstream out;
    out << cell;
    CHECK(out.str() == cell.repr());
    return out.str();
  };
  CHECK(repr(nn::Dense<>(4, 8)) == "nn::Dense<dyn, dyn>(4, 8)");
  CHECK(repr(nn::Dense<dyn, dyn, double, false>(4, 8)) == "nn::Dense<dyn, dyn, Float64, no bias>(4, 8)");
  CHECK(repr(nn::Dense<4, 8>{}) == "nn::Dense<4, 8>");
  CHECK(repr(nn::Embedding<>(10, 3)) == "nn::Embedding<dyn, dyn>(10, 3)");
  CHECK(repr(nn::Embedding<10, 3>{}) == "nn::Embedding<10, 3>");
  CHECK(repr(nn::LayerNorm<>(6)) == "nn::LayerNorm<dyn>(6)");
  CHECK(repr(nn::GroupNorm<>(2, 6)) == "nn::GroupNorm<dyn, dyn>(2, 6)");
  CHECK(repr(nn::BatchNorm1d<>(5)) == "nn::BatchNorm1d<dyn>(5)");
  CHECK(repr(nn::BatchNorm2d<5>{}) == "nn::BatchNorm2d<5>");
  CHECK(repr(nn::GRU<>(3, 4)) == "nn::GRU<dyn, dyn>(3, 4)");
  CHECK(repr(nn::LSTM<>(3, 4)) == "nn::LSTM<dyn, dyn>(3, 4)");
  CHECK(repr(nn::GRU<3, 4>{}) == "nn::GRU<3, 4>");
  CHECK(repr(nn::Conv2d<>(1, 6, 5)) == "nn::Conv2d<dyn, dyn, dyn>(1, 6, 5)");
  CHECK(repr(nn::Conv1d<>(2, 4, 3, {.stride = 2, .pad_mode = nn::PadMode::pad, .padding = 1, .has_bias = true})) ==
        "nn::Conv1d<dyn, dyn, dyn>(2, 4, 3, stride=2, pad_mode=pad, padding=1, has_bias=true)");
  CHECK(repr(nn::Conv2d<1, 6, 5, 1, 2>{}) == "nn::Conv2d<1, 6, 5, 1, 2>");
  // Errors keep naming the type alone.
  CHECK(nn::Dense<>(4, 8).label() == "nn::Dense<dyn, dyn>");
}

// torchinfo's summary prints once: so does summary() streamed where it prints, the usual
// `std::cout << duet::summary(net, shape)`; a Summary kept, or streamed elsewhere, prints.
TEST_CASE("summary: streaming the summary summary() returns prints it once") {
  Network net;
  std::ostringstream out;
  out << summary(net, {64, 1, 28, 28}, out);
  CHECK(out.str() == seed_network_summary);

  std::ostringstream first, second;
  second << summary(net, {64, 1, 28, 28}, first);
  CHECK(first.str() == seed_network_summary);
  CHECK(second.str() == seed_network_summary);

  std::ostringstream again;
  const Summary kept = summary(net, {64, 1, 28, 28}, again);
  again << kept;
  CHECK(again.str() == seed_network_summary + seed_network_summary);

  // To std::cout by default, the form the README shows.
  std::ostringstream captured;
  {
    const struct Redirect {
      std::streambuf* kept;
      ~Redirect() { std::cout.rdbuf(kept); }
    } redirect{std::cout.rdbuf(captured.rdbuf())};
    std::cout << summary(net, {64, 1, 28, 28});
    summary(net, {64, 1, 28, 28});
  }
  CHECK(captured.str() == seed_network_summary + seed_network_summary);
}

TEST_CASE("summary: the run changes no parameter, mode, compiled form or random draw") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  const Tensor x = randn({8, 1, 28, 28}, 3);

  Network seed;
  const Tensor seed_before = seed(x);
  auto runtime = runtime_built();
  const Tensor runtime_before = runtime(x);  // traced here
  const auto seed_state = parameter_state(seed);
  const auto runtime_state = parameter_state(runtime);
  const auto compiles = jit_compile_count();

  set_seed(5);
  std::ostringstream sink;
  summary(seed, {8, 1, 28, 28}, sink);
  summary(runtime, {8, 1, 28, 28}, sink);
  const Tensor drawn = uniform({4});

  CHECK(get_context().mode == GRAPH_MODE);
  CHECK(jit_compile_count() == compiles);
  CHECK(parameter_state(seed) == seed_state);
  CHECK(parameter_state(runtime) == runtime_state);
  set_seed(5);
  CHECK(duet_test::values_of(uniform({4})) == duet_test::values_of(drawn));
  // Still graph mode: the trace is replayed, not made again, and the outputs are the same.
  CHECK(duet_test::values_of(seed(x)) == duet_test::values_of(seed_before));
  CHECK(duet_test::values_of(runtime(x)) == duet_test::values_of(runtime_before));
  CHECK(jit_compile_count() == compiles);
}

struct NormDrop : nn::Cell<NormDrop> {
  nn::Dense<4, 6> fc;
  nn::BatchNorm1d<6> bn;
  nn::Dropout drop{0.5f};
  nn::Dense<6, 2> head;
  DUET_CELL_MEMBERS(fc, bn, drop, head);
  auto construct(auto x) { return head(drop(bn(fc(x)))); }
};

TEST_CASE("summary: a network set to train keeps its moving statistics and its Dropout's draws") {
  ModeGuard guard;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    const Tensor x = randn({8, 4}, 3);
    set_seed(7);
    NormDrop with;
    set_seed(7);
    NormDrop without;
    with.set_train(true);
    without.set_train(true);
    const auto values = [](NormDrop& net) {
      std::vector<std::vector<double>> out;
      for (const auto& p : net.parameters()) out.push_back(duet_test::values_of(Tensor(*p.parameter)));
      return out;
    };
    std::ostringstream sink;
    summary(with, {8, 4}, sink);
    CHECK(values(with) == values(without));
    // The next training call draws the masks it would have drawn without the summary.
    CHECK(duet_test::values_of(with(x)) == duet_test::values_of(without(x)));
    CHECK(values(with) == values(without));
  }
}

TEST_CASE("summary: cells whose mode is fixed, and cells with hooks, are seen too") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<GRAPH_MODE> graph;
  SeedNetwork<JitConfig{.jit_level = O2}> jitted;
  SeedNetwork<PYNATIVE_MODE> eager;
  const auto rows = [](auto& net) {
    std::ostringstream sink;
    std::vector<std::string> out;
    for (const SummaryRow& row : summary(net, {2, 1, 28, 28}, sink).rows) {
      out.push_back(row.name + " " + row.type_name + " " + to_string(row.output_shapes.at(0)) + " " +
                    std::to_string(row.parameters));
    }
    return out;
  };
  const auto expected = rows(eager);
  CHECK(expected.size() == 8);
  CHECK(expected[3] == "dense_relu_sequential.0 nn::Dense<784, 512> [2, 512] 401920");
  const auto graph_rows = rows(graph);
  const auto jitted_rows = rows(jitted);
  CHECK(std::vector(graph_rows.begin() + 1, graph_rows.end()) == std::vector(expected.begin() + 1, expected.end()));
  CHECK(std::vector(jitted_rows.begin() + 1, jitted_rows.end()) == std::vector(expected.begin() + 1, expected.end()));

  // A hook makes a graph-mode call a ModeError; the summary runs eagerly, so the hook just runs.
  int calls = 0;
  auto handle = graph.dense_relu_sequential.get<1>().register_forward_hook(
      [&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++calls; });
  CHECK_THROWS_AS(graph(ones({2, 1, 28, 28})), ModeError);
  CHECK(rows(graph) == graph_rows);
  CHECK(calls == 1);
  handle.remove();
}

namespace {
// A ReLU called twice on one shape, a Flatten twice on two, and a member never called.
struct Reused : nn::Cell<Reused> {
  nn::Flatten flatten;
  nn::Dense<6, 4> fc1;
  nn::Dense<4, 4> fc2;
  nn::ReLU relu;
  nn::Dense<4, 3> spare;
  DUET_CELL_MEMBERS(flatten, fc1, fc2, relu, spare);
  auto construct(auto x) {
    auto a = relu(fc1(flatten(x)));
    auto b = relu(fc2(a));
    return flatten(b);
  }
};
}  // namespace

TEST_CASE("summary: a cell called twice shows each call, one never called shows --") {
  Reused net;
  std::ostringstream sink;
  const Summary s = summary(net, {5, 2, 3}, sink);
  REQUIRE(s.rows.size() == 6);
  CHECK(s.rows[1].output_shapes == std::vector<Shape>{{5, 6}, {5, 4}});
  CHECK(s.rows[4].output_shapes == std::vector<Shape>{{5, 4}, {5, 4}});
  CHECK(s.rows[5].output_shapes.empty());
  CHECK(s.total_parameters == 28 + 20 + 15);
  CHECK(sink.str() == R"(Summary of tests_summary::(anonymous namespace)::Reused for an input of [5, 2, 3]
=========================================================================
Layer (type)                                   Output Shape       Param #
=========================================================================
tests_summary::(anonymous namespace)::Reused   [5, 4]                  --
  flatten (nn::Flatten)                        [5, 6], [5, 4]           0
  fc1 (nn::Dense<6, 4>)                        [5, 4]                  28
  fc2 (nn::Dense<4, 4>)                        [5, 4]                  20
  relu (nn::ReLU)                              [5, 4] (2 calls)         0
  spare (nn::Dense<4, 3>)                      --                      15
=========================================================================
Total params: 63
Trainable params: 63
Non-trainable params: 0
Params size: 252 bytes (0.00 MiB)
)");
}

TEST_CASE("summary: a wrong input shape is the layer's ShapeError, and graph mode goes on") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  Network seed;
  std::ostringstream sink;
  CHECK_THROWS_WITH_AS(summary(seed, {64, 1, 28, 27}, sink),
                       "duet::summary(SeedNetwork<CONTEXT_MODE>, input [64, 1, 28, 27]): nn::Dense<784, 512> "
                       "'dense_relu_sequential.0' expects an input whose last dimension is 784, got [64, 756]",
                       ShapeError);
  auto runtime = runtime_built();
  CHECK_THROWS_WITH_AS(summary(runtime, {8, 700}, sink),
                       "duet::summary(nn::DynamicSequentialCell, input [8, 700]): nn::Dense<dyn, dyn> '1.fc' expects "
                       "an input whose last dimension is 784, got [8, 700]",
                       ShapeError);
  CHECK(sink.str().empty());
  // The failed runs left nothing behind: the next call is traced, in graph mode.
  const auto compiles = jit_compile_count();
  runtime(ones({8, 784}));
  CHECK(jit_compile_count() == compiles + 1);

  CHECK_THROWS_WITH_AS(summary(seed, {dyn, 1, 28, 28}, sink),
                       "duet::summary(SeedNetwork<CONTEXT_MODE>, input [?, 1, 28, 28]): every dimension of the input shape "
                       "must be known, the batch size too",
                       ValueError);
}

namespace {
// A cell of two inputs, which a summary of one input cannot run (helper-75: a VAE and its noise).
struct WithNoise : nn::Cell<WithNoise> {
  nn::Dense<4, 2> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x, auto noise) { return fc(x) + noise; }
};
}  // namespace

TEST_CASE("summary: a cell of two inputs takes a shape for each, and given one, a ModeError that says so") {
  ModeGuard guard;
  WithNoise net;
  std::ostringstream sink;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    CHECK_THROWS_WITH_AS(summary(net, {2, 4}, sink),
                         doctest::Contains("WithNoise: construct takes several inputs, and this call (duet::summary, a "
                                           "container of cells, a call through nn::DynamicCell) gives it one"),
                         ModeError);
    const Summary s = summary(net, {{2, 4}, {2, 2}}, sink);
    CHECK(s.input_shapes == std::vector<Shape>{{2, 4}, {2, 2}});
    REQUIRE(s.rows.size() == 2);
    CHECK(s.rows[0].output_shapes == std::vector<Shape>{{2, 2}});
    CHECK(s.rows[1].output_shapes == std::vector<Shape>{{2, 2}});
    CHECK(s.total_parameters == 10);
    CHECK(s.text().starts_with("Summary of " + net.type_name() + " for inputs of [2, 4] and [2, 2]\n"));
  }
}

namespace {
// A runtime-built cell whose forward is given: it calls `inner` directly or through a jit function.
struct Calls : nn::DynamicCell {
  nn::DynamicCell& inner;
  std::function<Tensor(const Tensor&)> body;
  Calls(nn::DynamicCell& cell, std::function<Tensor(const Tensor&)> fn) : inner(cell), body(std::move(fn)) {}
  void for_each_child(const ChildVisitor& visit) override { visit("inner", inner); }
  std::string type_name() const override { return "Calls"; }

 protected:
  Tensor forward(const Tensor& x) override { return body(x); }
};
}  // namespace

TEST_CASE("summary: a cell called inside a jit function runs compiled with it, unseen") {
  nn::Dense<4, 3> fc;
  auto compiled = jit([&](auto x) { return fc(x); });
  Calls direct(fc, [&](const Tensor& x) { return fc(x); });
  Calls through_jit(fc, [&](const Tensor& x) { return compiled(x); });
  std::ostringstream sink;
  const Summary seen = summary(direct, {2, 4}, sink);
  const Summary unseen = summary(through_jit, {2, 4}, sink);
  CHECK(seen.rows.at(1).output_shapes == std::vector<Shape>{{2, 3}});
  CHECK(unseen.rows.at(0).output_shapes == std::vector<Shape>{{2, 3}});
  CHECK(unseen.rows.at(1).output_shapes.empty());
}

namespace {

// A network of int32 indices, as a language model begins.
struct Tokens : nn::Cell<Tokens> {
  using input_value_type = std::int32_t;
  nn::Embedding<10, 4> embed;
  nn::Dense<4, 3> head;
  DUET_CELL_MEMBERS(embed, head);
  auto construct(auto ids) { return head(embed(ids)); }
};

}  // namespace

TEST_CASE("summary: a network of int32 indices runs on int32 zeros, in both modes") {
  ModeGuard guard;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    Tokens net;
    std::ostringstream sink;
    const Summary s = summary(net, {2, 5}, sink);
    REQUIRE(s.rows.size() == 3);
    CHECK(s.rows[0].output_shapes == std::vector<Shape>{{2, 5, 3}});
    CHECK(s.rows[1].output_shapes == std::vector<Shape>{{2, 5, 4}});
    CHECK(s.rows[2].output_shapes == std::vector<Shape>{{2, 5, 3}});
    CHECK(s.total_parameters == 40 + 15);
  }
}

}  // namespace tests_summary
