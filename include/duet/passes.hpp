// Compile-time passes over a captured graph. Each takes a Sym (graph plus output) and
// returns a new one, of a new type; they run while the program compiles and leave nothing to
// do at run time but the evaluator's calls.
//
//   shape inference and checking   in graph.hpp, at capture (Graph::shapes, append)
//   views                          is_view nodes get no buffer (evaluator's plan)
//   fuse_epilogues                 bias adds and activations move into the product before them,
//                                  elementwise chains become one pass (O1 and O2)
//   pack_weights                   products keep their weights pre-packed between calls (O1 and
//                                  O2, graphs not being trained)
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <utility>

#include "graph.hpp"
#include "jit_config.hpp"
#include "tape.hpp"

namespace duet::passes {

namespace detail {
template <class... Nodes>
constexpr void count_users(const graph::NodeList<Nodes...>*, std::span<std::size_t> users) {
  for (const std::span<const std::size_t> args : {std::span<const std::size_t>(Nodes::args)...}) {
    for (const std::size_t a : args) ++users[a];
  }
}
}  // namespace detail

// How many nodes read each node's value; the graph's output counts as one more reader. (A
// loop over the nodes' argument lists, not a function per node.)
template <class G, std::size_t Out>
constexpr std::array<std::size_t, G::size> user_counts() {
  std::array<std::size_t, G::size> users{};
  detail::count_users(static_cast<const typename G::list_type*>(nullptr), users);
  ++users[Out];
  return users;
}

// user_counts, computed once per graph. fuse_from asks at every node, and compilers do not
// remember a constant-evaluated call between uses: evaluated anew at each of a 128-layer
// chain's 385 nodes, it was 70 MB of g++'s memory and about a fifth of its time.
template <class G, std::size_t Out>
inline constexpr std::array<std::size_t, G::size> users_of = user_counts<G, Out>();

// A producer op P takes consumer op C as its epilogue when it says so; in a graph that will be
// differentiated, only if the fused op still can be.
template <class P, class C, bool Differentiated>
concept absorbs = requires {
  requires P::template accepts_epilogue<C>;
} && (!Differentiated || DifferentiableOperation<decltype(std::declval<const P&>().absorb(std::declval<const C&>()))>);

// A producer op P takes the binary consumer C, reading P's value as its input Pos, into
// itself (elementwise chains: one pass over all their inputs); never in a graph that will be
// differentiated, since the fused op keeps no value in between.
template <class P, class C, int Pos, bool Differentiated>
concept absorbs_operand =
    !Differentiated && requires(const P& p, const C& c) { p.template absorb_operand<Pos>(c); };

namespace detail {

// Whether every built node after position R has no inputs (graph inputs, parameters): a node
// moved past them reads nothing they make.
template <class Built, std::size_t R>
constexpr bool only_sources_after() {
  bool ok = true;
  graph::for_each_index<Built::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    if constexpr (I > R) ok = ok && graph::node_at<Built, I>::node::arity == 0;
  });
  return ok;
}

// Which input of a binary node J the fusion can take: one read by J alone, made by a built
// node with only sources (graph inputs, parameters) after it, the other input being another
// node. -1 if neither.
template <class G, std::size_t J, std::size_t Out, class Built, std::size_t... Map>
constexpr int operand_to_absorb() {
  using N = graph::node_at<G, J>;
  constexpr std::array<std::size_t, J> m{Map...};
  constexpr const auto& users = users_of<G, Out>;
  const std::size_t a0 = N::args[0], a1 = N::args[1];
  if (a0 == a1 || m[a0] == m[a1]) return -1;
  if (users[a0] == 1 && only_sources_after<Built, m[N::args[0]]>()) return 0;
  if (users[a1] == 1 && only_sources_after<Built, m[N::args[1]]>()) return 1;
  return -1;
}

// Map after the built node at R is taken out and its value made by a node appended at the
// end: later nodes move down one, R's users go to the end.
template <std::size_t R, std::size_t End, std::size_t... Map>
constexpr std::array<std::size_t, sizeof...(Map)> moved_to_end() {
  std::array<std::size_t, sizeof...(Map)> m{Map...};
  for (std::size_t& v : m) v = v == R ? End : v > R ? v - 1 : v;
  return m;
}

