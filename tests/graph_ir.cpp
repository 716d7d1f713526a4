#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_graph_ir {

using namespace duet;
using duet_test::ModeGuard;
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
            "  %2 = PackedMatMul + BiasAdd + ReLU(%1) : [?, 512]  [slot 0]  nn::Dense<784, 512> 'dense_relu_sequential.0'\n"
            "  %3 = PackedMatMul + BiasAdd + ReLU(%2) : [?, 512]  [slot 1]  nn::Dense<512, 512> 'dense_relu_sequential.2'\n"
            "  %4 = PackedMatMul + BiasAdd(%3) : [?, 10]  [output]  nn::Dense<512, 10> 'dense_relu_sequential.4'\n"
            "  return %4\n"
            "}\n");
  std::ostringstream printed;
  printed << ir;
  CHECK(printed.str() == ir.optimized.text);  // what graph mode runs
}

TEST_CASE("graph_ir's DOT output has one node per graph node and one edge per argument") {
  SeedNetwork<> net;
  const GraphIR ir = graph_ir(net);
  const std::string& dot = ir.optimized.dot;
  CHECK(dot.rfind("digraph \"", 0) == 0);
  CHECK(dot.find("n2 [label=\"%2 PackedMatMul + BiasAdd + ReLU\\n[?, 512] (slot 0)\\nnn::Dense&lt;784, 512&gt; "
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
                                             "  n1 [label=\"%1 PackedMatMul + BiasAdd\\n[..., 2] (output)\\n" +
                                             escaped +
                                             "\"];\n"
                                             "  n0 -> n1;\n"
                                             "}\n");
}

namespace {
// Two layers of one type on one input: its capture is ambiguous, so it runs traced.
struct TwoQueries : nn::Cell<TwoQueries> {
  nn::Dense<6, 6> wq;
  nn::Dense<6, 6> wk;
  nn::BatchNorm1d<6> bn;
  DUET_CELL_MEMBERS(wq, wk, bn);
  auto construct(auto x) { return ops::matmul(wq(x), bn(wk(x)), ops::transpose_b); }
};
}  // namespace

TEST_CASE("graph_ir of an ambiguous capture shows the trace that runs, not the merged program") {
  TwoQueries net;
  net.set_train(true);
  const std::vector<float> moving_mean(net.bn.moving_mean.data(), net.bn.moving_mean.data() + 6);
  const GraphIR ir = graph_ir(net, shape<dyn, 6>);
  for (const GraphText* g : {&ir.captured, &ir.optimized}) {
    CHECK(g->text.find("ambiguous capture, so it runs as a traced graph (PIJit), not as a static graph: ") !=
          std::string::npos);
    CHECK(g->text.find("  traced on an input of shape [2, 6]\n  %0 = Input 0 : [2, 6]\n") != std::string::npos);
    CHECK(g->text.find("= BatchMatMul(transpose_b)(%") != std::string::npos);
    CHECK(g->dot.find("traced on an input of shape [2, 6]") != std::string::npos);
  }
  // Both products, where the merged program has one; in the order the compiler called them.
  CHECK(ir.captured.text.find("= MatMul(%0) : [2, 6]  nn::Dense<6, 6> 'wq'\n") != std::string::npos);
  CHECK(ir.captured.text.find("= MatMul(%0) : [2, 6]  nn::Dense<6, 6> 'wk'\n") != std::string::npos);
  CHECK(ir.captured.text.find("= BatchNorm(%") != std::string::npos);
  CHECK(ir.optimized.text.find("= PackedMatMul + BiasAdd(%0) : [2, 6]  nn::Dense<6, 6> 'wq'\n") != std::string::npos);
  CHECK(ir.optimized.text.find("= PackedMatMul + BiasAdd(%0) : [2, 6]  nn::Dense<6, 6> 'wk'\n") != std::string::npos);
  CHECK(ir.optimized.text.find("= BiasAdd(") == std::string::npos);  // fused into the products
  // Tracing ran BatchNorm in training; its moving statistics are as they were.
  CHECK(std::vector<float>(net.bn.moving_mean.data(), net.bn.moving_mean.data() + 6) == moving_mean);
  // An input of unknown rank cannot be traced: graph_ir says how to see the trace.
  CHECK(graph_ir(net).captured.text.find("give graph_ir an input shape (duet::shape<dyn, ...>) to see the trace") !=
        std::string::npos);
}

// A construct of two tensors (a VAE's reparameterisation: the noise is an input).
struct Reparam : nn::Cell<Reparam> {
  nn::Dense<8, 4> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x, auto eps) {
    auto [mu, logvar] = ops::split<-1, 2, 2>(fc(x));
    return mu + ops::exp(logvar * 0.5f) * eps;
  }
};

