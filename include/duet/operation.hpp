// The operation contract: what every node of a graph and every record of a tape is.
//
// An operation is a small value type (often empty, or a pointer to the layer that owns its
// parameters). It is written once and serves both modes: PyNative calls its shape rule and
// kernel on live tensors (eager.hpp), graph mode on the nodes of a captured graph
// (graph.hpp, evaluator.hpp). Deriving from ops::Primitive<Self> gives the defaults, so an
// operation states only what differs from them:
//
//   static constexpr int arity                       number of inputs (required)
//   static constexpr ShapeResult infer_static(std::span<const Shape>)
//                                                    its shape rule, constexpr: run on patterns
//                                                    at compile time, on shapes at run time
//                                                    (required)
//   template <class Backend, class T> void run(const graph::KernelArgs&) const
//                                                    its kernel; T is the type of the value it
//                                                    makes (required unless a view)
//   static std::string op_name()                     what it does, for graph_ir (required)
//
//   ShapeResult infer(std::span<const Shape>) const  default: infer_static; an operation whose
//                                                    sizes live in its layer overrides it
//   std::string label() const                        who does it, for run-time errors; default
//                                                    op_name()
//   using layer_type                                 the name compile-time errors show; default
//                                                    the operation itself
//   using value_type                                 the type of its value when it is not its
//                                                    first input's
//   is_view (output is input 0's elements, from view_offset() on, with another shape; no
//   kernel, no copy), is_elementwise
//   (unary, same shape: runs in place, fuses as an epilogue), is_sink (makes no value, runs
//   for its side effects), has_side_effects (a view whose kernel still runs), has_parameters:
//   all false by default.
//
// Differentiation. For each input K, `template <std::size_t K> auto grad_op() const` returns
// the operation that makes d(loss)/d(input K) from what it reads; the gradient operation
// names what it reads in `static constexpr std::array reads` (graph::Operand values: the
// incoming gradient, an input, the output). An input that has no gradient (integer labels, a
// condition) returns ops::NoGradient, and a gradient that reaches it is an error, unless the
// operation says `static constexpr bool stops_gradient = true` (no gradient is due: a
// stop_gradient, a zeros_like). An operation with parameters writes their gradients from
// grad_op<0>(), and from parameter_grad_op() when input 0 needs none. An operation either
// gives every input's gradient (DifferentiableOperation), or says `static constexpr bool
// differentiable = false` (argmax): one that gives some but not all is a compile error
// wherever it is used, so a missing gradient is never a silent zero.
#pragma once

#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shape.hpp"
#include "diagnostics.hpp"

namespace duet {

namespace graph {

// What an operation's kernel reads and writes. Inputs and output are untyped here because one
// node may mix element types (float logits, int32 labels); each op casts to what it knows.
struct KernelArgs {
  const void* const* inputs;
  const Shape* input_shapes;
  void* output;
  const Shape& output_shape;

  template <class U>
  const U* in(std::size_t k = 0) const {
    return static_cast<const U*>(inputs[k]);
  }
  const Shape& in_shape(std::size_t k = 0) const { return input_shapes[k]; }
  template <class U>
  U* out() const {
    return static_cast<U*>(output);
  }
};

// What a gradient op reads, by its place around the forward op it differentiates. Inputs past
// input2 are input_operand(k) (concat's gradients read up to all N inputs), so output stands
// clear of them.
enum class Operand : unsigned char { grad, input0, input1, input2, output = 255 };

constexpr Operand input_operand(std::size_t k) { return static_cast<Operand>(1 + k); }

}  // namespace graph

namespace ops {

// The defaults of the contract. Self is the operation deriving from it.
template <class Self>
struct Primitive {
  using layer_type = Self;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_sink = false;
  static constexpr bool has_side_effects = false;
  static constexpr bool has_parameters = false;

