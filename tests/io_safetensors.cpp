#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <duet/io/safetensors.hpp>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_io_safetensors {

using namespace duet;
using duet_test::Bytes;
using duet_test::format_error_of;
using duet_test::parameter_bytes;
using duet_test::read_file;
using duet_test::SeedNetwork;
using duet_test::TempDir;
using duet_test::write_file;
namespace fs = std::filesystem;

namespace {

// A safetensors file from its header's text and its data, laid out by hand from the format.
Bytes safetensors_file(const std::string& header, const Bytes& data) {
  Bytes out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<unsigned char>(std::uint64_t(header.size()) >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::string tensor(const std::string& name, const std::string& dtype, const std::string& shape, std::uint64_t begin,
                   std::uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

// nn::Dense<2, 2>'s tensors as a file would describe them.
const std::string weight = tensor("weight", "F32", "[2,2]", 0, 16);
const std::string bias = tensor("bias", "F32", "[2]", 16, 24);

std::span<const std::byte> as_span(const Bytes& bytes) { return std::as_bytes(std::span(bytes)); }

template <class Cell>
std::string load_error(const Bytes& file, Cell& cell, io::SafetensorsLoadOptions options = {}) {
  const Bytes before = parameter_bytes(cell);
  const std::string message = format_error_of([&] { io::load_safetensors_bytes(as_span(file), cell, options); });
  CHECK(parameter_bytes(cell) == before);
  return message;
}

std::string load_error(const std::string& header, std::size_t data_size, io::SafetensorsLoadOptions options = {}) {
  nn::Dense<2, 2> cell;
  return load_error(safetensors_file(header, Bytes(data_size, 0x3F)), cell, options);
}

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

const std::string data_where = "safetensors data: ";

// Compares a network's outputs with another's: the same weights give the same bits.
template <class A, class B>
void same_outputs(A& a, B& b, const Tensor& x) {
  CHECK(parameter_bytes(a) == parameter_bytes(b));
  CHECK(duet_test::values_of(a(x)) == duet_test::values_of(b(x)));
}

// tests/safetensors_torch.py's network in duet: tensors named differently in the two
// libraries (BatchNorm's, LayerNorm's) and alike (Dense's).
struct TorchNamed : nn::Cell<TorchNamed> {
  nn::Dense<4, 6> fc1;
  nn::BatchNorm1d<6> bn;
  nn::ReLU relu;
  nn::LayerNorm<6> ln;
  nn::Dense<6, 3> fc2;
  DUET_CELL_MEMBERS(fc1, bn, relu, ln, fc2);
  auto construct(auto x) { return fc2(ln(relu(bn(fc1(x))))); }
};

struct Embedded : nn::Cell<Embedded> {
  nn::Embedding<5, 3> emb;
  DUET_CELL_MEMBERS(emb);
  auto construct(auto x) { return emb(x); }
};

// The tensors the Python side reads (x, and duet's output y) or writes (its output y).
struct InOut : nn::Cell<InOut> {
  nn::Parameter x{zeros({5, 4})};
  nn::Parameter y{zeros({5, 3})};
  DUET_CELL_MEMBERS(x, y);
  auto construct(auto v) { return v; }
};
struct Out : nn::Cell<Out> {
  nn::Parameter y{zeros({5, 3})};
  DUET_CELL_MEMBERS(y);
  auto construct(auto v) { return v; }
};

// A TorchNamed whose moving statistics are not their initial values, in evaluation.
void train_statistics(TorchNamed& net) {
  net.set_train(true);
  EagerScope eager;
  static_cast<void>(net(randn({8, 4}, 21)));
  net.set_train(false);
}

}  // namespace

TEST_CASE("PyTorch's names: saved and loaded in them, and a file in them loaded in duet's names says so") {
  TempDir dir;
  const fs::path file = dir.path / "pytorch.safetensors";
  set_seed(3);
  TorchNamed net;
  train_statistics(net);
  io::save_safetensors(net, file, {.names = io::TensorNames::pytorch});
  TorchNamed loaded;
  const Tensor x = randn({5, 4}, 4);
  io::load_safetensors(file, loaded, {.names = io::TensorNames::pytorch});
  loaded.set_train(false);
  same_outputs(net, loaded, x);

  TorchNamed in_duet_names;
  const std::string error = format_error_of([&] { io::load_safetensors(file, in_duet_names); });
  CHECK(error.find("'bn.running_mean'") != std::string::npos);
  CHECK(error.find("'bn.num_batches_tracked'") != std::string::npos);
  CHECK(error.find("load it with {.names = duet::io::TensorNames::pytorch}") != std::string::npos);

  set_seed(4);
  Embedded embedded;
  io::save_safetensors(embedded, file, {.names = io::TensorNames::pytorch});
  Embedded embedded_loaded;
  io::load_safetensors(file, embedded_loaded, {.names = io::TensorNames::pytorch});
  CHECK(parameter_bytes(embedded) == parameter_bytes(embedded_loaded));
  CHECK(format_error_of([&] { io::load_safetensors(file, embedded_loaded); }) ==
        "safetensors file '" + file.string() +
            "': the file's parameter(s) 'emb.weight' are not in the cell, and the file has no value for the cell's "
            "parameter(s) 'emb.embedding_table'; the file names normalisation layers', embeddings' and attention's "
            "tensors as PyTorch does (weight, bias, running_mean, running_var, in_proj_weight): load it with {.names = "
            "duet::io::TensorNames::pytorch}");

  // A layer with a bias in the file and none in the cell: duet's convolutions have none by default.
  nn::SequentialCell<nn::Dense<4, 3>> with_bias;
  io::save_safetensors(with_bias, file);
  nn::SequentialCell<nn::Dense<4, 3, float, false>> without;
  CHECK(format_error_of([&] { io::load_safetensors(file, without); }) ==
        "safetensors file '" + file.string() +
            "': the file's parameter(s) '0.bias' are not in the cell; the cell's '0' has no bias: duet's "
            "convolutions have none unless has_bias is set (PyTorch's have one unless bias=False)");
}

TEST_CASE("a network saved as safetensors and loaded into a fresh one computes the same bits, in each mode") {
  TempDir dir;
  duet_test::ModeGuard guard;
  const Tensor x = randn({16, 1, 28, 28}, 5);
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode == GRAPH_MODE);
    set_context({.mode = mode});
    set_seed(1);
    SeedNetwork<> a;
    set_seed(2);
    SeedNetwork<> b;
    REQUIRE(parameter_bytes(a) != parameter_bytes(b));
    const Tensor before = a(x);
    const fs::path path = dir.path / "seed.safetensors";
    io::save_safetensors(a, path);
    const CheckpointLoad result = io::load_safetensors(path, b);
    CHECK(result.param_not_load.empty());
    CHECK(result.ckpt_not_load.empty());
    same_outputs(a, b, x);
    CHECK(duet_test::values_of(b(x)) == duet_test::values_of(before));
  }
}

TEST_CASE("safetensors written from a network in graph mode load into it in PyNative mode, and back") {
  TempDir dir;
  set_seed(1);
  SeedNetwork<GRAPH_MODE> graph;
  set_seed(2);
  SeedNetwork<PYNATIVE_MODE> eager;
  const Tensor x = randn({8, 1, 28, 28}, 6);
  const Tensor before = graph(x);
  const fs::path path = dir.path / "seed.safetensors";
  io::save_safetensors(graph, path);
  io::load_safetensors(path, eager);
  same_outputs(graph, eager, x);
  CHECK(duet_test::values_of(eager(x)) == duet_test::values_of(before));

  eager.dense_relu_sequential.get<4>().bias.data()[0] += 1;
  io::save_safetensors(eager, path);
  io::load_safetensors(path, graph);
  same_outputs(graph, eager, x);
}

TEST_CASE("save_safetensors writes the format's layout: length, padded JSON header, elements in the cell's order") {
  TempDir dir;
  using DoubleNet = nn::SequentialCell<nn::Dense<3, 2, double>, nn::Dense<2, 1, double>>;
  set_seed(1);
  DoubleNet net;
  const fs::path path = dir.path / "double.safetensors";
  io::save_safetensors(net, path);

  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}," + tensor("0.weight", "F64", "[2,3]", 0, 48) + "," +
                       tensor("0.bias", "F64", "[2]", 48, 64) + "," + tensor("1.weight", "F64", "[1,2]", 64, 80) +
                       "," + tensor("1.bias", "F64", "[1]", 80, 88) + "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  CHECK(read_file(path) == safetensors_file(header, parameter_bytes(net)));
  CHECK((8 + header.size()) % 8 == 0);

