// The definitions of data.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::data {

DUET_DETAIL_COMPILED ImageDataset::ImageDataset(BasicTensor<std::uint8_t> images, BasicTensor<std::int32_t> labels,
                                                int classes)
    : images_(std::move(images)), labels_(std::move(labels)), classes_(classes) {
  if (images_.ndim() != 3) {
    throw ShapeError("duet::data::ImageDataset: images must have shape [N, H, W], got " + to_string(images_.shape()));
  }
  if (labels_.ndim() != 1 || labels_.dim(0) != images_.dim(0)) {
    throw ShapeError("duet::data::ImageDataset: " + std::to_string(images_.dim(0)) + " images need labels of shape [" +
                     std::to_string(images_.dim(0)) + "], got " + to_string(labels_.shape()));
  }
  if (classes_ <= 0) {
    throw ValueError("duet::data::ImageDataset: classes must be positive, got " + std::to_string(classes_));
  }
  for (index_t i = 0; i < labels_.numel(); ++i) {
    const std::int32_t label = labels_.data()[i];
    if (label < 0 || label >= classes_) {
      throw ValueError("duet::data::ImageDataset: label " + std::to_string(i) + " is " + std::to_string(label) +
                       ", outside 0.." + std::to_string(classes_ - 1));
    }
  }
}

DUET_DETAIL_COMPILED void ImageDataset::gather(const index_t* samples, index_t count, Batch& batch) const {
  const index_t h = height();
  const index_t w = width();
  detail::reuse_or_make(batch.images, {count, 1, h, w});
  detail::reuse_or_make(batch.labels, {count});
  const index_t pixels = h * w;
  for (index_t k = 0; k < count; ++k) {
    const index_t sample = samples[k];
    const std::uint8_t* from = images_.data() + sample * pixels;
    float* to = batch.images.data() + k * pixels;
    for (index_t p = 0; p < pixels; ++p) to[p] = static_cast<float>(from[p]) / 255.0f;
    batch.labels.data()[k] = labels_.data()[sample];
  }
}

DUET_DETAIL_COMPILED ImageDataset load_fashion_mnist(const std::filesystem::path& dir, Split split) {
  const std::string prefix = split == Split::train ? "train" : "t10k";
  const auto find = [&](const std::string& name) {
    std::error_code ignored;
    for (const auto& candidate : {dir / (name + ".gz"), dir / name}) {
      if (std::filesystem::exists(candidate, ignored)) return candidate;
    }
    throw IOError("duet::data::load_fashion_mnist: '" + (dir / (name + ".gz")).string() +
                  "' not found; on Debian, install the dataset-fashion-mnist package, or pass the directory "
                  "holding the Fashion-MNIST files");
  };
  const auto images_path = find(prefix + "-images-idx3-ubyte");
  const auto labels_path = find(prefix + "-labels-idx1-ubyte");
  BasicTensor<std::uint8_t> images = io::read_idx_u8(images_path);
  const BasicTensor<std::uint8_t> label_bytes = io::read_idx_u8(labels_path);
  auto labels = BasicTensor<std::int32_t>::uninitialized(label_bytes.shape());
  std::copy_n(label_bytes.data(), label_bytes.numel(), labels.data());
  try {
    return ImageDataset(std::move(images), std::move(labels), 10);
  } catch (const Error& e) {
    throw FormatError("duet::data::load_fashion_mnist: '" + images_path.string() + "' and '" + labels_path.string() +
                      "' do not form a data set: " + e.what());
  }
}

DUET_DETAIL_COMPILED ImageDataset load_fashion_mnist(Split split) {
  return load_fashion_mnist(fashion_mnist_dir, split);
}

}  // namespace duet::data
