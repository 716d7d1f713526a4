// Checkpoints: a cell's parameters in one file (MindSpore's save_checkpoint / load_checkpoint),
// and optionally its optimiser's state, so that training can resume.
//
// Format, version 3; every integer is little-endian:
//
//   size           field
//   8              magic "DUETCKPT"
//   4              u32 version: 3
//   4              u32 number of parameters
//   per parameter, in the cell's order (a reader accepts any order), a record:
//     4            u32 name length, then the name's bytes: the parameter's path in the cell,
//                  "dense_relu_sequential.0.weight", with no terminator
//     1            u8 element type, a duet::DType: 0 Float32, 1 Float64, 2 Int32, 3 Int64, 4 UInt8
//     1            u8 rank, 0 to duet::max_rank
//     8 × rank     i64 dimensions
//     numel × size the elements, row-major, little-endian
//   4              u32 length of the optimiser's type name, then the name ("nn::Adam", "nn::AdamW",
//                  "nn::SGD"); 0 when the file holds no optimiser state, and then the next
//                  two fields and the records are absent
//   8              i64 the optimiser's global step (which drives schedules and bias correction)
//   4              u32 number of optimiser state tensors
//   per state tensor, a record as above, named "<slot>.<parameter's name>":
//                  "moment1.dense_relu_sequential.0.weight" (Adam: moment1, moment2; SGD with
//                  momentum: momentum)
//   4              u32 number of generators (present with the optimiser's state only): the
//                  random streams of the cells that draw while they train (nn::Dropout's masks)
//   per generator, in the cell's order:
//     4            u32 name length, then the name: "generator.<the cell's path>",
//                  "generator.classifier.1" ("generator" for a root cell)
//     8 × 4        u64 the four words of its xoshiro256** state, not all zero
//     1            u8 1 when a second normal draw is pending, else 0
//     8            f64 that draw (0 when none), finite
//   4              u32 CRC-32 (zlib's crc32) of every byte before it
//
// Version 2 is the same without the generators, and version 1 without the optimiser's state
// either (the checksum follows the parameters' records); both are still read. Resuming from a
// version 2 file leaves the generators as they are, so a network with Dropout then draws other
// masks than the run that saved it.
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
#include <cmath>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../cell.hpp"
#include "../dtype.hpp"
#include "../error.hpp"
#include "../nn/optim.hpp"
#include "../random.hpp"
#include "../shape.hpp"

namespace duet {

// Elements are written and read as they lie in memory.
static_assert(std::endian::native == std::endian::little, "duet checkpoints need a little-endian machine");

// One tensor a checkpoint file holds, as checkpoint_info lists it.
struct CheckpointEntry {
  std::string name;
  DType dtype;
  Shape shape;
};

// What a checkpoint file holds (checkpoint_info): its parameters and, when it was saved with
// an optimiser, that optimiser's type, step and state tensors.
struct CheckpointInfo {
  std::uint32_t version = 0;
  std::vector<CheckpointEntry> parameters;
  std::string optimizer;  // "nn::Adam", or "" when the file holds no optimiser state
  std::int64_t global_step = 0;
  std::vector<CheckpointEntry> optimizer_state;
  std::vector<std::string> generators;  // "generator.<cell path>", saved with the optimiser's state
};

struct CheckpointLoadOptions {
  // All or nothing: every parameter of the cell, and nothing else, with its type and shape.
  // When false, loads the parameters whose name, type and shape match and reports the rest.
  bool strict = true;
};

// What a load left out, as MindSpore's load_param_into_net returns it: the cell's parameters
// that kept their values, and the file's parameters that were not used (another name, type or
// shape). A strict load either loads everything, returning two empty lists, or throws.
struct CheckpointLoad {
  std::vector<std::string> param_not_load;
  std::vector<std::string> ckpt_not_load;
};

namespace detail {

inline constexpr std::string_view checkpoint_magic = "DUETCKPT";
inline constexpr std::uint32_t checkpoint_version = 3;
// Magic, version, count; the checksum; each record's name length, type and rank; the
// optimiser section's name length, then its step and count when there is one, and the
// generators' count; each generator's name length and state.
inline constexpr std::uint64_t checkpoint_header_bytes = 8 + 4 + 4;
inline constexpr std::uint64_t checkpoint_optimizer_bytes = 4;
inline constexpr std::uint64_t checkpoint_optimizer_state_bytes = 8 + 4;
inline constexpr std::uint64_t checkpoint_checksum_bytes = 4;
inline constexpr std::uint64_t checkpoint_record_header_bytes = 4 + 1 + 1;
inline constexpr std::uint64_t checkpoint_generators_bytes = 4;
inline constexpr std::uint64_t checkpoint_generator_bytes = 4 + 8 * 4 + 1 + 8;

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
// temporary file is removed if the writer is destroyed before commit. `where` names the file
// in messages ("checkpoint '<path>'"); safetensors files are written the same way.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::filesystem::path& path, const std::string& where) : path_(path), where_(where) {
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
  void u64(std::uint64_t v) { little_endian<8>(v); }

