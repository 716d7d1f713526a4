// MindSpore's nn.GELU(approximate=False) written as nn::GELU(false): duet's GELU cells take no
// argument, the form is in the type. The twin names the exact form's cell.
// expect: nn.GELU\(approximate=False\) is nn::GELUExact
#include <duet/duet.hpp>

int main() {
#ifdef DUET_COMPILE_FAIL
  duet::nn::GELU gelu(false);
#else
  duet::nn::GELUExact gelu;
#endif
  const duet::Tensor y = gelu(duet::ones({2, 3}));
  return y.numel() == 6 ? 0 : 1;
}
