// duet: one neural network, two modes. Single-header edition.
// Generated from include/duet by tools/amalgamate.cpp; edit include/, then run
// `cmake --build <build> --target single_include`.
#pragma once
// duet: one neural network, two modes. Include this header for all of duet.

// Kernels: the maths of every operation, shared by both modes.
//
// PyNative calls a kernel once per node on materialised tensors; the graph evaluator calls
// the same kernel, with the epilogue the passes fused into it. A backend is a struct of
// static kernels; the evaluator takes it as a template parameter, so a backend that derives
// from backend::Eigen and redefines one kernel swaps that operation alone, without touching
// capture or passes.

#include <Eigen/Core>

// duet: one neural network, two modes.

#include <cstddef>
#include <cstdint>

#define DUET_VERSION_MAJOR 0
#define DUET_VERSION_MINOR 1
#define DUET_VERSION_PATCH 0

namespace duet {

// Signed, as in numpy and MindSpore: -1 spells "dynamic" in shapes and "from the end" in axes.
using index_t = std::int64_t;

// A dimension whose size is known only at run time (MindSpore writes it as -1 or None).
inline constexpr index_t dyn = -1;

// Shapes live inline (no heap) so that creating a tensor costs one block from the pool.
inline constexpr int max_rank = 8;

}  // namespace duet

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
// Cells: the network model of both modes.
//
// BasicDynamicCell is the runtime-polymorphic interface PyNative mode runs on: a virtual
// forward, a name, forward hooks, children and parameters. Networks can be assembled from it
// at run time. Cell<Derived, Mode> is what a user derives from: it writes one generic
// construct(x), which PyNative calls with tensors (each sub-cell runs at once, through the
// virtual interface) and graph mode calls with a symbolic tensor (each sub-cell appends nodes,
// and the finished graph is optimised and evaluated in one call).

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana/accessors.hpp>
#include <boost/hana/concept/struct.hpp>
#include <boost/hana/first.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/second.hpp>

// Execution modes and the global context (MindSpore's set_context).

#include <atomic>
#include <optional>
#include <utility>

// The one exception hierarchy of duet: every run-time failure is a duet::Error.

#include <stdexcept>
#include <string>

namespace duet {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Shapes that a layer or operation cannot accept.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// An index or axis outside a tensor.
class IndexError : public Error {
 public:
  using Error::Error;
};

// An argument whose value is invalid (negative size, unknown option, ...).
class ValueError : public Error {
 public:
  using Error::Error;
};

// A feature used where the current mode cannot honour it (e.g. hooks inside a graph).
class ModeError : public Error {
 public:
  using Error::Error;
};

// Reading or writing a file failed; FormatError when the bytes themselves are wrong.
class IOError : public Error {
 public:
  using Error::Error;
};

class FormatError : public IOError {
 public:
  using IOError::IOError;
};

}  // namespace duet

namespace duet {

enum class Mode : unsigned char {
  graph,     // MindSpore GRAPH_MODE: capture construct as a static graph, optimise, evaluate once
  pynative,  // MindSpore PYNATIVE_MODE: evaluate each cell as it is called
  context,   // follow the global context at call time
};

inline constexpr Mode GRAPH_MODE = Mode::graph;
inline constexpr Mode PYNATIVE_MODE = Mode::pynative;
inline constexpr Mode CONTEXT_MODE = Mode::context;

// Fields left empty keep their current value, so set_context({.mode = GRAPH_MODE}) changes
// the mode and nothing else.
struct ContextConfig {
  std::optional<Mode> mode;
};

struct Context {
  Mode mode = PYNATIVE_MODE;
};

namespace detail {
// Read on every call of a context-following cell; atomic so threads may switch it freely.
inline std::atomic<Mode>& context_mode() {
  static std::atomic<Mode> mode{PYNATIVE_MODE};
  return mode;
}
}  // namespace detail

inline void set_context(const ContextConfig& config) {
  if (config.mode) {
    // CONTEXT_MODE is what a cell follows, not a mode the context can be in.
    if (*config.mode != GRAPH_MODE && *config.mode != PYNATIVE_MODE) {
      throw ValueError("duet::set_context: mode must be GRAPH_MODE or PYNATIVE_MODE");
    }
    detail::context_mode().store(*config.mode, std::memory_order_relaxed);
  }
}

namespace detail {
// Set while a cell runs in PyNative mode: the cells it calls follow it, not the global
// context, so one call is never half eager and half compiled (a thread switching the context
// meanwhile, or a parent fixed to PYNATIVE_MODE over children that follow the context).
inline bool& eager_call_in_progress() {
  thread_local bool active = false;
  return active;
}
}  // namespace detail

// Marks the current thread as inside an eager call for its lifetime.
class EagerScope {
 public:
  EagerScope() : outer_(std::exchange(detail::eager_call_in_progress(), true)) {}
  EagerScope(const EagerScope&) = delete;
  EagerScope& operator=(const EagerScope&) = delete;
  ~EagerScope() { detail::eager_call_in_progress() = outer_; }

 private:
  bool outer_;
};

inline Context get_context() { return Context{detail::context_mode().load(std::memory_order_relaxed)}; }

// The mode a cell declared with `declared` runs in right now.
inline Mode effective_mode(Mode declared) {
  if (declared != CONTEXT_MODE) return declared;
  if (detail::eager_call_in_progress()) return PYNATIVE_MODE;
  return detail::context_mode().load(std::memory_order_relaxed);
}

}  // namespace duet

#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#define DUET_HAS_CXXABI 1
#endif

namespace duet::detail {

// "duet::nn::Dense<784l, 512l, float>" becomes "nn::Dense<784, 512, float>": the name a user
// wrote, for cell type names in messages and graph dumps.
inline std::string readable_type_name(const std::type_info& type) {
  std::string name = type.name();
#ifdef DUET_HAS_CXXABI
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(type.name(), nullptr, nullptr, &status),
                                                   std::free);
  if (status == 0 && demangled) name = demangled.get();
#endif
  for (std::size_t at; (at = name.find("duet::")) != std::string::npos;) name.erase(at, 6);
  // Integer template arguments of type long print with an 'l' suffix.
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const bool digit_before = i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9';
    const bool closes = i + 1 < name.size() && (name[i + 1] == ',' || name[i + 1] == '>');
    if (name[i] == 'l' && digit_before && closes) continue;
    out += name[i];
  }
  return out;
}

}  // namespace duet::detail
// DUET_CELL_MEMBERS(a, b, ...): makes a cell a Boost.Hana Struct over the listed members,
// without naming the class (so it works inside class templates too). Each member becomes a
// (name, accessor) pair, which is how cells find their children and parameters by name.

#include <boost/hana/pair.hpp>
#include <boost/hana/string.hpp>
#include <boost/hana/tuple.hpp>

#define DUET_DETAIL_MEMBER(m)                                           \
  ::boost::hana::make_pair(BOOST_HANA_STRING(#m), [](auto&& self) -> decltype(auto) { \
    return (static_cast<decltype(self)&&>(self).m);                     \
  })

#define DUET_DETAIL_EXPAND(x) x
#define DUET_DETAIL_FE_1(f, a) f(a)
#define DUET_DETAIL_FE_2(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_1(f, __VA_ARGS__))
#define DUET_DETAIL_FE_3(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_2(f, __VA_ARGS__))
#define DUET_DETAIL_FE_4(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_3(f, __VA_ARGS__))
#define DUET_DETAIL_FE_5(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_4(f, __VA_ARGS__))
#define DUET_DETAIL_FE_6(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_5(f, __VA_ARGS__))
#define DUET_DETAIL_FE_7(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_6(f, __VA_ARGS__))
#define DUET_DETAIL_FE_8(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_7(f, __VA_ARGS__))
#define DUET_DETAIL_FE_9(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_8(f, __VA_ARGS__))
#define DUET_DETAIL_FE_10(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_9(f, __VA_ARGS__))
#define DUET_DETAIL_FE_11(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_10(f, __VA_ARGS__))
#define DUET_DETAIL_FE_12(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_11(f, __VA_ARGS__))
#define DUET_DETAIL_FE_13(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_12(f, __VA_ARGS__))
#define DUET_DETAIL_FE_14(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_13(f, __VA_ARGS__))
#define DUET_DETAIL_FE_15(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_14(f, __VA_ARGS__))
#define DUET_DETAIL_FE_16(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_15(f, __VA_ARGS__))
#define DUET_DETAIL_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, N, ...) N
#define DUET_DETAIL_FOR_EACH(f, ...)                                                                        \
  DUET_DETAIL_EXPAND(DUET_DETAIL_PICK(__VA_ARGS__, DUET_DETAIL_FE_16, DUET_DETAIL_FE_15, DUET_DETAIL_FE_14, \
                                      DUET_DETAIL_FE_13, DUET_DETAIL_FE_12, DUET_DETAIL_FE_11,              \
                                      DUET_DETAIL_FE_10, DUET_DETAIL_FE_9, DUET_DETAIL_FE_8,                \
                                      DUET_DETAIL_FE_7, DUET_DETAIL_FE_6, DUET_DETAIL_FE_5,                 \
                                      DUET_DETAIL_FE_4, DUET_DETAIL_FE_3, DUET_DETAIL_FE_2,                 \
                                      DUET_DETAIL_FE_1)(f, __VA_ARGS__))

// Up to 16 members; a cell with more groups them into sub-cells.
#define DUET_CELL_MEMBERS(...)                                                              \
  struct hana_accessors_impl {                                                              \
    static constexpr auto apply() {                                                         \
      return ::boost::hana::make_tuple(DUET_DETAIL_FOR_EACH(DUET_DETAIL_MEMBER, __VA_ARGS__)); \
    }                                                                                       \
  }
// The graph evaluator: one call runs a whole optimised graph.
//
// Evaluation has two steps. plan() is the run-time half of compiling: for the concrete input
// shapes it infers every node's shape (the rules of capture, now on real sizes; a broken rule
// throws here, before anything runs) and lays out the intermediate values in one arena. run()
// takes the arena and the output tensor from the pool and calls each node's kernel in order:
// no per-node dispatch, and once the pool is warm for these shapes, no heap allocation. A
// plan depends only on the input shapes, so callers keep it and skip planning next time.
//
// Where values live is decided at compile time (plan_buffers): views alias what they view,
// the output node writes straight into the returned tensor, and every other node gets a slot
// that is reused once its last reader has run.

#include <array>
#include <cstddef>
#include <span>
#include <utility>

#include <boost/hana/at.hpp>

// Shape rules' results and how a broken rule is reported: a static_assert naming the layer,
// its requirement and the input shape when the shapes are known at compile time, a
// duet::ShapeError with the same words when they are known only at run time.

#include <array>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

// Shapes: one constexpr type for concrete shapes (tensors) and shape patterns (graphs).
//
// A pattern may hold dynamic dimensions (duet::dyn) and may have unknown leading dimensions
// ("[..., 784]"), which is how graph mode captures a runtime tensor whose rank it cannot know.
// Shape rules are written once over this type and run both at compile time (on patterns,
// to reject mismatches before the program exists) and at run time (on concrete shapes).

#include <array>
#include <initializer_list>
#include <ostream>
#include <string>


namespace duet {

class Shape {
 public:
  constexpr Shape() = default;

  constexpr Shape(std::initializer_list<index_t> dims) {
    if (dims.size() > static_cast<std::size_t>(max_rank)) {
      throw ValueError("duet::Shape: rank " + std::to_string(dims.size()) + " exceeds max_rank " +
                       std::to_string(max_rank));
    }
    for (index_t d : dims) {
      if (d < 0 && d != dyn) {
        throw ValueError("duet::Shape: dimension " + std::to_string(d) +
                         " is negative (only duet::dyn = -1 is allowed, for dynamic sizes)");
      }
      dims_[static_cast<std::size_t>(rank_++)] = d;
    }
  }

  // "[...]": any rank, any sizes. What graph mode knows of a runtime tensor before it runs.
  static constexpr Shape any() {
    Shape s;
    s.leading_unknown_ = true;
    return s;
  }

  // The known trailing dimensions; with leading_unknown() there may be more in front.
  constexpr int rank() const { return rank_; }
  constexpr bool leading_unknown() const { return leading_unknown_; }

  // Axis -1 is the last dimension, as in numpy.
  constexpr index_t operator[](int axis) const { return dims_[static_cast<std::size_t>(normalize(axis))]; }
  constexpr index_t& operator[](int axis) { return dims_[static_cast<std::size_t>(normalize(axis))]; }
  // The last dimension; the shape must have one.
  constexpr index_t back() const { return dims_[static_cast<std::size_t>(rank_ - 1)]; }

  constexpr bool is_concrete() const {
    if (leading_unknown_) return false;
    for (int i = 0; i < rank_; ++i) {
      if (dims_[static_cast<std::size_t>(i)] == dyn) return false;
    }
    return true;
  }

