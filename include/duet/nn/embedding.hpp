// Embedding: nn::Embedding and the operation it captures, a lookup of int32 indices in the
// layer's table (MindSpore's nn.Embedding).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../initializer.hpp"
#include "../operation.hpp"
#include "../ops/indexing.hpp"

namespace duet {
namespace ops {

template <class Layer>
struct EmbeddingGradOp;

namespace detail {
// Indices must be int32; In is the element type of what was passed.
template <class In>
void require_int32_indices(const std::string& who) {
  if constexpr (!std::is_same_v<In, std::int32_t>) {
    throw ValueError(who + " takes int32 indices, got a tensor of " + std::string(name_of(dtype_of<In>)));
  }
}
}  // namespace detail

// table[indices]: for indices of shape S, the rows of the layer's table they name, of shape
// S + [embedding_size]. An index outside [0, vocab_size) is a duet::IndexError. The indices have
// no gradient; the table's adds each row of dy where its index points (gather's rule, whose
// index check and row walk it shares). In is the indices' element type: any other than int32
// is refused when the operation runs.
template <class Layer, class In = std::int32_t>
struct EmbeddingOp : Primitive<EmbeddingOp<Layer, In>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  EmbeddingOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult rule(index_t embedding_size, const Shape& indices) {
    Shape y = indices;
    y.push_back(embedding_size);
    return {y};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::embedding_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->embedding_size(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::require_int32_indices<In>(label());
    const std::int32_t* idx = a.in<std::int32_t>();
    const index_t n = a.in_shape().numel();
    const Shape& table = layer->embedding_table.shape();
    detail::check_indices(idx, n, table[0], label());
    const T* rows = layer->embedding_table.data();
    T* y = a.out<T>();
    detail::for_each_gathered(table, 0, idx, n, [&](index_t o, index_t i, index_t count) { std::copy_n(rows + i, count, y + o); });
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }
  auto parameter_grad_op() const { return EmbeddingGradOp<Layer>{layer}; }

  static std::string op_name() { return "Embedding"; }
  std::string label() const { return layer->label(); }
  // ONNX: the table's rows the indices name.
  Interchange interchange(std::span<const Shape>) const {
    return {{"Gather", {InterchangeInput::of_parameter(&layer->embedding_table), InterchangeInput::operand(0)},
             {InterchangeAttribute::of("axis", 0)}}};
  }
};

// d/d table of EmbeddingOp: each row of dy added to the table row its index names, in index
// order (an index read twice gets both).
template <class Layer>
struct EmbeddingGradOp : Primitive<EmbeddingGradOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, indices
  static constexpr bool is_sink = true;

  const Layer* layer;
  EmbeddingGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const std::int32_t* idx = a.in<std::int32_t>(1);
    const index_t n = a.in_shape(1).numel();
    const Shape& table = layer->embedding_table.shape();
    detail::check_indices(idx, n, table[0], layer->label() + " (gradient)");
    T* dtable = layer->embedding_table.grad_for_add(duet::detail::current_backward_pass());
    const T* dy = a.in<T>(0);
    detail::for_each_gathered(table, 0, idx, n, [&](index_t o, index_t i, index_t count) {
      ::Eigen::Map<Array>(dtable + i, count) += ::Eigen::Map<const Array>(dy + o, count);
    });
  }

  static std::string op_name() { return "EmbeddingGrad (parameters only)"; }
  std::string label() const { return layer->label(); }
};

inline const bool embedding_listed = list_operations({"Embedding"});

}  // namespace ops

