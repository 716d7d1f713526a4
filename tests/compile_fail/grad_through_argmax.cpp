// A gradient in graph mode that must flow through argmax, which has none (the function is of
// int32 tensors, so that differentiation reaches argmax's output).
// expect: operation_is_differentiable<duet::ops::ArgExtremeOp<true, -1, false, int> ?>
#include <duet/duet.hpp>

#include <cstdint>

int main() {
  duet::set_context({.mode = duet::GRAPH_MODE});
#ifdef DUET_COMPILE_FAIL
  auto f = [](auto x) { return duet::ops::argmax(x); };
#else
  auto f = [](auto x) { return duet::ops::max(x, duet::ops::axes<-1>); };
#endif
  const duet::BasicTensor<std::int32_t> x({2, 3}, {1, 5, 2, 7, 0, 3});
  const auto dx = duet::grad(f)(x);
  return dx.numel() == 6 ? 0 : 1;
}
