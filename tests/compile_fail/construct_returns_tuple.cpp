// PyTorch's `return out, mu, logvar`: construct returning a tuple. Said once, where the cell's
// call is compiled, rather than as "no type named value_type" from the capture and the trace.
// expect: construct must return one tensor; for several results
#include <duet/duet.hpp>

struct Encoder : duet::nn::Cell<Encoder> {
  duet::nn::Dense<8, 4> fc;
  DUET_CELL_MEMBERS(fc);

  auto construct(auto x) {
    auto [mu, logvar] = duet::ops::split<-1, 2, 2>(fc(x));
#ifdef DUET_COMPILE_FAIL
    return std::make_tuple(mu, logvar);
#else
    return duet::ops::concat<-1>(mu, logvar);
#endif
  }
};

int main() {
  Encoder net;
  return net(duet::ones({2, 8})).numel() == 8 ? 0 : 1;
}
