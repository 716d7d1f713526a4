// Indexing operations (include/duet/ops/indexing.hpp): their cases in the gradient harness,
// each value computed by plain loops over multi-indices, and what the harness does not cover:
// the values and gradients PyTorch gives, the order of ties, the static shapes and the errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>

#include "ops_harness.hpp"

namespace tests_ops_indexing {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using I32 = duet::BasicTensor<std::int32_t>;
using U8 = duet::BasicTensor<std::uint8_t>;

const I32 gather_indices(Shape{2, 2}, {2, 0, 2, 1});  // 2 twice: the gradient adds both
// For x of [3, 4] along axis 0 (0 and 2 read twice), and of [2, 3, 4] along -1 ([2, 2, 3]:
// smaller than x along the other axes, as torch.gather allows).
const I32 elements_rows(Shape{2, 4}, {2, 0, 1, 2, 2, 2, 0, 0});
const I32 elements_last(Shape{2, 2, 3}, {3, 0, 3, 1, 1, 2, 0, 0, 0, 2, 3, 1});
const U8 row_mask(Shape{3}, {1, 0, 1});
const U8 wide_mask(Shape{2, 1, 3}, {0, 1, 0, 1, 1, 0});

// The positions of x's elements along `axis` in the order of their values (largest first if
// descending), ties by position, the first k: sorted by a comparison written out here.
std::vector<Index> ranked(const D& x, int axis, bool descending, index_t k, Shape& out) {
  out = x.shape();
  out[axis] = k;
  std::vector<Index> rows;
  tabulate(out, [&](const Index& o) {
    if (o[static_cast<std::size_t>(axis)] != 0) return 0.0;
    Index order(static_cast<std::size_t>(x.dim(axis)));
    std::iota(order.begin(), order.end(), index_t{0});
    const auto value = [&](index_t j) {
      Index i = o;
      i[static_cast<std::size_t>(axis)] = j;
      return at(x, i);
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](index_t p, index_t q) { return descending ? value(p) > value(q) : value(p) < value(q); });
    order.resize(static_cast<std::size_t>(k));
    rows.push_back(order);
    return 0.0;
  });
  return rows;
}

// The first k values (positions if `positions`) along `axis` in that order.
D ranked_values(const D& x, int axis, bool descending, index_t k, bool positions = false) {
  Shape out;
  const std::vector<Index> rows = ranked(x, axis, descending, k, out);
  std::size_t row = 0;
  D y = duet::zeros<double>(out);
  // The rows come in the order of their first element; each fills its elements along the axis.
  tabulate(out, [&](const Index& o) {
    if (o[static_cast<std::size_t>(axis)] != 0) return 0.0;
    const Index& order = rows[row++];
    for (index_t j = 0; j < k; ++j) {
      Index i = o;
      i[static_cast<std::size_t>(axis)] = j;
      Index from = o;
      from[static_cast<std::size_t>(axis)] = order[static_cast<std::size_t>(j)];
      index_t offset = 0;
      for (int a = 0; a < out.rank(); ++a) offset = offset * out[a] + i[static_cast<std::size_t>(a)];
      y.data()[offset] = positions ? static_cast<double>(order[static_cast<std::size_t>(j)]) : at(x, from);
    }
    return 0.0;
  });
  return y;
}

