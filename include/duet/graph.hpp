// Graph capture: the compile-time IR of graph mode.
//
// A graph is a flat list of nodes (a NodeList), each an operation applied to the outputs of
// earlier nodes named by index, like SSA. Calling a cell's construct on a Sym (a symbolic
// tensor: a graph plus the index of the node it stands for) appends nodes instead of
// computing, so construct(Sym) returns the whole network as a type. The list stays flat, not
// nested like relu<dense<relu<...>>>, which keeps type names short and compiles faster.
//
// Every node holds an operation: the contract it meets is in operation.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "detail/node_id.hpp"
#include "diagnostics.hpp"
#include "operation.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace duet::graph {

// Calls f(std::integral_constant<std::size_t, I>{}) for I = 0, 1, ..., N-1 in order: the one
// loop over a graph's nodes at compile time. The calls are a braced list's elements, which run
// in order, not a comma fold: clang nests a fold's operands and refuses more than 256 (a
// network of 128 Dense + ReLU pairs has 385 nodes). (A fold over lambdas nested in a lambda
// with a template parameter pack also crashes clang 14; this shape does not.)
template <std::size_t N, class F>
constexpr void for_each_index(F&& f) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    [[maybe_unused]] const int in_order[] = {0, (f(std::integral_constant<std::size_t, I>{}), 0)...};
  }
  (std::make_index_sequence<N>{});
}

// Whether every one of a pack's conditions holds: all_of({C...}), where a fold (C && ...)
// would nest as deep as the pack is long (for_each_index says why that matters).
constexpr bool all_of(std::initializer_list<bool> conditions) {
  for (const bool c : conditions) {
    if (!c) return false;
  }
  return true;
}

template <class Op, std::size_t... Args>
struct Node {
  using op_type = Op;
  static constexpr std::size_t arity = sizeof...(Args);
  static constexpr std::array<std::size_t, sizeof...(Args)> args{Args...};
  Op op;
};

// Node N's shape rule applied to its inputs' shapes, taken from the shapes of the nodes before it.
// A span, not the graph's array: every graph captured on the way to a network has its own
// size, and the rule of each node is instantiated once, not once per graph it is in.
template <class N>
constexpr ShapeResult static_rule(std::span<const Shape> shapes) {
  std::array<Shape, N::arity> in{};
  for (std::size_t k = 0; k < N::arity; ++k) in[k] = shapes[N::args[k]];
  return N::op_type::infer_static(in);
}

// The nodes' shape rules, in order: a table, so that a loop over a graph's nodes is one
// function of the graph, not one per node.
template <class... Nodes>
inline constexpr std::array<ShapeResult (*)(std::span<const Shape>), sizeof...(Nodes)> static_rules{
    &static_rule<Nodes>...};

// A node whose rule its inputs break (reported where it was appended) has a shape nothing is
// known of, "[...]", so that no rule after it breaks on the same mistake: its best guess would
// carry the wrong size on (a residual add of the wrong input, then a LayerNorm of that sum, ...:
// six errors for one input of the wrong width).
template <class... Nodes>
constexpr std::array<Shape, sizeof...(Nodes)> infer_static_shapes() {
  std::array<Shape, sizeof...(Nodes)> shapes{};
  for (std::size_t i = 0; i < sizeof...(Nodes); ++i) {
    const ShapeResult r = static_rules<Nodes...>[i](shapes);
    shapes[i] = r.ok() ? r.shape : Shape::any();
  }
  return shapes;
}

template <class Op>
inline constexpr bool declares_value_type = requires { typename Op::value_type; };

template <class N>
constexpr std::size_t first_argument() {
  if constexpr (N::arity == 0)
    return 0;
  else
    return N::args[0];
}

// For each node, the node whose operation declares its element type: itself, or (an operation
// that keeps its input's type) its first input's source. An array computed once per graph: the
// type recursion it replaces ran back through the graph for every captured value, and a network
// of n nodes is captured through n graphs.
template <class... Nodes>
constexpr std::array<std::size_t, sizeof...(Nodes)> value_type_sources() {
  constexpr std::array<bool, sizeof...(Nodes)> declares{declares_value_type<typename Nodes::op_type>...};
  constexpr std::array<std::size_t, sizeof...(Nodes)> first{first_argument<Nodes>()...};
  std::array<std::size_t, sizeof...(Nodes)> source{};
  for (std::size_t i = 0; i < sizeof...(Nodes); ++i) source[i] = declares[i] ? i : source[first[i]];
  return source;
}

namespace detail {
// Node I of a list, held in a base of its own. A lookup by index is overload resolution
// against these bases (select, get): what it instantiates depends on I and the node's type
// only, so it is shared by every graph that has that node there, where a tuple's accessor is
// instantiated per tuple type and index, and capture makes a new tuple type per operation.
template <std::size_t I, class N>
struct slot {
  N node;
};
template <class Indices, class... Nodes>
struct slots;
template <std::size_t... I, class... Nodes>
struct slots<std::index_sequence<I...>, Nodes...> : slot<I, Nodes>... {
  slots() = default;
  explicit slots(std::in_place_t, const Nodes&... n) : slot<I, Nodes>{n}... {}
};
template <std::size_t I, class N>
std::type_identity<N> select(const slot<I, N>&);
}  // namespace detail

// A list of nodes: what the passes and the backward builder grow a graph in, node by node.
// It is not a Graph, whose shape inference would run on every list on the way.
template <class... Nodes>
struct NodeList : detail::slots<std::index_sequence_for<Nodes...>, Nodes...> {
  static constexpr std::size_t size = sizeof...(Nodes);
  using list_type = NodeList;
  using detail::slots<std::index_sequence_for<Nodes...>, Nodes...>::slots;
};

