// The definitions of diagnostics.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet {

DUET_DETAIL_COMPILED std::string describe_fault(const ShapeResult& r, std::string_view layer,
                                                std::span<const Shape> inputs) {
  const std::string got =
      inputs.empty() ? std::string("nothing") : to_string(inputs[static_cast<std::size_t>(r.input)]);
  const std::string e = std::to_string(r.expected);
  std::string what;
  switch (r.fault) {
    case ShapeFault::none:
      return {};
    case ShapeFault::last_dimension:
      what = "an input whose last dimension is " + e;
      break;
    case ShapeFault::min_rank:
      what = "an input of rank at least " + e;
      break;
    case ShapeFault::exact_rank:
      what = "an input of rank " + e;
      break;
    case ShapeFault::element_count:
      what = "an input of " + e + " elements per sample";
      break;
    case ShapeFault::shapes_differ:
    case ShapeFault::broadcast:
      what = "inputs of the same shape";
      break;
    case ShapeFault::class_labels:
      if (inputs.size() < 2) {
        what = "labels that fit its logits";
        break;
      }
      if (r.expected == 1) {
        Shape rows;
        for (int i = 0; i + 1 < inputs[0].rank(); ++i) rows.push_back(inputs[0][i]);
        return std::string(layer) + " expects class labels of shape " + to_string(rows) + ": the logits' " +
               to_string(inputs[0]) +
               " without the last axis, which holds the classes (PyTorch's [N, C, d...] "
               "logits are [N, d..., C] here), got " +
               to_string(inputs[1]);
      }
      return std::string(layer) + " expects labels of the logits' shape " + to_string(inputs[0]) +
             ", a distribution over the classes (the last axis) per row, got " + to_string(inputs[1]) +
             " (class indices are int32)";
    case ShapeFault::inner_dimensions:
      what = "inputs whose inner dimensions match";
      break;
    case ShapeFault::empty_reduction:
      what = "an input with no empty axis among those it reduces (the maximum of nothing is undefined)";
      break;
    case ShapeFault::batch_dimension:
      return std::string(layer) + " expects an input of rank at least " + e +
             " whose first dimension is the batch, got " + got + ": the batch dimension is missing";
    case ShapeFault::total_elements:
      what = "an input of " + e + " elements";
      break;
    case ShapeFault::elements_multiple:
      what = "an input whose element count is a multiple of " + e;
      break;
    case ShapeFault::axis_not_one:
      what = "an input whose axis " + e + " has size 1";
      break;
    case ShapeFault::sizes_except_axis: {
      std::string all;
      for (const Shape& s : inputs) all += (all.empty() ? "" : ", ") + to_string(s);
      return std::string(layer) + " expects inputs of one rank whose sizes match except along axis " + e + ", got " +
             all;
    }
    case ShapeFault::axis_size:
      what = "an input of size " + e + " along its axis";
      break;
    case ShapeFault::chunk_count:
      what = "an input whose size along its axis cuts into " + e + " pieces of ceil(size / " + e +
             ") elements (PyTorch's chunk makes fewer of it; give the pieces' sizes with ops::split)";
      break;
    case ShapeFault::slice_range:
      what = "an input whose axis " + e + " holds the slice's range";
      break;
    case ShapeFault::broadcast_to:
      what =
          "an input that broadcasts to its shape (numpy's rule: each size equal to the target's or 1, aligned at "
          "the last axis; a -1 keeps a size the input has)";
      break;
    case ShapeFault::axis_twice:
      what = "axes that name each axis of its input once (axis " + e + " is named twice, counted from both ends)";
      break;
    case ShapeFault::spatial_size:
      what = "an input whose spatial axes (after batch and channels) are each at least " + e +
             ", to hold its window less the padding";
      break;
    case ShapeFault::channel_dimension:
      what = "an input whose dimension 1 (channels) is " + e;
      break;
    case ShapeFault::empty_sequence:
      what = "sequences [batch, length, input] of at least one step";
      break;
    case ShapeFault::indices_fit:
      return std::string(layer) +
             " expects indices of its input's rank, no larger than the input along any axis but axis " + e +
             " (torch.gather's rule), got " + got + " for an input of shape " +
             (inputs.empty() ? std::string("nothing") : to_string(inputs[0]));
    case ShapeFault::axis_at_least:
      what = "an input of size at least " + e + " along its axis";
      break;
    case ShapeFault::axis_multiple:
      what = "an input whose size along its axis is a multiple of " + e;
      break;
    case ShapeFault::axes_in_order:
      what = "an input whose end axis does not come before its start axis, axis " + e;
      break;
    case ShapeFault::batch_first_sequences:
      return std::string(layer) + " expects batch-first sequences [batch, length, " + e + "], got " + got +
             " (one sequence [length, " + e + "] is ops::expand_dims<0>(x); PyTorch's default [length, batch, " + e +
             "] is ops::transpose<1, 0, 2>(x))";
    case ShapeFault::key_padding_mask: {
      if (inputs.size() < 2 || inputs[0].rank() != 4) {
        what = "a key padding mask [batch, length] of its input [batch, length, " + e + "]";
        break;
      }
      const Shape& scores = inputs[0];
      return std::string(layer) +
             " expects a key padding mask [batch, length] = " + to_string(Shape{scores[0], scores[3]}) +
             " for its input " + to_string(Shape{scores[0], scores[2], r.expected}) + ", got " + to_string(inputs[1]);
    }
    case ShapeFault::attn_mask: {
      if (inputs.size() < 2 || inputs[0].rank() != 4) {
        what =
            "an attn_mask [length, length] or [batch * heads, length, length] of its input [batch, length, " + e + "]";
        break;
      }
      const Shape& scores = inputs[0];
      const index_t sequences = scores[0] == dyn ? dyn : scores[0] * scores[1];
      return std::string(layer) + " expects an attn_mask [length, length] = " + to_string(Shape{scores[2], scores[3]}) +
             " or [batch * heads, length, length] = " + to_string(Shape{sequences, scores[2], scores[3]}) +
             " for its input " + to_string(Shape{scores[0], scores[2], r.expected}) + ", got " + to_string(inputs[1]);
    }
    case ShapeFault::initial_state:
      return std::string(layer) + " expects an initial state [batch, " + e + "] for sequences [batch, length, " +
             "input], got " + got + " for " + (inputs.empty() ? std::string("nothing") : to_string(inputs[0]));
  }
  if (r.fault == ShapeFault::broadcast && inputs.size() > 1) {
    const std::size_t a = static_cast<std::size_t>(r.input);
    const std::size_t b = broadcast_partner(r);
    return std::string(layer) +
           " expects inputs whose shapes broadcast together (numpy's rule: sizes equal or 1, "
           "aligned at the last axis), got " +
           to_string(inputs[std::min(a, b)]) + " and " + to_string(inputs[std::max(a, b)]);
  }
  if (r.fault == ShapeFault::inner_dimensions && inputs.size() > 1) {
    return std::string(layer) +
           " expects inputs whose inner dimensions match (the columns of the first, the "
           "rows of the second, after their transposes), got " +
           to_string(inputs[0]) + " and " + to_string(inputs[1]);
  }
  if (r.fault == ShapeFault::shapes_differ && inputs.size() > 1) {
    return std::string(layer) + " expects inputs of matching shapes, got " + to_string(inputs[0]) + " and " +
           to_string(inputs[r.input == 0 ? 1 : static_cast<std::size_t>(r.input)]);
  }
  return std::string(layer) + " expects " + what + ", got " + got;
}

}  // namespace duet
