// cumsum along an axis a static input does not have: the message names the operation, the rank
// it needs and the input's shape.
// expect: CumsumOp<-3>, duet::diagnostic::rank_must_be_at_least<3>, duet::diagnostic::input_shape<3, 4>
#include <duet/duet.hpp>

int main() {
#ifdef DUET_COMPILE_FAIL
  const auto y = duet::ops::cumsum<-3>(duet::ones(duet::shape<3, 4>));
#else
  const auto y = duet::ops::cumsum<-2>(duet::ones(duet::shape<3, 4>));
#endif
  return y.numel() == 12 ? 0 : 1;
}
