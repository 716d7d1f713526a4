// The small residual CNN that examples/resnet_fashion.cpp trains, shared with the benchmarks
// (benchmarks/conv.cpp).
//
// Three stages of one residual block each, 16, 32 and 64 channels on 28x28, 14x14 and 7x7;
// the second and third halve the size with a stride-2 first convolution and a 1x1 stride-2
// projection on the skip path. Global average pooling and Dropout before the classifier.
// Channels are kept small so that an epoch stays within minutes on one core (README gives
// the measured epoch time).
#pragma once

#include <duet/duet.hpp>

namespace resnet_fashion {

using namespace duet;

// relu(bn2(conv2(relu(bn1(conv1(x))))) + x), the identity skip of ResNet's basic block.
template <index_t C>
struct BasicBlock : nn::Cell<BasicBlock<C>> {
  nn::Conv2d<C, C, 3, 1, 1> conv1;
  nn::BatchNorm2d<C> bn1;
  nn::ReLU relu1;
  nn::Conv2d<C, C, 3, 1, 1> conv2;
  nn::BatchNorm2d<C> bn2;
  nn::ReLU relu2;
  DUET_CELL_MEMBERS(conv1, bn1, relu1, conv2, bn2, relu2);

  auto construct(auto x) { return relu2(bn2(conv2(relu1(bn1(conv1(x))))) + x); }
};

// The basic block that goes from In to Out channels at half the size: its skip path is a
// 1x1 stride-2 convolution with BatchNorm, so that the sum's shapes agree.
template <index_t In, index_t Out>
struct DownBlock : nn::Cell<DownBlock<In, Out>> {
  nn::Conv2d<In, Out, 3, 2, 1> conv1;
  nn::BatchNorm2d<Out> bn1;
  nn::ReLU relu1;
  nn::Conv2d<Out, Out, 3, 1, 1> conv2;
  nn::BatchNorm2d<Out> bn2;
  nn::Conv2d<In, Out, 1, 2> project;
  nn::BatchNorm2d<Out> bn_project;
  nn::ReLU relu2;
  DUET_CELL_MEMBERS(conv1, bn1, relu1, conv2, bn2, project, bn_project, relu2);

  auto construct(auto x) { return relu2(bn2(conv2(relu1(bn1(conv1(x))))) + bn_project(project(x))); }
};

struct ResNetFashion : nn::Cell<ResNetFashion> {
  // [N, 1, 28, 28] -> [N, 16, 28, 28] -> [N, 32, 14, 14] -> [N, 64, 7, 7] -> [N, 64] -> [N, 10]
  nn::Conv2d<1, 16, 3, 1, 1> stem;
  nn::BatchNorm2d<16> bn_stem;
  nn::ReLU relu_stem;
  BasicBlock<16> stage1;
  DownBlock<16, 32> stage2;
  DownBlock<32, 64> stage3;
  nn::AdaptiveAvgPool2d<1> pool;
  nn::Flatten flatten;
  nn::Dropout dropout{0.2};
  nn::Dense<64, 10> head;
  DUET_CELL_MEMBERS(stem, bn_stem, relu_stem, stage1, stage2, stage3, pool, flatten, dropout, head);

  auto construct(auto x) {
    auto features = stage3(stage2(stage1(relu_stem(bn_stem(stem(x))))));
    return head(dropout(flatten(pool(features))));
  }
};

}  // namespace resnet_fashion
