// Multi-head self-attention (PyTorch's nn.MultiheadAttention(E, H, batch_first=True) called
// as attn(x, x, x), with its key_padding_mask as attn(x, mask), its attn_mask as
// attn(x, nn::attn_mask(m)); MindSpore's
// nn.MultiheadAttention(batch_first=True)), in both modes, for sequences of any length.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cell.hpp"
#include "../error.hpp"
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

// The gradient of a key padding mask added to the scores: dy [batch, H, length, length]
// summed over heads and queries, [batch, length].
struct KeyPaddingMaskGradOp : Primitive<KeyPaddingMaskGradOp> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& dy = in[0];
    if (dy.leading_unknown() || dy.rank() != 4) return {Shape{dyn, dyn}};
    return {Shape{dy[0], dy[3]}};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const Shape& s = a.in_shape(0);
    const index_t batch = s[0], rows = s[1] * s[2], keys = s[3];
    const T* dy = a.in<T>(0);
    T* d = a.out<T>();
    std::fill_n(d, batch * keys, T(0));
    for (index_t b = 0; b < batch; ++b) {
      for (index_t r = 0; r < rows; ++r, dy += keys) {
        for (index_t j = 0; j < keys; ++j) d[b * keys + j] += dy[j];
      }
    }
  }

  static std::string op_name() { return "KeyPaddingMaskGrad"; }
};

// The gradient of an attn_mask added to the scores: dy [batch, H, queries, keys] summed into
// the mask's shape, [queries, keys] (over batch and heads) or [batch * H, queries, keys] (dy
// itself).
struct AttnMaskGradOp : Primitive<AttnMaskGradOp> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input1};
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const index_t n = a.in_shape(0).numel(), m = a.in_shape(1).numel();
    const T* dy = a.in<T>(0);
    T* d = a.out<T>();
    std::fill_n(d, m, T(0));
    for (index_t i = 0; i < n; ++i) d[i % m] += dy[i];
  }

  static std::string op_name() { return "AttnMaskGrad"; }
};

// Which of nn::MultiheadAttention's masks an AttentionMaskOp applies.
enum class AttentionMask : unsigned char {
  key_padding,  // PyTorch's key_padding_mask [batch, keys]: one row for every head and query of a sequence
  attn,         // PyTorch's attn_mask [queries, keys], or [batch * H, queries, keys]: one row per query
};