namespace nn {

// nn::Embedding's options (MindSpore's embedding_table, padding_idx): the table's initialiser,
// MindSpore's 'normal' (Normal(sigma=0.01)) if unset; padding_idx, a row set to zeros after it.
template <ElementType T>
struct EmbeddingOptions {
  std::optional<initializer::AnyInitializer<T>> embedding_table = std::nullopt;
  std::optional<index_t> padding_idx = std::nullopt;
};

// MindSpore's nn.Embedding(vocab_size, embedding_size): int32 indices of any shape S in, the
// rows of the table `embedding_table` ([vocab_size, embedding_size], its checkpoint name as in
// MindSpore; PyTorch calls it weight) they name out, of shape S + [embedding_size]. An index
// outside [0, vocab_size) is a duet::IndexError in both modes. Vocab and Dim are compile-time
// sizes (nn::Embedding<1000, 64>), or duet::dyn for sizes given to the constructor. As in
// MindSpore, padding_idx only zeroes its row at construction; its row still learns (PyTorch's
// padding_idx also keeps its gradient at zero).
template <index_t Vocab = dyn, index_t Dim = dyn, ElementType T = float>
class Embedding : public Cell<Embedding<Vocab, Dim, T>, CONTEXT_MODE, T> {
  static_assert(Vocab == dyn || Vocab > 0, "nn::Embedding<Vocab, Dim>: Vocab must be positive (or duet::dyn)");
  static_assert(Dim == dyn || Dim > 0, "nn::Embedding<Vocab, Dim>: Dim must be positive (or duet::dyn)");

 public:
  static constexpr index_t embedding_static = Dim;
  using input_value_type = std::int32_t;  // called with indices (Cell's call for them)

  BasicParameter<T> embedding_table;  // [vocab_size, embedding_size]
  DUET_CELL_MEMBERS(embedding_table);

  using Options = EmbeddingOptions<T>;

  Embedding() requires(Vocab != dyn && Dim != dyn) : Embedding(Vocab, Dim) {}
  explicit Embedding(Options options) requires(Vocab != dyn && Dim != dyn) : Embedding(Vocab, Dim, std::move(options)) {}

  Embedding(index_t vocab_size, index_t embedding_size, Options options = {}) : dim_(embedding_size) {
    if ((Vocab != dyn && vocab_size != Vocab) || (Dim != dyn && embedding_size != Dim) || vocab_size <= 0 ||
        embedding_size <= 0) {
      throw ValueError(type_name() + ": cannot be built with vocab_size " + std::to_string(vocab_size) +
                       " and embedding_size " + std::to_string(embedding_size));
    }
    if (options.padding_idx && (*options.padding_idx < 0 || *options.padding_idx >= vocab_size)) {
      throw ValueError(type_name() + ": padding_idx " + std::to_string(*options.padding_idx) + " is outside [0, " +
                       std::to_string(vocab_size) + ")");
    }
    auto table = BasicTensor<T>::uninitialized({vocab_size, embedding_size});
    const initializer::AnyInitializer<T> init = options.embedding_table.value_or(initializer::Normal{});
    try {
      initializer::initialize(table, init);
    } catch (const ValueError& e) {
      throw ValueError(type_name() + " embedding_table: " + e.what());
    }
    if (options.padding_idx) std::fill_n(table.data() + *options.padding_idx * embedding_size, embedding_size, T(0));
    embedding_table = BasicParameter<T>(std::move(table));
  }

  index_t vocab_size() const { return embedding_table.shape()[0]; }
  index_t embedding_size() const {
    if constexpr (Dim != dyn)
      return Dim;
    else
      return dim_;
  }

  // Indices of another element type compile (the one-tensor call of every cell instantiates
  // construct for tensors of T) and are refused when they run.
  template <class X>
  auto construct(X&& indices) {
    using In = typename std::remove_cvref_t<X>::value_type;
    return apply(ops::EmbeddingOp<Embedding, In>{this}, std::forward<X>(indices));
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = "nn::Embedding<" + size(Vocab) + ", " + size(Dim);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }
  std::string extra_repr() const override {
    if constexpr (Vocab != dyn && Dim != dyn)
      return {};
    else
      return std::to_string(embedding_table.shape()[0]) + ", " + std::to_string(dim_);
  }

 private:
  index_t dim_;
};

}  // namespace nn
}  // namespace duet
