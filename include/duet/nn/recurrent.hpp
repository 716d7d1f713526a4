// Recurrent layers: nn::GRU, nn::LSTM and the operations they capture.
//
// A recurrence is one operation over the whole sequence, not a graph unrolled step by step:
// unrolled by template recursion in construct, a GRU's training step took g++ -O1 62 s at 2
// steps and 1,176 s (7.9 GB) at 8; as one node it compiles as a Dense does, for any length,
// and the length may change from call to call in both modes.
//
// The two layers share everything but their cell: RecurrentOp and RecurrentGradOp run the
// products (every step's input gates in one, then one per step on h) and the loops over time,
// and a cell (GRUCell, LSTMCell) says what one element of one step does, forward and backward.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

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
struct RecurrentGradOp;

namespace detail {

template <class T>
using RowMatrix = ::Eigen::Matrix<T, ::Eigen::Dynamic, ::Eigen::Dynamic, ::Eigen::RowMajor>;
template <class T>
using RowVector = ::Eigen::Matrix<T, 1, ::Eigen::Dynamic>;
// Time step t of every sequence of a [B, L, N] tensor: B rows of N, L · N apart.
template <class T>
using StepRows = ::Eigen::Map<const RowMatrix<T>, 0, ::Eigen::OuterStride<>>;

template <class T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// One element j of one step of a GRU, PyTorch's formulas (gates in the order r, z, n):
//   r = σ(W_ir x + b_ir + W_hr h + b_hr)      z = σ(W_iz x + b_iz + W_hz h + b_hz)
//   n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))      h' = (1 - z) ⊙ n + z ⊙ h
// `xg` and `hg` are the step's input and hidden gate rows (W x + b, W h + b). What backward
// keeps of the step, per element: r, z, n and W_hn h + b_hn.
struct GRUCell {
  static constexpr index_t gates = 3;
  static constexpr index_t saved = 4;
  static constexpr bool has_cell_state = false;
  static constexpr const char* name = "GRU";

  template <class T>
  static T forward(const T* xg, const T* hg, index_t H, index_t j, T h, T* /*c*/, T* keep) {
    const T r = sigmoid(xg[j] + hg[j]);
    const T z = sigmoid(xg[H + j] + hg[H + j]);
    const T n = std::tanh(xg[2 * H + j] + r * hg[2 * H + j]);
    if (keep != nullptr) {
      keep[j] = r;
      keep[H + j] = z;
      keep[2 * H + j] = n;
      keep[3 * H + j] = hg[2 * H + j];
    }
    return (T(1) - z) * n + z * h;
  }

  // With dh the gradient reaching h_t:
  //   dn' = dh (1 - z)(1 - n²)   dz' = dh (h_{t-1} - n) z (1 - z)   dr' = dn' (W_hn h + b_hn) r (1 - r)
  // the input gates' gradient is [dr', dz', dn'], the hidden gates' [dr', dz', dn' r]; h_{t-1}
  // gets dh z besides what the hidden gates send back through W_hh.
  template <class T>
  static T backward(const T* keep, const T* /*keep_before*/, index_t H, index_t j, T dh, T h, T* /*dc*/, T* dxg, T* dhg) {
    const T r = keep[j], z = keep[H + j], n = keep[2 * H + j], hn = keep[3 * H + j];
    const T dn = dh * (T(1) - z) * (T(1) - n * n);
    const T dz = dh * (h - n) * z * (T(1) - z);
    const T dr = dn * hn * r * (T(1) - r);
    dxg[j] = dhg[j] = dr;
    dxg[H + j] = dhg[H + j] = dz;
    dxg[2 * H + j] = dn;
    dhg[2 * H + j] = dn * r;
    return dh * z;
  }
};

// One element j of one step of an LSTM, PyTorch's formulas (gates in the order i, f, g, o):
//   i = σ(W_ii x + b_ii + W_hi h + b_hi)   f = σ(..f..)   g = tanh(..g..)   o = σ(..o..)
//   c' = f ⊙ c + i ⊙ g      h' = o ⊙ tanh(c')
// What backward keeps, per element: i, f, g, o and c'.
struct LSTMCell {
  static constexpr index_t gates = 4;
  static constexpr index_t saved = 5;
  static constexpr bool has_cell_state = true;
  static constexpr const char* name = "LSTM";

