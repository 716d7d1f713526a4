// Shape rules' results and how a broken rule is reported: a static_assert naming the layer,
// its requirement and the input shape when the shapes are known at compile time, a
// duet::ShapeError with the same words when they are known only at run time.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "config.hpp"
#include "error.hpp"
#include "shape.hpp"

namespace duet {

enum class ShapeFault : unsigned char {
  none,
  last_dimension,     // the input's last dimension must equal `expected`
  min_rank,           // the input's rank must be at least `expected`
  exact_rank,         // the input's rank must be exactly `expected`
  element_count,      // the input must hold `expected` elements per sample
  shapes_differ,      // two inputs must have the same shape
  batch_dimension,    // the input must have a batch dimension in front: rank at least `expected`
  broadcast,          // the two inputs' shapes must broadcast together (numpy's rule)
  inner_dimensions,   // a product's inner dimensions must match (matmul: a's columns, b's rows)
  empty_reduction,    // an axis reduced by max, min or argmax must not be empty
  total_elements,     // the input must hold `expected` elements (reshape)
  elements_multiple,  // the input's element count must be a multiple of `expected` (reshape with -1)
  axis_not_one,       // the input's axis `expected` must have size 1 (squeeze)
  sizes_except_axis,  // every input's sizes must match input 0's except along axis `expected` (concat)
  axis_size,          // the input's size along the operation's axis must be `expected` (split)
  // the input's size along the operation's axis must cut into `expected` chunks (chunk)
  chunk_count,
  slice_range,        // the input's axis `expected` must hold the slice's range (slice)
  channel_dimension,  // the input's dimension 1 (channels, NCHW) must equal `expected` (BatchNorm, Conv)
  spatial_size,       // each spatial axis must be at least `expected`: the (dilated) window less the padding
  class_labels,       // a class loss's labels: the logits' shape without its last axis (`expected` 1: class
                      // indices) or the logits' shape (`expected` 0: a distribution per row)
  axis_twice,         // the axes listed name the input's axis `expected` twice, counted from both ends
  broadcast_to,       // the input must broadcast to the operation's target shape (broadcast_to)
  initial_state,      // a recurrence's initial state must be [batch, `expected`], the batch its sequences'
  empty_sequence,     // a recurrence's sequences [batch, length, input] must have a step (length at least 1)
  // input 1 (indices) must have input 0's rank and no axis larger than it but axis `expected` (gather_elements)
  indices_fit,
  axis_at_least,  // the input's size along the operation's axis must be at least `expected` (topk)
  axis_multiple,  // the input's size along the operation's axis must be a multiple of `expected` (unflatten with -1)
  axes_in_order,  // the operation's start axis, axis `expected` of the input, must not come after its end axis
                  // (flatten)
  batch_first_sequences,  // the input must be [batch, length, `expected`] (attention, batch_first)
  // input 1 (an attention's key padding mask) must be [batch, length] of the attention's input
  // [batch, length, `expected`], which input 0 (the scores, [batch, heads, length, length]) gives
  key_padding_mask,
  // input 1 (an attention's attn_mask) must be [length, length] or [batch * heads, length, length]
  // of the attention's input [batch, length, `expected`], which input 0 (the scores) gives
  attn_mask,
};

// What a shape rule returns: the output shape and, if the inputs break the rule, which way.
// On a fault the shape is still the rule's best guess, so the layers after it are checked
// against something sane and one mistake gives one error.
struct ShapeResult {
  Shape shape;
  ShapeFault fault = ShapeFault::none;
  index_t expected = 0;
  int input = 0;  // which input broke the rule

