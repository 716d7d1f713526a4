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

// Fusion walks the nodes in order. Each node either keeps its own step, appended to the plan,
// or is absorbed by an earlier node's step: a unary consumer as its epilogue, a binary one
// through the input it reads. The step a node makes holds the fused operation and its recipe.
// What decides is local, which keeps the walk linear in the graph's size:
//  - every node's step is the last of the plan when the node is planned, and a node's value
//    read by one consumer only is the newest of its step's (an absorbed node reads the newest);
//  - so a unary node can fold only into node J - 1's step, the last one;
//  - a binary node into the step of the operand it alone reads, when only sources (graph inputs,
//    parameters) were planned after that operand, and the other operand is in another step.
// Where each step ends up is worked out once, from values, by fuse_layout. (Planned as a list
// of the steps so far and a map of every node, carried from node to node, the walk had
// template arguments that grew with each node: quadratic in depth.)
enum class FuseKind : unsigned char { keep, epilogue, operand };

// Node J's part of the plan (fuse_node): what it does, the operation and recipe of the step it
// makes, that step's first node (two nodes share a step when they share it) and its arity.
template <FuseKind Kind, std::size_t Into, int Pos, class Op, class Recipe, std::size_t Head, std::size_t Arity>
struct FuseChoice {
  static constexpr FuseKind kind = Kind;
  static constexpr std::size_t into = Into;  // the node whose step this one absorbs
  static constexpr int pos = Pos;            // the input it reads that step's value through
  using op_type = Op;
  using recipe = Recipe;
  static constexpr std::size_t head = Head;
  static constexpr std::size_t arity = Arity;
};

template <class G, std::size_t Out, bool Differentiated, std::size_t J>
struct fuse_node;

// One past the last node before J whose step reads anything (0 if none).
template <class G, std::size_t Out, bool Differentiated, std::size_t J>
inline constexpr std::size_t computing_before = fuse_node<G, Out, Differentiated, J - 1>::computing_through;
template <class G, std::size_t Out, bool Differentiated>
inline constexpr std::size_t computing_before<G, Out, Differentiated, 0> = 0;

// Which input of binary node J can take its producer's step along: one J reads alone, with only
// sources planned after it, the other input being in another step. -1 if neither.
template <class G, std::size_t Out, bool Differentiated, std::size_t J>
constexpr int operand_to_absorb() {
  using N = graph::node_at<G, J>;
  constexpr const auto& users = users_of<G, Out>;
  constexpr std::size_t a0 = N::args[0], a1 = N::args[1];
  if constexpr (a0 == a1 ||
                fuse_node<G, Out, Differentiated, a0>::head == fuse_node<G, Out, Differentiated, a1>::head) {
    return -1;
  } else {
    constexpr std::size_t computing = computing_before<G, Out, Differentiated, J>;
    if (users[a0] == 1 && computing <= a0 + 1) return 0;
    if (users[a1] == 1 && computing <= a1 + 1) return 1;
    return -1;
  }
}

template <class G, std::size_t Out, bool Differentiated, std::size_t J>
auto fuse_choice() {
  using N = graph::node_at<G, J>;
  using C = typename N::op_type;
  using Keep = FuseChoice<FuseKind::keep, J, -1, C, graph::Take<J>, J, N::arity>;
  if constexpr (N::arity == 1) {
    constexpr std::size_t a = N::args[0];
    if constexpr (a + 1 == J && users_of<G, Out>[a] == 1) {
      using P = fuse_node<G, Out, Differentiated, a>;
      using Op = typename P::op_type;
      if constexpr (absorbed_count<typename P::recipe> < max_absorbed && absorbs<Op, C, Differentiated>) {
        using Absorbed = decltype(std::declval<const Op&>().absorb(std::declval<const C&>()));
        return FuseChoice<FuseKind::epilogue, a, -1, Absorbed, Absorb<typename P::recipe, J, -1>, P::head, P::arity>{};
      } else {
        return Keep{};
      }
    } else {
      return Keep{};
    }
  } else if constexpr (N::arity == 2) {
    constexpr int pos = operand_to_absorb<G, Out, Differentiated, J>();
    if constexpr (pos >= 0) {
      constexpr std::size_t a = N::args[pos];
      using P = fuse_node<G, Out, Differentiated, a>;
      using Op = typename P::op_type;
      if constexpr (absorbed_count<typename P::recipe> < max_absorbed && absorbs_operand<Op, C, pos, Differentiated>) {
        using Absorbed = decltype(std::declval<const Op&>().template absorb_operand<pos>(std::declval<const C&>()));
        return FuseChoice<FuseKind::operand, a, pos, Absorbed, Absorb<typename P::recipe, J, pos>, P::head,
                          P::arity + 1>{};
      } else {
        return Keep{};
      }
    } else {
      return Keep{};
    }
  } else {
    return Keep{};
  }
}

template <class G, std::size_t Out, bool Differentiated, std::size_t J>
struct fuse_node : decltype(fuse_choice<G, Out, Differentiated, J>()) {
  // One past the last node up to J whose step reads anything (0 if none).
  static constexpr std::size_t computing_through =
      fuse_node::arity != 0 ? J + 1 : computing_before<G, Out, Differentiated, J>;
};

