// A cell whose construct takes two tensors, called with one (helper-75: the noise of a
// variational autoencoder forgotten): the message says to call it with all of them.
// expect: one whose construct takes several \(a network with its loss, a sampler with its noise\) is called with all of them
#include <duet/duet.hpp>

struct Sampler : duet::nn::Cell<Sampler> {
  duet::nn::Dense<4, 2> dense;
  DUET_CELL_MEMBERS(dense);
  auto construct(auto x, auto noise) { return dense(x) + noise; }
};

int main() {
  Sampler sampler;
  const auto x = duet::ones({1, 4});
#ifdef DUET_COMPILE_FAIL
  const duet::Tensor y = sampler(x);
#else
  const duet::Tensor y = sampler(x, duet::zeros({1, 2}));
#endif
  return y.numel() == 2 ? 0 : 1;
}
