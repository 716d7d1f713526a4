// The libtorch reference for the Fashion-MNIST examples (the seed network of
// examples/train_fashion_mnist.cpp, examples/lenet5.cpp and examples/resnet_fashion.cpp): the
// same networks and recipe (Adam 1e-3, batch 64, softmax cross-entropy, Dropout 0.2 and
// BatchNorm with PyTorch's momentum 0.1, which is MindSpore's and duet's 0.9) in libtorch eager
// mode on --threads threads (1 unless given). The batches come from duet's DataLoader with the
// examples' shuffle seed, so both libraries see the same images in the same order; the weights
// are libtorch's own draws from --seed.
//
//   torch_fashion [--net seed|lenet5|resnet] [--epochs 5] [--seed 1] [--threads 1] [--data DIR]
//
// Prints per epoch the training loss, the test loss and accuracy, and the processor and wall
// time of the epoch's training (the test pass excluded), to set against the duet example's
// epoch: processor time on one thread, since wall time on a shared machine measures the other
// jobs; wall time with several threads, whose processor times add up.
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include <duet/duet.hpp>

#include "torch_nets.hpp"

namespace {

torch::Tensor images_of(const duet::data::Batch& batch) {
  const duet::Shape& s = batch.images.shape();
  return torch::from_blob(const_cast<float*>(batch.images.data()), {s[0], s[1], s[2], s[3]}, torch::kFloat32);
}

torch::Tensor labels_of(const duet::data::Batch& batch) {
  return torch::from_blob(const_cast<std::int32_t*>(batch.labels.data()), {batch.labels.numel()}, torch::kInt32)
      .to(torch::kInt64);
}

template <class Net>
void fit(Net net, int epochs, const std::string& dir, const char* name) {
  duet::data::DataLoader train_data(duet::data::load_fashion_mnist(dir, duet::data::Split::train), 64,
                                    {.shuffle = true, .seed = 1});
  duet::data::DataLoader test_data(duet::data::load_fashion_mnist(dir, duet::data::Split::test), 1000);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  for (int e = 1; e <= epochs; ++e) {
    net->train();
    double sum = 0;
    int64_t seen = 0;
    const std::clock_t start = std::clock();
    const auto wall_start = std::chrono::steady_clock::now();
    for (const duet::data::Batch& batch : train_data) {
      adam.zero_grad();
      torch::Tensor loss = torch::cross_entropy_loss(net->forward(images_of(batch)), labels_of(batch));
      loss.backward();
      adam.step();
      sum += loss.item<double>() * static_cast<double>(batch.labels.numel());
      seen += batch.labels.numel();
    }
    const double seconds = static_cast<double>(std::clock() - start) / CLOCKS_PER_SEC;
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
    net->eval();
    torch::NoGradGuard no_grad;
    double test_loss = 0;
    int64_t correct = 0, total = 0;
    for (const duet::data::Batch& batch : test_data) {
      torch::Tensor logits = net->forward(images_of(batch));
      torch::Tensor labels = labels_of(batch);
      test_loss += torch::cross_entropy_loss(logits, labels, {}, at::Reduction::Sum).item<double>();
      correct += logits.argmax(1).eq(labels).sum().item<int64_t>();
      total += labels.numel();
    }
    std::printf("libtorch %s epoch %d: train loss %.6f  test loss %.6f  test accuracy %.4f  epoch %.2f s cpu, %.2f s "
                "wall\n",
                name, e, sum / static_cast<double>(seen), test_loss / static_cast<double>(total),
                static_cast<double>(correct) / static_cast<double>(total), seconds, wall);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string net = "lenet5";
  int epochs = 5;
  uint64_t seed = 1;
  int threads = 1;
  std::string dir = duet::data::fashion_mnist_dir;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 < argc && flag == "--net") net = argv[i + 1];
    else if (i + 1 < argc && flag == "--epochs") epochs = std::atoi(argv[i + 1]);
    else if (i + 1 < argc && flag == "--seed") seed = std::strtoull(argv[i + 1], nullptr, 10);
    else if (i + 1 < argc && flag == "--threads") threads = std::atoi(argv[i + 1]);
    else if (i + 1 < argc && flag == "--data") dir = argv[i + 1];
    else {
      std::cerr << "usage: torch_fashion [--net seed|lenet5|resnet] [--epochs N] [--seed S] [--threads T] [--data DIR]\n";
      return 2;
    }
  }
  if (threads < 1) {
    std::cerr << "torch_fashion: --threads must be at least 1\n";
    return 2;
  }
  at::set_num_threads(threads);
  torch::manual_seed(seed);
  try {
    if (net == "seed") fit(torch_nets::Seed(), epochs, dir, "seed");
    else if (net == "lenet5") fit(torch_nets::LeNet5(), epochs, dir, "lenet5");
    else if (net == "resnet") fit(torch_nets::ResNet(), epochs, dir, "resnet");
    else {
      std::cerr << "torch_fashion: --net is seed, lenet5 or resnet, got '" << net << "'\n";
      return 2;
    }
  } catch (const duet::Error& e) {
    std::cerr << "torch_fashion: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
