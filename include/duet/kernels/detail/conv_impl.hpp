// One instruction set's direct convolution (kernels/conv.hpp describes when it runs), written
// on the set's Vec<T>, lanes<T>, load, store, load_first, store_first, fma (simd/arch.hpp) and
// splat (simd/detail/math.hpp).
// No include guard and no includes: conv.hpp includes it once per set, inside that set's
// namespace and target region.
//
// Both loops read the sample's input from a padded copy (direct_padded in conv.hpp): planes of
// `rows` rows `pitch` apart, zero around the image and far enough past each row's last output
// for whole vectors, so no load needs a bound.

// y[o, p] = Σ_(c, a, b) w[o, c, a, b] · xp[c, oh + a, ow + b] for `valid` (at most R) output
// channels of one sample, p = oh · cols + ow: each output's taps in (c, a, b) order, one FMA
// each, from zero. A tile is R channels by two vectors of an output row: 12 accumulators, a
// row's two vectors and the weight's broadcast fit the 16 registers of every set. Past the
// last channel the tile repeats it, computed but not stored, so one instantiation serves any
// channel count. The loops over the tile have fixed trip counts and are unrolled by pragma, so
// that every index of acc is a constant and acc stays in registers (gemm_impl.hpp's tile_step
// says why: rolled, GCC kept acc in memory, a load and a store in each FMA's chain; here at
// half the speed).
inline constexpr int direct_tile_channels = 6;

template <class T>
[[gnu::noinline]] void direct_tile_rows(const T* xp, index_t pitch, index_t plane, const T* w, int valid, index_t in,
                                        index_t kh, index_t kw, index_t rows, index_t cols, T* y) {
  constexpr int L = lanes<T>;
  constexpr int R = direct_tile_channels;
  const index_t depth = in * kh * kw;
  const index_t pixels = rows * cols;
  const T* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min(r, valid - 1) * depth;
  for (index_t oh = 0; oh < rows; ++oh) {
    for (index_t ow = 0; ow < cols; ow += 2 * L) {
      Vec<T> acc[R][2] = {};
      for (index_t c = 0; c < in; ++c) {
        for (index_t a = 0; a < kh; ++a) {
          const T* x = xp + c * plane + (oh + a) * pitch + ow;
          const index_t tap = (c * kh + a) * kw;
          for (index_t b = 0; b < kw; ++b) {
            const Vec<T> x0 = load(x + b);
            const Vec<T> x1 = load(x + b + L);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const Vec<T> weight = splat<T>(wr[r][tap + b]);
              acc[r][0] = fma<T>(weight, x0, acc[r][0]);
              acc[r][1] = fma<T>(weight, x1, acc[r][1]);
            }
          }
        }
      }
      const index_t first = std::min<index_t>(L, cols - ow);
      const index_t second = std::min<index_t>(L, cols - ow - first);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (r >= valid) continue;
        T* out = y + r * pixels + oh * cols + ow;
        if (first == L) store<T>(out, acc[r][0]);
        else store_first<T>(out, acc[r][0], static_cast<int>(first));
        if (second == L) store<T>(out + L, acc[r][1]);
        else if (second > 0) store_first<T>(out + L, acc[r][1], static_cast<int>(second));
      }
    }
  }
}

template <class T>
void direct_conv_step(Target, const T* xp, index_t pitch, index_t plane, const T* w, index_t in, index_t out,
                      index_t kh, index_t kw, index_t rows, index_t cols, T* y) {
  constexpr int R = direct_tile_channels;
  const index_t depth = in * kh * kw;
  for (index_t o = 0; o < out; o += R) {
    direct_tile_rows(xp, pitch, plane, w + o * depth, static_cast<int>(std::min<index_t>(R, out - o)), in, kh, kw, rows,
                     cols, y + o * rows * cols);
  }
}

// partial[(o · depth + t) · L + lane] += Σ dy[o, oh, ow] · xp[c, oh + a, ow + b] for tap
// t = (c, a, b), over the pixels of one sample whose ow is lane mod L: the weight gradient's
// sums, a vector per weight, which direct_weight_sums_step folds once every sample is in. A
// tile is two output channels (the second repeating the first past the last channel, not
// stored) by four taps of a kernel row: 8 accumulators. dy's lanes past a row's end load as
// zero, so the padded copy's values there add nothing. Unrolled by pragma as the forward is.
template <class T>
[[gnu::noinline]] void direct_weight_tile(const T* xp, index_t pitch, index_t plane, const T* dy, int valid, index_t in,
                                          index_t kh, index_t kw, index_t rows, index_t cols, T* partial) {
  constexpr int L = lanes<T>;
  constexpr int R = 2;
  constexpr int B = 4;
  const index_t depth = in * kh * kw;
  const index_t pixels = rows * cols;
  const T* dr[R];
  for (int r = 0; r < R; ++r) dr[r] = dy + std::min(r, valid - 1) * pixels;
  for (index_t c = 0; c < in; ++c) {
    for (index_t a = 0; a < kh; ++a) {
      for (index_t b0 = 0; b0 < kw; b0 += B) {
        const index_t count = std::min<index_t>(B, kw - b0);
        const index_t tap = (c * kh + a) * kw + b0;
        Vec<T> acc[R][B];
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
          for (int j = 0; j < B; ++j) {
            acc[r][j] = r < valid && j < count ? load(partial + (r * depth + tap + j) * L) : Vec<T>{};
          }
        }
        for (index_t oh = 0; oh < rows; ++oh) {
          const T* x = xp + c * plane + (oh + a) * pitch + b0;
          for (index_t ow = 0; ow < cols; ow += L) {
            const index_t n = std::min<index_t>(L, cols - ow);
            Vec<T> d[R];
#pragma GCC unroll 2
            for (int r = 0; r < R; ++r) {
              const T* from = dr[r] + oh * cols + ow;
              d[r] = n == L ? load(from) : load_first(from, static_cast<int>(n));
            }
#pragma GCC unroll 4
            for (int j = 0; j < B; ++j) {
              if (j < count) {
                const Vec<T> xv = load(x + ow + j);
#pragma GCC unroll 2
                for (int r = 0; r < R; ++r) acc[r][j] = fma<T>(d[r], xv, acc[r][j]);
              }
            }
          }
        }
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
          for (int j = 0; j < B; ++j) {
            if (r < valid && j < count) store<T>(partial + (r * depth + tap + j) * L, acc[r][j]);
          }
        }
      }
    }
  }
}

template <class T>
void direct_weight_step(Target, const T* xp, index_t pitch, index_t plane, const T* dy, index_t in, index_t out,
                        index_t kh, index_t kw, index_t rows, index_t cols, T* partial) {
  const index_t depth = in * kh * kw;
  for (index_t o = 0; o < out; o += 2) {
    direct_weight_tile(xp, pitch, plane, dy + o * rows * cols, static_cast<int>(std::min<index_t>(2, out - o)), in, kh, kw,
                       rows, cols, partial + o * depth * lanes<T>);
  }
}

// dw[i] (+)= the sum of the lanes of partial's vector i, lane by lane in order, for `count` weights.
template <class T>
void direct_weight_sums_step(Target, const T* partial, index_t count, T* dw, bool accumulate) {
  constexpr int L = lanes<T>;
  for (index_t i = 0; i < count; ++i) {
    T s = partial[i * L];
    for (int lane = 1; lane < L; ++lane) s += partial[i * L + lane];
    dw[i] = accumulate ? dw[i] + s : s;
  }
}
