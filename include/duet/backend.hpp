// Kernels: the maths of every operation, shared by both modes.
//
// PyNative calls a kernel once per node on materialised tensors; the graph evaluator calls
// the same kernel, with the epilogue the passes fused into it. A backend is a struct of
// static kernels; the evaluator takes it as a template parameter, so a backend that derives
// from backend::Eigen and redefines one kernel swaps that operation alone, without touching
// capture or passes.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>

#include <Eigen/Core>
#if !EIGEN_VERSION_AT_LEAST(3, 4, 0)
#error "duet needs Eigen 3.4 or later (nn::ReLU keeps NaN with Eigen::PropagateNaN)"
#endif

#include "config.hpp"
#include "error.hpp"
#include "kernels/elementwise.hpp"
#include "kernels/gemm.hpp"
#include "kernels/optim.hpp"
#include "memory.hpp"
#include "parameter.hpp"

namespace duet {

// What a product kernel applies to each output row before storing it: the bias (if not
// null), then each elementwise function Fns in order. Fusing them here saves one pass over
// the output per function, the point of the epilogue-fusion pass.
template <class T, class... Fns>
struct Epilogue {
  const T* bias = nullptr;
  std::tuple<Fns...> fns{};  // their parameters, if any (LeakyReLU's alpha)
};

// How a loss turns per-element losses into its output (MindSpore's `reduction`). batchmean
// (the sum over the size of axis 0) is nn::KLDivLoss's only, as in MindSpore; the other
// losses refuse it at compile time.
enum class Reduction : unsigned char { none, mean, sum, batchmean };

// The scalars of one optimiser step, computed once per step for all parameters.
struct AdamStep {
  double learning_rate;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;           // AdamW
  double bias_correction1;  // 1 - beta1^t
  double bias_correction2;  // 1 - beta2^t
};

struct SgdStep {
  double learning_rate;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool first_step;
};

// What the gradient of y = epilogue(x · Wᵀ) reads and writes; dx and db may be null.
template <class T>
struct DenseBackwardArgs {
  const T* dy;  // [rows, out]
  const T* x;   // [rows, in]
  const T* y;   // [rows, out], the forward output, read when an epilogue function needs it
  index_t rows;
  index_t in;
  const T* w;  // [out, in]
  index_t out;
  T* dx;  // [rows, in]
  T* dw;  // [out, in]
  bool accumulate_w;
  T* db;  // [out]
  bool accumulate_b;
};

namespace backend {

namespace detail {
// Sizes known at compile time become Eigen's fixed sizes only while small: that is where
// unrolling pays, and large fixed sizes overflow Eigen's unrolling cost estimates. Eigen
// rejects row-major matrices with a single column; the layout is the same either way.
constexpr int eigen_size(index_t n) { return n == dyn || n > 16 ? ::Eigen::Dynamic : static_cast<int>(n); }

template <class T, index_t Rows, index_t Cols>
using RowMajorMatrix = ::Eigen::Matrix<T, eigen_size(Rows), eigen_size(Cols), Cols == 1 ? ::Eigen::ColMajor : ::Eigen::RowMajor>;

// fns applied in order to an Eigen array expression, as one expression.
template <std::size_t I = 0, class... Fns, class Expr>
auto apply_all(const std::tuple<Fns...>& fns, const Expr& e) {
  if constexpr (I == sizeof...(Fns)) return e;
  else return apply_all<I + 1>(fns, std::get<I>(fns).array(e));
}

// Whether Fns' Eigen array forms give the same bits however a loop over them is split into
// SIMD vectors and scalars, and however it is fused with other arithmetic: those of the
// functions with a vector form of their own (ReLU) are exact comparisons and selections. The
// others (exp, tanh, erf, ...) take Eigen's vectorised approximations on full vectors and the C
// library on the rest, and a compiler may contract their arithmetic into that of a neighbouring
// function (FMA); so that a fused graph computes what PyNative's one-function passes compute,
// they run one function at a time over the same flat layout. That includes the functions
// whose vector form is kernels::activation's (fn::KernelActivation): their array forms are
// Eigen's.
template <class T, class... Fns>
inline constexpr bool exact_in_any_layout =
    ((kernels::VectorFunction<Fns, T> && !requires { Fns::kernel_activation; }) && ...);

// y[i] = fns(x[i]) one function at a time, each pass over a block that stays in L1 the call
// map_one(f, from, m, to) that runs f alone.
template <class... Fns, class T, class MapOne>
void map_in_turns(const std::tuple<Fns...>& fns, const T* x, index_t n, T* y, MapOne map_one) {
  // A multiple of every SIMD width, so that each block splits into vectors and a scalar tail
  // exactly where one pass over all n elements does.
  constexpr index_t block = 1024;
  for (index_t i = 0; i < n; i += block) {
    const index_t m = std::min(block, n - i);
    const T* from = x + i;
    std::apply([&](const auto&... f) { ((map_one(f, from, m, y + i), from = y + i), ...); }, fns);
  }
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
    if constexpr (detail::exact_in_any_layout<T, Fns...>) {
      if (epilogue.bias != nullptr) {
        using Row = ::Eigen::Array<T, 1, detail::eigen_size(Out)>;
        ::Eigen::Map<const Row> b(epilogue.bias, 1, out);
        Y.array() = detail::apply_all(epilogue.fns, Y.array().rowwise() + b);
      } else if constexpr (sizeof...(Fns) > 0) {
        Y.array() = detail::apply_all(epilogue.fns, Y.array());
      }
    } else {
      if (epilogue.bias != nullptr) add_bias(y, rows, out, epilogue.bias, y);
      map(epilogue.fns, y, rows * out, y);
    }
  }

