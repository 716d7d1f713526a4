// Class labels as floats (a PyTorch habit is int64, a numpy one float) given to a sparse
// softmax cross-entropy in a training step, which compiles the loss for PyNative, for its
// graph capture and for its trace: the assertion was printed once per form, four times
// (helper-80, 66 lines); now once.
// expect: sparse labels must be int32 class indices
#include <duet/duet.hpp>

struct Classifier : duet::nn::Cell<Classifier> {
  duet::nn::Dense<4, 3> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

int main() {
  Classifier net;
  duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  duet::nn::Adam adam(net.parameters());
  duet::nn::TrainOneStepCell step(with_loss, adam);
#ifdef DUET_COMPILE_FAIL
  const duet::Tensor labels = duet::zeros({8});
#else
  const duet::BasicTensor<std::int32_t> labels = duet::zeros<std::int32_t>({8});
#endif
  return step(duet::ones({8, 4}), labels).item() > 0 ? 0 : 1;
}
