// libFuzzer harness for the IDX reader. Any bytes must give an array consistent with its
// header or a duet::Error. Anything else is a bug in the reader: a sanitizer report, another
// exception (left uncaught, so libFuzzer reports it), a hang, or an allocation beyond
// -malloc_limit_mb.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <duet/duet.hpp>
#include <span>
#include <variant>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const duet::io::IdxArray a = duet::io::read_idx_bytes(std::as_bytes(std::span(data, size)));
    std::visit(
        [&](const auto& t) {
          if (t.dtype() != a.dtype || !(t.shape() == a.shape)) std::abort();
        },
        a.data);
  } catch (const duet::Error&) {
  }
  return 0;
}
