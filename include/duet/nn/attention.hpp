// Multi-head self-attention (PyTorch's nn.MultiheadAttention(E, H, batch_first=True) called
// as attn(x, x, x), MindSpore's nn.MultiheadAttention(batch_first=True)), in both modes, for
// sequences of any length.
#pragma once

#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../cell.hpp"
#include "../initializer.hpp"
#include "../ops/math.hpp"
#include "../ops/matmul.hpp"
#include "../ops/shape.hpp"
#include "../ops/softmax.hpp"
#include "dense.hpp"

namespace duet {
namespace ops {

// nn::MultiheadAttention's input as it is (a view) once it is [batch, length, E]: a sequence
// without its batch axis is then refused in the layer's words, not in those of the transpose
// inside it that would meet it first.
template <class Layer>
struct AttentionInputOp : Primitive<AttentionInputOp<Layer>> {
  using layer_type = Layer;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  const Layer* layer;
  explicit AttentionInputOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    constexpr index_t e = Layer::embed_dim;
    if (x.leading_unknown() && x.rank() <= 3 && (x.rank() == 0 || x.back() == dyn || x.back() == e)) return {x};
    if (x.rank() != 3 || (x.back() != dyn && x.back() != e)) {
      return fault(Shape{dyn, dyn, e}, ShapeFault::batch_first_sequences, e);
    }
    return {x};
  }

  template <std::size_t K>
  requires(K == 0) auto grad_op() const { return ReshapeLikeOp{}; }

  static std::string op_name() { return "AttentionInput"; }
  std::string label() const { return layer->label(); }
  Interchange interchange(std::span<const Shape>) const { return {{"Identity", {InterchangeInput::operand(0)}, {}}}; }
};

}  // namespace ops

namespace nn {

// x [batch, length, E] -> [batch, length, E]: q, k and v from one fused in-projection
// (in_proj, Dense<E, 3E>: its weight and bias hold PyTorch's in_proj_weight and in_proj_bias,
// under the names in_proj.weight and in_proj.bias, which io::TensorNames::pytorch reads and
// writes as PyTorch's; out_proj's are named as PyTorch's), each cut into H heads of E / H
// ([batch, H, length, E / H]), softmax(q kᵀ / sqrt(E / H)) v per head, the heads joined again and projected by out_proj
// (Dense<E, E>). Causal: position i attends to positions up to i only (PyTorch's attn_mask of -inf above the diagonal),
// one ops::tril pass at any length. The length is read at run time; E and H are fixed.
//
// One fused in-projection, not three Dense<E, E> on x: three values of one type on one input
// make graph mode fall back to a traced graph (README, "Shared values in graph mode").
// Initialised as PyTorch does: in_proj's weight Xavier-uniform, both biases 0, out_proj's
// weight U(-1/sqrt(E), 1/sqrt(E)). No dropout, and only the output (PyTorch's need_weights=False).
template <index_t E, index_t H, bool Causal = false, ElementType T = float>
class MultiheadAttention : public Cell<MultiheadAttention<E, H, Causal, T>, CONTEXT_MODE, T> {
  static_assert(E > 0 && H > 0 && E % H == 0,
                "nn::MultiheadAttention<E, H>: E (embed_dim) must be a positive multiple of H (num_heads)");

 public:
  Dense<E, 3 * E, T> in_proj{{.weight_init = initializer::XavierUniform{}, .bias_init = initializer::Zero{}}};
  Dense<E, E, T> out_proj{{.bias_init = initializer::Zero{}}};
  DUET_CELL_MEMBERS(in_proj, out_proj);

  static constexpr index_t embed_dim = E;
  static constexpr index_t num_heads = H;
  static constexpr index_t head_dim = E / H;
  static constexpr bool causal = Causal;

  template <class X>
  auto construct(X&& x) {
    auto [q, k, v] =
        ops::split<-1, E, E, E>(in_proj(apply(ops::AttentionInputOp<MultiheadAttention>{this}, std::forward<X>(x))));
    // [batch, length, E] -> [batch, H, length, E / H]: PyTorch's view(B, T, H, dh).transpose(1, 2).
    const auto heads = [](const auto& t) { return ops::transpose<0, 2, 1, 3>(ops::unflatten<-1, H, E / H>(t)); };
    auto scores = ops::matmul(heads(q) * (T(1) / std::sqrt(static_cast<T>(head_dim))), heads(k), ops::transpose_b);
    auto weights = [&] {
      if constexpr (Causal)
        return ops::softmax(ops::tril(scores, 0, -std::numeric_limits<T>::infinity()), -1);
      else
        return ops::softmax(scores, -1);
    }();
    return out_proj(ops::flatten<-2, -1>(ops::transpose<0, 2, 1, 3>(ops::matmul(weights, heads(v)))));
  }

  // PyTorch's attn(query, key, value) with three tensors: refused in words, rather than as
  // "construct does not take the tensors" with notes on GRU and LSTM.
  // Returning the query keeps the caller's capture going, so that this is the only error.
  template <class Q, class K, class V>
  auto construct(Q&& query, K&&, V&&) {
    static_assert(sizeof(Q) == 0,
                  "nn::MultiheadAttention is self-attention: call attn(x), which is PyTorch's attn(x, x, x); a query, "
                  "key and value from different tensors are not supported");
    return std::forward<Q>(query);
  }

  std::vector<std::pair<std::string_view, std::string_view>> pytorch_parameter_names() const override {
    return {{"in_proj.weight", "in_proj_weight"}, {"in_proj.bias", "in_proj_bias"}};
  }

  std::string type_name() const override {
    return "nn::MultiheadAttention<" + std::to_string(E) + ", " + std::to_string(H) + (Causal ? ", causal" : "") + ">";
  }
};

}  // namespace nn
}  // namespace duet
