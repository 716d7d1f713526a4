// LeNet-5 (lenet5.hpp), the first network of every convolutional tutorial, trained on
// Fashion-MNIST with the examples' recipe (fashion_fit.hpp: Adam 1e-3, batch 64) in PyNative
// mode and then in graph mode from the same seed: the two print the same losses, bit for bit.
//
//   lenet5 [--epochs 5 | --steps N] [--mode both|graph|pynative] [--data /usr/share/datasets/fashion-mnist]
#include "fashion_fit.hpp"
#include "lenet5.hpp"

int main(int argc, char** argv) { return fashion::run<LeNet5>(argc, argv, "lenet5"); }
