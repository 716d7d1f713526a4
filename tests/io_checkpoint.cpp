#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support.hpp"

namespace tests_io_checkpoint {

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

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

// For each byte from `first` on and each of three masks (its low bit, high bit, all bits):
// the file with that byte changed, written to `path`, then check(i, changed).
template <class Check>
void for_each_changed_byte(const Bytes& file, std::size_t first, const fs::path& path, Check&& check) {
  for (std::size_t i = first; i < file.size(); ++i) {
    for (unsigned char mask : {0x01, 0x80, 0xFF}) {
      CAPTURE(i);
      CAPTURE(int(mask));
      Bytes changed = file;
      changed[i] ^= mask;
      write_file(path, changed);
      check(i, changed);
    }
  }
}

// A checkpoint written field by field, for files save_checkpoint would never write.
struct Record {
  std::string name;
  std::uint8_t dtype;
  std::vector<std::int64_t> dims;
  Bytes data;
};

// The optimiser section of a version 2 or 3 file; an empty type writes none.
struct OptimizerSection {
  std::string type;
  std::int64_t step = 0;
  std::vector<Record> state;
};

using Generators = std::vector<std::pair<std::string, GeneratorState>>;

// `generators` follow the optimiser section in version 3.
Bytes checkpoint_bytes(const std::vector<Record>& records, std::uint32_t count, std::uint32_t version = 3,
                       const OptimizerSection& optimizer = {}, const Generators& generators = {}) {
  Bytes out{'D', 'U', 'E', 'T', 'C', 'K', 'P', 'T'};
  const auto put = [&](std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
  };
  const auto put_records = [&](const std::vector<Record>& rs) {
    for (const Record& r : rs) {
      put(r.name.size(), 4);
      out.insert(out.end(), r.name.begin(), r.name.end());
      put(r.dtype, 1);
      put(r.dims.size(), 1);
      for (std::int64_t d : r.dims) put(static_cast<std::uint64_t>(d), 8);
      out.insert(out.end(), r.data.begin(), r.data.end());
    }
  };
  put(version, 4);
  put(count, 4);
  put_records(records);
  if (version >= 2) {
    put(optimizer.type.size(), 4);
    out.insert(out.end(), optimizer.type.begin(), optimizer.type.end());
    if (!optimizer.type.empty()) {
      put(static_cast<std::uint64_t>(optimizer.step), 8);
      put(optimizer.state.size(), 4);
      put_records(optimizer.state);
      if (version >= 3) {
        put(generators.size(), 4);
        for (const auto& [name, state] : generators) {
          put(name.size(), 4);
          out.insert(out.end(), name.begin(), name.end());
          for (std::uint64_t word : state.words) put(word, 8);
          put(state.has_spare ? 1 : 0, 1);
          put(std::bit_cast<std::uint64_t>(state.spare), 8);
        }
      }
    }
  }
  put(crc32_z(0, out.data(), out.size()), 4);
  return out;
}

Bytes floats(std::initializer_list<float> values) {
  Bytes out(values.size() * sizeof(float));
  std::memcpy(out.data(), values.begin(), out.size());
  return out;
}

using SmallNet = nn::SequentialCell<nn::Dense<4, 3>, nn::ReLU, nn::Dense<3, 2>>;

// The seed network with 100 inputs instead of 784: the same names, one other shape.
struct NarrowNetwork : nn::Cell<NarrowNetwork> {
  nn::Flatten flatten;
  nn::SequentialCell<nn::Dense<100, 512>, nn::ReLU, nn::Dense<512, 512>, nn::ReLU, nn::Dense<512, 10>>
      dense_relu_sequential;
  DUET_CELL_MEMBERS(flatten, dense_relu_sequential);

  auto construct(auto x) { return dense_relu_sequential(flatten(x)); }
};

}  // namespace

TEST_CASE("a float network saved and loaded into another gets its parameters and its outputs") {
  TempDir dir;
  set_seed(1);
  SmallNet a;
  set_seed(2);
  SmallNet b;
  const Tensor x = randn({5, 4}, 3);
  REQUIRE(parameter_bytes(a) != parameter_bytes(b));
  const fs::path path = dir.path / "small.ckpt";
  save_checkpoint(a, path);
  load_checkpoint(path, b);
  CHECK(parameter_bytes(a) == parameter_bytes(b));
  CHECK(duet_test::values_of(a(x)) == duet_test::values_of(b(x)));
}

TEST_CASE("a double network round-trips, and the file has the documented layout") {
  TempDir dir;
  using DoubleNet = nn::SequentialCell<nn::Dense<3, 2, double>, nn::Dense<2, 1, double>>;
  set_seed(1);
  DoubleNet a;
  set_seed(2);
  DoubleNet b;
  const fs::path path = dir.path / "double.ckpt";
  save_checkpoint(a, path);
  load_checkpoint(path, b);
  CHECK(parameter_bytes(a) == parameter_bytes(b));

  std::vector<Record> expected;
  for (const auto& [name, p] : a.parameters()) {
    const auto* data = reinterpret_cast<const unsigned char*>(p->data());
    expected.push_back({name,
                        static_cast<std::uint8_t>(DType::float64),
                        {p->shape().begin(), p->shape().end()},
                        Bytes(data, data + p->numel() * 8)});
  }
  CHECK(read_file(path) == checkpoint_bytes(expected, 4));
  CHECK(expected[0].name == "0.weight");
  CHECK(expected[3].name == "1.bias");
}

