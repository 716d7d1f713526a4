// The sigmoid of an int32 tensor: it would run in the tensor's type, every result truncated to
// 0 or 1 (GELU's and erf's kernels divided by zero). The twin takes the sigmoid of floats.
// expect: take floating-point tensors
#include <duet/duet.hpp>

int main() {
#ifdef DUET_COMPILE_FAIL
  const duet::BasicTensor<std::int32_t> counts({4}, {-3, -1, 1, 3});
#else
  const duet::BasicTensor<float> counts({4}, {-3, -1, 1, 3});
#endif
  const auto y = duet::ops::sigmoid(counts);
  return y.numel() == 4 ? 0 : 1;
}
