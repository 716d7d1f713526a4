// A small residual CNN trained on Fashion-MNIST with the examples' recipe (fashion_fit.hpp:
// Adam 1e-3, batch 64) in PyNative mode and then in graph mode from the same seed: the two
// print the same losses, bit for bit (Dropout draws the same masks in both).
//
//   resnet_fashion [--epochs 5 | --steps N] [--mode both|graph|pynative] [--data DIR]
#include "fashion_fit.hpp"
#include "resnet_fashion.hpp"

int main(int argc, char** argv) { return fashion::run<resnet_fashion::ResNetFashion>(argc, argv, "resnet_fashion"); }
