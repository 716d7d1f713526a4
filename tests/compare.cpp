// duet::compare_modes and duet::runs_in_both_modes: the seed network agrees with itself in
// both modes, forward and gradients; a user's operation whose fused graph form computes
// something else is found, named, and its worst element given with both values.
#include <algorithm>
#include <array>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "support.hpp"

namespace tests_compare {

using namespace duet;
using duet_test::SeedNetwork;

// A named namespace: the fused form's contract members are not all read, which clang reports
// for internal linkage.
namespace compare_test {

// x + amount: a user's elementwise operation, which graph mode fuses with a ReLU after it
// into ShiftRelu, its own rule says.
struct ShiftRelu;

struct Shift : ops::Primitive<Shift> {
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;
  static constexpr bool differentiable = false;
  explicit Shift(float a) : amount(a) {}
  float amount;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.in_shape().numel(); ++i) a.out<T>()[i] = a.in<T>()[i] + T(amount);
  }
  static std::string op_name() { return "Shift"; }
  template <class C>
  static constexpr bool accepts_epilogue = std::is_same_v<C, ops::MapOp<fn::Relu>>;
  ShiftRelu absorb(const ops::MapOp<fn::Relu>&) const;
};

// The fused form, deliberately wrong: it adds 1e-3 more than Shift then ReLU would, so graph
// mode (which runs it at O1) and PyNative (which runs Shift, then ReLU) disagree.
struct ShiftRelu : ops::Primitive<ShiftRelu> {
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;
  static constexpr bool differentiable = false;
  explicit ShiftRelu(float a) : amount(a) {}
  float amount;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.in_shape().numel(); ++i) {
      a.out<T>()[i] = std::max(a.in<T>()[i] + T(amount) + T(1e-3), T(0));
    }
  }
  static std::string op_name() { return "Shift + ReLU"; }
};

ShiftRelu Shift::absorb(const ops::MapOp<fn::Relu>&) const { return ShiftRelu(amount); }

// dx = dy: the gradient of x + amount.
struct PassGrad : ops::Primitive<PassGrad> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    std::copy_n(a.in<T>(), a.in_shape().numel(), a.out<T>());
  }
  static std::string op_name() { return "OffsetGrad"; }
};

// dx = dy where the output y is positive: ReLU's gradient through the offset, deliberately
// 1.001 times too large.
struct OffsetReluGrad : ops::Primitive<OffsetReluGrad> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::output};
  static constexpr int arity = 2;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.in_shape().numel(); ++i) {
      a.out<T>()[i] = a.in<T>(1)[i] > T(0) ? a.in<T>(0)[i] * T(1.001) : T(0);
    }
  }
  static std::string op_name() { return "OffsetReluGrad"; }
};

struct OffsetRelu;

// x + amount, differentiable, fused with a ReLU after it into OffsetRelu: a forward kernel
// that is right, and a gradient that is not. Graph mode differentiates the fused form.
struct Offset : ops::Primitive<Offset> {
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;
  explicit Offset(float a) : amount(a) {}
  float amount;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.in_shape().numel(); ++i) a.out<T>()[i] = a.in<T>()[i] + T(amount);
  }
  template <std::size_t K>
    requires(K == 0)
  PassGrad grad_op() const {
    return {};
  }
  static std::string op_name() { return "Offset"; }
  template <class C>
  static constexpr bool accepts_epilogue = std::is_same_v<C, ops::MapOp<fn::Relu>>;
  OffsetRelu absorb(const ops::MapOp<fn::Relu>&) const;
};

struct OffsetRelu : ops::Primitive<OffsetRelu> {
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;
  explicit OffsetRelu(float a) : amount(a) {}
  float amount;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    for (index_t i = 0; i < a.in_shape().numel(); ++i) a.out<T>()[i] = std::max(a.in<T>()[i] + T(amount), T(0));
  }
  template <std::size_t K>
    requires(K == 0)
  OffsetReluGrad grad_op() const {
    return {};
  }
  static std::string op_name() { return "Offset + ReLU"; }
};

