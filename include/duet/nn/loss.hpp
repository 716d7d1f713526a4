// Losses: cells of two inputs (prediction, target) that reduce to what training minimises.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../backend.hpp"
#include "../cell.hpp"
#include "../eager.hpp"
#include "activation.hpp"

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
  static_assert(R != Reduction::batchmean, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
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
      return fault(reduced(rows, R), ShapeFault::class_labels, Sparse ? 1 : 0, 1);
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
      return fault(r.shape, ShapeFault::class_labels, Sparse ? 1 : 0, 1);
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
  static_assert(R != Reduction::batchmean, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
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

// The checks of a loss's element types are classes keyed on the element types alone, not on
// the inputs' (real or symbolic) types: a training step compiles the loss for several forms,
// and a wrong type is then reported once, not once per form (see ClassLabelsCheck).
template <bool Sparse, class Label, class Value>
struct SoftmaxLabelsCheck {
  static constexpr bool ok = Sparse ? std::is_same_v<Label, std::int32_t> : std::is_same_v<Label, Value>;
  static_assert(!Sparse || ok,
                "nn::SoftmaxCrossEntropyWithLogits<true>: sparse labels must be int32 class indices (PyTorch's "
                "int64 torch.long labels, or float ones, become a duet::BasicTensor<std::int32_t>)");
  static_assert(Sparse || ok,
                "nn::SoftmaxCrossEntropyWithLogits<false>: labels must be distributions of the logits' element type");
};
template <class Prediction, class Target>
struct TargetTypeCheck {
  static constexpr bool ok = std::is_same_v<Prediction, Target>;
  static_assert(ok, "duet::ops: a loss's prediction and target must have the same element type");
};

template <bool Sparse = false, Reduction R = Reduction::none, class Z, class Labels>
auto softmax_cross_entropy(const Z& logits, const Labels& labels) {
  using Check = SoftmaxLabelsCheck<Sparse, typename std::remove_cvref_t<Labels>::value_type,
                                   typename std::remove_cvref_t<Z>::value_type>;
  if constexpr (Check::ok) return apply(SoftmaxCrossEntropyOp<Sparse, R>{}, logits, labels);
  else return logits;  // after the assertion: no second error from an operation on such labels
}

template <Reduction R = Reduction::mean, class X, class Y>
auto mse(const X& prediction, const Y& target) {
  using Check = TargetTypeCheck<typename std::remove_cvref_t<X>::value_type, typename std::remove_cvref_t<Y>::value_type>;
  if constexpr (Check::ok) return apply(MSEOp<R>{}, prediction, target);
  else return prediction;
}

}  // namespace ops

namespace nn {

// MindSpore's nn.SoftmaxCrossEntropyWithLogits(sparse, reduction):
// nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> is (sparse=True, reduction='mean').
template <bool Sparse = false, Reduction R = Reduction::none, ElementType T = float>
class BasicSoftmaxCrossEntropyWithLogits
    : public Cell<BasicSoftmaxCrossEntropyWithLogits<Sparse, R, T>, CONTEXT_MODE, T> {
 public:
  static constexpr Reduction reduction = R;
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
  static constexpr Reduction reduction = R;
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

// ---------------------------------------------------------------------------------------------
// More losses (MindSpore's nn.L1Loss, SmoothL1Loss, KLDivLoss, BCELoss, BCEWithLogitsLoss,
// NLLLoss and CrossEntropyLoss). `reduction` is a template argument, as for the two above: it changes the
// output's shape, hence the graph's type. Numbers that do not change the shape (beta,
// label_smoothing, ignore_index) are members of the operation.
namespace duet {
namespace nn {

template <class Fn, Reduction R, ElementType T>
class BasicPointwiseLoss;
template <bool Logits, Reduction R, ElementType T>
class BasicClassLoss;

}  // namespace nn

namespace fn {

// The pointwise losses: value(x, y) per element, and its partial derivative in each argument,
// partial<K>(x, y), all on Eigen arrays so that the kernels vectorise (exp, log1p, logistic).
// They return expressions, evaluated once into the output: no temporary array per call.
// Each formula is PyTorch's, stated beside it; MindSpore's are the same.

// torch.nn.L1Loss: |x - y|. d/dx = sign(x - y), 0 at x = y (torch.sign(0) = 0).
struct L1Loss {
  static constexpr std::string_view name = "nn::L1Loss";
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    return (x - y).abs();
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    return S(K == 0 ? 1 : -1) * (x - y).sign();
  }
};

// torch.nn.SmoothL1Loss(beta): 0.5 d² / beta where |d| < beta, |d| - 0.5 beta elsewhere,
// d = x - y. beta = 0 is the L1 loss (the quadratic branch is never taken).
struct SmoothL1Loss {
  static constexpr std::string_view name = "nn::SmoothL1Loss";
  double beta = 1.0;
  void validate() const {
    if (!(beta >= 0)) throw ValueError("nn::SmoothL1Loss: beta must be >= 0, got " + std::to_string(beta));
  }
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    const S b = static_cast<S>(beta);
    return ((x - y).abs() < b).select(S(0.5) * (x - y).square() / b, (x - y).abs() - S(0.5) * b);
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    const S b = static_cast<S>(beta);
    return S(K == 0 ? 1 : -1) * ((x - y).abs() < b).select((x - y) / b, (x - y).sign());
  }
};

// MindSpore's nn.KLDivLoss (torch.nn.KLDivLoss, log_target=False): the input x is a
// log-probability, the target y a probability, and the loss y (log y - x), 0 where y = 0
// (torch.xlogy). d/dx = -y; d/dy = log y + 1 - x, which is -inf at y = 0 as the function's
// slope is.
struct KLDivLoss {
  static constexpr std::string_view name = "nn::KLDivLoss";
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    return (y == S(0)).select(X::Zero(x.rows(), x.cols()), y * (y.log() - x));
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    if constexpr (K == 0) return -y;
    else return y.log() + S(1) - x;
  }
};

// torch.nn.BCEWithLogitsLoss: -[y log σ(x) + (1 - y) log(1 - σ(x))], in the form that neither
// overflows nor loses digits for large |x|: max(x, 0) - x y + log1p(exp(-|x|)).
// d/dx = σ(x) - y; d/dy = -x.
struct BCEWithLogitsLoss {
  static constexpr std::string_view name = "nn::BCEWithLogitsLoss";
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    return x.max(S(0)) - x * y + (-x.abs()).exp().log1p();
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    if constexpr (K == 0) return x.logistic() - y;
    else return -x;
  }
};

// torch.nn.BCELoss (MindSpore's nn.BCELoss): the input x is a probability, the target y too,
// and the loss -[y log x + (1 - y) log(1 - x)], each log clamped at -100 as PyTorch does, so
// that x = 0 or 1 gives 100, not infinity. d/dx = (x - y) / max(x (1 - x), ε), PyTorch's
// (finite at 0 and 1; ε is its float 1e-12); d/dy = log(1 - x) - log x, clamped alike: the
// slope of the clamped loss, where PyTorch gives ±inf at x = 0 and 1. An x outside [0, 1] is a
// ValueError (PyTorch's too): logits passed where probabilities belong would otherwise give
// NaN, or, from a clamped log, a loss that trains nothing.
struct BCELoss {
  static constexpr std::string_view name = "nn::BCELoss";
  template <class X>
  static void check_input(const X& x) {
    // Written so that a NaN fails it too.
    if (!((x >= typename X::Scalar(0)) && (x <= typename X::Scalar(1))).all()) {
      std::ostringstream got;  // -1e-07 as such, where std::to_string would print -0.000000
      got << static_cast<double>(x.minCoeff()) << " to " << static_cast<double>(x.maxCoeff());
      throw ValueError("nn::BCELoss: the input must be probabilities in [0, 1] (for logits, nn::BCEWithLogitsLoss); got " +
                       got.str());
    }
  }
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    check_input(x);
    return -(y * x.log().max(S(-100)) + (S(1) - y) * (S(1) - x).log().max(S(-100)));
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    if constexpr (K == 0) return (x - y) / (x * (S(1) - x)).max(static_cast<S>(1e-12f));
    else return (S(1) - x).log().max(S(-100)) - x.log().max(S(-100));
  }
};

}  // namespace fn

