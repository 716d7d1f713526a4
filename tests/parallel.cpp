// The parallel context (set_auto_parallel_context) without MPI: what data parallelism refuses
// when half of it is set up. The training itself is tested with 2 ranks in distributed.cpp.
#include <doctest/doctest.h>

#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

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


namespace {
// `ranks` ranks with this rank's data: every sum is the value times `ranks`, exact for 2. A
// data-parallel step over it must give one process's step bit for bit (each rank's share of
// the mean is 1/2, exact too). It notes whether gradients were sent while backward ran.
class MirrorRuntime final : public duet::detail::DataParallelRuntime {
 public:
  int rank() const override { return 0; }
  int group_size() const override { return ranks; }
  void broadcast_parameters(const std::vector<nn::NamedParameter<float>>&) override {}
  void all_reduce_gradients(std::span<const duet::detail::GradientView> grads, std::span<double> values, bool mean,
                            const std::function<float*(std::size_t)>& write) override {
    const double weight = values[0];
    for (double& v : values) v *= ranks;
    const auto share = static_cast<float>(!mean ? weight : values[0] > 0 ? weight / values[0] : 0.0);
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].data == nullptr) continue;
      std::vector<float> g(grads[i].data, grads[i].data + grads[i].size);
      float* to = write(i);
      for (std::size_t k = 0; k < g.size(); ++k) to[k] = g[k] * share * static_cast<float>(ranks);
    }
  }
  // Mirrored ranks hold the same batches, which the first step refuses as a loader not sharded:
  // this answers as ranks with shards of one epoch order would (the order the same, the rest not).
  bool same_on_every_rank(std::uint64_t hash, duet::detail::Stream) override {
    return hash == data::detail::served_order().load();
  }
  void all_reduce_sum(std::span<double> values, duet::detail::Stream) override {
    for (double& v : values) v *= ranks;
  }
  void start_sum(float* data, index_t n) override {
    sent_during_backward = sent_during_backward || duet::detail::gradient_observer() != nullptr;
    ++gradient_sums;
    for (index_t k = 0; k < n; ++k) data[k] *= static_cast<float>(ranks);
  }
  void start_sum(std::span<double> values) override { all_reduce_sum(values, duet::detail::Stream::steps); }
  void test_sums() override {}
  void wait_sums(std::string_view) override {}
  bool overlaps_backward() const override { return true; }
  std::size_t bucket_bytes() const override { return 1024; }

  int ranks = 2;
  bool sent_during_backward = false;
  int gradient_sums = 0;
};

// Installs a runtime and DATA_PARALLEL for its lifetime.
struct MirrorScope {
  explicit MirrorScope(MirrorRuntime& runtime) {
    duet::detail::data_parallel_runtime().store(&runtime);
    set_auto_parallel_context({.parallel_mode = ParallelMode::DATA_PARALLEL, .gradients_mean = true});
  }
  MirrorScope(const MirrorScope&) = delete;
  MirrorScope& operator=(const MirrorScope&) = delete;
  ~MirrorScope() {
    duet::detail::data_parallel_runtime().store(nullptr);
    set_auto_parallel_context({.parallel_mode = ParallelMode::STAND_ALONE, .gradients_mean = false});
  }
};

// A 128 -> 160 product (80 KB of weight: summed in place) and small ones (bucketed).
struct Net : nn::Cell<Net> {
  nn::Dense<128, 160> fc1;
  nn::ReLU relu;
  nn::Dense<160, 10> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);
  auto construct(auto x) { return fc2(relu(fc1(x))); }
};

// The parameters after `steps` Adam steps, alone or over the mirror.
std::vector<std::vector<float>> trained(Mode mode, MirrorRuntime* mirror, int steps) {
  set_context({.mode = mode});
  set_seed(5);
  Net net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 0.01});
  nn::TrainOneStepCell step(with_loss, adam);
  std::optional<MirrorScope> scope;
  if (mirror != nullptr) scope.emplace(*mirror);
  for (int s = 0; s < steps; ++s) {
    const Tensor x = uniform<float>({8, 128}, -1.0f, 1.0f, static_cast<std::uint64_t>(10 + s));
    BasicTensor<std::int32_t> y({8});
    for (index_t r = 0; r < 8; ++r) y.values()[static_cast<std::size_t>(r)] = static_cast<std::int32_t>((r * 3 + s) % 10);
    step(x, y);
  }
  std::vector<std::vector<float>> params;
  for (const auto& p : net.parameters()) params.emplace_back(p.parameter->values().begin(), p.parameter->values().end());
  return params;
}
}  // namespace

