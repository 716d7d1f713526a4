// An MLP of residual blocks (x + f(x), f pre-normalised with LayerNorm, GELU between its two
// Dense layers), trained on Fashion-MNIST with the seed's recipe (Adam 1e-3, batch 64) in
// PyNative mode and then in graph mode from the same seed: the two print the same losses, bit
// for bit, and reach the seed MLP's test accuracy.
//
//   residual_mlp [--epochs 5] [--mode both|graph|pynative] [--data /usr/share/datasets/fashion-mnist]
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <duet/duet.hpp>

namespace {

using namespace duet;

constexpr index_t width = 256;

struct ResidualBlock : nn::Cell<ResidualBlock> {
  nn::LayerNorm<width> norm;
  nn::Dense<width, width> fc1;
  nn::GELU gelu;
  nn::Dense<width, width> fc2;
  DUET_CELL_MEMBERS(norm, fc1, gelu, fc2);

  auto construct(auto x) { return x + fc2(gelu(fc1(norm(x)))); }
};

struct ResidualMLP : nn::Cell<ResidualMLP> {
  nn::Flatten flatten;
  nn::Dense<784, width> stem;
  ResidualBlock block1;
  ResidualBlock block2;
  nn::LayerNorm<width> norm;
  nn::Dense<width, 10> head;
  DUET_CELL_MEMBERS(flatten, stem, block1, block2, norm, head);

  auto construct(auto x) { return head(norm(block2(block1(stem(flatten(x)))))); }
};

struct Epoch {
  double train_loss;
  double test_loss;
  double test_accuracy;
};

std::vector<Epoch> fit(Mode mode, int epochs, const std::string& dir) {
  set_context({.mode = mode});
  set_seed(1);
  ResidualMLP net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 1e-3});
  nn::TrainOneStepCell step(with_loss, adam);
  data::DataLoader train_data(data::load_fashion_mnist(dir, data::Split::train), 64, {.shuffle = true, .seed = 1});
  data::DataLoader test_data(data::load_fashion_mnist(dir, data::Split::test), 1000);
  std::vector<Epoch> out;
  for (int e = 1; e <= epochs; ++e) {
    double sum = 0;
    index_t seen = 0;
    for (const data::Batch& batch : train_data) {
      sum += static_cast<double>(step(batch.images, batch.labels).item()) * static_cast<double>(batch.labels.numel());
      seen += batch.labels.numel();
    }
    const train::Metrics test = train::evaluate(net, loss, test_data);
    out.push_back({sum / static_cast<double>(seen), test.loss, test.accuracy});
    std::printf("%s epoch %d: train loss %.9f  test loss %.9f  test accuracy %.4f\n",
                mode == GRAPH_MODE ? "graph   " : "pynative", e, out.back().train_loss, test.loss, test.accuracy);
    std::fflush(stdout);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 5;
  std::string mode = "both";
  std::string dir = data::fashion_mnist_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--epochs") epochs = std::atoi(argv[i + 1]);
    else if (flag == "--mode") mode = argv[i + 1];
    else if (flag == "--data") dir = argv[i + 1];
    else {
      std::cerr << "usage: residual_mlp [--epochs N] [--mode both|graph|pynative] [--data DIR]\n";
      return 2;
    }
  }
  try {
    std::vector<Epoch> pynative, graph;
    if (mode != "graph") pynative = fit(PYNATIVE_MODE, epochs, dir);
    if (mode != "pynative") graph = fit(GRAPH_MODE, epochs, dir);
    if (mode == "both") {
      bool same = pynative.size() == graph.size();
      for (std::size_t e = 0; same && e < pynative.size(); ++e) {
        same = pynative[e].train_loss == graph[e].train_loss && pynative[e].test_loss == graph[e].test_loss;
      }
      std::printf("modes identical: %s\n", same ? "yes" : "no");
      if (!same) return 1;
    }
  } catch (const Error& e) {
    std::cerr << "residual_mlp: " << e.what() << '\n';
    return 1;
  }
}
