// duet::summary: a network's cells with their output shapes and parameter counts, and the
// totals (Keras's model.summary(), torchinfo's summary).
//
// It runs the network once, eagerly, on zeros of the given shape, as torchinfo runs a forward
// pass: every cell, whatever its mode (a graph-mode or jit cell, a runtime-built network that
// graph mode would trace), then runs as in PyNative mode and reports each call, which is how
// each cell's output shape is known. The run changes no parameter and no mode, makes no graph
// or trace of the network, and gives back the random numbers it draws (Dropout's, and
// ops::randn_like's from the global generator); forward hooks run, as in any eager call.
// A duet::jit function the network calls runs compiled, as in any call: the cells it calls are
// not seen ("--").
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <ostream>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cell.hpp"
#include "error.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace duet {

struct SummaryRow {
  std::string name = {};  // the path from the network ("dense_relu_sequential.0"); "" for the network
  std::string type_name = {};  // "nn::Dense<784, 512>", "nn::Dense<dyn, dyn>(4, 8)": the cell's repr()
  int depth = 0;          // 0 for the network, 1 for its members, ...
  std::vector<Shape> output_shapes = {};  // one per call during the summary's run, in order
  index_t parameters = 0;            // elements of the parameters the cell holds itself
  bool has_children = false;
};

struct Summary {
  std::string network = {};  // the network's type name
  std::vector<Shape> input_shapes = {};  // one per input of the network's construct
  std::vector<SummaryRow> rows = {};  // every cell, depth first (cells_and_names order)
  index_t total_parameters = 0;  // each parameter counted once, even if held twice
  index_t trainable_parameters = 0;
  std::size_t parameter_bytes = 0;
  // The stream summary() printed it to: `std::cout << duet::summary(net, shape)` streams it
  // there once, not twice (operator<< of the temporary summary() returns writes nothing more).
  std::ostream* printed_to = nullptr;

  // The table operator<< prints.
  std::string text() const;
};

namespace detail {

// 669706 -> "669,706".
inline std::string with_thousands(std::size_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// "an input of [64, 784]", "inputs of [2, 4] and [2, 3]".
inline std::string inputs_text(const std::vector<Shape>& shapes) {
  if (shapes.size() == 1) return "an input of " + to_string(shapes.front());
  std::string out = "inputs of ";
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == shapes.size() ? " and " : ", ") + to_string(shapes[i]);
  }
  return out;
}

inline std::string output_column(const SummaryRow& row) {
  if (row.output_shapes.empty()) return "--";
  bool all_same = true;
  for (const Shape& s : row.output_shapes) all_same = all_same && s == row.output_shapes.front();
  if (all_same) {
    const std::string one = to_string(row.output_shapes.front());
    const std::size_t calls = row.output_shapes.size();
    return calls == 1 ? one : one + " (" + std::to_string(calls) + " calls)";
  }
  std::string shapes;
  for (const Shape& s : row.output_shapes) shapes += (shapes.empty() ? "" : ", ") + to_string(s);
  return shapes;
}

// A cell made only of others holds no parameters of its own: "--", as torchinfo prints, so
// that the column adds up to the total.
inline std::string parameter_column(const SummaryRow& row) {
  return row.parameters == 0 && row.has_children ? "--" : with_thousands(static_cast<std::size_t>(row.parameters));
}

inline std::string layer_column(const SummaryRow& row) {
  const std::string indent(static_cast<std::size_t>(2 * row.depth), ' ');
  return indent + (row.name.empty() ? row.type_name : row.name + " (" + row.type_name + ")");
}

// Sets the thread's call observer for its lifetime (exceptions included).
template <ElementType T>
class ObservedRun {
 public:
  explicit ObservedRun(const nn::BasicForwardHook<T>& observer)
      : outer_(std::exchange(nn::detail::call_observer<T>, &observer)) {}
  ObservedRun(const ObservedRun&) = delete;
  ObservedRun& operator=(const ObservedRun&) = delete;
  ~ObservedRun() { nn::detail::call_observer<T> = outer_; }

 private:
  const nn::BasicForwardHook<T>* outer_;
};

}  // namespace detail

inline std::string Summary::text() const {
  const std::string headers[3] = {"Layer (type)", "Output Shape", "Param #"};
  std::size_t widths[3] = {headers[0].size(), headers[1].size(), headers[2].size()};
  std::vector<std::array<std::string, 3>> cells;
  for (const SummaryRow& row : rows) {
    cells.push_back({detail::layer_column(row), detail::output_column(row), detail::parameter_column(row)});
    for (std::size_t c = 0; c < 3; ++c) widths[c] = std::max(widths[c], cells.back()[c].size());
  }
  const auto line = [&](const std::string& layer, const std::string& output, const std::string& params) {
    return layer + std::string(widths[0] - layer.size() + 3, ' ') + output +
           std::string(widths[1] - output.size() + 3 + widths[2] - params.size(), ' ') + params + "\n";
  };
  const std::string rule(widths[0] + widths[1] + widths[2] + 6, '=');
  std::string out = "Summary of " + network + " for " + detail::inputs_text(input_shapes) + "\n";
  out += rule + "\n" + line(headers[0], headers[1], headers[2]) + rule + "\n";
  for (const auto& c : cells) out += line(c[0], c[1], c[2]);
  out += rule + "\n";
  out += "Total params: " + detail::with_thousands(static_cast<std::size_t>(total_parameters)) + "\n";
  out += "Trainable params: " + detail::with_thousands(static_cast<std::size_t>(trainable_parameters)) + "\n";
  out += "Non-trainable params: " +
         detail::with_thousands(static_cast<std::size_t>(total_parameters - trainable_parameters)) + "\n";
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f", static_cast<double>(parameter_bytes) / (1024.0 * 1024.0));
  out += "Params size: " + detail::with_thousands(parameter_bytes) + " bytes (" + mib + " MiB)\n";
  return out;
}

