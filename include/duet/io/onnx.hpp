// ONNX models: duet::io::load_onnx(path) builds a network at run time from a model that
// torch.onnx.export (or any exporter) wrote, at opsets 13 to 17; duet::io::export_onnx(net,
// input_shape, path) writes a duet network as one (at the end of this file).
//
// The file is parsed by the official ONNX library's protobuf classes (Debian's libonnx-dev), so
// this header is not part of <duet/duet.hpp>: include <duet/io/onnx.hpp> and link the CMake
// target duet::onnx, which exists when CMake finds ONNX and holds the loader compiled once
// (below OnnxModel). Users who do not include it need neither ONNX nor protobuf.
//
// The network is an io::OnnxModel, a DynamicCell whose forward runs the graph's nodes, in the
// file's (topological) order, as duet's own operations: a Gemm is ops::matmul and ops::add, a
// Conv duet's convolution, and so on. So it runs in PyNative mode and, like any network built
// at run time, in graph mode (traced on its first call and replayed), with the same bits in
// both. The initializers of floating type are its parameters, under their ONNX names
// ("fc1.weight", "onnx::Conv_123"), so they train (TrainOneStepCell, value_and_grad), print in
// duet::summary, and load and save with checkpoints and safetensors. BatchNormalization's mean
// and variance are parameters with requires_grad = false, as duet's BatchNorm keeps its moving
// statistics; integer initializers (Reshape's target shape) and Constant nodes are constants.
//
// The operators (ONNX's names; what duet runs):
//   Gemm (alpha, beta, transA, transB), MatMul     ops::matmul (+ ops::add, scalar products)
//   Add, Sub, Mul, Div, Pow; Max, Min of two       ops::add, sub, mul, div, pow, maximum,
//                                                  minimum (numpy broadcasting)
//   Exp, Log, Sqrt, Abs, Neg, Reciprocal,          ops::exp, log, sqrt, abs, neg, 1 / x,
//   Softplus, Sin, Cos                             softplus, sin, cos
//   Clip (constant bounds)                         ops::clip_by_value
//   Slice (constant starts, ends, axes, steps)     ops::strided_slice
//   Relu, Sigmoid, Tanh, Softmax, LogSoftmax       ops::relu, sigmoid, tanh, softmax, log_softmax
//   LeakyRelu, Elu (alpha >= 0)                    ops::leaky_relu, elu
//   Div, Erf, Add, Mul, Mul (torch's GELU below    ops::gelu (erf form), when the five nodes are
//   opset 20: x * (erf(x / sqrt 2) + 1) * 0.5)     exactly that pattern; any other Erf is ops::erf
//   Conv (1-D, or 2-D with square kernels; one     duet's convolution (ops::ConvOp), as
//   stride, one dilation, symmetric pads below    nn::Conv1d and nn::Conv2d
//   the window's extent or SAME_UPPER/VALID,
//   group)
//   MaxPool, AveragePool (2-D windows of any       ops::max_pool2d, avg_pool2d over a window
//   kernel and stride, each axis padded alike on   given at run time (ops::Pool2dListOp: one
//   both sides or SAME_UPPER; no dilation, no      operation for every window)
//   ceil_mode)
//   Pad (zeros) before an AveragePool              that pooling counting its padding (torch's
//                                                  AvgPool2d(count_include_pad=True)); a Pad of
//                                                  nothing is the identity; other Pads are refused
//   GlobalAveragePool                              ops::adaptive_avg_pool2d<1>
//   BatchNormalization (inference)                 (x - mean) * scale / sqrt(var + eps) + B
//   LayerNormalization (opset 17, any axis)        the same over the axes from `axis` on, with
//                                                  their own mean and variance (nn::LayerNorm's
//                                                  arithmetic, in ops)
//   Flatten, Reshape                               views; Reshape's target a constant or made by
//   Shape (start, end), Gather, Unsqueeze,         shape arithmetic on int64s, as torch writes
//   Squeeze, Cast, Concat, Add, Sub, Mul, Div     x.view(x.size(0), -1) or an attention's heads:
//   of int64s                                      no step, the sizes are computed from the
//                                                  values' shapes as Reshape (or Slice) runs
//   Slice (constant axes and steps; starts and     ops::strided_slice
//   ends constant or shape arithmetic's)
//   Transpose (rank <= 8), Concat (rank <= 4)      ops::transpose(x, perm), ops::concat<Axis>
//   ReduceSum, ReduceMean, ReduceMax, ReduceMin,   ops::sum, mean, max, min, prod (axes at run
//   ReduceProd                                     time)
//   Tile (constant repeats)                        ops::tile(x, repeats)
//   GRU (linear_before_reset 1), LSTM: forward,    nn::GRU's and nn::LSTM's operation, their
//   sequence-major, default activations, no        weights rearranged into PyTorch's layout
//   sequence_lens or peepholes                     (prepare_recurrence)
//   ConstantOfShape (float), Expand                a tensor of the value; x + zeros of the
//                                                  shape (numpy's broadcast); the shape a
//                                                  constant or computed from the batch's size
//   Identity, Dropout (inference), Constant        no operation
//   Gather by the graph's input of int32 or int64  ops::gather<0>, as nn::Embedding looks its
//   token ids, axis 0 (torch's nn.Embedding)      table up: the model then takes int32 ids
//                                                  (or int64 ones that fit int32), net(ids)
//   Range(start, limit, delta) of int64 sizes      positions computed as the model runs, looked
//   (constants, or read from a Shape, of the ids   up as ops::gather<0> of the table: torch's
//   too), then Gather along axis 0, through Casts  torch.arange(ids.size(1)) and duet's
//   to int32 or int64 if any                       ops::positions into a positional embedding
// Anything else, and any attribute or setting the list does not cover, is a duet::ValueError
// when the file is loaded, naming the node, its operator and what is not supported. A file that
// is not a well-formed model (not protobuf, a node reading a name nothing defines, an
// initializer whose data does not fit its shape, more than one input or output) is a
// duet::FormatError naming what and where; nothing is allocated from a size the file states
// before the data is checked to be there.
#pragma once

#include <onnx/onnx_pb.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../duet.hpp"

