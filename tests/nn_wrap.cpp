// Training: both modes learn a small synthetic problem with the same loss curve, and a
// checkpoint saved in one mode loads into the other.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_nn_wrap {

using namespace duet;
using duet_test::ModeGuard;

namespace {

template <auto Setting>
struct SmallIn : nn::Cell<SmallIn<Setting>, Setting> {
  nn::Flatten flatten;
  nn::SequentialCell<nn::Dense<8, 16>, nn::ReLU, nn::Dense<16, 3>> layers;
  DUET_CELL_MEMBERS(flatten, layers);
  auto construct(auto x) { return layers(flatten(x)); }
};
using Small = SmallIn<CONTEXT_MODE>;

// Three classes, each a noisy prototype: learnable to a low loss in a few hundred steps.
struct Problem {
  Tensor x = randn({96, 2, 4}, 11);
  BasicTensor<std::int32_t> y{Shape{96}};
  Problem() {
    const Tensor prototypes = randn({3, 8}, 12);
    for (index_t i = 0; i < 96; ++i) {
      const auto c = static_cast<std::int32_t>(i % 3);
      y(i) = c;
      for (index_t j = 0; j < 8; ++j) x.data()[i * 8 + j] = 0.3f * x.data()[i * 8 + j] + 2 * prototypes(c, j);
    }
  }
};

std::vector<float> train_losses(Mode mode, const Problem& data, int steps, Small& net) {
  ModeGuard guard;
  set_context({.mode = mode});
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 0.01});
  nn::TrainOneStepCell step(with_loss, adam);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(step(data.x, data.y).item());
  return losses;
}

}  // namespace

TEST_CASE("both modes train to a low loss along the same curve") {
  const Problem data;
  set_seed(3);
  Small eager_net;
  set_seed(3);
  Small graph_net;
  const auto eager = train_losses(PYNATIVE_MODE, data, 150, eager_net);
  const auto graph = train_losses(GRAPH_MODE, data, 150, graph_net);
  CHECK(eager.front() > 0.5f);
  CHECK(eager.back() < 0.05f);
  for (std::size_t i = 0; i < eager.size(); ++i) CHECK(graph[i] == doctest::Approx(eager[i]).epsilon(1e-4));
  const index_t correct = train::correct_predictions(graph_net(data.x), data.y);
  CHECK(correct == 96);
}

TEST_CASE("parameter groups train in both modes to the same bits: a layer at rate 0 stays, the rest move") {
  const Problem data;
  const auto trained = [&](Mode mode) {
    ModeGuard guard;
    set_context({.mode = mode});
    set_seed(3);
    Small net;
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::Adam adam({{.params = net.layers.get<0>().parameters(), .learning_rate = 0.0},
                   {.params = net.layers.get<2>().parameters()}},
                  {.learning_rate = 0.01});
    nn::TrainOneStepCell step(with_loss, adam);
    const Tensor first = net.layers.get<0>().weight.clone();
    const Tensor last = net.layers.get<2>().weight.clone();
    for (int s = 0; s < 5; ++s) step(data.x, data.y);
    CHECK(std::equal(first.data(), first.data() + first.numel(), net.layers.get<0>().weight.data()));
    CHECK_FALSE(std::equal(last.data(), last.data() + last.numel(), net.layers.get<2>().weight.data()));
    std::vector<float> values;
    for (const auto& [name, p] : net.parameters()) values.insert(values.end(), p->data(), p->data() + p->numel());
    return values;
  };
  CHECK(trained(PYNATIVE_MODE) == trained(GRAPH_MODE));
}

TEST_CASE("WithLossCell keeps the backbone's parameter names") {
  Small net;
  nn::SoftmaxCrossEntropyWithLogits<true> loss;
  nn::WithLossCell with_loss(net, loss);
  const auto a = net.parameters();
  const auto b = with_loss.parameters();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].name == b[i].name);
    CHECK(a[i].parameter == b[i].parameter);
  }
  CHECK(a[0].name == "layers.0.weight");
}

