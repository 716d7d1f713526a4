// Optimiser updates (kernels::adam_update, kernels::sgd_update) under each instruction set
// this CPU runs, in GB/s of the bytes an update must move, against a memory floor measured in
// the same process on the same buffers: a streaming pass that reads and writes the same arrays
// as the update, with one add per element. The update is at the limit when of_floor is near 1.
//
//   build/benchmarks/duet_benchmarks --benchmark_filter=optim
//
// The optim/*_checked rows add the optimisers' finiteness check of the gradient
// (detail::first_nonfinite, run before every step) to the update; their with_check counter is
// (check + update) / update, each timed alone in the same process.
//
// Sizes: the seed network's 669,706 parameters (Adam's four arrays are 10.7 MB, past L2) and
// 65,536 (1 MB, within L2 on this project's machines).
#include <duet/duet.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <ctime>
#include <string>
#include <vector>

#include "cpu_model.hpp"

namespace {

using namespace duet;

// The floor: each of `written` arrays gets g added, in one pass. Compiled for each instruction
// set and chosen when loaded, so the floor does not depend on the flags this file is built with.
[[gnu::target_clones("avx512f", "avx2", "default")]] void add_to_each(float* const* written, int count, const float* g,
                                                                      index_t n) {
  for (int a = 0; a < count; ++a) {
    float* __restrict x = written[a];
    for (index_t i = 0; i < n; ++i) x[i] += g[i];
  }
}

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// This thread's CPU seconds per call of f (the time Google Benchmark's rates use, which other
// processes on a shared machine do not inflate), the median of a few timed batches.
template <class F>
double seconds_per_call(F&& f) {
  constexpr int batches = 9;
  constexpr int calls = 20;
  std::vector<double> times;
  for (int b = 0; b < batches; ++b) {
    const double start = thread_seconds();
    for (int c = 0; c < calls; ++c) f();
    times.push_back((thread_seconds() - start) / calls);
  }
  std::nth_element(times.begin(), times.begin() + batches / 2, times.end());
  return times[batches / 2];
}

struct Buffers {
  explicit Buffers(index_t n)
      : p(static_cast<std::size_t>(n), 0.01f),
        g(static_cast<std::size_t>(n), 1e-3f),
        m(static_cast<std::size_t>(n), 0.0f),
        v(static_cast<std::size_t>(n), 0.0f) {}
  std::vector<float> p, g, m, v;
};

// Runs update in the benchmark loop under isa, then the floor on the same buffers: arrays is
// how many the update writes (it reads those and g).
template <class Update>
void run(benchmark::State& state, kernels::Isa isa, int arrays, Update&& update) {
  struct Restore {
    kernels::Isa saved = kernels::active_isa();
    ~Restore() { kernels::set_active_isa(saved); }
  } restore;
  kernels::set_active_isa(isa);
  const index_t n = state.range(0);
  Buffers b(n);
  for (auto _ : state) {
    update(b);
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(n) * static_cast<double>(sizeof(float)) * (2 * arrays + 1);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  float* written[] = {b.p.data(), b.m.data(), b.v.data()};
  const double floor_seconds = seconds_per_call([&] {
    add_to_each(written, arrays, b.g.data(), n);
    benchmark::ClobberMemory();
  });
  const double update_seconds = seconds_per_call([&] {
    update(b);
    benchmark::ClobberMemory();
  });
  state.counters["floor_GB/s"] = bytes / floor_seconds / 1e9;
  state.counters["of_floor"] = floor_seconds / update_seconds;
  state.SetLabel(std::string(kernels::isa_name(isa)));
}

void adam(benchmark::State& state, kernels::Isa isa) {
  const kernels::AdamCoefficients<float> c{0.9f, 0.999f, 1e-8f, 0.0f, 1.0f, 1e-3f};
  run(state, isa, 3,
      [&](Buffers& b) { kernels::adam_update(b.p.data(), b.g.data(), b.m.data(), b.v.data(), state.range(0), c); });
}

void sgd_momentum(benchmark::State& state, kernels::Isa isa) {
  const kernels::SgdCoefficients<float> c{1e-2f, 0.0f, 0.9f, 1.0f, true, false, false};
  run(state, isa, 2, [&](Buffers& b) { kernels::sgd_update(b.p.data(), b.g.data(), b.m.data(), state.range(0), c); });
}

// The update and, before it, the check every optimiser step makes of the gradient.
template <class Update>
void run_checked(benchmark::State& state, kernels::Isa isa, int arrays, Update&& update) {
  const index_t n = state.range(0);
  const auto check = [n](Buffers& b) { benchmark::DoNotOptimize(duet::detail::first_nonfinite(b.g.data(), n)); };
  run(state, isa, arrays, [&](Buffers& b) {
    check(b);
    update(b);
  });
  const kernels::Isa saved = kernels::active_isa();
  kernels::set_active_isa(isa);
  Buffers b(n);
  const double update_seconds = seconds_per_call([&] {
    update(b);
    benchmark::ClobberMemory();
  });
  const double check_seconds = seconds_per_call([&] {
    check(b);
    benchmark::ClobberMemory();
  });
  kernels::set_active_isa(saved);
  state.counters["with_check"] = (check_seconds + update_seconds) / update_seconds;
}

void adam_checked(benchmark::State& state, kernels::Isa isa) {
  const kernels::AdamCoefficients<float> c{0.9f, 0.999f, 1e-8f, 0.0f, 1.0f, 1e-3f};
  run_checked(state, isa, 3, [&](Buffers& b) {
    kernels::adam_update(b.p.data(), b.g.data(), b.m.data(), b.v.data(), state.range(0), c);
  });
}

void sgd_checked(benchmark::State& state, kernels::Isa isa) {
  const kernels::SgdCoefficients<float> c{1e-2f, 0.0f, 0.0f, 1.0f, false, false, false};
  run_checked(state, isa, 1, [&](Buffers& b) {
    kernels::sgd_update(b.p.data(), b.g.data(), static_cast<float*>(nullptr), state.range(0), c);
  });
}

// One row per instruction set the CPU runs, registered before main() runs them.
[[maybe_unused]] const bool registered = [] {
  benchmark::AddCustomContext("cpu_model", duet_bench::cpu_model());
  benchmark::AddCustomContext("kernel_isa", std::string(kernel_isa()));
  for (kernels::Isa isa : kernels::all_isas) {
    if (!kernels::cpu_supports(isa)) continue;
    const std::string name(kernels::isa_name(isa));
    benchmark::RegisterBenchmark(("optim/adam/" + name).c_str(), adam, isa)->Arg(669706)->Arg(65536);
    benchmark::RegisterBenchmark(("optim/sgd_momentum/" + name).c_str(), sgd_momentum, isa)->Arg(669706)->Arg(65536);
    benchmark::RegisterBenchmark(("optim/adam_checked/" + name).c_str(), adam_checked, isa)->Arg(669706)->Arg(65536);
    benchmark::RegisterBenchmark(("optim/sgd_checked/" + name).c_str(), sgd_checked, isa)->Arg(669706)->Arg(65536);
  }
  return true;
}();

}  // namespace
