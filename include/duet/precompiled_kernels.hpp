// Precompiled kernels: the same kernels, compiled once instead of in every file (issue 16).
//
// Every translation unit that includes duet compiles the kernels it calls three times, once per
// instruction set (kernels/simd/arch.hpp), at -O2 whatever the build's level: for a one-layer
// network about a quarter of g++'s time (tools/compile_costs.md). The kernels do not depend on
// the network, only on the element type and the functions a product fuses, so a program can
// take them from one file:
//
//   - every file of the program is compiled with -DDUET_PRECOMPILED_KERNELS: the kernels'
//     entry points (kernels/detail/precompiled_impl.hpp lists them) are declared extern there;
//   - one file defines DUET_DEFINE_PRECOMPILED_KERNELS before including duet, and is linked in:
//     it holds their definitions. CMake's duet::kernels is that file, built once, and sets the
//     macro for whatever links it.
//
// The same file holds what else does not depend on the network: the non-template functions
// (DUET_DETAIL_COMPILED, config.hpp) and the float and double instances of the optimisers,
// DynamicCell, Parameter and the checkpoint functions (detail/precompiled_instances.hpp).
//
// The code that runs is the same (the kernels' own target and optimisation regions, not the
// build's flags, choose their instructions and turn off a·b + c contraction), so the results
// are the same bits. Forgetting the file is a link error naming the kernels' entry points and
// duet_precompiled_kernels__link_duet_kernels_or_a_file_defining_DUET_DEFINE_PRECOMPILED_KERNELS
// (and __with_openmp or __without_openmp, which must match). Both files must see the same duet.
#pragma once

#include "io/checkpoint.hpp"
#include "kernels/conv.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/gemm.hpp"
#include "kernels/optim.hpp"
#include "kernels/pool.hpp"
#include "nn/activation.hpp"
#include "nn/dense.hpp"
#include "parallel.hpp"

#if defined(DUET_DEFINE_PRECOMPILED_KERNELS)
#define DUET_DETAIL_INSTANCE template
#elif defined(DUET_PRECOMPILED_KERNELS)
#define DUET_DETAIL_INSTANCE extern template
#endif

#ifdef DUET_DETAIL_INSTANCE
// Each set's instances in its namespace, through the one list of sets; the sets' target regions
// hold no function declaration here, which clang would warn about.
#ifdef __clang__
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wpragma-clang-attribute"
#endif
#define DUET_KERNEL_BODY "precompiled_impl.hpp"
#include "kernels/detail/per_isa.hpp"
#ifdef __clang__
#pragma clang diagnostic pop
#endif
#include "detail/precompiled_instances.hpp"
#undef DUET_DETAIL_INSTANCE
#endif