namespace duet::io {

namespace detail {

// A view with a target shape chosen at run time: ONNX's Reshape (0 keeps the input's size,
// -1 is inferred) and Flatten(axis). duet's reshape<D...> takes its sizes as template
// arguments, which a model read at run time cannot give; the gradient is the same view back.
// An element of an int64 tensor that shape arithmetic made (torch writes x.view(x.size(0), -1)
// as Shape, Gather, Unsqueeze, Concat and Reshape): a constant, the size of one dimension of a
// value, known only when the network runs (the batch), or the sum, difference, product or
// quotient of two such (torch computes an attention head's size as the input's last size / heads).
struct OnnxSize {
  std::int64_t constant = 0;
  std::size_t value = 0;  // the value whose dimension it is, when sized
  std::optional<int> axis = {};  // that dimension (negative from the back); none for a constant
  char op = 0;                   // '+', '-', '*' or '/' of lhs and rhs; 0 for a constant or a dimension
  std::shared_ptr<const OnnxSize> lhs = {}, rhs = {};
  int terms = 1;  // the constants, dimensions and operations in it, bounded so that it is cheap to compute

  bool known() const { return op == 0 && !axis; }
};

// ONNX's Add, Sub, Mul and Div of int64s (Div truncating, as C++'s), or none for a division by
// zero or a result past int64.
inline std::optional<std::int64_t> onnx_arithmetic(char op, std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  switch (op) {
    case '+':
      return __builtin_add_overflow(a, b, &r) ? std::nullopt : std::optional(r);
    case '-':
      return __builtin_sub_overflow(a, b, &r) ? std::nullopt : std::optional(r);
    case '*':
      return __builtin_mul_overflow(a, b, &r) ? std::nullopt : std::optional(r);
    default:
      if (b == 0 || (a == std::numeric_limits<std::int64_t>::min() && b == -1)) return std::nullopt;
      return a / b;
  }
}

// The element's value, from the values' shapes now (shape_of(v): value v's).
template <class ShapeOf>
std::int64_t onnx_size_now(const OnnxSize& e, const ShapeOf& shape_of) {
  if (e.known()) return e.constant;
  if (e.axis) {
    const Shape& shape = shape_of(e.value);
    if (*e.axis < -shape.rank() || *e.axis >= shape.rank()) {
      throw ShapeError("a Gather of dimension " + std::to_string(*e.axis) + " of a Shape of " + to_string(shape));
    }
    return shape[*e.axis];
  }
  const std::int64_t a = onnx_size_now(*e.lhs, shape_of);
  const std::int64_t b = onnx_size_now(*e.rhs, shape_of);
  const std::optional<std::int64_t> r = onnx_arithmetic(e.op, a, b);
  if (!r) {
    throw ShapeError("shape arithmetic " + std::to_string(a) + " " + e.op + " " + std::to_string(b) +
                     (e.op == '/' ? " divides by zero or overflows int64" : " overflows int64"));
  }
  return *r;
}

// Such a tensor, flat (the rank-0 and rank-1 tensors of shape arithmetic), or the whole shape of
// a value, whose length is that value's rank.
struct OnnxSizes {
  std::vector<OnnxSize> elements;
  std::optional<std::size_t> shape_of;
};

// Range(start, limit, delta) of such sizes: a sequence's positions (torch.arange(ids.size(1)),
// duet's ops::positions), computed when the network runs.
struct OnnxRange {
  std::array<OnnxSize, 3> bounds;  // start, limit, delta
};

struct OnnxReshapeOp : ops::Primitive<OnnxReshapeOp> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  std::vector<std::int64_t> dims;  // Reshape's target; empty for Flatten
  int flatten_axis = -1;           // Flatten's axis, or -1
  std::string who;

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape> in) const {
    const Shape& x = in[0];
    Shape to;
    if (flatten_axis >= 0) {
      if (flatten_axis > x.rank()) return fault(x, ShapeFault::min_rank, flatten_axis);
      index_t outer = 1;
      for (int i = 0; i < flatten_axis; ++i) outer *= x[i];
      to = Shape{outer, x.numel() / std::max<index_t>(outer, 1)};
      if (outer == 0) to = Shape{0, x.numel_from(flatten_axis)};
      return {to};
    }
    index_t known = 1;
    for (std::size_t i = 0; i < dims.size(); ++i) {
      const std::int64_t d = dims[i];
      if (d == 0 && static_cast<int>(i) >= x.rank()) return fault(x, ShapeFault::min_rank, static_cast<int>(i) + 1);
      to.push_back(d == 0 ? x[static_cast<int>(i)] : d == -1 ? dyn : static_cast<index_t>(d));
      // A file's sizes can be any int64: a product past index_t's range fits no input.
      if (to[-1] != dyn && __builtin_mul_overflow(known, to[-1], &known)) {
        return fault(x, ShapeFault::total_elements, std::numeric_limits<index_t>::max());
      }
    }
    return ops::reshape_rule(x, to);
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ops::ReshapeLikeOp{};
  }

  static std::string op_name() { return "Reshape"; }
  std::string label() const { return who; }
};

// The operators load_onnx reads, some only in a pattern or with some inputs (Shape and Cast in
// shape arithmetic, Gather there or of one constant index), which their own errors then say. A model's other operators
// are all named at once, before anything is built. tests/io_onnx.cpp checks the list against OnnxBuilder::add_node.
// (Unformatted: clang-format 14 would put one name on each line.)
// clang-format off
inline constexpr auto onnx_operators = std::to_array<std::string_view>({
    "Abs", "Add", "AveragePool", "BatchNormalization", "Cast", "Clip", "Concat", "Constant", "ConstantOfShape", "Conv",
    "Cos", "Div", "Dropout", "Elu", "Erf", "Exp", "Expand", "Flatten", "GRU", "Gather", "Gemm", "GlobalAveragePool",
    "Identity", "LSTM", "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "MatMul", "Max", "MaxPool", "Min",
    "Mul", "Neg", "Pad", "Pow", "Range", "Reciprocal", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
    "Relu", "Reshape", "Shape", "Sigmoid", "Sin", "Slice", "Softmax", "Softplus", "Sqrt", "Squeeze", "Sub", "Tanh",
    "Tile", "Transpose", "Unsqueeze"});
