// The documented guarantee: a model's forward pass may be called from several threads at
// once, in both modes; so may a jitted function and a parameter's derived forms. Every
// concurrency case lives here, so that the tsan stage builds this file alone. Each case runs the seed network from four threads and compares every
// result with the same call made on one thread. The tsan stage of tools/check.sh runs the
// cases named "threads: ..." under ThreadSanitizer, which is what finds the races; without it
// these cases catch only races that corrupt results.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <exception>
#include <latch>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "support.hpp"

using namespace duet;

namespace {

constexpr std::size_t thread_count = 4;
// A different batch size in each thread at any moment, and a new one at every call: each
// call replans graph mode's thread-local plan, and the threads' arenas differ in size.
constexpr std::array<index_t, thread_count> batch_sizes{1, 3, 8, 17};
constexpr std::size_t calls_per_thread = 2 * thread_count;

std::vector<Tensor> make_inputs() {
  std::vector<Tensor> inputs;
  for (std::size_t i = 0; i < thread_count; ++i) inputs.push_back(randn({batch_sizes[i], 1, 28, 28}, 100 + i));
  return inputs;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(float)) == 0;
}

// Thread t's call k reads input (t + k) mod thread_count. All threads share the input tensors
// (and so their reference counts) and start together, so the first calls overlap.
template <class Net>
std::vector<std::vector<Tensor>> concurrent_forward(Net& net, const std::vector<Tensor>& inputs) {
  std::vector<std::vector<Tensor>> outputs(thread_count);
  std::vector<std::exception_ptr> errors(thread_count);
  std::latch start(thread_count);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < thread_count; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      try {
        for (std::size_t k = 0; k < calls_per_thread; ++k) outputs[t].push_back(net(inputs[(t + k) % thread_count]));
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return outputs;
}

template <class Net>
void check_against_one_thread(Net& net, const std::vector<Tensor>& inputs,
                              const std::vector<std::vector<Tensor>>& outputs) {
  std::vector<Tensor> expected;
  for (const Tensor& x : inputs) expected.push_back(net(x));
  for (std::size_t t = 0; t < thread_count; ++t) {
    REQUIRE(outputs[t].size() == calls_per_thread);
    for (std::size_t k = 0; k < calls_per_thread; ++k) {
      INFO("thread " << t << ", call " << k);
      CHECK(bitwise_equal(outputs[t][k], expected[(t + k) % thread_count]));
    }
  }
}

// Fresh: the threads' calls are the network's first, so they race to name its cells and
// each builds its own plans.
template <auto M>
void check_fresh_network() {
  const std::vector<Tensor> inputs = make_inputs();
  duet_test::SeedNetwork<M> net;
  const auto outputs = concurrent_forward(net, inputs);
  CHECK(net.dense_relu_sequential.template get<0>().name() == "dense_relu_sequential.0");
  CHECK(net.dense_relu_sequential.template get<4>().name() == "dense_relu_sequential.4");
  check_against_one_thread(net, inputs, outputs);
}

// Warm: named and planned on this thread first, the state every later call sees.
template <auto M>
void check_warm_network() {
  const std::vector<Tensor> inputs = make_inputs();
  duet_test::SeedNetwork<M> net;
  for (const Tensor& x : inputs) net(x);
  check_against_one_thread(net, inputs, concurrent_forward(net, inputs));
}

}  // namespace

TEST_CASE("threads: concurrent first calls of a fresh network in graph mode agree with one thread") {
  check_fresh_network<GRAPH_MODE>();
}

TEST_CASE("threads: concurrent first calls of a fresh network in PyNative mode agree with one thread") {
  check_fresh_network<PYNATIVE_MODE>();
}

TEST_CASE("threads: concurrent calls of a warm network in graph mode agree with one thread") {
  check_warm_network<GRAPH_MODE>();
}