  DoubleNet other;
  io::load_safetensors(path, other);
  CHECK(parameter_bytes(other) == parameter_bytes(net));
}

TEST_CASE("a file laid out unlike duet's own (other order, no padding, spaces, metadata) loads") {
  nn::Dense<2, 2> cell;
  const std::vector<float> values{1.5f, -2.f, 3.25f, 4.f, 0.5f, -0.75f};
  Bytes data(values.size() * sizeof(float));
  std::memcpy(data.data(), values.data(), data.size());
  const std::string header = "{ \"bias\": {\"shape\": [2], \"data_offsets\": [16, 24], \"dtype\": \"F32\"},"
                             " \"__metadata__\": {\"format\": \"np\"},"
                             " \"weight\": {\"data_offsets\": [0, 16], \"dtype\": \"F32\", \"shape\": [2, 2]} }  ";
  io::load_safetensors_bytes(as_span(safetensors_file(header, data)), cell);
  CHECK(duet_test::values_of(cell.weight) == std::vector<double>{1.5, -2, 3.25, 4});
  CHECK(duet_test::values_of(cell.bias) == std::vector<double>{0.5, -0.75});
}

TEST_CASE("a truncated file, a huge declared length, a header that is not JSON are FormatErrors") {
  nn::Dense<2, 2> cell;
  CHECK(load_error(Bytes{1, 2, 3, 4, 5}, cell) ==
        data_where + "truncated: 5 bytes, fewer than the 8 of the header's length");
  CHECK(load_error(Bytes{0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, '{', '}', ' '}, cell) ==
        data_where +
            "truncated or not a safetensors file: its header's length is 18446744073709551615 bytes, but 3 follow it");
  const Bytes whole = safetensors_file("{" + weight + "," + bias + "}", Bytes(24, 0));
  CHECK(load_error(Bytes(whole.begin(), whole.begin() + 20), cell) ==
        data_where + "truncated or not a safetensors file: its header's length is 120 bytes, but 12 follow it");
  // A header longer than the reference implementation accepts, in a file that holds it.
  Bytes long_header(8 + 100'000'001, ' ');
  const std::uint64_t length = 100'000'001;
  for (int i = 0; i < 8; ++i) long_header[std::size_t(i)] = static_cast<unsigned char>(length >> (8 * i));
  CHECK(load_error(long_header, cell) ==
        data_where + "malformed: its header's length is 100000001 bytes, more than safetensors allows (100000000)");

  CHECK(load_error("[1]", 0) == data_where + "not a safetensors file: its header does not start with '{'");
  CHECK(load_error("", 0) == data_where + "not a safetensors file: its header does not start with '{'");
  const std::string syntax = load_error("{\"weight\":", 0);
  CHECK(starts_with(syntax, data_where + "malformed header: [json.exception.parse_error.101] parse error"));
  CHECK(starts_with(load_error("{\"w\":\"\xff\"}", 0), data_where + "malformed header: [json.exception.parse_error"));
  CHECK(load_error("{\"a\":{\"shape\":[[1]]}}", 0) ==
        data_where + "malformed header: values nested deeper than a safetensors header's 3 levels");
  CHECK(load_error("{" + weight + "," + weight + "}", 16) ==
        data_where + "malformed header: the key 'weight' appears twice in one object");
  CHECK(load_error("{\"weight\":{\"dtype\":\"F32\",\"dtype\":\"F32\"}}", 0) ==
        data_where + "malformed header: the key 'dtype' appears twice in one object");
  CHECK(load_error("{\"__metadata__\":{\"a\":1}}", 0) ==
        data_where + "malformed header: __metadata__ is {\"a\":1}, not an object of strings");
}

