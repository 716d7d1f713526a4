// Shape operations: reshape, unflatten/flatten, transpose/permute, expand_dims, squeeze, concat, stack, tile,
// split, chunk, slice/strided_slice, flip and positions, in both modes (MindSpore's
// ops.reshape, ops.transpose, ...).
//
// Every argument that decides the output's shape is known at compile time, so that graph
// mode has a static shape to check the next layer against: a single list or axis is a
// template argument (reshape<2, -1>(x), transpose<1, 0>(x), concat<1>(a, b, c)); the two or
// three lists of slice and strided_slice are tag values, ops::ints<...>, since one template
// can hold only one list (slice(x, ints<1, 0>, ints<2, -1>)).
//
// duet's tensors are contiguous and row-major: a view is one run of its input's elements, in
// order, with a shape. So reshape, unflatten, flatten, expand_dims and squeeze are views (no kernel, no copy),
// and so is a slice along the first axis only (split<0, ...>, chunk<0, N>, or slice and
// strided_slice cutting axis 0 with stride 1), which begins further into the input's block.
// transpose, concat, stack, tile, flip and the other slices copy: their elements are
// not such a run.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../eager.hpp"
#include "../error.hpp"
#include "../operation.hpp"

namespace duet {
namespace ops {

// A list of integers fixed at compile time: the begin, end and strides of a slice.
template <index_t... V>
struct Ints {
  static constexpr std::array<index_t, sizeof...(V)> values{V...};
};
template <index_t... V>
inline constexpr Ints<V...> ints{};

// An end past every axis's last element, in the direction of the stride: strided_slice's "to
// the end" (Python's omitted end, x[b::s]).
inline constexpr index_t to_end = std::numeric_limits<index_t>::max();

namespace detail {

// axis in [-rank, rank) as an index in [0, rank), or -1 when it is out of range.
constexpr int axis_index(int axis, int rank) {
  const int a = axis < 0 ? axis + rank : axis;
  return a < 0 || a >= rank ? -1 : a;
}

// x with axis `at` removed (at < rank) or a size inserted before it.
constexpr Shape without_axis(const Shape& x, int at) {
  Shape out;
  for (int i = 0; i < x.rank(); ++i)
    if (i != at) out.push_back(x[i]);
  return out;
}
constexpr Shape with_axis(const Shape& x, int at, index_t size) {
  Shape out;
  for (int i = 0; i <= x.rank(); ++i) {
    if (i == at) out.push_back(size);
    if (i < x.rank()) out.push_back(x[i]);
  }
  return out;
}

// The shape rule of an operation along some of x's axes that keeps x's shape (flip, cumsum): an
// axis x does not have, or one named twice (0 and -rank), is a fault. An axis counted from the
// front of a shape with unknown leading axes is checked when the shape is known.
constexpr ShapeResult along_axes_rule(const Shape& x, std::span<const int> axes) {
  std::array<bool, max_rank> named{};
  for (int axis : axes) {
    const int a = axis_index(axis, x.rank());
    if (x.leading_unknown() && (axis >= 0 || a < 0)) continue;
    if (a < 0) return fault(x, ShapeFault::min_rank, axis < 0 ? -axis : axis + 1);
    if (named[static_cast<std::size_t>(a)]) return fault(x, ShapeFault::axis_twice, a);
    named[static_cast<std::size_t>(a)] = true;
  }
  return {x};
}

// Copies `rows` runs of `count` elements, run r from src + r * src_row to dst + r * dst_row.
template <class T>
void copy_runs(const T* src, index_t src_row, T* dst, index_t dst_row, index_t rows, index_t count) {
  for (index_t r = 0; r < rows; ++r) std::copy_n(src + r * src_row, count, dst + r * dst_row);
}

// Row-major strides of a shape, in elements.
constexpr std::array<index_t, max_rank> strides_of(const Shape& x) {
  std::array<index_t, max_rank> stride{};
  index_t s = 1;
  for (int a = x.rank() - 1; a >= 0; --a) {
    stride[static_cast<std::size_t>(a)] = s;
    s *= x[a];
  }
  return stride;
}

// Calls f(i, j) for each output element i, in order, and the input element j it reads, where
// output element 0 reads input element `first` and one step along output axis a moves
// stride[a] in the input: the walk of transpose and of slices.
template <class F>
void for_each_strided(index_t first, const std::array<index_t, max_rank>& stride, const Shape& out, F&& f) {
  const int rank = out.rank();
  const index_t n = out.numel();
  if (n == 0) return;
  const index_t inner = rank == 0 ? 1 : out[-1];
  const index_t inner_step = rank == 0 ? 0 : stride[static_cast<std::size_t>(rank - 1)];
  std::array<index_t, max_rank> index{};
  index_t j = first;
  for (index_t i = 0; i < n; i += inner) {
    for (index_t k = 0; k < inner; ++k) f(i + k, j + k * inner_step);
    // The odometer over the outer axes, last first.
    for (int axis = rank - 2; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      j += stride[ax];
      if (index[ax] < out[axis]) break;
      j -= stride[ax] * index[ax];
      index[ax] = 0;
    }
  }
}

}  // namespace detail

// The gradient of a view that only changes the shape: dy viewed with the forward input's shape.
struct ReshapeLikeOp : Primitive<ReshapeLikeOp> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, the forward input (for its shape)
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  static std::string op_name() { return "ReshapeLike"; }
};

// ----------------------------------------------------------------------------------------
// reshape<D...>(x): MindSpore's reshape(input, shape). One size may be -1, inferred from the
// element count. A view.

constexpr ShapeResult reshape_rule(const Shape& x, Shape to) {
  int inferred = -1;
  index_t known = 1;
  for (int i = 0; i < to.rank(); ++i) {
    if (to[i] == dyn) inferred = i;
    else known *= to[i];
  }
  const index_t n = x.numel();
  if (n == dyn) return {to};  // the inferred size stays dynamic
  if (inferred < 0) return known == n ? ShapeResult{to} : fault(to, ShapeFault::total_elements, known);
  if (known == 0 || n % known != 0) return fault(to, ShapeFault::elements_multiple, known);
  to[inferred] = n / known;
  return {to};
}

template <index_t... D>
struct ReshapeOp : Primitive<ReshapeOp<D...>> {
  static_assert(((D >= 0 || D == -1) && ...), "duet::ops::reshape: sizes must be >= 0, or -1 for one inferred size");
  static_assert((0 + ... + int{D == -1}) <= 1, "duet::ops::reshape: at most one size may be -1 (inferred)");
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return reshape_rule(in[0], Shape{D...}); }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Reshape<" + detail::list_text<index_t>({D...}) + ">"; }
  std::string label() const { return "ops::reshape<" + detail::list_text<index_t>({D...}) + ">"; }
  // ONNX reads a 0 in the target as "this axis of the input" unless allowzero says otherwise.
  Interchange interchange(std::span<const Shape>) const {
    std::vector<InterchangeAttribute> zero;
    if (((D == 0) || ...)) zero.push_back(InterchangeAttribute::of("allowzero", 1));
    return {{"Reshape", {InterchangeInput::operand(0), InterchangeInput::constant({D...})}, std::move(zero)}};
  }
};

