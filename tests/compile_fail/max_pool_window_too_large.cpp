// A MaxPool2d whose window does not fit its input's height and width.
// expect: layer_accepts<duet::nn::MaxPool2d<5, 2(, [^>]*)?>, duet::diagnostic::spatial_sizes_must_be_at_least<5>, duet::diagnostic::input_shape<2, 3, 4, 4>
#include <duet/duet.hpp>

struct Net : duet::nn::Cell<Net> {
  duet::nn::AvgPool2d<2, 2> shrink;
#ifdef DUET_COMPILE_FAIL
  duet::nn::MaxPool2d<5, 2> pool;
#else
  duet::nn::MaxPool2d<3, 2> pool;
#endif
  DUET_CELL_MEMBERS(shrink, pool);
  auto construct(auto x) { return pool(shrink(x)); }
};

int main() {
  Net net;
  auto y = net(duet::ones(duet::shape<2, 3, 8, 8>));
  return y.numel() == 6 ? 0 : 1;
}
