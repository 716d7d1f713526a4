// duet: one neural network, two modes. Single-header edition.
// Generated from include/duet by tools/amalgamate.cpp; edit include/, then run
// `cmake --build <build> --target single_include`.
#pragma once
#include "../duet.hpp"
// safetensors files: a cell's named tensors in the format of Hugging Face's safetensors, which
// PyTorch (safetensors.torch.save_file / load_file), JAX, MindSpore's converters and most
// model hubs read and write. duet::io::save_safetensors(net, path) and
// duet::io::load_safetensors(path, net, options).
//
// Format (https://github.com/huggingface/safetensors, "Format"):
//
//   8              u64, little-endian: N, the header's length in bytes
//   N              the header: UTF-8 JSON, an object starting with '{' (trailing spaces allowed):
//                    {"<name>": {"dtype": "F32", "shape": [4, 3], "data_offsets": [begin, end]},
//                     ..., "__metadata__": {"<key>": "<string>", ...}}
//                  offsets count from the first byte after the header; end is one past the last
//   rest           the tensors' elements, row-major, little-endian; the tensors' byte ranges
//                  cover it exactly, with no overlap and no gap
//
// Which tensors: those save_checkpoint writes, by the same names, the paths of
// cell.parameters() ("dense_relu_sequential.0.weight"). A cell's tensors that are not trained
// (BatchNorm's moving mean and variance, once duet has such layers) are saved and loaded with
// them as soon as checkpoints hold them, because both formats take their tensors from the same
// place (duet::detail::parameter_targets).
//
// Element types: a cell's tensors are written as their element type says (F32, F64). A file may
// hold F32, F64, I32, I64 and U8 tensors, the element types duet has; a tensor of any other
// dtype (F16, BF16, BOOL, ...) is refused, by a strict load with an error that names it and its
// dtype, by a load that is not strict by listing it in ckpt_not_load.
//
// Reading takes any bytes: nothing is allocated from a size the file states. The file is read
// whole into a buffer of its size on disk (as a checkpoint is), the header's length is checked
// against that, the header is parsed (nested at most as deep as a header goes, no repeated key),
// and every tensor's offsets are checked against the data's size, its shape and dtype, and the
// other tensors' ranges, before anything is copied into the cell. A malformed file is a
// duet::FormatError naming what and where; a file that cannot be read is a duet::IOError; on
// either the cell is left as it was.
//
// Include it on its own: #include <duet/io/safetensors.hpp> (the single-header edition has it
// beside duet.hpp, at single_include/duet/io/safetensors.hpp). It is not part of
// <duet/duet.hpp> because of what it parses: nlohmann/json (header-only; Debian's
// nlohmann-json3-dev, still one of duet's required dependencies) cost every program that
// includes duet.hpp 2.6 s of a do-nothing program's 10.5 s (g++ 12 -O2; 7.9 s without it),
// and only programs that exchange weights with PyTorch use it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>