const bool indexing_cases = add_cases([](std::multimap<std::string, Case>& m) {
  auto add = [&](std::string name, Case c) { m.emplace(std::move(name), std::move(c)); };
  const auto gathered = [](const D& p, const I32& idx, int axis) {
    Shape out;
    for (int a = 0; a < axis; ++a) out.push_back(p.dim(a));
    for (index_t d : idx.shape()) out.push_back(d);
    for (int a = axis + 1; a < p.ndim(); ++a) out.push_back(p.dim(a));
    return tabulate(out, [&](const Index& o) {
      const auto r = static_cast<std::size_t>(idx.ndim());
      Index j(o.begin() + axis, o.begin() + axis + static_cast<std::ptrdiff_t>(r));
      index_t offset = 0;
      for (std::size_t a = 0; a < r; ++a) offset = offset * idx.dim(static_cast<int>(a)) + j[a];
      Index i(o.begin(), o.begin() + axis);
      i.push_back(idx.data()[offset]);
      i.insert(i.end(), o.begin() + axis + static_cast<std::ptrdiff_t>(r), o.end());
      return at(p, i);
    });
  };
  add("gather",
      checked<1>(
          {{3, 4}}, [](const auto& p, const auto& idx) { return duet::ops::gather<0>(p, idx); },
          [=](const std::vector<D>& xs) { return gathered(xs[0], gather_indices, 0); }, std::tuple{gather_indices}));
  add("gather",
      checked<1>(
          {{2, 3, 2}}, [](const auto& p, const auto& idx) { return duet::ops::gather<1>(p, idx); },
          [=](const std::vector<D>& xs) { return gathered(xs[0], gather_indices, 1); }, std::tuple{gather_indices}));
  // gather_elements: element o of the output reads x at o with the axis's index replaced.
  const auto gathered_elements = [](const D& x, const I32& idx, int axis) {
    return tabulate(idx.shape(), [&](const Index& o) {
      index_t offset = 0;
      for (int a = 0; a < idx.ndim(); ++a) offset = offset * idx.dim(a) + o[static_cast<std::size_t>(a)];
      Index i = o;
      i[static_cast<std::size_t>(axis)] = idx.data()[offset];
      return at(x, i);
    });
  };
  add("gather_elements",
      checked<1>(
          {{3, 4}}, [](const auto& x, const auto& idx) { return duet::ops::gather_elements<0>(x, idx); },
          [=](const std::vector<D>& xs) { return gathered_elements(xs[0], elements_rows, 0); },
          std::tuple{elements_rows}));
  add("gather_elements",
      checked<1>(
          {{2, 3, 4}}, [](const auto& x, const auto& idx) { return duet::ops::gather_elements<-1>(x, idx); },
          [=](const std::vector<D>& xs) { return gathered_elements(xs[0], elements_last, 2); },
          std::tuple{elements_last}));
  // one_hot of indices truncated from values drawn in [0, 5): 1 where the last axis is at the
  // index, both forms.
  const auto one_hot_case = [&](auto f) {
    Case c = make_value_case({{2, 3}}, f, [](const std::vector<D>& xs) {
      return tabulate({2, 3, 5}, [&](const Index& o) { return o[2] == index_t(at(xs[0], {o[0], o[1]})) ? 1.0 : 0.0; });
    });
    c.lo = 0;
    c.hi = 4.99;
    return c;
  };
  add("one_hot",
      one_hot_case([](const auto& x) { return duet::ops::one_hot<5, double>(duet::ops::cast<std::int32_t>(x)); }));
  add("one_hot",
      one_hot_case([](const auto& x) { return duet::ops::one_hot<double>(duet::ops::cast<std::int32_t>(x), 5); }));
  // topk, sort: the values, whose gradient is gather_elements'; argsort: the positions.
  add("topk", checked<1>(
                  {{3, 5}}, [](const auto& x) { return duet::ops::topk<2>(x).values; },
                  [](const std::vector<D>& xs) { return ranked_values(xs[0], 1, true, 2); }));
  add("topk", checked<1>(
                  {{4, 3}}, [](const auto& x) { return duet::ops::topk<0>(x, 3).values; },
                  [](const std::vector<D>& xs) { return ranked_values(xs[0], 0, true, 3); }));
  add("sort", checked<1>(
                  {{2, 3, 4}}, [](const auto& x) { return duet::ops::sort(x).values; },
                  [](const std::vector<D>& xs) { return ranked_values(xs[0], 2, false, 4); }));
  add("sort", checked<1>(
                  {{3, 2}}, [](const auto& x) { return duet::ops::sort<0>(x, true).values; },
                  [](const std::vector<D>& xs) { return ranked_values(xs[0], 0, true, 3); }));
  add("argsort", make_value_case(
                     {{3, 4}}, [](const auto& x) { return duet::ops::argsort(x); },
                     [](const std::vector<D>& xs) { return ranked_values(xs[0], 1, false, 4, true); }));
  add("argsort", make_value_case(
                     {{3, 4}}, [](const auto& x) { return duet::ops::argsort<0>(x, true); },
                     [](const std::vector<D>& xs) { return ranked_values(xs[0], 0, true, 3, true); }));
  // masked_fill: the mask broadcast over x, and x over the mask.
  const auto filled = [](const D& x, const U8& mask, double value) {
    const Shape out = duet::ops::broadcast_shapes(x.shape(), mask.shape()).shape;
    return tabulate(out, [&](const Index& o) {
      const auto read = [&](const Shape& s, auto&& element) {
        index_t offset = 0;
        for (int a = 0; a < s.rank(); ++a) {
          const std::size_t oa = static_cast<std::size_t>(out.rank() - s.rank() + a);
          offset = offset * s[a] + (s[a] == 1 ? 0 : o[oa]);
        }
        return element(offset);
      };
      const bool masked = read(mask.shape(), [&](index_t j) { return mask.data()[j] != 0; });
      return masked ? value : read(x.shape(), [&](index_t j) { return x.data()[j]; });
    });
  };
  add("masked_fill",
      checked<1>(
          {{2, 3}}, [](const auto& x, const auto& mask) { return duet::ops::masked_fill(x, mask, -1.5); },
          [=](const std::vector<D>& xs) { return filled(xs[0], row_mask, -1.5); }, std::tuple{row_mask}));
  add("masked_fill", checked<1>(
                         {{2, 3}}, [](const auto& x, const auto& mask) { return duet::ops::masked_fill(x, mask, 2); },
                         [=](const std::vector<D>& xs) { return filled(xs[0], wide_mask, 2); }, std::tuple{wide_mask}));
});

