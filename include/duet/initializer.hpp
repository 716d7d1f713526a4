// Initialisers: how a parameter gets its first values (MindSpore's mindspore.common.initializer).
//
// The namespace is MindSpore's module name, duet::initializer, so that a program ported from
// `from mindspore.common.initializer import HeNormal` finds duet::initializer::HeNormal, and
// MindSpore's creation function initializer(init, shape, dtype) is
// duet::initializer::initializer<T>(init, shape). (`namespace init = duet::initializer;` makes
// it short.) Each initialiser is a small aggregate with MindSpore's arguments and defaults,
// HeNormal{.mode = FanMode::fan_out} say, and the same formulas; the random ones draw from a
// duet::Generator, the global one (set_seed) unless given another, so the same seed gives the
// same weights whatever the mode the network later runs in. Arguments MindSpore takes as
// strings ('fan_in', 'relu') are enums here: a misspelling does not compile.
//
// A type I is an initialiser for tensors of T (the Initializer concept) when it has
// `void fill(BasicTensor<T>&, Generator&) const` and `std::string name() const`; user types
// qualify the same way, and every layer option and free function below takes them.
#pragma once

#include <cmath>
#include <concepts>
#include <functional>
#include <limits>
#include <locale>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "error.hpp"
#include "random.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace duet::initializer {

template <class I, class T>
concept Initializer = ElementType<T> && requires(const I& init, BasicTensor<T>& tensor, Generator& gen) {
  init.fill(tensor, gen);
  { init.name() } -> std::convertible_to<std::string>;
};

// MindSpore's mode='fan_in' / 'fan_out': which side of the weight keeps its variance.
enum class FanMode { fan_in, fan_out };

// MindSpore's nonlinearity argument ('linear' also stands for its 'conv1d' ... 'conv_transpose3d').
enum class Nonlinearity { linear, sigmoid, tanh, relu, leaky_relu };

struct Fans {
  index_t fan_in = 0;
  index_t fan_out = 0;
  friend bool operator==(const Fans&, const Fans&) = default;
};

namespace detail {

// Arguments as MindSpore prints them: 0.01, not 0.010000.
inline std::string number(double x) {
  std::ostringstream s;
  s.imbue(std::locale::classic());
  s << x;
  return s.str();
}

inline std::string_view name_of(FanMode mode) {
  switch (mode) {
    case FanMode::fan_in:
      return "fan_in";
    case FanMode::fan_out:
      return "fan_out";
  }
  return "?";
}

inline std::string_view name_of(Nonlinearity f) {
  switch (f) {
    case Nonlinearity::linear:
      return "linear";
    case Nonlinearity::sigmoid:
      return "sigmoid";
    case Nonlinearity::tanh:
      return "tanh";
    case Nonlinearity::relu:
      return "relu";
    case Nonlinearity::leaky_relu:
      return "leaky_relu";
  }
  return "?";
}

inline void require_finite(double x, std::string_view argument, const std::string& who) {
  if (!std::isfinite(x)) {
    throw ValueError(who + ": " + std::string(argument) + " must be a finite number, got " + number(x));
  }
}

// How a He initialiser draws: HeUniform or HeNormal.
enum class HeDraw { uniform, normal };

}  // namespace detail

// MindSpore's _calculate_fan_in_and_fan_out: a [out, in] matrix has fan_in = in and
// fan_out = out; a higher-rank weight [out, in, k1, k2, ...] (a convolution's) multiplies
// both by the receptive field k1 * k2 * .... `who` names the caller in the error.
inline Fans fan_in_and_fan_out(const Shape& shape, const std::string& who = "initializer::fan_in_and_fan_out") {
  if (shape.rank() < 2 || !shape.is_concrete()) {
    throw ValueError(who + ": fan_in and fan_out are computed for a concrete shape of at least 2 dimensions, got " +
                     to_string(shape));
  }
  const index_t receptive_field = shape.numel_from(2);
  return {shape[1] * receptive_field, shape[0] * receptive_field};
}

// MindSpore's _calculate_gain: the factor that keeps a layer's output variance through the
// nonlinearity after it. negative_slope is used by leaky_relu only.
inline double calculate_gain(Nonlinearity nonlinearity, double negative_slope = 0.01,
                             const std::string& who = "initializer::calculate_gain") {
  switch (nonlinearity) {
    case Nonlinearity::linear:
    case Nonlinearity::sigmoid:
      return 1;
    case Nonlinearity::tanh:
      return 5.0 / 3;
    case Nonlinearity::relu:
      return std::sqrt(2.0);
    case Nonlinearity::leaky_relu:
      detail::require_finite(negative_slope, "negative_slope", who);
      return std::sqrt(2.0 / (1 + negative_slope * negative_slope));
  }
  throw ValueError(who + ": nonlinearity must be linear, sigmoid, tanh, relu or leaky_relu, got value " +
                   std::to_string(static_cast<int>(nonlinearity)));
}

