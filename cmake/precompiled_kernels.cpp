// duet::kernels: the kernels' definitions for programs built with DUET_PRECOMPILED_KERNELS
// (duet/precompiled_kernels.hpp). duet.hpp rather than precompiled_kernels.hpp alone, so that
// the tests can build it from the generated single header too.
#define DUET_DEFINE_PRECOMPILED_KERNELS
#include <duet/duet.hpp>