OffsetRelu Offset::absorb(const ops::MapOp<fn::Relu>&) const { return OffsetRelu(amount); }

}  // namespace compare_test

namespace {

using compare_test::Offset;
using compare_test::Shift;

struct Shifted : nn::Cell<Shifted> {
  nn::Dense<4, 6> hidden;
  nn::Dense<6, 3> head;
  DUET_CELL_MEMBERS(hidden, head);
  auto construct(auto x) {
    const auto h = hidden(x);
    return head(ops::relu(apply(Shift(0.25f), h)));
  }
};

struct OffsetNet : nn::Cell<OffsetNet> {
  nn::Dense<4, 6> hidden;
  nn::Dense<6, 3> head;
  DUET_CELL_MEMBERS(hidden, head);
  auto construct(auto x) {
    const auto h = hidden(x);
    return head(ops::relu(apply(Offset(0.25f), h)));
  }
};

// h * 2 and h * 3 are one operation type on the same input, yet two values: an ambiguous
// capture, which graph mode runs traced.
struct TwoProducts : nn::Cell<TwoProducts> {
  nn::Dense<4, 4> dense;
  DUET_CELL_MEMBERS(dense);
  auto construct(auto x) {
    const auto h = dense(x);
    return h * 2.f + h * 3.f;
  }
};

// A member read by construct: a constant of the graph captured by the first graph-mode call,
// read afresh by every PyNative call (README, "Capture time and run time").
struct Scaled : nn::Cell<Scaled> {
  nn::Dense<4, 3> fc;
  float scale = 2.0f;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) { return fc(x) * scale; }
};

// At evaluation graph mode folds the BatchNorm into the convolution's weight and bias, which
// moves the last bits (README, "BatchNorm folding").
struct ConvNorm : nn::Cell<ConvNorm> {
  nn::Conv2d<1, 8, 3> conv;
  nn::BatchNorm2d<8> bn;
  nn::ReLU relu;
  nn::Flatten flatten;
  DUET_CELL_MEMBERS(conv, bn, relu, flatten);
  auto construct(auto x) { return flatten(relu(bn(conv(x)))); }
};

using SeedPattern = StaticShape<dyn, 1, 28, 28>;


// Attention's three projections as one product and ops::split: graph mode computes each piece
// where it is used, after PyNative's order has passed it.
struct SplitAttention : nn::Cell<SplitAttention> {
  nn::Dense<4, 12> qkv;
  nn::Dense<4, 3> head;
  DUET_CELL_MEMBERS(qkv, head);
  auto construct(auto x) {
    auto [q, k, v] = ops::split<-1, 4, 4, 4>(qkv(x));
    auto attention = ops::softmax(ops::matmul(q, k, ops::transpose_b) * 0.5f, -1);
    return head(ops::mean(ops::matmul(attention, v), ops::axes<1>));
  }
};

// (h + x) * scale + bias fuses into one elementwise pass of three steps; the Add after it has
// the same name and shape as the first of them.
struct ResidualScale : nn::Cell<ResidualScale> {
  nn::Dense<4, 4> fc;
  nn::Parameter scale{Tensor({4}, {0.5f, -1.5f, 2.0f, 0.25f})};
  nn::Parameter bias{Tensor({4}, {0.1f, 0.2f, -0.3f, 0.4f})};
  DUET_CELL_MEMBERS(fc, scale, bias);
  auto construct(auto x) {
    const auto b = (fc(x) + x) * scale + bias;
    return ops::tanh(b) + b;
  }
};

// A shortcut computed before the main branch: PyNative runs side first, graph mode (in
// post-order) fc2 first, and both are a product with a bias on [?, 3].
struct SideFirst : nn::Cell<SideFirst> {
  nn::Dense<4, 6> fc1;
  nn::Dense<6, 3> fc2;
  nn::Dense<4, 3> side;
  DUET_CELL_MEMBERS(fc1, fc2, side);
  auto construct(auto x) {
    const auto s = side(x);
    const auto o = fc2(ops::relu(fc1(x)));
    return o + s;
  }
};