// clang-format on

// Conv's settings and parameters in the form duet's ConvOp reads from its layer.
template <int Spatial>
struct OnnxConv {
  using value_type = float;
  static constexpr int spatial = Spatial;
  static constexpr ops::ConvGeometry static_geometry{Spatial};

  ops::ConvGeometry g;
  const nn::Parameter& weight;
  const nn::Parameter& bias;  // the weight itself when there is none: has_bias() says which
  bool with_bias = false;
  std::string who;

  const ops::ConvGeometry& geometry() const { return g; }
  bool has_bias() const { return with_bias; }
  std::string label() const { return who; }
};

// A GRU's or LSTM's parameters in the form ops::RecurrentOp reads from nn::GRU and nn::LSTM:
// PyTorch's layout and gate order.
template <class Step>
struct OnnxRecurrent {
  using value_type = float;
  using cell_type = Step;
  static constexpr index_t input_static = dyn;
  static constexpr index_t hidden_static = dyn;

  const nn::Parameter& weight_ih_l0;  // [gates * hidden, input]
  const nn::Parameter& weight_hh_l0;  // [gates * hidden, hidden]
  const nn::Parameter& bias_ih_l0;    // [gates * hidden]
  const nn::Parameter& bias_hh_l0;
  index_t input = 0;
  index_t hidden = 0;
  std::string who;

  index_t input_size() const { return input; }
  index_t hidden_size() const { return hidden; }
  std::string label() const { return who; }
};

// A recurrence's values between ONNX's layout and duet's, with the operations the loader has
// already instantiated for Transpose and Reshape (their fixed-axis forms took g++ -O2 building
// run_onnx.cpp from 2.08 to 2.14 GB, over 2 GiB): [A, B, H] <-> [B, A, H], and a view.
inline Tensor onnx_swap_leading(const Tensor& t) { return ops::transpose(t, std::vector<int>{1, 0, 2}); }
inline Tensor onnx_view(const Tensor& t, std::vector<std::int64_t> dims) {
  if (t.numel() == 0) throw ShapeError("a recurrence of an empty batch, shape " + to_string(t.shape()));
  OnnxReshapeOp view;  // (a size 0 in dims would mean the input's own: none here)
  view.dims = std::move(dims);
  return apply(view, t);
}

// The last of a recurrence's steps [L, ...] (L at least 1, as the recurrence checks), the axis
// kept: [1, ...].
inline Tensor onnx_last_step(const Tensor& steps) {
  const index_t length = steps.dim(0);
  const std::array<index_t, 1> begin{length - 1};
  const std::array<index_t, 1> end{length};
  const std::array<index_t, 1> stride{1};
  return ops::strided_slice(steps, std::span(begin), std::span(end), std::span(stride));
}

template <class A, class B>
Tensor onnx_concat(const A& a, const B& b, int axis) {
  switch (axis) {
    case 0: return ops::concat<0>(a, b);
    case 1: return ops::concat<1>(a, b);
    case 2: return ops::concat<2>(a, b);
    default: return ops::concat<3>(a, b);
  }
}

inline std::string onnx_quoted(const std::string& s) { return "'" + s + "'"; }

// The tensor's elements as T, checked against its shape; external data is refused.
template <class T>
std::vector<T> onnx_elements(const onnx::TensorProto& t, const std::string& what, index_t count, const std::string& where) {
  if (t.data_location() == onnx::TensorProto::EXTERNAL) {
    throw ValueError(where + ": " + what + " keeps its data in an external file, which duet does not read");
  }
  std::vector<T> out;
  if (t.has_raw_data()) {
    const std::string& raw = t.raw_data();
    if (raw.size() != static_cast<std::size_t>(count) * sizeof(T)) {
      throw FormatError(where + ": " + what + " has " + std::to_string(raw.size()) + " bytes of data, its shape needs " +
                        std::to_string(static_cast<std::size_t>(count) * sizeof(T)));
    }
    out.resize(static_cast<std::size_t>(count));
    // An empty tensor's vector has no storage: memcpy from or to a null pointer is undefined
    // even for 0 bytes.
    if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
    return out;
  }
  const auto take = [&](const auto& field) {
    if (field.size() != count) {
      throw FormatError(where + ": " + what + " has " + std::to_string(field.size()) + " elements, its shape needs " +
                        std::to_string(count));
    }
    out.assign(field.begin(), field.end());
  };
  if constexpr (std::is_same_v<T, float>) take(t.float_data());
  else take(t.int64_data());
  return out;
}

// The tensor's shape; a size no file could hold data for is refused before anything is read.
inline Shape onnx_shape(const onnx::TensorProto& t, const std::string& what, const std::string& where) {
  if (t.dims_size() > max_rank) {
    throw ValueError(where + ": " + what + " has rank " + std::to_string(t.dims_size()) + ", above duet's " +
                     std::to_string(max_rank));
  }
  Shape s;
  index_t n = 1;
  for (const std::int64_t d : t.dims()) {
    if (d < 0 || d > (std::int64_t{1} << 40) || (d > 0 && n > (std::int64_t{1} << 40) / d)) {
      throw FormatError(where + ": " + what + " has a dimension of " + std::to_string(d) + ", which no data fits");
    }
    n *= d;
    s.push_back(static_cast<index_t>(d));
  }
  return s;
}

// Parses the bytes of an ONNX file; `where` names them in errors.
inline onnx::ModelProto parse_onnx(std::span<const std::byte> bytes, const std::string& where) {
  if (bytes.size() > static_cast<std::size_t>(INT_MAX)) throw FormatError(where + ": larger than protobuf's 2 GB limit");
  onnx::ModelProto proto;
  if (!proto.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    throw FormatError(where + ": not an ONNX model (the protobuf message does not parse)");
  }
  if (!proto.has_graph()) throw FormatError(where + ": the model has no graph");
  return proto;
}

inline std::string onnx_where(const std::filesystem::path& path) { return "ONNX file " + path.string(); }


}  // namespace detail