template <index_t... D, class X>
auto reshape(X&& x) {
  return apply(ReshapeOp<D...>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// unflatten<Axis, Sizes...>(x): axis Axis cut into axes of these sizes, one of which may be -1
// (inferred), the other axes kept as they are, whatever their sizes (torch.unflatten(x, dim,
// sizes)): [B, T, 32] as [B, T, 4, 8] for any T. flatten<Start, End>(x): axes Start to End,
// both included, merged into one (torch.flatten(x, start_dim, end_dim)). Views, as reshape,
// whose target follows the input's shape.

constexpr ShapeResult unflatten_rule(const Shape& x, int axis, const Shape& sizes) {
  const int a = x.leading_unknown() ? (axis < 0 ? axis + x.rank() : -1) : detail::axis_index(axis, x.rank());
  if (a < 0)
    return x.leading_unknown() ? ShapeResult{Shape::any()}
                               : fault(x, ShapeFault::min_rank, axis < 0 ? -axis : axis + 1);
  Shape piece = sizes;
  int inferred = -1;
  index_t known = 1;
  for (int i = 0; i < piece.rank(); ++i) {
    if (piece[i] == dyn)
      inferred = i;
    else
      known *= piece[i];
  }
  ShapeFault broken = ShapeFault::none;
  if (const index_t n = x[a]; n != dyn) {
    if (inferred < 0 && known != n)
      broken = ShapeFault::axis_size;
    else if (inferred >= 0 && (known == 0 || n % known != 0))
      broken = ShapeFault::axis_multiple;
    else if (inferred >= 0)
      piece[inferred] = n / known;
  }
  Shape out = x.leading_unknown() ? Shape::any() : Shape{};
  for (int i = 0; i < x.rank(); ++i) {
    if (i != a)
      out.push_back(x[i]);
    else
      for (index_t d : piece) out.push_back(d);
  }
  return broken == ShapeFault::none ? ShapeResult{out} : fault(out, broken, known);
}

constexpr ShapeResult flatten_rule(const Shape& x, int start, int end) {
  // A number is one axis of one element (torch.flatten(scalar) is [1]).
  if (x.rank() == 0 && !x.leading_unknown() && (start == 0 || start == -1) && (end == 0 || end == -1))
    return {Shape{1}};
  const auto index = [&](int axis) {
    return x.leading_unknown() ? (axis < 0 ? axis + x.rank() : -1) : detail::axis_index(axis, x.rank());
  };
  const int s = index(start), e = index(end);
  if (x.leading_unknown() && (s < 0 || e < 0)) return {Shape::any()};
  if (s < 0 || e < 0) {
    const int worst = s < 0 ? start : end;
    return fault(x, ShapeFault::min_rank, worst < 0 ? -worst : worst + 1);
  }
  if (s > e) return fault(x, ShapeFault::axes_in_order, s);
  Shape out = x.leading_unknown() ? Shape::any() : Shape{};
  index_t merged = 1;
  for (int i = 0; i < x.rank(); ++i) {
    if (i < s || i > e)
      out.push_back(x[i]);
    else
      merged = merged == dyn || x[i] == dyn ? dyn : merged * x[i];
    if (i == e) out.push_back(merged);
  }
  return {out};
}

namespace detail {
// ONNX's Reshape target for the output of unflatten (at axis `at`) or flatten (axes `at` to
// `last`, pieces {-1}) of x: 0, "this axis of the input", for the axes in front, so that a
// dynamic batch or length stays dynamic; the pieces; then the axes behind, a dynamic one as -1.
// A second -1, or a size 0 (which Reshape would read as "copy"), has no such form.
inline std::vector<std::int64_t> reshape_target(const Shape& x, int at, int last, std::initializer_list<index_t> pieces,
                                                const std::string& label) {
  std::vector<std::int64_t> target(static_cast<std::size_t>(at), 0);
  int inferred = 0;
  const auto add = [&](index_t d) {
    inferred += d == dyn;
    if (d == 0 || inferred > 1)
      throw ValueError(label + " of an input of shape " + to_string(x) + " has no ONNX Reshape form (" +
                       (d == 0 ? "a size 0" : "two sizes unknown") + ")");
    target.push_back(d);
  };
  for (index_t d : pieces) add(d);
  for (int i = last + 1; i < x.rank(); ++i) add(x[i]);
  return target;
}
}  // namespace detail

template <int Axis, index_t... Sizes>
struct UnflattenOp : Primitive<UnflattenOp<Axis, Sizes...>> {
  static_assert(sizeof...(Sizes) > 0, "duet::ops::unflatten<Axis, Sizes...>: give the sizes the axis is cut into");
  static_assert(((Sizes >= 0 || Sizes == -1) && ...),
                "duet::ops::unflatten: sizes must be >= 0, or -1 for one inferred size");
  static_assert((0 + ... + int{Sizes == -1}) <= 1, "duet::ops::unflatten: at most one size may be -1 (inferred)");
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return unflatten_rule(in[0], Axis, Shape{Sizes...});
  }

  template <std::size_t K>
  requires(K == 0) auto grad_op() const { return ReshapeLikeOp{}; }

  static std::string op_name() {
    return "Unflatten<" + std::to_string(Axis) + ", " + detail::list_text<index_t>({Sizes...}) + ">";
  }
  std::string label() const {
    return "ops::unflatten<" + std::to_string(Axis) + ", " + detail::list_text<index_t>({Sizes...}) + ">";
  }
  Interchange interchange(std::span<const Shape> in) const {
    const int at = detail::axis_index(Axis, in[0].rank());
    return {{"Reshape",
             {InterchangeInput::operand(0),
              InterchangeInput::constant(detail::reshape_target(in[0], at, at, {Sizes...}, label()))},
             {}}};
  }
};

template <int Start, int End>
struct FlattenAxesOp : Primitive<FlattenAxesOp<Start, End>> {
  static_assert((Start < 0) != (End < 0) || Start <= End,
                "duet::ops::flatten<Start, End>: Start must not come after End (torch: start_dim cannot come after "
                "end_dim)");
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return flatten_rule(in[0], Start, End); }

  template <std::size_t K>
  requires(K == 0) auto grad_op() const { return ReshapeLikeOp{}; }

  static std::string op_name() { return "Flatten<" + std::to_string(Start) + ", " + std::to_string(End) + ">"; }
  std::string label() const { return "ops::flatten<" + std::to_string(Start) + ", " + std::to_string(End) + ">"; }
  Interchange interchange(std::span<const Shape> in) const {
    const int rank = in[0].rank();
    const int at = detail::axis_index(Start, rank), last = detail::axis_index(End, rank);
    if (rank == 0) return {{"Reshape", {InterchangeInput::operand(0), InterchangeInput::constant({1})}, {}}};
    return {{"Reshape",
             {InterchangeInput::operand(0),
              InterchangeInput::constant(detail::reshape_target(in[0], at, last, {dyn}, label()))},
             {}}};
  }
};

template <int Axis, index_t... Sizes, class X>
auto unflatten(X&& x) {
  return apply(UnflattenOp<Axis, Sizes...>{}, std::forward<X>(x));
}

// ops::flatten(x), without axes, is nn::Flatten's: flatten<1, -1> (MindSpore's default; nn/flatten.hpp).
template <int Start, int End = -1, class X>
auto flatten(X&& x) {
  return apply(FlattenAxesOp<Start, End>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// expand_dims<Axis>(x): a size-1 axis inserted at Axis, in [-rank - 1, rank] (MindSpore's
// expand_dims(input_x, axis)). A view.

template <int Axis>
struct ExpandDimsOp : Primitive<ExpandDimsOp<Axis>> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    const int at = Axis < 0 ? Axis + x.rank() + 1 : Axis;
    if (x.leading_unknown()) {
      // Counted from the end, the axis is among the known trailing ones; from the front, not.
      if (Axis >= 0 || at < 0) return {Shape::any()};
      Shape out = Shape::any();
      for (index_t d : detail::with_axis(x, at, 1)) out.push_back(d);
      return {out};
    }
    if (at < 0 || at > x.rank()) return fault(x, ShapeFault::min_rank, Axis < 0 ? -Axis - 1 : Axis);
    return {detail::with_axis(x, at, 1)};
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "ExpandDims<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::expand_dims<" + std::to_string(Axis) + ">"; }
  // ONNX's Unsqueeze counts a negative axis from the end of the output, as this does.
  Interchange interchange(std::span<const Shape>) const {
    return {{"Unsqueeze", {InterchangeInput::operand(0), InterchangeInput::constant({Axis})}, {}}};
  }
};

