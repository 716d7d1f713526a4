// jit: a function of tensors compiled into a static graph, whatever the global context
// (MindSpore's mindspore.jit and JitConfig).
//
//   auto run_with_jit = duet::jit(run);                                   // function transform
//   auto run = duet::jit([&](auto x) { return model(x); });               // decorator form
//   auto plain = duet::jit<duet::JitConfig{.jit_level = duet::O0}>(run);  // with a configuration
//   struct Net : nn::Cell<Net, duet::JitConfig{}> {...};                  // jit on construct
//
// Calling a jitted function captures it on symbolic tensors (a compile-time graph), checks and
// optimises the graph at the JitConfig's level, and runs it in one evaluator call. The run-time
// half of compiling (a "compiled form": the plan for the input shapes) is made once per input
// signature, and counted: each jitted function and the program keep a compile count and a log
// saying why each recompilation happened.
//
// The signature of a call is the dtype and shape of each tensor argument (its input_signature
// pattern instead, when one is given: a dynamic dimension then means one compiled form for all
// its sizes), the value of each other argument (unless wrapped in duet::mutable_), and the
// current values of the hash_args.
//
// The recompilation contract: JitConfig::max_compiled_forms bounds the forms of one function
// (RecompileError or a warning, as JitConfig::on_recompile_limit says), freeze_compiles() makes
// every later compilation an error, and f.precompile(TensorSpec...) compiles a form ahead of
// its first call.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "config.hpp"
#include "context.hpp"
#include "detail/demangle.hpp"
#include "error.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "host.hpp"
#include "jit_config.hpp"
#include "passes.hpp"
#include "pijit.hpp"
#include "pipeline.hpp"
#include "tape.hpp"
#include "tensor.hpp"

namespace duet {

// PSJit: the compile-time static graph. PIJit: a trace of a network built at run time (see
// pijit.hpp), captured on the first call for each input shape and replayed.
enum class JitMode : unsigned char { PSJit, PIJit };

// What input_signature says of one tensor argument; duet::dyn in shape for any size.
struct TensorSpec {
  DType dtype = float32;
  Shape shape = {};
};

// A non-tensor argument whose value is not part of the signature (MindSpore's mutable): a
// new value does not recompile.
template <class T>
struct Mutable {
  T value;
};
template <class T>
Mutable<std::decay_t<T>> mutable_(T&& value) {
  return {std::forward<T>(value)};
}

namespace detail {
template <class T>
std::uint64_t value_hash(const T& value) {
  if constexpr (requires { std::hash<T>{}(value); }) {
    return static_cast<std::uint64_t>(std::hash<T>{}(value));
  } else {
    static_assert(std::is_trivially_copyable_v<T>,
                  "duet::jit: a non-tensor argument or hash_arg must be hashable (std::hash) or trivially "
                  "copyable; wrap other arguments in duet::mutable_");
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    for (unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
    return h;
  }
}
}  // namespace detail

// A value the jitted function reads besides its arguments (a free variable): a change of it
// recompiles at the next call. It refers to the value, which must outlive the jitted function.
class HashArg {
 public:
  template <class T>
  explicit HashArg(const T& value) : hash_([&value] { return detail::value_hash(value); }) {}
  std::uint64_t hash() const { return hash_(); }

