#include <array>
#include <optional>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_cell {

using namespace duet;
using duet_test::ModeGuard;
using duet_test::SeedNetwork;

TEST_CASE("parameters() names every parameter by its path, with its shape") {
  SeedNetwork<> net;
  const auto params = net.parameters();
  REQUIRE(params.size() == 6);
  const std::vector<std::pair<std::string, Shape>> expected{
      {"dense_relu_sequential.0.weight", {512, 784}}, {"dense_relu_sequential.0.bias", {512}},
      {"dense_relu_sequential.2.weight", {512, 512}}, {"dense_relu_sequential.2.bias", {512}},
      {"dense_relu_sequential.4.weight", {10, 512}},  {"dense_relu_sequential.4.bias", {10}}};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CHECK(params[i].name == expected[i].first);
    CHECK(params[i].parameter->shape() == expected[i].second);
  }
  CHECK(params[0].parameter == &net.dense_relu_sequential.get<0>().weight);
}

TEST_CASE("cells_and_names walks the tree depth first, names are paths from the first root used") {
  SeedNetwork<> net;
  const auto cells = net.cells_and_names();
  std::vector<std::string> names;
  for (const auto& [name, cell] : cells) names.push_back(name + " " + cell->type_name());
  CHECK(names == std::vector<std::string>{
                     "" + std::string(" ") + cells[0].second->type_name(), "flatten nn::Flatten",
                     "dense_relu_sequential nn::SequentialCell", "dense_relu_sequential.0 nn::Dense<784, 512>",
                     "dense_relu_sequential.1 nn::ReLU", "dense_relu_sequential.2 nn::Dense<512, 512>",
                     "dense_relu_sequential.3 nn::ReLU", "dense_relu_sequential.4 nn::Dense<512, 10>"});
  net.ensure_named();
  CHECK(net.dense_relu_sequential.get<2>().name() == "dense_relu_sequential.2");
  CHECK(net.dense_relu_sequential.get<2>().label() == "nn::Dense<512, 512> 'dense_relu_sequential.2'");
  CHECK(net.type_name().find("SeedNetwork") != std::string::npos);
}

namespace {
template <duet::Mode M, duet::nn::PadMode P, duet::Reduction R>
struct EnumArguments : duet::nn::Cell<EnumArguments<M, P, R>, M> {
  duet::nn::ReLU relu;
  DUET_CELL_MEMBERS(relu);
  auto construct(auto x) { return relu(x); }
};
}  // namespace

TEST_CASE("type names spell enum template arguments as written, not as casts such as (Mode)0") {
  CHECK(EnumArguments<GRAPH_MODE, nn::PadMode::same, Reduction::mean>().type_name() ==
        "tests_cell::(anonymous namespace)::EnumArguments<GRAPH_MODE, nn::PadMode::same, Reduction::mean>");
  CHECK(EnumArguments<PYNATIVE_MODE, nn::PadMode::pad, Reduction::none>().type_name() ==
        "tests_cell::(anonymous namespace)::EnumArguments<PYNATIVE_MODE, nn::PadMode::pad, Reduction::none>");
  CHECK(duet_test::SeedNetwork<CONTEXT_MODE>().type_name() == "duet_test::SeedNetwork<CONTEXT_MODE>");
}

TEST_CASE("forward hooks see every cell, in order, with its input and output, in PyNative mode") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<> net;
  std::vector<std::string> seen;
  std::vector<nn::HookHandle> handles;
  for (auto& [name, cell] : net.cells_and_names()) {
    handles.push_back(
        cell->register_forward_hook([&seen](const nn::DynamicCell& c, const Tensor& in, const Tensor& out) {
          seen.push_back(c.name() + " " + to_string(in.shape()) + " -> " + to_string(out.shape()));
        }));
  }
  const Tensor y = net(ones({64, 1, 28, 28}));
  CHECK(seen == std::vector<std::string>{
                    "flatten [64, 1, 28, 28] -> [64, 784]",
                    "dense_relu_sequential.0 [64, 784] -> [64, 512]",
                    "dense_relu_sequential.1 [64, 512] -> [64, 512]",
                    "dense_relu_sequential.2 [64, 512] -> [64, 512]",
                    "dense_relu_sequential.3 [64, 512] -> [64, 512]",
                    "dense_relu_sequential.4 [64, 512] -> [64, 10]",
                    "dense_relu_sequential [64, 784] -> [64, 10]",
                    " [64, 1, 28, 28] -> [64, 10]",
                });

  seen.clear();
  for (auto& h : handles) h.remove();
  net(ones({2, 1, 28, 28}));
  CHECK(seen.empty());
}

