// Data parallelism over MPI (duet/distributed.hpp). Run by ctest under `mpirun -np 2`: every
// case runs on both ranks. The cases marked skip are faults (a rank that hangs, throws or
// dies) that end the job; ctest runs each alone and checks how the job ended
// (distributed_run.cmake).
#include <doctest/doctest.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <duet/distributed.hpp>
#include <duet/duet.hpp>
#include <exception>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
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

// Images of 4x4 in 3 classes, the same on every rank: by default 44, 5 global batches of 8 and
// one of 4.
data::ImageDataset small_dataset(index_t count = 44) {
  Generator gen(42);
  auto images = BasicTensor<std::uint8_t>::uninitialized({count, 4, 4});
  auto labels = BasicTensor<std::int32_t>::uninitialized({count});
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
  data::DataLoader all(loader.dataset(), 16,
                       {.num_shards = loader.options().num_shards, .shard_id = loader.options().shard_id});
  run.metrics = train::evaluate(net, loss, all);
  return run;
}

// How the ranks train in compare_with_one_process: nn::TrainOneStepCell, or a loop written by
// hand with value_and_grad, distributed::GradReducer and optimizer(grads).
enum class Loop { train_one_step_cell, grad_reducer };

// The rows loss averages in a batch labelled y: those not ignored.
template <class Loss>
double counted_rows(const Loss& loss, const BasicTensor<std::int32_t>& y) {
  if constexpr (requires { loss.options(); }) {
    return static_cast<double>(std::ranges::count_if(y.values(), [&](std::int32_t l) { return l != loss.options().ignore_index; }));
  } else {
    return static_cast<double>(y.numel());
  }
}

// The global batches: 8 rows of 4x4 images, or more.
struct Batches {
  index_t images = 44;
  index_t global = 8;
  // Whether the ranks' parameters are to be one process's to the bit: the batch's halves above
  // 16 rows (kernels/detail/halves.hpp) and a mean over all rows (shares of 1/2).
  bool bitwise = false;
};

// One epoch with two ranks from different initial weights, and the same epoch in one
// process on the global batches from rank 0's weights.
template <class Loss>
void compare_with_one_process(Mode mode, Loss& loss, Loop loop = Loop::train_one_step_cell, Batches batches = {}) {
  init_two_ranks();
  set_context({.mode = mode});

  set_seed(1);
  SmallNet<8> reference_net;
  nn::WithLossCell reference_with_loss(reference_net, loss);
  nn::Adam reference_adam(reference_net.parameters(), {.learning_rate = 0.05});
  auto value_and_grads = value_and_grad(reference_with_loss, reference_net.parameters());
  data::DataLoader whole(small_dataset(batches.images), batches.global, {.shuffle = true, .seed = 7});
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
  data::DataLoader shard(small_dataset(batches.images), batches.global / 2,
                         {.shuffle = true, .seed = 7, .num_shards = 2, .shard_id = distributed::get_rank()});
  REQUIRE(shard.size() == whole.size());
  Run together;
  if (loop == Loop::train_one_step_cell) {
    nn::TrainOneStepCell step(with_loss, adam);
    together = epoch([&](const Tensor& x, const BasicTensor<std::int32_t>& y) { return step(x, y).item(); }, net,
                     loss, shard);
  } else {
    distributed::GradReducer reducer(net.parameters(), {.mean = Loss::reduction == Reduction::mean});
    auto rank_value_and_grads = value_and_grad(with_loss, net.parameters());
    together = epoch(
        [&](const Tensor& x, const BasicTensor<std::int32_t>& y) {
          auto out = rank_value_and_grads(x, y);
          CHECK_THROWS_WITH_AS(adam(out.grads), doctest::Contains("were not all-reduced"), ModeError);
          const double rows = counted_rows(loss, y);
          out.grads = reducer(out.grads, rows);
          adam(out.grads);
          const bool summed = Loss::reduction == Reduction::sum;
          std::vector<double> sums{out.value.item() * (summed ? 1 : rows), rows};
          distributed::all_reduce_sum(sums);
          return static_cast<float>(summed ? sums[0] : sums[0] / sums[1]);
        },
        net, loss, shard);
  }
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE, .gradients_mean = false});

  REQUIRE(together.losses.size() == alone.losses.size());
  for (std::size_t i = 0; i < alone.losses.size(); ++i) {
    CHECK(std::abs(together.losses[i] - alone.losses[i]) <= 1e-5 * std::abs(alone.losses[i]));
  }
  for (std::size_t i = 0; i < alone.parameters.size(); ++i) {
    CHECK(relative_difference(together.parameters[i], alone.parameters[i]) <= (batches.bitwise ? 0.0 : 1e-5));
    CHECK(same_on_every_rank(together.parameters[i]));
  }
  for (const auto& slot : adam.state()) {
    for (const Tensor& moment : *slot.tensors) CHECK(same_on_every_rank(moment));
  }
  CHECK(together.metrics.samples == alone.metrics.samples);
  CHECK(together.metrics.accuracy == alone.metrics.accuracy);
  CHECK(std::abs(together.metrics.loss - alone.metrics.loss) <= 1e-5 * alone.metrics.loss);
}