// nn::MultiheadAttention's masks on its scores [batch, H, queries, keys], each mask row one
// row of keys: PyTorch's key_padding_mask [batch, keys] or its attn_mask (see AttentionMask).
// A UInt8 mask (PyTorch's bool) sets the scores of the keys it marks (not 0) to -inf; a mask of
// the scores' type is added to them (PyTorch's float mask). A query left with no key to attend
// to, every score of its row -inf, is refused: softmax would make it NaN, as it does in
// PyTorch, and the NaN would reach every gradient.
template <class Layer, class M, AttentionMask Which = AttentionMask::key_padding>
struct AttentionMaskOp : Primitive<AttentionMaskOp<Layer, M, Which>> {
  using layer_type = Layer;
  static constexpr int arity = 2;
  static constexpr bool additive = !std::is_same_v<M, std::uint8_t>;
  static constexpr bool key_padding = Which == AttentionMask::key_padding;
  // As the gradient of a UInt8 mask's scores, it reads the incoming gradient and the mask.
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input1};

  const Layer* layer;
  // -inf for the scores; 0 for their gradient, which then checks no row.
  double fill;
  // A key padding mask after an attn_mask: a query it leaves with no key may have lost some to
  // the attn_mask.
  bool after_attn_mask;
  explicit AttentionMaskOp(const Layer* l, double f = -std::numeric_limits<double>::infinity(), bool after = false)
      : layer(l), fill(f), after_attn_mask(after) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& scores = in[0];
    const Shape& mask = in[1];
    if (scores.leading_unknown() || scores.rank() != 4 || mask.leading_unknown()) return {scores};
    const auto differs = [](index_t a, index_t b) { return a != dyn && b != dyn && a != b; };
    if constexpr (key_padding) {
      if (mask.rank() != 2 || differs(mask[0], scores[0]) || differs(mask[1], scores[3])) {
        return fault(scores, ShapeFault::key_padding_mask, Layer::embed_dim, 1);
      }
    } else {
      const index_t sequences = scores[0] == dyn ? dyn : scores[0] * scores[1];
      const bool fits = (mask.rank() == 2 || (mask.rank() == 3 && !differs(mask[0], sequences))) &&
                        !differs(mask[mask.rank() - 2], scores[2]) && !differs(mask[mask.rank() - 1], scores[3]);
      if (!fits) return fault(scores, ShapeFault::attn_mask, Layer::embed_dim, 1);
    }
    return {scores};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const Shape& s = a.in_shape(0);
    const index_t rows = s[0] * s[1] * s[2], sequence_rows = s[1] * s[2], keys = s[3];
    // The mask's rows an attn_mask repeats: every query's of every sequence and head, or one
    // sequence's queries (a 2-D mask).
    const index_t mask_rows = a.in_shape(1).numel() / std::max<index_t>(keys, 1);
    const T* x = a.in<T>(0);
    const M* mask = a.in<M>(1);
    T* y = a.out<T>();
    const T value = static_cast<T>(fill);
    for (index_t r = 0; r < rows; ++r, x += keys, y += keys) {
      const M* m = mask + (key_padding ? r / sequence_rows : r % mask_rows) * keys;
      bool attends = keys == 0;
      for (index_t j = 0; j < keys; ++j) {
        if constexpr (additive)
          y[j] = x[j] + m[j];
        else
          y[j] = m[j] != 0 ? value : x[j];
        attends = attends || y[j] != -std::numeric_limits<T>::infinity();
      }
      if (!attends && fill != 0) no_key(r / sequence_rows, r % s[2]);
    }
  }

  [[noreturn]] void no_key(index_t sequence, index_t query) const {
    throw ValueError(
        label() + ": query " + std::to_string(query) + " of sequence " + std::to_string(sequence) +
        " attends to no key: the " + (key_padding ? "key padding mask" : "attn_mask") + " masks every key it may see" +
        (after_attn_mask ? " after the attn_mask" : "") +
        (Layer::causal ? " (with Causal, keys 0 to " + std::to_string(query) + ")" : std::string()) +
        ", and softmax over nothing is NaN (PyTorch's result). Leave at least one key of each " +
        (key_padding ? "sequence unmasked (for a sequence that is all padding, its first)" : "query unmasked") +
        (Layer::causal ? ", or pad causal sequences on the right" : ""));
  }

  // A UInt8 mask: dy, 0 at the keys it masks (this operation again, filling 0); no gradient
  // for the mask. A mask added: dy for the scores, and dy summed into the mask's shape for
  // the mask.
  template <std::size_t K>
  requires(K < 2) auto grad_op() const {
    if constexpr (K == 0 && additive)
      return ReshapeLikeOp{};
    else if constexpr (K == 0)
      return AttentionMaskOp{layer, 0.0};
    else if constexpr (additive && key_padding)
      return KeyPaddingMaskGradOp{};
    else if constexpr (additive)
      return AttnMaskGradOp{};
    else
      return NoGradient{};
  }

  static std::string op_name() {
    return std::string(key_padding ? "KeyPaddingMask" : "AttnMask") + (additive ? " (added)" : "");
  }
  std::string label() const { return layer->label(); }
  // The mask shaped to broadcast against the scores ([batch, 1, 1, keys] for a key padding mask,
  // [batch, H, queries, keys] for an attn_mask per head, a 2-D one as it is), added, or cast to
  // ONNX's bool and selecting -inf. A query with no key is not refused there: its row is NaN, as
  // in PyTorch.
  Interchange interchange(std::span<const Shape> in) const {
    using In = InterchangeInput;
    Interchange nodes;
    if constexpr (key_padding) {
      nodes.push_back({"Unsqueeze", {In::operand(1), In::constant({1, 2})}, {}});
    } else if (in.size() > 1 && in[1].rank() == 3) {
      // [1, batch * H, queries, keys], then 0 copies the last two sizes.
      nodes.push_back({"Unsqueeze", {In::operand(1), In::constant({0})}, {}});
      nodes.push_back({"Reshape", {In::node(0), In::constant({-1, Layer::num_heads, 0, 0})}, {}});
    }
    const In mask = nodes.empty() ? In::operand(1) : In::node(nodes.size() - 1);
    if constexpr (additive) {
      nodes.push_back({"Add", {In::operand(0), mask}, {}});
    } else {
      nodes.push_back({"Cast", {mask}, {InterchangeAttribute::of("to", onnx_bool_code)}});
      nodes.push_back({"Where", {In::node(nodes.size() - 1), In::number(fill), In::operand(0)}, {}});
    }
    return nodes;
  }
};

