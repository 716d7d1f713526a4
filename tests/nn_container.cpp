#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

namespace tests_nn_container {

using namespace duet;
using duet_test::ModeGuard;

TEST_CASE("SequentialCell runs its cells in order and gives access to each") {
  ModeGuard guard;
  nn::SequentialCell seq(nn::Dense<>(4, 3), nn::ReLU{}, nn::Dense<3, 2>{});
  static_assert(decltype(seq)::size() == 3);
  CHECK(seq.get<0>().out_channels() == 3);
  const Tensor x = randn({5, 4}, 1);
  const Tensor eager = seq(x);
  set_context({.mode = GRAPH_MODE});
  const Tensor graph = seq(x);
  const auto expected =
      duet_test::reference_forward(duet_test::values_of(x), 5,
                                   {duet_test::layer_of(seq.get<0>().weight, seq.get<0>().bias, true),
                                    duet_test::layer_of(seq.get<2>().weight, seq.get<2>().bias, false)});
  CHECK(duet_test::relative_difference(duet_test::values_of(eager), expected) <= 1e-5);
  CHECK(duet_test::relative_difference(duet_test::values_of(graph), expected) <= 1e-5);
}

TEST_CASE("SequentialCell takes named cells moved in, with their parameters, and names them by index") {
  nn::Dense<4, 3> first;
  nn::ReLU relu;
  nn::Dense<3, 2> last;
  const auto first_weight = duet_test::values_of(first.weight);
  const auto last_bias = duet_test::values_of(last.bias);
  nn::SequentialCell seq(std::move(first), std::move(relu), std::move(last));
  CHECK(duet_test::values_of(seq.get<0>().weight) == first_weight);
  CHECK(duet_test::values_of(seq.get<2>().bias) == last_bias);
  std::vector<std::string> names;
  for (const auto& p : seq.parameters()) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"});
}

TEST_CASE("SequentialCell that begins with an Embedding takes its indices, in both modes, gradients too") {
  ModeGuard guard;
  nn::SequentialCell<nn::Embedding<10, 4>, nn::Dense<4, 3>, nn::ReLU> seq;
  BasicTensor<std::int32_t> ids({2, 5});
  for (index_t i = 0; i < 10; ++i) ids.data()[i] = static_cast<std::int32_t>(i * 7 % 10);
  // The reference: each index's row of the table, then the product and ReLU, in double.
  const auto& table = seq.get<0>().embedding_table;
  const auto& dense = seq.get<1>();
  std::vector<double> expected;
  for (index_t i = 0; i < 10; ++i) {
    for (index_t o = 0; o < 3; ++o) {
      double s = dense.bias(o);
      for (index_t d = 0; d < 4; ++d) s += double(dense.weight(o, d)) * table(ids.data()[i], d);
      expected.push_back(std::max(s, 0.0));
    }
  }
  auto f = [&](const auto& x) { return ops::sum(seq(x)); };
  std::vector<std::vector<Tensor>> grads;
  std::vector<Tensor> outputs;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    outputs.push_back(seq(ids));
    CHECK(outputs.back().shape() == Shape{2, 5, 3});
    CHECK(duet_test::relative_difference(duet_test::values_of(outputs.back()), expected) <= 1e-6);
    grads.push_back(value_and_grad(f, seq.parameters(), std::nullopt)(ids).grads);
  }
  CHECK(duet_test::values_of(outputs[0]) == duet_test::values_of(outputs[1]));
  REQUIRE(grads[0].size() == 3);
  REQUIRE(grads[1].size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(duet_test::values_of(grads[0][i]) == duet_test::values_of(grads[1][i]));
  // The table's gradient reaches exactly the rows the indices read.
  const Tensor& table_grad = grads[0][0];
  for (index_t row = 0; row < 10; ++row) {
    bool read = false;
    for (index_t i = 0; i < 10; ++i) read = read || ids.data()[i] == row;
    bool nonzero = false;
    for (index_t d = 0; d < 4; ++d) nonzero = nonzero || table_grad(row, d) != 0.0f;
    if (!read) CHECK_FALSE(nonzero);
  }
}

TEST_CASE("DynamicSequentialCell holds any DynamicCell, static ones included, and names them by index") {
  nn::DynamicSequentialCell net;
  net.append(nn::Dense<4, 4>{});
  net.append(std::make_unique<nn::ReLU>());
  auto& inner = net.append(nn::SequentialCell<nn::Dense<4, 2>>{});
  const auto cells = net.cells_and_names();
  REQUIRE(cells.size() == 5);
  CHECK(cells[3].first == "2");
  CHECK(cells[4].first == "2.0");
  CHECK(cells[4].second == &inner.get<0>());
  CHECK(net(ones({3, 4})).shape() == Shape{3, 2});
  CHECK_THROWS_WITH_AS(net[3], "nn::DynamicSequentialCell: index 3 is out of range for 3 cells", IndexError);
}

namespace {
// The seed network's shape, built at run time as a config file would give it.
nn::DynamicSequentialCell runtime_network(const std::vector<index_t>& widths) {
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    net.append(nn::Dense<>(widths[i], widths[i + 1]));
    if (i + 2 < widths.size()) net.append(nn::ReLU{});
  }
  return net;
}

Tensor run_in(Mode mode, nn::DynamicCell& net, const Tensor& x) {
  ModeGuard guard;
  set_context({.mode = mode});
  return net(x);
}

bool log_has(std::size_t from, const std::string& text) {
  const auto log = jit_compile_log();
  for (std::size_t i = from; i < log.size(); ++i) {
    if (log[i].find(text) != std::string::npos) return true;
  }
  return false;
}

// A cell of its own whose forward calls back into C++.
struct Doubling : nn::DynamicCell {
  int* calls;
  explicit Doubling(int* counter) : calls(counter) {}
  std::string type_name() const override { return "Doubling"; }

