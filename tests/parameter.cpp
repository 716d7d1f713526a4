// Parameter::derived keeps a form computed from the values until they may have changed.
// (set_data: tests/cell.cpp.)
#include "support.hpp"

#include <atomic>
#include <latch>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace duet;

namespace {

// A derived form that records the values it was made from.
struct Sum {
  float total = 0;
};

Sum sum_of(const nn::Parameter& p) {
  Sum s;
  for (float v : std::as_const(p).values()) s.total += v;
  return s;
}

}  // namespace

TEST_CASE("Parameter::derived is made once, and again after any write to the values") {
  nn::Parameter p(ones({2, 2}));
  int makes = 0;
  const auto make = [&] {
    ++makes;
    return sum_of(p);
  };
  const auto first = p.derived<Sum>(make);
  CHECK(first->total == 4.0f);
  CHECK(p.derived<Sum>(make) == first);
  CHECK(makes == 1);

  p.set_data(full({2, 2}, 2.0f));
  CHECK(p.derived<Sum>(make)->total == 8.0f);
  CHECK(first->total == 4.0f);  // a form handed out stays as it was

  Tensor alias = p;  // shares the elements
  alias(0, 0) = 12.0f;
  CHECK(p.derived<Sum>(make)->total == 18.0f);

  p = nn::Parameter(zeros({2, 2}));
  CHECK(p.derived<Sum>(make)->total == 0.0f);
  CHECK(makes == 4);
  CHECK(p.derived<Sum>(make)->total == 0.0f);
  CHECK(makes == 4);
}

TEST_CASE("Parameter::derived: a form of another type replaces the one kept") {
  nn::Parameter p(ones({3}));
  CHECK(p.derived<Sum>([&] { return sum_of(p); })->total == 3.0f);
  CHECK(*p.derived<std::string>([] { return std::string("packed"); }) == "packed");
  CHECK(p.derived<Sum>([&] { return sum_of(p); })->total == 3.0f);
}

TEST_CASE("threads: concurrent first uses of Parameter::derived make the form once") {
  nn::Parameter p(ones({64}));
  std::atomic<int> makes{0};
  constexpr int thread_count = 4;
  std::vector<std::shared_ptr<const Sum>> got(thread_count);
  std::latch start(thread_count);
  std::vector<std::thread> threads;
  for (int t = 0; t < thread_count; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      got[static_cast<std::size_t>(t)] = p.derived<Sum>([&] {
        ++makes;
        return sum_of(p);
      });
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(makes == 1);
  for (const auto& form : got) CHECK(form == got.front());
  CHECK(got.front()->total == 64.0f);
}
