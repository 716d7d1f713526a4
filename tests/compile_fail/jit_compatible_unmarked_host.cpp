// A COMPATIBLE jit function with a host callback nobody marked as an intended graph break.
// expect: JitSyntaxLevel::compatible: the function calls duet::host without marking the graph break
#include <duet/duet.hpp>

int main() {
  auto keep_positive = [](const duet::Tensor& t) { return t.item() > 0 ? t.clone() : duet::zeros(t.shape()); };
  constexpr duet::JitConfig config{.jit_syntax_level = duet::JitSyntaxLevel::compatible};
#ifdef DUET_COMPILE_FAIL
  auto f = duet::jit<config>([&](auto x) { return duet::host(keep_positive, x); });
#else
  auto f = duet::jit<config>([&](auto x) { return duet::host<duet::allowed_break>(keep_positive, x); });
#endif
  return f(duet::ones({1})).numel() == 1 ? 0 : 1;
}
