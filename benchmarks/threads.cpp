// One thread against two (duet::set_num_threads), in wall-clock time: the seed network's
// forward in graph mode at batch 1, 64 and 256, and its Adam training step at batch 256 (the
// step train_fashion_mnist takes). The ratio of a pair's items per second is the speed-up:
//
//   duet_benchmarks --benchmark_filter=threads/ --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// The counter `shared` is the share of calls in which some operation ran on more than one
// thread: 0 for every one-thread row, and for batch 1, whose products are bound by reading the
// weights and stay on the calling thread.
#include <benchmark/benchmark.h>

#include <cstdint>

#include "../examples/network.hpp"

namespace {

using namespace duet;

// Sets the count for one benchmark and puts back the one the others run with.
struct ThreadCount {
  int saved = get_num_threads();
  explicit ThreadCount(int n) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(saved); }
};

// Calls `call` once to warm it, then once per iteration on `Threads` threads, and reports the
// share of calls that ran shared and the items (batch rows) per second.
template <int Threads, class Call>
void measure(benchmark::State& state, Call&& call) {
  if (Threads > 1 && !threads_available) {
    state.SkipWithError("built without OpenMP");
    return;
  }
  ThreadCount count(Threads);
  call();
  const long before = detail::shared_runs().load();
  for (auto _ : state) call();
  state.counters["shared"] =
      static_cast<double>(detail::shared_runs().load() - before) / static_cast<double>(state.iterations());
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

template <int Threads>
void BM_threads_forward(benchmark::State& state) {
  SeedNetwork<GRAPH_MODE> net;
  const Tensor x = uniform({state.range(0), 1, 28, 28}, 0.0f, 1.0f, 1);
  measure<Threads>(state, [&] {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  });
}

template <int Threads>
void BM_threads_train_step(benchmark::State& state) {
  const index_t batch = state.range(0);
  SeedNetwork<GRAPH_MODE> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 1e-4});
  nn::TrainOneStepCell step(with_loss, adam);
  const Tensor x = uniform({batch, 1, 28, 28}, 0.0f, 1.0f, 1);
  BasicTensor<std::int32_t> labels({batch});
  for (index_t i = 0; i < batch; ++i) labels(i) = static_cast<std::int32_t>(i % 10);
  measure<Threads>(state, [&] {
    Tensor l = step(x, labels);
    benchmark::DoNotOptimize(l.data());
  });
}

}  // namespace

BENCHMARK(BM_threads_forward<1>)->Name("threads/seed_forward/1")->Arg(1)->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK(BM_threads_forward<2>)->Name("threads/seed_forward/2")->Arg(1)->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK(BM_threads_train_step<1>)->Name("threads/train_step_adam/1")->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK(BM_threads_train_step<2>)->Name("threads/train_step_adam/2")->Arg(64)->Arg(256)->UseRealTime();
