// The recipe the Fashion-MNIST examples share (Adam 1e-3, batch 64, shuffled with seed 1,
// softmax cross-entropy), run in PyNative mode and then in graph mode from the same seed, so
// that a network's two modes can be compared epoch by epoch:
//
//   NAME [--epochs 5] [--mode both|graph|pynative] [--data /usr/share/datasets/fashion-mnist]
//
// With --mode both (the default) it prints whether the losses are the same bit for bit, and
// fails when they are not.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <duet/duet.hpp>

namespace fashion {

struct Epoch {
  double train_loss;
  double test_loss;
  double test_accuracy;
};

template <class Net>
std::vector<Epoch> fit(duet::Mode mode, int epochs, const std::string& dir) {
  using namespace duet;
  set_context({.mode = mode});
  set_seed(1);
  Net net;
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

// The examples' main: parses the flags, trains Net in the modes asked for, compares them.
template <class Net>
int run(int argc, char** argv, const char* name) {
  int epochs = 5;
  std::string mode = "both";
  std::string dir = duet::data::fashion_mnist_dir;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 < argc && flag == "--epochs") epochs = std::atoi(argv[i + 1]);
    else if (i + 1 < argc && flag == "--mode") mode = argv[i + 1];
    else if (i + 1 < argc && flag == "--data") dir = argv[i + 1];
    else {
      std::cerr << "usage: " << name << " [--epochs N] [--mode both|graph|pynative] [--data DIR]\n";
      return 2;
    }
  }
  try {
    std::vector<Epoch> pynative, graph;
    if (mode != "graph") pynative = fit<Net>(duet::PYNATIVE_MODE, epochs, dir);
    if (mode != "pynative") graph = fit<Net>(duet::GRAPH_MODE, epochs, dir);
    if (mode == "both") {
      bool same = pynative.size() == graph.size();
      for (std::size_t e = 0; same && e < pynative.size(); ++e) {
        same = pynative[e].train_loss == graph[e].train_loss && pynative[e].test_loss == graph[e].test_loss;
      }
      std::printf("modes identical: %s\n", same ? "yes" : "no");
      if (!same) return 1;
    }
  } catch (const duet::Error& e) {
    std::cerr << name << ": " << e.what() << '\n';
    return 1;
  }
  return 0;
}

}  // namespace fashion
