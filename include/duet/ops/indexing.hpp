// Indexing operations: gather (index_select), gather_elements (torch.gather), one_hot, and the
// sorts that make indices, topk, sort and argsort, in both modes.
//
// Every index is int32, as duet's labels and ids, and is checked before anything is read with
// it: an index outside [0, size) is a duet::IndexError naming the index, its place and the
// bound, in both modes. Indices never get a gradient: they are integers. What an index reads
// gets dy back where it was read from, added up where two indices read the same element.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../eager.hpp"
#include "../error.hpp"
#include "../operation.hpp"
#include "shape.hpp"

namespace duet {
namespace ops {

// ----------------------------------------------------------------------------------------
// gather<Axis>(params, indices): the slices of params along Axis that int32 indices name,
// in the indices' shape: output shape params[:Axis] + indices + params[Axis + 1:]
// (MindSpore's gather(input_params, input_indices, axis)). An index outside [0, size) is a
// duet::IndexError. The indices have no gradient; params' gradient adds dy's slices back
// where they were read from, so an index read twice gets both.

namespace detail {
// Checks every index before anything is read with it.
inline void check_indices(const std::int32_t* idx, index_t n, index_t bound, const std::string& who) {
  for (index_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= bound) {
      throw IndexError(who + ": index " + std::to_string(idx[i]) + " (element " + std::to_string(i) +
                       " of the indices) is out of range [0, " + std::to_string(bound) + ")");
    }
  }
}

// Calls f(output offset, params offset, count) for each run of `inner` elements gather copies.
template <class F>
void for_each_gathered(const Shape& params, int a, const std::int32_t* idx, index_t n_idx, F&& f) {
  const index_t inner = params.numel_from(a + 1);
  const index_t rows = params.numel() / params.numel_from(a);
  const index_t size = params[a];
  for (index_t r = 0; r < rows; ++r) {
    for (index_t j = 0; j < n_idx; ++j) f((r * n_idx + j) * inner, (r * size + idx[j]) * inner, inner);
  }
}
}  // namespace detail

// What gather and gather_elements share: the kernel that copies what the indices read, and the
// gradient that adds dy back there. Self::for_each_read(x, indices' shape, axis, indices, f)
// calls f(output offset, x offset, count) for each run of elements it copies.
template <class Fwd>
struct IndexedReadGradOp;

template <class Self, int Axis>
struct IndexedReadPrimitive : Primitive<Self> {
  static constexpr int arity = 2;

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const Shape& x = args.in_shape(0);
    const int a = detail::axis_index(Axis, x.rank());
    const std::int32_t* idx = args.in<std::int32_t>(1);
    detail::check_indices(idx, args.in_shape(1).numel(), x[a], static_cast<const Self&>(*this).label());
    const T* xs = args.in<T>(0);
    T* y = args.out<T>();
    Self::for_each_read(x, args.in_shape(1), a, idx,
                        [&](index_t o, index_t i, index_t n) { std::copy_n(xs + i, n, y + o); });
  }

  template <std::size_t K>
  requires(K < 2) auto grad_op() const {
    if constexpr (K == 0)
      return IndexedReadGradOp<Self>{};
    else
      return NoGradient{};
  }
};

// d/d x of gather and gather_elements: zeros, with dy added where each index read, in the
// indices' order, so that both modes add in the same order.
template <class Fwd>
struct IndexedReadGradOp : Primitive<IndexedReadGradOp<Fwd>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const Shape& x = args.in_shape(1);
    const int a = detail::axis_index(Fwd::axis, x.rank());
    const std::int32_t* idx = args.in<std::int32_t>(2);
    detail::check_indices(idx, args.in_shape(2).numel(), x[a], Fwd{}.label() + " (gradient)");
    const T* dy = args.in<T>(0);
    T* dx = args.out<T>();
    std::fill_n(dx, x.numel(), T(0));
    Fwd::for_each_read(x, args.in_shape(2), a, idx, [&](index_t o, index_t i, index_t n) {
      for (index_t k = 0; k < n; ++k) dx[i + k] += dy[o + k];
    });
  }

  static std::string op_name() { return Fwd::grad_name(); }
};

template <int Axis>
struct GatherOp : IndexedReadPrimitive<GatherOp<Axis>, Axis> {
  static constexpr int axis = Axis;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& p = in[0];
    const Shape& idx = in[1];
    if (p.leading_unknown() || idx.leading_unknown()) return {Shape::any()};
    const int a = detail::axis_index(Axis, p.rank());
    if (a < 0) return fault(p, ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    Shape out;
    for (int i = 0; i < a; ++i) out.push_back(p[i]);
    for (index_t d : idx) out.push_back(d);
    for (int i = a + 1; i < p.rank(); ++i) out.push_back(p[i]);
    return {out};
  }

