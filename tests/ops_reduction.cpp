// Reductions (include/duet/ops/reduction.hpp): their cases in the gradient harness, with values
// from plain loops in double, and what the harness does not cover (ties, NaN, refused
// gradients, shape errors).
#include <limits>
#include <random>

#include "ops_harness.hpp"

namespace tests_ops_reduction {

namespace {

using namespace duet_test::ops;
using duet_test::ops::D;
namespace ops = duet::ops;

enum class Kind { sum, mean, prod, max, min, argmax, argmin, logsumexp };

// The reduction of x over `axes` (every axis if empty), written out: each input element's
// output index is its own with the reduced axes dropped (or pinned to 0 with keep_dims).
D reference_reduce(const D& x, std::vector<int> axes, bool keep, Kind kind) {
  const int rank = x.shape().rank();
  std::vector<bool> reduced(static_cast<std::size_t>(rank), axes.empty());
  for (int a : axes) reduced[static_cast<std::size_t>(a < 0 ? a + rank : a)] = true;
  Shape out;
  for (int i = 0; i < rank; ++i) {
    if (!reduced[static_cast<std::size_t>(i)]) out.push_back(x.shape()[i]);
    else if (keep) out.push_back(1);
  }
  const std::size_t n = static_cast<std::size_t>(out.numel());
  std::vector<double> acc(n, kind == Kind::max ? -1e300 : kind == Kind::min ? 1e300 : kind == Kind::prod ? 1.0 : 0.0);
  std::vector<double> count(n, 0.0), best(n, 0.0);
  std::vector<duet::index_t> index(static_cast<std::size_t>(rank));
  for (duet::index_t e = 0; e < x.numel(); ++e) {
    duet::index_t rest = e;
    for (int a = rank - 1; a >= 0; --a) {
      index[static_cast<std::size_t>(a)] = rest % x.shape()[a];
      rest /= x.shape()[a];
    }
    std::size_t o = 0;
    duet::index_t position = 0;  // along the reduced axis, for argmax and argmin
    for (int a = 0; a < rank; ++a) {
      const auto i = index[static_cast<std::size_t>(a)];
      if (!reduced[static_cast<std::size_t>(a)]) o = o * static_cast<std::size_t>(x.shape()[a]) + static_cast<std::size_t>(i);
      else position = i;
    }
    const double v = x.data()[e];
    switch (kind) {
      case Kind::sum:
      case Kind::mean:
        acc[o] += v;
        break;
      case Kind::prod:
        acc[o] *= v;
        break;
      case Kind::logsumexp:
        acc[o] += std::exp(v);
        break;
      case Kind::max:
        acc[o] = std::max(acc[o], v);
        break;
      case Kind::min:
        acc[o] = std::min(acc[o], v);
        break;
      case Kind::argmax:
      case Kind::argmin:
        if (count[o] == 0 || (kind == Kind::argmax ? v > best[o] : v < best[o])) {
          best[o] = v;
          acc[o] = static_cast<double>(position);
        }
        break;
    }
    count[o] += 1;
  }
  D y = duet::zeros<double>(out);
  for (std::size_t o = 0; o < n; ++o) {
    y.data()[o] = kind == Kind::mean ? acc[o] / count[o] : kind == Kind::logsumexp ? std::log(acc[o]) : acc[o];
  }
  return y;
}

// A reduction f (called with ops::axes<A...> or not, keep_dims or not) as a case checked
// against reference_reduce.
template <class F>
Case reduction_case(Shape shape, F f, std::vector<int> axes, bool keep, Kind kind) {
  return make_case_with_reference<1>({shape}, f, [axes, keep, kind](const std::vector<D>& xs) {
    return reference_reduce(xs[0], axes, keep, kind);
  });
}

// Axes given at run time, for the cases below.
constexpr std::array<int, 2> apart_axes{0, 2};
constexpr std::array<int, 1> last_axis{-1};

// Every spelling of one reduction: all axes, an inner axis, an outer axis, a middle one, two
// that are not neighbours, negative axes, each with and without keep_dims.
template <Kind K, class R>
void add_reduction(std::multimap<std::string, Case>& m, const std::string& name, R r) {
  auto add = [&](Shape s, auto f, std::vector<int> axes, bool keep) {
    m.emplace(name, reduction_case(s, f, std::move(axes), keep, K));
  };
  add({3, 4}, [r](const auto& x) { return r(x); }, {}, false);
  add({3, 4}, [r](const auto& x) { return r(x, ops::keep_dims); }, {}, true);
  add({2, 3, 4}, [r](const auto& x) { return r(x, ops::axes<2>); }, {2}, false);
  add({2, 3, 4}, [r](const auto& x) { return r(x, ops::axes<-1>, ops::keep_dims); }, {-1}, true);
  add({2, 3, 4}, [r](const auto& x) { return r(x, ops::axes<0>); }, {0}, false);
  add({2, 3, 4}, [r](const auto& x) { return r(x, ops::axes<1>, ops::keep_dims); }, {1}, true);
  add({2, 3, 4}, [r](const auto& x) { return r(x, ops::axes<-2>); }, {-2}, false);
  add({2, 3, 4}, [r](const auto& x) { return r(x, ops::axes<0, 1>); }, {0, 1}, false);
  add({2, 3, 4, 2}, [r](const auto& x) { return r(x, ops::axes<0, 2>); }, {0, 2}, false);
  add({2, 3, 4, 2}, [r](const auto& x) { return r(x, ops::axes<-1, 1>, ops::keep_dims); }, {-1, 1}, true);
  add({5}, [r](const auto& x) { return r(x, ops::axes<0>); }, {0}, false);
  // The axes given at run time: one operation for every set of them.
  add({2, 3, 4, 2}, [r](const auto& x) { return r(x, std::span<const int>(apart_axes)); }, {0, 2}, false);
  add({2, 3, 4}, [r](const auto& x) { return r(x, std::span<const int>(last_axis), ops::keep_dims); }, {-1}, true);
  add({3, 4}, [r](const auto& x) { return r(x, std::span<const int>()); }, {}, false);
}

// var or std over `axes` from two plain reductions: E[x^2] - E[x]^2 in double, against duet's
// mean of squared deviations.
template <class F>
Case moment_case(Shape shape, F f, std::vector<int> axes, bool keep, bool root) {
  return make_case_with_reference<1>({shape}, f, [axes, keep, root](const std::vector<D>& xs) {
    D squares = xs[0].clone();
    for (duet::index_t i = 0; i < squares.numel(); ++i) squares.data()[i] *= squares.data()[i];
    D v = reference_reduce(squares, axes, keep, Kind::mean);
    const D m = reference_reduce(xs[0], axes, keep, Kind::mean);
    for (duet::index_t i = 0; i < v.numel(); ++i) {
      v.data()[i] -= m.data()[i] * m.data()[i];
      if (root) v.data()[i] = std::sqrt(v.data()[i]);
    }
    return v;
  });
}

// x's running sums along `axis` in double, element by element: the multi-index of each element,
// and the sum of x over the indices up to its own along the axis.
D reference_cumsum(const D& x, int axis) {
  const int rank = x.ndim();
  const auto a = static_cast<std::size_t>(axis < 0 ? axis + rank : axis);
  D y = duet::zeros<double>(x.shape());
  std::vector<duet::index_t> index(static_cast<std::size_t>(rank));
  std::vector<duet::index_t> stride(static_cast<std::size_t>(rank), 1);
  for (int d = rank - 2; d >= 0; --d) {
    const auto u = static_cast<std::size_t>(d);
    stride[u] = stride[u + 1] * x.dim(d + 1);
  }
  for (duet::index_t e = 0; e < x.numel(); ++e) {
    duet::index_t rest = e;
    for (int d = rank - 1; d >= 0; --d) {
      index[static_cast<std::size_t>(d)] = rest % x.dim(d);
      rest /= x.dim(d);
    }
    double sum = 0;
    for (duet::index_t k = 0; k <= index[a]; ++k) sum += x.data()[e - (index[a] - k) * stride[a]];
    y.data()[e] = sum;
  }
  return y;
}

template <Kind K, class F>
Case arg_case(Shape s, F f, int axis, bool keep) {
  return make_value_case({s}, f, [axis, keep](const std::vector<D>& xs) {
    return reference_reduce(xs[0], {axis}, keep, K);
  });
}

const bool reduction_cases = add_cases([](std::multimap<std::string, Case>& m) {
  add_reduction<Kind::sum>(m, "sum", [](const auto&... a) { return ops::sum(a...); });
  add_reduction<Kind::mean>(m, "mean", [](const auto&... a) { return ops::mean(a...); });
  add_reduction<Kind::prod>(m, "prod", [](const auto&... a) { return ops::prod(a...); });
  add_reduction<Kind::max>(m, "max", [](const auto&... a) { return ops::max(a...); });
  add_reduction<Kind::min>(m, "min", [](const auto&... a) { return ops::min(a...); });
  add_reduction<Kind::logsumexp>(m, "logsumexp", [](const auto&... a) { return ops::logsumexp(a...); });
  // The same as the tensors' methods, PyTorch's x.sum(), in every spelling of the axes.
  m.emplace("sum", reduction_case(
                       {3, 4}, [](const auto& x) { return x.sum(); }, {}, false, Kind::sum));
  m.emplace("sum", reduction_case(
                       {2, 3, 4}, [](const auto& x) { return x.sum(1); }, {1}, false, Kind::sum));
  m.emplace("mean",
            reduction_case(
                {2, 3, 4}, [](const auto& x) { return ops::mean(x, -1, ops::keep_dims); }, {-1}, true, Kind::mean));
  m.emplace("mean",
            reduction_case(
                {2, 3, 4}, [](const auto& x) { return x.mean(ops::axes<1>, ops::keep_dims); }, {1}, true, Kind::mean));
  m.emplace("prod", reduction_case(
                        {2, 3, 4}, [](const auto& x) { return x.prod(ops::axes<0>); }, {0}, false, Kind::prod));
  m.emplace("max", reduction_case(
                       {2, 3, 4, 2},
                       [](const auto& x) {
                         return x.max({0, 2});
                       },
                       {0, 2}, false, Kind::max));
  m.emplace("min", reduction_case(
                       {2, 3, 4}, [](const auto& x) { return x.min({-1}, ops::keep_dims); }, {-1}, true, Kind::min));
  const auto add_cumsum = [&](Shape shape, auto f, int axis) {
    m.emplace("cumsum", make_case_with_reference<1>(
                            {shape}, f, [axis](const std::vector<D>& xs) { return reference_cumsum(xs[0], axis); }));
  };
  add_cumsum(
      {2, 3, 4}, [](const auto& x) { return ops::cumsum<0>(x); }, 0);
  add_cumsum(
      {2, 3, 4}, [](const auto& x) { return ops::cumsum<1>(x); }, 1);
  add_cumsum(
      {2, 3, 4}, [](const auto& x) { return ops::cumsum<-1>(x); }, -1);
  add_cumsum(
      {7}, [](const auto& x) { return ops::cumsum<0>(x); }, 0);
  add_cumsum(
      {3, 1, 2}, [](const auto& x) { return ops::cumsum<-2>(x); }, -2);
  m.emplace("var", moment_case({3, 4}, [](const auto& x) { return ops::var(x); }, {}, false, false));
  m.emplace("var", moment_case({2, 3, 4}, [](const auto& x) { return ops::var(x, ops::axes<-1>, ops::keep_dims); }, {-1},
                               true, false));
  m.emplace("var", moment_case({2, 3, 4, 2}, [](const auto& x) { return ops::var(x, ops::axes<0, 2>); }, {0, 2}, false,
                               false));
  m.emplace("std", moment_case({4, 5}, [](const auto& x) { return ops::std(x, ops::axes<0>); }, {0}, false, true));
  m.emplace("std", moment_case({3, 4}, [](const auto& x) { return ops::std(x, ops::keep_dims); }, {}, true, true));
  m.emplace("argmax", arg_case<Kind::argmax>({3, 4}, [](const auto& x) { return ops::argmax(x); }, -1, false));
  m.emplace("argmax", arg_case<Kind::argmax>({2, 3, 4}, [](const auto& x) { return ops::argmax(x, ops::axis<1>); }, 1,
                                             false));
  m.emplace("argmax", arg_case<Kind::argmax>(
                          {2, 3, 4}, [](const auto& x) { return ops::argmax(x, ops::axis<0>, ops::keep_dims); }, 0, true));
  m.emplace("argmin", arg_case<Kind::argmin>({3, 4}, [](const auto& x) { return ops::argmin(x); }, -1, false));
  m.emplace("argmin", arg_case<Kind::argmin>(
                          {2, 3, 4}, [](const auto& x) { return ops::argmin(x, ops::axis<-2>, ops::keep_dims); }, -2, true));

  // The axis at run time, as PyTorch's argmax(x, dim) is written.
  m.emplace("argmax", arg_case<Kind::argmax>(
                          {2, 3, 4}, [](const auto& x) { return ops::argmax(x, 1); }, 1, false));
  m.emplace("argmax", arg_case<Kind::argmax>(
                          {2, 3, 4}, [](const auto& x) { return ops::argmax(x, -1, ops::keep_dims); }, -1, true));
  m.emplace("argmin", arg_case<Kind::argmin>(
                          {2, 3, 4}, [](const auto& x) { return ops::argmin(x, 0); }, 0, false));
});

template <class F>
std::vector<D> gradient_in_both_modes(F f, const D& x) {
  std::vector<D> out;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    out.push_back(duet::grad(f)(x));
  }
  duet::set_context({.mode = duet::PYNATIVE_MODE});
  return out;
}

}  // namespace

