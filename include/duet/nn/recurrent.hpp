// Recurrent layers: nn::GRU and the operations it captures.
//
// A recurrence is one operation over the whole sequence, not a graph unrolled step by step:
// unrolled by template recursion in construct, a GRU's training step took g++ -O1 62 s at 2
// steps and 1,176 s (7.9 GB) at 8; as one node it compiles as a Dense does, for any length,
// and the length may change from call to call in both modes.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <Eigen/Core>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../initializer.hpp"
#include "../memory.hpp"
#include "../operation.hpp"
#include "../random.hpp"

namespace duet {
namespace ops {

template <class Layer, bool InputGrad>
struct GRUGradOp;

namespace detail {

template <class T>
using RowMatrix = ::Eigen::Matrix<T, ::Eigen::Dynamic, ::Eigen::Dynamic, ::Eigen::RowMajor>;
template <class T>
using RowVector = ::Eigen::Matrix<T, 1, ::Eigen::Dynamic>;
// Time step t of every sequence of a [B, L, H] tensor: B rows, L · H apart.
template <class T>
using StepRows = ::Eigen::Map<const RowMatrix<T>, 0, ::Eigen::OuterStride<>>;

// The sizes of one call: batch, length, input and hidden size.
struct RecurrentSizes {
  index_t batch, length, input, hidden;
  index_t gates() const { return 3 * hidden; }
  index_t rows() const { return batch * length; }
};

// The gates of a GRU over a sequence, PyTorch's formulas (gates in the order r, z, n):
//   r = σ(W_ir x + b_ir + W_hr h + b_hr)      z = σ(W_iz x + b_iz + W_hz h + b_hz)
//   n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))      h' = (1 - z) ⊙ n + z ⊙ h
// with h = 0 before the first step. h_{t-1} is read from `hs` ([B, L, H]); forward writes each
// h_t there as it goes, and backward, which reads the forward's output, writes nothing but
// `saved`: per row of [B · L], r, z, n and W_hn h + b_hn, what the gradient needs.
template <class Layer, class T>
void gru_steps(const Layer& layer, const RecurrentSizes& s, const T* x, const T* hs, T* h_out, T* saved) {
  const index_t H = s.hidden, G = s.gates();
  const ::Eigen::Map<const RowMatrix<T>> w_ih(layer.weight_ih_l0.data(), G, s.input);
  const ::Eigen::Map<const RowMatrix<T>> w_hh(layer.weight_hh_l0.data(), G, H);
  const ::Eigen::Map<const RowVector<T>> b_ih(layer.bias_ih_l0.data(), G);
  const ::Eigen::Map<const RowVector<T>> b_hh(layer.bias_hh_l0.data(), G);
  duet::detail::Storage input_gates_storage, hidden_gates_storage;
  T* input_gates = duet::detail::scratch<T>(input_gates_storage, static_cast<std::size_t>(s.rows() * G));
  T* hidden_gates = duet::detail::scratch<T>(hidden_gates_storage, static_cast<std::size_t>(s.batch * G));
  // Every step's input gates in one product: the part of the work that does not wait for h.
  ::Eigen::Map<RowMatrix<T>> xg(input_gates, s.rows(), G);
  xg.noalias() = ::Eigen::Map<const RowMatrix<T>>(x, s.rows(), s.input) * w_ih.transpose();
  xg.rowwise() += b_ih;
  ::Eigen::Map<RowMatrix<T>> hg(hidden_gates, s.batch, G);
  for (index_t t = 0; t < s.length; ++t) {
    if (t == 0) {
      hg.rowwise() = b_hh;
    } else {
      hg.noalias() = StepRows<T>(hs + (t - 1) * H, s.batch, H, ::Eigen::OuterStride<>(s.length * H)) * w_hh.transpose();
      hg.rowwise() += b_hh;
    }
    for (index_t b = 0; b < s.batch; ++b) {
      const index_t row = b * s.length + t;
      const T* xr = input_gates + row * G;
      const T* hr = hidden_gates + b * G;
      const T* h_prev = t == 0 ? nullptr : hs + (row - 1) * H;
      for (index_t j = 0; j < H; ++j) {
        const T r = T(1) / (T(1) + std::exp(-(xr[j] + hr[j])));
        const T z = T(1) / (T(1) + std::exp(-(xr[H + j] + hr[H + j])));
        const T n = std::tanh(xr[2 * H + j] + r * hr[2 * H + j]);
        const T h = h_prev == nullptr ? T(0) : h_prev[j];
        if (h_out != nullptr) h_out[row * H + j] = (T(1) - z) * n + z * h;
        if (saved != nullptr) {
          T* g = saved + row * 4 * H;
          g[j] = r;
          g[H + j] = z;
          g[2 * H + j] = n;
          g[3 * H + j] = hr[2 * H + j];
        }
      }
    }
  }
}

// A parameter's gradient in this backward pass, zeroed unless an earlier operation of the pass
// wrote it (a layer called twice).
template <class T, class P>
T* recurrent_parameter_grad(const P& p, std::uint64_t pass) {
  bool accumulate = false;
  T* g = p.grad_for_write(pass, &accumulate);
  if (!accumulate) std::fill_n(g, p.numel(), T(0));
  return g;
}

}  // namespace detail

// nn::GRU's operation: [B, L, input] in, every step's hidden state [B, L, hidden] out.
template <class Layer>
struct GRUOp : Primitive<GRUOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool has_parameters = true;

