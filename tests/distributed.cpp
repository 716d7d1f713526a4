// Data parallelism over MPI (duet/distributed.hpp). Run by ctest under `mpirun -np 2`: every
// case runs on both ranks. The cases marked skip are faults (a rank that hangs, throws or
// dies) that end the job; ctest runs each alone and checks how the job ended
// (distributed_run.cmake).
#include <doctest/doctest.h>

#include <csignal>
#include <duet/distributed.hpp>
#include <duet/duet.hpp>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

using namespace duet;

namespace {

template <index_t Hidden>
struct SmallNet : nn::Cell<SmallNet<Hidden>> {
  nn::Flatten flatten;
  nn::Dense<16, Hidden> fc1;
  nn::ReLU relu;
  nn::Dense<Hidden, 3> fc2;
  DUET_CELL_MEMBERS(flatten, fc1, relu, fc2);

  auto construct(auto x) { return fc2(relu(fc1(flatten(x)))); }
};

// 44 images of 4x4 in 3 classes, the same on every rank: 5 global batches of 8 and one of 4.
data::ImageDataset small_dataset() {
  Generator gen(42);
  auto images = BasicTensor<std::uint8_t>::uninitialized({44, 4, 4});
  auto labels = BasicTensor<std::int32_t>::uninitialized({44});
  for (index_t i = 0; i < images.numel(); ++i) images.data()[i] = static_cast<std::uint8_t>(gen.next() % 256);
  for (index_t i = 0; i < labels.numel(); ++i) labels.data()[i] = static_cast<std::int32_t>(gen.next() % 3);
  return data::ImageDataset(images, labels, 3);
}

void init_two_ranks() {
  distributed::init();
  REQUIRE(distributed::get_group_size() == 2);
}

// Whether every rank holds exactly these values (the sum of equal floats doubles them exactly).
bool same_on_every_rank(const Tensor& t) {
  std::vector<double> mine(t.values().begin(), t.values().end());
  std::vector<double> sums = mine;
  distributed::all_reduce_sum(sums);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (sums[i] != mine[i] * distributed::get_group_size()) return false;
  }
  return true;
}

double relative_difference(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (index_t i = 0; i < a.numel(); ++i) {
    const double x = a.data()[i];
    const double y = b.data()[i];
    worst = std::max(worst, std::abs(x - y) / std::max(std::abs(y), 1e-3));
  }
  return worst;
}

struct Run {
  std::vector<float> losses;
  std::vector<Tensor> parameters;
  train::Metrics metrics;
};

template <class Step, class Net, class Loss>
Run epoch(Step&& step, Net& net, Loss& loss, data::DataLoader& loader) {
  Run run;
  for (const data::Batch& batch : loader) run.losses.push_back(step(batch.images, batch.labels));
  for (const auto& p : net.parameters()) run.parameters.push_back(p.parameter->clone());
  data::DataLoader all(small_dataset(), 16, {.num_shards = loader.options().num_shards,
                                             .shard_id = loader.options().shard_id});
  run.metrics = train::evaluate(net, loss, all);
  return run;
}

// One epoch with two ranks from different initial weights, and the same epoch in one
// process on the global batches from rank 0's weights.
void compare_with_one_process(Mode mode) {
  init_two_ranks();
  set_context({.mode = mode});
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;

  set_seed(1);
  SmallNet<8> reference_net;
  nn::WithLossCell reference_with_loss(reference_net, loss);
  nn::Adam reference_adam(reference_net.parameters(), {.learning_rate = 0.05});
  auto value_and_grads = value_and_grad(reference_with_loss, reference_net.parameters());
  data::DataLoader whole(small_dataset(), 8, {.shuffle = true, .seed = 7});
  const Run alone = epoch(
      [&](const Tensor& x, const BasicTensor<std::int32_t>& y) {
        auto out = value_and_grads(x, y);
        reference_adam(out.grads);
        return out.value.item();
      },
      reference_net, loss, whole);

  set_seed(static_cast<std::uint64_t>(1 + distributed::get_rank()));
  SmallNet<8> net;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 0.05});
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  nn::TrainOneStepCell step(with_loss, adam);
  data::DataLoader shard(small_dataset(), 4,
                         {.shuffle = true, .seed = 7, .num_shards = 2, .shard_id = distributed::get_rank()});
  REQUIRE(shard.size() == whole.size());
  const Run together = epoch([&](const Tensor& x, const BasicTensor<std::int32_t>& y) { return step(x, y).item(); },
                             net, loss, shard);
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE, .gradients_mean = false});

  REQUIRE(together.losses.size() == alone.losses.size());
  for (std::size_t i = 0; i < alone.losses.size(); ++i) {
    CHECK(std::abs(together.losses[i] - alone.losses[i]) <= 1e-5 * std::abs(alone.losses[i]));
  }
  for (std::size_t i = 0; i < alone.parameters.size(); ++i) {
    CHECK(relative_difference(together.parameters[i], alone.parameters[i]) <= 1e-5);
    CHECK(same_on_every_rank(together.parameters[i]));
  }
  for (const auto& slot : adam.state()) {
    for (const Tensor& moment : *slot.tensors) CHECK(same_on_every_rank(moment));
  }
  CHECK(together.metrics.samples == 44);
  CHECK(together.metrics.accuracy == alone.metrics.accuracy);
  CHECK(std::abs(together.metrics.loss - alone.metrics.loss) <= 1e-5 * alone.metrics.loss);
}

}  // namespace