namespace duet::io {

// Whose names a file's tensors carry. duet's layers use MindSpore's, which checkpoints keep:
// a BatchNorm's gamma, beta, moving_mean and moving_variance, a LayerNorm's and a GroupNorm's
// gamma and beta, an Embedding's embedding_table. PyTorch's state_dict() calls them weight,
// bias, running_mean, running_var and weight, and a BatchNorm also keeps the I64 count
// num_batches_tracked. Everything else is named alike.
enum class TensorNames { duet, pytorch };

struct SafetensorsLoadOptions {
  // As CheckpointLoadOptions::strict: every tensor of the cell, and nothing else, with its type and shape.
  bool strict = true;
  TensorNames names = TensorNames::duet;
  // The file's names for some of the cell's tensors, as load_onnx_weights's name_map (the cell's
  // name -> the file's: {{"head.weight", "classifier.weight"}}), before `names`; an entry for no
  // tensor of the cell is a ValueError.
  std::map<std::string, std::string> name_map = {};
};

struct SafetensorsSaveOptions {
  TensorNames names = TensorNames::duet;
};

namespace detail {

// A cell's tensor's name in PyTorch's state_dict: its last part renamed where the two differ.
inline std::string pytorch_name(std::string_view name) {
  static constexpr std::pair<std::string_view, std::string_view> renamed[] = {
      {"gamma", "weight"},
      {"beta", "bias"},
      {"moving_mean", "running_mean"},
      {"moving_variance", "running_var"},
      {"embedding_table", "weight"}};
  const std::size_t dot = name.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
  for (const auto& [from, to] : renamed) {
    if (last == from) return std::string(name.substr(0, name.size() - last.size())) + std::string(to);
  }
  return std::string(name);
}

// The BatchNorms' step counts PyTorch keeps beside their running statistics: one per tensor
// named "<layer>.moving_mean".
template <ElementType T>
std::vector<std::string> batchnorm_counts(const std::vector<duet::detail::CheckpointTarget<T>>& targets) {
  constexpr std::string_view mean = "moving_mean";
  std::vector<std::string> counts;
  for (const auto& target : targets) {
    const std::string_view name = target.name;
    if (name == mean || (name.ends_with(mean) && name[name.size() - mean.size() - 1] == '.')) {
      counts.push_back(std::string(name.substr(0, name.size() - mean.size())) + "num_batches_tracked");
    }
  }
  return counts;
}

// The names each of the cell's tensors has in PyTorch's state_dict: its layer's own
// (pytorch_parameter_names), or its name with the last part renamed.
template <ElementType T>
std::vector<std::string> pytorch_names(nn::BasicDynamicCell<T>& cell,
                                       const std::vector<duet::detail::CheckpointTarget<T>>& targets) {
  std::map<std::string, std::string> own;
  for (const auto& [path, layer] : cell.cells_and_names()) {
    const std::string prefix = path.empty() ? path : path + ".";
    for (const auto& [name, pytorch] : layer->pytorch_parameter_names()) {
      own.emplace(prefix + std::string(name), prefix + std::string(pytorch));
    }
  }
  std::vector<std::string> out;
  for (const auto& target : targets) {
    const auto found = own.find(target.name);
    out.push_back(found == own.end() ? pytorch_name(target.name) : found->second);
  }
  return out;
}

// The targets under the file's names: name_map's, else those `names` gives them; two that would
// share one, or a name_map entry for no target, are a ValueError.
template <ElementType T>
std::vector<duet::detail::CheckpointTarget<T>> named_targets(nn::BasicDynamicCell<T>& cell,
                                                             std::vector<duet::detail::CheckpointTarget<T>> targets,
                                                             TensorNames names,
                                                             const std::map<std::string, std::string>& name_map,
                                                             const std::string& where) {
  for (const auto& [name, file_name] : name_map) {
    if (std::ranges::find(targets, name, &duet::detail::CheckpointTarget<T>::name) == targets.end()) {
      throw ValueError(where + ": the name map gives '" + file_name + "' for '" + name +
                       "', which is not a tensor of " + cell.type_name());
    }
  }
  if (names == TensorNames::duet && name_map.empty()) return targets;
  const std::vector<std::string> pytorch =
      names == TensorNames::pytorch ? pytorch_names(cell, targets) : std::vector<std::string>{};
  std::unordered_set<std::string> seen;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    auto& target = targets[i];
    const auto mapped = name_map.find(target.name);
    std::string renamed = mapped != name_map.end()        ? mapped->second
                          : names == TensorNames::pytorch ? pytorch[i]
                                                          : target.name;
    if (!seen.insert(renamed).second) {
      throw ValueError(where + ": two of the cell's tensors are named '" + renamed + "' in " +
                       (name_map.empty() ? "PyTorch's names" : "the file") + " (one of them is '" + target.name + "')");
    }
    target.name = std::move(renamed);
  }
  return targets;
}

// The reference implementation's limit; a longer header is taken as corrupt.
inline constexpr std::uint64_t max_safetensors_header_bytes = 100'000'000;

// The header's length before it, and the alignment of the data that save_safetensors keeps by
// padding the header with spaces (as the reference writer does), so that a reader may map the
// file and use the elements in place.
inline constexpr std::size_t safetensors_length_bytes = 8;
inline constexpr std::size_t safetensors_alignment = 8;

// Every dtype of the format, with its size, and the duet type of those duet reads.
struct SafetensorsDType {
  std::string_view name;
  std::size_t size;
  std::optional<DType> dtype;
};

inline constexpr std::array<SafetensorsDType, 15> safetensors_dtypes{{
    {"F32", 4, DType::float32},
    {"F64", 8, DType::float64},
    {"I32", 4, DType::int32},
    {"I64", 8, DType::int64},
    {"U8", 1, DType::uint8},
    {"BOOL", 1, std::nullopt},
    {"I8", 1, std::nullopt},
    {"I16", 2, std::nullopt},
    {"U16", 2, std::nullopt},
    {"U32", 4, std::nullopt},
    {"U64", 8, std::nullopt},
    {"F16", 2, std::nullopt},
    {"BF16", 2, std::nullopt},
    {"F8_E4M3", 1, std::nullopt},
    {"F8_E5M2", 1, std::nullopt},
}};

inline constexpr std::string_view safetensors_readable = "F32, F64, I32, I64 and U8";

inline const SafetensorsDType* find_safetensors_dtype(std::string_view name) {
  const auto found = std::ranges::find(safetensors_dtypes, name, &SafetensorsDType::name);
  return found == safetensors_dtypes.end() ? nullptr : &*found;
}

inline std::string_view safetensors_name_of(DType t) {
  return std::ranges::find(safetensors_dtypes, std::optional(t), &SafetensorsDType::dtype)->name;
}

inline std::string safetensors_where(const std::filesystem::path& path) {
  return std::string("safetensors file '").append(path.string()).append("'");
}
inline const std::string safetensors_data_where = "safetensors data";

// A file's tensor that a load cannot fill a duet tensor from, and why.
struct RefusedTensor {
  std::string_view name;
  std::string dtype;
  std::string reason;
};

// A safetensors file's tensors, which point into its bytes (records) and its parsed header
// (names): the header is kept here for them.
struct ParsedSafetensors {
  nlohmann::json header;
  std::vector<duet::detail::CheckpointRecord> tensors;
  std::vector<RefusedTensor> refused;
};

// Text from the file (a JSON value, a parser's message quoting it), cut for a message.
inline std::string shown_text(std::string_view text) {
  constexpr std::size_t most = 200;
  return std::string(text.substr(0, most)).append(text.size() > most ? "..." : "");
}

// Parses the header, refusing nesting deeper than {"name": {"shape": [...]}} and a key that an
// object repeats (JSON's parsers keep either silently; the format forbids both).
inline nlohmann::json parse_safetensors_header(std::string_view text, const std::string& where) {
  constexpr int deepest = 3;
  std::vector<std::unordered_set<std::string>> keys;
  const auto check = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if ((event == Event::object_start || event == Event::array_start) && depth >= deepest) {
      throw FormatError(where + ": malformed header: values nested deeper than a safetensors header's " +
                        std::to_string(deepest) + " levels");
    }
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end) keys.pop_back();
    if (event == Event::key && !keys.back().insert(parsed.get<std::string>()).second) {
      throw FormatError(where + ": malformed header: the key " + duet::detail::shown_name(parsed.get<std::string>()) +
                        " appears twice in one object");
    }
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), check);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(where + ": malformed header: " + shown_text(e.what()));
  }
}

