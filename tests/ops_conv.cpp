// Convolutions (include/duet/ops/conv.hpp): Conv2d and Conv1d in the gradient harness, each
// value against plain loops in double that write out MindSpore's definition (padding modes,
// stride, dilation, groups, bias); their parameter gradients against finite differences in
// both modes; shapes, names and errors; and a small convolutional network training with the
// same losses in both modes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "ops_harness.hpp"

namespace tests_ops_conv {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using duet::nn::PadMode;

// MindSpore's output size and padding before, for one axis.
struct Axis {
  index_t out;
  index_t before;
};

Axis reference_axis(index_t in, index_t k, index_t s, index_t d, PadMode mode, index_t p) {
  const index_t extent = d * (k - 1) + 1;
  if (mode == PadMode::same) {
    const index_t out = (in + s - 1) / s;
    const index_t total = std::max<index_t>(0, (out - 1) * s + extent - in);
    return {out, total / 2};
  }
  const index_t pad = mode == PadMode::pad ? p : 0;
  return {(in + 2 * pad - extent) / s + 1, pad};
}

struct Settings {
  index_t kernel;
  index_t stride = 1;
  PadMode mode = PadMode::pad;
  index_t padding = 0;
  index_t dilation = 1;
  index_t groups = 1;
};

// y[n, o, oh, ow] = b[o] + Σ_c Σ_i Σ_j w[o, c, i, j] · x[n, g·C/G + c, oh·s + i·d - top, ow·s + j·d - left],
// zero outside x; a 1-D input is read as height 1 with a kernel of height 1.
D reference_conv(const D& x, const D& w, const D* b, const Settings& s) {
  const bool two_d = x.shape().rank() == 4;
  const index_t n_batch = x.shape()[0], cin = x.shape()[1];
  const index_t h = two_d ? x.shape()[2] : 1, wd = x.shape()[-1];
  const index_t cout = w.shape()[0], cg = w.shape()[1];
  const index_t kh = two_d ? s.kernel : 1, kw = s.kernel;
  const Axis ah = two_d ? reference_axis(h, s.kernel, s.stride, s.dilation, s.mode, s.padding) : Axis{1, 0};
  const Axis aw = reference_axis(wd, s.kernel, s.stride, s.dilation, s.mode, s.padding);
  const index_t sh = two_d ? s.stride : 1, dh = two_d ? s.dilation : 1;
  Shape out_shape = two_d ? Shape{n_batch, cout, ah.out, aw.out} : Shape{n_batch, cout, aw.out};
  D y = duet::zeros<double>(out_shape);
  const index_t og = cout / s.groups;
  for (index_t n = 0; n < n_batch; ++n)
    for (index_t o = 0; o < cout; ++o)
      for (index_t oh = 0; oh < ah.out; ++oh)
        for (index_t ow = 0; ow < aw.out; ++ow) {
          double sum = b != nullptr ? b->data()[o] : 0.0;
          const index_t g = o / og;
          for (index_t c = 0; c < cg; ++c)
            for (index_t i = 0; i < kh; ++i)
              for (index_t j = 0; j < kw; ++j) {
                const index_t hi = oh * sh + i * dh - ah.before;
                const index_t wi = ow * s.stride + j * s.dilation - aw.before;
                if (hi < 0 || hi >= h || wi < 0 || wi >= wd) continue;
                const double xv = x.data()[((n * cin + g * cg + c) * h + hi) * wd + wi];
                sum += w.data()[((o * cg + c) * kh + i) * kw + j] * xv;
              }
          y.data()[((n * cout + o) * ah.out + oh) * aw.out + ow] = sum;
        }
  (void)cin;
  return y;
}

using Conv2dD = duet::nn::Conv2d<duet::dyn, duet::dyn, duet::dyn, 1, 0, 1, 1, double>;
using Conv1dD = duet::nn::Conv1d<duet::dyn, duet::dyn, duet::dyn, 1, 0, 1, 1, double>;

template <class Layer>
std::shared_ptr<Layer> make_layer(index_t in, index_t out, const Settings& s, bool bias) {
  return std::make_shared<Layer>(in, out, s.kernel,
                                 typename Layer::Options{.stride = s.stride, .pad_mode = s.mode, .padding = s.padding,
                                                         .dilation = s.dilation, .group = s.groups, .has_bias = bias});
}

template <class Layer>
Case conv_case(std::shared_ptr<Layer> conv, const Shape& x, const Settings& s) {
  Case c = case_of<1>({x}, [conv](const auto& v) { return (*conv)(v); }, -2.0, 2.0);
  c.reference = [conv, s](const std::vector<D>& xs) {
    return reference_conv(xs[0], conv->weight, conv->has_bias() ? &conv->bias : nullptr, s);
  };
  return c;
}

const bool conv_cases = add_cases([](std::multimap<std::string, Case>& m) {
  duet::set_seed(11);
  struct Row {
    index_t in, out;
    Settings s;
    bool bias;
    Shape x2, x1;  // the input of the 2-D and of the 1-D case
  };
  const Row rows[] = {
      {2, 3, {.kernel = 3}, true, {2, 2, 5, 6}, {2, 2, 7}},                                          // valid, as "pad" 0
      {2, 2, {.kernel = 3, .stride = 2, .padding = 1}, false, {1, 2, 6, 5}, {2, 2, 8}},             // stride, padding
      {2, 3, {.kernel = 2, .stride = 2, .mode = PadMode::same}, true, {1, 2, 5, 4}, {1, 2, 7}},     // odd "same" padding
      {1, 2, {.kernel = 3, .mode = PadMode::same}, false, {1, 1, 4, 5}, {2, 1, 6}},                 // "same", stride 1
      {2, 2, {.kernel = 4, .mode = PadMode::same}, true, {1, 2, 5, 6}, {1, 2, 7}},                  // uneven "same", stride 1
      {2, 3, {.kernel = 2, .padding = 2}, false, {1, 2, 3, 4}, {2, 2, 4}},                          // padding past the kernel
      {2, 2, {.kernel = 2, .mode = PadMode::valid, .dilation = 2}, true, {1, 2, 5, 5}, {1, 2, 7}},  // dilation
      {4, 2, {.kernel = 3, .padding = 1, .groups = 2}, true, {1, 4, 4, 3}, {1, 4, 5}},              // groups
      {3, 3, {.kernel = 3, .stride = 2, .padding = 1, .groups = 3}, false, {2, 3, 5, 5}, {2, 3, 6}},  // depthwise
  };
  for (const Row& r : rows) {
    m.emplace("Conv2d", conv_case(make_layer<Conv2dD>(r.in, r.out, r.s, r.bias), r.x2, r.s));
    m.emplace("Conv1d", conv_case(make_layer<Conv1dD>(r.in, r.out, r.s, r.bias), r.x1, r.s));
  }
  // The compile-time sized form, in both spatial ranks.
  auto fixed2 = std::make_shared<duet::nn::Conv2d<2, 4, 3, 2, 1, 1, 2, double>>(duet::nn::ConvInit<double>{.has_bias = true});
  m.emplace("Conv2d", conv_case(fixed2, {2, 2, 5, 4}, {.kernel = 3, .stride = 2, .padding = 1, .groups = 2}));
  auto fixed1 = std::make_shared<duet::nn::Conv1d<2, 3, 3, 1, PadMode::same, 2, 1, double>>();
  m.emplace("Conv1d", conv_case(fixed1, {2, 2, 6}, {.kernel = 3, .mode = PadMode::same, .dilation = 2}));
});

// value_and_grad of sum(w · conv(x)) with respect to the layer's parameters, in each mode.
template <class Layer>
std::vector<std::vector<D>> parameter_grads(Layer& conv, const D& x, const D& w) {
  duet_test::ModeGuard guard;
  std::vector<std::vector<D>> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto f = [&conv](const auto& v, const auto& cotangent) { return duet::ops::sum(conv(v) * cotangent); };
    auto vg = duet::value_and_grad(f, conv.parameters());
    grads.push_back(vg(x, w).grads);
  }
  return grads;
}

