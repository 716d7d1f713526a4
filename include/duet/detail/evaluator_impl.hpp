// The definitions of evaluator.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::detail {

DUET_DETAIL_COMPILED std::string node_context(bool debug, const std::string& op_name, std::size_t index,
                                              std::string_view where) {
  if (!debug) return {};
  return "duet (debug): in " + std::string(where) + ", node %" + std::to_string(index) + " (" + op_name + "): ";
}

DUET_DETAIL_COMPILED void infer_shapes(std::span<const PlanNode> nodes, std::span<const Shape> patterns,
                                       std::span<const Shape> input_shapes, std::span<Shape> shapes, bool debug,
                                       std::string_view where) {
  std::vector<Shape> in;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const PlanNode& node = nodes[i];
    if (node.is_input) {
      const Shape& s = input_shapes[node.input];
      if (!graph::fits(patterns[i], s)) {
        throw ShapeError(node_context(debug, node.op_name(), i, where) + "duet: graph input " +
                         std::to_string(node.input) + " must have shape " + to_string(patterns[i]) + ", got " +
                         to_string(s));
      }
      shapes[i] = s;
    } else {
      in.clear();
      for (std::size_t a : node.args) in.push_back(shapes[a]);
      const ShapeResult r = node.infer(node.op, in);
      if (!r.ok()) {
        // In debug the context comes first; else an operation naming no layer says where it is.
        const std::string label = node.label(node.op);
        throw ShapeError(node_context(debug, node.op_name(), i, where) + describe_fault(r, label, in) +
                         (debug || node.names_its_layer ? std::string() : duet::detail::called_in(label, where)));
      }
      shapes[i] = r.shape;
    }
  }
}

DUET_DETAIL_COMPILED std::size_t lay_out_slots(std::span<const graph::Storage> storage,
                                               std::span<const std::size_t> slot, std::size_t slot_count,
                                               std::span<const std::size_t> element_size, std::span<const Shape> shapes,
                                               std::span<std::size_t> offset) {
  std::vector<std::size_t> slot_bytes(slot_count), slot_offset(slot_count);
  for (std::size_t i = 0; i < storage.size(); ++i) {
    if (storage[i] != graph::Storage::slot) continue;
    const auto bytes = static_cast<std::size_t>(shapes[i].numel()) * element_size[i];
    if (bytes > slot_bytes[slot[i]]) slot_bytes[slot[i]] = bytes;
  }
  std::size_t arena_bytes = 0;
  for (std::size_t s = 0; s < slot_count; ++s) {
    slot_offset[s] = arena_bytes;
    arena_bytes += (slot_bytes[s] + block_alignment - 1) / block_alignment * block_alignment;
  }
  for (std::size_t i = 0; i < storage.size(); ++i) offset[i] = slot_count == 0 ? 0 : slot_offset[slot[i]];
  return arena_bytes;
}

}  // namespace duet::detail