  // Product of all dimensions; dyn if any is unknown.
  constexpr index_t numel() const {
    if (leading_unknown_) return dyn;
    index_t n = 1;
    for (int i = 0; i < rank_; ++i) {
      const index_t d = dims_[static_cast<std::size_t>(i)];
      if (d == dyn) return dyn;
      n *= d;
    }
    return n;
  }

  // Product of dimensions [first, rank); dyn if any is unknown.
  constexpr index_t numel_from(int first) const {
    index_t n = 1;
    for (int i = first; i < rank_; ++i) {
      const index_t d = dims_[static_cast<std::size_t>(i)];
      if (d == dyn) return dyn;
      n *= d;
    }
    return n;
  }

  // This shape with the last dimension replaced; the shape must have one.
  constexpr Shape with_back(index_t d) const {
    Shape s = *this;
    s.dims_[static_cast<std::size_t>(rank_ - 1)] = d;
    return s;
  }

  constexpr void push_back(index_t d) {
    if (rank_ == max_rank) throw ValueError("duet::Shape: rank exceeds max_rank");
    dims_[static_cast<std::size_t>(rank_++)] = d;
  }

  constexpr const index_t* begin() const { return dims_.data(); }
  constexpr const index_t* end() const { return dims_.data() + rank_; }

  friend constexpr bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_ || a.leading_unknown_ != b.leading_unknown_) return false;
    for (int i = 0; i < a.rank_; ++i) {
      if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
    }
    return true;
  }

 private:
  constexpr int normalize(int axis) const {
    const int a = axis < 0 ? axis + rank_ : axis;
    if (a < 0 || a >= rank_) {
      throw IndexError("duet::Shape: axis " + std::to_string(axis) + " is out of range for rank " +
                       std::to_string(rank_));
    }
    return a;
  }

  std::array<index_t, max_rank> dims_{};
  int rank_ = 0;
  bool leading_unknown_ = false;
};

// "[64, 1, 28, 28]", "[?, 784]" (dynamic), "[..., 512]" (unknown leading dimensions).
inline std::string to_string(const Shape& s) {
  std::string out = "[";
  bool first = true;
  if (s.leading_unknown()) {
    out += "...";
    first = false;
  }
  for (index_t d : s) {
    if (!first) out += ", ";
    out += d == dyn ? std::string("?") : std::to_string(d);
    first = false;
  }
  return out + "]";
}

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << to_string(s); }

// A shape fixed at compile time; duet::shape<64, 1, 28, 28> is its value.
template <index_t... Dims>
struct StaticShape {
  static_assert(sizeof...(Dims) <= max_rank, "duet::StaticShape: rank exceeds duet::max_rank");
  static_assert(((Dims >= 0 || Dims == dyn) && ...),
                "duet::StaticShape: dimensions must be >= 0 or duet::dyn");
  static constexpr Shape value{Dims...};
  constexpr operator Shape() const { return value; }
};

template <index_t... Dims>
inline constexpr StaticShape<Dims...> shape{};

}  // namespace duet

namespace duet {

enum class ShapeFault : unsigned char {
  none,
  last_dimension,  // the input's last dimension must equal `expected`
  min_rank,        // the input's rank must be at least `expected`
  exact_rank,      // the input's rank must be exactly `expected`
  element_count,   // the input must hold `expected` elements per sample
  shapes_differ,   // two inputs must have the same shape
};

// What a shape rule returns: the output shape and, if the inputs break the rule, which way.
// On a fault the shape is still the rule's best guess, so the layers after it are checked
// against something sane and one mistake gives one error.
struct ShapeResult {
  Shape shape;
  ShapeFault fault = ShapeFault::none;
  index_t expected = 0;
  int input = 0;  // which input broke the rule

  constexpr bool ok() const { return fault == ShapeFault::none; }
};

constexpr ShapeResult fault(Shape fallback, ShapeFault f, index_t expected, int input = 0) {
  return ShapeResult{fallback, f, expected, input};
}

// "nn::Dense<784, 512> 'dense_relu_sequential.0' expects an input whose last dimension is 784,
// got [64, 100]": the run-time wording of a broken rule.
inline std::string describe_fault(const ShapeResult& r, std::string_view layer, std::span<const Shape> inputs) {
  const std::string got = inputs.empty() ? std::string("nothing") : to_string(inputs[static_cast<std::size_t>(r.input)]);
  const std::string e = std::to_string(r.expected);
  std::string what;
  switch (r.fault) {
    case ShapeFault::none: return {};
    case ShapeFault::last_dimension: what = "an input whose last dimension is " + e; break;
    case ShapeFault::min_rank: what = "an input of rank at least " + e; break;
    case ShapeFault::exact_rank: what = "an input of rank " + e; break;
    case ShapeFault::element_count: what = "an input of " + e + " elements per sample"; break;
    case ShapeFault::shapes_differ: what = "inputs of the same shape"; break;
  }
  std::string msg = std::string(layer) + " expects " + what + ", got " + got;
  if (r.fault == ShapeFault::shapes_differ && inputs.size() > 1) msg += " and " + to_string(inputs[1]);
  return msg;
}

// Compile-time reports. The type names are the message: compilers print the failing
// condition with its template arguments, which then reads as
//   layer_accepts<duet::nn::Dense<784, 512>, last_dimension_must_be<784>, input_shape<64, 100>>
namespace diagnostic {

template <index_t... Dims>
struct input_shape {};
template <index_t... TrailingDims>
struct input_shape_after_unknown_leading_dims {};

template <index_t N>
struct last_dimension_must_be {};
template <index_t N>
struct rank_must_be_at_least {};
template <index_t N>
struct rank_must_be {};
template <index_t N>
struct elements_per_sample_must_be {};
struct inputs_must_have_the_same_shape {};

// Not derived from std::false_type: compilers would then print integral_constant<bool, false>
// instead of this type's name.
template <class Layer, class Requirement, class InputShape>
struct layer_accepts {
  static constexpr bool value = false;
};

template <ShapeFault F, index_t N>
constexpr auto requirement() {
  if constexpr (F == ShapeFault::last_dimension) return last_dimension_must_be<N>{};
  else if constexpr (F == ShapeFault::min_rank) return rank_must_be_at_least<N>{};
  else if constexpr (F == ShapeFault::exact_rank) return rank_must_be<N>{};
  else if constexpr (F == ShapeFault::element_count) return elements_per_sample_must_be<N>{};
  else return inputs_must_have_the_same_shape{};
}

// ShapeOf is any type with a `static constexpr Shape shape`.
template <class ShapeOf, std::size_t... I>
constexpr auto shape_type(std::index_sequence<I...>) {
  constexpr Shape s = ShapeOf::shape;
  if constexpr (s.leading_unknown()) return input_shape_after_unknown_leading_dims<s[static_cast<int>(I)]...>{};
  else return input_shape<s[static_cast<int>(I)]...>{};
}

template <class Layer, ShapeFault F, index_t N, class ShapeOf>
constexpr void reject() {
  using Requirement = decltype(requirement<F, N>());
  using Input = decltype(shape_type<ShapeOf>(std::make_index_sequence<static_cast<std::size_t>(ShapeOf::shape.rank())>{}));
  static_assert(layer_accepts<Layer, Requirement, Input>::value,
                "duet: a layer cannot accept its input's shape (the condition names the layer, "
                "its requirement and the input shape; -1 is a dynamic dimension)");
}

}  // namespace diagnostic
}  // namespace duet
// Graph capture: the compile-time IR of graph mode.
//
// A graph is a flat list of nodes (a hana::tuple), each an operation applied to the outputs of
// earlier nodes named by index, like SSA. Calling a cell's construct on a Sym (a symbolic
// tensor: a graph plus the index of the node it stands for) appends nodes instead of
// computing, so construct(Sym) returns the whole network as a type. The list stays flat, not
// nested like relu<dense<relu<...>>>, which keeps type names short and compiles faster.
//
// An operation type Op provides:
//   using layer_type                  the user-facing name compile-time errors show
//   static constexpr int arity        number of inputs
//   static constexpr bool is_view     output is input 0 with another shape (no kernel, no copy)
//   static constexpr bool is_elementwise   unary, same shape, may run in place or fuse as epilogue
//   static constexpr ShapeResult infer_static(std::span<const Shape>)   rule on compile-time patterns
//   ShapeResult infer(std::span<const Shape>) const                     the same rule at run time
//   template <class Backend, class T> void run(const T* const* in, const Shape* in_shapes,
//                                              T* out, const Shape& out_shape) const
//   std::string label() const          for graph_ir and run-time errors

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <boost/hana/append.hpp>
#include <boost/hana/at.hpp>
#include <boost/hana/tuple.hpp>

// duet::BasicTensor: a row-major, contiguous, reference-counted n-d array with a runtime shape,
// and duet::StaticTensor, the same with its shape (or part of it) fixed in the type.
//
// Copies share elements, as MindSpore and numpy references do; clone() copies them. Views
// (reshape, operator[]) share the block of the tensor they come from.

#include <algorithm>
#include <concepts>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

// Element types a tensor may hold, and their MindSpore names.

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace duet {

enum class DType : std::uint8_t { float32, float64, int32, int64, uint8 };

template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int32_t> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::uint8_t>;

template <class T>
concept ElementType = is_element_type_v<T>;

template <ElementType T>
inline constexpr DType dtype_of = std::is_same_v<T, float>          ? DType::float32
                                  : std::is_same_v<T, double>       ? DType::float64
                                  : std::is_same_v<T, std::int32_t> ? DType::int32
                                  : std::is_same_v<T, std::int64_t> ? DType::int64
                                                                    : DType::uint8;

inline constexpr DType float32 = DType::float32;
inline constexpr DType float64 = DType::float64;
inline constexpr DType int32 = DType::int32;
inline constexpr DType int64 = DType::int64;
inline constexpr DType uint8 = DType::uint8;

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::float32: return "Float32";
    case DType::float64: return "Float64";
    case DType::int32: return "Int32";
    case DType::int64: return "Int64";
    case DType::uint8: return "UInt8";
  }
  return "?";
}

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::float32: return 4;
    case DType::float64: return 8;
    case DType::int32: return 4;
    case DType::int64: return 8;
    case DType::uint8: return 1;
  }
  return 0;
}

}  // namespace duet
// Tensor storage: reference-counted blocks served from a per-thread caching pool.
//
// Every tensor, in both modes, takes its elements from here. A released block goes back to
// the releasing thread's cache instead of the heap, so a network that runs again on the same
// shapes finds its blocks waiting: once warm, a forward pass makes no heap allocation at all
// (the graph-mode guarantee) and PyNative pays a free-list pop per node instead of malloc.
// The cache is per thread, so concurrent forward passes never contend on a lock.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#define DUET_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DUET_ASAN 1
#endif
#endif
#ifdef DUET_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace duet {

namespace detail {

// Elements start one cache line after the block header, so they are 64-byte aligned
// (what AVX-512 loads and the GEMM packing routines want).
inline constexpr std::size_t block_alignment = 64;

struct Block {
  std::atomic<std::uint32_t> refs{1};
  std::uint32_t size_class = 0;
  std::size_t capacity = 0;  // bytes of element storage
  Block* next_free = nullptr;

  std::byte* data() { return reinterpret_cast<std::byte*>(this) + block_alignment; }
};
static_assert(sizeof(Block) <= block_alignment);

// Size classes: 64-byte steps up to 1 KiB, then four steps per power of two (at most 25%
// slack), so blocks are reusable across nearby sizes without unbounded waste.
inline constexpr std::uint32_t small_classes = 16;
inline constexpr std::uint32_t size_class_count = small_classes + 4 * 54 + 1;

constexpr std::uint32_t size_class_of(std::size_t bytes) {
  if (bytes <= 1024) return static_cast<std::uint32_t>((bytes + 63) / 64);
  std::uint32_t p = 0;  // 2^p < bytes <= 2^(p+1)
  while ((std::size_t{2} << p) < bytes) ++p;
  const std::size_t step = std::size_t{1} << (p - 2);
  const auto sub = static_cast<std::uint32_t>((bytes - (std::size_t{1} << p) + step - 1) / step);
  return small_classes + (p - 10) * 4 + sub;
}

constexpr std::size_t capacity_of(std::uint32_t size_class) {
  if (size_class <= small_classes) return std::size_t{size_class} * 64;
  const std::uint32_t p = (size_class - small_classes - 1) / 4 + 10;
  const std::uint32_t sub = (size_class - small_classes - 1) % 4 + 1;
  return (std::size_t{1} << p) + sub * (std::size_t{1} << (p - 2));
}

inline std::atomic<std::size_t>& cache_limit_bytes() {
  static std::atomic<std::size_t> limit{std::size_t{256} << 20};
  return limit;
}

inline void poison(Block* b) {
#ifdef DUET_ASAN
  ASAN_POISON_MEMORY_REGION(b->data(), b->capacity);
#else
  (void)b;
#endif
}

inline void unpoison(Block* b) {
#ifdef DUET_ASAN
  ASAN_UNPOISON_MEMORY_REGION(b->data(), b->capacity);
#else
  (void)b;
#endif
}

inline void free_block(Block* b) {
  unpoison(b);
  b->~Block();
  ::operator delete(static_cast<void*>(b), std::align_val_t{block_alignment});
}

class BlockCache {
 public:
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  ~BlockCache() { clear(); }