// f(x, fixed...) in each mode, jitted in graph mode: the two must be the same bits.
template <class T = float, class F, class X, class... Fixed>
std::vector<duet::BasicTensor<T>> in_both_modes(F f, const X& x, const Fixed&... fixed) {
  duet_test::ModeGuard guard;
  std::vector<duet::BasicTensor<T>> out;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    out.push_back(duet::jit(f)(x, fixed...));
  }
  CHECK(out[0].shape() == out[1].shape());
  CHECK(std::equal(out[0].data(), out[0].data() + out[0].numel(), out[1].data(),
                   [](T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }));
  return out;
}

// d sum(w * f(x, fixed...)) / dx in each mode: the two must be the same bits.
template <class F, class... Fixed>
duet::Tensor gradient_in_both_modes(F f, const duet::Tensor& x, const duet::Tensor& w, const Fixed&... fixed) {
  duet_test::ModeGuard guard;
  std::vector<duet::Tensor> grads;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto loss = [f](const auto& xs, const auto& ws, const auto&... k) { return duet::ops::sum(f(xs, k...) * ws); };
    grads.push_back(duet::value_and_grad(loss, 0)(x, w, fixed...).grads[0]);
  }
  CHECK(grads[0].shape() == grads[1].shape());
  CHECK(std::memcmp(grads[0].data(), grads[1].data(), sizeof(float) * static_cast<std::size_t>(grads[0].numel())) == 0);
  return grads[0];
}

// The largest difference between a tensor's elements and torch's.
double max_difference(const duet::Tensor& y, const std::vector<float>& torch) {
  REQUIRE(static_cast<std::size_t>(y.numel()) == torch.size());
  double most = 0;
  for (index_t i = 0; i < y.numel(); ++i) {
    most = std::max(most, std::abs(static_cast<double>(y.data()[i]) - torch[static_cast<std::size_t>(i)]));
  }
  return most;
}

}  // namespace