 private:
  std::function<std::uint64_t()> hash_;
};
template <class T>
HashArg hash_arg(const T& value) {
  return HashArg(value);
}

struct JitOptions {
  JitMode mode = JitMode::PSJit;
  std::vector<TensorSpec> input_signature = {};  // empty: any tensors
  std::vector<HashArg> hash_args = {};
  // Share compiled forms between every jitted function made from the same function type, so a
  // re-created one does not compile again. A risk if its free variables differ (as in MindSpore).
  bool compile_once = false;
  std::string name = {};  // for the recompile log; "jit function #n" by default
};

namespace detail {
struct JitStats {
  std::atomic<std::uint64_t> compiles{0};
  std::atomic<std::uint64_t> functions{0};
  std::mutex mutex;
  std::vector<std::string> log;
  std::set<std::string> ambiguities_logged;    // log_ambiguous_capture's
  std::set<std::string> ambiguities_explained;
  std::set<std::string> not_compiled_logged;  // log_not_compiled's
};
inline JitStats& jit_stats() {
  static JitStats stats;
  return stats;
}
DUET_DETAIL_COMPILED void jit_log(std::string line);

// Says in the log that `who` does not run as the static graph capture made and what runs
// instead, once per (who, why, instead): a loop of calls logs it once. The reason is spelled
// out the first time only: one network met in forward, gradient and training-step paths is one
// ambiguity, not three paragraphs.
DUET_DETAIL_COMPILED void log_ambiguous_capture(const std::string& who, const std::string& why,
                                                const std::string& instead);

// Says in the log, and on std::cerr, once per process, that graph mode runs something on
// PyNative's tape instead (the same bits, the speed of the other mode): what a user measuring
// graph mode should hear of.
DUET_DETAIL_COMPILED void log_not_compiled(const std::string& line);

inline std::atomic<bool> compiles_frozen_flag{false};
}  // namespace detail

// For serving: after freeze_compiles(), every compilation (a jitted function's new form, a
// PIJit trace, a runtime-built cell traced in graph mode on its first call) throws
// duet::RecompileError saying what would have compiled and why. Forms compiled before run as
// ever. A static graph (Cell<...>) is compiled with the program and is not concerned; its plan
// for a new input shape is not a compilation either.
inline void freeze_compiles() { detail::compiles_frozen_flag.store(true, std::memory_order_release); }
inline void unfreeze_compiles() { detail::compiles_frozen_flag.store(false, std::memory_order_release); }
inline bool compiles_frozen() { return detail::compiles_frozen_flag.load(std::memory_order_acquire); }

// Compiles frozen for a scope (a test, a serving loop), then as they were before it.
class FrozenCompiles {
 public:
  FrozenCompiles() : was_frozen_(detail::compiles_frozen_flag.exchange(true, std::memory_order_acq_rel)) {}
  ~FrozenCompiles() { detail::compiles_frozen_flag.store(was_frozen_, std::memory_order_release); }
  FrozenCompiles(const FrozenCompiles&) = delete;
  FrozenCompiles& operator=(const FrozenCompiles&) = delete;

 private:
  bool was_frozen_;
};

// Compilations of every jitted function so far.
inline std::uint64_t jit_compile_count() { return detail::jit_stats().compiles.load(); }

// One line per compilation, in order: which function, its compile number, and why; one when
// a PIJit trace is set aside because a cell in it has a hook now; and a "warning: " line when a
// function passes its max_compiled_forms under RecompilePolicy::warn.
inline std::vector<std::string> jit_compile_log() {
  auto& s = detail::jit_stats();
  std::lock_guard lock(s.mutex);
  return s.log;
}

namespace detail {

template <class X>
inline constexpr bool is_tensor_argument_v = is_tensor_v<std::remove_cvref_t<X>> || is_static_tensor_v<std::remove_cvref_t<X>>;

template <class X>
inline constexpr bool is_mutable_v = false;
template <class T>
inline constexpr bool is_mutable_v<Mutable<T>> = true;

// Position of argument I among the tensor arguments.
template <std::size_t I, class... Args>
constexpr std::size_t tensor_index() {
  constexpr std::array<bool, sizeof...(Args)> is_tensor{is_tensor_argument_v<Args>...};
  std::size_t k = 0;
  for (std::size_t i = 0; i < I; ++i) k += is_tensor[i] ? 1 : 0;
  return k;
}

template <class... Args>
constexpr std::size_t tensor_count() {
  return (std::size_t{0} + ... + (is_tensor_argument_v<Args> ? 1 : 0));
}

// What makes two calls share a compiled form.
template <std::size_t N>
struct Signature {
  std::array<DType, N> dtypes{};
  std::array<Shape, N> shapes{};
  std::array<std::uint64_t, N> values{};
  std::vector<std::uint64_t> hash_args;
  friend bool operator==(const Signature&, const Signature&) = default;
};

template <std::size_t N>
std::string why_recompiled(const Signature<N>& before, const Signature<N>& now) {
  for (std::size_t i = 0; i < N; ++i) {
    if (before.dtypes[i] != now.dtypes[i]) {
      return "argument " + std::to_string(i) + " dtype " + std::string(name_of(before.dtypes[i])) + " -> " +
             std::string(name_of(now.dtypes[i]));
    }
    if (!(before.shapes[i] == now.shapes[i])) {
      return "argument " + std::to_string(i) + " shape " + to_string(before.shapes[i]) + " -> " +
             to_string(now.shapes[i]);
    }
    if (before.values[i] != now.values[i]) return "argument " + std::to_string(i) + " (a value) changed";
  }
  for (std::size_t i = 0; i < now.hash_args.size(); ++i) {
    if (i >= before.hash_args.size() || before.hash_args[i] != now.hash_args[i]) {
      return "hash_args[" + std::to_string(i) + "] changed";
    }
  }
  return "a new signature";
}

// Compiled forms of one function for one list of argument types.
template <std::size_t N>
struct CompileCache {
  struct Entry {
    Signature<N> signature;
    std::uint64_t owner;  // keys the plans of this compiled form
    // PIJit: the replayable trace, or null when the trace broke and the function runs eagerly.
    std::shared_ptr<const pijit::Replay> replay;
  };
  std::shared_mutex mutex;
  std::deque<Entry> entries;  // a deque: an entry does not move when others are added
};

// The part of a jitted function that does not depend on the function: its options, its
// compiled forms and the recompilation contract. A base of its own, so that this code is
// compiled once, not once per jitted function type (each cell has a few).
class JitBase {
 public:
  // Compilations of this function (of every function of its type, with compile_once).
  std::uint64_t compile_count() const { return state_->compiles.load(); }
  const std::string& name() const { return options_.name; }

