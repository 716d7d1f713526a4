// One sequence [length, E] without its batch axis, static, in a graph-mode network: one error,
// naming the attention layer, the [batch, length, E] it takes and the input's shape (not the
// transpose inside it).
// expect: layer_accepts<duet::nn::MultiheadAttention<16, 2[^>]*>, duet::diagnostic::input_must_be_batch_first_sequences_batch_length_by<16>, duet::diagnostic::input_shape<4, 16> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  duet::nn::MultiheadAttention<16, 2> attn;
  DUET_CELL_MEMBERS(attn);
  auto construct(auto x) { return attn(x); }
};

int main() {
  Net net;
#ifdef DUET_COMPILE_FAIL
  const duet::Tensor y = net(duet::ones(duet::shape<4, 16>));
#else
  const duet::Tensor y = net(duet::ones(duet::shape<1, 4, 16>));
#endif
  return y.numel() == 64 ? 0 : 1;
}