inline const bool attention_listed =
    list_operations({"MultiheadAttention key_padding_mask", "MultiheadAttention attn_mask"});

}  // namespace ops

namespace nn {

namespace detail {

// The element types of nn::MultiheadAttention's masks: UInt8 or the layer's own.
template <class M, class T>
inline constexpr bool mask_type_v = std::is_same_v<M, std::uint8_t> || std::is_same_v<M, T>;

// Said where a mask of another element type meets the layer, in the words of its call.
template <class M, class T, ops::AttentionMask Which>
struct MaskType {
  static_assert(Which != ops::AttentionMask::key_padding || mask_type_v<M, T>,
                "nn::MultiheadAttention: attn(x, key_padding_mask) takes a UInt8 mask (PyTorch's bool mask: not 0 "
                "ignores that key; ops::equal(ids, pad_id) makes one) or a mask of the layer's element type, added to "
                "the scores (PyTorch's float mask); convert others with ops::cast");
  static_assert(Which != ops::AttentionMask::attn || mask_type_v<M, T>,
                "nn::MultiheadAttention: nn::attn_mask(m) takes a UInt8 mask (PyTorch's bool attn_mask: not 0 keeps "
                "that query from that key) or a mask of the layer's element type, added to the scores (PyTorch's "
                "float attn_mask); convert others with ops::cast");
};

}  // namespace detail

// The place of a mask a call leaves out.
struct NoMask {};

// PyTorch's attn(x, x, x, attn_mask=m, key_padding_mask=p), its masks named:
// attn(x, nn::attn_mask(m)), attn(x, nn::key_padding_mask(p)), and both as
// attn(x, nn::attn_mask(m).key_padding_mask(p)) (either first). The masks are held as they
// are given (a tensor shares its elements), A or K NoMask where none is.
template <class A, class K>
struct AttentionMasks {
  A attn;
  K key_padding;

