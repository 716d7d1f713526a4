#!/usr/bin/env bash
# What a user sees after each mistake the compile-fail suite holds: compiles every
# tests/compile_fail/*.cpp case (or the ones given) with DUET_COMPILE_FAIL, with g++ and with
# clang++ as CMake would, and prints a markdown table of the text the suite expects, each
# compiler's first error line (shortened) and how many lines and bytes of diagnostics it
# prints in all.
#   tools/diagnostics.sh                                  every case
#   tools/diagnostics.sh tests/compile_fail/dense_wrong_rank.cpp
# Exits 1 if a case compiles or a compiler's diagnostics miss the expected text.
set -euo pipefail
cd "$(dirname "$0")/.."
# Plain ASCII quotes and no colour, so that the output is the same on every terminal.
export LC_ALL=C
flags=(-std=c++20 -fsyntax-only -fdiagnostics-color=never -DDUET_COMPILE_FAIL -Iinclude -isystem /usr/include/eigen3)
width=110
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(tests/compile_fail/*.cpp)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0

# A markdown code span of its input: long text cut to $width characters, pipes escaped, and
# double backticks around text that holds one.
cell() {
  local text open='`' close='`'
  text=$(cat)
  [ ${#text} -le "$width" ] || text="${text:0:$((width - 3))}..."
  [[ $text != *'`'* ]] || { open='`` '; close=' ``'; }
  printf "%s%s%s" "$open" "${text//|/\\|}" "$close"
}

echo "| case | expected (regex) | g++ 12: first error | g++ lines | g++ bytes | clang++ 14: first error | clang++ lines | clang++ bytes |"
echo "|---|---|---|---:|---:|---|---:|---:|"
for case in "${cases[@]}"; do
  name=$(basename "$case" .cpp)
  # As tests/CMakeLists.txt does: the first "// expect: " line is the regex.
  expect=$(sed -n 's|^// expect: ||p' "$case" | head -n 1)
  row="| $name | $(printf '%s' "$expect" | cell)"
  for compiler in g++ clang++; do
    out=$scratch/$name.$compiler.txt
    if "$compiler" "${flags[@]}" "$case" >"$out" 2>&1; then
      echo "$case compiles with $compiler" >&2
      status=1
    elif ! grep -Eq -- "$expect" "$out"; then
      echo "$case: $compiler's diagnostics do not match the expected regex" >&2
      status=1
    fi
    first=$(grep -m 1 -E 'error:' "$out" | sed -E 's#^([^:]*/)?([^/:]+:[0-9]+):[0-9]+: error: #\2: #')
    row+=" | $(printf '%s' "$first" | cell) | $(wc -l <"$out") | $(wc -c <"$out")"
  done
  echo "$row |"
done
exit $status