TEST_CASE("a checkpoint of a network used in graph mode loads into the same network used in PyNative mode") {
  TempDir dir;
  set_seed(1);
  SeedNetwork<GRAPH_MODE> graph;
  set_seed(2);
  SeedNetwork<PYNATIVE_MODE> eager;
  const Tensor x = randn({16, 1, 28, 28}, 5);
  const Tensor before = graph(x);
  const fs::path path = dir.path / "seed.ckpt";
  save_checkpoint(graph, path);
  load_checkpoint(path, eager);
  CHECK(parameter_bytes(graph) == parameter_bytes(eager));
  // Both modes compute each output the same way, so the same weights give the same bits.
  CHECK(duet_test::values_of(eager(x)) == duet_test::values_of(before));
  CHECK(duet_test::values_of(graph(x)) == duet_test::values_of(before));

  // And back, after PyNative training would have changed the weights.
  eager.dense_relu_sequential.get<4>().bias.data()[0] += 1;
  save_checkpoint(eager, path);
  load_checkpoint(path, graph);
  CHECK(parameter_bytes(graph) == parameter_bytes(eager));
}

TEST_CASE(
    "every truncation and every single-byte change of a checkpoint is a FormatError that leaves the cell as it was") {
  TempDir dir;
  nn::Dense<2, 2> source;
  const fs::path good = dir.path / "good.ckpt";
  save_checkpoint(source, good);
  const Bytes file = read_file(good);
  REQUIRE(file.size() == 16 + (6 + 6 + 16 + 16) + (6 + 4 + 8 + 8) + 4 + 4);

  nn::Dense<2, 2> target;
  const Bytes before = parameter_bytes(target);
  REQUIRE(before != parameter_bytes(source));
  const fs::path bad = dir.path / "bad.ckpt";
  const std::string where = "checkpoint '" + bad.string() + "': ";

  for (std::size_t n = 0; n < file.size(); ++n) {
    CAPTURE(n);
    write_file(bad, Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n)));
    const std::string message = format_error_of([&] { load_checkpoint(bad, target); });
    CHECK(starts_with(message, where + "truncated at byte " + std::to_string(n)));
    CHECK(message.ends_with("; a checkpoint of this cell without optimizer state is 94 bytes"));
    REQUIRE(parameter_bytes(target) == before);
  }
  for_each_changed_byte(file, 0, bad, [&](std::size_t i, const Bytes& changed) {
    const std::string message = format_error_of([&] { load_checkpoint(bad, target); });
    // A version changed into another this duet reads fails the checksum.
    const bool read_version = i == 8 && changed[8] >= 1 && changed[8] <= 3;
    if (i < 8) {
      CHECK(message == where + "not a duet checkpoint: it does not start with \"DUETCKPT\"");
    } else if (i < 12 && !read_version) {
      CHECK(starts_with(message, where + "format version "));
    } else {
      CHECK(message == where + "checksum mismatch: the file is damaged");
    }
    REQUIRE(parameter_bytes(target) == before);
  });
  load_checkpoint(good, target);
  CHECK(parameter_bytes(target) == parameter_bytes(source));
}

TEST_CASE(
    "a cut checkpoint with optimizer state says it is truncated, whichever way it is read; damage says checksum") {
  TempDir dir;
  SmallNet source;
  nn::Adam adam(source.parameters(), {.learning_rate = 1e-3});
  const fs::path good = dir.path / "good.ckpt";
  save_checkpoint(source, good, adam);
  const Bytes file = read_file(good);
  const fs::path bad = dir.path / "bad.ckpt";
  const std::string where = "checkpoint '" + bad.string() + "': ";

  SmallNet target;
  nn::Adam target_adam(target.parameters(), {.learning_rate = 1e-3});
  const Bytes before = parameter_bytes(target);
  const auto messages = [&] {
    return std::vector<std::string>{format_error_of([&] { load_checkpoint(bad, target); }),
                                    format_error_of([&] { load_checkpoint(bad, target, target_adam); }),
                                    format_error_of([&] { load_checkpoint(bad, target, {.strict = false}); }),
                                    format_error_of([&] { checkpoint_info(bad); })};
  };

  // Cut to half: inside moment1.0.weight's elements, which the file's own fields place.
  const std::size_t half = file.size() / 2;
  write_file(bad, Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(half)));
  const std::string inside = where + "truncated at byte " + std::to_string(half) + ", inside optimizer state ";
  const std::vector<std::string> said = messages();
  CHECK(starts_with(said[0], inside));
  CHECK(said[1] ==
        said[0] + "; a checkpoint of this cell with its nn::Adam state is " + std::to_string(file.size()) + " bytes");
  CHECK(said[2] == said[0]);
  CHECK(said[3] == said[0]);
  CHECK(parameter_bytes(target) == before);

  // Every cut is a truncation to every reader, but for one: a strict load of the parameters
  // alone takes a file of the size of their checkpoint for a whole one, damaged.
  save_checkpoint(source, good);
  const std::size_t parameters_only = read_file(good).size();
  const std::string damaged = where + "checksum mismatch: the file is damaged";
  for (std::size_t n = 20; n < file.size(); ++n) {
    CAPTURE(n);
    write_file(bad, Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n)));
    const std::vector<std::string> cut = messages();
    for (std::size_t reader = 0; reader < cut.size(); ++reader) {
      CAPTURE(reader);
      if (reader == 0 && n == parameters_only)
        CHECK(cut[reader] == damaged);
      else
        CHECK(starts_with(cut[reader], where + "truncated at byte " + std::to_string(n) + ", inside "));
    }
  }
  // Every changed byte after the version is damage to a strict load. A reader with no cell to
  // compare with may take a parameter's dimension made larger than the file for a cut.
  for_each_changed_byte(file, 12, bad, [&](std::size_t, const Bytes&) {
    const std::vector<std::string> changed_said = messages();
    CHECK(changed_said[0] == damaged);
    CHECK(changed_said[1] == damaged);
    for (std::size_t reader = 2; reader < changed_said.size(); ++reader) {
      const std::string& message = changed_said[reader];
      CHECK((message == damaged || (starts_with(message, where + "truncated at byte " + std::to_string(file.size()) +
                                                             ", inside parameter '") &&
                                    message.find("'s elements (bytes ") != std::string::npos)));
    }
  });
  CHECK(parameter_bytes(target) == before);
}