template <int Axis, class X>
auto expand_dims(X&& x) {
  return apply(ExpandDimsOp<Axis>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// squeeze<Axes...>(x): the size-1 axes named removed, or every size-1 axis when none is
// (MindSpore's squeeze(input, axis)). A view.

template <int... Axes>
struct SqueezeOp : Primitive<SqueezeOp<Axes...>> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    if constexpr (sizeof...(Axes) == 0) {
      // Which axes go depends on sizes compile time may not know: then so is the result.
      if (!x.is_concrete()) return {Shape::any()};
      Shape out;
      for (index_t d : x)
        if (d != 1) out.push_back(d);
      return {out};
    } else {
      if (x.leading_unknown()) return {Shape::any()};
      std::array<bool, max_rank> drop{};
      for (int axis : {Axes...}) {
        const int a = detail::axis_index(axis, x.rank());
        if (a < 0) return fault(x, ShapeFault::min_rank, axis < 0 ? -axis : axis + 1);
        if (x[a] != 1 && x[a] != dyn) return fault(x, ShapeFault::axis_not_one, axis);
        drop[static_cast<std::size_t>(a)] = true;
      }
      Shape out;
      for (int i = 0; i < x.rank(); ++i)
        if (!drop[static_cast<std::size_t>(i)]) out.push_back(x[i]);
      return {out};
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Squeeze<" + detail::list_text<int>({Axes...}) + ">"; }
  std::string label() const { return "ops::squeeze<" + detail::list_text<int>({Axes...}) + ">"; }
  // Without axes, ONNX's Squeeze also removes every size-1 axis.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (sizeof...(Axes) == 0) return {{"Squeeze", {InterchangeInput::operand(0)}, {}}};
    else return {{"Squeeze", {InterchangeInput::operand(0), InterchangeInput::constant({Axes...})}, {}}};
  }
};

template <int... Axes, class X>
auto squeeze(X&& x) {
  return apply(SqueezeOp<Axes...>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// transpose<P...>(x): output axis i is input axis P[i] (MindSpore's transpose(input,
// input_perm); permute(input, axis) is the same). A copy: the output's elements are the
// input's in another order, which a contiguous row-major view cannot express.

namespace detail {
template <std::size_t N>
constexpr bool is_permutation(const std::array<int, N>& p) {
  std::array<bool, N> seen{};
  for (int v : p) {
    if (v < 0 || v >= static_cast<int>(N) || seen[static_cast<std::size_t>(v)]) return false;
    seen[static_cast<std::size_t>(v)] = true;
  }
  return true;
}
}  // namespace detail

namespace detail {
// Both forms' shape rule: output axis i is x's axis perm[i].
constexpr ShapeResult transpose_rule(const Shape& x, std::span<const int> perm) {
  const int rank = static_cast<int>(perm.size());
  if (x.leading_unknown() && x.rank() <= rank) return {Shape::any()};
  if (x.rank() != rank) return fault(x, ShapeFault::exact_rank, rank);
  Shape out;
  for (int a : perm) out.push_back(x[a]);
  return {out};
}

template <class T>
void transpose_run(const graph::KernelArgs& a, std::span<const int> perm) {
  const auto in_stride = strides_of(a.in_shape());
  std::array<index_t, max_rank> stride{};
  for (std::size_t i = 0; i < perm.size(); ++i) stride[i] = in_stride[static_cast<std::size_t>(perm[i])];
  const T* in = a.in<T>();
  T* out = a.out<T>();
  for_each_strided(0, stride, a.output_shape, [&](index_t i, index_t j) { out[i] = in[j]; });
}
}  // namespace detail

template <int... P>
struct TransposeOp : Primitive<TransposeOp<P...>> {
  static constexpr std::array<int, sizeof...(P)> perm{P...};
  static_assert(detail::is_permutation(perm),
                "duet::ops::transpose: the axes must be a permutation of 0, 1, ..., rank - 1 (each axis once, "
                "counted from the end where negative)");
  static constexpr int rank = static_cast<int>(sizeof...(P));
  // As the gradient of the inverse permutation, it reads the incoming gradient only.
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::transpose_rule(in[0], perm); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::transpose_run<T>(a, perm);
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      constexpr std::array<int, sizeof...(P)> inverse = [] {
        std::array<int, sizeof...(P)> inv{};
        for (std::size_t i = 0; i < sizeof...(P); ++i) inv[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
        return inv;
      }();
      return TransposeOp<inverse[I]...>{};
    }(std::make_index_sequence<sizeof...(P)>{});
  }

  static std::string op_name() { return "Transpose<" + detail::list_text<int>({P...}) + ">"; }
  std::string label() const { return "ops::transpose<" + detail::list_text<int>({P...}) + ">"; }
  Interchange interchange(std::span<const Shape>) const {
    return {{"Transpose", {InterchangeInput::operand(0)}, {InterchangeAttribute::of("perm", std::vector<std::int64_t>{P...})}}};
  }
};

// The permutation's length is the rank, so an axis counted from the end (-1 the last, as in
// PyTorch's permute(-1, 0, 1) and the run-time form) is known while the program compiles.
template <int... P, class X>
auto transpose(X&& x) {
  constexpr int rank = static_cast<int>(sizeof...(P));
  return apply(TransposeOp<(P < 0 ? P + rank : P)...>{}, std::forward<X>(x));
}

// transpose(x, perm): the permutation given at run time (MindSpore's transpose(input,
// input_perm) with a tuple the program computes; an ONNX model's Transpose). One operation for
// every permutation, where each transpose<P...> is a type and a kernel of its own: code that
// chooses among many permutations compiles one (the ONNX import chose among 32). Graph mode
// checks its shape when the network first runs, not at compile time.
struct PermuteOp : Primitive<PermuteOp> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  std::array<int, max_rank> order{};
  int rank = 0;

  std::span<const int> perm() const { return {order.data(), static_cast<std::size_t>(rank)}; }

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape> in) const { return detail::transpose_rule(in[0], perm()); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::transpose_run<T>(a, perm());
  }

  template <std::size_t K>
    requires(K == 0)
  PermuteOp grad_op() const {
    PermuteOp inverse;
    inverse.rank = rank;
    for (int i = 0; i < rank; ++i) inverse.order[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = i;
    return inverse;
  }

  static std::string op_name() { return "Transpose"; }
  std::string label() const {
    return "ops::transpose(x, {" + detail::list_text<int>(perm()) + "})";
  }
  Interchange interchange(std::span<const Shape>) const {
    return {{"Transpose", {InterchangeInput::operand(0)},
             {InterchangeAttribute::of("perm", std::vector<std::int64_t>(perm().begin(), perm().end()))}}};
  }
};

// Throws duet::ValueError unless perm is a permutation of 0, 1, ..., n - 1 with n at most
// duet::max_rank, an axis counted from the end where negative (-1 the last, as PyTorch's
// permute(-1, 0, 1)); the input's rank is checked against n like any shape.
template <class X>
auto transpose(X&& x, std::span<const int> perm) {
  PermuteOp op;
  op.rank = static_cast<int>(perm.size());
  std::array<bool, max_rank> seen{};
  bool valid = perm.size() <= static_cast<std::size_t>(max_rank);
  for (std::size_t i = 0; valid && i < perm.size(); ++i) {
    const int a = detail::axis_index(perm[i], op.rank);
    valid = a >= 0 && !seen[static_cast<std::size_t>(a)];
    if (valid) {
      seen[static_cast<std::size_t>(a)] = true;
      op.order[i] = a;
    }
  }
  if (!valid) {
    throw ValueError("duet::ops::transpose: {" + detail::list_text<int>(perm) +
                     "} is not a permutation of 0, 1, ..., rank - 1 (each axis once, counted from the end where "
                     "negative; at most " +
                     std::to_string(max_rank) + " axes)");
  }
  return apply(op, std::forward<X>(x));
}
template <class X>
auto transpose(X&& x, std::initializer_list<int> perm) {
  return transpose(std::forward<X>(x), std::span<const int>(perm.begin(), perm.size()));
}
template <int... P, class X>
auto permute(X&& x) {
  return transpose<P...>(std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// concat<Axis>(x0, x1, ...): the inputs joined along Axis, their other sizes equal (MindSpore's
// concat(tensors, axis)). N inputs, N a template argument of the op. A copy.

namespace detail {

// The inputs' common sizes, axis `except` aside (-1: none), into `common` (dyn where every
// input's is): the first input whose rank or a size differs, or 0 when none does.
constexpr int merge_sizes(std::span<const Shape> in, int except, Shape& common) {
  common = in[0];
  for (std::size_t k = 1; k < in.size(); ++k) {
    const Shape& x = in[k];
    if (x.rank() != common.rank()) return static_cast<int>(k);
    for (int i = 0; i < x.rank(); ++i) {
      if (i == except) continue;
      if (common[i] == dyn) common[i] = x[i];
      else if (x[i] != dyn && x[i] != common[i]) return static_cast<int>(k);
    }
  }
  return 0;
}

constexpr index_t numel_before(const Shape& x, int axis) {
  index_t n = 1;
  for (int i = 0; i < axis; ++i) n *= x[i];
  return n;
}

// concat's and stack's kernel: each row of the output's axes before `a` holds a block of
// every input in turn.
template <class T>
void join_blocks(const graph::KernelArgs& args, std::size_t inputs, int a) {
  const Shape& out = args.output_shape;
  index_t offset = 0;
  for (std::size_t k = 0; k < inputs; ++k) {
    const index_t block = args.in_shape(k).numel_from(a);
    copy_runs(args.in<T>(k), block, args.out<T>() + offset, out.numel_from(a), numel_before(out, a), block);
    offset += block;
  }
}

// Their gradients' kernel: from each row of dy, the block that begins `offset` into it.
template <class T>
void take_block(const graph::KernelArgs& args, int a, index_t offset) {
  const Shape& dy = args.in_shape(0);
  const index_t block = args.output_shape.numel_from(a);
  copy_runs(args.in<T>(0) + offset, dy.numel_from(a), args.out<T>(), block, numel_before(dy, a), block);
}

}  // namespace detail

template <int Axis, int K>
struct ConcatGradOp;

template <int Axis, int N>
struct ConcatOp : Primitive<ConcatOp<Axis, N>> {
  static_assert(N >= 1, "duet::ops::concat: needs at least one input");
  static constexpr int arity = N;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    for (const Shape& x : in)
      if (x.leading_unknown()) return {Shape::any()};
    const int a = detail::axis_index(Axis, in[0].rank());
    if (a < 0) return fault(in[0], ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    Shape out;
    if (const int k = detail::merge_sizes(in, a, out)) return fault(out, ShapeFault::sizes_except_axis, a, k);
    for (std::size_t k = 1; k < in.size(); ++k) out[a] = out[a] == dyn || in[k][a] == dyn ? dyn : out[a] + in[k][a];
    return {out};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    detail::join_blocks<T>(args, N, detail::axis_index(Axis, args.output_shape.rank()));
  }

  template <std::size_t K>
    requires(K < static_cast<std::size_t>(N))
  auto grad_op() const {
    return ConcatGradOp<Axis, static_cast<int>(K)>{};
  }

  static std::string op_name() { return "Concat<" + std::to_string(Axis) + ">"; }
  Interchange interchange(std::span<const Shape>) const {
    InterchangeNode n{"Concat", {}, {InterchangeAttribute::of("axis", std::int64_t{Axis})}};
    for (std::size_t k = 0; k < static_cast<std::size_t>(N); ++k) n.inputs.push_back(InterchangeInput::operand(k));
    return {std::move(n)};
  }
  std::string label() const { return "ops::concat<" + std::to_string(Axis) + ">"; }
};

// d/d input K of concat: input K's block of dy. It reads inputs 0 to K for their sizes along
// the axis, which place input K's block.
template <int Axis, int K>
struct ConcatGradOp : Primitive<ConcatGradOp<Axis, K>> {
  static constexpr auto reads = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array{graph::Operand::grad, graph::input_operand(I)...};
  }(std::make_index_sequence<static_cast<std::size_t>(K) + 1>{});
  static constexpr int arity = K + 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[static_cast<std::size_t>(K) + 1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const int a = detail::axis_index(Axis, args.in_shape(0).rank());
    index_t offset = 0;
    for (std::size_t k = 1; k <= static_cast<std::size_t>(K); ++k) offset += args.in_shape(k).numel_from(a);
    detail::take_block<T>(args, a, offset);
  }

  static std::string op_name() { return "ConcatGrad<" + std::to_string(Axis) + ", " + std::to_string(K) + ">"; }
};

template <int Axis = 0, class X0, class... X>
auto concat(const X0& x0, const X&... x) {
  return apply(ConcatOp<Axis, 1 + static_cast<int>(sizeof...(X))>{}, x0, x...);
}

// ----------------------------------------------------------------------------------------
// stack<Axis>(x0, x1, ...): inputs of one shape stacked along a new axis Axis, in
// [-rank - 1, rank] (MindSpore's stack(tensors, axis)). A copy: concat's kernel, each
// input's block being all of it past the axis.

template <int Axis, int K>
struct StackGradOp;

template <int Axis, int N>
struct StackOp : Primitive<StackOp<Axis, N>> {
  static_assert(N >= 1, "duet::ops::stack: needs at least one input");
  static constexpr int arity = N;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    for (const Shape& x : in)
      if (x.leading_unknown()) return {Shape::any()};
    Shape common;
    if (const int k = detail::merge_sizes(in, -1, common)) return fault(common, ShapeFault::shapes_differ, 0, k);
    const int a = detail::axis_index(Axis, common.rank() + 1);
    if (a < 0) return fault(common, ShapeFault::min_rank, Axis < 0 ? -Axis - 1 : Axis);
    return {detail::with_axis(common, a, N)};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    detail::join_blocks<T>(args, N, detail::axis_index(Axis, args.output_shape.rank()));
  }

  template <std::size_t K>
    requires(K < static_cast<std::size_t>(N))
  auto grad_op() const {
    return StackGradOp<Axis, static_cast<int>(K)>{};
  }

  static std::string op_name() { return "Stack<" + std::to_string(Axis) + ">"; }
  // ONNX has no Stack: each input gets its new axis (Unsqueeze), then they are joined there.
  Interchange interchange(std::span<const Shape>) const {
    Interchange nodes;
    InterchangeNode joined{"Concat", {}, {InterchangeAttribute::of("axis", std::int64_t{Axis})}};
    for (std::size_t k = 0; k < static_cast<std::size_t>(N); ++k) {
      nodes.push_back({"Unsqueeze", {InterchangeInput::operand(k), InterchangeInput::constant({Axis})}, {}});
      joined.inputs.push_back(InterchangeInput::node(k));
    }
    nodes.push_back(std::move(joined));
    return nodes;
  }
  std::string label() const { return "ops::stack<" + std::to_string(Axis) + ">"; }
};

// d/d input K of stack: entry K of dy along the stacked axis.
template <int Axis, int K>
struct StackGradOp : Primitive<StackGradOp<Axis, K>> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& dy = in[0];
    if (dy.leading_unknown()) return {Shape::any()};
    return {detail::without_axis(dy, detail::axis_index(Axis, dy.rank()))};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const int a = detail::axis_index(Axis, args.in_shape(0).rank());
    detail::take_block<T>(args, a, K * args.output_shape.numel_from(a));
  }

  static std::string op_name() { return "StackGrad<" + std::to_string(Axis) + ", " + std::to_string(K) + ">"; }
};

