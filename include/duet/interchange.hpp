// What an operation is in the vocabulary of ONNX, the format other frameworks read: the
// description io::export_onnx writes, given by the operation itself so that adding an
// operation touches one file. It names ONNX's operators and attributes as plain strings and
// numbers; only io/onnx.hpp turns them into the format, so duet itself needs no ONNX library.
//
// An operation describes itself with an optional member
//
//   Interchange interchange(std::span<const Shape> in) const
//
// given its inputs' shapes: one node, or a short chain (a product over a batch of matrices is
// a Transpose of its weight, then a MatMul). An operation without it is not exported, and
// export_onnx says which one stopped it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "dtype.hpp"

namespace duet::ops {

// An input of a described node: one of the operation's own inputs, a parameter of its layer
// (the exporter finds its name among the network's parameters), a constant of int64s (a
// Reshape's target shape), a number in the network's element type (x * 0.5: written as a
// Constant node, which a reader does not take for a parameter to train), or the value an
// earlier node of the same description makes; or none, an optional input left out before one
// that is given (ONNX's empty name).
// ONNX's numbers for the element types (TensorProto.DataType, fixed by the format), and for
// the bool its comparisons make and Where reads, which duet holds as uint8.
constexpr std::int64_t onnx_type_code(DType t) {
  switch (t) {
    case DType::float32: return 1;
    case DType::uint8: return 2;
    case DType::int32: return 6;
    case DType::int64: return 7;
    case DType::float64: return 11;
  }
  return 0;
}
inline constexpr std::int64_t onnx_bool_code = 9;

struct InterchangeInput {
  enum class Kind : unsigned char { input, parameter, int64s, real, earlier, absent };
  Kind kind = Kind::input;
  std::size_t index = 0;            // Kind::input: which input; Kind::earlier: which node
  const void* parameter = nullptr;  // Kind::parameter: the BasicParameter<T>, T the network's
  std::vector<std::int64_t> int64s;
  double real = 0;
  bool scalar = false;  // Kind::int64s: one int64 of rank 0 (Range's bounds), not a list
  std::optional<DType> number_type{};  // Kind::real: in this type, not the network's

  static InterchangeInput operand(std::size_t k) { return {Kind::input, k, nullptr, {}}; }
  static InterchangeInput of_parameter(const void* p) { return {Kind::parameter, 0, p, {}}; }
  static InterchangeInput constant(std::vector<std::int64_t> values) {
    return {Kind::int64s, 0, nullptr, std::move(values)};
  }
  static InterchangeInput integer(std::int64_t v) { return {Kind::int64s, 0, nullptr, {v}, 0, true}; }
  static InterchangeInput number(double v) { return {Kind::real, 0, nullptr, {}, v}; }
  // A number compared with integers (token ids == 0) or selected into them: of their type.
  static InterchangeInput number_of(double v, DType type) { return {Kind::real, 0, nullptr, {}, v, false, type}; }
  static InterchangeInput node(std::size_t k) { return {Kind::earlier, k, nullptr, {}}; }
  static InterchangeInput absent() { return {Kind::absent, 0, nullptr, {}}; }
};

struct InterchangeAttribute {
  enum class Kind : unsigned char { integer, real, integers, text };
  std::string name;
  Kind kind = Kind::integer;
  std::int64_t integer = 0;
  float real = 0;
  std::vector<std::int64_t> integers;
  std::string text;

  static InterchangeAttribute of(std::string n, std::int64_t v) { return {std::move(n), Kind::integer, v, 0, {}, {}}; }
  static InterchangeAttribute of_real(std::string n, double v) {
    return {std::move(n), Kind::real, 0, static_cast<float>(v), {}, {}};
  }
  static InterchangeAttribute of(std::string n, std::vector<std::int64_t> v) {
    return {std::move(n), Kind::integers, 0, 0, std::move(v), {}};
  }
  static InterchangeAttribute of_text(std::string n, std::string v) {
    return {std::move(n), Kind::text, 0, 0, {}, std::move(v)};
  }
};

struct InterchangeNode {
  std::string op_type;  // ONNX's operator ("Gemm", "Conv", "Relu")
  std::vector<InterchangeInput> inputs;
  std::vector<InterchangeAttribute> attributes;
};

// The operation's nodes in order; the last one's value is the operation's.
using Interchange = std::vector<InterchangeNode>;

// A description used as one part of a longer one (an elementwise function in a fused chain):
// its operand 0 becomes `in`, and its nodes' references to each other move past the `base`
// nodes already written.
DUET_DETAIL_COMPILED void append_interchange(Interchange& to, Interchange part, const InterchangeInput& in);

}  // namespace duet::ops

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/interchange_impl.hpp"
#endif
