// A user's own operation and layer, written against duet's public API only (README, "Writing
// an operation"); examples/custom_operation.cpp runs them, tests/ops_custom.cpp checks them.
#pragma once

#include <cmath>
#include <string_view>

#include <duet/duet.hpp>

namespace custom {

// gate(a, b) = a * sigmoid(b), elementwise. A binary elementwise operation is its value and the
// partial derivative of each argument; duet's BroadcastOp gives it broadcasting, both modes,
// the gradient of both inputs (reduced over broadcast axes), and fusion with the elementwise
// functions after it in graph mode.
struct Gate {
  static constexpr std::string_view name = "Gate";
  template <class T>
  static T apply(T a, T b) {
    return a * sigmoid(b);
  }
  template <int K, class T>
  static T partial(T a, T b) {
    const T s = sigmoid(b);
    return K == 0 ? s : a * s * (T(1) - s);
  }

 private:
  template <class T>
  static T sigmoid(T b) {
    return T(1) / (T(1) + std::exp(-b));
  }
};

template <class A, class B>
auto gate(const A& a, const B& b) {
  return duet::ops::binary<Gate>(a, b);
}

// A learned scale per feature (the last axis), initialised to ones: a layer with a parameter
// of its own, used directly in construct.
template <duet::index_t Features>
class Scale : public duet::nn::Cell<Scale<Features>> {
 public:
  duet::nn::Parameter weight{duet::ones({Features})};
  DUET_CELL_MEMBERS(weight);

  auto construct(auto x) { return x * weight; }
  std::string type_name() const override { return "custom::Scale<" + std::to_string(Features) + ">"; }
};

}  // namespace custom
