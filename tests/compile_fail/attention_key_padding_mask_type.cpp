// A key padding mask of int32 (token ids, or lengths): the message names the two types the
// layer takes, rather than the mask operation's kernel reading int32 as UInt8.
// expect: attn\(x, key_padding_mask\) takes a UInt8 mask
#include <cstdint>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::MultiheadAttention<8, 2> attn;
  DUET_CELL_MEMBERS(attn);
#ifdef DUET_COMPILE_FAIL
  auto construct(auto x, auto ids) { return attn(x, ids); }
#else
  auto construct(auto x, auto ids) { return attn(x, duet::ops::equal(ids, 0)); }
#endif
};

int main() {
  Net net;
  const duet::BasicTensor<std::int32_t> ids({1, 3}, {4, 7, 0});
  const duet::Tensor y = net(duet::ones({1, 3, 8}), ids);
  return y.numel() == 24 ? 0 : 1;
}
