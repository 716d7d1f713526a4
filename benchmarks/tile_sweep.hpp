// duet's own tile (kernels/detail/gemm_impl.hpp: tile<float, NV, MR>, the blocked product's
// micro-kernel) on data that stays in one level of the cache, for gemm/tile/* (gemm.cpp): what
// the product could reach without packing, edges or cache misses. No include guard: gemm.cpp
// includes it once per instruction set, inside the set's namespace and target region, as
// fma_chains.hpp.

inline constexpr int sweep_rows = MR;
inline constexpr int sweep_columns = NV * lanes<float>;

// `tiles` tiles down a K block of `depth`: A's rows packed (depth apart), B one panel [depth,
// sweep_columns], C's tiles reloaded, added to and stored as every K block after the first does.
inline void tile_sweep(duet::index_t depth, const float* a, int tiles, const float* b, float* c) {
  for (int t = 0; t < tiles; ++t) {
    tile<float, NV, MR>(depth, false, nullptr, a + t * MR * depth, depth, MR, b, sweep_columns, sweep_columns,
                        c + t * MR * sweep_columns, sweep_columns, false, false, nullptr);
  }
}
