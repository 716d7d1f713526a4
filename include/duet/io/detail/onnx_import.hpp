// The ONNX loader's definitions (duet/io/onnx.hpp declares load_onnx, load_onnx_bytes and
// load_onnx_weights): included by onnx.hpp, or compiled once by CMake's duet::onnx.
#pragma once

#include "../onnx.hpp"

namespace duet::io {

// Builds an OnnxModel from a parsed ModelProto, checking everything it reads.
class OnnxBuilder {
 public:
  using Operand = OnnxModel::Operand;
  using Kind = Operand::Kind;

  OnnxBuilder(const onnx::ModelProto& proto, std::string where) : proto_(proto), where_(std::move(where)) {}

  OnnxModel build() {
    check_opset();
    const onnx::GraphProto& g = proto_.graph();
    for (const onnx::TensorProto& t : g.initializer()) add_initializer(t);
    find_input(g);
    // Every node has an output before any is read: the GELU pattern looks at nodes ahead of
    // the one being added, and protobuf's output(0) of an empty list is out of bounds.
    std::vector<std::pair<int, int>> unknown;  // an operator's first node and its count
    for (int i = 0; i < g.node_size(); ++i) {
      const onnx::NodeProto& n = g.node(i);
      if (n.output_size() < 1) throw FormatError(where_ + ": " + who(n, i) + " has no output");
      for (const std::string& in : n.input()) {
        ++consumers_[in];
        readers_[in] = i;
      }
      for (const std::string& out : n.output()) producers_.emplace(out, i);
      if (std::ranges::find(detail::onnx_operators, n.op_type()) != detail::onnx_operators.end()) continue;
      const auto seen =
          std::ranges::find_if(unknown, [&](const auto& u) { return g.node(u.first).op_type() == n.op_type(); });
      if (seen == unknown.end())
        unknown.emplace_back(i, 1);
      else
        ++seen->second;
    }
    if (!unknown.empty()) refuse_operators(unknown);
    for (const onnx::ValueInfoProto& o : g.output()) ++consumers_[o.name()];
    // Constants first (they read nothing): a pattern read at its first node (GELU's) then sees
    // the constants its later nodes read.
    for (int i = 0; i < g.node_size(); ++i) {
      if (g.node(i).op_type() != "Constant") continue;
      add_node(g.node(i), i);
      skipped_.insert(i);
    }
    // A recurrence's weights before the nodes that prepare them, which it may take over.
    for (int i = 0; i < g.node_size(); ++i) {
      const std::string& op = g.node(i).op_type();
      if (op == "GRU") prepare_recurrence<ops::detail::GRUCell>(g.node(i), i);
      if (op == "LSTM") prepare_recurrence<ops::detail::LSTMCell>(g.node(i), i);
    }
    for (int i = 0; i < g.node_size(); ++i) {
      if (skipped_.contains(i)) continue;
      add_node(g.node(i), i);
    }
    if (g.output_size() != 1) {
      throw FormatError(where_ + ": the graph has " + std::to_string(g.output_size()) +
                        " outputs; duet's networks give one tensor");
    }
    const Operand out = operand_of(g.output(0).name(), "the graph's output");
    if (out.kind != Kind::value || out.index == 0) {
      throw ValueError(where_ + ": the graph's output " + detail::onnx_quoted(g.output(0).name()) +
                       " is not computed by any node; duet runs models whose output is an operation's");
    }
    model_.output_ = out.index;
    return std::move(model_);
  }

 private:
  void check_opset() {
    for (const onnx::OperatorSetIdProto& set : proto_.opset_import()) {
      if (!set.domain().empty() && set.domain() != "ai.onnx") continue;
      if (set.version() < 13 || set.version() > 17) {
        throw ValueError(where_ + ": the model uses opset " + std::to_string(set.version()) +
                         "; duet reads opsets 13 to 17 (torch.onnx.export(..., opset_version=17))");
      }
      return;
    }
    throw FormatError(where_ + ": the model imports no opset of the default ONNX domain");
  }

  // A float initializer becomes a parameter, an int64 one a list of integers.
  void add_initializer(const onnx::TensorProto& t) {
    const std::string what = "initializer " + detail::onnx_quoted(t.name());
    if (t.name().empty()) throw FormatError(where_ + ": an initializer has no name");
    if (defined(t.name())) throw FormatError(where_ + ": " + what + " is defined twice");
    const Shape shape = detail::onnx_shape(t, what, where_);
    if (t.data_type() == onnx::TensorProto::FLOAT) {
      const std::vector<float> data = detail::onnx_elements<float>(t, what, shape.numel(), where_);
      model_.parameters_.push_back(std::make_unique<nn::Parameter>(Tensor(shape, std::span<const float>(data))));
      model_.parameter_names_.push_back(t.name());
      operands_[t.name()] = {Kind::parameter, model_.parameters_.size() - 1};
    } else if (t.data_type() == onnx::TensorProto::INT64) {
      integers_[t.name()] = detail::onnx_elements<std::int64_t>(t, what, shape.numel(), where_);
    } else {
      throw ValueError(where_ + ": " + what + " has ONNX data type " + std::to_string(t.data_type()) +
                       "; duet reads float32 and int64 initializers");
    }
  }

  void find_input(const onnx::GraphProto& g) {
    const onnx::ValueInfoProto* input = nullptr;
    for (const onnx::ValueInfoProto& v : g.input()) {
      if (defined(v.name())) continue;  // an initializer listed as an input (older exporters)
      if (input != nullptr) {
        throw FormatError(where_ + ": the graph has more than one input (" + detail::onnx_quoted(input->name()) + ", " +
                          detail::onnx_quoted(v.name()) + "); duet's networks take one tensor");
      }
      input = &v;
    }
    if (input == nullptr) throw FormatError(where_ + ": the graph has no input");
    const auto& type = input->type();
    if (type.has_tensor_type() && type.tensor_type().elem_type() != onnx::TensorProto::FLOAT) {
      const int t = type.tensor_type().elem_type();
      if (t != onnx::TensorProto::INT32 && t != onnx::TensorProto::INT64) {
        throw ValueError(where_ + ": the graph's input " + detail::onnx_quoted(input->name()) + " has ONNX data type " +
                         std::to_string(t) +
                         "; load_onnx reads models of float32 input, or of int32 or int64 token ids");
      }
      // Token ids: read only as a Gather's indices (add_id_gather).
      model_.ids_input_ = true;
      ids_input_name_ = input->name();
    }
    if (type.has_tensor_type() && type.tensor_type().has_shape()) {
      std::string dims;
      for (const onnx::TensorShapeProto::Dimension& d : type.tensor_type().shape().dim()) {
        model_.input_dims_.push_back(d.has_dim_value() ? d.dim_value() : -1);
        dims += (dims.empty() ? "" : ", ") + (d.has_dim_value()       ? std::to_string(d.dim_value())
                                              : d.dim_param().empty() ? std::string("?")
                                                                      : d.dim_param());
      }
      model_.declared_input_ = detail::onnx_quoted(input->name()) + " [" + dims + "]";
    }
    if (model_.declared_input_.empty()) model_.declared_input_ = detail::onnx_quoted(input->name());
    if (!model_.ids_input_) operands_[input->name()] = {Kind::value, 0};
  }

  std::string ids_input_name_;  // the graph's input, when it holds token ids

  bool integer(const std::string& name) const { return integers_.contains(name) || sizes_.contains(name); }
  bool defined(const std::string& name) const {
    return operands_.contains(name) || integer(name) || ranges_.contains(name);
  }

  Operand operand_of(const std::string& name, const std::string& reader) const {
    const auto it = operands_.find(name);
    if (it == operands_.end() && name == ids_input_name_) {
      throw ValueError(where_ + ": " + reader + " reads the graph's input " + detail::onnx_quoted(name) +
                       ", token ids, which duet reads only as the indices of a Gather along axis 0 (an embedding), "
                       "and their Shape as a Range's bounds");
    }
    if (it == operands_.end() && ranges_.contains(name)) {
      throw ValueError(where_ + ": " + reader + " reads " + detail::onnx_quoted(name) +
                       ", a Range, which duet reads only as the indices of a Gather along axis 0 (a positional "
                       "embedding)");
    }
    if (it == operands_.end()) {
      if (integer(name)) {
        throw ValueError(where_ + ": " + reader + " reads " + detail::onnx_quoted(name) +
                         ", an int64 tensor, which duet reads only as sizes (Shape, Gather, Unsqueeze, Squeeze, Cast, "
                         "Concat, Add, Sub, Mul and Div of int64s, for a Reshape, Slice, Expand or ConstantOfShape)");
      }
      throw FormatError(where_ + ": " + reader + " reads " + detail::onnx_quoted(name) +
                        ", which no input, initializer or earlier node defines");
    }
    return it->second;
  }

  // --- attributes ---------------------------------------------------------------------------

  static std::string node_name(const onnx::NodeProto& n, int index) {
    return detail::onnx_quoted(n.name().empty() ? "#" + std::to_string(index) : n.name());
  }
  std::string who(const onnx::NodeProto& n, int index) const {
    return "ONNX node " + node_name(n, index) + " (" + n.op_type() + ")";
  }

  [[noreturn]] void unsupported(const std::string& node, const std::string& what) const {
    throw ValueError(where_ + ": " + node + ": " + what + " is not supported");
  }

  // The first node of an unknown operator, as unsupported() names one, then the others: a
  // user learns at once what a model needs, not one operator per attempt.
  [[noreturn]] void refuse_operators(const std::vector<std::pair<int, int>>& unknown) const {
    const auto name = [&](const std::pair<int, int>& u) {
      const std::string& op = proto_.graph().node(u.first).op_type();
      return op + (op == "RNN" ? " (duet has GRU and LSTM)" : "");
    };
    std::string also;
    for (std::size_t k = 1; k < unknown.size(); ++k) {
      const auto& u = unknown[k];
      also += (k == 1 ? "; nor are " : ", ") + name(u) + " (" +
              (u.second == 1 ? "node " : std::to_string(u.second) + " nodes, the first ") +
              node_name(proto_.graph().node(u.first), u.first) + ")";
    }
    const auto& first = unknown.front();
    const std::string count = first.second == 1 ? "" : " (" + std::to_string(first.second) + " nodes)";
    throw ValueError(where_ + ": " + who(proto_.graph().node(first.first), first.first) + ": the operator " +
                     name(first) + count + " is not supported" + also);
  }

  static const onnx::AttributeProto* attribute(const onnx::NodeProto& n, const std::string& name) {
    for (const onnx::AttributeProto& a : n.attribute())
      if (a.name() == name) return &a;
    return nullptr;
  }

  // Every attribute of n must be one the operator's conversion reads.
  void known_attributes(const onnx::NodeProto& n, const std::string& node,
                        std::initializer_list<std::string_view> known) const {
    for (const onnx::AttributeProto& a : n.attribute()) {
      if (std::ranges::find(known, a.name()) == known.end())
        unsupported(node, "attribute " + detail::onnx_quoted(a.name()));
    }
  }

  std::int64_t int_attr(const onnx::NodeProto& n, const std::string& name, std::int64_t fallback) const {
    const onnx::AttributeProto* a = attribute(n, name);
    return a == nullptr ? fallback : a->i();
  }
  float float_attr(const onnx::NodeProto& n, const std::string& name, float fallback) const {
    const onnx::AttributeProto* a = attribute(n, name);
    return a == nullptr ? fallback : a->f();
  }
  // An axis of any rank duet has, negative from the end (ONNX's convention); the int64 is
  // checked before it narrows to int, where 2^32 would pass as axis 0.
  int axis_attr(const onnx::NodeProto& n, const std::string& node, std::int64_t fallback) const {
    const std::int64_t axis = int_attr(n, "axis", fallback);
    if (axis < -max_rank || axis >= max_rank) {
      throw FormatError(where_ + ": " + node + ": axis " + std::to_string(axis) +
                        " is beyond every rank (duet's highest is " + std::to_string(max_rank) + ")");
    }
    return static_cast<int>(axis);
  }
  std::vector<std::int64_t> ints_attr(const onnx::NodeProto& n, const std::string& name) const {
    const onnx::AttributeProto* a = attribute(n, name);
    if (a == nullptr) return {};
    return {a->ints().begin(), a->ints().end()};
  }
  std::string string_attr(const onnx::NodeProto& n, const std::string& name, const std::string& fallback) const {
    const onnx::AttributeProto* a = attribute(n, name);
    return a == nullptr ? fallback : a->s();
  }

