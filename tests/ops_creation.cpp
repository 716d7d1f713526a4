// zeros_like, ones_like, full_like (include/duet/ops/creation.hpp): their values in the
// gradient harness (no gradient is due to their input), and here a learned initial state
// broadcast to the batch through zeros_like, trained in both modes, against a closed form.
// randn_like, rand_like (include/duet/ops/random.hpp): the global generator's draws in both
// modes, their distribution, and a reparameterised sample's gradients against a closed form.
// multinomial (the same header): the indices against a plain loop's draws from the same
// generator, in both modes, their frequencies against the weights, draws without replacement
// distinct, and its errors.
// cast (include/duet/ops/cast.hpp): conversions against static_cast, the gradient cast back, a
// padding mask as weights.
#include <array>
#include <cmath>
#include <cstdint>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ops_harness.hpp"

namespace tests_ops_creation {

namespace {

using namespace duet_test::ops;
using duet::index_t;
namespace nn = duet::nn;
namespace ops = duet::ops;

D filled(const Shape& shape, double v) {
  D out = duet::zeros<double>(shape);
  std::fill_n(out.data(), out.numel(), v);
  return out;
}

// What the global generator seeded with `seed` draws, element by element in row-major order.
D draws(const Shape& shape, std::uint64_t seed, bool uniform) {
  duet::Generator gen(seed);
  D out = duet::zeros<double>(shape);
  for (index_t i = 0; i < out.numel(); ++i) out.data()[i] = uniform ? gen.uniform01<double>() : gen.normal<double>();
  return out;
}

// torch.multinomial's draws as duet makes them, by a plain loop: per row, per sample, one
// uniform double u and the first index whose cumulative weight (of those left) exceeds u times
// their sum.
D multinomial_draws(const D& w, index_t samples, bool replacement, duet::Generator& gen) {
  const index_t categories = w.shape().back();
  Shape out_shape = w.shape();
  out_shape[out_shape.rank() - 1] = samples;
  D out = duet::zeros<double>(out_shape);
  for (index_t r = 0; r < w.numel() / categories; ++r) {
    std::vector<double> left(w.data() + r * categories, w.data() + (r + 1) * categories);
    for (index_t s = 0; s < samples; ++s) {
      double total = 0;
      for (const double x : left) total += x;
      const double target = gen.uniform01<double>() * total;
      double running = 0;
      index_t picked = -1;
      for (index_t c = 0; c < categories && picked < 0; ++c) {
        running += left[static_cast<std::size_t>(c)];
        if (left[static_cast<std::size_t>(c)] > 0 && target < running) picked = c;
      }
      REQUIRE(picked >= 0);
      out.data()[r * samples + s] = static_cast<double>(picked);
      if (!replacement) left[static_cast<std::size_t>(picked)] = 0;
    }
  }
  return out;
}

D absolute(const D& x) {
  D out = duet::zeros<double>(x.shape());
  for (index_t i = 0; i < x.numel(); ++i) out.data()[i] = std::abs(x.data()[i]);
  return out;
}

// x * scale converted to U as static_cast does, back in double.
template <class U>
D converted(const D& x, double scale) {
  D out = duet::zeros<double>(x.shape());
  for (index_t i = 0; i < x.numel(); ++i) out.data()[i] = static_cast<double>(static_cast<U>(x.data()[i] * scale));
  return out;
}

const bool creation_cases = add_cases([](std::multimap<std::string, Case>& m) {
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 1, 3}, Shape{}}) {
    m.emplace("zeros_like", make_value_case({shape}, [](const auto& x) { return ops::zeros_like(x); },
                                            [](const std::vector<D>& xs) { return filled(xs[0].shape(), 0.0); }));
    m.emplace("ones_like", make_value_case({shape}, [](const auto& x) { return ops::ones_like(x); },
                                           [](const std::vector<D>& xs) { return filled(xs[0].shape(), 1.0); }));
    m.emplace("full_like", make_value_case({shape}, [](const auto& x) { return ops::full_like(x, -2.5); },
                                           [](const std::vector<D>& xs) { return filled(xs[0].shape(), -2.5); }));
  }
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 1, 5}}) {
    m.emplace("cast", make_value_case({shape}, [](const auto& x) { return ops::cast<float>(x); },
                                      [](const std::vector<D>& xs) { return converted<float>(xs[0], 1.0); }));
    m.emplace("cast", make_value_case({shape}, [](const auto& x) { return ops::cast<std::int32_t>(x * 3.0); },
                                      [](const std::vector<D>& xs) { return converted<std::int32_t>(xs[0], 3.0); }));
    m.emplace("cast", make_case<1>({shape}, [](const auto& x) { return ops::cast<double>(x) * x; },
                                   [](double x, double) { return x * x; }));
  }
  // Seeded inside the function, so that each mode draws from the same state: graph mode runs
  // the function's C++ (the seeding) while capturing, then the graph (the draw).
  for (const Shape& shape : {Shape{3, 4}, Shape{2, 1, 5}}) {
    m.emplace("randn_like", make_value_case({shape}, [](const auto& x) {
                duet::set_seed(21);
                return ops::randn_like(x);
              }, [](const std::vector<D>& xs) { return draws(xs[0].shape(), 21, false); }));
    m.emplace("rand_like", make_value_case({shape}, [](const auto& x) {
                duet::set_seed(22);
                return ops::rand_like(x);
              }, [](const std::vector<D>& xs) { return draws(xs[0].shape(), 22, true); }));
    for (const bool replacement : {true, false}) {
      m.emplace("multinomial", make_value_case(
                                   {shape},
                                   [replacement](const auto& x) {
                                     duet::set_seed(23);
                                     return ops::multinomial(ops::abs(x), 3, replacement);
                                   },
                                   [replacement](const std::vector<D>& xs) {
                                     duet::Generator gen(23);
                                     return multinomial_draws(absolute(xs[0]), 3, replacement, gen);
                                   }));
    }
  }
});

