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
#include <vector>

#include "../cell.hpp"
#include "../config.hpp"
#include "../eager.hpp"
#include "../initializer.hpp"
#include "../kernels/elementwise.hpp"
#include "../memory.hpp"
#include "../operation.hpp"
#include "../random.hpp"

namespace duet {
namespace ops {

// What a recurrent layer's gradient operation makes: dx (with the parameters' gradients), the
// parameters' gradients alone, or the initial h's or c's gradient.
enum class RecurrentGradient : unsigned char { input, parameters, hidden, cell };

template <class Layer, int States, bool CellStates, RecurrentGradient Target>
struct RecurrentGradOp;

namespace detail {

// x[i] = σ(x[i]) and tanh(x[i]) for i < n, a gate's row at a time: on the kernels of the
// instruction set chosen at run time (kernels/elementwise.hpp) for float and double. One call
// to libm's expf or tanhf per element was half of an LSTM's training step.
template <class T>
void sigmoid_in_place(T* x, index_t n) {
  if constexpr (kernels::VectorElement<T>) {
    kernels::sigmoid(x, n, x);
  } else {
    for (index_t i = 0; i < n; ++i) x[i] = T(1) / (T(1) + std::exp(-x[i]));
  }
}
template <class T>
void tanh_in_place(T* x, index_t n) {
  if constexpr (kernels::VectorElement<T>) {
    kernels::tanh(x, n, x);
  } else {
    for (index_t i = 0; i < n; ++i) x[i] = std::tanh(x[i]);
  }
}

// One step of a GRU for one sample, PyTorch's formulas (gates in the order r, z, n):
//   r = σ(W_ir x + b_ir + W_hr h + b_hr)      z = σ(W_iz x + b_iz + W_hz h + b_hz)
//   n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))      h' = (1 - z) ⊙ n + z ⊙ h
// `xg` and `hg` are the step's input and hidden gate rows (W x + b, W h + b), h_prev null for
// zeros; `a` is scratch of gates · H. What backward keeps of the step, per element: r, z, n and
// W_hn h + b_hn.
struct GRUCell {
  static constexpr index_t gates = 3;
  static constexpr index_t saved = 4;
  static constexpr int states = 1;  // h
  static constexpr const char* name = "GRU";
  // ONNX's GRU orders the gates z, r, h (PyTorch's blocks 1, 0, 2); linear_before_reset = 1 is
  // PyTorch's n, r applied to W_hn h + b_hn.
  static constexpr std::array<index_t, gates> onnx_gates{1, 0, 2};
  static std::vector<InterchangeAttribute> onnx_attributes() { return {InterchangeAttribute::of("linear_before_reset", 1)}; }

  template <class T>
  static void forward(const T* xg, const T* hg, index_t H, const T* h_prev, T* /*c*/, T* keep, T* a, T* h_out) {
    DUET_SIMD_LOOP
    for (index_t j = 0; j < 2 * H; ++j) a[j] = xg[j] + hg[j];
    sigmoid_in_place(a, 2 * H);
    const T* r = a;
    const T* z = a + H;
    T* n = a + 2 * H;
    DUET_SIMD_LOOP
    for (index_t j = 0; j < H; ++j) n[j] = xg[2 * H + j] + r[j] * hg[2 * H + j];
    tanh_in_place(n, H);
    DUET_SIMD_LOOP
    for (index_t j = 0; j < H; ++j) {
      const T h = h_prev == nullptr ? T(0) : h_prev[j];
      h_out[j] = (T(1) - z[j]) * n[j] + z[j] * h;
    }
    if (keep != nullptr) {
      std::copy_n(a, 3 * H, keep);
      std::copy_n(hg + 2 * H, H, keep + 3 * H);
    }
  }

