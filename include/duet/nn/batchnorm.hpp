// Batch normalisation: nn::BatchNorm1d, nn::BatchNorm2d and the operations they capture.
//
// Layout NCL / NCHW: the statistics of channel c are taken over every axis but axis 1. Each
// channel's elements lie in `batch` contiguous runs of `spatial` elements (one per sample),
// which the kernels read as Eigen arrays, so they vectorise without a transposed copy.
// Measured (g++ 12 -O2, no -march, one core of the project's AMD EPYC, medians of 21, while
// other jobs shared the machine): [32, 64, 28, 28] float, training (two passes for the
// statistics, one to normalise) 1.49 ms, evaluation 0.58 ms, against 0.17 ms for a memcpy of
// the input and 21 ms for the same statistics in plain loops in double. BatchNorm1d on [N, C]
// has runs of one element, so it goes channel by channel with strided reads (not vectorised
// across channels; a row-wise form would need scratch for C statistics).
//
// Training (set_train()) normalises with the batch's statistics, mean and biased variance,
// and moves the moving statistics towards them; evaluation normalises with the moving
// statistics and leaves them alone. Both are the same kernels in both modes, so the outputs,
// the gradients and the moving statistics agree bit for bit. A training step that fails after
// the forward pass ran puts the moving statistics back (duet::detail::StepState).
//
// Folding into a convolution (graph mode at evaluation, O1 and O2): an evaluation BatchNorm is
// the per-channel affine map y = x · scale + shift of BatchNorm::evaluation_affine(), which
// passes::fuse_epilogues (and PIJit's fusion, through ops::EvaluationNorm) folds into the
// weight and bias of the convolution before it (W'[c] = W[c] · scale[c], b'[c] = b[c] ·
// scale[c] + shift[c]) when it meets (Conv, BatchNormOp<Layer, Phase::eval>): ops/conv.hpp's
// ConvEpilogueOp. Only the evaluation
// form has that node type, so training is never folded. The folded weight is the conv
// weight's derived() form, remade when the weight, the bias or any of this layer's four
// tensors changes version().
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../operation.hpp"
#include "../ops/evaluation_norm.hpp"
#include "../ops/phase.hpp"

namespace duet {
namespace ops {

template <class Layer, graph::Phase P, bool InputGrad>
struct BatchNormGradOp;

namespace detail {

// Where channel c's elements are: `batch` runs of `spatial` elements, run n starting at
// (n · channels + c) · spatial.
struct ChannelRuns {
  index_t batch;
  index_t channels;
  index_t spatial;

  explicit ChannelRuns(const Shape& x) : batch(x[0]), channels(x[1]), spatial(1) {
    for (int a = 2; a < x.rank(); ++a) spatial *= x[a];
  }
  index_t count() const { return batch * spatial; }
  index_t offset(index_t n, index_t c) const { return (n * channels + c) * spatial; }

