// Recurrent layers (include/duet/nn/recurrent.hpp): nn::GRU and nn::LSTM in the gradient
// harness against PyTorch's formulas written out in double, their parameters' gradients
// against finite differences in both modes, training, and their shape errors.
#include <cmath>
#include <memory>
#include <span>
#include <vector>

#include "ops_harness.hpp"

namespace tests_nn_recurrent {

namespace {

using namespace duet_test::ops;
using duet::index_t;
using GRU = duet::nn::GRU<duet::dyn, duet::dyn, double>;
using LSTM = duet::nn::LSTM<duet::dyn, duet::dyn, double>;

double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }

// Row b of an initial state given as input k of xs, or zeros.
std::vector<double> initial_row(const std::vector<D>& xs, std::size_t k, index_t b, index_t hidden) {
  std::vector<double> row(static_cast<std::size_t>(hidden), 0.0);
  if (k < xs.size()) std::copy_n(xs[k].data() + b * hidden, hidden, row.begin());
  return row;
}

// torch.nn.GRU(batch_first=True)'s output, one element at a time (gates r, z, n), from h0
// (xs[1]) or zeros.
D gru_reference(const GRU& gru, const std::vector<D>& xs) {
  const D& x = xs[0];
  const index_t batch = x.shape()[0], length = x.shape()[1], in = x.shape()[2], hidden = gru.hidden_size();
  const double* w_ih = gru.weight_ih_l0.data();
  const double* w_hh = gru.weight_hh_l0.data();
  const double* b_ih = gru.bias_ih_l0.data();
  const double* b_hh = gru.bias_hh_l0.data();
  D y = duet::zeros<double>(Shape{batch, length, hidden});
  for (index_t b = 0; b < batch; ++b) {
    std::vector<double> h = initial_row(xs, 1, b, hidden);
    for (index_t t = 0; t < length; ++t) {
      const double* xt = x.data() + (b * length + t) * in;
      // gate(k, j): row k · hidden + j of W_ih x + b_ih, and of W_hh h + b_hh.
      auto input_gate = [&](index_t k, index_t j) {
        double s = b_ih[k * hidden + j];
        for (index_t i = 0; i < in; ++i) s += w_ih[(k * hidden + j) * in + i] * xt[i];
        return s;
      };
      auto hidden_gate = [&](index_t k, index_t j) {
        double s = b_hh[k * hidden + j];
        for (index_t i = 0; i < hidden; ++i) s += w_hh[(k * hidden + j) * hidden + i] * h[static_cast<std::size_t>(i)];
        return s;
      };
      std::vector<double> next(h.size());
      for (index_t j = 0; j < hidden; ++j) {
        const double r = sigmoid(input_gate(0, j) + hidden_gate(0, j));
        const double z = sigmoid(input_gate(1, j) + hidden_gate(1, j));
        const double n = std::tanh(input_gate(2, j) + r * hidden_gate(2, j));
        next[static_cast<std::size_t>(j)] = (1 - z) * n + z * h[static_cast<std::size_t>(j)];
      }
      h = next;
      std::copy(h.begin(), h.end(), y.data() + (b * length + t) * hidden);
    }
  }
  return y;
}

// torch.nn.LSTM(batch_first=True)'s output, one element at a time (gates i, f, g, o), from
// h0 and c0 (xs[1], xs[2]) or zeros; or every step's cell state instead of h.
D lstm_steps_reference(const LSTM& lstm, const std::vector<D>& xs, bool cell_states) {
  const D& x = xs[0];
  const index_t batch = x.shape()[0], length = x.shape()[1], in = x.shape()[2], hidden = lstm.hidden_size();
  D y = duet::zeros<double>(Shape{batch, length, hidden});
  for (index_t b = 0; b < batch; ++b) {
    std::vector<double> h = initial_row(xs, 1, b, hidden), c = initial_row(xs, 2, b, hidden);
    for (index_t t = 0; t < length; ++t) {
      const double* xt = x.data() + (b * length + t) * in;
      // Row k · hidden + j of W_ih x + b_ih + W_hh h + b_hh.
      auto gate = [&](index_t k, index_t j) {
        const index_t r = k * hidden + j;
        double s = lstm.bias_ih_l0.data()[r] + lstm.bias_hh_l0.data()[r];
        for (index_t i = 0; i < in; ++i) s += lstm.weight_ih_l0.data()[r * in + i] * xt[i];
        for (index_t i = 0; i < hidden; ++i) s += lstm.weight_hh_l0.data()[r * hidden + i] * h[static_cast<std::size_t>(i)];
        return s;
      };
      std::vector<double> next(h.size());
      for (index_t j = 0; j < hidden; ++j) {
        const auto u = static_cast<std::size_t>(j);
        const double i = sigmoid(gate(0, j)), f = sigmoid(gate(1, j)), g = std::tanh(gate(2, j)), o = sigmoid(gate(3, j));
        c[u] = f * c[u] + i * g;
        next[u] = o * std::tanh(c[u]);
      }
      h = next;
      const std::vector<double>& kept = cell_states ? c : h;
      std::copy(kept.begin(), kept.end(), y.data() + (b * length + t) * hidden);
    }
  }
  return y;
}

D lstm_reference(const LSTM& lstm, const std::vector<D>& xs) { return lstm_steps_reference(lstm, xs, false); }

template <class Layer>
void add_recurrent_cases(std::multimap<std::string, Case>& m, const std::string& name,
                         D (*reference)(const Layer&, const std::vector<D>&)) {
  // One step, several, and a batch of one, from zeros.
  for (const Shape& shape : {Shape{2, 1, 3}, Shape{2, 4, 3}, Shape{1, 5, 2}}) {
    duet::set_seed(21);
    auto layer = std::make_shared<Layer>(shape[2], 3);
    Case c = case_of<1>({shape}, [layer](const auto& x) { return (*layer)(x); }, -1.5, 1.5);
    c.reference = [layer, reference](const std::vector<D>& xs) { return reference(*layer, xs); };
    m.emplace(name, std::move(c));
  }
  // From initial states, whose gradients the harness checks as the input's.
  for (const Shape& shape : {Shape{2, 1, 3}, Shape{2, 4, 3}}) {
    duet::set_seed(22);
    auto layer = std::make_shared<Layer>(shape[2], 3);
    const Shape state{shape[0], 3};
    Case c = [&] {
      if constexpr (Layer::cell_type::states == 1) {
        return case_of<2>({shape, state}, [layer](const auto& x, const auto& h) { return (*layer)(x, h); }, -1.5, 1.5);
      } else {
        return case_of<3>({shape, state, state},
                          [layer](const auto& x, const auto& h, const auto& c) { return (*layer)(x, h, c); }, -1.5, 1.5);
      }
    }();
    c.reference = [layer, reference](const std::vector<D>& xs) { return reference(*layer, xs); };
    m.emplace(name, std::move(c));
  }
}

const bool recurrent_cases = add_cases([](std::multimap<std::string, Case>& m) {
  add_recurrent_cases<GRU>(m, "GRU", gru_reference);
  add_recurrent_cases<LSTM>(m, "LSTM", lstm_reference);
  // An LSTM's cell states: the output's gradient reaches c instead of h.
  duet::set_seed(23);
  auto lstm = std::make_shared<LSTM>(3, 3);
  Case zero = case_of<1>({Shape{2, 4, 3}}, [lstm](const auto& x) { return lstm->cell_states(x); }, -1.5, 1.5);
  zero.reference = [lstm](const std::vector<D>& xs) { return lstm_steps_reference(*lstm, xs, true); };
  m.emplace("LSTM", std::move(zero));
  Case given = case_of<3>({Shape{2, 4, 3}, Shape{2, 3}, Shape{2, 3}},
                          [lstm](const auto& x, const auto& h, const auto& c) { return lstm->cell_states(x, h, c); }, -1.5, 1.5);
  given.reference = [lstm](const std::vector<D>& xs) { return lstm_steps_reference(*lstm, xs, true); };
  m.emplace("LSTM", std::move(given));
});

// The layers as types, for the cases run on both.
struct GRUs {
  template <index_t Input, index_t Hidden, class T>
  using layer = duet::nn::GRU<Input, Hidden, T>;
};
struct LSTMs {
  template <index_t Input, index_t Hidden, class T>
  using layer = duet::nn::LSTM<Input, Hidden, T>;
};

template <class Wrapped>
struct Tagger : duet::nn::Cell<Tagger<Wrapped>, duet::CONTEXT_MODE, double> {
  typename Wrapped::template layer<3, 4, double> rnn;
  duet::nn::Dense<4, 2, double> head;
  DUET_CELL_MEMBERS(rnn, head);
  auto construct(auto x) { return head(rnn(x)); }
};

template <class Wrapped>
struct Twice : duet::nn::Cell<Twice<Wrapped>, duet::CONTEXT_MODE, double> {
  typename Wrapped::template layer<2, 2, double> rnn;
  DUET_CELL_MEMBERS(rnn);
  auto construct(auto x) { return rnn(x) + rnn(x * 2.0); }
};

template <class Wrapped>
struct Summer : duet::nn::Cell<Summer<Wrapped>> {
  typename Wrapped::template layer<2, 8, float> rnn;
  duet::nn::Dense<8, 1> head;
  DUET_CELL_MEMBERS(rnn, head);
  auto construct(auto x) { return head(rnn(x)); }
};

// Learned initial states: parameters [batch, hidden] given to the layer, so that their
// gradients, and W_hh's from the first step, are checked against finite differences too.
struct SeededGRU : duet::nn::Cell<SeededGRU, duet::CONTEXT_MODE, double> {
  duet::nn::GRU<3, 4, double> rnn;
  duet::nn::BasicParameter<double> h0{random_input({2, 4}, -1, 1, 31)};
  duet::nn::Dense<4, 2, double> head;
  DUET_CELL_MEMBERS(rnn, h0, head);
  auto construct(auto x) { return head(rnn(x, h0)); }
};
struct SeededLSTM : duet::nn::Cell<SeededLSTM, duet::CONTEXT_MODE, double> {
  duet::nn::LSTM<3, 4, double> rnn;
  duet::nn::BasicParameter<double> h0{random_input({2, 4}, -1, 1, 31)};
  duet::nn::BasicParameter<double> c0{random_input({2, 4}, -1, 1, 32)};
  duet::nn::Dense<4, 2, double> head;
  DUET_CELL_MEMBERS(rnn, h0, c0, head);
  auto construct(auto x) { return head(rnn(x, h0, c0)); }
};

}  // namespace
}  // namespace tests_nn_recurrent

