// Checkpoints: a cell's parameters in one file (MindSpore's save_checkpoint / load_checkpoint).
//
// Format, version 1; every integer is little-endian:
//
//   size           field
//   8              magic "DUETCKPT"
//   4              u32 version: 1
//   4              u32 number of parameters
//   per parameter, in the cell's order (a reader accepts any order):
//     4            u32 name length, then the name's bytes: the parameter's path in the cell,
//                  "dense_relu_sequential.0.weight", with no terminator
//     1            u8 element type, a duet::DType: 0 Float32, 1 Float64, 2 Int32, 3 Int64, 4 UInt8
//     1            u8 rank, 0 to duet::max_rank
//     8 × rank     i64 dimensions
//     numel × size the elements, row-major, little-endian
//   4              u32 CRC-32 (zlib's crc32) of every byte before it
//
// Names are paths from the cell saved, which are the same whichever mode the cell runs in,
// so a checkpoint saved from a network in graph mode loads into the same network in PyNative
// mode and back.
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../cell.hpp"
#include "../dtype.hpp"
#include "../error.hpp"
#include "../shape.hpp"

namespace duet {

// Elements are written and read as they lie in memory.
static_assert(std::endian::native == std::endian::little, "duet checkpoints need a little-endian machine");

namespace detail {

inline constexpr std::string_view checkpoint_magic = "DUETCKPT";
inline constexpr std::uint32_t checkpoint_version = 1;
// Magic, version, count; the checksum; each parameter's name length, type and rank.
inline constexpr std::uint64_t checkpoint_header_bytes = 8 + 4 + 4;
inline constexpr std::uint64_t checkpoint_checksum_bytes = 4;
inline constexpr std::uint64_t checkpoint_record_header_bytes = 4 + 1 + 1;

inline std::string checkpoint_where(const std::filesystem::path& path) { return "checkpoint '" + path.string() + "'"; }

inline std::string system_message() {
  const int error = errno;
  return std::generic_category().message(error);
}

// A name from a file, for a message: a hostile one may be megabytes long.
inline std::string shown_name(std::string_view name) {
  constexpr std::size_t most = 100;
  // Built by appending: GCC 12 warns falsely (-Wrestrict, PR105329) on "'" + std::string.
  return std::string("'").append(name.substr(0, most)).append(name.size() > most ? "...'" : "'");
}

// Writes a checkpoint to a temporary file beside its destination and renames it into place
// on commit, so the destination is always either the old file or the whole new one. The
// temporary file is removed if the writer is destroyed before commit.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(const std::filesystem::path& path) : path_(path), where_(checkpoint_where(path)) {
    if (!path.has_filename()) throw IOError(where_ + ": the path names no file");
    static std::atomic<unsigned long> serial{0};
    temp_ = path.parent_path() / ("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                                  std::to_string(serial.fetch_add(1)));
    // "x": never write into a file that happens to have that name.
    file_ = std::fopen(temp_.c_str(), "wbx");
    if (file_ == nullptr) throw IOError(where_ + ": cannot create '" + temp_.string() + "': " + system_message());
  }
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) {
      std::error_code ignored;
      std::filesystem::remove(temp_, ignored);
    }
  }

  void bytes(std::span<const std::byte> b) {
    if (b.empty()) return;
    if (std::fwrite(b.data(), 1, b.size(), file_) != b.size()) {
      throw IOError(where_ + ": cannot write '" + temp_.string() + "': " + system_message());
    }
    crc_ = crc32_z(crc_, reinterpret_cast<const Bytef*>(b.data()), b.size());
  }
  void u8(std::uint8_t v) { bytes(std::array{std::byte{v}}); }
  void u32(std::uint32_t v) { little_endian<4>(v); }
  void i64(std::int64_t v) { little_endian<8>(static_cast<std::uint64_t>(v)); }

  // Appends the checksum, makes the file durable, and renames it over the destination.
  void commit() {
    u32(static_cast<std::uint32_t>(crc_));
    bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
    std::string why = ok ? "" : system_message();
    if (std::fclose(std::exchange(file_, nullptr)) != 0 && ok) {
      ok = false;
      why = system_message();
    }
    if (!ok) throw IOError(where_ + ": cannot write '" + temp_.string() + "': " + why);
    std::error_code error;
    std::filesystem::rename(temp_, path_, error);
    if (error) throw IOError(where_ + ": cannot rename '" + temp_.string() + "' into place: " + error.message());
    committed_ = true;
  }

 private:
  template <std::size_t N>
  void little_endian(std::uint64_t v) {
    std::array<std::byte, N> b;
    for (std::size_t i = 0; i < N; ++i) b[i] = static_cast<std::byte>(v >> (8 * i));
    bytes(b);
  }

  std::filesystem::path path_;
  std::filesystem::path temp_;
  std::string where_;
  std::FILE* file_ = nullptr;
  uLong crc_ = crc32_z(0, nullptr, 0);
  bool committed_ = false;
};