void compare_losses_with_one_process(Mode mode) {
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> mean;
  compare_with_one_process(mode, mean);
  // The ranks' batches hold different numbers of rows labelled 2, which count in neither.
  nn::CrossEntropyLoss<> ignoring({.ignore_index = 2});
  compare_with_one_process(mode, ignoring);
  nn::CrossEntropyLoss<Reduction::sum> sum;
  compare_with_one_process(mode, sum);
  nn::CrossEntropyLoss<Reduction::sum> sum_ignoring({.ignore_index = 2});
  compare_with_one_process(mode, sum_ignoring);
}

}  // namespace

#ifdef OPEN_MPI
// What mpirun gave this rank, read before any case calls init().
const bool environment_names_algorithm = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm") != nullptr;
const bool environment_names_copy = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism") != nullptr;

TEST_CASE("distributed: init chooses Open MPI's ring all-reduce and copies through shared buffers, unless the environment chose") {
  init_two_ranks();
  const char* algorithm = std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm");
  const char* copy = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism");
  REQUIRE(algorithm != nullptr);
  REQUIRE(copy != nullptr);
  if (!environment_names_algorithm) CHECK(std::string(algorithm) == "1");
  if (!environment_names_copy) CHECK(std::string(copy) == "none");
}
#endif

TEST_CASE("distributed: two ranks train as one process with the global batch, PyNative mode") {
  compare_losses_with_one_process(PYNATIVE_MODE);
}

TEST_CASE("distributed: two ranks train as one process with the global batch, graph mode") {
  compare_losses_with_one_process(GRAPH_MODE);
}

TEST_CASE("distributed: a loop written by hand with GradReducer trains as one process, both modes") {
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> mean;
    compare_with_one_process(mode, mean, Loop::grad_reducer);
    nn::CrossEntropyLoss<> ignoring({.ignore_index = 2});
    compare_with_one_process(mode, ignoring, Loop::grad_reducer);
    nn::CrossEntropyLoss<Reduction::sum> sum;
    compare_with_one_process(mode, sum, Loop::grad_reducer);
  }
}

// 45 samples over 2 ranks in global batches of 4: the last sample is no epoch's batch, but
// the evaluation counts it (helper-92: 500 of 501 samples were evaluated).
TEST_CASE(
    "distributed: evaluate over sharded loaders covers every sample, a last global batch shorter than the ranks too") {
  init_two_ranks();
  set_seed(1);
  SmallNet<8> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  const train::Metrics alone = train::evaluate(net, loss, data::DataLoader(small_dataset(45), 4));
  const train::Metrics together = train::evaluate(
      net, loss, data::DataLoader(small_dataset(45), 2, {.num_shards = 2, .shard_id = distributed::get_rank()}));
  CHECK(alone.samples == 45);
  CHECK(together.samples == 45);
  CHECK(together.accuracy == alone.accuracy);
  CHECK(std::abs(together.loss - alone.loss) <= 1e-6 * alone.loss);
}