// The template cases' names: "<nn::GRU>", not "<tests_nn_recurrent::{anonymous}::GRUs>".
TYPE_TO_STRING_AS("nn::GRU", tests_nn_recurrent::GRUs);
TYPE_TO_STRING_AS("nn::LSTM", tests_nn_recurrent::LSTMs);
TYPE_TO_STRING_AS("nn::GRU", tests_nn_recurrent::SeededGRU);
TYPE_TO_STRING_AS("nn::LSTM", tests_nn_recurrent::SeededLSTM);

namespace tests_nn_recurrent {

TEST_CASE_TEMPLATE("initial states: the layer's and the states' gradients match finite differences, the same bits in both modes",
                   Net, SeededGRU, SeededLSTM) {
  duet::set_seed(4);
  Net net;
  duet::nn::BasicMSELoss<duet::Reduction::mean, double> loss;
  const D x = random_input({2, 5, 3}, -1, 1, 9);
  const D target = random_input({2, 5, 2}, -1, 1, 10);
  check_parameter_grads(net, loss, x, target);
}

TEST_CASE_TEMPLATE_DEFINE("a recurrent layer's parameters' gradients match finite differences, the same bits in both modes",
                          Wrapped, recurrent_parameter_grads) {
  duet::set_seed(4);
  Tagger<Wrapped> net;
  duet::nn::BasicMSELoss<duet::Reduction::mean, double> loss;
  const D x = random_input({2, 5, 3}, -1, 1, 9);
  const D target = random_input({2, 5, 2}, -1, 1, 10);
  const auto params = net.parameters();
  REQUIRE(params.size() == 6);
  CHECK(params[0].name == "rnn.weight_ih_l0");
  CHECK(params[1].name == "rnn.weight_hh_l0");
  CHECK(params[2].name == "rnn.bias_ih_l0");
  CHECK(params[3].name == "rnn.bias_hh_l0");
  check_parameter_grads(net, loss, x, target);
}

TEST_CASE_TEMPLATE_DEFINE("a recurrent layer called twice in one step accumulates its gradients", Wrapped, recurrent_twice) {
  duet_test::ModeGuard guard;
  duet::set_seed(6);
  Twice<Wrapped> net;
  duet::nn::BasicMSELoss<duet::Reduction::sum, double> loss;
  const D x = random_input({1, 3, 2}, -1, 1, 11);
  const D target = random_input({1, 3, 2}, -1, 1, 12);
  check_parameter_grads(net, loss, x, target);
}

TEST_CASE_TEMPLATE_DEFINE("a recurrent layer trains in both modes along the same curve, over sequences of any length",
                          Wrapped, recurrent_training) {
  duet_test::ModeGuard guard;
  std::vector<std::vector<float>> curves;
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::set_seed(3);
    Summer<Wrapped> net;
    duet::nn::MSELoss<> loss;
    duet::nn::WithLossCell with_loss(net, loss);
    duet::nn::Adam adam(net.parameters(), {.learning_rate = 0.02});
    duet::nn::TrainOneStepCell step(with_loss, adam);
    // The running sum of the first feature: learnable only by carrying state along the sequence.
    std::vector<float> curve;
    for (int i = 0; i < 60; ++i) {
      const index_t length = 3 + i % 4;
      const duet::Tensor x = duet::uniform(Shape{8, length, 2}, -1.0f, 1.0f, static_cast<std::uint64_t>(100 + i));
      duet::Tensor y(Shape{8, length, 1});
      for (index_t b = 0; b < 8; ++b) {
        float sum = 0;
        for (index_t t = 0; t < length; ++t) y(b, t, 0) = sum += x(b, t, 0) * 0.5f;
      }
      curve.push_back(step(x, y).item());
    }
    CHECK(curve.back() < 0.2f * curve.front());
    curves.push_back(curve);
  }
  CHECK(curves[0] == curves[1]);
}