  template <class P>
  AttentionMasks<A, P> key_padding_mask(P p) const requires std::is_same_v<K, NoMask> {
    return {attn, std::move(p)};
  }
  template <class P>
  AttentionMasks<P, K> attn_mask(P m) const requires std::is_same_v<A, NoMask> {
    return {std::move(m), key_padding};
  }
};

// PyTorch's attn_mask: [length, length], the queries' rows and the keys' columns, or one such
// matrix per sequence and head, [batch * H, length, length] (sequence b's head h at b * H + h);
// UInt8 (PyTorch's bool: not 0 keeps that query from that key) or of the layer's element type,
// added to the scores (its gradient their sum over what it repeats for).
template <class M>
AttentionMasks<M, NoMask> attn_mask(M m) {
  return {std::move(m), {}};
}

// PyTorch's key_padding_mask, as attn(x, p) takes it: [batch, length], one per key.
template <class P>
AttentionMasks<NoMask, P> key_padding_mask(P p) {
  return {{}, std::move(p)};
}

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
// attn(x, key_padding_mask) masks keys per sequence, PyTorch's key_padding_mask, and
// attn(x, nn::attn_mask(m)) masks scores per query, PyTorch's attn_mask (ops::AttentionMaskOp).
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
    return attend(std::forward<X>(x), [](auto scores) { return scores; });
  }

  // PyTorch's attn(x, x, x, key_padding_mask=mask): mask [batch, length], one per key, UInt8
  // (PyTorch's bool: not 0 ignores the key; ops::equal(ids, pad) makes one) or of T (added to
  // the scores of every query, as PyTorch's float mask; its gradient is their sum).
  template <class X, class Mask>
  auto construct(X&& x, const Mask& key_padding_mask) {
    return attend_masked(std::forward<X>(x), nn::key_padding_mask(std::cref(key_padding_mask)));
  }

  // Calls on tensors, and attn(x, masks) with masks named (nn::attn_mask, nn::key_padding_mask).
  using Cell<MultiheadAttention, CONTEXT_MODE, T>::operator();

  // attn(x, nn::attn_mask(m)), with or without a key padding mask. Captured (construct's call
  // on symbolic tensors, a function given to value_and_grad or jit) it appends its operations
  // to the graph, as construct does; on tensors, it runs them one by one in either mode, as
  // nn::LSTM's cell_states does: the same kernels and bits.
  template <class X, class A, class K>
  auto operator()(X&& x, const AttentionMasks<A, K>& masks) {
    constexpr bool symbolic = graph::Symbolic<std::remove_cvref_t<X>>;
    constexpr bool alike = (std::is_same_v<A, NoMask> || graph::Symbolic<A> == symbolic) &&
                           (std::is_same_v<K, NoMask> || graph::Symbolic<K> == symbolic);
    static_assert(alike,
                  "nn::MultiheadAttention: attn(x, masks) takes its input and masks all captured (symbolic, in "
                  "construct in graph mode) or all tensors: a mask made outside construct is one of the network's "
                  "inputs, passed to construct beside x");
    if constexpr (!alike) {
      return attend(std::forward<X>(x), [](auto scores) { return scores; });  // so that this is the only error
    } else if constexpr (symbolic) {
      this->check_capture();
      return attend_masked(std::forward<X>(x), masks);
    } else {
      if (Cell<MultiheadAttention, CONTEXT_MODE, T>::runs_as_graph()) {
        duet::detail::log_not_compiled(type_name() +
                                       ": attn(x, masks) called on tensors runs its operations one by one in graph "
                                       "mode (PyNative's speed, the same bits); called in a cell's construct it is "
                                       "part of that cell's graph");
      }
      return duet::detail::all_or_nothing([&] {
        this->check_registered();
        this->ensure_named();
        EagerScope eager;
        return attend_masked(std::forward<X>(x), masks);
      });
    }
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

 private:
  // The attention of x on itself, the attn_mask then the key padding mask applied, as PyTorch
  // adds both to the scores. A mask of an element type neither UInt8 nor T is said once per
  // type, however many captures meet it; the call then runs without it, so that this is the
  // only error.
  template <class X, class A, class K>
  auto attend_masked(X&& x, const AttentionMasks<A, K>& masks) {
    return attend(std::forward<X>(x), [&](auto scores) {
      return masked<ops::AttentionMask::key_padding>(masked<ops::AttentionMask::attn>(scores, masks.attn),
                                                     masks.key_padding, !std::is_same_v<A, NoMask>);
    });
  }

  // The scores with one mask applied as Which, or as they are for NoMask. `mask` may be a
  // std::reference_wrapper (construct's key padding mask, not copied).
  template <ops::AttentionMask Which, class Scores, class Mask>
  auto masked(Scores scores, const Mask& mask, bool after_attn_mask = false) {
    if constexpr (std::is_same_v<Mask, NoMask>) {
      return scores;
    } else {
      using M = typename std::remove_cvref_t<std::unwrap_reference_t<Mask>>::value_type;
      if constexpr (!detail::mask_type_v<M, T>) {
        static_cast<void>(sizeof(detail::MaskType<M, T, Which>));
        return scores;
      } else {
        const std::unwrap_reference_t<Mask>& m = mask;
        return apply(ops::AttentionMaskOp<MultiheadAttention, M, Which>{this, -std::numeric_limits<double>::infinity(),
                                                                        after_attn_mask},
                     scores, m);
      }
    }
  }

  // The attention of x on itself, `mask` applied to the scores [batch, H, length, length]
  // after the causal mask and before softmax.
  template <class X, class Mask>
  auto attend(X&& x, Mask mask) {
    auto [q, k, v] =
        ops::split<-1, E, E, E>(in_proj(apply(ops::AttentionInputOp<MultiheadAttention>{this}, std::forward<X>(x))));
    // [batch, length, E] -> [batch, H, length, E / H]: PyTorch's view(B, T, H, dh).transpose(1, 2).
    const auto heads = [](const auto& t) { return ops::transpose<0, 2, 1, 3>(ops::unflatten<-1, H, E / H>(t)); };
    auto scores = ops::matmul(heads(q) * (T(1) / std::sqrt(static_cast<T>(head_dim))), heads(k), ops::transpose_b);
    auto weights = [&] {
      if constexpr (Causal)
        return ops::softmax(mask(ops::tril(scores, 0, -std::numeric_limits<T>::infinity())), -1);
      else
        return ops::softmax(mask(scores), -1);
    }();
    return out_proj(ops::flatten<-2, -1>(ops::transpose<0, 2, 1, 3>(ops::matmul(weights, heads(v)))));
  }
};

}  // namespace nn
}  // namespace duet
