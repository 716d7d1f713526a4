#include <string>

#include "support.hpp"

using namespace duet;
using duet_test::SeedNetwork;

TEST_CASE("graph_ir shows the captured and the optimised graph") {
  SeedNetwork<> net;
  const GraphIR ir = graph_ir(net, shape<dyn, 1, 28, 28>);
  const std::string title = net.type_name();
  CHECK(ir.captured.text ==
        "graph " + title +
            " {\n"
            "  %0 = Input 0 : [?, 1, 28, 28]  [input]\n"
            "  %1 = Flatten(%0) : [?, 784]  [view of %0]  nn::Flatten\n"
            "  %2 = MatMul(%1) : [?, 512]  [slot 0]  nn::Dense<784, 512> 'dense_relu_sequential.0'\n"
            "  %3 = BiasAdd(%2) : [?, 512]  [slot 1]  nn::Dense<784, 512> 'dense_relu_sequential.0'\n"
            "  %4 = ReLU(%3) : [?, 512]  [slot 0]\n"
            "  %5 = MatMul(%4) : [?, 512]  [slot 1]  nn::Dense<512, 512> 'dense_relu_sequential.2'\n"
            "  %6 = BiasAdd(%5) : [?, 512]  [slot 0]  nn::Dense<512, 512> 'dense_relu_sequential.2'\n"
            "  %7 = ReLU(%6) : [?, 512]  [slot 1]\n"
            "  %8 = MatMul(%7) : [?, 10]  [slot 0]  nn::Dense<512, 10> 'dense_relu_sequential.4'\n"
            "  %9 = BiasAdd(%8) : [?, 10]  [output]  nn::Dense<512, 10> 'dense_relu_sequential.4'\n"
            "  return %9\n"
            "}\n");
  CHECK(ir.optimized.text ==
        "graph " + title +
            " {\n"
            "  %0 = Input 0 : [?, 1, 28, 28]  [input]\n"
            "  %1 = Flatten(%0) : [?, 784]  [view of %0]  nn::Flatten\n"
            "  %2 = MatMul + BiasAdd + ReLU(%1) : [?, 512]  [slot 0]  nn::Dense<784, 512> 'dense_relu_sequential.0'\n"
            "  %3 = MatMul + BiasAdd + ReLU(%2) : [?, 512]  [slot 1]  nn::Dense<512, 512> 'dense_relu_sequential.2'\n"
            "  %4 = MatMul + BiasAdd(%3) : [?, 10]  [output]  nn::Dense<512, 10> 'dense_relu_sequential.4'\n"
            "  return %4\n"
            "}\n");
}

TEST_CASE("graph_ir's DOT output has one node per graph node and one edge per argument") {
  SeedNetwork<> net;
  const GraphIR ir = graph_ir(net);
  const std::string& dot = ir.optimized.dot;
  CHECK(dot.rfind("digraph \"", 0) == 0);
  CHECK(dot.find("n2 [label=\"%2 MatMul + BiasAdd + ReLU\\n[?, 512] (slot 0)\\nnn::Dense&lt;784, 512&gt; "
                 "'dense_relu_sequential.0'\"];") != std::string::npos);
  CHECK(dot.find("n3 -> n4;") != std::string::npos);
  CHECK(dot.find("n0 [label=\"%0 Input 0\\n[...] (input)\"];") != std::string::npos);
  CHECK(dot.back() == '\n');
}

namespace {
// A layer whose type name holds what a DOT string or label must escape.
struct OddlyNamed : nn::Dense<4, 2> {
  std::string type_name() const override { return "My\"Cell<\n>\\N&"; }
};
}  // namespace

TEST_CASE("graph_ir's DOT output escapes quotes, backslashes, newlines, <, > and & in titles and labels") {
  OddlyNamed layer;
  const std::string escaped = R"(My\"Cell&lt;\n&gt;\\N&amp;)";
  CHECK(graph_ir(layer).optimized.dot == "digraph \"" + escaped +
                                             "\" {\n"
                                             "  node [shape=box, fontname=\"monospace\"];\n"
                                             "  n0 [label=\"%0 Input 0\\n[...] (input)\"];\n"
                                             "  n1 [label=\"%1 MatMul + BiasAdd\\n[..., 2] (output)\\n" +
                                             escaped +
                                             "\"];\n"
                                             "  n0 -> n1;\n"
                                             "}\n");
}
