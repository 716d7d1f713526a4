// A LayerNorm whose normalized_shape does not match its input's last dimension.
// expect: layer_accepts<duet::nn::LayerNorm<8(, float)?>, duet::diagnostic::last_dimension_must_be<8>,
// duet::diagnostic::input_shape<2, 4>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<3, 4> dense;
#ifdef DUET_COMPILE_FAIL
  duet::nn::LayerNorm<8> norm;
#else
  duet::nn::LayerNorm<4> norm;
#endif
  DUET_CELL_MEMBERS(dense, norm);
  auto construct(auto x) { return norm(dense(x)); }
};

int main() {
  Net net;
  auto y = net(duet::ones(duet::shape<2, 3>));
  return y.numel() == 8 ? 0 : 1;
}
