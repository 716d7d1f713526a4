// duet's benchmarks, all in one process so that ratios between variants are fair:
//
//   build/benchmarks/duet_benchmarks --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Single-threaded, except the rows of threads.cpp that ask for two: duet is set to one thread
// here, and Eigen is kept to one (EIGEN_DONT_PARALLELIZE, from duet::duet); run the references
// with OMP_NUM_THREADS=1 too. forward.cpp: the seed network and a tiny one in both modes;
// train.cpp: one training step; jit.cpp: jit levels and PIJit; gemm.cpp: duet's matrix-product
// kernel against Eigen's; optim.cpp: optimiser updates per instruction set against a memory
// floor; threads.cpp: one thread against two.
#include <benchmark/benchmark.h>

#include <duet/duet.hpp>

int main(int argc, char** argv) {
  duet::set_num_threads(1);
  benchmark::AddCustomContext("duet_threads", "1, except threads/*/2");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
