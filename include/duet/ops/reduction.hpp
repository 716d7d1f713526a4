// Reductions: sum, mean, prod, max and min over axes, with keep_dims, argmax, argmin
// (MindSpore's ops.sum(x, dim, keepdim), ReduceSum(keep_dims), ops.prod, ops.argmax), the
// statistics var and std made of them, and cumsum, the running sum along an axis, in both modes.
//
// Spelling. The reduced axes shape the output, and graph mode computes every node's shape
// while the program compiles, so they are template arguments, given as tag values:
//   ops::sum(x)                                   every axis, a scalar
//   ops::sum(x, ops::axes<1>)                     axis 1 ([2, 3, 4] -> [2, 4])
//   ops::mean(x, ops::axes<0, -1>, ops::keep_dims)  axes 0 and -1, kept as 1 ([2, 3, 4] -> [1, 3, 1])
//   ops::argmax(x), ops::argmax(x, ops::axis<0>, ops::keep_dims)   one axis, -1 by default
// Negative axes count from the end, as in numpy. The same axis twice does not compile.
//
// Gradients. sum and mean send the incoming gradient back along the reduced axes (mean divided
// by the number of elements reduced). prod sends each element dy times the product of the
// others in its group, made without dividing by the element, so that a group holding zeros
// gets PyTorch's gradient, not 0/0. max and min send it to the elements equal to the
// extreme; where several are, it is split evenly among them, as PyTorch's amax/amin do: any
// other choice makes max(x) of a constant tensor depend on an arbitrary index, and splitting
// keeps the gradient's sum equal to the incoming one. A NaN extreme sends its gradient to the
// NaN elements. argmax and argmin make int32 indices and have no gradient: they declare
// `differentiable = false`, so a gradient that reaches them does not compile in graph mode
// and throws duet::ValueError in PyNative mode.
//
// Kernels. Both modes call the same kernel, so they agree bit for bit. Each output
// accumulates in the element type (a sum of a comparison's UInt8 mask in int32), over runs of
// a group's elements in order, and the runs' results are combined pairwise (detail::Pairwise),
// so that a sum's rounding error grows with the log of the group's size, as PyTorch's does.
// The input is seen as groups (one per output element), after merging neighbouring axes of
// the same kind and dropping axes of size 1:
//  - the reduced axes are the innermost: each group is contiguous, each run of it reduced by
//    Eigen's vectorised reduction (per-lane partial results combined at the end: a fixed order
//    for a given length and build);
//  - one block of reduced axes with kept axes inside it ([outer, reduced, inner]): a run's row
//    of `inner` results is accumulated row by row of the input, in increasing index along the
//    reduced block, each row one vectorised pass (a strided, cache-friendly walk);
//  - anything else (reduced axes not adjacent, as axes 0 and 2 of a 4-D tensor): each run in
//    increasing input index, one running value.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include <Eigen/Core>

#include "arithmetic.hpp"
#include "cast.hpp"
#include "gradient_control.hpp"
#include "math.hpp"
#include "shape.hpp"