template <auto A, std::size_t... I>
constexpr auto as_sequence(std::index_sequence<I...>) {
  return std::index_sequence<A[I]...>{};
}

// How a fused node's operation is made from the captured graph's (graph::Step's recipe): node
// J's own (graph::Take), or the operation of a fused node (From) absorbing node J's, as its
// epilogue (Pos < 0) or through its input Pos.
template <class From, std::size_t J, int Pos>
struct Absorb {
  template <class G>
  static auto make(const G& g) {
    if constexpr (Pos < 0) return From::make(g).absorb(graph::get<J>(g).op);
    else return From::make(g).template absorb_operand<Pos>(graph::get<J>(g).op);
  }
};

// How many operations a fused node's recipe has absorbed.
template <class Recipe>
inline constexpr std::size_t absorbed_count = 0;
template <class From, std::size_t J, int Pos>
inline constexpr std::size_t absorbed_count<Absorb<From, J, Pos>> = 1 + absorbed_count<From>;

// At most this many operations fuse into one. Fused without bound, a chain of elementwise
// functions makes one operation whose type lists them all, and the types on the way grow with
// the square of the chain's length: a Dense and 257 ReLUs took clang 5 minutes, and stopped at
// a fold over the epilogue's functions deeper than it allows. A product with its bias and
// activation absorbs 2.
inline constexpr std::size_t max_absorbed = 16;

// L without its element R, then X.
template <std::size_t R, class L, class X, class I = std::make_index_sequence<L::size - 1>>
struct moved_out;
template <std::size_t R, class L, class X, std::size_t... I>
struct moved_out<R, L, X, std::index_sequence<I...>> {
  using type = graph::NodeList<graph::node_at<L, (I < R ? I : I + 1)>..., X>;
};

// A node of Op reading what node type P reads, then Extra.
template <class Op, class P, class A, std::size_t... Extra>
struct with_args;
template <class Op, class P, std::size_t... A, std::size_t... Extra>
struct with_args<Op, P, std::index_sequence<A...>, Extra...> {
  using type = graph::Node<Op, P::args[A]..., Extra...>;
};
template <class Op, class P, std::size_t... Extra>
using with_args_of = typename with_args<Op, P, std::make_index_sequence<P::arity>, Extra...>::type;