 protected:
  Tensor forward(const Tensor& x) override {
    return host(
        [this](const Tensor& v) {
          ++*calls;
          Tensor y = v.clone();
          for (float& e : y.values()) e *= 2;
          return y;
        },
        x);
  }
};
}  // namespace

TEST_CASE("graph mode traces a network built at run time once per shape and structure, and replays it") {
  set_seed(31);
  auto net = runtime_network({12, 9, 7, 4});
  const std::uint64_t before = jit_compile_count();
  const std::size_t log_before = jit_compile_log().size();
  for (index_t batch : {3, 3, 3}) {
    const Tensor x = randn({batch, 3, 4}, 40);
    CHECK(duet_test::values_of(run_in(GRAPH_MODE, net, x)) == duet_test::values_of(run_in(PYNATIVE_MODE, net, x)));
  }
  CHECK(jit_compile_count() == before + 1);
  // Flatten, then MatMul, BiasAdd (and ReLU) per layer: 9 operations; O1 fuses each layer's.
  CHECK(log_has(log_before, "nn::DynamicSequentialCell in graph mode"));
  CHECK(log_has(log_before, "traced 9 operations, replays 4 steps: Flatten; PackedMatMul + BiasAdd + ReLU; PackedMatMul + BiasAdd + ReLU; "
                            "PackedMatMul + BiasAdd)"));
  const Tensor wider = randn({8, 3, 4}, 41);
  CHECK(duet_test::values_of(run_in(GRAPH_MODE, net, wider)) == duet_test::values_of(run_in(PYNATIVE_MODE, net, wider)));
  CHECK(jit_compile_count() == before + 2);
  CHECK(log_has(log_before, "argument 0 shape [3, 3, 4] -> [8, 3, 4]"));
  // A network changed after a call is traced again, never replayed in its old form.
  net.append(nn::ReLU{});
  net.append(nn::Dense<>(4, 2));
  const Tensor y = run_in(GRAPH_MODE, net, wider);
  CHECK(y.shape() == Shape{8, 2});
  CHECK(duet_test::values_of(y) == duet_test::values_of(run_in(PYNATIVE_MODE, net, wider)));
  CHECK(jit_compile_count() == before + 3);
  CHECK(log_has(log_before, "argument 1 (a value) changed (traced 12 operations, replays 5 steps: "));
}