TEST_CASE("a network trained in graph mode, checkpointed, loads into PyNative and predicts the same") {
  const Problem data;
  set_seed(5);
  Small trained;
  train_losses(GRAPH_MODE, data, 20, trained);
  const auto path = std::filesystem::temp_directory_path() / "duet_nn_wrap_test.ckpt";
  save_checkpoint(trained, path);
  set_seed(6);
  Small fresh;
  load_checkpoint(path, fresh);
  std::filesystem::remove(path);
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  const auto a = duet_test::values_of(trained(data.x));
  set_context({.mode = PYNATIVE_MODE});
  const auto b = duet_test::values_of(fresh(data.x));
  CHECK(duet_test::relative_difference(a, b) <= 1e-6);
}

namespace {
// The losses of `steps` SGD steps with momentum, in the mode the network and context say.
template <class Net>
std::vector<float> sgd_losses(Net& net, const Problem& data, int steps) {
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters(), {.learning_rate = 0.05, .momentum = 0.9});
  nn::TrainOneStepCell step(with_loss, sgd);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(step(data.x, data.y).item());
  return losses;
}

template <auto Setting>
std::vector<float> train_fixed(const Problem& data, int steps) {
  set_seed(5);
  SmallIn<Setting> net;
  return sgd_losses(net, data, steps);
}
}  // namespace

TEST_CASE("a network of fixed mode trains in that mode, whatever the context") {
  ModeGuard guard;
  const Problem data;
  set_context({.mode = PYNATIVE_MODE});
  static_assert(nn::WithLossCell<SmallIn<GRAPH_MODE>, nn::MSELoss<>>::mode == GRAPH_MODE);
  static_assert(nn::WithLossCell<Small, nn::MSELoss<>>::mode == CONTEXT_MODE);
  const auto graph = train_fixed<GRAPH_MODE>(data, 40);
  set_context({.mode = GRAPH_MODE});
  const auto eager = train_fixed<PYNATIVE_MODE>(data, 40);
  CHECK(eager.back() < eager.front());
  for (std::size_t i = 0; i < eager.size(); ++i) CHECK(graph[i] == doctest::Approx(eager[i]).epsilon(1e-4));
}

