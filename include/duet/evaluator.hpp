// The graph evaluator: one call runs a whole optimised graph.
//
// Evaluation has two steps. plan() is the run-time half of compiling: for the concrete input
// shapes it infers every node's shape (the rules of capture, now on real sizes; a broken rule
// throws here, before anything runs) and lays out the intermediate values in one arena. run()
// takes the arena and the output tensor from the pool and calls each node's kernel in order:
// no per-node dispatch, and once the pool is warm for these shapes, no heap allocation. A
// plan depends only on the input shapes, so callers keep it and skip planning next time.
//
// Where values live is decided at compile time (plan_buffers): views alias what they view,
// the output node writes straight into the returned tensor, and every other node gets a slot
// that is reused once its last reader has run.
#pragma once

#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "detail/finite.hpp"
#include "diagnostics.hpp"
#include "graph.hpp"
#include "jit_config.hpp"
#include "memory.hpp"
#include "tensor.hpp"

namespace duet {

namespace graph {

enum class Storage : unsigned char { input, view, slot, output, none };

template <std::size_t N>
struct BufferPlan {
  std::array<Storage, N> storage{};
  std::array<std::size_t, N> root{};  // the node whose memory a node's value lives in
  std::array<std::size_t, N> slot{};  // for Storage::slot roots
  std::size_t slot_count = 0;
};

// Reuse = false (exec_mode no_sink) gives every node a slot of its own, so every intermediate
// value survives until the call returns.
template <class G, std::size_t Out, bool Reuse = true>
constexpr BufferPlan<G::size> plan_buffers() {
  constexpr std::size_t n = G::size;
  BufferPlan<n> plan;
  std::array<std::size_t, n> last_read{};
  graph::for_each_index<n>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = node_at<G, I>;
    using Op = typename Node::op_type;
    if constexpr (is_input_op_v<Op>) {
      plan.storage[I] = Storage::input;
      plan.root[I] = I;
    } else if constexpr (Op::is_view) {
      plan.storage[I] = Storage::view;
      plan.root[I] = plan.root[Node::args[0]];
    } else if constexpr (is_sink<Op>()) {
      plan.storage[I] = Storage::none;
      plan.root[I] = I;
    } else {
      plan.storage[I] = Storage::slot;
      plan.root[I] = I;
    }
    for (std::size_t a : Node::args) {
      if (plan.storage[a] == Storage::none) throw "a sink node makes no value to read";
      last_read[plan.root[a]] = I;
    }
  });

  const std::size_t out_root = plan.root[Out];
  if (plan.storage[out_root] == Storage::slot) plan.storage[out_root] = Storage::output;
  last_read[out_root] = n;  // the caller reads it last

  // Greedy slot reuse: a slot is free again once every reader of its value has run. Linear in
  // the nodes: each value's slot goes back to a stack of free slots after its last reader,
  // found in buckets by that reader. (A scan of every slot at every node was quadratic, and an
  // unrolled recurrence's backward graph, thousands of nodes, exceeded the compiler's budget
  // of constant-evaluation steps.) A value nobody reads is free after its own node.
  std::array<std::size_t, n + 1> bucket{};  // values last read by node j: dying[bucket[j] .. bucket[j + 1])
  std::array<std::size_t, n> dying{};
  for (std::size_t r = 0; r < n; ++r) {
    if (plan.storage[r] != Storage::slot) continue;
    if (last_read[r] < r) last_read[r] = r;
    if (last_read[r] < n - 1) ++bucket[last_read[r] + 1];
  }
  for (std::size_t j = 1; j <= n; ++j) bucket[j] += bucket[j - 1];
  std::array<std::size_t, n + 1> filled = bucket;
  for (std::size_t r = 0; r < n; ++r) {
    if (plan.storage[r] == Storage::slot && last_read[r] < n - 1) dying[filled[last_read[r]]++] = r;
  }
  std::array<std::size_t, n> free_slots{};
  std::size_t free_count = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (Reuse && i > 0) {
      for (std::size_t k = bucket[i - 1]; k < bucket[i]; ++k) free_slots[free_count++] = plan.slot[dying[k]];
    }
    if (plan.storage[i] != Storage::slot) continue;
    plan.slot[i] = free_count > 0 ? free_slots[--free_count] : plan.slot_count++;
  }
  return plan;
}