template <class... Nodes>
struct Graph : NodeList<Nodes...> {
  // Shape inference: every node's output shape as far as compile time knows it.
  static constexpr std::array<Shape, sizeof...(Nodes)> shapes = infer_static_shapes<Nodes...>();
  static constexpr std::array<std::size_t, sizeof...(Nodes)> value_type_source = value_type_sources<Nodes...>();
  using NodeList<Nodes...>::NodeList;
  Graph() = default;
  explicit Graph(const NodeList<Nodes...>& nodes) : NodeList<Nodes...>(nodes) {}
};

namespace detail {
// Deduction finds the base slot<I, N> by searching every base of the list, so a lookup costs the
// list's size; a class remembers what it found, where an alias would search again at each use.
template <class G, std::size_t I>
struct node_type {
  using type = typename decltype(select<I>(std::declval<const G&>()))::type;
};
}  // namespace detail

// The type of node I of a graph or list.
template <class G, std::size_t I>
using node_at = typename detail::node_type<G, I>::type;

// Node I of a graph or list.
template <std::size_t I, class N>
constexpr const N& get(const detail::slot<I, N>& s) {
  return s.node;
}

namespace detail {
template <class To, class L, std::size_t... I, class... Tail>
To rebuilt(const L& from, std::index_sequence<I...>, const Tail&... tail) {
  return To(std::in_place, get<I>(from)..., tail...);
}
}  // namespace detail

// The graph of a list's nodes.
template <class... Nodes>
Graph<Nodes...> make_graph(const NodeList<Nodes...>& nodes) {
  return Graph<Nodes...>(nodes);
}

// A list or graph with nodes appended, made in one function (of as many copies as nodes) per
// list: capture appends once per operation.
template <class... Nodes, class... New>
NodeList<Nodes..., New...> with_nodes(const NodeList<Nodes...>& list, const New&... nodes) {
  return detail::rebuilt<NodeList<Nodes..., New...>>(list, std::index_sequence_for<Nodes...>{}, nodes...);
}
template <class... Nodes, class New>
Graph<Nodes..., New> with_node(const Graph<Nodes...>& g, const New& node) {
  return detail::rebuilt<Graph<Nodes..., New>>(g, std::index_sequence_for<Nodes...>{}, node);
}

// A list built from a plan in types. Each Step names a node type and its recipe, a type whose
// make(g) makes the node's operation from the graph g the plan was made from. The passes and
// the backward builder plan in types and build the list once: growing it node by node would
// instantiate a function copying the list so far per node, quadratic in the graph's size.
template <class Node, class Recipe>
struct Step {
  using node = Node;
  using recipe = Recipe;
};

// Recipes: node J's operation as it is; an operation of type Op made afresh.
template <std::size_t J>
struct Take {
  template <class G>
  static auto make(const G& g) {
    return get<J>(g).op;
  }
};
template <class Op>
struct Made {
  template <class G>
  static Op make(const G&) {
    return Op{};
  }
};

template <class L, class X>
struct appended;
template <class... S, class X>
struct appended<NodeList<S...>, X> {
  using type = NodeList<S..., X>;
};

// How many steps a plan holds, without completing its NodeList: a complete list has a base per
// element, and a walk that asked each plan on the way its size made bases quadratic in number.
template <class L>
inline constexpr std::size_t plan_size = L::size;
template <class... S>
inline constexpr std::size_t plan_size<NodeList<S...>> = sizeof...(S);

// The list (or graph: L = Graph) a plan of steps S makes from g, then the nodes tail.
template <template <class...> class L = NodeList, class G, class... S, class... Tail>
L<typename S::node..., Tail...> from_plan(const G& g, NodeList<S...>*, const Tail&... tail) {
  return L<typename S::node..., Tail...>(std::in_place, typename S::node{S::recipe::make(g)}..., tail...);
}

// A list of f(node) for each node of g.
template <class L, class F>
auto transformed(const L& list, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return NodeList<decltype(f(get<I>(list)))...>(std::in_place, f(get<I>(list))...);
  }(std::make_index_sequence<L::size>{});
}

// The element type of the value an op makes from inputs whose first has type First.
template <class Op, class First>
constexpr auto op_value_type() {
  if constexpr (declares_value_type<Op>)
    return std::type_identity<typename Op::value_type>{};
  else
    return std::type_identity<First>{};
}
template <class Op, class First>
using op_value_t = typename decltype(op_value_type<Op, First>())::type;

// The element type of node I's value.
template <class G, std::size_t I>
using node_value_t = typename node_at<G, G::value_type_source[I]>::op_type::value_type;

// A symbolic tensor: the value of node Out of graph G.
template <class>
inline constexpr bool no_value_during_capture = false;
template <class>
inline constexpr bool reassigned_during_capture = false;

// A class keyed on the variable's element type, not its graph, so that `x = fc1(x); x =
// relu(x);` is reported once, not again for each capture of construct (each phase's input is
// another type).
template <class Variable>
struct reassignment_during_capture {
  static_assert(reassigned_during_capture<Variable>,
                "duet: inside construct, each operation returns a new symbolic type while a graph is captured; "
                "write `auto y = layer(x);` (a new name per step) instead of reassigning `x = layer(x);`");
};

// static_assert takes a literal only; the uses below share it through this macro.
#define DUET_DETAIL_NO_VALUE_MESSAGE                                                                        \
  "duet: a tensor's value does not exist while a graph is captured (item(), data(), a branch on a value); " \
  "compute with graph operations, or run C++ on the value with duet::host(...) (a host node, "               \
  "JitSyntaxLevel::lax)"

