// Normalisation layers: nn::LayerNorm and the operation it captures.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../operation.hpp"

namespace duet {
namespace ops {

template <class Layer, bool InputGrad>
struct LayerNormGradOp;

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

}  // namespace detail

// (x - mean) / sqrt(var + eps) · gamma + beta over the last axis of x, gamma and beta being
// the layer's.
template <class Layer>
struct LayerNormOp : Primitive<LayerNormOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  LayerNormOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult rule(index_t n, const Shape& x) {
    if (x.rank() == 0) return x.leading_unknown() ? ShapeResult{x} : fault(x, ShapeFault::min_rank, 1);
    if (n != dyn && x.back() != dyn && x.back() != n) return fault(x, ShapeFault::last_dimension, n);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::normalized_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->normalized_size(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
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

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return LayerNormGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return LayerNormGradOp<Layer, false>{layer}; }

  static std::string op_name() { return "LayerNorm"; }
  std::string label() const { return layer->label(); }
};

// The gradient of LayerNormOp, from dy and x (the statistics are taken again, which costs a
// pass over x and saves keeping them between forward and backward). With x̂ the normalised
// row and h = dy · gamma: dx = rstd · (h - mean(h) - x̂ · mean(h · x̂)); dgamma = Σ_rows dy · x̂;
// dbeta = Σ_rows dy.
template <class Layer, bool InputGrad>
struct LayerNormGradOp : Primitive<LayerNormGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  LayerNormGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const std::uint64_t pass = duet::detail::current_backward_pass();
    bool accumulate_gamma = false;
    bool accumulate_beta = false;
    const index_t n = layer->normalized_size();
    ::Eigen::Map<Array> dgamma(layer->gamma.grad_for_write(pass, &accumulate_gamma), n);
    ::Eigen::Map<Array> dbeta(layer->beta.grad_for_write(pass, &accumulate_beta), n);
    if (!accumulate_gamma) dgamma.setZero();
    if (!accumulate_beta) dbeta.setZero();
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
  std::string label() const { return layer->label(); }
};

inline const bool normalization_listed = list_operations({"LayerNorm"});

}  // namespace ops

namespace nn {

// MindSpore's nn.LayerNorm(normalized_shape, begin_norm_axis=-1, begin_params_axis=-1,
// epsilon=1e-7) with its default axes: each row of the last axis is normalised to mean 0 and
// variance 1, then scaled by gamma and shifted by beta (ones and zeros at first), both of
// that axis's size. N is the size at compile time (nn::LayerNorm<512>), or duet::dyn for one
// given to the constructor. epsilon defaults to MindSpore's 1e-7; PyTorch's nn.LayerNorm uses
// 1e-5, so give that to match a PyTorch model: nn::LayerNorm<512>(512, 1e-5).
template <index_t N = dyn, ElementType T = float>
class LayerNorm : public Cell<LayerNorm<N, T>, CONTEXT_MODE, T> {
  static_assert(N == dyn || N > 0, "nn::LayerNorm<N>: N must be positive (or duet::dyn)");

 public:
  static constexpr index_t normalized_static = N;

  BasicParameter<T> gamma;  // [normalized_shape]
  BasicParameter<T> beta;   // [normalized_shape]
  DUET_CELL_MEMBERS(gamma, beta);

  LayerNorm() requires(N != dyn) : LayerNorm(N) {}

  explicit LayerNorm(index_t normalized_shape, double epsilon = 1e-7) : n_(normalized_shape), epsilon_(epsilon) {
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

 private:
  index_t n_;
  double epsilon_;
};

}  // namespace nn
}  // namespace duet