  template <class T>
  static T forward(const T* xg, const T* hg, index_t H, index_t j, T /*h*/, T* c, T* keep) {
    const T i = sigmoid(xg[j] + hg[j]);
    const T f = sigmoid(xg[H + j] + hg[H + j]);
    const T g = std::tanh(xg[2 * H + j] + hg[2 * H + j]);
    const T o = sigmoid(xg[3 * H + j] + hg[3 * H + j]);
    *c = f * *c + i * g;
    if (keep != nullptr) {
      keep[j] = i;
      keep[H + j] = f;
      keep[2 * H + j] = g;
      keep[3 * H + j] = o;
      keep[4 * H + j] = *c;
    }
    return o * std::tanh(*c);
  }

  // With dh the gradient reaching h_t and dc the one reaching c_t from step t + 1:
  //   do' = dh tanh(c) o (1 - o)   dc += dh o (1 - tanh²(c))
  //   di' = dc g i (1 - i)   df' = dc c_{t-1} f (1 - f)   dg' = dc i (1 - g²)
  // both gate rows' gradient is [di', df', dg', do']; c_{t-1} gets dc f, and h_{t-1} only what
  // the hidden gates send back through W_hh.
  template <class T>
  static T backward(const T* keep, const T* keep_before, index_t H, index_t j, T dh, T /*h*/, T* dc, T* dxg, T* dhg) {
    const T i = keep[j], f = keep[H + j], g = keep[2 * H + j], o = keep[3 * H + j];
    const T tc = std::tanh(keep[4 * H + j]);
    const T c_before = keep_before == nullptr ? T(0) : keep_before[4 * H + j];
    const T d_c = *dc + dh * o * (T(1) - tc * tc);
    dxg[j] = dhg[j] = d_c * g * i * (T(1) - i);
    dxg[H + j] = dhg[H + j] = d_c * c_before * f * (T(1) - f);
    dxg[2 * H + j] = dhg[2 * H + j] = d_c * i * (T(1) - g * g);
    dxg[3 * H + j] = dhg[3 * H + j] = dh * tc * o * (T(1) - o);
    *dc = d_c * f;
    return T(0);
  }
};

// The sizes of one call: batch, length, input and hidden size.
struct RecurrentSizes {
  index_t batch, length, input, hidden;
  index_t rows() const { return batch * length; }
};

// Every step of a layer's recurrence from h = 0 (and c = 0). h_{t-1} is read from `hs`
// ([B, L, H]): forward writes each h_t there as it goes (h_out = hs), backward reads the
// forward's output and writes nothing but `keep`, per row of [B · L] what Cell keeps.
template <class Cell, class Layer, class T>
void recurrent_steps(const Layer& layer, const RecurrentSizes& s, const T* x, const T* hs, T* h_out, T* keep) {
  const index_t H = s.hidden, G = Cell::gates * H;
  const ::Eigen::Map<const RowMatrix<T>> w_ih(layer.weight_ih_l0.data(), G, s.input);
  const ::Eigen::Map<const RowMatrix<T>> w_hh(layer.weight_hh_l0.data(), G, H);
  const ::Eigen::Map<const RowVector<T>> b_ih(layer.bias_ih_l0.data(), G);
  const ::Eigen::Map<const RowVector<T>> b_hh(layer.bias_hh_l0.data(), G);
  duet::detail::Storage input_gates_storage, hidden_gates_storage, cell_storage;
  T* input_gates = duet::detail::scratch<T>(input_gates_storage, static_cast<std::size_t>(s.rows() * G));
  T* hidden_gates = duet::detail::scratch<T>(hidden_gates_storage, static_cast<std::size_t>(s.batch * G));
  T* cell = Cell::has_cell_state ? duet::detail::scratch<T>(cell_storage, static_cast<std::size_t>(s.batch * H)) : nullptr;
  if (cell != nullptr) std::fill_n(cell, s.batch * H, T(0));
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
      const T* h_prev = t == 0 ? nullptr : hs + (row - 1) * H;
      T* kept = keep == nullptr ? nullptr : keep + row * Cell::saved * H;
      T* c = cell == nullptr ? nullptr : cell + b * H;
      for (index_t j = 0; j < H; ++j) {
        const T h = Cell::forward(input_gates + row * G, hidden_gates + b * G, H, j, h_prev == nullptr ? T(0) : h_prev[j],
                                  c == nullptr ? nullptr : c + j, kept);
        if (h_out != nullptr) h_out[row * H + j] = h;
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

// A recurrent layer's operation: [B, L, input] in, every step's hidden state [B, L, hidden] out.
template <class Layer>
struct RecurrentOp : Primitive<RecurrentOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  using Cell = typename Layer::cell_type;
  static constexpr int arity = 1;
  static constexpr bool has_parameters = true;

  const Layer* layer;
  RecurrentOp(const Layer* l) : layer(l) {}

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
    detail::recurrent_steps<Cell>(*layer, s, a.in<T>(), a.out<T>(), a.out<T>(), static_cast<T*>(nullptr));
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return RecurrentGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return RecurrentGradOp<Layer, false>{layer}; }

  static std::string op_name() { return Cell::name; }
  std::string label() const { return layer->label(); }
};

// Backpropagation through time. The gates are taken again from x and the forward's output (a
// pass as costly as the forward, which saves keeping them between forward and backward); then
// from the last step to the first, with dh the gradient reaching h_t (dy_t and what h_{t+1}
// sends back), the cell gives each step's gate gradients, and
//   dh_{t-1} = (the cell's part) + dhg W_hh;  dW_hh += dhgᵀ h_{t-1};  db_hh += dhg
// and, once for all steps, dW_ih = dxgᵀ x, db_ih the sum of dxg, dx = dxg W_ih.
template <class Layer, bool InputGrad>
struct RecurrentGradOp : Primitive<RecurrentGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  using Cell = typename Layer::cell_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
  static constexpr int arity = 3;  // dy, x, y
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  RecurrentGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using detail::RowMatrix;
    using detail::RowVector;
    const Shape& xs = a.in_shape(1);
    const detail::RecurrentSizes s{xs[0], xs[1], xs[2], layer->hidden_size()};
    const index_t H = s.hidden, G = Cell::gates * H, K = Cell::saved * H;
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    duet::detail::Storage keep_storage, dxg_storage, dhg_storage, dh_storage, dc_storage;
    T* keep = duet::detail::scratch<T>(keep_storage, static_cast<std::size_t>(s.rows() * K));
    detail::recurrent_steps<Cell>(*layer, s, x, y, static_cast<T*>(nullptr), keep);

