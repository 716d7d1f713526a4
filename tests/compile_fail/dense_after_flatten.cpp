// A Dense whose input size does not match what Flatten produces from a static input shape.
// expect: layer_accepts<duet::nn::Dense<100, 10(, float)?(, true)?>, duet::diagnostic::last_dimension_must_be<100>,
// duet::diagnostic::input_shape<64, 784>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Flatten flatten;
#ifdef DUET_COMPILE_FAIL
  duet::nn::Dense<100, 10> dense;
#else
  duet::nn::Dense<784, 10> dense;
#endif
  DUET_CELL_MEMBERS(flatten, dense);
  auto construct(auto x) { return dense(flatten(x)); }
};

int main() {
  Net net;
  auto y = net(duet::ones(duet::shape<64, 1, 28, 28>));
  return y.numel() == 640 ? 0 : 1;
}
