// The seed's second program: the same network in graph (static graph) mode. The network code
// is identical; only the context differs. construct is captured as a compile-time graph,
// optimised (Flatten becomes a view, bias and ReLU fuse into the products) and run in one call.
#include <iostream>

#include "network.hpp"

int main() {
  duet::set_context({.mode = duet::GRAPH_MODE});

  Network model;
  const auto input = duet::ones({64, 1, 28, 28});
  const auto output = model(input);
  std::cout << output << '\n';
}
