// Arithmetic: + - * / and the other binary elementwise functions, with numpy broadcasting,
// between tensors and with scalars, in both modes (MindSpore's ops.add, ops.mul, ...).
//
// A binary function is a type with apply(a, b) and the partial derivative of each argument,
// partial<K>(a, b). One operation, BroadcastOp<Fn>, runs any of them: its shape rule is
// numpy's, its kernel walks the output once, and the gradient of input K is that partial
// times the incoming gradient, summed over the axes input K was broadcast along (so that it
// has input K's shape). With a scalar the same functions run in ScalarOp, which keeps the
// scalar in the operation rather than in a tensor.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../eager.hpp"
#include "../kernels/elementwise.hpp"
#include "../nn/activation.hpp"
#include "../operation.hpp"

namespace duet {

namespace fn {

// A binary function written once, in place on numbers and on SIMD vectors alike (Fn::apply_in_place,
// by reference, as fn::Relu's: a vector never crosses a call between code compiled for different
// instruction sets); apply() gives its value. kernels::binary runs it on the vectors of the set
// chosen at run time.
template <class Fn>
struct InPlaceBinary {
  template <class T>
  static T apply(T a, T b) {
    Fn::apply_in_place(a, b);
    return a;
  }
};

struct Add : InPlaceBinary<Add> {
  static constexpr std::string_view name = "Add";
  static constexpr std::string_view onnx = "Add";  // its operator in ONNX
  template <class V>
  static void apply_in_place(V& a, const V& b) {
    a = a + b;
  }
  template <int K, class T>
  static T partial(T, T) {
    return T(1);
  }
};

struct Sub : InPlaceBinary<Sub> {
  static constexpr std::string_view name = "Sub";
  static constexpr std::string_view onnx = "Sub";  // its operator in ONNX
  template <class V>
  static void apply_in_place(V& a, const V& b) {
    a = a - b;
  }
  template <int K, class T>
  static T partial(T, T) {
    return K == 0 ? T(1) : T(-1);
  }
};

struct Mul : InPlaceBinary<Mul> {
  static constexpr std::string_view name = "Mul";
  static constexpr std::string_view onnx = "Mul";  // its operator in ONNX
  template <class V>
  static void apply_in_place(V& a, const V& b) {
    a = a * b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    return K == 0 ? b : a;
  }
};

struct Div : InPlaceBinary<Div> {
  static constexpr std::string_view name = "Div";
  static constexpr std::string_view onnx = "Div";  // its operator in ONNX
  // Integers divide as C++ does, truncating toward zero (-7 / 2 is -3; PyTorch's // floors);
  // a zero divisor, or the one quotient that overflows, is an error rather than the signal
  // that ends the process.
  template <class V>
  static void apply_in_place(V& a, const V& b) {
    if constexpr (std::is_integral_v<V>) {
      if (b == 0) throw ValueError("duet::ops::div: integer division by zero");
      if constexpr (std::is_signed_v<V>) {
        if (b == -1 && a == std::numeric_limits<V>::min()) {
          throw ValueError("duet::ops::div: integer division overflows (" + std::to_string(a) + " / -1)");
        }
      }
    }
    a = a / b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    return K == 0 ? T(1) / b : -a / (b * b);
  }
};

// Ties send half the gradient each way, as PyTorch does: the derivative there is undefined,
// and any other choice makes maximum(x, x) differ from x. Where either side is NaN (the result
// is NaN) both sides get the whole gradient, as in PyTorch, whichever side holds the NaN.
struct Maximum : InPlaceBinary<Maximum> {
  static constexpr std::string_view name = "Maximum";
  static constexpr std::string_view onnx = "Max";  // its operator in ONNX
  template <class V>
  static void apply_in_place(V& a, const V& b) {
    // NaN propagates from either side, as their sum. Only ordered comparisons: GCC lowers a
    // self-comparison (a != a) on a vector lane by lane, which made maximum 50x slower.
    a = a > b ? a : (a <= b ? b : a + b);
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if (a == b) return T(0.5);
    if (a != a || b != b) return T(1);
    return (K == 0) == (a > b) ? T(1) : T(0);
  }
};

struct Minimum : InPlaceBinary<Minimum> {
  static constexpr std::string_view name = "Minimum";
  static constexpr std::string_view onnx = "Min";  // its operator in ONNX
  template <class V>
  static void apply_in_place(V& a, const V& b) {
    a = a < b ? a : (a >= b ? b : a + b);
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if (a == b) return T(0.5);
    if (a != a || b != b) return T(1);
    return (K == 0) == (a < b) ? T(1) : T(0);
  }
};

// a^b. d/db = a^b · log a, which is NaN for a < 0 as the real power is; at a = 0 it is 0
// where the power itself is (b > 0), as PyTorch defines it.
struct Pow {
  static constexpr std::string_view name = "Pow";
  static constexpr std::string_view onnx = "Pow";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return static_cast<T>(std::pow(a, b));
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if constexpr (K == 0) {
      return b == T(0) ? T(0) : static_cast<T>(b * std::pow(a, b - T(1)));
    } else {
      return a == T(0) && b > T(0) ? T(0) : static_cast<T>(std::pow(a, b) * std::log(a));
    }
  }
};

}  // namespace fn