// N(mean, sigma²).
struct Normal {
  double sigma = 0.01;
  double mean = 0;

  std::string name() const {
    return "initializer::Normal(sigma=" + detail::number(sigma) + ", mean=" + detail::number(mean) + ")";
  }
  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    detail::require_finite(mean, "mean", name());
    if (!(sigma >= 0) || !std::isfinite(sigma)) {
      throw ValueError(name() + ": sigma must be finite and at least 0, got " + detail::number(sigma));
    }
    for (T& v : tensor.values()) v = static_cast<T>(mean + sigma * gen.normal<double>());
  }
};

// U(-scale, scale).
struct Uniform {
  double scale = 0.07;

  std::string name() const { return "initializer::Uniform(scale=" + detail::number(scale) + ")"; }
  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    if (!(scale >= 0) || !std::isfinite(scale)) {
      throw ValueError(name() + ": scale must be finite and at least 0, got " + detail::number(scale));
    }
    const auto bound = static_cast<T>(scale);
    for (T& v : tensor.values()) v = gen.uniform<T>(-bound, bound);
  }
};

// U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010).
struct XavierUniform {
  double gain = 1;

  std::string name() const { return "initializer::XavierUniform(gain=" + detail::number(gain) + ")"; }
  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    detail::require_finite(gain, "gain", name());
    const Fans fans = fan_in_and_fan_out(tensor.shape(), name());
    if (fans.fan_in + fans.fan_out == 0) {
      throw ValueError(name() + ": fan_in + fan_out is 0 for shape " + to_string(tensor.shape()));
    }
    const auto bound = static_cast<T>(gain * std::sqrt(6.0 / static_cast<double>(fans.fan_in + fans.fan_out)));
    for (T& v : tensor.values()) v = gen.uniform<T>(-bound, bound);
  }
};

// He et al., 2015: fan and gain from mode and nonlinearity. HeUniform draws U(-b, b) with
// b = gain * sqrt(3 / fan), HeNormal N(0, sigma²) with sigma = gain / sqrt(fan). nn::Dense's
// default weight is HeUniform{.negative_slope = std::sqrt(5.0)}: b = 1 / sqrt(fan_in).
template <detail::HeDraw Draw>
struct He {
  double negative_slope = 0;
  FanMode mode = FanMode::fan_in;
  Nonlinearity nonlinearity = Nonlinearity::leaky_relu;

  std::string name() const {
    return std::string(Draw == detail::HeDraw::uniform ? "initializer::HeUniform" : "initializer::HeNormal") +
           "(negative_slope=" + detail::number(negative_slope) + ", mode=" + std::string(detail::name_of(mode)) +
           ", nonlinearity=" + std::string(detail::name_of(nonlinearity)) + ")";
  }

  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    const double gain = calculate_gain(nonlinearity, negative_slope, name());
    if (mode != FanMode::fan_in && mode != FanMode::fan_out) {
      throw ValueError(name() + ": mode must be fan_in or fan_out, got value " + std::to_string(static_cast<int>(mode)));
    }
    const Fans fans = fan_in_and_fan_out(tensor.shape(), name());
    const index_t fan = mode == FanMode::fan_in ? fans.fan_in : fans.fan_out;
    if (fan == 0) {
      throw ValueError(name() + ": " + std::string(detail::name_of(mode)) + " is 0 for shape " +
                       to_string(tensor.shape()));
    }
    if constexpr (Draw == detail::HeDraw::uniform) {
      // sqrt(3) * gain is rounded to T before the division: with negative_slope = sqrt(5) it is
      // exactly 1, so the bound is T's 1 / sqrt(fan), the one nn::Dense has always drawn with.
      const T bound = static_cast<T>(std::sqrt(3.0) * gain) / std::sqrt(static_cast<T>(fan));
      for (T& v : tensor.values()) v = gen.uniform<T>(-bound, bound);
    } else {
      const double sigma = gain / std::sqrt(static_cast<double>(fan));
      for (T& v : tensor.values()) v = static_cast<T>(sigma * gen.normal<double>());
    }
  }
};
using HeUniform = He<detail::HeDraw::uniform>;
using HeNormal = He<detail::HeDraw::normal>;