template <int Axis = 0, class X0, class... X>
auto stack(const X0& x0, const X&... x) {
  return apply(StackOp<Axis, 1 + static_cast<int>(sizeof...(X))>{}, x0, x...);
}

// ----------------------------------------------------------------------------------------
// tile<M...>(x): x repeated M[a] times along each axis a (numpy's tile(x, reps), MindSpore's
// ops.tile(input, dims), PyTorch's torch.tile and x.repeat(...)). The multiples align with x's
// axes at the last, as numpy's: fewer than x's axes leave the leading ones as they are, more
// give x size-1 axes in front first (x.repeat asks for at least x's rank; the others take
// both), so no input breaks the rule. A copy. The gradient sums dy over the copies, in the
// output's order, the same in both modes.

namespace detail {
// Both forms' shape rule: each axis's size times its multiple, counted from the last.
constexpr ShapeResult tile_rule(const Shape& x, std::span<const index_t> multiples) {
  const int m = static_cast<int>(multiples.size());
  // Unknown leading axes are repeated once, unless a multiple may fall on one.
  if (x.leading_unknown() && x.rank() < m) return {Shape::any()};
  Shape out = x.leading_unknown() ? Shape::any() : Shape{};
  for (int i = std::max(x.rank(), m); i >= 1; --i) {
    const index_t size = i <= x.rank() ? x[-i] : 1;
    const index_t times = i <= m ? multiples[static_cast<std::size_t>(m - i)] : 1;
    out.push_back(size == dyn && times != 0 ? dyn : size * times);
  }
  return {out};
}

// Calls f(output offset, input offset, count) for each run of x's last axis that tile copies,
// in the output's order: output element o reads x at o modulo x's size along each axis, x's
// shape taken with size-1 axes in front up to the output's rank.
template <class F>
void for_each_tiled(const Shape& x, const Shape& out, F&& f) {
  if (out.numel() == 0) return;
  const int rank = out.rank();
  if (rank == 0) {
    f(0, 0, 1);
    return;
  }
  Shape in;
  for (int a = x.rank(); a < rank; ++a) in.push_back(1);
  for (index_t d : x) in.push_back(d);
  const auto stride = strides_of(in);
  const index_t row = out[rank - 1];
  const index_t inner = in[rank - 1];
  std::array<index_t, max_rank> index{};  // over the output's axes before the last
  for (index_t r = 0; r < out.numel() / row; ++r) {
    index_t from = 0;
    for (int a = 0; a + 1 < rank; ++a) {
      const auto ax = static_cast<std::size_t>(a);
      from += index[ax] % in[a] * stride[ax];
    }
    for (index_t o = 0; o < row; o += inner) f(r * row + o, from, inner);
    for (int a = rank - 2; a >= 0 && ++index[static_cast<std::size_t>(a)] == out[a]; --a) {
      index[static_cast<std::size_t>(a)] = 0;
    }
  }
}

// ONNX's Tile takes one multiple per axis of its input: x's leading axes get 1, and multiples
// past x's rank get their axes from an Unsqueeze first.
inline Interchange tile_interchange(const Shape& x, std::span<const index_t> multiples) {
  const int m = static_cast<int>(multiples.size());
  std::vector<std::int64_t> repeats(static_cast<std::size_t>(std::max(0, x.rank() - m)), 1);
  repeats.insert(repeats.end(), multiples.begin(), multiples.end());
  if (m <= x.rank())
    return {{"Tile", {InterchangeInput::operand(0), InterchangeInput::constant(std::move(repeats))}, {}}};
  std::vector<std::int64_t> new_axes(static_cast<std::size_t>(m - x.rank()));
  for (std::size_t a = 0; a < new_axes.size(); ++a) new_axes[a] = static_cast<std::int64_t>(a);
  return {{"Unsqueeze", {InterchangeInput::operand(0), InterchangeInput::constant(std::move(new_axes))}, {}},
          {"Tile", {InterchangeInput::node(0), InterchangeInput::constant(std::move(repeats))}, {}}};
}
}  // namespace detail

