// Convolutions: nn::Conv2d and nn::Conv1d (MindSpore's nn.Conv2d and nn.Conv1d, depthwise
// with groups = channels), and the operations they capture.
//
//   nn::Conv2d<In, Out, Kernel, Stride = 1, Padding = 0, Dilation = 1, Groups = 1>
//       compile-time sized: static shapes are checked through it while the program compiles.
//       Padding is a number (MindSpore's pad_mode "pad" with that padding on every side) or
//       nn::PadMode::same / nn::PadMode::valid;
//   nn::Conv2d<>(in, out, kernel, {.stride, .pad_mode, .padding, .dilation, .group, .has_bias,
//                .weight_init, .bias_init})
//       run-time sized, with MindSpore's defaults (pad_mode "same", no bias);
//   nn::Conv1d<...> and nn::Conv1d<>(...) the same on NCL inputs.
//
// MindSpore's conventions, where PyTorch's differ:
//  - pad_mode "same" gives ceil(size / stride) outputs, padding split evenly with the odd one
//    after (bottom, right), as MindSpore and TensorFlow do; PyTorch's padding="same" refuses
//    strides above 1. "valid" pads nothing. "pad" pads `padding` on each side, as PyTorch's
//    padding.
//  - has_bias defaults to false (PyTorch's bias to true); the layer without bias has no bias
//    parameter, so checkpoints hold `weight` alone, with `bias` when it has one (Dense's names).
//  - the run-time form defaults to pad_mode "same"; the compile-time form's Padding defaults
//    to 0 (the signature, PyTorch's default, MindSpore's "valid").
//  - the weight is [out, in / group, kh, kw] ([out, in / group, k] for Conv1d), initialised
//    as MindSpore 2.x does by default (HeUniform(sqrt(5)), and the bias Uniform(1/sqrt(fan_in))):
//    both U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in / group · kh · kw, PyTorch's default.
//  - the option is MindSpore's `group` (PyTorch's `groups`).
//
// The geometry (kernel, stride, padding, dilation, groups) is a template argument of the
// compile-time form, since the output's static shape needs it; the run-time form keeps it in
// the layer and its shape rule runs on it at run time. The compile-time form is the run-time
// one with its geometry in its type as well (SizedLayer, cell.hpp): only graph capture sees
// the type, and a network's convolutions of every size share the rest of their code.
//
// Algorithm: im2col, one kernel tap to a row, and duet's packed GEMM for all three products
// (the forward, the weight's gradient and the input's); kernels/conv.hpp gives the layout.
// Measured single-threaded in float, medians of processor time, on the project's 2-core AMD
// EPYC (AVX-512) while other builds loaded it (load average 11 to 14), forward of one layer,
// im2col + duet's GEMM / direct loops (an axpy per tap over output rows) / im2col + Eigen's
// product, with patches one pixel to a row:
//   LeNet conv1, 1->6 5x5 pad 2, batch 64:   2.0 / 8.7 to 32 / 1.5 ms
//   LeNet conv2, 6->16 5x5, batch 64:        1.4 / 29 to 65 / 1.6 to 1.9 ms
//   3x3 64->64 pad 1 on 28x28, batch 32:     111 to 291 / 1096 to 3263 / 101 to 333 ms
// Those direct loops lost even at one input channel; the direct convolution duet has now
// (kernels/conv.hpp, direct_convolution) holds a tile of 6 output channels by two vectors of an
// output row in registers, per instruction set, and takes layers of at most 2 input channels
// at stride 1: LeNet conv1's forward 0.73 -> 0.13 ms (g++ -O2, AVX-512 Zen 5, one thread,
// 2026-12-04), and its training step at batch 64 with the pooling and ReLU-gradient kernels
// (kernels/pool.hpp, kernels::map_grad) 8.9 -> 3.4 ms. Its forward alone beat im2col + GEMM up
// to 16 input channels on 28x28 (16 -> 16 3x3: 1.0 against 2.0 ms at batch 32), but not on
// narrow rows (16 -> 32 on 14x14: 0.94 against 0.82) nor at 64 channels (24 against 17), and
// LeNet's conv2 (6 -> 16, rows of 10) through the direct weight gradient made the step slower
// (4.4 against 3.4 ms). With patches one pixel to a row, im2col and col2im took 36% of the 3x3 layer's forward+backward
// (122 ms, Eigen's gradient products 38 ms of it). Patches one tap to a row (copies of input
// rows) with the products on duet's GEMM (gemm_kn packing the patches' panels from their rows)
// brought it, in the benchmark binary (benchmarks/conv.cpp, same load), to 25.9 ms forward
// (from 37.9; libtorch 29.8, oneDNN 26.5) and 87.0 ms forward+backward (from 122.6; libtorch
// 70.8, oneDNN 89.1), the GEMM's micro-kernel 59% of it; LeNet-5's training step at batch 64
// to 9.5 ms (from 11.0; libtorch 12.4). What remains is the products themselves: packing the
// patches' panels straight from the image (implicit GEMM) would save im2col's copy, a few
// percent.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../backend.hpp"
#include "../cell.hpp"
#include "../eager.hpp"
#include "../initializer.hpp"
#include "../kernels/conv.hpp"
#include "../nn/activation.hpp"
#include "../nn/batchnorm.hpp"
#include "../nn/pad_mode.hpp"
#include "../operation.hpp"
#include "../random.hpp"