// Every element `value`. It fills integer tensors too, with a value they hold exactly.
struct Constant {
  double value = 0;

  std::string name() const { return "initializer::Constant(value=" + detail::number(value) + ")"; }
  template <ElementType T>
  void fill(BasicTensor<T>& tensor, Generator& /*unused: not random*/) const {
    if (!exactly_representable<T>()) {
      throw ValueError(name() + ": a tensor of " + std::string(name_of(dtype_of<T>)) + " cannot hold " +
                       detail::number(value) +
                       (std::is_floating_point_v<T> ? " (not finite, or out of its range)" : " exactly"));
    }
    const auto v = static_cast<T>(value);
    for (T& x : tensor.values()) x = v;
  }

 private:
  template <class T>
  bool exactly_representable() const {
    if constexpr (std::is_floating_point_v<T>) {
      return std::isfinite(value) && std::abs(value) <= static_cast<double>(std::numeric_limits<T>::max());
    } else {
      // Both limits are powers of two (or their neighbours), so the comparisons are exact in double.
      return std::isfinite(value) && value == std::trunc(value) &&
             value >= static_cast<double>(std::numeric_limits<T>::min()) &&
             value < static_cast<double>(std::numeric_limits<T>::max()) + 1.0;
    }
  }
};

// Constant 0 and 1 (MindSpore's 'zeros', 'ones').
struct Zero {
  std::string name() const { return "initializer::Zero()"; }
  template <ElementType T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    Constant{0}.fill(tensor, gen);
  }
};
struct One {
  std::string name() const { return "initializer::One()"; }
  template <ElementType T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    Constant{1}.fill(tensor, gen);
  }
};

// Any initialiser of T, held by value: what a layer option such as nn::Dense's weight_init
// stores, so that it takes the built-in ones and a user's alike.
template <ElementType T>
class AnyInitializer {
 public:
  template <class I>
    requires(!std::is_same_v<std::remove_cvref_t<I>, AnyInitializer> && Initializer<std::remove_cvref_t<I>, T>)
  AnyInitializer(I&& init)  // NOLINT(google-explicit-constructor): `.weight_init = HeNormal{}` reads best
      : name_(init.name()),
        fill_([held = std::forward<I>(init)](BasicTensor<T>& tensor, Generator& gen) { held.fill(tensor, gen); }) {}

  void fill(BasicTensor<T>& tensor, Generator& gen) const { fill_(tensor, gen); }
  std::string name() const { return name_; }

 private:
  std::string name_;
  std::function<void(BasicTensor<T>&, Generator&)> fill_;
};

// Overwrites every element of `tensor` (a parameter too: the write moves its version, so no
// stale packed copy of it is used) with values from `init`, drawn from `gen`.
template <ElementType T, class I>
void initialize(BasicTensor<T>& tensor, const I& init, Generator& gen) {
  static_assert(Initializer<I, T>,
                "duet::initializer::initialize: this initialiser cannot fill a tensor of this element type (the "
                "random ones fill float and double tensors; a user's initialiser needs "
                "`void fill(BasicTensor<T>&, Generator&) const` and `std::string name() const`)");
  if constexpr (Initializer<I, T>) init.fill(tensor, gen);  // no second error after the assertion
}

// initialize() for a layer's option (weight_init, bias_init): an initialiser's ValueError is
// rethrown naming the layer and the option ("nn::Dense<4, 2> weight_init: ...").
template <ElementType T, class I>
void initialize_option(BasicTensor<T>& tensor, const I& init, Generator& gen, const std::string& layer,
                       const char* option) {
  try {
    initialize(tensor, init, gen);
  } catch (const ValueError& e) {
    throw ValueError(layer + " " + option + ": " + e.what());
  }
}

// The same, drawing from the global generator (set_seed).
template <ElementType T, class I>
void initialize(BasicTensor<T>& tensor, const I& init) {
  with_global_generator([&](Generator& gen) { initialize(tensor, init, gen); });
}

// A new tensor of `shape` made by `init` from the global generator (MindSpore's
// initializer(init, shape, dtype)): nn::Parameter(initializer<float>(HeNormal{}, {out, in})).
template <ElementType T = float, class I>
BasicTensor<T> initializer(const I& init, const Shape& shape) {
  auto tensor = BasicTensor<T>::uninitialized(shape);
  initialize(tensor, init);
  return tensor;
}

}  // namespace duet::initializer
