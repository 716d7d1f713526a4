// Execution modes and the global context (MindSpore's set_context).
#pragma once

#include <atomic>
#include <optional>
#include <utility>

#include "error.hpp"

namespace duet {

enum class Mode : unsigned char {
  graph,     // MindSpore GRAPH_MODE: capture construct as a static graph, optimise, evaluate once
  pynative,  // MindSpore PYNATIVE_MODE: evaluate each cell as it is called
  context,   // follow the global context at call time
};

inline constexpr Mode GRAPH_MODE = Mode::graph;
inline constexpr Mode PYNATIVE_MODE = Mode::pynative;
inline constexpr Mode CONTEXT_MODE = Mode::context;

// Fields left empty keep their current value, so set_context({.mode = GRAPH_MODE}) changes
// the mode and nothing else.
struct ContextConfig {
  std::optional<Mode> mode;
};

struct Context {
  Mode mode = PYNATIVE_MODE;
};

namespace detail {
// Read on every call of a context-following cell; atomic so threads may switch it freely.
inline std::atomic<Mode>& context_mode() {
  static std::atomic<Mode> mode{PYNATIVE_MODE};
  return mode;
}
}  // namespace detail

inline void set_context(const ContextConfig& config) {
  if (config.mode) {
    // CONTEXT_MODE is what a cell follows, not a mode the context can be in.
    if (*config.mode != GRAPH_MODE && *config.mode != PYNATIVE_MODE) {
      throw ValueError("duet::set_context: mode must be GRAPH_MODE or PYNATIVE_MODE");
    }
    detail::context_mode().store(*config.mode, std::memory_order_relaxed);
  }
}

namespace detail {
// Set while a cell runs in PyNative mode: the cells it calls follow it, not the global
// context, so one call is never half eager and half compiled (a thread switching the context
// meanwhile, or a parent fixed to PYNATIVE_MODE over children that follow the context).
inline bool& eager_call_in_progress() {
  thread_local bool active = false;
  return active;
}
}  // namespace detail

// Marks the current thread as inside an eager call for its lifetime.
class EagerScope {
 public:
  EagerScope() : outer_(std::exchange(detail::eager_call_in_progress(), true)) {}
  EagerScope(const EagerScope&) = delete;
  EagerScope& operator=(const EagerScope&) = delete;
  ~EagerScope() { detail::eager_call_in_progress() = outer_; }

 private:
  bool outer_;
};

inline Context get_context() { return Context{detail::context_mode().load(std::memory_order_relaxed)}; }

// The mode a cell declared with `declared` runs in right now.
inline Mode effective_mode(Mode declared) {
  if (declared != CONTEXT_MODE) return declared;
  if (detail::eager_call_in_progress()) return PYNATIVE_MODE;
  return detail::context_mode().load(std::memory_order_relaxed);
}

}  // namespace duet
