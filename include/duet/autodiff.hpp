// Differentiation in both modes, behind one API (MindSpore's grad and value_and_grad).
//
// PyNative records a tape while the function runs (tape.hpp) and walks it back. Graph mode
// derives the backward graph from the forward graph's type while the program compiles: each
// node's op names its gradient op and what that op reads, and build_backward appends those
// ops, last node first, summing where a value has several readers. The training graph is
// then planned and run like any other, in one evaluator call. Both modes call the same
// gradient ops, hence the same kernels.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "cell.hpp"
#include "context.hpp"
#include "eager.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "jit.hpp"
#include "ops/creation.hpp"
#include "parameter.hpp"
#include "passes.hpp"
#include "pipeline.hpp"
#include "tape.hpp"
#include "tensor.hpp"
#include "trace.hpp"

namespace duet {
namespace ops {

// Copies a value out of the graph into *destination (an input's gradient, for the caller).
template <class T>
struct StoreOp : Primitive<StoreOp<T>> {
  static constexpr int arity = 1;
  static constexpr bool is_sink = true;
  BasicTensor<T>* destination;
  StoreOp(BasicTensor<T>* d) : destination(d) {}
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }
  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    *destination = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), a.in_shape().numel(), destination->data());
  }
  static std::string op_name() { return "Store"; }
};

}  // namespace ops

namespace diagnostic {
template <class Op>
struct operation_is_differentiable {
  static constexpr bool value = false;
};

// A class, so that one operation is reported once however many backward graphs meet it.
template <class Op>
struct require_differentiable {
  static_assert(operation_is_differentiable<Op>::value,
                "duet::grad: a gradient must flow through an operation that has none (the condition names it)");
};
}  // namespace diagnostic

namespace autodiff {
namespace detail {

inline constexpr std::size_t no_grad = ~std::size_t{0};

// Which nodes' values depend on an input listed in Wrt or a parameter, along the edges
// `edge(std::type_identity<Op>, std::integral_constant<K>)` lets through (input K of Op).
template <class G, std::size_t... Wrt, class Edge>
constexpr std::array<bool, G::size> reached_from_differentiated(Edge edge) {
  std::array<bool, G::size> on{};
  graph::for_each_index<G::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using N = graph::node_at<G, I>;
    using Op = typename N::op_type;
    if constexpr (graph::is_input_op_v<Op>) {
      on[I] = ((Op::index == Wrt) || ...);
    } else {
      bool any = has_parameters<Op>();
      [&]<std::size_t... K>(std::index_sequence<K...>) {
        ((any = any || (edge(std::type_identity<Op>{}, std::integral_constant<std::size_t, K>{}) && on[N::args[K]])),
         ...);
      }(std::make_index_sequence<N::arity>{});
      on[I] = any;
    }
  });
  return on;
}

// Which nodes' values lead to something being differentiated: only those get gradients. An
// operation without a gradient passes on all its inputs, so that diagnostic::require_differentiable
// names it when a gradient must flow through it.
template <class G, std::size_t... Wrt>
constexpr std::array<bool, G::size> leads_to_gradient() {
  return reached_from_differentiated<G, Wrt...>([](auto op, auto k) {
    using Op = typename decltype(op)::type;
    if constexpr (DifferentiableOperation<Op>) return input_has_gradient<Op, decltype(k)::value>();
    else return true;
  });
}

// Which nodes' values depend on something being differentiated at all, through any input an
// operation does not cut (cuts_gradient): the tape's tracking. A gradient through a
// comparison is zero; an output no such path reaches has no gradient to take.
template <class G, std::size_t... Wrt>
constexpr std::array<bool, G::size> connected_to_differentiated() {
  return reached_from_differentiated<G, Wrt...>([](auto op, auto k) {
    return !cuts_gradient<typename decltype(op)::type, decltype(k)::value>();
  });
}

template <std::size_t N>
constexpr std::array<std::size_t, N> with(std::array<std::size_t, N> a, std::size_t i, std::size_t v) {
  a[i] = v;
  return a;
}

// What the backward walk returns at each step: the plan so far and where each value's gradient
// is. Not a std::pair: each of the walk's steps would instantiate a pair type, and with it the
// traits its constructors are constrained on, which were half of the walk's time (clang).
template <class Built, auto Grads>
struct BackwardPlan {
  using built = Built;
  static constexpr auto grads = Grads;
};

template <graph::Operand O, class N, std::size_t Self, std::size_t Grad>
constexpr std::size_t operand_index() {
  if constexpr (O == graph::Operand::grad)
    return Grad;
  else if constexpr (O == graph::Operand::output)
    return Self;
  else
    return N::args[static_cast<std::size_t>(O) - 1];
}

// How a gradient node's operation is made from the forward graph (graph::Step's recipe):
// forward node I's gradient op for its input K, or its parameters' gradient op.
template <std::size_t I, std::size_t K>
struct InputGrad {
  template <class G>
  static auto make(const G& g) {
    return graph::get<I>(g).op.template grad_op<K>();
  }
};
template <std::size_t I>
struct ParameterGrad {
  template <class G>
  static auto make(const G& g) {
    return graph::get<I>(g).op.parameter_grad_op();
  }
};

