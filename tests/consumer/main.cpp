#include <cmath>
#include <duet/duet.hpp>
#include <iostream>

struct Net : duet::nn::Cell<Net> {
  duet::nn::SequentialCell<duet::nn::Dense<4, 3>, duet::nn::ReLU, duet::nn::Dense<3, 2>> layers;
  DUET_CELL_MEMBERS(layers);
  auto construct(auto x) { return layers(x); }
};

int main() {
  Net net;
  const auto x = duet::ones({2, 4});
  const auto eager = net(x);
  duet::set_context({.mode = duet::GRAPH_MODE});
  const auto graph = net(x);
  for (duet::index_t i = 0; i < eager.numel(); ++i) {
    if (std::abs(eager.data()[i] - graph.data()[i]) > 1e-5f) return 1;
  }
  std::cout << graph << '\n';
  return 0;
}
