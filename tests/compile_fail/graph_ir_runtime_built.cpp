// graph_ir of a network built at run time: there is no construct to capture, and the message
// says where to look instead.
// expect: duet::graph_ir: a network built at run time
#include <duet/duet.hpp>

int main() {
  duet::nn::DynamicSequentialCell net;
  net.append(duet::nn::Dense<>(4, 2));
#ifdef DUET_COMPILE_FAIL
  const auto ir = duet::graph_ir(net, duet::shape<duet::dyn, 4>);
  return ir.optimized.text.empty() ? 1 : 0;
#else
  duet::set_context({.mode = duet::GRAPH_MODE});
  net(duet::ones({3, 4}));
  return duet::jit_compile_log().empty() ? 1 : 0;
#endif
}
