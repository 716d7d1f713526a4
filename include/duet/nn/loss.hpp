// Losses: cells of two inputs (prediction, target) that reduce to what training minimises.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../backend.hpp"
#include "../cell.hpp"
#include "../eager.hpp"

namespace duet {
namespace nn {

using duet::Reduction;

// MindSpore's arguments, in its order, as template arguments: they change the graph's types.
// Sparse: labels are int32 class indices rather than distributions. Both default as in MindSpore.
template <bool Sparse, Reduction R, ElementType T>
class BasicSoftmaxCrossEntropyWithLogits;

template <Reduction R, ElementType T>
class BasicMSELoss;

}  // namespace nn

namespace ops {

template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyGradOp;
template <Reduction R>
struct SoftmaxCrossEntropyLabelGradOp;

// The reduced shape of a loss over per-row (or per-element) values of shape `rows`.
constexpr Shape reduced(const Shape& rows, Reduction r) { return r == Reduction::none ? rows : Shape{}; }

// Logits [..., classes] and labels [...] (sparse) or [..., classes]; the loss per row, or its
// mean or sum.
template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyOp : Primitive<SoftmaxCrossEntropyOp<Sparse, R>> {
  using layer_type = nn::BasicSoftmaxCrossEntropyWithLogits<Sparse, R, float>;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& z = in[0];
    const Shape& labels = in[1];
    Shape rows = z;
    if (z.leading_unknown()) return {R == Reduction::none ? Shape::any() : Shape{}};
    if (z.rank() == 0) return fault(Shape{}, ShapeFault::min_rank, 1);
    if (z.back() == 0) return fault(Shape{}, ShapeFault::last_dimension, 1);
    rows = Shape();
    for (int i = 0; i + 1 < z.rank(); ++i) rows.push_back(z[i]);
    const Shape& expected = Sparse ? rows : z;
    if (!labels.leading_unknown() && labels.is_concrete() && expected.is_concrete() && !(labels == expected)) {
      return fault(reduced(rows, R), ShapeFault::shapes_differ, 0, 1);
    }
    return {reduced(rows, R)};
  }
  ShapeResult infer(std::span<const Shape> in) const {
    const ShapeResult r = infer_static(in);
    if (!r.ok()) return r;
    // At run time every size is known: the labels must match exactly.
    Shape rows;
    for (int i = 0; i + 1 < in[0].rank(); ++i) rows.push_back(in[0][i]);
    if (!(in[1] == (Sparse ? rows : in[0]))) {
      return fault(r.shape, ShapeFault::shapes_differ, 0, 1);
    }
    return r;
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using L = std::conditional_t<Sparse, std::int32_t, T>;
    const index_t classes = a.in_shape(0).back();
    Backend::template softmax_cross_entropy<Sparse>(a.in<T>(0), a.in<L>(1), a.in_shape(0).numel() / classes, classes, R,
                                                    a.out<T>());
  }

  template <std::size_t K>
  auto grad_op() const {
    if constexpr (K == 0) return SoftmaxCrossEntropyGradOp<Sparse, R>{};
    else if constexpr (Sparse) return NoGradient{};  // class indices
    else return SoftmaxCrossEntropyLabelGradOp<R>{};
  }

  static std::string op_name() { return "SoftmaxCrossEntropy"; }
  std::string label() const { return "nn::SoftmaxCrossEntropyWithLogits"; }
};

template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyGradOp : Primitive<SoftmaxCrossEntropyGradOp<Sparse, R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;  // g, logits, labels

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using L = std::conditional_t<Sparse, std::int32_t, T>;
    const index_t classes = a.in_shape(1).back();
    Backend::template softmax_cross_entropy_grad<Sparse>(a.in<T>(0), a.in<T>(1), a.in<L>(2),
                                                         a.in_shape(1).numel() / classes, classes, R, a.out<T>());
  }

  static std::string op_name() { return "SoftmaxCrossEntropyGrad"; }
};

template <Reduction R, bool Target>
struct MSEGradOp;

// (prediction - target)² per element, or its mean or sum.
template <Reduction R>
struct MSEOp : Primitive<MSEOp<R>> {
  using layer_type = nn::BasicMSELoss<R, float>;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if (in[0].is_concrete() && in[1].is_concrete() && !(in[0] == in[1])) {
      return fault(reduced(in[0], R), ShapeFault::shapes_differ, 0, 1);
    }
    return {reduced(in[0], R)};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::mse(a.in<T>(0), a.in<T>(1), a.in_shape(0).numel(), R, a.out<T>());
  }

  // d/d target is d/d prediction with the two swapped: 2 (target - prediction).
  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return MSEGradOp<R, K == 1>{};
  }

  static std::string op_name() { return "MSE"; }
  std::string label() const { return "nn::MSELoss"; }
};

