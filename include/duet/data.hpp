// Data for training: image data sets held in memory as bytes, Fashion-MNIST, data sets of
// tensors, and a DataLoader that cuts a data set into shuffled batches.
//
// Images stay bytes until a batch is made (Fashion-MNIST's training set is 47 MB as bytes,
// 188 MB as floats), and a batch's tensors are reused from one batch to the next when nobody
// else holds them.
//
// A data set is what BasicDataLoader cuts: its size(), its Batch type, and gather(), which makes a
// batch of the samples it is given.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "detail/hash.hpp"
#include "error.hpp"
#include "io/idx.hpp"
#include "random.hpp"
#include "tensor.hpp"

namespace duet::data {

namespace detail {
// t, of the given shape, reused when nobody else holds it (the batch before, not kept).
template <class T>
void reuse_or_make(BasicTensor<T>& t, const Shape& shape) {
  if (t.use_count() != 1 || !(t.shape() == shape)) t = BasicTensor<T>::uninitialized(shape);
}

// x's shape with its first axis `count` long: a batch of x's rows.
inline Shape rows_of(const Shape& x, index_t count) {
  Shape s = x;
  s[0] = count;
  return s;
}
}  // namespace detail

// A batch of images: [B, 1, H, W] as floats in [0, 1] (byte / 255) and their labels [B].
struct Batch {
  Tensor images;
  BasicTensor<std::int32_t> labels;
};

// Images [N, H, W] as bytes and their labels [N], each in 0 .. classes - 1. Copies share the
// elements, as tensors do.
class ImageDataset {
 public:
  using Batch = data::Batch;

  ImageDataset(BasicTensor<std::uint8_t> images, BasicTensor<std::int32_t> labels, int classes);

  // Samples.
  index_t size() const { return images_.dim(0); }
  index_t height() const { return images_.dim(1); }
  index_t width() const { return images_.dim(2); }
  int classes() const { return classes_; }
  const BasicTensor<std::uint8_t>& images() const { return images_; }
  const BasicTensor<std::int32_t>& labels() const { return labels_; }

  // The samples samples[0], ..., samples[count - 1], in that order.
  void gather(const index_t* samples, index_t count, Batch& batch) const;

 private:
  BasicTensor<std::uint8_t> images_;
  BasicTensor<std::int32_t> labels_;
  int classes_;
};

// Samples as rows of two tensors (PyTorch's TensorDataset, MindSpore's NumpySlicesDataset):
// inputs [N, ...] and targets [N, ...], float values to regress, or int32 class indices [N]
// (which train::evaluate reads as labels). Batches are {inputs, targets}, their rows in the
// loader's order: `for (const auto& [x, y] : loader)`. Copies share the elements.
template <ElementType X = float, ElementType Y = float>
class TensorDataset {
 public:
  struct Batch {
    BasicTensor<X> inputs;
    BasicTensor<Y> targets;
  };

  TensorDataset(BasicTensor<X> inputs, BasicTensor<Y> targets) : inputs_(std::move(inputs)), targets_(std::move(targets)) {
    if (inputs_.ndim() == 0 || targets_.ndim() == 0 || inputs_.dim(0) != targets_.dim(0)) {
      throw ShapeError("duet::data::TensorDataset: inputs and targets must have one row per sample, the same count, "
                       "got inputs " + to_string(inputs_.shape()) + " and targets " + to_string(targets_.shape()));
    }
  }

  index_t size() const { return inputs_.dim(0); }
  const BasicTensor<X>& inputs() const { return inputs_; }
  const BasicTensor<Y>& targets() const { return targets_; }

  // The samples samples[0], ..., samples[count - 1], in that order.
  void gather(const index_t* samples, index_t count, Batch& batch) const {
    gather_rows(inputs_, samples, count, batch.inputs);
    gather_rows(targets_, samples, count, batch.targets);
  }

 private:
  template <class T>
  static void gather_rows(const BasicTensor<T>& from, const index_t* samples, index_t count, BasicTensor<T>& to) {
    detail::reuse_or_make(to, detail::rows_of(from.shape(), count));
    const index_t row = from.dim(0) == 0 ? 0 : from.numel() / from.dim(0);
    for (index_t k = 0; k < count; ++k) std::copy_n(from.data() + samples[k] * row, row, to.data() + k * row);
  }

