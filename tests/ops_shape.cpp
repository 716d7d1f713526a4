// Shape operations (include/duet/ops/shape.hpp): their cases in the gradient harness, each
// with its value computed by plain loops over multi-indices, and what the harness does not
// cover: which are views, and the errors.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <tuple>

#include "ops_harness.hpp"

namespace tests_ops_shape {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using I32 = duet::BasicTensor<std::int32_t>;

// The same elements in another shape (reshape, expand_dims, squeeze).
std::function<D(const std::vector<D>&)> same_elements(Shape out) {
  return [out](const std::vector<D>& xs) { return D(out, xs[0].values()); };
}

const bool shape_cases = add_cases([](std::multimap<std::string, Case>& m) {
  auto add = [&](std::string name, Case c) { m.emplace(std::move(name), std::move(c)); };
  add("reshape", checked<1>({{3, 4}}, [](const auto& x) { return duet::ops::reshape<2, -1, 3>(x); },
                            same_elements({2, 2, 3})));
  add("reshape", checked<1>({{2, 3, 2}}, [](const auto& x) { return duet::ops::reshape<12>(x); }, same_elements({12})));
  // unflatten and flatten: an axis cut or axes merged, counted from either end, the others kept.
  add("unflatten",
      checked<1>(
          {{2, 12, 3}}, [](const auto& x) { return duet::ops::unflatten<1, 3, -1>(x); }, same_elements({2, 3, 4, 3})));
  add("unflatten", checked<1>(
                       {{2, 3, 8}}, [](const auto& x) { return duet::ops::unflatten<-1, 2, 2, 2>(x); },
                       same_elements({2, 3, 2, 2, 2})));
  add("flatten",
      checked<1>(
          {{2, 3, 4, 2}}, [](const auto& x) { return duet::ops::flatten<1, 2>(x); }, same_elements({2, 12, 2})));
  add("flatten", checked<1>(
                     {{2, 3, 4}}, [](const auto& x) { return duet::ops::flatten<0>(x); }, same_elements({24})));
  add("flatten", checked<1>(
                     {{2, 3, 4}}, [](const auto& x) { return duet::ops::flatten<-2, -1>(x); }, same_elements({2, 12})));
  add("expand_dims", checked<1>({{3, 4}}, [](const auto& x) { return duet::ops::expand_dims<1>(x); },
                                same_elements({3, 1, 4})));
  add("expand_dims", checked<1>({{3, 4}}, [](const auto& x) { return duet::ops::expand_dims<-1>(x); },
                                same_elements({3, 4, 1})));
  add("squeeze", checked<1>({{3, 1, 4, 1}}, [](const auto& x) { return duet::ops::squeeze<1>(x); },
                            same_elements({3, 4, 1})));
  add("squeeze", checked<1>({{1, 3, 1}}, [](const auto& x) { return duet::ops::squeeze<>(x); }, same_elements({3})));

  const auto transposed = [](const std::vector<D>& xs, std::vector<int> perm) {
    Shape out;
    for (int p : perm) out.push_back(xs[0].dim(p));
    return tabulate(out, [&](const Index& o) {
      Index i(o.size());
      for (std::size_t k = 0; k < o.size(); ++k) i[static_cast<std::size_t>(perm[k])] = o[k];
      return at(xs[0], i);
    });
  };
  add("transpose", checked<1>({{3, 4}}, [](const auto& x) { return duet::ops::transpose<1, 0>(x); },
                              [=](const std::vector<D>& xs) { return transposed(xs, {1, 0}); }));
  add("transpose", checked<1>({{2, 3, 4}}, [](const auto& x) { return duet::ops::transpose<2, 0, 1>(x); },
                              [=](const std::vector<D>& xs) { return transposed(xs, {2, 0, 1}); }));
  add("permute", checked<1>({{2, 3, 4}}, [](const auto& x) { return duet::ops::permute<1, 2, 0>(x); },
                            [=](const std::vector<D>& xs) { return transposed(xs, {1, 2, 0}); }));
  // The permutation given at run time: one operation for all, its gradient the inverse.
  add("transpose", checked<1>({{2, 3, 4}}, [](const auto& x) { return duet::ops::transpose(x, {2, 0, 1}); },
                              [=](const std::vector<D>& xs) { return transposed(xs, {2, 0, 1}); }));
  add("transpose", checked<1>({{2, 1, 3, 2}},
                              [](const auto& x) {
                                const std::vector<int> perm{3, 1, 0, 2};
                                return duet::ops::transpose(x, perm);
                              },
                              [=](const std::vector<D>& xs) { return transposed(xs, {3, 1, 0, 2}); }));
  // Negative axes count from the end, as PyTorch's permute(-1, 0, 1).
  add("transpose", checked<1>(
                       {{2, 3, 4}},
                       [](const auto& x) {
                         const std::vector<int> perm{-1, 0, -2};
                         return duet::ops::transpose(x, perm);
                       },
                       [=](const std::vector<D>& xs) {
                         return transposed(xs, {2, 0, 1});
                       }));
  add("permute", checked<1>(
                     {{2, 3, 4}}, [](const auto& x) { return duet::ops::permute<-1, 0, -2>(x); },
                     [=](const std::vector<D>& xs) {
                       return transposed(xs, {2, 0, 1});
                     }));

  // Along `axis`, the inputs one after the other.
  const auto concatenated = [](const std::vector<D>& xs, int axis) {
    Shape out = xs[0].shape();
    for (std::size_t k = 1; k < xs.size(); ++k) out[axis] += xs[k].dim(axis);
    return tabulate(out, [&](const Index& o) {
      Index i = o;
      std::size_t k = 0;
      index_t& along = i[static_cast<std::size_t>(axis)];
      while (along >= xs[k].dim(axis)) along -= xs[k++].dim(axis);
      return at(xs[k], i);
    });
  };
  add("concat", checked<2>({{2, 3}, {4, 3}}, [](const auto& a, const auto& b) { return duet::ops::concat<0>(a, b); },
                           [=](const std::vector<D>& xs) { return concatenated(xs, 0); }));
  add("concat", checked<3>({{2, 1, 3}, {2, 2, 3}, {2, 3, 3}},
                           [](const auto& a, const auto& b, const auto& c) { return duet::ops::concat<1>(a, b, c); },
                           [=](const std::vector<D>& xs) { return concatenated(xs, 1); }));
  add("concat", checked<2>({{2, 3}, {2, 2}}, [](const auto& a, const auto& b) { return duet::ops::concat<-1>(a, b); },
                           [=](const std::vector<D>& xs) { return concatenated(xs, 1); }));

  // Output element o reads x at o modulo x's size along each axis, x's shape taken with size-1
  // axes in front up to the output's rank (numpy's tile).
  const auto tiled = [](const D& x, Index multiples) {
    const std::size_t rank = std::max(multiples.size(), static_cast<std::size_t>(x.ndim()));
    multiples.insert(multiples.begin(), rank - multiples.size(), 1);
    Index size(rank - static_cast<std::size_t>(x.ndim()), 1);
    for (index_t d : x.shape()) size.push_back(d);
    Shape out;
    for (std::size_t a = 0; a < rank; ++a) out.push_back(size[a] * multiples[a]);
    return tabulate(out, [&](const Index& o) {
      Index i;
      for (std::size_t a = rank - static_cast<std::size_t>(x.ndim()); a < rank; ++a) i.push_back(o[a] % size[a]);
      return at(x, i);
    });
  };
  const auto add_tile = [&](Shape shape, auto f, Index multiples) {
    add("tile", checked<1>({shape}, f, [=](const std::vector<D>& xs) { return tiled(xs[0], multiples); }));
  };
  add_tile({2, 3}, [](const auto& x) { return duet::ops::tile<2, 3>(x); }, {2, 3});
  // Fewer multiples than axes: the last ones; more: new axes in front.
  add_tile({2, 3}, [](const auto& x) { return duet::ops::tile<2>(x); }, {2});
  add_tile({2, 3}, [](const auto& x) { return duet::ops::tile<2, 1, 2>(x); }, {2, 1, 2});
  add_tile({2, 1, 3}, [](const auto& x) { return duet::ops::tile<1, 4, 1>(x); }, {1, 4, 1});
  add_tile({3}, [](const auto& x) { return duet::ops::tile<1, 1>(x); }, {1, 1});
  // The multiples given at run time: one operation for every list.
  add_tile({3, 2}, [](const auto& x) { return duet::ops::tile(x, {2, 1, 3}); }, {2, 1, 3});
  add_tile({2, 2, 3}, [](const auto& x) { return duet::ops::tile(x, std::vector<duet::index_t>{3, 2}); }, {3, 2});

  // Output element o reads x at o with each flipped axis a's index i replaced by size - 1 - i.
  const auto flipped = [](const D& x, std::vector<int> axes) {
    return tabulate(x.shape(), [&](const Index& o) {
      Index i = o;
      for (int axis : axes) {
        const auto a = static_cast<std::size_t>(axis < 0 ? axis + x.ndim() : axis);
        i[a] = x.shape()[static_cast<int>(a)] - 1 - o[a];
      }
      return at(x, i);
    });
  };
  const auto add_flip = [&](Shape shape, auto f, std::vector<int> axes) {
    add("flip", checked<1>({shape}, f, [=](const std::vector<D>& xs) { return flipped(xs[0], axes); }));
  };
  add_flip({2, 3, 4}, [](const auto& x) { return duet::ops::flip<0>(x); }, {0});
  add_flip({2, 3, 4}, [](const auto& x) { return duet::ops::flip<-1>(x); }, {-1});
  add_flip({2, 3, 4}, [](const auto& x) { return duet::ops::flip<2, 0>(x); }, {2, 0});
  add_flip({3, 1, 2}, [](const auto& x) { return duet::ops::flip<0, 1, -1>(x); }, {0, 1, -1});
  add_flip({5}, [](const auto& x) { return duet::ops::flip<0>(x); }, {0});

  const auto stacked = [](const std::vector<D>& xs, int axis) {
    Shape out;
    for (int a = 0; a <= xs[0].ndim(); ++a) {
      out.push_back(a == axis ? static_cast<index_t>(xs.size()) : xs[0].dim(a < axis ? a : a - 1));
    }
    return tabulate(out, [&](const Index& o) {
      Index i = o;
      i.erase(i.begin() + axis);
      return at(xs[static_cast<std::size_t>(o[static_cast<std::size_t>(axis)])], i);
    });
  };
  add("stack", checked<2>({{2, 3}, {2, 3}}, [](const auto& a, const auto& b) { return duet::ops::stack<0>(a, b); },
                          [=](const std::vector<D>& xs) { return stacked(xs, 0); }));
  add("stack", checked<3>({{2, 3}, {2, 3}, {2, 3}},
                          [](const auto& a, const auto& b, const auto& c) { return duet::ops::stack<-1>(a, b, c); },
                          [=](const std::vector<D>& xs) { return stacked(xs, 2); }));

  // Element o of a slice is x at begin + o * stride along each axis.
  const auto sliced = [](const D& x, Shape out, Index begin, Index stride) {
    return tabulate(out, [&](const Index& o) {
      Index i = o;
      for (std::size_t a = 0; a < o.size(); ++a) i[a] = begin[a] + o[a] * stride[a];
      return at(x, i);
    });
  };
  add("split", checked<1>({{5, 3}}, [](const auto& x) { return std::get<0>(duet::ops::split<0, 2, 3>(x)); },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 3}, {0, 0}, {1, 1}); }));
  add("split", checked<1>({{5, 3}}, [](const auto& x) { return std::get<1>(duet::ops::split<0, 2, 3>(x)); },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {3, 3}, {2, 0}, {1, 1}); }));
  add("split", checked<1>({{2, 6}}, [](const auto& x) { return std::get<1>(duet::ops::split<1, 1, 4, 1>(x)); },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 4}, {0, 1}, {1, 1}); }));
  // Both pieces used: x's gradient is the sum of each piece's.
  add("split", checked<1>({{4, 3}},
                          [](const auto& x) {
                            const auto [a, b] = duet::ops::split<0, 2, 2>(x);
                            return a * b;
                          },
                          [=](const std::vector<D>& xs) {
                            return tabulate({2, 3},
                                            [&](const Index& o) { return at(xs[0], o) * at(xs[0], {o[0] + 2, o[1]}); });
                          }));

  // chunk: pieces of ceil(size / N), the last smaller; on these (run-time) tensors, N slices.
  const auto add_piece = [&](Shape shape, auto f, Shape out, Index begin) {
    const Index ones(begin.size(), 1);
    add("chunk", checked<1>({shape}, f, [=](const std::vector<D>& xs) { return sliced(xs[0], out, begin, ones); }));
  };
  add_piece({7, 2}, [](const auto& x) { return std::get<0>(duet::ops::chunk<0, 3>(x)); }, {3, 2}, {0, 0});
  add_piece({7, 2}, [](const auto& x) { return std::get<2>(duet::ops::chunk<0, 3>(x)); }, {1, 2}, {6, 0});
  add_piece({2, 10}, [](const auto& x) { return std::get<3>(duet::ops::chunk<-1, 4>(x)); }, {2, 1}, {0, 9});
  // Both pieces used, in the other order.
  const auto swapped = [=](const std::vector<D>& xs) {
    return tabulate({2, 5, 2}, [&](const Index& o) { return at(xs[0], {o[0], o[1] < 2 ? o[1] + 3 : o[1] - 2, o[2]}); });
  };
  const auto chunk_swapped = [](const auto& x) {
    const auto [a, b] = duet::ops::chunk<1, 2>(x);
    return duet::ops::concat<1>(b, a);
  };
  add("chunk", checked<1>({{2, 5, 2}}, chunk_swapped, swapped));

  using duet::ops::ints;
  // A view of a view, each beginning further in.
  add("slice", checked<1>({{4, 3}},
                          [](const auto& x) {
                            return duet::ops::slice(std::get<1>(duet::ops::split<0, 1, 3>(x)), ints<1>, ints<2>);
                          },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 3}, {2, 0}, {1, 1}); }));
  add("slice", checked<1>({{4, 5}}, [](const auto& x) { return duet::ops::slice(x, ints<1, 2>, ints<2, -1>); },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 3}, {1, 2}, {1, 1}); }));
  add("slice", checked<1>({{4, 5}}, [](const auto& x) { return duet::ops::slice(x, ints<1>, ints<2>); },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 5}, {1, 0}, {1, 1}); }));
  add("strided_slice",
      checked<1>({{5, 6}},
                 [](const auto& x) { return duet::ops::strided_slice(x, ints<0, 1>, ints<5, 6>, ints<2, 2>); },
                 [=](const std::vector<D>& xs) { return sliced(xs[0], {3, 3}, {0, 1}, {2, 2}); }));
  // Negative indices count from the end; a negative stride walks backwards.
  add("strided_slice",
      checked<1>({{4, 6}},
                 [](const auto& x) { return duet::ops::strided_slice(x, ints<-1, 1>, ints<-5, -1>, ints<-1, 3>); },
                 [=](const std::vector<D>& xs) { return sliced(xs[0], {4, 2}, {3, 1}, {-1, 3}); }));
  // to_end with a negative stride runs past the first element: x[2::-1, -1::-2].
  add("strided_slice", checked<1>({{4, 6}},
                                  [](const auto& x) {
                                    using duet::ops::to_end;
                                    return duet::ops::strided_slice(x, ints<2, -1>, ints<to_end, to_end>, ints<-1, -2>);
                                  },
                                  [=](const std::vector<D>& xs) { return sliced(xs[0], {3, 3}, {2, 5}, {-1, -2}); }));

  // take<Axis, Index>: x[:, i] of PyTorch, the axis dropped; from the start or the end.
  const auto taken = [](const D& x, Shape out, int axis, index_t index) {
    return tabulate(out, [&](const Index& o) {
      Index i = o;
      i.insert(i.begin() + axis, index);
      return at(x, i);
    });
  };
  add("take", checked<1>({{2, 5, 3}}, [](const auto& x) { return duet::ops::take<1, -1>(x); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {2, 3}, 1, 4); }));
  add("take", checked<1>({{2, 5, 3}}, [](const auto& x) { return duet::ops::take<1, -2>(x); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {2, 3}, 1, 3); }));
  add("take", checked<1>({{2, 5, 3}}, [](const auto& x) { return duet::ops::take<1, 0>(x); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {2, 3}, 1, 0); }));
  add("take", checked<1>({{4, 3}}, [](const auto& x) { return duet::ops::take<0, 2>(x); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {3}, 0, 2); }));
  // The index given at run time: the same slices.
  add("take", checked<1>({{2, 5, 3}}, [](const auto& x) { return duet::ops::take<1>(x, -1); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {2, 3}, 1, 4); }));
  add("take", checked<1>({{2, 5, 3}}, [](const auto& x) { return duet::ops::take<1>(x, -3); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {2, 3}, 1, 2); }));
  add("take", checked<1>({{2, 5, 3}}, [](const auto& x) { return duet::ops::take<2>(x, 1); },
                         [=](const std::vector<D>& xs) { return taken(xs[0], {2, 5}, 2, 1); }));
  add("take", checked<1>({{2, 3, 4}}, [](const auto& x) { return duet::ops::take<2, -1>(x) * duet::ops::take<2, 1>(x); },
                         [=](const std::vector<D>& xs) {
                           return tabulate({2, 3}, [&](const Index& o) {
                             return at(xs[0], {o[0], o[1], 3}) * at(xs[0], {o[0], o[1], 1});
                           });
                         }));

  // The window given at run time: one operation for every window, the same rules.
  add("slice", checked<1>({{4, 5}}, [](const auto& x) { return duet::ops::slice(x, {1, 2}, {2, -1}); },
                          [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 3}, {1, 2}, {1, 1}); }));
  add("strided_slice",
      checked<1>({{4, 6}}, [](const auto& x) { return duet::ops::strided_slice(x, {-1, 1}, {-5, -1}, {-1, 3}); },
                 [=](const std::vector<D>& xs) { return sliced(xs[0], {4, 2}, {3, 1}, {-1, 3}); }));
  add("strided_slice", checked<1>({{2, 4, 6}},
                                  [](const auto& x) {
                                    using duet::ops::to_end;
                                    const std::vector<duet::index_t> begin{0, 2, -1}, end{to_end, to_end, to_end},
                                        strides{1, -1, -2};
                                    return duet::ops::strided_slice(x, begin, end, strides);
                                  },
                                  [=](const std::vector<D>& xs) { return sliced(xs[0], {2, 3, 3}, {0, 2, 5}, {1, -1, -2}); }));

  // positions: the indices along one axis, whatever the values.
  const auto counting = [](index_t n) {
    D out = duet::zeros<double>(Shape{n});
    for (index_t i = 0; i < n; ++i) out.data()[i] = static_cast<double>(i);
    return out;
  };
  add("positions", make_value_case({{3, 5}}, [](const auto& x) { return duet::ops::positions<1>(x); },
                                   [=](const std::vector<D>&) { return counting(5); }));
  add("positions", make_value_case({{2, 3, 4}}, [](const auto& x) { return duet::ops::positions<0>(x); },
                                   [=](const std::vector<D>&) { return counting(2); }));
  add("positions", make_value_case(
                       {{2, 3, 4}}, [](const auto& x) { return duet::ops::positions<-2>(x); },
                       [=](const std::vector<D>&) { return counting(3); }));
});

