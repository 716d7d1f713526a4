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
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include "config.hpp"
#include "error.hpp"

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

// What a pass over memory costs per element in this unit of work: moving an element in and out
// of L2 takes about as long as 8 FMAs, so a pass over a [256, 512] activation shares the threads
// (one fewer pass on the caller's thread between a training step's products) and one over a
// batch-1 layer stays on the caller's.
inline constexpr index_t pass_work = 8;

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
