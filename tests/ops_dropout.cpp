// Dropout (include/duet/nn/dropout.hpp): its case in the gradient harness, the mask against the
// documented draw (the layer's generator, one float per element in row-major order), the same
// masks in both modes, the identity in evaluation, exact gradients at zero inputs, and errors.
#include "ops_harness.hpp"

namespace tests_ops_dropout {

namespace {

using namespace duet_test::ops;
using duet::index_t;

// What the header documents: element i is kept when the layer's i-th draw is at least p, and
// a kept element is scaled by 1 / (1 - p).
D dropout_reference(const D& x, double p, std::uint64_t seed) {
  duet::Generator gen(seed);
  D y = duet::zeros<double>(x.shape());
  for (index_t i = 0; i < x.numel(); ++i) {
    if (gen.uniform01<float>() >= static_cast<float>(p)) y.data()[i] = x.data()[i] / (1.0 - static_cast<float>(p));
  }
  return y;
}

const bool dropout_cases = add_cases([](std::multimap<std::string, Case>& m) {
  for (double p : {0.3, 0.7}) {
    auto drop = std::make_shared<duet::nn::BasicDropout<double>>(p);
    drop->set_train();
    // Each call restarts the masks, so that every evaluation of the function (finite
    // differences, both modes) drops the same elements.
    Case c = case_of<1>({{4, 5}}, [drop](const auto& x) {
      drop->reseed(17);
      return (*drop)(x);
    }, -2.0, 2.0);
    c.reference = [p](const std::vector<D>& xs) { return dropout_reference(xs[0], p, 17); };
    m.emplace("Dropout", std::move(c));
  }
});

template <auto Setting>
struct Dropped : duet::nn::Cell<Dropped<Setting>, Setting> {
  duet::nn::Dense<6, 6> fc;
  duet::nn::Dropout drop{0.5};
  DUET_CELL_MEMBERS(fc, drop);
  auto construct(auto x) { return drop(fc(x)); }
};

std::vector<float> values(const duet::Tensor& t) { return {t.data(), t.data() + t.numel()}; }

}  // namespace

TEST_CASE("nn::Dropout: seeded masks, the same in both modes call after call, the identity in evaluation") {
  duet_test::ModeGuard guard;
  const duet::Tensor x = duet::uniform(Shape{5, 6}, -1.0f, 1.0f, std::uint64_t{30});
  std::vector<std::vector<std::vector<float>>> outputs;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    duet::set_seed(31);
    Dropped<duet::CONTEXT_MODE> net;
    net.set_train();
    std::vector<std::vector<float>> calls;
    for (int i = 0; i < 3; ++i) calls.push_back(values(net(x)));
    CHECK(calls[0] != calls[1]);  // a new mask per call
    // Half the elements or so are dropped, the others scaled by 2.
    net.set_train(false);
    const duet::Tensor h = net.fc(x);
    const std::vector<float> identity = values(net(x));
    CHECK(identity == values(h));
    int dropped = 0;
    for (std::size_t i = 0; i < calls[0].size(); ++i) {
      if (calls[0][i] == 0.0f) ++dropped;
      else CHECK(calls[0][i] == h.data()[i] * 2.0f);
    }
    CHECK((dropped > 5 && dropped < 25));
    outputs.push_back(calls);
  }
  CHECK(outputs[0] == outputs[1]);
}

TEST_CASE("nn::Dropout: the gradient is exact at zero inputs, kept or dropped, in both modes") {
  duet_test::ModeGuard guard;
  duet::nn::Dropout drop(0.5);
  drop.set_train();
  duet::Tensor x({4, 8});
  for (index_t i = 0; i < x.numel(); ++i) x.data()[i] = i % 3 == 0 ? 0.0f : (i % 3 == 1 ? -0.0f : 1.5f);
  const duet::Tensor w = duet::uniform(Shape{4, 8}, 0.5f, 1.0f, std::uint64_t{40});
  auto loss = [&](const auto& in, const auto& weights) { return drop(in) * weights; };
  std::vector<std::vector<float>> grads;
  for (duet::Mode mode : {duet::PYNATIVE_MODE, duet::GRAPH_MODE}) {
    duet::set_context({.mode = mode});
    drop.reseed(41);
    grads.push_back(values(duet::value_and_grad(loss, 0)(x, w).grads[0]));
  }
  CHECK(grads[0] == grads[1]);
  // The mask the layer drew, from the same seed: the gradient is w · 2 where kept, 0 elsewhere.
  duet::Generator gen(41);
  int kept_zeros = 0;
  int dropped_zeros = 0;
  for (index_t i = 0; i < x.numel(); ++i) {
    const bool kept = gen.uniform01<float>() >= 0.5f;
    CHECK(grads[0][static_cast<std::size_t>(i)] == (kept ? w.data()[i] * 2.0f : 0.0f));
    if (x.data()[i] == 0.0f) (kept ? kept_zeros : dropped_zeros) += 1;
  }
  CHECK((kept_zeros > 0 && dropped_zeros > 0));  // both kinds of zero met
}

TEST_CASE("nn::Dropout: MindSpore 2's p, errors") {
  CHECK(duet::nn::Dropout().p() == 0.5f);
  CHECK(duet::nn::Dropout(0.2).p() == 0.2f);
  CHECK(duet::nn::Dropout().type_name() == "nn::Dropout");
  CHECK_THROWS_WITH_AS(duet::nn::Dropout(1.0),
                       "nn::Dropout: p, the probability of dropping an element, must be in [0, 1), got 1.000000",
                       duet::ValueError);
  CHECK_THROWS_AS(duet::nn::Dropout(-0.1), duet::ValueError);
  // p = 0 keeps everything, unscaled.
  duet::nn::Dropout none(0.0);
  none.set_train();
  const duet::Tensor x = duet::uniform(Shape{3, 3}, -1.0f, 1.0f, std::uint64_t{50});
  CHECK(values(none(x)) == values(x));
}

}  // namespace tests_ops_dropout
