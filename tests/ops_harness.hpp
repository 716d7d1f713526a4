// The gradient harness's cases: a test file per family of operations registers its cases
// (tests/ops_<family>.cpp), and tests/ops_gradients.cpp runs them all.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
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
  // For any operation: its expected output from plain loops in double, written independently
  // of duet (a reduction, a product).
  std::function<D(const std::vector<D>&)> reference;
  // For an operation without gradient (argmax): its value in a mode, as doubles. The harness
  // checks the two modes against each other and against `reference`, and no gradient.
  std::function<D(const std::vector<D>&, duet::Mode)> value_in_mode;
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

// Wraps f (a generic callable of N tensors, then of the fixed inputs) as a case: its value,
// and the value and gradient of sum(cotangent * f(...)) with respect to input `wrt`, in the
// given mode. Fixed inputs (int32 class labels) follow the N differentiated ones in every call
// and are never differentiated.
template <std::size_t N, class F, class... Fixed>
Case case_of(std::vector<Shape> shapes, F f, double lo, double hi, Fixed... fixed) {
  Case c;
  c.shapes = std::move(shapes);
  c.lo = lo;
  c.hi = hi;
  c.value = [f, fixed...](const std::vector<D>& xs) {
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return [&]<std::size_t... I>(std::index_sequence<I...>) { return D(f(xs[I]..., fixed...)); }
    (std::make_index_sequence<N>{});
  };
  c.gradient = [f, fixed...](const std::vector<D>& xs, const D& w, duet::Mode mode, std::size_t wrt) {
    duet::set_context({.mode = mode});
    // The cotangent enters as one more input, never differentiated: sum(w * f(x)) seeds
    // backward with w rather than with ones, which would hide gradients that sum to zero.
    auto loss = [f](const auto&... args) {
      auto with_w = [&](const auto& w, const auto&... x) { return f(x...) * w; };
      return with_w(args...);
    };
    auto vg = duet::value_and_grad(loss, wrt + 1);
    auto r = [&]<std::size_t... I>(std::index_sequence<I...>) { return vg(w, xs[I]..., fixed...); }
    (std::make_index_sequence<N>{});
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return std::vector<D>{r.value, r.grads[0]};
  };
  return c;
}

// case_of with the fixed inputs in a tuple (gather's indices).
template <std::size_t N, class F, class... C>
Case make_case_with(std::vector<Shape> shapes, F f, std::tuple<C...> constants = {}) {
  return std::apply([&](const auto&... k) { return case_of<N>(std::move(shapes), f, -2.0, 2.0, k...); }, constants);
}

template <std::size_t N, class F>
Case make_case(std::vector<Shape> shapes, F f, std::function<double(double, double)> elementwise, double lo = -2.0,
               double hi = 2.0) {
  Case c = case_of<N>(std::move(shapes), f, lo, hi);
  c.elementwise = std::move(elementwise);
  return c;
}

// The central difference of loss() along element j of a tensor it reads (a parameter), which is
// left as it was.
inline double finite_difference(D& value, duet::index_t j, const std::function<double()>& loss) {
  const double keep = value.data()[j];
  const double h = 1e-6;
  value.data()[j] = keep + h;
  const double up = loss();
  value.data()[j] = keep - h;
  const double down = loss();
  value.data()[j] = keep;
  return (up - down) / (2 * h);
}

// A case for f with its expected value from `reference`.
template <std::size_t N, class F>
Case make_case_with_reference(std::vector<Shape> shapes, F f, std::function<D(const std::vector<D>&)> reference,
                              double lo = -2.0, double hi = 2.0) {
  Case c = make_case<N>(std::move(shapes), f, nullptr, lo, hi);
  c.reference = std::move(reference);
  return c;
}