  template <class F>
  static void for_each_read(const Shape& p, const Shape& indices, int a, const std::int32_t* idx, F&& f) {
    detail::for_each_gathered(p, a, idx, indices.numel(), f);
  }

  static std::string op_name() { return "Gather<" + std::to_string(Axis) + ">"; }
  static std::string grad_name() { return "GatherGrad<" + std::to_string(Axis) + ">"; }
  Interchange interchange(std::span<const Shape>) const {
    return {{"Gather",
             {InterchangeInput::operand(0), InterchangeInput::operand(1)},
             {InterchangeAttribute::of("axis", Axis)}}};
  }
  std::string label() const { return "ops::gather<" + std::to_string(Axis) + ">"; }
};

template <int Axis = 0, class P, class I>
auto gather(const P& params, const I& indices) {
  static_assert(std::is_same_v<typename std::remove_cvref_t<I>::value_type, std::int32_t>,
                "duet::ops::gather: the indices must be int32 tensors");
  return apply(GatherOp<Axis>{}, params, indices);
}

// ----------------------------------------------------------------------------------------
// gather_elements<Axis>(x, indices): PyTorch's torch.gather(x, dim, index), ONNX's
// GatherElements, numpy's take_along_axis: out[i][j][k] = x[indices[i][j][k]][j][k] for Axis
// 0, and likewise along any axis. The indices have x's rank and are no larger than x along
// the other axes (torch's rule; numpy's broadcasting is not done); the output has their shape.
// x's gradient adds each element of dy back where its index read it (a scatter-add), so an
// element read twice gets both.

template <int Axis>
struct GatherElementsOp : IndexedReadPrimitive<GatherElementsOp<Axis>, Axis> {
  static constexpr int axis = Axis;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    const Shape& idx = in[1];
    if (x.leading_unknown() || idx.leading_unknown()) return {idx};
    const int a = detail::axis_index(Axis, x.rank());
    if (a < 0) return fault(idx, ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    if (idx.rank() != x.rank()) return fault(idx, ShapeFault::indices_fit, a, 1);
    for (int d = 0; d < x.rank(); ++d) {
      if (d != a && x[d] != dyn && idx[d] != dyn && idx[d] > x[d]) return fault(idx, ShapeFault::indices_fit, a, 1);
    }
    return {idx};
  }

  // One element a run: element i of the indices reads x where the walk of the indices' other
  // axes through x meets the index along the axis.
  template <class F>
  static void for_each_read(const Shape& x, const Shape& indices, int a, const std::int32_t* idx, F&& f) {
    std::array<index_t, max_rank> stride = detail::strides_of(x);
    const index_t along = stride[static_cast<std::size_t>(a)];
    stride[static_cast<std::size_t>(a)] = 0;
    detail::for_each_strided(0, stride, indices, [&](index_t i, index_t j) { f(i, j + idx[i] * along, 1); });
  }

  static std::string op_name() { return "GatherElements<" + std::to_string(Axis) + ">"; }
  static std::string grad_name() { return "GatherElementsGrad<" + std::to_string(Axis) + ">"; }
  Interchange interchange(std::span<const Shape>) const {
    return {{"GatherElements",
             {InterchangeInput::operand(0), InterchangeInput::operand(1)},
             {InterchangeAttribute::of("axis", Axis)}}};
  }
  std::string label() const { return "ops::gather_elements<" + std::to_string(Axis) + ">"; }
};

template <int Axis, class X, class I>
auto gather_elements(const X& x, const I& indices) {
  static_assert(std::is_same_v<typename std::remove_cvref_t<I>::value_type, std::int32_t>,
                "duet::ops::gather_elements: the indices must be int32 tensors");
  return apply(GatherElementsOp<Axis>{}, x, indices);
}

// ----------------------------------------------------------------------------------------
// topk<K, Axis = -1>(x), topk<Axis = -1>(x, k), sort<Axis = -1>(x, descending),
// argsort<Axis = -1>(x, descending): the positions along Axis in the order of their values,
// largest first for topk (torch.topk(x, k, dim), sorted=True), smallest first for sort unless
// descending (torch.sort). Equal values keep their order (lower index first, as
// torch.sort(stable=True)); torch.topk leaves the order of ties unspecified, and its CPU kernel
// does not keep it. A NaN counts as larger than any number, as in torch. The values are
// gather_elements(x, indices), so their gradient is gather_elements' and needs no kernel of
// its own; the indices get none.

// What topk and sort return, as torch's namedtuple: y.values, y.indices, or
// auto [values, indices] = ops::topk<3>(x).
template <class V, class I>
struct Sorted {
  V values;
  I indices;
};