// The README's non-generic construct, accepted in a Cell<Net, PYNATIVE_MODE> only.
struct OfTensors : nn::Cell<OfTensors, PYNATIVE_MODE> {
  nn::Dense<3, 2> fc;
  DUET_CELL_MEMBERS(fc);
  Tensor construct(const Tensor& x) { return fc(x); }
};
struct Generic : nn::Cell<Generic, PYNATIVE_MODE> {
  nn::Dense<3, 2> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

// A PyNative cell may reassign x (each operation's result is a Tensor): wrapped for training,
// its graph form must not be compiled, whatever the context says.
struct Reassigning : nn::Cell<Reassigning, PYNATIVE_MODE> {
  nn::Dense<3, 4> fc1;
  nn::Dense<4, 2> fc2;
  DUET_CELL_MEMBERS(fc1, fc2);
  auto construct(auto x) {
    x = fc1(x);
    x = ops::relu(x);
    return fc2(x);
  }
};
struct NewNames : nn::Cell<NewNames> {
  nn::Dense<3, 4> fc1;
  nn::Dense<4, 2> fc2;
  DUET_CELL_MEMBERS(fc1, fc2);
  auto construct(auto x) { return fc2(ops::relu(fc1(x))); }
};

TEST_CASE("a PyNative cell that reassigns x trains and takes gradients in a graph-mode context, as its generic twin") {
  ModeGuard guard;
  const Tensor x = randn({4, 3}, 5);
  const Tensor y = ones({4, 2});
  const auto losses = [&](auto& net) {
    nn::MSELoss<> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
    nn::TrainOneStepCell step(with_loss, sgd);
    std::vector<float> out;
    for (int i = 0; i < 3; ++i) out.push_back(step(x, y).item());
    auto [value, grads] = value_and_grad(with_loss, net.parameters())(x, y);
    out.push_back(value.item());
    for (const auto& g : grads) out.insert(out.end(), g.data(), g.data() + g.size());
    return out;
  };
  set_seed(3);
  Reassigning reassigning;
  set_seed(3);
  NewNames twin;
  set_context({.mode = PYNATIVE_MODE});
  const auto expected = losses(twin);
  set_context({.mode = GRAPH_MODE});
  const auto got = losses(reassigning);
  CHECK(got == expected);
  CHECK(got[2] < got[0]);
}

TEST_CASE("a PyNative cell whose construct takes tensors trains, as its generic twin does") {
  const auto losses = [](auto& net) {
    nn::MSELoss<> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
    nn::TrainOneStepCell step(with_loss, sgd);
    std::vector<float> out;
    for (int i = 0; i < 3; ++i) out.push_back(step(randn({4, 3}, 5), ones({4, 2})).item());
    return out;
  };
  set_seed(3);
  OfTensors of_tensors;
  set_seed(3);
  Generic generic;
  const auto got = losses(of_tensors);
  CHECK(got == losses(generic));
  CHECK(got.back() < got.front());
  CHECK(grad(of_tensors, of_tensors.parameters())(ones({1, 3})).size() == 2);
}

TEST_CASE("a graph-mode cell under a PyNative grad runs eagerly, so the tape reaches its parameters") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  set_seed(8);
  SmallIn<GRAPH_MODE> graph_net;
  set_seed(8);
  SmallIn<PYNATIVE_MODE> eager_net;
  const Tensor x = randn({4, 2, 4}, 9);
  // A plain function of tensors follows the context (PyNative here) and calls the graph-mode net.
  auto call = [](auto& net) { return [&net](const auto& input) { return net(input); }; };
  auto [gv, gg] = value_and_grad(call(graph_net), graph_net.parameters(), 0)(x);
  auto [ev, eg] = value_and_grad(call(eager_net), eager_net.parameters(), 0)(x);
  CHECK(duet_test::relative_difference(duet_test::values_of(gv), duet_test::values_of(ev)) <= 1e-6);
  REQUIRE(gg.size() == eg.size());
  for (std::size_t i = 0; i < gg.size(); ++i) {
    CHECK(duet_test::relative_difference(duet_test::values_of(gg[i]), duet_test::values_of(eg[i])) <= 1e-6);
  }
}

namespace {
// A network described at run time, as a config file would: "8-16-3" is Flatten, then Dense
// layers of those sizes with a ReLU between each two.
nn::DynamicSequentialCell network_from(const std::string& spec) {
  std::vector<index_t> sizes;
  std::size_t from = 0;
  while (from <= spec.size()) {
    const std::size_t dash = std::min(spec.find('-', from), spec.size());
    sizes.push_back(std::stoll(spec.substr(from, dash - from)));
    from = dash + 1;
  }
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) {
    net.append(nn::Dense<>(sizes[i], sizes[i + 1]));
    if (i + 2 < sizes.size()) net.append(nn::ReLU{});
  }
  return net;
}

// A DynamicCell of its own, with a forward of its own: no construct, no Cell<...>.
struct Handmade : nn::DynamicCell {
  nn::Dense<> first{8, 12};
  nn::ReLU relu;
  nn::Dense<> second{12, 3};
  void for_each_child(const ChildVisitor& visit) override {
    visit("first", first);
    visit("second", second);
  }
  std::string type_name() const override { return "Handmade"; }

 protected:
  Tensor forward(const Tensor& x) override { return second(relu(first(ops::flatten(x)))); }
};