// d/dx of tile: each element of x gets dy summed over its copies.
struct TileGradOp : Primitive<TileGradOp> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, the forward input (for its shape)

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    T* dx = a.out<T>();
    std::fill_n(dx, a.in_shape(1).numel(), T(0));
    detail::for_each_tiled(a.in_shape(1), a.in_shape(0), [&](index_t o, index_t i, index_t n) {
      for (index_t k = 0; k < n; ++k) dx[i + k] += dy[o + k];
    });
  }

  static std::string op_name() { return "TileGrad"; }
};

// What both forms share: the kernel, which reads the multiples off the two shapes, the
// gradient and ONNX's Tile.
template <class Self>
struct TilePrimitive : Primitive<Self> {
  static constexpr int arity = 1;

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* y = a.out<T>();
    detail::for_each_tiled(a.in_shape(), a.output_shape,
                           [&](index_t o, index_t i, index_t n) { std::copy_n(x + i, n, y + o); });
  }

  // Of input 0, the only one.
  template <std::size_t K>
  TileGradOp grad_op() const {
    return {};
  }

  Interchange interchange(std::span<const Shape> in) const {
    return detail::tile_interchange(in[0], static_cast<const Self&>(*this).multiples());
  }
};

template <index_t... M>
struct TileOp : TilePrimitive<TileOp<M...>> {
  static_assert(sizeof...(M) <= max_rank, "duet::ops::tile: at most duet::max_rank multiples");
  static_assert(((M >= 0) && ...), "duet::ops::tile: the multiples must be >= 0");
  static constexpr std::array<index_t, sizeof...(M)> times{M...};

  static constexpr std::span<const index_t> multiples() { return times; }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::tile_rule(in[0], times); }

  static std::string op_name() { return "Tile<" + detail::list_text<index_t>({M...}) + ">"; }
  std::string label() const { return "ops::tile<" + detail::list_text<index_t>({M...}) + ">"; }
};

template <index_t... M, class X>
auto tile(X&& x) {
  return apply(TileOp<M...>{}, std::forward<X>(x));
}

// tile(x, multiples): the multiples given at run time (an ONNX model's Tile), one operation for
// every list, as transpose(x, perm) is for every permutation. Graph mode reads them when it
// captures construct and knows the output's shape when the network first runs.
struct TileListOp : TilePrimitive<TileListOp> {
  std::array<index_t, max_rank> times{};
  std::size_t count = 0;

  std::span<const index_t> multiples() const { return std::span(times).first(count); }
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape> in) const { return detail::tile_rule(in[0], multiples()); }

  static std::string op_name() { return "Tile"; }
  std::string label() const { return "ops::tile(x, {" + detail::list_text<index_t>(multiples()) + "})"; }
};

// Throws duet::ValueError for a negative multiple or more than duet::max_rank of them.
template <class X>
auto tile(X&& x, std::span<const index_t> multiples) {
  if (multiples.size() > static_cast<std::size_t>(max_rank) ||
      std::ranges::any_of(multiples, [](index_t v) { return v < 0; })) {
    throw ValueError("duet::ops::tile: the multiples {" + detail::list_text<index_t>(multiples) +
                     "} must be >= 0, at most " + std::to_string(max_rank) + " of them");
  }
  TileListOp op;
  std::ranges::copy(multiples, op.times.begin());
  op.count = multiples.size();
  return apply(op, std::forward<X>(x));
}
template <class X>
auto tile(X&& x, std::initializer_list<index_t> multiples) {
  return tile(std::forward<X>(x), std::span<const index_t>(multiples.begin(), multiples.size()));
}

// ----------------------------------------------------------------------------------------
// Slices. A slice reads, along each axis a, count[a] elements step[a] apart from start[a]; its
// gradient scatters dy back into zeros of the input's shape. One rule per kind of slice
// gives that window from the input's shape; the kernels are shared.

namespace detail {

struct Window {
  Shape count;
  std::array<index_t, max_rank> start{};
  std::array<index_t, max_rank> step{};
  ShapeFault fault = ShapeFault::none;
  index_t expected = 0;
};

// The window a slice op reads from an input of shape x, as a shape rule's result.
template <class Op>
constexpr ShapeResult window_result(const Op& op, const Shape& x) {
  if (x.leading_unknown()) return {Shape::any()};
  const Window w = op.window(x);
  if (w.fault != ShapeFault::none) return fault(x, w.fault, w.expected);
  return {w.count};
}

// x[begin:end:stride] along the first begin.size() axes, the others whole: Python's rules
// (negative indices count from the end, indices past either end are clamped, a negative
// stride walks backwards, to_end is an omitted end), or with `checked` (ops::slice) begin and
// end must lie inside the axis.
constexpr Window strided_window(const Shape& x, std::span<const index_t> begin, std::span<const index_t> end,
                                std::span<const index_t> strides, bool checked) {
  const std::size_t n = begin.size();
  Window w;
  w.count = x;
  if (static_cast<int>(n) > x.rank()) {
    w.fault = ShapeFault::min_rank;
    w.expected = static_cast<index_t>(n);
    return w;
  }
  for (std::size_t a = 0; a < static_cast<std::size_t>(x.rank()); ++a) {
    const int axis = static_cast<int>(a);
    const index_t size = x[axis];
    w.step[a] = 1;
    if (a >= n) continue;
    if (size == dyn) {
      w.count[axis] = dyn;
      continue;
    }
    const index_t stride = strides[a];
    index_t b = begin[a];
    index_t e = end[a];
    if (checked) {
      if (e == to_end) e = size;
      if (b > size || e < b || e > size) {
        w.fault = ShapeFault::slice_range;
        w.expected = axis;
        return w;
      }
    }
    if (b < 0) b += size;
    if (e < 0) e += size;
    if (end[a] == to_end && stride < 0) e = -1;
    // Python's clamping: [0, size] walking forwards, [-1, size - 1] backwards.
    const index_t lo = stride > 0 ? 0 : -1;
    const index_t hi = stride > 0 ? size : size - 1;
    b = std::clamp(b, lo, hi);
    e = std::clamp(e, lo, hi);
    const index_t span = stride > 0 ? e - b : b - e;
    const index_t abs_stride = stride > 0 ? stride : -stride;
    w.start[a] = b;
    // Counted without span + stride, which a stride near 2^63 (a run-time one) overflows; a
    // step that is never taken is 1, so that the kernels' strides (size times step) stay small.
    w.count[axis] = span <= 0 ? 0 : 1 + (span - 1) / abs_stride;
    w.step[a] = w.count[axis] > 1 ? stride : 1;
  }
  return w;
}

template <class T>
void read_window(const Window& w, const Shape& in, const T* x, T* y) {
  const auto in_stride = strides_of(in);
  std::array<index_t, max_rank> stride{};
  index_t first = 0;
  for (std::size_t a = 0; a < static_cast<std::size_t>(in.rank()); ++a) {
    stride[a] = in_stride[a] * w.step[a];
    first += in_stride[a] * w.start[a];
  }
  for_each_strided(first, stride, w.count, [&](index_t i, index_t j) { y[i] = x[j]; });
}

template <class T>
void scatter_window(const Window& w, const Shape& in, const T* dy, T* dx) {
  std::fill_n(dx, in.numel(), T(0));
  const auto in_stride = strides_of(in);
  std::array<index_t, max_rank> stride{};
  index_t first = 0;
  for (std::size_t a = 0; a < static_cast<std::size_t>(in.rank()); ++a) {
    stride[a] = in_stride[a] * w.step[a];
    first += in_stride[a] * w.start[a];
  }
  for_each_strided(first, stride, w.count, [&](index_t i, index_t j) { dx[j] = dy[i]; });
}

}  // namespace detail

// The gradient of slice op Fwd: dy in Fwd's window of zeros shaped like the forward input.
template <class Fwd>
struct SliceGradOp : Primitive<SliceGradOp<Fwd>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;
  // Empty for the slices whose window is their type; the lists of a run-time one.
  [[no_unique_address]] Fwd fwd{};

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    detail::scatter_window(fwd.window(args.in_shape(1)), args.in_shape(1), args.in<T>(0), args.out<T>());
  }

  static std::string op_name() { return Fwd::op_name() + "Grad"; }
};

