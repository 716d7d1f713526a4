// A Dense applied to a rank-0 (scalar) input.
// expect: layer_accepts<duet::nn::Dense<4, 2(, float)?(, true)?>, duet::diagnostic::rank_must_be_at_least<1>,
// duet::diagnostic::input_shape<>
#include <duet/duet.hpp>

int main() {
  duet::nn::Dense<4, 2> dense;
#ifdef DUET_COMPILE_FAIL
  auto y = dense(duet::ones(duet::shape<>));
#else
  auto y = dense(duet::ones(duet::shape<4>));
#endif
  return y.numel() == 2 ? 0 : 1;
}
