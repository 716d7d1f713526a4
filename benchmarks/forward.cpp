// The seed network forward in graph mode, in PyNative mode and as hand-written Eigen, and a
// tiny network where what each mode pays per call and per node dominates.
#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include "../examples/network.hpp"

namespace {

using namespace duet;

template <Mode M>
void BM_seed_forward(benchmark::State& state) {
  SeedNetwork<M> net;
  const Tensor x = ones({state.range(0), 1, 28, 28});
  for (auto _ : state) {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// The hand-written baseline: three GEMMs with noalias, bias and ReLU, buffers allocated once.
void BM_seed_forward_eigen(benchmark::State& state) {
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Row = Eigen::RowVectorXf;
  const Eigen::Index batch = state.range(0);
  SeedNetwork<PYNATIVE_MODE> net;  // the same weights
  auto weights = [](const Tensor& w) { return Eigen::Map<const Matrix>(w.data(), w.dim(0), w.dim(1)); };
  auto biases = [](const Tensor& b) { return Eigen::Map<const Row>(b.data(), b.dim(0)); };
  const auto w1 = weights(net.dense_relu_sequential.template get<0>().weight);
  const auto w2 = weights(net.dense_relu_sequential.template get<2>().weight);
  const auto w3 = weights(net.dense_relu_sequential.template get<4>().weight);
  const auto b1 = biases(net.dense_relu_sequential.template get<0>().bias);
  const auto b2 = biases(net.dense_relu_sequential.template get<2>().bias);
  const auto b3 = biases(net.dense_relu_sequential.template get<4>().bias);
  Matrix x = Matrix::Ones(batch, 784), h1(batch, 512), h2(batch, 512), y(batch, 10);
  for (auto _ : state) {
    h1.noalias() = x * w1.transpose();
    h1 = (h1.rowwise() + b1).cwiseMax(0.0f);
    h2.noalias() = h1 * w2.transpose();
    h2 = (h2.rowwise() + b2).cwiseMax(0.0f);
    y.noalias() = h2 * w3.transpose();
    y.rowwise() += b3;
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * batch);
}

// Three Dense<4, 4> + ReLU at batch 1: the kernels cost almost nothing, so this measures what
// each mode pays per call and per node.
template <Mode M>
struct Tiny : nn::Cell<Tiny<M>, M> {
  nn::SequentialCell<nn::Dense<4, 4>, nn::ReLU, nn::Dense<4, 4>, nn::ReLU, nn::Dense<4, 4>, nn::ReLU> layers;
  DUET_CELL_MEMBERS(layers);
  auto construct(auto x) { return layers(x); }
};

template <Mode M>
void BM_tiny_forward(benchmark::State& state) {
  Tiny<M> net;
  const Tensor x = ones({1, 4});
  for (auto _ : state) {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  }
}

}  // namespace

BENCHMARK(BM_seed_forward<GRAPH_MODE>)->Name("seed_forward/graph")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_seed_forward<PYNATIVE_MODE>)->Name("seed_forward/pynative")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_seed_forward_eigen)->Name("seed_forward/eigen_by_hand")->Arg(1)->Arg(64)->Arg(256);
BENCHMARK(BM_tiny_forward<GRAPH_MODE>)->Name("tiny_forward/graph");
BENCHMARK(BM_tiny_forward<PYNATIVE_MODE>)->Name("tiny_forward/pynative");
