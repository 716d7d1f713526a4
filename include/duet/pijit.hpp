// PIJit: jit for networks built at run time. The first call with given input shapes runs the
// function eagerly under a trace (trace.hpp); the trace is then optimised as the jit level
// says, as graph mode's passes do (O1: each op takes the ops after it as its epilogue by its
// own rules, a product its bias into its kernel and then activations, an elementwise op the
// functions after it, and, unless the function trains, products keep their weights packed
// between calls), and planned
// (intermediate values in reused slots of one arena), and later calls replay it: one call per
// step, no virtual cell dispatch, no hooks to look up, no allocation once warm.
//
// What a trace cannot hold is a graph break: a function that makes its result from something
// no duet operation computed runs eagerly on every call instead. Control flow that depends on
// a tensor's value is fixed at the trace; run it through duet::host to keep it live.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "context.hpp"
#include "detail/finite.hpp"
#include "error.hpp"
#include "jit_config.hpp"
#include "memory.hpp"
#include "tensor.hpp"
#include "trace.hpp"

namespace duet::pijit {

// A step and the elementwise steps its op takes as epilogue (Step::takes_functions), run one
// after the other on one buffer: the functions in place on the step's output, so the values in
// between are never stored apart and no slot holds them. Each runs its own kernel, the one
// PyNative runs, so the bits are PyNative's, and graph mode's, whose fused products run such
// functions over their finished output too (backend::Native::dense; ReLU, exact in any layout,
// in registers). It is one class for every op and function: nothing is compiled per pair.
class EpilogueChain final : public Step {
 public:
  // `next` taken into `head` (which may already be a chain); it alone read head's value.
  static std::unique_ptr<Step> append(std::unique_ptr<Step> head, std::unique_ptr<Step> next);

  EpilogueChain(std::unique_ptr<Step> head, std::vector<std::shared_ptr<Step>> tail);

  void run(void* const* data, const std::vector<Value>& values) const override;
  // The fused op takes more functions as the head's op does; a bias only before functions.
  bool takes_functions(bool parameterless) const override { return head_->takes_functions(parameterless); }
  bool rounds_differently() const override { return head_->rounds_differently(); }
  std::unique_ptr<Step> with_packed_weight() const override;
  bool is_view() const override { return false; }
  bool runs_kernel() const override { return true; }
  std::string op_name() const override;
  std::string label() const override { return head_->label(); }

 private:
  // Every part writes value v, the chain's output, and the functions read it.
  void write_to(std::size_t v) {
    output = v;
    head_->output = v;
    for (const auto& t : tail_) t->inputs[0] = t->output = v;
  }

  std::unique_ptr<Step> head_;
  // Shared, so that a chain with its head's weight packed is made without copying steps.
  std::vector<std::shared_ptr<Step>> tail_;
};

// A trace made ready to run again: fused, with its memory laid out. Given the function's name
// for DebugLevel::debug, every step's output is checked for NaN and infinity as it is made,
// as graph mode checks every node's.
class Replay {
 public:
  Replay(Trace trace, std::size_t output, JitLevel level, std::string debug_name = {});

  // The steps it replays, after fusion, as graph_ir prints them.
  std::string describe() const { return pijit::describe(values_, steps_, output_); }

  std::size_t traced_steps() const { return traced_steps_; }
  // Whether a step rounds differently from the trace it replaces (a folded BatchNorm): the
  // replay's results then differ from the traced call's within a tolerance.
  bool rounds_differently() const {
    return std::any_of(steps_.begin(), steps_.end(), [](const auto& step) { return step->rounds_differently(); });
  }
  std::size_t steps() const { return steps_.size(); }

  // The steps a call runs, by name ("MatMul + BiasAdd + GELU(tanh); MatMul + BiasAdd"): what
  // fusion made of the trace, for the compile log.
  std::string step_names() const;

  // Whether a cell the trace went through has a hook now: the replay would skip it, so the
  // caller runs the function eagerly instead and the hook runs.
  bool cells_have_hooks() const;

  // True the first time it is called: the caller says once that it no longer replays this.
  bool set_aside() const { return !set_aside_.exchange(true); }

  // Runs the steps on new inputs of the traced shapes; returns the output value. Every size
  // in the steps is the trace's: inputs of other shapes would be read as if they had those
  // (a batch of 5 answered with one row), so they are refused.
  template <class T>
  BasicTensor<T> run(std::span<const void* const> inputs, std::span<const Shape> shapes) const {
    for (const Value& value : values_) {
      if (value.kind == Value::Kind::input && (value.input >= shapes.size() || shapes[value.input] != value.shape)) {
        throw ShapeError("duet::jit (PIJit): a replay traced with input " + std::to_string(value.input) + " of shape " +
                         to_string(value.shape) + " was given " +
                         (value.input < shapes.size() ? to_string(shapes[value.input]) : std::string("no such input")) +
                         "; a trace replays the shapes it was made with");
      }
    }
    thread_local std::vector<void*> data;
    data.assign(values_.size(), nullptr);
    duet::detail::Storage arena(arena_bytes_);
    auto result = BasicTensor<T>::uninitialized(values_[output_root_].shape);
    for (std::size_t v = 0; v < values_.size(); ++v) {
      const Value& value = values_[v];
      switch (value.kind) {
        case Value::Kind::input: data[v] = const_cast<void*>(inputs[value.input]); break;
        case Value::Kind::constant: data[v] = const_cast<void*>(value.data); break;
        case Value::Kind::view: data[v] = static_cast<char*>(data[value.view_of]) + value.view_bytes; break;
        case Value::Kind::computed:
          data[v] = v == output_root_ ? static_cast<void*>(result.data()) : arena.data() + offset_[v];
          break;
      }
    }
    std::size_t i = 0;
    try {
      for (; i < steps_.size(); ++i) {
        if (!steps_[i]->runs_kernel()) continue;
        steps_[i]->run(data.data(), values_);
        if (!debug_name_.empty()) check_step(i, data.data());
      }
    } catch (const Error&) {
      // Named as the traced call named it (an ONNX node): the handler costs nothing until a step throws.
      if (steps_[i]->where.empty()) throw;
      rethrow_at(steps_[i]->where);
    }
    const Value& out = values_[output_];
    if (out.shape == result.shape()) return result;
    return result.view(static_cast<index_t>(out.kind == Value::Kind::view ? out.view_bytes / sizeof(T) : 0), out.shape);
  }

 private:
  // A unary step becomes part of the step before it when it alone reads that step's value and
  // that step's op takes it as epilogue, by its own rules (graph mode's fuse_epilogues asks the
  // same ones): a product its bias into its kernel, then activations; an elementwise op the
  // functions after it. A training step's trace keeps each value its gradient steps read, since
  // they are readers too, so the rules are those of a graph that is not differentiated.
  void fuse();

  void pack_weights();

  // Computed values get slots of one arena, reused once their last reader has run.
  void layout();

  void check_step(std::size_t i, void* const* data) const;

  std::size_t root(std::size_t v) const {
    while (values_[v].kind == Value::Kind::view) v = values_[v].view_of;
    return v;
  }

  std::vector<Value> values_;
  std::vector<std::unique_ptr<Step>> steps_;
  std::vector<std::function<bool()>> cells_;
  std::size_t output_;
  std::size_t traced_steps_;
  std::size_t output_root_ = 0;
  std::vector<std::size_t> offset_;
  std::size_t arena_bytes_ = 0;
  std::string debug_name_;
  mutable std::atomic<bool> set_aside_{false};
};

}  // namespace duet::pijit

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/pijit_impl.hpp"
#endif
