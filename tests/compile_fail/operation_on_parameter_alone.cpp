// An operation on a cell's parameter alone in construct (a learnable temperature): it runs at
// once and gives a real tensor, which the captured graph cannot read. The twin multiplies by
// the parameter itself, which the graph reads as a node.
// expect: an operation on a cell's parameters alone
#include <duet/duet.hpp>

struct Scaled : duet::nn::Cell<Scaled> {
  duet::nn::Dense<4, 2> fc;
  duet::nn::Parameter log_scale{duet::zeros({1})};
  DUET_CELL_MEMBERS(fc, log_scale);

  auto construct(auto x) {
#ifdef DUET_COMPILE_FAIL
    return fc(x) * duet::ops::exp(log_scale);
#else
    return fc(x) * log_scale;
#endif
  }
};

int main() {
  Scaled net;
  return net(duet::ones({3, 4})).numel() == 6 ? 0 : 1;
}
