// The compile-time benchmark's transformer block (issue 16): what a user of sequence models
// compiles, as a new user wrote it from the README (helper-67): token and position embeddings,
// LayerNorm, single-head self-attention (one product split into q, k, v), a GELU MLP, both
// with residuals, mean pooling and a head; its forward and a training step (AdamW) in both
// modes from one translation unit. It has few layers but many kinds of operation, where
// deep.cpp has many layers of two kinds. tools/compile_bench.sh times its compilation; it
// runs too, and exits non-zero when the two modes' loss, parameters or outputs differ.
#include <duet/duet.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using namespace duet;

constexpr index_t Vocabulary = 16, Length = 12, Width = 32, Hidden = 64, Classes = 4;

struct Block : nn::Cell<Block> {
  using input_value_type = std::int32_t;
  nn::Embedding<Vocabulary, Width> tokens;
  nn::Embedding<Length, Width> positions;
  nn::LayerNorm<> norm1{Width, 1e-5};
  nn::Dense<Width, 3 * Width> qkv;
  nn::Dense<Width, Width> projection;
  nn::Dropout dropout{0.1f};
  nn::LayerNorm<> norm2{Width, 1e-5};
  nn::Dense<Width, Hidden> fc1;
  nn::GELUExact gelu;
  nn::Dense<Hidden, Width> fc2;
  nn::Dense<Width, Classes> head;
  DUET_CELL_MEMBERS(tokens, positions, norm1, qkv, projection, dropout, norm2, fc1, gelu, fc2, head);

  auto construct(auto ids) {
    auto x = tokens(ids) + positions(ops::positions<1>(ids));
    const auto [q, k, v] = ops::split<-1, Width, Width, Width>(qkv(norm1(x)));
    auto scores = ops::matmul(q, ops::transpose<0, 2, 1>(k)) * (1.0f / std::sqrt(float(Width)));
    auto attended = x + dropout(projection(ops::matmul(ops::softmax(scores, -1), v)));
    auto out = attended + fc2(gelu(fc1(norm2(attended))));
    return head(ops::mean(out, ops::axes<1>));
  }
};

template <ElementType T>
bool same_bits(const BasicTensor<T>& a, const BasicTensor<T>& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
}

struct Run {
  Tensor loss, output;
  std::vector<Tensor> parameters;
};

// Two AdamW steps of a fresh block (seeded alike) in `mode`, then its output at evaluation.
Run run(Mode mode, const BasicTensor<std::int32_t>& ids, const BasicTensor<std::int32_t>& labels) {
  set_context({.mode = mode});
  set_seed(1);
  Block net;
  nn::CrossEntropyLoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  nn::AdamW optimizer(net.parameters(), {.learning_rate = 1e-3});
  auto step = value_and_grad(with_loss, net.parameters());
  net.set_train(true);
  Run r;
  for (int i = 0; i < 2; ++i) {
    auto [value, grads] = step(ids, labels);
    optimizer(grads);
    r.loss = value;
  }
  net.set_train(false);
  r.output = net(ids);
  for (const auto& [name, p] : net.parameters()) r.parameters.push_back(p->clone());
  return r;
}

}  // namespace

int main() {
  BasicTensor<std::int32_t> ids({8, Length}), labels({8});
  for (index_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>(i * 7 % Vocabulary);
  for (index_t i = 0; i < 8; ++i) labels(i) = static_cast<std::int32_t>(i % Classes);
  const Run eager = run(PYNATIVE_MODE, ids, labels);
  const Run graph = run(GRAPH_MODE, ids, labels);
  bool same = same_bits(eager.loss, graph.loss) && same_bits(eager.output, graph.output) &&
              eager.parameters.size() == graph.parameters.size();
  for (std::size_t i = 0; same && i < eager.parameters.size(); ++i) {
    same = same_bits(eager.parameters[i], graph.parameters[i]);
  }
  std::printf("transformer block: modes %s\n", same ? "identical" : "DIFFER");
  return same ? 0 : 1;
}
