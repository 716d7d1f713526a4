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
// matmul()), except the forward and the weight's gradient of layers of few input channels,
// which the direct convolution below computes from a padded copy of each sample. The GEMM runs
// per instruction set: gemm when both operands have the sum's index
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
#pragma once

#include <algorithm>
#include <cstring>

#include <Eigen/Core>

#include "../shape.hpp"
#include "simd/arch.hpp"
#include "simd/dispatch.hpp"
#include "simd/isa.hpp"

// The direct convolution once per instruction set, each in its namespace and target region.
#define DUET_KERNEL_BODY "conv_impl.hpp"
#include "detail/per_isa.hpp"

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

// ---- Direct convolution --------------------------------------------------------------------
//
// Layers of few input channels at stride 1 (LeNet-5's first, 1 -> 6, 5x5): their patches are
// depth = in · kh · kw rows of every output pixel, the image copied kh · kw times, and the
// products on them are short (6 rows of 25 for LeNet's conv1), so im2col, the GEMM's packing
// and its narrow tiles cost more than the multiply-adds. Here each sample is copied once into
// zero-padded planes (direct_padded) and the forward and the weight's gradient read it in
// place, vectors along output rows (detail/conv_impl.hpp). The data gradient keeps the
// products (a first layer has none to take).
inline bool direct_convolution(const ConvProblem& q) {
  return q.groups == 1 && q.stride_h == 1 && q.stride_w == 1 && q.dilation_h == 1 && q.dilation_w == 1 &&
         q.in <= 2;
}

// The padded copy of one sample: in planes of `rows` rows, `pitch` elements apart, wide enough
// for two whole vectors of the widest set past any output's taps.
struct DirectLayout {
  index_t pitch = 0;
  index_t rows = 0;
  constexpr index_t plane() const { return pitch * rows; }
};

template <class T>
DirectLayout direct_layout(const ConvProblem& q) {
  constexpr index_t widest = 64 / sizeof(T);
  return {(q.out_width + 2 * widest - 1) / (2 * widest) * (2 * widest) + q.kernel_w - 1, q.out_height + q.kernel_h - 1};
}

// Elements of direct_weight_gradient's partial sums: a vector of the widest set per weight.
template <class T>
index_t direct_partial_size(const ConvProblem& q) {
  return q.out * q.depth() * (64 / static_cast<index_t>(sizeof(T)));
}

// xp = one sample's x ([in, H, W]) in direct_layout's planes, zero around it.
template <class T>
void direct_padded(const ConvProblem& q, const T* x, T* xp) {
  const DirectLayout l = direct_layout<T>(q);
  std::fill_n(xp, q.in * l.plane(), T(0));
  const index_t width = std::min(q.width, l.pitch - q.pad_left);
  for (index_t c = 0; c < q.in; ++c) {
    for (index_t h = 0; h < q.height && q.pad_top + h < l.rows; ++h) {
      std::copy_n(x + (c * q.height + h) * q.width, width, xp + c * l.plane() + (q.pad_top + h) * l.pitch + q.pad_left);
    }
  }
}

// y = conv(x, w) for one sample ([out, OH, OW]) from its padded copy: each output's taps in
// (c, a, b) order from zero, one multiply-add each (fused where the set has FMA).
template <class T>
void direct_convolve(Isa isa, const ConvProblem& q, const T* xp, const T* w, T* y) {
  const DirectLayout l = direct_layout<T>(q);
  detail::with_target(isa, [&](auto target) {
    direct_conv_step(target, xp, l.pitch, l.plane(), w, q.in, q.out, q.kernel_h, q.kernel_w, q.out_height, q.out_width, y);
  });
}

// One sample's part of the weight's gradient, added into partial (direct_partial_size
// elements, zero before the first sample): per weight a vector of sums, lane i over the output
// columns i, i + L, ... The lanes are added in order by direct_weight_sums once all the
// samples are in, under the same isa.
template <class T>
void direct_weight_gradient(Isa isa, const ConvProblem& q, const T* xp, const T* dy, T* partial) {
  const DirectLayout l = direct_layout<T>(q);
  detail::with_target(isa, [&](auto target) {
    direct_weight_step(target, xp, l.pitch, l.plane(), dy, q.in, q.out, q.kernel_h, q.kernel_w, q.out_height,
                       q.out_width, partial);
  });
}

template <class T>
void direct_weight_sums(Isa isa, const ConvProblem& q, const T* partial, T* dw, bool accumulate) {
  detail::with_target(isa, [&](auto target) { direct_weight_sums_step(target, partial, q.out * q.depth(), dw, accumulate); });
}

// y[c, p] += bias[c] for the `channels` planes of `pixels` values of one sample, plane by
// plane: Eigen's colwise() on the row-major planes went down the columns, a stride of a plane
// per element (a third of LeNet-5's first convolution's time).
template <class T>
void add_channel_bias(T* y, index_t channels, index_t pixels, const T* bias) {
  using Plane = ::Eigen::Array<T, ::Eigen::Dynamic, 1>;
  for (index_t c = 0; c < channels; ++c) ::Eigen::Map<Plane>(y + c * pixels, pixels) += bias[c];
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