// R, after saying that no value exists at capture. As a return type it is formed where the call
// is, so the message comes first, before what the call's use breaks next (`if (h.item() > 0)
// return a; return b;` gives two returns of different symbolic types).
template <class Dependent, class R>
struct value_during_capture {
  static_assert(no_value_during_capture<Dependent>, DUET_DETAIL_NO_VALUE_MESSAGE);
  using type = R;
};

namespace detail {
// Why a capture is ambiguous (Sym::ambiguity), or nothing. Each text is kept once, for the
// program's life (a program has as many as it has ambiguous captures), so that a Sym is
// trivially copyable and destructible: a chain's capture makes a Sym per part, and a
// std::string in each gave every capture function a copy, a destructor and an unwinding path
// per part, most of what g++ optimises in a deep network's capture.
class Note {
 public:
  Note() = default;
  explicit Note(const std::string& text) : text_(text.empty() ? nullptr : interned(text)) {}
  bool empty() const { return text_ == nullptr; }
  const std::string& str() const { return text_ != nullptr ? *text_ : none(); }

 private:
  static const std::string& none() {
    static const std::string empty;
    return empty;
  }
  static const std::string* interned(const std::string& text) {
    static std::mutex mutex;
    static std::set<std::string> texts;
    std::lock_guard lock(mutex);
    return &*texts.insert(text).first;
  }
  const std::string* text_ = nullptr;
};
}  // namespace detail

template <class G, std::size_t Out>
struct Sym {
  using graph_type = G;
  using value_type = node_value_t<G, Out>;
  static constexpr std::size_t output = Out;
  static constexpr Shape shape = G::shapes[Out];
  G graph;
  // Capture's run-time knowledge (passes and build_backward leave it behind): each node's id,
  // and, when a merge met two nodes of one type, inputs and place whose ids differ, what they
  // are. Such a graph computes one value where the function computes two: it must not run.
  std::array<std::uint64_t, G::size> ids{};
  detail::Note ambiguity{};

  // A graph is captured before it runs: reading a value then, or branching on one, cannot be
  // a graph operation. These say so, instead of "no member named item".
  template <class Dependent = void>
  typename value_during_capture<Dependent, value_type>::type item() const {
    return {};
  }
  template <class Dependent = void>
  typename value_during_capture<Dependent, const value_type*>::type data() const {
    return nullptr;
  }
  template <class Dependent = void>
  explicit operator bool() const {
    static_assert(no_value_during_capture<Dependent>, DUET_DETAIL_NO_VALUE_MESSAGE);
    return false;
  }

  // `x = layer(x);` in construct: a PyTorch habit that PyNative accepts (a Tensor stays a
  // Tensor) but capture cannot, every step being a Sym of its own type. Said here, instead of
  // "no match for operator=" with both graphs spelled out.
  template <class G2, std::size_t Out2>
  Sym& operator=(const Sym<G2, Out2>&) {
    static_cast<void>(sizeof(reassignment_during_capture<value_type>));
    return *this;
  }

  // x.sum(), x.mean(ops::axes<1>): graph nodes, as ops::sum(x) and ops::mean(x, ops::axes<1>) are.
  DUET_DETAIL_TENSOR_METHODS
};
#undef DUET_DETAIL_NO_VALUE_MESSAGE

template <class X>
inline constexpr bool is_sym_v = false;
template <class G, std::size_t Out>
inline constexpr bool is_sym_v<Sym<G, Out>> = true;

template <class X>
concept Symbolic = is_sym_v<std::remove_cvref_t<X>>;

template <class X>
inline constexpr bool is_input_op_v = false;

template <class Op>
constexpr bool is_sink() {
  if constexpr (requires { Op::is_sink; })
    return Op::is_sink;
  else
    return false;
}

// A host callback (duet::host): C++ on a live value, a graph break.
template <class Op>
constexpr bool is_host_op() {
  if constexpr (requires { Op::is_host; }) return Op::is_host;
  else return false;
}

// Whether a node's kernel runs: every op but a view without side effects.
template <class Op>
constexpr bool runs_kernel() {
  if constexpr (requires { Op::has_side_effects; })
    return !Op::is_view || Op::has_side_effects;
  else
    return !Op::is_view;
}

// Graph input K, of element type T, whose shape is known as far as Pattern says (a
// StaticShape, or AnyShape).
template <std::size_t K, class Pattern, class T>
struct InputOp : ops::Primitive<InputOp<K, Pattern, T>> {
  using value_type = T;
  using pattern = Pattern;
  static constexpr int arity = 0;
  static constexpr std::size_t index = K;
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Pattern::value}; }
  static std::string op_name() { return "Input " + std::to_string(K); }
};

template <std::size_t K, class Pattern, class T>
inline constexpr bool is_input_op_v<InputOp<K, Pattern, T>> = true;

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

// A capture on Pattern that reports no broken shape rule: a probe that asks whether the rules
// hold (first_rejection), or the stand-in for a part whose fault is reported elsewhere (quietly).
template <class Pattern>
struct Quiet {
  static constexpr Shape value = Pattern::value;
};
template <class Pattern>
inline constexpr bool is_quiet_v = false;
template <class Pattern>
inline constexpr bool is_quiet_v<Quiet<Pattern>> = true;

// The pattern of a symbolic tensor's shape.
template <class S>
struct SameShapeAs {
  static constexpr Shape value = S::shape;
};