namespace duet {

namespace ops {

// A convolution's settings, from its layer: the compile-time form's as a constant (dyn where
// the run-time form leaves them open), the run-time form's from its members. Spatial is 1
// (NCL) or 2 (NCHW); a 1-D convolution is a 2-D one of height 1, so axis 0 below is then the
// height of 1 with a kernel of 1.
struct ConvGeometry {
  int spatial = 2;
  index_t in = dyn;
  index_t out = dyn;
  index_t kernel = dyn;  // dyn: nothing but the ranks and channels is known at compile time
  index_t stride = 1;
  nn::PadMode pad_mode = nn::PadMode::pad;
  index_t padding = 0;
  index_t dilation = 1;
  index_t groups = 1;

  constexpr index_t extent() const { return dilation * (kernel - 1) + 1; }
};

namespace detail {

// One spatial axis: its output size and the padding before it, or the smallest input size
// that leaves an output (`smallest`, when `size` is below it).
struct ConvAxis {
  index_t out = dyn;
  index_t pad_before = 0;
  index_t smallest = 0;
};

constexpr ConvAxis conv_axis(const ConvGeometry& g, index_t size, bool real_axis) {
  if (!real_axis) return {size, 0, 0};  // the height of 1 of a 1-D convolution
  if (g.kernel == dyn) return {dyn, 0, 0};
  const index_t extent = g.extent();
  switch (g.pad_mode) {
    case nn::PadMode::same: {
      if (size == dyn) return {dyn, 0, 0};
      const index_t out = (size + g.stride - 1) / g.stride;
      const index_t total = std::max<index_t>(0, (out - 1) * g.stride + extent - size);
      return {out, total / 2, 0};
    }
    case nn::PadMode::valid:
    case nn::PadMode::pad: {
      const index_t pad = g.pad_mode == nn::PadMode::pad ? g.padding : 0;
      const index_t smallest = std::max<index_t>(1, extent - 2 * pad);
      if (size == dyn) return {dyn, pad, smallest};
      if (size < smallest) return {dyn, pad, smallest};
      return {(size + 2 * pad - extent) / g.stride + 1, pad, smallest};
    }
  }
  return {};
}

// The shape rule: [N, in, (H,) W] -> [N, out, (OH,) OW].
constexpr ShapeResult conv_shape(const ConvGeometry& g, const Shape& x) {
  const int rank = g.spatial + 2;
  Shape in = x;
  if (x.leading_unknown()) {
    if (x.rank() > rank) return fault(Shape::any(), ShapeFault::exact_rank, rank);
    in = Shape{};
    for (int i = 0; i < rank - x.rank(); ++i) in.push_back(dyn);
    for (int i = 0; i < x.rank(); ++i) in.push_back(x[i]);
  }
  Shape y{in.rank() > 0 ? in[0] : dyn, g.out};
  if (in.rank() != rank) {
    for (int i = 0; i < g.spatial; ++i) y.push_back(dyn);
    return fault(y, ShapeFault::exact_rank, rank);
  }
  ShapeResult r{y};
  for (int i = 0; i < g.spatial; ++i) {
    const ConvAxis axis = conv_axis(g, in[2 + i], true);
    r.shape.push_back(axis.out);
    if (axis.out == dyn && in[2 + i] != dyn && axis.smallest > 0 && r.ok()) {
      r = fault(r.shape, ShapeFault::spatial_size, axis.smallest);
    }
  }
  if (g.in != dyn && in[1] != dyn && in[1] != g.in) return fault(r.shape, ShapeFault::channel_dimension, g.in);
  return r;
}

// The sizes of one convolution of g on an input of shape x (which its rule accepted).
inline kernels::ConvProblem conv_problem(const ConvGeometry& g, const Shape& x) {
  const bool two_d = g.spatial == 2;
  const index_t height = two_d ? x[2] : 1;
  const index_t width = x[-1];
  const ConvAxis h = conv_axis(g, height, two_d);
  const ConvAxis w = conv_axis(g, width, true);
  kernels::ConvProblem q;
  q.batch = x[0];
  q.in = g.in;
  q.out = g.out;
  q.groups = g.groups;
  q.height = height;
  q.width = width;
  q.out_height = h.out;
  q.out_width = w.out;
  q.kernel_h = two_d ? g.kernel : 1;
  q.kernel_w = g.kernel;
  q.stride_h = two_d ? g.stride : 1;
  q.stride_w = g.stride;
  q.dilation_h = two_d ? g.dilation : 1;
  q.dilation_w = g.dilation;
  q.pad_top = h.pad_before;
  q.pad_left = w.pad_before;
  return q;
}

// y = fns(conv(x, w) + bias) for a convolution of geometry g, x and y being a's input and
// output; bias may be null. The bias and the functions go over each sample's planes right
// after its products, while they are still in cache: the bias is per output channel, a row
// of the product, which the GEMM's epilogue (a bias per column) cannot take.
template <class Backend, class T, class... Fns>
void convolve(const ConvGeometry& g, const graph::KernelArgs& a, const T* w, const T* bias,
              const std::tuple<Fns...>& fns) {
  const kernels::ConvProblem q = conv_problem(g, a.in_shape());
  const T* x = a.in<T>();
  T* y = a.out<T>();
  const index_t og = q.out_per_group();
  const bool direct = kernels::direct_convolution(q);
  const kernels::Isa isa = kernels::active_isa();
  duet::detail::Storage storage;
  // A sample's padded copy (direct), or a group's patches.
  T* col = direct ? duet::detail::scratch<T>(storage, q.in * kernels::direct_layout<T>(q).plane())
                  : duet::detail::scratch<T>(storage, q.depth() * q.pixels());
  for (index_t n = 0; n < q.batch; ++n) {
    if (direct) {
      kernels::direct_padded(q, x + n * q.in * q.image(), col);
      kernels::direct_convolve(isa, q, col, w, y + n * q.out * q.pixels());
    }
    for (index_t gr = 0; gr < q.groups && !direct; ++gr) {
      kernels::im2col(q, x + (n * q.in + gr * q.in_per_group()) * q.image(), col);
      T* yg = y + (n * q.out + gr * og) * q.pixels();
      Backend::matmul(w + gr * og * q.depth(), og, q.depth(), col, q.pixels(), yg);
    }
    T* yn = y + n * q.out * q.pixels();
    if (bias != nullptr) kernels::add_channel_bias(yn, q.out, q.pixels(), bias);
    if constexpr (sizeof...(Fns) > 0 && backend::detail::exact_in_any_layout<T, Fns...>) {
      Backend::map(fns, yn, q.out * q.pixels(), yn);
    }
  }
  // A function whose bits depend on where a vector starts (Eigen's exp, sin) goes over the
  // whole output, as PyNative's separate map does: a sample's planes need not split into
  // vectors where the whole does.
  if constexpr (sizeof...(Fns) > 0 && !backend::detail::exact_in_any_layout<T, Fns...>) {
    Backend::map(fns, y, q.batch * q.out * q.pixels(), y);
  }
}

// ConvOp's ONNX node: Conv. pad_mode same is auto_pad SAME_UPPER (the odd padding after, at
// every size: explicit pads, uneven at some sizes, were what load_onnx could not read back);
// the others' padding is written out.
template <class Runtime>
Interchange conv_interchange(const Runtime* layer, std::span<const Shape>) {
  const ConvGeometry g = layer->geometry();
  const auto each = [&](index_t v) { return std::vector<std::int64_t>(static_cast<std::size_t>(g.spatial), v); };
  using I = InterchangeInput;
  using A = InterchangeAttribute;
  InterchangeNode conv{
      "Conv",
      {I::operand(0), I::of_parameter(&layer->weight)},
      {A::of("kernel_shape", each(g.kernel)), A::of("strides", each(g.stride)), A::of("dilations", each(g.dilation)),
       g.pad_mode == nn::PadMode::same
           ? A::of_text("auto_pad", "SAME_UPPER")
           : A::of("pads", std::vector<std::int64_t>(static_cast<std::size_t>(2 * g.spatial),
                                                     g.pad_mode == nn::PadMode::pad ? g.padding : 0)),
       A::of("group", g.groups)}};
  if (layer->has_bias()) conv.inputs.push_back(I::of_parameter(&layer->bias));
  return {std::move(conv)};
}

// ConvGradOp's kernel: dweight, dbias and, if input_grad, dx (a's output) from dy and x (a's inputs).
template <class Backend, class T, class Runtime>
void conv_gradient(const Runtime* layer, const graph::KernelArgs& a, bool input_grad) {
  const kernels::ConvProblem q = detail::conv_problem(layer->geometry(), a.in_shape(1));
  const std::uint64_t pass = duet::detail::current_backward_pass();
  bool accumulate_w = false;
  bool accumulate_b = false;
  T* dw = layer->weight.grad_for_write(pass, &accumulate_w);
  T* db = layer->has_bias() ? layer->bias.grad_for_write(pass, &accumulate_b) : nullptr;
  const T* dy = a.in<T>(0);
  const T* x = a.in<T>(1);
  const T* w = layer->weight.data();
  const index_t og = q.out_per_group();
  const index_t weights = og * q.depth();  // one group's
  T* dx = input_grad ? a.out<T>() : nullptr;
  // dx as a convolution of dy (kernels::data_gradient_convolution), or as the patches'
  // gradient wᵀ · dy added back by col2im.
  const bool convolve_dx = dx != nullptr && kernels::has_data_gradient_convolution(q);
  const kernels::ConvProblem t = convolve_dx ? kernels::data_gradient_convolution(q) : q;
  const bool direct = kernels::direct_convolution(q);
  const kernels::Isa isa = kernels::active_isa();
  duet::detail::Storage col_storage, sample_storage, wt_storage, padded_storage;
  // The patches of x, then (once the weight's gradient has read them) those of dy or the
  // patches' gradient.
  T* col = !direct || dx != nullptr
               ? duet::detail::scratch<T>(col_storage, std::max(q.depth() * q.pixels(), t.depth() * t.pixels()))
               : nullptr;
  // One sample's part of a group's weight gradient, added to those before it; for the direct
  // convolution, the weight gradient's partial sums over every sample.
  T* dw_sample = direct ? duet::detail::scratch<T>(sample_storage, kernels::direct_partial_size<T>(q))
                        : duet::detail::scratch<T>(sample_storage, weights);
  if (direct) std::fill_n(dw_sample, kernels::direct_partial_size<T>(q), T(0));
  T* padded = direct ? duet::detail::scratch<T>(padded_storage, q.in * kernels::direct_layout<T>(q).plane()) : nullptr;
  // Each group's weight as the data gradient's product reads it: flipped, or as [depth, out_g].
  T* wt = dx != nullptr ? duet::detail::scratch<T>(wt_storage, q.groups * weights) : nullptr;
  if (convolve_dx) {
    for (index_t g = 0; g < q.groups; ++g) kernels::flipped_weight(q, w + g * weights, wt + g * weights);
  } else if (dx != nullptr) {
    std::fill_n(dx, q.batch * q.in * q.image(), T(0));
    for (index_t g = 0; g < q.groups; ++g) kernels::transpose(w + g * weights, og, q.depth(), wt + g * weights);
  }
  for (index_t n = 0; n < q.batch; ++n) {
    for (index_t g = 0; g < q.groups; ++g) {
      const T* dyg = dy + (n * q.out + g * og) * q.pixels();
      const index_t xg = (n * q.in + g * q.in_per_group()) * q.image();
      T* dwg = dw + g * weights;
      if (direct) {
        kernels::direct_padded(q, x + xg, padded);
        kernels::direct_weight_gradient(isa, q, padded, dyg, dw_sample);
      } else {
        kernels::im2col(q, x + xg, col);
        const bool add = accumulate_w || n > 0;
        Backend::template dense<dyn, dyn>(dyg, og, q.pixels(), col, q.depth(), Epilogue<T>{}, add ? dw_sample : dwg);
        if (add) std::transform(dwg, dwg + weights, dw_sample, dwg, std::plus<T>{});
      }
      if (convolve_dx) {
        kernels::im2col(t, dyg, col);
        Backend::matmul(wt + g * weights, t.out, t.depth(), col, t.pixels(), dx + xg);
      } else if (dx != nullptr) {
        Backend::matmul(wt + g * weights, q.depth(), og, dyg, q.pixels(), col);
        kernels::col2im_add(q, col, dx + xg);
      }
    }
    if (db != nullptr) kernels::channel_sums(dy + n * q.out * q.pixels(), q.out, q.pixels(), db, accumulate_b || n > 0);
  }
  if (direct) kernels::direct_weight_sums(isa, q, dw_sample, dw, accumulate_w);
  if (q.batch == 0) {
    if (!accumulate_w) std::fill_n(dw, layer->weight.numel(), T(0));
    if (db != nullptr && !accumulate_b) std::fill_n(db, q.out, T(0));
  }
  duet::detail::gradient_writes_done();
}

}  // namespace detail

// A convolution's weight and bias with the evaluation BatchNorm after it folded in, from
// BatchNorm::evaluation_affine()'s y = x · scale + shift per channel: W'[c] = W[c] · scale[c]
// and b'[c] = b[c] · scale[c] + shift[c], scale being gamma / sqrt(moving_variance + eps) and
// shift beta - moving_mean · scale. They round differently from the BatchNorm's own
// (x - mean) · scale + beta after the convolution: the folded output agrees with the unfolded
// one within a tolerance, not bit for bit (README, "BatchNorm folding at evaluation").
template <class T>
struct FoldedConv {
  BasicTensor<T> weight;
  BasicTensor<T> bias;
};

namespace detail {
// The folded weight and bias, kept as the weight's derived form and made again whenever the
// weight, the bias or any of the BatchNorm's four tensors has been written since: after a
// training step, set_data or load_checkpoint the next evaluation folds the new values.
template <class T, class Runtime, class Norm>
std::shared_ptr<const FoldedConv<T>> folded_conv(const Runtime* layer, const Norm& norm) {
  const auto& watched = norm.tensors();
  const auto& weight = layer->weight;
  const BasicTensor<T>& bias = layer->bias;
  return weight.template derived<FoldedConv<T>>(
      [&] {
        const index_t out = layer->geometry().out;
        const index_t per_channel = weight.numel() / out;
        const auto affine = norm.evaluation_affine();
        FoldedConv<T> f{BasicTensor<T>::uninitialized(weight.shape()), BasicTensor<T>::uninitialized({out})};
        for (index_t c = 0; c < out; ++c) {
          const T scale = affine.scale[static_cast<std::size_t>(c)];
          const T* w = weight.data() + c * per_channel;
          T* folded = f.weight.data() + c * per_channel;
          for (index_t k = 0; k < per_channel; ++k) folded[k] = w[k] * scale;
          const T b = layer->has_bias() ? bias.data()[c] : T(0);
          f.bias.data()[c] = b * scale + affine.shift[static_cast<std::size_t>(c)];
        }
        return f;
      },
      {&bias, watched[0], watched[1], watched[2], watched[3]});
}

}  // namespace detail

template <class Layer, bool InputGrad>
struct ConvGradOp;
template <class Layer, class Norm, class... Fns>
struct ConvEpilogueOp;

template <class C>
inline constexpr bool is_evaluation_batchnorm_v = false;
template <class Norm>
inline constexpr bool is_evaluation_batchnorm_v<BatchNormOp<Norm, graph::Phase::eval>> = true;

// y = conv(x, weight) + bias (when the layer has one), the layer's.
template <class Layer>
struct ConvOp : Primitive<ConvOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  ConvOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return detail::conv_shape(Layer::static_geometry, in[0]);
  }
  ShapeResult infer(std::span<const Shape> in) const { return detail::conv_shape(layer->geometry(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* bias = layer->has_bias() ? layer->bias.data() : nullptr;
    detail::convolve<Backend>(layer->geometry(), a, layer->weight.data(), bias, std::tuple<>{});
  }

  // At evaluation (passes::fuse_epilogues, in a graph that is not differentiated) it takes the
  // BatchNorm after it, folded into its weight and bias, then elementwise functions.
  template <class C>
  static constexpr bool accepts_epilogue = is_evaluation_batchnorm_v<C> || requires { C::elementwise_functions; };
  template <class Norm>
  auto absorb(const BatchNormOp<Norm, graph::Phase::eval>& next) const {
    return absorb(next.evaluation_norm());
  }
  // PIJit's fusion (trace.hpp), which sees the BatchNorm only through this description.
  auto absorb(const EvaluationNorm<value_type>& norm) const {
    return ConvEpilogueOp<Layer, EvaluationNorm<value_type>>{layer, norm, {}};
  }
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return ConvEpilogueOp<Layer, void, Gs...>{layer, nullptr, next.fns};
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ConvGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return ConvGradOp<Layer, false>{layer}; }

  static std::string op_name() { return Layer::spatial == 2 ? "Conv2d" : "Conv1d"; }
  std::string label() const { return layer->label(); }

  // ONNX: Conv, its padding explicit: SAME's is uneven for some sizes, known from the input's.
  Interchange interchange(std::span<const Shape> in) const {
    return detail::conv_interchange(nn::detail::runtime_form(layer), in);
  }
};

// The gradient of ConvOp from dy and x: dweight, dbias and, if InputGrad, dx. The patches are
// taken from x again rather than kept from the forward pass, which would hold depth times the
// input between the passes.
template <class Layer, bool InputGrad>
struct ConvGradOp : Primitive<ConvGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  ConvGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::conv_gradient<Backend, T>(nn::detail::runtime_form(layer), a, InputGrad);
  }

  static std::string op_name() {
    const std::string name = Layer::spatial == 2 ? "Conv2dGrad" : "Conv1dGrad";
    return InputGrad ? name : name + " (parameters only)";
  }
  std::string label() const { return layer->label(); }
};

