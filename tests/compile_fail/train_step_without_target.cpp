// A training step called with the input alone: the loss cell's construct takes the input and
// the target, and the step passes on what it is given.
// expect: construct does not take the tensors this cell is called with
#include <duet/duet.hpp>

struct Regressor : duet::nn::Cell<Regressor> {
  duet::nn::Dense<4, 1> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Regressor net;
  duet::nn::MSELoss<> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  duet::nn::Adam adam(net.parameters());
  duet::nn::TrainOneStepCell step(with_loss, adam);
#ifdef DUET_COMPILE_FAIL
  const duet::Tensor l = step(duet::ones({8, 4}));
#else
  const duet::Tensor l = step(duet::ones({8, 4}), duet::zeros({8, 1}));
#endif
  return l.numel() == 1 ? 0 : 1;
}