TEST_CASE("a parameter of another shape or element type is named with both") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': ";
  NarrowNetwork narrow;
  save_checkpoint(narrow, path);
  SeedNetwork<> seed;
  const Bytes before = parameter_bytes(seed);
  CHECK(format_error_of([&] { load_checkpoint(path, seed); }) ==
        where +
            "parameter 'dense_relu_sequential.0.weight' has shape [512, 784] in the cell but [512, 100] in the file");
  CHECK(parameter_bytes(seed) == before);

  nn::SequentialCell<nn::Dense<3, 2>> single;
  nn::SequentialCell<nn::Dense<3, 2, double>> single_double;
  save_checkpoint(single, path);
  CHECK(format_error_of([&] { load_checkpoint(path, single_double); }) ==
        where + "parameter '0.weight' is Float64 in the cell but Float32 in the file");
  save_checkpoint(single_double, path);
  CHECK(format_error_of([&] { load_checkpoint(path, single); }) ==
        where + "parameter '0.weight' is Float32 in the cell but Float64 in the file");
}

TEST_CASE("a file larger than the cell's checkpoint names the parameter whose shape differs") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  SeedNetwork<> seed;
  save_checkpoint(seed, path);
  NarrowNetwork narrow;
  const Bytes before = parameter_bytes(narrow);
  CHECK(format_error_of([&] { load_checkpoint(path, narrow); }) ==
        "checkpoint '" + path.string() +
            "': parameter 'dense_relu_sequential.0.weight' has shape [512, 100] in the cell but [512, 784] in the file");
  CHECK(parameter_bytes(narrow) == before);
}

TEST_CASE("missing, unexpected and repeated parameters are named") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': ";
  nn::SequentialCell<nn::Dense<4, 3>> first_only;
  SmallNet small;
  const Bytes before = parameter_bytes(small);
  save_checkpoint(first_only, path);
  CHECK(format_error_of([&] { load_checkpoint(path, small); }) ==
        where + "the file has no value for the cell's parameter(s) '2.weight', '2.bias'");

  // The same sizes under other names: 0 and 2 in the file, 0 and 1 in the cell.
  save_checkpoint(small, path);
  nn::SequentialCell<nn::Dense<4, 3>, nn::Dense<3, 2>> renamed;
  CHECK(format_error_of([&] { load_checkpoint(path, renamed); }) ==
        where +
            "the file's parameter(s) '2.weight', '2.bias' are not in the cell, and the file has no value for the "
            "cell's parameter(s) '1.weight', '1.bias'");

  nn::Dense<2, 2> dense;
  const Bytes dense_before = parameter_bytes(dense);
  const Record bias{"bias", 0, {2}, floats({1, 2})};
  write_file(path, checkpoint_bytes({bias, bias}, 2));
  CHECK(format_error_of([&] { load_checkpoint(path, dense); }) == where + "parameter 'bias' appears twice in the file");
  CHECK(parameter_bytes(small) == before);
  CHECK(parameter_bytes(dense) == dense_before);
}

TEST_CASE("a version 1 file with a valid checksum but malformed fields is a FormatError naming the field") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': malformed: ";
  nn::Dense<4, 3> dense;
  const Bytes before = parameter_bytes(dense);
  const auto error_for = [&](const Bytes& file) {
    write_file(path, file);
    return format_error_of([&] { load_checkpoint(path, dense); });
  };
  CHECK(error_for(checkpoint_bytes({{"bias", 9, {2}, floats({1, 2})}}, 1, 1)) ==
        where + "parameter 'bias' has element type 9, which is no duet::DType");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, std::vector<std::int64_t>(9, 1), {}}}, 1, 1)) ==
        where + "parameter 'bias' has rank 9, more than 8");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, {-2}, {}}}, 1, 1)) == where + "parameter 'bias' has dimension 0 = -2");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, {1000}, floats({1, 2})}}, 1, 1)) ==
        where + "parameter 'bias''s elements [1000] run past the parameters' end at byte 42");
  CHECK(error_for(checkpoint_bytes({}, 7, 1)) ==
        where + "parameter #0's name length at byte 16 runs past the parameters' end at byte 16");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, {2}, floats({1, 2, 3})}}, 1, 1)) ==
        where + "4 unexpected bytes at byte 42, after the parameters");
  CHECK(parameter_bytes(dense) == before);
}

