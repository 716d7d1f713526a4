// graph_ir: what graph mode made of a cell, as text and as Graphviz DOT, before and after the
// passes (MindSpore users get this from save_graphs).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "cell.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "passes.hpp"
#include "pipeline.hpp"
#include "pijit.hpp"
#include "trace.hpp"

namespace duet {

struct GraphText {
  std::string text;  // one line per node: "%2 = MatMul + BiasAdd + ReLU(%1) : [?, 512]  nn::Dense<...>"
  std::string dot;   // Graphviz: `dot -Tsvg`
};

struct GraphIR {
  GraphText captured;   // as construct built it
  GraphText optimized;  // after the passes: what the evaluator runs
};

namespace graph {

namespace detail {
// s inside a DOT quoted string that Graphviz shows as a label. A quote would end the string
// and a backslash starts Graphviz's own escapes (\n, \N, \G...), so both are escaped; a
// newline becomes a line break; &, < and > become the entities Graphviz decodes in labels.
inline std::string dot_text(std::string_view s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      default:
        out += c;
    }
  }
  return out;
}
}  // namespace detail

template <class G, std::size_t Out>
GraphText dump(const Sym<G, Out>& program, const std::string& title) {
  constexpr BufferPlan<G::size> plan = plan_buffers<G, Out>();
  std::ostringstream text;
  std::ostringstream dot;
  text << "graph " << title << " {\n";
  dot << "digraph \"" << detail::dot_text(title) << "\" {\n  node [shape=box, fontname=\"monospace\"];\n";
  graph::for_each_index<G::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = node_at<G, I>;
    const auto& op = graph::get<I>(program.graph).op;
    std::string what = Node::op_type::op_name();
    if constexpr (Node::arity > 0) {
      what += "(";
      for (std::size_t k = 0; k < Node::arity; ++k) what += (k ? ", %" : "%") + std::to_string(Node::args[k]);
      what += ")";
    }
    std::string storage;
    switch (plan.storage[I]) {
      case Storage::input:
        storage = "input";
        break;
      case Storage::view:
        storage = "view of %" + std::to_string(plan.root[I]);
        break;
      case Storage::slot:
        storage = "slot " + std::to_string(plan.slot[I]);
        break;
      case Storage::output:
        storage = "output";
        break;
      case Storage::none:
        storage = "no value";
        break;
    }
    const bool names_layer = op.label() != Node::op_type::op_name();
    const std::string who = names_layer ? "  " + op.label() : "";
    text << "  %" << I << " = " << what << " : " << to_string(G::shapes[I]) << "  [" << storage << "]" << who << "\n";
    std::string label = detail::dot_text("%" + std::to_string(I) + " " + Node::op_type::op_name()) + "\\n" +
                        detail::dot_text(to_string(G::shapes[I]) + " (" + storage + ")");
    if (names_layer) label += "\\n" + detail::dot_text(op.label());
    dot << "  n" << I << " [label=\"" << label << "\"];\n";
    for (std::size_t a : Node::args) dot << "  n" << a << " -> n" << I << ";\n";
  });
  text << "  return %" << Out << "\n";
  // Such a program does not run (pipeline::compile): the dump says so, and why.
  if (!program.ambiguity.empty())
    text << "  ambiguous capture, runs traced instead: " << program.ambiguity.str() << "\n";
  text << "}\n";
  dot << "}\n";
  return {text.str(), dot.str()};
}

namespace detail {
inline std::string dot_of_text(const std::string& title, const std::string& text) {
  return "digraph \"" + dot_text(title) + "\" {\n  node [shape=box, fontname=\"monospace\"];\n  trace [label=\"" +
         dot_text(text) + "\"];\n}\n";
}

// What graph mode runs when there is no static graph (a capture that is ambiguous, a network
// built at run time): the cell traced (PIJit) on an input of the pattern's shape, unknown sizes
// taken as 2 (BatchNorm trains on no fewer), as recorded and as replayed after fusion. Tracing
// runs the network; what that changes (BatchNorm's moving statistics, Dropout's generator) is
// put back, as for a step that does not commit.
template <JitConfig Config, class C, std::size_t N>
GraphIR traced_ir(C& cell, const std::string& title, std::array<Shape, N> patterns, const std::string& how) {
  using T = typename C::value_type;
  const std::string head = "graph " + title + " {\n  " + how + "\n";
  const auto ir = [&](const std::string& captured, const std::string& optimized) {
    return GraphIR{{head + captured + "}\n", dot_of_text(title, head + captured)},
                   {head + optimized + "}\n", dot_of_text(title, head + optimized)}};
  };
  if (std::ranges::any_of(patterns, [](const Shape& p) { return p.leading_unknown(); })) {
    const std::string note = "  traced on its first call for each input shape: give graph_ir an input shape "
                             "(duet::shape<dyn, ...>) to see the trace\n";
    return ir(note, note);
  }
  std::string shapes;
  std::array<BasicTensor<T>, N> xs;
  for (std::size_t k = 0; k < N; ++k) {
    Shape& p = patterns[k];
    for (int a = 0; a < p.rank(); ++a) p[a] = p[a] == dyn ? 2 : p[a];
    xs[k] = zeros<T>(p);
    shapes += (k == 0 ? "" : " and ") + to_string(p);
  }
  const duet::detail::StepScope discarded;
  pijit::Trace trace;
  for (std::size_t k = 0; k < N; ++k) trace.add_input(xs[k], k);
  BasicTensor<T> y;
  {
    pijit::Tracing tracing(&trace);
    EagerScope eager;
    y = std::apply([&](const auto&... x) { return BasicTensor<T>(cell(x...)); }, xs);
  }
  const std::size_t out = trace.find(y);
  if (!trace.broken().empty() || out == trace.values().size()) {
    const std::string note = "  graph break, runs eagerly: " + trace.broken() + "\n";
    return ir(note, note);
  }
  const std::string traced_on = std::string("  traced on ") + (N == 1 ? "an input of shape " : "inputs of shapes ") +
                                shapes + "\n";
  std::string captured = traced_on + pijit::describe(trace.values(), trace.steps(), out);
  const pijit::Replay replay(std::move(trace), out, Config.jit_level);
  return ir(captured, traced_on + replay.describe());
}
}  // namespace detail

}  // namespace graph