namespace ops {

namespace detail {

// What a mean divides the sum of a loss's n values, of shape `s`, by: n, or for batchmean
// the size of axis 0 (MindSpore's KLDivLoss; a scalar has none, refused by the shape rule).
template <Reduction R>
index_t mean_count(const Shape& s) {
  if constexpr (R == Reduction::batchmean) return s.rank() == 0 ? 0 : s[0];
  else return s.numel();
}

// A loss over per-element values of `values` shape: they, or their sum, or that sum divided
// by `count` (mean_count).
template <Reduction R, class T, class A>
void reduce_loss(const A& values, index_t n, index_t count, T* out) {
  using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  if constexpr (R == Reduction::none) ::Eigen::Map<Array>(out, n) = values;
  else if constexpr (R == Reduction::sum) out[0] = n == 0 ? T(0) : values.sum();
  else out[0] = n == 0 || count == 0 ? T(0) : values.sum() / static_cast<T>(count);
}

// The incoming gradient of a reduced loss as each of its terms sees it; a mean's terms are
// `count`.
template <Reduction R, class T>
T reduced_scale(const T* g, index_t count) {
  if constexpr (R == Reduction::mean || R == Reduction::batchmean) return count == 0 ? T(0) : g[0] / static_cast<T>(count);
  else return g[0];
}

}  // namespace detail

template <class Fn, Reduction R, int K>
struct PointwiseLossGradOp;

// Fn's loss between a prediction and a target of the same shape, per element or reduced.
template <class Fn, Reduction R>
struct PointwiseLossOp : Primitive<PointwiseLossOp<Fn, R>> {
  static_assert(R != Reduction::batchmean || std::is_same_v<Fn, fn::KLDivLoss>, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
  using layer_type = nn::BasicPointwiseLoss<Fn, R, float>;
  static constexpr int arity = 2;
  Fn fn;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if (in[0].is_concrete() && in[1].is_concrete() && !(in[0] == in[1])) {
      return fault(reduced(in[0], R), ShapeFault::shapes_differ, 0, 1);
    }
    // batchmean divides by the size of axis 0, which a scalar does not have (MindSpore refuses it).
    if (R == Reduction::batchmean && in[0].rank() == 0 && !in[0].leading_unknown()) {
      return fault(Shape{}, ShapeFault::min_rank, 1);
    }
    return {reduced(in[0], R)};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const index_t n = a.in_shape(0).numel();
    detail::reduce_loss<R>(fn.value(::Eigen::Map<const Array>(a.in<T>(0), n), ::Eigen::Map<const Array>(a.in<T>(1), n)),
                           n, detail::mean_count<R>(a.in_shape(0)), a.out<T>());
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return PointwiseLossGradOp<Fn, R, static_cast<int>(K)>{{}, fn};
  }

