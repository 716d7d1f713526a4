// ONNX models: duet::io::load_onnx(path) builds a network at run time from a model that
// torch.onnx.export (or any exporter) wrote, at opsets 13 to 17; duet::io::export_onnx(net,
// input_shape, path) writes a duet network as one (at the end of this file).
//
// The file is parsed by the official ONNX library's protobuf classes (Debian's libonnx-dev), so
// this header is not part of <duet/duet.hpp>: include <duet/io/onnx.hpp> and link the CMake
// target duet::onnx, which exists when CMake finds ONNX. Users who do not include it need
// neither ONNX nor protobuf.
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

// Builds an OnnxModel from a parsed ModelProto, checking everything it reads.
class OnnxBuilder {
 public:
  using Operand = OnnxModel::Operand;
  using Kind = Operand::Kind;

  OnnxBuilder(const onnx::ModelProto& proto, std::string where) : proto_(proto), where_(std::move(where)) {}

  OnnxModel build() {
    check_opset();
    const onnx::GraphProto& g = proto_.graph();
    for (const onnx::TensorProto& t : g.initializer()) add_initializer(t);
    find_input(g);
    // Every node has an output before any is read: the GELU pattern looks at nodes ahead of
    // the one being added, and protobuf's output(0) of an empty list is out of bounds.
    std::vector<std::pair<int, int>> unknown;  // an operator's first node and its count
    for (int i = 0; i < g.node_size(); ++i) {
      const onnx::NodeProto& n = g.node(i);
      if (n.output_size() < 1) throw FormatError(where_ + ": " + who(n, i) + " has no output");
      for (const std::string& in : n.input()) {
        ++consumers_[in];
        readers_[in] = i;
      }
      for (const std::string& out : n.output()) producers_.emplace(out, i);
      if (std::ranges::find(detail::onnx_operators, n.op_type()) != detail::onnx_operators.end()) continue;
      const auto seen = std::ranges::find_if(unknown, [&](const auto& u) { return g.node(u.first).op_type() == n.op_type(); });
      if (seen == unknown.end()) unknown.emplace_back(i, 1);
      else ++seen->second;
    }
    if (!unknown.empty()) refuse_operators(unknown);
    for (const onnx::ValueInfoProto& o : g.output()) ++consumers_[o.name()];
    // Constants first (they read nothing): a pattern read at its first node (GELU's) then sees
    // the constants its later nodes read.
    for (int i = 0; i < g.node_size(); ++i) {
      if (g.node(i).op_type() != "Constant") continue;
      add_node(g.node(i), i);
      skipped_.insert(i);
    }
    // A recurrence's weights before the nodes that prepare them, which it may take over.
    for (int i = 0; i < g.node_size(); ++i) {
      const std::string& op = g.node(i).op_type();
      if (op == "GRU") prepare_recurrence<ops::detail::GRUCell>(g.node(i), i);
      if (op == "LSTM") prepare_recurrence<ops::detail::LSTMCell>(g.node(i), i);
    }
    for (int i = 0; i < g.node_size(); ++i) {
      if (skipped_.contains(i)) continue;
      add_node(g.node(i), i);
    }
    if (g.output_size() != 1) {
      throw FormatError(where_ + ": the graph has " + std::to_string(g.output_size()) +
                        " outputs; duet's networks give one tensor");
    }
    const Operand out = operand_of(g.output(0).name(), "the graph's output");
    if (out.kind != Kind::value || out.index == 0) {
      throw ValueError(where_ + ": the graph's output " + detail::onnx_quoted(g.output(0).name()) +
                       " is not computed by any node; duet runs models whose output is an operation's");
    }
    model_.output_ = out.index;
    return std::move(model_);
  }

 private:
  void check_opset() {
    for (const onnx::OperatorSetIdProto& set : proto_.opset_import()) {
      if (!set.domain().empty() && set.domain() != "ai.onnx") continue;
      if (set.version() < 13 || set.version() > 17) {
        throw ValueError(where_ + ": the model uses opset " + std::to_string(set.version()) +
                         "; duet reads opsets 13 to 17 (torch.onnx.export(..., opset_version=17))");
      }
      return;
    }
    throw FormatError(where_ + ": the model imports no opset of the default ONNX domain");
  }

  // A float initializer becomes a parameter, an int64 one a list of integers.
  void add_initializer(const onnx::TensorProto& t) {
    const std::string what = "initializer " + detail::onnx_quoted(t.name());
    if (t.name().empty()) throw FormatError(where_ + ": an initializer has no name");
    if (defined(t.name())) throw FormatError(where_ + ": " + what + " is defined twice");
    const Shape shape = detail::onnx_shape(t, what, where_);
    if (t.data_type() == onnx::TensorProto::FLOAT) {
      const std::vector<float> data = detail::onnx_elements<float>(t, what, shape.numel(), where_);
      model_.parameters_.push_back(std::make_unique<nn::Parameter>(Tensor(shape, std::span<const float>(data))));
      model_.parameter_names_.push_back(t.name());
      operands_[t.name()] = {Kind::parameter, model_.parameters_.size() - 1};
    } else if (t.data_type() == onnx::TensorProto::INT64) {
      integers_[t.name()] = detail::onnx_elements<std::int64_t>(t, what, shape.numel(), where_);
    } else {
      throw ValueError(where_ + ": " + what + " has ONNX data type " + std::to_string(t.data_type()) +
                       "; duet reads float32 and int64 initializers");
    }
  }

  void find_input(const onnx::GraphProto& g) {
    const onnx::ValueInfoProto* input = nullptr;
    for (const onnx::ValueInfoProto& v : g.input()) {
      if (defined(v.name())) continue;  // an initializer listed as an input (older exporters)
      if (input != nullptr) {
        throw FormatError(where_ + ": the graph has more than one input (" + detail::onnx_quoted(input->name()) +
                          ", " + detail::onnx_quoted(v.name()) + "); duet's networks take one tensor");
      }
      input = &v;
    }
    if (input == nullptr) throw FormatError(where_ + ": the graph has no input");
    const auto& type = input->type();
    if (type.has_tensor_type() && type.tensor_type().elem_type() != onnx::TensorProto::FLOAT) {
      const int t = type.tensor_type().elem_type();
      if (t != onnx::TensorProto::INT32 && t != onnx::TensorProto::INT64) {
        throw ValueError(where_ + ": the graph's input " + detail::onnx_quoted(input->name()) + " has ONNX data type " +
                         std::to_string(t) +
                         "; load_onnx reads models of float32 input, or of int32 or int64 token ids");
      }
      // Token ids: read only as a Gather's indices (add_id_gather).
      model_.ids_input_ = true;
      ids_input_name_ = input->name();
    }
    if (type.has_tensor_type() && type.tensor_type().has_shape()) {
      std::string dims;
      for (const onnx::TensorShapeProto::Dimension& d : type.tensor_type().shape().dim()) {
        model_.input_dims_.push_back(d.has_dim_value() ? d.dim_value() : -1);
        dims += (dims.empty() ? "" : ", ") + (d.has_dim_value()         ? std::to_string(d.dim_value())
                                              : d.dim_param().empty() ? std::string("?")
                                                                      : d.dim_param());
      }
      model_.declared_input_ = detail::onnx_quoted(input->name()) + " [" + dims + "]";
    }
    if (model_.declared_input_.empty()) model_.declared_input_ = detail::onnx_quoted(input->name());
    if (!model_.ids_input_) operands_[input->name()] = {Kind::value, 0};
  }

  std::string ids_input_name_;  // the graph's input, when it holds token ids

  bool integer(const std::string& name) const { return integers_.contains(name) || sizes_.contains(name); }
  bool defined(const std::string& name) const {
    return operands_.contains(name) || integer(name) || ranges_.contains(name);
  }

  Operand operand_of(const std::string& name, const std::string& reader) const {
    const auto it = operands_.find(name);
    if (it == operands_.end() && name == ids_input_name_) {
      throw ValueError(where_ + ": " + reader + " reads the graph's input " + detail::onnx_quoted(name) +
                       ", token ids, which duet reads only as the indices of a Gather along axis 0 (an embedding), "
                       "and their Shape as a Range's bounds");
    }
    if (it == operands_.end() && ranges_.contains(name)) {
      throw ValueError(where_ + ": " + reader + " reads " + detail::onnx_quoted(name) +
                       ", a Range, which duet reads only as the indices of a Gather along axis 0 (a positional "
                       "embedding)");
    }
    if (it == operands_.end()) {
      if (integer(name)) {
        throw ValueError(where_ + ": " + reader + " reads " + detail::onnx_quoted(name) +
                         ", an int64 tensor, which duet reads only as sizes (Shape, Gather, Unsqueeze, Squeeze, Cast, "
                         "Concat, Add, Sub, Mul and Div of int64s, for a Reshape, Slice, Expand or ConstantOfShape)");
      }
      throw FormatError(where_ + ": " + reader + " reads " + detail::onnx_quoted(name) +
                        ", which no input, initializer or earlier node defines");
    }
    return it->second;
  }

  // --- attributes ---------------------------------------------------------------------------

  static std::string node_name(const onnx::NodeProto& n, int index) {
    return detail::onnx_quoted(n.name().empty() ? "#" + std::to_string(index) : n.name());
  }
  std::string who(const onnx::NodeProto& n, int index) const { return "ONNX node " + node_name(n, index) + " (" + n.op_type() + ")"; }

  [[noreturn]] void unsupported(const std::string& node, const std::string& what) const {
    throw ValueError(where_ + ": " + node + ": " + what + " is not supported");
  }

  // The first node of an unknown operator, as unsupported() names one, then the others: a
  // user learns at once what a model needs, not one operator per attempt.
  [[noreturn]] void refuse_operators(const std::vector<std::pair<int, int>>& unknown) const {
    const auto name = [&](const std::pair<int, int>& u) {
      const std::string& op = proto_.graph().node(u.first).op_type();
      return op + (op == "RNN" ? " (duet has GRU and LSTM)" : "");
    };
    std::string also;
    for (std::size_t k = 1; k < unknown.size(); ++k) {
      const auto& u = unknown[k];
      also += (k == 1 ? "; nor are " : ", ") + name(u) + " (" +
              (u.second == 1 ? "node " : std::to_string(u.second) + " nodes, the first ") +
              node_name(proto_.graph().node(u.first), u.first) + ")";
    }
    const auto& first = unknown.front();
    const std::string count = first.second == 1 ? "" : " (" + std::to_string(first.second) + " nodes)";
    throw ValueError(where_ + ": " + who(proto_.graph().node(first.first), first.first) + ": the operator " + name(first) +
                     count + " is not supported" + also);
  }

  static const onnx::AttributeProto* attribute(const onnx::NodeProto& n, const std::string& name) {
    for (const onnx::AttributeProto& a : n.attribute())
      if (a.name() == name) return &a;
    return nullptr;
  }

  // Every attribute of n must be one the operator's conversion reads.
  void known_attributes(const onnx::NodeProto& n, const std::string& node, std::initializer_list<std::string_view> known) const {
    for (const onnx::AttributeProto& a : n.attribute()) {
      if (std::ranges::find(known, a.name()) == known.end()) unsupported(node, "attribute " + detail::onnx_quoted(a.name()));
    }
  }

  std::int64_t int_attr(const onnx::NodeProto& n, const std::string& name, std::int64_t fallback) const {
    const onnx::AttributeProto* a = attribute(n, name);
    return a == nullptr ? fallback : a->i();
  }
  float float_attr(const onnx::NodeProto& n, const std::string& name, float fallback) const {
    const onnx::AttributeProto* a = attribute(n, name);
    return a == nullptr ? fallback : a->f();
  }
  // An axis of any rank duet has, negative from the end (ONNX's convention); the int64 is
  // checked before it narrows to int, where 2^32 would pass as axis 0.
  int axis_attr(const onnx::NodeProto& n, const std::string& node, std::int64_t fallback) const {
    const std::int64_t axis = int_attr(n, "axis", fallback);
    if (axis < -max_rank || axis >= max_rank) {
      throw FormatError(where_ + ": " + node + ": axis " + std::to_string(axis) + " is beyond every rank (duet's highest is " +
                        std::to_string(max_rank) + ")");
    }
    return static_cast<int>(axis);
  }
  std::vector<std::int64_t> ints_attr(const onnx::NodeProto& n, const std::string& name) const {
    const onnx::AttributeProto* a = attribute(n, name);
    if (a == nullptr) return {};
    return {a->ints().begin(), a->ints().end()};
  }
  std::string string_attr(const onnx::NodeProto& n, const std::string& name, const std::string& fallback) const {
    const onnx::AttributeProto* a = attribute(n, name);
    return a == nullptr ? fallback : a->s();
  }