  // CRC-32 of every byte written so far.
  std::uint32_t checksum() const { return static_cast<std::uint32_t>(crc_); }

  // Makes the file durable and renames it over the destination.
  void commit() {
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

// A whole file; `where` names it in messages. The buffer is sized by the file's size on disk,
// and grows with what arrives when that is unknown or the file grows meanwhile, so a file costs
// what it holds, whatever its fields claim.
inline std::vector<unsigned char> read_whole_file(const std::filesystem::path& path, const std::string& where) {
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  const std::unique_ptr<std::FILE, Closer> file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) throw IOError(where + ": cannot open: " + system_message());
  std::error_code unknown;
  const auto size = static_cast<std::size_t>(std::filesystem::file_size(path, unknown));
  std::vector<unsigned char> bytes;
  for (;;) {
    const std::size_t have = bytes.size();
    // One byte more than the size, so that the first read already meets the end.
    const std::size_t grow = have == 0 && !unknown ? size + 1 : std::max<std::size_t>(have, 64 * 1024);
    bytes.resize(have + grow);
    const std::size_t got = std::fread(bytes.data() + have, 1, grow, file.get());
    bytes.resize(have + got);
    if (got < grow) {
      if (std::ferror(file.get()) != 0) throw IOError(where + ": read failed: " + system_message());
      return bytes;
    }
  }
}

// One tensor as the file holds it; its elements are bytes [offset, offset + size) of the file.
struct CheckpointRecord {
  std::string_view name;
  DType dtype;
  Shape shape;
  std::size_t offset;
  std::size_t size;
};

// A field of a file that failed its checksum runs past the file's end: [begin, end) is where
// the field would lie, were the file whole.
struct CheckpointCut {
  std::string what;
  std::size_t begin;
  std::uint64_t end;
};

// Reads the fields of a checkpoint. Verified, its checksum held, so a field that does not fit
// is a file written wrong, not a damaged one. Unverified (why the checksum failed), a field
// that runs past the end throws a CheckpointCut.
class CheckpointParser {
 public:
  enum Checksum { verified, unverified };
  CheckpointParser(std::span<const unsigned char> bytes, const std::string& where, Checksum checksum = verified)
      : bytes_(bytes), where_(where), checksum_(checksum) {}

  std::size_t position() const { return pos_; }
  std::size_t remaining() const { return bytes_.size() - pos_; }