// A case for f, a function of one tensor without gradient, run in PyNative mode and jitted in
// graph mode, its output converted to double for the comparison.
template <class F>
Case make_value_case(std::vector<Shape> shapes, F f, std::function<D(const std::vector<D>&)> reference) {
  Case c;
  c.shapes = std::move(shapes);
  c.reference = std::move(reference);
  c.value_in_mode = [f](const std::vector<D>& xs, duet::Mode mode) {
    duet::set_context({.mode = mode});
    const auto y = mode == duet::GRAPH_MODE ? duet::jit(f)(xs[0]) : f(xs[0]);
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    D out = duet::zeros<double>(y.shape());
    std::copy_n(y.data(), y.numel(), out.data());
    return out;
  };
  return c;
}

// A multi-index, outermost axis first.
using Index = std::vector<duet::index_t>;

// Element `index` of x, by row-major arithmetic.
inline double at(const D& x, const Index& index) {
  duet::index_t offset = 0;
  for (int a = 0; a < x.ndim(); ++a) offset = offset * x.dim(a) + index[static_cast<std::size_t>(a)];
  return x.data()[offset];
}

// The tensor of this shape whose element at each multi-index is value(index).
inline D tabulate(const Shape& shape, const std::function<double(const Index&)>& value) {
  D y = duet::zeros<double>(shape);
  Index index(static_cast<std::size_t>(shape.rank()), 0);
  for (duet::index_t n = 0; n < shape.numel(); ++n) {
    duet::index_t rest = n;
    for (int a = shape.rank() - 1; a >= 0; --a) {
      index[static_cast<std::size_t>(a)] = rest % shape[a];
      rest /= shape[a];
    }
    y.data()[n] = value(index);
  }
  return y;
}

// A case whose expected value is `reference`, the fixed inputs (indices) in `constants`.
template <std::size_t N, class F, class... C>
Case checked(std::vector<Shape> shapes, F f, std::function<D(const std::vector<D>&)> reference,
             std::tuple<C...> constants = {}) {
  Case c = make_case_with<N>(std::move(shapes), f, constants);
  c.reference = std::move(reference);
  return c;
}

inline double dot(const D& a, const D& b) {
  double s = 0;
  for (duet::index_t i = 0; i < a.numel(); ++i) s += a.data()[i] * b.data()[i];
  return s;
}

// Whether two lists of tensors (gradients from the two modes) have the same shapes and the
// same bits: a NaN matches itself, -0 does not match 0.
inline bool same_bits(const std::vector<D>& a, const std::vector<D>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!(a[i].shape() == b[i].shape()) ||
        std::memcmp(a[i].data(), b[i].data(), sizeof(double) * static_cast<std::size_t>(a[i].numel())) != 0) {
      return false;
    }
  }
  return true;
}

// The gradients of value_and_grad(with_loss, net.parameters()) in each mode.
template <class Net, class Loss, class X, class Y>
std::vector<std::vector<D>> parameter_grads_in_both_modes(Net& net, Loss& loss, const X& x, const Y& y) {
  duet_test::ModeGuard guard;
  duet::nn::WithLossCell with_loss(net, loss);
  std::vector<std::vector<D>> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    auto vg = duet::value_and_grad(with_loss, net.parameters());
    grads.push_back(vg(x, y).grads);
  }
  return grads;
}

// Every parameter's gradient under loss(net(x), y): the same bits in both modes, and each
// element against central differences of the loss. Returns PyNative's gradients.
template <class Net, class Loss, class X, class Y>
std::vector<D> check_parameter_grads(Net& net, Loss& loss, const X& x, const Y& y) {
  const auto grads = parameter_grads_in_both_modes(net, loss, x, y);
  CHECK(same_bits(grads[0], grads[1]));
  duet::nn::WithLossCell with_loss(net, loss);
  auto loss_value = [&] {
    duet::set_context({.mode = duet::PYNATIVE_MODE});
    return with_loss(x, y).item();
  };
  const auto params = net.parameters();
  for (std::size_t p = 0; p < params.size(); ++p) {
    auto& value = *params[p].parameter;
    for (duet::index_t j = 0; j < value.numel(); ++j) {
      const double fd = finite_difference(value, j, loss_value);
      INFO(params[p].name, "[", j, "]");
      CHECK(std::abs(grads[0][p].data()[j] - fd) <= 1e-7 + 1e-6 * std::abs(fd));
    }
  }
  return grads[0];
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