template <class F>
struct Net : duet::nn::Cell<Net<F>, duet::CONTEXT_MODE, double> {
  auto construct(auto x) { return F{}(x); }
};

struct ReshapeTo6x2 {
  auto operator()(const auto& x) const { return duet::ops::reshape<6, 2>(x); }
};
struct SqueezeExpand {
  auto operator()(const auto& x) const { return duet::ops::squeeze<0>(duet::ops::expand_dims<0>(x)); }
};
struct SliceRows {
  auto operator()(const auto& x) const { return duet::ops::slice(x, duet::ops::ints<1>, duet::ops::ints<2>); }
};
struct TransposeIt {
  auto operator()(const auto& x) const { return duet::ops::transpose<1, 0>(x); }
};

}  // namespace

TEST_CASE("ops: reshape, expand_dims, squeeze and slices of the first axis are views of their input in PyNative") {
  using duet::ops::ints;
  const D x = random_input({3, 4}, -1, 1, 3);
  CHECK(std::get<1>(duet::ops::split<0, 1, 2>(x)).data() == x.data() + 4);
  CHECK(duet::ops::slice(x, ints<2>, ints<1>).data() == x.data() + 8);
  CHECK(duet::ops::strided_slice(x, ints<-2, 0>, ints<3, duet::ops::to_end>, ints<1, 1>).data() == x.data() + 4);
  // Along another axis, or with a step, the elements are not one run: a copy.
  CHECK_FALSE(std::get<1>(duet::ops::split<1, 1, 3>(x)).shares_storage_with(x));
  CHECK_FALSE(duet::ops::strided_slice(x, ints<0>, ints<3>, ints<2>).shares_storage_with(x));
  CHECK(duet::ops::reshape<2, -1>(x).data() == x.data());
  CHECK(duet::ops::reshape<2, -1>(x).shape() == Shape{2, 6});
  CHECK(duet::ops::unflatten<1, 2, -1>(x).data() == x.data());
  CHECK(duet::ops::unflatten<1, 2, -1>(x).shape() == Shape{3, 2, 2});
  CHECK(duet::ops::flatten<0>(x).data() == x.data());
  CHECK(duet::ops::flatten<0>(x).shape() == Shape{12});
  CHECK(duet::ops::expand_dims<0>(x).data() == x.data());
  CHECK(duet::ops::squeeze<>(duet::ops::expand_dims<2>(x)).data() == x.data());
  // A transpose copies: a row-major block cannot hold the other order.
  CHECK(duet::ops::transpose<1, 0>(x).data() != x.data());
}