template <class Layer>
void check_parameter_gradients(Layer& conv, const Shape& x_shape) {
  const D x = random_input(x_shape, -1, 1, 40);
  const D y = conv(x);
  const D w = random_input(y.shape(), -1, 1, 41);
  const auto grads = parameter_grads(conv, x, w);
  CHECK(same_bits(grads[0], grads[1]));
  auto loss = [&] {
    const D v = conv(x);
    return dot(v, w);
  };
  const auto params = conv.parameters();
  REQUIRE(params.size() == grads[0].size());
  for (std::size_t p = 0; p < params.size(); ++p) {
    auto& value = *params[p].parameter;
    for (index_t j = 0; j < value.numel(); ++j) {
      const double fd = finite_difference(value, j, loss);
      INFO(conv.type_name(), " ", params[p].name, "[", j, "]");
      CHECK(std::abs(grads[0][p].data()[j] - fd) <= 1e-7 + 1e-6 * std::abs(fd));
    }
  }
}

}  // namespace

TEST_CASE("nn::Conv2d, nn::Conv1d: weight and bias gradients match finite differences, the same in both modes") {
  duet::set_seed(5);
  Conv2dD plain(3, 4, 3, {.stride = 2, .pad_mode = PadMode::same, .has_bias = true});
  check_parameter_gradients(plain, {2, 3, 5, 6});
  Conv2dD grouped(4, 4, 2, {.pad_mode = PadMode::pad, .padding = 1, .dilation = 2, .group = 2, .has_bias = true});
  check_parameter_gradients(grouped, {2, 4, 4, 4});
  duet::nn::Conv2d<3, 3, 3, 1, 1, 1, 3, double> depthwise;
  CHECK(depthwise.parameters().size() == 1);  // no bias by default: weight alone
  check_parameter_gradients(depthwise, {2, 3, 4, 5});
  Conv1dD one_d(2, 3, 3, {.stride = 2, .pad_mode = PadMode::valid, .has_bias = true});
  check_parameter_gradients(one_d, {3, 2, 9});
  // Few input channels at stride 1: the direct convolution (kernels::direct_convolution).
  Conv2dD first_layer(1, 5, 5, {.pad_mode = PadMode::pad, .padding = 2, .has_bias = true});
  check_parameter_gradients(first_layer, {3, 1, 6, 7});
  Conv1dD first_1d(2, 3, 4, {.pad_mode = PadMode::same});
  check_parameter_gradients(first_1d, {2, 2, 11});
}

