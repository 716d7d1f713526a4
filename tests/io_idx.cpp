#include <doctest/doctest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <duet/duet.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace tests_io_idx {

using namespace duet;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<unsigned char>;

// A directory of its own for each test, removed when the test ends.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> serial{0};
    path = fs::temp_directory_path() /
           ("duet_io_idx_" + std::to_string(::getpid()) + "_" + std::to_string(serial.fetch_add(1)));
    fs::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { fs::remove_all(path); }

  fs::path write(const std::string& name, const Bytes& bytes) const {
    const fs::path file = path / name;
    std::ofstream(file, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return file;
  }
};

void append_u32_be(Bytes& out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<unsigned char>(v >> shift));
}

Bytes idx_header(unsigned char type, const std::vector<std::uint32_t>& dims) {
  Bytes out{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (std::uint32_t d : dims) append_u32_be(out, d);
  return out;
}

Bytes idx_u8(const std::vector<std::uint32_t>& dims, const Bytes& data) {
  Bytes out = idx_header(0x08, dims);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// Big-endian element bytes, as IDX stores them.
template <class T>
void append_be(Bytes& out, T value) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &value, sizeof(T));
  if constexpr (std::endian::native == std::endian::little) std::reverse(b, b + sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}

Bytes gzip(const Bytes& in) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&z, static_cast<uLong>(in.size())) + 32);
  z.next_in = const_cast<Bytef*>(in.data());
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// The message of the duet::FormatError f throws; fails the test if it throws anything else.
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

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

const Bytes small_data{1, 2, 3, 4, 5, 6, 250, 251, 252, 253, 254, 255};

}  // namespace

TEST_CASE("read_idx reads unsigned bytes, plain and gzipped") {
  TempDir dir;
  const Bytes file = idx_u8({2, 3, 2}, small_data);
  for (const fs::path& path : {dir.write("plain", file), dir.write("packed.gz", gzip(file))}) {
    CAPTURE(path);
    const io::IdxArray a = io::read_idx(path);
    CHECK(a.dtype == DType::uint8);
    CHECK(a.shape == Shape{2, 3, 2});
    const auto& t = std::get<BasicTensor<std::uint8_t>>(a.data);
    CHECK(t.shape() == Shape{2, 3, 2});
    CHECK(std::vector<unsigned char>(t.data(), t.data() + t.numel()) == small_data);
    const BasicTensor<std::uint8_t> u8 = io::read_idx_u8(path);
    CHECK(u8(1, 2, 1) == 255);
    CHECK(u8(0, 0, 0) == 1);
  }
}

TEST_CASE("read_idx converts big-endian int32, float32 and float64 elements") {
  TempDir dir;
  Bytes ints = idx_header(0x0C, {3});
  for (std::int32_t v : {1, -2, 0x01020304}) append_be(ints, v);
  Bytes floats = idx_header(0x0D, {2, 1});
  for (float v : {1.5f, -0.25f}) append_be(floats, v);
  Bytes doubles = idx_header(0x0E, {1});
  append_be(doubles, 3.125);

  const auto i = io::read_idx(dir.write("ints", ints));
  CHECK(i.dtype == DType::int32);
  const auto& it = std::get<BasicTensor<std::int32_t>>(i.data);
  CHECK(it(0) == 1);
  CHECK(it(1) == -2);
  CHECK(it(2) == 0x01020304);
  const auto f = io::read_idx(dir.write("floats.gz", gzip(floats)));
  CHECK(f.shape == Shape{2, 1});
  CHECK(std::get<Tensor>(f.data)(1, 0) == -0.25f);
  CHECK(std::get<BasicTensor<double>>(io::read_idx(dir.write("doubles", doubles)).data)(0) == 3.125);

  const fs::path floats_path = dir.path / "floats.gz";
  CHECK_THROWS_WITH_AS(
      io::read_idx_u8(floats_path),
      ("IDX file '" + floats_path.string() + "': holds Float32 elements, expected unsigned bytes (UInt8)").c_str(),
      FormatError);
}