// The node of gradient op Op around forward node I (of type N; its gradient in node Grad).
template <class Op, class N, std::size_t I, std::size_t Grad, std::size_t... J>
auto grad_node(std::index_sequence<J...>) -> graph::Node<Op, operand_index<Op::reads[J], N, I, Grad>()...>;

// Built with the step of Recipe's op appended, reading what the op declares around forward
// node I of G (its gradient in node Grad).
template <class G, std::size_t I, std::size_t Grad, class Recipe, class Built>
struct with_grad_step {
  using Op = decltype(Recipe::make(std::declval<const G&>()));
  using node = decltype(grad_node<Op, graph::node_at<G, I>, I, Grad>(std::make_index_sequence<Op::reads.size()>{}));
  using type = typename graph::appended<Built, graph::Step<node, Recipe>>::type;
};

// The gradients of forward node I's inputs K, K+1, ...: each input that leads to something
// differentiated gets its gradient op, summed with what it already has. Types only (the plan
// build_backward makes the list from): the steps built, and the new Grads.
template <std::size_t K, std::size_t I, auto Grads, auto Leads, class G, class Built>
auto backward_inputs() {
  using N = graph::node_at<G, I>;
  using Op = typename N::op_type;
  if constexpr (K == N::arity) {
    return BackwardPlan<Built, Grads>{};
  } else if constexpr (!input_has_gradient<Op, K>() || !Leads[N::args[K]]) {
    return backward_inputs<K + 1, I, Grads, Leads, G, Built>();
  } else {
    constexpr std::size_t a = N::args[K];
    constexpr std::size_t k = graph::plan_size<Built>;
    using WithGrad = typename with_grad_step<G, I, Grads[I], InputGrad<I, K>, Built>::type;
    if constexpr (Grads[a] == no_grad) {
      return backward_inputs<K + 1, I, with(Grads, a, k), Leads, G, WithGrad>();
    } else {
      using Sum = graph::Node<ops::GradAddOp, Grads[a], k>;
      using Summed = typename graph::appended<WithGrad, graph::Step<Sum, graph::Made<ops::GradAddOp>>>::type;
      return backward_inputs<K + 1, I, with(Grads, a, k + 1), Leads, G, Summed>();
    }
  }
}

// Whether input K of node I is an edge whose gradient a NoGradient declaration loses
// (operation.hpp, loses_gradient).
template <class G, std::size_t I, std::size_t K>
constexpr bool loses_gradient_at() {
  using N = graph::node_at<G, I>;
  if constexpr (input_has_gradient<typename N::op_type, K>()) return false;
  else return loses_gradient<typename N::op_type, graph::node_value_t<G, N::args[K]>, graph::node_value_t<G, I>>;
}

// Throws if a node the output's gradient reaches has an input without a gradient whose value
// depends on what is differentiated: the tape's refusal (OpEntry::input_backward), at run
// time, because grad_position is a run-time index and every position's backward graph is
// compiled. Leads, extended through such inputs, says what depends on what is differentiated.
template <auto Leads, std::size_t Out, class G>
void refuse_lost_gradients(const G& g) {
  static constexpr auto found = [] {
    std::array<bool, G::size> depends = Leads;
    bool any_lost = false;
    graph::for_each_index<G::size>([&](auto i) {
      constexpr std::size_t I = decltype(i)::value;
      using N = graph::node_at<G, I>;
      if constexpr (!graph::is_input_op_v<typename N::op_type> && DifferentiableOperation<typename N::op_type>) {
        [&]<std::size_t... K>(std::index_sequence<K...>) {
          const bool lost = ((loses_gradient_at<G, I, K>() && depends[N::args[K]]) || ...);
          depends[I] = depends[I] || lost;
          any_lost = any_lost || lost;
        }(std::make_index_sequence<N::arity>{});
      }
    });
    return std::pair{depends, any_lost};
  }();
  if constexpr (found.second) {
    // Which nodes the output's gradient reaches: consumers come after producers.
    std::array<bool, G::size> reached{};
    reached[Out] = true;
    graph::for_each_index<G::size>([&](auto r) {
      constexpr std::size_t I = G::size - 1 - decltype(r)::value;
      using N = graph::node_at<G, I>;
      using Op = typename N::op_type;
      if constexpr (!graph::is_input_op_v<Op> && DifferentiableOperation<Op>) {
        if (!reached[I]) return;
        [&]<std::size_t... K>(std::index_sequence<K...>) {
          const auto visit = [&](auto k) {
            constexpr std::size_t k_ = decltype(k)::value;
            if constexpr (input_has_gradient<Op, k_>()) {
              reached[N::args[k_]] = true;
            } else if constexpr (loses_gradient_at<G, I, k_>()) {
              if (found.first[N::args[k_]])
                throw ValueError(lost_gradient_message(graph::get<I>(g).op.label(), k_));
            }
          };
          (visit(std::integral_constant<std::size_t, K>{}), ...);
        }(std::make_index_sequence<N::arity>{});
      }
    });
  }
}

