// A BatchNorm2d of 3 channels after a layer that makes 4, in a network's construct.
// expect: layer_accepts<duet::nn::BatchNorm<2, 3(, float)?>, duet::diagnostic::channel_dimension_must_be<3>,
// duet::diagnostic::input_shape<2, 4, 5, 5>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
#ifdef DUET_COMPILE_FAIL
  duet::nn::BatchNorm2d<3> bn;
#else
  duet::nn::BatchNorm2d<4> bn;
#endif
  DUET_CELL_MEMBERS(bn);
  auto construct(auto x) { return bn(x); }
};

int main() {
  Net net;
  auto y = net(duet::ones(duet::shape<2, 4, 5, 5>));
  return y.numel() == 200 ? 0 : 1;
}
