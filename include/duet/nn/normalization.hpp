// Normalisation layers: nn::LayerNorm, nn::GroupNorm and the operations they capture.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../operation.hpp"

namespace duet {
namespace ops {

template <class Layer, bool InputGrad>
struct LayerNormGradOp;
template <class Layer, bool InputGrad>
struct GroupNormGradOp;

namespace detail {

// The statistics of one row of a layer norm: its mean and 1 / sqrt(variance + eps). The
// variance is taken around the mean in a second pass, which loses no digits when the mean is
// large against the spread (E[x²] - E[x]² would).
template <class T>
struct RowStatistics {
  T mean;
  T rstd;
};

template <class T, class Row>
RowStatistics<T> row_statistics(const Row& x, double epsilon) {
  const T mean = x.mean();
  const T variance = (x - mean).square().mean();
  return {mean, T(1) / std::sqrt(variance + static_cast<T>(epsilon))};
}

// An [N, C, *] input as N · groups contiguous blocks of channels_per_group planes.
struct GroupLayout {
  index_t groups, channels_per_group, spatial, block, blocks;
  GroupLayout(const Shape& x, index_t num_groups)
      : groups(num_groups),
        channels_per_group(x[1] / num_groups),
        spatial(x.numel_from(2)),
        block(channels_per_group * spatial),
        blocks(x[0] * num_groups) {}
};

}  // namespace detail

// What the normalisation operations share: the layer whose gamma and beta they read, and their
// gradient operations, GradOp<Layer, true> making dx and the parameters' gradients,
// GradOp<Layer, false> the parameters' alone.
template <class Self, class Layer, template <class, bool> class GradOp>
struct AffineNormOp : Primitive<Self> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool has_parameters = true;

  const Layer* layer;
  AffineNormOp(const Layer* l) : layer(l) {}

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return GradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return GradOp<Layer, false>{layer}; }
  std::string label() const { return layer->label(); }
};

// Their gradient operations read dy and x (the statistics are taken again, which costs a pass
// over x and saves keeping them between forward and backward).
template <class Self, class Layer, bool InputGrad>
struct AffineNormGradOp : Primitive<Self> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  AffineNormGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }
  std::string label() const { return layer->label(); }

 protected:
  // gamma's and beta's gradients in this backward pass, zeroed unless an earlier operation of
  // the pass wrote them (a layer used twice).
  template <class T>
  std::array<T*, 2> parameter_grads() const {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    return {layer->gamma.grad_for_add(pass), layer->beta.grad_for_add(pass)};
  }
};

// (x - mean) / sqrt(var + eps) · gamma + beta over the last axis of x, gamma and beta being
// the layer's.
template <class Layer>
struct LayerNormOp : AffineNormOp<LayerNormOp<Layer>, Layer, LayerNormGradOp> {
  using AffineNormOp<LayerNormOp<Layer>, Layer, LayerNormGradOp>::AffineNormOp;