// Walks forward nodes I-1, I-2, ..., 0. Grads[i] is the node holding d(output)/d(value i).
// Capture lays nodes out in depth-first post-order from the output (graph::detail::merge_from),
// so this is the order the tape walks its records in (Tape::backward_order): a value's
// gradients add up in the same order in both modes, the sum so far on the left, and its
// producer runs backward once, on the sum. Types only, as backward_inputs.
template <std::size_t I, auto Grads, auto Leads, class G, class Built>
auto backward_from() {
  if constexpr (I == 0) {
    return BackwardPlan<Built, Grads>{};
  } else {
    constexpr std::size_t i = I - 1;
    using N = graph::node_at<G, i>;
    using Op = typename N::op_type;
    if constexpr (Grads[i] == no_grad || graph::is_input_op_v<Op>) {
      return backward_from<i, Grads, Leads, G, Built>();
    } else if constexpr (!DifferentiableOperation<Op>) {
      // An operation that gives some inputs' gradients is reported by the contract's check.
      if constexpr (!diagnostic::check_operation<Op>::partial)
        static_cast<void>(sizeof(diagnostic::require_differentiable<typename Op::layer_type>));
      return backward_from<i, Grads, Leads, G, Built>();
    } else {
      // An op with parameters writes their gradients from input 0's gradient op, or from its
      // own parameter_grad_op when input 0 needs none.
      constexpr bool via_input0 = N::arity >= 1 && input_has_gradient<Op, 0>() && Leads[N::args[0]];
      using WithParameters = typename std::conditional_t<has_parameters<Op>() && !via_input0,
                                                         with_grad_step<G, i, Grads[i], ParameterGrad<i>, Built>,
                                                         std::type_identity<Built>>::type;
      using Inputs = decltype(backward_inputs<0, i, Grads, Leads, G, WithParameters>());
      return backward_from<i, Inputs::grads, Leads, G, typename Inputs::built>();
    }
  }
}

// The steps a training graph's plan begins with: the forward nodes as they are, then the seed
// d(output)/d(output) = 1.
template <class G, std::size_t Out, std::size_t... J>
auto backward_start(std::index_sequence<J...>)
    -> graph::NodeList<graph::Step<graph::node_at<G, J>, graph::Take<J>>...,
                       graph::Step<graph::Node<ops::FillLikeOp<ops::Fill::ones>, Out>, graph::Made<ops::FillLikeOp<ops::Fill::ones>>>>;

template <class G, std::size_t K>
constexpr std::size_t input_node() {
  std::size_t found = G::size;
  graph::for_each_index<G::size>([&](auto i) {
    using Op = typename graph::node_at<G, decltype(i)::value>::op_type;
    if constexpr (graph::is_input_op_v<Op>) {
      if (Op::index == K) found = decltype(i)::value;
    }
  });
  return found;
}

// Where the gradient of each differentiated input comes from: its gradient node, or the j-th
// zeros node (placed from ZerosAt on) when the output does not depend on it.
template <auto Grads, std::size_t ZerosAt, std::size_t... InputNodes>
constexpr std::array<std::size_t, sizeof...(InputNodes)> store_sources() {
  std::array<std::size_t, sizeof...(InputNodes)> sources{};
  std::size_t j = 0;
  ((sources[j] = Grads[InputNodes] != no_grad ? Grads[InputNodes] : ZerosAt + j, ++j), ...);
  return sources;
}

}  // namespace detail

// Gives the graph an input node K of type T if the function never read input K, so that its
// (zero) gradient has somewhere to come from.
template <std::size_t K, class T, class G, std::size_t Out>
auto with_input(const graph::Sym<G, Out>& program) {
  if constexpr (detail::input_node<G, K>() < G::size) {
    return program;
  } else {
    auto g = graph::with_node(program.graph, graph::Node<graph::InputOp<K, graph::AnyShape, T>>{});
    return graph::Sym<decltype(g), Out>{g};
  }
}

