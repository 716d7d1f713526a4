// An attn_mask made in construct from a real tensor while the input is captured: it would be
// read once, when capturing. One error, in the attention's words.
// expect: attn\(x, masks\) takes its input and masks all captured
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::MultiheadAttention<8, 2> attn;
  DUET_CELL_MEMBERS(attn);
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x, auto) { return attn(x, duet::nn::attn_mask(duet::zeros({4, 4}))); }
#else
  auto construct(auto x, auto mask) { return attn(x, duet::nn::attn_mask(mask)); }
#endif
};

int main() {
  Net net;
  const duet::Tensor y = net(duet::ones({2, 4, 8}), duet::zeros({4, 4}));
  return y.numel() == 64 ? 0 : 1;
}
