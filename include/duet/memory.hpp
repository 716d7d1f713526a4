// Tensor storage: reference-counted blocks served from a per-thread caching pool.
//
// Every tensor, in both modes, takes its elements from here. A released block goes back to
// the releasing thread's cache instead of the heap, so a network that runs again on the same
// shapes finds its blocks waiting: once warm, a forward pass makes no heap allocation at all
// (the graph-mode guarantee) and PyNative pays a free-list pop per node instead of malloc.
// The cache is per thread, so concurrent forward passes never contend on a lock.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#define DUET_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DUET_ASAN 1
#endif
#endif
#ifdef DUET_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace duet {

namespace detail {

// Elements start one cache line after the block header, so they are 64-byte aligned
// (what AVX-512 loads and the GEMM packing routines want).
inline constexpr std::size_t block_alignment = 64;

struct Block {
  std::atomic<std::uint32_t> refs{1};
  std::uint32_t size_class = 0;
  std::size_t capacity = 0;  // bytes of element storage
  Block* next_free = nullptr;
  // Grants of write access to the elements (Storage::note_write); kept while the block is
  // cached, so a count once seen on a block is never seen again on it for other contents.
  std::atomic<std::uint64_t> writes{0};
  // The parameter whose gradient value_and_grad returned in this block; nullptr for anything
  // else. Cleared when the block is reused.
  const void* gradient_of = nullptr;
  // False when those are zeros standing for no gradient: the backward pass did not reach the
  // parameter, or it is frozen (PyTorch's grad None), which the optimisers leave as it is.
  bool gradient_reached = true;

  std::byte* data() { return reinterpret_cast<std::byte*>(this) + block_alignment; }
};
static_assert(sizeof(Block) <= block_alignment);

// Size classes: 64-byte steps up to 1 KiB, then four steps per power of two (at most 25%
// slack), so blocks are reusable across nearby sizes without unbounded waste.
inline constexpr std::uint32_t small_classes = 16;
inline constexpr std::uint32_t size_class_count = small_classes + 4 * 54 + 1;

constexpr std::uint32_t size_class_of(std::size_t bytes) {
  if (bytes <= 1024) return static_cast<std::uint32_t>((bytes + 63) / 64);
  std::uint32_t p = 0;  // 2^p < bytes <= 2^(p+1)
  while ((std::size_t{2} << p) < bytes) ++p;
  const std::size_t step = std::size_t{1} << (p - 2);
  const auto sub = static_cast<std::uint32_t>((bytes - (std::size_t{1} << p) + step - 1) / step);
  return small_classes + (p - 10) * 4 + sub;
}

constexpr std::size_t capacity_of(std::uint32_t size_class) {
  if (size_class <= small_classes) return std::size_t{size_class} * 64;
  const std::uint32_t p = (size_class - small_classes - 1) / 4 + 10;
  const std::uint32_t sub = (size_class - small_classes - 1) % 4 + 1;
  return (std::size_t{1} << p) + sub * (std::size_t{1} << (p - 2));
}

inline std::atomic<std::size_t>& cache_limit_bytes() {
  static std::atomic<std::size_t> limit{std::size_t{256} << 20};
  return limit;
}

inline void poison(Block* b) {
#ifdef DUET_ASAN
  ASAN_POISON_MEMORY_REGION(b->data(), b->capacity);
#else
  (void)b;
#endif
}

inline void unpoison(Block* b) {
#ifdef DUET_ASAN
  ASAN_UNPOISON_MEMORY_REGION(b->data(), b->capacity);
#else
  (void)b;
#endif
}

inline void free_block(Block* b) {
  unpoison(b);
  b->~Block();
  ::operator delete (static_cast<void*>(b), std::align_val_t{block_alignment});
}

class BlockCache {
 public:
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  ~BlockCache() { clear(); }

  Block* take(std::uint32_t size_class) {
    Block* b = free_[size_class];
    if (b != nullptr) {
      free_[size_class] = b->next_free;
      cached_bytes_ -= b->capacity;
      unpoison(b);
      b->next_free = nullptr;
      b->gradient_of = nullptr;
      b->gradient_reached = true;
      b->refs.store(1, std::memory_order_relaxed);
    }
    return b;
  }

  // False when the cache is full; the caller then frees the block.
  bool give(Block* b) {
    if (cached_bytes_ + b->capacity > cache_limit_bytes().load(std::memory_order_relaxed)) return false;
    poison(b);
    b->next_free = free_[b->size_class];
    free_[b->size_class] = b;
    cached_bytes_ += b->capacity;
    return true;
  }

