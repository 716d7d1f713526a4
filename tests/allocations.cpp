// Graph mode makes no heap allocation per call once warm. Every allocation of the program goes
// through the replaced operator new below and is counted.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <atomic>
#include <cstdlib>
#include <new>

#include "support.hpp"

// The replacements below are one pair, over aligned_alloc and free. g++ from -O1 inlines the
// replaced delete where the standard library frees what the replaced new returned, and then
// takes free() of operator new's pointer for a mismatch.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace {
std::atomic<long> allocations{0};

void* counted(std::size_t size, std::size_t alignment) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t a = alignment < alignof(std::max_align_t) ? alignof(std::max_align_t) : alignment;
  void* p = std::aligned_alloc(a, (size + a - 1) / a * a);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t size) { return counted(size, alignof(std::max_align_t)); }
void* operator new[](std::size_t size) { return counted(size, alignof(std::max_align_t)); }
void* operator new(std::size_t size, std::align_val_t a) { return counted(size, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t size, std::align_val_t a) { return counted(size, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

using namespace duet;
using duet_test::ModeGuard;
using duet_test::SeedNetwork;

template <class F>
long allocations_during(F&& f) {
  const long before = allocations.load();
  f();
  return allocations.load() - before;
}

TEST_CASE("the counter sees allocations") {
  // A new-expression paired with its delete may be elided (clang does), a direct call may not.
  CHECK(allocations_during([] { ::operator delete(::operator new(sizeof(int))); }) == 1);
}

TEST_CASE("graph mode: zero heap allocations per call after the first, for each input shape") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  SeedNetwork<> net;
  for (index_t batch : {1, 64, 256}) {
    const Tensor x = ones({batch, 1, 28, 28});
    CHECK(allocations_during([&] { net(x); }) > 0);  // warms the pool for this shape
    for (int call = 0; call < 3; ++call) CHECK(allocations_during([&] { net(x); }) == 0);
  }
  // Keeping outputs alive only takes more blocks until the pool holds enough of them.
  const Tensor x = ones({64, 1, 28, 28});
  float a00 = 0, b00 = 1;
  const auto keep_two = [&] {
    const Tensor a = net(x);
    const Tensor b = net(x);
    a00 = a(0, 0);
    b00 = b(0, 0);
  };
  keep_two();
  CHECK(allocations_during(keep_two) == 0);
  CHECK(a00 == b00);
}

namespace {
struct RecordsHidden : nn::Cell<RecordsHidden> {
  nn::Dense<8, 8> fc1;
  nn::Dense<8, 2> fc2;
  DUET_CELL_MEMBERS(fc1, fc2);
  auto construct(auto x) { return fc2(record_value(fc1(x), "hidden")); }
};
}  // namespace

TEST_CASE("graph mode: a record_value node costs no allocation while no recorder is alive") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  RecordsHidden net;
  const Tensor x = ones({4, 8});
  net(x);
  for (int call = 0; call < 3; ++call) CHECK(allocations_during([&] { net(x); }) == 0);
  ValueRecorder recorder;
  CHECK(allocations_during([&] { net(x); }) > 0);  // the copy it keeps
  CHECK(recorder.get("hidden").shape() == Shape{4, 8});
}

TEST_CASE("graph mode on a statically shaped input: zero allocations per call after the first") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  SeedNetwork<> net;
  const auto x = ones(shape<4, 1, 28, 28>);
  net(x);
  CHECK(allocations_during([&] { net(x); }) == 0);
}

TEST_CASE("O2: zero allocations per call once the weights are packed") {
  SeedNetwork<JitConfig{.jit_level = O2}> net;
  const Tensor x = ones({64, 1, 28, 28});
  CHECK(allocations_during([&] { net(x); }) > 0);  // packs the weights
  for (int call = 0; call < 3; ++call) CHECK(allocations_during([&] { net(x); }) == 0);
}

TEST_CASE("PyNative mode also runs from the pool once warm (no hooks registered)") {
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  SeedNetwork<> net;
  const Tensor x = ones({8, 1, 28, 28});
  net(x);
  CHECK(allocations_during([&] { net(x); }) == 0);
}

namespace {
struct ConvNetwork : nn::Cell<ConvNetwork> {
  nn::Conv2d<1, 4, 5, 1, 2> conv{{.has_bias = true}};
  nn::ReLU relu;
  nn::Conv2d<4, 8, 3, 2, nn::PadMode::same, 1, 4> grouped;
  nn::Flatten flatten;
  nn::Dense<8 * 14 * 14, 10> fc;
  DUET_CELL_MEMBERS(conv, relu, grouped, flatten, fc);
  auto construct(auto x) { return fc(flatten(grouped(relu(conv(x))))); }
};
}  // namespace

TEST_CASE("graph mode: convolutions take their patch buffers from the pool, no allocation once warm") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  ConvNetwork net;
  for (index_t batch : {1, 16}) {
    const Tensor x = ones({batch, 1, 28, 28});
    net(x);
    for (int call = 0; call < 3; ++call) CHECK(allocations_during([&] { net(x); }) == 0);
  }
}

namespace {
struct ConvBatchNormNetwork : nn::Cell<ConvBatchNormNetwork> {
  nn::Conv2d<1, 4, 3, 1, 1> conv;
  nn::BatchNorm2d<4> bn;
  nn::ReLU relu;
  DUET_CELL_MEMBERS(conv, bn, relu);
  auto construct(auto x) { return relu(bn(conv(x))); }
};
}  // namespace

TEST_CASE("graph mode: a convolution with a BatchNorm folded in allocates nothing once warm, refolding only after a change") {
  ModeGuard guard;
  set_context({.mode = GRAPH_MODE});
  ConvBatchNormNetwork net;
  net.set_train(false);
  REQUIRE(graph_ir(net).optimized.text.find("Conv2d + BatchNorm(folded) + ReLU") != std::string::npos);
  const Tensor x = ones({8, 1, 12, 12});
  net(x);
  for (int call = 0; call < 3; ++call) CHECK(allocations_during([&] { net(x); }) == 0);
  net.bn.moving_mean.data()[0] = 0.5f;
  CHECK(allocations_during([&] { net(x); }) > 0);  // the fold is made again, once
  CHECK(allocations_during([&] { net(x); }) == 0);
}
