// Two static factors whose inner dimensions differ ([2, 3] · [4, 5]): the message names both.
// expect: layer_accepts<duet::ops::BatchMatMulOp<false, false>, duet::diagnostic::inner_dimension_must_match<duet::diagnostic::input_shape<2, 3> ?>, duet::diagnostic::input_shape<4, 5> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  auto construct(auto a, auto b) { return duet::ops::matmul(a, b); }
};

int main() {
  Net net;
  const auto a = duet::ones(duet::shape<2, 3>);
#ifdef DUET_COMPILE_FAIL
  const auto b = duet::ones(duet::shape<4, 5>);
#else
  const auto b = duet::ones(duet::shape<3, 5>);
#endif
  const duet::Tensor y = net(a, b);
  return y.numel() == 10 ? 0 : 1;
}