// A network read from an ONNX file (load_onnx). Its forward runs the graph's nodes in order.
// A model whose input is int32 or int64 token ids (torch.onnx.export of an nn.Embedding: a
// Gather from the table by the ids) takes int32 ids, as a DynamicSequentialCell that begins
// with an nn::Embedding does (other_input_type() is "Int32"), or int64 ids, each of which
// must fit int32.
class OnnxModel : public nn::DynamicCell {
 public:
  using nn::DynamicCell::operator();
  // int64 ids (torch's habit) as int32: one outside int32's range is a duet::IndexError naming
  // it, never narrowed; below 0 or past the table, the Gather's own IndexError.
  Tensor operator()(const BasicTensor<std::int64_t>& ids) {
    BasicTensor<std::int32_t> narrow = BasicTensor<std::int32_t>::uninitialized(ids.shape());
    for (index_t i = 0; i < ids.numel(); ++i) {
      const std::int64_t id = ids.data()[i];
      if (id < std::numeric_limits<std::int32_t>::min() || id > std::numeric_limits<std::int32_t>::max()) {
        throw IndexError(label() + ": token id " + std::to_string(id) + " (element " + std::to_string(i) +
                         " of the int64 ids) does not fit int32, which duet's indices are");
      }
      narrow.data()[i] = static_cast<std::int32_t>(id);
    }
    return (*this)(narrow);
  }

  std::string type_name() const override { return "io::OnnxModel"; }
  // print(model): the input as the file declares it and the steps it runs,
  // io::OnnxModel('input' [batch, length], 6 steps); operators() lists them.
  std::string extra_repr() const override {
    return declared_input_ + ", " + std::to_string(operators_.size()) + (operators_.size() == 1 ? " step" : " steps");
  }
  std::string_view other_input_type() const override { return ids_input_ ? name_of(DType::int32) : std::string_view{}; }

  void for_each_own_parameter(const ParameterVisitor& visit) override {
    for (std::size_t i = 0; i < parameters_.size(); ++i) visit(parameter_names_[i], *parameters_[i]);
  }

  bool never_trains(const nn::Parameter& p) const override { return std::ranges::find(statistics_, &p) != statistics_.end(); }

  // The ONNX operators of the model's steps, in order (a GELU pattern is one "Gelu").
  const std::vector<std::string>& operators() const { return operators_; }
  // The input's shape as the file declares it: -1 for a dimension it names rather than sizes
  // (torch.onnx.export's dynamic_axes, the batch), empty when it declares none.
  const std::vector<std::int64_t>& input_dims() const { return input_dims_; }

 protected:
  Tensor forward(const Tensor& x) override {
    if (ids_input_) {
      throw ValueError(label() + " takes int32 indices (the model's input " + declared_input_ +
                       " holds token ids), got a tensor of " + std::string(name_of(DType::float32)));
    }
    return run_steps(x, {});
  }
  Tensor forward_ids(const BasicTensor<std::int32_t>& ids) override {
    if (!ids_input_) return nn::DynamicCell::forward_ids(ids);
    return run_steps({}, ids);
  }

 private:
  friend class OnnxBuilder;

  // The steps on x, or on ids for a model of token ids (value 0 then empty).
  Tensor run_steps(const Tensor& x, const BasicTensor<std::int32_t>& ids) const {
    check_input_shape(ids_input_ ? ids.shape() : x.shape());
    std::vector<Tensor> values(value_count_);
    values[0] = x;
    for (const Step& step : steps_) {
      // A trace's steps of the node name it too when a replay of them fails.
      const pijit::TracedLocation here(step.who);
      try {
        values[step.output] = step.on_ids ? step.on_ids(*this, values, ids) : step.run(*this, values);
      } catch (const Error&) {
        rethrow_at(step.who);  // a layer the step made under the node's name already names it
      }
    }
    return values[output_];
  }

  // Where a node's operand lives: a value the forward pass computes, a parameter, a constant.
  struct Operand {
    enum class Kind : unsigned char { value, parameter, constant } kind = Kind::value;
    std::size_t index = 0;
  };
  struct Step {
    std::function<Tensor(const OnnxModel&, std::vector<Tensor>&)> run;
    std::size_t output = 0;
    std::string who;
    // Instead of run, for a step that reads the token ids (a Gather by them).
    std::function<Tensor(const OnnxModel&, const std::vector<Tensor>&, const BasicTensor<std::int32_t>&)> on_ids = {};
  };

  // The target a Reshape computed by shape arithmetic reads, from the values' shapes now.
  static std::vector<std::int64_t> resolve(const detail::OnnxSizes& sizes, const std::vector<Tensor>& values) {
    if (sizes.shape_of) {
      const Shape& shape = values[*sizes.shape_of].shape();
      return {shape.begin(), shape.end()};
    }
    std::vector<std::int64_t> dims;
    for (const detail::OnnxSize& e : sizes.elements) {
      dims.push_back(detail::onnx_size_now(e, [&](std::size_t v) -> const Shape& { return values[v].shape(); }));
    }
    return dims;
  }
  // The positions a Range gives now, as int32 indices; a size of value 0 in a model of token
  // ids is one of the ids'. ONNX's length, max(ceil((limit - start) / delta), 0), at most
  // `rows` (the table they index, beyond which one would be out of range anyway).
  BasicTensor<std::int32_t> positions_now(const detail::OnnxRange& r, const std::vector<Tensor>& values,
                                          const BasicTensor<std::int32_t>& ids, index_t rows) const {
    std::array<std::int64_t, 3> b{};
    for (std::size_t i = 0; i < 3; ++i) {
      b[i] = detail::onnx_size_now(r.bounds[i], [&](std::size_t v) -> const Shape& {
        return ids_input_ && v == 0 ? ids.shape() : values[v].shape();
      });
    }
    const auto [start, limit, delta] = b;
    if (delta == 0) throw ValueError("a Range with delta 0");
    // In double: limit - start can overflow int64, and the length is bounded just below.
    const double length = std::max(
        std::ceil((static_cast<double>(limit) - static_cast<double>(start)) / static_cast<double>(delta)), 0.0);
    if (length > static_cast<double>(rows)) {
      throw IndexError("a Range(" + std::to_string(start) + ", " + std::to_string(limit) + ", " +
                       std::to_string(delta) + ") of more positions than the " + std::to_string(rows) +
                       " rows it indexes");
    }
    auto positions = BasicTensor<std::int32_t>::uninitialized(Shape{static_cast<index_t>(length)});
    for (index_t i = 0; i < positions.numel(); ++i) {
      std::int64_t p = 0;
      const bool beyond = __builtin_mul_overflow(i, delta, &p) || __builtin_add_overflow(start, p, &p);
      if (beyond || p < 0 || p >= rows) {
        throw IndexError("position " + (beyond ? std::string("beyond int64") : std::to_string(p)) + " (element " +
                         std::to_string(i) + " of a Range(" + std::to_string(start) + ", " + std::to_string(limit) +
                         ", " + std::to_string(delta) + ")) is out of range [0, " + std::to_string(rows) + ")");
      }
      positions.data()[i] = static_cast<std::int32_t>(p);
    }
    return positions;
  }