inline std::ostream& operator<<(std::ostream& os, const Summary& s) { return os << s.text(); }

// The summary summary() just returned, streamed where summary() printed it already (torchinfo
// and Keras print a summary once): nothing more. Streamed elsewhere, or a Summary kept in a
// variable, it prints.
inline std::ostream& operator<<(std::ostream& os, Summary&& s) {
  return s.printed_to == &os ? os : os << std::as_const(s);
}

namespace detail {

// The summary of `net`, whose call on zeros of the input shapes run() makes, returning the
// network's output.
template <ElementType T, class Run>
Summary summary_of(nn::BasicDynamicCell<T>& net, std::vector<Shape> input_shapes, std::ostream& out, Run run) {
  std::string shapes;
  for (const Shape& s : input_shapes) shapes += (shapes.empty() ? "" : ", ") + to_string(s);
  const std::string where = "duet::summary(" + net.type_name() + ", input " + shapes + ")";
  if (!std::ranges::all_of(input_shapes, [](const Shape& s) { return s.is_concrete(); })) {
    throw ValueError(where + ": every dimension of the input shape must be known, the batch size too");
  }
  Summary result{.network = net.type_name(), .input_shapes = std::move(input_shapes)};
  std::unordered_map<const nn::BasicDynamicCell<T>*, std::size_t> row_of;
  std::unordered_map<const nn::BasicDynamicCell<T>*, int> depth_of;
  std::set<const nn::BasicParameter<T>*> counted;
  // cells_and_names lists a parent before its children, so each cell's depth is known when it comes.
  for (auto& [name, cell] : net.cells_and_names()) {
    SummaryRow row{.name = name, .type_name = cell->repr(), .depth = depth_of[cell]};
    cell->for_each_own_parameter([&](std::string_view, nn::BasicParameter<T>& p) {
      row.parameters += p.numel();
      if (!counted.insert(&p).second) return;
      result.total_parameters += p.numel();
      if (p.requires_grad) result.trainable_parameters += p.numel();
      result.parameter_bytes += static_cast<std::size_t>(p.numel()) * sizeof(T);
    });
    cell->for_each_child([&](std::string_view, nn::BasicDynamicCell<T>& child) {
      row.has_children = true;
      depth_of[&child] = row.depth + 1;
    });
    row_of[cell] = result.rows.size();
    result.rows.push_back(std::move(row));
  }
  const nn::BasicForwardHook<T> observer = [&](const nn::BasicDynamicCell<T>& cell, const BasicTensor<T>&,
                                               const BasicTensor<T>& output) {
    if (const auto it = row_of.find(&cell); it != row_of.end()) result.rows[it->second].output_shapes.push_back(output.shape());
  };
  {
    const detail::ObservedRun<T> observed(observer);
    // A step that does not commit: a network set to train puts back BatchNorm's moving
    // statistics and Dropout's generator as they were.
    const StepScope discarded;
    try {
      // A network of several inputs runs no forward hook of its own: its row is written here.
      const Shape output = run().shape();
      if (result.rows.front().output_shapes.empty()) result.rows.front().output_shapes.push_back(output);
    } catch (const ShapeError& e) {
      throw ShapeError(where + ": " + e.what());
    }
  }
  out << std::as_const(result);
  result.printed_to = &out;
  return result;
}

}  // namespace detail

// Prints the summary of `net` for an input of `input_shape` (every dimension known: the batch
// too) to `out`, and returns it. A shape a layer cannot take is the layer's ShapeError, with
// the summary's call in front.
template <ElementType T>
Summary summary(nn::BasicDynamicCell<T>& net, const Shape& input_shape, std::ostream& out = std::cout) {
  return detail::summary_of(net, {input_shape}, out, [&] {
    // A network built at run time that begins with an nn::Embedding runs on zero indices.
    if constexpr (!std::is_same_v<T, std::int32_t>) {
      if (net.other_input_type() == name_of(DType::int32)) return net(BasicTensor<std::int32_t>(input_shape));
    }
    return net(BasicTensor<T>(input_shape));
  });
}

// A network whose input holds another element type than its values (`using input_value_type =
// std::int32_t;`, a network that begins with an nn::Embedding) runs on zeros of that type.
template <class Net>
  requires requires { typename Net::input_value_type; }
Summary summary(Net& net, const Shape& input_shape, std::ostream& out = std::cout) {
  using U = typename Net::input_value_type;
  return detail::summary_of(net, {input_shape}, out, [&] { return BasicTensor<typename Net::value_type>(net(BasicTensor<U>(input_shape))); });
}

// A network whose construct takes several inputs (features and a mask): a shape for each,
// summary(net, {{64, 16}, {64, 16, 1}}).
template <class Net, std::size_t N>
  requires(N >= 2)
Summary summary(Net& net, const Shape (&input_shapes)[N], std::ostream& out = std::cout) {
  using T = typename Net::value_type;
  return detail::summary_of(net, std::vector<Shape>(input_shapes, input_shapes + N), out, [&] {
    return [&]<std::size_t... K>(std::index_sequence<K...>) {
      return BasicTensor<T>(net(BasicTensor<T>(input_shapes[K])...));
    }(std::make_index_sequence<N>{});
  });
}

}  // namespace duet