namespace duet {
namespace ops {

// The reduced axes, as a template value: ops::axes<1>, ops::axes<0, 2>; none means every axis.
template <int... A>
struct Axes {
  static constexpr std::array<int, sizeof...(A)> values{A...};
  static constexpr bool distinct = [] {
    for (std::size_t i = 0; i < values.size(); ++i) {
      for (std::size_t j = i + 1; j < values.size(); ++j) {
        if (values[i] == values[j]) return false;
      }
    }
    return true;
  }();
  static_assert(distinct, "duet::ops::axes: an axis is listed twice");
};
template <int... A>
inline constexpr Axes<A...> axes{};
// One axis (argmax, argmin).
template <int A>
inline constexpr Axes<A> axis{};

// Keeps the reduced axes in the output, with size 1 (MindSpore's keep_dims=True).
struct KeepDims {};
inline constexpr KeepDims keep_dims{};

// The reduced axes given at run time (ops::sum(x, {0, 2}); an ONNX model's ReduceMean): one
// operation for every set of axes, as transpose(x, perm) is for every permutation. None means
// every axis, as in Axes<>. Whether the reduced axes are kept is a value here too, so that the
// run-time form is one operation per reduction (ReduceOp's Keep is then false).
struct AxesList {
  std::array<int, max_rank> list{};
  std::size_t count = 0;
  bool keep = false;
};

namespace detail {
template <int... A>
constexpr std::span<const int> axes_of(Axes<A...>) {
  return Axes<A...>::values;
}
constexpr std::span<const int> axes_of(const AxesList& a) { return std::span(a.list).first(a.count); }
}  // namespace detail

namespace detail {

// Which axes of a shape of rank `rank` the values name; false if one is out of range, with
// `needed` the rank it would need.
struct AxisMask {
  std::array<bool, max_rank> reduced{};
  bool ok = true;
  index_t needed = 0;
  int twice = -1;  // an axis named twice (0 and -rank), as numpy refuses
};

constexpr AxisMask axis_mask(int rank, std::span<const int> values) {
  AxisMask m;
  if (values.empty()) {
    for (int i = 0; i < rank; ++i) m.reduced[static_cast<std::size_t>(i)] = true;
  }
  for (int a : values) {
    const int normal = a < 0 ? a + rank : a;
    if (normal < 0 || normal >= rank) {
      m.ok = false;
      m.needed = std::max<index_t>(m.needed, a < 0 ? -a : a + 1);
      continue;
    }
    if (m.reduced[static_cast<std::size_t>(normal)]) m.twice = normal;
    m.reduced[static_cast<std::size_t>(normal)] = true;
  }
  return m;
}

// The output shape of reducing `in` over `values` (every axis if none). An input of unknown
// leading axes gives a scalar when every axis is reduced without keep_dims, its known
// trailing axes when the axes are negative and among them, and an unknown shape otherwise.
// NonEmpty: the reduction has no identity (max, min, argmax), so a reduced axis of size 0 is
// refused.
constexpr ShapeResult reduced_shape(const Shape& in, std::span<const int> values, bool keep, bool non_empty) {
  if (in.leading_unknown()) {
    if (values.empty()) return {keep ? Shape::any() : Shape{}};
    for (int a : values) {
      if (a >= 0 || -a > in.rank()) return {Shape::any()};
    }
  }
  const AxisMask m = axis_mask(in.rank(), values);
  if (!m.ok) return fault(Shape::any(), ShapeFault::min_rank, m.needed);
  if (m.twice >= 0) return fault(Shape::any(), ShapeFault::axis_twice, m.twice);
  Shape out = in.leading_unknown() ? Shape::any() : Shape{};
  bool empty = false;
  for (int i = 0; i < in.rank(); ++i) {
    if (!m.reduced[static_cast<std::size_t>(i)]) out.push_back(in[i]);
    else {
      empty = empty || in[i] == 0;
      if (keep) out.push_back(1);
    }
  }
  if (non_empty && empty) return fault(out, ShapeFault::empty_reduction, 0);
  return {out};
}

// A reduction of a concrete shape, as groups of input elements, one group per output element
// in the output's order. Neighbouring axes of the same kind are merged and axes of size 1
// dropped; the lists are innermost first, each axis with its stride in the input.
struct ReduceLayout {
  std::array<index_t, max_rank> kept_size{}, kept_stride{}, red_size{}, red_stride{};
  int kept = 0;
  int red = 0;
  index_t outputs = 1;
  index_t group = 1;

  // Each group contiguous: the reduced axes are the innermost.
  bool contiguous() const { return red == 1 && red_stride[0] == 1; }
  // [outer, reduced, inner]: one block of reduced axes, the innermost axis kept.
  bool strided() const { return red == 1 && kept >= 1 && kept_stride[0] == 1 && kept <= 2; }
  index_t inner() const { return kept_size[0]; }

  // f(j, base) for each output j, base the offset of its group's first element.
  template <class F>
  void for_each_group(F&& f) const {
    std::array<index_t, max_rank> index{};
    index_t base = 0;
    for (index_t j = 0; j < outputs; ++j) {
      f(j, base);
      for (int a = 0; a < kept; ++a) {
        const std::size_t ax = static_cast<std::size_t>(a);
        base += kept_stride[ax];
        if (++index[ax] < kept_size[ax]) break;
        base -= kept_stride[ax] * index[ax];
        index[ax] = 0;
      }
    }
  }

