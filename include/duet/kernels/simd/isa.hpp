// Which instruction set the kernels run on, chosen at run time.
//
// Every kernel is compiled for AVX-512, for AVX2 + FMA and for a baseline (SSE2 on x86-64) in
// the same program, whatever -march the program is built with (simd/arch.hpp), and one is
// chosen once, from what the CPU reports (cpuid), as libtorch, oneDNN and OpenBLAS do: a
// program built without -march=native runs the kernels a native build runs.
//
// DUET_ISA=avx2 or DUET_ISA=baseline (read once, on the first product) forces a lower set, so
// that every path can be tested on one machine; DUET_ISA=avx512 asks for the highest. A value
// the CPU cannot run, or an unknown one, is a duet::ValueError from that first product rather
// than a quiet fallback: a run asked to test a path must not test another.
#pragma once

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>

#include "../../error.hpp"

namespace duet::kernels {

// Ordered: a higher set runs on a CPU only if the CPU also runs the lower ones.
enum class Isa : unsigned char { baseline, avx2, avx512 };

inline constexpr std::array<Isa, 3> all_isas = {Isa::baseline, Isa::avx2, Isa::avx512};

inline constexpr std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::baseline: break;
  }
  return "baseline";
}

// Whether this CPU (and its operating system, which must save the wider registers) runs isa.
inline bool cpu_supports(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512:
      // The AVX-512 kernels are compiled for the subset every AVX-512 CPU since Skylake-SP has.
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && cpu_supports(Isa::avx2);
    case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::baseline: break;
  }
  return true;
#else
  return isa == Isa::baseline;
#endif
}

inline Isa best_supported_isa() {
  Isa best = Isa::baseline;
  for (Isa isa : all_isas) {
    if (cpu_supports(isa)) best = isa;
  }
  return best;
}

// isa, after checking that this CPU runs it; where says who asked, for the message.
inline Isa require_supported(Isa isa, std::string_view where) {
  if (!cpu_supports(isa)) {
    throw ValueError(std::string(where) + " asks for the " + std::string(isa_name(isa)) +
                     " kernels, but this CPU does not run them (the best it runs is " +
                     std::string(isa_name(best_supported_isa())) + ")");
  }
  return isa;
}

// The set named by name ("avx512", "avx2" or "baseline"), which this CPU must run.
inline Isa parse_isa(std::string_view name, std::string_view where) {
  for (Isa isa : all_isas) {
    if (name == isa_name(isa)) return require_supported(isa, where);
  }
  throw ValueError(std::string(where) + ": unknown instruction set '" + std::string(name) +
                   "' (expected avx512, avx2 or baseline)");
}

namespace detail {

// The set to start with, given the value of DUET_ISA (null or empty: the best the CPU runs).
inline Isa initial_isa(const char* forced) {
  if (forced == nullptr || *forced == '\0') return best_supported_isa();
  return parse_isa(forced, "DUET_ISA=" + std::string(forced));
}

inline std::atomic<Isa>& active_isa_storage() {
  static std::atomic<Isa> isa{initial_isa(std::getenv("DUET_ISA"))};
  return isa;
}

}  // namespace detail

// The set the kernels run on now.
inline Isa active_isa() { return detail::active_isa_storage().load(std::memory_order_relaxed); }

// Switches the kernels to isa, which this CPU must run (duet::ValueError otherwise). For tests
// and for measuring: call it while no kernel runs on another thread, since a product that has
// started finishes on the set it started on, and the next one may run on the new set.
inline void set_active_isa(Isa isa) {
  detail::active_isa_storage().store(require_supported(isa, "duet::kernels::set_active_isa"), std::memory_order_relaxed);
}

}  // namespace duet::kernels

namespace duet {

// Which kernels run: "avx512", "avx2" or "baseline".
inline std::string_view kernel_isa() { return kernels::isa_name(kernels::active_isa()); }

// Runs the kernels on the named set from now on (see kernels::set_active_isa).
inline void set_kernel_isa(std::string_view name) {
  kernels::detail::active_isa_storage().store(kernels::parse_isa(name, "duet::set_kernel_isa"), std::memory_order_relaxed);
}

}  // namespace duet