TEST_CASE("a hook's tensors are the real intermediate values") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<> net;
  Tensor relu_in, relu_out;
  net.dense_relu_sequential.get<1>().register_forward_hook(
      [&](const nn::DynamicCell&, const Tensor& in, const Tensor& out) {
        relu_in = in.clone();
        relu_out = out.clone();
      });
  net(randn({3, 1, 28, 28}, 5));
  REQUIRE(relu_in.numel() == 3 * 512);
  bool some_negative = false;
  for (index_t i = 0; i < relu_in.numel(); ++i) {
    some_negative = some_negative || relu_in.data()[i] < 0;
    CHECK(relu_out.data()[i] == std::max(relu_in.data()[i], 0.0f));
  }
  CHECK(some_negative);
}

TEST_CASE("graph mode refuses to run a tree with forward hooks rather than skip them silently") {
  ModeGuard guard;
  SeedNetwork<> net;
  auto handle = net.dense_relu_sequential.get<0>().register_forward_hook(
      [](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  set_context({.mode = GRAPH_MODE});
  CHECK_THROWS_AS(net(ones({1, 1, 28, 28})), ModeError);
  handle.remove();
  CHECK(net(ones({1, 1, 28, 28})).shape() == Shape{1, 10});
}

TEST_CASE("a template argument fixes a cell's mode whatever the context") {
  ModeGuard guard;
  SeedNetwork<PYNATIVE_MODE> eager;
  std::size_t calls = 0;
  eager.flatten.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++calls; });
  set_context({.mode = GRAPH_MODE});
  eager(ones({1, 1, 28, 28}));
  CHECK(calls == 1);  // ran cell by cell although the context says graph

  SeedNetwork<GRAPH_MODE> compiled;
  compiled.flatten.register_forward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  set_context({.mode = PYNATIVE_MODE});
  CHECK_THROWS_AS(compiled(ones({1, 1, 28, 28})), ModeError);  // ran as a graph although the context says PyNative
}

TEST_CASE("set_data copies values in and keeps the parameter's shape") {
  nn::Dense<3, 2> dense;
  dense.weight.set_data(Tensor({2, 3}, {1, 2, 3, 4, 5, 6}));
  CHECK(dense.weight(1, 2) == 6);
  CHECK_THROWS_WITH_AS(dense.bias.set_data(zeros({3})),
                       "duet::nn::Parameter::set_data: parameter has shape [2], got [3]", ShapeError);
}

TEST_CASE("a network assembled at run time from DynamicCells with runtime sizes") {
  // Sizes as a config file would give them.
  const std::vector<index_t> sizes{6, 5, 4, 3};
  set_seed(11);
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
    net.append(nn::Dense<>(sizes[i], sizes[i + 1]));
    if (i + 2 < sizes.size()) net.append(nn::ReLU{});
  }
  CHECK(net.size() == 6);
  const auto params = net.parameters();
  REQUIRE(params.size() == 6);
  CHECK(params[0].name == "1.weight");
  CHECK(params[0].parameter->shape() == Shape{5, 6});
  CHECK(params[5].name == "5.bias");

  const Tensor x = randn({7, 2, 3}, 3);
  const Tensor y = net(x);
  CHECK(y.shape() == Shape{7, 3});

  std::vector<duet_test::Layer> layers;
  for (std::size_t i = 0; i < 3; ++i) {
    layers.push_back(duet_test::layer_of(*params[2 * i].parameter, *params[2 * i + 1].parameter, i < 2));
  }
  const auto expected = duet_test::reference_forward(duet_test::values_of(x), 7, layers);
  CHECK(duet_test::relative_difference(duet_test::values_of(y), expected) <= 1e-5);
}

TEST_CASE("backward hooks see each cell's input and output gradients while a PyNative gradient runs") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  nn::Dense<3, 2> first;
  nn::ReLU relu;
  nn::Dense<2, 1> second;
  auto f = [&](const Tensor& x) { return second(relu(first(x))); };
  std::vector<std::string> seen;
  Tensor relu_grad_in, relu_grad_out;
  auto record = [&](const nn::DynamicCell& c, const Tensor& gin, const Tensor& gout) {
    seen.push_back(c.type_name() + " " + to_string(gin.shape()) + " <- " + to_string(gout.shape()));
  };
  first.register_backward_hook(record);
  second.register_backward_hook(record);
  relu.register_backward_hook([&](const nn::DynamicCell&, const Tensor& gin, const Tensor& gout) {
    relu_grad_in = gin.clone();
    relu_grad_out = gout.clone();
  });
  const Tensor x = randn({4, 3}, 2);
  grad(f)(x);
  // Backward runs the last cell first; the first cell's input is x, whose gradient was asked for.
  CHECK(seen == std::vector<std::string>{"nn::Dense<2, 1> [4, 2] <- [4, 1]", "nn::Dense<3, 2> [4, 3] <- [4, 2]"});
  const Tensor h = relu(first(x));
  for (index_t i = 0; i < relu_grad_in.numel(); ++i) {
    CHECK(relu_grad_in.data()[i] == (h.data()[i] > 0 ? relu_grad_out.data()[i] : 0.0f));
  }
  set_context({.mode = GRAPH_MODE});
  CHECK_THROWS_AS(relu(x), ModeError);  // hooks are PyNative's; graph mode refuses rather than skips them
}