// y = Fns(conv(x) + bias) with the BatchNorm after it folded into the convolution (Norm is
// EvaluationNorm<T>, or void: none), the evaluation form that fuse_epilogues makes of (Conv, BatchNorm, functions).
// It has no gradient: only graphs that are not differentiated take it, and training graphs
// keep the BatchNorm's training op, which no convolution absorbs.
template <class Layer, class Norm, class... Fns>
struct ConvEpilogueOp : Primitive<ConvEpilogueOp<Layer, Norm, Fns...>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool differentiable = false;
  static constexpr bool folds = !std::is_void_v<Norm>;

  const Layer* layer;
  std::conditional_t<folds, Norm, std::nullptr_t> norm;
  std::tuple<Fns...> fns;
  ConvEpilogueOp(const Layer* l, decltype(norm) n, std::tuple<Fns...> f) : layer(l), norm(n), fns(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return ConvOp<Layer>::infer_static(in); }
  ShapeResult infer(std::span<const Shape> in) const { return ConvOp<Layer>{layer}.infer(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    if constexpr (folds) {
      // The BatchNorm's own check: a layer switched to training alone is refused, not folded stale.
      PhaseOf<const Norm, graph::Phase::eval>{&norm}.check_phase();
      const std::shared_ptr<const FoldedConv<T>> folded = fold<T>();
      detail::convolve<Backend>(layer->geometry(), a, folded->weight.data(), folded->bias.data(), fns);
    } else {
      const T* bias = layer->has_bias() ? layer->bias.data() : nullptr;
      detail::convolve<Backend>(layer->geometry(), a, layer->weight.data(), bias, fns);
    }
  }

  template <class C>
  static constexpr bool accepts_epilogue = requires { C::elementwise_functions; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return ConvEpilogueOp<Layer, Norm, Fns..., Gs...>{layer, norm, std::tuple_cat(fns, next.fns)};
  }

  static std::string op_name() {
    std::string s = Layer::spatial == 2 ? "Conv2d" : "Conv1d";
    if (folds) s += " + BatchNorm(folded)";
    ((s += " + ", s += Fns::name), ...);
    return s;
  }
  std::string label() const {
    if constexpr (folds) return layer->label() + " + " + norm.label();
    else return layer->label();
  }

 private:
  template <class T>
  std::shared_ptr<const FoldedConv<T>> fold() const {
    return detail::folded_conv<T>(nn::detail::runtime_form(layer), norm);
  }
};