  // f(offset) for each element of a group, in increasing input index (offsets from its base).
  template <class F>
  void for_each_in_group(F&& f) const {
    if (red <= 1) {
      const index_t stride = red == 0 ? 0 : red_stride[0];
      for (index_t r = 0; r < group; ++r) f(r * stride);
      return;
    }
    std::array<index_t, max_rank> index{};
    index_t offset = 0;
    for (index_t r = 0; r < group; ++r) {
      f(offset);
      for (int a = 0; a < red; ++a) {
        const std::size_t ax = static_cast<std::size_t>(a);
        offset += red_stride[ax];
        if (++index[ax] < red_size[ax]) break;
        offset -= red_stride[ax] * index[ax];
        index[ax] = 0;
      }
    }
  }
};

inline ReduceLayout reduce_layout(const Shape& in, const AxisMask& m) {
  ReduceLayout l;
  index_t stride = 1;
  int last_kind = -1;  // 0 kept, 1 reduced: the kind of the entry appended last
  for (int i = in.rank() - 1; i >= 0; --i) {
    const index_t d = in[i];
    const bool reduced = m.reduced[static_cast<std::size_t>(i)];
    if (reduced) l.group *= d;
    else l.outputs *= d;
    if (d != 1) {
      auto& size = reduced ? l.red_size : l.kept_size;
      auto& strides = reduced ? l.red_stride : l.kept_stride;
      int& count = reduced ? l.red : l.kept;
      if (last_kind == static_cast<int>(reduced)) {
        size[static_cast<std::size_t>(count - 1)] *= d;
      } else {
        size[static_cast<std::size_t>(count)] = d;
        strides[static_cast<std::size_t>(count)] = stride;
        ++count;
        last_kind = static_cast<int>(reduced);
      }
    }
    stride *= d;
  }
  return l;
}

template <class T>
using ArrayMap = ::Eigen::Map<::Eigen::Array<T, ::Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = ::Eigen::Map<const ::Eigen::Array<T, ::Eigen::Dynamic, 1>>;

// What each reduction does with one group: its first element, then combine with each next.
// sequential: the most elements of a group (rows, on the strided path: a sixteenth as many)
// combined in order before Pairwise combines the runs; max and min are exact in any order.
struct SumReducer {
  static constexpr std::string_view name = "ReduceSum";
  static constexpr bool mean = false;
  static constexpr bool non_empty = false;
  static constexpr int identity = 0;  // of an empty group
  static constexpr index_t sequential = 1024;
  template <class T>
  static T combine(T a, T b) {
    return a + b;
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.sum();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc += row;
  }
};

struct MeanReducer : SumReducer {
  static constexpr std::string_view name = "ReduceMean";
  static constexpr bool mean = true;
};

// Pairwise like a sum: a float product's rounding error grows with the log of its length too.
struct ProdReducer {
  static constexpr std::string_view name = "ReduceProd";
  static constexpr bool mean = false;
  static constexpr bool non_empty = false;
  static constexpr int identity = 1;
  static constexpr index_t sequential = 1024;
  template <class T>
  static T combine(T a, T b) {
    return a * b;
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.prod();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc *= row;
  }
};

struct MaxReducer {
  static constexpr std::string_view name = "ReduceMax";
  static constexpr bool mean = false;
  static constexpr bool non_empty = true;
  static constexpr index_t sequential = std::numeric_limits<index_t>::max();
  template <class T>
  static T combine(T a, T b) {
    return fn::Maximum::apply(a, b);
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.template maxCoeff<::Eigen::PropagateNaN>();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc = acc.binaryExpr(row, ::Eigen::internal::scalar_max_op<T, T, ::Eigen::PropagateNaN>());
  }
};

struct MinReducer {
  static constexpr std::string_view name = "ReduceMin";
  static constexpr bool mean = false;
  static constexpr bool non_empty = true;
  static constexpr index_t sequential = std::numeric_limits<index_t>::max();
  template <class T>
  static T combine(T a, T b) {
    return fn::Minimum::apply(a, b);
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.template minCoeff<::Eigen::PropagateNaN>();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc = acc.binaryExpr(row, ::Eigen::internal::scalar_min_op<T, T, ::Eigen::PropagateNaN>());
  }
};

// Combines a group's runs (each a partial result of `width` elements) pairwise: run i joins
// like a binary counter's bit, so the result is a balanced tree over the runs, whose rounding
// error grows with the log of their number rather than with it. Summed in order, a float mean
// of 10^6 values near 10^4 came out 9990.87 (PyTorch's, pairwise too: 10000.0).
template <class Reducer, class T>
class Pairwise {
 public:
  // slots: room for levels(runs) partial results of width elements.
  Pairwise(T* slots, index_t width) : slots_(slots), width_(width) {}
  static index_t levels(index_t runs) { return std::bit_width(static_cast<std::uint64_t>(runs)) + 1; }

  // Where the next run's result is to be written, before push().
  T* next() const { return slot(top_); }
  void push() {
    ++top_;
    for (std::uint64_t c = count_++; (c & 1) != 0; c >>= 1) {
      combine(slot(top_ - 2), slot(top_ - 1));
      --top_;
    }
  }
  // The whole group's result, into out: the runs left on the stack, the newest first.
  void finish(T* out) {
    for (index_t i = top_ - 2; i >= 0; --i) combine(slot(i), slot(i + 1));
    std::copy_n(slot(0), width_, out);
  }

 private:
  T* slot(index_t level) const { return slots_ + level * width_; }
  void combine(T* earlier, const T* later) const {
    ArrayMap<T> acc(earlier, width_);
    Reducer::combine_rows(acc, ConstArrayMap<T>(later, width_));
  }

  T* slots_;
  index_t width_;
  index_t top_ = 0;
  std::uint64_t count_ = 0;
};

inline std::string reduce_name(std::string_view op, std::span<const int> values, bool keep) {
  std::string s(op);
  s += "(axis=";
  if (values.empty()) s += "all";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(values[i]);
  }
  return s + (keep ? ", keep_dims)" : ")");
}

}  // namespace detail

template <class Reducer, class AxesT, bool Keep>
struct ReduceGradOp;

// Reducer over the axes AxesT (every axis if empty), the reduced axes kept as 1 if Keep.
// AxesT is Axes<A...>, or AxesList for axes given at run time, whose shape graph mode checks
// when the network first runs.
template <class Reducer, class AxesT, bool Keep>
struct ReduceOp : Primitive<ReduceOp<Reducer, AxesT, Keep>> {
  static constexpr int arity = 1;
  static constexpr bool runtime_axes = std::is_same_v<AxesT, AxesList>;
  [[no_unique_address]] AxesT reduced{};

