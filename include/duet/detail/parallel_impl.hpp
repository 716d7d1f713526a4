// The definitions of parallel.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::detail {

DUET_DETAIL_COMPILED void require_sharded_data(DataParallelRuntime& runtime, std::uint64_t hash, bool telling,
                                               std::string_view who, std::string_view what) {
  if (runtime.group_size() == 1) return;
  if (runtime.same_on_every_rank(hash, Stream::steps) && telling) {
    throw ValueError(std::string(who) + ": " + std::string(what) + " the same on all " +
                     std::to_string(runtime.group_size()) +
                     " ranks, so each would train on the same data; shard the loader: data::DataLoader(dataset, "
                     "batch, {.num_shards = duet::distributed::get_group_size(), .shard_id = "
                     "duet::distributed::get_rank()})");
  }
  const std::uint64_t order = data::detail::served_order().load(std::memory_order_relaxed);
  // Shuffled with a seed per rank, unsharded loaders serve first batches that differ, and each
  // rank trains on the whole data set (helper-92: in silence). Ranks may hold data sets of
  // their own, which no check here can tell from copies of one: it is said, not refused.
  static std::atomic<bool> warned{false};
  if (order == data::detail::unsharded_order && !warned.exchange(true)) {
    std::cerr << "duet: warning: rank " << runtime.rank() << " of " << runtime.group_size() << ": " << who
              << ": the batch came from a loader that is not sharded (num_shards = 1): unless each rank's data set "
                 "is its own part of the data, every rank trains on all of it; shard the loader: data::DataLoader("
                 "dataset, batch, {.num_shards = duet::distributed::get_group_size(), .shard_id = "
                 "duet::distributed::get_rank()})\n";
  }
  if (runtime.same_on_every_rank(order, Stream::steps)) return;
  throw ValueError(std::string(who) +
                   ": the ranks' sharded loaders serve different epoch orders (their .seed, .shuffle, epoch, data "
                   "set, batch size or .num_shards differ), so the shards overlap and leave samples out while each "
                   "rank's batches still differ; make the loaders alike on every rank, .shard_id apart, and start "
                   "the same epoch everywhere");
}

DUET_DETAIL_COMPILED std::vector<double> step_values(std::span<const float> loss,
                                                     const std::vector<nn::Parameter*>& buffers,
                                                     const BatchShare& share, bool weighted) {
  const double loss_weight = share.summed ? 1.0 : share.counted_rows;
  std::vector<double> values{weighted ? share.counted_rows : 1.0, loss_weight, share.rows};
  for (const float l : loss) values.push_back(static_cast<double>(l) * loss_weight);
  for (const nn::Parameter* b : buffers) {
    for (const float v : b->values()) values.push_back(static_cast<double>(v) * share.rows);
  }
  return values;
}

DUET_DETAIL_COMPILED void apply_step_values(std::span<const double> values, std::span<float> loss,
                                            const std::vector<nn::Parameter*>& buffers, const BatchShare& share) {
  const double counted = values[1];
  std::size_t k = 3;
  for (float& l : loss) {
    const double sum = values[k++];
    l = static_cast<float>(share.summed ? sum : counted > 0 ? sum / counted : 0.0);
  }
  for (nn::Parameter* b : buffers) {
    // Non-const data() moves the version, so what was made from the old values is made again.
    for (float& v : b->values()) {
      v = static_cast<float>(values[k++] / values[2]);
    }
  }
}

DUET_DETAIL_COMPILED void all_reduce_step(DataParallelRuntime& runtime, std::span<const GradientView> grads,
                                          const std::function<float*(std::size_t)>& write, std::span<float> loss,
                                          const std::vector<nn::Parameter*>& buffers, const BatchShare& share,
                                          bool gradients_mean) {
  const bool weighted = gradients_mean && !share.summed;
  std::vector<double> values = step_values(loss, buffers, share, weighted);
  runtime.all_reduce_gradients(grads, values, weighted, write);
  apply_step_values(values, loss, buffers, share);
}

DUET_DETAIL_COMPILED std::vector<OverlappedReduction::Unit> OverlappedReduction::plan(const std::vector<index_t>& sizes,
                                                                                      std::size_t bucket_bytes) {
  constexpr index_t in_place_elements = (64 << 10) / sizeof(float);
  const auto limit = static_cast<index_t>(std::max<std::size_t>(bucket_bytes / sizeof(float), 1));
  std::vector<Unit> units;
  bool open = false;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const index_t n = sizes[sizes.size() - 1 - k];
    if (n >= in_place_elements) {
      units.push_back({k, k + 1, true, n});
      open = false;
      continue;
    }
    if (!open || units.back().elements + n > limit) units.push_back({k, k, false, 0});
    open = true;
    units.back().last = k + 1;
    units.back().elements += n;
  }
  return units;
}

DUET_DETAIL_COMPILED OverlappedReduction::OverlappedReduction(DataParallelRuntime& runtime,
                                                              const std::vector<nn::BasicParameter<float>*>& params,
                                                              const std::unordered_map<const void*, std::size_t>& index,
                                                              const std::vector<int>& writes,
                                                              const std::vector<Unit>& units,
                                                              std::vector<std::vector<float>>& buffers,
                                                              std::vector<double>& weights, double weight, bool mean)
    : runtime_(runtime),
      params_(params),
      index_(index),
      writes_(writes),
      units_(units),
      buffers_(buffers),
      weights_(weights),
      mean_(mean),
      weight_(weight),
      count_(params.size(), 0),
      final_(params.size(), false),
      sent_(params.size(), false) {
  buffers_.resize(units_.size());
  weights_.assign(1, weight);
  runtime_.start_sum(std::span<double>(weights_));
}