  const Layer* layer;
  GRUOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult rule(index_t input, index_t hidden, const Shape& x) {
    if (x.leading_unknown() && x.rank() < 3) return {Shape{dyn, dyn, hidden}};
    if (x.rank() != 3) return fault(Shape{dyn, dyn, hidden}, ShapeFault::exact_rank, 3);
    if (input != dyn && x[2] != dyn && x[2] != input) return fault(Shape{x[0], x[1], hidden}, ShapeFault::last_dimension, input);
    return {Shape{x[0], x[1], hidden}};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return rule(Layer::input_static, Layer::hidden_static, in[0]);
  }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->input_size(), layer->hidden_size(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const Shape& x = a.in_shape();
    const detail::RecurrentSizes s{x[0], x[1], x[2], layer->hidden_size()};
    detail::gru_steps(*layer, s, a.in<T>(), a.out<T>(), a.out<T>(), static_cast<T*>(nullptr));
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return GRUGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return GRUGradOp<Layer, false>{layer}; }

  static std::string op_name() { return "GRU"; }
  std::string label() const { return layer->label(); }
};

// Backpropagation through time. The gates are taken again from x and the forward's output (a
// pass as costly as the forward, which saves keeping them between forward and backward); then
// from the last step to the first, with dh the gradient reaching h_t (dy_t and what h_{t+1}
// sends back):
//   dn = dh (1 - z)   dz = dh (h_{t-1} - n)   dn' = dn (1 - n²)   dz' = dz z (1 - z)
//   dr' = dn' (W_hn h + b_hn) r (1 - r)
// the input gates' gradient is [dr', dz', dn'], the hidden gates' [dr', dz', dn' r], and
//   dh_{t-1} = dh z + [dr', dz', dn' r] W_hh;  dW_hh += [..]ᵀ h_{t-1};  db_hh += [..]
// and, once for all steps, dW_ih = [dr', dz', dn']ᵀ x, db_ih its sum, dx = [dr', dz', dn'] W_ih.
template <class Layer, bool InputGrad>
struct GRUGradOp : Primitive<GRUGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
  static constexpr int arity = 3;  // dy, x, y
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  GRUGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using detail::RowMatrix;
    using detail::RowVector;
    const Shape& xs = a.in_shape(1);
    const detail::RecurrentSizes s{xs[0], xs[1], xs[2], layer->hidden_size()};
    const index_t H = s.hidden, G = s.gates();
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    duet::detail::Storage saved_storage, dxg_storage, dhg_storage, dh_storage;
    T* saved = duet::detail::scratch<T>(saved_storage, static_cast<std::size_t>(s.rows() * 4 * H));
    detail::gru_steps(*layer, s, x, y, static_cast<T*>(nullptr), saved);