  // c[m, n] = a[m, k] · b[k, n], all row-major: the product whose right operand is laid out
  // as im2col lays out an image's patches (ops/conv.hpp), which dense() would need transposed.
  template <class T>
  static void matmul(const T* a, index_t m, index_t k, const T* b, index_t n, T* c) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<Matrix>(c, m, n).noalias() = ::Eigen::Map<const Matrix>(a, m, k) * ::Eigen::Map<const Matrix>(b, k, n);
  }

  // dense() with a layer's weight, kept pre-packed from call to call where the backend has a
  // packed form (graphs not trained, at O1 and O2). Eigen packs inside each product, so here
  // it is dense(). dense_packed_of names the backend whose dense() it computes (packs_as_dense).
  using dense_packed_of = Eigen;
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_packed(const T* x, index_t rows, index_t in, const nn::BasicParameter<T>& w, index_t out,
                           const Epilogue<T, Fns...>& epilogue, T* y) {
    dense<In, Out>(x, rows, in, w.data(), out, epilogue, y);
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

  // y[i] = fns(x[i]), the functions applied in order in one pass over memory; y may be x.
  // Functions that are not exact in any layout (detail::exact_in_any_layout) take turns on
  // blocks that stay in L1, each function's pass the very code that runs it alone.
  template <class... Fns, class T>
  static void map(const std::tuple<Fns...>& fns, const T* x, index_t n, T* y) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    if constexpr (sizeof...(Fns) == 1 || detail::exact_in_any_layout<T, Fns...>) {
      ::Eigen::Map<Array>(y, n) = detail::apply_all(fns, ::Eigen::Map<const Array>(x, n));
    } else {
      detail::map_in_turns(fns, x, n, y,
                           [](const auto& f, const T* from, index_t m, T* to) { map(std::tuple{f}, from, m, to); });
    }
  }
  template <class... Fns, class T>
  static void map(const T* x, index_t n, T* y) {
    map(std::tuple<Fns...>{}, x, n, y);
  }

  // dx[i] = dy[i] · Fn'(x[i]), Fn' written in terms of the output y = Fn(x), or of the input
  // (fn::grad_from_input), which is then what `y` points to.
  template <class Fn, class T>
  static void map_grad(const Fn& f, const T* dy, const T* y, index_t n, T* dx) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(dx, n) = f.grad_array(::Eigen::Map<const Array>(dy, n), ::Eigen::Map<const Array>(y, n));
  }
  template <class Fn, class T>
  static void map_grad(const T* dy, const T* y, index_t n, T* dx) {
    map_grad(Fn{}, dy, y, n, dx);
  }

