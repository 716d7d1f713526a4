// MindSpore's pad_mode, shared by the layers that slide a window (convolution, pooling).
#pragma once

#include <string_view>

namespace duet::nn {

// same: ceil(size / stride) outputs, the padding split evenly with the odd one after (bottom,
// right); valid: no padding; pad: a given padding on each side (PyTorch's padding).
enum class PadMode : unsigned char { same, valid, pad };

constexpr std::string_view name_of(PadMode m) {
  return m == PadMode::same ? "same" : m == PadMode::valid ? "valid" : "pad";
}

}  // namespace duet::nn
