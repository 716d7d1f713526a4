// duet::compare_modes: where PyNative and graph mode disagree on one network, and
// duet::runs_in_both_modes: whether a network captures as a static graph at all.
//
// Both modes run the same kernels, so they agree bit for bit (README, Guarantees); when they
// do not (a user's operation whose fused graph form computes something else, BatchNorm folded
// at evaluation), the output alone does not say where. compare_modes runs the network once
// in each mode on the same weights and inputs and reads every intermediate value of both:
// PyNative's from a trace that keeps them (pijit::Trace::keep_values), graph mode's from the
// evaluator as each node runs (run_observed). It walks graph mode's nodes in the order they
// run and pairs each with the PyNative operations it stands for: a fused node
// ("MatMul + BiasAdd + ReLU") with that run of operations, whose last makes its value.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <optional>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "autodiff.hpp"
#include "cell.hpp"
#include "context.hpp"
#include "error.hpp"
#include "evaluator.hpp"
#include "graph.hpp"
#include "nn/wrap.hpp"
#include "parameter.hpp"
#include "pipeline.hpp"
#include "tensor.hpp"
#include "trace.hpp"

namespace duet {

// Whether Net captures as a static graph for inputs of shape Pattern (duet::shape<dyn, 784>'s
// type, StaticShape<dyn, 784>), so that graph mode runs it as one: a Cell with a generic
// construct whose operations all accept that shape. A network built at run time, a construct
// of duet::Tensor, or a cell calling one (WithLossCell over a DynamicSequentialCell) is traced
// or runs eagerly instead. Checked while the program compiles, as graph capture's own shape
// checks are; a capture found ambiguous when it runs (README: "Shared values in graph mode")
// still runs traced.
namespace detail {
// A cell graph capture may call: not built at run time, generic, calling nothing built so.
template <class Net>
concept capture_candidate =
    !nn::RuntimeBuilt<Net> && !nn::NonGenericConstruct<Net> && nn::capturable_construct<Net>();
}  // namespace detail

template <class Net, class Pattern = graph::AnyShape>
concept runs_in_both_modes =
    detail::capture_candidate<Net> && requires(Net& net) { net(graph::input<typename Net::value_type, Pattern>()); };

// Tolerances as numpy.isclose's: graph's value g agrees with PyNative's p when
// |g - p| <= atol + rtol * |p|, or both are NaN. The defaults ask for what the modes promise:
// the same values, bit for bit (a folded BatchNorm at evaluation needs about rtol 2e-6).
struct CompareOptions {
  double rtol = 0;
  double atol = 0;
};

// One value on which the modes disagree.
struct ModeDifference {
  std::string stage = {};      // "forward", "output" (the whole network) or "gradient"
  std::size_t node = 0;   // forward: %node of graph_ir's optimized dump
  std::string operation = {};  // forward: "MatMul + BiasAdd + ReLU"; gradient: the parameter's name
  std::string cell = {};       // the layer that runs it, "nn::Dense<784, 512> 'dense_relu_sequential.0'",
                               // or the cell whose construct calls it
  Shape shape = {};
  index_t element = 0;           // the worst element, row-major
  std::vector<index_t> index = {};    // the same, one index per axis
  double graph = 0;              // its value in graph mode
  double pynative = 0;           // and in PyNative mode
  double max_abs_error = 0;      // over the value's elements
  double max_rel_error = 0;      // |g - p| / |p|, over elements where p is not 0
};

struct ModeReport {
  std::optional<ModeDifference> difference = {};  // the first, in the order graph mode runs
  std::size_t values_compared = 0;
  // What could not be compared, and why (a graph node no PyNative operation stands for).
  std::vector<std::string> notes = {};

