#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <duet/duet.hpp>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

namespace tests_data {

using namespace duet;
namespace fs = std::filesystem;

namespace {

// n images of 2x2 whose first pixel is the sample's index, labelled index % 3.
data::ImageDataset numbered(index_t n) {
  auto images = BasicTensor<std::uint8_t>::uninitialized({n, 2, 2});
  auto labels = BasicTensor<std::int32_t>::uninitialized({n});
  for (index_t i = 0; i < n; ++i) {
    images(i, 0, 0) = static_cast<std::uint8_t>(i);
    images(i, 0, 1) = 0;
    images(i, 1, 0) = 128;
    images(i, 1, 1) = 255;
    labels(i) = static_cast<std::int32_t>(i % 3);
  }
  return data::ImageDataset(images, labels, 3);
}

// The samples a batch holds, read back from their first pixel.
std::vector<index_t> samples_of(const data::Batch& batch) {
  std::vector<index_t> out;
  for (index_t k = 0; k < batch.images.dim(0); ++k) {
    out.push_back(static_cast<index_t>(batch.images(k, 0, 0, 0) * 255.0f + 0.5f));
  }
  return out;
}

// One epoch's samples, in the order served, by range-for.
std::vector<index_t> epoch_order(data::DataLoader& loader) {
  std::vector<index_t> out;
  for (const data::Batch& batch : loader) {
    for (index_t s : samples_of(batch)) out.push_back(s);
  }
  return out;
}

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> serial{0};
    path = fs::temp_directory_path() /
           ("duet_data_" + std::to_string(::getpid()) + "_" + std::to_string(serial.fetch_add(1)));
    fs::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { fs::remove_all(path); }
};

void write_idx_u8(const fs::path& path, const std::vector<std::uint32_t>& dims,
                  const std::vector<unsigned char>& data) {
  std::vector<unsigned char> bytes{0, 0, 0x08, static_cast<unsigned char>(dims.size())};
  for (std::uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<unsigned char>(d >> shift));
  }
  bytes.insert(bytes.end(), data.begin(), data.end());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

TEST_CASE("batches cover the data set in order, the last one short unless drop_last") {
  data::DataLoader loader(numbered(10), 4);
  CHECK(loader.size() == 3);
  std::vector<index_t> sizes;
  for (const data::Batch& batch : loader) {
    sizes.push_back(batch.images.dim(0));
    CHECK(batch.labels.dim(0) == batch.images.dim(0));
  }
  CHECK(sizes == std::vector<index_t>{4, 4, 2});
  std::vector<index_t> all(10);
  std::iota(all.begin(), all.end(), 0);
  CHECK(epoch_order(loader) == all);

  data::DataLoader dropping(numbered(10), 4, {.drop_last = true});
  CHECK(dropping.size() == 2);
  CHECK(epoch_order(dropping) == std::vector<index_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(data::DataLoader(numbered(8), 4, {.drop_last = true}).size() == 2);
  CHECK(data::DataLoader(numbered(3), 4, {.drop_last = true}).size() == 0);
  CHECK(data::DataLoader(numbered(3), 4).size() == 1);
}

TEST_CASE("a batch holds images [B, 1, H, W] as byte / 255 and their labels") {
  data::DataLoader loader(numbered(5), 2);
  const data::Batch* batch = loader.next();
  REQUIRE(batch != nullptr);
  CHECK(batch->images.shape() == Shape{2, 1, 2, 2});
  CHECK(batch->labels.shape() == Shape{2});
  CHECK(batch->images(1, 0, 0, 0) == 1.0f / 255.0f);
  CHECK(batch->images(1, 0, 0, 1) == 0.0f);
  CHECK(batch->images(1, 0, 1, 0) == 128.0f / 255.0f);
  CHECK(batch->images(1, 0, 1, 1) == 1.0f);
  batch = loader.next();
  batch = loader.next();
  REQUIRE(batch != nullptr);
  CHECK(batch->images.shape() == Shape{1, 1, 2, 2});
  CHECK(batch->labels(0) == 4 % 3);
  CHECK(loader.next() == nullptr);
  CHECK(loader.next() == nullptr);
}

TEST_CASE("shuffling serves a permutation, the same for a seed and epoch, another each epoch") {
  const auto data = numbered(100);
  data::DataLoader a(data, 7, {.shuffle = true, .seed = 42});
  data::DataLoader b(data, 7, {.shuffle = true, .seed = 42});
  const auto a0 = epoch_order(a);
  const auto a1 = epoch_order(a);
  CHECK(a.epoch() == 1);
  std::vector<index_t> sorted = a0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<index_t> all(100);
  std::iota(all.begin(), all.end(), 0);
  CHECK(sorted == all);
  CHECK(a0 != all);
  CHECK(a0 != a1);
  CHECK(epoch_order(b) == a0);
  CHECK(epoch_order(b) == a1);

  // An epoch's order depends on the seed and the epoch number alone.
  data::DataLoader c(data, 10, {.shuffle = true, .seed = 42});
  c.start_epoch(1);
  CHECK(epoch_order(c) == a1);
  c.start_epoch(0);
  std::vector<index_t> by_next;
  while (const data::Batch* batch = c.next()) {
    for (index_t s : samples_of(*batch)) by_next.push_back(s);
  }
  CHECK(by_next == a0);
  data::DataLoader other_seed(data, 7, {.shuffle = true, .seed = 43});
  CHECK(epoch_order(other_seed) != a0);

  // Labels travel with their images.
  data::DataLoader d(data, 9, {.shuffle = true, .seed = 1});
  while (const data::Batch* batch = d.next()) {
    const auto samples = samples_of(*batch);
    for (std::size_t k = 0; k < samples.size(); ++k) {
      CHECK(batch->labels(static_cast<index_t>(k)) == samples[k] % 3);
    }
  }
}

TEST_CASE("an abandoned epoch is not resumed: the next range-for starts the next epoch") {
  const auto data = numbered(20);
  data::DataLoader a(data, 5, {.shuffle = true, .seed = 3});
  data::DataLoader b(data, 5, {.shuffle = true, .seed = 3});
  for (const data::Batch& batch : a) {
    static_cast<void>(batch);
    break;
  }
  CHECK(a.epoch() == 0);
  epoch_order(b);
  CHECK(epoch_order(a) == epoch_order(b));
  CHECK(a.epoch() == 1);
}

TEST_CASE("train::evaluate on the training loader leaves its epochs as they were") {
  const auto data = numbered(20);
  data::DataLoader trained(data, 5, {.shuffle = true, .seed = 3});
  data::DataLoader reference(data, 5, {.shuffle = true, .seed = 3});
  nn::SequentialCell<nn::Flatten, nn::Dense<4, 3>> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  CHECK(epoch_order(trained) == epoch_order(reference));
  // Between epochs, as a training loop evaluates: the pass reads epoch 0 again.
  const auto metrics = train::evaluate(net, loss, trained);
  CHECK(metrics.samples == 20);
  CHECK(trained.epoch() == 0);
  CHECK(epoch_order(trained) == epoch_order(reference));
  CHECK(trained.epoch() == 1);
  // In the middle of an epoch, the next batch is the one that was next.
  const data::Batch* taken = trained.next();
  REQUIRE(taken == nullptr);  // epoch 1 is over; start epoch 2 by hand and take one batch
  trained.start_epoch(2);
  reference.start_epoch(2);
  static_cast<void>(trained.next());
  static_cast<void>(reference.next());
  train::evaluate(net, loss, trained);
  CHECK(samples_of(*trained.next()) == samples_of(*reference.next()));
}

TEST_CASE("batch tensors are reused when nobody holds them, and left alone when someone does") {
  data::DataLoader loader(numbered(12), 4);
  const float* first = loader.next()->images.data();
  CHECK(loader.next()->images.data() == first);
  const data::Batch kept = *loader.next();
  const std::vector<index_t> kept_samples = samples_of(kept);
  loader.start_epoch(1);
  const data::Batch* fresh = loader.next();
  CHECK(fresh->images.data() != kept.images.data());
  CHECK(samples_of(kept) == kept_samples);
}

TEST_CASE("a data set checks its shapes and labels, a loader its batch size") {
  const auto images = BasicTensor<std::uint8_t>::uninitialized({3, 2, 2});
  CHECK_THROWS_WITH_AS(data::ImageDataset(images, BasicTensor<std::int32_t>({2}), 10),
                       "duet::data::ImageDataset: 3 images need labels of shape [3], got [2]", ShapeError);
  CHECK_THROWS_WITH_AS(data::ImageDataset(images.reshape({3, 4}), BasicTensor<std::int32_t>({3}), 10),
                       "duet::data::ImageDataset: images must have shape [N, H, W], got [3, 4]", ShapeError);
  CHECK_THROWS_WITH_AS(data::ImageDataset(images, BasicTensor<std::int32_t>({3}, {0, 10, 1}), 10),
                       "duet::data::ImageDataset: label 1 is 10, outside 0..9", ValueError);
  CHECK_THROWS_WITH_AS(data::DataLoader(numbered(3), 0), "duet::data::DataLoader: batch_size must be positive, got 0",
                       ValueError);
  CHECK(data::DataLoader(data::ImageDataset(BasicTensor<std::uint8_t>({0, 2, 2}), BasicTensor<std::int32_t>({0}), 1), 4)
            .next() == nullptr);
}

TEST_CASE("load_fashion_mnist says what is missing and how to get it, and checks the files agree") {
  TempDir dir;
  const std::string expected = "duet::data::load_fashion_mnist: '" + (dir.path / "t10k-images-idx3-ubyte.gz").string() +
                               "' not found; on Debian, install the dataset-fashion-mnist package, or pass the "
                               "directory holding the Fashion-MNIST files";
  CHECK_THROWS_WITH_AS(data::load_fashion_mnist(dir.path, data::Split::test), expected.c_str(), IOError);

  // Uncompressed files serve as well; three images with two labels do not form a data set.
  write_idx_u8(dir.path / "t10k-images-idx3-ubyte", {3, 2, 2}, std::vector<unsigned char>(12, 7));
  write_idx_u8(dir.path / "t10k-labels-idx1-ubyte", {2}, {1, 2});
  CHECK_THROWS_AS(data::load_fashion_mnist(dir.path, data::Split::test), FormatError);
  write_idx_u8(dir.path / "t10k-labels-idx1-ubyte", {3}, {1, 2, 10});
  CHECK_THROWS_AS(data::load_fashion_mnist(dir.path, data::Split::test), FormatError);
  write_idx_u8(dir.path / "t10k-labels-idx1-ubyte", {3}, {1, 2, 9});
  const auto test = data::load_fashion_mnist(dir.path, data::Split::test);
  CHECK(test.size() == 3);
  CHECK(test.labels()(2) == 9);
}

TEST_CASE("Fashion-MNIST loads as 60000 and 10000 images of 28x28 in 10 classes") {
  if (!fs::exists(fs::path(data::fashion_mnist_dir) / "train-images-idx3-ubyte.gz")) {
    MESSAGE("Fashion-MNIST is not installed (Debian package dataset-fashion-mnist): skipped");
    return;
  }
  const auto train = data::load_fashion_mnist();
  CHECK(train.size() == 60000);
  CHECK(train.height() == 28);
  CHECK(train.width() == 28);
  CHECK(train.labels()(0) == 9);
  const auto test = data::load_fashion_mnist(data::Split::test);
  CHECK(test.size() == 10000);
  CHECK(test.labels()(1) == 2);

  data::DataLoader loader(train, 64, {.shuffle = true, .seed = 0});
  CHECK(loader.size() == 938);
  const data::Batch* batch = loader.next();
  REQUIRE(batch != nullptr);
  CHECK(batch->images.shape() == Shape{64, 1, 28, 28});
  for (float v : batch->images.values()) REQUIRE((v >= 0.0f && v <= 1.0f));
  loader.start_epoch(0);
  for (index_t i = 0; i < 937; ++i) loader.next();
  CHECK(loader.next()->images.dim(0) == 60000 - 937 * 64);
}

TEST_CASE("shards of a loader, one after another, serve one process's batches of the global size, row for row") {
  for (const bool drop_last : {false, true}) {
    // 23 samples, global batches of 3 x 2: three of 6, one of 5 (shards of 2, 2 and 1).
    data::DataLoader whole(numbered(23), 6, {.shuffle = true, .seed = 5, .drop_last = drop_last});
    std::vector<data::DataLoader> shards;
    for (index_t s = 0; s < 3; ++s) {
      shards.emplace_back(numbered(23), 2,
                          data::LoaderOptions{.shuffle = true, .seed = 5, .drop_last = drop_last, .num_shards = 3, .shard_id = s});
    }
    for (int epoch = 0; epoch < 2; ++epoch) {
      whole.start_epoch(static_cast<std::uint64_t>(epoch));
      for (auto& shard : shards) {
        shard.start_epoch(static_cast<std::uint64_t>(epoch));
        CHECK(shard.size() == whole.size());
        CHECK(shard.global_batch_size() == 6);
      }
      while (const data::Batch* batch = whole.next()) {
        std::vector<index_t> together;
        for (auto& shard : shards) {
          const std::vector<index_t> part = samples_of(*shard.next());
          together.insert(together.end(), part.begin(), part.end());
        }
        CHECK(together == samples_of(*batch));
      }
      for (auto& shard : shards) CHECK(shard.next() == nullptr);
    }
  }
}

TEST_CASE(
    "a last global batch smaller than the shard count is left out on every shard, and left_out gives its samples") {
  // 13 samples in global batches of 2 x 3 = 6: the last holds one sample, and two shards none.
  for (index_t s = 0; s < 3; ++s) {
    data::DataLoader shard(numbered(13), 2, {.shuffle = true, .seed = 4, .num_shards = 3, .shard_id = s});
    CHECK(shard.size() == 2);
    const std::vector<index_t> served = epoch_order(shard);
    CHECK(served.size() == 4);
    const auto rest = shard.left_out();
    CHECK(rest.has_value() == (s == 0));
    if (rest) {
      // The one sample no shard served.
      data::DataLoader whole(numbered(13), 13, {.shuffle = true, .seed = 4});
      CHECK(samples_of(*rest) == std::vector<index_t>{samples_of(*whole.next()).back()});
    }
  }
  CHECK(!data::DataLoader(numbered(13), 2, {.drop_last = true, .num_shards = 3}).left_out());
  CHECK(!data::DataLoader(numbered(15), 2, {.num_shards = 3}).left_out());  // served: 3 samples, one a shard
  CHECK(data::DataLoader(numbered(15), 2, {.num_shards = 3, .shard_id = 1}).size() == 3);
}

TEST_CASE("a loader checks its shard") {
  CHECK_THROWS_WITH_AS(data::DataLoader(numbered(3), 1, {.num_shards = 2, .shard_id = 2}),
                       "duet::data::DataLoader: shard_id must be in 0..1 with num_shards positive, got shard 2 of 2",
                       ValueError);
  CHECK_THROWS_AS(data::DataLoader(numbered(3), 1, {.num_shards = 0}), ValueError);
  CHECK_THROWS_AS(data::DataLoader(numbered(3), 1, {.num_shards = 2, .shard_id = -1}), ValueError);
}

TEST_CASE("TensorDataset: rows of inputs and targets in the loader's order, shuffled and sharded as images are") {
  // Sample i: inputs [i, -i, 2i] (a row of [N, 3]) and targets [[i], [i + 0.5]] ([N, 2, 1]).
  const index_t n = 10;
  Tensor x({n, 3});
  Tensor y({n, 2, 1});
  for (index_t i = 0; i < n; ++i) {
    const auto v = static_cast<float>(i);
    x(i, 0) = v;
    x(i, 1) = -v;
    x(i, 2) = 2 * v;
    y(i, 0, 0) = v;
    y(i, 1, 0) = v + 0.5f;
  }
  data::BasicDataLoader loader(data::TensorDataset(x, y), 4, {.shuffle = true, .seed = 9});
  data::DataLoader images(numbered(n), 4, {.shuffle = true, .seed = 9});
  CHECK(loader.size() == 3);
  std::vector<index_t> order;
  for (const auto& [inputs, targets] : loader) {
    REQUIRE(inputs.shape() == Shape{inputs.dim(0), 3});
    REQUIRE(targets.shape() == Shape{inputs.dim(0), 2, 1});
    for (index_t k = 0; k < inputs.dim(0); ++k) {
      const float v = inputs(k, 0);
      CHECK(inputs(k, 1) == -v);
      CHECK(inputs(k, 2) == 2 * v);
      CHECK(targets(k, 0, 0) == v);
      CHECK(targets(k, 1, 0) == v + 0.5f);
      order.push_back(static_cast<index_t>(v));
    }
  }
  CHECK(order == epoch_order(images));  // the same order as any data set of n samples
  std::vector<index_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<index_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), index_t{0});
  CHECK(sorted == all);
  // Shards of a tensor data set: every sample once over the two shards.
  std::vector<index_t> sharded;
  for (index_t shard = 0; shard < 2; ++shard) {
    data::BasicDataLoader part(data::TensorDataset(x, y), 2, {.shuffle = true, .seed = 9, .num_shards = 2, .shard_id = shard});
    for (const auto& batch : part) {
      for (index_t k = 0; k < batch.inputs.dim(0); ++k) sharded.push_back(static_cast<index_t>(batch.inputs(k, 0)));
    }
  }
  std::sort(sharded.begin(), sharded.end());
  CHECK(sharded == all);
  CHECK_THROWS_WITH_AS(data::TensorDataset(x, Tensor({n - 1})),
                       "duet::data::TensorDataset: inputs and targets must have one row per sample, the same count, got "
                       "inputs [10, 3] and targets [9]",
                       ShapeError);
}