  bool keeps() const {
    if constexpr (runtime_axes) return reduced.keep;
    else return Keep;
  }

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if constexpr (runtime_axes) return {Shape::any()};
    else return detail::reduced_shape(in[0], AxesT::values, Keep, Reducer::non_empty);
  }
  ShapeResult infer(std::span<const Shape> in) const {
    return detail::reduced_shape(in[0], detail::axes_of(reduced), keeps(), Reducer::non_empty);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* out = a.out<T>();
    const Shape& in = a.in_shape();
    const detail::ReduceLayout l = detail::reduce_layout(in, detail::axis_mask(in.rank(), detail::axes_of(reduced)));
    if (l.outputs == 0) return;
    if (l.group == 0) {
      // Only sum, mean and prod get here (the rule refuses an empty max): 0, 0/0 for the mean, 1.
      if constexpr (!Reducer::non_empty) {
        std::fill_n(out, l.outputs,
                    Reducer::mean ? std::numeric_limits<T>::quiet_NaN() : static_cast<T>(Reducer::identity));
      }
      return;
    }
    // Each group in runs of at most Reducer::sequential elements, combined pairwise.
    constexpr index_t run = Reducer::sequential;
    std::array<T, 64> scalar_slots{};
    if (l.contiguous()) {
      for (index_t j = 0; j < l.outputs; ++j) {
        detail::Pairwise<Reducer, T> group(scalar_slots.data(), 1);
        for (index_t r0 = 0; r0 < l.group; r0 += run) {
          *group.next() = Reducer::redux(detail::ConstArrayMap<T>(x + j * l.group + r0, std::min(run, l.group - r0)));
          group.push();
        }
        group.finish(out + j);
      }
    } else if (l.strided()) {
      // Runs of rows: a sixteenth of the elements, so that a row is not reread from memory.
      const index_t inner = l.inner();
      const index_t outer = l.outputs / inner;
      const index_t rows = std::max<index_t>(1, run / 16);
      const index_t row_runs = (l.group + rows - 1) / rows;
      duet::detail::Storage slots_storage;
      T* slots = row_runs == 1 ? nullptr
                               : duet::detail::scratch<T>(slots_storage, static_cast<std::size_t>(
                                                                            detail::Pairwise<Reducer, T>::levels(row_runs) * inner));
      for (index_t o = 0; o < outer; ++o) {
        const T* block = x + o * l.group * inner;
        detail::Pairwise<Reducer, T> group(slots, inner);
        for (index_t r0 = 0; r0 < l.group; r0 += rows) {
          detail::ArrayMap<T> acc(row_runs == 1 ? out + o * inner : group.next(), inner);
          acc = detail::ConstArrayMap<T>(block + r0 * inner, inner);
          for (index_t r = r0 + 1; r < std::min(l.group, r0 + rows); ++r) {
            Reducer::combine_rows(acc, detail::ConstArrayMap<T>(block + r * inner, inner));
          }
          if (row_runs > 1) group.push();
        }
        if (row_runs > 1) group.finish(out + o * inner);
      }
    } else {
      l.for_each_group([&](index_t j, index_t base) {
        detail::Pairwise<Reducer, T> group(scalar_slots.data(), 1);
        index_t in_run = 0;
        T acc{};
        l.for_each_in_group([&](index_t off) {
          acc = in_run == 0 ? x[base + off] : Reducer::combine(acc, x[base + off]);
          if (++in_run == run) {
            *group.next() = acc;
            group.push();
            in_run = 0;
          }
        });
        if (in_run != 0) {
          *group.next() = acc;
          group.push();
        }
        group.finish(out + j);
      });
    }

    if constexpr (Reducer::mean) {
      const T count = static_cast<T>(l.group);
      for (index_t j = 0; j < l.outputs; ++j) out[j] /= count;
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    ReduceGradOp<Reducer, AxesT, Keep> g;
    g.reduced = reduced;
    return g;
  }

  static std::string op_name() {
    if constexpr (runtime_axes) return std::string(Reducer::name);
    else return detail::reduce_name(Reducer::name, AxesT::values, Keep);
  }
  std::string label() const { return detail::reduce_name(Reducer::name, detail::axes_of(reduced), keeps()); }

  // The reducers' names are ONNX's operators. At opset 17 ReduceSum reads its axes as an
  // input, the others as an attribute; no axes reduces them all, in both.
  Interchange interchange(std::span<const Shape>) const {
    InterchangeNode n{std::string(Reducer::name), {InterchangeInput::operand(0)}, {InterchangeAttribute::of("keepdims", keeps() ? 1 : 0)}};
    if (const std::span<const int> reduced_axes = detail::axes_of(reduced); !reduced_axes.empty()) {
      const std::vector<std::int64_t> axes(reduced_axes.begin(), reduced_axes.end());
      if (Reducer::name == "ReduceSum") n.inputs.push_back(InterchangeInput::constant(axes));
      else n.attributes.push_back(InterchangeAttribute::of("axes", axes));
    }
    return {std::move(n)};
  }
};

// d/dx of a reduction: sum and mean spread dy over each group (mean divided by its size);
// max and min send it to the elements equal to the extreme, split evenly among ties; prod
// gives each element dy times the product of the others in its group.
template <class Reducer, class AxesT, bool Keep>
struct ReduceGradOp : Primitive<ReduceGradOp<Reducer, AxesT, Keep>> {
  static constexpr bool extreme = Reducer::non_empty;
  static constexpr bool product = std::is_same_v<Reducer, detail::ProdReducer>;
  [[no_unique_address]] AxesT reduced{};
  static constexpr auto reads = [] {
    if constexpr (extreme) return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
    else return std::array{graph::Operand::grad, graph::Operand::input0};
  }();
  static constexpr int arity = static_cast<int>(reads.size());

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    T* d = a.out<T>();
    const Shape& in = a.in_shape(1);
    const detail::ReduceLayout l = detail::reduce_layout(in, detail::axis_mask(in.rank(), detail::axes_of(reduced)));
    if (l.outputs == 0 || l.group == 0) return;
    if constexpr (extreme) {
      const T* y = a.in<T>(2);
      l.for_each_group([&](index_t j, index_t base) {
        const T m = y[j];
        const bool nan = m != m;
        auto hit = [&](T v) { return v == m || (nan && v != v); };
        index_t ties = 0;
        l.for_each_in_group([&](index_t off) { ties += hit(x[base + off]) ? 1 : 0; });
        const T share = dy[j] / static_cast<T>(ties);
        l.for_each_in_group([&](index_t off) { d[base + off] = hit(x[base + off]) ? share : T(0); });
      });
    } else if constexpr (product) {
      // The product of the others as the product of those before times that of those after,
      // not y / x: exact where the group holds a zero (one zero's element gets the product of
      // the rest, every element of a group with two gets 0), as PyTorch's.
      duet::detail::Storage offsets_storage;
      index_t* offsets = duet::detail::scratch<index_t>(offsets_storage, static_cast<std::size_t>(l.group));
      index_t r = 0;
      l.for_each_in_group([&](index_t off) { offsets[r++] = off; });
      l.for_each_group([&](index_t j, index_t base) {
        T before(1);
        for (index_t i = 0; i < l.group; ++i) {
          d[base + offsets[i]] = before;
          before *= x[base + offsets[i]];
        }
        T after = dy[j];
        for (index_t i = l.group - 1; i >= 0; --i) {
          d[base + offsets[i]] *= after;
          after *= x[base + offsets[i]];
        }
      });
    } else {
      const T scale = Reducer::mean ? T(1) / static_cast<T>(l.group) : T(1);
      if (l.contiguous()) {
        for (index_t j = 0; j < l.outputs; ++j) std::fill_n(d + j * l.group, l.group, dy[j] * scale);
      } else if (l.strided()) {
        const index_t inner = l.inner();
        for (index_t o = 0; o < l.outputs / inner; ++o) {
          const detail::ConstArrayMap<T> g(dy + o * inner, inner);
          for (index_t r = 0; r < l.group; ++r) detail::ArrayMap<T>(d + (o * l.group + r) * inner, inner) = g * scale;
        }
      } else {
        l.for_each_group([&](index_t j, index_t base) {
          l.for_each_in_group([&](index_t off) { d[base + off] = dy[j] * scale; });
        });
      }
    }
  }

