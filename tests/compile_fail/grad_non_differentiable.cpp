// A gradient in graph mode that must flow through a host callback, which has none.
// expect: operation_is_differentiable<duet::ops::HostOp<float, false> ?>
#include <duet/duet.hpp>

int main() {
  duet::set_context({.mode = duet::GRAPH_MODE});
  duet::nn::Dense<3, 3> dense;
#ifdef DUET_COMPILE_FAIL
  auto f = [&](auto x) { return dense(duet::host([](const duet::Tensor& t) { return t; }, dense(x))); };
#else
  auto f = [&](auto x) { return dense(dense(x)); };
#endif
  const duet::Tensor dx = duet::grad(f)(duet::ones({1, 3}));
  return dx.numel() == 3 ? 0 : 1;
}