TEST_CASE("a zero dimension gives an empty array") {
  TempDir dir;
  const auto a = io::read_idx(dir.write("empty", idx_header(0x08, {0, 28, 28})));
  CHECK(a.shape == Shape{0, 28, 28});
  CHECK(std::get<BasicTensor<std::uint8_t>>(a.data).numel() == 0);
}

TEST_CASE("every truncation of a valid IDX file, plain or gzipped, is a FormatError") {
  TempDir dir;
  const Bytes file = idx_u8({2, 3, 2}, small_data);
  for (std::size_t n = 0; n < file.size(); ++n) {
    CAPTURE(n);
    const fs::path path = dir.write("cut", Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n)));
    CHECK(contains(format_error_of([&] { io::read_idx(path); }), "truncated at byte " + std::to_string(n)));
  }
  const Bytes packed = gzip(file);
  for (std::size_t n = 0; n < packed.size(); ++n) {
    CAPTURE(n);
    const fs::path path = dir.write("cut.gz", Bytes(packed.begin(), packed.begin() + static_cast<std::ptrdiff_t>(n)));
    CHECK(contains(format_error_of([&] { io::read_idx(path); }), "truncated"));
  }
}

TEST_CASE("trailing bytes are a FormatError, inside or after the gzip data, further gzip members are read on") {
  TempDir dir;
  const Bytes file = idx_u8({2, 3, 2}, small_data);
  Bytes longer = file;
  longer.push_back(0);
  const fs::path plain = dir.write("longer", longer);
  CHECK(format_error_of([&] { io::read_idx(plain); }) ==
        "IDX file '" + plain.string() + "': trailing bytes after byte 28, where the header [2, 3, 2] ends the data");
  CHECK(contains(format_error_of([&] { io::read_idx(dir.write("longer.gz", gzip(longer))); }),
                 "trailing bytes after byte 28 of the decompressed data"));

  Bytes garbage = gzip(file);
  garbage.insert(garbage.end(), {'j', 'u', 'n', 'k'});
  CHECK(contains(format_error_of([&] { io::read_idx(dir.write("garbage.gz", garbage)); }),
                 "bytes after the gzip data are not another gzip member"));

  // gunzip reads concatenated members as one stream.
  const std::size_t half = 13;
  Bytes members = gzip(Bytes(file.begin(), file.begin() + half));
  const Bytes second = gzip(Bytes(file.begin() + half, file.end()));
  members.insert(members.end(), second.begin(), second.end());
  CHECK(io::read_idx(dir.write("members.gz", members)).shape == Shape{2, 3, 2});
}

TEST_CASE("a bad magic, element type or rank is a FormatError that says which") {
  TempDir dir;
  const auto error_for = [&](Bytes file) {
    const fs::path path = dir.write("bad", file);
    return format_error_of([&] { io::read_idx(path); }).substr(("IDX file '" + path.string() + "': ").size());
  };
  Bytes file = idx_u8({2, 3, 2}, small_data);
  Bytes bad = file;
  bad[0] = 0x1F;
  CHECK(error_for(bad) == "not an IDX file: it starts with 0x1F 0x00, not 0x00 0x00");
  bad = file;
  bad[2] = 0x09;
  CHECK(error_for(bad) ==
        "element type 0x09 (int8) has no duet tensor type; duet reads unsigned bytes (0x08), int32 (0x0C), "
        "float32 (0x0D) and float64 (0x0E)");
  bad[2] = 0x42;
  CHECK(error_for(bad) == "unknown IDX element type 0x42");
  bad = file;
  bad[3] = 0;
  CHECK(error_for(bad) == "the header gives 0 dimensions; duet reads 1 to 8");
  bad[3] = 9;
  CHECK(error_for(bad) == "the header gives 9 dimensions; duet reads 1 to 8");
  bad[3] = 2;  // the third dimension's bytes become data, and the data is too long
  CHECK(error_for(bad) == "trailing bytes after byte 18, where the header [2, 3] ends the data");
  CHECK(error_for(Bytes{}) == "truncated at byte 0: an IDX header starts with 4 bytes");
}

