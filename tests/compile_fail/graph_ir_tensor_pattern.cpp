// graph_ir given a tensor where it takes an input shape written as a type.
// expect: duet::graph_ir\(net, pattern\): the pattern is an input shape written as a type
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<4, 3> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Net net;
#ifdef DUET_COMPILE_FAIL
  const auto ir = duet::graph_ir(net, duet::ones({2, 4}));
#else
  const auto ir = duet::graph_ir(net, duet::shape<duet::dyn, 4>);
#endif
  return ir.optimized.text.empty() ? 1 : 0;
}
