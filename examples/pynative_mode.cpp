// The seed's first program: the network in PyNative (dynamic graph) mode. Each cell runs as
// it is called, so every intermediate value exists and can be inspected.
#include <iostream>

#include "network.hpp"

int main() {
  duet::set_context({.mode = duet::PYNATIVE_MODE});  // the default; shown as in the seed

  Network model;
  const auto input = duet::ones({64, 1, 28, 28});
  const auto output = model(input);
  std::cout << output << '\n';
}
