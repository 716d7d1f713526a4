// A static reshape to the wrong element count ([3, 4] as [5, 2]): the message names the
// operation with its target shape, the count it needs and the input's shape.
// expect: layer_accepts<duet::ops::ReshapeOp<5, 2>, duet::diagnostic::element_count_must_be<10>, duet::diagnostic::input_shape<3, 4> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) { return duet::ops::reshape<5, 2>(x); }
#else
  auto construct(auto x) { return duet::ops::reshape<6, 2>(x); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones(duet::shape<3, 4>));
  return y.numel() == 12 ? 0 : 1;
}