  static std::string list_text(const std::vector<std::int64_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i > 0 ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  }

  // One value for both spatial axes: a pair of equal values (or none: the fallback).
  // A window's size, stride or dilation: one per spatial axis (2 unless a Conv is 1-D), all equal.
  std::int64_t square(const onnx::NodeProto& n, const std::string& node, const std::string& name, std::int64_t fallback,
                      int spatial = 2) const {
    const std::vector<std::int64_t> v = ints_attr(n, name);
    if (v.empty()) return fallback;
    if (v.size() != static_cast<std::size_t>(spatial) || std::ranges::count(v, v[0]) != spatial) {
      unsupported(node, name + " " + list_text(v) +
                            (spatial == 2 ? " (duet takes 2-D windows, equal on both axes)" : " (a 1-D window)"));
    }
    return v[0];
  }
  // An attribute of one value per spatial axis of a 2-D window (height, width).
  std::array<index_t, 2> spatial_pair(const onnx::NodeProto& n, const std::string& node, const std::string& name,
                                      std::int64_t fallback) const {
    const std::vector<std::int64_t> v = ints_attr(n, name);
    if (v.empty()) return {fallback, fallback};
    if (v.size() != 2) unsupported(node, name + " " + list_text(v) + " (duet pools over 2-D windows)");
    return {v[0], v[1]};
  }
  // pads [top, left, bottom, right] of a 2-D window, each axis padded alike on both sides.
  std::array<index_t, 2> axis_pads(const onnx::NodeProto& n, const std::string& node) const {
    const std::vector<std::int64_t> v = ints_attr(n, "pads");
    if (v.empty()) return {0, 0};
    if (v.size() != 4 || v[0] != v[2] || v[1] != v[3]) {
      unsupported(node, "pads " + list_text(v) + " (duet pads each spatial axis alike on both sides)");
    }
    return {v[0], v[1]};
  }
  std::int64_t symmetric_pads(const onnx::NodeProto& n, const std::string& node, int spatial = 2) const {
    const std::vector<std::int64_t> v = ints_attr(n, "pads");
    if (v.empty()) return 0;
    if (v.size() != 2 * static_cast<std::size_t>(spatial) || std::ranges::count(v, v[0]) != 2 * spatial) {
      unsupported(node, "pads " + list_text(v) + " (duet pads all sides alike)");
    }
    return v[0];
  }

  // --- nodes ----------------------------------------------------------------------------------

  std::size_t new_value(const std::string& name, const std::string& node) {
    if (name.empty()) throw FormatError(where_ + ": " + node + " has an output with no name");
    if (defined(name)) throw FormatError(where_ + ": " + node + ": " + detail::onnx_quoted(name) + " is defined twice");
    operands_[name] = {Kind::value, model_.value_count_};
    return model_.value_count_++;
  }

  void add_step(const std::string& op, const onnx::NodeProto& n, const std::string& node,
                std::function<Tensor(const OnnxModel&, std::vector<Tensor>&)> run, int output = 0) {
    const std::size_t out = new_value(n.output(output), node);
    model_.steps_.push_back({std::move(run), out, node});
    model_.operators_.push_back(op);
  }

  // `least` to `most` inputs, and no output but the first read (`outputs` for an operator
  // whose others duet makes too).
  void arity(const onnx::NodeProto& n, const std::string& node, int least, int most, int outputs = 1) const {
    if (n.input_size() < least || n.input_size() > most) {
      throw FormatError(
          where_ + ": " + node + " has " + std::to_string(n.input_size()) + " inputs, its operator takes " +
          (least == most ? std::to_string(least) : std::to_string(least) + " to " + std::to_string(most)));
    }
    for (int i = outputs; i < n.output_size(); ++i) {
      if (!n.output(i).empty() && consumers_.contains(n.output(i))) {
        unsupported(node, "its output " + std::to_string(i) + " (" + detail::onnx_quoted(n.output(i)) + ")");
      }
    }
  }

  // The float value of a one-element constant operand, if it is one.
  std::optional<float> scalar_constant(const std::string& name) const {
    const auto it = operands_.find(name);
    if (it == operands_.end()) return std::nullopt;
    const Tensor* t = nullptr;
    if (it->second.kind == Kind::constant)
      t = &model_.constants_[it->second.index];
    else if (it->second.kind == Kind::parameter)
      t = model_.parameters_[it->second.index].get();
    if (t == nullptr || t->numel() != 1) return std::nullopt;
    return t->data()[0];
  }

  // The node reading `name`, when exactly one node does (and the graph's output does not).
  int only_reader(const std::string& name) const {
    const auto count = consumers_.find(name);
    if (count == consumers_.end() || count->second != 1) return -1;
    const auto reader = readers_.find(name);
    return reader == readers_.end() ? -1 : reader->second;  // the graph's output is not a node
  }

  // The other input of a two-input node than `name`, or "" when it does not read it.
  static std::string other_input(const onnx::NodeProto& n, const std::string& name) {
    if (n.input_size() != 2) return "";
    if (n.input(0) == name) return n.input(1);
    if (n.input(1) == name) return n.input(0);
    return "";
  }

  // torch.onnx.export's GELU below opset 20: Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5),
  // factors in either order. On a match, the Div becomes one Gelu step and the rest are skipped.
  bool gelu_pattern(const onnx::NodeProto& div, int index) {
    const onnx::GraphProto& g = proto_.graph();
    if (div.op_type() != "Div" || div.input_size() != 2 || div.output_size() != 1) return false;
    const std::optional<float> root2 = scalar_constant(div.input(1));
    if (!root2 || std::abs(*root2 - std::sqrt(2.0f)) > 1e-6f) return false;
    const std::string& x = div.input(0);
    const int erf = only_reader(div.output(0));
    if (erf < 0 || g.node(erf).op_type() != "Erf" || g.node(erf).output_size() != 1) return false;
    const int add = only_reader(g.node(erf).output(0));
    if (add < 0 || g.node(add).op_type() != "Add") return false;
    const std::optional<float> one = scalar_constant(other_input(g.node(add), g.node(erf).output(0)));
    if (!one || *one != 1.0f) return false;
    const int mul = only_reader(g.node(add).output(0));
    if (mul < 0 || g.node(mul).op_type() != "Mul" || other_input(g.node(mul), g.node(add).output(0)) != x) return false;
    const int half = only_reader(g.node(mul).output(0));
    if (half < 0 || g.node(half).op_type() != "Mul") return false;
    const std::optional<float> h = scalar_constant(other_input(g.node(half), g.node(mul).output(0)));
    if (!h || *h != 0.5f) return false;
    for (const int i : {erf, add, mul, half})
      if (i <= index || !g.node(i).attribute().empty()) return false;
    const Operand in = operand_of(x, who(div, index));
    const std::string node = "ONNX nodes " + detail::onnx_quoted(div.name()) + " to " +
                             detail::onnx_quoted(g.node(half).name()) + " (GELU: Div, Erf, Add, Mul, Mul)";
    skipped_.insert({erf, add, mul});
    skipped_.insert(half);
    const std::size_t out = new_value(g.node(half).output(0), node);
    model_.steps_.push_back({[in](const OnnxModel& m, std::vector<Tensor>& v) {
                               return m.with(in, v, [](const auto& a) { return Tensor(ops::gelu(a)); });
                             },
                             out, node});
    model_.operators_.push_back("Gelu");
    return true;
  }

