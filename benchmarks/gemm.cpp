// The dense kernel alone, on the seed network's layers: backend::Native (kernels::gemm, the
// epilogue fused in registers) against backend::Eigen (Eigen's product, then the epilogue as
// an array expression), Native with the weight kept packed between calls (inference graphs at O1 and O2), and,
// where they are found, OpenBLAS's sgemm and oneDNN's matmul with the same bias and ReLU.
// Same weights, inputs and epilogues for all.
//
// Every row reports GFLOP/s and `of_peak`, the share of the FMA peak measured in the same
// process (gemm/fma_peak/<set>: independent chains of FMAs on the set duet's kernels run, one
// thread; /threads:2 on two), so that the rows mean something on any machine, and a run under
// DUET_ISA=avx2 on an AVX-512 machine measures its AVX2 rows against AVX2's peak. Batch 1 is
// bound by reading the weights instead: gemm/weight_read/<in>x<out> streams the same bytes once
// per iteration (the floor), and the batch-1 rows report `of_floor`. gemm/tile/L1 and /L2 run
// the blocked product's tile alone on data in L1 or L2 (tile_sweep.hpp): the products' ceiling.
// On a machine shared with other work, `best_of_peak` (the fastest iteration) is the figure to
// read: the mean counts the time the thread waited for a core.
#include <duet/duet.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_map>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef DUET_BENCH_OPENBLAS
#include <cblas.h>
#endif
#ifdef DUET_BENCH_DNNL
#include <dnnl.hpp>
#endif

#include "peak.hpp"

// ---- The limits ------------------------------------------------------------------------------

#if DUET_X86_KERNELS
DUET_BEGIN_AVX2
namespace duet_bench::avx2 {
using namespace duet::kernels::detail::avx2;
#include "fma_chains.hpp"
#include "tile_sweep.hpp"
}  // namespace duet_bench::avx2
DUET_END_ISA

DUET_BEGIN_AVX512
namespace duet_bench::avx512 {
using namespace duet::kernels::detail::avx512;
#include "fma_chains.hpp"
#include "tile_sweep.hpp"
}  // namespace duet_bench::avx512
DUET_END_ISA
#endif

namespace {

using namespace duet;

// The chains on the set duet's kernels run (kernel_isa(): the widest the CPU has, unless
// DUET_ISA chose a narrower one), and their floating-point operations per iteration. A share of
// the peak compares a kernel with what its own instructions can do: AVX2's FMAs are half as
// wide, so its rows against AVX-512's peak would read as half speed.
struct Peak {
  double flops_per_iteration = 0;
  float (*run)(long) = nullptr;
  std::string isa;
};

Peak kernels_fma() {
#if DUET_X86_KERNELS
  switch (kernels::active_isa()) {
    case kernels::Isa::avx512: return {duet_bench::avx512::fma_chains_flops, duet_bench::avx512::fma_chains, "avx512"};
    case kernels::Isa::avx2: return {duet_bench::avx2::fma_chains_flops, duet_bench::avx2::fma_chains, "avx2"};
    default: break;
  }
#endif
  return {};
}

// GFLOP/s of the chains on `threads` threads together, in wall time: the fastest of runs of
// 2 ms or so, short enough that some run without being preempted on a loaded machine (runs of
// 45 ms measured 122 GFLOP/s of 177 on the Xeon under a load of 3).
double measure_peak(int threads, double seconds) {
  const Peak peak = kernels_fma();
  if (peak.run == nullptr) return 0;
  const long iterations = 1'000'000;
  double best = 0;
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
       std::chrono::steady_clock::now() < until;) {
    const auto start = std::chrono::steady_clock::now();
    float sink = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : sink)
#endif
    sink += peak.run(iterations);
    benchmark::DoNotOptimize(sink);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, peak.flops_per_iteration * static_cast<double>(iterations) * threads / elapsed / 1e9);
  }
  return best;
}

}  // namespace

double duet_bench::single_thread_peak() {
  static const double peak = measure_peak(1, 1.0);
  return peak;
}