TEST_CASE("a hook may remove itself, as a one-shot hook does, or register another, while it runs") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  nn::Dense<3, 2> dense;
  const Tensor x = ones({1, 3});
  std::vector<std::string> ran;
  nn::HookHandle once;
  once = dense.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) {
    ran.push_back("once");
    once.remove();
  });
  auto every = dense.register_forward_hook([&](const nn::DynamicCell& cell, const Tensor&, const Tensor&) {
    ran.push_back("every");
    // Registered during the call: runs from the next call on.
    if (ran.size() == 2) {
      const_cast<nn::DynamicCell&>(cell).register_forward_hook(
          [&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ran.push_back("later"); });
    }
  });
  dense(x);
  dense(x);
  CHECK(ran == std::vector<std::string>{"once", "every", "every", "later"});
  every.remove();

  int backward_calls = 0;
  nn::HookHandle backward_once;
  backward_once = dense.register_backward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) {
    ++backward_calls;
    backward_once.remove();
  });
  const auto f = [&](const Tensor& input) { return ops::sum(dense(input)); };
  grad(f)(x);
  grad(f)(x);
  CHECK(backward_calls == 1);
}

namespace {
// A skip connection around a layer: y = inner(x) + x.
struct Residual : nn::Cell<Residual, PYNATIVE_MODE> {
  nn::Dense<3, 3> inner;
  DUET_CELL_MEMBERS(inner);
  Tensor construct(const Tensor& x) { return inner(x) + x; }
};

struct PassThrough : nn::Cell<PassThrough> {
  auto construct(auto x) { return x; }
};

// A learned query through a layer: the layer's input is a parameter.
struct LearnedQuery : nn::Cell<LearnedQuery, PYNATIVE_MODE> {
  nn::Parameter query{Tensor({1, 3}, {0.5f, -1.0f, 2.0f})};
  nn::Dense<3, 2> fc;
  DUET_CELL_MEMBERS(query, fc);
  Tensor construct(const Tensor& x) { return fc(query) + x; }
};
}  // namespace

