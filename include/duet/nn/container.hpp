// Containers: cells that run other cells in order.
#pragma once

#include <boost/hana/at.hpp>
#include <boost/hana/fold_left.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/tuple.hpp>
#include <concepts>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cell.hpp"

namespace duet::nn {

namespace detail {
// A chain takes the input its first cell takes: nn::Embedding's indices, say.
template <class First>
struct chain_input {};
template <class First>
requires requires { typename First::input_value_type; }
struct chain_input<First> {
  using input_value_type = typename First::input_value_type;
};
}  // namespace detail

// A fixed list of cells, each fed the previous one's output (MindSpore's nn.SequentialCell).
// The list is a hana::tuple: in graph mode the whole chain becomes one flat graph.
template <class First, class... Rest>
class SequentialCell : public Cell<SequentialCell<First, Rest...>, CONTEXT_MODE, typename First::value_type>,
                       public detail::chain_input<First> {
  using T = typename First::value_type;
  static_assert(graph::all_of({std::is_same_v<typename Rest::value_type, T>...}),
                "nn::SequentialCell: all cells must have the same element type");

 public:
  SequentialCell() { check_neighbours(); }
  // Takes cells by forwarding reference so that a named cell is one short error below, not the
  // deleted copy constructors of the cell, its parameters and its compiled forms.
  template <class C, class... Cs>
  requires(sizeof...(Cs) == sizeof...(Rest) && std::constructible_from<First, std::remove_cvref_t<C>> &&
           graph::all_of({std::constructible_from<Rest, std::remove_cvref_t<Cs>>...}))
  explicit SequentialCell(C&& first, Cs&&... rest)
      : cells_(moved_in(std::forward<C>(first)), moved_in(std::forward<Cs>(rest))...) {
    check_neighbours();
  }

  static constexpr std::size_t size() { return 1 + sizeof...(Rest); }

  template <std::size_t I>
  auto& get() {
    return boost::hana::at_c<I>(cells_);
  }

  // A chain whose neighbours do not fit is reported once, by the constructor; captured into a
  // graph, it is captured quietly so that no other shape of its input reports it again.
  template <class X>
  auto construct(X&& x) {
    if constexpr (graph::Symbolic<X> && !neighbours_fit())
      return graph::quietly(x, [this](const auto& q) { return chain(q); });
    else
      return chain(std::forward<X>(x));
  }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    std::size_t i = 0;
    boost::hana::for_each(cells_, [&](auto& cell) { visit(std::to_string(i++), cell); });
  }

  std::string type_name() const override { return "nn::SequentialCell"; }

 private:
  template <class X>
  auto chain(X&& x) {
    if constexpr (graph::Symbolic<X>) {
      return captured_parts(x, std::make_index_sequence<size()>{});
    } else if constexpr (passes_one_tensor<std::remove_cvref_t<X>>()) {
      // One tensor handed on: a fold keeps every cell's result as a temporary of its own,
      // destroyed and unwound one by one, which made it a deep chain's largest function.
      std::remove_cvref_t<X> y = std::forward<X>(x);
      boost::hana::for_each(cells_, [&y](auto& cell) { y = cell(std::as_const(y)); });
      return y;
    } else {
      return boost::hana::fold_left(cells_, std::forward<X>(x),
                                    [](auto&& acc, auto& cell) { return cell(std::forward<decltype(acc)>(acc)); });
    }
  }

  template <std::size_t I>
  using cell_at = std::remove_reference_t<decltype(boost::hana::at_c<I>(std::declval<boost::hana::tuple<First, Rest...>&>()))>;

  // Cell I's result when the chain runs on an X, and whether every cell's is an X (a tensor of
  // the input's type): only the calls the chain makes are named.
  template <class X, std::size_t I>
  struct result_on {
    using before = typename std::conditional_t<I == 0, std::type_identity<X>, result_on<X, I - 1>>::type;
    using type = std::remove_cvref_t<decltype(std::declval<cell_at<I>&>()(std::declval<const before&>()))>;
  };
  template <class X>
  static constexpr bool passes_one_tensor() {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return graph::all_of({std::is_same_v<typename result_on<X, I>::type, X>...});
    }
    (std::make_index_sequence<size()>{});
  }

  // Cell I captured on an input of its own, a continuation of the value before it: part
  // I - 1's output, or x's (X) for the first. Only the type of the part before is needed, so
  // no part's type holds the parts before it. (Types, not functions: a function per cell named
  // after the chain would make the names the compiler mangles grow with the chain's square.)
  template <class X, std::size_t I>
  struct part {
    using before = typename std::conditional_t<I == 0, std::type_identity<X>, part<X, I - 1>>::type;
    using type = decltype(std::declval<cell_at<I>&>()(graph::continuation<before>()));
  };

  // Captures each cell apart and splices the parts after x's graph at the end: each cell
  // appended to the graph so far would copy it, and a chain's capture would cost the square of
  // its length. The parts are a braced list's elements, so they are captured in order.
  template <class X, std::size_t... I>
  auto captured_parts(const X& x, std::index_sequence<I...>) {
    const graph::NodeList<typename part<X, I>::type...> parts{
        std::in_place, boost::hana::at_c<I>(cells_)(graph::continuation<typename part<X, I>::before>())...};
    return graph::spliced(x, graph::get<I>(parts)...);
  }

  // Capturing the chain on an input of unknown shape runs every layer's shape rule against
  // its neighbour's output. Captured quietly and reported from here, incompatible neighbours
  // fail to compile in either mode with a diagnostic that does not reach into the capture.
  static constexpr auto neighbour_rejection() {
    using Probe = decltype(std::declval<SequentialCell&>().chain(graph::input<T, graph::Quiet<graph::AnyShape>>()));
    return std::type_identity<graph::first_rejection<typename Probe::graph_type>>{};
  }
  static constexpr bool neighbours_fit() { return std::is_void_v<typename decltype(neighbour_rejection())::type>; }
  static void check_neighbours() {
    if constexpr (!neighbours_fit()) static_cast<void>(sizeof(typename decltype(neighbour_rejection())::type));
  }

  template <class C>
  static std::remove_reference_t<C>&& moved_in(C&& cell) {
    static_assert(!std::is_lvalue_reference_v<C>,
                  "nn::SequentialCell: cells are not copyable (a copy would train apart from its original); pass "
                  "temporaries, SequentialCell(nn::Dense<4, 8>{}, nn::ReLU{}), or move named cells in: std::move(a)");
    return static_cast<std::remove_reference_t<C>&&>(cell);
  }

  boost::hana::tuple<First, Rest...> cells_;
};

