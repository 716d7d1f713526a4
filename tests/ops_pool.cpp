// Pooling (include/duet/ops/pool.hpp): its cases in the gradient harness, each value against
// plain loops over each window written from MindSpore's pad_mode rules, and what the harness
// does not cover: the argmax's tie-breaking and NaN, shapes at compile time and run time,
// MindSpore's defaults, and the layers in a network in both modes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops_harness.hpp"

namespace tests_ops_pool {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using duet::nn::PadMode;

// One pooling configuration along both spatial axes, as MindSpore documents it.
struct Spec {
  index_t kernel, stride;
  PadMode mode;
  index_t padding = 0;
  bool count_include_pad = true;

  // Output size and padding before the first element along an axis of `in` elements.
  std::pair<index_t, index_t> axis(index_t in) const {
    if (mode == PadMode::same) {
      const index_t out = static_cast<index_t>(std::ceil(static_cast<double>(in) / static_cast<double>(stride)));
      const index_t total = std::max<index_t>(0, (out - 1) * stride + kernel - in);
      return {out, total / 2};
    }
    const index_t p = mode == PadMode::pad ? padding : 0;
    return {static_cast<index_t>(std::floor(static_cast<double>(in + 2 * p - kernel) / static_cast<double>(stride))) + 1,
            p};
  }
};

// Max or average over each window, by the definition: the window's elements inside the input.
// rows and cols: the window along the height and along the width.
D pool_reference(const D& x, const Spec& rows, const Spec& cols, bool max) {
  const index_t n = x.shape()[0], c = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  const auto [oh, pt] = rows.axis(h);
  const auto [ow, pl] = cols.axis(w);
  D y = duet::zeros<double>(Shape{n, c, oh, ow});
  for (index_t p = 0; p < n * c; ++p) {
    for (index_t i = 0; i < oh; ++i) {
      for (index_t j = 0; j < ow; ++j) {
        double best = -std::numeric_limits<double>::infinity();
        double sum = 0;
        index_t count = 0;
        for (index_t a = i * rows.stride - pt; a < i * rows.stride - pt + rows.kernel; ++a) {
          for (index_t b = j * cols.stride - pl; b < j * cols.stride - pl + cols.kernel; ++b) {
            if (a < 0 || a >= h || b < 0 || b >= w) continue;
            const double v = x.data()[(p * h + a) * w + b];
            best = std::max(best, v);
            sum += v;
            ++count;
          }
        }
        if (rows.mode == PadMode::pad && rows.count_include_pad) count = rows.kernel * cols.kernel;
        y.data()[(p * oh + i) * ow + j] = max ? best : sum / static_cast<double>(count);
      }
    }
  }
  return y;
}
D pool_reference(const D& x, const Spec& s, bool max) { return pool_reference(x, s, s, max); }

// The average of bin [floor(i H / OH), ceil((i + 1) H / OH)) x [the same along W].
D adaptive_reference(const D& x, index_t out_h, index_t out_w) {
  const index_t n = x.shape()[0], c = x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  D y = duet::zeros<double>(Shape{n, c, out_h, out_w});
  for (index_t p = 0; p < n * c; ++p) {
    for (index_t i = 0; i < out_h; ++i) {
      for (index_t j = 0; j < out_w; ++j) {
        const auto h0 = static_cast<index_t>(std::floor(static_cast<double>(i * h) / static_cast<double>(out_h)));
        const auto h1 = static_cast<index_t>(std::ceil(static_cast<double>((i + 1) * h) / static_cast<double>(out_h)));
        const auto w0 = static_cast<index_t>(std::floor(static_cast<double>(j * w) / static_cast<double>(out_w)));
        const auto w1 = static_cast<index_t>(std::ceil(static_cast<double>((j + 1) * w) / static_cast<double>(out_w)));
        double sum = 0;
        for (index_t a = h0; a < h1; ++a) {
          for (index_t b = w0; b < w1; ++b) sum += x.data()[(p * h + a) * w + b];
        }
        y.data()[(p * out_h + i) * out_w + j] = sum / static_cast<double>((h1 - h0) * (w1 - w0));
      }
    }
  }
  return y;
}

template <class F>
void add_pool_case(std::multimap<std::string, Case>& m, const std::string& name, Shape shape, F f,
                   std::function<D(const std::vector<D>&)> reference) {
  Case c = case_of<1>({shape}, f, -2.0, 2.0);
  c.reference = std::move(reference);
  m.emplace(name, std::move(c));
}

const bool pool_cases = add_cases([](std::multimap<std::string, Case>& m) {
  namespace ops = duet::ops;
  namespace nn = duet::nn;
  const Shape odd{2, 3, 5, 7};
  // The functional forms: pad_mode pad, MindSpore's stride defaults.
  add_pool_case(m, "max_pool2d", odd, [](const auto& x) { return ops::max_pool2d<2>(x); },
                [](const std::vector<D>& xs) { return pool_reference(xs[0], {2, 2, PadMode::pad}, true); });
  add_pool_case(m, "max_pool2d", odd, [](const auto& x) { return ops::max_pool2d<3, 2, 1>(x); },
                [](const std::vector<D>& xs) { return pool_reference(xs[0], {3, 2, PadMode::pad, 1}, true); });
  add_pool_case(m, "avg_pool2d", odd, [](const auto& x) { return ops::avg_pool2d<2>(x); },
                [](const std::vector<D>& xs) { return pool_reference(xs[0], {2, 1, PadMode::pad}, false); });
  add_pool_case(m, "avg_pool2d", odd, [](const auto& x) { return ops::avg_pool2d<3, 2, 1>(x); },
                [](const std::vector<D>& xs) { return pool_reference(xs[0], {3, 2, PadMode::pad, 1}, false); });
  // Windows given at run time: square ones with the template forms' defaults, a rectangular
  // one padded along one axis, pad_mode same.
  add_pool_case(
      m, "max_pool2d", odd, [](const auto& x) { return ops::max_pool2d(x, 3, 2, 1); },
      [](const std::vector<D>& xs) {
        return pool_reference(xs[0], {3, 2, PadMode::pad, 1}, true);
      });
  add_pool_case(
      m, "max_pool2d", odd, [](const auto& x) { return ops::max_pool2d(x, 2); },
      [](const std::vector<D>& xs) {
        return pool_reference(xs[0], {2, 2, PadMode::pad}, true);
      });
  add_pool_case(
      m, "avg_pool2d", odd, [](const auto& x) { return ops::avg_pool2d(x, 3, 2, 1, false); },
      [](const std::vector<D>& xs) {
        return pool_reference(xs[0], {3, 2, PadMode::pad, 1, false}, false);
      });
  const ops::Pool2dWindow tall{3, 2, 2, 1, PadMode::pad, 1, 0};
  add_pool_case(
      m, "max_pool2d", odd, [tall](const auto& x) { return ops::max_pool2d(x, tall); },
      [](const std::vector<D>& xs) {
        return pool_reference(xs[0], {3, 2, PadMode::pad, 1}, {2, 1, PadMode::pad, 0}, true);
      });
  add_pool_case(
      m, "avg_pool2d", odd, [tall](const auto& x) { return ops::avg_pool2d(x, tall); },
      [](const std::vector<D>& xs) {
        return pool_reference(xs[0], {3, 2, PadMode::pad, 1}, {2, 1, PadMode::pad, 0}, false);
      });
  const ops::Pool2dWindow same{3, 3, 2, 2, PadMode::same, 0, 0, false};
  add_pool_case(
      m, "avg_pool2d", odd, [same](const auto& x) { return ops::avg_pool2d(x, same); },
      [](const std::vector<D>& xs) {
        return pool_reference(xs[0], {3, 2, PadMode::same}, false);
      });
  // The layers: each pad_mode, overlapping and non-overlapping windows.
  auto layer_case = [&](const std::string& name, auto layer, Spec spec, bool max) {
    auto cell = std::make_shared<decltype(layer)>();
    add_pool_case(m, name, odd, [cell](const auto& x) { return (*cell)(x); },
                  [spec, max](const std::vector<D>& xs) { return pool_reference(xs[0], spec, max); });
  };
  layer_case("max_pool2d", nn::MaxPool2d<3, 2, PadMode::same, 0, double>{}, {3, 2, PadMode::same}, true);
  layer_case("max_pool2d", nn::MaxPool2d<2, 1, PadMode::valid, 0, double>{}, {2, 1, PadMode::valid}, true);
  layer_case("max_pool2d", nn::MaxPool2d<4, 3, PadMode::pad, 2, double>{}, {4, 3, PadMode::pad, 2}, true);
  layer_case("avg_pool2d", nn::AvgPool2d<3, 2, PadMode::same, 0, true, double>{}, {3, 2, PadMode::same}, false);
  layer_case("avg_pool2d", nn::AvgPool2d<2, 2, PadMode::valid, 0, true, double>{}, {2, 2, PadMode::valid}, false);
  layer_case("avg_pool2d", nn::AvgPool2d<3, 1, PadMode::pad, 1, false, double>{}, {3, 1, PadMode::pad, 1, false},
             false);
  // Adaptive: global, dividing bins, overlapping bins (5 rows into 3, 7 columns into 2).
  add_pool_case(m, "adaptive_avg_pool2d", odd, [](const auto& x) { return ops::adaptive_avg_pool2d<1>(x); },
                [](const std::vector<D>& xs) { return adaptive_reference(xs[0], 1, 1); });
  add_pool_case(m, "adaptive_avg_pool2d", odd, [](const auto& x) { return ops::adaptive_avg_pool2d<3, 2>(x); },
                [](const std::vector<D>& xs) { return adaptive_reference(xs[0], 3, 2); });
  auto global = std::make_shared<nn::AdaptiveAvgPool2d<2, 7, double>>();
  add_pool_case(m, "adaptive_avg_pool2d", odd, [global](const auto& x) { return (*global)(x); },
                [](const std::vector<D>& xs) { return adaptive_reference(xs[0], 2, 7); });
});

// The gradient of sum(max_pool2d(x)) in a mode.
template <class F>
D pool_gradient(const D& x, duet::Mode mode, F f) {
  duet_test::ModeGuard guard;
  duet::set_context({.mode = mode});
  auto loss = [f](const auto& v) { return duet::ops::sum(f(v)); };
  return duet::grad(loss)(x);
}

}  // namespace