// 3 global batches of 64 and one of 34: 2 ranks of 32 (and 17) rows each, whose parameters
// after the epoch are one process's to the bit.
TEST_CASE("distributed: two ranks train as one process to the bit, batches of 64 in halves, both modes and loops") {
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    for (const Loop loop : {Loop::train_one_step_cell, Loop::grad_reducer}) {
      CAPTURE(mode);
      CAPTURE(static_cast<int>(loop));
      nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> mean;
      compare_with_one_process(mode, mean, loop, {.images = 226, .global = 64, .bitwise = true});
    }
  }
}

// A gradient every rank has, of 64 KB or more, is summed in a collective of its own where it
// is to end (in GradReducer's output, in the parameter's gradient for TrainOneStepCell); the
// others travel in a bucket. Both give the weighted mean.
TEST_CASE("distributed: large gradients summed in place and small ones in buckets give the weighted mean") {
  init_two_ranks();
  const int rank = distributed::get_rank();
  set_seed(5);  // the same weights on both ranks
  SmallNet<1024> net;  // fc1.weight [1024, 16]: 64 KB
  const std::vector<nn::NamedParameter<float>> params = net.parameters();

  SUBCASE("GradReducer") {
    set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
    distributed::GradReducer reducer(params);
    // Rank r's gradients are (r + 1)·(i mod 7), over 3 rows on rank 0 and 1 on rank 1: the
    // mean 0.75·a + 0.25·2a = 1.25·a, exact in float.
    std::vector<Tensor> grads;
    for (const auto& p : params) {
      Tensor g = BasicTensor<float>::uninitialized(p.parameter->shape());
      for (index_t i = 0; i < g.numel(); ++i) g.data()[i] = static_cast<float>((rank + 1) * (i % 7));
      grads.push_back(g);
    }
    const std::vector<Tensor> given = [&] {
      std::vector<Tensor> copies;
      for (const Tensor& g : grads) copies.push_back(g.clone());
      return copies;
    }();
    const std::vector<Tensor> reduced = reducer(grads, rank == 0 ? 3 : 1);
    REQUIRE(reduced.size() == grads.size());
    for (std::size_t k = 0; k < reduced.size(); ++k) {
      CAPTURE(params[k].name);
      bool exact = true;
      for (index_t i = 0; i < reduced[k].numel(); ++i) exact = exact && reduced[k].data()[i] == 1.25f * static_cast<float>(i % 7);
      CHECK(exact);
      CHECK(std::equal(grads[k].values().begin(), grads[k].values().end(), given[k].values().begin()));  // untouched
    }
  }

  SUBCASE("TrainOneStepCell") {
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters(), {.learning_rate = 0.1});
    data::DataLoader shard(small_dataset(), 4, {.shuffle = true, .seed = 7, .num_shards = 2, .shard_id = rank});
    const data::Batch& batch = *shard.next();
    // This rank's own gradient, before the step (the weights are rank 0's on both ranks).
    auto value_and_grads = value_and_grad(with_loss, sgd.parameters());
    std::vector<Tensor> own;
    for (const Tensor& g : value_and_grads(batch.images, batch.labels).grads) own.push_back(g.clone());
    set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
    nn::TrainOneStepCell step(with_loss, sgd);
    step(batch.images, batch.labels);
    const std::vector<nn::Parameter*>& trained = sgd.parameters();
    REQUIRE(trained.size() == own.size());
    for (std::size_t k = 0; k < own.size(); ++k) {
      std::vector<double> mean(own[k].values().begin(), own[k].values().end());
      distributed::all_reduce_sum(mean);  // equal batches of 4: the mean is half the sum
      double worst = 0;
      for (index_t i = 0; i < own[k].numel(); ++i) {
        const double expected = mean[static_cast<std::size_t>(i)] / 2;
        worst = std::max(worst, std::abs(trained[k]->grad.data()[i] - expected) / std::max(std::abs(expected), 1e-6));
      }
      CHECK(worst <= 1e-6);
      CHECK(same_on_every_rank(*trained[k]));
    }
  }
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE, .gradients_mean = false});
}

