// Where a graph meets the host: printing a live value, recording it for after the call, and
// calling back into C++.
//
// duet::print is a graph operation: in either mode, and at every jit level, it prints the value
// when it is computed and passes it on unchanged (as a view), so a user never has to take jit
// away to see a value. duet::host runs any C++ function on a value: a host node, a graph
// break that runs eagerly between compiled parts, named by the line that calls it. A jit
// function (or a cell's construct) of JitSyntaxLevel::strict refuses host nodes at compile
// time, and one of JitSyntaxLevel::compatible those not marked duet::allowed_break.
#pragma once

#include <algorithm>
#include <array>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "eager.hpp"
#include "graph.hpp"
#include "jit_config.hpp"
#include "print.hpp"
#include "tensor.hpp"

namespace duet {

namespace detail {
inline std::mutex& print_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace detail

// Where a call was made, taken as a default argument is. Not std::source_location: libstdc++
// 12 leaves it empty under clang 14, which lacks __builtin_source_location; the builtins
// below are in both compilers.
struct SourceLocation {
  const char* file = "";
  unsigned line = 0;
  static constexpr SourceLocation current(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    return {file, line};
  }
  // Appended, not a chain of operator+: g++ 12 warns of bounds (-Warray-bounds) inside such a
  // chain at -O1, falsely.
  std::string to_string() const {
    std::string s = file;
    s += ':';
    s += std::to_string(line);
    return s;
  }
};

// The values duet::record_value records on this thread while it lives: a compiled graph's
// intermediate tensors, read after the call without leaving graph mode (PyNative records them
// as it runs, too). Without a recorder the recording nodes look at nothing: no copy, no
// allocation, one thread-local read. Recorders nest; the innermost records. A tag recorded
// again keeps the newest value.
class ValueRecorder {
 public:
  ValueRecorder() : outer_(active()) { active() = this; }
  ~ValueRecorder() { active() = outer_; }
  ValueRecorder(const ValueRecorder&) = delete;
  ValueRecorder& operator=(const ValueRecorder&) = delete;

  bool contains(const std::string& tag) const { return values_.contains(tag); }
  std::vector<std::string> tags() const {
    std::vector<std::string> out;
    for (const auto& [tag, entry] : values_) out.push_back(tag);
    return out;
  }

  template <ElementType T = float>
  const BasicTensor<T>& get(const std::string& tag) const {
    const auto it = values_.find(tag);
    if (it == values_.end()) {
      std::string recorded;
      for (const auto& [t, entry] : values_) recorded += (recorded.empty() ? "'" : ", '") + t + "'";
      throw ValueError("duet::ValueRecorder: no value was recorded under '" + tag + "' (recorded: " +
                       (recorded.empty() ? std::string("none") : recorded) + ")");
    }
    if (it->second.dtype != dtype_of<T>) {
      throw ValueError("duet::ValueRecorder: '" + tag + "' holds " + std::string(name_of(it->second.dtype)) +
                       " values, asked for " + std::string(name_of(dtype_of<T>)));
    }
    return *static_cast<const BasicTensor<T>*>(it->second.value.get());
  }

  // The recorder of the calling thread, or null.
  static ValueRecorder*& active() {
    thread_local ValueRecorder* recorder = nullptr;
    return recorder;
  }

  template <class T>
  void record(const char* tag, const T* values, const Shape& shape) {
    auto copy = std::make_shared<BasicTensor<T>>(BasicTensor<T>::uninitialized(shape));
    std::copy_n(values, copy->numel(), copy->data());
    values_[tag] = Entry{dtype_of<T>, std::move(copy)};
  }

 private:
  struct Entry {
    DType dtype;
    std::shared_ptr<const void> value;
  };
  std::map<std::string, Entry> values_;
  ValueRecorder* outer_;
};

namespace ops {

struct IdentityGradOp : Primitive<IdentityGradOp> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  static std::string op_name() { return "Identity"; }
};

// What PrintOp and RecordOp share: a view of the input, whose kernel only looks at it (so it
// runs at every jit level, in both modes) and whose gradient passes through.
template <class Derived>
struct LookOp {
  using layer_type = Derived;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool has_side_effects = true;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return IdentityGradOp{};
  }

  std::string label() const { return Derived::op_name(); }
};

// Prints "label: value" (numpy's format) when the value is computed; outputs its input.
struct PrintOp : LookOp<PrintOp> {
  const char* text;        // the label; a string literal or a string that outlives the graph
  std::ostream* out;
  PrintOp(const char* t, std::ostream* o) : text(t), out(o) {}

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    auto copy = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), copy.numel(), copy.data());
    // One print at a time: threads running graphs side by side do not interleave lines.
    std::lock_guard lock(duet::detail::print_mutex());
    *out << (text[0] != '\0' ? std::string(text) + ": " : std::string()) << copy << '\n';
  }

  static std::string op_name() { return "Print"; }
};