 protected:
  struct State {
    std::atomic<std::uint64_t> compiles{0};
    std::atomic<bool> warned{false};  // RecompilePolicy::warn says it once
    std::mutex mutex;
    std::vector<std::pair<std::type_index, std::shared_ptr<void>>> caches;
  };

  JitBase(JitOptions options, std::size_t max_compiled_forms, RecompilePolicy on_limit);

  // Entries are never removed, so a pointer to one stays valid once the lock is released.
  template <std::size_t N>
  static const typename CompileCache<N>::Entry* find(CompileCache<N>& cache, const Signature<N>& s) {
    for (const auto& e : cache.entries) {
      if (e.signature == s) return &e;
    }
    return nullptr;
  }

  template <std::size_t N>
  static std::string why_compiled(const CompileCache<N>& cache, const Signature<N>& s) {
    return cache.entries.empty() ? std::string("first call") : why_recompiled(cache.entries.back().signature, s);
  }

  // The recompilation contract, asked before form `number` is made: refused while compiles are
  // frozen, and past max_compiled_forms as on_recompile_limit says.
  void admit(std::uint64_t number, const std::string& reason) const;

  template <std::size_t N>
  const typename CompileCache<N>::Entry& compile(CompileCache<N>& cache, const Signature<N>& s,
                                                          const std::string& reason,
                                                          std::shared_ptr<const pijit::Replay> replay,
                                                          const std::string& note = {}) {
    count_compile(reason, note);
    cache.entries.push_back({s, duet::detail::new_plan_owner(), std::move(replay)});
    return cache.entries.back();
  }

  // A compile's number taken and logged: what compile<N> does whatever N.
  void count_compile(const std::string& reason, const std::string& note);

  template <std::size_t N>
  CompileCache<N>& compile_cache() {
    using Cache = CompileCache<N>;
    std::lock_guard lock(state_->mutex);
    const std::type_index key(typeid(Cache));
    for (auto& [type, cache] : state_->caches) {
      if (type == key) return *static_cast<Cache*>(cache.get());
    }
    state_->caches.emplace_back(key, std::make_shared<Cache>());
    return *static_cast<Cache*>(state_->caches.back().second.get());
  }

  // PIJit's compilation once the function has run under `trace` and returned value `out`: the
  // replay (checking every step's output, under DebugLevel::debug), or null when the trace
  // broke and the function runs eagerly.
  template <std::size_t N>
  std::shared_ptr<const pijit::Replay> kept(CompileCache<N>& cache, const Signature<N>& s, const std::string& reason,
                                            pijit::Trace&& trace, std::size_t out, JitLevel level, DebugLevel debug) {
    std::string note;
    std::shared_ptr<const pijit::Replay> replay = replay_of(std::move(trace), out, level, debug, note);
    compile(cache, s, reason, replay, note);
    return replay;
  }

