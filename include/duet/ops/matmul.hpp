// Matrix products: ops::matmul(a, b) with numpy's and MindSpore's semantics, and with
// MindSpore's BatchMatMul(transpose_a, transpose_b) flags, in both modes.
//
//   ops::matmul(a, b)                          [..., m, k] · [..., k, n] -> [..., m, n]
//   ops::matmul(a, b, ops::transpose_a)        a given as [..., k, m]
//   ops::matmul(a, b, ops::transpose_b)        b given as [..., n, k] (a weight as [out, in])
//   ops::matmul(a, b, ops::transpose_a, ops::transpose_b)
// The batch axes (all but the last two) broadcast as numpy's do. A 1-D a is a row [1, k] and a
// 1-D b a column [k, 1], the added axis dropped from the result (numpy's rule; a transpose of
// a 1-D input is refused). The flags are tags, so the operation's type carries them and graph
// mode computes the output's static shape, and checks the inner dimensions, at compile time:
// a mismatch names both shapes.
//
// Gradients, C = op(A)·op(B), each summed over the batch axes its input was broadcast along:
//   no transposes: dA = dC·Bᵀ,     dB = Aᵀ·dC
//   transpose_a:   dA = B·dCᵀ,     dB = A·dC
//   transpose_b:   dA = dC·B,      dB = dCᵀ·A
//   both:          dA = Bᵀ·dCᵀ,    dB = dCᵀ·Aᵀ
// Each is a product of the same kind, so one kernel serves the forward and both gradients.
//
// Kernel: each 2-D product X'·Y' (X' = X or Xᵀ as stored, the same for Y) takes
//  - duet's GEMM (the backend's dense(), kernels::gemm in backend::Native) when X' = X and
//    Y' = Yᵀ, and the result is written rather than added to: that is gemm's layout, C = A·Bᵀ
//    with both row-major, and it applies to the forward product with transpose_b (a weight as
//    [out, in]), and to dA of the product without transposes (dC·Bᵀ), the gradient a
//    network's layers take most;
//  - an Eigen product on Maps of the row-major storage otherwise (Xᵀ or a plain Y, and
//    gradients summed over broadcast batch axes, which add into the output): Eigen reads a
//    transposed Map in place, where gemm would need a transposed copy of the operand.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>

#include <Eigen/Core>

#include "../backend.hpp"
#include "arithmetic.hpp"