  // The gradient of y = Fns(x · wᵀ + b): dz = dy · Fns'(y), dw (+)= dzᵀ · x, db (+)= Σ_rows dz,
  // dx = dz · w.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_backward(const DenseBackwardArgs<T>& a, const std::tuple<Fns...>& fns = {}) {
    using XMatrix = detail::RowMajorMatrix<T, dyn, In>;
    using WMatrix = detail::RowMajorMatrix<T, Out, In>;
    using YMatrix = detail::RowMajorMatrix<T, dyn, Out>;
    ::Eigen::Map<const XMatrix> X(a.x, a.rows, a.in);
    ::Eigen::Map<const WMatrix> W(a.w, a.out, a.in);
    duet::detail::Storage masked;
    const T* dz = masked_gradient(a, fns, masked);
    ::Eigen::Map<const YMatrix> DZ(dz, a.rows, a.out);
    ::Eigen::Map<WMatrix> DW(a.dw, a.out, a.in);
    if (a.accumulate_w) DW.noalias() += DZ.transpose() * X;
    else DW.noalias() = DZ.transpose() * X;
    if (a.db != nullptr) column_sums(dz, a.rows, a.out, a.db, a.accumulate_b);
    if (a.dx != nullptr) {
      ::Eigen::Map<XMatrix> DX(a.dx, a.rows, a.in);
      DX.noalias() = DZ * W;
    }
  }

  // db (+)= Σ_rows dy.
  template <class T>
  static void bias_grad(const T* dy, index_t rows, index_t cols, T* db, bool accumulate) {
    column_sums(dy, rows, cols, db, accumulate);
  }

  // Row r's loss is logsumexp(z_r) - z_r[label_r] (sparse) or Σ_c p_rc (logsumexp(z_r) - z_rc)
  // (dense p). logsumexp subtracts the row's maximum first, so logits of magnitude 1e4 neither
  // overflow nor lose the answer.
  template <bool Sparse, class T, class L>
  static void softmax_cross_entropy(const T* z, const L* labels, index_t rows, index_t classes, Reduction r, T* out) {
    T total = 0;
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      const T lse = kernels::log_sum_exp(row, classes);
      T loss = 0;
      if constexpr (Sparse) {
        loss = lse - row[checked_label(labels[i], i, classes)];
      } else {
        loss = kernels::cross_entropy(row, labels + i * classes, classes, lse);
      }
      if (r == Reduction::none) out[i] = loss;
      else total += loss;
    }
    if (r == Reduction::sum) out[0] = total;
    if (r == Reduction::mean) out[0] = rows == 0 ? T(0) : total / static_cast<T>(rows);
  }

  // dz = (softmax(z) - p) · g, with g per row (no reduction), or g / rows (mean), or g (sum).
  template <bool Sparse, class T, class L>
  static void softmax_cross_entropy_grad(const T* g, const T* z, const L* labels, index_t rows, index_t classes,
                                         Reduction r, T* dz) {
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      T* d = dz + i * classes;
      const T lse = kernels::log_sum_exp(row, classes);
      const T scale = r == Reduction::none ? g[i] : r == Reduction::mean ? g[0] / static_cast<T>(rows) : g[0];
      if constexpr (Sparse) {
        kernels::softmax_grad(row, classes, lse, checked_label(labels[i], i, classes), scale, d);
      } else {
        // d/dz of Σ_c p_c (lse - z_c) is softmax · Σ_c p_c - p.
        const T* p = labels + i * classes;
        kernels::softmax_grad(row, p, classes, lse, kernels::sum(p, classes), scale, d);
      }
    }
  }

  // (x - y)², reduced.
  template <class T>
  static void mse(const T* x, const T* y, index_t n, Reduction r, T* out) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto sq = (::Eigen::Map<const Array>(x, n) - ::Eigen::Map<const Array>(y, n)).square();
    if (r == Reduction::none) ::Eigen::Map<Array>(out, n) = sq;
    else if (r == Reduction::sum) out[0] = sq.sum();
    else out[0] = n == 0 ? T(0) : sq.sum() / static_cast<T>(n);
  }

  // dx = 2 (x - y) · g, with g per element (no reduction), or g / n (mean), or g (sum).
  template <class T>
  static void mse_grad(const T* g, const T* x, const T* y, index_t n, Reduction r, T* dx) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto diff = ::Eigen::Map<const Array>(x, n) - ::Eigen::Map<const Array>(y, n);
    if (r == Reduction::none) {
      ::Eigen::Map<Array>(dx, n) = T(2) * diff * ::Eigen::Map<const Array>(g, n);
    } else {
      const T scale = r == Reduction::mean ? (n == 0 ? T(0) : T(2) * g[0] / static_cast<T>(n)) : T(2) * g[0];
      ::Eigen::Map<Array>(dx, n) = scale * diff;
    }
  }

  template <class T>
  static void fill(T* out, index_t n, T value) {
    std::fill_n(out, n, value);
  }

  template <class T>
  static void add(const T* a, const T* b, index_t n, T* out) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(out, n) = ::Eigen::Map<const Array>(a, n) + ::Eigen::Map<const Array>(b, n);
  }

  // One Adam step on n values (PyTorch's formulation: eps is added to the bias-corrected
  // sqrt(v)). weight_decay is L2 (added to the gradient) or, if decoupled, AdamW's
  // p -= lr · weight_decay · p.
  template <class T>
  static void adam_update(T* p, const T* g, T* m, T* v, index_t n, const AdamStep& s) {
    const T decay = s.decoupled ? T(1) - static_cast<T>(s.learning_rate * s.weight_decay) : T(1);
    const T l2 = s.decoupled ? T(0) : static_cast<T>(s.weight_decay);
    const double root_correction = std::sqrt(s.bias_correction2);
    const auto step = static_cast<T>(s.learning_rate * root_correction / s.bias_correction1);
    kernels::adam_update(p, g, m, v, n,
                         kernels::AdamCoefficients<T>{static_cast<T>(s.beta1), static_cast<T>(s.beta2),
                                                      static_cast<T>(s.eps * root_correction), l2, decay, step});
  }

  template <class T>
  static void sgd_update(T* p, const T* g, T* buf, index_t n, const SgdStep& s) {
    kernels::sgd_update(p, g, buf, n,
                        kernels::SgdCoefficients<T>{static_cast<T>(s.learning_rate), static_cast<T>(s.weight_decay),
                                                    static_cast<T>(s.momentum), static_cast<T>(1 - s.dampening),
                                                    s.momentum != 0, s.nesterov, s.first_step});
  }

  // dz = dy · Fn'(y) for a product's epilogue function, in `masked`, by Backend's map_grad;
  // dy itself without one.
  template <class Backend = Eigen, class T, class... Fns>
  static const T* masked_gradient(const DenseBackwardArgs<T>& a, const std::tuple<Fns...>& fns,
                                  duet::detail::Storage& masked) {
    static_assert(sizeof...(Fns) <= 1, "duet: a product's epilogue differentiates through one function at most");
    if constexpr (sizeof...(Fns) == 1) {
      masked = duet::detail::Storage(static_cast<std::size_t>(a.rows * a.out) * sizeof(T));
      T* m = reinterpret_cast<T*>(masked.data());
      Backend::map_grad(std::get<0>(fns), a.dy, a.y, a.rows * a.out, m);
      return m;
    } else {
      return a.dy;
    }
  }

  template <class T>
  static void column_sums(const T* x, index_t rows, index_t cols, T* sums, bool accumulate) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<::Eigen::Matrix<T, 1, ::Eigen::Dynamic>> s(sums, 1, cols);
    if (accumulate) s += ::Eigen::Map<const Matrix>(x, rows, cols).colwise().sum();
    else s = ::Eigen::Map<const Matrix>(x, rows, cols).colwise().sum();
  }

 private:
  template <class L>
  static index_t checked_label(L label, index_t row, index_t classes) {
    const auto c = static_cast<index_t>(label);
    if (c < 0 || c >= classes) {
      throw ValueError("nn::SoftmaxCrossEntropyWithLogits: label " + std::to_string(c) + " of sample " +
                       std::to_string(row) + " is outside [0, " + std::to_string(classes) + ")");
    }
    return c;
  }
};