template <class Net>
std::vector<float> train_runtime(Mode mode, Net& net, const Problem& data, int steps) {
  ModeGuard guard;
  set_context({.mode = mode});
  return sgd_losses(net, data, steps);
}
}  // namespace

TEST_CASE("a network built at run time trains with WithLossCell and TrainOneStepCell, in both modes") {
  const Problem data;
  std::vector<std::vector<float>> curves;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_seed(21);
    auto net = network_from("8-16-3");
    REQUIRE(net.size() == 4);
    const auto losses = train_runtime(mode, net, data, 60);
    CHECK(losses.back() < 0.5f * losses.front());
    curves.push_back(losses);
  }
  for (std::size_t i = 0; i < curves[0].size(); ++i) CHECK(curves[0][i] == curves[1][i]);
  set_seed(22);
  Handmade handmade;
  const auto losses = train_runtime(GRAPH_MODE, handmade, data, 60);
  CHECK(losses.back() < 0.5f * losses.front());
}

TEST_CASE("grad, value_and_grad and train::evaluate take a network built at run time, in both modes") {
  ModeGuard guard;
  const Problem data;
  set_seed(23);
  auto net = network_from("8-16-3");
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  // The same network as a Cell<...>, with the same weights, is the reference. Its layers have
  // compile-time sizes, whose kernels may round differently: equal to float rounding.
  set_seed(23);
  Small reference;
  nn::WithLossCell reference_loss(reference, loss);
  set_context({.mode = PYNATIVE_MODE});
  const auto expected = value_and_grad(reference_loss, reference.parameters())(data.x, data.y);
  const Tensor expected_dx = grad(reference)(data.x);
  const auto close = [](const Tensor& a, const Tensor& b) {
    return duet_test::relative_difference(duet_test::values_of(a), duet_test::values_of(b)) <= 1e-6;
  };
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    const auto got = value_and_grad(with_loss, net.parameters())(data.x, data.y);
    CHECK(close(got.value, expected.value));
    REQUIRE(got.grads.size() == expected.grads.size());
    for (std::size_t i = 0; i < got.grads.size(); ++i) CHECK(close(got.grads[i], expected.grads[i]));
    CHECK(close(grad(net)(data.x), expected_dx));
    BasicTensor<std::uint8_t> images{Shape{12, 2, 4}};
    BasicTensor<std::int32_t> labels{Shape{12}};
    for (index_t i = 0; i < 12; ++i) {
      labels(i) = static_cast<std::int32_t>(i % 3);
      for (index_t j = 0; j < 8; ++j) images.data()[i * 8 + j] = static_cast<std::uint8_t>((i * 37 + j * 11) % 256);
    }
    data::DataLoader loader(data::ImageDataset(images, labels, 3), 5);
    const auto m = train::evaluate(net, loss, loader);
    const auto r = train::evaluate(reference, loss, loader);
    CHECK(m.samples == 12);
    CHECK(m.loss == doctest::Approx(r.loss).epsilon(1e-6));
    CHECK(m.accuracy == r.accuracy);
  }
}

namespace {
struct StepRun {
  std::vector<float> losses;
  std::vector<std::vector<float>> parameters;
};

StepRun train_spec(Mode mode, const std::string& spec, const Problem& data, int steps) {
  set_seed(24);
  auto net = network_from(spec);
  const auto losses = train_runtime(mode, net, data, steps);
  StepRun run{losses, {}};
  for (const auto& p : net.parameters()) run.parameters.push_back(std::vector<float>(p.parameter->values().begin(), p.parameter->values().end()));
  return run;
}

std::size_t log_lines_with(std::size_t from, const std::string& text) {
  const auto log = jit_compile_log();
  std::size_t n = 0;
  for (std::size_t i = from; i < log.size(); ++i) n += log[i].find(text) != std::string::npos ? 1 : 0;
  return n;
}
}  // namespace

