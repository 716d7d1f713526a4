// PyTorch's eps given bare to a static LayerNorm, nn::LayerNorm<16>{1e-5}: it would be taken
// for the size (a narrowing error of six lines); the message shows the spelling by name.
// expect: give epsilon by name, nn::LayerNorm<N>\(\{\.epsilon = 1e-5\}\)
#include <duet/duet.hpp>

int main() {
#ifdef DUET_COMPILE_FAIL
  duet::nn::LayerNorm<16> norm{1e-5};
#else
  duet::nn::LayerNorm<16> norm{{.epsilon = 1e-5}};
#endif
  return norm.epsilon() == 1e-5 ? 0 : 1;
}