// A tensor's description in the header: dtype, shape and offsets, each checked.
class SafetensorsEntry {
 public:
  SafetensorsEntry(const std::string& name, const nlohmann::json& info, const std::string& where)
      : who_(where + ": malformed header: tensor " + duet::detail::shown_name(name)) {
    if (!info.is_object()) fail(" is ", shown_text(info.dump()), ", not an object of dtype, shape and data_offsets");
    const nlohmann::json& dtype = field(info, "dtype");
    if (!dtype.is_string()) fail("'s dtype is ", shown_text(dtype.dump()), ", not a string");
    dtype_name = dtype.get<std::string>();
    const nlohmann::json& shape = field(info, "shape");
    if (!shape.is_array()) fail("'s shape is ", shown_text(shape.dump()), ", not an array");
    for (const auto& d : shape) dims.push_back(count(d, "shape"));
    const nlohmann::json& offsets = field(info, "data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) {
      fail("'s data_offsets are ", shown_text(offsets.dump()), ", not an array [begin, end]");
    }
    begin = count(offsets[0], "data_offsets");
    end = count(offsets[1], "data_offsets");
    if (begin > end) fail("'s data_offsets [", range(), "] end before they begin");
  }

  // Built by appending: GCC 12 at -O3 warns falsely (-Wstringop-overflow) on "literal" + a
  // temporary std::string.
  template <class... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    std::string message = who_;
    (message.append(parts), ...);
    throw FormatError(message);
  }
  std::string range() const { return std::to_string(begin) + ", " + std::to_string(end); }
  std::string shape_text() const {
    std::string out = "[";
    for (std::size_t i = 0; i < dims.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(dims[i]);
    return out + "]";
  }

  std::string dtype_name;
  std::vector<std::uint64_t> dims;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;

 private:
  const nlohmann::json& field(const nlohmann::json& info, const char* key) const {
    const auto found = info.find(key);
    if (found == info.end()) fail(" has no ", key);
    return *found;
  }

  // A size or offset: a non-negative integer that an index_t holds.
  std::uint64_t count(const nlohmann::json& v, const char* what) const {
    if (!v.is_number_unsigned() || v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<index_t>::max())) {
      fail("'s ", what, " includes ", shown_text(v.dump()), ", not an integer from 0 to 2^63 - 1");
    }
    return v.get<std::uint64_t>();
  }

  std::string who_;
};

