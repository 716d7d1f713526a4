// The central invariant: the same network, weights and input give the same output in both
// modes, and both agree with an independent naive reference.
#include <boost/hana/range.hpp>
#include <vector>

#include "support.hpp"

namespace tests_equivalence {

using namespace duet;
using duet_test::ModeGuard;
using duet_test::SeedNetwork;

TEST_CASE("the seed network: PyNative, graph and the reference agree on an input of ones") {
  ModeGuard guard;
  SeedNetwork<> net;
  const Tensor x = ones({64, 1, 28, 28});
  set_context({.mode = PYNATIVE_MODE});
  const auto eager = duet_test::values_of(net(x));
  set_context({.mode = GRAPH_MODE});
  const auto graph = duet_test::values_of(net(x));
  const auto reference = duet_test::reference_forward(duet_test::values_of(x), 64, duet_test::layers_of(net));
  CHECK(duet_test::relative_difference(eager, reference) <= 1e-5);
  CHECK(duet_test::relative_difference(graph, reference) <= 1e-5);
  CHECK(duet_test::relative_difference(graph, eager) <= 1e-5);
}

TEST_CASE("the seed network with a static input shape gives a StaticTensor in both modes") {
  ModeGuard guard;
  SeedNetwork<> net;
  const auto x = ones(shape<8, 1, 28, 28>);
  set_context({.mode = PYNATIVE_MODE});
  const auto eager = net(x);
  static_assert(std::is_same_v<decltype(eager), const StaticTensor<float, 8, 10>>);
  set_context({.mode = GRAPH_MODE});
  const auto graph = net(x);
  CHECK(duet_test::relative_difference(duet_test::values_of(graph.tensor()), duet_test::values_of(eager.tensor())) <=
        1e-5);
}

TEST_CASE("modes agree when each is fixed by template argument, across random inputs and batches") {
  SeedNetwork<PYNATIVE_MODE> eager;
  set_seed(0);
  SeedNetwork<GRAPH_MODE> graph;
  set_seed(0);
  SeedNetwork<PYNATIVE_MODE> same_seed;
  CHECK(same_seed.dense_relu_sequential.get<4>().bias(3) == graph.dense_relu_sequential.get<4>().bias(3));
  for (index_t batch : {1, 2, 17, 64, 100}) {
    const Tensor x = randn({batch, 1, 28, 28}, static_cast<std::uint64_t>(batch) + 100);
    const auto a = duet_test::values_of(same_seed(x));
    const auto b = duet_test::values_of(graph(x));
    const auto reference = duet_test::reference_forward(duet_test::values_of(x), batch, duet_test::layers_of(graph));
    CHECK(duet_test::relative_difference(a, reference) <= 1e-5);
    CHECK(duet_test::relative_difference(b, reference) <= 1e-5);
  }
  (void)eager;
}

TEST_CASE("property: random Dense/ReLU stacks, inputs and batch sizes, PyNative against the reference") {
  Generator gen(2024);
  for (int trial = 0; trial < 25; ++trial) {
    const auto depth = 1 + static_cast<int>(gen.next() % 4);
    std::vector<index_t> widths{1 + static_cast<index_t>(gen.next() % 40)};
    for (int d = 0; d < depth; ++d) widths.push_back(1 + static_cast<index_t>(gen.next() % 40));
    const index_t batch = static_cast<index_t>(gen.next() % 9);
    nn::DynamicSequentialCell net;
    std::vector<duet_test::Layer> layers;
    for (int d = 0; d < depth; ++d) {
      auto& dense =
          net.append(nn::Dense<>(widths[static_cast<std::size_t>(d)], widths[static_cast<std::size_t>(d) + 1]));
      const bool relu = d + 1 < depth;
      if (relu) net.append(nn::ReLU{});
      layers.push_back(duet_test::layer_of(dense.weight, dense.bias, relu));
    }
    const Tensor x = randn({batch, widths[0]}, static_cast<std::uint64_t>(trial));
    const auto y = duet_test::values_of(net(x));
    CHECK(duet_test::relative_difference(y, duet_test::reference_forward(duet_test::values_of(x), batch, layers)) <=
          1e-5);
  }
}

// Graph mode needs the structure in the type; the widths may still be random at run time.
template <class Seq>
struct Stack : nn::Cell<Stack<Seq>> {
  Seq layers;
  DUET_CELL_MEMBERS(layers);
  explicit Stack(Seq s) : layers(std::move(s)) {}
  auto construct(auto x) { return layers(x); }
};

template <class... Cells>
void check_modes_agree(Generator& gen, Cells&&... cells) {
  Stack net(nn::SequentialCell(std::forward<Cells>(cells)...));
  std::vector<duet_test::Layer> layers;
  boost::hana::for_each(boost::hana::make_range(boost::hana::size_c<0>, boost::hana::size_c<sizeof...(Cells)>),
                        [&](auto i) {
                          auto& cell = net.layers.template get<decltype(i)::value>();
                          if constexpr (requires { cell.weight; }) {
                            constexpr bool relu = decltype(i)::value + 1 < sizeof...(Cells);
                            layers.push_back(duet_test::layer_of(cell.weight, cell.bias, relu));
                          }
                        });
  const index_t batch = static_cast<index_t>(gen.next() % 70);
  const Tensor x = randn({batch, layers.front().in}, gen.next());
  ModeGuard guard;
  set_context({.mode = PYNATIVE_MODE});
  const auto eager = duet_test::values_of(net(x));
  set_context({.mode = GRAPH_MODE});
  const auto graph = duet_test::values_of(net(x));
  const auto reference = duet_test::reference_forward(duet_test::values_of(x), batch, layers);
  CHECK(duet_test::relative_difference(eager, reference) <= 1e-5);
  CHECK(duet_test::relative_difference(graph, reference) <= 1e-5);
  CHECK(duet_test::relative_difference(graph, eager) <= 1e-5);
}

TEST_CASE("property: random widths and batches through fixed-depth stacks in both modes") {
  Generator gen(7);
  auto width = [&] { return 1 + static_cast<index_t>(gen.next() % 64); };
  for (int trial = 0; trial < 10; ++trial) {
    const index_t a = width(), b = width(), c = width(), d = width();
    check_modes_agree(gen, nn::Dense<>(a, b));
    check_modes_agree(gen, nn::Dense<>(a, b), nn::ReLU{}, nn::Dense<>(b, c));
    check_modes_agree(gen, nn::Dense<>(a, b), nn::ReLU{}, nn::Dense<>(b, c), nn::ReLU{}, nn::Dense<>(c, d));
  }
  check_modes_agree(gen, nn::Dense<4, 4>{}, nn::ReLU{}, nn::Dense<4, 4>{}, nn::ReLU{}, nn::Dense<4, 4>{});
}

}  // namespace tests_equivalence