  constexpr bool ok() const { return fault == ShapeFault::none; }
};

constexpr ShapeResult fault(Shape fallback, ShapeFault f, index_t expected, int input = 0) {
  return ShapeResult{fallback, f, expected, input};
}

// The input a broadcast fault's culprit does not broadcast with: `expected` when it names
// another input (an operation of three inputs, such as where), else the other of two.
constexpr std::size_t broadcast_partner(const ShapeResult& r) {
  if (r.expected != r.input) return static_cast<std::size_t>(r.expected);
  return r.input == 0 ? 1 : 0;
}

// "nn::Dense<784, 512> 'dense_relu_sequential.0' expects an input whose last dimension is 784,
// got [64, 100]": the run-time wording of a broken rule.
DUET_DETAIL_COMPILED std::string describe_fault(const ShapeResult& r, std::string_view layer,
                                                std::span<const Shape> inputs);

// Compile-time reports. The type names are the message: compilers print the failing
// condition with its template arguments, which then reads as
//   layer_accepts<duet::nn::Dense<784, 512>, last_dimension_must_be<784>, input_shape<64, 100>>
namespace diagnostic {

template <index_t... Dims>
struct input_shape {};
template <index_t... TrailingDims>
struct input_shape_after_unknown_leading_dims {};

template <index_t N>
struct last_dimension_must_be {};
template <index_t N>
struct rank_must_be_at_least {};
template <index_t N>
struct rank_must_be {};
template <index_t N>
struct elements_per_sample_must_be {};
struct inputs_must_have_the_same_shape {};
struct labels_must_have_the_logits_shape_without_the_class_axis {};
struct labels_must_have_the_logits_shape {};
// The other input's shape, which this one must broadcast with.
template <class OtherShape>
struct must_broadcast_with {};
template <index_t N>
struct batch_dimension_missing_rank_must_be_at_least {};
// The other factor's shape, whose rows this one's columns must match (after transposes).
template <class OtherShape>
struct inner_dimension_must_match {};
struct reduced_axes_must_not_be_empty {};
struct must_broadcast_to_the_target_shape {};
template <index_t N>
struct element_count_must_be {};
template <index_t N>
struct element_count_must_be_a_multiple_of {};
template <index_t N>
struct axis_must_have_size_1 {};
template <index_t N>
struct sizes_must_match_input_0_except_along_axis {};
template <index_t N>
struct size_along_the_axis_must_be {};
template <index_t N>
struct size_along_the_axis_must_cut_into_chunks {};
template <index_t N>
struct axis_must_hold_the_slice {};
template <index_t N>
struct axis_must_be_named_once {};
template <index_t N>
struct channel_dimension_must_be {};
template <index_t N>
struct initial_state_must_be_batch_by {};
struct sequence_length_must_be_at_least_1 {};
// The input's shape, which the indices must fit in but along axis N.
template <index_t N, class InputShape>
struct indices_must_fit_in_except_along_axis {};
template <index_t N>
struct size_along_the_axis_must_be_at_least {};
template <index_t N>
struct size_along_the_axis_must_be_a_multiple_of {};
template <index_t N>
struct end_axis_must_not_come_before_start_axis {};
template <index_t N>
struct input_must_be_batch_first_sequences_batch_length_by {};
// The attention's input [batch, length, E], whose first two sizes the mask must have.
template <class InputShape>
struct key_padding_mask_must_be_batch_by_length_of_input {};
// The attention's input [batch, length, E], whose length the mask's last two sizes must be.
template <class InputShape>
struct attn_mask_must_be_length_by_length_of_input {};
// A window's extent (a convolution's kernel, dilated) less the padding: a smaller input leaves
// no output.
template <index_t N>
struct spatial_sizes_must_be_at_least {};

// Not derived from std::false_type: compilers would then print integral_constant<bool, false>
// instead of this type's name.
template <class Layer, class Requirement, class InputShape>
struct layer_accepts {
  static constexpr bool value = false;
};

template <ShapeFault F, index_t N>
constexpr auto requirement() {
  if constexpr (F == ShapeFault::last_dimension)
    return last_dimension_must_be<N>{};
  else if constexpr (F == ShapeFault::min_rank)
    return rank_must_be_at_least<N>{};
  else if constexpr (F == ShapeFault::exact_rank)
    return rank_must_be<N>{};
  else if constexpr (F == ShapeFault::element_count)
    return elements_per_sample_must_be<N>{};
  else if constexpr (F == ShapeFault::batch_dimension)
    return batch_dimension_missing_rank_must_be_at_least<N>{};
  else if constexpr (F == ShapeFault::empty_reduction)
    return reduced_axes_must_not_be_empty{};
  else if constexpr (F == ShapeFault::total_elements)
    return element_count_must_be<N>{};
  else if constexpr (F == ShapeFault::elements_multiple)
    return element_count_must_be_a_multiple_of<N>{};
  else if constexpr (F == ShapeFault::axis_not_one)
    return axis_must_have_size_1<N>{};
  else if constexpr (F == ShapeFault::sizes_except_axis)
    return sizes_must_match_input_0_except_along_axis<N>{};
  else if constexpr (F == ShapeFault::axis_size)
    return size_along_the_axis_must_be<N>{};
  else if constexpr (F == ShapeFault::chunk_count)
    return size_along_the_axis_must_cut_into_chunks<N>{};
  else if constexpr (F == ShapeFault::slice_range)
    return axis_must_hold_the_slice<N>{};
  else if constexpr (F == ShapeFault::axis_twice)
    return axis_must_be_named_once<N>{};
  else if constexpr (F == ShapeFault::channel_dimension)
    return channel_dimension_must_be<N>{};
  else if constexpr (F == ShapeFault::initial_state)
    return initial_state_must_be_batch_by<N>{};
  else if constexpr (F == ShapeFault::empty_sequence)
    return sequence_length_must_be_at_least_1{};
  else if constexpr (F == ShapeFault::spatial_size)
    return spatial_sizes_must_be_at_least<N>{};
  else if constexpr (F == ShapeFault::broadcast_to)
    return must_broadcast_to_the_target_shape{};
  else if constexpr (F == ShapeFault::axis_at_least)
    return size_along_the_axis_must_be_at_least<N>{};
  else if constexpr (F == ShapeFault::axis_multiple)
    return size_along_the_axis_must_be_a_multiple_of<N>{};
  else if constexpr (F == ShapeFault::axes_in_order)
    return end_axis_must_not_come_before_start_axis<N>{};
  else if constexpr (F == ShapeFault::batch_first_sequences)
    return input_must_be_batch_first_sequences_batch_length_by<N>{};
  else if constexpr (F == ShapeFault::class_labels && N == 1)
    return labels_must_have_the_logits_shape_without_the_class_axis{};
  else if constexpr (F == ShapeFault::class_labels)
    return labels_must_have_the_logits_shape{};
  else
    return inputs_must_have_the_same_shape{};
}

// ShapeOf is any type with a `static constexpr Shape shape`.
template <class ShapeOf, std::size_t... I>
constexpr auto shape_type(std::index_sequence<I...>) {
  constexpr Shape s = ShapeOf::shape;
  if constexpr (s.leading_unknown())
    return input_shape_after_unknown_leading_dims<s[static_cast<int>(I)]...>{};
  else
    return input_shape<s[static_cast<int>(I)]...>{};
}

// A class, so that one (layer, requirement, input shape) is reported once however many
// captures meet it. Reported by instantiating it: static_cast<void>(sizeof(rejection<...>)).
template <class Layer, class Requirement, class InputShape>
struct rejected {
  static_assert(layer_accepts<Layer, Requirement, InputShape>::value,
                "duet: a layer cannot accept its input's shape (the condition names the layer, "
                "its requirement and the input shape; -1 is a dynamic dimension)");
};

template <class ShapeOf>
using shape_type_of = decltype(shape_type<ShapeOf>(std::make_index_sequence<static_cast<std::size_t>(ShapeOf::shape.rank())>{}));

// The report of two inputs that do not broadcast: the culprit's shape, and the other's in the
// requirement, so that both are named.
template <class Layer, class Culprit, class Other>
using broadcast_rejection = rejected<Layer, must_broadcast_with<shape_type_of<Other>>, shape_type_of<Culprit>>;
// The report of a product whose factors' inner dimensions differ: both shapes named.
template <class Layer, class Culprit, class Other>
using inner_dimension_rejection =
    rejected<Layer, inner_dimension_must_match<shape_type_of<Other>>, shape_type_of<Culprit>>;

// An attention's input [batch, length, E] from its scores' shape [batch, heads, length, length].
template <class Scores, index_t E>
struct attention_input_of {
  static constexpr Shape shape{Scores::shape[0], Scores::shape[2], E};
};
template <class Scores, index_t E>
using attention_input_shape = shape_type_of<attention_input_of<Scores, E>>;

// The report of Layer's rule broken with fault F (N being what it expected) by an input whose
// shape is ShapeOf::shape.
template <class Layer, ShapeFault F, index_t N, class ShapeOf>
using rejection = rejected<Layer, decltype(requirement<F, N>()),
                           decltype(shape_type<ShapeOf>(
                               std::make_index_sequence<static_cast<std::size_t>(ShapeOf::shape.rank())>{}))>;

// Reports Op's shape rule broken by inputs whose shapes compile time knows (Inputs::shape...):
// the op, its requirement and the culprit's shape, and the other operand's shape where the
// fault is between two. Instantiated where the op meets its inputs (a capture, or a call on
// static tensors), so that the error points at that line.
template <class Op, class... Inputs>
constexpr void report_static_fault() {
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, sizeof...(Inputs)>{Inputs::shape...});
  if constexpr (!r.ok()) {
    using In = std::tuple<Inputs...>;
    using Layer = typename Op::layer_type;
    using Culprit = std::tuple_element_t<static_cast<std::size_t>(r.input), In>;
    if constexpr (r.fault == ShapeFault::broadcast) {
      static_cast<void>(sizeof(broadcast_rejection<Layer, Culprit, std::tuple_element_t<broadcast_partner(r), In>>));
    } else if constexpr (r.fault == ShapeFault::indices_fit) {
      using Input = shape_type_of<std::tuple_element_t<0, In>>;
      static_cast<void>(
          sizeof(rejected<Layer, indices_must_fit_in_except_along_axis<r.expected, Input>, shape_type_of<Culprit>>));
    } else if constexpr (r.fault == ShapeFault::key_padding_mask) {
      static_cast<void>(sizeof(rejected<Layer,
                                        key_padding_mask_must_be_batch_by_length_of_input<
                                            attention_input_shape<std::tuple_element_t<0, In>, r.expected>>,
                                        shape_type_of<Culprit>>));
    } else if constexpr (r.fault == ShapeFault::attn_mask) {
      static_cast<void>(sizeof(rejected<Layer,
                                        attn_mask_must_be_length_by_length_of_input<
                                            attention_input_shape<std::tuple_element_t<0, In>, r.expected>>,
                                        shape_type_of<Culprit>>));
    } else if constexpr (r.fault == ShapeFault::inner_dimensions) {
      static_cast<void>(
          sizeof(inner_dimension_rejection<Layer, Culprit, std::tuple_element_t<r.input == 0 ? 1 : 0, In>>));
    } else {
      static_cast<void>(sizeof(rejection<Layer, r.fault, r.expected, Culprit>));
    }
  }
}

}  // namespace diagnostic