// A file's byte range and the tensor it belongs to, for the check that the ranges tile the data.
struct SafetensorsRange {
  std::uint64_t begin;
  std::uint64_t end;
  std::string_view name;
};

inline void check_tiling(std::vector<SafetensorsRange> ranges, std::uint64_t data_size, const std::string& where) {
  std::ranges::sort(ranges, [](const auto& a, const auto& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  std::uint64_t covered = 0;
  std::string_view last;
  for (const auto& r : ranges) {
    const std::string who = std::string("tensor ").append(duet::detail::shown_name(r.name));
    const std::string span =
        std::string("[").append(std::to_string(r.begin)).append(", ").append(std::to_string(r.end)).append(")");
    if (r.begin < covered) {
      throw FormatError(where + ": malformed header: " + who + "'s bytes " + span + " overlap those of tensor " +
                        duet::detail::shown_name(last) + ", which end at " + std::to_string(covered));
    }
    if (r.begin > covered) {
      throw FormatError(where + ": malformed header: the data's bytes [" + std::to_string(covered) + ", " +
                        std::to_string(r.begin) + ") belong to no tensor (" + who + " starts at " +
                        std::to_string(r.begin) + ")");
    }
    covered = r.end;
    last = r.name;
  }
  if (covered != data_size) {
    throw FormatError(where + ": malformed header: the data's bytes [" + std::to_string(covered) + ", " +
                      std::to_string(data_size) + ") at the end of the file belong to no tensor");
  }
}

// A safetensors file, checked for everything but whether it fits a cell.
inline ParsedSafetensors parse_safetensors(std::span<const unsigned char> bytes, const std::string& where) {
  const std::size_t n = bytes.size();
  if (n < safetensors_length_bytes) {
    throw FormatError(where + ": truncated: " + std::to_string(n) + " bytes, fewer than the " +
                      std::to_string(safetensors_length_bytes) + " of the header's length");
  }
  std::uint64_t header_size = 0;
  for (std::size_t i = 0; i < safetensors_length_bytes; ++i) header_size |= std::uint64_t{bytes[i]} << (8 * i);
  const std::uint64_t after = n - safetensors_length_bytes;
  if (header_size > after) {
    throw FormatError(where + ": truncated or not a safetensors file: its header's length is " +
                      std::to_string(header_size) + " bytes, but " + std::to_string(after) + " follow it");
  }
  if (header_size > max_safetensors_header_bytes) {
    throw FormatError(where + ": malformed: its header's length is " + std::to_string(header_size) +
                      " bytes, more than safetensors allows (" + std::to_string(max_safetensors_header_bytes) + ")");
  }
  const auto header = bytes.subspan(safetensors_length_bytes, static_cast<std::size_t>(header_size));
  if (header.empty() || header[0] != '{') {
    throw FormatError(where + ": not a safetensors file: its header does not start with '{'");
  }
  ParsedSafetensors file;
  file.header =
      parse_safetensors_header({reinterpret_cast<const char*>(header.data()), header.size()}, where);
  const std::size_t data_start = safetensors_length_bytes + header.size();
  const std::uint64_t data_size = n - data_start;
  std::vector<SafetensorsRange> ranges;
  // Names are views of the header's keys, which live as long as the header.
  for (auto it = file.header.cbegin(); it != file.header.cend(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& info = it.value();
    if (name == "__metadata__") {
      const bool strings = info.is_object() && std::ranges::all_of(info, [](const auto& v) { return v.is_string(); });
      if (!strings) {
        throw FormatError(where + ": malformed header: __metadata__ is " + shown_text(info.dump()) +
                          ", not an object of strings");
      }
      continue;
    }
    const SafetensorsEntry entry(name, info, where);
    if (entry.end > data_size) {
      entry.fail("'s data_offsets [", entry.range(), "] run past the data's end at ", std::to_string(data_size),
                 " (a truncated file?)");
    }
    const std::uint64_t bytes_held = entry.end - entry.begin;
    ranges.push_back({entry.begin, entry.end, name});
    const SafetensorsDType* type = find_safetensors_dtype(entry.dtype_name);
    if (type == nullptr) {
      file.refused.push_back({name, entry.dtype_name, "a dtype safetensors does not define"});
      continue;
    }
    // Saturates past what 64 bits count, so no product overflows and a zero dimension still gives 0.
    const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() / type->size;
    std::uint64_t numel = 1;
    for (const std::uint64_t d : entry.dims) numel = (d == 0 || numel <= limit / d) ? numel * d : limit + 1;
    if (numel > limit || numel * type->size != bytes_held) {
      entry.fail(" of dtype ", entry.dtype_name, " and shape ", entry.shape_text(), " needs ",
                 numel > limit ? "2^64 bytes or more" : std::to_string(numel * type->size) + " bytes",
                 ", but its data_offsets [", entry.range(), "] hold ", std::to_string(bytes_held));
    }
    if (!type->dtype) {
      file.refused.push_back({name, entry.dtype_name, "which duet does not read"});
    } else if (entry.dims.size() > static_cast<std::size_t>(max_rank)) {
      file.refused.push_back({name, entry.dtype_name,
                              "of rank " + std::to_string(entry.dims.size()) + ", more than duet's " +
                                  std::to_string(max_rank)});
    } else {
      Shape shape;
      for (const std::uint64_t d : entry.dims) shape.push_back(static_cast<index_t>(d));
      file.tensors.push_back({name, *type->dtype, shape, data_start + static_cast<std::size_t>(entry.begin),
                              static_cast<std::size_t>(bytes_held)});
    }
  }
  check_tiling(std::move(ranges), data_size, where);
  return file;
}

// What the names only the file has and only the cell has suggest: a file in PyTorch's names
// loaded in duet's, a convolution's bias the cell's layer does not have.
// `pytorch` holds the PyTorch name of each of targets (pytorch_names).
template <ElementType T>
std::string name_hint(const std::vector<std::string_view>& unknown, const std::vector<std::string_view>& missing,
                      const std::vector<duet::detail::CheckpointTarget<T>>& targets,
                      const std::vector<std::string>& pytorch, TensorNames names) {
  std::string hint;
  const auto last_is = [](std::string_view name, std::string_view last) {
    return name == last || (name.ends_with(last) && name[name.size() - last.size() - 1] == '.');
  };
  const bool pytorch_file =
      std::ranges::any_of(unknown,
                          [&](std::string_view n) {
                            return last_is(n, "running_mean") || last_is(n, "running_var") ||
                                   last_is(n, "num_batches_tracked");
                          }) ||
      std::ranges::any_of(missing, [&](std::string_view n) {
        const auto at = std::ranges::find(targets, n, &duet::detail::CheckpointTarget<T>::name) - targets.begin();
        if (static_cast<std::size_t>(at) >= pytorch.size()) return false;
        const std::string& renamed = pytorch[static_cast<std::size_t>(at)];
        return renamed != n && std::ranges::find(unknown, renamed) != unknown.end();
      });
  if (names == TensorNames::duet && pytorch_file) {
    hint +=
        "; the file names normalisation layers', embeddings' and attention's tensors as PyTorch does (weight, "
        "bias, running_mean, running_var, in_proj_weight): load it with {.names = duet::io::TensorNames::pytorch}";
  } else if (!unknown.empty() && !missing.empty()) {
    hint += "; if the file's tensors are the cell's under other names, give them in {.name_map = {{\"" +
            std::string(missing.front()) + "\", \"<the file's name>\"}}}";
  }
  const auto has = [&](const std::string& name) {
    return std::ranges::find(targets, name, &duet::detail::CheckpointTarget<T>::name) != targets.end();
  };
  for (const std::string_view n : unknown) {
    if (!last_is(n, "bias")) continue;
    const std::string layer(n.substr(0, n.size() - std::string_view("bias").size()));
    if (has(layer + "weight") && !has(layer + "bias")) {
      hint += "; the cell's '" + (layer.empty() ? layer : layer.substr(0, layer.size() - 1)) +
              "' has no bias: duet's convolutions have none unless has_bias is set (PyTorch's have one unless "
              "bias=False)";
      break;
    }
  }
  return hint;
}

// Checks the whole file, then copies what matches into the cell's tensors (named as in the cell).
template <ElementType T>
CheckpointLoad load_safetensors_into(std::span<const unsigned char> bytes, nn::BasicDynamicCell<T>& cell,
                                     const SafetensorsLoadOptions& options, const std::string& where) {
  const auto cell_targets = duet::detail::parameter_targets(cell, where);
  const ParsedSafetensors file = parse_safetensors(bytes, where);
  const auto targets = named_targets(cell, cell_targets, options.names, options.name_map, where);
  std::vector<duet::detail::CheckpointRecord> records = file.tensors;
  if (options.names == TensorNames::pytorch) {
    // PyTorch's BatchNorm step counts have no place in duet's layers (their momentum is fixed).
    const std::vector<std::string> counts = batchnorm_counts(cell_targets);
    std::erase_if(records, [&](const auto& r) { return std::ranges::find(counts, r.name) != counts.end(); });
  }
  if (options.strict && !file.refused.empty()) {
    const RefusedTensor& r = file.refused.front();
    const auto target = std::ranges::find(targets, r.name, &duet::detail::CheckpointTarget<T>::name);
    throw FormatError(where + ": tensor " + duet::detail::shown_name(r.name) + " has dtype " +
                      duet::detail::shown_name(r.dtype) + ", " + r.reason + " (duet reads " +
                      std::string(safetensors_readable) + ")" +
                      (target == targets.end() ? std::string()
                                               : "; the cell's parameter is " +
                                                     std::string(name_of(target->tensor->dtype())) + " " +
                                                     to_string(target->tensor->shape())));
  }
  // The header is a JSON object, which writers order by name: matched in the cell's order, the
  // first difference is the one a checkpoint would name (helper-93: bn1.beta before conv1.weight).
  const auto place = [&](const duet::detail::CheckpointRecord& r) {
    return static_cast<std::size_t>(std::ranges::find(targets, r.name, &duet::detail::CheckpointTarget<T>::name) -
                                    targets.begin());
  };
  std::ranges::stable_sort(records, {}, place);
  duet::detail::MatchWords words = duet::detail::parameter_words;
  words.hint = [&](const auto& unknown, const auto& missing) {
    return name_hint(unknown, missing, targets, pytorch_names(cell, cell_targets), options.names);
  };
  CheckpointLoad unmatched;
  const auto source = duet::detail::match_records(records, targets, words, where, options.strict ? nullptr : &unmatched);
  for (const RefusedTensor& r : file.refused) unmatched.ckpt_not_load.emplace_back(r.name);
  duet::detail::copy_records(bytes, targets, source);
  return unmatched;
}

}  // namespace detail

// Writes every parameter of cell (and the cells below it) to path as a safetensors file,
// atomically (on any failure path keeps its previous contents), with the metadata
// {"format": "pt"}: duet's layers keep their tensors in PyTorch's layout (nn::Dense's weight is
// [out, in], as torch.nn.Linear's), which is what the "pt" format declares to Hugging Face's
// loaders. With {.names = TensorNames::pytorch} the tensors carry PyTorch's names, and each
// BatchNorm also gets the num_batches_tracked PyTorch's load_state_dict asks for (0: duet
// does not count). A cell without parameters is a ValueError.
template <ElementType T>
void save_safetensors(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path,
                      SafetensorsSaveOptions options = {}) {
  const std::string where = detail::safetensors_where(path);
  const auto cell_targets = duet::detail::parameter_targets(cell, where);
  const auto targets = detail::named_targets(cell, cell_targets, options.names, {}, where);
  const std::vector<std::string> counts =
      options.names == TensorNames::pytorch ? detail::batchnorm_counts(cell_targets) : std::vector<std::string>{};
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"}};
  std::uint64_t offset = 0;
  const auto add = [&](const std::string& name, DType dtype, const Shape& shape, std::uint64_t size) {
    if (name == "__metadata__") {
      throw ValueError(where + ": " + cell.type_name() + " has a parameter named __metadata__, which the format reserves");
    }
    header[name] = {{"dtype", detail::safetensors_name_of(dtype)},
                    {"shape", std::vector<index_t>(shape.begin(), shape.end())},
                    {"data_offsets", {offset, offset + size}}};
    offset += size;
  };
  for (const auto& [name, t] : targets) add(name, t->dtype(), t->shape(), std::uint64_t(t->numel()) * sizeof(T));
  for (const std::string& name : counts) add(name, DType::int64, Shape{}, sizeof(std::int64_t));
  std::string text = header.dump();
  text.append((detail::safetensors_alignment - text.size() % detail::safetensors_alignment) %
                  detail::safetensors_alignment,
              ' ');
  duet::detail::CheckpointWriter out(path, where);
  out.u64(text.size());
  out.bytes(std::as_bytes(std::span(text)));
  for (const auto& [name, t] : targets) {
    out.bytes(std::as_bytes(std::span<const T>(t->data(), static_cast<std::size_t>(t->numel()))));
  }
  const std::int64_t zero = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) out.bytes(std::as_bytes(std::span(&zero, 1)));
  out.commit();
}

// Reads a safetensors file into cell's parameters, by name. Strict (the default): the file must
// hold exactly the cell's parameters, with their element types and shapes; the first difference
// is a duet::FormatError naming the parameter and both shapes or types, or the names only the
// file or only the cell has. Not strict ({.strict = false}): loads the tensors that match and
// returns the names of the others: the cell's that kept their values (param_not_load) and the
// file's that were not used (ckpt_not_load; among them any tensor of a dtype duet does not
// read). {.names = TensorNames::pytorch} reads PyTorch's names (and leaves its BatchNorms'
// num_batches_tracked aside); {.name_map = ...} gives the file's name for some tensors. The whole file is checked
// before anything is copied: on any error the cell is left as it was.
template <ElementType T>
CheckpointLoad load_safetensors(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell,
                                SafetensorsLoadOptions options = {}) {
  const std::string where = detail::safetensors_where(path);
  return detail::load_safetensors_into(std::span<const unsigned char>(duet::detail::read_whole_file(path, where)), cell,
                                       options, where);
}

// The same for the bytes of a safetensors file already in memory.
template <ElementType T>
CheckpointLoad load_safetensors_bytes(std::span<const std::byte> bytes, nn::BasicDynamicCell<T>& cell,
                                      SafetensorsLoadOptions options = {}) {
  const auto& where = detail::safetensors_data_where;
  return detail::load_safetensors_into(duet::detail::unsigned_bytes(bytes), cell, options, where);
}

}  // namespace duet::io
