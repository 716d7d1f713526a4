// The definitions of pijit.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::pijit {

DUET_DETAIL_COMPILED std::unique_ptr<Step> EpilogueChain::append(std::unique_ptr<Step> head,
                                                                 std::unique_ptr<Step> next) {
  auto* chain = dynamic_cast<EpilogueChain*>(head.get());
  if (chain == nullptr) {
    auto made = std::make_unique<EpilogueChain>(std::move(head), std::vector<std::shared_ptr<Step>>{});
    chain = made.get();
    head = std::move(made);
  }
  chain->tail_.push_back(std::move(next));
  chain->write_to(chain->tail_.back()->output);
  return head;
}

DUET_DETAIL_COMPILED EpilogueChain::EpilogueChain(std::unique_ptr<Step> head, std::vector<std::shared_ptr<Step>> tail)
    : head_(std::move(head)), tail_(std::move(tail)) {
  inputs = head_->inputs;
  where = head_->where;
  write_to(tail_.empty() ? head_->output : tail_.back()->output);
}

DUET_DETAIL_COMPILED void EpilogueChain::run(void* const* data, const std::vector<Value>& values) const {
  head_->run(data, values);
  for (const auto& t : tail_) t->run(data, values);
}

DUET_DETAIL_COMPILED std::unique_ptr<Step> EpilogueChain::with_packed_weight() const {
  auto packed = head_->with_packed_weight();
  if (packed == nullptr) return nullptr;
  return std::make_unique<EpilogueChain>(std::move(packed), tail_);
}

DUET_DETAIL_COMPILED std::string EpilogueChain::op_name() const {
  std::string name = head_->op_name();
  for (const auto& t : tail_) name += " + " + t->op_name();
  return name;
}

DUET_DETAIL_COMPILED Replay::Replay(Trace trace, std::size_t output, JitLevel level, std::string debug_name)
    : values_(std::move(trace.values())),
      steps_(std::move(trace.steps())),
      cells_(std::move(trace.cells())),
      output_(output),
      traced_steps_(steps_.size()),
      debug_name_(std::move(debug_name)) {
  if (level != JitLevel::O0) fuse();
  // A trace that trains writes its weights between calls: packing them would be one more
  // pass over each weight per call (graph mode's passes skip training graphs too).
  if (level != JitLevel::O0 && !trace.differentiates()) pack_weights();
  layout();
}

DUET_DETAIL_COMPILED std::string Replay::step_names() const {
  std::string names;
  for (const auto& step : steps_) names += (names.empty() ? "" : "; ") + step->op_name();
  return names;
}

DUET_DETAIL_COMPILED bool Replay::cells_have_hooks() const {
  if (duet::detail::live_hook_count().load(std::memory_order_relaxed) == 0) return false;
  return std::any_of(cells_.begin(), cells_.end(), [](const auto& has_hooks) { return has_hooks(); });
}

DUET_DETAIL_COMPILED void Replay::fuse() {
  std::vector<std::size_t> readers(values_.size(), 0);
  for (const auto& s : steps_) {
    for (std::size_t v : s->inputs) ++readers[v];
  }
  ++readers[output_];
  std::vector<std::unique_ptr<Step>> fused;
  for (auto& step : steps_) {
    if (!fused.empty()) {
      const Step& last = *fused.back();
      if (step->inputs.size() == 1 && step->inputs[0] == last.output && readers[last.output] == 1) {
        const EpilogueRole role = step->as_epilogue();
        if (auto merged = last.absorb(role, step->output)) {
          fused.back() = std::move(merged);
          continue;
        }
        if (role.kind == EpilogueRole::Kind::functions && last.takes_functions(role.parameterless)) {
          fused.back() = EpilogueChain::append(std::move(fused.back()), std::move(step));
          continue;
        }
      }
    }
    fused.push_back(std::move(step));
  }
  steps_ = std::move(fused);
}

DUET_DETAIL_COMPILED void Replay::pack_weights() {
  for (auto& step : steps_) {
    if (auto packed = step->with_packed_weight()) step = std::move(packed);
  }
}

DUET_DETAIL_COMPILED void Replay::layout() {
  output_root_ = output_;
  while (values_[output_root_].kind == Value::Kind::view) output_root_ = values_[output_root_].view_of;
  if (values_[output_root_].kind != Value::Kind::computed) {
    throw ModeError("duet::jit (PIJit): the traced function returns one of its inputs or constants");
  }
  std::vector<std::size_t> last_read(values_.size(), 0);
  std::vector<bool> made(values_.size(), false);
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    for (std::size_t v : steps_[i]->inputs) last_read[root(v)] = i;
    made[steps_[i]->output] = true;
  }
  offset_.assign(values_.size(), 0);
  struct Slot {
    std::size_t bytes = 0;
    std::size_t owner = 0;
    bool busy = false;
  };
  std::vector<Slot> slots;
  std::vector<std::size_t> slot_of(values_.size(), 0);
  for (std::size_t i = 0; i < steps_.size(); ++i) {
    for (Slot& s : slots) {
      if (s.busy && last_read[s.owner] < i) s.busy = false;
    }
    const std::size_t v = steps_[i]->output;
    if (values_[v].kind != Value::Kind::computed || v == output_root_) continue;
    const std::size_t bytes = static_cast<std::size_t>(values_[v].shape.numel()) * values_[v].element_size;
    auto free_slot = std::find_if(slots.begin(), slots.end(), [](const Slot& s) { return !s.busy; });
    if (free_slot == slots.end()) free_slot = slots.insert(slots.end(), Slot{});
    free_slot->bytes = std::max(free_slot->bytes, bytes);
    free_slot->owner = v;
    free_slot->busy = true;
    slot_of[v] = static_cast<std::size_t>(free_slot - slots.begin());
  }
  std::vector<std::size_t> slot_offset(slots.size(), 0);
  for (std::size_t s = 0; s < slots.size(); ++s) {
    slot_offset[s] = arena_bytes_;
    arena_bytes_ += (slots[s].bytes + duet::detail::block_alignment - 1) / duet::detail::block_alignment *
                    duet::detail::block_alignment;
  }
  for (std::size_t v = 0; v < values_.size(); ++v) {
    // The output root lives in the result, not in a slot (none may exist when it is viewed).
    if (made[v] && values_[v].kind == Value::Kind::computed && v != output_root_) {
      offset_[v] = slot_offset[slot_of[v]];
    }
  }
}

DUET_DETAIL_COMPILED void Replay::check_step(std::size_t i, void* const* data) const {
  const Step& step = *steps_[i];
  const Value& value = values_[step.output];
  const auto context = [&] {
    return "duet (debug): in " + debug_name_ + ", replayed step " + std::to_string(i) + " (" + step.op_name() + "): ";
  };
  if (value.dtype == DType::float32) {
    duet::detail::check_finite(static_cast<const float*>(data[step.output]), value.shape, context());
  } else if (value.dtype == DType::float64) {
    duet::detail::check_finite(static_cast<const double*>(data[step.output]), value.shape, context());
  }
}

}  // namespace duet::pijit
