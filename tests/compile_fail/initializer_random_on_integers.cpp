// A random initialiser asked to fill an integer tensor: its values would be truncated to
// nothing useful, so it does not compile (Constant, Zero and One fill integer tensors).
// expect: this initialiser cannot fill a tensor of this element type
#include <cstdint>
#include <duet/duet.hpp>

int main() {
  duet::BasicTensor<std::int32_t> labels({4});
#ifdef DUET_COMPILE_FAIL
  duet::initializer::initialize(labels, duet::initializer::HeNormal{});
#else
  duet::initializer::initialize(labels, duet::initializer::Constant{3});
#endif
  return labels(0) == 3 ? 0 : 1;
}