TEST_CASE("max_pool2d: a tie goes to the window's first maximal element, a NaN wins, the same in both modes") {
  // Plane 0: a constant 3x3 (every window all ties); plane 1: a NaN at (1, 2) among ties.
  D x = duet::zeros<double>(Shape{1, 2, 3, 3});
  for (index_t i = 0; i < 18; ++i) x.data()[i] = 1.0;
  x.data()[9 + 5] = std::nan("");
  auto pool = [](const auto& v) { return duet::ops::max_pool2d<2, 1>(v); };  // four overlapping 2x2 windows
  const D y = pool(x);
  CHECK(y.data()[0] == 1.0);
  CHECK(std::isnan(y.data()[5]));   // window (0, 1) of plane 1 holds the NaN
  CHECK(y.data()[6] == 1.0);        // window (1, 0) does not
  const D eager = pool_gradient(x, duet::PYNATIVE_MODE, pool);
  const D graph = pool_gradient(x, duet::GRAPH_MODE, pool);
  // Window (i, j)'s first element is (i, j): each window sends its 1 there.
  const double expected_plane0[] = {1, 1, 0, 1, 1, 0, 0, 0, 0};
  for (index_t i = 0; i < 9; ++i) {
    CHECK(eager.data()[i] == expected_plane0[i]);
    CHECK(graph.data()[i] == expected_plane0[i]);
  }
  // Plane 1: windows (0, 1) and (1, 1) hold the NaN at (1, 2), which takes both their gradients.
  const double expected_plane1[] = {1, 0, 0, 1, 0, 2, 0, 0, 0};
  for (index_t i = 0; i < 9; ++i) {
    CHECK(eager.data()[9 + i] == expected_plane1[i]);
    CHECK(graph.data()[9 + i] == expected_plane1[i]);
  }
}

