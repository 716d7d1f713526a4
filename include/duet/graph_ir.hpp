// graph_ir: what graph mode made of a cell, as text and as Graphviz DOT, before and after the
// passes (MindSpore users get this from save_graphs).
#pragma once

#include <boost/hana/at.hpp>
#include <cstddef>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "cell.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "passes.hpp"
#include "pipeline.hpp"

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
    const auto& op = boost::hana::at_c<I>(program.graph.nodes).op;
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
  text << "  return %" << Out << "\n}\n";
  dot << "}\n";
  return {text.str(), dot.str()};
}

}  // namespace graph

// The graph of cell for inputs of the given pattern (duet::shape<dyn, 1, 28, 28>, say; by
// default an input of unknown shape, as when a runtime tensor is passed), optimised at the
// jit level of Config.
template <JitConfig Config = JitConfig{}, class C, class Pattern = graph::AnyShape>
GraphIR graph_ir(C& cell, Pattern = {}) {
  if constexpr (nn::RuntimeBuilt<C>) {
    static_assert(!nn::RuntimeBuilt<C>,
                  "duet::graph_ir: a network built at run time (nn::DynamicSequentialCell, or a class deriving "
                  "from nn::DynamicCell) has no construct to capture; graph mode traces it on its first call, "
                  "and duet::jit_compile_log() says what the trace became");
    return {};
  } else {
    cell.ensure_named();
    const std::string title = cell.type_name();
    // The form the network's layers are set to (set_train), as a call would run.
    return pipeline::in_requested_phase(
        [&](auto phase) {
          using In = graph::pattern_in_phase<decltype(phase)::value, Pattern>;
          return cell(graph::input<typename C::value_type, In>());
        },
        [&](const auto& captured) {
          return GraphIR{graph::dump(captured, title), graph::dump(passes::optimize<Config>(captured), title)};
        });
  }
}

}  // namespace duet
