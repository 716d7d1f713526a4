// The main job: trains the seed network on Fashion-MNIST (Debian's dataset-fashion-mnist) in
// graph or PyNative mode, prints each epoch's train loss, test loss and accuracy and wall
// time, and saves a checkpoint with the optimiser's state. --resume PATH continues from such
// a checkpoint for --epochs more epochs, so that --epochs 2 and --epochs 1 followed by
// --resume with --epochs 1 end with the same weights, bit for bit (with the same other flags).
//
//   train_fashion_mnist [--mode graph|pynative] [--epochs 5] [--seed 1] [--threads 1]
//                       [--optimizer adam|sgd] [--lr 0.001] [--batch-size 64]
//                       [--data /usr/share/datasets/fashion-mnist] [--checkpoint seed_network.ckpt]
//                       [--resume PATH]
#include <sys/resource.h>
#include <unistd.h>

#include <Eigen/Core>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>

#include "network.hpp"

namespace {

struct Options {
  std::string mode = "graph";
  int epochs = 5;
  std::uint64_t seed = 1;
  int threads = 1;
  std::string optimizer = "adam";
  double lr = 1e-3;
  duet::index_t batch_size = 64;
  std::string data = duet::data::fashion_mnist_dir;
  std::string checkpoint = "seed_network.ckpt";
  std::string resume;  // a checkpoint to continue from; "" to start afresh
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "train_fashion_mnist: " << problem
            << "\nusage: train_fashion_mnist [--mode graph|pynative] [--epochs N] [--seed S] [--threads T]\n"
               "                           [--optimizer adam|sgd] [--lr LR] [--batch-size B] [--data DIR]\n"
               "                           [--checkpoint PATH] [--resume PATH]\n";
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  const std::map<std::string, std::function<void(const std::string&)>> flags{
      {"--mode", [&](const std::string& v) { o.mode = v; }},
      {"--epochs", [&](const std::string& v) { o.epochs = std::stoi(v); }},
      {"--seed", [&](const std::string& v) { o.seed = std::stoull(v); }},
      {"--threads", [&](const std::string& v) { o.threads = std::stoi(v); }},
      {"--optimizer", [&](const std::string& v) { o.optimizer = v; }},
      {"--lr", [&](const std::string& v) { o.lr = std::stod(v); }},
      {"--batch-size", [&](const std::string& v) { o.batch_size = std::stoll(v); }},
      {"--data", [&](const std::string& v) { o.data = v; }},
      {"--checkpoint", [&](const std::string& v) { o.checkpoint = v; }},
      {"--resume", [&](const std::string& v) { o.resume = v; }},
  };
  for (int i = 1; i < argc; i += 2) {
    const auto flag = flags.find(argv[i]);
    if (flag == flags.end()) usage(std::string("unknown flag ") + argv[i]);
    if (i + 1 >= argc) usage(std::string(argv[i]) + " needs a value");
    try {
      flag->second(argv[i + 1]);
    } catch (const std::exception&) {
      usage(std::string("bad value for ") + argv[i] + ": " + argv[i + 1]);
    }
  }
  if (o.mode != "graph" && o.mode != "pynative") usage("--mode is graph or pynative");
  if (o.optimizer != "adam" && o.optimizer != "sgd") usage("--optimizer is adam or sgd");
  if (o.epochs < 0 || o.threads < 1 || o.batch_size < 1) usage("--epochs, --threads and --batch-size must be positive");
  return o;
}

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

template <class Optimizer>
int train(const Options& o, Network& model, Optimizer& optimizer) {
  using namespace duet;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(model, loss);
  nn::TrainOneStepCell train_step(with_loss, optimizer);

  data::DataLoader train_data(data::load_fashion_mnist(o.data, data::Split::train), o.batch_size,
                              {.shuffle = true, .seed = o.seed});
  data::DataLoader test_data(data::load_fashion_mnist(o.data, data::Split::test), 1000);
  std::cout << "duet: training the seed network on Fashion-MNIST (" << train_data.dataset().size() << " images), "
            << o.mode << " mode, " << o.optimizer << " lr " << o.lr << ", batch " << o.batch_size << ", seed " << o.seed
            << ", " << o.threads << " thread(s)\n";

  // The step count says how many epochs the checkpoint has seen; the loader goes on with the
  // next epoch's order, as the run that saved it would have.
  std::int64_t done = 0;
  if (!o.resume.empty()) {
    load_checkpoint(o.resume, model, optimizer);
    const std::int64_t steps = optimizer.global_step();
    if (steps % train_data.size() != 0) {
      throw ValueError("--resume " + o.resume + ": its optimizer has taken " + std::to_string(steps) +
                       " steps, not a whole number of epochs of " + std::to_string(train_data.size()) +
                       " batches (another --batch-size?)");
    }
    done = steps / train_data.size();
    train_data.start_epoch(static_cast<std::uint64_t>(done));
    std::cout << "duet: resuming from " << o.resume << " after " << done << " epoch(s)\n";
  }

  const bool tty = isatty(STDOUT_FILENO) != 0;
  const std::int64_t last = done + o.epochs;
  for (std::int64_t epoch = done + 1; epoch <= last; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    train::ProgressBar bar(std::cout, "epoch " + std::to_string(epoch) + "/" + std::to_string(last),
                           train_data.size());
    double loss_sum = 0;
    index_t seen = 0;
    index_t batches = 0;
    for (const data::Batch& batch : train_data) {
      const float batch_loss = train_step(batch.images, batch.labels).item();
      const index_t n = batch.labels.numel();
      loss_sum += static_cast<double>(batch_loss) * static_cast<double>(n);
      seen += n;
      if (tty) bar.update(++batches, loss_sum / static_cast<double>(seen), seen);
    }
    if (tty) bar.finish();
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const train::Metrics test = train::evaluate(model, loss, test_data);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("epoch %lld: train loss %.6f  test loss %.6f  test accuracy %.4f  train time %.2f s  epoch time %.2f s\n",
                static_cast<long long>(epoch), loss_sum / static_cast<double>(seen), test.loss, test.accuracy,
                train_seconds, seconds);
    std::fflush(stdout);
  }
  save_checkpoint(model, o.checkpoint, optimizer);
  std::printf("saved %s; peak RSS %.1f MiB\n", o.checkpoint.c_str(), peak_rss_mib());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    Eigen::setNbThreads(o.threads);
    duet::set_context({.mode = o.mode == "graph" ? duet::GRAPH_MODE : duet::PYNATIVE_MODE});
    duet::set_seed(o.seed);
    Network model;
    if (o.optimizer == "adam") {
      duet::nn::Adam optimizer(model.parameters(), {.learning_rate = o.lr});
      return train(o, model, optimizer);
    }
    duet::nn::SGD optimizer(model.parameters(), {.learning_rate = o.lr, .momentum = 0.9});
    return train(o, model, optimizer);
  } catch (const duet::Error& e) {
    std::cerr << "train_fashion_mnist: " << e.what() << '\n';
    return 1;
  }
}