TEST_CASE("graph mode traces a runtime-built network's training step once and replays it, bit for bit") {
  const Problem data;
  const std::size_t log_before = jit_compile_log().size();
  const std::uint64_t before = jit_compile_count();
  const StepRun graph = train_spec(GRAPH_MODE, "8-16-12-3", data, 20);
  CHECK(jit_compile_count() == before + 1);  // one trace for 20 steps
  // The forward (Flatten, 3 x (MatMul, BiasAdd), 2 ReLU), the loss, the backward pass and its
  // gradient ops; O1 fuses each forward product with its bias and ReLU.
  CHECK(log_lines_with(log_before, "nn::WithLossCell forward and backward in graph mode") == 1);
  CHECK(log_lines_with(log_before, "traced ") == 1);
  const StepRun eager = train_spec(PYNATIVE_MODE, "8-16-12-3", data, 20);
  CHECK(graph.losses.back() < graph.losses.front());
  CHECK(graph.losses == eager.losses);
  CHECK(graph.parameters == eager.parameters);
}

TEST_CASE("a runtime-built network's training step traces again for a new batch size and a changed network") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  const Problem data;
  set_seed(25);
  auto net = network_from("8-6-3");
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  auto vg = value_and_grad(with_loss, net.parameters());
  const Tensor target = randn({96, 3}, 26);
  const std::uint64_t before = jit_compile_count();
  const std::size_t log_before = jit_compile_log().size();
  vg(data.x, target);
  vg(data.x, target);
  CHECK(jit_compile_count() == before + 1);
  const Tensor small_batch = randn({5, 2, 4}, 27);
  const Tensor small_target = randn({5, 3}, 28);
  vg(small_batch, small_target);
  CHECK(jit_compile_count() == before + 2);
  CHECK(log_lines_with(log_before, "argument 1 shape [96, 2, 4] -> [5, 2, 4]") == 1);
  // A layer appended after the trace: traced again, and the new layer gets its gradient.
  net.append(nn::ReLU{});
  net.append(nn::Dense<>(3, 3));
  CHECK(vg(small_batch, small_target).value.shape() == Shape{});
  CHECK(jit_compile_count() == before + 3);
  CHECK(log_lines_with(log_before, "argument 0 (a value) changed") == 1);
  const auto got = value_and_grad(with_loss, net.parameters())(small_batch, small_target);
  set_context({.mode = PYNATIVE_MODE});
  const auto expected = value_and_grad(with_loss, net.parameters())(small_batch, small_target);
  CHECK(got.value.item() == expected.value.item());
  REQUIRE(got.grads.size() == 6);
  for (std::size_t i = 0; i < got.grads.size(); ++i) CHECK(duet_test::values_of(got.grads[i]) == duet_test::values_of(expected.grads[i]));
}

TEST_CASE("a training step with a hook runs eagerly in graph mode, and the compile log says so") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  const Problem data;
  // A hook: every step runs eagerly, the hook sees each, and the log names the cell once.
  set_seed(27);
  auto net = network_from("8-16-3");
  int hook_calls = 0;
  net[1].register_forward_hook([&](const nn::DynamicCell&, const Tensor&, const Tensor&) { ++hook_calls; });
  const std::size_t log_before = jit_compile_log().size();
  const auto graph = train_runtime(GRAPH_MODE, net, data, 3);
  CHECK(hook_calls == 3);
  CHECK(log_lines_with(log_before, "graph break, runs eagerly: nn::Dense<dyn, dyn> '1' has a hook") == 1);
  set_seed(27);
  auto eager_net = network_from("8-16-3");
  CHECK(train_runtime(PYNATIVE_MODE, eager_net, data, 3) == graph);
}

