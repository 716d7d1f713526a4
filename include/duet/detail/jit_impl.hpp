// The definitions of jit.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::detail {

DUET_DETAIL_COMPILED void jit_log(std::string line) {
  auto& stats = jit_stats();
  std::lock_guard lock(stats.mutex);
  stats.log.push_back(std::move(line));
}

DUET_DETAIL_COMPILED void log_ambiguous_capture(const std::string& who, const std::string& why,
                                                const std::string& instead) {
  auto& stats = jit_stats();
  std::lock_guard lock(stats.mutex);
  if (!stats.ambiguities_logged.insert(who + '\n' + why + '\n' + instead).second) return;
  const bool explained = !stats.ambiguities_explained.insert(who + '\n' + why).second;
  stats.log.push_back(who + ": runs " + instead + ", not as a static graph: " +
                      (explained ? std::string("its capture is ambiguous, as logged above")
                                 : "at capture, " + why +
                                       ", which their types cannot tell apart (README, Guarantees: \"Shared values in "
                                       "graph mode\")"));
  // Graph mode quietly not being the static graph is what a user measuring it should hear of
  // (its numbers are right either way): once per construct and reason, on std::cerr.
  if (!explained) std::cerr << "duet: warning: " << stats.log.back() << '\n';
}

DUET_DETAIL_COMPILED void log_not_compiled(const std::string& line) {
  auto& stats = jit_stats();
  std::lock_guard lock(stats.mutex);
  if (!stats.not_compiled_logged.insert(line).second) return;
  stats.log.push_back(line);
  std::cerr << "duet: warning: " << line << '\n';
}

DUET_DETAIL_COMPILED JitBase::JitBase(JitOptions options, std::size_t max_compiled_forms, RecompilePolicy on_limit)
    : options_(std::move(options)), state_(std::make_shared<State>()), limit_(max_compiled_forms), on_limit_(on_limit) {
  if (options_.name.empty()) options_.name = "jit function #" + std::to_string(++jit_stats().functions);
}

DUET_DETAIL_COMPILED void JitBase::admit(std::uint64_t number, const std::string& reason) const {
  if (compiles_frozen()) {
    throw RecompileError(options_.name + ": compiles are frozen (duet::freeze_compiles), and this call would compile " +
                         "form #" + std::to_string(number) + ": " + reason);
  }
  if (limit_ == 0 || number <= limit_) return;
  const std::string text = options_.name + ": compile #" + std::to_string(number) +
                           " exceeds max_compiled_forms = " + std::to_string(limit_) + ": " + reason;
  if (on_limit_ == RecompilePolicy::raise) {
    throw RecompileError(text);
  } else if (!state_->warned.exchange(true)) {
    jit_log("warning: " + text);
  }
}

DUET_DETAIL_COMPILED void JitBase::count_compile(const std::string& reason, const std::string& note) {
  // Reserved by compare-and-swap: the caches of two argument lists have their own locks, so
  // two of this function's forms may be compiled at once, and the limit must hold for both.
  std::uint64_t number = state_->compiles.load();
  do {
    admit(number + 1, reason);
  } while (!state_->compiles.compare_exchange_weak(number, number + 1));
  ++number;
  jit_stats().compiles.fetch_add(1);
  jit_log(options_.name + ": compile #" + std::to_string(number) + ": " + reason +
          (note.empty() ? "" : " (" + note + ")"));
}

DUET_DETAIL_COMPILED std::shared_ptr<const pijit::Replay> JitBase::replay_of(pijit::Trace&& trace, std::size_t out,
                                                                             JitLevel level, DebugLevel debug,
                                                                             std::string& note) const {
  std::string broken = trace.broken();
  if (broken.empty() && out == trace.values().size()) broken = "the function returns a value no duet operation made";
  std::shared_ptr<const pijit::Replay> replay;
  note = "graph break, runs eagerly: " + broken;
  if (broken.empty()) {
    replay = std::make_shared<pijit::Replay>(std::move(trace), out, level,
                                             debug == DebugLevel::debug ? options_.name : std::string());
    note = "traced " + std::to_string(replay->traced_steps()) + " operations, replays " +
           std::to_string(replay->steps()) + " steps: " + replay->step_names();
  }
  return replay;
}

}  // namespace duet::detail
