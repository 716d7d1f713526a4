// libFuzzer harness for the checkpoint reader. Any bytes must load into the network (strictly,
// not strictly, and with Adam's or SGD's state) or throw a duet::Error that leaves its
// parameters, its Dropout's generator and the optimiser's state bit-identical, and checkpoint_info must list them or
// throw the same way (aborting otherwise). Anything else is a bug in the reader: a sanitizer
// report, another exception (left uncaught, so libFuzzer reports it), a hang, or an
// allocation beyond -malloc_limit_mb.
#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "network.hpp"

namespace {

struct Model {
  duet_fuzz::Network net;
  duet_fuzz::Adam adam{net.parameters()};
  duet_fuzz::SGD sgd{net.parameters(), duet_fuzz::sgd_config()};
};

// Everything a load may change.
std::vector<std::byte> snapshot(Model& m) {
  using duet_fuzz::append;
  std::vector<std::byte> out;
  for (const auto& [name, p] : m.net.parameters()) append(out, std::as_bytes(p->values()));
  // Field by field: the struct's padding holds no value.
  const duet::GeneratorState generator = m.net.get<3>().generator().state();
  append(out, std::as_bytes(std::span(generator.words)));
  append(out, std::as_bytes(std::span(&generator.has_spare, 1)));
  append(out, std::as_bytes(std::span(&generator.spare, 1)));
  const auto optimizer = [&](auto& o) {
    const std::int64_t step = o.global_step();
    append(out, std::as_bytes(std::span(&step, 1)));
    for (const auto& slot : o.state()) {
      for (auto& t : *slot.tensors) append(out, std::as_bytes(t.values()));
    }
  };
  optimizer(m.adam);
  optimizer(m.sgd);
  return out;
}

void load(std::span<const std::byte> bytes) {
  static Model m;
  const auto state = [&] { return snapshot(m); };
  const bool strict = duet_fuzz::attempt(state, [&] { duet::load_checkpoint_bytes(bytes, m.net); });
  duet_fuzz::attempt(state, [&] {
    duet_fuzz::check_not_strict(m.net, strict,
                                [&] { return duet::load_checkpoint_bytes(bytes, m.net, {.strict = false}); });
  });
  duet_fuzz::attempt(state, [&] { duet::load_checkpoint_bytes(bytes, m.net, m.adam); });
  duet_fuzz::attempt(state, [&] { duet::load_checkpoint_bytes(bytes, m.net, m.sgd); });
  try {
    const duet::CheckpointInfo info = duet::checkpoint_info_bytes(bytes);
    if (strict && info.parameters.size() != m.net.parameters().size()) std::abort();
  } catch (const duet::Error&) {
    if (strict) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  load(bytes);
  // Almost every mutation breaks the checksum, which the reader checks first; the same bytes
  // with their checksum made valid reach the parser behind it.
  if (size >= 4) {
    std::vector<std::byte> fixed(bytes.begin(), bytes.end());
    const uLong crc = crc32_z(crc32_z(0, nullptr, 0), data, size - 4);
    for (std::size_t i = 0; i < 4; ++i) fixed[size - 4 + i] = static_cast<std::byte>(crc >> (8 * i));
    load(fixed);
  }
  return 0;
}