// The training graph of a forward program: the forward nodes, then the gradient nodes. Its
// output is still the forward output; parameters' gradients land in their grad tensors, and
// the gradient of input K lands in *input_grads[j] for the j-th K of Wrt.
template <std::size_t... Wrt, class G0, std::size_t Out, class... T>
auto build_backward(const graph::Sym<G0, Out>& program, BasicTensor<T>*... input_grads) {
  static_assert(sizeof...(Wrt) == sizeof...(T), "duet::build_backward: one destination per input differentiated");
  static_assert(sizeof...(Wrt) <= 1, "duet::build_backward: one input at a time (grad_position is one index)");
  const auto forward = [&] {
    if constexpr (sizeof...(Wrt) == 0)
      return program;
    else
      return with_input<Wrt..., T...>(program);
  }();
  using G = typename std::remove_cvref_t<decltype(forward)>::graph_type;
  constexpr auto leads = detail::leads_to_gradient<G, Wrt...>();
  constexpr auto none = [] {
    std::array<std::size_t, G::size> a{};
    a.fill(detail::no_grad);
    return a;
  }();
  using Start = decltype(detail::backward_start<G, Out>(std::make_index_sequence<G::size>{}));
  using Plan = decltype(detail::backward_from<G::size, detail::with(none, Out, G::size), leads, G, Start>());
  using Built = typename Plan::built;
  static constexpr auto grads = Plan::grads;
  detail::refuse_lost_gradients<leads, Out>(forward.graph);
  // The tape's refusal (Tape::backward): a loss cut off from every parameter (through
  // ops::stop_gradient, say) would train nothing.
  if constexpr (!detail::connected_to_differentiated<G, Wrt...>()[Out]) throw ValueError(nothing_differentiated_message);
  constexpr std::size_t zeros_at = Built::size;
  [[maybe_unused]] static constexpr auto sources =
      detail::store_sources<grads, zeros_at, detail::input_node<G, Wrt>()...>();
  const std::tuple<BasicTensor<T>*...> destinations{input_grads...};
  // An input the output does not depend on has a zero gradient, as in MindSpore.
  auto training = [&]<std::size_t... J>(std::index_sequence<J...>) {
    return graph::from_plan<graph::Graph>(
        forward.graph, static_cast<Built*>(nullptr), graph::Node<ops::FillLikeOp<ops::Fill::zeros>, detail::input_node<G, Wrt>()>{}...,
        graph::Node<ops::StoreOp<std::tuple_element_t<J, std::tuple<T...>>>, sources[J]>{std::get<J>(destinations)}...);
  }(std::index_sequence_for<T...>{});
  return graph::Sym<decltype(training), Out>{training};
}

}  // namespace autodiff

// What value_and_grad returns: the function's value, then the gradients asked for (the
// input's first, when a grad_position is given, then the weights' in order).
template <ElementType T>
struct ValueAndGrads {
  BasicTensor<T> value;
  std::vector<BasicTensor<T>> grads;
};

namespace autodiff::detail {

template <class F>
concept CellLike = requires {
  typename std::remove_cvref_t<F>::value_type;
}
&&std::is_base_of_v<nn::BasicDynamicCell<typename std::remove_cvref_t<F>::value_type>, std::remove_cvref_t<F>>;

// The mode a function runs in: a cell's own, otherwise the context's.
template <class F>
Mode mode_of() {
  return effective_mode(nn::detail::fixed_mode_of<F>());
}

template <class T>
std::vector<nn::BasicParameter<T>*> parameters_of(const std::vector<nn::NamedParameter<T>>& named) {
  std::vector<nn::BasicParameter<T>*> out;
  out.reserve(named.size());
  for (const auto& p : named) out.push_back(p.parameter);
  return out;
}

// Returns f(integral_constant<K>) for K = position, K in 0..Count-1: a runtime position
// picks a compile-time instantiation.
template <std::size_t Count, class F>
auto at_position(std::size_t position, F&& f) {
  decltype(f(std::integral_constant<std::size_t, 0>{})) result{};
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ((position == K ? (void)(result = f(std::integral_constant<std::size_t, K>{})) : void()), ...);
  }
  (std::make_index_sequence<Count>{});
  return result;
}

// After a backward pass for `weights`, two mistakes that would otherwise train nothing, quietly:
// a pass that reached none of them (all their gradients zero: they are another network's, an
// optimiser made over net1.parameters() training net2), and, asked of `network` (a pointer to
// a cell, or nullptr), a parameter that got a gradient but is neither one of `weights` nor a parameter of
// the network (read in construct but missing from DUET_CELL_MEMBERS: neither trained nor saved).
template <class W, class Network>
void check_weights_reached(const std::vector<nn::BasicParameter<W>*>& weights, Network network,
                           const std::string& who) {
  const std::uint64_t pass = duet::detail::current_backward_pass();
  const auto trainable = std::ranges::count_if(weights, [](const auto* p) { return p->requires_grad; });
  if (trainable > 0 && std::ranges::none_of(weights, [&](const auto* p) { return p->has_grad_from(pass); })) {
    throw ValueError(who + ": no gradient reaches any of the " + std::to_string(trainable) +
                     " trainable parameters it is differentiated with respect to, so every gradient would be zero and "
                     "training would do nothing; are they another network's (an optimizer made over "
                     "net1.parameters() training net2), or read only through ops::stop_gradient?");
  }
  if constexpr (!std::is_same_v<Network, std::nullptr_t>) {
    const auto registered = network->parameters();
    for (const void* written : duet::detail::written_in_pass()) {
      const auto is = [&](const auto* p) { return static_cast<const void*>(p) == written; };
      if (std::ranges::any_of(weights, is) ||
          std::ranges::any_of(registered, [&](const auto& named) { return is(named.parameter); })) {
        continue;
      }
      const auto* p = static_cast<const nn::BasicParameter<W>*>(written);
      throw ValueError(who + ": a parameter of shape " + to_string(p->shape()) + " gets a gradient but is not a "
                       "parameter of " + network->type_name() + " (a construct reads it, but the cell that holds it "
                       "does not list it in DUET_CELL_MEMBERS(...)), so it would be neither trained nor saved");
    }
  }
}

}  // namespace autodiff::detail

