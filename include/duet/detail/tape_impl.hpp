// The definitions of tape.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::autodiff {

DUET_DETAIL_COMPILED std::vector<std::size_t> Tape::backward_order(std::size_t from) const {
  std::vector<std::size_t> order;
  if (has_cell_hooks_) {
    for (std::size_t i = entries_.size(); i-- > 0;) order.push_back(i);
    return order;
  }
  // Each record's inputs, in one array: record i reads inputs[begin[i]] to inputs[begin[i + 1]].
  std::vector<std::size_t> inputs;
  std::vector<std::size_t> begin(entries_.size() + 1, 0);
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    begin[i] = inputs.size();
    entries_[i]->append_inputs(*this, inputs);
  }
  begin[entries_.size()] = inputs.size();
  std::vector<bool> visited(entries_.size(), false);
  // (record, its next input to visit): a loop, not recursion, for deep networks' long chains.
  std::vector<std::pair<std::size_t, std::size_t>> stack{{from, begin[from]}};
  visited[from] = true;
  while (!stack.empty()) {
    auto& [record, next] = stack.back();
    if (next == begin[record + 1]) {
      order.push_back(record);
      stack.pop_back();
      continue;
    }
    const std::size_t input = inputs[next++];
    if (!visited[input]) {
      visited[input] = true;
      stack.emplace_back(input, begin[input]);
    }
  }
  std::reverse(order.begin(), order.end());
  return order;
}

}  // namespace duet::autodiff