// A whole file, or its first limit + 1 bytes when it is larger (which load_parameters then
// refuses). The buffer grows with what arrives, so a hostile file costs at most about the
// limit, however large it is or claims to be.
inline std::vector<unsigned char> read_checkpoint_file(const std::filesystem::path& path, std::uint64_t limit) {
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  const std::unique_ptr<std::FILE, Closer> file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) throw IOError(checkpoint_where(path) + ": cannot open: " + system_message());
  std::vector<unsigned char> bytes;
  for (;;) {
    const std::size_t have = bytes.size();
    if (have > limit) return bytes;
    const auto grow =
        static_cast<std::size_t>(std::min<std::uint64_t>(std::max<std::size_t>(have, 64 * 1024), limit + 1 - have));
    bytes.resize(have + grow);
    const std::size_t got = std::fread(bytes.data() + have, 1, grow, file.get());
    bytes.resize(have + got);
    if (got < grow) {
      if (std::ferror(file.get()) != 0) throw IOError(checkpoint_where(path) + ": read failed: " + system_message());
      return bytes;
    }
  }
}

// One parameter as the file holds it; its elements are bytes [offset, offset + size) of the file.
struct CheckpointRecord {
  std::string_view name;
  DType dtype;
  Shape shape;
  std::size_t offset;
  std::size_t size;
};

// Reads the fields of a checkpoint whose checksum has been verified, so a field that does not
// fit is a file written wrong, not a damaged one.
class CheckpointParser {
 public:
  CheckpointParser(std::span<const unsigned char> bytes, const std::string& where) : bytes_(bytes), where_(where) {}

  std::size_t position() const { return pos_; }
  std::size_t remaining() const { return bytes_.size() - pos_; }

  std::span<const unsigned char> take(std::size_t n, const std::string& what) {
    if (n > remaining()) {
      throw FormatError(where_ + ": malformed: " + what + " at byte " + std::to_string(pos_) +
                        " runs past the parameters' end at byte " + std::to_string(bytes_.size()));
    }
    const auto out = bytes_.subspan(pos_, n);
    pos_ += n;
    return out;
  }
  std::uint64_t little_endian(std::size_t n, const std::string& what) {
    std::uint64_t v = 0;
    const auto b = take(n, what);
    for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{b[i]} << (8 * i);
    return v;
  }

  CheckpointRecord record(std::uint32_t index) {
    const std::string what = "parameter #" + std::to_string(index);
    const auto name_size = static_cast<std::size_t>(little_endian(4, what + "'s name length"));
    const auto name_bytes = take(name_size, what + "'s name");
    CheckpointRecord r{std::string_view(reinterpret_cast<const char*>(name_bytes.data()), name_bytes.size()),
                       DType::float32, Shape{}, 0, 0};
    const std::string who = "parameter " + shown_name(r.name);
    const auto type = little_endian(1, who + "'s element type");
    if (type > static_cast<std::uint64_t>(DType::uint8)) {
      throw FormatError(where_ + ": malformed: " + who + " has element type " + std::to_string(type) +
                        ", which is no duet::DType");
    }
    r.dtype = static_cast<DType>(type);
    const auto rank = little_endian(1, who + "'s rank");
    if (rank > static_cast<std::uint64_t>(max_rank)) {
      throw FormatError(where_ + ": malformed: " + who + " has rank " + std::to_string(rank) + ", more than " +
                        std::to_string(max_rank));
    }
    // Saturates past what is left, so no product overflows and a zero dimension still gives 0.
    const std::uint64_t limit = remaining() / size_of(r.dtype);
    std::uint64_t numel = 1;
    for (std::uint64_t i = 0; i < rank; ++i) {
      const auto d = static_cast<std::int64_t>(little_endian(8, who + "'s dimension " + std::to_string(i)));
      if (d < 0) {
        throw FormatError(where_ + ": malformed: " + who + " has dimension " + std::to_string(i) + " = " +
                          std::to_string(d));
      }
      r.shape.push_back(d);
      const auto u = static_cast<std::uint64_t>(d);
      numel = (u == 0 || numel <= limit / u) ? numel * u : limit + 1;
    }
    if (numel > limit) {
      throw FormatError(where_ + ": malformed: " + who + "'s elements " + to_string(r.shape) +
                        " run past the parameters' end at byte " + std::to_string(bytes_.size()));
    }
    r.offset = pos_;
    r.size = static_cast<std::size_t>(numel) * size_of(r.dtype);
    take(r.size, who + "'s elements");
    return r;
  }