TEST_CASE("ops: max and min split the gradient evenly among ties, in both modes") {
  duet_test::ModeGuard guard;
  const D x({2, 4}, {1.0, 3.0, 3.0, 0.0, -2.0, -2.0, -2.0, 5.0});
  const auto dmax = gradient_in_both_modes([](const auto& t) { return ops::sum(ops::max(t, ops::axes<1>)); }, x);
  const auto dmin = gradient_in_both_modes([](const auto& t) { return ops::sum(ops::min(t, ops::axes<1>)); }, x);
  const std::vector<double> expect_max = {0, 0.5, 0.5, 0, 0, 0, 0, 1};
  const std::vector<double> expect_min = {0, 0, 0, 1, 1.0 / 3, 1.0 / 3, 1.0 / 3, 0};
  for (int m = 0; m < 2; ++m) {
    CHECK(std::vector<double>(dmax[m].data(), dmax[m].data() + 8) == expect_max);
    CHECK(std::vector<double>(dmin[m].data(), dmin[m].data() + 8) == expect_min);
  }
}

TEST_CASE("ops: max propagates NaN, argmax points at it, and an empty max is refused") {
  const duet::Tensor x({2, 3}, {1.f, NAN, 2.f, 4.f, 5.f, 6.f});
  const duet::Tensor m = ops::max(x, ops::axes<1>);
  CHECK(std::isnan(m(0)));
  CHECK(m(1) == 6.f);
  const auto i = ops::argmax(x);
  CHECK(i.shape() == Shape{2});
  CHECK(i(0) == 1);
  CHECK(i(1) == 2);
  CHECK(ops::sum(duet::zeros<float>({0, 3}), ops::axes<0>)(2) == 0.f);
  try {
    static_cast<void>(ops::max(duet::zeros<float>({0, 3}), ops::axes<0>));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()).find("ReduceMax(axis=0) expects an input with no empty axis") == 0);
  }
}

