// train::evaluate given tensors where it needs batches of images and labels.
// expect: duet::train::evaluate: the loader must be a range of batches with .images
#include <duet/duet.hpp>
#include <vector>

struct Net : duet::nn::Cell<Net> {
  duet::nn::Dense<4, 3> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x); }
};

struct Batch {
  duet::Tensor images;
  duet::BasicTensor<std::int32_t> labels;
};

int main() {
  Net net;
  duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
#ifdef DUET_COMPILE_FAIL
  std::vector<duet::Tensor> loader{duet::ones({2, 4})};
#else
  std::vector<Batch> loader{{duet::ones({2, 4}), duet::BasicTensor<std::int32_t>(duet::Shape{2})}};
#endif
  return duet::train::evaluate(net, loss, loader).samples == 2 ? 0 : 1;
}
