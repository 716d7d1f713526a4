// Kernels: the maths of every operation, shared by both modes.
//
// PyNative calls a kernel once per node on materialised tensors; the graph evaluator calls
// the same kernel, with the epilogue the passes fused into it. A backend is a struct of
// static kernels; the evaluator takes it as a template parameter, so a backend that derives
// from backend::Eigen and redefines one kernel swaps that operation alone, without touching
// capture or passes.
#pragma once

#include <Eigen/Core>

#include "config.hpp"

namespace duet {

// What a product kernel applies to each output row before storing it: the bias (if not
// null), then each elementwise function Fns in order. Fusing them here saves one pass over
// the output per function, the point of the epilogue-fusion pass.
template <class T, class... Fns>
struct Epilogue {
  const T* bias = nullptr;
};

namespace backend {

namespace detail {
// Eigen rejects row-major matrices with a single column; the layout is the same either way.
template <class T, index_t Rows, index_t Cols>
using RowMajorMatrix = ::Eigen::Matrix<T, Rows == dyn ? ::Eigen::Dynamic : static_cast<int>(Rows),
                                       Cols == dyn ? ::Eigen::Dynamic : static_cast<int>(Cols),
                                       Cols == 1 ? ::Eigen::ColMajor : ::Eigen::RowMajor>;

template <class Expr>
decltype(auto) apply_all(const Expr& e) {
  return e;
}
template <class Fn, class... Rest, class Expr>
auto apply_all(const Expr& e) {
  return apply_all<Rest...>(Fn::array(e));
}
}  // namespace detail

struct Eigen {
  // y[rows, out] = epilogue(x[rows, in] · w[out, in]ᵀ), all row-major. In and Out are the
  // compile-time sizes where known (dyn otherwise), so small layers get unrolled kernels.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense(const T* x, index_t rows, index_t in, const T* w, index_t out,
                    const Epilogue<T, Fns...>& epilogue, T* y) {
    using XMatrix = detail::RowMajorMatrix<T, dyn, In>;
    using WMatrix = detail::RowMajorMatrix<T, Out, In>;
    using YMatrix = detail::RowMajorMatrix<T, dyn, Out>;
    ::Eigen::Map<const XMatrix> X(x, rows, in);
    ::Eigen::Map<const WMatrix> W(w, out, in);
    ::Eigen::Map<YMatrix> Y(y, rows, out);
    Y.noalias() = X * W.transpose();
    if (epilogue.bias != nullptr) {
      using Row = ::Eigen::Array<T, 1, Out == dyn ? ::Eigen::Dynamic : static_cast<int>(Out)>;
      ::Eigen::Map<const Row> b(epilogue.bias, 1, out);
      Y.array() = detail::apply_all<Fns...>(Y.array().rowwise() + b);
    } else if constexpr (sizeof...(Fns) > 0) {
      Y.array() = detail::apply_all<Fns...>(Y.array());
    }
  }

  // y[rows, cols] = x[rows, cols] + bias[cols]; y may be x.
  template <class T>
  static void add_bias(const T* x, index_t rows, index_t cols, const T* bias, T* y) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<const Matrix> X(x, rows, cols);
    ::Eigen::Map<Matrix> Y(y, rows, cols);
    ::Eigen::Map<const ::Eigen::Array<T, 1, ::Eigen::Dynamic>> b(bias, 1, cols);
    Y.array() = X.array().rowwise() + b;
  }

  // y[i] = Fn(x[i]); y may be x.
  template <class Fn, class T>
  static void map(const T* x, index_t n, T* y) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(y, n) = Fn::array(::Eigen::Map<const Array>(x, n));
  }
};

}  // namespace backend

#ifdef DUET_DEFAULT_BACKEND
using DefaultBackend = DUET_DEFAULT_BACKEND;
#else
using DefaultBackend = backend::Eigen;
#endif

}  // namespace duet