namespace detail {
// Whether a goes before b, by value (a NaN the largest), then by position.
template <class T>
bool sorts_before(T a, T b, index_t i, index_t j, bool descending) {
  if constexpr (std::is_floating_point_v<T>) {
    const bool na = std::isnan(a), nb = std::isnan(b);
    if (na != nb) return descending ? na : nb;
    if (na) return i < j;
  }
  if (a != b) return descending ? a > b : a < b;
  return i < j;
}
}  // namespace detail

// The indices' kernel, shared by every form: the count kept is the output's size along the
// axis, the order Self::descending(). In is x's element type: the kernel is instantiated for
// the output's (int32).
template <class Self, int Axis, class In>
struct SortIndicesPrimitive : Primitive<Self> {
  using value_type = std::int32_t;
  static constexpr int arity = 1;

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const Shape& s = args.in_shape();
    const int a = detail::axis_index(Axis, s.rank());
    const index_t n = s[a];
    const index_t k = args.output_shape[a];
    const index_t inner = s.numel_from(a + 1);
    const index_t outer = n == 0 ? 0 : s.numel() / (n * inner);
    const bool descending = static_cast<const Self&>(*this).descending();
    const In* x = args.in<In>();
    T* y = args.out<T>();
    std::vector<index_t> order(static_cast<std::size_t>(n));
    for (index_t o = 0; o < outer; ++o) {
      for (index_t i = 0; i < inner; ++i) {
        const In* row = x + o * n * inner + i;
        std::iota(order.begin(), order.end(), index_t{0});
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](index_t p, index_t q) {
          return detail::sorts_before(row[p * inner], row[q * inner], p, q, descending);
        });
        for (index_t j = 0; j < k; ++j) y[(o * k + j) * inner + i] = static_cast<T>(order[static_cast<std::size_t>(j)]);
      }
    }
  }

  // Of input 0, the only one: the indices are integers, constant where x has no ties.
  template <std::size_t K>
  NoGradient grad_op() const {
    return {};
  }

 protected:
  static constexpr index_t every = -2;

  // x's shape with `count` elements along the axis (dyn: known when it runs; every: all).
  static constexpr ShapeResult keeping(const Shape& x, index_t count) {
    const int a = detail::axis_index(Axis, x.rank());
    // Counted from the front, an axis of a shape with unknown leading axes is not known.
    if (x.leading_unknown() && (Axis >= 0 || a < 0)) return {Shape::any()};
    if (a < 0) return fault(x, ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    if (count == every) return {x};
    if (x[a] != dyn && x[a] > std::numeric_limits<std::int32_t>::max())
      return fault(x, ShapeFault::axis_size, std::numeric_limits<std::int32_t>::max());
    if (x[a] != dyn && count != dyn && x[a] < count) return fault(x, ShapeFault::axis_at_least, count);
    Shape out = x;
    out[a] = count;
    return {out};
  }
};

template <index_t K, int Axis, class In>
struct TopKOp : SortIndicesPrimitive<TopKOp<K, Axis, In>, Axis, In> {
  static_assert(K >= 0, "duet::ops::topk: K must be >= 0");

  static constexpr bool descending() { return true; }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return TopKOp::keeping(in[0], K); }

  static std::string op_name() { return "TopK<" + std::to_string(K) + ", " + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::topk<" + std::to_string(K) + ", " + std::to_string(Axis) + ">"; }
};

// k given at run time: graph mode reads it when it captures construct, as one_hot's depth, and
// knows the axis's size when the network first runs.
template <int Axis, class In>
struct TopKCountOp : SortIndicesPrimitive<TopKCountOp<Axis, In>, Axis, In> {
  index_t k = 0;

  static constexpr bool descending() { return true; }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return TopKCountOp::keeping(in[0], dyn); }
  ShapeResult infer(std::span<const Shape> in) const { return TopKCountOp::keeping(in[0], k); }

  static std::string op_name() { return "TopK<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::topk<" + std::to_string(Axis) + ">(x, " + std::to_string(k) + ")"; }
};

template <int Axis, class In>
struct SortIndicesOp : SortIndicesPrimitive<SortIndicesOp<Axis, In>, Axis, In> {
  bool descending_order = false;

  bool descending() const { return descending_order; }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return SortIndicesOp::keeping(in[0], SortIndicesOp::every);
  }

  static std::string op_name() { return "Argsort<" + std::to_string(Axis) + ">"; }
  std::string label() const {
    return "ops::argsort<" + std::to_string(Axis) + ">" + (descending_order ? "(x, descending)" : "");
  }
};

namespace detail {
// Not Sorted{...}: clang 14 deduces no aggregate's template arguments.
template <int Axis, class X, class I>
auto sorted_by(const X& x, I indices) {
  auto values = gather_elements<Axis>(x, indices);
  return Sorted<decltype(values), I>{std::move(values), std::move(indices)};
}
}  // namespace detail