// What a graph is captured for: training or evaluation (MindSpore's set_train). A layer that
// behaves differently in the two (nn::BatchNorm2d, nn::Dropout) reads the phase from its
// input's type and appends that phase's operation, so the two forms of a network are two
// types, compiled and cached apart, and an evaluation form can be rewritten by passes (a
// BatchNorm folded into the convolution before it) without touching the training form. A
// capture is for training unless its inputs' pattern is an Evaluation.
enum class Phase : unsigned char { train, eval };

template <class Pattern>
struct Evaluation {
  static constexpr Shape value = Pattern::value;
};

template <Phase P, class Pattern>
using pattern_in_phase = std::conditional_t<P == Phase::eval, Evaluation<Pattern>, Pattern>;

template <class G>
constexpr Phase phase_of_graph();

namespace detail {
template <class Pattern>
struct pattern_phase {
  static constexpr Phase value = Phase::train;
};
template <class P>
struct pattern_phase<Evaluation<P>> {
  static constexpr Phase value = Phase::eval;
};
// A quiet capture (graph::quietly, a SequentialCell's chain) is in the phase of the value it
// continues.
template <class P>
struct pattern_phase<Quiet<P>> : pattern_phase<P> {};
template <class S>
struct pattern_phase<SameShapeAs<S>> {
  static constexpr Phase value = phase_of_graph<typename S::graph_type>();
};
}  // namespace detail

// The input of a part captured apart from the graph it continues (spliced): the shape and the
// phase of the value it continues, spelled out, so that a chain of parts does not nest their
// types in one another.
template <Phase P, bool LeadingUnknown, index_t... Dims>
struct Continuing {
  static constexpr Shape value = [] {
    Shape s = LeadingUnknown ? Shape::any() : Shape{};
    (s.push_back(Dims), ...);
    return s;
  }();
};
namespace detail {
template <Phase P, bool L, index_t... D>
struct pattern_phase<Continuing<P, L, D...>> {
  static constexpr Phase value = P;
};
}  // namespace detail

// The phase G is captured for: its inputs'. (A graph of parameters alone is a training one.)
template <class G>
constexpr Phase phase_of_graph() {
  Phase phase = Phase::train;
  bool found = false;
  for_each_index<G::size>([&](auto i) {
    using Op = typename node_at<G, decltype(i)::value>::op_type;
    if constexpr (is_input_op_v<Op>) {
      if (!found) phase = detail::pattern_phase<typename Op::pattern>::value;
      found = true;
    }
  });
  return phase;
}

// The phase a symbolic tensor is captured in, for a layer's construct.
template <class X>
constexpr Phase phase_of() {
  return phase_of_graph<typename std::remove_cvref_t<X>::graph_type>();
}

// An operation whose behaviour depends on the phase declares it, `static constexpr Phase
// phase`, and says which phase its layer is set to now, `Phase requested_phase() const`.
template <class Op>
concept PhaseDependent = requires(const Op& op) {
  { Op::phase } -> std::convertible_to<Phase>;
  { op.requested_phase() } -> std::same_as<Phase>;
  { op.layer_label() } -> std::convertible_to<std::string>;
};

// The nodes of G whose operations depend on the phase, in order.
template <class G>
constexpr auto phase_dependent_nodes() {
  constexpr std::size_t count = [] {
    std::size_t n = 0;
    for_each_index<G::size>([&](auto i) {
      if constexpr (PhaseDependent<typename node_at<G, decltype(i)::value>::op_type>) ++n;
    });
    return n;
  }();
  std::array<std::size_t, count> nodes{};
  std::size_t n = 0;
  for_each_index<G::size>([&](auto i) {
    if constexpr (PhaseDependent<typename node_at<G, decltype(i)::value>::op_type>) nodes[n++] = decltype(i)::value;
  });
  return nodes;
}

// Whether appending to G reports a broken shape rule: unless G was captured on a Quiet
// input. (Node 0 is an input: each graph starts as one, and merging keeps the first graph's
// nodes in front.)
template <class G>
constexpr bool reports_faults() {
  using Op = typename node_at<G, 0>::op_type;
  if constexpr (is_input_op_v<Op>)
    return !is_quiet_v<typename Op::pattern>;
  else
    return true;
}

// The pattern graph mode captures a tensor of type X with.
template <class X>
struct pattern_of {
  using type = AnyShape;
};
template <class T, index_t... D>
struct pattern_of<StaticTensor<T, D...>> {
  using type = StaticShape<D...>;
};

// Symbolic input K of element type T.
template <class T, class Pattern, std::size_t K = 0>
auto input() {
  using G = Graph<Node<InputOp<K, Pattern, T>>>;
  return Sym<G, 0>{G{}};
}

template <class R>
concept NotRealTensor = !is_tensor_v<std::remove_cvref_t<R>>;

template <class F, class Positions, class... X>
struct capturable;
template <class F, std::size_t... K, class... X>
struct capturable<F, std::index_sequence<K...>, X...> {
  // A real tensor out of symbolic inputs: the function called a cell built at run time.
  static constexpr bool value = requires(F & f) {
    { f(input<typename X::value_type, typename pattern_of<X>::type, K>()...) } -> NotRealTensor;
  };
};

// Whether graph capture can call f on inputs like X...: a generic function or a Cell<...> can;
// a function of duet::Tensor, or a cell built at run time, only runs on real tensors.
template <class F, class... X>
concept Capturable = capturable<F, std::index_sequence_for<X...>, X...>::value;

namespace detail {

// The run-time half of a merge: the ids of the nodes built so far, and the first ambiguity met.
struct Merged {
  std::vector<std::uint64_t> ids;
  Note ambiguity;

