// nn::AdamW (float) over a network of double: "no matching function" for the optimiser, with
// its candidates, and no word of nn::BasicAdam<double, true> (helper-84). The twin names it.
// expect: the optimiser's element type is not the parameters'
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::CONTEXT_MODE, double> {
  duet::nn::Dense<4, 3, double> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Net net;
#ifdef DUET_COMPILE_FAIL
  duet::nn::AdamW adamw(net.parameters(), {.learning_rate = 1e-2});
#else
  duet::nn::BasicAdam<double, true> adamw(net.parameters(), {.learning_rate = 1e-2});
#endif
  return adamw.learning_rate() > 0 ? 0 : 1;
}