inline const bool conv_listed = list_operations({"Conv2d", "Conv1d"});

}  // namespace ops

namespace nn {

// The initialisers and bias of a convolution whose geometry is in its type.
template <ElementType T>
struct ConvInit {
  bool has_bias = false;
  std::optional<initializer::AnyInitializer<T>> weight_init = std::nullopt;
  std::optional<initializer::AnyInitializer<T>> bias_init = std::nullopt;
};

// MindSpore's arguments after kernel_size, in its order, with its defaults.
template <ElementType T>
struct ConvOptions {
  index_t stride = 1;
  PadMode pad_mode = PadMode::same;
  index_t padding = 0;
  index_t dilation = 1;
  index_t group = 1;
  bool has_bias = false;
  std::optional<initializer::AnyInitializer<T>> weight_init = std::nullopt;
  std::optional<initializer::AnyInitializer<T>> bias_init = std::nullopt;
};

namespace detail {

template <auto Padding>
constexpr PadMode pad_mode_of() {
  if constexpr (std::is_same_v<decltype(Padding), PadMode>) return Padding;
  else return PadMode::pad;
}

template <auto Padding>
constexpr index_t padding_of() {
  if constexpr (std::is_same_v<decltype(Padding), PadMode>) return 0;
  else return static_cast<index_t>(Padding);
}

}  // namespace detail

// How a convolution names itself: "nn::Conv2d<1, 6, 5, 1, 2>" for a compile-time sized one
// (its template arguments up to the last that is not its default; pad_named when Padding is a
// PadMode), "nn::Conv2d<dyn, dyn, dyn>" for a run-time sized one (sized empty).
struct ConvName {
  bool sized = false;
  bool pad_named = false;
};

template <ElementType T>
std::string conv_type_name(const ops::ConvGeometry& g, ConvName form) {
  std::string s = g.spatial == 2 ? "nn::Conv2d<" : "nn::Conv1d<";
  if (form.sized) {
    const std::string arguments[] = {std::to_string(g.in), std::to_string(g.out), std::to_string(g.kernel),
                                     std::to_string(g.stride),
                                     form.pad_named ? "nn::PadMode::" + std::string(name_of(g.pad_mode))
                                                    : std::to_string(g.padding),
                                     std::to_string(g.dilation), std::to_string(g.groups)};
    const bool is_default[] = {false, false, false, g.stride == 1, !form.pad_named && g.padding == 0,
                               g.dilation == 1, g.groups == 1};
    std::size_t shown = std::is_same_v<T, float> ? 3 : 7;
    for (std::size_t i = 3; i < 7; ++i) shown = is_default[i] ? shown : std::max(shown, i + 1);
    for (std::size_t i = 0; i < shown; ++i) s += (i == 0 ? "" : ", ") + arguments[i];
  } else {
    s += "dyn, dyn, dyn";
  }
  if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
  return s + ">";
}

// A run-time sized convolution's sizes, as its constructor and options take them: "1, 6, 5",
// then the settings that are not ConvOptions' defaults ("1, 6, 5, stride=2, pad_mode=pad, padding=2").
inline std::string conv_sizes(const ops::ConvGeometry& g, bool has_bias) {
  std::string s = std::to_string(g.in) + ", " + std::to_string(g.out) + ", " + std::to_string(g.kernel);
  if (g.stride != 1) s += ", stride=" + std::to_string(g.stride);
  if (g.pad_mode != PadMode::same) s += ", pad_mode=" + std::string(name_of(g.pad_mode));
  if (g.padding != 0) s += ", padding=" + std::to_string(g.padding);
  if (g.dilation != 1) s += ", dilation=" + std::to_string(g.dilation);
  if (g.groups != 1) s += ", group=" + std::to_string(g.groups);
  if (has_bias) s += ", has_bias=true";
  return s;
}

// What Conv2d (Spatial = 2, NCHW) and Conv1d (Spatial = 1, NCL) share, sizes and settings held
// as values: nn::Conv2d<> itself, and what a compile-time sized one (SizedConv) runs as outside
// graph capture. Layer is the run-time form deriving from it.
template <class Layer, int Spatial, ElementType T>
class BasicConv : public Cell<Layer, CONTEXT_MODE, T> {
 public:
  using runtime_type = Layer;
  static constexpr int spatial = Spatial;
  static constexpr ops::ConvGeometry static_geometry{Spatial};