namespace {
struct BatchNormNet : nn::Cell<BatchNormNet> {
  nn::Flatten flatten;
  nn::Dense<16, 8> fc1;
  nn::BatchNorm1d<8> bn;
  nn::ReLU relu;
  nn::Dense<8, 3> fc2;
  DUET_CELL_MEMBERS(flatten, fc1, bn, relu, fc2);

  auto construct(auto x) { return fc2(relu(bn(fc1(flatten(x))))); }
};

// BatchNorm's moving statistics after the first step of one process on the global batch, and
// after each step of two ranks (through TrainOneStepCell or GradReducer).
void check_moving_statistics(Mode mode, Loop loop) {
  init_two_ranks();
  set_context({.mode = mode});
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  set_seed(3);
  BatchNormNet alone;
  {
    nn::WithLossCell with_loss(alone, loss);
    nn::SGD sgd(alone.parameters());
    alone.set_train(true);
    auto value_and_grads = value_and_grad(with_loss, sgd.parameters());
    data::DataLoader whole(small_dataset(), 8, {.shuffle = true, .seed = 7});
    const data::Batch& batch = *whole.next();
    sgd(value_and_grads(batch.images, batch.labels).grads);
  }

  set_seed(static_cast<std::uint64_t>(3 + distributed::get_rank()));
  BatchNormNet net;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters());
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  nn::TrainOneStepCell cell_step(with_loss, sgd);
  std::optional<distributed::GradReducer> reducer;
  if (loop == Loop::grad_reducer) reducer.emplace(net.parameters());
  auto value_and_grads = value_and_grad(with_loss, sgd.parameters());
  data::DataLoader shard(small_dataset(), 4,
                         {.shuffle = true, .seed = 7, .num_shards = 2, .shard_id = distributed::get_rank()});
  bool first = true;
  for (const data::Batch& batch : shard) {
    if (loop == Loop::train_one_step_cell) {
      cell_step(batch.images, batch.labels);
    } else {
      auto out = value_and_grads(batch.images, batch.labels);
      sgd((*reducer)(out.grads, static_cast<double>(batch.labels.numel())));
    }
    CHECK(same_on_every_rank(net.bn.moving_mean));
    CHECK(same_on_every_rank(net.bn.moving_variance));
    // After the first step, from the same weights: the mean of the two halves' batch means is
    // the global batch's. (Their variances are the halves' own, not the global batch's.)
    if (first) CHECK(relative_difference(net.bn.moving_mean, alone.bn.moving_mean) <= 1e-5);
    first = false;
  }
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
  // So rank 0's checkpoint and every rank's evaluation hold the same network.
  data::DataLoader all(small_dataset(), 16);
  const train::Metrics m = train::evaluate(net, loss, all);
  std::vector<double> sums{m.loss};
  distributed::all_reduce_sum(sums);
  CHECK(sums[0] == 2 * m.loss);
}
}  // namespace