// What every slice op shares: its rule and kernel from its window, its gradient.
template <class Self>
struct SlicePrimitive : Primitive<Self> {
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::window_result(Self{}, in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::read_window(self().window(a.in_shape()), a.in_shape(), a.in<T>(), a.out<T>());
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    SliceGradOp<Self> g;
    g.fwd = self();
    return g;
  }

  // ONNX's Slice, on the axes it cuts. A slice that has begin, end and strides writes them as
  // they are: ONNX reads them as Python does (from the end where negative, clamped, INT64_MAX
  // to the end), so the file cuts an input of any length as duet does, where the window's
  // numbers at the exported shape would hold at that length only (an axis export_onnx names).
  Interchange interchange(std::span<const Shape> in) const {
    std::vector<std::int64_t> starts, ends, axes, steps;
    if constexpr (requires(const Self& s) { s.python_lists(); }) {
      const auto [begin, end, strides] = self().python_lists();
      for (std::size_t a = 0; a < begin.size(); ++a) {
        if (begin[a] == 0 && end[a] == to_end && strides[a] == 1) continue;
        starts.push_back(begin[a]);
        ends.push_back(end[a] != to_end     ? end[a]
                       : strides[a] > 0 ? std::numeric_limits<std::int64_t>::max()
                                        : std::numeric_limits<std::int64_t>::min());
        axes.push_back(static_cast<std::int64_t>(a));
        steps.push_back(strides[a]);
      }
      return slice_interchange(std::move(starts), std::move(ends), std::move(axes), std::move(steps));
    }
    const Shape& x = in[0];
    const detail::Window w = self().window(x);
    for (int a = 0; a < x.rank(); ++a) {
      const auto i = static_cast<std::size_t>(a);
      if (w.start[i] == 0 && w.step[i] == 1 && w.count[a] == x[a]) continue;
      const index_t end = w.start[i] + w.count[a] * w.step[i];
      starts.push_back(w.start[i]);
      // Walking backwards past the first element: ONNX reads -1 as the last, -size - 1 as
      // before the first.
      ends.push_back(end < 0 ? -x[a] - 1 : end);
      axes.push_back(a);
      steps.push_back(w.step[i]);
    }
    return slice_interchange(std::move(starts), std::move(ends), std::move(axes), std::move(steps));
  }

 private:
  const Self& self() const { return static_cast<const Self&>(*this); }

  static Interchange slice_interchange(std::vector<std::int64_t> starts, std::vector<std::int64_t> ends,
                                       std::vector<std::int64_t> axes, std::vector<std::int64_t> steps) {
    if (axes.empty()) return {{"Identity", {InterchangeInput::operand(0)}, {}}};
    return {{"Slice",
             {InterchangeInput::operand(0), InterchangeInput::constant(std::move(starts)),
              InterchangeInput::constant(std::move(ends)), InterchangeInput::constant(std::move(axes)),
              InterchangeInput::constant(std::move(steps))},
             {}}};
  }
};

// strided_slice(x, ints<begin...>, ints<end...>, ints<strides...>): along axis a, from
// begin[a] up to (not including) end[a], strides[a] apart, as Python's x[begin:end:stride];
// negative indices count from the end, indices past either end are clamped, a negative
// stride walks backwards. Axes past the lists are taken whole (MindSpore's strided_slice
// without its masks). slice(x, ints<begin...>, ints<size...>) takes size[a] elements from
// begin[a] (-1: the rest), which must lie inside the axis (MindSpore's slice).
template <class Begin, class End, class Strides, bool Checked>
struct StridedSliceOp : SlicePrimitive<StridedSliceOp<Begin, End, Strides, Checked>> {
  static constexpr std::size_t n = Begin::values.size();
  static_assert(End::values.size() == n && Strides::values.size() == n,
                "duet::ops::strided_slice: begin, end and strides must have one entry per axis sliced");
  static_assert(std::ranges::none_of(Strides::values, [](index_t s) { return s == 0; }),
                "duet::ops::strided_slice: a stride cannot be 0");

  // Cutting the first axis only, one step at a time: the elements are one run of the input's.
  static constexpr bool is_view = [] {
    if (n == 0) return true;
    if (Strides::values[0] != 1) return false;
    for (std::size_t a = 1; a < n; ++a) {
      if (Begin::values[a] != 0 || End::values[a] != to_end || Strides::values[a] != 1) return false;
    }
    return true;
  }();
  index_t view_offset(const Shape& x) const { return x.rank() == 0 ? 0 : window(x).start[0] * x.numel_from(1); }

  static constexpr detail::Window window(const Shape& x) {
    return detail::strided_window(x, Begin::values, End::values, Strides::values, Checked);
  }
  static constexpr auto python_lists() {
    return std::tuple{std::span(Begin::values), std::span(End::values), std::span(Strides::values)};
  }

  static std::string op_name() {
    return std::string(Checked ? "Slice" : "StridedSlice") + "<" + lists() + ">";
  }
  std::string label() const { return std::string(Checked ? "ops::slice" : "ops::strided_slice") + "<" + lists() + ">"; }

 private:
  static std::string lists() {
    const auto text = [](const auto& values) {
      std::string out = "[";
      for (index_t v : values) {
        out += (out.size() > 1 ? ", " : "") + (v == to_end ? std::string("end") : std::to_string(v));
      }
      return out + "]";
    };
    if constexpr (Checked) {
      // ops::slice's own arguments, begin and size (-1: the rest of the axis), as the user wrote
      // them, not the end they make.
      std::array<index_t, Begin::values.size()> sizes{};
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        sizes[i] = End::values[i] == to_end ? -1 : End::values[i] - Begin::values[i];
      }
      return text(Begin::values) + ", " + text(sizes);
    } else {
      return text(Begin::values) + ", " + text(End::values) + ", " + text(Strides::values);
    }
  }
};

template <class X, index_t... B, index_t... E, index_t... S>
auto strided_slice(X&& x, Ints<B...>, Ints<E...>, Ints<S...>) {
  return apply(StridedSliceOp<Ints<B...>, Ints<E...>, Ints<S...>, false>{}, std::forward<X>(x));
}

template <class X, index_t... B, index_t... Size>
auto slice(X&& x, Ints<B...>, Ints<Size...>) {
  static_assert(sizeof...(B) == sizeof...(Size),
                "duet::ops::slice: begin and size must have one entry per axis sliced");
  static_assert(((B >= 0) && ...), "duet::ops::slice: begin must be >= 0");
  static_assert(((Size >= -1) && ...), "duet::ops::slice: a size must be >= 0, or -1 for the rest of the axis");
  using Op = StridedSliceOp<Ints<B...>, Ints<(Size == -1 ? to_end : B + Size)...>, Ints<(B * 0 + 1)...>, true>;
  return apply(Op{}, std::forward<X>(x));
}

// strided_slice(x, begin, end, strides) and slice(x, begin, size) with the lists given at run
// time (a window the program computes; an ONNX model's Slice): the same rules, one operation
// for every window, as transpose(x, perm) is for every permutation. Graph mode checks the
// window against the input's shape when the network first runs, not at compile time.
struct WindowSliceOp : SlicePrimitive<WindowSliceOp> {
  std::array<index_t, max_rank> begin{};
  std::array<index_t, max_rank> end{};
  std::array<index_t, max_rank> strides{};
  std::size_t n = 0;
  bool checked = false;

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape> in) const { return detail::window_result(*this, in[0]); }
  auto python_lists() const {
    return std::tuple{std::span(begin).first(n), std::span(end).first(n), std::span(strides).first(n)};
  }
  detail::Window window(const Shape& x) const {
    const auto [b, e, s] = python_lists();
    return detail::strided_window(x, b, e, s, checked);
  }

  static std::string op_name() { return "StridedSlice"; }
  std::string label() const {
    const auto text = [&](const std::array<index_t, max_rank>& values, bool as_size) {
      std::string out = "{";
      for (std::size_t a = 0; a < n; ++a) {
        const index_t v = as_size ? (values[a] == to_end ? -1 : values[a] - begin[a]) : values[a];
        out += (a > 0 ? ", " : "") + (v == to_end ? std::string("end") : std::to_string(v));
      }
      return out + "}";
    };
    if (checked) return "ops::slice(x, " + text(begin, false) + ", " + text(end, true) + ")";
    return "ops::strided_slice(x, " + text(begin, false) + ", " + text(end, false) + ", " + text(strides, false) + ")";
  }
};

