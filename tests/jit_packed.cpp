// At O1 and O2 a graph that does not train keeps each product's weight packed between calls.
// It must give the bits of the unpacked product (O0's), and pack again whenever the weight may
// have changed, whoever changed it.
#include "support.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>
#include <unistd.h>

namespace tests_jit_packed {

using namespace duet;
using duet_test::SeedNetwork;

namespace {

constexpr JitConfig o0_config{.jit_level = O0};
constexpr JitConfig o1_config{.jit_level = O1};
constexpr JitConfig o2_config{.jit_level = O2};

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(float)) == 0;
}

// The seed network, and the same network (same parameters) jitted at O0 (products pack their
// weight on every call), O1 and O2 (packed between calls).
struct Jitted {
  SeedNetwork<> net;
  std::function<Tensor(const Tensor&)> o0 = jit<o0_config>([this](auto x) { return net(x); });
  std::function<Tensor(const Tensor&)> o1 = jit<o1_config>([this](auto x) { return net(x); });
  std::function<Tensor(const Tensor&)> o2 = jit<o2_config>([this](auto x) { return net(x); });

  bool agree(const Tensor& x) {
    const Tensor unpacked = o0(x);
    return bitwise_equal(o1(x), unpacked) && bitwise_equal(o2(x), unpacked);
  }
};

}  // namespace

TEST_CASE("packed weights give the unpacked product's bits at every batch size, again and again") {
  Jitted j;
  for (int round = 0; round < 2; ++round) {
    for (index_t batch : {1, 2, 7, 64, 200}) {
      CAPTURE(batch);
      CHECK(j.agree(randn({batch, 1, 28, 28}, static_cast<std::uint64_t>(batch))));
    }
  }
}

TEST_CASE("O1's and O2's graphs read packed weights, O0's does not") {
  SeedNetwork<> net;
  CHECK(graph_ir<o0_config>(net).optimized.text.find("Packed") == std::string::npos);
  for (const std::string& optimized : {graph_ir<o1_config>(net).optimized.text, graph_ir<o2_config>(net).optimized.text}) {
    CHECK(optimized.find("PackedMatMul + BiasAdd + ReLU(%1)") != std::string::npos);
    CHECK(optimized.find("PackedMatMul + BiasAdd(%3)") != std::string::npos);
  }
  // Without a config of its own, graph_ir shows the level the cell is compiled at (it showed
  // the default level's packed, fused graph for a cell compiled at O0).
  SeedNetwork<o0_config> plain;
  const std::string unfused = graph_ir(plain).optimized.text;
  CHECK(unfused.find("= MatMul(%1)") != std::string::npos);
  CHECK(unfused.find("Packed") == std::string::npos);
}

TEST_CASE("a packed weight is packed again after an optimiser step, set_data, a write, a load or a new parameter") {
  Jitted j;
  const Tensor x = randn({16, 1, 28, 28}, 3);
  const Tensor before = j.o1(x);
  REQUIRE(j.agree(x));
  auto& first = j.net.dense_relu_sequential.get<0>();

  SUBCASE("optimiser step") {
    nn::SGD sgd(j.net.parameters(), {.learning_rate = 0.5});
    std::vector<Tensor> grads;
    for (const auto& p : j.net.parameters()) grads.push_back(ones(p.parameter->shape()));
    sgd(grads);
  }
  SUBCASE("set_data") { first.weight.set_data(randn(first.weight.shape(), 5)); }
  SUBCASE("one element written through a tensor sharing the weight") {
    Tensor alias = first.weight;
    alias(3, 100) += 1.0f;
  }
  SUBCASE("a checkpoint loaded") {
    const auto path = std::filesystem::temp_directory_path() / ("duet_jit_packed_" + std::to_string(::getpid()) + ".ckpt");
    set_seed(11);
    SeedNetwork<> other;
    save_checkpoint(other, path);
    load_checkpoint(path, j.net);
    std::filesystem::remove(path);
  }
  SUBCASE("a new parameter") { first.weight = nn::Parameter(randn(first.weight.shape(), 6)); }

  CHECK_FALSE(bitwise_equal(j.o1(x), before));
  CHECK(j.agree(x));
}

TEST_CASE("PIJit follows jit_level: O0 replays each traced operation, O1 and O2 fuse and pack weights") {
  set_seed(4);
  nn::DynamicSequentialCell net;
  net.append(nn::Dense<>(12, 20));
  net.append(nn::ReLU{});
  net.append(nn::Dense<>(20, 4));
  const nn::Parameter& weight = *net.parameters()[0].parameter;
  auto o0 = jit<JitConfig{.jit_level = O0}>([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit, .name = "o0"});
  auto o1 = jit<o1_config>([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit, .name = "o1"});
  auto o2 = jit<o2_config>([&](const Tensor& x) { return net(x); }, {.mode = JitMode::PIJit, .name = "o2"});
  const Tensor x = randn({5, 12}, 8);
  const Tensor expected = net(x);
  const long handles = weight.use_count();
  for (int call = 0; call < 3; ++call) {
    CAPTURE(call);
    CHECK(bitwise_equal(o0(x), expected));
    CHECK(bitwise_equal(o1(x), expected));
    CHECK(bitwise_equal(o2(x), expected));
    // The first call traces, eagerly; replays read the packed weight, which the parameter
    // keeps with a handle to the values it was made from.
    CHECK(weight.use_count() == handles + (call == 0 ? 0 : 1));
  }
  const auto& log = jit_compile_log();
  const auto line = [&](const std::string& name) {
    return *std::find_if(log.rbegin(), log.rend(), [&](const std::string& l) { return l.rfind(name + ":", 0) == 0; });
  };
  CHECK(line("o0") == "o0: compile #1: first call (traced 5 operations, replays 5 steps: MatMul; BiasAdd; ReLU; MatMul; BiasAdd)");
  CHECK(line("o1") == "o1: compile #1: first call (traced 5 operations, replays 2 steps: PackedMatMul + BiasAdd + ReLU; PackedMatMul + BiasAdd)");
  CHECK(line("o2") == "o2: compile #1: first call (traced 5 operations, replays 2 steps: PackedMatMul + BiasAdd + ReLU; PackedMatMul + BiasAdd)");
}

}  // namespace tests_jit_packed