  // f(run) for each run of channel c, run being an Eigen map of its elements in data.
  template <class T, class F>
  void for_each_run(T* data, index_t c, F&& f) const {
    using Array = ::Eigen::Array<std::remove_const_t<T>, ::Eigen::Dynamic, 1>;
    using Map = std::conditional_t<std::is_const_v<T>, ::Eigen::Map<const Array>, ::Eigen::Map<Array>>;
    for (index_t n = 0; n < batch; ++n) f(Map(data + offset(n, c), spatial));
  }
};

// Channel c's batch mean and biased variance, the variance taken around the mean in a second
// pass (no digits lost to E[x²] - E[x]² when the mean is large against the spread).
template <class T>
struct ChannelStatistics {
  T mean;
  T variance;
};

template <class T>
ChannelStatistics<T> channel_statistics(const T* x, const ChannelRuns& runs, index_t c) {
  const T count = static_cast<T>(runs.count());
  T sum = 0;
  runs.for_each_run(x, c, [&](const auto& run) { sum += run.sum(); });
  const T mean = sum / count;
  T squares = 0;
  runs.for_each_run(x, c, [&](const auto& run) { squares += (run - mean).square().sum(); });
  return {mean, squares / count};
}

// y = (x - mean) · scale + beta over channel c, scale being gamma / sqrt(var + eps).
template <class T>
void normalize(const T* x, T* y, const detail::ChannelRuns& runs, index_t c, T mean, T scale, T beta) {
  using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  for (index_t n = 0; n < runs.batch; ++n) {
    const index_t at = runs.offset(n, c);
    ::Eigen::Map<Array>(y + at, runs.spatial) = (::Eigen::Map<const Array>(x + at, runs.spatial) - mean) * scale + beta;
  }
}

// BatchNormOp's kernel, for a layer of any size.
template <graph::Phase P, class T, class Layer>
void batch_norm(Layer& layer, const graph::KernelArgs& a) {
  const ChannelRuns runs(a.in_shape());
  const T* x = a.in<T>();
  T* y = a.out<T>();
  const Layer& read = layer;  // reads leave the parameters' version() alone
  if constexpr (P == graph::Phase::train) {
    layer.check_batch(a.in_shape());
    const T momentum = static_cast<T>(layer.momentum());
    const T unbiased = static_cast<T>(runs.count()) / static_cast<T>(runs.count() - 1);
    duet::detail::will_change(layer);
    T* moving_mean = layer.moving_mean.data();
    T* moving_variance = layer.moving_variance.data();
    for (index_t c = 0; c < runs.channels; ++c) {
      const auto s = channel_statistics(x, runs, c);
      normalize(x, y, runs, c, s.mean, read.gamma.data()[c] / std::sqrt(s.variance + static_cast<T>(read.eps())),
                read.beta.data()[c]);
      moving_mean[c] = momentum * moving_mean[c] + (1 - momentum) * s.mean;
      moving_variance[c] = momentum * moving_variance[c] + (1 - momentum) * s.variance * unbiased;
    }
  } else {
    for (index_t c = 0; c < runs.channels; ++c) {
      normalize(x, y, runs, c, read.moving_mean.data()[c], read.evaluation_scale(c), read.beta.data()[c]);
    }
  }
}

// BatchNormGradOp's kernel: dgamma, dbeta and, if input_grad, dx (a's output) from dy and x.
template <graph::Phase P, class T, class Layer>
void batch_norm_gradient(Layer& layer, const graph::KernelArgs& a, bool input_grad) {
  using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  const ChannelRuns runs(a.in_shape(1));
  const T* dy = a.in<T>(0);
  const T* x = a.in<T>(1);
  // gamma and beta without requires_grad (affine = false) keep no gradient.
  T* dgamma = nullptr;
  T* dbeta = nullptr;
  bool accumulate_gamma = false;
  bool accumulate_beta = false;
  if (layer.gamma.requires_grad) {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    dgamma = layer.gamma.grad_for_write(pass, &accumulate_gamma);
    dbeta = layer.beta.grad_for_write(pass, &accumulate_beta);
  }
  const Layer& read = layer;  // reads leave the parameters' version() alone
  const T count = static_cast<T>(runs.count());
  const T eps = static_cast<T>(read.eps());
  for (index_t c = 0; c < runs.channels; ++c) {
    T mean;
    T rstd;
    if constexpr (P == graph::Phase::train) {
      const auto s = channel_statistics(x, runs, c);
      mean = s.mean;
      rstd = T(1) / std::sqrt(s.variance + eps);
    } else {
      mean = read.moving_mean.data()[c];
      rstd = T(1) / std::sqrt(read.moving_variance.data()[c] + eps);
    }
    T sum_dy = 0;
    T sum_dy_x_hat = 0;
    for (index_t n = 0; n < runs.batch; ++n) {
      const index_t at = runs.offset(n, c);
      const ::Eigen::Map<const Array> g(dy + at, runs.spatial);
      const ::Eigen::Map<const Array> xs(x + at, runs.spatial);
      sum_dy += g.sum();
      sum_dy_x_hat += (g * ((xs - mean) * rstd)).sum();
    }
    if (dgamma != nullptr) {
      dgamma[c] = accumulate_gamma ? dgamma[c] + sum_dy_x_hat : sum_dy_x_hat;
      dbeta[c] = accumulate_beta ? dbeta[c] + sum_dy : sum_dy;
    }
    if (input_grad) {
      const T scale = read.gamma.data()[c] * rstd;
      for (index_t n = 0; n < runs.batch; ++n) {
        const index_t at = runs.offset(n, c);
        const ::Eigen::Map<const Array> g(dy + at, runs.spatial);
        ::Eigen::Map<Array> dx(a.out<T>() + at, runs.spatial);
        if constexpr (P == graph::Phase::train) {
          const ::Eigen::Map<const Array> xs(x + at, runs.spatial);
          dx = scale * (g - sum_dy / count - (xs - mean) * rstd * (sum_dy_x_hat / count));
        } else {
          dx = scale * g;
        }
      }
    }
  }
  duet::detail::gradient_writes_done();
}

}  // namespace detail

// (x - mean) / sqrt(var + eps) · gamma + beta per channel; in training (P = train) mean and
// var are the batch's, and the layer's moving statistics move towards them; in evaluation
// they are the moving statistics.
template <class Layer, graph::Phase P>
struct BatchNormOp : Primitive<BatchNormOp<Layer, P>>, PhaseOf<Layer, P> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  explicit BatchNormOp(Layer* l) : PhaseOf<Layer, P>(l) {}

