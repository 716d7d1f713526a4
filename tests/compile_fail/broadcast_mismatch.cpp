// Two static shapes that do not broadcast ([2, 3] + [4]): the message names both.
// expect: layer_accepts<duet::ops::BroadcastOp<duet::fn::Add>, duet::diagnostic::must_broadcast_with<duet::diagnostic::input_shape<2, 3> ?>, duet::diagnostic::input_shape<4> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  auto construct(auto a, auto b) { return a + b; }
};

int main() {
  Net net;
  const auto a = duet::ones(duet::shape<2, 3>);
#ifdef DUET_COMPILE_FAIL
  const auto b = duet::ones(duet::shape<4>);
#else
  const auto b = duet::ones(duet::shape<3>);
#endif
  const duet::Tensor y = net(a, b);
  return y.numel() == 6 ? 0 : 1;
}