TEST_CASE("a backward hook's grad_in is the gradient through its cell alone, empty where the input takes none") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  const Tensor x = randn({2, 3}, 4);

  // PyTorch's grad_input: the skip connection's share of x's gradient is not the layer's.
  Residual residual;
  const auto through_residual = [&](const Tensor& input) { return ops::sum(residual(input)); };
  const Tensor whole_without_hook = grad(through_residual)(x);
  Tensor grad_in, grad_out;
  auto handle =
      residual.inner.register_backward_hook([&](const nn::DynamicCell&, const Tensor& gin, const Tensor& gout) {
        grad_in = gin.clone();
        grad_out = gout.clone();
      });
  const Tensor whole = grad(through_residual)(x);
  handle.remove();
  const Tensor through_inner = grad([&](const Tensor& input) { return ops::sum(residual.inner(input)); })(x);
  CHECK(duet_test::values_of(grad_in) == duet_test::values_of(through_inner));
  CHECK(duet_test::values_of(grad_in) != duet_test::values_of(whole));
  CHECK(duet_test::values_of(grad_out) == std::vector<double>(6, 1.0));
  CHECK(duet_test::values_of(whole) == duet_test::values_of(whole_without_hook));  // the hook changes nothing

  // The network's input takes no gradient unless it is asked for: PyTorch's None is empty.
  nn::SequentialCell<nn::Dense<3, 2>, nn::Dropout, nn::Dense<2, 1>> net;
  net.set_train(false);
  std::vector<Shape> first_grad_in;
  Tensor dropout_in, dropout_out;
  net.get<0>().register_backward_hook(
      [&](const nn::DynamicCell&, const Tensor& gin, const Tensor&) { first_grad_in.push_back(gin.shape()); });
  net.get<1>().register_backward_hook([&](const nn::DynamicCell&, const Tensor& gin, const Tensor& gout) {
    dropout_in = gin.clone();
    dropout_out = gout.clone();
  });
  const auto loss = [&](const Tensor& input) { return ops::sum(net(input)); };
  value_and_grad(loss, net.parameters())(x);
  grad(loss)(x);
  CHECK(first_grad_in == std::vector<Shape>{Shape{0}, Shape{2, 3}});
  // Dropout in evaluation gives its input back: the gradient passes through it whole.
  CHECK(dropout_in.shape() == Shape{2, 2});
  CHECK(duet_test::values_of(dropout_in) == duet_test::values_of(dropout_out));
  // A cell that returns its very input, first in a hooked container, sees what reaches the
  // container's input through it.
  nn::SequentialCell<PassThrough, nn::Dense<3, 2>> pass_first;
  Tensor container_in, first_in, first_out;
  pass_first.register_backward_hook(
      [&](const nn::DynamicCell&, const Tensor& gin, const Tensor&) { container_in = gin.clone(); });
  pass_first.get<0>().register_backward_hook([&](const nn::DynamicCell&, const Tensor& gin, const Tensor& gout) {
    first_in = gin.clone();
    first_out = gout.clone();
  });
  grad([&](const Tensor& input) { return ops::sum(pass_first(input)); })(x);
  CHECK(container_in.shape() == Shape{2, 3});
  CHECK(duet_test::values_of(first_in) == duet_test::values_of(container_in));
  CHECK(duet_test::values_of(first_out) == duet_test::values_of(container_in));

  // A parameter passed as the input takes its gradient in the parameter, not in grad_in.
  LearnedQuery query;
  Shape query_grad_in{7};
  query.fc.register_backward_hook(
      [&](const nn::DynamicCell&, const Tensor& gin, const Tensor&) { query_grad_in = gin.shape(); });
  const auto [value, grads] =
      value_and_grad([&](const Tensor& input) { return ops::sum(query(input)); }, query.parameters())(ones({1, 2}));
  CHECK(query_grad_in == Shape{0});
  CHECK(grads[0].shape() == Shape{1, 3});
}

TEST_CASE("graph mode's refusal of a hook names the cell that has it") {
  ModeGuard guard;
  SeedNetwork<> net;
  net.dense_relu_sequential.get<2>().register_forward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  set_context({.mode = GRAPH_MODE});
  CHECK_THROWS_WITH_AS(net(ones({2, 1, 28, 28})),
                       doctest::Contains("runs in graph mode, but nn::Dense<512, 512> 'dense_relu_sequential.2' in it "
                                         "has a hook"),
                       ModeError);
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  const BasicTensor<std::int32_t> labels({2}, {1, 2});
  CHECK_THROWS_WITH_AS(value_and_grad(with_loss, net.parameters())(ones({2, 1, 28, 28}), labels),
                       doctest::Contains("is differentiated in graph mode, but nn::Dense<512, 512> "
                                         "'dense_relu_sequential.2' in it has a hook"),
                       ModeError);
}

namespace {
struct TokenClassifier : nn::Cell<TokenClassifier> {
  using input_value_type = std::int32_t;
  nn::Embedding<10, 4> embed;
  nn::Dense<4, 2> head;
  DUET_CELL_MEMBERS(embed, head);
  auto construct(auto ids) { return head(embed(ids)); }
};
}  // namespace

namespace {
// PyTorch's F.embedding(ids, table).mean(1), written with the indices' own operation.
struct GatheredMean : nn::Cell<GatheredMean> {
  using input_value_type = std::int32_t;
  nn::Parameter table{randn({10, 4}, 3)};
  DUET_CELL_MEMBERS(table);
  auto construct(auto ids) { return ops::mean(ops::gather<0>(table, ids), ops::axes<1>); }
};
}  // namespace

TEST_CASE("a cell of int32 input may apply index operations to it, and refuses floats through DynamicCell") {
  ModeGuard guard;
  GatheredMean net;
  const BasicTensor<std::int32_t> ids({2, 3}, {1, 2, 3, 4, 5, 6});
  std::vector<double> expected;
  for (index_t b = 0; b < 2; ++b) {
    for (index_t d = 0; d < 4; ++d) {
      double s = 0;
      for (index_t j = 0; j < 3; ++j) s += net.table(ids(b, j), d);
      expected.push_back(s / 3);
    }
  }
  const Tensor eager = net(ids);
  set_context({.mode = GRAPH_MODE});
  const Tensor graph = net(ids);
  CHECK(duet_test::relative_difference(duet_test::values_of(eager), expected) <= 1e-6);
  CHECK(duet_test::values_of(graph) == duet_test::values_of(eager));
  nn::DynamicCell& erased = net;
  CHECK_THROWS_WITH_AS(erased(ones({2, 3})),
                       doctest::Contains("GatheredMean takes int32 indices, got a tensor of Float32"), ValueError);
}

