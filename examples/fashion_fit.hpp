// The recipe the Fashion-MNIST examples share (Adam 1e-3, batch 64, shuffled with seed 1,
// softmax cross-entropy), run in PyNative mode and then in graph mode from the same seed, so
// that a network's two modes can be compared epoch by epoch:
//
//   NAME [--epochs 5 | --steps N] [--mode both|graph|pynative] [--data /usr/share/datasets/fashion-mnist]
//
// Each epoch prints the processor time of its training steps (wall time on a shared machine
// measures the other jobs). With --mode both (the default) it prints whether the losses are the same bit for bit, and
// fails when they are not; --steps N compares the losses of the first N steps instead of
// whole epochs.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <ctime>
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

// The context and the seed, set before anything of the recipe draws from them.
struct Seeded {
  explicit Seeded(duet::Mode mode) : mode(mode) {
    duet::set_context({.mode = mode});
    duet::set_seed(1);
  }
  const char* name() const { return mode == duet::GRAPH_MODE ? "graph   " : "pynative"; }
  duet::Mode mode;
};

// Net with the recipe's loss, optimiser and data, made in `mode` from seed 1.
template <class Net>
struct Recipe {
  using Loss = duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean>;

  Recipe(duet::Mode mode, const std::string& dir)
      : seeded(mode),
        train_data(duet::data::load_fashion_mnist(dir, duet::data::Split::train), 64, {.shuffle = true, .seed = 1}),
        test_data(duet::data::load_fashion_mnist(dir, duet::data::Split::test), 1000) {}

  // One training step on `batch`: its mean loss, before the update.
  float step(const duet::data::Batch& batch) { return train_step(batch.images, batch.labels).item(); }

  Seeded seeded;
  Net net;
  Loss loss;
  duet::nn::WithLossCell<Net, Loss> with_loss{net, loss};
  duet::nn::Adam adam{net.parameters(), {.learning_rate = 1e-3}};
  duet::nn::TrainOneStepCell<duet::nn::WithLossCell<Net, Loss>, duet::nn::Adam> train_step{with_loss, adam};
  duet::data::DataLoader train_data;
  duet::data::DataLoader test_data;
};

template <class Net>
std::vector<Epoch> fit(duet::Mode mode, int epochs, const std::string& dir) {
  Recipe<Net> recipe(mode, dir);
  std::vector<Epoch> out;
  for (int e = 1; e <= epochs; ++e) {
    double sum = 0;
    duet::index_t seen = 0;
    const std::clock_t start = std::clock();
    for (const duet::data::Batch& batch : recipe.train_data) {
      sum += static_cast<double>(recipe.step(batch)) * static_cast<double>(batch.labels.numel());
      seen += batch.labels.numel();
    }
    const double seconds = static_cast<double>(std::clock() - start) / CLOCKS_PER_SEC;
    const duet::train::Metrics test = duet::train::evaluate(recipe.net, recipe.loss, recipe.test_data);
    out.push_back({sum / static_cast<double>(seen), test.loss, test.accuracy});
    std::printf("%s epoch %d: train loss %.9f  test loss %.9f  test accuracy %.4f  epoch %.1f s cpu\n",
                recipe.seeded.name(), e, out.back().train_loss, test.loss, test.accuracy, seconds);
    std::fflush(stdout);
  }
  return out;
}

// The losses of the first `steps` training steps (every 20th printed), for comparing the
// modes without training whole epochs.
template <class Net>
std::vector<float> first_steps(duet::Mode mode, int steps, const std::string& dir) {
  Recipe<Net> recipe(mode, dir);
  std::vector<float> out;
  while (static_cast<int>(out.size()) < steps) {
    for (const duet::data::Batch& batch : recipe.train_data) {
      out.push_back(recipe.step(batch));
      const int done = static_cast<int>(out.size());
      if (done % 20 == 0 || done == steps) std::printf("%s step %d: loss %.9f\n", recipe.seeded.name(), done, out.back());
      if (done == steps) break;
    }
  }
  std::fflush(stdout);
  return out;
}

// Whether each mode's run gave the same numbers, bit for bit; prints the verdict.
template <class Run, class Same>
bool modes_identical(const Run& pynative, const Run& graph, Same same_entry) {
  bool same = pynative.size() == graph.size();
  for (std::size_t i = 0; same && i < pynative.size(); ++i) same = same_entry(pynative[i], graph[i]);
  std::printf("modes identical: %s\n", same ? "yes" : "no");
  return same;
}

// The examples' main: parses the flags, trains Net in the modes asked for, compares them.
// --steps N trains N steps instead of whole epochs and compares their losses.
template <class Net>
int run(int argc, char** argv, const char* name) {
  int epochs = 5;
  int steps = 0;
  std::string mode = "both";
  std::string dir = duet::data::fashion_mnist_dir;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 < argc && flag == "--epochs") epochs = std::atoi(argv[i + 1]);
    else if (i + 1 < argc && flag == "--steps") steps = std::atoi(argv[i + 1]);
    else if (i + 1 < argc && flag == "--mode") mode = argv[i + 1];
    else if (i + 1 < argc && flag == "--data") dir = argv[i + 1];
    else {
      std::cerr << "usage: " << name << " [--epochs N | --steps N] [--mode both|graph|pynative] [--data DIR]\n";
      return 2;
    }
  }
  try {
    if (steps > 0) {
      std::vector<float> pynative, graph;
      if (mode != "graph") pynative = first_steps<Net>(duet::PYNATIVE_MODE, steps, dir);
      duet::empty_cache();
      if (mode != "pynative") graph = first_steps<Net>(duet::GRAPH_MODE, steps, dir);
      if (mode == "both" && !modes_identical(pynative, graph, [](float p, float g) { return p == g; })) return 1;
      return 0;
    }
    std::vector<Epoch> pynative, graph;
    if (mode != "graph") pynative = fit<Net>(duet::PYNATIVE_MODE, epochs, dir);
    // The blocks PyNative's run released stay in the thread's cache (up to 256 MiB), and graph
    // mode's plan asks for other sizes: handed back, they do not add to graph mode's peak
    // (lenet5 --epochs 1: 153 MiB peak RSS with them kept, README).
    duet::empty_cache();
    if (mode != "pynative") graph = fit<Net>(duet::GRAPH_MODE, epochs, dir);
    if (mode == "both" && !modes_identical(pynative, graph, [](const Epoch& p, const Epoch& g) {
          return p.train_loss == g.train_loss && p.test_loss == g.test_loss;
        })) {
      return 1;
    }
  } catch (const duet::Error& e) {
    std::cerr << name << ": " << e.what() << '\n';
    return 1;
  }
  return 0;
}

}  // namespace fashion