TEST_CASE("ops: graph_ir shows reshape, expand_dims and squeeze as views, transpose as a copy") {
  duet_test::ModeGuard guard;
  Net<ReshapeTo6x2> reshape;
  const std::string r = duet::graph_ir(reshape, duet::shape<3, 4>).captured.text;
  CHECK(r.find("Reshape<6, 2>(%0) : [6, 2]  [view of %0]") != std::string::npos);
  Net<SqueezeExpand> squeeze;
  const std::string s = duet::graph_ir(squeeze, duet::shape<3, 4>).captured.text;
  CHECK(s.find("ExpandDims<0>(%0) : [1, 3, 4]  [view of %0]") != std::string::npos);
  CHECK(s.find("Squeeze<0>(%1) : [3, 4]  [view of %0]") != std::string::npos);
  Net<TransposeIt> transpose;
  const std::string t = duet::graph_ir(transpose, duet::shape<3, 4>).captured.text;
  CHECK(t.find("Transpose<1, 0>(%0) : [4, 3]  [output]") != std::string::npos);
  Net<SliceRows> slice;
  const std::string sl = duet::graph_ir(slice, duet::shape<3, 4>).captured.text;
  CHECK(sl.find("Slice<[1], [2]>(%0) : [2, 4]  [view of %0]") != std::string::npos);  // begin, size
  // And in graph mode the output of a reshape-only network is the input's block.
  duet::set_context({.mode = duet::GRAPH_MODE});
  const D x = random_input({3, 4}, -1, 1, 4);
  CHECK(reshape(x).data() == x.data());
  CHECK(slice(x).data() == x.data() + 4);
}