namespace duet {
namespace ops {

struct TransposeA {};
struct TransposeB {};
// MindSpore's BatchMatMul(transpose_a=True) and (transpose_b=True), as tags.
inline constexpr TransposeA transpose_a{};
inline constexpr TransposeB transpose_b{};

namespace detail {

// The axes of s before its last `matrix` axes, unknown leading axes kept unknown.
constexpr Shape batch_of(const Shape& s, int matrix) {
  Shape b = s.leading_unknown() ? Shape::any() : Shape{};
  for (int i = 0; i + matrix < s.rank(); ++i) b.push_back(s[i]);
  return b;
}

// An operand as a batch of stored matrices: a 1-D a is one row, a 1-D b one column.
struct MatrixView {
  Shape batch;
  index_t rows = 0;
  index_t cols = 0;
};

constexpr MatrixView matrix_view(const Shape& s, bool first) {
  if (s.rank() == 1 && !s.leading_unknown()) return first ? MatrixView{Shape{}, 1, s[0]} : MatrixView{Shape{}, s[0], 1};
  return {batch_of(s, 2), s[-2], s[-1]};
}

template <bool TA, bool TB>
constexpr ShapeResult matmul_shape(const Shape& a, const Shape& b) {
  // An unknown rank might be 1 or more: nothing is known of the result.
  if ((a.leading_unknown() && a.rank() < 2) || (b.leading_unknown() && b.rank() < 2)) return {Shape::any()};
  for (int k = 0; k < 2; ++k) {
    const Shape& s = k == 0 ? a : b;
    const bool transposed = k == 0 ? TA : TB;
    if (s.rank() < (transposed ? 2 : 1)) return fault(Shape::any(), ShapeFault::min_rank, transposed ? 2 : 1, k);
  }
  const MatrixView va = matrix_view(a, true), vb = matrix_view(b, false);
  const index_t m = TA ? va.cols : va.rows, ka = TA ? va.rows : va.cols;
  const index_t kb = TB ? vb.cols : vb.rows, n = TB ? vb.rows : vb.cols;
  const ShapeResult batch = broadcast_shapes(va.batch, vb.batch);
  Shape out = batch.shape;
  if (a.rank() > 1) out.push_back(m);
  if (b.rank() > 1) out.push_back(n);
  if (ka != kb && ka != dyn && kb != dyn) return fault(out, ShapeFault::inner_dimensions, 0, 1);
  if (!batch.ok()) return fault(out, ShapeFault::broadcast, 0, batch.input);
  return {out};
}

// c (+)= X'·Y', X stored [xr, xc] and Y [yr, yc], row-major; X' is Xᵀ if tx, Y' is Yᵀ if ty.
template <class Backend, class T>
void product(const T* x, index_t xr, index_t xc, bool tx, const T* y, index_t yr, index_t yc, bool ty, T* c,
             bool accumulate) {
  const index_t m = tx ? xc : xr, k = tx ? xr : xc, n = ty ? yr : yc;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) std::fill_n(c, m * n, T(0));
    return;
  }
  if (!tx && ty && !accumulate) {
    Backend::template dense<dyn, dyn>(x, m, k, y, n, Epilogue<T>{}, c);
    return;
  }
  using Matrix = backend::detail::RowMajorMatrix<T, dyn, dyn>;
  const ::Eigen::Map<const Matrix> X(x, xr, xc), Y(y, yr, yc);
  ::Eigen::Map<Matrix> C(c, m, n);
  auto store = [&](const auto& p) {
    if (accumulate) C.noalias() += p;
    else C.noalias() = p;
  };
  if (tx && ty) store(X.transpose() * Y.transpose());
  else if (tx) store(X.transpose() * Y);
  else if (ty) store(X * Y.transpose());
  else store(X * Y);
}

// The products of a batch: for each batch index of the result of broadcasting a's and b's
// batches, f(i, ia, ib) with the matrix indices of the result, a and b.
template <class F>
void for_each_batch(const MatrixView& a, const MatrixView& b, F&& f) {
  const Shape out = broadcast_shapes(a.batch, b.batch).shape;
  for_each_broadcast(a.batch, b.batch, out, f);
}

}  // namespace detail

template <bool TA, bool TB, int K>
struct BatchMatMulGradOp;

template <bool TA, bool TB>
struct BatchMatMulOp : Primitive<BatchMatMulOp<TA, TB>> {
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::matmul_shape<TA, TB>(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const auto va = detail::matrix_view(a.in_shape(0), true), vb = detail::matrix_view(a.in_shape(1), false);
    const T* x = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* c = a.out<T>();
    const index_t m = TA ? va.cols : va.rows, n = TB ? vb.rows : vb.cols;
    const index_t sa = va.rows * va.cols, sb = vb.rows * vb.cols;
    detail::for_each_batch(va, vb, [&](index_t i, index_t ia, index_t ib) {
      detail::product<Backend>(x + ia * sa, va.rows, va.cols, TA, y + ib * sb, vb.rows, vb.cols, TB, c + i * m * n,
                               false);
    });
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return BatchMatMulGradOp<TA, TB, static_cast<int>(K)>{};
  }

  static std::string op_name() {
    return std::string("BatchMatMul") + (TA ? "(transpose_a" : "") + (TA && TB ? ", " : TB ? "(" : "") +
           (TB ? "transpose_b" : "") + (TA || TB ? ")" : "");
  }

