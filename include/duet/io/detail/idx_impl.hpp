// The definitions of io/idx.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::io {

DUET_DETAIL_COMPILED IdxArray read_idx(const std::filesystem::path& path) {
  const std::string where = "IDX file " + detail::quoted(path);
  return detail::read_idx_from([&] { return detail::IdxByteStream(path, where); }, where);
}

DUET_DETAIL_COMPILED IdxArray read_idx_bytes(std::span<const std::byte> bytes) {
  const std::string where = "IDX data";
  return detail::read_idx_from([&] { return detail::IdxByteStream(bytes, where); }, where);
}

DUET_DETAIL_COMPILED BasicTensor<std::uint8_t> read_idx_u8(const std::filesystem::path& path) {
  IdxArray a = read_idx(path);
  if (a.dtype != DType::uint8) {
    throw FormatError("IDX file " + detail::quoted(path) + ": holds " + std::string(name_of(a.dtype)) +
                      " elements, expected unsigned bytes (UInt8)");
  }
  return std::get<BasicTensor<std::uint8_t>>(std::move(a.data));
}

}  // namespace duet::io

namespace duet::io::detail {

DUET_DETAIL_COMPILED IdxByteStream::IdxByteStream(const std::filesystem::path& path, const std::string& where)
    : where_(where),
      file_(std::fopen(path.c_str(), "rb")),
      buffer_(std::make_unique_for_overwrite<unsigned char[]>(chunk)) {
  if (file_ == nullptr) {
    const int error = errno;
    throw IOError(where_ + ": cannot open: " + std::generic_category().message(error));
  }
  start();
}

DUET_DETAIL_COMPILED IdxByteStream::IdxByteStream(std::span<const std::byte> bytes, const std::string& where)
    : where_(where), memory_(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) {
  start();
}

DUET_DETAIL_COMPILED std::size_t IdxByteStream::read(std::span<std::byte> out) {
  std::size_t got = 0;
  while (got < out.size()) {
    const std::size_t n = gzipped() ? inflate_some(out.subspan(got)) : copy_some(out.subspan(got));
    if (n == 0) break;
    got += n;
  }
  return got;
}

DUET_DETAIL_COMPILED void IdxByteStream::start() {
  in_ = next_chunk();
  if (in_.size() >= 2 && in_[0] == 0x1F && in_[1] == 0x8B) {
    inflater_.emplace(where_);
    feed_inflater();
  }
}

DUET_DETAIL_COMPILED std::span<const unsigned char> IdxByteStream::next_chunk() {
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

DUET_DETAIL_COMPILED void IdxByteStream::feed_inflater() {
  // zlib only reads through next_in, which is non-const unless ZLIB_CONST is defined.
  inflater_->z.next_in = const_cast<Bytef*>(in_.data());
  inflater_->z.avail_in = static_cast<uInt>(in_.size());
}

DUET_DETAIL_COMPILED std::size_t IdxByteStream::copy_some(std::span<std::byte> out) {
  if (in_pos_ == in_.size()) {
    in_ = next_chunk();
    in_pos_ = 0;
  }
  const std::size_t n = std::min(out.size(), in_.size() - in_pos_);
  std::copy_n(in_.data() + in_pos_, n, reinterpret_cast<unsigned char*>(out.data()));
  in_pos_ += n;
  return n;
}

DUET_DETAIL_COMPILED std::size_t IdxByteStream::inflate_some(std::span<std::byte> out) {
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

DUET_DETAIL_COMPILED std::string hex_byte(std::byte b) {
  static constexpr char digits[] = "0123456789ABCDEF";
  const auto v = static_cast<unsigned>(b);
  return std::string("0x") + digits[v >> 4] + digits[v & 0xF];
}

DUET_DETAIL_COMPILED IdxHeader read_idx_header(IdxByteStream& in, const std::string& where) {
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

DUET_DETAIL_COMPILED void check_data_length(IdxByteStream& in, const IdxHeader& h, std::uint64_t got,
                                            const std::string& where) {
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

DUET_DETAIL_COMPILED void skip_idx_data(IdxByteStream& in, const IdxHeader& h, const std::string& where) {
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

}  // namespace duet::io::detail