  // With dh the gradient reaching h_t:
  //   dn' = dh (1 - z)(1 - n²)   dz' = dh (h_{t-1} - n) z (1 - z)   dr' = dn' (W_hn h + b_hn) r (1 - r)
  // the input gates' gradient is [dr', dz', dn'], the hidden gates' [dr', dz', dn' r]; h_{t-1}
  // gets dh z besides what the hidden gates send back through W_hh.
  template <class T>
  static T cell_state(const T*, index_t, index_t) {
    return T(0);
  }

  template <class T>
  static T backward(const T* keep, index_t H, index_t j, T dh, T h, T /*c*/, T* /*dc*/, T* dxg, T* dhg) {
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

// One step of an LSTM for one sample, PyTorch's formulas (gates in the order i, f, g, o):
//   i = σ(W_ii x + b_ii + W_hi h + b_hi)   f = σ(..f..)   g = tanh(..g..)   o = σ(..o..)
//   c' = f ⊙ c + i ⊙ g      h' = o ⊙ tanh(c')
// c is updated in place. What backward keeps, per element: i, f, g, o, c' and tanh(c').
struct LSTMCell {
  static constexpr index_t gates = 4;
  static constexpr index_t saved = 6;
  static constexpr int states = 2;  // h, c
  static constexpr const char* name = "LSTM";
  // ONNX's LSTM orders the gates i, o, f, c (PyTorch's blocks 0, 3, 1, 2).
  static constexpr std::array<index_t, gates> onnx_gates{0, 3, 1, 2};
  static std::vector<InterchangeAttribute> onnx_attributes() { return {}; }

  template <class T>
  static void forward(const T* xg, const T* hg, index_t H, const T* /*h_prev*/, T* c, T* keep, T* a, T* h_out) {
    DUET_SIMD_LOOP
    for (index_t j = 0; j < 4 * H; ++j) a[j] = xg[j] + hg[j];
    sigmoid_in_place(a, 2 * H);
    tanh_in_place(a + 2 * H, H);
    sigmoid_in_place(a + 3 * H, H);
    const T* i = a;
    const T* f = a + H;
    const T* g = a + 2 * H;
    const T* o = a + 3 * H;
    DUET_SIMD_LOOP
    for (index_t j = 0; j < H; ++j) {
      c[j] = f[j] * c[j] + i[j] * g[j];
      h_out[j] = c[j];
    }
    tanh_in_place(h_out, H);
    if (keep != nullptr) {
      std::copy_n(a, 4 * H, keep);
      std::copy_n(c, H, keep + 4 * H);
      std::copy_n(h_out, H, keep + 5 * H);
    }
    DUET_SIMD_LOOP
    for (index_t j = 0; j < H; ++j) h_out[j] *= o[j];
  }

  // With dh the gradient reaching h_t and dc the one reaching c_t from step t + 1:
  //   do' = dh tanh(c) o (1 - o)   dc += dh o (1 - tanh²(c))
  //   di' = dc g i (1 - i)   df' = dc c_{t-1} f (1 - f)   dg' = dc i (1 - g²)
  // both gate rows' gradient is [di', df', dg', do']; c_{t-1} gets dc f, and h_{t-1} only what
  // the hidden gates send back through W_hh.
  template <class T>
  static T cell_state(const T* keep, index_t H, index_t j) {
    return keep[4 * H + j];
  }

  template <class T>
  static T backward(const T* keep, index_t H, index_t j, T dh, T /*h*/, T c_before, T* dc, T* dxg, T* dhg) {
    const T i = keep[j], f = keep[H + j], g = keep[2 * H + j], o = keep[3 * H + j];
    const T tc = keep[5 * H + j];
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

// A call's initial states, [B, H] each, or null for zeros.
template <class T>
struct InitialStates {
  const T* h = nullptr;
  const T* c = nullptr;
};

// What a pass over the steps writes, each [B, L, ...] where not null: every h_t, every c_t (an
// LSTM's), and per row of [B · L] what the cell keeps for backward.
template <class T>
struct StepOutputs {
  T* h = nullptr;
  T* c = nullptr;
  T* keep = nullptr;
};

// y = x · wᵀ + bias, x [rows, in], w [out, in]: a Dense layer's product on Backend, with the
// weight packed once per version of it where Backend packs (nn::Dense's path). Eigen's
// product, which the gates took before, ran on the build's instruction set (SSE2 without
// -march): an LSTM's forward at B 32, L 32, 64 -> 128 spent 41 % of its time there.
template <class Backend, class T>
void gate_product(const T* x, index_t rows, index_t in, const nn::BasicParameter<T>& w, index_t out, const T* bias, T* y) {
  const Epilogue<T> epilogue{bias};
  if constexpr (backend::packs_as_dense<Backend, dyn, dyn, T>()) {
    Backend::template dense_packed<dyn, dyn>(x, rows, in, w, out, epilogue, y);
  } else {
    Backend::template dense<dyn, dyn>(x, rows, in, w.data(), out, epilogue, y);
  }
}

// Every step of a layer's recurrence from its initial states. h_{t-1} is read from `hs`
// ([B, L, H]): a forward writes each h_t there as it goes (out.h = hs); backward, given the
// forward's h, writes what the cell keeps.
template <class Backend, class Cell, class Layer, class T>
void recurrent_steps(const Layer& layer, const RecurrentSizes& s, const T* x, InitialStates<T> initial, const T* hs,
                     StepOutputs<T> out) {
  const index_t H = s.hidden, G = Cell::gates * H;
  duet::detail::Storage input_gates_storage, hidden_gates_storage, cell_storage, h_storage;
  T* input_gates = duet::detail::scratch<T>(input_gates_storage, static_cast<std::size_t>(s.rows() * G));
  T* hidden_gates = duet::detail::scratch<T>(hidden_gates_storage, static_cast<std::size_t>(s.batch * G));
  T* cell = Cell::states == 2 ? duet::detail::scratch<T>(cell_storage, static_cast<std::size_t>(s.batch * H)) : nullptr;
  if (cell != nullptr && initial.c != nullptr) std::copy_n(initial.c, s.batch * H, cell);
  else if (cell != nullptr) std::fill_n(cell, s.batch * H, T(0));
  // Every step's input gates in one product: the part of the work that does not wait for h.
  gate_product<Backend>(x, s.rows(), s.input, layer.weight_ih_l0, G, layer.bias_ih_l0.data(), input_gates);
  // h_{t-1} of every sample, rows L·H apart in hs, gathered into one matrix for the product.
  T* h_rows = duet::detail::scratch<T>(h_storage, static_cast<std::size_t>(s.batch * H));
  // The cell's gates for one sample and, where no h is written, its h.
  duet::detail::Storage activations_storage;
  T* activations = duet::detail::scratch<T>(activations_storage, static_cast<std::size_t>(G + H));
  T* h_step = activations + G;
  for (index_t t = 0; t < s.length; ++t) {
    if (t > 0) {
      for (index_t b = 0; b < s.batch; ++b) std::copy_n(hs + (b * s.length + t - 1) * H, H, h_rows + b * H);
      gate_product<Backend>(h_rows, s.batch, H, layer.weight_hh_l0, G, layer.bias_hh_l0.data(), hidden_gates);
    } else if (initial.h != nullptr) {
      gate_product<Backend>(initial.h, s.batch, H, layer.weight_hh_l0, G, layer.bias_hh_l0.data(), hidden_gates);
    } else {
      for (index_t b = 0; b < s.batch; ++b) std::copy_n(layer.bias_hh_l0.data(), G, hidden_gates + b * G);
    }
    for (index_t b = 0; b < s.batch; ++b) {
      const index_t row = b * s.length + t;
      const T* h_prev = t > 0 ? hs + (row - 1) * H : initial.h == nullptr ? nullptr : initial.h + b * H;
      T* kept = out.keep == nullptr ? nullptr : out.keep + row * Cell::saved * H;
      T* c = cell == nullptr ? nullptr : cell + b * H;
      T* h = out.h != nullptr ? out.h + row * H : h_step;
      Cell::forward(input_gates + row * G, hidden_gates + b * G, H, h_prev, c, kept, activations, h);
      if constexpr (Cell::states == 2) {
        if (out.c != nullptr) std::copy_n(c, H, out.c + row * H);
      }
    }
  }
}

}  // namespace detail

// A recurrent layer's operation: [B, L, input] and States initial states [B, hidden] (none, h,
// or h and c) in, every step's hidden state [B, L, hidden] out, or with CellStates every
// step's cell state c (an LSTM's: the same recurrence, the other of its two states).
template <class Layer, int States, bool CellStates = false>
struct RecurrentOp : Primitive<RecurrentOp<Layer, States, CellStates>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  using Cell = typename Layer::cell_type;
  static_assert(!CellStates || Cell::states == 2, "duet: only an LSTM has cell states");
  static constexpr int arity = 1 + States;
  static constexpr bool has_parameters = true;

  const Layer* layer;
  RecurrentOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult rule(index_t input, index_t hidden, std::span<const Shape> in) {
    const Shape& x = in[0];
    if (x.leading_unknown() && x.rank() < 3) return {Shape{dyn, dyn, hidden}};
    if (x.rank() != 3) return fault(Shape{dyn, dyn, hidden}, ShapeFault::exact_rank, 3);
    const Shape y{x[0], x[1], hidden};
    if (input != dyn && x[2] != dyn && x[2] != input) return fault(y, ShapeFault::last_dimension, input);
    // PyTorch refuses an empty sequence too: it has no last state to return.
    if (x[1] == 0) return fault(y, ShapeFault::empty_sequence, 1);
    for (int k = 1; k <= States; ++k) {
      const Shape& h = in[static_cast<std::size_t>(k)];
      if (h.leading_unknown()) continue;
      const auto differs = [](index_t a, index_t b) { return a != dyn && b != dyn && a != b; };
      if (h.rank() != 2 || differs(h[0], x[0]) || differs(h[1], hidden)) return fault(y, ShapeFault::initial_state, hidden, k);
    }
    return {y};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return rule(Layer::input_static, Layer::hidden_static, in);
  }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->input_size(), layer->hidden_size(), in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const Shape& x = a.in_shape();
    const detail::RecurrentSizes s{x[0], x[1], x[2], layer->hidden_size()};
    const detail::InitialStates<T> initial{States >= 1 ? a.in<T>(1) : nullptr, States >= 2 ? a.in<T>(2) : nullptr};
    if constexpr (CellStates) {
      duet::detail::Storage hs_storage;
      T* hs = duet::detail::scratch<T>(hs_storage, static_cast<std::size_t>(s.rows() * s.hidden));
      detail::recurrent_steps<Backend, Cell>(*layer, s, a.in<T>(), initial, hs, detail::StepOutputs<T>{hs, a.out<T>(), nullptr});
    } else {
      detail::recurrent_steps<Backend, Cell>(*layer, s, a.in<T>(), initial, a.out<T>(), detail::StepOutputs<T>{a.out<T>()});
    }
  }

  template <std::size_t K>
    requires(K <= States)
  auto grad_op() const {
    constexpr RecurrentGradient target = K == 0   ? RecurrentGradient::input
                                         : K == 1 ? RecurrentGradient::hidden
                                                  : RecurrentGradient::cell;
    return RecurrentGradOp<Layer, States, CellStates, target>{layer};
  }
  auto parameter_grad_op() const {
    return RecurrentGradOp<Layer, States, CellStates, RecurrentGradient::parameters>{layer};
  }

  static std::string op_name() { return std::string(Cell::name) + (CellStates ? " (cell states)" : ""); }
  std::string label() const { return layer->label(); }

  // ONNX: its GRU or LSTM, forward, which reads sequence-major [L, B, input], weights [1,
  // gates · hidden, ...] with ONNX's gate order, one bias of both halves, states [1, B,
  // hidden], and gives [L, 1, B, hidden]. The parameters stay initializers under their names
  // in PyTorch's layout, reordered in the graph by Gather: load_onnx_weights reads them back,
  // and load_onnx finds them behind the Gathers (OnnxBuilder::prepare_recurrence).
  // Every step's c has no form: ONNX's LSTM gives the last step's only.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (CellStates) {
      return {};
    } else {
      using I = InterchangeInput;
      using A = InterchangeAttribute;
      const index_t H = layer->hidden_size();
      std::vector<std::int64_t> rows;
      for (const index_t gate : Cell::onnx_gates) {
        for (index_t j = 0; j < H; ++j) rows.push_back(gate * H + j);
      }
      std::vector<std::int64_t> both = rows;
      for (const std::int64_t r : rows) both.push_back(r + Cell::gates * H);
      const std::vector<std::int64_t> swap_batch_and_length{1, 0, 2};
      Interchange n;
      const auto add = [&](InterchangeNode node) {
        n.push_back(std::move(node));
        return I::node(n.size() - 1);
      };
      const auto reordered = [&](I matrix, const std::vector<std::int64_t>& order) {
        return add({"Unsqueeze", {add({"Gather", {std::move(matrix), I::constant(order)}, {A::of("axis", 0)}}), I::constant({0})}, {}});
      };
      std::vector<I> in{add({"Transpose", {I::operand(0)}, {A::of("perm", swap_batch_and_length)}}),
                        reordered(I::of_parameter(&layer->weight_ih_l0), rows),
                        reordered(I::of_parameter(&layer->weight_hh_l0), rows),
                        reordered(add({"Concat", {I::of_parameter(&layer->bias_ih_l0), I::of_parameter(&layer->bias_hh_l0)}, {A::of("axis", 0)}}), both)};
      if constexpr (States > 0) {
        in.push_back(I::absent());  // sequence_lens: every sequence is whole
        for (std::size_t k = 1; k <= States; ++k) in.push_back(add({"Unsqueeze", {I::operand(k), I::constant({0})}, {}}));
      }
      std::vector<A> attributes = Cell::onnx_attributes();
      attributes.push_back(A::of("hidden_size", H));
      const I y = add({Cell::name, std::move(in), std::move(attributes)});
      add({"Transpose", {add({"Squeeze", {y, I::constant({1})}, {}})}, {A::of("perm", swap_batch_and_length)}});
      return n;
    }
  }
};

// Backpropagation through time. The gates are taken again from x, the initial states and the
// forward's output (a pass as costly as the forward, which saves keeping them between forward
// and backward); then from the last step to the first, with dh the gradient reaching h_t (dy_t
// and what h_{t+1} sends back), the cell gives each step's gate gradients, and
//   dh_{t-1} = (the cell's part) + dhg W_hh;  dW_hh += dhgᵀ h_{t-1};  db_hh += dhg
// and, once for all steps, dW_ih = dxgᵀ x, db_ih the sum of dxg, dx = dxg W_ih. The initial
// states' gradients are what reaches h_{-1} and c_{-1}: each is its own operation, which runs
// the loop again (the contract's one value per operation), and writes no parameter's gradient.
// With CellStates the output's gradient reaches each c_t instead of h_t, and h is taken again
// with the gates.
template <class Layer, int States, bool CellStates, RecurrentGradient Target>
struct RecurrentGradOp : Primitive<RecurrentGradOp<Layer, States, CellStates, Target>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  using Cell = typename Layer::cell_type;
  static constexpr auto reads = [] {
    using graph::Operand;
    if constexpr (States == 0) return std::array{Operand::grad, Operand::input0, Operand::output};
    else if constexpr (States == 1) return std::array{Operand::grad, Operand::input0, Operand::input1, Operand::output};
    else return std::array{Operand::grad, Operand::input0, Operand::input1, Operand::input2, Operand::output};
  }();
  static constexpr int arity = static_cast<int>(reads.size());  // dy, x, the initial states, y
  static constexpr bool is_sink = Target == RecurrentGradient::parameters;
  static constexpr bool writes_parameters = Target == RecurrentGradient::input || Target == RecurrentGradient::parameters;