TEST_CASE("value_and_grad made anew on every step replays the network's first trace, and trains as PyNative") {
  ModeGuard guard;
  // Two copies of one network, one trained in each mode, through value_and_grad made inside
  // the loop (as torch.autograd.grad is called each step) and an SGD step by hand.
  std::vector<Tensor> losses[2];
  std::vector<std::vector<double>> weights[2];
  std::uint64_t compiles = 0;
  for (int m = 0; m < 2; ++m) {
    set_context({.mode = m == 0 ? PYNATIVE_MODE : GRAPH_MODE});
    set_seed(7);
    auto net = runtime_network({12, 9, 4});
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
    nn::WithLossCell with_loss(net, loss);
    const Tensor x = randn({6, 3, 4}, 42);
    BasicTensor<std::int32_t> labels({6});
    for (index_t i = 0; i < 6; ++i) labels(i) = static_cast<std::int32_t>(i % 4);
    const std::uint64_t before = jit_compile_count();
    for (int step = 0; step < 4; ++step) {
      // The bias alone on odd steps: the step traced for all weights serves any of them.
      auto parameters = net.parameters();
      if (step % 2 == 1) parameters.resize(1);
      const auto result = value_and_grad(with_loss, parameters)(x, labels);
      losses[m].push_back(result.value);
      for (std::size_t i = 0; i < parameters.size(); ++i) {
        nn::Parameter& p = *parameters[i].parameter;
        CHECK(duet_test::values_of(result.grads[i]) == duet_test::values_of(p.grad));
        p.set_data(p - result.grads[i] * 0.5f);
      }
    }
    compiles = jit_compile_count() - before;
    for (const auto& p : net.parameters()) weights[m].push_back(duet_test::values_of(*p.parameter));
  }
  CHECK(compiles == 1);
  for (int step = 0; step < 4; ++step) CHECK(losses[0][step].item() == losses[1][step].item());
  CHECK(losses[1][3].item() < losses[1][0].item());
  CHECK(weights[0] == weights[1]);
}

TEST_CASE("a change to another network traces nothing again, a change below this one does, after freeze_compiles too") {
  // helper-91: one counter for the whole program made every network built at run time trace
  // again when any cell changed (set_train on another network, a DynamicSequentialCell built),
  // and one served after freeze_compiles() threw when another model was loaded.
  set_seed(33);
  auto served = runtime_network({12, 6, 3});
  auto other = runtime_network({12, 5, 2});
  const Tensor x = randn({2, 3, 4}, 42);
  const Tensor expected = run_in(PYNATIVE_MODE, served, x);
  static_cast<void>(run_in(GRAPH_MODE, served, x));
  const std::uint64_t traced = jit_compile_count();
  other.set_train(true);
  other.append(nn::ReLU{});
  auto loaded_later = runtime_network({12, 4, 4});
  {
    const FrozenCompiles frozen;
    CHECK(duet_test::values_of(run_in(GRAPH_MODE, served, x)) == duet_test::values_of(expected));
  }
  CHECK(jit_compile_count() == traced);
  // A phase switch inside the network, on one of its cells: traced again.
  served.cells_and_names().back().second->set_train(true);
  static_cast<void>(run_in(GRAPH_MODE, served, x));
  CHECK(jit_compile_count() == traced + 1);
}