  static constexpr ShapeResult rule(index_t n, const Shape& x) {
    if (x.rank() == 0) return x.leading_unknown() ? ShapeResult{x} : fault(x, ShapeFault::min_rank, 1);
    if (n != dyn && x.back() != dyn && x.back() != n) return fault(x, ShapeFault::last_dimension, n);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::normalized_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(this->layer->normalized_size(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const index_t n = layer->normalized_size();
    const index_t rows = a.in_shape().numel() / n;
    const ::Eigen::Map<const Array> gamma(layer->gamma.data(), n);
    const ::Eigen::Map<const Array> beta(layer->beta.data(), n);
    for (index_t i = 0; i < rows; ++i) {
      const ::Eigen::Map<const Array> x(a.in<T>() + i * n, n);
      const auto s = detail::row_statistics<T>(x, layer->epsilon());
      ::Eigen::Map<Array>(a.out<T>() + i * n, n) = (x - s.mean) * s.rstd * gamma + beta;
    }
  }

  static std::string op_name() { return "LayerNorm"; }

  // ONNX: LayerNormalization (opset 17) over the last axis.
  Interchange interchange(std::span<const Shape>) const {
    using I = InterchangeInput;
    return {{"LayerNormalization",
             {I::operand(0), I::of_parameter(&this->layer->gamma), I::of_parameter(&this->layer->beta)},
             {InterchangeAttribute::of("axis", -1), InterchangeAttribute::of_real("epsilon", this->layer->epsilon())}}};
  }
};

// The gradient of LayerNormOp. With x̂ the normalised row and h = dy · gamma: dx = rstd · (h -
// mean(h) - x̂ · mean(h · x̂)); dgamma = Σ_rows dy · x̂; dbeta = Σ_rows dy.
template <class Layer, bool InputGrad>
struct LayerNormGradOp : AffineNormGradOp<LayerNormGradOp<Layer, InputGrad>, Layer, InputGrad> {
  using AffineNormGradOp<LayerNormGradOp<Layer, InputGrad>, Layer, InputGrad>::AffineNormGradOp;

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const index_t n = layer->normalized_size();
    const auto [gamma_grad, beta_grad] = this->template parameter_grads<T>();
    ::Eigen::Map<Array> dgamma(gamma_grad, n);
    ::Eigen::Map<Array> dbeta(beta_grad, n);
    const ::Eigen::Map<const Array> gamma(layer->gamma.data(), n);
    const index_t rows = a.in_shape(1).numel() / n;
    for (index_t i = 0; i < rows; ++i) {
      const ::Eigen::Map<const Array> dy(a.in<T>(0) + i * n, n);
      const ::Eigen::Map<const Array> x(a.in<T>(1) + i * n, n);
      const auto s = detail::row_statistics<T>(x, layer->epsilon());
      const auto x_hat = (x - s.mean) * s.rstd;  // an expression: no array per row
      dgamma += dy * x_hat;
      dbeta += dy;
      if constexpr (InputGrad) {
        const auto h = dy * gamma;
        const T mean_h = h.mean();
        const T mean_h_x_hat = (h * x_hat).mean();
        ::Eigen::Map<Array>(a.out<T>() + i * n, n) = s.rstd * (h - mean_h - x_hat * mean_h_x_hat);
      }
    }
  }

  static std::string op_name() { return InputGrad ? "LayerNormGrad" : "LayerNormGrad (parameters only)"; }
};

// (x - mean) / sqrt(var + eps) · gamma[c] + beta[c], the statistics taken over each group of
// channels of each sample (with every spatial position of those channels), gamma and beta per
// channel. In NCHW a group is one contiguous block: its statistics are a layer norm's over a
// row of that block's size.
template <class Layer>
struct GroupNormOp : AffineNormOp<GroupNormOp<Layer>, Layer, GroupNormGradOp> {
  using AffineNormOp<GroupNormOp<Layer>, Layer, GroupNormGradOp>::AffineNormOp;

