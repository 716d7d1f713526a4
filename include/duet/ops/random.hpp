// Random tensors drawn in construct, shaped like another: randn_like, rand_like (MindSpore's
// ops.randn_like and ops.rand_like, PyTorch's torch.randn_like and torch.rand_like).
//
// The noise of a variational autoencoder's reparameterisation, z = mu + exp(logvar / 2) * eps
// with eps = ops::randn_like(mu), or of a denoising model's input. Like PyTorch's and
// MindSpore's, they draw from the global generator (duet::set_seed): each call of the network
// draws anew, element by element in row-major order, with the generator locked for the whole
// tensor. Graph mode runs the operation's kernel once per call, where PyNative mode runs it,
// so the same seed gives both modes the same noise. The global generator is a step's state, as
// Dropout's generators are: a step that does not commit (a training step that fails,
// duet::summary's run, each mode's run in duet::compare_modes) gives back the draws it made.
// Checkpoints do not hold it (Dropout's generators they do): a resumed run draws from the seed
// it sets.
//
// The output does not depend on the input's values, so no gradient is due to the input
// (stops_gradient, as for zeros_like); the gradient reaches mu and logvar through the
// arithmetic around eps.
//
// Of a parameter, or of a value of parameters alone, the draw would be made again at every
// call of a captured graph but also once while capturing, so that graph mode's draws would run
// ahead of PyNative mode's: refused at compile time (draw from the input, or pass the noise in).
//
// multinomial(weights, num_samples, replacement): indices drawn from rows of non-negative
// weights (torch.multinomial), a language model's next tokens from its softmax. From the global
// generator as above, or from a seed or a duet::Generator of one's own, as duet::randn takes
// them: those two draw on real tensors only, outside construct and traces, which would keep the
// seed or the generator's address and replay it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../eager.hpp"
#include "../error.hpp"
#include "../operation.hpp"
#include "../parameter.hpp"
#include "../random.hpp"

namespace duet::ops {

enum class Draw { normal, uniform };

namespace detail {
// The global generator as the state of the calling thread's steps.
class GlobalGeneratorDraws final : public duet::detail::StepState {
 public:
  void save_for_step() override {
    saved_ = with_global_generator([](const Generator& g) { return g; });
  }
  void restore_step() override {
    with_global_generator([&](Generator& g) { g = saved_; });
  }

 private:
  Generator saved_{0};
};
inline GlobalGeneratorDraws& global_generator_draws() {
  thread_local GlobalGeneratorDraws draws;
  return draws;
}
}  // namespace detail

template <Draw D>
struct RandomLikeOp : Primitive<RandomLikeOp<D>> {
  static constexpr int arity = 1;
  static constexpr bool stops_gradient = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    static_assert(std::is_floating_point_v<T>,
                  "duet::ops::randn_like / rand_like: the input has an integer element type; random values are "
                  "drawn for floating-point tensors");
    T* y = a.out<T>();
    const index_t n = a.output_shape.numel();
    duet::detail::will_change(detail::global_generator_draws());
    with_global_generator([&](Generator& gen) {
      for (index_t i = 0; i < n; ++i) y[i] = D == Draw::normal ? gen.normal<T>() : gen.uniform01<T>();
    });
  }

  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }

  static std::string op_name() { return D == Draw::normal ? "RandnLike" : "RandLike"; }
  std::string label() const { return D == Draw::normal ? "ops::randn_like" : "ops::rand_like"; }
};

namespace detail {
template <Draw D, class X>
auto random_like(X&& x) {
  static_assert(!nn::is_parameter_made_v<std::remove_cvref_t<X>>,
                "duet::ops::randn_like / rand_like of a parameter, or of a value of parameters alone: a captured "
                "graph would draw it again at each call and once more while capturing, ahead of PyNative mode; "
                "draw it from a tensor of the input (ops::randn_like(x)), or pass the noise in as an input");
  return apply(RandomLikeOp<D>{}, std::forward<X>(x));
}
}  // namespace detail

// Standard normal values of x's shape and element type.
template <class X>
auto randn_like(X&& x) {
  return detail::random_like<Draw::normal>(std::forward<X>(x));
}