  std::span<const unsigned char> take(std::size_t n, const std::string& what) {
    if (n > remaining()) {
      if (checksum_ == unverified) throw CheckpointCut{what, pos_, std::uint64_t{pos_} + n};
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
  std::string_view text(std::size_t n, const std::string& what) {
    const auto b = take(n, what);
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }

  // A name of n bytes: a path, an optimiser's type. Unverified, one that no writer makes (empty
  // where it may not be, longer than any path, or with control bytes in what the file holds of
  // it) is a damaged length rather than a cut.
  std::string_view name(std::size_t n, const std::string& what, bool may_be_empty = false) {
    if (checksum_ == unverified) {
      constexpr std::size_t longest = 64 * 1024;
      const auto there = bytes_.subspan(pos_, std::min(n, remaining()));
      if ((n == 0 && !may_be_empty) || n > longest ||
          std::any_of(there.begin(), there.end(), [](unsigned char c) { return c < 0x20 || c == 0x7F; })) {
        throw FormatError(where_ + ": malformed: " + what);
      }
    }
    return text(n, what);
  }

  // `count` records; `noun` ("parameter", "optimizer state") names them in messages. Unverified,
  // a record of `owners` (the optimiser's state, of the parameters) is "<slot>.<owner's name>",
  // of its owner's type and shape, or its fields are damaged.
  std::vector<CheckpointRecord> records(std::uint32_t count, const std::string& noun,
                                        const std::vector<CheckpointRecord>* owners = nullptr) {
    // Not reserved from count: a hostile count must not size an allocation.
    std::vector<CheckpointRecord> out;
    std::unordered_set<std::string_view> seen;
    for (std::uint32_t i = 0; i < count; ++i) {
      out.push_back(record(i, noun, owners));
      if (!seen.insert(out.back().name).second) {
        throw FormatError(where_ + ": " + noun + " " + shown_name(out.back().name) + " appears twice in the file");
      }
    }
    return out;
  }

  // A version 3 file's generators, their count first.
  std::vector<std::pair<std::string_view, GeneratorState>> generators() {
    const auto count = little_endian(4, "the generator count");
    std::vector<std::pair<std::string_view, GeneratorState>> out;
    std::unordered_set<std::string_view> seen;
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::string what = "generator #" + std::to_string(i);
      const auto name =
          this->name(static_cast<std::size_t>(little_endian(4, what + "'s name length")), what + "'s name");
      const std::string who = "generator " + shown_name(name);
      GeneratorState state;
      for (std::size_t w = 0; w < state.words.size(); ++w) {
        state.words[w] = little_endian(8, who + "'s word " + std::to_string(w));
      }
      const auto pending = little_endian(1, who + "'s pending-draw flag");
      state.spare = std::bit_cast<double>(little_endian(8, who + "'s pending draw"));
      std::string wrong;
      if (state.words == decltype(state.words){}) wrong = "all-zero words, which would draw only zeros";
      else if (pending > 1) wrong = "a pending-draw flag of " + std::to_string(pending) + ", not 0 or 1";
      else if (!std::isfinite(state.spare)) wrong = "a pending draw that is not finite";
      if (!wrong.empty()) throw FormatError(where_ + ": malformed: " + who + " has " + wrong);
      state.has_spare = pending == 1;
      if (!seen.insert(name).second) throw FormatError(where_ + ": " + who + " appears twice in the file");
      out.emplace_back(name, state);
    }
    return out;
  }

 private:
  CheckpointRecord record(std::uint32_t index, const std::string& noun, const std::vector<CheckpointRecord>* owners) {
    const std::string what = noun + " #" + std::to_string(index);
    const auto name_size = static_cast<std::size_t>(little_endian(4, what + "'s name length"));
    CheckpointRecord r{name(name_size, what + "'s name"), DType::float32, Shape{}, 0, 0};
    const std::string who = noun + " " + shown_name(r.name);
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
    // Saturates past any file's size, so no product overflows and a zero dimension still gives 0.
    constexpr std::uint64_t most = std::numeric_limits<std::uint64_t>::max() / 16;
    std::uint64_t numel = 1;
    for (std::uint64_t i = 0; i < rank; ++i) {
      const auto d = static_cast<std::int64_t>(little_endian(8, who + "'s dimension " + std::to_string(i)));
      if (d < 0) {
        throw FormatError(where_ + ": malformed: " + who + " has dimension " + std::to_string(i) + " = " +
                          std::to_string(d));
      }
      r.shape.push_back(d);
      const auto u = static_cast<std::uint64_t>(d);
      numel = (u == 0 || numel <= most / u) ? numel * u : most + 1;
    }
    if (checksum_ == unverified && owners != nullptr && !owned(r, *owners)) {
      throw FormatError(where_ + ": malformed: " + who + " is of no parameter");
    }
    const std::uint64_t size = numel * size_of(r.dtype);
    if (size > remaining()) {
      // A saturated count is no cut file's: those are the start of a whole one.
      if (checksum_ == unverified && numel <= most) throw CheckpointCut{who + "'s elements", pos_, pos_ + size};
      throw FormatError(where_ + ": malformed: " + who + "'s elements " + to_string(r.shape) +
                        " run past the parameters' end at byte " + std::to_string(bytes_.size()));
    }
    r.offset = pos_;
    r.size = static_cast<std::size_t>(size);
    take(r.size, who + "'s elements");
    return r;
  }

  static bool owned(const CheckpointRecord& r, const std::vector<CheckpointRecord>& owners) {
    const auto dot = r.name.find('.');
    if (dot == std::string_view::npos) return false;
    return std::any_of(owners.begin(), owners.end(), [&](const CheckpointRecord& owner) {
      return owner.name == r.name.substr(dot + 1) && owner.dtype == r.dtype && owner.shape == r.shape;
    });
  }

  std::span<const unsigned char> bytes_;
  std::string where_;
  Checksum checksum_;
  std::size_t pos_ = 0;
};

// A checkpoint file's fields, which point into its bytes.
struct ParsedCheckpoint {
  std::uint32_t version = 0;
  std::vector<CheckpointRecord> parameters;
  std::size_t parameters_end = 0;  // the byte after the parameters' records; 0 until they are read
  std::string_view optimizer;  // empty when the file holds no optimiser state
  std::int64_t global_step = 0;
  std::vector<CheckpointRecord> optimizer_state;
  std::vector<std::pair<std::string_view, GeneratorState>> generators;
};

// What a load expects of a file, for telling a cut one from a damaged one. Empty for a load
// that is not strict and for checkpoint_info, which have no cell to compare with.
struct CheckpointExpectation {
  std::uint64_t parameters_end = 0;  // where the cell's parameters' records end
  std::uint64_t size = 0;            // a whole checkpoint of the cell, as the load reads it
  std::string_view optimizer;        // whose state the load reads; empty for parameters alone
};

inline FormatError checkpoint_truncated(std::size_t n, const CheckpointExpectation& expected, const std::string& where,
                                        const std::string& inside = {}) {
  std::string message = where + ": truncated at byte " + std::to_string(n) + inside;
  if (n < expected.size) {
    message += "; a checkpoint of this cell " +
               (expected.optimizer.empty() ? std::string("without optimizer state")
                                           : "with its " + std::string(expected.optimizer) + " state") +
               " is " + std::to_string(expected.size) + " bytes";
  }
  return FormatError(message);
}

// The fields after the version, into `file` as they are read, so that a walk cut short keeps
// what it read.
inline void read_checkpoint_fields(CheckpointParser& in, ParsedCheckpoint& file, const std::string& where) {
  file.parameters = in.records(static_cast<std::uint32_t>(in.little_endian(4, "the parameter count")), "parameter");
  file.parameters_end = in.position();
  if (file.version >= 2) {
    const auto name_size = static_cast<std::size_t>(in.little_endian(4, "the optimizer's type name length"));
    file.optimizer = in.name(name_size, "the optimizer's type name", true);
    if (!file.optimizer.empty()) {
      file.global_step = static_cast<std::int64_t>(in.little_endian(8, "the optimizer's global step"));
      if (file.global_step < 0) {
        throw FormatError(where + ": malformed: the optimizer's global step is " + std::to_string(file.global_step));
      }
      const auto count = static_cast<std::uint32_t>(in.little_endian(4, "the optimizer state count"));
      file.optimizer_state = in.records(count, "optimizer state", &file.parameters);
      if (file.version >= 3) file.generators = in.generators();
    }
  }
}

// Why a file failed its checksum. A cut file is the start of a whole one, so its fields read
// well until one runs past its end; a damaged one has a whole file's size, and its fields read
// through to the checksum (damage in the values) or go wrong. A damaged field can also run past
// the end: where the cell says where its parameters end, they must end there for the file to be
// taken as cut, and a file of a whole checkpoint's size is taken as damaged.
inline FormatError checksum_failure(std::span<const unsigned char> bytes, std::uint32_t version,
                                    const CheckpointExpectation& expected, const std::string& where) {
  FormatError damaged(where + ": checksum mismatch: the file is damaged");
  if (bytes.size() == expected.size) return damaged;
  ParsedCheckpoint file;
  file.version = version;
  CheckpointParser walk(bytes, where, CheckpointParser::unverified);
  try {
    walk.take(checkpoint_magic.size() + 4, "the header");
    read_checkpoint_fields(walk, file, where);
    walk.take(checkpoint_checksum_bytes, "the checksum");
    return damaged;
  } catch (const FormatError&) {
    return damaged;
  } catch (const CheckpointCut& cut) {
    const bool other_parameters = file.parameters_end != 0 ? file.parameters_end != expected.parameters_end
                                                           : bytes.size() >= expected.parameters_end;
    if (expected.parameters_end != 0 && other_parameters) return damaged;
    return checkpoint_truncated(
        bytes.size(), expected, where,
        ", inside " + cut.what + " (bytes " + std::to_string(cut.begin) + " to " + std::to_string(cut.end) + ")");
  }
}

// A checkpoint file, checked for everything but whether it fits a cell.
inline ParsedCheckpoint parse_checkpoint(std::span<const unsigned char> bytes, const CheckpointExpectation& expected,
                                         const std::string& where) {
  const std::size_t n = bytes.size();
  const std::size_t magic_seen = std::min<std::size_t>(n, checkpoint_magic.size());
  if (!std::equal(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(magic_seen), checkpoint_magic.begin())) {
    throw FormatError(where + ": not a duet checkpoint: it does not start with \"DUETCKPT\"");
  }
  if (n < checkpoint_magic.size() + 4) throw checkpoint_truncated(n, expected, where);
  ParsedCheckpoint file;
  CheckpointParser header(bytes, where);
  header.take(checkpoint_magic.size(), "the magic");
  const auto version = header.little_endian(4, "the version");
  if (version < 1 || version > checkpoint_version) {
    throw FormatError(where + ": format version " + std::to_string(version) + "; this duet reads versions 1 to " +
                      std::to_string(checkpoint_version));
  }
  file.version = static_cast<std::uint32_t>(version);
  if (n < checkpoint_header_bytes + checkpoint_checksum_bytes) throw checkpoint_truncated(n, expected, where);

  const std::size_t body = n - checkpoint_checksum_bytes;
  CheckpointParser checksum(bytes.subspan(body), where);
  const auto stored = checksum.little_endian(4, "the checksum");
  if (stored != crc32_z(crc32_z(0, nullptr, 0), bytes.data(), body)) {
    throw checksum_failure(bytes, file.version, expected, where);
  }

  CheckpointParser in(bytes.first(body), where);
  in.take(checkpoint_magic.size() + 4, "the header");
  read_checkpoint_fields(in, file, where);
  if (in.remaining() != 0) {
    throw FormatError(where + ": malformed: " + std::to_string(in.remaining()) + " unexpected bytes at byte " +
                      std::to_string(in.position()) + ", after the " +
                      (file.optimizer.empty() ? "parameters" : file.version >= 3 ? "generators" : "optimizer state"));
  }
  return file;
}

inline std::vector<CheckpointEntry> entries_of(const std::vector<CheckpointRecord>& records) {
  std::vector<CheckpointEntry> out;
  out.reserve(records.size());
  for (const auto& r : records) out.push_back({std::string(r.name), r.dtype, r.shape});
  return out;
}

inline CheckpointInfo info_of(std::span<const unsigned char> bytes, const std::string& where) {
  const ParsedCheckpoint file = parse_checkpoint(bytes, {}, where);
  std::vector<std::string> generators;
  for (const auto& g : file.generators) generators.emplace_back(g.first);
  return {file.version, entries_of(file.parameters), std::string(file.optimizer), file.global_step,
          entries_of(file.optimizer_state), std::move(generators)};
}

// A tensor a load fills, by the name the file gives it.
template <ElementType T>
struct CheckpointTarget {
  std::string name;
  BasicTensor<T>* tensor;
};

// The cell's parameters, which a checkpoint cannot do without: a cell with none has almost
// certainly not declared its members.
template <ElementType T>
std::vector<CheckpointTarget<T>> parameter_targets(nn::BasicDynamicCell<T>& cell, const std::string& where) {
  std::vector<CheckpointTarget<T>> out;
  for (auto& [name, p] : cell.parameters()) out.push_back({std::move(name), p});
  if (out.empty()) {
    throw ValueError(where + ": " + cell.type_name() + " has no parameters; " + nn::detail::unregistered_members_hint);
  }
  return out;
}

// The optimiser's state tensors, named "<slot>.<parameter's name>" after the cell's names for
// the parameters the optimiser updates.
template <ElementType T>
std::vector<CheckpointTarget<T>> optimizer_targets(const std::vector<CheckpointTarget<T>>& parameters,
                                                   nn::BasicOptimizer<T>& optimizer, const std::string& where) {
  std::unordered_map<const BasicTensor<T>*, std::string_view> names;
  for (const auto& p : parameters) names.emplace(p.tensor, p.name);
  const auto& updated = optimizer.parameters();
  std::vector<std::string_view> updated_names;
  for (std::size_t i = 0; i < updated.size(); ++i) {
    const auto found = names.find(updated[i]);
    if (found == names.end()) {
      throw ValueError(where + ": the " + std::string(optimizer.type_name()) + "'s parameter #" + std::to_string(i) +
                       ", of shape " + to_string(updated[i]->shape()) +
                       ", is not a parameter of the cell, so its state has no name to go by");
    }
    updated_names.push_back(found->second);
  }
  std::vector<CheckpointTarget<T>> out;
  for (const auto& slot : optimizer.state()) {
    for (std::size_t i = 0; i < updated.size(); ++i) {
      out.push_back({std::string(slot.name).append(".").append(updated_names[i]), &(*slot.tensors)[i]});
    }
  }
  return out;
}

template <ElementType T>
std::uint64_t records_size(const std::vector<CheckpointTarget<T>>& targets) {
  std::uint64_t size = 0;
  for (const auto& [name, t] : targets) {
    size += checkpoint_record_header_bytes + name.size() + 8 * std::uint64_t(t->ndim()) +
            std::uint64_t(t->numel()) * sizeof(T);
  }
  return size;
}

// What a checkpoint saved with an optimiser holds beside the parameters.
template <ElementType T>
struct TrainingTargets {
  std::string_view optimizer;  // its type name; empty for a checkpoint of parameters only
  std::int64_t global_step = 0;
  std::vector<CheckpointTarget<T>> state;
  std::vector<NamedGenerator> generators;
};

// A checkpoint of these tensors, as a strict load expects it.
template <ElementType T>
CheckpointExpectation checkpoint_expectation(const std::vector<CheckpointTarget<T>>& parameters,
                                             const TrainingTargets<T>& training = {}) {
  const std::uint64_t parameters_end = checkpoint_header_bytes + records_size(parameters);
  std::uint64_t size = parameters_end + checkpoint_optimizer_bytes + checkpoint_checksum_bytes;
  if (!training.optimizer.empty()) {
    size += training.optimizer.size() + checkpoint_optimizer_state_bytes + records_size(training.state) +
            checkpoint_generators_bytes;
    for (const auto& g : training.generators) size += checkpoint_generator_bytes + g.name.size();
  }
  return {parameters_end, size, training.optimizer};
}

template <ElementType T>
void write_records(CheckpointWriter& out, const std::vector<CheckpointTarget<T>>& targets) {
  out.u32(static_cast<std::uint32_t>(targets.size()));
  for (const auto& [name, t] : targets) {
    out.u32(static_cast<std::uint32_t>(name.size()));
    out.bytes(std::as_bytes(std::span(name)));
    out.u8(static_cast<std::uint8_t>(t->dtype()));
    out.u8(static_cast<std::uint8_t>(t->ndim()));
    for (index_t d : t->shape()) out.i64(d);
    out.bytes(std::as_bytes(std::span<const T>(t->data(), static_cast<std::size_t>(t->numel()))));
  }
}

template <ElementType T>
void write_checkpoint(const std::filesystem::path& path, const std::vector<CheckpointTarget<T>>& parameters,
                      const TrainingTargets<T>& training = {}) {
  CheckpointWriter out(path, checkpoint_where(path));
  out.bytes(std::as_bytes(std::span(checkpoint_magic)));
  out.u32(checkpoint_version);
  write_records(out, parameters);
  out.u32(static_cast<std::uint32_t>(training.optimizer.size()));
  if (!training.optimizer.empty()) {
    out.bytes(std::as_bytes(std::span(training.optimizer)));
    out.i64(training.global_step);
    write_records(out, training.state);
    out.u32(static_cast<std::uint32_t>(training.generators.size()));
    for (const auto& [name, generator] : training.generators) {
      out.u32(static_cast<std::uint32_t>(name.size()));
      out.bytes(std::as_bytes(std::span(name)));
      const GeneratorState state = generator->state();
      for (std::uint64_t word : state.words) out.u64(word);
      out.u8(state.has_spare ? 1 : 0);
      out.u64(std::bit_cast<std::uint64_t>(state.spare));
    }
  }
  out.u32(out.checksum());
  out.commit();
}

// Names for a message, the first few of them: a hostile file may hold millions.
inline std::string name_list(const std::vector<std::string_view>& names) {
  constexpr std::size_t most = 10;
  std::string out;
  for (std::size_t i = 0; i < std::min(names.size(), most); ++i) out += (i == 0 ? "" : ", ") + shown_name(names[i]);
  if (names.size() > most) out += " and " + std::to_string(names.size() - most) + " more";
  return out;
}

// How messages call the tensors matched and what holds them: "parameter", "the cell".
struct MatchWords {
  std::string noun;
  std::string holder;
  // What the names only the file has and those only the holder has suggest, appended to a
  // strict match's error (a format's own knowledge: safetensors files from PyTorch).
  std::function<std::string(const std::vector<std::string_view>& unknown, const std::vector<std::string_view>& missing)>
      hint = {};
};

// A strict match's names: those only the file has (`unknown`) and those only the holder has.
inline void check_all_matched(const std::vector<std::string_view>& unknown, const std::vector<std::string_view>& missing,
                              const MatchWords& words, const std::string& where) {
  if (unknown.empty() && missing.empty()) return;
  std::string message = where + ": ";
  if (!unknown.empty()) {
    message += "the file's " + words.noun + "(s) " + name_list(unknown) + " are not in " + words.holder;
  }
  if (!missing.empty()) {
    message += std::string(unknown.empty() ? "" : ", and ") + "the file has no value for " + words.holder + "'s " +
               words.noun + "(s) " + name_list(missing);
  }
  if (words.hint) message += words.hint(unknown, missing);
  throw FormatError(message);
}

// For each target, the record of its name, type and shape, or nullptr. A strict match throws
// on the first difference of type or shape, then on names in the file or the holder only;
// otherwise the names not matched go to `unmatched`.
template <ElementType T>
std::vector<const CheckpointRecord*> match_records(const std::vector<CheckpointRecord>& records,
                                                   const std::vector<CheckpointTarget<T>>& targets,
                                                   const MatchWords& words, const std::string& where,
                                                   CheckpointLoad* unmatched) {
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < targets.size(); ++i) index.emplace(targets[i].name, i);
  std::vector<const CheckpointRecord*> source(targets.size(), nullptr);
  std::vector<std::string_view> unknown;
  for (const auto& r : records) {
    const auto found = index.find(r.name);
    if (found == index.end()) {
      unknown.push_back(r.name);
      continue;
    }
    const auto& [name, t] = targets[found->second];
    std::string difference;
    if (r.dtype != t->dtype()) {
      difference = " is " + std::string(name_of(t->dtype())) + " in " + words.holder + " but " +
                   std::string(name_of(r.dtype)) + " in the file";
    } else if (!(r.shape == t->shape())) {
      difference = " has shape " + to_string(t->shape()) + " in " + words.holder + " but " + to_string(r.shape) +
                   " in the file";
    }
    if (difference.empty()) {
      source[found->second] = &r;
    } else if (unmatched == nullptr) {
      throw FormatError(where + ": " + words.noun + " '" + name + "'" + difference);
    } else {
      unknown.push_back(r.name);
    }
  }
  std::vector<std::string_view> missing;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (source[i] == nullptr) missing.push_back(targets[i].name);
  }
  if (unmatched != nullptr) {
    for (const auto name : missing) unmatched->param_not_load.emplace_back(name);
    for (const auto name : unknown) unmatched->ckpt_not_load.emplace_back(name);
  } else {
    check_all_matched(unknown, missing, words, where);
  }
  return source;
}

// For each generator, its state in the file. A version 2 file holds none: the generators are
// left as they are (nullptr). Otherwise the names must be the cell's, all of them.
inline std::vector<const GeneratorState*> match_generators(const ParsedCheckpoint& file,
                                                           const std::vector<NamedGenerator>& generators,
                                                           const std::string& where) {
  std::vector<const GeneratorState*> source(generators.size(), nullptr);
  if (file.version < 3) return source;
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < generators.size(); ++i) index.emplace(generators[i].name, i);
  std::vector<std::string_view> unknown;
  for (const auto& [name, state] : file.generators) {
    const auto found = index.find(name);
    if (found == index.end()) unknown.push_back(name);
    else source[found->second] = &state;
  }
  std::vector<std::string_view> missing;
  for (std::size_t i = 0; i < generators.size(); ++i) {
    if (source[i] == nullptr) missing.push_back(generators[i].name);
  }
  check_all_matched(unknown, missing, {"generator", "the cell"}, where);
  return source;
}

