// The definitions of io/checkpoint.hpp's non-template functions (DUET_DETAIL_COMPILED in
// config.hpp): included at that header's end when header-only, compiled once in duet::kernels
// otherwise.
#pragma once

namespace duet {

DUET_DETAIL_COMPILED CheckpointInfo checkpoint_info(const std::filesystem::path& path) {
  const std::string where = detail::checkpoint_where(path);
  return detail::info_of(detail::read_whole_file(path, where), where);
}

DUET_DETAIL_COMPILED CheckpointInfo checkpoint_info_bytes(std::span<const std::byte> bytes) {
  return detail::info_of(detail::unsigned_bytes(bytes), detail::checkpoint_data_where);
}

}  // namespace duet

namespace duet::detail {

DUET_DETAIL_COMPILED std::string shown_name(std::string_view name) {
  constexpr std::size_t most = 100;
  // Built by appending: GCC 12 warns falsely (-Wrestrict, PR105329) on "'" + std::string.
  return std::string("'").append(name.substr(0, most)).append(name.size() > most ? "...'" : "'");
}

DUET_DETAIL_COMPILED CheckpointWriter::CheckpointWriter(const std::filesystem::path& path, const std::string& where)
    : path_(path), where_(where) {
  if (!path.has_filename()) throw IOError(where_ + ": the path names no file");
  static std::atomic<unsigned long> serial{0};
  temp_ = path.parent_path() / ("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                                std::to_string(serial.fetch_add(1)));
  // "x": never write into a file that happens to have that name.
  file_ = std::fopen(temp_.c_str(), "wbx");
  if (file_ == nullptr) throw IOError(where_ + ": cannot create '" + temp_.string() + "': " + system_message());
}

DUET_DETAIL_COMPILED CheckpointWriter::~CheckpointWriter() {
  if (file_ != nullptr) std::fclose(file_);
  if (!committed_) {
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
  }
}

DUET_DETAIL_COMPILED void CheckpointWriter::bytes(std::span<const std::byte> b) {
  if (b.empty()) return;
  if (std::fwrite(b.data(), 1, b.size(), file_) != b.size()) {
    throw IOError(where_ + ": cannot write '" + temp_.string() + "': " + system_message());
  }
  crc_ = crc32_z(crc_, reinterpret_cast<const Bytef*>(b.data()), b.size());
}

DUET_DETAIL_COMPILED void CheckpointWriter::commit() {
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

DUET_DETAIL_COMPILED std::vector<unsigned char> read_whole_file(const std::filesystem::path& path,
                                                                const std::string& where) {
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

DUET_DETAIL_COMPILED std::span<const unsigned char> CheckpointParser::take(std::size_t n, const std::string& what) {
  if (n > remaining()) {
    if (checksum_ == unverified) throw CheckpointCut{what, pos_, std::uint64_t{pos_} + n};
    throw FormatError(where_ + ": malformed: " + what + " at byte " + std::to_string(pos_) +
                      " runs past the parameters' end at byte " + std::to_string(bytes_.size()));
  }
  const auto out = bytes_.subspan(pos_, n);
  pos_ += n;
  return out;
}

DUET_DETAIL_COMPILED std::string_view CheckpointParser::name(std::size_t n, const std::string& what,
                                                             bool may_be_empty) {
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

DUET_DETAIL_COMPILED std::vector<CheckpointRecord> CheckpointParser::records(
    std::uint32_t count, const std::string& noun, const std::vector<CheckpointRecord>* owners) {
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

DUET_DETAIL_COMPILED std::vector<std::pair<std::string_view, GeneratorState>> CheckpointParser::generators() {
  const auto count = little_endian(4, "the generator count");
  std::vector<std::pair<std::string_view, GeneratorState>> out;
  std::unordered_set<std::string_view> seen;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::string what = "generator #" + std::to_string(i);
    const auto name = this->name(static_cast<std::size_t>(little_endian(4, what + "'s name length")), what + "'s name");
    const std::string who = "generator " + shown_name(name);
    GeneratorState state;
    for (std::size_t w = 0; w < state.words.size(); ++w) {
      state.words[w] = little_endian(8, who + "'s word " + std::to_string(w));
    }
    const auto pending = little_endian(1, who + "'s pending-draw flag");
    state.spare = std::bit_cast<double>(little_endian(8, who + "'s pending draw"));
    std::string wrong;
    if (state.words == decltype(state.words){})
      wrong = "all-zero words, which would draw only zeros";
    else if (pending > 1)
      wrong = "a pending-draw flag of " + std::to_string(pending) + ", not 0 or 1";
    else if (!std::isfinite(state.spare))
      wrong = "a pending draw that is not finite";
    if (!wrong.empty()) throw FormatError(where_ + ": malformed: " + who + " has " + wrong);
    state.has_spare = pending == 1;
    if (!seen.insert(name).second) throw FormatError(where_ + ": " + who + " appears twice in the file");
    out.emplace_back(name, state);
  }
  return out;
}

DUET_DETAIL_COMPILED CheckpointRecord CheckpointParser::record(std::uint32_t index, const std::string& noun,
                                                               const std::vector<CheckpointRecord>* owners) {
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

DUET_DETAIL_COMPILED bool CheckpointParser::owned(const CheckpointRecord& r,
                                                  const std::vector<CheckpointRecord>& owners) {
  const auto dot = r.name.find('.');
  if (dot == std::string_view::npos) return false;
  return std::any_of(owners.begin(), owners.end(), [&](const CheckpointRecord& owner) {
    return owner.name == r.name.substr(dot + 1) && owner.dtype == r.dtype && owner.shape == r.shape;
  });
}

DUET_DETAIL_COMPILED FormatError checkpoint_truncated(std::size_t n, const CheckpointExpectation& expected,
                                                      const std::string& where, const std::string& inside) {
  std::string message = where + ": truncated at byte " + std::to_string(n) + inside;
  if (n < expected.size) {
    message += "; a checkpoint of this cell " +
               (expected.optimizer.empty() ? std::string("without optimizer state")
                                           : "with its " + std::string(expected.optimizer) + " state") +
               " is " + std::to_string(expected.size) + " bytes";
  }
  return FormatError(message);
}

DUET_DETAIL_COMPILED void read_checkpoint_fields(CheckpointParser& in, ParsedCheckpoint& file,
                                                 const std::string& where) {
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

DUET_DETAIL_COMPILED FormatError checksum_failure(std::span<const unsigned char> bytes, std::uint32_t version,
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

DUET_DETAIL_COMPILED ParsedCheckpoint parse_checkpoint(std::span<const unsigned char> bytes,
                                                       const CheckpointExpectation& expected,
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
                      (file.optimizer.empty() ? "parameters"
                       : file.version >= 3    ? "generators"
                                              : "optimizer state"));
  }
  return file;
}

DUET_DETAIL_COMPILED std::vector<CheckpointEntry> entries_of(const std::vector<CheckpointRecord>& records) {
  std::vector<CheckpointEntry> out;
  out.reserve(records.size());
  for (const auto& r : records) out.push_back({std::string(r.name), r.dtype, r.shape});
  return out;
}

DUET_DETAIL_COMPILED CheckpointInfo info_of(std::span<const unsigned char> bytes, const std::string& where) {
  const ParsedCheckpoint file = parse_checkpoint(bytes, {}, where);
  std::vector<std::string> generators;
  for (const auto& g : file.generators) generators.emplace_back(g.first);
  return {file.version,     entries_of(file.parameters),      std::string(file.optimizer),
          file.global_step, entries_of(file.optimizer_state), std::move(generators)};
}

DUET_DETAIL_COMPILED std::string name_list(const std::vector<std::string_view>& names) {
  constexpr std::size_t most = 10;
  std::string out;
  for (std::size_t i = 0; i < std::min(names.size(), most); ++i) out += (i == 0 ? "" : ", ") + shown_name(names[i]);
  if (names.size() > most) out += " and " + std::to_string(names.size() - most) + " more";
  return out;
}

DUET_DETAIL_COMPILED void check_all_matched(const std::vector<std::string_view>& unknown,
                                            const std::vector<std::string_view>& missing, const MatchWords& words,
                                            const std::string& where) {
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

DUET_DETAIL_COMPILED std::vector<const GeneratorState*> match_generators(const ParsedCheckpoint& file,
                                                                         const std::vector<NamedGenerator>& generators,
                                                                         const std::string& where) {
  std::vector<const GeneratorState*> source(generators.size(), nullptr);
  if (file.version < 3) return source;
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < generators.size(); ++i) index.emplace(generators[i].name, i);
  std::vector<std::string_view> unknown;
  for (const auto& [name, state] : file.generators) {
    const auto found = index.find(name);
    if (found == index.end())
      unknown.push_back(name);
    else
      source[found->second] = &state;
  }
  std::vector<std::string_view> missing;
  for (std::size_t i = 0; i < generators.size(); ++i) {
    if (source[i] == nullptr) missing.push_back(generators[i].name);
  }
  check_all_matched(unknown, missing, {"generator", "the cell"}, where);
  return source;
}

}  // namespace duet::detail