// A loop of one's own is checked as nn::TrainOneStepCell checks its own, on both ranks alike.
TEST_CASE("distributed: GradReducer's first reduction and the optimiser's first update refuse ranks that would train apart or repeat one another") {
  init_two_ranks();
  const int rank = distributed::get_rank();
  set_seed(5);
  SmallNet<8> net;
  const auto params = net.parameters();
  const auto gradients = [&](float value) {
    std::vector<Tensor> grads;
    for (const auto& p : params) {
      Tensor g(p.parameter->shape());
      std::fill_n(g.data(), g.numel(), value);
      grads.push_back(g);
    }
    return grads;
  };
  SUBCASE("a parameter changed on one rank after the reducer was made") {
    distributed::GradReducer reducer(params);
    if (rank == 1) params[2].parameter->data()[0] += 1.0f;
    CHECK_THROWS_WITH_AS(reducer(gradients(static_cast<float>(rank + 1))),
                         doctest::Contains("the ranks' parameters differ ('fc2.weight' first) at the first reduction"),
                         ValueError);
  }
  SUBCASE("the same gradients on every rank (a loader not sharded)") {
    distributed::GradReducer reducer(params);
    CHECK_THROWS_WITH_AS(reducer(gradients(0.5f)), doctest::Contains("the first gradients are the same on all 2 ranks"),
                         ValueError);
  }
  SUBCASE("gradients that are all zero prove nothing") {
    distributed::GradReducer reducer(params);
    CHECK_NOTHROW(reducer(gradients(0.0f)));
  }
  SUBCASE("an optimiser state resumed on one rank") {
    distributed::GradReducer reducer(params);
    nn::Adam adam(params, {.learning_rate = 1e-3});
    if (rank == 0) adam.set_global_step(5);
    const std::vector<Tensor> reduced = reducer(gradients(static_cast<float>(rank + 1)));
    CHECK_THROWS_WITH_AS(adam(reduced), doctest::Contains("nn::Adam: the ranks' optimiser states differ (the step count"),
                         ValueError);
  }
  SUBCASE("moments resumed on one rank") {
    distributed::GradReducer reducer(params);
    nn::Adam adam(params, {.learning_rate = 1e-3});
    if (rank == 0) (*adam.state()[1].tensors)[0].data()[3] = 0.25f;
    const std::vector<Tensor> reduced = reducer(gradients(static_cast<float>(rank + 1)));
    CHECK_THROWS_WITH_AS(adam(reduced), doctest::Contains("nn::Adam: the ranks' optimiser states differ ('"), ValueError);
    // Equal states pass, and are checked once.
    nn::Adam equal(params, {.learning_rate = 1e-3});
    CHECK_NOTHROW(equal(reduced));
    CHECK_NOTHROW(equal(reducer(gradients(static_cast<float>(rank + 2)))));
  }
  SUBCASE("an update from gradients not reduced, the parallel mode never set, is said once") {
    const AutoParallelContext saved = get_auto_parallel_context();
    const bool chosen = duet::detail::parallel_mode_chosen().exchange(false);
    duet::detail::parallel_mode().store(ParallelMode::STAND_ALONE);
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(params);
    data::DataLoader shard(small_dataset(), 4, {.num_shards = 2, .shard_id = rank});
    const data::Batch& batch = *shard.next();
    std::ostringstream said;
    std::streambuf* const cerr = std::cerr.rdbuf(said.rdbuf());
    for (int k = 0; k < 2; ++k) sgd(value_and_grad(with_loss, sgd.parameters())(batch.images, batch.labels).grads);
    // Set by the program, STAND_ALONE is what it means.
    set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
    nn::SGD meant(params);
    meant(value_and_grad(with_loss, meant.parameters())(batch.images, batch.labels).grads);
    std::cerr.rdbuf(cerr);
    set_auto_parallel_context({.parallel_mode = saved.parallel_mode, .gradients_mean = saved.gradients_mean});
    duet::detail::parallel_mode_chosen().store(chosen);
    const std::string text = said.str();
    CHECK(text.find("nn::SGD updates from gradients that were not all-reduced across the ranks") != std::string::npos);
    CHECK(text.find("duet: warning") == text.rfind("duet: warning"));
  }
}

