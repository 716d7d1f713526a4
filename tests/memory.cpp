#include <doctest/doctest.h>

#include <duet/duet.hpp>
#include <thread>

namespace tests_memory {

using namespace duet::detail;

TEST_CASE("size classes: every size fits its class, with at most 25% slack above 1 KiB") {
  for (std::size_t bytes = 1; bytes < (std::size_t{1} << 22); bytes = bytes * 5 / 4 + 1) {
    const auto c = size_class_of(bytes);
    CHECK(c < size_class_count);
    CHECK(capacity_of(c) >= bytes);
    if (bytes > 1024) CHECK(capacity_of(c) <= bytes + bytes / 4 + 1);
    if (c > 1) CHECK(capacity_of(c - 1) < bytes);
  }
  CHECK(size_class_of(std::size_t{1} << 40) < size_class_count);
}

TEST_CASE("a released block is reused by the next tensor of a similar size on the same thread") {
  const float* first = nullptr;
  {
    const auto t = duet::zeros({1000});
    first = t.data();
  }
  const auto again = duet::zeros({990});
  CHECK(again.data() == first);
}

TEST_CASE("empty_cache and set_cache_limit return memory to the heap") {
  { const auto t = duet::zeros({4096}); }
  REQUIRE(thread_block_cache()->cached_bytes() > 0);
  duet::empty_cache();
  CHECK(thread_block_cache()->cached_bytes() == 0);
  duet::set_cache_limit(0);
  { const auto t = duet::zeros({4096}); }
  CHECK(thread_block_cache()->cached_bytes() == 0);
  duet::set_cache_limit(std::size_t{256} << 20);
}

TEST_CASE("tensors may be released on another thread than the one that made them") {
  auto t = duet::ones({10000});
  std::thread([moved = std::move(t)]() mutable {
    CHECK(moved.values()[9999] == 1.0f);
    moved = duet::Tensor();
  }).join();
}

}  // namespace tests_memory