// backend::Eigen with duet's own dense kernel (kernels::gemm), which applies the epilogue to
// each tile of the output while it is in registers. It does so for functions with a vector
// form of a few instructions (ReLU); kernels::activation's (sigmoid, GELU, ...) and those
// without a vector form (LeakyReLU with its alpha, ...) run as the map kernel over the finished
// product, so that the product's bits are the ones PyNative's unfused MatMul gets. Element
// types the kernel cannot take fall back to Eigen.
struct Native : Eigen {
  // Whether Fns run in the product's registers. kernels::activation's run over the finished
  // product, eight vectors at a time: one vector at a time, as a tile's epilogue has them, each
  // waited on its own chain of dependent FMAs, and GELU after a [256, 512] x [512, 512] product
  // took about twice the map's time.
  template <class T, class... Fns>
  static constexpr bool in_registers = kernels::gemm_supports<T, Fns...> && !(requires { Fns::kernel_activation; } || ...);

  // map() on the instruction set chosen at run time, with the functions' vector forms (the
  // code a product's epilogue runs); a function without one goes to Eigen. A chain of both
  // kinds takes turns, so that each function computes the bits it computes alone (PyNative's
  // separate maps).
  template <class... Fns, class T>
  static void map(const std::tuple<Fns...>& fns, const T* x, index_t n, T* y) {
    if constexpr (kernels::gemm_supports<T, Fns...>) {
      kernels::map<Fns...>(x, n, y);
    } else if constexpr (sizeof...(Fns) > 1) {
      detail::map_in_turns(fns, x, n, y,
                           [](const auto& f, const T* from, index_t m, T* to) { map(std::tuple{f}, from, m, to); });
    } else if constexpr ((std::is_empty_v<Fns> && ...)) {
      // Functions without parameters are made afresh: GCC 12 takes a copy of an empty tuple (a
      // fused product's epilogue) for uninitialised memory (-Wmaybe-uninitialized).
      Eigen::map<Fns...>(x, n, y);
    } else {
      Eigen::map(fns, x, n, y);
    }
  }
  template <class... Fns, class T>
  static void map(const T* x, index_t n, T* y) {
    map(std::tuple<Fns...>{}, x, n, y);
  }