TEST_CASE("threads: concurrent calls of a warm network in PyNative mode agree with one thread") {
  check_warm_network<PYNATIVE_MODE>();
}

// O2: the threads' first calls race to pack the shared weights; packing happens once and
// every thread reads the packed form (batches above 1 read it).
TEST_CASE("threads: concurrent first calls of a fresh network at O2 agree with one thread") {
  check_fresh_network<JitConfig{.jit_level = O2}>();
}

// A network built at run time, in graph mode: the threads' first calls race to trace it (once
// per input shape, under the compile cache's lock) and then replay the traces side by side.
TEST_CASE("threads: concurrent first calls of a runtime-built network in graph mode agree with PyNative") {
  duet_test::ModeGuard guard;
  const std::vector<Tensor> inputs = make_inputs();
  nn::DynamicSequentialCell net;
  net.append(nn::Flatten{});
  net.append(nn::Dense<>(784, 64));
  net.append(nn::ReLU{});
  net.append(nn::Dense<>(64, 10));
  const std::uint64_t before = jit_compile_count();
  set_context({.mode = GRAPH_MODE});
  const auto outputs = concurrent_forward(net, inputs);
  CHECK(jit_compile_count() == before + thread_count);  // one trace per batch size
  set_context({.mode = PYNATIVE_MODE});
  check_against_one_thread(net, inputs, outputs);
}

TEST_CASE("threads: concurrent first calls of a jitted function compile once") {
  duet_test::SeedNetwork<> net;
  auto f = jit([&](auto x) { return net(x); });
  const Tensor x = ones({3, 1, 28, 28});
  const Tensor expected = f(x);
  auto g = jit([&](auto x) { return net(x); });
  std::vector<Tensor> outputs(thread_count);
  std::latch start(thread_count);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < thread_count; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      outputs[t] = g(x);
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(g.compile_count() == 1);
  for (const Tensor& y : outputs) CHECK(bitwise_equal(y, expected));
}

TEST_CASE("threads: concurrent first uses of Parameter::derived make the form once") {
  struct Sum {
    float total = 0;
  };
  nn::Parameter p(ones({64}));
  std::atomic<int> makes{0};
  std::vector<std::shared_ptr<const Sum>> got(thread_count);
  std::latch start(thread_count);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < thread_count; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      got[t] = p.derived<Sum>([&] {
        ++makes;
        Sum s;
        for (float v : std::as_const(p).values()) s.total += v;
        return s;
      });
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(makes == 1);
  for (const auto& form : got) CHECK(form == got.front());
  CHECK(got.front()->total == 64.0f);
}

// Threads inside operations (threads.hpp) under callers of its own: four callers at batches
// large enough to share their products, with a budget of two threads in all, so that at most
// one helper runs beside them, whoever holds it, and every result is one thread's.
TEST_CASE("threads: concurrent callers share the operations' thread budget and get one thread's bits") {
  const int saved = get_num_threads();
  set_num_threads(threads_available ? 2 : 1);
  std::vector<Tensor> inputs;
  for (std::size_t i = 0; i < thread_count; ++i) inputs.push_back(randn({96 + 32 * static_cast<index_t>(i), 1, 28, 28}, 200 + i));
  duet_test::SeedNetwork<GRAPH_MODE> net;
  const long shared_before = detail::shared_runs().load();
  std::atomic<bool> done{false};
  int most_helpers = 0;
  std::thread monitor([&] {
    while (!done.load()) most_helpers = std::max(most_helpers, detail::helpers_in_use().load());
  });
  const auto outputs = concurrent_forward(net, inputs);
  done = true;
  monitor.join();
  CHECK(most_helpers <= get_num_threads() - 1);
  CHECK(detail::helpers_in_use().load() == 0);
  if (threads_available) CHECK(detail::shared_runs().load() > shared_before);
  set_num_threads(1);
  check_against_one_thread(net, inputs, outputs);
  set_num_threads(saved);
}