// A recurrent cell's layers, called at each of three steps on one shape: graph mode runs the
// steps' products in another order than PyNative (the last step's slice is captured first).
struct Unrolled : nn::Cell<Unrolled> {
  nn::Dense<1, 4> ih;
  nn::Dense<4, 4> hh;
  DUET_CELL_MEMBERS(ih, hh);
  auto step(const auto& xt, const auto& h) { return ops::tanh(ih(xt) + hh(h)); }
  auto construct(auto x) {
    const auto h1 = ops::tanh(ih(ops::slice(x, ops::ints<0, 0>, ops::ints<-1, 1>)));
    const auto h2 = step(ops::slice(x, ops::ints<0, 1>, ops::ints<-1, 1>), h1);
    return step(ops::slice(x, ops::ints<0, 2>, ops::ints<-1, 1>), h2);
  }
};

// Two steps of a GRU-like update, h' = (1 - z) * n + z * h: PyNative runs z * h before
// (1 - z) * n (the operands of + in the compiler's order), so the steps of graph mode's fused
// Add(c, Mul(a, b)) are not adjacent in its trace.
struct GatedSteps : nn::Cell<GatedSteps> {
  nn::Dense<1, 8> wx;
  nn::Dense<4, 8> wh;
  DUET_CELL_MEMBERS(wx, wh);
  auto step(const auto& xt, const auto& h) {
    const auto [xz, xn] = ops::split<1, 4, 4>(wx(xt));
    const auto [hz, hn] = ops::split<1, 4, 4>(wh(h));
    const auto z = ops::sigmoid(xz + hz);
    const auto n = ops::tanh(xn + z * hn);
    return (1.0f - z) * n + z * h;
  }
  auto construct(auto x) {
    const auto [x0, x1, x2] = ops::split<1, 1, 1, 1>(x);
    const auto [h1, unused] = ops::split<1, 4, 4>(ops::tanh(wx(x0)));
    static_cast<void>(unused);
    return step(x2, step(x1, h1));
  }
};

// A temporal-difference loss of three inputs: states, rewards, next states, with the target
// held by stop_gradient (a DQN's, its target network folded into the online one).
struct TemporalDifference : nn::Cell<TemporalDifference> {
  nn::Dense<4, 2> q;
  DUET_CELL_MEMBERS(q);
  auto construct(auto s, auto r, auto s_next) {
    const auto target = r + ops::stop_gradient(ops::max(q(s_next), ops::axes<1>, ops::keep_dims)) * 0.9f;
    return ops::mean(ops::square(ops::max(q(s), ops::axes<1>, ops::keep_dims) - target));
  }
};

}  // namespace

// Checked while this file compiles: the seed network captures for its input, a network built at
// run time never does (graph mode traces it), nor does a loss cell over one.
static_assert(runs_in_both_modes<SeedNetwork<>, SeedPattern>);
static_assert(runs_in_both_modes<SeedNetwork<GRAPH_MODE>>);
static_assert(runs_in_both_modes<Shifted, StaticShape<dyn, 4>>);
static_assert(!runs_in_both_modes<nn::DynamicSequentialCell>);
static_assert(!runs_in_both_modes<nn::WithLossCell<nn::DynamicSequentialCell, nn::MSELoss<>>>);

TEST_CASE("compare_modes: the seed network agrees with itself, forward and gradients, bit for bit") {
  SeedNetwork<> net;
  const Tensor x = randn({4, 1, 28, 28}, 7);
  const ModeReport forward = compare_modes(net, x);
  CHECK(forward.empty());
  CHECK(forward.agree());
  CHECK(forward.notes.empty());
  // Flatten, then the three fused products (graph_ir's optimized dump): each paired with PyNative.
  CHECK(forward.values_compared == 4);
  CHECK(forward.to_string() == "the modes agree (4 values compared)");

  // With its loss: the forward pass and the loss's nodes, then the gradients of its six
  // parameters.
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  nn::WithLossCell with_loss(net, loss);
  const BasicTensor<std::int32_t> labels({4}, {1, 0, 9, 3});
  const ModeReport training = compare_modes(with_loss, x, labels);
  CHECK(training.empty());
  CHECK(training.notes.empty());
  // The four values above, the loss, the six gradients.
  CHECK(training.values_compared == 4 + 1 + 6);
}