// SequentialCell seq(nn::Dense<4, 8>{}, nn::ReLU{}) holds the cells' own types.
template <class C, class... Cs>
SequentialCell(C&&, Cs&&...) -> SequentialCell<std::remove_cvref_t<C>, std::remove_cvref_t<Cs>...>;

// A list of cells built at run time (sizes and layers from a config file, say). Its structure is
// not known when the program compiles, so graph mode cannot capture it: it traces it on the
// first call instead (PIJit) and replays the trace, and traces again after an append. It takes
// what its first cell takes: tensors of T, or int32 indices when that cell is an nn::Embedding
// (or any cell whose input holds them), net(ids). Every later cell takes the T values its
// neighbour gives, which append checks.
template <ElementType T>
class BasicDynamicSequentialCell : public BasicDynamicCell<T> {
 public:
  BasicDynamicSequentialCell() = default;

  // Adds a cell at the end, taking ownership; returns it.
  template <class C>
  requires std::is_base_of_v<BasicDynamicCell<T>, C> C& append(C cell) {
    return static_cast<C&>(append(std::unique_ptr<BasicDynamicCell<T>>(std::make_unique<C>(std::move(cell)))));
  }
  BasicDynamicCell<T>& append(std::unique_ptr<BasicDynamicCell<T>> cell) {
    if (!cells_.empty() && !cell->other_input_type().empty()) {
      const BasicDynamicCell<T>& before = *cells_.back();
      throw ValueError(type_name() + ": cannot append " + cell->type_name() + " as cell " +
                       std::to_string(cells_.size()) + ": it takes " + std::string(cell->other_input_type()) +
                       " values, and cell " + std::to_string(cells_.size() - 1) + ", " + before.type_name() +
                       ", gives " + std::string(name_of(dtype_of<T>)) +
                       " values (only the first cell may take another element type, such as an nn::Embedding's "
                       "int32 indices)");
    }
    cells_.push_back(std::move(cell));
    this->structure_changed();
    return *cells_.back();
  }

  std::size_t size() const { return cells_.size(); }
  BasicDynamicCell<T>& operator[](std::size_t i) {
    if (i >= cells_.size()) {
      throw IndexError("nn::DynamicSequentialCell: index " + std::to_string(i) + " is out of range for " +
                       std::to_string(cells_.size()) + " cells");
    }
    return *cells_[i];
  }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    for (std::size_t i = 0; i < cells_.size(); ++i) visit(std::to_string(i), *cells_[i]);
  }

  std::string type_name() const override { return "nn::DynamicSequentialCell"; }
  // Its first cell's (nn::Embedding's "Int32"): what its input holds when that is not T.
  std::string_view other_input_type() const override {
    return cells_.empty() ? std::string_view{} : cells_.front()->other_input_type();
  }

 protected:
  BasicTensor<T> forward(const BasicTensor<T>& x) override { return run_from(0, x); }
  BasicTensor<T> forward_ids(const BasicTensor<std::int32_t>& ids) override {
    if (cells_.empty()) return BasicDynamicCell<T>::forward_ids(ids);
    return run_from(1, (*cells_.front())(ids));
  }

 private:
  // The cells from `first` on, each on the one before's output.
  BasicTensor<T> run_from(std::size_t first, const BasicTensor<T>& x) {
    BasicTensor<T> y = x;
    for (std::size_t i = first; i < cells_.size(); ++i) y = (*cells_[i])(y);
    return y;
  }

  std::vector<std::unique_ptr<BasicDynamicCell<T>>> cells_;
};

using DynamicSequentialCell = BasicDynamicSequentialCell<float>;

}  // namespace duet::nn