  static std::string op_name() { return std::string(Fn::name).substr(4); }
  std::string label() const { return std::string(Fn::name); }
};

// d/d input K of PointwiseLossOp: the partial times the incoming gradient, which is one value
// per element (no reduction) or one for all.
template <class Fn, Reduction R, int K>
struct PointwiseLossGradOp : Primitive<PointwiseLossGradOp<Fn, R, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;  // g, prediction, target
  Fn fn;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const index_t n = a.in_shape(1).numel();
    const auto partial =
        fn.template partial<K>(::Eigen::Map<const Array>(a.in<T>(1), n), ::Eigen::Map<const Array>(a.in<T>(2), n));
    if constexpr (R == Reduction::none) {
      ::Eigen::Map<Array>(a.out<T>(), n) = partial * ::Eigen::Map<const Array>(a.in<T>(0), n);
    } else {
      ::Eigen::Map<Array>(a.out<T>(), n) = partial * detail::reduced_scale<R>(a.in<T>(0), detail::mean_count<R>(a.in_shape(1)));
    }
  }

  static std::string op_name() { return std::string(Fn::name).substr(4) + "Grad" + std::to_string(K); }
};

template <class Fn, Reduction R, class X, class Y>
auto pointwise_loss(const Fn& fn, const X& prediction, const Y& target) {
  using Check = TargetTypeCheck<typename std::remove_cvref_t<X>::value_type, typename std::remove_cvref_t<Y>::value_type>;
  if constexpr (requires { fn.validate(); }) fn.validate();
  if constexpr (Check::ok) return apply(PointwiseLossOp<Fn, R>{{}, fn}, prediction, target);
  else return prediction;
}