TEST_CASE("ops: a reduction axis out of range is a ShapeError naming the operation and the shape") {
  try {
    static_cast<void>(ops::sum(duet::ones({2, 3}), ops::axes<2>));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "ReduceSum(axis=2) expects an input of rank at least 3, got [2, 3]");
  }
  try {
    static_cast<void>(ops::argmin(duet::ones({2, 3}), ops::axis<-3>));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "Argmin(axis=-3) expects an input of rank at least 3, got [2, 3]");
  }
}

TEST_CASE("ops: argmax's axis at run time is refused as ops::axis<A> is, in both modes") {
  duet_test::ModeGuard guard;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const int axis = 2;
    auto run = duet::jit([axis](const auto& x) { return ops::argmax(x, axis); });
    try {
      static_cast<void>(run(duet::ones({2, 3})));
      FAIL("no error");
    } catch (const duet::ShapeError& e) {
      CHECK(std::string(e.what()).find("Argmax(axis=2) expects an input of rank at least 3, got [2, 3]") == 0);
    }
  }
  try {
    static_cast<void>(ops::argmin(duet::ones({2, 3}), 9));
    FAIL("no error");
  } catch (const duet::ValueError& e) {
    CHECK(std::string(e.what()) == "duet::ops::argmin: the axis must be in [-8, 8), got 9");
  }
}

