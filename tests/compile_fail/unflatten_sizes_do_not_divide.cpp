// unflatten cutting an axis into sizes that do not divide it ([2, 8]'s last axis, 8, into 3 and
// an inferred size): the message names the operation, the multiple it needs and the input's shape.
// expect: layer_accepts<duet::ops::UnflattenOp<-1, 3, -1>,
// duet::diagnostic::size_along_the_axis_must_be_a_multiple_of<3>, duet::diagnostic::input_shape<2, 8> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) { return duet::ops::unflatten<-1, 3, -1>(x); }
#else
  auto construct(auto x) { return duet::ops::unflatten<-1, 4, -1>(x); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones(duet::shape<2, 8>));
  return y.shape() == duet::Shape{2, 4, 2} ? 0 : 1;
}