// Whether value_and_grad was given an input to differentiate: known when it was given a
// position or none, known only at run time when given a std::optional. Each backward graph is
// a compile-time instantiation (the whole graph-mode pipeline), so a function asked for its
// weights' gradients alone does not build its inputs' too.
enum class InputGradient { none, given, optional };

// A function with its gradient: what value_and_grad and grad return. Calls run the function
// forward and backward in its mode; parameters' gradients are also left in their grad tensors.
// W is the weights' element type, or void for none (then the function's output type is what
// is differentiated).
template <class Fn, class W = void, InputGradient Input = InputGradient::given>
class GradFunction {
  using FnRef = std::remove_reference_t<Fn>;
  using WeightType = std::conditional_t<std::is_void_v<W>, float, W>;

  // The training graph runs at a cell's debug level (JitConfig{.debug_level = DebugLevel::debug}):
  // its forward and backward nodes are checked as its forward graph alone is, so that a NaN in
  // training names the node that made it, not only the gradient the optimiser refuses later.
  // The rest of the cell's JitConfig is the default's, as before.
  static constexpr JitConfig training_config = [] {
    JitConfig config{};
    if constexpr (requires { std::remove_cvref_t<Fn>::jit_config; }) {
      config.debug_level = std::remove_cvref_t<Fn>::jit_config.debug_level;
    }
    return config;
  }();

  // The element type of fn's value on tensors like X...
  template <class... X>
  using value_t = typename decltype(std::declval<FnRef&>()(tensor_of(std::declval<const X&>())...))::value_type;

 public:
  GradFunction(Fn fn, std::vector<nn::BasicParameter<WeightType>*> weights, std::optional<std::size_t> grad_position)
      : fn_(std::forward<Fn>(fn)), weights_(std::move(weights)), grad_position_(grad_position) {}

  template <class... X>
  ValueAndGrads<value_t<X...>> operator()(const X&... xs) {
    using V = value_t<X...>;
    // An integer function's gradient would be zeros in the integer type: a wrong answer in silence.
    static_assert(std::is_floating_point_v<V>,
                  "duet::value_and_grad: the function's value has an integer element type (an int32 tensor, or "
                  "argmax's output), and gradients exist only for floating-point values, as in PyTorch; "
                  "differentiate a floating-point function");
    static_assert(std::is_void_v<W> || std::is_same_v<V, W>,
                  "duet::value_and_grad: the function's value and the weights have different element types");
    ValueAndGrads<V> out;
    const auto with_input = [&] {
      check_position<V, X...>();
      BasicTensor<V> input_grad;
      out.value = forward_backward<true>(input_grad, xs...);
      out.grads.push_back(std::move(input_grad));
    };
    const auto without_input = [&] {
      BasicTensor<V> unused;
      out.value = forward_backward<false>(unused, xs...);
    };
    if constexpr (Input == InputGradient::given) with_input();
    else if constexpr (Input == InputGradient::none) without_input();
    else grad_position_ ? with_input() : without_input();
    if constexpr (!std::is_void_v<W>) {
      check_weights_reached();
      const std::uint64_t pass = duet::detail::current_backward_pass();
      for (nn::BasicParameter<W>* p : weights_) {
        const bool reached = p->requires_grad && p->has_grad_from(pass);
        out.grads.push_back(reached ? p->grad.clone() : zeros<W>(p->shape()));
        out.grads.back().mark_gradient_of(p, reached);
      }
    }
    return out;
  }

  // The checks of autodiff::detail::check_weights_reached, of the last call's backward pass
  // (the registration check on the first call only: it is the network's structure).
  void check_weights_reached() {
    if constexpr (autodiff::detail::CellLike<Fn>) {
      if (!weights_checked_) {
        weights_checked_ = true;
        autodiff::detail::check_weights_reached(weights_, &fn_, "duet::value_and_grad");
        return;
      }
    }
    autodiff::detail::check_weights_reached(weights_, nullptr, "duet::value_and_grad");
  }

  // The value, with the gradients left in the parameters' grad tensors and none copied out:
  // a training step's first half.
  template <class... X>
  BasicTensor<value_t<X...>> value_and_parameter_grads(const X&... xs) {
    BasicTensor<value_t<X...>> unused;
    return forward_backward<false>(unused, xs...);
  }

 private:
  // Inputs of another element type than the value's (integer labels, say) have no gradient.
  template <class V, std::size_t K, class... X>
  static constexpr bool differentiable_input() {
    return std::is_same_v<typename std::tuple_element_t<K, std::tuple<X...>>::value_type, V>;
  }

  template <class V, class... X>
  void check_position() const {
    if (*grad_position_ >= sizeof...(X)) {
      throw ValueError("duet::value_and_grad: grad_position " + std::to_string(*grad_position_) +
                       " is out of range for " + std::to_string(sizeof...(X)) + " inputs");
    }
    const bool ok = autodiff::detail::at_position<sizeof...(X)>(
        *grad_position_, [](auto k) { return differentiable_input<V, decltype(k)::value, X...>(); });
    if (!ok) {
      throw ValueError("duet::value_and_grad: input " + std::to_string(*grad_position_) +
                       " (grad_position) is not of the element type being differentiated");
    }
  }

