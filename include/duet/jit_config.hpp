// JitConfig: how graph mode compiles a function or cell (MindSpore's mindspore.JitConfig).
#pragma once

#include <string>
#include <string_view>

#include "error.hpp"

namespace duet {

// Optimisation level. O0 runs the captured graph kernel by kernel (views are still aliases and
// nothing is dispatched or allocated per node); O1 adds fusion of elementwise chains and of
// bias/activation epilogues into the products; O2 also keeps each product's weight packed
// between calls (packed again only after the weight is written), which spares a batched
// forward pass the packing of every weight. All three give the same numbers.
enum class JitLevel : unsigned char { O0, O1, O2 };

// How much of C++ a jitted function may use. strict: anything that is not a graph operation
// (a host callback) is a compile error; lax: it becomes a host node, a graph break that runs
// eagerly between the compiled parts.
enum class JitSyntaxLevel : unsigned char { strict, lax };

// sink: the whole graph is one compiled call (one arena, slots reused); no_sink: node by node,
// each node's output in its own buffer; automatic: sink.
enum class ExecMode : unsigned char { automatic, sink, no_sink };

// debug: every node's output is checked for NaN and infinity, and a failing run-time check
// names the node and the function or construct it was captured from.
enum class DebugLevel : unsigned char { release, debug };

// A structural type, so that jit<JitConfig{...}> makes the configuration part of the program:
// it changes which passes run and what the evaluator checks.
struct JitConfig {
  JitLevel jit_level = JitLevel::O1;
  ExecMode exec_mode = ExecMode::automatic;
  JitSyntaxLevel jit_syntax_level = JitSyntaxLevel::lax;
  DebugLevel debug_level = DebugLevel::release;

  // MindSpore's spellings: parse("O2", "auto", "STRICT", "RELEASE"). Unknown values throw
  // duet::ValueError at run time, and do not compile in a constant expression.
  static constexpr JitConfig parse(std::string_view jit_level, std::string_view exec_mode = "auto",
                                   std::string_view jit_syntax_level = "LAX", std::string_view debug_level = "RELEASE") {
    JitConfig c;
    c.jit_level = jit_level == "O0"   ? JitLevel::O0
                  : jit_level == "O1" ? JitLevel::O1
                  : jit_level == "O2" ? JitLevel::O2
                                      : invalid<JitLevel>("jit_level", jit_level, "O0, O1 or O2");
    c.exec_mode = exec_mode == "auto"      ? ExecMode::automatic
                  : exec_mode == "sink"    ? ExecMode::sink
                  : exec_mode == "no_sink" ? ExecMode::no_sink
                                           : invalid<ExecMode>("exec_mode", exec_mode, "auto, sink or no_sink");
    c.jit_syntax_level = jit_syntax_level == "STRICT" ? JitSyntaxLevel::strict
                         : jit_syntax_level == "LAX"  ? JitSyntaxLevel::lax
                                                      : invalid<JitSyntaxLevel>("jit_syntax_level", jit_syntax_level,
                                                                                "STRICT or LAX");
    c.debug_level = debug_level == "RELEASE" ? DebugLevel::release
                    : debug_level == "DEBUG" ? DebugLevel::debug
                                             : invalid<DebugLevel>("debug_level", debug_level, "RELEASE or DEBUG");
    return c;
  }

  friend constexpr bool operator==(const JitConfig&, const JitConfig&) = default;

 private:
  template <class E>
  static constexpr E invalid(std::string_view field, std::string_view value, std::string_view allowed) {
    throw ValueError("duet::JitConfig: " + std::string(field) + " must be " + std::string(allowed) + ", got '" +
                     std::string(value) + "'");
  }
};

inline constexpr JitLevel O0 = JitLevel::O0;
inline constexpr JitLevel O1 = JitLevel::O1;
inline constexpr JitLevel O2 = JitLevel::O2;

}  // namespace duet
