// duet's benchmarks, all in one process so that ratios between variants are fair:
//
//   build/benchmarks/duet_benchmarks --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Single-threaded throughout (Eigen is built without OpenMP here). forward.cpp: the seed
// network and a tiny one in both modes; train.cpp: one training step; jit.cpp: jit levels and
// PIJit; gemm.cpp: duet's matrix-product kernel against Eigen's.
// optim.cpp: optimiser updates per instruction set against a memory floor.
#include <benchmark/benchmark.h>

BENCHMARK_MAIN();
