// The definitions of shape.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet {

DUET_DETAIL_COMPILED std::string to_string(const Shape& s) {
  std::string out = "[";
  bool first = true;
  if (s.leading_unknown()) {
    out += "...";
    first = false;
  }
  for (index_t d : s) {
    if (!first) out += ", ";
    out += d == dyn ? std::string("?") : std::to_string(d);
    first = false;
  }
  return out + "]";
}

}  // namespace duet
