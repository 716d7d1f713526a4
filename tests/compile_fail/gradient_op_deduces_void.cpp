// gradient_of_one_input_missing, written the way one first writes it: grad_op<1>() exists but
// deduces void (no branch returns for K = 1). It counts as missing, with the same error.
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
    requires(K < 2)
  auto grad_op() const {
    if constexpr (K == 0) return AddGrad{};
#ifndef DUET_COMPILE_FAIL
    else return AddGrad{};
#endif
  }
  static std::string op_name() { return "HalfAdd"; }
};

int main() {
  auto f = [](auto a, auto b) { return duet::apply(HalfAdd{}, a, b); };
  const duet::Tensor db = duet::grad(f, 1)(duet::ones({2, 3}), duet::ones({2, 3}));
  return db.numel() == 6 && db.data()[0] == 1.0f ? 0 : 1;
}