  BasicParameter<T> weight;  // [out, in / group, kh, kw] ([out, in / group, k] for Conv1d)
  BasicParameter<T> bias;    // [out], when has_bias

  using Init = ConvInit<T>;
  using Options = ConvOptions<T>;

  // The weight, then the bias, from the global generator (set_seed).
  BasicConv(index_t in_channels, index_t out_channels, index_t kernel_size, Options options = {})
      : BasicConv(in_channels, out_channels, kernel_size, std::move(options), ConvName{}) {}

  const ops::ConvGeometry& geometry() const { return geometry_; }
  index_t in_channels() const { return geometry_.in; }
  index_t out_channels() const { return geometry_.out; }
  bool has_bias() const { return has_bias_; }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::ConvOp<Layer>{static_cast<const Layer*>(this)}, std::forward<X>(x));
  }

  // weight, and bias only if the layer has one: a layer without bias trains and saves no
  // parameter that does nothing.
  void for_each_own_parameter(const typename BasicDynamicCell<T>::ParameterVisitor& visit) override {
    visit("weight", weight);
    if (has_bias_) visit("bias", bias);
  }

  std::string type_name() const override { return conv_type_name<T>(geometry_, name_); }
  std::string extra_repr() const override { return name_.sized ? std::string{} : conv_sizes(geometry_, has_bias_); }

 protected:
  // A compile-time sized convolution's, named as its type.
  BasicConv(index_t in_channels, index_t out_channels, index_t kernel_size, Options options, ConvName name)
      : geometry_{Spatial,           in_channels, out_channels,     kernel_size, options.stride,
                  options.pad_mode,  options.padding, options.dilation, options.group},
        has_bias_(options.has_bias),
        name_(name) {
    validate();
    const index_t fan_in = in_channels / options.group * (Spatial == 2 ? kernel_size * kernel_size : kernel_size);
    const initializer::Uniform mindspore_default{static_cast<double>(T(1) / std::sqrt(static_cast<T>(fan_in)))};
    Shape weight_shape{out_channels, in_channels / options.group, kernel_size};
    if (Spatial == 2) weight_shape.push_back(kernel_size);
    auto weight_value = BasicTensor<T>::uninitialized(weight_shape);
    auto bias_value = BasicTensor<T>::uninitialized({out_channels});
    with_global_generator([&](Generator& gen) {
      initializer::initialize_option(weight_value, options.weight_init.value_or(mindspore_default), gen, type_name(),
                                     "weight_init");
      if (has_bias_) {
        initializer::initialize_option(bias_value, options.bias_init.value_or(mindspore_default), gen, type_name(),
                                       "bias_init");
      }
    });
    weight = BasicParameter<T>(std::move(weight_value));
    if (has_bias_) bias = BasicParameter<T>(std::move(bias_value));
  }

 private:
  void validate() const {
    const ops::ConvGeometry& g = geometry_;
    auto refuse = [&](const std::string& why) { throw ValueError(type_name() + ": " + why); };
    if (g.in <= 0 || g.out <= 0 || g.kernel <= 0) {
      refuse("in_channels, out_channels and kernel_size must be positive, got " + std::to_string(g.in) + ", " +
             std::to_string(g.out) + " and " + std::to_string(g.kernel));
    }
    if (g.stride <= 0 || g.dilation <= 0 || g.groups <= 0) {
      refuse("stride, dilation and group must be positive, got " + std::to_string(g.stride) + ", " +
             std::to_string(g.dilation) + " and " + std::to_string(g.groups));
    }
    if (g.in % g.groups != 0 || g.out % g.groups != 0) {
      refuse("in_channels (" + std::to_string(g.in) + ") and out_channels (" + std::to_string(g.out) +
             ") must be multiples of group (" + std::to_string(g.groups) + ")");
    }
    if (g.padding < 0) refuse("padding must not be negative, got " + std::to_string(g.padding));
    // MindSpore refuses a padding that its pad_mode would ignore.
    if (g.pad_mode != PadMode::pad && g.padding != 0) {
      refuse("padding must be 0 unless pad_mode is \"pad\", got " + std::to_string(g.padding) + " with pad_mode \"" +
             std::string(name_of(g.pad_mode)) + "\"");
    }
  }

  ops::ConvGeometry geometry_;
  bool has_bias_;
  ConvName name_;
};