  static constexpr ShapeResult rule(index_t channels, const Shape& x) {
    if (x.leading_unknown()) return {x};
    if (x.rank() < Layer::min_rank) return fault(x, ShapeFault::min_rank, Layer::min_rank);
    if (x.rank() > Layer::max_rank) return fault(x, ShapeFault::exact_rank, Layer::max_rank);
    if (channels != dyn && x[1] != dyn && x[1] != channels) return fault(x, ShapeFault::channel_dimension, channels);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::channels_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(this->layer->num_features(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    this->check_phase();
    detail::batch_norm<P, T>(*nn::detail::runtime_form(this->layer), a);
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return BatchNormGradOp<Layer, P, true>{this->layer};
  }
  auto parameter_grad_op() const { return BatchNormGradOp<Layer, P, false>{this->layer}; }

  // What a convolution before it folds in (ops/conv.hpp), graph mode's passes and PIJit's alike.
  ops::EvaluationNorm<value_type> evaluation_norm() const
    requires(P == graph::Phase::eval)
  {
    return ops::EvaluationNorm<value_type>::of(*this->layer);
  }

  static std::string op_name() { return P == graph::Phase::train ? "BatchNorm" : "BatchNorm (moving statistics)"; }
  std::string label() const { return this->layer->label(); }

  // ONNX: BatchNormalization in inference, from the moving statistics (export_onnx traces the
  // network at evaluation).
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (P == graph::Phase::eval) {
      using I = InterchangeInput;
      const Layer& l = *this->layer;
      return {{"BatchNormalization",
               {I::operand(0), I::of_parameter(&l.gamma), I::of_parameter(&l.beta), I::of_parameter(&l.moving_mean),
                I::of_parameter(&l.moving_variance)},
               {InterchangeAttribute::of_real("epsilon", l.eps())}}};
    } else {
      return {};
    }
  }

};

// The gradient of BatchNormOp, from dy and x. With x̂ = (x - mean) · rstd and m the channel's
// count: dbeta = Σ dy, dgamma = Σ dy · x̂; in training (mean and rstd depend on x)
// dx = gamma · rstd · (dy - Σ dy / m - x̂ · Σ (dy · x̂) / m), in evaluation dx = gamma · rstd · dy.
// The statistics are taken again, by the forward's own code, so they are its bits.
template <class Layer, graph::Phase P, bool InputGrad>
struct BatchNormGradOp : Primitive<BatchNormGradOp<Layer, P, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  Layer* layer;
  explicit BatchNormGradOp(Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::batch_norm_gradient<P, T>(*nn::detail::runtime_form(layer), a, InputGrad);
  }

  static std::string op_name() {
    std::string s = P == graph::Phase::train ? "BatchNormGrad" : "BatchNormGrad (moving statistics)";
    return InputGrad ? s : s + " (parameters only)";
  }
  std::string label() const { return layer->label(); }
};

inline const bool batchnorm_listed = list_operations({"BatchNorm"});

}  // namespace ops