  // One step: what its forward pass changes (BatchNorm's moving statistics, Dropout's
  // generator) stays only if forward and backward both succeed.
  // A cell whose construct does not take what the call gives (a training step given the input
  // without the target): said once, before anything is compiled for a call that cannot work.
  template <bool WithInput, class V, class... X>
  BasicTensor<V> forward_backward(BasicTensor<V>& input_grad, const X&... xs) {
    // Asked of the tensors the eager path calls it with, which it compiles anyway.
    using Cell = std::remove_cvref_t<Fn>;
    if constexpr (requires { Cell::template construct_takes<decltype(tensor_of(xs))...>(); }) {
      if constexpr (!Cell::template construct_takes<decltype(tensor_of(xs))...>()) {
        (void)sizeof(nn::detail::construct_not_taking<Cell>);
        return {};
      } else {
        return forward_backward_taken<WithInput>(input_grad, xs...);
      }
    } else {
      return forward_backward_taken<WithInput>(input_grad, xs...);
    }
  }

  template <bool WithInput, class V, class... X>
  BasicTensor<V> forward_backward_taken(BasicTensor<V>& input_grad, const X&... xs) {
    if (autodiff::Tape* outer = autodiff::active_tape()) outer->note_gradient_within();
    if constexpr (autodiff::detail::CellLike<Fn>) {
      // A network's gradient over no sample is zeros (a mean loss over no row is 0), which an
      // optimiser step would still apply: momentum and the step count move the parameters.
      if (((tensor_of(xs).numel() == 0) || ...)) {
        throw ValueError("duet::value_and_grad: the batch is empty, so the loss would be 0 and every gradient zero, "
                         "which an optimiser step would still apply; give at least one sample");
      }
      if (!phase_checked_) {
        fn_.ensure_named();
        fn_.warn_if_phase_unchosen(std::cerr);
        for (auto& [path, cell] : fn_.cells_and_names()) {
          if (cell->depends_on_phase()) phase_layers_.push_back({cell->label(), [c = cell] { return c->training(); }});
        }
        phase_checked_ = true;
      }
      warn_if_back_from_evaluation(std::cerr);
    }
    duet::detail::StepScope step;
    BasicTensor<V> value = forward_backward_in_mode<WithInput>(input_grad, xs...);
    step.commit();
    return value;
  }

  // A gradient through those layers all set to evaluate, after earlier ones with them in
  // training, is almost always a validation pass that did not call set_train(true) after it
  // (TrainOneStepCell refuses it): training goes on with BatchNorm on its moving statistics
  // and Dropout off, and nothing fails. Said once per gradient function; a few flag reads a step.
  void warn_if_back_from_evaluation(std::ostream& out) {
    if (std::ranges::any_of(phase_layers_, [](const PhaseLayer& l) { return l.training(); })) {
      trained_ = true;
      return;
    }
    if (!trained_ || evaluation_warned_) return;
    evaluation_warned_ = true;
    out << "duet: warning: a gradient is taken through " << phase_layers_.front().label
        << ", set to evaluate, after earlier gradients with it in training: a validation that did not call "
           "set_train(true) after it? Training goes on with BatchNorm on its moving statistics and Dropout off; "
           "call set_train(true) on the network before the next step (said once)\n";
  }

