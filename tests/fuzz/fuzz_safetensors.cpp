// libFuzzer harness for the safetensors reader. Any bytes must load into the network (strictly
// and not strictly) or throw a duet::Error that leaves its parameters bit-identical (aborting
// otherwise). Anything else is a bug in the reader: a sanitizer report, another exception
// (left uncaught, so libFuzzer reports it), a hang, or an allocation beyond -malloc_limit_mb.
// safetensors.dict beside this file gives the mutator the header's JSON words.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <duet/io/safetensors.hpp>

#include "network.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static duet_fuzz::Network net;
  const auto bytes = std::as_bytes(std::span(data, size));
  const auto parameters = [&] {
    std::vector<std::byte> out;
    for (const auto& [name, p] : net.parameters()) duet_fuzz::append(out, std::as_bytes(p->values()));
    return out;
  };
  const bool strict = duet_fuzz::attempt(parameters, [&] { duet::io::load_safetensors_bytes(bytes, net); });
  duet_fuzz::attempt(parameters, [&] {
    duet_fuzz::check_not_strict(net, strict,
                                [&] { return duet::io::load_safetensors_bytes(bytes, net, {.strict = false}); });
  });
  return 0;
}