  bool empty() const { return !difference.has_value(); }
  bool agree() const { return empty(); }
  std::string to_string() const;
};

inline std::ostream& operator<<(std::ostream& os, const ModeReport& report) { return os << report.to_string(); }

namespace detail {

// The worst element of graph's value against PyNative's, and whether any is beyond tolerance.
struct ValueComparison {
  bool differs = false;
  index_t worst = 0;
  double graph = 0, pynative = 0, max_abs = 0, max_rel = 0;
};

template <class T>
ValueComparison compare_values(const T* g, const T* p, index_t n, const CompareOptions& options) {
  ValueComparison c;
  double worst_excess = -1;
  for (index_t i = 0; i < n; ++i) {
    const auto a = static_cast<double>(g[i]);
    const auto b = static_cast<double>(p[i]);
    if (std::isnan(a) && std::isnan(b)) continue;
    // A NaN on one side only is the worst there is.
    const double abs = std::isnan(a) || std::isnan(b) ? INFINITY : std::fabs(a - b);
    const double excess = abs - (options.atol + options.rtol * std::fabs(b));
    if (abs > c.max_abs) c.max_abs = abs;
    if (b != 0 && abs / std::fabs(b) > c.max_rel) c.max_rel = abs / std::fabs(b);
    if (excess > 0) c.differs = true;
    if (excess > worst_excess) {
      worst_excess = excess;
      c.worst = i;
      c.graph = a;
      c.pynative = b;
    }
  }
  return c;
}

// Whether this program's flags let the compiler fuse a * b + c into one rounding on its own
// (g++'s -ffp-contract=fast, its default in GNU mode, -std=gnu++20, wherever FMA is enabled,
// as by -march=native): one operation's eager and graph code are then fused differently, and
// the modes may differ in the last bits. (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 in one rounding
// and 0 in two; the values come through volatile, so that nothing is folded at compile time.
inline bool fuses_multiply_add() {
  volatile float a = 1.0f + 0x1p-12f;
  volatile float c = -(1.0f + 0x1p-11f);
  const float x = a;
  const float z = c;
  return x * x + z != 0.0f;
}

inline std::vector<index_t> index_of_element(const Shape& shape, index_t flat) {
  std::vector<index_t> index(static_cast<std::size_t>(shape.rank()));
  for (int a = shape.rank(); a-- > 0;) {
    index[static_cast<std::size_t>(a)] = shape[a] == 0 ? 0 : flat % shape[a];
    flat = shape[a] == 0 ? 0 : flat / shape[a];
  }
  return index;
}

template <class T>
void record_comparison(ModeReport& report, const T* g, const T* p, const Shape& shape, ModeDifference where,
                       const CompareOptions& options) {
  ++report.values_compared;
  if (report.difference) return;
  const ValueComparison c = compare_values(g, p, shape.numel(), options);
  if (!c.differs) return;
  where.shape = shape;
  where.element = c.worst;
  where.index = index_of_element(shape, c.worst);
  where.graph = c.graph;
  where.pynative = c.pynative;
  where.max_abs_error = c.max_abs;
  where.max_rel_error = c.max_rel;
  report.difference = std::move(where);
}

// "Add(Mul(Add(a, b), c), d)", a fused elementwise chain's tree (ops::ElementwiseOp): its
// functions each after its operands, {"Add", "Mul", "Add"}, the order PyNative ran them in. A
// user's operation may be named anything: an unmatched parenthesis is not a function.
inline void elementwise_tree_parts(std::string_view tree, std::vector<std::string>& parts) {
  std::vector<std::string_view> open;
  std::size_t begin = 0;
  for (std::size_t i = 0; i < tree.size(); ++i) {
    const char c = tree[i];
    if (c == '(') open.push_back(tree.substr(begin, i - begin));
    if (c == ')' && !open.empty()) {
      parts.emplace_back(open.back());
      open.pop_back();
    }
    if (c == '(' || c == ')' || c == ',' || c == ' ') begin = i + 1;
  }
}

// "MatMul + BiasAdd + ReLU" -> {"MatMul", "BiasAdd", "ReLU"}: the operations a fused node
// took in, each a step of PyNative's trace. An elementwise chain's tree counts as its steps:
// unpaired, they were left for a later node of the same name and shape to pair with, which
// then compared two different values and reported modes that agree as differing.
inline std::vector<std::string> fused_parts(const std::string& op_name) {
  constexpr std::string_view elementwise = "Elementwise ";
  std::vector<std::string> parts;
  std::size_t begin = 0;
  const auto add = [&](std::string_view part) {
    if (part.starts_with(elementwise)) elementwise_tree_parts(part.substr(elementwise.size()), parts);
    else parts.emplace_back(part);
  };
  for (std::size_t plus; (plus = op_name.find(" + ", begin)) != std::string::npos; begin = plus + 3) {
    add(std::string_view(op_name).substr(begin, plus - begin));
  }
  add(std::string_view(op_name).substr(begin));
  return parts;
}

// Pairs graph nodes, in the order they run, with the trace's steps: the first run of steps
// not paired yet whose names are the node's parts and whose last makes a value of its shape.
// Not only runs after the last one paired: graph mode may run a node before one PyNative
// ran first (the pieces of ops::split, each computed where it is used), and such a node would
// find its steps passed. Nor only by name and shape: runs that read the values paired with the
// node's inputs come first, then a layer's node is paired with its own layer's steps, since
// graph mode runs nodes in post-order and PyNative in construct's order (`s = side(x); o =
// fc2(fc1(x));` runs fc2 before side in graph mode, one operation on one shape; a recurrent
// cell's layer, called at every step on one shape, runs its steps in another order).
class TracePairing {
 public:
  explicit TracePairing(const pijit::Trace& trace) : trace_(trace), paired_(trace.steps().size(), false) {}