  Block* take(std::uint32_t size_class) {
    Block* b = free_[size_class];
    if (b != nullptr) {
      free_[size_class] = b->next_free;
      cached_bytes_ -= b->capacity;
      unpoison(b);
      b->next_free = nullptr;
      b->refs.store(1, std::memory_order_relaxed);
    }
    return b;
  }

  // False when the cache is full; the caller then frees the block.
  bool give(Block* b) {
    if (cached_bytes_ + b->capacity > cache_limit_bytes().load(std::memory_order_relaxed)) return false;
    poison(b);
    b->next_free = free_[b->size_class];
    free_[b->size_class] = b;
    cached_bytes_ += b->capacity;
    return true;
  }

  void clear() {
    for (Block*& head : free_) {
      while (head != nullptr) {
        Block* next = head->next_free;
        free_block(head);
        head = next;
      }
    }
    cached_bytes_ = 0;
  }

  std::size_t cached_bytes() const { return cached_bytes_; }

 private:
  std::array<Block*, size_class_count> free_{};
  std::size_t cached_bytes_ = 0;
};

// The calling thread's cache, or nullptr once it has been destroyed (tensors released during
// thread or program exit then go straight back to the heap).
inline BlockCache* thread_block_cache() {
  enum class State : unsigned char { unborn, alive, dead };
  thread_local State state = State::unborn;  // trivially destructible: readable after exit
  if (state == State::dead) return nullptr;
  struct Owner {
    State& state;
    BlockCache cache;
    explicit Owner(State& s) : state(s) { state = State::alive; }
    ~Owner() {
      cache.clear();
      state = State::dead;
    }
  };
  thread_local Owner owner(state);
  return &owner.cache;
}

inline Block* allocate_block(std::size_t bytes) {
  const std::uint32_t size_class = size_class_of(bytes);
  if (BlockCache* cache = thread_block_cache()) {
    if (Block* b = cache->take(size_class)) return b;
  }
  const std::size_t capacity = capacity_of(size_class);
  void* raw = ::operator new(block_alignment + capacity, std::align_val_t{block_alignment});
  auto* b = new (raw) Block;
  b->size_class = size_class;
  b->capacity = capacity;
  return b;
}

inline void release_block(Block* b) {
  if (b->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  BlockCache* cache = thread_block_cache();
  if (cache == nullptr || !cache->give(b)) free_block(b);
}

// Shared ownership of one block; what a tensor and all its views hold.
class Storage {
 public:
  Storage() = default;
  explicit Storage(std::size_t bytes) : block_(bytes == 0 ? nullptr : allocate_block(bytes)) {}
  Storage(const Storage& other) noexcept : block_(other.block_) { retain(); }
  Storage(Storage&& other) noexcept : block_(std::exchange(other.block_, nullptr)) {}
  Storage& operator=(const Storage& other) noexcept {
    Storage(other).swap(*this);
    return *this;
  }
  Storage& operator=(Storage&& other) noexcept {
    Storage(std::move(other)).swap(*this);
    return *this;
  }
  ~Storage() {
    if (block_ != nullptr) release_block(block_);
  }

  void swap(Storage& other) noexcept { std::swap(block_, other.block_); }
  std::byte* data() const { return block_ == nullptr ? nullptr : block_->data(); }
  std::size_t capacity() const { return block_ == nullptr ? 0 : block_->capacity; }
  bool same_block(const Storage& other) const { return block_ == other.block_ && block_ != nullptr; }
  long use_count() const { return block_ == nullptr ? 0 : static_cast<long>(block_->refs.load(std::memory_order_acquire)); }

 private:
  void retain() const {
    if (block_ != nullptr) block_->refs.fetch_add(1, std::memory_order_relaxed);
  }
  Block* block_ = nullptr;
};

}  // namespace detail

// Most bytes a thread keeps cached for reuse; a released block beyond it goes back to the heap.
inline void set_cache_limit(std::size_t bytes) {
  detail::cache_limit_bytes().store(bytes, std::memory_order_relaxed);
}

// Returns the calling thread's cached blocks to the heap (tensors still alive are untouched).
inline void empty_cache() {
  if (detail::BlockCache* cache = detail::thread_block_cache()) cache->clear();
}

}  // namespace duet

namespace duet {

namespace detail {

// Validates a shape a tensor is created with and returns its element count.
inline index_t checked_numel(const Shape& shape, std::size_t element_size) {
  if (!shape.is_concrete()) {
    throw ShapeError("duet::Tensor: cannot create a tensor of shape " + to_string(shape) +
                     ": every dimension must be known");
  }
  index_t n = 1;
  const auto limit = static_cast<index_t>(std::numeric_limits<std::size_t>::max() / 2 / element_size);
  for (index_t d : shape) {
    if (d != 0 && n > limit / d) {
      throw ValueError("duet::Tensor: shape " + to_string(shape) + " has too many elements");
    }
    n *= d;
  }
  return n;
}

}  // namespace detail

template <ElementType T>
class BasicTensor {
 public:
  using value_type = T;

  // An empty one-dimensional tensor.
  BasicTensor() : shape_{0} {}

  // Zero-filled.
  explicit BasicTensor(const Shape& shape) : BasicTensor(uninitialized(shape)) {
    std::fill_n(data_, numel(), T{});
  }

  BasicTensor(const Shape& shape, std::initializer_list<T> values)
      : BasicTensor(shape, std::span<const T>(values.begin(), values.size())) {}

  BasicTensor(const Shape& shape, std::span<const T> values) : BasicTensor(uninitialized(shape)) {
    if (static_cast<index_t>(values.size()) != numel()) {
      throw ShapeError("duet::Tensor: shape " + to_string(shape) + " holds " + std::to_string(numel()) +
                       " elements, got " + std::to_string(values.size()) + " values");
    }
    std::copy(values.begin(), values.end(), data_);
  }

  // For kernels that write every element: skips the zero fill.
  static BasicTensor uninitialized(const Shape& shape) {
    const index_t n = detail::checked_numel(shape, sizeof(T));
    BasicTensor t(detail::Storage(static_cast<std::size_t>(n) * sizeof(T)), shape);
    return t;
  }

  const Shape& shape() const { return shape_; }
  int ndim() const { return shape_.rank(); }
  index_t dim(int axis) const { return shape_[axis]; }
  index_t numel() const { return shape_.numel(); }
  index_t size() const { return numel(); }
  static constexpr DType dtype() { return dtype_of<T>; }

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::span<T> values() { return {data_, static_cast<std::size_t>(numel())}; }
  std::span<const T> values() const { return {data_, static_cast<std::size_t>(numel())}; }

  // Element access; negative indices count from the end, as in numpy. Always bounds-checked:
  // kernels use data(), so this is never the hot path.
  template <std::integral... I>
  T& operator()(I... index) {
    return data_[offset_of({static_cast<index_t>(index)...})];
  }
  template <std::integral... I>
  const T& operator()(I... index) const {
    return data_[offset_of({static_cast<index_t>(index)...})];
  }

  // The only element of a tensor with one element.
  T item() const {
    if (numel() != 1) {
      throw ShapeError("duet::Tensor::item: needs exactly one element, shape is " + to_string(shape_));
    }
    return data_[0];
  }

  // A view with another shape and the same elements; one dimension may be -1 (inferred).
  BasicTensor reshape(Shape to) const {
    int inferred = -1;
    index_t known = 1;
    for (int i = 0; i < to.rank(); ++i) {
      if (to[i] == dyn) {
        if (inferred >= 0) throw ShapeError("duet::Tensor::reshape: more than one -1 in " + to_string(to));
        inferred = i;
      } else {
        known *= to[i];
      }
    }
    if (inferred >= 0 && known != 0 && numel() % known == 0) to[inferred] = numel() / known;
    if (!to.is_concrete() || to.numel() != numel()) {
      throw ShapeError("duet::Tensor::reshape: cannot view " + to_string(shape_) + " (" +
                       std::to_string(numel()) + " elements) as " + to_string(to));
    }
    BasicTensor view = *this;
    view.shape_ = to;
    return view;
  }

  // Sub-tensor i along the first axis, as a view.
  BasicTensor operator[](index_t i) const {
    if (ndim() == 0) throw IndexError("duet::Tensor: cannot index a 0-d tensor");
    const index_t n = shape_[0];
    if (i < -n || i >= n) {
      throw IndexError("duet::Tensor: index " + std::to_string(i) + " is out of range for axis 0 of " +
                       to_string(shape_));
    }
    if (i < 0) i += n;
    Shape rest;
    for (int a = 1; a < ndim(); ++a) rest.push_back(shape_[a]);
    BasicTensor view = *this;
    view.shape_ = rest;
    view.data_ = data_ + i * rest.numel();
    return view;
  }

  BasicTensor clone() const {
    BasicTensor copy = uninitialized(shape_);
    std::copy_n(data_, numel(), copy.data_);
    return copy;
  }

  // True when both see the same elements (one is a view of the other, or a copy of its handle).
  bool shares_storage_with(const BasicTensor& other) const { return storage_.same_block(other.storage_); }

  // Handles (this one, copies and views) sharing the elements; 1 means this tensor may be
  // overwritten in place without anyone noticing.
  long use_count() const { return storage_.use_count(); }

 private:
  BasicTensor(detail::Storage storage, const Shape& shape)
      : storage_(std::move(storage)), data_(reinterpret_cast<T*>(storage_.data())), shape_(shape) {}

  index_t offset_of(std::initializer_list<index_t> index) const {
    if (static_cast<int>(index.size()) != ndim()) {
      throw IndexError("duet::Tensor: " + std::to_string(index.size()) + " indices for a tensor of shape " +
                       to_string(shape_));
    }
    index_t offset = 0;
    int axis = 0;
    for (index_t i : index) {
      const index_t n = shape_[axis];
      if (i < -n || i >= n) {
        throw IndexError("duet::Tensor: index " + std::to_string(i) + " is out of range for axis " +
                         std::to_string(axis) + " of " + to_string(shape_));
      }
      offset = offset * n + (i < 0 ? i + n : i);
      ++axis;
    }
    return offset;
  }

  detail::Storage storage_;
  T* data_ = nullptr;
  Shape shape_;
};

using Tensor = BasicTensor<float>;

// A tensor whose shape is (partly) fixed in its type: StaticTensor<float, duet::dyn, 784> is
// any batch of 784-vectors. Graph mode reads the shape from the type and checks layers
// against it at compile time.
template <ElementType T, index_t... Dims>
class StaticTensor {
 public:
  using value_type = T;
  using static_shape_type = StaticShape<Dims...>;
  static constexpr Shape static_shape = static_shape_type::value;

  // Zero-filled; only when every dimension is fixed.
  StaticTensor()
    requires(((Dims != dyn) && ...))
      : tensor_(static_shape) {}

  // Adopts a runtime tensor after checking it against the static shape.
  explicit StaticTensor(BasicTensor<T> tensor) : tensor_(std::move(tensor)) {
    const Shape& s = tensor_.shape();
    bool ok = s.rank() == static_shape.rank();
    for (int i = 0; ok && i < s.rank(); ++i) ok = static_shape[i] == dyn || static_shape[i] == s[i];
    if (!ok) {
      throw ShapeError("duet::StaticTensor" + to_string(static_shape) + ": got a tensor of shape " +
                       to_string(s));
    }
  }

  const BasicTensor<T>& tensor() const& { return tensor_; }
  BasicTensor<T>& tensor() & { return tensor_; }
  BasicTensor<T> tensor() && { return std::move(tensor_); }
  operator const BasicTensor<T>&() const& { return tensor_; }

  const Shape& shape() const { return tensor_.shape(); }
  static constexpr int ndim() { return static_shape.rank(); }
  index_t numel() const { return tensor_.numel(); }
  T* data() { return tensor_.data(); }
  const T* data() const { return tensor_.data(); }
  template <std::integral... I>
    requires(sizeof...(I) == sizeof...(Dims))
  T& operator()(I... index) {
    return tensor_(index...);
  }
  template <std::integral... I>
    requires(sizeof...(I) == sizeof...(Dims))
  const T& operator()(I... index) const {
    return tensor_(index...);
  }