TEST_CASE("nn::Conv2d: static shapes through stride, padding, dilation and pad_mode, in the output's type") {
  duet::set_seed(1);
  duet::nn::Conv2d<1, 6, 5, 1, 2> padded;       // LeNet-5's first layer: 28x28 stays 28x28
  duet::nn::Conv2d<6, 16, 5> valid;             // 14x14 -> 10x10
  duet::nn::Conv2d<3, 4, 3, 2, PadMode::same> same;   // ceil(7 / 2) = 4
  duet::nn::Conv2d<3, 4, 3, 1, 0, 2> dilated;   // extent 5: 7 -> 3
  duet::nn::Conv1d<2, 5, 3, 2, 1> one_d;        // (9 + 2 - 3) / 2 + 1 = 5
  auto a = padded(duet::ones(duet::shape<2, 1, 28, 28>));
  static_assert(std::is_same_v<decltype(a), duet::StaticTensor<float, 2, 6, 28, 28>>);
  auto b = valid(duet::ones(duet::shape<2, 6, 14, 14>));
  static_assert(std::is_same_v<decltype(b), duet::StaticTensor<float, 2, 16, 10, 10>>);
  auto c = same(duet::ones(duet::shape<1, 3, 7, 8>));
  static_assert(std::is_same_v<decltype(c), duet::StaticTensor<float, 1, 4, 4, 4>>);
  auto d = dilated(duet::ones(duet::shape<1, 3, 7, 7>));
  static_assert(std::is_same_v<decltype(d), duet::StaticTensor<float, 1, 4, 3, 3>>);
  auto e = one_d(duet::ones(duet::shape<4, 2, 9>));
  static_assert(std::is_same_v<decltype(e), duet::StaticTensor<float, 4, 5, 5>>);
  // The run-time form gives the same shapes from the same settings.
  duet::nn::Conv2d<> sized(3, 4, 3, {.stride = 2});
  CHECK(sized(duet::ones({1, 3, 7, 8})).shape() == Shape{1, 4, 4, 4});  // pad_mode "same" by default
}

