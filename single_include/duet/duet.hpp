// duet: one neural network, two modes. Single-header edition.
// Generated from include/duet by tools/amalgamate.cpp; edit include/, then run
// `cmake --build <build> --target single_include`.
#pragma once
// duet: one neural network, two modes. Include this header for all of duet.

// Differentiation in both modes, behind one API (MindSpore's grad and value_and_grad).
//
// PyNative records a tape while the function runs (tape.hpp) and walks it back. Graph mode
// derives the backward graph from the forward graph's type while the program compiles: each
// node's op names its gradient op and what that op reads, and build_backward appends those
// ops, last node first, summing where a value has several readers. The training graph is
// then planned and run like any other, in one evaluator call. Both modes call the same
// gradient ops, hence the same kernels.

#include <array>
#include <boost/hana/append.hpp>
#include <boost/hana/at.hpp>
#include <boost/hana/concat.hpp>
#include <boost/hana/length.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// Kernels: the maths of every operation, shared by both modes.
//
// PyNative calls a kernel once per node on materialised tensors; the graph evaluator calls
// the same kernel, with the epilogue the passes fused into it. A backend is a struct of
// static kernels; the evaluator takes it as a template parameter, so a backend that derives
// from backend::Eigen and redefines one kernel swaps that operation alone, without touching
// capture or passes.

#include <algorithm>
#include <cmath>
#include <string>

#include <Eigen/Core>
#if !EIGEN_VERSION_AT_LEAST(3, 4, 0)
#error "duet needs Eigen 3.4 or later (nn::ReLU keeps NaN with Eigen::PropagateNaN)"
#endif

// duet: one neural network, two modes.

#include <cstddef>
#include <cstdint>

#define DUET_VERSION_MAJOR 0
#define DUET_VERSION_MINOR 1
#define DUET_VERSION_PATCH 0

namespace duet {

// Signed, as in numpy and MindSpore: -1 spells "dynamic" in shapes and "from the end" in axes.
using index_t = std::int64_t;

// A dimension whose size is known only at run time (MindSpore writes it as -1 or None).
inline constexpr index_t dyn = -1;

// Shapes live inline (no heap) so that creating a tensor costs one block from the pool.
inline constexpr int max_rank = 8;

}  // namespace duet
// The one exception hierarchy of duet: every run-time failure is a duet::Error.

#include <stdexcept>
#include <string>

namespace duet {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Shapes that a layer or operation cannot accept.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// An index or axis outside a tensor.
class IndexError : public Error {
 public:
  using Error::Error;
};

// An argument whose value is invalid (negative size, unknown option, ...).
class ValueError : public Error {
 public:
  using Error::Error;
};

// A feature used where the current mode cannot honour it (e.g. hooks inside a graph).
class ModeError : public Error {
 public:
  using Error::Error;
};

// Reading or writing a file failed; FormatError when the bytes themselves are wrong.
class IOError : public Error {
 public:
  using Error::Error;
};

class FormatError : public IOError {
 public:
  using IOError::IOError;
};

}  // namespace duet
// The dense-layer product with its epilogue fused: C[m, n] = Fns(Σ_k A[m, k]·B[n, k] + bias[n]).
//
// A is the input [M, K] and B the weight [N, K], both row-major, so each output is a dot
// product of two contiguous rows. Three paths, chosen by shape:
//  - small static layers (K·N <= 64, as Dense<4, 4>): plain loops the compiler unrolls
//    completely; packing, or a loop over vectors, would cost more than the arithmetic.
//  - one row (batch 1): a GEMV. Every weight is used once, so the time is the time to stream
//    B from memory; it reads B in place, front to back, and a shuffle tree sums L rows'
//    vectors into one vector of L results for the epilogue.
//  - otherwise: a GEMM in the style of BLIS, with a twist that makes packing cheap. The
//    micro-kernel works on groups of KG = 4 consecutive k: one vector of B holds KG values of
//    each of L/KG rows of B, and is multiplied by the same KG values of a row of A, broadcast
//    (one load). Packing B into that layout moves whole KG-blocks, half the shuffles of a
//    full transpose; A is read in place. A tile of MR rows x L columns of C lives in MR x KG
//    registers for a K block; a short shuffle tree then folds each row's KG vectors into one
//    vector of L sums, and after the last K block the epilogue runs on that vector before
//    the one store, so the output never takes a second pass.
// Every path adds the bias to the finished sum and then applies the functions, in the order
// separate BiasAdd and map kernels would: fused and unfused evaluation agree to the bit.
//
// The GEMV and the GEMM exist once per instruction set (AVX-512, AVX2 + FMA, baseline), in
// detail/gemm_impl.hpp, compiled once per set below; each call runs the set chosen at
// run time (simd/isa.hpp, duet::kernel_isa()). The sets differ in vector width, tile height and
// FMA, so their results differ in the last bits; under one set, every mode computes the same
// bits. A PackedWeight is packed for one set, and only that set reads it.

#include <algorithm>
#include <concepts>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// Tensor storage: reference-counted blocks served from a per-thread caching pool.
//
// Every tensor, in both modes, takes its elements from here. A released block goes back to
// the releasing thread's cache instead of the heap, so a network that runs again on the same
// shapes finds its blocks waiting: once warm, a forward pass makes no heap allocation at all
// (the graph-mode guarantee) and PyNative pays a free-list pop per node instead of malloc.
// The cache is per thread, so concurrent forward passes never contend on a lock.

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

 private:
  void retain() const {
    if (block_ != nullptr) block_->refs.fetch_add(1, std::memory_order_relaxed);
  }
  Block* block_ = nullptr;
};

}  // namespace detail

// Most bytes a thread keeps cached for reuse; a released block beyond it goes back to the heap.
inline void set_cache_limit(std::size_t bytes) { detail::cache_limit_bytes().store(bytes, std::memory_order_relaxed); }

// Returns the calling thread's cached blocks to the heap (tensors still alive are untouched).
inline void empty_cache() {
  if (detail::BlockCache* cache = detail::thread_block_cache()) cache->clear();
}

}  // namespace duet
// The one place where the instruction sets differ: per set, the vector width, the tile height
// and the few operations GCC's vector extensions do not spell (FMA, masked memory access, the
// group broadcast). Everything else in a kernel is written once, on Vec<T>, and compiled once
// per set, in the set's namespace (detail::baseline, detail::avx2, detail::avx512) and between
// its DUET_BEGIN_... and DUET_END_ISA (as kernels/gemm.hpp does with detail/gemm_impl.hpp).
//
// Each set's code is compiled for its target whatever -march the program has, by a target
// region: GCC's `#pragma GCC target`, clang's `#pragma clang attribute push(target)`. Templates
// defined in a region keep its target when instantiated. Code outside the regions (the
// dispatch, the public functions) never handles a vector wider than the baseline's, so no
// vector crosses a call between functions of different targets (-Wpsabi).

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DUET_X86_KERNELS 1
#else
#define DUET_X86_KERNELS 0
#endif

#if defined(__clang__)
#define DUET_BEGIN_AVX2 _Pragma("clang attribute push(__attribute__((target(\"avx2,fma\"))), apply_to = function)")
#define DUET_BEGIN_AVX512 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512dq,avx512bw,avx512vl,avx2,fma\"))), apply_to = function)")
#define DUET_END_ISA _Pragma("clang attribute pop")
#else
#define DUET_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma\")")
#define DUET_BEGIN_AVX512 _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512dq,avx512bw,avx512vl,avx2,fma\")")
#define DUET_END_ISA _Pragma("GCC pop_options")
#endif

namespace duet::kernels::detail {

template <class T, int Bytes>
struct VectorOf {
  typedef T type __attribute__((vector_size(Bytes)));
};

// One SIMD register of Bytes bytes of T, as a GCC vector: arithmetic, comparisons and the
// functions' apply() work on it directly.
template <class T, int Bytes>
using Vector = typename VectorOf<T, Bytes>::type;

}  // namespace duet::kernels::detail

// ---- Baseline: 16-byte vectors in plain C++, which the compiler maps onto SSE2 (or NEON) ----

namespace duet::kernels::detail::baseline {

inline constexpr int vector_bytes = 16;
// Tile rows: MR x KG accumulators, KG vectors of B and a broadcast fit 16 registers.
inline constexpr int MR = 3;
// Vec, lanes, KG, load and store for the set whose vector_bytes is in scope: included once per
// set, inside its namespace (simd/arch.hpp), so no include guard.

template <class T>
using Vec = Vector<T, vector_bytes>;
template <class T>
inline constexpr int lanes = vector_bytes / static_cast<int>(sizeof(T));
// The k-group: a vector of B holds KG consecutive k of L / KG rows (gemm_impl.hpp).
template <class T>
inline constexpr int KG = std::min(4, lanes<T>);

template <class T>
Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}

// The first n lanes from p (0 < n <= lanes), zero in the others; never touches p[n] and on.
template <class T>
Vec<T> load_first(const T* p, int n) {
  Vec<T> v{};
  std::memcpy(&v, p, static_cast<std::size_t>(n) * sizeof(T));
  return v;
}

template <class T>
void store_first(T* p, Vec<T> v, int n) {
  std::memcpy(p, &v, static_cast<std::size_t>(n) * sizeof(T));
}

// a·b + c. Not fused here (the baseline has no FMA): two roundings.
template <class T>
Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
  return a * b + c;
}

// A[p .. p + KG) in every group of KG lanes.
template <class T>
Vec<T> broadcast_group(const T* p) {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = p[i % KG<T>];
  return v;
}

}  // namespace duet::kernels::detail::baseline

#if DUET_X86_KERNELS

// ---- AVX2 + FMA: 32-byte vectors ------------------------------------------------------------

DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {

inline constexpr int vector_bytes = 32;
inline constexpr int MR = 3;
// Vec, lanes, KG, load and store for the set whose vector_bytes is in scope: included once per
// set, inside its namespace (simd/arch.hpp), so no include guard.

template <class T>
using Vec = Vector<T, vector_bytes>;
template <class T>
inline constexpr int lanes = vector_bytes / static_cast<int>(sizeof(T));
// The k-group: a vector of B holds KG consecutive k of L / KG rows (gemm_impl.hpp).
template <class T>
inline constexpr int KG = std::min(4, lanes<T>);

template <class T>
Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}

// All ones in the lanes below n, as AVX2's masked loads and stores want.
template <class T>
__m256i lane_mask(int n) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  } else {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
  }
}

template <class T>
Vec<T> load_first(const T* p, int n) {
  if constexpr (std::is_same_v<T, float>) return _mm256_maskload_ps(p, lane_mask<T>(n));
  else return _mm256_maskload_pd(p, lane_mask<T>(n));
}

template <class T>
void store_first(T* p, Vec<T> v, int n) {
  if constexpr (std::is_same_v<T, float>) _mm256_maskstore_ps(p, lane_mask<T>(n), v);
  else _mm256_maskstore_pd(p, lane_mask<T>(n), v);
}

// a·b + c with one rounding. Spelled out because -std=c++20 (unlike gnu++20) stops GCC from
// contracting a * b + c, which would halve the throughput of the micro-kernel.
template <class T>
Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
  if constexpr (std::is_same_v<T, float>) return _mm256_fmadd_ps(a, b, c);
  else return _mm256_fmadd_pd(a, b, c);
}

template <class T>
Vec<T> broadcast_group(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
  } else {
    return load(p);
  }
}

}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

// ---- AVX-512 (F, DQ, BW, VL): 64-byte vectors ---------------------------------------------

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {

inline constexpr int vector_bytes = 64;
// 32 registers: twice the tile rows.
inline constexpr int MR = 6;
// Vec, lanes, KG, load and store for the set whose vector_bytes is in scope: included once per
// set, inside its namespace (simd/arch.hpp), so no include guard.

template <class T>
using Vec = Vector<T, vector_bytes>;
template <class T>
inline constexpr int lanes = vector_bytes / static_cast<int>(sizeof(T));
// The k-group: a vector of B holds KG consecutive k of L / KG rows (gemm_impl.hpp).
template <class T>
inline constexpr int KG = std::min(4, lanes<T>);

template <class T>
Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}

template <class T>
Vec<T> load_first(const T* p, int n) {
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(mask, p);
  else return _mm512_maskz_loadu_pd(static_cast<__mmask8>(mask), p);
}

template <class T>
void store_first(T* p, Vec<T> v, int n) {
  const auto mask = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p, mask, v);
  else _mm512_mask_storeu_pd(p, static_cast<__mmask8>(mask), v);
}

template <class T>
Vec<T> fma(Vec<T> a, Vec<T> b, Vec<T> c) {
  if constexpr (std::is_same_v<T, float>) return _mm512_fmadd_ps(a, b, c);
  else return _mm512_fmadd_pd(a, b, c);
}

template <class T>
Vec<T> broadcast_group(const T* p) {
  // The zero-masking forms, with every lane selected: the plain ones start from
  // _mm512_undefined_ps, which GCC 12 reports as uninitialised (PR105593).
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_broadcast_f32x4(0xFFFF, _mm_loadu_ps(p));
  else return _mm512_maskz_broadcast_f64x4(0xFF, _mm256_loadu_pd(p));
}

}  // namespace duet::kernels::detail::avx512
DUET_END_ISA

#else

// Elsewhere only the baseline is built; the dispatch never selects the other names.
namespace duet::kernels::detail {
namespace avx2 = baseline;
namespace avx512 = baseline;
}  // namespace duet::kernels::detail

#endif
// Which instruction set the kernels run on, chosen at run time.
//
// Every kernel is compiled for AVX-512, for AVX2 + FMA and for a baseline (SSE2 on x86-64) in
// the same program, whatever -march the program is built with (simd/arch.hpp), and one is
// chosen once, from what the CPU reports (cpuid), as libtorch, oneDNN and OpenBLAS do: a
// program built without -march=native runs the kernels a native build runs.
//
// DUET_ISA=avx2 or DUET_ISA=baseline (read once, on the first product) forces a lower set, so
// that every path can be tested on one machine; DUET_ISA=avx512 asks for the highest. A value
// the CPU cannot run, or an unknown one, is a duet::ValueError from that first product rather
// than a quiet fallback: a run asked to test a path must not test another.

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>


namespace duet::kernels {

// Ordered: a higher set runs on a CPU only if the CPU also runs the lower ones.
enum class Isa : unsigned char { baseline, avx2, avx512 };

inline constexpr std::array<Isa, 3> all_isas = {Isa::baseline, Isa::avx2, Isa::avx512};

inline constexpr std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::baseline: break;
  }
  return "baseline";
}

// Whether this CPU (and its operating system, which must save the wider registers) runs isa.
inline bool cpu_supports(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::avx512:
      // The AVX-512 kernels are compiled for the subset every AVX-512 CPU since Skylake-SP has.
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && cpu_supports(Isa::avx2);
    case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::baseline: break;
  }
  return true;
#else
  return isa == Isa::baseline;
#endif
}

inline Isa best_supported_isa() {
  Isa best = Isa::baseline;
  for (Isa isa : all_isas) {
    if (cpu_supports(isa)) best = isa;
  }
  return best;
}

// isa, after checking that this CPU runs it; where says who asked, for the message.
inline Isa require_supported(Isa isa, std::string_view where) {
  if (!cpu_supports(isa)) {
    throw ValueError(std::string(where) + " asks for the " + std::string(isa_name(isa)) +
                     " kernels, but this CPU does not run them (the best it runs is " +
                     std::string(isa_name(best_supported_isa())) + ")");
  }
  return isa;
}

// The set named by name ("avx512", "avx2" or "baseline"), which this CPU must run.
inline Isa parse_isa(std::string_view name, std::string_view where) {
  for (Isa isa : all_isas) {
    if (name == isa_name(isa)) return require_supported(isa, where);
  }
  throw ValueError(std::string(where) + ": unknown instruction set '" + std::string(name) +
                   "' (expected avx512, avx2 or baseline)");
}

namespace detail {

// The set to start with, given the value of DUET_ISA (null or empty: the best the CPU runs).
inline Isa initial_isa(const char* forced) {
  if (forced == nullptr || *forced == '\0') return best_supported_isa();
  return parse_isa(forced, "DUET_ISA=" + std::string(forced));
}

inline std::atomic<Isa>& active_isa_storage() {
  static std::atomic<Isa> isa{initial_isa(std::getenv("DUET_ISA"))};
  return isa;
}

}  // namespace detail

// The set the kernels run on now.
inline Isa active_isa() { return detail::active_isa_storage().load(std::memory_order_relaxed); }

// Switches the kernels to isa, which this CPU must run (duet::ValueError otherwise). For tests
// and for measuring: call it while no kernel runs on another thread, since a product that has
// started finishes on the set it started on, and the next one may run on the new set.
inline void set_active_isa(Isa isa) {
  detail::active_isa_storage().store(require_supported(isa, "duet::kernels::set_active_isa"), std::memory_order_relaxed);
}

}  // namespace duet::kernels

namespace duet {

// Which kernels run: "avx512", "avx2" or "baseline".
inline std::string_view kernel_isa() { return kernels::isa_name(kernels::active_isa()); }

// Runs the kernels on the named set from now on (see kernels::set_active_isa).
inline void set_kernel_isa(std::string_view name) {
  kernels::detail::active_isa_storage().store(kernels::parse_isa(name, "duet::set_kernel_isa"), std::memory_order_relaxed);
}

}  // namespace duet

namespace duet::kernels {

namespace detail {

// Fns in order, in place on a value or a vector of any set's width (by reference: see
// fn::Relu::apply_in_place).
template <class V, class... Fns>
void apply_all(V& v) {
  (Fns::apply_in_place(v), ...);
}

// ---- Small static layers -------------------------------------------------------------------

template <index_t K, index_t N, class T, class... Fns>
void dense_unrolled(const T* a, index_t m, const T* b, const T* bias, T* c) {
  for (index_t i = 0; i < m; ++i, a += K, c += N) {
    for (index_t j = 0; j < N; ++j) {
      // One chain per output, in k order: a balanced tree measured slower on chains of
      // Dense<4, 4> layers, where each layer waits on the last one's stores.
      T s = T(0);
      for (index_t k = 0; k < K; ++k) s += a[k] * b[j * K + k];
      if (bias != nullptr) s += bias[j];
      apply_all<T, Fns...>(s);
      c[j] = s;
    }
  }
}

// Cache blocking. A K block is 2 KiB of a row, so the packed panel of B (L rows: 32 KiB of
// floats), which every tile down the panel reuses, stays in a 32 KiB L1 or, when the rows of A
// streaming past evict it, comes from L2 at 21 bytes a cycle, well within what L2 delivers. An
// M block keeps the rows of A that every panel meets (MC x K) within half of a 1 MiB L2; each
// M block packs B again, a cost spread over MC rows. Measured on the seed layers, 1 KiB and
// 4 KiB K blocks were a few percent slower.
inline constexpr index_t KC_bytes = 2048;
inline constexpr index_t MC_bytes = 512 * 1024;

// Splits extent into the fewest blocks of at most limit, of equal size rounded up to a multiple
// of step: 784 in blocks of 256 becomes 4 x 196 rather than 3 x 256 + 16.
inline index_t balanced_block(index_t extent, index_t limit, index_t step) {
  const index_t blocks = (extent + limit - 1) / limit;
  const index_t size = (extent + blocks - 1) / blocks;
  return (size + step - 1) / step * step;
}

// B packed once, whole, in the panels the blocked product would otherwise pack on every call,
// for one instruction set's kernels (by default those active when it is made). Panel p (rows p·L .. p·L + L of B) holds the
// whole depth, rounded up to a group, in pack_panel's layout, so the K block at k0 of a panel
// is the k0·L-th element on: the product reads exactly what it reads after packing, and gives
// the same bits.
template <class T>
class PackedWeight {
 public:
  PackedWeight(const T* b, index_t n, index_t k, Isa isa = active_isa());

  index_t rows() const { return n_; }
  index_t depth() const { return k_; }
  Isa isa() const { return isa_; }
  const T* end() const { return panel(n_ + lanes_ - 1, 0); }
  const T* panel(index_t j0, index_t k0) const { return elements() + offset(j0, k0); }

 private:
  index_t padded(index_t k) const { return (k + group_ - 1) / group_ * group_; }
  index_t offset(index_t j0, index_t k0) const { return (j0 / lanes_) * padded(k_) * lanes_ + k0 * lanes_; }
  T* elements() const { return reinterpret_cast<T*>(storage_.data()); }

  Isa isa_;
  int lanes_ = 0;
  int group_ = 0;
  index_t n_;
  index_t k_;
  ::duet::detail::Storage storage_;
};

}  // namespace detail

}  // namespace duet::kernels

// The product once per instruction set, each in its namespace and target region.
namespace duet::kernels::detail::baseline {
// One instruction set's dense-layer kernels: the algorithm gemm.hpp describes, written once on
// the set's Vec<T>, lanes<T>, KG<T>, MR, load, store, fma, load_first, store_first and broadcast_group
// (simd/arch.hpp). No include guard and no includes: gemm.hpp includes it once per set, inside
// that set's namespace and target region, so each copy is compiled for its set.

// ---- Shuffles, written once for every vector width ---------------------------------------

// The perfect shuffle on blocks of B lanes: blocks of a and b, alternately, from the low (or
// high) halves.
template <int B, class T, int... I>
Vec<T> interleave_low(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + I / (2 * B) * B + I % B)...);
}

template <int B, class T, int... I>
Vec<T> interleave_high(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + L / 2 + I / (2 * B) * B + I % B)...);
}

// Transposes Q x Q blocks of B lanes (Q = L / B): block g of r[i] goes to block i of r[g].
// This and the folds below take arrays of registers by pointer; always inlined, so that the
// arrays stay in registers instead of going through memory.
template <int B, class T>
[[gnu::always_inline]] inline void transpose_blocks(Vec<T>* r) {
  constexpr int Q = lanes<T> / B;
  constexpr auto all = std::make_integer_sequence<int, lanes<T>>{};
  for (int round = 1; round < Q; round *= 2) {
    Vec<T> t[Q];
    for (int i = 0; i < Q / 2; ++i) {
      t[2 * i] = interleave_low<B, T>(r[i], r[i + Q / 2], all);
      t[2 * i + 1] = interleave_high<B, T>(r[i], r[i + Q / 2], all);
    }
    std::copy(t, t + Q, r);
  }
}

// Lanes [0, L/2) of the result sum pairs of W-lane groups of a, lanes [L/2, L) those of b:
// one step of a reduction tree that keeps the partial sums of both vectors, in order.
template <int W, class T, int... I>
Vec<T> fold_pair(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int H = lanes<T> / 2;
  constexpr auto from = [](int r, int shift) { return (r < H ? 0 : 2 * H) + (r % H) / W * 2 * W + r % W + shift; };
  return __builtin_shufflevector(a, b, from(I, 0)...) + __builtin_shufflevector(a, b, from(I, W)...);
}

template <int W, class T>
[[gnu::always_inline]] inline void fold_level(Vec<T>* v, int count) {
  for (int i = 0; i < count; ++i) v[i] = fold_pair<W, T>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, lanes<T>>{});
  if constexpr (W > 1) fold_level<W / 2, T>(v, count / 2);
}

// Lane i of the result is the sum of the lanes of v[i]; v is clobbered.
template <class T>
Vec<T> sum_lanes(Vec<T> (&v)[lanes<T>]) {
  fold_level<lanes<T> / 2, T>(v, lanes<T> / 2);
  return v[0];
}

// ---- One row ---------------------------------------------------------------------------------

template <class T, class... Fns>
void gemv(const T* a, index_t k, const T* b, index_t n, const T* bias, T* c) {
  constexpr int L = lanes<T>;
  const index_t k_pairs = k / (2 * L) * (2 * L);
  const index_t k_full = k / L * L;
  const int k_rest = static_cast<int>(k - k_full);
  for (index_t j0 = 0; j0 < n; j0 += L) {
    const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
    Vec<T> acc[L] = {};
    // Row after row, so that B is read front to back as one stream, which the hardware
    // prefetcher follows best (blocks of rows side by side were slower); two accumulators per
    // row, and the next rows' independent chains, keep the FMA latency hidden.
    for (int r = 0; r < cols; ++r) {
      const T* w = b + (j0 + r) * k;
      Vec<T> even{};
      Vec<T> odd{};
      index_t p = 0;
      for (; p < k_pairs; p += 2 * L) {
        even = fma<T>(load(w + p), load(a + p), even);
        odd = fma<T>(load(w + p + L), load(a + p + L), odd);
      }
      if (p < k_full) even = fma<T>(load(w + p), load(a + p), even);
      if (k_rest != 0) odd = fma<T>(load_first(w + k_full, k_rest), load_first(a + k_full, k_rest), odd);
      acc[r] = even + odd;
    }
    Vec<T> s = sum_lanes<T>(acc);
    if (bias != nullptr) s += load_first(bias + j0, cols);
    apply_all<Vec<T>, Fns...>(s);
    store_first<T>(c + j0, s, cols);
  }
}

// The panel of B for one tile (L rows from src, zero past rows, and depth k, zero-padded to a
// whole group): vector j of group g holds, in block q, B[j·Q + q][g·KG .. g·KG + KG).
template <class T>
void pack_panel(const T* src, index_t ld, int rows, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int Q = L / KG<T>;
  for (int j = 0; j < KG<T>; ++j) {
    for (index_t p0 = 0; p0 < depth; p0 += L) {
      const int count = static_cast<int>(std::min<index_t>(L, depth - p0));
      Vec<T> r[Q];
      for (int q = 0; q < Q; ++q) {
        const int row = j * Q + q;
        const T* from = src + row * ld + p0;
        r[q] = row >= rows ? Vec<T>{} : count == L ? load(from) : load_first(from, count);
      }
      transpose_blocks<KG<T>, T>(r);
      const index_t group0 = p0 / KG<T>;
      for (int g = 0; g * KG<T> < count; ++g) store<T>(dst + ((group0 + g) * KG<T> + j) * L, r[g]);
    }
  }
}

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> bv[G];
  for (int j = 0; j < G; ++j) bv[j] = load(bp + j * lanes<T>);
  for (int i = 0; i < MR; ++i) {
    Vec<T> av;
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av = broadcast_group<T>(group);
    } else {
      av = broadcast_group<T>(ar[i] + p);
    }
    for (int j = 0; j < G; ++j) acc[i][j] = fma<T>(av, bv[j], acc[i][j]);
  }
}

// C tile (rows x cols, at most MR x L) from MR rows of A, read in place, and a packed panel of
// B. Adds to C unless first; bias and Fns only after the last K block (last). Never inlined:
// inlined into a large caller, GCC 12 stored every accumulator at every step (2.5x slower).
template <class T, class... Fns>
[[gnu::noinline]] void micro_kernel(index_t depth, const T* a, index_t lda, int rows, const T* bp, T* c, index_t ldc, int cols,
                  bool first, bool last, const T* bias) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  // Past the last row, repeat it: the extra tile rows are computed but never stored.
  const T* ar[MR];
  for (int i = 0; i < MR; ++i) ar[i] = a + std::min(i, rows - 1) * lda;
  Vec<T> acc[MR][G] = {};
  const index_t whole = depth / G * G;
  for (index_t p = 0; p < whole; p += G, bp += G * L) tile_step<false, T>(acc, ar, p, bp, 0);
  // The last, partial group: A is not read past depth (its row may end there).
  if (whole < depth) tile_step<true, T>(acc, ar, whole, bp, static_cast<std::size_t>(depth - whole));
  for (int i = 0; i < MR && i < rows; ++i, c += ldc) {
    fold_level<G / 2, T>(acc[i], G / 2);
    Vec<T> v = acc[i][0];
    if (cols == L) {
      if (!first) v += load(c);
      if (last) {
        if (bias != nullptr) v += load(bias);
        apply_all<Vec<T>, Fns...>(v);
      }
      store<T>(c, v);
    } else {
      if (!first) v += load_first(c, cols);
      if (last) {
        if (bias != nullptr) v += load_first(bias, cols);
        apply_all<Vec<T>, Fns...>(v);
      }
      store_first<T>(c, v, cols);
    }
  }
}

// packed: B already packed, or null to pack each panel as it is reached.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  ::duet::detail::Storage scratch(packed != nullptr ? 0 : static_cast<std::size_t>(kc * L * size));
  T* panel = reinterpret_cast<T*>(scratch.data());
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = 0; j0 < n; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else pack_panel(b + j0 * k + k0, k, cols, depth, panel);
        // A packed panel comes from L3 or memory, and its first tile would wait for it. The
        // panels lie in the order they are used, so each tile fetches a slice of the next one
        // into L2, and it is there when wanted.
        const std::byte* ahead = nullptr;
        index_t ahead_bytes = 0;
        index_t slice = 0;
        if (packed != nullptr) {
          ahead = reinterpret_cast<const std::byte*>(bp + (depth + KG<T> - 1) / KG<T> * KG<T> * L);
          ahead_bytes = std::min<index_t>(reinterpret_cast<const std::byte*>(packed->end()) - ahead, kc * L * size);
          const index_t tiles = (m1 - m0 + MR - 1) / MR;
          slice = (ahead_bytes + tiles - 1) / tiles;
        }
        index_t fetched = 0;
        for (index_t i0 = m0; i0 < m1; i0 += MR) {
          micro_kernel<T, Fns...>(depth, a + i0 * k + k0, k, static_cast<int>(std::min<index_t>(MR, m1 - i0)), bp,
                                  c + i0 * n + j0, n, cols, k0 == 0, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

// The entry points gemm() and PackedWeight dispatch to (with_kernels in gemm.hpp).
struct Kernels {
  template <class T>
  static constexpr int lanes_of = lanes<T>;
  template <class T>
  static constexpr int group_of = KG<T>;

  template <class T, class... Fns>
  static void gemv_rows(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
    for (index_t i = 0; i < m; ++i) gemv<T, Fns...>(a + i * k, k, b, n, bias, c + i * n);
  }

  template <class T, class... Fns>
  static void blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                      const PackedWeight<T>* packed) {
    gemm_blocked<T, Fns...>(a, m, k, b, n, bias, c, packed);
  }

  // Every panel of b ([n, k]) into dst, panel after panel, panel_size elements apart.
  template <class T>
  static void pack(const T* b, index_t n, index_t k, index_t panel_size, T* dst) {
    for (index_t j0 = 0; j0 < n; j0 += lanes<T>) {
      pack_panel(b + j0 * k, k, static_cast<int>(std::min<index_t>(lanes<T>, n - j0)), k, dst + j0 / lanes<T> * panel_size);
    }
  }
};
}  // namespace duet::kernels::detail::baseline

#if DUET_X86_KERNELS
DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {
// One instruction set's dense-layer kernels: the algorithm gemm.hpp describes, written once on
// the set's Vec<T>, lanes<T>, KG<T>, MR, load, store, fma, load_first, store_first and broadcast_group
// (simd/arch.hpp). No include guard and no includes: gemm.hpp includes it once per set, inside
// that set's namespace and target region, so each copy is compiled for its set.

// ---- Shuffles, written once for every vector width ---------------------------------------

// The perfect shuffle on blocks of B lanes: blocks of a and b, alternately, from the low (or
// high) halves.
template <int B, class T, int... I>
Vec<T> interleave_low(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + I / (2 * B) * B + I % B)...);
}

template <int B, class T, int... I>
Vec<T> interleave_high(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + L / 2 + I / (2 * B) * B + I % B)...);
}

// Transposes Q x Q blocks of B lanes (Q = L / B): block g of r[i] goes to block i of r[g].
// This and the folds below take arrays of registers by pointer; always inlined, so that the
// arrays stay in registers instead of going through memory.
template <int B, class T>
[[gnu::always_inline]] inline void transpose_blocks(Vec<T>* r) {
  constexpr int Q = lanes<T> / B;
  constexpr auto all = std::make_integer_sequence<int, lanes<T>>{};
  for (int round = 1; round < Q; round *= 2) {
    Vec<T> t[Q];
    for (int i = 0; i < Q / 2; ++i) {
      t[2 * i] = interleave_low<B, T>(r[i], r[i + Q / 2], all);
      t[2 * i + 1] = interleave_high<B, T>(r[i], r[i + Q / 2], all);
    }
    std::copy(t, t + Q, r);
  }
}

// Lanes [0, L/2) of the result sum pairs of W-lane groups of a, lanes [L/2, L) those of b:
// one step of a reduction tree that keeps the partial sums of both vectors, in order.
template <int W, class T, int... I>
Vec<T> fold_pair(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int H = lanes<T> / 2;
  constexpr auto from = [](int r, int shift) { return (r < H ? 0 : 2 * H) + (r % H) / W * 2 * W + r % W + shift; };
  return __builtin_shufflevector(a, b, from(I, 0)...) + __builtin_shufflevector(a, b, from(I, W)...);
}

template <int W, class T>
[[gnu::always_inline]] inline void fold_level(Vec<T>* v, int count) {
  for (int i = 0; i < count; ++i) v[i] = fold_pair<W, T>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, lanes<T>>{});
  if constexpr (W > 1) fold_level<W / 2, T>(v, count / 2);
}

// Lane i of the result is the sum of the lanes of v[i]; v is clobbered.
template <class T>
Vec<T> sum_lanes(Vec<T> (&v)[lanes<T>]) {
  fold_level<lanes<T> / 2, T>(v, lanes<T> / 2);
  return v[0];
}

// ---- One row ---------------------------------------------------------------------------------

template <class T, class... Fns>
void gemv(const T* a, index_t k, const T* b, index_t n, const T* bias, T* c) {
  constexpr int L = lanes<T>;
  const index_t k_pairs = k / (2 * L) * (2 * L);
  const index_t k_full = k / L * L;
  const int k_rest = static_cast<int>(k - k_full);
  for (index_t j0 = 0; j0 < n; j0 += L) {
    const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
    Vec<T> acc[L] = {};
    // Row after row, so that B is read front to back as one stream, which the hardware
    // prefetcher follows best (blocks of rows side by side were slower); two accumulators per
    // row, and the next rows' independent chains, keep the FMA latency hidden.
    for (int r = 0; r < cols; ++r) {
      const T* w = b + (j0 + r) * k;
      Vec<T> even{};
      Vec<T> odd{};
      index_t p = 0;
      for (; p < k_pairs; p += 2 * L) {
        even = fma<T>(load(w + p), load(a + p), even);
        odd = fma<T>(load(w + p + L), load(a + p + L), odd);
      }
      if (p < k_full) even = fma<T>(load(w + p), load(a + p), even);
      if (k_rest != 0) odd = fma<T>(load_first(w + k_full, k_rest), load_first(a + k_full, k_rest), odd);
      acc[r] = even + odd;
    }
    Vec<T> s = sum_lanes<T>(acc);
    if (bias != nullptr) s += load_first(bias + j0, cols);
    apply_all<Vec<T>, Fns...>(s);
    store_first<T>(c + j0, s, cols);
  }
}

// The panel of B for one tile (L rows from src, zero past rows, and depth k, zero-padded to a
// whole group): vector j of group g holds, in block q, B[j·Q + q][g·KG .. g·KG + KG).
template <class T>
void pack_panel(const T* src, index_t ld, int rows, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int Q = L / KG<T>;
  for (int j = 0; j < KG<T>; ++j) {
    for (index_t p0 = 0; p0 < depth; p0 += L) {
      const int count = static_cast<int>(std::min<index_t>(L, depth - p0));
      Vec<T> r[Q];
      for (int q = 0; q < Q; ++q) {
        const int row = j * Q + q;
        const T* from = src + row * ld + p0;
        r[q] = row >= rows ? Vec<T>{} : count == L ? load(from) : load_first(from, count);
      }
      transpose_blocks<KG<T>, T>(r);
      const index_t group0 = p0 / KG<T>;
      for (int g = 0; g * KG<T> < count; ++g) store<T>(dst + ((group0 + g) * KG<T> + j) * L, r[g]);
    }
  }
}

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> bv[G];
  for (int j = 0; j < G; ++j) bv[j] = load(bp + j * lanes<T>);
  for (int i = 0; i < MR; ++i) {
    Vec<T> av;
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av = broadcast_group<T>(group);
    } else {
      av = broadcast_group<T>(ar[i] + p);
    }
    for (int j = 0; j < G; ++j) acc[i][j] = fma<T>(av, bv[j], acc[i][j]);
  }
}

// C tile (rows x cols, at most MR x L) from MR rows of A, read in place, and a packed panel of
// B. Adds to C unless first; bias and Fns only after the last K block (last). Never inlined:
// inlined into a large caller, GCC 12 stored every accumulator at every step (2.5x slower).
template <class T, class... Fns>
[[gnu::noinline]] void micro_kernel(index_t depth, const T* a, index_t lda, int rows, const T* bp, T* c, index_t ldc, int cols,
                  bool first, bool last, const T* bias) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  // Past the last row, repeat it: the extra tile rows are computed but never stored.
  const T* ar[MR];
  for (int i = 0; i < MR; ++i) ar[i] = a + std::min(i, rows - 1) * lda;
  Vec<T> acc[MR][G] = {};
  const index_t whole = depth / G * G;
  for (index_t p = 0; p < whole; p += G, bp += G * L) tile_step<false, T>(acc, ar, p, bp, 0);
  // The last, partial group: A is not read past depth (its row may end there).
  if (whole < depth) tile_step<true, T>(acc, ar, whole, bp, static_cast<std::size_t>(depth - whole));
  for (int i = 0; i < MR && i < rows; ++i, c += ldc) {
    fold_level<G / 2, T>(acc[i], G / 2);
    Vec<T> v = acc[i][0];
    if (cols == L) {
      if (!first) v += load(c);
      if (last) {
        if (bias != nullptr) v += load(bias);
        apply_all<Vec<T>, Fns...>(v);
      }
      store<T>(c, v);
    } else {
      if (!first) v += load_first(c, cols);
      if (last) {
        if (bias != nullptr) v += load_first(bias, cols);
        apply_all<Vec<T>, Fns...>(v);
      }
      store_first<T>(c, v, cols);
    }
  }
}

// packed: B already packed, or null to pack each panel as it is reached.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  ::duet::detail::Storage scratch(packed != nullptr ? 0 : static_cast<std::size_t>(kc * L * size));
  T* panel = reinterpret_cast<T*>(scratch.data());
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = 0; j0 < n; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else pack_panel(b + j0 * k + k0, k, cols, depth, panel);
        // A packed panel comes from L3 or memory, and its first tile would wait for it. The
        // panels lie in the order they are used, so each tile fetches a slice of the next one
        // into L2, and it is there when wanted.
        const std::byte* ahead = nullptr;
        index_t ahead_bytes = 0;
        index_t slice = 0;
        if (packed != nullptr) {
          ahead = reinterpret_cast<const std::byte*>(bp + (depth + KG<T> - 1) / KG<T> * KG<T> * L);
          ahead_bytes = std::min<index_t>(reinterpret_cast<const std::byte*>(packed->end()) - ahead, kc * L * size);
          const index_t tiles = (m1 - m0 + MR - 1) / MR;
          slice = (ahead_bytes + tiles - 1) / tiles;
        }
        index_t fetched = 0;
        for (index_t i0 = m0; i0 < m1; i0 += MR) {
          micro_kernel<T, Fns...>(depth, a + i0 * k + k0, k, static_cast<int>(std::min<index_t>(MR, m1 - i0)), bp,
                                  c + i0 * n + j0, n, cols, k0 == 0, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

// The entry points gemm() and PackedWeight dispatch to (with_kernels in gemm.hpp).
struct Kernels {
  template <class T>
  static constexpr int lanes_of = lanes<T>;
  template <class T>
  static constexpr int group_of = KG<T>;

  template <class T, class... Fns>
  static void gemv_rows(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
    for (index_t i = 0; i < m; ++i) gemv<T, Fns...>(a + i * k, k, b, n, bias, c + i * n);
  }

  template <class T, class... Fns>
  static void blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                      const PackedWeight<T>* packed) {
    gemm_blocked<T, Fns...>(a, m, k, b, n, bias, c, packed);
  }

  // Every panel of b ([n, k]) into dst, panel after panel, panel_size elements apart.
  template <class T>
  static void pack(const T* b, index_t n, index_t k, index_t panel_size, T* dst) {
    for (index_t j0 = 0; j0 < n; j0 += lanes<T>) {
      pack_panel(b + j0 * k, k, static_cast<int>(std::min<index_t>(lanes<T>, n - j0)), k, dst + j0 / lanes<T> * panel_size);
    }
  }
};
}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {
// One instruction set's dense-layer kernels: the algorithm gemm.hpp describes, written once on
// the set's Vec<T>, lanes<T>, KG<T>, MR, load, store, fma, load_first, store_first and broadcast_group
// (simd/arch.hpp). No include guard and no includes: gemm.hpp includes it once per set, inside
// that set's namespace and target region, so each copy is compiled for its set.

// ---- Shuffles, written once for every vector width ---------------------------------------

// The perfect shuffle on blocks of B lanes: blocks of a and b, alternately, from the low (or
// high) halves.
template <int B, class T, int... I>
Vec<T> interleave_low(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + I / (2 * B) * B + I % B)...);
}

template <int B, class T, int... I>
Vec<T> interleave_high(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int L = lanes<T>;
  return __builtin_shufflevector(a, b, ((I / B) % 2 * L + L / 2 + I / (2 * B) * B + I % B)...);
}

// Transposes Q x Q blocks of B lanes (Q = L / B): block g of r[i] goes to block i of r[g].
// This and the folds below take arrays of registers by pointer; always inlined, so that the
// arrays stay in registers instead of going through memory.
template <int B, class T>
[[gnu::always_inline]] inline void transpose_blocks(Vec<T>* r) {
  constexpr int Q = lanes<T> / B;
  constexpr auto all = std::make_integer_sequence<int, lanes<T>>{};
  for (int round = 1; round < Q; round *= 2) {
    Vec<T> t[Q];
    for (int i = 0; i < Q / 2; ++i) {
      t[2 * i] = interleave_low<B, T>(r[i], r[i + Q / 2], all);
      t[2 * i + 1] = interleave_high<B, T>(r[i], r[i + Q / 2], all);
    }
    std::copy(t, t + Q, r);
  }
}

// Lanes [0, L/2) of the result sum pairs of W-lane groups of a, lanes [L/2, L) those of b:
// one step of a reduction tree that keeps the partial sums of both vectors, in order.
template <int W, class T, int... I>
Vec<T> fold_pair(Vec<T> a, Vec<T> b, std::integer_sequence<int, I...>) {
  constexpr int H = lanes<T> / 2;
  constexpr auto from = [](int r, int shift) { return (r < H ? 0 : 2 * H) + (r % H) / W * 2 * W + r % W + shift; };
  return __builtin_shufflevector(a, b, from(I, 0)...) + __builtin_shufflevector(a, b, from(I, W)...);
}

template <int W, class T>
[[gnu::always_inline]] inline void fold_level(Vec<T>* v, int count) {
  for (int i = 0; i < count; ++i) v[i] = fold_pair<W, T>(v[2 * i], v[2 * i + 1], std::make_integer_sequence<int, lanes<T>>{});
  if constexpr (W > 1) fold_level<W / 2, T>(v, count / 2);
}

// Lane i of the result is the sum of the lanes of v[i]; v is clobbered.
template <class T>
Vec<T> sum_lanes(Vec<T> (&v)[lanes<T>]) {
  fold_level<lanes<T> / 2, T>(v, lanes<T> / 2);
  return v[0];
}

// ---- One row ---------------------------------------------------------------------------------

template <class T, class... Fns>
void gemv(const T* a, index_t k, const T* b, index_t n, const T* bias, T* c) {
  constexpr int L = lanes<T>;
  const index_t k_pairs = k / (2 * L) * (2 * L);
  const index_t k_full = k / L * L;
  const int k_rest = static_cast<int>(k - k_full);
  for (index_t j0 = 0; j0 < n; j0 += L) {
    const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
    Vec<T> acc[L] = {};
    // Row after row, so that B is read front to back as one stream, which the hardware
    // prefetcher follows best (blocks of rows side by side were slower); two accumulators per
    // row, and the next rows' independent chains, keep the FMA latency hidden.
    for (int r = 0; r < cols; ++r) {
      const T* w = b + (j0 + r) * k;
      Vec<T> even{};
      Vec<T> odd{};
      index_t p = 0;
      for (; p < k_pairs; p += 2 * L) {
        even = fma<T>(load(w + p), load(a + p), even);
        odd = fma<T>(load(w + p + L), load(a + p + L), odd);
      }
      if (p < k_full) even = fma<T>(load(w + p), load(a + p), even);
      if (k_rest != 0) odd = fma<T>(load_first(w + k_full, k_rest), load_first(a + k_full, k_rest), odd);
      acc[r] = even + odd;
    }
    Vec<T> s = sum_lanes<T>(acc);
    if (bias != nullptr) s += load_first(bias + j0, cols);
    apply_all<Vec<T>, Fns...>(s);
    store_first<T>(c + j0, s, cols);
  }
}

// The panel of B for one tile (L rows from src, zero past rows, and depth k, zero-padded to a
// whole group): vector j of group g holds, in block q, B[j·Q + q][g·KG .. g·KG + KG).
template <class T>
void pack_panel(const T* src, index_t ld, int rows, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int Q = L / KG<T>;
  for (int j = 0; j < KG<T>; ++j) {
    for (index_t p0 = 0; p0 < depth; p0 += L) {
      const int count = static_cast<int>(std::min<index_t>(L, depth - p0));
      Vec<T> r[Q];
      for (int q = 0; q < Q; ++q) {
        const int row = j * Q + q;
        const T* from = src + row * ld + p0;
        r[q] = row >= rows ? Vec<T>{} : count == L ? load(from) : load_first(from, count);
      }
      transpose_blocks<KG<T>, T>(r);
      const index_t group0 = p0 / KG<T>;
      for (int g = 0; g * KG<T> < count; ++g) store<T>(dst + ((group0 + g) * KG<T> + j) * L, r[g]);
    }
  }
}

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> bv[G];
  for (int j = 0; j < G; ++j) bv[j] = load(bp + j * lanes<T>);
  for (int i = 0; i < MR; ++i) {
    Vec<T> av;
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av = broadcast_group<T>(group);
    } else {
      av = broadcast_group<T>(ar[i] + p);
    }
    for (int j = 0; j < G; ++j) acc[i][j] = fma<T>(av, bv[j], acc[i][j]);
  }
}

// C tile (rows x cols, at most MR x L) from MR rows of A, read in place, and a packed panel of
// B. Adds to C unless first; bias and Fns only after the last K block (last). Never inlined:
// inlined into a large caller, GCC 12 stored every accumulator at every step (2.5x slower).
template <class T, class... Fns>
[[gnu::noinline]] void micro_kernel(index_t depth, const T* a, index_t lda, int rows, const T* bp, T* c, index_t ldc, int cols,
                  bool first, bool last, const T* bias) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  // Past the last row, repeat it: the extra tile rows are computed but never stored.
  const T* ar[MR];
  for (int i = 0; i < MR; ++i) ar[i] = a + std::min(i, rows - 1) * lda;
  Vec<T> acc[MR][G] = {};
  const index_t whole = depth / G * G;
  for (index_t p = 0; p < whole; p += G, bp += G * L) tile_step<false, T>(acc, ar, p, bp, 0);
  // The last, partial group: A is not read past depth (its row may end there).
  if (whole < depth) tile_step<true, T>(acc, ar, whole, bp, static_cast<std::size_t>(depth - whole));
  for (int i = 0; i < MR && i < rows; ++i, c += ldc) {
    fold_level<G / 2, T>(acc[i], G / 2);
    Vec<T> v = acc[i][0];
    if (cols == L) {
      if (!first) v += load(c);
      if (last) {
        if (bias != nullptr) v += load(bias);
        apply_all<Vec<T>, Fns...>(v);
      }
      store<T>(c, v);
    } else {
      if (!first) v += load_first(c, cols);
      if (last) {
        if (bias != nullptr) v += load_first(bias, cols);
        apply_all<Vec<T>, Fns...>(v);
      }
      store_first<T>(c, v, cols);
    }
  }
}

// packed: B already packed, or null to pack each panel as it is reached.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  ::duet::detail::Storage scratch(packed != nullptr ? 0 : static_cast<std::size_t>(kc * L * size));
  T* panel = reinterpret_cast<T*>(scratch.data());
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = 0; j0 < n; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else pack_panel(b + j0 * k + k0, k, cols, depth, panel);
        // A packed panel comes from L3 or memory, and its first tile would wait for it. The
        // panels lie in the order they are used, so each tile fetches a slice of the next one
        // into L2, and it is there when wanted.
        const std::byte* ahead = nullptr;
        index_t ahead_bytes = 0;
        index_t slice = 0;
        if (packed != nullptr) {
          ahead = reinterpret_cast<const std::byte*>(bp + (depth + KG<T> - 1) / KG<T> * KG<T> * L);
          ahead_bytes = std::min<index_t>(reinterpret_cast<const std::byte*>(packed->end()) - ahead, kc * L * size);
          const index_t tiles = (m1 - m0 + MR - 1) / MR;
          slice = (ahead_bytes + tiles - 1) / tiles;
        }
        index_t fetched = 0;
        for (index_t i0 = m0; i0 < m1; i0 += MR) {
          micro_kernel<T, Fns...>(depth, a + i0 * k + k0, k, static_cast<int>(std::min<index_t>(MR, m1 - i0)), bp,
                                  c + i0 * n + j0, n, cols, k0 == 0, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

// The entry points gemm() and PackedWeight dispatch to (with_kernels in gemm.hpp).
struct Kernels {
  template <class T>
  static constexpr int lanes_of = lanes<T>;
  template <class T>
  static constexpr int group_of = KG<T>;

  template <class T, class... Fns>
  static void gemv_rows(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c) {
    for (index_t i = 0; i < m; ++i) gemv<T, Fns...>(a + i * k, k, b, n, bias, c + i * n);
  }

  template <class T, class... Fns>
  static void blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                      const PackedWeight<T>* packed) {
    gemm_blocked<T, Fns...>(a, m, k, b, n, bias, c, packed);
  }

  // Every panel of b ([n, k]) into dst, panel after panel, panel_size elements apart.
  template <class T>
  static void pack(const T* b, index_t n, index_t k, index_t panel_size, T* dst) {
    for (index_t j0 = 0; j0 < n; j0 += lanes<T>) {
      pack_panel(b + j0 * k, k, static_cast<int>(std::min<index_t>(lanes<T>, n - j0)), k, dst + j0 / lanes<T> * panel_size);
    }
  }
};
}  // namespace duet::kernels::detail::avx512
DUET_END_ISA
#endif

namespace duet::kernels {

namespace detail {

// f(Kernels) with the kernels of isa: the one switch from the run-time choice to code
// compiled for it. Only pointers and sizes cross it.
template <class F>
decltype(auto) with_kernels(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f(avx512::Kernels{});
    case Isa::avx2: return f(avx2::Kernels{});
    case Isa::baseline: break;
  }
  return f(baseline::Kernels{});
}

template <class T>
PackedWeight<T>::PackedWeight(const T* b, index_t n, index_t k, Isa isa) : isa_(isa), n_(n), k_(k) {
  with_kernels(isa_, [&]<class K>(K) {
    lanes_ = K::template lanes_of<T>;
    group_ = K::template group_of<T>;
    const index_t panel_size = padded(k) * lanes_;
    storage_ = ::duet::detail::Storage(static_cast<std::size_t>((n + lanes_ - 1) / lanes_ * panel_size) * sizeof(T));
    K::pack(b, n, k, panel_size, elements());
  });
}

enum class Path : unsigned char { none, unrolled, gemv, blocked };

template <index_t K, index_t N>
Path path_of(index_t m, index_t k, index_t n) {
  if constexpr (K != dyn && N != dyn && K * N <= 64) {
    return Path::unrolled;
  } else {
    // k == 0 has no K block for the blocked path to finish on; the GEMV gives bias and Fns.
    if (m == 1 || k == 0) return Path::gemv;
    return m > 0 && n > 0 ? Path::blocked : Path::none;
  }
}

}  // namespace detail

// An elementwise function the kernels can apply in registers: Fn::apply(v) on a scalar and on
// a SIMD vector of the same element type.
template <class Fn, class T>
concept VectorFunction =
    requires(T& s, detail::Vector<T, 16>& v16, detail::Vector<T, 32>& v32, detail::Vector<T, 64>& v64) {
      Fn::apply_in_place(s);
      Fn::apply_in_place(v16);
      Fn::apply_in_place(v32);
      Fn::apply_in_place(v64);
    };

template <class T, class... Fns>
inline constexpr bool gemm_supports =
    (std::is_same_v<T, float> || std::is_same_v<T, double>) && (VectorFunction<Fns, T> && ...);

template <class T>
using PackedWeight = detail::PackedWeight<T>;

// A PackedWeight as a type of its own for each set's Kernels, for caches that keep one form
// per type (nn::BasicParameter::derived).
template <class T, class Kernels>
struct PackedWeightFor : PackedWeight<T> {
  using PackedWeight<T>::PackedWeight;
};

// Whether gemm on these sizes reads a packed weight when given one: the blocked product does;
// a GEMV reads every weight once, in place, and small static layers are unrolled.
template <index_t K = dyn, index_t N = dyn>
bool reads_packed_weight(index_t m, index_t k, index_t n) {
  return detail::path_of<K, N>(m, k, n) == detail::Path::blocked;
}

// c[m, n] = Fns(Σ_k a[m, k] · b[n, k] + bias[n]), each Fn applied in order; bias may be null.
// a is [m, k], b is [n, k] (a weight as [out, in]) and c is [m, n], all row-major and dense;
// no alignment is assumed. K and N are k and n when known at compile time, dyn otherwise.
// packed_b, if given, is PackedWeight(b, n, k), and saves packing b again; one packed for
// another instruction set (before a set_kernel_isa) has another layout, and is not read.
// After the first call on a thread for a given size, no heap allocation.
template <index_t K = dyn, index_t N = dyn, class... Fns, class T>
  requires gemm_supports<T, Fns...>
void gemm(const T* a, index_t m, index_t k, const T* b, index_t n, std::type_identity_t<const T*> bias, T* c,
          const PackedWeight<std::type_identity_t<T>>* packed_b = nullptr) {
  const Isa isa = active_isa();
  switch (detail::path_of<K, N>(m, k, n)) {
    case detail::Path::unrolled:
      if constexpr (K != dyn && N != dyn) detail::dense_unrolled<K, N, T, Fns...>(a, m, b, bias, c);
      break;
    case detail::Path::gemv:
      detail::with_kernels(isa, [&]<class Kernels>(Kernels) { Kernels::template gemv_rows<T, Fns...>(a, m, k, b, n, bias, c); });
      break;
    case detail::Path::blocked:
      if (packed_b != nullptr && (packed_b->rows() != n || packed_b->depth() != k)) {
        throw ShapeError("duet::kernels::gemm: a weight packed as [" + std::to_string(packed_b->rows()) + ", " +
                            std::to_string(packed_b->depth()) + "] for a product with [" + std::to_string(n) + ", " +
                            std::to_string(k) + "]");
      }
      if (packed_b != nullptr && packed_b->isa() != isa) packed_b = nullptr;
      detail::with_kernels(isa, [&]<class Kernels>(Kernels) {
        Kernels::template blocked<T, Fns...>(a, m, k, b, n, bias, c, packed_b);
      });
      break;
    case detail::Path::none:
      break;
  }
}

}  // namespace duet::kernels
// Parameters: the tensors a cell learns.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <typeindex>
#include <typeinfo>

// duet::BasicTensor: a row-major, contiguous, reference-counted n-d array with a runtime shape,
// and duet::StaticTensor, the same with its shape (or part of it) fixed in the type.
//
// Copies share elements, as MindSpore and numpy references do; clone() copies them. Views
// (reshape, operator[]) share the block of the tensor they come from.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

// Element types a tensor may hold, and their MindSpore names.

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace duet {

enum class DType : std::uint8_t { float32, float64, int32, int64, uint8 };

template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int32_t> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::uint8_t>;

template <class T>
concept ElementType = is_element_type_v<T>;

template <ElementType T>
inline constexpr DType dtype_of = std::is_same_v<T, float>          ? DType::float32
                                  : std::is_same_v<T, double>       ? DType::float64
                                  : std::is_same_v<T, std::int32_t> ? DType::int32
                                  : std::is_same_v<T, std::int64_t> ? DType::int64
                                                                    : DType::uint8;

inline constexpr DType float32 = DType::float32;
inline constexpr DType float64 = DType::float64;
inline constexpr DType int32 = DType::int32;
inline constexpr DType int64 = DType::int64;
inline constexpr DType uint8 = DType::uint8;

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::float32:
      return "Float32";
    case DType::float64:
      return "Float64";
    case DType::int32:
      return "Int32";
    case DType::int64:
      return "Int64";
    case DType::uint8:
      return "UInt8";
  }
  return "?";
}

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::float32:
      return 4;
    case DType::float64:
      return 8;
    case DType::int32:
      return 4;
    case DType::int64:
      return 8;
    case DType::uint8:
      return 1;
  }
  return 0;
}

}  // namespace duet
// Shapes: one constexpr type for concrete shapes (tensors) and shape patterns (graphs).
//
// A pattern may hold dynamic dimensions (duet::dyn) and may have unknown leading dimensions
// ("[..., 784]"), which is how graph mode captures a runtime tensor whose rank it cannot know.
// Shape rules are written once over this type and run both at compile time (on patterns,
// to reject mismatches before the program exists) and at run time (on concrete shapes).

#include <array>
#include <initializer_list>
#include <ostream>
#include <string>


namespace duet {

class Shape {
 public:
  constexpr Shape() = default;

  constexpr Shape(std::initializer_list<index_t> dims) {
    if (dims.size() > static_cast<std::size_t>(max_rank)) {
      throw ValueError("duet::Shape: rank " + std::to_string(dims.size()) + " exceeds max_rank " +
                       std::to_string(max_rank));
    }
    for (index_t d : dims) {
      if (d < 0 && d != dyn) {
        throw ValueError("duet::Shape: dimension " + std::to_string(d) +
                         " is negative (only duet::dyn = -1 is allowed, for dynamic sizes)");
      }
      dims_[static_cast<std::size_t>(rank_++)] = d;
    }
  }

  // "[...]": any rank, any sizes. What graph mode knows of a runtime tensor before it runs.
  static constexpr Shape any() {
    Shape s;
    s.leading_unknown_ = true;
    return s;
  }

  // The known trailing dimensions; with leading_unknown() there may be more in front.
  constexpr int rank() const { return rank_; }
  constexpr bool leading_unknown() const { return leading_unknown_; }

  // Axis -1 is the last dimension, as in numpy.
  constexpr index_t operator[](int axis) const { return dims_[static_cast<std::size_t>(normalize(axis))]; }
  constexpr index_t& operator[](int axis) { return dims_[static_cast<std::size_t>(normalize(axis))]; }
  // The last dimension; the shape must have one.
  constexpr index_t back() const { return dims_[static_cast<std::size_t>(rank_ - 1)]; }

  constexpr bool is_concrete() const {
    if (leading_unknown_) return false;
    for (int i = 0; i < rank_; ++i) {
      if (dims_[static_cast<std::size_t>(i)] == dyn) return false;
    }
    return true;
  }

  // Product of all dimensions; dyn if any is unknown.
  constexpr index_t numel() const {
    if (leading_unknown_) return dyn;
    index_t n = 1;
    for (int i = 0; i < rank_; ++i) {
      const index_t d = dims_[static_cast<std::size_t>(i)];
      if (d == dyn) return dyn;
      n *= d;
    }
    return n;
  }

  // Product of dimensions [first, rank); dyn if any is unknown.
  constexpr index_t numel_from(int first) const {
    index_t n = 1;
    for (int i = first; i < rank_; ++i) {
      const index_t d = dims_[static_cast<std::size_t>(i)];
      if (d == dyn) return dyn;
      n *= d;
    }
    return n;
  }

  // This shape with the last dimension replaced; the shape must have one.
  constexpr Shape with_back(index_t d) const {
    Shape s = *this;
    s.dims_[static_cast<std::size_t>(rank_ - 1)] = d;
    return s;
  }

  constexpr void push_back(index_t d) {
    if (rank_ == max_rank) throw ValueError("duet::Shape: rank exceeds max_rank");
    dims_[static_cast<std::size_t>(rank_++)] = d;
  }

  constexpr const index_t* begin() const { return dims_.data(); }
  constexpr const index_t* end() const { return dims_.data() + rank_; }

  friend constexpr bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_ || a.leading_unknown_ != b.leading_unknown_) return false;
    for (int i = 0; i < a.rank_; ++i) {
      if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
    }
    return true;
  }

 private:
  constexpr int normalize(int axis) const {
    const int a = axis < 0 ? axis + rank_ : axis;
    if (a < 0 || a >= rank_) {
      throw IndexError("duet::Shape: axis " + std::to_string(axis) + " is out of range for rank " +
                       std::to_string(rank_));
    }
    return a;
  }

  std::array<index_t, max_rank> dims_{};
  int rank_ = 0;
  bool leading_unknown_ = false;
};

// "[64, 1, 28, 28]", "[?, 784]" (dynamic), "[..., 512]" (unknown leading dimensions).
inline std::string to_string(const Shape& s) {
  std::string out = "[";
  bool first = true;
  if (s.leading_unknown()) {
    out += "...";
    first = false;
  }
  for (index_t d : s) {
    if (!first) out += ", ";
    out += d == dyn ? std::string("?") : std::to_string(d);
    first = false;
  }
  return out + "]";
}

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << to_string(s); }

// A shape fixed at compile time; duet::shape<64, 1, 28, 28> is its value.
template <index_t... Dims>
struct StaticShape {
  static_assert(sizeof...(Dims) <= max_rank, "duet::StaticShape: rank exceeds duet::max_rank");
  static_assert(((Dims >= 0 || Dims == dyn) && ...), "duet::StaticShape: dimensions must be >= 0 or duet::dyn");
  static constexpr Shape value{Dims...};
  constexpr operator Shape() const { return value; }
};

template <index_t... Dims>
inline constexpr StaticShape<Dims...> shape{};

}  // namespace duet

namespace duet {

namespace detail {

// Validates a shape a tensor is created with and returns its element count.
inline index_t checked_numel(const Shape& shape, std::size_t element_size) {
  if (!shape.is_concrete()) {
    throw ShapeError("duet::Tensor: cannot create a tensor of shape " + to_string(shape) +
                     ": every dimension must be known");
  }
  index_t n = 1;
  const auto limit = static_cast<index_t>(std::numeric_limits<std::size_t>::max() / 2 / element_size);
  for (index_t d : shape) {
    if (d != 0 && n > limit / d) {
      throw ValueError("duet::Tensor: shape " + to_string(shape) + " has too many elements");
    }
    n *= d;
  }
  return n;
}

}  // namespace detail

template <ElementType T>
class BasicTensor {
 public:
  using value_type = T;

  // An empty one-dimensional tensor.
  BasicTensor() : shape_{0} {}

  // Zero-filled.
  explicit BasicTensor(const Shape& shape) : BasicTensor(uninitialized(shape)) { std::fill_n(data_, numel(), T{}); }

  BasicTensor(const Shape& shape, std::initializer_list<T> values)
      : BasicTensor(shape, std::span<const T>(values.begin(), values.size())) {}

  BasicTensor(const Shape& shape, std::span<const T> values) : BasicTensor(uninitialized(shape)) {
    if (static_cast<index_t>(values.size()) != numel()) {
      throw ShapeError("duet::Tensor: shape " + to_string(shape) + " holds " + std::to_string(numel()) +
                       " elements, got " + std::to_string(values.size()) + " values");
    }
    std::copy(values.begin(), values.end(), data_);
  }

  // For kernels that write every element: skips the zero fill.
  static BasicTensor uninitialized(const Shape& shape) {
    const index_t n = detail::checked_numel(shape, sizeof(T));
    BasicTensor t(detail::Storage(static_cast<std::size_t>(n) * sizeof(T)), shape);
    return t;
  }

  const Shape& shape() const { return shape_; }
  int ndim() const { return shape_.rank(); }
  index_t dim(int axis) const { return shape_[axis]; }
  index_t numel() const { return shape_.numel(); }
  index_t size() const { return numel(); }
  static constexpr DType dtype() { return dtype_of<T>; }

  // Non-const access may write, so it moves version().
  T* data() {
    storage_.note_write();
    return data_;
  }
  const T* data() const { return data_; }
  std::span<T> values() { return {data(), static_cast<std::size_t>(numel())}; }
  std::span<const T> values() const { return {data_, static_cast<std::size_t>(numel())}; }

  // Element access; negative indices count from the end, as in numpy. Always bounds-checked:
  // kernels use data(), so this is never the hot path.
  template <std::integral... I>
  T& operator()(I... index) {
    return data()[offset_of({static_cast<index_t>(index)...})];
  }
  template <std::integral... I>
  const T& operator()(I... index) const {
    return data_[offset_of({static_cast<index_t>(index)...})];
  }

  // The only element of a tensor with one element.
  T item() const {
    if (numel() != 1) {
      throw ShapeError("duet::Tensor::item: needs exactly one element, shape is " + to_string(shape_));
    }
    return data_[0];
  }

  // A view with another shape and the same elements; one dimension may be -1 (inferred).
  BasicTensor reshape(Shape to) const {
    int inferred = -1;
    index_t known = 1;
    for (int i = 0; i < to.rank(); ++i) {
      if (to[i] == dyn) {
        if (inferred >= 0) throw ShapeError("duet::Tensor::reshape: more than one -1 in " + to_string(to));
        inferred = i;
      } else {
        known *= to[i];
      }
    }
    if (inferred >= 0 && known != 0 && numel() % known == 0) to[inferred] = numel() / known;
    if (!to.is_concrete() || to.numel() != numel()) {
      throw ShapeError("duet::Tensor::reshape: cannot view " + to_string(shape_) + " (" + std::to_string(numel()) +
                       " elements) as " + to_string(to));
    }
    BasicTensor view = *this;
    view.shape_ = to;
    view.tape_id_ = 0;
    view.trace_id_ = 0;
    return view;
  }

  // Sub-tensor i along the first axis, as a view.
  BasicTensor operator[](index_t i) const {
    if (ndim() == 0) throw IndexError("duet::Tensor: cannot index a 0-d tensor");
    const index_t n = shape_[0];
    if (i < -n || i >= n) {
      throw IndexError("duet::Tensor: index " + std::to_string(i) + " is out of range for axis 0 of " +
                       to_string(shape_));
    }
    if (i < 0) i += n;
    Shape rest;
    for (int a = 1; a < ndim(); ++a) rest.push_back(shape_[a]);
    BasicTensor view = *this;
    view.shape_ = rest;
    view.data_ = data_ + i * rest.numel();
    view.tape_id_ = 0;
    view.trace_id_ = 0;
    return view;
  }

  BasicTensor clone() const {
    BasicTensor copy = uninitialized(shape_);
    std::copy_n(data_, numel(), copy.data_);
    return copy;
  }

  // True when both see the same elements (one is a view of the other, or a copy of its handle).
  bool shares_storage_with(const BasicTensor& other) const { return storage_.same_block(other.storage_); }

  // Handles (this one, copies and views) sharing the elements; 1 means this tensor may be
  // overwritten in place without anyone noticing.
  long use_count() const { return storage_.use_count(); }

  // Moves whenever the elements may have been written through any handle sharing them (each
  // non-const data(), values() or element access counts), and only then: what is computed
  // from the elements at one version, such as a pre-packed weight, is current while the
  // version stays. Writes through a pointer kept from an earlier data() are not seen.
  std::uint64_t version() const { return storage_.writes(); }

  // Which value of a recording tape (autodiff) this handle is; 0 for none. Copies keep it,
  // views a user makes (reshape, operator[]) do not: they are new values the tape never saw.
  std::uint64_t tape_id() const { return tape_id_; }
  void set_tape_id(std::uint64_t id) { tape_id_ = id; }
  // The same for a recording PIJit trace, which may record while a tape does (a training step).
  std::uint64_t trace_id() const { return trace_id_; }
  void set_trace_id(std::uint64_t id) { trace_id_ = id; }

 private:
  BasicTensor(detail::Storage storage, const Shape& shape)
      : storage_(std::move(storage)), data_(reinterpret_cast<T*>(storage_.data())), shape_(shape) {}

  index_t offset_of(std::initializer_list<index_t> index) const {
    if (static_cast<int>(index.size()) != ndim()) {
      throw IndexError("duet::Tensor: " + std::to_string(index.size()) + " indices for a tensor of shape " +
                       to_string(shape_));
    }
    index_t offset = 0;
    int axis = 0;
    for (index_t i : index) {
      const index_t n = shape_[axis];
      if (i < -n || i >= n) {
        throw IndexError("duet::Tensor: index " + std::to_string(i) + " is out of range for axis " +
                         std::to_string(axis) + " of " + to_string(shape_));
      }
      offset = offset * n + (i < 0 ? i + n : i);
      ++axis;
    }
    return offset;
  }

  detail::Storage storage_;
  T* data_ = nullptr;
  Shape shape_;
  std::uint64_t tape_id_ = 0;
  std::uint64_t trace_id_ = 0;
};

using Tensor = BasicTensor<float>;

// A tensor whose shape is (partly) fixed in its type: StaticTensor<float, duet::dyn, 784> is
// any batch of 784-vectors. Graph mode reads the shape from the type and checks layers
// against it at compile time.
template <ElementType T, index_t... Dims>
class StaticTensor {
 public:
  using value_type = T;
  using static_shape_type = StaticShape<Dims...>;
  static constexpr Shape static_shape = static_shape_type::value;

  // Zero-filled; only when every dimension is fixed.
  StaticTensor() requires(((Dims != dyn) && ...)) : tensor_(static_shape) {}

  // Adopts a runtime tensor after checking it against the static shape.
  explicit StaticTensor(BasicTensor<T> tensor) : tensor_(std::move(tensor)) {
    const Shape& s = tensor_.shape();
    bool ok = s.rank() == static_shape.rank();
    for (int i = 0; ok && i < s.rank(); ++i) ok = static_shape[i] == dyn || static_shape[i] == s[i];
    if (!ok) {
      throw ShapeError("duet::StaticTensor" + to_string(static_shape) + ": got a tensor of shape " + to_string(s));
    }
  }

  const BasicTensor<T>& tensor() const& { return tensor_; }
  BasicTensor<T>& tensor() & { return tensor_; }
  BasicTensor<T> tensor() && { return std::move(tensor_); }
  operator const BasicTensor<T>&() const& { return tensor_; }

  const Shape& shape() const { return tensor_.shape(); }
  static constexpr int ndim() { return static_shape.rank(); }
  index_t numel() const { return tensor_.numel(); }
  T* data() { return tensor_.data(); }
  const T* data() const { return tensor_.data(); }
  template <std::integral... I>
  requires(sizeof...(I) == sizeof...(Dims)) T& operator()(I... index) { return tensor_(index...); }
  template <std::integral... I>
  requires(sizeof...(I) == sizeof...(Dims)) const T& operator()(I... index) const { return tensor_(index...); }

 private:
  BasicTensor<T> tensor_;
};

// The runtime tensor of either kind of tensor.
template <ElementType T>
const BasicTensor<T>& tensor_of(const BasicTensor<T>& t) {
  return t;
}
template <ElementType T, index_t... D>
const BasicTensor<T>& tensor_of(const StaticTensor<T, D...>& t) {
  return t.tensor();
}

template <class X>
inline constexpr bool is_static_tensor_v = false;
template <class T, index_t... D>
inline constexpr bool is_static_tensor_v<StaticTensor<T, D...>> = true;

template <class X>
inline constexpr bool is_tensor_v = false;
template <class T>
inline constexpr bool is_tensor_v<BasicTensor<T>> = true;

// Creation. Each takes a runtime Shape ({64, 1, 28, 28}) and returns a BasicTensor, or a
// duet::shape<...> and returns the matching StaticTensor.
template <ElementType T = float>
BasicTensor<T> full(const Shape& shape, T value) {
  auto t = BasicTensor<T>::uninitialized(shape);
  std::fill_n(t.data(), t.numel(), value);
  return t;
}
template <ElementType T = float>
BasicTensor<T> zeros(const Shape& shape) {
  return full<T>(shape, T{0});
}
template <ElementType T = float>
BasicTensor<T> ones(const Shape& shape) {
  return full<T>(shape, T{1});
}
template <ElementType T = float, index_t... D>
StaticTensor<T, D...> full(StaticShape<D...> shape, T value) {
  return StaticTensor<T, D...>(full<T>(Shape(shape), value));
}
template <ElementType T = float, index_t... D>
StaticTensor<T, D...> zeros(StaticShape<D...> shape) {
  return full<T>(shape, T{0});
}
template <ElementType T = float, index_t... D>
StaticTensor<T, D...> ones(StaticShape<D...> shape) {
  return full<T>(shape, T{1});
}

}  // namespace duet

namespace duet {
namespace detail {
// The backward pass running on this thread; gradient kernels pass it to grad_for_write.
inline std::uint64_t& current_backward_pass() {
  thread_local std::uint64_t pass = 0;
  return pass;
}

// Makes the calling thread's next backward pass, unique in the program.
inline std::uint64_t begin_backward_pass() {
  static std::atomic<std::uint64_t> last{0};
  return current_backward_pass() = last.fetch_add(1, std::memory_order_relaxed) + 1;
}
}  // namespace detail

namespace nn {

// A tensor a cell owns and an optimiser updates. It is a tensor (prints, indexes, feeds
// kernels) whose shape is fixed once made: set_data copies values in, never rebinds, so the
// graphs and views that refer to it stay valid.
template <ElementType T>
class BasicParameter : public BasicTensor<T> {
 public:
  BasicParameter() = default;
  explicit BasicParameter(BasicTensor<T> value) : BasicTensor<T>(std::move(value)) {}

  BasicParameter(const BasicParameter&) = delete;
  BasicParameter& operator=(const BasicParameter&) = delete;
  BasicParameter(BasicParameter&&) noexcept = default;
  BasicParameter& operator=(BasicParameter&&) noexcept = default;
  ~BasicParameter() = default;

  // MindSpore's Parameter.set_data: the new values must have this parameter's shape.
  void set_data(const BasicTensor<T>& value) {
    if (!(value.shape() == this->shape())) {
      throw ShapeError("duet::nn::Parameter::set_data: parameter has shape " + to_string(this->shape()) + ", got " +
                       to_string(value.shape()));
    }
    std::copy_n(value.data(), value.numel(), this->data());
  }

  // Where a gradient kernel writes this parameter's gradient in backward pass `pass`: the
  // first write of a pass assigns (*accumulate = false), later ones add, for a parameter used
  // twice. The buffer is made on the first pass and kept, so training does not allocate.
  T* grad_for_write(std::uint64_t pass, bool* accumulate) const {
    if (!(grad.shape() == this->shape())) grad = BasicTensor<T>(this->shape());
    *accumulate = grad_pass_ == pass;
    grad_pass_ = pass;
    return grad.data();
  }

  // Whether backward pass `pass` wrote this parameter's gradient (it did not reach it otherwise).
  bool has_grad_from(std::uint64_t pass) const { return grad_pass_ == pass; }

  // A form of the values a kernel computes from them and keeps (the pre-packed weight of
  // JitLevel::O2): make() runs on first use, and again whenever the values may have changed
  // since (version(), which optimisers, set_data, checkpoint loading and any non-const access
  // move), so a stale form is never returned. One form per parameter; safe from several
  // threads, and a returned form outlives a concurrent remake.
  template <class Form, class Make>
  std::shared_ptr<const Form> derived(Make&& make) const {
    DerivedForm& d = derived_;
    std::lock_guard lock(d.mutex);
    const BasicTensor<T>& values = *this;
    const BasicTensor<T>& seen = d.source;
    // The same first element means the same block: d.source keeps that block from being reused.
    const bool current = d.form != nullptr && d.type == typeid(Form) && seen.data() == values.data() &&
                         seen.shape() == values.shape() && d.version == values.version();
    if (!current) {
      d.form.reset();  // frees the old form before the new one is made, not after
      d.form = std::make_shared<const Form>(make());
      d.type = typeid(Form);
      d.source = values;
      d.version = values.version();
    }
    return std::static_pointer_cast<const Form>(d.form);
  }

  bool requires_grad = true;

  // The gradient from the last backward pass that reached this parameter; empty before.
  // Gradients are bookkeeping, not the parameter's value: kernels holding a const layer write them.
  mutable BasicTensor<T> grad;

 private:
  mutable std::uint64_t grad_pass_ = 0;

  struct DerivedForm {
    std::mutex mutex;
    BasicTensor<T> source;  // a handle: the block cannot be reused for other values meanwhile
    std::uint64_t version = 0;
    std::type_index type = typeid(void);
    std::shared_ptr<const void> form;

    DerivedForm() = default;
    // A moved parameter makes its forms again; the mutex cannot move.
    DerivedForm(DerivedForm&&) noexcept {}
    DerivedForm& operator=(DerivedForm&&) noexcept {
      form.reset();
      source = BasicTensor<T>();
      return *this;
    }
    DerivedForm(const DerivedForm&) = delete;
    DerivedForm& operator=(const DerivedForm&) = delete;
    ~DerivedForm() = default;
  };
  mutable DerivedForm derived_;
};

using Parameter = BasicParameter<float>;

template <ElementType T>
struct NamedParameter {
  std::string name;
  BasicParameter<T>* parameter;
};

namespace detail {
// What a cell with no parameters most likely lacks, for the errors that find one empty.
inline constexpr const char* unregistered_members_hint =
    "are its sub-cells and parameters registered? A Cell lists them in DUET_CELL_MEMBERS(...); a class "
    "deriving from nn::DynamicCell overrides for_each_child and for_each_own_parameter";
}  // namespace detail

}  // namespace nn
}  // namespace duet

namespace duet {

// What a product kernel applies to each output row before storing it: the bias (if not
// null), then each elementwise function Fns in order. Fusing them here saves one pass over
// the output per function, the point of the epilogue-fusion pass.
template <class T, class... Fns>
struct Epilogue {
  const T* bias = nullptr;
};

// How a loss turns per-element losses into its output (MindSpore's `reduction`).
enum class Reduction : unsigned char { none, mean, sum };

// The scalars of one optimiser step, computed once per step for all parameters.
struct AdamStep {
  double learning_rate;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool decoupled;           // AdamW
  double bias_correction1;  // 1 - beta1^t
  double bias_correction2;  // 1 - beta2^t
};

struct SgdStep {
  double learning_rate;
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool first_step;
};

// What the gradient of y = epilogue(x · Wᵀ) reads and writes; dx and db may be null.
template <class T>
struct DenseBackwardArgs {
  const T* dy;  // [rows, out]
  const T* x;   // [rows, in]
  const T* y;   // [rows, out], the forward output, read when an epilogue function needs it
  index_t rows;
  index_t in;
  const T* w;  // [out, in]
  index_t out;
  T* dx;  // [rows, in]
  T* dw;  // [out, in]
  bool accumulate_w;
  T* db;  // [out]
  bool accumulate_b;
};

namespace backend {

namespace detail {
// Sizes known at compile time become Eigen's fixed sizes only while small: that is where
// unrolling pays, and large fixed sizes overflow Eigen's unrolling cost estimates. Eigen
// rejects row-major matrices with a single column; the layout is the same either way.
constexpr int eigen_size(index_t n) { return n == dyn || n > 16 ? ::Eigen::Dynamic : static_cast<int>(n); }

template <class T, index_t Rows, index_t Cols>
using RowMajorMatrix = ::Eigen::Matrix<T, eigen_size(Rows), eigen_size(Cols), Cols == 1 ? ::Eigen::ColMajor : ::Eigen::RowMajor>;

template <class Expr>
decltype(auto) apply_all(const Expr& e) {
  return e;
}
template <class Fn, class... Rest, class Expr>
auto apply_all(const Expr& e) {
  return apply_all<Rest...>(Fn::array(e));
}
}  // namespace detail

struct Eigen {
  // y[rows, out] = epilogue(x[rows, in] · w[out, in]ᵀ), all row-major. In and Out are the
  // compile-time sizes where known (dyn otherwise), so small layers get unrolled kernels.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense(const T* x, index_t rows, index_t in, const T* w, index_t out,
                    const Epilogue<T, Fns...>& epilogue, T* y) {
    using XMatrix = detail::RowMajorMatrix<T, dyn, In>;
    using WMatrix = detail::RowMajorMatrix<T, Out, In>;
    using YMatrix = detail::RowMajorMatrix<T, dyn, Out>;
    ::Eigen::Map<const XMatrix> X(x, rows, in);
    ::Eigen::Map<const WMatrix> W(w, out, in);
    ::Eigen::Map<YMatrix> Y(y, rows, out);
    Y.noalias() = X * W.transpose();
    if (epilogue.bias != nullptr) {
      using Row = ::Eigen::Array<T, 1, detail::eigen_size(Out)>;
      ::Eigen::Map<const Row> b(epilogue.bias, 1, out);
      Y.array() = detail::apply_all<Fns...>(Y.array().rowwise() + b);
    } else if constexpr (sizeof...(Fns) > 0) {
      Y.array() = detail::apply_all<Fns...>(Y.array());
    }
  }

  // dense() with a layer's weight, kept pre-packed from call to call where the backend has a
  // packed form (JitLevel::O2). Eigen packs inside each product, so here it is dense().
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_packed(const T* x, index_t rows, index_t in, const nn::BasicParameter<T>& w, index_t out,
                           const Epilogue<T, Fns...>& epilogue, T* y) {
    dense<In, Out>(x, rows, in, w.data(), out, epilogue, y);
  }

  // y[rows, cols] = x[rows, cols] + bias[cols]; y may be x.
  template <class T>
  static void add_bias(const T* x, index_t rows, index_t cols, const T* bias, T* y) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<const Matrix> X(x, rows, cols);
    ::Eigen::Map<Matrix> Y(y, rows, cols);
    ::Eigen::Map<const ::Eigen::Array<T, 1, ::Eigen::Dynamic>> b(bias, 1, cols);
    Y.array() = X.array().rowwise() + b;
  }

  // y[i] = Fns(x[i]), the functions applied in order in one pass; y may be x.
  template <class... Fns, class T>
  static void map(const T* x, index_t n, T* y) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(y, n) = detail::apply_all<Fns...>(::Eigen::Map<const Array>(x, n));
  }

  // dx[i] = dy[i] · Fn'(x[i]), Fn' written in terms of the output y = Fn(x).
  template <class Fn, class T>
  static void map_grad(const T* dy, const T* y, index_t n, T* dx) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(dx, n) = Fn::grad_array(::Eigen::Map<const Array>(dy, n), ::Eigen::Map<const Array>(y, n));
  }

  // The gradient of y = Fns(x · wᵀ + b): dz = dy · Fns'(y), dw (+)= dzᵀ · x, db (+)= Σ_rows dz,
  // dx = dz · w.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_backward(const DenseBackwardArgs<T>& a) {
    static_assert(sizeof...(Fns) <= 1, "duet: a product's epilogue differentiates through one function at most");
    using XMatrix = detail::RowMajorMatrix<T, dyn, In>;
    using WMatrix = detail::RowMajorMatrix<T, Out, In>;
    using YMatrix = detail::RowMajorMatrix<T, dyn, Out>;
    ::Eigen::Map<const XMatrix> X(a.x, a.rows, a.in);
    ::Eigen::Map<const WMatrix> W(a.w, a.out, a.in);
    const T* dz = a.dy;
    duet::detail::Storage masked;
    if constexpr (sizeof...(Fns) == 1) {
      masked = duet::detail::Storage(static_cast<std::size_t>(a.rows * a.out) * sizeof(T));
      T* m = reinterpret_cast<T*>(masked.data());
      map_grad<Fns...>(a.dy, a.y, a.rows * a.out, m);
      dz = m;
    }
    ::Eigen::Map<const YMatrix> DZ(dz, a.rows, a.out);
    ::Eigen::Map<WMatrix> DW(a.dw, a.out, a.in);
    if (a.accumulate_w) DW.noalias() += DZ.transpose() * X;
    else DW.noalias() = DZ.transpose() * X;
    if (a.db != nullptr) column_sums(dz, a.rows, a.out, a.db, a.accumulate_b);
    if (a.dx != nullptr) {
      ::Eigen::Map<XMatrix> DX(a.dx, a.rows, a.in);
      DX.noalias() = DZ * W;
    }
  }

  // db (+)= Σ_rows dy.
  template <class T>
  static void bias_grad(const T* dy, index_t rows, index_t cols, T* db, bool accumulate) {
    column_sums(dy, rows, cols, db, accumulate);
  }

  // Row r's loss is logsumexp(z_r) - z_r[label_r] (sparse) or Σ_c p_rc (logsumexp(z_r) - z_rc)
  // (dense p). logsumexp subtracts the row's maximum first, so logits of magnitude 1e4 neither
  // overflow nor lose the answer.
  template <bool Sparse, class T, class L>
  static void softmax_cross_entropy(const T* z, const L* labels, index_t rows, index_t classes, Reduction r, T* out) {
    T total = 0;
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      const T lse = log_sum_exp(row, classes);
      T loss = 0;
      if constexpr (Sparse) {
        loss = lse - row[checked_label(labels[i], i, classes)];
      } else {
        for (index_t c = 0; c < classes; ++c) loss += static_cast<T>(labels[i * classes + c]) * (lse - row[c]);
      }
      if (r == Reduction::none) out[i] = loss;
      else total += loss;
    }
    if (r == Reduction::sum) out[0] = total;
    if (r == Reduction::mean) out[0] = rows == 0 ? T(0) : total / static_cast<T>(rows);
  }

  // dz = (softmax(z) - p) · g, with g per row (no reduction), or g / rows (mean), or g (sum).
  template <bool Sparse, class T, class L>
  static void softmax_cross_entropy_grad(const T* g, const T* z, const L* labels, index_t rows, index_t classes,
                                         Reduction r, T* dz) {
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      T* d = dz + i * classes;
      const T lse = log_sum_exp(row, classes);
      const T scale = r == Reduction::none ? g[i] : r == Reduction::mean ? g[0] / static_cast<T>(rows) : g[0];
      T label_mass = 0;
      for (index_t c = 0; c < classes; ++c) {
        if constexpr (!Sparse) label_mass += static_cast<T>(labels[i * classes + c]);
        d[c] = std::exp(row[c] - lse);
      }
      if constexpr (Sparse) {
        d[checked_label(labels[i], i, classes)] -= T(1);
        for (index_t c = 0; c < classes; ++c) d[c] *= scale;
      } else {
        // d/dz of Σ_c p_c (lse - z_c) is softmax · Σ_c p_c - p.
        for (index_t c = 0; c < classes; ++c) d[c] = (d[c] * label_mass - static_cast<T>(labels[i * classes + c])) * scale;
      }
    }
  }

  // (x - y)², reduced.
  template <class T>
  static void mse(const T* x, const T* y, index_t n, Reduction r, T* out) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto sq = (::Eigen::Map<const Array>(x, n) - ::Eigen::Map<const Array>(y, n)).square();
    if (r == Reduction::none) ::Eigen::Map<Array>(out, n) = sq;
    else if (r == Reduction::sum) out[0] = sq.sum();
    else out[0] = n == 0 ? T(0) : sq.sum() / static_cast<T>(n);
  }

  // dx = 2 (x - y) · g, with g per element (no reduction), or g / n (mean), or g (sum).
  template <class T>
  static void mse_grad(const T* g, const T* x, const T* y, index_t n, Reduction r, T* dx) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto diff = ::Eigen::Map<const Array>(x, n) - ::Eigen::Map<const Array>(y, n);
    if (r == Reduction::none) {
      ::Eigen::Map<Array>(dx, n) = T(2) * diff * ::Eigen::Map<const Array>(g, n);
    } else {
      const T scale = r == Reduction::mean ? (n == 0 ? T(0) : T(2) * g[0] / static_cast<T>(n)) : T(2) * g[0];
      ::Eigen::Map<Array>(dx, n) = scale * diff;
    }
  }

  template <class T>
  static void fill(T* out, index_t n, T value) {
    std::fill_n(out, n, value);
  }

  template <class T>
  static void add(const T* a, const T* b, index_t n, T* out) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(out, n) = ::Eigen::Map<const Array>(a, n) + ::Eigen::Map<const Array>(b, n);
  }

  // One Adam step on n values (PyTorch's formulation: eps is added to the bias-corrected
  // sqrt(v)). weight_decay is L2 (added to the gradient) or, if decoupled, AdamW's
  // p -= lr · weight_decay · p.
  template <class T>
  static void adam_update(T* p, const T* g, T* m, T* v, index_t n, const AdamStep& s) {
    const T b1 = static_cast<T>(s.beta1), b2 = static_cast<T>(s.beta2), eps = static_cast<T>(s.eps);
    const T wd = static_cast<T>(s.weight_decay);
    const T decay = s.decoupled ? T(1) - static_cast<T>(s.learning_rate * s.weight_decay) : T(1);
    const T l2 = s.decoupled ? T(0) : wd;
    const T step = static_cast<T>(s.learning_rate / s.bias_correction1);
    const T root_correction = static_cast<T>(std::sqrt(s.bias_correction2));
    for (index_t i = 0; i < n; ++i) {
      const T grad = g[i] + l2 * p[i];
      m[i] = b1 * m[i] + (T(1) - b1) * grad;
      v[i] = b2 * v[i] + (T(1) - b2) * grad * grad;
      p[i] = p[i] * decay - step * m[i] / (std::sqrt(v[i]) / root_correction + eps);
    }
  }

  template <class T>
  static void sgd_update(T* p, const T* g, T* buf, index_t n, const SgdStep& s) {
    const T lr = static_cast<T>(s.learning_rate), wd = static_cast<T>(s.weight_decay);
    const T momentum = static_cast<T>(s.momentum), keep = static_cast<T>(1 - s.dampening);
    for (index_t i = 0; i < n; ++i) {
      const T d = g[i] + wd * p[i];
      if (s.momentum == 0) {
        p[i] -= lr * d;
        continue;
      }
      buf[i] = s.first_step ? d : momentum * buf[i] + keep * d;
      p[i] -= lr * (s.nesterov ? d + momentum * buf[i] : buf[i]);
    }
  }

 private:
  template <class T>
  static void column_sums(const T* x, index_t rows, index_t cols, T* sums, bool accumulate) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<::Eigen::Matrix<T, 1, ::Eigen::Dynamic>> s(sums, 1, cols);
    if (accumulate) s += ::Eigen::Map<const Matrix>(x, rows, cols).colwise().sum();
    else s = ::Eigen::Map<const Matrix>(x, rows, cols).colwise().sum();
  }

  template <class T>
  static T log_sum_exp(const T* row, index_t n) {
    T m = row[0];
    for (index_t c = 1; c < n; ++c) m = std::max(m, row[c]);
    T sum = 0;
    for (index_t c = 0; c < n; ++c) sum += std::exp(row[c] - m);
    return m + std::log(sum);
  }

  template <class L>
  static index_t checked_label(L label, index_t row, index_t classes) {
    const auto c = static_cast<index_t>(label);
    if (c < 0 || c >= classes) {
      throw ValueError("nn::SoftmaxCrossEntropyWithLogits: label " + std::to_string(c) + " of sample " +
                       std::to_string(row) + " is outside [0, " + std::to_string(classes) + ")");
    }
    return c;
  }
};

// backend::Eigen with duet's own dense kernel (kernels::gemm), which applies the epilogue to
// each tile of the output while it is in registers. Element types or epilogue functions the
// kernel cannot take fall back to Eigen.
struct Native : Eigen {
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense(const T* x, index_t rows, index_t in, const T* w, index_t out,
                    const Epilogue<T, Fns...>& epilogue, T* y) {
    if constexpr (kernels::gemm_supports<T, Fns...>) {
      kernels::gemm<In, Out, Fns...>(x, rows, in, w, out, epilogue.bias, y);
    } else {
      Eigen::dense<In, Out>(x, rows, in, w, out, epilogue, y);
    }
  }

  // The weight is packed once per version of it (the parameter keeps the packed form), not
  // on every call; the product reads the same numbers in the same order, so the result is
  // the bits of dense().
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_packed(const T* x, index_t rows, index_t in, const nn::BasicParameter<T>& w, index_t out,
                           const Epilogue<T, Fns...>& epilogue, T* y) {
    if constexpr (kernels::gemm_supports<T, Fns...>) {
      if (kernels::reads_packed_weight<In, Out>(rows, in, out)) {
        // A type per instruction set, so that after a set_kernel_isa the parameter packs again
        // for the new set instead of keeping a form the product cannot read.
        const kernels::Isa isa = kernels::active_isa();
        kernels::detail::with_kernels(isa, [&]<class Kernels>(Kernels) {
          using Packed = kernels::PackedWeightFor<T, Kernels>;
          const auto packed = w.template derived<Packed>([&] { return Packed(w.data(), out, in, isa); });
          kernels::gemm<In, Out, Fns...>(x, rows, in, w.data(), out, epilogue.bias, y, packed.get());
        });
        return;
      }
    }
    dense<In, Out>(x, rows, in, w.data(), out, epilogue, y);
  }
};

}  // namespace backend

#ifdef DUET_DEFAULT_BACKEND
using DefaultBackend = DUET_DEFAULT_BACKEND;
#else
// Native: on the seed network, single-threaded, it runs batches of 64 and 256 about 1.35x
// faster than Eigen's products, and tiny layers in half the time (benchmarks/gemm.cpp).
using DefaultBackend = backend::Native;
#endif

}  // namespace duet
// Cells: the network model of both modes.
//
// BasicDynamicCell is the runtime-polymorphic interface PyNative mode runs on: a virtual
// forward, a name, forward hooks, children and parameters. Networks can be assembled from it
// at run time. Cell<Derived, Mode> is what a user derives from: it writes one generic
// construct(x), which PyNative calls with tensors (each sub-cell runs at once, through the
// virtual interface) and graph mode calls with a symbolic tensor (each sub-cell appends nodes,
// and the finished graph is optimised and evaluated in one call).

#include <atomic>
#include <concepts>
#include <boost/hana/accessors.hpp>
#include <boost/hana/concept/struct.hpp>
#include <boost/hana/first.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/second.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// Execution modes and the global context (MindSpore's set_context).

#include <atomic>
#include <cstdlib>
#include <string_view>
#include <optional>
#include <utility>


namespace duet {

enum class Mode : unsigned char {
  graph,     // MindSpore GRAPH_MODE: capture construct as a static graph, optimise, evaluate once
  pynative,  // MindSpore PYNATIVE_MODE: evaluate each cell as it is called
  context,   // follow the global context at call time
};

inline constexpr Mode GRAPH_MODE = Mode::graph;
inline constexpr Mode PYNATIVE_MODE = Mode::pynative;
inline constexpr Mode CONTEXT_MODE = Mode::context;

// Fields left empty keep their current value, so set_context({.mode = GRAPH_MODE}) changes
// the mode and nothing else.
// Every field has an initializer, so that g++ -Wextra accepts designated initialisers that
// name only some of them.
struct ContextConfig {
  std::optional<Mode> mode = std::nullopt;
  // false turns every duet::jit function into plain PyNative execution, for debugging; the
  // environment variable DUET_JIT=0 sets it at start-up.
  std::optional<bool> jit_enabled = std::nullopt;
};

struct Context {
  Mode mode = PYNATIVE_MODE;
  bool jit_enabled = true;
};

namespace detail {
// Read on every call of a context-following cell; atomic so threads may switch it freely.
inline std::atomic<Mode>& context_mode() {
  static std::atomic<Mode> mode{PYNATIVE_MODE};
  return mode;
}
// Hooks registered on any cell. Graph capture and PIJit replay look for hooks in their cells
// only while this is above zero, so hooks cost nothing when nobody uses them.
inline std::atomic<long>& live_hook_count() {
  static std::atomic<long> count{0};
  return count;
}
inline std::atomic<bool>& jit_enabled() {
  static std::atomic<bool> enabled{[] {
    const char* env = std::getenv("DUET_JIT");
    return env == nullptr || std::string_view(env) != "0";
  }()};
  return enabled;
}
}  // namespace detail

inline void set_context(const ContextConfig& config) {
  if (config.mode) {
    // CONTEXT_MODE is what a cell follows, not a mode the context can be in.
    if (*config.mode != GRAPH_MODE && *config.mode != PYNATIVE_MODE) {
      throw ValueError("duet::set_context: mode must be GRAPH_MODE or PYNATIVE_MODE");
    }
    detail::context_mode().store(*config.mode, std::memory_order_relaxed);
  }
  if (config.jit_enabled) detail::jit_enabled().store(*config.jit_enabled, std::memory_order_relaxed);
}

namespace detail {
// Set while a cell runs in PyNative mode: the cells it calls follow it, not the global
// context, so one call is never half eager and half compiled (a thread switching the context
// meanwhile, or a parent fixed to PYNATIVE_MODE over children that follow the context).
inline bool& eager_call_in_progress() {
  thread_local bool active = false;
  return active;
}
}  // namespace detail

// Marks the current thread as inside an eager call for its lifetime.
class EagerScope {
 public:
  EagerScope() : outer_(std::exchange(detail::eager_call_in_progress(), true)) {}
  EagerScope(const EagerScope&) = delete;
  EagerScope& operator=(const EagerScope&) = delete;
  ~EagerScope() { detail::eager_call_in_progress() = outer_; }

 private:
  bool outer_;
};

inline Context get_context() {
  return Context{detail::context_mode().load(std::memory_order_relaxed),
                 detail::jit_enabled().load(std::memory_order_relaxed)};
}

// The mode a cell declared with `declared` runs in right now.
inline Mode effective_mode(Mode declared) {
  if (declared != CONTEXT_MODE) return declared;
  if (detail::eager_call_in_progress()) return PYNATIVE_MODE;
  return detail::context_mode().load(std::memory_order_relaxed);
}

}  // namespace duet

#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#define DUET_HAS_CXXABI 1
#endif

namespace duet::detail {

// "duet::nn::Dense<784l, 512l, float>" becomes "nn::Dense<784, 512, float>": the name a user
// wrote, for cell type names in messages and graph dumps.
inline std::string readable_type_name(const std::type_info& type) {
  std::string name = type.name();
#ifdef DUET_HAS_CXXABI
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(type.name(), nullptr, nullptr, &status),
                                                   std::free);
  if (status == 0 && demangled) name = demangled.get();
#endif
  for (std::size_t at; (at = name.find("duet::")) != std::string::npos;) name.erase(at, 6);
  // Integer template arguments of type long print with an 'l' suffix.
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const bool digit_before = i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9';
    const bool closes = i + 1 < name.size() && (name[i + 1] == ',' || name[i + 1] == '>');
    if (name[i] == 'l' && digit_before && closes) continue;
    out += name[i];
  }
  return out;
}

}  // namespace duet::detail
// DUET_CELL_MEMBERS(a, b, ...): makes a cell a Boost.Hana Struct over the listed members,
// without naming the class (so it works inside class templates too). Each member becomes a
// (name, accessor) pair, which is how cells find their children and parameters by name. A
// member cell that construct calls but the list leaves out is refused at its first call.

#include <boost/hana/pair.hpp>
#include <boost/hana/string.hpp>
#include <boost/hana/tuple.hpp>

#define DUET_DETAIL_MEMBER(m)                                           \
  ::boost::hana::make_pair(BOOST_HANA_STRING(#m), [](auto&& self) -> decltype(auto) { \
    return (static_cast<decltype(self)&&>(self).m);                     \
  })

#define DUET_DETAIL_EXPAND(x) x
#define DUET_DETAIL_FE_1(f, a) f(a)
#define DUET_DETAIL_FE_2(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_1(f, __VA_ARGS__))
#define DUET_DETAIL_FE_3(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_2(f, __VA_ARGS__))
#define DUET_DETAIL_FE_4(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_3(f, __VA_ARGS__))
#define DUET_DETAIL_FE_5(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_4(f, __VA_ARGS__))
#define DUET_DETAIL_FE_6(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_5(f, __VA_ARGS__))
#define DUET_DETAIL_FE_7(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_6(f, __VA_ARGS__))
#define DUET_DETAIL_FE_8(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_7(f, __VA_ARGS__))
#define DUET_DETAIL_FE_9(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_8(f, __VA_ARGS__))
#define DUET_DETAIL_FE_10(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_9(f, __VA_ARGS__))
#define DUET_DETAIL_FE_11(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_10(f, __VA_ARGS__))
#define DUET_DETAIL_FE_12(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_11(f, __VA_ARGS__))
#define DUET_DETAIL_FE_13(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_12(f, __VA_ARGS__))
#define DUET_DETAIL_FE_14(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_13(f, __VA_ARGS__))
#define DUET_DETAIL_FE_15(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_14(f, __VA_ARGS__))
#define DUET_DETAIL_FE_16(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_15(f, __VA_ARGS__))
#define DUET_DETAIL_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, N, ...) N
#define DUET_DETAIL_FOR_EACH(f, ...)                                                                        \
  DUET_DETAIL_EXPAND(DUET_DETAIL_PICK(__VA_ARGS__, DUET_DETAIL_FE_16, DUET_DETAIL_FE_15, DUET_DETAIL_FE_14, \
                                      DUET_DETAIL_FE_13, DUET_DETAIL_FE_12, DUET_DETAIL_FE_11,              \
                                      DUET_DETAIL_FE_10, DUET_DETAIL_FE_9, DUET_DETAIL_FE_8,                \
                                      DUET_DETAIL_FE_7, DUET_DETAIL_FE_6, DUET_DETAIL_FE_5,                 \
                                      DUET_DETAIL_FE_4, DUET_DETAIL_FE_3, DUET_DETAIL_FE_2,                 \
                                      DUET_DETAIL_FE_1)(f, __VA_ARGS__))

// Up to 16 members; a cell with more groups them into sub-cells.
#define DUET_CELL_MEMBERS(...)                                                              \
  struct hana_accessors_impl {                                                              \
    static constexpr auto apply() {                                                         \
      return ::boost::hana::make_tuple(DUET_DETAIL_FOR_EACH(DUET_DETAIL_MEMBER, __VA_ARGS__)); \
    }                                                                                       \
  }
// The graph evaluator: one call runs a whole optimised graph.
//
// Evaluation has two steps. plan() is the run-time half of compiling: for the concrete input
// shapes it infers every node's shape (the rules of capture, now on real sizes; a broken rule
// throws here, before anything runs) and lays out the intermediate values in one arena. run()
// takes the arena and the output tensor from the pool and calls each node's kernel in order:
// no per-node dispatch, and once the pool is warm for these shapes, no heap allocation. A
// plan depends only on the input shapes, so callers keep it and skip planning next time.
//
// Where values live is decided at compile time (plan_buffers): views alias what they view,
// the output node writes straight into the returned tensor, and every other node gets a slot
// that is reused once its last reader has run.

#include <array>
#include <cmath>
#include <string>
#include <string_view>
#include <type_traits>
#include <atomic>
#include <boost/hana/at.hpp>
#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>
#include <utility>

// Shape rules' results and how a broken rule is reported: a static_assert naming the layer,
// its requirement and the input shape when the shapes are known at compile time, a
// duet::ShapeError with the same words when they are known only at run time.

#include <array>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>


namespace duet {

enum class ShapeFault : unsigned char {
  none,
  last_dimension,  // the input's last dimension must equal `expected`
  min_rank,        // the input's rank must be at least `expected`
  exact_rank,      // the input's rank must be exactly `expected`
  element_count,   // the input must hold `expected` elements per sample
  shapes_differ,   // two inputs must have the same shape
  batch_dimension,  // the input must have a batch dimension in front: rank at least `expected`
};

// What a shape rule returns: the output shape and, if the inputs break the rule, which way.
// On a fault the shape is still the rule's best guess, so the layers after it are checked
// against something sane and one mistake gives one error.
struct ShapeResult {
  Shape shape;
  ShapeFault fault = ShapeFault::none;
  index_t expected = 0;
  int input = 0;  // which input broke the rule

  constexpr bool ok() const { return fault == ShapeFault::none; }
};

constexpr ShapeResult fault(Shape fallback, ShapeFault f, index_t expected, int input = 0) {
  return ShapeResult{fallback, f, expected, input};
}

// "nn::Dense<784, 512> 'dense_relu_sequential.0' expects an input whose last dimension is 784,
// got [64, 100]": the run-time wording of a broken rule.
inline std::string describe_fault(const ShapeResult& r, std::string_view layer, std::span<const Shape> inputs) {
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
      what = "inputs of the same shape";
      break;
    case ShapeFault::batch_dimension:
      return std::string(layer) + " expects an input of rank at least " + e +
             " whose first dimension is the batch, got " + got + ": the batch dimension is missing";
  }
  if (r.fault == ShapeFault::shapes_differ && inputs.size() > 1) {
    return std::string(layer) + " expects inputs of matching shapes, got " + to_string(inputs[0]) + " and " +
           to_string(inputs[1]);
  }
  return std::string(layer) + " expects " + what + ", got " + got;
}

// Compile-time reports. The type names are the message: compilers print the failing
// condition with its template arguments, which then reads as
//   layer_accepts<duet::nn::Dense<784, 512>, last_dimension_must_be<784>, input_shape<64, 100>>
namespace diagnostic {

template <index_t... Dims>
struct input_shape {};
template <index_t... TrailingDims>
struct input_shape_after_unknown_leading_dims {};

template <index_t N>
struct last_dimension_must_be {};
template <index_t N>
struct rank_must_be_at_least {};
template <index_t N>
struct rank_must_be {};
template <index_t N>
struct elements_per_sample_must_be {};
struct inputs_must_have_the_same_shape {};
template <index_t N>
struct batch_dimension_missing_rank_must_be_at_least {};

// Not derived from std::false_type: compilers would then print integral_constant<bool, false>
// instead of this type's name.
template <class Layer, class Requirement, class InputShape>
struct layer_accepts {
  static constexpr bool value = false;
};

template <ShapeFault F, index_t N>
constexpr auto requirement() {
  if constexpr (F == ShapeFault::last_dimension)
    return last_dimension_must_be<N>{};
  else if constexpr (F == ShapeFault::min_rank)
    return rank_must_be_at_least<N>{};
  else if constexpr (F == ShapeFault::exact_rank)
    return rank_must_be<N>{};
  else if constexpr (F == ShapeFault::element_count)
    return elements_per_sample_must_be<N>{};
  else if constexpr (F == ShapeFault::batch_dimension)
    return batch_dimension_missing_rank_must_be_at_least<N>{};
  else
    return inputs_must_have_the_same_shape{};
}

// ShapeOf is any type with a `static constexpr Shape shape`.
template <class ShapeOf, std::size_t... I>
constexpr auto shape_type(std::index_sequence<I...>) {
  constexpr Shape s = ShapeOf::shape;
  if constexpr (s.leading_unknown())
    return input_shape_after_unknown_leading_dims<s[static_cast<int>(I)]...>{};
  else
    return input_shape<s[static_cast<int>(I)]...>{};
}

// A class, so that one (layer, requirement, input shape) is reported once however many
// captures meet it. Reported by instantiating it: static_cast<void>(sizeof(rejection<...>)).
template <class Layer, class Requirement, class InputShape>
struct rejected {
  static_assert(layer_accepts<Layer, Requirement, InputShape>::value,
                "duet: a layer cannot accept its input's shape (the condition names the layer, "
                "its requirement and the input shape; -1 is a dynamic dimension)");
};

// The report of Layer's rule broken with fault F (N being what it expected) by an input whose
// shape is ShapeOf::shape.
template <class Layer, ShapeFault F, index_t N, class ShapeOf>
using rejection = rejected<Layer, decltype(requirement<F, N>()),
                           decltype(shape_type<ShapeOf>(
                               std::make_index_sequence<static_cast<std::size_t>(ShapeOf::shape.rank())>{}))>;

}  // namespace diagnostic
}  // namespace duet
// Graph capture: the compile-time IR of graph mode.
//
// A graph is a flat list of nodes (a hana::tuple), each an operation applied to the outputs of
// earlier nodes named by index, like SSA. Calling a cell's construct on a Sym (a symbolic
// tensor: a graph plus the index of the node it stands for) appends nodes instead of
// computing, so construct(Sym) returns the whole network as a type. The list stays flat, not
// nested like relu<dense<relu<...>>>, which keeps type names short and compiles faster.
//
// An operation type Op provides:
//   using layer_type                  the user-facing name compile-time errors show
//   static constexpr int arity        number of inputs
//   static constexpr bool is_view     output is input 0 with another shape (no kernel, no copy)
//   static constexpr bool is_elementwise   unary, same shape, may run in place or fuse as epilogue
//   static constexpr ShapeResult infer_static(std::span<const Shape>)   rule on compile-time patterns
//   ShapeResult infer(std::span<const Shape>) const                     the same rule at run time
//   template <class Backend, class T> void run(const KernelArgs&) const
//                                      its kernel; T is the type of the value it makes
//   using value_type                   (optional) that type, when it is not its first input's
//   static std::string op_name()       what it does, for graph_ir ("MatMul + BiasAdd + ReLU")
//   std::string label() const          who does it, for run-time errors ("nn::Dense<784, 512> 'fc'")
// and optionally:
//   static constexpr bool is_sink             makes no value, runs for its side effects
//                                             (a gradient written into a parameter)
//   static constexpr bool has_side_effects    a view whose kernel still runs
// Differentiable operations also say how their gradient is computed (see autodiff.hpp):
//   static constexpr std::array grad_operands   what the gradient op reads (Operand values)
//   template <bool InputGrad> auto grad_op() const   the op making the gradient of input 0
//                                             (if InputGrad) and of the op's parameters
//   static constexpr bool has_parameters

#include <array>
#include <boost/hana/append.hpp>
#include <boost/hana/at.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/unpack.hpp>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>


namespace duet::graph {

namespace hana = boost::hana;

// Calls f(std::integral_constant<std::size_t, I>{}) for I = 0, 1, ..., N-1 in order: the one
// loop over a graph's nodes at compile time. (A fold over lambdas nested in a lambda with a
// template parameter pack crashes clang 14; this shape does not.)
template <std::size_t N, class F>
constexpr void for_each_index(F&& f) {
  [&]<std::size_t... I>(std::index_sequence<I...>) { (f(std::integral_constant<std::size_t, I>{}), ...); }
  (std::make_index_sequence<N>{});
}

template <class Op, std::size_t... Args>
struct Node {
  using op_type = Op;
  static constexpr std::size_t arity = sizeof...(Args);
  static constexpr std::array<std::size_t, sizeof...(Args)> args{Args...};
  Op op;
};

// Node N's shape rule applied to its inputs' shapes, taken from the shapes of the nodes before it.
template <class N, std::size_t Count>
constexpr ShapeResult static_rule(const std::array<Shape, Count>& shapes) {
  std::array<Shape, N::arity> in{};
  for (std::size_t k = 0; k < N::arity; ++k) in[k] = shapes[N::args[k]];
  return N::op_type::infer_static(in);
}

template <class... Nodes>
constexpr std::array<Shape, sizeof...(Nodes)> infer_static_shapes() {
  std::array<Shape, sizeof...(Nodes)> shapes{};
  std::size_t i = 0;
  ((shapes[i] = static_rule<Nodes>(shapes).shape, ++i), ...);
  return shapes;
}

template <class... Nodes>
struct Graph {
  static constexpr std::size_t size = sizeof...(Nodes);
  // Shape inference: every node's output shape as far as compile time knows it.
  static constexpr std::array<Shape, size> shapes = infer_static_shapes<Nodes...>();
  using nodes_type = hana::tuple<Nodes...>;
  nodes_type nodes;
};

template <class G, std::size_t I>
using node_at = std::remove_cvref_t<decltype(hana::at_c<I>(std::declval<typename G::nodes_type&>()))>;

template <class Nodes>
auto make_graph(const Nodes& nodes) {
  return hana::unpack(
      nodes, [](const auto&... n) { return Graph<std::remove_cvref_t<decltype(n)>...>{hana::make_tuple(n...)}; });
}

// What an operation's kernel reads and writes. Inputs and output are untyped here because one
// node may mix element types (float logits, int32 labels); each op casts to what it knows.
struct KernelArgs {
  const void* const* inputs;
  const Shape* input_shapes;
  void* output;
  const Shape& output_shape;

  template <class U>
  const U* in(std::size_t k = 0) const {
    return static_cast<const U*>(inputs[k]);
  }
  const Shape& in_shape(std::size_t k = 0) const { return input_shapes[k]; }
  template <class U>
  U* out() const {
    return static_cast<U*>(output);
  }
};

// The element type of the value an op makes from inputs whose first has type First.
template <class Op, class First>
constexpr auto op_value_type() {
  if constexpr (requires { typename Op::value_type; })
    return std::type_identity<typename Op::value_type>{};
  else
    return std::type_identity<First>{};
}
template <class Op, class First>
using op_value_t = typename decltype(op_value_type<Op, First>())::type;

template <class G, std::size_t I>
constexpr auto node_value_type() {
  using N = node_at<G, I>;
  if constexpr (N::arity == 0)
    return std::type_identity<typename N::op_type::value_type>{};
  else
    return std::type_identity<
        op_value_t<typename N::op_type, typename decltype(node_value_type<G, N::args[0]>())::type>>{};
}
// The element type of node I's value.
template <class G, std::size_t I>
using node_value_t = typename decltype(node_value_type<G, I>())::type;

// A symbolic tensor: the value of node Out of graph G.
template <class>
inline constexpr bool no_value_during_capture = false;
template <class>
inline constexpr bool reassigned_during_capture = false;

// A class keyed on the variable's type, so that `x = fc1(x); x = relu(x);` is reported once.
template <class Variable>
struct reassignment_during_capture {
  static_assert(reassigned_during_capture<Variable>,
                "duet: inside construct, each operation returns a new symbolic type while a graph is captured; "
                "write `auto y = layer(x);` (a new name per step) instead of reassigning `x = layer(x);`");
};

// static_assert takes a literal only; the three uses below share it through this macro.
#define DUET_DETAIL_NO_VALUE_MESSAGE                                                                        \
  "duet: a tensor's value does not exist while a graph is captured (item(), data(), a branch on a value); " \
  "compute with graph operations, or run C++ on the value with duet::host(...) (a host node, "               \
  "JitSyntaxLevel::lax)"

template <class G, std::size_t Out>
struct Sym {
  using graph_type = G;
  using value_type = node_value_t<G, Out>;
  static constexpr std::size_t output = Out;
  static constexpr Shape shape = G::shapes[Out];
  G graph;

  // A graph is captured before it runs: reading a value then, or branching on one, cannot be
  // a graph operation. These say so, instead of "no member named item".
  template <class Dependent = void>
  value_type item() const {
    static_assert(no_value_during_capture<Dependent>, DUET_DETAIL_NO_VALUE_MESSAGE);
    return {};
  }
  template <class Dependent = void>
  const value_type* data() const {
    static_assert(no_value_during_capture<Dependent>, DUET_DETAIL_NO_VALUE_MESSAGE);
    return nullptr;
  }
  template <class Dependent = void>
  explicit operator bool() const {
    static_assert(no_value_during_capture<Dependent>, DUET_DETAIL_NO_VALUE_MESSAGE);
    return false;
  }

  // `x = layer(x);` in construct: a PyTorch habit that PyNative accepts (a Tensor stays a
  // Tensor) but capture cannot, every step being a Sym of its own type. Said here, instead of
  // "no match for operator=" with both graphs spelled out.
  template <class G2, std::size_t Out2>
  Sym& operator=(const Sym<G2, Out2>&) {
    static_cast<void>(sizeof(reassignment_during_capture<Sym>));
    return *this;
  }
};
#undef DUET_DETAIL_NO_VALUE_MESSAGE

template <class X>
inline constexpr bool is_sym_v = false;
template <class G, std::size_t Out>
inline constexpr bool is_sym_v<Sym<G, Out>> = true;

template <class X>
concept Symbolic = is_sym_v<std::remove_cvref_t<X>>;

template <class X>
inline constexpr bool is_input_op_v = false;

template <class Op>
constexpr bool is_sink() {
  if constexpr (requires { Op::is_sink; })
    return Op::is_sink;
  else
    return false;
}

// A host callback (duet::host): C++ on a live value, a graph break.
template <class Op>
constexpr bool is_host_op() {
  if constexpr (requires { Op::is_host; }) return Op::is_host;
  else return false;
}

// Whether a node's kernel runs: every op but a view without side effects.
template <class Op>
constexpr bool runs_kernel() {
  if constexpr (requires { Op::has_side_effects; })
    return !Op::is_view || Op::has_side_effects;
  else
    return !Op::is_view;
}

// What a gradient op reads, by its place around the forward op it differentiates.
enum class Operand : unsigned char { grad, input0, input1, output };

// Graph input K, of element type T, whose shape is known as far as Pattern says (a
// StaticShape, or AnyShape).
template <std::size_t K, class Pattern, class T>
struct InputOp {
  using layer_type = InputOp;
  using value_type = T;
  using pattern = Pattern;
  static constexpr int arity = 0;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr std::size_t index = K;
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Pattern::value}; }
  static std::string op_name() { return "Input " + std::to_string(K); }
  std::string label() const { return op_name(); }
};

template <std::size_t K, class Pattern, class T>
inline constexpr bool is_input_op_v<InputOp<K, Pattern, T>> = true;

// Whether a concrete shape fits a pattern: same rank, same size wherever the pattern is fixed.
constexpr bool fits(const Shape& pattern, const Shape& s) {
  if (pattern.leading_unknown()) {
    if (s.rank() < pattern.rank()) return false;
  } else if (s.rank() != pattern.rank()) {
    return false;
  }
  for (int i = 1; i <= pattern.rank(); ++i) {
    if (pattern[-i] != dyn && pattern[-i] != s[-i]) return false;
  }
  return true;
}

// The pattern of a runtime tensor: rank and sizes unknown until it arrives.
struct AnyShape {
  static constexpr Shape value = Shape::any();
};

// A capture on Pattern that reports no broken shape rule: a probe that asks whether the rules
// hold (first_rejection), or the stand-in for a part whose fault is reported elsewhere (quietly).
template <class Pattern>
struct Quiet {
  static constexpr Shape value = Pattern::value;
};
template <class Pattern>
inline constexpr bool is_quiet_v = false;
template <class Pattern>
inline constexpr bool is_quiet_v<Quiet<Pattern>> = true;

// The pattern of a symbolic tensor's shape.
template <class S>
struct SameShapeAs {
  static constexpr Shape value = S::shape;
};

// Whether appending to G reports a broken shape rule: unless G was captured on a Quiet
// input. (Node 0 is an input: each graph starts as one, and merging keeps the first graph's
// nodes in front.)
template <class G>
constexpr bool reports_faults() {
  using Op = typename node_at<G, 0>::op_type;
  if constexpr (is_input_op_v<Op>)
    return !is_quiet_v<typename Op::pattern>;
  else
    return true;
}

// The pattern graph mode captures a tensor of type X with.
template <class X>
struct pattern_of {
  using type = AnyShape;
};
template <class T, index_t... D>
struct pattern_of<StaticTensor<T, D...>> {
  using type = StaticShape<D...>;
};

// Symbolic input K of element type T.
template <class T, class Pattern, std::size_t K = 0>
auto input() {
  using G = Graph<Node<InputOp<K, Pattern, T>>>;
  return Sym<G, 0>{G{}};
}

template <class F, class Positions, class... X>
struct capturable;
template <class F, std::size_t... K, class... X>
struct capturable<F, std::index_sequence<K...>, X...> {
  static constexpr bool value = requires(F & f) {
    f(input<typename X::value_type, typename pattern_of<X>::type, K>()...);
  };
};

// Whether graph capture can call f on inputs like X...: a generic function or a Cell<...> can;
// a function of duet::Tensor, or a cell built at run time, only runs on real tensors.
template <class F, class... X>
concept Capturable = capturable<F, std::index_sequence_for<X...>, X...>::value;

// Node n with its arguments renumbered through map.
template <class N, std::size_t... Map, std::size_t... A>
auto renumbered(const N& n, std::index_sequence<Map...>, std::index_sequence<A...>) {
  constexpr std::array<std::size_t, sizeof...(Map)> map{Map...};
  return Node<typename N::op_type, map[N::args[A]]...>{n.op};
}

namespace detail {

template <class Nodes, std::size_t K>
constexpr std::size_t find_input() {
  constexpr std::size_t n = decltype(hana::length(std::declval<Nodes>()))::value;
  std::size_t found = n;
  for_each_index<n>([&](auto i) {
    using Op = typename std::remove_cvref_t<decltype(hana::at_c<decltype(i)::value>(std::declval<Nodes&>()))>::op_type;
    if constexpr (is_input_op_v<Op>) {
      if (found == n && Op::index == K) found = decltype(i)::value;
    }
  });
  return found;
}

// Appends b's nodes after `built`, the same input appearing once. Map[j] is where b's node j
// ends up. Other shared work is not detected: a value used by both sides is computed twice.
template <std::size_t J, class GB, class Built, std::size_t... Map>
auto merge_from(const GB& b, const Built& built, std::index_sequence<Map...> map) {
  if constexpr (J == GB::size) {
    return std::pair{make_graph(built), map};
  } else {
    using N = node_at<GB, J>;
    constexpr std::size_t built_size = decltype(hana::length(built))::value;
    if constexpr (is_input_op_v<typename N::op_type>) {
      constexpr std::size_t found = find_input<Built, N::op_type::index>();
      if constexpr (found < built_size) {
        using Existing = std::remove_cvref_t<decltype(hana::at_c<found>(built))>;
        static_assert(std::is_same_v<Existing, N>,
                      "duet: one graph input is used with two different element types or shape patterns");
        return merge_from<J + 1>(b, built, std::index_sequence<Map..., found>{});
      } else {
        return merge_from<J + 1>(b, hana::append(built, hana::at_c<J>(b.nodes)),
                                 std::index_sequence<Map..., built_size>{});
      }
    } else {
      return merge_from<J + 1>(
          b, hana::append(built, renumbered(hana::at_c<J>(b.nodes), map, std::make_index_sequence<N::arity>{})),
          std::index_sequence<Map..., built_size>{});
    }
  }
}

template <std::size_t I, std::size_t... M>
constexpr std::size_t at(std::index_sequence<M...>) {
  constexpr std::array<std::size_t, sizeof...(M)> map{M...};
  return map[I];
}

}  // namespace detail

// Input K of node I of G, as diagnostic::rejection takes a shape.
template <class G, std::size_t I, int K>
struct NodeInput {
  static constexpr Shape shape = G::shapes[node_at<G, I>::args[static_cast<std::size_t>(K)]];
};

template <class G, std::size_t I = 0>
constexpr auto first_rejection_of() {
  if constexpr (I == G::size) {
    return std::type_identity<void>{};
  } else {
    using N = node_at<G, I>;
    constexpr ShapeResult r = static_rule<N>(G::shapes);
    if constexpr (r.ok())
      return first_rejection_of<G, I + 1>();
    else
      return std::type_identity<
          diagnostic::rejection<typename N::op_type::layer_type, r.fault, r.expected, NodeInput<G, I, r.input>>>{};
  }
}
// The report (diagnostic::rejection) of the first node of G whose shape rule does not hold on
// the shapes compile time knows, void if all hold. Naming it reports nothing; instantiating it
// (sizeof) does, from wherever that is: a check made outside the capture keeps the
// diagnostic's context short.
template <class G>
using first_rejection = typename decltype(first_rejection_of<G>())::type;

// f(x), captured without reporting a broken shape rule: f runs on a Quiet input of x's shape
// and its nodes are spliced after x's, so the graph is the one f(x) would give. For a part
// whose fault is reported elsewhere: one mistake, one error.
template <class G, std::size_t Out, class F>
auto quietly(const Sym<G, Out>& x, F&& f) {
  using X = Sym<G, Out>;
  const auto q = f(input<typename X::value_type, Quiet<SameShapeAs<X>>>());
  using Q = std::remove_cvref_t<decltype(q)>;
  auto [g, map] = detail::merge_from<1>(q.graph, x.graph.nodes, std::index_sequence<Out>{});
  return Sym<decltype(g), detail::at<Q::output>(decltype(map){})>{g};
}

// Appends `op` applied to x. The rule runs here, at capture, so a compile-time mismatch is
// reported where the user's construct calls the layer.
template <class Op, class G, std::size_t Out>
auto append(const Op& op, const Sym<G, Out>& x) {
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, 1>{G::shapes[Out]});
  if constexpr (!r.ok() && reports_faults<G>()) {
    static_cast<void>(sizeof(diagnostic::rejection<typename Op::layer_type, r.fault, r.expected, Sym<G, Out>>));
  }
  auto g = make_graph(hana::append(x.graph.nodes, Node<Op, Out>{op}));
  return Sym<decltype(g), G::size>{g};
}

// Appends `op` applied to a and b, whose graphs are merged first.
template <class Op, class GA, std::size_t A, class GB, std::size_t B>
auto append(const Op& op, const Sym<GA, A>& a, const Sym<GB, B>& b) {
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, 2>{GA::shapes[A], GB::shapes[B]});
  if constexpr (!r.ok() && reports_faults<GA>() && reports_faults<GB>()) {
    using Culprit = std::conditional_t<r.input == 0, Sym<GA, A>, Sym<GB, B>>;
    static_cast<void>(sizeof(diagnostic::rejection<typename Op::layer_type, r.fault, r.expected, Culprit>));
  }
  auto [merged, map] = detail::merge_from<0>(b.graph, a.graph.nodes, std::index_sequence<>{});
  constexpr std::size_t b_at = detail::at<B>(decltype(map){});
  auto g = make_graph(hana::append(merged.nodes, Node<Op, A, b_at>{op}));
  return Sym<decltype(g), decltype(merged)::size>{g};
}

}  // namespace duet::graph
// JitConfig: how graph mode compiles a function or cell (MindSpore's mindspore.JitConfig).

#include <string>
#include <string_view>


namespace duet {

// Optimisation level. O0 runs the captured graph kernel by kernel (views are still aliases and
// nothing is dispatched or allocated per node); O1 adds fusion of elementwise chains and of
// bias/activation epilogues into the products; O2 also keeps each product's weight packed
// between calls (packed again only after the weight is written), which spares a batched
// forward pass the packing of every weight. All three give the same numbers.
enum class JitLevel : unsigned char { O0, O1, O2 };

// How much of C++ a jitted function may use. strict: anything that is not a graph operation
// (a host callback) is a compile error; lax: it becomes a host node, a graph break that runs
// eagerly between the compiled parts.
enum class JitSyntaxLevel : unsigned char { strict, lax };

// sink: the whole graph is one compiled call (one arena, slots reused); no_sink: node by node,
// each node's output in its own buffer; automatic: sink.
enum class ExecMode : unsigned char { automatic, sink, no_sink };

// debug: every node's output is checked for NaN and infinity, and a failing run-time check
// names the node and the function or construct it was captured from.
enum class DebugLevel : unsigned char { release, debug };

// A structural type, so that jit<JitConfig{...}> makes the configuration part of the program:
// it changes which passes run and what the evaluator checks.
struct JitConfig {
  JitLevel jit_level = JitLevel::O1;
  ExecMode exec_mode = ExecMode::automatic;
  JitSyntaxLevel jit_syntax_level = JitSyntaxLevel::lax;
  DebugLevel debug_level = DebugLevel::release;

  // MindSpore's spellings: parse("O2", "auto", "STRICT", "RELEASE"). Unknown values throw
  // duet::ValueError at run time, and do not compile in a constant expression.
  static constexpr JitConfig parse(std::string_view jit_level, std::string_view exec_mode = "auto",
                                   std::string_view jit_syntax_level = "LAX", std::string_view debug_level = "RELEASE") {
    JitConfig c;
    c.jit_level = jit_level == "O0"   ? JitLevel::O0
                  : jit_level == "O1" ? JitLevel::O1
                  : jit_level == "O2" ? JitLevel::O2
                                      : invalid<JitLevel>("jit_level", jit_level, "O0, O1 or O2");
    c.exec_mode = exec_mode == "auto"      ? ExecMode::automatic
                  : exec_mode == "sink"    ? ExecMode::sink
                  : exec_mode == "no_sink" ? ExecMode::no_sink
                                           : invalid<ExecMode>("exec_mode", exec_mode, "auto, sink or no_sink");
    c.jit_syntax_level = jit_syntax_level == "STRICT" ? JitSyntaxLevel::strict
                         : jit_syntax_level == "LAX"  ? JitSyntaxLevel::lax
                                                      : invalid<JitSyntaxLevel>("jit_syntax_level", jit_syntax_level,
                                                                                "STRICT or LAX");
    c.debug_level = debug_level == "RELEASE" ? DebugLevel::release
                    : debug_level == "DEBUG" ? DebugLevel::debug
                                             : invalid<DebugLevel>("debug_level", debug_level, "RELEASE or DEBUG");
    return c;
  }

  friend constexpr bool operator==(const JitConfig&, const JitConfig&) = default;

 private:
  template <class E>
  static constexpr E invalid(std::string_view field, std::string_view value, std::string_view allowed) {
    throw ValueError("duet::JitConfig: " + std::string(field) + " must be " + std::string(allowed) + ", got '" +
                     std::string(value) + "'");
  }
};

inline constexpr JitLevel O0 = JitLevel::O0;
inline constexpr JitLevel O1 = JitLevel::O1;
inline constexpr JitLevel O2 = JitLevel::O2;

}  // namespace duet

namespace duet {

namespace graph {

enum class Storage : unsigned char { input, view, slot, output, none };

template <std::size_t N>
struct BufferPlan {
  std::array<Storage, N> storage{};
  std::array<std::size_t, N> root{};  // the node whose memory a node's value lives in
  std::array<std::size_t, N> slot{};  // for Storage::slot roots
  std::size_t slot_count = 0;
};

// Reuse = false (exec_mode no_sink) gives every node a slot of its own, so every intermediate
// value survives until the call returns.
template <class G, std::size_t Out, bool Reuse = true>
constexpr BufferPlan<G::size> plan_buffers() {
  constexpr std::size_t n = G::size;
  BufferPlan<n> plan;
  std::array<std::size_t, n> last_read{};
  graph::for_each_index<n>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = node_at<G, I>;
    using Op = typename Node::op_type;
    if constexpr (is_input_op_v<Op>) {
      plan.storage[I] = Storage::input;
      plan.root[I] = I;
    } else if constexpr (Op::is_view) {
      plan.storage[I] = Storage::view;
      plan.root[I] = plan.root[Node::args[0]];
    } else if constexpr (is_sink<Op>()) {
      plan.storage[I] = Storage::none;
      plan.root[I] = I;
    } else {
      plan.storage[I] = Storage::slot;
      plan.root[I] = I;
    }
    for (std::size_t a : Node::args) {
      if (plan.storage[a] == Storage::none) throw "a sink node makes no value to read";
      last_read[plan.root[a]] = I;
    }
  });

  const std::size_t out_root = plan.root[Out];
  if (plan.storage[out_root] == Storage::slot) plan.storage[out_root] = Storage::output;
  last_read[out_root] = n;  // the caller reads it last

  // Greedy slot reuse: a slot is free again once every reader of its value has run.
  std::array<std::size_t, n> slot_owner{};
  std::array<bool, n> slot_busy{};
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t s = 0; s < plan.slot_count; ++s) {
      if (Reuse && slot_busy[s] && last_read[slot_owner[s]] < i) slot_busy[s] = false;
    }
    if (plan.storage[i] != Storage::slot) continue;
    std::size_t s = 0;
    while (s < plan.slot_count && slot_busy[s]) ++s;
    if (s == plan.slot_count) ++plan.slot_count;
    slot_busy[s] = true;
    slot_owner[s] = i;
    plan.slot[i] = s;
  }
  return plan;
}

// One more than the largest input index the graph reads: how many tensors a call passes.
template <class G>
constexpr std::size_t input_count() {
  std::size_t count = 0;
  for_each_index<G::size>([&](auto i) {
    using Op = typename node_at<G, decltype(i)::value>::op_type;
    if constexpr (is_input_op_v<Op>) count = Op::index + 1 > count ? Op::index + 1 : count;
  });
  return count;
}

// The run-time part of a compiled graph for one set of input shapes. A call may pass inputs
// the graph never reads (a function that ignores an argument); they count in the key.
template <class G, std::size_t Inputs>
struct Plan {
  static constexpr std::size_t inputs = Inputs;
  std::array<Shape, Inputs> input_shapes;
  std::array<Shape, G::size> shapes;
  std::array<std::size_t, G::size> offset;  // bytes into the arena, for slot nodes
  std::size_t arena_bytes = 0;
  std::string where;  // what the graph was captured from, for debug's messages
};

}  // namespace graph

namespace detail {
// How a failing node is named: in debug, by its place in the graph and the function or cell
// it was captured from (`where`), so a user finds the line of construct that made it.
template <JitConfig Config, class Op>
std::string node_context(std::size_t index, std::string_view where) {
  if constexpr (Config.debug_level == DebugLevel::debug) {
    return "duet (debug): in " + std::string(where) + ", node %" + std::to_string(index) + " (" + Op::op_name() + "): ";
  } else {
    (void)index;
    (void)where;
    return {};
  }
}
}  // namespace detail

// Infers every node's shape for these input shapes and lays out the arena.
template <JitConfig Config = JitConfig{}, class G, std::size_t Out, std::size_t Inputs>
graph::Plan<G, Inputs> plan(const graph::Sym<G, Out>& program, const std::array<Shape, Inputs>& input_shapes,
                            std::string where = "the graph") {
  static_assert(Inputs >= graph::input_count<G>(), "duet::plan: the graph reads more inputs than are given");
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out, Config.exec_mode != ExecMode::no_sink>();
  constexpr std::array<std::size_t, n> element_size = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<std::size_t, n>{sizeof(graph::node_value_t<G, I>)...};
  }
  (std::make_index_sequence<n>{});
  graph::Plan<G, Inputs> p;
  p.input_shapes = input_shapes;
  p.where = std::move(where);
  graph::for_each_index<n>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = graph::node_at<G, I>;
    using Op = typename Node::op_type;
    const Op& op = boost::hana::at_c<I>(program.graph.nodes).op;
    if constexpr (graph::is_input_op_v<Op>) {
      const Shape& s = input_shapes[Op::index];
      if (!graph::fits(G::shapes[I], s)) {
        throw ShapeError(detail::node_context<Config, Op>(I, p.where) + "duet: graph input " + std::to_string(Op::index) +
                         " must have shape " + to_string(G::shapes[I]) + ", got " + to_string(s));
      }
      p.shapes[I] = s;
    } else {
      std::array<Shape, Node::arity> copies{};
      std::span<const Shape> in;
      if constexpr (Node::arity == 1) {
        in = std::span<const Shape>(&p.shapes[Node::args[0]], 1);
      } else {
        for (std::size_t k = 0; k < Node::arity; ++k) copies[k] = p.shapes[Node::args[k]];
        in = copies;
      }
      const ShapeResult r = op.infer(in);
      if (!r.ok()) throw ShapeError(detail::node_context<Config, Op>(I, p.where) + describe_fault(r, op.label(), in));
      p.shapes[I] = r.shape;
    }
  });

  // Slots one after another, each 64-byte aligned.
  std::array<std::size_t, n> slot_bytes{};
  for (std::size_t i = 0; i < n; ++i) {
    if (buffers.storage[i] != graph::Storage::slot) continue;
    const auto bytes = static_cast<std::size_t>(p.shapes[i].numel()) * element_size[i];
    if (bytes > slot_bytes[buffers.slot[i]]) slot_bytes[buffers.slot[i]] = bytes;
  }
  std::array<std::size_t, n> slot_offset{};
  for (std::size_t s = 0; s < buffers.slot_count; ++s) {
    slot_offset[s] = p.arena_bytes;
    p.arena_bytes += (slot_bytes[s] + detail::block_alignment - 1) / detail::block_alignment * detail::block_alignment;
  }
  for (std::size_t i = 0; i < n; ++i) p.offset[i] = slot_offset[buffers.slot[i]];
  return p;
}

namespace detail {
// Debug's check of a node's output: the first NaN or infinity, named with its node.
template <class T>
void check_finite(const T* values, const Shape& shape, const std::string& context) {
  if constexpr (std::is_floating_point_v<T>) {
    for (index_t i = 0; i < shape.numel(); ++i) {
      if (!std::isfinite(values[i])) {
        throw ValueError(context + "output element " + std::to_string(i) + " of " + to_string(shape) + " is " +
                         (std::isnan(values[i]) ? "NaN" : "infinite"));
      }
    }
  }
}
}  // namespace detail

// Runs a graph with a plan made for these inputs' shapes; inputs in the order of their index.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class... Inputs>
auto run(const graph::Sym<G, Out>& program, const graph::Plan<G, sizeof...(Inputs)>& p, const Inputs&... inputs) {
  using Result = graph::node_value_t<G, Out>;
  constexpr std::size_t n = G::size;
  constexpr graph::BufferPlan<n> buffers = graph::plan_buffers<G, Out, Config.exec_mode != ExecMode::no_sink>();
  const std::array<const void*, sizeof...(Inputs)> input{static_cast<const void*>(inputs.data())...};

  detail::Storage arena(p.arena_bytes);
  BasicTensor<Result> result;
  std::array<void*, n> data;
  graph::for_each_index<n>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = graph::node_at<G, I>;
    using Op = typename Node::op_type;
    if constexpr (buffers.storage[I] == graph::Storage::input) {
      // Inputs are only read: kernels see them through KernelArgs::in, as const.
      data[I] = const_cast<void*>(input[Op::index]);
    } else {
      if constexpr (buffers.storage[I] == graph::Storage::view) {
        data[I] = data[buffers.root[I]];
      } else if constexpr (buffers.storage[I] == graph::Storage::output) {
        result = BasicTensor<Result>::uninitialized(p.shapes[I]);
        data[I] = result.data();
      } else if constexpr (buffers.storage[I] == graph::Storage::slot) {
        data[I] = arena.data() + p.offset[I];
      } else {
        data[I] = nullptr;
      }
      if constexpr (graph::runs_kernel<Op>()) {
        std::array<const void*, Node::arity> in;
        for (std::size_t k = 0; k < Node::arity; ++k) in[k] = data[Node::args[k]];
        const auto& op = boost::hana::at_c<I>(program.graph.nodes).op;
        using T = graph::node_value_t<G, I>;
        if constexpr (Node::arity == 1) {
          op.template run<Backend, T>(graph::KernelArgs{in.data(), &p.shapes[Node::args[0]], data[I], p.shapes[I]});
        } else {
          std::array<Shape, Node::arity> in_shapes;
          for (std::size_t k = 0; k < Node::arity; ++k) in_shapes[k] = p.shapes[Node::args[k]];
          op.template run<Backend, T>(graph::KernelArgs{in.data(), in_shapes.data(), data[I], p.shapes[I]});
        }
        if constexpr (Config.debug_level == DebugLevel::debug && !Op::is_view && !graph::is_sink<Op>()) {
          detail::check_finite(static_cast<const T*>(data[I]), p.shapes[I], detail::node_context<Config, Op>(I, p.where));
        }
      }
    }
  });

  constexpr std::size_t out_root = buffers.root[Out];
  if constexpr (buffers.storage[out_root] == graph::Storage::input) {
    // The graph only reshapes an input: its output is a view of that input.
    constexpr std::size_t k = graph::node_at<G, out_root>::op_type::index;
    return tensor_of(std::get<k>(std::forward_as_tuple(inputs...))).reshape(p.shapes[Out]);
  } else if constexpr (out_root != Out) {
    return result.reshape(p.shapes[Out]);
  } else {
    return result;
  }
}

namespace detail {
// Identifies a user of plan caches (a cell, a gradient function) for the program's life; an
// address would not do, since a new object at a freed address may have other sizes.
inline std::uint64_t new_plan_owner() {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

// The plan of the last input shapes `owner` ran this graph type with on this thread. Per
// thread, so concurrent callers never share or lock; one entry, so it costs nothing to keep.
template <JitConfig Config = JitConfig{}, class G, std::size_t Out, std::size_t N, class Where>
const graph::Plan<G, N>& cached_plan(std::uint64_t owner, const graph::Sym<G, Out>& program,
                                     const std::array<Shape, N>& shapes, Where&& where) {
  thread_local struct {
    std::uint64_t owner = 0;
    graph::Plan<G, N> plan;
  } cache;
  if (cache.owner != owner || cache.plan.input_shapes != shapes) {
    cache.owner = 0;  // stays invalid if planning throws
    cache.plan = plan<Config>(program, shapes, std::string(where()));
    cache.owner = owner;
  }
  return cache.plan;
}
}  // namespace detail

// Plans and runs in one call.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class... Inputs>
auto evaluate(const graph::Sym<G, Out>& program, const Inputs&... inputs) {
  return run<Backend, Config>(program, plan<Config>(program, std::array<Shape, sizeof...(Inputs)>{inputs.shape()...}),
                              inputs...);
}

}  // namespace duet
// jit: a function of tensors compiled into a static graph, whatever the global context
// (MindSpore's mindspore.jit and JitConfig).
//
//   auto run_with_jit = duet::jit(run);                                   // function transform
//   auto run = duet::jit([&](auto x) { return model(x); });               // decorator form
//   auto fast = duet::jit<duet::JitConfig{.jit_level = duet::O2}>(run);   // with a configuration
//   struct Net : nn::Cell<Net, duet::JitConfig{}> {...};                  // jit on construct
//
// Calling a jitted function captures it on symbolic tensors (a compile-time graph), checks and
// optimises the graph at the JitConfig's level, and runs it in one evaluator call. The run-time
// half of compiling (a "compiled form": the plan for the input shapes) is made once per input
// signature, and counted: each jitted function and the program keep a compile count and a log
// saying why each recompilation happened.
//
// The signature of a call is the dtype and shape of each tensor argument (its input_signature
// pattern instead, when one is given: a dynamic dimension then means one compiled form for all
// its sizes), the value of each other argument (unless wrapped in duet::mutable_), and the
// current values of the hash_args.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

// Where a graph meets the host: printing a live value, and calling back into C++.
//
// duet::print is a graph operation: in either mode, and at every jit level, it prints the value
// when it is computed and passes it on unchanged (as a view), so a user never has to take jit
// away to see a value. duet::host runs any C++ function on a value: a host node, a graph
// break that runs eagerly between compiled parts. A jit function of JitSyntaxLevel::strict
// refuses host nodes at compile time.

#include <algorithm>
#include <array>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <utility>

// PyNative evaluation of one operation: run its shape rule, allocate its output from the
// pool, call its kernel. The graph evaluator uses the same rule and the same kernel, which is
// why the two modes agree.

#include <array>
#include <type_traits>
#include <utility>

// The PyNative half of autodiff: a tape that records each operation as it runs, then walks
// back over the records calling each operation's gradient op, the same op graph mode
// appends to its backward graph.

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

// The recording half of PIJit: while a trace is active, every eager operation appends a step
// (the op, the values it reads and the value it makes), so a network built at run time can be
// captured by running it once. pijit.hpp optimises and replays the trace.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace duet {
namespace fn {
struct Relu;
}  // namespace fn
namespace ops {
template <class Layer, bool Bias, class... Fns>
struct MatMulOp;
template <class Layer>
struct BiasAddOp;
template <class... Fns>
struct MapOp;
}  // namespace ops
}  // namespace duet

namespace duet::pijit {

class Trace;

// The trace recording on this thread, if any. Eager operations check it once each.
inline Trace*& active_trace() {
  thread_local Trace* trace = nullptr;
  return trace;
}

// A value of the trace: an input of the traced function, a constant it read (a tensor the trace
// did not make, held by handle), or what a step makes.
struct Value {
  enum class Kind : unsigned char { input, constant, computed, view };
  Kind kind = Kind::computed;
  Shape shape;
  std::size_t element_size = 0;
  std::size_t input = 0;               // Kind::input: which argument
  std::size_t view_of = 0;             // Kind::view: the value whose memory it shares
  std::shared_ptr<const void> handle;  // Kind::constant: keeps the tensor's storage alive
  const void* data = nullptr;          // Kind::constant
};

// What a step would be as the epilogue of a product, for fusion after the trace.
struct EpilogueInfo {
  enum class Kind : unsigned char { none, bias, relu };
  Kind kind = Kind::none;
  const void* layer = nullptr;  // Kind::bias: whose bias
};

class Step {
 public:
  virtual ~Step() = default;
  // data[v] is value v's memory; views are resolved before.
  virtual void run(void* const* data, const std::vector<Value>& values) const = 0;
  // This step followed by `next` as one step, when this step can take it as its epilogue.
  virtual std::unique_ptr<Step> absorb(const Step& next) const = 0;
  // This step reading its weight packed between calls (JitLevel::O2), if it has a weight.
  virtual std::unique_ptr<Step> with_packed_weight() const = 0;
  virtual EpilogueInfo as_epilogue() const = 0;
  virtual bool is_view() const = 0;
  virtual bool runs_kernel() const = 0;

  std::vector<std::size_t> inputs;
  std::size_t output = 0;
};

template <class Op, class T>
class OpStep;

namespace detail {
template <class Op, class T>
std::unique_ptr<Step> fused(const Op& op, const Step& from, std::size_t output) {
  auto s = std::make_unique<OpStep<Op, T>>(op);
  s->inputs = from.inputs;
  s->output = output;
  return s;
}

template <class X>
inline constexpr bool is_matmul_v = false;
template <class L, bool B, class... Fns>
inline constexpr bool is_matmul_v<ops::MatMulOp<L, B, Fns...>> = true;
}  // namespace detail

template <class Op, class T>
class OpStep final : public Step {
 public:
  explicit OpStep(const Op& op) : op_(op) {}

  void run(void* const* data, const std::vector<Value>& values) const override {
    if constexpr (graph::runs_kernel<Op>()) run_kernel(data, values);
  }

  // A product takes its layer's bias and then a ReLU, as the graph passes fuse them.
  std::unique_ptr<Step> absorb(const Step& next) const override {
    if constexpr (detail::is_matmul_v<Op>) {
      const EpilogueInfo e = next.as_epilogue();
      if (e.kind == EpilogueInfo::Kind::bias && e.layer == op_.layer) {
        if constexpr (std::is_same_v<Op, ops::MatMulOp<typename Op::layer_type, false>>) {
          return detail::fused<ops::MatMulOp<typename Op::layer_type, true>, T>({op_.layer}, *this, next.output);
        }
      }
      if (e.kind == EpilogueInfo::Kind::relu) {
        if constexpr (std::is_same_v<Op, ops::MatMulOp<typename Op::layer_type, true>>) {
          return detail::fused<ops::MatMulOp<typename Op::layer_type, true, fn::Relu>, T>({op_.layer}, *this, next.output);
        }
      }
    } else {
      (void)next;
    }
    return nullptr;
  }

  std::unique_ptr<Step> with_packed_weight() const override {
    if constexpr (requires { op_.with_packed_weight(); }) {
      return detail::fused<decltype(op_.with_packed_weight()), T>(op_.with_packed_weight(), *this, output);
    } else {
      return nullptr;
    }
  }

  EpilogueInfo as_epilogue() const override {
    if constexpr (std::is_same_v<Op, ops::MapOp<fn::Relu>>) {
      return {EpilogueInfo::Kind::relu, nullptr};
    } else if constexpr (requires { op_.layer; } && !detail::is_matmul_v<Op>) {
      if constexpr (std::is_same_v<Op, ops::BiasAddOp<typename Op::layer_type>>) return {EpilogueInfo::Kind::bias, op_.layer};
      else return {};
    } else {
      return {};
    }
  }

  bool is_view() const override { return Op::is_view; }
  bool runs_kernel() const override { return graph::runs_kernel<Op>(); }

 private:
  // Instantiated only for ops with a kernel: views have none.
  void run_kernel(void* const* data, const std::vector<Value>& values) const {
    std::array<const void*, Op::arity> in{};
    std::array<Shape, Op::arity> shapes{};
    for (std::size_t k = 0; k < static_cast<std::size_t>(Op::arity); ++k) {
      in[k] = data[inputs[k]];
      shapes[k] = values[inputs[k]].shape;
    }
    op_.template run<DefaultBackend, T>(graph::KernelArgs{in.data(), shapes.data(), data[output], values[output].shape});
  }

  Op op_;
};

// Begins a new backward pass on the replaying thread, where the traced one began one.
class BackwardPassStep final : public Step {
 public:
  void run(void* const*, const std::vector<Value>&) const override { duet::detail::begin_backward_pass(); }
  std::unique_ptr<Step> absorb(const Step&) const override { return nullptr; }
  std::unique_ptr<Step> with_packed_weight() const override { return nullptr; }
  EpilogueInfo as_epilogue() const override { return {}; }
  bool is_view() const override { return false; }
  bool runs_kernel() const override { return true; }
};

class Trace {
 public:
  Trace() : generation_(next_generation()) {}

  // Marks x (this handle and copies made from it afterwards) as input k.
  template <class T>
  void add_input(BasicTensor<T>& x, std::size_t k) {
    Value v;
    v.kind = Value::Kind::input;
    v.shape = x.shape();
    v.element_size = sizeof(T);
    v.input = k;
    add(std::move(v), x);
  }

  // A sink (an op that makes no value: a parameter's gradient written in place) is a step of a
  // training step's trace only; in any other it is a graph break.
  template <class Op, class T, class... In>
  void record(const Op& op, BasicTensor<T>& y, const BasicTensor<In>&... x) {
    if constexpr (graph::is_sink<Op>()) {
      if (!parameter_gradients_) mark_broken("calls " + op.label() + ", which makes no value");
    }
    // A host callback is C++ the replay would run on values it never saw made: the caller runs
    // eagerly instead, so that it is a plain call every time.
    if constexpr (graph::is_host_op<Op>()) mark_broken("calls duet::host, a host callback");
    auto step = std::make_unique<OpStep<Op, T>>(op);
    (step->inputs.push_back(value_of(x)), ...);
    Value v;
    v.element_size = graph::is_sink<Op>() ? 0 : sizeof(T);
    v.shape = graph::is_sink<Op>() ? Shape{} : y.shape();
    if constexpr (Op::is_view) {
      v.kind = Value::Kind::view;
      v.view_of = root_of(step->inputs[0]);
    }
    step->output = values_.size();
    add(std::move(v), y);
    steps_.push_back(std::move(step));
  }

  // A backward pass begins (parameters' gradients are assigned afresh from here): a step, so
  // that each replay begins its own.
  void record_backward_pass() {
    auto step = std::make_unique<BackwardPassStep>();
    step->output = values_.size();
    values_.push_back(Value{});
    steps_.push_back(std::move(step));
  }

  // The traced function is a whole training step, whose parameters' gradients are written in
  // place by its gradient ops: those are steps to replay, not breaks.
  void allow_parameter_gradients() { parameter_gradients_ = true; }

  // The value a tensor is, or nothing if the trace never saw it.
  template <class T>
  std::size_t find(const BasicTensor<T>& x) const {
    const std::uint64_t id = x.trace_id();
    if ((id >> 32) != (generation_ & 0xFFFFFFFFu) || id == 0) return values_.size();
    return static_cast<std::size_t>((id & 0xFFFFFFFFu) - 1);
  }

  // A cell ran during the trace; its check says whether it has hooks now.
  void note_cell(std::function<bool()> has_hooks) { cells_.push_back(std::move(has_hooks)); }

  // The cells whose forward is running, innermost last: what a graph break is blamed on.
  void enter_cell(std::string label) { running_.push_back(std::move(label)); }
  void leave_cell() { running_.pop_back(); }

  // The trace cannot be replayed, because the running cell does `what`; the first reason stays.
  void mark_broken(const std::string& what) {
    if (broken_.empty()) broken_ = (running_.empty() ? std::string("the function") : running_.back()) + " " + what;
  }
  std::vector<std::function<bool()>>& cells() { return cells_; }

  std::vector<Value>& values() { return values_; }
  std::vector<std::unique_ptr<Step>>& steps() { return steps_; }
  // Why the trace cannot be replayed, or empty.
  const std::string& broken() const { return broken_; }

 private:
  static std::uint64_t next_generation() {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  // A tensor the trace did not make is a constant: read through its handle at every replay.
  template <class T>
  std::size_t value_of(const BasicTensor<T>& x) {
    const std::size_t v = find(x);
    if (v < values_.size()) return v;
    Value c;
    c.kind = Value::Kind::constant;
    c.shape = x.shape();
    c.element_size = sizeof(T);
    auto handle = std::make_shared<BasicTensor<T>>(x);
    c.data = handle->data();
    c.handle = std::move(handle);
    values_.push_back(std::move(c));
    return values_.size() - 1;
  }

  std::size_t root_of(std::size_t v) const {
    while (values_[v].kind == Value::Kind::view) v = values_[v].view_of;
    return v;
  }

  template <class T>
  void add(Value v, BasicTensor<T>& tensor) {
    values_.push_back(std::move(v));
    tensor.set_trace_id(((generation_ & 0xFFFFFFFFu) << 32) | values_.size());
  }

  std::uint64_t generation_;
  std::vector<Value> values_;
  std::vector<std::unique_ptr<Step>> steps_;
  std::vector<std::function<bool()>> cells_;
  std::vector<std::string> running_;
  std::string broken_;
  bool parameter_gradients_ = false;
};

// Names a cell as running in the active trace, if any, for its lifetime.
class TracedCell {
 public:
  template <class Label>
  explicit TracedCell(Label&& label) : trace_(active_trace()) {
    if (trace_ != nullptr) trace_->enter_cell(label());
  }
  TracedCell(const TracedCell&) = delete;
  TracedCell& operator=(const TracedCell&) = delete;
  ~TracedCell() {
    if (trace_ != nullptr) trace_->leave_cell();
  }
  Trace* trace() const { return trace_; }

 private:
  Trace* trace_;
};

// Makes a trace the active one for its lifetime.
class Tracing {
 public:
  explicit Tracing(Trace* trace) : outer_(std::exchange(active_trace(), trace)) {}
  Tracing(const Tracing&) = delete;
  Tracing& operator=(const Tracing&) = delete;
  ~Tracing() { active_trace() = outer_; }

 private:
  Trace* outer_;
};

}  // namespace duet::pijit

namespace duet {

namespace detail {
template <class Backend, class Op, class First, class... Rest>
auto run_into_new(const Op& op, const BasicTensor<First>& first, const BasicTensor<Rest>&... rest);
}  // namespace detail

namespace ops {

// The sum of two gradients reaching one value.
struct GradAddOp {
  using layer_type = GradAddOp;
  static constexpr int arity = 2;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::add(a.in<T>(0), a.in<T>(1), a.in_shape(0).numel(), a.out<T>());
  }
  static std::string op_name() { return "GradAdd"; }
  std::string label() const { return op_name(); }
};

}  // namespace ops

namespace autodiff {

template <class Op>
constexpr bool declared_differentiable() {
  if constexpr (requires { Op::differentiable; }) return Op::differentiable;
  else return true;
}

// An op autodiff can go through: it names its gradient op and what that op reads.
template <class Op>
concept Differentiable = requires {
  Op::grad_operands;
  Op::has_parameters;
} && declared_differentiable<Op>();

class Tape;

// The tape recording on this thread, if any. Eager operations check it once each.
inline Tape*& active_tape() {
  thread_local Tape* tape = nullptr;
  return tape;
}

class Entry {
 public:
  virtual ~Entry() = default;
  virtual void backward(Tape& tape) = 0;
};

// An entry whose value can receive a gradient.
template <class T>
class ValueEntry : public Entry {
 public:
  // Gradients from several readers add up, through an op that a trace records. Never in place:
  // the first may alias another value.
  void accumulate(BasicTensor<T> g);
  const BasicTensor<T>* grad() const { return has_grad_ ? &grad_ : nullptr; }

 private:
  BasicTensor<T> grad_;
  bool has_grad_ = false;
};

// A value the caller differentiates with respect to (an input of grad_position).
template <class T>
class LeafEntry final : public ValueEntry<T> {
 public:
  void backward(Tape&) override {}
};

class Tape {
 public:
  Tape() : generation_(next_generation()) {}
  Tape(const Tape&) = delete;
  Tape& operator=(const Tape&) = delete;

  // Tracks x (the handle given, and copies made from it afterwards) as a leaf.
  template <class T>
  void watch(BasicTensor<T>& x) {
    add(std::make_unique<LeafEntry<T>>(), x);
  }

  template <class T>
  bool tracks(const BasicTensor<T>& x) const {
    return index_of(x.tape_id()) < entries_.size();
  }

  template <class T>
  ValueEntry<T>* entry_of(const BasicTensor<T>& x) const {
    const std::size_t i = index_of(x.tape_id());
    return i < entries_.size() ? static_cast<ValueEntry<T>*>(entries_[i].get()) : nullptr;
  }

  // Called by every eager operation while this tape is active.
  template <class Op, class Out, class... In>
  void record(const Op& op, BasicTensor<Out>& y, const BasicTensor<In>&... x);

  // Records a cell call, for its backward hooks; returns the slot its output goes in.
  template <class T, class Hook>
  BasicTensor<T>* begin_cell(const BasicTensor<T>& input, Hook hook);

  // Seeds d(output)/d(output) = 1 and runs every record's gradient, last first.
  template <class T>
  void backward(const BasicTensor<T>& output);

 private:
  static std::uint64_t next_generation() {
    static std::atomic<std::uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  std::size_t index_of(std::uint64_t id) const {
    return (id >> 32) == (generation_ & 0xFFFFFFFFu) && id != 0 ? static_cast<std::size_t>((id & 0xFFFFFFFFu) - 1)
                                                                : entries_.size();
  }

  template <class T>
  void add(std::unique_ptr<Entry> e, BasicTensor<T>& value) {
    entries_.push_back(std::move(e));
    value.set_tape_id(((generation_ & 0xFFFFFFFFu) << 32) | entries_.size());
  }

  std::uint64_t generation_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// Makes a tape the active one for its lifetime (nested scopes restore the outer tape).
class Recording {
 public:
  explicit Recording(Tape* tape) : outer_(std::exchange(active_tape(), tape)) {}
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
  ~Recording() { active_tape() = outer_; }

 private:
  Tape* outer_;
};

template <class T>
void ValueEntry<T>::accumulate(BasicTensor<T> g) {
  if (!has_grad_) {
    grad_ = std::move(g);
    has_grad_ = true;
    return;
  }
  grad_ = duet::detail::run_into_new<DefaultBackend>(ops::GradAddOp{}, grad_, g);
}

// One recorded operation: the op, the handles of its inputs and output, and the gradient of
// its output once readers have sent theirs.
template <class Op, class Out, class... In>
class OpEntry final : public ValueEntry<Out> {
 public:
  OpEntry(const Op& op, const BasicTensor<Out>& y, const BasicTensor<In>&... x) : op_(op), output_(y), inputs_(x...) {}

  void backward(Tape& tape) override {
    const BasicTensor<Out>* g = this->grad();
    if (g == nullptr) return;
    auto& x0 = std::get<0>(inputs_);
    if (tape.tracks(x0)) {
      auto dx = run_grad(op_.template grad_op<true>(), *g);
      tape.entry_of(x0)->accumulate(std::move(dx));
    } else if constexpr (Op::has_parameters) {
      run_grad(op_.template grad_op<false>(), *g);
    }
  }

 private:
  template <graph::Operand O>
  const auto& operand(const BasicTensor<Out>& g) const {
    if constexpr (O == graph::Operand::grad)
      return g;
    else if constexpr (O == graph::Operand::output)
      return output_;
    else if constexpr (O == graph::Operand::input0)
      return std::get<0>(inputs_);
    else
      return std::get<1>(inputs_);
  }

  template <class GradOp>
  auto run_grad(const GradOp& gop, const BasicTensor<Out>& g) const {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return duet::detail::run_into_new<DefaultBackend>(gop, operand<Op::grad_operands[I]>(g)...);
    }
    (std::make_index_sequence<Op::grad_operands.size()>{});
  }

  Op op_;
  BasicTensor<Out> output_;
  std::tuple<BasicTensor<In>...> inputs_;
};

// A cell call: after the cell's own records have run backward, its hook sees both gradients.
template <class T, class Hook>
class CellEntry final : public Entry {
 public:
  CellEntry(const BasicTensor<T>& input, Hook hook) : input_(input), hook_(std::move(hook)) {}

  void backward(Tape& tape) override {
    const ValueEntry<T>* out = tape.entry_of(output);
    if (out == nullptr || out->grad() == nullptr) return;
    const ValueEntry<T>* in = tape.entry_of(input_);
    const BasicTensor<T> none;
    hook_(in != nullptr && in->grad() != nullptr ? *in->grad() : none, *out->grad());
  }

  BasicTensor<T> output;

 private:
  BasicTensor<T> input_;
  Hook hook_;
};

template <class Op, class Out, class... In>
void Tape::record(const Op& op, BasicTensor<Out>& y, const BasicTensor<In>&... x) {
  const bool reads_tracked = (tracks(x) || ...);
  if constexpr (Differentiable<Op>) {
    if (!reads_tracked && !Op::has_parameters) return;
    add(std::make_unique<OpEntry<Op, Out, In...>>(op, y, x...), y);
  } else if (reads_tracked) {
    throw ValueError("duet::grad: " + op.label() + " is not differentiable, but a gradient flows through it");
  }
}

template <class T, class Hook>
BasicTensor<T>* Tape::begin_cell(const BasicTensor<T>& input, Hook hook) {
  auto entry = std::make_unique<CellEntry<T, Hook>>(input, std::move(hook));
  BasicTensor<T>* slot = &entry->output;
  entries_.push_back(std::move(entry));
  return slot;
}

template <class T>
void Tape::backward(const BasicTensor<T>& output) {
  ValueEntry<T>* seed = entry_of(output);
  if (seed == nullptr) {
    throw ValueError("duet::grad: the function's output does not depend on anything being differentiated");
  }
  seed->accumulate(full<T>(output.shape(), T(1)));
  Recording off(nullptr);
  detail::begin_backward_pass();
  if (pijit::Trace* trace = pijit::active_trace()) trace->record_backward_pass();
  for (std::size_t i = entries_.size(); i-- > 0;) entries_[i]->backward(*this);
}

}  // namespace autodiff
}  // namespace duet

namespace duet {

namespace detail {

template <class Op, std::size_t N>
Shape checked_output_shape(const Op& op, const std::array<Shape, N>& in) {
  const ShapeResult r = op.infer(in);
  if (!r.ok()) throw ShapeError(describe_fault(r, op.label(), in));
  return r.shape;
}

template <class Backend, class Op, class First, class... Rest>
auto run_into_new(const Op& op, const BasicTensor<First>& first, const BasicTensor<Rest>&... rest) {
  using T = graph::op_value_t<Op, First>;
  const std::array<Shape, 1 + sizeof...(Rest)> shapes{first.shape(), rest.shape()...};
  const Shape out_shape = checked_output_shape(op, shapes);
  const std::array<const void*, 1 + sizeof...(Rest)> in{first.data(), rest.data()...};
  BasicTensor<T> y;
  if constexpr (Op::is_view) {
    if constexpr (graph::runs_kernel<Op>()) {
      op.template run<Backend, T>(graph::KernelArgs{in.data(), shapes.data(), nullptr, out_shape});
    }
    y = first.reshape(out_shape);
  } else if constexpr (graph::is_sink<Op>()) {
    op.template run<Backend, T>(graph::KernelArgs{in.data(), shapes.data(), nullptr, out_shape});
    if (pijit::Trace* trace = pijit::active_trace()) trace->record(op, y, first, rest...);
    return y;
  } else {
    y = BasicTensor<T>::uninitialized(out_shape);
    op.template run<Backend, T>(graph::KernelArgs{in.data(), shapes.data(), y.data(), out_shape});
  }
  // The trace first: the tape keeps a copy of y, which must already be the trace's value.
  if (pijit::Trace* trace = pijit::active_trace()) trace->record(op, y, first, rest...);
  if (autodiff::Tape* tape = autodiff::active_tape()) tape->record(op, y, first, rest...);
  return y;
}

}  // namespace detail

template <class Backend = DefaultBackend, class Op, class T>
auto run_eager(const Op& op, const BasicTensor<T>& x) {
  return detail::run_into_new<Backend>(op, x);
}

// A temporary nobody else holds is overwritten in place by elementwise operations, unless a
// tape or a trace records: their records keep the values they read.
template <class Backend = DefaultBackend, class Op, class T>
auto run_eager(const Op& op, BasicTensor<T>&& x) {
  if constexpr (Op::is_elementwise) {
    if (x.use_count() == 1 && autodiff::active_tape() == nullptr && pijit::active_trace() == nullptr) {
      const std::array<Shape, 1> shapes{x.shape()};
      const Shape out_shape = detail::checked_output_shape(op, shapes);
      const void* in[1] = {x.data()};
      op.template run<Backend, T>(graph::KernelArgs{in, shapes.data(), x.data(), out_shape});
      return std::move(x);
    }
  }
  return detail::run_into_new<Backend>(op, static_cast<const BasicTensor<T>&>(x));
}

// The one entry point layers use: on symbolic tensors it records the operation in the graph,
// on real tensors it runs it now.
template <class Op, class X>
auto apply(const Op& op, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return graph::append(op, x);
  } else {
    return run_eager(op, std::forward<X>(x));
  }
}

template <class Op, class A, class B>
auto apply(const Op& op, const A& a, const B& b) {
  if constexpr (graph::Symbolic<A> && graph::Symbolic<B>) {
    return graph::append(op, a, b);
  } else {
    static_assert(!graph::Symbolic<A> && !graph::Symbolic<B>,
                  "duet: an operation mixes a symbolic tensor (graph capture) and a real one; pass "
                  "every tensor the graph reads as an input of the captured function");
    return detail::run_into_new<DefaultBackend>(op, tensor_of(a), tensor_of(b));
  }
}

}  // namespace duet
// Printing tensors: `std::cout << t` and duet::to_string(t) give exactly what numpy 1.24's
// str(array) gives with the default print options, which is how MindSpore prints tensors.
//
// The code follows numpy/core/arrayprint.py (array2string, _formatArray, FloatingFormat,
// IntegerFormat); the names below refer to it. numpy's Dragon4 prints the shortest decimal that
// reads back as the same value, as std::to_chars does, and rounds the exact binary value to
// nearest, ties to even, when a precision cuts it short, as std::to_chars does too.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace duet {

namespace detail {

// numpy's default print options.
inline constexpr std::size_t print_line_width = 75;
inline constexpr index_t print_threshold = 1000;  // more elements than this are summarised
inline constexpr index_t print_edge_items = 3;    // kept at each end of a summarised axis
inline constexpr int print_precision = 8;         // most digits after the point

// Stands for the "..." of a summarised axis where an index would be.
inline constexpr index_t print_ellipsis = -1;

// Calls fn with the indices along an axis of length n that are printed, in order, and with
// print_ellipsis where the middle ones are left out.
template <class Fn>
void for_each_printed(index_t n, bool summarise, Fn&& fn) {
  const bool gap = summarise && n > 2 * print_edge_items;
  for (index_t i = 0; i < n; ++i) {
    if (gap && i == print_edge_items) {
      fn(print_ellipsis);
      i = n - print_edge_items;
    }
    fn(i);
  }
}

// The printed elements in order: numpy computes the format from these alone (_leading_trailing).
template <class T>
void collect_printed(const T* data, const Shape& shape, int axis, bool summarise, std::vector<T>& out) {
  if (axis == shape.rank()) {
    out.push_back(*data);
    return;
  }
  const index_t stride = shape.numel_from(axis + 1);
  for_each_printed(shape[axis], summarise, [&](index_t i) {
    if (i != print_ellipsis) collect_printed(data + i * stride, shape, axis + 1, summarise, out);
  });
}

template <class... Args>
std::string chars_of(Args... args) {
  char buf[400];  // fits any double, even in fixed notation with print_precision decimals
  const auto result = std::to_chars(buf, buf + sizeof buf, args...);
  return std::string(buf, result.ptr);
}

inline std::string integer_str(std::int64_t x) { return chars_of(x); }

// A finite float in scientific notation: sign, significant digits and the exponent of the first
// digit. The shortest that reads back (precision < 0), or rounded to 1 + precision digits.
struct Decimal {
  bool negative = false;
  std::string digits;
  int exponent = 0;
};

template <class F>
Decimal decimal_of(F x, int precision = -1) {
  const std::string s = precision < 0 ? chars_of(x, std::chars_format::scientific)
                                      : chars_of(x, std::chars_format::scientific, precision);
  Decimal d;
  std::size_t i = 0;
  if (s[i] == '-') {
    d.negative = true;
    ++i;
  }
  for (; s[i] != 'e'; ++i) {
    if (s[i] != '.') d.digits += s[i];
  }
  ++i;
  if (s[i] == '+') ++i;  // from_chars rejects a leading '+'
  std::from_chars(s.data() + i, s.data() + s.size(), d.exponent);
  return d;
}

inline void trim_trailing_zeros(std::string& s, std::size_t keep) {
  while (s.size() > keep && s.back() == '0') s.pop_back();
}

// What numpy's Dragon4 writes either side of the point; the sign goes with the integer part.
struct FloatParts {
  std::string int_part;
  std::string frac_part;
  int exponent = 0;  // scientific notation only
};

// x rounded to `precision` digits after the point, trailing zeros dropped.
template <class F>
FloatParts fixed_parts(F x, int precision) {
  const std::string s = chars_of(x, std::chars_format::fixed, precision);
  const std::size_t point = s.find('.');
  FloatParts p;
  p.int_part = s.substr(0, point);
  if (point != std::string::npos) p.frac_part = s.substr(point + 1);
  trim_trailing_zeros(p.frac_part, 0);
  return p;
}

// dragon4_positional(x, precision, min_digits, unique=True, fractional=True, trim='.'), where
// precision < 0 means none and min_digits is -1 (none) or 0.
template <class F>
FloatParts positional_parts(F x, int precision, int min_digits) {
  const Decimal d = decimal_of(x);
  const int n = static_cast<int>(d.digits.size());
  const int frac_digits = n - 1 - d.exponent;
  // Past `precision`, and short of `min_digits` (as in 42598728.f, shortest 4259873e1), Dragon4
  // prints the exact digits of x, rounded.
  if (precision >= 0 && frac_digits > precision) return fixed_parts(x, precision);
  if (min_digits >= 0 && frac_digits < min_digits) return fixed_parts(x, min_digits);
  FloatParts p;
  if (d.negative) p.int_part = "-";
  if (d.exponent < 0) {
    p.int_part += '0';
    p.frac_part.assign(static_cast<std::size_t>(-d.exponent - 1), '0');
    p.frac_part += d.digits;
  } else if (d.exponent + 1 >= n) {
    p.int_part += d.digits;
    p.int_part.append(static_cast<std::size_t>(d.exponent + 1 - n), '0');
  } else {
    const auto split = static_cast<std::size_t>(d.exponent + 1);
    p.int_part += d.digits.substr(0, split);
    p.frac_part = d.digits.substr(split);
  }
  return p;
}

inline FloatParts scientific_parts(const Decimal& d) {
  FloatParts p;
  if (d.negative) p.int_part = "-";
  p.int_part += d.digits[0];
  p.frac_part = d.digits.substr(1);
  p.exponent = d.exponent;
  return p;
}

// dragon4_scientific(x, precision, unique=True, trim='.'); precision < 0 means none.
template <class F>
FloatParts scientific_parts(F x, int precision) {
  Decimal d = decimal_of(x);
  if (precision >= 0 && static_cast<int>(d.digits.size()) - 1 > precision) {
    d = decimal_of(x, precision);
    trim_trailing_zeros(d.digits, 1);
  }
  return scientific_parts(d);
}

// "e+05", "e-123": at least min_digits digits.
inline std::string exponent_str(int exponent, std::size_t min_digits) {
  std::string digits = integer_str(exponent < 0 ? -exponent : exponent);
  if (digits.size() < min_digits) digits.insert(0, min_digits - digits.size(), '0');
  return (exponent < 0 ? "e-" : "e+") + digits;
}

inline std::string pad_left(std::string s, std::size_t width) {
  if (s.size() < width) s.insert(0, width - s.size(), ' ');
  return s;
}

inline std::string pad_right(std::string s, std::size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

// str() of a numpy scalar, which is what str() of a 0-d array is.
template <class T>
std::string scalar_str(T x) {
  if constexpr (std::is_integral_v<T>) {
    return integer_str(x);
  } else {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
    const double magnitude = std::fabs(static_cast<double>(x));
    if (magnitude == 0 || (magnitude >= 1e-4 && magnitude < 1e16)) {
      const FloatParts p = positional_parts(x, -1, -1);
      return p.int_part + '.' + (p.frac_part.empty() ? "0" : p.frac_part);
    }
    const FloatParts p = scientific_parts(x, -1);
    return p.int_part + (p.frac_part.empty() ? "" : '.' + p.frac_part) + exponent_str(p.exponent, 2);
  }
}

// FloatingFormat with floatmode 'maxprec', sign '-', suppress_small off.
template <class F>
class FloatingFormat {
 public:
  explicit FloatingFormat(const std::vector<F>& data) {
    bool any_nonzero = false;
    bool any_finite = false;
    bool any_nonfinite = false;
    bool negative_inf = false;
    F max_val = 0;
    F min_val = 0;
    for (F x : data) {
      if (!std::isfinite(x)) {
        any_nonfinite = true;
        negative_inf = negative_inf || (std::isinf(x) && x < 0);
        continue;
      }
      any_finite = true;
      if (x == 0) continue;
      const F a = std::fabs(x);
      max_val = any_nonzero ? std::max(max_val, a) : a;
      min_val = any_nonzero ? std::min(min_val, a) : a;
      any_nonzero = true;
    }
    if (any_nonzero) {
      // numpy compares the limits as float64 but divides in the element type.
      const F ratio = max_val / min_val;
      exp_format_ = static_cast<double>(max_val) >= 1e8 || static_cast<double>(min_val) < 1e-4 || ratio > 1000;
    }

    if (any_finite && exp_format_) {
      std::size_t exp_digits = 0;
      for (F x : data) {
        if (!std::isfinite(x)) continue;
        const FloatParts p = scientific_parts(x, print_precision);
        pad_left_ = std::max(pad_left_, p.int_part.size());
        precision_ = std::max(precision_, p.frac_part.size());
        exp_digits = std::max(exp_digits, exponent_str(p.exponent, 2).size() - 2);  // less "e+"
      }
      exp_size_ = exp_digits;
      pad_right_ = exp_size_ + 2 + precision_;
    } else if (any_finite) {
      for (F x : data) {
        if (!std::isfinite(x)) continue;
        const FloatParts p = positional_parts(x, print_precision, -1);
        pad_left_ = std::max(pad_left_, p.int_part.size());
        pad_right_ = std::max(pad_right_, p.frac_part.size());
      }
    }

    if (any_nonfinite) {
      // Room for "nan" and "inf" (or "-inf"), right-aligned with the numbers' last column.
      const std::size_t width = negative_inf ? 4 : 3;
      if (width > pad_right_ + 1) pad_left_ = std::max(pad_left_, width - (pad_right_ + 1));
    }
  }

  std::string operator()(F x) const {
    if (std::isnan(x)) return pad_left("nan", pad_left_ + pad_right_ + 1);
    if (std::isinf(x)) return pad_left(x < 0 ? "-inf" : "inf", pad_left_ + pad_right_ + 1);
    if (exp_format_) {
      // numpy asks Dragon4 for min_digits = precision_, and it goes on past the shortest digits
      // with the exact ones: every mantissa is x rounded to precision_ digits, not zero-padded.
      const FloatParts p = scientific_parts(decimal_of(x, static_cast<int>(precision_)));
      return pad_left(p.int_part, pad_left_) + '.' + p.frac_part + exponent_str(p.exponent, exp_size_);
    }
    // numpy asks for min_digits = 0 here, but not when measuring.
    const FloatParts p = positional_parts(x, print_precision, 0);
    return pad_left(p.int_part, pad_left_) + '.' + pad_right(p.frac_part, pad_right_);
  }

 private:
  bool exp_format_ = false;
  std::size_t pad_left_ = 0;
  std::size_t pad_right_ = 0;
  std::size_t precision_ = 0;  // digits after the point of every mantissa, in exp_format_
  std::size_t exp_size_ = 0;   // digits of every exponent, in exp_format_
};

template <class I>
class IntegerFormat {
 public:
  explicit IntegerFormat(const std::vector<I>& data) {
    const auto [lo, hi] = std::minmax_element(data.begin(), data.end());
    width_ = std::max(integer_str(*lo).size(), integer_str(*hi).size());
  }

  std::string operator()(I x) const { return pad_left(integer_str(x), width_); }

 private:
  std::size_t width_ = 0;
};

// _formatArray, writing into one string. numpy measures each line from its hanging indent; here
// from the previous newline, which gives the same columns because the '['s opening a row take
// the place of the hanging indent one for one.
template <class T, class Format>
class ArrayWriter {
 public:
  ArrayWriter(const BasicTensor<T>& t, bool summarise, const Format& format)
      : data_(t.data()), shape_(t.shape()), summarise_(summarise), format_(format) {}

  std::string run() && {
    write(0, 0, print_line_width);
    return std::move(out_);
  }

 private:
  void write(int axis, index_t offset, std::size_t width) {
    const auto indent = static_cast<std::size_t>(axis) + 1;
    const bool innermost = axis == shape_.rank() - 1;
    const index_t stride = shape_.numel_from(axis + 1);
    bool first = true;
    out_ += '[';
    for_each_printed(shape_[axis], summarise_, [&](index_t i) {
      if (innermost) {
        if (!first) out_ += ' ';
        // The last column is kept for the closing ']'.
        extend_line(i == print_ellipsis ? "..." : format_(data_[offset + i]), width - 1, indent);
      } else {
        // Sub-arrays of rank n are separated by n - 1 blank lines.
        if (!first) start_line(static_cast<std::size_t>(shape_.rank() - axis - 1), indent);
        if (i == print_ellipsis) {
          out_ += "...";
        } else {
          write(axis + 1, offset + i * stride, width - 1);
        }
      }
      first = false;
    });
    out_ += ']';
  }

  // _extendLine: wraps unless the line holds nothing but its indent, since wrapping would not help.
  void extend_line(const std::string& word, std::size_t width, std::size_t indent) {
    const std::size_t column = out_.size() - line_start_;
    if (column + word.size() > width && column > indent) {
      while (out_.back() == ' ') out_.pop_back();
      start_line(1, indent);
    }
    out_ += word;
  }

  void start_line(std::size_t newlines, std::size_t indent) {
    out_.append(newlines, '\n');
    line_start_ = out_.size();
    out_.append(indent, ' ');
  }

  const T* data_;
  const Shape& shape_;
  bool summarise_;
  const Format& format_;
  std::string out_;
  std::size_t line_start_ = 0;
};

}  // namespace detail

// As numpy's str(array): "[[1.  2.5]\n [3.  4. ]]".
template <ElementType T>
std::string to_string(const BasicTensor<T>& t) {
  if (t.ndim() == 0) return detail::scalar_str(t.data()[0]);
  if (t.numel() == 0) return "[]";
  const bool summarise = t.numel() > detail::print_threshold;
  std::vector<T> printed;
  detail::collect_printed(t.data(), t.shape(), 0, summarise, printed);
  if constexpr (std::is_floating_point_v<T>) {
    const detail::FloatingFormat<T> format(printed);
    return detail::ArrayWriter<T, detail::FloatingFormat<T>>(t, summarise, format).run();
  } else {
    const detail::IntegerFormat<T> format(printed);
    return detail::ArrayWriter<T, detail::IntegerFormat<T>>(t, summarise, format).run();
  }
}

template <ElementType T, index_t... Dims>
std::string to_string(const StaticTensor<T, Dims...>& t) {
  return to_string(t.tensor());
}

template <ElementType T>
std::ostream& operator<<(std::ostream& os, const BasicTensor<T>& t) {
  return os << to_string(t);
}

template <ElementType T, index_t... Dims>
std::ostream& operator<<(std::ostream& os, const StaticTensor<T, Dims...>& t) {
  return os << to_string(t.tensor());
}

}  // namespace duet

namespace duet {

namespace detail {
inline std::mutex& print_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace detail

namespace ops {

struct IdentityGradOp {
  using layer_type = IdentityGradOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool is_elementwise = false;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }
  static std::string op_name() { return "Identity"; }
  std::string label() const { return op_name(); }
};

// Prints "label: value" (numpy's format) when the value is computed; outputs its input.
struct PrintOp {
  using layer_type = PrintOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool has_side_effects = true;
  static constexpr bool is_elementwise = false;

  const char* text;        // the label; a string literal or a string that outlives the graph
  std::ostream* out;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    auto copy = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), copy.numel(), copy.data());
    // One print at a time: threads running graphs side by side do not interleave lines.
    std::lock_guard lock(duet::detail::print_mutex());
    *out << (text[0] != '\0' ? std::string(text) + ": " : std::string()) << copy << '\n';
  }

  static constexpr bool has_parameters = false;
  static constexpr std::array grad_operands{graph::Operand::grad};
  template <bool InputGrad>
  auto grad_op() const {
    return IdentityGradOp{};
  }

  static std::string op_name() { return "Print"; }
  std::string label() const { return op_name(); }
};

// Calls a C++ function on the value; its result (of the same shape) is the node's value.
template <class T>
struct HostOp {
  using layer_type = HostOp;
  using value_type = T;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_host = true;

  std::function<BasicTensor<T>(const BasicTensor<T>&)> fn;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    auto input = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), input.numel(), input.data());
    const BasicTensor<T> result = fn(input);
    if (!(result.shape() == a.output_shape)) {
      throw ShapeError("duet::host: the callback must return its input's shape " + to_string(a.output_shape) +
                       ", returned " + to_string(result.shape()));
    }
    std::copy_n(result.data(), result.numel(), a.out<T>());
  }

  static std::string op_name() { return "Host"; }
  std::string label() const { return "duet::host"; }
};

}  // namespace ops

namespace graph {
// The first host node of G, or G::size.
template <class G>
constexpr std::size_t first_host_node() {
  std::size_t found = G::size;
  for_each_index<G::size>([&](auto i) {
    if (found == G::size && is_host_op<typename node_at<G, decltype(i)::value>::op_type>()) found = decltype(i)::value;
  });
  return found;
}
}  // namespace graph

// Prints x with an optional label when it is computed, and returns it: in PyNative at once, in a
// graph when the graph runs. The label must outlive the graph (a literal, say).
template <class X>
auto print(X&& x, const char* label = "", std::ostream& out = std::cout) {
  return apply(ops::PrintOp{label, &out}, std::forward<X>(x));
}

// Runs fn (a function from a tensor to a tensor of the same shape) on x: now in PyNative, or
// as a host node (a graph break) in a graph.
template <class F, class X>
auto host(F&& fn, X&& x) {
  using T = typename std::remove_cvref_t<X>::value_type;
  return apply(ops::HostOp<T>{std::function<BasicTensor<T>(const BasicTensor<T>&)>(std::forward<F>(fn))},
               std::forward<X>(x));
}

}  // namespace duet
// Compile-time passes over a captured graph. Each takes a Sym (graph plus output) and
// returns a new one, of a new type; they run while the program compiles and leave nothing to
// do at run time but the evaluator's calls.
//
//   shape inference and checking   in graph.hpp, at capture (Graph::shapes, append)
//   views                          is_view nodes get no buffer (evaluator's plan)
//   fuse_epilogues                 bias adds and activations move into the product before them,
//                                  elementwise chains become one pass (O1 and O2)
//   pack_weights                   products keep their weights pre-packed between calls (O2,
//                                  inference graphs)

#include <array>
#include <boost/hana/append.hpp>
#include <boost/hana/drop_back.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/transform.hpp>
#include <boost/hana/unpack.hpp>
#include <cstddef>
#include <utility>


namespace duet::passes {

namespace hana = boost::hana;

// How many nodes read each node's value; the graph's output counts as one more reader.
template <class G, std::size_t Out>
constexpr std::array<std::size_t, G::size> user_counts() {
  std::array<std::size_t, G::size> users{};
  graph::for_each_index<G::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    for (std::size_t a : graph::node_at<G, I>::args) ++users[a];
  });
  ++users[Out];
  return users;
}

// A producer op P takes consumer op C as its epilogue when it says so; in a graph that will be
// differentiated, only if the fused op still can be.
template <class P, class C, bool Differentiated>
concept absorbs = requires {
  requires P::template accepts_epilogue<C>;
} && (!Differentiated || autodiff::Differentiable<decltype(std::declval<const P&>().absorb(std::declval<const C&>()))>);

namespace detail {

// Walks the nodes in order, building the fused list. Map[j] is where node j's value lives in
// the new list. A unary consumer folds into the node that computes its input when that node
// is the last one built, absorbs it, and nobody else reads the value in between.
template <std::size_t J, std::size_t Out, bool Differentiated, class G, class Built, std::size_t... Map>
auto fuse_from(const G& g, const Built& built, std::index_sequence<Map...> map) {
  if constexpr (J == G::size) {
    constexpr std::array<std::size_t, G::size> m{Map...};
    auto fused = graph::make_graph(built);
    return graph::Sym<decltype(fused), m[Out]>{fused};
  } else {
    using N = graph::node_at<G, J>;
    const N& n = hana::at_c<J>(g.nodes);
    constexpr std::size_t built_size = decltype(hana::length(built))::value;
    if constexpr (N::arity == 1) {
      constexpr std::array<std::size_t, J> m{Map...};
      constexpr std::size_t a = N::args[0];
      constexpr std::size_t r = m[a];
      using P = std::remove_cvref_t<decltype(hana::at_c<r>(built))>;
      if constexpr (r + 1 == built_size && user_counts<G, Out>()[a] == 1 &&
                    absorbs<typename P::op_type, typename N::op_type, Differentiated>) {
        const P& p = hana::at_c<r>(built);
        auto absorbed = p.op.absorb(n.op);
        auto with_args = [&]<std::size_t... A>(std::index_sequence<A...>) {
          return graph::Node<decltype(absorbed), P::args[A]...>{absorbed};
        }
        (std::make_index_sequence<P::arity>{});
        return fuse_from<J + 1, Out, Differentiated>(g, hana::append(hana::drop_back(built), with_args),
                                     std::index_sequence<Map..., r>{});
      } else {
        return fuse_from<J + 1, Out, Differentiated>(
            g, hana::append(built, graph::renumbered(n, map, std::make_index_sequence<N::arity>{})),
            std::index_sequence<Map..., built_size>{});
      }
    } else {
      return fuse_from<J + 1, Out, Differentiated>(g,
                                   hana::append(built, graph::renumbered(n, map, std::make_index_sequence<N::arity>{})),
                                   std::index_sequence<Map..., built_size>{});
    }
  }
}

}  // namespace detail

// Moves each bias add and elementwise activation into the epilogue of the product that
// feeds it, and fuses chains of elementwise functions, so each value is written once.
template <bool Differentiated = false, class G, std::size_t Out>
auto fuse_epilogues(const graph::Sym<G, Out>& program) {
  return detail::fuse_from<0, Out, Differentiated>(program.graph, hana::make_tuple(), std::index_sequence<>{});
}

// Each op that can read its weight pre-packed (with_packed_weight()) is replaced by that
// form. Not for graphs being trained: their weights change at every step, and a packed copy
// would only add a pass over them.
template <class G, std::size_t Out>
auto pack_weights(const graph::Sym<G, Out>& program) {
  auto nodes = hana::transform(program.graph.nodes, []<class Op, std::size_t... A>(const graph::Node<Op, A...>& n) {
    if constexpr (requires { n.op.with_packed_weight(); }) {
      return graph::Node<decltype(n.op.with_packed_weight()), A...>{n.op.with_packed_weight()};
    } else {
      return n;
    }
  });
  auto packed = graph::make_graph(nodes);
  return graph::Sym<decltype(packed), Out>{packed};
}

// The pipeline of a jit level. Differentiated: the graph is the forward half of a training
// graph, so fusion keeps every op differentiable.
template <JitConfig Config = JitConfig{}, bool Differentiated = false, class G, std::size_t Out>
auto optimize(const graph::Sym<G, Out>& program) {
  if constexpr (Config.jit_level == JitLevel::O0) return program;
  else if constexpr (Config.jit_level == JitLevel::O1 || Differentiated) return fuse_epilogues<Differentiated>(program);
  else return pack_weights(fuse_epilogues<Differentiated>(program));
}

}  // namespace duet::passes
// PIJit: jit for networks built at run time. The first call with given input shapes runs the
// function eagerly under a trace (trace.hpp); the trace is then optimised as the jit level
// says, as graph mode's passes do (O1: each product takes its bias and ReLU as epilogue; O2:
// products also keep their weights packed between calls), and planned (intermediate values in
// reused slots of one arena), and later calls replay it: one call per step, no virtual cell
// dispatch, no hooks to look up, no allocation once warm.
//
// What a trace cannot hold is a graph break: a function that makes its result from something
// no duet operation computed runs eagerly on every call instead. Control flow that depends on
// a tensor's value is fixed at the trace; run it through duet::host to keep it live.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>


namespace duet::pijit {

// A trace made ready to run again: fused, with its memory laid out.
class Replay {
 public:
  Replay(Trace trace, std::size_t output, JitLevel level)
      : values_(std::move(trace.values())),
        steps_(std::move(trace.steps())),
        cells_(std::move(trace.cells())),
        output_(output),
        traced_steps_(steps_.size()) {
    if (level != JitLevel::O0) fuse();
    if (level == JitLevel::O2) pack_weights();
    layout();
  }

  std::size_t traced_steps() const { return traced_steps_; }
  std::size_t steps() const { return steps_.size(); }

  // Whether a cell the trace went through has a hook now: the replay would skip it, so the
  // caller runs the function eagerly instead and the hook runs.
  bool cells_have_hooks() const {
    if (duet::detail::live_hook_count().load(std::memory_order_relaxed) == 0) return false;
    return std::any_of(cells_.begin(), cells_.end(), [](const auto& has_hooks) { return has_hooks(); });
  }

  // True the first time it is called: the caller says once that it no longer replays this.
  bool set_aside() const { return !set_aside_.exchange(true); }

  // Runs the steps on new inputs of the traced shapes; returns the output value.
  template <class T>
  BasicTensor<T> run(std::span<const void* const> inputs) const {
    thread_local std::vector<void*> data;
    data.assign(values_.size(), nullptr);
    duet::detail::Storage arena(arena_bytes_);
    auto result = BasicTensor<T>::uninitialized(values_[output_root_].shape);
    for (std::size_t v = 0; v < values_.size(); ++v) {
      const Value& value = values_[v];
      switch (value.kind) {
        case Value::Kind::input: data[v] = const_cast<void*>(inputs[value.input]); break;
        case Value::Kind::constant: data[v] = const_cast<void*>(value.data); break;
        case Value::Kind::view: data[v] = data[value.view_of]; break;
        case Value::Kind::computed:
          data[v] = v == output_root_ ? static_cast<void*>(result.data()) : arena.data() + offset_[v];
          break;
      }
    }
    for (const auto& step : steps_) {
      if (step->runs_kernel()) step->run(data.data(), values_);
    }
    return values_[output_].shape == result.shape() ? result : result.reshape(values_[output_].shape);
  }

 private:
  // A product followed by its bias add, then a ReLU, becomes one step when nothing else reads
  // the values in between.
  void fuse() {
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
          if (auto merged = last.absorb(*step)) {
            fused.back() = std::move(merged);
            continue;
          }
        }
      }
      fused.push_back(std::move(step));
    }
    steps_ = std::move(fused);
  }

  void pack_weights() {
    for (auto& step : steps_) {
      if (auto packed = step->with_packed_weight()) step = std::move(packed);
    }
  }

  // Computed values get slots of one arena, reused once their last reader has run.
  void layout() {
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
      if (made[v] && values_[v].kind == Value::Kind::computed) offset_[v] = slot_offset[slot_of[v]];
    }
  }

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
  mutable std::atomic<bool> set_aside_{false};
};

}  // namespace duet::pijit

namespace duet {

// PSJit: the compile-time static graph. PIJit: a trace of a network built at run time (see
// pijit.hpp), captured on the first call for each input shape and replayed.
enum class JitMode : unsigned char { PSJit, PIJit };

// What input_signature says of one tensor argument; duet::dyn in shape for any size.
struct TensorSpec {
  DType dtype = float32;
  Shape shape = {};
};

// A non-tensor argument whose value is not part of the signature (MindSpore's mutable): a
// new value does not recompile.
template <class T>
struct Mutable {
  T value;
};
template <class T>
Mutable<std::decay_t<T>> mutable_(T&& value) {
  return {std::forward<T>(value)};
}

namespace detail {
template <class T>
std::uint64_t value_hash(const T& value) {
  if constexpr (requires { std::hash<T>{}(value); }) {
    return static_cast<std::uint64_t>(std::hash<T>{}(value));
  } else {
    static_assert(std::is_trivially_copyable_v<T>,
                  "duet::jit: a non-tensor argument or hash_arg must be hashable (std::hash) or trivially "
                  "copyable; wrap other arguments in duet::mutable_");
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    for (unsigned char b : bytes) h = (h ^ b) * 1099511628211ull;
    return h;
  }
}
}  // namespace detail

// A value the jitted function reads besides its arguments (a free variable): a change of it
// recompiles at the next call. It refers to the value, which must outlive the jitted function.
class HashArg {
 public:
  template <class T>
  explicit HashArg(const T& value) : hash_([&value] { return detail::value_hash(value); }) {}
  std::uint64_t hash() const { return hash_(); }

 private:
  std::function<std::uint64_t()> hash_;
};
template <class T>
HashArg hash_arg(const T& value) {
  return HashArg(value);
}

struct JitOptions {
  JitMode mode = JitMode::PSJit;
  std::vector<TensorSpec> input_signature = {};  // empty: any tensors
  std::vector<HashArg> hash_args = {};
  // Share compiled forms between every jitted function made from the same function type, so a
  // re-created one does not compile again. A risk if its free variables differ (as in MindSpore).
  bool compile_once = false;
  std::string name = {};  // for the recompile log; "jit function #n" by default
};

namespace detail {
struct JitStats {
  std::atomic<std::uint64_t> compiles{0};
  std::atomic<std::uint64_t> functions{0};
  std::mutex mutex;
  std::vector<std::string> log;
};
inline JitStats& jit_stats() {
  static JitStats stats;
  return stats;
}
inline void jit_log(std::string line) {
  auto& stats = jit_stats();
  std::lock_guard lock(stats.mutex);
  stats.log.push_back(std::move(line));
}
}  // namespace detail

// Compilations of every jitted function so far.
inline std::uint64_t jit_compile_count() { return detail::jit_stats().compiles.load(); }

// One line per compilation, in order: which function, its compile number, and why; and one when
// a PIJit trace is set aside because a cell in it has a hook now.
inline std::vector<std::string> jit_compile_log() {
  auto& s = detail::jit_stats();
  std::lock_guard lock(s.mutex);
  return s.log;
}

namespace detail {

template <class X>
inline constexpr bool is_tensor_argument_v = is_tensor_v<std::remove_cvref_t<X>> || is_static_tensor_v<std::remove_cvref_t<X>>;

template <class X>
inline constexpr bool is_mutable_v = false;
template <class T>
inline constexpr bool is_mutable_v<Mutable<T>> = true;

// Position of argument I among the tensor arguments.
template <std::size_t I, class... Args>
constexpr std::size_t tensor_index() {
  constexpr std::array<bool, sizeof...(Args)> is_tensor{is_tensor_argument_v<Args>...};
  std::size_t k = 0;
  for (std::size_t i = 0; i < I; ++i) k += is_tensor[i] ? 1 : 0;
  return k;
}

template <class... Args>
constexpr std::size_t tensor_count() {
  return (std::size_t{0} + ... + (is_tensor_argument_v<Args> ? 1 : 0));
}

// What makes two calls share a compiled form.
template <std::size_t N>
struct Signature {
  std::array<DType, N> dtypes{};
  std::array<Shape, N> shapes{};
  std::array<std::uint64_t, N> values{};
  std::vector<std::uint64_t> hash_args;
  friend bool operator==(const Signature&, const Signature&) = default;
};

template <std::size_t N>
std::string why_recompiled(const Signature<N>& before, const Signature<N>& now) {
  for (std::size_t i = 0; i < N; ++i) {
    if (before.dtypes[i] != now.dtypes[i]) {
      return "argument " + std::to_string(i) + " dtype " + std::string(name_of(before.dtypes[i])) + " -> " +
             std::string(name_of(now.dtypes[i]));
    }
    if (!(before.shapes[i] == now.shapes[i])) {
      return "argument " + std::to_string(i) + " shape " + to_string(before.shapes[i]) + " -> " +
             to_string(now.shapes[i]);
    }
    if (before.values[i] != now.values[i]) return "argument " + std::to_string(i) + " (a value) changed";
  }
  for (std::size_t i = 0; i < now.hash_args.size(); ++i) {
    if (i >= before.hash_args.size() || before.hash_args[i] != now.hash_args[i]) {
      return "hash_args[" + std::to_string(i) + "] changed";
    }
  }
  return "a new signature";
}

// Compiled forms of one function for one list of argument types.
template <std::size_t N>
struct CompileCache {
  struct Entry {
    Signature<N> signature;
    std::uint64_t owner;  // keys the plans of this compiled form
    // PIJit: the replayable trace, or null when the trace broke and the function runs eagerly.
    std::shared_ptr<const pijit::Replay> replay;
  };
  std::shared_mutex mutex;
  std::deque<Entry> entries;  // a deque: an entry does not move when others are added
};

}  // namespace detail

template <JitConfig Config, class Fn>
class JitFunction {
  using FnRef = std::remove_reference_t<Fn>;

 public:
  JitFunction(Fn fn, JitOptions options)
      : fn_(std::forward<Fn>(fn)), options_(std::move(options)), state_(std::make_shared<State>()) {
    if (options_.name.empty()) options_.name = "jit function #" + std::to_string(++detail::jit_stats().functions);
    if (options_.compile_once) state_ = shared_state();
  }

  // Compilations of this function (of every function of its type, with compile_once).
  std::uint64_t compile_count() const { return state_->compiles.load(); }
  const std::string& name() const { return options_.name; }

  template <class... Args>
  auto operator()(const Args&... args) {
    if constexpr ((graph::Symbolic<Args> || ...)) {
      // Called while an enclosing graph is captured (grad in graph mode, a jitted caller): the
      // function's nodes join that graph, which is compiled and differentiated as a whole.
      return fn_(argument(args)...);
    } else {
      return compiled(args...);
    }
  }

 private:
  template <class... Args>
  auto compiled(const Args&... args) {
    using Result = decltype(eager(args...));
    // A PyNative grad records operations as they run; a compiled call would hide them from it.
    if (!get_context().jit_enabled || autodiff::active_tape() != nullptr) return eager(args...);
    check_signature(args...);
    auto& cache = compile_cache<Args...>();
    const auto signature = signature_of(args...);
    const typename detail::CompileCache<sizeof...(Args)>::Entry* entry = nullptr;
    {
      std::shared_lock lock(cache.mutex);
      entry = find(cache, signature);
    }
    if (entry == nullptr) {
      // Concurrent first calls: one compiles, the others wait here and then find its form.
      std::unique_lock lock(cache.mutex);
      entry = find(cache, signature);
      if (entry == nullptr) {
        if (options_.mode == JitMode::PIJit) return trace(cache, signature, args...);
        entry = &compile(cache, signature, nullptr);
      }
    }
    if (options_.mode == JitMode::PIJit) {
      if (entry->replay == nullptr) return eager(args...);
      if (entry->replay->cells_have_hooks()) {
        if (entry->replay->set_aside()) {
          detail::jit_log(options_.name + ": runs eagerly while a cell in it has a hook (hooks see values in "
                                          "PyNative mode only)");
        }
        return eager(args...);
      }
      const auto inputs = std::apply([](const auto&... t) { return std::array<const void*, sizeof...(t)>{t.data()...}; },
                                     std::tuple_cat(tensor_tuple(args)...));
      return entry->replay->template run<typename Result::value_type>(inputs);
    }
    if constexpr (Capturable<Args...>) {
      return Result(run_graph(entry->owner, args...));
    } else {
      throw ValueError(options_.name + ": the function is not generic over its tensors, so it cannot be captured "
                                       "as a static graph (PSJit); jit it with {.mode = JitMode::PIJit}");
    }
  }

  struct State {
    std::atomic<std::uint64_t> compiles{0};
    std::mutex mutex;
    std::vector<std::pair<std::type_index, std::shared_ptr<void>>> caches;
  };

  // What compile_once shares: one state per function type (and configuration).
  static std::shared_ptr<State> shared_state() {
    static const auto state = std::make_shared<State>();
    return state;
  }

  template <class X>
  static decltype(auto) argument(const X& x) {
    if constexpr (detail::is_tensor_argument_v<X>) return tensor_of(x);
    else if constexpr (detail::is_mutable_v<X>) return (x.value);
    else return (x);
  }

  // DUET_JIT=0 or set_context({.jit_enabled = false}): the function as plain PyNative code.
  template <class... Args>
  auto eager(const Args&... args) {
    EagerScope eager;
    auto y = fn_(argument(args)...);
    return BasicTensor<typename decltype(y)::value_type>(y);
  }

  template <class... Args>
  void check_signature(const Args&... args) const {
    const auto& specs = options_.input_signature;
    if (specs.empty()) return;
    constexpr std::size_t tensors = detail::tensor_count<Args...>();
    if (specs.size() != tensors) {
      throw ValueError(options_.name + ": input_signature describes " + std::to_string(specs.size()) +
                       " tensors, the call passes " + std::to_string(tensors));
    }
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (check_one<detail::tensor_index<I, Args...>()>(args), ...);
    }(std::index_sequence_for<Args...>{});
  }

  template <std::size_t K, class X>
  void check_one(const X& x) const {
    if constexpr (detail::is_tensor_argument_v<X>) {
      const TensorSpec& spec = options_.input_signature[K];
      const auto& t = tensor_of(x);
      if (t.dtype() != spec.dtype || !graph::fits(spec.shape, t.shape())) {
        throw ShapeError(options_.name + ": input_signature says tensor " + std::to_string(K) + " is " +
                         std::string(name_of(spec.dtype)) + " " + to_string(spec.shape) + ", got " +
                         std::string(name_of(t.dtype())) + " " + to_string(t.shape()));
      }
    }
  }

  template <class... Args>
  detail::Signature<sizeof...(Args)> signature_of(const Args&... args) const {
    detail::Signature<sizeof...(Args)> s;
    const auto all = std::forward_as_tuple(args...);
    graph::for_each_index<sizeof...(Args)>([&](auto i) {
      constexpr std::size_t I = decltype(i)::value;
      using X = std::tuple_element_t<I, std::tuple<Args...>>;
      if constexpr (detail::is_tensor_argument_v<X>) {
        const auto& t = tensor_of(std::get<I>(all));
        s.dtypes[I] = t.dtype();
        // With an input_signature, the pattern (dynamic dimensions and all) is the key.
        s.shapes[I] = options_.input_signature.empty() ? t.shape()
                                                       : options_.input_signature[detail::tensor_index<I, Args...>()].shape;
      } else if constexpr (!detail::is_mutable_v<X>) {
        s.values[I] = detail::value_hash(std::get<I>(all));
      }
    });
    s.hash_args.reserve(options_.hash_args.size());
    for (const HashArg& h : options_.hash_args) s.hash_args.push_back(h.hash());
    return s;
  }

  // Entries are never removed, so a pointer to one stays valid once the lock is released.
  template <std::size_t N>
  static const typename detail::CompileCache<N>::Entry* find(detail::CompileCache<N>& cache,
                                                              const detail::Signature<N>& s) {
    for (const auto& e : cache.entries) {
      if (e.signature == s) return &e;
    }
    return nullptr;
  }

  // PIJit's compilation: run the function eagerly under a trace, keep the trace for replay.
  template <std::size_t N, class... Args>
  auto trace(detail::CompileCache<N>& cache, const detail::Signature<N>& s, const Args&... args) {
    pijit::Trace trace;
    auto inputs = std::make_tuple(traced_argument(args)...);
    std::size_t k = 0;
    std::apply([&](auto&... x) { (mark_input(trace, x, k), ...); }, inputs);
    auto y = [&] {
      pijit::Tracing tracing(&trace);
      EagerScope eager;
      return std::apply([&](const auto&... x) { return fn_(x...); }, inputs);
    }();
    using Result = BasicTensor<typename decltype(y)::value_type>;
    const std::size_t out = trace.find(y);
    std::string broken = trace.broken();
    if (broken.empty() && out == trace.values().size()) broken = "the function returns a value no duet operation made";
    std::shared_ptr<const pijit::Replay> replay;
    std::string note = "graph break, runs eagerly: " + broken;
    if (broken.empty()) {
      replay = std::make_shared<pijit::Replay>(std::move(trace), out, Config.jit_level);
      note = "traced " + std::to_string(replay->traced_steps()) + " operations, replays " +
             std::to_string(replay->steps()) + " steps";
    }
    compile(cache, s, std::move(replay), note);
    return Result(y);
  }

  template <class X>
  static auto traced_argument(const X& x) {
    if constexpr (detail::is_tensor_argument_v<X>) return BasicTensor<typename X::value_type>(tensor_of(x));
    else return argument(x);
  }

  template <class X>
  static void mark_input(pijit::Trace& trace, X& x, std::size_t& k) {
    if constexpr (is_tensor_v<X>) trace.add_input(x, k++);
  }

  template <std::size_t N>
  const typename detail::CompileCache<N>::Entry& compile(detail::CompileCache<N>& cache, const detail::Signature<N>& s,
                                                          std::shared_ptr<const pijit::Replay> replay,
                                                          const std::string& note = {}) {
    const std::uint64_t number = ++state_->compiles;
    auto& stats = detail::jit_stats();
    stats.compiles.fetch_add(1);
    const std::string reason = cache.entries.empty() ? std::string("first call")
                                                     : detail::why_recompiled(cache.entries.back().signature, s);
    detail::jit_log(options_.name + ": compile #" + std::to_string(number) + ": " + reason +
                    (note.empty() ? "" : " (" + note + ")"));
    cache.entries.push_back({s, duet::detail::new_plan_owner(), std::move(replay)});
    return cache.entries.back();
  }

  template <class... Args>
  detail::CompileCache<sizeof...(Args)>& compile_cache() {
    using Cache = detail::CompileCache<sizeof...(Args)>;
    std::lock_guard lock(state_->mutex);
    const std::type_index key(typeid(Cache));
    for (auto& [type, cache] : state_->caches) {
      if (type == key) return *static_cast<Cache*>(cache.get());
    }
    state_->caches.emplace_back(key, std::make_shared<Cache>());
    return *static_cast<Cache*>(state_->caches.back().second.get());
  }

  template <class... Args>
  auto run_graph(std::uint64_t owner, const Args&... args) {
    auto captured = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return fn_(symbolic<I, Args...>(args)...);
    }(std::index_sequence_for<Args...>{});
    using Captured = decltype(captured);
    static_assert(graph::Symbolic<Captured>, "duet::jit: the function must return a tensor computed from its inputs");
    using G = typename Captured::graph_type;
    if constexpr (Config.jit_syntax_level == JitSyntaxLevel::strict) {
      static_assert(graph::first_host_node<G>() == G::size,
                    "duet::jit: JitSyntaxLevel::strict: the function calls duet::host, a host callback, which is "
                    "not a graph operation; use JitSyntaxLevel::lax to run it as a graph break");
    }
    auto program = passes::optimize<Config>(captured);
    const auto tensors = std::tuple_cat(tensor_tuple(args)...);
    const auto shapes = std::apply([](const auto&... t) { return std::array<Shape, sizeof...(t)>{t.shape()...}; }, tensors);
    const auto& p = duet::detail::cached_plan<Config>(owner, program, shapes, [this] { return options_.name; });
    return std::apply([&](const auto&... t) { return run<DefaultBackend, Config>(program, p, t...); }, tensors);
  }

  template <std::size_t I, class... Args, class X>
  static decltype(auto) symbolic(const X& x) {
    if constexpr (detail::is_tensor_argument_v<X>) {
      return graph::input<typename X::value_type, typename graph::pattern_of<X>::type, detail::tensor_index<I, Args...>()>();
    } else {
      return argument(x);
    }
  }

  // Whether graph capture can call fn on these arguments: fn is generic over its tensors.
  // Defined after symbolic: a static member's initializer only sees the members declared before it.
  template <class... Args>
  static constexpr bool Capturable = [] {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return requires(FnRef& f) { f(symbolic<I, Args...>(std::declval<const Args&>())...); };
    }(std::index_sequence_for<Args...>{});
  }();

  template <class X>
  static auto tensor_tuple(const X& x) {
    if constexpr (detail::is_tensor_argument_v<X>) return std::tuple<const BasicTensor<typename X::value_type>&>(tensor_of(x));
    else return std::tuple<>();
  }

  Fn fn_;
  JitOptions options_;
  std::shared_ptr<State> state_;
};

namespace detail {
// A jitted function an object makes of itself on first use (a runtime-built cell's graph form,
// say), calling back into that object. A moved object makes its own, so none calls into an
// object that has moved. Concurrent first uses make it once.
template <class F>
class OwnForm {
 public:
  OwnForm() = default;
  OwnForm(OwnForm&&) noexcept {}
  OwnForm& operator=(OwnForm&&) noexcept { return *this; }
  OwnForm(const OwnForm&) = delete;
  OwnForm& operator=(const OwnForm&) = delete;
  ~OwnForm() = default;

  template <class Make>
  F& get(Make&& make) {
    std::call_once(made_, [&] { form_ = std::make_unique<F>(make()); });
    return *form_;
  }

 private:
  std::once_flag made_;
  std::unique_ptr<F> form_;
};
}  // namespace detail

// MindSpore's jit(fn, ...): fn is kept by reference if it is an lvalue, else moved in.
template <JitConfig Config = JitConfig{}, class Fn>
auto jit(Fn&& fn, JitOptions options = {}) {
  return JitFunction<Config, Fn>(std::forward<Fn>(fn), std::move(options));
}

}  // namespace duet

namespace duet::nn {

namespace hana = boost::hana;

template <ElementType T>
class BasicDynamicCell;

// Called after a cell's forward in PyNative mode with the cell, its input and its output.
template <ElementType T>
using BasicForwardHook =
    std::function<void(const BasicDynamicCell<T>& cell, const BasicTensor<T>& input, const BasicTensor<T>& output)>;
using ForwardHook = BasicForwardHook<float>;

// Called while a PyNative backward pass goes through the cell, with the gradient of its input
// (empty when nothing upstream is differentiated) and of its output.
template <ElementType T>
using BasicBackwardHook = std::function<void(const BasicDynamicCell<T>& cell, const BasicTensor<T>& grad_input,
                                             const BasicTensor<T>& grad_output)>;
using BackwardHook = BasicBackwardHook<float>;

namespace detail {
// Naming a tree of cells happens once, on first use; the lock makes concurrent first calls safe.
inline std::mutex& naming_mutex() {
  static std::mutex m;
  return m;
}

// Moves whenever a cell built at run time changes its structure (a DynamicSequentialCell
// appends): graph mode's traces key on it, so none is replayed for a network that has changed.
inline std::atomic<std::uint64_t>& structure_generation() {
  static std::atomic<std::uint64_t> generation{0};
  return generation;
}

// The cell whose construct is running on this thread, and the bytes of its object. A cell
// that construct calls and that lies inside those bytes is a member: it must be registered
// (DUET_CELL_MEMBERS), or its parameters would be neither trained nor saved. Frames live on
// the call stack, so keeping track costs no allocation.
template <ElementType T>
class RunningCell {
 public:
  RunningCell(BasicDynamicCell<T>& cell, const void* object, std::size_t size)
      : cell_(cell), begin_(static_cast<const char*>(object)), end_(begin_ + size), outer_(innermost_) {
    innermost_ = this;
  }
  RunningCell(const RunningCell&) = delete;
  RunningCell& operator=(const RunningCell&) = delete;
  ~RunningCell() { innermost_ = outer_; }

  static RunningCell* innermost() { return innermost_; }
  BasicDynamicCell<T>& cell() const { return cell_; }
  bool holds(const void* p) const {
    const std::less<const void*> before;
    return !before(p, begin_) && before(p, end_);
  }

 private:
  BasicDynamicCell<T>& cell_;
  const char* begin_;
  const char* end_;
  RunningCell* outer_;
  static inline thread_local RunningCell* innermost_ = nullptr;
};
}  // namespace detail

// Removes the hook it was returned for (MindSpore's handle.remove()).
template <ElementType T>
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(BasicDynamicCell<T>* cell, long id) : cell_(cell), id_(id) {}
  void remove() {
    if (cell_ != nullptr) cell_->remove_hook(id_);
    cell_ = nullptr;
  }

 private:
  BasicDynamicCell<T>* cell_ = nullptr;
  long id_ = 0;
};

template <ElementType T>
class BasicDynamicCell {
 public:
  using value_type = T;
  using ChildVisitor = std::function<void(std::string_view name, BasicDynamicCell& child)>;
  using ParameterVisitor = std::function<void(std::string_view name, BasicParameter<T>& parameter)>;

  BasicDynamicCell() = default;
  BasicDynamicCell(const BasicDynamicCell&) = delete;
  BasicDynamicCell& operator=(const BasicDynamicCell&) = delete;
  // Movable so that containers can take cells by value; a moved cell keeps its hooks, and
  // HookHandles of the old object no longer refer to it.
  BasicDynamicCell(BasicDynamicCell&& other) noexcept
      : name_(std::move(other.name_)),
        named_(other.named_.load()),
        hooks_(std::exchange(other.hooks_, {})),
        backward_hooks_(std::exchange(other.backward_hooks_, {})),
        last_hook_id_(other.last_hook_id_) {}
  BasicDynamicCell& operator=(BasicDynamicCell&&) = delete;
  virtual ~BasicDynamicCell() {
    duet::detail::live_hook_count().fetch_sub(static_cast<long>(hooks_.size() + backward_hooks_.size()));
  }

  BasicTensor<T> operator()(const BasicTensor<T>& x) {
    check_registered();
    ensure_named();
    if (effective_mode(CONTEXT_MODE) == GRAPH_MODE && autodiff::active_tape() == nullptr &&
        pijit::active_trace() == nullptr && traced_in_graph_mode()) {
      return graph_form()(x, detail::structure_generation().load(std::memory_order_acquire));
    }
    const pijit::TracedCell traced([this] { return label(); });
    if (pijit::Trace* trace = traced.trace()) {
      trace->note_cell([this] { return has_hooks_in_tree(); });
      if (!hooks_.empty() || !backward_hooks_.empty()) trace->mark_broken("has a hook, which sees values in PyNative mode only");
    }
    BasicTensor<T>* traced_output = nullptr;
    if (!backward_hooks_.empty()) {
      if (autodiff::Tape* tape = autodiff::active_tape()) {
        traced_output = tape->begin_cell(x, [this](const BasicTensor<T>& grad_input, const BasicTensor<T>& grad_output) {
          for (const auto& [id, hook] : backward_hooks_) hook(*this, grad_input, grad_output);
        });
      }
    }
    BasicTensor<T> y = forward(x);
    if (traced_output != nullptr) *traced_output = y;
    for (const auto& [id, hook] : hooks_) hook(*this, x, y);
    return y;
  }

  // Unique for the life of the program, unlike the address: what caches of compiled plans key on.
  std::uint64_t id() const { return id_; }

  // Path from the root the cell was first used under ("dense_relu_sequential.0"); "" for it.
  const std::string& name() const { return name_; }
  // What the cell is: "nn::Dense<784, 512, float>".
  virtual std::string type_name() const = 0;
  // "nn::Dense<784, 512, float> 'dense_relu_sequential.0'": how errors name a cell.
  std::string label() const { return name_.empty() ? type_name() : type_name() + " '" + name_ + "'"; }

  virtual void for_each_child(const ChildVisitor&) {}
  virtual void for_each_own_parameter(const ParameterVisitor&) {}

  // All parameters of the tree, named by path ("dense_relu_sequential.0.weight").
  std::vector<NamedParameter<T>> parameters() {
    std::vector<NamedParameter<T>> out;
    collect_parameters("", out);
    return out;
  }

  // This cell and all below it, depth first, with their paths (MindSpore's cells_and_names).
  std::vector<std::pair<std::string, BasicDynamicCell*>> cells_and_names() {
    std::vector<std::pair<std::string, BasicDynamicCell*>> out;
    collect_cells("", out);
    return out;
  }

  HookHandle<T> register_forward_hook(BasicForwardHook<T> hook) {
    hooks_.emplace_back(++last_hook_id_, std::move(hook));
    duet::detail::live_hook_count().fetch_add(1);
    return HookHandle<T>(this, last_hook_id_);
  }

  // Backward hooks run while a PyNative gradient (value_and_grad, grad, TrainOneStepCell)
  // goes back through this cell.
  HookHandle<T> register_backward_hook(BasicBackwardHook<T> hook) {
    backward_hooks_.emplace_back(++last_hook_id_, std::move(hook));
    duet::detail::live_hook_count().fetch_add(1);
    return HookHandle<T>(this, last_hook_id_);
  }

  void remove_hook(long id) {
    const auto before = hooks_.size() + backward_hooks_.size();
    std::erase_if(hooks_, [id](const auto& h) { return h.first == id; });
    std::erase_if(backward_hooks_, [id](const auto& h) { return h.first == id; });
    duet::detail::live_hook_count().fetch_sub(static_cast<long>(before - hooks_.size() - backward_hooks_.size()));
  }

  // Whether this cell or one below it has a forward or backward hook.
  bool has_hooks_in_tree() {
    if (duet::detail::live_hook_count().load() == 0) return false;
    bool found = !hooks_.empty() || !backward_hooks_.empty();
    for_each_child([&](std::string_view, BasicDynamicCell& c) { found = found || c.has_hooks_in_tree(); });
    return found;
  }

  // Gives this cell and all below it their paths, if no call or parent has done so yet.
  void ensure_named() {
    if (named_.load(std::memory_order_acquire)) return;
    std::lock_guard lock(detail::naming_mutex());
    if (!named_.load(std::memory_order_relaxed)) assign_names("");
  }

 protected:
  virtual BasicTensor<T> forward(const BasicTensor<T>& x) = 0;

  // Whether graph mode traces this cell when it is called from outside any other (PIJit): a
  // cell built at run time has no construct to capture. Cell<...> captures its construct instead.
  virtual bool traced_in_graph_mode() const { return true; }

  // A cell built at run time whose structure changes after it has run (layers added, removed or
  // replaced) calls this, so that graph mode traces it again instead of replaying the old one.
  static void structure_changed() { detail::structure_generation().fetch_add(1, std::memory_order_acq_rel); }

  // Refuses a call from the construct of a cell that holds this one as a member without
  // registering it. Once this cell was found registered, later calls only read a flag.
  void check_registered() {
    const detail::RunningCell<T>* parent = detail::RunningCell<T>::innermost();
    if (parent == nullptr || registered_.load(std::memory_order_relaxed) || &parent->cell() == this ||
        !parent->holds(this)) {
      return;
    }
    if (!parent->cell().is_ancestor_of(*this)) {
      throw ValueError(parent->cell().label() + " calls a member " + type_name() +
                       " that is not registered with it, so its parameters would be neither trained nor "
                       "saved; list the member in DUET_CELL_MEMBERS(...)");
    }
    registered_.store(true, std::memory_order_relaxed);
  }

 private:
  // Graph mode for a cell built at run time: PIJit at the default JitConfig, traced on the first
  // call for each input shape and structure, replayed after. Its second argument is the
  // structure generation: a network changed since the trace is traced again.
  struct GraphCall {
    BasicDynamicCell* cell;
    BasicTensor<T> operator()(const BasicTensor<T>& x, std::uint64_t /*structure*/) const { return (*cell)(x); }
  };
  using GraphForm = JitFunction<JitConfig{}, GraphCall>;

  GraphForm& graph_form() {
    return graph_form_.get([this] {
      return GraphForm(GraphCall{this},
                       {.mode = JitMode::PIJit, .name = label() + " in graph mode (argument 1: its structure)"});
    });
  }

  bool is_ancestor_of(const BasicDynamicCell& cell) {
    bool found = false;
    for_each_child(
        [&](std::string_view, BasicDynamicCell& c) { found = found || &c == &cell || c.is_ancestor_of(cell); });
    return found;
  }

  void assign_names(const std::string& path) {
    name_ = path;
    for_each_child([&](std::string_view child, BasicDynamicCell& c) { c.assign_names(join(path, child)); });
    named_.store(true, std::memory_order_release);
  }

  // A child named "" is transparent: its own children take their names from the path itself.
  static std::string join(const std::string& path, std::string_view child) {
    if (child.empty()) return path;
    return path.empty() ? std::string(child) : path + "." + std::string(child);
  }

  void collect_parameters(const std::string& path, std::vector<NamedParameter<T>>& out) {
    for_each_own_parameter([&](std::string_view n, BasicParameter<T>& p) { out.push_back({join(path, n), &p}); });
    for_each_child([&](std::string_view n, BasicDynamicCell& c) { c.collect_parameters(join(path, n), out); });
  }

  void collect_cells(const std::string& path, std::vector<std::pair<std::string, BasicDynamicCell*>>& out) {
    out.emplace_back(path, this);
    for_each_child([&](std::string_view n, BasicDynamicCell& c) { c.collect_cells(join(path, n), out); });
  }

  std::uint64_t id_ = duet::detail::new_plan_owner();
  std::string name_;
  std::atomic<bool> named_{false};
  std::atomic<bool> registered_{false};  // found registered with the cell whose construct called it
  std::vector<std::pair<long, BasicForwardHook<T>>> hooks_;
  std::vector<std::pair<long, BasicBackwardHook<T>>> backward_hooks_;
  long last_hook_id_ = 0;
  duet::detail::OwnForm<GraphForm> graph_form_;
};

using DynamicCell = BasicDynamicCell<float>;

template <class X>
concept DynamicCellType = std::is_base_of_v<BasicDynamicCell<typename X::value_type>, X>;

// A cell built at run time: a DynamicCell with a forward of its own (a DynamicSequentialCell, or
// a class deriving from DynamicCell), not a Cell<...> with a generic construct. Graph capture
// cannot call it.
template <class C>
concept RuntimeBuilt = DynamicCellType<std::remove_cvref_t<C>> && !requires { std::remove_cvref_t<C>::mode; };

// Whether graph capture can call a cell's construct. A cell that calls one built at run time
// (WithLossCell over a DynamicSequentialCell, say) says it cannot, with a static member
// `capturable = false`: it then runs on real tensors in every mode.
template <class C>
constexpr bool capturable_construct() {
  if constexpr (requires { C::capturable; }) return C::capturable;
  else return true;
}

template <class C, class X>
concept HasConstruct = requires(C& cell, X x) {
  cell.construct(x);
};

// construct is one plain function, `Tensor construct(const Tensor&)`, not a template: it takes
// real tensors only. (Asked without calling it, so that no construct body is instantiated.)
template <class C>
concept NonGenericConstruct = requires { &C::construct; };

namespace detail {
template <auto Setting>
constexpr Mode mode_of_setting() {
  using S = std::remove_cvref_t<decltype(Setting)>;
  static_assert(std::is_same_v<S, Mode> || std::is_same_v<S, JitConfig>,
                "duet::nn::Cell<Derived, Setting>: Setting is a Mode (GRAPH_MODE, PYNATIVE_MODE, CONTEXT_MODE) "
                "or a JitConfig");
  if constexpr (std::is_same_v<S, JitConfig>) return GRAPH_MODE;
  else return Setting;
}
template <auto Setting>
constexpr JitConfig jit_config_of_setting() {
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(Setting)>, JitConfig>) return Setting;
  else return JitConfig{};
}
}  // namespace detail

// What a user's network derives from. Setting fixes how the cell runs whatever the context:
// GRAPH_MODE or PYNATIVE_MODE, or a JitConfig (graph mode compiled that way: MindSpore's
// @jit on construct); CONTEXT_MODE, the default, follows set_context at each call.
template <class Derived, auto Setting = CONTEXT_MODE, ElementType T = float>
class Cell : public BasicDynamicCell<T> {
  static constexpr Mode M = detail::mode_of_setting<Setting>();

 public:
  static constexpr Mode mode = M;
  static constexpr JitConfig jit_config = detail::jit_config_of_setting<Setting>();

  // Checked here, once per cell type and where the cell is made, rather than as "cannot convert
  // Sym<...> to const Tensor&" inside the capture. A CONTEXT_MODE cell is refused too: the
  // context may choose graph mode when it runs.
  Cell() {
    static_assert(M == PYNATIVE_MODE || !NonGenericConstruct<Derived>,
                  "duet::nn::Cell: graph mode calls construct with symbolic tensors, so construct must be "
                  "generic: auto construct(auto x) { ... }; a construct taking duet::Tensor runs only in a "
                  "duet::nn::Cell<Net, duet::PYNATIVE_MODE>");
  }

  // One tensor in: the DynamicCell call (hooks, then forward in this cell's mode).
  BasicTensor<T> operator()(const BasicTensor<T>& x) {
    static_assert(HasConstruct<Derived, BasicTensor<T>>,
                  "duet::nn::Cell: the derived cell must define construct(x), generic over its input: "
                  "auto construct(auto x) { ... }");
    return BasicDynamicCell<T>::operator()(x);
  }

  // Graph capture: construct appends this cell's nodes to the graph its inputs belong to.
  // Hooks cannot run inside a graph: refused here rather than silently dropped.
  template <graph::Symbolic... S>
    requires(sizeof...(S) >= 1 && capturable_construct<Derived>())
  auto operator()(const S&... xs) {
    if (this->has_hooks_in_tree()) {
      throw ModeError(this->label() +
                      " is captured into a graph (graph mode or jit), but it or a cell in it has a hook; hooks "
                      "see intermediate values in PyNative mode only");
    }
    this->check_registered();
    return run_construct(xs...);
  }

  // A statically shaped input: both modes check it against the layers at compile time and
  // return a StaticTensor of the inferred output shape.
  template <index_t... D>
  auto operator()(const StaticTensor<T, D...>& x) {
    using Captured = decltype(std::declval<Derived&>().construct(graph::input<T, StaticShape<D...>>()));
    if constexpr (M != PYNATIVE_MODE) {
      if (runs_as_graph()) {
        this->check_registered();
        this->ensure_named();
        return to_static_tensor<Captured>(run_graph<StaticShape<D...>>(x.tensor()));
      }
    }
    return to_static_tensor<Captured>((*this)(x.tensor()));
  }

  // Cells whose construct takes several tensors (a network with its loss, say). They are not
  // DynamicCells of one input, so they run no forward hooks of their own.
  template <class... X>
  requires(sizeof...(X) >= 2 && ((is_tensor_v<X> || is_static_tensor_v<X>)&&...)) auto operator()(const X&... xs) {
    this->check_registered();
    this->ensure_named();
    if constexpr (can_capture() && graph::Capturable<Derived&, X...>) {
      if (runs_as_graph()) return run_graph<typename graph::pattern_of<X>::type...>(tensor_of(xs)...);
    } else if constexpr (M != PYNATIVE_MODE) {
      // construct calls a cell built at run time, so it cannot be captured: it runs on the
      // tensors, and each cell it calls follows the mode itself (graph mode traces that one).
      if (runs_as_graph()) return run_construct(tensor_of(xs)...);
    }
    EagerScope eager;
    return run_construct(tensor_of(xs)...);
  }

  std::string type_name() const override { return duet::detail::readable_type_name(typeid(Derived)); }

 protected:
  bool traced_in_graph_mode() const override { return false; }

 public:

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    for_each_member([&](std::string_view name, auto& member) {
      if constexpr (DynamicCellType<std::remove_cvref_t<decltype(member)>>) visit(name, member);
    });
  }

  void for_each_own_parameter(const typename BasicDynamicCell<T>::ParameterVisitor& visit) override {
    for_each_member([&](std::string_view name, auto& member) {
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(member)>, BasicParameter<T>>) visit(name, member);
    });
  }

 protected:
  BasicTensor<T> forward(const BasicTensor<T>& x) override {
    if constexpr (!HasConstruct<Derived, BasicTensor<T>>) {
      throw ModeError(this->label() + ": construct takes several inputs; call the cell with all of them");
    } else {
      if constexpr (can_capture()) {
        if (runs_as_graph()) return run_graph<graph::AnyShape>(x);
      }
      EagerScope eager;
      return run_construct(x);
    }
  }

 private:
  Derived& derived() { return static_cast<Derived&>(*this); }

  // Whether calls may run as a graph. A non-generic construct never does: the constructor
  // reports it, and nothing else should.
  static constexpr bool can_capture() { return M != PYNATIVE_MODE && !NonGenericConstruct<Derived>; }

  // construct, with this cell as the one whose members the cells it calls are checked against.
  template <class... X>
  auto run_construct(X&&... xs) {
    const detail::RunningCell<T> running(*this, &derived(), sizeof(Derived));
    return derived().construct(std::forward<X>(xs)...);
  }

  // A PyNative grad records the operations as they run; a graph would be one opaque call to
  // its tape. Under a recording tape, a graph-mode cell therefore runs its construct eagerly:
  // the same numbers, and gradients that reach its parameters.
  static bool runs_as_graph() { return effective_mode(M) == GRAPH_MODE && autodiff::active_tape() == nullptr; }

  // Capture, optimise, run. Capture and passes cost nothing at run time (they are types);
  // the plan for the inputs' shapes is kept per thread, so repeated shapes skip planning.
  template <class... Patterns, class... Ts>
  auto run_graph(const BasicTensor<Ts>&... xs) {
    if (this->has_hooks_in_tree()) {
      throw ModeError(this->label() +
                      " runs in graph mode, but a cell in it has a hook; hooks see intermediate values "
                      "in PyNative mode only (set_context({.mode = PYNATIVE_MODE}))");
    }
    const auto capture = [&] {
      return passes::optimize<jit_config>([&]<std::size_t... K>(std::index_sequence<K...>) {
        return run_construct(graph::input<Ts, Patterns, K>()...);
      }(std::index_sequence_for<Ts...>{}));
    };
    // construct is captured once per cell and thread, as MindSpore compiles it once: on a small
    // network capturing costs as much as running. Values construct reads while it is captured
    // are constants of the graph. A cell's id is never reused, and a moved cell gets a new one,
    // so the program's references to this cell and its members stay valid.
    using Program = decltype(capture());
    thread_local struct {
      std::uint64_t owner = 0;
      std::optional<Program> program;
    } captured;
    if (captured.owner != this->id()) {
      captured.owner = 0;  // stays invalid if capturing throws
      captured.program.emplace(capture());
      captured.owner = this->id();
    }
    const Program& program = *captured.program;
    const std::array<Shape, sizeof...(Ts)> shapes{xs.shape()...};
    const auto& p = duet::detail::cached_plan<jit_config>(this->id(), program, shapes,
                                                           [this] { return this->type_name() + "::construct"; });
    return run<DefaultBackend, jit_config>(program, p, xs...);
  }

  template <class Captured>
  static auto to_static_tensor(BasicTensor<T> y) {
    constexpr Shape s = Captured::shape;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return StaticTensor<T, s[static_cast<int>(I)]...>(std::move(y));
    }
    (std::make_index_sequence<static_cast<std::size_t>(s.rank())>{});
  }

  template <class F>
  void for_each_member(F&& f) {
    if constexpr (hana::Struct<Derived>::value) {
      hana::for_each(hana::accessors<Derived>(), [&](auto accessor) {
        f(std::string_view(hana::to<const char*>(hana::first(accessor))), hana::second(accessor)(derived()));
      });
    }
  }
};

namespace detail {
// The mode a callable's type fixes: a cell's own (a JitConfig fixes GRAPH_MODE), and
// CONTEXT_MODE for a cell that follows the context or for anything that is not a cell.
template <class F>
constexpr Mode fixed_mode_of() {
  using C = std::remove_cvref_t<F>;
  if constexpr (requires { requires std::same_as<std::remove_cv_t<decltype(C::mode)>, Mode>; }) return C::mode;
  else return CONTEXT_MODE;
}
}  // namespace detail

}  // namespace duet::nn

namespace duet {
namespace ops {

// A value of the input's shape filled with V: ones where backward starts (d output/d output),
// zeros for the gradient of an input the output does not depend on.
template <int V>
struct FillLikeOp {
  using layer_type = FillLikeOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::fill(a.out<T>(), a.output_shape.numel(), T(V));
  }
  static std::string op_name() { return V == 1 ? "OnesLike" : "ZerosLike"; }
  std::string label() const { return op_name(); }
};

// Copies a value out of the graph into *destination (an input's gradient, for the caller).
template <class T>
struct StoreOp {
  using layer_type = StoreOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_sink = true;
  BasicTensor<T>* destination;
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }
  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    *destination = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), a.in_shape().numel(), destination->data());
  }
  static std::string op_name() { return "Store"; }
  std::string label() const { return op_name(); }
};

}  // namespace ops

namespace diagnostic {
template <class Op>
struct operation_is_differentiable {
  static constexpr bool value = false;
};

// A class, so that one operation is reported once however many backward graphs meet it.
template <class Op>
struct require_differentiable {
  static_assert(operation_is_differentiable<Op>::value,
                "duet::grad: a gradient must flow through an operation that has none (the condition names it)");
};
}  // namespace diagnostic

namespace autodiff {
namespace detail {

inline constexpr std::size_t no_grad = ~std::size_t{0};

// Which nodes' values lead to something being differentiated: a parameter, or an input listed
// in Wrt. Only those get gradients.
template <class G, std::size_t... Wrt>
constexpr std::array<bool, G::size> leads_to_gradient() {
  std::array<bool, G::size> leads{};
  graph::for_each_index<G::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using N = graph::node_at<G, I>;
    using Op = typename N::op_type;
    if constexpr (graph::is_input_op_v<Op>) {
      leads[I] = ((Op::index == Wrt) || ...);
    } else {
      bool any = false;
      if constexpr (Differentiable<Op>) any = Op::has_parameters;
      for (std::size_t a : N::args) any = any || leads[a];
      leads[I] = any;
    }
  });
  return leads;
}

template <std::size_t N>
constexpr std::array<std::size_t, N> with(std::array<std::size_t, N> a, std::size_t i, std::size_t v) {
  a[i] = v;
  return a;
}

template <auto V>
struct value_tag {
  static constexpr auto value = V;
};

template <graph::Operand O, class N, std::size_t Self, std::size_t Grad>
constexpr std::size_t operand_index() {
  if constexpr (O == graph::Operand::grad)
    return Grad;
  else if constexpr (O == graph::Operand::output)
    return Self;
  else if constexpr (O == graph::Operand::input0)
    return N::args[0];
  else
    return N::args[1];
}

// Walks forward nodes I-1, I-2, ..., 0. Grads[i] is the node holding d(output)/d(value i).
template <std::size_t I, auto Grads, auto Leads, class G, class Built>
auto backward_from(const G& g, const Built& built) {
  if constexpr (I == 0) {
    return std::pair{built, value_tag<Grads>{}};
  } else {
    constexpr std::size_t i = I - 1;
    using N = graph::node_at<G, i>;
    using Op = typename N::op_type;
    constexpr std::size_t gi = Grads[i];
    if constexpr (gi == no_grad || graph::is_input_op_v<Op>) {
      return backward_from<i, Grads, Leads>(g, built);
    } else if constexpr (!Differentiable<Op>) {
      static_cast<void>(sizeof(diagnostic::require_differentiable<typename Op::layer_type>));
      return backward_from<i, Grads, Leads>(g, built);
    } else {
      constexpr bool input_grad = N::arity >= 1 && Leads[N::args[0]];
      if constexpr (!input_grad && !Op::has_parameters) {
        return backward_from<i, Grads, Leads>(g, built);
      } else {
        const auto gop = boost::hana::at_c<i>(g.nodes).op.template grad_op<input_grad>();
        constexpr std::size_t k = decltype(boost::hana::length(built))::value;
        auto node = [&]<std::size_t... J>(std::index_sequence<J...>) {
          return graph::Node<std::remove_cvref_t<decltype(gop)>, operand_index<Op::grad_operands[J], N, i, gi>()...>{
              gop};
        }
        (std::make_index_sequence<Op::grad_operands.size()>{});
        auto with_grad = boost::hana::append(built, node);
        if constexpr (!input_grad) {
          return backward_from<i, Grads, Leads>(g, with_grad);
        } else if constexpr (Grads[N::args[0]] == no_grad) {
          return backward_from<i, with(Grads, N::args[0], k), Leads>(g, with_grad);
        } else {
          auto summed = boost::hana::append(with_grad, graph::Node<ops::GradAddOp, Grads[N::args[0]], k>{});
          return backward_from<i, with(Grads, N::args[0], k + 1), Leads>(g, summed);
        }
      }
    }
  }
}

template <class G, std::size_t K>
constexpr std::size_t input_node() {
  std::size_t found = G::size;
  graph::for_each_index<G::size>([&](auto i) {
    using Op = typename graph::node_at<G, decltype(i)::value>::op_type;
    if constexpr (graph::is_input_op_v<Op>) {
      if (Op::index == K) found = decltype(i)::value;
    }
  });
  return found;
}

// Where the gradient of each differentiated input comes from: its gradient node, or the j-th
// zeros node (placed from ZerosAt on) when the output does not depend on it.
template <auto Grads, std::size_t ZerosAt, std::size_t... InputNodes>
constexpr std::array<std::size_t, sizeof...(InputNodes)> store_sources() {
  std::array<std::size_t, sizeof...(InputNodes)> sources{};
  std::size_t j = 0;
  ((sources[j] = Grads[InputNodes] != no_grad ? Grads[InputNodes] : ZerosAt + j, ++j), ...);
  return sources;
}

}  // namespace detail

// Gives the graph an input node K of type T if the function never read input K, so that its
// (zero) gradient has somewhere to come from.
template <std::size_t K, class T, class G, std::size_t Out>
auto with_input(const graph::Sym<G, Out>& program) {
  if constexpr (detail::input_node<G, K>() < G::size) {
    return program;
  } else {
    auto g = graph::make_graph(
        boost::hana::append(program.graph.nodes, graph::Node<graph::InputOp<K, graph::AnyShape, T>>{}));
    return graph::Sym<decltype(g), Out>{g};
  }
}

// The training graph of a forward program: the forward nodes, then the gradient nodes. Its
// output is still the forward output; parameters' gradients land in their grad tensors, and
// the gradient of input K lands in *input_grads[j] for the j-th K of Wrt.
template <std::size_t... Wrt, class G0, std::size_t Out, class... T>
auto build_backward(const graph::Sym<G0, Out>& program, BasicTensor<T>*... input_grads) {
  static_assert(sizeof...(Wrt) == sizeof...(T), "duet::build_backward: one destination per input differentiated");
  static_assert(sizeof...(Wrt) <= 1, "duet::build_backward: one input at a time (grad_position is one index)");
  const auto forward = [&] {
    if constexpr (sizeof...(Wrt) == 0)
      return program;
    else
      return with_input<Wrt..., T...>(program);
  }();
  using G = typename std::remove_cvref_t<decltype(forward)>::graph_type;
  constexpr auto leads = detail::leads_to_gradient<G, Wrt...>();
  constexpr auto none = [] {
    std::array<std::size_t, G::size> a{};
    a.fill(detail::no_grad);
    return a;
  }();
  auto seeded = boost::hana::append(forward.graph.nodes, graph::Node<ops::FillLikeOp<1>, Out>{});
  auto [built, grads_tag] =
      detail::backward_from<G::size, detail::with(none, Out, G::size), leads>(forward.graph, seeded);
  static constexpr auto grads = decltype(grads_tag)::value;
  // An input the output does not depend on has a zero gradient, as in MindSpore.
  auto zeros = boost::hana::make_tuple(graph::Node<ops::FillLikeOp<0>, detail::input_node<G, Wrt>()>{}...);
  constexpr std::size_t zeros_at = decltype(boost::hana::length(built))::value;
  [[maybe_unused]] static constexpr auto sources =
      detail::store_sources<grads, zeros_at, detail::input_node<G, Wrt>()...>();
  const std::tuple<BasicTensor<T>*...> destinations{input_grads...};
  auto stores = [&]<std::size_t... J>(std::index_sequence<J...>) {
    return boost::hana::make_tuple(
        graph::Node<ops::StoreOp<std::tuple_element_t<J, std::tuple<T...>>>, sources[J]>{std::get<J>(destinations)}...);
  }
  (std::index_sequence_for<T...>{});
  auto training = graph::make_graph(boost::hana::concat(boost::hana::concat(built, zeros), stores));
  return graph::Sym<decltype(training), Out>{training};
}

}  // namespace autodiff

// What value_and_grad returns: the function's value, then the gradients asked for (the
// input's first, when a grad_position is given, then the weights' in order).
template <ElementType T>
struct ValueAndGrads {
  BasicTensor<T> value;
  std::vector<BasicTensor<T>> grads;
};

namespace autodiff::detail {

template <class F>
concept CellLike = requires {
  typename std::remove_cvref_t<F>::value_type;
}
&&std::is_base_of_v<nn::BasicDynamicCell<typename std::remove_cvref_t<F>::value_type>, std::remove_cvref_t<F>>;

// The mode a function runs in: a cell's own, otherwise the context's.
template <class F>
Mode mode_of() {
  return effective_mode(nn::detail::fixed_mode_of<F>());
}

template <class T>
std::vector<nn::BasicParameter<T>*> parameters_of(const std::vector<nn::NamedParameter<T>>& named) {
  std::vector<nn::BasicParameter<T>*> out;
  out.reserve(named.size());
  for (const auto& p : named) out.push_back(p.parameter);
  return out;
}

// Returns f(integral_constant<K>) for K = position, K in 0..Count-1: a runtime position
// picks a compile-time instantiation.
template <std::size_t Count, class F>
auto at_position(std::size_t position, F&& f) {
  decltype(f(std::integral_constant<std::size_t, 0>{})) result{};
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    ((position == K ? (void)(result = f(std::integral_constant<std::size_t, K>{})) : void()), ...);
  }
  (std::make_index_sequence<Count>{});
  return result;
}

}  // namespace autodiff::detail

// A function with its gradient: what value_and_grad and grad return. Calls run the function
// forward and backward in its mode; parameters' gradients are also left in their grad tensors.
// W is the weights' element type, or void for none (then the function's output type is what
// is differentiated).
template <class Fn, class W = void>
class GradFunction {
  using FnRef = std::remove_reference_t<Fn>;
  using WeightType = std::conditional_t<std::is_void_v<W>, float, W>;

  // The element type of fn's value on tensors like X...
  template <class... X>
  using value_t = typename decltype(std::declval<FnRef&>()(tensor_of(std::declval<const X&>())...))::value_type;

 public:
  GradFunction(Fn fn, std::vector<nn::BasicParameter<WeightType>*> weights, std::optional<std::size_t> grad_position)
      : fn_(std::forward<Fn>(fn)), weights_(std::move(weights)), grad_position_(grad_position) {}

  template <class... X>
  ValueAndGrads<value_t<X...>> operator()(const X&... xs) {
    using V = value_t<X...>;
    static_assert(std::is_void_v<W> || std::is_same_v<V, W>,
                  "duet::value_and_grad: the function's value and the weights have different element types");
    ValueAndGrads<V> out;
    BasicTensor<V> input_grad;
    if (grad_position_) {
      check_position<V, X...>();
      out.value = forward_backward<true>(input_grad, xs...);
      out.grads.push_back(std::move(input_grad));
    } else {
      out.value = forward_backward<false>(input_grad, xs...);
    }
    if constexpr (!std::is_void_v<W>) {
      const std::uint64_t pass = duet::detail::current_backward_pass();
      for (nn::BasicParameter<W>* p : weights_) {
        out.grads.push_back(p->has_grad_from(pass) ? p->grad.clone() : zeros<W>(p->shape()));
      }
    }
    return out;
  }

  // The value, with the gradients left in the parameters' grad tensors and none copied out:
  // a training step's first half.
  template <class... X>
  BasicTensor<value_t<X...>> value_and_parameter_grads(const X&... xs) {
    BasicTensor<value_t<X...>> unused;
    return forward_backward<false>(unused, xs...);
  }

 private:
  // Inputs of another element type than the value's (integer labels, say) have no gradient.
  template <class V, std::size_t K, class... X>
  static constexpr bool differentiable_input() {
    return std::is_same_v<typename std::tuple_element_t<K, std::tuple<X...>>::value_type, V>;
  }

  template <class V, class... X>
  void check_position() const {
    if (*grad_position_ >= sizeof...(X)) {
      throw ValueError("duet::value_and_grad: grad_position " + std::to_string(*grad_position_) +
                       " is out of range for " + std::to_string(sizeof...(X)) + " inputs");
    }
    const bool ok = autodiff::detail::at_position<sizeof...(X)>(
        *grad_position_, [](auto k) { return differentiable_input<V, decltype(k)::value, X...>(); });
    if (!ok) {
      throw ValueError("duet::value_and_grad: input " + std::to_string(*grad_position_) +
                       " (grad_position) is not of the element type being differentiated");
    }
  }

  template <bool WithInput, class V, class... X>
  BasicTensor<V> forward_backward(BasicTensor<V>& input_grad, const X&... xs) {
    if constexpr (graph::Capturable<FnRef&, X...>) {
      if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE) return run_graph<WithInput>(input_grad, xs...);
    } else if constexpr (!WithInput && autodiff::detail::CellLike<Fn>) {
      if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE && autodiff::active_tape() == nullptr &&
          pijit::active_trace() == nullptr) {
        return traced_step_.get([this] {
          return TracedStep(StepCall{this}, {.mode = JitMode::PIJit,
                                             .name = fn_.label() + " forward and backward in graph mode "
                                                                   "(argument 0: the network's structure)"});
        })(nn::detail::structure_generation().load(std::memory_order_acquire), xs...);
      }
    }
    return run_eager<WithInput>(input_grad, xs...);
  }

  // Graph mode for a cell built at run time (it has no construct to capture): the whole step,
  // forward, loss and backward, is traced on the first call for each input signature and
  // structure, and replayed after (PIJit, default JitConfig). Parameters' gradients are written
  // by the replay's gradient steps, as the tape's backward writes them.
  struct StepCall {
    GradFunction* self;
    template <class... X>
      requires((is_tensor_v<X> || is_static_tensor_v<X>) && ...)
    BasicTensor<value_t<X...>> operator()(std::uint64_t /*structure*/, const X&... xs) const {
      if (pijit::Trace* trace = pijit::active_trace()) trace->allow_parameter_gradients();
      BasicTensor<value_t<X...>> no_input_grad;
      return self->template run_eager<false>(no_input_grad, xs...);
    }
  };
  using TracedStep = JitFunction<JitConfig{}, StepCall>;

  template <bool WithInput, class V, class... X>
  BasicTensor<V> run_eager(BasicTensor<V>& input_grad, const X&... xs) {
    autodiff::Tape tape;
    std::tuple<BasicTensor<typename X::value_type>...> inputs{tensor_of(xs)...};
    BasicTensor<V> value;
    {
      autodiff::Recording recording(&tape);
      EagerScope eager;
      if constexpr (WithInput) {
        autodiff::detail::at_position<sizeof...(X)>(*grad_position_, [&](auto k) {
          if constexpr (differentiable_input<V, decltype(k)::value, X...>())
            tape.watch(std::get<decltype(k)::value>(inputs));
          return 0;
        });
      }
      value = std::apply([&](const auto&... x) { return BasicTensor<V>(fn_(x...)); }, inputs);
    }
    tape.backward(value);
    if constexpr (WithInput) {
      autodiff::detail::at_position<sizeof...(X)>(*grad_position_, [&](auto k) {
        if constexpr (differentiable_input<V, decltype(k)::value, X...>()) {
          const auto& x = std::get<decltype(k)::value>(inputs);
          const auto* entry = tape.entry_of(x);
          input_grad = entry != nullptr && entry->grad() != nullptr ? entry->grad()->clone() : zeros<V>(x.shape());
        }
        return 0;
      });
    }
    return value;
  }

  template <bool WithInput, class V, class... X>
  BasicTensor<V> run_graph(BasicTensor<V>& input_grad, const X&... xs) {
    if constexpr (autodiff::detail::CellLike<Fn>) {
      if (fn_.has_hooks_in_tree()) {
        throw ModeError(fn_.label() +
                        " is differentiated in graph mode, but a cell in it has a hook; "
                        "hooks run in PyNative mode only");
      }
    }
    auto forward = passes::optimize<JitConfig{}, true>([&]<std::size_t... K>(std::index_sequence<K...>) {
      return fn_(graph::input<typename X::value_type, typename graph::pattern_of<X>::type, K>()...);
    }(std::index_sequence_for<X...>{}));
    const std::array<Shape, sizeof...(X)> shapes{xs.shape()...};
    duet::detail::begin_backward_pass();
    if constexpr (WithInput) {
      return autodiff::detail::at_position<sizeof...(X)>(*grad_position_, [&](auto k) {
        if constexpr (differentiable_input<V, decltype(k)::value, X...>()) {
          auto training = autodiff::build_backward<decltype(k)::value>(forward, &input_grad);
          return BasicTensor<V>(
              run<DefaultBackend>(training, duet::detail::cached_plan(id_, training, shapes, where()), tensor_of(xs)...));
        } else {
          return BasicTensor<V>();
        }
      });
    } else {
      auto training = autodiff::build_backward<>(forward);
      return run<DefaultBackend>(training, duet::detail::cached_plan(id_, training, shapes, where()), tensor_of(xs)...);
    }
  }

  // What messages call the function: the cell's construct, or "the differentiated function".
  auto where() const {
    if constexpr (autodiff::detail::CellLike<Fn>) return [this] { return fn_.type_name() + "::construct"; };
    else return [] { return std::string("the differentiated function"); };
  }

  Fn fn_;
  std::vector<nn::BasicParameter<WeightType>*> weights_;
  std::optional<std::size_t> grad_position_;
  std::uint64_t id_ = duet::detail::new_plan_owner();
  duet::detail::OwnForm<TracedStep> traced_step_;
};

// MindSpore's value_and_grad(fn, grad_position, weights). fn is a cell (kept by reference) or
// a function of tensors; weights a cell's parameters() or any list of them.
template <class Fn>
auto value_and_grad(Fn&& fn, std::optional<std::size_t> grad_position = 0) {
  return GradFunction<Fn, void>(std::forward<Fn>(fn), {}, grad_position);
}
template <class Fn, ElementType T>
auto value_and_grad(Fn&& fn, const std::vector<nn::NamedParameter<T>>& weights,
                    std::optional<std::size_t> grad_position = std::nullopt) {
  return GradFunction<Fn, T>(std::forward<Fn>(fn), autodiff::detail::parameters_of(weights), grad_position);
}
template <class Fn, ElementType T>
auto value_and_grad(Fn&& fn, std::vector<nn::BasicParameter<T>*> weights,
                    std::optional<std::size_t> grad_position = std::nullopt) {
  return GradFunction<Fn, T>(std::forward<Fn>(fn), std::move(weights), grad_position);
}

// MindSpore's grad: the gradients alone. grad(fn) differentiates with respect to the first input.
template <class Fn, class... Weights>
auto grad(Fn&& fn, Weights&&... weights_and_position) {
  auto vg = value_and_grad(std::forward<Fn>(fn), std::forward<Weights>(weights_and_position)...);
  return [vg = std::move(vg)](const auto&... xs) mutable {
    auto out = vg(xs...);
    if constexpr (sizeof...(Weights) == 0)
      return std::move(out.grads.front());
    else
      return std::move(out.grads);
  };
}

}  // namespace duet
// Data for training: image data sets held in memory as bytes, Fashion-MNIST, and a DataLoader
// that cuts a data set into shuffled float batches.
//
// Images stay bytes until a batch is made (Fashion-MNIST's training set is 47 MB as bytes,
// 188 MB as floats), and a batch's tensors are reused from one batch to the next when nobody
// else holds them.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

// IDX files, the format of MNIST and Fashion-MNIST, plain or gzip-compressed.
//
//   bytes 0-1   0x00 0x00
//   byte  2     element type: 0x08 unsigned byte, 0x09 signed byte, 0x0B int16, 0x0C int32,
//               0x0D float32, 0x0E float64
//   byte  3     number of dimensions
//   then        one big-endian u32 per dimension, then the elements, big-endian, row-major
//
// A file starting with the gzip magic (0x1F 0x8B) is decompressed on the way; concatenated
// gzip members are read as one stream, as gunzip does.
//
// The reader takes any bytes, from a file (read_idx) or from memory (read_idx_bytes): a
// malformed file is a duet::FormatError naming the problem, an unreadable one a
// duet::IOError. The header is not trusted with memory: the data is first streamed through a
// fixed buffer to prove it is all there, and only then is the tensor allocated and the file
// read again into it. So a short file claiming a gigabyte (a gzip bomb's header) fails having
// allocated nothing, and a real one is held once, with no growing buffer copied into the
// tensor to double the peak (the Fashion-MNIST training images are 47 MB; decompressing them
// twice costs about 0.4 s).

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <variant>


namespace duet::io {

// The largest element data read_idx accepts; larger headers are taken as corrupt.
inline constexpr std::uint64_t max_idx_data_bytes = std::uint64_t{1} << 30;

// An IDX file's contents: its elements as a tensor of the matching duet type, shaped as the
// header says.
struct IdxArray {
  DType dtype;
  Shape shape;
  std::variant<BasicTensor<std::uint8_t>, BasicTensor<std::int32_t>, BasicTensor<float>, BasicTensor<double>> data;
};

namespace detail {

// Built by appending: GCC 12 warns falsely (-Wrestrict, PR105329) on "'" + std::string.
inline std::string quoted(const std::filesystem::path& path) { return std::string("'").append(path.string()) + "'"; }

// The bytes of a file or of a buffer in memory, gunzipped on the way when they start with the
// gzip magic.
class IdxByteStream {
 public:
  // Reads the file a chunk at a time.
  IdxByteStream(const std::filesystem::path& path, const std::string& where)
      : where_(where),
        file_(std::fopen(path.c_str(), "rb")),
        buffer_(std::make_unique_for_overwrite<unsigned char[]>(chunk)) {
    if (file_ == nullptr) {
      const int error = errno;
      throw IOError(where_ + ": cannot open: " + std::generic_category().message(error));
    }
    start();
  }
  // Reads the caller's bytes in place, which must outlive the stream.
  IdxByteStream(std::span<const std::byte> bytes, const std::string& where)
      : where_(where), memory_(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) {
    start();
  }
  IdxByteStream(const IdxByteStream&) = delete;
  IdxByteStream& operator=(const IdxByteStream&) = delete;
  ~IdxByteStream() = default;

  bool gzipped() const { return inflater_.has_value(); }

  // Fills out; fewer bytes only at the end of the contents.
  std::size_t read(std::span<std::byte> out) {
    std::size_t got = 0;
    while (got < out.size()) {
      const std::size_t n = gzipped() ? inflate_some(out.subspan(got)) : copy_some(out.subspan(got));
      if (n == 0) break;
      got += n;
    }
    return got;
  }

 private:
  static constexpr std::size_t chunk = 64 * 1024;

  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };

  // Owns a z_stream, which must not move once initialised (zlib keeps a pointer to it).
  struct Inflater {
    explicit Inflater(const std::string& where) {
      // 16 + MAX_WBITS: gzip framing only, with each member's CRC-32 and length checked.
      if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) throw IOError(where + ": cannot initialise zlib");
    }
    Inflater(const Inflater&) = delete;
    Inflater& operator=(const Inflater&) = delete;
    ~Inflater() { inflateEnd(&z); }
    z_stream z{};
  };

  void start() {
    in_ = next_chunk();
    if (in_.size() >= 2 && in_[0] == 0x1F && in_[1] == 0x8B) {
      inflater_.emplace(where_);
      feed_inflater();
    }
  }

  // The next input bytes, empty at the end. Memory is handed out in chunks too, since zlib
  // counts its input in 32 bits.
  std::span<const unsigned char> next_chunk() {
    if (file_ == nullptr) {
      const auto out = memory_.first(std::min(chunk, memory_.size()));
      memory_ = memory_.subspan(out.size());
      return out;
    }
    const std::size_t n = std::fread(buffer_.get(), 1, chunk, file_.get());
    if (n < chunk && std::ferror(file_.get()) != 0) {
      const int error = errno;
      throw IOError(where_ + ": read failed: " + std::generic_category().message(error));
    }
    return {buffer_.get(), n};
  }

  void feed_inflater() {
    // zlib only reads through next_in, which is non-const unless ZLIB_CONST is defined.
    inflater_->z.next_in = const_cast<Bytef*>(in_.data());
    inflater_->z.avail_in = static_cast<uInt>(in_.size());
  }

  std::size_t copy_some(std::span<std::byte> out) {
    if (in_pos_ == in_.size()) {
      in_ = next_chunk();
      in_pos_ = 0;
    }
    const std::size_t n = std::min(out.size(), in_.size() - in_pos_);
    std::copy_n(in_.data() + in_pos_, n, reinterpret_cast<unsigned char*>(out.data()));
    in_pos_ += n;
    return n;
  }

  // Some output, or 0 at the end of the last member.
  std::size_t inflate_some(std::span<std::byte> out) {
    z_stream& z = inflater_->z;
    const auto wanted = static_cast<uInt>(std::min<std::size_t>(out.size(), std::numeric_limits<uInt>::max()));
    z.next_out = reinterpret_cast<Bytef*>(out.data());
    z.avail_out = wanted;
    while (z.avail_out == wanted) {
      if (z.avail_in == 0) {
        in_ = next_chunk();
        feed_inflater();
        if (z.avail_in == 0) {
          if (in_member_) throw FormatError(where_ + ": the gzip data is truncated");
          break;
        }
      }
      const bool starts_member = !in_member_;
      in_member_ = true;
      const int rc = inflate(&z, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        in_member_ = false;
        inflateReset(&z);
      } else if (rc == Z_MEM_ERROR) {
        throw IOError(where_ + ": out of memory while decompressing");
      } else if (rc != Z_OK && !(rc == Z_BUF_ERROR && z.avail_in == 0)) {
        // Z_BUF_ERROR with input left would mean no progress: refusing it rules out a loop.
        const std::string why = z.msg != nullptr ? z.msg : "zlib error " + std::to_string(rc);
        throw FormatError(where_ + (starts_member
                                        ? ": bytes after the gzip data are not another gzip member (" + why + ")"
                                        : ": corrupt gzip data (" + why + ")"));
      }
    }
    return wanted - z.avail_out;
  }

  std::string where_;
  std::unique_ptr<std::FILE, FileCloser> file_;  // null when reading memory_
  std::unique_ptr<unsigned char[]> buffer_;      // what in_ views, for a file
  std::span<const unsigned char> memory_;        // the bytes not yet handed out, for memory
  std::span<const unsigned char> in_;            // the current chunk
  std::size_t in_pos_ = 0;
  std::optional<Inflater> inflater_;
  bool in_member_ = true;  // the magic promised a first member
};

struct IdxHeader {
  DType dtype = DType::uint8;
  Shape shape;
  std::uint64_t header_bytes = 0;
  std::uint64_t data_bytes = 0;

  friend bool operator==(const IdxHeader&, const IdxHeader&) = default;
};

inline std::string hex_byte(std::byte b) {
  static constexpr char digits[] = "0123456789ABCDEF";
  const auto v = static_cast<unsigned>(b);
  return std::string("0x") + digits[v >> 4] + digits[v & 0xF];
}

// Where byte offsets count from, in messages.
inline std::string offsets_of(const IdxByteStream& in) { return in.gzipped() ? " of the decompressed data" : ""; }

inline IdxHeader read_idx_header(IdxByteStream& in, const std::string& where) {
  std::array<std::byte, 4> magic{};
  const std::size_t got = in.read(magic);
  if (got < magic.size()) {
    throw FormatError(where + ": truncated at byte " + std::to_string(got) + offsets_of(in) +
                      ": an IDX header starts with 4 bytes");
  }
  if (magic[0] != std::byte{0} || magic[1] != std::byte{0}) {
    throw FormatError(where + ": not an IDX file: it starts with " + hex_byte(magic[0]) + " " + hex_byte(magic[1]) +
                      ", not 0x00 0x00");
  }
  IdxHeader h;
  std::uint64_t element_size = 0;
  switch (static_cast<unsigned>(magic[2])) {
    case 0x08:
      h.dtype = DType::uint8;
      element_size = 1;
      break;
    case 0x0C:
      h.dtype = DType::int32;
      element_size = 4;
      break;
    case 0x0D:
      h.dtype = DType::float32;
      element_size = 4;
      break;
    case 0x0E:
      h.dtype = DType::float64;
      element_size = 8;
      break;
    case 0x09:
    case 0x0B:
      throw FormatError(where + ": element type " + hex_byte(magic[2]) +
                        (magic[2] == std::byte{0x09} ? " (int8)" : " (int16)") +
                        " has no duet tensor type; duet reads unsigned bytes (0x08), int32 (0x0C), float32 (0x0D) "
                        "and float64 (0x0E)");
    default:
      throw FormatError(where + ": unknown IDX element type " + hex_byte(magic[2]));
  }
  const auto ndim = static_cast<std::size_t>(magic[3]);
  if (ndim < 1 || ndim > static_cast<std::size_t>(max_rank)) {
    throw FormatError(where + ": the header gives " + std::to_string(ndim) + " dimensions; duet reads 1 to " +
                      std::to_string(max_rank));
  }
  std::array<std::byte, 4 * max_rank> dims{};
  const auto dim_bytes = std::span(dims).first(4 * ndim);
  const std::size_t got_dims = in.read(dim_bytes);
  if (got_dims < dim_bytes.size()) {
    throw FormatError(where + ": truncated at byte " + std::to_string(4 + got_dims) + offsets_of(in) +
                      ": a header of " + std::to_string(ndim) + " dimensions is " +
                      std::to_string(4 + dim_bytes.size()) + " bytes");
  }
  // The nonzero dimensions' product is bounded even when a zero makes the array empty: a
  // tensor's shape must not overflow on the way to its zero. It saturates just past the limit.
  const std::uint64_t limit = max_idx_data_bytes / element_size;
  std::uint64_t nonzero = 1;
  bool empty = false;
  for (std::size_t i = 0; i < ndim; ++i) {
    const std::byte* p = dims.data() + 4 * i;
    const std::uint64_t d =
        std::uint64_t(p[0]) << 24 | std::uint64_t(p[1]) << 16 | std::uint64_t(p[2]) << 8 | std::uint64_t(p[3]);
    h.shape.push_back(static_cast<index_t>(d));
    if (d == 0) {
      empty = true;
    } else {
      nonzero = nonzero <= limit / d ? nonzero * d : limit + 1;
    }
  }
  if (nonzero > limit) {
    throw FormatError(where + ": dimensions " + to_string(h.shape) + " exceed the " +
                      std::to_string(max_idx_data_bytes >> 20) + " MiB of data duet::io::read_idx accepts");
  }
  h.header_bytes = 4 + dim_bytes.size();
  h.data_bytes = empty ? 0 : nonzero * element_size;
  return h;
}

// Having read `got` bytes of data, checks they are exactly what the header promises.
inline void check_data_length(IdxByteStream& in, const IdxHeader& h, std::uint64_t got, const std::string& where) {
  if (got < h.data_bytes) {
    throw FormatError(where + ": truncated at byte " + std::to_string(h.header_bytes + got) + offsets_of(in) +
                      ": the header " + to_string(h.shape) + " promises " +
                      std::to_string(h.header_bytes + h.data_bytes) + " bytes");
  }
  std::array<std::byte, 1> extra{};
  if (in.read(extra) != 0) {
    throw FormatError(where + ": trailing bytes after byte " + std::to_string(h.header_bytes + h.data_bytes) +
                      offsets_of(in) + ", where the header " + to_string(h.shape) + " ends the data");
  }
}

// Streams the data through a small buffer: proves the file holds it before anything is allocated.
inline void skip_idx_data(IdxByteStream& in, const IdxHeader& h, const std::string& where) {
  std::array<std::byte, 16 * 1024> scratch;
  std::uint64_t got = 0;
  while (got < h.data_bytes) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(scratch.size(), h.data_bytes - got));
    const std::size_t n = in.read(std::span(scratch).first(want));
    got += n;
    if (n < want) break;
  }
  check_data_length(in, h, got, where);
}

template <class T>
BasicTensor<T> read_idx_data(IdxByteStream& in, const IdxHeader& h, const std::string& where) {
  auto t = BasicTensor<T>::uninitialized(h.shape);
  const std::span<std::byte> bytes = std::as_writable_bytes(t.values());
  check_data_length(in, h, in.read(bytes), where);
  // IDX elements are big-endian.
  if constexpr (sizeof(T) > 1 && std::endian::native == std::endian::little) {
    for (auto e = bytes.begin(); e != bytes.end(); e += sizeof(T)) std::reverse(e, e + sizeof(T));
  }
  return t;
}

// Both passes over the data; open() makes a new stream from its start each time.
template <class Open>
IdxArray read_idx_from(Open open, const std::string& where) {
  IdxHeader header;
  {
    IdxByteStream probe = open();
    header = read_idx_header(probe, where);
    skip_idx_data(probe, header, where);
  }
  IdxByteStream in = open();
  if (!(read_idx_header(in, where) == header)) throw FormatError(where + ": the file changed while being read");
  IdxArray out{header.dtype, header.shape, {}};
  switch (header.dtype) {
    case DType::int32:
      out.data = read_idx_data<std::int32_t>(in, header, where);
      break;
    case DType::float32:
      out.data = read_idx_data<float>(in, header, where);
      break;
    case DType::float64:
      out.data = read_idx_data<double>(in, header, where);
      break;
    default:
      out.data = read_idx_data<std::uint8_t>(in, header, where);
      break;  // uint8, the last one
  }
  return out;
}

}  // namespace detail

// The header, dimensions and elements of an IDX file; any malformed file is a FormatError.
inline IdxArray read_idx(const std::filesystem::path& path) {
  const std::string where = "IDX file " + detail::quoted(path);
  return detail::read_idx_from([&] { return detail::IdxByteStream(path, where); }, where);
}

// The same for the bytes of an IDX file already in memory, plain or gzipped.
inline IdxArray read_idx_bytes(std::span<const std::byte> bytes) {
  const std::string where = "IDX data";
  return detail::read_idx_from([&] { return detail::IdxByteStream(bytes, where); }, where);
}

// An IDX file of unsigned bytes (images, labels), as a tensor of its shape.
inline BasicTensor<std::uint8_t> read_idx_u8(const std::filesystem::path& path) {
  IdxArray a = read_idx(path);
  if (a.dtype != DType::uint8) {
    throw FormatError("IDX file " + detail::quoted(path) + ": holds " + std::string(name_of(a.dtype)) +
                      " elements, expected unsigned bytes (UInt8)");
  }
  return std::get<BasicTensor<std::uint8_t>>(std::move(a.data));
}

}  // namespace duet::io
// Seeded random numbers that are the same on every compiler and standard library.
//
// std::uniform_real_distribution and std::normal_distribution are implementation-defined, so
// duet draws its own: xoshiro256** seeded through splitmix64, uniform floats from the top
// bits, normals by Box-Muller. Both modes build their weights from this generator, which is
// why the same seed gives the same network in PyNative and graph mode.

#include <cmath>
#include <cstdint>
#include <mutex>
#include <numbers>


namespace duet {

class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0) { this->seed(seed); }

  void seed(std::uint64_t seed) {
    for (auto& word : state_) {
      seed += 0x9E3779B97F4A7C15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      word = z ^ (z >> 31);
    }
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1), with all the precision T can hold.
  template <class T>
  T uniform01() {
    if constexpr (std::is_same_v<T, float>) {
      return static_cast<float>(next() >> 40) * 0x1.0p-24f;
    } else {
      return static_cast<T>(static_cast<double>(next() >> 11) * 0x1.0p-53);
    }
  }

  template <class T>
  T uniform(T low, T high) {
    return low + (high - low) * uniform01<T>();
  }

  // Standard normal, Box-Muller in double so float and double draws agree to float precision.
  template <class T>
  T normal() {
    if (has_spare_) {
      has_spare_ = false;
      return static_cast<T>(spare_);
    }
    double u1 = 0;
    while (u1 == 0) u1 = uniform01<double>();
    const double u2 = uniform01<double>();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return static_cast<T>(r * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t state_[4]{};
  double spare_ = 0;
  bool has_spare_ = false;
};

namespace detail {
struct GlobalGenerator {
  std::mutex mutex;
  Generator generator{0};
};
inline GlobalGenerator& global_generator() {
  static GlobalGenerator g;
  return g;
}
}  // namespace detail

// Reseeds the generator that layer initialisers and the unseeded creation functions draw
// from (MindSpore's set_seed). The default seed is 0, so programs are reproducible by default.
inline void set_seed(std::uint64_t seed) {
  auto& g = detail::global_generator();
  std::lock_guard lock(g.mutex);
  g.generator.seed(seed);
}

// Runs fn(Generator&) with the global generator locked.
template <class F>
decltype(auto) with_global_generator(F&& fn) {
  auto& g = detail::global_generator();
  std::lock_guard lock(g.mutex);
  return fn(g.generator);
}

template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low, T high, Generator& gen) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (T& v : t.values()) v = gen.uniform<T>(low, high);
  return t;
}

template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape, Generator& gen) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (T& v : t.values()) v = gen.normal<T>();
  return t;
}

// Seeded: the same seed gives the same tensor, whatever else has drawn numbers.
template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low, T high, std::uint64_t seed) {
  Generator gen(seed);
  return uniform<T>(shape, low, high, gen);
}
template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape, std::uint64_t seed) {
  Generator gen(seed);
  return randn<T>(shape, gen);
}

// Unseeded: draws from the global generator (see set_seed).
template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low = 0, T high = 1) {
  return with_global_generator([&](Generator& gen) { return uniform<T>(shape, low, high, gen); });
}
template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape) {
  return with_global_generator([&](Generator& gen) { return randn<T>(shape, gen); });
}

}  // namespace duet

namespace duet::data {

// Images [N, H, W] as bytes and their labels [N], each in 0 .. classes - 1. Copies share the
// elements, as tensors do.
class ImageDataset {
 public:
  ImageDataset(BasicTensor<std::uint8_t> images, BasicTensor<std::int32_t> labels, int classes)
      : images_(std::move(images)), labels_(std::move(labels)), classes_(classes) {
    if (images_.ndim() != 3) {
      throw ShapeError("duet::data::ImageDataset: images must have shape [N, H, W], got " + to_string(images_.shape()));
    }
    if (labels_.ndim() != 1 || labels_.dim(0) != images_.dim(0)) {
      throw ShapeError("duet::data::ImageDataset: " + std::to_string(images_.dim(0)) +
                       " images need labels of shape [" + std::to_string(images_.dim(0)) + "], got " +
                       to_string(labels_.shape()));
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

  // Samples.
  index_t size() const { return images_.dim(0); }
  index_t height() const { return images_.dim(1); }
  index_t width() const { return images_.dim(2); }
  int classes() const { return classes_; }
  const BasicTensor<std::uint8_t>& images() const { return images_; }
  const BasicTensor<std::int32_t>& labels() const { return labels_; }

 private:
  BasicTensor<std::uint8_t> images_;
  BasicTensor<std::int32_t> labels_;
  int classes_;
};

enum class Split { train, test };

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";

// Fashion-MNIST (60000 training or 10000 test images of 28x28, 10 classes) from the four IDX
// files of its distribution, gzipped (as shipped) or not.
inline ImageDataset load_fashion_mnist(const std::filesystem::path& dir, Split split) {
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

inline ImageDataset load_fashion_mnist(Split split = Split::train) {
  return load_fashion_mnist(fashion_mnist_dir, split);
}

// A batch: images [B, 1, H, W] as floats in [0, 1] (byte / 255) and their labels [B].
struct Batch {
  Tensor images;
  BasicTensor<std::int32_t> labels;
};

struct LoaderOptions {
  // Epoch e's order is a function of (seed, e) alone, so a run can be repeated or resumed.
  bool shuffle = false;
  std::uint64_t seed = 0;
  // Leave out the last batch when it is smaller than batch_size, instead of returning it short.
  bool drop_last = false;
};

// Cuts a data set into batches, one epoch at a time:
//
//   data::DataLoader loader(data::load_fashion_mnist(), 64, {.shuffle = true, .seed = 1});
//   for (int epoch = 0; epoch < 10; ++epoch) {
//     for (const data::Batch& batch : loader) train(batch.images, batch.labels);
//   }
//
// Each range-for runs the next epoch (the first runs epoch 0); next() and start_epoch() step
// through epochs by hand. A batch is valid until the next batch is made.
class DataLoader {
 public:
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;

    Iterator() = default;
    explicit Iterator(DataLoader& loader) : loader_(&loader), batch_(loader.next()) {}

    const Batch& operator*() const { return *batch_; }
    const Batch* operator->() const { return batch_; }
    Iterator& operator++() {
      batch_ = loader_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const Iterator& it, std::default_sentinel_t) { return it.batch_ == nullptr; }

   private:
    DataLoader* loader_ = nullptr;
    const Batch* batch_ = nullptr;
  };

  DataLoader(ImageDataset data, index_t batch_size, LoaderOptions options = {})
      : data_(std::move(data)),
        batch_size_(batch_size),
        options_(options),
        order_(static_cast<std::size_t>(data_.size())) {
    if (batch_size_ <= 0) {
      throw ValueError("duet::data::DataLoader: batch_size must be positive, got " + std::to_string(batch_size_));
    }
    start_epoch(0);
  }

  // Batches per epoch (PyTorch's len(loader), MindSpore's get_dataset_size()).
  index_t size() const {
    return options_.drop_last ? data_.size() / batch_size_ : (data_.size() + batch_size_ - 1) / batch_size_;
  }
  index_t batch_size() const { return batch_size_; }
  const ImageDataset& dataset() const { return data_; }
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
    const index_t first = next_batch_ * batch_size_;
    make_batch(first, std::min(batch_size_, data_.size() - first));
    ++next_batch_;
    return &batch_;
  }

  // Starts the next epoch, or the current one if none of its batches has been taken yet.
  Iterator begin() {
    start_epoch(next_batch_ > 0 ? epoch_ + 1 : epoch_);
    return Iterator(*this);
  }
  std::default_sentinel_t end() const { return {}; }

 private:
  void make_batch(index_t first, index_t count) {
    const index_t h = data_.height();
    const index_t w = data_.width();
    if (batch_.images.use_count() != 1 || batch_.images.dim(0) != count) {
      batch_.images = Tensor::uninitialized({count, 1, h, w});
    }
    if (batch_.labels.use_count() != 1 || batch_.labels.dim(0) != count) {
      batch_.labels = BasicTensor<std::int32_t>::uninitialized({count});
    }
    const index_t pixels = h * w;
    const std::uint8_t* images = data_.images().data();
    for (index_t k = 0; k < count; ++k) {
      const index_t sample = order_[static_cast<std::size_t>(first + k)];
      const std::uint8_t* from = images + sample * pixels;
      float* to = batch_.images.data() + k * pixels;
      for (index_t p = 0; p < pixels; ++p) to[p] = static_cast<float>(from[p]) / 255.0f;
      batch_.labels.data()[k] = data_.labels().data()[sample];
    }
  }

  ImageDataset data_;
  index_t batch_size_;
  LoaderOptions options_;
  std::vector<index_t> order_;  // this epoch's samples, in the order they are served
  std::uint64_t epoch_ = 0;
  index_t next_batch_ = 0;
  Batch batch_;
};

}  // namespace duet::data
// graph_ir: what graph mode made of a cell, as text and as Graphviz DOT, before and after the
// passes (MindSpore users get this from save_graphs).

#include <boost/hana/at.hpp>
#include <cstddef>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>


namespace duet {

struct GraphText {
  std::string text;  // one line per node: "%2 = MatMul + BiasAdd + ReLU(%1) : [?, 512]  nn::Dense<...>"
  std::string dot;   // Graphviz: `dot -Tsvg`
};

struct GraphIR {
  GraphText captured;   // as construct built it
  GraphText optimized;  // after the passes: what the evaluator runs
};

namespace graph {

namespace detail {
// s inside a DOT quoted string that Graphviz shows as a label. A quote would end the string
// and a backslash starts Graphviz's own escapes (\n, \N, \G...), so both are escaped; a
// newline becomes a line break; &, < and > become the entities Graphviz decodes in labels.
inline std::string dot_text(std::string_view s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      default:
        out += c;
    }
  }
  return out;
}
}  // namespace detail

template <class G, std::size_t Out>
GraphText dump(const Sym<G, Out>& program, const std::string& title) {
  constexpr BufferPlan<G::size> plan = plan_buffers<G, Out>();
  std::ostringstream text;
  std::ostringstream dot;
  text << "graph " << title << " {\n";
  dot << "digraph \"" << detail::dot_text(title) << "\" {\n  node [shape=box, fontname=\"monospace\"];\n";
  graph::for_each_index<G::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    using Node = node_at<G, I>;
    const auto& op = boost::hana::at_c<I>(program.graph.nodes).op;
    std::string what = Node::op_type::op_name();
    if constexpr (Node::arity > 0) {
      what += "(";
      for (std::size_t k = 0; k < Node::arity; ++k) what += (k ? ", %" : "%") + std::to_string(Node::args[k]);
      what += ")";
    }
    std::string storage;
    switch (plan.storage[I]) {
      case Storage::input:
        storage = "input";
        break;
      case Storage::view:
        storage = "view of %" + std::to_string(plan.root[I]);
        break;
      case Storage::slot:
        storage = "slot " + std::to_string(plan.slot[I]);
        break;
      case Storage::output:
        storage = "output";
        break;
      case Storage::none:
        storage = "no value";
        break;
    }
    const bool names_layer = op.label() != Node::op_type::op_name();
    const std::string who = names_layer ? "  " + op.label() : "";
    text << "  %" << I << " = " << what << " : " << to_string(G::shapes[I]) << "  [" << storage << "]" << who << "\n";
    std::string label = detail::dot_text("%" + std::to_string(I) + " " + Node::op_type::op_name()) + "\\n" +
                        detail::dot_text(to_string(G::shapes[I]) + " (" + storage + ")");
    if (names_layer) label += "\\n" + detail::dot_text(op.label());
    dot << "  n" << I << " [label=\"" << label << "\"];\n";
    for (std::size_t a : Node::args) dot << "  n" << a << " -> n" << I << ";\n";
  });
  text << "  return %" << Out << "\n}\n";
  dot << "}\n";
  return {text.str(), dot.str()};
}

}  // namespace graph

// The graph of cell for inputs of the given pattern (duet::shape<dyn, 1, 28, 28>, say; by
// default an input of unknown shape, as when a runtime tensor is passed), optimised at the
// jit level of Config.
template <JitConfig Config = JitConfig{}, class C, class Pattern = graph::AnyShape>
GraphIR graph_ir(C& cell, Pattern = {}) {
  if constexpr (nn::RuntimeBuilt<C>) {
    static_assert(!nn::RuntimeBuilt<C>,
                  "duet::graph_ir: a network built at run time (nn::DynamicSequentialCell, or a class deriving "
                  "from nn::DynamicCell) has no construct to capture; graph mode traces it on its first call, "
                  "and duet::jit_compile_log() says what the trace became");
    return {};
  } else {
    cell.ensure_named();
    auto captured = cell(graph::input<typename C::value_type, Pattern>());
    const std::string title = cell.type_name();
    return {graph::dump(captured, title), graph::dump(passes::optimize<Config>(captured), title)};
  }
}

}  // namespace duet
// Checkpoints: a cell's parameters in one file (MindSpore's save_checkpoint / load_checkpoint),
// and optionally its optimiser's state, so that training can resume.
//
// Format, version 2; every integer is little-endian:
//
//   size           field
//   8              magic "DUETCKPT"
//   4              u32 version: 2
//   4              u32 number of parameters
//   per parameter, in the cell's order (a reader accepts any order), a record:
//     4            u32 name length, then the name's bytes: the parameter's path in the cell,
//                  "dense_relu_sequential.0.weight", with no terminator
//     1            u8 element type, a duet::DType: 0 Float32, 1 Float64, 2 Int32, 3 Int64, 4 UInt8
//     1            u8 rank, 0 to duet::max_rank
//     8 × rank     i64 dimensions
//     numel × size the elements, row-major, little-endian
//   4              u32 length of the optimiser's type name, then the name ("nn::Adam", "nn::AdamW",
//                  "nn::SGD"); 0 when the file holds no optimiser state, and then the next
//                  two fields and the records are absent
//   8              i64 the optimiser's global step (which drives schedules and bias correction)
//   4              u32 number of optimiser state tensors
//   per state tensor, a record as above, named "<slot>.<parameter's name>":
//                  "moment1.dense_relu_sequential.0.weight" (Adam: moment1, moment2; SGD with
//                  momentum: momentum)
//   4              u32 CRC-32 (zlib's crc32) of every byte before it
//
// Version 1 is the same up to the parameters' records, which the checksum follows directly;
// it is still read.
//
// Names are paths from the cell saved, which are the same whichever mode the cell runs in,
// so a checkpoint saved from a network in graph mode loads into the same network in PyNative
// mode and back.

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// Optimisers and learning-rate schedules (MindSpore's nn.SGD, nn.Adam, AdamW and nn.*LR).
//
// An optimiser updates its parameters from the gradients the last backward pass on this
// thread left in them (step()), or from a list of gradients (operator(), as MindSpore calls
// optimisers). Its state (momentum, Adam's moments) is made once, so steps do not allocate.
// state() and set_global_step expose that state for checkpoints (duet::save_checkpoint(net,
// path, optimizer)), which is how training resumes.

#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <string_view>
#include <utility>
#include <vector>


namespace duet::nn {

// The learning rate at global step t (0 for the first step).
using LearningRateSchedule = std::function<double(std::int64_t step)>;

// A constant rate or a schedule, so that `.learning_rate = 1e-3` and
// `.learning_rate = CosineDecayLR{...}` both read naturally.
class LearningRate {
 public:
  LearningRate(double constant)
      : schedule_([constant](std::int64_t) { return constant; }) {}  // NOLINT: implicit by design
  template <class F>
  requires std::is_invocable_r_v<double, F, std::int64_t> LearningRate(F schedule)
      : schedule_(std::move(schedule)) {}  // NOLINT: implicit by design
  double at(std::int64_t step) const { return schedule_(step); }

 private:
  LearningRateSchedule schedule_;
};

// min_lr + (max_lr - min_lr) · (1 + cos(π · min(t, decay_steps) / decay_steps)) / 2.
struct CosineDecayLR {
  double min_lr;
  double max_lr;
  std::int64_t decay_steps;
  double operator()(std::int64_t t) const {
    const double p = static_cast<double>(std::min(t, decay_steps)) / static_cast<double>(decay_steps);
    return min_lr + (max_lr - min_lr) * (1 + std::cos(std::numbers::pi * p)) / 2;
  }
};

// lr · decay_rate^(t / decay_steps), the exponent floored if is_stair.
struct ExponentialDecayLR {
  double learning_rate;
  double decay_rate;
  std::int64_t decay_steps;
  bool is_stair = false;
  double operator()(std::int64_t t) const {
    double p = static_cast<double>(t) / static_cast<double>(decay_steps);
    if (is_stair) p = std::floor(p);
    return learning_rate * std::pow(decay_rate, p);
  }
};

// values[i] while t < milestones[i]; the last value after the last milestone.
struct PiecewiseConstantLR {
  std::vector<std::int64_t> milestones;
  std::vector<double> values;
  double operator()(std::int64_t t) const {
    for (std::size_t i = 0; i < milestones.size(); ++i) {
      if (t < milestones[i]) return values.at(i);
    }
    return values.back();
  }
};

// Rises linearly from 0 to lr over warmup_steps (MindSpore's WarmUpLR).
struct WarmUpLR {
  double learning_rate;
  std::int64_t warmup_steps;
  double operator()(std::int64_t t) const {
    return learning_rate * static_cast<double>(std::min(t + 1, warmup_steps)) / static_cast<double>(warmup_steps);
  }
};

// One kind of state an optimiser keeps per parameter ("moment1"): tensors[i] belongs to
// parameters()[i] and has its shape.
template <ElementType T>
struct OptimizerSlot {
  std::string_view name;
  std::vector<BasicTensor<T>>* tensors;
};

template <ElementType T>
class BasicOptimizer {
 public:
  BasicOptimizer(const std::vector<NamedParameter<T>>& params, LearningRate lr) : learning_rate_(std::move(lr)) {
    for (const auto& p : params) {
      if (p.parameter->requires_grad) params_.push_back(p.parameter);
    }
    if (params_.empty()) {
      throw ValueError(params.empty() ? std::string("optimizer: got no parameters; ") + detail::unregistered_members_hint
                                      : "optimizer: got " + std::to_string(params.size()) +
                                            " parameters, none with requires_grad, so there is nothing to train");
    }
  }
  BasicOptimizer(std::vector<BasicParameter<T>*> params, LearningRate lr)
      : params_(std::move(params)), learning_rate_(std::move(lr)) {
    if (params_.empty()) {
      throw ValueError(std::string("optimizer: got no parameters; ") + detail::unregistered_members_hint);
    }
  }
  BasicOptimizer(const BasicOptimizer&) = delete;
  BasicOptimizer& operator=(const BasicOptimizer&) = delete;
  virtual ~BasicOptimizer() = default;

  // Updates every parameter the calling thread's last backward pass reached.
  void step() {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    begin_step();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i]->has_grad_from(pass)) update(i, params_[i]->grad.data());
    }
    ++global_step_;
  }

  // MindSpore's optimizer(grads): one gradient per parameter, in order.
  void operator()(const std::vector<BasicTensor<T>>& grads) {
    if (grads.size() != params_.size()) {
      throw ValueError("optimizer: got " + std::to_string(grads.size()) + " gradients for " +
                       std::to_string(params_.size()) + " parameters");
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!(grads[i].shape() == params_[i]->shape())) {
        throw ShapeError("optimizer: gradient " + std::to_string(i) + " has shape " + to_string(grads[i].shape()) +
                         ", its parameter " + to_string(params_[i]->shape()));
      }
    }
    begin_step();
    for (std::size_t i = 0; i < params_.size(); ++i) update(i, grads[i].data());
    ++global_step_;
  }

  const std::vector<BasicParameter<T>*>& parameters() const { return params_; }
  std::int64_t global_step() const { return global_step_; }
  // The rate the next step uses.
  double learning_rate() const { return learning_rate_.at(global_step_); }

  // What the optimiser is, as checkpoints record it: "nn::Adam".
  virtual std::string_view type_name() const = 0;
  // Its state besides the step count, by kind (MindSpore names them "moment1", "moment2", ...).
  virtual std::vector<OptimizerSlot<T>> state() = 0;
  // Where a resumed run continues: the step count drives bias correction and schedules.
  void set_global_step(std::int64_t step) {
    if (step < 0) throw ValueError(std::string(type_name()) + ": global step " + std::to_string(step) + " is negative");
    global_step_ = step;
  }

 protected:
  // Computes what is shared by all parameters this step.
  virtual void begin_step() = 0;
  virtual void update(std::size_t i, const T* grad) = 0;

  // A zero state tensor per parameter (moments, momentum buffers).
  std::vector<BasicTensor<T>> zero_state() const {
    std::vector<BasicTensor<T>> state;
    state.reserve(params_.size());
    for (const auto* p : params_) state.emplace_back(p->shape());
    return state;
  }

  std::vector<BasicParameter<T>*> params_;
  LearningRate learning_rate_;
  std::int64_t global_step_ = 0;
};

struct SGDConfig {
  LearningRate learning_rate = 0.1;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

template <ElementType T = float, class Backend = DefaultBackend>
class BasicSGD final : public BasicOptimizer<T> {
 public:
  template <class Params>
  explicit BasicSGD(const Params& params, SGDConfig config = {})
      : BasicOptimizer<T>(params, config.learning_rate), config_(std::move(config)) {
    if (config_.momentum < 0 || config_.weight_decay < 0 || (config_.nesterov && config_.momentum <= 0)) {
      throw ValueError("nn::SGD: momentum and weight_decay must be >= 0, and nesterov needs momentum > 0");
    }
    if (config_.momentum > 0) momentum_ = this->zero_state();
  }

  std::string_view type_name() const override { return "nn::SGD"; }
  // Without momentum, SGD keeps nothing but the step count.
  std::vector<OptimizerSlot<T>> state() override {
    if (momentum_.empty()) return {};
    return {{"momentum", &momentum_}};
  }

 private:
  void begin_step() override {
    step_ = SgdStep{this->learning_rate(), config_.momentum, config_.dampening,
                    config_.weight_decay,  config_.nesterov, this->global_step_ == 0};
  }
  void update(std::size_t i, const T* grad) override {
    BasicParameter<T>& p = *this->params_[i];
    Backend::sgd_update(p.data(), grad, momentum_.empty() ? nullptr : momentum_[i].data(), p.numel(), step_);
  }

  SGDConfig config_;
  std::vector<BasicTensor<T>> momentum_;
  SgdStep step_{};
};

struct AdamConfig {
  LearningRate learning_rate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

template <ElementType T = float, bool Decoupled = false, class Backend = DefaultBackend>
class BasicAdam final : public BasicOptimizer<T> {
 public:
  template <class Params>
  explicit BasicAdam(const Params& params, AdamConfig config = default_config())
      : BasicOptimizer<T>(params, config.learning_rate),
        config_(std::move(config)),
        m_(this->zero_state()),
        v_(this->zero_state()) {
    if (!(config_.beta1 >= 0 && config_.beta1 < 1 && config_.beta2 >= 0 && config_.beta2 < 1 && config_.eps > 0 &&
          config_.weight_decay >= 0)) {
      throw ValueError(std::string(Decoupled ? "nn::AdamW" : "nn::Adam") +
                       ": needs 0 <= beta1, beta2 < 1, eps > 0 and weight_decay >= 0");
    }
  }

  // AdamW decays weights by default (0.01, as MindSpore's and PyTorch's AdamW); Adam does not.
  static AdamConfig default_config() {
    AdamConfig c;
    if (Decoupled) c.weight_decay = 0.01;
    return c;
  }

  std::string_view type_name() const override { return Decoupled ? "nn::AdamW" : "nn::Adam"; }
  std::vector<OptimizerSlot<T>> state() override { return {{"moment1", &m_}, {"moment2", &v_}}; }

 private:
  void begin_step() override {
    const auto t = static_cast<double>(this->global_step_ + 1);
    step_ = AdamStep{this->learning_rate(),
                     config_.beta1,
                     config_.beta2,
                     config_.eps,
                     config_.weight_decay,
                     Decoupled,
                     1 - std::pow(config_.beta1, t),
                     1 - std::pow(config_.beta2, t)};
  }
  void update(std::size_t i, const T* grad) override {
    BasicParameter<T>& p = *this->params_[i];
    Backend::adam_update(p.data(), grad, m_[i].data(), v_[i].data(), p.numel(), step_);
  }

  AdamConfig config_;
  std::vector<BasicTensor<T>> m_;
  std::vector<BasicTensor<T>> v_;
  AdamStep step_{};
};

using SGD = BasicSGD<float>;
using Adam = BasicAdam<float, false>;
using AdamW = BasicAdam<float, true>;

}  // namespace duet::nn

namespace duet {

// Elements are written and read as they lie in memory.
static_assert(std::endian::native == std::endian::little, "duet checkpoints need a little-endian machine");

// One tensor a checkpoint file holds, as checkpoint_info lists it.
struct CheckpointEntry {
  std::string name;
  DType dtype;
  Shape shape;
};

// What a checkpoint file holds (checkpoint_info): its parameters and, when it was saved with
// an optimiser, that optimiser's type, step and state tensors.
struct CheckpointInfo {
  std::uint32_t version = 0;
  std::vector<CheckpointEntry> parameters;
  std::string optimizer;  // "nn::Adam", or "" when the file holds no optimiser state
  std::int64_t global_step = 0;
  std::vector<CheckpointEntry> optimizer_state;
};

struct CheckpointLoadOptions {
  // All or nothing: every parameter of the cell, and nothing else, with its type and shape.
  // When false, loads the parameters whose name, type and shape match and reports the rest.
  bool strict = true;
};

// What a load left out, as MindSpore's load_param_into_net returns it: the cell's parameters
// that kept their values, and the file's parameters that were not used (another name, type or
// shape). A strict load either loads everything, returning two empty lists, or throws.
struct CheckpointLoad {
  std::vector<std::string> param_not_load;
  std::vector<std::string> ckpt_not_load;
};

namespace detail {

inline constexpr std::string_view checkpoint_magic = "DUETCKPT";
inline constexpr std::uint32_t checkpoint_version = 2;
// Magic, version, count; the checksum; each record's name length, type and rank; the
// optimiser section's name length, then its step and count when there is one.
inline constexpr std::uint64_t checkpoint_header_bytes = 8 + 4 + 4;
inline constexpr std::uint64_t checkpoint_optimizer_bytes = 4;
inline constexpr std::uint64_t checkpoint_optimizer_state_bytes = 8 + 4;
inline constexpr std::uint64_t checkpoint_checksum_bytes = 4;
inline constexpr std::uint64_t checkpoint_record_header_bytes = 4 + 1 + 1;

inline std::string checkpoint_where(const std::filesystem::path& path) { return "checkpoint '" + path.string() + "'"; }

inline std::string system_message() {
  const int error = errno;
  return std::generic_category().message(error);
}

// A name from a file, for a message: a hostile one may be megabytes long.
inline std::string shown_name(std::string_view name) {
  constexpr std::size_t most = 100;
  // Built by appending: GCC 12 warns falsely (-Wrestrict, PR105329) on "'" + std::string.
  return std::string("'").append(name.substr(0, most)).append(name.size() > most ? "...'" : "'");
}

// Writes a checkpoint to a temporary file beside its destination and renames it into place
// on commit, so the destination is always either the old file or the whole new one. The
// temporary file is removed if the writer is destroyed before commit.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(const std::filesystem::path& path) : path_(path), where_(checkpoint_where(path)) {
    if (!path.has_filename()) throw IOError(where_ + ": the path names no file");
    static std::atomic<unsigned long> serial{0};
    temp_ = path.parent_path() / ("." + path.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                                  std::to_string(serial.fetch_add(1)));
    // "x": never write into a file that happens to have that name.
    file_ = std::fopen(temp_.c_str(), "wbx");
    if (file_ == nullptr) throw IOError(where_ + ": cannot create '" + temp_.string() + "': " + system_message());
  }
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  ~CheckpointWriter() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) {
      std::error_code ignored;
      std::filesystem::remove(temp_, ignored);
    }
  }

  void bytes(std::span<const std::byte> b) {
    if (b.empty()) return;
    if (std::fwrite(b.data(), 1, b.size(), file_) != b.size()) {
      throw IOError(where_ + ": cannot write '" + temp_.string() + "': " + system_message());
    }
    crc_ = crc32_z(crc_, reinterpret_cast<const Bytef*>(b.data()), b.size());
  }
  void u8(std::uint8_t v) { bytes(std::array{std::byte{v}}); }
  void u32(std::uint32_t v) { little_endian<4>(v); }
  void i64(std::int64_t v) { little_endian<8>(static_cast<std::uint64_t>(v)); }

  // Appends the checksum, makes the file durable, and renames it over the destination.
  void commit() {
    u32(static_cast<std::uint32_t>(crc_));
    bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
    std::string why = ok ? "" : system_message();
    if (std::fclose(std::exchange(file_, nullptr)) != 0 && ok) {
      ok = false;
      why = system_message();
    }
    if (!ok) throw IOError(where_ + ": cannot write '" + temp_.string() + "': " + why);
    std::error_code error;
    std::filesystem::rename(temp_, path_, error);
    if (error) throw IOError(where_ + ": cannot rename '" + temp_.string() + "' into place: " + error.message());
    committed_ = true;
  }

 private:
  template <std::size_t N>
  void little_endian(std::uint64_t v) {
    std::array<std::byte, N> b;
    for (std::size_t i = 0; i < N; ++i) b[i] = static_cast<std::byte>(v >> (8 * i));
    bytes(b);
  }

  std::filesystem::path path_;
  std::filesystem::path temp_;
  std::string where_;
  std::FILE* file_ = nullptr;
  uLong crc_ = crc32_z(0, nullptr, 0);
  bool committed_ = false;
};

// A whole file. The buffer is sized by the file's size on disk, and grows with what arrives
// when that is unknown or the file grows meanwhile, so a file costs what it holds, whatever its
// fields claim.
inline std::vector<unsigned char> read_checkpoint_file(const std::filesystem::path& path) {
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  const std::unique_ptr<std::FILE, Closer> file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) throw IOError(checkpoint_where(path) + ": cannot open: " + system_message());
  std::error_code unknown;
  const auto size = static_cast<std::size_t>(std::filesystem::file_size(path, unknown));
  std::vector<unsigned char> bytes;
  for (;;) {
    const std::size_t have = bytes.size();
    // One byte more than the size, so that the first read already meets the end.
    const std::size_t grow = have == 0 && !unknown ? size + 1 : std::max<std::size_t>(have, 64 * 1024);
    bytes.resize(have + grow);
    const std::size_t got = std::fread(bytes.data() + have, 1, grow, file.get());
    bytes.resize(have + got);
    if (got < grow) {
      if (std::ferror(file.get()) != 0) throw IOError(checkpoint_where(path) + ": read failed: " + system_message());
      return bytes;
    }
  }
}

// One tensor as the file holds it; its elements are bytes [offset, offset + size) of the file.
struct CheckpointRecord {
  std::string_view name;
  DType dtype;
  Shape shape;
  std::size_t offset;
  std::size_t size;
};

// Reads the fields of a checkpoint whose checksum has been verified, so a field that does not
// fit is a file written wrong, not a damaged one.
class CheckpointParser {
 public:
  CheckpointParser(std::span<const unsigned char> bytes, const std::string& where) : bytes_(bytes), where_(where) {}

  std::size_t position() const { return pos_; }
  std::size_t remaining() const { return bytes_.size() - pos_; }

  std::span<const unsigned char> take(std::size_t n, const std::string& what) {
    if (n > remaining()) {
      throw FormatError(where_ + ": malformed: " + what + " at byte " + std::to_string(pos_) +
                        " runs past the parameters' end at byte " + std::to_string(bytes_.size()));
    }
    const auto out = bytes_.subspan(pos_, n);
    pos_ += n;
    return out;
  }
  std::uint64_t little_endian(std::size_t n, const std::string& what) {
    std::uint64_t v = 0;
    const auto b = take(n, what);
    for (std::size_t i = 0; i < n; ++i) v |= std::uint64_t{b[i]} << (8 * i);
    return v;
  }
  std::string_view text(std::size_t n, const std::string& what) {
    const auto b = take(n, what);
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }

  // `count` records; `noun` ("parameter", "optimizer state") names them in messages.
  std::vector<CheckpointRecord> records(std::uint32_t count, const std::string& noun) {
    // Not reserved from count: a hostile count must not size an allocation.
    std::vector<CheckpointRecord> out;
    std::unordered_set<std::string_view> seen;
    for (std::uint32_t i = 0; i < count; ++i) {
      out.push_back(record(i, noun));
      if (!seen.insert(out.back().name).second) {
        throw FormatError(where_ + ": " + noun + " " + shown_name(out.back().name) + " appears twice in the file");
      }
    }
    return out;
  }

 private:
  CheckpointRecord record(std::uint32_t index, const std::string& noun) {
    const std::string what = noun + " #" + std::to_string(index);
    const auto name_size = static_cast<std::size_t>(little_endian(4, what + "'s name length"));
    CheckpointRecord r{text(name_size, what + "'s name"), DType::float32, Shape{}, 0, 0};
    const std::string who = noun + " " + shown_name(r.name);
    const auto type = little_endian(1, who + "'s element type");
    if (type > static_cast<std::uint64_t>(DType::uint8)) {
      throw FormatError(where_ + ": malformed: " + who + " has element type " + std::to_string(type) +
                        ", which is no duet::DType");
    }
    r.dtype = static_cast<DType>(type);
    const auto rank = little_endian(1, who + "'s rank");
    if (rank > static_cast<std::uint64_t>(max_rank)) {
      throw FormatError(where_ + ": malformed: " + who + " has rank " + std::to_string(rank) + ", more than " +
                        std::to_string(max_rank));
    }
    // Saturates past what is left, so no product overflows and a zero dimension still gives 0.
    const std::uint64_t limit = remaining() / size_of(r.dtype);
    std::uint64_t numel = 1;
    for (std::uint64_t i = 0; i < rank; ++i) {
      const auto d = static_cast<std::int64_t>(little_endian(8, who + "'s dimension " + std::to_string(i)));
      if (d < 0) {
        throw FormatError(where_ + ": malformed: " + who + " has dimension " + std::to_string(i) + " = " +
                          std::to_string(d));
      }
      r.shape.push_back(d);
      const auto u = static_cast<std::uint64_t>(d);
      numel = (u == 0 || numel <= limit / u) ? numel * u : limit + 1;
    }
    if (numel > limit) {
      throw FormatError(where_ + ": malformed: " + who + "'s elements " + to_string(r.shape) +
                        " run past the parameters' end at byte " + std::to_string(bytes_.size()));
    }
    r.offset = pos_;
    r.size = static_cast<std::size_t>(numel) * size_of(r.dtype);
    take(r.size, who + "'s elements");
    return r;
  }

  std::span<const unsigned char> bytes_;
  std::string where_;
  std::size_t pos_ = 0;
};

// A checkpoint file's fields, which point into its bytes.
struct ParsedCheckpoint {
  std::uint32_t version = 0;
  std::vector<CheckpointRecord> parameters;
  std::string_view optimizer;  // empty when the file holds no optimiser state
  std::int64_t global_step = 0;
  std::vector<CheckpointRecord> optimizer_state;
};

// A checkpoint file, checked for everything but whether it fits a cell. `expected` is the
// size a checkpoint of the cell takes, for telling truncation from damage; 0 when there is
// no cell to compare with.
inline ParsedCheckpoint parse_checkpoint(std::span<const unsigned char> bytes, std::uint64_t expected,
                                         const std::string& where) {
  const std::size_t n = bytes.size();
  const std::size_t magic_seen = std::min<std::size_t>(n, checkpoint_magic.size());
  if (!std::equal(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(magic_seen), checkpoint_magic.begin())) {
    throw FormatError(where + ": not a duet checkpoint: it does not start with \"DUETCKPT\"");
  }
  const auto truncated = [&] {
    return FormatError(where + ": truncated at byte " + std::to_string(n) +
                       (expected == 0 ? std::string()
                                      : "; a checkpoint of this cell is " + std::to_string(expected) + " bytes"));
  };
  if (n < checkpoint_magic.size() + 4) throw truncated();
  ParsedCheckpoint file;
  CheckpointParser header(bytes, where);
  header.take(checkpoint_magic.size(), "the magic");
  const auto version = header.little_endian(4, "the version");
  if (version < 1 || version > checkpoint_version) {
    throw FormatError(where + ": format version " + std::to_string(version) + "; this duet reads versions 1 to " +
                      std::to_string(checkpoint_version));
  }
  file.version = static_cast<std::uint32_t>(version);
  if (n < checkpoint_header_bytes + checkpoint_checksum_bytes) throw truncated();

  const std::size_t body = n - checkpoint_checksum_bytes;
  CheckpointParser checksum(bytes.subspan(body), where);
  const auto stored = checksum.little_endian(4, "the checksum");
  if (stored != crc32_z(crc32_z(0, nullptr, 0), bytes.data(), body)) {
    // A cut file rarely ends in a valid checksum, so a short file that fails is taken as cut.
    if (n < expected) throw truncated();
    throw FormatError(where + ": checksum mismatch: the file is damaged" + (expected == 0 ? " or truncated" : ""));
  }

  CheckpointParser in(bytes.first(body), where);
  in.take(checkpoint_magic.size() + 4, "the header");
  file.parameters = in.records(static_cast<std::uint32_t>(in.little_endian(4, "the parameter count")), "parameter");
  if (file.version >= 2) {
    const auto name_size = static_cast<std::size_t>(in.little_endian(4, "the optimizer's type name length"));
    file.optimizer = in.text(name_size, "the optimizer's type name");
    if (!file.optimizer.empty()) {
      file.global_step = static_cast<std::int64_t>(in.little_endian(8, "the optimizer's global step"));
      if (file.global_step < 0) {
        throw FormatError(where + ": malformed: the optimizer's global step is " + std::to_string(file.global_step));
      }
      const auto count = static_cast<std::uint32_t>(in.little_endian(4, "the optimizer state count"));
      file.optimizer_state = in.records(count, "optimizer state");
    }
  }
  if (in.remaining() != 0) {
    throw FormatError(where + ": malformed: " + std::to_string(in.remaining()) + " unexpected bytes at byte " +
                      std::to_string(in.position()) + ", after the " +
                      (file.optimizer.empty() ? "parameters" : "optimizer state"));
  }
  return file;
}

inline std::vector<CheckpointEntry> entries_of(const std::vector<CheckpointRecord>& records) {
  std::vector<CheckpointEntry> out;
  out.reserve(records.size());
  for (const auto& r : records) out.push_back({std::string(r.name), r.dtype, r.shape});
  return out;
}

inline CheckpointInfo info_of(std::span<const unsigned char> bytes, const std::string& where) {
  const ParsedCheckpoint file = parse_checkpoint(bytes, 0, where);
  return {file.version, entries_of(file.parameters), std::string(file.optimizer), file.global_step,
          entries_of(file.optimizer_state)};
}

// A tensor a load fills, by the name the file gives it.
template <ElementType T>
struct CheckpointTarget {
  std::string name;
  BasicTensor<T>* tensor;
};

// The cell's parameters, which a checkpoint cannot do without: a cell with none has almost
// certainly not declared its members.
template <ElementType T>
std::vector<CheckpointTarget<T>> parameter_targets(nn::BasicDynamicCell<T>& cell, const std::string& where) {
  std::vector<CheckpointTarget<T>> out;
  for (auto& [name, p] : cell.parameters()) out.push_back({std::move(name), p});
  if (out.empty()) {
    throw ValueError(where + ": " + cell.type_name() + " has no parameters; " + nn::detail::unregistered_members_hint);
  }
  return out;
}

// The optimiser's state tensors, named "<slot>.<parameter's name>" after the cell's names for
// the parameters the optimiser updates.
template <ElementType T>
std::vector<CheckpointTarget<T>> optimizer_targets(const std::vector<CheckpointTarget<T>>& parameters,
                                                   nn::BasicOptimizer<T>& optimizer, const std::string& where) {
  std::unordered_map<const BasicTensor<T>*, std::string_view> names;
  for (const auto& p : parameters) names.emplace(p.tensor, p.name);
  const auto& updated = optimizer.parameters();
  std::vector<std::string_view> updated_names;
  for (std::size_t i = 0; i < updated.size(); ++i) {
    const auto found = names.find(updated[i]);
    if (found == names.end()) {
      throw ValueError(where + ": the " + std::string(optimizer.type_name()) + "'s parameter #" + std::to_string(i) +
                       ", of shape " + to_string(updated[i]->shape()) +
                       ", is not a parameter of the cell, so its state has no name to go by");
    }
    updated_names.push_back(found->second);
  }
  std::vector<CheckpointTarget<T>> out;
  for (const auto& slot : optimizer.state()) {
    for (std::size_t i = 0; i < updated.size(); ++i) {
      out.push_back({std::string(slot.name).append(".").append(updated_names[i]), &(*slot.tensors)[i]});
    }
  }
  return out;
}

template <ElementType T>
std::uint64_t records_size(const std::vector<CheckpointTarget<T>>& targets) {
  std::uint64_t size = 0;
  for (const auto& [name, t] : targets) {
    size += checkpoint_record_header_bytes + name.size() + 8 * std::uint64_t(t->ndim()) +
            std::uint64_t(t->numel()) * sizeof(T);
  }
  return size;
}

// The size of a checkpoint of these tensors: a shorter file that fails its checksum is taken
// as cut.
template <ElementType T>
std::uint64_t checkpoint_size(const std::vector<CheckpointTarget<T>>& parameters, std::string_view optimizer = {},
                              const std::vector<CheckpointTarget<T>>& state = {}) {
  return checkpoint_header_bytes + records_size(parameters) + checkpoint_optimizer_bytes +
         (optimizer.empty() ? 0 : optimizer.size() + checkpoint_optimizer_state_bytes + records_size(state)) +
         checkpoint_checksum_bytes;
}

template <ElementType T>
void write_records(CheckpointWriter& out, const std::vector<CheckpointTarget<T>>& targets) {
  out.u32(static_cast<std::uint32_t>(targets.size()));
  for (const auto& [name, t] : targets) {
    out.u32(static_cast<std::uint32_t>(name.size()));
    out.bytes(std::as_bytes(std::span(name)));
    out.u8(static_cast<std::uint8_t>(t->dtype()));
    out.u8(static_cast<std::uint8_t>(t->ndim()));
    for (index_t d : t->shape()) out.i64(d);
    out.bytes(std::as_bytes(std::span<const T>(t->data(), static_cast<std::size_t>(t->numel()))));
  }
}

template <ElementType T>
void write_checkpoint(const std::filesystem::path& path, const std::vector<CheckpointTarget<T>>& parameters,
                      std::string_view optimizer = {}, std::int64_t global_step = 0,
                      const std::vector<CheckpointTarget<T>>& state = {}) {
  CheckpointWriter out(path);
  out.bytes(std::as_bytes(std::span(checkpoint_magic)));
  out.u32(checkpoint_version);
  write_records(out, parameters);
  out.u32(static_cast<std::uint32_t>(optimizer.size()));
  if (!optimizer.empty()) {
    out.bytes(std::as_bytes(std::span(optimizer)));
    out.i64(global_step);
    write_records(out, state);
  }
  out.commit();
}

// Names for a message, the first few of them: a hostile file may hold millions.
inline std::string name_list(const std::vector<std::string_view>& names) {
  constexpr std::size_t most = 10;
  std::string out;
  for (std::size_t i = 0; i < std::min(names.size(), most); ++i) out += (i == 0 ? "" : ", ") + shown_name(names[i]);
  if (names.size() > most) out += " and " + std::to_string(names.size() - most) + " more";
  return out;
}

// How messages call the tensors matched and what holds them: "parameter", "the cell".
struct MatchWords {
  std::string noun;
  std::string holder;
};

// For each target, the record of its name, type and shape, or nullptr. A strict match throws
// on the first difference of type or shape, then on names in the file or the holder only;
// otherwise the names not matched go to `unmatched`.
template <ElementType T>
std::vector<const CheckpointRecord*> match_records(const std::vector<CheckpointRecord>& records,
                                                   const std::vector<CheckpointTarget<T>>& targets,
                                                   const MatchWords& words, const std::string& where,
                                                   CheckpointLoad* unmatched) {
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < targets.size(); ++i) index.emplace(targets[i].name, i);
  std::vector<const CheckpointRecord*> source(targets.size(), nullptr);
  std::vector<std::string_view> unknown;
  for (const auto& r : records) {
    const auto found = index.find(r.name);
    if (found == index.end()) {
      unknown.push_back(r.name);
      continue;
    }
    const auto& [name, t] = targets[found->second];
    std::string difference;
    if (r.dtype != t->dtype()) {
      difference = " is " + std::string(name_of(t->dtype())) + " in " + words.holder + " but " +
                   std::string(name_of(r.dtype)) + " in the file";
    } else if (!(r.shape == t->shape())) {
      difference = " has shape " + to_string(t->shape()) + " in " + words.holder + " but " + to_string(r.shape) +
                   " in the file";
    }
    if (difference.empty()) {
      source[found->second] = &r;
    } else if (unmatched == nullptr) {
      throw FormatError(where + ": " + words.noun + " '" + name + "'" + difference);
    } else {
      unknown.push_back(r.name);
    }
  }
  std::vector<std::string_view> missing;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (source[i] == nullptr) missing.push_back(targets[i].name);
  }
  if (unmatched != nullptr) {
    for (const auto name : missing) unmatched->param_not_load.emplace_back(name);
    for (const auto name : unknown) unmatched->ckpt_not_load.emplace_back(name);
  } else if (!unknown.empty() || !missing.empty()) {
    std::string message = where + ": ";
    if (!unknown.empty()) {
      message += "the file's " + words.noun + "(s) " + name_list(unknown) + " are not in " + words.holder;
    }
    if (!missing.empty()) {
      message += std::string(unknown.empty() ? "" : ", and ") + "the file has no value for " + words.holder + "'s " +
                 words.noun + "(s) " + name_list(missing);
    }
    throw FormatError(message);
  }
  return source;
}

template <ElementType T>
void copy_records(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& targets,
                  const std::vector<const CheckpointRecord*>& source) {
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (source[i] == nullptr) continue;
    std::copy_n(bytes.begin() + static_cast<std::ptrdiff_t>(source[i]->offset), source[i]->size,
                reinterpret_cast<unsigned char*>(targets[i].tensor->data()));
  }
}

inline const MatchWords parameter_words{"parameter", "the cell"};

// load_checkpoint and load_checkpoint_bytes: checks the whole file, then copies what matches.
template <ElementType T>
CheckpointLoad load_parameters(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& parameters,
                               const CheckpointLoadOptions& options, const std::string& where) {
  // A file that need not fit the cell says nothing by its size.
  const ParsedCheckpoint file = parse_checkpoint(bytes, options.strict ? checkpoint_size(parameters) : 0, where);
  CheckpointLoad unmatched;
  const auto source =
      match_records(file.parameters, parameters, parameter_words, where, options.strict ? nullptr : &unmatched);
  copy_records(bytes, parameters, source);
  return unmatched;
}

// The same with the optimiser's state, which must match as strictly as the parameters.
template <ElementType T>
void load_training_state(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& parameters,
                         nn::BasicOptimizer<T>& optimizer, const std::vector<CheckpointTarget<T>>& state,
                         const std::string& where) {
  const std::string_view type = optimizer.type_name();
  const ParsedCheckpoint file = parse_checkpoint(bytes, checkpoint_size(parameters, type, state), where);
  const auto parameter_source = match_records(file.parameters, parameters, parameter_words, where, nullptr);
  if (file.optimizer.empty()) {
    throw FormatError(where + ": holds no optimizer state" +
                      (file.version < 2 ? " (it is format version 1, which cannot)"
                                        : " (it was saved without an optimizer)") +
                      ", so the " + std::string(type) + " cannot resume from it");
  }
  if (file.optimizer != type) {
    throw FormatError(where + ": holds the state of an optimizer " + shown_name(file.optimizer) + ", not of an " +
                      std::string(type));
  }
  const auto state_source =
      match_records(file.optimizer_state, state, {"optimizer state", "the " + std::string(type)}, where, nullptr);
  copy_records(bytes, parameters, parameter_source);
  copy_records(bytes, state, state_source);
  optimizer.set_global_step(file.global_step);
}

inline std::span<const unsigned char> unsigned_bytes(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()};
}

inline const std::string checkpoint_data_where = "checkpoint data";

}  // namespace detail

// Writes every parameter of cell (and the cells below it) to path, atomically: on any failure
// path keeps its previous contents. A cell without parameters is a ValueError.
template <ElementType T>
void save_checkpoint(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path) {
  detail::write_checkpoint(path, detail::parameter_targets(cell, detail::checkpoint_where(path)));
}

// The same, with the state of the optimiser that trains cell (its type, step count and, per
// parameter, its moments or momentum, named by the cell's parameter names), so that
// load_checkpoint(path, net, optimizer) resumes training where it stopped, in a new process
// too. Every parameter the optimiser updates must be one of cell's (a ValueError otherwise).
template <ElementType T>
void save_checkpoint(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path,
                     nn::BasicOptimizer<T>& optimizer) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  detail::write_checkpoint(path, parameters, optimizer.type_name(), optimizer.global_step(),
                           detail::optimizer_targets(parameters, optimizer, where));
}

// Reads a checkpoint into cell's parameters. Strict (the default): the file must hold
// exactly the cell's parameters, by name, with their element types and shapes; the first
// difference is a duet::FormatError naming the parameter and both shapes or types, or the
// names only the file or only the cell has. Not strict ({.strict = false}): loads the
// parameters that match and returns the names of the others (a strict load returns empty
// lists). Either way the whole file is checked (checksum, fields) before anything is copied:
// on any error (FormatError, or IOError when the file cannot be read) the cell is left as it
// was. Optimiser state in the file is not needed and not used.
template <ElementType T>
CheckpointLoad load_checkpoint(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell,
                               CheckpointLoadOptions options = {}) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  return detail::load_parameters(std::span<const unsigned char>(detail::read_checkpoint_file(path)), parameters,
                                 options, where);
}

// Reads a checkpoint saved with an optimiser into cell and optimizer, strictly: parameters,
// optimiser type (nn::Adam is not nn::AdamW) and every state tensor must match, or a
// FormatError names the difference and nothing changes. The optimiser's hyper-parameters
// (learning rate or schedule, betas, momentum) are its own, not the file's; its step count
// comes from the file, so a schedule goes on from where it was.
template <ElementType T>
void load_checkpoint(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell,
                     nn::BasicOptimizer<T>& optimizer) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  const auto state = detail::optimizer_targets(parameters, optimizer, where);
  detail::load_training_state(std::span<const unsigned char>(detail::read_checkpoint_file(path)), parameters,
                              optimizer, state, where);
}

// The same for the bytes of a checkpoint already in memory.
template <ElementType T>
CheckpointLoad load_checkpoint_bytes(std::span<const std::byte> bytes, nn::BasicDynamicCell<T>& cell,
                                     CheckpointLoadOptions options = {}) {
  const auto& where = detail::checkpoint_data_where;
  return detail::load_parameters(detail::unsigned_bytes(bytes), detail::parameter_targets(cell, where), options,
                                 where);
}

template <ElementType T>
void load_checkpoint_bytes(std::span<const std::byte> bytes, nn::BasicDynamicCell<T>& cell,
                           nn::BasicOptimizer<T>& optimizer) {
  const auto& where = detail::checkpoint_data_where;
  const auto parameters = detail::parameter_targets(cell, where);
  const auto state = detail::optimizer_targets(parameters, optimizer, where);
  detail::load_training_state(detail::unsigned_bytes(bytes), parameters, optimizer, state, where);
}

// What a checkpoint file holds, checked as a load checks it (checksum, every field), with no
// cell needed: a FormatError or IOError otherwise.
inline CheckpointInfo checkpoint_info(const std::filesystem::path& path) {
  return detail::info_of(detail::read_checkpoint_file(path), detail::checkpoint_where(path));
}

inline CheckpointInfo checkpoint_info_bytes(std::span<const std::byte> bytes) {
  return detail::info_of(detail::unsigned_bytes(bytes), detail::checkpoint_data_where);
}

}  // namespace duet
// Activation layers and the elementwise functions behind them.
//
// An elementwise function is a type with a name and an Eigen array form. The same type is a
// graph node of its own (ops::MapOp<Fn>, what PyNative runs) or, after fuse_epilogues, a
// step in a product's epilogue: the function is written once and used both ways.

#include <array>
#include <string>
#include <string_view>
#include <utility>


namespace duet {

namespace fn {

struct Relu {
  static constexpr std::string_view name = "ReLU";
  // NaN stays NaN, as IEEE and numpy's maximum say; a plain max(x, 0) would turn it into 0.
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    return a.binaryExpr(A::Constant(a.rows(), a.cols(), S(0)),
                        ::Eigen::internal::scalar_max_op<S, S, ::Eigen::PropagateNaN>());
  }
  // The same on one value or one SIMD vector, for kernels that apply it in registers. NaN
  // compares false, so it passes through. In place, by reference: a kernel compiled for
  // AVX-512 hands over its vector without passing a 64-byte value into code compiled for
  // another instruction set, which has another calling convention (-Wpsabi).
  template <class V>
  static void apply_in_place(V& v) {
    v = v < V{} ? V{} : v;
  }
  template <class V>
  static V apply(V v) {
    apply_in_place(v);
    return v;
  }
  // dy · relu'(x), from y = relu(x): zero where y <= 0. A NaN output passes dy through, as
  // PyTorch does, so a NaN is not silently hidden from the gradient.
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return (y <= S(0)).select(Y::Constant(y.rows(), y.cols(), S(0)), dy);
  }
};

}  // namespace fn

namespace ops {

template <class Fn>
struct MapGradOp;

// Fns applied elementwise, in order, in one pass. Capture makes one per function; O1 fuses
// chains (relu(tanh(x)) is one MapOp<Tanh, Relu>), and products absorb them as epilogues.
template <class... Fns>
struct MapOp {
  static_assert(sizeof...(Fns) >= 1);
  using layer_type = MapOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::template map<Fns...>(a.in<T>(), a.in_shape().numel(), a.out<T>());
  }

  template <class C>
  static constexpr bool accepts_epilogue = requires { C::elementwise_functions; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>&) const {
    return MapOp<Fns..., Gs...>{};
  }
  static constexpr auto elementwise_functions = sizeof...(Fns);

  // A single function is differentiated from its output; a fused chain would need the values
  // between its functions, which it never stores.
  static constexpr bool differentiable = sizeof...(Fns) == 1;
  static constexpr bool has_parameters = false;
  static constexpr std::array grad_operands{graph::Operand::grad, graph::Operand::output};
  template <bool InputGrad>
  auto grad_op() const {
    return MapGradOp<Fns...>{};
  }

  static std::string op_name() {
    std::string s;
    ((s += (s.empty() ? "" : " + ") + std::string(Fns::name)), ...);
    return s;
  }
  std::string label() const { return op_name(); }
};

// dx = dy · Fn'(x), from dy and the forward output y.
template <class Fn>
struct MapGradOp {
  using layer_type = MapGradOp;
  static constexpr int arity = 2;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::template map_grad<Fn>(a.in<T>(0), a.in<T>(1), a.in_shape().numel(), a.out<T>());
  }

  static std::string op_name() { return std::string(Fn::name) + "Grad"; }
  std::string label() const { return op_name(); }
};

template <class X>
auto relu(X&& x) {
  return apply(MapOp<fn::Relu>{}, std::forward<X>(x));
}

}  // namespace ops

namespace nn {

// max(x, 0), elementwise (MindSpore's nn.ReLU).
template <ElementType T>
class BasicReLU : public Cell<BasicReLU<T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return ops::relu(std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::ReLU"; }
};

using ReLU = BasicReLU<float>;

}  // namespace nn
}  // namespace duet
// Containers: cells that run other cells in order.

#include <boost/hana/at.hpp>
#include <boost/hana/fold_left.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/tuple.hpp>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace duet::nn {

// A fixed list of cells, each fed the previous one's output (MindSpore's nn.SequentialCell).
// The list is a hana::tuple: in graph mode the whole chain becomes one flat graph.
template <class First, class... Rest>
class SequentialCell : public Cell<SequentialCell<First, Rest...>, CONTEXT_MODE, typename First::value_type> {
  using T = typename First::value_type;
  static_assert((std::is_same_v<typename Rest::value_type, T> && ...),
                "nn::SequentialCell: all cells must have the same element type");

 public:
  SequentialCell() { check_neighbours(); }
  explicit SequentialCell(First first, Rest... rest) : cells_(std::move(first), std::move(rest)...) {
    check_neighbours();
  }

  static constexpr std::size_t size() { return 1 + sizeof...(Rest); }

  template <std::size_t I>
  auto& get() {
    return boost::hana::at_c<I>(cells_);
  }

  // A chain whose neighbours do not fit is reported once, by the constructor; captured into a
  // graph, it is captured quietly so that no other shape of its input reports it again.
  template <class X>
  auto construct(X&& x) {
    if constexpr (graph::Symbolic<X> && !neighbours_fit())
      return graph::quietly(x, [this](const auto& q) { return chain(q); });
    else
      return chain(std::forward<X>(x));
  }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    std::size_t i = 0;
    boost::hana::for_each(cells_, [&](auto& cell) { visit(std::to_string(i++), cell); });
  }

  std::string type_name() const override { return "nn::SequentialCell"; }

 private:
  template <class X>
  auto chain(X&& x) {
    return boost::hana::fold_left(cells_, std::forward<X>(x),
                                  [](auto&& acc, auto& cell) { return cell(std::forward<decltype(acc)>(acc)); });
  }

  // Capturing the chain on an input of unknown shape runs every layer's shape rule against
  // its neighbour's output. Captured quietly and reported from here, incompatible neighbours
  // fail to compile in either mode with a diagnostic that does not reach into the capture.
  static constexpr auto neighbour_rejection() {
    using Probe = decltype(std::declval<SequentialCell&>().chain(graph::input<T, graph::Quiet<graph::AnyShape>>()));
    return std::type_identity<graph::first_rejection<typename Probe::graph_type>>{};
  }
  static constexpr bool neighbours_fit() { return std::is_void_v<typename decltype(neighbour_rejection())::type>; }
  static void check_neighbours() {
    if constexpr (!neighbours_fit()) static_cast<void>(sizeof(typename decltype(neighbour_rejection())::type));
  }

  boost::hana::tuple<First, Rest...> cells_;
};

// A list of cells built at run time (sizes and layers from a config file, say). Its structure is
// not known when the program compiles, so graph mode cannot capture it: it traces it on the
// first call instead (PIJit) and replays the trace, and traces again after an append.
template <ElementType T>
class BasicDynamicSequentialCell : public BasicDynamicCell<T> {
 public:
  BasicDynamicSequentialCell() = default;

  // Adds a cell at the end, taking ownership; returns it.
  template <class C>
  requires std::is_base_of_v<BasicDynamicCell<T>, C> C& append(C cell) {
    auto owned = std::make_unique<C>(std::move(cell));
    C& ref = *owned;
    cells_.push_back(std::move(owned));
    this->structure_changed();
    return ref;
  }
  BasicDynamicCell<T>& append(std::unique_ptr<BasicDynamicCell<T>> cell) {
    cells_.push_back(std::move(cell));
    this->structure_changed();
    return *cells_.back();
  }

  std::size_t size() const { return cells_.size(); }
  BasicDynamicCell<T>& operator[](std::size_t i) {
    if (i >= cells_.size()) {
      throw IndexError("nn::DynamicSequentialCell: index " + std::to_string(i) + " is out of range for " +
                       std::to_string(cells_.size()) + " cells");
    }
    return *cells_[i];
  }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    for (std::size_t i = 0; i < cells_.size(); ++i) visit(std::to_string(i), *cells_[i]);
  }

  std::string type_name() const override { return "nn::DynamicSequentialCell"; }

 protected:
  BasicTensor<T> forward(const BasicTensor<T>& x) override {
    BasicTensor<T> y = x;
    for (auto& cell : cells_) y = (*cell)(y);
    return y;
  }

 private:
  std::vector<std::unique_ptr<BasicDynamicCell<T>>> cells_;
};

using DynamicSequentialCell = BasicDynamicSequentialCell<float>;

}  // namespace duet::nn
// Fully connected layers: nn::Dense and the operations it captures as (MatMul, BiasAdd).

#include <cmath>
#include <string>
#include <type_traits>
#include <utility>


namespace duet {
namespace ops {

template <class Layer>
struct BiasAddOp;
template <class Layer, bool Bias, class... Fns>
struct PackedMatMulOp;
template <class Layer, bool Bias, bool InputGrad, class... Fns>
struct DenseGradOp;
template <class Layer, bool InputGrad>
struct BiasAddGradOp;

// x · Wᵀ over the last axis of x, then the epilogue: the bias if Bias, then each Fn. Capture
// makes it with an empty epilogue; fuse_epilogues grows it.
template <class Layer, bool Bias = false, class... Fns>
struct MatMulOp {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  const Layer* layer;

  static constexpr ShapeResult rule(index_t in, index_t out, const Shape& x) {
    Shape y = x;
    if (x.rank() == 0) {
      y.push_back(out);
      return x.leading_unknown() ? ShapeResult{y} : fault(y, ShapeFault::min_rank, 1);
    }
    y = x.with_back(out);
    if (in != dyn && x.back() != dyn && x.back() != in) return fault(y, ShapeFault::last_dimension, in);
    return {y};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return rule(Layer::in_static, Layer::out_static, in[0]);
  }
  ShapeResult infer(std::span<const Shape> in) const {
    return rule(layer->in_channels(), layer->out_channels(), in[0]);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    product<Backend, T, false>(a);
  }

  // The same product with the weight kept pre-packed between calls (JitLevel::O2).
  auto with_packed_weight() const { return PackedMatMulOp<Layer, Bias, Fns...>{{layer}}; }

  // Takes this layer's bias first, then any elementwise functions.
  template <class C>
  static constexpr bool accepts_epilogue =
      (std::is_same_v<C, BiasAddOp<Layer>> && !Bias && sizeof...(Fns) == 0) || requires { C::elementwise_functions; };
  auto absorb(const BiasAddOp<Layer>&) const { return MatMulOp<Layer, true, Fns...>{layer}; }
  template <class... Gs>
  auto absorb(const MapOp<Gs...>&) const {
    return MatMulOp<Layer, Bias, Fns..., Gs...>{layer};
  }

  // Its gradient op reads the forward output only to differentiate an activation epilogue,
  // and can do so for one function.
  static constexpr bool differentiable = sizeof...(Fns) <= 1;
  static constexpr bool has_parameters = true;
  static constexpr auto grad_operands = [] {
    if constexpr (sizeof...(Fns) == 0)
      return std::array{graph::Operand::grad, graph::Operand::input0};
    else
      return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
  }();
  template <bool InputGrad>
  auto grad_op() const {
    return DenseGradOp<Layer, Bias, InputGrad, Fns...>{layer};
  }

  static std::string op_name() { return with_epilogue("MatMul"); }
  std::string label() const { return layer->label(); }

 protected:
  static std::string with_epilogue(std::string s) {
    if (Bias) s += " + BiasAdd";
    ((s += " + " + std::string(Fns::name)), ...);
    return s;
  }

  template <class Backend, class T, bool PackedWeight>
  void product(const graph::KernelArgs& a) const {
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : a.in_shape().numel() / in_channels;
    const Epilogue<T, Fns...> epilogue{Bias ? layer->bias.data() : nullptr};
    constexpr index_t In = Layer::in_static;
    constexpr index_t Out = Layer::out_static;
    if constexpr (PackedWeight) {
      Backend::template dense_packed<In, Out>(a.in<T>(), rows, in_channels, layer->weight, layer->out_channels(),
                                              epilogue, a.out<T>());
    } else {
      Backend::template dense<In, Out>(a.in<T>(), rows, in_channels, layer->weight.data(), layer->out_channels(),
                                       epilogue, a.out<T>());
    }
  }
};

// MatMulOp whose weight the backend keeps packed from call to call, repacking it only after
// the weight is written: what a layer that runs many times between updates wants. The result
// is bit for bit MatMulOp's.
template <class Layer, bool Bias, class... Fns>
struct PackedMatMulOp : MatMulOp<Layer, Bias, Fns...> {
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    this->template product<Backend, T, true>(a);
  }

  static std::string op_name() { return MatMulOp<Layer, Bias, Fns...>::with_epilogue("PackedMatMul"); }
};

// x + bias over the last axis, bias being the layer's.
template <class Layer>
struct BiasAddOp {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = true;

  const Layer* layer;

  static constexpr ShapeResult rule(index_t out, const Shape& x) {
    if (x.rank() > 0 && out != dyn && x.back() != dyn && x.back() != out) {
      return fault(x, ShapeFault::last_dimension, out);
    }
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::out_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->out_channels(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const index_t cols = layer->out_channels();
    Backend::add_bias(a.in<T>(), cols == 0 ? 0 : a.in_shape().numel() / cols, cols, layer->bias.data(), a.out<T>());
  }

  static constexpr bool has_parameters = true;
  static constexpr std::array grad_operands{graph::Operand::grad};
  template <bool InputGrad>
  auto grad_op() const {
    return BiasAddGradOp<Layer, InputGrad>{layer};
  }

  static std::string op_name() { return "BiasAdd"; }
  std::string label() const { return layer->label(); }
};

// The gradient of MatMulOp<Layer, Bias, Fns...>: from dy (and y, when Fns need it) it makes
// dW, db and, if InputGrad, dx. The activation mask and the bias sum are taken in the same
// kernel as the products, as the forward fused them.
template <class Layer, bool Bias, bool InputGrad, class... Fns>
struct DenseGradOp {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = sizeof...(Fns) == 0 ? 2 : 3;  // dy, x[, y]
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    bool accumulate_w = false;
    bool accumulate_b = false;
    T* dw = layer->weight.grad_for_write(pass, &accumulate_w);
    T* db = Bias ? layer->bias.grad_for_write(pass, &accumulate_b) : nullptr;
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : a.in_shape(1).numel() / in_channels;
    Backend::template dense_backward<Layer::in_static, Layer::out_static, T, Fns...>(DenseBackwardArgs<T>{
        a.in<T>(0), a.in<T>(1), sizeof...(Fns) == 0 ? nullptr : a.in<T>(2), rows, in_channels, layer->weight.data(),
        layer->out_channels(), InputGrad ? a.out<T>() : nullptr, dw, accumulate_w, db, accumulate_b});
  }

  static std::string op_name() {
    std::string s = "MatMulGrad";
    if (Bias) s += " + BiasGrad";
    ((s += " + " + std::string(Fns::name) + "Grad"), ...);
    if (!InputGrad) s += " (parameters only)";
    return s;
  }
  std::string label() const { return layer->label(); }
};

// The gradient of BiasAddOp: db is the column sum of dy, and dx is dy itself (a view).
template <class Layer, bool InputGrad>
struct BiasAddGradOp {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_view = InputGrad;
  static constexpr bool has_side_effects = true;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[0] : Shape{}}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    bool accumulate = false;
    T* db = layer->bias.grad_for_write(duet::detail::current_backward_pass(), &accumulate);
    const index_t cols = layer->out_channels();
    Backend::bias_grad(a.in<T>(), cols == 0 ? 0 : a.in_shape().numel() / cols, cols, db, accumulate);
  }

  static std::string op_name() { return InputGrad ? "BiasAddGrad" : "BiasAddGrad (parameters only)"; }
  std::string label() const { return layer->label(); }
};

}  // namespace ops

namespace nn {

// y = x · weightᵀ + bias over the last axis of x (MindSpore's nn.Dense). In and Out are
// compile-time sizes, or duet::dyn for sizes given to the constructor at run time.
template <index_t In = dyn, index_t Out = dyn, ElementType T = float>
class Dense : public Cell<Dense<In, Out, T>, CONTEXT_MODE, T> {
  static_assert(In == dyn || In > 0, "nn::Dense<In, Out>: In must be positive (or duet::dyn)");
  static_assert(Out == dyn || Out > 0, "nn::Dense<In, Out>: Out must be positive (or duet::dyn)");

 public:
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;

  BasicParameter<T> weight;  // [out_channels, in_channels]
  BasicParameter<T> bias;    // [out_channels]
  DUET_CELL_MEMBERS(weight, bias);

  Dense() requires(In != dyn && Out != dyn) : Dense(In, Out) {}

  // MindSpore 2.x's default initialisation, from the global generator (set_seed): weight
  // HeUniform(a = sqrt(5)), which is U(-1/sqrt(in), 1/sqrt(in)); bias U(-1/sqrt(in), 1/sqrt(in)).
  Dense(index_t in_channels, index_t out_channels) : in_(in_channels), out_(out_channels) {
    if ((In != dyn && in_channels != In) || (Out != dyn && out_channels != Out) || in_channels <= 0 ||
        out_channels <= 0) {
      throw ValueError(type_name() + ": cannot be built with in_channels " + std::to_string(in_channels) +
                       " and out_channels " + std::to_string(out_channels));
    }
    const T bound = T(1) / std::sqrt(static_cast<T>(in_channels));
    with_global_generator([&](Generator& gen) {
      weight = BasicParameter<T>(uniform<T>({out_channels, in_channels}, -bound, bound, gen));
      bias = BasicParameter<T>(uniform<T>({out_channels}, -bound, bound, gen));
    });
  }

  index_t in_channels() const {
    if constexpr (In != dyn)
      return In;
    else
      return in_;
  }
  index_t out_channels() const {
    if constexpr (Out != dyn)
      return Out;
    else
      return out_;
  }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::BiasAddOp<Dense>{this}, apply(ops::MatMulOp<Dense>{this}, std::forward<X>(x)));
  }

  std::string type_name() const override {
    std::string s = "nn::Dense<" + size_name(In) + ", " + size_name(Out);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  static std::string size_name(index_t n) { return n == dyn ? "dyn" : std::to_string(n); }

  index_t in_;
  index_t out_;
};

}  // namespace nn
}  // namespace duet
// Reshaping layers. They move no data: in both modes their output is a view of their input.

#include <array>
#include <string>
#include <utility>


namespace duet {
namespace ops {

// The gradient of a reshape: dy viewed with the shape of the forward input.
struct ReshapeLikeOp {
  using layer_type = ReshapeLikeOp;
  static constexpr int arity = 2;  // dy, the forward input (for its shape)
  static constexpr bool is_view = true;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  static std::string op_name() { return "ReshapeLike"; }
  std::string label() const { return op_name(); }
};

// [N, d1, d2, ...] -> [N, d1 * d2 * ...].
struct FlattenOp {
  using layer_type = FlattenOp;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    if (x.leading_unknown()) return {Shape{dyn, dyn}};
    // A rank-1 input is one sample without its batch dimension; flattening it as a batch of
    // one-element samples would only surface, puzzlingly, at the next layer.
    if (x.rank() < 2) return fault(Shape{1, x.numel()}, ShapeFault::batch_dimension, 2);
    return {Shape{x[0], x.numel_from(1)}};
  }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  static constexpr bool has_parameters = false;
  static constexpr std::array grad_operands{graph::Operand::grad, graph::Operand::input0};
  template <bool InputGrad>
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Flatten"; }
  std::string label() const { return "nn::Flatten"; }
};

template <class X>
auto flatten(X&& x) {
  return apply(FlattenOp{}, std::forward<X>(x));
}

}  // namespace ops

namespace nn {

// Keeps the first (batch) axis and merges the rest (MindSpore's nn.Flatten).
template <ElementType T>
class BasicFlatten : public Cell<BasicFlatten<T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return ops::flatten(std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::Flatten"; }
};

using Flatten = BasicFlatten<float>;

}  // namespace nn
}  // namespace duet
// Losses: cells of two inputs (prediction, target) that reduce to what training minimises.

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>


namespace duet {
namespace nn {

using duet::Reduction;

// MindSpore's arguments, in its order, as template arguments: they change the graph's types.
// Sparse: labels are int32 class indices rather than distributions. Both default as in MindSpore.
template <bool Sparse, Reduction R, ElementType T>
class BasicSoftmaxCrossEntropyWithLogits;

template <Reduction R, ElementType T>
class BasicMSELoss;

}  // namespace nn

namespace ops {

template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyGradOp;

// The reduced shape of a loss over per-row (or per-element) values of shape `rows`.
constexpr Shape reduced(const Shape& rows, Reduction r) { return r == Reduction::none ? rows : Shape{}; }

// Logits [..., classes] and labels [...] (sparse) or [..., classes]; the loss per row, or its
// mean or sum.
template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyOp {
  using layer_type = nn::BasicSoftmaxCrossEntropyWithLogits<Sparse, R, float>;
  static constexpr int arity = 2;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& z = in[0];
    const Shape& labels = in[1];
    Shape rows = z;
    if (z.leading_unknown()) return {R == Reduction::none ? Shape::any() : Shape{}};
    if (z.rank() == 0) return fault(Shape{}, ShapeFault::min_rank, 1);
    if (z.back() == 0) return fault(Shape{}, ShapeFault::last_dimension, 1);
    rows = Shape();
    for (int i = 0; i + 1 < z.rank(); ++i) rows.push_back(z[i]);
    const Shape& expected = Sparse ? rows : z;
    if (!labels.leading_unknown() && labels.is_concrete() && expected.is_concrete() && !(labels == expected)) {
      return fault(reduced(rows, R), ShapeFault::shapes_differ, 0, 1);
    }
    return {reduced(rows, R)};
  }
  ShapeResult infer(std::span<const Shape> in) const {
    const ShapeResult r = infer_static(in);
    if (!r.ok()) return r;
    // At run time every size is known: the labels must match exactly.
    Shape rows;
    for (int i = 0; i + 1 < in[0].rank(); ++i) rows.push_back(in[0][i]);
    if (!(in[1] == (Sparse ? rows : in[0]))) {
      return fault(r.shape, ShapeFault::shapes_differ, 0, 1);
    }
    return r;
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using L = std::conditional_t<Sparse, std::int32_t, T>;
    const index_t classes = a.in_shape(0).back();
    Backend::template softmax_cross_entropy<Sparse>(a.in<T>(0), a.in<L>(1), a.in_shape(0).numel() / classes, classes, R,
                                                    a.out<T>());
  }

  static constexpr bool has_parameters = false;
  static constexpr std::array grad_operands{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  template <bool InputGrad>
  auto grad_op() const {
    return SoftmaxCrossEntropyGradOp<Sparse, R>{};
  }

  static std::string op_name() { return "SoftmaxCrossEntropy"; }
  std::string label() const { return "nn::SoftmaxCrossEntropyWithLogits"; }
};

template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyGradOp {
  using layer_type = SoftmaxCrossEntropyGradOp;
  static constexpr int arity = 3;  // g, logits, labels
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using L = std::conditional_t<Sparse, std::int32_t, T>;
    const index_t classes = a.in_shape(1).back();
    Backend::template softmax_cross_entropy_grad<Sparse>(a.in<T>(0), a.in<T>(1), a.in<L>(2),
                                                         a.in_shape(1).numel() / classes, classes, R, a.out<T>());
  }

  static std::string op_name() { return "SoftmaxCrossEntropyGrad"; }
  std::string label() const { return op_name(); }
};

template <Reduction R>
struct MSEGradOp;

// (prediction - target)² per element, or its mean or sum.
template <Reduction R>
struct MSEOp {
  using layer_type = nn::BasicMSELoss<R, float>;
  static constexpr int arity = 2;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if (in[0].is_concrete() && in[1].is_concrete() && !(in[0] == in[1])) {
      return fault(reduced(in[0], R), ShapeFault::shapes_differ, 0, 1);
    }
    return {reduced(in[0], R)};
  }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::mse(a.in<T>(0), a.in<T>(1), a.in_shape(0).numel(), R, a.out<T>());
  }

  static constexpr bool has_parameters = false;
  static constexpr std::array grad_operands{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  template <bool InputGrad>
  auto grad_op() const {
    return MSEGradOp<R>{};
  }

  static std::string op_name() { return "MSE"; }
  std::string label() const { return "nn::MSELoss"; }
};

template <Reduction R>
struct MSEGradOp {
  using layer_type = MSEGradOp;
  static constexpr int arity = 3;  // g, prediction, target
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::mse_grad(a.in<T>(0), a.in<T>(1), a.in<T>(2), a.in_shape(1).numel(), R, a.out<T>());
  }

  static std::string op_name() { return "MSEGrad"; }
  std::string label() const { return op_name(); }
};

template <bool Sparse = false, Reduction R = Reduction::none, class Z, class Labels>
auto softmax_cross_entropy(const Z& logits, const Labels& labels) {
  using L = typename std::remove_cvref_t<Labels>::value_type;
  static_assert(!Sparse || std::is_same_v<L, std::int32_t>,
                "nn::SoftmaxCrossEntropyWithLogits<true>: sparse labels must be int32 class indices");
  static_assert(Sparse || std::is_same_v<L, typename std::remove_cvref_t<Z>::value_type>,
                "nn::SoftmaxCrossEntropyWithLogits<false>: labels must be distributions of the "
                "logits' element type");
  return apply(SoftmaxCrossEntropyOp<Sparse, R>{}, logits, labels);
}

template <Reduction R = Reduction::mean, class X, class Y>
auto mse(const X& prediction, const Y& target) {
  static_assert(
      std::is_same_v<typename std::remove_cvref_t<X>::value_type, typename std::remove_cvref_t<Y>::value_type>,
      "nn::MSELoss: prediction and target must have the same element type");
  return apply(MSEOp<R>{}, prediction, target);
}

}  // namespace ops

namespace nn {

// MindSpore's nn.SoftmaxCrossEntropyWithLogits(sparse, reduction):
// nn::SoftmaxCrossEntropyWithLogits<true, Reduction::mean> is (sparse=True, reduction='mean').
template <bool Sparse = false, Reduction R = Reduction::none, ElementType T = float>
class BasicSoftmaxCrossEntropyWithLogits
    : public Cell<BasicSoftmaxCrossEntropyWithLogits<Sparse, R, T>, CONTEXT_MODE, T> {
 public:
  template <class Z, class Labels>
  auto construct(const Z& logits, const Labels& labels) {
    return ops::softmax_cross_entropy<Sparse, R>(logits, labels);
  }
  std::string type_name() const override { return "nn::SoftmaxCrossEntropyWithLogits"; }
};

template <bool Sparse = false, Reduction R = Reduction::none>
using SoftmaxCrossEntropyWithLogits = BasicSoftmaxCrossEntropyWithLogits<Sparse, R, float>;

// MindSpore's nn.MSELoss(reduction), mean by default.
template <Reduction R = Reduction::mean, ElementType T = float>
class BasicMSELoss : public Cell<BasicMSELoss<R, T>, CONTEXT_MODE, T> {
 public:
  template <class X, class Y>
  auto construct(const X& prediction, const Y& target) {
    return ops::mse<R>(prediction, target);
  }
  std::string type_name() const override { return "nn::MSELoss"; }
};

template <Reduction R = Reduction::mean>
using MSELoss = BasicMSELoss<R, float>;

}  // namespace nn
}  // namespace duet
// Wrappers that turn a network into something to train (MindSpore's nn.WithLossCell and
// nn.TrainOneStepCell).

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>


namespace duet::nn {

// loss_fn(backbone(data), label). The backbone is transparent to naming, so the parameters
// keep the names they have in the backbone alone ("dense_relu_sequential.0.weight"), and a
// checkpoint of either loads into the other. It runs in the backbone's mode if that is fixed.
template <class Backbone, class Loss>
class WithLossCell
    : public Cell<WithLossCell<Backbone, Loss>, detail::fixed_mode_of<Backbone>(), typename Backbone::value_type> {
  using T = typename Backbone::value_type;

 public:
  // A backbone built at run time cannot be captured into a graph, so neither can this cell.
  static constexpr bool capturable = !RuntimeBuilt<Backbone>;

  WithLossCell(Backbone& backbone, Loss& loss_fn) : backbone_(backbone), loss_fn_(loss_fn) {}

  template <class X, class Y>
  auto construct(const X& data, const Y& label) {
    return loss_fn_(backbone_(data), label);
  }

  Backbone& backbone() { return backbone_; }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    visit("", backbone_);
    visit("loss_fn", loss_fn_);
  }
  std::string type_name() const override { return "nn::WithLossCell"; }

 private:
  Backbone& backbone_;
  Loss& loss_fn_;
};

// One training step per call: forward, loss, backward and the optimiser's update. In graph
// mode the first three are one compiled graph run by one evaluator call; the update follows
// in the same call, over the gradients that run left in the parameters.
template <class NetWithLoss, class Optimizer>
class TrainOneStepCell {
  using T = typename NetWithLoss::value_type;

 public:
  TrainOneStepCell(NetWithLoss& net_with_loss, Optimizer& optimizer)
      : grad_(net_with_loss, {}, std::nullopt), optimizer_(optimizer) {}

  // Returns the loss of the batch, before the update. A step that fails changes nothing. An
  // empty batch is refused: it has no gradient, yet an update would still advance the
  // optimiser (its step count, and momentum moving the parameters). A batch whose loss is NaN
  // or infinite (NaN or Inf inputs, or a model that diverged) skips the update, which would
  // write NaN into every parameter and moment for good; the caller sees the loss.
  template <class... X>
  BasicTensor<T> operator()(const X&... xs) {
    if (((tensor_of(xs).numel() == 0) || ...)) {
      throw ValueError("nn::TrainOneStepCell: the batch is empty; a training step needs at least one sample");
    }
    BasicTensor<T> loss = grad_.value_and_parameter_grads(xs...);
    if (std::ranges::all_of(loss.values(), [](T v) { return std::isfinite(v); })) optimizer_.step();
    return loss;
  }

  Optimizer& optimizer() { return optimizer_; }

 private:
  GradFunction<NetWithLoss&, void> grad_;
  Optimizer& optimizer_;
};

}  // namespace duet::nn
// Training helpers: evaluation of a classifier over a data set, and a terminal progress bar.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>


namespace duet::train {

struct Metrics {
  double loss = 0;      // mean over samples
  double accuracy = 0;  // top-1, in [0, 1]
  index_t samples = 0;
};

// How many rows of logits [B, C] have their largest value at the row's label.
inline index_t correct_predictions(const Tensor& logits, const BasicTensor<std::int32_t>& labels) {
  const index_t rows = logits.dim(0);
  const index_t classes = logits.dim(1);
  index_t correct = 0;
  for (index_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * classes;
    index_t best = 0;
    for (index_t c = 1; c < classes; ++c) {
      if (row[c] > row[best]) best = c;
    }
    correct += best == labels.data()[r] ? 1 : 0;
  }
  return correct;
}

// One pass over the loader's current epoch: mean loss (loss_fn must reduce by mean) and
// accuracy of net, each batch weighted by its size.
template <class Net, class Loss>
Metrics evaluate(Net& net, Loss& loss_fn, data::DataLoader& loader) {
  Metrics m;
  double loss_sum = 0;
  index_t correct = 0;
  for (const data::Batch& batch : loader) {
    const Tensor logits = net(batch.images);
    const index_t n = batch.labels.numel();
    loss_sum += static_cast<double>(loss_fn(logits, batch.labels).item()) * static_cast<double>(n);
    correct += correct_predictions(logits, batch.labels);
    m.samples += n;
  }
  if (m.samples > 0) {
    m.loss = loss_sum / static_cast<double>(m.samples);
    m.accuracy = static_cast<double>(correct) / static_cast<double>(m.samples);
  }
  return m;
}

// "epoch 2/5 [##########..........]  469/938  loss 0.4127  21034 ex/s  ETA 0:04", redrawn in
// place at most ten times a second, so drawing never costs training time.
class ProgressBar {
 public:
  ProgressBar(std::ostream& out, std::string title, index_t total)
      : out_(out), title_(std::move(title)), total_(total), start_(Clock::now()), last_draw_(start_) {}

  void update(index_t done, double loss, index_t examples) {
    const auto now = Clock::now();
    if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const double seconds = std::chrono::duration<double>(now - start_).count();
    const double rate = seconds > 0 ? static_cast<double>(examples) / seconds : 0;
    const double left = done > 0 ? seconds * static_cast<double>(total_ - done) / static_cast<double>(done) : 0;
    constexpr int width = 30;
    const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
    char line[256];
    std::snprintf(line, sizeof line, "\r%s [%s%s] %5lld/%lld  loss %.4f  %6.0f ex/s  ETA %d:%02d", title_.c_str(),
                  std::string(static_cast<std::size_t>(filled), '#').c_str(),
                  std::string(static_cast<std::size_t>(width - filled), '.').c_str(), static_cast<long long>(done),
                  static_cast<long long>(total_), loss, rate, static_cast<int>(left) / 60, static_cast<int>(left) % 60);
    out_ << line << std::flush;
  }

  // Ends the bar's line.
  void finish() { out_ << '\n'; }

 private:
  using Clock = std::chrono::steady_clock;
  std::ostream& out_;
  std::string title_;
  index_t total_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
};

}  // namespace duet::train