// Records the value under `tag` in the thread's duet::ValueRecorder, when there is one.
struct RecordOp : LookOp<RecordOp> {
  const char* tag;  // a string literal or a string that outlives the graph
  explicit RecordOp(const char* t) : tag(t) {}

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    if (ValueRecorder* recorder = ValueRecorder::active()) recorder->record(tag, a.in<T>(), a.in_shape());
  }

  static std::string op_name() { return "Record"; }
};

// Calls a C++ function on the value; its result (of the same shape) is the node's value.
// Allowed: the call was marked an intended graph break (duet::host<duet::allowed_break>).
template <class T, bool Allowed = false>
struct HostOp {
  using layer_type = HostOp;
  using value_type = T;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_host = true;
  static constexpr bool allowed_break = Allowed;

  std::function<BasicTensor<T>(const BasicTensor<T>&)> fn;
  SourceLocation where;  // the duet::host call: what graph_ir and the compile log name

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    auto input = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), input.numel(), input.data());
    const BasicTensor<T> result = fn(input);
    if (!(result.shape() == a.output_shape)) {
      throw ShapeError("duet::host: the callback must return its input's shape " + to_string(a.output_shape) +
                       ", returned " + to_string(result.shape()));
    }
    std::copy_n(result.data(), result.numel(), a.out<T>());
  }

  static std::string op_name() { return "Host"; }
  std::string label() const {
    std::string s = Allowed ? "duet::host<allowed_break> at " : "duet::host at ";
    s += where.to_string();
    return s;
  }
};

}  // namespace ops

// Marks a host callback as an intended graph break: duet::host<duet::allowed_break>(fn, x).
// JitSyntaxLevel::compatible accepts such breaks only.
struct allowed_break {};

namespace graph {
// The first host node of G, or G::size; with UnmarkedOnly, the first not marked allowed_break.
template <class G, bool UnmarkedOnly = false>
constexpr std::size_t first_host_node() {
  std::size_t found = G::size;
  for_each_index<G::size>([&](auto i) {
    using Op = typename node_at<G, decltype(i)::value>::op_type;
    if constexpr (is_host_op<Op>()) {
      if (found == G::size && !(UnmarkedOnly && Op::allowed_break)) found = decltype(i)::value;
    }
  });
  return found;
}

// The jit syntax level of Config, checked on a captured graph G, for every front end (a cell's
// construct, a jitted function, grad): strict refuses every host callback, compatible those
// not marked allowed_break, lax none.
template <JitConfig Config, class G>
constexpr void check_syntax_level() {
  if constexpr (Config.jit_syntax_level == JitSyntaxLevel::strict) {
    static_assert(first_host_node<G>() == G::size,
                  "duet::jit: JitSyntaxLevel::strict: the function calls duet::host, a host callback, which is not "
                  "a graph operation; use JitSyntaxLevel::lax to run it as a graph break");
  } else if constexpr (Config.jit_syntax_level == JitSyntaxLevel::compatible) {
    static_assert(first_host_node<G, true>() == G::size,
                  "duet::jit: JitSyntaxLevel::compatible: the function calls duet::host without marking the graph "
                  "break as intended; write duet::host<duet::allowed_break>(fn, x), or use JitSyntaxLevel::lax");
  }
}
}  // namespace graph

// Prints x with an optional label when it is computed, and returns it: in PyNative at once, in a
// graph when the graph runs. The label must outlive the graph (a literal, say).
template <class X>
auto print(X&& x, const char* label = "", std::ostream& out = std::cout) {
  return apply(ops::PrintOp{label, &out}, std::forward<X>(x));
}

// Records x under `tag` in the calling thread's duet::ValueRecorder, if one is alive, when it is
// computed, and returns it: in PyNative at once, in a graph when the graph runs. The tag must
// outlive the graph (a literal, say).
template <class X>
auto record_value(X&& x, const char* tag) {
  return apply(ops::RecordOp{tag}, std::forward<X>(x));
}

// Runs fn (a function from a tensor to a tensor of the same shape) on x: now in PyNative, or
// as a host node (a graph break) in a graph, named by where it is called. Mark, with
// duet::host<duet::allowed_break>(fn, x), a break that is intended.
template <class Mark = void, class F, class X>
auto host(F&& fn, X&& x, SourceLocation where = SourceLocation::current()) {
  static_assert(std::is_void_v<Mark> || std::is_same_v<Mark, allowed_break>,
                "duet::host<Mark>: Mark is duet::allowed_break, or nothing");
  using T = typename std::remove_cvref_t<X>::value_type;
  return apply(ops::HostOp<T, std::is_same_v<Mark, allowed_break>>{
                   std::function<BasicTensor<T>(const BasicTensor<T>&)>(std::forward<F>(fn)), where},
               std::forward<X>(x));
}

}  // namespace duet
