// matmul (include/duet/ops/matmul.hpp): its cases in the gradient harness, with values from
// plain loops in double, and what the harness does not cover (shape errors, static shapes).
#include "ops_harness.hpp"

namespace tests_ops_matmul {

namespace {

using namespace duet_test::ops;
using duet_test::ops::D;
namespace ops = duet::ops;

// op(a)·op(b) written out: a 1-D a is a row and a 1-D b a column (their added axis dropped),
// batch axes aligned at the end with size-1 axes pinned to 0.
D reference_matmul(const D& a, const D& b, bool ta, bool tb) {
  const Shape& sa = a.shape();
  const Shape& sb = b.shape();
  const bool a_vec = sa.rank() == 1, b_vec = sb.rank() == 1;
  const duet::index_t ar = a_vec ? 1 : sa[-2], ac = a_vec ? sa[0] : sa[-1];
  const duet::index_t br = b_vec ? sb[0] : sb[-2], bc = b_vec ? 1 : sb[-1];
  const duet::index_t m = ta ? ac : ar, k = ta ? ar : ac, n = tb ? br : bc;
  const int rank_a = a_vec ? 0 : sa.rank() - 2, rank_b = b_vec ? 0 : sb.rank() - 2;
  const int rank = std::max(rank_a, rank_b);
  std::vector<duet::index_t> batch(static_cast<std::size_t>(rank));
  for (int i = 1; i <= rank; ++i) {
    const duet::index_t da = i <= rank_a ? sa[rank_a - i] : 1, db = i <= rank_b ? sb[rank_b - i] : 1;
    batch[static_cast<std::size_t>(rank - i)] = std::max(da, db);
  }
  Shape out;
  duet::index_t batches = 1;
  for (duet::index_t d : batch) {
    out.push_back(d);
    batches *= d;
  }
  if (!a_vec) out.push_back(m);
  if (!b_vec) out.push_back(n);
  D c = duet::zeros<double>(out);
  // The offset of matrix `index` (a multi-index over the result's batch) in an operand of
  // `r` batch axes of shape s.
  auto matrix_offset = [&](const Shape& s, int r, const std::vector<duet::index_t>& index) {
    duet::index_t offset = 0;
    for (int i = 0; i < r; ++i) {
      const duet::index_t j = s[i] == 1 ? 0 : index[static_cast<std::size_t>(rank - r + i)];
      offset = offset * s[i] + j;
    }
    return offset;
  };
  std::vector<duet::index_t> index(static_cast<std::size_t>(rank));
  for (duet::index_t t = 0; t < batches; ++t) {
    duet::index_t rest = t;
    for (int i = rank - 1; i >= 0; --i) {
      index[static_cast<std::size_t>(i)] = rest % batch[static_cast<std::size_t>(i)];
      rest /= batch[static_cast<std::size_t>(i)];
    }
    const double* A = a.data() + matrix_offset(sa, rank_a, index) * ar * ac;
    const double* B = b.data() + matrix_offset(sb, rank_b, index) * br * bc;
    for (duet::index_t i = 0; i < m; ++i) {
      for (duet::index_t j = 0; j < n; ++j) {
        double s = 0;
        for (duet::index_t p = 0; p < k; ++p) {
          s += (ta ? A[p * ac + i] : A[i * ac + p]) * (tb ? B[j * bc + p] : B[p * bc + j]);
        }
        c.data()[(t * m + i) * n + j] = s;
      }
    }
  }
  return c;
}

template <bool TA, bool TB>
void add_matmul(std::multimap<std::string, Case>& m, Shape a, Shape b) {
  auto f = [](const auto& x, const auto& y) {
    if constexpr (TA && TB) return ops::matmul(x, y, ops::transpose_a, ops::transpose_b);
    else if constexpr (TA) return ops::matmul(x, y, ops::transpose_a);
    else if constexpr (TB) return ops::matmul(x, y, ops::transpose_b);
    else return ops::matmul(x, y);
  };
  m.emplace("matmul", make_case_with_reference<2>({a, b}, f, [](const std::vector<D>& xs) {
              return reference_matmul(xs[0], xs[1], TA, TB);
            }));
}

const bool matmul_cases = add_cases([](std::multimap<std::string, Case>& m) {
  // Plain, vectors on either side, batched, broadcast batch axes on either side.
  add_matmul<false, false>(m, {3, 4}, {4, 5});
  add_matmul<false, false>(m, {4}, {4, 5});
  add_matmul<false, false>(m, {3, 4}, {4});
  add_matmul<false, false>(m, {4}, {4});
  add_matmul<false, false>(m, {2, 3, 4}, {2, 4, 5});
  add_matmul<false, false>(m, {2, 3, 4}, {4, 5});
  add_matmul<false, false>(m, {3, 4}, {2, 4, 5});
  add_matmul<false, false>(m, {2, 1, 3, 4}, {3, 4, 2});
  add_matmul<false, false>(m, {2, 3, 4}, {4});
  // Each transpose flag, plain and batched with broadcasting.
  add_matmul<true, false>(m, {4, 3}, {4, 5});
  add_matmul<true, false>(m, {2, 4, 3}, {1, 4, 5});
  add_matmul<false, true>(m, {3, 4}, {5, 4});
  add_matmul<false, true>(m, {2, 3, 4}, {5, 4});
  add_matmul<true, true>(m, {4, 3}, {5, 4});
  add_matmul<true, true>(m, {1, 4, 3}, {2, 5, 4});
});

struct Product : duet::nn::Cell<Product, duet::GRAPH_MODE> {
  auto construct(auto a, auto b) { return ops::matmul(a, b, ops::transpose_b); }
};

}  // namespace

TEST_CASE("ops: matmul's shape errors name both shapes") {
  try {
    static_cast<void>(ops::matmul(duet::ones({2, 3}), duet::ones({4, 5})));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) ==
          "BatchMatMul expects inputs whose inner dimensions match (the columns of the first, the rows of the second, "
          "after their transposes), got [2, 3] and [4, 5]");
  }
  try {
    static_cast<void>(ops::matmul(duet::ones({2, 2, 3}), duet::ones({3, 3, 5})));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()).find("BatchMatMul expects inputs whose shapes broadcast together") == 0);
  }
  try {
    static_cast<void>(ops::matmul(duet::ones({3}), duet::ones({3, 5}), ops::transpose_a));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "BatchMatMul(transpose_a) expects an input of rank at least 2, got [3]");
  }
}

TEST_CASE("ops: matmul of static tensors has its static shape in graph mode") {
  Product net;
  const auto a = duet::ones(duet::shape<2, 3, 4>);
  const auto b = duet::ones(duet::shape<5, 4>);
  const duet::Tensor c = net(a, b);
  CHECK(c.shape() == Shape{2, 3, 5});
  CHECK(c(1, 2, 4) == 4.f);
  static_assert(ops::BatchMatMulOp<false, true>::infer_static(std::array<Shape, 2>{Shape{2, 3, 4}, Shape{5, 4}}).shape ==
                Shape{2, 3, 5});
}

}  // namespace tests_ops_matmul