  // As onnxruntime does, the input must have the shape the file declares, any size where it
  // names a dimension: otherwise a Flatten or a broadcast can make a wrong input run (a
  // [4, 784] batch through a model exported for [batch, 1, 28, 28]).
  void check_input_shape(const Shape& shape) const override {
    if (input_dims_.empty()) return;
    if (static_cast<std::size_t>(shape.rank()) != input_dims_.size()) throw wrong_input(shape, "");
    for (int i = 0; i < shape.rank(); ++i) {
      const std::int64_t want = input_dims_[static_cast<std::size_t>(i)];
      if (want >= 0 && want != shape[i]) {
        // torch.onnx.export fixes every size it is not told is dynamic, the batch too, as
        // duet::io::export_onnx does.
        throw wrong_input(shape, i == 0 ? " (a model exported with dynamic_axes={'input': {0: 'batch'}} by torch, or "
                                          "{.dynamic_batch = true} by duet::io::export_onnx, takes any batch)"
                                        : "");
      }
    }
  }
  ShapeError wrong_input(const Shape& shape, const std::string& hint) const {
    return ShapeError("io::OnnxModel: the model's input " + declared_input_ + ", as the file declares it, got " +
                      to_string(shape) + hint);
  }

  // f(operand): a parameter as the tensor an operation on it reads (the recording tape's leaf
  // for it, whose gradient goes to the parameter; its own storage, which a trace replays), so
  // that each step's operations are compiled for Tensor alone. Passed as nn::Parameter, they
  // ran the same, compiled again for each mix of operand types (nn::ParameterResult).
  template <class F>
  Tensor with(const Operand& o, const std::vector<Tensor>& values, F&& f) const {
    switch (o.kind) {
      case Operand::Kind::parameter:
        return f(duet::detail::eager_operand(static_cast<const nn::Parameter&>(*parameters_[o.index])));
      case Operand::Kind::constant: return f(constants_[o.index]);
      default: return f(values[o.index]);
    }
  }
  template <class F>
  Tensor with(const Operand& a, const Operand& b, const std::vector<Tensor>& values, F&& f) const {
    return with(a, values, [&](const auto& x) { return with(b, values, [&](const auto& y) { return f(x, y); }); });
  }

  std::vector<std::unique_ptr<nn::Parameter>> parameters_;
  std::vector<std::string> parameter_names_;
  std::vector<const nn::Parameter*> statistics_;  // BatchNormalization's mean and variance, never trained
  std::vector<Tensor> constants_;
  std::vector<std::unique_ptr<detail::OnnxConv<1>>> convs1d_;
  std::vector<std::unique_ptr<detail::OnnxConv<2>>> convs2d_;
  std::vector<std::unique_ptr<detail::OnnxRecurrent<ops::detail::GRUCell>>> grus_;
  std::vector<std::unique_ptr<detail::OnnxRecurrent<ops::detail::LSTMCell>>> lstms_;
  std::vector<Step> steps_;
  std::vector<std::string> operators_;
  std::vector<std::int64_t> input_dims_;
  std::string declared_input_;  // "'input' [batch, 1, 28, 28]", for the error below
  bool ids_input_ = false;      // the input is token ids (int32 or int64 in the file)
  std::size_t value_count_ = 1;  // value 0 is the input
  std::size_t output_ = 0;
};

// The loader (the class that builds an OnnxModel, about 1,700 lines that instantiate most of
// duet's operations) is compiled once where a program links CMake's duet::onnx: that target
// defines DUET_ONNX_LIBRARY for the program's files, which then see only the declarations
// below, and compiles detail/onnx_import.hpp in a file of its own (issue 16: it was most of a
// loading program's compile time). Without the macro the definitions are inline here.
#if defined(DUET_ONNX_LIBRARY) || defined(DUET_DEFINE_ONNX_LIBRARY)
#define DUET_DETAIL_ONNX_INLINE
#else
#define DUET_DETAIL_ONNX_INLINE inline
#endif

// The model in the bytes of an ONNX file; `where` names them in errors.
DUET_DETAIL_ONNX_INLINE OnnxModel load_onnx_bytes(std::span<const std::byte> bytes,
                                                  const std::string& where = "ONNX data");

// Reads an ONNX model file into a network duet runs in either mode (see the top of this file).
DUET_DETAIL_ONNX_INLINE OnnxModel load_onnx(const std::filesystem::path& path);

// Copies the float initializers of an ONNX file into a network defined in C++ (any cell, in
// either mode: a compile-time Cell such as examples/lenet5.hpp's LeNet5), each parameter from
// the initializer of its own name ("fc1.weight", as torch.onnx.export names a module's weight),
// or of the name `name_map` gives for it (network's name -> initializer's name: duet's BatchNorm
// "bn.gamma" from PyTorch's "bn.weight"). All or nothing: every parameter must find an
// initializer of its shape, or nothing is copied and a duet::FormatError names the first that
// does not (with both shapes); a name_map entry for no parameter of the network is a
// duet::ValueError. Returns, in ckpt_not_load, the float initializers that were not used.
DUET_DETAIL_ONNX_INLINE CheckpointLoad load_onnx_weights(const std::filesystem::path& path, nn::DynamicCell& net,
                                                         const std::map<std::string, std::string>& name_map = {});

