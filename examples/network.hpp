// The network of the seed tutorial, shared by the examples: Flatten, then Dense(784, 512),
// ReLU, Dense(512, 512), ReLU, Dense(512, 10).
#pragma once

#include <duet/duet.hpp>

struct Network : duet::nn::Cell<Network> {
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