// A learned initial state [1, 4] broadcast to the batch, then one recurrent step.
struct FromH0 : nn::Cell<FromH0, duet::CONTEXT_MODE, double> {
  nn::Dense<4, 4, double> hh;
  nn::Dense<3, 4, double> ih;
  nn::BasicParameter<double> h0{duet::uniform<double>({1, 4}, -0.5, 0.5, 3)};
  DUET_CELL_MEMBERS(hh, ih, h0);
  auto construct(auto x) {
    const auto h = ops::zeros_like(ih(x)) + h0;  // [batch, 4]
    return ops::sum(ops::square(ops::tanh(ih(x) + hh(h))));
  }
};

// A sample around an encoding, and its loss (a VAE's reparameterisation, without the decoder).
struct Reparam : nn::Cell<Reparam, duet::CONTEXT_MODE, double> {
  nn::Dense<3, 4, double> enc;
  DUET_CELL_MEMBERS(enc);
  auto construct(auto x) {
    const auto h = enc(x);
    return ops::sum(ops::square(h + ops::randn_like(h)));
  }
};

// The global generator's next draw, without drawing it.
double next_draw() {
  return duet::with_global_generator([](const duet::Generator& g) { return duet::Generator(g).normal<double>(); });
}

}  // namespace

TEST_CASE("randn_like: compare_modes and summary give back their draws, and so does a step that fails") {
  duet::set_seed(14);
  Reparam net;
  const D x = random_input({5, 3}, -1.0, 1.0, 15);
  const double next = next_draw();
  const duet::ModeReport report = duet::compare_modes(net, x);
  CHECK_MESSAGE(report.agree(), report.to_string());
  std::ostringstream sink;
  duet::summary(net, {5, 3}, sink);
  CHECK(next_draw() == next);
  // A loss that fails after drawing (a shape error in the loss) draws nothing in the end.
  auto failing = [&](const auto& in) {
    const auto noisy = in + ops::randn_like(in);
    return ops::sum(net(noisy));
  };
  CHECK_THROWS_AS(static_cast<void>(duet::value_and_grad(failing)(random_input({5, 2}, -1.0, 1.0, 16))), duet::ShapeError);
  CHECK(next_draw() == next);
}

TEST_CASE("zeros_like: a learned initial state broadcast to the batch gets the batch's summed gradient, the same in both modes") {
  const D x = random_input({5, 3}, -1.0, 1.0, 4);
  std::vector<std::vector<D>> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    duet::set_seed(5);
    FromH0 net;
    const auto params = net.parameters();
    grads.push_back(duet::value_and_grad(net, params)(x).grads);
    const auto at = std::ranges::find_if(params, [](const auto& p) { return p.name == "h0"; }) - params.begin();
    // Against the closed form: d/dh0 = Σ_batch hhᵀ · (2 t (1 - t²)), t = tanh(ih(x) + hh(h0)).
    const D h0 = net.h0.clone();
    std::vector<double> expected(4, 0.0);
    for (index_t b = 0; b < 5; ++b) {
      for (index_t o = 0; o < 4; ++o) {
        double z = net.ih.bias.data()[o] + net.hh.bias.data()[o];
        for (index_t i = 0; i < 3; ++i) z += net.ih.weight.data()[o * 3 + i] * x.data()[b * 3 + i];
        for (index_t i = 0; i < 4; ++i) z += net.hh.weight.data()[o * 4 + i] * h0.data()[i];
        const double t = std::tanh(z);
        for (index_t i = 0; i < 4; ++i) expected[static_cast<std::size_t>(i)] += 2 * t * (1 - t * t) * net.hh.weight.data()[o * 4 + i];
      }
    }
    const D& dh0 = grads.back()[static_cast<std::size_t>(at)];
    REQUIRE(dh0.shape() == Shape{1, 4});
    for (index_t i = 0; i < 4; ++i) CHECK(dh0.data()[i] == doctest::Approx(expected[static_cast<std::size_t>(i)]).epsilon(1e-12));
  }
  CHECK(same_bits(grads[0], grads[1]));
}