// MindSpore's ops.l1_loss(input, target, reduction='mean').
template <Reduction R = Reduction::mean, class X, class Y>
auto l1_loss(const X& input, const Y& target) {
  return pointwise_loss<fn::L1Loss, R>(fn::L1Loss{}, input, target);
}

// MindSpore's ops.smooth_l1_loss(input, target, beta=1.0, reduction='none').
template <Reduction R = Reduction::none, class X, class Y>
auto smooth_l1_loss(const X& input, const Y& target, double beta = 1.0) {
  return pointwise_loss<fn::SmoothL1Loss, R>(fn::SmoothL1Loss{beta}, input, target);
}

// MindSpore's ops.kl_div(logits, labels, reduction='mean'): logits are log-probabilities.
// 'mean' averages over every element, as MindSpore's and PyTorch's 'mean' do; the KL
// divergence proper is Reduction::batchmean, the sum divided by the size of axis 0.
template <Reduction R = Reduction::mean, class X, class Y>
auto kl_div(const X& logits, const Y& labels) {
  return pointwise_loss<fn::KLDivLoss, R>(fn::KLDivLoss{}, logits, labels);
}

// MindSpore's ops.binary_cross_entropy_with_logits(logits, label, weight=None,
// pos_weight=None, reduction='mean'), without weight and pos_weight.
template <Reduction R = Reduction::mean, class X, class Y>
auto binary_cross_entropy_with_logits(const X& logits, const Y& label) {
  return pointwise_loss<fn::BCEWithLogitsLoss, R>(fn::BCEWithLogitsLoss{}, logits, label);
}

// MindSpore's ops.binary_cross_entropy(logits, labels, weight=None, reduction='mean'), without
// weight: despite MindSpore's name, `probabilities` are probabilities (a sigmoid's output).
template <Reduction R = Reduction::mean, class X, class Y>
auto binary_cross_entropy(const X& probabilities, const Y& labels) {
  return pointwise_loss<fn::BCELoss, R>(fn::BCELoss{}, probabilities, labels);
}

// MindSpore's keyword arguments of nn.CrossEntropyLoss and nn.NLLLoss, weight aside: labels
// equal to ignore_index add nothing and do not count in the mean; label_smoothing ε takes the
// target distribution q to (1 - ε) q + ε / classes.
struct CrossEntropyOptions {
  int ignore_index = -100;
  double label_smoothing = 0.0;

  void validate(std::string_view who) const {
    if (!(label_smoothing >= 0 && label_smoothing <= 1)) {
      throw ValueError(std::string(who) + ": label_smoothing must be in [0, 1], got " +
                       std::to_string(label_smoothing));
    }
  }
};

template <bool Sparse, bool Logits, Reduction R>
struct ClassLossGradOp;
template <bool Logits, Reduction R>
struct ClassLossLabelGradOp;