  // map_grad() on the instruction set chosen at run time, for functions whose gradient has a
  // vector form (fn::Relu's select: the same bits as Eigen's); the others go to Eigen.
  template <class Fn, class T>
  static void map_grad(const Fn& f, const T* dy, const T* y, index_t n, T* dx) {
    if constexpr (kernels::VectorGradient<Fn, T>) kernels::map_grad<Fn>(dy, y, n, dx);
    else Eigen::map_grad(f, dy, y, n, dx);
  }
  template <class Fn, class T>
  static void map_grad(const T* dy, const T* y, index_t n, T* dx) {
    map_grad(Fn{}, dy, y, n, dx);
  }

  // Σ over rows on the instruction set chosen at run time, in one order of sums for every
  // build: Eigen's colwise sum orders them by its packet width (so by -march) and took 45-57 us
  // for the seed network's [256, 512] gradient, on the calling thread between the products.
  template <class T>
  static void column_sums(const T* x, index_t rows, index_t cols, T* sums, bool accumulate) {
    if constexpr (kernels::VectorElement<T>) {
      if (rows > 0) {
        kernels::column_sums(x, rows, cols, sums, accumulate);
        return;
      }
    }
    Eigen::column_sums(x, rows, cols, sums, accumulate);
  }
  template <class T>
  static void bias_grad(const T* dy, index_t rows, index_t cols, T* db, bool accumulate) {
    column_sums(dy, rows, cols, db, accumulate);
  }

  // The bias on the instruction set chosen at run time, with Eigen's bits (one IEEE sum each).
  template <class T>
  static void add_bias(const T* x, index_t rows, index_t cols, const T* bias, T* y) {
    if constexpr (kernels::VectorElement<T>) kernels::add_bias(x, rows, cols, bias, y);
    else Eigen::add_bias(x, rows, cols, bias, y);
  }

  template <index_t In, index_t Out, class T, class... Fns>
  static void dense(const T* x, index_t rows, index_t in, const T* w, index_t out,
                    const Epilogue<T, Fns...>& epilogue, T* y) {
    if constexpr (in_registers<T, Fns...>) {
      kernels::gemm<In, Out, Fns...>(x, rows, in, w, out, epilogue.bias, y);
    } else if constexpr (kernels::gemm_supports<T>) {
      kernels::gemm<In, Out>(x, rows, in, w, out, epilogue.bias, y);
      map(epilogue.fns, y, rows * out, y);
    } else {
      Eigen::dense<In, Out>(x, rows, in, w, out, epilogue, y);
    }
  }

  template <class T>
  static void matmul(const T* a, index_t m, index_t k, const T* b, index_t n, T* c) {
    if constexpr (kernels::gemm_supports<T>) kernels::gemm_kn(a, m, k, b, n, c);
    else Eigen::matmul(a, m, k, b, n, c);
  }

