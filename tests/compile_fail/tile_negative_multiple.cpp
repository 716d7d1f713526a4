// A negative multiple: the assertion names the operation and what it needs.
// expect: duet::ops::tile: the multiples must be >= 0
#include <duet/duet.hpp>

int main() {
#ifdef DUET_COMPILE_FAIL
  const auto y = duet::ops::tile<2, -1>(duet::ones(duet::shape<2, 3>));
#else
  const auto y = duet::ops::tile<2, 1>(duet::ones(duet::shape<2, 3>));
#endif
  return y.numel() == 12 ? 0 : 1;
}