template <Reduction R, bool Target>
struct MSEGradOp : Primitive<MSEGradOp<R, Target>> {
  static constexpr std::array reads{graph::Operand::grad, Target ? graph::Operand::input1 : graph::Operand::input0,
                                    Target ? graph::Operand::input0 : graph::Operand::input1};
  static constexpr int arity = 3;  // g, the value differentiated, the other

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::mse_grad(a.in<T>(0), a.in<T>(1), a.in<T>(2), a.in_shape(1).numel(), R, a.out<T>());
  }

  static std::string op_name() { return "MSEGrad"; }
};

// d/d labels of the dense form: -log_softmax(logits), scaled as the loss reduces. (MindSpore
// gives labels no gradient; PyTorch gives this one, the derivative.)
template <Reduction R>
struct SoftmaxCrossEntropyLabelGradOp : Primitive<SoftmaxCrossEntropyLabelGradOp<R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // g, logits

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* g = a.in<T>(0);
    const T* z = a.in<T>(1);
    T* d = a.out<T>();
    const index_t classes = a.in_shape(1).back();
    const index_t rows = classes == 0 ? 0 : a.in_shape(1).numel() / classes;
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      const T lse = kernels::log_sum_exp(row, classes);
      const T scale = R == Reduction::none ? g[i] : R == Reduction::mean ? g[0] / static_cast<T>(rows) : g[0];
      for (index_t c = 0; c < classes; ++c) d[i * classes + c] = (lse - row[c]) * scale;
    }
  }

  static std::string op_name() { return "SoftmaxCrossEntropyLabelGrad"; }
};

template <bool Sparse = false, Reduction R = Reduction::none, class Z, class Labels>
auto softmax_cross_entropy(const Z& logits, const Labels& labels) {
  using L = typename std::remove_cvref_t<Labels>::value_type;
  static_assert(!Sparse || std::is_same_v<L, std::int32_t>,
                "nn::SoftmaxCrossEntropyWithLogits<true>: sparse labels must be int32 class indices");
  static_assert(Sparse || std::is_same_v<L, typename std::remove_cvref_t<Z>::value_type>,
                "nn::SoftmaxCrossEntropyWithLogits<false>: labels must be distributions of the "
                "logits' element type");
  return apply(SoftmaxCrossEntropyOp<Sparse, R>{}, logits, labels);
}

template <Reduction R = Reduction::mean, class X, class Y>
auto mse(const X& prediction, const Y& target) {
  static_assert(
      std::is_same_v<typename std::remove_cvref_t<X>::value_type, typename std::remove_cvref_t<Y>::value_type>,
      "nn::MSELoss: prediction and target must have the same element type");
  return apply(MSEOp<R>{}, prediction, target);
}

}  // namespace ops

namespace nn {

// MindSpore's nn.SoftmaxCrossEntropyWithLogits(sparse, reduction):
// nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> is (sparse=True, reduction='mean').
template <bool Sparse = false, Reduction R = Reduction::none, ElementType T = float>
class BasicSoftmaxCrossEntropyWithLogits
    : public Cell<BasicSoftmaxCrossEntropyWithLogits<Sparse, R, T>, CONTEXT_MODE, T> {
 public:
  template <class Z, class Labels>
  auto construct(const Z& logits, const Labels& labels) {
    return ops::softmax_cross_entropy<Sparse, R>(logits, labels);
  }
  std::string type_name() const override { return "nn::SoftmaxCrossEntropyWithLogits"; }
};

template <bool Sparse = false, Reduction R = Reduction::none>
using SoftmaxCrossEntropyWithLogits = BasicSoftmaxCrossEntropyWithLogits<Sparse, R, float>;

// MindSpore's nn.MSELoss(reduction), mean by default.
template <Reduction R = Reduction::mean, ElementType T = float>
class BasicMSELoss : public Cell<BasicMSELoss<R, T>, CONTEXT_MODE, T> {
 public:
  template <class X, class Y>
  auto construct(const X& prediction, const Y& target) {
    return ops::mse<R>(prediction, target);
  }
  std::string type_name() const override { return "nn::MSELoss"; }
};

template <Reduction R = Reduction::mean>
using MSELoss = BasicMSELoss<R, float>;

}  // namespace nn
}  // namespace duet