  const Layer* layer;
  RecurrentGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if constexpr (Target == RecurrentGradient::input) return {in[1]};
    else if constexpr (Target == RecurrentGradient::hidden) return {in[2]};
    else if constexpr (Target == RecurrentGradient::cell) return {in[3]};
    else return {Shape{}};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const Shape& xs = a.in_shape(1);
    const detail::RecurrentSizes s{xs[0], xs[1], xs[2], layer->hidden_size()};
    const index_t H = s.hidden, G = Cell::gates * H, K = Cell::saved * H;
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    const detail::InitialStates<T> initial{States >= 1 ? a.in<T>(2) : nullptr, States >= 2 ? a.in<T>(3) : nullptr};
    duet::detail::Storage keep_storage, hs_storage, dxg_storage, dhg_storage, dh_storage, dc_storage;
    T* keep = duet::detail::scratch<T>(keep_storage, static_cast<std::size_t>(s.rows() * K));
    // Every h_t: the forward's output, or taken again when that output is the cell states.
    const T* y = a.in<T>(static_cast<std::size_t>(2 + States));
    if constexpr (CellStates) {
      T* hs = duet::detail::scratch<T>(hs_storage, static_cast<std::size_t>(s.rows() * H));
      detail::recurrent_steps<Backend, Cell>(*layer, s, x, initial, hs, detail::StepOutputs<T>{hs, nullptr, keep});
      y = hs;
    } else {
      detail::recurrent_steps<Backend, Cell>(*layer, s, x, initial, y, detail::StepOutputs<T>{nullptr, nullptr, keep});
    }