TEST_CASE("ops: unflatten and flatten keep the other axes, sizes known only at run time included, in both modes") {
  duet_test::ModeGuard guard;
  namespace ops = duet::ops;
  // The PyTorch attention idiom q.view(B, T, H, dh).transpose(1, 2) and back, at two lengths.
  auto heads = duet::jit([](const auto& t) {
    return ops::flatten<-2, -1>(ops::transpose<0, 2, 1, 3>(ops::transpose<0, 2, 1, 3>(ops::unflatten<-1, 4, -1>(t))));
  });
  auto merged = duet::jit([](const auto& t) { return ops::flatten<1, 2>(ops::unflatten<1, 2, -1>(t)); });
  for (index_t length : {5, 2}) {
    const D x = random_input({2, length, 8}, -1, 1, 11);
    std::vector<D> out;
    for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      duet::set_context({.mode = mode});
      out.push_back(heads(x));
      CHECK(out.back().shape() == x.shape());
      CHECK(std::equal(x.data(), x.data() + x.numel(), out.back().data()));
      CHECK(ops::unflatten<-1, 4, 2>(x).shape() == Shape{2, length, 4, 2});
      CHECK(ops::unflatten<0, 1, 2, 1>(x).shape() == Shape{1, 2, 1, length, 8});
      CHECK(ops::flatten<0, 1>(x).shape() == Shape{2 * length, 8});
    }
    const D even = random_input({3, 2 * length, 2}, -1, 1, 12);
    duet::set_context({.mode = duet::GRAPH_MODE});
    CHECK(merged(even).data() == even.data());
  }
  // Static shapes: the result is known at compile time; an unknown size stays unknown.
  using duet::dyn;
  CHECK(ops::unflatten_rule(Shape{dyn, dyn, 32}, -1, Shape{4, dyn}).shape == Shape{dyn, dyn, 4, 8});
  CHECK(ops::unflatten_rule(Shape{2, dyn}, 1, Shape{4, dyn}).shape == Shape{2, 4, dyn});
  CHECK(ops::flatten_rule(Shape{dyn, 3, 4}, 1, -1).shape == Shape{dyn, 12});
  CHECK(ops::flatten_rule(Shape{2, dyn, 4}, 0, 1).shape == Shape{dyn, 4});
  CHECK(ops::flatten_rule(Shape{}, 0, -1).shape == Shape{1});
  // ops::flatten(x), no axes, is nn::Flatten's: the batch axis kept.
  CHECK(ops::flatten(random_input({2, 3, 4}, -1, 1, 13)).shape() == Shape{2, 12});
}