// A convolution whose sizes and settings are template arguments: Runtime (its run-time form)
// with its geometry in its type as well. Captured into a graph it is ConvOp<Layer>, whose
// static shape rule checks the network while the program compiles; everywhere else it is
// Runtime (SizedLayer).
template <class Layer, class Runtime, index_t In, index_t Out, index_t Kernel, index_t Stride, auto Padding,
          index_t Dilation, index_t Groups>
class SizedConv : public SizedLayer<Layer, Runtime> {
  using T = typename Runtime::value_type;
  static_assert(std::is_same_v<decltype(Padding), PadMode> || std::is_integral_v<decltype(Padding)>,
                "nn::Conv: Padding is a number or nn::PadMode::same / nn::PadMode::valid");
  static_assert(In != dyn && Out != dyn && Kernel != dyn,
                "nn::Conv<>: the run-time sized form takes its sizes and settings from the constructor; give all "
                "of In, Out and Kernel as template arguments, or none");
  static_assert(In > 0 && Out > 0 && Kernel > 0, "nn::Conv: In, Out and Kernel must be positive");
  static_assert(Stride > 0 && Dilation > 0 && Groups > 0, "nn::Conv: Stride, Dilation and Groups must be positive");
  static_assert(detail::padding_of<Padding>() >= 0, "nn::Conv: Padding must not be negative");
  static_assert(In % Groups == 0 && Out % Groups == 0,
                "nn::Conv: In and Out must be multiples of Groups (depthwise: Groups = In)");
  static constexpr ConvName name{true, std::is_same_v<decltype(Padding), PadMode>};