namespace {
// PyTorch's nn.ModuleList and nn.ParameterList as std::arrays.
struct Blocks : nn::Cell<Blocks> {
  std::array<nn::Dense<4, 4>, 3> blocks;
  std::array<nn::Parameter, 2> scales{nn::Parameter(ones({4})), nn::Parameter(ones({4}))};
  DUET_CELL_MEMBERS(blocks, scales);
  auto construct(auto x) {
    auto h = ops::relu(blocks[0](x)) * scales[0];
    return blocks[2](ops::relu(blocks[1](h)) * scales[1]);
  }
};
}  // namespace

TEST_CASE("std::arrays of cells and parameters are registered element by element, named by index") {
  ModeGuard guard;
  Blocks net;
  std::vector<std::string> names;
  for (const auto& p : net.parameters()) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"scales.0", "scales.1", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                                          "blocks.1.bias", "blocks.2.weight", "blocks.2.bias"});
  const Tensor x = randn({5, 4}, 9);
  std::vector<std::vector<Tensor>> grads;
  std::vector<Tensor> outputs;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    outputs.push_back(net(x));
    grads.push_back(
        value_and_grad([&](const auto& t) { return ops::sum(net(t)); }, net.parameters(), std::nullopt)(x).grads);
  }
  CHECK(duet_test::values_of(outputs[0]) == duet_test::values_of(outputs[1]));
  REQUIRE(grads[0].size() == 8);
  for (std::size_t i = 0; i < 8; ++i) {
    CHECK(duet_test::values_of(grads[0][i]) == duet_test::values_of(grads[1][i]));
    CHECK(ops::global_norm(std::vector<Tensor>{grads[0][i]}) > 0);
  }
}

TEST_CASE("a hook on a cell whose input holds integers is refused where it is registered, not at the call") {
  TokenClassifier net;
  const auto forward = [](const nn::DynamicCell&, const Tensor&, const Tensor&) {};
  CHECK_THROWS_WITH_AS(net.embed.register_forward_hook(forward),
                       "nn::Embedding<10, 4>: hooks take tensors of its element type (Float32), and its input holds "
                       "Int32 values; hook the cell after it (the first that takes its output)",
                       ModeError);
  CHECK_THROWS_AS(net.register_backward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {}), ModeError);
  int seen = 0;
  auto handle = net.head.register_forward_hook(  // the cell after it takes floats
      [&seen](const nn::DynamicCell&, const Tensor& in, const Tensor&) { seen += static_cast<int>(in.dim(0)); });
  const BasicTensor<std::int32_t> ids({3}, {1, 2, 3});
  CHECK(net(ids).shape() == Shape{3, 2});
  CHECK(seen == 3);
  handle.remove();
}

TEST_CASE("a hook handle removes its hook from the cell wherever the cell was moved, as PyTorch's handle does") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  const Tensor x = ones({1, 3});

  // Moved into a vector that then reallocates, moving it again.
  int calls = 0;
  std::vector<nn::Dense<>> layers;
  nn::Dense<> layer(3, 2);
  auto handle = layer.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++calls; });
  layers.push_back(std::move(layer));
  for (int i = 0; i < 16; ++i) layers.emplace_back(3, 2);
  layers[0](x);
  CHECK(calls == 1);  // the hook moved with its cell
  handle.remove();
  layers[0](x);
  CHECK(calls == 1);

  // Moved into a container cell.
  int backward_calls = 0;
  nn::Dense<> dense(3, 2);
  auto backward_handle =
      dense.register_backward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++backward_calls; });
  nn::DynamicSequentialCell net;
  auto& appended = net.append(std::move(dense));
  const auto f = [&](const Tensor& input) { return ops::sum(net(input)); };
  grad(f)(x);
  CHECK(backward_calls == 1);
  backward_handle.remove();
  grad(f)(x);
  CHECK(backward_calls == 1);
  CHECK(!net.has_hooks_in_tree());
  // Without hooks the network runs in graph mode again, which a hook left behind would refuse.
  set_context({.mode = GRAPH_MODE});
  CHECK(net(x).shape() == Shape{1, 2});
  CHECK(appended.name() == "0");

  // A cell destroyed took its hooks with it: removing one then is nothing to do, not a crash.
  nn::HookHandle orphan;
  {
    nn::Dense<> gone(3, 2);
    orphan = gone.register_forward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  }
  CHECK_NOTHROW(orphan.remove());
}

