#!/bin/sh
# Compile-time benchmark (issue 16): times the compilation of one translation unit at a time
# and reports wall and user seconds and peak compiler memory (/usr/bin/time), for
#   seed          examples/train_fashion_mnist.cpp (the seed network)
#   deepN         tools/compile_bench/deep.cpp: N Dense<64, 64> + ReLU pairs, forward in both modes
#   deepN_train   the same with a training step in both modes
#   resnet        examples/resnet_fashion.cpp (the residual CNN)
#   transformer   tools/compile_bench/transformer.cpp: one transformer block (embeddings,
#                 LayerNorm, attention, GELU MLP), forward and AdamW steps in both modes
# The deep and transformer programs are also linked and run: each exits non-zero unless the
# two modes agree bit for bit.
#
#   tools/compile_bench.sh [-c g++|clang++|both] [-O -O2] [-p] [TARGET...]   (default: all targets, g++)
#
# -p: with precompiled kernels (duet/precompiled_kernels.hpp): the kernels' file is compiled
# first, once per compiler (the row "kernels"), and each target with -DDUET_PRECOMPILED_KERNELS
# and linked with it.
#
# Run from the repository's root. Targets (issue 16, g++ 12 -O2): seed <= 8 s; deep64 <= 15 s
# and 1 GB; deep64_train <= 20 s and 1.2 GB; deep128 <= 30 s; resnet <= 30 s and 2 GB. On a
# shared machine compare user seconds, and run a before and an after back to back.
set -eu

compilers=g++
opt=-O2
precompiled=
while [ $# -gt 0 ]; do
  case "$1" in
    -c) compilers=$2; shift 2 ;;
    -O) opt=$2; shift 2 ;;
    -p) precompiled=-DDUET_PRECOMPILED_KERNELS; shift ;;
    *) break ;;
  esac
done
[ "$compilers" = both ] && compilers="g++ clang++"
[ $# -gt 0 ] || set -- seed deep32 deep64 deep128 deep32_train deep64_train deep128_train resnet transformer

out=${TMPDIR:-/tmp}/duet_compile_bench.$$
mkdir -p "$out"
trap 'rm -rf "$out"' EXIT

# compile CXX NAME SOURCE DEFINES...: compiles SOURCE to $out/NAME.o, timed into $out/time.
compile() {
  cxx=$1 name=$2 source=$3
  shift 3
  # The warnings of the project's build (duet_warnings in CMakeLists.txt), g++'s false positives off.
  warnings="-Wall -Wextra -Wpedantic -Werror"
  if "$cxx" --version | grep -q 'Free Software Foundation'; then
    warnings="$warnings -Wno-uninitialized -Wno-maybe-uninitialized -Wno-aggressive-loop-optimizations
              -Wno-stringop-overflow -Wno-restrict"
  fi
  # shellcheck disable=SC2086
  if ! /usr/bin/time -f '%e %U %M' -o "$out/time" "$cxx" -std=c++20 $opt -DNDEBUG $warnings \
      -Iinclude -isystem /usr/include/eigen3 $precompiled "$@" -c "$source" -o "$out/$name.o"; then
    echo "compile_bench: $cxx failed on $name" >&2
    exit 1
  fi
}

# report CXX NAME RUN: one row, from $out/time.
report() {
  read -r wall user kb <"$out/time"
  printf '%-9s %-14s %8s %8s %8d  %s\n' "$1" "$2" "$wall" "$user" $((kb / 1024)) "$3"
}

printf '%-9s %-14s %8s %8s %8s  %s\n' compiler target wall_s user_s peak_MB run
for cxx in $compilers; do
  kernels=
  if [ -n "$precompiled" ]; then
    compile "$cxx" kernels cmake/precompiled_kernels.cpp
    report "$cxx" kernels -
    kernels=$out/kernels.o
  fi
  for target in "$@"; do
    defines=
    case "$target" in
      seed) source=examples/train_fashion_mnist.cpp ;;
      resnet) source=examples/resnet_fashion.cpp ;;
      transformer) source=tools/compile_bench/transformer.cpp ;;
      deep*_train) source=tools/compile_bench/deep.cpp
        depth=${target#deep}; depth=${depth%_train}
        defines="-DDUET_BENCH_DEPTH=$depth -DDUET_BENCH_TRAIN" ;;
      deep*) source=tools/compile_bench/deep.cpp; defines="-DDUET_BENCH_DEPTH=${target#deep}" ;;
      *) echo "compile_bench: unknown target $target" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    compile "$cxx" "$target" "$source" $defines
    run=-
    case "$target" in
      deep* | transformer)
        # shellcheck disable=SC2086
        "$cxx" "$out/$target.o" $kernels -lz -o "$out/$target"
        if "$out/$target" >/dev/null; then run=identical; else run=DIFFER; fi ;;
    esac
    report "$cxx" "$target" "$run"
    [ "$run" != DIFFER ] || exit 1
  done
done
