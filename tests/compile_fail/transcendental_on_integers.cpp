// The sigmoid of an int32 tensor: it would run in the tensor's type, every result truncated to
// 0 or 1 (GELU's and erf's kernels divided by zero). The twin casts to float first.
// expect: take floating-point tensors
#include <duet/duet.hpp>
#include <duet/ops/cast.hpp>

int main() {
  const duet::BasicTensor<std::int32_t> counts({4}, {-3, -1, 1, 3});
#ifdef DUET_COMPILE_FAIL
  const auto y = duet::ops::sigmoid(counts);
#else
  const auto y = duet::ops::sigmoid(duet::ops::cast<float>(counts));
#endif
  return y.numel() == 4 ? 0 : 1;
}
