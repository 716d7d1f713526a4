// The definitions of interchange.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::ops {

DUET_DETAIL_COMPILED void append_interchange(Interchange& to, Interchange part, const InterchangeInput& in) {
  const std::size_t base = to.size();
  for (InterchangeNode& n : part) {
    for (InterchangeInput& i : n.inputs) {
      if (i.kind == InterchangeInput::Kind::input)
        i = in;
      else if (i.kind == InterchangeInput::Kind::earlier)
        i.index += base;
    }
    to.push_back(std::move(n));
  }
}

}  // namespace duet::ops