namespace detail {
// Whether C's construct takes N + 1 tensors of its element type: graph_ir given N patterns
// would otherwise fail as "no matching function for call to construct" in the capture.
template <class C, std::size_t N>
constexpr bool takes_another_tensor() {
  return []<std::size_t... K>(std::index_sequence<K...>) {
    return requires(C& c, const BasicTensor<typename C::value_type>& x) { c.construct((void(K), x)..., x); };
  }(std::make_index_sequence<N>{});
}

template <JitConfig Config, class C, class... Patterns>
GraphIR graph_ir_of(C& cell, Patterns...) {
  cell.ensure_named();
  const std::string title = cell.type_name();
  const std::array<Shape, sizeof...(Patterns)> shapes{Shape(Patterns::value)...};
  if constexpr (nn::RuntimeBuilt<C>) {
    return graph::detail::traced_ir<Config>(cell, title, shapes, "built at run time, so graph mode runs it as a traced graph (PIJit)");
  } else {
    // The form the network's layers are set to (set_train), as a call would run.
    return pipeline::in_requested_phase(
        [&](auto phase) {
          return [&]<std::size_t... K>(std::index_sequence<K...>) {
            return cell(graph::input<typename C::value_type, graph::pattern_in_phase<decltype(phase)::value, Patterns>, K>()...);
          }(std::index_sequence_for<Patterns...>{});
        },
        [&](const auto& captured) {
          if (!captured.ambiguity.empty()) {
            return graph::detail::traced_ir<Config>(
                cell, title, shapes,
                "ambiguous capture, so it runs as a traced graph (PIJit), not as a static graph: " +
                    captured.ambiguity.str());
          }
          auto optimized = passes::optimize<Config>(captured);
          return GraphIR{graph::dump(captured, title), graph::dump(optimized, title)};
        });
  }
}
}  // namespace detail

// The graph of cell for inputs of the given pattern (duet::shape<dyn, 1, 28, 28>, say; by
// default an input of unknown shape, as when a runtime tensor is passed), optimised at the
// jit level of Config; for a construct of several tensors, a pattern for each
// (graph_ir(net, shape<dyn, 8>, shape<dyn, 4>)), each of the cell's element type. Where graph mode has no static graph to run, graph_ir shows the trace
// that runs instead: for a capture that is ambiguous (README, Guarantees: "Shared values in
// graph mode") and for a network built at run time (nn::DynamicSequentialCell, a class
// deriving from nn::DynamicCell), which has no construct to capture.
template <JitConfig Config, class C, class Pattern = graph::AnyShape, class... More>
GraphIR graph_ir(C& cell, Pattern = {}, More...) {
  // A tensor here failed deep inside with "'value' is not a member of BasicTensor".
  if constexpr (!(requires { Shape(Pattern::value); } && ... && requires { Shape(More::value); })) {
    static_assert((requires { Shape(Pattern::value); } && ... && requires { Shape(More::value); }),
                  "duet::graph_ir(net, pattern): the pattern is an input shape written as a type, "
                  "duet::shape<duet::dyn, 784> (duet::dyn: any size), not a tensor");
    return {};
  } else if constexpr (detail::takes_another_tensor<C, 1 + sizeof...(More)>()) {
    static_assert(!detail::takes_another_tensor<C, 1 + sizeof...(More)>(),
                  "duet::graph_ir(net, patterns...): construct takes more tensors than patterns were given; "
                  "give one for each, graph_ir(net, shape<dyn, 8>, shape<dyn, 4>)");
    return {};
  } else {
    return detail::graph_ir_of<Config>(cell, Pattern{}, More{}...);
  }
}

// At the level graph mode compiles the cell at: its own JitConfig (nn::Cell<Net, JitConfig{...}>),
// else the default. It showed the default level's graph for a cell compiled at O0.
template <class C, class Pattern = graph::AnyShape, class... More>
GraphIR graph_ir(C& cell, Pattern pattern = {}, More... more) {
  return graph_ir<nn::detail::graph_config_of<C>()>(cell, pattern, more...);
}

// What graph mode runs: std::cout << duet::graph_ir(net, duet::shape<duet::dyn, 784>).
inline std::ostream& operator<<(std::ostream& os, const GraphIR& ir) { return os << ir.optimized.text; }

}  // namespace duet
