// The libtorch forms of examples/network.hpp's seed network, examples/lenet5.hpp and
// examples/resnet_fashion.cpp, for the
// references that run beside duet (torch_fashion.cpp, conv.cpp).
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace torch_nets {

// The seed network: Flatten, 784->512, ReLU, 512->512, ReLU, 512->10.
struct SeedImpl : torch::nn::Module {
  torch::nn::Linear fc1{784, 512}, fc2{512, 512}, fc3{512, 10};

  SeedImpl() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("fc3", fc3);
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x.flatten(1)))))); }
};
TORCH_MODULE(Seed);

// conv1 1->6 5x5 pad 2, ReLU, MaxPool 2; conv2 6->16 5x5, ReLU, MaxPool 2; 400->120->84->10.
struct LeNet5Impl : torch::nn::Module {
  torch::nn::Conv2d conv1{torch::nn::Conv2dOptions(1, 6, 5).padding(2)};
  torch::nn::Conv2d conv2{torch::nn::Conv2dOptions(6, 16, 5)};
  torch::nn::Linear fc1{400, 120}, fc2{120, 84}, fc3{84, 10};

  LeNet5Impl() {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("fc3", fc3);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    return fc3(torch::relu(fc2(torch::relu(fc1(x.flatten(1))))));
  }
};
TORCH_MODULE(LeNet5);

inline torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// examples/resnet_fashion.cpp's blocks: relu(bn2(conv2(relu(bn1(conv1(x))))) + skip(x)), the
// skip a 1x1 stride-2 convolution with BatchNorm where the block halves the size.
struct BlockImpl : torch::nn::Module {
  torch::nn::Conv2d conv1, conv2;
  torch::nn::BatchNorm2d bn1, bn2;
  torch::nn::Conv2d project{nullptr};
  torch::nn::BatchNorm2d bn_project{nullptr};

  BlockImpl(int64_t in, int64_t out, int64_t stride)
      : conv1(conv3x3(in, out, stride)), conv2(conv3x3(out, out, 1)), bn1(out), bn2(out) {
    register_module("conv1", conv1);
    register_module("bn1", bn1);
    register_module("conv2", conv2);
    register_module("bn2", bn2);
    if (stride != 1) {
      project = register_module("project", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      bn_project = register_module("bn_project", torch::nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor skip = project ? bn_project(project(x)) : x;
    return torch::relu(bn2(conv2(torch::relu(bn1(conv1(x))))) + skip);
  }
};
TORCH_MODULE(Block);

struct ResNetImpl : torch::nn::Module {
  torch::nn::Conv2d stem{conv3x3(1, 16, 1)};
  torch::nn::BatchNorm2d bn_stem{16};
  Block stage1{16, 16, 1}, stage2{16, 32, 2}, stage3{32, 64, 2};
  torch::nn::Dropout dropout{0.2};
  torch::nn::Linear head{64, 10};

  ResNetImpl() {
    register_module("stem", stem);
    register_module("bn_stem", bn_stem);
    register_module("stage1", stage1);
    register_module("stage2", stage2);
    register_module("stage3", stage3);
    register_module("dropout", dropout);
    register_module("head", head);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = stage3(stage2(stage1(torch::relu(bn_stem(stem(x))))));
    return head(dropout(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1)));
  }
};
TORCH_MODULE(ResNet);

}  // namespace torch_nets