namespace nn {

// MindSpore's nn.BatchNorm1d (Dims = 1: input [N, C] or [N, C, L]) and nn.BatchNorm2d (Dims = 2:
// [N, C, H, W]), with their defaults: eps 1e-5, momentum 0.9, affine. C is the number of
// channels at compile time (nn::BatchNorm2d<64>), or duet::dyn for one given to the
// constructor (nn::BatchNorm2d<>(64)).
//
// Parameters, by MindSpore's names (which checkpoints and safetensors files use: "bn.gamma",
// "bn.moving_mean", ...): gamma (ones) and beta (zeros), trained unless affine is false
// (then they keep requires_grad = false, as in MindSpore); moving_mean (zeros) and
// moving_variance (ones), never trained (requires_grad = false: optimisers skip them) and
// saved and loaded with the rest. PyTorch calls them weight, bias, running_mean, running_var.
//
// momentum is MindSpore's: moving = momentum · moving + (1 - momentum) · batch. PyTorch's
// momentum is the weight of the batch instead, moving = (1 - m) · moving + m · batch, so
// PyTorch's momentum m is MindSpore's 1 - m: PyTorch's default 0.1 is MindSpore's 0.9 (and
// MindSpore 2.9 announces a switch to PyTorch's convention). The batch variance entering the
// moving one is the unbiased one (· m / (m - 1)), as in both; the batch is normalised with the
// biased one. Training needs more than one value per channel.
//
// BatchNorm2d<C> is BatchNorm2d<> with C in its type (SizedLayer): graph capture checks the
// input's channels against it while the program compiles.
// nn::BatchNorm1d's and nn::BatchNorm2d's options, MindSpore's (and their defaults): eps,
// momentum (MindSpore's: PyTorch's momentum m is 1 - m here), affine.
struct BatchNormOptions {
  double eps = 1e-5;
  double momentum = 0.9;
  bool affine = true;
};

template <int Dims, ElementType T>
std::string batch_norm_name(index_t channels) {
  std::string s = "nn::BatchNorm" + std::to_string(Dims) + "d<";
  s += channels == dyn ? std::string("dyn") : std::to_string(channels);
  if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
  return s + ">";
}

template <int Dims, index_t C = dyn, ElementType T = float>
class BatchNorm : public Cell<BatchNorm<Dims, C, T>, CONTEXT_MODE, T>, public duet::detail::StepState {
  static_assert(Dims == 1 || Dims == 2, "nn::BatchNorm<Dims>: Dims is 1 (BatchNorm1d) or 2 (BatchNorm2d)");

 public:
  using runtime_type = BatchNorm;
  static constexpr index_t channels_static = dyn;
  static constexpr int min_rank = Dims == 1 ? 2 : 4;
  static constexpr int max_rank = Dims == 1 ? 3 : 4;

  BasicParameter<T> gamma;            // [C]
  BasicParameter<T> beta;             // [C]
  BasicParameter<T> moving_mean;      // [C], not trained
  BasicParameter<T> moving_variance;  // [C], not trained
  DUET_CELL_MEMBERS(gamma, beta, moving_mean, moving_variance);

  using Options = BatchNormOptions;

  explicit BatchNorm(index_t num_features, double eps = Options{}.eps, double momentum = Options{}.momentum,
                     bool affine = Options{}.affine)
      : BatchNorm(num_features, eps, momentum, affine, false) {}
  BatchNorm(index_t num_features, Options options)
      : BatchNorm(num_features, options.eps, options.momentum, options.affine, false) {}

 protected:
  // A BatchNorm<Dims, C>'s, named as its type.
  BatchNorm(index_t num_features, double eps, double momentum, bool affine, bool sized)
      : features_(num_features), eps_(eps), momentum_(momentum), sized_(sized) {
    if (num_features <= 0) {
      throw ValueError(type_name() + ": cannot be built with num_features " + std::to_string(num_features));
    }
    if (!(eps > 0)) throw ValueError(type_name() + ": eps must be > 0, got " + std::to_string(eps));
    if (!(momentum >= 0 && momentum <= 1)) {
      throw ValueError(type_name() + ": momentum must be in [0, 1] (MindSpore's: the weight of the moving "
                                     "statistics), got " + std::to_string(momentum));
    }
    gamma = BasicParameter<T>(ones<T>({num_features}));
    beta = BasicParameter<T>(zeros<T>({num_features}));
    moving_mean = BasicParameter<T>(zeros<T>({num_features}));
    moving_variance = BasicParameter<T>(ones<T>({num_features}));
    gamma.requires_grad = affine;
    beta.requires_grad = affine;
    moving_mean.requires_grad = false;
    moving_variance.requires_grad = false;
    affine_ = affine;
  }

 public:
  bool never_trains(const BasicParameter<T>& p) const override {
    return &p == &moving_mean || &p == &moving_variance || !affine_;
  }