// One more than the largest input index the graph reads: how many tensors a call passes.
template <class G>
constexpr std::size_t input_count() {
  std::size_t count = 0;
  for_each_index<G::size>([&](auto i) {
    using Op = typename node_at<G, decltype(i)::value>::op_type;
    if constexpr (is_input_op_v<Op>) count = Op::index + 1 > count ? Op::index + 1 : count;
  });
  return count;
}

// The run-time part of a compiled graph for one set of input shapes. A call may pass inputs
// the graph never reads (a function that ignores an argument); they count in the key.
template <class G, std::size_t Inputs>
struct Plan {
  static constexpr std::size_t inputs = Inputs;
  std::array<Shape, Inputs> input_shapes;
  std::array<Shape, G::size> shapes;
  std::array<std::size_t, G::size> offset;  // bytes into the arena, for slot nodes
  std::size_t arena_bytes = 0;
  std::string where;  // what the graph was captured from, for its errors
};

}  // namespace graph

namespace detail {
// What plan() reads of one node, through functions of its op's type: the loop over the nodes
// is then compiled once, and each op type's functions once for every graph it is in, where a
// loop unrolled over the graph (a lambda per node) compiled every node of every graph anew.
struct PlanNode {
  const void* op = nullptr;
  ShapeResult (*infer)(const void* op, std::span<const Shape> in) = nullptr;
  std::string (*label)(const void* op) = nullptr;
  std::string (*op_name)() = nullptr;
  bool names_its_layer = false;
  bool is_input = false;
  std::size_t input = 0;  // is_input: which argument
  std::span<const std::size_t> args;
};

template <class Op>
ShapeResult infer_node(const void* op, std::span<const Shape> in) {
  return static_cast<const Op*>(op)->infer(in);
}
template <class Op>
std::string label_node(const void* op) {
  return static_cast<const Op*>(op)->label();
}

template <class Node>
PlanNode plan_node(const typename Node::op_type& op) {
  using Op = typename Node::op_type;
  PlanNode p;
  p.op = &op;
  p.op_name = &Op::op_name;
  p.args = Node::args;
  if constexpr (graph::is_input_op_v<Op>) {
    p.is_input = true;
    p.input = Op::index;
  } else {
    p.infer = &infer_node<Op>;
    p.label = &label_node<Op>;
    p.names_its_layer = duet::detail::names_its_layer<Op>;
  }
  return p;
}

// How a failing node is named: in debug, by its place in the graph and the function or cell
// it was captured from (`where`), so a user finds the line of construct that made it.
DUET_DETAIL_COMPILED std::string node_context(bool debug, const std::string& op_name, std::size_t index,
                                              std::string_view where);
template <JitConfig Config, class Op>
std::string node_context(std::size_t index, std::string_view where) {
  if constexpr (Config.debug_level == DebugLevel::debug) return node_context(true, Op::op_name(), index, where);
  else return {};
}

// Every node's shape for these input shapes (patterns: the shapes capture inferred, -1 where a
// dimension is dynamic).
DUET_DETAIL_COMPILED void infer_shapes(std::span<const PlanNode> nodes, std::span<const Shape> patterns,
                                       std::span<const Shape> input_shapes, std::span<Shape> shapes, bool debug,
                                       std::string_view where);

// Places the slots one after another, each 64-byte aligned and as large as the largest value
// it holds; offset[i] is where node i's slot begins. Returns the arena's size.
DUET_DETAIL_COMPILED std::size_t lay_out_slots(std::span<const graph::Storage> storage,
                                               std::span<const std::size_t> slot, std::size_t slot_count,
                                               std::span<const std::size_t> element_size, std::span<const Shape> shapes,
                                               std::span<std::size_t> offset);
}  // namespace detail