namespace ops {

// numpy's broadcasting of two shapes, aligned at their last axes: each pair of sizes must be
// equal or one of them 1. A dynamic size matches anything, and unknown leading axes stay
// unknown.
constexpr ShapeResult broadcast_shapes(const Shape& a, const Shape& b) {
  const int rank = std::max(a.rank(), b.rank());
  std::array<index_t, max_rank> dims{};
  bool ok = true;
  for (int i = 1; i <= rank; ++i) {
    const index_t da = i <= a.rank() ? a[-i] : (a.leading_unknown() ? dyn : 1);
    const index_t db = i <= b.rank() ? b[-i] : (b.leading_unknown() ? dyn : 1);
    index_t d = da;
    if (da == db || db == 1) d = da;
    else if (da == 1) d = db;
    else if (da == dyn) d = db;
    else if (db == dyn) d = da;
    else ok = false;
    dims[static_cast<std::size_t>(rank - i)] = d;
  }
  Shape out = a.leading_unknown() || b.leading_unknown() ? Shape::any() : Shape{};
  for (int i = 0; i < rank; ++i) out.push_back(dims[static_cast<std::size_t>(i)]);
  // Which input to blame: the one of lower rank, or the second.
  if (!ok) return fault(out, ShapeFault::broadcast, 0, b.rank() <= a.rank() ? 1 : 0);
  return {out};
}

namespace detail {

// Where each output element reads an input broadcast to the output's shape: the input's
// strides in the output's axes, 0 along broadcast axes.
inline std::array<index_t, max_rank> broadcast_strides(const Shape& in, const Shape& out) {
  std::array<index_t, max_rank> strides{};
  index_t stride = 1;
  for (int i = 1; i <= out.rank(); ++i) {
    const std::size_t axis = static_cast<std::size_t>(out.rank() - i);
    if (i <= in.rank() && in[-i] != 1) {
      strides[axis] = stride;
    }
    if (i <= in.rank()) stride *= in[-i];
  }
  return strides;
}

// Calls row(first, count, start, step) for each run of output elements [first, first + count)
// along which every input advances by a constant step: input k is read at start[k] +
// j * step[k] for the j-th element of the run. The whole output is one run when the shapes
// are equal, a row of the last axis otherwise.
template <std::size_t N, class Row>
void for_each_broadcast_row(const std::array<Shape, N>& in, const Shape& out, Row&& row) {
  const index_t n = out.numel();
  if (n == 0) return;
  std::array<index_t, N> at{};
  std::array<index_t, N> step{};
  if (std::all_of(in.begin(), in.end(), [&](const Shape& s) { return s == out; })) {
    step.fill(1);
    row(index_t{0}, n, at, step);
    return;
  }
  std::array<std::array<index_t, max_rank>, N> strides;
  for (std::size_t k = 0; k < N; ++k) strides[k] = broadcast_strides(in[k], out);
  const int rank = out.rank();
  const index_t inner = rank == 0 ? 1 : out[-1];
  for (std::size_t k = 0; k < N; ++k) step[k] = rank == 0 ? 0 : strides[k][static_cast<std::size_t>(rank - 1)];
  std::array<index_t, max_rank> index{};
  for (index_t i = 0; i < n; i += inner) {
    row(i, inner, at, step);
    // The odometer over the outer axes, last first.
    for (int axis = rank - 2; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      for (std::size_t k = 0; k < N; ++k) at[k] += strides[k][ax];
      if (index[ax] < out[axis]) break;
      for (std::size_t k = 0; k < N; ++k) at[k] -= strides[k][ax] * index[ax];
      index[ax] = 0;
    }
  }
}

// out[j] = Fn(a[j·sa], b[j·sb]) for j < n: on the kernels' vectors of the instruction set chosen
// at run time where Fn has a vector form and each input is a run (stride 1) or one value
// (stride 0), as every broadcast row is; element by element otherwise (pow, integers).
template <class Fn, class T>
void apply_run(const T* a, index_t sa, const T* b, index_t sb, index_t n, T* out) {
  if constexpr (kernels::VectorBinary<Fn, T>) {
    if (n > 0 && (sa == 0 || sa == 1) && (sb == 0 || sb == 1)) {
      kernels::binary<Fn>(a, sa == 1, b, sb == 1, n, out);
      return;
    }
  }
  for (index_t j = 0; j < n; ++j) out[j] = Fn::apply(a[j * sa], b[j * sb]);
}

// Calls f(i, ia, ib) for each output element i, with the elements ia and ib of the two inputs
// it reads, in the order of the output.
template <class F>
void for_each_broadcast(const Shape& a, const Shape& b, const Shape& out, F&& f) {
  for_each_broadcast_row<2>(std::array<Shape, 2>{a, b}, out,
                            [&](index_t first, index_t count, const std::array<index_t, 2>& start,
                                const std::array<index_t, 2>& step) {
                              for (index_t j = 0; j < count; ++j) {
                                f(first + j, start[0] + j * step[0], start[1] + j * step[1]);
                              }
                            });
}

}  // namespace detail

template <class Fn, int K>
struct BroadcastGradOp;
template <class Fn, class... Epilogue>
struct BroadcastOp;

// An elementwise expression tree over the inputs of a fused operation: input I, or Fn of two
// subtrees.
template <int I>
struct Arg {};
template <class Fn, class L, class R>
struct Apply {};

namespace detail {

// A run of up to `block` elements of one operand: strided in an input, contiguous in a block
// buffer.
template <class T>
struct Operand {
  const T* data;
  index_t stride;
};

// Where a fused epilogue runs: over [0, n) in blocks of epilogue_block from 0, each once the
// walk over the output has written up to its end. PyNative maps a function over the whole
// output, which the vectorised functions Eigen gives (exp, sin, log1p) split into vectors and
// a scalar tail of other bits; a broadcast walks the output a row at a time, and an epilogue
// per row would take the scalar path on rows shorter than a vector (a helper's exp(x * w)
// with w [1, 2] differed from PyNative in 122 of 512 elements). Blocks that are multiples of
// every vector width, from the same aligned start, split where the whole pass does.
inline constexpr index_t epilogue_block = 1024;
class EpilogueBlocks {
 public:
  explicit EpilogueBlocks(index_t n) : n_(n) {}
  // The output is written up to `end`: runs done(first, count) on each block now complete.
  template <class Done>
  void written_to(index_t end, Done&& done) {
    while (next_ < end && (end - next_ >= epilogue_block || end == n_)) {
      const index_t count = std::min(epilogue_block, end - next_);
      done(next_, count);
      next_ += count;
    }
  }