  index_t num_features() const { return features_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }

  // Evaluation's map per channel, y = x · scale + shift with scale = gamma / sqrt(moving_variance
  // + eps) and shift = beta - moving_mean · scale: what a convolution before it can absorb.
  using Affine = ops::AffineMap<T>;
  Affine evaluation_affine() const {
    const auto n = static_cast<std::size_t>(num_features());
    Affine a{std::vector<T>(n), std::vector<T>(n)};
    for (std::size_t c = 0; c < n; ++c) {
      a.scale[c] = evaluation_scale(static_cast<index_t>(c));
      a.shift[c] = beta.data()[c] - moving_mean.data()[c] * a.scale[c];
    }
    return a;
  }
  T evaluation_scale(index_t c) const {
    return gamma.data()[c] / std::sqrt(moving_variance.data()[c] + static_cast<T>(eps_));
  }

  // Batch statistics need two values per channel at least (the unbiased variance divides by m - 1).
  void check_batch(const Shape& x) const {
    if (ops::detail::ChannelRuns(x).count() < 2) {
      throw ValueError(this->label() + " in training needs more than one value per channel to take batch "
                                       "statistics, got an input of shape " + to_string(x) +
                       " (set_train(false) to normalise with the moving statistics)");
    }
  }

  template <class X>
  auto construct(X&& x) {
    return ops::apply_in_phase<ops::BatchNormOp>(this, std::forward<X>(x));
  }

  // Training moves the moving statistics; a step that fails puts them back.
  void save_for_step() override {
    const auto& mean = std::as_const(moving_mean);
    const auto& variance = std::as_const(moving_variance);
    saved_mean_.assign(mean.data(), mean.data() + mean.numel());
    saved_variance_.assign(variance.data(), variance.data() + variance.numel());
  }
  void restore_step() override {
    std::ranges::copy(saved_mean_, moving_mean.data());
    std::ranges::copy(saved_variance_, moving_variance.data());
  }

  bool depends_on_phase() const override { return true; }

  std::string type_name() const override { return batch_norm_name<Dims, T>(sized_ ? features_ : dyn); }
  std::string extra_repr() const override { return sized_ ? std::string{} : std::to_string(features_); }

 private:
  index_t features_;
  double eps_;
  double momentum_;
  bool sized_;
  bool affine_ = true;
  std::vector<T> saved_mean_;
  std::vector<T> saved_variance_;
};

template <int Dims, index_t C, ElementType T>
  requires(C != dyn)
class BatchNorm<Dims, C, T> : public SizedLayer<BatchNorm<Dims, C, T>, BatchNorm<Dims, dyn, T>> {
  static_assert(C > 0, "nn::BatchNorm2d<C>: C must be positive (or duet::dyn)");
  using Sized = SizedLayer<BatchNorm, BatchNorm<Dims, dyn, T>>;

 public:
  static constexpr index_t channels_static = C;

  using Options = BatchNormOptions;

  BatchNorm() : BatchNorm(C) {}
  explicit BatchNorm(Options options) : BatchNorm(C, options.eps, options.momentum, options.affine) {}
  // nn::BatchNorm2d<16>{1e-3} would take the eps for the number of features.
  template <std::floating_point F>
  explicit BatchNorm(F) {
    static_assert(sizeof(F) == 0, "nn::BatchNorm: give eps by name, nn::BatchNorm2d<C>({.eps = 1e-3})");
  }
  explicit BatchNorm(index_t num_features, double eps = Options{}.eps, double momentum = Options{}.momentum,
                     bool affine = Options{}.affine)
      : Sized(checked(num_features), eps, momentum, affine, true) {}

  template <graph::Symbolic S>
  auto sized_construct(const S& x) {
    return ops::apply_in_phase<ops::BatchNormOp>(this, x);
  }

 private:
  static index_t checked(index_t num_features) {
    if (num_features != C) {
      throw ValueError(batch_norm_name<Dims, T>(C) + ": cannot be built with num_features " +
                       std::to_string(num_features));
    }
    return num_features;
  }
};

template <index_t C = dyn, ElementType T = float>
using BatchNorm1d = BatchNorm<1, C, T>;
template <index_t C = dyn, ElementType T = float>
using BatchNorm2d = BatchNorm<2, C, T>;

}  // namespace nn
}  // namespace duet
