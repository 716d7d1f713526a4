// Shapes: one constexpr type for concrete shapes (tensors) and shape patterns (graphs).
//
// A pattern may hold dynamic dimensions (duet::dyn) and may have unknown leading dimensions
// ("[..., 784]"), which is how graph mode captures a runtime tensor whose rank it cannot know.
// Shape rules are written once over this type and run both at compile time (on patterns,
// to reject mismatches before the program exists) and at run time (on concrete shapes).
#pragma once

#include <array>
#include <initializer_list>
#include <ostream>
#include <string>

#include "config.hpp"
#include "error.hpp"

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
DUET_DETAIL_COMPILED std::string to_string(const Shape& s);

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << to_string(s); }

// A shape fixed at compile time; duet::shape<64, 1, 28, 28> is its value.
template <index_t... Dims>
struct StaticShape {
  static_assert(sizeof...(Dims) <= max_rank, "duet::StaticShape: rank exceeds duet::max_rank");
  static_assert(((Dims >= 0 || Dims == dyn) && ...), "duet::StaticShape: dimensions must be >= 0 or duet::dyn");
  static constexpr Shape value{Dims...};
  constexpr operator Shape() const { return value; }
};

template <index_t... Dims>
inline constexpr StaticShape<Dims...> shape{};

}  // namespace duet

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/shape_impl.hpp"
#endif
