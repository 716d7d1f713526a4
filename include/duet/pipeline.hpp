// The compile driver of graph mode, written once for Cell, grad and jit:
//
//   capture   the function called on symbolic inputs (graph::input) returns the program as a
//             type; each front end captures its own way (a cell's construct, a function with
//             non-tensor arguments for jit), through compile() where the inputs are tensors
//   passes    passes::optimize<Config> rewrites that type (grad then appends the backward
//             graph, autodiff::build_backward)
//   plan      for the inputs' shapes, kept per owner and thread (cached_plan; the captured
//             program is kept the same way, captured_once)
//   run       the evaluator, in one call (execute)
//
// Capture and passes happen while the program compiles; plan once per new input shape; run
// on every call.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "error.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "host.hpp"
#include "jit_config.hpp"
#include "passes.hpp"
#include "tensor.hpp"

namespace duet::pipeline {

// A symbolic input: its element type and what compile time knows of its shape.
template <class T, class Pattern>
struct Input {};

// f captured on Inputs (input K being the K-th) and optimised; Differentiated keeps every
// operation differentiable, for a graph that build_backward extends. The program keeps the
// capture's ambiguity (graph::Sym::ambiguity): when it is not empty, the program computes one
// value where the function computes two, and the caller runs the function another way (a
// trace, which knows each value at run time).
template <JitConfig Config, bool Differentiated, class... Inputs, class F>
auto compile(F&& f) {
  return [&]<class... T, class... P, std::size_t... K>(std::index_sequence<K...>, Input<T, P>*...) {
    const auto captured = f(graph::input<T, P, K>()...);
    graph::check_syntax_level<Config, typename decltype(captured)::graph_type>();
    auto program = passes::optimize<Config, Differentiated>(captured);
    program.ambiguity = captured.ambiguity;
    return program;
  }(std::index_sequence_for<Inputs...>{}, static_cast<Inputs*>(nullptr)...);
}

template <graph::Phase P>
using PhaseConstant = std::integral_constant<graph::Phase, P>;

// The phase the layers of the phase-dependent nodes of g are set to. When they disagree, the
// error names the first two that do: the kernels' own check (ops::PhaseOf) could only blame
// the layer whose operation ran in the other phase's form, which need not be the one the user
// switched.
template <class G, auto nodes>
graph::Phase agreed_phase(const G& g) {
  const auto& lead = graph::get<nodes[0]>(g).op;
  const graph::Phase phase = lead.requested_phase();
  const auto setting = [](graph::Phase p) { return p == graph::Phase::train ? "train" : "evaluate"; };
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    const auto agrees = [&](const auto& op) {
      if (op.requested_phase() == phase) return true;
      throw ModeError(lead.layer_label() + " is set to " + setting(phase) + " and " + op.layer_label() + " to " +
                      setting(op.requested_phase()) +
                      " (set_train); graph mode captures a network in one phase, which all its layers must "
                      "share: call set_train on the whole network, or run it in PyNative mode");
    };
    static_cast<void>((agrees(graph::get<nodes[K]>(g).op) && ...));
  }(std::make_index_sequence<nodes.size()>{});
  return phase;
}

// run(program), program being what capture(PhaseConstant<P>{}) makes for the phase the
// network's layers are set to (set_train). The training form is made first: its type says
// whether any operation depends on the phase, and if any do, their layers say which form to
// run, and must agree (agreed_phase). Each form's plan is cached apart (cached_plan keys on the graph's type), so switching
// back and forth keeps both. Every phase-dependent kernel checks its layer again when it
// runs, so a form whose layers have been switched since (one layer alone, say) is refused,
// never run stale.
template <class Capture, class Run>
decltype(auto) in_requested_phase(Capture&& capture, Run&& run) {
  auto&& train = capture(PhaseConstant<graph::Phase::train>{});
  using G = typename std::remove_cvref_t<decltype(train)>::graph_type;
  constexpr auto nodes = graph::phase_dependent_nodes<G>();
  if constexpr (!nodes.empty()) {
    if (agreed_phase<G, nodes>(train.graph) == graph::Phase::eval) {
      return run(capture(PhaseConstant<graph::Phase::eval>{}));
    }
  }
  return run(train);
}

// The program compile() returns, compiled once for `key` on this thread and kept until another
// key asks (the front ends' "captured once per owner, thread and phase"). One entry per
// compile type, which is one per call site and program type: it costs nothing to keep, and
// concurrent callers never share or lock it.
template <class Key, class Compile>
const auto& captured_once(const Key& key, Compile&& compile) {
  thread_local struct {
    std::optional<Key> key;
    std::optional<decltype(compile())> program;
  } cache;
  if (cache.key != key) {
    cache.key.reset();  // stays invalid if compiling throws
    cache.program.emplace(compile());
    cache.key = key;
  }
  return *cache.program;
}

// The plan of the last input shapes `owner` ran this graph type with on this thread. Per
// thread, so concurrent callers never share or lock; one entry, so it costs nothing to keep.
template <JitConfig Config = JitConfig{}, class G, std::size_t Out, std::size_t N, class Where>
const graph::Plan<G, N>& cached_plan(std::uint64_t owner, const graph::Sym<G, Out>& program,
                                     const std::array<Shape, N>& shapes, Where&& where) {
  thread_local struct {
    std::uint64_t owner = 0;
    graph::Plan<G, N> plan;
  } cache;
  if (cache.owner != owner || cache.plan.input_shapes != shapes) {
    cache.owner = 0;  // stays invalid if planning throws
    cache.plan = plan<Config>(program, shapes, std::string(where()));
    cache.owner = owner;
  }
  return cache.plan;
}

// Plans (or reuses the plan for these shapes) and runs a compiled program. `owner` keys the
// plan cache (detail::new_plan_owner); `where` names the program in shape errors.
template <JitConfig Config, class G, std::size_t Out, class Where, class... Ts>
auto execute(std::uint64_t owner, const graph::Sym<G, Out>& program, Where&& where, const BasicTensor<Ts>&... xs) {
  const std::array<Shape, sizeof...(Ts)> shapes{xs.shape()...};
  return run<DefaultBackend, Config>(program, cached_plan<Config>(owner, program, shapes, where), xs...);
}

}  // namespace duet::pipeline
