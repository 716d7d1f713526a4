// Threads inside an operation (threads.hpp): how many, the budget callers share, and the same
// bits on any number of threads in both modes.
#include <cstring>
#include <vector>

#include "support.hpp"

namespace tests_num_threads {

using namespace duet;
using duet_test::ModeGuard;

struct ThreadsGuard {
  int saved = get_num_threads();
  ~ThreadsGuard() { set_num_threads(saved); }
};

std::vector<float> random_values(std::size_t n, std::uint64_t seed) {
  const Tensor t = randn({static_cast<index_t>(n)}, seed);
  return {t.data(), t.data() + n};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("num_threads: set_num_threads, set_context and get_context agree, and a refused count changes nothing") {
  ThreadsGuard threads;
  ModeGuard mode;
  set_num_threads(1);
  CHECK(get_num_threads() == 1);
  CHECK(get_context().num_threads == 1);
  CHECK_THROWS_WITH_AS(set_num_threads(0), "duet::set_num_threads: the number of threads must be in [1, 1024], got 0",
                       ValueError);
  CHECK(get_num_threads() == 1);
  set_context({.mode = GRAPH_MODE});
  // Checked before anything is applied: the mode stays as it was.
  CHECK_THROWS_WITH_AS(set_context({.mode = PYNATIVE_MODE, .num_threads = -1}),
                       "duet::set_context: num_threads: the number of threads must be in [1, 1024], got -1", ValueError);
  CHECK(get_context().mode == GRAPH_MODE);
  if (threads_available) {
    set_context({.num_threads = 2});
    CHECK(get_num_threads() == 2);
    CHECK(get_context().num_threads == 2);
  } else {
    CHECK_THROWS_WITH_AS(set_num_threads(2),
                         doctest::Contains("asks for 2 threads, but this program was built without OpenMP"), ValueError);
    CHECK(get_num_threads() == 1);
  }
  CHECK_THROWS_WITH_AS(detail::initial_num_threads("two"), "DUET_NUM_THREADS=two: not a whole number", ValueError);
  CHECK(detail::initial_num_threads("1") == 1);
}

TEST_CASE("num_threads: a large product is shared by two threads and gives one thread's bits, on every instruction set" * duet_test::every_isa) {
  if (!threads_available) {
    MESSAGE("SKIPPED: built without OpenMP");
    return;
  }
  ThreadsGuard threads;
  const index_t m = 96, k = 300, n = 200;  // 5.8M multiply-adds, 13+ panels of columns
  const auto a = random_values(static_cast<std::size_t>(m * k), 1);
  const auto b = random_values(static_cast<std::size_t>(n * k), 2);
  const auto bias = random_values(static_cast<std::size_t>(n), 3);
  duet_test::for_each_isa([&] {
    const kernels::PackedWeight<float> packed(b.data(), n, k);
    // gemm with a fused ReLU, from the weight and from its packed form; gemm_kn written, and
    // added to what is there.
    auto run = [&] {
      std::vector<float> c1(static_cast<std::size_t>(m * n)), c2(c1.size()), c3(c1.size(), 0.5f);
      kernels::gemm<dyn, dyn, fn::Relu>(a.data(), m, k, b.data(), n, bias.data(), c1.data());
      kernels::gemm<dyn, dyn, fn::Relu>(a.data(), m, k, b.data(), n, bias.data(), c2.data(), &packed);
      kernels::gemm_kn(a.data(), m, k, b.data(), n, c3.data(), true);
      c1.insert(c1.end(), c2.begin(), c2.end());
      c1.insert(c1.end(), c3.begin(), c3.end());
      return c1;
    };
    set_num_threads(1);
    const long before = detail::shared_runs().load();
    const auto one = run();
    CHECK(detail::shared_runs().load() == before);
    set_num_threads(2);
    const auto two = run();
    CHECK(detail::shared_runs().load() == before + 3);
    CHECK(same_bits(one, two));
    // While another caller holds the one helper the budget has, a product runs on its own
    // thread, with the same bits.
    {
      detail::HelperLease held(1);
      CHECK(held.threads() == 2);
      const auto alone = run();
      CHECK(detail::shared_runs().load() == before + 3);
      CHECK(same_bits(one, alone));
    }
  });
}

TEST_CASE("num_threads: large elementwise passes, column sums and transpositions are shared by two threads with one thread's bits, on every instruction set" * duet_test::every_isa) {
  if (!threads_available) {
    MESSAGE("SKIPPED: built without OpenMP");
    return;
  }
  ThreadsGuard threads;
  // Sizes off every block and vector boundary: 98 blocks of 1,024 elements with a partial
  // one, 6 strips of 64 columns with a partial one, 5 strips of 64 rows with a partial one.
  const index_t n = 100'003, rows = 300, cols = 333;
  const auto x = random_values(static_cast<std::size_t>(n), 4);
  const auto dy = random_values(static_cast<std::size_t>(n), 5);
  const auto m = random_values(static_cast<std::size_t>(rows * cols), 6);
  duet_test::for_each_isa([&] {
    auto run = [&](index_t size) {
      std::vector<float> y(static_cast<std::size_t>(size)), dx(y.size()), scaled(y.size());
      std::vector<float> sums(static_cast<std::size_t>(cols), 0.25f);
      kernels::map<fn::Relu>(x.data(), size, y.data());
      kernels::map_grad<fn::Relu>(dy.data(), y.data(), size, dx.data());
      kernels::scale(x.data(), size, 0.3f, scaled.data());
      kernels::column_sums(m.data(), size == n ? rows : 2, cols, sums.data(), true);
      const index_t t_rows = size == n ? rows : 2;
      std::vector<float> transposed(static_cast<std::size_t>(t_rows * cols));
      kernels::transpose(m.data(), t_rows, cols, transposed.data());
      for (const auto* part : {&dx, &scaled, &sums, &transposed}) y.insert(y.end(), part->begin(), part->end());
      return y;
    };
    set_num_threads(1);
    const long before = detail::shared_runs().load();
    const auto one = run(n);
    CHECK(detail::shared_runs().load() == before);
    set_num_threads(2);
    const auto two = run(n);
    CHECK(detail::shared_runs().load() == before + 5);
    CHECK(same_bits(one, two));
    // A batch-1 layer's pass is not worth waking a helper for.
    const auto small = run(512);
    CHECK(detail::shared_runs().load() == before + 5);
    set_num_threads(1);
    CHECK(same_bits(small, run(512)));
  });
}

TEST_CASE("num_threads: training steps give the same bits on one and two threads, in both modes, and batch 1 stays on one") {
  ThreadsGuard threads;
  ModeGuard mode;
  using Net = duet_test::SeedNetwork<>;
  using Loss = nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean>;
  const Tensor x = randn({128, 1, 28, 28}, 11);
  BasicTensor<std::int32_t> labels(Shape{128});
  for (index_t i = 0; i < 128; ++i) labels(i) = static_cast<std::int32_t>(i * 7 % 10);
  auto train = [&](Mode m, int n) {
    set_context({.mode = m});
    set_num_threads(n);
    set_seed(5);
    Net net;
    Loss loss;
    nn::WithLossCell<Net, Loss> with_loss{net, loss};
    nn::Adam adam{net.parameters(), {.learning_rate = 0.01}};
    nn::TrainOneStepCell<nn::WithLossCell<Net, Loss>, nn::Adam> step{with_loss, adam};
    for (int i = 0; i < 3; ++i) step(x, labels);
    std::vector<float> values;
    for (const auto& [name, p] : net.parameters()) values.insert(values.end(), p->data(), p->data() + p->numel());
    return values;
  };
  const long before = detail::shared_runs().load();
  const auto pynative = train(PYNATIVE_MODE, 1);
  const auto graph = train(GRAPH_MODE, 1);
  CHECK(detail::shared_runs().load() == before);
  CHECK(same_bits(pynative, graph));
  if (!threads_available) {
    MESSAGE("SKIPPED: built without OpenMP, so only one thread was tried");
    return;
  }
  CHECK(same_bits(train(PYNATIVE_MODE, 2), pynative));
  CHECK(same_bits(train(GRAPH_MODE, 2), pynative));
  CHECK(detail::shared_runs().load() > before);
  // A single row is a GEMV, bound by reading the weights: a second thread would only wait.
  const long after_training = detail::shared_runs().load();
  Net net;
  (void)net(randn({1, 1, 28, 28}, 3));
  CHECK(detail::shared_runs().load() == after_training);
}

}  // namespace tests_num_threads