TEST_CASE_TEMPLATE_INVOKE(recurrent_parameter_grads, GRUs, LSTMs);
TEST_CASE_TEMPLATE_INVOKE(recurrent_twice, GRUs, LSTMs);
TEST_CASE_TEMPLATE_INVOKE(recurrent_training, GRUs, LSTMs);

namespace {
// x[:, from:to] of a [B, L, F] tensor, and y[:, -1] of one.
D steps(const D& x, index_t from, index_t to) {
  const index_t batch = x.shape()[0], length = x.shape()[1], features = x.shape()[2];
  D out = duet::zeros<double>(Shape{batch, to - from, features});
  for (index_t b = 0; b < batch; ++b) {
    std::copy_n(x.data() + (b * length + from) * features, (to - from) * features, out.data() + b * (to - from) * features);
  }
  return out;
}
D last_step(const D& y) {
  const D step = steps(y, y.shape()[1] - 1, y.shape()[1]);
  return D(Shape{y.shape()[0], y.shape()[2]}, std::span<const double>(step.data(), static_cast<std::size_t>(step.numel())));
}
}  // namespace

TEST_CASE("a sequence run in two chunks, the state carried from one to the next, gives the whole run's outputs") {
  duet_test::ModeGuard guard;
  const D x = random_input({2, 7, 3}, -1, 1, 41);
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    duet::set_seed(7);
    duet::nn::GRU<3, 4, double> gru;
    duet::nn::LSTM<3, 4, double> lstm;
    const D gru_whole = gru(x);
    const D gru_first = gru(steps(x, 0, 4));
    const D gru_rest = gru(steps(x, 4, 7), last_step(gru_first));
    const D lstm_whole = lstm(x);
    const D lstm_first = lstm(steps(x, 0, 4));
    const D lstm_first_c = lstm.cell_states(steps(x, 0, 4));
    const D lstm_rest = lstm(steps(x, 4, 7), last_step(lstm_first), last_step(lstm_first_c));
    const D gru_tail = steps(gru_whole, 4, 7);
    const D lstm_tail = steps(lstm_whole, 4, 7);
    for (index_t i = 0; i < gru_rest.numel(); ++i) {
      CHECK(gru_rest.data()[i] == doctest::Approx(gru_tail.data()[i]).epsilon(1e-14));
      CHECK(lstm_rest.data()[i] == doctest::Approx(lstm_tail.data()[i]).epsilon(1e-14));
    }
  }
}