  // A cell fixed to PyNative mode runs on the tape whatever the context says, so its graph
  // form is not compiled: that would cost the build and refuse what such a construct may do
  // (reassign x, call code of Tensors).
  template <bool WithInput, class V, class... X>
  BasicTensor<V> forward_backward_in_mode(BasicTensor<V>& input_grad, const X&... xs) {
    // (Nested, because asking Capturable deduces construct's result on symbolic tensors.)
    if constexpr (nn::detail::fixed_mode_of<Fn>() != PYNATIVE_MODE) {
      if constexpr (graph::Capturable<FnRef&, X...>) {
        if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE) return run_graph<WithInput>(input_grad, xs...);
      } else if constexpr (!WithInput && autodiff::detail::CellLike<Fn>) {
        if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE && can_trace()) return traced_step(xs...);
      } else if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE && can_trace()) {
        log_runs_on_tape();
      }
    }
    return run_eager<WithInput>(input_grad, xs...);
  }

  static bool can_trace() { return autodiff::active_tape() == nullptr && pijit::active_trace() == nullptr; }

  // Graph mode that takes a gradient on PyNative's tape, step by step, is said once: its
  // results are right, only its speed is PyNative's.
  void log_runs_on_tape() const {
    if constexpr (autodiff::detail::CellLike<Fn>) {
      duet::detail::log_not_compiled("duet::grad/value_and_grad: the gradient of " + fn_.label() +
                                     ", a network built at run time, with respect to its input runs on PyNative's "
                                     "tape in graph mode; graph mode traces and replays parameters' gradients only");
    } else {
      duet::detail::log_not_compiled(
          "duet::grad/value_and_grad: a function that runs on real tensors (one taking const duet::Tensor&, or "
          "calling a network built at run time) runs on PyNative's tape in graph mode, not compiled or traced; "
          "differentiate a cell instead (nn::WithLossCell with_loss(net, loss), then value_and_grad(with_loss, "
          "net.parameters()), or nn::TrainOneStepCell), or a generic lambda if it calls no network built at run "
          "time");
    }
  }

  // Graph mode for a cell built at run time (it has no construct to capture), or whose capture
  // is ambiguous (graph::Sym::ambiguity): the whole step, forward, loss and backward,
  // is traced on the first call for each input signature and structure, and replayed after
  // (PIJit, default JitConfig). Parameters' gradients are written by the replay's gradient
  // steps, as the tape's backward writes them. Its first argument is the cell tree's structure
  // key (BasicDynamicCell::structure_key): a network changed since the trace is traced again.
  // The step runs the network alone, whatever weights this function returns, so it is kept with
  // the network (kept_form): a value_and_grad made on every step replays the first one's trace.
  template <class... X>
  auto traced_step(const X&... xs) {
    using R = BasicTensor<value_t<X...>>;
    using Step =
        JitFunction<JitConfig{}, duet::detail::ErasedCall<R, std::uint64_t, BasicTensor<typename X::value_type>...>>;
    struct GradientStep : Step {
      explicit GradientStep(Step&& step) : Step(std::move(step)) {}
    };
    auto& network = static_cast<nn::BasicDynamicCell<typename FnRef::value_type>&>(fn_);
    return network.template kept_form<GradientStep>([this] {
      return GradientStep(
          Step({&fn_,
                [](void* fn, const std::uint64_t&, const BasicTensor<typename X::value_type>&... x) {
                  if (pijit::Trace* trace = pijit::active_trace()) trace->allow_parameter_gradients();
                  R no_input_grad;
                  return run_eager_on<false>(*static_cast<FnRef*>(fn), std::nullopt, no_input_grad, x...);
                }},
               {.mode = JitMode::PIJit,
                .name = fn_.label() + " forward and backward in graph mode (argument 0: the network's structure)"}));
    })(network.structure_key(), tensor_of(xs)...);
  }

  template <bool WithInput, class V, class... X>
  BasicTensor<V> run_eager(BasicTensor<V>& input_grad, const X&... xs) {
    return run_eager_on<WithInput>(fn_, grad_position_, input_grad, xs...);
  }

  template <bool WithInput, class V, class... X>
  static BasicTensor<V> run_eager_on(FnRef& fn, std::optional<std::size_t> grad_position, BasicTensor<V>& input_grad,
                                     const X&... xs) {
    autodiff::Tape tape;
    std::tuple<BasicTensor<typename X::value_type>...> inputs{tensor_of(xs)...};
    BasicTensor<V> value;
    {
      autodiff::Recording recording(&tape);
      EagerScope eager;
      if constexpr (WithInput) {
        autodiff::detail::at_position<sizeof...(X)>(*grad_position, [&](auto k) {
          if constexpr (differentiable_input<V, decltype(k)::value, X...>())
            tape.watch(std::get<decltype(k)::value>(inputs));
          return 0;
        });
      }
      value = std::apply([&](const auto&... x) { return BasicTensor<V>(fn(x...)); }, inputs);
    }
    tape.backward(value);
    if constexpr (WithInput) {
      autodiff::detail::at_position<sizeof...(X)>(*grad_position, [&](auto k) {
        if constexpr (differentiable_input<V, decltype(k)::value, X...>()) {
          const auto& x = std::get<decltype(k)::value>(inputs);
          const auto* entry = tape.entry_of(x);
          input_grad = entry != nullptr && entry->grad() != nullptr ? entry->grad()->clone() : zeros<V>(x.shape());
        }
        return 0;
      });
    }
    return value;
  }

  template <bool WithInput, class V, class... X>
  BasicTensor<V> run_graph(BasicTensor<V>& input_grad, const X&... xs) {
    if constexpr (autodiff::detail::CellLike<Fn>) {
      if (fn_.has_hooks_in_tree()) {
        throw ModeError(fn_.label() + " is differentiated in graph mode, but " + fn_.hook_holder() +
                        " has a hook; hooks run in PyNative mode only");
      }
      fn_.ensure_named();  // an ambiguous capture names its layers
    }
    // The forward is captured once per function object, thread and phase, as a cell's graph
    // form is (nn::Cell::captured): construct's C++ runs at the first step, not at every one,
    // and what it reads then is a constant of the graph. Keyed by the id and the address: a
    // copy of this function (same id) holds another fn_.
    const auto capture = [&](auto phase) -> const auto& {
      return pipeline::captured_once(std::pair(id_, static_cast<const void*>(this)), [&] {
        return pipeline::compile<JitConfig{}, true,
                                 pipeline::Input<typename X::value_type,
                                                 graph::pattern_in_phase<decltype(phase)::value,
                                                                         typename graph::pattern_of<X>::type>>...>(
            [&](const auto&... in) { return fn_(in...); });
      });
    };
    return pipeline::in_requested_phase(capture, [&](const auto& forward) -> BasicTensor<V> {
      if (!forward.ambiguity.empty()) {
        if constexpr (!WithInput && autodiff::detail::CellLike<Fn>) {
          if (can_trace()) {
            duet::detail::log_ambiguous_capture(where()(), forward.ambiguity.str(),
                                                "forward and backward as a traced graph (PIJit)");
            return traced_step(xs...);
          }
        }
        duet::detail::log_ambiguous_capture(where()(), forward.ambiguity.str(),
                                            "forward and backward in PyNative mode");
        return run_eager<WithInput>(input_grad, xs...);
      }
      duet::detail::begin_backward_pass();
      if constexpr (WithInput) {
        return autodiff::detail::at_position<sizeof...(X)>(*grad_position_, [&](auto k) {
          if constexpr (differentiable_input<V, decltype(k)::value, X...>()) {
            auto training = autodiff::build_backward<decltype(k)::value>(forward, &input_grad);
            return BasicTensor<V>(pipeline::execute<training_config>(id_, training, where(), tensor_of(xs)...));
          } else {
            return BasicTensor<V>();
          }
        });
      } else {
        auto training = autodiff::build_backward<>(forward);
        return BasicTensor<V>(pipeline::execute<training_config>(id_, training, where(), tensor_of(xs)...));
      }
    });
  }

  // What messages call the function: the cell's construct, or "the differentiated function".
  auto where() const {
    if constexpr (autodiff::detail::CellLike<Fn>) return [this] { return fn_.type_name() + "::construct"; };
    else return [] { return std::string("the differentiated function"); };
  }

  Fn fn_;
  std::vector<nn::BasicParameter<WeightType>*> weights_;
  std::optional<std::size_t> grad_position_;
  std::uint64_t id_ = duet::detail::new_plan_owner();
  duet::detail::OwnForms forms_;  // traced_step's
  bool phase_checked_ = false;  // the first call warns of layers nobody set_train-ed
  struct PhaseLayer {
    std::string label;
    std::function<bool()> training;
  };
  std::vector<PhaseLayer> phase_layers_;  // BatchNorm, Dropout: the layers found at the first call
  bool trained_ = false;                  // an earlier call ran one of them in training
  bool evaluation_warned_ = false;
  bool weights_checked_ = false;
};

