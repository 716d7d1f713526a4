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
#include <cmath>
#include <string>
#include <string_view>
#include <type_traits>
#include <atomic>
#include <boost/hana/at.hpp>
#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>
#include <utility>

#include "backend.hpp"
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

  // Greedy slot reuse: a slot is free again once every reader of its value has run.
  std::array<std::size_t, n> slot_owner{};
  std::array<bool, n> slot_busy{};
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t s = 0; s < plan.slot_count; ++s) {
      if (Reuse && slot_busy[s] && last_read[slot_owner[s]] < i) slot_busy[s] = false;
    }
    if (plan.storage[i] != Storage::slot) continue;
    std::size_t s = 0;
    while (s < plan.slot_count && slot_busy[s]) ++s;
    if (s == plan.slot_count) ++plan.slot_count;
    slot_busy[s] = true;
    slot_owner[s] = i;
    plan.slot[i] = s;
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
  std::string where;  // what the graph was captured from, for debug's messages
};

}  // namespace graph

namespace detail {
// How a failing node is named: in debug, by its place in the graph and the function or cell
// it was captured from (`where`), so a user finds the line of construct that made it.
template <JitConfig Config, class Op>
std::string node_context(std::size_t index, std::string_view where) {
  if constexpr (Config.debug_level == DebugLevel::debug) {
    return "duet (debug): in " + std::string(where) + ", node %" + std::to_string(index) + " (" + Op::op_name() + "): ";
  } else {
    (void)index;
    (void)where;
    return {};
  }
}
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
  graph::Plan<G, Inputs> p;
  p.input_shapes = input_shapes;
  p.where = std::move(where);
  graph::for_each_index<n>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = graph::node_at<G, I>;
    using Op = typename Node::op_type;
    const Op& op = boost::hana::at_c<I>(program.graph.nodes).op;
    if constexpr (graph::is_input_op_v<Op>) {
      const Shape& s = input_shapes[Op::index];
      if (!graph::fits(G::shapes[I], s)) {
        throw ShapeError(detail::node_context<Config, Op>(I, p.where) + "duet: graph input " + std::to_string(Op::index) +
                         " must have shape " + to_string(G::shapes[I]) + ", got " + to_string(s));
      }
      p.shapes[I] = s;
    } else {
      std::array<Shape, Node::arity> copies{};
      std::span<const Shape> in;
      if constexpr (Node::arity == 1) {
        in = std::span<const Shape>(&p.shapes[Node::args[0]], 1);
      } else {
        for (std::size_t k = 0; k < Node::arity; ++k) copies[k] = p.shapes[Node::args[k]];
        in = copies;
      }
      const ShapeResult r = op.infer(in);
      if (!r.ok()) throw ShapeError(detail::node_context<Config, Op>(I, p.where) + describe_fault(r, op.label(), in));
      p.shapes[I] = r.shape;
    }
  });

  // Slots one after another, each 64-byte aligned.
  std::array<std::size_t, n> slot_bytes{};
  for (std::size_t i = 0; i < n; ++i) {
    if (buffers.storage[i] != graph::Storage::slot) continue;
    const auto bytes = static_cast<std::size_t>(p.shapes[i].numel()) * element_size[i];
    if (bytes > slot_bytes[buffers.slot[i]]) slot_bytes[buffers.slot[i]] = bytes;
  }
  std::array<std::size_t, n> slot_offset{};
  for (std::size_t s = 0; s < buffers.slot_count; ++s) {
    slot_offset[s] = p.arena_bytes;
    p.arena_bytes += (slot_bytes[s] + detail::block_alignment - 1) / detail::block_alignment * detail::block_alignment;
  }
  for (std::size_t i = 0; i < n; ++i) p.offset[i] = slot_offset[buffers.slot[i]];
  return p;
}

namespace detail {
// Debug's check of a node's output: the first NaN or infinity, named with its node.
template <class T>
void check_finite(const T* values, const Shape& shape, const std::string& context) {
  if constexpr (std::is_floating_point_v<T>) {
    for (index_t i = 0; i < shape.numel(); ++i) {
      if (!std::isfinite(values[i])) {
        throw ValueError(context + "output element " + std::to_string(i) + " of " + to_string(shape) + " is " +
                         (std::isnan(values[i]) ? "NaN" : "infinite"));
      }
    }
  }
}
}  // namespace detail

namespace graph {
// What run_observed shows each node's value to. This one is nothing, and costs nothing.
struct NoObserver {};
}  // namespace graph

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
  graph::for_each_index<n>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = graph::node_at<G, I>;
    using Op = typename Node::op_type;
    if constexpr (buffers.storage[I] == graph::Storage::input) {
      // Inputs are only read: kernels see them through KernelArgs::in, as const.
      data[I] = const_cast<void*>(input[Op::index]);
    } else {
      if constexpr (buffers.storage[I] == graph::Storage::view) {
        const auto& op = boost::hana::at_c<I>(program.graph.nodes).op;
        data[I] = static_cast<char*>(data[Node::args[0]]) +
                  view_offset(op, p.shapes[Node::args[0]]) * static_cast<index_t>(sizeof(graph::node_value_t<G, I>));
      } else if constexpr (buffers.storage[I] == graph::Storage::output) {
        result = BasicTensor<Result>::uninitialized(p.shapes[I]);
        data[I] = result.data();
      } else if constexpr (buffers.storage[I] == graph::Storage::slot) {
        data[I] = arena.data() + p.offset[I];
      } else {
        data[I] = nullptr;
      }
      if constexpr (graph::runs_kernel<Op>()) {
        std::array<const void*, Node::arity> in;
        for (std::size_t k = 0; k < Node::arity; ++k) in[k] = data[Node::args[k]];
        const auto& op = boost::hana::at_c<I>(program.graph.nodes).op;
        using T = graph::node_value_t<G, I>;
        if constexpr (Node::arity == 1) {
          op.template run<Backend, T>(graph::KernelArgs{in.data(), &p.shapes[Node::args[0]], data[I], p.shapes[I]});
        } else {
          std::array<Shape, Node::arity> in_shapes;
          for (std::size_t k = 0; k < Node::arity; ++k) in_shapes[k] = p.shapes[Node::args[k]];
          op.template run<Backend, T>(graph::KernelArgs{in.data(), in_shapes.data(), data[I], p.shapes[I]});
        }
        if constexpr (Config.debug_level == DebugLevel::debug && !Op::is_view && !graph::is_sink<Op>()) {
          detail::check_finite(static_cast<const T*>(data[I]), p.shapes[I], detail::node_context<Config, Op>(I, p.where));
        }
      }
    }
    if constexpr (!std::is_same_v<std::remove_cvref_t<Observer>, graph::NoObserver> && !graph::is_sink<Op>()) {
      observe(std::integral_constant<std::size_t, I>{}, static_cast<const graph::node_value_t<G, I>*>(data[I]),
              p.shapes[I]);
    }
  });

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