TEST_CASE("graph mode runs a network built at run time eagerly where it cannot be traced, and says so once") {
  set_seed(32);
  int callbacks = 0;
  auto net = runtime_network({8, 5});
  net.append(Doubling(&callbacks));
  const Tensor x = randn({2, 8}, 42);
  const std::uint64_t before = jit_compile_count();
  const std::size_t log_before = jit_compile_log().size();
  const Tensor expected = run_in(PYNATIVE_MODE, net, x);
  for (int call = 0; call < 3; ++call) CHECK(duet_test::values_of(run_in(GRAPH_MODE, net, x)) == duet_test::values_of(expected));
  CHECK(callbacks == 4);  // every call ran the callback on its own values
  CHECK(jit_compile_count() == before + 1);
  CHECK(log_has(log_before, "graph break, runs eagerly: Doubling '2' calls duet::host, a host callback"));

  // A hook sees the values of each call: the network runs eagerly and the hook runs.
  auto hooked = runtime_network({8, 5, 3});
  int hook_calls = 0;
  hooked[3].register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++hook_calls; });
  const Tensor h = run_in(GRAPH_MODE, hooked, x);
  run_in(GRAPH_MODE, hooked, x);
  CHECK(hook_calls == 2);
  CHECK(duet_test::values_of(h) == duet_test::values_of(run_in(PYNATIVE_MODE, hooked, x)));
  CHECK(log_has(log_before, "graph break, runs eagerly: nn::Dense<dyn, dyn> '3' has a hook"));

  // A hook added after the trace: the trace is set aside, and the log says so once.
  auto later = runtime_network({8, 5, 3});
  run_in(GRAPH_MODE, later, x);
  int later_calls = 0;
  auto handle = later[1].register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++later_calls; });
  const std::size_t log_hooked = jit_compile_log().size();
  run_in(GRAPH_MODE, later, x);
  run_in(GRAPH_MODE, later, x);
  CHECK(later_calls == 2);
  const auto log = jit_compile_log();
  REQUIRE(log.size() == log_hooked + 1);
  CHECK(log.back() == "nn::DynamicSequentialCell in graph mode (argument 1: its structure): runs eagerly while a cell "
                      "in it has a hook (hooks see values in PyNative mode only)");
  handle.remove();
  CHECK(duet_test::values_of(run_in(GRAPH_MODE, later, x)) == duet_test::values_of(run_in(PYNATIVE_MODE, later, x)));
  CHECK(later_calls == 2);
}

namespace {
// Mean over the tokens of a sequence of embeddings: [B, L, D] to [B, D].
struct MeanOverTokens : nn::Cell<MeanOverTokens> {
  auto construct(auto x) { return ops::mean(x, ops::axes<1>); }
};

using StaticTextClassifier =
    nn::SequentialCell<nn::Embedding<12, 6>, MeanOverTokens, nn::Dense<6, 5>, nn::ReLU, nn::Dense<5, 3>>;

// The same classifier built at run time, with `weights`' parameters (through a checkpoint).
nn::DynamicSequentialCell runtime_text_classifier(StaticTextClassifier& weights) {
  nn::DynamicSequentialCell net;
  net.append(nn::Embedding<12, 6>{});
  net.append(MeanOverTokens{});
  net.append(nn::Dense<6, 5>{});
  net.append(nn::ReLU{});
  net.append(nn::Dense<5, 3>{});
  const duet_test::TempDir dir;
  save_checkpoint(weights, dir.path / "classifier.ckpt");
  load_checkpoint(dir.path / "classifier.ckpt", net);
  return net;
}

BasicTensor<std::int32_t> token_ids(index_t batch, index_t length, int salt) {
  BasicTensor<std::int32_t> ids({batch, length});
  for (index_t i = 0; i < batch * length; ++i) ids.data()[i] = static_cast<std::int32_t>((i * 7 + salt) % 12);
  return ids;
}
}  // namespace

