// The same training steps built twice by the consumer project: header-only, and with the
// kernels from duet::kernels (duet/precompiled_kernels.hpp). run.cmake compares their outputs,
// which print every bit: the two builds must compute the same numbers. The layers are large
// enough to take the blocked product, the narrow product and the GEMV.
#include <cstdint>
#include <cstdio>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::SequentialCell<duet::nn::Dense<64, 48>, duet::nn::ReLU, duet::nn::Dense<48, 32>, duet::nn::GELU,
                           duet::nn::Dense<32, 10>>
      layers;
  DUET_CELL_MEMBERS(layers);
  auto construct(auto x) { return layers(x); }
};

int main() {
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::set_seed(3);
    Net net;
    duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
    duet::nn::WithLossCell with_loss(net, loss);
    duet::nn::Adam optimizer(net.parameters(), {.learning_rate = 1e-2});
    duet::nn::TrainOneStepCell step(with_loss, optimizer);
    const duet::Tensor x = duet::uniform({16, 64}, -1.0f, 1.0f, 7);
    duet::BasicTensor<std::int32_t> labels({16});
    for (duet::index_t i = 0; i < 16; ++i) labels(i) = static_cast<std::int32_t>(i % 10);
    for (int i = 0; i < 3; ++i) std::printf("loss %a\n", static_cast<double>(step(x, labels).item()));
    const duet::Tensor one = net(duet::uniform({1, 64}, -1.0f, 1.0f, 9));
    for (duet::index_t i = 0; i < one.numel(); ++i) std::printf("%a ", static_cast<double>(one.data()[i]));
    std::printf("\n");
  }
  return 0;
}