TEST_CASE("a version 2 file with malformed optimizer fields is a FormatError naming the field") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': malformed: ";
  nn::Dense<2, 2> dense;
  const std::vector<Record> parameters{{"weight", 0, {2, 2}, floats({1, 2, 3, 4})}, {"bias", 0, {2}, floats({5, 6})}};
  const auto info_error = [&](const Bytes& file) {
    write_file(path, file);
    return format_error_of([&] { checkpoint_info(path); });
  };
  CHECK(info_error(checkpoint_bytes(parameters, 2, 2, {"nn::SGD", -1, {}})) ==
        where + "the optimizer's global step is -1");
  const Record moment{"moment1.bias", 0, {2}, floats({0, 0})};
  CHECK(info_error(checkpoint_bytes(parameters, 2, 2, {"nn::Adam", 3, {moment, moment}})) ==
        "checkpoint '" + path.string() + "': optimizer state 'moment1.bias' appears twice in the file");
  Bytes trailing = checkpoint_bytes(parameters, 2, 2, {"nn::Adam", 3, {moment}});
  trailing.insert(trailing.end() - 4, {0, 0});
  const uLong crc = crc32_z(0, trailing.data(), trailing.size() - 4);
  for (std::size_t i = 0; i < 4; ++i) trailing[trailing.size() - 4 + i] = static_cast<unsigned char>(crc >> (8 * i));
  CHECK(info_error(trailing) == where + "2 unexpected bytes at byte " + std::to_string(trailing.size() - 6) +
                                    ", after the optimizer state");
  CHECK(format_error_of([&] { load_checkpoint(path, dense); }) == info_error(trailing));
}

TEST_CASE("parameters may come in any order") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  nn::Dense<2, 2> dense;
  write_file(path,
             checkpoint_bytes({{"bias", 0, {2}, floats({5, 6})}, {"weight", 0, {2, 2}, floats({1, 2, 3, 4})}}, 2));
  load_checkpoint(path, dense);
  CHECK(dense.weight(1, 0) == 3);
  CHECK(dense.bias(1) == 6);
}

TEST_CASE("save replaces the file atomically and leaves no temporary file, even when it fails") {
  TempDir dir;
  nn::Dense<2, 2> dense;
  const fs::path path = dir.path / "model.ckpt";
  save_checkpoint(dense, path);
  save_checkpoint(dense, path);
  CHECK(dir.listing() == std::vector<std::string>{"model.ckpt"});

  // Renaming over a directory fails: the temporary file goes, the directory stays.
  const fs::path occupied = dir.path / "occupied";
  fs::create_directory(occupied);
  CHECK_THROWS_AS(save_checkpoint(dense, occupied), IOError);
  CHECK(dir.listing() == std::vector<std::string>{"model.ckpt", "occupied"});

  const fs::path nowhere = dir.path / "no" / "such" / "dir.ckpt";
  CHECK_THROWS_AS(save_checkpoint(dense, nowhere), IOError);
  CHECK(dir.listing() == std::vector<std::string>{"model.ckpt", "occupied"});

  const fs::path missing = dir.path / "missing.ckpt";
  try {
    load_checkpoint(missing, dense);
    FAIL("loading a missing file succeeded");
  } catch (const FormatError& e) {
    FAIL("a missing file is an IOError, not a FormatError: " << e.what());
  } catch (const IOError& e) {
    CHECK(std::string(e.what()) == "checkpoint '" + missing.string() + "': cannot open: No such file or directory");
  }
}

