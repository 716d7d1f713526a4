// A construct written for Tensors only, in a cell that may run in graph mode (Cell<Net> follows
// the context; Cell<Net, duet::GRAPH_MODE> the same): capture calls it with symbolic tensors.
// expect: graph mode calls construct with symbolic tensors, so construct must be generic: auto construct\(auto x\)
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<4, 2> fc;
  DUET_CELL_MEMBERS(fc);

#ifdef DUET_COMPILE_FAIL
  duet::Tensor construct(const duet::Tensor& x) { return fc(x); }
#else
  auto construct(auto x) { return fc(x); }
#endif
};

int main() {
  duet::set_context({.mode = duet::GRAPH_MODE});
  Net net;
  return net(duet::ones({3, 4})).numel() == 6 ? 0 : 1;
}