TEST_CASE(
    "DynamicSequentialCell that begins with an Embedding takes token ids, bit for bit the static SequentialCell") {
  ModeGuard guard;
  set_seed(51);
  StaticTextClassifier fixed;
  auto net = runtime_text_classifier(fixed);
  CHECK(net.other_input_type() == "Int32");
  const auto ids = token_ids(4, 7, 3);
  const auto sum_of = [](auto& cell) { return [&cell](const auto& x) { return ops::sum(cell(x)); }; };
  const Tensor expected = fixed(ids);
  const auto expected_grads = value_and_grad(sum_of(fixed), fixed.parameters(), std::nullopt)(ids).grads;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    CAPTURE(m);
    const std::uint64_t before = jit_compile_count();
    for (int call = 0; call < 2; ++call) {  // graph mode: traced, then replayed
      const Tensor y = net(ids);
      CHECK(jit_compile_count() == before + (m == GRAPH_MODE ? 1 : 0));
      CHECK(y.shape() == Shape{4, 3});
      CHECK(duet_test::values_of(y) == duet_test::values_of(expected));
      CHECK(duet_test::values_of(y) == duet_test::values_of(fixed(ids)));
    }
    const auto result = value_and_grad(sum_of(net), net.parameters(), std::nullopt)(ids);
    REQUIRE(result.grads.size() == expected_grads.size());
    for (std::size_t i = 0; i < expected_grads.size(); ++i) {
      CHECK(duet_test::values_of(result.grads[i]) == duet_test::values_of(expected_grads[i]));
    }
    // Through the DynamicCell interface too.
    nn::DynamicCell& cell = net;
    CHECK(duet_test::values_of(cell(ids)) == duet_test::values_of(expected));
  }
}

TEST_CASE("a run-time text classifier of token ids trains as the static one, bit for bit, in both modes") {
  ModeGuard guard;
  BasicTensor<std::int32_t> labels({4});
  for (index_t i = 0; i < 4; ++i) labels(i) = static_cast<std::int32_t>(i % 3);
  std::vector<std::vector<float>> losses;
  std::vector<std::vector<std::vector<double>>> weights;
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    set_seed(52);
    StaticTextClassifier fixed;
    auto net = runtime_text_classifier(fixed);
    const auto train = [&](auto& backbone) {
      nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
      nn::WithLossCell with_loss(backbone, loss);
      nn::SGD sgd(backbone.parameters(), {.learning_rate = 0.5});
      nn::TrainOneStepCell step(with_loss, sgd);
      std::vector<float> seen;
      for (int k = 0; k < 4; ++k) seen.push_back(step(token_ids(4, 7, k), labels).item());
      losses.push_back(seen);
      std::vector<std::vector<double>> w;
      for (const auto& p : backbone.parameters()) w.push_back(duet_test::values_of(*p.parameter));
      weights.push_back(w);
    };
    train(fixed);
    train(net);
  }
  REQUIRE(losses.size() == 4);
  for (std::size_t i = 1; i < 4; ++i) {
    CHECK(losses[i] == losses[0]);
    CHECK(weights[i] == weights[0]);
  }
  CHECK(losses[0][3] < losses[0][0]);
}

TEST_CASE("a run-time network of token ids prints its summary and refuses floats, ids elsewhere, ids for floats") {
  set_seed(53);
  StaticTextClassifier fixed;
  auto net = runtime_text_classifier(fixed);
  std::ostringstream out;
  const Summary s = summary(net, {4, 7}, out);
  REQUIRE(s.rows.size() == 6);
  CHECK(s.rows[0].output_shapes == std::vector<Shape>{Shape{4, 3}});
  CHECK(s.rows[1].output_shapes == std::vector<Shape>{Shape{4, 7, 6}});
  CHECK(s.rows[2].output_shapes == std::vector<Shape>{Shape{4, 6}});
  CHECK(s.total_parameters == 12 * 6 + 6 * 5 + 5 + 5 * 3 + 3);
  // Ids are not floats, and floats are not ids: each is refused, saying what was expected.
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    ModeGuard guard;
    set_context({.mode = m});
    CHECK_THROWS_WITH_AS(net(ones({4, 7})), "nn::Embedding<12, 6> '0' takes int32 indices, got a tensor of Float32",
                         ValueError);
    auto floats = runtime_network({6, 3});
    CHECK_THROWS_WITH_AS(floats(token_ids(4, 6, 0)),
                         "nn::Flatten '0' takes tensors of Float32, got a tensor of Int32 (indices)", ValueError);
  }
  nn::DynamicSequentialCell empty;
  CHECK_THROWS_WITH_AS(empty(token_ids(1, 2, 0)),
                       "nn::DynamicSequentialCell takes tensors of Float32, got a tensor of Int32 (indices)",
                       ValueError);
  CHECK_THROWS_WITH_AS(
      net.append(nn::Embedding<3, 3>{}),
      "nn::DynamicSequentialCell: cannot append nn::Embedding<3, 3> as cell 5: it takes Int32 values, "
      "and cell 4, nn::Dense<5, 3>, gives Float32 values (only the first cell may take another element "
      "type, such as an nn::Embedding's int32 indices)",
      ValueError);
  CHECK(net.size() == 5);
}

