// A permutation of the wrong rank for a static input (two axes for [2, 3, 4]): the message
// names the operation with its permutation, the rank it needs and the input's shape.
// expect: layer_accepts<duet::ops::TransposeOp<1, 0>, duet::diagnostic::rank_must_be<2>, duet::diagnostic::input_shape<2, 3, 4> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) { return duet::ops::transpose<1, 0>(x); }
#else
  auto construct(auto x) { return duet::ops::transpose<1, 2, 0>(x); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones(duet::shape<2, 3, 4>));
  return y.numel() == 24 ? 0 : 1;
}