    duet::detail::Storage dhg_step_storage, dh_product_storage, h_before_storage;
    T* dxg = duet::detail::scratch<T>(dxg_storage, static_cast<std::size_t>(s.rows() * G));
    // The hidden gates' gradient of every row: a step's [B, G] goes back through W_hh to h_{t-1}
    // at once, and all of them make W_hh's gradient in one product after the loop.
    T* dhg = duet::detail::scratch<T>(dhg_storage, static_cast<std::size_t>(s.rows() * G));
    T* dhg_step = duet::detail::scratch<T>(dhg_step_storage, static_cast<std::size_t>(s.batch * G));
    T* dh_product = duet::detail::scratch<T>(dh_product_storage, static_cast<std::size_t>(s.batch * H));
    // The gradient reaching h_{t-1} (and c_{t-1}): the output itself when it is the initial
    // state's.
    T* dh_next = Target == RecurrentGradient::hidden ? a.out<T>()
                                                     : duet::detail::scratch<T>(dh_storage, static_cast<std::size_t>(s.batch * H));
    T* dc = Cell::states < 2                       ? nullptr
            : Target == RecurrentGradient::cell ? a.out<T>()
                                                : duet::detail::scratch<T>(dc_storage, static_cast<std::size_t>(s.batch * H));
    if (dc != nullptr) std::fill_n(dc, s.batch * H, T(0));
    std::fill_n(dh_next, s.batch * H, T(0));

