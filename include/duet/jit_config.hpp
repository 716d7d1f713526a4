// JitConfig: how graph mode compiles a function or cell (MindSpore's mindspore.JitConfig).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "error.hpp"

namespace duet {

// Optimisation level. O0 runs the captured graph kernel by kernel (views are still aliases and
// nothing is dispatched or allocated per node); O1 adds fusion of elementwise chains and of
// bias/activation epilogues into the products and, in graphs that do not train, keeps each
// product's weight packed between calls (packed again only after the weight is written; the
// copy costs the weight's size again), which spares a batched forward pass the packing of
// every weight: 7 to 10 % of a batch of 64 on the seed network. O2 is O1: what MindSpore's O2
// adds, the whole graph sunk into one call, is ExecMode::sink here, the default at every
// level. All three give the same numbers.
enum class JitLevel : unsigned char { O0, O1, O2 };

// How much of C++ a jitted function (or a cell's construct) may use. strict: anything that is
// not a graph operation (a host callback) is a compile error; lax: it becomes a host node, a
// graph break that runs eagerly between the compiled parts; compatible, between the two (as
// MindSpore's COMPATIBLE is): only breaks marked duet::host<duet::allowed_break>.
enum class JitSyntaxLevel : unsigned char { strict, compatible, lax };

// sink: the whole graph is one compiled call (one arena, slots reused); no_sink: node by node,
// each node's output in its own buffer; automatic: sink.
enum class ExecMode : unsigned char { automatic, sink, no_sink };

// debug: every node's output is checked for NaN and infinity, and a failing run-time check
// names the node and the function or construct it was captured from.
enum class DebugLevel : unsigned char { release, debug };

// What a call does that would compile one form more than JitConfig::max_compiled_forms:
// raise throws duet::RecompileError; warn says so once in the compile log and compiles.
enum class RecompilePolicy : unsigned char { raise, warn };

// A structural type, so that jit<JitConfig{...}> makes the configuration part of the program:
// it changes which passes run and what the evaluator checks.
struct JitConfig {
  JitLevel jit_level = JitLevel::O1;
  ExecMode exec_mode = ExecMode::automatic;
  JitSyntaxLevel jit_syntax_level = JitSyntaxLevel::lax;
  DebugLevel debug_level = DebugLevel::release;
  // Compiled forms (input signatures) one jitted function may make; 0: any number. A limit
  // turns a recompilation storm, otherwise found only by its slowness, into an error naming
  // the argument that changed.
  std::size_t max_compiled_forms = 0;
  RecompilePolicy on_recompile_limit = RecompilePolicy::raise;

  // MindSpore's spellings: parse("O2", "auto", "STRICT", "RELEASE"), and the recompilation
  // limit in the same style: parse("O1", "auto", "LAX", "RELEASE", "4", "WARN"). Unknown values
  // throw duet::ValueError at run time, and do not compile in a constant expression.
  static constexpr JitConfig parse(std::string_view jit_level, std::string_view exec_mode = "auto",
                                   std::string_view jit_syntax_level = "LAX", std::string_view debug_level = "RELEASE",
                                   std::string_view max_compiled_forms = "0",
                                   std::string_view on_recompile_limit = "RAISE") {
    JitConfig c;
    c.jit_level = jit_level == "O0"   ? JitLevel::O0
                  : jit_level == "O1" ? JitLevel::O1
                  : jit_level == "O2" ? JitLevel::O2
                                      : invalid<JitLevel>("jit_level", jit_level, "O0, O1 or O2");
    c.exec_mode = exec_mode == "auto"      ? ExecMode::automatic
                  : exec_mode == "sink"    ? ExecMode::sink
                  : exec_mode == "no_sink" ? ExecMode::no_sink
                                           : invalid<ExecMode>("exec_mode", exec_mode, "auto, sink or no_sink");
    c.jit_syntax_level = jit_syntax_level == "STRICT"       ? JitSyntaxLevel::strict
                         : jit_syntax_level == "COMPATIBLE" ? JitSyntaxLevel::compatible
                         : jit_syntax_level == "LAX"        ? JitSyntaxLevel::lax
                                                            : invalid<JitSyntaxLevel>("jit_syntax_level", jit_syntax_level,
                                                                                      "STRICT, COMPATIBLE or LAX");
    c.debug_level = debug_level == "RELEASE" ? DebugLevel::release
                    : debug_level == "DEBUG" ? DebugLevel::debug
                                             : invalid<DebugLevel>("debug_level", debug_level, "RELEASE or DEBUG");
    c.max_compiled_forms = count("max_compiled_forms", max_compiled_forms);
    c.on_recompile_limit = on_recompile_limit == "RAISE"  ? RecompilePolicy::raise
                           : on_recompile_limit == "WARN" ? RecompilePolicy::warn
                                                          : invalid<RecompilePolicy>("on_recompile_limit",
                                                                                     on_recompile_limit, "RAISE or WARN");
    return c;
  }

  friend constexpr bool operator==(const JitConfig&, const JitConfig&) = default;

 private:
  template <class E>
  static constexpr E invalid(std::string_view field, std::string_view value, std::string_view allowed) {
    throw ValueError("duet::JitConfig: " + std::string(field) + " must be " + std::string(allowed) + ", got '" +
                     std::string(value) + "'");
  }

  // A decimal count; std::from_chars is not constexpr in C++20, so the digits are read here.
  static constexpr std::size_t count(std::string_view field, std::string_view value) {
    if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
      return invalid<std::size_t>(field, value, "a count of forms (0: any)");
    }
    std::size_t n = 0;
    for (char c : value) n = n * 10 + static_cast<std::size_t>(c - '0');
    return n;
  }
};

inline constexpr JitLevel O0 = JitLevel::O0;
inline constexpr JitLevel O1 = JitLevel::O1;
inline constexpr JitLevel O2 = JitLevel::O2;

}  // namespace duet
