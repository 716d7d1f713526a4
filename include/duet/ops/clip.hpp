// Gradient clipping by global norm (MindSpore's ops.clip_by_global_norm), and by value inside
// nn::TrainOneStepCell (PyTorch's clip_grad_value_).
//
// It works on gradients once backward has made them, outside the graph, so it is the same code
// in both modes: on the list value_and_grad returns (clip, then call the optimiser with it), or
// inside nn::TrainOneStepCell ({.clip_global_norm = 1.0}), which clips the gradients backward
// left in the parameters before the optimiser reads them.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "../error.hpp"
#include "../tensor.hpp"

namespace duet::ops {

namespace detail {

inline void check_clip_norm(double clip_norm) {
  if (!(clip_norm > 0) || !std::isfinite(clip_norm)) {
    throw ValueError("ops::clip_by_global_norm: clip_norm must be positive and finite, got " +
                     std::to_string(clip_norm));
  }
}

inline void check_clip_value(double clip_value) {
  if (!(clip_value > 0) || !std::isfinite(clip_value)) {
    throw ValueError("nn::TrainOneStepCell: clip_grad_value must be positive and finite, got " + std::to_string(clip_value));
  }
}

// Clamps each element of each tensor to [-clip_value, clip_value] in place; whether every
// element was finite (a NaN stays NaN, an infinity becomes the bound).
template <class Tensors>
bool clamp_in_place(const Tensors& tensors, double clip_value) {
  bool finite = true;
  for (auto* t : tensors) {
    using T = std::remove_cvref_t<decltype(t->values()[0])>;
    const auto bound = static_cast<T>(clip_value);
    for (auto& v : t->values()) {
      finite = finite && std::isfinite(v);
      v = std::clamp(v, -bound, bound);
    }
  }
  return finite;
}

// sqrt(Σ over every tensor of Σ x²), accumulated in double: float gradients of a large model
// would lose the small ones' squares in a float sum. Tensors is a range of tensor pointers.
template <class Tensors>
double global_norm_of(const Tensors& tensors) {
  double sum = 0;
  for (const auto* t : tensors) {
    for (auto v : t->values()) sum += static_cast<double>(v) * static_cast<double>(v);
  }
  return std::sqrt(sum);
}

// Scales each tensor in place by clip_norm / max(norm, clip_norm); those whose norm is within
// clip_norm are left bit for bit as they are. Returns the norm before clipping.
template <class Tensors>
double clip_in_place(const Tensors& tensors, double clip_norm) {
  check_clip_norm(clip_norm);
  const double norm = global_norm_of(tensors);
  if (norm > clip_norm || !std::isfinite(norm)) {
    const double factor = clip_norm / norm;
    for (auto* t : tensors) {
      using T = std::remove_cvref_t<decltype(t->values()[0])>;
      for (auto& v : t->values()) v = static_cast<T>(v * factor);
    }
  }
  return norm;
}

}  // namespace detail

// The global norm of a list of tensors: the norm of all their elements taken together.
template <ElementType T>
double global_norm(const std::vector<BasicTensor<T>>& x) {
  std::vector<const BasicTensor<T>*> all;
  for (const auto& t : x) all.push_back(&t);
  return detail::global_norm_of(all);
}

// MindSpore's ops.clip_by_global_norm(x, clip_norm=1.0, use_norm=None): each tensor times
// clip_norm / max(global_norm(x), clip_norm), so that the clipped list's global norm is at most
// clip_norm. New tensors; x is not changed. A NaN or infinite norm goes through the same formula,
// as in MindSpore. Each keeps whose gradient it is (BasicTensor::gradient_of), so that an
// optimiser given the clipped list checks and skips as it would the list itself.
template <ElementType T>
std::vector<BasicTensor<T>> clip_by_global_norm(const std::vector<BasicTensor<T>>& x, double clip_norm = 1.0) {
  std::vector<BasicTensor<T>> out;
  std::vector<BasicTensor<T>*> all;
  out.reserve(x.size());
  for (const auto& t : x) {
    all.push_back(&out.emplace_back(t.clone()));
    if (t.gradient_of() != nullptr) out.back().mark_gradient_of(t.gradient_of(), t.gradient_reached());
  }
  detail::clip_in_place(all, clip_norm);
  return out;
}

}  // namespace duet::ops
