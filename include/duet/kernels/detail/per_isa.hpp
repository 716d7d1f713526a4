// A kernel family's body once per instruction set, each in its set's namespace and target
// region: the one place that lists the sets (simd/arch.hpp defines them). A family's header
// defines DUET_KERNEL_BODY as its body's file name in this directory and includes this file:
//
//   #define DUET_KERNEL_BODY "pool_impl.hpp"
//   #include "detail/per_isa.hpp"
//
// No include guard: every family includes it. tools/amalgamate.cpp follows the macro.
#ifndef DUET_KERNEL_BODY
#error "define DUET_KERNEL_BODY (the body's file name) before including kernels/detail/per_isa.hpp"
#endif

DUET_BEGIN_BASELINE
namespace duet::kernels::detail::baseline {
#include DUET_KERNEL_BODY
}  // namespace duet::kernels::detail::baseline
DUET_END_BASELINE

#if DUET_X86_KERNELS
DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {
#include DUET_KERNEL_BODY
}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {
#include DUET_KERNEL_BODY
}  // namespace duet::kernels::detail::avx512
DUET_END_ISA
#endif

#undef DUET_KERNEL_BODY