namespace detail {

// The construct running on this thread in PyNative mode, innermost. An operation called
// from construct itself (`fc(x) + shift`) names no layer in its shape error, so the error says
// whose construct called it, as graph mode's plan names the program it runs. Frames live on
// the call stack: keeping track costs no allocation.
class RunningConstruct {
 public:
  RunningConstruct() : outer_(innermost_) { innermost_ = this; }
  RunningConstruct(const RunningConstruct&) = delete;
  RunningConstruct& operator=(const RunningConstruct&) = delete;
  // "Net::construct", or nothing outside any construct.
  static std::string innermost_where() { return innermost_ == nullptr ? std::string() : innermost_->where(); }

 protected:
  ~RunningConstruct() { innermost_ = outer_; }
  virtual std::string where() const = 0;

 private:
  const RunningConstruct* outer_;
  static inline thread_local const RunningConstruct* innermost_ = nullptr;
};

// Whether an operation's label names the layer that made it (nn::Dense<784, 512> 'fc1'), so
// that its errors need no more context.
template <class Op>
inline constexpr bool names_its_layer = requires(const Op& op) { op.layer; };

// Where an operation labelled `label` was called from, after its shape error: " (in
// Net::construct)"; nothing outside any construct, or when the label names one of duet's cells
// ("nn::L1Loss": the loss's own operation).
inline std::string called_in(std::string_view label, std::string_view where) {
  return where.empty() || label.starts_with("nn::") ? std::string() : " (in " + std::string(where) + ")";
}

}  // namespace detail

}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/diagnostics_impl.hpp"
#endif