  // The trace's value standing for a node whose operation `label()` gives `label` and whose
  // inputs are (among others) the trace's values `fed_by`, or the values' count.
  std::size_t pair(const std::string& op_name, const std::string& label, const Shape& shape,
                   std::span<const std::size_t> fed_by) {
    const std::vector<std::string> parts = fused_parts(op_name);
    while (first_free_ < paired_.size() && paired_[first_free_]) ++first_free_;
    const auto in_layer = [&](const std::string& cell) { return of_layer(label, cell); };
    const auto anywhere = [](const std::string&) { return true; };
    const std::size_t none = trace_.values().size();
    if (!fed_by.empty()) {
      if (const std::size_t v = first_run(parts, shape, fed_by, in_layer); v < none) return v;
      if (const std::size_t v = first_run(parts, shape, fed_by, anywhere); v < none) return v;
      if (const std::size_t v = first_apart(parts, shape, fed_by); v < none) return v;
    }
    if (const std::size_t v = first_run(parts, shape, {}, in_layer); v < none) return v;
    return first_run(parts, shape, {}, anywhere);
  }

 private:
  // Whether a step made in `cell` belongs to the layer `label` names: the layer itself, or the
  // first of a fused pair ("nn::Conv2d<...> 'conv' + nn::BatchNorm2d<...> 'bn'").
  static bool of_layer(const std::string& label, const std::string& cell) {
    return !cell.empty() && label.starts_with(cell) &&
           (label.size() == cell.size() || std::string_view(label).substr(cell.size()).starts_with(" + "));
  }

  template <class InCell>
  std::size_t first_run(const std::vector<std::string>& parts, const Shape& shape, std::span<const std::size_t> fed_by,
                        InCell in_cell) {
    const auto& steps = trace_.steps();
    const auto& values = trace_.values();
    for (std::size_t s = first_free_; s + parts.size() <= steps.size(); ++s) {
      bool same = in_cell(values[steps[s]->output].cell);
      for (std::size_t k = 0; k < parts.size() && same; ++k) {
        same = !paired_[s + k] && stands_for(steps[s + k]->op_name(), parts[k]);
      }
      const std::size_t out = steps[s + parts.size() - 1]->output;
      if (same && values[out].shape == shape && values[out].data != nullptr && reads_all(s, parts.size(), fed_by)) {
        std::fill_n(paired_.begin() + static_cast<std::ptrdiff_t>(s), parts.size(), true);
        return out;
      }
    }
    return values.size();
  }