 private:
  BasicTensor<T> tensor_;
};

template <class X>
inline constexpr bool is_static_tensor_v = false;
template <class T, index_t... D>
inline constexpr bool is_static_tensor_v<StaticTensor<T, D...>> = true;

template <class X>
inline constexpr bool is_tensor_v = false;
template <class T>
inline constexpr bool is_tensor_v<BasicTensor<T>> = true;

// Creation. Each takes a runtime Shape ({64, 1, 28, 28}) and returns a BasicTensor, or a
// duet::shape<...> and returns the matching StaticTensor.
template <ElementType T = float>
BasicTensor<T> full(const Shape& shape, T value) {
  auto t = BasicTensor<T>::uninitialized(shape);
  std::fill_n(t.data(), t.numel(), value);
  return t;
}
template <ElementType T = float>
BasicTensor<T> zeros(const Shape& shape) {
  return full<T>(shape, T{0});
}
template <ElementType T = float>
BasicTensor<T> ones(const Shape& shape) {
  return full<T>(shape, T{1});
}
template <ElementType T = float, index_t... D>
StaticTensor<T, D...> full(StaticShape<D...> shape, T value) {
  return StaticTensor<T, D...>(full<T>(Shape(shape), value));
}
template <ElementType T = float, index_t... D>
StaticTensor<T, D...> zeros(StaticShape<D...> shape) {
  return full<T>(shape, T{0});
}
template <ElementType T = float, index_t... D>
StaticTensor<T, D...> ones(StaticShape<D...> shape) {
  return full<T>(shape, T{1});
}

}  // namespace duet

namespace duet::graph {

namespace hana = boost::hana;

template <class Op, std::size_t... Args>
struct Node {
  using op_type = Op;
  static constexpr std::size_t arity = sizeof...(Args);
  static constexpr std::array<std::size_t, sizeof...(Args)> args{Args...};
  Op op;
};

template <class N, std::size_t Count>
constexpr Shape static_output_shape(const std::array<Shape, Count>& shapes) {
  std::array<Shape, N::arity> in{};
  for (std::size_t k = 0; k < N::arity; ++k) in[k] = shapes[N::args[k]];
  return N::op_type::infer_static(in).shape;
}

template <class... Nodes>
constexpr std::array<Shape, sizeof...(Nodes)> infer_static_shapes() {
  std::array<Shape, sizeof...(Nodes)> shapes{};
  std::size_t i = 0;
  ((shapes[i] = static_output_shape<Nodes>(shapes), ++i), ...);
  return shapes;
}

template <class T, class... Nodes>
struct Graph {
  using value_type = T;
  static constexpr std::size_t size = sizeof...(Nodes);
  // Shape inference: every node's output shape as far as compile time knows it.
  static constexpr std::array<Shape, size> shapes = infer_static_shapes<Nodes...>();
  using nodes_type = hana::tuple<Nodes...>;
  nodes_type nodes;
};

template <class G, std::size_t I>
using node_at = std::remove_cvref_t<decltype(hana::at_c<I>(std::declval<typename G::nodes_type&>()))>;

template <class G, class N>
struct appended;
template <class T, class... Nodes, class N>
struct appended<Graph<T, Nodes...>, N> {
  using type = Graph<T, Nodes..., N>;
};

// A symbolic tensor: the value of node Out of graph G.
template <class G, std::size_t Out>
struct Sym {
  using graph_type = G;
  using value_type = typename G::value_type;
  static constexpr std::size_t output = Out;
  static constexpr Shape shape = G::shapes[Out];
  G graph;
};

template <class X>
inline constexpr bool is_sym_v = false;
template <class G, std::size_t Out>
inline constexpr bool is_sym_v<Sym<G, Out>> = true;

template <class X>
concept Symbolic = is_sym_v<std::remove_cvref_t<X>>;

template <class X>
inline constexpr bool is_input_op_v = false;

// Graph input K, whose shape is known as far as Pattern says (a StaticShape, or AnyShape).
template <std::size_t K, class Pattern>
struct InputOp {
  using layer_type = InputOp;
  static constexpr int arity = 0;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr std::size_t index = K;
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Pattern::value}; }
  static std::string op_name() { return "Input " + std::to_string(K); }
  std::string label() const { return op_name(); }
};

template <std::size_t K, class Pattern>
inline constexpr bool is_input_op_v<InputOp<K, Pattern>> = true;

// Whether a concrete shape fits a pattern: same rank, same size wherever the pattern is fixed.
constexpr bool fits(const Shape& pattern, const Shape& s) {
  if (pattern.leading_unknown()) {
    if (s.rank() < pattern.rank()) return false;
  } else if (s.rank() != pattern.rank()) {
    return false;
  }
  for (int i = 1; i <= pattern.rank(); ++i) {
    if (pattern[-i] != dyn && pattern[-i] != s[-i]) return false;
  }
  return true;
}

// The pattern of a runtime tensor: rank and sizes unknown until it arrives.
struct AnyShape {
  static constexpr Shape value = Shape::any();
};

template <class T, class Pattern, std::size_t K = 0>
auto input() {
  using G = Graph<T, Node<InputOp<K, Pattern>>>;
  return Sym<G, 0>{G{}};
}

// Appends `op` applied to x. The rule runs here, at capture, so a compile-time mismatch is
// reported where the user's construct calls the layer.
template <class Op, class G, std::size_t Out>
auto append(const Op& op, const Sym<G, Out>& x) {
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, 1>{G::shapes[Out]});
  if constexpr (!r.ok()) {
    diagnostic::reject<typename Op::layer_type, r.fault, r.expected, Sym<G, Out>>();
  }
  using N = Node<Op, Out>;
  using Appended = typename appended<G, N>::type;
  return Sym<Appended, G::size>{Appended{hana::append(x.graph.nodes, N{op})}};
}

}  // namespace duet::graph

namespace duet {

namespace graph {

enum class Storage : unsigned char { input, view, slot, output };

template <std::size_t N>
struct BufferPlan {
  std::array<Storage, N> storage{};
  std::array<std::size_t, N> root{};  // the node whose memory a node's value lives in
  std::array<std::size_t, N> slot{};  // for Storage::slot roots
  std::size_t slot_count = 0;
};

template <class G, std::size_t Out>
constexpr BufferPlan<G::size> plan_buffers() {
  constexpr std::size_t n = G::size;
  BufferPlan<n> plan;
  std::array<std::size_t, n> last_read{};
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = node_at<G, I>;
           using Op = typename Node::op_type;
           if constexpr (is_input_op_v<Op>) {
             plan.storage[I] = Storage::input;
             plan.root[I] = I;
           } else if constexpr (Op::is_view) {
             plan.storage[I] = Storage::view;
             plan.root[I] = plan.root[Node::args[0]];
           } else {
             plan.storage[I] = Storage::slot;
             plan.root[I] = I;
           }
           for (std::size_t a : Node::args) last_read[plan.root[a]] = I;
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  const std::size_t out_root = plan.root[Out];
  if (plan.storage[out_root] == Storage::slot) plan.storage[out_root] = Storage::output;
  last_read[out_root] = n;  // the caller reads it last

  // Greedy slot reuse: a slot is free again once every reader of its value has run.
  std::array<std::size_t, n> slot_owner{};
  std::array<bool, n> slot_busy{};
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t s = 0; s < plan.slot_count; ++s) {
      if (slot_busy[s] && last_read[slot_owner[s]] < i) slot_busy[s] = false;
    }
    if (plan.storage[i] != Storage::slot) continue;
    std::size_t s = 0;
    while (s < plan.slot_count && slot_busy[s]) ++s;
    if (s == plan.slot_count) ++plan.slot_count;
    slot_busy[s] = true;
    slot_owner[s] = i;
    plan.slot[i] = s;
  }
  return plan;
}

template <class G>
constexpr std::size_t input_count() {
  std::size_t count = 0;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((count += is_input_op_v<typename node_at<G, I>::op_type> ? 1 : 0), ...);
  }(std::make_index_sequence<G::size>{});
  return count;
}

// The run-time part of a compiled graph for one set of input shapes.
template <class G>
struct Plan {
  static constexpr std::size_t inputs = input_count<G>();
  std::array<Shape, inputs> input_shapes;
  std::array<Shape, G::size> shapes;
  std::array<std::size_t, G::size> offset;  // bytes into the arena, for slot nodes
  std::size_t arena_bytes = 0;
};

}  // namespace graph

// Infers every node's shape for these input shapes and lays out the arena.
template <class G, std::size_t Out>
graph::Plan<G> plan(const graph::Sym<G, Out>& program,
                    const std::array<Shape, graph::Plan<G>::inputs>& input_shapes) {
  using T = typename G::value_type;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out>();
  graph::Plan<G> p;
  p.input_shapes = input_shapes;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = graph::node_at<G, I>;
           using Op = typename Node::op_type;
           const Op& op = boost::hana::at_c<I>(program.graph.nodes).op;
           if constexpr (graph::is_input_op_v<Op>) {
             const Shape& s = input_shapes[Op::index];
             if (!graph::fits(G::shapes[I], s)) {
               throw ShapeError("duet: graph input " + std::to_string(Op::index) + " must have shape " +
                                to_string(G::shapes[I]) + ", got " + to_string(s));
             }
             p.shapes[I] = s;
           } else {
             std::array<Shape, Node::arity> copies{};
             std::span<const Shape> in;
             if constexpr (Node::arity == 1) {
               in = std::span<const Shape>(&p.shapes[Node::args[0]], 1);
             } else {
               for (std::size_t k = 0; k < Node::arity; ++k) copies[k] = p.shapes[Node::args[k]];
               in = copies;
             }
             const ShapeResult r = op.infer(in);
             if (!r.ok()) throw ShapeError(describe_fault(r, op.label(), in));
             p.shapes[I] = r.shape;
           }
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  // Slots one after another, each 64-byte aligned.
  std::array<std::size_t, n> slot_bytes{};
  for (std::size_t i = 0; i < n; ++i) {
    if (buffers.storage[i] != graph::Storage::slot) continue;
    const auto bytes = static_cast<std::size_t>(p.shapes[i].numel()) * sizeof(T);
    if (bytes > slot_bytes[buffers.slot[i]]) slot_bytes[buffers.slot[i]] = bytes;
  }
  std::array<std::size_t, n> slot_offset{};
  for (std::size_t s = 0; s < buffers.slot_count; ++s) {
    slot_offset[s] = p.arena_bytes;
    p.arena_bytes += (slot_bytes[s] + detail::block_alignment - 1) / detail::block_alignment * detail::block_alignment;
  }
  for (std::size_t i = 0; i < n; ++i) p.offset[i] = slot_offset[buffers.slot[i]];
  return p;
}

// Runs a graph with a plan made for these inputs' shapes.
template <class Backend = DefaultBackend, class G, std::size_t Out, class... Inputs>
BasicTensor<typename G::value_type> run(const graph::Sym<G, Out>& program, const graph::Plan<G>& p,
                                        const Inputs&... inputs) {
  using T = typename G::value_type;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out>();
  static_assert(sizeof...(Inputs) == graph::Plan<G>::inputs, "duet::run: one tensor per graph input");
  const std::array<const BasicTensor<T>*, sizeof...(Inputs)> input{&static_cast<const BasicTensor<T>&>(inputs)...};

  detail::Storage arena(p.arena_bytes);
  BasicTensor<T> result;
  std::array<T*, n> data;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = graph::node_at<G, I>;
           using Op = typename Node::op_type;
           if constexpr (buffers.storage[I] == graph::Storage::input) {
             // Inputs are only read: kernels take their inputs as const T*.
             data[I] = const_cast<T*>(input[Op::index]->data());
           } else if constexpr (buffers.storage[I] == graph::Storage::view) {
             data[I] = data[buffers.root[I]];
           } else {
             if constexpr (buffers.storage[I] == graph::Storage::output) {
               result = BasicTensor<T>::uninitialized(p.shapes[I]);
               data[I] = result.data();
             } else {
               data[I] = reinterpret_cast<T*>(arena.data() + p.offset[I]);
             }
             std::array<const T*, Node::arity> in;
             for (std::size_t k = 0; k < Node::arity; ++k) in[k] = data[Node::args[k]];
             if constexpr (Node::arity == 1) {
               boost::hana::at_c<I>(program.graph.nodes)
                   .op.template run<Backend>(in.data(), &p.shapes[Node::args[0]], data[I], p.shapes[I]);
             } else {
               std::array<Shape, Node::arity> in_shapes;
               for (std::size_t k = 0; k < Node::arity; ++k) in_shapes[k] = p.shapes[Node::args[k]];
               boost::hana::at_c<I>(program.graph.nodes)
                   .op.template run<Backend>(in.data(), in_shapes.data(), data[I], p.shapes[I]);
             }
           }
         }()),
     ...);
  }(std::make_index_sequence<n>{});

  constexpr std::size_t out_root = buffers.root[Out];
  if constexpr (buffers.storage[out_root] == graph::Storage::input) {
    // The graph only reshapes an input: its output is a view of that input.
    return input[graph::node_at<G, out_root>::op_type::index]->reshape(p.shapes[Out]);
  } else if constexpr (out_root != Out) {
    return result.reshape(p.shapes[Out]);
  } else {
    return result;
  }
}