TEST_CASE("ops: split returns one slice per piece, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({5, 2}, -1, 1, 5);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto f = duet::jit([](const auto& t) { return std::get<2>(duet::ops::split<0, 1, 1, 3>(t)); });
    const D y = f(x);
    REQUIRE(y.shape() == Shape{3, 2});
    CHECK(std::equal(y.data(), y.data() + 6, x.data() + 4));
  }
}

TEST_CASE("ops: shape errors name the operation and the shapes, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({3, 4}, -1, 1, 6);
  const D y = random_input({2, 5}, -1, 1, 7);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const auto expect = [](auto&& call, const char* message) {
      CHECK_THROWS_WITH_AS(call(), doctest::Contains(message), duet::ShapeError);
    };
    auto reshape = duet::jit([](const auto& t) { return duet::ops::reshape<5, 2>(t); });
    expect([&] { return reshape(x); }, "ops::reshape<5, 2> expects an input of 10 elements, got [3, 4]");
    auto inferred = duet::jit([](const auto& t) { return duet::ops::reshape<5, -1>(t); });
    expect([&] { return inferred(x); },
           "ops::reshape<5, -1> expects an input whose element count is a multiple of 5, got [3, 4]");
    auto unflatten = duet::jit([](const auto& t) { return duet::ops::unflatten<1, 3, -1>(t); });
    expect([&] { return unflatten(y); },
           "ops::unflatten<1, 3, -1> expects an input whose size along its axis is a multiple of 3, got [2, 5]");
    auto unflatten_sizes = duet::jit([](const auto& t) { return duet::ops::unflatten<-1, 2, 3>(t); });
    expect([&] { return unflatten_sizes(x); },
           "ops::unflatten<-1, 2, 3> expects an input of size 6 along its axis, got [3, 4]");
    auto unflatten_axis = duet::jit([](const auto& t) { return duet::ops::unflatten<2, 2, 2>(t); });
    expect([&] { return unflatten_axis(x); },
           "ops::unflatten<2, 2, 2> expects an input of rank at least 3, got [3, 4]");
    auto flatten_order = duet::jit([](const auto& t) { return duet::ops::flatten<-1, 0>(t); });
    expect(
        [&] { return flatten_order(x); },
        "ops::flatten<-1, 0> expects an input whose end axis does not come before its start axis, axis 1, got [3, 4]");
    auto flatten_axis = duet::jit([](const auto& t) { return duet::ops::flatten<0, 2>(t); });
    expect([&] { return flatten_axis(x); }, "ops::flatten<0, 2> expects an input of rank at least 3, got [3, 4]");
    auto concat = duet::jit([](const auto& a, const auto& b) { return duet::ops::concat<0>(a, b); });
    expect([&] { return concat(x, y); },
           "ops::concat<0> expects inputs of one rank whose sizes match except along axis 0, got [3, 4], [2, 5]");
    auto transpose = duet::jit([](const auto& t) { return duet::ops::transpose<0, 2, 1>(t); });
    expect([&] { return transpose(x); }, "ops::transpose<0, 2, 1> expects an input of rank 3, got [3, 4]");
    auto permuted = duet::jit([](const auto& t) { return duet::ops::transpose(t, {0, 2, 1}); });
    expect([&] { return permuted(x); }, "ops::transpose(x, {0, 2, 1}) expects an input of rank 3, got [3, 4]");
    auto squeeze = duet::jit([](const auto& t) { return duet::ops::squeeze<1>(t); });
    expect([&] { return squeeze(x); }, "ops::squeeze<1> expects an input whose axis 1 has size 1, got [3, 4]");
    auto split = duet::jit([](const auto& t) { return std::get<0>(duet::ops::split<1, 2, 3>(t)); });
    expect([&] { return split(x); }, "expects an input of size 5 along its axis, got [3, 4]");
    auto slice = duet::jit([](const auto& t) { return duet::ops::slice(t, duet::ops::ints<2>, duet::ops::ints<2>); });
    expect([&] { return slice(x); },
           "ops::slice<[2], [2]> expects an input whose axis 0 holds the slice's range, got [3, 4]");
    auto taken = duet::jit([](const auto& t) { return duet::ops::take<1, 4>(t); });
    expect([&] { return taken(x); },
           "ops::slice<[0, 4], [-1, 1]> expects an input whose axis 1 holds the slice's range, got [3, 4]");
    auto taken_later = duet::jit([](const auto& t) { return duet::ops::take<1>(t, 4); });
    expect([&] { return taken_later(x); },
           "ops::slice(x, {0, 4}, {-1, 1}) expects an input whose axis 1 holds the slice's range, got [3, 4]");
    auto taken_rank = duet::jit([](const auto& t) { return duet::ops::take<2, -1>(t); });
    expect([&] { return taken_rank(x); }, "expects an input of rank at least 3, got [3, 4]");
    auto window = duet::jit([](const auto& t) { return duet::ops::slice(t, {0, 2}, {2, 3}); });
    expect([&] { return window(x); },
           "ops::slice(x, {0, 2}, {2, 3}) expects an input whose axis 1 holds the slice's range, got [3, 4]");
    auto deep = duet::jit([](const auto& t) { return duet::ops::strided_slice(t, {0, 0, 0}, {1, 1, 1}, {1, 1, 1}); });
    expect([&] { return deep(x); }, "expects an input of rank at least 3, got [3, 4]");
    auto summed = duet::jit([](const auto& t) { return duet::ops::sum(t, {0, 2}); });
    expect([&] { return summed(x); }, "ReduceSum(axis=0,2) expects an input of rank at least 3, got [3, 4]");
    // Two names of one axis, which numpy refuses too.
    auto twice = duet::jit([](const auto& t) { return duet::ops::mean(t, {0, -2}); });
    expect([&] { return twice(x); },
           "ReduceMean(axis=0,-2) expects axes that name each axis of its input once (axis 0 is named twice, counted "
           "from both ends), got [3, 4]");
    auto twice_typed = duet::jit([](const auto& t) { return duet::ops::max(t, duet::ops::axes<1, -1>); });
    expect([&] { return twice_typed(x); }, "axis 1 is named twice");
  }
}