TEST_CASE("zeros_like: zeros where x * 0 would be NaN, and its input gets no gradient, which is no error") {
  D x = random_input({2, 3}, -1.0, 1.0, 6);
  x.data()[1] = INFINITY;
  x.data()[4] = NAN;
  const D z = ops::zeros_like(x);
  for (index_t i = 0; i < z.numel(); ++i) CHECK(z.data()[i] == 0.0);
  const D w = random_input({2, 3}, -1.0, 1.0, 7);
  const D y = random_input({2, 3}, -1.0, 1.0, 8);
  std::vector<D> dy;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    // d/dy sum(w * (full_like(y, 2) + y)) = w: the full_like adds nothing.
    auto f = [](const auto& w_, const auto& y_) { return (ops::full_like(y_, 2.0) + y_) * w_; };
    dy.push_back(duet::value_and_grad(f, 1)(w, y).grads[0]);
    for (index_t i = 0; i < 6; ++i) CHECK(dy.back().data()[i] == w.data()[i]);
  }
  CHECK(same_bits(std::vector<D>{dy[0]}, std::vector<D>{dy[1]}));
  // Into int32: truncated as MindSpore's, and a value int32 cannot hold refused (not UB).
  const duet::BasicTensor<std::int32_t> ids({2}, {4, 7});
  CHECK(ops::full_like(ids, 2.7).data()[1] == 2);
  CHECK_THROWS_AS(static_cast<void>(ops::full_like(ids, 1e10)), duet::ValueError);
}

TEST_CASE("randn_like: a reparameterised sample mu + exp(logvar / 2) * eps, its gradients and draws in both modes") {
  const D mu = random_input({4, 3}, -1.0, 1.0, 9);
  const D logvar = random_input({4, 3}, -1.0, 1.0, 10);
  const D w = random_input({4, 3}, -1.0, 1.0, 11);
  const D eps = draws({4, 3}, 12, false);
  std::vector<std::vector<D>> results;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    auto sample = [](const auto& w_, const auto& mu_, const auto& logvar_) {
      return (mu_ + ops::exp(logvar_ * 0.5) * ops::randn_like(mu_)) * w_;
    };
    auto by_mu = duet::value_and_grad(sample, 1);
    auto by_logvar = duet::value_and_grad(sample, 2);
    duet::set_seed(12);
    const auto r_mu = by_mu(w, mu, logvar);
    duet::set_seed(12);
    const auto r_logvar = by_logvar(w, mu, logvar);
    // d/dmu = w, d/dlogvar = w exp(logvar / 2) eps / 2, with eps the seed's draws.
    for (index_t i = 0; i < 12; ++i) {
      const double s = std::exp(logvar.data()[i] * 0.5);
      CHECK(r_mu.grads[0].data()[i] == w.data()[i]);
      CHECK(r_logvar.grads[0].data()[i] == doctest::Approx(w.data()[i] * s * eps.data()[i] * 0.5).epsilon(1e-14));
    }
    // Each call draws anew, from where the generator is.
    const D again = by_mu(w, mu, logvar).value;
    CHECK(!same_bits(std::vector<D>{again}, std::vector<D>{r_mu.value}));
    results.push_back({r_mu.value, r_mu.grads[0], r_logvar.grads[0], again});
  }
  CHECK(same_bits(results[0], results[1]));
}