TEST_CASE("max_pool2d: windows that tile the input keep the first maximal element and the NaN rule") {
  // 2x2 windows at stride 2 on 5x5 (its own loop, max_pool2d_backward_tiled): plane 0 all
  // ties, plane 1 ties with a NaN at (2, 3); row 4 and column 4 are in no window.
  D x = duet::zeros<double>(Shape{1, 2, 5, 5});
  for (index_t i = 0; i < 50; ++i) x.data()[i] = 1.0;
  x.data()[25 + 2 * 5 + 3] = std::nan("");
  auto pool = [](const auto& v) { return duet::ops::max_pool2d<2>(v); };
  const D eager = pool_gradient(x, duet::PYNATIVE_MODE, pool);
  const D graph = pool_gradient(x, duet::GRAPH_MODE, pool);
  for (index_t i = 0; i < 50; ++i) {
    const index_t plane = i / 25, h = i % 25 / 5, w = i % 5;
    // Each window's first element takes its 1, but window (1, 1)'s NaN at (2, 3) takes it there.
    const bool nan_window = plane == 1 && h / 2 == 1 && w / 2 == 1;
    const bool first = h % 2 == 0 && w % 2 == 0 && h < 4 && w < 4;
    const double expected = nan_window ? (h == 2 && w == 3 ? 1 : 0) : first ? 1 : 0;
    CAPTURE(i);
    CHECK(eager.data()[i] == expected);
    CHECK(graph.data()[i] == expected);
  }
}