// Infers every node's shape for these input shapes and lays out the arena.
template <JitConfig Config = JitConfig{}, class G, std::size_t Out, std::size_t Inputs>
graph::Plan<G, Inputs> plan(const graph::Sym<G, Out>& program, const std::array<Shape, Inputs>& input_shapes,
                            std::string where = "the graph") {
  static_assert(Inputs >= graph::input_count<G>(), "duet::plan: the graph reads more inputs than are given");
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out, Config.exec_mode != ExecMode::no_sink>();
  constexpr std::array<std::size_t, n> element_size = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<std::size_t, n>{sizeof(graph::node_value_t<G, I>)...};
  }
  (std::make_index_sequence<n>{});
  const std::array<detail::PlanNode, n> nodes = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<detail::PlanNode, n>{
        detail::plan_node<graph::node_at<G, I>>(graph::get<I>(program.graph).op)...};
  }(std::make_index_sequence<n>{});
  graph::Plan<G, Inputs> p;
  p.input_shapes = input_shapes;
  p.where = std::move(where);
  detail::infer_shapes(nodes, G::shapes, input_shapes, p.shapes, Config.debug_level == DebugLevel::debug, p.where);

  p.arena_bytes = detail::lay_out_slots(buffers.storage, buffers.slot, buffers.slot_count, element_size, p.shapes, p.offset);
  return p;
}

namespace graph {
// What run_observed shows each node's value to. This one is nothing, and costs nothing.
struct NoObserver {};
}  // namespace graph

namespace detail {
// What run_observed's nodes share.
template <class Result>
struct RunState {
  void** data;                // each node's values
  const void* const* inputs;  // the graph's inputs' values
  const Shape* shapes;
  const std::size_t* offset;  // into the arena, for slot nodes
  std::byte* arena;
  BasicTensor<Result>* result;
  const std::string* where;
};

// Node i of run_observed, reading the nodes `args`: where its value lives (S), then its kernel.
// A function of the operation's type and the node's storage, shared by every node of that
// kind in every graph, rather than a lambda of run_observed (a function per node, named
// after the graph: compile time and names that grow with the square of the network's depth).
template <class Backend, JitConfig Config, graph::Storage S, class T, class Result, std::size_t arity, class Op>
void run_node(const Op& op, const std::size_t* args, std::size_t i, const RunState<Result>& state) {
  void** data = state.data;
  if constexpr (S == graph::Storage::input) {
    // Inputs are only read: kernels see them through KernelArgs::in, as const.
    data[i] = const_cast<void*>(state.inputs[Op::index]);
  } else {
    if constexpr (S == graph::Storage::view) {
      data[i] = static_cast<char*>(data[args[0]]) +
                view_offset(op, state.shapes[args[0]]) * static_cast<index_t>(sizeof(T));
    } else if constexpr (S == graph::Storage::output) {
      *state.result = BasicTensor<Result>::uninitialized(state.shapes[i]);
      data[i] = state.result->data();
    } else if constexpr (S == graph::Storage::slot) {
      data[i] = state.arena + state.offset[i];
    } else {
      data[i] = nullptr;
    }
    if constexpr (graph::runs_kernel<Op>()) {
      std::array<const void*, arity> in;
      for (std::size_t k = 0; k < arity; ++k) in[k] = data[args[k]];
      if constexpr (arity == 1) {
        op.template run<Backend, T>(graph::KernelArgs{in.data(), &state.shapes[args[0]], data[i], state.shapes[i]});
      } else {
        std::array<Shape, arity> in_shapes;
        for (std::size_t k = 0; k < arity; ++k) in_shapes[k] = state.shapes[args[k]];
        op.template run<Backend, T>(graph::KernelArgs{in.data(), in_shapes.data(), data[i], state.shapes[i]});
      }
      if constexpr (Config.debug_level == DebugLevel::debug && !Op::is_view && !graph::is_sink<Op>()) {
        check_finite(static_cast<const T*>(data[i]), state.shapes[i], node_context<Config, Op>(i, *state.where));
      }
    }
  }
}

template <std::size_t I, class Op, class T, class Observer>
void show_node([[maybe_unused]] Observer& observe, [[maybe_unused]] const void* values,
               [[maybe_unused]] const Shape& shape) {
  if constexpr (!std::is_same_v<std::remove_cvref_t<Observer>, graph::NoObserver> && !graph::is_sink<Op>()) {
    observe(std::integral_constant<std::size_t, I>{}, static_cast<const T*>(values), shape);
  }
}
}  // namespace detail