TEST_CASE("a header claiming more data than the file holds fails without allocating it") {
  TempDir dir;
  // Beyond the cap, or overflowing 64 bits: rejected from the header alone.
  CHECK(contains(format_error_of([&] {
                   io::read_idx(dir.write("huge", idx_header(0x08, {0xFFFFFFFF, 2})));
                 }),
                 "dimensions [4294967295, 2] exceed the 1024 MiB of data"));
  CHECK(contains(format_error_of([&] {
                   io::read_idx(dir.write("overflow", idx_header(0x0E, {65536, 65536, 65536, 65536, 65536})));
                 }),
                 "exceed the 1024 MiB"));
  // Empty, but no tensor could have that shape: its size overflows before the zero.
  CHECK(contains(format_error_of([&] {
                   io::read_idx(dir.write("empty", idx_header(0x08, {0xFFFFFFFF, 0xFFFFFFFF, 0})));
                 }),
                 "exceed the 1024 MiB"));
  // Within the cap (512 MiB claimed), as a gzip bomb would: 1 MiB of zeros that compress to 1 KiB.
  Bytes bomb = idx_header(0x08, {1u << 29});
  bomb.resize(bomb.size() + (1u << 20));
  const Bytes packed = gzip(bomb);
  CHECK(packed.size() < 2048);
  CHECK(format_error_of([&] { io::read_idx(dir.write("bomb.gz", packed)); }) ==
        "IDX file '" + (dir.path / "bomb.gz").string() + "': truncated at byte " + std::to_string(bomb.size()) +
            " of the decompressed data: the header [536870912] promises 536870920 bytes");
}

TEST_CASE("corrupt gzip data is a FormatError, and no single-byte change makes the reader misbehave") {
  TempDir dir;
  const Bytes packed = gzip(idx_u8({2, 3, 2}, small_data));
  Bytes bad = packed;
  bad[bad.size() - 6] ^= 0x01;  // inside the CRC-32 of the trailer
  CHECK(contains(format_error_of([&] { io::read_idx(dir.write("crc.gz", bad)); }), "corrupt gzip data"));
  // Each byte, changed: a valid array or a FormatError, nothing else (and sanitizers watch).
  for (std::size_t i = 0; i < packed.size(); ++i) {
    for (unsigned char mask : {0x01, 0x10, 0x80, 0xFF}) {
      bad = packed;
      bad[i] ^= mask;
      const fs::path path = dir.write("flip.gz", bad);
      try {
        io::read_idx(path);
      } catch (const FormatError&) {
      }
    }
  }
}

TEST_CASE("a file that cannot be read is an IOError, not a FormatError") {
  TempDir dir;
  const fs::path missing = dir.path / "missing";
  CHECK_THROWS_WITH_AS(io::read_idx(missing),
                       ("IDX file '" + missing.string() + "': cannot open: No such file or directory").c_str(),
                       IOError);
  CHECK_THROWS_WITH_AS(io::read_idx(dir.path),
                       ("IDX file '" + dir.path.string() + "': read failed: Is a directory").c_str(), IOError);
}

TEST_CASE("the Fashion-MNIST files read as 60000 and 10000 images of 28x28 with their labels") {
  const fs::path dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir / "t10k-labels-idx1-ubyte.gz")) {
    MESSAGE("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist): skipped");
    return;
  }
  const auto train_images = io::read_idx_u8(dir / "train-images-idx3-ubyte.gz");
  CHECK(train_images.shape() == Shape{60000, 28, 28});
  long sum = 0;
  for (index_t i = 0; i < 784; ++i) sum += train_images.data()[i];
  CHECK(sum == 76247);  // the first image, as numpy sums it
  const auto train_labels = io::read_idx_u8(dir / "train-labels-idx1-ubyte.gz");
  CHECK(train_labels.shape() == Shape{60000});
  CHECK(std::vector<int>(train_labels.data(), train_labels.data() + 10) ==
        std::vector<int>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5});
  CHECK(io::read_idx_u8(dir / "t10k-images-idx3-ubyte.gz").shape() == Shape{10000, 28, 28});
  const auto test_labels = io::read_idx_u8(dir / "t10k-labels-idx1-ubyte.gz");
  CHECK(test_labels.shape() == Shape{10000});
  CHECK(std::vector<int>(test_labels.data(), test_labels.data() + 10) ==
        std::vector<int>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7});
}

}  // namespace tests_io_idx