  static std::string list_text(const std::vector<std::int64_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i > 0 ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }

  // One value for both spatial axes: a pair of equal values (or none: the fallback).
  // A window's size, stride or dilation: one per spatial axis (2 unless a Conv is 1-D), all equal.
  std::int64_t square(const onnx::NodeProto& n, const std::string& node, const std::string& name, std::int64_t fallback,
                      int spatial = 2) const {
    const std::vector<std::int64_t> v = ints_attr(n, name);
    if (v.empty()) return fallback;
    if (v.size() != static_cast<std::size_t>(spatial) || std::ranges::count(v, v[0]) != spatial) {
      unsupported(node, name + " " + list_text(v) + (spatial == 2 ? " (duet takes 2-D windows, equal on both axes)" : " (a 1-D window)"));
    }
    return v[0];
  }
  // An attribute of one value per spatial axis of a 2-D window (height, width).
  std::array<index_t, 2> spatial_pair(const onnx::NodeProto& n, const std::string& node, const std::string& name,
                                      std::int64_t fallback) const {
    const std::vector<std::int64_t> v = ints_attr(n, name);
    if (v.empty()) return {fallback, fallback};
    if (v.size() != 2) unsupported(node, name + " " + list_text(v) + " (duet pools over 2-D windows)");
    return {v[0], v[1]};
  }
  // pads [top, left, bottom, right] of a 2-D window, each axis padded alike on both sides.
  std::array<index_t, 2> axis_pads(const onnx::NodeProto& n, const std::string& node) const {
    const std::vector<std::int64_t> v = ints_attr(n, "pads");
    if (v.empty()) return {0, 0};
    if (v.size() != 4 || v[0] != v[2] || v[1] != v[3]) {
      unsupported(node, "pads " + list_text(v) + " (duet pads each spatial axis alike on both sides)");
    }
    return {v[0], v[1]};
  }
  std::int64_t symmetric_pads(const onnx::NodeProto& n, const std::string& node, int spatial = 2) const {
    const std::vector<std::int64_t> v = ints_attr(n, "pads");
    if (v.empty()) return 0;
    if (v.size() != 2 * static_cast<std::size_t>(spatial) || std::ranges::count(v, v[0]) != 2 * spatial) {
      unsupported(node, "pads " + list_text(v) + " (duet pads all sides alike)");
    }
    return v[0];
  }

  // --- nodes ----------------------------------------------------------------------------------

  std::size_t new_value(const std::string& name, const std::string& node) {
    if (name.empty()) throw FormatError(where_ + ": " + node + " has an output with no name");
    if (defined(name)) throw FormatError(where_ + ": " + node + ": " + detail::onnx_quoted(name) + " is defined twice");
    operands_[name] = {Kind::value, model_.value_count_};
    return model_.value_count_++;
  }

  void add_step(const std::string& op, const onnx::NodeProto& n, const std::string& node,
                std::function<Tensor(const OnnxModel&, std::vector<Tensor>&)> run, int output = 0) {
    const std::size_t out = new_value(n.output(output), node);
    model_.steps_.push_back({std::move(run), out, node});
    model_.operators_.push_back(op);
  }

  // `least` to `most` inputs, and no output but the first read (`outputs` for an operator
  // whose others duet makes too).
  void arity(const onnx::NodeProto& n, const std::string& node, int least, int most, int outputs = 1) const {
    if (n.input_size() < least || n.input_size() > most) {
      throw FormatError(where_ + ": " + node + " has " + std::to_string(n.input_size()) + " inputs, its operator takes " +
                        (least == most ? std::to_string(least) : std::to_string(least) + " to " + std::to_string(most)));
    }
    for (int i = outputs; i < n.output_size(); ++i) {
      if (!n.output(i).empty() && consumers_.contains(n.output(i))) {
        unsupported(node, "its output " + std::to_string(i) + " (" + detail::onnx_quoted(n.output(i)) + ")");
      }
    }
  }

  // The float value of a one-element constant operand, if it is one.
  std::optional<float> scalar_constant(const std::string& name) const {
    const auto it = operands_.find(name);
    if (it == operands_.end()) return std::nullopt;
    const Tensor* t = nullptr;
    if (it->second.kind == Kind::constant) t = &model_.constants_[it->second.index];
    else if (it->second.kind == Kind::parameter) t = model_.parameters_[it->second.index].get();
    if (t == nullptr || t->numel() != 1) return std::nullopt;
    return t->data()[0];
  }

  // The node reading `name`, when exactly one node does (and the graph's output does not).
  int only_reader(const std::string& name) const {
    const auto count = consumers_.find(name);
    if (count == consumers_.end() || count->second != 1) return -1;
    const auto reader = readers_.find(name);
    return reader == readers_.end() ? -1 : reader->second;  // the graph's output is not a node
  }

  // The other input of a two-input node than `name`, or "" when it does not read it.
  static std::string other_input(const onnx::NodeProto& n, const std::string& name) {
    if (n.input_size() != 2) return "";
    if (n.input(0) == name) return n.input(1);
    if (n.input(1) == name) return n.input(0);
    return "";
  }

  // torch.onnx.export's GELU below opset 20: Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5),
  // factors in either order. On a match, the Div becomes one Gelu step and the rest are skipped.
  bool gelu_pattern(const onnx::NodeProto& div, int index) {
    const onnx::GraphProto& g = proto_.graph();
    if (div.op_type() != "Div" || div.input_size() != 2 || div.output_size() != 1) return false;
    const std::optional<float> root2 = scalar_constant(div.input(1));
    if (!root2 || std::abs(*root2 - std::sqrt(2.0f)) > 1e-6f) return false;
    const std::string& x = div.input(0);
    const int erf = only_reader(div.output(0));
    if (erf < 0 || g.node(erf).op_type() != "Erf" || g.node(erf).output_size() != 1) return false;
    const int add = only_reader(g.node(erf).output(0));
    if (add < 0 || g.node(add).op_type() != "Add") return false;
    const std::optional<float> one = scalar_constant(other_input(g.node(add), g.node(erf).output(0)));
    if (!one || *one != 1.0f) return false;
    const int mul = only_reader(g.node(add).output(0));
    if (mul < 0 || g.node(mul).op_type() != "Mul" || other_input(g.node(mul), g.node(add).output(0)) != x) return false;
    const int half = only_reader(g.node(mul).output(0));
    if (half < 0 || g.node(half).op_type() != "Mul") return false;
    const std::optional<float> h = scalar_constant(other_input(g.node(half), g.node(mul).output(0)));
    if (!h || *h != 0.5f) return false;
    for (const int i : {erf, add, mul, half})
      if (i <= index || !g.node(i).attribute().empty()) return false;
    const Operand in = operand_of(x, who(div, index));
    const std::string node = "ONNX nodes " + detail::onnx_quoted(div.name()) + " to " +
                             detail::onnx_quoted(g.node(half).name()) + " (GELU: Div, Erf, Add, Mul, Mul)";
    skipped_.insert({erf, add, mul});
    skipped_.insert(half);
    const std::size_t out = new_value(g.node(half).output(0), node);
    model_.steps_.push_back({[in](const OnnxModel& m, std::vector<Tensor>& v) {
                               return m.with(in, v, [](const auto& a) { return Tensor(ops::gelu(a)); });
                             },
                             out, node});
    model_.operators_.push_back("Gelu");
    return true;
  }