TEST_CASE("data parallelism sums gradients while backward runs, with one process's result, in both modes") {
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    CAPTURE(mode);
    MirrorRuntime mirror;
    const auto alone = trained(mode, nullptr, 4);
    const auto parallel = trained(mode, &mirror, 4);
    CHECK(parallel == alone);
    // The first step counts each gradient's writes and sums after backward; the next three
    // send gradients before backward has ended, in 4 units each: fc2's bias, fc2's weight and
    // fc1's bias each in a bucket (1 KB buckets), fc1's weight in place.
    CHECK(mirror.sent_during_backward);
    CHECK(mirror.gradient_sums == 3 * 4);
  }
  set_context({.mode = PYNATIVE_MODE});
}

// What makes 2 ranks train as one process: a batch's mean gradient is the mean of its halves'
// gradients to the bit (the layers sum over the batch in halves, and the loader gives rank k
// the k-th half), under every instruction set and in both modes.
TEST_CASE("a batch's gradients are the mean of its halves' gradients, to the bit, in both modes" *
          duet_test::every_isa) {
  duet_test::for_each_isa([&] {
    for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
      for (const index_t rows : {64, 50, 34, 256}) {
        CAPTURE(mode);
        CAPTURE(rows);
        set_context({.mode = mode});
        set_seed(3);
        Net net;
        nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
        nn::WithLossCell with_loss(net, loss);
        auto grads_of = value_and_grad(with_loss, net.parameters());
        const Tensor x = uniform<float>({rows, 128}, -1.0f, 1.0f, 17);
        BasicTensor<std::int32_t> y({rows});
        for (index_t r = 0; r < rows; ++r)
          y.values()[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(r * 7 % 10);
        const auto half = [&](index_t r0, index_t r1) {
          Tensor xs({r1 - r0, 128});
          BasicTensor<std::int32_t> ys({r1 - r0});
          std::copy(x.data() + r0 * 128, x.data() + r1 * 128, xs.data());
          std::copy(y.data() + r0, y.data() + r1, ys.data());
          return grads_of(xs, ys).grads;
        };
        const auto whole = grads_of(x, y).grads;
        const auto first = half(0, rows / 2);
        const auto second = half(rows / 2, rows);
        REQUIRE(whole.size() == 4);
        for (std::size_t i = 0; i < whole.size(); ++i) {
          CAPTURE(i);
          bool same = true;
          for (index_t k = 0; k < whole[i].numel(); ++k) {
            same = same && whole[i].data()[k] == first[i].data()[k] * 0.5f + second[i].data()[k] * 0.5f;
          }
          CHECK(same);
        }
      }
    }
  });
  set_context({.mode = PYNATIVE_MODE});
}

namespace {
// Uses fc twice from its second call on, in PyNative mode: its backward then writes fc's
// gradients twice, where the first step wrote them once.
struct Changing : nn::Cell<Changing, PYNATIVE_MODE> {
  nn::Dense<4, 4> fc;
  DUET_CELL_MEMBERS(fc);
  int calls = 0;
  Tensor construct(const Tensor& x) { return ++calls == 1 ? fc(x) : fc(fc(x)); }
};
}  // namespace

TEST_CASE("a gradient written after it was sent to the other ranks is an error, not a wrong sum") {
  MirrorRuntime mirror;
  Changing net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD sgd(net.parameters());
  nn::TrainOneStepCell step(with_loss, sgd);
  const MirrorScope scope(mirror);
  const Tensor x = ones({2, 4});
  const BasicTensor<std::int32_t> y({2}, {0, 2});
  step(x, y);
  CHECK_THROWS_WITH_AS(step(x, y), doctest::Contains("after it was sent to the other ranks: this step writes it more "
                                                     "often (2 times) than the first step did (1)"),
                       ModeError);
}

}  // namespace tests_parallel