// Where the plan puts each step (at the position of the node that made it last) and each
// node's value, applying the choices in order. An absorbing operand's step leaves its place for
// one at the end, which moves the steps after it down one: they are sources, read by no step,
// so no argument changes. Positions a step reads never move after it is made.
template <std::size_t N>
struct FuseLayout {
  std::array<std::size_t, N> map{};    // node -> position of the step holding its value
  std::array<std::size_t, N> maker{};  // position -> the node whose step is there
  std::size_t size = 0;
};

template <class G, std::size_t Out, bool Differentiated, std::size_t... J>
constexpr FuseLayout<sizeof...(J)> fuse_layout(std::index_sequence<J...>) {
  // A braced list plans the nodes in order: each finds the nodes before it planned, and no
  // instantiation nests in the last one's (nested, a 300-layer network's 901 nodes passed g++'s
  // limit of 900).
  constexpr std::array<FuseKind, sizeof...(J)> kind{fuse_node<G, Out, Differentiated, J>::kind...};
  constexpr std::array<std::size_t, sizeof...(J)> into{fuse_node<G, Out, Differentiated, J>::into...};
  FuseLayout<sizeof...(J)> l;
  for (std::size_t j = 0; j < sizeof...(J); ++j) {
    if (kind[j] == FuseKind::keep) {
      l.map[j] = l.size;
      l.maker[l.size++] = j;
    } else if (kind[j] == FuseKind::epilogue) {
      l.map[j] = l.map[into[j]];
      l.maker[l.map[j]] = j;
    } else {
      const std::size_t r = l.map[into[j]];
      for (std::size_t i = 0; i < j; ++i) {
        l.map[i] = l.map[i] == r ? l.size - 1 : l.map[i] > r ? l.map[i] - 1 : l.map[i];
      }
      for (std::size_t p = r; p + 1 < l.size; ++p) l.maker[p] = l.maker[p + 1];
      l.maker[l.size - 1] = j;
      l.map[j] = l.size - 1;
    }
  }
  return l;
}

template <class G, std::size_t Out, bool Differentiated>
inline constexpr auto fuse_layout_of = fuse_layout<G, Out, Differentiated>(std::make_index_sequence<G::size>{});

// The node type of node J's step: its operation, reading what the absorbed step read (and, for
// an operand, the other input), or its own inputs at their planned positions.
template <class G, std::size_t Out, bool Differentiated, std::size_t J,
          class A = std::make_index_sequence<graph::node_at<G, J>::arity>>
struct fused_node_type;
template <class G, std::size_t Out, bool Differentiated, std::size_t J, std::size_t... A>
struct fused_node_type<G, Out, Differentiated, J, std::index_sequence<A...>> {
  using F = fuse_node<G, Out, Differentiated, J>;
  using N = graph::node_at<G, J>;
  static constexpr const auto& map = fuse_layout_of<G, Out, Differentiated>.map;
  template <std::size_t... P, std::size_t... Extra>
  static auto with_args_of(std::index_sequence<P...>, std::index_sequence<Extra...>) {
    using Absorbed = typename fused_node_type<G, Out, Differentiated, F::into>::type;
    return std::type_identity<graph::Node<typename F::op_type, Absorbed::args[P]..., Extra...>>{};
  }
  static auto make() {
    if constexpr (F::kind == FuseKind::keep) {
      return std::type_identity<graph::Node<typename F::op_type, map[N::args[A]]...>>{};
    } else {
      using Absorbed = typename fused_node_type<G, Out, Differentiated, F::into>::type;
      if constexpr (F::kind == FuseKind::epilogue) {
        return with_args_of(std::make_index_sequence<Absorbed::arity>{}, std::index_sequence<>{});
      } else {
        return with_args_of(std::make_index_sequence<Absorbed::arity>{},
                            std::index_sequence<map[N::args[1 - F::pos]]>{});
      }
    }
  }
  using type = typename decltype(make())::type;
};

template <class G, std::size_t Out, bool Differentiated, std::size_t... P>
auto fused_steps(std::index_sequence<P...>) {
  constexpr const auto& maker = fuse_layout_of<G, Out, Differentiated>.maker;
  return graph::NodeList<graph::Step<typename fused_node_type<G, Out, Differentiated, maker[P]>::type,
                                     typename fuse_node<G, Out, Differentiated, maker[P]>::recipe>...>{};
}

}  // namespace detail

// Moves each bias add and elementwise activation into the epilogue of the product that
// feeds it, and fuses chains of elementwise functions, so each value is written once.
template <bool Differentiated = false, class G, std::size_t Out>
auto fuse_epilogues(const graph::Sym<G, Out>& program) {
  constexpr const auto& layout = detail::fuse_layout_of<G, Out, Differentiated>;
  using Built = decltype(detail::fused_steps<G, Out, Differentiated>(std::make_index_sequence<layout.size>{}));
  auto fused = graph::from_plan<graph::Graph>(program.graph, static_cast<Built*>(nullptr));
  return graph::Sym<decltype(fused), layout.map[Out]>{fused};
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