  // Both products on duet's GEMM, so that they run on the instruction set chosen at run time
  // and on every thread, as the forward product does: dx = dz · w is gemm_kn (w is [out, in],
  // the [k, n] it reads), and dw (+)= dzᵀ · x is gemm_kn on a transposed copy of dz, which
  // costs rows·out copies against the product's rows·out·in multiply-adds and leaves x, the
  // larger operand, read in place. dw and db sum over the batch in halves
  // (kernels/detail/halves.hpp): a batch's gradient is its halves' (2 ranks') to the bit.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_backward(const DenseBackwardArgs<T>& a, const std::tuple<Fns...>& fns = {}) {
    if constexpr (!kernels::gemm_supports<T>) {
      Eigen::dense_backward<In, Out>(a, fns);
    } else {
      duet::detail::Storage masked;
      const T* dz = masked_gradient<Native>(a, fns, masked);
      duet::detail::Storage transposed(static_cast<std::size_t>(a.rows * a.out) * sizeof(T));
      T* dzt = reinterpret_cast<T*>(transposed.data());
      kernels::transpose(dz, a.rows, a.out, dzt);
      kernels::gemm_kn(dzt, a.out, a.rows, a.x, a.in, a.dw, a.accumulate_w, true);
      if (a.db != nullptr) column_sums(dz, a.rows, a.out, a.db, a.accumulate_b);
      if (a.dx != nullptr) kernels::gemm_kn(dz, a.rows, a.out, a.w, a.in, a.dx);
    }
  }

  // The weight is packed once per version of it (the parameter keeps the packed form), not
  // on every call; the product reads the same numbers in the same order, so the result is
  // the bits of dense().
  using dense_packed_of = Native;
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_packed(const T* x, index_t rows, index_t in, const nn::BasicParameter<T>& w, index_t out,
                           const Epilogue<T, Fns...>& epilogue, T* y) {
    if constexpr (kernels::gemm_supports<T>) {
      if (kernels::reads_packed_weight<In, Out>(rows, in, out)) {
        // A type per instruction set, so that after a set_kernel_isa the parameter packs again
        // for the new set instead of keeping a form the product cannot read.
        const kernels::Isa isa = kernels::active_isa();
        kernels::detail::with_kernels(isa, [&]<class Kernels>(Kernels) {
          using Packed = kernels::PackedWeightFor<T, Kernels>;
          const auto packed = w.template derived<Packed>([&] { return Packed(w.data(), out, in, isa); });
          if constexpr (in_registers<T, Fns...>) {
            kernels::gemm<In, Out, Fns...>(x, rows, in, w.data(), out, epilogue.bias, y, packed.get());
          } else {
            kernels::gemm<In, Out>(x, rows, in, w.data(), out, epilogue.bias, y, packed.get());
            map(epilogue.fns, y, rows * out, y);
          }
        });
        return;
      }
    }
    dense<In, Out>(x, rows, in, w.data(), out, epilogue, y);
  }
};

}  // namespace backend

namespace backend {
// Whether a product may call Backend::dense_packed for what Backend::dense computes. A backend
// deriving from another that replaces dense() alone inherits a dense_packed that would bypass
// the replacement (tests/backend.cpp's counting backend saw no calls once O1 packed weights): its
// products call dense() then, which runs the replacement and packs on every call.
template <class Backend, index_t In, index_t Out, class T, class... Fns>
constexpr bool packs_as_dense() {
  if constexpr (requires { typename Backend::dense_packed_of; }) {
    return &Backend::template dense<In, Out, T, Fns...> ==
           &Backend::dense_packed_of::template dense<In, Out, T, Fns...>;
  } else {
    return false;
  }
}

// Whether Backend's dense<In, Out> may give other bits than its dense<dyn, dyn>. Native's
// differs only where the GEMM unrolls small static layers (or falls back to Eigen for types it
// has no kernels for); Eigen's fixed-size products are other code. Where it does not, an
// nn::Dense<In, Out> runs Dense<>'s code in both modes (nn::SizedLayer).
template <class Backend, index_t In, index_t Out, class T>
constexpr bool dense_depends_on_sizes() {
  if constexpr (std::is_same_v<Backend, Native>) return !kernels::gemm_supports<T> || kernels::unrolls<In, Out>;
  else return In != dyn || Out != dyn;
}
}  // namespace backend

#ifdef DUET_DEFAULT_BACKEND
using DefaultBackend = DUET_DEFAULT_BACKEND;
#else
// Native: on the seed network, single-threaded, it runs batches of 64 and 256 about 1.35x
// faster than Eigen's products, and tiny layers in half the time (benchmarks/gemm.cpp).
using DefaultBackend = backend::Native;
#endif

}  // namespace duet