TEST_CASE("checkpoint_info lists a file's parameters and optimizer state without a cell") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  SmallNet net;
  save_checkpoint(net, path);
  CheckpointInfo info = checkpoint_info(path);
  CHECK(info.version == 3);
  REQUIRE(info.parameters.size() == 4);
  CHECK(info.parameters[0].name == "0.weight");
  CHECK(info.parameters[0].dtype == DType::float32);
  CHECK(info.parameters[0].shape == Shape{3, 4});
  CHECK(info.parameters[3].name == "2.bias");
  CHECK(info.parameters[3].shape == Shape{2});
  CHECK(info.optimizer.empty());
  CHECK(info.optimizer_state.empty());

  nn::Adam adam(net.parameters());
  adam.set_global_step(7);
  save_checkpoint(net, path, adam);
  info = checkpoint_info(path);
  CHECK(info.parameters.size() == 4);
  CHECK(info.optimizer == "nn::Adam");
  CHECK(info.global_step == 7);
  REQUIRE(info.optimizer_state.size() == 8);
  CHECK(info.optimizer_state[0].name == "moment1.0.weight");
  CHECK(info.optimizer_state[0].shape == Shape{3, 4});
  CHECK(info.optimizer_state[7].name == "moment2.2.bias");
  CHECK(info.optimizer_state[7].dtype == DType::float32);

  // The same checks as a load, with no cell size to tell a cut file from a damaged one.
  const Bytes file = read_file(path);
  const std::string where = "checkpoint '" + path.string() + "': ";
  write_file(path, Bytes(file.begin(), file.end() - 1));
  CHECK(format_error_of([&] { checkpoint_info(path); }) ==
        where + "truncated at byte " + std::to_string(file.size() - 1) + ", inside the checksum (bytes " +
            std::to_string(file.size() - 4) + " to " + std::to_string(file.size()) + ")");
  write_file(path, Bytes(file.begin(), file.begin() + 10));
  CHECK(format_error_of([&] { checkpoint_info(path); }) == where + "truncated at byte 10");
  CHECK_THROWS_AS(checkpoint_info(dir.path / "missing.ckpt"), IOError);

  // Version 1 files are read as they are.
  write_file(path, checkpoint_bytes({{"bias", 0, {2}, floats({1, 2})}}, 1, 1));
  info = checkpoint_info(path);
  CHECK(info.version == 1);
  REQUIRE(info.parameters.size() == 1);
  CHECK(info.parameters[0].name == "bias");
  CHECK(info.optimizer.empty());
  const Bytes v1 = read_file(path);
  CHECK(checkpoint_info_bytes(std::as_bytes(std::span(v1))).parameters[0].shape == Shape{2});
}

TEST_CASE("a load that is not strict loads what matches and names the rest") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  set_seed(1);
  SmallNet source;
  save_checkpoint(source, path);
  set_seed(2);
  nn::SequentialCell<nn::Dense<4, 3>, nn::ReLU, nn::Dense<3, 5>, nn::Dense<5, 5>> target;
  const auto target_parameters = target.parameters();
  const Bytes wider_before(reinterpret_cast<const unsigned char*>(target_parameters[2].parameter->data()),
                           reinterpret_cast<const unsigned char*>(target_parameters[2].parameter->data()) + 15 * 4);

  const CheckpointLoad result = load_checkpoint(path, target, {.strict = false});
  CHECK(result.param_not_load == std::vector<std::string>{"2.weight", "2.bias", "3.weight", "3.bias"});
  CHECK(result.ckpt_not_load == std::vector<std::string>{"2.weight", "2.bias"});
  CHECK(duet_test::values_of(target.get<0>().weight) == duet_test::values_of(source.get<0>().weight));
  CHECK(duet_test::values_of(target.get<0>().bias) == duet_test::values_of(source.get<0>().bias));
  const auto* wider = reinterpret_cast<const unsigned char*>(target.get<2>().weight.data());
  CHECK(Bytes(wider, wider + 15 * 4) == wider_before);

  // A strict load of the same file throws and changes nothing; one that fits returns empty lists.
  const Bytes before = parameter_bytes(target);
  CHECK(format_error_of([&] { load_checkpoint(path, target); }) ==
        "checkpoint '" + path.string() +
            "': parameter '2.weight' has shape [5, 3] in the cell but [2, 3] in the file");
  CHECK(parameter_bytes(target) == before);
  SmallNet same;
  const CheckpointLoad full = load_checkpoint(path, same);
  CHECK(full.param_not_load.empty());
  CHECK(full.ckpt_not_load.empty());
  CHECK(parameter_bytes(same) == parameter_bytes(source));

  // Not strict is not lenient about the file: a damaged one loads nothing.
  Bytes file = read_file(path);
  file[30] ^= 1;
  write_file(path, file);
  CHECK(format_error_of([&] { load_checkpoint(path, target, {.strict = false}); }) ==
        "checkpoint '" + path.string() + "': checksum mismatch: the file is damaged");
  CHECK(parameter_bytes(target) == before);
}

TEST_CASE("a cell without parameters cannot be saved: its members are probably not declared") {
  TempDir dir;
  nn::ReLU relu;
  try {
    save_checkpoint(relu, dir.path / "x.ckpt");
    FAIL("saving a cell without parameters succeeded");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()) == "checkpoint '" + (dir.path / "x.ckpt").string() +
                                       "': nn::ReLU has no parameters; are its sub-cells and parameters "
                                       "registered? A Cell lists them in DUET_CELL_MEMBERS(...); a class deriving "
                                       "from nn::DynamicCell overrides for_each_child and for_each_own_parameter");
  }
  CHECK(dir.listing().empty());
  CHECK_THROWS_AS(load_checkpoint(dir.path / "x.ckpt", relu), ValueError);
}

