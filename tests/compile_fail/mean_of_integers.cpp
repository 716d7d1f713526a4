// The mean of an int32 tensor: it ran in the tensor's type, truncated (mean([1, -7, 3]) gave
// -1), where PyTorch refuses it. The twin casts to float first.
// expect: whose mean would be truncated
#include <duet/duet.hpp>

int main() {
  const duet::BasicTensor<std::int32_t> counts({3}, {1, -7, 3});
#ifdef DUET_COMPILE_FAIL
  const auto m = duet::ops::mean(counts);
#else
  const auto m = duet::ops::mean(duet::ops::cast<float>(counts));
#endif
  return m.numel() == 1 ? 0 : 1;
}