  void note(const Note& why) {
    if (ambiguity.empty()) ambiguity = why;
  }
  template <std::size_t N>
  std::array<std::uint64_t, N> id_array() const {
    std::array<std::uint64_t, N> a{};
    std::copy_n(ids.begin(), N, a.begin());
    return a;
  }
};

// Who names parameters in an ambiguity's note: the outermost cell being captured sets itself
// here (nn::Cell's capture), so that the note says "Parameter 's1' and Parameter 's2'" where
// both would read "Parameter". A jitted function has no names to give.
struct ParameterNamer {
  void* cell = nullptr;
  std::string (*name)(void* cell, const void* parameter) = nullptr;
};
inline thread_local ParameterNamer parameter_namer{};

// For the duration of a capture: the first (outermost) one names.
class NamingParameters {
 public:
  NamingParameters(void* cell, std::string (*name)(void*, const void*)) : outer_(parameter_namer.name == nullptr) {
    if (outer_) parameter_namer = {cell, name};
  }
  NamingParameters(const NamingParameters&) = delete;
  NamingParameters& operator=(const NamingParameters&) = delete;
  ~NamingParameters() {
    if (outer_) parameter_namer = {};
  }

 private:
  bool outer_;
};

// An operation as an ambiguity's note names it: its label, and the parameter's name for a
// parameter read in construct.
template <class Op>
std::string merge_label(const Op& op) {
  if constexpr (requires { op.parameter; }) {
    if (parameter_namer.name != nullptr) {
      const std::string name = parameter_namer.name(parameter_namer.cell, op.parameter);
      if (!name.empty()) return op.label() + " '" + name + "'";
    }
  }
  return op.label();
}

// A constant standing for a type: two keys are equal when their types are. Comparing keys in a
// constant expression replaces an is_same per pair of nodes of two graphs with one key per type.
template <class T>
inline constexpr char type_key = 0;

// A node as a merge sees it: its operation's type, its whole type, its inputs, and which graph
// input it is, if one.
struct NodeView {
  const void* op = nullptr;
  const void* node = nullptr;
  std::span<const std::size_t> args{};
  bool is_input = false;
  std::size_t input_index = 0;
};

template <class N>
constexpr NodeView view_of() {
  NodeView v{&type_key<typename N::op_type>, &type_key<N>, std::span<const std::size_t>(N::args)};
  if constexpr (is_input_op_v<typename N::op_type>) {
    v.is_input = true;
    v.input_index = N::op_type::index;
  }
  return v;
}

template <class L>
struct views_of;
template <class... Nodes>
struct views_of<NodeList<Nodes...>> {
  static constexpr std::array<NodeView, sizeof...(Nodes)> value{view_of<Nodes>()...};
};

// A parameter node of b that is not where `built` has one of its type is held back until a
// node of b reads it: that node, found in `built` with a parameter of that type in the held
// one's place, says which parameter it is; if none is found, or nothing reads it, the parameter
// is appended then. A value computed from a parameter (`h = x + h0`) that two graphs hold at
// different places is thus merged, where matching by place alone captured it again at each
// merge, and a recurrent cell reading such a state twice per step doubled its graph per step.
// Several are held at once: a value of parameters alone (`angle = pos * freq`, read by sin and
// by cos) is found by its product of two, and captured once, as PyNative computes it once.
inline constexpr std::size_t held = static_cast<std::size_t>(-1);

// What merging b's nodes from Start on after `built` does: where each goes (map), and which
// are appended, in order. `first` is where b's nodes before Start go.
template <std::size_t NB>
struct MergePlan {
  std::array<std::size_t, NB> map{};
  std::array<bool, NB> met{};  // b's node j is a node `built` computes, whose ids must agree
  std::array<std::size_t, NB> order{};
  std::size_t appended = 0;
  bool input_clash = false;  // one graph input of two element types or shape patterns
};

template <std::size_t NB, std::size_t NBuilt, std::size_t Start>
constexpr MergePlan<NB> plan_merge(const std::array<NodeView, NB>& b, const std::array<NodeView, NBuilt>& built,
                                   const std::array<std::size_t, Start>& first) {
  MergePlan<NB> p;
  for (std::size_t j = 0; j < Start; ++j) p.map[j] = first[j];
  // The parameters held, in b's order (a product of two, `pos * freq`, holds both).
  std::array<std::size_t, NB> pending{};
  std::size_t n_pending = 0;
  const auto append = [&](std::size_t j) {
    p.map[j] = NBuilt + p.appended;
    p.order[p.appended++] = j;
  };
  // Appends the held parameters `keep` says no to, in b's order.
  const auto place_pending = [&](auto keep) {
    std::size_t kept = 0;
    for (std::size_t k = 0; k < n_pending; ++k) {
      if (keep(pending[k])) pending[kept++] = pending[k];
      else append(pending[k]);
    }
    n_pending = kept;
  };
  const auto place_all = [&] { place_pending([](std::size_t) { return false; }); };
  // Whether built's node i is b's node j, each held parameter j reads standing for the
  // parameter of its type in its slot there (which, then in stand_in: b's node to built's).
  std::array<std::size_t, NB> stand_in{};
  const auto same = [&](std::size_t i, std::size_t j) {
    if (built[i].op != b[j].op || built[i].args.size() != b[j].args.size()) return false;
    for (std::size_t a = 0; a < b[j].args.size(); ++a) {
      const std::size_t arg = b[j].args[a];
      const std::size_t want = p.map[arg];
      const std::size_t have = built[i].args[a];
      if (want != held) {
        if (have != want) return false;
        continue;
      }
      if (built[have].node != b[arg].node) return false;
      // One held parameter stands for one parameter of built, and two for two.
      for (std::size_t c = 0; c < a; ++c) {
        const std::size_t other = b[j].args[c];
        if (p.map[other] != held) continue;
        if ((other == arg) != (stand_in[other] == have)) return false;
      }
      stand_in[arg] = have;
    }
    return true;
  };
  // Whether b's nodes so far are each where `built` has it: a prefix the two graphs share.
  bool shared = Start == 0;
  for (std::size_t j = Start; j < NB; shared = shared && p.map[j] == j, ++j) {
    const NodeView& n = b[j];
    if (n.is_input) {
      std::size_t i = 0;
      while (i < NBuilt && !(built[i].is_input && built[i].input_index == n.input_index)) ++i;
      if (i == NBuilt) {
        append(j);
      } else {
        p.input_clash = p.input_clash || built[i].node != n.node;
        p.map[j] = i;
      }
      continue;
    }
    if (n.args.empty()) {
      // A node without inputs (a parameter), whose type says nothing of which one it is: where
      // built has one of its type at its own place inside a prefix the two graphs share, else
      // held, so that `x * gamma + beta` does not meet gamma where beta is, nor
      // `relu(h) * s1 + tanh(h) * s2` s1 where s2 is.
      if (shared && j < NBuilt && built[j].node == n.node) {
        p.map[j] = j;
        p.met[j] = true;
      } else {
        pending[n_pending++] = j;
        p.map[j] = held;
      }
      continue;
    }
    // Place j is tried first: a graph merged into one it extends has each node where the
    // other has it.
    std::size_t found = NBuilt;
    if (j < NBuilt && same(j, j)) found = j;
    for (std::size_t i = 0; i < NBuilt && found == NBuilt; ++i) {
      if (same(i, j)) found = i;
    }
    const auto reads = [&](std::size_t q) { return std::find(n.args.begin(), n.args.end(), q) != n.args.end(); };
    if (found < NBuilt) {
      for (const std::size_t arg : n.args) {
        if (p.map[arg] != held) continue;
        p.map[arg] = stand_in[arg];
        p.met[arg] = true;
      }
      std::size_t kept = 0;  // those still held; the ones found are placed already
      for (std::size_t k = 0; k < n_pending; ++k) {
        if (p.map[pending[k]] == held) pending[kept++] = pending[k];
      }
      n_pending = kept;
      p.map[j] = found;
      p.met[j] = true;
    } else {
      place_pending([&](std::size_t q) { return !reads(q); });
      append(j);
    }
  }
  place_all();
  return p;
}

template <class GB, class Built, std::size_t... First>
struct Merge {
  static constexpr auto plan = plan_merge(views_of<typename GB::list_type>::value, views_of<Built>::value,
                                          std::array<std::size_t, sizeof...(First)>{First...});
  static_assert(!plan.input_clash, "duet: one graph input is used with two different element types or shape patterns");
  // b's nodes that met one of built's, whose ids are compared.
  static constexpr std::size_t met_count = static_cast<std::size_t>(std::count(plan.met.begin(), plan.met.end(), true));
  static constexpr std::array<std::size_t, met_count> met = [] {
    std::array<std::size_t, met_count> m{};
    for (std::size_t j = 0, k = 0; j < plan.met.size(); ++j) {
      if (plan.met[j]) m[k++] = j;
    }
    return m;
  }();

