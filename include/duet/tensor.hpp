// duet::BasicTensor: a row-major, contiguous, reference-counted n-d array with a runtime shape,
// and duet::StaticTensor, the same with its shape (or part of it) fixed in the type.
//
// Copies share elements, as MindSpore and numpy references do; clone() copies them. Views
// (reshape, operator[]) share the block of the tensor they come from.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "detail/tensor_methods.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "memory.hpp"
#include "shape.hpp"

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

// Called with a tensor's trace id when C++ reads or writes one of its elements (item(),
// element access) while PIJit records a trace on this thread (trace.hpp sets it): a branch on
// a value would be replayed as it went the first time, so the trace breaks instead.
using HostAccessHook = void (*)(std::uint64_t trace_id);
inline HostAccessHook& host_access_hook() {
  thread_local HostAccessHook hook = nullptr;
  return hook;
}

}  // namespace detail

template <ElementType T>
class BasicTensor {
 public:
  using value_type = T;

  // An empty one-dimensional tensor.
  BasicTensor() : shape_{0} {}

  // Zero-filled.
  explicit BasicTensor(const Shape& shape) : BasicTensor(uninitialized(shape)) { std::fill_n(data_, numel(), T{}); }

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

  // Non-const access may write, so it moves version().
  T* data() {
    storage_.note_write();
    return data_;
  }
  const T* data() const { return data_; }
  std::span<T> values() { return {data(), static_cast<std::size_t>(numel())}; }
  std::span<const T> values() const { return {data_, static_cast<std::size_t>(numel())}; }

  // Element access; negative indices count from the end, as in numpy. Always bounds-checked:
  // kernels use data(), so this is never the hot path.
  template <std::integral... I>
  T& operator()(I... index) {
    note_host_access();
    return data()[offset_of({static_cast<index_t>(index)...})];
  }
  template <std::integral... I>
  const T& operator()(I... index) const {
    note_host_access();
    return data_[offset_of({static_cast<index_t>(index)...})];
  }

  // x.sum(), x.mean(ops::axes<1>), x.max({0, 1}, ops::keep_dims): ops::sum(x, ...) and its kin.
  DUET_DETAIL_TENSOR_METHODS

  // The only element of a tensor with one element.
  T item() const {
    if (numel() != 1) {
      throw ShapeError("duet::Tensor::item: needs exactly one element, shape is " + to_string(shape_));
    }
    note_host_access();
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
      throw ShapeError("duet::Tensor::reshape: cannot view " + to_string(shape_) + " (" + std::to_string(numel()) +
                       " elements) as " + to_string(to));
    }
    return view(0, to);
  }

  // The elements from `offset` on, as a view of shape `to` (a slice along the first axis).
  BasicTensor view(index_t offset, const Shape& to) const {
    if (!to.is_concrete() || offset < 0 || offset + to.numel() > numel()) {
      throw ShapeError("duet::Tensor::view: cannot view " + std::to_string(to.numel()) + " elements from element " +
                       std::to_string(offset) + " of " + to_string(shape_) + " as " + to_string(to));
    }
    BasicTensor v = *this;
    v.shape_ = to;
    v.data_ = data_ + offset;
    v.tape_id_ = 0;
    v.trace_id_ = 0;
    return v;
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
    view.tape_id_ = 0;
    view.trace_id_ = 0;
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

  // Moves whenever the elements may have been written through any handle sharing them (each
  // non-const data(), values() or element access counts), and only then: what is computed
  // from the elements at one version, such as a pre-packed weight, is current while the
  // version stays. Writes through a pointer kept from an earlier data() are not seen.
  std::uint64_t version() const { return storage_.writes(); }

  // The parameter whose gradient value_and_grad returned in these elements (copies and views
  // share it), nullptr for any other tensor: an optimiser given it for another parameter
  // refuses it rather than apply it there. Not reached: zeros for a parameter that has no
  // gradient (unused by the function, or frozen), which an optimiser skips, weight decay and
  // momentum included, as PyTorch skips a parameter whose grad is None.
  const void* gradient_of() const { return storage_.gradient_of(); }
  bool gradient_reached() const { return storage_.gradient_reached(); }
  void mark_gradient_of(const void* parameter, bool reached = true) const { storage_.mark_gradient_of(parameter, reached); }

  // Which value of a recording tape (autodiff) this handle is; 0 for none. Copies keep it,
  // views a user makes (reshape, operator[]) do not: they are new values the tape never saw.
  std::uint64_t tape_id() const { return tape_id_; }
  void set_tape_id(std::uint64_t id) { tape_id_ = id; }
  // The same for a recording PIJit trace, which may record while a tape does (a training step).
  std::uint64_t trace_id() const { return trace_id_; }
  void set_trace_id(std::uint64_t id) { trace_id_ = id; }

 private:
  void note_host_access() const {
    if (const detail::HostAccessHook hook = detail::host_access_hook()) hook(trace_id_);
  }
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
  std::uint64_t tape_id_ = 0;
  std::uint64_t trace_id_ = 0;
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
  StaticTensor() requires(((Dims != dyn) && ...)) : tensor_(static_shape) {}

  // Adopts a runtime tensor after checking it against the static shape.
  explicit StaticTensor(BasicTensor<T> tensor) : tensor_(std::move(tensor)) {
    const Shape& s = tensor_.shape();
    bool ok = s.rank() == static_shape.rank();
    for (int i = 0; ok && i < s.rank(); ++i) ok = static_shape[i] == dyn || static_shape[i] == s[i];
    if (!ok) {
      throw ShapeError("duet::StaticTensor" + to_string(static_shape) + ": got a tensor of shape " + to_string(s));
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
  requires(sizeof...(I) == sizeof...(Dims)) T& operator()(I... index) { return tensor_(index...); }
  template <std::integral... I>
  requires(sizeof...(I) == sizeof...(Dims)) const T& operator()(I... index) const { return tensor_(index...); }

  DUET_DETAIL_TENSOR_METHODS

 private:
  BasicTensor<T> tensor_;
};

// The runtime tensor of either kind of tensor.
template <ElementType T>
const BasicTensor<T>& tensor_of(const BasicTensor<T>& t) {
  return t;
}
template <ElementType T, index_t... D>
const BasicTensor<T>& tensor_of(const StaticTensor<T, D...>& t) {
  return t.tensor();
}

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