template <ElementType T>
void copy_records(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& targets,
                  const std::vector<const CheckpointRecord*>& source) {
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (source[i] == nullptr) continue;
    std::copy_n(bytes.begin() + static_cast<std::ptrdiff_t>(source[i]->offset), source[i]->size,
                reinterpret_cast<unsigned char*>(targets[i].tensor->data()));
  }
}

inline const MatchWords parameter_words{"parameter", "the cell"};

// load_checkpoint and load_checkpoint_bytes: checks the whole file, then copies what matches.
template <ElementType T>
CheckpointLoad load_parameters(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& parameters,
                               const CheckpointLoadOptions& options, const std::string& where) {
  // A file that need not fit the cell says nothing by its size.
  const ParsedCheckpoint file =
      parse_checkpoint(bytes, options.strict ? checkpoint_expectation(parameters) : CheckpointExpectation{}, where);
  CheckpointLoad unmatched;
  const auto source =
      match_records(file.parameters, parameters, parameter_words, where, options.strict ? nullptr : &unmatched);
  copy_records(bytes, parameters, source);
  return unmatched;
}

// The same with the optimiser's state and the generators, which must match as strictly as the
// parameters.
template <ElementType T>
void load_training_state(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& parameters,
                         nn::BasicOptimizer<T>& optimizer, const TrainingTargets<T>& training,
                         const std::string& where) {
  const std::string_view type = training.optimizer;
  const ParsedCheckpoint file = parse_checkpoint(bytes, checkpoint_expectation(parameters, training), where);
  const auto parameter_source = match_records(file.parameters, parameters, parameter_words, where, nullptr);
  if (file.optimizer.empty()) {
    throw FormatError(where + ": holds no optimizer state" +
                      (file.version < 2 ? " (it is format version 1, which cannot)"
                                        : " (it was saved without an optimizer)") +
                      ", so the " + std::string(type) + " cannot resume from it");
  }
  if (file.optimizer != type) {
    throw FormatError(where + ": holds the state of an optimizer " + shown_name(file.optimizer) + ", not of an " +
                      std::string(type));
  }
  const auto state_source = match_records(file.optimizer_state, training.state,
                                          {"optimizer state", "the " + std::string(type)}, where, nullptr);
  const auto generator_source = match_generators(file, training.generators, where);
  copy_records(bytes, parameters, parameter_source);
  copy_records(bytes, training.state, state_source);
  optimizer.set_global_step(file.global_step);
  for (std::size_t i = 0; i < generator_source.size(); ++i) {
    if (generator_source[i] != nullptr) training.generators[i].generator->set_state(*generator_source[i]);
  }
}

