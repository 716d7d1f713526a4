// where's two branches of static shapes that do not broadcast ([2, 3] and [4]): the message
// names the operation and both shapes, not the condition's.
// expect: layer_accepts<duet::ops::WhereOp<float>, duet::diagnostic::must_broadcast_with<duet::diagnostic::input_shape<2, 3> ?>, duet::diagnostic::input_shape<4> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  auto construct(auto a, auto b) { return duet::ops::where(duet::ops::greater(a, 0.0f), a, b); }
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
