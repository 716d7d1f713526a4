#!/usr/bin/env bash
# Builds and tests duet the way CI does, one stage after another, and prints one line per
# stage with its elapsed time. With stage names as arguments, runs only those:
#   tools/check.sh                 every stage
#   tools/check.sh gcc             the quick local check
# Build trees go under $DUET_BUILD_ROOT (build-check), one per stage; DUET_JOBS (2) is the
# parallelism.
# Stages:
#   gcc     g++, include/, warnings as errors: the unit tests and the benchmarks compiled for
#           g++'s diagnostics only (DUET_DIAGNOSTICS_ONLY, -fsyntax-only: building the unit
#           tests twice, once per compiler, no longer fitted CI's 90 minutes; the clang stage
#           builds and runs them), examples (built -O2, as the README's command builds a
#           program, run, their outputs compared: the modes' agreement in g++'s optimised code;
#           -O3, CMake's Release, took a third longer to compile the seed example, 40.3 against
#           30.0 s), the other test programs
#           (threads, heap allocations, ONNX, MPI; at -O0, DUET_TEST_OPTIMIZATION: they test
#           behaviour, the examples g++'s optimiser; -O1 doubled io_onnx.cpp's 84 s), compile-fail
#           (the failing programs: their twins that must compile are the clang stage's, where
#           they take a third of g++'s time), install
#   clang   clang++, the generated single header, address + undefined-behaviour sanitizers
#           (leak checking on; UBSan's null and alignment checks in the io tests and the
#           kernels' only: tests/CMakeLists.txt): unit tests, each public header of include/ on
#           its own (clang parses them in 70 % of g++'s time), compile-fail, install; line
#           tables only. The unit tests run as whole suites, one process each (unit.whole,
#           unit.isa_*), not a process per case (label unit_case): starting and stopping the
#           sanitized program was half of the stage's test time. The unit tests and the other test programs at -O0: clang's warnings do
#           not depend on optimisation, and sanitized -O1 took 3.3 times -O0's CPU time
#           (tools/compile_costs.md), most of the stage; the kernels' tests, whose loops are
#           the suite's run time, at -O1 (the sanitizers' documentation suggests it; both keep
#           the stack traces exact).
#           One build serves both: a separate unsanitised clang build proved nothing more.
#           The unit tests take their kernels from one precompiled file
#           (DUET_TEST_PRECOMPILED_KERNELS, duet/precompiled_kernels.hpp), so that every case
#           checks that path too; every other program of both stages is header-only.
#           In batches of 4 files (DUET_UNITY_BATCH_SIZE): the heaviest batch (ops_arithmetic,
#           ops_custom, ops_math, ops_layers) takes 5.2 GB; batches of 8 with all of UBSan's
#           checks took 10.7 GB, more than two jobs have on 23 GB
#   tsan    thread sanitizer: the concurrency tests (tests/threads.cpp alone, CTest label threads),
#           without OpenMP (DUET_OPENMP=OFF): the sanitizer cannot see the OpenMP runtime's
#           own barriers, which are not built with it, and would report every product shared by
#           two threads; the clang stage runs those products under ASan instead
#   fuzz    libFuzzer with address + undefined-behaviour sanitizers: each fuzzer of tests/fuzz
#           for DUET_FUZZ_SECONDS (45) from a copy of its seed corpus (and with its dictionary,
#           tests/fuzz/<name>.dict, where there is one); any finding fails it. At -O0 -g1:
#           fuzz_onnx, which instantiates every operation the ONNX loader reads, took 130-160 s
#           to build at -O1 (libFuzzer's suggestion), the stage's longest step, and 92 s at -O0;
#           the stage 192 s against 232 (-O1 for the others beside it) and 263-283 (all -O1).
#           A minute at -O0 is fewer inputs (checkpoint 87 a second against 403 at -O1, onnx
#           2,300): CI's fuzzing replays the corpus (the past findings among it) and explores
#           near it; longer runs find more. 45 s rather than a minute since CI reached 1,814 s of
#           its 30 minutes (2026-12-06)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=${DUET_JOBS:-2}
build=${DUET_BUILD_ROOT:-build-check}
fuzz_seconds=${DUET_FUZZ_SECONDS:-45}
stages=("$@")
# Linking: lld (Debian's lld, which tools/install-deps.sh installs) links the clang stage's
# sanitized test program (0.9 GB, -g1) in 8-10 s where ld.bfd took 49-60 s; and that program,
# started once per test case (418 times), starts in 0.35 s instead of 0.77 s without PIE: most
# of its start was the dynamic loader relocating 125 MB of data (perf: _dl_relocate_object and
# its page faults). Only the clang stage drops PIE: ThreadSanitizer wants a PIE executable.
link_flags=
if command -v ld.lld >/dev/null; then link_flags=-fuse-ld=lld; fi
[ ${#stages[@]} -gt 0 ] || stages=(gcc clang tsan fuzz)
summary=()

# run_stage NAME DIR TARGETS CTEST_ARGS CMAKE_ARGS...: builds TARGETS (all when empty), then runs
# the tests CTEST_ARGS select.
run_stage() {
  local name=$1 dir=$2 targets=$3 ctest_args=$4
  shift 4
  local start=$SECONDS
  echo "=== stage $name ==="
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_WERROR=ON "-DCMAKE_EXE_LINKER_FLAGS=$link_flags" "$@"
  # shellcheck disable=SC2086
  cmake --build "$dir" -j "$jobs" ${targets:+--target $targets}
  # Tests run side by side, each with duet's default of a thread per core: OpenMP's helpers
  # sleep between products instead of spinning on the core the other test needs.
  # shellcheck disable=SC2086
  (cd "$dir" && OMP_WAIT_POLICY=PASSIVE ctest -j "$jobs" --output-on-failure $ctest_args)
  summary+=("$(printf '%-6s passed in %4ds' "$name" $((SECONDS - start)))")
}

# The fuzzers run side by side. Each works on a copy of its committed corpus, so that the
# inputs it adds (and any crash it writes) stay in the build tree.
fuzz_stage() {
  local dir=$build/fuzz start=$SECONDS name failed=0 fuzzers=(idx checkpoint safetensors)
  local -A pids
  echo "=== stage fuzz ==="
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -g1" \
    -DDUET_WERROR=ON "-DCMAKE_EXE_LINKER_FLAGS=$link_flags" -DCMAKE_CXX_COMPILER=clang++ -DDUET_BUILD_FUZZERS=ON -DDUET_BUILD_EXAMPLES=OFF -DDUET_BUILD_BENCHMARKS=OFF
  # fuzz_onnx exists where CMake found ONNX (duet::onnx).
  if grep -q "^build tests/fuzz/fuzz_onnx:" "$dir/build.ninja"; then fuzzers+=(onnx); fi
  cmake --build "$dir" -j "$jobs" --target "${fuzzers[@]/#/fuzz_}"
  for name in "${fuzzers[@]}"; do
    rm -rf "$dir/run/$name"
    mkdir -p "$dir/run/$name/corpus"
    cp "tests/fuzz/corpus/$name/"* "$dir/run/$name/corpus/"
    local dict=()
    [ -f "tests/fuzz/$name.dict" ] && dict=(-dict="tests/fuzz/$name.dict")
    "$dir/tests/fuzz/fuzz_$name" "$dir/run/$name/corpus" "${dict[@]}" -max_total_time="$fuzz_seconds" \
      -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -artifact_prefix="$dir/run/$name/" \
      >"$dir/run/$name/log" 2>&1 &
    pids[$name]=$!
  done
  for name in "${fuzzers[@]}"; do
    if wait "${pids[$name]}"; then
      echo "fuzz_$name: $(grep -E '^#[0-9]+[[:space:]]+DONE' "$dir/run/$name/log" | tail -n 1)"
    else
      echo "fuzz_$name FAILED; the end of $dir/run/$name/log (the input is saved beside it):"
      tail -n 60 "$dir/run/$name/log"
      failed=1
    fi
  done
  [ $failed -eq 0 ] || exit 1
  summary+=("$(printf '%-6s passed in %4ds' fuzz $((SECONDS - start)))")
}

for stage in "${stages[@]}"; do
  case $stage in
    gcc)
      run_stage gcc "$build/gcc" "" "-LE compile_fail_ok" -DCMAKE_CXX_COMPILER=g++ -DDUET_NATIVE=OFF -DDUET_DIAGNOSTICS_ONLY=ON \
        "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG" \
        -DDUET_TEST_OPTIMIZATION=-O0 -DDUET_CHECK_HEADERS=OFF
      ;;
    clang)
      ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        run_stage clang "$build/clang" "" "-LE unit_case" -DCMAKE_CXX_COMPILER=clang++ -DDUET_USE_SINGLE_INCLUDE=ON \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DDUET_TEST_OPTIMIZATION=-O0 \
        "-DCMAKE_EXE_LINKER_FLAGS=$link_flags -no-pie" -DDUET_UNITY_TESTS=ON -DDUET_UNITY_BATCH_SIZE=4 -DDUET_TEST_PRECOMPILED_KERNELS=ON -DDUET_SANITIZE=address,undefined -DDUET_BUILD_EXAMPLES=OFF -DDUET_BUILD_BENCHMARKS=OFF
      ;;
    tsan)
      TSAN_OPTIONS=halt_on_error=1 run_stage tsan "$build/tsan" duet_thread_tests "-L threads" \
        -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDUET_SANITIZE=thread -DDUET_OPENMP=OFF \
        -DDUET_BUILD_EXAMPLES=OFF -DDUET_BUILD_BENCHMARKS=OFF -DDUET_CHECK_HEADERS=OFF
      ;;
    fuzz) fuzz_stage ;;
    *) echo "unknown stage: $stage" >&2; exit 2 ;;
  esac
done

echo "=== summary ==="
printf '%s\n' "${summary[@]}"
echo "all stages passed in $SECONDS s"