TEST_CASE("every malformed tensor entry is a FormatError naming the tensor") {
  const std::string bad = data_where + "malformed header: tensor 'weight'";
  CHECK(load_error("{\"weight\":5}", 0) == bad + " is 5, not an object of dtype, shape and data_offsets");
  CHECK(load_error("{\"weight\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8) == bad + " has no dtype");
  CHECK(load_error("{\"weight\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8) == bad + " has no shape");
  CHECK(load_error("{\"weight\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8) == bad + " has no data_offsets");
  CHECK(load_error("{\"weight\":{\"dtype\":1,\"shape\":[2],\"data_offsets\":[0,8]}}", 8) ==
        bad + "'s dtype is 1, not a string");
  CHECK(load_error("{\"weight\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8) ==
        bad + "'s shape is 2, not an array");
  CHECK(load_error("{" + tensor("weight", "F32", "[-2]", 0, 8) + "}", 8) ==
        bad + "'s shape includes -2, not an integer from 0 to 2^63 - 1");
  CHECK(load_error("{" + tensor("weight", "F32", "[2.5]", 0, 8) + "}", 8) ==
        bad + "'s shape includes 2.5, not an integer from 0 to 2^63 - 1");
  CHECK(load_error("{" + tensor("weight", "F32", "[9223372036854775808]", 0, 8) + "}", 8) ==
        bad + "'s shape includes 9223372036854775808, not an integer from 0 to 2^63 - 1");
  CHECK(load_error("{\"weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8) ==
        bad + "'s data_offsets are [0], not an array [begin, end]");
  CHECK(load_error("{\"weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,\"8\"]}}", 8) ==
        bad + "'s data_offsets includes \"8\", not an integer from 0 to 2^63 - 1");
  CHECK(load_error("{" + tensor("weight", "F32", "[2]", 8, 0) + "}", 8) ==
        bad + "'s data_offsets [8, 0] end before they begin");
  CHECK(load_error("{" + tensor("weight", "F32", "[2,2]", 0, 16) + "}", 12) ==
        bad + "'s data_offsets [0, 16] run past the data's end at 12 (a truncated file?)");
  CHECK(load_error("{" + tensor("weight", "F32", "[2,3]", 0, 16) + "}", 16) ==
        bad + " of dtype F32 and shape [2, 3] needs 24 bytes, but its data_offsets [0, 16] hold 16");
  CHECK(load_error("{" + tensor("weight", "F64", "[4294967296,4294967296,16]", 0, 16) + "}", 16) ==
        bad + " of dtype F64 and shape [4294967296, 4294967296, 16] needs 2^64 bytes or more, but its data_offsets "
              "[0, 16] hold 16");
}

TEST_CASE("tensors' byte ranges must cover the data exactly: overlaps, gaps and trailing bytes are named") {
  const std::string bad = data_where + "malformed header: ";
  CHECK(load_error("{" + weight + "," + tensor("bias", "F32", "[2]", 8, 16) + "}", 16) ==
        bad + "tensor 'bias''s bytes [8, 16) overlap those of tensor 'weight', which end at 16");
  CHECK(load_error("{" + weight + "," + tensor("bias", "F32", "[2]", 20, 28) + "}", 28) ==
        bad + "the data's bytes [16, 20) belong to no tensor (tensor 'bias' starts at 20)");
  CHECK(load_error("{" + weight + "," + bias + "}", 28) ==
        bad + "the data's bytes [24, 28) at the end of the file belong to no tensor");
  CHECK(load_error("{" + tensor("bias", "F32", "[2]", 8, 16) + "}", 16) ==
        bad + "the data's bytes [0, 8) belong to no tensor (tensor 'bias' starts at 8)");
}

TEST_CASE("a tensor of another shape, type or name is named with both, not strict, the rest loads") {
  const std::string where = data_where;
  CHECK(load_error("{" + tensor("weight", "F32", "[4]", 0, 16) + "," + bias + "}", 24) ==
        where + "parameter 'weight' has shape [2, 2] in the cell but [4] in the file");
  CHECK(load_error("{" + tensor("weight", "F64", "[2,2]", 0, 32) + "," + tensor("bias", "F32", "[2]", 32, 40) + "}",
                   40) == where + "parameter 'weight' is Float32 in the cell but Float64 in the file");
  CHECK(load_error("{" + weight + "}", 16) == where + "the file has no value for the cell's parameter(s) 'bias'");
  // Two differences, the file's names in alphabetical order: the cell's first parameter is named,
  // as a checkpoint names it (helper-93: the file's first name was).
  CHECK(load_error("{" + tensor("bias", "F32", "[3]", 0, 12) + "," + tensor("weight", "F32", "[4]", 12, 28) + "}",
                   28) == where + "parameter 'weight' has shape [2, 2] in the cell but [4] in the file");
  CHECK(load_error("{" + weight + "," + bias + "," + tensor("extra", "I32", "[1]", 24, 28) + "}", 28) ==
        where + "the file's parameter(s) 'extra' are not in the cell");

  nn::Dense<2, 2> cell;
  const Bytes before = parameter_bytes(cell);
  const Bytes weight_before(before.begin(), before.begin() + 16);
  const Bytes data{0, 0, 0x80, 0x3F, 0, 0, 0, 0x40, 9, 9, 9, 9, 9, 9, 9, 9};  // bias 1.f, 2.f; then "extra"
  const std::string header = "{" + tensor("bias", "F32", "[2]", 0, 8) + "," + tensor("weight", "F16", "[2,2]", 8, 16) +
                             "," + tensor("extra", "I8", "[0]", 16, 16) + "}";
  const CheckpointLoad result =
      io::load_safetensors_bytes(as_span(safetensors_file(header, data)), cell, {.strict = false});
  CHECK(result.param_not_load == std::vector<std::string>{"weight"});
  CHECK(result.ckpt_not_load == std::vector<std::string>{"extra", "weight"});
  CHECK(duet_test::values_of(cell.bias) == std::vector<double>{1, 2});
  const Bytes after = parameter_bytes(cell);
  CHECK(Bytes(after.begin(), after.begin() + 16) == weight_before);
}

TEST_CASE("a dtype duet does not read is refused by a strict load, naming the tensor and its dtype") {
  CHECK(load_error("{" + tensor("weight", "F16", "[2,2]", 0, 8) + "," + tensor("bias", "F32", "[2]", 8, 16) + "}",
                   16) == data_where +
                              "tensor 'weight' has dtype 'F16', which duet does not read (duet reads F32, F64, I32, "
                              "I64 and U8); the cell's parameter is Float32 [2, 2]");
  CHECK(load_error("{" + weight + "," + bias + "," + tensor("extra", "BF16", "[2]", 24, 28) + "}", 28) ==
        data_where + "tensor 'extra' has dtype 'BF16', which duet does not read (duet reads F32, F64, I32, I64 and U8)");
  CHECK(load_error("{" + weight + "," + bias + "," + tensor("extra", "F7", "[2]", 24, 28) + "}", 28) ==
        data_where +
            "tensor 'extra' has dtype 'F7', a dtype safetensors does not define (duet reads F32, F64, I32, I64 and U8)");
  CHECK(load_error("{" + weight + "," + bias + "," + tensor("extra", "U8", "[1,1,1,1,1,1,1,1,1]", 24, 25) + "}", 25) ==
        data_where + "tensor 'extra' has dtype 'U8', of rank 9, more than duet's 8 (duet reads F32, F64, I32, I64 and U8)");
  CHECK(load_error("{" + weight + "," + bias + "," + tensor("extra", "F16", "[3]", 24, 28) + "}", 28) ==
        data_where + "malformed header: tensor 'extra' of dtype F16 and shape [3] needs 6 bytes, but its data_offsets "
                     "[24, 28] hold 4");
}

TEST_CASE("every truncation and every byte changed of a safetensors file loads or is a FormatError") {
  TempDir dir;
  nn::Dense<2, 2> source;
  const fs::path good = dir.path / "good.safetensors";
  io::save_safetensors(source, good);
  const Bytes file = read_file(good);
  nn::Dense<2, 2> target;
  const Bytes before = parameter_bytes(target);
  for (std::size_t n = 0; n < file.size(); ++n) {
    CAPTURE(n);
    load_error(Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n)), target);
    REQUIRE(parameter_bytes(target) == before);
  }
  const std::size_t data_start = file.size() - 24;
  // The same file with the target's own values, to undo a load that succeeds.
  Bytes restore(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(data_start));
  restore.insert(restore.end(), before.begin(), before.end());
  for (std::size_t i = 0; i < file.size(); ++i) {
    for (unsigned char mask : {0x01, 0x20, 0x80, 0xFF}) {
      CAPTURE(i);
      CAPTURE(int(mask));
      Bytes changed = file;
      changed[i] ^= mask;
      if (i >= data_start) {
        // The elements are not checked: any bits are a value.
        io::load_safetensors_bytes(as_span(changed), target);
        CHECK(parameter_bytes(target) == Bytes(changed.begin() + static_cast<std::ptrdiff_t>(data_start), changed.end()));
      } else {
        try {
          io::load_safetensors_bytes(as_span(changed), target);
          // A change that leaves the header valid and fitting (a letter of the metadata).
          CHECK(parameter_bytes(target) == parameter_bytes(source));
        } catch (const FormatError&) {
          CHECK(parameter_bytes(target) == before);
        }
      }
      io::load_safetensors_bytes(as_span(restore), target);
    }
  }
}

TEST_CASE("saving and loading name the file: unreadable paths, a cell without parameters") {
  TempDir dir;
  nn::Dense<2, 2> cell;
  const fs::path missing = dir.path / "missing.safetensors";
  CHECK_THROWS_WITH_AS(io::load_safetensors(missing, cell),
                       ("safetensors file '" + missing.string() + "': cannot open: No such file or directory").c_str(),
                       IOError);
  const fs::path nowhere = dir.path / "no" / "such" / "dir.safetensors";
  CHECK_THROWS_AS(io::save_safetensors(cell, nowhere), IOError);
  nn::ReLU nothing;
  CHECK_THROWS_AS(io::save_safetensors(nothing, dir.path / "relu.safetensors"), ValueError);
  const fs::path bad = dir.path / "bad.safetensors";
  write_file(bad, Bytes{1, 2});
  CHECK(format_error_of([&] { io::load_safetensors(bad, cell); }) ==
        "safetensors file '" + bad.string() + "': truncated: 2 bytes, fewer than the 8 of the header's length");
  CHECK(dir.listing() == std::vector<std::string>{"bad.safetensors"});
}

namespace {

// The first python3 that has numpy: the one on PATH, else Debian's, where python3-numpy
// installs (a PATH may lead to another Python first, pyenv's for one).
std::optional<std::string> python_with_numpy() {
  for (const std::string python : {"python3", "/usr/bin/python3"}) {
    if (std::system((python + " -c 'import numpy' >/dev/null 2>&1").c_str()) == 0) return python;
  }
  return std::nullopt;
}

// tests/safetensors_reader.py, beside this file.
const fs::path python_reader = fs::path(__FILE__).parent_path() / "safetensors_reader.py";

std::string quoted(const fs::path& path) { return std::string("'").append(path.string()).append("'"); }

void run(const std::string& command) {
  INFO(command);
  REQUIRE(std::system(command.c_str()) == 0);
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string part; std::getline(in, part, separator);) out.push_back(part);
  return out;
}

// What the Python reader prints of a cell's file equals the cell's parameters, bit for bit.
template <ElementType T>
void check_python_dump(const std::string& python, nn::BasicDynamicCell<T>& cell, const TempDir& dir) {
  const fs::path file = dir.path / "duet.safetensors";
  const fs::path dump = dir.path / "dump.txt";
  io::save_safetensors(cell, file);
  run(python + " " + quoted(python_reader) + " dump " + quoted(file) + " > " + quoted(dump));
  const Bytes text = read_file(dump);
  const std::vector<std::string> lines = split(std::string(text.begin(), text.end()), '\n');
  const auto parameters = cell.parameters();
  REQUIRE(lines.size() == parameters.size() + 1);
  CHECK(lines[0] == "{\"format\": \"pt\"}");
  for (std::size_t k = 0; k < parameters.size(); ++k) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const std::string& name = parameters[k].name;
    const auto* p = parameters[k].parameter;
    CAPTURE(name);
    const std::vector<std::string> fields = split(lines[k + 1], '\t');
    REQUIRE(fields.size() == 4);
    CHECK(fields[0] == name);
    CHECK(fields[1] == (sizeof(T) == 4 ? "F32" : "F64"));
    std::string shape;
    for (const index_t d : p->shape()) shape.append(shape.empty() ? "" : ",").append(std::to_string(d));
    CHECK(fields[2] == shape);
    const std::vector<std::string> values = split(fields[3], ' ');
    REQUIRE(values.size() == static_cast<std::size_t>(p->numel()));
    for (std::size_t i = 0; i < values.size(); ++i) {
      CAPTURE(i);
      REQUIRE(std::strtod(values[i].c_str(), nullptr) == static_cast<double>(p->data()[i]));
    }
  }
}

// Each parameter of a cell loaded from the Python writer's file holds, for the k-th in its
// command's order, (i - 3k) / 8 at element i.
template <ElementType T>
void check_python_values(nn::BasicDynamicCell<T>& cell, const std::vector<std::string>& order) {
  for (const auto& parameter : cell.parameters()) {
    const std::string& name = parameter.name;
    const auto* p = parameter.parameter;
    CAPTURE(name);
    const auto k = static_cast<index_t>(std::find(order.begin(), order.end(), name) - order.begin());
    REQUIRE(static_cast<std::size_t>(k) < order.size());
    for (index_t i = 0; i < p->numel(); ++i) REQUIRE(p->data()[i] == static_cast<T>(i - 3 * k) / 8);
  }
}

}  // namespace

namespace {
struct Attending : nn::Cell<Attending> {
  nn::MultiheadAttention<8, 2> attn;
  nn::Dense<8, 3> in_proj;  // a user's layer of the same name keeps duet's (and PyTorch's) in_proj.weight
  DUET_CELL_MEMBERS(attn, in_proj);
  auto construct(auto x) { return in_proj(attn(x)); }
};
}  // namespace

TEST_CASE("nn::MultiheadAttention's in_proj_weight and in_proj_bias in PyTorch's names, and a name map") {
  TempDir dir;
  const fs::path file = dir.path / "attention.safetensors";
  set_seed(8);
  Attending net;
  io::save_safetensors(net, file, {.names = io::TensorNames::pytorch});
  std::ifstream in(file, std::ios::binary);
  std::uint64_t length = 0;
  in.read(reinterpret_cast<char*>(&length), sizeof length);
  std::string header(length, ' ');
  in.read(header.data(), static_cast<std::streamsize>(length));
  const nlohmann::json entries = nlohmann::json::parse(header);
  std::vector<std::string> saved;
  for (const auto& [name, t] : entries.items())
    if (name != "__metadata__") saved.push_back(name);
  std::ranges::sort(saved);
  CHECK(saved == std::vector<std::string>{"attn.in_proj_bias", "attn.in_proj_weight", "attn.out_proj.bias",
                                          "attn.out_proj.weight", "in_proj.bias", "in_proj.weight"});
  Attending loaded;
  io::load_safetensors(file, loaded, {.names = io::TensorNames::pytorch});
  CHECK(parameter_bytes(net) == parameter_bytes(loaded));
  // In duet's names the error says which names to load it with.
  Attending in_duet_names;
  const std::string error = format_error_of([&] { io::load_safetensors(file, in_duet_names); });
  CHECK(error.find("'attn.in_proj_weight'") != std::string::npos);
  CHECK(error.find("load it with {.names = duet::io::TensorNames::pytorch}") != std::string::npos);
  // A name map, as load_onnx_weights's: the cell's name -> the file's.
  Attending mapped;
  io::load_safetensors(
      file, mapped,
      {.name_map = {{"attn.in_proj.weight", "attn.in_proj_weight"}, {"attn.in_proj.bias", "attn.in_proj_bias"}}});
  CHECK(parameter_bytes(net) == parameter_bytes(mapped));
  CHECK_THROWS_WITH_AS(io::load_safetensors(file, mapped, {.name_map = {{"attn.q.weight", "x"}}}),
                       doctest::Contains("the name map gives 'x' for 'attn.q.weight', which is not a tensor of"),
                       duet::ValueError);
  // A module renamed on one side: the error suggests a name map.
  nn::SequentialCell<nn::Dense<4, 3>> plain;
  io::save_safetensors(plain, file);
  Attending other;
  const std::string unmapped = format_error_of([&] { io::load_safetensors(file, other, {.strict = true}); });
  CHECK(unmapped.find("give them in {.name_map = {{\"") != std::string::npos);
}

TEST_CASE("an independent reader (Python, json + numpy) reads duet's safetensors, and duet reads its files") {
  const std::optional<std::string> python = python_with_numpy();
  if (!python) {
    MESSAGE("SKIPPED: python3 with numpy not found (tools/install-deps.sh installs python3-numpy), so duet's "
            "safetensors files were not checked against an independent reader");
    return;
  }
  TempDir dir;
  using SmallNet = nn::SequentialCell<nn::Dense<4, 3>, nn::ReLU, nn::Dense<3, 2>>;
  using DoubleNet = nn::SequentialCell<nn::Dense<3, 2, double>, nn::Dense<2, 1, double>>;
  set_seed(7);
  SmallNet small;
  DoubleNet twice;
  check_python_dump(*python, small, dir);
  check_python_dump(*python, twice, dir);

  const fs::path file = dir.path / "python.safetensors";
  const std::string write = *python + " " + quoted(python_reader) + " write " + quoted(file);
  run(write + " 0.weight:F32:3,4 0.bias:F32:3 2.weight:F32:2,3 2.bias:F32:2");
  SmallNet loaded;
  io::load_safetensors(file, loaded);
  check_python_values(loaded, {"0.weight", "0.bias", "2.weight", "2.bias"});
  const Tensor x = randn({5, 4}, 8);
  // The values came through intact: the network computes with them.
  CHECK(duet_test::values_of(loaded(x)) != duet_test::values_of(small(x)));
  run(write + " 1.bias:F64:1 1.weight:F64:1,2 0.bias:F64:2 0.weight:F64:2,3");
  io::load_safetensors(file, twice);
  check_python_values(twice, {"1.bias", "1.weight", "0.bias", "0.weight"});

  // PyTorch's BatchNorm keeps an I64 step count, and half-precision weights are F16: a strict
  // load names them, a load that is not strict leaves them out and says so.
  run(write + " 0.weight:F32:3,4 0.bias:F32:3 2.weight:F32:2,3 2.bias:F32:2 bn.num_batches_tracked:I64: "
              "half:F16:2,2");
  SmallNet partial;
  CHECK(format_error_of([&] { io::load_safetensors(file, partial); }) ==
        "safetensors file '" + file.string() +
            "': tensor 'half' has dtype 'F16', which duet does not read (duet reads F32, F64, I32, I64 and U8)");
  const CheckpointLoad result = io::load_safetensors(file, partial, {.strict = false});
  CHECK(result.param_not_load.empty());
  CHECK(result.ckpt_not_load == std::vector<std::string>{"bn.num_batches_tracked", "half"});
  check_python_values(partial, {"0.weight", "0.bias", "2.weight", "2.bias"});
}

TEST_CASE("PyTorch loads duet's file in its names with load_state_dict(strict=True) and computes the same, and duet loads PyTorch's") {
  std::optional<std::string> python;
  for (const std::string candidate : {"python3", "/usr/bin/python3"}) {
    if (std::system((candidate + " -c 'import torch, numpy' >/dev/null 2>&1").c_str()) == 0) {
      python = candidate;
      break;
    }
  }
  if (!python) {
    MESSAGE("SKIPPED: no python3 with torch and numpy (Debian: python3-torch, python3-numpy), so the exchange "
            "in PyTorch's names was not checked against PyTorch");
    return;
  }
  TempDir dir;
  const fs::path duet_file = dir.path / "duet.safetensors", io_file = dir.path / "io.safetensors",
                 torch_file = dir.path / "torch.safetensors";
  set_seed(6);
  TorchNamed net;
  train_statistics(net);
  const Tensor x = randn({5, 4}, 9);
  io::save_safetensors(net, duet_file, {.names = io::TensorNames::pytorch});
  InOut io_tensors;
  io_tensors.x.set_data(x.clone());
  {
    EagerScope eager;
    io_tensors.y.set_data(net(x).clone());
  }
  io::save_safetensors(io_tensors, io_file);
  run(*python + " " + quoted(fs::path(__FILE__).parent_path() / "safetensors_torch.py") + " " + quoted(duet_file) +
      " " + quoted(io_file) + " " + quoted(torch_file));

  // PyTorch's state_dict (num_batches_tracked included) into a fresh network: its output in both modes.
  TorchNamed from_torch;
  io::load_safetensors(torch_file, from_torch, {.names = io::TensorNames::pytorch});
  from_torch.set_train(false);
  Out torch_output;
  io::load_safetensors(fs::path(torch_file.string() + ".out"), torch_output);
  const std::vector<double> expected = duet_test::values_of(static_cast<const Tensor&>(torch_output.y));
  duet_test::ModeGuard guard;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    const std::vector<double> y = duet_test::values_of(from_torch(x));
    REQUIRE(y.size() == expected.size());
    for (std::size_t i = 0; i < y.size(); ++i) CHECK(y[i] == doctest::Approx(expected[i]).epsilon(1e-5));
  }
  CHECK(duet_test::values_of(from_torch(x)) != duet_test::values_of(net(x)));
}

}  // namespace tests_io_safetensors
