// The dense kernel alone, on the seed network's layers: backend::Native (kernels::gemm, the
// epilogue fused in registers) against backend::Eigen (Eigen's product, then the epilogue as
// an array expression), and Native with the weight kept packed between calls (JitLevel::O2).
// Same weights, inputs and epilogues for all.
#include <duet/duet.hpp>

#include <benchmark/benchmark.h>

namespace {

using namespace duet;

template <class Backend, bool PackedWeight, index_t In, index_t Out, class... Fns>
void BM_dense(benchmark::State& state) {
  const index_t rows = state.range(0);
  const Tensor x = uniform<float>({rows, In}, -1.0f, 1.0f);
  const nn::Parameter w(uniform<float>({Out, In}, -0.05f, 0.05f));
  const Tensor b = uniform<float>({Out}, -0.05f, 0.05f);
  const Epilogue<float, Fns...> epilogue{b.data()};
  Tensor y = zeros({rows, Out});
  for (auto _ : state) {
    if constexpr (PackedWeight) Backend::template dense_packed<In, Out>(x.data(), rows, In, w, Out, epilogue, y.data());
    else Backend::template dense<In, Out>(x.data(), rows, In, w.data(), Out, epilogue, y.data());
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * rows * In * Out);  // multiply-adds
}

}  // namespace

BENCHMARK(BM_dense<backend::Native, false, 784, 512, fn::Relu>)->Name("gemm/native/784x512+relu")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Native, true, 784, 512, fn::Relu>)->Name("gemm/native_packed/784x512+relu")->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Eigen, false, 784, 512, fn::Relu>)->Name("gemm/eigen/784x512+relu")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Native, false, 512, 512, fn::Relu>)->Name("gemm/native/512x512+relu")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Native, true, 512, 512, fn::Relu>)->Name("gemm/native_packed/512x512+relu")->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Eigen, false, 512, 512, fn::Relu>)->Name("gemm/eigen/512x512+relu")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Native, false, 512, 10>)->Name("gemm/native/512x10")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_dense<backend::Eigen, false, 512, 10>)->Name("gemm/eigen/512x10")->Arg(1)->Arg(64)->Arg(256);