TEST_CASE("ops: gather_elements gives what torch.gather gives, and its gradient adds up repeated indices") {
  // x = (arange(12) - 5) / 4 as [3, 4], torch.gather(x, 0, i0) and torch.gather(x, 1, i1), and
  // x.grad of sum(y0 * w0) + sum(y1 * w1), in torch 1.13. Quarters: every sum is exact.
  duet::Tensor x(Shape{3, 4});
  for (index_t i = 0; i < 12; ++i) x.data()[i] = static_cast<float>(i - 5) / 4;
  const I32 i0(Shape{2, 4}, {2, 0, 1, 2, 2, 2, 0, 1});
  const I32 i1(Shape{3, 2}, {3, 3, 0, 1, 2, 0});
  const duet::Tensor w0(Shape{2, 4}, {1, -2, 0.5, 3, 0.25, 4, -1, 2});
  const duet::Tensor w1(Shape{3, 2}, {1, 2, -0.5, 3, 0.75, -4});
  const auto y0 =
      in_both_modes([](const auto& a, const auto& i) { return duet::ops::gather_elements<0>(a, i); }, x, i0);
  const auto y1 =
      in_both_modes([](const auto& a, const auto& i) { return duet::ops::gather_elements<-1>(a, i); }, x, i1);
  CHECK(y0[0].shape() == Shape{2, 4});
  CHECK(std::ranges::equal(y0[0].values(), std::vector<float>{0.75f, -1.0f, 0.25f, 1.5f, 0.75f, 1.0f, -0.75f, 0.5f}));
  CHECK(std::ranges::equal(y1[0].values(), std::vector<float>{-0.5f, -0.5f, -0.25f, 0.0f, 1.25f, 0.75f}));
  const duet::Tensor g0 = gradient_in_both_modes(
      [](const auto& a, const auto& i) { return duet::ops::gather_elements<0>(a, i); }, x, w0, i0);
  const duet::Tensor g1 = gradient_in_both_modes(
      [](const auto& a, const auto& i) { return duet::ops::gather_elements<1>(a, i); }, x, w1, i1);
  const std::vector<float> torch_grad{0.0f, -2.0f, -1.0f, 3.0f, -0.5f, 3.0f, 0.5f, 2.0f, -2.75f, 4.0f, 0.75f, 3.0f};
  for (index_t i = 0; i < 12; ++i) CHECK(g0.data()[i] + g1.data()[i] == torch_grad[static_cast<std::size_t>(i)]);
}

// torch.manual_seed(0); x = torch.randn(3, 6); torch.topk(x, 3) and torch.topk(x, 2, dim=0)
// with the gradients of sum(values * w), w = torch.randn of the values' shape, in torch 1.13.
const std::vector<float> topk_x{-1.1258398294448853f, -1.152360200881958f,  0.5666506290435791f,  0.7935083508491516f,
                                0.5988394618034363f,  -1.5550950765609741f, -0.3413603901863098f, 1.85300612449646f,
                                0.46809640526771545f, -0.1577124446630478f, -0.1733967512845993f, 0.18347793817520142f,
                                1.3893661499023438f,  1.586334228515625f,   0.946298360824585f,   -0.843676745891571f,
                                0.9318265914916992f,  1.2590092420578003f};