    const std::uint64_t pass = duet::detail::current_backward_pass();
    ::Eigen::Map<RowMatrix<T>> dw_ih(detail::recurrent_parameter_grad<T>(layer->weight_ih_l0, pass), G, s.input);
    ::Eigen::Map<RowMatrix<T>> dw_hh(detail::recurrent_parameter_grad<T>(layer->weight_hh_l0, pass), G, H);
    ::Eigen::Map<RowVector<T>> db_ih(detail::recurrent_parameter_grad<T>(layer->bias_ih_l0, pass), G);
    ::Eigen::Map<RowVector<T>> db_hh(detail::recurrent_parameter_grad<T>(layer->bias_hh_l0, pass), G);
    const ::Eigen::Map<const RowMatrix<T>> w_hh(layer->weight_hh_l0.data(), G, H);

    T* dxg = duet::detail::scratch<T>(dxg_storage, static_cast<std::size_t>(s.rows() * G));
    T* dhg = duet::detail::scratch<T>(dhg_storage, static_cast<std::size_t>(s.batch * G));
    T* dh_next = duet::detail::scratch<T>(dh_storage, static_cast<std::size_t>(s.batch * H));
    ::Eigen::Map<RowMatrix<T>> dhg_rows(dhg, s.batch, G);
    ::Eigen::Map<RowMatrix<T>> dh_rows(dh_next, s.batch, H);
    dh_rows.setZero();
    for (index_t t = s.length - 1; t >= 0; --t) {
      for (index_t b = 0; b < s.batch; ++b) {
        const index_t row = b * s.length + t;
        const T* g = saved + row * 4 * H;
        const T* h_prev = t == 0 ? nullptr : y + (row - 1) * H;
        T* dx_gates = dxg + row * G;
        T* dh_gates = dhg + b * G;
        T* carry = dh_next + b * H;
        for (index_t j = 0; j < H; ++j) {
          const T r = g[j], z = g[H + j], n = g[2 * H + j], hn = g[3 * H + j];
          const T dh = dy[row * H + j] + carry[j];
          const T h = h_prev == nullptr ? T(0) : h_prev[j];
          const T dn = dh * (T(1) - z) * (T(1) - n * n);
          const T dz = dh * (h - n) * z * (T(1) - z);
          const T dr = dn * hn * r * (T(1) - r);
          dx_gates[j] = dr;
          dx_gates[H + j] = dz;
          dx_gates[2 * H + j] = dn;
          dh_gates[j] = dr;
          dh_gates[H + j] = dz;
          dh_gates[2 * H + j] = dn * r;
          carry[j] = dh * z;
        }
      }
      dh_rows.noalias() += dhg_rows * w_hh;
      db_hh += dhg_rows.colwise().sum();
      if (t > 0) {
        dw_hh.noalias() +=
            dhg_rows.transpose() * detail::StepRows<T>(y + (t - 1) * H, s.batch, H, ::Eigen::OuterStride<>(s.length * H));
      }
    }
    const ::Eigen::Map<const RowMatrix<T>> dxg_rows(dxg, s.rows(), G);
    const ::Eigen::Map<const RowMatrix<T>> x_rows(x, s.rows(), s.input);
    dw_ih.noalias() += dxg_rows.transpose() * x_rows;
    db_ih += dxg_rows.colwise().sum();
    if constexpr (InputGrad) {
      ::Eigen::Map<RowMatrix<T>>(a.out<T>(), s.rows(), s.input).noalias() =
          dxg_rows * ::Eigen::Map<const RowMatrix<T>>(layer->weight_ih_l0.data(), G, s.input);
    }
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() { return InputGrad ? "GRUGrad" : "GRUGrad (parameters only)"; }
  std::string label() const { return layer->label(); }
};

