#!/bin/sh
# Installs everything duet's build, tests, examples and benchmarks need on Debian 12
# (run as root, or through sudo). Safe to run again.
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends \
  g++ clang lld libclang-rt-14-dev libomp-14-dev cmake make ninja-build ccache \
  libeigen3-dev libboost-dev doctest-dev libbenchmark-dev zlib1g-dev nlohmann-json3-dev \
  dataset-fashion-mnist python3-numpy libopenmpi-dev openmpi-bin \
  libonnx-dev libprotobuf-dev python3-onnx python3-torch
