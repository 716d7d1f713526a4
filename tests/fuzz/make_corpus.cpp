// Writes the fuzzers' seed corpora: small valid IDX files, checkpoints and safetensors files of
// duet_fuzz::Network, and a few broken ones, each a different way into the readers. The
// output is committed; rerun after a format changes:
//   cmake --build <fuzz build> --target fuzz_make_corpus && <fuzz build>/tests/fuzz/fuzz_make_corpus tests/fuzz/corpus
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <duet/io/safetensors.hpp>

#include "network.hpp"

namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<unsigned char>;

void write(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

Bytes read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

Bytes concat(Bytes a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Bytes gzip(const Bytes& in) {
  z_stream z{};
  if (deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    throw std::runtime_error("deflateInit2 failed");
  }
  Bytes out(deflateBound(&z, static_cast<uLong>(in.size())) + 32);
  z.next_in = const_cast<Bytef*>(in.data());
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  deflateEnd(&z);
  if (rc != Z_STREAM_END) throw std::runtime_error("deflate failed");
  out.resize(z.total_out);
  return out;
}

// ---- IDX ------------------------------------------------------------------------------------

template <class T>
void append_big_endian(Bytes& out, T value) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &value, sizeof(T));
  if constexpr (std::endian::native == std::endian::little) std::reverse(b, b + sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}

Bytes idx_header(unsigned char type, const std::vector<std::uint32_t>& dims) {
  Bytes out{0, 0, type, static_cast<unsigned char>(dims.size())};
  for (std::uint32_t d : dims) append_big_endian(out, d);
  return out;
}

// An IDX file of the given dimensions, element i being f(i).
template <class T, class F>
Bytes idx(unsigned char type, const std::vector<std::uint32_t>& dims, F f) {
  Bytes out = idx_header(type, dims);
  std::uint64_t n = 1;
  for (std::uint32_t d : dims) n *= d;
  for (std::uint64_t i = 0; i < n; ++i) append_big_endian(out, static_cast<T>(f(i)));
  return out;
}

void write_idx_corpus(const fs::path& dir) {
  const auto pattern = [](std::uint64_t i) { return (i * 37 + 11) % 256; };
  const Bytes u8 = idx<std::uint8_t>(0x08, {2, 3, 4}, pattern);
  write(dir / "u8_5", idx<std::uint8_t>(0x08, {5}, pattern));
  write(dir / "u8_2x3x4", u8);
  write(dir / "u8_2x3x4.gz", gzip(u8));
  const Bytes half(u8.begin(), u8.begin() + static_cast<std::ptrdiff_t>(u8.size() / 2));
  const Bytes rest(u8.begin() + static_cast<std::ptrdiff_t>(u8.size() / 2), u8.end());
  write(dir / "u8_2x3x4_two_members.gz", concat(gzip(half), gzip(rest)));
  write(dir / "u8_rank8", idx<std::uint8_t>(0x08, {1, 2, 1, 2, 1, 2, 1, 2}, pattern));
  write(dir / "u8_0x3", idx<std::uint8_t>(0x08, {0, 3}, pattern));
  write(dir / "i32_3", idx<std::int32_t>(0x0C, {3}, [](std::uint64_t i) { return -1000000 + 999999 * int(i); }));
  const Bytes f32 = idx<float>(0x0D, {2, 2}, [](std::uint64_t i) { return 0.5f - float(i); });
  write(dir / "f32_2x2", f32);
  write(dir / "f32_2x2.gz", gzip(f32));
  write(dir / "f64_2", idx<double>(0x0E, {2}, [](std::uint64_t i) { return 1e-300 * double(i + 1); }));

  write(dir / "broken_truncated_data", Bytes(u8.begin(), u8.end() - 5));
  const Bytes gz = gzip(u8);
  write(dir / "broken_truncated.gz", Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
  write(dir / "broken_trailing_byte", concat(idx<std::uint8_t>(0x08, {5}, pattern), Bytes{0}));
  write(dir / "broken_int8_type", idx<std::uint8_t>(0x09, {4}, pattern));
  write(dir / "broken_claims_4GiB", concat(idx_header(0x08, {65536, 65536}), Bytes{1, 2, 3}));
}

// ---- Checkpoints ----------------------------------------------------------------------------

struct Record {
  std::string name;
  duet::DType dtype;
  duet::Shape shape;
  Bytes elements;
};

template <class Cell>
std::vector<Record> records_of(Cell& cell) {
  std::vector<Record> out;
  for (const auto& [name, p] : cell.parameters()) {
    const auto* b = reinterpret_cast<const unsigned char*>(p->data());
    out.push_back({name, p->dtype(), p->shape(), Bytes(b, b + p->numel() * sizeof(float))});
  }
  return out;
}

// The optimiser's state as save_checkpoint(net, path, optimizer) names it.
template <class Cell, class Optimizer>
std::vector<Record> state_records_of(Cell& cell, Optimizer& optimizer) {
  const auto parameters = cell.parameters();
  std::vector<Record> out;
  for (const auto& slot : optimizer.state()) {
    for (std::size_t i = 0; i < slot.tensors->size(); ++i) {
      const auto& t = (*slot.tensors)[i];
      const auto* b = reinterpret_cast<const unsigned char*>(t.data());
      out.push_back({std::string(slot.name) + "." + parameters[i].name, t.dtype(), t.shape(),
                     Bytes(b, b + t.numel() * sizeof(float))});
    }
  }
  return out;
}

template <class T>
void append_little_endian(Bytes& out, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<unsigned char>(value >> (8 * i)));
}

void append_records(Bytes& out, const std::vector<Record>& records) {
  append_little_endian(out, static_cast<std::uint32_t>(records.size()));
  for (const Record& r : records) {
    append_little_endian(out, static_cast<std::uint32_t>(r.name.size()));
    out.insert(out.end(), r.name.begin(), r.name.end());
    out.push_back(static_cast<unsigned char>(r.dtype));
    out.push_back(static_cast<unsigned char>(r.shape.rank()));
    for (duet::index_t d : r.shape) append_little_endian(out, static_cast<std::uint64_t>(d));
    out.insert(out.end(), r.elements.begin(), r.elements.end());
  }
}

// A version 2 or 3 file's optimiser section; an empty type writes none. Version 3 adds the
// generators.
struct OptimizerSection {
  std::string type;
  std::int64_t step = 0;
  std::vector<Record> state;
  std::vector<std::pair<std::string, duet::GeneratorState>> generators = {};
};

// The format of include/duet/io/checkpoint.hpp, written independently of save_checkpoint (which
// it is checked against) so that it can also write files save_checkpoint never would. Version
// 1 has no optimiser section, version 2 no generators.
Bytes checkpoint(const std::vector<Record>& records, std::uint32_t version, const OptimizerSection& optimizer = {}) {
  Bytes out{'D', 'U', 'E', 'T', 'C', 'K', 'P', 'T'};
  append_little_endian(out, version);
  append_records(out, records);
  if (version >= 2) {
    append_little_endian(out, static_cast<std::uint32_t>(optimizer.type.size()));
    out.insert(out.end(), optimizer.type.begin(), optimizer.type.end());
    if (!optimizer.type.empty()) {
      append_little_endian(out, static_cast<std::uint64_t>(optimizer.step));
      append_records(out, optimizer.state);
      if (version >= 3) {
        append_little_endian(out, static_cast<std::uint32_t>(optimizer.generators.size()));
        for (const auto& [name, state] : optimizer.generators) {
          append_little_endian(out, static_cast<std::uint32_t>(name.size()));
          out.insert(out.end(), name.begin(), name.end());
          for (std::uint64_t word : state.words) append_little_endian(out, word);
          out.push_back(state.has_spare ? 1 : 0);
          append_little_endian(out, std::bit_cast<std::uint64_t>(state.spare));
        }
      }
    }
  }
  append_little_endian(out, static_cast<std::uint32_t>(crc32_z(crc32_z(0, nullptr, 0), out.data(), out.size())));
  return out;
}

// Steps the optimiser on made-up gradients, so that its state is not all zeros.
template <class Cell, class Optimizer>
void take_steps(Cell& cell, Optimizer& optimizer, int steps) {
  for (int s = 0; s < steps; ++s) {
    std::vector<duet::Tensor> grads;
    for (const auto& [name, p] : cell.parameters()) grads.push_back(duet::randn(p->shape(), 100 + s));
    optimizer(grads);
  }
}

// Version 1 files (parameters only), as duet wrote them before optimiser state.
void write_version_1_corpus(const fs::path& dir) {
  duet::set_seed(1);
  duet_fuzz::Network net;
  const std::vector<Record> records = records_of(net);
  write(dir / "valid", checkpoint(records, 1));
  duet::set_seed(2);
  duet_fuzz::Network other_values;
  write(dir / "valid_other_values", checkpoint(records_of(other_values), 1));
  write(dir / "valid_reversed", checkpoint(std::vector<Record>(records.rbegin(), records.rend()), 1));

  duet::nn::SequentialCell<duet::nn::Dense<3, 4>, duet::nn::ReLU, duet::nn::Dense<4, 3>> other_shapes;
  write(dir / "broken_other_shapes", checkpoint(records_of(other_shapes), 1));
  const Bytes valid = checkpoint(records, 1);
  write(dir / "broken_truncated", Bytes(valid.begin(), valid.begin() + static_cast<std::ptrdiff_t>(valid.size() / 2)));
  Bytes damaged = valid;
  damaged[valid.size() - 10] ^= 0x40;
  write(dir / "broken_checksum", damaged);
  write(dir / "broken_version", checkpoint(records, 4));
  write(dir / "broken_missing_parameter", checkpoint(std::vector<Record>(records.begin(), records.end() - 1), 1));
  std::vector<Record> twice = records;
  twice.back() = twice.front();
  write(dir / "broken_repeated_parameter", checkpoint(twice, 1));
  std::vector<Record> extra = records;
  extra.push_back({"2.extra", duet::DType::uint8, duet::Shape{1}, Bytes{7}});
  write(dir / "broken_extra_parameter", checkpoint(extra, 1));
}

// Version 2 files, with and without the optimiser state fuzz_checkpoint loads them with.
void write_version_2_corpus(const fs::path& dir) {
  duet::set_seed(1);
  duet_fuzz::Network net;
  write(dir / "v2_valid", checkpoint(records_of(net), 2));

  duet_fuzz::Adam adam(net.parameters());
  take_steps(net, adam, 3);
  const OptimizerSection adam_section{"nn::Adam", adam.global_step(), state_records_of(net, adam)};
  write(dir / "v2_adam", checkpoint(records_of(net), 2, adam_section));
  duet_fuzz::SGD sgd(net.parameters(), duet_fuzz::sgd_config());
  take_steps(net, sgd, 2);
  write(dir / "v2_sgd_momentum", checkpoint(records_of(net), 2, {"nn::SGD", sgd.global_step(), state_records_of(net, sgd)}));
  duet::nn::AdamW adamw(net.parameters());
  take_steps(net, adamw, 1);
  write(dir / "v2_adamw", checkpoint(records_of(net), 2, {"nn::AdamW", adamw.global_step(), state_records_of(net, adamw)}));

  OptimizerSection missing = adam_section;
  missing.state.pop_back();
  write(dir / "v2_broken_missing_state", checkpoint(records_of(net), 2, missing));
  OptimizerSection negative = adam_section;
  negative.step = -1;
  write(dir / "v2_broken_negative_step", checkpoint(records_of(net), 2, negative));
}

// Version 3 files, as save_checkpoint writes them (checked against checkpoint()): with Adam's
// state and the Dropout's generator, and broken generators.
void write_version_3_corpus(const fs::path& dir) {
  duet::set_seed(1);
  duet_fuzz::Network net;
  duet::save_checkpoint(net, dir / "v3_valid");
  if (checkpoint(records_of(net), 3) != read(dir / "v3_valid")) {
    throw std::runtime_error("checkpoint() differs from save_checkpoint");
  }
  duet_fuzz::Adam adam(net.parameters());
  take_steps(net, adam, 3);
  auto& dropout = net.get<3>();
  for (int i = 0; i < 5; ++i) dropout.generator().next();
  duet::save_checkpoint(net, dir / "v3_adam", adam);
  const OptimizerSection adam_section{
      "nn::Adam", adam.global_step(), state_records_of(net, adam), {{"generator.3", dropout.generator().state()}}};
  if (checkpoint(records_of(net), 3, adam_section) != read(dir / "v3_adam")) {
    throw std::runtime_error("checkpoint() with optimizer state differs from save_checkpoint");
  }
  duet_fuzz::SGD sgd(net.parameters(), duet_fuzz::sgd_config());
  take_steps(net, sgd, 2);
  duet::save_checkpoint(net, dir / "v3_sgd_momentum", sgd);

  OptimizerSection zero = adam_section;
  zero.generators[0].second = duet::GeneratorState{};
  write(dir / "v3_broken_zero_generator", checkpoint(records_of(net), 3, zero));
  OptimizerSection other_name = adam_section;
  other_name.generators[0].first = "generator.2";
  write(dir / "v3_broken_generator_name", checkpoint(records_of(net), 3, other_name));
  OptimizerSection none = adam_section;
  none.generators.clear();
  write(dir / "v3_broken_missing_generator", checkpoint(records_of(net), 3, none));
}

// ---- safetensors --------------------------------------------------------------------------

struct Entry {
  std::string name;
  std::string dtype;
  std::vector<duet::index_t> shape;
  Bytes elements;
};

// The format of include/duet/io/safetensors.hpp, written independently of save_safetensors (which
// it is checked against): the tensors' data in the order given, their header entries in
// `header_order` (default: the same), the header padded with `padding` spaces.
Bytes safetensors(const std::vector<Entry>& tensors, const std::string& metadata, std::size_t padding,
                  std::vector<std::size_t> header_order = {}) {
  if (header_order.empty()) {
    for (std::size_t i = 0; i < tensors.size(); ++i) header_order.push_back(i);
  }
  std::vector<std::size_t> begin;
  std::size_t offset = 0;
  for (const Entry& t : tensors) {
    begin.push_back(offset);
    offset += t.elements.size();
  }
  std::string header = "{" + metadata;
  for (const std::size_t i : header_order) {
    const Entry& t = tensors[i];
    std::string shape;
    for (const duet::index_t d : t.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
    header += (header.size() == 1 ? "" : ",") + ("\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" +
                                                 shape + "],\"data_offsets\":[" + std::to_string(begin[i]) + "," +
                                                 std::to_string(begin[i] + t.elements.size()) + "]}");
  }
  header += "}" + std::string(padding, ' ');
  Bytes out;
  append_little_endian(out, static_cast<std::uint64_t>(header.size()));
  out.insert(out.end(), header.begin(), header.end());
  for (const Entry& t : tensors) out.insert(out.end(), t.elements.begin(), t.elements.end());
  return out;
}

template <class Cell>
std::vector<Entry> tensors_of(Cell& cell) {
  std::vector<Entry> out;
  for (const Record& r : records_of(cell)) out.push_back({r.name, "F32", {r.shape.begin(), r.shape.end()}, r.elements});
  return out;
}

void write_safetensors_corpus(const fs::path& dir) {
  duet::set_seed(1);
  duet_fuzz::Network net;
  duet::io::save_safetensors(net, dir / "valid");
  const std::vector<Entry> tensors = tensors_of(net);
  const std::string metadata = "\"__metadata__\":{\"format\":\"pt\"}";
  std::size_t data_size = 0;
  for (const Entry& t : tensors) data_size += t.elements.size();
  const std::size_t header_size = safetensors(tensors, metadata, 0).size() - 8 - data_size;
  const std::size_t padding = (8 - header_size % 8) % 8;
  if (safetensors(tensors, metadata, padding) != read(dir / "valid")) {
    throw std::runtime_error("safetensors() differs from save_safetensors");
  }
  write(dir / "valid_reversed_header_unpadded", safetensors(tensors, "", 0, {3, 2, 1, 0}));
  std::vector<Entry> extra = tensors;
  extra.push_back({"bn.num_batches_tracked", "I64", {}, Bytes(8, 0)});
  extra.push_back({"half", "F16", {2}, Bytes{0, 0x3C, 0, 0x40}});
  extra.push_back({"empty", "U8", {0, 3}, {}});
  write(dir / "valid_not_strict_extra", safetensors(extra, metadata, 3));

  const Bytes valid = read(dir / "valid");
  write(dir / "broken_truncated_header", Bytes(valid.begin(), valid.begin() + 40));
  write(dir / "broken_truncated_data", Bytes(valid.begin(), valid.end() - 5));
  Bytes huge = valid;
  huge[7] = 0x7F;
  write(dir / "broken_huge_length", huge);
  std::vector<Entry> reshaped = tensors;
  reshaped[0].shape = {3, 4};
  write(dir / "broken_other_shape", safetensors(reshaped, metadata, 0));
  reshaped[0].shape = {5, 3};
  write(dir / "broken_shape_past_offsets", safetensors(reshaped, metadata, 0));
  std::vector<Entry> doubled = tensors;
  doubled[1].dtype = "F64";
  write(dir / "broken_other_dtype", safetensors(doubled, metadata, 0));
  write(dir / "broken_repeated_tensor", safetensors(tensors, metadata, 0, {0, 1, 2, 3, 0}));
  const std::string text(valid.begin(), valid.end());
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string out = text;
    out.replace(out.find(from), from.size(), to);
    return Bytes(out.begin(), out.end());
  };
  write(dir / "broken_overlap", replaced("[48,64]", "[40,56]"));
  write(dir / "broken_nested", replaced("\"dtype\":\"F32\"", "\"dtype\":[[0]]"));
  write(dir / "broken_metadata", replaced("\"pt\"", "7   "));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_make_corpus <corpus directory, as tests/fuzz/corpus>\n";
    return 2;
  }
  const fs::path root = argv[1];
  for (const char* name : {"idx", "checkpoint", "safetensors"}) {
    fs::remove_all(root / name);
    fs::create_directories(root / name);
  }
  write_idx_corpus(root / "idx");
  write_version_1_corpus(root / "checkpoint");
  write_version_2_corpus(root / "checkpoint");
  write_version_3_corpus(root / "checkpoint");
  write_safetensors_corpus(root / "safetensors");
}
