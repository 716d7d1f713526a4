// One sample given without its batch dimension: Flatten refuses it, rather than making it
// [784, 1] and leaving the next Dense to report a puzzling shape.
// expect: layer_accepts<duet::ops::FlattenOp, duet::diagnostic::batch_dimension_missing_rank_must_be_at_least<2>, duet::diagnostic::input_shape<784>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Flatten flatten;
  duet::nn::Dense<784, 10> dense;
  DUET_CELL_MEMBERS(flatten, dense);
  auto construct(auto x) { return dense(flatten(x)); }
};

int main() {
  Net net;
#ifdef DUET_COMPILE_FAIL
  auto y = net(duet::ones(duet::shape<784>));
#else
  auto y = net(duet::ones(duet::shape<1, 784>));
#endif
  return y.numel() == 10 ? 0 : 1;
}