  void add_node(const onnx::NodeProto& n, int index) {
    const std::string node = who(n, index);
    if (!n.domain().empty() && n.domain() != "ai.onnx")
      unsupported(node, "the operator domain " + detail::onnx_quoted(n.domain()));
    const std::string& op = n.op_type();
    if (gelu_pattern(n, index)) return;
    const auto input = [&](int i) { return operand_of(n.input(i), node); };

    if (op == "Identity" || op == "Dropout") {
      arity(n, node, 1, op == "Dropout" ? 3 : 1);
      known_attributes(n, node, {"seed"});
      if (op == "Dropout" && n.input_size() == 3 && !n.input(2).empty()) {
        unsupported(node, "a training_mode input (duet runs an ONNX Dropout as in inference, the identity)");
      }
      if (n.output(0).empty() || defined(n.output(0)))
        throw FormatError(where_ + ": " + node + " has no new output name");
      operands_[n.output(0)] = input(0);  // no operation: its output is its input
      return;
    }
    if (op == "Constant") {
      arity(n, node, 0, 0);
      add_constant(n, node);
      return;
    }
    if (op == "Add" || op == "Sub" || op == "Mul" || op == "Div" || op == "Pow" || op == "Max" || op == "Min") {
      if (shape_arithmetic(n, node)) return;
      // ONNX's Max and Min take any number of inputs; duet reads two.
      if ((op == "Max" || op == "Min") && n.input_size() != 2) unsupported(node, op + " of other than two inputs");
      arity(n, node, 2, 2);
      known_attributes(n, node, {});
      const Operand a = input(0);
      const Operand b = input(1);
      const char kind = op == "Max" ? 'X' : op == "Min" ? 'N' : op[0];
      add_step(op, n, node, [a, b, kind](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, b, v, [kind](const auto& x, const auto& y) -> Tensor {
          switch (kind) {
            case 'A':
              return ops::add(x, y);
            case 'S':
              return ops::sub(x, y);
            case 'M':
              return ops::mul(x, y);
            case 'P':
              return ops::pow(x, y);
            case 'X':
              return ops::maximum(x, y);
            case 'N':
              return ops::minimum(x, y);
            default:
              return ops::div(x, y);
          }
        });
      });
      return;
    }
    if (op == "Exp" || op == "Log" || op == "Sqrt" || op == "Abs" || op == "Neg" || op == "Reciprocal" ||
        op == "Softplus" || op == "Sin" || op == "Cos" || op == "Erf") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {});
      const Operand a = input(0);
      const std::string kind = op;
      add_step(op, n, node, [a, kind](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [&kind](const auto& x) -> Tensor {
          if (kind == "Exp") return ops::exp(x);
          if (kind == "Log") return ops::log(x);
          if (kind == "Sqrt") return ops::sqrt(x);
          if (kind == "Abs") return ops::abs(x);
          if (kind == "Neg") return ops::neg(x);
          if (kind == "Reciprocal") return ops::div(1.0, x);
          if (kind == "Sin") return ops::sin(x);
          if (kind == "Cos") return ops::cos(x);
          if (kind == "Erf") return ops::erf(x);
          // ONNX's log(1 + exp(x)); duet's turns linear past 20, where the two differ by less
          // than exp(-20) of x.
          return ops::softplus(x);
        });
      });
      return;
    }
    if (op == "Clip") {
      arity(n, node, 1, 3);
      known_attributes(n, node, {});
      const Operand a = input(0);
      // The bounds are optional inputs, numbers the model holds.
      const auto bound = [&](int i, double fallback) {
        if (n.input_size() <= i || n.input(i).empty()) return fallback;
        const std::optional<float> b = scalar_constant(n.input(i));
        if (!b) unsupported(node, "a bound that is not a one-element constant");
        return static_cast<double>(*b);
      };
      const double lo = bound(1, -std::numeric_limits<double>::infinity());
      const double hi = bound(2, std::numeric_limits<double>::infinity());
      add_step(op, n, node, [a, lo, hi](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [&](const auto& x) -> Tensor { return ops::clip_by_value(x, lo, hi); });
      });
      return;
    }
    if (op == "Slice") return add_slice(n, node);
    if (op == "ReduceSum" || op == "ReduceMean" || op == "ReduceMax" || op == "ReduceMin" || op == "ReduceProd") {
      return add_reduce(n, node);
    }
    if (op == "Relu" || op == "Sigmoid" || op == "Tanh" || op == "LeakyRelu" || op == "Elu") {
      arity(n, node, 1, 1);
      const bool has_alpha = op == "LeakyRelu" || op == "Elu";
      if (has_alpha)
        known_attributes(n, node, {"alpha"});
      else
        known_attributes(n, node, {});
      // ONNX's defaults, which are PyTorch's.
      const double alpha = float_attr(n, "alpha", op == "Elu" ? 1.0f : 0.01f);
      if (has_alpha) fn::check_alpha(alpha, where_ + ": " + node);
      const Operand a = input(0);
      const char kind = op[0];
      add_step(op, n, node, [a, kind, alpha](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [kind, alpha](const auto& x) -> Tensor {
          switch (kind) {
            case 'R':
              return ops::relu(x);
            case 'S':
              return ops::sigmoid(x);
            case 'T':
              return ops::tanh(x);
            case 'L':
              return ops::leaky_relu(x, alpha);
            default:
              return ops::elu(x, alpha);
          }
        });
      });
      return;
    }
    if (op == "Softmax" || op == "LogSoftmax") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"axis"});
      const Operand a = input(0);
      const int axis = axis_attr(n, node, -1);
      const bool log = op == "LogSoftmax";
      add_step(op, n, node, [a, axis, log](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [&](const auto& x) -> Tensor {
          // Not ?: : on an initializer the two give different nn::ParameterResult types.
          if (log) return ops::log_softmax(x, axis);
          return ops::softmax(x, axis);
        });
      });
      return;
    }
    if (op == "MatMul") {
      arity(n, node, 2, 2);
      known_attributes(n, node, {});
      const Operand a = input(0);
      const Operand b = input(1);
      add_step(op, n, node, [a, b](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, b, v, [](const auto& x, const auto& y) -> Tensor { return ops::matmul(x, y); });
      });
      return;
    }
    if (op == "Gemm") return add_gemm(n, node);
    if (op == "Conv") return add_conv(n, node);
    if (op == "MaxPool" || op == "AveragePool") return add_pool(n, node, index);
    if (op == "Pad") return add_pad(n, node, index);
    if (op == "GlobalAveragePool") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {});
      const Operand a = input(0);
      add_step(op, n, node, [a](const OnnxModel& m, std::vector<Tensor>& v) {
        return m.with(a, v, [](const auto& x) -> Tensor { return ops::adaptive_avg_pool2d<1>(x); });
      });
      return;
    }
    if (op == "BatchNormalization") return add_batchnorm(n, node);
    if (op == "LayerNormalization") return add_layernorm(n, node);
    if (op == "GRU") return add_recurrence(n, node, index, model_.grus_);
    if (op == "LSTM") return add_recurrence(n, node, index, model_.lstms_);
    if (op == "Flatten" || op == "Reshape") return add_reshape(n, node);
    if (op == "Transpose") return add_transpose(n, node);
    if (op == "Tile") return add_tile(n, node);
    if (positions(n, node)) return;
    if (shape_arithmetic(n, node)) return;
    if (op == "Unsqueeze" || op == "Squeeze") return add_squeeze(n, node);
    if (op == "Concat") return add_concat(n, node);
    if (op == "Expand" || op == "ConstantOfShape") return add_fill(n, node);
    unsupported(node, "the operator " + op);
  }

  void add_constant(const onnx::NodeProto& n, const std::string& node) {
    if (n.attribute_size() != 1)
      throw FormatError(where_ + ": " + node + " has " + std::to_string(n.attribute_size()) + " attributes, not one");
    const onnx::AttributeProto& a = n.attribute(0);
    const std::string& name = n.output(0);
    if (name.empty() || defined(name)) throw FormatError(where_ + ": " + node + " has no new output name");
    const auto add_float = [&](Tensor t) {
      model_.constants_.push_back(std::move(t));
      operands_[name] = {Kind::constant, model_.constants_.size() - 1};
    };
    if (a.name() == "value") {
      const onnx::TensorProto& t = a.t();
      const std::string what = node + "'s value";
      const Shape shape = detail::onnx_shape(t, what, where_);
      if (t.data_type() == onnx::TensorProto::FLOAT) {
        const std::vector<float> data = detail::onnx_elements<float>(t, what, shape.numel(), where_);
        add_float(Tensor(shape, std::span<const float>(data)));
      } else if (t.data_type() == onnx::TensorProto::INT64) {
        integers_[name] = detail::onnx_elements<std::int64_t>(t, what, shape.numel(), where_);
      } else {
        unsupported(node, "a value of ONNX data type " + std::to_string(t.data_type()));
      }
    } else if (a.name() == "value_float") {
      add_float(Tensor(Shape{}, {a.f()}));
    } else if (a.name() == "value_floats") {
      const std::vector<float> data(a.floats().begin(), a.floats().end());
      add_float(Tensor(Shape{static_cast<index_t>(data.size())}, std::span<const float>(data)));
    } else if (a.name() == "value_int") {
      integers_[name] = {a.i()};
    } else if (a.name() == "value_ints") {
      integers_[name] = {a.ints().begin(), a.ints().end()};
    } else {
      unsupported(node, "attribute " + detail::onnx_quoted(a.name()));
    }
  }

  void add_gemm(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 3);
    known_attributes(n, node, {"alpha", "beta", "transA", "transB"});
    const Operand a = operand_of(n.input(0), node);
    const Operand b = operand_of(n.input(1), node);
    const bool has_c = n.input_size() == 3 && !n.input(2).empty();
    const Operand c = has_c ? operand_of(n.input(2), node) : Operand{};
    const float alpha = float_attr(n, "alpha", 1.0f);
    const float beta = float_attr(n, "beta", 1.0f);
    const bool ta = int_attr(n, "transA", 0) != 0;
    const bool tb = int_attr(n, "transB", 0) != 0;
    add_step("Gemm", n, node, [=](const OnnxModel& m, std::vector<Tensor>& v) {
      Tensor y = m.with(a, b, v, [&](const auto& x, const auto& w) -> Tensor {
        if (ta && tb) return ops::matmul(x, w, ops::transpose_a, ops::transpose_b);
        if (ta) return ops::matmul(x, w, ops::transpose_a);
        if (tb) return ops::matmul(x, w, ops::transpose_b);
        return ops::matmul(x, w);
      });
      if (alpha != 1.0f) y = ops::mul(y, alpha);
      if (!has_c) return y;
      return m.with(c, v, [&](const auto& bias) -> Tensor {
        if (beta == 1.0f) return ops::add(y, bias);
        return ops::add(y, ops::mul(bias, beta));
      });
    });
  }

  // A Conv's weight and bias must be initializers: duet's convolution reads its geometry from
  // the weight's shape, and writes their gradients as a layer's.
  const nn::Parameter& parameter_input(const onnx::NodeProto& n, int i, const std::string& node) const {
    const Operand o = operand_of(n.input(i), node);
    if (o.kind != Kind::parameter) unsupported(node, "input " + std::to_string(i) + " that is not a float initializer");
    return *model_.parameters_[o.index];
  }

  void add_conv(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 3);
    known_attributes(n, node, {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"});
    const Operand x = operand_of(n.input(0), node);
    const nn::Parameter& w = parameter_input(n, 1, node);
    const bool with_bias = n.input_size() == 3 && !n.input(2).empty();
    const nn::Parameter& b = with_bias ? parameter_input(n, 2, node) : w;
    // [out, in / group, k] for a 1-D Conv, [out, in / group, k, k] for a 2-D one.
    const int spatial = w.shape().rank() - 2;
    if ((spatial != 1 && spatial != 2) || (spatial == 2 && w.dim(2) != w.dim(3)) || w.dim(2) < 1) {
      unsupported(node,
                  "a weight of shape " + to_string(w.shape()) + " (duet's Conv is 1-D, or 2-D with square kernels)");
    }
    const std::int64_t group = int_attr(n, "group", 1);
    // A group above the output channels divides none but 0, and would overflow g.in below.
    if (group < 1 || group > std::max<index_t>(w.dim(0), 1) || w.dim(0) % group != 0)
      throw FormatError(where_ + ": " + node + ": group " + std::to_string(group) + " does not divide the weight's " +
                        std::to_string(w.dim(0)) + " output channels");
    if (with_bias && (b.shape().rank() != 1 || b.dim(0) != w.dim(0))) {
      throw FormatError(where_ + ": " + node + ": bias of shape " + to_string(b.shape()) + " for a weight of shape " +
                        to_string(w.shape()));
    }
    ops::ConvGeometry g;
    g.spatial = spatial;
    g.out = w.dim(0);
    g.in = w.dim(1) * group;
    g.groups = group;
    g.kernel = square(n, node, "kernel_shape", w.dim(2), spatial);
    if (g.kernel != w.dim(2))
      throw FormatError(where_ + ": " + node + ": kernel_shape does not match the weight's " + to_string(w.shape()));
    g.stride = square(n, node, "strides", 1, spatial);
    g.dilation = square(n, node, "dilations", 1, spatial);
    if (g.stride < 1 || g.dilation < 1) unsupported(node, "a stride or dilation below 1");
    // A file's sizes can be any int64: bounded here, the convolution's window arithmetic
    // (extent, padded size) cannot overflow.
    constexpr index_t most = index_t{1} << 31;
    index_t span = 0;
    if (g.stride > most || __builtin_mul_overflow(g.dilation, g.kernel - 1, &span) || span >= most) {
      unsupported(node, "strides " + std::to_string(g.stride) + " and dilations " + std::to_string(g.dilation) +
                            " (duet's ONNX import takes windows and steps below 2^31)");
    }
    const std::string auto_pad = string_attr(n, "auto_pad", "NOTSET");
    if (auto_pad == "NOTSET") {
      g.pad_mode = nn::PadMode::pad;
      g.padding = symmetric_pads(n, node, spatial);
    } else if (auto_pad == "VALID") {
      g.pad_mode = nn::PadMode::valid;
    } else if (auto_pad == "SAME_UPPER") {
      g.pad_mode = nn::PadMode::same;  // the odd padding after, as duet's "same"
    } else {
      unsupported(node, "auto_pad " + auto_pad);
    }
    // A full convolution (padding extent - 1) is as far as padding can go with every output
    // seeing some input: more only adds outputs of nothing but zeros, and would let a small
    // file ask for outputs of any size.
    if (g.padding < 0 || g.padding >= g.extent()) {
      unsupported(node, "padding " + std::to_string(g.padding) + " for a window of " + std::to_string(g.extent()) +
                            " (duet's ONNX import pads less than the window, at most a full convolution)");
    }
    if (spatial == 1)
      add_conv_step(n, node, x, model_.convs1d_, detail::OnnxConv<1>{g, w, b, with_bias, node});
    else
      add_conv_step(n, node, x, model_.convs2d_, detail::OnnxConv<2>{g, w, b, with_bias, node});
  }

  template <class Layer>
  void add_conv_step(const onnx::NodeProto& n, const std::string& node, Operand x,
                     std::vector<std::unique_ptr<Layer>>& layers, Layer made) {
    layers.push_back(std::make_unique<Layer>(std::move(made)));
    const Layer* layer = layers.back().get();
    add_step("Conv", n, node, [x, layer](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [layer](const auto& in) -> Tensor { return apply(ops::ConvOp<Layer>{layer}, in); });
    });
  }

  // ONNX's GRU and LSTM: forward, sequence-major (layout 0), the default activations, no
  // sequence_lens or peepholes, and a GRU's linear_before_reset = 1 (PyTorch's formula; 0 is
  // another). Run as nn::GRU's and nn::LSTM's operation, whose weights are in PyTorch's layout
  // and gate order: those export_onnx wrote, Unsqueeze(Gather(P, ONNX's order)) of the
  // network's own parameters (the biases Concatenated first), are those parameters, and the
  // nodes that reorder them are not run; initializers in ONNX's layout, as torch.onnx.export
  // writes them, are rearranged into it where nothing else reads them, B split into
  // "<B>.bias_ih" and "<B>.bias_hh". So an exported network's parameters come back under their
  // names, and a torch export's train as duet's layers do.
  template <class Step>
  void prepare_recurrence(const onnx::NodeProto& n, int index) {
    const std::string node = who(n, index);
    const bool lstm = Step::states == 2;
    arity(n, node, 3, lstm ? 8 : 6, lstm ? 3 : 2);  // Y, Y_h and an LSTM's Y_c
    if (lstm)
      known_attributes(n, node, {"hidden_size", "direction", "layout", "activations", "input_forget"});
    else
      known_attributes(n, node, {"hidden_size", "direction", "layout", "activations", "linear_before_reset"});
    if (string_attr(n, "direction", "forward") != "forward")
      unsupported(node, "direction " + string_attr(n, "direction", ""));
    if (int_attr(n, "layout", 0) != 0)
      unsupported(node, "layout 1 (batch-major; duet reads ONNX's default, sequence-major)");
    if (int_attr(n, "input_forget", 0) != 0) unsupported(node, "input_forget 1");
    if (!lstm && int_attr(n, "linear_before_reset", 0) != 1) {
      unsupported(node, "linear_before_reset 0 (duet's GRU is PyTorch's, linear_before_reset 1)");
    }
    if (const onnx::AttributeProto* a = attribute(n, "activations")) {
      const std::vector<std::string> defaults =
          lstm ? std::vector<std::string>{"Sigmoid", "Tanh", "Tanh"} : std::vector<std::string>{"Sigmoid", "Tanh"};
      if (!std::ranges::equal(a->strings(), defaults)) unsupported(node, "activations other than the defaults");
    }
    if (n.input_size() > 4 && !n.input(4).empty())
      unsupported(node, "sequence_lens (every sequence of a batch is whole)");
    if (n.input_size() > 7 && !n.input(7).empty()) unsupported(node, "peepholes (input P)");
    const index_t gates = Step::gates;
    const std::int64_t hidden = int_attr(n, "hidden_size", 0);
    // ONNX's rows of the stacked gates, in PyTorch's numbering (export_onnx's Gather indices).
    const auto order = [&](index_t halves) {
      std::vector<std::int64_t> rows;
      for (index_t h = 0; h < halves; ++h)
        for (const index_t gate : Step::onnx_gates)
          for (std::int64_t j = 0; j < hidden; ++j) rows.push_back((h * gates + gate) * hidden + j);
      return rows;
    };
    if (hidden < 1 || hidden > (index_t{1} << 24))
      throw FormatError(where_ + ": " + node + ": hidden_size " + std::to_string(hidden));
    std::array<std::size_t, 4> p{};
    std::vector<int> taken;  // the nodes export_onnx wrote to reorder the weights
    const auto take = [&](const std::string& name, const char* op) -> const onnx::NodeProto* {
      const auto at = producers_.find(name);
      const auto readers = consumers_.find(name);
      if (at == producers_.end() || readers == consumers_.end() || readers->second != 1) return nullptr;
      const onnx::NodeProto& m = proto_.graph().node(at->second);
      if (m.op_type() != op || m.output_size() != 1) return nullptr;
      taken.push_back(at->second);
      return &m;
    };
    const auto integers = [&](const std::string& name) {
      const auto it = integers_.find(name);
      return it == integers_.end() ? std::vector<std::int64_t>{} : it->second;
    };
    const auto parameter = [&](const std::string& name) -> std::optional<std::size_t> {
      const auto it = operands_.find(name);
      if (it == operands_.end() || it->second.kind != Kind::parameter) return std::nullopt;
      return it->second.index;
    };
    // Unsqueeze(Gather(source, rows), [0]) with rows in ONNX's order: the Gather's source.
    const auto gathered = [&](const std::string& name, index_t halves) -> const onnx::NodeProto* {
      const onnx::NodeProto* unsqueeze = take(name, "Unsqueeze");
      if (unsqueeze == nullptr || unsqueeze->input_size() != 2 ||
          integers(unsqueeze->input(1)) != std::vector<std::int64_t>{0})
        return nullptr;
      const onnx::NodeProto* gather = take(unsqueeze->input(0), "Gather");
      if (gather == nullptr || gather->input_size() != 2 || int_attr(*gather, "axis", 0) != 0) return nullptr;
      // The indices' count first: order() is as long as hidden_size says, the file's data is not.
      const std::vector<std::int64_t> indices = integers(gather->input(1));
      if (indices.size() != static_cast<std::size_t>(halves * gates * hidden) || indices != order(halves))
        return nullptr;
      return gather;
    };
    const auto shaped = [&](std::size_t k, const Shape& shape) { return model_.parameters_[k]->shape() == shape; };
    const std::string w = n.input(1);
    const std::string r = n.input(2);
    const std::string b = n.input_size() > 3 ? n.input(3) : "";
    const onnx::NodeProto* gw = gathered(w, 1);
    const onnx::NodeProto* gr = gathered(r, 1);
    const onnx::NodeProto* gb = b.empty() ? nullptr : gathered(b, 2);
    const onnx::NodeProto* concat = gb == nullptr ? nullptr : take(gb->input(0), "Concat");
    const auto pw = gw == nullptr ? std::nullopt : parameter(gw->input(0));
    const auto pr = gr == nullptr ? std::nullopt : parameter(gr->input(0));
    if (pw && pr && concat != nullptr && concat->input_size() == 2 && int_attr(*concat, "axis", 0) == 0 &&
        parameter(concat->input(0)) && parameter(concat->input(1))) {
      p = {*pw, *pr, *parameter(concat->input(0)), *parameter(concat->input(1))};
      const index_t input = model_.parameters_[p[0]]->shape().rank() == 2 ? model_.parameters_[p[0]]->dim(1) : 0;
      const index_t rows = gates * hidden;
      if (!shaped(p[0], Shape{rows, input}) || !shaped(p[1], Shape{rows, hidden}) || !shaped(p[2], Shape{rows}) ||
          !shaped(p[3], Shape{rows})) {
        throw FormatError(where_ + ": " + node + ": weights whose shapes do not fit hidden_size " +
                          std::to_string(hidden));
      }
      skipped_.insert(taken.begin(), taken.end());
      recurrences_[index] = p;
      return;
    }
    // Initializers in ONNX's layout, read by this node alone.
    const auto own = [&](const std::string& name, const char* what) {
      const auto k = parameter(name);
      const auto readers = consumers_.find(name);
      if (!k || readers == consumers_.end() || readers->second != 1) {
        unsupported(
            node, std::string(what) + " " + detail::onnx_quoted(name) +
                      " that is not a float initializer read by this node alone, nor export_onnx's reordering of one");
      }
      return *k;
    };
    const std::size_t kw = own(w, "a weight W");
    const std::size_t kr = own(r, "a weight R");
    const index_t rows = gates * hidden;
    const Shape& ws = model_.parameters_[kw]->shape();
    if (ws.rank() != 3 || ws[0] != 1 || ws[1] != rows || !shaped(kr, Shape{1, rows, hidden})) {
      throw FormatError(where_ + ": " + node + ": W " + to_string(ws) + " and R " +
                        to_string(model_.parameters_[kr]->shape()) + " do not fit hidden_size " +
                        std::to_string(hidden) + " (one direction)");
    }
    // Row (gate, j) of PyTorch's layout from row (ONNX's block of that gate, j) of ONNX's.
    const auto rearranged = [&](const float* from, index_t halves, index_t columns) {
      Tensor to(halves == 1 ? Shape{rows, columns} : Shape{rows});
      for (index_t h = 0; h < halves; ++h)
        for (index_t block = 0; block < gates; ++block)
          std::copy_n(from + ((h * gates + block) * hidden) * columns, hidden * columns,
                      to.data() + (Step::onnx_gates[static_cast<std::size_t>(block)] * hidden) * columns);
      return to;
    };
    *model_.parameters_[kw] = nn::Parameter(rearranged(model_.parameters_[kw]->data(), 1, ws[2]));
    *model_.parameters_[kr] = nn::Parameter(rearranged(model_.parameters_[kr]->data(), 1, hidden));
    Tensor biases = Tensor(Shape{2 * rows});  // zeros: ONNX's B when there is none
    std::string base = node;
    if (!b.empty()) {
      const std::size_t k = own(b, "a bias B");
      if (!shaped(k, Shape{1, 2 * rows})) {
        throw FormatError(where_ + ": " + node + ": B " + to_string(model_.parameters_[k]->shape()) +
                          " does not fit hidden_size " + std::to_string(hidden));
      }
      std::copy_n(model_.parameters_[k]->data(), 2 * rows, biases.data());
      base = b;
    }
    const auto bias = [&](index_t half, const std::string& name, std::optional<std::size_t> reuse) {
      Tensor t(Shape{rows});
      for (index_t block = 0; block < gates; ++block)
        std::copy_n(biases.data() + (half * gates + block) * hidden, hidden,
                    t.data() + Step::onnx_gates[static_cast<std::size_t>(block)] * hidden);
      if (reuse) {
        *model_.parameters_[*reuse] = nn::Parameter(std::move(t));
        model_.parameter_names_[*reuse] = name;
        return *reuse;
      }
      model_.parameters_.push_back(std::make_unique<nn::Parameter>(std::move(t)));
      model_.parameter_names_.push_back(name);
      return model_.parameters_.size() - 1;
    };
    const std::optional<std::size_t> kb = b.empty() ? std::nullopt : parameter(b);
    const std::size_t k_ih = bias(0, base + ".bias_ih", kb);
    recurrences_[index] = {kw, kr, k_ih, bias(1, base + ".bias_hh", std::nullopt)};
  }

  template <class Layer>
  void add_recurrence(const onnx::NodeProto& n, const std::string& node, int index,
                      std::vector<std::unique_ptr<Layer>>& layers) {
    const std::array<std::size_t, 4>& p = recurrences_.at(index);
    const auto& params = model_.parameters_;
    layers.push_back(std::make_unique<Layer>(Layer{*params[p[0]], *params[p[1]], *params[p[2]], *params[p[3]],
                                                   params[p[0]]->dim(1), params[p[1]]->dim(1), node}));
    const Layer* layer = layers.back().get();
    const Operand x = operand_of(n.input(0), node);
    const auto state = [&](int i) {
      const bool given = n.input_size() > i && !n.input(i).empty();
      return given ? std::optional(operand_of(n.input(i), node)) : std::nullopt;
    };
    const std::array<std::optional<Operand>, 2> states{state(5), state(6)};  // h0, c0
    // [B, L, H]: every step's h, or with Cells an LSTM's c, from X [L, B, I] and states
    // [1, B, H], zeros where the node has none: the same numbers as the operation's own zeros,
    // and one instantiation of it rather than one per set of states (g++ -O2 building
    // run_onnx.cpp peaked at 2.22 GB with one per set, 2.14 without).
    const auto recurrence = [x, states, layer]<bool Cells>(const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& sequences) -> Tensor {
        const Tensor xs = detail::onnx_swap_leading(sequences);
        const auto initial = [&](const std::optional<Operand>& s) {
          if (!s) return Tensor(zeros(Shape{xs.dim(0), layer->hidden}));
          return m.with(*s, v, [](const auto& t) {  // [1, B, H] -> [B, H]
            const Shape& shape = t.shape();
            if (shape.rank() != 3 || shape[0] != 1)
              throw ShapeError("an initial state [1, batch, hidden], got " + to_string(shape));
            return detail::onnx_view(Tensor(t), {shape[1], shape[2]});
          });
        };
        if constexpr (Layer::cell_type::states == 1)
          return apply(ops::RecurrentOp<Layer, 1>{layer}, xs, initial(states[0]));
        else
          return apply(ops::RecurrentOp<Layer, 2, Cells>{layer}, xs, initial(states[0]), initial(states[1]));
      });
    };
    // Y [L, 1, B, H]
    add_step(n.op_type(), n, node, [recurrence](const OnnxModel& m, std::vector<Tensor>& v) -> Tensor {
      const Tensor y = detail::onnx_swap_leading(recurrence.template operator()<false>(m, v));  // [L, B, H]
      return detail::onnx_view(y, {y.dim(0), 1, y.dim(1), y.dim(2)});
    });
    // Y_h and Y_c [1, B, H], the last step's h and c, where the graph reads them.
    const auto read = [&](int k) {
      return n.output_size() > k && !n.output(k).empty() && consumers_.contains(n.output(k));
    };
    const std::size_t y = operands_.at(n.output(0)).index;
    if (read(1)) {
      add_step(
          n.op_type() + " (last h)", n, node,
          [y](const OnnxModel&, std::vector<Tensor>& v) -> Tensor {
            const Tensor last = detail::onnx_last_step(v[y]);  // [1, 1, B, H]
            return detail::onnx_view(last, {1, last.dim(2), last.dim(3)});
          },
          1);
    }
    if constexpr (Layer::cell_type::states == 2) {
      if (read(2)) {
        add_step(
            n.op_type() + " (last c)", n, node,
            [recurrence](const OnnxModel& m, std::vector<Tensor>& v) -> Tensor {
              return detail::onnx_last_step(detail::onnx_swap_leading(recurrence.template operator()<true>(m, v)));
            },
            2);
      }
    }
  }

  void add_pool(const onnx::NodeProto& n, const std::string& node, int index) {
    const bool max = n.op_type() == "MaxPool";
    arity(n, node, 1, 1);
    if (max)
      known_attributes(n, node,
                       {"auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "storage_order", "strides"});
    else
      known_attributes(n, node, {"auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides"});
    if (int_attr(n, "ceil_mode", 0) != 0) unsupported(node, "ceil_mode 1");
    if (int_attr(n, "storage_order", 0) != 0) unsupported(node, "storage_order 1");
    if (spatial_pair(n, node, "dilations", 1) != std::array<index_t, 2>{1, 1})
      unsupported(node, "dilations other than 1");
    const std::string auto_pad = string_attr(n, "auto_pad", "NOTSET");
    if (auto_pad != "NOTSET" && auto_pad != "VALID" && auto_pad != "SAME_UPPER")
      unsupported(node, "auto_pad " + auto_pad);
    const bool same = auto_pad == "SAME_UPPER";
    const auto [kh, kw] = spatial_pair(n, node, "kernel_shape", 0);
    const auto [sh, sw] = spatial_pair(n, node, "strides", 1);
    const auto padded = pool_padding_.find(index);
    const bool pad_node = padded != pool_padding_.end();
    const auto [ph, pw] = pad_node               ? padded->second
                          : auto_pad == "NOTSET" ? axis_pads(n, node)
                                                 : std::array<index_t, 2>{};
    const bool count_pad = pad_node || int_attr(n, "count_include_pad", 0) != 0;
    // duet's average over a same window counts only the input's elements.
    if (same && !max && count_pad) unsupported(node, "auto_pad SAME_UPPER with count_include_pad 1");
    const ops::Pool2dWindow w{kh, kw, sh, sw, same ? nn::PadMode::same : nn::PadMode::pad, ph, pw, count_pad};
    if (const std::string fault = ops::detail::window_fault(w); !fault.empty()) {
      throw ValueError(where_ + ": " + node + ": " + fault);
    }
    const Operand x = operand_of(n.input(0), node);
    if (x.kind != Kind::value) unsupported(node, "pooling an initializer");
    add_step(n.op_type(), n, node, [x, w, max](const OnnxModel&, std::vector<Tensor>& v) -> Tensor {
      return max ? ops::max_pool2d(v[x.index], w) : ops::avg_pool2d(v[x.index], w);
    });
  }

  // torch.onnx.export writes AvgPool2d(count_include_pad=True) as a Pad of zeros before an
  // AveragePool without padding: the pair is duet's average pooling that counts its padding.
  // A Pad of nothing is the identity.
  void add_pad(const onnx::NodeProto& n, const std::string& node, int index) {
    arity(n, node, 2, 4);
    known_attributes(n, node, {"mode"});
    if (string_attr(n, "mode", "constant") != "constant") unsupported(node, "mode " + string_attr(n, "mode", ""));
    const auto pads = integers_.find(n.input(1));
    if (pads == integers_.end()) unsupported(node, "pads that are not a constant int64 tensor");
    if (n.input_size() >= 3 && !n.input(2).empty()) {
      const std::optional<float> value = scalar_constant(n.input(2));
      if (!value || *value != 0.0f) unsupported(node, "a padding value other than a constant 0");
    }
    if (n.input_size() == 4 && !n.input(3).empty()) unsupported(node, "the axes input");
    const std::vector<std::int64_t>& p = pads->second;
    const Operand x = operand_of(n.input(0), node);
    if (n.output(0).empty() || defined(n.output(0)))
      throw FormatError(where_ + ": " + node + " has no new output name");
    if (std::ranges::all_of(p, [](std::int64_t v) { return v == 0; })) {
      operands_[n.output(0)] = x;
      return;
    }
    const int pool = only_reader(n.output(0));
    const bool spatial =
        p.size() == 8 && p[0] == 0 && p[1] == 0 && p[4] == 0 && p[5] == 0 && p[2] == p[6] && p[3] == p[7];
    if (pool < 0 || pool <= index || proto_.graph().node(pool).op_type() != "AveragePool" || !spatial ||
        axis_pads(proto_.graph().node(pool), node) != std::array<index_t, 2>{0, 0}) {
      unsupported(
          node, "pads " + list_text(p) + " other than before an AveragePool, alike on both sides of each spatial axis");
    }
    pool_padding_[pool] = {p[2], p[3]};
    operands_[n.output(0)] = x;
  }

  void add_batchnorm(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 5, 5);
    known_attributes(n, node, {"epsilon", "momentum", "training_mode"});
    if (int_attr(n, "training_mode", 0) != 0) unsupported(node, "training_mode 1");
    const Operand x = operand_of(n.input(0), node);
    if (x.kind != Kind::value) unsupported(node, "normalising an initializer");
    std::array<Operand, 4> p{};
    for (int i = 1; i <= 4; ++i) {
      parameter_input(n, i, node);
      p[static_cast<std::size_t>(i - 1)] = operand_of(n.input(i), node);
    }
    const index_t channels = model_.parameters_[p[0].index]->numel();
    for (const Operand& o : p) {
      const nn::Parameter& t = *model_.parameters_[o.index];
      if (t.shape().rank() != 1 || t.dim(0) != channels) {
        throw FormatError(where_ + ": " + node + ": its scale, bias, mean and variance must be [C] alike, got " +
                          to_string(t.shape()));
      }
    }
    // The statistics are not trained, as duet's BatchNorm's moving mean and variance.
    for (const Operand& statistic : {p[2], p[3]}) {
      model_.parameters_[statistic.index]->requires_grad = false;
      model_.statistics_.push_back(&*model_.parameters_[statistic.index]);
    }
    const double eps = float_attr(n, "epsilon", 1e-5f);
    const std::string step_who = node;
    add_step("BatchNormalization", n, node, [=](const OnnxModel& m, std::vector<Tensor>& v) {
      // [C] viewed as [C, 1, ...] to broadcast along axis 1 of the input.
      const auto per_channel = [&](const Operand& o) -> Tensor {
        const Tensor& in = v[x.index];
        std::vector<std::int64_t> dims{channels};
        for (int i = 2; i < in.shape().rank(); ++i) dims.push_back(1);
        return apply(detail::OnnxReshapeOp{{}, dims, -1, step_who}, *m.parameters_[o.index]);
      };
      // gamma / sqrt(var + eps), the layer's own rounding (nn::BatchNorm's evaluation_scale):
      // gamma * rsqrt(var + eps) rounds twice, and an exported BatchNorm came back a bit off.
      const Tensor scale = ops::div(per_channel(p[0]), ops::sqrt(ops::add(per_channel(p[3]), eps)));
      return m.with(x, v, [&](const auto& in) -> Tensor {
        return ops::add(ops::mul(ops::sub(in, per_channel(p[2])), scale), per_channel(p[1]));
      });
    });
  }

  // torch's nn.LayerNorm at opset 17. The axes from `axis` on are normalised as the rows of a
  // matrix, so that one reduction over the last axis serves any axis, the rank and sizes being
  // known only as the step runs.
  void add_layernorm(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 3);
    known_attributes(n, node, {"axis", "epsilon", "stash_type"});
    if (int_attr(n, "stash_type", 1) != 1)
      unsupported(node, "stash_type " + std::to_string(int_attr(n, "stash_type", 1)));
    const Operand x = operand_of(n.input(0), node);
    if (x.kind != Kind::value) unsupported(node, "normalising an initializer");
    const auto parameter_operand = [&](int i) {
      parameter_input(n, i, node);
      return operand_of(n.input(i), node);
    };
    const Operand scale = parameter_operand(1);
    const bool with_bias = n.input_size() == 3 && !n.input(2).empty();
    const Operand bias = with_bias ? parameter_operand(2) : scale;
    const Shape normalized = model_.parameters_[scale.index]->shape();
    if (with_bias && model_.parameters_[bias.index]->shape() != normalized) {
      throw FormatError(where_ + ": " + node + ": its scale " + to_string(normalized) + " and bias " +
                        to_string(model_.parameters_[bias.index]->shape()) + " differ in shape");
    }
    const std::int64_t axis = int_attr(n, "axis", -1);
    const double eps = float_attr(n, "epsilon", 1e-5f);
    const std::string step_who = node;
    add_step("LayerNormalization", n, node, [=](const OnnxModel& m, std::vector<Tensor>& v) {
      const Tensor& in = v[x.index];
      const int rank = in.shape().rank();
      const std::int64_t first = axis < 0 ? axis + rank : axis;
      if (first < 0 || first >= rank || in.shape().rank() - first != normalized.rank() ||
          !std::equal(normalized.begin(), normalized.end(), in.shape().begin() + first)) {
        throw ShapeError(step_who + " normalises from axis " + std::to_string(axis) + " with a scale of shape " +
                         to_string(normalized) + ", which must be those axes' sizes, and is given " +
                         to_string(in.shape()));
      }
      const Tensor rows = apply(detail::OnnxReshapeOp{{}, {-1, normalized.numel()}, -1, step_who}, in);
      const Tensor centred = ops::sub(rows, ops::mean(rows, ops::axes<-1>, ops::keep_dims));
      const Tensor variance = ops::mean(ops::square(centred), ops::axes<-1>, ops::keep_dims);
      const Tensor normal = ops::mul(centred, ops::rsqrt(ops::add(variance, eps)));
      const Tensor y =
          ops::mul(apply(detail::OnnxReshapeOp{{}, {in.shape().begin(), in.shape().end()}, -1, step_who}, normal),
                   *m.parameters_[scale.index]);
      if (!with_bias) return y;
      return ops::add(y, *m.parameters_[bias.index]);
    });
  }

  void add_reshape(const onnx::NodeProto& n, const std::string& node) {
    detail::OnnxReshapeOp op;
    std::optional<detail::OnnxSizes> target;  // computed by shape arithmetic, resolved as it runs
    op.who = node;
    if (n.op_type() == "Flatten") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"axis"});
      const std::int64_t axis = int_attr(n, "axis", 1);
      if (axis < 0 || axis > max_rank)
        unsupported(node, "axis " + std::to_string(axis) + " (duet takes 0 to the input's rank)");
      op.flatten_axis = static_cast<int>(axis);
    } else {
      arity(n, node, 2, 2);
      known_attributes(n, node, {"allowzero"});
      target = sizes_for_values(n.input(1), node);
      if (!target) unsupported(node, "a target shape that is not an int64 tensor");
      // The constants of the target are checked now; a size read from a shape is one.
      for (const detail::OnnxSize& e : target->elements)
        if (e.known()) op.dims.push_back(e.constant);
      if (target->elements.size() > static_cast<std::size_t>(max_rank) || std::ranges::count(op.dims, -1) > 1 ||
          std::ranges::any_of(op.dims, [](std::int64_t d) { return d < -1; })) {
        throw FormatError(where_ + ": " + node + ": the target shape " + list_text(op.dims) + " is not a shape");
      }
      if (int_attr(n, "allowzero", 0) != 0 && std::ranges::count(op.dims, 0) > 0)
        unsupported(node, "allowzero 1 with a size 0");
      if (integers_.contains(n.input(1))) target.reset();  // all constant: op.dims is the target
    }
    const Operand x = operand_of(n.input(0), node);
    add_step(n.op_type(), n, node, [x, op, target](const OnnxModel& m, std::vector<Tensor>& v) {
      if (!target) return m.with(x, v, [&](const auto& in) -> Tensor { return apply(op, in); });
      detail::OnnxReshapeOp resolved = op;
      resolved.dims = OnnxModel::resolve(*target, v);
      // Shape arithmetic can compute any int64.
      if (std::ranges::count(resolved.dims, -1) > 1 ||
          std::ranges::any_of(resolved.dims, [](std::int64_t d) { return d < -1; })) {
        throw ShapeError("the target shape " + list_text(resolved.dims) + " is not a shape");
      }
      return m.with(x, v, [&](const auto& in) -> Tensor { return apply(resolved, in); });
    });
  }

  // --- shape arithmetic ------------------------------------------------------------------------

  // A shape has at most max_rank sizes. Bounding every list here keeps a small file from asking
  // for much memory: a chain of Concats of a list with itself doubles it at each node, and a
  // long constant copied by every node of a chain grows with the square of the file.
  void check_sizes(std::size_t count, const std::string& node) const {
    if (count > static_cast<std::size_t>(max_rank)) {
      throw FormatError(where_ + ": " + node + ": " + std::to_string(count) + " int64s where a shape has at most " +
                        std::to_string(max_rank));
    }
  }

  // The int64 tensor of that name as sizes, if it is one.
  std::optional<detail::OnnxSizes> sizes_of(const std::string& name, const std::string& node) const {
    if (const auto it = sizes_.find(name); it != sizes_.end()) return it->second;
    const auto constant = integers_.find(name);
    if (constant == integers_.end()) return std::nullopt;
    check_sizes(constant->second.size(), node);
    detail::OnnxSizes sizes;
    for (const std::int64_t c : constant->second)
      sizes.elements.push_back({.constant = c, .value = 0, .axis = std::nullopt});
    return sizes;
  }

  // Sizes a float value's shape is made of (Reshape's target, Expand's shape): never the token
  // ids' (value 0 of a model of ids holds nothing; only a Range reads their sizes).
  std::optional<detail::OnnxSizes> sizes_for_values(const std::string& name, const std::string& node) const {
    std::optional<detail::OnnxSizes> sizes = sizes_of(name, node);
    if (sizes && model_.ids_input_ && (sizes->shape_of == 0 || std::ranges::any_of(sizes->elements, [](const auto& e) {
                                         return e.axis && e.value == 0;
                                       }))) {
      unsupported(node, "a shape read from the token ids' Shape (duet reads their sizes only as a Range's bounds)");
    }
    return sizes;
  }

  // Shape's start and end (opset 15) as the axes [first, last) they keep, where they name them
  // without the rank: both from the front, or a start from the back to the end. None without them.
  std::optional<std::pair<int, int>> shape_part(const onnx::NodeProto& n, const std::string& node) const {
    const onnx::AttributeProto* start = attribute(n, "start");
    const onnx::AttributeProto* end = attribute(n, "end");
    const std::int64_t first = start == nullptr ? 0 : start->i();
    if (first == 0 && end == nullptr) return std::nullopt;
    if (first >= -max_rank && first < 0 && end == nullptr) return std::pair{static_cast<int>(first), 0};
    const std::int64_t last = end == nullptr ? -1 : end->i();
    if (first < 0 || first > max_rank || last < first || last > max_rank) {
      unsupported(node, "start " + std::to_string(first) + " and end " +
                            (end == nullptr ? "(none)" : std::to_string(last)) +
                            " (duet reads both from the front, or a start from the back with no end)");
    }
    return std::pair{static_cast<int>(first), static_cast<int>(last)};
  }

  // Range(start, limit, delta) of one size each, torch's torch.arange(ids.size(1)) and duet's
  // ops::positions, read only as the indices of a Gather along axis 0 (a positional embedding),
  // through Casts to int32 or int64 if any. It makes no step: the Gather computes the positions
  // from the sizes as it runs (OnnxModel::positions_now) and looks them up, as add_id_gather
  // looks the ids up. False for a node that is none of these.
  bool positions(const onnx::NodeProto& n, const std::string& node) {
    const std::string& op = n.op_type();
    const bool range_in = n.input_size() > 0 && ranges_.contains(n.input(op == "Gather" ? n.input_size() - 1 : 0));
    detail::OnnxRange range;
    if (op == "Range") {
      arity(n, node, 3, 3);
      known_attributes(n, node, {});
      for (std::size_t i = 0; i < 3; ++i) {
        const std::string& bound = n.input(static_cast<int>(i));
        const std::optional<detail::OnnxSizes> size = bound.empty() ? std::nullopt : sizes_of(bound, node);
        if (!size || size->shape_of || size->elements.size() != 1) {
          unsupported(node,
                      "a Range whose start, limit or delta is not one int64 (a constant, or a size read from a "
                      "Shape)");
        }
        range.bounds[i] = size->elements.front();
      }
    } else if (op == "Cast" && range_in) {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"to"});
      const std::int64_t to = int_attr(n, "to", 0);
      if (to != onnx::TensorProto::INT32 && to != onnx::TensorProto::INT64)
        unsupported(node, "a Cast of a Range to other than int32 or int64");
      range = ranges_.at(n.input(0));
    } else if (op == "Gather" && range_in) {
      arity(n, node, 2, 2);
      known_attributes(n, node, {"axis"});
      if (int_attr(n, "axis", 0) != 0) unsupported(node, "a Gather by a Range along an axis other than 0");
      const Operand table = operand_of(n.input(0), node);
      add_step("Gather", n, node, {});
      model_.steps_.back().on_ids = [table, range = ranges_.at(n.input(1))](const OnnxModel& m,
                                                                            const std::vector<Tensor>& v,
                                                                            const BasicTensor<std::int32_t>& ids) {
        return m.with(table, v, [&](const auto& rows) -> Tensor {
          if (rows.shape().rank() == 0) throw ShapeError("a Gather of a tensor of rank 0");
          return ops::gather<0>(rows, m.positions_now(range, v, ids, rows.shape()[0]));
        });
      };
      return true;
    } else {
      return false;
    }
    if (n.output(0).empty() || defined(n.output(0)))
      throw FormatError(where_ + ": " + node + " has no new output name");
    ranges_[n.output(0)] = range;
    return true;
  }

  const std::vector<std::int64_t>& constant_ints(const onnx::NodeProto& n, const std::string& node, int input,
                                                 const std::string& what) const {
    const auto it = integers_.find(n.input(input));
    if (it == integers_.end()) unsupported(node, what + " that are not a constant int64 tensor");
    return it->second;
  }

  // Shape, Gather, Unsqueeze, Squeeze, Cast, Concat, and Add, Sub, Mul and Div on int64 tensors,
  // as torch.onnx.export writes x.view(x.size(0), -1) with a dynamic batch, or an attention's
  // heads: they make no step, only the sizes a Reshape or Slice resolves when it runs. False for
  // a node that is not shape arithmetic.
  bool shape_arithmetic(const onnx::NodeProto& n, const std::string& node) {
    const std::string& op = n.op_type();
    const bool binary = op == "Add" || op == "Sub" || op == "Mul" || op == "Div";
    if (binary && n.input_size() == 2 && (integer(n.input(0)) || integer(n.input(1)))) return size_arithmetic(n, node);
    if (binary) return false;
    const bool integers_in = n.input_size() > 0 && integer(n.input(0));
    if (op != "Shape" &&
        !((op == "Gather" || op == "Unsqueeze" || op == "Squeeze" || op == "Cast" || op == "Concat") && integers_in)) {
      if (op == "Gather" && n.input_size() == 2 && !ids_input_name_.empty() && n.input(1) == ids_input_name_) {
        add_id_gather(n, node);
        return true;
      }
      if (op == "Gather" && n.input_size() == 2 && integers_.contains(n.input(1)) &&
          integers_.at(n.input(1)).size() == 1) {
        add_take(n, node);
        return true;
      }
      if (op == "Gather") {
        unsupported(node,
                    "a Gather of a float tensor by other than one constant index (duet reads x[:, -1], and Gathers "
                    "in shape arithmetic)");
      }
      if (op == "Shape" || op == "Cast") {
        unsupported(node, "the operator " + op + " on a float tensor (duet reads it in shape arithmetic only)");
      }
      return false;
    }
    detail::OnnxSizes out;
    if (op == "Shape") {
      arity(n, node, 1, 1);
      known_attributes(n, node, {"start", "end"});
      if (integers_in) unsupported(node, "the Shape of an int64 tensor");
      // The token ids are value 0 (which holds nothing in such a model): their sizes are read
      // only as a Range's bounds (sizes_for_values).
      const Operand x = n.input(0) == ids_input_name_ ? Operand{} : operand_of(n.input(0), node);
      const std::optional<std::pair<int, int>> part = shape_part(n, node);
      if (x.kind == Kind::value && part) {
        for (int a = part->first; a < part->second; ++a)
          out.elements.push_back({.constant = 0, .value = x.index, .axis = a});
      } else if (x.kind == Kind::value) {
        out.shape_of = x.index;
      } else if (part) {
        unsupported(node, "start and end of the Shape of a weight");
      } else {
        const Shape shape =
            x.kind == Kind::parameter ? model_.parameters_[x.index]->shape() : model_.constants_[x.index].shape();
        for (const index_t d : shape) out.elements.push_back({.constant = d, .value = 0, .axis = std::nullopt});
      }
    } else if (op == "Gather") {
      arity(n, node, 2, 2);
      known_attributes(n, node, {"axis"});
      if (int_attr(n, "axis", 0) != 0) unsupported(node, "a Gather of int64s along an axis other than 0");
      const detail::OnnxSizes from = *sizes_of(n.input(0), node);
      const std::vector<std::int64_t>& indices = constant_ints(n, node, 1, "indices");
      check_sizes(indices.size(), node);
      for (const std::int64_t i : indices) {
        if (from.shape_of) {
          if (i < -max_rank || i >= max_rank)
            throw FormatError(where_ + ": " + node + ": index " + std::to_string(i) + " of a Shape");
          out.elements.push_back({.constant = 0, .value = *from.shape_of, .axis = static_cast<int>(i)});
        } else {
          const auto size = static_cast<std::int64_t>(from.elements.size());
          if (i < -size || i >= size) {
            throw FormatError(where_ + ": " + node + ": index " + std::to_string(i) + " of " + std::to_string(size) +
                              " elements");
          }
          out.elements.push_back(from.elements[static_cast<std::size_t>(i < 0 ? i + size : i)]);
        }
      }
    } else if (op == "Concat") {
      known_attributes(n, node, {"axis"});
      const std::int64_t axis = int_attr(n, "axis", 0);
      if (axis != 0 && axis != -1)
        throw FormatError(where_ + ": " + node + ": axis " + std::to_string(axis) + " of int64 vectors");
      for (const std::string& name : n.input()) {
        const std::optional<detail::OnnxSizes> part = sizes_of(name, node);
        if (!part) unsupported(node, "concatenating float and int64 tensors");
        if (part->shape_of)
          unsupported(node, "concatenating a whole Shape (duet reads a Shape's dimensions one by one, by Gather)");
        out.elements.insert(out.elements.end(), part->elements.begin(), part->elements.end());
        check_sizes(out.elements.size(), node);
      }
    } else {
      // Unsqueeze, Squeeze and Cast to int64 leave the elements as they are.
      if (op == "Cast") {
        arity(n, node, 1, 1);
        known_attributes(n, node, {"to"});
        if (int_attr(n, "to", 0) != onnx::TensorProto::INT64) unsupported(node, "a Cast of int64s to another type");
      } else {
        arity(n, node, 1, 2);
        known_attributes(n, node, {});
        if (n.input_size() == 2) static_cast<void>(constant_ints(n, node, 1, "axes"));
      }
      out = *sizes_of(n.input(0), node);
    }
    if (n.output(0).empty() || defined(n.output(0)))
      throw FormatError(where_ + ": " + node + " has no new output name");
    sizes_[n.output(0)] = std::move(out);
    return true;
  }

  // Add, Sub, Mul or Div of two int64 tensors of one element or of equal lengths (numpy's
  // broadcasting of shape arithmetic's flat tensors), folded now where both are constants.
  bool size_arithmetic(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 2);
    known_attributes(n, node, {});
    const std::optional<detail::OnnxSizes> a = sizes_of(n.input(0), node);
    const std::optional<detail::OnnxSizes> b = sizes_of(n.input(1), node);
    if (!a || !b) unsupported(node, "arithmetic of a float and an int64 tensor");
    if (a->shape_of || b->shape_of) {
      unsupported(node, "arithmetic on a whole Shape (duet reads a Shape's dimensions one by one, by Gather)");
    }
    const std::size_t na = a->elements.size();
    const std::size_t nb = b->elements.size();
    if (na != nb && na != 1 && nb != 1) {
      throw FormatError(where_ + ": " + node + ": int64 tensors of " + std::to_string(na) + " and " +
                        std::to_string(nb) + " elements do not broadcast");
    }
    const char op = n.op_type() == "Add" ? '+' : n.op_type() == "Sub" ? '-' : n.op_type() == "Mul" ? '*' : '/';
    detail::OnnxSizes out;
    for (std::size_t i = 0; i < (na == 1 ? nb : na); ++i) {
      const detail::OnnxSize& x = a->elements[na == 1 ? 0 : i];
      const detail::OnnxSize& y = b->elements[nb == 1 ? 0 : i];
      if (x.known() && y.known()) {
        const std::optional<std::int64_t> r = detail::onnx_arithmetic(op, x.constant, y.constant);
        if (!r) {
          throw FormatError(where_ + ": " + node + ": " + std::to_string(x.constant) + " " + op + " " +
                            std::to_string(y.constant) + " divides by zero or overflows int64");
        }
        out.elements.push_back({.constant = *r});
        continue;
      }
      // A chain of nodes each adding a size to itself would double the work of computing it.
      if (x.terms + y.terms >= 64) unsupported(node, "shape arithmetic of more than 64 terms");
      out.elements.push_back({.op = op,
                              .lhs = std::make_shared<const detail::OnnxSize>(x),
                              .rhs = std::make_shared<const detail::OnnxSize>(y),
                              .terms = x.terms + y.terms + 1});
    }
    if (n.output(0).empty() || defined(n.output(0)))
      throw FormatError(where_ + ": " + node + " has no new output name");
    sizes_[n.output(0)] = std::move(out);
    return true;
  }

  // Slice(data, starts, ends, axes, steps), the axes and steps constant, the starts and ends
  // constant or computed by shape arithmetic (torch splits an attention's packed projection at
  // multiples of its last size / 3): ops::strided_slice with the lists given at run time, whose
  // rules (negative indices from the end, clamping, negative steps) are ONNX's.
  void add_slice(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 3, 5);
    known_attributes(n, node, {});
    const Operand x = operand_of(n.input(0), node);
    const auto bounds = [&](int i, const std::string& what) {
      const std::optional<detail::OnnxSizes> b = sizes_of(n.input(i), node);
      if (!b || b->shape_of)
        unsupported(node, what + " that are not an int64 tensor of constants or of a Shape's dimensions");
      return *b;
    };
    const detail::OnnxSizes starts = bounds(1, "starts");
    const detail::OnnxSizes ends = bounds(2, "ends");
    const std::size_t count = starts.elements.size();
    std::vector<std::int64_t> axes;
    if (n.input_size() > 3 && !n.input(3).empty())
      axes = constant_ints(n, node, 3, "axes");
    else
      for (std::size_t a = 0; a < count; ++a) axes.push_back(static_cast<std::int64_t>(a));
    std::vector<std::int64_t> steps(count, 1);
    if (n.input_size() > 4 && !n.input(4).empty()) steps = constant_ints(n, node, 4, "steps");
    check_sizes(count, node);
    if (ends.elements.size() != count || axes.size() != count || steps.size() != count) {
      throw FormatError(where_ + ": " + node + ": starts, ends, axes and steps of different lengths");
    }
    for (std::size_t i = 0; i < axes.size(); ++i) {
      if (axes[i] < -max_rank || axes[i] >= max_rank || std::ranges::count(axes, axes[i]) > 1 || steps[i] == 0 ||
          steps[i] == std::numeric_limits<std::int64_t>::min()) {
        throw FormatError(where_ + ": " + node + ": axes " + list_text(axes) + " and steps " + list_text(steps) +
                          " (each axis once, of a rank duet has; no step 0 or -2^63)");
      }
    }
    add_step("Slice", n, node, [x, starts, ends, axes, steps](const OnnxModel& m, std::vector<Tensor>& v) {
      const std::vector<std::int64_t> first = OnnxModel::resolve(starts, v);
      const std::vector<std::int64_t> last = OnnxModel::resolve(ends, v);
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const int rank = in.shape().rank();
        std::array<index_t, max_rank> begin{}, end{}, stride{};
        end.fill(ops::to_end);
        stride.fill(1);
        std::size_t used = 0;
        for (std::size_t i = 0; i < axes.size(); ++i) {
          const std::int64_t a = axes[i] < 0 ? axes[i] + rank : axes[i];
          if (a < 0 || a >= rank) {
            throw ShapeError("axes " + list_text(axes) + " for an input of shape " + to_string(in.shape()));
          }
          const auto k = static_cast<std::size_t>(a);
          begin[k] = first[i];
          end[k] = last[i];
          stride[k] = steps[i];
          used = std::max(used, k + 1);
        }
        return ops::strided_slice(in, std::span(begin).first(used), std::span(end).first(used),
                                  std::span(stride).first(used));
      });
    });
  }

  // ReduceSum's axes are an input from opset 13, the others' from 18 (an attribute before).
  void add_reduce(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 1, 2);
    known_attributes(n, node, {"axes", "keepdims", "noop_with_empty_axes"});
    const Operand x = operand_of(n.input(0), node);
    std::vector<std::int64_t> given = ints_attr(n, "axes");
    if (n.input_size() == 2 && !n.input(1).empty()) given = constant_ints(n, node, 1, "axes");
    check_sizes(given.size(), node);
    std::vector<int> axes;
    for (const std::int64_t a : given) {
      if (a < -max_rank || a >= max_rank || std::ranges::count(given, a) > 1) {
        throw FormatError(where_ + ": " + node + ": axes " + list_text(given) + " (each once, of a rank duet has)");
      }
      axes.push_back(static_cast<int>(a));
    }
    if (axes.empty() && int_attr(n, "noop_with_empty_axes", 0) != 0) {
      if (n.output(0).empty() || defined(n.output(0)))
        throw FormatError(where_ + ": " + node + " has no new output name");
      operands_[n.output(0)] = x;  // no axes and told so: the identity
      return;
    }
    const bool keep = int_attr(n, "keepdims", 1) != 0;
    const std::string op = n.op_type();
    add_step(op, n, node, [x, axes, keep, op](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const std::span<const int> over(axes);
        const auto reduce = [&](auto f) -> Tensor {
          if (keep) return f(in, over, ops::keep_dims);
          return f(in, over);
        };
        if (op == "ReduceSum") return reduce([](const auto&... a) { return ops::sum(a...); });
        if (op == "ReduceMean") return reduce([](const auto&... a) { return ops::mean(a...); });
        if (op == "ReduceMax") return reduce([](const auto&... a) { return ops::max(a...); });
        if (op == "ReduceProd") return reduce([](const auto&... a) { return ops::prod(a...); });
        return reduce([](const auto&... a) { return ops::min(a...); });
      });
    });
  }

  // Unsqueeze and Squeeze of a float tensor (of int64s they are shape arithmetic): a view
  // with the size-1 axes added or removed, resolved when it runs.
  // ConstantOfShape (a float value, 0 unless given) and Expand (x broadcast to the shape, as
  // x + zeros(shape), whose gradient is x's): torch makes a recurrence's zero initial states
  // so, of the batch's size, which shape arithmetic reads as the network runs. The constant
  // sizes may ask for no more elements than the file's weights hold, so that a small file
  // cannot make a large tensor.
  void add_fill(const onnx::NodeProto& n, const std::string& node) {
    const bool expand = n.op_type() == "Expand";
    arity(n, node, expand ? 2 : 1, expand ? 2 : 1);
    if (expand)
      known_attributes(n, node, {});
    else
      known_attributes(n, node, {"value"});
    float value = 0;
    if (const onnx::AttributeProto* a = expand ? nullptr : attribute(n, "value")) {
      if (!a->has_t() || a->t().data_type() != onnx::TensorProto::FLOAT)
        unsupported(node, "a value that is not a float");
      value = detail::onnx_elements<float>(a->t(), "ConstantOfShape's value", 1, where_)[0];
    }
    const std::optional<detail::OnnxSizes> shape = sizes_for_values(n.input(expand ? 1 : 0), node);
    if (!shape) unsupported(node, "a shape that is not an int64 tensor");
    const index_t weights = weight_elements();
    index_t constant = 1;
    for (const detail::OnnxSize& e : shape->elements) {
      if (!e.known()) continue;
      if (e.constant < 0 || __builtin_mul_overflow(constant, e.constant, &constant) || constant > weights) {
        std::vector<std::int64_t> sizes;
        for (const detail::OnnxSize& f : shape->elements) sizes.push_back(f.known() ? f.constant : -1);
        unsupported(node, "a shape of sizes " + list_text(sizes) +
                              " (-1: read as it runs), more elements than the model's weights,");
      }
    }
    const std::optional<Operand> x = expand ? std::optional(operand_of(n.input(0), node)) : std::nullopt;
    add_step(n.op_type(), n, node,
             [x, sizes = *shape, value, weights](const OnnxModel& m, std::vector<Tensor>& v) -> Tensor {
               const std::vector<std::int64_t> dims = OnnxModel::resolve(sizes, v);
               // Shape arithmetic's sizes are bounded as the constants are (a value's dimension is one
               // that exists).
               index_t computed = 1;
               for (std::size_t i = 0; i < sizes.elements.size(); ++i) {
                 if (dims[i] < 0 || (!sizes.elements[i].axis &&
                                     (__builtin_mul_overflow(computed, dims[i], &computed) || computed > weights))) {
                   throw ShapeError("a shape of sizes " + list_text(dims) +
                                    " (negative, or more elements than the model's weights)");
                 }
               }
               Shape to;
               for (const std::int64_t d : dims) to.push_back(d);
               if (!x) return full(to, value);
               return m.with(*x, v, [&](const auto& in) -> Tensor { return ops::add(in, zeros(to)); });
             });
  }

  // What bounds the sizes a file may ask for: its weights' elements, and 1.
  index_t weight_elements() const {
    index_t weights = 1;
    for (const auto& p : model_.parameters_) weights += p->numel();
    return weights;
  }

  // Tile by constant repeats, one per axis of its input (ONNX's rule; ops::tile also takes
  // fewer or more, as numpy's). As ConstantOfShape's sizes, the copies may be no more than the
  // file's weights have elements, so that a small file cannot make a large tensor.
  void add_tile(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 2);
    known_attributes(n, node, {});
    const std::vector<std::int64_t>& repeats = constant_ints(n, node, 1, "repeats");
    check_sizes(repeats.size(), node);
    index_t copies = 1;
    for (const std::int64_t r : repeats) {
      if (r < 0 || __builtin_mul_overflow(copies, r, &copies) || copies > weight_elements()) {
        unsupported(node, "repeats " + list_text(repeats) +
                              " (negative, or more copies than the model's weights have elements)");
      }
    }
    const std::vector<index_t> times(repeats.begin(), repeats.end());
    const Operand x = operand_of(n.input(0), node);
    add_step("Tile", n, node, [x, times](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        if (in.shape().rank() != static_cast<int>(times.size())) {
          throw ShapeError("repeats of " + std::to_string(times.size()) + " axes for an input of shape " +
                           to_string(in.shape()));
        }
        return ops::tile(in, std::span<const index_t>(times));
      });
    });
  }

  // The rank of an int64 constant, an initializer or a Constant node's value.
  int constant_rank(const std::string& name) const {
    for (const onnx::TensorProto& t : proto_.graph().initializer())
      if (t.name() == name) return t.dims_size();
    const auto at = producers_.find(name);
    if (at == producers_.end()) return -1;
    const onnx::AttributeProto* value = attribute(proto_.graph().node(at->second), "value");
    if (value != nullptr && value->has_t()) return value->t().dims_size();
    const onnx::AttributeProto* ints = attribute(proto_.graph().node(at->second), "value_ints");
    return ints == nullptr ? 0 : 1;  // value_int is a scalar, value_ints a list
  }

  // A Gather by the token ids along axis 0, torch's nn.Embedding: ops::gather<0> of the table's
  // rows (nn::Embedding's lookup, and the same gradient). ONNX's negative indices count from
  // the end; torch's embedding refuses them, and so does duet (an IndexError).
  void add_id_gather(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 2, 2);
    known_attributes(n, node, {"axis"});
    if (int_attr(n, "axis", 0) != 0) unsupported(node, "a Gather by the token ids along an axis other than 0");
    const Operand table = operand_of(n.input(0), node);
    add_step("Gather", n, node, {});
    model_.steps_.back().on_ids = [table](const OnnxModel& m, const std::vector<Tensor>& v,
                                          const BasicTensor<std::int32_t>& ids) {
      return m.with(table, v, [&](const auto& rows) -> Tensor { return ops::gather<0>(rows, ids); });
    };
  }

  // A Gather of one constant index i along an axis of a float tensor, torch's x[:, i]: the
  // slice [i, i + 1) of that axis, which the index's rank 0 then drops (rank 1 keeps it).
  void add_take(const onnx::NodeProto& n, const std::string& node) {
    known_attributes(n, node, {"axis"});
    const int axis = axis_attr(n, node, 0);
    const std::int64_t index = integers_.at(n.input(1)).front();
    const bool drop = constant_rank(n.input(1)) == 0;
    const Operand x = operand_of(n.input(0), node);
    detail::OnnxReshapeOp view;
    view.who = node;
    add_step("Gather", n, node, [x, axis, index, drop, view](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const Shape& s = in.shape();
        const int a = axis < 0 ? axis + s.rank() : axis;
        if (a < 0 || a >= s.rank() || index < -s[a] || index >= s[a]) {
          throw IndexError("index " + std::to_string(index) + " of axis " + std::to_string(axis) +
                           " of a tensor of shape " + to_string(s));
        }
        std::array<index_t, max_rank> begin{}, end{}, stride{};
        end.fill(ops::to_end);
        stride.fill(1);
        const auto k = static_cast<std::size_t>(a);
        begin[k] = index < 0 ? index + s[a] : index;
        end[k] = begin[k] + 1;
        const Tensor slice = ops::strided_slice(in, std::span(begin).first(k + 1), std::span(end).first(k + 1),
                                                std::span(stride).first(k + 1));
        if (!drop) return slice;
        detail::OnnxReshapeOp resolved = view;
        for (int i = 0; i < s.rank(); ++i)
          if (i != a) resolved.dims.push_back(s[i]);
        if (std::ranges::count(resolved.dims, 0) > 0)
          throw ShapeError("a Gather of an empty tensor, shape " + to_string(s));
        return apply(resolved, slice);
      });
    });
  }

  void add_squeeze(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 1, 2);
    known_attributes(n, node, {});
    const bool add = n.op_type() == "Unsqueeze";
    const Operand x = operand_of(n.input(0), node);
    std::vector<std::int64_t> axes;
    if (n.input_size() == 2 && !n.input(1).empty()) axes = constant_ints(n, node, 1, "axes");
    if (add && axes.empty()) throw FormatError(where_ + ": " + node + " has no axes");
    check_sizes(axes.size(), node);
    detail::OnnxReshapeOp view;
    view.who = node;
    add_step(n.op_type(), n, node, [x, axes, add, view](const OnnxModel& m, std::vector<Tensor>& v) {
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const Shape& s = in.shape();
        const int rank = add ? s.rank() + static_cast<int>(axes.size()) : s.rank();
        std::array<bool, max_rank> marked{};
        for (const std::int64_t given : axes) {
          const std::int64_t a = given < 0 ? given + rank : given;
          if (a < 0 || a >= rank || rank > max_rank || marked[static_cast<std::size_t>(a)] ||
              (!add && s[static_cast<int>(a)] != 1)) {
            throw ShapeError(std::string(add ? "Unsqueeze" : "Squeeze") + " axes " + list_text(axes) +
                             " for an input of shape " + to_string(s));
          }
          marked[static_cast<std::size_t>(a)] = true;
        }
        detail::OnnxReshapeOp resolved = view;
        for (int i = 0, from = 0; i < rank; ++i) {
          const bool here = marked[static_cast<std::size_t>(i)];
          if (add)
            resolved.dims.push_back(here ? 1 : s[from++]);
          else if (!here && !(axes.empty() && s[i] == 1))
            resolved.dims.push_back(s[i]);
        }
        // A size 0 in the target would read as "this axis of the input".
        if (std::ranges::count(resolved.dims, 0) > 0)
          throw ShapeError(std::string(add ? "Unsqueeze" : "Squeeze") + " of an empty tensor, shape " + to_string(s));
        return apply(resolved, in);
      });
    });
  }

  void add_transpose(const onnx::NodeProto& n, const std::string& node) {
    arity(n, node, 1, 1);
    known_attributes(n, node, {"perm"});
    const std::vector<std::int64_t> given = ints_attr(n, "perm");
    // Checked as int64s: narrowed first, 2^32 + 1 would pass as axis 1. No perm is ONNX's
    // default, the axes reversed, known when the step sees its input's rank.
    std::vector<std::int64_t> sorted = given;
    std::ranges::sort(sorted);
    for (std::size_t i = 0; i < sorted.size(); ++i)
      if (sorted[i] != static_cast<std::int64_t>(i))
        throw FormatError(where_ + ": " + node + ": perm " + list_text(given) + " is not a permutation");
    if (given.size() > static_cast<std::size_t>(max_rank)) {
      unsupported(node, "perm " + list_text(given) + " (duet's ONNX import transposes ranks up to " +
                            std::to_string(max_rank) + ")");
    }
    const std::vector<int> given_perm(given.begin(), given.end());
    const Operand x = operand_of(n.input(0), node);
    add_step("Transpose", n, node, [x, given_perm](const OnnxModel& m, std::vector<Tensor>& v) {
      // An initializer too: export_onnx writes a Dense on more than two axes as a MatMul by its
      // transposed weight.
      return m.with(x, v, [&](const auto& in) -> Tensor {
        const int rank = in.shape().rank();
        std::vector<int> perm = given_perm;
        if (perm.empty()) {
          for (int axis = rank - 1; axis >= 0; --axis) perm.push_back(axis);
        }
        if (rank != static_cast<int>(perm.size())) {
          throw ShapeError("perm of " + std::to_string(perm.size()) + " axes for an input of shape " +
                           to_string(in.shape()));
        }
        return ops::transpose(in, perm);
      });
    });
  }

  void add_concat(const onnx::NodeProto& n, const std::string& node) {
    if (n.input_size() < 1) throw FormatError(where_ + ": " + node + " has no input");
    arity(n, node, 1, INT_MAX);
    known_attributes(n, node, {"axis"});
    if (attribute(n, "axis") == nullptr) throw FormatError(where_ + ": " + node + " has no axis");
    const int axis = axis_attr(n, node, 0);
    std::vector<Operand> in;
    for (const std::string& name : n.input()) in.push_back(operand_of(name, node));
    add_step("Concat", n, node, [in, axis](const OnnxModel& m, std::vector<Tensor>& v) {
      const auto rank_of = [&](const Operand& o) {
        return m.with(o, v, [](const auto& t) { return Tensor(t); }).shape().rank();
      };
      const int rank = rank_of(in[0]);
      const int a = axis < 0 ? axis + rank : axis;
      if (a < 0 || a >= rank || rank > 4) {
        throw ShapeError("axis " + std::to_string(axis) + " for inputs of rank " + std::to_string(rank) +
                         " (duet's ONNX import concatenates ranks up to 4)");
      }
      // Pairwise: concat<Axis>(a, b) is one instantiation per axis.
      Tensor acc = m.with(in[0], v, [](const auto& t) { return Tensor(t); });
      if (in.size() == 1) return acc;
      for (std::size_t i = 1; i < in.size(); ++i) {
        acc = m.with(in[i], v, [&](const auto& t) { return detail::onnx_concat(acc, t, a); });
      }
      return acc;
    });
  }

  const onnx::ModelProto& proto_;
  std::string where_;
  OnnxModel model_;
  std::map<std::string, Operand> operands_;
  std::map<std::string, std::vector<std::int64_t>> integers_;
  std::map<std::string, detail::OnnxSizes> sizes_;   // int64 tensors shape arithmetic made
  std::map<std::string, detail::OnnxRange> ranges_;  // Ranges of sizes, and Casts of them (positions)
  std::map<std::string, int> consumers_;             // the nodes and graph outputs reading each value
  std::map<std::string, int> readers_;               // the last node reading each value
  std::map<std::string, int> producers_;             // the node writing each value
  // A GRU's or LSTM's parameters, weight_ih, weight_hh, bias_ih, bias_hh (prepare_recurrence).
  std::map<int, std::array<std::size_t, 4>> recurrences_;
  std::set<int> skipped_;
  std::map<int, std::array<index_t, 2>>
      pool_padding_;  // an AveragePool's padding (height, width), from the Pad before it
};