  static std::string op_name() { return ReduceOp<Reducer, AxesT, Keep>::op_name() + "Grad"; }
};

// The index of the first largest (smallest) element along one axis, as int32 (numpy's and
// MindSpore's choice on ties); a NaN counts as the largest and the smallest, as in numpy. In
// is the input's element type: the kernel is instantiated for the output's (int32). AxisT is
// Axes<A>, or AxesList of one axis given at run time (PyTorch's argmax(x, dim)), whose shape
// graph mode checks when the network first runs, as ReduceOp's.
template <bool Max, class AxisT, bool Keep, class In>
struct ArgExtremeOp : Primitive<ArgExtremeOp<Max, AxisT, Keep, In>> {
  using value_type = std::int32_t;
  static constexpr int arity = 1;
  static constexpr bool differentiable = false;
  static constexpr bool runtime_axis = std::is_same_v<AxisT, AxesList>;
  [[no_unique_address]] AxisT reduced{};

  bool keeps() const {
    if constexpr (runtime_axis)
      return reduced.keep;
    else
      return Keep;
  }

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if constexpr (runtime_axis)
      return {Shape::any()};
    else
      return detail::reduced_shape(in[0], AxisT::values, Keep, true);
  }
  ShapeResult infer(std::span<const Shape> in) const {
    return detail::reduced_shape(in[0], detail::axes_of(reduced), keeps(), true);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* x = a.in<In>();
    T* out = a.out<T>();
    const Shape& in = a.in_shape();
    const int given = detail::axes_of(reduced)[0];
    const int axis = given < 0 ? given + in.rank() : given;
    const index_t size = in[axis];
    const index_t inner = in.numel_from(axis + 1);
    const index_t outer = inner == 0 || size == 0 ? 0 : in.numel() / (size * inner);
    auto better = [](In v, In best) { return (v != v && best == best) || (Max ? v > best : v < best); };
    for (index_t o = 0; o < outer; ++o) {
      const In* block = x + o * size * inner;
      T* idx = out + o * inner;
      std::fill_n(idx, inner, T(0));
      // Along the axis outermost, so that each step reads a contiguous row of the input.
      for (index_t r = 1; r < size; ++r) {
        for (index_t i = 0; i < inner; ++i) {
          if (better(block[r * inner + i], block[idx[i] * inner + i])) idx[i] = static_cast<T>(r);
        }
      }
    }
  }

  static std::string name(int axis, bool keep) {
    return std::string(Max ? "Argmax" : "Argmin") + "(axis=" + std::to_string(axis) + (keep ? ", keep_dims)" : ")");
  }
  static std::string op_name() {
    if constexpr (runtime_axis)
      return Max ? "Argmax" : "Argmin";
    else
      return name(AxisT::values[0], Keep);
  }
  std::string label() const { return name(detail::axes_of(reduced)[0], keeps()); }
};

