// duet::io::load_onnx against PyTorch: tests/onnx_references.py exports the models and writes
// PyTorch's outputs into $DUET_ONNX_REFERENCES (CTest runs it first); without them (no torch)
// those cases report themselves skipped. The error cases build their models here with the ONNX
// library's protobuf classes. duet::io::export_onnx's models are read back by load_onnx and
// checked by tests/onnx_check_export.py: onnx.checker, and an evaluation of the file in numpy.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <duet/duet.hpp>
#include <duet/io/onnx.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "../examples/lenet5.hpp"
#include "../examples/network.hpp"
#include "../examples/resnet_fashion.hpp"
#include "support.hpp"

namespace {

namespace fs = std::filesystem;
using duet::Shape;
using duet::Tensor;

std::optional<fs::path> references() {
  const char* dir = std::getenv("DUET_ONNX_REFERENCES");
  if (dir == nullptr || !fs::exists(fs::path(dir) / "mlp_opset13.onnx")) return std::nullopt;
  return fs::path(dir);
}

#define REQUIRE_REFERENCES(dir)                                                                                     \
  const std::optional<fs::path> dir = references();                                                                 \
  if (!dir) {                                                                                                       \
    MESSAGE("SKIPPED: no PyTorch references (DUET_ONNX_REFERENCES unset or empty: tests/onnx_references.py needs " \
            "python3-torch and python3-onnx)");                                                                     \
    return;                                                                                                         \
  }

Tensor read_floats(const fs::path& path, const Shape& shape) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in);
  std::vector<float> data(static_cast<std::size_t>(shape.numel()));
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(data.size() * sizeof(float)));
  REQUIRE(in.gcount() == static_cast<std::streamsize>(data.size() * sizeof(float)));
  return Tensor(shape, std::span<const float>(data));
}

struct Reference {
  std::string name;
  Shape input;
  std::vector<int> opsets = {13, 17};
};
const std::vector<Reference> models{
    {"mlp", {4, 1, 28, 28}},  {"lenet5", {4, 1, 28, 28}},    {"resnet", {4, 1, 28, 28}},
    {"operators", {4, 16}},   {"temporal", {4, 3, 12}},      {"norms", {4, 16}, {17}},
    {"recurrent", {4, 7, 4}}, {"pools", {4, 2, 13, 11}},     {"attention", {4, 7, 16}},
    {"attention_static", {4, 7, 16}}, {"encoder", {4, 7, 16}}, {"encoder_static", {4, 7, 16}}};

// Within 1e-5 of the largest magnitude in PyTorch's output.
void check_close(const Tensor& got, const Tensor& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  float scale = 0;
  for (duet::index_t i = 0; i < want.numel(); ++i) scale = std::max(scale, std::abs(want.data()[i]));
  for (duet::index_t i = 0; i < want.numel(); ++i) {
    INFO("element " << i << ": duet " << got.data()[i] << ", PyTorch " << want.data()[i]);
    CHECK(std::abs(got.data()[i] - want.data()[i]) <= 1e-5f * scale);
  }
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::equal(a.data(), a.data() + a.numel(), b.data());
}

struct ModeScope {
  explicit ModeScope(duet::Mode m) { duet::set_context({.mode = m}); }
  ~ModeScope() { duet::set_context({.mode = duet::PYNATIVE_MODE}); }
};

TEST_CASE("io::load_onnx: PyTorch's models give PyTorch's outputs in both modes, bit for bit between them") {
  REQUIRE_REFERENCES(dir);
  for (const Reference& r : models) {
    const Tensor x = read_floats(*dir / (r.name + ".input.bin"), r.input);
    for (const int opset : r.opsets) {
      const std::string file = r.name + "_opset" + std::to_string(opset) + ".onnx";
      duet::io::OnnxModel eager = duet::io::load_onnx(*dir / file);
      const Tensor want = read_floats(*dir / (r.name + ".output.bin"), eager(x).shape());
      const Tensor pynative = eager(x);
      check_close(pynative, want, file + " in PyNative mode");

      duet::io::OnnxModel traced = duet::io::load_onnx(*dir / file);
      ModeScope graph(duet::GRAPH_MODE);
      const auto log_before = duet::jit_compile_log().size();
      const Tensor first = traced(x);
      const Tensor replayed = traced(x);
      CHECK(duet::jit_compile_log().size() == log_before + 1);
      CHECK(duet::jit_compile_log().back().find("io::OnnxModel in graph mode") != std::string::npos);
      CHECK(same_bits(first, pynative));
      CHECK(same_bits(replayed, pynative));
    }
  }
}

TEST_CASE("io::load_onnx: PyTorch's attention, exported with a dynamic batch and length, takes others") {
  REQUIRE_REFERENCES(dir);
  for (const std::string name : {"attention", "encoder"}) {
    for (const int opset : {13, 17}) {
      const std::string file = name + "_opset" + std::to_string(opset) + ".onnx";
      duet::io::OnnxModel eager = duet::io::load_onnx(*dir / file);
      duet::io::OnnxModel traced = duet::io::load_onnx(*dir / file);
      for (const auto& [batch, length] : {std::pair{2, 7}, {4, 3}, {1, 5}}) {
        const std::string tag = name + "." + std::to_string(batch) + "x" + std::to_string(length);
        const Tensor x = read_floats(*dir / (tag + ".input.bin"), {batch, length, 16});
        const Tensor pynative = eager(x);
        check_close(pynative, read_floats(*dir / (tag + ".output.bin"), {batch, length, 16}), file + " on " + tag);
        ModeScope graph(duet::GRAPH_MODE);
        CHECK(same_bits(traced(x), pynative));
        CHECK(same_bits(traced(x), pynative));
      }
    }
  }
  // The static export refuses another length, as the file declares its input.
  duet::io::OnnxModel fixed = duet::io::load_onnx(*dir / "attention_static_opset17.onnx");
  CHECK_THROWS_AS(fixed(duet::ones({4, 3, 16})), duet::ShapeError);
}