TEST_CASE("nn::GRU, nn::LSTM: sizes, PyTorch's initial bound, and shape errors in both modes") {
  duet_test::ModeGuard guard;
  duet::nn::GRU<4, 5> fixed;
  duet::nn::GRU<> sized(4, 5);
  CHECK(fixed.weight_ih_l0.shape() == Shape{15, 4});
  CHECK(fixed.weight_hh_l0.shape() == Shape{15, 5});
  CHECK(sized.bias_hh_l0.shape() == Shape{15});
  duet::nn::LSTM<4, 5> lstm;
  CHECK(lstm.weight_ih_l0.shape() == Shape{20, 4});
  CHECK(lstm.weight_hh_l0.shape() == Shape{20, 5});
  CHECK(lstm.type_name() == "nn::LSTM<4, 5>");
  const float bound = 1 / std::sqrt(5.0f);
  for (const auto& p : sized.parameters()) {
    for (const float v : p.parameter->values()) CHECK(std::abs(v) <= bound);
  }
  CHECK_THROWS_AS((duet::nn::GRU<4, 5>(3, 5)), duet::ValueError);
  CHECK_THROWS_AS(duet::nn::GRU<>(4, 0), duet::ValueError);
  for (const duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    CAPTURE(mode);
    duet::set_context({.mode = mode});
    CHECK(sized(duet::ones({2, 7, 4})).shape() == Shape{2, 7, 5});
    CHECK_THROWS_WITH_AS(sized(duet::ones({2, 7, 3})), doctest::Contains("nn::GRU<dyn, dyn>"), duet::ShapeError);
    CHECK_THROWS_WITH_AS(sized(duet::ones({7, 4})), doctest::Contains("rank"), duet::ShapeError);
    CHECK(lstm(duet::ones({3, 2, 4})).shape() == Shape{3, 2, 5});
    CHECK_THROWS_WITH_AS(lstm(duet::ones({3, 2, 5})), doctest::Contains("nn::LSTM<4, 5>"), duet::ShapeError);
    CHECK(sized(duet::ones({2, 7, 4}), duet::zeros({2, 5})).shape() == Shape{2, 7, 5});
    CHECK_THROWS_WITH_AS(sized(duet::ones({2, 7, 4}), duet::zeros({3, 5})),
                         doctest::Contains("expects an initial state [batch, 5] for sequences [batch, length, input], got "
                                           "[3, 5] for [2, 7, 4]"),
                         duet::ShapeError);
    CHECK_THROWS_WITH_AS(lstm(duet::ones({3, 2, 4}), duet::zeros({3, 5}), duet::zeros({3, 4})),
                         doctest::Contains("got [3, 4] for [3, 2, 4]"), duet::ShapeError);
    // An empty sequence has no last state: refused, as PyTorch does, not an empty output.
    CHECK_THROWS_WITH_AS(sized(duet::ones({2, 0, 4})),
                         doctest::Contains("expects sequences [batch, length, input] of at least one step, got [2, 0, 4]"),
                         duet::ShapeError);
    CHECK_THROWS_WITH_AS(lstm.cell_states(duet::ones({3, 0, 4})), doctest::Contains("nn::LSTM<4, 5>"), duet::ShapeError);
  }
}

}  // namespace tests_nn_recurrent
