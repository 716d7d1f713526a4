// Recurrent layers: an LSTM and a GRU of 64 inputs and 128 hidden units over sequences of 32
// steps at batch 32, forward and a training step (MSE on every step's output, SGD), in graph
// mode and in PyNative mode, one thread. GFLOP/s counts the products (the input and hidden
// gates: 2 · B · L · (input + hidden) · gates · hidden per forward; a step has them three
// times: forward, the forward again in backward for what the cells keep, and the gradients'
// products, counted as two); `of_peak` is their share of one thread's FMA peak (peak.hpp). The
// rest is the gates' elementwise arithmetic.
//
//   build/benchmarks/duet_benchmarks --benchmark_filter='recurrent/' --benchmark_repetitions=5
#include <benchmark/benchmark.h>

#include <duet/duet.hpp>

#include "peak.hpp"

namespace {

using namespace duet;

constexpr index_t batch = 32, length = 32, input = 64, hidden = 128;

template <class Layer, Mode M>
struct Sequence : nn::Cell<Sequence<Layer, M>, M> {
  Layer layer;
  DUET_CELL_MEMBERS(layer);
  auto construct(const auto& x) { return layer(x); }
};

template <class Layer>
double forward_flops() {
  return 2.0 * static_cast<double>(batch * length * (input + hidden) * Layer::cell_type::gates * hidden);
}

template <class Layer, Mode M>
void BM_forward(benchmark::State& state) {
  Sequence<Layer, M> net;
  const Tensor x = uniform({batch, length, input}, -1.0f, 1.0f, 1);
  duet_bench::timed_loop(state, forward_flops<Layer>(), [&] {
    Tensor y = net(x);
    benchmark::DoNotOptimize(y.data());
  });
}

template <class Layer, Mode M>
void BM_train_step(benchmark::State& state) {
  Sequence<Layer, M> net;
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD optimizer(net.parameters(), {.learning_rate = 1e-3});
  nn::TrainOneStepCell step(with_loss, optimizer);
  const Tensor x = uniform({batch, length, input}, -1.0f, 1.0f, 1);
  const Tensor target = uniform({batch, length, hidden}, -1.0f, 1.0f, 2);
  duet_bench::timed_loop(state, 4 * forward_flops<Layer>(), [&] {
    Tensor l = step(x, target);
    benchmark::DoNotOptimize(l.data());
  });
}

using LSTM = nn::LSTM<input, hidden>;
using GRU = nn::GRU<input, hidden>;

}  // namespace

BENCHMARK(BM_forward<LSTM, GRAPH_MODE>)->Name("recurrent/lstm_forward/graph");
BENCHMARK(BM_forward<LSTM, PYNATIVE_MODE>)->Name("recurrent/lstm_forward/pynative");
BENCHMARK(BM_forward<GRU, GRAPH_MODE>)->Name("recurrent/gru_forward/graph");
BENCHMARK(BM_forward<GRU, PYNATIVE_MODE>)->Name("recurrent/gru_forward/pynative");
BENCHMARK(BM_train_step<LSTM, GRAPH_MODE>)->Name("recurrent/lstm_train_step/graph");
BENCHMARK(BM_train_step<LSTM, PYNATIVE_MODE>)->Name("recurrent/lstm_train_step/pynative");