 private:
  index_t n_;
  index_t next_ = 0;
};

// Evaluates a tree on a run of `count` (<= block) output elements, each subtree into a block
// buffer of its own, a loop per node. Every intermediate value is stored in T before the next
// node reads it, so the compiler cannot contract a multiply and an add into one FMA: the
// result is the unfused operations' bit for bit, as PyNative computes them.
template <class Tree>
struct tree;
template <int I>
struct tree<Arg<I>> {
  static constexpr std::size_t buffers = 0;
  template <class T, std::size_t N>
  static Operand<T> eval(const std::array<const T*, N>& in, const std::array<index_t, N>& start,
                         const std::array<index_t, N>& step, index_t, index_t, T*, T*) {
    return {in[I] + start[I], step[I]};
  }
  static std::string text() { return std::string(1, static_cast<char>('a' + I)); }
};
template <class Fn, class L, class R>
struct tree<Apply<Fn, L, R>> {
  // Blocks of scratch the subtrees need: one per inner node, the root writing to its destination.
  static constexpr std::size_t buffers = tree<L>::buffers + tree<R>::buffers + 2;
  template <class T, std::size_t N>
  static Operand<T> eval(const std::array<const T*, N>& in, const std::array<index_t, N>& start,
                         const std::array<index_t, N>& step, index_t count, index_t block, T* destination,
                         T* scratch) {
    const Operand<T> l = tree<L>::eval(in, start, step, count, block, scratch, scratch + block);
    const Operand<T> r = tree<R>::eval(in, start, step, count, block, scratch + block * (1 + tree<L>::buffers),
                                       scratch + block * (2 + tree<L>::buffers));
    apply_run<Fn>(l.data, l.stride, r.data, r.stride, count, destination);
    return {destination, 1};
  }
  static std::string text() { return std::string(Fn::name) + "(" + tree<L>::text() + ", " + tree<R>::text() + ")"; }
};

// The run of a fused pass: its scratch (Buffers blocks) within 16 KiB, in L1 beside the inputs'
// runs, and at most an epilogue block; whole vectors of every set. Each node is a kernel call per
// run, and runs of 256 floats made the calls a third of gelu(x * w + b)'s time.
template <class T, std::size_t Buffers>
inline constexpr index_t fused_block =
    std::clamp<index_t>(static_cast<index_t>(16384 / (std::max<std::size_t>(Buffers, 1) * sizeof(T))) / 64 * 64, 64,
                        epilogue_block);

}  // namespace detail

// A chain of binary elementwise operations fused into one pass over N inputs (Tree), then the
// unary functions Epilogue: what fuse_epilogues makes of `x * w + b` in a graph that is not
// differentiated, so the intermediate values are never written.
template <std::size_t N, class Tree, class... Epilogue>
struct ElementwiseOp : Primitive<ElementwiseOp<N, Tree, Epilogue...>> {
  static constexpr int arity = static_cast<int>(N);

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    ShapeResult r{in[0]};
    for (std::size_t k = 1; k < N && r.ok(); ++k) {
      r = broadcast_shapes(r.shape, in[k]);
      if (!r.ok()) r.input = static_cast<int>(k);
    }
    return r;
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    std::array<const T*, N> in;
    std::array<Shape, N> shapes;
    for (std::size_t k = 0; k < N; ++k) {
      in[k] = a.in<T>(k);
      shapes[k] = a.in_shape(k);
    }
    T* out = a.out<T>();
    constexpr index_t block = detail::fused_block<T, detail::tree<Tree>::buffers>;
    std::array<T, block * detail::tree<Tree>::buffers> scratch;
    [[maybe_unused]] detail::EpilogueBlocks blocks(a.output_shape.numel());
    detail::for_each_broadcast_row<N>(
        shapes, a.output_shape,
        [&](index_t first, index_t count, const std::array<index_t, N>& start, const std::array<index_t, N>& step) {
          for (index_t done = 0; done < count; done += block) {
            const index_t n = std::min(block, count - done);
            std::array<index_t, N> at = start;
            for (std::size_t k = 0; k < N; ++k) at[k] += done * step[k];
            detail::tree<Tree>::eval(in, at, step, n, block, out + first + done, scratch.data());
            if constexpr (sizeof...(Epilogue) > 0) {
              blocks.written_to(first + done + n, [&](index_t from, index_t m) {
                Backend::template map<Epilogue...>(out + from, m, out + from);
              });
            }
          }
        });
  }

