// A SequentialCell of named cells: they would be copied, and cells are not copyable.
// expect: cells are not copyable.*std::move\(a\)
#include <duet/duet.hpp>

#include <utility>

int main() {
  duet::nn::Dense<4, 8> a;
  duet::nn::ReLU r;
  duet::nn::Dense<8, 2> b;
#ifdef DUET_COMPILE_FAIL
  duet::nn::SequentialCell seq(a, r, b);
#else
  duet::nn::SequentialCell seq(std::move(a), std::move(r), std::move(b));
#endif
  return seq(duet::ones({3, 4})).numel() == 6 ? 0 : 1;
}
