// An int32 tensor times 0.5: the operation runs in the tensor's type, so the number would be
// truncated to 0 and every element with it. The twin multiplies by an integer.
// expect: an integer tensor with a floating-point number
#include <duet/duet.hpp>

int main() {
  const duet::BasicTensor<std::int32_t> counts({4}, {1, 2, 3, 4});
#ifdef DUET_COMPILE_FAIL
  const auto half = counts * 0.5;
#else
  const auto half = counts * 2;
#endif
  return half.numel() == 4 ? 0 : 1;
}
