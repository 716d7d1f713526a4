// LeNet-5 as examples/lenet5.cpp trains it, shared with the benchmarks (benchmarks/conv.cpp).
#pragma once

#include <duet/duet.hpp>

struct LeNet5 : duet::nn::Cell<LeNet5> {
  // [N, 1, 28, 28] -> [N, 6, 28, 28] -> [N, 6, 14, 14] -> [N, 16, 10, 10] -> [N, 16, 5, 5]
  duet::nn::Conv2d<1, 6, 5, 1, 2> conv1{{.has_bias = true}};
  duet::nn::ReLU relu1;
  duet::nn::MaxPool2d<2, 2> pool1;
  duet::nn::Conv2d<6, 16, 5> conv2{{.has_bias = true}};
  duet::nn::ReLU relu2;
  duet::nn::MaxPool2d<2, 2> pool2;
  duet::nn::Flatten flatten;
  duet::nn::Dense<400, 120> fc1;
  duet::nn::ReLU relu3;
  duet::nn::Dense<120, 84> fc2;
  duet::nn::ReLU relu4;
  duet::nn::Dense<84, 10> fc3;
  DUET_CELL_MEMBERS(conv1, relu1, pool1, conv2, relu2, pool2, flatten, fc1, relu3, fc2, relu4, fc3);

  auto construct(auto x) {
    auto a = pool1(relu1(conv1(x)));
    auto b = pool2(relu2(conv2(a)));
    return fc3(relu4(fc2(relu3(fc1(flatten(b))))));
  }
};
