// Convolutional networks, single-threaded: LeNet-5 (examples/lenet5.hpp) forward at batch 1
// and 64 and one training step at batch 64 (Adam), and a 3x3 convolution 64->64 (pad 1, with
// bias) on 28x28 at batch 32, forward and forward+backward (the gradients of the input, the
// weight and the bias). duet in graph mode and PyNative mode, against libtorch eager
// (DUET_BENCH_TORCH) and, for the convolution, oneDNN's convolution primitives
// (DUET_BENCH_DNNL: f32, nchw, the CPU engine), all in this process on the same sizes:
//
//   OMP_NUM_THREADS=1 build/benchmarks/duet_benchmarks --benchmark_filter=conv/
//       --benchmark_repetitions=5 --benchmark_report_aggregates_only=true   (one line)
//
// The CPU and the kernels' instruction set are in the table's context (optim.cpp adds them).
// duet's forward+backward row differentiates sum(conv(x) · dy), which adds one elementwise
// product and a sum to the convolution's three products.
//
// The evaluation rows run LeNet-5 and examples/resnet_fashion's network (set_train(false)) at
// batch 64 in graph mode at O0, where each convolution, BatchNorm and ReLU is its own pass,
// and at O1, where each BatchNorm is folded into the convolution before it and bias and ReLU
// run in the convolution's epilogue (LeNet-5 has no BatchNorm: only the epilogue).
#include <duet/duet.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>

#include "../examples/lenet5.hpp"
#include "../examples/resnet_fashion.hpp"

#if DUET_BENCH_TORCH
#include <torch/torch.h>

#include "torch_nets.hpp"
#endif
#if DUET_BENCH_DNNL
#include <dnnl.hpp>
#endif

