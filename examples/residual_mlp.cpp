// An MLP of residual blocks (x + f(x), f pre-normalised with LayerNorm, GELU between its two
// Dense layers), trained on Fashion-MNIST with the seed's recipe (fashion_fit.hpp) in PyNative
// mode and then in graph mode from the same seed: the two print the same losses, bit for bit,
// and reach the seed MLP's test accuracy.
//
//   residual_mlp [--epochs 5] [--mode both|graph|pynative] [--data /usr/share/datasets/fashion-mnist]
#include "fashion_fit.hpp"

namespace {

using namespace duet;

constexpr index_t width = 256;

struct ResidualBlock : nn::Cell<ResidualBlock> {
  nn::LayerNorm<width> norm;
  nn::Dense<width, width> fc1;
  nn::GELU gelu;
  nn::Dense<width, width> fc2;
  DUET_CELL_MEMBERS(norm, fc1, gelu, fc2);

  auto construct(auto x) { return x + fc2(gelu(fc1(norm(x)))); }
};

struct ResidualMLP : nn::Cell<ResidualMLP> {
  nn::Flatten flatten;
  nn::Dense<784, width> stem;
  ResidualBlock block1;
  ResidualBlock block2;
  nn::LayerNorm<width> norm;
  nn::Dense<width, 10> head;
  DUET_CELL_MEMBERS(flatten, stem, block1, block2, norm, head);

  auto construct(auto x) { return head(norm(block2(block1(stem(flatten(x)))))); }
};

}  // namespace

int main(int argc, char** argv) { return fashion::run<ResidualMLP>(argc, argv, "residual_mlp"); }
