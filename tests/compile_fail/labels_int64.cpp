// PyTorch's class indices are int64 (torch.long); a port that keeps them gets one message
// saying what duet takes. The twin's labels are int32.
// expect: nn::CrossEntropyLoss takes labels of int32 class indices
#include <duet/duet.hpp>

int main() {
  duet::nn::CrossEntropyLoss<> loss;
  const duet::Tensor logits = duet::zeros({4, 10});
#ifdef DUET_COMPILE_FAIL
  const duet::BasicTensor<std::int64_t> labels({4}, {1, 2, 3, 4});
#else
  const duet::BasicTensor<std::int32_t> labels({4}, {1, 2, 3, 4});
#endif
  return loss(logits, labels).numel() == 1 ? 0 : 1;
}