// What save_checkpoint(cell, path, optimizer) saves beside the parameters, and a load restores.
template <ElementType T>
TrainingTargets<T> training_targets(nn::BasicDynamicCell<T>& cell, const std::vector<CheckpointTarget<T>>& parameters,
                                    nn::BasicOptimizer<T>& optimizer, const std::string& where) {
  return {optimizer.type_name(), optimizer.global_step(), optimizer_targets(parameters, optimizer, where),
          named_generators(cell)};
}

inline std::span<const unsigned char> unsigned_bytes(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()};
}

inline const std::string checkpoint_data_where = "checkpoint data";

}  // namespace detail

// Writes every parameter of cell (and the cells below it) to path, atomically: on any failure
// path keeps its previous contents. A cell without parameters is a ValueError.
template <ElementType T>
void save_checkpoint(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path) {
  detail::write_checkpoint(path, detail::parameter_targets(cell, detail::checkpoint_where(path)));
}

// The same, with the state of the optimiser that trains cell (its type, step count and, per
// parameter, its moments or momentum, named by the cell's parameter names) and of the
// generators its Dropout layers draw masks from, so that load_checkpoint(path, net, optimizer)
// resumes training where it stopped, in a new process too, bit for bit. Every parameter the
// optimiser updates must be one of cell's (a ValueError otherwise).
template <ElementType T>
void save_checkpoint(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path,
                     nn::BasicOptimizer<T>& optimizer) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  detail::write_checkpoint(path, parameters, detail::training_targets(cell, parameters, optimizer, where));
}