  // ONNX's MatMul broadcasts the batch axes as numpy's matmul does, as this does; a transposed
  // factor is a Transpose of its last two axes first.
  Interchange interchange(std::span<const Shape> in) const {
    Interchange nodes;
    std::array<InterchangeInput, 2> factor{InterchangeInput::operand(0), InterchangeInput::operand(1)};
    for (std::size_t k = 0; k < 2; ++k) {
      if (!(k == 0 ? TA : TB)) continue;
      const int rank = in[k].rank();
      std::vector<std::int64_t> perm;
      for (int a = 0; a < rank; ++a) perm.push_back(a < rank - 2 ? a : a == rank - 2 ? rank - 1 : rank - 2);
      nodes.push_back({"Transpose", {factor[k]}, {InterchangeAttribute::of("perm", std::move(perm))}});
      factor[k] = InterchangeInput::node(nodes.size() - 1);
    }
    nodes.push_back({"MatMul", {factor[0], factor[1]}, {}});
    return nodes;
  }
};

// d/d input K of op(A)·op(B), by the table at the top of this header, summed over the batch
// axes input K was broadcast along.
template <bool TA, bool TB, int K>
struct BatchMatMulGradOp : Primitive<BatchMatMulGradOp<TA, TB, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const auto va = detail::matrix_view(a.in_shape(1), true), vb = detail::matrix_view(a.in_shape(2), false);
    const T* dc = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* d = a.out<T>();
    const index_t m = TA ? va.cols : va.rows, n = TB ? vb.rows : vb.cols;
    const index_t sa = va.rows * va.cols, sb = vb.rows * vb.cols;
    const detail::MatrixView& target = K == 0 ? va : vb;
    const Shape out_batch = broadcast_shapes(va.batch, vb.batch).shape;
    // Each target matrix is written once unless its input was broadcast along batch axes.
    const bool accumulate = target.batch.numel() != out_batch.numel();
    if (accumulate) std::fill_n(d, a.in_shape(1 + K).numel(), T(0));
    detail::for_each_batch(va, vb, [&](index_t i, index_t ia, index_t ib) {
      const T* g = dc + i * m * n;
      const T* A = x + ia * sa;
      const T* B = y + ib * sb;
      if constexpr (K == 0) {
        T* out = d + ia * sa;
        if constexpr (!TA && !TB) detail::product<Backend>(g, m, n, false, B, vb.rows, vb.cols, true, out, accumulate);
        else if constexpr (TA && !TB) detail::product<Backend>(B, vb.rows, vb.cols, false, g, m, n, true, out, accumulate);
        else if constexpr (!TA && TB) detail::product<Backend>(g, m, n, false, B, vb.rows, vb.cols, false, out, accumulate);
        else detail::product<Backend>(B, vb.rows, vb.cols, true, g, m, n, true, out, accumulate);
      } else {
        T* out = d + ib * sb;
        if constexpr (!TA && !TB) detail::product<Backend>(A, va.rows, va.cols, true, g, m, n, false, out, accumulate);
        else if constexpr (TA && !TB) detail::product<Backend>(A, va.rows, va.cols, false, g, m, n, false, out, accumulate);
        else if constexpr (!TA && TB) detail::product<Backend>(g, m, n, true, A, va.rows, va.cols, false, out, accumulate);
        else detail::product<Backend>(g, m, n, true, A, va.rows, va.cols, true, out, accumulate);
      }
    });
  }

  static std::string op_name() { return BatchMatMulOp<TA, TB>::op_name() + "Grad" + std::to_string(K); }
};

inline const bool matmul_listed = list_operations({"matmul"});

template <TensorLike A, TensorLike B, class... Flags>
auto matmul(const A& a, const B& b, Flags...) {
  using F = std::tuple<Flags...>;
  static_assert(std::is_same_v<F, std::tuple<>> || std::is_same_v<F, std::tuple<TransposeA>> ||
                    std::is_same_v<F, std::tuple<TransposeB>> || std::is_same_v<F, std::tuple<TransposeA, TransposeB>>,
                "duet::ops::matmul: the flags are ops::transpose_a, ops::transpose_b or both, in that order");
  constexpr bool ta = (std::is_same_v<Flags, TransposeA> || ...);
  constexpr bool tb = (std::is_same_v<Flags, TransposeB> || ...);
  static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                "duet::ops::matmul: both factors must have the same element type");
  return apply(BatchMatMulOp<ta, tb>{}, a, b);
}

}  // namespace ops
}  // namespace duet