  void add_node(const onnx::NodeProto& n, int index) {
    const std::string node = who(n, index);
    if (!n.domain().empty() && n.domain() != "ai.onnx") unsupported(node, "the operator domain " + detail::onnx_quoted(n.domain()));
    const std::string& op = n.op_type();
    if (gelu_pattern(n, index)) return;
    const auto input = [&](int i) { return operand_of(n.input(i), node); };

    if (op == "Identity" || op == "Dropout") {
      arity(n, node, 1, op == "Dropout" ? 3 : 1);
      known_attributes(n, node, {"seed"});
      if (op == "Dropout" && n.input_size() == 3 && !n.input(2).empty()) {
        unsupported(node, "a training_mode input (duet runs an ONNX Dropout as in inference, the identity)");
      }
      if (n.output(0).empty() || defined(n.output(0))) throw FormatError(where_ + ": " + node + " has no new output name");
      operands_[n.output(0)] = input(0);  // no operation: its output is its input
      return;
    }
    if (op == "Constant") {
      arity(n, node, 0, 0);
      add_constant(n, node);
      return;
    }
    if (op == "Add" || op == "Sub" || op == "Mul" || op == "Div" || op == "Pow" || op == "Max" || op == "Min") {
      if (shape_arithmetic(n, node)) return;
      // ONNX's Max and Min take any number of inputs; duet reads two.
      if ((op == "Max" || op == "Min") && n.input_size() != 2) unsupported(node, op + " of other than two inputs");
      arity(n, node, 2, 2);
      known_attributes(n, node, {});
      const Operand a = input(0);
      const Operand b = input(1);
      const char kind = op == "Max" ? 'X' : op == "Min" ? 'N' : op[0];
      add_step(op, n, node, [a, b, kind](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, b, v, [kind](const auto& x, const auto& y) -> Tensor {
          switch (kind) {
            case 'A': return ops::add(x, y);
            case 'S': return ops::sub(x, y);
            case 'M': return ops::mul(x, y);
            case 'P': return ops::pow(x, y);
            case 'X': return ops::maximum(x, y);
            case 'N': return ops::minimum(x, y);
            default: return ops::div(x, y);
          }
        });
      });
      return;
    }
    if (op == "Exp" || op == "Log" || op == "Sqrt" || op == "Abs" || op == "Neg" || op == "Reciprocal" || op == "Softplus" ||
        op == "Sin" || op == "Cos" || op == "Erf") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {});
      const Operand a = input(0);
      const std::string kind = op;
      add_step(op, n, node, [a, kind](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [&kind](const auto& x) -> Tensor {
          if (kind == "Exp") return ops::exp(x);
          if (kind == "Log") return ops::log(x);
          if (kind == "Sqrt") return ops::sqrt(x);
          if (kind == "Abs") return ops::abs(x);
          if (kind == "Neg") return ops::neg(x);
          if (kind == "Reciprocal") return ops::div(1.0, x);
          if (kind == "Sin") return ops::sin(x);
          if (kind == "Cos") return ops::cos(x);
          if (kind == "Erf") return ops::erf(x);
          // ONNX's log(1 + exp(x)); duet's turns linear past 20, where the two differ by less
          // than exp(-20) of x.
          return ops::softplus(x);
        });
      });
      return;
    }
    if (op == "Clip") {
      arity(n, node, 1, 3);
      known_attributes(n, node, {});
      const Operand a = input(0);
      // The bounds are optional inputs, numbers the model holds.
      const auto bound = [&](int i, double fallback) {
        if (n.input_size() <= i || n.input(i).empty()) return fallback;
        const std::optional<float> b = scalar_constant(n.input(i));
        if (!b) unsupported(node, "a bound that is not a one-element constant");
        return static_cast<double>(*b);
      };
      const double lo = bound(1, -std::numeric_limits<double>::infinity());
      const double hi = bound(2, std::numeric_limits<double>::infinity());
      add_step(op, n, node, [a, lo, hi](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [&](const auto& x) -> Tensor { return ops::clip_by_value(x, lo, hi); });
      });
      return;
    }
    if (op == "Slice") return add_slice(n, node);
    if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax" || op == "ReduceMin" || op == "ReduceProd") {
      return add_reduce(n, node);
    }
    if (op == "Relu" || op == "Sigmoid" || op == "Tanh" || op == "LeakyRelu" || op == "Elu") {
      arity(n, node, 1, 1);
      const bool has_alpha = op == "LeakyRelu" || op == "Elu";
      if (has_alpha) known_attributes(n, node, {"alpha"});
      else known_attributes(n, node, {});
      // ONNX's defaults, which are PyTorch's.
      const double alpha = float_attr(n, "alpha", op == "Elu" ? 1.0f : 0.01f);
      if (has_alpha) fn::check_alpha(alpha, where_ + ": " + node);
      const Operand a = input(0);
      const char kind = op[0];
      add_step(op, n, node, [a, kind, alpha](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [kind, alpha](const auto& x) -> Tensor {
          switch (kind) {
            case 'R': return ops::relu(x);
            case 'S': return ops::sigmoid(x);
            case 'T': return ops::tanh(x);
            case 'L': return ops::leaky_relu(x, alpha);
            default: return ops::elu(x, alpha);
          }
        });
      });
      return;
    }
    if (op == "Softmax" || op == "LogSoftmax") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"axis"});
      const Operand a = input(0);
      const int axis = axis_attr(n, node, -1);
      const bool log = op == "LogSoftmax";
      add_step(op, n, node, [a, axis, log](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [&](const auto& x) -> Tensor {
          // Not ?: : on an initializer the two give different nn::ParameterResult types.
          if (log) return ops::log_softmax(x, axis);
          return ops::softmax(x, axis);
        });
      });
      return;
    }
    if (op == "MatMul") {
      arity(n, node, 2, 2);
      known_attributes(n, node, {});
      const Operand a = input(0);
      const Operand b = input(1);
      add_step(op, n, node, [a, b](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, b, v, [](const auto& x, const auto& y) -> Tensor { return ops::matmul(x, y); });
      });
      return;
    }
    if (op == "Gemm") return add_gemm(n, node);
    if (op == "Conv") return add_conv(n, node);
    if (op == "MaxPool" || op == "AveragePool") return add_pool(n, node, index);
    if (op == "Pad") return add_pad(n, node, index);
    if (op == "GlobalAveragePool") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {});
      const Operand a = input(0);
      add_step(op, n, node, [a](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [](const auto& x) -> Tensor { return ops::adaptive_avg_pool2d<1>(x); });
      });
      return;
    }
    if (op == "BatchNormalization") return add_batchnorm(n, node);
    if (op == "LayerNormalization") return add_layernorm(n, node);
    if (op == "GRU") return add_recurrence(n, node, index, model_.grus_);
    if (op == "LSTM") return add_recurrence(n, node, index, model_.lstms_);
    if (op == "Flatten" || op == "Reshape") return add_reshape(n, node);
    if (op == "Transpose") return add_transpose(n, node);
    if (op == "Tile") return add_tile(n, node);
    if (positions(n, node)) return;
    if (shape_arithmetic(n, node)) return;
    if (op == "Unsqueeze" || op == "Squeeze") return add_squeeze(n, node);
    if (op == "Concat") return add_concat(n, node);
    if (op == "Expand" || op == "ConstantOfShape") return add_fill(n, node);
    unsupported(node, "the operator " + op);
  }

  void add_constant(const onnx::NodeProto& n, const std::string& node) {
    if (n.attribute_size() != 1) throw FormatError(where_ + ": " + node + " has " + std::to_string(n.attribute_size()) + " attributes, not one");
    const onnx::AttributeProto& a = n.attribute(0);
    const std::string& name = n.output(0);
    if (name.empty() || defined(name)) throw FormatError(where_ + ": " + node + " has no new output name");
    const auto add_float = [&](Tensor t) {
      model_.constants_.push_back(std::move(t));
      operands_[name] = {Kind::constant, model_.constants_.size() - 1};
    };
    if (a.name() == "value") {
      const onnx::TensorProto& t = a.t();
      const std::string what = node + "'s value";
      const Shape shape = detail::onnx_shape(t, what, where_);
      if (t.data_type() == onnx::TensorProto::FLOAT) {
        const std::vector<float> data = detail::onnx_elements<float>(t, what, shape.numel(), where_);
        add_float(Tensor(shape, std::span<const float>(data)));
      } else if (t.data_type() == onnx::TensorProto::INT64) {
        integers_[name] = detail::onnx_elements<std::int64_t>(t, what, shape.numel(), where_);
      } else {
        unsupported(node, "a value of ONNX data type " + std::to_string(t.data_type()));
      }
    } else if (a.name() == "value_float") {
      add_float(Tensor(Shape{}, {a.f()}));
    } else if (a.name() == "value_floats") {
      const std::vector<float> data(a.floats().begin(), a.floats().end());
      add_float(Tensor(Shape{static_cast<index_t>(data.size())}, std::span<const float>(data)));
    } else if (a.name() == "value_int") {
      integers_[name] = {a.i()};
    } else if (a.name() == "value_ints") {
      integers_[name] = {a.ints().begin(), a.ints().end()};
    } else {
      unsupported(node, "attribute " + detail::onnx_quoted(a.name()));
    }
  }

  void add_gemm(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 3);
    known_attributes(n, node, {"alpha", "beta", "transA", "transB"});
    const Operand a = operand_of(n.input(0), node);
    const Operand b = operand_of(n.input(1), node);
    const bool has_c = n.input_size() == 3 && !n.input(2).empty();
    const Operand c = has_c ? operand_of(n.input(2), node) : Operand{};
    const float alpha = float_attr(n, "alpha", 1.0f);
    const float beta = float_attr(n, "beta", 1.0f);
    const bool ta = int_attr(n, "transA", 0) != 0;
    const bool tb = int_attr(n, "transB", 0) != 0;
    add_step("Gemm", n, node, [=](const OnnxModel& m, std::vector<Tensor>& v) {
      Tensor y = m.with(a, b, v, [&](const auto& x, const auto& w) -> Tensor {
        if (ta && tb) return ops::matmul(x, w, ops::transpose_a, ops::transpose_b);
        if (ta) return ops::matmul(x, w, ops::transpose_a);
        if (tb) return ops::matmul(x, w, ops::transpose_b);
        return ops::matmul(x, w);
      });
      if (alpha != 1.0f) y = ops::mul(y, alpha);
      if (!has_c) return y;
      return m.with(c, v, [&](const auto& bias) -> Tensor {
        if (beta == 1.0f) return ops::add(y, bias);
        return ops::add(y, ops::mul(bias, beta));
      });
    });
  }

  // A Conv's weight and bias must be initializers: duet's convolution reads its geometry from
  // the weight's shape, and writes their gradients as a layer's.
  const nn::Parameter& parameter_input(const onnx::NodeProto& n, int i, const std::string& node) const {
    const Operand o = operand_of(n.input(i), node);
    if (o.kind != Kind::parameter) unsupported(node, "input " + std::to_string(i) + " that is not a float initializer");
    return *model_.parameters_[o.index];
  }

  void add_conv(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 3);
    known_attributes(n, node, {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"});
    const Operand x = operand_of(n.input(0), node);
    const nn::Parameter& w = parameter_input(n, 1, node);
    const bool with_bias = n.input_size() == 3 && !n.input(2).empty();
    const nn::Parameter& b = with_bias ? parameter_input(n, 2, node) : w;
    // [out, in / group, k] for a 1-D Conv, [out, in / group, k, k] for a 2-D one.
    const int spatial = w.shape().rank() - 2;
    if ((spatial != 1 && spatial != 2) || (spatial == 2 && w.dim(2) != w.dim(3)) || w.dim(2) < 1) {
      unsupported(node, "a weight of shape " + to_string(w.shape()) + " (duet's Conv is 1-D, or 2-D with square kernels)");
    }
    const std::int64_t group = int_attr(n, "group", 1);
    // A group above the output channels divides none but 0, and would overflow g.in below.
    if (group < 1 || group > std::max<index_t>(w.dim(0), 1) || w.dim(0) % group != 0) throw FormatError(where_ + ": " + node + ": group " + std::to_string(group) + " does not divide the weight's " + std::to_string(w.dim(0)) + " output channels");
    if (with_bias && (b.shape().rank() != 1 || b.dim(0) != w.dim(0))) {
      throw FormatError(where_ + ": " + node + ": bias of shape " + to_string(b.shape()) + " for a weight of shape " + to_string(w.shape()));
    }
    ops::ConvGeometry g;
    g.spatial = spatial;
    g.out = w.dim(0);
    g.in = w.dim(1) * group;
    g.groups = group;
    g.kernel = square(n, node, "kernel_shape", w.dim(2), spatial);
    if (g.kernel != w.dim(2)) throw FormatError(where_ + ": " + node + ": kernel_shape does not match the weight's " + to_string(w.shape()));
    g.stride = square(n, node, "strides", 1, spatial);
    g.dilation = square(n, node, "dilations", 1, spatial);
    if (g.stride < 1 || g.dilation < 1) unsupported(node, "a stride or dilation below 1");
    // A file's sizes can be any int64: bounded here, the convolution's window arithmetic
    // (extent, padded size) cannot overflow.
    constexpr index_t most = index_t{1} << 31;
    index_t span = 0;
    if (g.stride > most || __builtin_mul_overflow(g.dilation, g.kernel - 1, &span) || span >= most) {
      unsupported(node, "strides " + std::to_string(g.stride) + " and dilations " + std::to_string(g.dilation) +
                            " (duet's ONNX import takes windows and steps below 2^31)");
    }
    const std::string auto_pad = string_attr(n, "auto_pad", "NOTSET");
    if (auto_pad == "NOTSET") {
      g.pad_mode = nn::PadMode::pad;
      g.padding = symmetric_pads(n, node, spatial);
    } else if (auto_pad == "VALID") {
      g.pad_mode = nn::PadMode::valid;
    } else if (auto_pad == "SAME_UPPER") {
      g.pad_mode = nn::PadMode::same;  // the odd padding after, as duet's "same"
    } else {
      unsupported(node, "auto_pad " + auto_pad);
    }
    // A full convolution (padding extent - 1) is as far as padding can go with every output
    // seeing some input: more only adds outputs of nothing but zeros, and would let a small
    // file ask for outputs of any size.
    if (g.padding < 0 || g.padding >= g.extent()) {
      unsupported(node, "padding " + std::to_string(g.padding) + " for a window of " + std::to_string(g.extent()) +
                            " (duet's ONNX import pads less than the window, at most a full convolution)");
    }
    if (spatial == 1) add_conv_step(n, node, x, model_.convs1d_, detail::OnnxConv<1>{g, w, b, with_bias, node});
    else add_conv_step(n, node, x, model_.convs2d_, detail::OnnxConv<2>{g, w, b, with_bias, node});
  }

  template <class Layer>
  void add_conv_step(const onnx::NodeProto& n, const std::string& node, Operand x, std::vector<std::unique_ptr<Layer>>& layers,
                     Layer made) {
    layers.push_back(std::make_unique<Layer>(std::move(made)));
    const Layer* layer = layers.back().get();
    add_step("Conv", n, node, [x, layer](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [layer](const auto& in) -> Tensor { return apply(ops::ConvOp<Layer>{layer}, in); });
    });
  }

  // ONNX's GRU and LSTM: forward, sequence-major (layout 0), the default activations, no
  // sequence_lens or peepholes, and a GRU's linear_before_reset = 1 (PyTorch's formula; 0 is
  // another). Run as nn::GRU's and nn::LSTM's operation, whose weights are in PyTorch's layout
  // and gate order: those export_onnx wrote, Unsqueeze(Gather(P, ONNX's order)) of the
  // network's own parameters (the biases Concatenated first), are those parameters, and the
  // nodes that reorder them are not run; initializers in ONNX's layout, as torch.onnx.export
  // writes them, are rearranged into it where nothing else reads them, B split into
  // "<B>.bias_ih" and "<B>.bias_hh". So an exported network's parameters come back under their
  // names, and a torch export's train as duet's layers do.
  template <class Step>
  void prepare_recurrence(const onnx::NodeProto& n, int index) {
    const std::string node = who(n, index);
    const bool lstm = Step::states == 2;
    arity(n, node, 3, lstm ? 8 : 6, lstm ? 3 : 2);  // Y, Y_h and an LSTM's Y_c
    if (lstm) known_attributes(n, node, {"hidden_size", "direction", "layout", "activations", "input_forget"});
    else known_attributes(n, node, {"hidden_size", "direction", "layout", "activations", "linear_before_reset"});
    if (string_attr(n, "direction", "forward") != "forward") unsupported(node, "direction " + string_attr(n, "direction", ""));
    if (int_attr(n, "layout", 0) != 0) unsupported(node, "layout 1 (batch-major; duet reads ONNX's default, sequence-major)");
    if (int_attr(n, "input_forget", 0) != 0) unsupported(node, "input_forget 1");
    if (!lstm && int_attr(n, "linear_before_reset", 0) != 1) {
      unsupported(node, "linear_before_reset 0 (duet's GRU is PyTorch's, linear_before_reset 1)");
    }
    if (const onnx::AttributeProto* a = attribute(n, "activations")) {
      const std::vector<std::string> defaults = lstm ? std::vector<std::string>{"Sigmoid", "Tanh", "Tanh"}
                                                     : std::vector<std::string>{"Sigmoid", "Tanh"};
      if (!std::ranges::equal(a->strings(), defaults)) unsupported(node, "activations other than the defaults");
    }
    if (n.input_size() > 4 && !n.input(4).empty()) unsupported(node, "sequence_lens (every sequence of a batch is whole)");
    if (n.input_size() > 7 && !n.input(7).empty()) unsupported(node, "peepholes (input P)");
    const index_t gates = Step::gates;
    const std::int64_t hidden = int_attr(n, "hidden_size", 0);
    // ONNX's rows of the stacked gates, in PyTorch's numbering (export_onnx's Gather indices).
    const auto order = [&](index_t halves) {
      std::vector<std::int64_t> rows;
      for (index_t h = 0; h < halves; ++h)
        for (const index_t gate : Step::onnx_gates)
          for (std::int64_t j = 0; j < hidden; ++j) rows.push_back((h * gates + gate) * hidden + j);
      return rows;
    };
    if (hidden < 1 || hidden > (index_t{1} << 24)) throw FormatError(where_ + ": " + node + ": hidden_size " + std::to_string(hidden));
    std::array<std::size_t, 4> p{};
    std::vector<int> taken;  // the nodes export_onnx wrote to reorder the weights
    const auto take = [&](const std::string& name, const char* op) -> const onnx::NodeProto* {
      const auto at = producers_.find(name);
      const auto readers = consumers_.find(name);
      if (at == producers_.end() || readers == consumers_.end() || readers->second != 1) return nullptr;
      const onnx::NodeProto& m = proto_.graph().node(at->second);
      if (m.op_type() != op || m.output_size() != 1) return nullptr;
      taken.push_back(at->second);
      return &m;
    };
    const auto integers = [&](const std::string& name) {
      const auto it = integers_.find(name);
      return it == integers_.end() ? std::vector<std::int64_t>{} : it->second;
    };
    const auto parameter = [&](const std::string& name) -> std::optional<std::size_t> {
      const auto it = operands_.find(name);
      if (it == operands_.end() || it->second.kind != Kind::parameter) return std::nullopt;
      return it->second.index;
    };
    // Unsqueeze(Gather(source, rows), [0]) with rows in ONNX's order: the Gather's source.
    const auto gathered = [&](const std::string& name, index_t halves) -> const onnx::NodeProto* {
      const onnx::NodeProto* unsqueeze = take(name, "Unsqueeze");
      if (unsqueeze == nullptr || unsqueeze->input_size() != 2 || integers(unsqueeze->input(1)) != std::vector<std::int64_t>{0}) return nullptr;
      const onnx::NodeProto* gather = take(unsqueeze->input(0), "Gather");
      if (gather == nullptr || gather->input_size() != 2 || int_attr(*gather, "axis", 0) != 0) return nullptr;
      // The indices' count first: order() is as long as hidden_size says, the file's data is not.
      const std::vector<std::int64_t> indices = integers(gather->input(1));
      if (indices.size() != static_cast<std::size_t>(halves * gates * hidden) || indices != order(halves)) return nullptr;
      return gather;
    };
    const auto shaped = [&](std::size_t k, const Shape& shape) { return model_.parameters_[k]->shape() == shape; };
    const std::string w = n.input(1);
    const std::string r = n.input(2);
    const std::string b = n.input_size() > 3 ? n.input(3) : "";
    const onnx::NodeProto* gw = gathered(w, 1);
    const onnx::NodeProto* gr = gathered(r, 1);
    const onnx::NodeProto* gb = b.empty() ? nullptr : gathered(b, 2);
    const onnx::NodeProto* concat = gb == nullptr ? nullptr : take(gb->input(0), "Concat");
    const auto pw = gw == nullptr ? std::nullopt : parameter(gw->input(0));
    const auto pr = gr == nullptr ? std::nullopt : parameter(gr->input(0));
    if (pw && pr && concat != nullptr && concat->input_size() == 2 && int_attr(*concat, "axis", 0) == 0 &&
        parameter(concat->input(0)) && parameter(concat->input(1))) {
      p = {*pw, *pr, *parameter(concat->input(0)), *parameter(concat->input(1))};
      const index_t input = model_.parameters_[p[0]]->shape().rank() == 2 ? model_.parameters_[p[0]]->dim(1) : 0;
      const index_t rows = gates * hidden;
      if (!shaped(p[0], Shape{rows, input}) || !shaped(p[1], Shape{rows, hidden}) || !shaped(p[2], Shape{rows}) ||
          !shaped(p[3], Shape{rows})) {
        throw FormatError(where_ + ": " + node + ": weights whose shapes do not fit hidden_size " + std::to_string(hidden));
      }
      skipped_.insert(taken.begin(), taken.end());
      recurrences_[index] = p;
      return;
    }
    // Initializers in ONNX's layout, read by this node alone.
    const auto own = [&](const std::string& name, const char* what) {
      const auto k = parameter(name);
      const auto readers = consumers_.find(name);
      if (!k || readers == consumers_.end() || readers->second != 1) {
        unsupported(node, std::string(what) + " " + detail::onnx_quoted(name) +
                              " that is not a float initializer read by this node alone, nor export_onnx's reordering of one");
      }
      return *k;
    };
    const std::size_t kw = own(w, "a weight W");
    const std::size_t kr = own(r, "a weight R");
    const index_t rows = gates * hidden;
    const Shape& ws = model_.parameters_[kw]->shape();
    if (ws.rank() != 3 || ws[0] != 1 || ws[1] != rows || !shaped(kr, Shape{1, rows, hidden})) {
      throw FormatError(where_ + ": " + node + ": W " + to_string(ws) + " and R " + to_string(model_.parameters_[kr]->shape()) +
                        " do not fit hidden_size " + std::to_string(hidden) + " (one direction)");
    }
    // Row (gate, j) of PyTorch's layout from row (ONNX's block of that gate, j) of ONNX's.
    const auto rearranged = [&](const float* from, index_t halves, index_t columns) {
      Tensor to(halves == 1 ? Shape{rows, columns} : Shape{rows});
      for (index_t h = 0; h < halves; ++h)
        for (index_t block = 0; block < gates; ++block)
          std::copy_n(from + ((h * gates + block) * hidden) * columns, hidden * columns,
                      to.data() + (Step::onnx_gates[static_cast<std::size_t>(block)] * hidden) * columns);
      return to;
    };
    *model_.parameters_[kw] = nn::Parameter(rearranged(model_.parameters_[kw]->data(), 1, ws[2]));
    *model_.parameters_[kr] = nn::Parameter(rearranged(model_.parameters_[kr]->data(), 1, hidden));
    Tensor biases = Tensor(Shape{2 * rows});  // zeros: ONNX's B when there is none
    std::string base = node;
    if (!b.empty()) {
      const std::size_t k = own(b, "a bias B");
      if (!shaped(k, Shape{1, 2 * rows})) {
        throw FormatError(where_ + ": " + node + ": B " + to_string(model_.parameters_[k]->shape()) + " does not fit hidden_size " +
                          std::to_string(hidden));
      }
      std::copy_n(model_.parameters_[k]->data(), 2 * rows, biases.data());
      base = b;
    }
    const auto bias = [&](index_t half, const std::string& name, std::optional<std::size_t> reuse) {
      Tensor t(Shape{rows});
      for (index_t block = 0; block < gates; ++block)
        std::copy_n(biases.data() + (half * gates + block) * hidden, hidden,
                    t.data() + Step::onnx_gates[static_cast<std::size_t>(block)] * hidden);
      if (reuse) {
        *model_.parameters_[*reuse] = nn::Parameter(std::move(t));
        model_.parameter_names_[*reuse] = name;
        return *reuse;
      }
      model_.parameters_.push_back(std::make_unique<nn::Parameter>(std::move(t)));
      model_.parameter_names_.push_back(name);
      return model_.parameters_.size() - 1;
    };
    const std::optional<std::size_t> kb = b.empty() ? std::nullopt : parameter(b);
    const std::size_t k_ih = bias(0, base + ".bias_ih", kb);
    recurrences_[index] = {kw, kr, k_ih, bias(1, base + ".bias_hh", std::nullopt)};
  }

  template <class Layer>
  void add_recurrence(const onnx::NodeProto& n, const std::string& node, int index, std::vector<std::unique_ptr<Layer>>& layers) {
    const std::array<std::size_t, 4>& p = recurrences_.at(index);
    const auto& params = model_.parameters_;
    layers.push_back(std::make_unique<Layer>(Layer{*params[p[0]], *params[p[1]], *params[p[2]], *params[p[3]],
                                                   params[p[0]]->dim(1), params[p[1]]->dim(1), node}));
    const Layer* layer = layers.back().get();
    const Operand x = operand_of(n.input(0), node);
    const auto state = [&](int i) {
      const bool given = n.input_size() > i && !n.input(i).empty();
      return given ? std::optional(operand_of(n.input(i), node)) : std::nullopt;
    };
    const std::array<std::optional<Operand>, 2> states{state(5), state(6)};  // h0, c0
    // [B, L, H]: every step's h, or with Cells an LSTM's c, from X [L, B, I] and states
    // [1, B, H], zeros where the node has none: the same numbers as the operation's own zeros,
    // and one instantiation of it rather than one per set of states (g++ -O2 building
    // run_onnx.cpp peaked at 2.22 GB with one per set, 2.14 without).
    const auto recurrence = [x, states, layer]<bool Cells>(const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& sequences) -> Tensor {
        const Tensor xs = detail::onnx_swap_leading(sequences);
        const auto initial = [&](const std::optional<Operand>& s) {
          if (!s) return Tensor(zeros(Shape{xs.dim(0), layer->hidden}));
          return m.with(*s, v, [](const auto& t) {  // [1, B, H] -> [B, H]
            const Shape& shape = t.shape();
            if (shape.rank() != 3 || shape[0] != 1) throw ShapeError("an initial state [1, batch, hidden], got " + to_string(shape));
            return detail::onnx_view(Tensor(t), {shape[1], shape[2]});
          });
        };
        if constexpr (Layer::cell_type::states == 1) return apply(ops::RecurrentOp<Layer, 1>{layer}, xs, initial(states[0]));
        else return apply(ops::RecurrentOp<Layer, 2, Cells>{layer}, xs, initial(states[0]), initial(states[1]));
      });
    };
    // Y [L, 1, B, H]
    add_step(n.op_type(), n, node, [recurrence](const OnnxModel& m, std::vector<Tensor>& v) -> Tensor {
      const Tensor y = detail::onnx_swap_leading(recurrence.template operator()<false>(m, v));  // [L, B, H]
      return detail::onnx_view(y, {y.dim(0), 1, y.dim(1), y.dim(2)});
    });
    // Y_h and Y_c [1, B, H], the last step's h and c, where the graph reads them.
    const auto read = [&](int k) { return n.output_size() > k && !n.output(k).empty() && consumers_.contains(n.output(k)); };
    const std::size_t y = operands_.at(n.output(0)).index;
    if (read(1)) {
      add_step(n.op_type() + " (last h)", n, node, [y](const OnnxModel&, std::vector<Tensor>& v) -> Tensor {
        const Tensor last = detail::onnx_last_step(v[y]);  // [1, 1, B, H]
        return detail::onnx_view(last, {1, last.dim(2), last.dim(3)});
      }, 1);
    }
    if constexpr (Layer::cell_type::states == 2) {
      if (read(2)) {
        add_step(n.op_type() + " (last c)", n, node, [recurrence](const OnnxModel& m, std::vector<Tensor>& v) -> Tensor {
          return detail::onnx_last_step(detail::onnx_swap_leading(recurrence.template operator()<true>(m, v)));
        }, 2);
      }
    }
  }

  void add_pool(const onnx::NodeProto& n, const std::string& node, int index) {
    const bool max = n.op_type() == "MaxPool";
    arity(n, node, 1, 1);
    if (max) known_attributes(n, node, {"auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "storage_order", "strides"});
    else known_attributes(n, node, {"auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides"});
    if (int_attr(n, "ceil_mode", 0) != 0) unsupported(node, "ceil_mode 1");
    if (int_attr(n, "storage_order", 0) != 0) unsupported(node, "storage_order 1");
    if (spatial_pair(n, node, "dilations", 1) != std::array<index_t, 2>{1, 1})
      unsupported(node, "dilations other than 1");
    const std::string auto_pad = string_attr(n, "auto_pad", "NOTSET");
    if (auto_pad != "NOTSET" && auto_pad != "VALID" && auto_pad != "SAME_UPPER")
      unsupported(node, "auto_pad " + auto_pad);
    const bool same = auto_pad == "SAME_UPPER";
    const auto [kh, kw] = spatial_pair(n, node, "kernel_shape", 0);
    const auto [sh, sw] = spatial_pair(n, node, "strides", 1);
    const auto padded = pool_padding_.find(index);
    const bool pad_node = padded != pool_padding_.end();
    const auto [ph, pw] = pad_node               ? padded->second
                          : auto_pad == "NOTSET" ? axis_pads(n, node)
                                                 : std::array<index_t, 2>{};
    const bool count_pad = pad_node || int_attr(n, "count_include_pad", 0) != 0;
    // duet's average over a same window counts only the input's elements.
    if (same && !max && count_pad) unsupported(node, "auto_pad SAME_UPPER with count_include_pad 1");
    const ops::Pool2dWindow w{kh, kw, sh, sw, same ? nn::PadMode::same : nn::PadMode::pad, ph, pw, count_pad};
    if (const std::string fault = ops::detail::window_fault(w); !fault.empty()) {
      throw ValueError(where_ + ": " + node + ": " + fault);
    }
    const Operand x = operand_of(n.input(0), node);
    if (x.kind != Kind::value) unsupported(node, "pooling an initializer");
    add_step(n.op_type(), n, node, [x, w, max](const OnnxModel&, std::vector<Tensor>& v) -> Tensor {
      return max ? ops::max_pool2d(v[x.index], w) : ops::avg_pool2d(v[x.index], w);
    });
  }

  // torch.onnx.export writes AvgPool2d(count_include_pad=True) as a Pad of zeros before an
  // AveragePool without padding: the pair is duet's average pooling that counts its padding.
  // A Pad of nothing is the identity.
  void add_pad(const onnx::NodeProto& n, const std::string& node, int index) {
    arity(n, node, 2, 4);
    known_attributes(n, node, {"mode"});
    if (string_attr(n, "mode", "constant") != "constant") unsupported(node, "mode " + string_attr(n, "mode", ""));
    const auto pads = integers_.find(n.input(1));
    if (pads == integers_.end()) unsupported(node, "pads that are not a constant int64 tensor");
    if (n.input_size() >= 3 && !n.input(2).empty()) {
      const std::optional<float> value = scalar_constant(n.input(2));
      if (!value || *value != 0.0f) unsupported(node, "a padding value other than a constant 0");
    }
    if (n.input_size() == 4 && !n.input(3).empty()) unsupported(node, "the axes input");
    const std::vector<std::int64_t>& p = pads->second;
    const Operand x = operand_of(n.input(0), node);
    if (n.output(0).empty() || defined(n.output(0))) throw FormatError(where_ + ": " + node + " has no new output name");
    if (std::ranges::all_of(p, [](std::int64_t v) { return v == 0; })) {
      operands_[n.output(0)] = x;
      return;
    }
    const int pool = only_reader(n.output(0));
    const bool spatial =
        p.size() == 8 && p[0] == 0 && p[1] == 0 && p[4] == 0 && p[5] == 0 && p[2] == p[6] && p[3] == p[7];
    if (pool < 0 || pool <= index || proto_.graph().node(pool).op_type() != "AveragePool" || !spatial ||
        axis_pads(proto_.graph().node(pool), node) != std::array<index_t, 2>{0, 0}) {
      unsupported(
          node, "pads " + list_text(p) + " other than before an AveragePool, alike on both sides of each spatial axis");
    }
    pool_padding_[pool] = {p[2], p[3]};
    operands_[n.output(0)] = x;
  }

  void add_batchnorm(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 5, 5);
    known_attributes(n, node, {"epsilon", "momentum", "training_mode"});
    if (int_attr(n, "training_mode", 0) != 0) unsupported(node, "training_mode 1");
    const Operand x = operand_of(n.input(0), node);
    if (x.kind != Kind::value) unsupported(node, "normalising an initializer");
    std::array<Operand, 4> p{};
    for (int i = 1; i <= 4; ++i) {
      parameter_input(n, i, node);
      p[static_cast<std::size_t>(i - 1)] = operand_of(n.input(i), node);
    }
    const index_t channels = model_.parameters_[p[0].index]->numel();
    for (const Operand& o : p) {
      const nn::Parameter& t = *model_.parameters_[o.index];
      if (t.shape().rank() != 1 || t.dim(0) != channels) {
        throw FormatError(where_ + ": " + node + ": its scale, bias, mean and variance must be [C] alike, got " + to_string(t.shape()));
      }
    }
    // The statistics are not trained, as duet's BatchNorm's moving mean and variance.
    for (const Operand& statistic : {p[2], p[3]}) {
      model_.parameters_[statistic.index]->requires_grad = false;
      model_.statistics_.push_back(&*model_.parameters_[statistic.index]);
    }
    const double eps = float_attr(n, "epsilon", 1e-5f);
    const std::string step_who = node;
    add_step("BatchNormalization", n, node, [=](const OnnxModel& m, std::vector<Tensor>& v) {
      // [C] viewed as [C, 1, ...] to broadcast along axis 1 of the input.
      const auto per_channel = [&](const Operand& o) -> Tensor {
        const Tensor& in = v[x.index];
        std::vector<std::int64_t> dims{channels};
        for (int i = 2; i < in.shape().rank(); ++i) dims.push_back(1);
        return apply(detail::OnnxReshapeOp{{}, dims, -1, step_who}, *m.parameters_[o.index]);
      };
      // gamma / sqrt(var + eps), the layer's own rounding (nn::BatchNorm's evaluation_scale):
      // gamma * rsqrt(var + eps) rounds twice, and an exported BatchNorm came back a bit off.
      const Tensor scale = ops::div(per_channel(p[0]), ops::sqrt(ops::add(per_channel(p[3]), eps)));
      return m.with(x, v, [&](const auto& in) -> Tensor {
        return ops::add(ops::mul(ops::sub(in, per_channel(p[2])), scale), per_channel(p[1]));
      });
    });
  }

  // torch's nn.LayerNorm at opset 17. The axes from `axis` on are normalised as the rows of a
  // matrix, so that one reduction over the last axis serves any axis, the rank and sizes being
  // known only as the step runs.
  void add_layernorm(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 3);
    known_attributes(n, node, {"axis", "epsilon", "stash_type"});
    if (int_attr(n, "stash_type", 1) != 1) unsupported(node, "stash_type " + std::to_string(int_attr(n, "stash_type", 1)));
    const Operand x = operand_of(n.input(0), node);
    if (x.kind != Kind::value) unsupported(node, "normalising an initializer");
    const auto parameter_operand = [&](int i) {
      parameter_input(n, i, node);
      return operand_of(n.input(i), node);
    };
    const Operand scale = parameter_operand(1);
    const bool with_bias = n.input_size() == 3 && !n.input(2).empty();
    const Operand bias = with_bias ? parameter_operand(2) : scale;
    const Shape normalized = model_.parameters_[scale.index]->shape();
    if (with_bias && model_.parameters_[bias.index]->shape() != normalized) {
      throw FormatError(where_ + ": " + node + ": its scale " + to_string(normalized) + " and bias " +
                        to_string(model_.parameters_[bias.index]->shape()) + " differ in shape");
    }
    const std::int64_t axis = int_attr(n, "axis", -1);
    const double eps = float_attr(n, "epsilon", 1e-5f);
    const std::string step_who = node;
    add_step("LayerNormalization", n, node, [=](const OnnxModel& m, std::vector<Tensor>& v) {
      const Tensor& in = v[x.index];
      const int rank = in.shape().rank();
      const std::int64_t first = axis < 0 ? axis + rank : axis;
      if (first < 0 || first >= rank || in.shape().rank() - first != normalized.rank() ||
          !std::equal(normalized.begin(), normalized.end(), in.shape().begin() + first)) {
        throw ShapeError(step_who + " normalises from axis " + std::to_string(axis) + " with a scale of shape " +
                         to_string(normalized) + ", which must be those axes' sizes, and is given " + to_string(in.shape()));
      }
      const Tensor rows = apply(detail::OnnxReshapeOp{{}, {-1, normalized.numel()}, -1, step_who}, in);
      const Tensor centred = ops::sub(rows, ops::mean(rows, ops::axes<-1>, ops::keep_dims));
      const Tensor variance = ops::mean(ops::square(centred), ops::axes<-1>, ops::keep_dims);
      const Tensor normal = ops::mul(centred, ops::rsqrt(ops::add(variance, eps)));
      const Tensor y = ops::mul(apply(detail::OnnxReshapeOp{{}, {in.shape().begin(), in.shape().end()}, -1, step_who}, normal),
                                *m.parameters_[scale.index]);
      if (!with_bias) return y;
      return ops::add(y, *m.parameters_[bias.index]);
    });
  }

  void add_reshape(const onnx::NodeProto& n, const std::string& node) {
    detail::OnnxReshapeOp op;
    std::optional<detail::OnnxSizes> target;  // computed by shape arithmetic, resolved as it runs
    op.who = node;
    if (n.op_type() == "Flatten") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"axis"});
      const std::int64_t axis = int_attr(n, "axis", 1);
      if (axis < 0 || axis > max_rank) unsupported(node, "axis " + std::to_string(axis) + " (duet takes 0 to the input's rank)");
      op.flatten_axis = static_cast<int>(axis);
    } else {
      arity(n, node, 2, 2);
      known_attributes(n, node, {"allowzero"});
      target = sizes_for_values(n.input(1), node);
      if (!target) unsupported(node, "a target shape that is not an int64 tensor");
      // The constants of the target are checked now; a size read from a shape is one.
      for (const detail::OnnxSize& e : target->elements)
        if (e.known()) op.dims.push_back(e.constant);
      if (target->elements.size() > static_cast<std::size_t>(max_rank) || std::ranges::count(op.dims, -1) > 1 ||
          std::ranges::any_of(op.dims, [](std::int64_t d) { return d < -1; })) {
        throw FormatError(where_ + ": " + node + ": the target shape " + list_text(op.dims) + " is not a shape");
      }
      if (int_attr(n, "allowzero", 0) != 0 && std::ranges::count(op.dims, 0) > 0) unsupported(node, "allowzero 1 with a size 0");
      if (integers_.contains(n.input(1))) target.reset();  // all constant: op.dims is the target
    }
    const Operand x = operand_of(n.input(0), node);
    add_step(n.op_type(), n, node, [x, op, target](const OnnxModel& m, std::vector<Tensor>& v) {
      if (!target) return m.with(x, v, [&](const auto& in) -> Tensor { return apply(op, in); });
      detail::OnnxReshapeOp resolved = op;
      resolved.dims = OnnxModel::resolve(*target, v);
      // Shape arithmetic can compute any int64.
      if (std::ranges::count(resolved.dims, -1) > 1 ||
          std::ranges::any_of(resolved.dims, [](std::int64_t d) { return d < -1; })) {
        throw ShapeError("the target shape " + list_text(resolved.dims) + " is not a shape");
      }
      return m.with(x, v, [&](const auto& in) -> Tensor { return apply(resolved, in); });
    });
  }

  // --- shape arithmetic ------------------------------------------------------------------------

  // A shape has at most max_rank sizes. Bounding every list here keeps a small file from asking
  // for much memory: a chain of Concats of a list with itself doubles it at each node, and a
  // long constant copied by every node of a chain grows with the square of the file.
  void check_sizes(std::size_t count, const std::string& node) const {
    if (count > static_cast<std::size_t>(max_rank)) {
      throw FormatError(where_ + ": " + node + ": " + std::to_string(count) + " int64s where a shape has at most " +
                        std::to_string(max_rank));
    }
  }

  // The int64 tensor of that name as sizes, if it is one.
  std::optional<detail::OnnxSizes> sizes_of(const std::string& name, const std::string& node) const {
    if (const auto it = sizes_.find(name); it != sizes_.end()) return it->second;
    const auto constant = integers_.find(name);
    if (constant == integers_.end()) return std::nullopt;
    check_sizes(constant->second.size(), node);
    detail::OnnxSizes sizes;
    for (const std::int64_t c : constant->second) sizes.elements.push_back({.constant = c, .value = 0, .axis = std::nullopt});
    return sizes;
  }

  // Sizes a float value's shape is made of (Reshape's target, Expand's shape): never the token
  // ids' (value 0 of a model of ids holds nothing; only a Range reads their sizes).
  std::optional<detail::OnnxSizes> sizes_for_values(const std::string& name, const std::string& node) const {
    std::optional<detail::OnnxSizes> sizes = sizes_of(name, node);
    if (sizes && model_.ids_input_ && (sizes->shape_of == 0 || std::ranges::any_of(sizes->elements, [](const auto& e) {
                                         return e.axis && e.value == 0;
                                       }))) {
      unsupported(node, "a shape read from the token ids' Shape (duet reads their sizes only as a Range's bounds)");
    }
    return sizes;
  }

  // Shape's start and end (opset 15) as the axes [first, last) they keep, where they name them
  // without the rank: both from the front, or a start from the back to the end. None without them.
  std::optional<std::pair<int, int>> shape_part(const onnx::NodeProto& n, const std::string& node) const {
    const onnx::AttributeProto* start = attribute(n, "start");
    const onnx::AttributeProto* end = attribute(n, "end");
    const std::int64_t first = start == nullptr ? 0 : start->i();
    if (first == 0 && end == nullptr) return std::nullopt;
    if (first >= -max_rank && first < 0 && end == nullptr) return std::pair{static_cast<int>(first), 0};
    const std::int64_t last = end == nullptr ? -1 : end->i();
    if (first < 0 || first > max_rank || last < first || last > max_rank) {
      unsupported(node, "start " + std::to_string(first) + " and end " +
                            (end == nullptr ? "(none)" : std::to_string(last)) +
                            " (duet reads both from the front, or a start from the back with no end)");
    }
    return std::pair{static_cast<int>(first), static_cast<int>(last)};
  }

  // Range(start, limit, delta) of one size each, torch's torch.arange(ids.size(1)) and duet's
  // ops::positions, read only as the indices of a Gather along axis 0 (a positional embedding),
  // through Casts to int32 or int64 if any. It makes no step: the Gather computes the positions
  // from the sizes as it runs (OnnxModel::positions_now) and looks them up, as add_id_gather
  // looks the ids up. False for a node that is none of these.
  bool positions(const onnx::NodeProto& n, const std::string& node) {
    const std::string& op = n.op_type();
    const bool range_in = n.input_size() > 0 && ranges_.contains(n.input(op == "Gather" ? n.input_size() - 1 : 0));
    detail::OnnxRange range;
    if (op == "Range") {
      arity(n, node, 3, 3);
      known_attributes(n, node, {});
      for (std::size_t i = 0; i < 3; ++i) {
        const std::string& bound = n.input(static_cast<int>(i));
        const std::optional<detail::OnnxSizes> size = bound.empty() ? std::nullopt : sizes_of(bound, node);
        if (!size || size->shape_of || size->elements.size() != 1) {
          unsupported(node,
                      "a Range whose start, limit or delta is not one int64 (a constant, or a size read from a "
                      "Shape)");
        }
        range.bounds[i] = size->elements.front();
      }
    } else if (op == "Cast" && range_in) {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"to"});
      const std::int64_t to = int_attr(n, "to", 0);
      if (to != onnx::TensorProto::INT32 && to != onnx::TensorProto::INT64)
        unsupported(node, "a Cast of a Range to other than int32 or int64");
      range = ranges_.at(n.input(0));
    } else if (op == "Gather" && range_in) {
      arity(n, node, 2, 2);
      known_attributes(n, node, {"axis"});
      if (int_attr(n, "axis", 0) != 0) unsupported(node, "a Gather by a Range along an axis other than 0");
      const Operand table = operand_of(n.input(0), node);
      add_step("Gather", n, node, {});
      model_.steps_.back().on_ids = [table, range = ranges_.at(n.input(1))](const OnnxModel& m,
                                                                            const std::vector<Tensor>& v,
                                                                            const BasicTensor<std::int32_t>& ids) {
        return m.with(table, v, [&](const auto& rows) -> Tensor {
          if (rows.shape().rank() == 0) throw ShapeError("a Gather of a tensor of rank 0");
          return ops::gather<0>(rows, m.positions_now(range, v, ids, rows.shape()[0]));
        });
      };
      return true;
    } else {
      return false;
    }
    if (n.output(0).empty() || defined(n.output(0)))
      throw FormatError(where_ + ": " + node + " has no new output name");
    ranges_[n.output(0)] = range;
    return true;
  }

  const std::vector<std::int64_t>& constant_ints(const onnx::NodeProto& n, const std::string& node, int input,
                                                 const std::string& what) const {
    const auto it = integers_.find(n.input(input));
    if (it == integers_.end()) unsupported(node, what + " that are not a constant int64 tensor");
    return it->second;
  }

  // Shape, Gather, Unsqueeze, Squeeze, Cast, Concat, and Add, Sub, Mul and Div on int64 tensors,
  // as torch.onnx.export writes x.view(x.size(0), -1) with a dynamic batch, or an attention's
  // heads: they make no step, only the sizes a Reshape or Slice resolves when it runs. False for
  // a node that is not shape arithmetic.
  bool shape_arithmetic(const onnx::NodeProto& n, const std::string& node) {
    const std::string& op = n.op_type();
    const bool binary = op == "Add" || op == "Sub" || op == "Mul" || op == "Div";
    if (binary && n.input_size() == 2 && (integer(n.input(0)) || integer(n.input(1)))) return size_arithmetic(n, node);
    if (binary) return false;
    const bool integers_in = n.input_size() > 0 && integer(n.input(0));
    if (op != "Shape" && !((op == "Gather" || op == "Unsqueeze" || op == "Squeeze" || op == "Cast" || op == "Concat") && integers_in)) {
      if (op == "Gather" && n.input_size() == 2 && !ids_input_name_.empty() && n.input(1) == ids_input_name_) {
        add_id_gather(n, node);
        return true;
      }
      if (op == "Gather" && n.input_size() == 2 && integers_.contains(n.input(1)) && integers_.at(n.input(1)).size() == 1) {
        add_take(n, node);
        return true;
      }
      if (op == "Gather") {
        unsupported(node, "a Gather of a float tensor by other than one constant index (duet reads x[:, -1], and Gathers "
                          "in shape arithmetic)");
      }
      if (op == "Shape" || op == "Cast") {
        unsupported(node, "the operator " + op + " on a float tensor (duet reads it in shape arithmetic only)");
      }
      return false;
    }
    detail::OnnxSizes out;
    if (op == "Shape") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"start", "end"});
      if (integers_in) unsupported(node, "the Shape of an int64 tensor");
      // The token ids are value 0 (which holds nothing in such a model): their sizes are read
      // only as a Range's bounds (sizes_for_values).
      const Operand x = n.input(0) == ids_input_name_ ? Operand{} : operand_of(n.input(0), node);
      const std::optional<std::pair<int, int>> part = shape_part(n, node);
      if (x.kind == Kind::value && part) {
        for (int a = part->first; a < part->second; ++a)
          out.elements.push_back({.constant = 0, .value = x.index, .axis = a});
      } else if (x.kind == Kind::value) {
        out.shape_of = x.index;
      } else if (part) {
        unsupported(node, "start and end of the Shape of a weight");
      } else {
        const Shape shape = x.kind == Kind::parameter ? model_.parameters_[x.index]->shape() : model_.constants_[x.index].shape();
        for (const index_t d : shape) out.elements.push_back({.constant = d, .value = 0, .axis = std::nullopt});
      }
    } else if (op == "Gather") {
      arity(n, node, 2, 2);
      known_attributes(n, node, {"axis"});
      if (int_attr(n, "axis", 0) != 0) unsupported(node, "a Gather of int64s along an axis other than 0");
      const detail::OnnxSizes from = *sizes_of(n.input(0), node);
      const std::vector<std::int64_t>& indices = constant_ints(n, node, 1, "indices");
      check_sizes(indices.size(), node);
      for (const std::int64_t i : indices) {
        if (from.shape_of) {
          if (i < -max_rank || i >= max_rank) throw FormatError(where_ + ": " + node + ": index " + std::to_string(i) + " of a Shape");
          out.elements.push_back({.constant = 0, .value = *from.shape_of, .axis = static_cast<int>(i)});
        } else {
          const auto size = static_cast<std::int64_t>(from.elements.size());
          if (i < -size || i >= size) {
            throw FormatError(where_ + ": " + node + ": index " + std::to_string(i) + " of " + std::to_string(size) + " elements");
          }
          out.elements.push_back(from.elements[static_cast<std::size_t>(i < 0 ? i + size : i)]);
        }
      }
    } else if (op == "Concat") {
      known_attributes(n, node, {"axis"});
      const std::int64_t axis = int_attr(n, "axis", 0);
      if (axis != 0 && axis != -1) throw FormatError(where_ + ": " + node + ": axis " + std::to_string(axis) + " of int64 vectors");
      for (const std::string& name : n.input()) {
        const std::optional<detail::OnnxSizes> part = sizes_of(name, node);
        if (!part) unsupported(node, "concatenating float and int64 tensors");
        if (part->shape_of) unsupported(node, "concatenating a whole Shape (duet reads a Shape's dimensions one by one, by Gather)");
        out.elements.insert(out.elements.end(), part->elements.begin(), part->elements.end());
        check_sizes(out.elements.size(), node);
      }
    } else {
      // Unsqueeze, Squeeze and Cast to int64 leave the elements as they are.
      if (op == "Cast") {
        arity(n, node, 1, 1);
        known_attributes(n, node, {"to"});
        if (int_attr(n, "to", 0) != onnx::TensorProto::INT64) unsupported(node, "a Cast of int64s to another type");
      } else {
        arity(n, node, 1, 2);
        known_attributes(n, node, {});
        if (n.input_size() == 2) static_cast<void>(constant_ints(n, node, 1, "axes"));
      }
      out = *sizes_of(n.input(0), node);
    }
    if (n.output(0).empty() || defined(n.output(0))) throw FormatError(where_ + ": " + node + " has no new output name");
    sizes_[n.output(0)] = std::move(out);
    return true;
  }

  // Add, Sub, Mul or Div of two int64 tensors of one element or of equal lengths (numpy's
  // broadcasting of shape arithmetic's flat tensors), folded now where both are constants.
  bool size_arithmetic(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 2);
    known_attributes(n, node, {});
    const std::optional<detail::OnnxSizes> a = sizes_of(n.input(0), node);
    const std::optional<detail::OnnxSizes> b = sizes_of(n.input(1), node);
    if (!a || !b) unsupported(node, "arithmetic of a float and an int64 tensor");
    if (a->shape_of || b->shape_of) {
      unsupported(node, "arithmetic on a whole Shape (duet reads a Shape's dimensions one by one, by Gather)");
    }
    const std::size_t na = a->elements.size();
    const std::size_t nb = b->elements.size();
    if (na != nb && na != 1 && nb != 1) {
      throw FormatError(where_ + ": " + node + ": int64 tensors of " + std::to_string(na) + " and " +
                        std::to_string(nb) + " elements do not broadcast");
    }
    const char op = n.op_type() == "Add" ? '+' : n.op_type() == "Sub" ? '-' : n.op_type() == "Mul" ? '*' : '/';
    detail::OnnxSizes out;
    for (std::size_t i = 0; i < (na == 1 ? nb : na); ++i) {
      const detail::OnnxSize& x = a->elements[na == 1 ? 0 : i];
      const detail::OnnxSize& y = b->elements[nb == 1 ? 0 : i];
      if (x.known() && y.known()) {
        const std::optional<std::int64_t> r = detail::onnx_arithmetic(op, x.constant, y.constant);
        if (!r) {
          throw FormatError(where_ + ": " + node + ": " + std::to_string(x.constant) + " " + op + " " +
                            std::to_string(y.constant) + " divides by zero or overflows int64");
        }
        out.elements.push_back({.constant = *r});
        continue;
      }
      // A chain of nodes each adding a size to itself would double the work of computing it.
      if (x.terms + y.terms >= 64) unsupported(node, "shape arithmetic of more than 64 terms");
      out.elements.push_back({.op = op,
                              .lhs = std::make_shared<const detail::OnnxSize>(x),
                              .rhs = std::make_shared<const detail::OnnxSize>(y),
                              .terms = x.terms + y.terms + 1});
    }
    if (n.output(0).empty() || defined(n.output(0)))
      throw FormatError(where_ + ": " + node + " has no new output name");
    sizes_[n.output(0)] = std::move(out);
    return true;
  }

  // Slice(data, starts, ends, axes, steps), the axes and steps constant, the starts and ends
  // constant or computed by shape arithmetic (torch splits an attention's packed projection at
  // multiples of its last size / 3): ops::strided_slice with the lists given at run time, whose
  // rules (negative indices from the end, clamping, negative steps) are ONNX's.
  void add_slice(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 3, 5);
    known_attributes(n, node, {});
    const Operand x = operand_of(n.input(0), node);
    const auto bounds = [&](int i, const std::string& what) {
      const std::optional<detail::OnnxSizes> b = sizes_of(n.input(i), node);
      if (!b || b->shape_of)
        unsupported(node, what + " that are not an int64 tensor of constants or of a Shape's dimensions");
      return *b;
    };
    const detail::OnnxSizes starts = bounds(1, "starts");
    const detail::OnnxSizes ends = bounds(2, "ends");
    const std::size_t count = starts.elements.size();
    std::vector<std::int64_t> axes;
    if (n.input_size() > 3 && !n.input(3).empty()) axes = constant_ints(n, node, 3, "axes");
    else
      for (std::size_t a = 0; a < count; ++a) axes.push_back(static_cast<std::int64_t>(a));
    std::vector<std::int64_t> steps(count, 1);
    if (n.input_size() > 4 && !n.input(4).empty()) steps = constant_ints(n, node, 4, "steps");
    check_sizes(count, node);
    if (ends.elements.size() != count || axes.size() != count || steps.size() != count) {
      throw FormatError(where_ + ": " + node + ": starts, ends, axes and steps of different lengths");
    }
    for (std::size_t i = 0; i < axes.size(); ++i) {
      if (axes[i] < -max_rank || axes[i] >= max_rank || std::ranges::count(axes, axes[i]) > 1 || steps[i] == 0 ||
          steps[i] == std::numeric_limits<std::int64_t>::min()) {
        throw FormatError(where_ + ": " + node + ": axes " + list_text(axes) + " and steps " + list_text(steps) +
                          " (each axis once, of a rank duet has; no step 0 or -2^63)");
      }
    }
    add_step("Slice", n, node, [x, starts, ends, axes, steps](const OnnxModel& m, std::vector<Tensor>& v) {
      const std::vector<std::int64_t> first = OnnxModel::resolve(starts, v);
      const std::vector<std::int64_t> last = OnnxModel::resolve(ends, v);
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const int rank = in.shape().rank();
        std::array<index_t, max_rank> begin{}, end{}, stride{};
        end.fill(ops::to_end);
        stride.fill(1);
        std::size_t used = 0;
        for (std::size_t i = 0; i < axes.size(); ++i) {
          const std::int64_t a = axes[i] < 0 ? axes[i] + rank : axes[i];
          if (a < 0 || a >= rank) {
            throw ShapeError("axes " + list_text(axes) + " for an input of shape " + to_string(in.shape()));
          }
          const auto k = static_cast<std::size_t>(a);
          begin[k] = first[i];
          end[k] = last[i];
          stride[k] = steps[i];
          used = std::max(used, k + 1);
        }
        return ops::strided_slice(in, std::span(begin).first(used), std::span(end).first(used), std::span(stride).first(used));
      });
    });
  }

  // ReduceSum's axes are an input from opset 13, the others' from 18 (an attribute before).
  void add_reduce(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 1, 2);
    known_attributes(n, node, {"axes", "keepdims", "noop_with_empty_axes"});
    const Operand x = operand_of(n.input(0), node);
    std::vector<std::int64_t> given = ints_attr(n, "axes");
    if (n.input_size() == 2 && !n.input(1).empty()) given = constant_ints(n, node, 1, "axes");
    check_sizes(given.size(), node);
    std::vector<int> axes;
    for (const std::int64_t a : given) {
      if (a < -max_rank || a >= max_rank || std::ranges::count(given, a) > 1) {
        throw FormatError(where_ + ": " + node + ": axes " + list_text(given) + " (each once, of a rank duet has)");
      }
      axes.push_back(static_cast<int>(a));
    }
    if (axes.empty() && int_attr(n, "noop_with_empty_axes", 0) != 0) {
      if (n.output(0).empty() || defined(n.output(0))) throw FormatError(where_ + ": " + node + " has no new output name");
      operands_[n.output(0)] = x;  // no axes and told so: the identity
      return;
    }
    const bool keep = int_attr(n, "keepdims", 1) != 0;
    const std::string op = n.op_type();
    add_step(op, n, node, [x, axes, keep, op](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const std::span<const int> over(axes);
        const auto reduce = [&](auto f) -> Tensor {
          if (keep) return f(in, over, ops::keep_dims);
          return f(in, over);
        };
        if (op == "ReduceSum") return reduce([](const auto&... a) { return ops::sum(a...); });
        if (op == "ReduceMean") return reduce([](const auto&... a) { return ops::mean(a...); });
        if (op == "ReduceMax") return reduce([](const auto&... a) { return ops::max(a...); });
        if (op == "ReduceProd") return reduce([](const auto&... a) { return ops::prod(a...); });
        return reduce([](const auto&... a) { return ops::min(a...); });
      });
    });
  }

  // Unsqueeze and Squeeze of a float tensor (of int64s they are shape arithmetic): a view
  // with the size-1 axes added or removed, resolved when it runs.
  // ConstantOfShape (a float value, 0 unless given) and Expand (x broadcast to the shape, as
  // x + zeros(shape), whose gradient is x's): torch makes a recurrence's zero initial states
  // so, of the batch's size, which shape arithmetic reads as the network runs. The constant
  // sizes may ask for no more elements than the file's weights hold, so that a small file
  // cannot make a large tensor.
  void add_fill(const onnx::NodeProto& n, const std::string& node) {
    const bool expand = n.op_type() == "Expand";
    arity(n, node, expand ? 2 : 1, expand ? 2 : 1);
    if (expand) known_attributes(n, node, {});
    else known_attributes(n, node, {"value"});
    float value = 0;
    if (const onnx::AttributeProto* a = expand ? nullptr : attribute(n, "value")) {
      if (!a->has_t() || a->t().data_type() != onnx::TensorProto::FLOAT) unsupported(node, "a value that is not a float");
      value = detail::onnx_elements<float>(a->t(), "ConstantOfShape's value", 1, where_)[0];
    }
    const std::optional<detail::OnnxSizes> shape = sizes_for_values(n.input(expand ? 1 : 0), node);
    if (!shape) unsupported(node, "a shape that is not an int64 tensor");
    const index_t weights = weight_elements();
    index_t constant = 1;
    for (const detail::OnnxSize& e : shape->elements) {
      if (!e.known()) continue;
      if (e.constant < 0 || __builtin_mul_overflow(constant, e.constant, &constant) || constant > weights) {
        std::vector<std::int64_t> sizes;
        for (const detail::OnnxSize& f : shape->elements) sizes.push_back(f.known() ? f.constant : -1);
        unsupported(node, "a shape of sizes " + list_text(sizes) + " (-1: read as it runs), more elements than the model's weights,");
      }
    }
    const std::optional<Operand> x = expand ? std::optional(operand_of(n.input(0), node)) : std::nullopt;
    add_step(n.op_type(), n, node,
             [x, sizes = *shape, value, weights](const OnnxModel& m, std::vector<Tensor>& v) -> Tensor {
               const std::vector<std::int64_t> dims = OnnxModel::resolve(sizes, v);
               // Shape arithmetic's sizes are bounded as the constants are (a value's dimension is one
               // that exists).
               index_t computed = 1;
               for (std::size_t i = 0; i < sizes.elements.size(); ++i) {
                 if (dims[i] < 0 || (!sizes.elements[i].axis &&
                                     (__builtin_mul_overflow(computed, dims[i], &computed) || computed > weights))) {
                   throw ShapeError("a shape of sizes " + list_text(dims) +
                                    " (negative, or more elements than the model's weights)");
                 }
               }
               Shape to;
               for (const std::int64_t d : dims) to.push_back(d);
               if (!x) return full(to, value);
               return m.with(*x, v, [&](const auto& in) -> Tensor { return ops::add(in, zeros(to)); });
             });
  }

  // What bounds the sizes a file may ask for: its weights' elements, and 1.
  index_t weight_elements() const {
    index_t weights = 1;
    for (const auto& p : model_.parameters_) weights += p->numel();
    return weights;
  }

  // Tile by constant repeats, one per axis of its input (ONNX's rule; ops::tile also takes
  // fewer or more, as numpy's). As ConstantOfShape's sizes, the copies may be no more than the
  // file's weights have elements, so that a small file cannot make a large tensor.
  void add_tile(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 2);
    known_attributes(n, node, {});
    const std::vector<std::int64_t>& repeats = constant_ints(n, node, 1, "repeats");
    check_sizes(repeats.size(), node);
    index_t copies = 1;
    for (const std::int64_t r : repeats) {
      if (r < 0 || __builtin_mul_overflow(copies, r, &copies) || copies > weight_elements()) {
        unsupported(node, "repeats " + list_text(repeats) +
                              " (negative, or more copies than the model's weights have elements)");
      }
    }
    const std::vector<index_t> times(repeats.begin(), repeats.end());
    const Operand x = operand_of(n.input(0), node);
    add_step("Tile", n, node, [x, times](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        if (in.shape().rank() != static_cast<int>(times.size())) {
          throw ShapeError("repeats of " + std::to_string(times.size()) + " axes for an input of shape " +
                           to_string(in.shape()));
        }
        return ops::tile(in, std::span<const index_t>(times));
      });
    });
  }

  // The rank of an int64 constant, an initializer or a Constant node's value.
  int constant_rank(const std::string& name) const {
    for (const onnx::TensorProto& t : proto_.graph().initializer())
      if (t.name() == name) return t.dims_size();
    const auto at = producers_.find(name);
    if (at == producers_.end()) return -1;
    const onnx::AttributeProto* value = attribute(proto_.graph().node(at->second), "value");
    if (value != nullptr && value->has_t()) return value->t().dims_size();
    const onnx::AttributeProto* ints = attribute(proto_.graph().node(at->second), "value_ints");
    return ints == nullptr ? 0 : 1;  // value_int is a scalar, value_ints a list
  }

  // A Gather by the token ids along axis 0, torch's nn.Embedding: ops::gather<0> of the table's
  // rows (nn::Embedding's lookup, and the same gradient). ONNX's negative indices count from
  // the end; torch's embedding refuses them, and so does duet (an IndexError).
  void add_id_gather(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 2);
    known_attributes(n, node, {"axis"});
    if (int_attr(n, "axis", 0) != 0) unsupported(node, "a Gather by the token ids along an axis other than 0");
    const Operand table = operand_of(n.input(0), node);
    add_step("Gather", n, node, {});
    model_.steps_.back().on_ids = [table](const OnnxModel& m, const std::vector<Tensor>& v,
                                          const BasicTensor<std::int32_t>& ids) {
      return m.with(table, v, [&](const auto& rows) -> Tensor { return ops::gather<0>(rows, ids); });
    };
  }

  // A Gather of one constant index i along an axis of a float tensor, torch's x[:, i]: the
  // slice [i, i + 1) of that axis, which the index's rank 0 then drops (rank 1 keeps it).
  void add_take(const onnx::NodeProto& n, const std::string& node) {
    known_attributes(n, node, {"axis"});
    const int axis = axis_attr(n, node, 0);
    const std::int64_t index = integers_.at(n.input(1)).front();
    const bool drop = constant_rank(n.input(1)) == 0;
    const Operand x = operand_of(n.input(0), node);
    detail::OnnxReshapeOp view;
    view.who = node;
    add_step("Gather", n, node, [x, axis, index, drop, view](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const Shape& s = in.shape();
        const int a = axis < 0 ? axis + s.rank() : axis;
        if (a < 0 || a >= s.rank() || index < -s[a] || index >= s[a]) {
          throw IndexError("index " + std::to_string(index) + " of axis " + std::to_string(axis) + " of a tensor of shape " +
                           to_string(s));
        }
        std::array<index_t, max_rank> begin{}, end{}, stride{};
        end.fill(ops::to_end);
        stride.fill(1);
        const auto k = static_cast<std::size_t>(a);
        begin[k] = index < 0 ? index + s[a] : index;
        end[k] = begin[k] + 1;
        const Tensor slice = ops::strided_slice(in, std::span(begin).first(k + 1), std::span(end).first(k + 1),
                                                std::span(stride).first(k + 1));
        if (!drop) return slice;
        detail::OnnxReshapeOp resolved = view;
        for (int i = 0; i < s.rank(); ++i)
          if (i != a) resolved.dims.push_back(s[i]);
        if (std::ranges::count(resolved.dims, 0) > 0) throw ShapeError("a Gather of an empty tensor, shape " + to_string(s));
        return apply(resolved, slice);
      });
    });
  }

  void add_squeeze(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 1, 2);
    known_attributes(n, node, {});
    const bool add = n.op_type() == "Unsqueeze";
    const Operand x = operand_of(n.input(0), node);
    std::vector<std::int64_t> axes;
    if (n.input_size() == 2 && !n.input(1).empty()) axes = constant_ints(n, node, 1, "axes");
    if (add && axes.empty()) throw FormatError(where_ + ": " + node + " has no axes");
    check_sizes(axes.size(), node);
    detail::OnnxReshapeOp view;
    view.who = node;
    add_step(n.op_type(), n, node, [x, axes, add, view](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const Shape& s = in.shape();
        const int rank = add ? s.rank() + static_cast<int>(axes.size()) : s.rank();
        std::array<bool, max_rank> marked{};
        for (const std::int64_t given : axes) {
          const std::int64_t a = given < 0 ? given + rank : given;
          if (a < 0 || a >= rank || rank > max_rank || marked[static_cast<std::size_t>(a)] ||
              (!add && s[static_cast<int>(a)] != 1)) {
            throw ShapeError(std::string(add ? "Unsqueeze" : "Squeeze") + " axes " + list_text(axes) +
                             " for an input of shape " + to_string(s));
          }
          marked[static_cast<std::size_t>(a)] = true;
        }
        detail::OnnxReshapeOp resolved = view;
        for (int i = 0, from = 0; i < rank; ++i) {
          const bool here = marked[static_cast<std::size_t>(i)];
          if (add) resolved.dims.push_back(here ? 1 : s[from++]);
          else if (!here && !(axes.empty() && s[i] == 1)) resolved.dims.push_back(s[i]);
        }
        // A size 0 in the target would read as "this axis of the input".
        if (std::ranges::count(resolved.dims, 0) > 0) throw ShapeError(std::string(add ? "Unsqueeze" : "Squeeze") + " of an empty tensor, shape " + to_string(s));
        return apply(resolved, in);
      });
    });
  }

  void add_transpose(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 1, 1);
    known_attributes(n, node, {"perm"});
    const std::vector<std::int64_t> given = ints_attr(n, "perm");
    // Checked as int64s: narrowed first, 2^32 + 1 would pass as axis 1. No perm is ONNX's
    // default, the axes reversed, known when the step sees its input's rank.
    std::vector<std::int64_t> sorted = given;
    std::ranges::sort(sorted);
    for (std::size_t i = 0; i < sorted.size(); ++i)
      if (sorted[i] != static_cast<std::int64_t>(i)) throw FormatError(where_ + ": " + node + ": perm " + list_text(given) + " is not a permutation");
    if (given.size() > static_cast<std::size_t>(max_rank)) {
      unsupported(node, "perm " + list_text(given) + " (duet's ONNX import transposes ranks up to " + std::to_string(max_rank) + ")");
    }
    const std::vector<int> given_perm(given.begin(), given.end());
    const Operand x = operand_of(n.input(0), node);
    add_step("Transpose", n, node, [x, given_perm](const OnnxModel& m, std::vector<Tensor>& v) {
      // An initializer too: export_onnx writes a Dense on more than two axes as a MatMul by its
      // transposed weight.
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const int rank = in.shape().rank();
        std::vector<int> perm = given_perm;
        if (perm.empty()) {
          for (int axis = rank - 1; axis >= 0; --axis) perm.push_back(axis);
        }
        if (rank != static_cast<int>(perm.size())) {
          throw ShapeError("perm of " + std::to_string(perm.size()) + " axes for an input of shape " + to_string(in.shape()));
        }
        return ops::transpose(in, perm);
      });
    });
  }

  void add_concat(const onnx::NodeProto& n, const std::string& node) {
    if (n.input_size() < 1) throw FormatError(where_ + ": " + node + " has no input");
    arity(n, node, 1, INT_MAX);
    known_attributes(n, node, {"axis"});
    if (attribute(n, "axis") == nullptr) throw FormatError(where_ + ": " + node + " has no axis");
    const int axis = axis_attr(n, node, 0);
    std::vector<Operand> in;
    for (const std::string& name : n.input()) in.push_back(operand_of(name, node));
    add_step("Concat", n, node, [in, axis](const OnnxModel& m, std::vector<Tensor>& v) {
      const auto rank_of = [&](const Operand& o) { return m.with(o, v, [](const auto& t) { return Tensor(t); }).shape().rank(); };
      const int rank = rank_of(in[0]);
      const int a = axis < 0 ? axis + rank : axis;
      if (a < 0 || a >= rank || rank > 4) {
        throw ShapeError("axis " + std::to_string(axis) + " for inputs of rank " + std::to_string(rank) +
                         " (duet's ONNX import concatenates ranks up to 4)");
      }
      // Pairwise: concat<Axis>(a, b) is one instantiation per axis.
      Tensor acc = m.with(in[0], v, [](const auto& t) { return Tensor(t); });
      if (in.size() == 1) return acc;
      for (std::size_t i = 1; i < in.size(); ++i) {
        acc = m.with(in[i], v, [&](const auto& t) { return detail::onnx_concat(acc, t, a); });
      }
      return acc;
    });
  }

  const onnx::ModelProto& proto_;
  std::string where_;
  OnnxModel model_;
  std::map<std::string, Operand> operands_;
  std::map<std::string, std::vector<std::int64_t>> integers_;
  std::map<std::string, detail::OnnxSizes> sizes_;  // int64 tensors shape arithmetic made
  std::map<std::string, detail::OnnxRange> ranges_;  // Ranges of sizes, and Casts of them (positions)
  std::map<std::string, int> consumers_;  // the nodes and graph outputs reading each value
  std::map<std::string, int> readers_;    // the last node reading each value
  std::map<std::string, int> producers_;  // the node writing each value
  // A GRU's or LSTM's parameters, weight_ih, weight_hh, bias_ih, bias_hh (prepare_recurrence).
  std::map<int, std::array<std::size_t, 4>> recurrences_;
  std::set<int> skipped_;
  std::map<int, std::array<index_t, 2>>
      pool_padding_;  // an AveragePool's padding (height, width), from the Pad before it
};