// A generic function is asked whether graph capture can call it; one calling a network built at
// run time cannot be captured, and then runs on real tensors as one taking `const Tensor&` does.
TEST_CASE("value_and_grad of a generic function over a network built at run time, bit for bit a Tensor function") {
  ModeGuard guard;
  set_seed(54);
  StaticTextClassifier fixed;
  auto net = runtime_text_classifier(fixed);
  auto floats = runtime_network({6, 5, 3});
  const auto ids = token_ids(4, 7, 5);
  const Tensor x = randn({4, 6});
  auto generic = value_and_grad([&](auto t) { return ops::sum(ops::square(net(t))); }, net.parameters());
  auto typed = value_and_grad([&](const BasicTensor<std::int32_t>& t) { return ops::sum(ops::square(net(t))); },
                              net.parameters());
  auto generic_floats = value_and_grad([&](const auto& t) { return ops::mean(floats(t)); }, floats.parameters(), 0);
  auto typed_floats = value_and_grad([&](const Tensor& t) { return ops::mean(floats(t)); }, floats.parameters(), 0);
  const auto expected = typed(ids);
  const auto expected_floats = typed_floats(x);
  for (Mode m : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = m});
    CAPTURE(m);
    const auto got = generic(ids);
    CHECK(duet_test::values_of(got.value) == duet_test::values_of(expected.value));
    REQUIRE(got.grads.size() == expected.grads.size());
    for (std::size_t i = 0; i < got.grads.size(); ++i) {
      CHECK(duet_test::values_of(got.grads[i]) == duet_test::values_of(expected.grads[i]));
    }
    const auto got_floats = generic_floats(x);
    CHECK(duet_test::values_of(got_floats.value) == duet_test::values_of(expected_floats.value));
    REQUIRE(got_floats.grads.size() == expected_floats.grads.size());
    for (std::size_t i = 0; i < got_floats.grads.size(); ++i) {
      CHECK(duet_test::values_of(got_floats.grads[i]) == duet_test::values_of(expected_floats.grads[i]));
    }
  }
  // Graph mode not applied is said (once per process, so this or an earlier case said it).
  CHECK(std::ranges::any_of(jit_compile_log(), [](const std::string& line) {
    return line.starts_with("duet::grad/value_and_grad: a function that runs on real tensors") &&
           line.find("runs on PyNative's tape in graph mode") != std::string::npos;
  }));
}

namespace {
// A static cell whose construct calls a network built at run time: it cannot be captured, so it
// runs on real tensors in both modes, the network following the mode itself.
struct AroundRuntimeNetwork : nn::Cell<AroundRuntimeNetwork> {
  nn::DynamicSequentialCell inner = runtime_network({6, 5, 3});
  DUET_CELL_MEMBERS(inner);
  auto construct(auto x) { return inner(x); }
};
}  // namespace

TEST_CASE("a static cell calling a network built at run time runs it in both modes, bit for bit") {
  ModeGuard guard;
  set_seed(55);
  AroundRuntimeNetwork net;
  const Tensor x = randn({4, 6});
  set_context({.mode = PYNATIVE_MODE});
  const Tensor expected = net(x);
  CHECK(duet_test::values_of(expected) == duet_test::values_of(net.inner(x)));
  set_context({.mode = GRAPH_MODE});
  for (int call = 0; call < 2; ++call) CHECK(duet_test::values_of(net(x)) == duet_test::values_of(expected));
}

}  // namespace tests_nn_container
