#!/usr/bin/env bash
# Builds and tests duet the way CI does, one stage after another, and prints one line per
# stage with its elapsed time. With stage names as arguments, runs only those:
#   tools/check.sh                 every stage
#   tools/check.sh gcc             the quick local check
# Stages:
#   gcc     g++, include/, warnings as errors: unit tests, examples, compile-fail, install
#   clang   clang++, the generated single header: the same tests
#   asan    address + undefined-behaviour sanitizers (leak checking on): unit tests, examples
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=${DUET_JOBS:-2}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(gcc clang asan)
summary=()

run_stage() {
  local name=$1 dir=$2 ctest_args=$3
  shift 3
  local start=$SECONDS
  echo "=== stage $name ==="
  cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DDUET_WERROR=ON "$@"
  cmake --build "$dir" -j "$jobs"
  # shellcheck disable=SC2086
  (cd "$dir" && ctest -j "$jobs" --output-on-failure $ctest_args)
  summary+=("$(printf '%-6s passed in %4ds' "$name" $((SECONDS - start)))")
}

for stage in "${stages[@]}"; do
  case $stage in
    gcc) run_stage gcc build-check/gcc "" -DCMAKE_CXX_COMPILER=g++ ;;
    clang) run_stage clang build-check/clang "" -DCMAKE_CXX_COMPILER=clang++ -DDUET_USE_SINGLE_INCLUDE=ON ;;
    asan)
      ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        run_stage asan build-check/asan "-LE compile_fail|install" -DCMAKE_CXX_COMPILER=clang++ \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDUET_SANITIZE=address,undefined -DDUET_BUILD_BENCHMARKS=OFF
      ;;
    *) echo "unknown stage: $stage" >&2; exit 2 ;;
  esac
done

echo "=== summary ==="
printf '%s\n' "${summary[@]}"
echo "all stages passed in $SECONDS s"