TEST_CASE("TensorDataset of class indices: train::evaluate reads its batches, as a DataLoader of images") {
  nn::Dense<2, 3> net;
  nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> loss;
  const Tensor x = randn({7, 2}, 3);
  BasicTensor<std::int32_t> y({7});
  for (index_t i = 0; i < 7; ++i) y(i) = static_cast<std::int32_t>(i % 3);
  data::BasicDataLoader loader(data::TensorDataset(x, y), 3);
  const train::Metrics m = train::evaluate(net, loss, loader);
  CHECK(m.samples == 7);
  const Tensor logits = net(x);
  CHECK(m.loss == doctest::Approx(loss(logits, y).item()).epsilon(1e-6));
  CHECK(m.accuracy == doctest::Approx(static_cast<double>(train::correct_predictions(logits, y)) / 7));
  CHECK(loader.epoch() == 0);  // evaluate left the loader where it was
}

// A sequence model's logits [B, L, C] against labels [B, L]: one prediction per token, as the
// loss counts them (before 2026-12-08 read as [B, C] with C = L: 1 / L accuracy after training).
TEST_CASE("train::evaluate counts a sequence model's tokens right, classes on the last axis") {
  // Logits that pick class (b + t) % 4 at token t of sequence b, labels right except at two tokens.
  Tensor logits({3, 5, 4});
  BasicTensor<std::int32_t> y({3, 5});
  for (index_t b = 0; b < 3; ++b) {
    for (index_t t = 0; t < 5; ++t) {
      logits(b, t, (b + t) % 4) = 2.f;
      y(b, t) = static_cast<std::int32_t>((b + t) % 4);
    }
  }
  y(0, 4) = 3;
  y(2, 1) = 0;
  CHECK(train::correct_predictions(logits, y) == 13);
  // The ignored label's tokens count in neither.
  y(1, 2) = -100;
  CHECK(train::correct_predictions(logits, y, -100) == 12);

  // Through evaluate: a Dense of identity weights gives the logits back.
  nn::Dense<4, 4> net;
  for (index_t i = 0; i < 16; ++i) net.weight.data()[i] = i % 5 == 0 ? 1.f : 0.f;
  for (index_t i = 0; i < 4; ++i) net.bias.data()[i] = 0.f;
  REQUIRE(std::equal(logits.values().begin(), logits.values().end(), net(logits).values().begin()));
  nn::CrossEntropyLoss<> loss;
  struct Batch {
    Tensor inputs;
    BasicTensor<std::int32_t> targets;
  };
  const std::vector<Batch> one_batch{{logits, y}};
  const train::Metrics m = train::evaluate(net, loss, one_batch);
  CHECK(m.samples == 14);
  CHECK(m.accuracy == doctest::Approx(12.0 / 14));

  CHECK_THROWS_WITH_AS(train::correct_predictions(logits, BasicTensor<std::int32_t>({3})),
                       "duet::train::correct_predictions: expects logits with the classes on their last axis and class "
                       "labels of their shape without it, got logits [3, 5, 4] and labels [3]",
                       ShapeError);
}

}  // namespace tests_data