// With a seed per rank, or one rank a start_epoch behind, the shards overlap and leave samples
// out, and each rank's batches still differ: nothing else shows it.
TEST_CASE("distributed: sharded loaders cutting different epoch orders are refused at the first step, in both loops") {
  init_two_ranks();
  const int rank = distributed::get_rank();
  set_seed(5);
  SmallNet<8> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters());
  SUBCASE("a seed per rank, TrainOneStepCell") {
    const AutoParallelContext saved = get_auto_parallel_context();
    set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
    nn::TrainOneStepCell step(with_loss, sgd);
    data::DataLoader shard(small_dataset(), 4,
                           {.shuffle = true, .seed = static_cast<std::uint64_t>(7 + rank), .num_shards = 2, .shard_id = rank});
    const data::Batch& batch = *shard.next();
    CHECK_THROWS_WITH_AS(step(batch.images, batch.labels),
                         doctest::Contains("nn::TrainOneStepCell: the ranks' sharded loaders serve different epoch orders"),
                         ValueError);
    set_auto_parallel_context({.parallel_mode = saved.parallel_mode, .gradients_mean = saved.gradients_mean});
  }
  SUBCASE("one rank an epoch behind, GradReducer") {
    distributed::GradReducer reducer(net.parameters());
    data::DataLoader shard(small_dataset(), 4, {.shuffle = true, .seed = 7, .num_shards = 2, .shard_id = rank});
    if (rank == 1) shard.start_epoch(1);
    const data::Batch& batch = *shard.next();
    const auto out = value_and_grad(with_loss, sgd.parameters())(batch.images, batch.labels);
    CHECK_THROWS_WITH_AS(reducer(out.grads, static_cast<double>(batch.labels.numel())),
                         doctest::Contains("duet::distributed::GradReducer: the ranks' sharded loaders"), ValueError);
  }
}

TEST_CASE("distributed: BatchNorm's moving statistics are the same on every rank") {
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    check_moving_statistics(mode, Loop::train_one_step_cell);
    check_moving_statistics(mode, Loop::grad_reducer);
  }
}

TEST_CASE("distributed: a loader that is not sharded is refused at the first step") {
  init_two_ranks();
  SmallNet<8> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters());
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  nn::TrainOneStepCell step(with_loss, sgd);
  data::DataLoader unsharded(small_dataset(), 4, {.shuffle = true, .seed = 7});
  const data::Batch& batch = *unsharded.next();
  CHECK_THROWS_WITH_AS(step(batch.images, batch.labels),
                       doctest::Contains("the first batch is the same on all 2 ranks"), ValueError);
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
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

TEST_CASE("distributed: the first step gives every rank rank 0's optimiser state, and evaluate refuses ranks that differ") {
  init_two_ranks();
  const int rank = distributed::get_rank();
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  const auto test_shard = [&] { return data::DataLoader(small_dataset(), 4, {.num_shards = 2, .shard_id = rank}); };
  set_seed(static_cast<std::uint64_t>(11 + rank));
  SmallNet<8> net;
  // Before the first step each rank has its own weights (as after a loop of one's own that
  // left the parallel mode STAND_ALONE): their metrics' sum would describe no network.
  CHECK_THROWS_WITH_AS(train::evaluate(net, loss, test_shard()),
                       doctest::Contains("the ranks' networks differ ('fc1.weight' first)"), ModeError);
  // Rank 0 alone has moments and a step count, as after resuming a checkpoint that rank 0 saved.
  nn::Adam adam(net.parameters(), {.learning_rate = 0.05});
  if (rank == 0) {
    std::uint64_t seed = 12;
    for (const auto& slot : adam.state()) {
      for (Tensor& t : *slot.tensors) t = uniform(t.shape(), 0.01f, 0.02f, seed++);
    }
    adam.set_global_step(5);
  }
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  nn::WithLossCell with_loss(net, loss);
  nn::TrainOneStepCell step(with_loss, adam);
  data::DataLoader shard = test_shard();
  const data::Batch& batch = *shard.next();
  step(batch.images, batch.labels);
  CHECK(adam.global_step() == 6);
  for (const auto& slot : adam.state()) {
    for (const Tensor& moment : *slot.tensors) CHECK(same_on_every_rank(moment));
  }
  for (const auto& p : net.parameters()) CHECK(same_on_every_rank(*p.parameter));
  CHECK_NOTHROW(train::evaluate(net, loss, test_shard()));
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
}