// The model in the bytes of an ONNX file; `where` names them in errors.
inline OnnxModel load_onnx_bytes(std::span<const std::byte> bytes, const std::string& where = "ONNX data") {
  const onnx::ModelProto proto = detail::parse_onnx(bytes, where);
  return OnnxBuilder(proto, where).build();
}

// Reads an ONNX model file into a network duet runs in either mode (see the top of this file).
inline OnnxModel load_onnx(const std::filesystem::path& path) {
  const std::string where = detail::onnx_where(path);
  const std::vector<unsigned char> bytes = duet::detail::read_whole_file(path, where);
  return load_onnx_bytes(std::as_bytes(std::span(bytes)), where);
}

// Copies the float initializers of an ONNX file into a network defined in C++ (any cell, in
// either mode: a compile-time Cell such as examples/lenet5.hpp's LeNet5), each parameter from
// the initializer of its own name ("fc1.weight", as torch.onnx.export names a module's weight),
// or of the name `name_map` gives for it (network's name -> initializer's name: duet's BatchNorm
// "bn.gamma" from PyTorch's "bn.weight"). All or nothing: every parameter must find an
// initializer of its shape, or nothing is copied and a duet::FormatError names the first that
// does not (with both shapes); a name_map entry for no parameter of the network is a
// duet::ValueError. Returns, in ckpt_not_load, the float initializers that were not used.
inline CheckpointLoad load_onnx_weights(const std::filesystem::path& path, nn::DynamicCell& net,
                                        const std::map<std::string, std::string>& name_map = {}) {
  const std::string where = detail::onnx_where(path);
  const std::vector<unsigned char> bytes = duet::detail::read_whole_file(path, where);
  const onnx::ModelProto proto = detail::parse_onnx(std::as_bytes(std::span(bytes)), where);
  std::map<std::string, const onnx::TensorProto*> initializers;
  for (const onnx::TensorProto& t : proto.graph().initializer()) initializers[t.name()] = &t;
  const auto targets = duet::detail::parameter_targets(net, where);
  for (const auto& [name, source] : name_map) {
    if (std::ranges::find(targets, name, &duet::detail::CheckpointTarget<float>::name) == targets.end()) {
      throw ValueError(where + ": the name map gives " + detail::onnx_quoted(source) + " for " + detail::onnx_quoted(name) +
                       ", which is not a parameter of " + net.type_name());
    }
  }
  std::vector<std::vector<float>> values;
  std::set<std::string> used;
  for (const auto& [name, tensor] : targets) {
    const auto mapped = name_map.find(name);
    const std::string& source = mapped == name_map.end() ? name : mapped->second;
    const std::string parameter = "the network's parameter " + detail::onnx_quoted(name) + " " + to_string(tensor->shape());
    const auto found = initializers.find(source);
    if (found == initializers.end()) {
      throw FormatError(where + ": " + parameter + " has no initializer " + detail::onnx_quoted(source) +
                        (mapped == name_map.end() ? " (give its name in the name map)" : ""));
    }
    const onnx::TensorProto& t = *found->second;
    const std::string what = "initializer " + detail::onnx_quoted(source);
    if (t.data_type() != onnx::TensorProto::FLOAT) {
      throw FormatError(where + ": " + parameter + " is float32, " + what + " has ONNX data type " +
                        std::to_string(t.data_type()));
    }
    const Shape shape = detail::onnx_shape(t, what, where);
    if (!(shape == tensor->shape())) {
      throw FormatError(where + ": " + parameter + " does not fit " + what + " " + to_string(shape));
    }
    values.push_back(detail::onnx_elements<float>(t, what, shape.numel(), where));
    used.insert(source);
  }
  const auto parameters = net.parameters();  // targets' order
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    nn::Parameter& p = *parameters[i].parameter;
    p.set_data(Tensor(p.shape(), std::span<const float>(values[i])));
  }
  CheckpointLoad left;
  for (const auto& [name, t] : initializers)
    if (t->data_type() == onnx::TensorProto::FLOAT && !used.contains(name)) left.ckpt_not_load.push_back(name);
  return left;
}


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