TEST_CASE("ops: slices and reductions given at run time are the compile-time ones' bits, in both modes") {
  duet_test::ModeGuard guard;
  namespace ops = duet::ops;
  using ops::ints;
  const D x = random_input({4, 5, 6}, -1, 1, 12);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const auto same = [&](auto given, auto typed) {
      const D a = duet::jit(given)(x);
      const D b = duet::jit(typed)(x);
      REQUIRE(a.shape() == b.shape());
      CHECK(std::equal(a.data(), a.data() + a.numel(), b.data()));
    };
    same([](const auto& t) { return ops::slice(t, {1, 0, 2}, {2, -1, 3}); },
         [](const auto& t) { return ops::slice(t, ints<1, 0, 2>, ints<2, -1, 3>); });
    same([](const auto& t) { return ops::strided_slice(t, {-1, 4}, {0, 0}, {-2, -3}); },
         [](const auto& t) { return ops::strided_slice(t, ints<-1, 4>, ints<0, 0>, ints<-2, -3>); });
    same([](const auto& t) { return ops::mean(t, {-1, 0}, ops::keep_dims); },
         [](const auto& t) { return ops::mean(t, ops::axes<-1, 0>, ops::keep_dims); });
    same([](const auto& t) { return ops::max(t, {1}); }, [](const auto& t) { return ops::max(t, ops::axes<1>); });
    same([](const auto& t) { return ops::prod(t, {0}); }, [](const auto& t) { return ops::prod(t, ops::axes<0>); });
    same([](const auto& t) { return ops::var(t, {1}, ops::keep_dims); },
         [](const auto& t) { return ops::var(t, ops::axes<1>, ops::keep_dims); });
    same([](const auto& t) { return ops::std(t, {0, 1}); }, [](const auto& t) { return ops::std(t, ops::axes<0, 1>); });
    same([](const auto& t) { return ops::logsumexp(t, {-1}); },
         [](const auto& t) { return ops::logsumexp(t, ops::axes<-1>); });
    same([](const auto& t) { return ops::sum(t, std::span<const int>()); }, [](const auto& t) { return ops::sum(t); });
  }
  // The lists themselves are checked where they are given.
  CHECK_THROWS_WITH_AS(ops::sum(x, {1, 1}), doctest::Contains("must be distinct"), duet::ValueError);
  CHECK_THROWS_WITH_AS(ops::strided_slice(x, {0}, {1}, {0}), doctest::Contains("a stride cannot be 0"), duet::ValueError);
  CHECK_THROWS_WITH_AS(ops::slice(x, {0, 1}, {1}), doctest::Contains("one entry per axis"), duet::ValueError);
  CHECK_THROWS_WITH_AS(ops::slice(x, {-1}, {1}), doctest::Contains("begin must be >= 0"), duet::ValueError);
}

TEST_CASE("ops: transpose refuses a run-time perm that is not a permutation, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({3, 4}, -1, 1, 8);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    // {1, -1}: axis 1 twice, once counted from the end; {-3, 0}: before the first of two.
    for (const std::vector<int>& perm :
         std::vector<std::vector<int>>{{0, 0}, {1, 2}, {1, -1}, {-3, 0}, {0, 1, 2, 3, 4, 5, 6, 7, 8}}) {
      auto f = duet::jit([&](const auto& t) { return duet::ops::transpose(t, perm); });
      CHECK_THROWS_WITH_AS(f(x), doctest::Contains("is not a permutation of 0, 1, ..., rank - 1"), duet::ValueError);
    }
  }
}

