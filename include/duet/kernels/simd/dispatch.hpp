// From the set chosen at run time (simd/isa.hpp) to the code compiled for it (simd/arch.hpp).
#pragma once

#include "arch.hpp"
#include "isa.hpp"

namespace duet::kernels::detail {

// f(Target) with the Target of isa. A kernel written once, as a function template in each
// set's namespace that takes that set's Target first, is called as `step(target, ...)` inside
// f: argument-dependent lookup picks the set's copy. Only pointers and sizes cross the call.
template <class F>
decltype(auto) with_target(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f(avx512::Target{});
    case Isa::avx2: return f(avx2::Target{});
    case Isa::baseline: break;
  }
  return f(baseline::Target{});
}

}  // namespace duet::kernels::detail