// Plans and runs in one call.
template <class Backend = DefaultBackend, class G, std::size_t Out, class... Inputs>
BasicTensor<typename G::value_type> evaluate(const graph::Sym<G, Out>& program, const Inputs&... inputs) {
  using T = typename G::value_type;
  const std::array<Shape, sizeof...(Inputs)> shapes{static_cast<const BasicTensor<T>&>(inputs).shape()...};
  return run<Backend>(program, plan(program, shapes), inputs...);
}

}  // namespace duet
// Parameters: the tensors a cell learns.

#include <algorithm>
#include <string>


namespace duet::nn {

// A tensor a cell owns and an optimiser updates. It is a tensor (prints, indexes, feeds
// kernels) whose shape is fixed once made: set_data copies values in, never rebinds, so the
// graphs and views that refer to it stay valid.
template <ElementType T>
class BasicParameter : public BasicTensor<T> {
 public:
  BasicParameter() = default;
  explicit BasicParameter(BasicTensor<T> value) : BasicTensor<T>(std::move(value)) {}

  BasicParameter(const BasicParameter&) = delete;
  BasicParameter& operator=(const BasicParameter&) = delete;
  BasicParameter(BasicParameter&&) noexcept = default;
  BasicParameter& operator=(BasicParameter&&) noexcept = default;
  ~BasicParameter() = default;

  // MindSpore's Parameter.set_data: the new values must have this parameter's shape.
  void set_data(const BasicTensor<T>& value) {
    if (!(value.shape() == this->shape())) {
      throw ShapeError("duet::nn::Parameter::set_data: parameter has shape " + to_string(this->shape()) +
                       ", got " + to_string(value.shape()));
    }
    std::copy_n(value.data(), value.numel(), this->data());
  }

  bool requires_grad = true;
};

using Parameter = BasicParameter<float>;

template <ElementType T>
struct NamedParameter {
  std::string name;
  BasicParameter<T>* parameter;
};

}  // namespace duet::nn
// Compile-time passes over a captured graph. Each takes a Sym (graph plus output) and
// returns a new one, of a new type; they run while the program compiles and leave nothing to
// do at run time but the evaluator's calls.
//
//   shape inference and checking   in graph.hpp, at capture (Graph::shapes, append)
//   views                          is_view nodes get no buffer (evaluator's plan)
//   fuse_epilogues                 bias adds and activations move into the product before them

#include <array>
#include <cstddef>
#include <utility>

#include <boost/hana/append.hpp>
#include <boost/hana/drop_back.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/unpack.hpp>


namespace duet::passes {

namespace hana = boost::hana;

// How many nodes read each node's value; the graph's output counts as one more reader.
template <class G, std::size_t Out>
constexpr std::array<std::size_t, G::size> user_counts() {
  std::array<std::size_t, G::size> users{};
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           for (std::size_t a : graph::node_at<G, I>::args) ++users[a];
         }()),
     ...);
  }(std::make_index_sequence<G::size>{});
  ++users[Out];
  return users;
}

// A producer op P takes consumer op C as its epilogue when it says so.
template <class P, class C>
concept absorbs = requires { requires P::template accepts_epilogue<C>; };

namespace detail {

template <class T, class Nodes>
auto make_graph(const Nodes& nodes) {
  return hana::unpack(nodes, [](const auto&... n) {
    return graph::Graph<T, std::remove_cvref_t<decltype(n)>...>{hana::make_tuple(n...)};
  });
}

// Node n with its arguments renumbered through map.
template <class N, std::size_t... Map, std::size_t... A>
auto renumbered(const N& n, std::index_sequence<Map...>, std::index_sequence<A...>) {
  constexpr std::array<std::size_t, sizeof...(Map)> map{Map...};
  return graph::Node<typename N::op_type, map[N::args[A]]...>{n.op};
}

// Walks the nodes in order, building the fused list. Map[j] is where node j's value lives in
// the new list. A unary consumer folds into the node that computes its input when that node
// is the last one built, absorbs it, and nobody else reads the value in between.
template <std::size_t J, std::size_t Out, class G, class Built, std::size_t... Map>
auto fuse_from(const G& g, const Built& built, std::index_sequence<Map...> map) {
  if constexpr (J == G::size) {
    constexpr std::array<std::size_t, G::size> m{Map...};
    using T = typename G::value_type;
    auto fused = make_graph<T>(built);
    return graph::Sym<decltype(fused), m[Out]>{fused};
  } else {
    using N = graph::node_at<G, J>;
    const N& n = hana::at_c<J>(g.nodes);
    constexpr std::size_t built_size = decltype(hana::length(built))::value;
    if constexpr (N::arity == 1) {
      constexpr std::array<std::size_t, J> m{Map...};
      constexpr std::size_t a = N::args[0];
      constexpr std::size_t r = m[a];
      using P = std::remove_cvref_t<decltype(hana::at_c<r>(built))>;
      if constexpr (r + 1 == built_size && user_counts<G, Out>()[a] == 1 &&
                    absorbs<typename P::op_type, typename N::op_type>) {
        const P& p = hana::at_c<r>(built);
        auto absorbed = p.op.absorb(n.op);
        auto with_args = [&]<std::size_t... A>(std::index_sequence<A...>) {
          return graph::Node<decltype(absorbed), P::args[A]...>{absorbed};
        }(std::make_index_sequence<P::arity>{});
        return fuse_from<J + 1, Out>(g, hana::append(hana::drop_back(built), with_args),
                                     std::index_sequence<Map..., r>{});
      } else {
        return fuse_from<J + 1, Out>(g, hana::append(built, renumbered(n, map, std::make_index_sequence<N::arity>{})),
                                     std::index_sequence<Map..., built_size>{});
      }
    } else {
      return fuse_from<J + 1, Out>(g, hana::append(built, renumbered(n, map, std::make_index_sequence<N::arity>{})),
                                   std::index_sequence<Map..., built_size>{});
    }
  }
}

}  // namespace detail

// Moves each bias add and elementwise activation into the epilogue of the product that
// feeds it, so the product writes its final values in one pass.
template <class G, std::size_t Out>
auto fuse_epilogues(const graph::Sym<G, Out>& program) {
  return detail::fuse_from<0, Out>(program.graph, hana::make_tuple(), std::index_sequence<>{});
}

// The pipeline graph mode runs.
template <class G, std::size_t Out>
auto optimize(const graph::Sym<G, Out>& program) {
  return fuse_epilogues(program);
}

}  // namespace duet::passes

namespace duet::nn {

namespace hana = boost::hana;

template <ElementType T>
class BasicDynamicCell;

// Called after a cell's forward in PyNative mode with the cell, its input and its output.
template <ElementType T>
using BasicForwardHook = std::function<void(const BasicDynamicCell<T>& cell, const BasicTensor<T>& input,
                                            const BasicTensor<T>& output)>;
using ForwardHook = BasicForwardHook<float>;

namespace detail {
// Hooks registered anywhere; graph mode walks its cell tree for hooks only when this is > 0.
inline std::atomic<long>& live_hook_count() {
  static std::atomic<long> count{0};
  return count;
}
// Naming a tree of cells happens once, on first use; the lock makes concurrent first calls safe.
inline std::mutex& naming_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace detail

// Removes the hook it was returned for (MindSpore's handle.remove()).
template <ElementType T>
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(BasicDynamicCell<T>* cell, long id) : cell_(cell), id_(id) {}
  void remove() {
    if (cell_ != nullptr) cell_->remove_forward_hook(id_);
    cell_ = nullptr;
  }

 private:
  BasicDynamicCell<T>* cell_ = nullptr;
  long id_ = 0;
};

template <ElementType T>
class BasicDynamicCell {
 public:
  using value_type = T;
  using ChildVisitor = std::function<void(std::string_view name, BasicDynamicCell& child)>;
  using ParameterVisitor = std::function<void(std::string_view name, BasicParameter<T>& parameter)>;

  BasicDynamicCell() = default;
  BasicDynamicCell(const BasicDynamicCell&) = delete;
  BasicDynamicCell& operator=(const BasicDynamicCell&) = delete;
  // Movable so that containers can take cells by value; a moved cell keeps its hooks, and
  // HookHandles of the old object no longer refer to it.
  BasicDynamicCell(BasicDynamicCell&& other) noexcept
      : name_(std::move(other.name_)),
        named_(other.named_.load()),
        hooks_(std::exchange(other.hooks_, {})),
        last_hook_id_(other.last_hook_id_) {}
  BasicDynamicCell& operator=(BasicDynamicCell&&) = delete;
  virtual ~BasicDynamicCell() { detail::live_hook_count().fetch_sub(static_cast<long>(hooks_.size())); }

  BasicTensor<T> operator()(const BasicTensor<T>& x) {
    ensure_named();
    BasicTensor<T> y = forward(x);
    for (const auto& [id, hook] : hooks_) hook(*this, x, y);
    return y;
  }

  // Unique for the life of the program, unlike the address: what caches of compiled plans key on.
  std::uint64_t id() const { return id_; }

  // Path from the root the cell was first used under ("dense_relu_sequential.0"); "" for it.
  const std::string& name() const { return name_; }
  // What the cell is: "nn::Dense<784, 512, float>".
  virtual std::string type_name() const = 0;
  // "nn::Dense<784, 512, float> 'dense_relu_sequential.0'": how errors name a cell.
  std::string label() const { return name_.empty() ? type_name() : type_name() + " '" + name_ + "'"; }

  virtual void for_each_child(const ChildVisitor&) {}
  virtual void for_each_own_parameter(const ParameterVisitor&) {}

  // All parameters of the tree, named by path ("dense_relu_sequential.0.weight").
  std::vector<NamedParameter<T>> parameters() {
    std::vector<NamedParameter<T>> out;
    collect_parameters("", out);
    return out;
  }

  // This cell and all below it, depth first, with their paths (MindSpore's cells_and_names).
  std::vector<std::pair<std::string, BasicDynamicCell*>> cells_and_names() {
    std::vector<std::pair<std::string, BasicDynamicCell*>> out;
    collect_cells("", out);
    return out;
  }

  HookHandle<T> register_forward_hook(BasicForwardHook<T> hook) {
    hooks_.emplace_back(++last_hook_id_, std::move(hook));
    detail::live_hook_count().fetch_add(1);
    return HookHandle<T>(this, last_hook_id_);
  }

  void remove_forward_hook(long id) {
    const auto before = hooks_.size();
    std::erase_if(hooks_, [id](const auto& h) { return h.first == id; });
    detail::live_hook_count().fetch_sub(static_cast<long>(before - hooks_.size()));
  }

  bool has_forward_hooks_in_tree() {
    if (detail::live_hook_count().load() == 0) return false;
    bool found = !hooks_.empty();
    for_each_child([&](std::string_view, BasicDynamicCell& c) { found = found || c.has_forward_hooks_in_tree(); });
    return found;
  }

  // Gives this cell and all below it their paths, if no call or parent has done so yet.
  void ensure_named() {
    if (named_.load(std::memory_order_acquire)) return;
    std::lock_guard lock(detail::naming_mutex());
    if (!named_.load(std::memory_order_relaxed)) assign_names("");
  }

 protected:
  virtual BasicTensor<T> forward(const BasicTensor<T>& x) = 0;

 private:
  void assign_names(const std::string& path) {
    name_ = path;
    for_each_child([&](std::string_view child, BasicDynamicCell& c) { c.assign_names(join(path, child)); });
    named_.store(true, std::memory_order_release);
  }

  static std::string join(const std::string& path, std::string_view child) {
    return path.empty() ? std::string(child) : path + "." + std::string(child);
  }

  void collect_parameters(const std::string& path, std::vector<NamedParameter<T>>& out) {
    for_each_own_parameter([&](std::string_view n, BasicParameter<T>& p) { out.push_back({join(path, n), &p}); });
    for_each_child([&](std::string_view n, BasicDynamicCell& c) { c.collect_parameters(join(path, n), out); });
  }

  void collect_cells(const std::string& path, std::vector<std::pair<std::string, BasicDynamicCell*>>& out) {
    out.emplace_back(path, this);
    for_each_child([&](std::string_view n, BasicDynamicCell& c) { c.collect_cells(join(path, n), out); });
  }

  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  std::uint64_t id_ = next_id();
  std::string name_;
  std::atomic<bool> named_{false};
  std::vector<std::pair<long, BasicForwardHook<T>>> hooks_;
  long last_hook_id_ = 0;
};

using DynamicCell = BasicDynamicCell<float>;

template <class X>
concept DynamicCellType = std::is_base_of_v<BasicDynamicCell<typename X::value_type>, X>;

template <class C, class X>
concept HasConstruct = requires(C& cell, X x) { cell.construct(x); };

// What a user's network derives from. Mode fixes how the cell runs whatever the context
// (GRAPH_MODE, PYNATIVE_MODE); CONTEXT_MODE, the default, follows set_context at each call.
template <class Derived, Mode M = CONTEXT_MODE, ElementType T = float>
class Cell : public BasicDynamicCell<T> {
 public:
  static constexpr Mode mode = M;
  using BasicDynamicCell<T>::operator();