 private:
  std::span<const unsigned char> bytes_;
  std::string where_;
  std::size_t pos_ = 0;
};

// The parameters of a checkpoint file, checked for everything but whether they fit a cell.
// `expected` is the size a checkpoint of the cell takes, for telling truncation from damage.
inline std::vector<CheckpointRecord> parse_checkpoint(std::span<const unsigned char> bytes, std::uint64_t expected,
                                                      const std::string& where) {
  const std::size_t n = bytes.size();
  const std::size_t magic_seen = std::min<std::size_t>(n, checkpoint_magic.size());
  if (!std::equal(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(magic_seen), checkpoint_magic.begin())) {
    throw FormatError(where + ": not a duet checkpoint: it does not start with \"DUETCKPT\"");
  }
  const auto truncated = [&] {
    return FormatError(where + ": truncated at byte " + std::to_string(n) + "; a checkpoint of this cell is " +
                       std::to_string(expected) + " bytes");
  };
  if (n < checkpoint_magic.size() + 4) throw truncated();
  CheckpointParser header(bytes, where);
  header.take(checkpoint_magic.size(), "the magic");
  const auto version = header.little_endian(4, "the version");
  if (version != checkpoint_version) {
    throw FormatError(where + ": format version " + std::to_string(version) + "; this duet reads version " +
                      std::to_string(checkpoint_version));
  }
  if (n < checkpoint_header_bytes + checkpoint_checksum_bytes) throw truncated();

  const std::size_t body = n - checkpoint_checksum_bytes;
  CheckpointParser checksum(bytes.subspan(body), where);
  const auto stored = checksum.little_endian(4, "the checksum");
  if (stored != crc32_z(crc32_z(0, nullptr, 0), bytes.data(), body)) {
    // A cut file rarely ends in a valid checksum, so a short file that fails is taken as cut.
    if (n < expected) throw truncated();
    throw FormatError(where + ": checksum mismatch: the file is damaged");
  }

  CheckpointParser in(bytes.first(body), where);
  in.take(checkpoint_magic.size() + 4, "the header");
  const auto count = static_cast<std::uint32_t>(in.little_endian(4, "the parameter count"));
  // Not reserved from count: a hostile count must not size an allocation.
  std::vector<CheckpointRecord> records;
  for (std::uint32_t i = 0; i < count; ++i) records.push_back(in.record(i));
  if (in.remaining() != 0) {
    throw FormatError(where + ": malformed: " + std::to_string(in.remaining()) + " unexpected bytes at byte " +
                      std::to_string(in.position()) + ", after the parameters");
  }
  return records;
}

// The size of a checkpoint of these parameters: files of other sizes hold something else, and
// a shorter one that fails its checksum is taken as cut.
template <ElementType T>
std::uint64_t checkpoint_size(const std::vector<nn::NamedParameter<T>>& parameters) {
  std::uint64_t size = checkpoint_header_bytes + checkpoint_checksum_bytes;
  for (const auto& [name, p] : parameters) {
    size += checkpoint_record_header_bytes + name.size() + 8 * std::uint64_t(p->ndim()) +
            std::uint64_t(p->numel()) * sizeof(T);
  }
  return size;
}