  ShapeResult infer(std::span<const Shape> in) const { return Self::infer_static(in); }
  std::string label() const { return Self::op_name(); }
};

// What grad_op<K>() returns for an input that has no gradient.
struct NoGradient {};

// The functions duet's operation headers define, by the names users call them with. The
// gradient harness (tests/ops_gradients.cpp) runs each in both modes and fails on a name it
// has no case for, so an operation cannot be added unchecked. A header lists its own:
//   inline const bool arithmetic_listed = ops::list_operations({"add", "sub", ...});
inline std::vector<std::string_view>& catalogue() {
  static std::vector<std::string_view> names;
  return names;
}
inline bool list_operations(std::initializer_list<std::string_view> names) {
  catalogue().insert(catalogue().end(), names);
  return true;
}

namespace detail {
// "1, 2, 3": an operation's list of axes or sizes, in its name and its messages.
template <class V>
std::string list_text(std::span<const V> values) {
  std::string out;
  for (V v : values) {
    if (!out.empty()) out += ", ";
    out += std::to_string(v);
  }
  return out;
}
template <class V>
std::string list_text(std::initializer_list<V> values) {
  return list_text(std::span<const V>(values.begin(), values.size()));
}
}  // namespace detail

}  // namespace ops

// An operation a graph or a tape can hold: its shape rule, its name and its flags.
template <class Op>
concept Operation = requires(const Op& op, std::span<const Shape> shapes) {
  { Op::arity } -> std::convertible_to<int>;
  { Op::infer_static(shapes) } -> std::same_as<ShapeResult>;
  { op.infer(shapes) } -> std::same_as<ShapeResult>;
  { Op::op_name() } -> std::convertible_to<std::string>;
  { op.label() } -> std::convertible_to<std::string>;
  typename Op::layer_type;
  { Op::is_view } -> std::convertible_to<bool>;
  { Op::is_elementwise } -> std::convertible_to<bool>;
};

// Whether Op writes gradients of parameters it owns (a layer's weight).
template <class Op>
constexpr bool has_parameters() {
  if constexpr (requires { Op::has_parameters; }) return Op::has_parameters;
  else return false;
}

namespace detail {

// A grad_op<K> that deduces void (`if constexpr (K == 0) return ...;` with no other branch)
// gives no gradient: it counts as missing, so the contract's check names the input.
template <class Op, std::size_t K>
concept has_grad_op = requires(const Op& op) { op.template grad_op<K>(); } &&
                      !std::is_void_v<decltype(std::declval<const Op&>().template grad_op<K>())>;

template <class Op>
constexpr bool declares_non_differentiable() {
  if constexpr (requires { Op::differentiable; }) return !Op::differentiable;
  else return false;
}

template <class Op>
constexpr std::size_t gradients_given() {
  return [&]<std::size_t... K>(std::index_sequence<K...>) {
    return (std::size_t{0} + ... + std::size_t{has_grad_op<Op, K>});
  }(std::make_index_sequence<static_cast<std::size_t>(Op::arity)>{});
}

template <class Op>
constexpr bool has_parameter_grad_op() {
  if constexpr (!duet::has_parameters<Op>()) return true;
  else return requires(const Op& op) { op.parameter_grad_op(); };
}

}  // namespace detail

// An operation whose every input has a gradient rule (possibly NoGradient), and that does not
// declare itself non-differentiable.
template <class Op>
concept DifferentiableOperation = Operation<Op> && !detail::declares_non_differentiable<Op>() &&
                                  detail::gradients_given<Op>() == static_cast<std::size_t>(Op::arity) &&
                                  detail::has_parameter_grad_op<Op>();

namespace diagnostic {

template <class Op>
struct is_an_operation {
  static constexpr bool value = false;
};
template <class Op, std::size_t Input>
struct gives_the_gradient_of_input {
  static constexpr bool value = false;
};

// Checks Op against the contract where it enters a graph or a tape (instantiated there with
// sizeof); a class, so that one operation is reported once wherever it is used.
template <class Op>
struct check_operation {
  static_assert(Operation<Op> || is_an_operation<Op>::value,
                "duet: this type is used as an operation but does not meet duet::Operation (arity, "
                "infer_static, op_name; derive from duet::ops::Primitive<Self> for the rest)");
  static constexpr std::size_t first_missing = [] {
    if constexpr (!Operation<Op>) {
      return std::size_t{0};
    } else {
      std::size_t missing = static_cast<std::size_t>(Op::arity);
      [&]<std::size_t... K>(std::index_sequence<K...>) {
        ((missing = !detail::has_grad_op<Op, K> && missing == static_cast<std::size_t>(Op::arity) ? K : missing),
         ...);
      }(std::make_index_sequence<static_cast<std::size_t>(Op::arity)>{});
      return missing;
    }
  }();
  static constexpr bool partial = Operation<Op> && !detail::declares_non_differentiable<Op>() &&
                                  detail::gradients_given<Op>() > 0 &&
                                  detail::gradients_given<Op>() < static_cast<std::size_t>(Op::arity);
  static_assert(!partial || gives_the_gradient_of_input<typename Op::layer_type, first_missing>::value,
                "duet: an operation gives the gradient of some inputs but not of the one named in the "
                "condition; define grad_op<K>() for every input K (ops::NoGradient where there is none), "
                "or declare `static constexpr bool differentiable = false`");
};

}  // namespace diagnostic

// Where a view's elements begin in its input's, in elements: 0 (the input's first), unless
// the view says otherwise with `index_t view_offset(const Shape& input) const` (a slice along
// the first axis).
template <class Op>
index_t view_offset(const Op& op, const Shape& input) {
  if constexpr (requires { op.view_offset(input); }) return op.view_offset(input);
  else return 0;
}

// Whether Op's NoGradient inputs get no gradient because none is due, not because it is
// unknown (`static constexpr bool stops_gradient = true`): ops::stop_gradient, which cuts it
// on purpose, and zeros_like, whose output does not depend on its input's values. Such an
// input is as one the output does not depend on.
template <class Op>
constexpr bool stops_gradient() {
  if constexpr (requires { Op::stops_gradient; }) return Op::stops_gradient;
  else return false;
}

// Whether a gradient reaching a NoGradient input of type In, of an operation Op whose output
// is Out, would be lost: integer labels, conditions and comparisons' outputs carry none to
// lose, and an operation that stops the gradient loses none by definition. Both modes refuse
// the loss at run time with this message.
template <class Op, class In, class Out>
inline constexpr bool loses_gradient =
    !stops_gradient<Op>() && std::is_floating_point_v<In> && std::is_floating_point_v<Out>;

inline std::string lost_gradient_message(const std::string& op, std::size_t k) {
  const std::string input = std::to_string(k);
  return "duet::grad: " + op + " has no gradient for input " + input + " (its grad_op<" + input +
         ">() is ops::NoGradient), but that input depends on what is differentiated: its gradient would be a "
         "silent zero";
}

inline constexpr const char* nothing_differentiated_message =
    "duet: the function differentiated (a loss, in a training step) does not depend on anything being "
    "differentiated (no parameter, nor the input asked for, reaches it: an ops::stop_gradient or a "
    "zeros_like on the only path?); its gradients would be silent zeros";

// Whether grad_op<K>() of Op gives an actual gradient, not NoGradient.
template <class Op, std::size_t K>
constexpr bool input_has_gradient() {
  if constexpr (!detail::has_grad_op<Op, K>) return false;
  else return !std::is_same_v<decltype(std::declval<const Op&>().template grad_op<K>()), ops::NoGradient>;
}

// Whether input K of Op is cut off from its output for differentiation: the operation stops
// the gradient there. Through every other input, even one without a gradient (a comparison's,
// whose output is piecewise constant in it), the output depends on the input: a gradient
// taken through it is zero, not a function that depends on nothing.
template <class Op, std::size_t K>
constexpr bool cuts_gradient() {
  return stops_gradient<Op>() && !input_has_gradient<Op, K>();
}

}  // namespace duet
