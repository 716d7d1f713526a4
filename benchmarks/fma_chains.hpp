// Chains of FMAs on registers, as many as hide the FMA latency on every x86 core with two FMA
// units (latency 4-5): the peak the products are measured against (gemm.cpp). No include
// guard: gemm.cpp includes it once per instruction set, inside the set's namespace and target
// region, with the set's Vec and fma in scope, as duet's kernels are written once per set.

inline float fma_chains(long iterations) {
  constexpr int chains = 12;
  Vec<float> acc[chains];
#pragma GCC unroll 12
  for (int i = 0; i < chains; ++i) acc[i] = Vec<float>{} + (1.0f + 0.01f * static_cast<float>(i));
  const Vec<float> scale = Vec<float>{} + 0.999f;
  const Vec<float> shift = Vec<float>{} + 0.001f;
  for (long n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < chains; ++i) acc[i] = fma<float>(acc[i], scale, shift);
  }
  float sum = 0;
  for (int i = 0; i < chains; ++i) sum += acc[i][0];
  return sum;
}

// Floating-point operations of one iteration.
inline constexpr double fma_chains_flops = 2.0 * 12 * lanes<float>;
