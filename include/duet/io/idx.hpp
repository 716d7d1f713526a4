// IDX files, the format of MNIST and Fashion-MNIST, plain or gzip-compressed.
//
//   bytes 0-1   0x00 0x00
//   byte  2     element type: 0x08 unsigned byte, 0x09 signed byte, 0x0B int16, 0x0C int32,
//               0x0D float32, 0x0E float64
//   byte  3     number of dimensions
//   then        one big-endian u32 per dimension, then the elements, big-endian, row-major
//
// A file starting with the gzip magic (0x1F 0x8B) is decompressed on the way; concatenated
// gzip members are read as one stream, as gunzip does.
//
// The reader takes any bytes, from a file (read_idx) or from memory (read_idx_bytes): a
// malformed file is a duet::FormatError naming the problem, an unreadable one a
// duet::IOError. The header is not trusted with memory: the data is first streamed through a
// fixed buffer to prove it is all there, and only then is the tensor allocated and the file
// read again into it. So a short file claiming a gigabyte (a gzip bomb's header) fails having
// allocated nothing, and a real one is held once, with no growing buffer copied into the
// tensor to double the peak (the Fashion-MNIST training images are 47 MB; decompressing them
// twice costs about 0.4 s).
#pragma once

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <variant>

#include "../dtype.hpp"
#include "../error.hpp"
#include "../shape.hpp"
#include "../tensor.hpp"

namespace duet::io {

// The largest element data read_idx accepts; larger headers are taken as corrupt.
inline constexpr std::uint64_t max_idx_data_bytes = std::uint64_t{1} << 30;

// An IDX file's contents: its elements as a tensor of the matching duet type, shaped as the
// header says.
struct IdxArray {
  DType dtype;
  Shape shape;
  std::variant<BasicTensor<std::uint8_t>, BasicTensor<std::int32_t>, BasicTensor<float>, BasicTensor<double>> data;
};

namespace detail {

// Built by appending: GCC 12 warns falsely (-Wrestrict, PR105329) on "'" + std::string.
inline std::string quoted(const std::filesystem::path& path) { return std::string("'").append(path.string()) + "'"; }

// The bytes of a file or of a buffer in memory, gunzipped on the way when they start with the
// gzip magic.
class IdxByteStream {
 public:
  // Reads the file a chunk at a time.
  IdxByteStream(const std::filesystem::path& path, const std::string& where)
      : where_(where),
        file_(std::fopen(path.c_str(), "rb")),
        buffer_(std::make_unique_for_overwrite<unsigned char[]>(chunk)) {
    if (file_ == nullptr) {
      const int error = errno;
      throw IOError(where_ + ": cannot open: " + std::generic_category().message(error));
    }
    start();
  }
  // Reads the caller's bytes in place, which must outlive the stream.
  IdxByteStream(std::span<const std::byte> bytes, const std::string& where)
      : where_(where), memory_(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) {
    start();
  }
  IdxByteStream(const IdxByteStream&) = delete;
  IdxByteStream& operator=(const IdxByteStream&) = delete;
  ~IdxByteStream() = default;

  bool gzipped() const { return inflater_.has_value(); }

  // Fills out; fewer bytes only at the end of the contents.
  std::size_t read(std::span<std::byte> out) {
    std::size_t got = 0;
    while (got < out.size()) {
      const std::size_t n = gzipped() ? inflate_some(out.subspan(got)) : copy_some(out.subspan(got));
      if (n == 0) break;
      got += n;
    }
    return got;
  }

 private:
  static constexpr std::size_t chunk = 64 * 1024;

  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };

  // Owns a z_stream, which must not move once initialised (zlib keeps a pointer to it).
  struct Inflater {
    explicit Inflater(const std::string& where) {
      // 16 + MAX_WBITS: gzip framing only, with each member's CRC-32 and length checked.
      if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) throw IOError(where + ": cannot initialise zlib");
    }
    Inflater(const Inflater&) = delete;
    Inflater& operator=(const Inflater&) = delete;
    ~Inflater() { inflateEnd(&z); }
    z_stream z{};
  };