namespace {
struct DropoutNet : nn::Cell<DropoutNet> {
  SmallNet<8> body;
  nn::Dropout drop{0.5};
  DUET_CELL_MEMBERS(body, drop);
  auto construct(auto x) { return drop(body(x)); }
};
}  // namespace

TEST_CASE("distributed: the first step gives every rank rank 0's Dropout generators") {
  init_two_ranks();
  const int rank = distributed::get_rank();
  DropoutNet net;
  // Rank 0's as a checkpoint resumed on rank 0 alone leaves it: its own, the others' fresh.
  net.drop.reseed(static_cast<std::uint64_t>(100 + rank));
  const auto words = [&] {
    const GeneratorState state = net.drop.generator().state();
    BasicTensor<float> out({16});
    // Each word's 16-bit pieces, which floats hold exactly.
    for (std::size_t w = 0; w < 4; ++w) {
      for (std::size_t k = 0; k < 4; ++k) out.data()[w * 4 + k] = static_cast<float>((state.words[w] >> (16 * k)) & 0xFFFF);
    }
    return out;
  };
  Generator rank0(100);
  CHECK_FALSE(same_on_every_rank(words()));
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::SGD sgd(net.parameters());
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  nn::WithLossCell with_loss(net, loss);
  nn::TrainOneStepCell step(with_loss, sgd);
  data::DataLoader shard(small_dataset(), 4, {.num_shards = 2, .shard_id = rank});
  const data::Batch& batch = *shard.next();
  step(batch.images, batch.labels);
  CHECK(same_on_every_rank(words()));
  // Rank 0's, moved on by the step's draws: one per output, 3 per row.
  for (index_t i = 0; i < batch.images.dim(0) * 3; ++i) rank0.next();
  CHECK(net.drop.generator().state() == rank0.state());
  set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
}

// Faults: each ends the job, so ctest runs each on its own and checks the exit and the output.
// doctest catches what a case throws; terminating from the handler is what an exception that
// leaves a program's main does.
namespace {
// at_step returns false to end the rank's training there.
// Trains until at_step(k) is false, then, with `evaluate`, evaluates on a sharded loader.
void train_until(const std::function<bool(int step)>& at_step, bool evaluate = false) {
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
      if (!at_step(k)) {
        if (evaluate) {
          data::DataLoader test(small_dataset(), 4, {.num_shards = 2, .shard_id = distributed::get_rank()});
          train::evaluate(net, loss, test);
        }
        return;
      }
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
// train::evaluate's checks and sums travel apart from the steps' collectives: met with a step's,
// they ended the job in MPI's own words (MPI_ERR_TRUNCATE), or, against the first step's
// network check, with a false "the ranks' networks differ".
TEST_CASE("distributed fault: a rank that takes fewer steps then evaluates" * doctest::skip()) {
  train_until([](int k) { return k < 3 || distributed::get_rank() == 1; }, true);
}

TEST_CASE("distributed fault: a rank that evaluates before the first step" * doctest::skip()) {
  train_until([](int) { return distributed::get_rank() == 1; }, true);
}

TEST_CASE("distributed fault: a rank that takes fewer steps" * doctest::skip()) {
  train_until([](int k) { return k < 3 || distributed::get_rank() == 1; });
  try {
    std::vector<double> metrics{1, 2, 3};
    distributed::all_reduce_sum(metrics);
  } catch (...) {
    std::terminate();
  }
}