namespace {

// A small problem fed through a shuffling loader, as the example trains.
struct TinyProblem {
  data::DataLoader loader;
  TinyProblem() : loader(dataset(), 8, {.shuffle = true, .seed = 5}) {}
  static data::ImageDataset dataset() {
    BasicTensor<std::uint8_t> images{Shape{40, 2, 3}};
    BasicTensor<std::int32_t> labels{Shape{40}};
    for (index_t i = 0; i < images.numel(); ++i) images.data()[i] = static_cast<std::uint8_t>((i * 37 + 11) % 256);
    for (index_t i = 0; i < 40; ++i) labels.data()[i] = static_cast<std::int32_t>((i * 7) % 3);
    return data::ImageDataset(std::move(images), std::move(labels), 3);
  }
};

struct TinyNet : nn::Cell<TinyNet> {
  nn::Flatten flatten;
  nn::SequentialCell<nn::Dense<6, 8>, nn::ReLU, nn::Dense<8, 3>> layers;
  DUET_CELL_MEMBERS(flatten, layers);
  auto construct(auto x) { return layers(flatten(x)); }
};

// The same with Dropout, which draws its masks from a generator of its own.
struct TinyDropoutNet : nn::Cell<TinyDropoutNet> {
  nn::Flatten flatten;
  nn::SequentialCell<nn::Dense<6, 8>, nn::ReLU, nn::Dropout, nn::Dense<8, 3>> layers;
  DUET_CELL_MEMBERS(flatten, layers);
  auto construct(auto x) { return layers(flatten(x)); }
};

template <class Net, class Optimizer>
void train_epochs(Net& net, Optimizer& optimizer, TinyProblem& problem, std::uint64_t from, std::uint64_t to) {
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::TrainOneStepCell step(with_loss, optimizer);
  for (std::uint64_t epoch = from; epoch < to; ++epoch) {
    problem.loader.start_epoch(epoch);
    while (const data::Batch* batch = problem.loader.next()) step(batch->images, batch->labels);
  }
}

template <class Optimizer>
Bytes state_bytes(Optimizer& optimizer) {
  Bytes out;
  for (const auto& slot : optimizer.state()) {
    for (const auto& t : *slot.tensors) {
      const auto* b = reinterpret_cast<const unsigned char*>(t.data());
      out.insert(out.end(), b, b + t.numel() * 4);
    }
  }
  return out;
}

// 2 epochs, a checkpoint, then a new network and optimiser (as in a new process) that load it
// and train 3 more must end where 5 epochs in one go end, bit for bit.
template <class Optimizer, class Config, class Net = TinyNet>
void check_resume(Mode mode, const Config& config) {
  duet_test::ModeGuard guard;
  set_context({.mode = mode});
  TempDir dir;
  const fs::path path = dir.path / "resume.ckpt";

  set_seed(1);
  Net straight;
  Optimizer straight_optimizer(straight.parameters(), config);
  TinyProblem straight_data;
  train_epochs(straight, straight_optimizer, straight_data, 0, 5);

  {
    set_seed(1);
    Net first;
    Optimizer first_optimizer(first.parameters(), config);
    TinyProblem first_data;
    train_epochs(first, first_optimizer, first_data, 0, 2);
    save_checkpoint(first, path, first_optimizer);
  }
  set_seed(2);
  Net resumed;
  Optimizer resumed_optimizer(resumed.parameters(), config);
  load_checkpoint(path, resumed, resumed_optimizer);
  CHECK(resumed_optimizer.global_step() == 10);
  TinyProblem resumed_data;
  train_epochs(resumed, resumed_optimizer, resumed_data, 2, 5);
  CHECK(resumed_optimizer.global_step() == straight_optimizer.global_step());
  CHECK(parameter_bytes(resumed) == parameter_bytes(straight));
  CHECK(state_bytes(resumed_optimizer) == state_bytes(straight_optimizer));

  // The optimiser state matters: the parameters alone resume to other values.
  set_seed(2);
  Net weights_only;
  Optimizer fresh_optimizer(weights_only.parameters(), config);
  load_checkpoint(path, weights_only);
  TinyProblem weights_only_data;
  train_epochs(weights_only, fresh_optimizer, weights_only_data, 2, 5);
  CHECK(parameter_bytes(weights_only) != parameter_bytes(straight));

  // So do Dropout's generators: restarted, they draw other masks.
  if constexpr (std::is_same_v<Net, TinyDropoutNet>) {
    set_seed(2);
    Net masks_restarted;
    Optimizer restarted_optimizer(masks_restarted.parameters(), config);
    load_checkpoint(path, masks_restarted, restarted_optimizer);
    masks_restarted.layers.template get<2>().reseed(0);
    TinyProblem restarted_data;
    train_epochs(masks_restarted, restarted_optimizer, restarted_data, 2, 5);
    CHECK(parameter_bytes(masks_restarted) != parameter_bytes(straight));
  }
}

}  // namespace

TEST_CASE("training resumed from a checkpoint with its optimizer state ends as training in one go, bit for bit") {
  for (Mode mode : {GRAPH_MODE, PYNATIVE_MODE}) {
    CAPTURE(mode);
    check_resume<nn::Adam>(mode, nn::AdamConfig{.learning_rate = 0.01});
    check_resume<nn::AdamW>(mode, nn::AdamConfig{.learning_rate = 0.01, .weight_decay = 0.1});
    check_resume<nn::SGD>(mode, nn::SGDConfig{.learning_rate = 0.05, .momentum = 0.9});
    check_resume<nn::SGD>(mode, nn::SGDConfig{.learning_rate = nn::CosineDecayLR{0.001, 0.1, 30}, .momentum = 0.9});
    check_resume<nn::Adam>(mode, nn::AdamConfig{.learning_rate = nn::ExponentialDecayLR{0.02, 0.5, 7, true}});
    check_resume<nn::Adam, nn::AdamConfig, TinyDropoutNet>(mode, nn::AdamConfig{.learning_rate = 0.01});
  }
}

