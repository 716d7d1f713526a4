// Builds against the installed duet::onnx, whose library holds the ONNX loader: exports a
// network, loads the file back through the library and checks both give the same outputs.
#include <cstring>
#include <duet/duet.hpp>
#include <duet/io/onnx.hpp>
#include <filesystem>
#include <iostream>

int main() {
  duet::nn::SequentialCell<duet::nn::Dense<4, 5>, duet::nn::Tanh, duet::nn::Dense<5, 2>> net;
  const std::filesystem::path file = "duet_consumer.onnx";  // in the test's own build directory
  duet::io::export_onnx(net, duet::Shape{2, 4}, file);
  duet::io::OnnxModel loaded = duet::io::load_onnx(file);
  std::filesystem::remove(file);
  const auto x = duet::uniform({2, 4}, -1.0f, 1.0f, 3);
  const auto mine = net(x);
  const auto theirs = loaded(x);
  std::cout << theirs << '\n';
  return mine.shape() == theirs.shape() &&
                 std::memcmp(mine.data(), theirs.data(), static_cast<std::size_t>(mine.numel()) * sizeof(float)) == 0
             ? 0
             : 1;
}