  // Functions with parameters (LeakyReLU's alpha) are not taken: the op holds no values
  // for its epilogue, and would run them with their defaults.
  template <class C>
  static constexpr bool accepts_epilogue = requires { requires C::parameterless; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>&) const {
    return ElementwiseOp<N, Tree, Epilogue..., Gs...>{};
  }
  // This value as input Pos of a binary elementwise operation: one more input, one more level.
  template <int Pos, class Fn2>
    requires(sizeof...(Epilogue) == 0)
  auto absorb_operand(const BroadcastOp<Fn2>&) const {
    using Other = Arg<static_cast<int>(N)>;
    return ElementwiseOp<N + 1, std::conditional_t<Pos == 0, Apply<Fn2, Tree, Other>, Apply<Fn2, Other, Tree>>>{};
  }

  // It keeps none of the values between its steps: a graph to differentiate is not fused so.
  static constexpr bool differentiable = false;

  static std::string op_name() {
    std::string s = "Elementwise " + detail::tree<Tree>::text();
    ((s += " + " + std::string(Epilogue::name)), ...);
    return s;
  }
};

// Fn(a, b) elementwise, a and b broadcast to a common shape, then the unary functions Epilogue
// (fuse_epilogues moves elementwise functions that follow it here, so the value is written
// once).
template <class Fn, class... Epilogue>
struct BroadcastOp : Primitive<BroadcastOp<Fn, Epilogue...>> {
  using layer_type = BroadcastOp<Fn>;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_shapes(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* out = a.out<T>();
    [[maybe_unused]] detail::EpilogueBlocks blocks(a.output_shape.numel());
    detail::for_each_broadcast_row<2>(
        {a.in_shape(0), a.in_shape(1)}, a.output_shape,
        [&](index_t first, index_t count, const std::array<index_t, 2>& start, const std::array<index_t, 2>& step) {
          if constexpr (sizeof...(Epilogue) == 0) {
            detail::apply_run<Fn>(x + start[0], step[0], y + start[1], step[1], count, out + first);
          } else {
            // In runs that stay in cache until the epilogue has seen them.
            for (index_t r = 0; r < count; r += detail::epilogue_block) {
              const index_t m = std::min(detail::epilogue_block, count - r);
              detail::apply_run<Fn>(x + start[0] + r * step[0], step[0], y + start[1] + r * step[1], step[1], m,
                                    out + first + r);
              blocks.written_to(first + r + m, [&](index_t from, index_t k) {
                Backend::template map<Epilogue...>(out + from, k, out + from);
              });
            }
          }
        });
  }