// A language model's input: token and position embeddings, the positions made from the ids,
// so that one compiled graph serves every sequence length.
struct TokensAndPositions : duet::nn::Cell<TokensAndPositions> {
  duet::nn::Embedding<11, 4> tokens;
  duet::nn::Embedding<8, 4> positions;
  DUET_CELL_MEMBERS(tokens, positions);
  using input_value_type = std::int32_t;
  auto construct(auto ids) { return tokens(ids) + positions(duet::ops::positions<1>(ids)); }
};

TEST_CASE("ops: positions feed a positional Embedding in both modes, for any sequence length") {
  duet_test::ModeGuard guard;
  TokensAndPositions net;
  for (const index_t t : {3, 5}) {
    INFO("length ", t);
    I32 ids(Shape{2, t});
    for (index_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>((3 * i + 1) % 11);
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    const duet::Tensor pynative = net(ids);
    duet::set_context({.mode = duet::GRAPH_MODE});
    const duet::Tensor graph = net(ids);
    REQUIRE(pynative.shape() == Shape{2, t, 4});
    CHECK(std::equal(graph.data(), graph.data() + graph.numel(), pynative.data()));
    for (index_t b = 0; b < 2; ++b) {
      for (index_t j = 0; j < t; ++j) {
        for (index_t k = 0; k < 4; ++k) {
          const float want = net.tokens.embedding_table(ids(b, j), k) + net.positions.embedding_table(j, k);
          CHECK(pynative(b, j, k) == want);
        }
      }
    }
  }
  // The position table trains: row j's gradient is the sum of dy over the batch at position j.
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    I32 ids(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
    const auto grads = duet::value_and_grad([&](const I32& x) { return duet::ops::sum(net(x)); },
                                            net.positions.parameters())(ids)
                           .grads;
    REQUIRE(grads.size() == 1);
    for (index_t j = 0; j < 8; ++j) CHECK(grads[0](j, 0) == (j < 3 ? 2.0f : 0.0f));
  }
}

TEST_CASE("ops: PIJit replays views that begin inside their input, as the output and in between") {
  using duet::ops::ints;
  const auto rows = [](const D& x) { return duet::ops::slice(x * 2.0, ints<1>, ints<2>); };
  const auto through = [](const D& x) { return std::get<1>(duet::ops::split<0, 1, 2>(x * 2.0)) * 3.0; };
  auto f = duet::jit([&](const D& x) { return rows(x); }, {.mode = duet::JitMode::PIJit, .name = "rows"});
  auto g = duet::jit([&](const D& x) { return through(x); }, {.mode = duet::JitMode::PIJit, .name = "through"});
  for (std::uint64_t seed : {1, 2, 3}) {
    const D x = random_input({3, 4}, -1, 1, seed);
    const D fx = f(x);
    const D gx = g(x);
    const D f_eager = rows(x);
    const D g_eager = through(x);
    REQUIRE(fx.shape() == f_eager.shape());
    REQUIRE(gx.shape() == g_eager.shape());
    CHECK(std::equal(fx.data(), fx.data() + fx.numel(), f_eager.data()));
    CHECK(std::equal(gx.data(), gx.data() + gx.numel(), g_eager.data()));
  }
  CHECK(f.compile_count() == 1);
  CHECK(g.compile_count() == 1);
}

namespace {
// The rows of each piece chunk<0, N> makes of a static [Size, 2], each piece checked to be x's
// rows from where the pieces before it end, and a static tensor (split's pieces).
template <index_t Size, index_t N>
std::vector<index_t> static_chunk_rows() {
  const duet::StaticTensor<double, Size, 2> x(random_input({Size, 2}, -1, 1, 20));
  std::vector<index_t> rows;
  index_t row = 0;
  const auto each = [&](const auto& piece) {
    static_assert(duet::is_static_tensor_v<std::remove_cvref_t<decltype(piece)>>);
    CHECK(std::equal(piece.data(), piece.data() + piece.numel(), x.data() + row * 2));
    rows.push_back(piece.shape()[0]);
    row += piece.shape()[0];
  };
  std::apply([&](const auto&... piece) { (each(piece), ...); }, duet::ops::chunk<0, N>(x));
  CHECK(row == Size);
  return rows;
}
}  // namespace

TEST_CASE("ops: chunk cuts a static size as torch.chunk does, into fewer pieces where it does") {
  // torch.arange(size).chunk(n) in torch 1.13, piece by piece.
  CHECK(static_chunk_rows<5, 4>() == std::vector<index_t>{2, 2, 1});
  CHECK(static_chunk_rows<6, 4>() == std::vector<index_t>{2, 2, 2});
  CHECK(static_chunk_rows<10, 4>() == std::vector<index_t>{3, 3, 3, 1});
  CHECK(static_chunk_rows<7, 3>() == std::vector<index_t>{3, 3, 1});
  CHECK(static_chunk_rows<0, 3>() == std::vector<index_t>{0, 0, 0});
  CHECK(static_chunk_rows<1, 3>() == std::vector<index_t>{1});
  CHECK(static_chunk_rows<3, 5>() == std::vector<index_t>{1, 1, 1});
  CHECK(static_chunk_rows<4, 4>() == std::vector<index_t>{1, 1, 1, 1});
  // A size known only when it runs: N pieces, the same rows where torch makes N.
  const D x = random_input({10, 2}, -1, 1, 21);
  const auto [a, b, c, d] = duet::ops::chunk<0, 4>(x);
  CHECK(a.shape() == Shape{3, 2});
  CHECK(d.shape() == Shape{1, 2});
  CHECK(d.data() == x.data() + 18);  // along axis 0 a view, as split's pieces
  const auto [e, f, g] = duet::ops::chunk<0, 3>(duet::zeros<double>({0, 2}));
  CHECK(g.shape() == Shape{0, 2});
  // A static shape whose axis is dyn there: the run-time pieces; a sized axis: split's.
  const duet::StaticTensor<double, duet::dyn, 5> batch(random_input({3, 5}, -1, 1, 22));
  static_assert(std::tuple_size_v<decltype(duet::ops::chunk<0, 2>(batch))> == 2);
  static_assert(std::tuple_size_v<decltype(duet::ops::chunk<1, 4>(batch))> == 3);
  CHECK(std::get<2>(duet::ops::chunk<1, 4>(batch)).shape() == Shape{3, 1});
}

namespace {
template <class F>
struct StaticNet : duet::nn::Cell<StaticNet<F>, duet::GRAPH_MODE, double> {
  auto construct(auto x) { return F{}(x); }
};
// The last of chunk<0, 4>'s pieces, doubled: of 5 rows, torch's third piece (one row).
struct LastChunk {
  auto operator()(const auto& x) const {
    const auto pieces = duet::ops::chunk<0, 4>(x);
    return std::get<std::tuple_size_v<decltype(pieces)> - 1>(pieces) * 2.0;
  }
};
}  // namespace

TEST_CASE("ops: chunk of a static shape in graph mode makes torch's pieces, PyNative's bits") {
  duet_test::ModeGuard guard;
  const duet::StaticTensor<double, 5, 3> x(random_input({5, 3}, -1, 1, 23));
  StaticNet<LastChunk> net;
  const auto graph = net(x);
  const auto eager = LastChunk{}(x);
  REQUIRE(graph.shape() == Shape{1, 3});
  REQUIRE(eager.shape() == Shape{1, 3});
  CHECK(std::equal(graph.data(), graph.data() + 3, eager.data()));
  for (int j = 0; j < 3; ++j) CHECK(eager.data()[j] == 2 * x(4, j));
}

TEST_CASE("ops: chunk refuses a run-time size torch cuts into fewer pieces, and a missing axis, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({5, 2}, -1, 1, 24);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto fewer = duet::jit([](const auto& t) { return std::get<0>(duet::ops::chunk<0, 4>(t)); });
    CHECK_THROWS_WITH_AS(fewer(x),
                         doctest::Contains("ops::chunk<0, 4> piece 0 expects an input whose size along its axis cuts "
                                           "into 4 pieces of ceil(size / 4) elements (PyTorch's chunk makes fewer of "
                                           "it; give the pieces' sizes with ops::split), got [5, 2]"),
                         duet::ShapeError);
    auto missing = duet::jit([](const auto& t) { return std::get<1>(duet::ops::chunk<2, 2>(t)); });
    CHECK_THROWS_WITH_AS(missing(x),
                         doctest::Contains("ops::chunk<2, 2> piece 1 expects an input of rank at least 3, got [5, 2]"),
                         duet::ShapeError);
  }
}