namespace {
struct StaticReductions : duet::nn::Cell<StaticReductions, duet::GRAPH_MODE> {
  auto construct(auto t) {
    auto s = ops::sum(t, ops::axes<0, 2>);
    auto m = ops::mean(t, ops::axes<-1>);
    // Captured on the input's static shape (the cell also probes construct on an unknown one).
    if constexpr (duet::graph::Symbolic<decltype(t)>) {
      if constexpr (decltype(t)::shape.is_concrete()) {
        static_assert(decltype(s)::shape == Shape{3});
        static_assert(decltype(m)::shape == Shape{2, 3});
      }
    }
    return s * m;
  }
};
}  // namespace

TEST_CASE("ops: reductions on static tensors compute their shapes at compile time") {
  const auto x = duet::ones(duet::shape<2, 3, 4>);
  StaticReductions net;
  const duet::Tensor y = net(x);
  CHECK(y.shape() == Shape{2, 3});
  CHECK(y(1, 2) == 8.f);
  const duet::Tensor eager = ops::sum(x, ops::axes<0, 2>, ops::keep_dims);
  CHECK(eager.shape() == Shape{1, 3, 1});
}

namespace {
// The same network written with the tensors' methods (PyTorch's h.mean(1), scale.sum()) or
// with the ops they call: on a layer's output, on a parameter alone, axes in each spelling.
template <bool Methods>
struct Reduced : duet::nn::Cell<Reduced<Methods>> {
  duet::nn::Dense<4, 3> fc;
  duet::nn::Parameter scale{duet::Tensor({2}, {0.5f, 2.f})};
  DUET_CELL_MEMBERS(fc, scale);
  auto construct(auto x) {
    auto h = fc(x);
    if constexpr (Methods) {
      return h.mean(1) * scale.sum() + h.max(ops::axes<-1>) - h.min({1}) + h.prod(ops::axes<1>);
    } else {
      return ops::mean(h, ops::axes<1>) * ops::sum(scale) + ops::max(h, ops::axes<-1>) - ops::min(h, {1}) +
             ops::prod(h, ops::axes<1>);
    }
  }
};
}  // namespace