  // [N, C, *] with C the layer's channels.
  static constexpr ShapeResult rule(index_t channels, const Shape& x) {
    if (x.leading_unknown()) return {x};
    if (x.rank() < 2) return fault(x, ShapeFault::min_rank, 2);
    if (channels != dyn && x[1] != dyn && x[1] != channels) return fault(x, ShapeFault::channel_dimension, channels);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::channels_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(this->layer->num_channels(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const detail::GroupLayout g(a.in_shape(), layer->num_groups());
    const T* gamma = layer->gamma.data();
    const T* beta = layer->beta.data();
    for (index_t b = 0; b < g.blocks; ++b) {
      const index_t at = b * g.block;
      const auto s = detail::row_statistics<T>(::Eigen::Map<const Array>(a.in<T>() + at, g.block), layer->epsilon());
      for (index_t k = 0; k < g.channels_per_group; ++k) {
        const index_t c = (b % g.groups) * g.channels_per_group + k;
        const index_t plane = at + k * g.spatial;
        ::Eigen::Map<Array>(a.out<T>() + plane, g.spatial) =
            (::Eigen::Map<const Array>(a.in<T>() + plane, g.spatial) - s.mean) * s.rstd * gamma[c] + beta[c];
      }
    }
  }

  static std::string op_name() { return "GroupNorm"; }
};

// The gradient of GroupNormOp. Per group, with x̂ the normalised block and h = dy · gamma[c]:
// dx = rstd · (h - mean(h) - x̂ · mean(h · x̂)); dgamma[c] = Σ dy · x̂ and dbeta[c] = Σ dy over
// the samples and positions of channel c. mean(h) and mean(h · x̂) come from the per-channel
// sums dbeta and dgamma take.
template <class Layer, bool InputGrad>
struct GroupNormGradOp : AffineNormGradOp<GroupNormGradOp<Layer, InputGrad>, Layer, InputGrad> {
  using AffineNormGradOp<GroupNormGradOp<Layer, InputGrad>, Layer, InputGrad>::AffineNormGradOp;

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const auto [dgamma, dbeta] = this->template parameter_grads<T>();
    const T* gamma = layer->gamma.data();
    const detail::GroupLayout g(a.in_shape(1), layer->num_groups());
    for (index_t b = 0; b < g.blocks; ++b) {
      const index_t at = b * g.block;
      const auto s = detail::row_statistics<T>(::Eigen::Map<const Array>(a.in<T>(1) + at, g.block), layer->epsilon());
      T sum_h{0};
      T sum_h_x_hat{0};
      for (index_t k = 0; k < g.channels_per_group; ++k) {
        const index_t c = (b % g.groups) * g.channels_per_group + k;
        const index_t plane = at + k * g.spatial;
        const ::Eigen::Map<const Array> dy(a.in<T>(0) + plane, g.spatial);
        const auto x_hat = (::Eigen::Map<const Array>(a.in<T>(1) + plane, g.spatial) - s.mean) * s.rstd;
        const T dy_sum = dy.sum();
        const T dy_x_hat = (dy * x_hat).sum();
        dgamma[c] += dy_x_hat;
        dbeta[c] += dy_sum;
        sum_h += gamma[c] * dy_sum;
        sum_h_x_hat += gamma[c] * dy_x_hat;
      }
      if constexpr (InputGrad) {
        const T mean_h = sum_h / static_cast<T>(g.block);
        const T mean_h_x_hat = sum_h_x_hat / static_cast<T>(g.block);
        for (index_t k = 0; k < g.channels_per_group; ++k) {
          const index_t c = (b % g.groups) * g.channels_per_group + k;
          const index_t plane = at + k * g.spatial;
          const ::Eigen::Map<const Array> dy(a.in<T>(0) + plane, g.spatial);
          const auto x_hat = (::Eigen::Map<const Array>(a.in<T>(1) + plane, g.spatial) - s.mean) * s.rstd;
          ::Eigen::Map<Array>(a.out<T>() + plane, g.spatial) = s.rstd * (dy * gamma[c] - mean_h - x_hat * mean_h_x_hat);
        }
      }
    }
  }

  static std::string op_name() { return InputGrad ? "GroupNormGrad" : "GroupNormGrad (parameters only)"; }
};

inline const bool normalization_listed = list_operations({"LayerNorm", "GroupNorm"});

}  // namespace ops

namespace nn {

// nn::LayerNorm's options: MindSpore's epsilon, 1e-7 unless given. PyTorch's nn.LayerNorm
// uses 1e-5: nn::LayerNorm<512>({.epsilon = 1e-5}) matches a PyTorch model.
struct LayerNormOptions {
  double epsilon = 1e-7;
};

// MindSpore's nn.LayerNorm(normalized_shape, begin_norm_axis=-1, begin_params_axis=-1,
// epsilon=1e-7) with its default axes: each row of the last axis is normalised to mean 0 and
// variance 1, then scaled by gamma and shifted by beta (ones and zeros at first), both of
// that axis's size. N is the size at compile time (nn::LayerNorm<512>), or duet::dyn for one
// given to the constructor (nn::LayerNorm<>(512, {.epsilon = 1e-5}), or (512, 1e-5)).
template <index_t N = dyn, ElementType T = float>
class LayerNorm : public Cell<LayerNorm<N, T>, CONTEXT_MODE, T> {
  static_assert(N == dyn || N > 0, "nn::LayerNorm<N>: N must be positive (or duet::dyn)");

 public:
  static constexpr index_t normalized_static = N;

  BasicParameter<T> gamma;  // [normalized_shape]
  BasicParameter<T> beta;   // [normalized_shape]
  DUET_CELL_MEMBERS(gamma, beta);

  using Options = LayerNormOptions;

  LayerNorm() requires(N != dyn) : LayerNorm(N) {}
  explicit LayerNorm(Options options) requires(N != dyn) : LayerNorm(N, options) {}
  // nn::LayerNorm<16>{1e-5} would take the epsilon for the size.
  template <std::floating_point F>
  explicit LayerNorm(F) {
    static_assert(sizeof(F) == 0, "nn::LayerNorm: give epsilon by name, nn::LayerNorm<N>({.epsilon = 1e-5})");
  }
  LayerNorm(index_t normalized_shape, Options options) : LayerNorm(normalized_shape, options.epsilon) {}

  explicit LayerNorm(index_t normalized_shape, double epsilon = Options{}.epsilon)
      : n_(normalized_shape), epsilon_(epsilon) {
    if ((N != dyn && normalized_shape != N) || normalized_shape <= 0) {
      throw ValueError(type_name() + ": cannot be built with normalized_shape " + std::to_string(normalized_shape));
    }
    if (!(epsilon > 0)) throw ValueError(type_name() + ": epsilon must be > 0, got " + std::to_string(epsilon));
    gamma = BasicParameter<T>(ones<T>({normalized_shape}));
    beta = BasicParameter<T>(zeros<T>({normalized_shape}));
  }

