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
#include <cstddef>
#include <span>
#include <utility>

#include <boost/hana/at.hpp>

#include "backend.hpp"
#include "diagnostics.hpp"
#include "graph.hpp"
#include "memory.hpp"
#include "tensor.hpp"

namespace duet {

namespace graph {

enum class Storage : unsigned char { input, view, slot, output };

template <std::size_t N>
struct BufferPlan {
  std::array<Storage, N> storage{};
  std::array<std::size_t, N> root{};  // the node whose memory a node's value lives in
  std::array<std::size_t, N> slot{};  // for Storage::slot roots
  std::size_t slot_count = 0;
};

template <class G, std::size_t Out>
constexpr BufferPlan<G::size> plan_buffers() {
  constexpr std::size_t n = G::size;
  BufferPlan<n> plan;
  std::array<std::size_t, n> last_read{};
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = node_at<G, I>;
           using Op = typename Node::op_type;
           if constexpr (is_input_op_v<Op>) {
             plan.storage[I] = Storage::input;
             plan.root[I] = I;
           } else if constexpr (Op::is_view) {
             plan.storage[I] = Storage::view;
             plan.root[I] = plan.root[Node::args[0]];
           } else {
             plan.storage[I] = Storage::slot;
             plan.root[I] = I;
           }
           for (std::size_t a : Node::args) last_read[plan.root[a]] = I;
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  const std::size_t out_root = plan.root[Out];
  if (plan.storage[out_root] == Storage::slot) plan.storage[out_root] = Storage::output;
  last_read[out_root] = n;  // the caller reads it last

  // Greedy slot reuse: a slot is free again once every reader of its value has run.
  std::array<std::size_t, n> slot_owner{};
  std::array<bool, n> slot_busy{};
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t s = 0; s < plan.slot_count; ++s) {
      if (slot_busy[s] && last_read[slot_owner[s]] < i) slot_busy[s] = false;
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

template <class G>
constexpr std::size_t input_count() {
  std::size_t count = 0;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((count += is_input_op_v<typename node_at<G, I>::op_type> ? 1 : 0), ...);
  }(std::make_index_sequence<G::size>{});
  return count;
}

// The run-time part of a compiled graph for one set of input shapes.
template <class G>
struct Plan {
  static constexpr std::size_t inputs = input_count<G>();
  std::array<Shape, inputs> input_shapes;
  std::array<Shape, G::size> shapes;
  std::array<std::size_t, G::size> offset;  // bytes into the arena, for slot nodes
  std::size_t arena_bytes = 0;
};

}  // namespace graph

// Infers every node's shape for these input shapes and lays out the arena.
template <class G, std::size_t Out>
graph::Plan<G> plan(const graph::Sym<G, Out>& program,
                    const std::array<Shape, graph::Plan<G>::inputs>& input_shapes) {
  using T = typename G::value_type;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out>();
  graph::Plan<G> p;
  p.input_shapes = input_shapes;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = graph::node_at<G, I>;
           using Op = typename Node::op_type;
           const Op& op = boost::hana::at_c<I>(program.graph.nodes).op;
           if constexpr (graph::is_input_op_v<Op>) {
             const Shape& s = input_shapes[Op::index];
             if (!graph::fits(G::shapes[I], s)) {
               throw ShapeError("duet: graph input " + std::to_string(Op::index) + " must have shape " +
                                to_string(G::shapes[I]) + ", got " + to_string(s));
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
             if (!r.ok()) throw ShapeError(describe_fault(r, op.label(), in));
             p.shapes[I] = r.shape;
           }
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  // Slots one after another, each 64-byte aligned.
  std::array<std::size_t, n> slot_bytes{};
  for (std::size_t i = 0; i < n; ++i) {
    if (buffers.storage[i] != graph::Storage::slot) continue;
    const auto bytes = static_cast<std::size_t>(p.shapes[i].numel()) * sizeof(T);
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

// Runs a graph with a plan made for these inputs' shapes.
template <class Backend = DefaultBackend, class G, std::size_t Out, class... Inputs>
BasicTensor<typename G::value_type> run(const graph::Sym<G, Out>& program, const graph::Plan<G>& p,
                                        const Inputs&... inputs) {
  using T = typename G::value_type;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out>();
  static_assert(sizeof...(Inputs) == graph::Plan<G>::inputs, "duet::run: one tensor per graph input");
  const std::array<const BasicTensor<T>*, sizeof...(Inputs)> input{&static_cast<const BasicTensor<T>&>(inputs)...};

  detail::Storage arena(p.arena_bytes);
  BasicTensor<T> result;
  std::array<T*, n> data;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = graph::node_at<G, I>;
           using Op = typename Node::op_type;
           if constexpr (buffers.storage[I] == graph::Storage::input) {
             // Inputs are only read: kernels take their inputs as const T*.
             data[I] = const_cast<T*>(input[Op::index]->data());
           } else if constexpr (buffers.storage[I] == graph::Storage::view) {
             data[I] = data[buffers.root[I]];
           } else {
             if constexpr (buffers.storage[I] == graph::Storage::output) {
               result = BasicTensor<T>::uninitialized(p.shapes[I]);
               data[I] = result.data();
             } else {
               data[I] = reinterpret_cast<T*>(arena.data() + p.offset[I]);
             }
             std::array<const T*, Node::arity> in;
             for (std::size_t k = 0; k < Node::arity; ++k) in[k] = data[Node::args[k]];
             if constexpr (Node::arity == 1) {
               boost::hana::at_c<I>(program.graph.nodes)
                   .op.template run<Backend>(in.data(), &p.shapes[Node::args[0]], data[I], p.shapes[I]);
             } else {
               std::array<Shape, Node::arity> in_shapes;
               for (std::size_t k = 0; k < Node::arity; ++k) in_shapes[k] = p.shapes[Node::args[k]];
               boost::hana::at_c<I>(program.graph.nodes)
                   .op.template run<Backend>(in.data(), in_shapes.data(), data[I], p.shapes[I]);
             }
           }
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  constexpr std::size_t out_root = buffers.root[Out];
  if constexpr (buffers.storage[out_root] == graph::Storage::input) {
    // The graph only reshapes an input: its output is a view of that input.
    return input[graph::node_at<G, out_root>::op_type::index]->reshape(p.shapes[Out]);
  } else if constexpr (out_root != Out) {
    return result.reshape(p.shapes[Out]);
  } else {
    return result;
  }
}

// Plans and runs in one call.
template <class Backend = DefaultBackend, class G, std::size_t Out, class... Inputs>
BasicTensor<typename G::value_type> evaluate(const graph::Sym<G, Out>& program, const Inputs&... inputs) {
  using T = typename G::value_type;
  const std::array<Shape, sizeof...(Inputs)> shapes{static_cast<const BasicTensor<T>&>(inputs).shape()...};
  return run<Backend>(program, plan(program, shapes), inputs...);
}

}  // namespace duet