TEST_CASE("ops: topk gives torch.topk's values, indices and gradient, static and run-time k, in both modes") {
  const duet::Tensor x(Shape{3, 6}, topk_x);
  const auto values = in_both_modes([](const auto& a) { return duet::ops::topk<3>(a).values; }, x);
  const auto indices = in_both_modes<std::int32_t>([](const auto& a) { return duet::ops::topk<3>(a).indices; }, x);
  CHECK(max_difference(values[0], {0.7935083508491516f, 0.5988394618034363f, 0.5666506290435791f, 1.85300612449646f,
                                   0.46809640526771545f, 0.18347793817520142f, 1.586334228515625f, 1.3893661499023438f,
                                   1.2590092420578003f}) == 0);
  CHECK(std::ranges::equal(indices[0].values(), std::vector<std::int32_t>{3, 4, 2, 1, 2, 5, 1, 0, 5}));
  const duet::Tensor w(Shape{3, 3}, {0.40871575474739075f, 1.4214179515838623f, 0.14939700067043304f,
                                     -0.6708600521087646f, -0.2141861468553543f, -0.4319688677787781f,
                                     -0.7078776955604553f, -0.10643401741981506f, -1.2427316904067993f});
  const duet::Tensor g = gradient_in_both_modes([](const auto& a) { return duet::ops::topk<3>(a).values; }, x, w);
  CHECK(max_difference(g, {0.0f, 0.0f, 0.14939700067043304f, 0.40871575474739075f, 1.4214179515838623f, 0.0f, 0.0f,
                           -0.6708600521087646f, -0.2141861468553543f, 0.0f, 0.0f, -0.4319688677787781f,
                           -0.10643401741981506f, -0.7078776955604553f, 0.0f, 0.0f, 0.0f, -1.2427316904067993f}) == 0);

  // Along axis 0, k given at run time.
  const auto down = in_both_modes([](const auto& a) { return duet::ops::topk<0>(a, 2).values; }, x);
  const auto down_at = in_both_modes<std::int32_t>([](const auto& a) { return duet::ops::topk<0>(a, 2).indices; }, x);
  CHECK(max_difference(down[0],
                       {1.3893661499023438f, 1.85300612449646f, 0.946298360824585f, 0.7935083508491516f,
                        0.9318265914916992f, 1.2590092420578003f, -0.3413603901863098f, 1.586334228515625f,
                        0.5666506290435791f, -0.1577124446630478f, 0.5988394618034363f, 0.18347793817520142f}) == 0);
  CHECK(std::ranges::equal(down_at[0].values(), std::vector<std::int32_t>{2, 1, 2, 0, 2, 2, 1, 2, 0, 1, 0, 1}));
  const duet::Tensor w0(Shape{2, 6},
                        {-0.47623157501220703f, -0.6859184503555298f, -1.5051417350769043f, 0.25498273968696594f,
                         1.8042484521865845f, -0.450237512588501f, -0.48303207755088806f, 0.6577075719833374f,
                         0.9386566877365112f, 1.1317306756973267f, -0.6454730033874512f, -1.7702915668487549f});
  const duet::Tensor g0 = gradient_in_both_modes([](const auto& a) { return duet::ops::topk<0>(a, 2).values; }, x, w0);
  CHECK(max_difference(g0, {0.0f, 0.0f, 0.9386566877365112f, 0.25498273968696594f, -0.6454730033874512f, 0.0f,
                            -0.48303207755088806f, -0.6859184503555298f, 0.0f, 1.1317306756973267f, 0.0f,
                            -1.7702915668487549f, -0.47623157501220703f, 0.6577075719833374f, -1.5051417350769043f,
                            0.0f, 1.8042484521865845f, -0.450237512588501f}) == 0);

  // What torch returns, a pair with names: structured bindings too.
  const auto [top, at_top] = duet::ops::topk<1>(x);
  CHECK(top.shape() == Shape{3, 1});
  CHECK(std::ranges::equal(at_top.values(), std::vector<std::int32_t>{3, 1, 1}));
}

TEST_CASE("ops: sort and argsort give torch.sort(stable=True)'s order, ties by position and NaN the largest") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const duet::Tensor s(Shape{2, 6}, {1, 3, 3, 2, 3, -1, 0, nan, -2, 0, 5, -2});
  // torch.sort(s, dim, descending, stable=True).indices in torch 1.13.
  const auto up = in_both_modes<std::int32_t>([](const auto& a) { return duet::ops::argsort(a); }, s);
  CHECK(std::ranges::equal(up[0].values(), std::vector<std::int32_t>{5, 0, 3, 1, 2, 4, 2, 5, 0, 3, 4, 1}));
  const auto down = in_both_modes<std::int32_t>([](const auto& a) { return duet::ops::argsort(a, true); }, s);
  CHECK(std::ranges::equal(down[0].values(), std::vector<std::int32_t>{1, 2, 4, 3, 0, 5, 1, 4, 0, 3, 2, 5}));
  const auto columns = in_both_modes<std::int32_t>([](const auto& a) { return duet::ops::sort<0>(a).indices; }, s);
  CHECK(std::ranges::equal(columns[0].values(), std::vector<std::int32_t>{1, 0, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0}));
  const auto values = in_both_modes([](const auto& a) { return duet::ops::sort(a, true).values; }, s);
  const std::vector<float> torch_values{3, 3, 3, 2, 1, -1, nan, 5, 0, 0, -2, -2};
  for (std::size_t i = 0; i < torch_values.size(); ++i) {
    const float v = values[0].data()[i];
    CHECK((v == torch_values[i] || (std::isnan(v) && std::isnan(torch_values[i]))));
  }
  // topk keeps the ties' order too, which torch.topk does not promise ([2, 4, 1] here).
  const auto top = in_both_modes<std::int32_t>([](const auto& a) { return duet::ops::topk<3>(a).indices; }, s);
  CHECK(std::ranges::equal(top[0].values(), std::vector<std::int32_t>{1, 2, 4, 1, 4, 0}));
}