  void start() {
    in_ = next_chunk();
    if (in_.size() >= 2 && in_[0] == 0x1F && in_[1] == 0x8B) {
      inflater_.emplace(where_);
      feed_inflater();
    }
  }

  // The next input bytes, empty at the end. Memory is handed out in chunks too, since zlib
  // counts its input in 32 bits.
  std::span<const unsigned char> next_chunk() {
    if (file_ == nullptr) {
      const auto out = memory_.first(std::min(chunk, memory_.size()));
      memory_ = memory_.subspan(out.size());
      return out;
    }
    const std::size_t n = std::fread(buffer_.get(), 1, chunk, file_.get());
    if (n < chunk && std::ferror(file_.get()) != 0) {
      const int error = errno;
      throw IOError(where_ + ": read failed: " + std::generic_category().message(error));
    }
    return {buffer_.get(), n};
  }

  void feed_inflater() {
    // zlib only reads through next_in, which is non-const unless ZLIB_CONST is defined.
    inflater_->z.next_in = const_cast<Bytef*>(in_.data());
    inflater_->z.avail_in = static_cast<uInt>(in_.size());
  }

  std::size_t copy_some(std::span<std::byte> out) {
    if (in_pos_ == in_.size()) {
      in_ = next_chunk();
      in_pos_ = 0;
    }
    const std::size_t n = std::min(out.size(), in_.size() - in_pos_);
    std::copy_n(in_.data() + in_pos_, n, reinterpret_cast<unsigned char*>(out.data()));
    in_pos_ += n;
    return n;
  }

  // Some output, or 0 at the end of the last member.
  std::size_t inflate_some(std::span<std::byte> out) {
    z_stream& z = inflater_->z;
    const auto wanted = static_cast<uInt>(std::min<std::size_t>(out.size(), std::numeric_limits<uInt>::max()));
    z.next_out = reinterpret_cast<Bytef*>(out.data());
    z.avail_out = wanted;
    while (z.avail_out == wanted) {
      if (z.avail_in == 0) {
        in_ = next_chunk();
        feed_inflater();
        if (z.avail_in == 0) {
          if (in_member_) throw FormatError(where_ + ": the gzip data is truncated");
          break;
        }
      }
      const bool starts_member = !in_member_;
      in_member_ = true;
      const int rc = inflate(&z, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        in_member_ = false;
        inflateReset(&z);
      } else if (rc == Z_MEM_ERROR) {
        throw IOError(where_ + ": out of memory while decompressing");
      } else if (rc != Z_OK && !(rc == Z_BUF_ERROR && z.avail_in == 0)) {
        // Z_BUF_ERROR with input left would mean no progress: refusing it rules out a loop.
        const std::string why = z.msg != nullptr ? z.msg : "zlib error " + std::to_string(rc);
        throw FormatError(where_ + (starts_member
                                        ? ": bytes after the gzip data are not another gzip member (" + why + ")"
                                        : ": corrupt gzip data (" + why + ")"));
      }
    }
    return wanted - z.avail_out;
  }

  std::string where_;
  std::unique_ptr<std::FILE, FileCloser> file_;  // null when reading memory_
  std::unique_ptr<unsigned char[]> buffer_;      // what in_ views, for a file
  std::span<const unsigned char> memory_;        // the bytes not yet handed out, for memory
  std::span<const unsigned char> in_;            // the current chunk
  std::size_t in_pos_ = 0;
  std::optional<Inflater> inflater_;
  bool in_member_ = true;  // the magic promised a first member
};

struct IdxHeader {
  DType dtype = DType::uint8;
  Shape shape;
  std::uint64_t header_bytes = 0;
  std::uint64_t data_bytes = 0;

  friend bool operator==(const IdxHeader&, const IdxHeader&) = default;
};