TEST_CASE("cast: float and double round trips pass the gradient back, a padding mask weighs a mean, a value out of range is refused") {
  const D x = random_input({3, 4}, -2.0, 2.0, 17);
  const D w = random_input({3, 4}, -1.0, 1.0, 18);
  // ids [2, 4] with 0 for padding: the mean over the others, and its gradient.
  const duet::BasicTensor<std::int32_t> ids({2, 4}, {5, 0, 7, 0, 3, 4, 0, 0});
  std::vector<std::vector<D>> results;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    auto round_trip = [](const auto& w_, const auto& x_) { return ops::cast<double>(ops::cast<float>(x_)) * w_; };
    const auto r = duet::value_and_grad(round_trip, 1)(w, x);
    // d/dx = w, rounded to float on the way back.
    for (index_t i = 0; i < 12; ++i) CHECK(r.grads[0].data()[i] == static_cast<double>(static_cast<float>(w.data()[i])));
    auto masked_mean = [](const auto& h, const auto& tokens) {
      const auto mask = ops::cast<double>(ops::not_equal(tokens, 0));  // [2, 4]
      return ops::sum(h * mask, ops::axes<1>) / ops::sum(mask, ops::axes<1>);
    };
    const D h = random_input({2, 4}, -1.0, 1.0, 19);
    const auto m = duet::value_and_grad(masked_mean, 0)(h, ids);
    CHECK(m.value.data()[0] == doctest::Approx((h.data()[0] + h.data()[2]) / 2).epsilon(1e-15));
    CHECK(m.value.data()[1] == doctest::Approx((h.data()[4] + h.data()[5]) / 2).epsilon(1e-15));
    const std::vector<double> expected{0.5, 0, 0.5, 0, 0.5, 0.5, 0, 0};
    for (index_t i = 0; i < 8; ++i) CHECK(m.grads[0].data()[i] == expected[static_cast<std::size_t>(i)]);
    results.push_back({r.value, r.grads[0], m.value, m.grads[0]});
  }
  CHECK(same_bits(results[0], results[1]));
  CHECK(ops::cast<std::int32_t>(duet::Tensor({2}, {2.9f, -2.9f})).data()[1] == -2);
  CHECK_THROWS_AS(static_cast<void>(ops::cast<std::int32_t>(duet::Tensor({1}, {3e9f}))), duet::ValueError);
  CHECK_THROWS_AS(static_cast<void>(ops::cast<std::uint8_t>(duet::Tensor({1}, {NAN}))), duet::ValueError);
}

TEST_CASE("randn_like and rand_like: standard normal draws, and uniform ones from 0 up to 1, in float and double") {
  duet::set_seed(13);
  const D n = ops::randn_like(duet::zeros<double>({200000}));
  double mean = 0, square = 0;
  for (double v : n.values()) {
    mean += v;
    square += v * v;
  }
  mean /= 200000.0;
  CHECK(std::abs(mean) < 0.01);  // 4.5 standard errors
  CHECK(square / 200000.0 - mean * mean == doctest::Approx(1.0).epsilon(0.01));
  const duet::Tensor u = ops::rand_like(duet::zeros({100000}));
  CHECK(std::ranges::all_of(u.values(), [](float v) { return v >= 0.0f && v < 1.0f; }));
  double total = 0;
  for (float v : u.values()) total += v;
  CHECK(total / 100000.0 == doctest::Approx(0.5).epsilon(0.01));
}

TEST_CASE(
    "multinomial: frequencies follow the weights, within a chi-square bound, and draw from the seed or generator "
    "given") {
  // Unnormalised weights, a category of weight 0; 40000 draws from a seed.
  const duet::Tensor w({2, 5}, {1, 2, 3, 4, 0, 0.5f, 0, 0, 0, 0.5f});
  constexpr index_t n = 40000;
  const duet::BasicTensor<std::int32_t> got = ops::multinomial(w, n, true, std::uint64_t{31});
  REQUIRE(got.shape() == Shape{2, n});
  for (index_t r = 0; r < 2; ++r) {
    std::array<double, 5> counts{};
    for (index_t s = 0; s < n; ++s) counts.at(static_cast<std::size_t>(got(r, s))) += 1;
    double sum = 0;
    for (index_t c = 0; c < 5; ++c) sum += w(r, c);
    double chi2 = 0;
    int categories = 0;
    for (index_t c = 0; c < 5; ++c) {
      const double expected = n * w(r, c) / sum;
      if (expected == 0) {
        CHECK(counts[static_cast<std::size_t>(c)] == 0);  // weight 0: never drawn
        continue;
      }
      chi2 += (counts[static_cast<std::size_t>(c)] - expected) * (counts[static_cast<std::size_t>(c)] - expected) /
              expected;
      ++categories;
    }
    // 16.27 and 10.83: chi-square's 0.999 quantiles at 3 and 1 degrees of freedom.
    CAPTURE(r);
    CHECK(chi2 < (categories == 4 ? 16.27 : 10.83));
  }
  // The same seed, the same indices; the plain loop's, from a generator of that seed.
  CHECK(duet_test::values_of(ops::multinomial(w, n, true, std::uint64_t{31})) == duet_test::values_of(got));
  duet::Generator reference(31);
  CHECK(duet_test::values_of(got) ==
        duet_test::values_of(multinomial_draws(duet::ops::cast<double>(w), n, true, reference)));
  // A generator of one's own moves on: two calls draw what one generator draws in turn.
  duet::Generator gen(32), again(32);
  const auto first = ops::multinomial(w, 7, true, gen);
  const auto second = ops::multinomial(w, 7, true, gen);
  CHECK(duet_test::values_of(first) ==
        duet_test::values_of(multinomial_draws(duet::ops::cast<double>(w), 7, true, again)));
  CHECK(duet_test::values_of(second) ==
        duet_test::values_of(multinomial_draws(duet::ops::cast<double>(w), 7, true, again)));
}