// cumsum<Axis>(x): the running sum along one axis, x's shape (PyTorch's torch.cumsum(x, dim),
// MindSpore's ops.cumsum; a negative axis counts from the end). Element i is element i - 1's
// sum plus x's element i, in order along the axis and in the element type, not pairwise: each
// output is a sum of its prefix, so the order is the definition's (PyTorch's CPU kernel carries
// a float's sums in double: a few ulps apart). The gradient is dy's running sum from the last
// element back.

namespace detail {
// Running sums along `axis` of x, seen as [outer, size, inner]: each row of `inner` sums is the
// row before it (after it, backward: cumsum's gradient) plus x's row.
template <class T>
void running_sum(const T* x, T* y, const Shape& shape, int axis, bool backward) {
  const int a = axis_index(axis, shape.rank());
  const index_t size = shape[a];
  const index_t inner = shape.numel_from(a + 1);
  const index_t block = size * inner;
  if (block == 0) return;
  for (index_t o = 0; o < shape.numel() / block; ++o) {
    for (index_t r = 0; r < size; ++r) {
      const index_t at = o * block + (backward ? size - 1 - r : r) * inner;
      if (r == 0) {
        std::copy_n(x + at, inner, y + at);
        continue;
      }
      const index_t before = backward ? at + inner : at - inner;
      for (index_t i = 0; i < inner; ++i) y[at + i] = y[before + i] + x[at + i];
    }
  }
}
}  // namespace detail

// d/dx of cumsum: x's element i reaches every sum from i on, so it gets dy summed from the last
// element back to i.
template <int Axis>
struct CumsumGradOp : Primitive<CumsumGradOp<Axis>> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::running_sum(a.in<T>(), a.out<T>(), a.in_shape(), Axis, true);
  }

  static std::string op_name() { return "CumsumGrad<" + std::to_string(Axis) + ">"; }
};

template <int Axis>
struct CumsumOp : Primitive<CumsumOp<Axis>> {
  static constexpr int arity = 1;
  static constexpr std::array<int, 1> axes{Axis};

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::along_axes_rule(in[0], axes); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::running_sum(a.in<T>(), a.out<T>(), a.in_shape(), Axis, false);
  }

  // Of input 0, the only one.
  template <std::size_t K>
  CumsumGradOp<Axis> grad_op() const {
    return {};
  }

  static std::string op_name() { return "Cumsum<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::cumsum<" + std::to_string(Axis) + ">"; }
};

template <int Axis, class X>
auto cumsum(X&& x) {
  return apply(CumsumOp<Axis>{}, std::forward<X>(x));
}

inline const bool reduction_listed =
    list_operations({"sum", "mean", "prod", "max", "min", "argmax", "argmin", "var", "std", "logsumexp", "cumsum"});

