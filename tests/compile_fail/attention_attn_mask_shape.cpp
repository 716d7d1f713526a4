// An attn_mask whose static shape is not the input's [length, length], in a graph-mode network:
// one error naming the attention layer, the input's shape the mask must follow and the mask's
// shape.
// expect: layer_accepts<duet::nn::MultiheadAttention<16, 2[^>]*>, duet::diagnostic::attn_mask_must_be_length_by_length_of_input<duet::diagnostic::input_shape<2, 4, 16> ?>, duet::diagnostic::input_shape<4, 5> ?>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net, duet::GRAPH_MODE> {
  duet::nn::MultiheadAttention<16, 2> attn;
  DUET_CELL_MEMBERS(attn);
  auto construct(auto x, auto mask) { return attn(x, duet::nn::attn_mask(mask)); }
};

int main() {
  Net net;
#ifdef DUET_COMPILE_FAIL
  const auto mask = duet::zeros(duet::shape<4, 5>);
#else
  const auto mask = duet::zeros(duet::shape<4, 4>);
#endif
  const duet::Tensor y = net(duet::ones(duet::shape<2, 4, 16>), mask);
  return y.numel() == 128 ? 0 : 1;
}
