// The convolution's kernels (include/duet/kernels/conv.hpp) against plain loops in double:
// im2col and col2im_add on their own, then a float Conv2d's value and its three gradients
// (input, weight, bias) through both modes under every instruction set, on sizes across the
// product's boundaries (odd sizes, stride 2, padding, dilation, groups, depthwise, batch 1,
// a depth over one K block).
#include "support.hpp"

#include <cstdint>
#include <random>
#include <vector>

namespace tests_kernels_conv {

using namespace duet;

namespace {

// The input element tap (c, a, b) of output pixel (oh, ow) reads, within one group's channels,
// or -1 in the padding: the definition, written out.
index_t tap_source(const kernels::ConvProblem& q, index_t c, index_t a, index_t b, index_t oh, index_t ow) {
  const index_t h = oh * q.stride_h + a * q.dilation_h - q.pad_top;
  const index_t w = ow * q.stride_w + b * q.dilation_w - q.pad_left;
  if (h < 0 || h >= q.height || w < 0 || w >= q.width) return -1;
  return (c * q.height + h) * q.width + w;
}

struct Geometry {
  index_t in, out, groups, height, width, kernel, stride, padding, dilation;
};

// One group's problem for an input of `height` x `width`, MindSpore's "pad" mode.
kernels::ConvProblem problem_of(const Geometry& g, index_t batch) {
  kernels::ConvProblem q;
  q.batch = batch;
  q.in = g.in;
  q.out = g.out;
  q.groups = g.groups;
  q.height = g.height;
  q.width = g.width;
  q.kernel_h = q.kernel_w = g.kernel;
  q.stride_h = q.stride_w = g.stride;
  q.dilation_h = q.dilation_w = g.dilation;
  q.pad_top = q.pad_left = g.padding;
  const index_t extent = g.dilation * (g.kernel - 1) + 1;
  q.out_height = (g.height + 2 * g.padding - extent) / g.stride + 1;
  q.out_width = (g.width + 2 * g.padding - extent) / g.stride + 1;
  return q;
}

const Geometry geometries[] = {
    {1, 6, 1, 28, 28, 5, 1, 2, 1},   // LeNet's first layer
    {6, 16, 1, 14, 14, 5, 1, 0, 1},  // its second
    {3, 5, 1, 7, 9, 3, 2, 1, 1},     // odd sizes, stride 2
    {2, 3, 1, 6, 5, 2, 3, 2, 1},     // stride over the kernel, padding past it
    {3, 2, 1, 5, 6, 2, 1, 3, 1},     // padding past the kernel at stride 1
    {4, 4, 2, 9, 8, 3, 1, 2, 2},     // dilation, groups
    {8, 8, 8, 7, 7, 3, 2, 1, 1},     // depthwise
    {2, 2, 1, 5, 1, 3, 1, 1, 1},     // a width of 1
    {64, 20, 1, 6, 5, 3, 1, 1, 1},   // depth 576: two K blocks of the product
};

TEST_CASE("kernels::im2col and col2im_add: each tap's row, and its adjoint, as the definition says") {
  std::mt19937 gen(3);
  for (const Geometry& g : geometries) {
    const kernels::ConvProblem q = problem_of(g, 1);
    CAPTURE(g.in);
    CAPTURE(g.height);
    CAPTURE(g.width);
    CAPTURE(g.kernel);
    CAPTURE(g.stride);
    const index_t cg = q.in_per_group();
    std::vector<double> x(static_cast<std::size_t>(cg * q.image()));
    for (double& v : x) v = static_cast<double>(gen() % 17) - 8;  // whole numbers: sums are exact
    std::vector<double> col(static_cast<std::size_t>(q.depth() * q.pixels()), 99.0);
    kernels::im2col(q, x.data(), col.data());
    std::vector<double> dcol(col.size());
    for (double& v : dcol) v = static_cast<double>(gen() % 17) - 8;
    std::vector<double> dx(x.size(), 1.0);
    kernels::col2im_add(q, dcol.data(), dx.data());
    std::vector<double> expected_dx(x.size(), 1.0);
    bool same = true;
    index_t row = 0;
    for (index_t c = 0; c < cg; ++c) {
      for (index_t a = 0; a < q.kernel_h; ++a) {
        for (index_t b = 0; b < q.kernel_w; ++b, ++row) {
          for (index_t oh = 0; oh < q.out_height; ++oh) {
            for (index_t ow = 0; ow < q.out_width; ++ow) {
              const index_t i = tap_source(q, c, a, b, oh, ow);
              const auto at = static_cast<std::size_t>(row * q.pixels() + oh * q.out_width + ow);
              same = same && col[at] == (i < 0 ? 0.0 : x[static_cast<std::size_t>(i)]);
              if (i >= 0) expected_dx[static_cast<std::size_t>(i)] += dcol[at];
            }
          }
        }
      }
    }
    CHECK(same);
    CHECK(dx == expected_dx);
  }
}

struct Reference {
  std::vector<double> y, dx, dw, db;
};

// y = conv(x, w) + bias, and the gradients of sum(y · dy), in plain loops over the definition.
Reference reference(const kernels::ConvProblem& q, const std::vector<double>& x, const std::vector<double>& w,
                    const std::vector<double>& bias, const std::vector<double>& dy) {
  Reference r{std::vector<double>(dy.size()), std::vector<double>(x.size()), std::vector<double>(w.size()),
              std::vector<double>(bias.size())};
  const index_t og = q.out_per_group(), cg = q.in_per_group();
  for (index_t n = 0; n < q.batch; ++n) {
    for (index_t o = 0; o < q.out; ++o) {
      const index_t g = o / og;
      const double* xg = x.data() + (n * q.in + g * cg) * q.image();
      double* dxg = r.dx.data() + (n * q.in + g * cg) * q.image();
      for (index_t p = 0; p < q.pixels(); ++p) {
        const auto at = static_cast<std::size_t>((n * q.out + o) * q.pixels() + p);
        double s = bias[static_cast<std::size_t>(o)];
        for (index_t c = 0; c < cg; ++c) {
          for (index_t a = 0; a < q.kernel_h; ++a) {
            for (index_t b = 0; b < q.kernel_w; ++b) {
              const index_t i = tap_source(q, c, a, b, p / q.out_width, p % q.out_width);
              if (i < 0) continue;
              const auto wi = static_cast<std::size_t>(((o * cg + c) * q.kernel_h + a) * q.kernel_w + b);
              s += w[wi] * xg[i];
              r.dw[wi] += dy[at] * xg[i];
              dxg[i] += dy[at] * w[wi];
            }
          }
        }
        r.y[at] = s;
        r.db[static_cast<std::size_t>(o)] += dy[at];
      }
    }
  }
  return r;
}

template <class T>
std::vector<double> as_double(const BasicTensor<T>& t) {
  return std::vector<double>(t.data(), t.data() + t.numel());
}

std::vector<double> random_doubles(std::size_t count, std::mt19937& gen) {
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> v(count);
  for (double& x : v) x = static_cast<float>(u(gen));  // values a float holds exactly
  return v;
}

Tensor float_tensor(const std::vector<double>& v, const Shape& shape) {
  Tensor t = Tensor::uninitialized(shape);
  std::copy(v.begin(), v.end(), t.data());
  return t;
}

}  // namespace

TEST_CASE("a float Conv2d's value and gradients against plain loops, the same bits in both modes, in every set" * duet_test::every_isa) {
  duet_test::ModeGuard guard;
  std::mt19937 gen(5);
  for (const Geometry& g : geometries) {
    for (index_t batch : {1, 3}) {
      CAPTURE(g.in);
      CAPTURE(g.out);
      CAPTURE(g.groups);
      CAPTURE(g.kernel);
      CAPTURE(g.stride);
      CAPTURE(batch);
      const kernels::ConvProblem q = problem_of(g, batch);
      nn::Conv2d<> conv(g.in, g.out, g.kernel,
                        {.stride = g.stride, .pad_mode = nn::PadMode::pad, .padding = g.padding, .dilation = g.dilation,
                         .group = g.groups, .has_bias = true});
      const std::vector<double> x = random_doubles(static_cast<std::size_t>(batch * g.in * q.image()), gen);
      const std::vector<double> w = random_doubles(static_cast<std::size_t>(conv.weight.numel()), gen);
      const std::vector<double> bias = random_doubles(static_cast<std::size_t>(g.out), gen);
      const std::vector<double> dy = random_doubles(static_cast<std::size_t>(batch * g.out * q.pixels()), gen);
      std::copy(w.begin(), w.end(), conv.weight.data());
      std::copy(bias.begin(), bias.end(), conv.bias.data());
      const Reference expected = reference(q, x, w, bias, dy);
      const Tensor xt = float_tensor(x, {batch, g.in, g.height, g.width});
      const Tensor dyt = float_tensor(dy, {batch, g.out, q.out_height, q.out_width});
      duet_test::for_each_isa([&] {
        std::vector<std::vector<double>> runs;
        for (Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
          set_context({.mode = mode});
          const Tensor y = conv(xt);
          CHECK(duet_test::relative_difference(as_double(y), expected.y) <= 1e-5);
          auto f = [&conv](const auto& v, const auto& cotangent) { return ops::sum(conv(v) * cotangent); };
          auto vg = value_and_grad(f, conv.parameters(), 0);
          const auto out = vg(xt, dyt);
          REQUIRE(out.grads.size() == 3);
          CHECK(duet_test::relative_difference(as_double(out.grads[0]), expected.dx) <= 1e-5);
          CHECK(duet_test::relative_difference(as_double(out.grads[1]), expected.dw) <= 1e-5);
          CHECK(duet_test::relative_difference(as_double(out.grads[2]), expected.db) <= 1e-5);
          std::vector<double> all = as_double(y);
          for (const Tensor& t : out.grads) {
            const std::vector<double> v = as_double(t);
            all.insert(all.end(), v.begin(), v.end());
          }
          runs.push_back(std::move(all));
        }
        CHECK(runs[0] == runs[1]);
      });
    }
  }
}

}  // namespace tests_kernels_conv