  // kept's replay, whatever N, and what the compile log says of it in `note`.
  std::shared_ptr<const pijit::Replay> replay_of(pijit::Trace&& trace, std::size_t out, JitLevel level,
                                                 DebugLevel debug, std::string& note) const;

  // What follows depends on the argument types only: shared by every function called with them.
  template <class X>
  static decltype(auto) argument(const X& x) {
    if constexpr (is_tensor_argument_v<X>) return tensor_of(x);
    else if constexpr (is_mutable_v<X>) return (x.value);
    else return (x);
  }

  template <class... Args>
  void check_signature(const Args&... args) const {
    const auto& specs = options_.input_signature;
    if (specs.empty()) return;
    constexpr std::size_t tensors = tensor_count<Args...>();
    if (specs.size() != tensors) {
      throw ValueError(options_.name + ": input_signature describes " + std::to_string(specs.size()) +
                       " tensors, the call passes " + std::to_string(tensors));
    }
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (check_one<tensor_index<I, Args...>()>(args), ...);
    }(std::index_sequence_for<Args...>{});
  }

  template <std::size_t K, class X>
  void check_one(const X& x) const {
    if constexpr (is_tensor_argument_v<X>) {
      const TensorSpec& spec = options_.input_signature[K];
      const auto& t = tensor_of(x);
      if (t.dtype() != spec.dtype || !graph::fits(spec.shape, t.shape())) {
        throw ShapeError(options_.name + ": input_signature says tensor " + std::to_string(K) + " is " +
                         std::string(name_of(spec.dtype)) + " " + to_string(spec.shape) + ", got " +
                         std::string(name_of(t.dtype())) + " " + to_string(t.shape()));
      }
    }
  }

  template <class... Args>
  Signature<sizeof...(Args)> signature_of(const Args&... args) const {
    Signature<sizeof...(Args)> s;
    const auto all = std::forward_as_tuple(args...);
    graph::for_each_index<sizeof...(Args)>([&](auto i) {
      constexpr std::size_t I = decltype(i)::value;
      using X = std::tuple_element_t<I, std::tuple<Args...>>;
      if constexpr (is_tensor_argument_v<X>) {
        const auto& t = tensor_of(std::get<I>(all));
        s.dtypes[I] = t.dtype();
        // With an input_signature, the pattern (dynamic dimensions and all) is the key of a
        // static graph, which runs at every size the pattern admits; a PIJit replay runs at the
        // traced shapes only, so its key stays the shape (the signature still checks it).
        s.shapes[I] = options_.input_signature.empty() || options_.mode == JitMode::PIJit
                          ? t.shape()
                          : options_.input_signature[tensor_index<I, Args...>()].shape;
      } else if constexpr (is_mutable_v<X>) {
        // A replay runs the operations it traced with the numbers they were given, so under
        // PIJit a new value traces again (helper-91: f(x, mutable_(3.0f)) replayed 2.0f's
        // answer); PSJit reads it as an input of its graph.
        if (options_.mode == JitMode::PIJit) s.values[I] = value_hash(std::get<I>(all).value);
      } else {
        s.values[I] = value_hash(std::get<I>(all));
      }
    });
    s.hash_args.reserve(options_.hash_args.size());
    for (const HashArg& h : options_.hash_args) s.hash_args.push_back(h.hash());
    return s;
  }

  template <class T, class... Args>
  static BasicTensor<T> replayed(const pijit::Replay& replay, const Args&... args) {
    const auto tensors = std::tuple_cat(tensor_tuple(args)...);
    const auto inputs =
        std::apply([](const auto&... t) { return std::array<const void*, sizeof...(t)>{t.data()...}; }, tensors);
    const auto shapes = std::apply([](const auto&... t) { return std::array<Shape, sizeof...(t)>{t.shape()...}; }, tensors);
    return replay.template run<T>(inputs, shapes);
  }