DUET_DETAIL_COMPILED void OverlappedReduction::will_write(const void* parameter) {
  const auto it = index_.find(parameter);
  if (it == index_.end()) return;
  const std::size_t i = it->second;
  if (sent_[i]) {
    throw ModeError("nn::TrainOneStepCell (DATA_PARALLEL): backward wrote the gradient of parameter " +
                    std::to_string(i) + " " + to_string(params_[i]->shape()) +
                    " after it was sent to the other "
                    "ranks: this step writes it more often (" +
                    std::to_string(count_[i] + 1) + " times) than the first step did (" + std::to_string(writes_[i]) +
                    "); a network whose backward changes between steps needs duet::distributed::InitConfig{"
                    ".overlap_backward = false}");
  }
  ++count_[i];
  written_.push_back(i);
}

DUET_DETAIL_COMPILED void OverlappedReduction::writes_done() {
  for (const std::size_t i : written_) final_[i] = final_[i] || count_[i] >= writes_[i];
  written_.clear();
  start_ready();
  if (started_ > 0) runtime_.test_sums();
}

DUET_DETAIL_COMPILED void OverlappedReduction::finish(std::vector<double>& values) {
  std::fill(final_.begin(), final_.end(), true);
  start_ready();
  const std::size_t flags = values.size();
  for (std::size_t i = 0; i < params_.size(); ++i) values.push_back(count_[i] > 0 ? 1 : 0);
  runtime_.start_sum(std::span<double>(values));
  runtime_.wait_sums("all-reducing the gradients");
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const float* from = buffers_[u].data();
    for (std::size_t k = units_[u].first; k < units_[u].last; ++k) {
      const std::size_t i = position(k);
      nn::BasicParameter<float>& p = *params_[i];
      if (values[flags + i] == 0) {
        p.forget_grad(current_backward_pass());  // no rank wrote it: unwritten, as all_reduce_step leaves it
      } else if (!units_[u].in_place) {
        bool accumulate = false;
        std::copy_n(from, p.numel(), p.grad_for_write(current_backward_pass(), &accumulate));
      }
      if (!units_[u].in_place) from += p.numel();  // an in-place unit has no buffer
    }
  }
  values.resize(flags);
}

DUET_DETAIL_COMPILED void OverlappedReduction::start_ready() {
  while (started_ < units_.size()) {
    const Unit& unit = units_[started_];
    for (std::size_t k = unit.first; k < unit.last; ++k) {
      if (!final_[position(k)]) return;
    }
    if (started_ == 0) {
      runtime_.wait_sums("all-reducing the step's weights");
      share_ = static_cast<float>(!mean_ ? weight_ : weights_[0] > 0 ? weight_ / weights_[0] : 0.0);
    }
    start(unit, buffers_[started_]);
    ++started_;
  }
}

DUET_DETAIL_COMPILED void OverlappedReduction::start(const Unit& unit, std::vector<float>& buffer) {
  for (std::size_t k = unit.first; k < unit.last; ++k) sent_[position(k)] = true;
  if (unit.in_place) {
    const std::size_t i = position(unit.first);
    nn::BasicParameter<float>& p = *params_[i];
    float* g = p.grad.data();
    if (count_[i] == 0) {  // this rank has none; only finish() starts such a unit, with no observer
      bool accumulate = false;
      g = p.grad_for_write(current_backward_pass(), &accumulate);
      std::fill_n(g, p.numel(), 0.0f);
    } else if (share_ != 1) {
      kernels::scale(g, p.numel(), share_, g);
    }
    runtime_.start_sum(g, p.numel());
    return;
  }
  buffer.resize(static_cast<std::size_t>(unit.elements));
  float* to = buffer.data();
  for (std::size_t k = unit.first; k < unit.last; ++k) {
    const nn::BasicParameter<float>& p = *params_[position(k)];
    if (count_[position(k)] > 0) {
      kernels::scale(p.grad.data(), p.numel(), share_, to);
    } else {
      std::fill_n(to, p.numel(), 0.0f);
    }
    to += p.numel();
  }
  runtime_.start_sum(buffer.data(), unit.elements);
}

DUET_DETAIL_COMPILED DataParallelRuntime* training_runtime(std::string_view who) {
  DataParallelRuntime* runtime = data_parallel_runtime().load(std::memory_order_acquire);
  const bool data_parallel = parallel_mode().load(std::memory_order_relaxed) == ParallelMode::DATA_PARALLEL;
  if (data_parallel && runtime == nullptr) {
    throw ModeError(std::string(who) +
                    ": the parallel mode is DATA_PARALLEL but no rank group exists; include <duet/distributed.hpp> "
                    "and call duet::distributed::init() first");
  }
  if (!data_parallel && runtime != nullptr && runtime->group_size() > 1) {
    throw ModeError(std::string(who) + ": duet::distributed::init() joined " + std::to_string(runtime->group_size()) +
                    " ranks but the parallel mode is STAND_ALONE, so each rank would train its own network; call "
                    "duet::set_auto_parallel_context({.parallel_mode = duet::ParallelMode::DATA_PARALLEL})");
  }
  return data_parallel ? runtime : nullptr;
}

}  // namespace duet::detail
