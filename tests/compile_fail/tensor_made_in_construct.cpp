// A tensor made in construct from nothing the graph reads (a constant of the capture, not of
// each call) next to a symbolic tensor. The twin makes it a parameter of the cell, which the
// graph reads when it runs, and an operation on parameters alone, which capture makes again.
// expect: a tensor made from anything else in construct
#include <duet/duet.hpp>

struct Scaled : duet::nn::Cell<Scaled> {
  duet::nn::Dense<4, 2> fc;
  duet::nn::Parameter log_scale{duet::zeros({1})};
  DUET_CELL_MEMBERS(fc, log_scale);

  auto construct(auto x) {
#ifdef DUET_COMPILE_FAIL
    return fc(x) * duet::ops::exp(duet::zeros({1}));
#else
    return fc(x) * duet::ops::exp(log_scale);
#endif
  }
};

int main() {
  Scaled net;
  return net(duet::ones({3, 4})).numel() == 6 ? 0 : 1;
}
