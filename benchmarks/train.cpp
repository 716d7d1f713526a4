// One training step of the seed network at batch 64 (forward, softmax cross-entropy,
// backward, SGD update), single-threaded: graph mode, PyNative mode, and by hand with Eigen;
// and graph mode with Adam, the step train_fashion_mnist takes.
//
// Every row reports GFLOP/s of the step's products (each layer's forward product and weight
// gradient, and the input gradient of every layer but the first: 205 MFLOP at batch 64) in
// wall time, and `of_peak`, their share of one thread's FMA peak measured in the same process
// (peak.hpp; issue 12 asks for 70 % at batch 64). The rest of the step (softmax, bias
// gradients, the optimiser's update) counts as time without operations.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>

#include "../examples/network.hpp"
#include "peak.hpp"

namespace {

using namespace duet;

duet::BasicTensor<std::int32_t> labels_for(index_t batch) {
  BasicTensor<std::int32_t> labels({batch});
  for (index_t i = 0; i < batch; ++i) labels(i) = static_cast<std::int32_t>(i % 10);
  return labels;
}

// The floating-point operations of the products of one step of a network of dense layers
// (2 per multiply-add): every [out, in] weight's forward product and gradient, and the input
// gradient of every layer after the first, whose input needs none.
template <class Net>
double dense_step_flops(Net& net, index_t batch) {
  double flops = 0;
  bool first = true;
  for (const auto& p : net.parameters()) {
    if (p.parameter->ndim() != 2) continue;
    flops += 2.0 * static_cast<double>(batch * p.parameter->numel()) * (first ? 2 : 3);
    first = false;
  }
  return flops;
}

template <Mode M, class Optimizer = nn::SGD>
void BM_train_step(benchmark::State& state) {
  const index_t batch = state.range(0);
  SeedNetwork<M> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  Optimizer optimizer(net.parameters(), {.learning_rate = 1e-4});
  nn::TrainOneStepCell step(with_loss, optimizer);
  const Tensor x = uniform({batch, 1, 28, 28}, 0.0f, 1.0f, 1);
  const auto labels = labels_for(batch);
  duet_bench::timed_loop(state, dense_step_flops(net, batch), [&] {
    Tensor l = step(x, labels);
    benchmark::DoNotOptimize(l.data());
  });
  state.SetItemsProcessed(state.iterations() * batch);
}

// The same step written by hand: Eigen products with noalias, bias, ReLU and their
// gradients, softmax cross-entropy, SGD; every buffer allocated once.
void BM_train_step_eigen(benchmark::State& state) {
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Row = Eigen::RowVectorXf;
  const Eigen::Index batch = state.range(0);
  Network reference;  // initial weights as duet's
  auto copy = [](const Tensor& t) { return Matrix(Eigen::Map<const Matrix>(t.data(), t.dim(0), t.numel() / t.dim(0))); };
  auto& layers = reference.dense_relu_sequential;
  Matrix w1 = copy(layers.get<0>().weight), w2 = copy(layers.get<2>().weight), w3 = copy(layers.get<4>().weight);
  Row b1 = copy(layers.get<0>().bias.reshape({1, 512})), b2 = copy(layers.get<2>().bias.reshape({1, 512}));
  Row b3 = copy(layers.get<4>().bias.reshape({1, 10}));
  const Tensor input = uniform({batch, 1, 28, 28}, 0.0f, 1.0f, 1);
  const Matrix x = Eigen::Map<const Matrix>(input.data(), batch, 784);
  const auto labels = labels_for(batch);
  Matrix h1(batch, 512), h2(batch, 512), z(batch, 10), dz(batch, 10), dh2(batch, 512), dh1(batch, 512);
  Matrix dw1(512, 784), dw2(512, 512), dw3(10, 512);
  Row db1(512), db2(512), db3(10);
  const float lr = 1e-4f;
  duet_bench::timed_loop(state, dense_step_flops(reference, batch), [&] {
    h1.noalias() = x * w1.transpose();
    h1 = (h1.rowwise() + b1).cwiseMax(0.0f);
    h2.noalias() = h1 * w2.transpose();
    h2 = (h2.rowwise() + b2).cwiseMax(0.0f);
    z.noalias() = h2 * w3.transpose();
    z.rowwise() += b3;
    float loss = 0;
    for (Eigen::Index r = 0; r < batch; ++r) {
      const float m = z.row(r).maxCoeff();
      const float lse = m + std::log((z.row(r).array() - m).exp().sum());
      loss += lse - z(r, labels(r));
      dz.row(r) = ((z.row(r).array() - lse).exp() / static_cast<float>(batch)).matrix();
      dz(r, labels(r)) -= 1.0f / static_cast<float>(batch);
    }
    benchmark::DoNotOptimize(loss);
    dw3.noalias() = dz.transpose() * h2;
    db3.noalias() = dz.colwise().sum();
    dh2.noalias() = dz * w3;
    dh2 = (h2.array() > 0).select(dh2, 0.0f);
    dw2.noalias() = dh2.transpose() * h1;
    db2.noalias() = dh2.colwise().sum();
    dh1.noalias() = dh2 * w2;
    dh1 = (h1.array() > 0).select(dh1, 0.0f);
    dw1.noalias() = dh1.transpose() * x;
    db1.noalias() = dh1.colwise().sum();
    w1 -= lr * dw1;
    w2 -= lr * dw2;
    w3 -= lr * dw3;
    b1 -= lr * db1;
    b2 -= lr * db2;
    b3 -= lr * db3;
    benchmark::DoNotOptimize(w1.data());
  });
  state.SetItemsProcessed(state.iterations() * batch);
}

}  // namespace

BENCHMARK(BM_train_step<GRAPH_MODE>)->Name("train_step/graph")->Arg(64);
BENCHMARK(BM_train_step<PYNATIVE_MODE>)->Name("train_step/pynative")->Arg(64);
BENCHMARK(BM_train_step<GRAPH_MODE, nn::Adam>)->Name("train_step/graph_adam")->Arg(64);
BENCHMARK(BM_train_step_eigen)->Name("train_step/eigen_by_hand")->Arg(64);