namespace detail {
// What export_onnx traces a network on: its values' type, or the index type it declares.
template <class Net, class T>
struct ExportInput {
  using type = T;
};
template <class Net, class T>
  requires requires { typename Net::input_value_type; }
struct ExportInput<Net, T> {
  using type = typename Net::input_value_type;
};
}  // namespace detail

// What export_onnx writes beside the graph.
struct OnnxExportOptions {
  // Axis 0 of the input and the output is named "batch" rather than sized, so that the model
  // takes any batch (torch.onnx.export's dynamic_axes). The graph must then not fix the batch
  // itself (a Reshape to a static shape); Flatten and the layers do not.
  bool dynamic_batch = false;
  // Other input axes named rather than sized, by axis ({{1, "length"}}: a sequence model of
  // any length). export_onnx runs the network again with each such axis one longer: an axis
  // the network fixes (ops::reshape<-1, 8, 4, 4>) is a duet::ValueError, and the output's axes
  // that follow it get its name.
  std::map<int, std::string> dynamic_axes = {};
  std::string graph_name = "duet";
};

namespace detail {

constexpr int onnx_type(DType t) { return static_cast<int>(ops::onnx_type_code(t)); }
static_assert(onnx_type(DType::float32) == onnx::TensorProto::FLOAT && onnx_type(DType::float64) == onnx::TensorProto::DOUBLE &&
              onnx_type(DType::int32) == onnx::TensorProto::INT32 && onnx_type(DType::int64) == onnx::TensorProto::INT64 &&
              onnx_type(DType::uint8) == onnx::TensorProto::UINT8 && ops::onnx_bool_code == onnx::TensorProto::BOOL);

// v in element type `type`, as the bytes an initializer holds.
inline std::vector<char> number_bytes(double v, DType type) {
  std::vector<char> bytes(size_of(type));
  const auto put = [&](auto x) { std::memcpy(bytes.data(), &x, sizeof x); };
  switch (type) {
    case DType::float32: put(static_cast<float>(v)); break;
    case DType::float64: put(v); break;
    case DType::int32: put(static_cast<std::int32_t>(v)); break;
    case DType::int64: put(static_cast<std::int64_t>(v)); break;
    case DType::uint8: put(static_cast<std::uint8_t>(v)); break;
  }
  return bytes;
}

// An initializer of raw little-endian bytes (the only byte order duet runs on, x86-64).
inline void set_onnx_tensor(onnx::TensorProto& t, const std::string& name, const Shape& shape, DType type,
                            const void* values) {
  t.set_name(name);
  t.set_data_type(onnx_type(type));
  for (int i = 0; i < shape.rank(); ++i) t.add_dims(shape[i]);
  t.set_raw_data(static_cast<const char*>(values), static_cast<std::size_t>(shape.numel()) * size_of(type));
}
template <class T>
void set_onnx_tensor(onnx::TensorProto& t, const std::string& name, const Shape& shape, const T* values) {
  set_onnx_tensor(t, name, shape, dtype_of<T>, values);
}

// Each axis sized, or named where `names` has a name for it ("?": neither, an unknown size).
inline void set_onnx_value_info(onnx::ValueInfoProto& info, const std::string& name, int type, const Shape& shape,
                                const std::map<int, std::string>& names) {
  info.set_name(name);
  onnx::TypeProto_Tensor& tensor = *info.mutable_type()->mutable_tensor_type();
  tensor.set_elem_type(type);
  for (int i = 0; i < shape.rank(); ++i) {
    onnx::TensorShapeProto_Dimension& d = *tensor.mutable_shape()->add_dim();
    const auto named = names.find(i);
    if (named == names.end()) d.set_dim_value(shape[i]);
    else if (named->second != "?") d.set_dim_param(named->second);
  }
}

// Builds the model from a trace of PyNative's operations: each step says what it is in ONNX's
// vocabulary (ops::Interchange); this names values, writes parameters as initializers under
// the network's names for them, and checks that every step has a form.
template <class T>
class OnnxExporter {
 public:
  OnnxExporter(const pijit::Trace& trace, std::vector<nn::NamedParameter<T>> parameters, std::string where)
      : trace_(trace), where_(std::move(where)) {
    for (const auto& p : parameters) parameters_.emplace(static_cast<const void*>(p.parameter), p);
  }

  // The input's and the output's named axes (set_onnx_value_info).
  onnx::ModelProto build(std::size_t output, const std::string& graph_name, const std::map<int, std::string>& input_names,
                         const std::map<int, std::string>& output_names) {
    onnx::ModelProto model;
    model.set_ir_version(8);
    model.set_producer_name("duet");
    onnx::OperatorSetIdProto& opset = *model.add_opset_import();
    opset.set_domain("");
    opset.set_version(17);
    graph_ = model.mutable_graph();
    graph_->set_name(graph_name);
    output_ = output;
    const auto& values = trace_.values();
    inputs_ = static_cast<std::size_t>(
        std::ranges::count_if(values, [](const pijit::Value& v) { return v.kind == pijit::Value::Kind::input; }));
    for (std::size_t v = 0; v < values.size(); ++v) {
      if (values[v].kind == pijit::Value::Kind::input) {
        set_onnx_value_info(*graph_->add_input(), input_name(values[v].input), onnx_type(values[v].dtype),
                            values[v].shape, input_names);
      }
    }
    for (const auto& step : trace_.steps()) add_step(*step);
    if (values[output].kind == pijit::Value::Kind::input || values[output].kind == pijit::Value::Kind::constant) {
      onnx::NodeProto& node = *graph_->add_node();
      node.set_op_type("Identity");
      node.add_input(value_name(output, false));
      node.add_output("output");
    }
    set_onnx_value_info(*graph_->add_output(), "output", onnx_type(values[output].dtype), values[output].shape,
                        output_names);
    return model;
  }

