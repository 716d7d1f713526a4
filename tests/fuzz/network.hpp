// The network (and optimisers) fuzz_checkpoint and fuzz_safetensors load into and make_corpus
// writes files of, and the checks the loaders' harnesses share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <duet/duet.hpp>
#include <span>
#include <vector>

namespace duet_fuzz {

// Small, so that a whole checkpoint is a few hundred bytes for the fuzzer to mutate; two
// layers of different shapes, so that a mutated file can swap or reshape them; a Dropout,
// whose generator checkpoints with an optimiser hold ("generator.3").
using Network =
    duet::nn::SequentialCell<duet::nn::Dense<3, 4>, duet::nn::ReLU, duet::nn::Dense<4, 2>, duet::nn::Dropout>;

// The optimisers whose state fuzz_checkpoint loads along with the network's parameters.
using Adam = duet::nn::Adam;
using SGD = duet::nn::SGD;
// A function, not a constant: clang 14 crashed emitting this struct (an empty
// [[no_unique_address]] member) as a namespace-scope constant in fuzz_checkpoint.cpp once
// the chunk operation joined the headers (a segfault in ConstantEmitter, at -O0 with the
// sanitizers).
inline duet::nn::SGDConfig sgd_config() { return {.momentum = 0.9}; }

inline void append(std::vector<std::byte>& out, std::span<const std::byte> bytes) {
  out.insert(out.end(), bytes.begin(), bytes.end());
}

// Runs a load; one that throws a duet::Error must leave what snapshot() returns as it was.
template <class Snapshot, class Load>
bool attempt(Snapshot&& snapshot, Load&& load) {
  const auto before = snapshot();
  try {
    load();
    return true;
  } catch (const duet::Error&) {
    if (snapshot() != before) std::abort();
    return false;
  }
}

// A load that is not strict (load() returns its CheckpointLoad): the parameters it reports left
// out keep their values, and after the same bytes loaded strictly (`strict`) it leaves out nothing.
template <class Load>
void check_not_strict(Network& net, bool strict, Load&& load) {
  const auto before = net.parameters();
  // Bytes, not floats: a loaded NaN is not equal to itself.
  std::vector<std::vector<std::byte>> values(before.size());
  for (std::size_t i = 0; i < before.size(); ++i) append(values[i], std::as_bytes(before[i].parameter->values()));
  const duet::CheckpointLoad result = load();
  if (strict && !(result.param_not_load.empty() && result.ckpt_not_load.empty())) std::abort();
  for (std::size_t i = 0; i < before.size(); ++i) {
    const bool kept = std::ranges::find(result.param_not_load, before[i].name) != result.param_not_load.end();
    if (kept && !std::ranges::equal(std::as_bytes(before[i].parameter->values()), values[i])) std::abort();
  }
}

}  // namespace duet_fuzz
