// A cell compiled STRICT (Cell<Net, JitConfig{...}>) whose construct calls back into C++: the
// level applies to a cell's construct as to a jitted function.
// expect: JitSyntaxLevel::strict: the function calls duet::host
#include <duet/duet.hpp>

#ifdef DUET_COMPILE_FAIL
constexpr duet::JitConfig config{.jit_syntax_level = duet::JitSyntaxLevel::strict};
#else
constexpr duet::JitConfig config{.jit_syntax_level = duet::JitSyntaxLevel::compatible};
#endif

struct Net : duet::nn::Cell<Net, config> {
  duet::nn::Dense<4, 2> fc;
  DUET_CELL_MEMBERS(fc);
  auto construct(auto x) {
    return duet::host<duet::allowed_break>([](const duet::Tensor& t) { return t.clone(); }, fc(x));
  }
};

int main() {
  Net net;
  return net(duet::ones({3, 4})).numel() == 6 ? 0 : 1;
}