namespace {
// kernels::max_pool_2x2 and its gradient against plain loops over the rules ops/pool.hpp
// states, bit for bit: ties, NaNs and -0 among random values, rows and columns no window covers.
template <class T>
void check_max_pool_2x2(index_t planes, index_t H, index_t W) {
  CAPTURE(H);
  CAPTURE(W);
  const index_t OH = H / 2, OW = W / 2;
  std::mt19937 gen(static_cast<unsigned>(H * 100 + W));
  const T values[] = {T(-1), T(-0.0), T(0), T(1), T(2), std::numeric_limits<T>::quiet_NaN()};
  std::vector<T> x(static_cast<std::size_t>(planes * H * W)), dy(static_cast<std::size_t>(planes * OH * OW));
  for (T& v : x) v = values[gen() % (gen() % 9 == 0 ? 6 : 5)];
  for (T& v : dy) v = values[gen() % 5];
  std::vector<T> y_ref(dy.size()), dx_ref(x.size(), T(0));
  for (index_t p = 0; p < planes; ++p) {
    for (index_t oh = 0; oh < OH; ++oh) {
      for (index_t ow = 0; ow < OW; ++ow) {
        T tap[4];
        index_t where[4];
        for (int t = 0; t < 4; ++t) {
          where[t] = (p * H + 2 * oh + t / 2) * W + 2 * ow + t % 2;
          tap[t] = x[static_cast<std::size_t>(where[t])];
        }
        T value = tap[0], best = tap[0];
        int at = 0;
        for (int t = 1; t < 4; ++t) {
          if (tap[t] > value || std::isnan(tap[t])) value = tap[t];  // the forward: the last NaN
          if (tap[t] > best || (std::isnan(tap[t]) && !std::isnan(best))) {  // the gradient: the first
            best = tap[t];
            at = t;
          }
        }
        const auto o = static_cast<std::size_t>((p * OH + oh) * OW + ow);
        y_ref[o] = value;
        dx_ref[static_cast<std::size_t>(where[at])] = T(0) + dy[o];
      }
    }
  }
  duet_test::for_each_isa([&] {
    std::vector<T> y(y_ref.size()), dx(dx_ref.size(), T(7));
    duet::kernels::max_pool_2x2(x.data(), planes, H, W, OH, OW, y.data());
    duet::kernels::max_pool_2x2_backward(dy.data(), x.data(), planes, H, W, OH, OW, dx.data());
    CHECK(std::memcmp(y.data(), y_ref.data(), y.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(dx.data(), dx_ref.data(), dx.size() * sizeof(T)) == 0);
  });
}
}  // namespace

TEST_CASE_TEMPLATE("max_pool2d 2x2 at stride 2: each instruction set's kernels give the rules' bits" * duet_test::every_isa,
                   T, float, double) {
  for (const auto& [h, w] : {std::pair<index_t, index_t>{28, 28}, {5, 37}, {10, 10}, {4, 70}, {2, 3}}) {
    check_max_pool_2x2<T>(3, h, w);
  }
}

namespace {
// max pooling and its gradient over overlapping and padded windows (kernels::max_pool and
// max_pool_backward at column stride 1 or 2, ops/pool.hpp's general loops otherwise) against one
// window at a time in output order, bit for bit: the maximum from the window's first element
// in row-major order, a NaN winning (the last one); the first NaN, or else the first maximal
// element, takes dy; an element several windows choose sums theirs from 0 in output order.
template <class T>
void check_max_pool_gradient(const duet::ops::Pool2dWindow& w, Shape shape) {
  CAPTURE(duet::ops::detail::window_text(w));
  CAPTURE(shape);
  namespace detail = duet::ops::detail;
  const detail::PoolGeometry g = detail::pool_geometry(w, shape);
  std::mt19937 gen(static_cast<unsigned>(g.H * 131 + g.W * 7 + w.kernel_w));
  const T values[] = {
      T(-1), T(-0.0), T(0), T(1), T(2), -std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()};
  std::vector<T> x(static_cast<std::size_t>(g.planes * g.H * g.W)),
      dy(static_cast<std::size_t>(g.planes * g.OH * g.OW));
  for (T& v : x) v = values[gen() % (gen() % 9 == 0 ? 7 : 6)];
  std::uniform_real_distribution<T> uniform(-1, 1);
  for (T& v : dy) v = gen() % 5 == 0 ? T(-0.0) : uniform(gen);
  std::vector<T> y_ref(dy.size()), dx_ref(x.size(), T(0));
  for (index_t p = 0; p < g.planes; ++p) {
    for (index_t oh = 0; oh < g.OH; ++oh) {
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const auto o = static_cast<std::size_t>((p * g.OH + oh) * g.OW + ow);
        std::size_t at = 0;
        bool found = false;
        for (index_t a = oh * w.stride_h - g.pad_top; a < oh * w.stride_h - g.pad_top + w.kernel_h; ++a) {
          for (index_t b = ow * w.stride_w - g.pad_left; b < ow * w.stride_w - g.pad_left + w.kernel_w; ++b) {
            if (a < 0 || a >= g.H || b < 0 || b >= g.W) continue;
            const auto i = static_cast<std::size_t>((p * g.H + a) * g.W + b);
            if (!found || x[i] > y_ref[o] || std::isnan(x[i])) y_ref[o] = x[i];
            if (!found || x[i] > x[at] || (std::isnan(x[i]) && !std::isnan(x[at]))) at = i;
            found = true;
          }
        }
        dx_ref[at] += dy[o];
      }
    }
  }
  duet_test::for_each_isa([&] {
    std::vector<T> y(y_ref.size(), T(7)), dx(x.size(), T(7));
    detail::pool2d_forward<detail::MaxPoolKind>(w, g, x.data(), y.data());
    detail::max_pool2d_backward(w, g, dy.data(), x.data(), dx.data());
    CHECK(std::memcmp(y.data(), y_ref.data(), y.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(dx.data(), dx_ref.data(), dx.size() * sizeof(T)) == 0);
  });
}
}  // namespace

TEST_CASE_TEMPLATE("max_pool2d and its gradient over overlapping windows: each instruction set gives the rules' bits" *
                       duet_test::every_isa,
                   T, float, double) {
  using duet::ops::Pool2dWindow;
  const Pool2dWindow windows[] = {
      {3, 3, 2, 2, PadMode::pad, 1, 1},  // ResNet's stem
      {3, 3, 1, 1, PadMode::pad, 1, 1}, {2, 2, 1, 1},
      {5, 5, 2, 2, PadMode::pad, 2, 2}, {2, 2, 2, 2, PadMode::pad, 1, 1},
      {3, 3, 2, 2, PadMode::same},      {3, 2, 1, 2, PadMode::pad, 1, 1},
      {4, 4, 3, 3, PadMode::pad, 2, 2},  // column stride 3: the general loop
  };
  for (const Pool2dWindow& w : windows) {
    for (const Shape& shape : {Shape{2, 3, 28, 28}, Shape{1, 2, 7, 9}, Shape{1, 1, 5, 70}, Shape{1, 1, 3, 3}}) {
      check_max_pool_gradient<T>(w, shape);
    }
  }
  // Rows too long for the kernels' buffer: the general loops at stride 2.
  check_max_pool_gradient<T>(windows[0], Shape{1, 1, 3, 3000});
}

namespace {
// Average pooling and its gradient (kernels::avg_pool and avg_pool_backward, per instruction
// set, or ops/pool.hpp's general loops at other strides and for rows too long for the buffers)
// against sums written out, bit for bit. The value: each window's elements inside the input in
// row-major order, from the first, divided by the count. The gradient: each element's sum from
// +0 over the output rows whose windows hold it in ascending order; for each, the windows
// inside the input's columns in descending output column (their taps in ascending order), then
// those meeting the padding in ascending output column, each adding dy / count. And the
// gradient against the sum in double, one window at a time.
template <class T>
void check_avg_pool(const duet::ops::Pool2dWindow& w, Shape shape) {
  CAPTURE(duet::ops::detail::window_text(w));
  CAPTURE(w.count_include_pad);
  CAPTURE(shape);
  namespace detail = duet::ops::detail;
  const detail::PoolGeometry g = detail::pool_geometry(w, shape);
  std::mt19937 gen(static_cast<unsigned>(g.H * 131 + g.W * 7 + w.kernel_w));
  std::uniform_real_distribution<T> uniform(-1, 1);
  const T specials[] = {T(-0.0), T(0), std::numeric_limits<T>::infinity(), std::numeric_limits<T>::quiet_NaN()};
  std::vector<T> x(static_cast<std::size_t>(g.planes * g.H * g.W)),
      dy(static_cast<std::size_t>(g.planes * g.OH * g.OW));
  for (T& v : x) v = gen() % 4 == 0 ? specials[gen() % (gen() % 25 == 0 ? 4 : 2)] : uniform(gen);
  for (T& v : dy) v = gen() % 5 == 0 ? T(-0.0) : uniform(gen);
  const bool count_padding = w.pad_mode == PadMode::pad && w.count_include_pad;
  auto inside = [](index_t start, index_t k, index_t n) {
    return std::pair{std::max<index_t>(start, 0), std::min(start + k, n)};
  };
  std::vector<T> y_ref(dy.size()), dx_ref(x.size());
  std::vector<double> dx_double(dx_ref.size(), 0.0);
  for (index_t p = 0; p < g.planes; ++p) {
    auto share = [&](index_t oh, index_t ow) {
      const auto [r0, r1] = inside(oh * w.stride_h - g.pad_top, w.kernel_h, g.H);
      const auto [c0, c1] = inside(ow * w.stride_w - g.pad_left, w.kernel_w, g.W);
      const index_t count = count_padding ? w.kernel_h * w.kernel_w : (r1 - r0) * (c1 - c0);
      return dy[static_cast<std::size_t>((p * g.OH + oh) * g.OW + ow)] / static_cast<T>(count);
    };
    for (index_t a = 0; a < g.H; ++a) {
      for (index_t b = 0; b < g.W; ++b) {
        T sum = T(0);
        auto covers = [](index_t i, index_t start, index_t k) { return start <= i && i < start + k; };
        for (index_t oh = 0; oh < g.OH; ++oh) {
          if (!covers(a, oh * w.stride_h - g.pad_top, w.kernel_h)) continue;
          auto holds = [&](index_t ow) { return covers(b, ow * w.stride_w - g.pad_left, w.kernel_w); };
          for (index_t ow = g.hi - 1; ow >= g.lo; --ow) {
            if (holds(ow)) sum += share(oh, ow);
          }
          for (index_t ow = 0; ow < g.OW; ++ow) {
            if ((ow < g.lo || ow >= g.hi) && holds(ow)) sum += share(oh, ow);
          }
        }
        dx_ref[static_cast<std::size_t>((p * g.H + a) * g.W + b)] = sum;
      }
    }
    for (index_t oh = 0; oh < g.OH; ++oh) {
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const auto [r0, r1] = inside(oh * w.stride_h - g.pad_top, w.kernel_h, g.H);
        const auto [c0, c1] = inside(ow * w.stride_w - g.pad_left, w.kernel_w, g.W);
        T sum = x[static_cast<std::size_t>((p * g.H + r0) * g.W + c0)];
        for (index_t a = r0; a < r1; ++a) {
          for (index_t b = c0; b < c1; ++b) {
            if (a > r0 || b > c0) sum += x[static_cast<std::size_t>((p * g.H + a) * g.W + b)];
          }
        }
        const auto o = static_cast<std::size_t>((p * g.OH + oh) * g.OW + ow);
        y_ref[o] = sum / static_cast<T>(count_padding ? w.kernel_h * w.kernel_w : (r1 - r0) * (c1 - c0));
        const double count = count_padding ? double(w.kernel_h * w.kernel_w) : double((r1 - r0) * (c1 - c0));
        for (index_t a = r0; a < r1; ++a) {
          for (index_t b = c0; b < c1; ++b) {
            dx_double[static_cast<std::size_t>((p * g.H + a) * g.W + b)] +=
                double(dy[static_cast<std::size_t>((p * g.OH + oh) * g.OW + ow)]) / count;
          }
        }
      }
    }
  }
  const double tolerance = std::is_same_v<T, float> ? 1e-5 : 1e-13;
  for (std::size_t i = 0; i < dx_ref.size(); ++i) REQUIRE(std::abs(double(dx_ref[i]) - dx_double[i]) <= tolerance);
  duet_test::for_each_isa([&] {
    std::vector<T> y(y_ref.size(), T(7)), dx(dx_ref.size(), T(7));
    detail::pool2d_forward<detail::AvgPoolKind>(w, g, x.data(), y.data());
    detail::avg_pool2d_backward(w, g, dy.data(), dx.data());
    CHECK(std::memcmp(y.data(), y_ref.data(), y.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(dx.data(), dx_ref.data(), dx.size() * sizeof(T)) == 0);
  });
}
}  // namespace

TEST_CASE_TEMPLATE("avg_pool2d and its gradient: each instruction set gives the order's bits" * duet_test::every_isa, T,
                   float, double) {
  using duet::ops::Pool2dWindow;
  const Pool2dWindow windows[] = {
      {3, 3, 2, 2, PadMode::pad, 1, 1},  // ResNet's stem
      {3, 3, 2, 2, PadMode::pad, 1, 1, false},
      {3, 3, 1, 1, PadMode::pad, 1, 1},
      {3, 3, 1, 1, PadMode::pad, 1, 1, false},
      {2, 2, 1, 1},
      {2, 2, 2, 2},
      {5, 5, 1, 1, PadMode::pad, 2, 2, false},  // two border windows on each side
      {5, 5, 2, 2, PadMode::pad, 2, 2},
      {2, 2, 2, 2, PadMode::pad, 1, 1, false},
      {3, 3, 2, 2, PadMode::same},
      {3, 2, 1, 2, PadMode::pad, 1, 1},
      {4, 4, 3, 3, PadMode::pad, 2, 2, false},
  };
  for (const Pool2dWindow& w : windows) {
    for (const Shape& shape : {Shape{2, 3, 28, 28}, Shape{1, 2, 7, 9}, Shape{1, 1, 5, 70}, Shape{1, 1, 4, 4}}) {
      check_avg_pool<T>(w, shape);
    }
  }
  // Rows too long for the kernels' buffers: the general loops.
  check_avg_pool<T>(windows[0], Shape{1, 1, 3, 3000});
}

TEST_CASE("pooling layers: MindSpore's output sizes, and shapes checked at compile time and at run time") {
  namespace nn = duet::nn;
  // MindSpore's example: nn.MaxPool2d(kernel_size=3, stride=1) on [1, 2, 4, 4] gives [1, 2, 2, 2].
  nn::MaxPool2d<3> pool;
  CHECK(pool(duet::ones({1, 2, 4, 4})).shape() == Shape{1, 2, 2, 2});
  // The static shape of each layer's output, as graph mode computes it while compiling.
  const auto x = duet::ones(duet::shape<2, 3, 28, 28>);
  nn::MaxPool2d<2, 2> lenet_pool;
  nn::AvgPool2d<3, 2, PadMode::same> same;
  nn::AvgPool2d<3, 2, PadMode::pad, 1> padded;
  nn::AdaptiveAvgPool2d<1> global;
  static_assert(std::is_same_v<decltype(lenet_pool(x)), duet::StaticTensor<float, 2, 3, 14, 14>>);
  static_assert(std::is_same_v<decltype(same(x)), duet::StaticTensor<float, 2, 3, 14, 14>>);
  static_assert(std::is_same_v<decltype(padded(x)), duet::StaticTensor<float, 2, 3, 14, 14>>);
  static_assert(std::is_same_v<decltype(global(x)), duet::StaticTensor<float, 2, 3, 1, 1>>);
  CHECK(global(x).tensor()(0, 0, 0, 0) == 1.0f);
  CHECK(padded(x).tensor()(0, 0, 0, 0) == doctest::Approx(4.0 / 9));  // a corner: 4 of 9 inside, padding counted
  CHECK(same(x).tensor()(0, 0, 13, 13) == 1.0f);                       // "same" divides by the elements inside
  nn::MaxPool2d<5> too_large;
  try {
    static_cast<void>(too_large(duet::ones({1, 1, 4, 6})));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) ==
          "nn::MaxPool2d<5, 1, valid, 0> expects an input whose spatial axes (after batch and channels) are each at "
          "least 5, to hold its window less the padding, got [1, 1, 4, 6]");
  }
  try {
    static_cast<void>(duet::ops::avg_pool2d<2>(duet::ones({4, 4})));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) ==
          "ops::avg_pool2d(kernel=2x2, stride=1x1, pad_mode=pad, padding=0x0) expects an input of rank 4, got [4, 4]");
  }
  CHECK_THROWS_AS(nn::AdaptiveAvgPool2d<2>()(duet::ones({1, 1, 0, 3})), duet::ShapeError);
}

