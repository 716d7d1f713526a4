// One thread's FMA peak, measured once per process (gemm.cpp: independent chains of FMAs on the
// widest set the CPU runs), in GFLOP/s; 0 where the CPU has neither AVX2 nor AVX-512. Rows
// that report `of_peak` divide by it, so that a share means the same on every machine.
#pragma once

namespace duet_bench {

double single_thread_peak();

}  // namespace duet_bench