TEST_CASE("distributed: two ranks train as one process with the global batch, PyNative mode") {
  compare_with_one_process(PYNATIVE_MODE);
}

TEST_CASE("distributed: two ranks train as one process with the global batch, graph mode") {
  compare_with_one_process(GRAPH_MODE);
}

TEST_CASE("distributed: networks that differ between ranks are named at the first step") {
  init_two_ranks();
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  data::DataLoader shard(small_dataset(), 4, {.num_shards = 2, .shard_id = distributed::get_rank()});
  const data::Batch& batch = *shard.next();
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  const auto first_step = [&](auto& net) {
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters());
    nn::TrainOneStepCell step(with_loss, sgd);
    step(batch.images, batch.labels);
  };
  const auto expected = doctest::Contains(
      "the ranks' networks differ: rank 1 has 'fc1.weight' [9, 16] as parameter 0 where rank 0 has 'fc1.weight' [8, 16]");
  if (distributed::get_rank() == 0) {
    SmallNet<8> net;
    CHECK_THROWS_WITH_AS(first_step(net), expected, ValueError);
  } else {
    SmallNet<9> net;
    CHECK_THROWS_WITH_AS(first_step(net), expected, ValueError);
  }
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
}

TEST_CASE("distributed: half of the set-up is refused, not trained alone") {
  init_two_ranks();
  SmallNet<8> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters());
  const Tensor x = ones({2, 1, 4, 4});
  const BasicTensor<std::int32_t> y({2}, {0, 1});
  nn::TrainOneStepCell step(with_loss, sgd);
  CHECK_THROWS_WITH_AS(step(x, y), doctest::Contains("joined 2 ranks but the parallel mode is STAND_ALONE"), ModeError);
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL});
  auto value_and_grads = value_and_grad(with_loss, net.parameters());
  value_and_grads(x, y);
  CHECK_THROWS_WITH_AS(sgd.step(), doctest::Contains("were not all-reduced"), ModeError);
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
}

// Faults: each ends the job, so ctest runs each on its own and checks the exit and the output.
// doctest catches what a case throws; terminating from the handler is what an exception that
// leaves a program's main does.
namespace {
// at_step returns false to end the rank's training there.
void train_until(const std::function<bool(int step)>& at_step) {
  try {
    init_two_ranks();
    set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
    SmallNet<8> net;
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters());
    nn::TrainOneStepCell step(with_loss, sgd);
    data::DataLoader shard(small_dataset(), 4, {.num_shards = 2, .shard_id = distributed::get_rank()});
    for (int k = 0;; ++k) {
      const data::Batch* batch = shard.next();
      if (batch == nullptr) {
        shard.start_epoch(shard.epoch() + 1);
        batch = shard.next();
      }
      if (!at_step(k)) return;
      step(batch->images, batch->labels);
    }
  } catch (...) {
    std::terminate();
  }
}
}  // namespace

TEST_CASE("distributed fault: a rank that hangs" * doctest::skip()) {
  train_until([](int k) {
    if (k == 3 && distributed::get_rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
    return true;
  });
}

TEST_CASE("distributed fault: a rank that throws" * doctest::skip()) {
  train_until([](int k) {
    if (k == 3 && distributed::get_rank() == 1) throw ValueError("the test's rank 1 fails at step 3");
    return true;
  });
}

TEST_CASE("distributed fault: a rank that is killed" * doctest::skip()) {
  train_until([](int k) {
    if (k == 3 && distributed::get_rank() == 1) std::raise(SIGKILL);
    return true;
  });
}

// Rank 0 stops training after 3 steps and sums its metrics, while rank 1 waits in its fourth
// step: two different collectives, which must time out with duet's message, not meet in MPI.
TEST_CASE("distributed fault: a rank that takes fewer steps" * doctest::skip()) {
  train_until([](int k) { return k < 3 || distributed::get_rank() == 1; });
  try {
    std::vector<double> metrics{1, 2, 3};
    distributed::all_reduce_sum(metrics);
  } catch (...) {
    std::terminate();
  }
}