  BasicTensor<X> inputs_;
  BasicTensor<Y> targets_;
};

enum class Split { train, test };

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";

// Fashion-MNIST (60000 training or 10000 test images of 28x28, 10 classes) from the four IDX
// files of its distribution, gzipped (as shipped) or not.
DUET_DETAIL_COMPILED ImageDataset load_fashion_mnist(const std::filesystem::path& dir, Split split);

DUET_DETAIL_COMPILED ImageDataset load_fashion_mnist(Split split = Split::train);

struct LoaderOptions {
  // Epoch e's order is a function of (seed, e) alone, so a run can be repeated or resumed.
  bool shuffle = false;
  std::uint64_t seed = 0;
  // Leave out the last batch when it is smaller than batch_size, instead of returning it short.
  bool drop_last = false;
  // Data parallelism (MindSpore's num_shards/shard_id): the loader serves shard shard_id of
  // every global batch of batch_size * num_shards samples, its shard_id-th contiguous part (a
  // short last batch's first parts a sample longer where it does not divide). Every shard
  // shuffles alike (the same seed gives the same epoch order), so the shards' batches, one
  // after another, are one process's batches of the global size, row for row: 2 ranks hold the
  // halves that a layer's gradient sums separately (kernels/detail/halves.hpp), and their
  // gradients' mean is one process's to the bit.
  // A last global batch of fewer than num_shards samples is left out on every shard: some shard
  // would get an empty batch.
  index_t num_shards = 1;
  index_t shard_id = 0;
};

namespace detail {
// What the last batch a sharded loader served (in any thread) was cut from: its epoch's order,
// as a hash of what makes it (seed when shuffled, epoch, data set size, global batch, shards,
// drop_last) and of the batch's place in it; 0 before any. Ranks training together must serve
// shards of one order: with a seed per rank, or one rank a start_epoch behind, the shards
// overlap and leave samples out, and each rank's batches still differ. The first data-parallel
// step compares it between the ranks (parallel.hpp, require_sharded_data).
inline std::atomic<std::uint64_t>& served_order() {
  static std::atomic<std::uint64_t> order{0};
  return order;
}
// What served_order holds after a loader that is not sharded served a batch.
inline constexpr std::uint64_t unsharded_order = 1;
}  // namespace detail

// Cuts a data set into batches, one epoch at a time:
//
//   data::DataLoader loader(data::load_fashion_mnist(), 64, {.shuffle = true, .seed = 1});
//   for (int epoch = 0; epoch < 10; ++epoch) {
//     for (const data::Batch& batch : loader) train(batch.images, batch.labels);
//   }
//
//   data::BasicDataLoader pairs(data::TensorDataset(x, y), 32, {.shuffle = true});
//   for (const auto& [inputs, targets] : pairs) step(inputs, targets);
//
// Each range-for runs the next epoch (the first runs epoch 0); next() and start_epoch() step
// through epochs by hand. A batch is valid until the next batch is made.
//
// DataLoader is the loader of images (BasicDataLoader<ImageDataset>), as Tensor is BasicTensor<float>.
template <class Dataset>
class BasicDataLoader {
 public:
  using Batch = typename Dataset::Batch;

  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;

    Iterator() = default;
    explicit Iterator(BasicDataLoader& loader) : loader_(&loader), batch_(loader.next()) {}

    const Batch& operator*() const { return *batch_; }
    const Batch* operator->() const { return batch_; }
    Iterator& operator++() {
      batch_ = loader_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const Iterator& it, std::default_sentinel_t) { return it.batch_ == nullptr; }

   private:
    BasicDataLoader* loader_ = nullptr;
    const Batch* batch_ = nullptr;
  };

  BasicDataLoader(Dataset data, index_t batch_size, LoaderOptions options = {})
      : data_(std::move(data)),
        batch_size_(batch_size),
        options_(options),
        order_(static_cast<std::size_t>(data_.size())) {
    if (batch_size_ <= 0) {
      throw ValueError("duet::data::DataLoader: batch_size must be positive, got " + std::to_string(batch_size_));
    }
    if (options_.num_shards <= 0 || options_.shard_id < 0 || options_.shard_id >= options_.num_shards) {
      throw ValueError("duet::data::DataLoader: shard_id must be in 0.." + std::to_string(options_.num_shards - 1) +
                       " with num_shards positive, got shard " + std::to_string(options_.shard_id) + " of " +
                       std::to_string(options_.num_shards));
    }
    start_epoch(0);
  }

