// Graph capture: the compile-time IR of graph mode.
//
// A graph is a flat list of nodes (a hana::tuple), each an operation applied to the outputs of
// earlier nodes named by index, like SSA. Calling a cell's construct on a Sym (a symbolic
// tensor: a graph plus the index of the node it stands for) appends nodes instead of
// computing, so construct(Sym) returns the whole network as a type. The list stays flat, not
// nested like relu<dense<relu<...>>>, which keeps type names short and compiles faster.
//
// An operation type Op provides:
//   using layer_type                  the user-facing name compile-time errors show
//   static constexpr int arity        number of inputs
//   static constexpr bool is_view     output is input 0 with another shape (no kernel, no copy)
//   static constexpr bool is_elementwise   unary, same shape, may run in place or fuse as epilogue
//   static constexpr ShapeResult infer_static(std::span<const Shape>)   rule on compile-time patterns
//   ShapeResult infer(std::span<const Shape>) const                     the same rule at run time
//   template <class Backend, class T> void run(const T* const* in, const Shape* in_shapes,
//                                              T* out, const Shape& out_shape) const
//   std::string label() const          for graph_ir and run-time errors
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <boost/hana/append.hpp>
#include <boost/hana/at.hpp>
#include <boost/hana/tuple.hpp>

#include "diagnostics.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace duet::graph {

namespace hana = boost::hana;

template <class Op, std::size_t... Args>
struct Node {
  using op_type = Op;
  static constexpr std::size_t arity = sizeof...(Args);
  static constexpr std::array<std::size_t, sizeof...(Args)> args{Args...};
  Op op;
};

template <class N, std::size_t Count>
constexpr Shape static_output_shape(const std::array<Shape, Count>& shapes) {
  std::array<Shape, N::arity> in{};
  for (std::size_t k = 0; k < N::arity; ++k) in[k] = shapes[N::args[k]];
  return N::op_type::infer_static(in).shape;
}

template <class... Nodes>
constexpr std::array<Shape, sizeof...(Nodes)> infer_static_shapes() {
  std::array<Shape, sizeof...(Nodes)> shapes{};
  std::size_t i = 0;
  ((shapes[i] = static_output_shape<Nodes>(shapes), ++i), ...);
  return shapes;
}

template <class T, class... Nodes>
struct Graph {
  using value_type = T;
  static constexpr std::size_t size = sizeof...(Nodes);
  // Shape inference: every node's output shape as far as compile time knows it.
  static constexpr std::array<Shape, size> shapes = infer_static_shapes<Nodes...>();
  using nodes_type = hana::tuple<Nodes...>;
  nodes_type nodes;
};

template <class G, std::size_t I>
using node_at = std::remove_cvref_t<decltype(hana::at_c<I>(std::declval<typename G::nodes_type&>()))>;

template <class G, class N>
struct appended;
template <class T, class... Nodes, class N>
struct appended<Graph<T, Nodes...>, N> {
  using type = Graph<T, Nodes..., N>;
};

// A symbolic tensor: the value of node Out of graph G.
template <class G, std::size_t Out>
struct Sym {
  using graph_type = G;
  using value_type = typename G::value_type;
  static constexpr std::size_t output = Out;
  static constexpr Shape shape = G::shapes[Out];
  G graph;
};

template <class X>
inline constexpr bool is_sym_v = false;
template <class G, std::size_t Out>
inline constexpr bool is_sym_v<Sym<G, Out>> = true;

template <class X>
concept Symbolic = is_sym_v<std::remove_cvref_t<X>>;

template <class X>
inline constexpr bool is_input_op_v = false;

// Graph input K, whose shape is known as far as Pattern says (a StaticShape, or AnyShape).
template <std::size_t K, class Pattern>
struct InputOp {
  using layer_type = InputOp;
  static constexpr int arity = 0;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr std::size_t index = K;
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Pattern::value}; }
  static std::string op_name() { return "Input " + std::to_string(K); }
  std::string label() const { return op_name(); }
};

template <std::size_t K, class Pattern>
inline constexpr bool is_input_op_v<InputOp<K, Pattern>> = true;

// Whether a concrete shape fits a pattern: same rank, same size wherever the pattern is fixed.
constexpr bool fits(const Shape& pattern, const Shape& s) {
  if (pattern.leading_unknown()) {
    if (s.rank() < pattern.rank()) return false;
  } else if (s.rank() != pattern.rank()) {
    return false;
  }
  for (int i = 1; i <= pattern.rank(); ++i) {
    if (pattern[-i] != dyn && pattern[-i] != s[-i]) return false;
  }
  return true;
}

// The pattern of a runtime tensor: rank and sizes unknown until it arrives.
struct AnyShape {
  static constexpr Shape value = Shape::any();
};

template <class T, class Pattern, std::size_t K = 0>
auto input() {
  using G = Graph<T, Node<InputOp<K, Pattern>>>;
  return Sym<G, 0>{G{}};
}

// Appends `op` applied to x. The rule runs here, at capture, so a compile-time mismatch is
// reported where the user's construct calls the layer.
template <class Op, class G, std::size_t Out>
auto append(const Op& op, const Sym<G, Out>& x) {
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, 1>{G::shapes[Out]});
  if constexpr (!r.ok()) {
    diagnostic::reject<typename Op::layer_type, r.fault, r.expected, Sym<G, Out>>();
  }
  using N = Node<Op, Out>;
  using Appended = typename appended<G, N>::type;
  return Sym<Appended, G::size>{Appended{hana::append(x.graph.nodes, N{op})}};
}

}  // namespace duet::graph