namespace detail {
inline WindowSliceOp window_slice(std::span<const index_t> begin, std::span<const index_t> end,
                                  std::span<const index_t> strides, const char* who) {
  if (end.size() != begin.size() || strides.size() != begin.size() || begin.size() > static_cast<std::size_t>(max_rank)) {
    throw ValueError(std::string("duet::ops::") + who + ": begin, end and strides must have one entry per axis sliced, " +
                     "at most " + std::to_string(max_rank) + ", got " + std::to_string(begin.size()) + ", " +
                     std::to_string(end.size()) + " and " + std::to_string(strides.size()) + " entries");
  }
  WindowSliceOp op;
  op.n = begin.size();
  std::ranges::copy(begin, op.begin.begin());
  std::ranges::copy(end, op.end.begin());
  std::ranges::copy(strides, op.strides.begin());
  // -2^63 has no negation: a stride is counted by its magnitude.
  if (std::ranges::any_of(strides, [](index_t v) { return v == 0 || v == std::numeric_limits<index_t>::min(); })) {
    throw ValueError(std::string("duet::ops::") + who + ": a stride cannot be 0 (or -2^63), got {" +
                     list_text<index_t>(strides) + "}");
  }
  return op;
}
}  // namespace detail

template <class X>
auto strided_slice(X&& x, std::span<const index_t> begin, std::span<const index_t> end, std::span<const index_t> strides) {
  return apply(detail::window_slice(begin, end, strides, "strided_slice"), std::forward<X>(x));
}
template <class X>
auto strided_slice(X&& x, std::initializer_list<index_t> begin, std::initializer_list<index_t> end,
                   std::initializer_list<index_t> strides) {
  return strided_slice(std::forward<X>(x), std::span(begin.begin(), begin.size()), std::span(end.begin(), end.size()),
                       std::span(strides.begin(), strides.size()));
}

// begin[a] >= 0, size[a] >= 0 or -1 for the rest of the axis; the window must lie inside x.
template <class X>
auto slice(X&& x, std::span<const index_t> begin, std::span<const index_t> size) {
  if (size.size() != begin.size() || begin.size() > static_cast<std::size_t>(max_rank)) {
    throw ValueError("duet::ops::slice: begin and size must have one entry per axis sliced, at most " +
                     std::to_string(max_rank) + ", got " + std::to_string(begin.size()) + " and " +
                     std::to_string(size.size()));
  }
  std::array<index_t, max_rank> end{};
  std::array<index_t, max_rank> ones{};
  for (std::size_t a = 0; a < begin.size(); ++a) {
    if (begin[a] < 0 || size[a] < -1) {
      throw ValueError("duet::ops::slice: begin must be >= 0 and a size >= 0, or -1 for the rest of the axis, got {" +
                       detail::list_text<index_t>(begin) + "} and {" + detail::list_text<index_t>(size) + "}");
    }
    end[a] = size[a] == -1 ? to_end : begin[a] + size[a];
    ones[a] = 1;
  }
  WindowSliceOp op = detail::window_slice(begin, std::span(end).first(begin.size()), std::span(ones).first(begin.size()), "slice");
  op.checked = true;
  return apply(op, std::forward<X>(x));
}
template <class X>
auto slice(X&& x, std::initializer_list<index_t> begin, std::initializer_list<index_t> size) {
  return slice(std::forward<X>(x), std::span(begin.begin(), begin.size()), std::span(size.begin(), size.size()));
}

// ----------------------------------------------------------------------------------------
// take<Axis, Index>(x): the slice of x at Index along Axis, that axis dropped: PyTorch's
// x[:, -1] (x.select(1, -1)), numpy's take(x, -1, axis=1) with one index, what a sequence
// model reads from every step's states (the last one) and a transformer from its tokens (the
// first). A negative Index counts from the end. It is squeeze<Axis> of a slice one element
// long, so its gradient, both modes and ONNX's Slice and Squeeze come with it; an Index from
// the start is a checked slice, whose error names the axis that does not hold it.
namespace detail {
template <int Axis, index_t Index, class X, std::size_t... A>
auto take_along(X&& x, std::index_sequence<A...>) {
  constexpr auto at = [](std::size_t a, index_t here, index_t elsewhere) {
    return a == static_cast<std::size_t>(Axis) ? here : elsewhere;
  };
  if constexpr (Index >= 0) {
    return squeeze<Axis>(slice(std::forward<X>(x), ints<at(A, Index, 0)...>, ints<at(A, 1, -1)...>));
  } else {
    return squeeze<Axis>(strided_slice(std::forward<X>(x), ints<at(A, Index, 0)...>,
                                       ints<at(A, Index == -1 ? to_end : Index + 1, to_end)...>, ints<at(A, 1, 1)...>));
  }
}
}  // namespace detail

template <int Axis, index_t Index, class X>
auto take(X&& x) {
  static_assert(Axis >= 0 && Axis < max_rank,
                "duet::ops::take<Axis, Index>: Axis counts from the first axis (0 for x[i], 1 for x[:, i])");
  return detail::take_along<Axis, Index>(std::forward<X>(x), std::make_index_sequence<Axis + 1>{});
}

// take<Axis>(x, index): the index given at run time (a decoder's step t), through the slices
// whose window is chosen at run time: graph mode reads it when it captures construct, as it
// reads theirs, and checks it against x's shape when the network runs.
template <int Axis, class X>
auto take(X&& x, index_t index) {
  static_assert(Axis >= 0 && Axis < max_rank,
                "duet::ops::take<Axis>(x, index): Axis counts from the first axis (0 for x[i], 1 for x[:, i])");
  std::array<index_t, Axis + 1> begin{};
  std::array<index_t, Axis + 1> end{};
  std::array<index_t, Axis + 1> strides{};
  end.fill(index >= 0 ? -1 : to_end);
  strides.fill(1);
  begin[Axis] = index;
  if (index >= 0) {
    end[Axis] = 1;  // slice's size
    return squeeze<Axis>(slice(std::forward<X>(x), std::span<const index_t>(begin), std::span<const index_t>(end)));
  }
  end[Axis] = index == -1 ? to_end : index + 1;
  return squeeze<Axis>(strided_slice(std::forward<X>(x), std::span<const index_t>(begin), std::span<const index_t>(end),
                                     std::span<const index_t>(strides)));
}

// split<Axis, Sizes...>(x): x cut along Axis into pieces of these sizes, which must add up to
// the axis's size (MindSpore's split(tensor, split_size_or_sections, axis) with sections).
// duet's operations make one value each, so split returns a std::tuple of one slice
// operation per piece: each reads x, and the gradients of the pieces that are used add up
// in x's gradient. Sizes are template arguments because they give the number of outputs.

namespace detail {
// Where each piece begins: the sizes before it, added.
template <std::size_t N>
constexpr std::array<index_t, N> prefix_sums(const std::array<index_t, N>& sizes) {
  std::array<index_t, N> b{};
  for (std::size_t i = 1; i < N; ++i) b[i] = b[i - 1] + sizes[i - 1];
  return b;
}

// One piece of an axis (split's, chunk's): where it begins and its length, or the fault of a
// size it does not fit.
struct Piece {
  index_t begin = 0;
  index_t count = 0;
  ShapeFault fault = ShapeFault::none;
  index_t expected = 0;
};

// The window of piece(size of x along axis): x whole elsewhere; the fault of an x without the
// axis.
template <class F>
constexpr Window piece_window(const Shape& x, int axis, F piece) {
  Window w;
  w.count = x;
  w.step.fill(1);
  const int a = axis_index(axis, x.rank());
  if (a < 0) {
    w.fault = ShapeFault::min_rank;
    w.expected = axis < 0 ? -axis : axis + 1;
    return w;
  }
  const Piece p = piece(x[a]);
  w.fault = p.fault;
  w.expected = p.expected;
  w.start[static_cast<std::size_t>(a)] = p.begin;
  w.count[a] = p.count;
  return w;
}
}  // namespace detail

template <int Axis, index_t Total, index_t Begin, index_t Size>
struct SplitOp : SlicePrimitive<SplitOp<Axis, Total, Begin, Size>> {
  // A piece along the first axis is one run of the input's elements.
  static constexpr bool is_view = Axis == 0;
  index_t view_offset(const Shape& x) const { return Begin * x.numel_from(1); }

  static constexpr detail::Window window(const Shape& x) {
    return detail::piece_window(x, Axis, [](index_t size) {
      if (size != dyn && size != Total) return detail::Piece{0, 0, ShapeFault::axis_size, Total};
      return detail::Piece{Begin, Size};
    });
  }

  static std::string op_name() {
    return "Split<" + std::to_string(Axis) + ">[" + std::to_string(Begin) + ":" + std::to_string(Begin + Size) + "]";
  }
  std::string label() const {
    return "ops::split<" + std::to_string(Axis) + "> piece [" + std::to_string(Begin) + ", " +
           std::to_string(Begin + Size) + ") of " + std::to_string(Total);
  }
};