  // A fused node's parts that PyNative ran apart, in the order the compiler evaluated an
  // expression's operands: `(1 - z) * n + z * h` may run z * h, then (1 - z) * n, then +, and the
  // adjacent steps (1 - z) * n, + belong to another node. The last part's step, with the earlier
  // parts found among the unpaired steps that make its inputs (and theirs), reading `fed_by`.
  std::size_t first_apart(const std::vector<std::string>& parts, const Shape& shape,
                          std::span<const std::size_t> fed_by) {
    const auto& steps = trace_.steps();
    const auto& values = trace_.values();
    if (parts.size() < 2) return values.size();
    std::vector<std::size_t> producer(values.size(), steps.size());
    for (std::size_t s = 0; s < steps.size(); ++s) producer[steps[s]->output] = s;
    for (std::size_t last = first_free_; last < steps.size(); ++last) {
      const std::size_t out = steps[last]->output;
      if (paired_[last] || !stands_for(steps[last]->op_name(), parts.back()) || values[out].shape != shape ||
          values[out].data == nullptr) {
        continue;
      }
      std::vector<std::size_t> taken{last};
      std::vector<std::string> left(parts.begin(), parts.end() - 1);
      for (std::size_t k = 0; k < taken.size() && !left.empty(); ++k) {
        for (const std::size_t v : steps[taken[k]]->inputs) {
          const std::size_t s = producer[v];
          if (s == steps.size() || paired_[s] || std::ranges::find(taken, s) != taken.end()) continue;
          const auto part = std::ranges::find_if(left, [&](const std::string& p) { return stands_for(steps[s]->op_name(), p); });
          if (part == left.end()) continue;
          left.erase(part);
          taken.push_back(s);
        }
      }
      if (left.empty() && reads_all(taken, fed_by)) {
        for (const std::size_t s : taken) paired_[s] = true;
        return out;
      }
    }
    return values.size();
  }

  // Whether the run of `count` steps from `first` reads each value of `fed_by`.
  bool reads_all(std::size_t first, std::size_t count, std::span<const std::size_t> fed_by) const {
    std::vector<std::size_t> run(count);
    for (std::size_t k = 0; k < count; ++k) run[k] = first + k;
    return reads_all(run, fed_by);
  }
  bool reads_all(std::span<const std::size_t> run, std::span<const std::size_t> fed_by) const {
    const auto& steps = trace_.steps();
    return std::ranges::all_of(fed_by, [&](std::size_t v) {
      return std::ranges::any_of(run, [&](std::size_t s) { return std::ranges::find(steps[s]->inputs, v) != steps[s]->inputs.end(); });
    });
  }

  // A folded part ("BatchNorm(folded)", the normalisation taken into a convolution's weight
  // at evaluation) stands for the PyNative step it replaced ("BatchNorm (moving statistics)"):
  // compared, so that where the folding moves the values is the node the report names. A
  // packed product ("PackedMatMul", its weight read from the packed copy) stands for the
  // product PyNative ran ("MatMul").
  static bool stands_for(const std::string& step, const std::string& part) {
    constexpr std::string_view folded = "(folded)";
    constexpr std::string_view packed = "Packed";
    if (part.starts_with(packed)) return step == std::string_view(part).substr(packed.size());
    if (part.size() <= folded.size() || !part.ends_with(folded)) return step == part;
    return step.starts_with(std::string_view(part).substr(0, part.size() - folded.size()));
  }

  const pijit::Trace& trace_;
  std::vector<bool> paired_;
  std::size_t first_free_ = 0;
};

// Switches the global context's mode for its lifetime.
class ContextModeScope {
 public:
  explicit ContextModeScope(Mode mode) : saved_(get_context().mode) { set_context({.mode = mode}); }
  ContextModeScope(const ContextModeScope&) = delete;
  ContextModeScope& operator=(const ContextModeScope&) = delete;
  ~ContextModeScope() { set_context({.mode = saved_}); }

