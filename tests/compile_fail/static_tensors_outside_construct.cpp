// Operations on static tensors outside construct check their shapes at compile time too:
// [2, 3] + [4] names both shapes, as in construct.
// expect: layer_accepts<duet::ops::BroadcastOp<duet::fn::Add>, duet::diagnostic::must_broadcast_with<duet::diagnostic::input_shape<2, 3> ?>, duet::diagnostic::input_shape<4> ?>
#include <duet/duet.hpp>

int main() {
  const auto a = duet::ones(duet::shape<2, 3>);
#ifdef DUET_COMPILE_FAIL
  const auto b = duet::ones(duet::shape<4>);
#else
  const auto b = duet::ones(duet::shape<3>);
#endif
  const auto y = a + b;
  return y.numel() == 6 ? 0 : 1;
}