  // Graph capture: construct appends this cell's nodes to the graph x belongs to.
  template <graph::Symbolic S>
  auto operator()(const S& x) {
    return derived().construct(x);
  }

  // A statically shaped input: both modes check it against the layers at compile time and
  // return a StaticTensor of the inferred output shape.
  template <index_t... D>
  auto operator()(const StaticTensor<T, D...>& x) {
    using Captured = decltype(std::declval<Derived&>().construct(graph::input<T, StaticShape<D...>>()));
    if constexpr (M != PYNATIVE_MODE) {
      if (effective_mode(M) == GRAPH_MODE) {
        this->ensure_named();
        return to_static_tensor<Captured>(run_graph<StaticShape<D...>>(x.tensor()));
      }
    }
    return to_static_tensor<Captured>((*this)(x.tensor()));
  }

  std::string type_name() const override { return duet::detail::readable_type_name(typeid(Derived)); }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    for_each_member([&](std::string_view name, auto& member) {
      if constexpr (DynamicCellType<std::remove_cvref_t<decltype(member)>>) visit(name, member);
    });
  }

  void for_each_own_parameter(const typename BasicDynamicCell<T>::ParameterVisitor& visit) override {
    for_each_member([&](std::string_view name, auto& member) {
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(member)>, BasicParameter<T>>) visit(name, member);
    });
  }

 protected:
  BasicTensor<T> forward(const BasicTensor<T>& x) override {
    if constexpr (!HasConstruct<Derived, BasicTensor<T>>) {
      static_assert(HasConstruct<Derived, BasicTensor<T>>,
                    "duet::nn::Cell: the derived cell must define construct(x), generic over its input: "
                    "auto construct(auto x) { ... }");
      return x;
    } else if constexpr (M == GRAPH_MODE) {
      return run_graph<graph::AnyShape>(x);
    } else {
      if constexpr (M == CONTEXT_MODE) {
        if (effective_mode(M) == GRAPH_MODE) return run_graph<graph::AnyShape>(x);
      }
      EagerScope eager;
      return derived().construct(x);
    }
  }

 private:
  Derived& derived() { return static_cast<Derived&>(*this); }

  // Capture, optimise, run. Capture and passes cost nothing at run time (they are types);
  // the plan for the input's shape is kept per thread, so a repeated shape skips planning.
  template <class Pattern>
  BasicTensor<T> run_graph(const BasicTensor<T>& x) {
    if (this->has_forward_hooks_in_tree()) {
      throw ModeError(this->label() +
                      " runs in graph mode, but a cell in it has a forward hook; hooks see "
                      "intermediate values in PyNative mode only (set_context({.mode = PYNATIVE_MODE}))");
    }
    auto program = passes::optimize(derived().construct(graph::input<T, Pattern>()));
    using G = typename decltype(program)::graph_type;
    thread_local struct {
      std::uint64_t cell = 0;
      graph::Plan<G> plan;
    } cache;
    if (cache.cell != this->id() || !(cache.plan.input_shapes[0] == x.shape())) {
      cache.cell = 0;
      cache.plan = plan(program, {x.shape()});
      cache.cell = this->id();
    }
    return run<DefaultBackend>(program, cache.plan, x);
  }

  template <class Captured>
  static auto to_static_tensor(BasicTensor<T> y) {
    constexpr Shape s = Captured::shape;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return StaticTensor<T, s[static_cast<int>(I)]...>(std::move(y));
    }(std::make_index_sequence<static_cast<std::size_t>(s.rank())>{});
  }

  template <class F>
  void for_each_member(F&& f) {
    if constexpr (hana::Struct<Derived>::value) {
      hana::for_each(hana::accessors<Derived>(), [&](auto accessor) {
        f(std::string_view(hana::to<const char*>(hana::first(accessor))), hana::second(accessor)(derived()));
      });
    }
  }
};

}  // namespace duet::nn
// PyNative evaluation of one operation: run its shape rule, allocate its output from the
// pool, call its kernel. The graph evaluator uses the same rule and the same kernel, which is
// why the two modes agree.

#include <array>
#include <utility>


namespace duet {

namespace detail {
template <class Op, class T>
Shape checked_output_shape(const Op& op, const BasicTensor<T>& x) {
  const std::array<Shape, 1> in{x.shape()};
  const ShapeResult r = op.infer(in);
  if (!r.ok()) throw ShapeError(describe_fault(r, op.label(), in));
  return r.shape;
}
}  // namespace detail

template <class Backend = DefaultBackend, class Op, class T>
BasicTensor<T> run_eager(const Op& op, const BasicTensor<T>& x) {
  const Shape out_shape = detail::checked_output_shape(op, x);
  if constexpr (Op::is_view) {
    return x.reshape(out_shape);
  } else {
    auto y = BasicTensor<T>::uninitialized(out_shape);
    const T* in[1] = {x.data()};
    op.template run<Backend>(in, &x.shape(), y.data(), out_shape);
    return y;
  }
}

// A temporary nobody else holds is overwritten in place by elementwise operations.
template <class Backend = DefaultBackend, class Op, class T>
BasicTensor<T> run_eager(const Op& op, BasicTensor<T>&& x) {
  if constexpr (Op::is_elementwise) {
    if (x.use_count() == 1) {
      const Shape out_shape = detail::checked_output_shape(op, x);
      const T* in[1] = {x.data()};
      op.template run<Backend>(in, &x.shape(), x.data(), out_shape);
      return std::move(x);
    }
  }
  return run_eager<Backend>(op, static_cast<const BasicTensor<T>&>(x));
}

// The one entry point layers use: on a symbolic tensor it records the operation in the graph,
// on a real tensor it runs it now.
template <class Op, class X>
auto apply(const Op& op, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return graph::append(op, x);
  } else {
    return run_eager(op, std::forward<X>(x));
  }
}

}  // namespace duet
// graph_ir: what graph mode made of a cell, as text and as Graphviz DOT, before and after the
// passes (MindSpore users get this from save_graphs).

#include <cstddef>
#include <sstream>
#include <string>
#include <utility>

#include <boost/hana/at.hpp>


namespace duet {

struct GraphText {
  std::string text;  // one line per node: "%2 = MatMul + BiasAdd + ReLU(%1) : [?, 512]  nn::Dense<...>"
  std::string dot;   // Graphviz: `dot -Tsvg`
};

struct GraphIR {
  GraphText captured;   // as construct built it
  GraphText optimized;  // after the passes: what the evaluator runs
};

namespace graph {

template <class G, std::size_t Out>
GraphText dump(const Sym<G, Out>& program, const std::string& title) {
  constexpr BufferPlan<G::size> plan = plan_buffers<G, Out>();
  std::ostringstream text;
  std::ostringstream dot;
  text << "graph " << title << " {\n";
  dot << "digraph \"" << title << "\" {\n  node [shape=box, fontname=\"monospace\"];\n";
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((
         [&] {
           using Node = node_at<G, I>;
           const auto& op = boost::hana::at_c<I>(program.graph.nodes).op;
           std::string what = Node::op_type::op_name();
           if constexpr (Node::arity > 0) {
             what += "(";
             for (std::size_t k = 0; k < Node::arity; ++k) what += (k ? ", %" : "%") + std::to_string(Node::args[k]);
             what += ")";
           }
           std::string storage;
           switch (plan.storage[I]) {
             case Storage::input: storage = "input"; break;
             case Storage::view: storage = "view of %" + std::to_string(plan.root[I]); break;
             case Storage::slot: storage = "slot " + std::to_string(plan.slot[I]); break;
             case Storage::output: storage = "output"; break;
           }
           const std::string who = op.label() == Node::op_type::op_name() ? "" : "  " + op.label();
           text << "  %" << I << " = " << what << " : " << to_string(G::shapes[I]) << "  [" << storage << "]" << who
                << "\n";
           dot << "  n" << I << " [label=\"%" << I << " " << Node::op_type::op_name()
               << "\\n" << to_string(G::shapes[I]) << " (" << storage << ")\"];\n";
           for (std::size_t a : Node::args) dot << "  n" << a << " -> n" << I << ";\n";
         }()),
     ...);
  }(std::make_index_sequence<G::size>{});
  text << "  return %" << Out << "\n}\n";
  dot << "}\n";
  return {text.str(), dot.str()};
}

}  // namespace graph

// The graph of cell for inputs of the given pattern (duet::shape<dyn, 1, 28, 28>, say); by
// default an input of unknown shape, as when a runtime tensor is passed.
template <class C, class Pattern = graph::AnyShape>
GraphIR graph_ir(C& cell, Pattern = {}) {
  cell.ensure_named();
  auto captured = cell(graph::input<typename C::value_type, Pattern>());
  const std::string title = cell.type_name();
  return {graph::dump(captured, title), graph::dump(passes::optimize(captured), title)};
}

}  // namespace duet
// Activation layers and the elementwise functions behind them.
//
// An elementwise function is a type with a name and an Eigen array form. The same type is a
// graph node of its own (ops::MapOp<Fn>, what PyNative runs) or, after fuse_epilogues, a
// step in a product's epilogue: the function is written once and used both ways.

#include <string>
#include <string_view>
#include <utility>


namespace duet {

namespace fn {

struct Relu {
  static constexpr std::string_view name = "ReLU";
  // NaN stays NaN, as IEEE and numpy's maximum say; a plain max(x, 0) would turn it into 0.
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    return a.binaryExpr(A::Constant(a.rows(), a.cols(), S(0)),
                        ::Eigen::internal::scalar_max_op<S, S, ::Eigen::PropagateNaN>());
  }
};

}  // namespace fn

namespace ops {

template <class Fn>
struct MapOp {
  using layer_type = MapOp;
  using fn_type = Fn;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const T* const* in, const Shape* in_shapes, T* out, const Shape&) const {
    Backend::template map<Fn>(in[0], in_shapes[0].numel(), out);
  }

  static std::string op_name() { return std::string(Fn::name); }
  std::string label() const { return op_name(); }
};

template <class X>
auto relu(X&& x) {
  return apply(MapOp<fn::Relu>{}, std::forward<X>(x));
}

}  // namespace ops

namespace nn {

// max(x, 0), elementwise (MindSpore's nn.ReLU).
template <ElementType T>
class BasicReLU : public Cell<BasicReLU<T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return ops::relu(std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::ReLU"; }
};

using ReLU = BasicReLU<float>;

}  // namespace nn
}  // namespace duet
// Containers: cells that run other cells in order.

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <boost/hana/at.hpp>
#include <boost/hana/fold_left.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/tuple.hpp>


namespace duet::nn {

// A fixed list of cells, each fed the previous one's output (MindSpore's nn.SequentialCell).
// The list is a hana::tuple: in graph mode the whole chain becomes one flat graph.
template <class First, class... Rest>
class SequentialCell
    : public Cell<SequentialCell<First, Rest...>, CONTEXT_MODE, typename First::value_type> {
  using T = typename First::value_type;
  static_assert((std::is_same_v<typename Rest::value_type, T> && ...),
                "nn::SequentialCell: all cells must have the same element type");

 public:
  SequentialCell() { check_neighbours(); }
  explicit SequentialCell(First first, Rest... rest) : cells_(std::move(first), std::move(rest)...) {
    check_neighbours();
  }

  static constexpr std::size_t size() { return 1 + sizeof...(Rest); }

  template <std::size_t I>
  auto& get() {
    return boost::hana::at_c<I>(cells_);
  }

  template <class X>
  auto construct(X&& x) {
    return boost::hana::fold_left(cells_, std::forward<X>(x),
                                  [](auto&& acc, auto& cell) { return cell(std::forward<decltype(acc)>(acc)); });
  }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    std::size_t i = 0;
    boost::hana::for_each(cells_, [&](auto& cell) { visit(std::to_string(i++), cell); });
  }

  std::string type_name() const override { return "nn::SequentialCell"; }

 private:
  // Capturing the chain on an input of unknown shape runs every layer's shape rule against
  // its neighbour's output, so incompatible neighbours fail to compile in either mode.
  static void check_neighbours() {
    using Captured = decltype(std::declval<SequentialCell&>().construct(graph::input<T, graph::AnyShape>()));
    static_cast<void>(sizeof(Captured));
  }

  boost::hana::tuple<First, Rest...> cells_;
};

// A list of cells built at run time (sizes and layers from a config file, say). Always runs in
// PyNative mode: its structure is not known when the program compiles.
template <ElementType T>
class BasicDynamicSequentialCell : public BasicDynamicCell<T> {
 public:
  BasicDynamicSequentialCell() = default;

