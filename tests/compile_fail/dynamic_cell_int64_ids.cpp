// PyTorch's token ids are int64 (torch.long); a network built at run time given them says, as a
// static cell does, what it takes. The twin's ids are int32.
// expect: duet::nn::DynamicCell: called with a tensor of another element type than the cell's own
#include <duet/duet.hpp>

int main() {
  duet::nn::DynamicSequentialCell net;
  net.append(duet::nn::Embedding<>(10, 4));
  net.append(duet::nn::Dense<>(4, 3));
#ifdef DUET_COMPILE_FAIL
  const duet::BasicTensor<std::int64_t> ids({2, 3}, {1, 2, 3, 4, 5, 6});
#else
  const duet::BasicTensor<std::int32_t> ids({2, 3}, {1, 2, 3, 4, 5, 6});
#endif
  return net(ids).numel() == 18 ? 0 : 1;
}
