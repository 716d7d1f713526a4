// The compile-time benchmark's deep network (issue 16): a SequentialCell of DUET_BENCH_DEPTH
// Dense<64, 64> + ReLU pairs, run in both modes from one translation unit; with
// DUET_BENCH_TRAIN, also a training step (forward, loss, backward, SGD) in both modes.
// tools/compile_bench.sh times its compilation. It runs, too: it exits non-zero when the two
// modes' outputs (and, training, the updated parameters) are not the same bit for bit.
#include <duet/duet.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

#ifndef DUET_BENCH_DEPTH
#define DUET_BENCH_DEPTH 64
#endif

namespace {

using namespace duet;

template <std::size_t... I>
auto dense_relu_pairs(std::index_sequence<I...>)
    -> nn::SequentialCell<std::conditional_t<I % 2 == 0, nn::Dense<64, 64>, nn::ReLU>...>;

template <auto Setting>
struct Deep : nn::Cell<Deep<Setting>, Setting> {
  decltype(dense_relu_pairs(std::make_index_sequence<2 * DUET_BENCH_DEPTH>{})) layers;
  DUET_CELL_MEMBERS(layers);

  auto construct(auto x) { return layers(x); }
};

template <ElementType T>
bool same_bits(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
}

#ifdef DUET_BENCH_TRAIN
// One SGD step of a fresh network (seeded alike) in `mode`; its loss and every parameter after.
std::pair<Tensor, std::vector<Tensor>> train_step(Mode mode, const Tensor& x, const BasicTensor<std::int32_t>& labels) {
  set_context({.mode = mode});
  set_seed(1);
  Deep<CONTEXT_MODE> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::SGD optimizer(net.parameters(), {.learning_rate = 1e-2});
  nn::TrainOneStepCell step(with_loss, optimizer);
  Tensor l = step(x, labels);
  std::vector<Tensor> parameters;
  for (const auto& [name, p] : net.parameters()) parameters.push_back(p->clone());
  return {l, parameters};
}
#endif

}  // namespace

int main() {
  const Tensor x = uniform({16, 64}, -1.0f, 1.0f, 7);
  set_seed(1);
  Deep<CONTEXT_MODE> net;
  set_context({.mode = PYNATIVE_MODE});
  const Tensor eager = net(x);
  set_context({.mode = GRAPH_MODE});
  const Tensor graph = net(x);
  bool same = same_bits(eager, graph);
#ifdef DUET_BENCH_TRAIN
  BasicTensor<std::int32_t> labels({16});
  for (index_t i = 0; i < 16; ++i) labels(i) = static_cast<std::int32_t>(i * 5 % 64);
  const auto [eager_loss, eager_parameters] = train_step(PYNATIVE_MODE, x, labels);
  const auto [graph_loss, graph_parameters] = train_step(GRAPH_MODE, x, labels);
  same = same && same_bits(eager_loss, graph_loss) && eager_parameters.size() == graph_parameters.size();
  for (std::size_t i = 0; same && i < eager_parameters.size(); ++i) {
    same = same_bits(eager_parameters[i], graph_parameters[i]);
  }
#endif
  std::printf("depth %d: modes %s\n", DUET_BENCH_DEPTH, same ? "identical" : "DIFFER");
  return same ? 0 : 1;
}
