// The graph evaluator: one call runs a whole optimised graph.
//
// The buffer plan is computed at compile time: views alias what they view, the output node
// writes straight into the returned tensor, and every other node gets a slot that is reused
// once its last reader has run. At run time the evaluator infers the concrete shapes (the
// same rules as at capture, now on real sizes), takes one arena block for the slots and one
// block for the output from the pool, and calls each node's kernel in order: no per-node
// dispatch, and once the pool is warm for these shapes, no heap allocation.
#pragma once

#include <array>
#include <cstddef>
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

}  // namespace graph

// Runs an optimised graph on its inputs (one tensor per InputOp, in order).
template <class Backend = DefaultBackend, class G, std::size_t Out, class... Inputs>
BasicTensor<typename G::value_type> evaluate(const graph::Sym<G, Out>& program, const Inputs&... inputs) {
  using T = typename G::value_type;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> plan = graph::plan_buffers<G, Out>();
  const std::array<const BasicTensor<T>*, sizeof...(Inputs)> input{&static_cast<const BasicTensor<T>&>(inputs)...};

  std::array<Shape, n> shapes{};
  std::array<T*, n> data{};
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = graph::node_at<G, I>;
           using Op = typename Node::op_type;
           const Op& op = boost::hana::at_c<I>(program.graph.nodes).op;
           if constexpr (graph::is_input_op_v<Op>) {
             static_assert(Op::index < sizeof...(Inputs), "duet::evaluate: the graph reads more inputs than were given");
             shapes[I] = input[Op::index]->shape();
             // Inputs are only ever read: a node's input pointers are const in every kernel.
             data[I] = const_cast<T*>(input[Op::index]->data());
             if (!graph::fits(G::shapes[I], shapes[I])) {
               throw ShapeError("duet: graph input " + std::to_string(Op::index) + " must have shape " +
                                to_string(G::shapes[I]) + ", got " + to_string(shapes[I]));
             }
           } else {
             std::array<Shape, Node::arity> in{};
             for (std::size_t k = 0; k < Node::arity; ++k) in[k] = shapes[Node::args[k]];
             const ShapeResult r = op.infer(in);
             if (!r.ok()) throw ShapeError(describe_fault(r, op.label(), in));
             shapes[I] = r.shape;
           }
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  // Slots are laid out one after another in a single arena block, each 64-byte aligned.
  std::array<std::size_t, n> slot_offset{};
  std::size_t arena_bytes = 0;
  {
    std::array<std::size_t, n> slot_bytes{};
    for (std::size_t i = 0; i < n; ++i) {
      if (plan.storage[i] != graph::Storage::slot) continue;
      const auto bytes = static_cast<std::size_t>(shapes[i].numel()) * sizeof(T);
      if (bytes > slot_bytes[plan.slot[i]]) slot_bytes[plan.slot[i]] = bytes;
    }
    for (std::size_t s = 0; s < plan.slot_count; ++s) {
      slot_offset[s] = arena_bytes;
      arena_bytes += (slot_bytes[s] + detail::block_alignment - 1) / detail::block_alignment * detail::block_alignment;
    }
  }
  detail::Storage arena(arena_bytes);

  BasicTensor<T> result;
  for (std::size_t i = 0; i < n; ++i) {
    switch (plan.storage[i]) {
      case graph::Storage::input: break;
      case graph::Storage::view: data[i] = data[plan.root[i]]; break;
      case graph::Storage::slot: data[i] = reinterpret_cast<T*>(arena.data() + slot_offset[plan.slot[i]]); break;
      case graph::Storage::output:
        result = BasicTensor<T>::uninitialized(shapes[i]);
        data[i] = result.data();
        break;
    }
  }

  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = graph::node_at<G, I>;
           using Op = typename Node::op_type;
           if constexpr (!graph::is_input_op_v<Op> && !Op::is_view) {
             std::array<const T*, Node::arity> in{};
             std::array<Shape, Node::arity> in_shapes{};
             for (std::size_t k = 0; k < Node::arity; ++k) {
               in[k] = data[Node::args[k]];
               in_shapes[k] = shapes[Node::args[k]];
             }
             boost::hana::at_c<I>(program.graph.nodes).op.template run<Backend>(in.data(), in_shapes.data(), data[I], shapes[I]);
           }
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  constexpr std::size_t out_root = plan.root[Out];
  if constexpr (plan.storage[out_root] == graph::Storage::input) {
    // The graph only reshapes an input: its output is a view of that input.
    return input[graph::node_at<G, out_root>::op_type::index]->reshape(shapes[Out]);
  } else {
    return shapes[Out] == result.shape() ? result : result.reshape(shapes[Out]);
  }
}

}  // namespace duet