 private:
  Mode saved_;
};

// The forward pass in both modes, node by node. Each run is a step that does not commit, so
// both start from the network as it was (BatchNorm's statistics, Dropout's generator) and
// leave it so.
template <class Net, class... X>
void compare_forward(ModeReport& report, Net& net, const CompareOptions& options, const X&... xs) {
  using T = typename Net::value_type;
  pijit::Trace trace;
  trace.keep_values();
  auto inputs = std::make_tuple(BasicTensor<typename X::value_type>(tensor_of(xs))...);
  [&]<std::size_t... K>(std::index_sequence<K...>) { (trace.add_input(std::get<K>(inputs), K), ...); }
  (std::index_sequence_for<X...>{});
  BasicTensor<T> pynative_out;
  {
    const StepScope discarded;
    const pijit::Tracing tracing(&trace);
    const EagerScope eager;
    pynative_out = std::apply([&](const auto&... in) { return BasicTensor<T>(net(in...)); }, inputs);
  }

  constexpr JitConfig Config = nn::detail::graph_config_of<Net>();
  // The program the cell's own graph-mode calls run, kept since the first of them: a value
  // construct read then (a member flag, a scale) is a constant of it, and may differ from
  // what PyNative reads now; capturing afresh would hide that.
  const auto capture = [&](auto phase) -> const auto& {
    return net.template graph_program<decltype(phase)::value, typename graph::pattern_of<X>::type...>(tensor_of(xs)...);
  };
  pipeline::in_requested_phase(capture, [&](const auto& program) {
    if (!program.ambiguity.empty()) {
      // Graph mode runs such a network as a trace of PyNative's own operations (README,
      // "Shared values in graph mode"): there are no graph nodes to pair, only the output.
      report.notes.push_back("the capture is ambiguous (" + program.ambiguity.str() +
                             "), so graph mode runs it traced (PIJit): only the output is compared");
      const StepScope discarded;
      const ContextModeScope graph_mode(GRAPH_MODE);
      const BasicTensor<T> graph_out(net(tensor_of(xs)...));
      if (graph_out.shape() == pynative_out.shape()) {
        record_comparison(report, graph_out.data(), pynative_out.data(), graph_out.shape(),
                          ModeDifference{.stage = "output", .cell = net.label()}, options);
      }
      return 0;
    }
    using G = typename std::remove_cvref_t<decltype(program)>::graph_type;
    TracePairing pairing(trace);
    const std::size_t unpaired = trace.values().size();
    // The trace's value each node stands for, as far as known: the inputs', and each paired node's.
    std::vector<std::size_t> stands_for(G::size, unpaired);
    const auto observe = [&](auto i, const auto* values, const Shape& shape) {
      constexpr std::size_t I = decltype(i)::value;
      using Node = graph::node_at<G, I>;
      // Inputs and parameters are the same tensors in both modes.
      if constexpr (graph::is_input_op_v<typename Node::op_type>) {
        for (std::size_t v = 0; v < trace.values().size(); ++v) {
          const pijit::Value& value = trace.values()[v];
          if (value.kind == pijit::Value::Kind::input && value.input == Node::op_type::index) stands_for[I] = v;
        }
      } else if constexpr (Node::arity > 0) {
        const std::string name = Node::op_type::op_name();
        const std::string label = graph::get<I>(program.graph).op.label();
        std::vector<std::size_t> fed_by;
        for (const std::size_t a : Node::args) {
          if (stands_for[a] != unpaired) fed_by.push_back(stands_for[a]);
        }
        const std::size_t v = pairing.pair(name, label, shape, fed_by);
        if (v == unpaired) {
          report.notes.push_back("%" + std::to_string(I) + " " + name + " : " + duet::to_string(shape) +
                                 ": no PyNative operation stands for it, not compared");
          return;
        }
        stands_for[I] = v;
        const pijit::Value& p = trace.values()[v];
        // The layer the operation names, as graph_ir shows it; else the cell whose construct
        // called it, as PyNative saw it run.
        record_comparison(report, values, static_cast<decltype(values)>(p.data), shape,
                          ModeDifference{.stage = "forward", .node = I, .operation = name,
                                         .cell = label == name ? p.cell : label},
                          options);
      }
    };
    const StepScope discarded;
    const auto tensors = std::make_tuple(tensor_of(xs)...);
    std::apply(
        [&](const auto&... in) {
          const auto p = plan<Config>(program, std::array<Shape, sizeof...(X)>{in.shape()...},
                                      net.type_name() + "::construct");
          run_observed<DefaultBackend, Config>(program, p, observe, in...);
        },
        tensors);
    return 0;
  });
}

template <class Net>
inline constexpr bool is_loss_cell = false;
template <class Backbone, class Loss>
inline constexpr bool is_loss_cell<nn::WithLossCell<Backbone, Loss>> = true;

// Whether the capture of net on inputs like X gives one floating-point number: a loss, though
// not a WithLossCell (a VAE's loss reads the mean and variance the network returns beside its
// output), whose gradients are compared as a WithLossCell's are. Known from the capture's type,
// so that a network of several outputs does not compile a backward graph it never runs.
template <class Net, class... X>
constexpr bool gives_a_loss() {
  return []<std::size_t... K>(std::index_sequence<K...>) {
    using S = std::remove_cvref_t<decltype(std::declval<Net&>()(
        graph::input<typename X::value_type, typename graph::pattern_of<X>::type, K>()...))>;
    if constexpr (requires { S::shape; typename S::value_type; }) {
      return S::shape.rank() == 0 && !S::shape.leading_unknown() && std::is_floating_point_v<typename S::value_type>;
    } else {
      return false;
    }
  }(std::index_sequence_for<X...>{});
}

// The loss's gradients in both modes, PyNative's tape against graph mode's backward graph,
// parameter by parameter in parameters() order. The graph-mode half switches the context for
// its call, so the cell must follow it.
template <class Net, class... X>
void compare_gradients(ModeReport& report, Net& net, const CompareOptions& options, const X&... xs) {
  if constexpr (Net::mode != CONTEXT_MODE) {
    throw ModeError("duet::compare_modes: " + net.label() +
                    " is fixed to one mode, so its gradients cannot be taken in the other; compare the "
                    "gradients of a cell that follows the context (nn::Cell<Net>)");
  } else {
    const auto parameters = net.parameters();
    const auto grads_in = [&](Mode mode) {
      const StepScope discarded;
      const ContextModeScope scope(mode);
      return value_and_grad(net, parameters)(xs...).grads;
    };
    const auto pynative = grads_in(PYNATIVE_MODE);
    const auto graph = grads_in(GRAPH_MODE);
    for (std::size_t k = 0; k < parameters.size(); ++k) {
      record_comparison(report, graph[k].data(), pynative[k].data(), graph[k].shape(),
                        ModeDifference{.stage = "gradient", .operation = parameters[k].name}, options);
    }
  }
}

template <class Net, class... X>
ModeReport compare_modes(Net& net, const CompareOptions& options, const X&... xs) {
  static_assert(capture_candidate<Net> && graph::Capturable<Net&, X...>,
                "duet::compare_modes: the network does not capture as a static graph for this input "
                "(see duet::runs_in_both_modes): graph mode would trace it or run it eagerly");
  net.ensure_named();
  // Graph mode's program may have been captured before the hook was added, and would run
  // without it: refused, as graph mode's own calls refuse it.
  if (net.has_hooks_in_tree()) {
    throw ModeError("duet::compare_modes: " + net.label() + " runs in graph mode for the comparison, but " +
                    net.hook_holder() + " has a hook; hooks see intermediate values in PyNative mode only "
                    "(remove it for the comparison)");
  }
  ModeReport report;
  if (fuses_multiply_add()) {
    report.notes.push_back("this program is compiled so that the compiler fuses a * b + c into one rounding "
                           "(-ffp-contract=fast, g++'s default with -std=gnu++20 and FMA enabled), and may fuse "
                           "PyNative's and graph mode's code differently: the modes may differ in the last bits. "
                           "Compile with -ffp-contract=off (duet's CMake target adds it)");
  }
  compare_forward(report, net, options, xs...);
  if constexpr (!is_loss_cell<Net> && gives_a_loss<Net, X...>() && Net::mode != CONTEXT_MODE) {
    report.notes.push_back("the gradients are not compared: " + net.label() +
                           " is fixed to one mode, so they cannot be taken in the other");
  } else if constexpr (is_loss_cell<Net> || gives_a_loss<Net, X...>()) {
    if (report.empty()) {
      compare_gradients(report, net, options, xs...);
    } else {
      // The first difference stays the report's; whether the gradients follow it is still
      // worth knowing (a BatchNorm folded at evaluation moves the forward's last bits only).
      ModeReport gradients;
      compare_gradients(gradients, net, options, xs...);
      std::ostringstream note;
      if (gradients.agree()) {
        note << "the gradients agree all the same (" << gradients.values_compared << " values compared)";
      } else {
        note << "the gradients differ too, first in parameter '" << gradients.difference->operation
             << "' (max abs error " << gradients.difference->max_abs_error << ")";
      }
      report.notes.push_back(note.str());
    }
  }
  return report;
}

}  // namespace detail

// Runs net on x in PyNative mode and in graph mode, on the same weights, and reports the
// first graph node whose value differs beyond the tolerances. The network is left as it was.
template <class Net, class X>
ModeReport compare_modes(Net& net, const X& x, const CompareOptions& options = {}) {
  return detail::compare_modes(net, options, x);
}

// The same for a construct of two inputs. Given a loss cell (nn::WithLossCell, or any cell
// whose output is one number) and its data and labels, then, if the forward pass agrees, the
// first parameter whose gradient of the loss does not; if it differs, a note says whether the
// gradients agree.
template <class Net, class X, class Y>
ModeReport compare_modes(Net& net, const X& x, const Y& y, const CompareOptions& options = {}) {
  return detail::compare_modes(net, options, x, y);
}

// Three and four inputs (a TD loss of states, rewards and next states). An overload per count
// rather than a pack, so that the options can still be written in braces after the tensors.
template <class Net, class X, class Y, class Z>
ModeReport compare_modes(Net& net, const X& x, const Y& y, const Z& z, const CompareOptions& options = {}) {
  return detail::compare_modes(net, options, x, y, z);
}
template <class Net, class X, class Y, class Z, class W>
ModeReport compare_modes(Net& net, const X& x, const Y& y, const Z& z, const W& w, const CompareOptions& options = {}) {
  return detail::compare_modes(net, options, x, y, z, w);
}

inline std::string ModeReport::to_string() const {
  std::ostringstream os;
  if (!difference) {
    os << "the modes agree (" << values_compared << " values compared)\n";
  } else {
    const ModeDifference& d = *difference;
    os << "the modes differ ";
    if (d.stage == "forward") {
      os << "first at node %" << d.node << " " << d.operation << (d.cell.empty() ? "" : " of " + d.cell);
    } else if (d.stage == "gradient") {
      os << "first in the gradient of parameter '" << d.operation << "'";
    } else {
      os << "at the output of " << d.cell;
    }
    std::string index;
    for (index_t i : d.index) index += (index.empty() ? "" : ", ") + std::to_string(i);
    std::ostringstream values;
    values.precision(9);
    values << "graph " << d.graph << ", PyNative " << d.pynative;
    os << " : " << duet::to_string(d.shape) << "\n  worst element " << d.element << " [" << index << "]: "
       << values.str() << "\n  max abs error " << d.max_abs_error << ", max rel error " << d.max_rel_error << "\n";
  }
  for (const std::string& note : notes) os << "  note: " << note << "\n";
  // Lines end with a newline, the last excepted, so that `std::cout << report << '\n'` prints
  // no blank line, as printing a tensor does.
  std::string text = os.str();
  text.pop_back();
  return text;
}

}  // namespace duet
