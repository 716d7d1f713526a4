// Noise shaped like a parameter (a noisy network's weight noise): a captured graph would draw
// it once more while capturing than PyNative mode does, so it is refused in either mode.
// expect: duet::ops::randn_like / rand_like of a parameter, or of a value of parameters alone
#include <duet/duet.hpp>

struct Noisy : duet::nn::Cell<Noisy> {
  duet::nn::Parameter sigma{duet::full({1, 4}, 0.1f)};
  DUET_CELL_MEMBERS(sigma);
  auto construct(auto x) {
#ifdef DUET_COMPILE_FAIL
    return x + sigma * duet::ops::randn_like(sigma);
#else
    return x + sigma * duet::ops::randn_like(x);
#endif
  }
};

int main() {
  Noisy net;
  const duet::Tensor y = net(duet::ones({2, 4}));
  return y.numel() == 8 ? 0 : 1;
}
