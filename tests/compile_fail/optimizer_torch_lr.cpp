// PyTorch's spelling of the learning rate, {.lr = 1e-3}: without a field of that name the
// error was "no matching function" for the optimiser, 19 lines that never said which field.
// expect: the learning rate is .learning_rate
#include <duet/duet.hpp>

struct Regressor : duet::nn::Cell<Regressor> {
  duet::nn::Dense<4, 1> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Regressor net;
#ifdef DUET_COMPILE_FAIL
  duet::nn::Adam adam(net.parameters(), {.lr = 1e-3, .weight_decay = 0.01});
#else
  duet::nn::Adam adam(net.parameters(), {.learning_rate = 1e-3, .weight_decay = 0.01});
#endif
  return adam.learning_rate() > 0 ? 0 : 1;
}
