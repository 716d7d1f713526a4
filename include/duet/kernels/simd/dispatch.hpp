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

// The Target of the set whose vectors are Bytes wide. Each set's width is its own, so code
// written once outside the sets on a vector of any width (fn::Sigmoid::apply_in_place, inlined
// into a set's product or map) reaches that set's functions from the vector's type.
template <int Bytes>
struct TargetOfWidth;
template <>
struct TargetOfWidth<baseline::vector_bytes> {
  using type = baseline::Target;
};
#if DUET_X86_KERNELS
template <>
struct TargetOfWidth<avx2::vector_bytes> {
  using type = avx2::Target;
};
template <>
struct TargetOfWidth<avx512::vector_bytes> {
  using type = avx512::Target;
};
#endif

}  // namespace duet::kernels::detail