  template <class X>
  static auto traced_argument(const X& x) {
    if constexpr (is_tensor_argument_v<X>) return BasicTensor<typename X::value_type>(tensor_of(x));
    else return argument(x);
  }

  template <class X>
  static void mark_input(pijit::Trace& trace, X& x, std::size_t& k) {
    if constexpr (is_tensor_v<X>) trace.add_input(x, k++);
  }

  template <class X>
  static auto tensor_tuple(const X& x) {
    if constexpr (is_tensor_argument_v<X>) return std::tuple<const BasicTensor<typename X::value_type>&>(tensor_of(x));
    else return std::tuple<>();
  }

  JitOptions options_;
  std::shared_ptr<State> state_;

 private:
  std::size_t limit_;
  RecompilePolicy on_limit_;
};

}  // namespace detail

template <JitConfig Config, class Fn>
class JitFunction : public detail::JitBase {
  using FnRef = std::remove_reference_t<Fn>;

 public:
  JitFunction(Fn fn, JitOptions options)
      : JitBase(std::move(options), Config.max_compiled_forms, Config.on_recompile_limit), fn_(std::forward<Fn>(fn)) {
    if (options_.compile_once) state_ = shared_state();
  }

  // Compiles the form for tensor arguments of these dtypes and shapes ahead of the first call,
  // so that call does not stall: by calling the function once on zeros, as the first call
  // would on its inputs (PIJit traces it; PSJit plans it, on this thread, and at O1 and O2
  // packs the weights). It counts toward max_compiled_forms and is refused while compiles are frozen; a
  // form already compiled is left as it is. What that call changes (a BatchNorm's moving
  // statistics in training, Dropout's generator) is put back, as for a step that does not
  // commit: the zeros leave no trace but the form. Every argument is a tensor of element type T.
  template <ElementType T = float, class... Specs>
    requires(std::same_as<Specs, TensorSpec> && ...)
  void precompile(const Specs&... specs) {
    if (!get_context().jit_enabled) return;  // nothing compiles
    std::size_t k = 0;
    const auto zeros_for = [&](const TensorSpec& spec) {
      if (spec.dtype != dtype_of<T> || !spec.shape.is_concrete()) {
        throw ValueError(options_.name + ": precompile<" + std::string(name_of(dtype_of<T>)) + "> takes concrete " +
                         std::string(name_of(dtype_of<T>)) + " shapes, got " + std::string(name_of(spec.dtype)) + " " +
                         to_string(spec.shape) + " for tensor " + std::to_string(k));
      }
      ++k;
      return zeros<T>(spec.shape);
    };
    const std::tuple<decltype(zeros<T>(specs.shape))...> inputs{zeros_for(specs)...};
    std::apply(
        [&](const auto&... x) {
          check_signature(x...);
          auto& cache = compile_cache<sizeof...(x)>();
          {
            std::shared_lock lock(cache.mutex);
            if (find(cache, signature_of(x...)) != nullptr) return;
          }
          const detail::StepScope discarded;
          (void)compiled(x...);
        },
        inputs);
  }

  template <class... Args>
  auto operator()(const Args&... args) {
    if constexpr ((graph::Symbolic<Args> || ...)) {
      // Called while an enclosing graph is captured (grad in graph mode, a jitted caller): the
      // function's nodes join that graph, which is compiled and differentiated as a whole.
      return fn_(argument(args)...);
    } else {
      return compiled(args...);
    }
  }