 private:
  // "input" (input0, input1, ... of a network of several), "output", a parameter's or
  // constant's initializer, or v<N> for the value %N.
  std::string value_name(std::size_t v, bool producing) {
    const pijit::Value& value = trace_.values()[v];
    if (value.kind == pijit::Value::Kind::input) return input_name(value.input);
    if (v == output_ && (producing || value.kind != pijit::Value::Kind::constant)) return "output";
    if (value.kind == pijit::Value::Kind::constant) {
      // A parameter read as a tensor (ops::ParameterOp's operand) keeps its name.
      for (const auto& [key, p] : parameters_) {
        if (p.parameter->data() == value.data) return parameter_name(key);
      }
      const std::string name = "constant" + std::to_string(v);
      if (written_.insert(name).second) set_onnx_tensor(*graph_->add_initializer(), name, value.shape, value.dtype, value.data);
      return name;
    }
    return "v" + std::to_string(v);
  }

  std::string input_name(std::size_t k) const { return inputs_ == 1 ? "input" : "input" + std::to_string(k); }

  std::string parameter_name(const void* key) {
    const auto found = parameters_.find(key);
    if (found == parameters_.end()) return {};
    const nn::NamedParameter<T>& p = found->second;
    if (written_.insert(p.name).second) {
      set_onnx_tensor(*graph_->add_initializer(), p.name, p.parameter->shape(), p.parameter->data());
    }
    return p.name;
  }

  void add_step(const pijit::Step& step) {
    const auto& values = trace_.values();
    std::vector<Shape> shapes;
    for (std::size_t v : step.inputs) shapes.push_back(values[v].shape);
    const ops::Interchange nodes = step.interchange(shapes);
    const std::string who = step.op_name() + (step.label().empty() ? "" : " (" + step.label() + ")");
    if (nodes.empty()) {
      throw ValueError(where_ + ": " + who + " has no ONNX form; the operations export_onnx writes are those whose "
                                            "op gives interchange() (the README lists them)");
    }
    const std::string out = value_name(step.output, true);
    for (std::size_t k = 0; k < nodes.size(); ++k) {
      const ops::InterchangeNode& n = nodes[k];
      // A node's constants are named after it, and a Constant node comes before its reader.
      const std::string part = out + (nodes.size() > 1 ? "." + std::to_string(k) : "");
      std::vector<std::string> inputs;
      for (std::size_t i = 0; i < n.inputs.size(); ++i) inputs.push_back(node_input(n.inputs[i], step, out, part, who, i));
      onnx::NodeProto& node = *graph_->add_node();
      node.set_op_type(n.op_type);
      node.set_name("%" + std::to_string(step.output) + (nodes.size() > 1 ? "." + std::to_string(k) : "") + " " + who);
      for (const std::string& name : inputs) node.add_input(name);
      node.add_output(k + 1 == nodes.size() ? out : out + "." + std::to_string(k));
      for (const ops::InterchangeAttribute& a : n.attributes) {
        onnx::AttributeProto& attribute = *node.add_attribute();
        attribute.set_name(a.name);
        switch (a.kind) {
          case ops::InterchangeAttribute::Kind::integer:
            attribute.set_type(onnx::AttributeProto::INT);
            attribute.set_i(a.integer);
            break;
          case ops::InterchangeAttribute::Kind::real:
            attribute.set_type(onnx::AttributeProto::FLOAT);
            attribute.set_f(a.real);
            break;
          case ops::InterchangeAttribute::Kind::integers:
            attribute.set_type(onnx::AttributeProto::INTS);
            for (std::int64_t v : a.integers) attribute.add_ints(v);
            break;
          case ops::InterchangeAttribute::Kind::text:
            attribute.set_type(onnx::AttributeProto::STRING);
            attribute.set_s(a.text);
            break;
        }
      }
    }
  }

  std::string node_input(const ops::InterchangeInput& in, const pijit::Step& step, const std::string& out,
                         const std::string& part, const std::string& who, std::size_t position) {
    using Kind = ops::InterchangeInput::Kind;
    switch (in.kind) {
      case Kind::input:
        return value_name(step.inputs.at(in.index), false);
      case Kind::earlier:
        return out + "." + std::to_string(in.index);
      case Kind::int64s: {
        const std::string name = part + ".constant" + std::to_string(position);
        const Shape shape = in.scalar ? Shape{} : Shape{static_cast<index_t>(in.int64s.size())};
        set_onnx_tensor(*graph_->add_initializer(), name, shape, in.int64s.data());
        return name;
      }
      case Kind::real: {
        const std::string name = part + ".constant" + std::to_string(position);
        onnx::NodeProto& constant = *graph_->add_node();
        constant.set_op_type("Constant");
        constant.set_name(name);
        constant.add_output(name);
        onnx::AttributeProto& value = *constant.add_attribute();
        value.set_name("value");
        value.set_type(onnx::AttributeProto::TENSOR);
        const DType type = in.number_type.value_or(dtype_of<T>);
        set_onnx_tensor(*value.mutable_t(), name, Shape{}, type, detail::number_bytes(in.real, type).data());
        return name;
      }
      case Kind::absent:
        return {};
      case Kind::parameter: {
        std::string name = parameter_name(in.parameter);
        if (name.empty()) {
          throw ValueError(where_ + ": " + who + " reads a parameter that is not among the network's parameters (" +
                           std::string(nn::detail::unregistered_members_hint) + ")");
        }
        return name;
      }
    }
    return {};
  }

  const pijit::Trace& trace_;
  std::string where_;
  std::map<const void*, nn::NamedParameter<T>> parameters_;
  std::set<std::string> written_;
  onnx::GraphProto* graph_ = nullptr;
  std::size_t output_ = 0;
  std::size_t inputs_ = 0;
};

}  // namespace detail