 public:
  static constexpr ops::ConvGeometry static_geometry{Runtime::spatial,
                                                     In,
                                                     Out,
                                                     Kernel,
                                                     Stride,
                                                     detail::pad_mode_of<Padding>(),
                                                     detail::padding_of<Padding>(),
                                                     Dilation,
                                                     Groups};
  using typename Runtime::Init;
  using typename Runtime::Options;

  // nn::Conv2d<1, 6, 5, 1, 2> conv{{.has_bias = true}};
  explicit SizedConv(Init init = {})
      : SizedLayer<Layer, Runtime>(In, Out, Kernel,
                                   Options{Stride, static_geometry.pad_mode, static_geometry.padding, Dilation, Groups,
                                           init.has_bias, std::move(init.weight_init), std::move(init.bias_init)},
                                   name) {}

  // The run-time form's constructor, for sizes and settings that must be the type's.
  SizedConv(index_t in_channels, index_t out_channels, index_t kernel_size, Options options = {})
      : SizedLayer<Layer, Runtime>(checked(in_channels, out_channels, kernel_size, options), out_channels, kernel_size,
                                   std::move(options), name) {}

  template <graph::Symbolic S>
  auto sized_construct(const S& x) {
    return apply(ops::ConvOp<Layer>{static_cast<const Layer*>(this)}, x);
  }