 private:
  template <class... Args>
  auto compiled(const Args&... args) {
    using Result = decltype(eager(args...));
    // A PyNative grad records operations as they run; a compiled call would hide them from it.
    if (!get_context().jit_enabled || autodiff::active_tape() != nullptr) return eager(args...);
    check_signature(args...);
    auto& cache = compile_cache<sizeof...(Args)>();
    const auto signature = signature_of(args...);
    const typename detail::CompileCache<sizeof...(Args)>::Entry* entry = nullptr;
    {
      std::shared_lock lock(cache.mutex);
      entry = find(cache, signature);
    }
    if (entry == nullptr) {
      // Concurrent first calls: one compiles, the others wait here and then find its form.
      std::unique_lock lock(cache.mutex);
      entry = find(cache, signature);
      if (entry == nullptr) {
        const std::string reason = why_compiled(cache, signature);
        if (options_.mode == JitMode::PIJit) {
          admit(state_->compiles.load() + 1, reason);  // before the trace runs the function for nothing
          return trace(cache, signature, reason, args...);
        }
        entry = &compile(cache, signature, reason, nullptr);
      }
    }
    if (options_.mode == JitMode::PIJit) {
      if (entry->replay == nullptr) return checked(eager(args...), "eagerly (a graph break)");
      if (entry->replay->cells_have_hooks()) {
        if (entry->replay->set_aside()) {
          detail::jit_log(options_.name + ": runs eagerly while a cell in it has a hook (hooks see values in "
                                          "PyNative mode only)");
        }
        return checked(eager(args...), "eagerly (a hook)");
      }
      return replayed<typename Result::value_type>(*entry->replay, args...);
    }
    if constexpr (Capturable<Args...>) {
      return Result(run_graph(entry->owner, args...));
    } else {
      throw ValueError(options_.name + ": the function is not generic over its tensors, so it cannot be captured "
                                       "as a static graph (PSJit); jit it with {.mode = JitMode::PIJit}");
    }
  }

  // DebugLevel::debug where a compiled function runs eagerly instead (a graph break, a hook, an
  // ambiguous capture) or under its trace: the result, since the operations that made it ran
  // as PyNative runs them, unchecked.
  template <class R>
  R checked(R y, const char* how) const {
    if constexpr (Config.debug_level == DebugLevel::debug) {
      duet::detail::check_finite(y.data(), y.shape(),
                                 "duet (debug): in " + options_.name + ", the result of a call run " + how + ": ");
    }
    return y;
  }

  // DUET_JIT=0 or set_context({.jit_enabled = false}): the function as plain PyNative code.
  template <class... Args>
  auto eager(const Args&... args) {
    EagerScope eager;
    auto y = fn_(argument(args)...);
    return BasicTensor<typename decltype(y)::value_type>(y);
  }

  // PIJit's compilation: run the function eagerly under a trace, keep the trace for replay.
  template <std::size_t N, class... Args>
  auto trace(detail::CompileCache<N>& cache, const detail::Signature<N>& s, const std::string& reason,
             const Args&... args) {
    pijit::Trace trace;
    auto inputs = std::make_tuple(traced_argument(args)...);
    std::size_t k = 0;
    std::apply([&](auto&... x) { (mark_input(trace, x, k), ...); }, inputs);
    auto y = [&] {
      pijit::Tracing tracing(&trace);
      EagerScope eager;
      return std::apply([&](const auto&... x) { return fn_(x...); }, inputs);
    }();
    using Result = BasicTensor<typename decltype(y)::value_type>;
    // The syntax level a static graph checks at compile time (graph::check_syntax_level), on the
    // host callbacks the trace met: it ran them once (a trace runs the function), and refuses
    // the function from here on rather than run it as a graph break (helper-91: it was not applied).
    if (Config.jit_syntax_level == JitSyntaxLevel::strict
            ? !trace.host_call().empty()
            : Config.jit_syntax_level == JitSyntaxLevel::compatible && trace.unmarked_host_call()) {
      throw ModeError(options_.name + ": JitSyntaxLevel::" +
                      (Config.jit_syntax_level == JitSyntaxLevel::strict ? "strict" : "compatible") +
                      ": the function " + trace.host_call() + ", which is not a graph operation" +
                      (Config.jit_syntax_level == JitSyntaxLevel::strict
                           ? "; use JitSyntaxLevel::lax to run it as a graph break"
                           : "; write duet::host<duet::allowed_break>(fn, x), or use JitSyntaxLevel::lax"));
    }
    const std::size_t out = trace.find(y);
    const auto replay = kept(cache, s, reason, std::move(trace), out, Config.jit_level, Config.debug_level);
    // A replay that folds a BatchNorm (evaluation, which changes no state) rounds differently
    // from the eager run that traced it: the traced call returns the replay's result too, so
    // that every call of this shape gives the same bits.
    if (replay != nullptr && replay->rounds_differently()) {
      return replayed<typename Result::value_type>(*replay, args...);
    }
    return checked(Result(y), "under its trace");
  }