  // Functions with parameters (LeakyReLU's alpha) are not taken: the op holds no values
  // for its epilogue, and would run them with their defaults.
  template <class C>
  static constexpr bool accepts_epilogue = requires { requires C::parameterless; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>&) const {
    return BroadcastOp<Fn, Epilogue..., Gs...>{};
  }
  template <int Pos, class Fn2>
    requires(sizeof...(Epilogue) == 0)
  auto absorb_operand(const BroadcastOp<Fn2>& next) const {
    return ElementwiseOp<2, Apply<Fn, Arg<0>, Arg<1>>>{}.template absorb_operand<Pos>(next);
  }

  // Fused with an epilogue it keeps no value between Fn and the epilogue to differentiate from.
  static constexpr bool differentiable = sizeof...(Epilogue) == 0;
  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return BroadcastGradOp<Fn, static_cast<int>(K)>{};
  }

  static std::string op_name() {
    std::string s(Fn::name);
    ((s += " + " + std::string(Epilogue::name)), ...);
    return s;
  }

  // ONNX broadcasts as numpy does, as duet does.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (sizeof...(Epilogue) == 0 && requires { Fn::onnx; }) {
      return {{std::string(Fn::onnx), {InterchangeInput::operand(0), InterchangeInput::operand(1)}, {}}};
    } else {
      return {};
    }
  }
};

