// PyTorch's attn(x, x, x) on nn::MultiheadAttention, which is self-attention: the message says
// to call attn(x), rather than that construct does not take the tensors.
// expect: nn::MultiheadAttention is self-attention: call attn
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::MultiheadAttention<8, 2, true> attn;
  DUET_CELL_MEMBERS(attn);
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x) { return attn(x, x, x); }
#else
  auto construct(auto x) { return attn(x); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones({1, 3, 8}));
  return y.numel() == 24 ? 0 : 1;
}
