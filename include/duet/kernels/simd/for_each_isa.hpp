// Compiles the kernel file DUET_SIMD_BODY names (a path relative to this directory) once per
// instruction set, into duet::kernels::detail::baseline, ::avx2 and ::avx512, each inside its
// target region; the file finds its set's Vec, lanes, fma, ... (simd/arch.hpp) unqualified.
// No include guard: included once by each kernel header, which defines DUET_SIMD_BODY first.
#include "arch.hpp"

namespace duet::kernels::detail::baseline {
#include DUET_SIMD_BODY
}  // namespace duet::kernels::detail::baseline

#if DUET_X86_KERNELS
DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {
#include DUET_SIMD_BODY
}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {
#include DUET_SIMD_BODY
}  // namespace duet::kernels::detail::avx512
DUET_END_ISA
#endif

#undef DUET_SIMD_BODY
