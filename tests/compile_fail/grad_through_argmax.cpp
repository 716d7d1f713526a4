// A gradient of argmax's output: it is int32, and nothing integer has a gradient (without the
// check, the gradient would be zeros in int32, in silence).
// expect: gradients exist only for floating-point values
#include <duet/duet.hpp>

int main() {
  auto f = [](auto x) {
#ifdef DUET_COMPILE_FAIL
    return duet::ops::argmax(x);
#else
    return duet::ops::max(x, duet::ops::axes<-1>);
#endif
  };
  const duet::Tensor x({2, 3}, {1, 5, 2, 7, 0, 3});
  const auto dx = duet::grad(f)(x);
  return dx.numel() == 6 ? 0 : 1;
}
