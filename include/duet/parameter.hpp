// Parameters: the tensors a cell learns.
#pragma once

#include <algorithm>
#include <string>

#include "tensor.hpp"

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