// Walks the nodes in order, planning the fused list: a NodeList of Steps, and where the output
// is. Map[j] is where node j's value lives in the new list. A unary consumer folds into the
// node that computes its input when that node is the last one planned, absorbs it, and nobody
// else reads the value in between. Types only: the list is made once, from the plan
// (fuse_epilogues), where growing it node by node would copy it once per node.
template <std::size_t J, std::size_t Out, bool Differentiated, class G, class Built, std::size_t... Map>
auto fuse_from(std::index_sequence<Map...> map) {
  if constexpr (J == G::size) {
    constexpr std::array<std::size_t, G::size> m{Map...};
    return std::pair<std::type_identity<Built>, std::integral_constant<std::size_t, m[Out]>>{};
  } else {
    using N = graph::node_at<G, J>;
    using Kept =
        graph::Step<decltype(graph::renumbered(std::declval<const N&>(), map, std::make_index_sequence<N::arity>{})),
                    graph::Take<J>>;
    constexpr std::size_t built_size = Built::size;
    if constexpr (N::arity == 1) {
      constexpr std::array<std::size_t, J> m{Map...};
      constexpr std::size_t a = N::args[0];
      constexpr std::size_t r = m[a];
      using PS = graph::node_at<Built, r>;
      using P = typename PS::node;
      if constexpr (r + 1 == built_size && users_of<G, Out>[a] == 1 &&
                    absorbed_count<typename PS::recipe> < max_absorbed &&
                    absorbs<typename P::op_type, typename N::op_type, Differentiated>) {
        using Absorbed = decltype(std::declval<const P&>().op.absorb(std::declval<const N&>().op));
        using Fused = graph::Step<with_args_of<Absorbed, P>, Absorb<typename PS::recipe, J, -1>>;
        return fuse_from<J + 1, Out, Differentiated, G, typename moved_out<r, Built, Fused>::type>(
            std::index_sequence<Map..., r>{});
      } else {
        return fuse_from<J + 1, Out, Differentiated, G, typename graph::appended<Built, Kept>::type>(
            std::index_sequence<Map..., built_size>{});
      }
    } else if constexpr (N::arity == 2) {
      constexpr int pos = operand_to_absorb<G, J, Out, Built, Map...>();
      constexpr std::array<std::size_t, J> m{Map...};
      constexpr std::size_t r = m[N::args[pos < 0 ? 0 : pos]];
      using PS = graph::node_at<Built, r>;
      using P = typename PS::node;
      if constexpr (pos >= 0 && absorbed_count<typename PS::recipe> < max_absorbed &&
                    absorbs_operand<typename P::op_type, typename N::op_type, pos, Differentiated>) {
        // P's node leaves its place for one at the end that also reads the other input.
        static constexpr auto moved = moved_to_end<r, built_size - 1, Map..., r>();
        using Absorbed =
            decltype(std::declval<const P&>().op.template absorb_operand<pos>(std::declval<const N&>().op));
        using Fused =
            graph::Step<with_args_of<Absorbed, P, moved[N::args[1 - pos]]>, Absorb<typename PS::recipe, J, pos>>;
        return fuse_from<J + 1, Out, Differentiated, G, typename moved_out<r, Built, Fused>::type>(
            as_sequence<moved>(std::make_index_sequence<J + 1>{}));
      } else {
        return fuse_from<J + 1, Out, Differentiated, G, typename graph::appended<Built, Kept>::type>(
            std::index_sequence<Map..., built_size>{});
      }
    } else {
      return fuse_from<J + 1, Out, Differentiated, G, typename graph::appended<Built, Kept>::type>(
          std::index_sequence<Map..., built_size>{});
    }
  }
}

}  // namespace detail

// Moves each bias add and elementwise activation into the epilogue of the product that
// feeds it, and fuses chains of elementwise functions, so each value is written once.
template <bool Differentiated = false, class G, std::size_t Out>
auto fuse_epilogues(const graph::Sym<G, Out>& program) {
  using Plan = decltype(detail::fuse_from<0, Out, Differentiated, G, graph::NodeList<>>(std::index_sequence<>{}));
  using Built = typename Plan::first_type::type;
  auto fused = graph::from_plan<graph::Graph>(program.graph, static_cast<Built*>(nullptr));
  return graph::Sym<decltype(fused), Plan::second_type::value>{fused};
}

namespace detail {
// A node with its weight packed. Not a lambda in pack_weights: a lambda's functions are named
// after the graph, one per node, and such names grow with the square of the network's depth.
struct PackedWeight {
  template <class Op, std::size_t... A>
  auto operator()(const graph::Node<Op, A...>& n) const {
    if constexpr (requires { n.op.with_packed_weight(); }) {
      return graph::Node<decltype(n.op.with_packed_weight()), A...>{n.op.with_packed_weight()};
    } else {
      return n;
    }
  }
};
}  // namespace detail

// Each op that can read its weight pre-packed (with_packed_weight()) is replaced by that
// form. Not for graphs being trained: their weights change at every step, and a packed copy
// would only add a pass over them.
template <class G, std::size_t Out>
auto pack_weights(const graph::Sym<G, Out>& program) {
  auto nodes = graph::transformed(program.graph, detail::PackedWeight{});
  auto packed = graph::make_graph(nodes);
  return graph::Sym<decltype(packed), Out>{packed};
}

// The pipeline of a jit level. Differentiated: the graph is the forward half of a training
// graph, so fusion keeps every op differentiable.
template <JitConfig Config = JitConfig{}, bool Differentiated = false, class G, std::size_t Out>
auto optimize(const graph::Sym<G, Out>& program) {
  if constexpr (Config.jit_level == JitLevel::O0) return program;
  else if constexpr (Differentiated) return fuse_epilogues<Differentiated>(program);
  else return pack_weights(fuse_epilogues<Differentiated>(program));
}

}  // namespace duet::passes
