// A cell that forgot to define construct.
// expect: duet::nn::Cell: called with one tensor, but construct does not take one: a cell defines construct\(x\)
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<4, 2> dense;
  DUET_CELL_MEMBERS(dense);
#ifndef DUET_COMPILE_FAIL
  auto construct(auto x) { return dense(x); }
#endif
};

int main() {
  Net net;
  return net(duet::ones({1, 4})).numel() == 2 ? 0 : 1;
}