// Reads a checkpoint into cell's parameters. Strict (the default): the file must hold
// exactly the cell's parameters, by name, with their element types and shapes; the first
// difference is a duet::FormatError naming the parameter and both shapes or types, or the
// names only the file or only the cell has. Not strict ({.strict = false}): loads the
// parameters that match and returns the names of the others (a strict load returns empty
// lists). Either way the whole file is checked (checksum, fields) before anything is copied:
// on any error (FormatError, or IOError when the file cannot be read) the cell is left as it
// was. Optimiser state in the file is not needed and not used.
template <ElementType T>
CheckpointLoad load_checkpoint(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell,
                               CheckpointLoadOptions options = {}) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  return detail::load_parameters(std::span<const unsigned char>(detail::read_whole_file(path, where)), parameters,
                                 options, where);
}

// Reads a checkpoint saved with an optimiser into cell and optimizer, strictly: parameters,
// optimiser type (nn::Adam is not nn::AdamW), every state tensor and the Dropout layers'
// generators must match, or a FormatError names the difference and nothing changes (a
// version 2 file holds no generators and leaves them as they are). The optimiser's hyper-parameters
// (learning rate or schedule, betas, momentum) are its own, not the file's; its step count
// comes from the file, so a schedule goes on from where it was.
template <ElementType T>
void load_checkpoint(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell,
                     nn::BasicOptimizer<T>& optimizer) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  detail::load_training_state(std::span<const unsigned char>(detail::read_whole_file(path, where)), parameters,
                              optimizer, detail::training_targets(cell, parameters, optimizer, where), where);
}