namespace {

using namespace duet;

// The convolution row's sizes.
constexpr index_t batch = 32, channels = 64, size = 28;

BasicTensor<std::int32_t> labels_for(index_t n) {
  BasicTensor<std::int32_t> labels({n});
  for (index_t i = 0; i < n; ++i) labels(i) = static_cast<std::int32_t>(i % 10);
  return labels;
}

// Sets the context's mode for one benchmark and puts the previous one back.
struct ModeScope {
  explicit ModeScope(Mode mode) { set_context({.mode = mode}); }
  ~ModeScope() { set_context({.mode = saved}); }
  Mode saved = get_context().mode;
};

template <Mode M>
void lenet5_forward(benchmark::State& state) {
  const ModeScope scope(M);
  LeNet5 net;
  const Tensor x = uniform({state.range(0), 1, 28, 28}, 0.0f, 1.0f, 1);
  for (auto _ : state) {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

template <Mode M>
void lenet5_train_step(benchmark::State& state) {
  const ModeScope scope(M);
  LeNet5 net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::Adam adam(net.parameters(), {.learning_rate = 1e-3});
  nn::TrainOneStepCell step(with_loss, adam);
  const Tensor x = uniform({state.range(0), 1, 28, 28}, 0.0f, 1.0f, 1);
  const auto labels = labels_for(state.range(0));
  for (auto _ : state) {
    Tensor l = step(x, labels);
    benchmark::DoNotOptimize(l.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

template <class Net, JitLevel Level>
void eval_forward(benchmark::State& state) {
  const ModeScope scope(GRAPH_MODE);
  Net net;
  net.set_train(false);
  auto forward = jit<JitConfig{.jit_level = Level}>([&net](auto x) { return net(x); });
  const Tensor x = uniform({state.range(0), 1, 28, 28}, 0.0f, 1.0f, 1);
  for (auto _ : state) {
    Tensor y = forward(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

struct Conv3x3 : nn::Cell<Conv3x3> {
  nn::Conv2d<channels, channels, 3, 1, 1> conv{{.has_bias = true}};
  DUET_CELL_MEMBERS(conv);
  auto construct(auto x) { return conv(x); }
};

template <Mode M>
void conv3x3_forward(benchmark::State& state) {
  const ModeScope scope(M);
  Conv3x3 net;
  const Tensor x = uniform({batch, channels, size, size}, -1.0f, 1.0f, 1);
  for (auto _ : state) {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

template <Mode M>
void conv3x3_backward(benchmark::State& state) {
  const ModeScope scope(M);
  Conv3x3 net;
  const Tensor x = uniform({batch, channels, size, size}, -1.0f, 1.0f, 1);
  const Tensor dy = uniform({batch, channels, size, size}, -1.0f, 1.0f, 2);
  auto f = [&net](const auto& v, const auto& cotangent) { return ops::sum(net(v) * cotangent); };
  auto grads = value_and_grad(f, net.parameters(), 0);
  for (auto _ : state) {
    auto out = grads(x, dy);
    benchmark::DoNotOptimize(out.grads.front().data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

#if DUET_BENCH_TORCH
void torch_lenet5_forward(benchmark::State& state) {
  at::set_num_threads(1);
  torch::NoGradGuard no_grad;
  torch_nets::LeNet5 net;
  net->eval();
  const torch::Tensor x = torch::rand({state.range(0), 1, 28, 28});
  for (auto _ : state) {
    torch::Tensor y = net->forward(x);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void torch_lenet5_train_step(benchmark::State& state) {
  at::set_num_threads(1);
  torch_nets::LeNet5 net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3));
  const torch::Tensor x = torch::rand({state.range(0), 1, 28, 28});
  const torch::Tensor labels = torch::arange(state.range(0)).remainder(10);
  for (auto _ : state) {
    adam.zero_grad();
    torch::Tensor loss = torch::cross_entropy_loss(net->forward(x), labels);
    loss.backward();
    adam.step();
    benchmark::DoNotOptimize(loss.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void torch_conv3x3_forward(benchmark::State& state) {
  at::set_num_threads(1);
  torch::NoGradGuard no_grad;
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(channels, channels, 3).padding(1));
  const torch::Tensor x = torch::rand({batch, channels, size, size});
  for (auto _ : state) {
    torch::Tensor y = conv(x);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

void torch_conv3x3_backward(benchmark::State& state) {
  at::set_num_threads(1);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(channels, channels, 3).padding(1));
  const torch::Tensor x = torch::rand({batch, channels, size, size}).requires_grad_(true);
  const torch::Tensor dy = torch::rand({batch, channels, size, size});
  for (auto _ : state) {
    x.mutable_grad() = torch::Tensor();
    conv->zero_grad();
    torch::Tensor y = conv(x);
    y.backward(dy);
    benchmark::DoNotOptimize(x.grad().data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}
#endif

// ResNet's stem pooling, max over 3x3 windows at stride 2, padding 1, on the convolution's
// [32, 64, 28, 28], and the average over the same windows (the padding counted, PyTorch's and
// MindSpore's default): the window fixed at compile time (ops::max_pool2d<3, 2, 1>) or given
// at run time (ops::max_pool2d(x, 3, 2, 1), one operation for every window), and its gradient
// (d sum(pool(x) * dy) / dx, the forward included, as libtorch's row). Max pooling's forward
// loops are vectorised by the compiler: the rows show what a build's flags give them (GCC's
// -O2 left them scalar before DUET_BEGIN_VECTORIZED); its gradient and the average's forward
// and gradient are kernels/pool.hpp's, per instruction set.
template <bool Max, bool FixedWindow, class X>
auto stem_pool(const X& x) {
  if constexpr (Max && FixedWindow)
    return ops::max_pool2d<3, 2, 1>(x);
  else if constexpr (Max)
    return ops::max_pool2d(x, 3, 2, 1);
  else if constexpr (FixedWindow)
    return ops::avg_pool2d<3, 2, 1>(x);
  else
    return ops::avg_pool2d(x, 3, 2, 1);
}

template <bool Max, bool FixedWindow>
void pool_forward(benchmark::State& state) {
  const Tensor x = uniform({batch, channels, size, size}, -1.0f, 1.0f, 1);
  for (auto _ : state) {
    Tensor y = stem_pool<Max, FixedWindow>(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

template <bool Max, bool FixedWindow>
void pool_backward(benchmark::State& state) {
  const Tensor x = uniform({batch, channels, size, size}, -1.0f, 1.0f, 1);
  const Tensor dy = uniform({batch, channels, size / 2, size / 2}, -1.0f, 1.0f, 2);
  auto dx = grad([](const auto& v, const auto& cotangent) { return ops::sum(stem_pool<Max, FixedWindow>(v) * cotangent); });
  for (auto _ : state) {
    Tensor g = dx(x, dy);
    benchmark::DoNotOptimize(g.data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

#if DUET_BENCH_TORCH
template <bool Max>
torch::Tensor torch_stem_pool(const torch::Tensor& x) {
  return Max ? torch::max_pool2d(x, 3, 2, 1) : torch::avg_pool2d(x, 3, 2, 1);
}

template <bool Max>
void torch_pool_forward(benchmark::State& state) {
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::rand({batch, channels, size, size});
  for (auto _ : state) {
    torch::Tensor y = torch_stem_pool<Max>(x);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

template <bool Max>
void torch_pool_backward(benchmark::State& state) {
  const torch::Tensor x = torch::rand({batch, channels, size, size}).requires_grad_(true);
  const torch::Tensor dy = torch::rand({batch, channels, size / 2, size / 2});
  for (auto _ : state) {
    x.mutable_grad() = torch::Tensor();
    torch_stem_pool<Max>(x).backward(dy);
    benchmark::DoNotOptimize(x.grad().data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}
#endif

#if DUET_BENCH_DNNL
// oneDNN's convolution primitives on nchw f32 memory, made once; the rows time execute().
struct DnnlConv3x3 {
  using dims = dnnl::memory::dims;
  using tag = dnnl::memory::format_tag;
  static constexpr auto f32 = dnnl::memory::data_type::f32;

  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dims strides{1, 1}, padding{1, 1};
  dnnl::memory::desc data_md{{batch, channels, size, size}, f32, tag::nchw};
  dnnl::memory::desc weight_md{{channels, channels, 3, 3}, f32, tag::oihw};
  dnnl::memory::desc bias_md{{channels}, f32, tag::x};
  dnnl::memory src{data_md, engine}, dst{data_md, engine}, diff_dst{data_md, engine}, diff_src{data_md, engine};
  dnnl::memory weight{weight_md, engine}, bias{bias_md, engine}, diff_weight{weight_md, engine},
      diff_bias{bias_md, engine};
  dnnl::convolution_forward::primitive_desc forward_pd{
      {dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, data_md, weight_md, bias_md, data_md,
       strides, padding, padding},
      engine};
  dnnl::convolution_forward forward{forward_pd};
  dnnl::convolution_backward_data backward_data{dnnl::convolution_backward_data::primitive_desc{
      {dnnl::algorithm::convolution_direct, data_md, weight_md, data_md, strides, padding, padding}, engine,
      forward_pd}};
  dnnl::convolution_backward_weights backward_weights{dnnl::convolution_backward_weights::primitive_desc{
      {dnnl::algorithm::convolution_direct, data_md, weight_md, bias_md, data_md, strides, padding, padding}, engine,
      forward_pd}};

  DnnlConv3x3() {
    fill(src, 1);
    fill(weight, 2);
    fill(bias, 3);
    fill(diff_dst, 4);
  }
  static void fill(dnnl::memory& m, std::uint64_t seed) {
    const index_t n = static_cast<index_t>(m.get_desc().get_size() / sizeof(float));
    const Tensor values = uniform({n}, -1.0f, 1.0f, seed);
    std::copy_n(values.data(), n, static_cast<float*>(m.get_data_handle()));
  }
  void run_forward() {
    forward.execute(stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weight}, {DNNL_ARG_BIAS, bias}, {DNNL_ARG_DST, dst}});
    stream.wait();
  }
  void run_backward() {
    run_forward();
    backward_data.execute(stream, {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, weight}, {DNNL_ARG_DIFF_SRC, diff_src}});
    backward_weights.execute(stream, {{DNNL_ARG_SRC, src},
                                      {DNNL_ARG_DIFF_DST, diff_dst},
                                      {DNNL_ARG_DIFF_WEIGHTS, diff_weight},
                                      {DNNL_ARG_DIFF_BIAS, diff_bias}});
    stream.wait();
  }
};

void dnnl_conv3x3_forward(benchmark::State& state) {
  DnnlConv3x3 conv;
  for (auto _ : state) conv.run_forward();
  state.SetItemsProcessed(state.iterations() * batch);
}

void dnnl_conv3x3_backward(benchmark::State& state) {
  DnnlConv3x3 conv;
  for (auto _ : state) conv.run_backward();
  state.SetItemsProcessed(state.iterations() * batch);
}
#endif

}  // namespace

BENCHMARK(lenet5_forward<GRAPH_MODE>)->Name("conv/lenet5_forward/graph")->Arg(1)->Arg(64);
BENCHMARK(lenet5_forward<PYNATIVE_MODE>)->Name("conv/lenet5_forward/pynative")->Arg(1)->Arg(64);
BENCHMARK(lenet5_train_step<GRAPH_MODE>)->Name("conv/lenet5_train_step/graph")->Arg(64);
BENCHMARK(lenet5_train_step<PYNATIVE_MODE>)->Name("conv/lenet5_train_step/pynative")->Arg(64);
BENCHMARK(eval_forward<LeNet5, O0>)->Name("conv/lenet5_eval_forward/graph_O0")->Arg(64);
BENCHMARK(eval_forward<LeNet5, O1>)->Name("conv/lenet5_eval_forward/graph_O1")->Arg(64);
BENCHMARK(eval_forward<resnet_fashion::ResNetFashion, O0>)->Name("conv/resnet_fashion_eval_forward/graph_O0")->Arg(64);
BENCHMARK(eval_forward<resnet_fashion::ResNetFashion, O1>)->Name("conv/resnet_fashion_eval_forward/graph_O1")->Arg(64);
BENCHMARK(conv3x3_forward<GRAPH_MODE>)->Name("conv/3x3_64x64_28x28_b32_forward/graph");
BENCHMARK(conv3x3_forward<PYNATIVE_MODE>)->Name("conv/3x3_64x64_28x28_b32_forward/pynative");
BENCHMARK(conv3x3_backward<GRAPH_MODE>)->Name("conv/3x3_64x64_28x28_b32_backward/graph");
BENCHMARK(conv3x3_backward<PYNATIVE_MODE>)->Name("conv/3x3_64x64_28x28_b32_backward/pynative");
BENCHMARK(pool_forward<true, true>)->Name("conv/maxpool_3x3s2p1_64x28x28_b32_forward/duet");
BENCHMARK(pool_forward<true, false>)->Name("conv/maxpool_3x3s2p1_64x28x28_b32_forward/duet_runtime_window");
BENCHMARK(pool_backward<true, true>)->Name("conv/maxpool_3x3s2p1_64x28x28_b32_backward/duet");
BENCHMARK(pool_backward<true, false>)->Name("conv/maxpool_3x3s2p1_64x28x28_b32_backward/duet_runtime_window");
BENCHMARK(pool_forward<false, true>)->Name("conv/avgpool_3x3s2p1_64x28x28_b32_forward/duet");
BENCHMARK(pool_forward<false, false>)->Name("conv/avgpool_3x3s2p1_64x28x28_b32_forward/duet_runtime_window");
BENCHMARK(pool_backward<false, true>)->Name("conv/avgpool_3x3s2p1_64x28x28_b32_backward/duet");
BENCHMARK(pool_backward<false, false>)->Name("conv/avgpool_3x3s2p1_64x28x28_b32_backward/duet_runtime_window");
#if DUET_BENCH_TORCH
BENCHMARK(torch_pool_forward<true>)->Name("conv/maxpool_3x3s2p1_64x28x28_b32_forward/libtorch");
BENCHMARK(torch_pool_backward<true>)->Name("conv/maxpool_3x3s2p1_64x28x28_b32_backward/libtorch");
BENCHMARK(torch_pool_forward<false>)->Name("conv/avgpool_3x3s2p1_64x28x28_b32_forward/libtorch");
BENCHMARK(torch_pool_backward<false>)->Name("conv/avgpool_3x3s2p1_64x28x28_b32_backward/libtorch");
BENCHMARK(torch_lenet5_forward)->Name("conv/lenet5_forward/libtorch")->Arg(1)->Arg(64);
BENCHMARK(torch_lenet5_train_step)->Name("conv/lenet5_train_step/libtorch")->Arg(64);
BENCHMARK(torch_conv3x3_forward)->Name("conv/3x3_64x64_28x28_b32_forward/libtorch");
BENCHMARK(torch_conv3x3_backward)->Name("conv/3x3_64x64_28x28_b32_backward/libtorch");
#endif
#if DUET_BENCH_DNNL
BENCHMARK(dnnl_conv3x3_forward)->Name("conv/3x3_64x64_28x28_b32_forward/onednn");
BENCHMARK(dnnl_conv3x3_backward)->Name("conv/3x3_64x64_28x28_b32_backward/onednn");
#endif
