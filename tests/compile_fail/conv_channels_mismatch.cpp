// A Conv2d whose in_channels do not match the channels of the layer before it.
// expect: layer_accepts<duet::nn::Conv2d<4, 8, 3(, 1, 0, 1, 1)?(, float)?>, duet::diagnostic::channel_dimension_must_be<4>, duet::diagnostic::input_shape<2, 6, 10, 10>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Conv2d<1, 6, 5, 1, 2> conv1;
#ifdef DUET_COMPILE_FAIL
  duet::nn::Conv2d<4, 8, 3> conv2;
#else
  duet::nn::Conv2d<6, 8, 3> conv2;
#endif
  DUET_CELL_MEMBERS(conv1, conv2);
  auto construct(auto x) { return conv2(conv1(x)); }
};

int main() {
  Net net;
  auto y = net(duet::ones(duet::shape<2, 1, 10, 10>));
  return y.numel() == 2 * 8 * 8 * 8 ? 0 : 1;
}