// The loss of a distribution over the last axis against a class (Sparse: int32 labels [...])
// or a target distribution (labels [..., classes]): -Σ_c q_c lp_c per row, where lp is the
// input itself (NLLLoss, log-probabilities) or log_softmax of it (Logits: CrossEntropyLoss),
// and q the target, smoothed. PyTorch: torch.nn.functional.nll_loss / cross_entropy(input,
// target, ignore_index, reduction, label_smoothing), classes on the last axis rather than on
// axis 1 (the same for the usual [batch, classes]). 'mean' divides by the rows not ignored.
template <bool Sparse, bool Logits, Reduction R>
struct ClassLossOp : Primitive<ClassLossOp<Sparse, Logits, R>> {
  static_assert(R != Reduction::batchmean, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
  using layer_type = nn::BasicClassLoss<Logits, R, float>;
  static constexpr int arity = 2;
  static constexpr std::string_view name = Logits ? "nn::CrossEntropyLoss" : "nn::NLLLoss";
  CrossEntropyOptions options;

  // The rule of softmax cross-entropy: [..., classes] against [...] or [..., classes].
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return SoftmaxCrossEntropyOp<Sparse, R>::infer_static(in);
  }
  ShapeResult infer(std::span<const Shape> in) const { return SoftmaxCrossEntropyOp<Sparse, R>{}.infer(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto [rows, classes] = shape_of(a);
    const T* z = a.in<T>(0);
    T* out = a.out<T>();
    const T keep = static_cast<T>(1 - options.label_smoothing);
    const T spread = static_cast<T>(options.label_smoothing / static_cast<double>(classes));
    T total = 0;
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      const T shift = log_normaliser<Backend>(row, classes);
      const ::Eigen::Map<const Array> lp_plus_shift(row, classes);
      T loss = 0;
      if constexpr (Sparse) {
        const std::int32_t label = a.in<std::int32_t>(1)[i];
        if (label != options.ignore_index) {
          const index_t c = checked_label(label, i, classes);
          loss = -keep * (row[c] - shift);
          // Without smoothing the other classes take no part: a logit of -inf (a masked class)
          // would make 0 · -inf = NaN of the loss, where PyTorch's is finite.
          if (spread != 0) loss -= spread * (lp_plus_shift.sum() - static_cast<T>(classes) * shift);
        }
      } else {
        const ::Eigen::Map<const Array> p(a.in<T>(1) + i * classes, classes);
        loss = -((keep * p + spread) * (lp_plus_shift - shift)).sum();
      }
      if constexpr (R == Reduction::none) out[i] = loss;
      else total += loss;
    }
    if constexpr (R == Reduction::sum) out[0] = total;
    if constexpr (R == Reduction::mean) {
      const index_t counted = counted_rows(a);
      out[0] = counted == 0 ? T(0) : total / static_cast<T>(counted);
    }
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    if constexpr (K == 0) return ClassLossGradOp<Sparse, Logits, R>{{}, options};
    else if constexpr (Sparse) return NoGradient{};  // class indices
    else return ClassLossLabelGradOp<Logits, R>{{}, options};
  }

  static std::string op_name() { return Logits ? "CrossEntropy" : "NLL"; }
  std::string label() const { return std::string(name); }

  // What the kernels share with the gradients'.
  static std::pair<index_t, index_t> shape_of(const graph::KernelArgs& a, std::size_t input = 0) {
    const index_t classes = a.in_shape(input).back();
    return {classes == 0 ? 0 : a.in_shape(input).numel() / classes, classes};
  }
  // log Σ exp(row), by which logits exceed log-probabilities; 0 for log-probabilities.
  template <class Backend, class T>
  static T log_normaliser(const T* row, index_t classes) {
    if constexpr (Logits) return kernels::log_sum_exp(row, classes);
    else return T(0);
  }
  // The rows 'mean' divides by: those whose label is not ignore_index (all, for distributions).
  index_t counted_rows(const graph::KernelArgs& a, std::size_t logits = 0) const {
    const index_t rows = shape_of(a, logits).first;
    if constexpr (!Sparse) {
      return rows;
    } else {
      const std::int32_t* labels = a.in<std::int32_t>(logits + 1);
      return static_cast<index_t>(std::count_if(labels, labels + rows, [&](std::int32_t l) { return l != options.ignore_index; }));
    }
  }
  index_t checked_label(std::int32_t label, index_t row, index_t classes) const {
    if (label < 0 || label >= classes) {
      throw ValueError(std::string(name) + ": label " +
                       std::to_string(label) + " of sample " + std::to_string(row) + " is outside [0, " +
                       std::to_string(classes) + ") and is not ignore_index (" +
                       std::to_string(options.ignore_index) + ")");
    }
    return label;
  }
};