// Uniform values in [0, 1) of x's shape and element type.
template <class X>
auto rand_like(X&& x) {
  return detail::random_like<Draw::uniform>(std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// multinomial: num_samples int32 indices per row of weights along the last axis (any rank from
// 1; torch takes 1 or 2), each drawn with probability weight / row sum, with replacement or
// without (each index at most once, drawn one after another from the weights left, as torch
// does). The weights need not sum to 1; a weight that is negative, infinite or NaN, a row of
// zeros, or fewer categories of positive weight than samples drawn without replacement is a
// duet::ValueError naming the row, before anything is drawn. Each draw is one uniform double,
// row by row and sample by sample; the indices have no gradient.
template <class In>
struct MultinomialOp : Primitive<MultinomialOp<In>> {
  using value_type = std::int32_t;
  static constexpr int arity = 1;
  static constexpr bool stops_gradient = true;

  index_t samples = 1;
  bool replacement = false;
  std::optional<std::uint64_t> seed;  // a generator of this seed at each run, else `generator`
  Generator* generator = nullptr;     // else the global one

  static constexpr ShapeResult with_samples(const Shape& x, index_t n) {
    if (x.leading_unknown()) return {Shape::any()};
    if (x.rank() < 1) return fault(x, ShapeFault::min_rank, 1);
    Shape out = x;
    out[x.rank() - 1] = n;
    return {out};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return with_samples(in[0], dyn); }
  ShapeResult infer(std::span<const Shape> in) const { return with_samples(in[0], samples); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* w = a.in<In>();
    const index_t categories = a.in_shape().back();
    const index_t rows = categories == 0 ? 0 : a.in_shape().numel() / categories;
    for (index_t r = 0; r < rows; ++r) check_row(w + r * categories, categories, r);
    if (rows == 0 && a.output_shape.numel() > 0) check_row(w, 0, 0);  // categories 0: nothing to draw from
    const auto draw = [&](Generator& gen) {
      std::vector<double> left(static_cast<std::size_t>(categories));
      for (index_t r = 0; r < rows; ++r) {
        std::copy_n(w + r * categories, categories, left.begin());
        for (index_t s = 0; s < samples; ++s) {
          const std::size_t c = pick(left, gen.uniform01<double>());
          a.out<T>()[r * samples + s] = static_cast<T>(c);
          if (!replacement) left[c] = 0;
        }
      }
    };
    if (seed) {
      Generator own(*seed);
      draw(own);
    } else if (generator != nullptr) {
      draw(*generator);
    } else {
      duet::detail::will_change(detail::global_generator_draws());
      with_global_generator(draw);
    }
  }

  template <std::size_t K>
  requires(K == 0) NoGradient grad_op()
  const { return {}; }

  static std::string op_name() { return "Multinomial"; }
  std::string label() const {
    return "ops::multinomial(weights, " + std::to_string(samples) + (replacement ? ", replacement)" : ")");
  }

 private:
  void check_row(const In* w, index_t categories, index_t row) const {
    index_t positive = 0;
    for (index_t c = 0; c < categories; ++c) {
      if (!(w[c] >= 0) || std::isinf(w[c])) {
        throw ValueError(label() + ": row " + std::to_string(row) + " has weight " + std::to_string(w[c]) +
                         " at index " + std::to_string(c) + "; weights must be finite and >= 0");
      }
      positive += w[c] > 0 ? 1 : 0;
    }
    if (positive == 0)
      throw ValueError(label() + ": row " + std::to_string(row) + " has no positive weight to draw from");
    if (!replacement && positive < samples) {
      throw ValueError(label() + ": row " + std::to_string(row) + " has " + std::to_string(positive) +
                       " indices of positive weight, fewer than the " + std::to_string(samples) +
                       " samples drawn without replacement");
    }
  }

  // The index whose share of the running sum holds u * sum: the first whose cumulative weight
  // exceeds it (a weight of 0 never does), or, where rounding leaves u * sum at the sum, the
  // last index of positive weight.
  static std::size_t pick(const std::vector<double>& weights, double u) {
    double total = 0;
    for (const double x : weights) total += x;
    const double target = u * total;
    double running = 0;
    std::size_t last = 0;
    for (std::size_t c = 0; c < weights.size(); ++c) {
      if (weights[c] == 0) continue;
      running += weights[c];
      if (target < running) return c;
      last = c;
    }
    return last;
  }
};

namespace detail {
template <class X>
auto multinomial_op(index_t num_samples, bool replacement) {
  using In = typename std::remove_cvref_t<X>::value_type;
  static_assert(std::is_floating_point_v<In>, "duet::ops::multinomial: the weights must be floating-point");
  if (num_samples < 1) {
    throw ValueError("duet::ops::multinomial: num_samples " + std::to_string(num_samples) + " must be at least 1");
  }
  MultinomialOp<In> op;
  op.samples = num_samples;
  op.replacement = replacement;
  return op;
}

// A seed or a generator of one's own is read when the operation is recorded: a graph or a trace
// would keep it and replay it at every call.
template <class X>
void refuse_recorded_draw() {
  static_assert(!graph::Symbolic<X>,
                "duet::ops::multinomial with a seed or a duet::Generator of one's own draws on real tensors (a "
                "model's output, outside construct); in construct it draws from the global generator "
                "(duet::set_seed), without the last argument");
  if (pijit::active_trace() != nullptr) {
    throw ModeError(
        "duet::ops::multinomial with a seed or a duet::Generator of one's own, in a traced call (a network "
        "built at run time in graph mode, a PIJit function): the trace would replay that seed or generator; "
        "draw from the global generator there (duet::set_seed), without the last argument");
  }
}
}  // namespace detail

// Drawn from the global generator (duet::set_seed), in construct too, the same in both modes.
template <class X>
auto multinomial(const X& weights, index_t num_samples, bool replacement = false) {
  return apply(detail::multinomial_op<X>(num_samples, replacement), weights);
}

// Drawn from a generator seeded with `seed`: the same indices on every call.
template <class X>
auto multinomial(const X& weights, index_t num_samples, bool replacement, std::uint64_t seed) {
  detail::refuse_recorded_draw<std::remove_cvref_t<X>>();
  auto op = detail::multinomial_op<X>(num_samples, replacement);
  op.seed = seed;
  return apply(op, weights);
}

// Drawn from `generator`, which moves on: successive calls draw anew.
template <class X>
auto multinomial(const X& weights, index_t num_samples, bool replacement, Generator& generator) {
  detail::refuse_recorded_draw<std::remove_cvref_t<X>>();
  auto op = detail::multinomial_op<X>(num_samples, replacement);
  op.generator = &generator;
  return apply(op, weights);
}

inline const bool random_listed = list_operations({"randn_like", "rand_like", "multinomial"});

}  // namespace duet::ops
