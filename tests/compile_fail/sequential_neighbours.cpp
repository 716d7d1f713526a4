// A SequentialCell whose second Dense does not take what the first one gives, in any mode.
// expect: layer_accepts<duet::nn::Dense<256, 10(, float)?(, true)?>, duet::diagnostic::last_dimension_must_be<256>,
// duet::diagnostic::input_shape_after_unknown_leading_dims<512>
#include <duet/duet.hpp>

int main() {
#ifdef DUET_COMPILE_FAIL
  duet::nn::SequentialCell<duet::nn::Dense<784, 512>, duet::nn::ReLU, duet::nn::Dense<256, 10>> seq;
#else
  duet::nn::SequentialCell<duet::nn::Dense<784, 512>, duet::nn::ReLU, duet::nn::Dense<512, 10>> seq;
#endif
  return seq(duet::ones({1, 784})).numel() == 10 ? 0 : 1;
}