TEST_CASE("compare_modes: a user's operation whose fused form differs is named, with its worst element") {
  Shifted net;
  const Tensor x = randn({5, 4}, 3);
  const ModeReport report = compare_modes(net, x);
  REQUIRE_FALSE(report.empty());
  CHECK_FALSE(report.agree());
  const ModeDifference& d = *report.difference;
  CHECK(d.stage == "forward");
  CHECK(d.operation == "Shift + ReLU");
  CHECK(d.shape == Shape{5, 6});
  // Shift names no layer, so the cell whose construct calls it is named.
  CHECK(d.cell == net.label());
  // The node as graph_ir's optimized dump numbers it.
  const std::string ir = graph_ir(net, shape<dyn, 4>).optimized.text;
  CHECK(ir.find("%" + std::to_string(d.node) + " = Shift + ReLU(") != std::string::npos);

  // Both values at the worst element, computed here from the hidden layer's output: PyNative's
  // is ReLU(h + 0.25), graph mode's the fused kernel's, and no element differs more.
  const Tensor h = net.hidden(x);
  double worst = 0;
  for (index_t i = 0; i < h.numel(); ++i) {
    const float p = std::max(h.data()[i] + 0.25f, 0.f);
    const float g = std::max(h.data()[i] + 0.25f + 1e-3f, 0.f);
    worst = std::max(worst, std::fabs(double(g) - double(p)));
  }
  REQUIRE(d.index.size() == 2);
  CHECK(d.element == d.index[0] * 6 + d.index[1]);
  const float hv = h(d.index[0], d.index[1]);
  CHECK(d.pynative == double(std::max(hv + 0.25f, 0.f)));
  CHECK(d.graph == double(std::max(hv + 0.25f + 1e-3f, 0.f)));
  CHECK(std::fabs(d.graph - d.pynative) == worst);
  CHECK(d.max_abs_error == worst);
  CHECK(worst == doctest::Approx(1e-3).epsilon(1e-3));
  const std::string text = report.to_string();
  CHECK(text.find("the modes differ first at node %" + std::to_string(d.node) + " Shift + ReLU of " + net.label() +
                  " : [5, 6]") == 0);
  CHECK(text.find("worst element " + std::to_string(d.element) + " [" + std::to_string(d.index[0]) + ", " +
                  std::to_string(d.index[1]) + "]") != std::string::npos);

  // Within a tolerance that covers the difference (and the head's, which reads the shifted
  // values), the modes agree.
  CHECK(compare_modes(net, x, {.atol = 1e-2}).empty());
}

TEST_CASE("compare_modes: a loss cell whose gradient differs between the modes names the parameter") {
  duet_test::ModeGuard guard;
  OffsetNet net;
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  const Tensor x = randn({5, 4}, 3);
  const Tensor target = zeros({5, 3});
  // The fused forward kernel is right: the forward passes agree, the loss's included.
  CHECK(compare_modes(net, x).empty());
  const ModeReport report = compare_modes(with_loss, x, target);
  REQUIRE_FALSE(report.empty());
  const ModeDifference& d = *report.difference;
  CHECK(d.stage == "gradient");
  // The first parameter, in parameters() order, whose gradient flows through Offset + ReLU.
  CHECK(d.operation == "hidden.weight");
  CHECK(d.shape == Shape{6, 4});
  CHECK(report.to_string().find("the modes differ first in the gradient of parameter 'hidden.weight' : [6, 4]") == 0);

  // Both values at the worst element, as value_and_grad gives them in each mode.
  std::vector<Tensor> grads;
  for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    grads.push_back(value_and_grad(with_loss, with_loss.parameters())(x, target).grads[0]);
  }
  double worst = 0;
  for (index_t i = 0; i < grads[0].numel(); ++i) {
    worst = std::max(worst, std::fabs(double(grads[1].data()[i]) - double(grads[0].data()[i])));
  }
  CHECK(d.pynative == double(grads[0].data()[d.element]));
  CHECK(d.graph == double(grads[1].data()[d.element]));
  CHECK(d.max_abs_error == worst);
  CHECK(d.graph == doctest::Approx(d.pynative * 1.001).epsilon(1e-5));
}

