// libFuzzer harness for the checkpoint loader. Any bytes must load into the network or throw
// a duet::Error that leaves its parameters bit-identical (aborting otherwise). Anything else
// is a bug in the loader: a sanitizer report, another exception (left uncaught, so libFuzzer
// reports it), a hang, or an allocation beyond -malloc_limit_mb.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "network.hpp"

namespace {

std::vector<std::byte> parameter_bytes(duet_fuzz::Network& net) {
  std::vector<std::byte> out;
  for (const auto& [name, p] : net.parameters()) {
    const auto bytes = std::as_bytes(p->values());
    out.insert(out.end(), bytes.begin(), bytes.end());
  }
  return out;
}

void load(std::span<const std::byte> bytes) {
  static duet_fuzz::Network net;
  const std::vector<std::byte> before = parameter_bytes(net);
  try {
    duet::load_checkpoint_bytes(bytes, net);
  } catch (const duet::Error&) {
    if (parameter_bytes(net) != before) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  load(bytes);
  // Almost every mutation breaks the checksum, which the loader checks first; the same bytes
  // with their checksum made valid reach the parser behind it.
  if (size >= 4) {
    std::vector<std::byte> fixed(bytes.begin(), bytes.end());
    const uLong crc = crc32_z(crc32_z(0, nullptr, 0), data, size - 4);
    for (std::size_t i = 0; i < 4; ++i) fixed[size - 4 + i] = static_cast<std::byte>(crc >> (8 * i));
    load(fixed);
  }
  return 0;
}