TEST_CASE("ops: masked_fill gives torch's masked_fill, the mask broadcast either way, in both modes") {
  // torch.manual_seed(0) after the topk draws; x.masked_fill(m, -1.5), x.masked_fill(m2, 2.0),
  // and x.grad of sum(y * wy) + sum(y2 * wy2), in torch 1.13.
  const duet::Tensor x(Shape{2, 3}, {0.21427294611930847f, -0.5382167100906372f, 0.5879932045936584f,
                                     1.6059457063674927f, 0.42785587906837463f, -0.67763751745224f});
  const auto y =
      in_both_modes([](const auto& a, const auto& m) { return duet::ops::masked_fill(a, m, -1.5f); }, x, row_mask);
  CHECK(std::ranges::equal(y[0].values(),
                           std::vector<float>{-1.5f, -0.5382167100906372f, -1.5f, -1.5f, 0.42785587906837463f, -1.5f}));
  const auto y2 =
      in_both_modes([](const auto& a, const auto& m) { return duet::ops::masked_fill(a, m, 2); }, x, wide_mask);
  CHECK(y2[0].shape() == Shape{2, 2, 3});
  CHECK(std::ranges::equal(y2[0].values(), std::vector<float>{0.21427294611930847f, 2.0f, 0.5879932045936584f,
                                                              1.6059457063674927f, 2.0f, -0.67763751745224f, 2.0f, 2.0f,
                                                              0.5879932045936584f, 2.0f, 2.0f, -0.67763751745224f}));
  const duet::Tensor wy(Shape{2, 3}, {1.0421911478042603f, -1.9512622356414795f, 0.41861534118652344f,
                                      3.3214149475097656f, 0.8764007091522217f, 1.2345104217529297f});
  const duet::Tensor wy2(Shape{2, 2, 3},
                         {-1.16419517993927f, -0.024031592532992363f, 0.6479946374893188f, 1.7340123653411865f,
                          -0.1335686445236206f, -0.8351086974143982f, 0.9855432510375977f, -0.005227182991802692f,
                          -0.09443804621696472f, -1.123593807220459f, -0.651263415813446f, 0.5693069696426392f});
  const duet::Tensor g = gradient_in_both_modes(
      [](const auto& a, const auto& m) { return duet::ops::masked_fill(a, m, -1.5f); }, x, wy, row_mask);
  const duet::Tensor g2 = gradient_in_both_modes(
      [](const auto& a, const auto& m) { return duet::ops::masked_fill(a, m, 2); }, x, wy2, wide_mask);
  duet::Tensor total(Shape{2, 3});
  for (index_t i = 0; i < 6; ++i) total.data()[i] = g.data()[i] + g2.data()[i];
  // torch adds the three terms of an element in another order: at most an ulp apart.
  CHECK(max_difference(total, {-1.16419517993927f, -1.9512622356414795f, 0.5535565614700317f, 1.7340123653411865f,
                               0.8764007091522217f, -0.26580172777175903f}) <= 1e-7);
}

TEST_CASE("ops: static shapes of gather_elements, topk and sort") {
  const duet::StaticTensor<float, duet::dyn, 5> x(duet::Tensor(Shape{2, 5}));
  const duet::StaticTensor<std::int32_t, duet::dyn, 2> idx(I32(Shape{2, 2}));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(duet::ops::gather_elements<1>(x, idx))>,
                               duet::StaticTensor<float, duet::dyn, 2>>);
  const auto [values, indices] = duet::ops::topk<3>(x);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(values)>, duet::StaticTensor<float, duet::dyn, 3>>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(indices)>, duet::StaticTensor<std::int32_t, duet::dyn, 3>>);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(duet::ops::sort<-1>(x).values)>,
                               duet::StaticTensor<float, duet::dyn, 5>>);
  CHECK(values.shape() == Shape{2, 3});
}

