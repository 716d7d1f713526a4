// A generic function over a network built at run time runs on real tensors; one that mixes the
// network's output with its symbolic input is told to take `const duet::Tensor&` (the twin's).
// expect: calls a cell built at run time \(nn::DynamicSequentialCell\) takes .const duet::Tensor&., not .auto.
#include <duet/duet.hpp>

int main() {
  duet::nn::DynamicSequentialCell net;
  net.append(duet::nn::Dense<>(4, 4));
#ifdef DUET_COMPILE_FAIL
  auto gated = [&](auto x) { return duet::ops::sum(net(x) * x); };
#else
  auto gated = [&](const duet::Tensor& x) { return duet::ops::sum(net(x) * x); };
#endif
  auto step = duet::value_and_grad(gated, net.parameters());
  return step(duet::ones({2, 4})).grads.size() == 2 ? 0 : 1;
}
