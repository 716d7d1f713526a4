// LeNet-5, the first network of every convolutional tutorial, trained on Fashion-MNIST with the
// examples' recipe (fashion_fit.hpp: Adam 1e-3, batch 64) in PyNative mode and then in graph
// mode from the same seed: the two print the same losses, bit for bit.
//
//   lenet5 [--epochs 5] [--mode both|graph|pynative] [--data /usr/share/datasets/fashion-mnist]
#include "fashion_fit.hpp"

namespace {

using namespace duet;

struct LeNet5 : nn::Cell<LeNet5> {
  // [N, 1, 28, 28] -> [N, 6, 28, 28] -> [N, 6, 14, 14] -> [N, 16, 10, 10] -> [N, 16, 5, 5]
  nn::Conv2d<1, 6, 5, 1, 2> conv1{{.has_bias = true}};
  nn::ReLU relu1;
  nn::MaxPool2d<2, 2> pool1;
  nn::Conv2d<6, 16, 5> conv2{{.has_bias = true}};
  nn::ReLU relu2;
  nn::MaxPool2d<2, 2> pool2;
  nn::Flatten flatten;
  nn::Dense<400, 120> fc1;
  nn::ReLU relu3;
  nn::Dense<120, 84> fc2;
  nn::ReLU relu4;
  nn::Dense<84, 10> fc3;
  DUET_CELL_MEMBERS(conv1, relu1, pool1, conv2, relu2, pool2, flatten, fc1, relu3, fc2, relu4, fc3);

  auto construct(auto x) {
    auto a = pool1(relu1(conv1(x)));
    auto b = pool2(relu2(conv2(a)));
    return fc3(relu4(fc2(relu3(fc1(flatten(b))))));
  }
};

}  // namespace

int main(int argc, char** argv) { return fashion::run<LeNet5>(argc, argv, "lenet5"); }