 private:
  static index_t checked(index_t in, index_t out, index_t kernel, const Options& o) {
    const std::string type = conv_type_name<T>(static_geometry, name);
    if (in != In || out != Out || kernel != Kernel) {
      throw ValueError(type + ": cannot be built with in_channels " + std::to_string(in) + ", out_channels " +
                       std::to_string(out) + " and kernel_size " + std::to_string(kernel));
    }
    const ops::ConvGeometry& g = static_geometry;
    // "valid" is "pad" with no padding: the same geometry.
    const auto unpadded = [](PadMode mode, index_t padding) {
      return mode == PadMode::valid || (mode == PadMode::pad && padding == 0);
    };
    const bool same_padding = (o.pad_mode == g.pad_mode && o.padding == g.padding) ||
                              (unpadded(o.pad_mode, o.padding) && unpadded(g.pad_mode, g.padding));
    if (o.stride != g.stride || !same_padding || o.dilation != g.dilation || o.group != g.groups) {
      const auto settings = [](index_t stride, PadMode mode, index_t padding, index_t dilation, index_t group) {
        return "stride " + std::to_string(stride) + ", pad_mode \"" + std::string(name_of(mode)) + "\", padding " +
               std::to_string(padding) + ", dilation " + std::to_string(dilation) + " and group " +
               std::to_string(group);
      };
      throw ValueError(type + ": its type fixes " + settings(g.stride, g.pad_mode, g.padding, g.dilation, g.groups) +
                       ", got " + settings(o.stride, o.pad_mode, o.padding, o.dilation, o.group) +
                       " (the run-time options' defaults include pad_mode \"same\"); give only has_bias and the "
                       "initialisers: " + type + "{{.has_bias = true}}");
    }
    return in;
  }
};

// Conv2d<> and Conv1d<> (every argument but T left at its default) are the run-time forms.
template <int Spatial, index_t In, index_t Out, index_t Kernel, index_t Stride, auto Padding, index_t Dilation,
          index_t Groups, ElementType T, class Layer, class Runtime>
using conv_base = std::conditional_t<
    In == dyn && Out == dyn && Kernel == dyn && Stride == 1 && std::is_same_v<decltype(Padding), int> &&
        detail::padding_of<Padding>() == 0 && Dilation == 1 && Groups == 1,
    BasicConv<Layer, Spatial, T>, SizedConv<Layer, Runtime, In, Out, Kernel, Stride, Padding, Dilation, Groups>>;

template <index_t In = dyn, index_t Out = dyn, index_t Kernel = dyn, index_t Stride = 1, auto Padding = 0,
          index_t Dilation = 1, index_t Groups = 1, ElementType T = float>
class Conv2d : public conv_base<2, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                                Conv2d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>,
                                Conv2d<dyn, dyn, dyn, 1, 0, 1, 1, T>> {
  using Base = conv_base<2, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                         Conv2d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>, Conv2d<dyn, dyn, dyn, 1, 0, 1, 1, T>>;

 public:
  using Base::Base;
};

template <index_t In = dyn, index_t Out = dyn, index_t Kernel = dyn, index_t Stride = 1, auto Padding = 0,
          index_t Dilation = 1, index_t Groups = 1, ElementType T = float>
class Conv1d : public conv_base<1, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                                Conv1d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>,
                                Conv1d<dyn, dyn, dyn, 1, 0, 1, 1, T>> {
  using Base = conv_base<1, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                         Conv1d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>, Conv1d<dyn, dyn, dyn, 1, 0, 1, 1, T>>;

 public:
  using Base::Base;
};

}  // namespace nn
}  // namespace duet