namespace {

struct DropNet : nn::Cell<DropNet> {
  nn::Dense<2, 2> fc;
  nn::Dropout drop{0.25};
  DUET_CELL_MEMBERS(fc, drop);
  auto construct(auto x) { return drop(fc(x)); }
};

struct PlainNet : nn::Cell<PlainNet> {
  nn::Dense<2, 2> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

}  // namespace

TEST_CASE("Dropout's generators are saved with the optimizer state, named by path, and must match to load") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': ";
  DropNet net;
  net.drop.reseed(11);
  net.drop.generator().next();
  nn::SGD sgd(net.parameters(), {.momentum = 0.5});
  sgd.set_global_step(3);
  save_checkpoint(net, path, sgd);
  CHECK(checkpoint_info(path).generators == std::vector<std::string>{"generator.drop"});

  // The documented layout, the generator after the optimizer state.
  const auto record = [](const std::string& name, const BasicTensor<float>& t) {
    const auto* b = reinterpret_cast<const unsigned char*>(t.data());
    return Record{name, 0, {t.shape().begin(), t.shape().end()}, Bytes(b, b + t.numel() * 4)};
  };
  const auto& momentum = *sgd.state()[0].tensors;
  const GeneratorState saved = net.drop.generator().state();
  CHECK(read_file(path) == checkpoint_bytes({record("fc.weight", net.fc.weight), record("fc.bias", net.fc.bias)}, 2, 3,
                                            {"nn::SGD",
                                             3,
                                             {record("momentum.fc.weight", momentum[0]),
                                              record("momentum.fc.bias", momentum[1])}},
                                            {{"generator.drop", saved}}));

  DropNet target;
  nn::SGD target_sgd(target.parameters(), {.momentum = 0.5});
  load_checkpoint(path, target, target_sgd);
  CHECK(target.drop.generator().state() == saved);
  CHECK(target.drop.generator().next() == net.drop.generator().next());

  // A network without the Dropout, or with one the file lacks: named, and nothing changes.
  PlainNet plain;
  nn::SGD plain_sgd(plain.parameters(), {.momentum = 0.5});
  const Bytes plain_before = parameter_bytes(plain);
  CHECK(format_error_of([&] { load_checkpoint(path, plain, plain_sgd); }) ==
        where + "the file's generator(s) 'generator.drop' are not in the cell");
  CHECK(parameter_bytes(plain) == plain_before);
  CHECK(plain_sgd.global_step() == 0);
  save_checkpoint(plain, path, plain_sgd);
  DropNet other;
  nn::SGD other_sgd(other.parameters(), {.momentum = 0.5});
  const Bytes other_before = parameter_bytes(other);
  const GeneratorState other_state = other.drop.generator().state();
  CHECK(format_error_of([&] { load_checkpoint(path, other, other_sgd); }) ==
        where + "the file has no value for the cell's generator(s) 'generator.drop'");
  CHECK(parameter_bytes(other) == other_before);
  CHECK(other.drop.generator().state() == other_state);

  // Parameters alone hold no generators, and a version 2 file none: they are left as they are.
  save_checkpoint(net, path);
  CHECK(checkpoint_info(path).generators.empty());
  load_checkpoint(path, other);
  CHECK(other.drop.generator().state() == other_state);
  write_file(path, checkpoint_bytes({record("fc.weight", net.fc.weight), record("fc.bias", net.fc.bias)}, 2, 2,
                                    {"nn::SGD",
                                     3,
                                     {record("momentum.fc.weight", momentum[0]),
                                      record("momentum.fc.bias", momentum[1])}}));
  load_checkpoint(path, other, other_sgd);
  CHECK(parameter_bytes(other) == parameter_bytes(net));
  CHECK(other_sgd.global_step() == 3);
  CHECK(other.drop.generator().state() == other_state);
}

