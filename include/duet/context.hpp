// Execution modes and the global context (MindSpore's set_context).
#pragma once

#include <atomic>
#include <cstdlib>
#include <string_view>
#include <optional>
#include <utility>

#include "error.hpp"
#include "threads.hpp"

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
// Every field has an initializer, so that g++ -Wextra accepts designated initialisers that
// name only some of them.
struct ContextConfig {
  std::optional<Mode> mode = std::nullopt;
  // false turns every duet::jit function into plain PyNative execution, for debugging; the
  // environment variable DUET_JIT=0 sets it at start-up.
  std::optional<bool> jit_enabled = std::nullopt;
  // The threads duet's operations may use in all (duet::set_num_threads, threads.hpp).
  std::optional<int> num_threads = std::nullopt;
};

struct Context {
  Mode mode = PYNATIVE_MODE;
  bool jit_enabled = true;
  int num_threads = 1;
};

namespace detail {
// Read on every call of a context-following cell; atomic so threads may switch it freely.
inline std::atomic<Mode>& context_mode() {
  static std::atomic<Mode> mode{PYNATIVE_MODE};
  return mode;
}
// Hooks registered on any cell. Graph capture and PIJit replay look for hooks in their cells
// only while this is above zero, so hooks cost nothing when nobody uses them.
inline std::atomic<long>& live_hook_count() {
  static std::atomic<long> count{0};
  return count;
}
inline std::atomic<bool>& jit_enabled() {
  static std::atomic<bool> enabled{[] {
    const char* env = std::getenv("DUET_JIT");
    return env == nullptr || std::string_view(env) != "0";
  }()};
  return enabled;
}
}  // namespace detail

// Every field is checked before any is applied: a refused call changes nothing.
inline void set_context(const ContextConfig& config) {
  if (config.num_threads) detail::checked_num_threads(*config.num_threads, "duet::set_context: num_threads");
  if (config.mode) {
    // CONTEXT_MODE is what a cell follows, not a mode the context can be in.
    if (*config.mode != GRAPH_MODE && *config.mode != PYNATIVE_MODE) {
      throw ValueError("duet::set_context: mode must be GRAPH_MODE or PYNATIVE_MODE");
    }
    detail::context_mode().store(*config.mode, std::memory_order_relaxed);
  }
  if (config.jit_enabled) detail::jit_enabled().store(*config.jit_enabled, std::memory_order_relaxed);
  if (config.num_threads) detail::num_threads_storage().store(*config.num_threads, std::memory_order_relaxed);
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

inline Context get_context() {
  return Context{detail::context_mode().load(std::memory_order_relaxed),
                 detail::jit_enabled().load(std::memory_order_relaxed), get_num_threads()};
}

// The mode a cell declared with `declared` runs in right now.
inline Mode effective_mode(Mode declared) {
  if (declared != CONTEXT_MODE) return declared;
  if (detail::eager_call_in_progress()) return PYNATIVE_MODE;
  return detail::context_mode().load(std::memory_order_relaxed);
}

}  // namespace duet
