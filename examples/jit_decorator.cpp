// The seed's jit program 1, the decorator form: a function marked with jit always runs as a
// static graph, whatever the global context (PyNative here, the default).
#include "network.hpp"

#include <iostream>

int main() {
  Network model;
  auto run = duet::jit([&](auto x) { return model(x); });

  const auto input = duet::ones({64, 1, 28, 28});
  const auto output = run(input);
  std::cout << output << '\n';
}