TEST_CASE("a version 3 file with malformed generator fields is a FormatError naming the field") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': ";
  const std::vector<Record> parameters{{"fc.weight", 0, {2, 2}, floats({1, 2, 3, 4})},
                                       {"fc.bias", 0, {2}, floats({5, 6})}};
  const auto error_for = [&](const Generators& generators) {
    write_file(path, checkpoint_bytes(parameters, 2, 3, {"nn::SGD", 1, {}}, generators));
    return format_error_of([&] { checkpoint_info(path); });
  };
  const GeneratorState good{{1, 2, 3, 4}, false, 0};
  CHECK(error_for({{"generator.drop", GeneratorState{}}}) ==
        where + "malformed: generator 'generator.drop' has all-zero words, which would draw only zeros");
  GeneratorState pending = good;
  pending.spare = std::numeric_limits<double>::infinity();
  CHECK(error_for({{"generator.drop", pending}}) ==
        where + "malformed: generator 'generator.drop' has a pending draw that is not finite");
  CHECK(error_for({{"generator.drop", good}, {"generator.drop", good}}) ==
        where + "generator 'generator.drop' appears twice in the file");

  Bytes flag = checkpoint_bytes(parameters, 2, 3, {"nn::SGD", 1, {}}, {{"g", good}});
  flag[flag.size() - 4 - 8 - 1] = 2;
  const auto fix_checksum = [](Bytes& file) {
    const uLong crc = crc32_z(0, file.data(), file.size() - 4);
    for (std::size_t i = 0; i < 4; ++i) file[file.size() - 4 + i] = static_cast<unsigned char>(crc >> (8 * i));
  };
  fix_checksum(flag);
  write_file(path, flag);
  CHECK(format_error_of([&] { checkpoint_info(path); }) ==
        where + "malformed: generator 'g' has a pending-draw flag of 2, not 0 or 1");
  Bytes trailing = checkpoint_bytes(parameters, 2, 3, {"nn::SGD", 1, {}}, {{"g", good}});
  trailing.insert(trailing.end() - 4, {0, 0, 0});
  fix_checksum(trailing);
  write_file(path, trailing);
  CHECK(format_error_of([&] { checkpoint_info(path); }) == where + "malformed: 3 unexpected bytes at byte " +
                                                               std::to_string(trailing.size() - 7) +
                                                               ", after the generators");
  Bytes cut = checkpoint_bytes(parameters, 2, 3, {"nn::SGD", 1, {}}, {{"g", good}});
  cut.erase(cut.end() - 4 - 9, cut.end() - 4);
  fix_checksum(cut);
  write_file(path, cut);
  CHECK(format_error_of([&] { checkpoint_info(path); }) ==
        where + "malformed: generator 'g''s pending-draw flag at byte " + std::to_string(cut.size() - 4) +
            " runs past the parameters' end at byte " + std::to_string(cut.size() - 4));
}

TEST_CASE("the optimizer state is stored as the documented layout, named by parameter") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  nn::Dense<2, 1> dense;
  nn::SGD sgd(dense.parameters(), {.momentum = 0.5});
  sgd.set_global_step(3);
  (*sgd.state()[0].tensors)[1].data()[0] = 0.25f;
  save_checkpoint(dense, path, sgd);

  const auto record = [](const std::string& name, const BasicTensor<float>& t) {
    const auto* b = reinterpret_cast<const unsigned char*>(t.data());
    return Record{name, 0, {t.shape().begin(), t.shape().end()}, Bytes(b, b + t.numel() * 4)};
  };
  const auto& momentum = *sgd.state()[0].tensors;
  CHECK(read_file(path) == checkpoint_bytes({record("weight", dense.weight), record("bias", dense.bias)}, 2, 3,
                                            {"nn::SGD",
                                             3,
                                             {record("momentum.weight", momentum[0]),
                                              record("momentum.bias", momentum[1])}}));
}

TEST_CASE("an optimizer state that does not fit is named, and nothing changes") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': ";
  SmallNet net;
  nn::Adam adam(net.parameters());
  adam.set_global_step(4);
  save_checkpoint(net, path, adam);

  SmallNet target;
  const Bytes before = parameter_bytes(target);
  nn::AdamW adamw(target.parameters());
  CHECK(format_error_of([&] { load_checkpoint(path, target, adamw); }) ==
        where + "holds the state of an optimizer 'nn::Adam', not of an nn::AdamW");
  nn::SGD plain(target.parameters());
  CHECK(format_error_of([&] { load_checkpoint(path, target, plain); }) ==
        where + "holds the state of an optimizer 'nn::Adam', not of an nn::SGD");
  CHECK(plain.global_step() == 0);

  // The same type updating fewer parameters.
  auto parameters = target.parameters();
  parameters.back().parameter->requires_grad = false;
  nn::Adam partial(parameters);
  CHECK(format_error_of([&] { load_checkpoint(path, target, partial); }) ==
        where + "the file's optimizer state(s) 'moment1.2.bias', 'moment2.2.bias' are not in the nn::Adam");
  CHECK(partial.global_step() == 0);

  // A file without optimizer state.
  save_checkpoint(net, path);
  nn::Adam fresh(target.parameters());
  CHECK(format_error_of([&] { load_checkpoint(path, target, fresh); }) ==
        where + "holds no optimizer state (it was saved without an optimizer), so the nn::Adam cannot resume from it");
  write_file(path, checkpoint_bytes({{"weight", 0, {1, 2}, floats({1, 2})}, {"bias", 0, {1}, floats({3})}}, 2, 1));
  nn::Dense<2, 1> dense;
  const Bytes dense_before = parameter_bytes(dense);
  nn::Adam dense_adam(dense.parameters());
  CHECK(format_error_of([&] { load_checkpoint(path, dense, dense_adam); }) ==
        where + "holds no optimizer state (it is format version 1, which cannot), so the nn::Adam cannot resume from it");
  CHECK(parameter_bytes(dense) == dense_before);
  CHECK(parameter_bytes(target) == before);

  // An optimiser of parameters the cell does not have cannot name its state.
  nn::Dense<2, 2> other;
  nn::Adam other_adam(other.parameters());
  try {
    save_checkpoint(net, path, other_adam);
    FAIL("saving another cell's optimizer succeeded");
  } catch (const ValueError& e) {
    CHECK(std::string(e.what()) == where + "the nn::Adam's parameter #0, of shape [2, 2], is not a parameter of the "
                                           "cell, so its state has no name to go by");
  }
}

}  // namespace tests_io_checkpoint
