// The main job: trains the seed network on Fashion-MNIST (Debian's dataset-fashion-mnist) in
// graph or PyNative mode, prints each epoch's train loss, test loss and accuracy and wall
// time, and saves a checkpoint with the optimiser's state. --resume PATH continues from such
// a checkpoint for --epochs more epochs, so that --epochs 2 and --epochs 1 followed by
// --resume with --epochs 1 end with the same weights, bit for bit (with the same other flags).
//
//   train_fashion_mnist [--mode graph|pynative] [--epochs 5] [--seed 1] [--threads 1]
//                       [--optimizer adam|sgd] [--lr 0.001] [--batch-size 64]
//                       [--data /usr/share/datasets/fashion-mnist] [--checkpoint seed_network.ckpt]
//                       [--resume PATH] [--distributed]
//
// --distributed trains data-parallel over the ranks of `mpirun -np N` (duet/distributed.hpp;
// built only when CMake found MPI): --batch-size stays the global batch, each rank takes
// 1/N of it, and the losses, accuracy and checkpoint are those of one process with that batch
// (with 2 ranks, the checkpoint's very bits). Rank 0 prints and writes the checkpoint.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <span>
#include <string>

#include "network.hpp"
#ifdef DUET_EXAMPLE_DISTRIBUTED
#include <duet/distributed.hpp>
#endif

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
  bool distributed = false;
};

// This process's part of the work: shard `rank` of `ranks`.
struct Group {
  int rank = 0;
  int ranks = 1;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "train_fashion_mnist: " << problem
            << "\nusage: train_fashion_mnist [--mode graph|pynative] [--epochs N] [--seed S] [--threads T]\n"
               "                           [--optimizer adam|sgd] [--lr LR] [--batch-size B] [--data DIR]\n"
               "                           [--checkpoint PATH] [--resume PATH] [--distributed]\n";
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
    if (std::string(argv[i]) == "--distributed") {
      o.distributed = true;
      --i;  // a flag without a value
      continue;
    }
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

// The sums over the ranks of values each rank has for its shard.
void sum_over_ranks([[maybe_unused]] const Group& group, [[maybe_unused]] std::span<double> values) {
#ifdef DUET_EXAMPLE_DISTRIBUTED
  if (group.ranks > 1) duet::distributed::all_reduce_sum(values);
#endif
}

// The optimiser through its base class: the step calls its update through one virtual call per
// parameter, and this function compiles once, not once per optimiser type.
int train(const Options& o, const Group& group, Network& model, duet::nn::BasicOptimizer<float>& optimizer) {
  using namespace duet;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(model, loss);
  nn::TrainOneStepCell train_step(with_loss, optimizer);

  if (o.batch_size % group.ranks != 0) {
    throw ValueError("--batch-size " + std::to_string(o.batch_size) + " does not split over " +
                     std::to_string(group.ranks) + " ranks");
  }
  const auto shard = [&](data::LoaderOptions options) {
    options.num_shards = group.ranks;
    options.shard_id = group.rank;
    return options;
  };
  data::DataLoader train_data(data::load_fashion_mnist(o.data, data::Split::train), o.batch_size / group.ranks,
                              shard({.shuffle = true, .seed = o.seed}));
  data::DataLoader test_data(data::load_fashion_mnist(o.data, data::Split::test), 1000 / group.ranks, shard({}));
  // Every rank computes the same numbers; rank 0 says them.
  const bool main_rank = group.rank == 0;
  std::ostream silent(nullptr);
  std::ostream& out = main_rank ? std::cout : silent;
  out << "duet: training the seed network on Fashion-MNIST (" << train_data.dataset().size() << " images), "
            << o.mode << " mode, " << o.optimizer << " lr " << o.lr << ", batch " << o.batch_size << ", seed " << o.seed
            << ", " << o.threads << " thread(s)";
  if (o.distributed) out << ", " << group.ranks << " rank(s) of batch " << o.batch_size / group.ranks;
  out << '\n';

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
    out << "duet: resuming from " << o.resume << " after " << done << " epoch(s)\n";
  }

  const bool tty = main_rank && isatty(STDOUT_FILENO) != 0;
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
      // Every rank takes its share at the same pace, so the group's rate is this rank's times
      // the ranks (the epoch's line below sums them exactly).
      if (tty) bar.update(++batches, loss_sum / static_cast<double>(seen), seen * group.ranks);
    }
    if (tty) bar.finish();
    double sums[] = {loss_sum, static_cast<double>(seen)};
    sum_over_ranks(group, sums);
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const train::Metrics test = train::evaluate(model, loss, test_data);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (main_rank) {
      std::printf("epoch %lld: train loss %.6f  test loss %.6f  test accuracy %.4f  train time %.2f s (%.0f images/s)  "
                  "epoch time %.2f s\n",
                  static_cast<long long>(epoch), sums[0] / sums[1], test.loss, test.accuracy, train_seconds,
                  sums[1] / train_seconds, seconds);
      std::fflush(stdout);
    }
  }
  if (main_rank) {
    save_checkpoint(model, o.checkpoint, optimizer);
    std::printf("saved %s; peak RSS %.1f MiB\n", o.checkpoint.c_str(), peak_rss_mib());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  Group group;
  try {
    if (o.distributed) {
#ifdef DUET_EXAMPLE_DISTRIBUTED
      duet::distributed::init();
      duet::set_auto_parallel_context({.parallel_mode = duet::ParallelMode::DATA_PARALLEL, .gradients_mean = true});
      group = {duet::distributed::get_rank(), duet::distributed::get_group_size()};
#else
      usage("--distributed: this build has no MPI (CMake did not find it)");
#endif
    }
    duet::set_num_threads(o.threads);
    duet::set_context({.mode = o.mode == "graph" ? duet::GRAPH_MODE : duet::PYNATIVE_MODE});
    duet::set_seed(o.seed);
    Network model;
    if (o.optimizer == "adam") {
      duet::nn::Adam optimizer(model.parameters(), {.learning_rate = o.lr});
      return train(o, group, model, optimizer);
    }
    duet::nn::SGD optimizer(model.parameters(), {.learning_rate = o.lr, .momentum = 0.9});
    return train(o, group, model, optimizer);
  } catch (const duet::Error& e) {
    const std::string message = std::string("train_fashion_mnist: ") + e.what();
#ifdef DUET_EXAMPLE_DISTRIBUTED
    // The other ranks would wait for this one until their timeout.
    if (o.distributed) duet::distributed::abort(message);
#endif
    std::cerr << message << '\n';
    return 1;
  }
}
