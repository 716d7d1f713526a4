// The README's first network with a Dense whose input size does not follow its neighbour,
// called in both modes: reported once, from the SequentialCell's constructor.
// expect: layer_accepts<duet::nn::Dense<500, 10(, float)?(, true)?>, duet::diagnostic::last_dimension_must_be<500>, duet::diagnostic::input_shape_after_unknown_leading_dims<512>
#include <duet/duet.hpp>

#ifdef DUET_COMPILE_FAIL
constexpr duet::index_t last_in = 500;
#else
constexpr duet::index_t last_in = 512;
#endif

struct Network : duet::nn::Cell<Network> {
  duet::nn::Flatten flatten;
  duet::nn::SequentialCell<duet::nn::Dense<784, 512>, duet::nn::ReLU, duet::nn::Dense<512, 512>, duet::nn::ReLU,
                           duet::nn::Dense<last_in, 10>>
      dense_relu_sequential;
  DUET_CELL_MEMBERS(flatten, dense_relu_sequential);

  auto construct(auto x) { return dense_relu_sequential(flatten(x)); }
};

int main() {
  Network model;
  duet::set_context({.mode = duet::GRAPH_MODE});
  const duet::Tensor graph = model(duet::ones({64, 1, 28, 28}));
  duet::set_context({.mode = duet::PYNATIVE_MODE});
  const duet::Tensor pynative = model(duet::ones({64, 1, 28, 28}));
  return graph.numel() == 640 && pynative.numel() == 640 ? 0 : 1;
}