TEST_CASE("ops: gather refuses an index out of range in both modes, naming the index and the bound") {
  duet_test::ModeGuard guard;
  const D p = random_input({3, 2}, -1, 1, 8);
  for (std::int32_t bad : {3, -1}) {
    const I32 idx(Shape{2}, {0, bad});
    for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      duet::set_context({.mode = mode});
      auto gather = duet::jit([](const auto& a, const auto& i) { return duet::ops::gather<0>(a, i); });
      const std::string expected =
          "ops::gather<0>: index " + std::to_string(bad) + " (element 1 of the indices) is out of range [0, 3)";
      CHECK_THROWS_WITH_AS(gather(p, idx), doctest::Contains(expected.c_str()), duet::IndexError);
    }
  }
}

TEST_CASE("ops: gather_elements refuses an index out of range and indices that do not fit, in both modes") {
  duet_test::ModeGuard guard;
  const duet::Tensor x(Shape{3, 2});
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    INFO("mode ", static_cast<int>(mode));
    duet::set_context({.mode = mode});
    auto along_rows = duet::jit([](const auto& a, const auto& i) { return duet::ops::gather_elements<0>(a, i); });
    for (const std::int32_t bad : {3, -1}) {
      const I32 idx(Shape{1, 2}, {0, bad});
      const std::string expected = "ops::gather_elements<0>: index " + std::to_string(bad) +
                                   " (element 1 of the indices) is out of range [0, 3)";
      CHECK_THROWS_WITH_AS(along_rows(x, idx), doctest::Contains(expected.c_str()), duet::IndexError);
    }
    CHECK_THROWS_WITH_AS(
        along_rows(x, I32(Shape{2, 3})),
        doctest::Contains("ops::gather_elements<0> expects indices of its input's rank, no larger than "
                          "the input along any axis but axis 0 (torch.gather's rule), got [2, 3] for "
                          "an input of shape [3, 2]"),
        duet::ShapeError);
    CHECK_THROWS_AS(along_rows(x, I32(Shape{2})), duet::ShapeError);
  }
}

TEST_CASE("ops: topk refuses k past the axis, and a negative k, in both modes") {
  duet_test::ModeGuard guard;
  const duet::Tensor x(Shape{2, 3});
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    CHECK_THROWS_WITH_AS(
        duet::jit([](const auto& a) { return duet::ops::topk<-1>(a, 4).values; })(x),
        doctest::Contains("ops::topk<-1>(x, 4) expects an input of size at least 4 along its axis, got [2, 3]"),
        duet::ShapeError);
  }
  CHECK_THROWS_WITH_AS(duet::ops::topk(x, -1), doctest::Contains("duet::ops::topk: k -1 must be >= 0"),
                       duet::ValueError);
}

// PyTorch's Linear(F.one_hot(ids, 5).float()): an int32-input cell whose construct makes the
// one-hot rows, with the depth fixed or given at run time.
template <bool RunTimeDepth>
struct OneHotDense : duet::nn::Cell<OneHotDense<RunTimeDepth>> {
  using input_value_type = std::int32_t;
  duet::nn::Dense<5, 3> dense;
  DUET_CELL_MEMBERS(dense);
  auto construct(auto ids) {
    if constexpr (RunTimeDepth)
      return dense(duet::ops::one_hot(ids, 5));
    else
      return dense(duet::ops::one_hot<5>(ids));
  }
};