namespace {
// A learned scale read in construct but left out of DUET_CELL_MEMBERS (a new user's slip).
struct Unlisted : nn::Cell<Unlisted> {
  nn::Dense<6, 4> fc;
  nn::Parameter w{ones({4})};
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x) * w; }
};
struct WithNorm : nn::Cell<WithNorm> {
  nn::Dense<6, 4> fc;
  nn::BatchNorm1d<4> bn;
  DUET_CELL_MEMBERS(fc, bn);
  auto construct(auto x) { return bn(fc(x)); }
};
}  // namespace

TEST_CASE("training that would do nothing is an error: weights of another network, a parameter nobody registered, an empty batch") {
  ModeGuard guard;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    const Tensor x = randn({8, 6}, 3);
    const Tensor y = randn({8, 4}, 4);
    nn::MSELoss<> loss;

    WithNorm net1;
    WithNorm net2;
    nn::WithLossCell with_loss(net2, loss);
    nn::Adam adam(net1.parameters(), {.learning_rate = 1e-2});
    nn::TrainOneStepCell step(with_loss, adam);
    const auto before = duet_test::values_of(net2.bn.moving_mean);
    CHECK_THROWS_WITH_AS(step(x, y),
                         "nn::TrainOneStepCell: no gradient reaches any of the 4 trainable parameters it is "
                         "differentiated with respect to, so every gradient would be zero and training would do nothing; are they another "
                         "network's (an optimizer made over net1.parameters() training net2), or read only through "
                         "ops::stop_gradient?",
                         ValueError);
    CHECK(duet_test::values_of(net2.bn.moving_mean) == before);  // the failed step changed nothing
    CHECK_THROWS_WITH_AS(value_and_grad(with_loss, net1.parameters())(x, y),
                         doctest::Contains("duet::value_and_grad: no gradient reaches any of the 4 trainable parameters"),
                         ValueError);

    Unlisted unlisted;
    nn::WithLossCell unlisted_loss(unlisted, loss);
    nn::SGD sgd(unlisted.parameters(), {.learning_rate = 0.5});
    nn::TrainOneStepCell unlisted_step(unlisted_loss, sgd);
    const std::string message = "a parameter of shape [4] gets a gradient but is not a parameter of ";
    CHECK_THROWS_WITH_AS(unlisted_step(x, y), doctest::Contains(("nn::TrainOneStepCell: " + message).c_str()), ValueError);
    CHECK_THROWS_WITH_AS(value_and_grad(unlisted, unlisted.parameters())(x),
                         doctest::Contains("Unlisted (a construct reads it, but the cell that holds it does not list it in DUET_CELL_MEMBERS"), ValueError);
    // Listed in the weights, it is differentiated as asked.
    std::vector<nn::Parameter*> with_w{&unlisted.w};
    CHECK(value_and_grad(unlisted, with_w)(x).grads.size() == 1);

    // An empty batch: loss 0 and zero gradients, which an optimiser would still apply.
    nn::WithLossCell own_loss(net1, loss);
    CHECK_THROWS_WITH_AS(value_and_grad(own_loss, net1.parameters())(Tensor({0, 6}), Tensor({0, 4})),
                         doctest::Contains("duet::value_and_grad: the batch is empty"), ValueError);
  }
}

TEST_CASE("a training step after a manual set_train(false) is refused, not run in evaluation") {
  ModeGuard guard;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    WithNorm net;
    nn::MSELoss<> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
    nn::TrainOneStepCell step(with_loss, sgd);
    const Tensor x = randn({8, 6}, 5);
    const Tensor y = randn({8, 4}, 6);
    step(x, y);
    net.set_train(false);
    (void)net(x);  // a validation pass
    CHECK_THROWS_WITH_AS(step(x, y),
                         doctest::Contains("nn::TrainOneStepCell: nn::BatchNorm1d<4> 'bn' is set to evaluate "
                                           "(set_train(false) since this step was made)"),
                         ModeError);
    net.set_train(true);
    CHECK(std::isfinite(step(x, y).item()));
  }
}