inline const bool recurrent_listed = list_operations({"GRU"});

}  // namespace ops

namespace nn {

// A one-layer GRU over batch-first sequences (PyTorch's nn.GRU(input_size, hidden_size,
// batch_first=True), MindSpore's nn.GRU with batch_first=True): x [B, L, input] in, the
// hidden state after every step [B, L, hidden] out (PyTorch's `output`; its h_n is the last
// step, ops::strided_slice from -1 on axis 1), starting from h = 0. Parameters under PyTorch's names and
// layout, so that a torch state dict loads as it is: weight_ih_l0 [3 · hidden, input],
// weight_hh_l0 [3 · hidden, hidden], bias_ih_l0 and bias_hh_l0 [3 · hidden], the gates in the
// order r, z, n; all drawn from U(-1/sqrt(hidden), 1/sqrt(hidden)), as both libraries do.
// Input and Hidden are compile-time sizes (nn::GRU<16, 32>), or duet::dyn for sizes given to
// the constructor. The whole sequence is one operation: compile time does not grow with the
// length, which may differ from call to call. Sequence-major data ([L, B, input], both
// libraries' default) goes through ops::transpose first.
template <index_t Input = dyn, index_t Hidden = dyn, ElementType T = float>
class GRU : public Cell<GRU<Input, Hidden, T>, CONTEXT_MODE, T> {
  static_assert(Input == dyn || Input > 0, "nn::GRU<Input, Hidden>: Input must be positive (or duet::dyn)");
  static_assert(Hidden == dyn || Hidden > 0, "nn::GRU<Input, Hidden>: Hidden must be positive (or duet::dyn)");

 public:
  static constexpr index_t input_static = Input;
  static constexpr index_t hidden_static = Hidden;

  BasicParameter<T> weight_ih_l0;  // [3 * hidden, input]
  BasicParameter<T> weight_hh_l0;  // [3 * hidden, hidden]
  BasicParameter<T> bias_ih_l0;    // [3 * hidden]
  BasicParameter<T> bias_hh_l0;    // [3 * hidden]
  DUET_CELL_MEMBERS(weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0);

  GRU() requires(Input != dyn && Hidden != dyn) : GRU(Input, Hidden) {}

  GRU(index_t input_size, index_t hidden_size) : input_(input_size), hidden_(hidden_size) {
    if ((Input != dyn && input_size != Input) || (Hidden != dyn && hidden_size != Hidden) || input_size <= 0 ||
        hidden_size <= 0) {
      throw ValueError(type_name() + ": cannot be built with input_size " + std::to_string(input_size) +
                       " and hidden_size " + std::to_string(hidden_size));
    }
    const initializer::Uniform init{static_cast<double>(T(1) / std::sqrt(static_cast<T>(hidden_size)))};
    const index_t gates = 3 * hidden_size;
    for (auto [p, shape] : {std::pair{&weight_ih_l0, Shape{gates, input_size}}, std::pair{&weight_hh_l0, Shape{gates, hidden_size}},
                            std::pair{&bias_ih_l0, Shape{gates}}, std::pair{&bias_hh_l0, Shape{gates}}}) {
      auto value = BasicTensor<T>::uninitialized(shape);
      with_global_generator([&](Generator& gen) { init.fill(value, gen); });
      *p = BasicParameter<T>(std::move(value));
    }
  }

  index_t input_size() const {
    if constexpr (Input != dyn)
      return Input;
    else
      return input_;
  }
  index_t hidden_size() const {
    if constexpr (Hidden != dyn)
      return Hidden;
    else
      return hidden_;
  }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::GRUOp<GRU>{this}, std::forward<X>(x));
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = "nn::GRU<" + size(Input) + ", " + size(Hidden);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  index_t input_;
  index_t hidden_;
};

}  // namespace nn
}  // namespace duet
