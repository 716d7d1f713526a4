#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "support.hpp"

using namespace duet;
using duet_test::SeedNetwork;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<unsigned char>;

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> serial{0};
    path = fs::temp_directory_path() /
           ("duet_io_checkpoint_" + std::to_string(::getpid()) + "_" + std::to_string(serial.fetch_add(1)));
    fs::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { fs::remove_all(path); }

  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

Bytes read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Every parameter's bytes, in the cell's order: what "bit-identical" compares.
template <ElementType T>
Bytes parameter_bytes(nn::BasicDynamicCell<T>& cell) {
  Bytes out;
  for (const auto& [name, p] : cell.parameters()) {
    const auto* b = reinterpret_cast<const unsigned char*>(p->data());
    out.insert(out.end(), b, b + p->numel() * static_cast<index_t>(sizeof(T)));
  }
  return out;
}

template <class F>
std::string format_error_of(F&& f) {
  try {
    f();
  } catch (const FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected a duet::FormatError, got: " << e.what());
  }
  FAIL("expected a duet::FormatError, nothing was thrown");
  return {};
}

bool starts_with(const std::string& text, const std::string& prefix) { return text.rfind(prefix, 0) == 0; }

// A checkpoint written field by field, for files save_checkpoint would never write.
struct Record {
  std::string name;
  std::uint8_t dtype;
  std::vector<std::int64_t> dims;
  Bytes data;
};

Bytes checkpoint_bytes(const std::vector<Record>& records, std::uint32_t count) {
  Bytes out{'D', 'U', 'E', 'T', 'C', 'K', 'P', 'T'};
  const auto put = [&](std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<unsigned char>(v >> (8 * i)));
  };
  put(1, 4);
  put(count, 4);
  for (const Record& r : records) {
    put(r.name.size(), 4);
    out.insert(out.end(), r.name.begin(), r.name.end());
    put(r.dtype, 1);
    put(r.dims.size(), 1);
    for (std::int64_t d : r.dims) put(static_cast<std::uint64_t>(d), 8);
    out.insert(out.end(), r.data.begin(), r.data.end());
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
  REQUIRE(file.size() == 16 + (6 + 6 + 16 + 16) + (6 + 4 + 8 + 8) + 4);

  nn::Dense<2, 2> target;
  const Bytes before = parameter_bytes(target);
  REQUIRE(before != parameter_bytes(source));
  const fs::path bad = dir.path / "bad.ckpt";
  const std::string where = "checkpoint '" + bad.string() + "': ";

  for (std::size_t n = 0; n < file.size(); ++n) {
    CAPTURE(n);
    write_file(bad, Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n)));
    CHECK(format_error_of([&] { load_checkpoint(bad, target); }) ==
          where + "truncated at byte " + std::to_string(n) + "; a checkpoint of this cell is 90 bytes");
    REQUIRE(parameter_bytes(target) == before);
  }
  for (std::size_t i = 0; i < file.size(); ++i) {
    for (unsigned char mask : {0x01, 0x80, 0xFF}) {
      CAPTURE(i);
      CAPTURE(int(mask));
      Bytes changed = file;
      changed[i] ^= mask;
      write_file(bad, changed);
      const std::string message = format_error_of([&] { load_checkpoint(bad, target); });
      if (i < 8) {
        CHECK(message == where + "not a duet checkpoint: it does not start with \"DUETCKPT\"");
      } else if (i < 12) {
        CHECK(starts_with(message, where + "format version "));
      } else {
        CHECK(message == where + "checksum mismatch: the file is damaged");
      }
      REQUIRE(parameter_bytes(target) == before);
    }
  }
  load_checkpoint(good, target);
  CHECK(parameter_bytes(target) == parameter_bytes(source));
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
  // A file larger than the cell's checkpoint is refused before it is read in full.
  save_checkpoint(single_double, path);
  CHECK(format_error_of([&] { load_checkpoint(path, single); }) ==
        where + "larger than the 102 bytes a checkpoint of this cell takes; it holds other parameters or shapes");
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
        where + "parameter '2.weight' in the file is not in the cell");

  nn::Dense<2, 2> dense;
  const Bytes dense_before = parameter_bytes(dense);
  const Record bias{"bias", 0, {2}, floats({1, 2})};
  write_file(path, checkpoint_bytes({bias, bias}, 2));
  CHECK(format_error_of([&] { load_checkpoint(path, dense); }) == where + "parameter 'bias' appears twice in the file");
  CHECK(parameter_bytes(small) == before);
  CHECK(parameter_bytes(dense) == dense_before);
}

TEST_CASE("a file with a valid checksum but malformed fields is a FormatError naming the field") {
  TempDir dir;
  const fs::path path = dir.path / "x.ckpt";
  const std::string where = "checkpoint '" + path.string() + "': malformed: ";
  nn::Dense<4, 3> dense;
  const Bytes before = parameter_bytes(dense);
  const auto error_for = [&](const Bytes& file) {
    write_file(path, file);
    return format_error_of([&] { load_checkpoint(path, dense); });
  };
  CHECK(error_for(checkpoint_bytes({{"bias", 9, {2}, floats({1, 2})}}, 1)) ==
        where + "parameter 'bias' has element type 9, which is no duet::DType");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, std::vector<std::int64_t>(9, 1), {}}}, 1)) ==
        where + "parameter 'bias' has rank 9, more than 8");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, {-2}, {}}}, 1)) == where + "parameter 'bias' has dimension 0 = -2");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, {1000}, floats({1, 2})}}, 1)) ==
        where + "parameter 'bias''s elements [1000] run past the parameters' end at byte 42");
  CHECK(error_for(checkpoint_bytes({}, 7)) ==
        where + "parameter #0's name length at byte 16 runs past the parameters' end at byte 16");
  CHECK(error_for(checkpoint_bytes({{"bias", 0, {2}, floats({1, 2, 3})}}, 1)) ==
        where + "4 unexpected bytes at byte 42, after the parameters");
  CHECK(parameter_bytes(dense) == before);
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