    const std::uint64_t pass = duet::detail::current_backward_pass();
    ::Eigen::Map<RowMatrix<T>> dw_ih(detail::recurrent_parameter_grad<T>(layer->weight_ih_l0, pass), G, s.input);
    ::Eigen::Map<RowMatrix<T>> dw_hh(detail::recurrent_parameter_grad<T>(layer->weight_hh_l0, pass), G, H);
    ::Eigen::Map<RowVector<T>> db_ih(detail::recurrent_parameter_grad<T>(layer->bias_ih_l0, pass), G);
    ::Eigen::Map<RowVector<T>> db_hh(detail::recurrent_parameter_grad<T>(layer->bias_hh_l0, pass), G);
    const ::Eigen::Map<const RowMatrix<T>> w_hh(layer->weight_hh_l0.data(), G, H);

    T* dxg = duet::detail::scratch<T>(dxg_storage, static_cast<std::size_t>(s.rows() * G));
    T* dhg = duet::detail::scratch<T>(dhg_storage, static_cast<std::size_t>(s.batch * G));
    T* dh_next = duet::detail::scratch<T>(dh_storage, static_cast<std::size_t>(s.batch * H));
    T* dc = Cell::has_cell_state ? duet::detail::scratch<T>(dc_storage, static_cast<std::size_t>(s.batch * H)) : nullptr;
    if (dc != nullptr) std::fill_n(dc, s.batch * H, T(0));
    ::Eigen::Map<RowMatrix<T>> dhg_rows(dhg, s.batch, G);
    ::Eigen::Map<RowMatrix<T>> dh_rows(dh_next, s.batch, H);
    dh_rows.setZero();
    for (index_t t = s.length - 1; t >= 0; --t) {
      for (index_t b = 0; b < s.batch; ++b) {
        const index_t row = b * s.length + t;
        const T* h_prev = t == 0 ? nullptr : y + (row - 1) * H;
        const T* kept = keep + row * K;
        const T* kept_before = t == 0 ? nullptr : kept - K;
        T* carry = dh_next + b * H;
        for (index_t j = 0; j < H; ++j) {
          carry[j] = Cell::backward(kept, kept_before, H, j, dy[row * H + j] + carry[j],
                                    h_prev == nullptr ? T(0) : h_prev[j], dc == nullptr ? nullptr : dc + b * H + j,
                                    dxg + row * G, dhg + b * G);
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
    dw_ih.noalias() += dxg_rows.transpose() * ::Eigen::Map<const RowMatrix<T>>(x, s.rows(), s.input);
    db_ih += dxg_rows.colwise().sum();
    if constexpr (InputGrad) {
      ::Eigen::Map<RowMatrix<T>>(a.out<T>(), s.rows(), s.input).noalias() =
          dxg_rows * ::Eigen::Map<const RowMatrix<T>>(layer->weight_ih_l0.data(), G, s.input);
    }
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() { return std::string(Cell::name) + (InputGrad ? "Grad" : "Grad (parameters only)"); }
  std::string label() const { return layer->label(); }
};

inline const bool recurrent_listed = list_operations({"GRU", "LSTM"});

}  // namespace ops

namespace nn {
namespace detail {

// What nn::GRU and nn::LSTM share: one layer over batch-first sequences, x [B, L, input] in,
// the hidden state after every step [B, L, hidden] out, starting from zeros; parameters under
// PyTorch's names and layout, weight_ih_l0 [gates · hidden, input], weight_hh_l0 [gates ·
// hidden, hidden], bias_ih_l0 and bias_hh_l0 [gates · hidden], all drawn from
// U(-1/sqrt(hidden), 1/sqrt(hidden)), as both libraries do.
template <class Derived, class Step, index_t Input, index_t Hidden, ElementType T>
class RecurrentLayer : public Cell<Derived, CONTEXT_MODE, T> {
  static_assert(Input == dyn || Input > 0, "nn::GRU, nn::LSTM<Input, Hidden>: Input must be positive (or duet::dyn)");
  static_assert(Hidden == dyn || Hidden > 0, "nn::GRU, nn::LSTM<Input, Hidden>: Hidden must be positive (or duet::dyn)");

 public:
  using cell_type = Step;
  static constexpr index_t input_static = Input;
  static constexpr index_t hidden_static = Hidden;

  BasicParameter<T> weight_ih_l0;  // [gates * hidden, input]
  BasicParameter<T> weight_hh_l0;  // [gates * hidden, hidden]
  BasicParameter<T> bias_ih_l0;    // [gates * hidden]
  BasicParameter<T> bias_hh_l0;    // [gates * hidden]
  DUET_CELL_MEMBERS(weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0);

  RecurrentLayer(index_t input_size, index_t hidden_size) : input_(input_size), hidden_(hidden_size) {
    if ((Input != dyn && input_size != Input) || (Hidden != dyn && hidden_size != Hidden) || input_size <= 0 ||
        hidden_size <= 0) {
      throw ValueError(type_name() + ": cannot be built with input_size " + std::to_string(input_size) +
                       " and hidden_size " + std::to_string(hidden_size));
    }
    const initializer::Uniform init{static_cast<double>(T(1) / std::sqrt(static_cast<T>(hidden_size)))};
    const index_t gates = Step::gates * hidden_size;
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
    return apply(ops::RecurrentOp<Derived>{static_cast<const Derived*>(this)}, std::forward<X>(x));
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = std::string("nn::") + Step::name + "<" + size(Input) + ", " + size(Hidden);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  index_t input_;
  index_t hidden_;
};

}  // namespace detail

// PyTorch's nn.GRU(input_size, hidden_size, batch_first=True), MindSpore's nn.GRU with
// batch_first=True, one layer: gates r, z, n (PyTorch's order and formulas). Its `output`
// is what the layer gives; its h_n is the last step (ops::strided_slice from -1 on axis 1).
// Input and Hidden are compile-time sizes (nn::GRU<16, 32>), or duet::dyn for sizes given to
// the constructor. Sequence-major data ([L, B, input], both libraries' default) goes through
// ops::transpose first.
template <index_t Input = dyn, index_t Hidden = dyn, ElementType T = float>
class GRU : public detail::RecurrentLayer<GRU<Input, Hidden, T>, ops::detail::GRUCell, Input, Hidden, T> {
  using Base = detail::RecurrentLayer<GRU<Input, Hidden, T>, ops::detail::GRUCell, Input, Hidden, T>;

 public:
  GRU() requires(Input != dyn && Hidden != dyn) : Base(Input, Hidden) {}
  GRU(index_t input_size, index_t hidden_size) : Base(input_size, hidden_size) {}
};

// PyTorch's nn.LSTM(input_size, hidden_size, batch_first=True), MindSpore's nn.LSTM with
// batch_first=True, one layer: gates i, f, g, o (PyTorch's order and formulas), h and c from
// zeros; it gives every step's h (PyTorch's `output`), as nn::GRU does.
template <index_t Input = dyn, index_t Hidden = dyn, ElementType T = float>
class LSTM : public detail::RecurrentLayer<LSTM<Input, Hidden, T>, ops::detail::LSTMCell, Input, Hidden, T> {
  using Base = detail::RecurrentLayer<LSTM<Input, Hidden, T>, ops::detail::LSTMCell, Input, Hidden, T>;

 public:
  LSTM() requires(Input != dyn && Hidden != dyn) : Base(Input, Hidden) {}
  LSTM(index_t input_size, index_t hidden_size) : Base(input_size, hidden_size) {}
};

}  // namespace nn
}  // namespace duet
