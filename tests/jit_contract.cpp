// The recompilation contract of jit: max_compiled_forms (raise or warn), freeze_compiles and
// precompile, for PSJit, PIJit and a runtime-built cell in graph mode.
#include "support.hpp"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

namespace tests_jit_contract {

using namespace duet;
using duet_test::ModeGuard;

namespace {

// A runtime-built network (PIJit's case), its sizes known only at run time.
nn::DynamicSequentialCell runtime_network() {
  set_seed(15);
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  net.append(nn::Dense<>(12, 9));
  net.append(nn::ReLU{});
  net.append(nn::Dense<>(9, 4));
  return net;
}

std::string message_of(auto&& call) {
  try {
    call();
  } catch (const RecompileError& e) {
    return e.what();
  }
  FAIL("no duet::RecompileError");
  return {};
}

std::size_t count_in_log(const std::string& line) {
  const auto log = jit_compile_log();
  return static_cast<std::size_t>(std::count(log.begin(), log.end(), line));
}

}  // namespace

TEST_CASE("RecompileError is a duet::Error, and JitConfig::parse reads the limit MindSpore's way") {
  static_assert(std::is_base_of_v<Error, RecompileError>);
  static_assert(JitConfig::parse("O1", "auto", "LAX", "RELEASE", "4", "WARN") ==
                JitConfig{.max_compiled_forms = 4, .on_recompile_limit = RecompilePolicy::warn});
  static_assert(JitConfig::parse("O2").max_compiled_forms == 0);  // default: any number of forms
  CHECK(JitConfig::parse("O1", "auto", "LAX", "RELEASE", "12").max_compiled_forms == 12);
  CHECK_THROWS_WITH_AS(JitConfig::parse("O1", "auto", "LAX", "RELEASE", "4x"),
                       "duet::JitConfig: max_compiled_forms must be a count of forms (0: any), got '4x'", ValueError);
  CHECK_THROWS_WITH_AS(JitConfig::parse("O1", "auto", "LAX", "RELEASE", "4", "IGNORE"),
                       "duet::JitConfig: on_recompile_limit must be RAISE or WARN, got 'IGNORE'", ValueError);
}

TEST_CASE("max_compiled_forms: one more form throws RecompileError with the reason, nothing compiles") {
  auto f = jit<JitConfig{.max_compiled_forms = 2}>([](auto x) { return ops::relu(x); }, {.name = "limited"});
  f(ones({2, 3}));
  f(ones({4, 3}));
  CHECK(f.compile_count() == 2);
  const std::uint64_t global = jit_compile_count();
  const std::size_t log_size = jit_compile_log().size();
  CHECK(message_of([&] { f(ones({5, 3})); }) ==
        "limited: compile #3 exceeds max_compiled_forms = 2: argument 0 shape [4, 3] -> [5, 3]");
  CHECK(message_of([&] { f(ones<double>({4, 3})); }) ==
        "limited: compile #3 exceeds max_compiled_forms = 2: argument 0 dtype Float32 -> Float64");
  CHECK(f.compile_count() == 2);
  CHECK(jit_compile_count() == global);
  CHECK(jit_compile_log().size() == log_size);
  // The forms it has still run, and give their values.
  CHECK(duet_test::values_of(f(full({2, 3}, -1.0f))) == std::vector<double>(6, 0.0));
  CHECK(duet_test::values_of(f(full({4, 3}, 2.0f))) == std::vector<double>(12, 2.0));
  CHECK(f.compile_count() == 2);
}

TEST_CASE("max_compiled_forms under PIJit: refused before the trace runs the function") {
  auto net = runtime_network();
  int runs = 0;
  auto f = jit<JitConfig{.max_compiled_forms = 1}>(
      [&](const Tensor& x) {
        ++runs;
        return net(x);
      },
      {.mode = JitMode::PIJit, .name = "limited trace"});
  const Tensor x = randn({3, 3, 4}, 1);
  const auto expected = duet_test::values_of(net(x));
  CHECK(duet_test::values_of(f(x)) == expected);  // the trace
  CHECK(duet_test::values_of(f(x)) == expected);  // its replay
  CHECK(runs == 1);
  CHECK(message_of([&] { f(randn({8, 3, 4}, 2)); }) ==
        "limited trace: compile #2 exceeds max_compiled_forms = 1: argument 0 shape [3, 3, 4] -> [8, 3, 4]");
  CHECK(runs == 1);
  CHECK(f.compile_count() == 1);
  CHECK(duet_test::values_of(f(x)) == expected);
}

TEST_CASE("max_compiled_forms with RecompilePolicy::warn: said once in the compile log, and compiled") {
  constexpr JitConfig warn{.max_compiled_forms = 1, .on_recompile_limit = RecompilePolicy::warn};
  auto f = jit<warn>([](auto x) { return ops::relu(x); }, {.name = "warned"});
  for (index_t n : {2, 3, 4, 3}) f(ones({n}));
  CHECK(f.compile_count() == 3);
  CHECK(count_in_log("warning: warned: compile #2 exceeds max_compiled_forms = 1: argument 0 shape [2] -> [3]") == 1);
  CHECK(count_in_log("warned: compile #3: argument 0 shape [3] -> [4]") == 1);
  const std::vector<std::string> log = jit_compile_log();  // a copy: one, for begin and end
  CHECK(std::none_of(log.begin(), log.end(), [](const std::string& l) { return l.starts_with("warning: warned: compile #3"); }));

  auto net = runtime_network();
  auto g = jit<warn>([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit, .name = "warned trace"});
  const Tensor x = randn({5, 3, 4}, 3);
  g(randn({2, 3, 4}, 4));
  CHECK(duet_test::values_of(g(x)) == duet_test::values_of(net(x)));
  CHECK(g.compile_count() == 2);
  CHECK(count_in_log("warning: warned trace: compile #2 exceeds max_compiled_forms = 1: argument 0 shape [2, 3, 4] -> "
                     "[5, 3, 4]") == 1);
}

TEST_CASE("freeze_compiles: compiled forms run, every new compilation throws RecompileError") {
  auto f = jit([](auto x) { return ops::relu(x); }, {.name = "served"});
  auto net = runtime_network();
  auto g = jit([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit, .name = "served trace"});
  const Tensor x = randn({3, 3, 4}, 5);
  f(ones({2, 3}));
  const auto traced = duet_test::values_of(g(x));
  const std::uint64_t global = jit_compile_count();
  {
    FrozenCompiles frozen;
    CHECK(compiles_frozen());
    CHECK(duet_test::values_of(f(full({2, 3}, 3.0f))) == std::vector<double>(6, 3.0));
    CHECK(duet_test::values_of(g(x)) == traced);
    CHECK(message_of([&] { f(ones({4, 3})); }) ==
          "served: compiles are frozen (duet::freeze_compiles), and this call would compile form #2: argument 0 shape "
          "[2, 3] -> [4, 3]");
    CHECK(message_of([&] { g(randn({6, 3, 4}, 6)); }) ==
          "served trace: compiles are frozen (duet::freeze_compiles), and this call would compile form #2: argument 0 "
          "shape [3, 3, 4] -> [6, 3, 4]");
    auto fresh = jit([](auto v) { return ops::relu(v); }, {.name = "fresh"});
    CHECK(message_of([&] { fresh(ones({2})); }) ==
          "fresh: compiles are frozen (duet::freeze_compiles), and this call would compile form #1: first call");
    // An atomic flag: another thread is refused as well.
    std::string other;
    std::thread([&] { other = message_of([&] { f(ones({7})); }); }).join();
    CHECK(other.starts_with("served: compiles are frozen"));
    CHECK(jit_compile_count() == global);
  }
  CHECK_FALSE(compiles_frozen());
  f(ones({4, 3}));
  CHECK(f.compile_count() == 2);

  freeze_compiles();
  CHECK_THROWS_AS(f(ones({9})), RecompileError);
  unfreeze_compiles();
  f(ones({9}));
  CHECK(f.compile_count() == 3);
}

TEST_CASE("freeze_compiles: a runtime-built cell in graph mode traces no new shape") {
  ModeGuard mode;
  set_context({.mode = GRAPH_MODE});
  auto net = runtime_network();
  const Tensor x = randn({3, 3, 4}, 7);
  const auto first = duet_test::values_of(net(x));  // traced now
  FrozenCompiles frozen;
  CHECK(duet_test::values_of(net(x)) == first);  // replayed
  const std::string message = message_of([&] { net(randn({5, 3, 4}, 8)); });
  CHECK(message.find("compiles are frozen (duet::freeze_compiles), and this call would compile form #2: argument 0 "
                     "shape [3, 3, 4] -> [5, 3, 4]") != std::string::npos);
}

TEST_CASE("freeze_compiles: a training step over a runtime-built network in graph mode traces no new shape") {
  ModeGuard mode;
  set_context({.mode = GRAPH_MODE});
  auto net = runtime_network();
  nn::MSELoss<> loss;
  nn::WithLossCell with_loss(net, loss);
  auto step = value_and_grad(with_loss, net.parameters());
  const Tensor x = randn({3, 3, 4}, 10);
  const Tensor target = randn({3, 4}, 11);
  const double first = step(x, target).value.item();  // traced now
  FrozenCompiles frozen;
  CHECK(step(x, target).value.item() == first);  // replayed
  const auto weights = duet_test::values_of(*net.parameters()[0].parameter);
  const std::string message = message_of([&] { step(randn({6, 3, 4}, 12), randn({6, 4}, 13)); });
  CHECK(message.find("compiles are frozen (duet::freeze_compiles), and this call would compile form #2: argument 1 "
                     "shape [3, 3, 4] -> [6, 3, 4]") != std::string::npos);
  CHECK(duet_test::values_of(*net.parameters()[0].parameter) == weights);
}

TEST_CASE("precompile: the form is compiled before the first call, which then does not compile") {
  auto f = jit<JitConfig{.jit_level = O2, .max_compiled_forms = 2}>([](auto x) { return ops::relu(x); },
                                                                     {.name = "warm"});
  f.precompile(TensorSpec{float32, {2, 3}});
  CHECK(f.compile_count() == 1);
  CHECK(count_in_log("warm: compile #1: first call") == 1);
  CHECK(duet_test::values_of(f(full({2, 3}, -2.0f))) == std::vector<double>(6, 0.0));
  CHECK(duet_test::values_of(f(full({2, 3}, 5.0f))) == std::vector<double>(6, 5.0));
  CHECK(f.compile_count() == 1);
  f.precompile(TensorSpec{float32, {2, 3}});  // already there
  CHECK(f.compile_count() == 1);
  f.precompile<double>(TensorSpec{float64, {2, 3}});
  CHECK(f.compile_count() == 2);
  f(ones<double>({2, 3}));
  CHECK(f.compile_count() == 2);
  // It counts toward the limit, with the reason of the form it would make.
  CHECK(message_of([&] { f.precompile(TensorSpec{float32, {8}}); }) ==
        "warm: compile #3 exceeds max_compiled_forms = 2: argument 0 dtype Float64 -> Float32");
  CHECK_THROWS_WITH_AS(f.precompile(TensorSpec{float64, {2}}),
                       "warm: precompile<Float32> takes concrete Float32 shapes, got Float64 [2] for tensor 0", ValueError);
  CHECK_THROWS_WITH_AS(f.precompile(TensorSpec{float32, {dyn, 2}}),
                       "warm: precompile<Float32> takes concrete Float32 shapes, got Float32 [?, 2] for tensor 0",
                       ValueError);
  {
    FrozenCompiles frozen;
    auto g = jit([](auto x, auto y) { return ops::add(x, y); }, {.name = "frozen warm"});
    CHECK(message_of([&] { g.precompile(TensorSpec{float32, {4}}, TensorSpec{float32, {4}}); }) ==
          "frozen warm: compiles are frozen (duet::freeze_compiles), and this call would compile form #1: first call");
    CHECK(g.compile_count() == 0);
  }
}

TEST_CASE("precompile at the training phase leaves BatchNorm's moving statistics and Dropout's generator alone") {
  const auto check = [](auto jitted) {
    nn::BatchNorm1d<4> bn;
    bn.moving_mean.set_data(full({4}, 0.5f));
    nn::Dropout dropout(0.5);
    nn::Dropout twin(0.5);
    dropout.reseed(77);
    twin.reseed(77);
    bn.set_train(true);
    dropout.set_train(true);
    twin.set_train(true);
    auto f = jitted(bn, dropout);
    f.precompile(TensorSpec{float32, {5, 4}});
    CHECK(f.compile_count() == 1);
    CHECK(duet_test::values_of(bn.moving_mean) == std::vector<double>(4, 0.5));
    CHECK(duet_test::values_of(bn.moving_variance) == std::vector<double>(4, 1.0));
    // The next mask is the one a layer that never ran draws.
    CHECK(duet_test::values_of(dropout(ones({4, 8}))) == duet_test::values_of(twin(ones({4, 8}))));
  };
  check([](auto& bn, auto& dropout) { return jit([&](auto x) { return dropout(bn(x)); }); });
  check([](auto& bn, auto& dropout) {
    return jit([&](const Tensor& x) { return dropout(bn(x)); }, {.mode = JitMode::PIJit});
  });
}

TEST_CASE("precompile under PIJit: the trace is made ahead, the first call replays it") {
  auto net = runtime_network();
  int runs = 0;
  auto f = jit(
      [&](const Tensor& x) {
        ++runs;
        return net(x);
      },
      {.mode = JitMode::PIJit, .name = "warm trace"});
  f.precompile(TensorSpec{float32, {3, 3, 4}});
  CHECK(f.compile_count() == 1);
  CHECK(runs == 1);  // the trace ran it, on zeros
  const Tensor x = randn({3, 3, 4}, 9);
  CHECK(duet_test::values_of(f(x)) == duet_test::values_of(net(x)));
  CHECK(runs == 1);  // replayed, not traced again
  CHECK(f.compile_count() == 1);
  {
    FrozenCompiles frozen;  // a precompiled form serves while frozen
    CHECK(duet_test::values_of(f(x)) == duet_test::values_of(net(x)));
  }
}

}  // namespace tests_jit_contract