// The same for the bytes of a checkpoint already in memory.
template <ElementType T>
CheckpointLoad load_checkpoint_bytes(std::span<const std::byte> bytes, nn::BasicDynamicCell<T>& cell,
                                     CheckpointLoadOptions options = {}) {
  const auto& where = detail::checkpoint_data_where;
  return detail::load_parameters(detail::unsigned_bytes(bytes), detail::parameter_targets(cell, where), options,
                                 where);
}

template <ElementType T>
void load_checkpoint_bytes(std::span<const std::byte> bytes, nn::BasicDynamicCell<T>& cell,
                           nn::BasicOptimizer<T>& optimizer) {
  const auto& where = detail::checkpoint_data_where;
  const auto parameters = detail::parameter_targets(cell, where);
  detail::load_training_state(detail::unsigned_bytes(bytes), parameters, optimizer,
                              detail::training_targets(cell, parameters, optimizer, where), where);
}

// What a checkpoint file holds, checked as a load checks it (checksum, every field), with no
// cell needed: a FormatError or IOError otherwise.
inline CheckpointInfo checkpoint_info(const std::filesystem::path& path) {
  const std::string where = detail::checkpoint_where(path);
  return detail::info_of(detail::read_whole_file(path, where), where);
}

inline CheckpointInfo checkpoint_info_bytes(std::span<const std::byte> bytes) {
  return detail::info_of(detail::unsigned_bytes(bytes), detail::checkpoint_data_where);
}

}  // namespace duet
