// The parallel context (set_auto_parallel_context) without MPI: what data parallelism refuses
// when half of it is set up. The training itself is tested with 2 ranks in distributed.cpp.
#include <doctest/doctest.h>

#include <duet/duet.hpp>

#include "support.hpp"

namespace tests_parallel {

using namespace duet;

namespace {
// Restores STAND_ALONE after a case, even a failing one.
struct StandAloneAfter {
  StandAloneAfter() = default;
  StandAloneAfter(const StandAloneAfter&) = delete;
  StandAloneAfter& operator=(const StandAloneAfter&) = delete;
  ~StandAloneAfter() {
    set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE, .gradients_mean = false});
  }
};
}  // namespace

TEST_CASE("set_auto_parallel_context sets the fields it is given and keeps the others") {
  const StandAloneAfter restore;
  CHECK(get_auto_parallel_context().parallel_mode == ParallelMode::STAND_ALONE);
  CHECK_FALSE(get_auto_parallel_context().gradients_mean);
  set_auto_parallel_context({.gradients_mean = true});
  CHECK(get_auto_parallel_context().parallel_mode == ParallelMode::STAND_ALONE);
  CHECK(get_auto_parallel_context().gradients_mean);
  set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL});
  CHECK(get_auto_parallel_context().parallel_mode == ParallelMode::DATA_PARALLEL);
  CHECK(get_auto_parallel_context().gradients_mean);
  CHECK_THROWS_AS(set_auto_parallel_context({.parallel_mode = static_cast<ParallelMode>(7)}), ValueError);
}

TEST_CASE("DATA_PARALLEL without duet::distributed::init() refuses to train, in both modes") {
  const StandAloneAfter restore;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    nn::Dense<4, 3> net;
    nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
    nn::WithLossCell with_loss(net, loss);
    nn::SGD sgd(net.parameters());
    nn::TrainOneStepCell step(with_loss, sgd);
    const Tensor x = ones({2, 4});
    const BasicTensor<std::int32_t> y({2}, {0, 2});
    const Tensor before = net.weight.clone();
    set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL});
    CHECK_THROWS_WITH_AS(step(x, y), doctest::Contains("no rank group exists; include <duet/distributed.hpp>"),
                         ModeError);
    // An optimiser stepped by hand would update from this rank's gradients alone.
    auto value_and_grads = value_and_grad(with_loss, net.parameters());
    value_and_grads(x, y);
    CHECK_THROWS_WITH_AS(sgd.step(), doctest::Contains("nn::SGD.step(): DATA_PARALLEL, but the gradients"), ModeError);
    CHECK_THROWS_WITH_AS(sgd(value_and_grads(x, y).grads),
                         doctest::Contains("nn::SGD(grads): DATA_PARALLEL, but the gradients"), ModeError);
    CHECK(std::ranges::equal(net.weight.values(), before.values()));
    set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE});
    step(x, y);
    CHECK_FALSE(std::ranges::equal(net.weight.values(), before.values()));
  }
  set_context({.mode = PYNATIVE_MODE});
}

TEST_CASE("evaluating a sharded loader without a rank group is refused, not one shard's metrics") {
  duet_test::SeedNetwork<> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  data::DataLoader shard(data::ImageDataset(BasicTensor<std::uint8_t>({4, 28, 28}), BasicTensor<std::int32_t>({4}), 10),
                         2, {.num_shards = 2, .shard_id = 1});
  CHECK_THROWS_WITH_AS(train::evaluate(net, loss, shard),
                       doctest::Contains("the loader is shard 1 of 2, but no rank group exists"), ModeError);
}

}  // namespace tests_parallel