// Writes a network as an ONNX model (opset 17) for one input shape, or a shape per input of a
// network of several ({{2, 16}, {2, 16, 1}}: inputs "input0", "input1", ...): a trace of the
// network running once in PyNative mode at evaluation (Dropout the identity, BatchNorm its moving
// statistics; every cell's own setting is given back after), each operation written as ONNX's
// operator for it and each parameter as an initializer under its name in the network
// ("dense_relu_sequential.0.weight"), so load_onnx and load_onnx_weights read it back and
// onnx.checker accepts it. The operations that have an ONNX form say so (ops::Interchange,
// interchange.hpp): the layers, the activations and elementwise functions, arithmetic (with a
// number too), products, reductions, slices and the other shape operations (the README lists
// them); anything else is a duet::ValueError naming it. A network of indices (input_value_type)
// gets int32 inputs. The file is written beside the destination and renamed into place, as
// checkpoints are.
namespace detail {
// A network whose type does not say what it takes: one built at run time (a
// DynamicSequentialCell, a DynamicCell&) says it at run time; a static Cell (which has a
// jit_config) by its input_value_type.
template <class Net, class T>
inline constexpr bool input_type_known_at_run_time = std::is_base_of_v<nn::BasicDynamicCell<T>, Net> && !requires {
  Net::jit_config;
};

// export_onnx, the network traced on zeros of In: its values' type, or the indices it takes.
template <class In, class Net, std::size_t N>
void export_onnx_on(Net& net, const Shape (&input_shapes)[N], const std::filesystem::path& path,
                    const OnnxExportOptions& options) {
  using T = typename Net::value_type;
  const std::string where = "duet::io::export_onnx(" + net.type_name() + ", " + path.string() + ")";
  for (const Shape& shape : input_shapes) {
    if (!shape.is_concrete() || shape.rank() == 0) {
      throw ValueError(where + ": the input shape must be concrete and of rank 1 or more, got " + to_string(shape));
    }
  }
  if (N > 1 && !options.dynamic_axes.empty()) {
    throw ValueError(where + ": dynamic_axes names axes of a network of one input; this one has " + std::to_string(N) +
                     " (dynamic_batch names axis 0 of each)");
  }
  const auto run = [&](std::array<BasicTensor<In>, N>& inputs) {
    return [&]<std::size_t... K>(std::index_sequence<K...>) { return BasicTensor<T>(net(inputs[K]...)); }
    (std::make_index_sequence<N>{});
  };
  const train::detail::EvaluationScope<Net> evaluation(net);
  pijit::Trace trace;
  trace.keep_values();
  std::array<BasicTensor<In>, N> inputs;
  for (std::size_t k = 0; k < N; ++k) {
    inputs[k] = zeros<In>(input_shapes[k]);
    trace.add_input(inputs[k], k);
  }
  BasicTensor<T> out;
  {
    const duet::detail::StepScope discarded;
    const pijit::Tracing tracing(&trace);
    const EagerScope eager;
    out = run(inputs);
  }
  if (!trace.broken().empty()) throw ValueError(where + ": the network cannot be traced: " + trace.broken());
  const std::size_t output = trace.find(out);
  if (output >= trace.values().size()) throw ValueError(where + ": the network's output is not made from its input");
  // Named axes: the batch as given; each other one probed (a run with it one longer), which
  // also names the output axes that follow it. An output axis that follows two is left unsized.
  std::map<int, std::string> input_names, output_names;
  const Shape out_shape = trace.values()[output].shape;
  if (options.dynamic_batch) input_names[0] = output_names[0] = "batch";
  for (const auto& [axis, name] : options.dynamic_axes) {
    const Shape& input_shape = input_shapes[0];
    if (axis < 0 || axis >= input_shape.rank() || name.empty() || name == "?") {
      throw ValueError(where + ": dynamic_axes names axis " + std::to_string(axis) + " '" + name + "' of an input of shape " +
                       to_string(input_shape) + " (an axis of the input, a name other than '?')");
    }
    input_names[axis] = name;
    Shape longer = input_shape;
    longer[axis] += 1;
    Shape probed;
    try {
      const duet::detail::StepScope discarded;
      const EagerScope eager;
      std::array<BasicTensor<In>, N> probe{zeros<In>(longer)};
      probed = run(probe).shape();
    } catch (const Error& e) {
      throw ValueError(where + ": the network does not take another size along input axis " + std::to_string(axis) + " ('" +
                       name + "'), which dynamic_axes names: at " + to_string(longer) + ": " + e.what());
    }
    for (int i = 0; i < out_shape.rank() && probed.rank() == out_shape.rank(); ++i) {
      if (probed[i] == out_shape[i]) continue;
      const auto [it, fresh] = output_names.emplace(i, name);
      if (!fresh && it->second != name) it->second = "?";
    }
  }
  const onnx::ModelProto model =
      detail::OnnxExporter<T>(trace, net.parameters(), where).build(output, options.graph_name, input_names, output_names);
  std::string bytes;
  if (!model.SerializeToString(&bytes)) throw IOError(where + ": the model could not be serialised");
  duet::detail::CheckpointWriter file(path, "ONNX file " + path.string());
  file.bytes(std::as_bytes(std::span(bytes)));
  file.commit();
}
}  // namespace detail

template <class Net, std::size_t N>
void export_onnx(Net& net, const Shape (&input_shapes)[N], const std::filesystem::path& path,
                 const OnnxExportOptions& options = {}) {
  using T = typename Net::value_type;
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "duet::io::export_onnx: the network's values must be float or double");
  // A network of indices (an Embedding first) is traced on zeros of its index type, written
  // as the model's int32 input: one that declares it, or one built at run time that begins
  // with such a cell (a DynamicSequentialCell), which says so only at run time.
  using In = typename detail::ExportInput<Net, T>::type;
  if constexpr (std::is_same_v<In, T> && detail::input_type_known_at_run_time<Net, T>) {
    if (net.other_input_type() == name_of(DType::int32)) {
      return detail::export_onnx_on<std::int32_t>(net, input_shapes, path, options);
    }
  }
  detail::export_onnx_on<In>(net, input_shapes, path, options);
}

template <class Net>
void export_onnx(Net& net, const Shape& input_shape, const std::filesystem::path& path,
                 const OnnxExportOptions& options = {}) {
  const Shape shapes[] = {input_shape};
  export_onnx(net, shapes, path, options);
}

}  // namespace duet::io

#if !defined(DUET_ONNX_LIBRARY) || defined(DUET_DEFINE_ONNX_LIBRARY)
#include "detail/onnx_import.hpp"
#endif
