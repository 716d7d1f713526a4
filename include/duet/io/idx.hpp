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

#include "../config.hpp"
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
  IdxByteStream(const std::filesystem::path& path, const std::string& where);
  // Reads the caller's bytes in place, which must outlive the stream.
  IdxByteStream(std::span<const std::byte> bytes, const std::string& where);
  IdxByteStream(const IdxByteStream&) = delete;
  IdxByteStream& operator=(const IdxByteStream&) = delete;
  ~IdxByteStream() = default;

  bool gzipped() const { return inflater_.has_value(); }

  // Fills out; fewer bytes only at the end of the contents.
  std::size_t read(std::span<std::byte> out);

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

  void start();

  // The next input bytes, empty at the end. Memory is handed out in chunks too, since zlib
  // counts its input in 32 bits.
  std::span<const unsigned char> next_chunk();

  void feed_inflater();

  std::size_t copy_some(std::span<std::byte> out);

  // Some output, or 0 at the end of the last member.
  std::size_t inflate_some(std::span<std::byte> out);

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

DUET_DETAIL_COMPILED std::string hex_byte(std::byte b);

// Where byte offsets count from, in messages.
inline std::string offsets_of(const IdxByteStream& in) { return in.gzipped() ? " of the decompressed data" : ""; }

DUET_DETAIL_COMPILED IdxHeader read_idx_header(IdxByteStream& in, const std::string& where);

// Having read `got` bytes of data, checks they are exactly what the header promises.
DUET_DETAIL_COMPILED void check_data_length(IdxByteStream& in, const IdxHeader& h, std::uint64_t got,
                                            const std::string& where);

// Streams the data through a small buffer: proves the file holds it before anything is allocated.
DUET_DETAIL_COMPILED void skip_idx_data(IdxByteStream& in, const IdxHeader& h, const std::string& where);

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
DUET_DETAIL_COMPILED IdxArray read_idx(const std::filesystem::path& path);

// The same for the bytes of an IDX file already in memory, plain or gzipped.
DUET_DETAIL_COMPILED IdxArray read_idx_bytes(std::span<const std::byte> bytes);

// An IDX file of unsigned bytes (images, labels), as a tensor of its shape.
DUET_DETAIL_COMPILED BasicTensor<std::uint8_t> read_idx_u8(const std::filesystem::path& path);

}  // namespace duet::io

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/idx_impl.hpp"
#endif