// d/d input K of Fn(a, b): dy · partial_K(a, b), summed over the axes input K was broadcast
// along.
template <class Fn, int K>
struct BroadcastGradOp : Primitive<BroadcastGradOp<Fn, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* d = a.out<T>();
    const Shape& target = a.in_shape(1 + K);
    const Shape& out = a.in_shape(0);
    if (target == out) {
      detail::for_each_broadcast(a.in_shape(1), a.in_shape(2), out, [&](index_t i, index_t ia, index_t ib) {
        d[i] = dy[i] * Fn::template partial<K>(x[ia], y[ib]);
      });
      return;
    }
    std::fill_n(d, target.numel(), T(0));
    detail::for_each_broadcast(a.in_shape(1), a.in_shape(2), out, [&](index_t i, index_t ia, index_t ib) {
      d[K == 0 ? ia : ib] += dy[i] * Fn::template partial<K>(x[ia], y[ib]);
    });
  }

  static std::string op_name() { return std::string(Fn::name) + "Grad" + std::to_string(K); }
};

template <class Fn, bool ScalarFirst>
struct ScalarGradOp;

// Fn(x, s) (or Fn(s, x) if ScalarFirst) elementwise, s a number the operation holds.
template <class Fn, bool ScalarFirst>
struct ScalarOp : Primitive<ScalarOp<Fn, ScalarFirst>> {
  static constexpr int arity = 1;
  double scalar;
  ScalarOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* out = a.out<T>();
    const T s = static_cast<T>(scalar);
    const index_t n = a.in_shape().numel();
    if constexpr (ScalarFirst) detail::apply_run<Fn>(&s, 0, x, 1, n, out);
    else detail::apply_run<Fn>(x, 1, &s, 0, n, out);
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ScalarGradOp<Fn, ScalarFirst>{scalar};
  }

  static std::string op_name() { return std::string(Fn::name) + (ScalarFirst ? "(scalar, x)" : "(x, scalar)"); }

  // The number as a Constant of the network's element type, in its place.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (requires { Fn::onnx; }) {
      InterchangeNode n{std::string(Fn::onnx), {InterchangeInput::operand(0), InterchangeInput::number(scalar)}, {}};
      if constexpr (ScalarFirst) std::swap(n.inputs[0], n.inputs[1]);
      return {std::move(n)};
    } else {
      return {};
    }
  }
};

template <class Fn, bool ScalarFirst>
struct ScalarGradOp : Primitive<ScalarGradOp<Fn, ScalarFirst>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;
  double scalar;
  ScalarGradOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    T* d = a.out<T>();
    const T s = static_cast<T>(scalar);
    const index_t n = a.in_shape(1).numel();
    for (index_t i = 0; i < n; ++i) {
      d[i] = dy[i] * (ScalarFirst ? Fn::template partial<1>(s, x[i]) : Fn::template partial<0>(x[i], s));
    }
  }

  static std::string op_name() { return std::string(Fn::name) + "ScalarGrad"; }
};

