// Elementwise operations: the chain gelu(x * w + b) at [256, 512] (w a row, b a column) fused
// into one pass by graph mode, against the same chain unfused (JitLevel::O0: one node per
// operation, each writing its value), against PyNative, and against a memory floor: one read of
// x and one write of the output, the least any implementation moves. (libtorch eager joins this
// table with issue 12's benchmark rows, when libtorch is linked.)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>

#include <duet/duet.hpp>

namespace {

using namespace duet;

constexpr index_t rows = 256;
constexpr index_t cols = 512;

auto chain = [](const auto& x, const auto& w, const auto& b) { return ops::gelu(x * w + b); };

struct Inputs {
  Tensor x = randn({rows, cols}, 1);
  Tensor w = randn({cols}, 2);
  Tensor b = randn({rows, 1}, 3);
};

void report_bytes(benchmark::State& state) {
  // What the chain must move at the least: x in, the output out.
  state.SetBytesProcessed(state.iterations() * 2 * rows * cols * static_cast<std::int64_t>(sizeof(float)));
}

template <JitLevel Level>
void BM_chain_graph(benchmark::State& state) {
  const Inputs in;
  auto compiled = jit<JitConfig{.jit_level = Level}>(chain);
  for (auto _ : state) {
    Tensor y = compiled(in.x, in.w, in.b);
    benchmark::DoNotOptimize(y.data());
  }
  report_bytes(state);
}

void BM_chain_pynative(benchmark::State& state) {
  const Inputs in;
  set_context({.mode = PYNATIVE_MODE});
  for (auto _ : state) {
    Tensor y = chain(in.x, in.w, in.b);
    benchmark::DoNotOptimize(y.data());
  }
  report_bytes(state);
}

// The floor: a copy of the same bytes, read once and written once.
void BM_chain_memory_floor(benchmark::State& state) {
  const Inputs in;
  Tensor y = zeros({rows, cols});
  for (auto _ : state) {
    std::memcpy(y.data(), in.x.data(), static_cast<std::size_t>(rows * cols) * sizeof(float));
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  report_bytes(state);
}

}  // namespace

BENCHMARK(BM_chain_graph<JitLevel::O1>)->Name("ops/gelu(x*w+b)/graph_fused");
BENCHMARK(BM_chain_graph<JitLevel::O0>)->Name("ops/gelu(x*w+b)/graph_unfused");
BENCHMARK(BM_chain_pynative)->Name("ops/gelu(x*w+b)/pynative");
BENCHMARK(BM_chain_memory_floor)->Name("ops/gelu(x*w+b)/memory_floor_copy");
