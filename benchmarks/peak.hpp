// One thread's FMA peak, measured once per process (gemm.cpp: independent chains of FMAs on the
// set duet's kernels run, kernel_isa()), in GFLOP/s; 0 where they run neither AVX2 nor AVX-512; and the
// loop of the rows that report GFLOP/s and `of_peak`, the share of that peak, so that a share
// means the same on every machine.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>

namespace duet_bench {

double single_thread_peak();

// Runs body once per iteration, timed here in wall time (rows registered with UseManualTime
// report that time), and reports GFLOP/s and the share of one thread's measured peak. Returns
// the mean seconds per iteration. best_of_peak is the fastest iteration's share: the peak is the
// fastest of many short runs, and on a machine shared with other work (2 cores, other builds)
// the mean counts the time the thread was not running, the fastest iteration the least of it.
template <class Body>
double timed_loop(benchmark::State& state, double flops_per_iteration, Body&& body) {
  double total = 0;
  double fastest = 1e30;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    body();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(seconds);
    total += seconds;
    fastest = std::min(fastest, seconds);
  }
  const double gflops = flops_per_iteration * static_cast<double>(state.iterations()) / total / 1e9;
  state.counters["GFLOP/s"] = gflops;
  if (const double peak = single_thread_peak(); peak > 0) {
    state.counters["of_peak"] = gflops / peak;
    state.counters["best_of_peak"] = flops_per_iteration / fastest / 1e9 / peak;
  }
  return total / static_cast<double>(state.iterations());
}

}  // namespace duet_bench