TEST_CASE("ops: the tensors' reduction methods are the ops, on parameters and in construct, in both modes") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::randn({5, 4}, 3);
  std::vector<std::vector<float>> results;  // each run's output, then each parameter's gradient
  const auto run = [&](auto& net) {
    auto vg = duet::value_and_grad([&](auto t) { return ops::sum(net(t)); }, net.parameters());
    const auto [value, grads] = vg(x);
    const duet::Tensor y = net(x);
    std::vector<float> all(y.values().begin(), y.values().end());
    all.push_back(value.item());
    for (const auto& g : grads) all.insert(all.end(), g.values().begin(), g.values().end());
    results.push_back(all);
  };
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::set_seed(4);
    Reduced<true> methods;
    duet::set_seed(4);
    Reduced<false> spelled;
    run(methods);
    run(spelled);
  }
  REQUIRE(results.size() == 4);
  CHECK(results[0].size() == 5 + 1 + 12 + 3 + 2);
  for (const auto& r : results) CHECK(r == results[0]);
  // scale's gradient is the sum of the means: not a silent zero.
  CHECK(results[0].back() != 0.f);

  // Static tensors keep their static shapes; integer sums and a mask's count as ops::sum's.
  const auto s = duet::ones(duet::shape<2, 3, 4>).sum(ops::axes<0, 2>, ops::keep_dims);
  static_assert(std::is_same_v<std::remove_const_t<decltype(s)>, duet::StaticTensor<float, 1, 3, 1>>);
  CHECK(s(0, 2, 0) == 8.f);
  const duet::BasicTensor<std::int32_t> ids({4}, {3, 0, 3, 7});
  CHECK(ids.sum().item() == 13);
  CHECK(ids.max().item() == 7);
  CHECK(ops::equal(ids, 3).sum().item() == 2);
  CHECK(duet::Tensor({2, 2}, {1.f, 2.f, 3.f, 4.f}).mean({0}).values()[1] == 3.f);
  // One axis as an int, PyTorch's x.sum(1), is the axes at run time: checked when it runs.
  CHECK(duet::Tensor({2, 2}, {1.f, 2.f, 3.f, 4.f}).sum(1).values()[1] == 7.f);
  CHECK_THROWS_AS(duet::ones({2, 2}).sum(2), duet::ShapeError);
  CHECK_THROWS_AS(duet::ones({2, 2}).sum(9), duet::ValueError);
}

}  // namespace tests_ops_reduction

namespace tests_ops_reduction {

TEST_CASE("ops: a sum of a comparison's mask counts in int32, past 255") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::uniform({300}, 0.0f, 1.0f, 1);
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const auto count = duet::jit([](const auto& t) { return ops::sum(ops::greater(t, -1.0f)); })(x);
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(count)>::value_type, std::int32_t>);
    CHECK(count.item() == 300);
    const auto per_row = ops::sum(ops::less(duet::uniform({2, 400}, 0.0f, 1.0f, 2), 2.0f), {1});
    CHECK(per_row(0) == 400);
    CHECK(per_row(1) == 400);
  }
}