inline std::string hex_byte(std::byte b) {
  static constexpr char digits[] = "0123456789ABCDEF";
  const auto v = static_cast<unsigned>(b);
  return std::string("0x") + digits[v >> 4] + digits[v & 0xF];
}

// Where byte offsets count from, in messages.
inline std::string offsets_of(const IdxByteStream& in) { return in.gzipped() ? " of the decompressed data" : ""; }

inline IdxHeader read_idx_header(IdxByteStream& in, const std::string& where) {
  std::array<std::byte, 4> magic{};
  const std::size_t got = in.read(magic);
  if (got < magic.size()) {
    throw FormatError(where + ": truncated at byte " + std::to_string(got) + offsets_of(in) +
                      ": an IDX header starts with 4 bytes");
  }
  if (magic[0] != std::byte{0} || magic[1] != std::byte{0}) {
    throw FormatError(where + ": not an IDX file: it starts with " + hex_byte(magic[0]) + " " + hex_byte(magic[1]) +
                      ", not 0x00 0x00");
  }
  IdxHeader h;
  std::uint64_t element_size = 0;
  switch (static_cast<unsigned>(magic[2])) {
    case 0x08:
      h.dtype = DType::uint8;
      element_size = 1;
      break;
    case 0x0C:
      h.dtype = DType::int32;
      element_size = 4;
      break;
    case 0x0D:
      h.dtype = DType::float32;
      element_size = 4;
      break;
    case 0x0E:
      h.dtype = DType::float64;
      element_size = 8;
      break;
    case 0x09:
    case 0x0B:
      throw FormatError(where + ": element type " + hex_byte(magic[2]) +
                        (magic[2] == std::byte{0x09} ? " (int8)" : " (int16)") +
                        " has no duet tensor type; duet reads unsigned bytes (0x08), int32 (0x0C), float32 (0x0D) "
                        "and float64 (0x0E)");
    default:
      throw FormatError(where + ": unknown IDX element type " + hex_byte(magic[2]));
  }
  const auto ndim = static_cast<std::size_t>(magic[3]);
  if (ndim < 1 || ndim > static_cast<std::size_t>(max_rank)) {
    throw FormatError(where + ": the header gives " + std::to_string(ndim) + " dimensions; duet reads 1 to " +
                      std::to_string(max_rank));
  }
  std::array<std::byte, 4 * max_rank> dims{};
  const auto dim_bytes = std::span(dims).first(4 * ndim);
  const std::size_t got_dims = in.read(dim_bytes);
  if (got_dims < dim_bytes.size()) {
    throw FormatError(where + ": truncated at byte " + std::to_string(4 + got_dims) + offsets_of(in) +
                      ": a header of " + std::to_string(ndim) + " dimensions is " +
                      std::to_string(4 + dim_bytes.size()) + " bytes");
  }
  // The nonzero dimensions' product is bounded even when a zero makes the array empty: a
  // tensor's shape must not overflow on the way to its zero. It saturates just past the limit.
  const std::uint64_t limit = max_idx_data_bytes / element_size;
  std::uint64_t nonzero = 1;
  bool empty = false;
  for (std::size_t i = 0; i < ndim; ++i) {
    const std::byte* p = dims.data() + 4 * i;
    const std::uint64_t d =
        std::uint64_t(p[0]) << 24 | std::uint64_t(p[1]) << 16 | std::uint64_t(p[2]) << 8 | std::uint64_t(p[3]);
    h.shape.push_back(static_cast<index_t>(d));
    if (d == 0) {
      empty = true;
    } else {
      nonzero = nonzero <= limit / d ? nonzero * d : limit + 1;
    }
  }
  if (nonzero > limit) {
    throw FormatError(where + ": dimensions " + to_string(h.shape) + " exceed the " +
                      std::to_string(max_idx_data_bytes >> 20) + " MiB of data duet::io::read_idx accepts");
  }
  h.header_bytes = 4 + dim_bytes.size();
  h.data_bytes = empty ? 0 : nonzero * element_size;
  return h;
}

