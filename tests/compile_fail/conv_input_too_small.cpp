// A Conv2d whose dilated kernel, less its padding, is larger than its input.
// expect: layer_accepts<duet::nn::Conv2d<1, 2, 5, 1, 1, 2(, 1)?(, float)?>, duet::diagnostic::spatial_sizes_must_be_at_least<7>, duet::diagnostic::input_shape<1, 1, 6, 9>
#include <duet/duet.hpp>

int main() {
  duet::nn::Conv2d<1, 2, 5, 1, 1, 2> conv;  // extent 2 · 4 + 1 = 9, padded by 1 on each side
#ifdef DUET_COMPILE_FAIL
  auto y = conv(duet::ones(duet::shape<1, 1, 6, 9>));
#else
  auto y = conv(duet::ones(duet::shape<1, 1, 7, 9>));
#endif
  return y.numel() == 2 * 1 * 3 ? 0 : 1;
}