    const T* w_hh = layer->weight_hh_l0.data();
    for (index_t t = s.length - 1; t >= 0; --t) {
      for (index_t b = 0; b < s.batch; ++b) {
        const index_t row = b * s.length + t;
        const T* h_prev = t > 0 ? y + (row - 1) * H : initial.h == nullptr ? nullptr : initial.h + b * H;
        const T* kept = keep + row * K;
        T* carry = dh_next + b * H;
        for (index_t j = 0; j < H; ++j) {
          const T c_prev = t > 0 ? Cell::cell_state(kept - K, H, j) : initial.c == nullptr ? T(0) : initial.c[b * H + j];
          T dh = carry[j];
          if constexpr (CellStates) dc[b * H + j] += dy[row * H + j];
          else dh += dy[row * H + j];
          carry[j] = Cell::backward(kept, H, j, dh, h_prev == nullptr ? T(0) : h_prev[j], c_prev,
                                    dc == nullptr ? nullptr : dc + b * H + j, dxg + row * G, dhg + row * G);
        }
        std::copy_n(dhg + row * G, G, dhg_step + b * G);
      }
      // dh_{t-1} += dhg_t · W_hh, on the backend's product (W_hh [G, H] is the [k, n] it reads).
      Backend::matmul(dhg_step, s.batch, G, w_hh, H, dh_product);
      for (index_t i = 0; i < s.batch * H; ++i) dh_next[i] += dh_product[i];
    }
    if constexpr (writes_parameters) {
      const std::uint64_t pass = duet::detail::current_backward_pass();
      // Each row's h_{t-1} (the initial state's, or zeros, at t = 0) beside its dhg: W_hh's and
      // b_hh's gradients are a Dense layer's, over all rows at once.
      T* h_before = duet::detail::scratch<T>(h_before_storage, static_cast<std::size_t>(s.rows() * H));
      for (index_t b = 0; b < s.batch; ++b) {
        T* first = h_before + b * s.length * H;
        if (initial.h != nullptr) std::copy_n(initial.h + b * H, H, first);
        else std::fill_n(first, H, T(0));
        std::copy_n(y + b * s.length * H, (s.length - 1) * H, first + H);
      }
      Backend::template dense_backward<dyn, dyn>(DenseBackwardArgs<T>{dhg, h_before, nullptr, s.rows(), H, w_hh, G, nullptr,
                                                                      layer->weight_hh_l0.grad_for_add(pass), true,
                                                                      layer->bias_hh_l0.grad_for_add(pass), true});
      Backend::template dense_backward<dyn, dyn>(DenseBackwardArgs<T>{
          dxg, x, nullptr, s.rows(), s.input, layer->weight_ih_l0.data(), G,
          Target == RecurrentGradient::input ? a.out<T>() : nullptr, layer->weight_ih_l0.grad_for_add(pass), true,
          layer->bias_ih_l0.grad_for_add(pass), true});
      duet::detail::gradient_writes_done();
    }
  }