// The same, with the noise scaled twice by one operation type: an ambiguous capture.
struct ReparamTwice : nn::Cell<ReparamTwice> {
  nn::Dense<8, 2> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x, auto eps) { return fc(x) * (eps * 2.0f) + eps * 3.0f; }
};

TEST_CASE("graph_ir of a construct of two tensors takes a pattern for each") {
  Reparam net;
  const GraphIR ir = graph_ir(net, shape<dyn, 8>, shape<dyn, 2>);
  CHECK(ir.captured.text.find("  %0 = Input 0 : [?, 8]  [input]\n") != std::string::npos);
  CHECK(ir.captured.text.find(" = Input 1 : [?, 2]  [input]\n") != std::string::npos);
  CHECK(ir.optimized.text.find("PackedMatMul + BiasAdd(%0) : [?, 4]") != std::string::npos);

  ReparamTwice twice;
  const GraphIR traced = graph_ir(twice, shape<dyn, 8>, shape<dyn, 2>);
  CHECK(traced.captured.text.find("ambiguous capture") != std::string::npos);
  CHECK(traced.captured.text.find("  traced on inputs of shapes [2, 8] and [2, 2]\n") != std::string::npos);
  CHECK(traced.captured.text.find(" = Input 1 : [2, 2]\n") != std::string::npos);
}

TEST_CASE("graph_ir of a network built at run time shows the trace graph mode runs") {
  set_seed(3);
  nn::DynamicSequentialCell net;
  net.append(nn::Dense<>(4, 3));
  net.append(nn::ReLU());
  net.append(nn::Dense<>(3, 2));
  const GraphIR ir = graph_ir(net, shape<dyn, 4>);
  for (const GraphText* g : {&ir.captured, &ir.optimized}) {
    CHECK(g->text.find("built at run time, so graph mode runs it as a traced graph (PIJit)\n") != std::string::npos);
    CHECK(g->text.find("  traced on an input of shape [2, 4]\n  %0 = Input 0 : [2, 4]\n") != std::string::npos);
  }
  CHECK(ir.captured.text.find("= MatMul(%0) : [2, 3]") != std::string::npos);
  CHECK(ir.captured.text.find("= ReLU(%") != std::string::npos);
  CHECK(ir.optimized.text.find("  %3 = PackedMatMul + BiasAdd + ReLU(%0) : [2, 3]  nn::Dense<dyn, dyn> '0'\n"
                                "  %5 = PackedMatMul + BiasAdd(%3) : [2, 2]  nn::Dense<dyn, dyn> '2'\n  return %5\n") !=
        std::string::npos);
  // What graph mode then runs is that replay, and gives the same values as PyNative mode.
  ModeGuard guard;
  const Tensor x = uniform<float>({5, 4}, -1.0f, 1.0f, 4);
  set_context({.mode = PYNATIVE_MODE});
  const Tensor eager = net(x);
  set_context({.mode = GRAPH_MODE});
  const Tensor graph = net(x);
  CHECK(std::equal(eager.data(), eager.data() + eager.numel(), graph.data()));
  const auto log = jit_compile_log();
  CHECK(std::any_of(log.begin(), log.end(),
                    [](const std::string& l) { return l.find("MatMul + BiasAdd + ReLU") != std::string::npos; }));
}

}  // namespace tests_graph_ir
