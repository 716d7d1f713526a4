// A user's own operation (a gate, a * sigmoid(b)) and layer (a learned per-feature scale) in a
// network trained in both modes: the same losses, bit for bit, and in graph mode the gate and
// the scale each run as one fused pass (see the graph printed first).
#include <cstdint>
#include <iostream>
#include <vector>

#include "custom_operation.hpp"

namespace {

struct GatedNet : duet::nn::Cell<GatedNet> {
  // The value and the gate as one product cut in two: two nn::Dense<8, 16> applied to x would
  // be two values of one type, which graph capture cannot tell apart (README, Guarantees).
  duet::nn::Dense<8, 32> value_and_gate;
  custom::Scale<16> scale;
  duet::nn::Dense<16, 3> head;
  DUET_CELL_MEMBERS(value_and_gate, scale, head);

  auto construct(auto x) {
    const auto [value, gate] = duet::ops::split<-1, 16, 16>(value_and_gate(x));
    return head(duet::ops::relu(scale(custom::gate(value, gate))));
  }
};

// Three noisy prototypes to tell apart.
struct Problem {
  duet::Tensor x = duet::randn({96, 8}, 11);
  duet::BasicTensor<std::int32_t> y{duet::Shape{96}};
  Problem() {
    const duet::Tensor prototypes = duet::randn({3, 8}, 12);
    for (duet::index_t i = 0; i < 96; ++i) {
      y(i) = static_cast<std::int32_t>(i % 3);
      for (duet::index_t j = 0; j < 8; ++j) x(i, j) = 0.5f * x(i, j) + prototypes(i % 3, j);
    }
  }
};

std::vector<float> train(duet::Mode mode, const Problem& data) {
  duet::set_context({.mode = mode});
  duet::set_seed(7);
  GatedNet net;
  duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  duet::nn::Adam adam(net.parameters(), {.learning_rate = 0.01});
  duet::nn::TrainOneStepCell step(with_loss, adam);
  std::vector<float> losses;
  for (int s = 0; s < 60; ++s) losses.push_back(step(data.x, data.y).item());
  return losses;
}

}  // namespace

int main() {
  GatedNet net;
  std::cout << duet::graph_ir(net, duet::shape<duet::dyn, 8>).optimized.text << '\n';

  const Problem data;
  const auto pynative = train(duet::PYNATIVE_MODE, data);
  const auto graph = train(duet::GRAPH_MODE, data);
  for (std::size_t s = 0; s < pynative.size(); s += 20) {
    std::cout << "step " << s << ": loss " << pynative[s] << " (PyNative), " << graph[s] << " (graph)\n";
  }
  std::cout << "final loss " << pynative.back() << ", modes identical: " << (pynative == graph ? "yes" : "no") << '\n';
  return pynative == graph && pynative.back() < 0.5f * pynative.front() ? 0 : 1;
}
