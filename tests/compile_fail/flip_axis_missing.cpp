// flip along an axis a static input does not have: the message names the operation, the rank
// it needs and the input's shape.
// expect: FlipOp<0, 2>, duet::diagnostic::rank_must_be_at_least<3>, duet::diagnostic::input_shape<3, 4>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) { return duet::ops::flip<0, 2>(x); }
#else
  auto construct(auto x) { return duet::ops::flip<0, 1>(x); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones(duet::shape<3, 4>));
  return y.numel() == 12 ? 0 : 1;
}
