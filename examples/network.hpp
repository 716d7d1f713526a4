// The network of the seed tutorial, shared by the examples: Flatten, then Dense(784, 512),
// ReLU, Dense(512, 512), ReLU, Dense(512, 10). Setting is how it runs: following the context
// (the default), or a fixed mode or JitConfig.
#pragma once

#include <duet/duet.hpp>

template <auto Setting = duet::CONTEXT_MODE>
struct SeedNetwork : duet::nn::Cell<SeedNetwork<Setting>, Setting> {
  duet::nn::Flatten flatten;
  duet::nn::SequentialCell<duet::nn::Dense<28 * 28, 512>, duet::nn::ReLU, duet::nn::Dense<512, 512>, duet::nn::ReLU,
                           duet::nn::Dense<512, 10>>
      dense_relu_sequential;
  DUET_CELL_MEMBERS(flatten, dense_relu_sequential);

  auto construct(auto x) {
    auto flat = flatten(x);
    auto logits = dense_relu_sequential(flat);
    return logits;
  }
};

using Network = SeedNetwork<>;