// ----------------------------------------------------------------------------------------
// broadcast_to<D...>(x): x repeated to shape D by numpy's rule (MindSpore's
// ops.broadcast_to(input, shape)): sizes aligned at the last axis, each of x's equal to the
// target's or 1, new axes in front; a -1 keeps x's size on an axis x has. A copy. The gradient
// sums dy over the axes x was repeated along, in the output's order, the same in both modes.

// The target D against x's shape: -1s resolved, or the fault. A dynamic size of x is checked
// when it is known, at run time.
constexpr ShapeResult broadcast_to_rule(const Shape& x, Shape to) {
  bool ok = !(x.rank() > to.rank() && !x.leading_unknown());
  for (int i = 1; i <= to.rank(); ++i) {
    if (i > x.rank()) {
      // A new axis in front, where -1 has nothing to keep (unless x has axes compile time does not know).
      if (to[-i] == dyn && !x.leading_unknown()) ok = false;
      continue;
    }
    if (to[-i] == dyn) {
      to[-i] = x[-i];
    } else if (x[-i] != dyn && x[-i] != 1 && x[-i] != to[-i]) {
      ok = false;
    }
  }
  if (!ok) return fault(to, ShapeFault::broadcast_to, 0);
  return {to};
}

struct BroadcastToGradOp;

template <index_t... D>
struct BroadcastToOp : Primitive<BroadcastToOp<D...>> {
  static_assert(((D >= 0 || D == -1) && ...), "duet::ops::broadcast_to: sizes must be >= 0, or -1 to keep the input's");
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_to_rule(in[0], Shape{D...}); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* y = a.out<T>();
    detail::for_each_broadcast_row<1>(std::array<Shape, 1>{a.in_shape()}, a.output_shape,
                                      [&](index_t first, index_t count, const std::array<index_t, 1>& start,
                                          const std::array<index_t, 1>& step) {
                                        for (index_t j = 0; j < count; ++j) y[first + j] = x[start[0] + j * step[0]];
                                      });
  }

  template <std::size_t K>
    requires(K == 0)
  BroadcastToGradOp grad_op() const;

  static std::string op_name() { return "BroadcastTo<" + detail::list_text<index_t>({D...}) + ">"; }
  std::string label() const { return "ops::broadcast_to<" + detail::list_text<index_t>({D...}) + ">"; }
};

// d/dx of broadcast_to: dy summed back onto the element of x each output element copied.
struct BroadcastToGradOp : Primitive<BroadcastToGradOp> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, the forward input (for its shape)

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    T* d = a.out<T>();
    std::fill_n(d, a.in_shape(1).numel(), T(0));
    detail::for_each_broadcast_row<1>(std::array<Shape, 1>{a.in_shape(1)}, a.in_shape(0),
                                      [&](index_t first, index_t count, const std::array<index_t, 1>& start,
                                          const std::array<index_t, 1>& step) {
                                        for (index_t j = 0; j < count; ++j) d[start[0] + j * step[0]] += dy[first + j];
                                      });
  }

  static std::string op_name() { return "BroadcastToGrad"; }
};

template <index_t... D>
template <std::size_t K>
  requires(K == 0)
BroadcastToGradOp BroadcastToOp<D...>::grad_op() const {
  return {};
}

template <index_t... D, class X>
auto broadcast_to(X&& x) {
  return apply(BroadcastToOp<D...>{}, std::forward<X>(x));
}

inline const bool arithmetic_listed =
    list_operations({"add", "sub", "mul", "div", "maximum", "minimum", "pow", "neg", "add_scalar", "sub_scalar",
                     "mul_scalar", "div_scalar", "scalar_sub", "scalar_div", "pow_scalar", "scalar_pow", "broadcast_to"});

