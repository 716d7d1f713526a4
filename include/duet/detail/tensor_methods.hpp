// Reductions as methods of every tensor type (PyTorch's x.sum(), x.mean(dim), x.max()):
// x.sum() is ops::sum(x), x.mean(ops::axes<1>, ops::keep_dims) is ops::mean(x, ops::axes<1>,
// ops::keep_dims), x.max({0, 1}) is ops::max(x, {0, 1}); the same operations, so the same
// values, gradients and graphs in both modes.
#pragma once

#include <initializer_list>
#include <span>
#include <type_traits>

namespace duet::detail {
// The ops:: reduction each method calls (ops/reduction.hpp defines it), named through the
// tensor's own type so that it is looked up where the method is used: a parameter stays a
// parameter, a symbolic tensor symbolic.
template <class X>
struct TensorMethods;
}  // namespace duet::detail

// Inside a tensor class (BasicTensor, StaticTensor, BasicParameter, ParameterResult, graph::Sym).
#define DUET_DETAIL_TENSOR_METHOD(name)                                                               \
  template <class... Args>                                                                            \
  auto name(Args... args) const {                                                                     \
    return ::duet::detail::TensorMethods<std::remove_cvref_t<decltype(*this)>>::name(*this, args...); \
  }                                                                                                   \
  template <class... Keep>                                                                            \
  auto name(std::initializer_list<int> axes, Keep... keep) const {                                    \
    return ::duet::detail::TensorMethods<std::remove_cvref_t<decltype(*this)>>::name(                 \
        *this, std::span<const int>(axes.begin(), axes.size()), keep...);                             \
  }
#define DUET_DETAIL_TENSOR_METHODS \
  DUET_DETAIL_TENSOR_METHOD(sum)   \
  DUET_DETAIL_TENSOR_METHOD(mean)  \
  DUET_DETAIL_TENSOR_METHOD(prod)  \
  DUET_DETAIL_TENSOR_METHOD(max)   \
  DUET_DETAIL_TENSOR_METHOD(min)