// PyTorch's int64 token ids (onnx_references.py's text.ids.bin), and the same as int32.
duet::BasicTensor<std::int64_t> read_ids(const fs::path& path, const Shape& shape) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in);
  duet::BasicTensor<std::int64_t> ids = duet::zeros<std::int64_t>(shape);
  in.read(reinterpret_cast<char*>(ids.data()), static_cast<std::streamsize>(ids.numel() * sizeof(std::int64_t)));
  REQUIRE(in.gcount() == static_cast<std::streamsize>(ids.numel() * sizeof(std::int64_t)));
  return ids;
}
duet::BasicTensor<std::int32_t> as_int32(const duet::BasicTensor<std::int64_t>& ids64) {
  duet::BasicTensor<std::int32_t> ids = duet::zeros<std::int32_t>(ids64.shape());
  for (duet::index_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>(ids64.data()[i]);
  return ids;
}

TEST_CASE("io::load_onnx: PyTorch's text classifier of int64 token ids takes int32 or int64 ids, and trains") {
  REQUIRE_REFERENCES(dir);
  const duet::BasicTensor<std::int64_t> ids64 = read_ids(*dir / "text.ids.bin", {4, 7});
  const duet::BasicTensor<std::int32_t> ids = as_int32(ids64);
  const Tensor want = read_floats(*dir / "text.output.bin", {4, 3});
  for (const int opset : {13, 17}) {
    const std::string file = "text_opset" + std::to_string(opset) + ".onnx";
    duet::io::OnnxModel eager = duet::io::load_onnx(*dir / file);
    CHECK(eager.other_input_type() == "Int32");
    CHECK(eager.operators() == std::vector<std::string>{"Gather", "ReduceMean", "Gemm", "Relu", "Gemm"});
    const Tensor pynative = eager(ids);
    check_close(pynative, want, file + " in PyNative mode");
    float largest = 0;
    for (duet::index_t i = 0; i < want.numel(); ++i)
      largest = std::max(largest, std::abs(pynative.data()[i] - want.data()[i]));
    MESSAGE(file << ": largest difference from PyTorch " << largest);
    CHECK(same_bits(eager(ids64), pynative));
    duet::nn::DynamicCell& cell = eager;
    CHECK(same_bits(cell(ids), pynative));

    duet::io::OnnxModel traced = duet::io::load_onnx(*dir / file);
    {
      ModeScope graph(duet::GRAPH_MODE);
      const auto log_before = duet::jit_compile_log().size();
      CHECK(same_bits(traced(ids), pynative));
      CHECK(same_bits(traced(ids64), pynative));
      CHECK(duet::jit_compile_log().size() == log_before + 1);
    }
  }
  // A few training steps, the same bits in both modes.
  duet::BasicTensor<std::int32_t> labels = duet::zeros<std::int32_t>({4});
  for (duet::index_t i = 0; i < 4; ++i) labels.data()[i] = static_cast<std::int32_t>(i % 3);
  std::vector<std::vector<float>> losses;
  std::vector<std::vector<std::vector<double>>> weights;
  for (const duet::Mode m : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    ModeScope mode(m);
    duet::io::OnnxModel net = duet::io::load_onnx(*dir / "text_opset17.onnx");
    duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
    duet::nn::WithLossCell with_loss(net, loss);
    duet::nn::SGD sgd(net.parameters(), {.learning_rate = 0.5});
    duet::nn::TrainOneStepCell step(with_loss, sgd);
    losses.emplace_back();
    for (int k = 0; k < 3; ++k) losses.back().push_back(step(ids, labels).item());
    weights.emplace_back();
    for (const auto& p : net.parameters()) weights.back().push_back(duet_test::values_of(*p.parameter));
  }
  CHECK(losses[0] == losses[1]);
  CHECK(weights[0] == weights[1]);
  CHECK(losses[0][2] < losses[0][0]);
}

TEST_CASE("io::load_onnx: PyTorch's position embedding of torch.arange (Shape, Gather, Cast, Range) in both modes") {
  REQUIRE_REFERENCES(dir);
  const duet::BasicTensor<std::int64_t> ids64 = read_ids(*dir / "text.ids.bin", {4, 7});
  const duet::BasicTensor<std::int32_t> ids = as_int32(ids64);
  const Tensor want = read_floats(*dir / "positions.output.bin", {4, 3});
  for (const int opset : {13, 17}) {
    const std::string file = "positions_opset" + std::to_string(opset) + ".onnx";
    duet::io::OnnxModel net = duet::io::load_onnx(*dir / file);
    CHECK(net.operators() == std::vector<std::string>{"Gather", "Gather", "Add", "ReduceMean", "Gemm"});
    const Tensor pynative = net(ids);
    check_close(pynative, want, file + " in PyNative mode");
    CHECK(same_bits(net(ids64), pynative));
    ModeScope graph(duet::GRAPH_MODE);
    CHECK(same_bits(net(ids64), pynative));
    CHECK(same_bits(net(ids), pynative));
  }
  // The Range read other than as a Gather's indices.
  onnx::ModelProto model;
  {
    std::ifstream in(*dir / "positions_opset17.onnx", std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  std::string range;
  for (const auto& node : model.graph().node())
    if (node.op_type() == "Range") range = node.output(0);
  auto* relu = model.mutable_graph()->add_node();
  relu->set_op_type("Relu");
  relu->set_name("relu_of_range");
  relu->add_input(range);
  relu->add_output("relu_out");
  const std::string bytes = model.SerializeAsString();
  const std::string expected = "'relu_of_range' (Relu) reads '" + range +
                               "', a Range, which duet reads only as the indices of a Gather along axis 0";
  CHECK_THROWS_WITH_AS(duet::io::load_onnx_bytes(std::as_bytes(std::span(bytes.data(), bytes.size()))),
                       doctest::Contains(expected.c_str()), duet::ValueError);
}

TEST_CASE(
    "io::load_onnx: a model of token ids refuses floats, ids past int32 or its table, and other readers of them") {
  REQUIRE_REFERENCES(dir);
  duet::io::OnnxModel net = duet::io::load_onnx(*dir / "text_opset17.onnx");
  CHECK_THROWS_WITH_AS(net(duet::ones({4, 7})),
                       "io::OnnxModel takes int32 indices (the model's input 'ids' [batch, length] holds token ids), "
                       "got a tensor of Float32",
                       duet::ValueError);
  duet::BasicTensor<std::int64_t> ids = duet::zeros<std::int64_t>({2, 3});
  ids.data()[4] = std::int64_t{1} << 40;
  CHECK_THROWS_WITH_AS(net(ids),
                       "io::OnnxModel: token id 1099511627776 (element 4 of the int64 ids) does not fit int32, which "
                       "duet's indices are",
                       duet::IndexError);
  ids.data()[4] = 50;
  CHECK_THROWS_WITH_AS(
      net(ids),
      doctest::Contains("(Gather): ops::gather<0>: index 50 (element 4 of the indices) is out of range [0, 50)"),
      duet::IndexError);
  ids.data()[4] = -1;
  CHECK_THROWS_AS(net(ids), duet::IndexError);
  // Graph mode's replay of the trace names the node as the traced call (and PyNative mode) did.
  {
    ids.data()[4] = 50;
    std::string pynative;
    try {
      net(ids);
    } catch (const duet::IndexError& e) {
      pynative = e.what();
    }
    CHECK(pynative.starts_with("ONNX node '/embedding/Gather' (Gather): ops::gather<0>: index 50"));
    duet::io::OnnxModel traced = duet::io::load_onnx(*dir / "text_opset17.onnx");
    ModeScope graph(duet::GRAPH_MODE);
    ids.data()[4] = 1;
    const Tensor good = traced(ids);
    ids.data()[4] = 50;
    CHECK_THROWS_WITH_AS(traced(ids), pynative.c_str(), duet::IndexError);
    ids.data()[4] = 1;
    CHECK(same_bits(traced(ids), good));
  }
  // A float model refuses ids.
  duet::io::OnnxModel floats = duet::io::load_onnx(*dir / "mlp_opset17.onnx");
  duet::BasicTensor<std::int32_t> small = duet::zeros<std::int32_t>({4, 1, 28, 28});
  CHECK_THROWS_WITH_AS(floats(small), "io::OnnxModel takes tensors of Float32, got a tensor of Int32 (indices)",
                       duet::ValueError);
  // The ids read other than as a Gather's indices.
  onnx::ModelProto model;
  {
    std::ifstream in(*dir / "text_opset17.onnx", std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  auto* relu = model.mutable_graph()->add_node();
  relu->set_op_type("Relu");
  relu->set_name("relu_of_ids");
  relu->add_input("ids");
  relu->add_output("relu_out");
  const std::string bytes = model.SerializeAsString();
  CHECK_THROWS_WITH_AS(duet::io::load_onnx_bytes(std::as_bytes(std::span(bytes.data(), bytes.size()))),
                       doctest::Contains("reads the graph's input 'ids', token ids, which duet reads only as the "
                                         "indices of a Gather along axis 0 (an embedding)"),
                       duet::ValueError);
}

TEST_CASE("io::load_onnx: the initializers are the network's parameters, by their ONNX names") {
  REQUIRE_REFERENCES(dir);
  duet::io::OnnxModel mlp = duet::io::load_onnx(*dir / "mlp_opset17.onnx");
  std::vector<std::string> names;
  for (const auto& [name, p] : mlp.parameters()) names.push_back(name);
  CHECK(names == std::vector<std::string>{"dense_relu_sequential.0.weight", "dense_relu_sequential.0.bias",
                                          "dense_relu_sequential.2.weight", "dense_relu_sequential.2.bias",
                                          "dense_relu_sequential.4.weight", "dense_relu_sequential.4.bias"});
  CHECK(mlp.operators() == std::vector<std::string>{"Flatten", "Gemm", "Relu", "Gemm", "Relu", "Gemm"});

  duet::io::OnnxModel resnet = duet::io::load_onnx(*dir / "resnet_opset17.onnx");
  for (const auto& named : resnet.parameters()) {
    INFO(named.name);
    const bool statistic = named.name == "norm.running_mean" || named.name == "norm.running_var";
    CHECK(named.parameter->requires_grad == !statistic);
  }
  duet::io::OnnxModel operators = duet::io::load_onnx(*dir / "operators_opset13.onnx");
  CHECK(std::ranges::count(operators.operators(), "Gelu") == 1);  // torch's Erf pattern

  // torch's GRU and LSTM weights, in ONNX's layout, come in PyTorch's, B split in two.
  duet::io::OnnxModel recurrent = duet::io::load_onnx(*dir / "recurrent_opset17.onnx");
  std::vector<Shape> shapes;
  std::vector<std::string> recurrent_names;
  for (const auto& [name, p] : recurrent.parameters()) {
    shapes.push_back(p->shape());
    recurrent_names.push_back(name);
  }
  CHECK(std::ranges::count(shapes, Shape{18, 4}) == 1);  // the GRU's first W_ih
  CHECK(std::ranges::count(shapes, Shape{18, 6}) == 3);  // its second, and both W_hh
  CHECK(std::ranges::count(shapes, Shape{20, 5}) == 1);  // the LSTM's W_hh
  CHECK(std::ranges::count(shapes, Shape{20}) == 2);     // its two biases
  CHECK(std::ranges::count_if(recurrent_names, [](const std::string& n) { return n.ends_with(".bias_hh"); }) == 3);
  for (const char* op : {"GRU", "LSTM (last h)", "LSTM (last c)", "ConstantOfShape", "Gather"})
    CHECK(std::ranges::count(recurrent.operators(), op) > 0);
}

TEST_CASE("io::load_onnx: a loaded model trains, with the same losses and parameters in both modes") {
  REQUIRE_REFERENCES(dir);
  for (const std::string name : {"lenet5", "resnet", "operators", "temporal", "norms", "recurrent"}) {
    INFO(name);
    const Reference& r = *std::ranges::find(models, name, &Reference::name);
    const Tensor x = read_floats(*dir / (name + ".input.bin"), r.input);
    const duet::BasicTensor<std::int32_t> labels({4}, {1, 3, 5, 7});
    std::vector<std::vector<float>> losses(2);
    std::vector<std::vector<Tensor>> weights(2);
    for (const int m : {0, 1}) {
      ModeScope mode(m == 0 ? duet::PYNATIVE_MODE : duet::GRAPH_MODE);
      duet::io::OnnxModel net = duet::io::load_onnx(*dir / (name + "_opset17.onnx"));
      const Tensor before = Tensor(*net.parameters().front().parameter).clone();
      duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
      duet::nn::WithLossCell with_loss(net, loss);
      duet::nn::SGD sgd(net.parameters(), {.learning_rate = 0.05});
      duet::nn::TrainOneStepCell step(with_loss, sgd);
      for (int i = 0; i < 3; ++i) losses[static_cast<std::size_t>(m)].push_back(step(x, labels).item());
      for (const auto& [n, p] : net.parameters()) weights[static_cast<std::size_t>(m)].push_back(Tensor(*p).clone());
      CHECK_FALSE(same_bits(Tensor(*net.parameters().front().parameter), before));
    }
    CHECK(losses[0] == losses[1]);
    CHECK(losses[0].back() < losses[0].front());
    REQUIRE(weights[0].size() == weights[1].size());
    for (std::size_t i = 0; i < weights[0].size(); ++i) CHECK(same_bits(weights[0][i], weights[1][i]));
  }
}

// The C++ networks of examples/ with PyTorch's weights give PyTorch's outputs, in both modes.
template <class Net>
void check_weights_into(const fs::path& dir, const std::string& name) {
  const Reference& r = *std::ranges::find(models, name, &Reference::name);
  const Tensor x = read_floats(dir / (name + ".input.bin"), r.input);
  const Tensor want = read_floats(dir / (name + ".output.bin"), {4, 10});
  Net net;
  const duet::CheckpointLoad left = duet::io::load_onnx_weights(dir / (name + "_opset13.onnx"), net);
  CHECK(left.ckpt_not_load.empty());
  const Tensor pynative = net(x);
  check_close(pynative, want, name + " in C++, PyNative mode");
  ModeScope graph(duet::GRAPH_MODE);
  const Tensor in_graph = net(x);
  check_close(in_graph, want, name + " in C++, graph mode");
}

TEST_CASE("io::load_onnx_weights: PyTorch's weights in examples' seed network and LeNet-5 give PyTorch's outputs") {
  REQUIRE_REFERENCES(dir);
  check_weights_into<Network>(*dir, "mlp");
  check_weights_into<LeNet5>(*dir, "lenet5");
}

TEST_CASE("io::load_onnx_weights: a name or shape that does not fit names both, and copies nothing") {
  REQUIRE_REFERENCES(dir);
  LeNet5 net;
  const Tensor before = Tensor(net.conv1.weight).clone();
  const fs::path file = *dir / "lenet5_opset17.onnx";
  const std::string where = "ONNX file " + file.string() + ": ";
  CHECK_THROWS_WITH_AS(duet::io::load_onnx_weights(file, net, {{"fc1.weight", "fc2.weight"}}),
                       (where + "the network's parameter 'fc1.weight' [120, 400] does not fit initializer 'fc2.weight' [84, 120]").c_str(),
                       duet::FormatError);
  CHECK_THROWS_WITH_AS(duet::io::load_onnx_weights(file, net, {{"fc9.weight", "fc2.weight"}}),
                       (where + "the name map gives 'fc2.weight' for 'fc9.weight', which is not a parameter of LeNet5").c_str(),
                       duet::ValueError);
  CHECK_THROWS_WITH_AS(duet::io::load_onnx_weights(*dir / "mlp_opset17.onnx", net),
                       ("ONNX file " + (*dir / "mlp_opset17.onnx").string() +
                        ": the network's parameter 'conv1.weight' [6, 1, 5, 5] has no initializer 'conv1.weight' (give its name in the name map)").c_str(),
                       duet::FormatError);
  CHECK(same_bits(Tensor(net.conv1.weight), before));
}

TEST_CASE("io::load_onnx_weights: by an explicit name map, into a network built at run time") {
  REQUIRE_REFERENCES(dir);
  duet::nn::DynamicSequentialCell net;
  net.append(duet::nn::Dense<>(784, 512));
  net.append(duet::nn::ReLU{});
  net.append(duet::nn::Dense<>(512, 512));
  net.append(duet::nn::ReLU{});
  net.append(duet::nn::Dense<>(512, 10));
  std::map<std::string, std::string> map;
  for (const std::string layer : {"0", "2", "4"})
    for (const std::string what : {".weight", ".bias"}) map[layer + what] = "dense_relu_sequential." + layer + what;
  CHECK(duet::io::load_onnx_weights(*dir / "mlp_opset17.onnx", net, map).ckpt_not_load.empty());
  check_close(net(read_floats(*dir / "mlp.input.bin", {4, 784})), read_floats(*dir / "mlp.output.bin", {4, 10}),
              "the seed network built at run time");
}

TEST_CASE("io::load_onnx: the fuzzer's seed models load and run, the same in both modes") {
  // tests/fuzz/make_onnx_corpus.py: every operator the loader reads (gemm.onnx at opset 13, the rest 17).
  const fs::path corpus = fs::path(__FILE__).parent_path() / "fuzz" / "corpus" / "onnx";
  for (const std::string name : {"gemm", "conv", "gelu", "shape", "view", "slice", "recurrent"}) {
    INFO(name);
    duet::io::OnnxModel net = duet::io::load_onnx(corpus / (name + ".onnx"));
    Shape shape;
    for (const std::int64_t d : net.input_dims()) shape.push_back(d);
    const Tensor x = duet::randn(shape, 7);
    const Tensor eager = net(x);
    for (duet::index_t i = 0; i < eager.numel(); ++i) CHECK(std::isfinite(eager.data()[i]));
    duet::io::OnnxModel traced = duet::io::load_onnx(corpus / (name + ".onnx"));
    ModeScope graph(duet::GRAPH_MODE);
    CHECK(same_bits(traced(x), eager));
  }
}

TEST_CASE("io::load_onnx: the fuzzer's findings in its corpus are duet errors, never a crash") {
  // make_onnx_corpus.py's broken_*.onnx; each has its own case below, with its message.
  const fs::path corpus = fs::path(__FILE__).parent_path() / "fuzz" / "corpus" / "onnx";
  int seen = 0;
  for (const fs::directory_entry& file : fs::directory_iterator(corpus)) {
    if (!file.path().filename().string().starts_with("broken_")) continue;
    INFO(file.path().filename().string());
    ++seen;
    CHECK_THROWS_AS(duet::io::load_onnx(file.path())(duet::ones({1, 2, 6, 6})), duet::Error);
  }
  CHECK(seen == 9);
}

// --- errors, on models built here --------------------------------------------------------------

onnx::ModelProto model_of(int opset = 17) {
  onnx::ModelProto m;
  m.set_ir_version(8);
  auto* set = m.add_opset_import();
  set->set_domain("");
  set->set_version(opset);
  auto* g = m.mutable_graph();
  g->set_name("g");
  auto* in = g->add_input();
  in->set_name("x");
  in->mutable_type()->mutable_tensor_type()->set_elem_type(onnx::TensorProto::FLOAT);
  g->add_output()->set_name("y");
  return m;
}

onnx::NodeProto* add_node(onnx::ModelProto& m, const std::string& op, const std::string& name,
                          std::initializer_list<std::string> in, const std::string& out = "y") {
  onnx::NodeProto* n = m.mutable_graph()->add_node();
  n->set_op_type(op);
  n->set_name(name);
  for (const std::string& i : in) n->add_input(i);
  n->add_output(out);
  return n;
}

onnx::TensorProto* add_initializer(onnx::ModelProto& m, const std::string& name, std::initializer_list<std::int64_t> dims,
                                   std::size_t count) {
  onnx::TensorProto* t = m.mutable_graph()->add_initializer();
  t->set_name(name);
  t->set_data_type(onnx::TensorProto::FLOAT);
  for (const std::int64_t d : dims) t->add_dims(d);
  for (std::size_t i = 0; i < count; ++i) t->add_float_data(0.5f * static_cast<float>(i));
  return t;
}

onnx::AttributeProto* add_ints(onnx::NodeProto* n, const std::string& name, std::initializer_list<std::int64_t> v) {
  onnx::AttributeProto* a = n->add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (const std::int64_t i : v) a->add_ints(i);
  return a;
}

onnx::AttributeProto* add_int(onnx::NodeProto* n, const std::string& name, std::int64_t v) {
  onnx::AttributeProto* a = n->add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(v);
  return a;
}

duet::io::OnnxModel load(const onnx::ModelProto& m) {
  const std::string bytes = m.SerializeAsString();
  return duet::io::load_onnx_bytes(std::as_bytes(std::span(bytes)), "test.onnx");
}

// Running net on x is a ShapeError whose text begins with the node, and names no node again.
void check_shape_error_names_once(duet::io::OnnxModel& net, const Tensor& x, const std::string& node) {
  try {
    net(x);
    FAIL("no ShapeError");
  } catch (const duet::ShapeError& e) {
    const std::string what = e.what();
    CHECK(what.starts_with(node));
    CHECK(what.find("ONNX node", 1) == std::string::npos);
  }
}

template <class E>
std::string message_of(const onnx::ModelProto& m) {
  try {
    load(m);
  } catch (const E& e) {
    return e.what();
  }
  FAIL("no exception of the expected type");
  return "";
}

onnx::TensorProto* add_int64s(onnx::ModelProto& m, const std::string& name, std::initializer_list<std::int64_t> dims,
                              std::initializer_list<std::int64_t> values) {
  onnx::TensorProto* t = m.mutable_graph()->add_initializer();
  t->set_name(name);
  t->set_data_type(onnx::TensorProto::INT64);
  for (const std::int64_t d : dims) t->add_dims(d);
  for (const std::int64_t v : values) t->add_int64_data(v);
  return t;
}

TEST_CASE("io::load_onnx: a Gather of one index, Expand and ConstantOfShape on floats, and their limits") {
  {  // x[:, 1:2] (an index of rank 1 keeps the axis) times x[:, -1] (of rank 0, drops it)
    onnx::ModelProto m = model_of();
    add_int64s(m, "one", {1}, {1});
    add_int64s(m, "last", {}, {-1});
    add_int(add_node(m, "Gather", "keep", {"x", "one"}, "a"), "axis", 1);
    add_int(add_node(m, "Gather", "drop", {"x", "last"}, "b"), "axis", 1);
    add_node(m, "Mul", "product", {"a", "b"});
    duet::io::OnnxModel net = load(m);
    CHECK(same_bits(net(Tensor({2, 3}, {1, 2, 3, 4, 5, 6})), Tensor({2, 2}, {6, 12, 15, 30})));
    CHECK_THROWS_WITH_AS(net(Tensor({2, 1}, {1, 2})), doctest::Contains("index 1 of axis 1 of a tensor of shape [2, 1]"),
                         duet::IndexError);
  }
  {  // x [2, 1] expanded to [2, 3], plus a ConstantOfShape of 7
    onnx::ModelProto m = model_of();
    add_initializer(m, "w", {6}, 6);  // weights, which bound what a constant shape may ask for
    add_int64s(m, "shape", {2}, {2, 3});
    add_node(m, "Expand", "expand", {"x", "shape"}, "e");
    onnx::AttributeProto* value = add_node(m, "ConstantOfShape", "fill", {"shape"}, "c")->add_attribute();
    value->set_name("value");
    value->set_type(onnx::AttributeProto::TENSOR);
    value->mutable_t()->set_data_type(onnx::TensorProto::FLOAT);
    value->mutable_t()->add_dims(1);
    value->mutable_t()->add_float_data(7);
    add_node(m, "Add", "sum", {"e", "c"});
    duet::io::OnnxModel net = load(m);
    CHECK(same_bits(net(Tensor({2, 1}, {1, 2})), Tensor({2, 3}, {8, 8, 8, 9, 9, 9})));
  }
  {  // a constant shape larger than the file's weights
    onnx::ModelProto m = model_of();
    add_int64s(m, "shape", {2}, {1000, 1000});
    add_node(m, "ConstantOfShape", "fill", {"shape"});
    CHECK(message_of<duet::ValueError>(m) == "test.onnx: ONNX node 'fill' (ConstantOfShape): a shape of sizes [1000, 1000] "
                                             "(-1: read as it runs), more elements than the model's weights, is not supported");
  }
  {  // arithmetic on a whole Shape, whose length only the run knows
    onnx::ModelProto m = model_of();
    add_node(m, "Shape", "shape", {"x"}, "s");
    add_node(m, "Sub", "minus", {"s", "s"}, "d");
    add_node(m, "Reshape", "view", {"x", "d"});
    CHECK(message_of<duet::ValueError>(m) ==
          "test.onnx: ONNX node 'minus' (Sub): arithmetic on a whole Shape (duet "
          "reads a Shape's dimensions one by one, by Gather) is not supported");
  }
}

// x [n, c] -> Shape, Gather of both sizes; the second half of each row, a Slice at computed
// bounds c / divisor to c / divisor * 2 (torch's split of a packed projection), viewed as
// [(c - 2) / 2 + 1, n * 2 - n] by Add, Sub, Mul and Div of sizes and constants.
onnx::ModelProto size_arithmetic_model(std::int64_t divisor) {
  onnx::ModelProto m = model_of();
  add_int64s(m, "zero", {}, {0});
  add_int64s(m, "one", {}, {1});
  add_int64s(m, "axis0", {1}, {0});
  add_int64s(m, "axis1", {1}, {1});
  add_int64s(m, "two", {}, {2});
  add_int64s(m, "divisor", {}, {divisor});
  add_node(m, "Shape", "shape", {"x"}, "s");
  add_node(m, "Gather", "rows", {"s", "zero"}, "n");
  add_node(m, "Gather", "cols", {"s", "one"}, "c");
  add_node(m, "Div", "half", {"c", "divisor"}, "h");
  add_node(m, "Unsqueeze", "start", {"h", "axis0"}, "h1");
  add_node(m, "Mul", "end", {"h1", "two"}, "e1");
  add_node(m, "Slice", "second", {"x", "h1", "e1", "axis1"}, "b");
  add_node(m, "Mul", "twice", {"n", "two"}, "n2");
  add_node(m, "Sub", "once", {"n2", "n"}, "n1");
  add_node(m, "Sub", "less", {"c", "two"}, "c2");
  add_node(m, "Div", "halve", {"c2", "two"}, "c3");
  add_node(m, "Add", "plus", {"c3", "one"}, "c4");
  add_node(m, "Unsqueeze", "u0", {"c4", "axis0"}, "d0");
  add_node(m, "Unsqueeze", "u1", {"n1", "axis0"}, "d1");
  add_int(add_node(m, "Concat", "target", {"d0", "d1"}, "t"), "axis", 0);
  add_node(m, "Reshape", "view", {"b", "t"});
  return m;
}

TEST_CASE("io::load_onnx: Add, Sub, Mul and Div of sizes, and a Slice at computed bounds") {
  duet::io::OnnxModel net = load(size_arithmetic_model(2));
  const Tensor x({2, 6}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  const Tensor want({3, 2}, {3, 4, 5, 9, 10, 11});
  CHECK(same_bits(net(x), want));
  const Tensor wide({1, 8}, {0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(same_bits(net(wide), Tensor({4, 1}, {4, 5, 6, 7})));
  {
    ModeScope graph(duet::GRAPH_MODE);
    CHECK(same_bits(net(x), want));
    CHECK(same_bits(net(wide), Tensor({4, 1}, {4, 5, 6, 7})));
    CHECK(same_bits(net(x), want));
  }
  // A size divided by zero as the model runs names the node that reads it; constants, at load.
  duet::io::OnnxModel by_zero = load(size_arithmetic_model(0));
  CHECK_THROWS_WITH_AS(by_zero(x),
                       "ONNX node 'second' (Slice): shape arithmetic 6 / 0 divides by zero or overflows int64",
                       duet::ShapeError);
  onnx::ModelProto constants = model_of();
  add_int64s(constants, "six", {1}, {6});
  add_int64s(constants, "zero", {}, {0});
  add_node(constants, "Div", "ratio", {"six", "zero"}, "r");
  add_node(constants, "Reshape", "view", {"x", "r"});
  CHECK(message_of<duet::FormatError>(constants) ==
        "test.onnx: ONNX node 'ratio' (Div): 6 / 0 divides by zero or overflows int64");
  // A float operation reading a size is not shape arithmetic.
  onnx::ModelProto mixed = model_of();
  add_node(mixed, "Shape", "shape", {"x"}, "s");
  add_node(mixed, "Relu", "act", {"s"});
  CHECK(message_of<duet::ValueError>(mixed).find("ONNX node 'act' (Relu) reads 's', an int64 tensor") !=
        std::string::npos);
}

TEST_CASE("io::load_onnx: a model built here runs, and reads its attributes") {
  onnx::ModelProto m = model_of();
  add_initializer(m, "w", {3, 2}, 6);
  add_initializer(m, "b", {3}, 3);
  onnx::NodeProto* gemm = add_node(m, "Gemm", "fc", {"x", "w", "b"}, "h");
  auto* tb = gemm->add_attribute();
  tb->set_name("transB");
  tb->set_type(onnx::AttributeProto::INT);
  tb->set_i(1);
  auto* alpha = gemm->add_attribute();
  alpha->set_name("alpha");
  alpha->set_type(onnx::AttributeProto::FLOAT);
  alpha->set_f(2.0f);
  add_node(m, "Sigmoid", "act", {"h"});
  duet::io::OnnxModel net = load(m);
  const Tensor y = net(Tensor({1, 2}, {1.f, -1.f}));
  // w = [[0, .5], [1, 1.5], [2, 2.5]], b = [0, .5, 1]: 2 * x.w^T + b = [-1, -0.5, 0]
  const Tensor want = duet::ops::sigmoid(Tensor({1, 3}, {-1.f, -0.5f, 0.f}));
  CHECK(same_bits(y, want));
}

TEST_CASE("io::load_onnx: a Transpose without perm reverses the axes, of an initializer too") {
  onnx::ModelProto m = model_of();
  add_initializer(m, "w", {3, 2}, 6);  // [[0, .5], [1, 1.5], [2, 2.5]]
  add_node(m, "Transpose", "wt", {"w"}, "w_t");
  add_node(m, "MatMul", "mm", {"x", "w_t"}, "h");  // x [.., 2] . w^T [2, 3]
  add_node(m, "Transpose", "t", {"h"});            // no perm: [2, 4, 3] -> [3, 4, 2]
  duet::io::OnnxModel net = load(m);
  const Tensor x = duet::randn({2, 4, 2}, 3);
  const Tensor w({3, 2}, {0.f, .5f, 1.f, 1.5f, 2.f, 2.5f});
  const Tensor want = duet::ops::transpose<2, 1, 0>(duet::ops::matmul(x, duet::ops::transpose<1, 0>(w)));
  CHECK(same_bits(net(x), want));
  ModeScope graph(duet::GRAPH_MODE);
  CHECK(same_bits(net(x), want));
}

TEST_CASE("io::load_onnx: LeakyRelu and Elu take ONNX's alpha, and its defaults") {
  const auto model = [](const std::string& op, std::optional<float> alpha) {
    onnx::ModelProto m = model_of();
    onnx::NodeProto* n = add_node(m, op, "act", {"x"});
    if (alpha) {
      onnx::AttributeProto* a = n->add_attribute();
      a->set_name("alpha");
      a->set_type(onnx::AttributeProto::FLOAT);
      a->set_f(*alpha);
    }
    return m;
  };
  const Tensor x({1, 4}, {-2.f, -0.5f, 0.f, 3.f});
  CHECK(same_bits(load(model("LeakyRelu", std::nullopt))(x), duet::ops::leaky_relu(x, 0.01f)));
  CHECK(same_bits(load(model("LeakyRelu", 0.3f))(x), duet::ops::leaky_relu(x, 0.3f)));
  CHECK(same_bits(load(model("Elu", std::nullopt))(x), duet::ops::elu(x, 1.0)));
  CHECK(same_bits(load(model("Elu", 0.7f))(x), duet::ops::elu(x, 0.7f)));
  CHECK(load(model("Elu", 0.7f))(x)(0, 0) == doctest::Approx(0.7 * std::expm1(-2.0)));
  // duet differentiates them from their output, which a negative slope makes ambiguous.
  CHECK(message_of<duet::ValueError>(model("LeakyRelu", -0.1f)).starts_with(
      "test.onnx: ONNX node 'act' (LeakyRelu): alpha must be at least 0"));
}

TEST_CASE("io::load_onnx: an input must have the shape the file declares, any size where it names a dimension") {
  onnx::ModelProto m = model_of();
  auto* shape = m.mutable_graph()->mutable_input(0)->mutable_type()->mutable_tensor_type()->mutable_shape();
  shape->add_dim()->set_dim_param("batch");
  shape->add_dim()->set_dim_value(3);
  add_node(m, "Relu", "r", {"x"});
  duet::io::OnnxModel net = load(m);
  CHECK(net.input_dims() == std::vector<std::int64_t>{-1, 3});
  CHECK(net(duet::ones({5, 3})).shape() == Shape{5, 3});
  CHECK_THROWS_WITH_AS(net(duet::ones({5, 4})), "io::OnnxModel: the model's input 'x' [batch, 3], as the file declares it, got [5, 4]",
                       duet::ShapeError);
  CHECK_THROWS_WITH_AS(net(duet::ones({1, 5, 3})),
                       "io::OnnxModel: the model's input 'x' [batch, 3], as the file declares it, got [1, 5, 3]", duet::ShapeError);
  ModeScope graph(duet::GRAPH_MODE);
  CHECK_THROWS_AS(net(duet::ones({2, 4})), duet::ShapeError);
  // A batch fixed by the exporter says how to free it.
  shape->mutable_dim(0)->set_dim_value(2);
  duet::io::OnnxModel fixed = load(m);
  CHECK(fixed(duet::ones({2, 3})).shape() == Shape{2, 3});
  CHECK_THROWS_WITH_AS(
      fixed(duet::ones({5, 3})),
      "io::OnnxModel: the model's input 'x' [2, 3], as the file declares it, got [5, 3] (a model exported "
      "with dynamic_axes={'input': {0: 'batch'}} by torch, or {.dynamic_batch = true} by "
      "duet::io::export_onnx, takes any batch)",
      duet::ShapeError);
}

TEST_CASE("io::load_onnx: a Reshape to sizes read from a Shape, as torch writes x.view(x.size(0), -1), follows the batch") {
  // Shape -> Gather(0) -> Unsqueeze -> Concat with [-1] -> Reshape, and Cast, Squeeze on the way.
  const auto model = [](std::int64_t index, bool whole_shape_in_concat = false) {
    onnx::ModelProto m = model_of();
    const auto ints = [&](const std::string& name, std::vector<std::int64_t> v) {
      onnx::AttributeProto* a = add_node(m, "Constant", name, {}, name)->add_attribute();
      a->set_name("value_ints");
      a->set_type(onnx::AttributeProto::INTS);
      for (const std::int64_t i : v) a->add_ints(i);
    };
    add_node(m, "Relu", "relu", {"x"}, "h");
    add_node(m, "Shape", "shape", {"h"}, "s");
    ints("index", {index});
    ints("axes", {0});
    ints("rest", {-1});
    add_node(m, "Gather", "gather", {"s", "index"}, "b");
    add_int(add_node(m, "Cast", "cast", {"b"}, "b64"), "to", onnx::TensorProto::INT64);
    add_node(m, "Squeeze", "squeeze", {"b64", "axes"}, "bs");
    add_node(m, "Unsqueeze", "unsqueeze", {"bs", "axes"}, "b1");
    add_int(add_node(m, "Concat", "concat", {whole_shape_in_concat ? "s" : "b1", "rest"}, "to"), "axis", 0);
    add_node(m, "Reshape", "view", {"h", "to"});
    return m;
  };
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    ModeScope scope(mode);
    duet::io::OnnxModel net = load(model(0));
    CHECK(net.operators() == std::vector<std::string>{"Relu", "Reshape"});
    for (const duet::index_t batch : {4, 2, 4}) {
      const Tensor x = duet::randn({batch, 3, 2, 2}, 5);
      const Tensor y = net(x);
      CHECK(y.shape() == Shape{batch, 12});
      CHECK(same_bits(y, duet::ops::relu(x).reshape({batch, 12})));
    }
    // Dimension -4 of a rank-4 input is its first; -5 is none, found when it runs.
    CHECK(net(duet::ones({3, 1, 1, 2})).shape() == Shape{3, 2});
    duet::io::OnnxModel past = load(model(-5));
    CHECK_THROWS_WITH_AS(past(duet::ones({3, 1, 1, 2})),
                         "ONNX node 'view' (Reshape): a Gather of dimension -5 of a Shape of [3, 1, 1, 2]", duet::ShapeError);
  }
  CHECK(message_of<duet::FormatError>(model(9)) == "test.onnx: ONNX node 'gather' (Gather): index 9 of a Shape");
  CHECK(message_of<duet::ValueError>(model(0, true)) ==
        "test.onnx: ONNX node 'concat' (Concat): concatenating a whole Shape (duet reads a Shape's dimensions one by one, by "
        "Gather) is not supported");
  // A chain of Concats of a list with itself doubles it at each node: bounded at a shape's rank.
  onnx::ModelProto doubling = model_of();
  onnx::AttributeProto* one = add_node(doubling, "Constant", "c", {}, "l1")->add_attribute();
  one->set_name("value_ints");
  one->set_type(onnx::AttributeProto::INTS);
  one->add_ints(-1);
  for (int k = 1; k <= 8; k *= 2) {
    const std::string in = "l" + std::to_string(k);
    add_int(add_node(doubling, "Concat", "cat" + std::to_string(2 * k), {in, in}, "l" + std::to_string(2 * k)), "axis", 0);
  }
  CHECK(message_of<duet::FormatError>(doubling) == "test.onnx: ONNX node 'cat16' (Concat): 16 int64s where a shape has at most 8");
  onnx::ModelProto floats = model_of();
  add_initializer(floats, "w", {2}, 2);
  add_node(floats, "Gather", "lookup", {"w", "x"});
  CHECK(message_of<duet::ValueError>(floats) ==
        "test.onnx: ONNX node 'lookup' (Gather): a Gather of a float tensor by other than one constant index (duet reads "
        "x[:, -1], and Gathers in shape arithmetic) is not supported");
}

TEST_CASE("io::load_onnx: a 1-D Conv's window and pads have one axis") {
  const auto conv1d = [](std::initializer_list<std::int64_t> kernel, std::initializer_list<std::int64_t> pads) {
    onnx::ModelProto m = model_of();
    add_initializer(m, "w", {2, 1, 3}, 6);
    onnx::NodeProto* n = add_node(m, "Conv", "conv", {"x", "w"});
    add_ints(n, "kernel_shape", kernel);
    add_ints(n, "pads", pads);
    return m;
  };
  duet::io::OnnxModel net = load(conv1d({3}, {1, 1}));
  CHECK(net(duet::ones({1, 1, 5})).shape() == Shape{1, 2, 5});
  CHECK(message_of<duet::ValueError>(conv1d({3, 3}, {1, 1})) ==
        "test.onnx: ONNX node 'conv' (Conv): kernel_shape [3, 3] (a 1-D window) is not supported");
  CHECK(message_of<duet::ValueError>(conv1d({3}, {1, 1, 1, 1})) ==
        "test.onnx: ONNX node 'conv' (Conv): pads [1, 1, 1, 1] (duet pads all sides alike) is not supported");
}

TEST_CASE("io::load_onnx: an error while running names the node once") {
  onnx::ModelProto m = model_of();
  add_initializer(m, "w", {2, 1, 3, 3}, 18);
  add_node(m, "Conv", "conv", {"x", "w"});
  duet::io::OnnxModel net = load(m);
  check_shape_error_names_once(net, duet::ones({4, 9}), "ONNX node 'conv' (Conv)");  // a rank-2 input to a Conv
}

TEST_CASE("io::load_onnx: an unsupported operator or attribute names the node and the operator") {
  {
    onnx::ModelProto m = model_of();
    add_node(m, "RNN", "rnn", {"x"});
    const std::string e = message_of<duet::ValueError>(m);
    CHECK(e == "test.onnx: ONNX node 'rnn' (RNN): the operator RNN (duet has GRU and LSTM) is not supported");
  }
  {  // every unknown operator at once, in the order of their first nodes
    onnx::ModelProto m = model_of();
    add_node(m, "Relu", "r", {"x"}, "a");
    add_node(m, "Einsum", "e1", {"a"}, "b");
    add_node(m, "TopK", "", {"b"}, "c");
    add_node(m, "Einsum", "e2", {"c"});
    const std::string e = message_of<duet::ValueError>(m);
    CHECK(e == "test.onnx: ONNX node 'e1' (Einsum): the operator Einsum (2 nodes) is not supported; nor are TopK "
               "(node '#2')");
  }
  {
    onnx::ModelProto m = model_of();
    auto* a = add_node(m, "Softmax", "sm", {"x"})->add_attribute();
    a->set_name("bogus");
    a->set_type(onnx::AttributeProto::INT);
    CHECK(message_of<duet::ValueError>(m) == "test.onnx: ONNX node 'sm' (Softmax): attribute 'bogus' is not supported");
  }
  {
    onnx::ModelProto m = model_of();
    auto* pool = add_node(m, "MaxPool", "pool", {"x"});
    auto* a = pool->add_attribute();
    a->set_name("kernel_shape");
    a->add_ints(3);
    a->add_ints(3);
    auto* pads = pool->add_attribute();
    pads->set_name("pads");
    for (const int p : {1, 1, 0, 1}) pads->add_ints(p);
    CHECK(message_of<duet::ValueError>(m) ==
          "test.onnx: ONNX node 'pool' (MaxPool): pads [1, 1, 0, 1] (duet pads each "
          "spatial axis alike on both sides) is not supported");
    a->set_ints(0, 1);
    pads->set_ints(2, 1);
    CHECK(message_of<duet::ValueError>(m) ==
          "test.onnx: ONNX node 'pool' (MaxPool): the window (kernel=1x3, "
          "stride=1x1, pad_mode=pad, padding=1x1) pads by less than 0 or by more "
          "than half its kernel");
  }
  {
    onnx::ModelProto m = model_of(11);
    add_node(m, "Relu", "r", {"x"});
    CHECK(message_of<duet::ValueError>(m).find("opset 11; duet reads opsets 13 to 17") != std::string::npos);
  }
}

TEST_CASE("io::load_onnx: every operator its list names, the loader reads (if only in a pattern)") {
  for (const std::string_view op : duet::io::detail::onnx_operators) {
    INFO(op);
    onnx::ModelProto m = model_of();
    add_node(m, std::string(op), "n", {"x"});
    try {
      load(m);
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()).find("the operator " + std::string(op) + " is not supported") == std::string::npos);
    }
  }
}

TEST_CASE("io::load_onnx: a Reshape to more elements than index_t counts is a ShapeError naming the node") {
  onnx::ModelProto m = model_of();
  onnx::TensorProto* to = m.mutable_graph()->add_initializer();
  to->set_name("to");
  to->set_data_type(onnx::TensorProto::INT64);
  to->add_dims(3);
  for (const std::int64_t d : {std::int64_t{1} << 40, std::int64_t{1} << 40, std::int64_t{1} << 40}) to->add_int64_data(d);
  add_node(m, "Reshape", "big", {"x", "to"});
  duet::io::OnnxModel net = load(m);
  check_shape_error_names_once(net, duet::ones({2, 3}), "ONNX node 'big' (Reshape)");
}

TEST_CASE("io::load_onnx: Tile refuses repeats past the model's weights, and repeats that do not fit the input") {
  {
    onnx::ModelProto m = model_of();
    add_int64s(m, "r", {2}, {1 << 20, 1 << 20});
    add_node(m, "Tile", "t", {"x", "r"});
    CHECK(message_of<duet::ValueError>(m).find("ONNX node 't' (Tile): repeats [1048576, 1048576] (negative, or more "
                                               "copies than the model's weights have elements) is not supported") !=
          std::string::npos);
  }
  onnx::ModelProto m = model_of();
  add_int64s(m, "r", {3}, {1, 1, 1});
  add_node(m, "Tile", "t", {"x", "r"});
  duet::io::OnnxModel net = load(m);
  check_shape_error_names_once(net, duet::ones({2, 3}),
                               "ONNX node 't' (Tile): repeats of 3 axes for an input of shape [2, 3]");
}

TEST_CASE("io::load_onnx: a malformed model is a FormatError, never a crash") {
  {
    const std::string junk = "not a protobuf \xff\xff\xff\xff";
    CHECK_THROWS_WITH_AS(duet::io::load_onnx_bytes(std::as_bytes(std::span(junk)), "junk.onnx"),
                         "junk.onnx: not an ONNX model (the protobuf message does not parse)", duet::FormatError);
  }
  {
    onnx::ModelProto m = model_of();
    add_node(m, "Add", "add", {"x", "nowhere"});
    CHECK(message_of<duet::FormatError>(m) ==
          "test.onnx: ONNX node 'add' (Add) reads 'nowhere', which no input, initializer or earlier node defines");
  }
  {
    onnx::ModelProto m = model_of();
    add_initializer(m, "w", {3, 2}, 5);
    add_node(m, "MatMul", "mm", {"x", "w"});
    CHECK(message_of<duet::FormatError>(m) == "test.onnx: initializer 'w' has 5 elements, its shape needs 6");
  }
  {
    onnx::ModelProto m = model_of();
    onnx::TensorProto* t = add_initializer(m, "w", {1 << 20, 1 << 20}, 0);
    t->set_raw_data("abcd");
    add_node(m, "MatMul", "mm", {"x", "w"});
    CHECK(message_of<duet::FormatError>(m).find("initializer 'w' has 4 bytes of data") != std::string::npos);
  }
  {
    onnx::ModelProto m = model_of();
    CHECK(message_of<duet::FormatError>(m) ==
          "test.onnx: the graph's output reads 'y', which no input, initializer or earlier node defines");
  }
  {
    onnx::ModelProto m = model_of();
    add_initializer(m, "y", {1}, 1);
    CHECK(message_of<duet::ValueError>(m).find("is not computed by any node") != std::string::npos);
  }
  REQUIRE_REFERENCES(dir);
  // Every prefix of a real file, and a changed byte at each of many places: a model or a duet error.
  std::ifstream in(*dir / "lenet5_opset17.onnx", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto try_load = [](const std::string& b) {
    try {
      duet::io::load_onnx_bytes(std::as_bytes(std::span(b)));
    } catch (const duet::Error&) {
    }
  };
  for (std::size_t n = 0; n < bytes.size(); n += 97) try_load(bytes.substr(0, n));
  for (std::size_t i = 0; i < bytes.size(); i += 61) {
    std::string changed = bytes;
    changed[i] = static_cast<char>(changed[i] ^ 0x5a);
    try_load(changed);
  }
}

// --- the fuzzer's findings (tests/fuzz/fuzz_onnx.cpp; each input is in tests/fuzz/corpus/onnx) --

TEST_CASE("io::load_onnx: an empty initializer in raw bytes loads (empty_raw_initializer.onnx)") {
  // Its vector has no storage: the copy of its 0 bytes was a memcpy to a null pointer.
  onnx::ModelProto m = model_of();
  onnx::TensorProto* t = add_initializer(m, "w", {0}, 0);
  t->set_raw_data("");
  add_node(m, "Add", "add", {"x", "w"});
  duet::io::OnnxModel net = load(m);
  REQUIRE(net.parameters().size() == 1);
  CHECK(net.parameters()[0].parameter->shape() == Shape{0});
}

TEST_CASE("io::load_onnx: a node without outputs is a FormatError, also inside the GELU pattern (gelu_no_output.onnx)") {
  // The pattern looked at its last Mul's output(0) before the node itself was checked.
  onnx::ModelProto m = model_of();
  const auto constant = [&](const std::string& name, float v) {
    onnx::AttributeProto* a = add_node(m, "Constant", "", {}, name)->add_attribute();
    a->set_name("value_float");
    a->set_type(onnx::AttributeProto::FLOAT);
    a->set_f(v);
  };
  constant("root2", std::sqrt(2.0f));
  constant("one", 1.0f);
  constant("half", 0.5f);
  add_node(m, "Div", "div", {"x", "root2"}, "d");
  add_node(m, "Erf", "erf", {"d"}, "e");
  add_node(m, "Add", "add", {"e", "one"}, "a");
  add_node(m, "Mul", "mul", {"x", "a"}, "mx");
  add_node(m, "Mul", "times_half", {"mx", "half"})->clear_output();
  CHECK(message_of<duet::FormatError>(m) == "test.onnx: ONNX node 'times_half' (Mul) has no output");
}

TEST_CASE("io::load_onnx: a Conv group above the output channels is a FormatError (conv_group_overflow.onnx)") {
  // 0 output channels are divisible by any group: g.in = in * group overflowed.
  onnx::ModelProto m = model_of();
  add_initializer(m, "w", {0, 4, 1, 1}, 0);
  add_int(add_node(m, "Conv", "conv", {"x", "w"}), "group", std::int64_t{1} << 62);
  CHECK(message_of<duet::FormatError>(m) ==
        "test.onnx: ONNX node 'conv' (Conv): group 4611686018427387904 does not divide the weight's 0 output channels");
}

TEST_CASE("io::load_onnx: Conv sizes that overflow or ask for any output size are refused (conv_*.onnx)") {
  const auto conv = [](const std::string& attribute, std::initializer_list<std::int64_t> v) {
    onnx::ModelProto m = model_of();
    add_initializer(m, "w", {3, 2, 3, 3}, 54);
    add_ints(add_node(m, "Conv", "conv", {"x", "w"}), attribute, v);
    return message_of<duet::ValueError>(m);
  };
  // dilation * (kernel - 1) overflowed in the window's extent
  CHECK(conv("dilations", {std::int64_t{1} << 62, std::int64_t{1} << 62}) ==
        "test.onnx: ONNX node 'conv' (Conv): strides 1 and dilations 4611686018427387904 (duet's ONNX import takes "
        "windows and steps below 2^31) is not supported");
  CHECK(conv("strides", {INT64_MAX, INT64_MAX}).find("strides 9223372036854775807 and dilations 1") != std::string::npos);
  // size + 2 * pad overflowed; 100000 asked for a 448 GB output of a 6x6 input
  CHECK(conv("pads", {std::int64_t{1} << 62, std::int64_t{1} << 62, std::int64_t{1} << 62, std::int64_t{1} << 62}) ==
        "test.onnx: ONNX node 'conv' (Conv): padding 4611686018427387904 for a window of 3 (duet's ONNX import pads "
        "less than the window, at most a full convolution) is not supported");
  CHECK(conv("pads", {100000, 100000, 100000, 100000}).find("padding 100000 for a window of 3") != std::string::npos);
  CHECK(conv("pads", {3, 3, 3, 3}).find("padding 3 for a window of 3") != std::string::npos);
  // A full convolution: a dilated window's extent 2 * (3 - 1) + 1 = 5, padding 4; every output
  // sees an input element, the corners one each.
  onnx::ModelProto m = model_of();
  add_initializer(m, "w", {3, 2, 3, 3}, 54);
  onnx::NodeProto* n = add_node(m, "Conv", "conv", {"x", "w"});
  add_ints(n, "dilations", {2, 2});
  add_ints(n, "pads", {4, 4, 4, 4});
  duet::io::OnnxModel net = load(m);
  CHECK(net(duet::ones({1, 2, 6, 6})).shape() == Shape{1, 3, 10, 10});
}

TEST_CASE("io::load_onnx: an axis or perm beyond int is refused, not narrowed (softmax_axis_2pow32.onnx, ...)") {
  {
    onnx::ModelProto m = model_of();
    add_int(add_node(m, "Softmax", "sm", {"x"}), "axis", std::int64_t{1} << 32);
    CHECK(message_of<duet::FormatError>(m) ==
          "test.onnx: ONNX node 'sm' (Softmax): axis 4294967296 is beyond every rank (duet's highest is 8)");
  }
  {
    onnx::ModelProto m = model_of();
    add_int(add_node(m, "Concat", "cat", {"x", "x"}), "axis", (std::int64_t{1} << 32) + 1);
    CHECK(message_of<duet::FormatError>(m).find("ONNX node 'cat' (Concat): axis 4294967297 is beyond every rank") !=
          std::string::npos);
  }
  {
    onnx::ModelProto m = model_of();
    add_ints(add_node(m, "Transpose", "t", {"x"}), "perm", {(std::int64_t{1} << 32) + 1, std::int64_t{1} << 32});
    CHECK(message_of<duet::FormatError>(m) ==
          "test.onnx: ONNX node 't' (Transpose): perm [4294967297, 4294967296] is not a permutation");
  }
}


// A python3 that has onnx and numpy, and the export checker (tests/onnx_check_export.py, whose
// path CMake defines); nothing if there is none.
std::optional<std::string> export_checker() {
  const std::string script = DUET_ONNX_EXPORT_CHECK;
  for (const std::string python : {"python3", "/usr/bin/python3"}) {
    if (std::system((python + " -c 'import onnx, numpy' 2>/dev/null").c_str()) == 0) {
      return python + " " + script;
    }
  }
  return std::nullopt;
}

template <class U>
void write_raw(const fs::path& path, const duet::BasicTensor<U>& t) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.numel() * sizeof(U)));
  REQUIRE(out);
}

// net's output on xs in PyNative mode, whatever the context's mode: what an export traces.
template <class Net, class... X>
Tensor pynative_output(Net& net, const X&... xs) {
  const duet::EagerScope eager;
  return Tensor(net(xs...));
}

// onnx.checker accepts dir/name.onnx, and a numpy evaluation of it on x gives want.
template <class U>
void check_by_numpy(const duet_test::TempDir& dir, const std::string& name, const duet::BasicTensor<U>& x,
                    const Tensor& want) {
  if (const auto checker = export_checker()) {
    write_raw(dir.path / (name + ".in"), x);
    write_raw(dir.path / (name + ".out"), want);
    std::string shape;
    for (const duet::index_t d : x.shape()) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    const std::string command = *checker + " " + (dir.path / (name + ".onnx")).string() + " " +
                                (dir.path / (name + ".in")).string() + " " + (dir.path / (name + ".out")).string() +
                                " " + shape;
    CHECK(std::system(command.c_str()) == 0);
  } else {
    MESSAGE("SKIPPED: the exported model is not checked by onnx.checker (no python3 with onnx and numpy)");
  }
}

// Exports net for `shape`, then: load_onnx gives back its parameters under their names and
// its output at evaluation (PyNative's, computed here), in both modes, bit for bit; and
// onnx.checker accepts the file and a numpy evaluation of it gives that output. An operation
// the importer makes of other operations (LayerNormalization) sums in another order: `exact`
// false asks the output within check_close's tolerance, and the loaded model's two modes
// still bit for bit.
template <class Net>
void check_export(Net& net, const Shape& shape, const std::string& name, const duet_test::TempDir& dir,
                  bool exact = true) {
  INFO(name);
  const fs::path file = dir.path / (name + ".onnx");
  const bool training = net.training();
  duet::io::export_onnx(net, shape, file);
  CHECK(net.training() == training);  // it ran at evaluation, and gave the setting back
  net.set_train(false);
  const Tensor x = duet::randn(shape);
  const Tensor want = pynative_output(net, x);
  duet::io::OnnxModel loaded = duet::io::load_onnx(file);
  std::vector<std::string> names, loaded_names;
  for (const auto& p : net.parameters()) names.push_back(p.name);
  for (const auto& p : loaded.parameters()) loaded_names.push_back(p.name);
  std::ranges::sort(names);
  std::ranges::sort(loaded_names);
  CHECK(loaded_names == names);
  const Tensor pynative = loaded(x);
  if (exact) CHECK(same_bits(pynative, want));
  else check_close(pynative, want, name + " loaded back");
  {
    ModeScope graph(duet::GRAPH_MODE);
    CHECK(same_bits(loaded(x), pynative));
  }
  check_by_numpy(dir, name, x, want);
}

TEST_CASE("io::export_onnx: the seed network, LeNet-5 and the residual CNN load back with their outputs and names") {
  const duet_test::TempDir dir;
  SeedNetwork<> seed;
  check_export(seed, Shape{3, 1, 28, 28}, "seed", dir);
  LeNet5 lenet;
  check_export(lenet, Shape{2, 1, 28, 28}, "lenet5", dir);
  resnet_fashion::ResNetFashion resnet;
  {  // moving statistics other than 0 and 1, so that BatchNormalization's inputs matter
    const duet::EagerScope eager;
    resnet.set_train(true);
    for (int step = 0; step < 2; ++step) (void)Tensor(resnet(duet::randn(Shape{8, 1, 28, 28})));
  }
  // and gamma other than 1, whose product with 1 / sqrt(var + eps) the importer must round as
  // the layer does (gamma * rsqrt rounded otherwise: 1,818 of 16,384 outputs off by 2e-7)
  for (const auto& p : resnet.parameters()) {
    if (p.name.ends_with("gamma")) p.parameter->set_data(duet::uniform(p.parameter->shape(), 0.5f, 1.5f, 17));
  }
  check_export(resnet, Shape{2, 1, 28, 28}, "resnet", dir);
}

// pad_mode same where its padding is uneven (stride 2 on 28 x 28 pads 0 before and 1 after):
// written as auto_pad SAME_UPPER, which load_onnx reads back (helper-93: the explicit uneven
// pads written before, it refused).
struct SamePadded : duet::nn::Cell<SamePadded> {
  duet::nn::Conv2d<1, 4, 3, 2, duet::nn::PadMode::same> conv;
  duet::nn::MaxPool2d<3, 2, duet::nn::PadMode::same> max_pool;
  duet::nn::AvgPool2d<2, 2, duet::nn::PadMode::same> avg_pool;
  DUET_CELL_MEMBERS(conv, max_pool, avg_pool);
  auto construct(auto x) { return avg_pool(max_pool(conv(x))); }
};

TEST_CASE("io::export_onnx: pad_mode same is auto_pad SAME_UPPER, at sizes where it is uneven too, and loads back") {
  const duet_test::TempDir dir;
  SamePadded net;
  check_export(net, Shape{2, 1, 28, 28}, "same_padded", dir);
  check_export(net, Shape{2, 1, 27, 27}, "same_padded_odd", dir);
  const std::string text = [&] {
    std::ifstream in(dir.path / "same_padded.onnx", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  CHECK(text.find("SAME_UPPER") != std::string::npos);
}

// A transformer block's normalisation: LayerNorm with PyTorch's epsilon, between products.
struct Normed : duet::nn::Cell<Normed> {
  duet::nn::Dense<16, 24> fc;
  duet::nn::LayerNorm<24> norm{24, 1e-5};
  duet::nn::Dense<24, 10> head;
  DUET_CELL_MEMBERS(fc, norm, head);
  auto construct(auto x) { return head(duet::ops::relu(norm(fc(x)))); }
};

TEST_CASE("io::export_onnx: LayerNorm is written as LayerNormalization, Dense on three axes as MatMul, and both load back") {
  const duet_test::TempDir dir;
  Normed net;
  for (const auto& p : net.norm.parameters()) {  // gamma and beta other than 1 and 0
    const Tensor r = duet::randn(p.parameter->shape(), 9);
    std::copy_n(r.data(), r.numel(), p.parameter->data());
  }
  // [batch, tokens, features]: the Dense layers are written as Transpose and MatMul.
  check_export(net, Shape{3, 5, 16}, "normed", dir, false);
  const onnx::ModelProto m = [&] {
    onnx::ModelProto model;
    std::ifstream in(dir.path / "normed.onnx", std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
    return model;
  }();
  const auto& nodes = m.graph().node();
  const auto ln = std::ranges::find(nodes, std::string("LayerNormalization"), &onnx::NodeProto::op_type);
  REQUIRE(ln != nodes.end());
  CHECK(ln->input(1) == "norm.gamma");
  CHECK(ln->input(2) == "norm.beta");
  CHECK(std::ranges::count(nodes, std::string("Transpose"), &onnx::NodeProto::op_type) == 2);
}

// A transformer encoder block after its embeddings, as helper-67 wrote one: LayerNorm, one
// product split into q, k and v, scaled scores, softmax, a GELU MLP, residuals, mean pooling.
template <bool Exact>
struct Encoder : duet::nn::Cell<Encoder<Exact>> {
  static constexpr duet::index_t width = 8;
  duet::nn::LayerNorm<> norm1{width, 1e-5};
  duet::nn::Dense<width, 3 * width> qkv;
  duet::nn::Dense<width, width> projection;
  duet::nn::LayerNorm<> norm2{width, 1e-5};
  duet::nn::Dense<width, 16> fc1;
  duet::nn::Activation<duet::fn::Gelu<!Exact>> gelu;
  duet::nn::Dense<16, width> fc2;
  duet::nn::Dense<width, 3> head;
  DUET_CELL_MEMBERS(norm1, qkv, projection, norm2, fc1, gelu, fc2, head);
  auto construct(auto x) {
    namespace ops = duet::ops;
    const auto [q, k, v] = ops::split<-1, width, width, width>(qkv(norm1(x)));
    auto scores = ops::matmul(q, ops::transpose<0, 2, 1>(k)) * (1.0f / std::sqrt(float(width)));
    auto attended = x + projection(ops::matmul(ops::softmax(scores, -1), v));
    auto out = attended + fc2(gelu(fc1(norm2(attended))));
    return head(ops::mean(out, ops::axes<1>));
  }
};

TEST_CASE("io::export_onnx: a transformer block (split, batched MatMul, GELU, numbers, ReduceMean) loads back") {
  const duet_test::TempDir dir;
  Encoder<true> exact;
  check_export(exact, Shape{2, 5, 8}, "encoder", dir, false);
  const auto op_types = [&](const std::string& name) {
    onnx::ModelProto model;
    std::ifstream in(dir.path / (name + ".onnx"), std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
    std::multiset<std::string> ops;
    for (const auto& n : model.graph().node()) ops.insert(n.op_type());
    return ops;
  };
  const std::multiset<std::string> ops = op_types("encoder");
  CHECK(ops.count("Slice") == 3);
  CHECK(ops.count("Erf") == 1);  // torch's GELU pattern, read back as one GELU
  CHECK(ops.count("ReduceMean") == 1);
  CHECK(ops.count("Constant") == 4);  // the scale and GELU's three numbers, none a parameter
  // The tanh form is written out node by node, and read back as those operations.
  Encoder<false> approximate;
  check_export(approximate, Shape{2, 5, 8}, "encoder_tanh", dir, false);
  CHECK(op_types("encoder_tanh").count("Tanh") == 1);
}

// helper-67's whole classifier: token and position embeddings ahead of the encoder block.
struct TokenClassifier : duet::nn::Cell<TokenClassifier> {
  using input_value_type = std::int32_t;
  duet::nn::Embedding<16, 8> tokens;
  duet::nn::Embedding<12, 8> positions;
  Encoder<true> encoder;
  DUET_CELL_MEMBERS(tokens, positions, encoder);
  auto construct(auto ids) { return encoder(tokens(ids) + positions(duet::ops::positions<1>(ids))); }
};

TEST_CASE("io::export_onnx: a network of token ids has an int32 input, Gather for embeddings, Range for positions") {
  const duet_test::TempDir dir;
  TokenClassifier net;
  net.set_train(false);
  const auto ids_of = [](Shape shape) {
    duet::BasicTensor<std::int32_t> ids = duet::zeros<std::int32_t>(shape);
    for (duet::index_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>((i * 7 + 3) % 16);
    return ids;
  };
  const auto output_of = [&](const duet::BasicTensor<std::int32_t>& ids) { return pynative_output(net, ids); };
  const fs::path file = dir.path / "tokens.onnx";
  // Any batch and any length: the file names both axes, and the output's batch.
  duet::io::export_onnx(net, Shape{2, 5}, file, {.dynamic_batch = true, .dynamic_axes = {{1, "length"}}});
  for (const Shape& shape : {Shape{2, 5}, Shape{3, 9}}) {
    const duet::BasicTensor<std::int32_t> ids = ids_of(shape);
    check_by_numpy(dir, "tokens", ids, output_of(ids));
  }
  onnx::ModelProto model;
  {
    std::ifstream in(file, std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  const auto& in_dims = model.graph().input(0).type().tensor_type().shape().dim();
  CHECK(in_dims[0].dim_param() == "batch");
  CHECK(in_dims[1].dim_param() == "length");
  const auto& out_dims = model.graph().output(0).type().tensor_type().shape().dim();
  CHECK(out_dims[0].dim_param() == "batch");
  CHECK(out_dims[1].dim_value() == 3);
  // Loaded back, the positions' Range included. (Its Dense layers on three axes come back as
  // MatMul and Add, equal within rounding; TokenPositions below checks the bits.)
  duet::io::OnnxModel back = duet::io::load_onnx(file);
  for (const Shape& shape : {Shape{2, 5}, Shape{3, 9}})
    check_close(back(ids_of(shape)), output_of(ids_of(shape)), "tokens, loaded back");
}

// Token and position embeddings, their mean and a Dense: exported as Gathers, Range and Gemm,
// which load back as the same operations.
struct TokenPositions : duet::nn::Cell<TokenPositions> {
  using input_value_type = std::int32_t;
  duet::nn::Embedding<16, 8> tokens;
  duet::nn::Embedding<12, 8> positions;
  duet::nn::Dense<8, 3> head;
  DUET_CELL_MEMBERS(tokens, positions, head);
  auto construct(auto ids) {
    return head(duet::ops::mean(tokens(ids) + positions(duet::ops::positions<1>(ids)), duet::ops::axes<1>));
  }
};

TEST_CASE("io::export_onnx: ops::positions' Range loads back, the same bits at any length, in both modes") {
  const duet_test::TempDir dir;
  TokenPositions net;
  const fs::path file = dir.path / "positions.onnx";
  duet::io::export_onnx(net, Shape{2, 5}, file, {.dynamic_batch = true, .dynamic_axes = {{1, "length"}}});
  duet::io::OnnxModel back = duet::io::load_onnx(file);
  CHECK(back.other_input_type() == "Int32");
  CHECK(back.operators() == std::vector<std::string>{"Gather", "Gather", "Add", "ReduceMean", "Gemm", "Add"});
  std::ostringstream printed;  // print(model): what it takes and how much it runs
  printed << back;
  CHECK(printed.str() == "io::OnnxModel('input' [batch, length], 6 steps)");
  for (const Shape& shape : {Shape{2, 5}, Shape{3, 9}, Shape{1, 12}}) {
    INFO(to_string(shape));
    duet::BasicTensor<std::int32_t> ids = duet::zeros<std::int32_t>(shape);
    duet::BasicTensor<std::int64_t> ids64 = duet::zeros<std::int64_t>(shape);
    for (duet::index_t i = 0; i < ids.numel(); ++i)
      ids64.data()[i] = ids.data()[i] = static_cast<std::int32_t>((i * 5 + 1) % 16);
    const Tensor want = pynative_output(net, ids);
    CHECK(same_bits(back(ids), want));
    CHECK(same_bits(back(ids64), want));
    ModeScope graph(duet::GRAPH_MODE);
    CHECK(same_bits(back(ids), want));
    CHECK(same_bits(back(ids), want));  // replayed
  }
  // Longer than the position table: an IndexError naming the node, in both modes, as the
  // network's own embedding refuses it.
  const duet::BasicTensor<std::int32_t> long_ids = duet::zeros<std::int32_t>({1, 13});
  for (const duet::Mode m : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    ModeScope mode(m);
    CHECK_THROWS_WITH_AS(back(long_ids),
                         doctest::Contains("(Gather): a Range(0, 13, 1) of more positions than the 12 rows it indexes"),
                         duet::IndexError);
  }
}

// A network built at run time says only at run time that it takes ids (its first cell is an
// Embedding): export_onnx traced it on float zeros, which the Embedding refused.
struct MeanOverTokens : duet::nn::Cell<MeanOverTokens> {
  auto construct(auto x) { return duet::ops::mean(x, duet::ops::axes<1>); }
};

TEST_CASE("io::export_onnx: a DynamicSequentialCell that begins with an Embedding has an int32 input and loads back") {
  const duet_test::TempDir dir;
  duet::nn::DynamicSequentialCell net;
  net.append(duet::nn::Embedding<>(20, 16));
  net.append(MeanOverTokens{});
  net.append(duet::nn::Dense<>(16, 3));
  const fs::path file = dir.path / "runtime_tokens.onnx";
  duet::io::export_onnx(net, Shape{2, 5}, file, {.dynamic_batch = true, .dynamic_axes = {{1, "length"}}});
  duet::io::OnnxModel back = duet::io::load_onnx(file);
  for (const Shape& shape : {Shape{2, 5}, Shape{3, 7}}) {
    duet::BasicTensor<std::int32_t> ids = duet::zeros<std::int32_t>(shape);
    for (duet::index_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>((i * 7 + 3) % 20);
    CHECK(same_bits(back(ids), net(ids)));
  }
}

// helper-76's padding mask: the tokens that are not padding (id 0) as the weights of a mean
// (a comparison with an int32 number, a cast), then comparisons and selections between floats.
struct PaddedMean : duet::nn::Cell<PaddedMean> {
  using input_value_type = std::int32_t;
  duet::nn::Embedding<16, 8> tokens;
  duet::nn::Dense<8, 3> head;
  DUET_CELL_MEMBERS(tokens, head);
  auto construct(auto ids) {
    namespace ops = duet::ops;
    const auto keep = ops::expand_dims<-1>(ops::cast<float>(ops::not_equal(ids, 0)));
    const auto pooled = ops::sum(tokens(ids) * keep, ops::axes<1>) / ops::sum(keep, ops::axes<1>);
    const auto y = head(pooled);
    const auto low = ops::where(ops::less(y, 0.0f), 0.0f, y * 2.0f);
    const auto picked = ops::where(ops::greater_equal(y, ops::square(y) - 1.0f), y, low);
    return picked + ops::cast<float>(ops::equal(ops::less_equal(y, 0.5f), ops::greater(y, -0.5f)));
  }
};

TEST_CASE("io::export_onnx: comparisons, casts and where, on token ids and on floats, evaluate as duet does") {
  const duet_test::TempDir dir;
  PaddedMean net;
  net.set_train(false);
  duet::BasicTensor<std::int32_t> ids({3, 6}, {5, 9, 2, 0, 0, 0, 1, 1, 1, 1, 1, 7, 15, 3, 0, 0, 0, 0});
  const Tensor want = pynative_output(net, ids);
  duet::io::export_onnx(net, ids.shape(), dir.path / "padded.onnx");
  check_by_numpy(dir, "padded", ids, want);
  std::set<std::string> types;
  onnx::ModelProto model;
  {
    std::ifstream in(dir.path / "padded.onnx", std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  for (const auto& node : model.graph().node()) types.insert(node.op_type());
  for (const char* op : {"Equal", "Not", "Less", "GreaterOrEqual", "LessOrEqual", "Greater", "Cast", "Where"}) {
    CHECK_MESSAGE(types.count(op) == 1, op);
  }
}

// A network of two inputs: features and a mask of the outputs to keep.
struct FeaturesAndMask : duet::nn::Cell<FeaturesAndMask> {
  duet::nn::Dense<4, 3> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x, auto keep) { return duet::ops::relu(fc(x)) * keep; }
};

TEST_CASE("io::export_onnx: a network of two inputs has input0 and input1, each with its own shape") {
  const duet_test::TempDir dir;
  FeaturesAndMask net;
  const fs::path file = dir.path / "two.onnx";
  duet::io::export_onnx(net, {{2, 4}, {2, 3}}, file, {.dynamic_batch = true});
  onnx::ModelProto model;
  {
    std::ifstream in(file, std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  REQUIRE(model.graph().input_size() == 2);
  CHECK(model.graph().input(0).name() == "input0");
  CHECK(model.graph().input(1).name() == "input1");
  CHECK(model.graph().input(1).type().tensor_type().shape().dim(0).dim_param() == "batch");
  CHECK(model.graph().input(1).type().tensor_type().shape().dim(1).dim_value() == 3);
  // Evaluated by numpy at another batch, against duet's output.
  const Tensor x = duet::randn({5, 4}, 1);
  const Tensor keep = duet::ops::cast<float>(duet::ops::greater(duet::randn({5, 3}, 2), 0.0f));
  const Tensor want = pynative_output(net, x, keep);
  if (const auto checker = export_checker()) {
    write_raw(dir.path / "x.in", x);
    write_raw(dir.path / "keep.in", keep);
    write_raw(dir.path / "two.out", want);
    const std::string command = *checker + " " + file.string() + " " + (dir.path / "x.in").string() + "," +
                                (dir.path / "keep.in").string() + " " + (dir.path / "two.out").string() + " '5,4;5,3'";
    CHECK(std::system(command.c_str()) == 0);
  }
  CHECK_THROWS_WITH_AS(duet::io::export_onnx(net, {{2, 4}, {2, 3}}, file, {.dynamic_axes = {{1, "length"}}}),
                       doctest::Contains("dynamic_axes names axes of a network of one input; this one has 2"),
                       duet::ValueError);
}

// Heads of a fixed length: the reshape fixes axis 1 in the network itself.
struct FixedLength : duet::nn::Cell<FixedLength> {
  duet::nn::Dense<4, 4> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return duet::ops::reshape<-1, 5, 2, 2>(fc(x)); }
};

TEST_CASE("io::export_onnx: an axis dynamic_axes names that the network fixes is a ValueError naming it") {
  const duet_test::TempDir dir;
  FixedLength net;
  const fs::path file = dir.path / "fixed.onnx";
  CHECK_THROWS_WITH_AS(duet::io::export_onnx(net, Shape{2, 5, 4}, file, {.dynamic_axes = {{1, "length"}}}),
                       doctest::Contains("the network does not take another size along input axis 1 ('length')"),
                       duet::ValueError);
  CHECK(dir.listing().empty());
  CHECK_THROWS_WITH_AS(duet::io::export_onnx(net, Shape{2, 5, 4}, file, {.dynamic_axes = {{3, "x"}}}),
                       doctest::Contains("dynamic_axes names axis 3 'x' of an input of shape [2, 5, 4]"), duet::ValueError);
}

// Windows of an axis of any length: the first two steps, the last two backwards, the mean of
// all but the first. Written at length 5, each must cut another length as duet does.
struct SlicedLength : duet::nn::Cell<SlicedLength> {
  duet::nn::Dense<4, 3> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) {
    namespace ops = duet::ops;
    const auto head = ops::slice(x, ops::ints<0, 0>, ops::ints<-1, 2>);
    const auto tail = ops::strided_slice(x, ops::ints<0, -1>, ops::ints<ops::to_end, -3>, ops::ints<1, -1>);
    const auto rest = ops::mean(ops::slice(x, ops::ints<0, 1>, ops::ints<-1, -1>), ops::axes<1>, ops::keep_dims);
    return fc(ops::concat<1>(head, tail, rest));
  }
};

TEST_CASE("io::export_onnx: slices of an axis dynamic_axes names cut any length as duet does") {
  const duet_test::TempDir dir;
  SlicedLength net;
  net.set_train(false);
  const fs::path file = dir.path / "sliced.onnx";
  duet::io::export_onnx(net, Shape{2, 5, 4}, file, {.dynamic_batch = true, .dynamic_axes = {{1, "length"}}});
  duet::io::OnnxModel loaded = duet::io::load_onnx(file);
  for (const Shape& shape : {Shape{2, 5, 4}, Shape{3, 9, 4}, Shape{1, 3, 4}}) {
    INFO(to_string(shape));
    const Tensor x = duet::randn(shape, 5);
    const Tensor want = pynative_output(net, x);
    check_by_numpy(dir, "sliced", x, want);
    // The Dense on three axes comes back as MatMul and Add, whose sums the product's size
    // orders: equal within rounding, not always to the bit.
    check_close(loaded(x), want, "sliced, loaded back");
  }
}

// nn::MultiheadAttention: its heads made and joined by ops::unflatten and ops::flatten, written
// as Reshapes that copy the batch and length (0), so that the file takes any length.
struct Attending : duet::nn::Cell<Attending> {
  duet::nn::MultiheadAttention<8, 2> attn;
  duet::nn::Dense<8, 3> head;
  DUET_CELL_MEMBERS(attn, head);
  auto construct(auto x) { return head(attn(x)); }
};

// The attention with a float key padding mask, the network's second input.
struct MaskedAttending : duet::nn::Cell<MaskedAttending> {
  duet::nn::MultiheadAttention<8, 2> attn;
  DUET_CELL_MEMBERS(attn);
  auto construct(auto x, auto mask) { return attn(x, mask); }
};

// Token ids attending to each other but to padding (id 1).
struct PaddedAttending : duet::nn::Cell<PaddedAttending> {
  using input_value_type = std::int32_t;
  duet::nn::Embedding<16, 8> tokens;
  duet::nn::MultiheadAttention<8, 2> attn;
  DUET_CELL_MEMBERS(tokens, attn);
  auto construct(auto ids) { return attn(tokens(ids), duet::ops::equal(ids, 1)); }
};

TEST_CASE("io::export_onnx: nn::MultiheadAttention's unflatten and flatten are Reshapes of any length, and load back") {
  const duet_test::TempDir dir;
  Attending net;
  net.set_train(false);
  const fs::path file = dir.path / "attending.onnx";
  duet::io::export_onnx(net, Shape{2, 5, 8}, file, {.dynamic_batch = true, .dynamic_axes = {{1, "length"}}});
  duet::io::OnnxModel loaded = duet::io::load_onnx(file);
  for (const Shape& shape : {Shape{2, 5, 8}, Shape{3, 9, 8}, Shape{1, 1, 8}}) {
    INFO(to_string(shape));
    const Tensor x = duet::randn(shape, 5);
    const Tensor want = pynative_output(net, x);
    check_by_numpy(dir, "attending", x, want);
    check_close(loaded(x), want, "attending, loaded back");
  }
  // The causal mask, ops::tril with a value, has none (ONNX's Trilu writes zeros only).
  duet::nn::MultiheadAttention<8, 2, true> causal;
  CHECK_THROWS_WITH_AS(duet::io::export_onnx(causal, Shape{2, 5, 8}, dir.path / "causal.onnx"),
                       doctest::Contains("has no ONNX form"), duet::ValueError);
}

TEST_CASE("io::export_onnx: nn::MultiheadAttention's key padding mask, added or from token ids, evaluates as duet's") {
  const duet_test::TempDir dir;
  const auto checker = export_checker();
  if (!checker) {
    MESSAGE("SKIPPED: the exported models are not checked by onnx.checker (no python3 with onnx and numpy)");
    return;
  }
  // A float mask, the network's second input: an Unsqueeze and an Add.
  MaskedAttending masked;
  const fs::path file = dir.path / "masked.onnx";
  duet::io::export_onnx(masked, {{2, 5, 8}, {2, 5}}, file, {.dynamic_batch = true});
  const Tensor x = duet::randn({3, 5, 8}, 1);
  const Tensor mask = duet::randn({3, 5}, 2);
  write_raw(dir.path / "x.in", x);
  write_raw(dir.path / "mask.in", mask);
  write_raw(dir.path / "masked.out", pynative_output(masked, x, mask));
  const std::string command = *checker + " " + file.string() + " " + (dir.path / "x.in").string() + "," +
                              (dir.path / "mask.in").string() + " " + (dir.path / "masked.out").string() +
                              " '3,5,8;3,5'";
  CHECK(std::system(command.c_str()) == 0);
  // A UInt8 mask of token ids: Cast to bool, Where -inf. The pad id is not 0, since export_onnx
  // runs the network on zeros, where a mask of ids == 0 leaves no key.
  PaddedAttending padded;
  padded.set_train(false);
  duet::io::export_onnx(padded, Shape{3, 6}, dir.path / "padded_attention.onnx");
  duet::BasicTensor<std::int32_t> ids({3, 6}, {5, 9, 2, 1, 1, 1, 3, 4, 6, 7, 8, 2, 15, 1, 1, 1, 1, 1});
  check_by_numpy(dir, "padded_attention", ids, pynative_output(padded, ids));
}

// The attention with an attn_mask from the network's second input: added as it is ([L, L]) or
// per sequence and head ([B * H, L, L]: Unsqueeze, Reshape), or where it is 1 (Cast, Where).
template <bool Bool>
struct ScoresMaskedAttending : duet::nn::Cell<ScoresMaskedAttending<Bool>> {
  duet::nn::MultiheadAttention<8, 2> attn;
  DUET_CELL_MEMBERS(attn);
  auto construct(auto x, auto scores) {
    if constexpr (Bool)
      return attn(x, duet::nn::attn_mask(duet::ops::equal(scores, 1.0f)));
    else
      return attn(x, duet::nn::attn_mask(scores));
  }
};

TEST_CASE(
    "io::export_onnx: nn::MultiheadAttention's attn_mask, added or bool, one or one per head, evaluates as duet's") {
  const duet_test::TempDir dir;
  const auto checker = export_checker();
  if (!checker) {
    MESSAGE("SKIPPED: the exported models are not checked by onnx.checker (no python3 with onnx and numpy)");
    return;
  }
  const auto check = [&](auto& net, const Shape& mask_shape, const std::string& name) {
    INFO(name);
    const fs::path file = dir.path / (name + ".onnx");
    duet::io::export_onnx(net, {{3, 5, 8}, mask_shape}, file);
    const Tensor x = duet::randn({3, 5, 8}, 1);
    Tensor mask = duet::randn(mask_shape, 2);
    // Some keys but 0 of some queries, for the bool mask.
    for (duet::index_t i = 1; i < mask.numel(); i += 3) mask.data()[i] = i % 5 == 0 ? 0.5f : 1.0f;
    write_raw(dir.path / "x.in", x);
    write_raw(dir.path / "mask.in", mask);
    write_raw(dir.path / (name + ".out"), pynative_output(net, x, mask));
    std::string shape;
    for (const duet::index_t d : mask_shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    const std::string command = *checker + " " + file.string() + " " + (dir.path / "x.in").string() + "," +
                                (dir.path / "mask.in").string() + " " + (dir.path / (name + ".out")).string() +
                                " '3,5,8;" + shape + "'";
    CHECK(std::system(command.c_str()) == 0);
  };
  ScoresMaskedAttending<false> added;
  check(added, Shape{5, 5}, "attn_mask_added");
  check(added, Shape{6, 5, 5}, "attn_mask_per_head");
  ScoresMaskedAttending<true> selected;
  check(selected, Shape{5, 5}, "attn_mask_bool");
}

// Operations whose ONNX forms are short chains, each checked by the same round trip.
struct Assorted : duet::nn::Cell<Assorted> {
  duet::nn::Dense<6, 12> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) {
    namespace ops = duet::ops;
    auto h = ops::stop_gradient(fc(x));                              // [2, 12], Identity
    auto r = ops::reshape<2, 3, 4>(h);                              // Reshape
    auto s = ops::strided_slice(r, ops::ints<0, 2>, ops::ints<2, ops::to_end>, ops::ints<1, -1>);  // backwards
    auto e = ops::expand_dims<1>(ops::sum(s, ops::axes<-1>));        // ReduceSum, Unsqueeze
    auto c = ops::concat<-1>(e, ops::squeeze<1>(ops::expand_dims<1>(ops::max(r, ops::axes<1>, ops::keep_dims))));
    auto t = ops::stack<0>(ops::silu(c), ops::softplus(c), ops::clip_by_value(c, -0.5, 0.5));
    return ops::mean(ops::sqrt(ops::abs(t)) + ops::exp(-t) + 2.0f / (1.0f + ops::square(t)) + ops::sin(t) * ops::cos(t) +
                         ops::log1p(ops::abs(t)) - ops::expm1(t * 0.5f) + ops::erf(t),
                     ops::keep_dims);
  }
};

TEST_CASE("io::export_onnx: shape operations, reductions, numbers on either side and elementwise chains load back") {
  const duet_test::TempDir dir;
  Assorted net;
  check_export(net, Shape{2, 6}, "assorted", dir, false);
}

// Tile (its multiples fewer than the axes, and more: an Unsqueeze first) and ReduceProd.
struct TiledProducts : duet::nn::Cell<TiledProducts> {
  duet::nn::Dense<4, 6> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) {
    namespace ops = duet::ops;
    auto h = ops::reshape<2, 2, 3>(fc(x));
    auto rows = ops::prod(ops::tile<2, 1>(h), ops::axes<1>);            // [2, 4, 3] -> [2, 3]
    auto apart = ops::prod(ops::tile<3, 1, 1, 2>(h), ops::axes<0, 2>);  // [3, 2, 2, 6] -> [2, 6]
    return ops::concat<-1>(rows, ops::tile(apart, {1, 1}), ops::prod(ops::reshape<2, 6>(h), {-1}, ops::keep_dims));
  }
};

TEST_CASE("io::export_onnx: tile and prod are Tile and ReduceProd, and load back") {
  const duet_test::TempDir dir;
  TiledProducts net;
  check_export(net, Shape{2, 4}, "tiled_products", dir);
  const duet::io::OnnxModel loaded = duet::io::load_onnx(dir.path / "tiled_products.onnx");
  CHECK(std::ranges::count(loaded.operators(), "Tile") == 3);
  CHECK(std::ranges::count(loaded.operators(), "ReduceProd") == 3);
}

// torch.gather's elements, their indices computed from the input (a Cast of int32s), and a
// masked_fill: GatherElements and Where.
struct PickedFeatures : duet::nn::Cell<PickedFeatures> {
  duet::nn::Dense<4, 6> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) {
    namespace ops = duet::ops;
    const auto h = fc(x);                                                                         // [B, 6]
    const auto at = ops::cast<std::int32_t>(ops::clip_by_value(ops::abs(x) * 2.0f, 0.0f, 5.0f));  // [B, 4] in [0, 5]
    const auto picked = ops::gather_elements<1>(h, at);
    return ops::masked_fill(picked, ops::greater(picked, 0.5f), 0.5f);
  }
};

// topk's indices have no ONNX form: TopK makes values and indices at once, and an exported
// operation makes one value.
struct TopTwo : duet::nn::Cell<TopTwo> {
  auto construct(auto x) { return duet::ops::topk<2>(x).values; }
};

TEST_CASE("io::export_onnx: gather_elements is GatherElements, masked_fill Where, and numpy evaluates them as duet") {
  const duet_test::TempDir dir;
  PickedFeatures net;
  net.set_train(false);
  const Tensor x = duet::randn({3, 4});
  const Tensor want = pynative_output(net, x);
  duet::io::export_onnx(net, x.shape(), dir.path / "picked.onnx");
  check_by_numpy(dir, "picked", x, want);
  onnx::ModelProto model;
  {
    std::ifstream in(dir.path / "picked.onnx", std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  std::multiset<std::string> types;
  for (const auto& node : model.graph().node()) types.insert(node.op_type());
  CHECK(types.count("GatherElements") == 1);
  CHECK(types.count("Where") == 1);
  TopTwo top;
  CHECK_THROWS_WITH_AS(duet::io::export_onnx(top, Shape{2, 5}, dir.path / "top.onnx"),
                       doctest::Contains("has no ONNX form"), duet::ValueError);
}

// A server freezes compiles after warming up: a request of the wrong shape is still a
// ShapeError about the input, not a RecompileError about a form it would compile (helper-85).
TEST_CASE("io::export_onnx: with dynamic_batch the model takes any batch, and frozen in graph mode it refuses a wrong input as one") {
  const duet_test::TempDir dir;
  LeNet5 lenet;
  lenet.set_train(false);
  duet::io::export_onnx(lenet, Shape{2, 1, 28, 28}, dir.path / "lenet5.onnx", {.dynamic_batch = true});
  duet::io::OnnxModel loaded = duet::io::load_onnx(dir.path / "lenet5.onnx");
  CHECK(loaded.input_dims() == std::vector<std::int64_t>{-1, 1, 28, 28});
  const Tensor x = duet::randn(Shape{5, 1, 28, 28});
  {
    const duet::EagerScope eager;
    CHECK(same_bits(loaded(x), Tensor(lenet(x))));
  }
  duet_test::ModeGuard mode;
  duet::set_context({.mode = duet::GRAPH_MODE});
  const Tensor warm = loaded(x);
  const duet::FrozenCompiles frozen;
  CHECK(same_bits(loaded(x), warm));
  CHECK_THROWS_WITH_AS(loaded(duet::randn(Shape{1, 3, 28, 28})),
                       doctest::Contains("the model's input 'input' [batch, 1, 28, 28], as the file declares it, got [1, 3, 28, 28]"),
                       duet::ShapeError);
  CHECK_THROWS_AS(loaded(duet::randn(Shape{4, 1, 28, 28})), duet::RecompileError);  // a right shape not warmed up
}

struct Masked : duet::nn::Cell<Masked> {
  duet::nn::Dense<4, 3> dense;
  DUET_CELL_MEMBERS(dense);
  auto construct(auto x) { return duet::ops::tril(dense(x)); }
};

// A sequence model: GRU then a Dense on every step ([batch, length, 3]).
struct SequenceModel : duet::nn::Cell<SequenceModel> {
  duet::nn::GRU<4, 6> gru;
  duet::nn::Dense<6, 3> head;
  DUET_CELL_MEMBERS(gru, head);
  auto construct(auto x) { return head(gru(x)); }
};

// A GRU then an LSTM, from zeros and from a learned initial state.
struct Recurrences : duet::nn::Cell<Recurrences> {
  duet::nn::GRU<4, 6> gru;
  duet::nn::LSTM<6, 5> lstm;
  duet::nn::Parameter h0{duet::randn({2, 5}, 4)};
  duet::nn::Parameter c0{duet::randn({2, 5}, 5)};
  DUET_CELL_MEMBERS(gru, lstm, h0, c0);
  auto construct(auto x) { return lstm(gru(x), h0, c0); }
};

// An LSTM from given states: the model's inputs input0 (x), input1 (h0), input2 (c0).
struct StatefulLSTM : duet::nn::Cell<StatefulLSTM> {
  duet::nn::LSTM<4, 5> lstm;
  DUET_CELL_MEMBERS(lstm);
  auto construct(auto x, auto h0, auto c0) { return lstm(x, h0, c0); }
};

struct CellStatesOut : duet::nn::Cell<CellStatesOut> {
  duet::nn::LSTM<4, 5> lstm;
  DUET_CELL_MEMBERS(lstm);
  auto construct(auto x) { return lstm.cell_states(x); }
};

// Parameters of the same names hold the same bits.
template <class A, class B>
void check_same_parameters(A& a, B& b) {
  const auto pa = a.parameters();
  const auto pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].name);
    CHECK(pa[i].name == pb[i].name);
    CHECK(same_bits(Tensor(*pa[i].parameter), Tensor(*pb[i].parameter)));
  }
}

TEST_CASE("io::export_onnx: GRU and LSTM are ONNX's, with its gate order, at any length, and load back by name") {
  const duet_test::TempDir dir;
  SequenceModel net;
  const fs::path file = dir.path / "gru.onnx";
  duet::io::export_onnx(net, Shape{2, 5, 4}, file, {.dynamic_batch = true, .dynamic_axes = {{1, "length"}}});
  onnx::ModelProto model;
  {
    std::ifstream in(file, std::ios::binary);
    REQUIRE(model.ParseFromIstream(&in));
  }
  const auto gru_node = std::ranges::find(model.graph().node(), std::string("GRU"), &onnx::NodeProto::op_type);
  REQUIRE(gru_node != model.graph().node().end());
  // PyTorch's layout stays in the file, under the network's names; the graph reorders it.
  std::set<std::string> initializers;
  for (const auto& t : model.graph().initializer()) initializers.insert(t.name());
  CHECK(initializers.contains("gru.weight_ih_l0"));
  CHECK(initializers.contains("gru.bias_hh_l0"));
  for (const Shape& shape : {Shape{2, 5, 4}, Shape{3, 9, 4}, Shape{1, 1, 4}}) {
    INFO(to_string(shape));
    const Tensor x = duet::randn(shape, 8);
    const Tensor want = pynative_output(net, x);
    check_by_numpy(dir, "gru", x, want);
  }
  SequenceModel other;
  duet::io::load_onnx_weights(file, other);
  check_same_parameters(net, other);
  // load_onnx runs the layer's own operation on the network's own parameters, the nodes that
  // reorder them for ONNX not run: the same names, and (the Dense after it being MatMul and
  // Add) the output within rounding, at any length.
  duet::io::OnnxModel loaded = duet::io::load_onnx(file);
  std::vector<std::string> names;
  for (const auto& p : loaded.parameters()) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"gru.weight_ih_l0", "gru.weight_hh_l0", "gru.bias_ih_l0", "gru.bias_hh_l0",
                                          "head.weight", "head.bias"});
  CHECK(std::ranges::count(loaded.operators(), "Gather") == 0);
  for (const Shape& shape : {Shape{2, 5, 4}, Shape{3, 9, 4}}) {
    const Tensor x = duet::randn(shape, 6);
    const Tensor pynative = loaded(x);
    check_close(pynative, pynative_output(net, x), "gru.onnx loaded back");
    ModeScope graph(duet::GRAPH_MODE);
    CHECK(same_bits(loaded(x), pynative));
  }
  // Recurrences alone come back bit for bit, their initial states too.
  Recurrences recurrences;
  check_export(recurrences, Shape{2, 6, 4}, "recurrences", dir);

  StatefulLSTM lstm;
  const fs::path lstm_file = dir.path / "lstm.onnx";
  duet::io::export_onnx(lstm, {{2, 5, 4}, {2, 5}, {2, 5}}, lstm_file);
  const Tensor x = duet::randn({2, 5, 4}, 1);
  const Tensor h0 = duet::randn({2, 5}, 2);
  const Tensor c0 = duet::randn({2, 5}, 3);
  const Tensor want = pynative_output(lstm, x, h0, c0);
  if (const auto checker = export_checker()) {
    write_raw(dir.path / "x.in", x);
    write_raw(dir.path / "h0.in", h0);
    write_raw(dir.path / "c0.in", c0);
    write_raw(dir.path / "lstm.out", want);
    const std::string command = *checker + " " + lstm_file.string() + " " + (dir.path / "x.in").string() + "," +
                                (dir.path / "h0.in").string() + "," + (dir.path / "c0.in").string() + " " +
                                (dir.path / "lstm.out").string();
    CHECK(std::system(command.c_str()) == 0);
  }
  StatefulLSTM lstm_other;
  duet::io::load_onnx_weights(lstm_file, lstm_other);
  check_same_parameters(lstm, lstm_other);

  // Every step's c has no ONNX form (ONNX's LSTM gives the last only).
  CellStatesOut cells;
  CHECK_THROWS_WITH_AS(duet::io::export_onnx(cells, Shape{2, 5, 4}, dir.path / "c.onnx"),
                       doctest::Contains("LSTM (cell states) (nn::LSTM<4, 5> 'lstm') has no ONNX form"), duet::ValueError);
}

TEST_CASE("io::export_onnx: an operation with no ONNX form, or an input shape that is not concrete, is a ValueError") {
  const duet_test::TempDir dir;
  const auto value_error_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const duet::ValueError& e) {
      return e.what();
    }
    FAIL("expected a duet::ValueError");
    return {};
  };
  Masked net;
  const fs::path file = dir.path / "masked.onnx";
  const std::string message = value_error_of([&] { duet::io::export_onnx(net, Shape{2, 4}, file); });
  CHECK(message.find("Tril") != std::string::npos);
  CHECK(message.find("has no ONNX form") != std::string::npos);
  CHECK(dir.listing().empty());  // nothing written, not even the temporary file
  const std::string shape = value_error_of([&] { duet::io::export_onnx(net, Shape{-1, 4}, file); });
  CHECK(shape.find("the input shape must be concrete") != std::string::npos);
}

}  // namespace
