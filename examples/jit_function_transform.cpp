// The seed's jit program 2, the function transform: jit(run) is a compiled version of run;
// run itself stays dynamic.
#include "network.hpp"

#include <iostream>

int main() {
  Network model;
  auto run = [&](auto x) { return model(x); };
  auto run_with_jit = duet::jit(run);

  const auto input = duet::ones({64, 1, 28, 28});
  const auto output = run_with_jit(input);
  std::cout << output << '\n';
}