TEST_CASE("nn::HookHandle is a float cell's handle type, as the README names it, and BasicHookHandle<T> any other's") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  nn::Dense<3, 2> fc;
  std::vector<nn::HookHandle> handles;  // the README's spelling, kept in a container
  int float_calls = 0;
  handles.push_back(
      fc.register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++float_calls; }));
  fc(ones({1, 3}));
  for (auto& handle : handles) handle.remove();
  fc(ones({1, 3}));
  CHECK(float_calls == 1);

  nn::Dense<3, 2, double> wide;
  int double_calls = 0;
  nn::BasicHookHandle<double> handle =
      wide.register_forward_hook([&](const nn::BasicDynamicCell<double>&, const BasicTensor<double>&,
                                     const BasicTensor<double>&) { ++double_calls; });
  wide(ones<double>({1, 3}));
  handle.remove();
  wide(ones<double>({1, 3}));
  CHECK(double_calls == 1);
}

namespace {
// Counts how often its construct runs: once per call in PyNative mode, once per capture in graph mode.
struct CountingCell : nn::Cell<CountingCell> {
  nn::Dense<3, 2> dense;
  int constructs = 0;
  DUET_CELL_MEMBERS(dense);
  auto construct(auto x) {
    ++constructs;
    return dense(x);
  }
};
}  // namespace

TEST_CASE("graph mode captures construct once per cell and thread, as MindSpore compiles it once") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  CountingCell a, b;
  const Tensor x = ones({2, 3});
  for (int i = 0; i < 3; ++i) a(x);
  CHECK(a.constructs == 1);
  b(x);
  a(ones({5, 3}));  // another shape is planned again, yet not captured again
  CHECK(a.constructs == 2);  // b's capture replaced a's program: one program per cell type is kept
  CHECK(b.constructs == 1);
  set_context({.mode = PYNATIVE_MODE});
  a(x);
  a(x);
  CHECK(a.constructs == 4);
}

namespace {
// Counts its construct's runs, as CountingCell does, around one or two operations.
template <auto Setting>
struct OneOperation : nn::Cell<OneOperation<Setting>, Setting> {
  int constructs = 0;
  auto construct(auto x) {
    ++constructs;
    return ops::tanh(x);
  }
};
struct TwoOperations : nn::Cell<TwoOperations> {
  int constructs = 0;
  auto construct(auto x) {
    ++constructs;
    return ops::tanh(ops::relu(x));
  }
};
}  // namespace

TEST_CASE("a cell of one operation called alone in graph mode runs the operation, a cell of more is captured") {
  ModeGuard guard;
  const Tensor x = randn({4, 3}, 5);
  set_context({.mode = PYNATIVE_MODE});
  OneOperation<CONTEXT_MODE> one;
  const Tensor eager = one(x);
  set_context({.mode = GRAPH_MODE});
  const Tensor graph = one(x);
  one(x);
  CHECK(one.constructs == 3);  // no graph of its own: a graph of one node has nothing to fuse or plan
  CHECK(duet_test::values_of(graph) == duet_test::values_of(eager));
  // Hooks are refused as in any graph-mode call, rather than run.
  auto handle = one.register_forward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  CHECK_THROWS_AS(one(x), ModeError);
  handle.remove();
  // A cell that fixes graph mode asked for its graph, and one of two operations has one to fuse.
  OneOperation<GRAPH_MODE> fixed;
  TwoOperations two;
  for (int i = 0; i < 2; ++i) {
    fixed(x);
    two(x);
  }
  CHECK(fixed.constructs == 1);
  CHECK(two.constructs == 1);
}

namespace {
// The same, returning a loss to train on.
struct CountingLoss : nn::Cell<CountingLoss> {
  nn::Dense<3, 2> dense;
  int constructs = 0;
  DUET_CELL_MEMBERS(dense);
  auto construct(auto x) {
    ++constructs;
    return ops::sum(dense(x));
  }
};
}  // namespace

TEST_CASE("graph mode captures a training step's construct once too, not at every step") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  CountingLoss net;
  nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
  nn::TrainOneStepCell step(net, sgd);
  const Tensor x = ones({2, 3});
  const float first = step(x).item();
  for (int i = 0; i < 3; ++i) step(x);
  CHECK(net.constructs == 1);
  CHECK(step(x).item() != first);  // and the steps still train
  auto grads = value_and_grad(net, net.parameters());
  grads(x);
  grads(x);
  CHECK(net.constructs == 2);  // another function: captured once for itself
  set_context({.mode = PYNATIVE_MODE});
  step(x);
  CHECK(net.constructs == 3);
}