// A loss cell of one's own (a VAE's reads what the network returns beside its output, so it
// cannot be a WithLossCell): one number out, so its gradients are compared as WithLossCell's.
template <class Net>
struct OwnLoss : nn::Cell<OwnLoss<Net>> {
  Net net;
  DUET_CELL_MEMBERS(net);
  auto construct(auto x, auto target) { return ops::mean(ops::square(net(x) - target)); }
};

struct Plain : nn::Cell<Plain> {
  nn::Dense<4, 6> hidden;
  nn::Dense<6, 3> head;
  DUET_CELL_MEMBERS(hidden, head);
  auto construct(auto x) { return head(ops::relu(hidden(x))); }
};

struct FixedOwnLoss : nn::Cell<FixedOwnLoss, GRAPH_MODE> {
  nn::Dense<4, 3> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x, auto target) { return ops::mean(ops::square(fc(x) - target)); }
};

TEST_CASE("compare_modes compares the gradients of any cell whose output is one number") {
  duet_test::ModeGuard guard;
  const Tensor x = randn({5, 4}, 3);
  const Tensor target = zeros({5, 3});
  OwnLoss<OffsetNet> offset;
  const ModeReport report = compare_modes(offset, x, target);
  REQUIRE_FALSE(report.empty());
  CHECK(report.difference->stage == "gradient");
  CHECK(report.difference->operation == "net.hidden.weight");

  // The same forward and loss as a WithLossCell: as many values compared, all agreeing.
  OwnLoss<Plain> own;
  nn::MSELoss<> mse;
  nn::WithLossCell with_loss(own.net, mse);
  const ModeReport by_own = compare_modes(own, x, target);
  const ModeReport by_with_loss = compare_modes(with_loss, x, target);
  CHECK(by_own.agree());
  CHECK(by_with_loss.agree());
  // Its own loss is two nodes where MSELoss is one; the six gradients are in both.
  CHECK(by_own.values_compared == by_with_loss.values_compared + 1);

  // A cell fixed to one mode cannot be differentiated in the other: said, not skipped quietly.
  FixedOwnLoss fixed;
  const ModeReport by_fixed = compare_modes(fixed, x, target);
  REQUIRE(by_fixed.notes.size() == 1);
  CHECK(by_fixed.notes[0].find("the gradients are not compared") == 0);
}

TEST_CASE("compare_modes takes the three inputs of a TD loss, options in braces after them") {
  TemporalDifference td;
  const Tensor s = randn({6, 4}, 11), r = randn({6, 1}, 12), s_next = randn({6, 4}, 13);
  const ModeReport report = compare_modes(td, s, r, s_next);
  CHECK(report.agree());
  CHECK(report.notes.empty());
  CHECK(report.values_compared >= 6);  // forward nodes, then q's two gradients
  CHECK(compare_modes(td, s, r, s_next, {.rtol = 1e-6}).agree());
}

TEST_CASE("compare_modes: an ambiguous capture runs traced in graph mode, and only its output is compared") {
  TwoProducts net;
  const ModeReport report = compare_modes(net, randn({3, 4}, 5));
  CHECK(report.empty());
  CHECK(report.values_compared == 1);
  REQUIRE(report.notes.size() == 1);
  CHECK(report.notes[0].find("the capture is ambiguous (") == 0);
  CHECK(report.notes[0].find("only the output is compared") != std::string::npos);
}

