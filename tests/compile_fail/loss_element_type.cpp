// nn::CrossEntropyLoss (float) with a network of double: a std::function's "no match for call"
// inside WithLossCell (helper-84). The twin names the loss's type.
// expect: the loss's element type is not the network's
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::CONTEXT_MODE, double> {
  duet::nn::Dense<4, 3, double> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Net net;
#ifdef DUET_COMPILE_FAIL
  duet::nn::CrossEntropyLoss<> loss;
#else
  duet::nn::BasicCrossEntropyLoss<duet::Reduction::mean, double> loss;
#endif
  duet::nn::WithLossCell with_loss(net, loss);
  return with_loss(duet::zeros<double>({2, 4}), duet::BasicTensor<std::int32_t>({2})).numel() == 1 ? 0 : 1;
}
