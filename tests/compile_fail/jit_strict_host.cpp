// A STRICT jit function that calls back into C++ to branch on a value.
// expect: JitSyntaxLevel::strict: the function calls duet::host
#include <duet/duet.hpp>

int main() {
  auto keep_positive = [](const duet::Tensor& t) { return t.item() > 0 ? t.clone() : duet::zeros(t.shape()); };
#ifdef DUET_COMPILE_FAIL
  constexpr duet::JitConfig config{.jit_syntax_level = duet::JitSyntaxLevel::strict};
#else
  constexpr duet::JitConfig config{.jit_syntax_level = duet::JitSyntaxLevel::lax};
#endif
  auto f = duet::jit<config>([&](auto x) { return duet::host(keep_positive, x); });
  return f(duet::ones({1})).numel() == 1 ? 0 : 1;
}
