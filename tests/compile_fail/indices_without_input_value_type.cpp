// A network that begins with an nn::Embedding, called with int32 indices, without saying that
// its input holds them: one message naming the declaration, not each overload's reasons. The
// twin declares it.
// expect: called with a tensor of another element type than the cell's own
#include <duet/duet.hpp>

struct Tokens : duet::nn::Cell<Tokens> {
#ifndef DUET_COMPILE_FAIL
  using input_value_type = std::int32_t;
#endif
  duet::nn::Embedding<10, 4> embed;
  duet::nn::Dense<4, 3> head;
  DUET_CELL_MEMBERS(embed, head);

  auto construct(auto ids) { return head(embed(ids)); }
};

int main() {
  Tokens net;
  return net(duet::BasicTensor<std::int32_t>({2, 5})).numel() == 30 ? 0 : 1;
}
