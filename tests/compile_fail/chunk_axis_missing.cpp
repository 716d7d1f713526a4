// chunk along an axis a static input does not have: the message names the piece's operation,
// the rank it needs and the input's shape.
// expect: ChunkOp<2, 2, 0>, duet::diagnostic::rank_must_be_at_least<3>, duet::diagnostic::input_shape<4, 3>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) { return std::get<0>(duet::ops::chunk<2, 2>(x)); }
#else
  auto construct(auto x) { return std::get<0>(duet::ops::chunk<1, 2>(x)); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones(duet::shape<4, 3>));
  return y.numel() == 8 ? 0 : 1;
}
