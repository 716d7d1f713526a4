// A user's two-input operation that gives the gradient of input 0 only. Differentiating through
// it would leave input 1's gradient a silent zero; the contract makes it a compile error that
// names the operation and the input.
// expect: gives_the_gradient_of_input<HalfAdd, 1>
#include <duet/duet.hpp>

struct AddGrad : duet::ops::Primitive<AddGrad> {
  static constexpr std::array reads{duet::graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr duet::ShapeResult infer_static(std::span<const duet::Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const duet::graph::KernelArgs& a) const {
    std::copy_n(a.in<T>(), a.in_shape().numel(), a.out<T>());
  }
  static std::string op_name() { return "AddGrad"; }
};

struct HalfAdd : duet::ops::Primitive<HalfAdd> {
  static constexpr int arity = 2;
  static constexpr duet::ShapeResult infer_static(std::span<const duet::Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const duet::graph::KernelArgs& a) const {
    for (duet::index_t i = 0; i < a.output_shape.numel(); ++i) a.out<T>()[i] = a.in<T>(0)[i] + a.in<T>(1)[i];
  }
  template <std::size_t K>
#ifdef DUET_COMPILE_FAIL
    requires(K == 0)
#else
    requires(K < 2)
#endif
  auto grad_op() const {
    return AddGrad{};
  }
  static std::string op_name() { return "HalfAdd"; }
};

int main() {
  auto f = [](auto a, auto b) { return duet::apply(HalfAdd{}, a, b); };
  const duet::Tensor db = duet::grad(f, 1)(duet::ones({2, 3}), duet::ones({2, 3}));
  return db.numel() == 6 && db.data()[0] == 1.0f ? 0 : 1;
}