// load_checkpoint and load_checkpoint_bytes: checks that bytes hold exactly these parameters,
// then copies them in. `expected` is checkpoint_size(parameters).
template <ElementType T>
void load_parameters(std::span<const unsigned char> bytes, std::uint64_t expected,
                     const std::vector<nn::NamedParameter<T>>& parameters, const std::string& where) {
  if (bytes.size() > expected) {
    throw FormatError(where + ": larger than the " + std::to_string(expected) +
                      " bytes a checkpoint of this cell takes; it holds other parameters or shapes");
  }
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < parameters.size(); ++i) index.emplace(parameters[i].name, i);
  const auto records = parse_checkpoint(bytes, expected, where);

  std::vector<const CheckpointRecord*> source(parameters.size(), nullptr);
  for (const auto& r : records) {
    const auto found = index.find(r.name);
    if (found == index.end()) {
      throw FormatError(where + ": parameter " + shown_name(r.name) + " in the file is not in the cell");
    }
    const std::size_t i = found->second;
    const auto& p = *parameters[i].parameter;
    if (source[i] != nullptr) {
      throw FormatError(where + ": parameter '" + parameters[i].name + "' appears twice in the file");
    }
    if (r.dtype != p.dtype()) {
      throw FormatError(where + ": parameter '" + parameters[i].name + "' is " + std::string(name_of(p.dtype())) +
                        " in the cell but " + std::string(name_of(r.dtype)) + " in the file");
    }
    if (!(r.shape == p.shape())) {
      throw FormatError(where + ": parameter '" + parameters[i].name + "' has shape " + to_string(p.shape()) +
                        " in the cell but " + to_string(r.shape) + " in the file");
    }
    source[i] = &r;
  }
  std::string missing;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    if (source[i] == nullptr) missing += (missing.empty() ? "'" : ", '") + parameters[i].name + "'";
  }
  if (!missing.empty()) throw FormatError(where + ": the file has no value for the cell's parameter(s) " + missing);

  for (std::size_t i = 0; i < parameters.size(); ++i) {
    std::copy_n(bytes.begin() + static_cast<std::ptrdiff_t>(source[i]->offset), source[i]->size,
                reinterpret_cast<unsigned char*>(parameters[i].parameter->data()));
  }
}

}  // namespace detail

// Writes every parameter of cell (and the cells below it) to path, atomically: on any failure
// path keeps its previous contents.
template <ElementType T>
void save_checkpoint(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path) {
  const auto parameters = cell.parameters();
  detail::CheckpointWriter out(path);
  out.bytes(std::as_bytes(std::span(detail::checkpoint_magic)));
  out.u32(detail::checkpoint_version);
  out.u32(static_cast<std::uint32_t>(parameters.size()));
  for (const auto& [name, p] : parameters) {
    out.u32(static_cast<std::uint32_t>(name.size()));
    out.bytes(std::as_bytes(std::span(name)));
    out.u8(static_cast<std::uint8_t>(p->dtype()));
    out.u8(static_cast<std::uint8_t>(p->ndim()));
    for (index_t d : p->shape()) out.i64(d);
    out.bytes(std::as_bytes(p->values()));
  }
  out.commit();
}

// Reads a checkpoint into cell's parameters. The file must hold exactly the cell's
// parameters, by name, with their element types and shapes. Everything is checked before
// anything is copied: on any error (a duet::FormatError naming the problem, or IOError when
// the file cannot be read) the cell is left as it was.
template <ElementType T>
void load_checkpoint(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell) {
  const auto parameters = cell.parameters();
  const std::uint64_t expected = detail::checkpoint_size(parameters);
  const std::vector<unsigned char> bytes = detail::read_checkpoint_file(path, expected);
  detail::load_parameters(std::span<const unsigned char>(bytes), expected, parameters, detail::checkpoint_where(path));
}

// The same for the bytes of a checkpoint already in memory.
template <ElementType T>
void load_checkpoint_bytes(std::span<const std::byte> bytes, nn::BasicDynamicCell<T>& cell) {
  const auto parameters = cell.parameters();
  detail::load_parameters(std::span(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()),
                          detail::checkpoint_size(parameters), parameters, "checkpoint data");
}

}  // namespace duet