DUET_DETAIL_ONNX_INLINE OnnxModel load_onnx_bytes(std::span<const std::byte> bytes, const std::string& where) {
  const onnx::ModelProto proto = detail::parse_onnx(bytes, where);
  return OnnxBuilder(proto, where).build();
}

DUET_DETAIL_ONNX_INLINE OnnxModel load_onnx(const std::filesystem::path& path) {
  const std::string where = detail::onnx_where(path);
  const std::vector<unsigned char> bytes = duet::detail::read_whole_file(path, where);
  return load_onnx_bytes(std::as_bytes(std::span(bytes)), where);
}

DUET_DETAIL_ONNX_INLINE CheckpointLoad load_onnx_weights(const std::filesystem::path& path, nn::DynamicCell& net,
                                                         const std::map<std::string, std::string>& name_map) {
  const std::string where = detail::onnx_where(path);
  const std::vector<unsigned char> bytes = duet::detail::read_whole_file(path, where);
  const onnx::ModelProto proto = detail::parse_onnx(std::as_bytes(std::span(bytes)), where);
  std::map<std::string, const onnx::TensorProto*> initializers;
  for (const onnx::TensorProto& t : proto.graph().initializer()) initializers[t.name()] = &t;
  const auto targets = duet::detail::parameter_targets(net, where);
  for (const auto& [name, source] : name_map) {
    if (std::ranges::find(targets, name, &duet::detail::CheckpointTarget<float>::name) == targets.end()) {
      throw ValueError(where + ": the name map gives " + detail::onnx_quoted(source) + " for " +
                       detail::onnx_quoted(name) + ", which is not a parameter of " + net.type_name());
    }
  }
  std::vector<std::vector<float>> values;
  std::set<std::string> used;
  for (const auto& [name, tensor] : targets) {
    const auto mapped = name_map.find(name);
    const std::string& source = mapped == name_map.end() ? name : mapped->second;
    const std::string parameter =
        "the network's parameter " + detail::onnx_quoted(name) + " " + to_string(tensor->shape());
    const auto found = initializers.find(source);
    if (found == initializers.end()) {
      throw FormatError(where + ": " + parameter + " has no initializer " + detail::onnx_quoted(source) +
                        (mapped == name_map.end() ? " (give its name in the name map)" : ""));
    }
    const onnx::TensorProto& t = *found->second;
    const std::string what = "initializer " + detail::onnx_quoted(source);
    if (t.data_type() != onnx::TensorProto::FLOAT) {
      throw FormatError(where + ": " + parameter + " is float32, " + what + " has ONNX data type " +
                        std::to_string(t.data_type()));
    }
    const Shape shape = detail::onnx_shape(t, what, where);
    if (!(shape == tensor->shape())) {
      throw FormatError(where + ": " + parameter + " does not fit " + what + " " + to_string(shape));
    }
    values.push_back(detail::onnx_elements<float>(t, what, shape.numel(), where));
    used.insert(source);
  }
  const auto parameters = net.parameters();  // targets' order
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    nn::Parameter& p = *parameters[i].parameter;
    p.set_data(Tensor(p.shape(), std::span<const float>(values[i])));
  }
  CheckpointLoad left;
  for (const auto& [name, t] : initializers)
    if (t->data_type() == onnx::TensorProto::FLOAT && !used.contains(name)) left.ckpt_not_load.push_back(name);
  return left;
}

}  // namespace duet::io