  // Adds a cell at the end, taking ownership; returns it.
  template <class C>
    requires std::is_base_of_v<BasicDynamicCell<T>, C>
  C& append(C cell) {
    auto owned = std::make_unique<C>(std::move(cell));
    C& ref = *owned;
    cells_.push_back(std::move(owned));
    return ref;
  }
  BasicDynamicCell<T>& append(std::unique_ptr<BasicDynamicCell<T>> cell) {
    cells_.push_back(std::move(cell));
    return *cells_.back();
  }

  std::size_t size() const { return cells_.size(); }
  BasicDynamicCell<T>& operator[](std::size_t i) {
    if (i >= cells_.size()) {
      throw IndexError("nn::DynamicSequentialCell: index " + std::to_string(i) + " is out of range for " +
                       std::to_string(cells_.size()) + " cells");
    }
    return *cells_[i];
  }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    for (std::size_t i = 0; i < cells_.size(); ++i) visit(std::to_string(i), *cells_[i]);
  }

  std::string type_name() const override { return "nn::DynamicSequentialCell"; }

 protected:
  BasicTensor<T> forward(const BasicTensor<T>& x) override {
    BasicTensor<T> y = x;
    for (auto& cell : cells_) y = (*cell)(y);
    return y;
  }

 private:
  std::vector<std::unique_ptr<BasicDynamicCell<T>>> cells_;
};

using DynamicSequentialCell = BasicDynamicSequentialCell<float>;

}  // namespace duet::nn
// Fully connected layers: nn::Dense and the operations it captures as (MatMul, BiasAdd).

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

// Seeded random numbers that are the same on every compiler and standard library.
//
// std::uniform_real_distribution and std::normal_distribution are implementation-defined, so
// duet draws its own: xoshiro256** seeded through splitmix64, uniform floats from the top
// bits, normals by Box-Muller. Both modes build their weights from this generator, which is
// why the same seed gives the same network in PyNative and graph mode.

#include <cmath>
#include <cstdint>
#include <mutex>
#include <numbers>


namespace duet {

class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0) { this->seed(seed); }

  void seed(std::uint64_t seed) {
    for (auto& word : state_) {
      seed += 0x9E3779B97F4A7C15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      word = z ^ (z >> 31);
    }
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1), with all the precision T can hold.
  template <class T>
  T uniform01() {
    if constexpr (std::is_same_v<T, float>) {
      return static_cast<float>(next() >> 40) * 0x1.0p-24f;
    } else {
      return static_cast<T>(static_cast<double>(next() >> 11) * 0x1.0p-53);
    }
  }

  template <class T>
  T uniform(T low, T high) {
    return low + (high - low) * uniform01<T>();
  }

  // Standard normal, Box-Muller in double so float and double draws agree to float precision.
  template <class T>
  T normal() {
    if (has_spare_) {
      has_spare_ = false;
      return static_cast<T>(spare_);
    }
    double u1 = 0;
    while (u1 == 0) u1 = uniform01<double>();
    const double u2 = uniform01<double>();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return static_cast<T>(r * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t state_[4]{};
  double spare_ = 0;
  bool has_spare_ = false;
};

namespace detail {
struct GlobalGenerator {
  std::mutex mutex;
  Generator generator{0};
};
inline GlobalGenerator& global_generator() {
  static GlobalGenerator g;
  return g;
}
}  // namespace detail

// Reseeds the generator that layer initialisers and the unseeded creation functions draw
// from (MindSpore's set_seed). The default seed is 0, so programs are reproducible by default.
inline void set_seed(std::uint64_t seed) {
  auto& g = detail::global_generator();
  std::lock_guard lock(g.mutex);
  g.generator.seed(seed);
}

// Runs fn(Generator&) with the global generator locked.
template <class F>
decltype(auto) with_global_generator(F&& fn) {
  auto& g = detail::global_generator();
  std::lock_guard lock(g.mutex);
  return fn(g.generator);
}

template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low, T high, Generator& gen) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (T& v : t.values()) v = gen.uniform<T>(low, high);
  return t;
}

template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape, Generator& gen) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (T& v : t.values()) v = gen.normal<T>();
  return t;
}

// Seeded: the same seed gives the same tensor, whatever else has drawn numbers.
template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low, T high, std::uint64_t seed) {
  Generator gen(seed);
  return uniform<T>(shape, low, high, gen);
}
template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape, std::uint64_t seed) {
  Generator gen(seed);
  return randn<T>(shape, gen);
}

// Unseeded: draws from the global generator (see set_seed).
template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low = 0, T high = 1) {
  return with_global_generator([&](Generator& gen) { return uniform<T>(shape, low, high, gen); });
}
template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape) {
  return with_global_generator([&](Generator& gen) { return randn<T>(shape, gen); });
}

}  // namespace duet

namespace duet {
namespace ops {

template <class Layer>
struct BiasAddOp;

// x · Wᵀ over the last axis of x, then the epilogue: the bias if Bias, then each Fn. Capture
// makes it with an empty epilogue; fuse_epilogues grows it.
template <class Layer, bool Bias = false, class... Fns>
struct MatMulOp {
  using layer_type = Layer;
  using T = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  const Layer* layer;

  static constexpr ShapeResult rule(index_t in, index_t out, const Shape& x) {
    Shape y = x;
    if (x.rank() == 0) {
      y.push_back(out);
      return x.leading_unknown() ? ShapeResult{y} : fault(y, ShapeFault::min_rank, 1);
    }
    y = x.with_back(out);
    if (in != dyn && x.back() != dyn && x.back() != in) return fault(y, ShapeFault::last_dimension, in);
    return {y};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return rule(Layer::in_static, Layer::out_static, in[0]);
  }
  ShapeResult infer(std::span<const Shape> in) const {
    return rule(layer->in_channels(), layer->out_channels(), in[0]);
  }

  template <class Backend>
  void run(const T* const* in, const Shape* in_shapes, T* out, const Shape&) const {
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : in_shapes[0].numel() / in_channels;
    Backend::template dense<Layer::in_static, Layer::out_static>(
        in[0], rows, in_channels, layer->weight.data(), layer->out_channels(),
        Epilogue<T, Fns...>{Bias ? layer->bias.data() : nullptr}, out);
  }

  // Takes this layer's bias first, then any elementwise function.
  template <class C>
  static constexpr bool accepts_epilogue =
      (std::is_same_v<C, BiasAddOp<Layer>> && !Bias && sizeof...(Fns) == 0) || requires { typename C::fn_type; };
  auto absorb(const BiasAddOp<Layer>&) const { return MatMulOp<Layer, true, Fns...>{layer}; }
  template <class Fn>
  auto absorb(const MapOp<Fn>&) const {
    return MatMulOp<Layer, Bias, Fns..., Fn>{layer};
  }

  static std::string op_name() {
    std::string s = "MatMul";
    if (Bias) s += " + BiasAdd";
    ((s += " + " + std::string(Fns::name)), ...);
    return s;
  }
  std::string label() const { return layer->label(); }
};

// x + bias over the last axis, bias being the layer's.
template <class Layer>
struct BiasAddOp {
  using layer_type = Layer;
  using T = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = true;

  const Layer* layer;

  static constexpr ShapeResult rule(index_t out, const Shape& x) {
    if (x.rank() > 0 && out != dyn && x.back() != dyn && x.back() != out) {
      return fault(x, ShapeFault::last_dimension, out);
    }
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::out_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->out_channels(), in[0]); }

  template <class Backend>
  void run(const T* const* in, const Shape* in_shapes, T* out, const Shape&) const {
    const index_t cols = layer->out_channels();
    Backend::add_bias(in[0], cols == 0 ? 0 : in_shapes[0].numel() / cols, cols, layer->bias.data(), out);
  }

  static std::string op_name() { return "BiasAdd"; }
  std::string label() const { return layer->label(); }
};

}  // namespace ops

namespace nn {

// y = x · weightᵀ + bias over the last axis of x (MindSpore's nn.Dense). In and Out are
// compile-time sizes, or duet::dyn for sizes given to the constructor at run time.
template <index_t In = dyn, index_t Out = dyn, ElementType T = float>
class Dense : public Cell<Dense<In, Out, T>, CONTEXT_MODE, T> {
  static_assert(In == dyn || In > 0, "nn::Dense<In, Out>: In must be positive (or duet::dyn)");
  static_assert(Out == dyn || Out > 0, "nn::Dense<In, Out>: Out must be positive (or duet::dyn)");

 public:
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;

  BasicParameter<T> weight;  // [out_channels, in_channels]
  BasicParameter<T> bias;    // [out_channels]
  DUET_CELL_MEMBERS(weight, bias);

  Dense()
    requires(In != dyn && Out != dyn)
      : Dense(In, Out) {}

  // MindSpore 2.x's default initialisation, from the global generator (set_seed): weight
  // HeUniform(a = sqrt(5)), which is U(-1/sqrt(in), 1/sqrt(in)); bias U(-1/sqrt(in), 1/sqrt(in)).
  Dense(index_t in_channels, index_t out_channels) : in_(in_channels), out_(out_channels) {
    if ((In != dyn && in_channels != In) || (Out != dyn && out_channels != Out) || in_channels <= 0 ||
        out_channels <= 0) {
      throw ValueError(type_name() + ": cannot be built with in_channels " + std::to_string(in_channels) +
                       " and out_channels " + std::to_string(out_channels));
    }
    const T bound = T(1) / std::sqrt(static_cast<T>(in_channels));
    with_global_generator([&](Generator& gen) {
      weight = BasicParameter<T>(uniform<T>({out_channels, in_channels}, -bound, bound, gen));
      bias = BasicParameter<T>(uniform<T>({out_channels}, -bound, bound, gen));
    });
  }

  index_t in_channels() const {
    if constexpr (In != dyn) return In;
    else return in_;
  }
  index_t out_channels() const {
    if constexpr (Out != dyn) return Out;
    else return out_;
  }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::BiasAddOp<Dense>{this}, apply(ops::MatMulOp<Dense>{this}, std::forward<X>(x)));
  }

  std::string type_name() const override {
    std::string s = "nn::Dense<" + size_name(In) + ", " + size_name(Out);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  static std::string size_name(index_t n) { return n == dyn ? "dyn" : std::to_string(n); }

  index_t in_;
  index_t out_;
};

}  // namespace nn
}  // namespace duet
// Reshaping layers. They move no data: in both modes their output is a view of their input.

#include <string>
#include <utility>


namespace duet {
namespace ops {

// [N, d1, d2, ...] -> [N, d1 * d2 * ...].
struct FlattenOp {
  using layer_type = FlattenOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    if (x.leading_unknown()) return {Shape{dyn, dyn}};
    if (x.rank() == 0) return fault(Shape{1, 1}, ShapeFault::min_rank, 1);
    return {Shape{x[0], x.numel_from(1)}};
  }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  static std::string op_name() { return "Flatten"; }
  std::string label() const { return "nn::Flatten"; }
};

template <class X>
auto flatten(X&& x) {
  return apply(FlattenOp{}, std::forward<X>(x));
}

}  // namespace ops

namespace nn {

// Keeps the first (batch) axis and merges the rest (MindSpore's nn.Flatten).
template <ElementType T>
class BasicFlatten : public Cell<BasicFlatten<T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return ops::flatten(std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::Flatten"; }
};

using Flatten = BasicFlatten<float>;

}  // namespace nn
}  // namespace duet
// Printing tensors: `std::cout << t` and duet::to_string(t) give exactly what numpy 1.24's
// str(array) gives with the default print options, which is how MindSpore prints tensors.
//
// The code follows numpy/core/arrayprint.py (array2string, _formatArray, FloatingFormat,
// IntegerFormat); the names below refer to it. numpy's Dragon4 prints the shortest decimal that
// reads back as the same value, as std::to_chars does, and rounds the exact binary value to
// nearest, ties to even, when a precision cuts it short, as std::to_chars does too.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace duet {