TEST_CASE("nn::Conv2d, nn::Conv1d: MindSpore's parameters, names, defaults and checkpoints") {
  duet::set_seed(2);
  duet::nn::Conv2d<3, 8, 3> no_bias;
  const auto only = no_bias.parameters();
  REQUIRE(only.size() == 1);
  CHECK(only[0].name == "weight");
  CHECK(no_bias.weight.shape() == Shape{8, 3, 3, 3});
  duet::nn::Conv2d<4, 8, 3, 1, 1, 1, 2> grouped({.has_bias = true});
  const auto both = grouped.parameters();
  REQUIRE(both.size() == 2);
  CHECK(both[0].name == "weight");
  CHECK(both[1].name == "bias");
  CHECK(grouped.weight.shape() == Shape{8, 2, 3, 3});
  CHECK(grouped.bias.shape() == Shape{8});
  duet::nn::Conv1d<> one_d(4, 6, 5, {.group = 2, .has_bias = true});
  CHECK(one_d.weight.shape() == Shape{6, 2, 5});
  // MindSpore 2.x's default initialisers: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = 2 · 3 · 3.
  const float bound = 1.0f / std::sqrt(18.0f);
  for (const auto* p : {&grouped.weight, &grouped.bias}) {
    CHECK(std::all_of(p->data(), p->data() + p->numel(), [&](float v) { return std::abs(v) <= bound; }));
  }
  CHECK(no_bias.type_name() == "nn::Conv2d<3, 8, 3>");
  CHECK(grouped.type_name() == "nn::Conv2d<4, 8, 3, 1, 1, 1, 2>");
  CHECK(duet::nn::Conv2d<1, 6, 5, 1, PadMode::same>().type_name() == "nn::Conv2d<1, 6, 5, 1, nn::PadMode::same>");
  CHECK(one_d.type_name() == "nn::Conv1d<dyn, dyn, dyn>");
  // Saved and loaded under those names.
  duet_test::TempDir dir;
  duet::save_checkpoint(grouped, dir.path / "conv.ckpt");
  const auto info = duet::checkpoint_info(dir.path / "conv.ckpt");
  REQUIRE(info.parameters.size() == 2);
  CHECK(info.parameters[0].name == "weight");
  CHECK(info.parameters[1].name == "bias");
  duet::set_seed(3);
  duet::nn::Conv2d<4, 8, 3, 1, 1, 1, 2> other({.has_bias = true});
  duet::load_checkpoint(dir.path / "conv.ckpt", other);
  CHECK(std::equal(other.weight.data(), other.weight.data() + other.weight.numel(), grouped.weight.data()));
  CHECK(std::equal(other.bias.data(), other.bias.data() + 8, grouped.bias.data()));
}

TEST_CASE("nn::Conv2d, nn::Conv1d: shape errors name the layer and the input, bad settings are ValueErrors") {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const duet::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  duet::nn::Conv2d<> conv(3, 4, 5, {.pad_mode = PadMode::valid});
  CHECK(message([&] { conv(duet::ones({2, 2, 8, 8})); }) ==
        "nn::Conv2d<dyn, dyn, dyn> expects an input whose dimension 1 (channels) is 3, got [2, 2, 8, 8]");
  CHECK(message([&] { conv(duet::ones({3, 8, 8})); }) == "nn::Conv2d<dyn, dyn, dyn> expects an input of rank 4, got [3, 8, 8]");
  CHECK(message([&] { conv(duet::ones({1, 3, 4, 8})); }) ==
        "nn::Conv2d<dyn, dyn, dyn> expects an input whose spatial axes (after batch and channels) are each at least "
        "5, to hold its window less the padding, got [1, 3, 4, 8]");
  duet::nn::Conv1d<2, 2, 3, 1, 0, 3> dilated;  // extent 7
  CHECK(message([&] { dilated(duet::ones({1, 2, 6})); }) ==
        "nn::Conv1d<2, 2, 3, 1, 0, 3> expects an input whose spatial axes (after batch and channels) are each at "
        "least 7, to hold its window less the padding, got [1, 2, 6]");
  CHECK_THROWS_AS(duet::nn::Conv2d<>(3, 4, 3, {.group = 2}), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::Conv2d<>(3, 4, 0), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::Conv2d<>(3, 4, 3, {.stride = 0}), duet::ValueError);
  try {
    duet::nn::Conv2d<>(3, 4, 3, {.padding = 1});
    FAIL("no error");
  } catch (const duet::ValueError& e) {
    CHECK(std::string(e.what()) ==
          "nn::Conv2d<dyn, dyn, dyn>: padding must be 0 unless pad_mode is \"pad\", got 1 with pad_mode \"same\"");
  }
  // A compile-time sized layer given sizes or settings at run time takes only its type's: its
  // static shape rule is the type's (the run-time form's default pad_mode "same" is not).
  CHECK(message([] { duet::nn::Conv2d<3, 4, 3> c(3, 5, 3); }) ==
        "nn::Conv2d<3, 4, 3>: cannot be built with in_channels 3, out_channels 5 and kernel_size 3");
  CHECK(message([] { duet::nn::Conv2d<3, 4, 3> c(3, 4, 3); }) ==
        "nn::Conv2d<3, 4, 3>: its type fixes stride 1, pad_mode \"pad\", padding 0, dilation 1 and group 1, got "
        "stride 1, pad_mode \"same\", padding 0, dilation 1 and group 1 (the run-time options' defaults include "
        "pad_mode \"same\"); give only has_bias and the initialisers: nn::Conv2d<3, 4, 3>{{.has_bias = true}}");
  // "valid" is the same geometry as a padding of 0.
  duet::nn::Conv2d<3, 4, 3> valid(3, 4, 3, {.pad_mode = PadMode::valid});
  CHECK(valid.type_name() == "nn::Conv2d<3, 4, 3>");
  duet::nn::Conv2d<3, 4, 3, 2, 1> matching(3, 4, 3, {.stride = 2, .pad_mode = PadMode::pad, .padding = 1, .has_bias = true});
  CHECK(matching.has_bias());
  CHECK(matching.type_name() == "nn::Conv2d<3, 4, 3, 2, 1>");
}