  // The K-th node appended: b's node with its inputs renumbered.
  template <std::size_t K, class N = node_at<GB, plan.order[K]>, class A = std::make_index_sequence<N::arity>>
  struct appended;
  template <std::size_t K, class N, std::size_t... A>
  struct appended<K, N, std::index_sequence<A...>> {
    using type = Node<typename N::op_type, plan.map[N::args[A]]...>;
  };
};

// Appends b's nodes after `built`, each value once: a node of b whose type (op and renumbered
// inputs) is already built is that node, provided the ids agree; if they do not, the merge is
// ambiguous (Sym::ambiguity) and says which two nodes it met. Returns the graph and where each
// of b's nodes is in it (b's nodes before Start are where First says). Shared work is thus
// captured once: `x + f(x)` holds x's nodes once, and the graph of stacked residual blocks
// grows linearly with their number. The plan is a constant computed over both graphs at once,
// and the graph is made in one step: appending node by node made a list type per node
// appended, and merging a long graph into a short one cost the square of its length.
template <std::size_t Start, class GB, class Built, std::size_t... First>
auto merge_from(const GB& b, std::span<const std::uint64_t> b_ids, const Built& built,
                std::index_sequence<First...>, Merged& merged) {
  static_assert(Start == sizeof...(First));
  using M = Merge<GB, Built, First...>;
  constexpr std::size_t n_built = Built::size;
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    [[maybe_unused]] const auto check = [&](auto j) {
      constexpr std::size_t at = M::plan.map[decltype(j)::value];
      if (merged.ids[at] != b_ids[decltype(j)::value]) {
        merged.note(Note("%" + std::to_string(at) + " " + merge_label(get<at>(built).op) + " and " +
                         merge_label(get<decltype(j)::value>(b).op) +
                         " are one operation type on the same inputs, but two values"));
      }
    };
    [[maybe_unused]] const int in_order[] = {0, (check(std::integral_constant<std::size_t, M::met[K]>{}), 0)...};
  }(std::make_index_sequence<M::met_count>{});
  for (std::size_t k = 0; k < M::plan.appended; ++k) merged.ids.push_back(b_ids[M::plan.order[k]]);
  auto g = [&]<std::size_t... I, std::size_t... K>(std::index_sequence<I...>, std::index_sequence<K...>) {
    return Graph<node_at<Built, I>..., typename M::template appended<K>::type...>(
        std::in_place, get<I>(built)..., typename M::template appended<K>::type{get<M::plan.order[K]>(b).op}...);
  }(std::make_index_sequence<n_built>{}, std::make_index_sequence<M::plan.appended>{});
  auto map = []<std::size_t... J>(std::index_sequence<J...>) {
    return std::index_sequence<M::plan.map[J]...>{};
  }(std::make_index_sequence<GB::size>{});
  return std::pair{std::move(g), map};
}