// Having read `got` bytes of data, checks they are exactly what the header promises.
inline void check_data_length(IdxByteStream& in, const IdxHeader& h, std::uint64_t got, const std::string& where) {
  if (got < h.data_bytes) {
    throw FormatError(where + ": truncated at byte " + std::to_string(h.header_bytes + got) + offsets_of(in) +
                      ": the header " + to_string(h.shape) + " promises " +
                      std::to_string(h.header_bytes + h.data_bytes) + " bytes");
  }
  std::array<std::byte, 1> extra{};
  if (in.read(extra) != 0) {
    throw FormatError(where + ": trailing bytes after byte " + std::to_string(h.header_bytes + h.data_bytes) +
                      offsets_of(in) + ", where the header " + to_string(h.shape) + " ends the data");
  }
}

// Streams the data through a small buffer: proves the file holds it before anything is allocated.
inline void skip_idx_data(IdxByteStream& in, const IdxHeader& h, const std::string& where) {
  std::array<std::byte, 16 * 1024> scratch;
  std::uint64_t got = 0;
  while (got < h.data_bytes) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(scratch.size(), h.data_bytes - got));
    const std::size_t n = in.read(std::span(scratch).first(want));
    got += n;
    if (n < want) break;
  }
  check_data_length(in, h, got, where);
}

template <class T>
BasicTensor<T> read_idx_data(IdxByteStream& in, const IdxHeader& h, const std::string& where) {
  auto t = BasicTensor<T>::uninitialized(h.shape);
  const std::span<std::byte> bytes = std::as_writable_bytes(t.values());
  check_data_length(in, h, in.read(bytes), where);
  // IDX elements are big-endian.
  if constexpr (sizeof(T) > 1 && std::endian::native == std::endian::little) {
    for (auto e = bytes.begin(); e != bytes.end(); e += sizeof(T)) std::reverse(e, e + sizeof(T));
  }
  return t;
}

// Both passes over the data; open() makes a new stream from its start each time.
template <class Open>
IdxArray read_idx_from(Open open, const std::string& where) {
  IdxHeader header;
  {
    IdxByteStream probe = open();
    header = read_idx_header(probe, where);
    skip_idx_data(probe, header, where);
  }
  IdxByteStream in = open();
  if (!(read_idx_header(in, where) == header)) throw FormatError(where + ": the file changed while being read");
  IdxArray out{header.dtype, header.shape, {}};
  switch (header.dtype) {
    case DType::int32:
      out.data = read_idx_data<std::int32_t>(in, header, where);
      break;
    case DType::float32:
      out.data = read_idx_data<float>(in, header, where);
      break;
    case DType::float64:
      out.data = read_idx_data<double>(in, header, where);
      break;
    default:
      out.data = read_idx_data<std::uint8_t>(in, header, where);
      break;  // uint8, the last one
  }
  return out;
}

}  // namespace detail

// The header, dimensions and elements of an IDX file; any malformed file is a FormatError.
inline IdxArray read_idx(const std::filesystem::path& path) {
  const std::string where = "IDX file " + detail::quoted(path);
  return detail::read_idx_from([&] { return detail::IdxByteStream(path, where); }, where);
}

// The same for the bytes of an IDX file already in memory, plain or gzipped.
inline IdxArray read_idx_bytes(std::span<const std::byte> bytes) {
  const std::string where = "IDX data";
  return detail::read_idx_from([&] { return detail::IdxByteStream(bytes, where); }, where);
}

// An IDX file of unsigned bytes (images, labels), as a tensor of its shape.
inline BasicTensor<std::uint8_t> read_idx_u8(const std::filesystem::path& path) {
  IdxArray a = read_idx(path);
  if (a.dtype != DType::uint8) {
    throw FormatError("IDX file " + detail::quoted(path) + ": holds " + std::string(name_of(a.dtype)) +
                      " elements, expected unsigned bytes (UInt8)");
  }
  return std::get<BasicTensor<std::uint8_t>>(std::move(a.data));
}

}  // namespace duet::io