  void clear() {
    for (Block*& head : free_) {
      while (head != nullptr) {
        Block* next = head->next_free;
        free_block(head);
        head = next;
      }
    }
    cached_bytes_ = 0;
  }

  std::size_t cached_bytes() const { return cached_bytes_; }

 private:
  std::array<Block*, size_class_count> free_{};
  std::size_t cached_bytes_ = 0;
};

// The calling thread's cache, or nullptr once it has been destroyed (tensors released during
// thread or program exit then go straight back to the heap).
inline BlockCache* thread_block_cache() {
  enum class State : unsigned char { unborn, alive, dead };
  thread_local State state = State::unborn;  // trivially destructible: readable after exit
  if (state == State::dead) return nullptr;
  struct Owner {
    State& state;
    BlockCache cache;
    explicit Owner(State& s) : state(s) { state = State::alive; }
    ~Owner() {
      cache.clear();
      state = State::dead;
    }
  };
  thread_local Owner owner(state);
  return &owner.cache;
}

inline Block* allocate_block(std::size_t bytes) {
  const std::uint32_t size_class = size_class_of(bytes);
  if (BlockCache* cache = thread_block_cache()) {
    if (Block* b = cache->take(size_class)) return b;
  }
  const std::size_t capacity = capacity_of(size_class);
  void* raw = ::operator new (block_alignment + capacity, std::align_val_t{block_alignment});
  auto* b = new (raw) Block;
  b->size_class = size_class;
  b->capacity = capacity;
  return b;
}

inline void release_block(Block* b) {
  if (b->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  BlockCache* cache = thread_block_cache();
  if (cache == nullptr || !cache->give(b)) free_block(b);
}

// Shared ownership of one block; what a tensor and all its views hold.
class Storage {
 public:
  Storage() = default;
  explicit Storage(std::size_t bytes) : block_(bytes == 0 ? nullptr : allocate_block(bytes)) {}
  Storage(const Storage& other) noexcept : block_(other.block_) { retain(); }
  Storage(Storage&& other) noexcept : block_(std::exchange(other.block_, nullptr)) {}
  Storage& operator=(const Storage& other) noexcept {
    Storage(other).swap(*this);
    return *this;
  }
  Storage& operator=(Storage&& other) noexcept {
    Storage(std::move(other)).swap(*this);
    return *this;
  }
  ~Storage() {
    if (block_ != nullptr) release_block(block_);
  }

  void swap(Storage& other) noexcept { std::swap(block_, other.block_); }
  std::byte* data() const { return block_ == nullptr ? nullptr : block_->data(); }
  std::size_t capacity() const { return block_ == nullptr ? 0 : block_->capacity; }
  bool same_block(const Storage& other) const { return block_ == other.block_ && block_ != nullptr; }
  long use_count() const {
    return block_ == nullptr ? 0 : static_cast<long>(block_->refs.load(std::memory_order_acquire));
  }

  // A plain increment, not an atomic read-modify-write (which would cost every PyNative node
  // a locked instruction): two threads granting themselves write access at once race on the
  // elements as well, which is the caller's error, not a count to be exact about.
  void note_write() const {
    if (block_ != nullptr) block_->writes.store(block_->writes.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  std::uint64_t writes() const { return block_ == nullptr ? 0 : block_->writes.load(std::memory_order_relaxed); }
  const void* gradient_of() const { return block_ == nullptr ? nullptr : block_->gradient_of; }
  bool gradient_reached() const { return block_ == nullptr || block_->gradient_reached; }
  void mark_gradient_of(const void* parameter, bool reached) const {
    if (block_ == nullptr) return;
    block_->gradient_of = parameter;
    block_->gradient_reached = reached;
  }

 private:
  void retain() const {
    if (block_ != nullptr) block_->refs.fetch_add(1, std::memory_order_relaxed);
  }
  Block* block_ = nullptr;
};

// Scratch of `count` elements for one kernel call (a convolution's patches, a recurrence's
// gates): from the thread's block cache, so a warm graph allocates nothing (as the GEMM's own
// packing buffer). Valid while `storage` holds it.
template <class T>
T* scratch(Storage& storage, std::size_t count) {
  storage = Storage(count * sizeof(T));
  return reinterpret_cast<T*>(storage.data());
}

}  // namespace detail

// Most bytes a thread keeps cached for reuse; a released block beyond it goes back to the heap.
inline void set_cache_limit(std::size_t bytes) { detail::cache_limit_bytes().store(bytes, std::memory_order_relaxed); }

// Returns the calling thread's cached blocks to the heap (tensors still alive are untouched).
inline void empty_cache() {
  if (detail::BlockCache* cache = detail::thread_block_cache()) cache->clear();
}

}  // namespace duet
