// `x = layer(x);` inside construct, as a PyTorch forward is written: fine in PyNative, where
// every step is a Tensor, but each captured step is a symbolic tensor of its own type.
// expect: inside construct, each operation returns a new symbolic type while a graph is captured; write .auto y = layer\(x\);. \(a new name per step\)
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<4, 8> fc1;
  duet::nn::ReLU relu;
  duet::nn::Dense<8, 2> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);

#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) {
    x = fc1(x);
    x = relu(x);
    return fc2(x);
  }
#else
  auto construct(auto x) {
    auto hidden = fc1(x);
    auto activated = relu(hidden);
    return fc2(activated);
  }
#endif
};

int main() {
  duet::set_context({.mode = duet::GRAPH_MODE});
  Net net;
  return net(duet::ones({3, 4})).numel() == 6 ? 0 : 1;
}