// d/d input of ClassLossOp, row by row: -q (log-probabilities in), or softmax · Σq - q
// (logits in), times the incoming gradient as the reduction spreads it.
template <bool Sparse, bool Logits, Reduction R>
struct ClassLossGradOp : Primitive<ClassLossGradOp<Sparse, Logits, R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;  // g, input, labels
  CrossEntropyOptions options;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Forward = ClassLossOp<Sparse, Logits, R>;
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Forward forward{{}, options};
    const auto [rows, classes] = Forward::shape_of(a, 1);
    const T* g = a.in<T>(0);
    const T* z = a.in<T>(1);
    const T keep = static_cast<T>(1 - options.label_smoothing);
    const T spread = static_cast<T>(options.label_smoothing / static_cast<double>(classes));
    const T shared = R == Reduction::none ? T(0) : detail::reduced_scale<R>(g, forward.counted_rows(a, 1));
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      ::Eigen::Map<Array> d(a.out<T>() + i * classes, classes);
      const T scale = R == Reduction::none ? g[i] : shared;
      if constexpr (Sparse) {
        const std::int32_t label = a.in<std::int32_t>(2)[i];
        if (label == options.ignore_index) {
          d.setZero();
          continue;
        }
        const index_t c = forward.checked_label(label, i, classes);
        // Σq = 1 here.
        if constexpr (Logits) {
          const T lse = Forward::template log_normaliser<Backend>(row, classes);
          d = fn::exp_array(::Eigen::Map<const Array>(row, classes) - lse) - spread;
        } else {
          d.setConstant(-spread);
        }
        d[c] -= keep;
        d *= scale;
      } else {
        const auto q = keep * ::Eigen::Map<const Array>(a.in<T>(2) + i * classes, classes) + spread;
        if constexpr (Logits) {
          const T lse = Forward::template log_normaliser<Backend>(row, classes);
          const T q_sum = q.sum();
          d = (fn::exp_array(::Eigen::Map<const Array>(row, classes) - lse) * q_sum - q) * scale;
        } else {
          d = -q * scale;
        }
      }
    }
  }

  static std::string op_name() { return Logits ? "CrossEntropyGrad" : "NLLGrad"; }
};

// d/d target distribution of the dense form: -(1 - ε) lp, times the incoming gradient.
// (MindSpore gives labels no gradient; PyTorch gives this one, the derivative.)
template <bool Logits, Reduction R>
struct ClassLossLabelGradOp : Primitive<ClassLossLabelGradOp<Logits, R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // g, input
  CrossEntropyOptions options;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Forward = ClassLossOp<false, Logits, R>;
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto [rows, classes] = Forward::shape_of(a, 1);
    const T* g = a.in<T>(0);
    const T keep = static_cast<T>(1 - options.label_smoothing);
    for (index_t i = 0; i < rows; ++i) {
      const T* row = a.in<T>(1) + i * classes;
      const T scale = R == Reduction::none ? g[i] : detail::reduced_scale<R>(g, rows);
      const T shift = Forward::template log_normaliser<Backend>(row, classes);
      ::Eigen::Map<Array>(a.out<T>() + i * classes, classes) =
          -keep * scale * (::Eigen::Map<const Array>(row, classes) - shift);
    }
  }

  static std::string op_name() { return Logits ? "CrossEntropyLabelGrad" : "NLLLabelGrad"; }
};

// Whether a class loss takes labels of element type Label for values of type Value. A class
// keyed on the element types alone, not on the input's (real or symbolic) type: a training step
// compiles the loss for several forms, and a wrong label type is then reported once, not once
// per form. PyTorch's class indices are int64 (torch.long); duet's, as MindSpore's, int32.
template <bool Logits, class Label, class Value>
struct ClassLabelsCheck {
  static constexpr bool sparse = std::is_same_v<Label, std::int32_t>;
  static constexpr bool ok = sparse || (Logits && std::is_same_v<Label, Value>);
  static_assert(sparse || !Logits || std::is_same_v<Label, Value>,
                "duet::ops: nn::CrossEntropyLoss takes labels of int32 class indices (PyTorch's int64 torch.long "
                "labels become a duet::BasicTensor<std::int32_t>), or distributions of the input's element type");
  static_assert(sparse || Logits,
                "duet::ops: nn::NLLLoss takes labels of int32 class indices (PyTorch's int64 torch.long labels "
                "become a duet::BasicTensor<std::int32_t>)");
};

template <bool Logits, Reduction R, class X, class Labels>
auto class_loss(const X& input, const Labels& labels, const CrossEntropyOptions& options) {
  using L = typename std::remove_cvref_t<Labels>::value_type;
  using Check = ClassLabelsCheck<Logits, L, typename std::remove_cvref_t<X>::value_type>;
  if constexpr (Check::ok) {
    options.validate(ClassLossOp<Check::sparse, Logits, R>::name);
    return apply(ClassLossOp<Check::sparse, Logits, R>{{}, options}, input, labels);
  } else {
    return input;  // after the assertion: no second error from an operation on such labels
  }
}

// MindSpore's ops.nll_loss(inputs, target, ignore_index=-100, reduction='mean',
// label_smoothing=0.0), without weight: inputs are log-probabilities, target int32 classes.
template <Reduction R = Reduction::mean, class X, class Labels>
auto nll_loss(const X& inputs, const Labels& target, const CrossEntropyOptions& options = {}) {
  return class_loss<false, R>(inputs, target, options);
}