TEST_CASE("compare_modes leaves the network and the context as they were") {
  duet_test::ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<> net;
  const Tensor x = randn({2, 1, 28, 28}, 11);
  const Tensor before = net(x);
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  CHECK(compare_modes(with_loss, x, zeros({2, 10})).empty());
  CHECK(get_context().mode == PYNATIVE_MODE);
  const Tensor after = net(x);
  CHECK(std::equal(before.data(), before.data() + before.numel(), after.data()));
}

TEST_CASE("compare_modes compares the program graph mode keeps, with the constants its capture read") {
  duet_test::ModeGuard guard;
  Scaled net;
  const Tensor x = randn({2, 4}, 8);
  CHECK(compare_modes(net, x).agree());  // its first graph-mode program, scale 2 in both
  set_context({.mode = GRAPH_MODE});
  const Tensor before = net(x);
  net.scale = 1.0f;  // PyNative reads 1 now; graph mode's program keeps 2
  CHECK(std::equal(before.data(), before.data() + before.numel(), net(x).data()));
  const ModeReport report = compare_modes(net, x);
  REQUIRE_FALSE(report.agree());
  const ModeDifference& d = *report.difference;
  CHECK(d.stage == "forward");
  CHECK(d.graph == doctest::Approx(2.0 * d.pynative));
}

TEST_CASE("compare_modes pairs every piece of a split, though graph mode runs them in another order") {
  SplitAttention net;
  const ModeReport report = compare_modes(net, randn({2, 3, 4}, 3));
  CHECK(report.notes.empty());
  CHECK(report.agree());
  CHECK(report.values_compared >= 9);
}

TEST_CASE("compare_modes pairs a fused elementwise chain with its steps, not a later node with them") {
  ResidualScale net;
  const std::string ir = graph_ir(net, shape<dyn, 4>).optimized.text;
  REQUIRE(ir.find("Elementwise Add(Mul(Add(a, b), c), d)") != std::string::npos);
  const ModeReport report = compare_modes(net, randn({3, 4}, 5));
  CHECK(report.notes.empty());  // the fused node paired with its three steps
  CHECK(report.agree());
  CHECK(report.values_compared == 4);  // the product, the fused chain, tanh, the last Add
}

TEST_CASE("compare_modes pairs a layer's node with that layer's steps, whichever branch construct runs first") {
  SideFirst net;
  const std::string ir = graph_ir(net, shape<dyn, 4>).optimized.text;
  REQUIRE(ir.find("'fc2'") < ir.find("'side'"));  // graph mode runs fc2 first
  for (const bool train : {false, true}) {
    net.set_train(train);
    const ModeReport report = compare_modes(net, randn({5, 4}, 3));
    CHECK(report.notes.empty());
    CHECK(report.agree());
    CHECK(report.values_compared == 4);  // fc1 with its ReLU, fc2, side, the Add
  }
  nn::MSELoss<> mse;
  nn::WithLossCell with_loss(net, mse);
  CHECK(compare_modes(with_loss, randn({5, 4}, 3), randn({5, 3}, 4)).agree());
}

TEST_CASE("compare_modes pairs each call of a recurrent cell's layer with its own step") {
  Unrolled net;
  const std::string ir = graph_ir(net, shape<dyn, 3>).optimized.text;
  REQUIRE(ir.find("Slice<[0, 2]") < ir.find("Slice<[0, 0]"));  // graph mode runs the last step's slice first
  const ModeReport report = compare_modes(net, randn({5, 3}, 6));
  CHECK(report.notes.empty());
  CHECK(report.agree());
  nn::MSELoss<> mse;
  nn::WithLossCell with_loss(net, mse);
  CHECK(compare_modes(with_loss, randn({5, 3}, 6), randn({5, 4}, 7)).agree());
}

