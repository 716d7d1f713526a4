// The run-time ids of captured nodes (graph.hpp, Sym::ids).
//
// Capture merges two nodes of one type on the same inputs into one (graph::detail::merge_from),
// but the type cannot tell whether they are one value: `wq(x)` and `wk(x)` with wq, wk two
// nn::Dense<64, 64>, or `s * 2` and `s * 3`, have the types of `s` and `s` again. Each node
// therefore carries a run-time id, new for each node append makes, the parameter's own for a
// parameter node, the result's own for an operation on parameters alone (nn::ParameterResult:
// read twice, it is one value), none (0) for graph inputs (which are one value per index). Ids
// are even; a parameter's is its address with the low bit set, so the two never meet.
#pragma once

#include <atomic>
#include <cstdint>

namespace duet::graph {

inline std::uint64_t new_node_id() {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(2, std::memory_order_relaxed) + 2;
}

}  // namespace duet::graph
