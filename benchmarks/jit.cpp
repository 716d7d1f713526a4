// The seed network forward at each jit level, single-threaded, and PIJit on the same network
// built at run time from DynamicCells, against plain PyNative on that network; and PIJit on
// the seed network with GELU for ReLU, replayed op by op (O0) and with each GELU taken into
// the product before it (O1).
#include <benchmark/benchmark.h>

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

}  // namespace

BENCHMARK(BM_jit_level<JitLevel::O0>)->Name("jit/O0")->Arg(1)->Arg(64);
BENCHMARK(BM_jit_level<JitLevel::O1>)->Name("jit/O1")->Arg(1)->Arg(64);
BENCHMARK(BM_jit_level<JitLevel::O2>)->Name("jit/O2")->Arg(1)->Arg(64);
BENCHMARK(BM_pijit<>)->Name("jit/PIJit_runtime_network")->Arg(1)->Arg(64);
BENCHMARK(BM_runtime_network_pynative)->Name("jit/pynative_runtime_network")->Arg(1)->Arg(64);
BENCHMARK(BM_pijit<nn::GELU, JitLevel::O0>)->Name("jit/PIJit_gelu_network_O0")->Arg(1)->Arg(64);
BENCHMARK(BM_pijit<nn::GELU, JitLevel::O1>)->Name("jit/PIJit_gelu_network_O1")->Arg(1)->Arg(64);