TEST_CASE("multinomial without replacement: distinct indices, all of them when as many as the weights allow") {
  const duet::Tensor w({3, 6}, {1, 1, 1, 1, 1, 1, 5, 0, 1, 0, 2, 3, 0.1f, 100, 0.1f, 0.1f, 0.1f, 0.1f});
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const auto six = ops::multinomial(w, 4, false, seed);
    for (index_t r = 0; r < 3; ++r) {
      std::set<int> seen;
      for (index_t s = 0; s < 4; ++s) {
        seen.insert(six(r, s));
        CHECK(w(r, six(r, s)) > 0);
      }
      CHECK(seen.size() == 4);
    }
  }
  // As many samples as positive weights: each index once (a permutation of them).
  const duet::Tensor row({6}, {0, 2, 0, 1, 3, 0});
  const auto drawn = ops::multinomial(row, 3, false, std::uint64_t{5});
  std::vector<int> all;
  for (const std::int32_t i : drawn.values()) all.push_back(i);
  std::sort(all.begin(), all.end());
  CHECK(all == std::vector<int>{1, 3, 4});
}

TEST_CASE("multinomial: negative, NaN, infinite or all-zero weights, too many samples, and recorded seeds are errors") {
  const auto message = [](const duet::Tensor& w, index_t n, bool replacement) {
    try {
      static_cast<void>(ops::multinomial(w, n, replacement, std::uint64_t{1}));
    } catch (const duet::ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message(duet::Tensor({2, 3}, {1, 2, 3, 1, -1, 1}), 1, true) ==
        "ops::multinomial(weights, 1, replacement): row 1 has weight -1.000000 at index 1; weights must be finite and "
        ">= 0");
  CHECK(message(duet::Tensor({3}, {1, std::nanf(""), 1}), 2, true).find("has weight nan at index 1") !=
        std::string::npos);
  CHECK(message(duet::Tensor({3}, {1, INFINITY, 1}), 2, true).find("has weight inf at index 1") != std::string::npos);
  CHECK(message(duet::Tensor({2, 2}, {1, 1, 0, 0}), 1, true) ==
        "ops::multinomial(weights, 1, replacement): row 1 has no positive weight to draw from");
  CHECK(message(duet::Tensor({4}, {1, 0, 1, 1}), 4, false) ==
        "ops::multinomial(weights, 4): row 0 has 3 indices of positive weight, fewer than the 4 samples drawn without "
        "replacement");
  CHECK(message(duet::Tensor({4}, {1, 0, 1, 1}), 0, true) ==
        "duet::ops::multinomial: num_samples 0 must be at least 1");
  CHECK(message(duet::Tensor({4}, {1, 0, 1, 1}), 4, true) == "no error");
  // An error draws nothing from the global generator; in both modes, as a graph's kernel.
  duet::set_seed(40);
  const double next = next_draw();
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet_test::ModeGuard guard;
    duet::set_context({.mode = mode});
    auto sample = duet::jit([](const auto& w) { return ops::multinomial(w, 2, false); });
    CHECK_THROWS_WITH_AS(sample(duet::Tensor({2}, {0, 1})), doctest::Contains("fewer than the 2 samples"),
                         duet::ValueError);
  }
  CHECK(next_draw() == next);
  // A seed or a generator of one's own in a trace would be replayed: refused.
  auto traced =
      duet::jit([](const duet::Tensor& w) { return ops::cast<float>(ops::multinomial(w, 1, true, std::uint64_t{3})); },
                {.mode = duet::JitMode::PIJit});
  CHECK_THROWS_AS(traced(duet::Tensor({2}, {1, 1})), duet::ModeError);
}

}  // namespace tests_ops_creation
