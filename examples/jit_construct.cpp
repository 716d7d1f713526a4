// The seed's jit program 3, jit on construct: a cell declared with a JitConfig compiles its
// construct into a graph on every call, whatever the context, while the code around it stays
// dynamic.
#include "network.hpp"

#include <iostream>

using JitNetwork = SeedNetwork<duet::JitConfig{}>;  // MindSpore: @ms.jit on construct

int main() {
  JitNetwork model;
  const auto input = duet::ones({64, 1, 28, 28});
  const auto output = model(input);
  std::cout << output << '\n';
}
