// A float layer (nn::Dense<16, 3>, the default type) inside a network of double: the member's
// type was the third of three errors, a std::function's "no match for call" (helper-84). The
// twin gives the layer the network's type.
// expect: a member layer's element type is not the cell's
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::CONTEXT_MODE, double> {
  duet::nn::Dense<4, 16, double> fc1;
#ifdef DUET_COMPILE_FAIL
  duet::nn::Dense<16, 3> fc2;
#else
  duet::nn::Dense<16, 3, double> fc2;
#endif
  DUET_CELL_MEMBERS(fc1, fc2);
  auto construct(auto x) { return fc2(fc1(x)); }
};

int main() {
  Net net;
  return net(duet::zeros<double>({2, 4})).numel() == 6 ? 0 : 1;
}
