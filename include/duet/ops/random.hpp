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
#pragma once

#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "../eager.hpp"
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

inline const bool random_listed = list_operations({"randn_like", "rand_like"});

}  // namespace duet::ops