TEST_CASE("ops: float sums combine runs pairwise, so a million values keep their digits on every path") {
  // 10^6 values near 10^4, as helper-89 had them: summed in order, float lost three digits of
  // the mean (9990.87) and most of the variance (91.4 for 8.0).
  constexpr duet::index_t n = 1'000'000;
  duet::Tensor x({n});
  std::mt19937 engine(7);
  std::uniform_real_distribution<float> spread(-4.0f, 4.0f);
  double total = 0;
  for (duet::index_t i = 0; i < n; ++i) {
    x.data()[i] = 1e4f + spread(engine);
    total += x.data()[i];
  }
  const double mean = total / n;
  double squares = 0;
  for (duet::index_t i = 0; i < n; ++i) squares += (x.data()[i] - mean) * (x.data()[i] - mean);
  CHECK(std::abs(ops::mean(x).item() - mean) < 2e-3);  // the float nearest 10^4 is 1e-3 away
  CHECK(std::abs(ops::var(x).item() - squares / n) < 1e-3 * (squares / n));
  // The strided path ([reduced, inner]) and the general one (axes 0 and 2 of three).
  duet::Tensor rows({n / 4, 4});
  duet::Tensor apart({100, 100, 100});
  std::copy_n(x.data(), n, rows.data());
  std::copy_n(x.data(), n, apart.data());
  const duet::Tensor column_means = ops::mean(rows, ops::axes<0>);
  const duet::Tensor middle_means = ops::mean(apart, ops::axes<0, 2>);
  for (int c = 0; c < 4; ++c) CHECK(std::abs(column_means(c) - 1e4) < 2e-2);
  for (int j = 0; j < 100; ++j) CHECK(std::abs(middle_means(j) - 1e4) < 0.5);
  // The order is fixed: the same bits again, and max and min as before.
  CHECK(ops::sum(x).item() == ops::sum(x).item());
  CHECK(ops::max(x).item() == *std::max_element(x.data(), x.data() + n));
}

TEST_CASE("ops: std's gradient is 0 where the variance is 0, as PyTorch's, in both modes") {
  duet_test::ModeGuard guard;
  const D x({2, 3}, {1.0, 1.0, 1.0, 1.0, 2.0, 4.0});
  const auto d = gradient_in_both_modes([](const auto& t) { return ops::sum(ops::std(t, ops::axes<1>)); }, x);
  for (int m = 0; m < 2; ++m) {
    for (int i = 0; i < 3; ++i) CHECK(d[m].data()[i] == 0.0);
    for (int i = 3; i < 6; ++i) CHECK(std::isfinite(d[m].data()[i]));
  }
  CHECK(std::equal(d[0].data(), d[0].data() + 6, d[1].data()));
  // Where the variance is not 0: sqrt's, (x - mean) / (n · std).
  const double mean = 7.0 / 3, sd = std::sqrt(((1 - mean) * (1 - mean) + (2 - mean) * (2 - mean) + (4 - mean) * (4 - mean)) / 3);
  CHECK(d[0].data()[5] == doctest::Approx((4 - mean) / (3 * sd)).epsilon(1e-12));
}

TEST_CASE("ops: logsumexp keeps large logits finite and a row of -inf at -inf, as PyTorch's, in both modes") {
  duet_test::ModeGuard guard;
  constexpr float inf = std::numeric_limits<float>::infinity();
  const duet::Tensor x({3, 3}, {1000.0f, 1000.0f, -1000.0f, -inf, -inf, -inf, 0.0f, -inf, inf});
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const duet::Tensor y = duet::jit([](const auto& t) { return ops::logsumexp(t, ops::axes<1>); })(x);
    CHECK(y(0) == doctest::Approx(1000.0 + std::log(2.0)));
    CHECK(y(1) == -inf);
    CHECK(y(2) == inf);
    const duet::Tensor kept = ops::logsumexp(x, {-1}, ops::keep_dims);
    CHECK(kept.shape() == Shape{3, 1});
    CHECK(kept(0, 0) == y(0));
  }
}

}  // namespace tests_ops_reduction

