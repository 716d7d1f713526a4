// Elementwise operations: the chain gelu(x * w + b) at [256, 512] (w a row, b a column) fused
// into one pass by graph mode, against the same chain unfused (JitLevel::O0: one node per
// operation, each writing its value), against PyNative, against libtorch eager on one thread
// (when the benchmarks link libtorch: DUET_BENCH_TORCH), and against a memory floor: one read
// of x and one write of the output, the least any implementation moves.
//
// Then each activation alone on [256, 512] (ops/activation/<name>/duet: backend::Native's map,
// the kernel PyNative's node and a product's epilogue run, on the instruction set chosen at run
// time), against the same function's Eigen form (/eigen: backend::Eigen::map, what the Native
// backend ran before it had vector forms of its own, vectorised for the build's instruction set
// only), and the gradients of those differentiated from their input (/grad).
//
// Then what PyNative pays per operation, apart from its kernel: a chain of additions on [1, 4]
// tensors, whose kernels cost a few nanoseconds, reported per node (counter per_node).
//
//   build/benchmarks/duet_benchmarks --benchmark_filter='ops/' --benchmark_repetitions=5
//                                    --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>

#include <duet/duet.hpp>

#if DUET_BENCH_TORCH
#include <torch/torch.h>
#endif

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

#if DUET_BENCH_TORCH
// The same chain in libtorch eager mode, on one thread like duet: three operations, each
// writing its value, with torch::gelu's default (erf) form, ops::gelu's.
void BM_chain_torch(benchmark::State& state) {
  at::set_num_threads(1);
  const Inputs in;
  auto as_torch = [](const Tensor& t, at::IntArrayRef shape) {
    return torch::from_blob(const_cast<float*>(t.data()), shape, torch::kFloat32).clone();
  };
  const torch::Tensor x = as_torch(in.x, {rows, cols});
  const torch::Tensor w = as_torch(in.w, {cols});
  const torch::Tensor b = as_torch(in.b, {rows, 1});
  for (auto _ : state) {
    torch::Tensor y = torch::gelu(x * w + b);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  report_bytes(state);
}
#endif

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

// One activation over [rows, cols] in place, by Backend's map (or map_grad with Grad).
template <class Backend, class Fn, bool Grad = false>
void BM_activation(benchmark::State& state) {
  const Tensor x = randn({rows, cols}, 4);
  const Tensor dy = randn({rows, cols}, 5);
  Tensor y = zeros({rows, cols});
  for (auto _ : state) {
    if constexpr (Grad)
      Backend::template map_grad<Fn>(dy.data(), x.data(), rows * cols, y.data());
    else
      Backend::template map<Fn>(x.data(), rows * cols, y.data());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  report_bytes(state);
}

// PyNative's cost per node: state.range(0) additions, one after the other, on [1, 4] tensors.
void BM_pynative_per_node(benchmark::State& state) {
  set_context({.mode = PYNATIVE_MODE});
  const index_t nodes = state.range(0);
  const Tensor x = ones({1, 4});
  for (auto _ : state) {
    Tensor y = x;
    for (index_t i = 0; i < nodes; ++i) y = y + x;
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["per_node"] =
      benchmark::Counter(static_cast<double>(state.iterations() * nodes), benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

}  // namespace

BENCHMARK(BM_chain_graph<JitLevel::O1>)->Name("ops/gelu(x*w+b)/graph_fused");
BENCHMARK(BM_chain_graph<JitLevel::O0>)->Name("ops/gelu(x*w+b)/graph_unfused");
BENCHMARK(BM_chain_pynative)->Name("ops/gelu(x*w+b)/pynative");
#if DUET_BENCH_TORCH
BENCHMARK(BM_chain_torch)->Name("ops/gelu(x*w+b)/libtorch_eager");
#endif
BENCHMARK(BM_chain_memory_floor)->Name("ops/gelu(x*w+b)/memory_floor_copy");
#define DUET_ACTIVATION_BENCHMARKS(name, Fn)                                           \
  BENCHMARK(BM_activation<backend::Native, Fn>)->Name("ops/activation/" name "/duet"); \
  BENCHMARK(BM_activation<backend::Eigen, Fn>)->Name("ops/activation/" name "/eigen")
DUET_ACTIVATION_BENCHMARKS("sigmoid", fn::Sigmoid);
DUET_ACTIVATION_BENCHMARKS("tanh", fn::Tanh);
DUET_ACTIVATION_BENCHMARKS("gelu", fn::Gelu<false>);
DUET_ACTIVATION_BENCHMARKS("gelu_tanh", fn::Gelu<true>);
DUET_ACTIVATION_BENCHMARKS("silu", fn::Silu);
DUET_ACTIVATION_BENCHMARKS("erf", fn::Erf);
DUET_ACTIVATION_BENCHMARKS("exp", fn::Exp);
BENCHMARK(BM_activation<backend::Native, fn::Gelu<false>, true>)->Name("ops/activation/gelu/grad/duet");
BENCHMARK(BM_activation<backend::Eigen, fn::Gelu<false>, true>)->Name("ops/activation/gelu/grad/eigen");
#undef DUET_ACTIVATION_BENCHMARKS
BENCHMARK(BM_pynative_per_node)->Name("ops/pynative_per_node/add[1,4]")->Arg(16);