template <index_t K, int Axis = -1, class X>
auto topk(const X& x) {
  auto indices = apply(TopKOp<K, Axis, typename std::remove_cvref_t<X>::value_type>{}, x);
  return detail::sorted_by<Axis>(x, indices);
}

// Throws duet::ValueError for a negative k.
template <int Axis = -1, class X>
auto topk(const X& x, index_t k) {
  if (k < 0) throw ValueError("duet::ops::topk: k " + std::to_string(k) + " must be >= 0");
  TopKCountOp<Axis, typename std::remove_cvref_t<X>::value_type> op;
  op.k = k;
  auto indices = apply(op, x);
  return detail::sorted_by<Axis>(x, indices);
}

template <int Axis = -1, class X>
auto argsort(const X& x, bool descending = false) {
  SortIndicesOp<Axis, typename std::remove_cvref_t<X>::value_type> op;
  op.descending_order = descending;
  return apply(op, x);
}

template <int Axis = -1, class X>
auto sort(const X& x, bool descending = false) {
  auto indices = argsort<Axis>(x, descending);
  return detail::sorted_by<Axis>(x, indices);
}

// one_hot<Depth>(indices): int32 indices of any shape to values of element type T (float
// unless given) of shape indices + [Depth], 1 where the new last axis is at the index and 0
// elsewhere (PyTorch's F.one_hot(t, num_classes), MindSpore's ops.one_hot(indices, depth)
// with on_value 1 and off_value 0); one_hot(indices, depth) takes the depth at run time. An
// index outside [0, Depth) is a duet::IndexError, as gather's. The indices get no gradient,
// as gather's: they are integers.

// What both forms share: the kernel, which reads the depth off the output's last axis, and
// the indices' lack of a gradient.
template <class Self, ElementType T>
struct OneHotPrimitive : Primitive<Self> {
  using value_type = T;
  static constexpr int arity = 1;

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const std::int32_t* idx = a.in<std::int32_t>();
    const index_t n = a.in_shape().numel();
    const index_t depth = a.output_shape.back();
    detail::check_indices(idx, n, depth, static_cast<const Self&>(*this).label());
    U* y = a.out<U>();
    Backend::fill(y, n * depth, U(0));
    for (index_t i = 0; i < n; ++i) y[i * depth + idx[i]] = U(1);
  }

  // Of input 0, the only one.
  template <std::size_t K>
  NoGradient grad_op() const {
    return {};
  }

 protected:
  static constexpr ShapeResult with_depth(const Shape& indices, index_t depth) {
    Shape out = indices;
    out.push_back(depth);
    return {out};
  }
};

template <index_t Depth, ElementType T>
struct OneHotOp : OneHotPrimitive<OneHotOp<Depth, T>, T> {
  static_assert(Depth >= 0, "duet::ops::one_hot: the depth must be >= 0");

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return OneHotOp::with_depth(in[0], Depth); }

  static std::string op_name() { return "OneHot<" + std::to_string(Depth) + ">"; }
  std::string label() const { return "ops::one_hot<" + std::to_string(Depth) + ">"; }
};

// The depth given at run time: graph mode reads it when it captures construct, as tile's
// multiples, and knows the last axis's size when the network first runs.
template <ElementType T>
struct OneHotDepthOp : OneHotPrimitive<OneHotDepthOp<T>, T> {
  index_t depth = 0;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return OneHotDepthOp::with_depth(in[0], dyn); }
  ShapeResult infer(std::span<const Shape> in) const { return OneHotDepthOp::with_depth(in[0], depth); }

  static std::string op_name() { return "OneHot"; }
  std::string label() const { return "ops::one_hot(indices, " + std::to_string(depth) + ")"; }
};

template <index_t Depth, ElementType T = float, class I>
auto one_hot(const I& indices) {
  static_assert(std::is_same_v<typename std::remove_cvref_t<I>::value_type, std::int32_t>,
                "duet::ops::one_hot: the indices must be int32 tensors");
  return apply(OneHotOp<Depth, T>{}, indices);
}

// Throws duet::ValueError for a negative depth.
template <ElementType T = float, class I>
auto one_hot(const I& indices, index_t depth) {
  static_assert(std::is_same_v<typename std::remove_cvref_t<I>::value_type, std::int32_t>,
                "duet::ops::one_hot: the indices must be int32 tensors");
  if (depth < 0) throw ValueError("duet::ops::one_hot: the depth " + std::to_string(depth) + " must be >= 0");
  OneHotDepthOp<T> op;
  op.depth = depth;
  return apply(op, indices);
}

inline const bool indexing_listed =
    list_operations({"gather", "gather_elements", "one_hot", "topk", "sort", "argsort"});

}  // namespace ops
}  // namespace duet
