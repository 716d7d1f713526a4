// The order of a sum over a batch's rows that does not change when the batch is split in two.
//
// Data parallelism sums a batch's gradient in parts: each of 2 ranks sums its half of the rows,
// and the halves are added. A sum that runs down all the rows in one chain rounds otherwise,
// so one process and 2 ranks part at the first step, and training carries the difference on
// (6e-5 in the seed network's loss after an epoch). Summed in halves, each the same way down
// to leaves of at most halves_leaf rows, a batch's sum is its halves' sum in any process:
// sum[0, n) = sum[0, ⌈n/2⌉) + sum[⌈n/2⌉, n). Data loaders give shard k of a global batch its
// k-th contiguous part, the first parts a row longer where it does not divide, so that 2 ranks
// hold exactly these halves. Sums over 2^j equal shards agree too when the ranks add theirs
// pairwise; MPI chooses its own order beyond 2.
//
// The partial sums are added as the leaves end, left part first, so a sum keeps one partial
// for every level of the tree above it. Leaves of 16 rows let Fashion-MNIST's last batch of 32
// split too; for the GEMM's tile, whose 24 accumulators are then stored, reloaded and added
// once every 16 rows or so, that cost the seed network's weight gradients 5-8 % against one
// chain (benchmarks/gemm.cpp, gemm/weight_gradient/native against native_chain: 225 / 214 us
// for 784 x 512 at batch 64, 890 / 829 us at 256; AMD EPYC Zen 5, AVX-512) and its training
// step about 2 % (perf: the product's tile from 31.3 to 32.9 % of an epoch's samples).
#pragma once

#include "../../config.hpp"

namespace duet::kernels::detail {

inline constexpr index_t halves_leaf = 16;
// Levels of the tree for 2^40 · 16 rows: more than any batch.
inline constexpr int halves_levels = 40;

// The leaves of [0, n), left to right: [begin, end) each, and how many partial sums before it
// complete with it (the leaf, then its parent, ... while each is its parent's right part).
// Halving stops at halves_leaf rows, or at once when halves is false (one leaf, one chain).
class HalvesLeaves {
 public:
  HalvesLeaves(index_t n, bool halves) : leaf_(halves ? halves_leaf : n) { push(0, n, 0); }

  bool next(index_t& begin, index_t& end, int& merges) {
    if (top_ == 0) return false;
    Part part = pending_[--top_];
    while (part.end - part.begin > leaf_) {
      const index_t mid = part.begin + (part.end - part.begin + 1) / 2;
      push(mid, part.end, part.rights + 1);
      part = {part.begin, mid, 0};
    }
    begin = part.begin;
    end = part.end;
    merges = part.rights;
    return true;
  }

 private:
  struct Part {
    index_t begin;
    index_t end;
    int rights;  // how many right parts in a row end here, counting up the tree
  };
  void push(index_t begin, index_t end, int rights) { pending_[top_++] = {begin, end, rights}; }

  index_t leaf_;
  Part pending_[halves_levels + 1];
  int top_ = 0;
};

// How many partial sums a sum over n rows in halves keeps at most: the levels above its leaves.
inline int halves_depth(index_t n) {
  int levels = 0;
  for (; n > halves_leaf; n = (n + 1) / 2) ++levels;
  return levels;
}

}  // namespace duet::kernels::detail