namespace tests_ops_reduction {

namespace {
// d/dx_i of the product of a group: the product of the group's other elements, multiplied out
// one by one in double. Groups are the rows of x viewed as [groups, n] with the reduced axis
// last.
std::vector<double> product_of_others(const std::vector<double>& x, std::size_t n) {
  std::vector<double> d(x.size());
  for (std::size_t g = 0; g < x.size() / n; ++g) {
    for (std::size_t i = 0; i < n; ++i) {
      double p = 1;
      for (std::size_t k = 0; k < n; ++k) p *= k == i ? 1.0 : x[g * n + k];
      d[g * n + i] = p;
    }
  }
  return d;
}
}  // namespace

TEST_CASE("ops: prod's gradient is the product of the others, exact where a group holds zeros, in both modes") {
  duet_test::ModeGuard guard;
  // Rows without a zero, with one, with two, of zeros only, and with a -0; the values' products
  // are exact in double, so the reference is too. PyTorch's torch.prod(x, 1).sum().backward()
  // gives the same gradient (torch 1.13, in float64).
  const std::vector<double> rows = {2, -3, 1.5, -6, 1, 0, 3, -2, 0, 4, 0, 5, 0, 0, 0, 0, -0.0, 0.5, 3, -0.5};
  const std::vector<double> expect_rows = {27, -18, 36, -9, 0, -6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -0.75, 0, 0, 0};
  const std::vector<double> others = product_of_others(rows, 4);
  for (std::size_t i = 0; i < rows.size(); ++i) CHECK(others[i] == expect_rows[i]);
  const D x({5, 4}, rows);
  // The group contiguous (axis 1), strided (axis 0 of the transpose) and general (axes 0 and 2
  // of [2, 5, 2]): each group the same four values.
  const auto along_rows = gradient_in_both_modes([](const auto& t) { return ops::sum(ops::prod(t, ops::axes<1>)); }, x);
  const auto along_columns = gradient_in_both_modes(
      [](const auto& t) { return ops::sum(ops::prod(ops::transpose<1, 0>(t), ops::axes<0>)); }, x);
  const auto apart = gradient_in_both_modes(
      [](const auto& t) {
        // [5, 4] as [5, 2, 2] with the group's axes apart: [2, 5, 2] after the transpose.
        return ops::sum(ops::prod(ops::transpose<1, 0, 2>(ops::reshape<5, 2, 2>(t)), ops::axes<0, 2>));
      },
      x);
  for (const auto* grads : {&along_rows, &along_columns, &apart}) {
    for (int mode = 0; mode < 2; ++mode) {
      INFO("layout ",
           grads == &along_rows      ? "contiguous"
           : grads == &along_columns ? "strided"
                                     : "general",
           ", mode ", mode);
      CHECK(std::vector<double>((*grads)[mode].data(), (*grads)[mode].data() + 20) == expect_rows);
    }
    CHECK(std::memcmp((*grads)[0].data(), (*grads)[1].data(), 20 * sizeof(double)) == 0);
  }
  // Central differences: the product is linear in each element, zero or not.
  D probe = x.clone();
  for (duet::index_t j = 0; j < 20; ++j) {
    const double fd = finite_difference(probe, j, [&] { return ops::sum(ops::prod(probe, ops::axes<1>)).item(); });
    CHECK(std::abs(fd - expect_rows[static_cast<std::size_t>(j)]) <= 1e-8);
  }
}

TEST_CASE("ops: prod of floats against a product in double, on every kernel path and past a run's length") {
  // [3, 3000]: runs of 1024 combined pairwise; its transpose's axis 0: the strided path, in
  // runs of 64 rows; axes 0 and 2 of [30, 3, 100]: the general path. Values near 1, so that
  // thousands of factors stay finite.
  std::mt19937 engine(11);
  std::uniform_real_distribution<float> near_one(0.995f, 1.005f);
  duet::Tensor x({3, 3000});
  for (duet::index_t i = 0; i < x.numel(); ++i) x.data()[i] = near_one(engine);
  D x_double = duet::zeros<double>(x.shape());
  std::copy_n(x.data(), x.numel(), x_double.data());
  const D expect = reference_reduce(x_double, {1}, false, Kind::prod);
  const duet::Tensor rows = ops::prod(x, ops::axes<1>);
  const duet::Tensor strided = ops::prod(ops::transpose<1, 0>(x), ops::axes<0>);
  const duet::Tensor general = ops::prod(ops::transpose<1, 0, 2>(ops::reshape<3, 30, 100>(x)), ops::axes<0, 2>);
  double worst = 0;
  for (int r = 0; r < 3; ++r) {
    for (const duet::Tensor* y : {&rows, &strided, &general}) {
      const double got = (*y)(r);
      worst = std::max(worst, std::abs(got - expect.data()[r]) / expect.data()[r]);
    }
  }
  MESSAGE("prod of 3000 floats: largest relative error ", worst);
  CHECK(worst < 1e-5);  // 3000 roundings of 2^-24, at worst; pairwise keeps it far below
  // An empty group's product is 1 (PyTorch's too), and integers multiply as integers.
  const duet::Tensor empty = ops::prod(duet::zeros<float>({0, 3}), ops::axes<0>);
  CHECK(empty.shape() == Shape{3});
  CHECK(empty(2) == 1.f);
  const duet::BasicTensor<std::int32_t> ints(Shape{2, 3}, {1, -2, 3, 4, 5, 6});
  const auto products = ops::prod(ints, {-1}, ops::keep_dims);
  CHECK(products.shape() == Shape{2, 1});
  CHECK(products(0, 0) == -6);
  CHECK(products(1, 0) == 120);
}

TEST_CASE("ops: prod refuses axes as sum does, naming itself") {
  CHECK_THROWS_WITH_AS(ops::prod(duet::ones({2, 3}), ops::axes<2>),
                       "ReduceProd(axis=2) expects an input of rank at least 3, got [2, 3]", duet::ShapeError);
  CHECK_THROWS_WITH_AS(ops::prod(duet::ones({2, 3}), {1, 1}), doctest::Contains("duet::ops::prod: the axes {1, 1}"),
                       duet::ValueError);
  CHECK_THROWS_WITH_AS(ops::prod(duet::ones({2, 3}), {0, -2}), doctest::Contains("axis 0 is named twice"),
                       duet::ShapeError);
}

}  // namespace tests_ops_reduction