TEST_CASE("the tests are compiled without a * b + c fused on the compiler's own (duet's CMake target)") {
  // With the fusion on (g++ -std=gnu++20 -march=native without -ffp-contract=off), the modes
  // differed in the last bit of nll_loss's gradients, and compare_modes says so in a note.
  CHECK_FALSE(detail::fuses_multiply_add());
  Shifted net;
  const ModeReport report = compare_modes(net, randn({2, 4}, 8));
  CHECK(std::none_of(report.notes.begin(), report.notes.end(),
                     [](const std::string& note) { return note.find("-ffp-contract") != std::string::npos; }));
}

TEST_CASE("compare_modes pairs a fused node whose parts PyNative ran apart") {
  GatedSteps net;
  CHECK(graph_ir(net, shape<dyn, 3>).captured.text.find("ambiguous") == std::string::npos);
  const ModeReport report = compare_modes(net, randn({4, 3}, 9));
  CHECK(report.notes.empty());
  CHECK(report.agree());
  CHECK(report.values_compared >= 20);
}

TEST_CASE("compare_modes refuses a network with a hook, also after graph mode has captured it") {
  duet_test::ModeGuard guard;
  SideFirst net;
  const Tensor x = randn({5, 4}, 3);
  CHECK(compare_modes(net, x).agree());  // graph mode's program is captured and kept
  auto handle = net.fc2.register_forward_hook([](const nn::DynamicCell&, const Tensor&, const Tensor&) {});
  CHECK_THROWS_WITH_AS(compare_modes(net, x),
                       doctest::Contains("runs in graph mode for the comparison, but nn::Dense<6, 3> 'fc2' in it has a hook"),
                       ModeError);
  handle.remove();
  CHECK(compare_modes(net, x).agree());
}

TEST_CASE("a fused node's parts: products with epilogues, elementwise trees, any user's name") {
  using duet::detail::fused_parts;
  CHECK(fused_parts("PackedMatMul + BiasAdd + ReLU") == std::vector<std::string>{"PackedMatMul", "BiasAdd", "ReLU"});
  CHECK(fused_parts("Elementwise Add(Mul(Add(a, b), c), d) + ReLU") ==
        std::vector<std::string>{"Add", "Mul", "Add", "ReLU"});
  CHECK(fused_parts("Elementwise b), c)").empty());
}

TEST_CASE("compare_modes names a folded BatchNorm's node where the folding moves the values") {
  ConvNorm net;
  for (index_t c = 0; c < 8; ++c) {
    net.bn.gamma.data()[c] = 1.7f + 0.1f * static_cast<float>(c);
    net.bn.moving_mean.data()[c] = 0.1f * static_cast<float>(c);
    net.bn.moving_variance.data()[c] = 0.3f + 0.05f * static_cast<float>(c);
  }
  net.set_train(false);
  const Tensor x = randn({2, 1, 12, 12}, 4);
  const ModeReport exact = compare_modes(net, x);
  CHECK(exact.notes.empty());  // every node paired, the folded one too
  REQUIRE_FALSE(exact.agree());
  CHECK(exact.difference->operation == "Conv2d + BatchNorm(folded) + ReLU");
  CHECK(exact.difference->max_abs_error < 1e-5);  // last bits of values near 1
  CHECK(compare_modes(net, x, CompareOptions{.rtol = 1e-5, .atol = 1e-6}).agree());

  // Its loss cell: the forward's difference is the report's, and a note says the gradients,
  // taken without folding, agree.
  nn::MSELoss<> mse;
  nn::WithLossCell with_loss(net, mse);
  const Tensor output = net(x);
  const ModeReport loss_report = compare_modes(with_loss, x, randn(output.shape(), 5));
  REQUIRE_FALSE(loss_report.agree());
  CHECK(loss_report.difference->operation == "Conv2d + BatchNorm(folded) + ReLU");
  REQUIRE(loss_report.notes.size() == 1);
  CHECK(loss_report.notes[0].find("the gradients agree all the same (") == 0);
}

}  // namespace tests_compare