namespace detail {

template <class X>
using element_of = typename std::remove_cvref_t<X>::value_type;

// A mean of integers would truncate, where PyTorch refuses one.
template <class Reducer, class V>
inline constexpr bool refused_on = Reducer::mean && std::is_integral_v<V>;
#define DUET_DETAIL_INTEGER_MEAN_MESSAGE                                                                   \
  "duet::ops::mean (and var, std): the tensor has an integer element type, whose mean would be truncated " \
  "(mean([1, 2]) = 1); cast it first, ops::mean(ops::cast<float>(x)), as PyTorch asks for a floating type"

// The input a reduction reads: a sum of a comparison's UInt8 mask (sum(equal(pred, labels)),
// counting) in int32, where UInt8 would wrap at 256 (300 matches counted 44); other types as
// they are.
template <class Reducer, class X>
decltype(auto) reduced_input(const X& x) {
  if constexpr (std::is_same_v<Reducer, SumReducer> && std::is_same_v<element_of<X>, std::uint8_t>) {
    return cast<std::int32_t>(x);
  } else {
    return (x);
  }
}

template <class Reducer, class X, class AxesT, class... Keep>
auto reduce(const X& x, AxesT, Keep...) {
  static_assert(sizeof...(Keep) <= 1 && (std::is_same_v<Keep, KeepDims> && ...),
                "duet::ops: a reduction takes the tensor, then optionally ops::axes<...>, then optionally ops::keep_dims");
  static_assert(!refused_on<Reducer, element_of<X>>, DUET_DETAIL_INTEGER_MEAN_MESSAGE);
  return apply(ReduceOp<Reducer, AxesT, sizeof...(Keep) == 1>{}, reduced_input<Reducer>(x));
}

// The axes given at run time: each within [-max_rank, max_rank) and listed once; whether they
// fit the input's rank is a shape error when it runs.
template <class Reducer, class X, class... Keep>
auto reduce_listed(const X& x, std::span<const int> axes, const char* who, Keep...) {
  static_assert(sizeof...(Keep) <= 1 && (std::is_same_v<Keep, KeepDims> && ...),
                "duet::ops: a reduction takes the tensor, then optionally the axes, then optionally ops::keep_dims");
  static_assert(!refused_on<Reducer, element_of<X>>, DUET_DETAIL_INTEGER_MEAN_MESSAGE);
  ReduceOp<Reducer, AxesList, false> op;
  op.reduced.keep = sizeof...(Keep) == 1;
  bool valid = axes.size() <= static_cast<std::size_t>(max_rank);
  for (std::size_t i = 0; valid && i < axes.size(); ++i) {
    valid = axes[i] >= -max_rank && axes[i] < max_rank && std::ranges::count(axes.first(i), axes[i]) == 0;
    op.reduced.list[i] = axes[i];
  }
  if (!valid) {
    throw ValueError(std::string("duet::ops::") + who + ": the axes {" + list_text<int>(axes) +
                     "} must be distinct, at most " + std::to_string(max_rank) + " of them");
  }
  op.reduced.count = axes.size();
  return apply(op, reduced_input<Reducer>(x));
}

template <bool Max, class X, int A, class... Keep>
auto arg_extreme(const X& x, Axes<A>, Keep...) {
  static_assert(sizeof...(Keep) <= 1 && (std::is_same_v<Keep, KeepDims> && ...),
                "duet::ops: argmax and argmin take the tensor, then optionally the axis (ops::axis<A> or an int), then "
                "optionally ops::keep_dims");
  return apply(ArgExtremeOp<Max, Axes<A>, sizeof...(Keep) == 1, element_of<X>>{}, x);
}

// The axis given at run time, within [-max_rank, max_rank); whether it fits the input's rank is
// a shape error when it runs.
template <bool Max, class X, class... Keep>
auto arg_extreme(const X& x, int axis, const char* who, Keep...) {
  static_assert(sizeof...(Keep) <= 1 && (std::is_same_v<Keep, KeepDims> && ...),
                "duet::ops: argmax and argmin take the tensor, then optionally the axis (ops::axis<A> or an int), then "
                "optionally ops::keep_dims");
  if (axis < -max_rank || axis >= max_rank) {
    throw ValueError(std::string("duet::ops::") + who + ": the axis must be in [" + std::to_string(-max_rank) + ", " +
                     std::to_string(max_rank) + "), got " + std::to_string(axis));
  }
  ArgExtremeOp<Max, AxesList, false, element_of<X>> op;
  op.reduced.list[0] = axis;
  op.reduced.count = 1;
  op.reduced.keep = sizeof...(Keep) == 1;
  return apply(op, x);
}

}  // namespace detail

namespace detail {
// A reduction over axes given either way: ops::axes<...> while the program compiles, a list at
// run time.
template <class Reducer, class X, class AxesT, class... Keep>
auto reduce_over(const X& x, const AxesT& axes, const char* who, Keep... keep) {
  if constexpr (std::is_same_v<AxesT, std::span<const int>>)
    return reduce_listed<Reducer>(x, axes, who, keep...);
  else
    return reduce<Reducer>(x, axes, keep...);
}
}  // namespace detail

// The ways an operation over axes is called, as sum is: sum(x) and sum(x, keep_dims) over every
// axis; sum(x, axes<...>), the axes known while the program compiles; sum(x, {0, 1}) or a
// std::span<const int>, known at run time, and sum(x, 1), one axis so (PyTorch's torch.sum(x,
// 1), x.sum(1)); keep_dims last. Each overload returns the expression given, written on x, axes
// (an Axes<A...> or a std::span<const int>) and keep.
#define DUET_DETAIL_OVER_AXES(name, ...)                                                  \
  template <TensorLike X, int... A, class... Keep>                                        \
  auto name(const X& x, Axes<A...> axes, Keep... keep) {                                  \
    return __VA_ARGS__;                                                                   \
  }                                                                                       \
  template <TensorLike X, class... Keep>                                                  \
  requires((std::is_same_v<Keep, KeepDims> && ...)) auto name(const X& x, Keep... keep) { \
    const Axes<> axes{};                                                                  \
    return __VA_ARGS__;                                                                   \
  }                                                                                       \
  template <TensorLike X, class... Keep>                                                  \
  auto name(const X& x, std::span<const int> axes, Keep... keep) {                        \
    return __VA_ARGS__;                                                                   \
  }                                                                                       \
  template <TensorLike X, class... Keep>                                                  \
  auto name(const X& x, std::initializer_list<int> list, Keep... keep) {                  \
    const std::span<const int> axes(list.begin(), list.size());                           \
    return __VA_ARGS__;                                                                   \
  }                                                                                       \
  template <TensorLike X, std::integral I, class... Keep>                                 \
  auto name(const X& x, I axis, Keep... keep) {                                           \
    const int one[] = {static_cast<int>(axis)};                                           \
    const std::span<const int> axes(one);                                                 \
    return __VA_ARGS__;                                                                   \
  }