namespace detail {

// numpy's default print options.
inline constexpr std::size_t print_line_width = 75;
inline constexpr index_t print_threshold = 1000;  // more elements than this are summarised
inline constexpr index_t print_edge_items = 3;    // kept at each end of a summarised axis
inline constexpr int print_precision = 8;         // most digits after the point

// Stands for the "..." of a summarised axis where an index would be.
inline constexpr index_t print_ellipsis = -1;

// Calls fn with the indices along an axis of length n that are printed, in order, and with
// print_ellipsis where the middle ones are left out.
template <class Fn>
void for_each_printed(index_t n, bool summarise, Fn&& fn) {
  const bool gap = summarise && n > 2 * print_edge_items;
  for (index_t i = 0; i < n; ++i) {
    if (gap && i == print_edge_items) {
      fn(print_ellipsis);
      i = n - print_edge_items;
    }
    fn(i);
  }
}

// The printed elements in order: numpy computes the format from these alone (_leading_trailing).
template <class T>
void collect_printed(const T* data, const Shape& shape, int axis, bool summarise, std::vector<T>& out) {
  if (axis == shape.rank()) {
    out.push_back(*data);
    return;
  }
  const index_t stride = shape.numel_from(axis + 1);
  for_each_printed(shape[axis], summarise, [&](index_t i) {
    if (i != print_ellipsis) collect_printed(data + i * stride, shape, axis + 1, summarise, out);
  });
}

template <class... Args>
std::string chars_of(Args... args) {
  char buf[400];  // fits any double, even in fixed notation with print_precision decimals
  const auto result = std::to_chars(buf, buf + sizeof buf, args...);
  return std::string(buf, result.ptr);
}

inline std::string integer_str(std::int64_t x) { return chars_of(x); }

// A finite float in scientific notation: sign, significant digits and the exponent of the first
// digit. The shortest that reads back (precision < 0), or rounded to 1 + precision digits.
struct Decimal {
  bool negative = false;
  std::string digits;
  int exponent = 0;
};

template <class F>
Decimal decimal_of(F x, int precision = -1) {
  const std::string s = precision < 0 ? chars_of(x, std::chars_format::scientific)
                                      : chars_of(x, std::chars_format::scientific, precision);
  Decimal d;
  std::size_t i = 0;
  if (s[i] == '-') {
    d.negative = true;
    ++i;
  }
  for (; s[i] != 'e'; ++i) {
    if (s[i] != '.') d.digits += s[i];
  }
  ++i;
  if (s[i] == '+') ++i;  // from_chars rejects a leading '+'
  std::from_chars(s.data() + i, s.data() + s.size(), d.exponent);
  return d;
}

inline void trim_trailing_zeros(std::string& s, std::size_t keep) {
  while (s.size() > keep && s.back() == '0') s.pop_back();
}

// What numpy's Dragon4 writes either side of the point; the sign goes with the integer part.
struct FloatParts {
  std::string int_part;
  std::string frac_part;
  int exponent = 0;  // scientific notation only
};

// x rounded to `precision` digits after the point, trailing zeros dropped.
template <class F>
FloatParts fixed_parts(F x, int precision) {
  const std::string s = chars_of(x, std::chars_format::fixed, precision);
  const std::size_t point = s.find('.');
  FloatParts p;
  p.int_part = s.substr(0, point);
  if (point != std::string::npos) p.frac_part = s.substr(point + 1);
  trim_trailing_zeros(p.frac_part, 0);
  return p;
}

// dragon4_positional(x, precision, min_digits, unique=True, fractional=True, trim='.'), where
// precision < 0 means none and min_digits is -1 (none) or 0.
template <class F>
FloatParts positional_parts(F x, int precision, int min_digits) {
  const Decimal d = decimal_of(x);
  const int n = static_cast<int>(d.digits.size());
  const int frac_digits = n - 1 - d.exponent;
  // Past `precision`, and short of `min_digits` (as in 42598728.f, shortest 4259873e1), Dragon4
  // prints the exact digits of x, rounded.
  if (precision >= 0 && frac_digits > precision) return fixed_parts(x, precision);
  if (min_digits >= 0 && frac_digits < min_digits) return fixed_parts(x, min_digits);
  FloatParts p;
  if (d.negative) p.int_part = "-";
  if (d.exponent < 0) {
    p.int_part += '0';
    p.frac_part.assign(static_cast<std::size_t>(-d.exponent - 1), '0');
    p.frac_part += d.digits;
  } else if (d.exponent + 1 >= n) {
    p.int_part += d.digits;
    p.int_part.append(static_cast<std::size_t>(d.exponent + 1 - n), '0');
  } else {
    const auto split = static_cast<std::size_t>(d.exponent + 1);
    p.int_part += d.digits.substr(0, split);
    p.frac_part = d.digits.substr(split);
  }
  return p;
}

inline FloatParts scientific_parts(const Decimal& d) {
  FloatParts p;
  if (d.negative) p.int_part = "-";
  p.int_part += d.digits[0];
  p.frac_part = d.digits.substr(1);
  p.exponent = d.exponent;
  return p;
}

// dragon4_scientific(x, precision, unique=True, trim='.'); precision < 0 means none.
template <class F>
FloatParts scientific_parts(F x, int precision) {
  Decimal d = decimal_of(x);
  if (precision >= 0 && static_cast<int>(d.digits.size()) - 1 > precision) {
    d = decimal_of(x, precision);
    trim_trailing_zeros(d.digits, 1);
  }
  return scientific_parts(d);
}

// "e+05", "e-123": at least min_digits digits.
inline std::string exponent_str(int exponent, std::size_t min_digits) {
  std::string digits = integer_str(exponent < 0 ? -exponent : exponent);
  if (digits.size() < min_digits) digits.insert(0, min_digits - digits.size(), '0');
  return (exponent < 0 ? "e-" : "e+") + digits;
}

inline std::string pad_left(std::string s, std::size_t width) {
  if (s.size() < width) s.insert(0, width - s.size(), ' ');
  return s;
}

inline std::string pad_right(std::string s, std::size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

// str() of a numpy scalar, which is what str() of a 0-d array is.
template <class T>
std::string scalar_str(T x) {
  if constexpr (std::is_integral_v<T>) {
    return integer_str(x);
  } else {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
    const double magnitude = std::fabs(static_cast<double>(x));
    if (magnitude == 0 || (magnitude >= 1e-4 && magnitude < 1e16)) {
      const FloatParts p = positional_parts(x, -1, -1);
      return p.int_part + '.' + (p.frac_part.empty() ? "0" : p.frac_part);
    }
    const FloatParts p = scientific_parts(x, -1);
    return p.int_part + (p.frac_part.empty() ? "" : '.' + p.frac_part) + exponent_str(p.exponent, 2);
  }
}

// FloatingFormat with floatmode 'maxprec', sign '-', suppress_small off.
template <class F>
class FloatingFormat {
 public:
  explicit FloatingFormat(const std::vector<F>& data) {
    bool any_nonzero = false;
    bool any_finite = false;
    bool any_nonfinite = false;
    bool negative_inf = false;
    F max_val = 0;
    F min_val = 0;
    for (F x : data) {
      if (!std::isfinite(x)) {
        any_nonfinite = true;
        negative_inf = negative_inf || (std::isinf(x) && x < 0);
        continue;
      }
      any_finite = true;
      if (x == 0) continue;
      const F a = std::fabs(x);
      max_val = any_nonzero ? std::max(max_val, a) : a;
      min_val = any_nonzero ? std::min(min_val, a) : a;
      any_nonzero = true;
    }
    if (any_nonzero) {
      // numpy compares the limits as float64 but divides in the element type.
      const F ratio = max_val / min_val;
      exp_format_ =
          static_cast<double>(max_val) >= 1e8 || static_cast<double>(min_val) < 1e-4 || ratio > 1000;
    }

    if (any_finite && exp_format_) {
      std::size_t exp_digits = 0;
      for (F x : data) {
        if (!std::isfinite(x)) continue;
        const FloatParts p = scientific_parts(x, print_precision);
        pad_left_ = std::max(pad_left_, p.int_part.size());
        precision_ = std::max(precision_, p.frac_part.size());
        exp_digits = std::max(exp_digits, exponent_str(p.exponent, 2).size() - 2);  // less "e+"
      }
      exp_size_ = exp_digits;
      pad_right_ = exp_size_ + 2 + precision_;
    } else if (any_finite) {
      for (F x : data) {
        if (!std::isfinite(x)) continue;
        const FloatParts p = positional_parts(x, print_precision, -1);
        pad_left_ = std::max(pad_left_, p.int_part.size());
        pad_right_ = std::max(pad_right_, p.frac_part.size());
      }
    }

    if (any_nonfinite) {
      // Room for "nan" and "inf" (or "-inf"), right-aligned with the numbers' last column.
      const std::size_t width = negative_inf ? 4 : 3;
      if (width > pad_right_ + 1) pad_left_ = std::max(pad_left_, width - (pad_right_ + 1));
    }
  }

  std::string operator()(F x) const {
    if (std::isnan(x)) return pad_left("nan", pad_left_ + pad_right_ + 1);
    if (std::isinf(x)) return pad_left(x < 0 ? "-inf" : "inf", pad_left_ + pad_right_ + 1);
    if (exp_format_) {
      // numpy asks Dragon4 for min_digits = precision_, and it goes on past the shortest digits
      // with the exact ones: every mantissa is x rounded to precision_ digits, not zero-padded.
      const FloatParts p = scientific_parts(decimal_of(x, static_cast<int>(precision_)));
      return pad_left(p.int_part, pad_left_) + '.' + p.frac_part + exponent_str(p.exponent, exp_size_);
    }
    // numpy asks for min_digits = 0 here, but not when measuring.
    const FloatParts p = positional_parts(x, print_precision, 0);
    return pad_left(p.int_part, pad_left_) + '.' + pad_right(p.frac_part, pad_right_);
  }

 private:
  bool exp_format_ = false;
  std::size_t pad_left_ = 0;
  std::size_t pad_right_ = 0;
  std::size_t precision_ = 0;  // digits after the point of every mantissa, in exp_format_
  std::size_t exp_size_ = 0;   // digits of every exponent, in exp_format_
};

template <class I>
class IntegerFormat {
 public:
  explicit IntegerFormat(const std::vector<I>& data) {
    const auto [lo, hi] = std::minmax_element(data.begin(), data.end());
    width_ = std::max(integer_str(*lo).size(), integer_str(*hi).size());
  }

  std::string operator()(I x) const { return pad_left(integer_str(x), width_); }

 private:
  std::size_t width_ = 0;
};

// _formatArray, writing into one string. numpy measures each line from its hanging indent; here
// from the previous newline, which gives the same columns because the '['s opening a row take
// the place of the hanging indent one for one.
template <class T, class Format>
class ArrayWriter {
 public:
  ArrayWriter(const BasicTensor<T>& t, bool summarise, const Format& format)
      : data_(t.data()), shape_(t.shape()), summarise_(summarise), format_(format) {}

  std::string run() && {
    write(0, 0, print_line_width);
    return std::move(out_);
  }

 private:
  void write(int axis, index_t offset, std::size_t width) {
    const auto indent = static_cast<std::size_t>(axis) + 1;
    const bool innermost = axis == shape_.rank() - 1;
    const index_t stride = shape_.numel_from(axis + 1);
    bool first = true;
    out_ += '[';
    for_each_printed(shape_[axis], summarise_, [&](index_t i) {
      if (innermost) {
        if (!first) out_ += ' ';
        // The last column is kept for the closing ']'.
        extend_line(i == print_ellipsis ? "..." : format_(data_[offset + i]), width - 1, indent);
      } else {
        // Sub-arrays of rank n are separated by n - 1 blank lines.
        if (!first) start_line(static_cast<std::size_t>(shape_.rank() - axis - 1), indent);
        if (i == print_ellipsis) {
          out_ += "...";
        } else {
          write(axis + 1, offset + i * stride, width - 1);
        }
      }
      first = false;
    });
    out_ += ']';
  }

  // _extendLine: wraps unless the line holds nothing but its indent, since wrapping would not help.
  void extend_line(const std::string& word, std::size_t width, std::size_t indent) {
    const std::size_t column = out_.size() - line_start_;
    if (column + word.size() > width && column > indent) {
      while (out_.back() == ' ') out_.pop_back();
      start_line(1, indent);
    }
    out_ += word;
  }

  void start_line(std::size_t newlines, std::size_t indent) {
    out_.append(newlines, '\n');
    line_start_ = out_.size();
    out_.append(indent, ' ');
  }

  const T* data_;
  const Shape& shape_;
  bool summarise_;
  const Format& format_;
  std::string out_;
  std::size_t line_start_ = 0;
};

}  // namespace detail

// As numpy's str(array): "[[1.  2.5]\n [3.  4. ]]".
template <ElementType T>
std::string to_string(const BasicTensor<T>& t) {
  if (t.ndim() == 0) return detail::scalar_str(t.data()[0]);
  if (t.numel() == 0) return "[]";
  const bool summarise = t.numel() > detail::print_threshold;
  std::vector<T> printed;
  detail::collect_printed(t.data(), t.shape(), 0, summarise, printed);
  if constexpr (std::is_floating_point_v<T>) {
    const detail::FloatingFormat<T> format(printed);
    return detail::ArrayWriter<T, detail::FloatingFormat<T>>(t, summarise, format).run();
  } else {
    const detail::IntegerFormat<T> format(printed);
    return detail::ArrayWriter<T, detail::IntegerFormat<T>>(t, summarise, format).run();
  }
}

template <ElementType T, index_t... Dims>
std::string to_string(const StaticTensor<T, Dims...>& t) {
  return to_string(t.tensor());
}

template <ElementType T>
std::ostream& operator<<(std::ostream& os, const BasicTensor<T>& t) {
  return os << to_string(t);
}

template <ElementType T, index_t... Dims>
std::ostream& operator<<(std::ostream& os, const StaticTensor<T, Dims...>& t) {
  return os << to_string(t.tensor());
}

}  // namespace duet