namespace {
// construct as a PyTorch user writes it first: taking Tensor, reassigning x. A PyNative cell
// runs it; a cell that may run as a graph must be written generic, with a new name per step.
struct TensorConstruct : nn::Cell<TensorConstruct, PYNATIVE_MODE> {
  nn::Dense<4, 8> fc1;
  nn::ReLU relu;
  nn::Dense<8, 2> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);
  Tensor construct(const Tensor& input) {
    Tensor x = fc1(input);
    x = relu(x);
    return fc2(x);
  }
};

struct Reassigning : nn::Cell<Reassigning, PYNATIVE_MODE> {
  nn::Dense<4, 8> fc1;
  nn::ReLU relu;
  nn::Dense<8, 2> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);
  auto construct(auto x) {
    x = fc1(x);
    x = relu(x);
    return fc2(x);
  }
};

struct NewNames : nn::Cell<NewNames> {
  nn::Dense<4, 8> fc1;
  nn::ReLU relu;
  nn::Dense<8, 2> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);
  auto construct(auto x) {
    auto hidden = fc1(x);
    auto activated = relu(hidden);
    return fc2(activated);
  }
};
}  // namespace

TEST_CASE("PyNative cells may take Tensor in construct and reassign x, written generic, graph mode agrees") {
  ModeGuard guard;
  const Tensor x = uniform({3, 4}, -1.0f, 1.0f, 5);
  set_seed(11);
  TensorConstruct tensor_construct;
  set_seed(11);
  Reassigning reassigning;
  set_seed(11);
  NewNames new_names;
  set_context({.mode = GRAPH_MODE});  // the first two are PyNative whatever the context
  const auto expected = duet_test::values_of(new_names(x));
  CHECK(duet_test::values_of(tensor_construct(x)) == expected);
  CHECK(duet_test::values_of(reassigning(x)) == expected);
  set_context({.mode = PYNATIVE_MODE});
  CHECK(duet_test::values_of(new_names(x)) == expected);
}

namespace unregistered {
// DUET_CELL_MEMBERS forgotten: nothing would be trained.
struct NoList : nn::Cell<NoList> {
  nn::Dense<4, 3> first;
  nn::Dense<3, 2> second;
  auto construct(auto x) { return second(first(x)); }
};

// One member left out of the list.
struct Partial : nn::Cell<Partial> {
  nn::Dense<4, 3> first;
  nn::Dense<3, 2> second;
  DUET_CELL_MEMBERS(first);
  auto construct(auto x) { return second(first(x)); }
};

// The faulty cell is itself a member, so the message names it by its path.
struct Outer : nn::Cell<Outer> {
  Partial inner;
  DUET_CELL_MEMBERS(inner);
  auto construct(auto x) { return inner(x); }
};

// Two inputs: the path of Cell's several-tensor call.
struct TwoInputs : nn::Cell<TwoInputs> {
  nn::Dense<4, 2> dense;
  nn::MSELoss<> loss;
  DUET_CELL_MEMBERS(loss);
  auto construct(const auto& x, const auto& y) { return loss(dense(x), y); }
};

// A loss member left out: it has no parameters to lose, but set_train would not reach it.
struct LossUnlisted : nn::Cell<LossUnlisted> {
  nn::Dense<4, 2> dense;
  nn::MSELoss<> loss;
  DUET_CELL_MEMBERS(dense);
  auto construct(const auto& x, const auto& y) { return loss(dense(x), y); }
};

std::string refusal(const std::string& parent, const std::string& member) {
  return parent + " calls a member " + member +
         " that is not registered with it, so its parameters would be neither trained nor saved; list the member "
         "in DUET_CELL_MEMBERS(...)";
}

// Registered in every way a cell can be: by member, through a container, by reference in a
// wrapper; and cells construct may call that are not its members.
struct Block : nn::Cell<Block> {
  nn::Dense<4, 4> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};
struct Legit : nn::Cell<Legit> {
  Block block;
  nn::Dense<4, 4> square;
  nn::SequentialCell<nn::Dense<4, 3>, nn::ReLU> head;
  DUET_CELL_MEMBERS(block, square, head);
  auto construct(auto x) {
    const auto h = block.fc(block(x));           // a grandchild reached through a registered child
    return head(square(nn::ReLU{}(square(h))));  // the same cell twice, and a temporary
  }
};

// Cells registered through a container built at run time, whose cells live on the heap.
struct Holder : nn::Cell<Holder, PYNATIVE_MODE> {
  nn::DynamicSequentialCell layers;
  DUET_CELL_MEMBERS(layers);
  auto construct(auto x) { return layers(x); }
};
}  // namespace unregistered