// What may stand on either side of an arithmetic operator: a tensor, a static tensor, a
// parameter or what operations on parameters alone made, or a symbolic tensor in construct.
template <class X>
concept TensorLike = is_tensor_v<std::remove_cvref_t<X>> || is_static_tensor_v<std::remove_cvref_t<X>> ||
                     nn::is_parameter_made_v<std::remove_cvref_t<X>> || graph::Symbolic<X>;

template <class S>
concept Scalar = std::is_arithmetic_v<std::remove_cvref_t<S>>;

// What arithmetic takes: tensors and numbers, at least one a tensor.
template <class A, class B>
concept Operands = (TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>);

// Whether number S with a tensor of X would lose its fraction: a floating-point number with an
// integer tensor, which runs in the tensor's type (where PyTorch would promote to float).
template <class S, class X>
inline constexpr bool truncates =
    std::is_floating_point_v<std::remove_cvref_t<S>> && std::is_integral_v<typename std::remove_cvref_t<X>::value_type>;

// static_assert takes a literal.
#define DUET_DETAIL_TRUNCATION_MESSAGE                                                                              \
  "duet::ops: an integer tensor with a floating-point number: the operation runs in the tensor's element type, so " \
  "the number would lose its fraction (x * 0.5 would be x * 0); write an integer, or compute on a floating-point "   \
  "tensor"

// Fn(a, b) for any mix of tensors and numbers (two numbers are not an operation).
template <class Fn, class A, class B>
auto binary(const A& a, const B& b) {
  if constexpr (Scalar<A>) {
    static_assert(!truncates<A, B>, DUET_DETAIL_TRUNCATION_MESSAGE);
    return apply(ScalarOp<Fn, true>{static_cast<double>(a)}, b);
  } else if constexpr (Scalar<B>) {
    static_assert(!truncates<B, A>, DUET_DETAIL_TRUNCATION_MESSAGE);
    return apply(ScalarOp<Fn, false>{static_cast<double>(b)}, a);
  } else {
    static_assert(std::is_same_v<typename std::remove_cvref_t<A>::value_type, typename std::remove_cvref_t<B>::value_type>,
                  "duet::ops: both operands of an arithmetic operation must have the same element type");
    return apply(BroadcastOp<Fn>{}, a, b);
  }
}

template <class A, class B>
  requires Operands<A, B>
auto add(const A& a, const B& b) {
  return binary<fn::Add>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto sub(const A& a, const B& b) {
  return binary<fn::Sub>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto mul(const A& a, const B& b) {
  return binary<fn::Mul>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto div(const A& a, const B& b) {
  return binary<fn::Div>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto maximum(const A& a, const B& b) {
  return binary<fn::Maximum>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto minimum(const A& a, const B& b) {
  return binary<fn::Minimum>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto pow(const A& a, const B& b) {
  return binary<fn::Pow>(a, b);
}

template <class X>
  requires TensorLike<X>
auto neg(const X& x) {
  return binary<fn::Mul>(x, -1);
}

}  // namespace ops

// The operators, found by argument-dependent lookup on duet's tensors and graph::Sym.
#define DUET_DETAIL_ARITHMETIC_OPERATOR(op, function)                                                   \
  template <class A, class B>                                                                          \
    requires ops::Operands<A, B>                                                                       \
  auto operator op(const A& a, const B& b) {                                                           \
    return ops::function(a, b);                                                                        \
  }
DUET_DETAIL_ARITHMETIC_OPERATOR(+, add)
DUET_DETAIL_ARITHMETIC_OPERATOR(-, sub)
DUET_DETAIL_ARITHMETIC_OPERATOR(*, mul)
DUET_DETAIL_ARITHMETIC_OPERATOR(/, div)

template <class X>
  requires ops::TensorLike<X>
auto operator-(const X& x) {
  return ops::neg(x);
}

namespace graph {
using duet::operator+;
using duet::operator-;
using duet::operator*;
using duet::operator/;
}  // namespace graph

#undef DUET_DETAIL_ARITHMETIC_OPERATOR

}  // namespace duet