template <int Axis, index_t... Sizes, class X>
auto split(const X& x) {
  static_assert(sizeof...(Sizes) >= 1, "duet::ops::split: give the size of each piece");
  static_assert(((Sizes >= 0) && ...), "duet::ops::split: sizes must be >= 0");
  constexpr std::array<index_t, sizeof...(Sizes)> sizes{Sizes...};
  constexpr std::array<index_t, sizeof...(Sizes)> begins = detail::prefix_sums(sizes);
  constexpr index_t total = begins.back() + sizes.back();
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::make_tuple(apply(SplitOp<Axis, total, begins[I], sizes[I]>{}, x)...);
  }(std::make_index_sequence<sizeof...(Sizes)>{});
}

// chunk<Axis, N>(x): x cut along Axis into pieces of ceil(size / N) elements, the last one
// smaller, as PyTorch's x.chunk(N, Axis) (MindSpore's ops.chunk), a std::tuple of them. As
// PyTorch's, a size that N pieces of that length would overshoot gives fewer (5 into 4: 2, 2,
// 1; 3 into 5: 1, 1, 1), and an empty axis N empty pieces. The number of pieces is the
// tuple's size, so it is known where the size is at compile time (a static tensor, a capture
// on a static shape): then the pieces are split's. Where the size is known only when it runs
// (a duet::Tensor, a capture on any shape), there are N pieces, each a slice whose window is
// computed then, and a size that PyTorch cuts into fewer than N is a duet::ShapeError.

namespace detail {
// The size of X along axis, where the type of X says it (dyn elsewhere).
template <class X>
constexpr index_t static_size_along(int axis) {
  using V = std::remove_cvref_t<X>;
  Shape s = Shape::any();
  if constexpr (graph::Symbolic<V>) {
    s = V::shape;
  } else if constexpr (requires { V::static_shape; }) {
    s = V::static_shape;
  }
  const bool known = s.leading_unknown() ? axis < 0 && -axis <= s.rank() : axis_index(axis, s.rank()) >= 0;
  return known ? s[axis] : dyn;
}

// A size cut into n chunks, as PyTorch's: each chunk's length but the last's, and how many
// there are (n empty ones of an empty axis).
constexpr index_t chunk_length(index_t size, index_t n) { return (size + n - 1) / n; }
constexpr index_t chunk_count(index_t size, index_t n) {
  return size == 0 ? n : (size + chunk_length(size, n) - 1) / chunk_length(size, n);
}
// Chunk k of them, of length 0 past the last.
constexpr Piece chunk_piece(index_t size, index_t n, index_t k) {
  const index_t length = chunk_length(size, n);
  return {std::min(k * length, size), std::clamp<index_t>(size - k * length, 0, length)};
}
}  // namespace detail

// Piece K of chunk<Axis, N> of a size known when it runs.
template <int Axis, index_t N, index_t K>
struct ChunkOp : SlicePrimitive<ChunkOp<Axis, N, K>> {
  static constexpr bool is_view = Axis == 0;
  index_t view_offset(const Shape& x) const { return window(x).start[0] * x.numel_from(1); }

  static constexpr detail::Window window(const Shape& x) {
    return detail::piece_window(x, Axis, [](index_t size) {
      if (size == dyn) return detail::Piece{0, dyn};
      if (detail::chunk_count(size, N) != N) return detail::Piece{0, 0, ShapeFault::chunk_count, N};
      return detail::chunk_piece(size, N, K);
    });
  }

  static std::string op_name() {
    return "Chunk<" + std::to_string(Axis) + ", " + std::to_string(N) + ">[" + std::to_string(K) + "]";
  }
  std::string label() const {
    return "ops::chunk<" + std::to_string(Axis) + ", " + std::to_string(N) + "> piece " + std::to_string(K);
  }
};

template <int Axis, index_t N, class X>
auto chunk(const X& x) {
  static_assert(N >= 1, "duet::ops::chunk: N, the number of pieces, must be at least 1");
  constexpr index_t size = detail::static_size_along<X>(Axis);
  if constexpr (size != dyn) {
    constexpr index_t count = detail::chunk_count(size, N);
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return split<Axis, detail::chunk_piece(size, N, static_cast<index_t>(K)).count...>(x);
    }
    (std::make_index_sequence<static_cast<std::size_t>(count)>{});
  } else {
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return std::make_tuple(apply(ChunkOp<Axis, N, static_cast<index_t>(K)>{}, x)...);
    }
    (std::make_index_sequence<static_cast<std::size_t>(N)>{});
  }
}

// ----------------------------------------------------------------------------------------
// 0, 1, ..., n - 1 as int32, n the size of x along Axis: a sequence's positions, made from the
// sequence itself (PyTorch's torch.arange(x.size(1))) so that a positional Embedding serves any
// length in graph mode too. x's values are not read, and get no gradient.
template <int Axis>
struct PositionsOp : Primitive<PositionsOp<Axis>> {
  using value_type = std::int32_t;
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    const int a = detail::axis_index(Axis, x.rank());
    if (a < 0) return x.leading_unknown() ? ShapeResult{Shape{dyn}} : fault(x, ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    // Counted from the front, an axis of a shape with unknown leading axes is not known.
    if (x.leading_unknown() && Axis >= 0) return {Shape{dyn}};
    if (x[a] > std::numeric_limits<std::int32_t>::max()) return fault(x, ShapeFault::axis_size, std::numeric_limits<std::int32_t>::max());
    return {Shape{x[a]}};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    T* out = a.out<T>();
    for (index_t i = 0; i < a.output_shape.numel(); ++i) out[i] = static_cast<T>(i);
  }

  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }

  static std::string op_name() { return "Positions<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::positions<" + std::to_string(Axis) + ">"; }
  // ONNX: Range(0, n, 1) for n the size the input has when it runs (Shape of that one axis),
  // so that an exported model serves any length too.
  Interchange interchange(std::span<const Shape> in) const {
    using I = InterchangeInput;
    const std::int64_t a = detail::axis_index(Axis, in[0].rank());
    return {{"Shape", {I::operand(0)}, {InterchangeAttribute::of("start", a), InterchangeAttribute::of("end", a + 1)}},
            {"Squeeze", {I::node(0), I::constant({0})}, {}},
            {"Range", {I::integer(0), I::node(1), I::integer(1)}, {}},
            {"Cast", {I::node(2)}, {InterchangeAttribute::of("to", 6)}}};  // 6: ONNX's INT32
  }
};

// ops::positions<1>(ids): [0, 1, ..., T - 1] for ids of shape [B, T].
template <int Axis, class X>
auto positions(const X& x) {
  return apply(PositionsOp<Axis>{}, x);
}

// ----------------------------------------------------------------------------------------
// flip<A...>(x): x reversed along each axis A (PyTorch's torch.flip(x, dims), numpy's flip;
// negative axes count from the end). A slice that walks those axes backwards from their last
// element, so the kernel and the gradient (dy flipped back) are the slices'. Not written as
// strided_slice with stride -1: its lists go by position from axis 0, so they cannot name an
// axis from the end of an input whose rank is known only when it runs.
template <int... A>
struct FlipOp : SlicePrimitive<FlipOp<A...>> {
  static constexpr std::array<int, sizeof...(A)> axes{A...};

  // Not the slices' rule, which gives up on unknown leading axes: flip keeps any shape.
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::along_axes_rule(in[0], axes); }

  static constexpr detail::Window window(const Shape& x) {
    detail::Window w;
    w.count = x;
    w.step.fill(1);
    for (int axis : axes) {
      const int a = detail::axis_index(axis, x.rank());
      // A step never taken stays 1, as strided_window's, so that a size-1 axis is left whole.
      if (x[a] < 2) continue;
      w.start[static_cast<std::size_t>(a)] = x[a] - 1;
      w.step[static_cast<std::size_t>(a)] = -1;
    }
    return w;
  }

  static std::string op_name() { return "Flip<" + detail::list_text<int>({A...}) + ">"; }
  std::string label() const { return "ops::flip<" + detail::list_text<int>({A...}) + ">"; }
};

template <int... A, class X>
auto flip(X&& x) {
  return apply(FlipOp<A...>{}, std::forward<X>(x));
}

inline const bool shape_listed =
    list_operations({"reshape", "unflatten", "flatten", "transpose", "permute", "expand_dims", "squeeze", "concat",
                     "stack", "split", "chunk", "tile", "slice", "strided_slice", "flip", "take", "positions"});

}  // namespace ops
}  // namespace duet