TEST_CASE("ops: tile's shape is known at compile time, a multiple of 0 empties it, and its gradient is zeros") {
  duet_test::ModeGuard guard;
  const auto y = duet::ops::tile<2, 1, 3>(duet::ones<double>(duet::shape<2, 3>));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(y)>, duet::StaticTensor<double, 2, 2, 9>>);
  const D x = random_input({2, 3}, -1, 1, 25);
  std::vector<D> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto vg = duet::value_and_grad([](const auto& t) { return duet::ops::sum(duet::ops::tile<0, 2>(t)); });
    const D empty = duet::jit([](const auto& t) { return duet::ops::tile(t, {2, 0}); })(x);
    CHECK(empty.shape() == Shape{4, 0});
    grads.push_back(vg(x).grads[0]);
  }
  for (const D& g : grads) CHECK(std::all_of(g.data(), g.data() + 6, [](double v) { return v == 0.0; }));
}

TEST_CASE("ops: tile refuses negative multiples and more than max_rank of them") {
  const D x = random_input({2, 3}, -1, 1, 26);
  CHECK_THROWS_WITH_AS(duet::ops::tile(x, {2, -1}),
                       "duet::ops::tile: the multiples {2, -1} must be >= 0, at most 8 of them", duet::ValueError);
  CHECK_THROWS_WITH_AS(duet::ops::tile(x, {1, 1, 1, 1, 1, 1, 1, 1, 1}), doctest::Contains("at most 8 of them"),
                       duet::ValueError);
}

TEST_CASE("ops: flip keeps its input's shape, static or unknown, and twice over is its input, in both modes") {
  duet_test::ModeGuard guard;
  const auto y = duet::ops::flip<-1>(duet::ones<double>(duet::shape<2, 3>));
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(y)>, duet::StaticTensor<double, 2, 3>>);
  // Known trailing axes behind unknown leading ones stay known, as the slices' rule would not.
  constexpr duet::Shape any_leading = [] {
    duet::Shape s = duet::Shape::any();
    s.push_back(4);
    return s;
  }();
  static_assert(duet::ops::FlipOp<-1>::infer_static(std::span(&any_leading, 1)).shape == any_leading);
  const D x = random_input({3, 4}, -1, 1, 28);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    const D back = duet::jit([](const auto& t) { return duet::ops::flip<1, 0>(duet::ops::flip<0, -1>(t)); })(x);
    CHECK(std::equal(back.data(), back.data() + 12, x.data()));
    const D empty = duet::jit([](const auto& t) { return duet::ops::flip<0>(t); })(duet::zeros<double>({0, 3}));
    CHECK(empty.shape() == Shape{0, 3});
  }
}

TEST_CASE("ops: flip refuses an axis its input does not have, or one named twice, in both modes") {
  duet_test::ModeGuard guard;
  const D x = random_input({3, 4}, -1, 1, 29);
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto missing = duet::jit([](const auto& t) { return duet::ops::flip<0, 2>(t); });
    CHECK_THROWS_WITH_AS(missing(x),
                         doctest::Contains("ops::flip<0, 2> expects an input of rank at least 3, got [3, 4]"),
                         duet::ShapeError);
    // torch.flip refuses it too ("dim 0 appears multiple times").
    auto twice = duet::jit([](const auto& t) { return duet::ops::flip<0, -2>(t); });
    CHECK_THROWS_WITH_AS(twice(x), doctest::Contains("axis 0 is named twice"), duet::ShapeError);
  }
}

}  // namespace tests_ops_shape