DUET_DETAIL_OVER_AXES(sum, detail::reduce_over<detail::SumReducer>(x, axes, "sum", keep...))
DUET_DETAIL_OVER_AXES(mean, detail::reduce_over<detail::MeanReducer>(x, axes, "mean", keep...))
DUET_DETAIL_OVER_AXES(prod, detail::reduce_over<detail::ProdReducer>(x, axes, "prod", keep...))
DUET_DETAIL_OVER_AXES(max, detail::reduce_over<detail::MaxReducer>(x, axes, "max", keep...))
DUET_DETAIL_OVER_AXES(min, detail::reduce_over<detail::MinReducer>(x, axes, "min", keep...))

namespace detail {
template <class X, class AxesT, class... Keep>
auto variance(const X& x, const AxesT& axes, Keep... keep) {
  return mean(square(x - mean(x, axes, keep_dims)), axes, keep...);
}
}  // namespace detail

// var(x), var(x, axes<...>), with keep_dims, or the axes at run time, as sum takes them: the
// variance over the axes (every axis if none),
// mean((x - mean(x))^2), dividing by the n elements reduced, as numpy's and MindSpore's
// ops.var do by default (ddof = 0); torch.var divides by n - 1 by default (a sample's
// unbiased estimate: multiply by n / (n - 1)). std is its square root. Made of mean,
// subtraction and square, which give their gradients; std's is 0 where the variance is 0, as
// PyTorch's (fn::StdRoot).
DUET_DETAIL_OVER_AXES(var, detail::variance(x, axes, keep...))
DUET_DETAIL_OVER_AXES(std, apply(MapOp<fn::StdRoot>{}, detail::variance(x, axes, keep...)))

// argmax(x) (axis -1, MindSpore's ops.Argmax default), argmax(x, axis<A>), or the axis at run
// time, argmax(x, 1) (PyTorch's argmax(x, dim)); with keep_dims.
template <TensorLike X, int A = -1, class... Keep>
auto argmax(const X& x, Axes<A> a = {}, Keep... keep) {
  return detail::arg_extreme<true>(x, a, keep...);
}
template <TensorLike X, class... Keep>
auto argmax(const X& x, int axis, Keep... keep) {
  return detail::arg_extreme<true>(x, axis, "argmax", keep...);
}
template <TensorLike X, int A = -1, class... Keep>
auto argmin(const X& x, Axes<A> a = {}, Keep... keep) {
  return detail::arg_extreme<false>(x, a, keep...);
}
template <TensorLike X, class... Keep>
auto argmin(const X& x, int axis, Keep... keep) {
  return detail::arg_extreme<false>(x, axis, "argmin", keep...);
}

namespace detail {
// m + log Σ exp(x - m), m the maximum over the axes (kept as 1 while it is subtracted). An
// infinite m is taken out as 0: every element -inf gives -inf (m = -inf would make -inf - -inf
// = NaN), and a +inf gives +inf, as PyTorch's. m is a constant of the gradient
// (ops::stop_gradient), which is then exp(x - m) / Σ exp(x - m): softmax over the axes.
template <class X, class AxesT, class... Keep>
auto log_sum_exp(const X& x, const AxesT& axes, Keep...) {
  using V = element_of<X>;
  static_assert(std::is_floating_point_v<V>, "duet::ops::logsumexp: the tensor must have a floating-point element type");
  const auto shift = [&](auto... kept) {
    const auto m = stop_gradient(max(x, axes, kept...));
    return where(equal(abs(m), std::numeric_limits<V>::infinity()), V(0), m);
  };
  const auto m = shift(keep_dims);
  // With keep_dims the maximum is m itself; without, it is taken again in the output's shape
  // (the same operation twice on one input would be one value captured twice).
  if constexpr (sizeof...(Keep) == 1) return log(sum(exp(x - m), axes, keep_dims)) + m;
  else return log(sum(exp(x - m), axes)) + shift();
}
}  // namespace detail

// logsumexp(x), logsumexp(x, axes<...>), with keep_dims, or the axes at run time, as sum takes
// them: log Σ exp(x) over the axes (every axis if none), PyTorch's torch.logsumexp and
// MindSpore's ops.logsumexp, without overflow (the maximum is taken out first) and -inf for a
// group of -inf (a fully masked row).
DUET_DETAIL_OVER_AXES(logsumexp, detail::log_sum_exp(x, axes, keep...))
#undef DUET_DETAIL_OVER_AXES

}  // namespace ops

// What the tensor types' methods call (detail/tensor_methods.hpp): x.sum(...) is ops::sum(x, ...).
template <class X>
struct detail::TensorMethods {
  static auto sum(const X& x, auto... args) { return ops::sum(x, args...); }
  static auto mean(const X& x, auto... args) { return ops::mean(x, args...); }
  static auto prod(const X& x, auto... args) { return ops::prod(x, args...); }
  static auto max(const X& x, auto... args) { return ops::max(x, args...); }
  static auto min(const X& x, auto... args) { return ops::min(x, args...); }
};

}  // namespace duet
