// Runs an ONNX model (torch.onnx.export's, opsets 13 to 17) with duet: prints duet::summary of
// the network duet built from it, then its output for an input, in PyNative or graph mode.
//
//   run_onnx model.onnx                                 random input (seed 1) of the declared shape, batch 1
//   run_onnx model.onnx --shape 4,1,28,28              another shape
//   run_onnx model.onnx --input x.bin --shape 4,1,28,28  float32 values from a file (numpy's tofile)
//   run_onnx model.onnx --mode graph                   traced on the first call, as any runtime-built network
#include <duet/duet.hpp>
#include <duet/io/onnx.hpp>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

duet::Shape parse_shape(const std::string& text) {
  duet::Shape s;
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) s.push_back(std::stoll(part));
  return s;
}

duet::Tensor read_input(const std::string& path, const duet::Shape& shape) {
  std::ifstream in(path, std::ios::binary);
  std::vector<float> values(static_cast<std::size_t>(shape.numel()));
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  if (!in || in.peek() != std::char_traits<char>::eof()) {
    throw duet::IOError(path + ": expected exactly " + std::to_string(values.size()) + " float32 values for " +
                        duet::to_string(shape));
  }
  return duet::Tensor(shape, std::span<const float>(values));
}

int usage() {
  std::cerr << "usage: run_onnx MODEL.onnx [--shape N,C,H,W] [--input FILE.bin] [--mode pynative|graph]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  std::string shape_text, input_path, mode = "pynative";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--shape") shape_text = argv[i + 1];
    else if (flag == "--input") input_path = argv[i + 1];
    else if (flag == "--mode") mode = argv[i + 1];
    else return usage();
  }
  if (argc % 2 != 0 || (mode != "pynative" && mode != "graph")) return usage();
  try {
    duet::io::OnnxModel net = duet::io::load_onnx(argv[1]);
    duet::Shape shape;
    if (!shape_text.empty()) {
      shape = parse_shape(shape_text);
    } else {
      if (net.input_dims().empty()) throw duet::ValueError("the model declares no input shape: give --shape");
      for (const std::int64_t d : net.input_dims()) shape.push_back(d < 0 ? 1 : d);  // a named dimension: 1
    }
    duet::summary(net, shape);
    const duet::Tensor x = input_path.empty() ? duet::randn(shape, 1) : read_input(input_path, shape);
    duet::set_context({.mode = mode == "graph" ? duet::GRAPH_MODE : duet::PYNATIVE_MODE});
    std::cout << "output (" << mode << " mode):\n" << net(x) << '\n';
  } catch (const duet::Error& e) {
    std::cerr << "run_onnx: " << e.what() << '\n';
    return 1;
  }
}