  index_t normalized_size() const {
    if constexpr (N != dyn)
      return N;
    else
      return n_;
  }
  double epsilon() const { return epsilon_; }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::LayerNormOp<LayerNorm>{this}, std::forward<X>(x));
  }

  std::string type_name() const override {
    std::string s = "nn::LayerNorm<" + (N == dyn ? std::string("dyn") : std::to_string(N));
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }
  std::string extra_repr() const override {
    if constexpr (N != dyn)
      return {};
    else
      return std::to_string(n_);
  }

 private:
  index_t n_;
  double epsilon_;
};

// nn::GroupNorm's options: MindSpore's eps, 1e-5 unless given (PyTorch's too).
struct GroupNormOptions {
  double eps = 1e-5;
};

// MindSpore's nn.GroupNorm(num_groups, num_channels, eps=1e-5, affine=True) on [N, C, *]
// inputs: the channels are split into num_groups groups of consecutive channels, each group of
// each sample normalised to mean 0 and variance 1 over its channels and positions, then each
// channel scaled by gamma and shifted by beta (ones and zeros at first; the checkpoint names
// are MindSpore's, gamma and beta; PyTorch calls them weight and bias). Groups and Channels
// are compile-time sizes (nn::GroupNorm<2, 8>), or duet::dyn for sizes given to the
// constructor. Always affine.
template <index_t Groups = dyn, index_t Channels = dyn, ElementType T = float>
class GroupNorm : public Cell<GroupNorm<Groups, Channels, T>, CONTEXT_MODE, T> {
  static_assert(Groups == dyn || Groups > 0, "nn::GroupNorm<Groups, Channels>: Groups must be positive (or duet::dyn)");
  static_assert(Channels == dyn || Channels > 0,
                "nn::GroupNorm<Groups, Channels>: Channels must be positive (or duet::dyn)");
  static_assert(Groups == dyn || Channels == dyn || Channels % Groups == 0,
                "nn::GroupNorm<Groups, Channels>: Channels must be a multiple of Groups");

 public:
  static constexpr index_t channels_static = Channels;

  BasicParameter<T> gamma;  // [num_channels]
  BasicParameter<T> beta;   // [num_channels]
  DUET_CELL_MEMBERS(gamma, beta);

  using Options = GroupNormOptions;

  GroupNorm() requires(Groups != dyn && Channels != dyn) : GroupNorm(Groups, Channels) {}
  explicit GroupNorm(Options options) requires(Groups != dyn && Channels != dyn)
      : GroupNorm(Groups, Channels, options) {}
  template <std::floating_point F>
  explicit GroupNorm(F) {
    static_assert(sizeof(F) == 0, "nn::GroupNorm: give eps by name, nn::GroupNorm<G, C>({.eps = 1e-5})");
  }
  GroupNorm(index_t num_groups, index_t num_channels, Options options)
      : GroupNorm(num_groups, num_channels, options.eps) {}

  GroupNorm(index_t num_groups, index_t num_channels, double eps = Options{}.eps)
      : groups_(num_groups), channels_(num_channels), epsilon_(eps) {
    if ((Groups != dyn && num_groups != Groups) || (Channels != dyn && num_channels != Channels) || num_groups <= 0 ||
        num_channels <= 0 || num_channels % num_groups != 0) {
      throw ValueError(type_name() + ": cannot be built with num_groups " + std::to_string(num_groups) +
                       " and num_channels " + std::to_string(num_channels) +
                       " (num_channels must be a positive multiple of num_groups)");
    }
    if (!(eps > 0)) throw ValueError(type_name() + ": eps must be > 0, got " + std::to_string(eps));
    gamma = BasicParameter<T>(ones<T>({num_channels}));
    beta = BasicParameter<T>(zeros<T>({num_channels}));
  }

  index_t num_groups() const {
    if constexpr (Groups != dyn)
      return Groups;
    else
      return groups_;
  }
  index_t num_channels() const {
    if constexpr (Channels != dyn)
      return Channels;
    else
      return channels_;
  }
  double epsilon() const { return epsilon_; }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::GroupNormOp<GroupNorm>{this}, std::forward<X>(x));
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = "nn::GroupNorm<" + size(Groups) + ", " + size(Channels);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }
  std::string extra_repr() const override {
    if constexpr (Groups != dyn && Channels != dyn)
      return {};
    else
      return std::to_string(groups_) + ", " + std::to_string(channels_);
  }

 private:
  index_t groups_;
  index_t channels_;
  double epsilon_;
};

}  // namespace nn
}  // namespace duet