TEST_CASE("a frozen BatchNorm kept in evaluation trains the rest, both modes the same bits, its statistics unmoved") {
  // PyTorch's fine-tuning recipe: freeze a layer, then model.train(); layer.eval().
  ModeGuard guard;
  const Tensor x = randn({8, 6}, 5);
  const Tensor y = randn({8, 4}, 6);
  std::vector<std::vector<float>> runs;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    set_seed(9);
    WithNorm net;
    nn::MSELoss<> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
    nn::TrainOneStepCell step(with_loss, sgd);
    step(x, y);  // moves the statistics once, in training
    const Tensor mean = net.bn.moving_mean.clone();
    const Tensor gamma = net.bn.gamma.clone();
    net.bn.set_requires_grad(false);
    net.bn.set_train(false);
    std::vector<float> run;
    for (int i = 0; i < 3; ++i) run.push_back(step(x, y).item());
    CHECK(run.back() < run.front());
    CHECK(std::ranges::equal(net.bn.moving_mean.values(), mean.values()));
    CHECK(std::ranges::equal(net.bn.gamma.values(), gamma.values()));
    CHECK_FALSE(net.bn.training());
    // Unfrozen, the same setting is a validation pass not undone: refused.
    net.bn.set_requires_grad(true);
    CHECK_THROWS_WITH_AS(step(x, y), doctest::Contains("'bn' is set to evaluate"), ModeError);
    run.insert(run.end(), net.fc.weight.values().begin(), net.fc.weight.values().end());
    runs.push_back(run);
  }
  CHECK(runs[0] == runs[1]);
}

TEST_CASE("a parameter frozen after its optimizer was made stays where it is, one unfrozen after is refused by name") {
  ModeGuard guard;
  std::vector<std::vector<float>> losses;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    const Tensor x = randn({4, 2, 4}, 5);
    const Tensor y = randn({4, 3}, 6);
    nn::MSELoss<> loss;
    set_seed(3);
    Small net;
    nn::WithLossCell with_loss(net, loss);
    nn::Adam adam(net.parameters(), {.learning_rate = 1e-2});
    nn::TrainOneStepCell step(with_loss, adam);
    std::vector<float> got{step(x, y).item()};  // graph mode captures with every parameter trained
    auto& frozen = net.layers.get<0>().weight;
    frozen.requires_grad = false;  // PyTorch's way: after the optimizer exists
    const auto kept = duet_test::values_of(frozen);
    const auto moving = duet_test::values_of(net.layers.get<2>().weight);
    for (int i = 0; i < 3; ++i) got.push_back(step(x, y).item());
    CHECK(duet_test::values_of(frozen) == kept);
    CHECK(duet_test::values_of(net.layers.get<2>().weight) != moving);
    losses.push_back(got);

    // Left out when the optimizer was made, a parameter cannot join it later.
    set_seed(3);
    Small later;
    later.layers.get<0>().bias.requires_grad = false;
    nn::WithLossCell later_loss(later, loss);
    nn::SGD sgd(later.parameters(), {.learning_rate = 0.1});
    nn::TrainOneStepCell later_step(later_loss, sgd);
    later_step(x, y);
    later.layers.get<0>().bias.requires_grad = true;
    const auto bias = duet_test::values_of(later.layers.get<0>().bias);
    CHECK_THROWS_WITH_AS(later_step(x, y),
                         "nn::SGD: parameter 'layers.0.bias' had requires_grad = false when the optimizer was made, so it "
                         "is not among the parameters it trains, and has requires_grad = true now; make the optimizer "
                         "after unfreezing it",
                         ValueError);
    CHECK(duet_test::values_of(later.layers.get<0>().bias) == bias);
  }
  CHECK(losses[0] == losses[1]);
}

namespace {
// A backbone to freeze and a head to fine-tune.
struct Tuned : nn::Cell<Tuned> {
  nn::SequentialCell<nn::Dense<4, 8>, nn::BatchNorm1d<8>, nn::ReLU> backbone;
  nn::Dense<8, 3> head;
  DUET_CELL_MEMBERS(backbone, head);
  auto construct(auto x) { return head(backbone(x)); }
};
}  // namespace

