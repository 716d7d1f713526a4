// Two static shapes that concat cannot join along axis 0 ([2, 3] and [4, 5]): the message
// names the operation, its axis and the shape that does not match.
// expect: layer_accepts<duet::ops::ConcatOp<0, 2>, duet::diagnostic::sizes_must_match_input_0_except_along_axis<0>, duet::diagnostic::input_shape<4, 5> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  auto construct(auto a, auto b) { return duet::ops::concat<0>(a, b); }
};

int main() {
  Net net;
  const auto a = duet::ones(duet::shape<2, 3>);
#ifdef DUET_COMPILE_FAIL
  const auto b = duet::ones(duet::shape<4, 5>);
#else
  const auto b = duet::ones(duet::shape<4, 3>);
#endif
  const duet::Tensor y = net(a, b);
  return y.numel() == 18 ? 0 : 1;
}
