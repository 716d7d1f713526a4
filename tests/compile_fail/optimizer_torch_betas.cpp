// PyTorch's betas=(0.5, 0.999), written .betas = {0.5, 0.999}: MindSpore's Adam, whose names
// duet takes, has two fields.
// expect: betas=.b1, b2. are two fields
#include <duet/duet.hpp>

struct Regressor : duet::nn::Cell<Regressor> {
  duet::nn::Dense<4, 1> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Regressor net;
  duet::nn::SGD head(net.parameters(), {.learning_rate = 0.1, .momentum = 0.9});
#ifdef DUET_COMPILE_FAIL
  duet::nn::Adam adam({{.params = net.parameters(), .lr = 1e-4}}, {.learning_rate = 1e-3, .betas = {0.5, 0.999}});
#else
  duet::nn::Adam adam({{.params = net.parameters(), .learning_rate = 1e-4}}, {.learning_rate = 1e-3, .beta1 = 0.5, .beta2 = 0.999});
#endif
  return adam.learning_rate() > 0 && head.learning_rate() > 0 ? 0 : 1;
}