TEST_CASE_TEMPLATE("ops: one_hot feeds a Dense in an int32-input cell, the same bits in both modes", Net,
                   OneHotDense<false>, OneHotDense<true>) {
  duet_test::ModeGuard guard;
  Net net;
  const I32 ids(Shape{2, 3}, {4, 0, 2, 2, 1, 4});
  std::vector<duet::Tensor> outputs;
  std::vector<std::vector<duet::Tensor>> grads;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    outputs.push_back(net(ids));
    grads.push_back(
        duet::value_and_grad([&](const I32& x) { return duet::ops::sum(net(x)); }, net.parameters())(ids).grads);
  }
  REQUIRE(outputs[0].shape() == Shape{2, 3, 3});
  CHECK(std::equal(outputs[1].data(), outputs[1].data() + outputs[1].numel(), outputs[0].data()));
  // A one-hot row picks the weight's column at its index.
  for (index_t b = 0; b < 2; ++b) {
    for (index_t j = 0; j < 3; ++j) {
      for (index_t o = 0; o < 3; ++o) {
        CHECK(outputs[0](b, j, o) == net.dense.weight(o, ids(b, j)) + net.dense.bias(o));
      }
    }
  }
  // Column k of the weight's gradient counts the indices equal to k; the bias's, every index.
  REQUIRE(grads[0].size() == 2);
  for (std::size_t p = 0; p < 2; ++p) {
    CHECK(grads[1][p].shape() == grads[0][p].shape());
    CHECK(std::equal(grads[1][p].data(), grads[1][p].data() + grads[1][p].numel(), grads[0][p].data()));
  }
  const std::vector<float> counts{1, 1, 2, 0, 2};
  for (index_t o = 0; o < 3; ++o) {
    for (index_t k = 0; k < 5; ++k) CHECK(grads[0][0](o, k) == counts[static_cast<std::size_t>(k)]);
    CHECK(grads[0][1](o) == 6.0f);
  }
}

TEST_CASE("ops: one_hot gives what PyTorch's F.one_hot gives, for any shape of indices") {
  duet_test::ModeGuard guard;
  // F.one_hot(t, 5).flatten().tolist() in torch 1.13 (int64 there) for these [3, 2, 2] indices.
  const I32 ids(Shape{3, 2, 2}, {3, 0, 4, 1, 1, 2, 0, 0, 2, 4, 3, 3});
  const std::vector<float> torch_values{0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0,
                                        0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0,
                                        0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0};
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const duet::Tensor y = duet::jit([](const auto& i) { return duet::ops::one_hot<5>(i); })(ids);
    REQUIRE(y.shape() == Shape{3, 2, 2, 5});
    CHECK(std::ranges::equal(y.values(), torch_values));
    const duet::Tensor z = duet::jit([](const auto& i) { return duet::ops::one_hot(i, 5); })(ids);
    REQUIRE(z.shape() == Shape{3, 2, 2, 5});
    CHECK(std::ranges::equal(z.values(), torch_values));
    // A 0-d index gives a vector, empty indices an empty tensor, as torch's.
    const auto scalar = duet::ops::one_hot<4>(I32(Shape{}, {2}));
    CHECK(std::ranges::equal(scalar.values(), std::vector<float>{0, 0, 1, 0}));
    CHECK(duet::ops::one_hot(I32(Shape{0, 3}), 4).shape() == Shape{0, 3, 4});
  }
  // The static shape: the indices' with the depth at the end, the element type as asked.
  const duet::StaticTensor<std::int32_t, duet::dyn, 3> batch(I32(Shape{2, 3}, {0, 1, 2, 2, 1, 0}));
  using Out = std::remove_cvref_t<decltype(duet::ops::one_hot<4, double>(batch))>;
  static_assert(std::is_same_v<Out, duet::StaticTensor<double, duet::dyn, 3, 4>>);
}

TEST_CASE("ops: one_hot refuses an index out of range in both modes, naming the index, its place and the bound") {
  duet_test::ModeGuard guard;
  OneHotDense<false> fixed;
  OneHotDense<true> run_time;
  for (const std::int32_t bad : {5, -1}) {
    const I32 ids(Shape{2, 2}, {0, 1, bad, 3});
    for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      INFO("index ", bad, ", mode ", static_cast<int>(mode));
      duet::set_context({.mode = mode});
      const std::string where = ": index " + std::to_string(bad) + " (element 2 of the indices) is out of range [0, 5)";
      CHECK_THROWS_WITH_AS(fixed(ids), doctest::Contains(("ops::one_hot<5>" + where).c_str()), duet::IndexError);
      CHECK_THROWS_WITH_AS(run_time(ids), doctest::Contains(("ops::one_hot(indices, 5)" + where).c_str()),
                           duet::IndexError);
    }
  }
  CHECK_THROWS_WITH_AS(duet::ops::one_hot(I32(Shape{2}, {0, 1}), -2),
                       doctest::Contains("duet::ops::one_hot: the depth -2 must be >= 0"), duet::ValueError);
}

}  // namespace tests_ops_indexing
