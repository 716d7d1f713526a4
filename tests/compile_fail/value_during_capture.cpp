// A branch on a tensor's value inside a graph: the value does not exist at capture.
// expect: a tensor's value does not exist while a graph is captured
#include <duet/duet.hpp>

int main() {
  auto f = duet::jit([](auto x) {
#ifdef DUET_COMPILE_FAIL
    if (x.item() > 0) return duet::ops::relu(x);
#endif
    return duet::ops::relu(x);
  });
  return f(duet::ones({1})).numel() == 1 ? 0 : 1;
}