  static std::string op_name() {
    const std::string name = std::string(Cell::name) + "Grad" + (CellStates ? " (cell states)" : "");
    switch (Target) {
      case RecurrentGradient::input: return name;
      case RecurrentGradient::parameters: return name + " (parameters only)";
      case RecurrentGradient::hidden: return name + " (initial h)";
      case RecurrentGradient::cell: return name + " (initial c)";
    }
    return name;
  }
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

  // x alone starts from zeros; x with h0 (a GRU's), or with h0 and c0 (an LSTM's), [B, hidden]
  // each, from those (PyTorch's gru(x, h0), lstm(x, (h0, c0))), and their gradients reach them.
  template <class X, class... States>
    requires(sizeof...(States) == 0 || sizeof...(States) == Step::states)
  auto construct(X&& x, States&&... states) {
    return apply(ops::RecurrentOp<Derived, static_cast<int>(sizeof...(States))>{static_cast<const Derived*>(this)},
                 std::forward<X>(x), std::forward<States>(states)...);
  }

  // An LSTM's cell state after every step, [B, L, hidden], from the same inputs as its call
  // (PyTorch's c_n is the last step): what carries its state to the next chunk, beside h. It
  // runs the recurrence again, so a network that needs both pays for it twice.
  template <class X, class... States>
    requires(Step::states == 2 && (sizeof...(States) == 0 || sizeof...(States) == 2))
  auto cell_states(X&& x, States&&... states) {
    return apply(ops::RecurrentOp<Derived, static_cast<int>(sizeof...(States)), true>{static_cast<const Derived*>(this)},
                 std::forward<X>(x), std::forward<States>(states)...);
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = std::string("nn::") + Step::name + "<" + size(Input) + ", " + size(Hidden);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }
  std::string extra_repr() const override {
    if constexpr (Input != dyn && Hidden != dyn)
      return {};
    else
      return std::to_string(input_) + ", " + std::to_string(hidden_);
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