  // Batches per epoch (PyTorch's len(loader), MindSpore's get_dataset_size()), the same on every shard.
  index_t size() const {
    const index_t global = global_batch_size();
    if (options_.drop_last || data_.size() % global < options_.num_shards) return data_.size() / global;
    return data_.size() / global + 1;
  }
  // Samples per batch on this shard (the last batch may have fewer).
  index_t batch_size() const { return batch_size_; }
  // Samples per batch over all shards.
  index_t global_batch_size() const { return batch_size_ * options_.num_shards; }
  const LoaderOptions& options() const { return options_; }
  const Dataset& dataset() const { return data_; }
  std::uint64_t epoch() const { return epoch_; }

  // Rewinds to the first batch of the given epoch, in that epoch's order.
  void start_epoch(std::uint64_t epoch) {
    epoch_ = epoch;
    next_batch_ = 0;
    std::iota(order_.begin(), order_.end(), index_t{0});
    if (options_.shuffle) {
      // Fisher-Yates. The modulo's bias is below size / 2^64: nothing for any data set in memory.
      Generator gen(Generator(options_.seed).next() + epoch);
      for (std::size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[gen.next() % i]);
    }
  }

  // The next batch of this epoch, or nullptr when the epoch is over.
  const Batch* next() {
    if (next_batch_ == size()) return nullptr;
    const index_t shards = options_.num_shards;
    const index_t start = next_batch_ * global_batch_size();
    const index_t global = std::min(global_batch_size(), data_.size() - start);
    const index_t part = global / shards;
    const index_t longer = global % shards;
    const index_t shard = options_.shard_id;
    data_.gather(order_.data() + start + shard * part + std::min(shard, longer), part + (shard < longer ? 1 : 0),
                 batch_);
    if (shards == 1) {
      detail::served_order().store(detail::unsharded_order, std::memory_order_relaxed);
    } else {
      const std::uint64_t made_of[] = {options_.shuffle ? options_.seed : 0,
                                       options_.shuffle,
                                       epoch_,
                                       static_cast<std::uint64_t>(data_.size()),
                                       static_cast<std::uint64_t>(global_batch_size()),
                                       static_cast<std::uint64_t>(shards),
                                       options_.drop_last,
                                       static_cast<std::uint64_t>(next_batch_)};
      detail::served_order().store(duet::detail::fnv1a_of(made_of), std::memory_order_relaxed);
    }
    ++next_batch_;
    return &batch_;
  }

  // This shard's part of the current epoch's last global batch when it is too short to shard
  // (fewer samples than shards, left out of the epoch, unless drop_last): one sample for each
  // of the first shards, none for the others. train::evaluate takes it, so that metrics over
  // sharded loaders cover every sample.
  std::optional<Batch> left_out() const {
    const index_t start = data_.size() / global_batch_size() * global_batch_size();
    const index_t rest = data_.size() - start;
    if (options_.drop_last || rest >= options_.num_shards || options_.shard_id >= rest) return std::nullopt;
    Batch batch;
    data_.gather(order_.data() + start + options_.shard_id, 1, batch);
    return batch;
  }

  // Starts the next epoch, or the current one if none of its batches has been taken yet.
  Iterator begin() {
    start_epoch(next_batch_ > 0 ? epoch_ + 1 : epoch_);
    return Iterator(*this);
  }
  std::default_sentinel_t end() const { return {}; }

 private:
  Dataset data_;
  index_t batch_size_;
  LoaderOptions options_;
  std::vector<index_t> order_;  // this epoch's samples, in the order they are served
  std::uint64_t epoch_ = 0;
  index_t next_batch_ = 0;
  Batch batch_;
};

using DataLoader = BasicDataLoader<ImageDataset>;

template <class L>
inline constexpr bool is_data_loader_v = false;
template <class Dataset>
inline constexpr bool is_data_loader_v<BasicDataLoader<Dataset>> = true;

}  // namespace duet::data

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "detail/data_impl.hpp"
#endif