TEST_CASE("a member cell missing from DUET_CELL_MEMBERS is an error on the first call, in both modes") {
  using unregistered::refusal;
  ModeGuard guard;
  const std::string no_list = refusal("tests_cell::unregistered::NoList", "nn::Dense<4, 3>");
  const std::string partial_second = refusal("tests_cell::unregistered::Partial", "nn::Dense<3, 2>");
  const std::string inner_second = refusal("tests_cell::unregistered::Partial 'inner'", "nn::Dense<3, 2>");
  const std::string two_dense = refusal("tests_cell::unregistered::TwoInputs", "nn::Dense<4, 2>");
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    unregistered::NoList none;
    CHECK_THROWS_WITH_AS(none(ones({2, 4})), no_list.c_str(), ValueError);
    CHECK_THROWS_WITH_AS(none(ones({2, 4})), no_list.c_str(), ValueError);  // every call, not only the first
    unregistered::Partial partial;
    CHECK_THROWS_WITH_AS(partial(ones({2, 4})), partial_second.c_str(), ValueError);
    CHECK_THROWS_WITH_AS(partial(ones(shape<2, 4>)), partial_second.c_str(), ValueError);
    unregistered::Outer outer;
    CHECK_THROWS_WITH_AS(outer(ones({2, 4})), inner_second.c_str(), ValueError);
    unregistered::TwoInputs two;
    CHECK_THROWS_WITH_AS(two(ones({2, 4}), ones({2, 2})), two_dense.c_str(), ValueError);
    unregistered::LossUnlisted loss_unlisted;
    CHECK_THROWS_WITH_AS(loss_unlisted(ones({2, 4}), ones({2, 2})),
                         "tests_cell::unregistered::LossUnlisted calls a member nn::MSELoss that is not registered with "
                         "it, so set_train and the network's hooks would not reach it; list the member in "
                         "DUET_CELL_MEMBERS(...)",
                         ValueError);
    // Differentiating it for training is refused as well.
    CHECK_THROWS_WITH_AS(value_and_grad(two, two.parameters())(ones({2, 4}), ones({2, 2})), two_dense.c_str(),
                         ValueError);
  }
  // Capturing the graph to show it is a first call too.
  unregistered::Partial partial;
  CHECK_THROWS_WITH_AS(graph_ir(partial), partial_second.c_str(), ValueError);
}

TEST_CASE("registered cells, wrappers, temporaries and cells outside any construct run in both modes alike") {
  ModeGuard guard;
  set_seed(4);
  unregistered::Legit net;
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);  // keeps net by reference
  nn::Dense<4, 4> free_standing;
  const Tensor x = randn({3, 4}, 9);
  const Tensor target = randn({3, 3}, 10);
  std::vector<std::vector<double>> outputs;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    for (int call = 0; call < 2; ++call) {
      outputs.push_back(duet_test::values_of(net(x)));
      outputs.push_back(duet_test::values_of(with_loss(x, target)));
      outputs.push_back(duet_test::values_of(jit([&](auto in) { return net(free_standing(in)); })(x)));
      outputs.push_back(duet_test::values_of(value_and_grad(with_loss, net.parameters())(x, target).grads[0]));
    }
  }
  for (std::size_t i = 4; i < outputs.size(); ++i) CHECK(outputs[i] == outputs[i % 4]);
  CHECK(net.parameters().size() == 6);
}

namespace empty_list {
// A cell with nothing to register may say so: an empty list is a list.
struct Twice : nn::Cell<Twice> {
  DUET_CELL_MEMBERS();
  auto construct(auto x) { return x * 2.0f; }
};
struct Net : nn::Cell<Net> {
  Twice twice;
  nn::Dense<3, 2> fc;
  DUET_CELL_MEMBERS(twice, fc);
  auto construct(auto x) { return fc(twice(x)); }
};
}  // namespace empty_list

TEST_CASE("DUET_CELL_MEMBERS() with no member: a cell without children or parameters, in both modes") {
  ModeGuard guard;
  empty_list::Net net;
  const Tensor x = randn({4, 3}, 3);
  std::vector<std::vector<double>> outputs;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    outputs.push_back(duet_test::values_of(net(x)));
    CHECK(empty_list::Twice{}.parameters().empty());
  }
  CHECK(outputs[0] == outputs[1]);
  CHECK(outputs[0] == duet_test::values_of(net.fc(x * 2.0f)));
  CHECK(net.parameters().size() == 2);
}

TEST_CASE("a PyNative cell may hold a DynamicSequentialCell, whose cells live outside it") {
  unregistered::Holder holder;
  holder.layers.append(nn::Dense<>(4, 2));
  holder.layers.append(nn::ReLU{});
  CHECK(holder(ones({3, 4})).shape() == Shape{3, 2});
  CHECK(holder.parameters().size() == 2);
}

}  // namespace tests_cell
