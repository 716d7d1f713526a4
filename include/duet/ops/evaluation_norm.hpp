// A BatchNorm at evaluation as what a convolution before it folds in, whatever the layer's type:
// its per-channel affine map, the tensors the fold watches for changes, its label and its
// train/evaluate setting. Graph mode's passes meet the layer's own type, but PIJit's fusion
// holds steps of erased types (trace.hpp: no code sees a producer's type and its consumer's
// together), so both fold through this one description, with the same code and the same bits.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "../tensor.hpp"

namespace duet::ops {

// y = x · scale + shift per channel.
template <class T>
struct AffineMap {
  std::vector<T> scale;
  std::vector<T> shift;
};

template <class T>
class EvaluationNorm {
 public:
  template <class Layer>
  static EvaluationNorm of(const Layer& layer) {
    return EvaluationNorm(&layer, {&layer.gamma, &layer.beta, &layer.moving_mean, &layer.moving_variance},
                          [](const void* l) { return static_cast<const Layer*>(l)->label(); },
                          [](const void* l) { return static_cast<const Layer*>(l)->training(); },
                          [](const void* l) { return static_cast<const Layer*>(l)->evaluation_affine(); });
  }

  std::string label() const { return label_(layer_); }
  bool training() const { return training_(layer_); }
  AffineMap<T> evaluation_affine() const { return affine_(layer_); }
  // gamma, beta, moving mean, moving variance: a write to any makes the fold stale.
  const std::array<const BasicTensor<T>*, 4>& tensors() const { return tensors_; }

 private:
  EvaluationNorm(const void* layer, std::array<const BasicTensor<T>*, 4> tensors, std::string (*label)(const void*),
                 bool (*training)(const void*), AffineMap<T> (*affine)(const void*))
      : layer_(layer), tensors_(tensors), label_(label), training_(training), affine_(affine) {}

  const void* layer_;
  std::array<const BasicTensor<T>*, 4> tensors_;
  std::string (*label_)(const void*);
  bool (*training_)(const void*);
  AffineMap<T> (*affine_)(const void*);
};

}  // namespace duet::ops
