// The seed network forward at each jit level, single-threaded, and PIJit on the same network
// built at run time from DynamicCells, against plain PyNative on that network; and PIJit on
// the seed network with GELU for ReLU, replayed op by op (O0) and with each GELU taken into
// the product before it (O1). And the first call of a new jitted function, with and without
// precompile.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "../examples/network.hpp"

namespace {

using namespace duet;

template <JitLevel Level>
void BM_jit_level(benchmark::State& state) {
  Network net;
  auto run = jit<JitConfig{.jit_level = Level}>([&](auto x) { return net(x); });
  const Tensor x = ones({state.range(0), 1, 28, 28});
  for (auto _ : state) {
    Tensor y = run(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// The seed network with its sizes known only at run time, Act after each hidden layer.
template <class Act = nn::ReLU>
nn::DynamicSequentialCell runtime_seed_network() {
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  net.append(nn::Dense<>(784, 512));
  net.append(Act{});
  net.append(nn::Dense<>(512, 512));
  net.append(Act{});
  net.append(nn::Dense<>(512, 10));
  return net;
}

template <class Act = nn::ReLU, JitLevel Level = JitConfig{}.jit_level>
void BM_pijit(benchmark::State& state) {
  auto net = runtime_seed_network<Act>();
  auto run = jit<JitConfig{.jit_level = Level}>([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit});
  const Tensor x = ones({state.range(0), 1, 28, 28});
  for (auto _ : state) {
    Tensor y = run(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_runtime_network_pynative(benchmark::State& state) {
  auto net = runtime_seed_network<>();
  const Tensor x = ones({state.range(0), 1, 28, 28});
  for (auto _ : state) {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// The latency of a jitted function's first call, the request that would stall a server: without
// precompile it compiles the form (PSJit: captures, plans and packs each weight; PIJit:
// traces), with it the form was made ahead and the call only runs. A new network per
// iteration, since packed weights are kept by the parameters; the timer (manual) covers
// the first call alone. On a shared machine a preempted call weighs on the mean, so the
// counters give medians: of the first call, and of the second (the same form run again), whose
// difference is the stall.
template <JitMode Mode, JitLevel Level, bool Precompiled>
void BM_first_call(benchmark::State& state) {
  const Tensor x = ones({state.range(0), 1, 28, 28});
  const TensorSpec spec{float32, x.shape()};
  std::vector<double> first, second;
  const auto timed = [&](auto& run) {
    const auto start = std::chrono::steady_clock::now();
    Tensor y = run(x);
    benchmark::DoNotOptimize(y.data());
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (auto _ : state) {
    const auto first_and_second = [&](auto& run) {
      if constexpr (Precompiled) run.precompile(spec);
      first.push_back(timed(run));
      second.push_back(timed(run));
    };
    if constexpr (Mode == JitMode::PSJit) {
      auto net = std::make_unique<Network>();
      auto run = jit<JitConfig{.jit_level = Level}>([&](auto v) { return (*net)(v); });
      first_and_second(run);
    } else {
      auto net = runtime_seed_network<>();
      auto run = jit<JitConfig{.jit_level = Level}>([&](const Tensor& v) { return net(v); }, {.mode = JitMode::PIJit});
      first_and_second(run);
    }
    state.SetIterationTime(first.back());
  }
  const auto median_us = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2] * 1e6;
  };
  state.counters["first_us"] = median_us(first);
  state.counters["second_us"] = median_us(second);
}

}  // namespace

BENCHMARK(BM_jit_level<JitLevel::O0>)->Name("jit/O0")->Arg(1)->Arg(64);
BENCHMARK(BM_jit_level<JitLevel::O1>)->Name("jit/O1")->Arg(1)->Arg(64);
BENCHMARK(BM_jit_level<JitLevel::O2>)->Name("jit/O2")->Arg(1)->Arg(64);
BENCHMARK(BM_pijit<>)->Name("jit/PIJit_runtime_network")->Arg(1)->Arg(64);
BENCHMARK(BM_runtime_network_pynative)->Name("jit/pynative_runtime_network")->Arg(1)->Arg(64);
BENCHMARK(BM_pijit<nn::GELU, JitLevel::O0>)->Name("jit/PIJit_gelu_network_O0")->Arg(1)->Arg(64);
BENCHMARK(BM_pijit<nn::GELU, JitLevel::O1>)->Name("jit/PIJit_gelu_network_O1")->Arg(1)->Arg(64);

BENCHMARK(BM_first_call<JitMode::PSJit, JitLevel::O1, false>)->Name("jit/first_call/PSJit_O1")->Arg(1)->Arg(64)->UseManualTime()->Iterations(100);
BENCHMARK(BM_first_call<JitMode::PSJit, JitLevel::O1, true>)->Name("jit/first_call/PSJit_O1_precompiled")->Arg(1)->Arg(64)->UseManualTime()->Iterations(100);
BENCHMARK(BM_first_call<JitMode::PIJit, JitLevel::O1, false>)->Name("jit/first_call/PIJit_O1")->Arg(1)->Arg(64)->UseManualTime()->Iterations(100);
BENCHMARK(BM_first_call<JitMode::PIJit, JitLevel::O1, true>)->Name("jit/first_call/PIJit_O1_precompiled")->Arg(1)->Arg(64)->UseManualTime()->Iterations(100);