namespace {

void BM_fma_peak(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  if (kernels_fma().run == nullptr) {
    state.SkipWithError("duet's kernels run neither AVX2 nor AVX-512 here");
    return;
  }
#ifndef _OPENMP
  if (threads > 1) {
    state.SkipWithError("built without OpenMP");
    return;
  }
#endif
  double gflops = 0;
  for (auto _ : state) gflops = measure_peak(threads, 0.2);
  state.counters["GFLOP/s"] = gflops;
  state.SetLabel(kernels_fma().isa);
}

// The ceiling of the blocked product: its tile alone, on the set duet's kernels run, over a K
// block whose panel of B takes Bytes (32 KiB: in a 48 KiB L1 with the tile's rows of A; 256 KiB,
// the product's largest K block, from L2), down 1 tile (L1) or 10 (60 rows of A, in L2 with
// B). No packing, no edges, no epilogue: C's tiles are loaded, added to and stored.
template <index_t Bytes, int Tiles>
void BM_tile(benchmark::State& state) {
  struct Sweep {
    int rows = 0;
    int columns = 0;
    void (*run)(index_t, const float*, int, const float*, float*) = nullptr;
  };
  Sweep sweep;
#if DUET_X86_KERNELS
  switch (kernels::active_isa()) {
    case kernels::Isa::avx512:
      sweep = {duet_bench::avx512::sweep_rows, duet_bench::avx512::sweep_columns, duet_bench::avx512::tile_sweep};
      break;
    case kernels::Isa::avx2:
      sweep = {duet_bench::avx2::sweep_rows, duet_bench::avx2::sweep_columns, duet_bench::avx2::tile_sweep};
      break;
    default:
      break;
  }
#endif
  if (sweep.run == nullptr) {
    state.SkipWithError("duet's kernels run neither AVX2 nor AVX-512 here");
    return;
  }
  const index_t depth = Bytes / (sweep.columns * static_cast<index_t>(sizeof(float)));
  const Tensor a = uniform<float>({Tiles * sweep.rows, depth}, -1.0f, 1.0f);
  const Tensor b = uniform<float>({depth, sweep.columns}, -1.0f, 1.0f);
  Tensor c = zeros({Tiles * sweep.rows, sweep.columns});
  // Enough tiles per timed iteration that the clock's own cost does not count.
  const int repeats = std::max(1, static_cast<int>(4'000'000 / (2 * depth * Tiles * sweep.rows * sweep.columns)));
  duet_bench::timed_loop(state, 2.0 * static_cast<double>(repeats * Tiles * sweep.rows * sweep.columns * depth), [&] {
    for (int r = 0; r < repeats; ++r) sweep.run(depth, a.data(), Tiles, b.data(), c.data());
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  });
  state.SetLabel(kernels_fma().isa + ", " + std::to_string(sweep.rows) + " x " + std::to_string(sweep.columns) +
                 " tile, k " + std::to_string(depth));
}

// Reading In x Out floats once, four 16-byte vectors at a time (more than L3 or memory
// deliver per cycle, on any x86-64 build): the time a batch-1 product cannot beat.
template <index_t In, index_t Out>
double weight_read_seconds(const float* w) {
  using Quad = float __attribute__((vector_size(16)));
  constexpr index_t n = In * Out;
  static_assert(n % 16 == 0);
  double best = 1e9;
  for (int repeat = 0; repeat < 50; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    Quad s[4] = {};
    for (index_t i = 0; i < n; i += 16) {
      for (int q = 0; q < 4; ++q) {
        Quad v;
        std::memcpy(&v, w + i + 4 * q, sizeof v);
        s[q] += v;
      }
    }
    const Quad total = s[0] + s[1] + s[2] + s[3];
    benchmark::DoNotOptimize(total);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// ---- duet and Eigen ------------------------------------------------------------------------

template <class Backend, bool PackedWeight, index_t In, index_t Out, class... Fns>
void BM_dense(benchmark::State& state) {
  const index_t rows = state.range(0);
  const Tensor x = uniform<float>({rows, In}, -1.0f, 1.0f);
  const nn::Parameter w(uniform<float>({Out, In}, -0.05f, 0.05f));
  const Tensor b = uniform<float>({Out}, -0.05f, 0.05f);
  const Epilogue<float, Fns...> epilogue{b.data()};
  Tensor y = zeros({rows, Out});
  const double seconds = duet_bench::timed_loop(state, 2.0 * static_cast<double>(rows * In * Out), [&] {
    if constexpr (PackedWeight) Backend::template dense_packed<In, Out>(x.data(), rows, In, w, Out, epilogue, y.data());
    else Backend::template dense<In, Out>(x.data(), rows, In, w.data(), Out, epilogue, y.data());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  });
  if (rows == 1) state.counters["of_floor"] = weight_read_seconds<In, Out>(w.data()) / seconds;
}

// A layer's weight gradient dw[Out, In] = dzᵀ · x over a batch of rows, as Native's
// dense_backward takes it (gemm_kn, dz transposed beforehand): summed over the rows in halves
// (kernels/detail/halves.hpp, what training runs) or in one chain, which is what the halves cost.
template <index_t In, index_t Out, bool Halves>
void BM_weight_gradient(benchmark::State& state) {
  const index_t rows = state.range(0);
  const Tensor dzt = uniform<float>({Out, rows}, -1.0f, 1.0f);
  const Tensor x = uniform<float>({rows, In}, -1.0f, 1.0f);
  Tensor dw = zeros({Out, In});
  duet_bench::timed_loop(state, 2.0 * static_cast<double>(rows * In * Out), [&] {
    kernels::gemm_kn(dzt.data(), Out, rows, x.data(), In, dw.data(), false, Halves);
    benchmark::DoNotOptimize(dw.data());
    benchmark::ClobberMemory();
  });
}

template <index_t In, index_t Out>
void BM_weight_read(benchmark::State& state) {
  const Tensor w = uniform<float>({Out, In}, -0.05f, 0.05f);
  double seconds = 0;
  for (auto _ : state) {
    seconds = weight_read_seconds<In, Out>(w.data());
    state.SetIterationTime(seconds);
  }
  state.counters["GB/s"] = static_cast<double>(In * Out) * sizeof(float) / seconds / 1e9;
}

// ---- References ----------------------------------------------------------------------------

#ifdef DUET_BENCH_OPENBLAS
// sgemm, then the bias and ReLU in one pass over the output, as a user of BLAS writes it.
template <index_t In, index_t Out, bool Relu>
void BM_openblas(benchmark::State& state) {
  const index_t rows = state.range(0);
  const Tensor x = uniform<float>({rows, In}, -1.0f, 1.0f);
  const Tensor w = uniform<float>({Out, In}, -0.05f, 0.05f);
  const Tensor b = uniform<float>({Out}, -0.05f, 0.05f);
  Tensor y = zeros({rows, Out});
  openblas_set_num_threads(1);
  duet_bench::timed_loop(state, 2.0 * static_cast<double>(rows * In * Out), [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), Out, In, 1.0f, x.data(), In, w.data(),
                In, 0.0f, y.data(), Out);
    float* out = y.data();
    for (index_t r = 0; r < rows; ++r, out += Out) {
      for (index_t j = 0; j < Out; ++j) out[j] = Relu ? std::max(out[j] + b.data()[j], 0.0f) : out[j] + b.data()[j];
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  });
}
#endif

#ifdef DUET_BENCH_DNNL
// oneDNN's matmul primitive, made once outside the loop: c[m, n] = a[m, k] · b, b stored as
// [k, n] (format tag ab) or, a weight as duet stores it, as [n, k] (tag ba), with the bias (and
// a ReLU post-op, its fused epilogue) or neither.
void onednn_matmul(benchmark::State& state, index_t m, index_t k, index_t n, bool b_kn, bool epilogue, bool relu) {
  using tag = dnnl::memory::format_tag;
  constexpr auto f32 = dnnl::memory::data_type::f32;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  const dnnl::memory::desc a_md{{m, k}, f32, tag::ab}, b_md{{k, n}, f32, b_kn ? tag::ab : tag::ba},
      bias_md{{1, n}, f32, tag::ab}, c_md{{m, n}, f32, tag::ab};
  dnnl::post_ops post;
  if (epilogue && relu) post.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(post);
  const dnnl::matmul::primitive_desc pd = epilogue
                                              ? dnnl::matmul::primitive_desc{{a_md, b_md, bias_md, c_md}, attr, engine}
                                              : dnnl::matmul::primitive_desc{{a_md, b_md, c_md}, engine};
  const dnnl::matmul matmul{pd};
  const Tensor a = uniform<float>({m, k}, -1.0f, 1.0f);
  const Tensor b = uniform<float>({k, n}, -0.05f, 0.05f);
  const Tensor bias = uniform<float>({n}, -0.05f, 0.05f);
  Tensor c = zeros({m, n});
  dnnl::memory a_mem{a_md, engine, const_cast<float*>(a.data())}, b_mem{b_md, engine, const_cast<float*>(b.data())},
      bias_mem{bias_md, engine, const_cast<float*>(bias.data())}, c_mem{c_md, engine, c.data()};
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
  if (epilogue) args.emplace(DNNL_ARG_BIAS, bias_mem);
  duet_bench::timed_loop(state, 2.0 * static_cast<double>(m * k * n), [&] {
    matmul.execute(stream, args);
    stream.wait();
    benchmark::DoNotOptimize(c.data());
  });
}

// A layer's forward product with its bias, and its ReLU where Relu.
template <index_t In, index_t Out, bool Relu = true>
void BM_onednn(benchmark::State& state) {
  onednn_matmul(state, state.range(0), In, Out, false, true, Relu);
}

// The weight gradient's product, dw[Out, In] = dzᵀ[Out, rows] · x[rows, In].
template <index_t In, index_t Out>
void BM_onednn_weight_gradient(benchmark::State& state) {
  onednn_matmul(state, Out, state.range(0), In, true, false, false);
}
#endif

}  // namespace

BENCHMARK(BM_fma_peak)->Name("gemm/fma_peak/threads")->Arg(1)->Arg(2)->Iterations(3)->UseRealTime();
BENCHMARK(BM_tile<32 * 1024, 1>)->Name("gemm/tile/L1")->UseManualTime();
BENCHMARK(BM_tile<kernels::detail::panel_block_bytes, 10>)->Name("gemm/tile/L2")->UseManualTime();
BENCHMARK(BM_weight_read<784, 512>)->Name("gemm/weight_read/784x512")->UseManualTime();
BENCHMARK(BM_weight_read<512, 512>)->Name("gemm/weight_read/512x512")->UseManualTime();
BENCHMARK(BM_dense<backend::Native, false, 784, 512, fn::Relu>)->Name("gemm/native/784x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Native, true, 784, 512, fn::Relu>)->Name("gemm/native_packed/784x512+relu")->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Eigen, false, 784, 512, fn::Relu>)->Name("gemm/eigen/784x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Native, false, 512, 512, fn::Relu>)->Name("gemm/native/512x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Native, true, 512, 512, fn::Relu>)->Name("gemm/native_packed/512x512+relu")->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Eigen, false, 512, 512, fn::Relu>)->Name("gemm/eigen/512x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Native, false, 512, 10>)->Name("gemm/native/512x10")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Native, true, 512, 10>)->Name("gemm/native_packed/512x10")->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_dense<backend::Eigen, false, 512, 10>)->Name("gemm/eigen/512x10")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_weight_gradient<784, 512, true>)->Name("gemm/weight_gradient/native/784x512")->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_weight_gradient<784, 512, false>)->Name("gemm/weight_gradient/native_chain/784x512")->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_weight_gradient<512, 512, true>)->Name("gemm/weight_gradient/native/512x512")->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_weight_gradient<512, 512, false>)->Name("gemm/weight_gradient/native_chain/512x512")->Arg(64)->Arg(256)->UseManualTime();
#ifdef DUET_BENCH_OPENBLAS
BENCHMARK(BM_openblas<784, 512, true>)->Name("gemm/openblas/784x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_openblas<512, 512, true>)->Name("gemm/openblas/512x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_openblas<512, 10, false>)->Name("gemm/openblas/512x10")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
#endif
#ifdef DUET_BENCH_DNNL
BENCHMARK(BM_onednn<784, 512>)->Name("gemm/onednn/784x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_onednn<512, 512>)->Name("gemm/onednn/512x512+relu")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_onednn<512, 10, false>)->Name("gemm/onednn/512x10")->Arg(1)->Arg(64)->Arg(256)->UseManualTime();
BENCHMARK(BM_onednn_weight_gradient<784, 512>)
    ->Name("gemm/weight_gradient/onednn/784x512")
    ->Arg(64)
    ->Arg(256)
    ->UseManualTime();
BENCHMARK(BM_onednn_weight_gradient<512, 512>)
    ->Name("gemm/weight_gradient/onednn/512x512")
    ->Arg(64)
    ->Arg(256)
    ->UseManualTime();
#endif
