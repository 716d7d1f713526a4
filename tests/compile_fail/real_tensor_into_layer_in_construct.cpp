// A PyTorch habit, z = torch.randn(B, 16) inside the loss: the noise is a real tensor inside a
// captured construct, so a layer given it and a symbolic tensor would read it once, while
// capturing. Said once by the cell called, not as 300 lines of overloads that do not match.
// expect: duet::nn::Cell: called with a symbolic tensor .graph capture. and a real one
#include <duet/duet.hpp>

struct Generator : duet::nn::Cell<Generator> {
  duet::nn::Dense<16, 2> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto z) { return fc(z); }
};

struct GeneratorLoss : duet::nn::Cell<GeneratorLoss> {
  Generator g;
  duet::nn::MSELoss<> mse;
  DUET_CELL_MEMBERS(g, mse);
#ifdef DUET_COMPILE_FAIL
  auto construct(auto target) { return mse(g(duet::randn({8, 16})), target); }
#else
  auto construct(auto z, auto target) { return mse(g(z), target); }
#endif
};

int main() {
  GeneratorLoss loss;
  duet::nn::Adam adam(loss.parameters());
  duet::nn::TrainOneStepCell step(loss, adam);
#ifdef DUET_COMPILE_FAIL
  const duet::Tensor l = step(duet::zeros({8, 2}));
#else
  const duet::Tensor l = step(duet::randn({8, 16}), duet::zeros({8, 2}));
#endif
  return l.numel() == 1 ? 0 : 1;
}
