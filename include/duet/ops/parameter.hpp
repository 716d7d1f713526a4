// A cell's own parameter read directly by operations in construct (a learned scale,
// `x * weight`), in both modes.
//
// Graph mode makes the parameter a node of the graph (ParameterOp, which reads the values live
// at each run); PyNative gives the tape a leaf for it. Either way its gradient ends in the
// parameter's grad through ParameterGradOp, the way a layer's gradient kernel writes its
// weight's, so optimisers, checkpoints and both modes see no difference from nn::Dense's.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "../graph.hpp"
#include "../operation.hpp"
#include "../parameter.hpp"

namespace duet::ops {

// d(loss)/d(parameter) added to the parameter's gradient of the current backward pass.
template <class T>
struct ParameterGradOp : Primitive<ParameterGradOp<T>> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr bool is_sink = true;
  const nn::BasicParameter<T>* parameter;
  ParameterGradOp(const nn::BasicParameter<T>* p) : parameter(p) {}

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    bool accumulate = false;
    T* g = parameter->grad_for_write(duet::detail::current_backward_pass(), &accumulate);
    const T* dy = a.in<T>();
    const index_t n = a.in_shape().numel();
    if (accumulate) {
      for (index_t i = 0; i < n; ++i) g[i] += dy[i];
    } else {
      std::copy_n(dy, n, g);
    }
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() { return "ParameterGrad"; }
};

// The values of a parameter, as a node with no inputs. Its shape is known when the graph runs.
template <class T>
struct ParameterOp : Primitive<ParameterOp<T>> {
  using value_type = T;
  static constexpr int arity = 0;
  static constexpr bool has_parameters = true;
  const nn::BasicParameter<T>* parameter;
  ParameterOp(const nn::BasicParameter<T>* p) : parameter(p) {}

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape>) const { return {parameter->shape()}; }

  // A copy into the graph's arena: the graph's values are planned there, and the parameter's
  // storage may be replaced between runs (checkpoint loading keeps it, set_data copies).
  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const nn::BasicParameter<T>& p = *parameter;
    std::copy_n(p.data(), p.numel(), a.out<T>());
  }

  auto parameter_grad_op() const { return ParameterGradOp<T>{parameter}; }

  static std::string op_name() { return "Parameter"; }
};

}  // namespace duet::ops

namespace duet::graph {

// A parameter read after everything `anchor`'s graph holds: a node appended to that graph,
// never merged. Merging places a node without inputs where the other graph has it, and two
// parameters of one type there are indistinguishable to the type: `a - b` captured from two
// one-node graphs would meet b where a is. Operations on parameters alone are captured this
// way (eager.hpp, graph_operand).
template <class T, class G, std::size_t Out>
auto parameter_after(const Sym<G, Out>& anchor, const nn::BasicParameter<T>& p) {
  auto g = with_node(anchor.graph, Node<ops::ParameterOp<T>>{ops::ParameterOp<T>{&p}});
  std::array<std::uint64_t, G::size + 1> ids{};
  std::copy(anchor.ids.begin(), anchor.ids.end(), ids.begin());
  ids[G::size] = reinterpret_cast<std::uintptr_t>(&p) | 1u;
  return Sym<decltype(g), G::size>{g, ids, anchor.ambiguity};
}

}  // namespace duet::graph
