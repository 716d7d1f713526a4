// The network (and optimisers) fuzz_checkpoint loads into and make_corpus writes checkpoints of.
#pragma once

#include <duet/duet.hpp>

namespace duet_fuzz {

// Small, so that a whole checkpoint is a few hundred bytes for the fuzzer to mutate; two
// layers of different shapes, so that a mutated file can swap or reshape them.
using Network = duet::nn::SequentialCell<duet::nn::Dense<3, 4>, duet::nn::ReLU, duet::nn::Dense<4, 2>>;

// The optimisers whose state fuzz_checkpoint loads along with the network's parameters.
using Adam = duet::nn::Adam;
using SGD = duet::nn::SGD;
inline const duet::nn::SGDConfig sgd_config{.momentum = 0.9};

}  // namespace duet_fuzz