// run(), showing each node's value to `observe` as soon as its kernel has run (before its slot
// may be reused): observe(std::integral_constant<std::size_t, I>{}, const T* values, shape) for
// every node I that makes a value, inputs included. duet::compare_modes reads graph mode's
// intermediate values so.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class Observer,
          class... Inputs>
auto run_observed(const graph::Sym<G, Out>& program, const graph::Plan<G, sizeof...(Inputs)>& p, Observer&& observe,
                  const Inputs&... inputs) {
  using Result = graph::node_value_t<G, Out>;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out, Config.exec_mode != ExecMode::no_sink>();
  const std::array<const void*, sizeof...(Inputs)> input{static_cast<const void*>(inputs.data())...};

  detail::Storage arena(p.arena_bytes);
  BasicTensor<Result> result;
  std::array<void*, n> data;
  const detail::RunState<Result> state{data.data(), input.data(), p.shapes.data(), p.offset.data(), arena.data(),
                                       &result,     &p.where};
  // One call per node, in order (a braced list's elements), in this one function.
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    [[maybe_unused]] const int in_order[] = {
        0, (detail::run_node<Backend, Config, buffers.storage[I], graph::node_value_t<G, I>, Result,
                             graph::node_at<G, I>::arity>(graph::get<I>(program.graph).op,
                                                          graph::node_at<G, I>::args.data(), I, state),
            detail::show_node<I, typename graph::node_at<G, I>::op_type, graph::node_value_t<G, I>>(observe, data[I],
                                                                                                   p.shapes[I]),
            0)...};
  }(std::make_index_sequence<n>{});

  constexpr std::size_t out_root = buffers.root[Out];
  // Where the output's elements begin in its root's, when it is a view.
  const index_t offset = static_cast<const Result*>(data[Out]) - static_cast<const Result*>(data[out_root]);
  if constexpr (buffers.storage[out_root] == graph::Storage::input) {
    // The graph only views an input: its output is a view of that input.
    constexpr std::size_t k = graph::node_at<G, out_root>::op_type::index;
    return tensor_of(std::get<k>(std::forward_as_tuple(inputs...))).view(offset, p.shapes[Out]);
  } else if constexpr (out_root != Out) {
    return result.view(offset, p.shapes[Out]);
  } else {
    return result;
  }
}

// Runs a graph with a plan made for these inputs' shapes; inputs in the order of their index.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class... Inputs>
auto run(const graph::Sym<G, Out>& program, const graph::Plan<G, sizeof...(Inputs)>& p, const Inputs&... inputs) {
  return run_observed<Backend, Config>(program, p, graph::NoObserver{}, inputs...);
}

namespace detail {
// Identifies a user of plan caches (a cell, a gradient function) for the program's life; an
// address would not do, since a new object at a freed address may have other sizes.
inline std::uint64_t new_plan_owner() {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}
}  // namespace detail

// Plans and runs in one call.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class... Inputs>
auto evaluate(const graph::Sym<G, Out>& program, const Inputs&... inputs) {
  return run<Backend, Config>(program, plan<Config>(program, std::array<Shape, sizeof...(Inputs)>{inputs.shape()...}),
                              inputs...);
}

}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/evaluator_impl.hpp"
#endif
