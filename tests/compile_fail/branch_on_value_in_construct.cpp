// A branch on a value in a network's construct, each way returning another layer's output: the
// two returns also differ in type, and the message about the value must come first. The twin
// computes both ways with graph operations and picks with ops::where.
// expect: a tensor's value does not exist while a graph is captured
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<16, 4> fc1;
  duet::nn::ReLU relu;
  DUET_CELL_MEMBERS(fc1, relu);

  auto construct(auto x) {
    auto h = fc1(x);
#ifdef DUET_COMPILE_FAIL
    if (duet::ops::mean(h).item() > 0) return relu(h);
    return h;
#else
    return duet::ops::where(duet::ops::greater(duet::ops::mean(h), 0.f), relu(h), h);
#endif
  }
};

int main() {
  duet::set_context({.mode = duet::GRAPH_MODE});
  Net net;
  return net(duet::ones({2, 16})).numel() == 8 ? 0 : 1;
}