template <std::size_t I, std::size_t... M>
constexpr std::size_t at(std::index_sequence<M...>) {
  constexpr std::array<std::size_t, sizeof...(M)> map{M...};
  return map[I];
}

}  // namespace detail

// Input K of node I of G, as diagnostic::rejection takes a shape.
template <class G, std::size_t I, int K>
struct NodeInput {
  static constexpr Shape shape = G::shapes[node_at<G, I>::args[static_cast<std::size_t>(K)]];
};

// The first node of a list whose shape rule does not hold, or the list's size.
template <class... Nodes>
constexpr std::size_t first_rejected(const NodeList<Nodes...>*, std::span<const Shape> shapes) {
  for (std::size_t i = 0; i < sizeof...(Nodes); ++i) {
    if (!static_rules<Nodes...>[i](shapes).ok()) return i;
  }
  return sizeof...(Nodes);
}

template <class G>
constexpr auto first_rejection_of() {
  constexpr std::size_t I = first_rejected(static_cast<const typename G::list_type*>(nullptr), G::shapes);
  if constexpr (I == G::size) {
    return std::type_identity<void>{};
  } else {
    using N = node_at<G, I>;
    constexpr ShapeResult r = static_rule<N>(G::shapes);
    return std::type_identity<
        diagnostic::rejection<typename N::op_type::layer_type, r.fault, r.expected, NodeInput<G, I, r.input>>>{};
  }
}
// The report (diagnostic::rejection) of the first node of G whose shape rule does not hold on
// the shapes compile time knows, void if all hold. Naming it reports nothing; instantiating it
// (sizeof) does, from wherever that is: a check made outside the capture keeps the
// diagnostic's context short.
template <class G>
using first_rejection = typename decltype(first_rejection_of<G>())::type;

// f(x), captured without reporting a broken shape rule: f runs on a Quiet input of x's shape
// and its nodes are spliced after x's, so the graph is the one f(x) would give. For a part
// whose fault is reported elsewhere: one mistake, one error.
template <class G, std::size_t Out, class F>
auto quietly(const Sym<G, Out>& x, F&& f) {
  using X = Sym<G, Out>;
  const auto q = f(input<typename X::value_type, Quiet<SameShapeAs<X>>>());
  using Q = std::remove_cvref_t<decltype(q)>;
  detail::Merged merged{{x.ids.begin(), x.ids.end()}, x.ambiguity};
  auto [g, map] = detail::merge_from<1>(q.graph, q.ids, static_cast<const typename G::list_type&>(x.graph),
                                              std::index_sequence<Out>{}, merged);
  merged.note(q.ambiguity);
  return Sym<decltype(g), detail::at<Q::output>(decltype(map){})>{g, merged.id_array<decltype(g)::size>(),
                                                                   merged.ambiguity};
}

// Appends `op` applied to x. The rule runs here, at capture, so a compile-time mismatch is
// reported where the user's construct calls the layer.
template <class Op, class G, std::size_t Out>
auto append(const Op& op, const Sym<G, Out>& x) {
  static_cast<void>(sizeof(diagnostic::check_operation<Op>));
  if constexpr (reports_faults<G>()) diagnostic::report_static_fault<Op, Sym<G, Out>>();
  auto g = with_node(x.graph, Node<Op, Out>{op});
  std::array<std::uint64_t, G::size + 1> ids{};
  std::copy(x.ids.begin(), x.ids.end(), ids.begin());
  ids[G::size] = new_node_id();
  return Sym<decltype(g), G::size>{g, ids, x.ambiguity};
}

// A symbolic input standing for x's value in a part captured apart (spliced after x): of x's
// element type, shape and phase, quiet if x's capture is.
template <class X>
auto continuation() {
  using G = typename X::graph_type;
  return []<std::size_t... I>(std::index_sequence<I...>) {
    using C = Continuing<phase_of_graph<G>(), X::shape.leading_unknown(), X::shape[static_cast<int>(I)]...>;
    return input<typename X::value_type, std::conditional_t<reports_faults<G>(), C, Quiet<C>>>();
  }(std::make_index_sequence<static_cast<std::size_t>(X::shape.rank())>{});
}

namespace detail {
// Where spliced puts things: part c's node j (j > 0; node 0 is its input) lands at
// base[c] + j - 1, and its input is the value of the part before it (out[c - 1], or x's).
template <std::size_t Size0, std::size_t Out0, class... Parts>
struct Splice {
  static constexpr std::size_t parts = sizeof...(Parts);
  static constexpr std::array<std::size_t, parts> sizes{Parts::graph_type::size...};
  static constexpr std::array<std::size_t, parts> outputs{Parts::output...};
  static constexpr std::array<std::size_t, parts + 1> base = [] {
    std::array<std::size_t, parts + 1> b{};
    b[0] = Size0;
    for (std::size_t c = 0; c < parts; ++c) b[c + 1] = b[c] + sizes[c] - 1;
    return b;
  }();
  static constexpr std::size_t size = base[parts];
  static constexpr std::size_t where(std::size_t c, std::size_t j) {
    if (j > 0) return base[c] + j - 1;
    return c == 0 ? Out0 : where(c - 1, outputs[c - 1]);
  }
  static constexpr std::size_t output = parts == 0 ? Out0 : where(parts - 1, outputs[parts - 1]);
  // For node K after x's: its part and its place there.
  static constexpr std::array<std::size_t, size - Size0> part = [] {
    std::array<std::size_t, size - Size0> a{};
    for (std::size_t c = 0; c < parts; ++c)
      for (std::size_t j = 1; j < sizes[c]; ++j) a[base[c] + j - 1 - Size0] = c;
    return a;
  }();
  static constexpr std::size_t place(std::size_t k) { return k + Size0 - base[part[k]] + 1; }

