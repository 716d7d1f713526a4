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
#include <cerrno>
#include <cmath>
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
#include "../config.hpp"
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
DUET_DETAIL_COMPILED std::string shown_name(std::string_view name);

// Writes a checkpoint to a temporary file beside its destination and renames it into place
// on commit, so the destination is always either the old file or the whole new one. The
// temporary file is removed if the writer is destroyed before commit. `where` names the file
// in messages ("checkpoint '<path>'"); safetensors files are written the same way.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::filesystem::path& path, const std::string& where);
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter();

  void bytes(std::span<const std::byte> b);
  void u8(std::uint8_t v) { bytes(std::array{std::byte{v}}); }
  void u32(std::uint32_t v) { little_endian<4>(v); }
  void i64(std::int64_t v) { little_endian<8>(static_cast<std::uint64_t>(v)); }
  void u64(std::uint64_t v) { little_endian<8>(v); }

  // CRC-32 of every byte written so far.
  std::uint32_t checksum() const { return static_cast<std::uint32_t>(crc_); }

  // Makes the file durable and renames it over the destination.
  void commit();

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
DUET_DETAIL_COMPILED std::vector<unsigned char> read_whole_file(const std::filesystem::path& path,
                                                                const std::string& where);

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

  std::span<const unsigned char> take(std::size_t n, const std::string& what);
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
  std::string_view name(std::size_t n, const std::string& what, bool may_be_empty = false);

  // `count` records; `noun` ("parameter", "optimizer state") names them in messages. Unverified,
  // a record of `owners` (the optimiser's state, of the parameters) is "<slot>.<owner's name>",
  // of its owner's type and shape, or its fields are damaged.
  std::vector<CheckpointRecord> records(std::uint32_t count, const std::string& noun,
                                        const std::vector<CheckpointRecord>* owners = nullptr);

  // A version 3 file's generators, their count first.
  std::vector<std::pair<std::string_view, GeneratorState>> generators();

 private:
  CheckpointRecord record(std::uint32_t index, const std::string& noun, const std::vector<CheckpointRecord>* owners);

  static bool owned(const CheckpointRecord& r, const std::vector<CheckpointRecord>& owners);

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

DUET_DETAIL_COMPILED FormatError checkpoint_truncated(std::size_t n, const CheckpointExpectation& expected,
                                                      const std::string& where, const std::string& inside = {});

// The fields after the version, into `file` as they are read, so that a walk cut short keeps
// what it read.
DUET_DETAIL_COMPILED void read_checkpoint_fields(CheckpointParser& in, ParsedCheckpoint& file,
                                                 const std::string& where);

// Why a file failed its checksum. A cut file is the start of a whole one, so its fields read
// well until one runs past its end; a damaged one has a whole file's size, and its fields read
// through to the checksum (damage in the values) or go wrong. A damaged field can also run past
// the end: where the cell says where its parameters end, they must end there for the file to be
// taken as cut, and a file of a whole checkpoint's size is taken as damaged.
DUET_DETAIL_COMPILED FormatError checksum_failure(std::span<const unsigned char> bytes, std::uint32_t version,
                                                  const CheckpointExpectation& expected, const std::string& where);

// A checkpoint file, checked for everything but whether it fits a cell.
DUET_DETAIL_COMPILED ParsedCheckpoint parse_checkpoint(std::span<const unsigned char> bytes,
                                                       const CheckpointExpectation& expected, const std::string& where);

DUET_DETAIL_COMPILED std::vector<CheckpointEntry> entries_of(const std::vector<CheckpointRecord>& records);

DUET_DETAIL_COMPILED CheckpointInfo info_of(std::span<const unsigned char> bytes, const std::string& where);

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
DUET_DETAIL_COMPILED std::string name_list(const std::vector<std::string_view>& names);

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
DUET_DETAIL_COMPILED void check_all_matched(const std::vector<std::string_view>& unknown,
                                            const std::vector<std::string_view>& missing, const MatchWords& words,
                                            const std::string& where);

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
DUET_DETAIL_COMPILED std::vector<const GeneratorState*> match_generators(const ParsedCheckpoint& file,
                                                                         const std::vector<NamedGenerator>& generators,
                                                                         const std::string& where);

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
DUET_DETAIL_COMPILED CheckpointInfo checkpoint_info(const std::filesystem::path& path);

DUET_DETAIL_COMPILED CheckpointInfo checkpoint_info_bytes(std::span<const std::byte> bytes);

}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/checkpoint_impl.hpp"
#endif