TEST_CASE("set_requires_grad freezes a sub-tree for fine-tuning, and leaves BatchNorm's statistics untrained") {
  ModeGuard guard;
  const Tensor x = randn({6, 4}, 5);
  const Tensor y = randn({6, 3}, 6);
  nn::MSELoss<> loss;
  std::vector<std::vector<float>> losses;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    set_seed(3);
    Tuned net;
    net.backbone.set_requires_grad(false);
    for (const auto& p : net.parameters()) CHECK(p.parameter->requires_grad == p.name.starts_with("head."));
    const auto backbone = duet_test::values_of(net.backbone.get<0>().weight);
    const auto head = duet_test::values_of(net.head.weight);
    nn::WithLossCell with_loss(net, loss);
    nn::Adam adam(net.parameters(), {.learning_rate = 1e-2});
    CHECK(adam.parameters().size() == 2);
    nn::TrainOneStepCell step(with_loss, adam);
    std::vector<float> got;
    for (int i = 0; i < 3; ++i) got.push_back(step(x, y).item());
    CHECK(duet_test::values_of(net.backbone.get<0>().weight) == backbone);
    CHECK(duet_test::values_of(net.head.weight) != head);
    losses.push_back(got);

    net.set_requires_grad(true);
    auto& bn = net.backbone.get<1>();
    CHECK(bn.gamma.requires_grad);
    CHECK(!bn.moving_mean.requires_grad);
    CHECK(!bn.moving_variance.requires_grad);
  }
  CHECK(losses[0] == losses[1]);
  nn::BatchNorm1d<> fixed(8, 1e-5, 0.9, /*affine=*/false);
  fixed.set_requires_grad(true);
  CHECK(!fixed.gamma.requires_grad);
}

TEST_CASE("clipping skips a parameter frozen after its optimizer was made, and a step with all frozen is refused") {
  ModeGuard guard;
  const Tensor x = randn({4, 2, 4}, 5);
  const Tensor y = randn({4, 3}, 6);
  nn::MSELoss<> loss;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    set_context({.mode = mode});
    // The first layer's weight frozen before the optimizer was made, and after: the same
    // norm and the same update, as PyTorch's clip_grad_norm_ sees only what is trained.
    std::vector<double> norms;
    std::vector<std::vector<double>> trained;
    for (const bool after : {false, true}) {
      set_seed(3);
      Small net;
      auto& frozen = net.layers.get<0>().weight;
      if (!after) frozen.requires_grad = false;
      nn::WithLossCell with_loss(net, loss);
      nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
      nn::TrainOneStepCell step(with_loss, sgd, {.clip_global_norm = 1e-3});
      if (after) frozen.requires_grad = false;
      step(x, y);
      norms.push_back(step.last_global_norm());
      trained.push_back(duet_test::values_of(net.layers.get<2>().weight));
    }
    CHECK(norms[0] == norms[1]);
    CHECK(trained[0] == trained[1]);

    // Everything frozen after the optimizer was made: a step would change nothing.
    set_seed(3);
    Small net;
    nn::WithLossCell with_loss(net, loss);
    nn::Adam adam(net.parameters(), {.learning_rate = 1e-2});
    nn::TrainOneStepCell step(with_loss, adam);
    for (const auto& p : net.parameters()) p.parameter->requires_grad = false;
    CHECK_THROWS_WITH_AS(step(x, y),
                         "nn::Adam: all 4 of its parameters have requires_grad = false (frozen since the optimizer was "
                         "made), so the step would change nothing; unfreeze some, or make an optimizer over the ones "
                         "to train",
                         ValueError);
    CHECK(adam.global_step() == 0);
  }
}

}  // namespace tests_nn_wrap