TEST_CASE("nn::Conv2d, nn::BatchNorm2d: the compile-time sized forms are the run-time forms with sizes in their types") {
  // Outside graph capture a sized layer is its run-time form, so a network's layers of every
  // size share that cell's code (the reason: compile time, tools/compile_costs.md).
  static_assert(std::is_base_of_v<duet::nn::Conv2d<>, duet::nn::Conv2d<1, 6, 5, 1, 2>>);
  static_assert(std::is_base_of_v<duet::nn::Conv1d<>, duet::nn::Conv1d<2, 2, 3, 1, 0, 3>>);
  static_assert(std::is_base_of_v<duet::nn::BatchNorm2d<>, duet::nn::BatchNorm2d<6>>);
  static_assert(std::is_base_of_v<duet::nn::Conv2d<3, 4, 3, 1, 0, 1, 1, double>::runtime_type,
                                  duet::nn::Conv2d<3, 4, 3, 1, 0, 1, 1, double>>);
  duet_test::ModeGuard guard;
  duet::set_seed(5);
  duet::nn::Conv2d<2, 3, 3, 1, 1> sized{{.has_bias = true}};
  duet::set_seed(5);
  duet::nn::Conv2d<> runtime(2, 3, 3, {.pad_mode = PadMode::pad, .padding = 1, .has_bias = true});
  // The same draws from the same seed, the same names, and called alone the same numbers in
  // both modes; the sized one keeps its static shape.
  CHECK(sized.weight.shape() == runtime.weight.shape());
  CHECK(std::memcmp(sized.weight.data(), runtime.weight.data(), static_cast<std::size_t>(sized.weight.numel()) * sizeof(float)) == 0);
  CHECK(sized.type_name() == "nn::Conv2d<2, 3, 3, 1, 1>");
  const duet::Tensor x = duet::randn({2, 2, 5, 5}, 3);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const duet::Tensor a = sized(x);
    const duet::Tensor b = runtime(x);
    CHECK(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(float)) == 0);
    const auto s = sized(duet::StaticTensor<float, 2, 2, 5, 5>(x));
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(s)>, duet::StaticTensor<float, 2, 3, 5, 5>>);
    CHECK(std::memcmp(s.tensor().data(), b.data(), static_cast<std::size_t>(b.numel()) * sizeof(float)) == 0);
  }
}