  template <std::size_t K, class N = node_at<typename node_at<NodeList<Parts...>, part[K]>::graph_type, place(K)>,
            class A = std::make_index_sequence<N::arity>>
  struct renumbered_node;
  template <std::size_t K, class N, std::size_t... A>
  struct renumbered_node<K, N, std::index_sequence<A...>> {
    using type = Node<typename N::op_type, where(part[K], N::args[A])...>;
  };
};

// Node `Place`'s operation in a part. Not a member of Splice, whose name spells out every part:
// a function per node named so makes the names the compiler mangles grow with the square of
// the chain's length (two fifths of the bytes of names g++ made for a 128-layer network).
template <std::size_t Place, class Part>
const auto& op_at(const Part* part) {
  return get<Place>(part->graph).op;
}
}  // namespace detail

// x's graph, then each part's nodes after the value before it: parts[0] captured on
// continuation<X>(), parts[c] on continuation of parts[c - 1]. The result is the graph that
// capturing them one after the other on x would give, made in one function: appending to x's
// graph would copy it once per node, so a chain of n nodes would cost n^2.
template <class G0, std::size_t Out0, class... Parts>
auto spliced(const Sym<G0, Out0>& x, const Parts&... parts) {
  using S = detail::Splice<G0::size, Out0, Parts...>;
  const NodeList<const Parts*...> all(std::in_place, &parts...);
  auto g = [&]<std::size_t... I, std::size_t... K>(std::index_sequence<I...>, std::index_sequence<K...>) {
    return Graph<node_at<G0, I>..., typename S::template renumbered_node<K>::type...>(
        std::in_place, get<I>(x.graph)..., {detail::op_at<S::place(K)>(get<S::part[K]>(all))}...);
  }(std::make_index_sequence<G0::size>{}, std::make_index_sequence<S::size - G0::size>{});
  Sym<decltype(g), S::output> y{std::move(g), {}, x.ambiguity};
  std::copy(x.ids.begin(), x.ids.end(), y.ids.begin());
  auto at = y.ids.begin() + G0::size;
  for (const std::span<const std::uint64_t> ids : {std::span<const std::uint64_t>(parts.ids)...}) {
    at = std::copy(ids.begin() + 1, ids.end(), at);
  }
  for (const detail::Note* a : {&parts.ambiguity...}) {
    if (y.ambiguity.empty()) y.ambiguity = *a;
  }
  return y;
}

namespace detail {

// Merges the graphs of xs... after g, each input once; Outs are where the values used so far
// live in the result (the nodes already there keep their places).
template <class G, std::size_t... Outs>
auto merge_all(const G& g, Merged&, std::index_sequence<Outs...> outs) {
  return std::pair{g, outs};
}
template <class G, std::size_t... Outs, class GB, std::size_t B, class... Rest>
auto merge_all(const G& g, Merged& ids, std::index_sequence<Outs...>, const Sym<GB, B>& b, const Rest&... rest) {
  ids.note(b.ambiguity);
  auto [merged, map] = merge_from<0>(b.graph, b.ids, static_cast<const typename G::list_type&>(g), std::index_sequence<>{}, ids);
  return merge_all(merged, ids, std::index_sequence<Outs..., at<B>(decltype(map){})>{}, rest...);
}

}  // namespace detail

// Appends `op` applied to x0, x1, ..., whose graphs are merged first.
template <class Op, class G0, std::size_t O0, class... Rest>
  requires(sizeof...(Rest) >= 1 && (Symbolic<Rest> && ...))
auto append(const Op& op, const Sym<G0, O0>& x0, const Rest&... rest) {
  static_cast<void>(sizeof(diagnostic::check_operation<Op>));
  // Graph mode binds the inputs, and reports_faults reads them, from node 0 on: a graph that
  // started with a parameter read the input in the parameter's place.
  static_assert(is_input_op_v<typename node_at<G0, 0>::op_type>, "duet (internal): a captured graph starts with an input");
  if constexpr (reports_faults<G0>() && (reports_faults<typename Rest::graph_type>() && ...)) {
    diagnostic::report_static_fault<Op, Sym<G0, O0>, Rest...>();
  }
  detail::Merged ids{{x0.ids.begin(), x0.ids.end()}, x0.ambiguity};
  auto [merged, outs] = detail::merge_all(x0.graph, ids, std::index_sequence<O0>{}, rest...);
  // merged is passed, not captured: clang 14 cannot capture a structured binding.
  auto g = [&op]<class M, std::size_t... Args>(const M& m, std::index_sequence<Args...>) {
    return with_node(m, Node<Op, Args...>{op});
  }(merged, decltype(outs){});
  ids.ids.push_back(new_node_id());
  return Sym<decltype(g), decltype(merged)::size>{g, ids.id_array<decltype(g)::size>(), ids.ambiguity};
}

}  // namespace duet::graph
