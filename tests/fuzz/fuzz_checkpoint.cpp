// libFuzzer harness for the checkpoint reader. Any bytes must load into the network (strictly,
// not strictly, and with Adam's or SGD's state) or throw a duet::Error that leaves its
// parameters and the optimiser's state bit-identical, and checkpoint_info must list them or
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
  duet_fuzz::SGD sgd{net.parameters(), duet_fuzz::sgd_config};
};

void append(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

// Everything a load may change.
std::vector<std::byte> snapshot(Model& m) {
  std::vector<std::byte> out;
  for (const auto& [name, p] : m.net.parameters()) append(out, std::as_bytes(p->values()));
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

// Runs a load; one that throws must have changed nothing.
template <class F>
bool attempt(Model& m, F&& load) {
  const std::vector<std::byte> before = snapshot(m);
  try {
    load();
    return true;
  } catch (const duet::Error&) {
    if (snapshot(m) != before) std::abort();
    return false;
  }
}

void load(std::span<const std::byte> bytes) {
  static Model m;
  const bool strict = attempt(m, [&] { duet::load_checkpoint_bytes(bytes, m.net); });
  attempt(m, [&] {
    const auto before = m.net.parameters();
    // Bytes, not floats: a loaded NaN is not equal to itself.
    std::vector<std::vector<std::byte>> values(before.size());
    for (std::size_t i = 0; i < before.size(); ++i) append(values[i], std::as_bytes(before[i].parameter->values()));
    const duet::CheckpointLoad result = duet::load_checkpoint_bytes(bytes, m.net, {.strict = false});
    // What a load that succeeds strictly leaves out is nothing; what it leaves out keeps its values.
    if (strict && !(result.param_not_load.empty() && result.ckpt_not_load.empty())) std::abort();
    for (std::size_t i = 0; i < before.size(); ++i) {
      const bool kept = std::ranges::find(result.param_not_load, before[i].name) != result.param_not_load.end();
      if (kept && !std::ranges::equal(std::as_bytes(before[i].parameter->values()), values[i])) std::abort();
    }
  });
  attempt(m, [&] { duet::load_checkpoint_bytes(bytes, m.net, m.adam); });
  attempt(m, [&] { duet::load_checkpoint_bytes(bytes, m.net, m.sgd); });
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