namespace tests_ops_reduction {

TEST_CASE("ops: cumsum of floats adds in order along the axis, in both modes, and keeps a static shape") {
  duet_test::ModeGuard guard;
  const auto ones = ops::cumsum<-1>(duet::ones<double>(duet::shape<2, 3>));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(ones)>, duet::StaticTensor<double, 2, 3>>);
  CHECK(ones(1, 2) == 3.0);
  // [4, 1000] along its rows and its transpose's columns: each sum the float one before it plus
  // one term, the same bits as a loop doing that.
  std::mt19937 engine(12);
  std::uniform_real_distribution<float> values(-1.f, 1.f);
  duet::Tensor x({4, 1000});
  for (duet::index_t i = 0; i < x.numel(); ++i) x.data()[i] = values(engine);
  std::vector<float> expect(static_cast<std::size_t>(x.numel()));
  for (std::size_t r = 0; r < 4; ++r) {
    float sum = 0.f;
    for (std::size_t i = 0; i < 1000; ++i) expect[r * 1000 + i] = sum += x.data()[r * 1000 + i];
  }
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const duet::Tensor rows = duet::jit([](const auto& t) { return ops::cumsum<1>(t); })(x);
    const duet::Tensor columns =
        duet::jit([](const auto& t) { return ops::transpose<1, 0>(ops::cumsum<0>(ops::transpose<1, 0>(t))); })(x);
    CHECK(std::equal(expect.begin(), expect.end(), rows.data()));
    CHECK(std::equal(expect.begin(), expect.end(), columns.data()));
    const duet::Tensor empty = duet::jit([](const auto& t) { return ops::cumsum<0>(t); })(duet::zeros<float>({0, 3}));
    CHECK(empty.shape() == Shape{0, 3});
  }
}

TEST_CASE("ops: cumsum refuses an axis its input does not have, naming itself, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({3, 4}, -1, 1, 27);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto past_the_end = duet::jit([](const auto& t) { return ops::cumsum<2>(t); });
    CHECK_THROWS_WITH_AS(past_the_end(x),
                         doctest::Contains("ops::cumsum<2> expects an input of rank at least 3, got [3, 4]"),
                         duet::ShapeError);
    auto before_the_start = duet::jit([](const auto& t) { return ops::cumsum<-3>(t); });
    CHECK_THROWS_WITH_AS(before_the_start(x),
                         doctest::Contains("ops::cumsum<-3> expects an input of rank at least 3, got [3, 4]"),
                         duet::ShapeError);
  }
}

}  // namespace tests_ops_reduction