namespace {

template <auto Setting>
struct TinyConvNet : duet::nn::Cell<TinyConvNet<Setting>, Setting> {
  duet::nn::Conv2d<2, 4, 3, 1, 1> conv{{.has_bias = true}};
  duet::nn::Conv2d<4, 4, 3, 2, PadMode::same, 1, 4> depthwise;
  duet::nn::ReLU relu;
  duet::nn::Flatten flatten;
  duet::nn::Dense<4 * 3 * 3, 3> fc;
  DUET_CELL_MEMBERS(conv, depthwise, relu, flatten, fc);
  auto construct(auto x) { return fc(flatten(relu(depthwise(relu(conv(x)))))); }
};

// Losses of a few Adam steps of net on one batch, in the context's mode.
template <class Net>
std::vector<float> train_losses(Net& net, int steps) {
  duet::nn::SoftmaxCrossEntropyWithLogits<true, duet::Reduction::mean> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  duet::nn::Adam adam(net.parameters(), {.learning_rate = 0.01});
  duet::nn::TrainOneStepCell step(with_loss, adam);
  const duet::Tensor x = duet::randn({8, 2, 6, 6}, 22);
  duet::BasicTensor<std::int32_t> y({8});
  for (index_t i = 0; i < 8; ++i) y.data()[i] = static_cast<std::int32_t>(i % 3);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) losses.push_back(step(x, y).item());
  return losses;
}

template <auto Setting>
std::vector<float> tiny_net_losses() {
  duet::set_seed(21);
  TinyConvNet<Setting> net;
  return train_losses(net, 6);
}

// The same layers, sized at run time and put together at run time (graph mode traces it).
std::vector<float> runtime_built_losses(duet::Mode mode) {
  duet_test::ModeGuard guard;
  duet::set_context({.mode = mode});
  duet::set_seed(21);
  duet::nn::DynamicSequentialCell net;
  net.append(duet::nn::Conv2d<>(2, 4, 3, {.pad_mode = PadMode::pad, .padding = 1, .has_bias = true}));
  net.append(duet::nn::ReLU{});
  net.append(duet::nn::Conv2d<>(4, 4, 3, {.stride = 2, .group = 4}));
  net.append(duet::nn::ReLU{});
  net.append(duet::nn::Flatten{});
  net.append(duet::nn::Dense<>(4 * 3 * 3, 3));
  return train_losses(net, 6);
}

bool same_losses(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A convolution whose sample (3 x 5 x 5 = 75 values) is no whole number of vectors, followed
// by functions whose bits depend on where a vector starts.
struct ConvExp : duet::nn::Cell<ConvExp> {
  duet::nn::Conv2d<1, 3, 3> conv{{.has_bias = true}};
  DUET_CELL_MEMBERS(conv);
  auto construct(auto x) { return duet::ops::sin(duet::ops::exp(conv(x))); }
};

}  // namespace

TEST_CASE("a small convolutional network trains with Adam, with the same losses in both modes") {
  const auto pynative = tiny_net_losses<duet::PYNATIVE_MODE>();
  const auto graph = tiny_net_losses<duet::GRAPH_MODE>();
  CHECK(same_losses(pynative, graph));
  CHECK(pynative.back() < pynative.front());
  // Built at run time from run-time sized layers (graph mode traces the training step).
  const auto dynamic_pynative = runtime_built_losses(duet::PYNATIVE_MODE);
  const auto dynamic_graph = runtime_built_losses(duet::GRAPH_MODE);
  CHECK(same_losses(dynamic_pynative, dynamic_graph));
  CHECK(dynamic_pynative.back() < dynamic_pynative.front());
}

TEST_CASE("a convolution's epilogue of exp and sin gives PyNative's bits when a sample is no whole number of vectors") {
  duet_test::ModeGuard guard;
  duet::set_seed(23);
  ConvExp net;
  net.set_train(false);
  const duet::Tensor x = duet::randn({5, 1, 7, 7}, 24);
  duet::set_context({.mode = duet::PYNATIVE_MODE});
  const duet::Tensor eager = net(x);
  duet::set_context({.mode = duet::GRAPH_MODE});
  const duet::Tensor graph = net(x);
  REQUIRE(eager.shape() == graph.shape());
  CHECK(std::memcmp(eager.data(), graph.data(), sizeof(float) * static_cast<std::size_t>(eager.numel())) == 0);
  // The functions are the convolution's epilogue, not passes of their own.
  CHECK(duet::graph_ir(net, duet::shape<duet::dyn, 1, 7, 7>).optimized.text.find(" + Exp") != std::string::npos);
}

}  // namespace tests_ops_conv
