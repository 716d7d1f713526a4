// softmax and log_softmax (include/duet/ops/softmax.hpp): their cases in the gradient harness,
// with values from plain loops in double, and what the harness does not cover (large logits,
// the cells in a SequentialCell, axis errors).
#include "ops_harness.hpp"

namespace tests_ops_softmax {

namespace {

using namespace duet_test::ops;
using duet_test::ops::D;
namespace ops = duet::ops;

// softmax (or log_softmax) along `axis`, written out: for each slice, exp of each element over
// the sum of exps, in double without subtracting the maximum (the inputs are small).
D reference_softmax(const D& x, int axis, bool log) {
  const Shape& s = x.shape();
  const int a = axis < 0 ? axis + s.rank() : axis;
  duet::index_t outer = 1, inner = 1;
  for (int i = 0; i < a; ++i) outer *= s[i];
  for (int i = a + 1; i < s.rank(); ++i) inner *= s[i];
  const duet::index_t n = s[a];
  D y = duet::zeros<double>(s);
  for (duet::index_t o = 0; o < outer; ++o) {
    for (duet::index_t i = 0; i < inner; ++i) {
      double total = 0;
      for (duet::index_t r = 0; r < n; ++r) total += std::exp(x.data()[(o * n + r) * inner + i]);
      for (duet::index_t r = 0; r < n; ++r) {
        const double v = x.data()[(o * n + r) * inner + i];
        y.data()[(o * n + r) * inner + i] = log ? v - std::log(total) : std::exp(v) / total;
      }
    }
  }
  return y;
}

template <bool Log>
void add_softmax(std::multimap<std::string, Case>& m) {
  auto add = [&](Shape s, int axis) {
    auto f = [axis](const auto& x) {
      if constexpr (Log) return ops::log_softmax(x, axis);
      else return ops::softmax(x, axis);
    };
    m.emplace(Log ? "log_softmax" : "softmax",
              make_case_with_reference<1>({s}, f, [axis](const std::vector<D>& xs) {
                return reference_softmax(xs[0], axis, Log);
              }));
  };
  add({3, 5}, -1);
  add({3, 5}, 0);
  add({2, 3, 4}, 1);
  add({2, 3, 4}, -1);
  add({4}, 0);
}

const bool softmax_cases = add_cases([](std::multimap<std::string, Case>& m) {
  add_softmax<false>(m);
  add_softmax<true>(m);
});

template <auto Setting>
struct Classifier : duet::nn::Cell<Classifier<Setting>, Setting> {
  duet::nn::SequentialCell<duet::nn::Dense<4, 3>, duet::nn::LogSoftmax> head;
  DUET_CELL_MEMBERS(head);
  auto construct(auto x) { return head(x); }
};

}  // namespace

TEST_CASE("ops: softmax and log_softmax of logits of 1000 give no inf or NaN") {
  const duet::Tensor x({2, 3}, {1000.f, 0.f, -1000.f, 1000.f, 1000.f, 999.f});
  const duet::Tensor p = ops::softmax(x);
  const duet::Tensor lp = ops::log_softmax(x);
  CHECK(p(0, 0) == 1.f);
  CHECK(p(0, 2) == 0.f);
  CHECK(lp(0, 0) == 0.f);
  CHECK(lp(0, 2) == -2000.f);
  CHECK(p(1, 0) == doctest::Approx(std::exp(1.0) / (2 * std::exp(1.0) + 1)));
  const duet::Tensor column = ops::log_softmax(x, 0);
  for (duet::index_t i = 0; i < x.numel(); ++i) {
    CHECK(std::isfinite(p.data()[i]));
    CHECK(std::isfinite(lp.data()[i]));
    CHECK(std::isfinite(column.data()[i]));
  }
  // The gradient stays finite too.
  const duet::Tensor g = duet::grad([](const auto& t) { return ops::sum(ops::log_softmax(t) * ops::softmax(t)); })(x);
  for (duet::index_t i = 0; i < g.numel(); ++i) CHECK(std::isfinite(g.data()[i]));
}

TEST_CASE("ops: a position masked with -1e9 gets exactly zero weight and gradient, whatever the row's length") {
  for (duet::index_t n : {3, 64, 67}) {
    CAPTURE(n);
    std::vector<float> v(static_cast<std::size_t>(n), 0.5f);
    for (std::size_t i = 1; i < v.size(); i += 2) v[i] = -1e9f;  // every other position masked
    const duet::Tensor x({2, n}, [&] {
      std::vector<float> both = v;
      both.insert(both.end(), v.begin(), v.end());
      return both;
    }());
    for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
      duet_test::ModeGuard guard;
      duet::set_context({.mode = mode});
      const auto probabilities = [](const auto& t) { return ops::softmax(t); };
      const duet::Tensor p = duet::jit(probabilities)(x);
      const duet::Tensor e = ops::exp(x);
      const duet::Tensor g = duet::grad([](const auto& t) { return ops::sum(ops::square(ops::softmax(t))); })(x);
      for (duet::index_t i = 0; i < x.numel(); ++i) {
        if (x.data()[i] > 0) continue;
        CHECK(p.data()[i] == 0.0f);
        CHECK(e.data()[i] == 0.0f);
        CHECK(g.data()[i] == 0.0f);
      }
    }
  }
}

TEST_CASE("ops: nn::Softmax and nn::LogSoftmax are cells in a SequentialCell, the same in both modes") {
  duet_test::ModeGuard guard;
  duet::set_seed(3);
  Classifier<duet::PYNATIVE_MODE> eager;
  duet::set_seed(3);
  Classifier<duet::GRAPH_MODE> graph;
  duet::Generator gen(7);
  const duet::Tensor x = duet::uniform<float>({5, 4}, -1.f, 1.f, gen);
  const duet::Tensor a = eager(x);
  const duet::Tensor b = graph(x);
  CHECK(std::equal(a.data(), a.data() + a.numel(), b.data()));
  const duet::Tensor p = duet::nn::Softmax(0)(x);
  CHECK(ops::sum(p, ops::axes<0>)(2) == doctest::Approx(1.f));
  CHECK(duet::nn::LogSoftmax().type_name() == "nn::LogSoftmax");
}

TEST_CASE("ops: a softmax axis out of range is a ShapeError naming the operation and the shape") {
  try {
    static_cast<void>(ops::softmax(duet::ones({2, 3}), 2));
    FAIL("no error");
  } catch (const duet::ShapeError& e) {
    CHECK(std::string(e.what()) == "Softmax(axis=2) expects an input of rank at least 3, got [2, 3]");
  }
}

}  // namespace tests_ops_softmax