// MindSpore's ops.cross_entropy(input, target, ignore_index=-100, reduction='mean',
// label_smoothing=0.0), without weight: input are logits, target int32 classes or
// probabilities (the form follows the labels' element type, as in MindSpore).
template <Reduction R = Reduction::mean, class X, class Labels>
auto cross_entropy(const X& input, const Labels& target, const CrossEntropyOptions& options = {}) {
  return class_loss<true, R>(input, target, options);
}

inline const bool losses_listed = list_operations(
    {"l1_loss", "smooth_l1_loss", "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits", "nll_loss",
     "cross_entropy"});

}  // namespace ops

namespace nn {

// A loss cell over one of the pointwise functions above; the names below are MindSpore's.
template <class Fn, Reduction R = Reduction::mean, ElementType T = float>
class BasicPointwiseLoss : public Cell<BasicPointwiseLoss<Fn, R, T>, CONTEXT_MODE, T> {
 public:
  static constexpr Reduction reduction = R;
  // The function's numbers, MindSpore's keyword arguments: nn::SmoothL1Loss<>({.beta = 0.5}).
  explicit BasicPointwiseLoss(Fn fn = {}) : fn_(fn) {
    if constexpr (requires { fn.validate(); }) fn.validate();
  }

  template <class X, class Y>
  auto construct(const X& prediction, const Y& target) {
    return ops::pointwise_loss<Fn, R>(fn_, prediction, target);
  }
  std::string type_name() const override { return std::string(Fn::name); }

 private:
  Fn fn_;
};

// MindSpore's nn.NLLLoss(ignore_index=-100, reduction='mean'), without weight, and
// nn.CrossEntropyLoss(ignore_index=-100, reduction='mean', label_smoothing=0.0):
// nn::CrossEntropyLoss<> loss({.label_smoothing = 0.1}).
template <bool Logits, Reduction R, ElementType T>
class BasicClassLoss : public Cell<BasicClassLoss<Logits, R, T>, CONTEXT_MODE, T> {
 public:
  static constexpr Reduction reduction = R;
  explicit BasicClassLoss(ops::CrossEntropyOptions options = {}) : options_(options) { options_.validate(type_name()); }
  const ops::CrossEntropyOptions& options() const { return options_; }
  template <class X, class Labels>
  auto construct(const X& input, const Labels& labels) {
    return ops::class_loss<Logits, R>(input, labels, options_);
  }
  std::string type_name() const override { return std::string(ops::ClassLossOp<false, Logits, R>::name); }

 private:
  ops::CrossEntropyOptions options_;
};

template <Reduction R = Reduction::mean, ElementType T = float>
using BasicNLLLoss = BasicClassLoss<false, R, T>;
template <Reduction R = Reduction::mean, ElementType T = float>
using BasicCrossEntropyLoss = BasicClassLoss<true, R, T>;
template <Reduction R = Reduction::mean>
using NLLLoss = BasicNLLLoss<R, float>;
template <Reduction R = Reduction::mean>
using CrossEntropyLoss = BasicCrossEntropyLoss<R, float>;

template <Reduction R = Reduction::mean>
using L1Loss = BasicPointwiseLoss<fn::L1Loss, R, float>;

template <Reduction R = Reduction::mean>
using KLDivLoss = BasicPointwiseLoss<fn::KLDivLoss, R, float>;

// MindSpore's nn.BCELoss(weight=None, reduction='mean'), without weight: on probabilities.
template <Reduction R = Reduction::mean>
using BCELoss = BasicPointwiseLoss<fn::BCELoss, R, float>;

// MindSpore's nn.BCEWithLogitsLoss(reduction='mean'), without weight and pos_weight.
template <Reduction R = Reduction::mean>
using BCEWithLogitsLoss = BasicPointwiseLoss<fn::BCEWithLogitsLoss, R, float>;

// MindSpore's nn.SmoothL1Loss(beta=1.0, reduction='none'): nn::SmoothL1Loss<>({.beta = 0.5}).
template <Reduction R = Reduction::none>
using SmoothL1Loss = BasicPointwiseLoss<fn::SmoothL1Loss, R, float>;

}  // namespace nn
}  // namespace duet
