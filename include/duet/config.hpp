// duet: one neural network, two modes.
#pragma once

#include <cstddef>
#include <cstdint>

#define DUET_VERSION_MAJOR 0
#define DUET_VERSION_MINOR 1
#define DUET_VERSION_PATCH 0

// Before a loop the compiler is to vectorise at any optimisation level: GCC 12 at -O2, the
// README's build, vectorises none by itself. OpenMP's simd, which duet's CMake target's
// -fopenmp turns on; without OpenMP the loop stays as it is.
#ifdef _OPENMP
#define DUET_SIMD_LOOP _Pragma("omp simd")
#else
#define DUET_SIMD_LOOP
#endif

// Non-template functions compiled once (issue 16). Such a function is declared
// DUET_DETAIL_COMPILED in its header and defined in a detail/*_impl.hpp file that the header
// includes at its end when DUET_DETAIL_DEFINE_COMPILED is set. Header-only, that is always, and
// the function is inline; with DUET_PRECOMPILED_KERNELS (duet/precompiled_kernels.hpp) a
// program's files see the declaration only, and duet::kernels' file, which defines
// DUET_DEFINE_PRECOMPILED_KERNELS, compiles the definitions once, not inline.
#if defined(DUET_PRECOMPILED_KERNELS) || defined(DUET_DEFINE_PRECOMPILED_KERNELS)
#define DUET_DETAIL_COMPILED
#else
#define DUET_DETAIL_COMPILED inline
#endif
#if !defined(DUET_PRECOMPILED_KERNELS) || defined(DUET_DEFINE_PRECOMPILED_KERNELS)
#define DUET_DETAIL_DEFINE_COMPILED
#endif

// A program built with DUET_PRECOMPILED_KERNELS but without duet::kernels' file fails to link on
// this name too, among the functions it lacks: it says what is missing, whichever duet headers
// the program includes. The name also says whether OpenMP was on (-fopenmp), which must be the same in the file and the
// program: the kernels' threads, and inline functions both sides define (threads.hpp), differ with it.
#ifdef _OPENMP
#define DUET_DETAIL_KERNELS_LINKED \
  duet_precompiled_kernels__link_duet_kernels_or_a_file_defining_DUET_DEFINE_PRECOMPILED_KERNELS__with_openmp
#else
#define DUET_DETAIL_KERNELS_LINKED \
  duet_precompiled_kernels__link_duet_kernels_or_a_file_defining_DUET_DEFINE_PRECOMPILED_KERNELS__without_openmp
#endif
#if defined(DUET_DEFINE_PRECOMPILED_KERNELS)
extern "C" const int DUET_DETAIL_KERNELS_LINKED = 1;
#elif defined(DUET_PRECOMPILED_KERNELS)
extern "C" const int DUET_DETAIL_KERNELS_LINKED;
namespace duet::detail {
[[gnu::used]] static const int* const precompiled_kernels_linked = &DUET_DETAIL_KERNELS_LINKED;
}  // namespace duet::detail
#endif
#undef DUET_DETAIL_KERNELS_LINKED

namespace duet {

// Signed, as in numpy and MindSpore: -1 spells "dynamic" in shapes and "from the end" in axes.
using index_t = std::int64_t;

// A dimension whose size is known only at run time (MindSpore writes it as -1 or None).
inline constexpr index_t dyn = -1;

// Shapes live inline (no heap) so that creating a tensor costs one block from the pool.
inline constexpr int max_rank = 8;

}  // namespace duet