  template <class... Args>
  auto run_graph(std::uint64_t owner, const Args&... args) {
    const auto capture = [&](auto phase) {
      auto captured = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return fn_(symbolic<I, Args...>(args, phase)...);
      }(std::index_sequence_for<Args...>{});
      using Captured = decltype(captured);
      static_assert(graph::Symbolic<Captured>, "duet::jit: the function must return a tensor computed from its inputs");
      using G = typename Captured::graph_type;
      graph::check_syntax_level<Config, G>();
      auto program = passes::optimize<Config>(captured);
      program.ambiguity = captured.ambiguity;  // the optimised graph cannot run either
      return program;
    };
    return pipeline::in_requested_phase(capture, [&](const auto& program) {
      if (!program.ambiguity.empty()) {
        detail::log_ambiguous_capture(options_.name, program.ambiguity.str(), "in PyNative mode");
        return checked(eager(args...), "in PyNative mode (an ambiguous capture)");
      }
      return std::apply(
          [&](const auto&... t) {
            return pipeline::execute<Config>(owner, program, [this] { return options_.name; }, t...);
          },
          std::tuple_cat(tensor_tuple(args)...));
    });
  }

  template <std::size_t I, class... Args, class X, graph::Phase P = graph::Phase::train>
  static decltype(auto) symbolic(const X& x, pipeline::PhaseConstant<P> = {}) {
    if constexpr (detail::is_tensor_argument_v<X>) {
      return graph::input<typename X::value_type, graph::pattern_in_phase<P, typename graph::pattern_of<X>::type>,
                          detail::tensor_index<I, Args...>()>();
    } else {
      return argument(x);
    }
  }

  // Whether graph capture can call fn on these arguments: fn is generic over its tensors.
  // Defined after symbolic: a static member's initializer only sees the members declared before it.
  template <class... Args>
  static constexpr bool Capturable = [] {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return requires(FnRef& f) { f(symbolic<I, Args...>(std::declval<const Args&>())...); };
    }(std::index_sequence_for<Args...>{});
  }();

  // What compile_once shares: one state per function type (and configuration).
  static std::shared_ptr<State> shared_state() {
    static const auto state = std::make_shared<State>();
    return state;
  }

  Fn fn_;
};

namespace detail {
// The jitted functions an object makes of itself on first use (a runtime-built cell's graph
// form, a cell's traced form), calling back into that object: one per function type. A moved
// object makes its own, so none calls into an object that has moved. Concurrent first uses
// make each once.
class OwnForms {
 public:
  OwnForms() = default;
  OwnForms(OwnForms&&) noexcept {}
  OwnForms& operator=(OwnForms&&) noexcept { return *this; }
  OwnForms(const OwnForms&) = delete;
  OwnForms& operator=(const OwnForms&) = delete;
  ~OwnForms() = default;

  template <class F, class Make>
  F& get(Make&& make) {
    std::lock_guard lock(mutex_);
    for (const auto& [type, form] : forms_) {
      if (type == typeid(F)) return *static_cast<F*>(form.get());
    }
    forms_.emplace_back(typeid(F), std::make_shared<F>(make()));
    return *static_cast<F*>(forms_.back().second.get());
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::type_index, std::shared_ptr<void>>> forms_;
};

// A call into an object, erased to its argument list. A jitted function of it is compiled once
// for every object type with that argument list (a traced form per cell type, with the whole
// jit machinery, is most of what a network costs to compile), and it is not generic over its
// tensors, so it is traced (PIJit), never captured as a second static graph.
template <class R, class... Args>
struct ErasedCall {
  void* self;
  R (*call)(void*, const Args&...);
  R operator()(const Args&... args) const { return call(self, args...); }
};
}  // namespace detail

// MindSpore's jit(fn, ...): fn is kept by reference if it is an lvalue, else moved in.
template <JitConfig Config = JitConfig{}, class Fn>
auto jit(Fn&& fn, JitOptions options = {}) {
  return JitFunction<Config, Fn>(std::forward<Fn>(fn), std::move(options));
}

}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/jit_impl.hpp"
#endif