TEST_CASE("pooling over a window given at run time: the template forms' bits, its checks and its errors") {
  namespace ops = duet::ops;
  const duet::Tensor x = duet::uniform({2, 3, 9, 8}, -1.0f, 1.0f, 5);
  const auto same_bits = [](const duet::Tensor& a, const duet::Tensor& b) {
    return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * 4) == 0;
  };
  // Forward and gradient, in each mode, the same bits as the window fixed at compile time.
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    const auto fixed = [](const auto& t) { return ops::sum(ops::square(ops::max_pool2d<3, 2, 1>(t))); };
    const auto given = [](const auto& t) { return ops::sum(ops::square(ops::max_pool2d(t, 3, 2, 1))); };
    CHECK(same_bits(duet::grad(fixed)(x), duet::grad(given)(x)));
    CHECK(same_bits(ops::avg_pool2d<2, 2>(x), ops::avg_pool2d(x, 2, 2)));
    CHECK(same_bits(ops::max_pool2d<2>(x), ops::max_pool2d(x, 2)));  // the 2x2 kernels of each instruction set
  }
  // A shape too small for the window, as the fixed form says it.
  try {
    static_cast<void>(ops::max_pool2d(duet::ones({1, 1, 4, 6}), 5, 1));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()).find("ops::max_pool2d(kernel=5x5, stride=1x1, pad_mode=pad, padding=0x0)") == 0);
  }
  const auto refused = [&](const ops::Pool2dWindow& w) {
    try {
      static_cast<void>(ops::avg_pool2d(x, w));
    } catch (const duet::ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(refused({3, 3, 0, 1}) ==
        "duet::ops::avg_pool2d: the window (kernel=3x3, stride=0x1, pad_mode=valid) has a kernel or stride below 1");
  CHECK(refused({2, 2, 1, 1, PadMode::pad, 2, 0}) ==
        "duet::ops::avg_pool2d: the window (kernel=2x2, stride=1x1, pad_mode=pad, padding=2x0) pads by less than 0 or "
        "by more than half its kernel");
  CHECK(refused({3, 3, 1, 1, PadMode::same, 1, 1}) ==
        "duet::ops::avg_pool2d: the window (kernel=3x3, stride=1x1, pad_mode=same) gives padding outside pad_mode pad");
}

namespace {

// Tokens as a 4-channel image: every layer of this pool part in one network.
template <auto Setting>
struct TokenImageNet : duet::nn::Cell<TokenImageNet<Setting>, Setting> {
  using input_value_type = std::int32_t;                // called with token indices
  duet::nn::Embedding<12, 8> embedding;                 // [N, 16] -> [N, 16, 8]
  duet::nn::GroupNorm<2, 4> norm;                       // [N, 4, 4, 8]
  duet::nn::MaxPool2d<2, 2> max_pool;                   // [N, 4, 2, 4]
  duet::nn::AvgPool2d<3, 1, PadMode::same> avg_pool;   // [N, 4, 2, 4]
  duet::nn::AdaptiveAvgPool2d<1, 2> pool;               // [N, 4, 1, 2]
  duet::nn::Flatten flatten;
  duet::nn::Dense<8, 3> fc;
  DUET_CELL_MEMBERS(embedding, norm, max_pool, avg_pool, pool, flatten, fc);
  auto construct(auto x) {
    auto image = duet::ops::reshape<-1, 4, 4, 8>(embedding(x));
    return fc(flatten(pool(avg_pool(max_pool(norm(image))))));
  }
};

std::vector<float> train_token_net(duet::Mode mode, const duet::BasicTensor<std::int32_t>& x,
                                   const duet::BasicTensor<std::int32_t>& y) {
  duet_test::ModeGuard guard;
  duet::set_context({.mode = mode});
  duet::set_seed(21);
  TokenImageNet<duet::CONTEXT_MODE> net;
  duet::nn::CrossEntropyLoss<> loss;
  duet::nn::WithLossCell with_loss(net, loss);
  duet::nn::Adam adam(net.parameters(), {.learning_rate = 0.05});
  duet::nn::TrainOneStepCell step(with_loss, adam);
  std::vector<float> losses;
  for (int s = 0; s < 8; ++s) losses.push_back(step(x, y).item());
  return losses;
}

}  // namespace

TEST_CASE("Embedding, GroupNorm and the pooling layers train a network with the same losses in both modes") {
  duet::BasicTensor<std::int32_t> x({24, 16});
  duet::BasicTensor<std::int32_t> y({24});
  duet::Generator gen(5);
  const D u = duet::uniform<double>(Shape{24, 16}, 0.0, 12.0, gen);
  for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<std::int32_t>(u.data()[i]);
  for (index_t i = 0; i < 24; ++i) y.data()[i] = x.data()[i * 16] % 3;  // the class is in the first token
  const auto eager = train_token_net(duet::PYNATIVE_MODE, x, y);
  const auto graph = train_token_net(duet::GRAPH_MODE, x, y);
  REQUIRE(eager.size() == graph.size());
  for (std::size_t s = 0; s < eager.size(); ++s) {
    INFO("step ", s);
    CHECK(eager[s] == graph[s]);
  }
  CHECK(eager.back() < 0.9f * eager.front());
  // Called with its int32 indices alone, in each mode.
  duet_test::ModeGuard guard;
  duet::set_seed(21);
  TokenImageNet<duet::CONTEXT_MODE> net;
  const duet::Tensor pynative = net(x);
  duet::set_context({.mode = duet::GRAPH_MODE});
  const duet::Tensor graph_out = net(x);
  REQUIRE(pynative.shape() == Shape{24, 3});
  REQUIRE(graph_out.shape() == Shape{24, 3});
  CHECK(std::equal(pynative.data(), pynative.data() + 72, graph_out.data()));
}

}  // namespace tests_ops_pool
