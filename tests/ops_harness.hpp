// The gradient harness's cases: a test file per family of operations registers its cases
// (tests/ops_<family>.cpp), and tests/ops_gradients.cpp runs them all.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support.hpp"

namespace duet_test::ops {

using duet::BasicTensor;
using duet::Shape;
using D = BasicTensor<double>;

using duet::BasicTensor;
using duet::Shape;
using D = BasicTensor<double>;

// One check: f applied to inputs of these shapes, drawn from [lo, hi] (a domain where f is
// smooth), and optionally f's value computed independently, element by element.
struct Case {
  std::vector<Shape> shapes;
  double lo = -2.0;
  double hi = 2.0;
  // Builds the function under test; it must be generic (it runs on tensors and on symbolic
  // tensors), so each case gives it as a callable taking one to three arguments.
  std::function<std::vector<D>(const std::vector<D>&, const D& cotangent, duet::Mode, std::size_t wrt)> gradient;
  std::function<D(const std::vector<D>&)> value;
  // For elementwise operations: the function on one element of each input, from which the
  // harness computes the expected output with its own broadcasting loop.
  std::function<double(double, double)> elementwise;
  // Otherwise: the expected output from the inputs, computed with plain loops.
  std::function<D(const std::vector<D>&)> reference;
};

// numpy's broadcasting, written out independently of duet: the multi-index of each output
// element, each input read at that index with its size-1 axes pinned to 0.
inline D reference_elementwise(const std::vector<D>& xs, const Shape& out, const std::function<double(double, double)>& f) {
  D y = duet::zeros<double>(out);
  const int rank = out.rank();
  std::vector<duet::index_t> index(static_cast<std::size_t>(rank), 0);
  auto read = [&](const D& x) {
    duet::index_t offset = 0;
    for (int a = 0; a < x.shape().rank(); ++a) {
      const int axis = rank - x.shape().rank() + a;
      const duet::index_t i = x.shape()[a] == 1 ? 0 : index[static_cast<std::size_t>(axis)];
      offset = offset * x.shape()[a] + i;
    }
    return x.data()[offset];
  };
  for (duet::index_t n = 0; n < out.numel(); ++n) {
    duet::index_t rest = n;
    for (int a = rank - 1; a >= 0; --a) {
      index[static_cast<std::size_t>(a)] = rest % out[a];
      rest /= out[a];
    }
    y.data()[n] = f(read(xs[0]), xs.size() > 1 ? read(xs[1]) : 0.0);
  }
  return y;
}

inline D random_input(const Shape& s, double lo, double hi, std::uint64_t seed) {
  duet::Generator gen(seed);
  return duet::uniform<double>(s, lo, hi, gen);
}

// Wraps f (a generic callable of N tensors, then the constants) as a case: its value, and
// the value and gradient of sum(cotangent * f(...)) with respect to input `wrt`, in the given
// mode. The constants (integer indices, say) are passed after the N inputs in both modes and
// never differentiated.
template <std::size_t N, class F, class... C>
Case make_case_with(std::vector<Shape> shapes, F f, std::tuple<C...> constants = {}) {
  Case c;
  c.shapes = std::move(shapes);
  c.value = [f, constants](const std::vector<D>& xs) {
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return std::apply([&](const auto&... k) { return D(f(xs[I]..., k...)); }, constants);
    }(std::make_index_sequence<N>{});
  };
  c.gradient = [f, constants](const std::vector<D>& xs, const D& w, duet::Mode mode, std::size_t wrt) {
    duet::set_context({.mode = mode});
    // The cotangent enters as one more input, never differentiated: sum(w * f(x)) seeds
    // backward with w rather than with ones, which would hide gradients that sum to zero.
    auto loss = [f](const auto&... args) {
      auto with_w = [&](const auto& w, const auto&... x) { return f(x...) * w; };
      return with_w(args...);
    };
    auto vg = duet::value_and_grad(loss, wrt + 1);
    auto r = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return std::apply([&](const auto&... k) { return vg(w, xs[I]..., k...); }, constants);
    }(std::make_index_sequence<N>{});
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return std::vector<D>{r.value, r.grads[0]};
  };
  return c;
}

// An elementwise case: f, and the function on one element of each input from which the
// harness computes the expected output.
template <std::size_t N, class F>
Case make_case(std::vector<Shape> shapes, F f, std::function<double(double, double)> elementwise, double lo = -2.0,
               double hi = 2.0) {
  Case c = make_case_with<N>(std::move(shapes), f);
  c.elementwise = std::move(elementwise);
  c.lo = lo;
  c.hi = hi;
  return c;
}

inline double dot(const D& a, const D& b) {
  double s = 0;
  for (duet::index_t i = 0; i < a.numel(); ++i) s += a.data()[i] * b.data()[i];
  return s;
}

// Every case of every family, by the name the operation is listed under.
inline std::multimap<std::string, Case>& registry() {
  static std::multimap<std::string, Case> cases;
  return cases;
}

// Registers a family's cases at static initialisation: `const bool listed = add_cases(...)`.
inline bool add_cases(const std::function<void(std::multimap<std::string, Case>&)>& f) {
  f(registry());
  return true;
}

}  // namespace duet_test::ops
