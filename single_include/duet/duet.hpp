// duet: one neural network, two modes. Single-header edition.
// Generated from include/duet by tools/amalgamate.cpp; edit include/, then run
// `cmake --build <build> --target single_include`.
#pragma once
// duet: one neural network, two modes. Include this header for all of duet but the headers
// whose libraries cost every program to parse: <duet/io/safetensors.hpp> (nlohmann/json) and
// <duet/io/onnx.hpp> (ONNX, protobuf).

// Differentiation in both modes, behind one API (MindSpore's grad and value_and_grad).
//
// PyNative records a tape while the function runs (tape.hpp) and walks it back. Graph mode
// derives the backward graph from the forward graph's type while the program compiles: each
// node's op names its gradient op and what that op reads, and build_backward appends those
// ops, last node first, summing where a value has several readers. The training graph is
// then planned and run like any other, in one evaluator call. Both modes call the same
// gradient ops, hence the same kernels.

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
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
#include <tuple>
#include <type_traits>

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

// A compilation the recompilation contract forbids: one form more than a jitted function's
// JitConfig::max_compiled_forms, or any compilation after duet::freeze_compiles(). Not a
// ModeError: the call itself is valid, the program has said it may not compile again.
class RecompileError : public Error {
 public:
  using Error::Error;
};

class FormatError : public IOError {
 public:
  using IOError::IOError;
};

}  // namespace duet
// Elementwise kernels and the row reductions of softmax cross-entropy: exp, log-sum-exp, the
// softmax gradient of a row, sums, a scaled copy, and a map of vector functions (fn::Relu).
//
// Written once (detail/elementwise_impl.hpp) on the vectors of each instruction set, compiled
// per set below and chosen at run time (simd/isa.hpp, duet::kernel_isa()); a row's tail is one
// masked vector through the same code. exp is simd/detail/math.hpp's, within 2 ulp of std::exp,
// so no element calls libm; a row's logarithm is one std::log. Sums run lane by lane and then
// fold in a fixed tree, so they are not the scalar left-to-right sums, and a set with wider
// vectors (or FMA) can differ from another in the last bits of a loss or a gradient; under one
// set every call gives the same bits, which is what makes graph and PyNative mode agree.
// map() applies Fns::apply_in_place, the code a product's fused epilogue runs, so a map and an
// epilogue give the same bits.

#include <cmath>
#include <limits>

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
// The GEMM gives whole panels of columns to each thread (threads.hpp) when the product is large
// enough to share: every element's sum is the same code in the same order on any thread, so
// the bits do not depend on the number of threads. The GEMV stays on one: it is bound by
// reading the weight, and waking a second thread costs more than the time it could save there.
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
// Threads inside an operation: how many, and who may use them.
//
// duet splits its large products (Dense forward and backward, the convolutions' products)
// across threads with OpenMP, which the compilers and Debian provide (libgomp with g++, libomp
// with clang), rather than a pool of its own: OpenMP keeps its workers alive between regions,
// lets OMP_NUM_THREADS and OMP_WAIT_POLICY tune them as they tune libtorch and oneDNN, and is
// the one runtime a program that also uses those libraries already has. oneTBB would have done
// as well; OpenMP needs nothing beyond the compiler's flag (CMake's duet::duet adds it when
// OpenMP is found, or build with -fopenmp). Built without it, duet runs on one thread, and
// asking for more is an error rather than a setting quietly not applied.
//
// How many: duet::set_num_threads(n), set_context({.num_threads = n}), or DUET_NUM_THREADS=n
// read at start-up; by default OpenMP's own number (OMP_NUM_THREADS, else one per core).
//
// The policy, for one model called from several user threads at once: n is a budget for the
// whole process, not per call. A product takes as many helper threads as it can use (each must
// get enough work to pay for waking it: small products and batch 1 stay on the calling thread)
// from the n - 1 that are free at that moment, and runs on the rest itself; while another call
// holds the helpers, it runs on its own thread. So duet never runs more than n - 1 threads of
// its own beside the callers, whatever the number of callers, and a call made inside the
// user's own OpenMP parallel region takes none. The split is by blocks of output columns, each
// computed by the same code in the same order as on one thread: results are the same bits for
// every thread count.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>


#ifdef _OPENMP
#include <omp.h>
#endif

namespace duet {

// Whether this program was built with OpenMP, so that duet can use more than one thread.
inline constexpr bool threads_available =
#ifdef _OPENMP
    true;
#else
    false;
#endif

namespace detail {

inline int checked_num_threads(long n, std::string_view where) {
  if (n < 1 || n > 1024) {
    throw ValueError(std::string(where) + ": the number of threads must be in [1, 1024], got " + std::to_string(n));
  }
  if (n > 1 && !threads_available) {
    throw ValueError(std::string(where) + " asks for " + std::to_string(n) +
                     " threads, but this program was built without OpenMP, so duet runs on one: build with "
                     "-fopenmp (CMake: link duet::duet, which adds it where OpenMP is found)");
  }
  return static_cast<int>(n);
}

// The number to start with, given the value of DUET_NUM_THREADS (null or empty: OpenMP's).
inline int initial_num_threads(const char* env) {
  if (env == nullptr || *env == '\0') {
#ifdef _OPENMP
    return std::max(1, omp_get_max_threads());
#else
    return 1;
#endif
  }
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  const std::string where = "DUET_NUM_THREADS=" + std::string(env);
  if (*end != '\0') throw ValueError(where + ": not a whole number");
  return checked_num_threads(n, where);
}

inline std::atomic<int>& num_threads_storage() {
  static std::atomic<int> n{initial_num_threads(std::getenv("DUET_NUM_THREADS"))};
  return n;
}

// Helper threads (beyond the callers) that products run on now, across the process.
inline std::atomic<int>& helpers_in_use() {
  static std::atomic<int> n{0};
  return n;
}

// Up to `wanted` helpers from the budget, given back at the end of the scope; none while the
// budget is spent or inside an OpenMP region someone else opened.
class HelperLease {
 public:
  explicit HelperLease(int wanted) {
#ifdef _OPENMP
    if (wanted <= 0 || omp_in_parallel()) return;
    const int budget = num_threads_storage().load(std::memory_order_relaxed) - 1;
    int in_use = helpers_in_use().load(std::memory_order_relaxed);
    while (in_use < budget) {
      const int take = std::min(wanted, budget - in_use);
      if (helpers_in_use().compare_exchange_weak(in_use, in_use + take, std::memory_order_acquire)) {
        granted_ = take;
        return;
      }
    }
#else
    (void)wanted;
#endif
  }
  HelperLease(const HelperLease&) = delete;
  HelperLease& operator=(const HelperLease&) = delete;
  ~HelperLease() {
    if (granted_ > 0) helpers_in_use().fetch_sub(granted_, std::memory_order_release);
  }
  int threads() const { return 1 + granted_; }

 private:
  int granted_ = 0;
};

}  // namespace detail

// The number of threads duet's operations may use in all (see the policy above).
inline int get_num_threads() { return detail::num_threads_storage().load(std::memory_order_relaxed); }

// From the next operation on. More than one needs a build with OpenMP (duet::ValueError
// otherwise); more than the cores is allowed, and only slows things down.
inline void set_num_threads(int n) {
  detail::num_threads_storage().store(detail::checked_num_threads(n, "duet::set_num_threads"), std::memory_order_relaxed);
}

namespace detail {

// The threads a product of `work` multiply-adds over `blocks` independent blocks can use: one
// per block at most, and each with at least min_work, so that waking a helper (a few
// microseconds) costs little next to its share.
inline int useful_threads(index_t work, index_t blocks) {
  constexpr index_t min_work = index_t{1} << 18;
  const index_t by_work = std::max<index_t>(1, work / min_work);
  return static_cast<int>(std::min<index_t>({by_work, blocks, get_num_threads()}));
}

// How many operations have run on more than one thread since the program started: what shows
// that a setting took effect (tests, benchmarks), since the results cannot.
inline std::atomic<long>& shared_runs() {
  static std::atomic<long> n{0};
  return n;
}

// f(begin, end, slot) over [0, blocks) cut into contiguous ranges, one per thread, with up to
// `threads` threads (fewer if the budget is short). slot < threads numbers the range, so each
// can have scratch of its own. An exception thrown by f on any thread is rethrown here, after
// every thread has finished.
template <class F>
void parallel_blocks(index_t blocks, int threads, F&& f) {
  HelperLease lease(threads - 1);
  const int team = lease.threads();
  if (team == 1) {
    f(index_t{0}, blocks, 0);
    return;
  }
#ifdef _OPENMP
  std::exception_ptr error;
#pragma omp parallel num_threads(team)
  {
    const int t = omp_get_thread_num();
    const int n = omp_get_num_threads();
    if (t == 0 && n > 1) shared_runs().fetch_add(1, std::memory_order_relaxed);
    try {
      f(blocks * t / n, blocks * (t + 1) / n, t);
    } catch (...) {
#pragma omp critical(duet_parallel_blocks_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
#endif
}

// f(i0, i1) over [0, n) for an elementwise pass costing about `work` multiply-adds per element,
// cut at multiples of 1024 elements (whole vectors of every set).
template <class F>
void parallel_elements(index_t n, index_t work, F&& f) {
  constexpr index_t block = 1024;
  const index_t blocks = (n + block - 1) / block;
  parallel_blocks(blocks, useful_threads(n * work, blocks),
                  [&](index_t b0, index_t b1, int) { f(b0 * block, std::min(n, b1 * block)); });
}

}  // namespace detail
}  // namespace duet
// The one place where the instruction sets differ: per set, the vector width, the tile height
// and the few operations GCC's vector extensions do not spell (FMA, masked memory access, the
// group broadcast, the square root). Everything else in a kernel is written once, on Vec<T>,
// and compiled once per set, in the set's namespace (detail::baseline, detail::avx2,
// detail::avx512) and between its DUET_BEGIN_... and DUET_END_ISA (as kernels/gemm.hpp does
// with detail/gemm_impl.hpp); so are exp and the reductions (detail/math.hpp).
//
// Each set's code is compiled for its target whatever -march the program has, by a target
// region: GCC's `#pragma GCC target`, clang's `#pragma clang attribute push(target)`. Templates
// defined in a region keep its target when instantiated. Code outside the regions (the
// dispatch, the public functions) never handles a vector wider than the baseline's, so no
// vector crosses a call between functions of different targets (-Wpsabi).

#include <algorithm>
#include <cstdint>
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

// Arithmetic exactly as written: no a·b + c contracted into an FMA, which both compilers do
// wherever the target has one (GCC 12 even under -std=c++20). Kernels whose every set must
// give the bits of the scalar formula (kernels/optim.hpp) sit between these, inside their
// set's region; templates keep the setting when instantiated later, as they keep the target.
#if defined(__clang__)
#define DUET_BEGIN_UNFUSED _Pragma("float_control(push)") _Pragma("clang fp contract(off)")
#define DUET_END_UNFUSED _Pragma("float_control(pop)")
#else
#define DUET_BEGIN_UNFUSED _Pragma("GCC push_options") _Pragma("GCC optimize(\"fp-contract=off\")")
#define DUET_END_UNFUSED _Pragma("GCC pop_options")
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

// Subnormal inputs and results treated as zero (x86's MXCSR FTZ and DAZ) on this thread while
// it lives; the caller's setting is restored after. On x86 an operation that reads or makes a
// subnormal costs a microcode assist of a hundred cycles or more, and an optimiser's state makes
// them for good: where a gradient stays 0, m shrinks by β1 each step until rounding holds it at a
// few times the smallest subnormal (0.9·k·2^-149 rounds back to k·2^-149 for k < 5; v likewise
// for k < 500). TensorFlow flushes them in all its CPU threads for the same reason.
class FlushSubnormals {
 public:
#if DUET_X86_KERNELS
  FlushSubnormals() noexcept : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
#else
  FlushSubnormals() noexcept = default;
#endif
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

#if DUET_X86_KERNELS
 private:
  unsigned saved_;
#endif
};

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

// Correctly rounded, as std::sqrt, without its call into libm for errno.
template <class T>
Vec<T> sqrt(Vec<T> v) {
#if DUET_X86_KERNELS
  if constexpr (std::is_same_v<T, float>) return _mm_sqrt_ps(v);
  else return _mm_sqrt_pd(v);
#else
  for (int i = 0; i < lanes<T>; ++i) v[i] = __builtin_sqrt(v[i]);
  return v;
#endif
}

// What elementwise kernels need beyond vector.hpp, written once on the set's Vec<T>, fma and
// sqrt: a tag that names the set, broadcasts, tails, horizontal reductions and exp. Included
// once per set, inside its namespace and target region (simd/arch.hpp), so no include guard.

// The set this copy is compiled for, as a type: a kernel written once (kernels/optim.hpp) is a
// function template taking Target first, so that simd/dispatch.hpp reaches the set's copy by
// argument-dependent lookup.
struct Target {};

template <class T>
Vec<T> splat(T x) {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = x;
  return v;
}

// Lane i holds i.
template <class T>
Vec<T> lane_index() {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = static_cast<T>(i);
  return v;
}

// v in the lanes below n, fill in the others: what a tail read by load_first must hold for a
// reduction (0 for a sum, -inf for a maximum).
template <class T>
Vec<T> first_or(Vec<T> v, int n, T fill) {
  return lane_index<T>() < static_cast<T>(n) ? v : splat(fill);
}

// NaN-ignoring like std::max(a, b) with a the running maximum: a NaN in b is skipped.
template <class T>
Vec<T> max(Vec<T> a, Vec<T> b) {
  return a < b ? b : a;
}

// The lanes of v folded in a fixed tree (halves, then quarters, ...): the sum, or with Max the
// maximum as max() takes it.
template <bool Max, class T>
T reduce_lanes(Vec<T> v) {
  T x[lanes<T>];
  std::memcpy(x, &v, sizeof v);
  for (int width = lanes<T> / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) x[i] = Max ? (x[i] < x[i + width] ? x[i + width] : x[i]) : x[i] + x[i + width];
  }
  return x[0];
}

// ---- exp ---------------------------------------------------------------------------------
//
// e^x = 2^k · e^r with k = round(x / ln 2) and |r| <= ln 2 / 2, r = x - k·ln 2 in two parts
// (Cody and Waite: k·ln2_hi is exact, so r loses nothing to cancellation), e^r by its Taylor
// polynomial (degree 7 for float, 13 for double: the first omitted term is below 2^-27 and
// 2^-57 of the result) in Horner's form, and 2^k built in the exponent bits. 2^k is applied in
// two halves, so that a result near the top of the range, or subnormal at the bottom, is
// rounded once, as std::exp's is. tests/kernels_elementwise.cpp requires 2 ulp of std::exp
// under every set on millions of arguments across the whole range, and measures at most 1.
// x above the range gives +inf, below it +0, and NaN stays NaN. The sets differ in FMA (the
// baseline rounds a·b and + c separately), so their results may differ in the last bit.

template <class T>
struct ExpConstants;

template <>
struct ExpConstants<float> {
  using Bits = std::int32_t;
  static constexpr int mantissa_bits = 23;
  static constexpr Bits exponent_bias = 127;
  // e^89 overflows and e^-104 is below half the smallest subnormal; clamping there keeps k
  // within what two halves of 2^k can represent.
  static constexpr float lowest = -104.0f;
  static constexpr float highest = 89.0f;
  // Adding 1.5·2^23 rounds to an integer, and leaves it in the low bits.
  static constexpr float round_shift = 12582912.0f;
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f;
  static constexpr float ln2_lo = -2.12194440e-4f;
  static constexpr float taylor[] = {1.0f,        1.0f,          1.0f / 2,      1.0f / 6,
                                     1.0f / 24,   1.0f / 120,    1.0f / 720,    1.0f / 5040};
};

template <>
struct ExpConstants<double> {
  using Bits = std::int64_t;
  static constexpr int mantissa_bits = 52;
  static constexpr Bits exponent_bias = 1023;
  static constexpr double lowest = -746.0;
  static constexpr double highest = 710.0;
  static constexpr double round_shift = 6755399441055744.0;  // 1.5·2^52
  static constexpr double log2e = 1.4426950408889634074;
  static constexpr double ln2_hi = 6.93145751953125e-1;
  static constexpr double ln2_lo = 1.42860682030941723212e-6;
  static constexpr double taylor[] = {1.0,
                                      1.0,
                                      1.0 / 2,
                                      1.0 / 6,
                                      1.0 / 24,
                                      1.0 / 120,
                                      1.0 / 720,
                                      1.0 / 5040,
                                      1.0 / 40320,
                                      1.0 / 362880,
                                      1.0 / 3628800,
                                      1.0 / 39916800,
                                      1.0 / 479001600,
                                      1.0 / 6227020800};
};

// 2^k for whole numbers k within the normal exponents, given k + round_shift: its low bits are
// k + bias once shifted into the exponent field, and the bits of round_shift shift out.
template <class T>
Vec<T> exp2_of_shifted(Vec<T> shifted) {
  using C = ExpConstants<T>;
  using Bits = Vector<typename C::Bits, vector_bytes>;
  Bits bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits + C::exponent_bias) << C::mantissa_bits;
  Vec<T> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <class T>
Vec<T> exp(Vec<T> x) {
  using C = ExpConstants<T>;
  // Comparisons with NaN are false, so NaN passes both clamps and stays NaN to the end.
  x = x < C::lowest ? splat(C::lowest) : x;
  x = x > C::highest ? splat(C::highest) : x;
  const Vec<T> k = (x * C::log2e + C::round_shift) - C::round_shift;
  Vec<T> r = fma<T>(k, splat(-C::ln2_hi), x);
  r = fma<T>(k, splat(-C::ln2_lo), r);
  constexpr int degree = static_cast<int>(sizeof C::taylor / sizeof(T)) - 1;
  Vec<T> p = splat(C::taylor[degree]);
  for (int i = degree - 1; i >= 0; --i) p = fma<T>(p, r, splat(C::taylor[i]));
  const Vec<T> half = k * T(0.5) + C::round_shift;
  const Vec<T> rest = (k - (half - C::round_shift)) + C::round_shift;
  return p * exp2_of_shifted<T>(half) * exp2_of_shifted<T>(rest);
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

template <class T>
Vec<T> sqrt(Vec<T> v) {
  if constexpr (std::is_same_v<T, float>) return _mm256_sqrt_ps(v);
  else return _mm256_sqrt_pd(v);
}

// What elementwise kernels need beyond vector.hpp, written once on the set's Vec<T>, fma and
// sqrt: a tag that names the set, broadcasts, tails, horizontal reductions and exp. Included
// once per set, inside its namespace and target region (simd/arch.hpp), so no include guard.

// The set this copy is compiled for, as a type: a kernel written once (kernels/optim.hpp) is a
// function template taking Target first, so that simd/dispatch.hpp reaches the set's copy by
// argument-dependent lookup.
struct Target {};

template <class T>
Vec<T> splat(T x) {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = x;
  return v;
}

// Lane i holds i.
template <class T>
Vec<T> lane_index() {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = static_cast<T>(i);
  return v;
}

// v in the lanes below n, fill in the others: what a tail read by load_first must hold for a
// reduction (0 for a sum, -inf for a maximum).
template <class T>
Vec<T> first_or(Vec<T> v, int n, T fill) {
  return lane_index<T>() < static_cast<T>(n) ? v : splat(fill);
}

// NaN-ignoring like std::max(a, b) with a the running maximum: a NaN in b is skipped.
template <class T>
Vec<T> max(Vec<T> a, Vec<T> b) {
  return a < b ? b : a;
}

// The lanes of v folded in a fixed tree (halves, then quarters, ...): the sum, or with Max the
// maximum as max() takes it.
template <bool Max, class T>
T reduce_lanes(Vec<T> v) {
  T x[lanes<T>];
  std::memcpy(x, &v, sizeof v);
  for (int width = lanes<T> / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) x[i] = Max ? (x[i] < x[i + width] ? x[i + width] : x[i]) : x[i] + x[i + width];
  }
  return x[0];
}

// ---- exp ---------------------------------------------------------------------------------
//
// e^x = 2^k · e^r with k = round(x / ln 2) and |r| <= ln 2 / 2, r = x - k·ln 2 in two parts
// (Cody and Waite: k·ln2_hi is exact, so r loses nothing to cancellation), e^r by its Taylor
// polynomial (degree 7 for float, 13 for double: the first omitted term is below 2^-27 and
// 2^-57 of the result) in Horner's form, and 2^k built in the exponent bits. 2^k is applied in
// two halves, so that a result near the top of the range, or subnormal at the bottom, is
// rounded once, as std::exp's is. tests/kernels_elementwise.cpp requires 2 ulp of std::exp
// under every set on millions of arguments across the whole range, and measures at most 1.
// x above the range gives +inf, below it +0, and NaN stays NaN. The sets differ in FMA (the
// baseline rounds a·b and + c separately), so their results may differ in the last bit.

template <class T>
struct ExpConstants;

template <>
struct ExpConstants<float> {
  using Bits = std::int32_t;
  static constexpr int mantissa_bits = 23;
  static constexpr Bits exponent_bias = 127;
  // e^89 overflows and e^-104 is below half the smallest subnormal; clamping there keeps k
  // within what two halves of 2^k can represent.
  static constexpr float lowest = -104.0f;
  static constexpr float highest = 89.0f;
  // Adding 1.5·2^23 rounds to an integer, and leaves it in the low bits.
  static constexpr float round_shift = 12582912.0f;
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f;
  static constexpr float ln2_lo = -2.12194440e-4f;
  static constexpr float taylor[] = {1.0f,        1.0f,          1.0f / 2,      1.0f / 6,
                                     1.0f / 24,   1.0f / 120,    1.0f / 720,    1.0f / 5040};
};

template <>
struct ExpConstants<double> {
  using Bits = std::int64_t;
  static constexpr int mantissa_bits = 52;
  static constexpr Bits exponent_bias = 1023;
  static constexpr double lowest = -746.0;
  static constexpr double highest = 710.0;
  static constexpr double round_shift = 6755399441055744.0;  // 1.5·2^52
  static constexpr double log2e = 1.4426950408889634074;
  static constexpr double ln2_hi = 6.93145751953125e-1;
  static constexpr double ln2_lo = 1.42860682030941723212e-6;
  static constexpr double taylor[] = {1.0,
                                      1.0,
                                      1.0 / 2,
                                      1.0 / 6,
                                      1.0 / 24,
                                      1.0 / 120,
                                      1.0 / 720,
                                      1.0 / 5040,
                                      1.0 / 40320,
                                      1.0 / 362880,
                                      1.0 / 3628800,
                                      1.0 / 39916800,
                                      1.0 / 479001600,
                                      1.0 / 6227020800};
};

// 2^k for whole numbers k within the normal exponents, given k + round_shift: its low bits are
// k + bias once shifted into the exponent field, and the bits of round_shift shift out.
template <class T>
Vec<T> exp2_of_shifted(Vec<T> shifted) {
  using C = ExpConstants<T>;
  using Bits = Vector<typename C::Bits, vector_bytes>;
  Bits bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits + C::exponent_bias) << C::mantissa_bits;
  Vec<T> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <class T>
Vec<T> exp(Vec<T> x) {
  using C = ExpConstants<T>;
  // Comparisons with NaN are false, so NaN passes both clamps and stays NaN to the end.
  x = x < C::lowest ? splat(C::lowest) : x;
  x = x > C::highest ? splat(C::highest) : x;
  const Vec<T> k = (x * C::log2e + C::round_shift) - C::round_shift;
  Vec<T> r = fma<T>(k, splat(-C::ln2_hi), x);
  r = fma<T>(k, splat(-C::ln2_lo), r);
  constexpr int degree = static_cast<int>(sizeof C::taylor / sizeof(T)) - 1;
  Vec<T> p = splat(C::taylor[degree]);
  for (int i = degree - 1; i >= 0; --i) p = fma<T>(p, r, splat(C::taylor[i]));
  const Vec<T> half = k * T(0.5) + C::round_shift;
  const Vec<T> rest = (k - (half - C::round_shift)) + C::round_shift;
  return p * exp2_of_shifted<T>(half) * exp2_of_shifted<T>(rest);
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

// Zero-masking with every lane selected, as broadcast_group, for the same GCC 12 warning.
template <class T>
Vec<T> sqrt(Vec<T> v) {
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_sqrt_ps(0xFFFF, v);
  else return _mm512_maskz_sqrt_pd(0xFF, v);
}

// What elementwise kernels need beyond vector.hpp, written once on the set's Vec<T>, fma and
// sqrt: a tag that names the set, broadcasts, tails, horizontal reductions and exp. Included
// once per set, inside its namespace and target region (simd/arch.hpp), so no include guard.

// The set this copy is compiled for, as a type: a kernel written once (kernels/optim.hpp) is a
// function template taking Target first, so that simd/dispatch.hpp reaches the set's copy by
// argument-dependent lookup.
struct Target {};

template <class T>
Vec<T> splat(T x) {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = x;
  return v;
}

// Lane i holds i.
template <class T>
Vec<T> lane_index() {
  Vec<T> v;
  for (int i = 0; i < lanes<T>; ++i) v[i] = static_cast<T>(i);
  return v;
}

// v in the lanes below n, fill in the others: what a tail read by load_first must hold for a
// reduction (0 for a sum, -inf for a maximum).
template <class T>
Vec<T> first_or(Vec<T> v, int n, T fill) {
  return lane_index<T>() < static_cast<T>(n) ? v : splat(fill);
}

// NaN-ignoring like std::max(a, b) with a the running maximum: a NaN in b is skipped.
template <class T>
Vec<T> max(Vec<T> a, Vec<T> b) {
  return a < b ? b : a;
}

// The lanes of v folded in a fixed tree (halves, then quarters, ...): the sum, or with Max the
// maximum as max() takes it.
template <bool Max, class T>
T reduce_lanes(Vec<T> v) {
  T x[lanes<T>];
  std::memcpy(x, &v, sizeof v);
  for (int width = lanes<T> / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) x[i] = Max ? (x[i] < x[i + width] ? x[i + width] : x[i]) : x[i] + x[i + width];
  }
  return x[0];
}

// ---- exp ---------------------------------------------------------------------------------
//
// e^x = 2^k · e^r with k = round(x / ln 2) and |r| <= ln 2 / 2, r = x - k·ln 2 in two parts
// (Cody and Waite: k·ln2_hi is exact, so r loses nothing to cancellation), e^r by its Taylor
// polynomial (degree 7 for float, 13 for double: the first omitted term is below 2^-27 and
// 2^-57 of the result) in Horner's form, and 2^k built in the exponent bits. 2^k is applied in
// two halves, so that a result near the top of the range, or subnormal at the bottom, is
// rounded once, as std::exp's is. tests/kernels_elementwise.cpp requires 2 ulp of std::exp
// under every set on millions of arguments across the whole range, and measures at most 1.
// x above the range gives +inf, below it +0, and NaN stays NaN. The sets differ in FMA (the
// baseline rounds a·b and + c separately), so their results may differ in the last bit.

template <class T>
struct ExpConstants;

template <>
struct ExpConstants<float> {
  using Bits = std::int32_t;
  static constexpr int mantissa_bits = 23;
  static constexpr Bits exponent_bias = 127;
  // e^89 overflows and e^-104 is below half the smallest subnormal; clamping there keeps k
  // within what two halves of 2^k can represent.
  static constexpr float lowest = -104.0f;
  static constexpr float highest = 89.0f;
  // Adding 1.5·2^23 rounds to an integer, and leaves it in the low bits.
  static constexpr float round_shift = 12582912.0f;
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_hi = 0.693359375f;
  static constexpr float ln2_lo = -2.12194440e-4f;
  static constexpr float taylor[] = {1.0f,        1.0f,          1.0f / 2,      1.0f / 6,
                                     1.0f / 24,   1.0f / 120,    1.0f / 720,    1.0f / 5040};
};

template <>
struct ExpConstants<double> {
  using Bits = std::int64_t;
  static constexpr int mantissa_bits = 52;
  static constexpr Bits exponent_bias = 1023;
  static constexpr double lowest = -746.0;
  static constexpr double highest = 710.0;
  static constexpr double round_shift = 6755399441055744.0;  // 1.5·2^52
  static constexpr double log2e = 1.4426950408889634074;
  static constexpr double ln2_hi = 6.93145751953125e-1;
  static constexpr double ln2_lo = 1.42860682030941723212e-6;
  static constexpr double taylor[] = {1.0,
                                      1.0,
                                      1.0 / 2,
                                      1.0 / 6,
                                      1.0 / 24,
                                      1.0 / 120,
                                      1.0 / 720,
                                      1.0 / 5040,
                                      1.0 / 40320,
                                      1.0 / 362880,
                                      1.0 / 3628800,
                                      1.0 / 39916800,
                                      1.0 / 479001600,
                                      1.0 / 6227020800};
};

// 2^k for whole numbers k within the normal exponents, given k + round_shift: its low bits are
// k + bias once shifted into the exponent field, and the bits of round_shift shift out.
template <class T>
Vec<T> exp2_of_shifted(Vec<T> shifted) {
  using C = ExpConstants<T>;
  using Bits = Vector<typename C::Bits, vector_bytes>;
  Bits bits;
  std::memcpy(&bits, &shifted, sizeof bits);
  bits = (bits + C::exponent_bias) << C::mantissa_bits;
  Vec<T> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <class T>
Vec<T> exp(Vec<T> x) {
  using C = ExpConstants<T>;
  // Comparisons with NaN are false, so NaN passes both clamps and stays NaN to the end.
  x = x < C::lowest ? splat(C::lowest) : x;
  x = x > C::highest ? splat(C::highest) : x;
  const Vec<T> k = (x * C::log2e + C::round_shift) - C::round_shift;
  Vec<T> r = fma<T>(k, splat(-C::ln2_hi), x);
  r = fma<T>(k, splat(-C::ln2_lo), r);
  constexpr int degree = static_cast<int>(sizeof C::taylor / sizeof(T)) - 1;
  Vec<T> p = splat(C::taylor[degree]);
  for (int i = degree - 1; i >= 0; --i) p = fma<T>(p, r, splat(C::taylor[i]));
  const Vec<T> half = k * T(0.5) + C::round_shift;
  const Vec<T> rest = (k - (half - C::round_shift)) + C::round_shift;
  return p * exp2_of_shifted<T>(half) * exp2_of_shifted<T>(rest);
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

// Within each vector, the G x Q lanes (G = KG blocks of Q) as Q x G: lane q·G + i from lane
// i·Q + q.
template <class T, int... I>
Vec<T> transpose_lanes(Vec<T> v, std::integer_sequence<int, I...>) {
  constexpr int G = KG<T>;
  constexpr int Q = lanes<T> / G;
  return __builtin_shufflevector(v, v, (I % G * Q + I / G)...);
}

// pack_panel's panel from B stored transposed, as bt[k, n] (ld apart): the same layout, for
// products whose right operand is an image's patches rather than a weight (kernels/conv.hpp).
// A group's KG rows of bt, L columns each, are the panel's KG vectors transposed: block j of
// row i goes to block i of vector j (transpose_blocks), then each vector's lanes from
// row-major KG x Q to Q x KG.
template <class T>
void pack_panel_kn(const T* src, index_t ld, int cols, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  for (index_t g0 = 0; g0 < depth; g0 += G, dst += G * L) {
    Vec<T> r[G];
    for (int i = 0; i < G; ++i) {
      const T* from = src + (g0 + i) * ld;
      r[i] = g0 + i >= depth ? Vec<T>{} : cols == L ? load(from) : load_first(from, cols);
    }
    transpose_blocks<L / G, T>(r);
    for (int j = 0; j < G; ++j) store<T>(dst + j * L, transpose_lanes<T>(r[j], std::make_integer_sequence<int, L>{}));
  }
}

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
// The MR broadcasts first, then each vector of B once, for every row: MR x KG accumulators, MR
// broadcasts and one vector of B are all the registers it holds (16 for AVX2's 3 x 4, 31 of
// AVX-512's 32 for 6 x 4). Holding the KG vectors of B instead needed one register more than
// AVX2 has, and the accumulator spilled to the stack put a store and a load in its chain of
// FMAs (AVX2 with clang: 38% of the FMA peak, now 80-95%).
// Each accumulator still takes its FMAs in the order of k: the order between them changes no
// bit. The loops over the tile are unrolled by pragma here and in micro_kernel's store loop:
// GCC keeps an array in registers only where every index is a constant, and left to itself it
// kept these loops rolled, kept acc in memory and stored all of it at every step (with the
// register fix alone, GCC's AVX2 product stayed at 25% of the peak; with both, 60-80%, level
// with OpenBLAS on the same machine; benchmarks/gemm.cpp).
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> av[MR];
  for (int i = 0; i < MR; ++i) {
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av[i] = broadcast_group<T>(group);
    } else {
      av[i] = broadcast_group<T>(ar[i] + p);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) {
    const Vec<T> bv = load(bp + j * lanes<T>);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = fma<T>(av[i], bv, acc[i][j]);
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
  // A fixed trip count, unrolled, so that every index of acc is a constant (see tile_step).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i, c += ldc) {
    if (i >= rows) continue;
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

// Panels [p0, p1) of C (columns p0·L .. p1·L), every row: the blocked product's work for one
// thread. panel: scratch for one packed panel of B, unless packed. b_kn: b is stored
// transposed, as [k, n] (never packed ahead). accumulate: adds to C instead of writing it.
template <class T, class... Fns>
void gemm_panels(index_t p0, index_t p1, const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                 const PackedWeight<T>* packed, bool b_kn, bool accumulate, index_t kc, index_t mc, T* panel) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t n1 = std::min(n, p1 * L);
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = p0 * L; j0 < n1; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else if (b_kn) pack_panel_kn(b + k0 * n + j0, n, cols, depth, panel);
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
                                  c + i0 * n + j0, n, cols, k0 == 0 && !accumulate, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

// The product on as many threads as it can use (threads.hpp), each taking whole panels of
// columns, so that every element of C is summed by the same code in the same order whatever
// the number of threads.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed, bool b_kn = false, bool accumulate = false) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  const index_t panels = (n + L - 1) / L;
  const int threads = ::duet::detail::useful_threads(m * n * k, panels);
  const index_t panel_elements = packed != nullptr ? 0 : kc * L;
  ::duet::detail::Storage scratch(static_cast<std::size_t>(threads * panel_elements * size));
  T* panels_scratch = reinterpret_cast<T*>(scratch.data());
  ::duet::detail::parallel_blocks(panels, threads, [&](index_t p0, index_t p1, int slot) {
    gemm_panels<T, Fns...>(p0, p1, a, m, k, b, n, bias, c, packed, b_kn, accumulate, kc, mc,
                           panels_scratch + slot * panel_elements);
  });
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

  template <class T>
  static void blocked_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate) {
    gemm_blocked<T>(a, m, k, b, n, nullptr, c, nullptr, true, accumulate);
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

// Within each vector, the G x Q lanes (G = KG blocks of Q) as Q x G: lane q·G + i from lane
// i·Q + q.
template <class T, int... I>
Vec<T> transpose_lanes(Vec<T> v, std::integer_sequence<int, I...>) {
  constexpr int G = KG<T>;
  constexpr int Q = lanes<T> / G;
  return __builtin_shufflevector(v, v, (I % G * Q + I / G)...);
}

// pack_panel's panel from B stored transposed, as bt[k, n] (ld apart): the same layout, for
// products whose right operand is an image's patches rather than a weight (kernels/conv.hpp).
// A group's KG rows of bt, L columns each, are the panel's KG vectors transposed: block j of
// row i goes to block i of vector j (transpose_blocks), then each vector's lanes from
// row-major KG x Q to Q x KG.
template <class T>
void pack_panel_kn(const T* src, index_t ld, int cols, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  for (index_t g0 = 0; g0 < depth; g0 += G, dst += G * L) {
    Vec<T> r[G];
    for (int i = 0; i < G; ++i) {
      const T* from = src + (g0 + i) * ld;
      r[i] = g0 + i >= depth ? Vec<T>{} : cols == L ? load(from) : load_first(from, cols);
    }
    transpose_blocks<L / G, T>(r);
    for (int j = 0; j < G; ++j) store<T>(dst + j * L, transpose_lanes<T>(r[j], std::make_integer_sequence<int, L>{}));
  }
}

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
// The MR broadcasts first, then each vector of B once, for every row: MR x KG accumulators, MR
// broadcasts and one vector of B are all the registers it holds (16 for AVX2's 3 x 4, 31 of
// AVX-512's 32 for 6 x 4). Holding the KG vectors of B instead needed one register more than
// AVX2 has, and the accumulator spilled to the stack put a store and a load in its chain of
// FMAs (AVX2 with clang: 38% of the FMA peak, now 80-95%).
// Each accumulator still takes its FMAs in the order of k: the order between them changes no
// bit. The loops over the tile are unrolled by pragma here and in micro_kernel's store loop:
// GCC keeps an array in registers only where every index is a constant, and left to itself it
// kept these loops rolled, kept acc in memory and stored all of it at every step (with the
// register fix alone, GCC's AVX2 product stayed at 25% of the peak; with both, 60-80%, level
// with OpenBLAS on the same machine; benchmarks/gemm.cpp).
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> av[MR];
  for (int i = 0; i < MR; ++i) {
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av[i] = broadcast_group<T>(group);
    } else {
      av[i] = broadcast_group<T>(ar[i] + p);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) {
    const Vec<T> bv = load(bp + j * lanes<T>);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = fma<T>(av[i], bv, acc[i][j]);
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
  // A fixed trip count, unrolled, so that every index of acc is a constant (see tile_step).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i, c += ldc) {
    if (i >= rows) continue;
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

// Panels [p0, p1) of C (columns p0·L .. p1·L), every row: the blocked product's work for one
// thread. panel: scratch for one packed panel of B, unless packed. b_kn: b is stored
// transposed, as [k, n] (never packed ahead). accumulate: adds to C instead of writing it.
template <class T, class... Fns>
void gemm_panels(index_t p0, index_t p1, const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                 const PackedWeight<T>* packed, bool b_kn, bool accumulate, index_t kc, index_t mc, T* panel) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t n1 = std::min(n, p1 * L);
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = p0 * L; j0 < n1; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else if (b_kn) pack_panel_kn(b + k0 * n + j0, n, cols, depth, panel);
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
                                  c + i0 * n + j0, n, cols, k0 == 0 && !accumulate, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

// The product on as many threads as it can use (threads.hpp), each taking whole panels of
// columns, so that every element of C is summed by the same code in the same order whatever
// the number of threads.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed, bool b_kn = false, bool accumulate = false) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  const index_t panels = (n + L - 1) / L;
  const int threads = ::duet::detail::useful_threads(m * n * k, panels);
  const index_t panel_elements = packed != nullptr ? 0 : kc * L;
  ::duet::detail::Storage scratch(static_cast<std::size_t>(threads * panel_elements * size));
  T* panels_scratch = reinterpret_cast<T*>(scratch.data());
  ::duet::detail::parallel_blocks(panels, threads, [&](index_t p0, index_t p1, int slot) {
    gemm_panels<T, Fns...>(p0, p1, a, m, k, b, n, bias, c, packed, b_kn, accumulate, kc, mc,
                           panels_scratch + slot * panel_elements);
  });
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

  template <class T>
  static void blocked_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate) {
    gemm_blocked<T>(a, m, k, b, n, nullptr, c, nullptr, true, accumulate);
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

// Within each vector, the G x Q lanes (G = KG blocks of Q) as Q x G: lane q·G + i from lane
// i·Q + q.
template <class T, int... I>
Vec<T> transpose_lanes(Vec<T> v, std::integer_sequence<int, I...>) {
  constexpr int G = KG<T>;
  constexpr int Q = lanes<T> / G;
  return __builtin_shufflevector(v, v, (I % G * Q + I / G)...);
}

// pack_panel's panel from B stored transposed, as bt[k, n] (ld apart): the same layout, for
// products whose right operand is an image's patches rather than a weight (kernels/conv.hpp).
// A group's KG rows of bt, L columns each, are the panel's KG vectors transposed: block j of
// row i goes to block i of vector j (transpose_blocks), then each vector's lanes from
// row-major KG x Q to Q x KG.
template <class T>
void pack_panel_kn(const T* src, index_t ld, int cols, index_t depth, T* dst) {
  constexpr int L = lanes<T>;
  constexpr int G = KG<T>;
  for (index_t g0 = 0; g0 < depth; g0 += G, dst += G * L) {
    Vec<T> r[G];
    for (int i = 0; i < G; ++i) {
      const T* from = src + (g0 + i) * ld;
      r[i] = g0 + i >= depth ? Vec<T>{} : cols == L ? load(from) : load_first(from, cols);
    }
    transpose_blocks<L / G, T>(r);
    for (int j = 0; j < G; ++j) store<T>(dst + j * L, transpose_lanes<T>(r[j], std::make_integer_sequence<int, L>{}));
  }
}

// One group of k for a tile: acc[i] += the group of row i of A, broadcast, times the panel's KG
// vectors at bp. Partial: only rest < KG values of A remain, and A is not read past them. A
// function rather than a lambda: GCC does not give lambdas the target of their region.
// The MR broadcasts first, then each vector of B once, for every row: MR x KG accumulators, MR
// broadcasts and one vector of B are all the registers it holds (16 for AVX2's 3 x 4, 31 of
// AVX-512's 32 for 6 x 4). Holding the KG vectors of B instead needed one register more than
// AVX2 has, and the accumulator spilled to the stack put a store and a load in its chain of
// FMAs (AVX2 with clang: 38% of the FMA peak, now 80-95%).
// Each accumulator still takes its FMAs in the order of k: the order between them changes no
// bit. The loops over the tile are unrolled by pragma here and in micro_kernel's store loop:
// GCC keeps an array in registers only where every index is a constant, and left to itself it
// kept these loops rolled, kept acc in memory and stored all of it at every step (with the
// register fix alone, GCC's AVX2 product stayed at 25% of the peak; with both, 60-80%, level
// with OpenBLAS on the same machine; benchmarks/gemm.cpp).
template <bool Partial, class T>
[[gnu::always_inline]] inline void tile_step(Vec<T> (&acc)[MR][KG<T>], const T* const (&ar)[MR], index_t p, const T* bp,
                                             std::size_t rest) {
  constexpr int G = KG<T>;
  Vec<T> av[MR];
  for (int i = 0; i < MR; ++i) {
    if constexpr (Partial) {
      T group[G] = {};
      std::memcpy(group, ar[i] + p, rest * sizeof(T));
      av[i] = broadcast_group<T>(group);
    } else {
      av[i] = broadcast_group<T>(ar[i] + p);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < G; ++j) {
    const Vec<T> bv = load(bp + j * lanes<T>);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i][j] = fma<T>(av[i], bv, acc[i][j]);
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
  // A fixed trip count, unrolled, so that every index of acc is a constant (see tile_step).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i, c += ldc) {
    if (i >= rows) continue;
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

// Panels [p0, p1) of C (columns p0·L .. p1·L), every row: the blocked product's work for one
// thread. panel: scratch for one packed panel of B, unless packed. b_kn: b is stored
// transposed, as [k, n] (never packed ahead). accumulate: adds to C instead of writing it.
template <class T, class... Fns>
void gemm_panels(index_t p0, index_t p1, const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                 const PackedWeight<T>* packed, bool b_kn, bool accumulate, index_t kc, index_t mc, T* panel) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t n1 = std::min(n, p1 * L);
  for (index_t m0 = 0; m0 < m; m0 += mc) {
    const index_t m1 = std::min(m, m0 + mc);
    for (index_t j0 = p0 * L; j0 < n1; j0 += L) {
      const int cols = static_cast<int>(std::min<index_t>(L, n - j0));
      const T* bias_panel = bias == nullptr ? nullptr : bias + j0;
      for (index_t k0 = 0; k0 < k; k0 += kc) {
        const index_t depth = std::min(kc, k - k0);
        const T* bp = panel;
        if (packed != nullptr) bp = packed->panel(j0, k0);
        else if (b_kn) pack_panel_kn(b + k0 * n + j0, n, cols, depth, panel);
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
                                  c + i0 * n + j0, n, cols, k0 == 0 && !accumulate, k0 + depth == k, bias_panel);
          for (const index_t until = std::min(ahead_bytes, fetched + slice); fetched < until; fetched += 64) {
            __builtin_prefetch(ahead + fetched, 0, 2);
          }
        }
      }
    }
  }
}

// The product on as many threads as it can use (threads.hpp), each taking whole panels of
// columns, so that every element of C is summed by the same code in the same order whatever
// the number of threads.
template <class T, class... Fns>
void gemm_blocked(const T* a, index_t m, index_t k, const T* b, index_t n, const T* bias, T* c,
                  const PackedWeight<T>* packed, bool b_kn = false, bool accumulate = false) {
  constexpr int L = lanes<T>;
  constexpr auto size = static_cast<index_t>(sizeof(T));
  const index_t kc = balanced_block(k, KC_bytes / size, KG<T>);
  const index_t mc = balanced_block(m, std::max<index_t>(MR, MC_bytes / (k * size)), MR);
  const index_t panels = (n + L - 1) / L;
  const int threads = ::duet::detail::useful_threads(m * n * k, panels);
  const index_t panel_elements = packed != nullptr ? 0 : kc * L;
  ::duet::detail::Storage scratch(static_cast<std::size_t>(threads * panel_elements * size));
  T* panels_scratch = reinterpret_cast<T*>(scratch.data());
  ::duet::detail::parallel_blocks(panels, threads, [&](index_t p0, index_t p1, int slot) {
    gemm_panels<T, Fns...>(p0, p1, a, m, k, b, n, bias, c, packed, b_kn, accumulate, kc, mc,
                           panels_scratch + slot * panel_elements);
  });
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

  template <class T>
  static void blocked_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate) {
    gemm_blocked<T>(a, m, k, b, n, nullptr, c, nullptr, true, accumulate);
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

// Whether gemm<K, N> takes the unrolled loop of small static layers: the one place where the
// compile-time sizes change the order of the sums, and so the bits, of gemm<dyn, dyn>.
template <index_t K, index_t N>
inline constexpr bool unrolls = K != dyn && N != dyn && K * N <= 64;

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
  if constexpr (unrolls<K, N>) {
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

// to[cols, rows] = from[rows, cols]ᵀ, both row-major: the copy an operand takes where a product
// needs it the other way round (a convolution's weight, a layer's output gradient). In square
// blocks, so that both sides move whole cache lines.
template <class T>
void transpose(const T* from, index_t rows, index_t cols, T* to) {
  constexpr index_t block = 32;
  for (index_t r0 = 0; r0 < rows; r0 += block) {
    const index_t r1 = std::min(rows, r0 + block);
    for (index_t c0 = 0; c0 < cols; c0 += block) {
      const index_t c1 = std::min(cols, c0 + block);
      for (index_t c = c0; c < c1; ++c) {
        for (index_t r = r0; r < r1; ++r) to[c * rows + r] = from[r * cols + c];
      }
    }
  }
}

// c[m, n] (+)= Σ_k a[m, k] · b[k, n]: gemm with b stored the other way round, [k, n] row-major,
// as an image's patches and a layer's input under its weight gradient are, with neither bias
// nor functions; accumulate adds to c instead of writing it. The blocked product at every
// size, so the result has the same bits whether m is 1 or more; b's panels are packed from the
// rows of b, which is the only difference from gemm on bᵀ, and the sums are gemm's sums in the
// same order. After the first call on a thread for a given size, no heap allocation.
template <class T>
  requires gemm_supports<T>
void gemm_kn(const T* a, index_t m, index_t k, const T* b, index_t n, T* c, bool accumulate = false) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) std::fill_n(c, m * n, T(0));
    return;
  }
  detail::with_kernels(active_isa(), [&]<class Kernels>(Kernels) { Kernels::blocked_kn(a, m, k, b, n, c, accumulate); });
}

}  // namespace duet::kernels
// From the set chosen at run time (simd/isa.hpp) to the code compiled for it (simd/arch.hpp).


namespace duet::kernels::detail {

// f(Target) with the Target of isa. A kernel written once, as a function template in each
// set's namespace that takes that set's Target first, is called as `step(target, ...)` inside
// f: argument-dependent lookup picks the set's copy. Only pointers and sizes cross the call.
template <class F>
decltype(auto) with_target(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f(avx512::Target{});
    case Isa::avx2: return f(avx2::Target{});
    case Isa::baseline: break;
  }
  return f(baseline::Target{});
}

}  // namespace duet::kernels::detail

namespace duet::kernels::detail::baseline {
// One instruction set's elementwise kernels (kernels/elementwise.hpp), written on its Vec<T>,
// load, store, load_first, store_first, exp and the reductions of simd/detail/math.hpp. No
// include guard and no includes: elementwise.hpp includes it once per set, inside that set's
// namespace and target region.

// The lanes of a row of n from i on: a whole vector, or the tail, whose load reads nothing
// past n and holds zero in the lanes past it. (Plain loops over these, not a helper taking a
// lambda: GCC does not give a lambda the target of its region.)
template <class T>
int lanes_from(index_t i, index_t n) {
  return n - i < lanes<T> ? static_cast<int>(n - i) : lanes<T>;
}

template <class T>
Vec<T> load_lanes(const T* x, int count) {
  return count == lanes<T> ? load(x) : load_first(x, count);
}

template <class T>
void store_lanes(T* y, Vec<T> v, int count) {
  if (count == lanes<T>) store<T>(y, v);
  else store_first<T>(y, v, count);
}

template <class T>
void exp_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, exp<T>(load_lanes(x + i, count)), count);
  }
}

template <class T>
void scale_step(Target, const T* x, index_t n, T a, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, a * load_lanes(x + i, count), count);
  }
}

template <class T>
T sum_step(Target, const T* x, index_t n) {
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) s += load_lanes(x + i, lanes_from<T>(i, n));
  return reduce_lanes<false, T>(s);
}

template <class T>
T log_sum_exp_step(Target, const T* x, index_t n) {
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  Vec<T> top = splat(lowest);
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    top = max<T>(top, first_or<T>(load_lanes(x + i, count), count, lowest));
  }
  const T m = reduce_lanes<true, T>(top);
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += first_or<T>(exp<T>(load_lanes(x + i, count) - m), count, T(0));
  }
  return m + std::log(reduce_lanes<false, T>(s));
}

template <class T>
T cross_entropy_step(Target, const T* z, const T* p, index_t n, T lse) {
  Vec<T> s{};
  // Past n, p's lanes are zero, and so is what they add.
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += load_lanes(p + i, count) * (lse - load_lanes(z + i, count));
  }
  return reduce_lanes<false, T>(s);
}

template <class T>
void softmax_grad_step(Target, const T* z, index_t n, T lse, index_t label, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    const Vec<T> one_hot = lane_index<T>() == static_cast<T>(label - i) ? splat(T(1)) : Vec<T>{};
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) - one_hot) * scale, count);
  }
}

template <class T>
void softmax_grad_step(Target, const T* z, const T* p, index_t n, T lse, T mass, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) * mass - load_lanes(p + i, count)) * scale, count);
  }
}

template <class T, class... Fns>
void map_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> v = load_lanes(x + i, count);
    apply_all<Vec<T>, Fns...>(v);
    store_lanes<T>(y + i, v, count);
  }
}
}  // namespace duet::kernels::detail::baseline

#if DUET_X86_KERNELS
DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {
// One instruction set's elementwise kernels (kernels/elementwise.hpp), written on its Vec<T>,
// load, store, load_first, store_first, exp and the reductions of simd/detail/math.hpp. No
// include guard and no includes: elementwise.hpp includes it once per set, inside that set's
// namespace and target region.

// The lanes of a row of n from i on: a whole vector, or the tail, whose load reads nothing
// past n and holds zero in the lanes past it. (Plain loops over these, not a helper taking a
// lambda: GCC does not give a lambda the target of its region.)
template <class T>
int lanes_from(index_t i, index_t n) {
  return n - i < lanes<T> ? static_cast<int>(n - i) : lanes<T>;
}

template <class T>
Vec<T> load_lanes(const T* x, int count) {
  return count == lanes<T> ? load(x) : load_first(x, count);
}

template <class T>
void store_lanes(T* y, Vec<T> v, int count) {
  if (count == lanes<T>) store<T>(y, v);
  else store_first<T>(y, v, count);
}

template <class T>
void exp_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, exp<T>(load_lanes(x + i, count)), count);
  }
}

template <class T>
void scale_step(Target, const T* x, index_t n, T a, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, a * load_lanes(x + i, count), count);
  }
}

template <class T>
T sum_step(Target, const T* x, index_t n) {
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) s += load_lanes(x + i, lanes_from<T>(i, n));
  return reduce_lanes<false, T>(s);
}

template <class T>
T log_sum_exp_step(Target, const T* x, index_t n) {
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  Vec<T> top = splat(lowest);
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    top = max<T>(top, first_or<T>(load_lanes(x + i, count), count, lowest));
  }
  const T m = reduce_lanes<true, T>(top);
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += first_or<T>(exp<T>(load_lanes(x + i, count) - m), count, T(0));
  }
  return m + std::log(reduce_lanes<false, T>(s));
}

template <class T>
T cross_entropy_step(Target, const T* z, const T* p, index_t n, T lse) {
  Vec<T> s{};
  // Past n, p's lanes are zero, and so is what they add.
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += load_lanes(p + i, count) * (lse - load_lanes(z + i, count));
  }
  return reduce_lanes<false, T>(s);
}

template <class T>
void softmax_grad_step(Target, const T* z, index_t n, T lse, index_t label, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    const Vec<T> one_hot = lane_index<T>() == static_cast<T>(label - i) ? splat(T(1)) : Vec<T>{};
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) - one_hot) * scale, count);
  }
}

template <class T>
void softmax_grad_step(Target, const T* z, const T* p, index_t n, T lse, T mass, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) * mass - load_lanes(p + i, count)) * scale, count);
  }
}

template <class T, class... Fns>
void map_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> v = load_lanes(x + i, count);
    apply_all<Vec<T>, Fns...>(v);
    store_lanes<T>(y + i, v, count);
  }
}
}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {
// One instruction set's elementwise kernels (kernels/elementwise.hpp), written on its Vec<T>,
// load, store, load_first, store_first, exp and the reductions of simd/detail/math.hpp. No
// include guard and no includes: elementwise.hpp includes it once per set, inside that set's
// namespace and target region.

// The lanes of a row of n from i on: a whole vector, or the tail, whose load reads nothing
// past n and holds zero in the lanes past it. (Plain loops over these, not a helper taking a
// lambda: GCC does not give a lambda the target of its region.)
template <class T>
int lanes_from(index_t i, index_t n) {
  return n - i < lanes<T> ? static_cast<int>(n - i) : lanes<T>;
}

template <class T>
Vec<T> load_lanes(const T* x, int count) {
  return count == lanes<T> ? load(x) : load_first(x, count);
}

template <class T>
void store_lanes(T* y, Vec<T> v, int count) {
  if (count == lanes<T>) store<T>(y, v);
  else store_first<T>(y, v, count);
}

template <class T>
void exp_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, exp<T>(load_lanes(x + i, count)), count);
  }
}

template <class T>
void scale_step(Target, const T* x, index_t n, T a, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(y + i, a * load_lanes(x + i, count), count);
  }
}

template <class T>
T sum_step(Target, const T* x, index_t n) {
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) s += load_lanes(x + i, lanes_from<T>(i, n));
  return reduce_lanes<false, T>(s);
}

template <class T>
T log_sum_exp_step(Target, const T* x, index_t n) {
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  Vec<T> top = splat(lowest);
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    top = max<T>(top, first_or<T>(load_lanes(x + i, count), count, lowest));
  }
  const T m = reduce_lanes<true, T>(top);
  Vec<T> s{};
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += first_or<T>(exp<T>(load_lanes(x + i, count) - m), count, T(0));
  }
  return m + std::log(reduce_lanes<false, T>(s));
}

template <class T>
T cross_entropy_step(Target, const T* z, const T* p, index_t n, T lse) {
  Vec<T> s{};
  // Past n, p's lanes are zero, and so is what they add.
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    s += load_lanes(p + i, count) * (lse - load_lanes(z + i, count));
  }
  return reduce_lanes<false, T>(s);
}

template <class T>
void softmax_grad_step(Target, const T* z, index_t n, T lse, index_t label, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    const Vec<T> one_hot = lane_index<T>() == static_cast<T>(label - i) ? splat(T(1)) : Vec<T>{};
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) - one_hot) * scale, count);
  }
}

template <class T>
void softmax_grad_step(Target, const T* z, const T* p, index_t n, T lse, T mass, T scale, T* d) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    store_lanes<T>(d + i, (exp<T>(load_lanes(z + i, count) - lse) * mass - load_lanes(p + i, count)) * scale, count);
  }
}

template <class T, class... Fns>
void map_step(Target, const T* x, index_t n, T* y) {
  for (index_t i = 0; i < n; i += lanes<T>) {
    const int count = lanes_from<T>(i, n);
    Vec<T> v = load_lanes(x + i, count);
    apply_all<Vec<T>, Fns...>(v);
    store_lanes<T>(y + i, v, count);
  }
}
}  // namespace duet::kernels::detail::avx512
DUET_END_ISA
#endif

namespace duet::kernels {

template <class T>
concept VectorElement = std::is_same_v<T, float> || std::is_same_v<T, double>;

// y[i] = e^x[i]; y may be x.
template <VectorElement T>
void exp(const T* x, index_t n, T* y) {
  detail::with_target(active_isa(), [&](auto target) { exp_step(target, x, n, y); });
}

// Σ x[i].
template <VectorElement T>
T sum(const T* x, index_t n) {
  return detail::with_target(active_isa(), [&](auto target) { return sum_step(target, x, n); });
}

// log Σ e^x[i], after subtracting the maximum, so that 1e4 neither overflows nor is lost.
template <VectorElement T>
T log_sum_exp(const T* x, index_t n) {
  return detail::with_target(active_isa(), [&](auto target) { return log_sum_exp_step(target, x, n); });
}

// Σ p[i] (lse - z[i]): the cross-entropy of a row of logits z against a distribution p.
template <VectorElement T>
T cross_entropy(const T* z, const T* p, index_t n, T lse) {
  return detail::with_target(active_isa(), [&](auto target) { return cross_entropy_step(target, z, p, n, lse); });
}

// d[i] = (e^(z[i] - lse) - [i == label]) · scale: the gradient of a row's sparse softmax
// cross-entropy, times the gradient flowing in.
template <VectorElement T>
void softmax_grad(const T* z, index_t n, T lse, index_t label, T scale, T* d) {
  detail::with_target(active_isa(), [&](auto target) { softmax_grad_step(target, z, n, lse, label, scale, d); });
}

// d[i] = (e^(z[i] - lse) · mass - p[i]) · scale, mass = Σ p: the same against a distribution.
template <VectorElement T>
void softmax_grad(const T* z, const T* p, index_t n, T lse, T mass, T scale, T* d) {
  detail::with_target(active_isa(), [&](auto target) { softmax_grad_step(target, z, p, n, lse, mass, scale, d); });
}

// y[i] = a·x[i]; y may be x.
template <VectorElement T>
void scale(const T* x, index_t n, T a, T* y) {
  detail::with_target(active_isa(), [&](auto target) { scale_step(target, x, n, a, y); });
}

// y[i] = Fns(x[i]), the functions applied in order; y may be x.
template <class... Fns, class T>
  requires gemm_supports<T, Fns...>
void map(const T* x, index_t n, T* y) {
  detail::with_target(active_isa(), [&](auto target) { map_step<T, Fns...>(target, x, n, y); });
}

}  // namespace duet::kernels
// Optimiser updates (nn::Adam, nn::AdamW, nn::SGD), one pass over each parameter.
//
// An update reads the parameter, its gradient and the optimiser's state and writes parameter
// and state back: 28 bytes per float for Adam, for a few operations, one of them a square root
// and one a division. It runs near memory speed only if those two are vector instructions
// (benchmarks/optim.cpp compares it with a streaming pass over the same bytes); a scalar loop
// is bound by std::sqrt and the division instead. Even as vectors they share one unit and
// bound Adam on data in L2, so Adam's rule is written with one of each (AdamCoefficients).
//
// Written once (detail/optim_impl.hpp) on the vectors of each instruction set, compiled per set
// below and chosen at run time like the matrix product (simd/isa.hpp, duet::kernel_isa()). The
// tail is one masked vector through the same code, not a scalar loop. Every set computes each
// element with the operations of the scalar formula in its order, unfused (DUET_BEGIN_UNFUSED),
// and IEEE's +, -, ·, / and sqrt are correctly rounded: every set gives the bits of that
// formula evaluated in T, on any CPU and for any tail (tests/kernels_optim.cpp), except that
// on x86 subnormal inputs and results count as zero (detail::FlushSubnormals says why):
// the moments of weights whose gradients stay zero sink to subnormals and stay there, and
// flushing them took Adam from 25 % to 15 % of a Fashion-MNIST epoch of the seed network. Large
// parameters are cut into ranges for several threads (threads.hpp); elementwise, that changes
// no bit.


namespace duet::kernels {

// Adam's scalars for one step, in T: m = β1·m + (1 - β1)·g', v = β2·v + (1 - β2)·g'·g' with
// g' = g + l2·p, then p = p·decay - step·m / (sqrt(v) + eps). With c1 = 1 - β1^t and
// c2 = 1 - β2^t, PyTorch's lr·(m / c1) / (sqrt(v) / sqrt(c2) + ε) is this with
// step = lr·sqrt(c2) / c1 and eps = ε·sqrt(c2), both computed once in double: one division
// per element instead of two, as accurate (four roundings in T either way, each within half
// an ulp), though not the same bits.
template <class T>
struct AdamCoefficients {
  T beta1;
  T beta2;
  T eps;    // ε·sqrt(1 - β2^t)
  T l2;     // L2 weight decay (Adam), added to the gradient
  T decay;  // 1 - lr·weight_decay (AdamW's decoupled decay), else 1
  T step;   // lr·sqrt(1 - β2^t) / (1 - β1^t)
};

// SGD's scalars for one step: d = g + weight_decay·p; without momentum p -= lr·d; with it
// buf = d on the first step and momentum·buf + keep·d after, and p -= lr·buf (or, Nesterov,
// lr·(d + momentum·buf)).
template <class T>
struct SgdCoefficients {
  T learning_rate;
  T weight_decay;
  T momentum;
  T keep;  // 1 - dampening
  bool with_momentum;
  bool nesterov;
  bool first_step;
};

}  // namespace duet::kernels

namespace duet::kernels::detail::baseline {
DUET_BEGIN_UNFUSED
// One instruction set's optimiser updates (kernels/optim.hpp), written on its Vec<T>, load,
// store, load_first, store_first and sqrt (simd/arch.hpp). No include guard and no includes:
// optim.hpp includes it once per set, inside that set's namespace and target region, where
// a·b + c is not fused.

// Adam on one vector of values, as the scalar formula writes it (AdamCoefficients).
template <class T>
[[gnu::always_inline]] inline void adam_lanes(Vec<T>& p, Vec<T> g, Vec<T>& m, Vec<T>& v, const AdamCoefficients<T>& c) {
  const Vec<T> grad = g + c.l2 * p;
  m = c.beta1 * m + (T(1) - c.beta1) * grad;
  v = c.beta2 * v + (T(1) - c.beta2) * grad * grad;
  p = p * c.decay - c.step * m / (sqrt<T>(v) + c.eps);
}

template <class T>
void adam_step(Target, T* p, const T* g, T* m, T* v, index_t n, const AdamCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    Vec<T> mv = load(m + i);
    Vec<T> vv = load(v + i);
    adam_lanes<T>(pv, load(g + i), mv, vv, c);
    store<T>(p + i, pv);
    store<T>(m + i, mv);
    store<T>(v + i, vv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    Vec<T> mv = load_first(m + i, rest);
    Vec<T> vv = load_first(v + i, rest);
    adam_lanes<T>(pv, load_first(g + i, rest), mv, vv, c);
    store_first<T>(p + i, pv, rest);
    store_first<T>(m + i, mv, rest);
    store_first<T>(v + i, vv, rest);
  }
}

// SGD on one vector of values (SgdCoefficients); buf is untouched without momentum.
template <class T>
[[gnu::always_inline]] inline void sgd_lanes(Vec<T>& p, Vec<T> g, Vec<T>& buf, const SgdCoefficients<T>& c) {
  const Vec<T> d = g + c.weight_decay * p;
  if (!c.with_momentum) {
    p -= c.learning_rate * d;
    return;
  }
  buf = c.first_step ? d : c.momentum * buf + c.keep * d;
  p -= c.learning_rate * (c.nesterov ? d + c.momentum * buf : buf);
}

template <class T>
void sgd_step(Target, T* p, const T* g, T* buf, index_t n, const SgdCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  Vec<T> bv{};
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    if (c.with_momentum) bv = load(buf + i);
    sgd_lanes<T>(pv, load(g + i), bv, c);
    store<T>(p + i, pv);
    if (c.with_momentum) store<T>(buf + i, bv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    if (c.with_momentum) bv = load_first(buf + i, rest);
    sgd_lanes<T>(pv, load_first(g + i, rest), bv, c);
    store_first<T>(p + i, pv, rest);
    if (c.with_momentum) store_first<T>(buf + i, bv, rest);
  }
}
DUET_END_UNFUSED
}  // namespace duet::kernels::detail::baseline

#if DUET_X86_KERNELS
DUET_BEGIN_AVX2
namespace duet::kernels::detail::avx2 {
DUET_BEGIN_UNFUSED
// One instruction set's optimiser updates (kernels/optim.hpp), written on its Vec<T>, load,
// store, load_first, store_first and sqrt (simd/arch.hpp). No include guard and no includes:
// optim.hpp includes it once per set, inside that set's namespace and target region, where
// a·b + c is not fused.

// Adam on one vector of values, as the scalar formula writes it (AdamCoefficients).
template <class T>
[[gnu::always_inline]] inline void adam_lanes(Vec<T>& p, Vec<T> g, Vec<T>& m, Vec<T>& v, const AdamCoefficients<T>& c) {
  const Vec<T> grad = g + c.l2 * p;
  m = c.beta1 * m + (T(1) - c.beta1) * grad;
  v = c.beta2 * v + (T(1) - c.beta2) * grad * grad;
  p = p * c.decay - c.step * m / (sqrt<T>(v) + c.eps);
}

template <class T>
void adam_step(Target, T* p, const T* g, T* m, T* v, index_t n, const AdamCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    Vec<T> mv = load(m + i);
    Vec<T> vv = load(v + i);
    adam_lanes<T>(pv, load(g + i), mv, vv, c);
    store<T>(p + i, pv);
    store<T>(m + i, mv);
    store<T>(v + i, vv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    Vec<T> mv = load_first(m + i, rest);
    Vec<T> vv = load_first(v + i, rest);
    adam_lanes<T>(pv, load_first(g + i, rest), mv, vv, c);
    store_first<T>(p + i, pv, rest);
    store_first<T>(m + i, mv, rest);
    store_first<T>(v + i, vv, rest);
  }
}

// SGD on one vector of values (SgdCoefficients); buf is untouched without momentum.
template <class T>
[[gnu::always_inline]] inline void sgd_lanes(Vec<T>& p, Vec<T> g, Vec<T>& buf, const SgdCoefficients<T>& c) {
  const Vec<T> d = g + c.weight_decay * p;
  if (!c.with_momentum) {
    p -= c.learning_rate * d;
    return;
  }
  buf = c.first_step ? d : c.momentum * buf + c.keep * d;
  p -= c.learning_rate * (c.nesterov ? d + c.momentum * buf : buf);
}

template <class T>
void sgd_step(Target, T* p, const T* g, T* buf, index_t n, const SgdCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  Vec<T> bv{};
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    if (c.with_momentum) bv = load(buf + i);
    sgd_lanes<T>(pv, load(g + i), bv, c);
    store<T>(p + i, pv);
    if (c.with_momentum) store<T>(buf + i, bv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    if (c.with_momentum) bv = load_first(buf + i, rest);
    sgd_lanes<T>(pv, load_first(g + i, rest), bv, c);
    store_first<T>(p + i, pv, rest);
    if (c.with_momentum) store_first<T>(buf + i, bv, rest);
  }
}
DUET_END_UNFUSED
}  // namespace duet::kernels::detail::avx2
DUET_END_ISA

DUET_BEGIN_AVX512
namespace duet::kernels::detail::avx512 {
DUET_BEGIN_UNFUSED
// One instruction set's optimiser updates (kernels/optim.hpp), written on its Vec<T>, load,
// store, load_first, store_first and sqrt (simd/arch.hpp). No include guard and no includes:
// optim.hpp includes it once per set, inside that set's namespace and target region, where
// a·b + c is not fused.

// Adam on one vector of values, as the scalar formula writes it (AdamCoefficients).
template <class T>
[[gnu::always_inline]] inline void adam_lanes(Vec<T>& p, Vec<T> g, Vec<T>& m, Vec<T>& v, const AdamCoefficients<T>& c) {
  const Vec<T> grad = g + c.l2 * p;
  m = c.beta1 * m + (T(1) - c.beta1) * grad;
  v = c.beta2 * v + (T(1) - c.beta2) * grad * grad;
  p = p * c.decay - c.step * m / (sqrt<T>(v) + c.eps);
}

template <class T>
void adam_step(Target, T* p, const T* g, T* m, T* v, index_t n, const AdamCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    Vec<T> mv = load(m + i);
    Vec<T> vv = load(v + i);
    adam_lanes<T>(pv, load(g + i), mv, vv, c);
    store<T>(p + i, pv);
    store<T>(m + i, mv);
    store<T>(v + i, vv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    Vec<T> mv = load_first(m + i, rest);
    Vec<T> vv = load_first(v + i, rest);
    adam_lanes<T>(pv, load_first(g + i, rest), mv, vv, c);
    store_first<T>(p + i, pv, rest);
    store_first<T>(m + i, mv, rest);
    store_first<T>(v + i, vv, rest);
  }
}

// SGD on one vector of values (SgdCoefficients); buf is untouched without momentum.
template <class T>
[[gnu::always_inline]] inline void sgd_lanes(Vec<T>& p, Vec<T> g, Vec<T>& buf, const SgdCoefficients<T>& c) {
  const Vec<T> d = g + c.weight_decay * p;
  if (!c.with_momentum) {
    p -= c.learning_rate * d;
    return;
  }
  buf = c.first_step ? d : c.momentum * buf + c.keep * d;
  p -= c.learning_rate * (c.nesterov ? d + c.momentum * buf : buf);
}

template <class T>
void sgd_step(Target, T* p, const T* g, T* buf, index_t n, const SgdCoefficients<T>& c) {
  constexpr int L = lanes<T>;
  index_t i = 0;
  Vec<T> bv{};
  for (; i + L <= n; i += L) {
    Vec<T> pv = load(p + i);
    if (c.with_momentum) bv = load(buf + i);
    sgd_lanes<T>(pv, load(g + i), bv, c);
    store<T>(p + i, pv);
    if (c.with_momentum) store<T>(buf + i, bv);
  }
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    Vec<T> pv = load_first(p + i, rest);
    if (c.with_momentum) bv = load_first(buf + i, rest);
    sgd_lanes<T>(pv, load_first(g + i, rest), bv, c);
    store_first<T>(p + i, pv, rest);
    if (c.with_momentum) store_first<T>(buf + i, bv, rest);
  }
}
DUET_END_UNFUSED
}  // namespace duet::kernels::detail::avx512
DUET_END_ISA
#endif

namespace duet::kernels {

// One Adam step on n values: p, m and v updated in place from g. No alignment is assumed.
template <class T>
void adam_update(T* p, const T* g, T* m, T* v, index_t n, const AdamCoefficients<T>& c) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, 4, [&](index_t i0, index_t i1) {
    const detail::FlushSubnormals flush;
    detail::with_target(isa, [&](auto target) { adam_step(target, p + i0, g + i0, m + i0, v + i0, i1 - i0, c); });
  });
}

// One SGD step on n values; momentum is read and written only with_momentum.
template <class T>
void sgd_update(T* p, const T* g, T* momentum, index_t n, const SgdCoefficients<T>& c) {
  const Isa isa = active_isa();
  ::duet::detail::parallel_elements(n, 2, [&](index_t i0, index_t i1) {
    const detail::FlushSubnormals flush;
    detail::with_target(isa, [&](auto target) {
      sgd_step(target, p + i0, g + i0, c.with_momentum ? momentum + i0 : momentum, i1 - i0, c);
    });
  });
}

}  // namespace duet::kernels
// Parameters: the tensors a cell learns.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <vector>

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
    return view(0, to);
  }

  // The elements from `offset` on, as a view of shape `to` (a slice along the first axis).
  BasicTensor view(index_t offset, const Shape& to) const {
    if (!to.is_concrete() || offset < 0 || offset + to.numel() > numel()) {
      throw ShapeError("duet::Tensor::view: cannot view " + std::to_string(to.numel()) + " elements from element " +
                       std::to_string(offset) + " of " + to_string(shape_) + " as " + to_string(to));
    }
    BasicTensor v = *this;
    v.shape_ = to;
    v.data_ = data_ + offset;
    v.tape_id_ = 0;
    v.trace_id_ = 0;
    return v;
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

// The parameters whose gradient the calling thread's backward pass has written, in the order
// first written: what a training step checks against its network's registered parameters.
// Cleared, not freed, by each new pass, so training does not allocate once warm.
inline std::vector<const void*>& written_in_pass() {
  thread_local std::vector<const void*> written;
  return written;
}

// Told of a backward pass's gradient writes as they happen, on the thread that runs it: which
// parameter a kernel is about to write (grad_for_write), and that every kernel called so far
// has finished (an op that writes parameters' gradients asks for their buffers first and
// computes after, so only its end says they are written). A data-parallel training step
// starts summing the gradients that are final while backward goes on.
class GradientObserver {
 public:
  virtual void will_write(const void* parameter) = 0;
  virtual void writes_done() = 0;

 protected:
  ~GradientObserver() = default;
};

inline GradientObserver*& gradient_observer() {
  thread_local GradientObserver* observer = nullptr;
  return observer;
}

// Called at the end of each op that writes parameters' gradients. One that does not call it
// only makes its gradients known as final later (at the next op's call, or the pass's end).
inline void gradient_writes_done() {
  if (GradientObserver* observer = gradient_observer()) observer->writes_done();
}

// Makes the calling thread's next backward pass, unique in the program.
inline std::uint64_t begin_backward_pass() {
  static std::atomic<std::uint64_t> last{0};
  written_in_pass().clear();
  return current_backward_pass() = last.fetch_add(1, std::memory_order_relaxed) + 1;
}

// State that a forward pass changes (BatchNorm's moving statistics, Dropout's generator) and
// that a training step must leave as it was when it fails: such a step throws after the
// forward ran (a loss refusing its labels) or skips its update (a loss that is not finite).
// The owner saves its state the first time a step changes it and puts it back if the step
// does not commit; saving into buffers kept from step to step allocates nothing once warm.
class StepState {
 public:
  virtual void save_for_step() = 0;
  virtual void restore_step() = 0;

 protected:
  ~StepState() = default;
};

struct StepLog {
  int depth = 0;  // nested steps (a TrainOneStepCell's gradient) commit with the outermost
  std::vector<StepState*> saved;
};
inline StepLog& step_log() {
  thread_local StepLog log;
  return log;
}

// Called before a forward pass changes `state`. Outside a step (state changed by a kernel run
// outside any cell's call) the change is final at once, as the run itself is.
inline void will_change(StepState& state) {
  StepLog& log = step_log();
  if (log.depth == 0 || std::ranges::find(log.saved, &state) != log.saved.end()) return;
  state.save_for_step();
  log.saved.push_back(&state);
}

// One training step on this thread (value_and_grad's call, TrainOneStepCell's): every
// StepState it changes is put back when it ends without commit(), by an exception or not.
class StepScope {
 public:
  StepScope() { ++step_log().depth; }
  StepScope(const StepScope&) = delete;
  StepScope& operator=(const StepScope&) = delete;
  ~StepScope() {
    StepLog& log = step_log();
    if (--log.depth > 0) return;
    if (!committed_) {
      for (auto it = log.saved.rbegin(); it != log.saved.rend(); ++it) (*it)->restore_step();
    }
    log.saved.clear();
  }
  void commit() { committed_ = true; }

 private:
  bool committed_ = false;
};

// Runs a cell's forward call as one step of its own when no step is open: a call that throws
// (a shape error at a later layer, a label out of range in the loss) after BatchNorm or Dropout
// ran leaves their state as it was, as a failed training step does.
template <class F>
auto all_or_nothing(F&& call) {
  StepScope scope;
  auto result = std::forward<F>(call)();
  scope.commit();
  return result;
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
    if (!*accumulate && pass == duet::detail::current_backward_pass()) duet::detail::written_in_pass().push_back(this);
    if (duet::detail::GradientObserver* observer = duet::detail::gradient_observer()) observer->will_write(this);
    grad_pass_ = pass;
    return grad.data();
  }

  // Forgets the gradient of backward pass `pass`, as if it had not reached this parameter.
  void forget_grad(std::uint64_t pass) const {
    if (grad_pass_ == pass) grad_pass_ = 0;
  }

  // Whether backward pass `pass` wrote this parameter's gradient (it did not reach it otherwise).
  bool has_grad_from(std::uint64_t pass) const { return grad_pass_ == pass; }

  // A form of the values a kernel computes from them and keeps (the pre-packed weight of an
  // inference graph, the weight with a BatchNorm folded in): make() runs on first use, and again
  // whenever the values, or any of the tensors in `also` that the form is made from too, may
  // have changed since (version(), which optimisers, set_data, checkpoint loading and any
  // non-const access move), so a stale form is never returned. One form per parameter; safe
  // from several threads, and a returned form outlives a concurrent remake.
  template <class Form, class Make>
  std::shared_ptr<const Form> derived(Make&& make, std::initializer_list<const BasicTensor<T>*> also = {}) const {
    DerivedForm& d = derived_;
    std::lock_guard lock(d.mutex);
    const BasicTensor<T>& values = *this;
    // The same first element means the same block: the handles kept stop that block from being reused.
    const auto same = [](const Seen& seen, const BasicTensor<T>& now) {
      return seen.values.data() == now.data() && seen.values.shape() == now.shape() && seen.version == now.version();
    };
    bool current = d.form != nullptr && d.type == typeid(Form) && same(d.source, values) && d.also.size() == also.size();
    for (std::size_t i = 0; current && i < also.size(); ++i) current = same(d.also[i], *also.begin()[i]);
    if (!current) {
      d.form.reset();  // frees the old form before the new one is made, not after
      d.form = std::make_shared<const Form>(make());
      d.type = typeid(Form);
      d.source = {values, values.version()};
      d.also.clear();
      for (const BasicTensor<T>* t : also) d.also.push_back({*t, t->version()});
    }
    return std::static_pointer_cast<const Form>(d.form);
  }

  bool requires_grad = true;

  // The gradient from the last backward pass that reached this parameter; empty before.
  // Gradients are bookkeeping, not the parameter's value: kernels holding a const layer write them.
  mutable BasicTensor<T> grad;

 private:
  mutable std::uint64_t grad_pass_ = 0;

  // A tensor a form was made from, as it was then.
  struct Seen {
    BasicTensor<T> values;  // a handle: the block cannot be reused for other values meanwhile
    std::uint64_t version = 0;
  };
  struct DerivedForm {
    std::mutex mutex;
    Seen source;
    std::vector<Seen> also;
    std::type_index type = typeid(void);
    std::shared_ptr<const void> form;

    DerivedForm() = default;
    // A moved parameter makes its forms again; the mutex cannot move.
    DerivedForm(DerivedForm&&) noexcept {}
    DerivedForm& operator=(DerivedForm&&) noexcept {
      form.reset();
      source = Seen{};
      also.clear();
      return *this;
    }
    DerivedForm(const DerivedForm&) = delete;
    DerivedForm& operator=(const DerivedForm&) = delete;
    ~DerivedForm() = default;
  };
  mutable DerivedForm derived_;
};

using Parameter = BasicParameter<float>;

template <class X>
inline constexpr bool is_parameter_v = false;
template <class T>
inline constexpr bool is_parameter_v<BasicParameter<T>> = true;

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
  std::tuple<Fns...> fns{};  // their parameters, if any (LeakyReLU's alpha)
};

// How a loss turns per-element losses into its output (MindSpore's `reduction`). batchmean
// (the sum over the size of axis 0) is nn::KLDivLoss's only, as in MindSpore; the other
// losses refuse it at compile time.
enum class Reduction : unsigned char { none, mean, sum, batchmean };

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

// fns applied in order to an Eigen array expression, as one expression.
template <std::size_t I = 0, class... Fns, class Expr>
auto apply_all(const std::tuple<Fns...>& fns, const Expr& e) {
  if constexpr (I == sizeof...(Fns)) return e;
  else return apply_all<I + 1>(fns, std::get<I>(fns).array(e));
}

// Whether Fns give the same bits however a loop over them is split into SIMD vectors and
// scalars, and however it is fused with other arithmetic: those with a vector form for the
// product's registers (ReLU) are exact comparisons and selections. The others (exp, tanh,
// erf, ...) take Eigen's vectorised approximations on full vectors and the C library on the
// rest, and a compiler may contract their arithmetic into that of a neighbouring function
// (FMA); so that a fused graph computes what PyNative's one-function passes compute, they run
// one function at a time over the same flat layout.
template <class T, class... Fns>
inline constexpr bool exact_in_any_layout = (kernels::VectorFunction<Fns, T> && ...);
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
    if constexpr (detail::exact_in_any_layout<T, Fns...>) {
      if (epilogue.bias != nullptr) {
        using Row = ::Eigen::Array<T, 1, detail::eigen_size(Out)>;
        ::Eigen::Map<const Row> b(epilogue.bias, 1, out);
        Y.array() = detail::apply_all(epilogue.fns, Y.array().rowwise() + b);
      } else if constexpr (sizeof...(Fns) > 0) {
        Y.array() = detail::apply_all(epilogue.fns, Y.array());
      }
    } else {
      if (epilogue.bias != nullptr) add_bias(y, rows, out, epilogue.bias, y);
      map(epilogue.fns, y, rows * out, y);
    }
  }

  // c[m, n] = a[m, k] · b[k, n], all row-major: the product whose right operand is laid out
  // as im2col lays out an image's patches (ops/conv.hpp), which dense() would need transposed.
  template <class T>
  static void matmul(const T* a, index_t m, index_t k, const T* b, index_t n, T* c) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<Matrix>(c, m, n).noalias() = ::Eigen::Map<const Matrix>(a, m, k) * ::Eigen::Map<const Matrix>(b, k, n);
  }

  // dense() with a layer's weight, kept pre-packed from call to call where the backend has a
  // packed form (graphs not trained, at O1 and O2). Eigen packs inside each product, so here
  // it is dense(). dense_packed_of names the backend whose dense() it computes (packs_as_dense).
  using dense_packed_of = Eigen;
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

  // y[i] = fns(x[i]), the functions applied in order in one pass over memory; y may be x.
  // Functions that are not exact in any layout (detail::exact_in_any_layout) take turns on
  // blocks that stay in L1, each function's pass the very code that runs it alone.
  template <class... Fns, class T>
  static void map(const std::tuple<Fns...>& fns, const T* x, index_t n, T* y) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    if constexpr (sizeof...(Fns) == 1 || detail::exact_in_any_layout<T, Fns...>) {
      ::Eigen::Map<Array>(y, n) = detail::apply_all(fns, ::Eigen::Map<const Array>(x, n));
    } else {
      // A multiple of every SIMD width, so that each block splits into vectors and a scalar
      // tail exactly where one pass over all n elements does.
      constexpr index_t block = 1024;
      for (index_t i = 0; i < n; i += block) {
        const index_t m = std::min(block, n - i);
        const T* from = x + i;
        std::apply([&](const auto&... f) { ((map(std::tuple{f}, from, m, y + i), from = y + i), ...); }, fns);
      }
    }
  }
  template <class... Fns, class T>
  static void map(const T* x, index_t n, T* y) {
    map(std::tuple<Fns...>{}, x, n, y);
  }

  // dx[i] = dy[i] · Fn'(x[i]), Fn' written in terms of the output y = Fn(x), or of the input
  // (fn::grad_from_input), which is then what `y` points to.
  template <class Fn, class T>
  static void map_grad(const Fn& f, const T* dy, const T* y, index_t n, T* dx) {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    ::Eigen::Map<Array>(dx, n) = f.grad_array(::Eigen::Map<const Array>(dy, n), ::Eigen::Map<const Array>(y, n));
  }
  template <class Fn, class T>
  static void map_grad(const T* dy, const T* y, index_t n, T* dx) {
    map_grad(Fn{}, dy, y, n, dx);
  }

  // The gradient of y = Fns(x · wᵀ + b): dz = dy · Fns'(y), dw (+)= dzᵀ · x, db (+)= Σ_rows dz,
  // dx = dz · w.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_backward(const DenseBackwardArgs<T>& a, const std::tuple<Fns...>& fns = {}) {
    using XMatrix = detail::RowMajorMatrix<T, dyn, In>;
    using WMatrix = detail::RowMajorMatrix<T, Out, In>;
    using YMatrix = detail::RowMajorMatrix<T, dyn, Out>;
    ::Eigen::Map<const XMatrix> X(a.x, a.rows, a.in);
    ::Eigen::Map<const WMatrix> W(a.w, a.out, a.in);
    duet::detail::Storage masked;
    const T* dz = masked_gradient(a, fns, masked);
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
      const T lse = kernels::log_sum_exp(row, classes);
      T loss = 0;
      if constexpr (Sparse) {
        loss = lse - row[checked_label(labels[i], i, classes)];
      } else {
        loss = kernels::cross_entropy(row, labels + i * classes, classes, lse);
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
      const T lse = kernels::log_sum_exp(row, classes);
      const T scale = r == Reduction::none ? g[i] : r == Reduction::mean ? g[0] / static_cast<T>(rows) : g[0];
      if constexpr (Sparse) {
        kernels::softmax_grad(row, classes, lse, checked_label(labels[i], i, classes), scale, d);
      } else {
        // d/dz of Σ_c p_c (lse - z_c) is softmax · Σ_c p_c - p.
        const T* p = labels + i * classes;
        kernels::softmax_grad(row, p, classes, lse, kernels::sum(p, classes), scale, d);
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
    const T decay = s.decoupled ? T(1) - static_cast<T>(s.learning_rate * s.weight_decay) : T(1);
    const T l2 = s.decoupled ? T(0) : static_cast<T>(s.weight_decay);
    const double root_correction = std::sqrt(s.bias_correction2);
    const auto step = static_cast<T>(s.learning_rate * root_correction / s.bias_correction1);
    kernels::adam_update(p, g, m, v, n,
                         kernels::AdamCoefficients<T>{static_cast<T>(s.beta1), static_cast<T>(s.beta2),
                                                      static_cast<T>(s.eps * root_correction), l2, decay, step});
  }

  template <class T>
  static void sgd_update(T* p, const T* g, T* buf, index_t n, const SgdStep& s) {
    kernels::sgd_update(p, g, buf, n,
                        kernels::SgdCoefficients<T>{static_cast<T>(s.learning_rate), static_cast<T>(s.weight_decay),
                                                    static_cast<T>(s.momentum), static_cast<T>(1 - s.dampening),
                                                    s.momentum != 0, s.nesterov, s.first_step});
  }

  // dz = dy · Fn'(y) for a product's epilogue function, in `masked`; dy itself without one.
  template <class T, class... Fns>
  static const T* masked_gradient(const DenseBackwardArgs<T>& a, const std::tuple<Fns...>& fns,
                                  duet::detail::Storage& masked) {
    static_assert(sizeof...(Fns) <= 1, "duet: a product's epilogue differentiates through one function at most");
    if constexpr (sizeof...(Fns) == 1) {
      masked = duet::detail::Storage(static_cast<std::size_t>(a.rows * a.out) * sizeof(T));
      T* m = reinterpret_cast<T*>(masked.data());
      map_grad(std::get<0>(fns), a.dy, a.y, a.rows * a.out, m);
      return m;
    } else {
      return a.dy;
    }
  }

  template <class T>
  static void column_sums(const T* x, index_t rows, index_t cols, T* sums, bool accumulate) {
    using Matrix = detail::RowMajorMatrix<T, dyn, dyn>;
    ::Eigen::Map<::Eigen::Matrix<T, 1, ::Eigen::Dynamic>> s(sums, 1, cols);
    if (accumulate) s += ::Eigen::Map<const Matrix>(x, rows, cols).colwise().sum();
    else s = ::Eigen::Map<const Matrix>(x, rows, cols).colwise().sum();
  }

 private:
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
// each tile of the output while it is in registers. It does so for functions with a vector
// form (kernels::VectorFunction: ReLU); any other epilogue (sigmoid, GELU, LeakyReLU with its
// alpha, ...) runs as the map kernel over the finished product, so that the product's bits are
// the ones PyNative's unfused MatMul gets. Element types the kernel cannot take fall back to
// Eigen.
struct Native : Eigen {
  // map() on the instruction set chosen at run time, with the functions' vector forms (the
  // code a product's epilogue runs); functions without one go to Eigen.
  template <class... Fns, class T>
  static void map(const std::tuple<Fns...>& fns, const T* x, index_t n, T* y) {
    if constexpr (kernels::gemm_supports<T, Fns...>) kernels::map<Fns...>(x, n, y);
    // Functions without parameters are made afresh: GCC 12 takes a copy of an empty tuple (a
    // fused product's epilogue) for uninitialised memory (-Wmaybe-uninitialized).
    else if constexpr ((std::is_empty_v<Fns> && ...)) Eigen::map<Fns...>(x, n, y);
    else Eigen::map(fns, x, n, y);
  }
  template <class... Fns, class T>
  static void map(const T* x, index_t n, T* y) {
    map(std::tuple<Fns...>{}, x, n, y);
  }

  template <index_t In, index_t Out, class T, class... Fns>
  static void dense(const T* x, index_t rows, index_t in, const T* w, index_t out,
                    const Epilogue<T, Fns...>& epilogue, T* y) {
    if constexpr (kernels::gemm_supports<T, Fns...>) {
      kernels::gemm<In, Out, Fns...>(x, rows, in, w, out, epilogue.bias, y);
    } else if constexpr (kernels::gemm_supports<T>) {
      kernels::gemm<In, Out>(x, rows, in, w, out, epilogue.bias, y);
      map(epilogue.fns, y, rows * out, y);
    } else {
      Eigen::dense<In, Out>(x, rows, in, w, out, epilogue, y);
    }
  }

  template <class T>
  static void matmul(const T* a, index_t m, index_t k, const T* b, index_t n, T* c) {
    if constexpr (kernels::gemm_supports<T>) kernels::gemm_kn(a, m, k, b, n, c);
    else Eigen::matmul(a, m, k, b, n, c);
  }

  // Both products on duet's GEMM, so that they run on the instruction set chosen at run time
  // and on every thread, as the forward product does: dx = dz · w is gemm_kn (w is [out, in],
  // the [k, n] it reads), and dw (+)= dzᵀ · x is gemm_kn on a transposed copy of dz, which
  // costs rows·out copies against the product's rows·out·in multiply-adds and leaves x, the
  // larger operand, read in place.
  template <index_t In, index_t Out, class T, class... Fns>
  static void dense_backward(const DenseBackwardArgs<T>& a, const std::tuple<Fns...>& fns = {}) {
    if constexpr (!kernels::gemm_supports<T>) {
      Eigen::dense_backward<In, Out>(a, fns);
    } else {
      duet::detail::Storage masked;
      const T* dz = masked_gradient(a, fns, masked);
      duet::detail::Storage transposed(static_cast<std::size_t>(a.rows * a.out) * sizeof(T));
      T* dzt = reinterpret_cast<T*>(transposed.data());
      kernels::transpose(dz, a.rows, a.out, dzt);
      kernels::gemm_kn(dzt, a.out, a.rows, a.x, a.in, a.dw, a.accumulate_w);
      if (a.db != nullptr) column_sums(dz, a.rows, a.out, a.db, a.accumulate_b);
      if (a.dx != nullptr) kernels::gemm_kn(dz, a.rows, a.out, a.w, a.in, a.dx);
    }
  }

  // The weight is packed once per version of it (the parameter keeps the packed form), not
  // on every call; the product reads the same numbers in the same order, so the result is
  // the bits of dense().
  using dense_packed_of = Native;
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

namespace backend {
// Whether a product may call Backend::dense_packed for what Backend::dense computes. A backend
// deriving from another that replaces dense() alone inherits a dense_packed that would bypass
// the replacement (tests/backend.cpp's counting backend saw no calls once O1 packed weights): its
// products call dense() then, which runs the replacement and packs on every call.
template <class Backend, index_t In, index_t Out, class T, class... Fns>
constexpr bool packs_as_dense() {
  if constexpr (requires { typename Backend::dense_packed_of; }) {
    return &Backend::template dense<In, Out, T, Fns...> ==
           &Backend::dense_packed_of::template dense<In, Out, T, Fns...>;
  } else {
    return false;
  }
}

// Whether Backend's dense<In, Out> may give other bits than its dense<dyn, dyn>. Native's
// differs only where the GEMM unrolls small static layers (or falls back to Eigen for types it
// has no kernels for); Eigen's fixed-size products are other code. Where it does not, an
// nn::Dense<In, Out> runs Dense<>'s code in both modes (nn::SizedLayer).
template <class Backend, index_t In, index_t Out, class T>
constexpr bool dense_depends_on_sizes() {
  if constexpr (std::is_same_v<Backend, Native>) return !kernels::gemm_supports<T> || kernels::unrolls<In, Out>;
  else return In != dyn || Out != dyn;
}
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
#include <ostream>
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
  // The threads duet's operations may use in all (duet::set_num_threads, threads.hpp).
  std::optional<int> num_threads = std::nullopt;
};

struct Context {
  Mode mode = PYNATIVE_MODE;
  bool jit_enabled = true;
  int num_threads = 1;
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

// Every field is checked before any is applied: a refused call changes nothing.
inline void set_context(const ContextConfig& config) {
  if (config.num_threads) detail::checked_num_threads(*config.num_threads, "duet::set_context: num_threads");
  if (config.mode) {
    // CONTEXT_MODE is what a cell follows, not a mode the context can be in.
    if (*config.mode != GRAPH_MODE && *config.mode != PYNATIVE_MODE) {
      throw ValueError("duet::set_context: mode must be GRAPH_MODE or PYNATIVE_MODE");
    }
    detail::context_mode().store(*config.mode, std::memory_order_relaxed);
  }
  if (config.jit_enabled) detail::jit_enabled().store(*config.jit_enabled, std::memory_order_relaxed);
  if (config.num_threads) detail::num_threads_storage().store(*config.num_threads, std::memory_order_relaxed);
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
                 detail::jit_enabled().load(std::memory_order_relaxed), get_num_threads()};
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
#include <string_view>
#include <typeinfo>
#include <utility>

// MindSpore's pad_mode, shared by the layers that slide a window (convolution, pooling).

#include <string_view>

namespace duet::nn {

// same: ceil(size / stride) outputs, the padding split evenly with the odd one after (bottom,
// right); valid: no padding; pad: a given padding on each side (PyTorch's padding).
enum class PadMode : unsigned char { same, valid, pad };

constexpr std::string_view name_of(PadMode m) {
  return m == PadMode::same ? "same" : m == PadMode::valid ? "valid" : "pad";
}

}  // namespace duet::nn

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#define DUET_HAS_CXXABI 1
#endif

namespace duet::detail {

// The demangler writes an enum template argument as a cast, "(duet::Mode)0"; these are the
// spellings a user writes instead, for the enums that appear in cells' template arguments.
inline std::string spell_enum_arguments(std::string name) {
  const auto spelled = [](auto value, std::string_view cast, std::string spelling) {
    return std::pair{std::string(cast) + std::to_string(static_cast<int>(value)), std::move(spelling)};
  };
  const std::pair<std::string, std::string> spellings[] = {
      spelled(Mode::graph, "(Mode)", "GRAPH_MODE"),
      spelled(Mode::pynative, "(Mode)", "PYNATIVE_MODE"),
      spelled(Mode::context, "(Mode)", "CONTEXT_MODE"),
      spelled(nn::PadMode::same, "(nn::PadMode)", "nn::PadMode::same"),
      spelled(nn::PadMode::valid, "(nn::PadMode)", "nn::PadMode::valid"),
      spelled(nn::PadMode::pad, "(nn::PadMode)", "nn::PadMode::pad"),
      spelled(Reduction::none, "(Reduction)", "Reduction::none"),
      spelled(Reduction::mean, "(Reduction)", "Reduction::mean"),
      spelled(Reduction::sum, "(Reduction)", "Reduction::sum"),
      spelled(Reduction::batchmean, "(Reduction)", "Reduction::batchmean"),
  };
  for (const auto& [cast, spelling] : spellings) {
    for (std::size_t at; (at = name.find(cast)) != std::string::npos;) name.replace(at, cast.size(), spelling);
  }
  return name;
}

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
  return spell_enum_arguments(std::move(out));
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
#include <cstddef>
#include <cstdint>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

// Shape rules' results and how a broken rule is reported: a static_assert naming the layer,
// its requirement and the input shape when the shapes are known at compile time, a
// duet::ShapeError with the same words when they are known only at run time.

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
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
  broadcast,        // the two inputs' shapes must broadcast together (numpy's rule)
  inner_dimensions,  // a product's inner dimensions must match (matmul: a's columns, b's rows)
  empty_reduction,   // an axis reduced by max, min or argmax must not be empty
  total_elements,     // the input must hold `expected` elements (reshape)
  elements_multiple,  // the input's element count must be a multiple of `expected` (reshape with -1)
  axis_not_one,       // the input's axis `expected` must have size 1 (squeeze)
  sizes_except_axis,  // every input's sizes must match input 0's except along axis `expected` (concat)
  axis_size,          // the input's size along the operation's axis must be `expected` (split)
  slice_range,        // the input's axis `expected` must hold the slice's range (slice)
  channel_dimension,  // the input's dimension 1 (channels, NCHW) must equal `expected` (BatchNorm, Conv)
  spatial_size,       // each spatial axis must be at least `expected`: the (dilated) window less the padding
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

// The input a broadcast fault's culprit does not broadcast with: `expected` when it names
// another input (an operation of three inputs, such as where), else the other of two.
constexpr std::size_t broadcast_partner(const ShapeResult& r) {
  if (r.expected != r.input) return static_cast<std::size_t>(r.expected);
  return r.input == 0 ? 1 : 0;
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
    case ShapeFault::broadcast:
      what = "inputs of the same shape";
      break;
    case ShapeFault::inner_dimensions:
      what = "inputs whose inner dimensions match";
      break;
    case ShapeFault::empty_reduction:
      what = "an input with no empty axis among those it reduces (the maximum of nothing is undefined)";
      break;
    case ShapeFault::batch_dimension:
      return std::string(layer) + " expects an input of rank at least " + e +
             " whose first dimension is the batch, got " + got + ": the batch dimension is missing";
    case ShapeFault::total_elements:
      what = "an input of " + e + " elements";
      break;
    case ShapeFault::elements_multiple:
      what = "an input whose element count is a multiple of " + e;
      break;
    case ShapeFault::axis_not_one:
      what = "an input whose axis " + e + " has size 1";
      break;
    case ShapeFault::sizes_except_axis: {
      std::string all;
      for (const Shape& s : inputs) all += (all.empty() ? "" : ", ") + to_string(s);
      return std::string(layer) + " expects inputs of one rank whose sizes match except along axis " + e + ", got " +
             all;
    }
    case ShapeFault::axis_size:
      what = "an input of size " + e + " along its axis";
      break;
    case ShapeFault::slice_range:
      what = "an input whose axis " + e + " holds the slice's range";
      break;
    case ShapeFault::spatial_size:
      what = "an input whose spatial axes (after batch and channels) are each at least " + e +
             ", to hold its window less the padding";
      break;
    case ShapeFault::channel_dimension:
      what = "an input whose dimension 1 (channels) is " + e;
      break;
  }
  if (r.fault == ShapeFault::broadcast && inputs.size() > 1) {
    const std::size_t a = static_cast<std::size_t>(r.input);
    const std::size_t b = broadcast_partner(r);
    return std::string(layer) + " expects inputs whose shapes broadcast together (numpy's rule: sizes equal or 1, "
           "aligned at the last axis), got " + to_string(inputs[std::min(a, b)]) + " and " +
           to_string(inputs[std::max(a, b)]);
  }
  if (r.fault == ShapeFault::inner_dimensions && inputs.size() > 1) {
    return std::string(layer) + " expects inputs whose inner dimensions match (the columns of the first, the "
           "rows of the second, after their transposes), got " + to_string(inputs[0]) + " and " + to_string(inputs[1]);
  }
  if (r.fault == ShapeFault::shapes_differ && inputs.size() > 1) {
    return std::string(layer) + " expects inputs of matching shapes, got " + to_string(inputs[0]) + " and " +
           to_string(inputs[r.input == 0 ? 1 : static_cast<std::size_t>(r.input)]);
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
// The other input's shape, which this one must broadcast with.
template <class OtherShape>
struct must_broadcast_with {};
template <index_t N>
struct batch_dimension_missing_rank_must_be_at_least {};
// The other factor's shape, whose rows this one's columns must match (after transposes).
template <class OtherShape>
struct inner_dimension_must_match {};
struct reduced_axes_must_not_be_empty {};
template <index_t N>
struct element_count_must_be {};
template <index_t N>
struct element_count_must_be_a_multiple_of {};
template <index_t N>
struct axis_must_have_size_1 {};
template <index_t N>
struct sizes_must_match_input_0_except_along_axis {};
template <index_t N>
struct size_along_the_axis_must_be {};
template <index_t N>
struct axis_must_hold_the_slice {};
template <index_t N>
struct channel_dimension_must_be {};
// A window's extent (a convolution's kernel, dilated) less the padding: a smaller input leaves
// no output.
template <index_t N>
struct spatial_sizes_must_be_at_least {};

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
  else if constexpr (F == ShapeFault::empty_reduction)
    return reduced_axes_must_not_be_empty{};
  else if constexpr (F == ShapeFault::total_elements)
    return element_count_must_be<N>{};
  else if constexpr (F == ShapeFault::elements_multiple)
    return element_count_must_be_a_multiple_of<N>{};
  else if constexpr (F == ShapeFault::axis_not_one)
    return axis_must_have_size_1<N>{};
  else if constexpr (F == ShapeFault::sizes_except_axis)
    return sizes_must_match_input_0_except_along_axis<N>{};
  else if constexpr (F == ShapeFault::axis_size)
    return size_along_the_axis_must_be<N>{};
  else if constexpr (F == ShapeFault::slice_range)
    return axis_must_hold_the_slice<N>{};
  else if constexpr (F == ShapeFault::channel_dimension)
    return channel_dimension_must_be<N>{};
  else if constexpr (F == ShapeFault::spatial_size)
    return spatial_sizes_must_be_at_least<N>{};
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

template <class ShapeOf>
using shape_type_of = decltype(shape_type<ShapeOf>(std::make_index_sequence<static_cast<std::size_t>(ShapeOf::shape.rank())>{}));

// The report of two inputs that do not broadcast: the culprit's shape, and the other's in the
// requirement, so that both are named.
template <class Layer, class Culprit, class Other>
using broadcast_rejection = rejected<Layer, must_broadcast_with<shape_type_of<Other>>, shape_type_of<Culprit>>;
// The report of a product whose factors' inner dimensions differ: both shapes named.
template <class Layer, class Culprit, class Other>
using inner_dimension_rejection =
    rejected<Layer, inner_dimension_must_match<shape_type_of<Other>>, shape_type_of<Culprit>>;

// The report of Layer's rule broken with fault F (N being what it expected) by an input whose
// shape is ShapeOf::shape.
template <class Layer, ShapeFault F, index_t N, class ShapeOf>
using rejection = rejected<Layer, decltype(requirement<F, N>()),
                           decltype(shape_type<ShapeOf>(
                               std::make_index_sequence<static_cast<std::size_t>(ShapeOf::shape.rank())>{}))>;

// Reports Op's shape rule broken by inputs whose shapes compile time knows (Inputs::shape...):
// the op, its requirement and the culprit's shape, and the other operand's shape where the
// fault is between two. Instantiated where the op meets its inputs (a capture, or a call on
// static tensors), so that the error points at that line.
template <class Op, class... Inputs>
constexpr void report_static_fault() {
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, sizeof...(Inputs)>{Inputs::shape...});
  if constexpr (!r.ok()) {
    using In = std::tuple<Inputs...>;
    using Layer = typename Op::layer_type;
    using Culprit = std::tuple_element_t<static_cast<std::size_t>(r.input), In>;
    if constexpr (r.fault == ShapeFault::broadcast) {
      static_cast<void>(sizeof(broadcast_rejection<Layer, Culprit, std::tuple_element_t<broadcast_partner(r), In>>));
    } else if constexpr (r.fault == ShapeFault::inner_dimensions) {
      static_cast<void>(
          sizeof(inner_dimension_rejection<Layer, Culprit, std::tuple_element_t<r.input == 0 ? 1 : 0, In>>));
    } else {
      static_cast<void>(sizeof(rejection<Layer, r.fault, r.expected, Culprit>));
    }
  }
}

}  // namespace diagnostic
}  // namespace duet
// Graph capture: the compile-time IR of graph mode.
//
// A graph is a flat list of nodes (a NodeList), each an operation applied to the outputs of
// earlier nodes named by index, like SSA. Calling a cell's construct on a Sym (a symbolic
// tensor: a graph plus the index of the node it stands for) appends nodes instead of
// computing, so construct(Sym) returns the whole network as a type. The list stays flat, not
// nested like relu<dense<relu<...>>>, which keeps type names short and compiles faster.
//
// Every node holds an operation: the contract it meets is in operation.hpp.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// The operation contract: what every node of a graph and every record of a tape is.
//
// An operation is a small value type (often empty, or a pointer to the layer that owns its
// parameters). It is written once and serves both modes: PyNative calls its shape rule and
// kernel on live tensors (eager.hpp), graph mode on the nodes of a captured graph
// (graph.hpp, evaluator.hpp). Deriving from ops::Primitive<Self> gives the defaults, so an
// operation states only what differs from them:
//
//   static constexpr int arity                       number of inputs (required)
//   static constexpr ShapeResult infer_static(std::span<const Shape>)
//                                                    its shape rule, constexpr: run on patterns
//                                                    at compile time, on shapes at run time
//                                                    (required)
//   template <class Backend, class T> void run(const graph::KernelArgs&) const
//                                                    its kernel; T is the type of the value it
//                                                    makes (required unless a view)
//   static std::string op_name()                     what it does, for graph_ir (required)
//
//   ShapeResult infer(std::span<const Shape>) const  default: infer_static; an operation whose
//                                                    sizes live in its layer overrides it
//   std::string label() const                        who does it, for run-time errors; default
//                                                    op_name()
//   using layer_type                                 the name compile-time errors show; default
//                                                    the operation itself
//   using value_type                                 the type of its value when it is not its
//                                                    first input's
//   is_view (output is input 0's elements, from view_offset() on, with another shape; no
//   kernel, no copy), is_elementwise
//   (unary, same shape: runs in place, fuses as an epilogue), is_sink (makes no value, runs
//   for its side effects), has_side_effects (a view whose kernel still runs), has_parameters:
//   all false by default.
//
// Differentiation. For each input K, `template <std::size_t K> auto grad_op() const` returns
// the operation that makes d(loss)/d(input K) from what it reads; the gradient operation
// names what it reads in `static constexpr std::array reads` (graph::Operand values: the
// incoming gradient, an input, the output). An input that has no gradient (integer labels, a
// condition) returns ops::NoGradient, and a gradient that reaches it is an error. An
// operation with parameters writes their gradients from grad_op<0>(), and from
// parameter_grad_op() when input 0 needs none. An operation either gives every input's
// gradient (DifferentiableOperation), or says `static constexpr bool differentiable = false`
// (argmax): one that gives some but not all is a compile error wherever it is used, so a
// missing gradient is never a silent zero.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>


namespace duet {

namespace graph {

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

// What a gradient op reads, by its place around the forward op it differentiates. Inputs past
// input2 are input_operand(k) (concat's gradients read up to all N inputs), so output stands
// clear of them.
enum class Operand : unsigned char { grad, input0, input1, input2, output = 255 };

constexpr Operand input_operand(std::size_t k) { return static_cast<Operand>(1 + k); }

}  // namespace graph

namespace ops {

// The defaults of the contract. Self is the operation deriving from it.
template <class Self>
struct Primitive {
  using layer_type = Self;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_sink = false;
  static constexpr bool has_side_effects = false;
  static constexpr bool has_parameters = false;

  ShapeResult infer(std::span<const Shape> in) const { return Self::infer_static(in); }
  std::string label() const { return Self::op_name(); }
};

// What grad_op<K>() returns for an input that has no gradient.
struct NoGradient {};

// The functions duet's operation headers define, by the names users call them with. The
// gradient harness (tests/ops_gradients.cpp) runs each in both modes and fails on a name it
// has no case for, so an operation cannot be added unchecked. A header lists its own:
//   inline const bool arithmetic_listed = ops::list_operations({"add", "sub", ...});
inline std::vector<std::string_view>& catalogue() {
  static std::vector<std::string_view> names;
  return names;
}
inline bool list_operations(std::initializer_list<std::string_view> names) {
  catalogue().insert(catalogue().end(), names);
  return true;
}

}  // namespace ops

// An operation a graph or a tape can hold: its shape rule, its name and its flags.
template <class Op>
concept Operation = requires(const Op& op, std::span<const Shape> shapes) {
  { Op::arity } -> std::convertible_to<int>;
  { Op::infer_static(shapes) } -> std::same_as<ShapeResult>;
  { op.infer(shapes) } -> std::same_as<ShapeResult>;
  { Op::op_name() } -> std::convertible_to<std::string>;
  { op.label() } -> std::convertible_to<std::string>;
  typename Op::layer_type;
  { Op::is_view } -> std::convertible_to<bool>;
  { Op::is_elementwise } -> std::convertible_to<bool>;
};

// Whether Op writes gradients of parameters it owns (a layer's weight).
template <class Op>
constexpr bool has_parameters() {
  if constexpr (requires { Op::has_parameters; }) return Op::has_parameters;
  else return false;
}

namespace detail {

// A grad_op<K> that deduces void (`if constexpr (K == 0) return ...;` with no other branch)
// gives no gradient: it counts as missing, so the contract's check names the input.
template <class Op, std::size_t K>
concept has_grad_op = requires(const Op& op) { op.template grad_op<K>(); } &&
                      !std::is_void_v<decltype(std::declval<const Op&>().template grad_op<K>())>;

template <class Op>
constexpr bool declares_non_differentiable() {
  if constexpr (requires { Op::differentiable; }) return !Op::differentiable;
  else return false;
}

template <class Op>
constexpr std::size_t gradients_given() {
  return [&]<std::size_t... K>(std::index_sequence<K...>) {
    return (std::size_t{0} + ... + std::size_t{has_grad_op<Op, K>});
  }(std::make_index_sequence<static_cast<std::size_t>(Op::arity)>{});
}

template <class Op>
constexpr bool has_parameter_grad_op() {
  if constexpr (!duet::has_parameters<Op>()) return true;
  else return requires(const Op& op) { op.parameter_grad_op(); };
}

}  // namespace detail

// An operation whose every input has a gradient rule (possibly NoGradient), and that does not
// declare itself non-differentiable.
template <class Op>
concept DifferentiableOperation = Operation<Op> && !detail::declares_non_differentiable<Op>() &&
                                  detail::gradients_given<Op>() == static_cast<std::size_t>(Op::arity) &&
                                  detail::has_parameter_grad_op<Op>();

namespace diagnostic {

template <class Op>
struct is_an_operation {
  static constexpr bool value = false;
};
template <class Op, std::size_t Input>
struct gives_the_gradient_of_input {
  static constexpr bool value = false;
};

// Checks Op against the contract where it enters a graph or a tape (instantiated there with
// sizeof); a class, so that one operation is reported once wherever it is used.
template <class Op>
struct check_operation {
  static_assert(Operation<Op> || is_an_operation<Op>::value,
                "duet: this type is used as an operation but does not meet duet::Operation (arity, "
                "infer_static, op_name; derive from duet::ops::Primitive<Self> for the rest)");
  static constexpr std::size_t first_missing = [] {
    if constexpr (!Operation<Op>) {
      return std::size_t{0};
    } else {
      std::size_t missing = static_cast<std::size_t>(Op::arity);
      [&]<std::size_t... K>(std::index_sequence<K...>) {
        ((missing = !detail::has_grad_op<Op, K> && missing == static_cast<std::size_t>(Op::arity) ? K : missing),
         ...);
      }(std::make_index_sequence<static_cast<std::size_t>(Op::arity)>{});
      return missing;
    }
  }();
  static constexpr bool partial = Operation<Op> && !detail::declares_non_differentiable<Op>() &&
                                  detail::gradients_given<Op>() > 0 &&
                                  detail::gradients_given<Op>() < static_cast<std::size_t>(Op::arity);
  static_assert(!partial || gives_the_gradient_of_input<typename Op::layer_type, first_missing>::value,
                "duet: an operation gives the gradient of some inputs but not of the one named in the "
                "condition; define grad_op<K>() for every input K (ops::NoGradient where there is none), "
                "or declare `static constexpr bool differentiable = false`");
};

}  // namespace diagnostic

// Where a view's elements begin in its input's, in elements: 0 (the input's first), unless
// the view says otherwise with `index_t view_offset(const Shape& input) const` (a slice along
// the first axis).
template <class Op>
index_t view_offset(const Op& op, const Shape& input) {
  if constexpr (requires { op.view_offset(input); }) return op.view_offset(input);
  else return 0;
}

// Whether a gradient reaching a NoGradient input of type In, of an operation whose output is
// Out, would be lost: integer labels, conditions and comparisons' outputs carry none to lose.
// Both modes refuse the loss at run time with this message.
template <class In, class Out>
inline constexpr bool loses_gradient = std::is_floating_point_v<In> && std::is_floating_point_v<Out>;

inline std::string lost_gradient_message(const std::string& op, std::size_t k) {
  const std::string input = std::to_string(k);
  return "duet::grad: " + op + " has no gradient for input " + input + " (its grad_op<" + input +
         ">() is ops::NoGradient), but that input depends on what is differentiated: its gradient would be a "
         "silent zero";
}

// Whether grad_op<K>() of Op gives an actual gradient, not NoGradient.
template <class Op, std::size_t K>
constexpr bool input_has_gradient() {
  if constexpr (!detail::has_grad_op<Op, K>) return false;
  else return !std::is_same_v<decltype(std::declval<const Op&>().template grad_op<K>()), ops::NoGradient>;
}

}  // namespace duet

namespace duet::graph {

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
// A span, not the graph's array: every graph captured on the way to a network has its own
// size, and the rule of each node is instantiated once, not once per graph it is in.
template <class N>
constexpr ShapeResult static_rule(std::span<const Shape> shapes) {
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

template <class Op>
inline constexpr bool declares_value_type = requires { typename Op::value_type; };

template <class N>
constexpr std::size_t first_argument() {
  if constexpr (N::arity == 0)
    return 0;
  else
    return N::args[0];
}

// For each node, the node whose operation declares its element type: itself, or (an operation
// that keeps its input's type) its first input's source. An array computed once per graph: the
// type recursion it replaces ran back through the graph for every captured value, and a network
// of n nodes is captured through n graphs.
template <class... Nodes>
constexpr std::array<std::size_t, sizeof...(Nodes)> value_type_sources() {
  constexpr std::array<bool, sizeof...(Nodes)> declares{declares_value_type<typename Nodes::op_type>...};
  constexpr std::array<std::size_t, sizeof...(Nodes)> first{first_argument<Nodes>()...};
  std::array<std::size_t, sizeof...(Nodes)> source{};
  for (std::size_t i = 0; i < sizeof...(Nodes); ++i) source[i] = declares[i] ? i : source[first[i]];
  return source;
}

namespace detail {
// Node I of a list, held in a base of its own. A lookup by index is overload resolution
// against these bases (select, get): what it instantiates depends on I and the node's type
// only, so it is shared by every graph that has that node there, where a tuple's accessor is
// instantiated per tuple type and index, and capture makes a new tuple type per operation.
template <std::size_t I, class N>
struct slot {
  N node;
};
template <class Indices, class... Nodes>
struct slots;
template <std::size_t... I, class... Nodes>
struct slots<std::index_sequence<I...>, Nodes...> : slot<I, Nodes>... {
  slots() = default;
  explicit slots(std::in_place_t, const Nodes&... n) : slot<I, Nodes>{n}... {}
};
template <std::size_t I, class N>
std::type_identity<N> select(const slot<I, N>&);
}  // namespace detail

// A list of nodes: what the passes and the backward builder grow a graph in, node by node.
// It is not a Graph, whose shape inference would run on every list on the way.
template <class... Nodes>
struct NodeList : detail::slots<std::index_sequence_for<Nodes...>, Nodes...> {
  static constexpr std::size_t size = sizeof...(Nodes);
  using list_type = NodeList;
  using detail::slots<std::index_sequence_for<Nodes...>, Nodes...>::slots;
};

template <class... Nodes>
struct Graph : NodeList<Nodes...> {
  // Shape inference: every node's output shape as far as compile time knows it.
  static constexpr std::array<Shape, sizeof...(Nodes)> shapes = infer_static_shapes<Nodes...>();
  static constexpr std::array<std::size_t, sizeof...(Nodes)> value_type_source = value_type_sources<Nodes...>();
  using NodeList<Nodes...>::NodeList;
  Graph() = default;
  explicit Graph(const NodeList<Nodes...>& nodes) : NodeList<Nodes...>(nodes) {}
};

// The type of node I of a graph or list.
template <class G, std::size_t I>
using node_at = typename decltype(detail::select<I>(std::declval<const G&>()))::type;

// Node I of a graph or list.
template <std::size_t I, class N>
constexpr const N& get(const detail::slot<I, N>& s) {
  return s.node;
}

namespace detail {
template <class To, class L, std::size_t... I, class... Tail>
To rebuilt(const L& from, std::index_sequence<I...>, const Tail&... tail) {
  return To(std::in_place, get<I>(from)..., tail...);
}
}  // namespace detail

// The graph of a list's nodes.
template <class... Nodes>
Graph<Nodes...> make_graph(const NodeList<Nodes...>& nodes) {
  return Graph<Nodes...>(nodes);
}

// A list or graph with nodes appended, made in one function (of as many copies as nodes) per
// list: capture appends once per operation.
template <class... Nodes, class... New>
NodeList<Nodes..., New...> with_nodes(const NodeList<Nodes...>& list, const New&... nodes) {
  return detail::rebuilt<NodeList<Nodes..., New...>>(list, std::index_sequence_for<Nodes...>{}, nodes...);
}
template <class... Nodes, class New>
Graph<Nodes..., New> with_node(const Graph<Nodes...>& g, const New& node) {
  return detail::rebuilt<Graph<Nodes..., New>>(g, std::index_sequence_for<Nodes...>{}, node);
}

// A list built from a plan in types. Each Step names a node type and its recipe, a type whose
// make(g) makes the node's operation from the graph g the plan was made from. The passes and
// the backward builder plan in types and build the list once: growing it node by node would
// instantiate a function copying the list so far per node, quadratic in the graph's size.
template <class Node, class Recipe>
struct Step {
  using node = Node;
  using recipe = Recipe;
};

// Recipes: node J's operation as it is; an operation of type Op made afresh.
template <std::size_t J>
struct Take {
  template <class G>
  static auto make(const G& g) {
    return get<J>(g).op;
  }
};
template <class Op>
struct Made {
  template <class G>
  static Op make(const G&) {
    return Op{};
  }
};

template <class L, class X>
struct appended;
template <class... S, class X>
struct appended<NodeList<S...>, X> {
  using type = NodeList<S..., X>;
};

// The list (or graph: L = Graph) a plan of steps S makes from g, then the nodes tail.
template <template <class...> class L = NodeList, class G, class... S, class... Tail>
L<typename S::node..., Tail...> from_plan(const G& g, NodeList<S...>*, const Tail&... tail) {
  return L<typename S::node..., Tail...>(std::in_place, typename S::node{S::recipe::make(g)}..., tail...);
}

// A list of f(node) for each node of g.
template <class L, class F>
auto transformed(const L& list, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return NodeList<decltype(f(get<I>(list)))...>(std::in_place, f(get<I>(list))...);
  }(std::make_index_sequence<L::size>{});
}

// The element type of the value an op makes from inputs whose first has type First.
template <class Op, class First>
constexpr auto op_value_type() {
  if constexpr (declares_value_type<Op>)
    return std::type_identity<typename Op::value_type>{};
  else
    return std::type_identity<First>{};
}
template <class Op, class First>
using op_value_t = typename decltype(op_value_type<Op, First>())::type;

// The element type of node I's value.
template <class G, std::size_t I>
using node_value_t = typename node_at<G, G::value_type_source[I]>::op_type::value_type;

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

// Capture merges two nodes of one type on the same inputs into one (graph::detail::merge_from),
// but the type cannot tell whether they are one value: `wq(x)` and `wk(x)` with wq, wk two
// nn::Dense<64, 64>, or `s * 2` and `s * 3`, have the types of `s` and `s` again. Each node
// therefore carries a run-time id, new for each node append makes, the parameter's own for a
// parameter node, none (0) for graph inputs (which are one value per index). Ids are even; a
// parameter's is its address with the low bit set, so the two never meet.
inline std::uint64_t new_node_id() {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(2, std::memory_order_relaxed) + 2;
}

template <class G, std::size_t Out>
struct Sym {
  using graph_type = G;
  using value_type = node_value_t<G, Out>;
  static constexpr std::size_t output = Out;
  static constexpr Shape shape = G::shapes[Out];
  G graph;
  // Capture's run-time knowledge (passes and build_backward leave it behind): each node's id,
  // and, when a merge met two nodes of one type, inputs and place whose ids differ, what they
  // are. Such a graph computes one value where the function computes two: it must not run.
  std::array<std::uint64_t, G::size> ids{};
  std::string ambiguity{};

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

// Graph input K, of element type T, whose shape is known as far as Pattern says (a
// StaticShape, or AnyShape).
template <std::size_t K, class Pattern, class T>
struct InputOp : ops::Primitive<InputOp<K, Pattern, T>> {
  using value_type = T;
  using pattern = Pattern;
  static constexpr int arity = 0;
  static constexpr std::size_t index = K;
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Pattern::value}; }
  static std::string op_name() { return "Input " + std::to_string(K); }
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

// What a graph is captured for: training or evaluation (MindSpore's set_train). A layer that
// behaves differently in the two (nn::BatchNorm2d, nn::Dropout) reads the phase from its
// input's type and appends that phase's operation, so the two forms of a network are two
// types, compiled and cached apart, and an evaluation form can be rewritten by passes (a
// BatchNorm folded into the convolution before it) without touching the training form. A
// capture is for training unless its inputs' pattern is an Evaluation.
enum class Phase : unsigned char { train, eval };

template <class Pattern>
struct Evaluation {
  static constexpr Shape value = Pattern::value;
};

template <Phase P, class Pattern>
using pattern_in_phase = std::conditional_t<P == Phase::eval, Evaluation<Pattern>, Pattern>;

template <class G>
constexpr Phase phase_of_graph();

namespace detail {
template <class Pattern>
struct pattern_phase {
  static constexpr Phase value = Phase::train;
};
template <class P>
struct pattern_phase<Evaluation<P>> {
  static constexpr Phase value = Phase::eval;
};
// A quiet capture (graph::quietly, a SequentialCell's chain) is in the phase of the value it
// continues.
template <class P>
struct pattern_phase<Quiet<P>> : pattern_phase<P> {};
template <class S>
struct pattern_phase<SameShapeAs<S>> {
  static constexpr Phase value = phase_of_graph<typename S::graph_type>();
};
}  // namespace detail

// The input of a part captured apart from the graph it continues (spliced): the shape and the
// phase of the value it continues, spelled out, so that a chain of parts does not nest their
// types in one another.
template <Phase P, bool LeadingUnknown, index_t... Dims>
struct Continuing {
  static constexpr Shape value = [] {
    Shape s = LeadingUnknown ? Shape::any() : Shape{};
    (s.push_back(Dims), ...);
    return s;
  }();
};
namespace detail {
template <Phase P, bool L, index_t... D>
struct pattern_phase<Continuing<P, L, D...>> {
  static constexpr Phase value = P;
};
}  // namespace detail

// The phase G is captured for: its inputs'. (A graph of parameters alone is a training one.)
template <class G>
constexpr Phase phase_of_graph() {
  Phase phase = Phase::train;
  bool found = false;
  for_each_index<G::size>([&](auto i) {
    using Op = typename node_at<G, decltype(i)::value>::op_type;
    if constexpr (is_input_op_v<Op>) {
      if (!found) phase = detail::pattern_phase<typename Op::pattern>::value;
      found = true;
    }
  });
  return phase;
}

// The phase a symbolic tensor is captured in, for a layer's construct.
template <class X>
constexpr Phase phase_of() {
  return phase_of_graph<typename std::remove_cvref_t<X>::graph_type>();
}

// An operation whose behaviour depends on the phase declares it, `static constexpr Phase
// phase`, and says which phase its layer is set to now, `Phase requested_phase() const`.
template <class Op>
concept PhaseDependent = requires(const Op& op) {
  { Op::phase } -> std::convertible_to<Phase>;
  { op.requested_phase() } -> std::same_as<Phase>;
  { op.layer_label() } -> std::convertible_to<std::string>;
};

// The nodes of G whose operations depend on the phase, in order.
template <class G>
constexpr auto phase_dependent_nodes() {
  constexpr std::size_t count = [] {
    std::size_t n = 0;
    for_each_index<G::size>([&](auto i) {
      if constexpr (PhaseDependent<typename node_at<G, decltype(i)::value>::op_type>) ++n;
    });
    return n;
  }();
  std::array<std::size_t, count> nodes{};
  std::size_t n = 0;
  for_each_index<G::size>([&](auto i) {
    if constexpr (PhaseDependent<typename node_at<G, decltype(i)::value>::op_type>) nodes[n++] = decltype(i)::value;
  });
  return nodes;
}

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

template <class L, std::size_t K>
constexpr std::size_t find_input() {
  std::size_t found = L::size;
  for_each_index<L::size>([&](auto i) {
    using Op = typename node_at<L, decltype(i)::value>::op_type;
    if constexpr (is_input_op_v<Op>) {
      if (found == L::size && Op::index == K) found = decltype(i)::value;
    }
  });
  return found;
}

// Where a node of type Target is in a NodeList, or its length if nowhere.
// Place Hint is tried first: a graph merged into one it extends has each node where the
// other has it. Anywhere = false looks there only: for a node without inputs (a parameter),
// whose type says nothing of which one it is, so that `x * gamma + beta` does not meet gamma
// where beta is; inside a shared prefix, it is where the other graph has it.
template <class Target, class Nodes, std::size_t Hint, bool Anywhere>
struct position_of;
template <class Target, class... Nodes, std::size_t Hint, bool Anywhere>
struct position_of<Target, NodeList<Nodes...>, Hint, Anywhere> {
  static constexpr std::size_t value = [] {
    constexpr std::array<bool, sizeof...(Nodes) + 1> same{std::is_same_v<Target, Nodes>..., true};
    if (Hint < sizeof...(Nodes) && same[Hint]) return Hint;
    if (!Anywhere) return sizeof...(Nodes);
    std::size_t i = 0;
    while (!same[i]) ++i;
    return i;
  }();
};

// The run-time half of a merge: the ids of the nodes built so far, and the first ambiguity met.
struct Merged {
  std::vector<std::uint64_t> ids;
  std::string ambiguity;

  void note(const std::string& why) {
    if (ambiguity.empty()) ambiguity = why;
  }
  template <std::size_t N>
  std::array<std::uint64_t, N> id_array() const {
    std::array<std::uint64_t, N> a{};
    std::copy_n(ids.begin(), N, a.begin());
    return a;
  }
};

// Appends b's nodes after `built`, each value once: a node of b whose type (op and renumbered
// inputs) is already built is that node, provided the ids agree; if they do not, the merge is
// ambiguous (Sym::ambiguity) and says which two nodes it met. Map[j] is where b's node j ends
// up. Shared work is thus captured once: `x + f(x)` holds x's nodes once, and the graph of
// stacked residual blocks grows linearly with their number.
template <std::size_t J, class GB, class Built, std::size_t... Map>
auto merge_from(const GB& b, std::span<const std::uint64_t> b_ids, const Built& built,
                std::index_sequence<Map...> map, Merged& merged) {
  if constexpr (J == GB::size) {
    return std::pair{make_graph(built), map};
  } else {
    using N = node_at<GB, J>;
    constexpr std::size_t built_size = Built::size;
    if constexpr (is_input_op_v<typename N::op_type>) {
      constexpr std::size_t found = find_input<Built, N::op_type::index>();
      if constexpr (found < built_size) {
        using Existing = node_at<Built, found>;
        static_assert(std::is_same_v<Existing, N>,
                      "duet: one graph input is used with two different element types or shape patterns");
        return merge_from<J + 1>(b, b_ids, built, std::index_sequence<Map..., found>{}, merged);
      } else {
        merged.ids.push_back(b_ids[J]);
        return merge_from<J + 1>(b, b_ids, with_nodes(built, get<J>(b)),
                                 std::index_sequence<Map..., built_size>{}, merged);
      }
    } else {
      auto node = renumbered(get<J>(b), map, std::make_index_sequence<N::arity>{});
      constexpr std::size_t found = position_of<decltype(node), Built, J, (N::arity > 0)>::value;
      if constexpr (found < built_size) {
        if (merged.ids[found] != b_ids[J]) {
          merged.note("%" + std::to_string(found) + " " + get<found>(built).op.label() + " and " +
                      node.op.label() + " are one operation type on the same inputs, but two values");
        }
        return merge_from<J + 1>(b, b_ids, built, std::index_sequence<Map..., found>{}, merged);
      } else {
        merged.ids.push_back(b_ids[J]);
        return merge_from<J + 1>(b, b_ids, with_nodes(built, node), std::index_sequence<Map..., built_size>{},
                                 merged);
      }
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
  detail::Merged merged{{x.ids.begin(), x.ids.end()}, x.ambiguity};
  auto [g, map] = detail::merge_from<1>(q.graph, q.ids, static_cast<const typename G::list_type&>(x.graph),
                                              std::index_sequence<Out>{}, merged);
  merged.note(q.ambiguity);
  return Sym<decltype(g), detail::at<Q::output>(decltype(map){})>{g, merged.id_array<decltype(g)::size>(),
                                                                   merged.ambiguity};
}

// Appends `op` applied to x. The rule runs here, at capture, so a compile-time mismatch is
// reported where the user's construct calls the layer.
template <class Op, class G, std::size_t Out>
auto append(const Op& op, const Sym<G, Out>& x) {
  static_cast<void>(sizeof(diagnostic::check_operation<Op>));
  if constexpr (reports_faults<G>()) diagnostic::report_static_fault<Op, Sym<G, Out>>();
  auto g = with_node(x.graph, Node<Op, Out>{op});
  std::array<std::uint64_t, G::size + 1> ids{};
  std::copy(x.ids.begin(), x.ids.end(), ids.begin());
  ids[G::size] = new_node_id();
  return Sym<decltype(g), G::size>{g, ids, x.ambiguity};
}

// A symbolic input standing for x's value in a part captured apart (spliced after x): of x's
// element type, shape and phase, quiet if x's capture is.
template <class X>
auto continuation() {
  using G = typename X::graph_type;
  return []<std::size_t... I>(std::index_sequence<I...>) {
    using C = Continuing<phase_of_graph<G>(), X::shape.leading_unknown(), X::shape[static_cast<int>(I)]...>;
    return input<typename X::value_type, std::conditional_t<reports_faults<G>(), C, Quiet<C>>>();
  }(std::make_index_sequence<static_cast<std::size_t>(X::shape.rank())>{});
}

namespace detail {
// Where spliced puts things: part c's node j (j > 0; node 0 is its input) lands at
// base[c] + j - 1, and its input is the value of the part before it (out[c - 1], or x's).
template <std::size_t Size0, std::size_t Out0, class... Parts>
struct Splice {
  static constexpr std::size_t parts = sizeof...(Parts);
  static constexpr std::array<std::size_t, parts> sizes{Parts::graph_type::size...};
  static constexpr std::array<std::size_t, parts> outputs{Parts::output...};
  static constexpr std::array<std::size_t, parts + 1> base = [] {
    std::array<std::size_t, parts + 1> b{};
    b[0] = Size0;
    for (std::size_t c = 0; c < parts; ++c) b[c + 1] = b[c] + sizes[c] - 1;
    return b;
  }();
  static constexpr std::size_t size = base[parts];
  static constexpr std::size_t where(std::size_t c, std::size_t j) {
    if (j > 0) return base[c] + j - 1;
    return c == 0 ? Out0 : where(c - 1, outputs[c - 1]);
  }
  static constexpr std::size_t output = parts == 0 ? Out0 : where(parts - 1, outputs[parts - 1]);
  // For node K after x's: its part and its place there.
  static constexpr std::array<std::size_t, size - Size0> part = [] {
    std::array<std::size_t, size - Size0> a{};
    for (std::size_t c = 0; c < parts; ++c)
      for (std::size_t j = 1; j < sizes[c]; ++j) a[base[c] + j - 1 - Size0] = c;
    return a;
  }();
  template <std::size_t K>
  static constexpr std::size_t place = K + Size0 - base[part[K]] + 1;

  template <std::size_t K, class N = node_at<typename node_at<NodeList<Parts...>, part[K]>::graph_type, place<K>>,
            class A = std::make_index_sequence<N::arity>>
  struct renumbered_node;
  template <std::size_t K, class N, std::size_t... A>
  struct renumbered_node<K, N, std::index_sequence<A...>> {
    using type = Node<typename N::op_type, where(part[K], N::args[A])...>;
  };
  template <std::size_t K>
  static typename renumbered_node<K>::type node(const NodeList<const Parts*...>& p) {
    return {get<place<K>>(get<part[K]>(p)->graph).op};
  }
};
}  // namespace detail

// x's graph, then each part's nodes after the value before it: parts[0] captured on
// continuation<X>(), parts[c] on continuation of parts[c - 1]. The result is the graph that
// capturing them one after the other on x would give, made in one function: appending to x's
// graph would copy it once per node, so a chain of n nodes would cost n^2.
template <class G0, std::size_t Out0, class... Parts>
auto spliced(const Sym<G0, Out0>& x, const Parts&... parts) {
  using S = detail::Splice<G0::size, Out0, Parts...>;
  const NodeList<const Parts*...> all(std::in_place, &parts...);
  auto g = [&]<std::size_t... I, std::size_t... K>(std::index_sequence<I...>, std::index_sequence<K...>) {
    return Graph<node_at<G0, I>..., typename S::template renumbered_node<K>::type...>(
        std::in_place, get<I>(x.graph)..., S::template node<K>(all)...);
  }(std::make_index_sequence<G0::size>{}, std::make_index_sequence<S::size - G0::size>{});
  Sym<decltype(g), S::output> y{std::move(g), {}, x.ambiguity};
  std::copy(x.ids.begin(), x.ids.end(), y.ids.begin());
  auto at = y.ids.begin() + G0::size;
  ((at = std::copy(parts.ids.begin() + 1, parts.ids.end(), at)), ...);
  ((y.ambiguity.empty() ? void(y.ambiguity = parts.ambiguity) : void()), ...);
  return y;
}

namespace detail {

// Merges the graphs of xs... after g, each input once; Outs are where the values used so far
// live in the result (the nodes already there keep their places).
template <class G, std::size_t... Outs>
auto merge_all(const G& g, Merged&, std::index_sequence<Outs...> outs) {
  return std::pair{g, outs};
}
template <class G, std::size_t... Outs, class GB, std::size_t B, class... Rest>
auto merge_all(const G& g, Merged& ids, std::index_sequence<Outs...>, const Sym<GB, B>& b, const Rest&... rest) {
  ids.note(b.ambiguity);
  auto [merged, map] = merge_from<0>(b.graph, b.ids, static_cast<const typename G::list_type&>(g), std::index_sequence<>{}, ids);
  return merge_all(merged, ids, std::index_sequence<Outs..., at<B>(decltype(map){})>{}, rest...);
}

}  // namespace detail

// Appends `op` applied to x0, x1, ..., whose graphs are merged first.
template <class Op, class G0, std::size_t O0, class... Rest>
  requires(sizeof...(Rest) >= 1 && (Symbolic<Rest> && ...))
auto append(const Op& op, const Sym<G0, O0>& x0, const Rest&... rest) {
  static_cast<void>(sizeof(diagnostic::check_operation<Op>));
  if constexpr (reports_faults<G0>() && (reports_faults<typename Rest::graph_type>() && ...)) {
    diagnostic::report_static_fault<Op, Sym<G0, O0>, Rest...>();
  }
  detail::Merged ids{{x0.ids.begin(), x0.ids.end()}, x0.ambiguity};
  auto [merged, outs] = detail::merge_all(x0.graph, ids, std::index_sequence<O0>{}, rest...);
  // merged is passed, not captured: clang 14 cannot capture a structured binding.
  auto g = [&op]<class M, std::size_t... Args>(const M& m, std::index_sequence<Args...>) {
    return with_node(m, Node<Op, Args...>{op});
  }(merged, decltype(outs){});
  ids.ids.push_back(new_node_id());
  return Sym<decltype(g), decltype(merged)::size>{g, ids.id_array<decltype(g)::size>(), ids.ambiguity};
}

}  // namespace duet::graph
// JitConfig: how graph mode compiles a function or cell (MindSpore's mindspore.JitConfig).

#include <cstddef>
#include <string>
#include <string_view>


namespace duet {

// Optimisation level. O0 runs the captured graph kernel by kernel (views are still aliases and
// nothing is dispatched or allocated per node); O1 adds fusion of elementwise chains and of
// bias/activation epilogues into the products and, in graphs that do not train, keeps each
// product's weight packed between calls (packed again only after the weight is written; the
// copy costs the weight's size again), which spares a batched forward pass the packing of
// every weight: 7 to 10 % of a batch of 64 on the seed network. O2 is O1: what MindSpore's O2
// adds, the whole graph sunk into one call, is ExecMode::sink here, the default at every
// level. All three give the same numbers.
enum class JitLevel : unsigned char { O0, O1, O2 };

// How much of C++ a jitted function (or a cell's construct) may use. strict: anything that is
// not a graph operation (a host callback) is a compile error; lax: it becomes a host node, a
// graph break that runs eagerly between the compiled parts; compatible, between the two (as
// MindSpore's COMPATIBLE is): only breaks marked duet::host<duet::allowed_break>.
enum class JitSyntaxLevel : unsigned char { strict, compatible, lax };

// sink: the whole graph is one compiled call (one arena, slots reused); no_sink: node by node,
// each node's output in its own buffer; automatic: sink.
enum class ExecMode : unsigned char { automatic, sink, no_sink };

// debug: every node's output is checked for NaN and infinity, and a failing run-time check
// names the node and the function or construct it was captured from.
enum class DebugLevel : unsigned char { release, debug };

// What a call does that would compile one form more than JitConfig::max_compiled_forms:
// raise throws duet::RecompileError; warn says so once in the compile log and compiles.
enum class RecompilePolicy : unsigned char { raise, warn };

// A structural type, so that jit<JitConfig{...}> makes the configuration part of the program:
// it changes which passes run and what the evaluator checks.
struct JitConfig {
  JitLevel jit_level = JitLevel::O1;
  ExecMode exec_mode = ExecMode::automatic;
  JitSyntaxLevel jit_syntax_level = JitSyntaxLevel::lax;
  DebugLevel debug_level = DebugLevel::release;
  // Compiled forms (input signatures) one jitted function may make; 0: any number. A limit
  // turns a recompilation storm, otherwise found only by its slowness, into an error naming
  // the argument that changed.
  std::size_t max_compiled_forms = 0;
  RecompilePolicy on_recompile_limit = RecompilePolicy::raise;

  // MindSpore's spellings: parse("O2", "auto", "STRICT", "RELEASE"), and the recompilation
  // limit in the same style: parse("O1", "auto", "LAX", "RELEASE", "4", "WARN"). Unknown values
  // throw duet::ValueError at run time, and do not compile in a constant expression.
  static constexpr JitConfig parse(std::string_view jit_level, std::string_view exec_mode = "auto",
                                   std::string_view jit_syntax_level = "LAX", std::string_view debug_level = "RELEASE",
                                   std::string_view max_compiled_forms = "0",
                                   std::string_view on_recompile_limit = "RAISE") {
    JitConfig c;
    c.jit_level = jit_level == "O0"   ? JitLevel::O0
                  : jit_level == "O1" ? JitLevel::O1
                  : jit_level == "O2" ? JitLevel::O2
                                      : invalid<JitLevel>("jit_level", jit_level, "O0, O1 or O2");
    c.exec_mode = exec_mode == "auto"      ? ExecMode::automatic
                  : exec_mode == "sink"    ? ExecMode::sink
                  : exec_mode == "no_sink" ? ExecMode::no_sink
                                           : invalid<ExecMode>("exec_mode", exec_mode, "auto, sink or no_sink");
    c.jit_syntax_level = jit_syntax_level == "STRICT"       ? JitSyntaxLevel::strict
                         : jit_syntax_level == "COMPATIBLE" ? JitSyntaxLevel::compatible
                         : jit_syntax_level == "LAX"        ? JitSyntaxLevel::lax
                                                            : invalid<JitSyntaxLevel>("jit_syntax_level", jit_syntax_level,
                                                                                      "STRICT, COMPATIBLE or LAX");
    c.debug_level = debug_level == "RELEASE" ? DebugLevel::release
                    : debug_level == "DEBUG" ? DebugLevel::debug
                                             : invalid<DebugLevel>("debug_level", debug_level, "RELEASE or DEBUG");
    c.max_compiled_forms = count("max_compiled_forms", max_compiled_forms);
    c.on_recompile_limit = on_recompile_limit == "RAISE"  ? RecompilePolicy::raise
                           : on_recompile_limit == "WARN" ? RecompilePolicy::warn
                                                          : invalid<RecompilePolicy>("on_recompile_limit",
                                                                                     on_recompile_limit, "RAISE or WARN");
    return c;
  }

  friend constexpr bool operator==(const JitConfig&, const JitConfig&) = default;

 private:
  template <class E>
  static constexpr E invalid(std::string_view field, std::string_view value, std::string_view allowed) {
    throw ValueError("duet::JitConfig: " + std::string(field) + " must be " + std::string(allowed) + ", got '" +
                     std::string(value) + "'");
  }

  // A decimal count; std::from_chars is not constexpr in C++20, so the digits are read here.
  static constexpr std::size_t count(std::string_view field, std::string_view value) {
    if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
      return invalid<std::size_t>(field, value, "a count of forms (0: any)");
    }
    std::size_t n = 0;
    for (char c : value) n = n * 10 + static_cast<std::size_t>(c - '0');
    return n;
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
// What plan() reads of one node, through functions of its op's type: the loop over the nodes
// is then compiled once, and each op type's functions once for every graph it is in, where a
// loop unrolled over the graph (a lambda per node) compiled every node of every graph anew.
struct PlanNode {
  const void* op = nullptr;
  ShapeResult (*infer)(const void* op, std::span<const Shape> in) = nullptr;
  std::string (*label)(const void* op) = nullptr;
  std::string (*op_name)() = nullptr;
  bool is_input = false;
  std::size_t input = 0;  // is_input: which argument
  std::span<const std::size_t> args;
};

template <class Op>
ShapeResult infer_node(const void* op, std::span<const Shape> in) {
  return static_cast<const Op*>(op)->infer(in);
}
template <class Op>
std::string label_node(const void* op) {
  return static_cast<const Op*>(op)->label();
}

template <class Node>
PlanNode plan_node(const typename Node::op_type& op) {
  using Op = typename Node::op_type;
  PlanNode p;
  p.op = &op;
  p.op_name = &Op::op_name;
  p.args = Node::args;
  if constexpr (graph::is_input_op_v<Op>) {
    p.is_input = true;
    p.input = Op::index;
  } else {
    p.infer = &infer_node<Op>;
    p.label = &label_node<Op>;
  }
  return p;
}

// How a failing node is named: in debug, by its place in the graph and the function or cell
// it was captured from (`where`), so a user finds the line of construct that made it.
inline std::string node_context(bool debug, const std::string& op_name, std::size_t index, std::string_view where) {
  if (!debug) return {};
  return "duet (debug): in " + std::string(where) + ", node %" + std::to_string(index) + " (" + op_name + "): ";
}
template <JitConfig Config, class Op>
std::string node_context(std::size_t index, std::string_view where) {
  if constexpr (Config.debug_level == DebugLevel::debug) return node_context(true, Op::op_name(), index, where);
  else return {};
}

// Every node's shape for these input shapes (patterns: the shapes capture inferred, -1 where a
// dimension is dynamic).
inline void infer_shapes(std::span<const PlanNode> nodes, std::span<const Shape> patterns,
                         std::span<const Shape> input_shapes, std::span<Shape> shapes, bool debug,
                         std::string_view where) {
  std::vector<Shape> in;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const PlanNode& node = nodes[i];
    if (node.is_input) {
      const Shape& s = input_shapes[node.input];
      if (!graph::fits(patterns[i], s)) {
        throw ShapeError(node_context(debug, node.op_name(), i, where) + "duet: graph input " + std::to_string(node.input) +
                         " must have shape " + to_string(patterns[i]) + ", got " + to_string(s));
      }
      shapes[i] = s;
    } else {
      in.clear();
      for (std::size_t a : node.args) in.push_back(shapes[a]);
      const ShapeResult r = node.infer(node.op, in);
      if (!r.ok()) throw ShapeError(node_context(debug, node.op_name(), i, where) + describe_fault(r, node.label(node.op), in));
      shapes[i] = r.shape;
    }
  }
}

// Places the slots one after another, each 64-byte aligned and as large as the largest value
// it holds; offset[i] is where node i's slot begins. Returns the arena's size.
inline std::size_t lay_out_slots(std::span<const graph::Storage> storage, std::span<const std::size_t> slot,
                                 std::size_t slot_count, std::span<const std::size_t> element_size,
                                 std::span<const Shape> shapes, std::span<std::size_t> offset) {
  std::vector<std::size_t> slot_bytes(slot_count), slot_offset(slot_count);
  for (std::size_t i = 0; i < storage.size(); ++i) {
    if (storage[i] != graph::Storage::slot) continue;
    const auto bytes = static_cast<std::size_t>(shapes[i].numel()) * element_size[i];
    if (bytes > slot_bytes[slot[i]]) slot_bytes[slot[i]] = bytes;
  }
  std::size_t arena_bytes = 0;
  for (std::size_t s = 0; s < slot_count; ++s) {
    slot_offset[s] = arena_bytes;
    arena_bytes += (slot_bytes[s] + block_alignment - 1) / block_alignment * block_alignment;
  }
  for (std::size_t i = 0; i < storage.size(); ++i) offset[i] = slot_count == 0 ? 0 : slot_offset[slot[i]];
  return arena_bytes;
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
  const std::array<detail::PlanNode, n> nodes = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<detail::PlanNode, n>{
        detail::plan_node<graph::node_at<G, I>>(graph::get<I>(program.graph).op)...};
  }(std::make_index_sequence<n>{});
  graph::Plan<G, Inputs> p;
  p.input_shapes = input_shapes;
  p.where = std::move(where);
  detail::infer_shapes(nodes, G::shapes, input_shapes, p.shapes, Config.debug_level == DebugLevel::debug, p.where);

  p.arena_bytes = detail::lay_out_slots(buffers.storage, buffers.slot, buffers.slot_count, element_size, p.shapes, p.offset);
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

namespace graph {
// What run_observed shows each node's value to. This one is nothing, and costs nothing.
struct NoObserver {};
}  // namespace graph

// run(), showing each node's value to `observe` as soon as its kernel has run (before its slot
// may be reused): observe(std::integral_constant<std::size_t, I>{}, const T* values, shape) for
// every node I that makes a value, inputs included. duet::compare_modes reads graph mode's
// intermediate values so.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class Observer,
          class... Inputs>
auto run_observed(const graph::Sym<G, Out>& program, const graph::Plan<G, sizeof...(Inputs)>& p, Observer&& observe,
                  const Inputs&... inputs) {
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
        const auto& op = graph::get<I>(program.graph).op;
        data[I] = static_cast<char*>(data[Node::args[0]]) +
                  view_offset(op, p.shapes[Node::args[0]]) * static_cast<index_t>(sizeof(graph::node_value_t<G, I>));
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
        const auto& op = graph::get<I>(program.graph).op;
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
    if constexpr (!std::is_same_v<std::remove_cvref_t<Observer>, graph::NoObserver> && !graph::is_sink<Op>()) {
      observe(std::integral_constant<std::size_t, I>{}, static_cast<const graph::node_value_t<G, I>*>(data[I]),
              p.shapes[I]);
    }
  });

  constexpr std::size_t out_root = buffers.root[Out];
  // Where the output's elements begin in its root's, when it is a view.
  const index_t offset = static_cast<const Result*>(data[Out]) - static_cast<const Result*>(data[out_root]);
  if constexpr (buffers.storage[out_root] == graph::Storage::input) {
    // The graph only views an input: its output is a view of that input.
    constexpr std::size_t k = graph::node_at<G, out_root>::op_type::index;
    return tensor_of(std::get<k>(std::forward_as_tuple(inputs...))).view(offset, p.shapes[Out]);
  } else if constexpr (out_root != Out) {
    return result.view(offset, p.shapes[Out]);
  } else {
    return result;
  }
}

// Runs a graph with a plan made for these inputs' shapes; inputs in the order of their index.
template <class Backend = DefaultBackend, JitConfig Config = JitConfig{}, class G, std::size_t Out, class... Inputs>
auto run(const graph::Sym<G, Out>& program, const graph::Plan<G, sizeof...(Inputs)>& p, const Inputs&... inputs) {
  return run_observed<Backend, Config>(program, p, graph::NoObserver{}, inputs...);
}

namespace detail {
// Identifies a user of plan caches (a cell, a gradient function) for the program's life; an
// address would not do, since a new object at a freed address may have other sizes.
inline std::uint64_t new_plan_owner() {
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
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
//   auto plain = duet::jit<duet::JitConfig{.jit_level = duet::O0}>(run);  // with a configuration
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
//
// The recompilation contract: JitConfig::max_compiled_forms bounds the forms of one function
// (RecompileError or a warning, as JitConfig::on_recompile_limit says), freeze_compiles() makes
// every later compilation an error, and f.precompile(TensorSpec...) compiles a form ahead of
// its first call.

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

// Where a graph meets the host: printing a live value, recording it for after the call, and
// calling back into C++.
//
// duet::print is a graph operation: in either mode, and at every jit level, it prints the value
// when it is computed and passes it on unchanged (as a view), so a user never has to take jit
// away to see a value. duet::host runs any C++ function on a value: a host node, a graph
// break that runs eagerly between compiled parts, named by the line that calls it. A jit
// function (or a cell's construct) of JitSyntaxLevel::strict refuses host nodes at compile
// time, and one of JitSyntaxLevel::compatible those not marked duet::allowed_break.

#include <algorithm>
#include <array>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// PyNative evaluation of one operation: run its shape rule, allocate its output from the
// pool, call its kernel. The graph evaluator uses the same rule and the same kernel, which is
// why the two modes agree.

#include <array>
#include <type_traits>
#include <utility>

// The PyNative half of autodiff: a tape that records each operation as it runs, then walks
// back over the records calling each operation's gradient op, the same op graph mode
// appends to its backward graph.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// A cell's own parameter read directly by operations in construct (a learned scale,
// `x * weight`), in both modes.
//
// Graph mode makes the parameter a node of the graph (ParameterOp, which reads the values live
// at each run); PyNative gives the tape a leaf for it. Either way its gradient ends in the
// parameter's grad through ParameterGradOp, the way a layer's gradient kernel writes its
// weight's, so optimisers, checkpoints and both modes see no difference from nn::Dense's.

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>


namespace duet::ops {

// d(loss)/d(parameter) added to the parameter's gradient of the current backward pass.
template <class T>
struct ParameterGradOp : Primitive<ParameterGradOp<T>> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr bool is_sink = true;
  const nn::BasicParameter<T>* parameter;
  ParameterGradOp(const nn::BasicParameter<T>* p) : parameter(p) {}

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    bool accumulate = false;
    T* g = parameter->grad_for_write(duet::detail::current_backward_pass(), &accumulate);
    const T* dy = a.in<T>();
    const index_t n = a.in_shape().numel();
    if (accumulate) {
      for (index_t i = 0; i < n; ++i) g[i] += dy[i];
    } else {
      std::copy_n(dy, n, g);
    }
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() { return "ParameterGrad"; }
};

// The values of a parameter, as a node with no inputs. Its shape is known when the graph runs.
template <class T>
struct ParameterOp : Primitive<ParameterOp<T>> {
  using value_type = T;
  static constexpr int arity = 0;
  static constexpr bool has_parameters = true;
  const nn::BasicParameter<T>* parameter;
  ParameterOp(const nn::BasicParameter<T>* p) : parameter(p) {}

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape>) const { return {parameter->shape()}; }

  // A copy into the graph's arena: the graph's values are planned there, and the parameter's
  // storage may be replaced between runs (checkpoint loading keeps it, set_data copies).
  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const nn::BasicParameter<T>& p = *parameter;
    std::copy_n(p.data(), p.numel(), a.out<T>());
  }

  auto parameter_grad_op() const { return ParameterGradOp<T>{parameter}; }

  static std::string op_name() { return "Parameter"; }
};

}  // namespace duet::ops

namespace duet::graph {

// A parameter as a symbolic tensor: a graph of one node, merged into the graph that reads it.
template <class T>
auto parameter(const nn::BasicParameter<T>& p) {
  using G = Graph<Node<ops::ParameterOp<T>>>;
  // Its id is the parameter's: each read of one parameter is the same value.
  return Sym<G, 0>{G{std::in_place, Node<ops::ParameterOp<T>>{ops::ParameterOp<T>{&p}}},
                   {reinterpret_cast<std::uintptr_t>(&p) | 1u}};
}

}  // namespace duet::graph
// The recording half of PIJit: while a trace is active, every eager operation appends a step
// (the op, the values it reads and the value it makes), so a network built at run time can be
// captured by running it once. pijit.hpp optimises and replays the trace.

#include <array>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace duet::ops {

// An input of a described node: one of the operation's own inputs, a parameter of its layer
// (the exporter finds its name among the network's parameters), a constant of int64s (a
// Reshape's target shape), or the value an earlier node of the same description makes.
struct InterchangeInput {
  enum class Kind : unsigned char { input, parameter, int64s, earlier };
  Kind kind = Kind::input;
  std::size_t index = 0;            // Kind::input: which input; Kind::earlier: which node
  const void* parameter = nullptr;  // Kind::parameter: the BasicParameter<T>, T the network's
  std::vector<std::int64_t> int64s;

  static InterchangeInput operand(std::size_t k) { return {Kind::input, k, nullptr, {}}; }
  static InterchangeInput of_parameter(const void* p) { return {Kind::parameter, 0, p, {}}; }
  static InterchangeInput constant(std::vector<std::int64_t> values) {
    return {Kind::int64s, 0, nullptr, std::move(values)};
  }
  static InterchangeInput node(std::size_t k) { return {Kind::earlier, k, nullptr, {}}; }
};

struct InterchangeAttribute {
  enum class Kind : unsigned char { integer, real, integers };
  std::string name;
  Kind kind = Kind::integer;
  std::int64_t integer = 0;
  float real = 0;
  std::vector<std::int64_t> integers;

  static InterchangeAttribute of(std::string n, std::int64_t v) { return {std::move(n), Kind::integer, v, 0, {}}; }
  static InterchangeAttribute of_real(std::string n, double v) {
    return {std::move(n), Kind::real, 0, static_cast<float>(v), {}};
  }
  static InterchangeAttribute of(std::string n, std::vector<std::int64_t> v) {
    return {std::move(n), Kind::integers, 0, 0, std::move(v)};
  }
};

struct InterchangeNode {
  std::string op_type;  // ONNX's operator ("Gemm", "Conv", "Relu")
  std::vector<InterchangeInput> inputs;
  std::vector<InterchangeAttribute> attributes;
};

// The operation's nodes in order; the last one's value is the operation's.
using Interchange = std::vector<InterchangeNode>;

}  // namespace duet::ops
// A BatchNorm at evaluation as what a convolution before it folds in, whatever the layer's type:
// its per-channel affine map, the tensors the fold watches for changes, its label and its
// train/evaluate setting. Graph mode's passes meet the layer's own type, but PIJit's fusion
// holds steps of erased types (trace.hpp: no code sees a producer's type and its consumer's
// together), so both fold through this one description, with the same code and the same bits.

#include <array>
#include <string>
#include <vector>


namespace duet::ops {

// y = x · scale + shift per channel.
template <class T>
struct AffineMap {
  std::vector<T> scale;
  std::vector<T> shift;
};

template <class T>
class EvaluationNorm {
 public:
  template <class Layer>
  static EvaluationNorm of(const Layer& layer) {
    return EvaluationNorm(&layer, {&layer.gamma, &layer.beta, &layer.moving_mean, &layer.moving_variance},
                          [](const void* l) { return static_cast<const Layer*>(l)->label(); },
                          [](const void* l) { return static_cast<const Layer*>(l)->training(); },
                          [](const void* l) { return static_cast<const Layer*>(l)->evaluation_affine(); });
  }

  std::string label() const { return label_(layer_); }
  bool training() const { return training_(layer_); }
  AffineMap<T> evaluation_affine() const { return affine_(layer_); }
  // gamma, beta, moving mean, moving variance: a write to any makes the fold stale.
  const std::array<const BasicTensor<T>*, 4>& tensors() const { return tensors_; }

 private:
  EvaluationNorm(const void* layer, std::array<const BasicTensor<T>*, 4> tensors, std::string (*label)(const void*),
                 bool (*training)(const void*), AffineMap<T> (*affine)(const void*))
      : layer_(layer), tensors_(tensors), label_(label), training_(training), affine_(affine) {}

  const void* layer_;
  std::array<const BasicTensor<T>*, 4> tensors_;
  std::string (*label_)(const void*);
  bool (*training_)(const void*);
  AffineMap<T> (*affine_)(const void*);
};

}  // namespace duet::ops

namespace duet {
namespace fn {
struct Relu;
struct LeakyRelu;
}  // namespace fn
namespace ops {
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
  std::size_t view_bytes = 0;          // Kind::view: where in that memory it begins
  std::shared_ptr<const void> handle;  // Kind::constant, or any kind in a trace that keeps values:
  const void* data = nullptr;          // keeps the tensor's storage alive, and its elements
  std::string cell;                    // in a trace that keeps values: the cell running when it was made
};

// What a step is as the epilogue of the step before it, for fusion after the trace (pijit.hpp).
// A trace holds its steps behind this interface, and no code sees a producer's type and its
// consumer's together, so each step states once what kind of epilogue its op would be, and the
// producer's own rule (accepts_epilogue) is asked about that kind: the rules read a consumer's
// kind (its layer's bias; elementwise functions, with parameters or without), never which
// functions it runs. Nothing is compiled per pair of op types.
struct EpilogueRole {
  enum class Kind : unsigned char { none, bias, functions, normalization };
  Kind kind = Kind::none;
  bool parameterless = false;   // Kind::functions: none holds a parameter (LeakyReLU's alpha)
  const void* layer = nullptr;  // Kind::bias: whose bias
  // Kind::normalization: an ops::EvaluationNorm<T> of the trace's element type, the BatchNorm
  // at evaluation that the product before it may fold in.
  std::shared_ptr<const void> norm{};
};

class Step {
 public:
  virtual ~Step() = default;
  // data[v] is value v's memory; views are resolved before.
  virtual void run(void* const* data, const std::vector<Value>& values) const = 0;
  virtual EpilogueRole as_epilogue() const { return {}; }
  // This step with `next` (writing `output`) taken into its own kernel, when its op takes it
  // so (a product its layer's bias); null otherwise.
  virtual std::unique_ptr<Step> absorb(const EpilogueRole& /*next*/, std::size_t /*output*/) const { return nullptr; }
  // Whether its op takes elementwise functions (of the role's kind) as epilogue, which then run
  // in place on its output (pijit.hpp's EpilogueChain).
  virtual bool takes_functions(bool /*parameterless*/) const { return false; }
  // Whether it rounds differently from the steps it replaced (a BatchNorm folded into a
  // convolution's weight): its results agree with theirs within a tolerance, not bit for bit.
  virtual bool rounds_differently() const { return false; }
  // This step reading its weight packed between calls (JitLevel O1 and O2), if it has a weight.
  virtual std::unique_ptr<Step> with_packed_weight() const = 0;
  virtual bool is_view() const = 0;
  virtual bool runs_kernel() const = 0;
  // What graph_ir prints for it: the operation's name, and who runs it (empty if nobody else).
  virtual std::string op_name() const = 0;
  virtual std::string label() const = 0;
  // What it is in ONNX's vocabulary (interchange.hpp), for io::export_onnx; empty if its op
  // does not say.
  virtual ops::Interchange interchange(std::span<const Shape> /*in*/) const { return {}; }

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
inline constexpr bool is_bias_add_v = false;
template <class L>
inline constexpr bool is_bias_add_v<ops::BiasAddOp<L>> = true;

// Op's own epilogue rule, asked of consumer C.
template <class Op, class C>
inline constexpr bool accepts_epilogue = requires { requires Op::template accepts_epilogue<C>; };
}  // namespace detail

template <class Op, class T>
class OpStep final : public Step {
 public:
  explicit OpStep(const Op& op) : op_(op) {}

  void run(void* const* data, const std::vector<Value>& values) const override {
    if constexpr (graph::runs_kernel<Op>()) run_kernel(data, values);
  }

  // The layer's own bias add, if the op's rule takes it: the rule names the type, and two
  // layers may share one, so the layer is compared too.
  std::unique_ptr<Step> absorb(const EpilogueRole& next, std::size_t output) const override {
    if constexpr (requires { typename Op::layer_type::value_type; }) {
      using Bias = ops::BiasAddOp<typename Op::layer_type>;
      if constexpr (detail::accepts_epilogue<Op, Bias>) {
        if (next.kind == EpilogueRole::Kind::bias && next.layer == op_.layer) {
          const auto with_bias = op_.absorb(Bias{op_.layer});
          return detail::fused<std::remove_cvref_t<decltype(with_bias)>, T>(with_bias, *this, output);
        }
      }
    }
    if constexpr (requires(const ops::EvaluationNorm<T>& norm) { op_.absorb(norm); }) {
      if (next.kind == EpilogueRole::Kind::normalization) {
        const auto folded = op_.absorb(*static_cast<const ops::EvaluationNorm<T>*>(next.norm.get()));
        return detail::fused<std::remove_cvref_t<decltype(folded)>, T>(folded, *this, output);
      }
    }
    (void)next;
    (void)output;
    return nullptr;
  }

  // A one-function MapOp of the kind asked stands for any: the rules read only the kind.
  bool takes_functions(bool parameterless) const override {
    return parameterless ? detail::accepts_epilogue<Op, ops::MapOp<fn::Relu>>
                         : detail::accepts_epilogue<Op, ops::MapOp<fn::LeakyRelu>>;
  }

  std::unique_ptr<Step> with_packed_weight() const override {
    if constexpr (requires { op_.with_packed_weight(); }) {
      return detail::fused<decltype(op_.with_packed_weight()), T>(op_.with_packed_weight(), *this, output);
    } else {
      return nullptr;
    }
  }

  EpilogueRole as_epilogue() const override {
    if constexpr (requires { Op::elementwise_functions; }) {
      return {EpilogueRole::Kind::functions, Op::parameterless, nullptr};
    } else if constexpr (detail::is_bias_add_v<Op>) {
      return {EpilogueRole::Kind::bias, false, op_.layer};
    } else if constexpr (requires { { op_.evaluation_norm() } -> std::same_as<ops::EvaluationNorm<T>>; }) {
      return {EpilogueRole::Kind::normalization, false, nullptr,
              std::make_shared<const ops::EvaluationNorm<T>>(op_.evaluation_norm())};
    } else {
      return {};
    }
  }

  bool rounds_differently() const override {
    if constexpr (requires { Op::folds; }) return Op::folds;
    else return false;
  }

  bool is_view() const override { return Op::is_view; }
  bool runs_kernel() const override { return graph::runs_kernel<Op>(); }
  std::string op_name() const override { return Op::op_name(); }
  std::string label() const override { return op_.label() == Op::op_name() ? std::string() : op_.label(); }
  ops::Interchange interchange(std::span<const Shape> in) const override {
    if constexpr (requires { op_.interchange(in); }) return op_.interchange(in);
    else return {};
  }

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
  std::unique_ptr<Step> with_packed_weight() const override { return nullptr; }
  bool is_view() const override { return false; }
  bool runs_kernel() const override { return true; }
  std::string op_name() const override { return "BeginBackwardPass"; }
  std::string label() const override { return {}; }
};

// A trace as text, one line per step in graph_ir's form ("%3 = MatMul(%0) : [1, 6]  nn::Dense<6, 6> 'wq'"),
// each input or constant on a line of its own before its first reader.
inline std::string describe(const std::vector<Value>& values, const std::vector<std::unique_ptr<Step>>& steps,
                            std::size_t output) {
  std::string text;
  std::vector<bool> shown(values.size(), false);
  const auto show_source = [&](std::size_t v) {
    const Value& value = values[v];
    if (shown[v] || (value.kind != Value::Kind::input && value.kind != Value::Kind::constant)) return;
    shown[v] = true;
    text += "  %" + std::to_string(v) + " = " +
            (value.kind == Value::Kind::input ? "Input " + std::to_string(value.input) : std::string("Constant")) +
            " : " + to_string(value.shape) + "\n";
  };
  for (const auto& step : steps) {
    for (std::size_t v : step->inputs) show_source(v);
    std::string args;
    for (std::size_t v : step->inputs) args += (args.empty() ? "%" : ", %") + std::to_string(v);
    const std::string who = step->label();
    text += "  %" + std::to_string(step->output) + " = " + step->op_name() + (args.empty() ? "" : "(" + args + ")") +
            " : " + to_string(values[step->output].shape) + (who.empty() ? "" : "  " + who) + "\n";
  }
  show_source(output);
  return text + "  return %" + std::to_string(output) + "\n";
}

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
    if constexpr (graph::is_host_op<Op>()) {
      std::string what = Op::allowed_break ? "calls duet::host, a host callback marked allowed_break, at "
                                           : "calls duet::host, a host callback, at ";
      what += op.where.to_string();
      mark_broken(what);
    }
    auto step = std::make_unique<OpStep<Op, T>>(op);
    (step->inputs.push_back(value_of(x)), ...);
    std::size_t view_offset_bytes = 0;
    if constexpr (Op::is_view) {
      view_offset_bytes = static_cast<std::size_t>(view_offset(op, values_[step->inputs[0]].shape)) * sizeof(T);
    }
    keep(std::move(step), y, graph::is_sink<Op>(), Op::is_view, view_offset_bytes);
  }

  // Every value a step makes stays readable (Value::data) for the trace's life, as PyNative
  // computed it: duet::compare_modes reads them against graph mode's. A trace to replay keeps
  // none, since replay computes them again.
  void keep_values() { keep_values_ = true; }

  // A backward pass begins (parameters' gradients are assigned afresh from here): a step, so
  // that each replay begins its own.
  void record_backward_pass() {
    differentiates_ = true;
    auto step = std::make_unique<BackwardPassStep>();
    step->output = values_.size();
    values_.push_back(Value{});
    steps_.push_back(std::move(step));
  }

  // The traced function is a whole training step, whose parameters' gradients are written in
  // place by its gradient ops: those are steps to replay, not breaks.
  void allow_parameter_gradients() { parameter_gradients_ = true; }

  // Whether the traced function differentiates (a backward pass began in it): its weights are
  // then those being trained, written between calls.
  bool differentiates() const { return differentiates_; }

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
  const std::vector<Value>& values() const { return values_; }
  std::vector<std::unique_ptr<Step>>& steps() { return steps_; }
  const std::vector<std::unique_ptr<Step>>& steps() const { return steps_; }
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

  // The op-independent half of record, compiled once per element type rather than per op.
  template <class T>
  void keep(std::unique_ptr<Step> step, BasicTensor<T>& y, bool sink, bool view, std::size_t view_offset_bytes) {
    Value v;
    v.element_size = sink ? 0 : sizeof(T);
    v.shape = sink ? Shape{} : y.shape();
    if (view) {
      v.kind = Value::Kind::view;
      v.view_of = root_of(step->inputs[0]);
      const Value& in = values_[step->inputs[0]];
      v.view_bytes = (in.kind == Value::Kind::view ? in.view_bytes : 0) + view_offset_bytes;
    }
    if (!sink && keep_values_) {
      auto handle = std::make_shared<BasicTensor<T>>(y);
      v.data = handle->data();
      v.handle = std::move(handle);
      if (!running_.empty()) v.cell = running_.back();
    }
    step->output = values_.size();
    add(std::move(v), y);
    steps_.push_back(std::move(step));
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
  bool differentiates_ = false;
  bool keep_values_ = false;
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
struct GradAddOp : Primitive<GradAddOp> {
  static constexpr int arity = 2;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::add(a.in<T>(0), a.in<T>(1), a.in_shape(0).numel(), a.out<T>());
  }
  static std::string op_name() { return "GradAdd"; }
};

}  // namespace ops

namespace autodiff {

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
  // Appends the entries of the values it reads, in the order it reads them.
  virtual void append_inputs(const Tape&, std::vector<std::size_t>&) const {}
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

  // A handle on p's values that the tape tracks: what reaches it in backward is added to p's
  // gradient, as a layer's gradient kernel adds to its weight's.
  template <class T>
  BasicTensor<T> watch_parameter(const nn::BasicParameter<T>& p);

  template <class T>
  bool tracks(const BasicTensor<T>& x) const {
    return index_of(x.tape_id()) < entries_.size();
  }

  // The entry x is, entries_.size() if none.
  template <class T>
  std::size_t position_of(const BasicTensor<T>& x) const {
    return index_of(x.tape_id());
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

  // Seeds d(output)/d(output) = 1 and runs the gradient of every record the output depends
  // on, in backward_order.
  template <class T>
  void backward(const BasicTensor<T>& output);

 private:
  // The records `from` depends on, as graph capture lays out a program's nodes: a depth-first
  // post-order from the output, each record's inputs left to right, reversed. Walking them
  // so, the gradients reaching one value add up in the order graph mode's backward graph adds
  // them (autodiff::build_backward walks the captured nodes last first), whatever order C++
  // evaluated the operands of an expression in (g++ and clang++ differ). With a cell's
  // backward hook, the records keep the order they were made in: the hook runs once every
  // record made after its cell was entered has run, and hooks run in PyNative mode only.
  std::vector<std::size_t> backward_order(std::size_t from) const;

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
  bool has_cell_hooks_ = false;
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

  void append_inputs(const Tape& tape, std::vector<std::size_t>& out) const override {
    std::apply([&](const auto&... x) { ((tape.tracks(x) ? out.push_back(tape.position_of(x)) : void()), ...); },
               inputs_);
  }

  void backward(Tape& tape) override {
    const BasicTensor<Out>* g = this->grad();
    if (g == nullptr) return;
    bool parameters_written = false;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (input_backward<K>(tape, *g, parameters_written), ...);
    }(std::index_sequence_for<In...>{});
    if constexpr (has_parameters<Op>()) {
      if (!parameters_written) run_grad(op_.parameter_grad_op(), *g);
    }
  }

 private:
  template <std::size_t K>
  void input_backward(Tape& tape, const BasicTensor<Out>& g, bool& parameters_written) const {
    if constexpr (input_has_gradient<Op, K>()) {
      const auto& x = std::get<K>(inputs_);
      if (!tape.tracks(x)) return;
      tape.entry_of(x)->accumulate(run_grad(op_.template grad_op<K>(), g));
      parameters_written = parameters_written || K == 0;
    } else if constexpr (loses_gradient<std::tuple_element_t<K, std::tuple<In...>>, Out>) {
      if (tape.tracks(std::get<K>(inputs_))) throw ValueError(lost_gradient_message(op_.label(), K));
    }
  }

  template <graph::Operand O>
  const auto& operand(const BasicTensor<Out>& g) const {
    if constexpr (O == graph::Operand::grad)
      return g;
    else if constexpr (O == graph::Operand::output)
      return output_;
    else
      return std::get<static_cast<std::size_t>(O) - 1>(inputs_);
  }

  template <class GradOp>
  auto run_grad(const GradOp& gop, const BasicTensor<Out>& g) const {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return duet::detail::run_into_new<DefaultBackend>(gop, operand<GradOp::reads[I]>(g)...);
    }
    (std::make_index_sequence<GradOp::reads.size()>{});
  }

  Op op_;
  BasicTensor<Out> output_;
  std::tuple<BasicTensor<In>...> inputs_;
};

// The output of an operation that has no gradient (argmax), computed from something being
// differentiated: harmless unless a gradient reaches it, which is refused.
template <class Out>
class RefusedEntry final : public ValueEntry<Out> {
 public:
  explicit RefusedEntry(std::string label) : label_(std::move(label)) {}
  void backward(Tape&) override {
    if (this->grad() != nullptr) {
      throw ValueError("duet::grad: " + label_ + " is not differentiable, but a gradient flows through it");
    }
  }

 private:
  std::string label_;
};

// A parameter read directly by operations: its gradient goes to the parameter.
template <class T>
class ParameterEntry final : public ValueEntry<T> {
 public:
  explicit ParameterEntry(const nn::BasicParameter<T>* p) : parameter_(p) {}
  void backward(Tape&) override {
    if (const BasicTensor<T>* g = this->grad()) {
      duet::detail::run_into_new<DefaultBackend>(ops::ParameterGradOp<T>{parameter_}, *g);
    }
  }

 private:
  const nn::BasicParameter<T>* parameter_;
};

template <class T>
BasicTensor<T> Tape::watch_parameter(const nn::BasicParameter<T>& p) {
  BasicTensor<T> handle = p;
  add(std::make_unique<ParameterEntry<T>>(&p), handle);
  return handle;
}

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
  static_cast<void>(sizeof(diagnostic::check_operation<Op>));
  const bool reads_tracked = (tracks(x) || ...);
  if constexpr (DifferentiableOperation<Op>) {
    if (!reads_tracked && !has_parameters<Op>()) return;
    add(std::make_unique<OpEntry<Op, Out, In...>>(op, y, x...), y);
  } else if (reads_tracked) {
    add(std::make_unique<RefusedEntry<Out>>(op.label()), y);
  }
}

template <class T, class Hook>
BasicTensor<T>* Tape::begin_cell(const BasicTensor<T>& input, Hook hook) {
  auto entry = std::make_unique<CellEntry<T, Hook>>(input, std::move(hook));
  BasicTensor<T>* slot = &entry->output;
  entries_.push_back(std::move(entry));
  has_cell_hooks_ = true;
  return slot;
}

inline std::vector<std::size_t> Tape::backward_order(std::size_t from) const {
  std::vector<std::size_t> order;
  if (has_cell_hooks_) {
    for (std::size_t i = entries_.size(); i-- > 0;) order.push_back(i);
    return order;
  }
  // Each record's inputs, in one array: record i reads inputs[begin[i]] to inputs[begin[i + 1]].
  std::vector<std::size_t> inputs;
  std::vector<std::size_t> begin(entries_.size() + 1, 0);
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    begin[i] = inputs.size();
    entries_[i]->append_inputs(*this, inputs);
  }
  begin[entries_.size()] = inputs.size();
  std::vector<bool> visited(entries_.size(), false);
  // (record, its next input to visit): a loop, not recursion, for deep networks' long chains.
  std::vector<std::pair<std::size_t, std::size_t>> stack{{from, begin[from]}};
  visited[from] = true;
  while (!stack.empty()) {
    auto& [record, next] = stack.back();
    if (next == begin[record + 1]) {
      order.push_back(record);
      stack.pop_back();
      continue;
    }
    const std::size_t input = inputs[next++];
    if (!visited[input]) {
      visited[input] = true;
      stack.emplace_back(input, begin[input]);
    }
  }
  std::reverse(order.begin(), order.end());
  return order;
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
  for (std::size_t i : backward_order(index_of(output.tape_id()))) entries_[i]->backward(*this);
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
    y = first.view(view_offset(op, shapes[0]), out_shape);
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

namespace detail {

// An operand of an operation that runs now: a parameter is tracked by the recording tape (its
// gradient goes to the parameter), any other tensor is itself.
template <class X>
decltype(auto) eager_operand(const X& x) {
  if constexpr (nn::is_parameter_v<X>) {
    if (autodiff::Tape* tape = autodiff::active_tape()) return tape->watch_parameter(x);
    return BasicTensor<typename X::value_type>(x);
  } else {
    return tensor_of(x);
  }
}

// An operand of an operation being captured: a parameter becomes a node of the graph.
template <class X>
decltype(auto) graph_operand(const X& x) {
  if constexpr (nn::is_parameter_v<X>) return graph::parameter(x);
  else return (x);
}

template <class X>
struct StaticOperand {
  static constexpr Shape shape = X::static_shape;
};

// An operation on static tensors outside construct: its rule is checked at compile time, as in
// construct, and the result is a StaticTensor of the shape the rule gives.
template <class Op, class... X>
auto run_static(const Op& op, const X&... xs) {
  diagnostic::report_static_fault<Op, StaticOperand<X>...>();
  auto y = run_into_new<DefaultBackend>(op, tensor_of(xs)...);
  constexpr ShapeResult r = Op::infer_static(std::array<Shape, sizeof...(X)>{X::static_shape...});
  if constexpr (r.ok() && !r.shape.leading_unknown()) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return StaticTensor<typename decltype(y)::value_type, r.shape[static_cast<int>(I)]...>(std::move(y));
    }
    (std::make_index_sequence<static_cast<std::size_t>(r.shape.rank())>{});
  } else {
    return y;
  }
}

}  // namespace detail

// The one entry point layers use: on symbolic tensors it records the operation in the graph,
// on static tensors it checks the shapes at compile time and runs it now, on other tensors it
// runs it now. A cell's parameter may be an operand in either mode.
template <class Op, class X>
auto apply(const Op& op, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return graph::append(op, x);
  } else if constexpr (is_static_tensor_v<std::remove_cvref_t<X>>) {
    return detail::run_static(op, x);
  } else if constexpr (nn::is_parameter_v<std::remove_cvref_t<X>>) {
    return detail::run_into_new<DefaultBackend>(op, detail::eager_operand(x));
  } else {
    return run_eager(op, std::forward<X>(x));
  }
}

template <class Op, class A, class B, class... C>
auto apply(const Op& op, const A& a, const B& b, const C&... c) {
  constexpr bool any_symbolic = graph::Symbolic<A> || graph::Symbolic<B> || (graph::Symbolic<C> || ...);
  if constexpr (any_symbolic) {
    static_assert((graph::Symbolic<A> || nn::is_parameter_v<A>)&&(graph::Symbolic<B> || nn::is_parameter_v<B>)&&(
                      (graph::Symbolic<C> || nn::is_parameter_v<C>)&&...),
                  "duet: an operation mixes a symbolic tensor (graph capture) and a real one; pass "
                  "every tensor the graph reads as an input of the captured function (a cell's own "
                  "parameters may be used directly)");
    return graph::append(op, detail::graph_operand(a), detail::graph_operand(b), detail::graph_operand(c)...);
  } else if constexpr (is_static_tensor_v<A> && is_static_tensor_v<B> && (is_static_tensor_v<C> && ...)) {
    return detail::run_static(op, a, b, c...);
  } else {
    return detail::run_into_new<DefaultBackend>(op, detail::eager_operand(a), detail::eager_operand(b),
                                                detail::eager_operand(c)...);
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

// Where a call was made, taken as a default argument is. Not std::source_location: libstdc++
// 12 leaves it empty under clang 14, which lacks __builtin_source_location; the builtins
// below are in both compilers.
struct SourceLocation {
  const char* file = "";
  unsigned line = 0;
  static constexpr SourceLocation current(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    return {file, line};
  }
  // Appended, not a chain of operator+: g++ 12 warns of bounds (-Warray-bounds) inside such a
  // chain at -O1, falsely.
  std::string to_string() const {
    std::string s = file;
    s += ':';
    s += std::to_string(line);
    return s;
  }
};

// The values duet::record_value records on this thread while it lives: a compiled graph's
// intermediate tensors, read after the call without leaving graph mode (PyNative records them
// as it runs, too). Without a recorder the recording nodes look at nothing: no copy, no
// allocation, one thread-local read. Recorders nest; the innermost records. A tag recorded
// again keeps the newest value.
class ValueRecorder {
 public:
  ValueRecorder() : outer_(active()) { active() = this; }
  ~ValueRecorder() { active() = outer_; }
  ValueRecorder(const ValueRecorder&) = delete;
  ValueRecorder& operator=(const ValueRecorder&) = delete;

  bool contains(const std::string& tag) const { return values_.contains(tag); }
  std::vector<std::string> tags() const {
    std::vector<std::string> out;
    for (const auto& [tag, entry] : values_) out.push_back(tag);
    return out;
  }

  template <ElementType T = float>
  const BasicTensor<T>& get(const std::string& tag) const {
    const auto it = values_.find(tag);
    if (it == values_.end()) {
      std::string recorded;
      for (const auto& [t, entry] : values_) recorded += (recorded.empty() ? "'" : ", '") + t + "'";
      throw ValueError("duet::ValueRecorder: no value was recorded under '" + tag + "' (recorded: " +
                       (recorded.empty() ? std::string("none") : recorded) + ")");
    }
    if (it->second.dtype != dtype_of<T>) {
      throw ValueError("duet::ValueRecorder: '" + tag + "' holds " + std::string(name_of(it->second.dtype)) +
                       " values, asked for " + std::string(name_of(dtype_of<T>)));
    }
    return *static_cast<const BasicTensor<T>*>(it->second.value.get());
  }

  // The recorder of the calling thread, or null.
  static ValueRecorder*& active() {
    thread_local ValueRecorder* recorder = nullptr;
    return recorder;
  }

  template <class T>
  void record(const char* tag, const T* values, const Shape& shape) {
    auto copy = std::make_shared<BasicTensor<T>>(BasicTensor<T>::uninitialized(shape));
    std::copy_n(values, copy->numel(), copy->data());
    values_[tag] = Entry{dtype_of<T>, std::move(copy)};
  }

 private:
  struct Entry {
    DType dtype;
    std::shared_ptr<const void> value;
  };
  std::map<std::string, Entry> values_;
  ValueRecorder* outer_;
};

namespace ops {

struct IdentityGradOp : Primitive<IdentityGradOp> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  static std::string op_name() { return "Identity"; }
};

// What PrintOp and RecordOp share: a view of the input, whose kernel only looks at it (so it
// runs at every jit level, in both modes) and whose gradient passes through.
template <class Derived>
struct LookOp {
  using layer_type = Derived;
  static constexpr int arity = 1;
  static constexpr bool is_view = true;
  static constexpr bool has_side_effects = true;
  static constexpr bool is_elementwise = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  ShapeResult infer(std::span<const Shape> in) const { return infer_static(in); }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return IdentityGradOp{};
  }

  std::string label() const { return Derived::op_name(); }
};

// Prints "label: value" (numpy's format) when the value is computed; outputs its input.
struct PrintOp : LookOp<PrintOp> {
  const char* text;        // the label; a string literal or a string that outlives the graph
  std::ostream* out;
  PrintOp(const char* t, std::ostream* o) : text(t), out(o) {}

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    auto copy = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), copy.numel(), copy.data());
    // One print at a time: threads running graphs side by side do not interleave lines.
    std::lock_guard lock(duet::detail::print_mutex());
    *out << (text[0] != '\0' ? std::string(text) + ": " : std::string()) << copy << '\n';
  }

  static std::string op_name() { return "Print"; }
};

// Records the value under `tag` in the thread's duet::ValueRecorder, when there is one.
struct RecordOp : LookOp<RecordOp> {
  const char* tag;  // a string literal or a string that outlives the graph
  explicit RecordOp(const char* t) : tag(t) {}

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    if (ValueRecorder* recorder = ValueRecorder::active()) recorder->record(tag, a.in<T>(), a.in_shape());
  }

  static std::string op_name() { return "Record"; }
};

// Calls a C++ function on the value; its result (of the same shape) is the node's value.
// Allowed: the call was marked an intended graph break (duet::host<duet::allowed_break>).
template <class T, bool Allowed = false>
struct HostOp {
  using layer_type = HostOp;
  using value_type = T;
  static constexpr int arity = 1;
  static constexpr bool is_view = false;
  static constexpr bool is_elementwise = false;
  static constexpr bool is_host = true;
  static constexpr bool allowed_break = Allowed;

  std::function<BasicTensor<T>(const BasicTensor<T>&)> fn;
  SourceLocation where;  // the duet::host call: what graph_ir and the compile log name

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
  std::string label() const {
    std::string s = Allowed ? "duet::host<allowed_break> at " : "duet::host at ";
    s += where.to_string();
    return s;
  }
};

}  // namespace ops

// Marks a host callback as an intended graph break: duet::host<duet::allowed_break>(fn, x).
// JitSyntaxLevel::compatible accepts such breaks only.
struct allowed_break {};

namespace graph {
// The first host node of G, or G::size; with UnmarkedOnly, the first not marked allowed_break.
template <class G, bool UnmarkedOnly = false>
constexpr std::size_t first_host_node() {
  std::size_t found = G::size;
  for_each_index<G::size>([&](auto i) {
    using Op = typename node_at<G, decltype(i)::value>::op_type;
    if constexpr (is_host_op<Op>()) {
      if (found == G::size && !(UnmarkedOnly && Op::allowed_break)) found = decltype(i)::value;
    }
  });
  return found;
}

// The jit syntax level of Config, checked on a captured graph G, for every front end (a cell's
// construct, a jitted function, grad): strict refuses every host callback, compatible those
// not marked allowed_break, lax none.
template <JitConfig Config, class G>
constexpr void check_syntax_level() {
  if constexpr (Config.jit_syntax_level == JitSyntaxLevel::strict) {
    static_assert(first_host_node<G>() == G::size,
                  "duet::jit: JitSyntaxLevel::strict: the function calls duet::host, a host callback, which is not "
                  "a graph operation; use JitSyntaxLevel::lax to run it as a graph break");
  } else if constexpr (Config.jit_syntax_level == JitSyntaxLevel::compatible) {
    static_assert(first_host_node<G, true>() == G::size,
                  "duet::jit: JitSyntaxLevel::compatible: the function calls duet::host without marking the graph "
                  "break as intended; write duet::host<duet::allowed_break>(fn, x), or use JitSyntaxLevel::lax");
  }
}
}  // namespace graph

// Prints x with an optional label when it is computed, and returns it: in PyNative at once, in a
// graph when the graph runs. The label must outlive the graph (a literal, say).
template <class X>
auto print(X&& x, const char* label = "", std::ostream& out = std::cout) {
  return apply(ops::PrintOp{label, &out}, std::forward<X>(x));
}

// Records x under `tag` in the calling thread's duet::ValueRecorder, if one is alive, when it is
// computed, and returns it: in PyNative at once, in a graph when the graph runs. The tag must
// outlive the graph (a literal, say).
template <class X>
auto record_value(X&& x, const char* tag) {
  return apply(ops::RecordOp{tag}, std::forward<X>(x));
}

// Runs fn (a function from a tensor to a tensor of the same shape) on x: now in PyNative, or
// as a host node (a graph break) in a graph, named by where it is called. Mark, with
// duet::host<duet::allowed_break>(fn, x), a break that is intended.
template <class Mark = void, class F, class X>
auto host(F&& fn, X&& x, SourceLocation where = SourceLocation::current()) {
  static_assert(std::is_void_v<Mark> || std::is_same_v<Mark, allowed_break>,
                "duet::host<Mark>: Mark is duet::allowed_break, or nothing");
  using T = typename std::remove_cvref_t<X>::value_type;
  return apply(ops::HostOp<T, std::is_same_v<Mark, allowed_break>>{
                   std::function<BasicTensor<T>(const BasicTensor<T>&)>(std::forward<F>(fn)), where},
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
//   pack_weights                   products keep their weights pre-packed between calls (O1 and
//                                  O2, graphs not being trained)

#include <array>
#include <cstddef>
#include <utility>


namespace duet::passes {

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
} && (!Differentiated || DifferentiableOperation<decltype(std::declval<const P&>().absorb(std::declval<const C&>()))>);

// A producer op P takes the binary consumer C, reading P's value as its input Pos, into
// itself (elementwise chains: one pass over all their inputs); never in a graph that will be
// differentiated, since the fused op keeps no value in between.
template <class P, class C, int Pos, bool Differentiated>
concept absorbs_operand =
    !Differentiated && requires(const P& p, const C& c) { p.template absorb_operand<Pos>(c); };

namespace detail {

// Whether every built node after position R has no inputs (graph inputs, parameters): a node
// moved past them reads nothing they make.
template <class Built, std::size_t R>
constexpr bool only_sources_after() {
  bool ok = true;
  graph::for_each_index<Built::size>([&](auto i) {
    constexpr std::size_t I = decltype(i)::value;
    if constexpr (I > R) ok = ok && graph::node_at<Built, I>::node::arity == 0;
  });
  return ok;
}

// Which input of a binary node J the fusion can take: one read by J alone, made by a built
// node with only sources (graph inputs, parameters) after it, the other input being another
// node. -1 if neither.
template <class G, std::size_t J, std::size_t Out, class Built, std::size_t... Map>
constexpr int operand_to_absorb() {
  using N = graph::node_at<G, J>;
  constexpr std::array<std::size_t, J> m{Map...};
  const auto users = user_counts<G, Out>();
  const std::size_t a0 = N::args[0], a1 = N::args[1];
  if (a0 == a1 || m[a0] == m[a1]) return -1;
  if (users[a0] == 1 && only_sources_after<Built, m[N::args[0]]>()) return 0;
  if (users[a1] == 1 && only_sources_after<Built, m[N::args[1]]>()) return 1;
  return -1;
}

// Map after the built node at R is taken out and its value made by a node appended at the
// end: later nodes move down one, R's users go to the end.
template <std::size_t R, std::size_t End, std::size_t... Map>
constexpr std::array<std::size_t, sizeof...(Map)> moved_to_end() {
  std::array<std::size_t, sizeof...(Map)> m{Map...};
  for (std::size_t& v : m) v = v == R ? End : v > R ? v - 1 : v;
  return m;
}

template <auto A, std::size_t... I>
constexpr auto as_sequence(std::index_sequence<I...>) {
  return std::index_sequence<A[I]...>{};
}

// How a fused node's operation is made from the captured graph's (graph::Step's recipe): node
// J's own (graph::Take), or the operation of a fused node (From) absorbing node J's, as its
// epilogue (Pos < 0) or through its input Pos.
template <class From, std::size_t J, int Pos>
struct Absorb {
  template <class G>
  static auto make(const G& g) {
    if constexpr (Pos < 0) return From::make(g).absorb(graph::get<J>(g).op);
    else return From::make(g).template absorb_operand<Pos>(graph::get<J>(g).op);
  }
};

// L without its element R, then X.
template <std::size_t R, class L, class X, class I = std::make_index_sequence<L::size - 1>>
struct moved_out;
template <std::size_t R, class L, class X, std::size_t... I>
struct moved_out<R, L, X, std::index_sequence<I...>> {
  using type = graph::NodeList<graph::node_at<L, (I < R ? I : I + 1)>..., X>;
};

// A node of Op reading what node type P reads, then Extra.
template <class Op, class P, class A, std::size_t... Extra>
struct with_args;
template <class Op, class P, std::size_t... A, std::size_t... Extra>
struct with_args<Op, P, std::index_sequence<A...>, Extra...> {
  using type = graph::Node<Op, P::args[A]..., Extra...>;
};
template <class Op, class P, std::size_t... Extra>
using with_args_of = typename with_args<Op, P, std::make_index_sequence<P::arity>, Extra...>::type;

// Walks the nodes in order, planning the fused list: a NodeList of Steps, and where the output
// is. Map[j] is where node j's value lives in the new list. A unary consumer folds into the
// node that computes its input when that node is the last one planned, absorbs it, and nobody
// else reads the value in between. Types only: the list is made once, from the plan
// (fuse_epilogues), where growing it node by node would copy it once per node.
template <std::size_t J, std::size_t Out, bool Differentiated, class G, class Built, std::size_t... Map>
auto fuse_from(std::index_sequence<Map...> map) {
  if constexpr (J == G::size) {
    constexpr std::array<std::size_t, G::size> m{Map...};
    return std::pair<std::type_identity<Built>, std::integral_constant<std::size_t, m[Out]>>{};
  } else {
    using N = graph::node_at<G, J>;
    using Kept =
        graph::Step<decltype(graph::renumbered(std::declval<const N&>(), map, std::make_index_sequence<N::arity>{})),
                    graph::Take<J>>;
    constexpr std::size_t built_size = Built::size;
    if constexpr (N::arity == 1) {
      constexpr std::array<std::size_t, J> m{Map...};
      constexpr std::size_t a = N::args[0];
      constexpr std::size_t r = m[a];
      using PS = graph::node_at<Built, r>;
      using P = typename PS::node;
      if constexpr (r + 1 == built_size && user_counts<G, Out>()[a] == 1 &&
                    absorbs<typename P::op_type, typename N::op_type, Differentiated>) {
        using Absorbed = decltype(std::declval<const P&>().op.absorb(std::declval<const N&>().op));
        using Fused = graph::Step<with_args_of<Absorbed, P>, Absorb<typename PS::recipe, J, -1>>;
        return fuse_from<J + 1, Out, Differentiated, G, typename moved_out<r, Built, Fused>::type>(
            std::index_sequence<Map..., r>{});
      } else {
        return fuse_from<J + 1, Out, Differentiated, G, typename graph::appended<Built, Kept>::type>(
            std::index_sequence<Map..., built_size>{});
      }
    } else if constexpr (N::arity == 2) {
      constexpr int pos = operand_to_absorb<G, J, Out, Built, Map...>();
      constexpr std::array<std::size_t, J> m{Map...};
      constexpr std::size_t r = m[N::args[pos < 0 ? 0 : pos]];
      using PS = graph::node_at<Built, r>;
      using P = typename PS::node;
      if constexpr (pos >= 0 && absorbs_operand<typename P::op_type, typename N::op_type, pos, Differentiated>) {
        // P's node leaves its place for one at the end that also reads the other input.
        static constexpr auto moved = moved_to_end<r, built_size - 1, Map..., r>();
        using Absorbed =
            decltype(std::declval<const P&>().op.template absorb_operand<pos>(std::declval<const N&>().op));
        using Fused =
            graph::Step<with_args_of<Absorbed, P, moved[N::args[1 - pos]]>, Absorb<typename PS::recipe, J, pos>>;
        return fuse_from<J + 1, Out, Differentiated, G, typename moved_out<r, Built, Fused>::type>(
            as_sequence<moved>(std::make_index_sequence<J + 1>{}));
      } else {
        return fuse_from<J + 1, Out, Differentiated, G, typename graph::appended<Built, Kept>::type>(
            std::index_sequence<Map..., built_size>{});
      }
    } else {
      return fuse_from<J + 1, Out, Differentiated, G, typename graph::appended<Built, Kept>::type>(
          std::index_sequence<Map..., built_size>{});
    }
  }
}

}  // namespace detail

// Moves each bias add and elementwise activation into the epilogue of the product that
// feeds it, and fuses chains of elementwise functions, so each value is written once.
template <bool Differentiated = false, class G, std::size_t Out>
auto fuse_epilogues(const graph::Sym<G, Out>& program) {
  using Plan = decltype(detail::fuse_from<0, Out, Differentiated, G, graph::NodeList<>>(std::index_sequence<>{}));
  using Built = typename Plan::first_type::type;
  auto fused = graph::from_plan<graph::Graph>(program.graph, static_cast<Built*>(nullptr));
  return graph::Sym<decltype(fused), Plan::second_type::value>{fused};
}

// Each op that can read its weight pre-packed (with_packed_weight()) is replaced by that
// form. Not for graphs being trained: their weights change at every step, and a packed copy
// would only add a pass over them.
template <class G, std::size_t Out>
auto pack_weights(const graph::Sym<G, Out>& program) {
  auto nodes = graph::transformed(program.graph, []<class Op, std::size_t... A>(const graph::Node<Op, A...>& n) {
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
  else if constexpr (Differentiated) return fuse_epilogues<Differentiated>(program);
  else return pack_weights(fuse_epilogues<Differentiated>(program));
}

}  // namespace duet::passes
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

// A step and the elementwise steps its op takes as epilogue (Step::takes_functions), run one
// after the other on one buffer: the functions in place on the step's output, so the values in
// between are never stored apart and no slot holds them. Each runs its own kernel, the one
// PyNative runs, so the bits are PyNative's, and graph mode's, whose fused products run such
// functions over their finished output too (backend::Native::dense; ReLU, exact in any layout,
// in registers). It is one class for every op and function: nothing is compiled per pair.
class EpilogueChain final : public Step {
 public:
  // `next` taken into `head` (which may already be a chain); it alone read head's value.
  static std::unique_ptr<Step> append(std::unique_ptr<Step> head, std::unique_ptr<Step> next) {
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

  EpilogueChain(std::unique_ptr<Step> head, std::vector<std::shared_ptr<Step>> tail)
      : head_(std::move(head)), tail_(std::move(tail)) {
    inputs = head_->inputs;
    write_to(tail_.empty() ? head_->output : tail_.back()->output);
  }

  void run(void* const* data, const std::vector<Value>& values) const override {
    head_->run(data, values);
    for (const auto& t : tail_) t->run(data, values);
  }
  // The fused op takes more functions as the head's op does; a bias only before functions.
  bool takes_functions(bool parameterless) const override { return head_->takes_functions(parameterless); }
  bool rounds_differently() const override { return head_->rounds_differently(); }
  std::unique_ptr<Step> with_packed_weight() const override {
    auto packed = head_->with_packed_weight();
    if (packed == nullptr) return nullptr;
    return std::make_unique<EpilogueChain>(std::move(packed), tail_);
  }
  bool is_view() const override { return false; }
  bool runs_kernel() const override { return true; }
  std::string op_name() const override {
    std::string name = head_->op_name();
    for (const auto& t : tail_) name += " + " + t->op_name();
    return name;
  }
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
    // A trace that trains writes its weights between calls: packing them would be one more
    // pass over each weight per call (graph mode's passes skip training graphs too).
    if (level != JitLevel::O0 && !trace.differentiates()) pack_weights();
    layout();
  }

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
  std::string step_names() const {
    std::string names;
    for (const auto& step : steps_) names += (names.empty() ? "" : "; ") + step->op_name();
    return names;
  }

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
        case Value::Kind::view: data[v] = static_cast<char*>(data[value.view_of]) + value.view_bytes; break;
        case Value::Kind::computed:
          data[v] = v == output_root_ ? static_cast<void*>(result.data()) : arena.data() + offset_[v];
          break;
      }
    }
    for (const auto& step : steps_) {
      if (step->runs_kernel()) step->run(data.data(), values_);
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
      // The output root lives in the result, not in a slot (none may exist when it is viewed).
      if (made[v] && values_[v].kind == Value::Kind::computed && v != output_root_) {
        offset_[v] = slot_offset[slot_of[v]];
      }
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
// The compile driver of graph mode, written once for Cell, grad and jit:
//
//   capture   the function called on symbolic inputs (graph::input) returns the program as a
//             type; each front end captures its own way (a cell's construct, a function with
//             non-tensor arguments for jit), through compile() where the inputs are tensors
//   passes    passes::optimize<Config> rewrites that type (grad then appends the backward
//             graph, autodiff::build_backward)
//   plan      for the inputs' shapes, kept per owner and thread (cached_plan)
//   run       the evaluator, in one call (execute)
//
// Capture and passes happen while the program compiles; plan once per new input shape; run
// on every call.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>



namespace duet::pipeline {

// A symbolic input: its element type and what compile time knows of its shape.
template <class T, class Pattern>
struct Input {};

// f captured on Inputs (input K being the K-th) and optimised; Differentiated keeps every
// operation differentiable, for a graph that build_backward extends. The program keeps the
// capture's ambiguity (graph::Sym::ambiguity): when it is not empty, the program computes one
// value where the function computes two, and the caller runs the function another way (a
// trace, which knows each value at run time).
template <JitConfig Config, bool Differentiated, class... Inputs, class F>
auto compile(F&& f) {
  return [&]<class... T, class... P, std::size_t... K>(std::index_sequence<K...>, Input<T, P>*...) {
    const auto captured = f(graph::input<T, P, K>()...);
    graph::check_syntax_level<Config, typename decltype(captured)::graph_type>();
    auto program = passes::optimize<Config, Differentiated>(captured);
    program.ambiguity = captured.ambiguity;
    return program;
  }(std::index_sequence_for<Inputs...>{}, static_cast<Inputs*>(nullptr)...);
}

template <graph::Phase P>
using PhaseConstant = std::integral_constant<graph::Phase, P>;

// The phase the layers of the phase-dependent nodes of g are set to. When they disagree, the
// error names the first two that do: the kernels' own check (ops::PhaseOf) could only blame
// the layer whose operation ran in the other phase's form, which need not be the one the user
// switched.
template <class G, auto nodes>
graph::Phase agreed_phase(const G& g) {
  const auto& lead = graph::get<nodes[0]>(g).op;
  const graph::Phase phase = lead.requested_phase();
  const auto setting = [](graph::Phase p) { return p == graph::Phase::train ? "train" : "evaluate"; };
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    const auto agrees = [&](const auto& op) {
      if (op.requested_phase() == phase) return true;
      throw ModeError(lead.layer_label() + " is set to " + setting(phase) + " and " + op.layer_label() + " to " +
                      setting(op.requested_phase()) +
                      " (set_train); graph mode captures a network in one phase, which all its layers must "
                      "share: call set_train on the whole network, or run it in PyNative mode");
    };
    static_cast<void>((agrees(graph::get<nodes[K]>(g).op) && ...));
  }(std::make_index_sequence<nodes.size()>{});
  return phase;
}

// run(program), program being what capture(PhaseConstant<P>{}) makes for the phase the
// network's layers are set to (set_train). The training form is made first: its type says
// whether any operation depends on the phase, and if any do, their layers say which form to
// run, and must agree (agreed_phase). Each form's plan is cached apart (cached_plan keys on the graph's type), so switching
// back and forth keeps both. Every phase-dependent kernel checks its layer again when it
// runs, so a form whose layers have been switched since (one layer alone, say) is refused,
// never run stale.
template <class Capture, class Run>
decltype(auto) in_requested_phase(Capture&& capture, Run&& run) {
  auto&& train = capture(PhaseConstant<graph::Phase::train>{});
  using G = typename std::remove_cvref_t<decltype(train)>::graph_type;
  constexpr auto nodes = graph::phase_dependent_nodes<G>();
  if constexpr (!nodes.empty()) {
    if (agreed_phase<G, nodes>(train.graph) == graph::Phase::eval) {
      return run(capture(PhaseConstant<graph::Phase::eval>{}));
    }
  }
  return run(train);
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

// Plans (or reuses the plan for these shapes) and runs a compiled program. `owner` keys the
// plan cache (detail::new_plan_owner); `where` names the program in shape errors.
template <JitConfig Config, class G, std::size_t Out, class Where, class... Ts>
auto execute(std::uint64_t owner, const graph::Sym<G, Out>& program, Where&& where, const BasicTensor<Ts>&... xs) {
  const std::array<Shape, sizeof...(Ts)> shapes{xs.shape()...};
  return run<DefaultBackend, Config>(program, cached_plan<Config>(owner, program, shapes, where), xs...);
}

}  // namespace duet::pipeline

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
  std::set<std::string> ambiguities_logged;    // log_ambiguous_capture's
  std::set<std::string> ambiguities_explained;
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

// Says in the log that `who` does not run as the static graph capture made and what runs
// instead, once per (who, why, instead): a loop of calls logs it once. The reason is spelled
// out the first time only: one network met in forward, gradient and training-step paths is one
// ambiguity, not three paragraphs.
inline void log_ambiguous_capture(const std::string& who, const std::string& why, const std::string& instead) {
  auto& stats = jit_stats();
  std::lock_guard lock(stats.mutex);
  if (!stats.ambiguities_logged.insert(who + '\n' + why + '\n' + instead).second) return;
  const bool explained = !stats.ambiguities_explained.insert(who + '\n' + why).second;
  stats.log.push_back(who + ": runs " + instead + ", not as a static graph: " +
                      (explained ? std::string("its capture is ambiguous, as logged above")
                                 : "at capture, " + why +
                                       ", which their types cannot tell apart (README, Guarantees: \"Shared values in "
                                       "graph mode\")"));
}

inline std::atomic<bool> compiles_frozen_flag{false};
}  // namespace detail

// For serving: after freeze_compiles(), every compilation (a jitted function's new form, a
// PIJit trace, a runtime-built cell traced in graph mode on its first call) throws
// duet::RecompileError saying what would have compiled and why. Forms compiled before run as
// ever. A static graph (Cell<...>) is compiled with the program and is not concerned; its plan
// for a new input shape is not a compilation either.
inline void freeze_compiles() { detail::compiles_frozen_flag.store(true, std::memory_order_release); }
inline void unfreeze_compiles() { detail::compiles_frozen_flag.store(false, std::memory_order_release); }
inline bool compiles_frozen() { return detail::compiles_frozen_flag.load(std::memory_order_acquire); }

// Compiles frozen for a scope (a test, a serving loop), then as they were before it.
class FrozenCompiles {
 public:
  FrozenCompiles() : was_frozen_(detail::compiles_frozen_flag.exchange(true, std::memory_order_acq_rel)) {}
  ~FrozenCompiles() { detail::compiles_frozen_flag.store(was_frozen_, std::memory_order_release); }
  FrozenCompiles(const FrozenCompiles&) = delete;
  FrozenCompiles& operator=(const FrozenCompiles&) = delete;

 private:
  bool was_frozen_;
};

// Compilations of every jitted function so far.
inline std::uint64_t jit_compile_count() { return detail::jit_stats().compiles.load(); }

// One line per compilation, in order: which function, its compile number, and why; one when
// a PIJit trace is set aside because a cell in it has a hook now; and a "warning: " line when a
// function passes its max_compiled_forms under RecompilePolicy::warn.
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

// The part of a jitted function that does not depend on the function: its options, its
// compiled forms and the recompilation contract. A base of its own, so that this code is
// compiled once, not once per jitted function type (each cell has a few).
class JitBase {
 public:
  // Compilations of this function (of every function of its type, with compile_once).
  std::uint64_t compile_count() const { return state_->compiles.load(); }
  const std::string& name() const { return options_.name; }

 protected:
  struct State {
    std::atomic<std::uint64_t> compiles{0};
    std::atomic<bool> warned{false};  // RecompilePolicy::warn says it once
    std::mutex mutex;
    std::vector<std::pair<std::type_index, std::shared_ptr<void>>> caches;
  };

  JitBase(JitOptions options, std::size_t max_compiled_forms, RecompilePolicy on_limit)
      : options_(std::move(options)), state_(std::make_shared<State>()), limit_(max_compiled_forms), on_limit_(on_limit) {
    if (options_.name.empty()) options_.name = "jit function #" + std::to_string(++jit_stats().functions);
  }

  // Entries are never removed, so a pointer to one stays valid once the lock is released.
  template <std::size_t N>
  static const typename CompileCache<N>::Entry* find(CompileCache<N>& cache, const Signature<N>& s) {
    for (const auto& e : cache.entries) {
      if (e.signature == s) return &e;
    }
    return nullptr;
  }

  template <std::size_t N>
  static std::string why_compiled(const CompileCache<N>& cache, const Signature<N>& s) {
    return cache.entries.empty() ? std::string("first call") : why_recompiled(cache.entries.back().signature, s);
  }

  // The recompilation contract, asked before form `number` is made: refused while compiles are
  // frozen, and past max_compiled_forms as on_recompile_limit says.
  void admit(std::uint64_t number, const std::string& reason) const {
    if (compiles_frozen()) {
      throw RecompileError(options_.name + ": compiles are frozen (duet::freeze_compiles), and this call would compile " +
                           "form #" + std::to_string(number) + ": " + reason);
    }
    if (limit_ == 0 || number <= limit_) return;
    const std::string text = options_.name + ": compile #" + std::to_string(number) + " exceeds max_compiled_forms = " +
                             std::to_string(limit_) + ": " + reason;
    if (on_limit_ == RecompilePolicy::raise) {
      throw RecompileError(text);
    } else if (!state_->warned.exchange(true)) {
      jit_log("warning: " + text);
    }
  }

  template <std::size_t N>
  const typename CompileCache<N>::Entry& compile(CompileCache<N>& cache, const Signature<N>& s,
                                                          const std::string& reason,
                                                          std::shared_ptr<const pijit::Replay> replay,
                                                          const std::string& note = {}) {
    // Reserved by compare-and-swap: the caches of two argument lists have their own locks, so
    // two of this function's forms may be compiled at once, and the limit must hold for both.
    std::uint64_t number = state_->compiles.load();
    do {
      admit(number + 1, reason);
    } while (!state_->compiles.compare_exchange_weak(number, number + 1));
    ++number;
    jit_stats().compiles.fetch_add(1);
    jit_log(options_.name + ": compile #" + std::to_string(number) + ": " + reason +
                    (note.empty() ? "" : " (" + note + ")"));
    cache.entries.push_back({s, duet::detail::new_plan_owner(), std::move(replay)});
    return cache.entries.back();
  }

  template <std::size_t N>
  CompileCache<N>& compile_cache() {
    using Cache = CompileCache<N>;
    std::lock_guard lock(state_->mutex);
    const std::type_index key(typeid(Cache));
    for (auto& [type, cache] : state_->caches) {
      if (type == key) return *static_cast<Cache*>(cache.get());
    }
    state_->caches.emplace_back(key, std::make_shared<Cache>());
    return *static_cast<Cache*>(state_->caches.back().second.get());
  }

  // PIJit's compilation once the function has run under `trace` and returned value `out`: the
  // replay, or null when the trace broke and the function runs eagerly.
  template <std::size_t N>
  std::shared_ptr<const pijit::Replay> kept(CompileCache<N>& cache, const Signature<N>& s, const std::string& reason,
                                            pijit::Trace&& trace, std::size_t out, JitLevel level) {
    std::string broken = trace.broken();
    if (broken.empty() && out == trace.values().size()) broken = "the function returns a value no duet operation made";
    std::shared_ptr<const pijit::Replay> replay;
    std::string note = "graph break, runs eagerly: " + broken;
    if (broken.empty()) {
      replay = std::make_shared<pijit::Replay>(std::move(trace), out, level);
      note = "traced " + std::to_string(replay->traced_steps()) + " operations, replays " +
             std::to_string(replay->steps()) + " steps: " + replay->step_names();
    }
    compile(cache, s, reason, replay, note);
    return replay;
  }

  // What follows depends on the argument types only: shared by every function called with them.
  template <class X>
  static decltype(auto) argument(const X& x) {
    if constexpr (is_tensor_argument_v<X>) return tensor_of(x);
    else if constexpr (is_mutable_v<X>) return (x.value);
    else return (x);
  }

  template <class... Args>
  void check_signature(const Args&... args) const {
    const auto& specs = options_.input_signature;
    if (specs.empty()) return;
    constexpr std::size_t tensors = tensor_count<Args...>();
    if (specs.size() != tensors) {
      throw ValueError(options_.name + ": input_signature describes " + std::to_string(specs.size()) +
                       " tensors, the call passes " + std::to_string(tensors));
    }
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (check_one<tensor_index<I, Args...>()>(args), ...);
    }(std::index_sequence_for<Args...>{});
  }

  template <std::size_t K, class X>
  void check_one(const X& x) const {
    if constexpr (is_tensor_argument_v<X>) {
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
  Signature<sizeof...(Args)> signature_of(const Args&... args) const {
    Signature<sizeof...(Args)> s;
    const auto all = std::forward_as_tuple(args...);
    graph::for_each_index<sizeof...(Args)>([&](auto i) {
      constexpr std::size_t I = decltype(i)::value;
      using X = std::tuple_element_t<I, std::tuple<Args...>>;
      if constexpr (is_tensor_argument_v<X>) {
        const auto& t = tensor_of(std::get<I>(all));
        s.dtypes[I] = t.dtype();
        // With an input_signature, the pattern (dynamic dimensions and all) is the key.
        s.shapes[I] = options_.input_signature.empty() ? t.shape()
                                                       : options_.input_signature[tensor_index<I, Args...>()].shape;
      } else if constexpr (!is_mutable_v<X>) {
        s.values[I] = value_hash(std::get<I>(all));
      }
    });
    s.hash_args.reserve(options_.hash_args.size());
    for (const HashArg& h : options_.hash_args) s.hash_args.push_back(h.hash());
    return s;
  }

  template <class T, class... Args>
  static BasicTensor<T> replayed(const pijit::Replay& replay, const Args&... args) {
    const auto inputs = std::apply([](const auto&... t) { return std::array<const void*, sizeof...(t)>{t.data()...}; },
                                   std::tuple_cat(tensor_tuple(args)...));
    return replay.template run<T>(inputs);
  }

  template <class X>
  static auto traced_argument(const X& x) {
    if constexpr (is_tensor_argument_v<X>) return BasicTensor<typename X::value_type>(tensor_of(x));
    else return argument(x);
  }

  template <class X>
  static void mark_input(pijit::Trace& trace, X& x, std::size_t& k) {
    if constexpr (is_tensor_v<X>) trace.add_input(x, k++);
  }

  template <class X>
  static auto tensor_tuple(const X& x) {
    if constexpr (is_tensor_argument_v<X>) return std::tuple<const BasicTensor<typename X::value_type>&>(tensor_of(x));
    else return std::tuple<>();
  }

  JitOptions options_;
  std::shared_ptr<State> state_;

 private:
  std::size_t limit_;
  RecompilePolicy on_limit_;
};

}  // namespace detail

template <JitConfig Config, class Fn>
class JitFunction : public detail::JitBase {
  using FnRef = std::remove_reference_t<Fn>;

 public:
  JitFunction(Fn fn, JitOptions options)
      : JitBase(std::move(options), Config.max_compiled_forms, Config.on_recompile_limit), fn_(std::forward<Fn>(fn)) {
    if (options_.compile_once) state_ = shared_state();
  }

  // Compiles the form for tensor arguments of these dtypes and shapes ahead of the first call,
  // so that call does not stall: by calling the function once on zeros, as the first call
  // would on its inputs (PIJit traces it; PSJit plans it, on this thread, and at O1 and O2
  // packs the weights). It counts toward max_compiled_forms and is refused while compiles are frozen; a
  // form already compiled is left as it is. What that call changes (a BatchNorm's moving
  // statistics in training, Dropout's generator) is put back, as for a step that does not
  // commit: the zeros leave no trace but the form. Every argument is a tensor of element type T.
  template <ElementType T = float, class... Specs>
    requires(std::same_as<Specs, TensorSpec> && ...)
  void precompile(const Specs&... specs) {
    if (!get_context().jit_enabled) return;  // nothing compiles
    std::size_t k = 0;
    const auto zeros_for = [&](const TensorSpec& spec) {
      if (spec.dtype != dtype_of<T> || !spec.shape.is_concrete()) {
        throw ValueError(options_.name + ": precompile<" + std::string(name_of(dtype_of<T>)) + "> takes concrete " +
                         std::string(name_of(dtype_of<T>)) + " shapes, got " + std::string(name_of(spec.dtype)) + " " +
                         to_string(spec.shape) + " for tensor " + std::to_string(k));
      }
      ++k;
      return zeros<T>(spec.shape);
    };
    const std::tuple<decltype(zeros<T>(specs.shape))...> inputs{zeros_for(specs)...};
    std::apply(
        [&](const auto&... x) {
          check_signature(x...);
          auto& cache = compile_cache<sizeof...(x)>();
          {
            std::shared_lock lock(cache.mutex);
            if (find(cache, signature_of(x...)) != nullptr) return;
          }
          const detail::StepScope discarded;
          (void)compiled(x...);
        },
        inputs);
  }

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
    auto& cache = compile_cache<sizeof...(Args)>();
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
        const std::string reason = why_compiled(cache, signature);
        if (options_.mode == JitMode::PIJit) {
          admit(state_->compiles.load() + 1, reason);  // before the trace runs the function for nothing
          return trace(cache, signature, reason, args...);
        }
        entry = &compile(cache, signature, reason, nullptr);
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
      return replayed<typename Result::value_type>(*entry->replay, args...);
    }
    if constexpr (Capturable<Args...>) {
      return Result(run_graph(entry->owner, args...));
    } else {
      throw ValueError(options_.name + ": the function is not generic over its tensors, so it cannot be captured "
                                       "as a static graph (PSJit); jit it with {.mode = JitMode::PIJit}");
    }
  }

  // DUET_JIT=0 or set_context({.jit_enabled = false}): the function as plain PyNative code.
  template <class... Args>
  auto eager(const Args&... args) {
    EagerScope eager;
    auto y = fn_(argument(args)...);
    return BasicTensor<typename decltype(y)::value_type>(y);
  }

  // PIJit's compilation: run the function eagerly under a trace, keep the trace for replay.
  template <std::size_t N, class... Args>
  auto trace(detail::CompileCache<N>& cache, const detail::Signature<N>& s, const std::string& reason,
             const Args&... args) {
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
    const auto replay = kept(cache, s, reason, std::move(trace), out, Config.jit_level);
    // A replay that folds a BatchNorm (evaluation, which changes no state) rounds differently
    // from the eager run that traced it: the traced call returns the replay's result too, so
    // that every call of this shape gives the same bits.
    if (replay != nullptr && replay->rounds_differently()) {
      return replayed<typename Result::value_type>(*replay, args...);
    }
    return Result(y);
  }

  template <class... Args>
  auto run_graph(std::uint64_t owner, const Args&... args) {
    const auto capture = [&](auto phase) {
      auto captured = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return fn_(symbolic<I, Args...>(args, phase)...);
      }(std::index_sequence_for<Args...>{});
      using Captured = decltype(captured);
      static_assert(graph::Symbolic<Captured>, "duet::jit: the function must return a tensor computed from its inputs");
      using G = typename Captured::graph_type;
      graph::check_syntax_level<Config, G>();
      auto program = passes::optimize<Config>(captured);
      program.ambiguity = captured.ambiguity;  // the optimised graph cannot run either
      return program;
    };
    return pipeline::in_requested_phase(capture, [&](const auto& program) {
      if (!program.ambiguity.empty()) {
        detail::log_ambiguous_capture(options_.name, program.ambiguity, "in PyNative mode");
        return eager(args...);
      }
      return std::apply(
          [&](const auto&... t) {
            return pipeline::execute<Config>(owner, program, [this] { return options_.name; }, t...);
          },
          std::tuple_cat(tensor_tuple(args)...));
    });
  }

  template <std::size_t I, class... Args, class X, graph::Phase P = graph::Phase::train>
  static decltype(auto) symbolic(const X& x, pipeline::PhaseConstant<P> = {}) {
    if constexpr (detail::is_tensor_argument_v<X>) {
      return graph::input<typename X::value_type, graph::pattern_in_phase<P, typename graph::pattern_of<X>::type>,
                          detail::tensor_index<I, Args...>()>();
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

  // What compile_once shares: one state per function type (and configuration).
  static std::shared_ptr<State> shared_state() {
    static const auto state = std::make_shared<State>();
    return state;
  }

  Fn fn_;
};

namespace detail {
// The jitted functions an object makes of itself on first use (a runtime-built cell's graph
// form, a cell's traced form), calling back into that object: one per function type. A moved
// object makes its own, so none calls into an object that has moved. Concurrent first uses
// make each once.
class OwnForms {
 public:
  OwnForms() = default;
  OwnForms(OwnForms&&) noexcept {}
  OwnForms& operator=(OwnForms&&) noexcept { return *this; }
  OwnForms(const OwnForms&) = delete;
  OwnForms& operator=(const OwnForms&) = delete;
  ~OwnForms() = default;

  template <class F, class Make>
  F& get(Make&& make) {
    std::lock_guard lock(mutex_);
    for (const auto& [type, form] : forms_) {
      if (type == typeid(F)) return *static_cast<F*>(form.get());
    }
    forms_.emplace_back(typeid(F), std::make_shared<F>(make()));
    return *static_cast<F*>(forms_.back().second.get());
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::type_index, std::shared_ptr<void>>> forms_;
};

// A call into an object, erased to its argument list. A jitted function of it is compiled once
// for every object type with that argument list (a traced form per cell type, with the whole
// jit machinery, is most of what a network costs to compile), and it is not generic over its
// tensors, so it is traced (PIJit), never captured as a second static graph.
template <class R, class... Args>
struct ErasedCall {
  void* self;
  R (*call)(void*, const Args&...);
  R operator()(const Args&... args) const { return call(self, args...); }
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

namespace detail {
// Set on a thread while duet::summary runs a network once: every cell then runs eagerly,
// whatever its mode, and reports each call here, so that each layer's output is seen. (A
// forward hook would be refused inside a graph, and would change the cells.)
template <ElementType T>
inline thread_local const BasicForwardHook<T>* call_observer = nullptr;
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
        training_(other.training_.load()),
        phase_chosen_(other.phase_chosen_.load()),
        hooks_(std::exchange(other.hooks_, {})),
        backward_hooks_(std::exchange(other.backward_hooks_, {})),
        last_hook_id_(other.last_hook_id_) {}
  BasicDynamicCell& operator=(BasicDynamicCell&&) = delete;
  virtual ~BasicDynamicCell() {
    duet::detail::live_hook_count().fetch_sub(static_cast<long>(hooks_.size() + backward_hooks_.size()));
  }

  // The cell on x, in its mode. A call that throws leaves what its layers change (BatchNorm's
  // moving statistics, Dropout's draws) as it was.
  BasicTensor<T> operator()(const BasicTensor<T>& x) {
    return duet::detail::all_or_nothing([&] { return call(x); });
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

  // MindSpore's Cell.set_train(mode=True): this cell and every cell below it are set to train
  // (true) or to evaluate (false). Only layers that differ between the two read it (BatchNorm
  // uses batch statistics and updates its moving ones in training, Dropout drops only in
  // training). As in MindSpore, a cell starts in evaluation (training() is false): call
  // set_train() before training a network that has such layers. A cell built at run time is
  // traced again after a switch (its trace holds the phase's operations); a Cell's two graph
  // forms are both kept (pipeline::in_requested_phase).
  BasicDynamicCell& set_train(bool mode = true) {
    for (auto& [path, cell] : cells_and_names()) {
      cell->training_.store(mode, std::memory_order_relaxed);
      cell->phase_chosen_.store(true, std::memory_order_relaxed);
    }
    structure_changed();
    return *this;
  }
  bool training() const { return training_.load(std::memory_order_relaxed); }

  // What a temporary switch (train::evaluate) gives back to each cell: its setting, and
  // whether anybody chose it, so that the switch does not count as a choice.
  struct PhaseSetting {
    bool training;
    bool chosen;
  };
  PhaseSetting phase_setting() const { return {training(), phase_chosen_.load(std::memory_order_relaxed)}; }
  void restore_phase_setting(PhaseSetting setting) {
    training_.store(setting.training, std::memory_order_relaxed);
    phase_chosen_.store(setting.chosen, std::memory_order_relaxed);
    structure_changed();
  }

  // Whether the cell computes differently in training and evaluation (BatchNorm, Dropout).
  virtual bool depends_on_phase() const { return false; }

  // A gradient through such a cell that nobody set_train-ed is almost always a training loop
  // that forgot set_train(true): it trains on the moving statistics with Dropout off, and
  // nothing fails. Says so on `out` (std::cerr), once per cell for the program's life. Calling
  // set_train(false) says evaluation is meant (fine-tuning with BatchNorm frozen) and silences
  // it. value_and_grad and grad call this on their first call.
  void warn_if_phase_unchosen(std::ostream& out) {
    for (auto& [path, cell] : cells_and_names()) {
      if (!cell->depends_on_phase() || cell->phase_chosen_.load(std::memory_order_relaxed) ||
          cell->phase_warned_.exchange(true)) {
        continue;
      }
      out << "duet: warning: a gradient is taken through " << cell->label()
          << ", which nobody set to train or evaluate, so it runs in evaluation (BatchNorm on its moving "
             "statistics, Dropout as the identity); call set_train(true) on the network to train it, or "
             "set_train(false) if evaluation is meant\n";
    }
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

  bool has_own_hooks() const { return !hooks_.empty() || !backward_hooks_.empty(); }

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
  // operator()'s call: hooks, then forward in this cell's mode.
  BasicTensor<T> call(const BasicTensor<T>& x) {
    check_registered();
    ensure_named();
    const BasicForwardHook<T>* observer = detail::call_observer<T>;
    if (observer == nullptr && effective_mode(CONTEXT_MODE) == GRAPH_MODE && autodiff::active_tape() == nullptr &&
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
    if (observer != nullptr) (*observer)(*this, x, y);
    return y;
  }

  // Graph mode for a cell built at run time: PIJit at the default JitConfig, traced on the first
  // call for each input shape and structure, replayed after. Its second argument is the
  // structure generation: a network changed since the trace is traced again.
  struct GraphCall {
    BasicDynamicCell* cell;
    BasicTensor<T> operator()(const BasicTensor<T>& x, std::uint64_t /*structure*/) const { return (*cell)(x); }
  };
  using GraphForm = JitFunction<JitConfig{}, GraphCall>;

  GraphForm& graph_form() {
    return forms_.get<GraphForm>([this] {
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
  std::atomic<bool> training_{false};    // MindSpore's Cell.training, false until set_train
  std::atomic<bool> phase_chosen_{false};  // set_train was called on it or above it
  std::atomic<bool> phase_warned_{false};  // warn_if_phase_unchosen said so already
  std::vector<std::pair<long, BasicForwardHook<T>>> hooks_;
  std::vector<std::pair<long, BasicBackwardHook<T>>> backward_hooks_;
  long last_hook_id_ = 0;

 protected:
  duet::detail::OwnForms forms_;  // this cell's jitted forms: graph_form, Cell's traced_form
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
// Names C through the operator's own template parameters, so that a constraint on it is asked
// when the operator is considered, not when Cell<Derived> is instantiated: clang 14 checks a
// non-dependent concept at the base's instantiation, while Derived is still incomplete, and
// keeps that answer ("no construct").
template <class C, class...>
struct deferred {
  using type = C;
};

template <auto Setting>
constexpr Mode mode_of_setting() {
  using S = std::remove_cvref_t<decltype(Setting)>;
  static_assert(std::is_same_v<S, Mode> || std::is_same_v<S, JitConfig>,
                "duet::nn::Cell<Derived, Setting>: Setting is a Mode (GRAPH_MODE, PYNATIVE_MODE, CONTEXT_MODE) "
                "or a JitConfig");
  if constexpr (std::is_same_v<S, JitConfig>) return GRAPH_MODE;
  else return Setting;
}
// Whether cell C declares (input_value_type) that its input holds U values.
template <class C, class U>
constexpr bool declares_input_value_type() {
  if constexpr (requires { typename C::input_value_type; }) return std::is_same_v<typename C::input_value_type, U>;
  else return false;
}

template <auto Setting>
constexpr JitConfig jit_config_of_setting() {
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(Setting)>, JitConfig>) return Setting;
  else return JitConfig{};
}

// How graph mode compiles network Net: its own JitConfig (nn::Cell<Net, JitConfig{...}>), else
// the default one (a cell that follows the context, a network built at run time).
template <class Net>
constexpr JitConfig graph_config_of() {
  if constexpr (requires { Net::jit_config; }) return Net::jit_config;
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
  template <graph::Symbolic... S>
    requires(sizeof...(S) >= 1 && capturable_construct<typename detail::deferred<Derived, S...>::type>() &&
             !NonGenericConstruct<typename detail::deferred<Derived, S...>::type>)
  auto operator()(const S&... xs) {
    check_capture();
    if constexpr (captured_apart<S...>()) {
      return graph::spliced(xs..., run_construct(graph::continuation<S...>()));
    } else {
      return run_construct(xs...);
    }
  }

  // Whether a call on one symbolic input is captured on an input of its own and spliced after
  // the input's graph: appending each of its operations to that graph would copy the graph
  // once per operation.
  template <class... S>
  static constexpr bool captured_apart() {
    if constexpr (sizeof...(S) == 1) {
      return graph::Symbolic<decltype(std::declval<Derived&>().construct(graph::continuation<S...>()))>;
    } else {
      return false;
    }
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
        return to_static_tensor<Captured>(
            duet::detail::all_or_nothing([&] { return run_graph<StaticShape<D...>>(x.tensor()); }));
      }
    }
    return to_static_tensor<Captured>((*this)(x.tensor()));
  }

  // One tensor of the element type the cell declares its input has, when that is not T:
  // `using input_value_type = std::int32_t;` in nn::Embedding and in a network that begins with
  // one (any other cell given a tensor of another type does not compile: its operations would
  // read the elements as T's). construct runs in this cell's mode, as for a tensor of T. Its
  // forward hooks take tensors of T, so a hook on this cell is refused rather than skipped.
  template <ElementType U>
    requires(!std::is_same_v<U, T> && detail::declares_input_value_type<Derived, U>() &&
             HasConstruct<Derived, BasicTensor<U>>)
  auto operator()(const BasicTensor<U>& x) {
    if (this->has_own_hooks()) {
      throw ModeError(this->label() + " has a hook, but hooks take tensors of its element type, and it is called with " +
                      std::string(name_of(dtype_of<U>)) + " values");
    }
    return duet::detail::all_or_nothing([&] {
      this->check_registered();
      this->ensure_named();
      if constexpr (can_capture()) {
        if (runs_as_graph()) return run_graph<graph::AnyShape>(x);
      }
      EagerScope eager;
      return run_construct(x);
    });
  }

  // Cells whose construct takes several tensors (a network with its loss, say). They are not
  // DynamicCells of one input, so they run no forward hooks of their own.
  template <class... X>
  requires(sizeof...(X) >= 2 && ((is_tensor_v<X> || is_static_tensor_v<X>)&&...)) auto operator()(const X&... xs) {
    return duet::detail::all_or_nothing([&] {
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
    });
  }

  std::string type_name() const override { return duet::detail::readable_type_name(typeid(Derived)); }

 protected:
  bool traced_in_graph_mode() const override { return false; }

  // Before a call on symbolic tensors. Hooks cannot run inside a graph: refused here rather
  // than silently dropped.
  void check_capture() {
    if (this->has_hooks_in_tree()) {
      throw ModeError(this->label() +
                      " is captured into a graph (graph mode or jit), but it or a cell in it has a hook; hooks "
                      "see intermediate values in PyNative mode only");
    }
    this->check_registered();
  }

  template <class Captured>
  static auto to_static_tensor(BasicTensor<T> y) {
    constexpr Shape s = Captured::shape;
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return StaticTensor<T, s[static_cast<int>(I)]...>(std::move(y));
    }
    (std::make_index_sequence<static_cast<std::size_t>(s.rank())>{});
  }

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

  // The program a graph-mode call with inputs like xs runs in phase P: the one captured by the
  // first such call and kept, with the values construct read then as its constants.
  // duet::compare_modes reads it, so that it compares what graph mode really runs.
  template <graph::Phase P, class... Patterns, class... Ts>
  const auto& graph_program(const BasicTensor<Ts>&... xs) {
    this->check_registered();
    this->ensure_named();
    return captured<P, Patterns...>(xs...);
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
  // the same numbers, and gradients that reach its parameters. So does a cell duet::summary
  // observes, so that the call of each cell inside it is seen, and one a PIJit trace runs
  // through, whose replay would otherwise read the graph's output as a constant.
  static bool runs_as_graph() {
    return effective_mode(M) == GRAPH_MODE && autodiff::active_tape() == nullptr && detail::call_observer<T> == nullptr &&
           pijit::active_trace() == nullptr;
  }

  // Capture, optimise, run, in the phase the network's layers are set to. Capture and passes
  // cost nothing at run time (they are types); the plan for the inputs' shapes is kept per
  // thread and form, so repeated shapes skip planning.
  template <class... Patterns, class... Ts>
  auto run_graph(const BasicTensor<Ts>&... xs) {
    if (this->has_hooks_in_tree()) {
      throw ModeError(this->label() +
                      " runs in graph mode, but a cell in it has a hook; hooks see intermediate values "
                      "in PyNative mode only (set_context({.mode = PYNATIVE_MODE}))");
    }
    return pipeline::in_requested_phase(
        [&](auto phase) -> const auto& { return captured<decltype(phase)::value, Patterns...>(xs...); },
        [&](const auto& program) {
          if (!program.ambiguity.empty()) return traced_form<Ts...>()(xs...);
          return pipeline::execute<jit_config>(
              this->id(), program, [this] { return this->type_name() + "::construct"; }, xs...);
        });
  }

  // construct is captured once per cell, thread and phase, as MindSpore compiles it once per
  // phase: on a small network capturing costs as much as running. Values construct reads while
  // it is captured are constants of the graph. A cell's id is never reused, and a moved cell
  // gets a new one, so the program's references to this cell and its members stay valid.
  template <graph::Phase P, class... Patterns, class... Ts>
  const auto& captured(const BasicTensor<Ts>&...) {
    const auto capture = [&] {
      return pipeline::compile<jit_config, false, pipeline::Input<Ts, graph::pattern_in_phase<P, Patterns>>...>(
          [&](const auto&... in) { return run_construct(in...); });
    };
    using Program = decltype(capture());
    thread_local struct {
      std::uint64_t owner = 0;
      std::optional<Program> program;
    } cache;
    if (cache.owner != this->id()) {
      cache.owner = 0;  // stays invalid if capturing throws
      cache.program.emplace(capture());
      cache.owner = this->id();
      if (!cache.program->ambiguity.empty()) {
        duet::detail::log_ambiguous_capture(this->type_name() + "::construct", cache.program->ambiguity,
                                                     "as a traced graph (PIJit)");
      }
    }
    return *cache.program;
  }

  // Graph mode when capture cannot make the graph (graph::Sym::ambiguity): construct
  // traced on tensors (PIJit) on the first call for each input shape, and replayed after. The
  // trace knows each value at run time, which the captured graph's types cannot.
  template <class... Ts>
  auto& traced_form() {
    using R = BasicTensor<typename decltype(run_construct(std::declval<const BasicTensor<Ts>&>()...))::value_type>;
    using Form = JitFunction<jit_config, duet::detail::ErasedCall<R, BasicTensor<Ts>...>>;
    return this->forms_.template get<Form>([this] {
      return Form({this, [](void* self, const BasicTensor<Ts>&... xs) {
                     return R(static_cast<Cell*>(self)->run_construct(xs...));
                   }},
                  {.mode = JitMode::PIJit, .name = this->type_name() + "::construct, traced"});
    });
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

// A layer whose sizes are template arguments (nn::Conv2d<1, 6, 5>, nn::BatchNorm2d<16>), as its
// run-time sized form Runtime (nn::Conv2d<>, nn::BatchNorm2d<>) with those sizes in its type.
// Captured into a graph it appends what Layer::sized_construct makes, an operation whose
// static shape rule checks the network while the program compiles; everywhere else (PyNative
// mode, a call alone in graph mode) it is Runtime. So a network's layers of one kind share one
// cell's code whatever their sizes: the PyNative operations with their gradients and traces,
// the cell's own graph forms. As a cell type each, examples/resnet_fashion.cpp's 7 sizes of
// convolution took a fifth of its compile time.
template <class Layer, class Runtime>
class SizedLayer : public Runtime {
  using T = typename Runtime::value_type;

 public:
  using Runtime::Runtime;

  BasicTensor<T> operator()(const BasicTensor<T>& x) { return Runtime::operator()(x); }

  // Captured on an input of its own and spliced after x's graph, as Cell's calls are.
  template <graph::Symbolic S>
  auto operator()(const S& x) {
    this->check_capture();
    return graph::spliced(x, static_cast<Layer*>(this)->sized_construct(graph::continuation<S>()));
  }

  // A static shape is checked against the sizes in the type while the program compiles.
  template <index_t... D>
  auto operator()(const StaticTensor<T, D...>& x) {
    using Captured = decltype(std::declval<Layer&>().sized_construct(graph::input<T, StaticShape<D...>>()));
    return Runtime::template to_static_tensor<Captured>(Runtime::operator()(x.tensor()));
  }
};

namespace detail {
// An operation's layer as its run-time sized form (SizedLayer), whose functions the operation's
// kernels and descriptions call, so that they are compiled once for all sizes; any other layer
// (ONNX import's description of a node, say) as itself.
template <class Layer>
auto* runtime_form(Layer* layer) {
  if constexpr (requires { typename std::remove_const_t<Layer>::runtime_type; }) {
    using R = typename std::remove_const_t<Layer>::runtime_type;
    return static_cast<std::conditional_t<std::is_const_v<Layer>, const R, R>*>(layer);
  } else {
    return layer;
  }
}

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
struct FillLikeOp : Primitive<FillLikeOp<V>> {
  static constexpr int arity = 1;
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }
  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::fill(a.out<T>(), a.output_shape.numel(), T(V));
  }
  static std::string op_name() { return V == 1 ? "OnesLike" : "ZerosLike"; }
};

// Copies a value out of the graph into *destination (an input's gradient, for the caller).
template <class T>
struct StoreOp : Primitive<StoreOp<T>> {
  static constexpr int arity = 1;
  static constexpr bool is_sink = true;
  BasicTensor<T>* destination;
  StoreOp(BasicTensor<T>* d) : destination(d) {}
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }
  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    *destination = BasicTensor<T>::uninitialized(a.in_shape());
    std::copy_n(a.in<T>(), a.in_shape().numel(), destination->data());
  }
  static std::string op_name() { return "Store"; }
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
      if constexpr (DifferentiableOperation<Op>) {
        any = has_parameters<Op>();
        [&]<std::size_t... K>(std::index_sequence<K...>) {
          ((any = any || (input_has_gradient<Op, K>() && leads[N::args[K]])), ...);
        }(std::make_index_sequence<N::arity>{});
      } else {
        for (std::size_t a : N::args) any = any || leads[a];
      }
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
  else
    return N::args[static_cast<std::size_t>(O) - 1];
}

// How a gradient node's operation is made from the forward graph (graph::Step's recipe):
// forward node I's gradient op for its input K, or its parameters' gradient op.
template <std::size_t I, std::size_t K>
struct InputGrad {
  template <class G>
  static auto make(const G& g) {
    return graph::get<I>(g).op.template grad_op<K>();
  }
};
template <std::size_t I>
struct ParameterGrad {
  template <class G>
  static auto make(const G& g) {
    return graph::get<I>(g).op.parameter_grad_op();
  }
};

// The node of gradient op Op around forward node I (of type N; its gradient in node Grad).
template <class Op, class N, std::size_t I, std::size_t Grad, std::size_t... J>
auto grad_node(std::index_sequence<J...>) -> graph::Node<Op, operand_index<Op::reads[J], N, I, Grad>()...>;

// Built with the step of Recipe's op appended, reading what the op declares around forward
// node I of G (its gradient in node Grad).
template <class G, std::size_t I, std::size_t Grad, class Recipe, class Built>
struct with_grad_step {
  using Op = decltype(Recipe::make(std::declval<const G&>()));
  using node = decltype(grad_node<Op, graph::node_at<G, I>, I, Grad>(std::make_index_sequence<Op::reads.size()>{}));
  using type = typename graph::appended<Built, graph::Step<node, Recipe>>::type;
};

// The gradients of forward node I's inputs K, K+1, ...: each input that leads to something
// differentiated gets its gradient op, summed with what it already has. Types only (the plan
// build_backward makes the list from): the steps built, and the new Grads.
template <std::size_t K, std::size_t I, auto Grads, auto Leads, class G, class Built>
auto backward_inputs() {
  using N = graph::node_at<G, I>;
  using Op = typename N::op_type;
  if constexpr (K == N::arity) {
    return std::pair<std::type_identity<Built>, value_tag<Grads>>{};
  } else if constexpr (!input_has_gradient<Op, K>() || !Leads[N::args[K]]) {
    return backward_inputs<K + 1, I, Grads, Leads, G, Built>();
  } else {
    constexpr std::size_t a = N::args[K];
    constexpr std::size_t k = Built::size;
    using WithGrad = typename with_grad_step<G, I, Grads[I], InputGrad<I, K>, Built>::type;
    if constexpr (Grads[a] == no_grad) {
      return backward_inputs<K + 1, I, with(Grads, a, k), Leads, G, WithGrad>();
    } else {
      using Sum = graph::Node<ops::GradAddOp, Grads[a], k>;
      using Summed = typename graph::appended<WithGrad, graph::Step<Sum, graph::Made<ops::GradAddOp>>>::type;
      return backward_inputs<K + 1, I, with(Grads, a, k + 1), Leads, G, Summed>();
    }
  }
}

// Whether input K of node I is an edge whose gradient a NoGradient declaration loses
// (operation.hpp, loses_gradient).
template <class G, std::size_t I, std::size_t K>
constexpr bool loses_gradient_at() {
  using N = graph::node_at<G, I>;
  if constexpr (input_has_gradient<typename N::op_type, K>()) return false;
  else return loses_gradient<graph::node_value_t<G, N::args[K]>, graph::node_value_t<G, I>>;
}

// Throws if a node the output's gradient reaches has an input without a gradient whose value
// depends on what is differentiated: the tape's refusal (OpEntry::input_backward), at run
// time, because grad_position is a run-time index and every position's backward graph is
// compiled. Leads, extended through such inputs, says what depends on what is differentiated.
template <auto Leads, std::size_t Out, class G>
void refuse_lost_gradients(const G& g) {
  static constexpr auto found = [] {
    std::array<bool, G::size> depends = Leads;
    bool any_lost = false;
    graph::for_each_index<G::size>([&](auto i) {
      constexpr std::size_t I = decltype(i)::value;
      using N = graph::node_at<G, I>;
      if constexpr (!graph::is_input_op_v<typename N::op_type> && DifferentiableOperation<typename N::op_type>) {
        [&]<std::size_t... K>(std::index_sequence<K...>) {
          const bool lost = ((loses_gradient_at<G, I, K>() && depends[N::args[K]]) || ...);
          depends[I] = depends[I] || lost;
          any_lost = any_lost || lost;
        }(std::make_index_sequence<N::arity>{});
      }
    });
    return std::pair{depends, any_lost};
  }();
  if constexpr (found.second) {
    // Which nodes the output's gradient reaches: consumers come after producers.
    std::array<bool, G::size> reached{};
    reached[Out] = true;
    graph::for_each_index<G::size>([&](auto r) {
      constexpr std::size_t I = G::size - 1 - decltype(r)::value;
      using N = graph::node_at<G, I>;
      using Op = typename N::op_type;
      if constexpr (!graph::is_input_op_v<Op> && DifferentiableOperation<Op>) {
        if (!reached[I]) return;
        [&]<std::size_t... K>(std::index_sequence<K...>) {
          const auto visit = [&](auto k) {
            constexpr std::size_t k_ = decltype(k)::value;
            if constexpr (input_has_gradient<Op, k_>()) {
              reached[N::args[k_]] = true;
            } else if constexpr (loses_gradient_at<G, I, k_>()) {
              if (found.first[N::args[k_]])
                throw ValueError(lost_gradient_message(graph::get<I>(g).op.label(), k_));
            }
          };
          (visit(std::integral_constant<std::size_t, K>{}), ...);
        }(std::make_index_sequence<N::arity>{});
      }
    });
  }
}

// Walks forward nodes I-1, I-2, ..., 0. Grads[i] is the node holding d(output)/d(value i).
// Capture lays nodes out in depth-first post-order from the output (graph::detail::merge_from),
// so this is the order the tape walks its records in (Tape::backward_order): a value's
// gradients add up in the same order in both modes, the sum so far on the left, and its
// producer runs backward once, on the sum. Types only, as backward_inputs.
template <std::size_t I, auto Grads, auto Leads, class G, class Built>
auto backward_from() {
  if constexpr (I == 0) {
    return std::pair<std::type_identity<Built>, value_tag<Grads>>{};
  } else {
    constexpr std::size_t i = I - 1;
    using N = graph::node_at<G, i>;
    using Op = typename N::op_type;
    if constexpr (Grads[i] == no_grad || graph::is_input_op_v<Op>) {
      return backward_from<i, Grads, Leads, G, Built>();
    } else if constexpr (!DifferentiableOperation<Op>) {
      // An operation that gives some inputs' gradients is reported by the contract's check.
      if constexpr (!diagnostic::check_operation<Op>::partial)
        static_cast<void>(sizeof(diagnostic::require_differentiable<typename Op::layer_type>));
      return backward_from<i, Grads, Leads, G, Built>();
    } else {
      // An op with parameters writes their gradients from input 0's gradient op, or from its
      // own parameter_grad_op when input 0 needs none.
      constexpr bool via_input0 = N::arity >= 1 && input_has_gradient<Op, 0>() && Leads[N::args[0]];
      using WithParameters = typename std::conditional_t<has_parameters<Op>() && !via_input0,
                                                         with_grad_step<G, i, Grads[i], ParameterGrad<i>, Built>,
                                                         std::type_identity<Built>>::type;
      using Inputs = decltype(backward_inputs<0, i, Grads, Leads, G, WithParameters>());
      return backward_from<i, Inputs::second_type::value, Leads, G, typename Inputs::first_type::type>();
    }
  }
}

// The steps a training graph's plan begins with: the forward nodes as they are, then the seed
// d(output)/d(output) = 1.
template <class G, std::size_t Out, std::size_t... J>
auto backward_start(std::index_sequence<J...>)
    -> graph::NodeList<graph::Step<graph::node_at<G, J>, graph::Take<J>>...,
                       graph::Step<graph::Node<ops::FillLikeOp<1>, Out>, graph::Made<ops::FillLikeOp<1>>>>;

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
    auto g = graph::with_node(program.graph, graph::Node<graph::InputOp<K, graph::AnyShape, T>>{});
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
  using Start = decltype(detail::backward_start<G, Out>(std::make_index_sequence<G::size>{}));
  using Plan = decltype(detail::backward_from<G::size, detail::with(none, Out, G::size), leads, G, Start>());
  using Built = typename Plan::first_type::type;
  static constexpr auto grads = Plan::second_type::value;
  detail::refuse_lost_gradients<leads, Out>(forward.graph);
  constexpr std::size_t zeros_at = Built::size;
  [[maybe_unused]] static constexpr auto sources =
      detail::store_sources<grads, zeros_at, detail::input_node<G, Wrt>()...>();
  const std::tuple<BasicTensor<T>*...> destinations{input_grads...};
  // An input the output does not depend on has a zero gradient, as in MindSpore.
  auto training = [&]<std::size_t... J>(std::index_sequence<J...>) {
    return graph::from_plan<graph::Graph>(
        forward.graph, static_cast<Built*>(nullptr), graph::Node<ops::FillLikeOp<0>, detail::input_node<G, Wrt>()>{}...,
        graph::Node<ops::StoreOp<std::tuple_element_t<J, std::tuple<T...>>>, sources[J]>{std::get<J>(destinations)}...);
  }(std::index_sequence_for<T...>{});
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

// After a backward pass for `weights`, two mistakes that would otherwise train nothing, quietly:
// a pass that reached none of them (all their gradients zero: they are another network's, an
// optimiser made over net1.parameters() training net2), and, asked of `network` (a pointer to
// a cell, or nullptr), a parameter that got a gradient but is neither one of `weights` nor a parameter of
// the network (read in construct but missing from DUET_CELL_MEMBERS: neither trained nor saved).
template <class W, class Network>
void check_weights_reached(const std::vector<nn::BasicParameter<W>*>& weights, Network network,
                           const std::string& who) {
  const std::uint64_t pass = duet::detail::current_backward_pass();
  const auto trainable = std::ranges::count_if(weights, [](const auto* p) { return p->requires_grad; });
  if (trainable > 0 && std::ranges::none_of(weights, [&](const auto* p) { return p->has_grad_from(pass); })) {
    throw ValueError(who + ": the function reads none of the " + std::to_string(trainable) +
                     " trainable parameters it is differentiated with respect to, so every gradient would be zero and "
                     "training would do nothing; are they another network's (an optimizer made over "
                     "net1.parameters() training net2)?");
  }
  if constexpr (!std::is_same_v<Network, std::nullptr_t>) {
    const auto registered = network->parameters();
    for (const void* written : duet::detail::written_in_pass()) {
      const auto is = [&](const auto* p) { return static_cast<const void*>(p) == written; };
      if (std::ranges::any_of(weights, is) ||
          std::ranges::any_of(registered, [&](const auto& named) { return is(named.parameter); })) {
        continue;
      }
      const auto* p = static_cast<const nn::BasicParameter<W>*>(written);
      throw ValueError(who + ": a parameter of shape " + to_string(p->shape()) + " gets a gradient but is not a "
                       "parameter of " + network->type_name() + " (a construct reads it, but the cell that holds it "
                       "does not list it in DUET_CELL_MEMBERS(...)), so it would be neither trained nor saved");
    }
  }
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
      check_weights_reached();
      const std::uint64_t pass = duet::detail::current_backward_pass();
      for (nn::BasicParameter<W>* p : weights_) {
        out.grads.push_back(p->has_grad_from(pass) ? p->grad.clone() : zeros<W>(p->shape()));
      }
    }
    return out;
  }

  // The checks of autodiff::detail::check_weights_reached, of the last call's backward pass
  // (the registration check on the first call only: it is the network's structure).
  void check_weights_reached() {
    if constexpr (autodiff::detail::CellLike<Fn>) {
      if (!weights_checked_) {
        weights_checked_ = true;
        autodiff::detail::check_weights_reached(weights_, &fn_, "duet::value_and_grad");
        return;
      }
    }
    autodiff::detail::check_weights_reached(weights_, nullptr, "duet::value_and_grad");
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

  // One step: what its forward pass changes (BatchNorm's moving statistics, Dropout's
  // generator) stays only if forward and backward both succeed.
  template <bool WithInput, class V, class... X>
  BasicTensor<V> forward_backward(BasicTensor<V>& input_grad, const X&... xs) {
    if constexpr (autodiff::detail::CellLike<Fn>) {
      if (!phase_checked_) {
        fn_.ensure_named();
        fn_.warn_if_phase_unchosen(std::cerr);
        phase_checked_ = true;
      }
    }
    duet::detail::StepScope step;
    BasicTensor<V> value = forward_backward_in_mode<WithInput>(input_grad, xs...);
    step.commit();
    return value;
  }

  template <bool WithInput, class V, class... X>
  BasicTensor<V> forward_backward_in_mode(BasicTensor<V>& input_grad, const X&... xs) {
    if constexpr (graph::Capturable<FnRef&, X...>) {
      if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE) return run_graph<WithInput>(input_grad, xs...);
    } else if constexpr (!WithInput && autodiff::detail::CellLike<Fn>) {
      if (autodiff::detail::mode_of<Fn>() == GRAPH_MODE && can_trace()) return traced_step(xs...);
    }
    return run_eager<WithInput>(input_grad, xs...);
  }

  static bool can_trace() { return autodiff::active_tape() == nullptr && pijit::active_trace() == nullptr; }

  // Graph mode for a cell built at run time (it has no construct to capture), or whose capture
  // is ambiguous (graph::Sym::ambiguity): the whole step, forward, loss and backward,
  // is traced on the first call for each input signature and structure, and replayed after
  // (PIJit, default JitConfig). Parameters' gradients are written by the replay's gradient
  // steps, as the tape's backward writes them. Its first argument is the structure generation:
  // a network changed since the trace is traced again.
  template <class... X>
  auto traced_step(const X&... xs) {
    using R = BasicTensor<value_t<X...>>;
    using Step =
        JitFunction<JitConfig{}, duet::detail::ErasedCall<R, std::uint64_t, BasicTensor<typename X::value_type>...>>;
    return forms_.template get<Step>([this] {
      return Step({this,
                   [](void* self, const std::uint64_t&, const BasicTensor<typename X::value_type>&... x) {
                     if (pijit::Trace* trace = pijit::active_trace()) trace->allow_parameter_gradients();
                     R no_input_grad;
                     return static_cast<GradFunction*>(self)->template run_eager<false>(no_input_grad, x...);
                   }},
                  {.mode = JitMode::PIJit,
                   .name = fn_.label() + " forward and backward in graph mode (argument 0: the network's structure)"});
    })(nn::detail::structure_generation().load(std::memory_order_acquire), tensor_of(xs)...);
  }

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
      fn_.ensure_named();  // an ambiguous capture names its layers
    }
    const auto capture = [&](auto phase) {
      return pipeline::compile<JitConfig{}, true,
                               pipeline::Input<typename X::value_type,
                                               graph::pattern_in_phase<decltype(phase)::value,
                                                                       typename graph::pattern_of<X>::type>>...>(
          [&](const auto&... in) { return fn_(in...); });
    };
    return pipeline::in_requested_phase(capture, [&](const auto& forward) -> BasicTensor<V> {
      if (!forward.ambiguity.empty()) {
        if constexpr (!WithInput && autodiff::detail::CellLike<Fn>) {
          if (can_trace()) {
            duet::detail::log_ambiguous_capture(where()(), forward.ambiguity,
                                                          "forward and backward as a traced graph (PIJit)");
            return traced_step(xs...);
          }
        }
        duet::detail::log_ambiguous_capture(where()(), forward.ambiguity,
                                                          "forward and backward in PyNative mode");
        return run_eager<WithInput>(input_grad, xs...);
      }
      duet::detail::begin_backward_pass();
      if constexpr (WithInput) {
        return autodiff::detail::at_position<sizeof...(X)>(*grad_position_, [&](auto k) {
          if constexpr (differentiable_input<V, decltype(k)::value, X...>()) {
            auto training = autodiff::build_backward<decltype(k)::value>(forward, &input_grad);
            return BasicTensor<V>(pipeline::execute<JitConfig{}>(id_, training, where(), tensor_of(xs)...));
          } else {
            return BasicTensor<V>();
          }
        });
      } else {
        auto training = autodiff::build_backward<>(forward);
        return BasicTensor<V>(pipeline::execute<JitConfig{}>(id_, training, where(), tensor_of(xs)...));
      }
    });
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
  duet::detail::OwnForms forms_;  // traced_step's
  bool phase_checked_ = false;  // the first call warns of layers nobody set_train-ed
  bool weights_checked_ = false;
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

// MindSpore's grad: the gradients alone. grad(fn) and grad(fn, k) give the gradient of input 0
// or k; with weights, the list of gradients.
template <class Fn, class... Weights>
auto grad(Fn&& fn, Weights&&... weights_and_position) {
  auto vg = value_and_grad(std::forward<Fn>(fn), std::forward<Weights>(weights_and_position)...);
  return [vg = std::move(vg)](const auto&... xs) mutable {
    auto out = vg(xs...);
    if constexpr (sizeof...(Weights) == 0 || (std::is_integral_v<std::remove_cvref_t<Weights>> && ...))
      return std::move(out.grads.front());
    else
      return std::move(out.grads);
  };
}

}  // namespace duet
// duet::compare_modes: where PyNative and graph mode disagree on one network, and
// duet::runs_in_both_modes: whether a network captures as a static graph at all.
//
// Both modes run the same kernels, so they agree bit for bit (README, Guarantees); when they
// do not (a user's operation whose fused graph form computes something else, BatchNorm folded
// at evaluation), the output alone does not say where. compare_modes runs the network once
// in each mode on the same weights and inputs and reads every intermediate value of both:
// PyNative's from a trace that keeps them (pijit::Trace::keep_values), graph mode's from the
// evaluator as each node runs (run_observed). It walks graph mode's nodes in the order they
// run and pairs each with the PyNative operations it stands for: a fused node
// ("MatMul + BiasAdd + ReLU") with that run of operations, whose last makes its value.

#include <array>
#include <cmath>
#include <cstddef>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// Wrappers that turn a network into something to train (MindSpore's nn.WithLossCell and
// nn.TrainOneStepCell).

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

// Gradient clipping by global norm (MindSpore's ops.clip_by_global_norm).
//
// It works on gradients once backward has made them, outside the graph, so it is the same code
// in both modes: on the list value_and_grad returns (clip, then call the optimiser with it), or
// inside nn::TrainOneStepCell ({.clip_global_norm = 1.0}), which clips the gradients backward
// left in the parameters before the optimiser reads them.

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>


namespace duet::ops {

namespace detail {

inline void check_clip_norm(double clip_norm) {
  if (!(clip_norm > 0) || !std::isfinite(clip_norm)) {
    throw ValueError("ops::clip_by_global_norm: clip_norm must be positive and finite, got " +
                     std::to_string(clip_norm));
  }
}

// sqrt(Σ over every tensor of Σ x²), accumulated in double: float gradients of a large model
// would lose the small ones' squares in a float sum. Tensors is a range of tensor pointers.
template <class Tensors>
double global_norm_of(const Tensors& tensors) {
  double sum = 0;
  for (const auto* t : tensors) {
    for (auto v : t->values()) sum += static_cast<double>(v) * static_cast<double>(v);
  }
  return std::sqrt(sum);
}

// Scales each tensor in place by clip_norm / max(norm, clip_norm); those whose norm is within
// clip_norm are left bit for bit as they are. Returns the norm before clipping.
template <class Tensors>
double clip_in_place(const Tensors& tensors, double clip_norm) {
  check_clip_norm(clip_norm);
  const double norm = global_norm_of(tensors);
  if (norm > clip_norm || !std::isfinite(norm)) {
    const double factor = clip_norm / norm;
    for (auto* t : tensors) {
      using T = std::remove_cvref_t<decltype(t->values()[0])>;
      for (auto& v : t->values()) v = static_cast<T>(v * factor);
    }
  }
  return norm;
}

}  // namespace detail

// The global norm of a list of tensors: the norm of all their elements taken together.
template <ElementType T>
double global_norm(const std::vector<BasicTensor<T>>& x) {
  std::vector<const BasicTensor<T>*> all;
  for (const auto& t : x) all.push_back(&t);
  return detail::global_norm_of(all);
}

// MindSpore's ops.clip_by_global_norm(x, clip_norm=1.0, use_norm=None): each tensor times
// clip_norm / max(global_norm(x), clip_norm), so that the clipped list's global norm is at most
// clip_norm. New tensors; x is not changed. A NaN or infinite norm goes through the same formula,
// as in MindSpore.
template <ElementType T>
std::vector<BasicTensor<T>> clip_by_global_norm(const std::vector<BasicTensor<T>>& x, double clip_norm = 1.0) {
  std::vector<BasicTensor<T>> out;
  std::vector<BasicTensor<T>*> all;
  out.reserve(x.size());
  for (const auto& t : x) all.push_back(&out.emplace_back(t.clone()));
  detail::clip_in_place(all, clip_norm);
  return out;
}

}  // namespace duet::ops
// Data parallelism's settings (MindSpore's set_auto_parallel_context) and the interface through
// which a training step, an optimiser and an evaluation reach the runtime that
// duet/distributed.hpp provides. This header needs no MPI: a program that never includes
// distributed.hpp has no runtime, and asking for DATA_PARALLEL without one is an error.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>


namespace duet {

// MindSpore's ParallelMode: STAND_ALONE (one process) and DATA_PARALLEL (every rank holds the
// whole network and a shard of each batch). The other MindSpore modes split the network itself.
enum class ParallelMode : unsigned char { STAND_ALONE, DATA_PARALLEL };

// Fields left empty keep their current value, as ContextConfig's do.
struct AutoParallelConfig {
  std::optional<ParallelMode> parallel_mode = std::nullopt;
  // true: the update uses the mean of the ranks' gradients (weighted by their samples, so it is
  // the gradient of the global batch's mean loss); false: their sum (MindSpore's default).
  std::optional<bool> gradients_mean = std::nullopt;
};

struct AutoParallelContext {
  ParallelMode parallel_mode = ParallelMode::STAND_ALONE;
  bool gradients_mean = false;
};

namespace detail {
inline std::atomic<ParallelMode>& parallel_mode() {
  static std::atomic<ParallelMode> mode{ParallelMode::STAND_ALONE};
  return mode;
}
inline std::atomic<bool>& gradients_mean() {
  static std::atomic<bool> mean{false};
  return mean;
}
}  // namespace detail

inline void set_auto_parallel_context(const AutoParallelConfig& config) {
  if (config.parallel_mode) {
    if (*config.parallel_mode != ParallelMode::STAND_ALONE && *config.parallel_mode != ParallelMode::DATA_PARALLEL) {
      throw ValueError("duet::set_auto_parallel_context: parallel_mode must be STAND_ALONE or DATA_PARALLEL");
    }
    detail::parallel_mode().store(*config.parallel_mode, std::memory_order_relaxed);
  }
  if (config.gradients_mean) detail::gradients_mean().store(*config.gradients_mean, std::memory_order_relaxed);
}

inline AutoParallelContext get_auto_parallel_context() {
  return {detail::parallel_mode().load(std::memory_order_relaxed),
          detail::gradients_mean().load(std::memory_order_relaxed)};
}

namespace detail {

// 64-bit FNV-1a, continuing from h: what ranks compare in one collective (their networks'
// descriptions, their first batches) is hashed first.
inline std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h = 14695981039346656037ull) {
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// A tensor's values as bytes, for fnv1a.
template <class E>
std::string_view tensor_bytes(const BasicTensor<E>& t) {
  return {reinterpret_cast<const char*>(t.data()), static_cast<std::size_t>(t.numel()) * sizeof(E)};
}

// A gradient a rank contributes to an all-reduce.
struct GradientView {
  const float* data = nullptr;  // nullptr: none this step
  index_t size = 0;
};

// What duet/distributed.hpp implements over MPI. Every call is collective: all ranks make it,
// in the same order, or it fails with a duet::Error after the runtime's timeout.
class DataParallelRuntime {
 public:
  DataParallelRuntime() = default;
  DataParallelRuntime(const DataParallelRuntime&) = delete;
  DataParallelRuntime& operator=(const DataParallelRuntime&) = delete;
  virtual ~DataParallelRuntime() = default;

  virtual int rank() const = 0;
  virtual int group_size() const = 0;
  // Checks that every rank has parameters of the same names and shapes (ValueError naming the
  // first difference otherwise), then gives every rank rank 0's values.
  virtual void broadcast_parameters(const std::vector<nn::NamedParameter<float>>& params) = 0;
  // One step's reduction. `values` are summed over the ranks first, in one collective;
  // values[0] is this rank's weight. Then each gradient (data nullptr: this rank has none,
  // counted as zeros) times the weight, divided by the summed weight when `mean` (zeros when
  // that is 0), is summed over the ranks, in collectives started in reverse order (backward's),
  // into write(i), for each gradient i that some rank has.
  virtual void all_reduce_gradients(std::span<const GradientView> grads, std::span<double> values, bool mean,
                                    const std::function<float*(std::size_t)>& write) = 0;
  // Whether `hash` is the same on every rank.
  virtual bool same_on_every_rank(std::uint64_t hash) = 0;
  // Nonblocking sums over the ranks, in place, each a collective of its own that every rank
  // starts in the same order (OverlappedReduction's). test_sums moves the started ones on
  // without waiting; wait_sums waits for all of them, within the timeout.
  virtual void start_sum(float* data, index_t n) = 0;
  virtual void start_sum(std::span<double> values) = 0;
  virtual void test_sums() = 0;
  virtual void wait_sums(std::string_view what) = 0;
  // Whether training steps sum their gradients while backward runs (OverlappedReduction), and
  // in buffers of about how many bytes.
  virtual bool overlaps_backward() const = 0;
  virtual std::size_t bucket_bytes() const = 0;
  // Each value becomes its sum over the ranks.
  virtual void all_reduce_sum(std::span<double> values) = 0;
};

// Where the ranks' params first differ, if they do ("'fc1.weight'", or their names and shapes):
// every rank gets the same answer, in two collectives when none differs (names and shapes,
// then values), one more per parameter up to the first that does otherwise.
template <class T>
std::optional<std::string> first_difference_between_ranks(DataParallelRuntime& runtime,
                                                          const std::vector<nn::NamedParameter<T>>& params) {
  std::string names;
  for (const auto& p : params) names += p.name + to_string(p.parameter->shape()) + "\n";
  if (!runtime.same_on_every_rank(fnv1a(names))) return "the parameters' names or shapes";
  std::uint64_t hash = fnv1a({});
  for (const auto& p : params) hash = fnv1a(tensor_bytes<T>(*p.parameter), hash);
  if (runtime.same_on_every_rank(hash)) return std::nullopt;
  for (const auto& p : params) {
    if (!runtime.same_on_every_rank(fnv1a(tensor_bytes<T>(*p.parameter)))) return "'" + p.name + "'";
  }
  return std::nullopt;  // unreachable: the whole hash differed, so one part does
}

// Set by duet::distributed::init().
inline std::atomic<DataParallelRuntime*>& data_parallel_runtime() {
  static std::atomic<DataParallelRuntime*> runtime{nullptr};
  return runtime;
}

// The backward pass whose gradients the runtime last all-reduced on this thread: an optimiser
// step in DATA_PARALLEL over any other pass would update each rank differently.
inline std::uint64_t& all_reduced_backward_pass() {
  thread_local std::uint64_t pass = 0;
  return pass;
}

// The gradients distributed::GradReducer last returned on this thread, and the backward pass
// then current: optimizer(grads) accepts them in DATA_PARALLEL until the next backward pass.
struct ReducedGradients {
  std::uint64_t pass = 0;
  std::vector<const float*> data;
};
inline ReducedGradients& all_reduced_gradient_set() {
  thread_local ReducedGradients set;
  return set;
}

// What a rank's batch weighs in the global batch's loss (DATA_PARALLEL).
struct BatchShare {
  // Reduction::sum: the ranks' losses and gradients add up, as the one batch's would.
  bool summed = false;
  // Otherwise: the rows the loss averaged (those not ignored); each rank's loss and gradient
  // count in proportion to them.
  double counted_rows = 0;
  // The batch's rows, by which the ranks' moving statistics are averaged.
  double rows = 0;
};

// The label a loss leaves out (nn::CrossEntropyLoss's and nn::NLLLoss's ignore_index), if any.
template <class Loss>
std::optional<std::int32_t> ignored_label(const Loss& loss) {
  if constexpr (requires { loss.options().ignore_index; }) return loss.options().ignore_index;
  else return std::nullopt;
}

// The share of `loss` (a loss cell) over a batch of `rows` with these labels. Losses state
// their reduction (a static member `reduction`); one that does not, such as a cell of the
// user's own, is taken to average the batch's rows.
template <class Loss, class Labels>
BatchShare batch_share(const Loss& loss, const Labels& labels, index_t rows, std::string_view who) {
  BatchShare share{.summed = false, .counted_rows = static_cast<double>(rows), .rows = static_cast<double>(rows)};
  if constexpr (requires { Loss::reduction; }) {
    if (Loss::reduction == Reduction::none) {
      throw ModeError(std::string(who) + ": " + loss.label() +
                      " has Reduction::none; combining batches (or the ranks' shares of one) needs a loss reduced "
                      "to one number (Reduction::mean or Reduction::sum)");
    }
    share.summed = Loss::reduction == Reduction::sum;
  }
  if constexpr (std::same_as<Labels, BasicTensor<std::int32_t>>) {
    if (const std::optional<std::int32_t> ignored = ignored_label(loss)) {
      share.counted_rows = static_cast<double>(std::ranges::count_if(labels.values(), [&](std::int32_t l) { return l != *ignored; }));
    }
  }
  return share;
}

// The reduction a data-parallel step makes, shared by nn::TrainOneStepCell and
// distributed::GradReducer: gradients (see DataParallelRuntime::all_reduce_gradients), `loss`
// (each element becomes the global batch's: the ranks' sum, or their mean weighted by counted
// rows), and `buffers`, the parameters nothing trains (BatchNorm's moving statistics), which
// become their mean over the ranks weighted by rows. Parameters equal on every rank, such as
// frozen weights, stay exactly as they are: the sums are in double, where n * x is exact.
// With gradients_mean the gradients are the global batch's; without, their sum over the ranks
// (MindSpore's default).
// [gradient weight, loss weight, rows, weighted losses..., weighted buffers...]: what a step's
// ranks sum besides the gradients (all_reduce_step).
inline std::vector<double> step_values(std::span<const float> loss, const std::vector<nn::Parameter*>& buffers,
                                       const BatchShare& share, bool weighted) {
  const double loss_weight = share.summed ? 1.0 : share.counted_rows;
  std::vector<double> values{weighted ? share.counted_rows : 1.0, loss_weight, share.rows};
  for (const float l : loss) values.push_back(static_cast<double>(l) * loss_weight);
  for (const nn::Parameter* b : buffers) {
    for (const float v : b->values()) values.push_back(static_cast<double>(v) * share.rows);
  }
  return values;
}

// The losses and buffers from step_values summed over the ranks.
inline void apply_step_values(std::span<const double> values, std::span<float> loss,
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

inline void all_reduce_step(DataParallelRuntime& runtime, std::span<const GradientView> grads,
                            const std::function<float*(std::size_t)>& write, std::span<float> loss,
                            const std::vector<nn::Parameter*>& buffers, const BatchShare& share, bool gradients_mean) {
  const bool weighted = gradients_mean && !share.summed;
  std::vector<double> values = step_values(loss, buffers, share, weighted);
  runtime.all_reduce_gradients(grads, values, weighted, write);
  apply_step_values(values, loss, buffers, share);
}

// Counts each parameter's gradient writes in a backward pass: what OverlappedReduction needs
// to know when a gradient is final. index maps a parameter to its place in the optimiser's list.
class GradientWriteCounter final : public GradientObserver {
 public:
  GradientWriteCounter(const std::unordered_map<const void*, std::size_t>& index, std::vector<int>& writes)
      : index_(index), writes_(writes) {
    writes_.assign(index_.size(), 0);
  }
  void will_write(const void* parameter) override {
    if (const auto it = index_.find(parameter); it != index_.end()) ++writes_[it->second];
  }
  void writes_done() override {}

 private:
  const std::unordered_map<const void*, std::size_t>& index_;
  std::vector<int>& writes_;
};

// Sets the calling thread's gradient observer for its lifetime.
class GradientObserverScope {
 public:
  explicit GradientObserverScope(GradientObserver* observer) : saved_(gradient_observer()) {
    gradient_observer() = observer;
  }
  GradientObserverScope(const GradientObserverScope&) = delete;
  GradientObserverScope& operator=(const GradientObserverScope&) = delete;
  ~GradientObserverScope() { gradient_observer() = saved_; }

 private:
  GradientObserver* saved_;
};

// One data-parallel step's reduction, its gradients summed while backward still runs (the
// issue's overlap, PyTorch DDP's buckets): all_reduce_step's result, bit for bit where the
// shares are powers of two. The optimiser's parameters are planned once, in reverse order
// (backward's), into units: each gradient of 64 KB or more alone, summed in place in the
// parameter's gradient; runs of smaller ones packed into buckets of the runtime's size. Every
// rank starts the units in that order, each once all its gradients are final: a gradient is
// final when an op that wrote it has ended (gradient_writes_done) and it has been written as
// many times as in the step that recorded the counts (GradientWriteCounter, the first). The
// weights' sum comes first, started before backward: it gives each rank its share of the mean.
// Losses, moving statistics and which gradients each rank wrote follow backward, in a small
// sum of their own; a gradient no rank wrote stays unwritten, as all_reduce_step leaves it.
class OverlappedReduction final : public GradientObserver {
 public:
  struct Unit {
    std::size_t first = 0;  // positions [first, last) in backward order
    std::size_t last = 0;
    bool in_place = false;
    index_t elements = 0;
  };

  // Units of parameters of these sizes, in backward order (the last parameter first).
  static std::vector<Unit> plan(const std::vector<index_t>& sizes, std::size_t bucket_bytes) {
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

  // writes: each parameter's gradient writes in the recorded step; buffers and weights: the
  // sums' storage, kept by the caller between steps (a step that throws leaves its sums to the
  // runtime, which may still write them). `weight` is this rank's weight in the mean
  // (BatchShare).
  OverlappedReduction(DataParallelRuntime& runtime, const std::vector<nn::BasicParameter<float>*>& params,
                      const std::unordered_map<const void*, std::size_t>& index, const std::vector<int>& writes,
                      const std::vector<Unit>& units, std::vector<std::vector<float>>& buffers,
                      std::vector<double>& weights, double weight, bool mean)
      : runtime_(runtime), params_(params), index_(index), writes_(writes), units_(units), buffers_(buffers),
        weights_(weights), mean_(mean), weight_(weight), count_(params.size(), 0), final_(params.size(), false),
        sent_(params.size(), false) {
    buffers_.resize(units_.size());
    weights_.assign(1, weight);
    runtime_.start_sum(std::span<double>(weights_));
  }

  void will_write(const void* parameter) override {
    const auto it = index_.find(parameter);
    if (it == index_.end()) return;
    const std::size_t i = it->second;
    if (sent_[i]) {
      throw ModeError("nn::TrainOneStepCell (DATA_PARALLEL): backward wrote the gradient of parameter " +
                      std::to_string(i) + " " + to_string(params_[i]->shape()) + " after it was sent to the other "
                      "ranks: this step writes it more often (" + std::to_string(count_[i] + 1) +
                      " times) than the first step did (" + std::to_string(writes_[i]) +
                      "); a network whose backward changes between steps needs duet::distributed::InitConfig{"
                      ".overlap_backward = false}");
    }
    ++count_[i];
    written_.push_back(i);
  }

  void writes_done() override {
    for (const std::size_t i : written_) final_[i] = final_[i] || count_[i] >= writes_[i];
    written_.clear();
    start_ready();
    if (started_ > 0) runtime_.test_sums();
  }

  // After backward, with no observer set: starts what is left, sums `values` (step_values'
  // losses and buffers) with which gradients each rank wrote, and leaves the sums in the
  // parameters' gradients.
  void finish(std::vector<double>& values) {
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

 private:
  std::size_t position(std::size_t k) const { return params_.size() - 1 - k; }

  void start_ready() {
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

  void start(const Unit& unit, std::vector<float>& buffer) {
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

  DataParallelRuntime& runtime_;
  const std::vector<nn::BasicParameter<float>*>& params_;
  const std::unordered_map<const void*, std::size_t>& index_;
  const std::vector<int>& writes_;
  const std::vector<Unit>& units_;
  std::vector<std::vector<float>>& buffers_;
  std::vector<double>& weights_;  // this rank's weight, then (summed) the ranks'
  bool mean_;
  double weight_;
  float share_ = 1;
  std::vector<int> count_;
  std::vector<bool> final_;
  std::vector<bool> sent_;
  std::vector<std::size_t> written_;
  std::size_t started_ = 0;
};

// The runtime a training step of `who` synchronises through, or nullptr when it trains alone.
// Either half of the set-up without the other is refused: each rank would train on its own.
inline DataParallelRuntime* training_runtime(std::string_view who) {
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

}  // namespace detail
}  // namespace duet
// Seeded random numbers that are the same on every compiler and standard library.
//
// std::uniform_real_distribution and std::normal_distribution are implementation-defined, so
// duet draws its own: xoshiro256** seeded through splitmix64, uniform floats from the top
// bits, normals by Box-Muller. Both modes build their weights from this generator, which is
// why the same seed gives the same network in PyNative and graph mode.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <numbers>
#include <string>
#include <utility>
#include <vector>


namespace duet {

// Everything a Generator will draw from: its xoshiro words and a pending second normal draw.
// What a checkpoint saves of a layer's generator (Dropout's), so that training resumes with
// the masks it would have drawn.
struct GeneratorState {
  std::array<std::uint64_t, 4> words{};
  bool has_spare = false;
  double spare = 0;
  friend bool operator==(const GeneratorState&, const GeneratorState&) = default;
};

class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0) { this->seed(seed); }

  // Reseeding also drops a pending second normal draw, which belongs to the old sequence.
  void seed(std::uint64_t seed) {
    has_spare_ = false;
    for (auto& word : state_) {
      seed += 0x9E3779B97F4A7C15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      word = z ^ (z >> 31);
    }
  }

  GeneratorState state() const { return {{state_[0], state_[1], state_[2], state_[3]}, has_spare_, spare_}; }
  // All-zero words are xoshiro's one fixed point, never reached from a seed: it would draw
  // zeros for ever, so callers check (checkpoints refuse it as malformed).
  void set_state(const GeneratorState& s) {
    for (std::size_t i = 0; i < 4; ++i) state_[i] = s.words[i];
    has_spare_ = s.has_spare;
    spare_ = s.spare;
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
// A cell that draws from a generator of its own while it trains (Dropout). A checkpoint saved
// with an optimiser holds that generator's state, under the cell's path, and resuming from it
// restores the state: the resumed run then draws what the uninterrupted one would have.
class GeneratorOwner {
 public:
  virtual Generator& owned_generator() = 0;

 protected:
  ~GeneratorOwner() = default;
};

// A generator in a cell's tree, named "generator.<the cell's path>" ("generator" for the root):
// the name checkpoints save it under and data-parallel training broadcasts it by.
struct NamedGenerator {
  std::string name;
  Generator* generator;
};

// The generators of the cells in `cell`'s tree that own one, in its order: what checkpoints
// save and data-parallel training gives every rank from rank 0.
template <class Cell>
std::vector<NamedGenerator> named_generators(Cell& cell) {
  std::vector<NamedGenerator> out;
  for (const auto& [path, c] : cell.cells_and_names()) {
    if (auto* owner = dynamic_cast<GeneratorOwner*>(c)) {
      out.push_back({path.empty() ? "generator" : "generator." + path, &owner->owned_generator()});
    }
  }
  return out;
}

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

namespace duet::nn {

// loss_fn(backbone(data), label). The backbone is transparent to naming, so the parameters
// keep the names they have in the backbone alone ("dense_relu_sequential.0.weight"), and a
// checkpoint of either loads into the other. It runs in the backbone's mode if that is fixed.
template <class Backbone, class Loss>
class WithLossCell
    : public Cell<WithLossCell<Backbone, Loss>, detail::fixed_mode_of<Backbone>(), typename Backbone::value_type> {
  using T = typename Backbone::value_type;

 public:
  // A backbone built at run time, or with a construct of tensors (PyNative only), cannot be
  // captured into a graph, so neither can this cell.
  static constexpr bool capturable = !RuntimeBuilt<Backbone> && !NonGenericConstruct<Backbone>;

  WithLossCell(Backbone& backbone, Loss& loss_fn) : backbone_(backbone), loss_fn_(loss_fn) {}

  template <class X, class Y>
  auto construct(const X& data, const Y& label) {
    return loss_fn_(backbone_(data), label);
  }

  Backbone& backbone() { return backbone_; }
  Loss& loss_fn() { return loss_fn_; }

  void for_each_child(const typename BasicDynamicCell<T>::ChildVisitor& visit) override {
    visit("", backbone_);
    visit("loss_fn", loss_fn_);
  }
  std::string type_name() const override { return "nn::WithLossCell"; }

 private:
  Backbone& backbone_;
  Loss& loss_fn_;
};

// What a training step does besides forward, backward and update.
struct TrainOneStepConfig {
  // Clip the gradients to this global norm before the update (ops::clip_by_global_norm over
  // every gradient the optimiser reads); none if empty.
  std::optional<double> clip_global_norm;
};

// One training step per call: forward, loss, backward and the optimiser's update. In graph
// mode the first three are one compiled graph run by one evaluator call; the update follows
// in the same call, over the gradients that run left in the parameters.
//
// In DATA_PARALLEL (duet/distributed.hpp) the first step first gives every rank rank 0's
// parameters and optimiser state, and each step all-reduces the gradients before the update, in both modes, so
// that every rank applies the same update (from the second step on, each as soon as backward
// has finished it: duet::detail::OverlappedReduction); the loss returned is then the global
// batch's.
template <class NetWithLoss, class Optimizer>
class TrainOneStepCell {
  using T = typename NetWithLoss::value_type;

 public:
  TrainOneStepCell(NetWithLoss& net_with_loss, Optimizer& optimizer, TrainOneStepConfig config = {})
      : net_with_loss_(net_with_loss), grad_(net_with_loss, {}, std::nullopt), optimizer_(optimizer), config_(config) {
    if (config_.clip_global_norm) ops::detail::check_clip_norm(*config_.clip_global_norm);
    // Cells start in evaluation (MindSpore's default); a training step that ran BatchNorm on
    // its moving statistics and Dropout as the identity would train quietly wrong. MindSpore's
    // Model.train sets the network to training before its steps; a step made here does too.
    net_with_loss.set_train(true);
    net_with_loss.ensure_named();
    for (const auto& [path, cell] : net_with_loss.cells_and_names()) {
      if (cell->depends_on_phase()) phase_layers_.push_back(cell);
    }
  }

  // Returns the loss of the batch, before the update. A step that fails or skips its update
  // changes nothing, not even BatchNorm's moving statistics or Dropout's generator. An
  // empty batch is refused: it has no gradient, yet an update would still advance the
  // optimiser (its step count, and momentum moving the parameters). A batch whose loss is NaN
  // or infinite (NaN or Inf inputs, or a model that diverged) skips the update, which would
  // write NaN into every parameter and moment for good; the caller sees the loss.
  template <class... X>
  BasicTensor<T> operator()(const X&... xs) {
    if (((tensor_of(xs).numel() == 0) || ...)) {
      throw ValueError("nn::TrainOneStepCell: the batch is empty; a training step needs at least one sample");
    }
    // A manual validation pass (net.set_train(false)) not undone: the step would train with
    // BatchNorm on its moving statistics and Dropout off, quietly, so it refuses instead.
    for (const BasicDynamicCell<T>* layer : phase_layers_) {
      if (!layer->training()) {
        throw ModeError("nn::TrainOneStepCell: " + layer->label() +
                        " is set to evaluate (set_train(false) since this step was made), so the step would "
                        "train with BatchNorm on its moving statistics and Dropout off; call set_train(true) on "
                        "the network before training again (duet::train::evaluate puts the setting back itself)");
      }
    }
    duet::detail::StepScope step;
    duet::detail::DataParallelRuntime* parallel = duet::detail::training_runtime("nn::TrainOneStepCell");
    if (parallel != nullptr && !parameters_broadcast_) {
      if constexpr (std::same_as<T, float>) {
        start_data_parallel(*parallel, xs...);
      } else {
        throw ModeError("nn::TrainOneStepCell: DATA_PARALLEL trains float networks only");
      }
      parameters_broadcast_ = true;
    }
    BasicTensor<T> loss;
    if constexpr (std::same_as<T, float>) {
      if (parallel != nullptr && parallel->overlaps_backward()) {
        loss = overlapped_step(*parallel, xs...);
      } else {
        loss = grad_.value_and_parameter_grads(xs...);
      }
    } else {
      loss = grad_.value_and_parameter_grads(xs...);
    }
    if (weights_checked_) {
      autodiff::detail::check_weights_reached(optimizer_.parameters(), nullptr, "nn::TrainOneStepCell");
    } else {
      autodiff::detail::check_weights_reached(optimizer_.parameters(), &net_with_loss_, "nn::TrainOneStepCell");
      weights_checked_ = true;
    }
    if constexpr (std::same_as<T, float>) {
      // Before the finiteness check: a NaN on one rank must skip the update on all of them.
      if (parallel != nullptr) all_reduce(*parallel, loss, xs...);
      overlapped_.reset();
    }
    if (!std::ranges::all_of(loss.values(), [](T v) { return std::isfinite(v); })) return loss;
    // Clipping reads the gradients backward left, the same in both modes, so both clip alike.
    // A gradient whose norm is not finite skips the update, as a NaN loss does; the norm is
    // kept for the caller to see (last_global_norm).
    if (config_.clip_global_norm) {
      const std::uint64_t pass = duet::detail::current_backward_pass();
      std::vector<BasicTensor<T>*> grads;
      for (BasicParameter<T>* p : optimizer_.parameters()) {
        if (p->has_grad_from(pass)) grads.push_back(&p->grad);
      }
      last_global_norm_ = ops::detail::clip_in_place(grads, *config_.clip_global_norm);
      if (!std::isfinite(last_global_norm_)) return loss;
    }
    optimizer_.step();
    step.commit();
    return loss;
  }

  Optimizer& optimizer() { return optimizer_; }
  // The global norm of the last step's gradients before clipping (with clip_global_norm set).
  double last_global_norm() const { return last_global_norm_; }

 private:
  // The first data-parallel step: every rank gets rank 0's parameters and optimiser state, and
  // a loader that gives every rank the same batches (not sharded) is refused: the ranks would
  // repeat one another.
  template <class... X>
  void start_data_parallel(duet::detail::DataParallelRuntime& parallel, const X&... xs) {
    const std::vector<NamedParameter<float>> params = net_with_loss_.parameters();
    parallel.broadcast_parameters(params);
    broadcast_optimizer_state(parallel, params);
    broadcast_generators(parallel);
    for (const auto& p : params) {
      if (!p.parameter->requires_grad) buffers_.push_back(p.parameter);
    }
    std::uint64_t hash = duet::detail::fnv1a({});
    ((hash = duet::detail::fnv1a(duet::detail::tensor_bytes(tensor_of(xs)), hash)), ...);
    if (parallel.group_size() > 1 && parallel.same_on_every_rank(hash)) {
      throw ValueError("nn::TrainOneStepCell: DATA_PARALLEL, but the first batch is the same on all " +
                       std::to_string(parallel.group_size()) +
                       " ranks, so each would train on the same data; shard the loader: data::DataLoader(dataset, "
                       "batch, {.num_shards = duet::distributed::get_group_size(), .shard_id = "
                       "duet::distributed::get_rank()})");
    }
  }

  // Rank 0's moments and step count, as its parameters: a checkpoint is saved by rank 0 alone,
  // and resumed there alone it would leave the other ranks' moments at zero, each rank then
  // updating the same weights its own way from the first step on, with the same losses printed.
  void broadcast_optimizer_state(duet::detail::DataParallelRuntime& parallel,
                                 const std::vector<NamedParameter<float>>& params) {
    const std::vector<BasicParameter<float>*>& order = optimizer_.parameters();
    const auto name_of = [&](std::size_t i) {
      const auto named = std::ranges::find(params, order[i], &NamedParameter<float>::parameter);
      return named != params.end() ? named->name : "parameter " + std::to_string(i);
    };
    // The state's tensors moved into parameters for broadcast_parameters (which also refuses
    // ranks whose optimisers differ), then back.
    const auto slots = optimizer_.state();
    std::vector<BasicParameter<float>> held;
    std::vector<NamedParameter<float>> named;
    for (const auto& slot : slots) {
      for (std::size_t i = 0; i < slot.tensors->size(); ++i) {
        held.emplace_back(std::move((*slot.tensors)[i]));
        named.push_back({std::string(slot.name) + "." + name_of(i), nullptr});
      }
    }
    for (std::size_t k = 0; k < held.size(); ++k) named[k].parameter = &held[k];
    const auto put_back = [&] {
      std::size_t k = 0;
      for (const auto& slot : slots) {
        for (BasicTensor<float>& tensor : *slot.tensors) tensor = std::move(static_cast<BasicTensor<float>&>(held[k++]));
      }
    };
    try {
      parallel.broadcast_parameters(named);
    } catch (...) {
      put_back();
      throw;
    }
    put_back();
    double step[] = {parallel.rank() == 0 ? static_cast<double>(optimizer_.global_step()) : 0.0};
    parallel.all_reduce_sum(step);
    optimizer_.set_global_step(static_cast<std::int64_t>(step[0]));
  }

  // Rank 0's Dropout generators, for the same reason: resumed on rank 0 alone, the other ranks
  // would draw the masks of freshly built layers, not those the run that saved it would have.
  // Each travels as a parameter "generator.<path>" of its state's 16-bit pieces (exact in
  // floats) through broadcast_parameters, which also refuses ranks whose Dropout layers differ.
  void broadcast_generators(duet::detail::DataParallelRuntime& parallel) {
    constexpr int words = 4 + 1;  // the xoshiro words, then the pending draw's bits
    constexpr index_t pieces = 4 * words + 1;  // and the pending flag
    const auto generators = duet::detail::named_generators(net_with_loss_);
    std::vector<BasicParameter<float>> held;
    held.reserve(generators.size());
    std::vector<NamedParameter<float>> named;
    for (const auto& [name, generator] : generators) {
      const GeneratorState state = generator->state();
      std::uint64_t bits[words] = {state.words[0], state.words[1], state.words[2], state.words[3],
                                   std::bit_cast<std::uint64_t>(state.spare)};
      BasicTensor<float> t = zeros<float>({pieces});
      for (int w = 0; w < words; ++w) {
        for (int piece = 0; piece < 4; ++piece) t.data()[4 * w + piece] = static_cast<float>((bits[w] >> (16 * piece)) & 0xFFFF);
      }
      t.data()[pieces - 1] = state.has_spare ? 1.0f : 0.0f;
      held.emplace_back(std::move(t));
      named.push_back({name, nullptr});
    }
    for (std::size_t i = 0; i < held.size(); ++i) named[i].parameter = &held[i];
    parallel.broadcast_parameters(named);
    for (std::size_t i = 0; i < held.size(); ++i) {
      const float* v = held[i].data();
      std::uint64_t bits[words] = {};
      for (int w = 0; w < words; ++w) {
        for (int piece = 0; piece < 4; ++piece) bits[w] |= static_cast<std::uint64_t>(v[4 * w + piece]) << (16 * piece);
      }
      GeneratorState state{{bits[0], bits[1], bits[2], bits[3]}, v[pieces - 1] != 0, std::bit_cast<double>(bits[4])};
      generators[i].generator->set_state(state);
    }
  }

  // What this rank's batch weighs in the global batch.
  template <class... X>
  duet::detail::BatchShare batch_share(const X&... xs) const {
    const auto inputs = std::forward_as_tuple(xs...);
    const index_t rows = tensor_of(std::get<0>(inputs)).dim(0);
    duet::detail::BatchShare share{.summed = false, .counted_rows = static_cast<double>(rows),
                                   .rows = static_cast<double>(rows)};
    if constexpr (requires { net_with_loss_.loss_fn(); } && sizeof...(X) == 2) {
      share = duet::detail::batch_share(net_with_loss_.loss_fn(), tensor_of(std::get<1>(inputs)), rows,
                                        "nn::TrainOneStepCell");
    }
    return share;
  }

  // Forward and backward with the gradients' sums started as they become final
  // (duet::detail::OverlappedReduction), from the second step on; the first counts how often
  // backward writes each gradient.
  template <class... X>
  BasicTensor<float> overlapped_step(duet::detail::DataParallelRuntime& parallel, const X&... xs) {
    const std::vector<BasicParameter<float>*>& params = optimizer_.parameters();
    if (!writes_recorded_) {
      if (gradient_index_.empty()) {
        std::vector<index_t> sizes;
        for (std::size_t i = 0; i < params.size(); ++i) {
          gradient_index_.emplace(params[i], i);
          sizes.push_back(params[i]->numel());
        }
        units_ = duet::detail::OverlappedReduction::plan(sizes, parallel.bucket_bytes());
      }
      std::vector<int> writes;
      duet::detail::GradientWriteCounter counter(gradient_index_, writes);
      BasicTensor<float> loss;
      {
        const duet::detail::GradientObserverScope scope(&counter);
        loss = grad_.value_and_parameter_grads(xs...);
      }
      writes_ = std::move(writes);
      writes_recorded_ = true;
      return loss;
    }
    const duet::detail::BatchShare share = batch_share(xs...);
    const bool weighted = get_auto_parallel_context().gradients_mean && !share.summed;
    overlapped_.emplace(parallel, params, gradient_index_, writes_, units_, overlap_buffers_, overlap_weights_,
                        weighted ? share.counted_rows : 1.0, weighted);
    const duet::detail::GradientObserverScope scope(&*overlapped_);
    return grad_.value_and_parameter_grads(xs...);
  }

  // The gradients backward left, the loss and the moving statistics become the global batch's.
  template <class... X>
  void all_reduce(duet::detail::DataParallelRuntime& parallel, BasicTensor<float>& loss, const X&... xs) {
    if (loss.numel() != 1) {
      throw ModeError("nn::TrainOneStepCell: DATA_PARALLEL combines the ranks' losses, which needs each reduced to "
                      "one number; this loss has shape " + to_string(loss.shape()));
    }
    const duet::detail::BatchShare share = batch_share(xs...);
    if (overlapped_) {
      const bool weighted = get_auto_parallel_context().gradients_mean && !share.summed;
      std::vector<double> values = duet::detail::step_values(loss.values(), buffers_, share, weighted);
      overlapped_->finish(values);
      duet::detail::apply_step_values(values, loss.values(), buffers_, share);
      duet::detail::all_reduced_backward_pass() = duet::detail::current_backward_pass();
      return;
    }
    const std::uint64_t pass = duet::detail::current_backward_pass();
    const std::vector<BasicParameter<float>*>& params = optimizer_.parameters();
    std::vector<duet::detail::GradientView> grads;
    grads.reserve(params.size());
    for (const BasicParameter<float>* p : params) {
      grads.push_back({p->has_grad_from(pass) ? p->grad.data() : nullptr, p->numel()});
    }
    duet::detail::all_reduce_step(
        parallel, grads,
        [&](std::size_t i) {
          bool accumulate = false;
          return params[i]->grad_for_write(pass, &accumulate);
        },
        loss.values(), buffers_, share, get_auto_parallel_context().gradients_mean);
    duet::detail::all_reduced_backward_pass() = pass;
  }

  NetWithLoss& net_with_loss_;
  GradFunction<NetWithLoss&, void> grad_;
  Optimizer& optimizer_;
  TrainOneStepConfig config_;
  double last_global_norm_ = 0;
  bool parameters_broadcast_ = false;
  bool weights_checked_ = false;  // the network's parameters against those its first step wrote
  std::vector<const BasicDynamicCell<T>*> phase_layers_;  // BatchNorm, Dropout: they must still train
  std::vector<BasicParameter<float>*> buffers_;  // parameters nothing trains: moving statistics
  // DATA_PARALLEL with overlap_backward: the optimiser's parameters' places, their units, how
  // often the first step's backward wrote each gradient, the sums' storage, this step's sums.
  std::unordered_map<const void*, std::size_t> gradient_index_;
  std::vector<duet::detail::OverlappedReduction::Unit> units_;
  std::vector<int> writes_;
  bool writes_recorded_ = false;
  std::vector<std::vector<float>> overlap_buffers_;
  std::vector<double> overlap_weights_;
  std::optional<duet::detail::OverlappedReduction> overlapped_;
};

}  // namespace duet::nn

namespace duet {

// Whether Net captures as a static graph for inputs of shape Pattern (duet::shape<dyn, 784>'s
// type, StaticShape<dyn, 784>), so that graph mode runs it as one: a Cell with a generic
// construct whose operations all accept that shape. A network built at run time, a construct
// of duet::Tensor, or a cell calling one (WithLossCell over a DynamicSequentialCell) is traced
// or runs eagerly instead. Checked while the program compiles, as graph capture's own shape
// checks are; a capture found ambiguous when it runs (README: "Shared values in graph mode")
// still runs traced.
namespace detail {
// A cell graph capture may call: not built at run time, generic, calling nothing built so.
template <class Net>
concept capture_candidate =
    !nn::RuntimeBuilt<Net> && !nn::NonGenericConstruct<Net> && nn::capturable_construct<Net>();
}  // namespace detail

template <class Net, class Pattern = graph::AnyShape>
concept runs_in_both_modes =
    detail::capture_candidate<Net> && requires(Net& net) { net(graph::input<typename Net::value_type, Pattern>()); };

// Tolerances as numpy.isclose's: graph's value g agrees with PyNative's p when
// |g - p| <= atol + rtol * |p|, or both are NaN. The defaults ask for what the modes promise:
// the same values, bit for bit (a folded BatchNorm at evaluation needs about rtol 2e-6).
struct CompareOptions {
  double rtol = 0;
  double atol = 0;
};

// One value on which the modes disagree.
struct ModeDifference {
  std::string stage = {};      // "forward", "output" (the whole network) or "gradient"
  std::size_t node = 0;   // forward: %node of graph_ir's optimized dump
  std::string operation = {};  // forward: "MatMul + BiasAdd + ReLU"; gradient: the parameter's name
  std::string cell = {};       // the layer that runs it, "nn::Dense<784, 512> 'dense_relu_sequential.0'",
                               // or the cell whose construct calls it
  Shape shape = {};
  index_t element = 0;           // the worst element, row-major
  std::vector<index_t> index = {};    // the same, one index per axis
  double graph = 0;              // its value in graph mode
  double pynative = 0;           // and in PyNative mode
  double max_abs_error = 0;      // over the value's elements
  double max_rel_error = 0;      // |g - p| / |p|, over elements where p is not 0
};

struct ModeReport {
  std::optional<ModeDifference> difference = {};  // the first, in the order graph mode runs
  std::size_t values_compared = 0;
  // What could not be compared, and why (a graph node no PyNative operation stands for).
  std::vector<std::string> notes = {};

  bool empty() const { return !difference.has_value(); }
  bool agree() const { return empty(); }
  std::string to_string() const;
};

inline std::ostream& operator<<(std::ostream& os, const ModeReport& report) { return os << report.to_string(); }

namespace detail {

// The worst element of graph's value against PyNative's, and whether any is beyond tolerance.
struct ValueComparison {
  bool differs = false;
  index_t worst = 0;
  double graph = 0, pynative = 0, max_abs = 0, max_rel = 0;
};

template <class T>
ValueComparison compare_values(const T* g, const T* p, index_t n, const CompareOptions& options) {
  ValueComparison c;
  double worst_excess = -1;
  for (index_t i = 0; i < n; ++i) {
    const auto a = static_cast<double>(g[i]);
    const auto b = static_cast<double>(p[i]);
    if (std::isnan(a) && std::isnan(b)) continue;
    // A NaN on one side only is the worst there is.
    const double abs = std::isnan(a) || std::isnan(b) ? INFINITY : std::fabs(a - b);
    const double excess = abs - (options.atol + options.rtol * std::fabs(b));
    if (abs > c.max_abs) c.max_abs = abs;
    if (b != 0 && abs / std::fabs(b) > c.max_rel) c.max_rel = abs / std::fabs(b);
    if (excess > 0) c.differs = true;
    if (excess > worst_excess) {
      worst_excess = excess;
      c.worst = i;
      c.graph = a;
      c.pynative = b;
    }
  }
  return c;
}

inline std::vector<index_t> index_of_element(const Shape& shape, index_t flat) {
  std::vector<index_t> index(static_cast<std::size_t>(shape.rank()));
  for (int a = shape.rank(); a-- > 0;) {
    index[static_cast<std::size_t>(a)] = shape[a] == 0 ? 0 : flat % shape[a];
    flat = shape[a] == 0 ? 0 : flat / shape[a];
  }
  return index;
}

template <class T>
void record_comparison(ModeReport& report, const T* g, const T* p, const Shape& shape, ModeDifference where,
                       const CompareOptions& options) {
  ++report.values_compared;
  if (report.difference) return;
  const ValueComparison c = compare_values(g, p, shape.numel(), options);
  if (!c.differs) return;
  where.shape = shape;
  where.element = c.worst;
  where.index = index_of_element(shape, c.worst);
  where.graph = c.graph;
  where.pynative = c.pynative;
  where.max_abs_error = c.max_abs;
  where.max_rel_error = c.max_rel;
  report.difference = std::move(where);
}

// "MatMul + BiasAdd + ReLU" -> {"MatMul", "BiasAdd", "ReLU"}: the operations a fused node
// took in, each a step of PyNative's trace.
inline std::vector<std::string> fused_parts(const std::string& op_name) {
  std::vector<std::string> parts;
  std::size_t begin = 0;
  for (std::size_t plus; (plus = op_name.find(" + ", begin)) != std::string::npos; begin = plus + 3) {
    parts.push_back(op_name.substr(begin, plus - begin));
  }
  parts.push_back(op_name.substr(begin));
  return parts;
}

// Pairs graph nodes, in the order they run, with the trace's steps: the first run of steps
// from `next` on whose names are the node's parts and whose last makes a value of its shape.
class TracePairing {
 public:
  explicit TracePairing(const pijit::Trace& trace) : trace_(trace) {}

  // The trace's value standing for a node, or nothing.
  const pijit::Value* pair(const std::string& op_name, const Shape& shape) {
    const std::vector<std::string> parts = fused_parts(op_name);
    const auto& steps = trace_.steps();
    const auto& values = trace_.values();
    for (std::size_t s = next_; s + parts.size() <= steps.size(); ++s) {
      bool same = true;
      for (std::size_t k = 0; k < parts.size() && same; ++k) same = stands_for(steps[s + k]->op_name(), parts[k]);
      const pijit::Value& v = values[steps[s + parts.size() - 1]->output];
      if (same && v.shape == shape && v.data != nullptr) {
        next_ = s + parts.size();
        return &v;
      }
    }
    return nullptr;
  }

 private:
  // A folded part ("BatchNorm(folded)", the normalisation taken into a convolution's weight
  // at evaluation) stands for the PyNative step it replaced ("BatchNorm (moving statistics)"):
  // compared, so that where the folding moves the values is the node the report names. A
  // packed product ("PackedMatMul", its weight read from the packed copy) stands for the
  // product PyNative ran ("MatMul").
  static bool stands_for(const std::string& step, const std::string& part) {
    constexpr std::string_view folded = "(folded)";
    constexpr std::string_view packed = "Packed";
    if (part.starts_with(packed)) return step == std::string_view(part).substr(packed.size());
    if (part.size() <= folded.size() || !part.ends_with(folded)) return step == part;
    return step.starts_with(std::string_view(part).substr(0, part.size() - folded.size()));
  }

  const pijit::Trace& trace_;
  std::size_t next_ = 0;
};

// Switches the global context's mode for its lifetime.
class ContextModeScope {
 public:
  explicit ContextModeScope(Mode mode) : saved_(get_context().mode) { set_context({.mode = mode}); }
  ContextModeScope(const ContextModeScope&) = delete;
  ContextModeScope& operator=(const ContextModeScope&) = delete;
  ~ContextModeScope() { set_context({.mode = saved_}); }

 private:
  Mode saved_;
};

// The forward pass in both modes, node by node. Each run is a step that does not commit, so
// both start from the network as it was (BatchNorm's statistics, Dropout's generator) and
// leave it so.
template <class Net, class... X>
void compare_forward(ModeReport& report, Net& net, const CompareOptions& options, const X&... xs) {
  using T = typename Net::value_type;
  pijit::Trace trace;
  trace.keep_values();
  auto inputs = std::make_tuple(BasicTensor<typename X::value_type>(tensor_of(xs))...);
  [&]<std::size_t... K>(std::index_sequence<K...>) { (trace.add_input(std::get<K>(inputs), K), ...); }
  (std::index_sequence_for<X...>{});
  BasicTensor<T> pynative_out;
  {
    const StepScope discarded;
    const pijit::Tracing tracing(&trace);
    const EagerScope eager;
    pynative_out = std::apply([&](const auto&... in) { return BasicTensor<T>(net(in...)); }, inputs);
  }

  constexpr JitConfig Config = nn::detail::graph_config_of<Net>();
  // The program the cell's own graph-mode calls run, kept since the first of them: a value
  // construct read then (a member flag, a scale) is a constant of it, and may differ from
  // what PyNative reads now; capturing afresh would hide that.
  const auto capture = [&](auto phase) -> const auto& {
    return net.template graph_program<decltype(phase)::value, typename graph::pattern_of<X>::type...>(tensor_of(xs)...);
  };
  pipeline::in_requested_phase(capture, [&](const auto& program) {
    if (!program.ambiguity.empty()) {
      // Graph mode runs such a network as a trace of PyNative's own operations (README,
      // "Shared values in graph mode"): there are no graph nodes to pair, only the output.
      report.notes.push_back("the capture is ambiguous (" + program.ambiguity +
                             "), so graph mode runs it traced (PIJit): only the output is compared");
      const StepScope discarded;
      const ContextModeScope graph_mode(GRAPH_MODE);
      const BasicTensor<T> graph_out(net(tensor_of(xs)...));
      if (graph_out.shape() == pynative_out.shape()) {
        record_comparison(report, graph_out.data(), pynative_out.data(), graph_out.shape(),
                          ModeDifference{.stage = "output", .cell = net.label()}, options);
      }
      return 0;
    }
    using G = typename std::remove_cvref_t<decltype(program)>::graph_type;
    TracePairing pairing(trace);
    const auto observe = [&](auto i, const auto* values, const Shape& shape) {
      constexpr std::size_t I = decltype(i)::value;
      using Node = graph::node_at<G, I>;
      // Inputs and parameters are the same tensors in both modes.
      if constexpr (Node::arity > 0) {
        const std::string name = Node::op_type::op_name();
        const pijit::Value* p = pairing.pair(name, shape);
        if (p == nullptr) {
          report.notes.push_back("%" + std::to_string(I) + " " + name + " : " + duet::to_string(shape) +
                                 ": no PyNative operation stands for it, not compared");
          return;
        }
        // The layer the operation names, as graph_ir shows it; else the cell whose construct
        // called it, as PyNative saw it run.
        const std::string label = graph::get<I>(program.graph).op.label();
        record_comparison(report, values, static_cast<decltype(values)>(p->data), shape,
                          ModeDifference{.stage = "forward", .node = I, .operation = name,
                                         .cell = label == name ? p->cell : label},
                          options);
      }
    };
    const StepScope discarded;
    const auto tensors = std::make_tuple(tensor_of(xs)...);
    std::apply(
        [&](const auto&... in) {
          const auto p = plan<Config>(program, std::array<Shape, sizeof...(X)>{in.shape()...},
                                      net.type_name() + "::construct");
          run_observed<DefaultBackend, Config>(program, p, observe, in...);
        },
        tensors);
    return 0;
  });
}

template <class Net>
inline constexpr bool is_loss_cell = false;
template <class Backbone, class Loss>
inline constexpr bool is_loss_cell<nn::WithLossCell<Backbone, Loss>> = true;

// The loss's gradients in both modes, PyNative's tape against graph mode's backward graph,
// parameter by parameter in parameters() order. The graph-mode half switches the context for
// its call, so the cell must follow it.
template <class Net, class... X>
void compare_gradients(ModeReport& report, Net& net, const CompareOptions& options, const X&... xs) {
  if constexpr (Net::mode != CONTEXT_MODE) {
    throw ModeError("duet::compare_modes: " + net.label() +
                    " is fixed to one mode, so its gradients cannot be taken in the other; compare the "
                    "gradients of a cell that follows the context (nn::Cell<Net>)");
  } else {
    const auto parameters = net.parameters();
    const auto grads_in = [&](Mode mode) {
      const StepScope discarded;
      const ContextModeScope scope(mode);
      return value_and_grad(net, parameters)(xs...).grads;
    };
    const auto pynative = grads_in(PYNATIVE_MODE);
    const auto graph = grads_in(GRAPH_MODE);
    for (std::size_t k = 0; k < parameters.size(); ++k) {
      record_comparison(report, graph[k].data(), pynative[k].data(), graph[k].shape(),
                        ModeDifference{.stage = "gradient", .operation = parameters[k].name}, options);
    }
  }
}

template <class Net, class... X>
ModeReport compare_modes(Net& net, const CompareOptions& options, const X&... xs) {
  static_assert(capture_candidate<Net> && graph::Capturable<Net&, X...>,
                "duet::compare_modes: the network does not capture as a static graph for this input "
                "(see duet::runs_in_both_modes): graph mode would trace it or run it eagerly");
  net.ensure_named();
  ModeReport report;
  compare_forward(report, net, options, xs...);
  if constexpr (is_loss_cell<Net>) {
    if (report.empty()) compare_gradients(report, net, options, xs...);
  }
  return report;
}

}  // namespace detail

// Runs net on x in PyNative mode and in graph mode, on the same weights, and reports the
// first graph node whose value differs beyond the tolerances. The network is left as it was.
template <class Net, class X>
ModeReport compare_modes(Net& net, const X& x, const CompareOptions& options = {}) {
  return detail::compare_modes(net, options, x);
}

// The same for a construct of two inputs. Given a loss cell (nn::WithLossCell) and its data
// and labels, then, if the forward pass agrees, the first parameter whose gradient of the loss
// does not.
template <class Net, class X, class Y>
ModeReport compare_modes(Net& net, const X& x, const Y& y, const CompareOptions& options = {}) {
  return detail::compare_modes(net, options, x, y);
}

inline std::string ModeReport::to_string() const {
  std::ostringstream os;
  if (!difference) {
    os << "the modes agree (" << values_compared << " values compared)\n";
  } else {
    const ModeDifference& d = *difference;
    os << "the modes differ ";
    if (d.stage == "forward") {
      os << "first at node %" << d.node << " " << d.operation << (d.cell.empty() ? "" : " of " + d.cell);
    } else if (d.stage == "gradient") {
      os << "first in the gradient of parameter '" << d.operation << "'";
    } else {
      os << "at the output of " << d.cell;
    }
    std::string index;
    for (index_t i : d.index) index += (index.empty() ? "" : ", ") + std::to_string(i);
    std::ostringstream values;
    values.precision(9);
    values << "graph " << d.graph << ", PyNative " << d.pynative;
    os << " : " << duet::to_string(d.shape) << "\n  worst element " << d.element << " [" << index << "]: "
       << values.str() << "\n  max abs error " << d.max_abs_error << ", max rel error " << d.max_rel_error << "\n";
  }
  for (const std::string& note : notes) os << "  note: " << note << "\n";
  // Lines end with a newline, the last excepted, so that `std::cout << report << '\n'` prints
  // no blank line, as printing a tensor does.
  std::string text = os.str();
  text.pop_back();
  return text;
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
  // Data parallelism (MindSpore's num_shards/shard_id): the loader serves shard shard_id of
  // every global batch of batch_size * num_shards samples, the samples at positions shard_id,
  // shard_id + num_shards, ... of it. Every shard shuffles alike (the same seed gives the same
  // epoch order), so the shards' batches together are one process's batches of the global size.
  // A last global batch of fewer than num_shards samples is left out on every shard: some shard
  // would get an empty batch.
  index_t num_shards = 1;
  index_t shard_id = 0;
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
    const index_t first = next_batch_ * global_batch_size() + options_.shard_id;
    const index_t shards = options_.num_shards;
    make_batch(first, std::min(batch_size_, (data_.size() - first + shards - 1) / shards));
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
  // The samples at positions first, first + num_shards, ... of this epoch's order.
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
      const index_t sample = order_[static_cast<std::size_t>(first + k * options_.num_shards)];
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

#include <cstddef>
#include <ostream>
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
    const auto& op = graph::get<I>(program.graph).op;
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
  text << "  return %" << Out << "\n";
  // Such a program does not run (pipeline::compile): the dump says so, and why.
  if (!program.ambiguity.empty()) text << "  ambiguous capture, runs traced instead: " << program.ambiguity << "\n";
  text << "}\n";
  dot << "}\n";
  return {text.str(), dot.str()};
}

namespace detail {
inline std::string dot_of_text(const std::string& title, const std::string& text) {
  return "digraph \"" + dot_text(title) + "\" {\n  node [shape=box, fontname=\"monospace\"];\n  trace [label=\"" +
         dot_text(text) + "\"];\n}\n";
}

// What graph mode runs when there is no static graph (a capture that is ambiguous, a network
// built at run time): the cell traced (PIJit) on an input of the pattern's shape, unknown sizes
// taken as 2 (BatchNorm trains on no fewer), as recorded and as replayed after fusion. Tracing
// runs the network; what that changes (BatchNorm's moving statistics, Dropout's generator) is
// put back, as for a step that does not commit.
template <JitConfig Config, class C>
GraphIR traced_ir(C& cell, const std::string& title, Shape pattern, const std::string& how) {
  using T = typename C::value_type;
  const std::string head = "graph " + title + " {\n  " + how + "\n";
  const auto ir = [&](const std::string& captured, const std::string& optimized) {
    return GraphIR{{head + captured + "}\n", dot_of_text(title, head + captured)},
                   {head + optimized + "}\n", dot_of_text(title, head + optimized)}};
  };
  if (pattern.leading_unknown()) {
    const std::string note = "  traced on its first call for each input shape: give graph_ir an input shape "
                             "(duet::shape<dyn, ...>) to see the trace\n";
    return ir(note, note);
  }
  for (int a = 0; a < pattern.rank(); ++a) pattern[a] = pattern[a] == dyn ? 2 : pattern[a];
  const duet::detail::StepScope discarded;
  pijit::Trace trace;
  BasicTensor<T> x = zeros<T>(pattern);
  trace.add_input(x, 0);
  BasicTensor<T> y;
  {
    pijit::Tracing tracing(&trace);
    EagerScope eager;
    y = BasicTensor<T>(cell(x));
  }
  const std::size_t out = trace.find(y);
  if (!trace.broken().empty() || out == trace.values().size()) {
    const std::string note = "  graph break, runs eagerly: " + trace.broken() + "\n";
    return ir(note, note);
  }
  const std::string traced_on = "  traced on an input of shape " + to_string(pattern) + "\n";
  std::string captured = traced_on + pijit::describe(trace.values(), trace.steps(), out);
  const pijit::Replay replay(std::move(trace), out, Config.jit_level);
  return ir(captured, traced_on + replay.describe());
}
}  // namespace detail

}  // namespace graph

namespace detail {
template <JitConfig Config, class C, class Pattern>
GraphIR graph_ir_of(C& cell, Pattern) {
  cell.ensure_named();
  const std::string title = cell.type_name();
  if constexpr (nn::RuntimeBuilt<C>) {
    return graph::detail::traced_ir<Config>(cell, title, Pattern::value, "built at run time, so graph mode runs it as a traced graph (PIJit)");
  } else {
    // The form the network's layers are set to (set_train), as a call would run.
    return pipeline::in_requested_phase(
        [&](auto phase) {
          using In = graph::pattern_in_phase<decltype(phase)::value, Pattern>;
          return cell(graph::input<typename C::value_type, In>());
        },
        [&](const auto& captured) {
          if (!captured.ambiguity.empty()) {
            return graph::detail::traced_ir<Config>(cell, title, Pattern::value,
                                                    "ambiguous capture, so it runs as a traced graph (PIJit), not as a static graph: " +
                                                        captured.ambiguity);
          }
          auto optimized = passes::optimize<Config>(captured);
          return GraphIR{graph::dump(captured, title), graph::dump(optimized, title)};
        });
  }
}
}  // namespace detail

// The graph of cell for inputs of the given pattern (duet::shape<dyn, 1, 28, 28>, say; by
// default an input of unknown shape, as when a runtime tensor is passed), optimised at the
// jit level of Config. Where graph mode has no static graph to run, graph_ir shows the trace
// that runs instead: for a capture that is ambiguous (README, Guarantees: "Shared values in
// graph mode") and for a network built at run time (nn::DynamicSequentialCell, a class
// deriving from nn::DynamicCell), which has no construct to capture.
template <JitConfig Config, class C, class Pattern = graph::AnyShape>
GraphIR graph_ir(C& cell, Pattern = {}) {
  // A tensor here failed deep inside with "'value' is not a member of BasicTensor".
  if constexpr (!requires { Shape(Pattern::value); }) {
    static_assert(requires { Shape(Pattern::value); },
                  "duet::graph_ir(net, pattern): the pattern is an input shape written as a type, "
                  "duet::shape<duet::dyn, 784> (duet::dyn: any size), not a tensor");
    return {};
  } else {
    return detail::graph_ir_of<Config>(cell, Pattern{});
  }
}

// At the level graph mode compiles the cell at: its own JitConfig (nn::Cell<Net, JitConfig{...}>),
// else the default. It showed the default level's graph for a cell compiled at O0.
template <class C, class Pattern = graph::AnyShape>
GraphIR graph_ir(C& cell, Pattern pattern = {}) {
  return graph_ir<nn::detail::graph_config_of<C>()>(cell, pattern);
}

// What graph mode runs: std::cout << duet::graph_ir(net, duet::shape<duet::dyn, 784>).
inline std::ostream& operator<<(std::ostream& os, const GraphIR& ir) { return os << ir.optimized.text; }

}  // namespace duet
// Initialisers: how a parameter gets its first values (MindSpore's mindspore.common.initializer).
//
// The namespace is MindSpore's module name, duet::initializer, so that a program ported from
// `from mindspore.common.initializer import HeNormal` finds duet::initializer::HeNormal, and
// MindSpore's creation function initializer(init, shape, dtype) is
// duet::initializer::initializer<T>(init, shape). (`namespace init = duet::initializer;` makes
// it short.) Each initialiser is a small aggregate with MindSpore's arguments and defaults,
// HeNormal{.mode = FanMode::fan_out} say, and the same formulas; the random ones draw from a
// duet::Generator, the global one (set_seed) unless given another, so the same seed gives the
// same weights whatever the mode the network later runs in. Arguments MindSpore takes as
// strings ('fan_in', 'relu') are enums here: a misspelling does not compile.
//
// A type I is an initialiser for tensors of T (the Initializer concept) when it has
// `void fill(BasicTensor<T>&, Generator&) const` and `std::string name() const`; user types
// qualify the same way, and every layer option and free function below takes them.

#include <cmath>
#include <concepts>
#include <functional>
#include <limits>
#include <locale>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>


namespace duet::initializer {

template <class I, class T>
concept Initializer = ElementType<T> && requires(const I& init, BasicTensor<T>& tensor, Generator& gen) {
  init.fill(tensor, gen);
  { init.name() } -> std::convertible_to<std::string>;
};

// MindSpore's mode='fan_in' / 'fan_out': which side of the weight keeps its variance.
enum class FanMode { fan_in, fan_out };

// MindSpore's nonlinearity argument ('linear' also stands for its 'conv1d' ... 'conv_transpose3d').
enum class Nonlinearity { linear, sigmoid, tanh, relu, leaky_relu };

struct Fans {
  index_t fan_in = 0;
  index_t fan_out = 0;
  friend bool operator==(const Fans&, const Fans&) = default;
};

namespace detail {

// Arguments as MindSpore prints them: 0.01, not 0.010000.
inline std::string number(double x) {
  std::ostringstream s;
  s.imbue(std::locale::classic());
  s << x;
  return s.str();
}

inline std::string_view name_of(FanMode mode) {
  switch (mode) {
    case FanMode::fan_in:
      return "fan_in";
    case FanMode::fan_out:
      return "fan_out";
  }
  return "?";
}

inline std::string_view name_of(Nonlinearity f) {
  switch (f) {
    case Nonlinearity::linear:
      return "linear";
    case Nonlinearity::sigmoid:
      return "sigmoid";
    case Nonlinearity::tanh:
      return "tanh";
    case Nonlinearity::relu:
      return "relu";
    case Nonlinearity::leaky_relu:
      return "leaky_relu";
  }
  return "?";
}

inline void require_finite(double x, std::string_view argument, const std::string& who) {
  if (!std::isfinite(x)) {
    throw ValueError(who + ": " + std::string(argument) + " must be a finite number, got " + number(x));
  }
}

// How a He initialiser draws: HeUniform or HeNormal.
enum class HeDraw { uniform, normal };

}  // namespace detail

// MindSpore's _calculate_fan_in_and_fan_out: a [out, in] matrix has fan_in = in and
// fan_out = out; a higher-rank weight [out, in, k1, k2, ...] (a convolution's) multiplies
// both by the receptive field k1 * k2 * .... `who` names the caller in the error.
inline Fans fan_in_and_fan_out(const Shape& shape, const std::string& who = "initializer::fan_in_and_fan_out") {
  if (shape.rank() < 2 || !shape.is_concrete()) {
    throw ValueError(who + ": fan_in and fan_out are computed for a concrete shape of at least 2 dimensions, got " +
                     to_string(shape));
  }
  const index_t receptive_field = shape.numel_from(2);
  return {shape[1] * receptive_field, shape[0] * receptive_field};
}

// MindSpore's _calculate_gain: the factor that keeps a layer's output variance through the
// nonlinearity after it. negative_slope is used by leaky_relu only.
inline double calculate_gain(Nonlinearity nonlinearity, double negative_slope = 0.01,
                             const std::string& who = "initializer::calculate_gain") {
  switch (nonlinearity) {
    case Nonlinearity::linear:
    case Nonlinearity::sigmoid:
      return 1;
    case Nonlinearity::tanh:
      return 5.0 / 3;
    case Nonlinearity::relu:
      return std::sqrt(2.0);
    case Nonlinearity::leaky_relu:
      detail::require_finite(negative_slope, "negative_slope", who);
      return std::sqrt(2.0 / (1 + negative_slope * negative_slope));
  }
  throw ValueError(who + ": nonlinearity must be linear, sigmoid, tanh, relu or leaky_relu, got value " +
                   std::to_string(static_cast<int>(nonlinearity)));
}

// N(mean, sigma²).
struct Normal {
  double sigma = 0.01;
  double mean = 0;

  std::string name() const {
    return "initializer::Normal(sigma=" + detail::number(sigma) + ", mean=" + detail::number(mean) + ")";
  }
  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    detail::require_finite(mean, "mean", name());
    if (!(sigma >= 0) || !std::isfinite(sigma)) {
      throw ValueError(name() + ": sigma must be finite and at least 0, got " + detail::number(sigma));
    }
    for (T& v : tensor.values()) v = static_cast<T>(mean + sigma * gen.normal<double>());
  }
};

// U(-scale, scale).
struct Uniform {
  double scale = 0.07;

  std::string name() const { return "initializer::Uniform(scale=" + detail::number(scale) + ")"; }
  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    if (!(scale >= 0) || !std::isfinite(scale)) {
      throw ValueError(name() + ": scale must be finite and at least 0, got " + detail::number(scale));
    }
    const auto bound = static_cast<T>(scale);
    for (T& v : tensor.values()) v = gen.uniform<T>(-bound, bound);
  }
};

// U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010).
struct XavierUniform {
  double gain = 1;

  std::string name() const { return "initializer::XavierUniform(gain=" + detail::number(gain) + ")"; }
  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    detail::require_finite(gain, "gain", name());
    const Fans fans = fan_in_and_fan_out(tensor.shape(), name());
    if (fans.fan_in + fans.fan_out == 0) {
      throw ValueError(name() + ": fan_in + fan_out is 0 for shape " + to_string(tensor.shape()));
    }
    const auto bound = static_cast<T>(gain * std::sqrt(6.0 / static_cast<double>(fans.fan_in + fans.fan_out)));
    for (T& v : tensor.values()) v = gen.uniform<T>(-bound, bound);
  }
};

// He et al., 2015: fan and gain from mode and nonlinearity. HeUniform draws U(-b, b) with
// b = gain * sqrt(3 / fan), HeNormal N(0, sigma²) with sigma = gain / sqrt(fan). nn::Dense's
// default weight is HeUniform{.negative_slope = std::sqrt(5.0)}: b = 1 / sqrt(fan_in).
template <detail::HeDraw Draw>
struct He {
  double negative_slope = 0;
  FanMode mode = FanMode::fan_in;
  Nonlinearity nonlinearity = Nonlinearity::leaky_relu;

  std::string name() const {
    return std::string(Draw == detail::HeDraw::uniform ? "initializer::HeUniform" : "initializer::HeNormal") +
           "(negative_slope=" + detail::number(negative_slope) + ", mode=" + std::string(detail::name_of(mode)) +
           ", nonlinearity=" + std::string(detail::name_of(nonlinearity)) + ")";
  }

  template <std::floating_point T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    const double gain = calculate_gain(nonlinearity, negative_slope, name());
    if (mode != FanMode::fan_in && mode != FanMode::fan_out) {
      throw ValueError(name() + ": mode must be fan_in or fan_out, got value " + std::to_string(static_cast<int>(mode)));
    }
    const Fans fans = fan_in_and_fan_out(tensor.shape(), name());
    const index_t fan = mode == FanMode::fan_in ? fans.fan_in : fans.fan_out;
    if (fan == 0) {
      throw ValueError(name() + ": " + std::string(detail::name_of(mode)) + " is 0 for shape " +
                       to_string(tensor.shape()));
    }
    if constexpr (Draw == detail::HeDraw::uniform) {
      // sqrt(3) * gain is rounded to T before the division: with negative_slope = sqrt(5) it is
      // exactly 1, so the bound is T's 1 / sqrt(fan), the one nn::Dense has always drawn with.
      const T bound = static_cast<T>(std::sqrt(3.0) * gain) / std::sqrt(static_cast<T>(fan));
      for (T& v : tensor.values()) v = gen.uniform<T>(-bound, bound);
    } else {
      const double sigma = gain / std::sqrt(static_cast<double>(fan));
      for (T& v : tensor.values()) v = static_cast<T>(sigma * gen.normal<double>());
    }
  }
};
using HeUniform = He<detail::HeDraw::uniform>;
using HeNormal = He<detail::HeDraw::normal>;

// Every element `value`. It fills integer tensors too, with a value they hold exactly.
struct Constant {
  double value = 0;

  std::string name() const { return "initializer::Constant(value=" + detail::number(value) + ")"; }
  template <ElementType T>
  void fill(BasicTensor<T>& tensor, Generator& /*unused: not random*/) const {
    if (!exactly_representable<T>()) {
      throw ValueError(name() + ": a tensor of " + std::string(name_of(dtype_of<T>)) + " cannot hold " +
                       detail::number(value) +
                       (std::is_floating_point_v<T> ? " (not finite, or out of its range)" : " exactly"));
    }
    const auto v = static_cast<T>(value);
    for (T& x : tensor.values()) x = v;
  }

 private:
  template <class T>
  bool exactly_representable() const {
    if constexpr (std::is_floating_point_v<T>) {
      return std::isfinite(value) && std::abs(value) <= static_cast<double>(std::numeric_limits<T>::max());
    } else {
      // Both limits are powers of two (or their neighbours), so the comparisons are exact in double.
      return std::isfinite(value) && value == std::trunc(value) &&
             value >= static_cast<double>(std::numeric_limits<T>::min()) &&
             value < static_cast<double>(std::numeric_limits<T>::max()) + 1.0;
    }
  }
};

// Constant 0 and 1 (MindSpore's 'zeros', 'ones').
struct Zero {
  std::string name() const { return "initializer::Zero()"; }
  template <ElementType T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    Constant{0}.fill(tensor, gen);
  }
};
struct One {
  std::string name() const { return "initializer::One()"; }
  template <ElementType T>
  void fill(BasicTensor<T>& tensor, Generator& gen) const {
    Constant{1}.fill(tensor, gen);
  }
};

// Any initialiser of T, held by value: what a layer option such as nn::Dense's weight_init
// stores, so that it takes the built-in ones and a user's alike.
template <ElementType T>
class AnyInitializer {
 public:
  template <class I>
    requires(!std::is_same_v<std::remove_cvref_t<I>, AnyInitializer> && Initializer<std::remove_cvref_t<I>, T>)
  AnyInitializer(I&& init)  // NOLINT(google-explicit-constructor): `.weight_init = HeNormal{}` reads best
      : name_(init.name()),
        fill_([held = std::forward<I>(init)](BasicTensor<T>& tensor, Generator& gen) { held.fill(tensor, gen); }) {}

  void fill(BasicTensor<T>& tensor, Generator& gen) const { fill_(tensor, gen); }
  std::string name() const { return name_; }

 private:
  std::string name_;
  std::function<void(BasicTensor<T>&, Generator&)> fill_;
};

// Overwrites every element of `tensor` (a parameter too: the write moves its version, so no
// stale packed copy of it is used) with values from `init`, drawn from `gen`.
template <ElementType T, class I>
void initialize(BasicTensor<T>& tensor, const I& init, Generator& gen) {
  static_assert(Initializer<I, T>,
                "duet::initializer::initialize: this initialiser cannot fill a tensor of this element type (the "
                "random ones fill float and double tensors; a user's initialiser needs "
                "`void fill(BasicTensor<T>&, Generator&) const` and `std::string name() const`)");
  if constexpr (Initializer<I, T>) init.fill(tensor, gen);  // no second error after the assertion
}

// initialize() for a layer's option (weight_init, bias_init): an initialiser's ValueError is
// rethrown naming the layer and the option ("nn::Dense<4, 2> weight_init: ...").
template <ElementType T, class I>
void initialize_option(BasicTensor<T>& tensor, const I& init, Generator& gen, const std::string& layer,
                       const char* option) {
  try {
    initialize(tensor, init, gen);
  } catch (const ValueError& e) {
    throw ValueError(layer + " " + option + ": " + e.what());
  }
}

// The same, drawing from the global generator (set_seed).
template <ElementType T, class I>
void initialize(BasicTensor<T>& tensor, const I& init) {
  with_global_generator([&](Generator& gen) { initialize(tensor, init, gen); });
}

// A new tensor of `shape` made by `init` from the global generator (MindSpore's
// initializer(init, shape, dtype)): nn::Parameter(initializer<float>(HeNormal{}, {out, in})).
template <ElementType T = float, class I>
BasicTensor<T> initializer(const I& init, const Shape& shape) {
  auto tensor = BasicTensor<T>::uninitialized(shape);
  initialize(tensor, init);
  return tensor;
}

}  // namespace duet::initializer
// Checkpoints: a cell's parameters in one file (MindSpore's save_checkpoint / load_checkpoint),
// and optionally its optimiser's state, so that training can resume.
//
// Format, version 3; every integer is little-endian:
//
//   size           field
//   8              magic "DUETCKPT"
//   4              u32 version: 3
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
//   4              u32 number of generators (present with the optimiser's state only): the
//                  random streams of the cells that draw while they train (nn::Dropout's masks)
//   per generator, in the cell's order:
//     4            u32 name length, then the name: "generator.<the cell's path>",
//                  "generator.classifier.1" ("generator" for a root cell)
//     8 × 4        u64 the four words of its xoshiro256** state, not all zero
//     1            u8 1 when a second normal draw is pending, else 0
//     8            f64 that draw (0 when none), finite
//   4              u32 CRC-32 (zlib's crc32) of every byte before it
//
// Version 2 is the same without the generators, and version 1 without the optimiser's state
// either (the checksum follows the parameters' records); both are still read. Resuming from a
// version 2 file leaves the generators as they are, so a network with Dropout then draws other
// masks than the run that saved it.
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
#include <cmath>
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

#include <algorithm>
#include <cmath>
#include <concepts>
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
    require_all_reduced(pass, ".step()");
    require_learning_rate();
    begin_step();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i]->has_grad_from(pass)) update(i, params_[i]->grad.data());
    }
    ++global_step_;
  }

  // MindSpore's optimizer(grads): one gradient per parameter, in order.
  void operator()(const std::vector<BasicTensor<T>>& grads) {
    if (!is_all_reduced_set(grads)) require_all_reduced(duet::detail::current_backward_pass(), "(grads)");
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
    require_learning_rate();
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
  // A bad hyper-parameter is refused where it is written, not found later as a loss that
  // diverges or never moves: "nn::Adam: learning_rate must be >= 0, got -1". Every optimiser
  // checks its options through this, from its constructor (type_name() names it there).
  void require_option(std::string_view option, double value, bool valid, std::string_view rule,
                      std::string_view when = {}) const {
    if (valid && std::isfinite(value)) return;
    throw ValueError(std::string(type_name()) + ": " + std::string(option) + " must be " +
                     (std::isfinite(value) ? "" : "finite and ") + std::string(rule) + ", got " +
                     duet::detail::chars_of(value) + std::string(when));
  }
  // A schedule is a function, so its rate is checked at every step as well as at construction.
  void require_learning_rate() const {
    const double lr = learning_rate();
    if (lr >= 0 && std::isfinite(lr)) return;  // the step's text is made only for the error: no allocation
    require_option("learning_rate", lr, false, ">= 0", global_step_ == 0 ? "" : " at step " + std::to_string(global_step_));
  }

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

 private:
  // In DATA_PARALLEL an update must use gradients all-reduced across the ranks (nn::TrainOneStepCell
  // does it), or each rank would move its parameters its own way, with no error anywhere.
  void require_all_reduced(std::uint64_t pass, const char* call) const {
    if (duet::detail::parallel_mode().load(std::memory_order_relaxed) == ParallelMode::DATA_PARALLEL &&
        duet::detail::all_reduced_backward_pass() != pass) {
      throw ModeError(std::string(type_name()) + call +
                      ": DATA_PARALLEL, but the gradients of the last backward pass were not all-reduced across the "
                      "ranks; train with nn::TrainOneStepCell, or pass them through duet::distributed::GradReducer");
    }
  }

  // Whether grads are those distributed::GradReducer returned since the last backward pass
  // (their elements, since the vector may have been copied).
  static bool is_all_reduced_set(const std::vector<BasicTensor<T>>& grads) {
    if constexpr (std::same_as<T, float>) {
      const duet::detail::ReducedGradients& set = duet::detail::all_reduced_gradient_set();
      return set.pass == duet::detail::current_backward_pass() && !grads.empty() &&
             std::ranges::equal(grads, set.data, [](const Tensor& g, const float* d) { return g.data() == d; });
    } else {
      return false;
    }
  }
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
    // As MindSpore's nn.SGD: momentum may exceed 1 (it diverges, but is not refused).
    this->require_learning_rate();
    this->require_option("momentum", config_.momentum, config_.momentum >= 0, ">= 0");
    this->require_option("momentum", config_.momentum, !config_.nesterov || config_.momentum > 0, "> 0 with nesterov");
    this->require_option("dampening", config_.dampening, config_.dampening >= 0, ">= 0");
    this->require_option("weight_decay", config_.weight_decay, config_.weight_decay >= 0, ">= 0");
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
    this->require_learning_rate();
    this->require_option("beta1", config_.beta1, config_.beta1 >= 0 && config_.beta1 < 1, "in [0, 1)");
    this->require_option("beta2", config_.beta2, config_.beta2 >= 0 && config_.beta2 < 1, "in [0, 1)");
    this->require_option("eps", config_.eps, config_.eps > 0, "> 0");
    this->require_option("weight_decay", config_.weight_decay, config_.weight_decay >= 0, ">= 0");
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
  std::vector<std::string> generators;  // "generator.<cell path>", saved with the optimiser's state
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
inline constexpr std::uint32_t checkpoint_version = 3;
// Magic, version, count; the checksum; each record's name length, type and rank; the
// optimiser section's name length, then its step and count when there is one, and the
// generators' count; each generator's name length and state.
inline constexpr std::uint64_t checkpoint_header_bytes = 8 + 4 + 4;
inline constexpr std::uint64_t checkpoint_optimizer_bytes = 4;
inline constexpr std::uint64_t checkpoint_optimizer_state_bytes = 8 + 4;
inline constexpr std::uint64_t checkpoint_checksum_bytes = 4;
inline constexpr std::uint64_t checkpoint_record_header_bytes = 4 + 1 + 1;
inline constexpr std::uint64_t checkpoint_generators_bytes = 4;
inline constexpr std::uint64_t checkpoint_generator_bytes = 4 + 8 * 4 + 1 + 8;

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
// temporary file is removed if the writer is destroyed before commit. `where` names the file
// in messages ("checkpoint '<path>'"); safetensors files are written the same way.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::filesystem::path& path, const std::string& where) : path_(path), where_(where) {
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
  void u64(std::uint64_t v) { little_endian<8>(v); }

  // CRC-32 of every byte written so far.
  std::uint32_t checksum() const { return static_cast<std::uint32_t>(crc_); }

  // Makes the file durable and renames it over the destination.
  void commit() {
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

// A whole file; `where` names it in messages. The buffer is sized by the file's size on disk,
// and grows with what arrives when that is unknown or the file grows meanwhile, so a file costs
// what it holds, whatever its fields claim.
inline std::vector<unsigned char> read_whole_file(const std::filesystem::path& path, const std::string& where) {
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  const std::unique_ptr<std::FILE, Closer> file(std::fopen(path.c_str(), "rb"));
  if (file == nullptr) throw IOError(where + ": cannot open: " + system_message());
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
      if (std::ferror(file.get()) != 0) throw IOError(where + ": read failed: " + system_message());
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

  // A version 3 file's generators, their count first.
  std::vector<std::pair<std::string_view, GeneratorState>> generators() {
    const auto count = little_endian(4, "the generator count");
    std::vector<std::pair<std::string_view, GeneratorState>> out;
    std::unordered_set<std::string_view> seen;
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::string what = "generator #" + std::to_string(i);
      const auto name = text(static_cast<std::size_t>(little_endian(4, what + "'s name length")), what + "'s name");
      const std::string who = "generator " + shown_name(name);
      GeneratorState state;
      for (std::size_t w = 0; w < state.words.size(); ++w) {
        state.words[w] = little_endian(8, who + "'s word " + std::to_string(w));
      }
      const auto pending = little_endian(1, who + "'s pending-draw flag");
      state.spare = std::bit_cast<double>(little_endian(8, who + "'s pending draw"));
      std::string wrong;
      if (state.words == decltype(state.words){}) wrong = "all-zero words, which would draw only zeros";
      else if (pending > 1) wrong = "a pending-draw flag of " + std::to_string(pending) + ", not 0 or 1";
      else if (!std::isfinite(state.spare)) wrong = "a pending draw that is not finite";
      if (!wrong.empty()) throw FormatError(where_ + ": malformed: " + who + " has " + wrong);
      state.has_spare = pending == 1;
      if (!seen.insert(name).second) throw FormatError(where_ + ": " + who + " appears twice in the file");
      out.emplace_back(name, state);
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
  std::vector<std::pair<std::string_view, GeneratorState>> generators;
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
      if (file.version >= 3) file.generators = in.generators();
    }
  }
  if (in.remaining() != 0) {
    throw FormatError(where + ": malformed: " + std::to_string(in.remaining()) + " unexpected bytes at byte " +
                      std::to_string(in.position()) + ", after the " +
                      (file.optimizer.empty() ? "parameters" : file.version >= 3 ? "generators" : "optimizer state"));
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
  std::vector<std::string> generators;
  for (const auto& g : file.generators) generators.emplace_back(g.first);
  return {file.version, entries_of(file.parameters), std::string(file.optimizer), file.global_step,
          entries_of(file.optimizer_state), std::move(generators)};
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

// What a checkpoint saved with an optimiser holds beside the parameters.
template <ElementType T>
struct TrainingTargets {
  std::string_view optimizer;  // its type name; empty for a checkpoint of parameters only
  std::int64_t global_step = 0;
  std::vector<CheckpointTarget<T>> state;
  std::vector<NamedGenerator> generators;
};

// The size of a checkpoint of these tensors: a shorter file that fails its checksum is taken
// as cut.
template <ElementType T>
std::uint64_t checkpoint_size(const std::vector<CheckpointTarget<T>>& parameters, const TrainingTargets<T>& training = {}) {
  std::uint64_t size = checkpoint_header_bytes + records_size(parameters) + checkpoint_optimizer_bytes +
                       checkpoint_checksum_bytes;
  if (training.optimizer.empty()) return size;
  size += training.optimizer.size() + checkpoint_optimizer_state_bytes + records_size(training.state) +
          checkpoint_generators_bytes;
  for (const auto& g : training.generators) size += checkpoint_generator_bytes + g.name.size();
  return size;
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
                      const TrainingTargets<T>& training = {}) {
  CheckpointWriter out(path, checkpoint_where(path));
  out.bytes(std::as_bytes(std::span(checkpoint_magic)));
  out.u32(checkpoint_version);
  write_records(out, parameters);
  out.u32(static_cast<std::uint32_t>(training.optimizer.size()));
  if (!training.optimizer.empty()) {
    out.bytes(std::as_bytes(std::span(training.optimizer)));
    out.i64(training.global_step);
    write_records(out, training.state);
    out.u32(static_cast<std::uint32_t>(training.generators.size()));
    for (const auto& [name, generator] : training.generators) {
      out.u32(static_cast<std::uint32_t>(name.size()));
      out.bytes(std::as_bytes(std::span(name)));
      const GeneratorState state = generator->state();
      for (std::uint64_t word : state.words) out.u64(word);
      out.u8(state.has_spare ? 1 : 0);
      out.u64(std::bit_cast<std::uint64_t>(state.spare));
    }
  }
  out.u32(out.checksum());
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

// A strict match's names: those only the file has (`unknown`) and those only the holder has.
inline void check_all_matched(const std::vector<std::string_view>& unknown, const std::vector<std::string_view>& missing,
                              const MatchWords& words, const std::string& where) {
  if (unknown.empty() && missing.empty()) return;
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
  } else {
    check_all_matched(unknown, missing, words, where);
  }
  return source;
}

// For each generator, its state in the file. A version 2 file holds none: the generators are
// left as they are (nullptr). Otherwise the names must be the cell's, all of them.
inline std::vector<const GeneratorState*> match_generators(const ParsedCheckpoint& file,
                                                           const std::vector<NamedGenerator>& generators,
                                                           const std::string& where) {
  std::vector<const GeneratorState*> source(generators.size(), nullptr);
  if (file.version < 3) return source;
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < generators.size(); ++i) index.emplace(generators[i].name, i);
  std::vector<std::string_view> unknown;
  for (const auto& [name, state] : file.generators) {
    const auto found = index.find(name);
    if (found == index.end()) unknown.push_back(name);
    else source[found->second] = &state;
  }
  std::vector<std::string_view> missing;
  for (std::size_t i = 0; i < generators.size(); ++i) {
    if (source[i] == nullptr) missing.push_back(generators[i].name);
  }
  check_all_matched(unknown, missing, {"generator", "the cell"}, where);
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

// The same with the optimiser's state and the generators, which must match as strictly as the
// parameters.
template <ElementType T>
void load_training_state(std::span<const unsigned char> bytes, const std::vector<CheckpointTarget<T>>& parameters,
                         nn::BasicOptimizer<T>& optimizer, const TrainingTargets<T>& training,
                         const std::string& where) {
  const std::string_view type = training.optimizer;
  const ParsedCheckpoint file = parse_checkpoint(bytes, checkpoint_size(parameters, training), where);
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
  const auto state_source = match_records(file.optimizer_state, training.state,
                                          {"optimizer state", "the " + std::string(type)}, where, nullptr);
  const auto generator_source = match_generators(file, training.generators, where);
  copy_records(bytes, parameters, parameter_source);
  copy_records(bytes, training.state, state_source);
  optimizer.set_global_step(file.global_step);
  for (std::size_t i = 0; i < generator_source.size(); ++i) {
    if (generator_source[i] != nullptr) training.generators[i].generator->set_state(*generator_source[i]);
  }
}

// What save_checkpoint(cell, path, optimizer) saves beside the parameters, and a load restores.
template <ElementType T>
TrainingTargets<T> training_targets(nn::BasicDynamicCell<T>& cell, const std::vector<CheckpointTarget<T>>& parameters,
                                    nn::BasicOptimizer<T>& optimizer, const std::string& where) {
  return {optimizer.type_name(), optimizer.global_step(), optimizer_targets(parameters, optimizer, where),
          named_generators(cell)};
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
// parameter, its moments or momentum, named by the cell's parameter names) and of the
// generators its Dropout layers draw masks from, so that load_checkpoint(path, net, optimizer)
// resumes training where it stopped, in a new process too, bit for bit. Every parameter the
// optimiser updates must be one of cell's (a ValueError otherwise).
template <ElementType T>
void save_checkpoint(nn::BasicDynamicCell<T>& cell, const std::filesystem::path& path,
                     nn::BasicOptimizer<T>& optimizer) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  detail::write_checkpoint(path, parameters, detail::training_targets(cell, parameters, optimizer, where));
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
  return detail::load_parameters(std::span<const unsigned char>(detail::read_whole_file(path, where)), parameters,
                                 options, where);
}

// Reads a checkpoint saved with an optimiser into cell and optimizer, strictly: parameters,
// optimiser type (nn::Adam is not nn::AdamW), every state tensor and the Dropout layers'
// generators must match, or a FormatError names the difference and nothing changes (a
// version 2 file holds no generators and leaves them as they are). The optimiser's hyper-parameters
// (learning rate or schedule, betas, momentum) are its own, not the file's; its step count
// comes from the file, so a schedule goes on from where it was.
template <ElementType T>
void load_checkpoint(const std::filesystem::path& path, nn::BasicDynamicCell<T>& cell,
                     nn::BasicOptimizer<T>& optimizer) {
  const std::string where = detail::checkpoint_where(path);
  const auto parameters = detail::parameter_targets(cell, where);
  detail::load_training_state(std::span<const unsigned char>(detail::read_whole_file(path, where)), parameters,
                              optimizer, detail::training_targets(cell, parameters, optimizer, where), where);
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
  detail::load_training_state(detail::unsigned_bytes(bytes), parameters, optimizer,
                              detail::training_targets(cell, parameters, optimizer, where), where);
}

// What a checkpoint file holds, checked as a load checks it (checksum, every field), with no
// cell needed: a FormatError or IOError otherwise.
inline CheckpointInfo checkpoint_info(const std::filesystem::path& path) {
  const std::string where = detail::checkpoint_where(path);
  return detail::info_of(detail::read_whole_file(path, where), where);
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
#include <tuple>
#include <type_traits>
#include <utility>

#include <unsupported/Eigen/SpecialFunctions>  // erf, for the exact GELU


namespace duet {

namespace fn {

// Whether Fn's derivative is computed from its input (Fn::grad_array(dy, x)) rather than from
// its output (Fn::grad_array(dy, y)), as for log or abs, whose input the output does not give.
template <class Fn>
inline constexpr bool grad_from_input = requires { requires Fn::grad_from_input; };

struct Relu {
  static constexpr std::string_view name = "ReLU";
  static ops::InterchangeNode interchange() { return {"Relu", {}, {}}; }
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

// The activations below have no vector form, so a product runs them as the map kernel after
// the finished product rather than in its registers (backend::Native::dense); only ReLU takes
// the register path. Those differentiated from their output (sigmoid, tanh, LeakyReLU, ELU,
// softplus) also fuse into a product in a graph being trained; GELU and SiLU need their
// input, and stay nodes of their own there.

// 1 / (1 + exp(-x)); derivative y (1 - y).
struct Sigmoid {
  static constexpr std::string_view name = "Sigmoid";
  static ops::InterchangeNode interchange() { return {"Sigmoid", {}, {}}; }
  template <class A>
  static auto array(const A& a) {
    return a.logistic();
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * (y * (S(1) - y));
  }
};

// Derivative 1 - y².
struct Tanh {
  static constexpr std::string_view name = "Tanh";
  static ops::InterchangeNode interchange() { return {"Tanh", {}, {}}; }
  template <class A>
  static auto array(const A& a) {
    return a.tanh();
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * (S(1) - y.square());
  }
};

// x Φ(x), Φ the standard normal distribution: exactly, 0.5 x (1 + erf(x / √2)), or with
// Approximate, 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))) (MindSpore's approximate=True,
// PyTorch's approximate='tanh').
template <bool Approximate>
struct Gelu {
  static constexpr std::string_view name = Approximate ? "GELU(tanh)" : "GELU(erf)";
  static constexpr bool grad_from_input = true;
  static constexpr double sqrt_2_over_pi = 0.7978845608028654;
  static constexpr double inv_sqrt_2 = 0.7071067811865476;
  static constexpr double inv_sqrt_2pi = 0.3989422804014327;
  static constexpr double cubic = 0.044715;

  template <class A>
  static auto inner(const A& a) {
    using S = typename A::Scalar;
    return S(sqrt_2_over_pi) * (a + S(cubic) * a.cube());
  }
  template <class A>
  static auto array(const A& a) {
    using S = typename A::Scalar;
    if constexpr (Approximate) return S(0.5) * a * (S(1) + inner(a).tanh());
    else return S(0.5) * a * (S(1) + (a * S(inv_sqrt_2)).erf());
  }
  // Φ(x) + x φ(x), or for the tanh form with t = tanh(u(x)):
  // 0.5 (1 + t) + 0.5 x (1 - t²) u'(x), u'(x) = √(2/π) (1 + 3 · 0.044715 x²).
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    if constexpr (Approximate) {
      const auto t = inner(x).tanh();
      return dy * (S(0.5) * (S(1) + t) +
                   S(0.5) * x * (S(1) - t.square()) * (S(sqrt_2_over_pi) * (S(1) + S(3 * cubic) * x.square())));
    } else {
      return dy * (S(0.5) * (S(1) + (x * S(inv_sqrt_2)).erf()) + S(inv_sqrt_2pi) * x * (S(-0.5) * x.square()).exp());
    }
  }
};

// x · sigmoid(x) (MindSpore's SiLU, also called swish); derivative s (1 + x (1 - s)).
struct Silu {
  static constexpr std::string_view name = "SiLU";
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a * a.logistic();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    const auto s = x.logistic();
    return dy * (s * (S(1) + x * (S(1) - s)));
  }
};

// The activations with a parameter keep it as a member; ops::leaky_relu and friends check it.
// Their derivative is read off the output, which tells which side of 0 the input was on only
// for alpha >= 0: a negative alpha is refused where the function is made.
inline void check_alpha(double alpha, const std::string& who) {
  if (!(alpha >= 0)) {
    throw ValueError(who + ": alpha must be at least 0 (its gradient is taken from its output), got " +
                     std::to_string(alpha));
  }
}

// x for x > 0, alpha x otherwise; the derivative at 0 is alpha, as PyTorch's.
struct LeakyRelu {
  static constexpr std::string_view name = "LeakyReLU";
  ops::InterchangeNode interchange() const { return {"LeakyRelu", {}, {ops::InterchangeAttribute::of_real("alpha", alpha)}}; }
  double alpha = 0.2;
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    return (a > S(0)).select(a, a * static_cast<S>(alpha));
  }
  template <class G, class Y>
  auto grad_array(const G& dy, const Y& y) const {
    using S = typename Y::Scalar;
    return (y > S(0)).select(dy, dy * static_cast<S>(alpha));
  }
};

// x for x > 0, alpha (exp(x) - 1) otherwise; the derivative there is y + alpha.
struct Elu {
  static constexpr std::string_view name = "ELU";
  ops::InterchangeNode interchange() const { return {"Elu", {}, {ops::InterchangeAttribute::of_real("alpha", alpha)}}; }
  double alpha = 1.0;
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    return (a > S(0)).select(a, static_cast<S>(alpha) * a.expm1());
  }
  template <class G, class Y>
  auto grad_array(const G& dy, const Y& y) const {
    using S = typename Y::Scalar;
    return (y > S(0)).select(dy, dy * (y + static_cast<S>(alpha)));
  }
};

// log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (MindSpore's and
// PyTorch's softplus, which turn linear there to keep exp from overflowing). The derivative,
// sigmoid(beta x) or 1 on the linear side, comes from the input: the output cannot tell the
// sides apart just below the threshold, where log1p(exp(beta x)) already exceeds it.
struct Softplus {
  static constexpr std::string_view name = "Softplus";
  static constexpr bool grad_from_input = true;
  double beta = 1.0;
  double threshold = 20.0;
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    const S b = static_cast<S>(beta);
    return (a * b > static_cast<S>(threshold)).select(a, (a * b).exp().log1p() / b);
  }
  template <class G, class X>
  auto grad_array(const G& dy, const X& x) const {
    using S = typename X::Scalar;
    const S b = static_cast<S>(beta);
    return (x * b > static_cast<S>(threshold)).select(dy, dy * (x * b).logistic());
  }
};

}  // namespace fn

namespace ops {

template <class Fn>
struct MapGradOp;

// Whether an elementwise function says what it is in ONNX (MapOp::interchange).
template <class Fn>
inline constexpr bool has_interchange = requires(const Fn& f) { f.interchange(); };

// Fns applied elementwise, in order, in one pass. Capture makes one per function; O1 fuses
// chains (relu(tanh(x)) is one MapOp<Tanh, Relu>), and products absorb them as epilogues.
template <class... Fns>
struct MapOp : Primitive<MapOp<Fns...>> {
  static_assert(sizeof...(Fns) >= 1);
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;

  // The functions' parameters (LeakyReLU's alpha), if they have any. They are values held
  // by the node rather than template arguments: a float cannot be one under clang 14, and
  // nn::LeakyReLU(alpha) takes its alpha at run time, as MindSpore's does.
  std::tuple<Fns...> fns{};
  MapOp() = default;
  explicit MapOp(std::tuple<Fns...> f) : fns(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::map(fns, a.in<T>(), a.in_shape().numel(), a.out<T>());
  }

  template <class C>
  static constexpr bool accepts_epilogue = requires { C::elementwise_functions; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return MapOp<Fns..., Gs...>{std::tuple_cat(fns, next.fns)};
  }
  static constexpr auto elementwise_functions = sizeof...(Fns);
  // Whether the functions have no parameters, so that an op keeping only their types (the
  // arithmetic ops' epilogues) runs them as this one does.
  static constexpr bool parameterless = (std::is_empty_v<Fns> && ...);

  // A single function is differentiated from its output; a fused chain would need the values
  // between its functions, which it never stores.
  static constexpr bool differentiable = sizeof...(Fns) == 1;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return MapGradOp<Fns...>{std::get<0>(fns)};
  }

  static std::string op_name() {
    std::string s;
    ((s += s.empty() ? "" : " + ", s += Fns::name), ...);
    return s;
  }

  // ONNX: a node per function, each function saying what it is (fn::Relu::interchange); empty
  // if one does not.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr ((has_interchange<Fns> && ...)) {
      Interchange nodes;
      std::apply([&](const auto&... f) { (nodes.push_back(f.interchange()), ...); }, fns);
      for (std::size_t k = 0; k < nodes.size(); ++k) {
        nodes[k].inputs = {k == 0 ? InterchangeInput::operand(0) : InterchangeInput::node(k - 1)};
      }
      return nodes;
    } else {
      return {};
    }
  }
};

// dx = dy · Fn'(x), from dy and the forward output y (or its input x, fn::grad_from_input).
template <class Fn>
struct MapGradOp : Primitive<MapGradOp<Fn>> {
  static constexpr std::array reads{graph::Operand::grad,
                                    fn::grad_from_input<Fn> ? graph::Operand::input0 : graph::Operand::output};
  static constexpr int arity = 2;

  Fn fn{};
  MapGradOp() = default;
  explicit MapGradOp(Fn f) : fn(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::map_grad(fn, a.in<T>(0), a.in<T>(1), a.in_shape().numel(), a.out<T>());
  }

  static std::string op_name() { return std::string(Fn::name) + "Grad"; }
};

template <class X>
auto relu(X&& x) {
  return apply(MapOp<fn::Relu>{}, std::forward<X>(x));
}

template <class X>
auto sigmoid(X&& x) {
  return apply(MapOp<fn::Sigmoid>{}, std::forward<X>(x));
}
template <class X>
auto tanh(X&& x) {
  return apply(MapOp<fn::Tanh>{}, std::forward<X>(x));
}
// MindSpore's ops.gelu(x, approximate='none'): gelu(x) is the exact (erf) form,
// gelu<true>(x) the tanh form. A template argument: the two are different graph nodes.
template <bool Approximate = false, class X>
auto gelu(X&& x) {
  return apply(MapOp<fn::Gelu<Approximate>>{}, std::forward<X>(x));
}
template <class X>
auto silu(X&& x) {
  return apply(MapOp<fn::Silu>{}, std::forward<X>(x));
}
template <class X>
auto leaky_relu(X&& x, double alpha = 0.2) {
  fn::check_alpha(alpha, "ops::leaky_relu");
  return apply(MapOp<fn::LeakyRelu>{std::tuple{fn::LeakyRelu{alpha}}}, std::forward<X>(x));
}
template <class X>
auto elu(X&& x, double alpha = 1.0) {
  fn::check_alpha(alpha, "ops::elu");
  return apply(MapOp<fn::Elu>{std::tuple{fn::Elu{alpha}}}, std::forward<X>(x));
}
template <class X>
auto softplus(X&& x, double beta = 1.0, double threshold = 20.0) {
  if (!(beta > 0)) throw ValueError("ops::softplus: beta must be positive, got " + std::to_string(beta));
  return apply(MapOp<fn::Softplus>{std::tuple{fn::Softplus{beta, threshold}}}, std::forward<X>(x));
}

inline const bool activations_listed =
    list_operations({"relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu", "leaky_relu", "elu", "softplus"});

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

// An activation layer: Fn elementwise, with Fn's parameters given to the constructor
// (nn::LeakyReLU(0.1), nn::Softplus(2.0, 10.0)), checked as the ops:: functions check them.
template <class Fn, ElementType T = float>
class Activation : public Cell<Activation<Fn, T>, CONTEXT_MODE, T> {
 public:
  Activation() = default;
  template <class P, class... Ps>
    requires(std::is_arithmetic_v<P> && (std::is_arithmetic_v<Ps> && ...))
  explicit Activation(P p, Ps... ps) : fn_{static_cast<double>(p), static_cast<double>(ps)...} {
    if constexpr (requires { fn_.alpha; }) fn::check_alpha(fn_.alpha, "nn::" + std::string(Fn::name));
    if constexpr (requires { fn_.beta; }) {
      if (!(fn_.beta > 0)) throw ValueError(type_name() + ": beta must be positive, got " + std::to_string(fn_.beta));
    }
  }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::MapOp<Fn>{std::tuple{fn_}}, std::forward<X>(x));
  }
  std::string type_name() const override { return "nn::" + std::string(Fn::name); }

 private:
  Fn fn_{};
};

// MindSpore's activation cells.
using Sigmoid = Activation<fn::Sigmoid>;
using Tanh = Activation<fn::Tanh>;
using GELU = Activation<fn::Gelu<true>>;  // MindSpore's nn.GELU(approximate=True), its default
using GELUExact = Activation<fn::Gelu<false>>;  // nn.GELU(approximate=False)
using SiLU = Activation<fn::Silu>;
using LeakyReLU = Activation<fn::LeakyRelu>;  // alpha 0.2 by default, as MindSpore's
using ELU = Activation<fn::Elu>;              // alpha 1.0
using Softplus = Activation<fn::Softplus>;    // beta 1, threshold 20

}  // namespace nn
}  // namespace duet
// Batch normalisation: nn::BatchNorm1d, nn::BatchNorm2d and the operations they capture.
//
// Layout NCL / NCHW: the statistics of channel c are taken over every axis but axis 1. Each
// channel's elements lie in `batch` contiguous runs of `spatial` elements (one per sample),
// which the kernels read as Eigen arrays, so they vectorise without a transposed copy.
// Measured (g++ 12 -O2, no -march, one core of the project's AMD EPYC, medians of 21, while
// other jobs shared the machine): [32, 64, 28, 28] float, training (two passes for the
// statistics, one to normalise) 1.49 ms, evaluation 0.58 ms, against 0.17 ms for a memcpy of
// the input and 21 ms for the same statistics in plain loops in double. BatchNorm1d on [N, C]
// has runs of one element, so it goes channel by channel with strided reads (not vectorised
// across channels; a row-wise form would need scratch for C statistics).
//
// Training (set_train()) normalises with the batch's statistics, mean and biased variance,
// and moves the moving statistics towards them; evaluation normalises with the moving
// statistics and leaves them alone. Both are the same kernels in both modes, so the outputs,
// the gradients and the moving statistics agree bit for bit. A training step that fails after
// the forward pass ran puts the moving statistics back (duet::detail::StepState).
//
// Folding into a convolution (graph mode at evaluation, O1 and O2): an evaluation BatchNorm is
// the per-channel affine map y = x · scale + shift of BatchNorm::evaluation_affine(), which
// passes::fuse_epilogues (and PIJit's fusion, through ops::EvaluationNorm) folds into the
// weight and bias of the convolution before it (W'[c] = W[c] · scale[c], b'[c] = b[c] ·
// scale[c] + shift[c]) when it meets (Conv, BatchNormOp<Layer, Phase::eval>): ops/conv.hpp's
// ConvEpilogueOp. Only the evaluation
// form has that node type, so training is never folded. The folded weight is the conv
// weight's derived() form, remade when the weight, the bias or any of this layer's four
// tensors changes version().

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

// What the operations of layers that differ between training and evaluation share
// (nn::BatchNorm1d/2d, nn::Dropout): the phase they were made for, and the check that their
// layer is still set to it when they run.
//
// Such a layer appends the operation of its input's phase in graph capture (graph::phase_of),
// and of its own setting (set_train) in PyNative mode. Graph mode runs the form its layers ask
// for (pipeline::in_requested_phase, which reads requested_phase()); the check below refuses a
// form that one of its layers no longer agrees with (a layer switched alone, whose network was
// captured in the other phase) rather than running it stale.

#include <string>
#include <utility>


namespace duet::ops {

// The base of such an operation, made for phase P by `layer`.
template <class Layer, graph::Phase P>
struct PhaseOf {
  static constexpr graph::Phase phase = P;

  Layer* layer;
  explicit PhaseOf(Layer* l) : layer(l) {}

  graph::Phase requested_phase() const { return layer->training() ? graph::Phase::train : graph::Phase::eval; }
  std::string layer_label() const { return layer->label(); }

  // Called first by the operation's kernel.
  void check_phase() const {
    if (requested_phase() == P) return;
    throw ModeError(layer->label() + " is set to " + (layer->training() ? "train" : "evaluate") +
                    " (set_train), but runs in a graph captured for " +
                    (P == graph::Phase::train ? "training" : "evaluation") +
                    "; graph mode captures a network in one phase, which all its layers must share: call "
                    "set_train on the whole network, or run it in PyNative mode");
  }
};

// What such a layer's construct does: applies Op<Layer, P> to x, P being x's phase in graph
// capture, and the layer's setting on a tensor (PyNative).
template <template <class, graph::Phase> class Op, class Layer, class X>
auto apply_in_phase(Layer* layer, X&& x) {
  if constexpr (graph::Symbolic<X>) {
    return apply(Op<Layer, graph::phase_of<X>()>{layer}, x);
  } else if (layer->training()) {
    return apply(Op<Layer, graph::Phase::train>{layer}, std::forward<X>(x));
  } else {
    return apply(Op<Layer, graph::Phase::eval>{layer}, std::forward<X>(x));
  }
}

}  // namespace duet::ops

namespace duet {
namespace ops {

template <class Layer, graph::Phase P, bool InputGrad>
struct BatchNormGradOp;

namespace detail {

// Where channel c's elements are: `batch` runs of `spatial` elements, run n starting at
// (n · channels + c) · spatial.
struct ChannelRuns {
  index_t batch;
  index_t channels;
  index_t spatial;

  explicit ChannelRuns(const Shape& x) : batch(x[0]), channels(x[1]), spatial(1) {
    for (int a = 2; a < x.rank(); ++a) spatial *= x[a];
  }
  index_t count() const { return batch * spatial; }
  index_t offset(index_t n, index_t c) const { return (n * channels + c) * spatial; }

  // f(run) for each run of channel c, run being an Eigen map of its elements in data.
  template <class T, class F>
  void for_each_run(T* data, index_t c, F&& f) const {
    using Array = ::Eigen::Array<std::remove_const_t<T>, ::Eigen::Dynamic, 1>;
    using Map = std::conditional_t<std::is_const_v<T>, ::Eigen::Map<const Array>, ::Eigen::Map<Array>>;
    for (index_t n = 0; n < batch; ++n) f(Map(data + offset(n, c), spatial));
  }
};

// Channel c's batch mean and biased variance, the variance taken around the mean in a second
// pass (no digits lost to E[x²] - E[x]² when the mean is large against the spread).
template <class T>
struct ChannelStatistics {
  T mean;
  T variance;
};

template <class T>
ChannelStatistics<T> channel_statistics(const T* x, const ChannelRuns& runs, index_t c) {
  const T count = static_cast<T>(runs.count());
  T sum = 0;
  runs.for_each_run(x, c, [&](const auto& run) { sum += run.sum(); });
  const T mean = sum / count;
  T squares = 0;
  runs.for_each_run(x, c, [&](const auto& run) { squares += (run - mean).square().sum(); });
  return {mean, squares / count};
}

// y = (x - mean) · scale + beta over channel c, scale being gamma / sqrt(var + eps).
template <class T>
void normalize(const T* x, T* y, const detail::ChannelRuns& runs, index_t c, T mean, T scale, T beta) {
  using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  for (index_t n = 0; n < runs.batch; ++n) {
    const index_t at = runs.offset(n, c);
    ::Eigen::Map<Array>(y + at, runs.spatial) = (::Eigen::Map<const Array>(x + at, runs.spatial) - mean) * scale + beta;
  }
}

// BatchNormOp's kernel, for a layer of any size.
template <graph::Phase P, class T, class Layer>
void batch_norm(Layer& layer, const graph::KernelArgs& a) {
  const ChannelRuns runs(a.in_shape());
  const T* x = a.in<T>();
  T* y = a.out<T>();
  const Layer& read = layer;  // reads leave the parameters' version() alone
  if constexpr (P == graph::Phase::train) {
    layer.check_batch(a.in_shape());
    const T momentum = static_cast<T>(layer.momentum());
    const T unbiased = static_cast<T>(runs.count()) / static_cast<T>(runs.count() - 1);
    duet::detail::will_change(layer);
    T* moving_mean = layer.moving_mean.data();
    T* moving_variance = layer.moving_variance.data();
    for (index_t c = 0; c < runs.channels; ++c) {
      const auto s = channel_statistics(x, runs, c);
      normalize(x, y, runs, c, s.mean, read.gamma.data()[c] / std::sqrt(s.variance + static_cast<T>(read.eps())),
                read.beta.data()[c]);
      moving_mean[c] = momentum * moving_mean[c] + (1 - momentum) * s.mean;
      moving_variance[c] = momentum * moving_variance[c] + (1 - momentum) * s.variance * unbiased;
    }
  } else {
    for (index_t c = 0; c < runs.channels; ++c) {
      normalize(x, y, runs, c, read.moving_mean.data()[c], read.evaluation_scale(c), read.beta.data()[c]);
    }
  }
}

// BatchNormGradOp's kernel: dgamma, dbeta and, if input_grad, dx (a's output) from dy and x.
template <graph::Phase P, class T, class Layer>
void batch_norm_gradient(Layer& layer, const graph::KernelArgs& a, bool input_grad) {
  using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  const ChannelRuns runs(a.in_shape(1));
  const T* dy = a.in<T>(0);
  const T* x = a.in<T>(1);
  // gamma and beta without requires_grad (affine = false) keep no gradient.
  T* dgamma = nullptr;
  T* dbeta = nullptr;
  bool accumulate_gamma = false;
  bool accumulate_beta = false;
  if (layer.gamma.requires_grad) {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    dgamma = layer.gamma.grad_for_write(pass, &accumulate_gamma);
    dbeta = layer.beta.grad_for_write(pass, &accumulate_beta);
  }
  const Layer& read = layer;  // reads leave the parameters' version() alone
  const T count = static_cast<T>(runs.count());
  const T eps = static_cast<T>(read.eps());
  for (index_t c = 0; c < runs.channels; ++c) {
    T mean;
    T rstd;
    if constexpr (P == graph::Phase::train) {
      const auto s = channel_statistics(x, runs, c);
      mean = s.mean;
      rstd = T(1) / std::sqrt(s.variance + eps);
    } else {
      mean = read.moving_mean.data()[c];
      rstd = T(1) / std::sqrt(read.moving_variance.data()[c] + eps);
    }
    T sum_dy = 0;
    T sum_dy_x_hat = 0;
    for (index_t n = 0; n < runs.batch; ++n) {
      const index_t at = runs.offset(n, c);
      const ::Eigen::Map<const Array> g(dy + at, runs.spatial);
      const ::Eigen::Map<const Array> xs(x + at, runs.spatial);
      sum_dy += g.sum();
      sum_dy_x_hat += (g * ((xs - mean) * rstd)).sum();
    }
    if (dgamma != nullptr) {
      dgamma[c] = accumulate_gamma ? dgamma[c] + sum_dy_x_hat : sum_dy_x_hat;
      dbeta[c] = accumulate_beta ? dbeta[c] + sum_dy : sum_dy;
    }
    if (input_grad) {
      const T scale = read.gamma.data()[c] * rstd;
      for (index_t n = 0; n < runs.batch; ++n) {
        const index_t at = runs.offset(n, c);
        const ::Eigen::Map<const Array> g(dy + at, runs.spatial);
        ::Eigen::Map<Array> dx(a.out<T>() + at, runs.spatial);
        if constexpr (P == graph::Phase::train) {
          const ::Eigen::Map<const Array> xs(x + at, runs.spatial);
          dx = scale * (g - sum_dy / count - (xs - mean) * rstd * (sum_dy_x_hat / count));
        } else {
          dx = scale * g;
        }
      }
    }
  }
  duet::detail::gradient_writes_done();
}

}  // namespace detail

// (x - mean) / sqrt(var + eps) · gamma + beta per channel; in training (P = train) mean and
// var are the batch's, and the layer's moving statistics move towards them; in evaluation
// they are the moving statistics.
template <class Layer, graph::Phase P>
struct BatchNormOp : Primitive<BatchNormOp<Layer, P>>, PhaseOf<Layer, P> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  explicit BatchNormOp(Layer* l) : PhaseOf<Layer, P>(l) {}

  static constexpr ShapeResult rule(index_t channels, const Shape& x) {
    if (x.leading_unknown()) return {x};
    if (x.rank() < Layer::min_rank) return fault(x, ShapeFault::min_rank, Layer::min_rank);
    if (x.rank() > Layer::max_rank) return fault(x, ShapeFault::exact_rank, Layer::max_rank);
    if (channels != dyn && x[1] != dyn && x[1] != channels) return fault(x, ShapeFault::channel_dimension, channels);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::channels_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(this->layer->num_features(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    this->check_phase();
    detail::batch_norm<P, T>(*nn::detail::runtime_form(this->layer), a);
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return BatchNormGradOp<Layer, P, true>{this->layer};
  }
  auto parameter_grad_op() const { return BatchNormGradOp<Layer, P, false>{this->layer}; }

  // What a convolution before it folds in (ops/conv.hpp), graph mode's passes and PIJit's alike.
  ops::EvaluationNorm<value_type> evaluation_norm() const
    requires(P == graph::Phase::eval)
  {
    return ops::EvaluationNorm<value_type>::of(*this->layer);
  }

  static std::string op_name() { return P == graph::Phase::train ? "BatchNorm" : "BatchNorm (moving statistics)"; }
  std::string label() const { return this->layer->label(); }

  // ONNX: BatchNormalization in inference, from the moving statistics (export_onnx traces the
  // network at evaluation).
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (P == graph::Phase::eval) {
      using I = InterchangeInput;
      const Layer& l = *this->layer;
      return {{"BatchNormalization",
               {I::operand(0), I::of_parameter(&l.gamma), I::of_parameter(&l.beta), I::of_parameter(&l.moving_mean),
                I::of_parameter(&l.moving_variance)},
               {InterchangeAttribute::of_real("epsilon", l.eps())}}};
    } else {
      return {};
    }
  }

};

// The gradient of BatchNormOp, from dy and x. With x̂ = (x - mean) · rstd and m the channel's
// count: dbeta = Σ dy, dgamma = Σ dy · x̂; in training (mean and rstd depend on x)
// dx = gamma · rstd · (dy - Σ dy / m - x̂ · Σ (dy · x̂) / m), in evaluation dx = gamma · rstd · dy.
// The statistics are taken again, by the forward's own code, so they are its bits.
template <class Layer, graph::Phase P, bool InputGrad>
struct BatchNormGradOp : Primitive<BatchNormGradOp<Layer, P, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  Layer* layer;
  explicit BatchNormGradOp(Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::batch_norm_gradient<P, T>(*nn::detail::runtime_form(layer), a, InputGrad);
  }

  static std::string op_name() {
    std::string s = P == graph::Phase::train ? "BatchNormGrad" : "BatchNormGrad (moving statistics)";
    return InputGrad ? s : s + " (parameters only)";
  }
  std::string label() const { return layer->label(); }
};

inline const bool batchnorm_listed = list_operations({"BatchNorm"});

}  // namespace ops

namespace nn {

// MindSpore's nn.BatchNorm1d (Dims = 1: input [N, C] or [N, C, L]) and nn.BatchNorm2d (Dims = 2:
// [N, C, H, W]), with their defaults: eps 1e-5, momentum 0.9, affine. C is the number of
// channels at compile time (nn::BatchNorm2d<64>), or duet::dyn for one given to the
// constructor (nn::BatchNorm2d<>(64)).
//
// Parameters, by MindSpore's names (which checkpoints and safetensors files use: "bn.gamma",
// "bn.moving_mean", ...): gamma (ones) and beta (zeros), trained unless affine is false
// (then they keep requires_grad = false, as in MindSpore); moving_mean (zeros) and
// moving_variance (ones), never trained (requires_grad = false: optimisers skip them) and
// saved and loaded with the rest. PyTorch calls them weight, bias, running_mean, running_var.
//
// momentum is MindSpore's: moving = momentum · moving + (1 - momentum) · batch. PyTorch's
// momentum is the weight of the batch instead, moving = (1 - m) · moving + m · batch, so
// PyTorch's momentum m is MindSpore's 1 - m: PyTorch's default 0.1 is MindSpore's 0.9 (and
// MindSpore 2.9 announces a switch to PyTorch's convention). The batch variance entering the
// moving one is the unbiased one (· m / (m - 1)), as in both; the batch is normalised with the
// biased one. Training needs more than one value per channel.
//
// BatchNorm2d<C> is BatchNorm2d<> with C in its type (SizedLayer): graph capture checks the
// input's channels against it while the program compiles.
template <int Dims, ElementType T>
std::string batch_norm_name(index_t channels) {
  std::string s = "nn::BatchNorm" + std::to_string(Dims) + "d<";
  s += channels == dyn ? std::string("dyn") : std::to_string(channels);
  if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
  return s + ">";
}

template <int Dims, index_t C = dyn, ElementType T = float>
class BatchNorm : public Cell<BatchNorm<Dims, C, T>, CONTEXT_MODE, T>, public duet::detail::StepState {
  static_assert(Dims == 1 || Dims == 2, "nn::BatchNorm<Dims>: Dims is 1 (BatchNorm1d) or 2 (BatchNorm2d)");

 public:
  using runtime_type = BatchNorm;
  static constexpr index_t channels_static = dyn;
  static constexpr int min_rank = Dims == 1 ? 2 : 4;
  static constexpr int max_rank = Dims == 1 ? 3 : 4;

  BasicParameter<T> gamma;            // [C]
  BasicParameter<T> beta;             // [C]
  BasicParameter<T> moving_mean;      // [C], not trained
  BasicParameter<T> moving_variance;  // [C], not trained
  DUET_CELL_MEMBERS(gamma, beta, moving_mean, moving_variance);

  explicit BatchNorm(index_t num_features, double eps = 1e-5, double momentum = 0.9, bool affine = true)
      : BatchNorm(num_features, eps, momentum, affine, false) {}

 protected:
  // A BatchNorm<Dims, C>'s, named as its type.
  BatchNorm(index_t num_features, double eps, double momentum, bool affine, bool sized)
      : features_(num_features), eps_(eps), momentum_(momentum), sized_(sized) {
    if (num_features <= 0) {
      throw ValueError(type_name() + ": cannot be built with num_features " + std::to_string(num_features));
    }
    if (!(eps > 0)) throw ValueError(type_name() + ": eps must be > 0, got " + std::to_string(eps));
    if (!(momentum >= 0 && momentum <= 1)) {
      throw ValueError(type_name() + ": momentum must be in [0, 1] (MindSpore's: the weight of the moving "
                                     "statistics), got " + std::to_string(momentum));
    }
    gamma = BasicParameter<T>(ones<T>({num_features}));
    beta = BasicParameter<T>(zeros<T>({num_features}));
    moving_mean = BasicParameter<T>(zeros<T>({num_features}));
    moving_variance = BasicParameter<T>(ones<T>({num_features}));
    gamma.requires_grad = affine;
    beta.requires_grad = affine;
    moving_mean.requires_grad = false;
    moving_variance.requires_grad = false;
  }

 public:
  index_t num_features() const { return features_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }

  // Evaluation's map per channel, y = x · scale + shift with scale = gamma / sqrt(moving_variance
  // + eps) and shift = beta - moving_mean · scale: what a convolution before it can absorb.
  using Affine = ops::AffineMap<T>;
  Affine evaluation_affine() const {
    const auto n = static_cast<std::size_t>(num_features());
    Affine a{std::vector<T>(n), std::vector<T>(n)};
    for (std::size_t c = 0; c < n; ++c) {
      a.scale[c] = evaluation_scale(static_cast<index_t>(c));
      a.shift[c] = beta.data()[c] - moving_mean.data()[c] * a.scale[c];
    }
    return a;
  }
  T evaluation_scale(index_t c) const {
    return gamma.data()[c] / std::sqrt(moving_variance.data()[c] + static_cast<T>(eps_));
  }

  // Batch statistics need two values per channel at least (the unbiased variance divides by m - 1).
  void check_batch(const Shape& x) const {
    if (ops::detail::ChannelRuns(x).count() < 2) {
      throw ValueError(this->label() + " in training needs more than one value per channel to take batch "
                                       "statistics, got an input of shape " + to_string(x) +
                       " (set_train(false) to normalise with the moving statistics)");
    }
  }

  template <class X>
  auto construct(X&& x) {
    return ops::apply_in_phase<ops::BatchNormOp>(this, std::forward<X>(x));
  }

  // Training moves the moving statistics; a step that fails puts them back.
  void save_for_step() override {
    const auto& mean = std::as_const(moving_mean);
    const auto& variance = std::as_const(moving_variance);
    saved_mean_.assign(mean.data(), mean.data() + mean.numel());
    saved_variance_.assign(variance.data(), variance.data() + variance.numel());
  }
  void restore_step() override {
    std::ranges::copy(saved_mean_, moving_mean.data());
    std::ranges::copy(saved_variance_, moving_variance.data());
  }

  bool depends_on_phase() const override { return true; }

  std::string type_name() const override { return batch_norm_name<Dims, T>(sized_ ? features_ : dyn); }

 private:
  index_t features_;
  double eps_;
  double momentum_;
  bool sized_;
  std::vector<T> saved_mean_;
  std::vector<T> saved_variance_;
};

template <int Dims, index_t C, ElementType T>
  requires(C != dyn)
class BatchNorm<Dims, C, T> : public SizedLayer<BatchNorm<Dims, C, T>, BatchNorm<Dims, dyn, T>> {
  static_assert(C > 0, "nn::BatchNorm2d<C>: C must be positive (or duet::dyn)");
  using Sized = SizedLayer<BatchNorm, BatchNorm<Dims, dyn, T>>;

 public:
  static constexpr index_t channels_static = C;

  BatchNorm() : BatchNorm(C) {}
  explicit BatchNorm(index_t num_features, double eps = 1e-5, double momentum = 0.9, bool affine = true)
      : Sized(checked(num_features), eps, momentum, affine, true) {}

  template <graph::Symbolic S>
  auto sized_construct(const S& x) {
    return ops::apply_in_phase<ops::BatchNormOp>(this, x);
  }

 private:
  static index_t checked(index_t num_features) {
    if (num_features != C) {
      throw ValueError(batch_norm_name<Dims, T>(C) + ": cannot be built with num_features " +
                       std::to_string(num_features));
    }
    return num_features;
  }
};

template <index_t C = dyn, ElementType T = float>
using BatchNorm1d = BatchNorm<1, C, T>;
template <index_t C = dyn, ElementType T = float>
using BatchNorm2d = BatchNorm<2, C, T>;

}  // namespace nn
}  // namespace duet
// Containers: cells that run other cells in order.

#include <boost/hana/at.hpp>
#include <boost/hana/fold_left.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/tuple.hpp>
#include <concepts>
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
  // Takes cells by forwarding reference so that a named cell is one short error below, not the
  // deleted copy constructors of the cell, its parameters and its compiled forms.
  template <class C, class... Cs>
  requires(sizeof...(Cs) == sizeof...(Rest) && std::constructible_from<First, std::remove_cvref_t<C>> &&
           (std::constructible_from<Rest, std::remove_cvref_t<Cs>> && ...))
  explicit SequentialCell(C&& first, Cs&&... rest)
      : cells_(moved_in(std::forward<C>(first)), moved_in(std::forward<Cs>(rest))...) {
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
    if constexpr (graph::Symbolic<X>) {
      return captured_from<0>(x);
    } else {
      return boost::hana::fold_left(cells_, std::forward<X>(x),
                                    [](auto&& acc, auto& cell) { return cell(std::forward<decltype(acc)>(acc)); });
    }
  }

  // Captures cell I on an input of its own, standing for the value of the cell before it, and splices
  // the cells' graphs after x's at the end: each cell appended to the graph so far would copy
  // it, and a chain's capture would cost the square of its length.
  template <std::size_t I, class X, class... Parts>
  auto captured_from(const X& x, const Parts&... parts) {
    if constexpr (I == size()) {
      return graph::spliced(x, parts...);
    } else {
      using Last = typename decltype((std::type_identity<std::remove_cvref_t<X>>{}, ..., std::type_identity<Parts>{}))::type;
      return captured_from<I + 1>(x, parts..., boost::hana::at_c<I>(cells_)(graph::continuation<Last>()));
    }
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

  template <class C>
  static std::remove_reference_t<C>&& moved_in(C&& cell) {
    static_assert(!std::is_lvalue_reference_v<C>,
                  "nn::SequentialCell: cells are not copyable (a copy would train apart from its original); pass "
                  "temporaries, SequentialCell(nn::Dense<4, 8>{}, nn::ReLU{}), or move named cells in: std::move(a)");
    return static_cast<std::remove_reference_t<C>&&>(cell);
  }

  boost::hana::tuple<First, Rest...> cells_;
};

// SequentialCell seq(nn::Dense<4, 8>{}, nn::ReLU{}) holds the cells' own types.
template <class C, class... Cs>
SequentialCell(C&&, Cs&&...) -> SequentialCell<std::remove_cvref_t<C>, std::remove_cvref_t<Cs>...>;

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

#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
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

namespace detail {
// The sizes a layer's products are compiled for: its run-time form's, dyn where an
// nn::Dense<In, Out> shares the code of nn::Dense<> (backend::dense_depends_on_sizes).
template <class Layer>
using DenseKernel = std::remove_pointer_t<decltype(nn::detail::runtime_form(std::declval<Layer*>()))>;
}  // namespace detail

// x · Wᵀ over the last axis of x, then the epilogue: the bias if Bias, then each Fn. Capture
// makes it with an empty epilogue; fuse_epilogues grows it.
template <class Layer, bool Bias = false, class... Fns>
struct MatMulOp : Primitive<MatMulOp<Layer, Bias, Fns...>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  std::tuple<Fns...> fns{};  // the epilogue functions' parameters (fn::LeakyRelu's alpha)
  MatMulOp(const Layer* l) : layer(l) {}
  MatMulOp(const Layer* l, std::tuple<Fns...> f) : layer(l), fns(std::move(f)) {}

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

  // The same product with the weight kept pre-packed between calls (inference graphs at O1 and O2).
  auto with_packed_weight() const { return PackedMatMulOp<Layer, Bias, Fns...>{{layer, fns}}; }

  // Takes this layer's bias first (if it has one), then any elementwise functions.
  template <class C>
  static constexpr bool accepts_epilogue =
      (std::is_same_v<C, BiasAddOp<Layer>> && Layer::has_bias && !Bias && sizeof...(Fns) == 0) ||
      requires { C::elementwise_functions; };
  auto absorb(const BiasAddOp<Layer>&) const { return MatMulOp<Layer, true, Fns...>{layer, fns}; }
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return MatMulOp<Layer, Bias, Fns..., Gs...>{layer, std::tuple_cat(fns, next.fns)};
  }

  // Its gradient op differentiates an activation epilogue from the forward output, so it can
  // do so for one function whose derivative the output gives.
  static constexpr bool differentiable = sizeof...(Fns) == 0 || (sizeof...(Fns) == 1 && (!fn::grad_from_input<Fns> && ...));
  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return DenseGradOp<Layer, Bias, true, Fns...>{layer, fns};
  }
  auto parameter_grad_op() const { return DenseGradOp<Layer, Bias, false, Fns...>{layer, fns}; }

  static std::string op_name() { return with_epilogue("MatMul"); }
  std::string label() const { return layer->label(); }

  // ONNX: Gemm(x, W, transB = 1) on a matrix; on other ranks a MatMul by Wᵀ. Only the plain
  // product: PyNative, which export_onnx traces, runs the epilogue as ops of their own.
  Interchange interchange(std::span<const Shape> in) const {
    if constexpr (Bias || sizeof...(Fns) > 0) {
      return {};
    } else {
      using I = InterchangeInput;
      if (in[0].rank() == 2) {
        return {{"Gemm", {I::operand(0), I::of_parameter(&layer->weight)}, {InterchangeAttribute::of("transB", 1)}}};
      }
      return {{"Transpose", {I::of_parameter(&layer->weight)}, {}}, {"MatMul", {I::operand(0), I::node(0)}, {}}};
    }
  }

 protected:
  // Built in a local, not a by-value parameter: g++ 12 at -O1 and above warns (-Warray-bounds,
  // a false positive) on the inlined move of a returned parameter string.
  static std::string with_epilogue(const char* product) {
    std::string s = product;
    if (Bias) s += " + BiasAdd";
    ((s += " + ", s += Fns::name), ...);
    return s;
  }

  template <class Backend, class T, bool PackedWeight>
  void product(const graph::KernelArgs& a) const {
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : a.in_shape().numel() / in_channels;
    const T* bias = nullptr;
    if constexpr (Bias) bias = layer->bias.data();
    const Epilogue<T, Fns...> epilogue{bias, fns};
    constexpr index_t In = detail::DenseKernel<Layer>::in_static;
    constexpr index_t Out = detail::DenseKernel<Layer>::out_static;
    if constexpr (PackedWeight && backend::packs_as_dense<Backend, In, Out, T, Fns...>()) {
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
struct BiasAddOp : Primitive<BiasAddOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool is_elementwise = true;

  const Layer* layer;
  BiasAddOp(const Layer* l) : layer(l) {}

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
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return BiasAddGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return BiasAddGradOp<Layer, false>{layer}; }

  static std::string op_name() { return "BiasAdd"; }
  std::string label() const { return layer->label(); }

  Interchange interchange(std::span<const Shape>) const {
    return {{"Add", {InterchangeInput::operand(0), InterchangeInput::of_parameter(&layer->bias)}, {}}};
  }
};

// The gradient of MatMulOp<Layer, Bias, Fns...>: from dy (and y, when Fns need it) it makes
// dW, db and, if InputGrad, dx. The activation mask and the bias sum are taken in the same
// kernel as the products, as the forward fused them.
template <class Layer, bool Bias, bool InputGrad, class... Fns>
struct DenseGradOp : Primitive<DenseGradOp<Layer, Bias, InputGrad, Fns...>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr auto reads = [] {
    if constexpr (sizeof...(Fns) == 0)
      return std::array{graph::Operand::grad, graph::Operand::input0};
    else
      return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
  }();
  static constexpr int arity = static_cast<int>(reads.size());  // dy, x[, y]
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  std::tuple<Fns...> fns;
  DenseGradOp(const Layer* l, std::tuple<Fns...> f) : layer(l), fns(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    bool accumulate_w = false;
    bool accumulate_b = false;
    T* dw = layer->weight.grad_for_write(pass, &accumulate_w);
    T* db = nullptr;
    if constexpr (Bias) db = layer->bias.grad_for_write(pass, &accumulate_b);
    const index_t in_channels = layer->in_channels();
    const index_t rows = in_channels == 0 ? 0 : a.in_shape(1).numel() / in_channels;
    using Kernel = detail::DenseKernel<Layer>;
    Backend::template dense_backward<Kernel::in_static, Kernel::out_static, T, Fns...>(DenseBackwardArgs<T>{
        a.in<T>(0), a.in<T>(1), sizeof...(Fns) == 0 ? nullptr : a.in<T>(2), rows, in_channels, layer->weight.data(),
        layer->out_channels(), InputGrad ? a.out<T>() : nullptr, dw, accumulate_w, db, accumulate_b}, fns);
    duet::detail::gradient_writes_done();
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
struct BiasAddGradOp : Primitive<BiasAddGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;
  static constexpr bool is_view = InputGrad;
  static constexpr bool has_side_effects = true;
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  BiasAddGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[0] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    bool accumulate = false;
    T* db = layer->bias.grad_for_write(duet::detail::current_backward_pass(), &accumulate);
    const index_t cols = layer->out_channels();
    Backend::bias_grad(a.in<T>(), cols == 0 ? 0 : a.in_shape().numel() / cols, cols, db, accumulate);
    duet::detail::gradient_writes_done();
  }

  static std::string op_name() { return InputGrad ? "BiasAddGrad" : "BiasAddGrad (parameters only)"; }
  std::string label() const { return layer->label(); }
};

}  // namespace ops

namespace nn {

// nn::Dense's initialisers (MindSpore's weight_init, bias_init): any duet::initializer, or a
// user's; left unset, MindSpore's defaults. (MindSpore's has_bias is a template argument of
// nn::Dense: it decides which nodes the layer captures.)
template <ElementType T>
struct DenseOptions {
  std::optional<initializer::AnyInitializer<T>> weight_init = std::nullopt;
  std::optional<initializer::AnyInitializer<T>> bias_init = std::nullopt;
};

namespace detail {
// A Dense layer's parameters, the checkpoint entries: weight and, if it has one, bias.
template <ElementType T, bool HasBias>
struct DenseParameters {
  BasicParameter<T> weight;  // [out_channels, in_channels]
  BasicParameter<T> bias;    // [out_channels]
  DUET_CELL_MEMBERS(weight, bias);
};
template <ElementType T>
struct DenseParameters<T, false> {
  BasicParameter<T> weight;
  DUET_CELL_MEMBERS(weight);
};

// A Dense's weight, then its bias, from the global generator (set_seed); `fixed` holds its
// compile-time sizes (dyn where none). Unset options are MindSpore 2.x's defaults: weight
// HeUniform(negative_slope = sqrt(5)) and bias Uniform(1/sqrt(in)), both U(-1/sqrt(in),
// 1/sqrt(in)), drawn here as that Uniform so that the bound is T's 1/sqrt(in) for every T.
// Not a member of Dense: compiled once per element type, not once per layer size.
template <ElementType T, bool HasBias>
void initialize_dense(DenseParameters<T, HasBias>& parameters, const BasicDynamicCell<T>& cell,
                      std::array<index_t, 2> fixed, std::array<index_t, 2> sizes, const DenseOptions<T>& options) {
  const index_t in_channels = sizes[0], out_channels = sizes[1];  // not a structured binding: clang 14 cannot capture one
  if ((fixed[0] != dyn && in_channels != fixed[0]) || (fixed[1] != dyn && out_channels != fixed[1]) ||
      in_channels <= 0 || out_channels <= 0) {
    throw ValueError(cell.type_name() + ": cannot be built with in_channels " + std::to_string(in_channels) +
                     " and out_channels " + std::to_string(out_channels));
  }
  const initializer::Uniform mindspore_default{static_cast<double>(T(1) / std::sqrt(static_cast<T>(in_channels)))};
  if (!HasBias && options.bias_init) {
    throw ValueError(cell.type_name() + ": bias_init is given, but the layer has no bias (HasBias = false)");
  }
  const initializer::AnyInitializer<T> weight_init = options.weight_init.value_or(mindspore_default);
  auto weight_value = BasicTensor<T>::uninitialized({out_channels, in_channels});
  with_global_generator([&](Generator& gen) {
    initializer::initialize_option(weight_value, weight_init, gen, cell.type_name(), "weight_init");
    if constexpr (HasBias) {
      auto bias_value = BasicTensor<T>::uninitialized({out_channels});
      initializer::initialize_option(bias_value, options.bias_init.value_or(mindspore_default), gen, cell.type_name(),
                                     "bias_init");
      parameters.bias = BasicParameter<T>(std::move(bias_value));
    }
  });
  parameters.weight = BasicParameter<T>(std::move(weight_value));
}
}  // namespace detail

// y = x · weightᵀ + bias over the last axis of x (MindSpore's nn.Dense). In and Out are
// compile-time sizes, or duet::dyn for sizes given to the constructor at run time. HasBias
// false is MindSpore's has_bias=False: no bias parameter, y = x · weightᵀ.
//
// Dense<In, Out> is Dense<> with the sizes in its type (SizedLayer): graph capture checks the
// input against them while the program compiles, and the layer otherwise runs Dense<>'s code,
// compiled once for all sizes. Except where the sizes change the product's code, and so
// possibly its bits (small layers the GEMM unrolls, backend::dense_depends_on_sizes): such a
// layer is a cell of its own, as a partly dyn one is.
template <index_t In = dyn, index_t Out = dyn, ElementType T = float, bool HasBias = true>
class Dense : public Cell<Dense<In, Out, T, HasBias>, CONTEXT_MODE, T>, public detail::DenseParameters<T, HasBias> {
  static_assert(In == dyn || In > 0, "nn::Dense<In, Out>: In must be positive (or duet::dyn)");
  static_assert(Out == dyn || Out > 0, "nn::Dense<In, Out>: Out must be positive (or duet::dyn)");

 public:
  using runtime_type = Dense;
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;
  static constexpr bool has_bias = HasBias;
  using detail::DenseParameters<T, HasBias>::weight;

  using Options = DenseOptions<T>;

  Dense() requires(In != dyn && Out != dyn) : Dense(In, Out) {}
  // nn::Dense<784, 512> fc{{.weight_init = initializer::HeNormal{}, .bias_init = initializer::Zero{}}};
  explicit Dense(Options options) requires(In != dyn && Out != dyn) : Dense(In, Out, std::move(options)) {}

  Dense(index_t in_channels, index_t out_channels, Options options = {})
      : Dense(in_channels, out_channels, std::move(options), {In, Out}) {}

 protected:
  // A Dense<In, Out>'s: sized holds the sizes its type fixes, which it checks and is named by.
  Dense(index_t in_channels, index_t out_channels, Options options, std::array<index_t, 2> sized)
      : in_(in_channels), out_(out_channels), sized_(sized) {
    detail::initialize_dense<T, HasBias>(*this, *this, sized, {in_channels, out_channels}, options);
  }

 public:
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
    return captured_as(this, std::forward<X>(x));
  }

  std::string type_name() const override {
    std::string s = "nn::Dense<" + size_name(sized_[0]) + ", " + size_name(sized_[1]);
    if constexpr (!std::is_same_v<T, float> || !HasBias) s += ", " + std::string(name_of(dtype_of<T>));
    if constexpr (!HasBias) s += ", no bias";
    return s + ">";
  }

 protected:
  // The operations of a Dense typed on layer: this one, or a Dense<In, Out> deriving from it.
  template <class Layer, class X>
  static auto captured_as(Layer* layer, X&& x) {
    if constexpr (HasBias) return apply(ops::BiasAddOp<Layer>{layer}, apply(ops::MatMulOp<Layer>{layer}, std::forward<X>(x)));
    else return apply(ops::MatMulOp<Layer>{layer}, std::forward<X>(x));
  }

 private:
  static std::string size_name(index_t n) { return n == dyn ? "dyn" : std::to_string(n); }

  index_t in_;
  index_t out_;
  std::array<index_t, 2> sized_;
};

template <index_t In, index_t Out, ElementType T, bool HasBias>
  requires(In > 0 && Out > 0 && !backend::dense_depends_on_sizes<DefaultBackend, In, Out, T>())
class Dense<In, Out, T, HasBias> : public SizedLayer<Dense<In, Out, T, HasBias>, Dense<dyn, dyn, T, HasBias>> {
  using Runtime = Dense<dyn, dyn, T, HasBias>;
  using Sized = SizedLayer<Dense, Runtime>;

 public:
  static constexpr index_t in_static = In;
  static constexpr index_t out_static = Out;
  using Options = DenseOptions<T>;

  Dense() : Dense(In, Out) {}
  explicit Dense(Options options) : Dense(In, Out, std::move(options)) {}
  Dense(index_t in_channels, index_t out_channels, Options options = {})
      : Sized(in_channels, out_channels, std::move(options), {In, Out}) {}

  template <graph::Symbolic S>
  auto sized_construct(const S& x) {
    return Runtime::captured_as(this, x);
  }
};

}  // namespace nn
}  // namespace duet
// Dropout: nn::Dropout and the operations it captures.
//
// MindSpore 2.x's nn.Dropout(p=0.5): in training each element is zeroed with probability p and
// the others are scaled by 1 / (1 - p) (inverted dropout, so evaluation is the identity).
// MindSpore 1.x took keep_prob = 1 - p instead; 2.x deprecates it for p, PyTorch's convention,
// which duet follows.
//
// Seeded: a layer draws its masks from a generator of its own, seeded from the global one
// (duet::set_seed) when the layer is made, one draw per element in row-major order per
// training call. Both modes run the same kernel once per call, so they draw the same masks in
// the same order and give the same losses. A training step that fails gives its draws back.
// A checkpoint saved with an optimiser holds the generator's state ("generator.<path>"), so
// training resumed from it draws the masks the uninterrupted run would have.
//
// The mask is not kept: the gradient recovers it from the input and the output. A kept
// element's output is x / (1 - p), which is 0 only if x is (|1 / (1 - p)| >= 1: no
// underflow); a dropped element's output is 0 with the sign bit opposite to x's when x is 0,
// so a kept zero and a dropped one differ in their sign. Nothing is stored between forward and
// backward, so a layer applied twice, or a network run by several threads, needs no care.

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>


namespace duet {
namespace ops {

template <class Layer, graph::Phase P>
struct DropoutGradOp;

// Training: x · mask / (1 - p), the mask drawn from the layer's generator. Evaluation: x
// itself, a view (the node stays in the graph so that its phase is checked).
template <class Layer, graph::Phase P>
struct DropoutOp : Primitive<DropoutOp<Layer, P>>, PhaseOf<Layer, P> {
  using layer_type = Layer;
  static constexpr int arity = 1;
  static constexpr bool is_view = P == graph::Phase::eval;
  static constexpr bool has_side_effects = is_view;  // the view's kernel checks the phase

  explicit DropoutOp(Layer* l) : PhaseOf<Layer, P>(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    this->check_phase();
    if constexpr (P == graph::Phase::train) {
      const index_t n = a.in_shape().numel();
      const T* x = a.in<T>();
      T* y = a.out<T>();
      const float p = this->layer->p();
      const T scale = T(1) / (T(1) - static_cast<T>(p));
      duet::detail::will_change(*this->layer);
      Generator& gen = this->layer->generator();
      for (index_t i = 0; i < n; ++i) {
        // Drawn as float whatever T is, so that float and double networks drop alike.
        if (gen.uniform01<float>() >= p) {
          y[i] = x[i] * scale;
        } else {
          y[i] = std::signbit(x[i]) || x[i] != T(0) ? T(0) : T(-0.0);
        }
      }
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return DropoutGradOp<Layer, P>{this->layer};
  }

  static std::string op_name() { return P == graph::Phase::train ? "Dropout" : "Dropout (identity)"; }
  std::string label() const { return this->layer->label(); }

  // ONNX: at evaluation, what it is, the identity.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (P == graph::Phase::eval) return {{"Identity", {InterchangeInput::operand(0)}, {}}};
    else return {};
  }
};

// Training: dx = dy / (1 - p) where the element was kept, 0 where it was dropped (recovered from
// x and y, see above). Evaluation: dy itself, a view.
template <class Layer, graph::Phase P>
struct DropoutGradOp : Primitive<DropoutGradOp<Layer, P>> {
  using layer_type = Layer;
  static constexpr auto reads = [] {
    if constexpr (P == graph::Phase::train)
      return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
    else
      return std::array{graph::Operand::grad};
  }();
  static constexpr int arity = static_cast<int>(reads.size());
  static constexpr bool is_view = P == graph::Phase::eval;

  const Layer* layer;
  explicit DropoutGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    if constexpr (P == graph::Phase::train) {
      const index_t n = a.in_shape().numel();
      const T* dy = a.in<T>(0);
      const T* x = a.in<T>(1);
      const T* y = a.in<T>(2);
      T* dx = a.out<T>();
      const T scale = T(1) / (T(1) - static_cast<T>(layer->p()));
      for (index_t i = 0; i < n; ++i) {
        const bool kept = y[i] != T(0) || (x[i] == T(0) && std::signbit(x[i]) == std::signbit(y[i]));
        dx[i] = kept ? dy[i] * scale : T(0);
      }
    }
  }

  static std::string op_name() { return P == graph::Phase::train ? "DropoutGrad" : "DropoutGrad (identity)"; }
  std::string label() const { return layer->label(); }
};

inline const bool dropout_listed = list_operations({"Dropout"});

}  // namespace ops

namespace nn {

// MindSpore's nn.Dropout(p=0.5) (see the header's comment): p in [0, 1).
template <ElementType T>
class BasicDropout : public Cell<BasicDropout<T>, CONTEXT_MODE, T>,
                     public duet::detail::StepState,
                     public duet::detail::GeneratorOwner {
 public:
  explicit BasicDropout(double p = 0.5) : p_(static_cast<float>(p)) {
    if (!(p >= 0 && p < 1)) {
      throw ValueError("nn::Dropout: p, the probability of dropping an element, must be in [0, 1), got " +
                       std::to_string(p));
    }
    reseed(with_global_generator([](Generator& gen) { return gen.next(); }));
  }

  float p() const { return p_; }

  // Restarts the masks from `seed`: the same seed gives the same masks in both modes.
  void reseed(std::uint64_t seed) { generator_.seed(seed); }
  // The masks' generator; training kernels draw from it (one training call at a time).
  Generator& generator() const { return generator_; }

  Generator& owned_generator() override { return generator_; }

  // A step that fails gives back the draws it took, so the next one drops what it would have.
  void save_for_step() override { saved_ = generator_; }
  void restore_step() override { generator_ = saved_; }

  template <class X>
  auto construct(X&& x) {
    return ops::apply_in_phase<ops::DropoutOp>(this, std::forward<X>(x));
  }

  bool depends_on_phase() const override { return true; }

  std::string type_name() const override {
    std::string s = "nn::Dropout";
    if constexpr (!std::is_same_v<T, float>) s += "<" + std::string(name_of(dtype_of<T>)) + ">";
    return s;
  }

 private:
  float p_;
  mutable Generator generator_;
  Generator saved_;
};

using Dropout = BasicDropout<float>;

}  // namespace nn
}  // namespace duet
// Embedding: nn::Embedding and the operation it captures, a lookup of int32 indices in the
// layer's table (MindSpore's nn.Embedding).

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

// Shape operations: reshape, transpose/permute, expand_dims, squeeze, concat, stack, split,
// slice/strided_slice and gather, in both modes (MindSpore's ops.reshape, ops.transpose, ...).
//
// Every argument that decides the output's shape is known at compile time, so that graph
// mode has a static shape to check the next layer against: a single list or axis is a
// template argument (reshape<2, -1>(x), transpose<1, 0>(x), concat<1>(a, b, c)); the two or
// three lists of slice and strided_slice are tag values, ops::ints<...>, since one template
// can hold only one list (slice(x, ints<1, 0>, ints<2, -1>)).
//
// duet's tensors are contiguous and row-major: a view is one run of its input's elements, in
// order, with a shape. So reshape, expand_dims and squeeze are views (no kernel, no copy),
// and so is a slice along the first axis only (split<0, ...>, or slice and strided_slice
// cutting axis 0 with stride 1), which begins further into the input's block. transpose,
// concat, stack, gather and the other slices copy: their elements are not such a run.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>


namespace duet {
namespace ops {

// A list of integers fixed at compile time: the begin, end and strides of a slice.
template <index_t... V>
struct Ints {
  static constexpr std::array<index_t, sizeof...(V)> values{V...};
};
template <index_t... V>
inline constexpr Ints<V...> ints{};

// An end past every axis's last element, in the direction of the stride: strided_slice's "to
// the end" (Python's omitted end, x[b::s]).
inline constexpr index_t to_end = std::numeric_limits<index_t>::max();

namespace detail {

// axis in [-rank, rank) as an index in [0, rank), or -1 when it is out of range.
constexpr int axis_index(int axis, int rank) {
  const int a = axis < 0 ? axis + rank : axis;
  return a < 0 || a >= rank ? -1 : a;
}

template <class V>
std::string list_text(std::span<const V> values) {
  std::string out;
  for (V v : values) {
    if (!out.empty()) out += ", ";
    out += std::to_string(v);
  }
  return out;
}
template <class V>
std::string list_text(std::initializer_list<V> values) {
  return list_text(std::span<const V>(values.begin(), values.size()));
}

// x with axis `at` removed (at < rank) or a size inserted before it.
constexpr Shape without_axis(const Shape& x, int at) {
  Shape out;
  for (int i = 0; i < x.rank(); ++i)
    if (i != at) out.push_back(x[i]);
  return out;
}
constexpr Shape with_axis(const Shape& x, int at, index_t size) {
  Shape out;
  for (int i = 0; i <= x.rank(); ++i) {
    if (i == at) out.push_back(size);
    if (i < x.rank()) out.push_back(x[i]);
  }
  return out;
}

// Copies `rows` runs of `count` elements, run r from src + r * src_row to dst + r * dst_row.
template <class T>
void copy_runs(const T* src, index_t src_row, T* dst, index_t dst_row, index_t rows, index_t count) {
  for (index_t r = 0; r < rows; ++r) std::copy_n(src + r * src_row, count, dst + r * dst_row);
}

// Row-major strides of a shape, in elements.
constexpr std::array<index_t, max_rank> strides_of(const Shape& x) {
  std::array<index_t, max_rank> stride{};
  index_t s = 1;
  for (int a = x.rank() - 1; a >= 0; --a) {
    stride[static_cast<std::size_t>(a)] = s;
    s *= x[a];
  }
  return stride;
}

// Calls f(i, j) for each output element i, in order, and the input element j it reads, where
// output element 0 reads input element `first` and one step along output axis a moves
// stride[a] in the input: the walk of transpose and of slices.
template <class F>
void for_each_strided(index_t first, const std::array<index_t, max_rank>& stride, const Shape& out, F&& f) {
  const int rank = out.rank();
  const index_t n = out.numel();
  if (n == 0) return;
  const index_t inner = rank == 0 ? 1 : out[-1];
  const index_t inner_step = rank == 0 ? 0 : stride[static_cast<std::size_t>(rank - 1)];
  std::array<index_t, max_rank> index{};
  index_t j = first;
  for (index_t i = 0; i < n; i += inner) {
    for (index_t k = 0; k < inner; ++k) f(i + k, j + k * inner_step);
    // The odometer over the outer axes, last first.
    for (int axis = rank - 2; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      j += stride[ax];
      if (index[ax] < out[axis]) break;
      j -= stride[ax] * index[ax];
      index[ax] = 0;
    }
  }
}

}  // namespace detail

// The gradient of a view that only changes the shape: dy viewed with the forward input's shape.
struct ReshapeLikeOp : Primitive<ReshapeLikeOp> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, the forward input (for its shape)
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  static std::string op_name() { return "ReshapeLike"; }
};

// ----------------------------------------------------------------------------------------
// reshape<D...>(x): MindSpore's reshape(input, shape). One size may be -1, inferred from the
// element count. A view.

constexpr ShapeResult reshape_rule(const Shape& x, Shape to) {
  int inferred = -1;
  index_t known = 1;
  for (int i = 0; i < to.rank(); ++i) {
    if (to[i] == dyn) inferred = i;
    else known *= to[i];
  }
  const index_t n = x.numel();
  if (n == dyn) return {to};  // the inferred size stays dynamic
  if (inferred < 0) return known == n ? ShapeResult{to} : fault(to, ShapeFault::total_elements, known);
  if (known == 0 || n % known != 0) return fault(to, ShapeFault::elements_multiple, known);
  to[inferred] = n / known;
  return {to};
}

template <index_t... D>
struct ReshapeOp : Primitive<ReshapeOp<D...>> {
  static_assert(((D >= 0 || D == -1) && ...), "duet::ops::reshape: sizes must be >= 0, or -1 for one inferred size");
  static_assert((0 + ... + int{D == -1}) <= 1, "duet::ops::reshape: at most one size may be -1 (inferred)");
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return reshape_rule(in[0], Shape{D...}); }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Reshape<" + detail::list_text<index_t>({D...}) + ">"; }
  std::string label() const { return "ops::reshape<" + detail::list_text<index_t>({D...}) + ">"; }
};

template <index_t... D, class X>
auto reshape(X&& x) {
  return apply(ReshapeOp<D...>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// expand_dims<Axis>(x): a size-1 axis inserted at Axis, in [-rank - 1, rank] (MindSpore's
// expand_dims(input_x, axis)). A view.

template <int Axis>
struct ExpandDimsOp : Primitive<ExpandDimsOp<Axis>> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    const int at = Axis < 0 ? Axis + x.rank() + 1 : Axis;
    if (x.leading_unknown()) {
      // Counted from the end, the axis is among the known trailing ones; from the front, not.
      if (Axis >= 0 || at < 0) return {Shape::any()};
      Shape out = Shape::any();
      for (index_t d : detail::with_axis(x, at, 1)) out.push_back(d);
      return {out};
    }
    if (at < 0 || at > x.rank()) return fault(x, ShapeFault::min_rank, Axis < 0 ? -Axis - 1 : Axis);
    return {detail::with_axis(x, at, 1)};
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "ExpandDims<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::expand_dims<" + std::to_string(Axis) + ">"; }
};

template <int Axis, class X>
auto expand_dims(X&& x) {
  return apply(ExpandDimsOp<Axis>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// squeeze<Axes...>(x): the size-1 axes named removed, or every size-1 axis when none is
// (MindSpore's squeeze(input, axis)). A view.

template <int... Axes>
struct SqueezeOp : Primitive<SqueezeOp<Axes...>> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    if constexpr (sizeof...(Axes) == 0) {
      // Which axes go depends on sizes compile time may not know: then so is the result.
      if (!x.is_concrete()) return {Shape::any()};
      Shape out;
      for (index_t d : x)
        if (d != 1) out.push_back(d);
      return {out};
    } else {
      if (x.leading_unknown()) return {Shape::any()};
      std::array<bool, max_rank> drop{};
      for (int axis : {Axes...}) {
        const int a = detail::axis_index(axis, x.rank());
        if (a < 0) return fault(x, ShapeFault::min_rank, axis < 0 ? -axis : axis + 1);
        if (x[a] != 1 && x[a] != dyn) return fault(x, ShapeFault::axis_not_one, axis);
        drop[static_cast<std::size_t>(a)] = true;
      }
      Shape out;
      for (int i = 0; i < x.rank(); ++i)
        if (!drop[static_cast<std::size_t>(i)]) out.push_back(x[i]);
      return {out};
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Squeeze<" + detail::list_text<int>({Axes...}) + ">"; }
  std::string label() const { return "ops::squeeze<" + detail::list_text<int>({Axes...}) + ">"; }
};

template <int... Axes, class X>
auto squeeze(X&& x) {
  return apply(SqueezeOp<Axes...>{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// transpose<P...>(x): output axis i is input axis P[i] (MindSpore's transpose(input,
// input_perm); permute(input, axis) is the same). A copy: the output's elements are the
// input's in another order, which a contiguous row-major view cannot express.

namespace detail {
template <std::size_t N>
constexpr bool is_permutation(const std::array<int, N>& p) {
  std::array<bool, N> seen{};
  for (int v : p) {
    if (v < 0 || v >= static_cast<int>(N) || seen[static_cast<std::size_t>(v)]) return false;
    seen[static_cast<std::size_t>(v)] = true;
  }
  return true;
}
}  // namespace detail

namespace detail {
// Both forms' shape rule: output axis i is x's axis perm[i].
constexpr ShapeResult transpose_rule(const Shape& x, std::span<const int> perm) {
  const int rank = static_cast<int>(perm.size());
  if (x.leading_unknown() && x.rank() <= rank) return {Shape::any()};
  if (x.rank() != rank) return fault(x, ShapeFault::exact_rank, rank);
  Shape out;
  for (int a : perm) out.push_back(x[a]);
  return {out};
}

template <class T>
void transpose_run(const graph::KernelArgs& a, std::span<const int> perm) {
  const auto in_stride = strides_of(a.in_shape());
  std::array<index_t, max_rank> stride{};
  for (std::size_t i = 0; i < perm.size(); ++i) stride[i] = in_stride[static_cast<std::size_t>(perm[i])];
  const T* in = a.in<T>();
  T* out = a.out<T>();
  for_each_strided(0, stride, a.output_shape, [&](index_t i, index_t j) { out[i] = in[j]; });
}
}  // namespace detail

template <int... P>
struct TransposeOp : Primitive<TransposeOp<P...>> {
  static constexpr std::array<int, sizeof...(P)> perm{P...};
  static_assert(detail::is_permutation(perm),
                "duet::ops::transpose: the axes must be a permutation of 0, 1, ..., rank - 1");
  static constexpr int rank = static_cast<int>(sizeof...(P));
  // As the gradient of the inverse permutation, it reads the incoming gradient only.
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::transpose_rule(in[0], perm); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::transpose_run<T>(a, perm);
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      constexpr std::array<int, sizeof...(P)> inverse = [] {
        std::array<int, sizeof...(P)> inv{};
        for (std::size_t i = 0; i < sizeof...(P); ++i) inv[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
        return inv;
      }();
      return TransposeOp<inverse[I]...>{};
    }(std::make_index_sequence<sizeof...(P)>{});
  }

  static std::string op_name() { return "Transpose<" + detail::list_text<int>({P...}) + ">"; }
  std::string label() const { return "ops::transpose<" + detail::list_text<int>({P...}) + ">"; }
};

template <int... P, class X>
auto transpose(X&& x) {
  return apply(TransposeOp<P...>{}, std::forward<X>(x));
}

// transpose(x, perm): the permutation given at run time (MindSpore's transpose(input,
// input_perm) with a tuple the program computes; an ONNX model's Transpose). One operation for
// every permutation, where each transpose<P...> is a type and a kernel of its own: code that
// chooses among many permutations compiles one (the ONNX import chose among 32). Graph mode
// checks its shape when the network first runs, not at compile time.
struct PermuteOp : Primitive<PermuteOp> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  std::array<int, max_rank> order{};
  int rank = 0;

  std::span<const int> perm() const { return {order.data(), static_cast<std::size_t>(rank)}; }

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape> in) const { return detail::transpose_rule(in[0], perm()); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::transpose_run<T>(a, perm());
  }

  template <std::size_t K>
    requires(K == 0)
  PermuteOp grad_op() const {
    PermuteOp inverse;
    inverse.rank = rank;
    for (int i = 0; i < rank; ++i) inverse.order[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] = i;
    return inverse;
  }

  static std::string op_name() { return "Transpose"; }
  std::string label() const {
    return "ops::transpose(x, {" + detail::list_text<int>(perm()) + "})";
  }
};

// Throws duet::ValueError unless perm is a permutation of 0, 1, ..., n - 1 with n at most
// duet::max_rank; the input's rank is checked against n like any shape.
template <class X>
auto transpose(X&& x, std::span<const int> perm) {
  PermuteOp op;
  op.rank = static_cast<int>(perm.size());
  std::array<bool, max_rank> seen{};
  bool valid = perm.size() <= static_cast<std::size_t>(max_rank);
  for (std::size_t i = 0; valid && i < perm.size(); ++i) {
    const int a = perm[i];
    valid = a >= 0 && a < op.rank && !seen[static_cast<std::size_t>(a)];
    if (valid) {
      seen[static_cast<std::size_t>(a)] = true;
      op.order[i] = a;
    }
  }
  if (!valid) {
    throw ValueError("duet::ops::transpose: {" + detail::list_text<int>(perm) +
                     "} is not a permutation of 0, 1, ..., rank - 1 (of at most " + std::to_string(max_rank) + " axes)");
  }
  return apply(op, std::forward<X>(x));
}
template <class X>
auto transpose(X&& x, std::initializer_list<int> perm) {
  return transpose(std::forward<X>(x), std::span<const int>(perm.begin(), perm.size()));
}
template <int... P, class X>
auto permute(X&& x) {
  return transpose<P...>(std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// concat<Axis>(x0, x1, ...): the inputs joined along Axis, their other sizes equal (MindSpore's
// concat(tensors, axis)). N inputs, N a template argument of the op. A copy.

namespace detail {

// The inputs' common sizes, axis `except` aside (-1: none), into `common` (dyn where every
// input's is): the first input whose rank or a size differs, or 0 when none does.
constexpr int merge_sizes(std::span<const Shape> in, int except, Shape& common) {
  common = in[0];
  for (std::size_t k = 1; k < in.size(); ++k) {
    const Shape& x = in[k];
    if (x.rank() != common.rank()) return static_cast<int>(k);
    for (int i = 0; i < x.rank(); ++i) {
      if (i == except) continue;
      if (common[i] == dyn) common[i] = x[i];
      else if (x[i] != dyn && x[i] != common[i]) return static_cast<int>(k);
    }
  }
  return 0;
}

constexpr index_t numel_before(const Shape& x, int axis) {
  index_t n = 1;
  for (int i = 0; i < axis; ++i) n *= x[i];
  return n;
}

// concat's and stack's kernel: each row of the output's axes before `a` holds a block of
// every input in turn.
template <class T>
void join_blocks(const graph::KernelArgs& args, std::size_t inputs, int a) {
  const Shape& out = args.output_shape;
  index_t offset = 0;
  for (std::size_t k = 0; k < inputs; ++k) {
    const index_t block = args.in_shape(k).numel_from(a);
    copy_runs(args.in<T>(k), block, args.out<T>() + offset, out.numel_from(a), numel_before(out, a), block);
    offset += block;
  }
}

// Their gradients' kernel: from each row of dy, the block that begins `offset` into it.
template <class T>
void take_block(const graph::KernelArgs& args, int a, index_t offset) {
  const Shape& dy = args.in_shape(0);
  const index_t block = args.output_shape.numel_from(a);
  copy_runs(args.in<T>(0) + offset, dy.numel_from(a), args.out<T>(), block, numel_before(dy, a), block);
}

}  // namespace detail

template <int Axis, int K>
struct ConcatGradOp;

template <int Axis, int N>
struct ConcatOp : Primitive<ConcatOp<Axis, N>> {
  static_assert(N >= 1, "duet::ops::concat: needs at least one input");
  static constexpr int arity = N;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    for (const Shape& x : in)
      if (x.leading_unknown()) return {Shape::any()};
    const int a = detail::axis_index(Axis, in[0].rank());
    if (a < 0) return fault(in[0], ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    Shape out;
    if (const int k = detail::merge_sizes(in, a, out)) return fault(out, ShapeFault::sizes_except_axis, a, k);
    for (std::size_t k = 1; k < in.size(); ++k) out[a] = out[a] == dyn || in[k][a] == dyn ? dyn : out[a] + in[k][a];
    return {out};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    detail::join_blocks<T>(args, N, detail::axis_index(Axis, args.output_shape.rank()));
  }

  template <std::size_t K>
    requires(K < static_cast<std::size_t>(N))
  auto grad_op() const {
    return ConcatGradOp<Axis, static_cast<int>(K)>{};
  }

  static std::string op_name() { return "Concat<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::concat<" + std::to_string(Axis) + ">"; }
};

// d/d input K of concat: input K's block of dy. It reads inputs 0 to K for their sizes along
// the axis, which place input K's block.
template <int Axis, int K>
struct ConcatGradOp : Primitive<ConcatGradOp<Axis, K>> {
  static constexpr auto reads = []<std::size_t... I>(std::index_sequence<I...>) {
    return std::array{graph::Operand::grad, graph::input_operand(I)...};
  }(std::make_index_sequence<static_cast<std::size_t>(K) + 1>{});
  static constexpr int arity = K + 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[static_cast<std::size_t>(K) + 1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const int a = detail::axis_index(Axis, args.in_shape(0).rank());
    index_t offset = 0;
    for (std::size_t k = 1; k <= static_cast<std::size_t>(K); ++k) offset += args.in_shape(k).numel_from(a);
    detail::take_block<T>(args, a, offset);
  }

  static std::string op_name() { return "ConcatGrad<" + std::to_string(Axis) + ", " + std::to_string(K) + ">"; }
};

template <int Axis = 0, class X0, class... X>
auto concat(const X0& x0, const X&... x) {
  return apply(ConcatOp<Axis, 1 + static_cast<int>(sizeof...(X))>{}, x0, x...);
}

// ----------------------------------------------------------------------------------------
// stack<Axis>(x0, x1, ...): inputs of one shape stacked along a new axis Axis, in
// [-rank - 1, rank] (MindSpore's stack(tensors, axis)). A copy: concat's kernel, each
// input's block being all of it past the axis.

template <int Axis, int K>
struct StackGradOp;

template <int Axis, int N>
struct StackOp : Primitive<StackOp<Axis, N>> {
  static_assert(N >= 1, "duet::ops::stack: needs at least one input");
  static constexpr int arity = N;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    for (const Shape& x : in)
      if (x.leading_unknown()) return {Shape::any()};
    Shape common;
    if (const int k = detail::merge_sizes(in, -1, common)) return fault(common, ShapeFault::shapes_differ, 0, k);
    const int a = detail::axis_index(Axis, common.rank() + 1);
    if (a < 0) return fault(common, ShapeFault::min_rank, Axis < 0 ? -Axis - 1 : Axis);
    return {detail::with_axis(common, a, N)};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    detail::join_blocks<T>(args, N, detail::axis_index(Axis, args.output_shape.rank()));
  }

  template <std::size_t K>
    requires(K < static_cast<std::size_t>(N))
  auto grad_op() const {
    return StackGradOp<Axis, static_cast<int>(K)>{};
  }

  static std::string op_name() { return "Stack<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::stack<" + std::to_string(Axis) + ">"; }
};

// d/d input K of stack: entry K of dy along the stacked axis.
template <int Axis, int K>
struct StackGradOp : Primitive<StackGradOp<Axis, K>> {
  static constexpr std::array reads{graph::Operand::grad};
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& dy = in[0];
    if (dy.leading_unknown()) return {Shape::any()};
    return {detail::without_axis(dy, detail::axis_index(Axis, dy.rank()))};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const int a = detail::axis_index(Axis, args.in_shape(0).rank());
    detail::take_block<T>(args, a, K * args.output_shape.numel_from(a));
  }

  static std::string op_name() { return "StackGrad<" + std::to_string(Axis) + ", " + std::to_string(K) + ">"; }
};

template <int Axis = 0, class X0, class... X>
auto stack(const X0& x0, const X&... x) {
  return apply(StackOp<Axis, 1 + static_cast<int>(sizeof...(X))>{}, x0, x...);
}

// ----------------------------------------------------------------------------------------
// Slices. A slice reads, along each axis a, count[a] elements step[a] apart from start[a]; its
// gradient scatters dy back into zeros of the input's shape. One rule per kind of slice
// gives that window from the input's shape; the kernels are shared.

namespace detail {

struct Window {
  Shape count;
  std::array<index_t, max_rank> start{};
  std::array<index_t, max_rank> step{};
  ShapeFault fault = ShapeFault::none;
  index_t expected = 0;
};

// The window a slice op reads from an input of shape x, as a shape rule's result.
template <class Op>
constexpr ShapeResult window_result(const Shape& x) {
  if (x.leading_unknown()) return {Shape::any()};
  const Window w = Op::window(x);
  if (w.fault != ShapeFault::none) return fault(x, w.fault, w.expected);
  return {w.count};
}

template <class T>
void read_window(const Window& w, const Shape& in, const T* x, T* y) {
  const auto in_stride = strides_of(in);
  std::array<index_t, max_rank> stride{};
  index_t first = 0;
  for (std::size_t a = 0; a < static_cast<std::size_t>(in.rank()); ++a) {
    stride[a] = in_stride[a] * w.step[a];
    first += in_stride[a] * w.start[a];
  }
  for_each_strided(first, stride, w.count, [&](index_t i, index_t j) { y[i] = x[j]; });
}

template <class T>
void scatter_window(const Window& w, const Shape& in, const T* dy, T* dx) {
  std::fill_n(dx, in.numel(), T(0));
  const auto in_stride = strides_of(in);
  std::array<index_t, max_rank> stride{};
  index_t first = 0;
  for (std::size_t a = 0; a < static_cast<std::size_t>(in.rank()); ++a) {
    stride[a] = in_stride[a] * w.step[a];
    first += in_stride[a] * w.start[a];
  }
  for_each_strided(first, stride, w.count, [&](index_t i, index_t j) { dx[j] = dy[i]; });
}

}  // namespace detail

// The gradient of slice op Fwd: dy in Fwd's window of zeros shaped like the forward input.
template <class Fwd>
struct SliceGradOp : Primitive<SliceGradOp<Fwd>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    detail::scatter_window(Fwd::window(args.in_shape(1)), args.in_shape(1), args.in<T>(0), args.out<T>());
  }

  static std::string op_name() { return Fwd::op_name() + "Grad"; }
};

// What every slice op shares: its rule and kernel from its window, its gradient.
template <class Self>
struct SlicePrimitive : Primitive<Self> {
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::window_result<Self>(in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::read_window(Self::window(a.in_shape()), a.in_shape(), a.in<T>(), a.out<T>());
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return SliceGradOp<Self>{};
  }
};

// strided_slice(x, ints<begin...>, ints<end...>, ints<strides...>): along axis a, from
// begin[a] up to (not including) end[a], strides[a] apart, as Python's x[begin:end:stride];
// negative indices count from the end, indices past either end are clamped, a negative
// stride walks backwards. Axes past the lists are taken whole (MindSpore's strided_slice
// without its masks). slice(x, ints<begin...>, ints<size...>) takes size[a] elements from
// begin[a] (-1: the rest), which must lie inside the axis (MindSpore's slice).
template <class Begin, class End, class Strides, bool Checked>
struct StridedSliceOp : SlicePrimitive<StridedSliceOp<Begin, End, Strides, Checked>> {
  static constexpr std::size_t n = Begin::values.size();
  static_assert(End::values.size() == n && Strides::values.size() == n,
                "duet::ops::strided_slice: begin, end and strides must have one entry per axis sliced");
  static_assert(std::ranges::none_of(Strides::values, [](index_t s) { return s == 0; }),
                "duet::ops::strided_slice: a stride cannot be 0");

  // Cutting the first axis only, one step at a time: the elements are one run of the input's.
  static constexpr bool is_view = [] {
    if (n == 0) return true;
    if (Strides::values[0] != 1) return false;
    for (std::size_t a = 1; a < n; ++a) {
      if (Begin::values[a] != 0 || End::values[a] != to_end || Strides::values[a] != 1) return false;
    }
    return true;
  }();
  index_t view_offset(const Shape& x) const { return x.rank() == 0 ? 0 : window(x).start[0] * x.numel_from(1); }

  static constexpr detail::Window window(const Shape& x) {
    detail::Window w;
    w.count = x;
    if (static_cast<int>(n) > x.rank()) {
      w.fault = ShapeFault::min_rank;
      w.expected = static_cast<index_t>(n);
      return w;
    }
    for (std::size_t a = 0; a < static_cast<std::size_t>(x.rank()); ++a) {
      const int axis = static_cast<int>(a);
      const index_t size = x[axis];
      w.step[a] = 1;
      if (a >= n) continue;
      if (size == dyn) {
        w.count[axis] = dyn;
        continue;
      }
      const index_t stride = Strides::values[a];
      index_t b = Begin::values[a];
      index_t e = End::values[a];
      if constexpr (Checked) {
        if (e == to_end) e = size;
        if (b > size || e < b || e > size) {
          w.fault = ShapeFault::slice_range;
          w.expected = axis;
          return w;
        }
      }
      if (b < 0) b += size;
      if (e < 0) e += size;
      // to_end is Python's omitted end: past the last element in the stride's direction.
      if (End::values[a] == to_end && stride < 0) e = -1;
      // Python's clamping: [0, size] walking forwards, [-1, size - 1] backwards.
      const index_t lo = stride > 0 ? 0 : -1;
      const index_t hi = stride > 0 ? size : size - 1;
      b = std::clamp(b, lo, hi);
      e = std::clamp(e, lo, hi);
      const index_t span = stride > 0 ? e - b : b - e;
      const index_t abs_stride = stride > 0 ? stride : -stride;
      w.start[a] = b;
      w.step[a] = stride;
      w.count[axis] = span <= 0 ? 0 : (span + abs_stride - 1) / abs_stride;
    }
    return w;
  }

  static std::string op_name() {
    return std::string(Checked ? "Slice" : "StridedSlice") + "<" + lists() + ">";
  }
  std::string label() const { return std::string(Checked ? "ops::slice" : "ops::strided_slice") + "<" + lists() + ">"; }

 private:
  static std::string lists() {
    const auto text = [](const auto& values) {
      std::string out = "[";
      for (index_t v : values) {
        out += (out.size() > 1 ? ", " : "") + (v == to_end ? std::string("end") : std::to_string(v));
      }
      return out + "]";
    };
    return text(Begin::values) + ", " + text(End::values) + (Checked ? std::string() : ", " + text(Strides::values));
  }
};

template <class X, index_t... B, index_t... E, index_t... S>
auto strided_slice(X&& x, Ints<B...>, Ints<E...>, Ints<S...>) {
  return apply(StridedSliceOp<Ints<B...>, Ints<E...>, Ints<S...>, false>{}, std::forward<X>(x));
}

template <class X, index_t... B, index_t... Size>
auto slice(X&& x, Ints<B...>, Ints<Size...>) {
  static_assert(sizeof...(B) == sizeof...(Size),
                "duet::ops::slice: begin and size must have one entry per axis sliced");
  static_assert(((B >= 0) && ...), "duet::ops::slice: begin must be >= 0");
  static_assert(((Size >= -1) && ...), "duet::ops::slice: a size must be >= 0, or -1 for the rest of the axis");
  using Op = StridedSliceOp<Ints<B...>, Ints<(Size == -1 ? to_end : B + Size)...>, Ints<(B * 0 + 1)...>, true>;
  return apply(Op{}, std::forward<X>(x));
}

// ----------------------------------------------------------------------------------------
// split<Axis, Sizes...>(x): x cut along Axis into pieces of these sizes, which must add up to
// the axis's size (MindSpore's split(tensor, split_size_or_sections, axis) with sections).
// duet's operations make one value each, so split returns a std::tuple of one slice
// operation per piece: each reads x, and the gradients of the pieces that are used add up
// in x's gradient. Sizes are template arguments because they give the number of outputs.

namespace detail {
// Where each piece begins: the sizes before it, added.
template <std::size_t N>
constexpr std::array<index_t, N> prefix_sums(const std::array<index_t, N>& sizes) {
  std::array<index_t, N> b{};
  for (std::size_t i = 1; i < N; ++i) b[i] = b[i - 1] + sizes[i - 1];
  return b;
}
}  // namespace detail

template <int Axis, index_t Total, index_t Begin, index_t Size>
struct SplitOp : SlicePrimitive<SplitOp<Axis, Total, Begin, Size>> {
  // A piece along the first axis is one run of the input's elements.
  static constexpr bool is_view = Axis == 0;
  index_t view_offset(const Shape& x) const { return Begin * x.numel_from(1); }

  static constexpr detail::Window window(const Shape& x) {
    detail::Window w;
    w.count = x;
    w.step.fill(1);
    const int a = detail::axis_index(Axis, x.rank());
    if (a < 0) {
      w.fault = ShapeFault::min_rank;
      w.expected = Axis < 0 ? -Axis : Axis + 1;
    } else if (x[a] != dyn && x[a] != Total) {
      w.fault = ShapeFault::axis_size;
      w.expected = Total;
    } else {
      w.start[static_cast<std::size_t>(a)] = Begin;
      w.count[a] = Size;
    }
    return w;
  }

  static std::string op_name() {
    return "Split<" + std::to_string(Axis) + ">[" + std::to_string(Begin) + ":" + std::to_string(Begin + Size) + "]";
  }
  std::string label() const {
    return "ops::split<" + std::to_string(Axis) + "> piece [" + std::to_string(Begin) + ", " +
           std::to_string(Begin + Size) + ") of " + std::to_string(Total);
  }
};

template <int Axis, index_t... Sizes, class X>
auto split(const X& x) {
  static_assert(sizeof...(Sizes) >= 1, "duet::ops::split: give the size of each piece");
  static_assert(((Sizes >= 0) && ...), "duet::ops::split: sizes must be >= 0");
  constexpr std::array<index_t, sizeof...(Sizes)> sizes{Sizes...};
  constexpr std::array<index_t, sizeof...(Sizes)> begins = detail::prefix_sums(sizes);
  constexpr index_t total = begins.back() + sizes.back();
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::make_tuple(apply(SplitOp<Axis, total, begins[I], sizes[I]>{}, x)...);
  }(std::make_index_sequence<sizeof...(Sizes)>{});
}

// ----------------------------------------------------------------------------------------
// gather<Axis>(params, indices): the slices of params along Axis that int32 indices name,
// in the indices' shape: output shape params[:Axis] + indices + params[Axis + 1:]
// (MindSpore's gather(input_params, input_indices, axis)). An index outside [0, size) is a
// duet::IndexError. The indices have no gradient; params' gradient adds dy's slices back
// where they were read from, so an index read twice gets both.

namespace detail {
// Checks every index before anything is read with it.
inline void check_indices(const std::int32_t* idx, index_t n, index_t bound, const std::string& who) {
  for (index_t i = 0; i < n; ++i) {
    if (idx[i] < 0 || idx[i] >= bound) {
      throw IndexError(who + ": index " + std::to_string(idx[i]) + " (element " + std::to_string(i) +
                       " of the indices) is out of range [0, " + std::to_string(bound) + ")");
    }
  }
}

// Calls f(output offset, params offset, count) for each run of `inner` elements gather copies.
template <class F>
void for_each_gathered(const Shape& params, int a, const std::int32_t* idx, index_t n_idx, F&& f) {
  const index_t inner = params.numel_from(a + 1);
  const index_t rows = params.numel() / params.numel_from(a);
  const index_t size = params[a];
  for (index_t r = 0; r < rows; ++r) {
    for (index_t j = 0; j < n_idx; ++j) f((r * n_idx + j) * inner, (r * size + idx[j]) * inner, inner);
  }
}
}  // namespace detail

template <int Axis>
struct GatherGradOp;

template <int Axis>
struct GatherOp : Primitive<GatherOp<Axis>> {
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& p = in[0];
    const Shape& idx = in[1];
    if (p.leading_unknown() || idx.leading_unknown()) return {Shape::any()};
    const int a = detail::axis_index(Axis, p.rank());
    if (a < 0) return fault(p, ShapeFault::min_rank, Axis < 0 ? -Axis : Axis + 1);
    Shape out;
    for (int i = 0; i < a; ++i) out.push_back(p[i]);
    for (index_t d : idx) out.push_back(d);
    for (int i = a + 1; i < p.rank(); ++i) out.push_back(p[i]);
    return {out};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const Shape& p = args.in_shape(0);
    const int a = detail::axis_index(Axis, p.rank());
    const std::int32_t* idx = args.in<std::int32_t>(1);
    const index_t n_idx = args.in_shape(1).numel();
    detail::check_indices(idx, n_idx, p[a], label());
    const T* x = args.in<T>(0);
    T* y = args.out<T>();
    detail::for_each_gathered(p, a, idx, n_idx, [&](index_t o, index_t i, index_t n) { std::copy_n(x + i, n, y + o); });
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    if constexpr (K == 0) return GatherGradOp<Axis>{};
    else return NoGradient{};
  }

  static std::string op_name() { return "Gather<" + std::to_string(Axis) + ">"; }
  std::string label() const { return "ops::gather<" + std::to_string(Axis) + ">"; }
};

// d/d params of gather: zeros, with each slice of dy added where its index points.
template <int Axis>
struct GatherGradOp : Primitive<GatherGradOp<Axis>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& args) const {
    const Shape& p = args.in_shape(1);
    const int a = detail::axis_index(Axis, p.rank());
    const std::int32_t* idx = args.in<std::int32_t>(2);
    const index_t n_idx = args.in_shape(2).numel();
    detail::check_indices(idx, n_idx, p[a], "ops::gather<" + std::to_string(Axis) + "> (gradient)");
    const T* dy = args.in<T>(0);
    T* dx = args.out<T>();
    std::fill_n(dx, p.numel(), T(0));
    detail::for_each_gathered(p, a, idx, n_idx, [&](index_t o, index_t i, index_t n) {
      for (index_t k = 0; k < n; ++k) dx[i + k] += dy[o + k];
    });
  }

  static std::string op_name() { return "GatherGrad<" + std::to_string(Axis) + ">"; }
};

template <int Axis = 0, class P, class I>
auto gather(const P& params, const I& indices) {
  static_assert(std::is_same_v<typename std::remove_cvref_t<I>::value_type, std::int32_t>,
                "duet::ops::gather: the indices must be int32 tensors");
  return apply(GatherOp<Axis>{}, params, indices);
}

inline const bool shape_listed = list_operations({"reshape", "transpose", "permute", "expand_dims", "squeeze", "concat",
                                                  "stack", "split", "slice", "strided_slice", "gather"});

}  // namespace ops
}  // namespace duet

namespace duet {
namespace ops {

template <class Layer>
struct EmbeddingGradOp;

namespace detail {
// Indices must be int32; In is the element type of what was passed.
template <class In>
void require_int32_indices(const std::string& who) {
  if constexpr (!std::is_same_v<In, std::int32_t>) {
    throw ValueError(who + " takes int32 indices, got a tensor of " + std::string(name_of(dtype_of<In>)));
  }
}
}  // namespace detail

// table[indices]: for indices of shape S, the rows of the layer's table they name, of shape
// S + [embedding_size]. An index outside [0, vocab_size) is a duet::IndexError. The indices have
// no gradient; the table's adds each row of dy where its index points (gather's rule, whose
// index check and row walk it shares). In is the indices' element type: any other than int32
// is refused when the operation runs.
template <class Layer, class In = std::int32_t>
struct EmbeddingOp : Primitive<EmbeddingOp<Layer, In>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  EmbeddingOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult rule(index_t embedding_size, const Shape& indices) {
    Shape y = indices;
    y.push_back(embedding_size);
    return {y};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::embedding_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(layer->embedding_size(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::require_int32_indices<In>(label());
    const std::int32_t* idx = a.in<std::int32_t>();
    const index_t n = a.in_shape().numel();
    const Shape& table = layer->embedding_table.shape();
    detail::check_indices(idx, n, table[0], label());
    const T* rows = layer->embedding_table.data();
    T* y = a.out<T>();
    detail::for_each_gathered(table, 0, idx, n, [&](index_t o, index_t i, index_t count) { std::copy_n(rows + i, count, y + o); });
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }
  auto parameter_grad_op() const { return EmbeddingGradOp<Layer>{layer}; }

  static std::string op_name() { return "Embedding"; }
  std::string label() const { return layer->label(); }
};

// d/d table of EmbeddingOp: each row of dy added to the table row its index names, in index
// order (an index read twice gets both).
template <class Layer>
struct EmbeddingGradOp : Primitive<EmbeddingGradOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, indices
  static constexpr bool is_sink = true;

  const Layer* layer;
  EmbeddingGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const std::int32_t* idx = a.in<std::int32_t>(1);
    const index_t n = a.in_shape(1).numel();
    const Shape& table = layer->embedding_table.shape();
    detail::check_indices(idx, n, table[0], layer->label() + " (gradient)");
    bool accumulate = false;
    T* dtable = layer->embedding_table.grad_for_write(duet::detail::current_backward_pass(), &accumulate);
    if (!accumulate) std::fill_n(dtable, table.numel(), T(0));
    const T* dy = a.in<T>(0);
    detail::for_each_gathered(table, 0, idx, n, [&](index_t o, index_t i, index_t count) {
      ::Eigen::Map<Array>(dtable + i, count) += ::Eigen::Map<const Array>(dy + o, count);
    });
  }

  static std::string op_name() { return "EmbeddingGrad (parameters only)"; }
  std::string label() const { return layer->label(); }
};

inline const bool embedding_listed = list_operations({"Embedding"});

}  // namespace ops

namespace nn {

// nn::Embedding's options (MindSpore's embedding_table, padding_idx): the table's initialiser,
// MindSpore's 'normal' (Normal(sigma=0.01)) if unset; padding_idx, a row set to zeros after it.
template <ElementType T>
struct EmbeddingOptions {
  std::optional<initializer::AnyInitializer<T>> embedding_table = std::nullopt;
  std::optional<index_t> padding_idx = std::nullopt;
};

// MindSpore's nn.Embedding(vocab_size, embedding_size): int32 indices of any shape S in, the
// rows of the table `embedding_table` ([vocab_size, embedding_size], its checkpoint name as in
// MindSpore; PyTorch calls it weight) they name out, of shape S + [embedding_size]. An index
// outside [0, vocab_size) is a duet::IndexError in both modes. Vocab and Dim are compile-time
// sizes (nn::Embedding<1000, 64>), or duet::dyn for sizes given to the constructor. As in
// MindSpore, padding_idx only zeroes its row at construction; its row still learns (PyTorch's
// padding_idx also keeps its gradient at zero).
template <index_t Vocab = dyn, index_t Dim = dyn, ElementType T = float>
class Embedding : public Cell<Embedding<Vocab, Dim, T>, CONTEXT_MODE, T> {
  static_assert(Vocab == dyn || Vocab > 0, "nn::Embedding<Vocab, Dim>: Vocab must be positive (or duet::dyn)");
  static_assert(Dim == dyn || Dim > 0, "nn::Embedding<Vocab, Dim>: Dim must be positive (or duet::dyn)");

 public:
  static constexpr index_t embedding_static = Dim;
  using input_value_type = std::int32_t;  // called with indices (Cell's call for them)

  BasicParameter<T> embedding_table;  // [vocab_size, embedding_size]
  DUET_CELL_MEMBERS(embedding_table);

  using Options = EmbeddingOptions<T>;

  Embedding() requires(Vocab != dyn && Dim != dyn) : Embedding(Vocab, Dim) {}
  explicit Embedding(Options options) requires(Vocab != dyn && Dim != dyn) : Embedding(Vocab, Dim, std::move(options)) {}

  Embedding(index_t vocab_size, index_t embedding_size, Options options = {}) : dim_(embedding_size) {
    if ((Vocab != dyn && vocab_size != Vocab) || (Dim != dyn && embedding_size != Dim) || vocab_size <= 0 ||
        embedding_size <= 0) {
      throw ValueError(type_name() + ": cannot be built with vocab_size " + std::to_string(vocab_size) +
                       " and embedding_size " + std::to_string(embedding_size));
    }
    if (options.padding_idx && (*options.padding_idx < 0 || *options.padding_idx >= vocab_size)) {
      throw ValueError(type_name() + ": padding_idx " + std::to_string(*options.padding_idx) + " is outside [0, " +
                       std::to_string(vocab_size) + ")");
    }
    auto table = BasicTensor<T>::uninitialized({vocab_size, embedding_size});
    const initializer::AnyInitializer<T> init = options.embedding_table.value_or(initializer::Normal{});
    try {
      initializer::initialize(table, init);
    } catch (const ValueError& e) {
      throw ValueError(type_name() + " embedding_table: " + e.what());
    }
    if (options.padding_idx) std::fill_n(table.data() + *options.padding_idx * embedding_size, embedding_size, T(0));
    embedding_table = BasicParameter<T>(std::move(table));
  }

  index_t vocab_size() const { return embedding_table.shape()[0]; }
  index_t embedding_size() const {
    if constexpr (Dim != dyn)
      return Dim;
    else
      return dim_;
  }

  // Indices of another element type compile (the one-tensor call of every cell instantiates
  // construct for tensors of T) and are refused when they run.
  template <class X>
  auto construct(X&& indices) {
    using In = typename std::remove_cvref_t<X>::value_type;
    return apply(ops::EmbeddingOp<Embedding, In>{this}, std::forward<X>(indices));
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = "nn::Embedding<" + size(Vocab) + ", " + size(Dim);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  index_t dim_;
};

}  // namespace nn
}  // namespace duet
// Reshaping layers. They move no data: in both modes their output is a view of their input.

#include <array>
#include <string>
#include <utility>


namespace duet {
namespace ops {

// [N, d1, d2, ...] -> [N, d1 * d2 * ...].
struct FlattenOp : Primitive<FlattenOp> {
  static constexpr int arity = 1;
  static constexpr bool is_view = true;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    const Shape& x = in[0];
    if (x.leading_unknown()) return {Shape{dyn, dyn}};
    // A rank-1 input is one sample without its batch dimension; flattening it as a batch of
    // one-element samples would only surface, puzzlingly, at the next layer.
    if (x.rank() < 2) return fault(Shape{1, x.numel()}, ShapeFault::batch_dimension, 2);
    return {Shape{x[0], x.numel_from(1)}};
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReshapeLikeOp{};
  }

  static std::string op_name() { return "Flatten"; }
  std::string label() const { return "nn::Flatten"; }
  Interchange interchange(std::span<const Shape>) const {
    return {{"Flatten", {InterchangeInput::operand(0)}, {InterchangeAttribute::of("axis", 1)}}};
  }
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

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
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
template <Reduction R>
struct SoftmaxCrossEntropyLabelGradOp;

// The reduced shape of a loss over per-row (or per-element) values of shape `rows`.
constexpr Shape reduced(const Shape& rows, Reduction r) { return r == Reduction::none ? rows : Shape{}; }

// Logits [..., classes] and labels [...] (sparse) or [..., classes]; the loss per row, or its
// mean or sum.
template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyOp : Primitive<SoftmaxCrossEntropyOp<Sparse, R>> {
  static_assert(R != Reduction::batchmean, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
  using layer_type = nn::BasicSoftmaxCrossEntropyWithLogits<Sparse, R, float>;
  static constexpr int arity = 2;

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

  template <std::size_t K>
  auto grad_op() const {
    if constexpr (K == 0) return SoftmaxCrossEntropyGradOp<Sparse, R>{};
    else if constexpr (Sparse) return NoGradient{};  // class indices
    else return SoftmaxCrossEntropyLabelGradOp<R>{};
  }

  static std::string op_name() { return "SoftmaxCrossEntropy"; }
  std::string label() const { return "nn::SoftmaxCrossEntropyWithLogits"; }
};

template <bool Sparse, Reduction R>
struct SoftmaxCrossEntropyGradOp : Primitive<SoftmaxCrossEntropyGradOp<Sparse, R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;  // g, logits, labels

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using L = std::conditional_t<Sparse, std::int32_t, T>;
    const index_t classes = a.in_shape(1).back();
    Backend::template softmax_cross_entropy_grad<Sparse>(a.in<T>(0), a.in<T>(1), a.in<L>(2),
                                                         a.in_shape(1).numel() / classes, classes, R, a.out<T>());
  }

  static std::string op_name() { return "SoftmaxCrossEntropyGrad"; }
};

template <Reduction R, bool Target>
struct MSEGradOp;

// (prediction - target)² per element, or its mean or sum.
template <Reduction R>
struct MSEOp : Primitive<MSEOp<R>> {
  static_assert(R != Reduction::batchmean, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
  using layer_type = nn::BasicMSELoss<R, float>;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if (in[0].is_concrete() && in[1].is_concrete() && !(in[0] == in[1])) {
      return fault(reduced(in[0], R), ShapeFault::shapes_differ, 0, 1);
    }
    return {reduced(in[0], R)};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::mse(a.in<T>(0), a.in<T>(1), a.in_shape(0).numel(), R, a.out<T>());
  }

  // d/d target is d/d prediction with the two swapped: 2 (target - prediction).
  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return MSEGradOp<R, K == 1>{};
  }

  static std::string op_name() { return "MSE"; }
  std::string label() const { return "nn::MSELoss"; }
};

template <Reduction R, bool Target>
struct MSEGradOp : Primitive<MSEGradOp<R, Target>> {
  static constexpr std::array reads{graph::Operand::grad, Target ? graph::Operand::input1 : graph::Operand::input0,
                                    Target ? graph::Operand::input0 : graph::Operand::input1};
  static constexpr int arity = 3;  // g, the value differentiated, the other

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    Backend::mse_grad(a.in<T>(0), a.in<T>(1), a.in<T>(2), a.in_shape(1).numel(), R, a.out<T>());
  }

  static std::string op_name() { return "MSEGrad"; }
};

// d/d labels of the dense form: -log_softmax(logits), scaled as the loss reduces. (MindSpore
// gives labels no gradient; PyTorch gives this one, the derivative.)
template <Reduction R>
struct SoftmaxCrossEntropyLabelGradOp : Primitive<SoftmaxCrossEntropyLabelGradOp<R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // g, logits

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* g = a.in<T>(0);
    const T* z = a.in<T>(1);
    T* d = a.out<T>();
    const index_t classes = a.in_shape(1).back();
    const index_t rows = classes == 0 ? 0 : a.in_shape(1).numel() / classes;
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      const T lse = kernels::log_sum_exp(row, classes);
      const T scale = R == Reduction::none ? g[i] : R == Reduction::mean ? g[0] / static_cast<T>(rows) : g[0];
      for (index_t c = 0; c < classes; ++c) d[i * classes + c] = (lse - row[c]) * scale;
    }
  }

  static std::string op_name() { return "SoftmaxCrossEntropyLabelGrad"; }
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
  static constexpr Reduction reduction = R;
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
  static constexpr Reduction reduction = R;
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

// ---------------------------------------------------------------------------------------------
// More losses (MindSpore's nn.L1Loss, SmoothL1Loss, KLDivLoss, BCEWithLogitsLoss, NLLLoss and
// CrossEntropyLoss). `reduction` is a template argument, as for the two above: it changes the
// output's shape, hence the graph's type. Numbers that do not change the shape (beta,
// label_smoothing, ignore_index) are members of the operation.
namespace duet {
namespace nn {

template <class Fn, Reduction R, ElementType T>
class BasicPointwiseLoss;
template <bool Logits, Reduction R, ElementType T>
class BasicClassLoss;

}  // namespace nn

namespace fn {

// The pointwise losses: value(x, y) per element, and its partial derivative in each argument,
// partial<K>(x, y), all on Eigen arrays so that the kernels vectorise (exp, log1p, logistic).
// They return expressions, evaluated once into the output: no temporary array per call.
// Each formula is PyTorch's, stated beside it; MindSpore's are the same.

// torch.nn.L1Loss: |x - y|. d/dx = sign(x - y), 0 at x = y (torch.sign(0) = 0).
struct L1Loss {
  static constexpr std::string_view name = "nn::L1Loss";
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    return (x - y).abs();
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    return S(K == 0 ? 1 : -1) * (x - y).sign();
  }
};

// torch.nn.SmoothL1Loss(beta): 0.5 d² / beta where |d| < beta, |d| - 0.5 beta elsewhere,
// d = x - y. beta = 0 is the L1 loss (the quadratic branch is never taken).
struct SmoothL1Loss {
  static constexpr std::string_view name = "nn::SmoothL1Loss";
  double beta = 1.0;
  void validate() const {
    if (!(beta >= 0)) throw ValueError("nn::SmoothL1Loss: beta must be >= 0, got " + std::to_string(beta));
  }
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    const S b = static_cast<S>(beta);
    return ((x - y).abs() < b).select(S(0.5) * (x - y).square() / b, (x - y).abs() - S(0.5) * b);
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    const S b = static_cast<S>(beta);
    return S(K == 0 ? 1 : -1) * ((x - y).abs() < b).select((x - y) / b, (x - y).sign());
  }
};

// MindSpore's nn.KLDivLoss (torch.nn.KLDivLoss, log_target=False): the input x is a
// log-probability, the target y a probability, and the loss y (log y - x), 0 where y = 0
// (torch.xlogy). d/dx = -y; d/dy = log y + 1 - x, which is -inf at y = 0 as the function's
// slope is.
struct KLDivLoss {
  static constexpr std::string_view name = "nn::KLDivLoss";
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    return (y == S(0)).select(X::Zero(x.rows(), x.cols()), y * (y.log() - x));
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    if constexpr (K == 0) return -y;
    else return y.log() + S(1) - x;
  }
};

// torch.nn.BCEWithLogitsLoss: -[y log σ(x) + (1 - y) log(1 - σ(x))], in the form that neither
// overflows nor loses digits for large |x|: max(x, 0) - x y + log1p(exp(-|x|)).
// d/dx = σ(x) - y; d/dy = -x.
struct BCEWithLogitsLoss {
  static constexpr std::string_view name = "nn::BCEWithLogitsLoss";
  template <class X, class Y>
  auto value(const X& x, const Y& y) const {
    using S = typename X::Scalar;
    return x.max(S(0)) - x * y + (-x.abs()).exp().log1p();
  }
  template <int K, class X, class Y>
  auto partial(const X& x, const Y& y) const {
    if constexpr (K == 0) return x.logistic() - y;
    else return -x;
  }
};

}  // namespace fn

namespace ops {

namespace detail {

// What a mean divides the sum of a loss's n values, of shape `s`, by: n, or for batchmean
// the size of axis 0 (MindSpore's KLDivLoss; a scalar has none, refused by the shape rule).
template <Reduction R>
index_t mean_count(const Shape& s) {
  if constexpr (R == Reduction::batchmean) return s.rank() == 0 ? 0 : s[0];
  else return s.numel();
}

// A loss over per-element values of `values` shape: they, or their sum, or that sum divided
// by `count` (mean_count).
template <Reduction R, class T, class A>
void reduce_loss(const A& values, index_t n, index_t count, T* out) {
  using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  if constexpr (R == Reduction::none) ::Eigen::Map<Array>(out, n) = values;
  else if constexpr (R == Reduction::sum) out[0] = n == 0 ? T(0) : values.sum();
  else out[0] = n == 0 || count == 0 ? T(0) : values.sum() / static_cast<T>(count);
}

// The incoming gradient of a reduced loss as each of its terms sees it; a mean's terms are
// `count`.
template <Reduction R, class T>
T reduced_scale(const T* g, index_t count) {
  if constexpr (R == Reduction::mean || R == Reduction::batchmean) return count == 0 ? T(0) : g[0] / static_cast<T>(count);
  else return g[0];
}

}  // namespace detail

template <class Fn, Reduction R, int K>
struct PointwiseLossGradOp;

// Fn's loss between a prediction and a target of the same shape, per element or reduced.
template <class Fn, Reduction R>
struct PointwiseLossOp : Primitive<PointwiseLossOp<Fn, R>> {
  static_assert(R != Reduction::batchmean || std::is_same_v<Fn, fn::KLDivLoss>, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
  using layer_type = nn::BasicPointwiseLoss<Fn, R, float>;
  static constexpr int arity = 2;
  Fn fn;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    if (in[0].is_concrete() && in[1].is_concrete() && !(in[0] == in[1])) {
      return fault(reduced(in[0], R), ShapeFault::shapes_differ, 0, 1);
    }
    // batchmean divides by the size of axis 0, which a scalar does not have (MindSpore refuses it).
    if (R == Reduction::batchmean && in[0].rank() == 0 && !in[0].leading_unknown()) {
      return fault(Shape{}, ShapeFault::min_rank, 1);
    }
    return {reduced(in[0], R)};
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const index_t n = a.in_shape(0).numel();
    detail::reduce_loss<R>(fn.value(::Eigen::Map<const Array>(a.in<T>(0), n), ::Eigen::Map<const Array>(a.in<T>(1), n)),
                           n, detail::mean_count<R>(a.in_shape(0)), a.out<T>());
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return PointwiseLossGradOp<Fn, R, static_cast<int>(K)>{{}, fn};
  }

  static std::string op_name() { return std::string(Fn::name).substr(4); }
  std::string label() const { return std::string(Fn::name); }
};

// d/d input K of PointwiseLossOp: the partial times the incoming gradient, which is one value
// per element (no reduction) or one for all.
template <class Fn, Reduction R, int K>
struct PointwiseLossGradOp : Primitive<PointwiseLossGradOp<Fn, R, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;  // g, prediction, target
  Fn fn;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const index_t n = a.in_shape(1).numel();
    const auto partial =
        fn.template partial<K>(::Eigen::Map<const Array>(a.in<T>(1), n), ::Eigen::Map<const Array>(a.in<T>(2), n));
    if constexpr (R == Reduction::none) {
      ::Eigen::Map<Array>(a.out<T>(), n) = partial * ::Eigen::Map<const Array>(a.in<T>(0), n);
    } else {
      ::Eigen::Map<Array>(a.out<T>(), n) = partial * detail::reduced_scale<R>(a.in<T>(0), detail::mean_count<R>(a.in_shape(1)));
    }
  }

  static std::string op_name() { return std::string(Fn::name).substr(4) + "Grad" + std::to_string(K); }
};

template <class Fn, Reduction R, class X, class Y>
auto pointwise_loss(const Fn& fn, const X& prediction, const Y& target) {
  static_assert(
      std::is_same_v<typename std::remove_cvref_t<X>::value_type, typename std::remove_cvref_t<Y>::value_type>,
      "duet::ops: a loss's prediction and target must have the same element type");
  if constexpr (requires { fn.validate(); }) fn.validate();
  return apply(PointwiseLossOp<Fn, R>{{}, fn}, prediction, target);
}

// MindSpore's ops.l1_loss(input, target, reduction='mean').
template <Reduction R = Reduction::mean, class X, class Y>
auto l1_loss(const X& input, const Y& target) {
  return pointwise_loss<fn::L1Loss, R>(fn::L1Loss{}, input, target);
}

// MindSpore's ops.smooth_l1_loss(input, target, beta=1.0, reduction='none').
template <Reduction R = Reduction::none, class X, class Y>
auto smooth_l1_loss(const X& input, const Y& target, double beta = 1.0) {
  return pointwise_loss<fn::SmoothL1Loss, R>(fn::SmoothL1Loss{beta}, input, target);
}

// MindSpore's ops.kl_div(logits, labels, reduction='mean'): logits are log-probabilities.
// 'mean' averages over every element, as MindSpore's and PyTorch's 'mean' do; the KL
// divergence proper is Reduction::batchmean, the sum divided by the size of axis 0.
template <Reduction R = Reduction::mean, class X, class Y>
auto kl_div(const X& logits, const Y& labels) {
  return pointwise_loss<fn::KLDivLoss, R>(fn::KLDivLoss{}, logits, labels);
}

// MindSpore's ops.binary_cross_entropy_with_logits(logits, label, weight=None,
// pos_weight=None, reduction='mean'), without weight and pos_weight.
template <Reduction R = Reduction::mean, class X, class Y>
auto binary_cross_entropy_with_logits(const X& logits, const Y& label) {
  return pointwise_loss<fn::BCEWithLogitsLoss, R>(fn::BCEWithLogitsLoss{}, logits, label);
}


// MindSpore's keyword arguments of nn.CrossEntropyLoss and nn.NLLLoss, weight aside: labels
// equal to ignore_index add nothing and do not count in the mean; label_smoothing ε takes the
// target distribution q to (1 - ε) q + ε / classes.
struct CrossEntropyOptions {
  int ignore_index = -100;
  double label_smoothing = 0.0;

  void validate(std::string_view who) const {
    if (!(label_smoothing >= 0 && label_smoothing <= 1)) {
      throw ValueError(std::string(who) + ": label_smoothing must be in [0, 1], got " +
                       std::to_string(label_smoothing));
    }
  }
};

template <bool Sparse, bool Logits, Reduction R>
struct ClassLossGradOp;
template <bool Logits, Reduction R>
struct ClassLossLabelGradOp;

// The loss of a distribution over the last axis against a class (Sparse: int32 labels [...])
// or a target distribution (labels [..., classes]): -Σ_c q_c lp_c per row, where lp is the
// input itself (NLLLoss, log-probabilities) or log_softmax of it (Logits: CrossEntropyLoss),
// and q the target, smoothed. PyTorch: torch.nn.functional.nll_loss / cross_entropy(input,
// target, ignore_index, reduction, label_smoothing), classes on the last axis rather than on
// axis 1 (the same for the usual [batch, classes]). 'mean' divides by the rows not ignored.
template <bool Sparse, bool Logits, Reduction R>
struct ClassLossOp : Primitive<ClassLossOp<Sparse, Logits, R>> {
  static_assert(R != Reduction::batchmean, "duet: Reduction::batchmean is nn::KLDivLoss's only, as in MindSpore");
  using layer_type = nn::BasicClassLoss<Logits, R, float>;
  static constexpr int arity = 2;
  static constexpr std::string_view name = Logits ? "nn::CrossEntropyLoss" : "nn::NLLLoss";
  CrossEntropyOptions options;

  // The rule of softmax cross-entropy: [..., classes] against [...] or [..., classes].
  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return SoftmaxCrossEntropyOp<Sparse, R>::infer_static(in);
  }
  ShapeResult infer(std::span<const Shape> in) const { return SoftmaxCrossEntropyOp<Sparse, R>{}.infer(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto [rows, classes] = shape_of(a);
    const T* z = a.in<T>(0);
    T* out = a.out<T>();
    const T keep = static_cast<T>(1 - options.label_smoothing);
    const T spread = static_cast<T>(options.label_smoothing / static_cast<double>(classes));
    T total = 0;
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      const T shift = log_normaliser<Backend>(row, classes);
      const ::Eigen::Map<const Array> lp_plus_shift(row, classes);
      T loss = 0;
      if constexpr (Sparse) {
        const std::int32_t label = a.in<std::int32_t>(1)[i];
        if (label != options.ignore_index) {
          const index_t c = checked_label(label, i, classes);
          loss = -(keep * (row[c] - shift) + spread * (lp_plus_shift.sum() - static_cast<T>(classes) * shift));
        }
      } else {
        const ::Eigen::Map<const Array> p(a.in<T>(1) + i * classes, classes);
        loss = -((keep * p + spread) * (lp_plus_shift - shift)).sum();
      }
      if constexpr (R == Reduction::none) out[i] = loss;
      else total += loss;
    }
    if constexpr (R == Reduction::sum) out[0] = total;
    if constexpr (R == Reduction::mean) {
      const index_t counted = counted_rows(a);
      out[0] = counted == 0 ? T(0) : total / static_cast<T>(counted);
    }
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    if constexpr (K == 0) return ClassLossGradOp<Sparse, Logits, R>{{}, options};
    else if constexpr (Sparse) return NoGradient{};  // class indices
    else return ClassLossLabelGradOp<Logits, R>{{}, options};
  }

  static std::string op_name() { return Logits ? "CrossEntropy" : "NLL"; }
  std::string label() const { return std::string(name); }

  // What the kernels share with the gradients'.
  static std::pair<index_t, index_t> shape_of(const graph::KernelArgs& a, std::size_t input = 0) {
    const index_t classes = a.in_shape(input).back();
    return {classes == 0 ? 0 : a.in_shape(input).numel() / classes, classes};
  }
  // log Σ exp(row), by which logits exceed log-probabilities; 0 for log-probabilities.
  template <class Backend, class T>
  static T log_normaliser(const T* row, index_t classes) {
    if constexpr (Logits) return kernels::log_sum_exp(row, classes);
    else return T(0);
  }
  // The rows 'mean' divides by: those whose label is not ignore_index (all, for distributions).
  index_t counted_rows(const graph::KernelArgs& a, std::size_t logits = 0) const {
    const index_t rows = shape_of(a, logits).first;
    if constexpr (!Sparse) {
      return rows;
    } else {
      const std::int32_t* labels = a.in<std::int32_t>(logits + 1);
      return static_cast<index_t>(std::count_if(labels, labels + rows, [&](std::int32_t l) { return l != options.ignore_index; }));
    }
  }
  index_t checked_label(std::int32_t label, index_t row, index_t classes) const {
    if (label < 0 || label >= classes) {
      throw ValueError(std::string(name) + ": label " +
                       std::to_string(label) + " of sample " + std::to_string(row) + " is outside [0, " +
                       std::to_string(classes) + ") and is not ignore_index (" +
                       std::to_string(options.ignore_index) + ")");
    }
    return label;
  }
};

// d/d input of ClassLossOp, row by row: -q (log-probabilities in), or softmax · Σq - q
// (logits in), times the incoming gradient as the reduction spreads it.
template <bool Sparse, bool Logits, Reduction R>
struct ClassLossGradOp : Primitive<ClassLossGradOp<Sparse, Logits, R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;  // g, input, labels
  CrossEntropyOptions options;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Forward = ClassLossOp<Sparse, Logits, R>;
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Forward forward{{}, options};
    const auto [rows, classes] = Forward::shape_of(a, 1);
    const T* g = a.in<T>(0);
    const T* z = a.in<T>(1);
    const T keep = static_cast<T>(1 - options.label_smoothing);
    const T spread = static_cast<T>(options.label_smoothing / static_cast<double>(classes));
    const T shared = R == Reduction::none ? T(0) : detail::reduced_scale<R>(g, forward.counted_rows(a, 1));
    for (index_t i = 0; i < rows; ++i) {
      const T* row = z + i * classes;
      ::Eigen::Map<Array> d(a.out<T>() + i * classes, classes);
      const T scale = R == Reduction::none ? g[i] : shared;
      if constexpr (Sparse) {
        const std::int32_t label = a.in<std::int32_t>(2)[i];
        if (label == options.ignore_index) {
          d.setZero();
          continue;
        }
        const index_t c = forward.checked_label(label, i, classes);
        // Σq = 1 here.
        if constexpr (Logits) {
          const T lse = Forward::template log_normaliser<Backend>(row, classes);
          d = (::Eigen::Map<const Array>(row, classes) - lse).exp() - spread;
        } else {
          d.setConstant(-spread);
        }
        d[c] -= keep;
        d *= scale;
      } else {
        const auto q = keep * ::Eigen::Map<const Array>(a.in<T>(2) + i * classes, classes) + spread;
        if constexpr (Logits) {
          const T lse = Forward::template log_normaliser<Backend>(row, classes);
          const T q_sum = q.sum();
          d = ((::Eigen::Map<const Array>(row, classes) - lse).exp() * q_sum - q) * scale;
        } else {
          d = -q * scale;
        }
      }
    }
  }

  static std::string op_name() { return Logits ? "CrossEntropyGrad" : "NLLGrad"; }
};

// d/d target distribution of the dense form: -(1 - ε) lp, times the incoming gradient.
// (MindSpore gives labels no gradient; PyTorch gives this one, the derivative.)
template <bool Logits, Reduction R>
struct ClassLossLabelGradOp : Primitive<ClassLossLabelGradOp<Logits, R>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // g, input
  CrossEntropyOptions options;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Forward = ClassLossOp<false, Logits, R>;
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const auto [rows, classes] = Forward::shape_of(a, 1);
    const T* g = a.in<T>(0);
    const T keep = static_cast<T>(1 - options.label_smoothing);
    for (index_t i = 0; i < rows; ++i) {
      const T* row = a.in<T>(1) + i * classes;
      const T scale = R == Reduction::none ? g[i] : detail::reduced_scale<R>(g, rows);
      const T shift = Forward::template log_normaliser<Backend>(row, classes);
      ::Eigen::Map<Array>(a.out<T>() + i * classes, classes) =
          -keep * scale * (::Eigen::Map<const Array>(row, classes) - shift);
    }
  }

  static std::string op_name() { return Logits ? "CrossEntropyLabelGrad" : "NLLLabelGrad"; }
};

template <bool Logits, Reduction R, class X, class Labels>
auto class_loss(const X& input, const Labels& labels, const CrossEntropyOptions& options) {
  using L = typename std::remove_cvref_t<Labels>::value_type;
  constexpr bool sparse = std::is_same_v<L, std::int32_t>;
  static_assert(sparse || (Logits && std::is_same_v<L, typename std::remove_cvref_t<X>::value_type>),
                "duet::ops: the labels of nn::NLLLoss are int32 class indices; those of nn::CrossEntropyLoss "
                "are int32 class indices or distributions of the input's element type");
  options.validate(ClassLossOp<sparse, Logits, R>::name);
  return apply(ClassLossOp<sparse, Logits, R>{{}, options}, input, labels);
}

// MindSpore's ops.nll_loss(inputs, target, ignore_index=-100, reduction='mean',
// label_smoothing=0.0), without weight: inputs are log-probabilities, target int32 classes.
template <Reduction R = Reduction::mean, class X, class Labels>
auto nll_loss(const X& inputs, const Labels& target, const CrossEntropyOptions& options = {}) {
  return class_loss<false, R>(inputs, target, options);
}

// MindSpore's ops.cross_entropy(input, target, ignore_index=-100, reduction='mean',
// label_smoothing=0.0), without weight: input are logits, target int32 classes or
// probabilities (the form follows the labels' element type, as in MindSpore).
template <Reduction R = Reduction::mean, class X, class Labels>
auto cross_entropy(const X& input, const Labels& target, const CrossEntropyOptions& options = {}) {
  return class_loss<true, R>(input, target, options);
}

inline const bool losses_listed = list_operations(
    {"l1_loss", "smooth_l1_loss", "kl_div", "binary_cross_entropy_with_logits", "nll_loss", "cross_entropy"});

}  // namespace ops

namespace nn {

// A loss cell over one of the pointwise functions above; the names below are MindSpore's.
template <class Fn, Reduction R = Reduction::mean, ElementType T = float>
class BasicPointwiseLoss : public Cell<BasicPointwiseLoss<Fn, R, T>, CONTEXT_MODE, T> {
 public:
  static constexpr Reduction reduction = R;
  // The function's numbers, MindSpore's keyword arguments: nn::SmoothL1Loss<>({.beta = 0.5}).
  explicit BasicPointwiseLoss(Fn fn = {}) : fn_(fn) {
    if constexpr (requires { fn.validate(); }) fn.validate();
  }

  template <class X, class Y>
  auto construct(const X& prediction, const Y& target) {
    return ops::pointwise_loss<Fn, R>(fn_, prediction, target);
  }
  std::string type_name() const override { return std::string(Fn::name); }

 private:
  Fn fn_;
};

// MindSpore's nn.NLLLoss(ignore_index=-100, reduction='mean'), without weight, and
// nn.CrossEntropyLoss(ignore_index=-100, reduction='mean', label_smoothing=0.0):
// nn::CrossEntropyLoss<> loss({.label_smoothing = 0.1}).
template <bool Logits, Reduction R, ElementType T>
class BasicClassLoss : public Cell<BasicClassLoss<Logits, R, T>, CONTEXT_MODE, T> {
 public:
  static constexpr Reduction reduction = R;
  explicit BasicClassLoss(ops::CrossEntropyOptions options = {}) : options_(options) { options_.validate(type_name()); }
  const ops::CrossEntropyOptions& options() const { return options_; }
  template <class X, class Labels>
  auto construct(const X& input, const Labels& labels) {
    return ops::class_loss<Logits, R>(input, labels, options_);
  }
  std::string type_name() const override { return std::string(ops::ClassLossOp<false, Logits, R>::name); }

 private:
  ops::CrossEntropyOptions options_;
};

template <Reduction R = Reduction::mean, ElementType T = float>
using BasicNLLLoss = BasicClassLoss<false, R, T>;
template <Reduction R = Reduction::mean, ElementType T = float>
using BasicCrossEntropyLoss = BasicClassLoss<true, R, T>;
template <Reduction R = Reduction::mean>
using NLLLoss = BasicNLLLoss<R, float>;
template <Reduction R = Reduction::mean>
using CrossEntropyLoss = BasicCrossEntropyLoss<R, float>;

template <Reduction R = Reduction::mean>
using L1Loss = BasicPointwiseLoss<fn::L1Loss, R, float>;

template <Reduction R = Reduction::mean>
using KLDivLoss = BasicPointwiseLoss<fn::KLDivLoss, R, float>;

// MindSpore's nn.BCEWithLogitsLoss(reduction='mean'), without weight and pos_weight.
template <Reduction R = Reduction::mean>
using BCEWithLogitsLoss = BasicPointwiseLoss<fn::BCEWithLogitsLoss, R, float>;

// MindSpore's nn.SmoothL1Loss(beta=1.0, reduction='none'): nn::SmoothL1Loss<>({.beta = 0.5}).
template <Reduction R = Reduction::none>
using SmoothL1Loss = BasicPointwiseLoss<fn::SmoothL1Loss, R, float>;

}  // namespace nn
}  // namespace duet
// Normalisation layers: nn::LayerNorm, nn::GroupNorm and the operations they capture.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>


namespace duet {
namespace ops {

template <class Layer, bool InputGrad>
struct LayerNormGradOp;
template <class Layer, bool InputGrad>
struct GroupNormGradOp;

namespace detail {

// The statistics of one row of a layer norm: its mean and 1 / sqrt(variance + eps). The
// variance is taken around the mean in a second pass, which loses no digits when the mean is
// large against the spread (E[x²] - E[x]² would).
template <class T>
struct RowStatistics {
  T mean;
  T rstd;
};

template <class T, class Row>
RowStatistics<T> row_statistics(const Row& x, double epsilon) {
  const T mean = x.mean();
  const T variance = (x - mean).square().mean();
  return {mean, T(1) / std::sqrt(variance + static_cast<T>(epsilon))};
}

// An [N, C, *] input as N · groups contiguous blocks of channels_per_group planes.
struct GroupLayout {
  index_t groups, channels_per_group, spatial, block, blocks;
  GroupLayout(const Shape& x, index_t num_groups)
      : groups(num_groups),
        channels_per_group(x[1] / num_groups),
        spatial(x.numel_from(2)),
        block(channels_per_group * spatial),
        blocks(x[0] * num_groups) {}
};

}  // namespace detail

// What the normalisation operations share: the layer whose gamma and beta they read, and their
// gradient operations, GradOp<Layer, true> making dx and the parameters' gradients,
// GradOp<Layer, false> the parameters' alone.
template <class Self, class Layer, template <class, bool> class GradOp>
struct AffineNormOp : Primitive<Self> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool has_parameters = true;

  const Layer* layer;
  AffineNormOp(const Layer* l) : layer(l) {}

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return GradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return GradOp<Layer, false>{layer}; }
  std::string label() const { return layer->label(); }
};

// Their gradient operations read dy and x (the statistics are taken again, which costs a pass
// over x and saves keeping them between forward and backward).
template <class Self, class Layer, bool InputGrad>
struct AffineNormGradOp : Primitive<Self> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  AffineNormGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }
  std::string label() const { return layer->label(); }

 protected:
  // gamma's and beta's gradients in this backward pass, zeroed unless an earlier operation of
  // the pass wrote them (a layer used twice).
  template <class T>
  std::array<T*, 2> parameter_grads() const {
    const std::uint64_t pass = duet::detail::current_backward_pass();
    std::array<T*, 2> grads{};
    std::size_t i = 0;
    for (const auto* p : {&layer->gamma, &layer->beta}) {
      bool accumulate = false;
      grads[i] = p->grad_for_write(pass, &accumulate);
      if (!accumulate) std::fill_n(grads[i], p->numel(), T(0));
      ++i;
    }
    return grads;
  }
};

// (x - mean) / sqrt(var + eps) · gamma + beta over the last axis of x, gamma and beta being
// the layer's.
template <class Layer>
struct LayerNormOp : AffineNormOp<LayerNormOp<Layer>, Layer, LayerNormGradOp> {
  using AffineNormOp<LayerNormOp<Layer>, Layer, LayerNormGradOp>::AffineNormOp;

  static constexpr ShapeResult rule(index_t n, const Shape& x) {
    if (x.rank() == 0) return x.leading_unknown() ? ShapeResult{x} : fault(x, ShapeFault::min_rank, 1);
    if (n != dyn && x.back() != dyn && x.back() != n) return fault(x, ShapeFault::last_dimension, n);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::normalized_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(this->layer->normalized_size(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const index_t n = layer->normalized_size();
    const index_t rows = a.in_shape().numel() / n;
    const ::Eigen::Map<const Array> gamma(layer->gamma.data(), n);
    const ::Eigen::Map<const Array> beta(layer->beta.data(), n);
    for (index_t i = 0; i < rows; ++i) {
      const ::Eigen::Map<const Array> x(a.in<T>() + i * n, n);
      const auto s = detail::row_statistics<T>(x, layer->epsilon());
      ::Eigen::Map<Array>(a.out<T>() + i * n, n) = (x - s.mean) * s.rstd * gamma + beta;
    }
  }

  static std::string op_name() { return "LayerNorm"; }
};

// The gradient of LayerNormOp. With x̂ the normalised row and h = dy · gamma: dx = rstd · (h -
// mean(h) - x̂ · mean(h · x̂)); dgamma = Σ_rows dy · x̂; dbeta = Σ_rows dy.
template <class Layer, bool InputGrad>
struct LayerNormGradOp : AffineNormGradOp<LayerNormGradOp<Layer, InputGrad>, Layer, InputGrad> {
  using AffineNormGradOp<LayerNormGradOp<Layer, InputGrad>, Layer, InputGrad>::AffineNormGradOp;

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const index_t n = layer->normalized_size();
    const auto [gamma_grad, beta_grad] = this->template parameter_grads<T>();
    ::Eigen::Map<Array> dgamma(gamma_grad, n);
    ::Eigen::Map<Array> dbeta(beta_grad, n);
    const ::Eigen::Map<const Array> gamma(layer->gamma.data(), n);
    const index_t rows = a.in_shape(1).numel() / n;
    for (index_t i = 0; i < rows; ++i) {
      const ::Eigen::Map<const Array> dy(a.in<T>(0) + i * n, n);
      const ::Eigen::Map<const Array> x(a.in<T>(1) + i * n, n);
      const auto s = detail::row_statistics<T>(x, layer->epsilon());
      const auto x_hat = (x - s.mean) * s.rstd;  // an expression: no array per row
      dgamma += dy * x_hat;
      dbeta += dy;
      if constexpr (InputGrad) {
        const auto h = dy * gamma;
        const T mean_h = h.mean();
        const T mean_h_x_hat = (h * x_hat).mean();
        ::Eigen::Map<Array>(a.out<T>() + i * n, n) = s.rstd * (h - mean_h - x_hat * mean_h_x_hat);
      }
    }
  }

  static std::string op_name() { return InputGrad ? "LayerNormGrad" : "LayerNormGrad (parameters only)"; }
};

// (x - mean) / sqrt(var + eps) · gamma[c] + beta[c], the statistics taken over each group of
// channels of each sample (with every spatial position of those channels), gamma and beta per
// channel. In NCHW a group is one contiguous block: its statistics are a layer norm's over a
// row of that block's size.
template <class Layer>
struct GroupNormOp : AffineNormOp<GroupNormOp<Layer>, Layer, GroupNormGradOp> {
  using AffineNormOp<GroupNormOp<Layer>, Layer, GroupNormGradOp>::AffineNormOp;

  // [N, C, *] with C the layer's channels.
  static constexpr ShapeResult rule(index_t channels, const Shape& x) {
    if (x.leading_unknown()) return {x};
    if (x.rank() < 2) return fault(x, ShapeFault::min_rank, 2);
    if (channels != dyn && x[1] != dyn && x[1] != channels) return fault(x, ShapeFault::channel_dimension, channels);
    return {x};
  }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return rule(Layer::channels_static, in[0]); }
  ShapeResult infer(std::span<const Shape> in) const { return rule(this->layer->num_channels(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const detail::GroupLayout g(a.in_shape(), layer->num_groups());
    const T* gamma = layer->gamma.data();
    const T* beta = layer->beta.data();
    for (index_t b = 0; b < g.blocks; ++b) {
      const index_t at = b * g.block;
      const auto s = detail::row_statistics<T>(::Eigen::Map<const Array>(a.in<T>() + at, g.block), layer->epsilon());
      for (index_t k = 0; k < g.channels_per_group; ++k) {
        const index_t c = (b % g.groups) * g.channels_per_group + k;
        const index_t plane = at + k * g.spatial;
        ::Eigen::Map<Array>(a.out<T>() + plane, g.spatial) =
            (::Eigen::Map<const Array>(a.in<T>() + plane, g.spatial) - s.mean) * s.rstd * gamma[c] + beta[c];
      }
    }
  }

  static std::string op_name() { return "GroupNorm"; }
};

// The gradient of GroupNormOp. Per group, with x̂ the normalised block and h = dy · gamma[c]:
// dx = rstd · (h - mean(h) - x̂ · mean(h · x̂)); dgamma[c] = Σ dy · x̂ and dbeta[c] = Σ dy over
// the samples and positions of channel c. mean(h) and mean(h · x̂) come from the per-channel
// sums dbeta and dgamma take.
template <class Layer, bool InputGrad>
struct GroupNormGradOp : AffineNormGradOp<GroupNormGradOp<Layer, InputGrad>, Layer, InputGrad> {
  using AffineNormGradOp<GroupNormGradOp<Layer, InputGrad>, Layer, InputGrad>::AffineNormGradOp;

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using Array = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
    const Layer* layer = this->layer;
    const auto [dgamma, dbeta] = this->template parameter_grads<T>();
    const T* gamma = layer->gamma.data();
    const detail::GroupLayout g(a.in_shape(1), layer->num_groups());
    for (index_t b = 0; b < g.blocks; ++b) {
      const index_t at = b * g.block;
      const auto s = detail::row_statistics<T>(::Eigen::Map<const Array>(a.in<T>(1) + at, g.block), layer->epsilon());
      T sum_h{0};
      T sum_h_x_hat{0};
      for (index_t k = 0; k < g.channels_per_group; ++k) {
        const index_t c = (b % g.groups) * g.channels_per_group + k;
        const index_t plane = at + k * g.spatial;
        const ::Eigen::Map<const Array> dy(a.in<T>(0) + plane, g.spatial);
        const auto x_hat = (::Eigen::Map<const Array>(a.in<T>(1) + plane, g.spatial) - s.mean) * s.rstd;
        const T dy_sum = dy.sum();
        const T dy_x_hat = (dy * x_hat).sum();
        dgamma[c] += dy_x_hat;
        dbeta[c] += dy_sum;
        sum_h += gamma[c] * dy_sum;
        sum_h_x_hat += gamma[c] * dy_x_hat;
      }
      if constexpr (InputGrad) {
        const T mean_h = sum_h / static_cast<T>(g.block);
        const T mean_h_x_hat = sum_h_x_hat / static_cast<T>(g.block);
        for (index_t k = 0; k < g.channels_per_group; ++k) {
          const index_t c = (b % g.groups) * g.channels_per_group + k;
          const index_t plane = at + k * g.spatial;
          const ::Eigen::Map<const Array> dy(a.in<T>(0) + plane, g.spatial);
          const auto x_hat = (::Eigen::Map<const Array>(a.in<T>(1) + plane, g.spatial) - s.mean) * s.rstd;
          ::Eigen::Map<Array>(a.out<T>() + plane, g.spatial) = s.rstd * (dy * gamma[c] - mean_h - x_hat * mean_h_x_hat);
        }
      }
    }
  }

  static std::string op_name() { return InputGrad ? "GroupNormGrad" : "GroupNormGrad (parameters only)"; }
};

inline const bool normalization_listed = list_operations({"LayerNorm", "GroupNorm"});

}  // namespace ops

namespace nn {

// MindSpore's nn.LayerNorm(normalized_shape, begin_norm_axis=-1, begin_params_axis=-1,
// epsilon=1e-7) with its default axes: each row of the last axis is normalised to mean 0 and
// variance 1, then scaled by gamma and shifted by beta (ones and zeros at first), both of
// that axis's size. N is the size at compile time (nn::LayerNorm<512>), or duet::dyn for one
// given to the constructor. epsilon defaults to MindSpore's 1e-7; PyTorch's nn.LayerNorm uses
// 1e-5, so give that to match a PyTorch model: nn::LayerNorm<512>(512, 1e-5).
template <index_t N = dyn, ElementType T = float>
class LayerNorm : public Cell<LayerNorm<N, T>, CONTEXT_MODE, T> {
  static_assert(N == dyn || N > 0, "nn::LayerNorm<N>: N must be positive (or duet::dyn)");

 public:
  static constexpr index_t normalized_static = N;

  BasicParameter<T> gamma;  // [normalized_shape]
  BasicParameter<T> beta;   // [normalized_shape]
  DUET_CELL_MEMBERS(gamma, beta);

  LayerNorm() requires(N != dyn) : LayerNorm(N) {}

  explicit LayerNorm(index_t normalized_shape, double epsilon = 1e-7) : n_(normalized_shape), epsilon_(epsilon) {
    if ((N != dyn && normalized_shape != N) || normalized_shape <= 0) {
      throw ValueError(type_name() + ": cannot be built with normalized_shape " + std::to_string(normalized_shape));
    }
    if (!(epsilon > 0)) throw ValueError(type_name() + ": epsilon must be > 0, got " + std::to_string(epsilon));
    gamma = BasicParameter<T>(ones<T>({normalized_shape}));
    beta = BasicParameter<T>(zeros<T>({normalized_shape}));
  }

  index_t normalized_size() const {
    if constexpr (N != dyn)
      return N;
    else
      return n_;
  }
  double epsilon() const { return epsilon_; }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::LayerNormOp<LayerNorm>{this}, std::forward<X>(x));
  }

  std::string type_name() const override {
    std::string s = "nn::LayerNorm<" + (N == dyn ? std::string("dyn") : std::to_string(N));
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  index_t n_;
  double epsilon_;
};

// MindSpore's nn.GroupNorm(num_groups, num_channels, eps=1e-5, affine=True) on [N, C, *]
// inputs: the channels are split into num_groups groups of consecutive channels, each group of
// each sample normalised to mean 0 and variance 1 over its channels and positions, then each
// channel scaled by gamma and shifted by beta (ones and zeros at first; the checkpoint names
// are MindSpore's, gamma and beta; PyTorch calls them weight and bias). Groups and Channels
// are compile-time sizes (nn::GroupNorm<2, 8>), or duet::dyn for sizes given to the
// constructor. Always affine.
template <index_t Groups = dyn, index_t Channels = dyn, ElementType T = float>
class GroupNorm : public Cell<GroupNorm<Groups, Channels, T>, CONTEXT_MODE, T> {
  static_assert(Groups == dyn || Groups > 0, "nn::GroupNorm<Groups, Channels>: Groups must be positive (or duet::dyn)");
  static_assert(Channels == dyn || Channels > 0,
                "nn::GroupNorm<Groups, Channels>: Channels must be positive (or duet::dyn)");
  static_assert(Groups == dyn || Channels == dyn || Channels % Groups == 0,
                "nn::GroupNorm<Groups, Channels>: Channels must be a multiple of Groups");

 public:
  static constexpr index_t channels_static = Channels;

  BasicParameter<T> gamma;  // [num_channels]
  BasicParameter<T> beta;   // [num_channels]
  DUET_CELL_MEMBERS(gamma, beta);

  GroupNorm() requires(Groups != dyn && Channels != dyn) : GroupNorm(Groups, Channels) {}

  GroupNorm(index_t num_groups, index_t num_channels, double eps = 1e-5)
      : groups_(num_groups), channels_(num_channels), epsilon_(eps) {
    if ((Groups != dyn && num_groups != Groups) || (Channels != dyn && num_channels != Channels) || num_groups <= 0 ||
        num_channels <= 0 || num_channels % num_groups != 0) {
      throw ValueError(type_name() + ": cannot be built with num_groups " + std::to_string(num_groups) +
                       " and num_channels " + std::to_string(num_channels) +
                       " (num_channels must be a positive multiple of num_groups)");
    }
    if (!(eps > 0)) throw ValueError(type_name() + ": eps must be > 0, got " + std::to_string(eps));
    gamma = BasicParameter<T>(ones<T>({num_channels}));
    beta = BasicParameter<T>(zeros<T>({num_channels}));
  }

  index_t num_groups() const {
    if constexpr (Groups != dyn)
      return Groups;
    else
      return groups_;
  }
  index_t num_channels() const {
    if constexpr (Channels != dyn)
      return Channels;
    else
      return channels_;
  }
  double epsilon() const { return epsilon_; }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::GroupNormOp<GroupNorm>{this}, std::forward<X>(x));
  }

  std::string type_name() const override {
    auto size = [](index_t n) { return n == dyn ? std::string("dyn") : std::to_string(n); };
    std::string s = "nn::GroupNorm<" + size(Groups) + ", " + size(Channels);
    if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
    return s + ">";
  }

 private:
  index_t groups_;
  index_t channels_;
  double epsilon_;
};

}  // namespace nn
}  // namespace duet
// Arithmetic: + - * / and the other binary elementwise functions, with numpy broadcasting,
// between tensors and with scalars, in both modes (MindSpore's ops.add, ops.mul, ...).
//
// A binary function is a type with apply(a, b) and the partial derivative of each argument,
// partial<K>(a, b). One operation, BroadcastOp<Fn>, runs any of them: its shape rule is
// numpy's, its kernel walks the output once, and the gradient of input K is that partial
// times the incoming gradient, summed over the axes input K was broadcast along (so that it
// has input K's shape). With a scalar the same functions run in ScalarOp, which keeps the
// scalar in the operation rather than in a tensor.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>


namespace duet {

namespace fn {

struct Add {
  static constexpr std::string_view name = "Add";
  static constexpr std::string_view onnx = "Add";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return a + b;
  }
  template <int K, class T>
  static T partial(T, T) {
    return T(1);
  }
};

struct Sub {
  static constexpr std::string_view name = "Sub";
  static constexpr std::string_view onnx = "Sub";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return a - b;
  }
  template <int K, class T>
  static T partial(T, T) {
    return K == 0 ? T(1) : T(-1);
  }
};

struct Mul {
  static constexpr std::string_view name = "Mul";
  static constexpr std::string_view onnx = "Mul";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return a * b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    return K == 0 ? b : a;
  }
};

struct Div {
  static constexpr std::string_view name = "Div";
  static constexpr std::string_view onnx = "Div";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return a / b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    return K == 0 ? T(1) / b : -a / (b * b);
  }
};

// Ties send half the gradient each way, as PyTorch does: the derivative there is undefined,
// and any other choice makes maximum(x, x) differ from x.
struct Maximum {
  static constexpr std::string_view name = "Maximum";
  static constexpr std::string_view onnx = "Max";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return a != a || a > b ? a : b;  // NaN propagates from either side
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if (a == b) return T(0.5);
    return (K == 0) == (a > b) ? T(1) : T(0);
  }
};

struct Minimum {
  static constexpr std::string_view name = "Minimum";
  static constexpr std::string_view onnx = "Min";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return a != a || a < b ? a : b;
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if (a == b) return T(0.5);
    return (K == 0) == (a < b) ? T(1) : T(0);
  }
};

// a^b. d/db = a^b · log a, which is NaN for a < 0 as the real power is; at a = 0 it is 0
// where the power itself is (b > 0), as PyTorch defines it.
struct Pow {
  static constexpr std::string_view name = "Pow";
  static constexpr std::string_view onnx = "Pow";  // its operator in ONNX
  template <class T>
  static T apply(T a, T b) {
    return static_cast<T>(std::pow(a, b));
  }
  template <int K, class T>
  static T partial(T a, T b) {
    if constexpr (K == 0) {
      return b == T(0) ? T(0) : static_cast<T>(b * std::pow(a, b - T(1)));
    } else {
      return a == T(0) && b > T(0) ? T(0) : static_cast<T>(std::pow(a, b) * std::log(a));
    }
  }
};

}  // namespace fn

namespace ops {

// numpy's broadcasting of two shapes, aligned at their last axes: each pair of sizes must be
// equal or one of them 1. A dynamic size matches anything, and unknown leading axes stay
// unknown.
constexpr ShapeResult broadcast_shapes(const Shape& a, const Shape& b) {
  const int rank = std::max(a.rank(), b.rank());
  std::array<index_t, max_rank> dims{};
  bool ok = true;
  for (int i = 1; i <= rank; ++i) {
    const index_t da = i <= a.rank() ? a[-i] : (a.leading_unknown() ? dyn : 1);
    const index_t db = i <= b.rank() ? b[-i] : (b.leading_unknown() ? dyn : 1);
    index_t d = da;
    if (da == db || db == 1) d = da;
    else if (da == 1) d = db;
    else if (da == dyn) d = db;
    else if (db == dyn) d = da;
    else ok = false;
    dims[static_cast<std::size_t>(rank - i)] = d;
  }
  Shape out = a.leading_unknown() || b.leading_unknown() ? Shape::any() : Shape{};
  for (int i = 0; i < rank; ++i) out.push_back(dims[static_cast<std::size_t>(i)]);
  // Which input to blame: the one of lower rank, or the second.
  if (!ok) return fault(out, ShapeFault::broadcast, 0, b.rank() <= a.rank() ? 1 : 0);
  return {out};
}

namespace detail {

// Where each output element reads an input broadcast to the output's shape: the input's
// strides in the output's axes, 0 along broadcast axes.
inline std::array<index_t, max_rank> broadcast_strides(const Shape& in, const Shape& out) {
  std::array<index_t, max_rank> strides{};
  index_t stride = 1;
  for (int i = 1; i <= out.rank(); ++i) {
    const std::size_t axis = static_cast<std::size_t>(out.rank() - i);
    if (i <= in.rank() && in[-i] != 1) {
      strides[axis] = stride;
    }
    if (i <= in.rank()) stride *= in[-i];
  }
  return strides;
}

// Calls row(first, count, start, step) for each run of output elements [first, first + count)
// along which every input advances by a constant step: input k is read at start[k] +
// j * step[k] for the j-th element of the run. The whole output is one run when the shapes
// are equal, a row of the last axis otherwise.
template <std::size_t N, class Row>
void for_each_broadcast_row(const std::array<Shape, N>& in, const Shape& out, Row&& row) {
  const index_t n = out.numel();
  if (n == 0) return;
  std::array<index_t, N> at{};
  std::array<index_t, N> step{};
  if (std::all_of(in.begin(), in.end(), [&](const Shape& s) { return s == out; })) {
    step.fill(1);
    row(index_t{0}, n, at, step);
    return;
  }
  std::array<std::array<index_t, max_rank>, N> strides;
  for (std::size_t k = 0; k < N; ++k) strides[k] = broadcast_strides(in[k], out);
  const int rank = out.rank();
  const index_t inner = rank == 0 ? 1 : out[-1];
  for (std::size_t k = 0; k < N; ++k) step[k] = rank == 0 ? 0 : strides[k][static_cast<std::size_t>(rank - 1)];
  std::array<index_t, max_rank> index{};
  for (index_t i = 0; i < n; i += inner) {
    row(i, inner, at, step);
    // The odometer over the outer axes, last first.
    for (int axis = rank - 2; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      for (std::size_t k = 0; k < N; ++k) at[k] += strides[k][ax];
      if (index[ax] < out[axis]) break;
      for (std::size_t k = 0; k < N; ++k) at[k] -= strides[k][ax] * index[ax];
      index[ax] = 0;
    }
  }
}

// Calls f(i, ia, ib) for each output element i, with the elements ia and ib of the two inputs
// it reads, in the order of the output; then done(first, count) after each run, while the run
// is still in cache (an epilogue's pass).
template <class F, class Done = void (*)(index_t, index_t)>
void for_each_broadcast(const Shape& a, const Shape& b, const Shape& out, F&& f,
                        Done&& done = [](index_t, index_t) {}) {
  for_each_broadcast_row<2>(std::array<Shape, 2>{a, b}, out,
                            [&](index_t first, index_t count, const std::array<index_t, 2>& start,
                                const std::array<index_t, 2>& step) {
                              // In runs that stay in cache until done() has seen them.
                              constexpr index_t run = 1024;
                              for (index_t r = 0; r < count; r += run) {
                                const index_t end = std::min(count, r + run);
                                for (index_t j = r; j < end; ++j) {
                                  f(first + j, start[0] + j * step[0], start[1] + j * step[1]);
                                }
                                done(first + r, end - r);
                              }
                            });
}

}  // namespace detail

template <class Fn, int K>
struct BroadcastGradOp;
template <class Fn, class... Epilogue>
struct BroadcastOp;

// An elementwise expression tree over the inputs of a fused operation: input I, or Fn of two
// subtrees.
template <int I>
struct Arg {};
template <class Fn, class L, class R>
struct Apply {};

namespace detail {

// A run of up to `block` elements of one operand: strided in an input, contiguous in a block
// buffer.
template <class T>
struct Operand {
  const T* data;
  index_t stride;
  T operator[](index_t j) const { return data[j * stride]; }
};

inline constexpr index_t block = 256;

// Evaluates a tree on a run of `count` (<= block) output elements, each subtree into a block
// buffer of its own, a loop per node. Every intermediate value is stored in T before the next
// node reads it, so the compiler cannot contract a multiply and an add into one FMA: the
// result is the unfused operations' bit for bit, as PyNative computes them.
template <class Tree>
struct tree;
template <int I>
struct tree<Arg<I>> {
  static constexpr std::size_t buffers = 0;
  template <class T, std::size_t N>
  static Operand<T> eval(const std::array<const T*, N>& in, const std::array<index_t, N>& start,
                         const std::array<index_t, N>& step, index_t, T*, T*) {
    return {in[I] + start[I], step[I]};
  }
  static std::string text() { return std::string(1, static_cast<char>('a' + I)); }
};
template <class Fn, class L, class R>
struct tree<Apply<Fn, L, R>> {
  // Blocks of scratch the subtrees need: one per inner node, the root writing to its destination.
  static constexpr std::size_t buffers = tree<L>::buffers + tree<R>::buffers + 2;
  template <class T, std::size_t N>
  static Operand<T> eval(const std::array<const T*, N>& in, const std::array<index_t, N>& start,
                         const std::array<index_t, N>& step, index_t count, T* destination, T* scratch) {
    const Operand<T> l = tree<L>::eval(in, start, step, count, scratch, scratch + block);
    const Operand<T> r = tree<R>::eval(in, start, step, count, scratch + block * (1 + tree<L>::buffers),
                                       scratch + block * (2 + tree<L>::buffers));
    for (index_t j = 0; j < count; ++j) destination[j] = Fn::apply(l[j], r[j]);
    return {destination, 1};
  }
  static std::string text() { return std::string(Fn::name) + "(" + tree<L>::text() + ", " + tree<R>::text() + ")"; }
};

}  // namespace detail

// A chain of binary elementwise operations fused into one pass over N inputs (Tree), then the
// unary functions Epilogue: what fuse_epilogues makes of `x * w + b` in a graph that is not
// differentiated, so the intermediate values are never written.
template <std::size_t N, class Tree, class... Epilogue>
struct ElementwiseOp : Primitive<ElementwiseOp<N, Tree, Epilogue...>> {
  static constexpr int arity = static_cast<int>(N);

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    ShapeResult r{in[0]};
    for (std::size_t k = 1; k < N && r.ok(); ++k) {
      r = broadcast_shapes(r.shape, in[k]);
      if (!r.ok()) r.input = static_cast<int>(k);
    }
    return r;
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    std::array<const T*, N> in;
    std::array<Shape, N> shapes;
    for (std::size_t k = 0; k < N; ++k) {
      in[k] = a.in<T>(k);
      shapes[k] = a.in_shape(k);
    }
    T* out = a.out<T>();
    std::array<T, detail::block * detail::tree<Tree>::buffers> scratch;
    detail::for_each_broadcast_row<N>(
        shapes, a.output_shape,
        [&](index_t first, index_t count, const std::array<index_t, N>& start, const std::array<index_t, N>& step) {
          for (index_t done = 0; done < count; done += detail::block) {
            const index_t n = std::min(detail::block, count - done);
            std::array<index_t, N> at = start;
            for (std::size_t k = 0; k < N; ++k) at[k] += done * step[k];
            detail::tree<Tree>::eval(in, at, step, n, out + first + done, scratch.data());
            if constexpr (sizeof...(Epilogue) > 0)
              Backend::template map<Epilogue...>(out + first + done, n, out + first + done);
          }
        });
  }

  // Functions with parameters (LeakyReLU's alpha) are not taken: the op holds no values
  // for its epilogue, and would run them with their defaults.
  template <class C>
  static constexpr bool accepts_epilogue = requires { requires C::parameterless; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>&) const {
    return ElementwiseOp<N, Tree, Epilogue..., Gs...>{};
  }
  // This value as input Pos of a binary elementwise operation: one more input, one more level.
  template <int Pos, class Fn2>
    requires(sizeof...(Epilogue) == 0)
  auto absorb_operand(const BroadcastOp<Fn2>&) const {
    using Other = Arg<static_cast<int>(N)>;
    return ElementwiseOp<N + 1, std::conditional_t<Pos == 0, Apply<Fn2, Tree, Other>, Apply<Fn2, Other, Tree>>>{};
  }

  // It keeps none of the values between its steps: a graph to differentiate is not fused so.
  static constexpr bool differentiable = false;

  static std::string op_name() {
    std::string s = "Elementwise " + detail::tree<Tree>::text();
    ((s += " + " + std::string(Epilogue::name)), ...);
    return s;
  }
};

// Fn(a, b) elementwise, a and b broadcast to a common shape, then the unary functions Epilogue
// (fuse_epilogues moves elementwise functions that follow it here, so the value is written
// once).
template <class Fn, class... Epilogue>
struct BroadcastOp : Primitive<BroadcastOp<Fn, Epilogue...>> {
  using layer_type = BroadcastOp<Fn>;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_shapes(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* out = a.out<T>();
    detail::for_each_broadcast(
        a.in_shape(0), a.in_shape(1), a.output_shape,
        [&](index_t i, index_t ia, index_t ib) { out[i] = Fn::apply(x[ia], y[ib]); },
        [&](index_t first, index_t count) {
          if constexpr (sizeof...(Epilogue) > 0) Backend::template map<Epilogue...>(out + first, count, out + first);
        });
  }

  // Functions with parameters (LeakyReLU's alpha) are not taken: the op holds no values
  // for its epilogue, and would run them with their defaults.
  template <class C>
  static constexpr bool accepts_epilogue = requires { requires C::parameterless; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>&) const {
    return BroadcastOp<Fn, Epilogue..., Gs...>{};
  }
  template <int Pos, class Fn2>
    requires(sizeof...(Epilogue) == 0)
  auto absorb_operand(const BroadcastOp<Fn2>& next) const {
    return ElementwiseOp<2, Apply<Fn, Arg<0>, Arg<1>>>{}.template absorb_operand<Pos>(next);
  }

  // Fused with an epilogue it keeps no value between Fn and the epilogue to differentiate from.
  static constexpr bool differentiable = sizeof...(Epilogue) == 0;
  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return BroadcastGradOp<Fn, static_cast<int>(K)>{};
  }

  static std::string op_name() {
    std::string s(Fn::name);
    ((s += " + " + std::string(Epilogue::name)), ...);
    return s;
  }

  // ONNX broadcasts as numpy does, as duet does.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (sizeof...(Epilogue) == 0 && requires { Fn::onnx; }) {
      return {{std::string(Fn::onnx), {InterchangeInput::operand(0), InterchangeInput::operand(1)}, {}}};
    } else {
      return {};
    }
  }
};

// d/d input K of Fn(a, b): dy · partial_K(a, b), summed over the axes input K was broadcast
// along.
template <class Fn, int K>
struct BroadcastGradOp : Primitive<BroadcastGradOp<Fn, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* d = a.out<T>();
    const Shape& target = a.in_shape(1 + K);
    const Shape& out = a.in_shape(0);
    if (target == out) {
      detail::for_each_broadcast(a.in_shape(1), a.in_shape(2), out, [&](index_t i, index_t ia, index_t ib) {
        d[i] = dy[i] * Fn::template partial<K>(x[ia], y[ib]);
      });
      return;
    }
    std::fill_n(d, target.numel(), T(0));
    detail::for_each_broadcast(a.in_shape(1), a.in_shape(2), out, [&](index_t i, index_t ia, index_t ib) {
      d[K == 0 ? ia : ib] += dy[i] * Fn::template partial<K>(x[ia], y[ib]);
    });
  }

  static std::string op_name() { return std::string(Fn::name) + "Grad" + std::to_string(K); }
};

template <class Fn, bool ScalarFirst>
struct ScalarGradOp;

// Fn(x, s) (or Fn(s, x) if ScalarFirst) elementwise, s a number the operation holds.
template <class Fn, bool ScalarFirst>
struct ScalarOp : Primitive<ScalarOp<Fn, ScalarFirst>> {
  static constexpr int arity = 1;
  double scalar;
  ScalarOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* out = a.out<T>();
    const T s = static_cast<T>(scalar);
    const index_t n = a.in_shape().numel();
    for (index_t i = 0; i < n; ++i) out[i] = ScalarFirst ? Fn::apply(s, x[i]) : Fn::apply(x[i], s);
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ScalarGradOp<Fn, ScalarFirst>{scalar};
  }

  static std::string op_name() { return std::string(Fn::name) + (ScalarFirst ? "(scalar, x)" : "(x, scalar)"); }
};

template <class Fn, bool ScalarFirst>
struct ScalarGradOp : Primitive<ScalarGradOp<Fn, ScalarFirst>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;
  double scalar;
  ScalarGradOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    T* d = a.out<T>();
    const T s = static_cast<T>(scalar);
    const index_t n = a.in_shape(1).numel();
    for (index_t i = 0; i < n; ++i) {
      d[i] = dy[i] * (ScalarFirst ? Fn::template partial<1>(s, x[i]) : Fn::template partial<0>(x[i], s));
    }
  }

  static std::string op_name() { return std::string(Fn::name) + "ScalarGrad"; }
};

inline const bool arithmetic_listed =
    list_operations({"add", "sub", "mul", "div", "maximum", "minimum", "pow", "neg", "add_scalar", "sub_scalar",
                     "mul_scalar", "div_scalar", "scalar_sub", "scalar_div", "pow_scalar", "scalar_pow"});

// What may stand on either side of an arithmetic operator: a tensor, a static tensor, or a
// symbolic tensor in construct.
template <class X>
concept TensorLike = is_tensor_v<std::remove_cvref_t<X>> || is_static_tensor_v<std::remove_cvref_t<X>> ||
                     nn::is_parameter_v<std::remove_cvref_t<X>> || graph::Symbolic<X>;

template <class S>
concept Scalar = std::is_arithmetic_v<std::remove_cvref_t<S>>;

// What arithmetic takes: tensors and numbers, at least one a tensor.
template <class A, class B>
concept Operands = (TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>);

// Fn(a, b) for any mix of tensors and numbers (two numbers are not an operation).
template <class Fn, class A, class B>
auto binary(const A& a, const B& b) {
  if constexpr (Scalar<A>) {
    return apply(ScalarOp<Fn, true>{static_cast<double>(a)}, b);
  } else if constexpr (Scalar<B>) {
    return apply(ScalarOp<Fn, false>{static_cast<double>(b)}, a);
  } else {
    static_assert(std::is_same_v<typename std::remove_cvref_t<A>::value_type, typename std::remove_cvref_t<B>::value_type>,
                  "duet::ops: both operands of an arithmetic operation must have the same element type");
    return apply(BroadcastOp<Fn>{}, a, b);
  }
}

template <class A, class B>
  requires Operands<A, B>
auto add(const A& a, const B& b) {
  return binary<fn::Add>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto sub(const A& a, const B& b) {
  return binary<fn::Sub>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto mul(const A& a, const B& b) {
  return binary<fn::Mul>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto div(const A& a, const B& b) {
  return binary<fn::Div>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto maximum(const A& a, const B& b) {
  return binary<fn::Maximum>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto minimum(const A& a, const B& b) {
  return binary<fn::Minimum>(a, b);
}
template <class A, class B>
  requires Operands<A, B>
auto pow(const A& a, const B& b) {
  return binary<fn::Pow>(a, b);
}

template <class X>
  requires TensorLike<X>
auto neg(const X& x) {
  return binary<fn::Mul>(x, -1);
}

}  // namespace ops

// The operators, found by argument-dependent lookup on duet's tensors and graph::Sym.
#define DUET_DETAIL_ARITHMETIC_OPERATOR(op, function)                                                   \
  template <class A, class B>                                                                          \
    requires ops::Operands<A, B>                                                                       \
  auto operator op(const A& a, const B& b) {                                                           \
    return ops::function(a, b);                                                                        \
  }
DUET_DETAIL_ARITHMETIC_OPERATOR(+, add)
DUET_DETAIL_ARITHMETIC_OPERATOR(-, sub)
DUET_DETAIL_ARITHMETIC_OPERATOR(*, mul)
DUET_DETAIL_ARITHMETIC_OPERATOR(/, div)

template <class X>
  requires ops::TensorLike<X>
auto operator-(const X& x) {
  return ops::neg(x);
}

namespace graph {
using duet::operator+;
using duet::operator-;
using duet::operator*;
using duet::operator/;
}  // namespace graph

#undef DUET_DETAIL_ARITHMETIC_OPERATOR

}  // namespace duet
// Convolutions: nn::Conv2d and nn::Conv1d (MindSpore's nn.Conv2d and nn.Conv1d, depthwise
// with groups = channels), and the operations they capture.
//
//   nn::Conv2d<In, Out, Kernel, Stride = 1, Padding = 0, Dilation = 1, Groups = 1>
//       compile-time sized: static shapes are checked through it while the program compiles.
//       Padding is a number (MindSpore's pad_mode "pad" with that padding on every side) or
//       nn::PadMode::same / nn::PadMode::valid;
//   nn::Conv2d<>(in, out, kernel, {.stride, .pad_mode, .padding, .dilation, .group, .has_bias,
//                .weight_init, .bias_init})
//       run-time sized, with MindSpore's defaults (pad_mode "same", no bias);
//   nn::Conv1d<...> and nn::Conv1d<>(...) the same on NCL inputs.
//
// MindSpore's conventions, where PyTorch's differ:
//  - pad_mode "same" gives ceil(size / stride) outputs, padding split evenly with the odd one
//    after (bottom, right), as MindSpore and TensorFlow do; PyTorch's padding="same" refuses
//    strides above 1. "valid" pads nothing. "pad" pads `padding` on each side, as PyTorch's
//    padding.
//  - has_bias defaults to false (PyTorch's bias to true); the layer without bias has no bias
//    parameter, so checkpoints hold `weight` alone, with `bias` when it has one (Dense's names).
//  - the run-time form defaults to pad_mode "same"; the compile-time form's Padding defaults
//    to 0 (the issue's signature, PyTorch's default, MindSpore's "valid").
//  - the weight is [out, in / group, kh, kw] ([out, in / group, k] for Conv1d), initialised
//    as MindSpore 2.x does by default (HeUniform(sqrt(5)), and the bias Uniform(1/sqrt(fan_in))):
//    both U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in / group · kh · kw, PyTorch's default.
//  - the option is MindSpore's `group` (PyTorch's `groups`).
//
// The geometry (kernel, stride, padding, dilation, groups) is a template argument of the
// compile-time form, since the output's static shape needs it; the run-time form keeps it in
// the layer and its shape rule runs on it at run time. The compile-time form is the run-time
// one with its geometry in its type as well (SizedLayer, cell.hpp): only graph capture sees
// the type, and a network's convolutions of every size share the rest of their code.
//
// Algorithm: im2col, one kernel tap to a row, and duet's packed GEMM for all three products
// (the forward, the weight's gradient and the input's); kernels/conv.hpp gives the layout.
// Measured single-threaded in float, medians of processor time, on the project's 2-core AMD
// EPYC (AVX-512) while other builds loaded it (load average 11 to 14), forward of one layer,
// im2col + duet's GEMM / direct loops (an axpy per tap over output rows) / im2col + Eigen's
// product, with patches one pixel to a row:
//   LeNet conv1, 1->6 5x5 pad 2, batch 64:   2.0 / 8.7 to 32 / 1.5 ms
//   LeNet conv2, 6->16 5x5, batch 64:        1.4 / 29 to 65 / 1.6 to 1.9 ms
//   3x3 64->64 pad 1 on 28x28, batch 32:     111 to 291 / 1096 to 3263 / 101 to 333 ms
// Direct convolution loses even at one input channel, so there is no direct path. With
// patches one pixel to a row, im2col and col2im took 36% of the 3x3 layer's forward+backward
// (122 ms, Eigen's gradient products 38 ms of it). Patches one tap to a row (copies of input
// rows) with the products on duet's GEMM (gemm_kn packing the patches' panels from their rows)
// brought it, in the benchmark binary (benchmarks/conv.cpp, same load), to 25.9 ms forward
// (from 37.9; libtorch 29.8, oneDNN 26.5) and 87.0 ms forward+backward (from 122.6; libtorch
// 70.8, oneDNN 89.1), the GEMM's micro-kernel 59% of it; LeNet-5's training step at batch 64
// to 9.5 ms (from 11.0; libtorch 12.4). What remains is the products themselves: packing the
// patches' panels straight from the image (implicit GEMM) would save im2col's copy, a few
// percent.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

// The loops of a convolution around its matrix products (ops/conv.hpp runs them): im2col,
// which lays out the input patches one kernel tap to a row, and col2im, which adds such rows
// back into an image.
//
// Layout: images NCHW (a 1-D convolution is a 2-D one of height 1), the weight
// [out, in / groups, kh, kw], so that one output channel's weights are one contiguous row of
// depth = in / groups · kh · kw. For one sample and one group, with col[depth, P] (P output
// pixels) its patches, one row per tap (c, a, b):
//   forward           y[out_g, P]      = w[out_g, depth] · col               gemm_kn
//   backward, weight  dw[out_g, depth] += dy[out_g, P] · colᵀ                gemm
//   backward, data    dcol[depth, P]   = wᵀ[depth, out_g] · dy, then col2im  gemm_kn
// All three are duet's packed GEMM (kernels/gemm.hpp, through the backend's dense() and
// matmul()), which runs per instruction set: gemm when both operands have the sum's index
// innermost (dy's rows and col's rows for the weight), gemm_kn when the right one has it
// outermost (col for the forward, dy for the data), packing its panels from rows rather than
// columns. Only wᵀ, out · depth numbers, is copied, once per call; y and dx come out NCHW.
//
// Why a row per tap rather than a row per pixel (the patch as a row, which gemm takes as it
// stands in the forward): a tap's row is a strided copy of input rows, a plain copy at stride
// 1, and col2im's adds run along the same rows; a pixel's row gathers depth scattered values.
// Measured single-threaded (float, AVX-512, medians of CPU time on the project's 2-core
// machine under load), the 3x3 64->64 convolution on 28x28 at batch 32 spent about 36% of a
// forward+backward step in im2col and col2im by pixel rows (122 ms, of which Eigen's two
// gradient products 38 ms); see ops/conv.hpp for the times with this layout. An implicit GEMM
// (panels packed straight from the image) was not built: with this layout, im2col's copies are
// about 8% of that step, the most it could save.
//
// Bits: the products are gemm's, whose instruction sets differ in the last bits (gemm.hpp), so
// under DUET_ISA=baseline, avx2 and avx512 a convolution's gradients now differ as its forward
// did already (Eigen's products gave every set the same gradient bits); under one set, both
// modes run these very loops and agree bit for bit.

#include <algorithm>
#include <cstring>

#include <Eigen/Core>


namespace duet::kernels {

// One convolution's sizes for one input: everything the loops need. Padding before is given;
// the padding after is what the output size implies.
struct ConvProblem {
  index_t batch = 0;
  index_t in = 0;  // input channels
  index_t out = 0;  // output channels
  index_t groups = 1;
  index_t height = 0;
  index_t width = 0;
  index_t out_height = 0;
  index_t out_width = 0;
  index_t kernel_h = 1;
  index_t kernel_w = 1;
  index_t stride_h = 1;
  index_t stride_w = 1;
  index_t dilation_h = 1;
  index_t dilation_w = 1;
  index_t pad_top = 0;
  index_t pad_left = 0;

  constexpr index_t in_per_group() const { return in / groups; }
  constexpr index_t out_per_group() const { return out / groups; }
  constexpr index_t depth() const { return in_per_group() * kernel_h * kernel_w; }
  constexpr index_t pixels() const { return out_height * out_width; }
  constexpr index_t image() const { return height * width; }
};

namespace detail {

// First o >= 0 with o · stride >= v.
inline index_t first_multiple_at_least(index_t v, index_t stride) { return v <= 0 ? 0 : (v + stride - 1) / stride; }

// f(at, lo, hi, from) for every row of one group's patches and every output row oh in it: the
// run of out_width values at col[at] (row (c, a, b) of col[depth, P], pixels oh · OW on) takes,
// for ow in [lo, hi), the input element x[from + (ow - lo) · stride_w] within the group's
// channels ([in / groups, H, W]), and lies in the padding outside [lo, hi) (lo = hi = 0 when
// the whole input row is padding).
template <class F>
void for_each_tap_row(const ConvProblem& q, F&& f) {
  index_t at = 0;
  for (index_t c = 0; c < q.in_per_group(); ++c) {
    for (index_t a = 0; a < q.kernel_h; ++a) {
      for (index_t b = 0; b < q.kernel_w; ++b) {
        const index_t shift = b * q.dilation_w - q.pad_left;  // w = ow · stride + shift
        const index_t lo = std::min(q.out_width, first_multiple_at_least(-shift, q.stride_w));
        const index_t hi = std::max(lo, std::min(q.out_width, first_multiple_at_least(q.width - shift, q.stride_w)));
        for (index_t oh = 0; oh < q.out_height; ++oh, at += q.out_width) {
          const index_t h = oh * q.stride_h - q.pad_top + a * q.dilation_h;
          if (h < 0 || h >= q.height) f(at, index_t{0}, index_t{0}, index_t{0});
          else f(at, lo, hi, c * q.image() + h * q.width + lo * q.stride_w + shift);
        }
      }
    }
  }
}

// Copies (or, with in == nullptr, zeroes) a short run of n elements in place of std::copy and
// std::fill, which call memmove and memset: LeNet-5's rows are 10 to 28 elements, and the
// calls cost more than the copies. Blocks of 16 bytes, the last one overlapping the one before
// it, and below one block (at most 3 floats or 1 double) element by element, unrolled: a loop
// of element copies is what compilers turn back into a call. LeNet-5's im2col at batch 64
// (AMD EPYC Zen 5, g++ -O3, alternating builds, 3 runs): 251-280 -> 197-207 us for conv1,
// 402-411 -> 283-302 us for conv2; the 3x3 64-channel layer's rows of 28 at batch 32,
// 2.79-2.95 -> 2.22-2.24 ms.
template <class T>
inline void short_run(const T* in, index_t n, T* out) {
  constexpr index_t block = 16 / sizeof(T);
  static_assert(block <= 4);
  constexpr T zeros[block] = {};
  const auto move = [&](index_t at) { std::memcpy(out + at, in == nullptr ? zeros : in + at, 16); };
  if (n >= block) {
    for (index_t i = 0; i + block < n; i += block) move(i);
    move(n - block);
    return;
  }
  const auto element = [&](index_t i) { out[i] = in == nullptr ? T(0) : in[i]; };
  if (n > 0) element(0);
  if (n > 1) element(1);
  if (n > 2) element(2);
}

// Rows of at most this many elements go through short_run.
inline constexpr index_t short_row = 64;

}  // namespace detail

// col[depth, P] = the patches of x, one group's channels of one sample ([in / groups, H, W]):
// row (c, a, b) holds what kernel tap (a, b) of channel c reads at every output pixel, zero
// where it reaches into the padding. A row is a strided copy of input rows (a plain copy at
// stride 1), which vectorises; the forward product and the weight's gradient both contract
// over it as it stands (see the top).
template <class T>
void im2col(const ConvProblem& q, const T* x, T* col) {
  if (q.stride_w == 1 && q.out_width <= detail::short_row) {
    detail::for_each_tap_row(q, [&](index_t at, index_t lo, index_t hi, index_t from) {
      T* out = col + at;
      detail::short_run<T>(nullptr, lo, out);
      detail::short_run(x + from, hi - lo, out + lo);
      detail::short_run<T>(nullptr, q.out_width - hi, out + hi);
    });
    return;
  }
  detail::for_each_tap_row(q, [&](index_t at, index_t lo, index_t hi, index_t from) {
    T* out = col + at;
    std::fill(out, out + lo, T(0));
    const T* in = x + from;
    if (q.stride_w == 1) std::copy(in, in + (hi - lo), out + lo);
    else for (index_t o = lo; o < hi; ++o) out[o] = in[(o - lo) * q.stride_w];
    std::fill(out + hi, out + q.out_width, T(0));
  });
}

// dx += the rows of col[depth, P] added back where im2col took them from.
template <class T>
void col2im_add(const ConvProblem& q, const T* col, T* dx) {
  detail::for_each_tap_row(q, [&](index_t at, index_t lo, index_t hi, index_t from) {
    const T* in = col + at;
    T* out = dx + from;
    if (q.stride_w == 1) {
      for (index_t o = lo; o < hi; ++o) out[o - lo] += in[o];
    } else {
      for (index_t o = lo; o < hi; ++o) out[(o - lo) * q.stride_w] += in[o];
    }
  });
}

// The convolution whose output is q's data gradient, where there is one: at stride 1, dx is
// dy convolved with each group's weight flipped in both spatial axes and its two channel axes
// swapped (flipped_weight), padded dilation · (kernel - 1) - pad on each side, so that each
// output pixel's taps find what the forward took from it (a padding beyond the kernel's
// extent makes that negative: im2col then starts inside dy, and the input rows no output
// read get zeros). That is one product of the forward's shape per sample and group,
// out_g · kh · kw deep, written onto dx: against wᵀ · dy (out_g deep, 64 for a 64-channel
// layer) and col2im adding its rows back, it spares the col2im pass, the zeroing of dx and
// the GEMM's short sums, which spend a larger share of their time folding and storing each
// tile (the AVX-512 micro-kernel alone, in L1: 81 GFLOP/s at depth 64, 95 at depth 256).
// Measured on the 3x3 64->64 layer, 28x28, batch 32, forward and backward, one thread, the
// fastest of 20 runs alternating with the old build: 114.3 -> 107.5 ms (libtorch 88.5 in
// the same runs). Strides above 1 keep the product and col2im, and so do layers with more
// output channels than input channels (LeNet-5's 6 -> 16): the convolution's patches of dy
// would be out_g / in_g times the size of col2im's rows, and its product only in_g columns
// wide (6, a third of an AVX-512 vector), so its im2col's copies became the step's largest
// cost. Measured on LeNet-5's training step at batch 64, AMD EPYC (Zen 5, AVX-512), one
// thread: see ops/conv.hpp.
inline bool has_data_gradient_convolution(const ConvProblem& q) {
  return q.stride_h == 1 && q.stride_w == 1 && q.out_per_group() <= q.in_per_group();
}

// That convolution, for one group of one sample (has_data_gradient_convolution(q)): its input
// is dy's out_g channels, its output dx's in_g channels.
inline ConvProblem data_gradient_convolution(const ConvProblem& q) {
  ConvProblem t = q;
  t.batch = 1;
  t.groups = 1;
  t.in = q.out_per_group();
  t.out = q.in_per_group();
  t.height = q.out_height;
  t.width = q.out_width;
  t.out_height = q.height;
  t.out_width = q.width;
  t.pad_top = q.dilation_h * (q.kernel_h - 1) - q.pad_top;
  t.pad_left = q.dilation_w * (q.kernel_w - 1) - q.pad_left;
  return t;
}

// wt[c, o, a, b] = w[o, c, kh - 1 - a, kw - 1 - b] for one group's weight [out_g, in_g, kh, kw]:
// the weight of data_gradient_convolution(q).
template <class T>
void flipped_weight(const ConvProblem& q, const T* w, T* wt) {
  const index_t taps = q.kernel_h * q.kernel_w;
  for (index_t o = 0; o < q.out_per_group(); ++o) {
    for (index_t c = 0; c < q.in_per_group(); ++c) {
      const T* from = w + (o * q.in_per_group() + c) * taps;
      T* to = wt + (c * q.out_per_group() + o) * taps;
      for (index_t t = 0; t < taps; ++t) to[t] = from[taps - 1 - t];
    }
  }
}

// y[c, p] += bias[c] for the `channels` planes of `pixels` values of one sample.
template <class T>
void add_channel_bias(T* y, index_t channels, index_t pixels, const T* bias) {
  using Planes = ::Eigen::Array<T, ::Eigen::Dynamic, ::Eigen::Dynamic, ::Eigen::RowMajor>;
  ::Eigen::Map<Planes> Y(y, channels, pixels);
  Y.colwise() += ::Eigen::Map<const ::Eigen::Array<T, ::Eigen::Dynamic, 1>>(bias, channels);
}

// db[c] (+)= Σ_p dy[c, p] over the `channels` planes of one sample.
template <class T>
void channel_sums(const T* dy, index_t channels, index_t pixels, T* db, bool accumulate) {
  using Planes = ::Eigen::Array<T, ::Eigen::Dynamic, ::Eigen::Dynamic, ::Eigen::RowMajor>;
  const ::Eigen::Map<const Planes> DY(dy, channels, pixels);
  ::Eigen::Map<::Eigen::Array<T, ::Eigen::Dynamic, 1>> DB(db, channels);
  if (accumulate) DB += DY.rowwise().sum();
  else DB = DY.rowwise().sum();
}

}  // namespace duet::kernels

namespace duet {

namespace ops {

// A convolution's settings, from its layer: the compile-time form's as a constant (dyn where
// the run-time form leaves them open), the run-time form's from its members. Spatial is 1
// (NCL) or 2 (NCHW); a 1-D convolution is a 2-D one of height 1, so axis 0 below is then the
// height of 1 with a kernel of 1.
struct ConvGeometry {
  int spatial = 2;
  index_t in = dyn;
  index_t out = dyn;
  index_t kernel = dyn;  // dyn: nothing but the ranks and channels is known at compile time
  index_t stride = 1;
  nn::PadMode pad_mode = nn::PadMode::pad;
  index_t padding = 0;
  index_t dilation = 1;
  index_t groups = 1;

  constexpr index_t extent() const { return dilation * (kernel - 1) + 1; }
};

namespace detail {

// One spatial axis: its output size and the padding before it, or the smallest input size
// that leaves an output (`smallest`, when `size` is below it).
struct ConvAxis {
  index_t out = dyn;
  index_t pad_before = 0;
  index_t smallest = 0;
};

constexpr ConvAxis conv_axis(const ConvGeometry& g, index_t size, bool real_axis) {
  if (!real_axis) return {size, 0, 0};  // the height of 1 of a 1-D convolution
  if (g.kernel == dyn) return {dyn, 0, 0};
  const index_t extent = g.extent();
  switch (g.pad_mode) {
    case nn::PadMode::same: {
      if (size == dyn) return {dyn, 0, 0};
      const index_t out = (size + g.stride - 1) / g.stride;
      const index_t total = std::max<index_t>(0, (out - 1) * g.stride + extent - size);
      return {out, total / 2, 0};
    }
    case nn::PadMode::valid:
    case nn::PadMode::pad: {
      const index_t pad = g.pad_mode == nn::PadMode::pad ? g.padding : 0;
      const index_t smallest = std::max<index_t>(1, extent - 2 * pad);
      if (size == dyn) return {dyn, pad, smallest};
      if (size < smallest) return {dyn, pad, smallest};
      return {(size + 2 * pad - extent) / g.stride + 1, pad, smallest};
    }
  }
  return {};
}

// The shape rule: [N, in, (H,) W] -> [N, out, (OH,) OW].
constexpr ShapeResult conv_shape(const ConvGeometry& g, const Shape& x) {
  const int rank = g.spatial + 2;
  Shape in = x;
  if (x.leading_unknown()) {
    if (x.rank() > rank) return fault(Shape::any(), ShapeFault::exact_rank, rank);
    in = Shape{};
    for (int i = 0; i < rank - x.rank(); ++i) in.push_back(dyn);
    for (int i = 0; i < x.rank(); ++i) in.push_back(x[i]);
  }
  Shape y{in.rank() > 0 ? in[0] : dyn, g.out};
  if (in.rank() != rank) {
    for (int i = 0; i < g.spatial; ++i) y.push_back(dyn);
    return fault(y, ShapeFault::exact_rank, rank);
  }
  ShapeResult r{y};
  for (int i = 0; i < g.spatial; ++i) {
    const ConvAxis axis = conv_axis(g, in[2 + i], true);
    r.shape.push_back(axis.out);
    if (axis.out == dyn && in[2 + i] != dyn && axis.smallest > 0 && r.ok()) {
      r = fault(r.shape, ShapeFault::spatial_size, axis.smallest);
    }
  }
  if (g.in != dyn && in[1] != dyn && in[1] != g.in) return fault(r.shape, ShapeFault::channel_dimension, g.in);
  return r;
}

// The sizes of one convolution of g on an input of shape x (which its rule accepted).
inline kernels::ConvProblem conv_problem(const ConvGeometry& g, const Shape& x) {
  const bool two_d = g.spatial == 2;
  const index_t height = two_d ? x[2] : 1;
  const index_t width = x[-1];
  const ConvAxis h = conv_axis(g, height, two_d);
  const ConvAxis w = conv_axis(g, width, true);
  kernels::ConvProblem q;
  q.batch = x[0];
  q.in = g.in;
  q.out = g.out;
  q.groups = g.groups;
  q.height = height;
  q.width = width;
  q.out_height = h.out;
  q.out_width = w.out;
  q.kernel_h = two_d ? g.kernel : 1;
  q.kernel_w = g.kernel;
  q.stride_h = two_d ? g.stride : 1;
  q.stride_w = g.stride;
  q.dilation_h = two_d ? g.dilation : 1;
  q.dilation_w = g.dilation;
  q.pad_top = h.pad_before;
  q.pad_left = w.pad_before;
  return q;
}

// Scratch of `count` elements (the patches of one group of one sample, ...): from the thread's
// block cache, so a warm graph allocates nothing (as the GEMM's own packing buffer).
template <class T>
T* scratch(duet::detail::Storage& storage, index_t count) {
  storage = duet::detail::Storage(static_cast<std::size_t>(count) * sizeof(T));
  return reinterpret_cast<T*>(storage.data());
}

// y = fns(conv(x, w) + bias) for a convolution of geometry g, x and y being a's input and
// output; bias may be null. The bias and the functions go over each sample's planes right
// after its products, while they are still in cache: the bias is per output channel, a row
// of the product, which the GEMM's epilogue (a bias per column) cannot take.
template <class Backend, class T, class... Fns>
void convolve(const ConvGeometry& g, const graph::KernelArgs& a, const T* w, const T* bias,
              const std::tuple<Fns...>& fns) {
  const kernels::ConvProblem q = conv_problem(g, a.in_shape());
  const T* x = a.in<T>();
  T* y = a.out<T>();
  const index_t og = q.out_per_group();
  duet::detail::Storage storage;
  T* col = scratch<T>(storage, q.depth() * q.pixels());
  for (index_t n = 0; n < q.batch; ++n) {
    for (index_t gr = 0; gr < q.groups; ++gr) {
      kernels::im2col(q, x + (n * q.in + gr * q.in_per_group()) * q.image(), col);
      T* yg = y + (n * q.out + gr * og) * q.pixels();
      Backend::matmul(w + gr * og * q.depth(), og, q.depth(), col, q.pixels(), yg);
    }
    T* yn = y + n * q.out * q.pixels();
    if (bias != nullptr) kernels::add_channel_bias(yn, q.out, q.pixels(), bias);
    if constexpr (sizeof...(Fns) > 0) Backend::map(fns, yn, q.out * q.pixels(), yn);
  }
}

// ConvOp's ONNX node: Conv, its padding explicit: SAME's is uneven for some sizes, known from the input's.
template <class Runtime>
Interchange conv_interchange(const Runtime* layer, std::span<const Shape> in) {
  const ConvGeometry g = layer->geometry();
  std::vector<std::int64_t> begin, end;
  for (int i = 0; i < g.spatial; ++i) {
    const index_t size = in[0][2 + i];
    const detail::ConvAxis axis = detail::conv_axis(g, size, true);
    begin.push_back(axis.pad_before);
    end.push_back(g.pad_mode == nn::PadMode::same
                      ? std::max<index_t>(0, (axis.out - 1) * g.stride + g.extent() - size) - axis.pad_before
                      : axis.pad_before);
  }
  std::vector<std::int64_t> pads = begin;
  pads.insert(pads.end(), end.begin(), end.end());
  const auto each = [&](index_t v) { return std::vector<std::int64_t>(static_cast<std::size_t>(g.spatial), v); };
  using I = InterchangeInput;
  using A = InterchangeAttribute;
  InterchangeNode conv{"Conv",
                       {I::operand(0), I::of_parameter(&layer->weight)},
                       {A::of("kernel_shape", each(g.kernel)), A::of("strides", each(g.stride)),
                        A::of("dilations", each(g.dilation)), A::of("pads", std::move(pads)),
                        A::of("group", g.groups)}};
  if (layer->has_bias()) conv.inputs.push_back(I::of_parameter(&layer->bias));
  return {std::move(conv)};
}

// ConvGradOp's kernel: dweight, dbias and, if input_grad, dx (a's output) from dy and x (a's inputs).
template <class Backend, class T, class Runtime>
void conv_gradient(const Runtime* layer, const graph::KernelArgs& a, bool input_grad) {
  const kernels::ConvProblem q = detail::conv_problem(layer->geometry(), a.in_shape(1));
  const std::uint64_t pass = duet::detail::current_backward_pass();
  bool accumulate_w = false;
  bool accumulate_b = false;
  T* dw = layer->weight.grad_for_write(pass, &accumulate_w);
  T* db = layer->has_bias() ? layer->bias.grad_for_write(pass, &accumulate_b) : nullptr;
  const T* dy = a.in<T>(0);
  const T* x = a.in<T>(1);
  const T* w = layer->weight.data();
  const index_t og = q.out_per_group();
  const index_t weights = og * q.depth();  // one group's
  T* dx = input_grad ? a.out<T>() : nullptr;
  // dx as a convolution of dy (kernels::data_gradient_convolution), or as the patches'
  // gradient wᵀ · dy added back by col2im.
  const bool convolve_dx = dx != nullptr && kernels::has_data_gradient_convolution(q);
  const kernels::ConvProblem t = convolve_dx ? kernels::data_gradient_convolution(q) : q;
  duet::detail::Storage col_storage, sample_storage, wt_storage;
  // The patches of x, then (once the weight's gradient has read them) those of dy or the
  // patches' gradient.
  T* col = detail::scratch<T>(col_storage, std::max(q.depth() * q.pixels(), t.depth() * t.pixels()));
  // One sample's part of a group's weight gradient, added to those before it.
  T* dw_sample = detail::scratch<T>(sample_storage, weights);
  // Each group's weight as the data gradient's product reads it: flipped, or as [depth, out_g].
  T* wt = dx != nullptr ? detail::scratch<T>(wt_storage, q.groups * weights) : nullptr;
  if (convolve_dx) {
    for (index_t g = 0; g < q.groups; ++g) kernels::flipped_weight(q, w + g * weights, wt + g * weights);
  } else if (dx != nullptr) {
    std::fill_n(dx, q.batch * q.in * q.image(), T(0));
    for (index_t g = 0; g < q.groups; ++g) kernels::transpose(w + g * weights, og, q.depth(), wt + g * weights);
  }
  for (index_t n = 0; n < q.batch; ++n) {
    for (index_t g = 0; g < q.groups; ++g) {
      const T* dyg = dy + (n * q.out + g * og) * q.pixels();
      const index_t xg = (n * q.in + g * q.in_per_group()) * q.image();
      T* dwg = dw + g * weights;
      kernels::im2col(q, x + xg, col);
      const bool add = accumulate_w || n > 0;
      Backend::template dense<dyn, dyn>(dyg, og, q.pixels(), col, q.depth(), Epilogue<T>{}, add ? dw_sample : dwg);
      if (add) std::transform(dwg, dwg + weights, dw_sample, dwg, std::plus<T>{});
      if (convolve_dx) {
        kernels::im2col(t, dyg, col);
        Backend::matmul(wt + g * weights, t.out, t.depth(), col, t.pixels(), dx + xg);
      } else if (dx != nullptr) {
        Backend::matmul(wt + g * weights, q.depth(), og, dyg, q.pixels(), col);
        kernels::col2im_add(q, col, dx + xg);
      }
    }
    if (db != nullptr) kernels::channel_sums(dy + n * q.out * q.pixels(), q.out, q.pixels(), db, accumulate_b || n > 0);
  }
  if (q.batch == 0) {
    if (!accumulate_w) std::fill_n(dw, layer->weight.numel(), T(0));
    if (db != nullptr && !accumulate_b) std::fill_n(db, q.out, T(0));
  }
  duet::detail::gradient_writes_done();
}

}  // namespace detail

// A convolution's weight and bias with the evaluation BatchNorm after it folded in, from
// BatchNorm::evaluation_affine()'s y = x · scale + shift per channel: W'[c] = W[c] · scale[c]
// and b'[c] = b[c] · scale[c] + shift[c], scale being gamma / sqrt(moving_variance + eps) and
// shift beta - moving_mean · scale. They round differently from the BatchNorm's own
// (x - mean) · scale + beta after the convolution: the folded output agrees with the unfolded
// one within a tolerance, not bit for bit (README, "BatchNorm folding at evaluation").
template <class T>
struct FoldedConv {
  BasicTensor<T> weight;
  BasicTensor<T> bias;
};

namespace detail {
// The folded weight and bias, kept as the weight's derived form and made again whenever the
// weight, the bias or any of the BatchNorm's four tensors has been written since: after a
// training step, set_data or load_checkpoint the next evaluation folds the new values.
template <class T, class Runtime, class Norm>
std::shared_ptr<const FoldedConv<T>> folded_conv(const Runtime* layer, const Norm& norm) {
  const auto& watched = norm.tensors();
  const auto& weight = layer->weight;
  const BasicTensor<T>& bias = layer->bias;
  return weight.template derived<FoldedConv<T>>(
      [&] {
        const index_t out = layer->geometry().out;
        const index_t per_channel = weight.numel() / out;
        const auto affine = norm.evaluation_affine();
        FoldedConv<T> f{BasicTensor<T>::uninitialized(weight.shape()), BasicTensor<T>::uninitialized({out})};
        for (index_t c = 0; c < out; ++c) {
          const T scale = affine.scale[static_cast<std::size_t>(c)];
          const T* w = weight.data() + c * per_channel;
          T* folded = f.weight.data() + c * per_channel;
          for (index_t k = 0; k < per_channel; ++k) folded[k] = w[k] * scale;
          const T b = layer->has_bias() ? bias.data()[c] : T(0);
          f.bias.data()[c] = b * scale + affine.shift[static_cast<std::size_t>(c)];
        }
        return f;
      },
      {&bias, watched[0], watched[1], watched[2], watched[3]});
}

}  // namespace detail

template <class Layer, bool InputGrad>
struct ConvGradOp;
template <class Layer, class Norm, class... Fns>
struct ConvEpilogueOp;

template <class C>
inline constexpr bool is_evaluation_batchnorm_v = false;
template <class Norm>
inline constexpr bool is_evaluation_batchnorm_v<BatchNormOp<Norm, graph::Phase::eval>> = true;

// y = conv(x, weight) + bias (when the layer has one), the layer's.
template <class Layer>
struct ConvOp : Primitive<ConvOp<Layer>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;

  const Layer* layer;
  ConvOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return detail::conv_shape(Layer::static_geometry, in[0]);
  }
  ShapeResult infer(std::span<const Shape> in) const { return detail::conv_shape(layer->geometry(), in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* bias = layer->has_bias() ? layer->bias.data() : nullptr;
    detail::convolve<Backend>(layer->geometry(), a, layer->weight.data(), bias, std::tuple<>{});
  }

  // At evaluation (passes::fuse_epilogues, in a graph that is not differentiated) it takes the
  // BatchNorm after it, folded into its weight and bias, then elementwise functions.
  template <class C>
  static constexpr bool accepts_epilogue = is_evaluation_batchnorm_v<C> || requires { C::elementwise_functions; };
  template <class Norm>
  auto absorb(const BatchNormOp<Norm, graph::Phase::eval>& next) const {
    return absorb(next.evaluation_norm());
  }
  // PIJit's fusion (trace.hpp), which sees the BatchNorm only through this description.
  auto absorb(const EvaluationNorm<value_type>& norm) const {
    return ConvEpilogueOp<Layer, EvaluationNorm<value_type>>{layer, norm, {}};
  }
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return ConvEpilogueOp<Layer, void, Gs...>{layer, nullptr, next.fns};
  }

  static constexpr bool has_parameters = true;
  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ConvGradOp<Layer, true>{layer};
  }
  auto parameter_grad_op() const { return ConvGradOp<Layer, false>{layer}; }

  static std::string op_name() { return Layer::spatial == 2 ? "Conv2d" : "Conv1d"; }
  std::string label() const { return layer->label(); }

  // ONNX: Conv, its padding explicit: SAME's is uneven for some sizes, known from the input's.
  Interchange interchange(std::span<const Shape> in) const {
    return detail::conv_interchange(nn::detail::runtime_form(layer), in);
  }
};

// The gradient of ConvOp from dy and x: dweight, dbias and, if InputGrad, dx. The patches are
// taken from x again rather than kept from the forward pass, which would hold depth times the
// input between the passes.
template <class Layer, bool InputGrad>
struct ConvGradOp : Primitive<ConvGradOp<Layer, InputGrad>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;  // dy, x
  static constexpr bool is_sink = !InputGrad;

  const Layer* layer;
  ConvGradOp(const Layer* l) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {InputGrad ? in[1] : Shape{}}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::conv_gradient<Backend, T>(nn::detail::runtime_form(layer), a, InputGrad);
  }

  static std::string op_name() {
    const std::string name = Layer::spatial == 2 ? "Conv2dGrad" : "Conv1dGrad";
    return InputGrad ? name : name + " (parameters only)";
  }
  std::string label() const { return layer->label(); }
};

// y = Fns(conv(x) + bias) with the BatchNorm after it folded into the convolution (Norm is
// EvaluationNorm<T>, or void: none), the evaluation form that fuse_epilogues makes of (Conv, BatchNorm, functions).
// It has no gradient: only graphs that are not differentiated take it, and training graphs
// keep the BatchNorm's training op, which no convolution absorbs.
template <class Layer, class Norm, class... Fns>
struct ConvEpilogueOp : Primitive<ConvEpilogueOp<Layer, Norm, Fns...>> {
  using layer_type = Layer;
  using value_type = typename Layer::value_type;
  static constexpr int arity = 1;
  static constexpr bool differentiable = false;
  static constexpr bool folds = !std::is_void_v<Norm>;

  const Layer* layer;
  std::conditional_t<folds, Norm, std::nullptr_t> norm;
  std::tuple<Fns...> fns;
  ConvEpilogueOp(const Layer* l, decltype(norm) n, std::tuple<Fns...> f) : layer(l), norm(n), fns(std::move(f)) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return ConvOp<Layer>::infer_static(in); }
  ShapeResult infer(std::span<const Shape> in) const { return ConvOp<Layer>{layer}.infer(in); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    if constexpr (folds) {
      // The BatchNorm's own check: a layer switched to training alone is refused, not folded stale.
      PhaseOf<const Norm, graph::Phase::eval>{&norm}.check_phase();
      const std::shared_ptr<const FoldedConv<T>> folded = fold<T>();
      detail::convolve<Backend>(layer->geometry(), a, folded->weight.data(), folded->bias.data(), fns);
    } else {
      const T* bias = layer->has_bias() ? layer->bias.data() : nullptr;
      detail::convolve<Backend>(layer->geometry(), a, layer->weight.data(), bias, fns);
    }
  }

  template <class C>
  static constexpr bool accepts_epilogue = requires { C::elementwise_functions; };
  template <class... Gs>
  auto absorb(const MapOp<Gs...>& next) const {
    return ConvEpilogueOp<Layer, Norm, Fns..., Gs...>{layer, norm, std::tuple_cat(fns, next.fns)};
  }

  static std::string op_name() {
    std::string s = Layer::spatial == 2 ? "Conv2d" : "Conv1d";
    if (folds) s += " + BatchNorm(folded)";
    ((s += " + ", s += Fns::name), ...);
    return s;
  }
  std::string label() const {
    if constexpr (folds) return layer->label() + " + " + norm.label();
    else return layer->label();
  }

 private:
  template <class T>
  std::shared_ptr<const FoldedConv<T>> fold() const {
    return detail::folded_conv<T>(nn::detail::runtime_form(layer), norm);
  }
};

inline const bool conv_listed = list_operations({"Conv2d", "Conv1d"});

}  // namespace ops

namespace nn {

// The initialisers and bias of a convolution whose geometry is in its type.
template <ElementType T>
struct ConvInit {
  bool has_bias = false;
  std::optional<initializer::AnyInitializer<T>> weight_init = std::nullopt;
  std::optional<initializer::AnyInitializer<T>> bias_init = std::nullopt;
};

// MindSpore's arguments after kernel_size, in its order, with its defaults.
template <ElementType T>
struct ConvOptions {
  index_t stride = 1;
  PadMode pad_mode = PadMode::same;
  index_t padding = 0;
  index_t dilation = 1;
  index_t group = 1;
  bool has_bias = false;
  std::optional<initializer::AnyInitializer<T>> weight_init = std::nullopt;
  std::optional<initializer::AnyInitializer<T>> bias_init = std::nullopt;
};

namespace detail {

template <auto Padding>
constexpr PadMode pad_mode_of() {
  if constexpr (std::is_same_v<decltype(Padding), PadMode>) return Padding;
  else return PadMode::pad;
}

template <auto Padding>
constexpr index_t padding_of() {
  if constexpr (std::is_same_v<decltype(Padding), PadMode>) return 0;
  else return static_cast<index_t>(Padding);
}

}  // namespace detail

// How a convolution names itself: "nn::Conv2d<1, 6, 5, 1, 2>" for a compile-time sized one
// (its template arguments up to the last that is not its default; pad_named when Padding is a
// PadMode), "nn::Conv2d<dyn, dyn, dyn>" for a run-time sized one (sized empty).
struct ConvName {
  bool sized = false;
  bool pad_named = false;
};

template <ElementType T>
std::string conv_type_name(const ops::ConvGeometry& g, ConvName form) {
  std::string s = g.spatial == 2 ? "nn::Conv2d<" : "nn::Conv1d<";
  if (form.sized) {
    const std::string arguments[] = {std::to_string(g.in), std::to_string(g.out), std::to_string(g.kernel),
                                     std::to_string(g.stride),
                                     form.pad_named ? "nn::PadMode::" + std::string(name_of(g.pad_mode))
                                                    : std::to_string(g.padding),
                                     std::to_string(g.dilation), std::to_string(g.groups)};
    const bool is_default[] = {false, false, false, g.stride == 1, !form.pad_named && g.padding == 0,
                               g.dilation == 1, g.groups == 1};
    std::size_t shown = std::is_same_v<T, float> ? 3 : 7;
    for (std::size_t i = 3; i < 7; ++i) shown = is_default[i] ? shown : std::max(shown, i + 1);
    for (std::size_t i = 0; i < shown; ++i) s += (i == 0 ? "" : ", ") + arguments[i];
  } else {
    s += "dyn, dyn, dyn";
  }
  if constexpr (!std::is_same_v<T, float>) s += ", " + std::string(name_of(dtype_of<T>));
  return s + ">";
}

// What Conv2d (Spatial = 2, NCHW) and Conv1d (Spatial = 1, NCL) share, sizes and settings held
// as values: nn::Conv2d<> itself, and what a compile-time sized one (SizedConv) runs as outside
// graph capture. Layer is the run-time form deriving from it.
template <class Layer, int Spatial, ElementType T>
class BasicConv : public Cell<Layer, CONTEXT_MODE, T> {
 public:
  using runtime_type = Layer;
  static constexpr int spatial = Spatial;
  static constexpr ops::ConvGeometry static_geometry{Spatial};

  BasicParameter<T> weight;  // [out, in / group, kh, kw] ([out, in / group, k] for Conv1d)
  BasicParameter<T> bias;    // [out], when has_bias

  using Init = ConvInit<T>;
  using Options = ConvOptions<T>;

  // The weight, then the bias, from the global generator (set_seed).
  BasicConv(index_t in_channels, index_t out_channels, index_t kernel_size, Options options = {})
      : BasicConv(in_channels, out_channels, kernel_size, std::move(options), ConvName{}) {}

  const ops::ConvGeometry& geometry() const { return geometry_; }
  index_t in_channels() const { return geometry_.in; }
  index_t out_channels() const { return geometry_.out; }
  bool has_bias() const { return has_bias_; }

  template <class X>
  auto construct(X&& x) {
    return apply(ops::ConvOp<Layer>{static_cast<const Layer*>(this)}, std::forward<X>(x));
  }

  // weight, and bias only if the layer has one: a layer without bias trains and saves no
  // parameter that does nothing.
  void for_each_own_parameter(const typename BasicDynamicCell<T>::ParameterVisitor& visit) override {
    visit("weight", weight);
    if (has_bias_) visit("bias", bias);
  }

  std::string type_name() const override { return conv_type_name<T>(geometry_, name_); }

 protected:
  // A compile-time sized convolution's, named as its type.
  BasicConv(index_t in_channels, index_t out_channels, index_t kernel_size, Options options, ConvName name)
      : geometry_{Spatial,           in_channels, out_channels,     kernel_size, options.stride,
                  options.pad_mode,  options.padding, options.dilation, options.group},
        has_bias_(options.has_bias),
        name_(name) {
    validate();
    const index_t fan_in = in_channels / options.group * (Spatial == 2 ? kernel_size * kernel_size : kernel_size);
    const initializer::Uniform mindspore_default{static_cast<double>(T(1) / std::sqrt(static_cast<T>(fan_in)))};
    Shape weight_shape{out_channels, in_channels / options.group, kernel_size};
    if (Spatial == 2) weight_shape.push_back(kernel_size);
    auto weight_value = BasicTensor<T>::uninitialized(weight_shape);
    auto bias_value = BasicTensor<T>::uninitialized({out_channels});
    with_global_generator([&](Generator& gen) {
      initializer::initialize_option(weight_value, options.weight_init.value_or(mindspore_default), gen, type_name(),
                                     "weight_init");
      if (has_bias_) {
        initializer::initialize_option(bias_value, options.bias_init.value_or(mindspore_default), gen, type_name(),
                                       "bias_init");
      }
    });
    weight = BasicParameter<T>(std::move(weight_value));
    if (has_bias_) bias = BasicParameter<T>(std::move(bias_value));
  }

 private:
  void validate() const {
    const ops::ConvGeometry& g = geometry_;
    auto refuse = [&](const std::string& why) { throw ValueError(type_name() + ": " + why); };
    if (g.in <= 0 || g.out <= 0 || g.kernel <= 0) {
      refuse("in_channels, out_channels and kernel_size must be positive, got " + std::to_string(g.in) + ", " +
             std::to_string(g.out) + " and " + std::to_string(g.kernel));
    }
    if (g.stride <= 0 || g.dilation <= 0 || g.groups <= 0) {
      refuse("stride, dilation and group must be positive, got " + std::to_string(g.stride) + ", " +
             std::to_string(g.dilation) + " and " + std::to_string(g.groups));
    }
    if (g.in % g.groups != 0 || g.out % g.groups != 0) {
      refuse("in_channels (" + std::to_string(g.in) + ") and out_channels (" + std::to_string(g.out) +
             ") must be multiples of group (" + std::to_string(g.groups) + ")");
    }
    if (g.padding < 0) refuse("padding must not be negative, got " + std::to_string(g.padding));
    // MindSpore refuses a padding that its pad_mode would ignore.
    if (g.pad_mode != PadMode::pad && g.padding != 0) {
      refuse("padding must be 0 unless pad_mode is \"pad\", got " + std::to_string(g.padding) + " with pad_mode \"" +
             std::string(name_of(g.pad_mode)) + "\"");
    }
  }

  ops::ConvGeometry geometry_;
  bool has_bias_;
  ConvName name_;
};

// A convolution whose sizes and settings are template arguments: Runtime (its run-time form)
// with its geometry in its type as well. Captured into a graph it is ConvOp<Layer>, whose
// static shape rule checks the network while the program compiles; everywhere else it is
// Runtime (SizedLayer).
template <class Layer, class Runtime, index_t In, index_t Out, index_t Kernel, index_t Stride, auto Padding,
          index_t Dilation, index_t Groups>
class SizedConv : public SizedLayer<Layer, Runtime> {
  using T = typename Runtime::value_type;
  static_assert(std::is_same_v<decltype(Padding), PadMode> || std::is_integral_v<decltype(Padding)>,
                "nn::Conv: Padding is a number or nn::PadMode::same / nn::PadMode::valid");
  static_assert(In != dyn && Out != dyn && Kernel != dyn,
                "nn::Conv<>: the run-time sized form takes its sizes and settings from the constructor; give all "
                "of In, Out and Kernel as template arguments, or none");
  static_assert(In > 0 && Out > 0 && Kernel > 0, "nn::Conv: In, Out and Kernel must be positive");
  static_assert(Stride > 0 && Dilation > 0 && Groups > 0, "nn::Conv: Stride, Dilation and Groups must be positive");
  static_assert(detail::padding_of<Padding>() >= 0, "nn::Conv: Padding must not be negative");
  static_assert(In % Groups == 0 && Out % Groups == 0,
                "nn::Conv: In and Out must be multiples of Groups (depthwise: Groups = In)");
  static constexpr ConvName name{true, std::is_same_v<decltype(Padding), PadMode>};

 public:
  static constexpr ops::ConvGeometry static_geometry{Runtime::spatial,
                                                     In,
                                                     Out,
                                                     Kernel,
                                                     Stride,
                                                     detail::pad_mode_of<Padding>(),
                                                     detail::padding_of<Padding>(),
                                                     Dilation,
                                                     Groups};
  using typename Runtime::Init;
  using typename Runtime::Options;

  // nn::Conv2d<1, 6, 5, 1, 2> conv{{.has_bias = true}};
  explicit SizedConv(Init init = {})
      : SizedLayer<Layer, Runtime>(In, Out, Kernel,
                                   Options{Stride, static_geometry.pad_mode, static_geometry.padding, Dilation, Groups,
                                           init.has_bias, std::move(init.weight_init), std::move(init.bias_init)},
                                   name) {}

  // The run-time form's constructor, for sizes and settings that must be the type's.
  SizedConv(index_t in_channels, index_t out_channels, index_t kernel_size, Options options = {})
      : SizedLayer<Layer, Runtime>(checked(in_channels, out_channels, kernel_size, options), out_channels, kernel_size,
                                   std::move(options), name) {}

  template <graph::Symbolic S>
  auto sized_construct(const S& x) {
    return apply(ops::ConvOp<Layer>{static_cast<const Layer*>(this)}, x);
  }

 private:
  static index_t checked(index_t in, index_t out, index_t kernel, const Options& o) {
    const std::string type = conv_type_name<T>(static_geometry, name);
    if (in != In || out != Out || kernel != Kernel) {
      throw ValueError(type + ": cannot be built with in_channels " + std::to_string(in) + ", out_channels " +
                       std::to_string(out) + " and kernel_size " + std::to_string(kernel));
    }
    const ops::ConvGeometry& g = static_geometry;
    // "valid" is "pad" with no padding: the same geometry.
    const auto unpadded = [](PadMode mode, index_t padding) {
      return mode == PadMode::valid || (mode == PadMode::pad && padding == 0);
    };
    const bool same_padding = (o.pad_mode == g.pad_mode && o.padding == g.padding) ||
                              (unpadded(o.pad_mode, o.padding) && unpadded(g.pad_mode, g.padding));
    if (o.stride != g.stride || !same_padding || o.dilation != g.dilation || o.group != g.groups) {
      const auto settings = [](index_t stride, PadMode mode, index_t padding, index_t dilation, index_t group) {
        return "stride " + std::to_string(stride) + ", pad_mode \"" + std::string(name_of(mode)) + "\", padding " +
               std::to_string(padding) + ", dilation " + std::to_string(dilation) + " and group " +
               std::to_string(group);
      };
      throw ValueError(type + ": its type fixes " + settings(g.stride, g.pad_mode, g.padding, g.dilation, g.groups) +
                       ", got " + settings(o.stride, o.pad_mode, o.padding, o.dilation, o.group) +
                       " (the run-time options' defaults include pad_mode \"same\"); give only has_bias and the "
                       "initialisers: " + type + "{{.has_bias = true}}");
    }
    return in;
  }
};

// Conv2d<> and Conv1d<> (every argument but T left at its default) are the run-time forms.
template <int Spatial, index_t In, index_t Out, index_t Kernel, index_t Stride, auto Padding, index_t Dilation,
          index_t Groups, ElementType T, class Layer, class Runtime>
using conv_base = std::conditional_t<
    In == dyn && Out == dyn && Kernel == dyn && Stride == 1 && std::is_same_v<decltype(Padding), int> &&
        detail::padding_of<Padding>() == 0 && Dilation == 1 && Groups == 1,
    BasicConv<Layer, Spatial, T>, SizedConv<Layer, Runtime, In, Out, Kernel, Stride, Padding, Dilation, Groups>>;

template <index_t In = dyn, index_t Out = dyn, index_t Kernel = dyn, index_t Stride = 1, auto Padding = 0,
          index_t Dilation = 1, index_t Groups = 1, ElementType T = float>
class Conv2d : public conv_base<2, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                                Conv2d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>,
                                Conv2d<dyn, dyn, dyn, 1, 0, 1, 1, T>> {
  using Base = conv_base<2, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                         Conv2d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>, Conv2d<dyn, dyn, dyn, 1, 0, 1, 1, T>>;

 public:
  using Base::Base;
};

template <index_t In = dyn, index_t Out = dyn, index_t Kernel = dyn, index_t Stride = 1, auto Padding = 0,
          index_t Dilation = 1, index_t Groups = 1, ElementType T = float>
class Conv1d : public conv_base<1, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                                Conv1d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>,
                                Conv1d<dyn, dyn, dyn, 1, 0, 1, 1, T>> {
  using Base = conv_base<1, In, Out, Kernel, Stride, Padding, Dilation, Groups, T,
                         Conv1d<In, Out, Kernel, Stride, Padding, Dilation, Groups, T>, Conv1d<dyn, dyn, dyn, 1, 0, 1, 1, T>>;

 public:
  using Base::Base;
};

}  // namespace nn
}  // namespace duet
// Reductions: sum, mean, max and min over axes, with keep_dims, and argmax, argmin (MindSpore's
// ops.sum(x, dim, keepdim), ReduceSum(keep_dims), ops.argmax), in both modes.
//
// Spelling. The reduced axes shape the output, and graph mode computes every node's shape
// while the program compiles, so they are template arguments, given as tag values:
//   ops::sum(x)                                   every axis, a scalar
//   ops::sum(x, ops::axes<1>)                     axis 1 ([2, 3, 4] -> [2, 4])
//   ops::mean(x, ops::axes<0, -1>, ops::keep_dims)  axes 0 and -1, kept as 1 ([2, 3, 4] -> [1, 3, 1])
//   ops::argmax(x), ops::argmax(x, ops::axis<0>, ops::keep_dims)   one axis, -1 by default
// Negative axes count from the end, as in numpy. The same axis twice does not compile.
//
// Gradients. sum and mean send the incoming gradient back along the reduced axes (mean divided
// by the number of elements reduced). max and min send it to the elements equal to the
// extreme; where several are, it is split evenly among them, as PyTorch's amax/amin do: any
// other choice makes max(x) of a constant tensor depend on an arbitrary index, and splitting
// keeps the gradient's sum equal to the incoming one. A NaN extreme sends its gradient to the
// NaN elements. argmax and argmin make int32 indices and have no gradient: they declare
// `differentiable = false`, so a gradient that reaches them does not compile in graph mode
// and throws duet::ValueError in PyNative mode.
//
// Kernels. Both modes call the same kernel, so they agree bit for bit. Each output
// accumulates in the element type. The input is seen as groups (one per output element),
// after merging neighbouring axes of the same kind and dropping axes of size 1:
//  - the reduced axes are the innermost: each group is contiguous, reduced by Eigen's
//    vectorised reduction (per-lane partial results combined at the end: a fixed order for a
//    given length and build);
//  - one block of reduced axes with kept axes inside it ([outer, reduced, inner]): the output
//    row of `inner` elements is accumulated row by row of the input, in increasing index
//    along the reduced block, each row one vectorised pass (a strided, cache-friendly walk);
//  - anything else (reduced axes not adjacent, as axes 0 and 2 of a 4-D tensor): each group
//    in increasing input index, one running value.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include <Eigen/Core>


namespace duet {
namespace ops {

// The reduced axes, as a template value: ops::axes<1>, ops::axes<0, 2>; none means every axis.
template <int... A>
struct Axes {
  static constexpr std::array<int, sizeof...(A)> values{A...};
  static constexpr bool distinct = [] {
    for (std::size_t i = 0; i < values.size(); ++i) {
      for (std::size_t j = i + 1; j < values.size(); ++j) {
        if (values[i] == values[j]) return false;
      }
    }
    return true;
  }();
  static_assert(distinct, "duet::ops::axes: an axis is listed twice");
};
template <int... A>
inline constexpr Axes<A...> axes{};
// One axis (argmax, argmin).
template <int A>
inline constexpr Axes<A> axis{};

// Keeps the reduced axes in the output, with size 1 (MindSpore's keep_dims=True).
struct KeepDims {};
inline constexpr KeepDims keep_dims{};

namespace detail {

// Which axes of a shape of rank `rank` the values name; false if one is out of range, with
// `needed` the rank it would need.
struct AxisMask {
  std::array<bool, max_rank> reduced{};
  bool ok = true;
  index_t needed = 0;
};

template <std::size_t N>
constexpr AxisMask axis_mask(int rank, const std::array<int, N>& values) {
  AxisMask m;
  if constexpr (N == 0) {
    for (int i = 0; i < rank; ++i) m.reduced[static_cast<std::size_t>(i)] = true;
  }
  for (int a : values) {
    const int normal = a < 0 ? a + rank : a;
    if (normal < 0 || normal >= rank) {
      m.ok = false;
      m.needed = std::max<index_t>(m.needed, a < 0 ? -a : a + 1);
      continue;
    }
    m.reduced[static_cast<std::size_t>(normal)] = true;
  }
  return m;
}

// The output shape of reducing `in` over `values` (every axis if none). An input of unknown
// leading axes gives a scalar when every axis is reduced without keep_dims, its known
// trailing axes when the axes are negative and among them, and an unknown shape otherwise.
// NonEmpty: the reduction has no identity (max, min, argmax), so a reduced axis of size 0 is
// refused.
template <std::size_t N>
constexpr ShapeResult reduced_shape(const Shape& in, const std::array<int, N>& values, bool keep, bool non_empty) {
  if (in.leading_unknown()) {
    if (N == 0) return {keep ? Shape::any() : Shape{}};
    for (int a : values) {
      if (a >= 0 || -a > in.rank()) return {Shape::any()};
    }
  }
  const AxisMask m = axis_mask(in.rank(), values);
  if (!m.ok) return fault(Shape::any(), ShapeFault::min_rank, m.needed);
  Shape out = in.leading_unknown() ? Shape::any() : Shape{};
  bool empty = false;
  for (int i = 0; i < in.rank(); ++i) {
    if (!m.reduced[static_cast<std::size_t>(i)]) out.push_back(in[i]);
    else {
      empty = empty || in[i] == 0;
      if (keep) out.push_back(1);
    }
  }
  if (non_empty && empty) return fault(out, ShapeFault::empty_reduction, 0);
  return {out};
}

// A reduction of a concrete shape, as groups of input elements, one group per output element
// in the output's order. Neighbouring axes of the same kind are merged and axes of size 1
// dropped; the lists are innermost first, each axis with its stride in the input.
struct ReduceLayout {
  std::array<index_t, max_rank> kept_size{}, kept_stride{}, red_size{}, red_stride{};
  int kept = 0;
  int red = 0;
  index_t outputs = 1;
  index_t group = 1;

  // Each group contiguous: the reduced axes are the innermost.
  bool contiguous() const { return red == 1 && red_stride[0] == 1; }
  // [outer, reduced, inner]: one block of reduced axes, the innermost axis kept.
  bool strided() const { return red == 1 && kept >= 1 && kept_stride[0] == 1 && kept <= 2; }
  index_t inner() const { return kept_size[0]; }

  // f(j, base) for each output j, base the offset of its group's first element.
  template <class F>
  void for_each_group(F&& f) const {
    std::array<index_t, max_rank> index{};
    index_t base = 0;
    for (index_t j = 0; j < outputs; ++j) {
      f(j, base);
      for (int a = 0; a < kept; ++a) {
        const std::size_t ax = static_cast<std::size_t>(a);
        base += kept_stride[ax];
        if (++index[ax] < kept_size[ax]) break;
        base -= kept_stride[ax] * index[ax];
        index[ax] = 0;
      }
    }
  }

  // f(offset) for each element of a group, in increasing input index (offsets from its base).
  template <class F>
  void for_each_in_group(F&& f) const {
    if (red <= 1) {
      const index_t stride = red == 0 ? 0 : red_stride[0];
      for (index_t r = 0; r < group; ++r) f(r * stride);
      return;
    }
    std::array<index_t, max_rank> index{};
    index_t offset = 0;
    for (index_t r = 0; r < group; ++r) {
      f(offset);
      for (int a = 0; a < red; ++a) {
        const std::size_t ax = static_cast<std::size_t>(a);
        offset += red_stride[ax];
        if (++index[ax] < red_size[ax]) break;
        offset -= red_stride[ax] * index[ax];
        index[ax] = 0;
      }
    }
  }
};

inline ReduceLayout reduce_layout(const Shape& in, const AxisMask& m) {
  ReduceLayout l;
  index_t stride = 1;
  int last_kind = -1;  // 0 kept, 1 reduced: the kind of the entry appended last
  for (int i = in.rank() - 1; i >= 0; --i) {
    const index_t d = in[i];
    const bool reduced = m.reduced[static_cast<std::size_t>(i)];
    if (reduced) l.group *= d;
    else l.outputs *= d;
    if (d != 1) {
      auto& size = reduced ? l.red_size : l.kept_size;
      auto& strides = reduced ? l.red_stride : l.kept_stride;
      int& count = reduced ? l.red : l.kept;
      if (last_kind == static_cast<int>(reduced)) {
        size[static_cast<std::size_t>(count - 1)] *= d;
      } else {
        size[static_cast<std::size_t>(count)] = d;
        strides[static_cast<std::size_t>(count)] = stride;
        ++count;
        last_kind = static_cast<int>(reduced);
      }
    }
    stride *= d;
  }
  return l;
}

template <class T>
using ArrayMap = ::Eigen::Map<::Eigen::Array<T, ::Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = ::Eigen::Map<const ::Eigen::Array<T, ::Eigen::Dynamic, 1>>;

// What each reduction does with one group: its first element, then combine with each next.
struct SumReducer {
  static constexpr std::string_view name = "ReduceSum";
  static constexpr bool mean = false;
  static constexpr bool non_empty = false;
  template <class T>
  static T combine(T a, T b) {
    return a + b;
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.sum();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc += row;
  }
};

struct MeanReducer : SumReducer {
  static constexpr std::string_view name = "ReduceMean";
  static constexpr bool mean = true;
};

struct MaxReducer {
  static constexpr std::string_view name = "ReduceMax";
  static constexpr bool mean = false;
  static constexpr bool non_empty = true;
  template <class T>
  static T combine(T a, T b) {
    return fn::Maximum::apply(a, b);
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.template maxCoeff<::Eigen::PropagateNaN>();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc = acc.binaryExpr(row, ::Eigen::internal::scalar_max_op<T, T, ::Eigen::PropagateNaN>());
  }
};

struct MinReducer {
  static constexpr std::string_view name = "ReduceMin";
  static constexpr bool mean = false;
  static constexpr bool non_empty = true;
  template <class T>
  static T combine(T a, T b) {
    return fn::Minimum::apply(a, b);
  }
  template <class T>
  static T redux(const ConstArrayMap<T>& g) {
    return g.template minCoeff<::Eigen::PropagateNaN>();
  }
  template <class T>
  static void combine_rows(ArrayMap<T>& acc, const ConstArrayMap<T>& row) {
    acc = acc.binaryExpr(row, ::Eigen::internal::scalar_min_op<T, T, ::Eigen::PropagateNaN>());
  }
};

template <class AxesT, bool Keep>
std::string reduce_name(std::string_view op) {
  std::string s(op);
  s += "(axis=";
  if (AxesT::values.empty()) s += "all";
  for (std::size_t i = 0; i < AxesT::values.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(AxesT::values[i]);
  }
  return s + (Keep ? ", keep_dims)" : ")");
}

}  // namespace detail

template <class Reducer, class AxesT, bool Keep>
struct ReduceGradOp;

// Reducer over the axes AxesT (every axis if empty), the reduced axes kept as 1 if Keep.
template <class Reducer, class AxesT, bool Keep>
struct ReduceOp : Primitive<ReduceOp<Reducer, AxesT, Keep>> {
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return detail::reduced_shape(in[0], AxesT::values, Keep, Reducer::non_empty);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* out = a.out<T>();
    const Shape& in = a.in_shape();
    const detail::ReduceLayout l = detail::reduce_layout(in, detail::axis_mask(in.rank(), AxesT::values));
    if (l.outputs == 0) return;
    if (l.group == 0) {
      // Only sum and mean get here (the rule refuses an empty max): 0, and 0/0 for the mean.
      std::fill_n(out, l.outputs, Reducer::mean ? std::numeric_limits<T>::quiet_NaN() : T(0));
      return;
    }
    if (l.contiguous()) {
      for (index_t j = 0; j < l.outputs; ++j) out[j] = Reducer::redux(detail::ConstArrayMap<T>(x + j * l.group, l.group));
    } else if (l.strided()) {
      const index_t inner = l.inner();
      const index_t outer = l.outputs / inner;
      for (index_t o = 0; o < outer; ++o) {
        const T* block = x + o * l.group * inner;
        detail::ArrayMap<T> acc(out + o * inner, inner);
        acc = detail::ConstArrayMap<T>(block, inner);
        for (index_t r = 1; r < l.group; ++r) Reducer::combine_rows(acc, detail::ConstArrayMap<T>(block + r * inner, inner));
      }
    } else {
      l.for_each_group([&](index_t j, index_t base) {
        bool first = true;
        T acc{};
        l.for_each_in_group([&](index_t off) {
          acc = first ? x[base + off] : Reducer::combine(acc, x[base + off]);
          first = false;
        });
        out[j] = acc;
      });
    }
    if constexpr (Reducer::mean) {
      const T count = static_cast<T>(l.group);
      for (index_t j = 0; j < l.outputs; ++j) out[j] /= count;
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return ReduceGradOp<Reducer, AxesT, Keep>{};
  }

  static std::string op_name() { return detail::reduce_name<AxesT, Keep>(Reducer::name); }
};

// d/dx of a reduction: sum and mean spread dy over each group (mean divided by its size);
// max and min send it to the elements equal to the extreme, split evenly among ties.
template <class Reducer, class AxesT, bool Keep>
struct ReduceGradOp : Primitive<ReduceGradOp<Reducer, AxesT, Keep>> {
  static constexpr bool extreme = Reducer::non_empty;
  static constexpr auto reads = [] {
    if constexpr (extreme) return std::array{graph::Operand::grad, graph::Operand::input0, graph::Operand::output};
    else return std::array{graph::Operand::grad, graph::Operand::input0};
  }();
  static constexpr int arity = static_cast<int>(reads.size());

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    const T* x = a.in<T>(1);
    T* d = a.out<T>();
    const Shape& in = a.in_shape(1);
    const detail::ReduceLayout l = detail::reduce_layout(in, detail::axis_mask(in.rank(), AxesT::values));
    if (l.outputs == 0 || l.group == 0) return;
    if constexpr (extreme) {
      const T* y = a.in<T>(2);
      l.for_each_group([&](index_t j, index_t base) {
        const T m = y[j];
        const bool nan = m != m;
        auto hit = [&](T v) { return v == m || (nan && v != v); };
        index_t ties = 0;
        l.for_each_in_group([&](index_t off) { ties += hit(x[base + off]) ? 1 : 0; });
        const T share = dy[j] / static_cast<T>(ties);
        l.for_each_in_group([&](index_t off) { d[base + off] = hit(x[base + off]) ? share : T(0); });
      });
    } else {
      const T scale = Reducer::mean ? T(1) / static_cast<T>(l.group) : T(1);
      if (l.contiguous()) {
        for (index_t j = 0; j < l.outputs; ++j) std::fill_n(d + j * l.group, l.group, dy[j] * scale);
      } else if (l.strided()) {
        const index_t inner = l.inner();
        for (index_t o = 0; o < l.outputs / inner; ++o) {
          const detail::ConstArrayMap<T> g(dy + o * inner, inner);
          for (index_t r = 0; r < l.group; ++r) detail::ArrayMap<T>(d + (o * l.group + r) * inner, inner) = g * scale;
        }
      } else {
        l.for_each_group([&](index_t j, index_t base) {
          l.for_each_in_group([&](index_t off) { d[base + off] = dy[j] * scale; });
        });
      }
    }
  }

  static std::string op_name() { return detail::reduce_name<AxesT, Keep>(Reducer::name) + "Grad"; }
};

// The index of the first largest (smallest) element along one axis, as int32 (numpy's and
// MindSpore's choice on ties); a NaN counts as the largest and the smallest, as in numpy. In
// is the input's element type: the kernel is instantiated for the output's (int32).
template <bool Max, int Axis, bool Keep, class In>
struct ArgExtremeOp : Primitive<ArgExtremeOp<Max, Axis, Keep, In>> {
  using value_type = std::int32_t;
  static constexpr int arity = 1;
  static constexpr bool differentiable = false;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return detail::reduced_shape(in[0], std::array<int, 1>{Axis}, Keep, true);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* x = a.in<In>();
    T* out = a.out<T>();
    const Shape& in = a.in_shape();
    const int axis = Axis < 0 ? Axis + in.rank() : Axis;
    const index_t size = in[axis];
    const index_t inner = in.numel_from(axis + 1);
    const index_t outer = inner == 0 || size == 0 ? 0 : in.numel() / (size * inner);
    auto better = [](In v, In best) { return (v != v && best == best) || (Max ? v > best : v < best); };
    for (index_t o = 0; o < outer; ++o) {
      const In* block = x + o * size * inner;
      T* idx = out + o * inner;
      std::fill_n(idx, inner, T(0));
      // Along the axis outermost, so that each step reads a contiguous row of the input.
      for (index_t r = 1; r < size; ++r) {
        for (index_t i = 0; i < inner; ++i) {
          if (better(block[r * inner + i], block[idx[i] * inner + i])) idx[i] = static_cast<T>(r);
        }
      }
    }
  }

  static std::string op_name() {
    return std::string(Max ? "Argmax" : "Argmin") + "(axis=" + std::to_string(Axis) + (Keep ? ", keep_dims)" : ")");
  }
};

inline const bool reduction_listed = list_operations({"sum", "mean", "max", "min", "argmax", "argmin"});

namespace detail {

template <class X>
using element_of = typename std::remove_cvref_t<X>::value_type;

template <class Reducer, class X, class AxesT, class... Keep>
auto reduce(const X& x, AxesT, Keep...) {
  static_assert(sizeof...(Keep) <= 1 && (std::is_same_v<Keep, KeepDims> && ...),
                "duet::ops: a reduction takes the tensor, then optionally ops::axes<...>, then optionally ops::keep_dims");
  return apply(ReduceOp<Reducer, AxesT, sizeof...(Keep) == 1>{}, x);
}

template <bool Max, class X, int A, class... Keep>
auto arg_extreme(const X& x, Axes<A>, Keep...) {
  static_assert(sizeof...(Keep) <= 1 && (std::is_same_v<Keep, KeepDims> && ...),
                "duet::ops: argmax and argmin take the tensor, then optionally ops::axis<A>, then optionally ops::keep_dims");
  return apply(ArgExtremeOp<Max, A, sizeof...(Keep) == 1, element_of<X>>{}, x);
}

}  // namespace detail

// sum(x), sum(x, keep_dims), sum(x, axes<...>), sum(x, axes<...>, keep_dims); the same for
// mean, max and min.
#define DUET_DETAIL_REDUCTION(name, Reducer)                           \
  template <TensorLike X, int... A, class... Keep>                     \
  auto name(const X& x, Axes<A...> a, Keep... keep) {                  \
    return detail::reduce<detail::Reducer>(x, a, keep...);             \
  }                                                                    \
  template <TensorLike X, class... Keep>                               \
    requires((std::is_same_v<Keep, KeepDims> && ...))                  \
  auto name(const X& x, Keep... keep) {                                \
    return detail::reduce<detail::Reducer>(x, Axes<>{}, keep...);      \
  }
DUET_DETAIL_REDUCTION(sum, SumReducer)
DUET_DETAIL_REDUCTION(mean, MeanReducer)
DUET_DETAIL_REDUCTION(max, MaxReducer)
DUET_DETAIL_REDUCTION(min, MinReducer)
#undef DUET_DETAIL_REDUCTION

// argmax(x) (axis -1, MindSpore's ops.Argmax default), argmax(x, axis<A>), with keep_dims.
template <TensorLike X, int A = -1, class... Keep>
auto argmax(const X& x, Axes<A> a = {}, Keep... keep) {
  return detail::arg_extreme<true>(x, a, keep...);
}
template <TensorLike X, int A = -1, class... Keep>
auto argmin(const X& x, Axes<A> a = {}, Keep... keep) {
  return detail::arg_extreme<false>(x, a, keep...);
}

}  // namespace ops
}  // namespace duet
// Matrix products: ops::matmul(a, b) with numpy's and MindSpore's semantics, and with
// MindSpore's BatchMatMul(transpose_a, transpose_b) flags, in both modes.
//
//   ops::matmul(a, b)                          [..., m, k] · [..., k, n] -> [..., m, n]
//   ops::matmul(a, b, ops::transpose_a)        a given as [..., k, m]
//   ops::matmul(a, b, ops::transpose_b)        b given as [..., n, k] (a weight as [out, in])
//   ops::matmul(a, b, ops::transpose_a, ops::transpose_b)
// The batch axes (all but the last two) broadcast as numpy's do. A 1-D a is a row [1, k] and a
// 1-D b a column [k, 1], the added axis dropped from the result (numpy's rule; a transpose of
// a 1-D input is refused). The flags are tags, so the operation's type carries them and graph
// mode computes the output's static shape, and checks the inner dimensions, at compile time:
// a mismatch names both shapes.
//
// Gradients, C = op(A)·op(B), each summed over the batch axes its input was broadcast along:
//   no transposes: dA = dC·Bᵀ,     dB = Aᵀ·dC
//   transpose_a:   dA = B·dCᵀ,     dB = A·dC
//   transpose_b:   dA = dC·B,      dB = dCᵀ·A
//   both:          dA = Bᵀ·dCᵀ,    dB = dCᵀ·Aᵀ
// Each is a product of the same kind, so one kernel serves the forward and both gradients.
//
// Kernel: each 2-D product X'·Y' (X' = X or Xᵀ as stored, the same for Y) takes
//  - duet's GEMM (the backend's dense(), kernels::gemm in backend::Native) when X' = X and
//    Y' = Yᵀ, and the result is written rather than added to: that is gemm's layout, C = A·Bᵀ
//    with both row-major, and it applies to the forward product with transpose_b (a weight as
//    [out, in]), and to dA of the product without transposes (dC·Bᵀ), the gradient a
//    network's layers take most;
//  - an Eigen product on Maps of the row-major storage otherwise (Xᵀ or a plain Y, and
//    gradients summed over broadcast batch axes, which add into the output): Eigen reads a
//    transposed Map in place, where gemm would need a transposed copy of the operand.

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>

#include <Eigen/Core>


namespace duet {
namespace ops {

struct TransposeA {};
struct TransposeB {};
// MindSpore's BatchMatMul(transpose_a=True) and (transpose_b=True), as tags.
inline constexpr TransposeA transpose_a{};
inline constexpr TransposeB transpose_b{};

namespace detail {

// The axes of s before its last `matrix` axes, unknown leading axes kept unknown.
constexpr Shape batch_of(const Shape& s, int matrix) {
  Shape b = s.leading_unknown() ? Shape::any() : Shape{};
  for (int i = 0; i + matrix < s.rank(); ++i) b.push_back(s[i]);
  return b;
}

// An operand as a batch of stored matrices: a 1-D a is one row, a 1-D b one column.
struct MatrixView {
  Shape batch;
  index_t rows = 0;
  index_t cols = 0;
};

constexpr MatrixView matrix_view(const Shape& s, bool first) {
  if (s.rank() == 1 && !s.leading_unknown()) return first ? MatrixView{Shape{}, 1, s[0]} : MatrixView{Shape{}, s[0], 1};
  return {batch_of(s, 2), s[-2], s[-1]};
}

template <bool TA, bool TB>
constexpr ShapeResult matmul_shape(const Shape& a, const Shape& b) {
  // An unknown rank might be 1 or more: nothing is known of the result.
  if ((a.leading_unknown() && a.rank() < 2) || (b.leading_unknown() && b.rank() < 2)) return {Shape::any()};
  for (int k = 0; k < 2; ++k) {
    const Shape& s = k == 0 ? a : b;
    const bool transposed = k == 0 ? TA : TB;
    if (s.rank() < (transposed ? 2 : 1)) return fault(Shape::any(), ShapeFault::min_rank, transposed ? 2 : 1, k);
  }
  const MatrixView va = matrix_view(a, true), vb = matrix_view(b, false);
  const index_t m = TA ? va.cols : va.rows, ka = TA ? va.rows : va.cols;
  const index_t kb = TB ? vb.cols : vb.rows, n = TB ? vb.rows : vb.cols;
  const ShapeResult batch = broadcast_shapes(va.batch, vb.batch);
  Shape out = batch.shape;
  if (a.rank() > 1) out.push_back(m);
  if (b.rank() > 1) out.push_back(n);
  if (ka != kb && ka != dyn && kb != dyn) return fault(out, ShapeFault::inner_dimensions, 0, 1);
  if (!batch.ok()) return fault(out, ShapeFault::broadcast, 0, batch.input);
  return {out};
}

// c (+)= X'·Y', X stored [xr, xc] and Y [yr, yc], row-major; X' is Xᵀ if tx, Y' is Yᵀ if ty.
template <class Backend, class T>
void product(const T* x, index_t xr, index_t xc, bool tx, const T* y, index_t yr, index_t yc, bool ty, T* c,
             bool accumulate) {
  const index_t m = tx ? xc : xr, k = tx ? xr : xc, n = ty ? yr : yc;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) std::fill_n(c, m * n, T(0));
    return;
  }
  if (!tx && ty && !accumulate) {
    Backend::template dense<dyn, dyn>(x, m, k, y, n, Epilogue<T>{}, c);
    return;
  }
  using Matrix = backend::detail::RowMajorMatrix<T, dyn, dyn>;
  const ::Eigen::Map<const Matrix> X(x, xr, xc), Y(y, yr, yc);
  ::Eigen::Map<Matrix> C(c, m, n);
  auto store = [&](const auto& p) {
    if (accumulate) C.noalias() += p;
    else C.noalias() = p;
  };
  if (tx && ty) store(X.transpose() * Y.transpose());
  else if (tx) store(X.transpose() * Y);
  else if (ty) store(X * Y.transpose());
  else store(X * Y);
}

// The products of a batch: for each batch index of the result of broadcasting a's and b's
// batches, f(i, ia, ib) with the matrix indices of the result, a and b.
template <class F>
void for_each_batch(const MatrixView& a, const MatrixView& b, F&& f) {
  const Shape out = broadcast_shapes(a.batch, b.batch).shape;
  for_each_broadcast(a.batch, b.batch, out, f);
}

}  // namespace detail

template <bool TA, bool TB, int K>
struct BatchMatMulGradOp;

template <bool TA, bool TB>
struct BatchMatMulOp : Primitive<BatchMatMulOp<TA, TB>> {
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::matmul_shape<TA, TB>(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const auto va = detail::matrix_view(a.in_shape(0), true), vb = detail::matrix_view(a.in_shape(1), false);
    const T* x = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* c = a.out<T>();
    const index_t m = TA ? va.cols : va.rows, n = TB ? vb.rows : vb.cols;
    const index_t sa = va.rows * va.cols, sb = vb.rows * vb.cols;
    detail::for_each_batch(va, vb, [&](index_t i, index_t ia, index_t ib) {
      detail::product<Backend>(x + ia * sa, va.rows, va.cols, TA, y + ib * sb, vb.rows, vb.cols, TB, c + i * m * n,
                               false);
    });
  }

  template <std::size_t K>
    requires(K < 2)
  auto grad_op() const {
    return BatchMatMulGradOp<TA, TB, static_cast<int>(K)>{};
  }

  static std::string op_name() {
    return std::string("BatchMatMul") + (TA ? "(transpose_a" : "") + (TA && TB ? ", " : TB ? "(" : "") +
           (TB ? "transpose_b" : "") + (TA || TB ? ")" : "");
  }
};

// d/d input K of op(A)·op(B), by the table at the top of this header, summed over the batch
// axes input K was broadcast along.
template <bool TA, bool TB, int K>
struct BatchMatMulGradOp : Primitive<BatchMatMulGradOp<TA, TB, K>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1};
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const auto va = detail::matrix_view(a.in_shape(1), true), vb = detail::matrix_view(a.in_shape(2), false);
    const T* dc = a.in<T>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* d = a.out<T>();
    const index_t m = TA ? va.cols : va.rows, n = TB ? vb.rows : vb.cols;
    const index_t sa = va.rows * va.cols, sb = vb.rows * vb.cols;
    const detail::MatrixView& target = K == 0 ? va : vb;
    const Shape out_batch = broadcast_shapes(va.batch, vb.batch).shape;
    // Each target matrix is written once unless its input was broadcast along batch axes.
    const bool accumulate = target.batch.numel() != out_batch.numel();
    if (accumulate) std::fill_n(d, a.in_shape(1 + K).numel(), T(0));
    detail::for_each_batch(va, vb, [&](index_t i, index_t ia, index_t ib) {
      const T* g = dc + i * m * n;
      const T* A = x + ia * sa;
      const T* B = y + ib * sb;
      if constexpr (K == 0) {
        T* out = d + ia * sa;
        if constexpr (!TA && !TB) detail::product<Backend>(g, m, n, false, B, vb.rows, vb.cols, true, out, accumulate);
        else if constexpr (TA && !TB) detail::product<Backend>(B, vb.rows, vb.cols, false, g, m, n, true, out, accumulate);
        else if constexpr (!TA && TB) detail::product<Backend>(g, m, n, false, B, vb.rows, vb.cols, false, out, accumulate);
        else detail::product<Backend>(B, vb.rows, vb.cols, true, g, m, n, true, out, accumulate);
      } else {
        T* out = d + ib * sb;
        if constexpr (!TA && !TB) detail::product<Backend>(A, va.rows, va.cols, true, g, m, n, false, out, accumulate);
        else if constexpr (TA && !TB) detail::product<Backend>(A, va.rows, va.cols, false, g, m, n, false, out, accumulate);
        else if constexpr (!TA && TB) detail::product<Backend>(g, m, n, true, A, va.rows, va.cols, false, out, accumulate);
        else detail::product<Backend>(g, m, n, true, A, va.rows, va.cols, true, out, accumulate);
      }
    });
  }

  static std::string op_name() { return BatchMatMulOp<TA, TB>::op_name() + "Grad" + std::to_string(K); }
};

inline const bool matmul_listed = list_operations({"matmul"});

template <TensorLike A, TensorLike B, class... Flags>
auto matmul(const A& a, const B& b, Flags...) {
  using F = std::tuple<Flags...>;
  static_assert(std::is_same_v<F, std::tuple<>> || std::is_same_v<F, std::tuple<TransposeA>> ||
                    std::is_same_v<F, std::tuple<TransposeB>> || std::is_same_v<F, std::tuple<TransposeA, TransposeB>>,
                "duet::ops::matmul: the flags are ops::transpose_a, ops::transpose_b or both, in that order");
  constexpr bool ta = (std::is_same_v<Flags, TransposeA> || ...);
  constexpr bool tb = (std::is_same_v<Flags, TransposeB> || ...);
  static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                "duet::ops::matmul: both factors must have the same element type");
  return apply(BatchMatMulOp<ta, tb>{}, a, b);
}

}  // namespace ops
}  // namespace duet
// Pooling over the two spatial axes of NCHW tensors: max, average and adaptive average, as
// operations (MindSpore's ops.max_pool2d, ops.avg_pool2d, ops.adaptive_avg_pool2d) and as
// layers (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d), in both modes.
//
// Spelling. The window decides the output's shape, so it is a template argument: graph mode
// checks every layer after a pool against a static shape while the program compiles.
//   nn::MaxPool2d<Kernel, Stride = 1, nn::PadMode Mode = nn::PadMode::valid, Padding = 0>
//   nn::AvgPool2d<Kernel, Stride = 1, Mode = valid, Padding = 0, CountIncludePad = true>
//   nn::AdaptiveAvgPool2d<OutH, OutW = OutH>        (<1>: global average pooling)
//   ops::max_pool2d<Kernel, Stride = Kernel, Padding = 0>(x)
//   ops::avg_pool2d<Kernel, Stride = 1, Padding = 0>(x)
//   ops::adaptive_avg_pool2d<OutH, OutW = OutH>(x)
// The defaults are MindSpore's, which differ from PyTorch's: nn.MaxPool2d and nn.AvgPool2d
// default to stride 1 (PyTorch: the kernel size) and pad_mode "valid"; ops.max_pool2d defaults
// its stride to the kernel size, ops.avg_pool2d to 1. pad_mode (MindSpore's strings) is:
//   valid  no padding, out = floor((in - k) / s) + 1;
//   same   out = ceil(in / s), padded by max((out - 1) s + k - in, 0) in total, the odd one at
//          the bottom/right (TensorFlow's rule); an average divides by the elements inside the
//          input only, as MindSpore's "same" AvgPool and TensorFlow do;
//   pad    `Padding` on each side, out = floor((in + 2p - k) / s) + 1 (PyTorch's rule, which the
//          functional forms use); an average counts the padding if CountIncludePad (MindSpore's
//          and PyTorch's default). Padding is at most half the kernel, so no window is all padding.
// Max pooling never reads padding (PyTorch's -inf padding). Square kernels and strides, no
// dilation, ceil_mode or divisor_override; inputs of rank 4 only (PyTorch also takes CHW).
//
// Gradients. Max pooling sends each output's gradient to one input, the first maximal element
// of its window in row-major order (the smallest row, then the smallest column: PyTorch's CPU
// choice); a NaN counts as the largest, so the first NaN of a window takes the gradient. A
// window's ties are resolved by that rule alone, taken again from x in the gradient kernel,
// which both modes call: the same element in both. Where windows overlap an input element may
// receive several outputs' gradients, added in output order. Average pooling spreads dy / count
// over its window; adaptive pooling does so over each bin.
//
// Kernels. NCHW, one (sample, channel) plane at a time. The forward kernels and the average's
// gradient walk each window element in row-major order, and for each one make a pass along an
// output row over the columns whose windows lie inside the input: a loop of constant stride
// (the window's stride, a compile-time constant), no branch, no call, which the compiler
// vectorises (max as compare-and-select). The few border columns whose windows meet the
// padding run the same order on the clipped window, one element at a time. Measured against
// one output at a time in the same order (g++ -O3, medians, 2026-11-30, a shared 2-core
// machine): max pooling's forward is 2.4 to 7 times faster this way (2x2/2 on [64, 6, 28, 28]
// and [64, 16, 10, 10], 3x3/2 pad 1 on [32, 64, 28, 28], 3x3/1 same on [32, 16, 28, 28]). Max
// pooling's gradient is a branch-free argmax search (random data mispredicts "a new maximum")
// and a scatter, one output at a time. Adaptive pooling sums
// each bin row by row with Eigen's vectorised reduction (a whole bin at once when it spans
// full rows: global pooling is one contiguous sum per plane). Nothing is allocated beyond the
// output.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <Eigen/Core>


namespace duet {

namespace ops {

// A pooling window over the last two axes (height, width).
struct Pool2dWindow {
  index_t kernel_h = 1;
  index_t kernel_w = 1;
  index_t stride_h = 1;
  index_t stride_w = 1;
  nn::PadMode pad_mode = nn::PadMode::valid;
  index_t pad_h = 0;  // pad_mode pad: on each side
  index_t pad_w = 0;
  bool count_include_pad = true;  // average pooling in pad_mode pad
};

namespace detail {

// One spatial axis of a window: the output size, the padding before the first element, and the
// smallest input the window fits (for the shape rule).
struct PoolAxis {
  index_t out;
  index_t pad_before;
  index_t min_input;
};

constexpr PoolAxis pool_axis(index_t in, index_t k, index_t s, nn::PadMode mode, index_t p) {
  if (mode == nn::PadMode::same) {
    if (in == dyn) return {dyn, 0, 0};
    const index_t out = (in + s - 1) / s;
    const index_t total = std::max<index_t>((out - 1) * s + k - in, 0);
    return {out, total / 2, 0};
  }
  const index_t pad = mode == nn::PadMode::pad ? p : 0;
  const index_t min_input = k - 2 * pad;
  if (in == dyn) return {dyn, pad, min_input};
  if (in < min_input) return {0, pad, min_input};
  return {(in + 2 * pad - k) / s + 1, pad, min_input};
}

// [N, C, H, W] -> [N, C, OH, OW]. A rank other than 4 is refused; an input whose spatial axes
// are smaller than the window (after padding) too.
constexpr ShapeResult pool2d_rule(const Pool2dWindow& w, const Shape& x) {
  if (x.rank() < 2 || (!x.leading_unknown() && x.rank() != 4)) {
    return x.leading_unknown() ? ShapeResult{Shape::any()} : fault(x, ShapeFault::exact_rank, 4);
  }
  const PoolAxis h = pool_axis(x[-2], w.kernel_h, w.stride_h, w.pad_mode, w.pad_h);
  const PoolAxis v = pool_axis(x[-1], w.kernel_w, w.stride_w, w.pad_mode, w.pad_w);
  Shape y = x;
  y[-2] = h.out;
  y[-1] = v.out;
  if (x[-2] != dyn && x[-2] < h.min_input) return fault(y, ShapeFault::spatial_size, h.min_input);
  if (x[-1] != dyn && x[-1] < v.min_input) return fault(y, ShapeFault::spatial_size, v.min_input);
  return {y};
}

// The planes of a concrete NCHW shape and its window's arithmetic.
struct PoolGeometry {
  index_t planes, H, W, OH, OW, pad_top, pad_left;
  // Output columns [lo, hi) have windows inside the input's columns.
  index_t lo, hi;
};

inline PoolGeometry pool_geometry(const Pool2dWindow& w, const Shape& x) {
  const PoolAxis h = pool_axis(x[2], w.kernel_h, w.stride_h, w.pad_mode, w.pad_h);
  const PoolAxis v = pool_axis(x[3], w.kernel_w, w.stride_w, w.pad_mode, w.pad_w);
  PoolGeometry g{x[0] * x[1], x[2], x[3], h.out, v.out, h.pad_before, v.pad_before, 0, 0};
  g.lo = std::min(g.OW, (g.pad_left + w.stride_w - 1) / w.stride_w);
  const index_t last_start = g.W + g.pad_left - w.kernel_w;  // of a window ending at the last column
  g.hi = std::max(g.lo, last_start < 0 ? index_t{0} : std::min(g.OW, last_start / w.stride_w + 1));
  return g;
}

// The rows [lo, hi) of a window that lie inside the input, for output row oh.
struct WindowRows {
  index_t first;  // input row of window row 0 (may be negative)
  index_t lo, hi;
};

template <Pool2dWindow Win>
WindowRows window_rows(const PoolGeometry& g, index_t oh) {
  const index_t first = oh * Win.stride_h - g.pad_top;
  return {first, std::max<index_t>(0, -first), std::min<index_t>(Win.kernel_h, g.H - first)};
}

struct MaxPoolKind {
  static constexpr std::string_view name = "MaxPool2d";
  static constexpr std::string_view function = "ops::max_pool2d";
  // A NaN wins, so the maximum of a window with a NaN is NaN. Both comparisons are evaluated
  // (no short circuit): a compare-and-select the compiler vectorises.
  template <class T>
  static T combine(T acc, T v) {
    return ((v > acc) | (v != v)) ? v : acc;
  }
  template <class T>
  static T finish(T acc, index_t) {
    return acc;
  }
};

struct AvgPoolKind {
  static constexpr std::string_view name = "AvgPool2d";
  static constexpr std::string_view function = "ops::avg_pool2d";
  template <class T>
  static T combine(T acc, T v) {
    return acc + v;
  }
  template <class T>
  static T finish(T acc, index_t count) {
    return acc / static_cast<T>(count);
  }
};

// The divisor of an average over `rows` x `cols` window elements inside the input.
template <Pool2dWindow Win>
constexpr index_t average_count(index_t rows, index_t cols) {
  if (Win.pad_mode == nn::PadMode::pad && Win.count_include_pad) return Win.kernel_h * Win.kernel_w;
  return rows * cols;
}

template <class Kind, Pool2dWindow Win, class T>
void pool2d_forward(const PoolGeometry& g, const T* x, T* y) {
  constexpr index_t KW = Win.kernel_w;
  constexpr index_t SW = Win.stride_w;
  for (index_t p = 0; p < g.planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    T* yp = y + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const WindowRows r = window_rows<Win>(g, oh);
      T* yr = yp + oh * g.OW;
      bool first = true;
      for (index_t kh = r.lo; kh < r.hi; ++kh) {
        const T* row = xp + (r.first + kh) * g.W;
        for (index_t kw = 0; kw < KW; ++kw) {
          const index_t offset = kw - g.pad_left;  // input column of output column ow: ow * SW + offset
          if (first) {
            for (index_t ow = g.lo; ow < g.hi; ++ow) yr[ow] = row[ow * SW + offset];
          } else {
            for (index_t ow = g.lo; ow < g.hi; ++ow) yr[ow] = Kind::combine(yr[ow], row[ow * SW + offset]);
          }
          first = false;
        }
      }
      const index_t inner_count = average_count<Win>(r.hi - r.lo, KW);
      for (index_t ow = g.lo; ow < g.hi; ++ow) yr[ow] = Kind::finish(yr[ow], inner_count);
      auto border = [&](index_t ow) {
        const index_t c0 = ow * SW - g.pad_left;
        const index_t kw_lo = std::max<index_t>(0, -c0);
        const index_t kw_hi = std::min<index_t>(KW, g.W - c0);
        T acc{};
        bool empty = true;
        for (index_t kh = r.lo; kh < r.hi; ++kh) {
          for (index_t kw = kw_lo; kw < kw_hi; ++kw) {
            const T v = xp[(r.first + kh) * g.W + c0 + kw];
            acc = empty ? v : Kind::combine(acc, v);
            empty = false;
          }
        }
        yr[ow] = Kind::finish(acc, average_count<Win>(r.hi - r.lo, kw_hi - kw_lo));
      };
      for (index_t ow = 0; ow < g.lo; ++ow) border(ow);
      for (index_t ow = g.hi; ow < g.OW; ++ow) border(ow);
    }
  }
}

// max_pool2d_backward where the windows tile the input (stride = kernel, no padding, no
// window past the edge), as in LeNet-5's and most CNNs' 2x2 pooling: each element lies in one
// window at most, so dx is written once, window by window, with no zeroing pass first and no
// bounds per window. A row of windows goes tap by tap across a chunk of columns, keeping each
// window's maximum and tap in arrays, so that the loops over columns vectorise (a window at a
// time, its taps' compare-and-select chain ran at about 40 cycles a window). Measured on
// LeNet-5's training step at batch 64 (AMD EPYC Zen 5, one thread), the general loop below
// was 15% of the step. dx = 0 + dy where the general loop adds dy to a zero, so that the two
// give the same bits, -0 included.
// c ? a : b through the bits, which compilers keep branch-free and vectorise: a branch on
// which tap holds a window's maximum is a coin toss on real data (g++ 12 -O3 branched on the
// conditional expression it took for a conditional addition: 1.2 ms against 0.4 for LeNet-5's
// first pooling at batch 64; the compare loop's selects vectorise as they are).
template <class T>
T select_bits(bool c, T a, T b) {
  using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  const U mask = U(0) - U(c);
  return std::bit_cast<T>(static_cast<U>((std::bit_cast<U>(a) & mask) | (std::bit_cast<U>(b) & ~mask)));
}

// Whether v takes over as a window's maximum from best: a larger value, or the first NaN (the
// forward pass's maximum is NaN once any is, and the gradient goes to the first). Branch-free
// by using | and &: on random data the branch of "a new maximum" is mispredicted often.
template <class T>
bool takes_max(T v, T best) {
  return (v > best) | ((v != v) & (best == best));
}

template <Pool2dWindow Win, class T>
void max_pool2d_backward_tiled(const PoolGeometry& g, const T* dy, const T* x, T* dx) {
  constexpr index_t KH = Win.kernel_h;
  constexpr index_t KW = Win.kernel_w;
  constexpr index_t chunk = 64;
  const index_t W = g.W;
  T best[chunk];
  std::int32_t at[chunk];
  for (index_t p = 0; p < g.planes; ++p) {
    const T* xp = x + p * g.H * W;
    T* dxp = dx + p * g.H * W;
    const T* dyp = dy + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const T* xr = xp + oh * KH * W;
      T* dxr = dxp + oh * KH * W;
      const T* dyr = dyp + oh * g.OW;
      for (index_t ow0 = 0; ow0 < g.OW; ow0 += chunk) {
        const index_t n = std::min(chunk, g.OW - ow0);
        const T* xc = xr + ow0 * KW;
        T* dxc = dxr + ow0 * KW;
        const T* dyc = dyr + ow0;
        for (index_t i = 0; i < n; ++i) {
          best[i] = xc[i * KW];
          at[i] = 0;
        }
        for (index_t kh = 0; kh < KH; ++kh) {
          for (index_t kw = 0; kw < KW; ++kw) {
            const T* xt = xc + kh * W + kw;
            for (index_t i = 0; i < n; ++i) {
              const T v = xt[i * KW];
              const bool take = takes_max(v, best[i]);
              best[i] = take ? v : best[i];
              at[i] = take ? static_cast<std::int32_t>(kh * KW + kw) : at[i];
            }
          }
        }
        for (index_t kh = 0; kh < KH; ++kh) {
          for (index_t kw = 0; kw < KW; ++kw) {
            T* dxt = dxc + kh * W + kw;
            const auto tap = static_cast<std::int32_t>(kh * KW + kw);
            for (index_t i = 0; i < n; ++i) dxt[i * KW] = select_bits(at[i] == tap, T(0) + dyc[i], T(0));
          }
        }
      }
      for (index_t kh = 0; kh < KH; ++kh) std::fill(dxr + kh * W + g.OW * KW, dxr + (kh + 1) * W, T(0));
    }
    std::fill(dxp + g.OH * KH * W, dxp + g.H * W, T(0));
  }
}

// dx of max pooling: each dy to its window's first maximal element (a NaN counting as larger
// than any number).
template <Pool2dWindow Win, class T>
void max_pool2d_backward(const PoolGeometry& g, const T* dy, const T* x, T* dx) {
  if constexpr (Win.stride_h == Win.kernel_h && Win.stride_w == Win.kernel_w) {
    if (g.pad_top == 0 && g.pad_left == 0 && g.OH * Win.kernel_h <= g.H && g.OW * Win.kernel_w <= g.W) {
      max_pool2d_backward_tiled<Win>(g, dy, x, dx);
      return;
    }
  }
  std::fill_n(dx, g.planes * g.H * g.W, T(0));
  for (index_t p = 0; p < g.planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    T* dxp = dx + p * g.H * g.W;
    const T* dyp = dy + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const WindowRows r = window_rows<Win>(g, oh);
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const index_t c0 = ow * Win.stride_w - g.pad_left;
        const index_t kw_lo = std::max<index_t>(0, -c0);
        const index_t kw_hi = std::min<index_t>(Win.kernel_w, g.W - c0);
        index_t at = (r.first + r.lo) * g.W + c0 + kw_lo;
        T best = xp[at];
        for (index_t kh = r.lo; kh < r.hi; ++kh) {
          for (index_t kw = kw_lo; kw < kw_hi; ++kw) {
            const index_t i = (r.first + kh) * g.W + c0 + kw;
            const T v = xp[i];
            const bool take = takes_max(v, best);
            best = take ? v : best;
            at = take ? i : at;
          }
        }
        dxp[at] += dyp[oh * g.OW + ow];
      }
    }
  }
}

// dx of average pooling: dy / count added over each window, in the forward kernel's order.
template <Pool2dWindow Win, class T>
void avg_pool2d_backward(const PoolGeometry& g, const T* dy, T* dx) {
  constexpr index_t KW = Win.kernel_w;
  constexpr index_t SW = Win.stride_w;
  std::fill_n(dx, g.planes * g.H * g.W, T(0));
  for (index_t p = 0; p < g.planes; ++p) {
    T* dxp = dx + p * g.H * g.W;
    const T* dyp = dy + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const WindowRows r = window_rows<Win>(g, oh);
      const T* dyr = dyp + oh * g.OW;
      const T inner_count = static_cast<T>(average_count<Win>(r.hi - r.lo, KW));
      for (index_t kh = r.lo; kh < r.hi; ++kh) {
        T* row = dxp + (r.first + kh) * g.W;
        for (index_t kw = 0; kw < KW; ++kw) {
          const index_t offset = kw - g.pad_left;
          for (index_t ow = g.lo; ow < g.hi; ++ow) row[ow * SW + offset] += dyr[ow] / inner_count;
        }
      }
      auto border = [&](index_t ow) {
        const index_t c0 = ow * SW - g.pad_left;
        const index_t kw_lo = std::max<index_t>(0, -c0);
        const index_t kw_hi = std::min<index_t>(KW, g.W - c0);
        const T share = dyr[ow] / static_cast<T>(average_count<Win>(r.hi - r.lo, kw_hi - kw_lo));
        for (index_t kh = r.lo; kh < r.hi; ++kh) {
          for (index_t kw = kw_lo; kw < kw_hi; ++kw) dxp[(r.first + kh) * g.W + c0 + kw] += share;
        }
      };
      for (index_t ow = 0; ow < g.lo; ++ow) border(ow);
      for (index_t ow = g.hi; ow < g.OW; ++ow) border(ow);
    }
  }
}

template <Pool2dWindow Win>
std::string window_text() {
  std::string s = "(kernel=" + std::to_string(Win.kernel_h) + "x" + std::to_string(Win.kernel_w) +
                  ", stride=" + std::to_string(Win.stride_h) + "x" + std::to_string(Win.stride_w) +
                  ", pad_mode=" + std::string(name_of(Win.pad_mode));
  if (Win.pad_mode == nn::PadMode::pad) s += ", padding=" + std::to_string(Win.pad_h) + "x" + std::to_string(Win.pad_w);
  return s + ")";
}

// Adaptive pooling's bin i of `out` over an axis of `in` elements: [floor(i in / out),
// ceil((i + 1) in / out)), PyTorch's and MindSpore's rule (bins overlap when out does not
// divide in).
constexpr index_t bin_begin(index_t i, index_t in, index_t out) { return i * in / out; }
constexpr index_t bin_end(index_t i, index_t in, index_t out) { return ((i + 1) * in + out - 1) / out; }

constexpr ShapeResult adaptive_pool2d_rule(index_t out_h, index_t out_w, const Shape& x) {
  if (x.rank() < 2 || (!x.leading_unknown() && x.rank() != 4)) {
    return x.leading_unknown() ? ShapeResult{Shape::any()} : fault(x, ShapeFault::exact_rank, 4);
  }
  Shape y = x;
  y[-2] = out_h;
  y[-1] = out_w;
  if (x[-2] == 0 || x[-1] == 0) return fault(y, ShapeFault::spatial_size, 1);
  return {y};
}

template <class T>
using PoolArrayMap = ::Eigen::Map<::Eigen::Array<T, ::Eigen::Dynamic, 1>>;
template <class T>
using ConstPoolArrayMap = ::Eigen::Map<const ::Eigen::Array<T, ::Eigen::Dynamic, 1>>;

// f(plane, oh, ow, first row, rows, first column, columns) for each bin of each plane.
template <class F>
void for_each_bin(const Shape& x, index_t out_h, index_t out_w, F&& f) {
  const index_t planes = x[0] * x[1];
  const index_t H = x[2];
  const index_t W = x[3];
  for (index_t p = 0; p < planes; ++p) {
    for (index_t oh = 0; oh < out_h; ++oh) {
      const index_t h0 = bin_begin(oh, H, out_h);
      const index_t h1 = bin_end(oh, H, out_h);
      for (index_t ow = 0; ow < out_w; ++ow) {
        const index_t w0 = bin_begin(ow, W, out_w);
        f(p, oh, ow, h0, h1 - h0, w0, bin_end(ow, W, out_w) - w0);
      }
    }
  }
}

}  // namespace detail

template <class Kind, Pool2dWindow Win, class Layer>
struct Pool2dGradOp;

// Kind pooling with window Win. Layer is the nn:: layer that captures it (named in errors), or
// void for the functional form.
template <class Kind, Pool2dWindow Win, class Layer = void>
struct Pool2dOp : Primitive<Pool2dOp<Kind, Win, Layer>> {
  static_assert(Win.kernel_h >= 1 && Win.kernel_w >= 1 && Win.stride_h >= 1 && Win.stride_w >= 1,
                "duet::ops: a pooling window's kernel and stride must be at least 1");
  static_assert(Win.pad_h >= 0 && Win.pad_w >= 0 && 2 * Win.pad_h <= Win.kernel_h && 2 * Win.pad_w <= Win.kernel_w,
                "duet::ops: a pooling window's padding must be at least 0 and at most half its kernel");
  using layer_type = std::conditional_t<std::is_void_v<Layer>, Pool2dOp, Layer>;
  static constexpr int arity = 1;

  const Layer* layer;
  Pool2dOp(const Layer* l = nullptr) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::pool2d_rule(Win, in[0]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    detail::pool2d_forward<Kind, Win>(detail::pool_geometry(Win, a.in_shape()), a.in<T>(), a.out<T>());
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return Pool2dGradOp<Kind, Win, Layer>{layer};
  }

  static std::string op_name() { return std::string(Kind::name) + detail::window_text<Win>(); }
  std::string label() const {
    if constexpr (std::is_void_v<Layer>) return std::string(Kind::function) + detail::window_text<Win>();
    else return layer->label();
  }

  // ONNX: MaxPool or AveragePool, the padding explicit (SAME's depends on the input's size); an
  // average counts the padding as duet's does (only in pad_mode pad with count_include_pad).
  Interchange interchange(std::span<const Shape> in) const {
    const index_t k[2] = {Win.kernel_h, Win.kernel_w}, s[2] = {Win.stride_h, Win.stride_w}, p[2] = {Win.pad_h, Win.pad_w};
    std::vector<std::int64_t> pads(4);
    for (int i = 0; i < 2; ++i) {
      const index_t size = in[0][2 + i];
      const detail::PoolAxis axis = detail::pool_axis(size, k[i], s[i], Win.pad_mode, p[i]);
      pads[i] = axis.pad_before;
      pads[2 + i] = Win.pad_mode == nn::PadMode::same
                        ? std::max<index_t>(0, (axis.out - 1) * s[i] + k[i] - size) - axis.pad_before
                        : axis.pad_before;
    }
    using A = InterchangeAttribute;
    InterchangeNode pool{std::is_same_v<Kind, detail::MaxPoolKind> ? "MaxPool" : "AveragePool",
                         {InterchangeInput::operand(0)},
                         {A::of("kernel_shape", {k[0], k[1]}), A::of("strides", {s[0], s[1]}), A::of("pads", pads)}};
    if constexpr (!std::is_same_v<Kind, detail::MaxPoolKind>) {
      pool.attributes.push_back(A::of("count_include_pad", Win.pad_mode == nn::PadMode::pad && Win.count_include_pad));
    }
    return {std::move(pool)};
  }
};

// d/dx of Pool2dOp, from dy and x.
template <class Kind, Pool2dWindow Win, class Layer>
struct Pool2dGradOp : Primitive<Pool2dGradOp<Kind, Win, Layer>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;

  const Layer* layer;
  Pool2dGradOp(const Layer* l = nullptr) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const detail::PoolGeometry g = detail::pool_geometry(Win, a.in_shape(1));
    if constexpr (std::is_same_v<Kind, detail::MaxPoolKind>) {
      detail::max_pool2d_backward<Win>(g, a.in<T>(0), a.in<T>(1), a.out<T>());
    } else {
      detail::avg_pool2d_backward<Win>(g, a.in<T>(0), a.out<T>());
    }
  }

  static std::string op_name() { return std::string(Kind::name) + "Grad" + detail::window_text<Win>(); }
};

template <index_t OutH, index_t OutW, class Layer>
struct AdaptiveAvgPool2dGradOp;

// The average of each of OutH x OutW bins of the spatial axes.
template <index_t OutH, index_t OutW, class Layer = void>
struct AdaptiveAvgPool2dOp : Primitive<AdaptiveAvgPool2dOp<OutH, OutW, Layer>> {
  static_assert(OutH >= 1 && OutW >= 1, "duet::ops::adaptive_avg_pool2d: the output size must be at least 1");
  using layer_type = std::conditional_t<std::is_void_v<Layer>, AdaptiveAvgPool2dOp, Layer>;
  static constexpr int arity = 1;

  const Layer* layer;
  AdaptiveAvgPool2dOp(const Layer* l = nullptr) : layer(l) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    return detail::adaptive_pool2d_rule(OutH, OutW, in[0]);
  }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* x = a.in<T>();
    T* y = a.out<T>();
    const index_t H = a.in_shape()[2];
    const index_t W = a.in_shape()[3];
    detail::for_each_bin(a.in_shape(), OutH, OutW,
                         [&](index_t p, index_t oh, index_t ow, index_t h0, index_t rows, index_t w0, index_t cols) {
                           const T* xp = x + p * H * W;
                           T sum;
                           if (cols == W) {
                             sum = detail::ConstPoolArrayMap<T>(xp + h0 * W, rows * W).sum();
                           } else {
                             sum = T(0);
                             for (index_t h = h0; h < h0 + rows; ++h) {
                               sum += detail::ConstPoolArrayMap<T>(xp + h * W + w0, cols).sum();
                             }
                           }
                           y[(p * OutH + oh) * OutW + ow] = sum / static_cast<T>(rows * cols);
                         });
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return AdaptiveAvgPool2dGradOp<OutH, OutW, Layer>{};
  }

  static std::string op_name() {
    return "AdaptiveAvgPool2d(output_size=" + std::to_string(OutH) + "x" + std::to_string(OutW) + ")";
  }
  // ONNX has the global average (output 1x1) only.
  Interchange interchange(std::span<const Shape>) const {
    if constexpr (OutH == 1 && OutW == 1) return {{"GlobalAveragePool", {InterchangeInput::operand(0)}, {}}};
    else return {};
  }
  std::string label() const {
    if constexpr (std::is_void_v<Layer>) {
      return "ops::adaptive_avg_pool2d<" + std::to_string(OutH) + ", " + std::to_string(OutW) + ">";
    } else {
      return layer->label();
    }
  }
};

// d/dx of adaptive average pooling: dy / count added over each bin.
template <index_t OutH, index_t OutW, class Layer>
struct AdaptiveAvgPool2dGradOp : Primitive<AdaptiveAvgPool2dGradOp<OutH, OutW, Layer>> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const T* dy = a.in<T>(0);
    T* dx = a.out<T>();
    const Shape& x = a.in_shape(1);
    std::fill_n(dx, x.numel(), T(0));
    const index_t H = x[2];
    const index_t W = x[3];
    detail::for_each_bin(x, OutH, OutW,
                         [&](index_t p, index_t oh, index_t ow, index_t h0, index_t rows, index_t w0, index_t cols) {
                           const T share = dy[(p * OutH + oh) * OutW + ow] / static_cast<T>(rows * cols);
                           for (index_t h = h0; h < h0 + rows; ++h) {
                             detail::PoolArrayMap<T>(dx + (p * H + h) * W + w0, cols) += share;
                           }
                         });
  }

  static std::string op_name() {
    return "AdaptiveAvgPool2dGrad(output_size=" + std::to_string(OutH) + "x" + std::to_string(OutW) + ")";
  }
};

inline const bool pool_listed = list_operations({"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"});

// MindSpore's ops.max_pool2d(x, kernel_size, stride=None (the kernel size), padding=0).
template <index_t Kernel, index_t Stride = Kernel, index_t Padding = 0, TensorLike X>
auto max_pool2d(const X& x) {
  constexpr Pool2dWindow w{Kernel, Kernel, Stride, Stride, nn::PadMode::pad, Padding, Padding};
  return apply(Pool2dOp<detail::MaxPoolKind, w>{}, x);
}

// MindSpore's ops.avg_pool2d(x, kernel_size, stride=1, padding=0, count_include_pad=True).
template <index_t Kernel, index_t Stride = 1, index_t Padding = 0, TensorLike X>
auto avg_pool2d(const X& x) {
  constexpr Pool2dWindow w{Kernel, Kernel, Stride, Stride, nn::PadMode::pad, Padding, Padding};
  return apply(Pool2dOp<detail::AvgPoolKind, w>{}, x);
}

// MindSpore's ops.adaptive_avg_pool2d(x, output_size): <1> is global average pooling.
template <index_t OutH, index_t OutW = OutH, TensorLike X>
auto adaptive_avg_pool2d(const X& x) {
  return apply(AdaptiveAvgPool2dOp<OutH, OutW>{}, x);
}

}  // namespace ops

namespace nn {

namespace detail {

template <index_t Kernel, index_t Stride, nn::PadMode Mode, index_t Padding>
std::string pool_type_name(std::string_view layer) {
  return std::string(layer) + "<" + std::to_string(Kernel) + ", " + std::to_string(Stride) + ", " +
         std::string(name_of(Mode)) + ", " + std::to_string(Padding) + ">";
}

}  // namespace detail

// MindSpore's nn.MaxPool2d(kernel_size, stride=1, pad_mode="valid", padding=0) on NCHW inputs.
template <index_t Kernel = 1, index_t Stride = 1, nn::PadMode Mode = nn::PadMode::valid, index_t Padding = 0,
          ElementType T = float>
class MaxPool2d : public Cell<MaxPool2d<Kernel, Stride, Mode, Padding, T>, CONTEXT_MODE, T> {
  static_assert(Mode == nn::PadMode::pad || Padding == 0,
                "nn::MaxPool2d: padding is given with nn::PadMode::pad only (MindSpore: padding must be 0 in "
                "pad_mode valid and same)");

 public:
  static constexpr ops::Pool2dWindow window{Kernel, Kernel, Stride, Stride, Mode, Padding, Padding};

  template <class X>
  auto construct(X&& x) {
    return apply(ops::Pool2dOp<ops::detail::MaxPoolKind, window, MaxPool2d>{this}, std::forward<X>(x));
  }
  std::string type_name() const override {
    return detail::pool_type_name<Kernel, Stride, Mode, Padding>("nn::MaxPool2d");
  }
};

// MindSpore's nn.AvgPool2d(kernel_size, stride=1, pad_mode="valid", padding=0,
// count_include_pad=True) on NCHW inputs.
template <index_t Kernel = 1, index_t Stride = 1, nn::PadMode Mode = nn::PadMode::valid, index_t Padding = 0,
          bool CountIncludePad = true, ElementType T = float>
class AvgPool2d : public Cell<AvgPool2d<Kernel, Stride, Mode, Padding, CountIncludePad, T>, CONTEXT_MODE, T> {
  static_assert(Mode == nn::PadMode::pad || Padding == 0,
                "nn::AvgPool2d: padding is given with nn::PadMode::pad only (MindSpore: padding must be 0 in "
                "pad_mode valid and same)");

 public:
  static constexpr ops::Pool2dWindow window{Kernel, Kernel, Stride, Stride, Mode, Padding, Padding, CountIncludePad};

  template <class X>
  auto construct(X&& x) {
    return apply(ops::Pool2dOp<ops::detail::AvgPoolKind, window, AvgPool2d>{this}, std::forward<X>(x));
  }
  std::string type_name() const override {
    std::string s = detail::pool_type_name<Kernel, Stride, Mode, Padding>("nn::AvgPool2d");
    if (!CountIncludePad) s.insert(s.size() - 1, ", count_include_pad=false");
    return s;
  }
};

// MindSpore's nn.AdaptiveAvgPool2d(output_size): each output element the average of its bin of
// the input's height and width, whatever their sizes. AdaptiveAvgPool2d<1> is global average
// pooling ([N, C, H, W] -> [N, C, 1, 1]).
template <index_t OutH, index_t OutW = OutH, ElementType T = float>
class AdaptiveAvgPool2d : public Cell<AdaptiveAvgPool2d<OutH, OutW, T>, CONTEXT_MODE, T> {
 public:
  template <class X>
  auto construct(X&& x) {
    return apply(ops::AdaptiveAvgPool2dOp<OutH, OutW, AdaptiveAvgPool2d>{this}, std::forward<X>(x));
  }
  std::string type_name() const override {
    return "nn::AdaptiveAvgPool2d<" + std::to_string(OutH) + ", " + std::to_string(OutW) + ">";
  }
};

}  // namespace nn
}  // namespace duet
// softmax and log_softmax along one axis (MindSpore's ops.softmax(x, axis=-1),
// ops.log_softmax, nn.Softmax(axis), nn.LogSoftmax(axis)), in both modes.
//
// The axis is a member of the operation, not a template argument as the reductions' axes are:
// the output has the input's shape whatever the axis, so graph mode needs it only when the
// kernel runs, and nn::Softmax(axis) takes it at run time as MindSpore's does. Its range is
// checked against the input's rank where the rule runs on concrete shapes (ShapeError).
//
// Numerically stable: each slice has its maximum m subtracted before exp, so the largest term
// is exp(0) = 1 and logits of 1000 give no inf or NaN; log_softmax is x - m - log Σ exp(x - m),
// never the log of a rounded-to-zero probability. Gradients come from the output y:
//   softmax:     dx = y · (dy - Σ dy·y)
//   log_softmax: dx = dy - exp(y) · Σ dy
// The kernels use the reductions' layout ([outer, axis, inner]): a contiguous slice per row
// when the axis is the last one (Eigen's vectorised exp and sums), otherwise a row of `inner`
// elements at a time along the axis, with the running maximum and sum in a per-thread scratch
// row that stops growing once it has the largest size seen (no allocation per call once warm).

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Core>


namespace duet {
namespace ops {

namespace detail {

// [outer, size, inner] around one axis of a concrete shape.
struct AxisLayout {
  index_t outer = 0;
  index_t size = 0;
  index_t inner = 0;
};

inline AxisLayout axis_layout(const Shape& s, int axis) {
  const int a = axis < 0 ? axis + s.rank() : axis;
  AxisLayout l{1, s[a], s.numel_from(a + 1)};
  for (int i = 0; i < a; ++i) l.outer *= s[i];
  return l;
}

template <class T>
T* scratch_row(index_t n) {
  thread_local std::vector<T> row;
  if (row.size() < static_cast<std::size_t>(n)) row.resize(static_cast<std::size_t>(n));
  return row.data();
}

template <class Self>
struct AxisMember {
  int axis = -1;

  ShapeResult infer(std::span<const Shape> in) const {
    const Shape& x = in[0];
    if (!x.leading_unknown() && (axis >= x.rank() || axis < -x.rank())) {
      return fault(x, ShapeFault::min_rank, axis < 0 ? -axis : axis + 1);
    }
    return {x};
  }
  std::string label() const { return Self::op_name() + "(axis=" + std::to_string(axis) + ")"; }
};

}  // namespace detail

template <bool Log>
struct SoftmaxGradOp;

template <bool Log>
struct SoftmaxOp : Primitive<SoftmaxOp<Log>>, detail::AxisMember<SoftmaxOp<Log>> {
  using detail::AxisMember<SoftmaxOp<Log>>::infer;
  using detail::AxisMember<SoftmaxOp<Log>>::label;
  static constexpr int arity = 1;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using detail::ArrayMap;
    using detail::ConstArrayMap;
    const auto l = detail::axis_layout(a.in_shape(), this->axis);
    const T* x = a.in<T>();
    T* y = a.out<T>();
    if (l.size == 0 || l.inner == 0) return;
    const index_t block = l.size * l.inner;
    if (l.inner == 1) {
      for (index_t o = 0; o < l.outer; ++o) {
        const ConstArrayMap<T> xs(x + o * block, l.size);
        ArrayMap<T> ys(y + o * block, l.size);
        const T m = xs.template maxCoeff<::Eigen::PropagateNaN>();
        ys = (xs - m).exp();
        const T s = ys.sum();
        if constexpr (Log) ys = xs - m - std::log(s);
        else ys /= s;
      }
      return;
    }
    T* scratch = detail::scratch_row<T>(2 * l.inner);
    ArrayMap<T> m(scratch, l.inner), s(scratch + l.inner, l.inner);
    for (index_t o = 0; o < l.outer; ++o) {
      const T* xb = x + o * block;
      T* yb = y + o * block;
      auto row = [&](index_t r) { return ConstArrayMap<T>(xb + r * l.inner, l.inner); };
      auto out = [&](index_t r) { return ArrayMap<T>(yb + r * l.inner, l.inner); };
      m = row(0);
      for (index_t r = 1; r < l.size; ++r) m = m.binaryExpr(row(r), ::Eigen::internal::scalar_max_op<T, T, ::Eigen::PropagateNaN>());
      s.setZero();
      for (index_t r = 0; r < l.size; ++r) {
        auto yr = out(r);
        yr = (row(r) - m).exp();
        s += yr;
      }
      if constexpr (Log) {
        s = m + s.log();
        for (index_t r = 0; r < l.size; ++r) out(r) = row(r) - s;
      } else {
        for (index_t r = 0; r < l.size; ++r) out(r) /= s;
      }
    }
  }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return SoftmaxGradOp<Log>{{}, {this->axis}};
  }

  static std::string op_name() { return Log ? "LogSoftmax" : "Softmax"; }
  // ONNX's (opset 13 on) takes one axis, as this does.
  Interchange interchange(std::span<const Shape>) const {
    return {{op_name(), {InterchangeInput::operand(0)}, {InterchangeAttribute::of("axis", this->axis)}}};
  }
};

template <bool Log>
struct SoftmaxGradOp : Primitive<SoftmaxGradOp<Log>>, detail::AxisMember<SoftmaxGradOp<Log>> {
  using detail::AxisMember<SoftmaxGradOp<Log>>::infer;
  using detail::AxisMember<SoftmaxGradOp<Log>>::label;
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::output};
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    using detail::ArrayMap;
    using detail::ConstArrayMap;
    const auto l = detail::axis_layout(a.in_shape(), this->axis);
    const T* dy = a.in<T>(0);
    const T* y = a.in<T>(1);
    T* dx = a.out<T>();
    if (l.size == 0 || l.inner == 0) return;
    const index_t block = l.size * l.inner;
    if (l.inner == 1) {
      for (index_t o = 0; o < l.outer; ++o) {
        const ConstArrayMap<T> g(dy + o * block, l.size), ys(y + o * block, l.size);
        ArrayMap<T> d(dx + o * block, l.size);
        if constexpr (Log) d = g - ys.exp() * g.sum();
        else d = ys * (g - (g * ys).sum());
      }
      return;
    }
    ArrayMap<T> s(detail::scratch_row<T>(l.inner), l.inner);
    for (index_t o = 0; o < l.outer; ++o) {
      auto g = [&](index_t r) { return ConstArrayMap<T>(dy + o * block + r * l.inner, l.inner); };
      auto ys = [&](index_t r) { return ConstArrayMap<T>(y + o * block + r * l.inner, l.inner); };
      auto d = [&](index_t r) { return ArrayMap<T>(dx + o * block + r * l.inner, l.inner); };
      s.setZero();
      for (index_t r = 0; r < l.size; ++r) {
        if constexpr (Log) s += g(r);
        else s += g(r) * ys(r);
      }
      for (index_t r = 0; r < l.size; ++r) {
        if constexpr (Log) d(r) = g(r) - ys(r).exp() * s;
        else d(r) = ys(r) * (g(r) - s);
      }
    }
  }

  static std::string op_name() { return Log ? "LogSoftmaxGrad" : "SoftmaxGrad"; }
};

inline const bool softmax_listed = list_operations({"softmax", "log_softmax"});

template <TensorLike X>
auto softmax(const X& x, int axis = -1) {
  return apply(SoftmaxOp<false>{{}, {axis}}, x);
}
template <TensorLike X>
auto log_softmax(const X& x, int axis = -1) {
  return apply(SoftmaxOp<true>{{}, {axis}}, x);
}

}  // namespace ops

namespace nn {

// MindSpore's nn.Softmax(axis=-1) and nn.LogSoftmax(axis=-1).
template <bool Log, ElementType T>
class BasicSoftmax : public Cell<BasicSoftmax<Log, T>, CONTEXT_MODE, T> {
 public:
  explicit BasicSoftmax(int axis = -1) : axis_(axis) {}
  template <class X>
  auto construct(X&& x) {
    if constexpr (Log) return ops::log_softmax(std::forward<X>(x), axis_);
    else return ops::softmax(std::forward<X>(x), axis_);
  }
  std::string type_name() const override { return Log ? "nn::LogSoftmax" : "nn::Softmax"; }

 private:
  int axis_;
};

using Softmax = BasicSoftmax<false, float>;
using LogSoftmax = BasicSoftmax<true, float>;

}  // namespace nn
}  // namespace duet
// Elementwise functions (MindSpore's ops.exp, log, sqrt, rsqrt, abs, square, clip_by_value),
// where, and the comparisons that build its condition, in both modes.
//
// The unary functions are fn:: types run by ops::MapOp (nn/activation.hpp), like the
// activations: chains of them fuse into one pass, and into the epilogue of the product before
// them, in graph mode. Each is differentiated from its output where the output gives the
// derivative (exp, sqrt, rsqrt), from its input otherwise (fn::grad_from_input: log, abs,
// square, clip_by_value); a product cannot take the latter as an epilogue in a graph being
// trained (passes.hpp's absorbs), so there they stay nodes of their own.
//
// Out of a function's domain the result is IEEE's, never an error, as in numpy and PyTorch:
// log(x < 0) and sqrt(x < 0) are NaN, log(0) is -inf, rsqrt(0) is inf, and NaN propagates
// through every function here (clip_by_value too).
//
// Comparisons make UInt8 tensors of 0 and 1 (duet has no bool), with numpy broadcasting
// between two tensors, or against a number. They have no gradient: their output carries none,
// so a gradient never flows back through them, and differentiating a function that uses one
// (to build a where's condition) is no error.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>


namespace duet {

namespace fn {

struct Exp {
  static constexpr std::string_view name = "Exp";
  template <class A>
  static auto array(const A& a) {
    return a.exp();
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    return dy * y;
  }
};

// log(x): NaN for x < 0, -inf at 0.
struct Log {
  static constexpr std::string_view name = "Log";
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.log();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    return dy / x;
  }
};

namespace detail {
// Eigen's vectorised sqrt under EIGEN_FAST_MATH (its default) refines the processor's
// reciprocal-root estimate once: not correctly rounded (sqrt(4) came out below 2), and not the
// same bits on Intel and AMD, whose estimates differ. IEEE's root is one instruction per lane;
// a scalar functor keeps it without naming any instruction set here.
struct RoundedSqrt {
  template <class T>
  T operator()(T v) const {
    return std::sqrt(v);
  }
};
}  // namespace detail

// sqrt(x): NaN for x < 0; its derivative 1 / (2 sqrt(x)) is inf at 0, as PyTorch's.
struct Sqrt {
  static constexpr std::string_view name = "Sqrt";
  template <class A>
  static auto array(const A& a) {
    return a.unaryExpr(detail::RoundedSqrt{});
  }
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy / (S(2) * y);
  }
};

// 1 / sqrt(x), as a division of the correctly rounded root: Eigen's rsqrt may take the
// processor's estimate, whose bits differ between a vector and a scalar and between vendors.
struct Rsqrt {
  static constexpr std::string_view name = "Rsqrt";
  template <class A>
  static auto array(const A& a) {
    return a.unaryExpr(detail::RoundedSqrt{}).inverse();
  }
  // d/dx x^(-1/2) = -y³ / 2.
  template <class G, class Y>
  static auto grad_array(const G& dy, const Y& y) {
    using S = typename Y::Scalar;
    return dy * (S(-0.5) * y.cube());
  }
};

// |x|; its derivative at 0 is taken as 0, as PyTorch's (sign(x) · dy).
struct Abs {
  static constexpr std::string_view name = "Abs";
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.abs();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    return dy * x.sign();
  }
};

struct Square {
  static constexpr std::string_view name = "Square";
  static constexpr bool grad_from_input = true;
  template <class A>
  static auto array(const A& a) {
    return a.square();
  }
  template <class G, class X>
  static auto grad_array(const G& dy, const X& x) {
    using S = typename X::Scalar;
    return dy * (S(2) * x);
  }
};

// min(max(x, lo), hi), so hi wherever lo > hi, as MindSpore's and PyTorch's; NaN stays NaN.
// The gradient passes where lo <= x <= hi (PyTorch's clamp: bounds included), from the input,
// since the output cannot tell a clipped value from one equal to a bound.
struct ClipByValue {
  static constexpr std::string_view name = "ClipByValue";
  static constexpr bool grad_from_input = true;
  double lo = 0;
  double hi = 0;
  template <class A>
  auto array(const A& a) const {
    using S = typename A::Scalar;
    return a
        .binaryExpr(A::Constant(a.rows(), a.cols(), static_cast<S>(lo)),
                    ::Eigen::internal::scalar_max_op<S, S, ::Eigen::PropagateNaN>())
        .binaryExpr(A::Constant(a.rows(), a.cols(), static_cast<S>(hi)),
                    ::Eigen::internal::scalar_min_op<S, S, ::Eigen::PropagateNaN>());
  }
  template <class G, class X>
  auto grad_array(const G& dy, const X& x) const {
    using S = typename X::Scalar;
    return (x >= static_cast<S>(lo) && x <= static_cast<S>(hi)).select(dy, G::Zero(dy.rows(), dy.cols()));
  }
};

// The comparisons: each names the one with its operands swapped (a number on the left).
struct Greater;
struct Less;
struct GreaterEqual;
struct LessEqual;
struct Greater {
  static constexpr std::string_view name = "Greater";
  using swapped = Less;
  template <class T>
  static bool apply(T a, T b) {
    return a > b;
  }
};
struct Less {
  static constexpr std::string_view name = "Less";
  using swapped = Greater;
  template <class T>
  static bool apply(T a, T b) {
    return a < b;
  }
};
struct GreaterEqual {
  static constexpr std::string_view name = "GreaterEqual";
  using swapped = LessEqual;
  template <class T>
  static bool apply(T a, T b) {
    return a >= b;
  }
};
struct LessEqual {
  static constexpr std::string_view name = "LessEqual";
  using swapped = GreaterEqual;
  template <class T>
  static bool apply(T a, T b) {
    return a <= b;
  }
};
struct Equal {
  static constexpr std::string_view name = "Equal";
  using swapped = Equal;
  template <class T>
  static bool apply(T a, T b) {
    return a == b;
  }
};
struct NotEqual {
  static constexpr std::string_view name = "NotEqual";
  using swapped = NotEqual;
  template <class T>
  static bool apply(T a, T b) {
    return a != b;
  }
};

}  // namespace fn

namespace ops {

// Fn(a, b) as 0 or 1, a and b of element type In broadcast together (numpy's rule).
template <class Fn, class In>
struct CompareOp : Primitive<CompareOp<Fn, In>> {
  using value_type = std::uint8_t;
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return broadcast_shapes(in[0], in[1]); }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* x = a.in<In>(0);
    const In* y = a.in<In>(1);
    T* out = a.out<T>();
    detail::for_each_broadcast(a.in_shape(0), a.in_shape(1), a.output_shape,
                               [&](index_t i, index_t ia, index_t ib) { out[i] = Fn::apply(x[ia], y[ib]); });
  }

  template <std::size_t K>
    requires(K < 2)
  NoGradient grad_op() const {
    return {};
  }

  static std::string op_name() { return std::string(Fn::name); }
};

// Fn(x, s) as 0 or 1, s a number the operation holds (converted to In, as the comparison
// would be made in In).
template <class Fn, class In>
struct CompareScalarOp : Primitive<CompareScalarOp<Fn, In>> {
  using value_type = std::uint8_t;
  static constexpr int arity = 1;
  double scalar;
  CompareScalarOp(double s) : scalar(s) {}

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[0]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const In* x = a.in<In>();
    T* out = a.out<T>();
    const In s = static_cast<In>(scalar);
    const index_t n = a.in_shape().numel();
    for (index_t i = 0; i < n; ++i) out[i] = Fn::apply(x[i], s);
  }

  template <std::size_t K>
    requires(K == 0)
  NoGradient grad_op() const {
    return {};
  }

  static std::string op_name() { return std::string(Fn::name) + "(x, scalar)"; }
};

namespace detail {

// Calls f(i, i0, i1, i2) for each element i of out, with the elements of three inputs of
// these shapes broadcast to it.
template <class F>
void for_each_broadcast3(const std::array<Shape, 3>& in, const Shape& out, F&& f) {
  const index_t n = out.numel();
  if (in[0] == out && in[1] == out && in[2] == out) {
    for (index_t i = 0; i < n; ++i) f(i, i, i, i);
    return;
  }
  const std::array strides{broadcast_strides(in[0], out), broadcast_strides(in[1], out),
                           broadcast_strides(in[2], out)};
  std::array<index_t, max_rank> index{};
  std::array<index_t, 3> at{};
  for (index_t i = 0; i < n; ++i) {
    f(i, at[0], at[1], at[2]);
    for (int axis = out.rank() - 1; axis >= 0; --axis) {
      const std::size_t ax = static_cast<std::size_t>(axis);
      ++index[ax];
      for (std::size_t k = 0; k < 3; ++k) at[k] += strides[k][ax];
      if (index[ax] < out[axis]) break;
      for (std::size_t k = 0; k < 3; ++k) at[k] -= strides[k][ax] * index[ax];
      index[ax] = 0;
    }
  }
}

}  // namespace detail

template <class T, int K>
struct WhereGradOp;

// cond ? a : b elementwise, the three broadcast together; cond is UInt8, true where not 0.
template <class T>
struct WhereOp : Primitive<WhereOp<T>> {
  using value_type = T;
  static constexpr int arity = 3;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) {
    // A broadcast fault names the culprit (input) and the input it does not broadcast with
    // (expected).
    const ShapeResult ab = broadcast_shapes(in[1], in[2]);
    if (!ab.ok()) return fault(ab.shape, ShapeFault::broadcast, ab.input == 0 ? 2 : 1, 1 + ab.input);
    const ShapeResult all = broadcast_shapes(in[0], ab.shape);
    if (!all.ok()) return fault(all.shape, ShapeFault::broadcast, in[1].rank() >= in[2].rank() ? 1 : 2, 0);
    return all;
  }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const std::uint8_t* c = a.in<std::uint8_t>(0);
    const T* x = a.in<T>(1);
    const T* y = a.in<T>(2);
    T* out = a.out<T>();
    detail::for_each_broadcast3({a.in_shape(0), a.in_shape(1), a.in_shape(2)}, a.output_shape,
                                [&](index_t i, index_t ic, index_t ia, index_t ib) { out[i] = c[ic] != 0 ? x[ia] : y[ib]; });
  }

  template <std::size_t K>
    requires(K < 3)
  auto grad_op() const {
    if constexpr (K == 0) return NoGradient{};
    else return WhereGradOp<T, static_cast<int>(K)>{};
  }

  static std::string op_name() { return "Select"; }
};

// d/d a (K = 1) or d/d b (K = 2) of where(cond, a, b): dy where the condition picks that
// input, 0 elsewhere, summed over the axes the input was broadcast along.
template <class T, int K>
struct WhereGradOp : Primitive<WhereGradOp<T, K>> {
  using value_type = T;
  // a and b are read for their shapes only.
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0, graph::Operand::input1,
                                    graph::Operand::input2};
  static constexpr int arity = 4;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1 + K]}; }

  template <class Backend, class U>
  void run(const graph::KernelArgs& a) const {
    const U* dy = a.in<U>(0);
    const std::uint8_t* c = a.in<std::uint8_t>(1);
    U* d = a.out<U>();
    const Shape& target = a.in_shape(1 + K);
    const Shape& out = a.in_shape(0);
    const bool picks = K == 1;
    const bool summed = !(target == out);
    if (summed) std::fill_n(d, target.numel(), U(0));
    detail::for_each_broadcast3({a.in_shape(1), a.in_shape(2), a.in_shape(3)}, out,
                                [&](index_t i, index_t ic, index_t ia, index_t ib) {
                                  const U g = (c[ic] != 0) == picks ? dy[i] : U(0);
                                  if (summed) d[K == 1 ? ia : ib] += g;
                                  else d[i] = g;
                                });
  }

  static std::string op_name() { return "SelectGrad" + std::to_string(K); }
};

inline const bool math_listed =
    list_operations({"exp", "log", "sqrt", "rsqrt", "abs", "square", "clip_by_value", "where", "greater", "less",
                     "equal", "greater_equal", "less_equal", "not_equal"});

template <class X>
  requires TensorLike<X>
auto exp(const X& x) {
  return apply(MapOp<fn::Exp>{}, x);
}
template <class X>
  requires TensorLike<X>
auto log(const X& x) {
  return apply(MapOp<fn::Log>{}, x);
}
template <class X>
  requires TensorLike<X>
auto sqrt(const X& x) {
  return apply(MapOp<fn::Sqrt>{}, x);
}
template <class X>
  requires TensorLike<X>
auto rsqrt(const X& x) {
  return apply(MapOp<fn::Rsqrt>{}, x);
}
template <class X>
  requires TensorLike<X>
auto abs(const X& x) {
  return apply(MapOp<fn::Abs>{}, x);
}
template <class X>
  requires TensorLike<X>
auto square(const X& x) {
  return apply(MapOp<fn::Square>{}, x);
}
// MindSpore's ops.clip_by_value(x, clip_value_min, clip_value_max), with number bounds.
template <class X>
  requires TensorLike<X>
auto clip_by_value(const X& x, double clip_value_min, double clip_value_max) {
  return apply(MapOp<fn::ClipByValue>{std::tuple{fn::ClipByValue{clip_value_min, clip_value_max}}}, x);
}

// Fn(a, b) as UInt8 0/1, between two tensors (broadcast) or a tensor and a number.
template <class Fn, class A, class B>
auto compare(const A& a, const B& b) {
  if constexpr (Scalar<A>) {
    return apply(CompareScalarOp<typename Fn::swapped, typename B::value_type>{static_cast<double>(a)}, b);
  } else if constexpr (Scalar<B>) {
    return apply(CompareScalarOp<Fn, typename A::value_type>{static_cast<double>(b)}, a);
  } else {
    static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                  "duet::ops: both operands of a comparison must have the same element type");
    return apply(CompareOp<Fn, typename A::value_type>{}, a, b);
  }
}

#define DUET_DETAIL_COMPARISON(function, Fn)                                                             \
  template <class A, class B>                                                                          \
    requires((TensorLike<A> || Scalar<A>) && (TensorLike<B> || Scalar<B>) && (TensorLike<A> || TensorLike<B>)) \
  auto function(const A& a, const B& b) {                                                              \
    return compare<fn::Fn>(a, b);                                                                      \
  }
DUET_DETAIL_COMPARISON(greater, Greater)
DUET_DETAIL_COMPARISON(less, Less)
DUET_DETAIL_COMPARISON(greater_equal, GreaterEqual)
DUET_DETAIL_COMPARISON(less_equal, LessEqual)
DUET_DETAIL_COMPARISON(equal, Equal)
DUET_DETAIL_COMPARISON(not_equal, NotEqual)
#undef DUET_DETAIL_COMPARISON

// MindSpore's ops.where(condition, x, y): x where condition is not 0, y elsewhere, the three
// broadcast together. The condition gets no gradient; x and y get dy where each is chosen.
template <class C, class A, class B>
  requires(TensorLike<C> && TensorLike<A> && TensorLike<B>)
auto where(const C& condition, const A& x, const B& y) {
  static_assert(std::is_same_v<typename C::value_type, std::uint8_t>,
                "duet::ops::where: the condition is a UInt8 tensor, as the comparisons (ops::greater, ...) make");
  static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                "duet::ops::where: x and y must have the same element type");
  return apply(WhereOp<typename A::value_type>{}, condition, x, y);
}

}  // namespace ops
}  // namespace duet
// duet::summary: a network's cells with their output shapes and parameter counts, and the
// totals (Keras's model.summary(), torchinfo's summary).
//
// It runs the network once, eagerly, on zeros of the given shape, as torchinfo runs a forward
// pass: every cell, whatever its mode (a graph-mode or jit cell, a runtime-built network that
// graph mode would trace), then runs as in PyNative mode and reports each call, which is how
// each cell's output shape is known. The run changes no parameter and no mode, makes no graph
// or trace of the network, and draws no random number; forward hooks run, as in any eager call.
// A duet::jit function the network calls runs compiled, as in any call: the cells it calls are
// not seen ("--").

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdio>
#include <iostream>
#include <ostream>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>


namespace duet {

struct SummaryRow {
  std::string name = {};  // the path from the network ("dense_relu_sequential.0"); "" for the network
  std::string type_name = {};  // "nn::Dense<784, 512>"
  int depth = 0;          // 0 for the network, 1 for its members, ...
  std::vector<Shape> output_shapes = {};  // one per call during the summary's run, in order
  index_t parameters = 0;            // elements of the parameters the cell holds itself
  bool has_children = false;
};

struct Summary {
  std::string network = {};  // the network's type name
  Shape input_shape = {};
  std::vector<SummaryRow> rows = {};  // every cell, depth first (cells_and_names order)
  index_t total_parameters = 0;  // each parameter counted once, even if held twice
  index_t trainable_parameters = 0;
  std::size_t parameter_bytes = 0;

  // The table operator<< prints.
  std::string text() const;
};

namespace detail {

// 669706 -> "669,706".
inline std::string with_thousands(std::size_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

inline std::string output_column(const SummaryRow& row) {
  if (row.output_shapes.empty()) return "--";
  bool all_same = true;
  for (const Shape& s : row.output_shapes) all_same = all_same && s == row.output_shapes.front();
  if (all_same) {
    const std::string one = to_string(row.output_shapes.front());
    const std::size_t calls = row.output_shapes.size();
    return calls == 1 ? one : one + " (" + std::to_string(calls) + " calls)";
  }
  std::string shapes;
  for (const Shape& s : row.output_shapes) shapes += (shapes.empty() ? "" : ", ") + to_string(s);
  return shapes;
}

// A cell made only of others holds no parameters of its own: "--", as torchinfo prints, so
// that the column adds up to the total.
inline std::string parameter_column(const SummaryRow& row) {
  return row.parameters == 0 && row.has_children ? "--" : with_thousands(static_cast<std::size_t>(row.parameters));
}

inline std::string layer_column(const SummaryRow& row) {
  const std::string indent(static_cast<std::size_t>(2 * row.depth), ' ');
  return indent + (row.name.empty() ? row.type_name : row.name + " (" + row.type_name + ")");
}

// Sets the thread's call observer for its lifetime (exceptions included).
template <ElementType T>
class ObservedRun {
 public:
  explicit ObservedRun(const nn::BasicForwardHook<T>& observer)
      : outer_(std::exchange(nn::detail::call_observer<T>, &observer)) {}
  ObservedRun(const ObservedRun&) = delete;
  ObservedRun& operator=(const ObservedRun&) = delete;
  ~ObservedRun() { nn::detail::call_observer<T> = outer_; }

 private:
  const nn::BasicForwardHook<T>* outer_;
};

}  // namespace detail

inline std::string Summary::text() const {
  const std::string headers[3] = {"Layer (type)", "Output Shape", "Param #"};
  std::size_t widths[3] = {headers[0].size(), headers[1].size(), headers[2].size()};
  std::vector<std::array<std::string, 3>> cells;
  for (const SummaryRow& row : rows) {
    cells.push_back({detail::layer_column(row), detail::output_column(row), detail::parameter_column(row)});
    for (std::size_t c = 0; c < 3; ++c) widths[c] = std::max(widths[c], cells.back()[c].size());
  }
  const auto line = [&](const std::string& layer, const std::string& output, const std::string& params) {
    return layer + std::string(widths[0] - layer.size() + 3, ' ') + output +
           std::string(widths[1] - output.size() + 3 + widths[2] - params.size(), ' ') + params + "\n";
  };
  const std::string rule(widths[0] + widths[1] + widths[2] + 6, '=');
  std::string out = "Summary of " + network + " for an input of " + to_string(input_shape) + "\n";
  out += rule + "\n" + line(headers[0], headers[1], headers[2]) + rule + "\n";
  for (const auto& c : cells) out += line(c[0], c[1], c[2]);
  out += rule + "\n";
  out += "Total params: " + detail::with_thousands(static_cast<std::size_t>(total_parameters)) + "\n";
  out += "Trainable params: " + detail::with_thousands(static_cast<std::size_t>(trainable_parameters)) + "\n";
  out += "Non-trainable params: " +
         detail::with_thousands(static_cast<std::size_t>(total_parameters - trainable_parameters)) + "\n";
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f", static_cast<double>(parameter_bytes) / (1024.0 * 1024.0));
  out += "Params size: " + detail::with_thousands(parameter_bytes) + " bytes (" + mib + " MiB)\n";
  return out;
}

inline std::ostream& operator<<(std::ostream& os, const Summary& s) { return os << s.text(); }

// Prints the summary of `net` for an input of `input_shape` (every dimension known: the batch
// too) to `out`, and returns it. A shape a layer cannot take is the layer's ShapeError, with
// the summary's call in front.
template <ElementType T>
Summary summary(nn::BasicDynamicCell<T>& net, const Shape& input_shape, std::ostream& out = std::cout) {
  const std::string where = "duet::summary(" + net.type_name() + ", input " + to_string(input_shape) + ")";
  if (!input_shape.is_concrete()) {
    throw ValueError(where + ": every dimension of the input shape must be known, the batch size too");
  }
  Summary result{.network = net.type_name(), .input_shape = input_shape};
  std::unordered_map<const nn::BasicDynamicCell<T>*, std::size_t> row_of;
  std::unordered_map<const nn::BasicDynamicCell<T>*, int> depth_of;
  std::set<const nn::BasicParameter<T>*> counted;
  // cells_and_names lists a parent before its children, so each cell's depth is known when it comes.
  for (auto& [name, cell] : net.cells_and_names()) {
    SummaryRow row{.name = name, .type_name = cell->type_name(), .depth = depth_of[cell]};
    cell->for_each_own_parameter([&](std::string_view, nn::BasicParameter<T>& p) {
      row.parameters += p.numel();
      if (!counted.insert(&p).second) return;
      result.total_parameters += p.numel();
      if (p.requires_grad) result.trainable_parameters += p.numel();
      result.parameter_bytes += static_cast<std::size_t>(p.numel()) * sizeof(T);
    });
    cell->for_each_child([&](std::string_view, nn::BasicDynamicCell<T>& child) {
      row.has_children = true;
      depth_of[&child] = row.depth + 1;
    });
    row_of[cell] = result.rows.size();
    result.rows.push_back(std::move(row));
  }
  const nn::BasicForwardHook<T> observer = [&](const nn::BasicDynamicCell<T>& cell, const BasicTensor<T>&,
                                               const BasicTensor<T>& output) {
    if (const auto it = row_of.find(&cell); it != row_of.end()) result.rows[it->second].output_shapes.push_back(output.shape());
  };
  {
    const detail::ObservedRun<T> observed(observer);
    try {
      static_cast<void>(net(BasicTensor<T>(input_shape)));
    } catch (const ShapeError& e) {
      throw ShapeError(where + ": " + e.what());
    }
  }
  out << result;
  return result;
}

}  // namespace duet
// Training helpers: evaluation of a classifier over a data set, and a terminal progress bar.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <concepts>
#include <ostream>
#include <ranges>
#include <string>
#include <utility>
#include <vector>


namespace duet::train {

struct Metrics {
  double loss = 0;      // mean over samples
  double accuracy = 0;  // top-1, in [0, 1]
  index_t samples = 0;  // those counted: not those whose label is the loss's ignore_index
};

// How many rows of logits [B, C] have their largest value at the row's label; rows labelled
// `ignored` do not count.
template <ElementType T>
index_t correct_predictions(const BasicTensor<T>& logits, const BasicTensor<std::int32_t>& labels,
                            std::optional<std::int32_t> ignored = std::nullopt) {
  const index_t rows = logits.dim(0);
  const index_t classes = logits.dim(1);
  index_t correct = 0;
  for (index_t r = 0; r < rows; ++r) {
    if (labels.data()[r] == ignored) continue;
    const T* row = logits.data() + r * classes;
    index_t best = 0;
    for (index_t c = 1; c < classes; ++c) {
      if (row[c] > row[best]) best = c;
    }
    correct += best == labels.data()[r] ? 1 : 0;
  }
  return correct;
}

namespace detail {
// Sets a network to evaluation (set_train(false)) for its life, then gives every cell in it
// back its own setting, even when the evaluation throws.
template <class Net>
class EvaluationScope {
 public:
  explicit EvaluationScope(Net& net) {
    for (auto& [path, cell] : net.cells_and_names()) saved_.emplace_back(cell, cell->phase_setting());
    net.set_train(false);
  }
  EvaluationScope(const EvaluationScope&) = delete;
  EvaluationScope& operator=(const EvaluationScope&) = delete;
  ~EvaluationScope() {
    for (auto& [cell, setting] : saved_) cell->restore_phase_setting(setting);
  }

 private:
  using DynamicCell = nn::BasicDynamicCell<typename Net::value_type>;
  std::vector<std::pair<DynamicCell*, typename DynamicCell::PhaseSetting>> saved_;
};
}  // namespace detail

// What evaluate reads: a range of batches (a range-for over it runs one pass), each with
// `images`, what the network takes (any shape, channel count or element type), and `labels`,
// the class indices [B] as BasicTensor<std::int32_t>. data::DataLoader is one; so is a
// std::vector of such structs.
template <class L>
concept ClassificationLoader = std::ranges::input_range<L> && requires(std::ranges::range_reference_t<L> batch) {
  batch.images;
  { batch.labels } -> std::convertible_to<const BasicTensor<std::int32_t>&>;
};

// One pass over the loader (a DataLoader's current epoch, or a temporary range): mean loss per
// sample and accuracy of net. loss_fn reduces by mean (each batch weighs the rows it counted)
// or sum; rows whose label is its ignore_index (nn::CrossEntropyLoss, nn::NLLLoss) count in
// neither, as they do not in training. A loader with no sample is an error. A cell runs in evaluation meanwhile
// (MindSpore's Model.eval sets set_train(False)): Dropout passes its input through, BatchNorm
// uses its moving statistics and leaves them as they are; each cell's setting is restored after.
// A sharded loader's metrics are summed over the ranks (duet/distributed.hpp), so that every
// rank returns the whole data set's; ranks whose networks differ are refused.
template <class Net, class Loss, class Loader>
  requires ClassificationLoader<Loader>
Metrics evaluate(Net& net, Loss& loss_fn, Loader&& loader) {
  duet::detail::DataParallelRuntime* runtime = nullptr;
  if constexpr (requires { loader.options().num_shards; }) {
    if (loader.options().num_shards > 1) {
      runtime = duet::detail::data_parallel_runtime().load(std::memory_order_acquire);
      if (runtime == nullptr) {
        throw ModeError("duet::train::evaluate: the loader is shard " + std::to_string(loader.options().shard_id) +
                        " of " + std::to_string(loader.options().num_shards) +
                        ", but no rank group exists to sum the shards' metrics; call duet::distributed::init()");
      }
      // Metrics summed over ranks whose networks differ describe no network, and look like a result.
      if (const auto where = duet::detail::first_difference_between_ranks(*runtime, net.parameters())) {
        throw ModeError("duet::train::evaluate: the ranks' networks differ (" + *where +
                        " first), so the sum of their metrics would describe no network. Ranks agree from "
                        "nn::TrainOneStepCell's first step (which gives every rank rank 0's parameters) when every "
                        "step reduces the gradients over the ranks (set_auto_parallel_context(DATA_PARALLEL), or "
                        "distributed::GradReducer in a loop of your own); before that step, build the network "
                        "with the same seed on every rank");
      }
    }
  }
  const detail::EvaluationScope<Net> evaluation(net);
  Metrics m;
  double loss_sum = 0;
  index_t correct = 0;
  for (const auto& batch : loader) {
    const auto output = net(batch.images);
    const auto& logits = tensor_of(output);
    const BasicTensor<std::int32_t>& labels = batch.labels;
    const duet::detail::BatchShare share =
        duet::detail::batch_share(loss_fn, labels, labels.numel(), "duet::train::evaluate");
    const auto loss = static_cast<double>(loss_fn(logits, labels).item());
    loss_sum += share.summed ? loss : loss * share.counted_rows;
    correct += correct_predictions(logits, labels, duet::detail::ignored_label(loss_fn));
    m.samples += static_cast<index_t>(share.counted_rows);
  }
  if (runtime != nullptr) {
    double sums[] = {loss_sum, static_cast<double>(correct), static_cast<double>(m.samples)};
    runtime->all_reduce_sum(sums);
    loss_sum = sums[0];
    correct = static_cast<index_t>(sums[1]);
    m.samples = static_cast<index_t>(sums[2]);
  }
  // Loss 0 and accuracy 0 would read as a result.
  if (m.samples == 0) {
    throw ValueError("duet::train::evaluate: the loader gave no sample to evaluate (an empty data set or epoch, or "
                     "every label is the loss's ignore_index)");
  }
  m.loss = loss_sum / static_cast<double>(m.samples);
  m.accuracy = static_cast<double>(correct) / static_cast<double>(m.samples);
  return m;
}

// Anything else: one error that says what a loader is, rather than a failed constraint.
template <class Net, class Loss, class Loader>
Metrics evaluate(Net&, Loss&, Loader&&) {
  static_assert(ClassificationLoader<Loader>,
                "duet::train::evaluate: the loader must be a range of batches with .images (the network's input) "
                "and .labels (BasicTensor<std::int32_t>), see duet::train::ClassificationLoader");
  return {};
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
