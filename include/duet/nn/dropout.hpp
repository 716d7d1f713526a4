// Dropout: nn::Dropout and the operations it captures.
//
// MindSpore 2.x's nn.Dropout(p=0.5): in training each element is zeroed with probability p and
// the others are scaled by 1 / (1 - p) (inverted dropout, so evaluation is the identity).
// MindSpore 1.x took keep_prob = 1 - p instead; 2.x deprecates it for p, PyTorch's convention,
// which duet follows.
//
// Seeded: a layer draws its masks from a generator of its own, seeded from the global one
// (duet::set_seed) when the layer is made, one draw per element in row-major order per
// training call. Both modes run the same kernel once per call, so they draw the same masks in
// the same order and give the same losses. A training step that fails gives its draws back.
// A checkpoint saved with an optimiser holds the generator's state ("generator.<path>"), so
// training resumed from it draws the masks the uninterrupted run would have.
//
// The mask is not kept: the gradient recovers it from the input and the output. A kept
// element's output is x / (1 - p), which is 0 only if x is (|1 / (1 - p)| >= 1: no
// underflow); a dropped element's output is 0 with the sign bit opposite to x's when x is 0,
// so a kept zero and a dropped one differ in their sign. Nothing is stored between forward and
// backward, so a layer applied twice, or a network run by several threads, needs no care.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../operation.hpp"
#include "../ops/phase.hpp"
#include "../random.hpp"

namespace duet {
namespace ops {

template <class Layer, graph::Phase P>
struct DropoutGradOp;

// Training: x · mask / (1 - p), the mask drawn from the layer's generator. Evaluation: x
// itself, a view (the node stays in the graph so that its phase is checked).
template <class Layer, graph::Phase P>
struct DropoutOp : Primitive<DropoutOp<Layer, P>>, PhaseOf<Layer, P> {
  using layer_type = Layer;
  static constexpr int arity = 1;
  static constexpr bool is_view = P == graph::Phase::eval;
  static constexpr bool has_side_effects = is_view;  // the view's kernel checks the phase

  explicit DropoutOp(Layer* l) : PhaseOf<Layer, P>(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    this->check_phase();
    if constexpr (P == graph::Phase::train) {
      const index_t n = a.in_shape().numel();
      const T* x = a.in<T>();
      T* y = a.out<T>();
      const float p = this->layer->p();
      const T scale = T(1) / (T(1) - static_cast<T>(p));
      duet::detail::will_change(*this->layer);
      Generator& gen = this->layer->generator();
      for (index_t i = 0; i < n; ++i) {
        // Drawn as float whatever T is, so that float and double networks drop alike.
        if (gen.uniform01<float>() >= p) {
          y[i] = x[i] * scale;
        } else {
          y[i] = std::signbit(x[i]) || x[i] != T(0) ? T(0) : T(-0.0);
        }
      }
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return DropoutGradOp<Layer, P>{this->layer};
  }

  static std::string op_name() { return P == graph::Phase::train ? "Dropout" : "Dropout (identity)"; }
  std::string label() const { return this->layer->label(); }

  // ONNX: at evaluation, what it is, the identity.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (P == graph::Phase::eval) return {{"Identity", {InterchangeInput::operand(0)}, {}}};
    else return {};
  }
};

// Training: dx = dy / (1 - p) where the element was kept, 0 where it was dropped (recovered from
// x and y, see above). Evaluation: dy itself, a view.
template <class Layer, graph::Phase P>
struct DropoutGradOp : Primitive<DropoutGradOp<Layer, P>> {
  using layer_type = Layer;
  static constexpr auto reads = [] {
    if constexpr (P == graph::Phase::train)
      return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
    else
      return std::array{graph::Operand::grad};
  }();
  static constexpr int arity = static_cast<int>(reads.size());
  static constexpr bool is_view = P == graph::Phase::eval;

  const Layer* layer;
  explicit DropoutGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    if constexpr (P == graph::Phase::train) {
      const index_t n = a.in_shape().numel();
      const T* dy = a.in<T>(0);
      const T* x = a.in<T>(1);
      const T* y = a.in<T>(2);
      T* dx = a.out<T>();
      const T scale = T(1) / (T(1) - static_cast<T>(layer->p()));
      for (index_t i = 0; i < n; ++i) {
        const bool kept = y[i] != T(0) || (x[i] == T(0) && std::signbit(x[i]) == std::signbit(y[i]));
        dx[i] = kept ? dy[i] * scale : T(0);
      }
    }
  }

  static std::string op_name() { return P == graph::Phase::train ? "DropoutGrad" : "DropoutGrad (identity)"; }
  std::string label() const { return layer->label(); }
};

inline const bool dropout_listed = list_operations({"Dropout"});

}  // namespace ops

namespace nn {

// MindSpore's nn.Dropout(p=0.5) (see the header's comment): p in [0, 1).
template <ElementType T>
class BasicDropout : public Cell<BasicDropout<T>, CONTEXT_MODE, T>,
                     public duet::detail::StepState,
                     public duet::detail::GeneratorOwner {
 public:
  explicit BasicDropout(double p = 0.5) : p_(static_cast<float>(p)) {
    if (!(p >= 0 && p < 1)) {
      throw ValueError("nn::Dropout: p, the probability of dropping an element, must be in [0, 1), got " +
                       std::to_string(p));
    }
    reseed(with_global_generator([](Generator& gen) { return gen.next(); }));
  }

  float p() const { return p_; }

  // Restarts the masks from `seed`: the same seed gives the same masks in both modes.
  void reseed(std::uint64_t seed) { generator_.seed(seed); }
  // The masks' generator; training kernels draw from it (one training call at a time).
  Generator& generator() const { return generator_; }

  Generator& owned_generator() override { return generator_; }

  // A step that fails gives back the draws it took, so the next one drops what it would have.
  void save_for_step() override { saved_ = generator_; }
  void restore_step() override { generator_ = saved_; }

  template <class X>
  auto construct(X&& x) {
    return ops::apply_in_phase<ops::DropoutOp>(this, std::forward<X>(x));
  }

  bool depends_on_phase() const override { return true; }

  std::string type_name() const override {
    std::string s = "nn::Dropout";
    if constexpr (!std::is_same_v<T, float>) s += "<" + std::string(name_of(dtype_of<T>)) + ">";
    return s;
  }

 private:
  float p_;
  mutable Generator generator_;
  Generator saved_;
};

using Dropout = BasicDropout<float>;

}  // namespace nn
}  // namespace duet