// MindSpore's value_and_grad(fn, grad_position, weights). fn is a cell (kept by reference) or
// a function of tensors; weights a cell's parameters() or any list of them. A grad_position
// of std::nullopt is MindSpore's None: no input's gradient.
template <class Fn>
auto value_and_grad(Fn&& fn, std::size_t grad_position = 0) {
  return GradFunction<Fn, void>(std::forward<Fn>(fn), {}, grad_position);
}
template <class Fn>
auto value_and_grad(Fn&& fn, std::optional<std::size_t> grad_position) {
  return GradFunction<Fn, void, InputGradient::optional>(std::forward<Fn>(fn), {}, grad_position);
}
template <class Fn, ElementType T>
auto value_and_grad(Fn&& fn, std::vector<nn::BasicParameter<T>*> weights) {
  return GradFunction<Fn, T, InputGradient::none>(std::forward<Fn>(fn), std::move(weights), std::nullopt);
}
template <class Fn, ElementType T>
auto value_and_grad(Fn&& fn, std::vector<nn::BasicParameter<T>*> weights, std::size_t grad_position) {
  return GradFunction<Fn, T>(std::forward<Fn>(fn), std::move(weights), grad_position);
}
template <class Fn, ElementType T>
auto value_and_grad(Fn&& fn, std::vector<nn::BasicParameter<T>*> weights, std::optional<std::size_t> grad_position) {
  return GradFunction<Fn, T, InputGradient::optional>(std::forward<Fn>(fn), std::move(weights), grad_position);
}
template <class Fn, ElementType T, class... Position>
  requires(sizeof...(Position) <= 1)
auto value_and_grad(Fn&& fn, const std::vector<nn::NamedParameter<T>>& weights, Position... grad_position) {
  return value_and_grad(std::forward<Fn>(fn), autodiff::detail::parameters_of(weights), grad_position...);
}

// MindSpore's grad: the gradients alone. grad(fn) and grad(fn, k) give the gradient of input 0
// or k; with weights, the list of gradients.
template <class Fn, class... Weights>
auto grad(Fn&& fn, Weights&&... weights_and_position) {
  auto vg = value_and_grad(std::forward<Fn>(fn), std::forward<Weights>(weights_and_position)...);
  return [vg = std::move(vg)](const auto&... xs) mutable {
    auto out = vg(xs...);
    if constexpr (sizeof...(Weights) == 0 || (std::is_integral_v<std::remove_cvref_t<Weights>> && ...))
      return std::move(out.grads.front());
    else
      return std::move(out.grads);
  };
}

}  // namespace duet
