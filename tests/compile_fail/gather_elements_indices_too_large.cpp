// gather_elements' indices larger than x along an axis other than the one gathered ([3, 3]
// into [3, 2] along axis 0): the message names the operation, its axis and both shapes.
// expect: layer_accepts<duet::ops::GatherElementsOp<0>, duet::diagnostic::indices_must_fit_in_except_along_axis<0, duet::diagnostic::input_shape<3, 2> ?>, duet::diagnostic::input_shape<3, 3> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  auto construct(auto x, auto indices) { return duet::ops::gather_elements<0>(x, indices); }
};

int main() {
  Net net;
  const auto x = duet::ones(duet::shape<3, 2>);
#ifdef DUET_COMPILE_FAIL
  const auto indices = duet::zeros<std::int32_t>(duet::shape<3, 3>);
#else
  const auto indices = duet::zeros<std::int32_t>(duet::shape<3, 2>);
#endif
  const duet::Tensor y = net(x, indices);
  return y.numel() == 6 ? 0 : 1;
}
