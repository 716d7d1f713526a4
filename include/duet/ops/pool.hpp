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
// A window known only at run time (a network built at run time, an ONNX model's, PyTorch's
// F.max_pool2d(x, kernel_size, stride, padding)) is an argument instead, one operation for every
// window (Pool2dListOp), its output's shape known when it runs and a bad window a ValueError:
//   ops::max_pool2d(x, kernel, stride = kernel, padding = 0)
//   ops::avg_pool2d(x, kernel, stride = 1, padding = 0, count_include_pad = true)
//   ops::max_pool2d(x, Pool2dWindow{...}), ops::avg_pool2d(x, Pool2dWindow{...})   (any window)
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
// Max pooling never reads padding (PyTorch's -inf padding). The template forms take square
// kernels and strides, a Pool2dWindow any; no dilation, ceil_mode or divisor_override; inputs
// of rank 4 only (PyTorch also takes CHW).
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
// (the window's stride, a compile-time constant for the template forms), no branch, no call,
// which the compiler vectorises (max as compare-and-select), under GCC's -O2 too by
// DUET_BEGIN_VECTORIZED (kernels/simd/arch.hpp): without it, max pooling 3x3/2 pad 1 on
// [32, 64, 28, 28] took 11.9 ms at -O2 against 2.8 at -O3, its gradient 26.0 against 17.1,
// the average 3x3/2 2.3 against 1.3 (Intel Xeon, one thread, no -march; now the -O3 figures at
// -O2). The few border columns whose windows meet the padding run the same order on the
// clipped window, one element at a time. Measured against
// one output at a time in the same order (g++ -O3, medians, 2026-11-30, a shared 2-core
// machine): max pooling's forward is 2.4 to 7 times faster this way (2x2/2 on [64, 6, 28, 28]
// and [64, 16, 10, 10], 3x3/2 pad 1 on [32, 64, 28, 28], 3x3/1 same on [32, 16, 28, 28]). Max
// pooling at column stride 1 or 2, forward and gradient, is kernels/pool.hpp's per instruction
// set instead: a vector of windows at a time from a padded copy of their rows, the gradient's
// argmax then a scatter in output order (3x3/2 pad 1 on [32, 64, 28, 28]: the gradient 1.8 ms
// against 13 one output at a time, the forward 1.2 against 1.7 by the loops above; the machine
// and build as above, AVX-512). At other strides, or for rows longer than its buffer, max
// pooling's gradient is a branch-free argmax search (random data mispredicts "a new maximum")
// and a scatter, one output at a time. Max pooling over 2x2 windows at stride 2 that tile the
// input, forward and gradient, is kernels/pool.hpp's too: these loops vectorise only where the
// compiler is told the machine (g++ 12 -O3 -march=native); built with -O2 they were two
// fifths of LeNet-5's training step. So is average pooling, its forward at column stride 1 or
// 2 from a padded copy of the window's rows, its gradient at any stride as a gather that
// writes each element of dx once, both with the additions of the loops here in their order
// (the same bits); the loops here remain for rows longer than their buffers and, for the
// forward, other strides. Adaptive pooling sums each bin row by row with Eigen's
// vectorised reduction (a whole bin at once when it spans full rows: global pooling is one
// contiguous sum per plane). Nothing is allocated beyond the output.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../cell.hpp"
#include "../eager.hpp"
#include "../kernels/pool.hpp"
#include "../nn/pad_mode.hpp"
#include "../operation.hpp"
#include "arithmetic.hpp"

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
  const auto [lo, hi] = kernels::inner_columns(x[3], v.out, w.kernel_w, w.stride_w, v.pad_before);
  return {x[0] * x[1], x[2], x[3], h.out, v.out, h.pad_before, v.pad_before, lo, hi};
}

DUET_BEGIN_VECTORIZED

// The rows [lo, hi) of a window that lie inside the input, for output row oh.
struct WindowRows {
  index_t first;  // input row of window row 0 (may be negative)
  index_t lo, hi;
};

template <class Window>
WindowRows window_rows(const Window& w, const PoolGeometry& g, index_t oh) {
  const index_t first = oh * w.stride_h - g.pad_top;
  return {first, std::max<index_t>(0, -first), std::min<index_t>(w.kernel_h, g.H - first)};
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

// Whether an average divides by its window's size, the padding included.
template <class Window>
constexpr bool counts_padding(const Window& w) {
  return w.pad_mode == nn::PadMode::pad && w.count_include_pad;
}

// The divisor of an average over `rows` x `cols` window elements inside the input.
template <class Window>
constexpr index_t average_count(const Window& w, index_t rows, index_t cols) {
  return counts_padding(w) ? w.kernel_h * w.kernel_w : rows * cols;
}

// Whether w is the 2x2 window at stride 2 and its windows tile g's input without padding:
// the case kernels/pool.hpp runs per instruction set.
template <class Window>
bool tiles_2x2(const Window& w, const PoolGeometry& g) {
  return w.kernel_h == 2 && w.kernel_w == 2 && w.stride_h == 2 && w.stride_w == 2 && g.pad_top == 0 &&
         g.pad_left == 0 && 2 * g.OH <= g.H && 2 * g.OW <= g.W;
}

// The kernels' view of w over g.
template <class Window>
kernels::PoolShape pool_shape(const Window& w, const PoolGeometry& g) {
  return {g.planes, g.H, g.W, g.OH, g.OW, w.kernel_h, w.kernel_w, w.stride_h, w.stride_w, g.pad_top, g.pad_left};
}

template <class Kind, class Window, class T>
void pool2d_forward(const Window& w, const PoolGeometry& g, const T* x, T* y) {
  if constexpr (std::is_same_v<Kind, MaxPoolKind>) {
    if (tiles_2x2(w, g)) return kernels::max_pool_2x2(x, g.planes, g.H, g.W, g.OH, g.OW, y);
    if (kernels::pool_rows_take<T>(pool_shape(w, g))) return kernels::max_pool(x, pool_shape(w, g), y);
  } else {
    if (kernels::pool_rows_take<T>(pool_shape(w, g)))
      return kernels::avg_pool(x, pool_shape(w, g), counts_padding(w), y);
  }
  const index_t KW = w.kernel_w;
  const index_t SW = w.stride_w;
  for (index_t p = 0; p < g.planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    T* yp = y + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const WindowRows r = window_rows(w, g, oh);
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
      const index_t inner_count = average_count(w, r.hi - r.lo, KW);
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
        yr[ow] = Kind::finish(acc, average_count(w, r.hi - r.lo, kw_hi - kw_lo));
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

template <class Window, class T>
void max_pool2d_backward_tiled(const Window& w, const PoolGeometry& g, const T* dy, const T* x, T* dx) {
  const index_t KH = w.kernel_h;
  const index_t KW = w.kernel_w;
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
// than any number), in output order where windows choose the same one.
template <class Window, class T>
void max_pool2d_backward(const Window& w, const PoolGeometry& g, const T* dy, const T* x, T* dx) {
  if (tiles_2x2(w, g)) return kernels::max_pool_2x2_backward(dy, x, g.planes, g.H, g.W, g.OH, g.OW, dx);
  if (w.stride_h == w.kernel_h && w.stride_w == w.kernel_w && g.pad_top == 0 && g.pad_left == 0 &&
      g.OH * w.kernel_h <= g.H && g.OW * w.kernel_w <= g.W) {
    max_pool2d_backward_tiled(w, g, dy, x, dx);
    return;
  }
  const kernels::PoolShape shape = pool_shape(w, g);
  if (kernels::pool_rows_take<T>(shape)) return kernels::max_pool_backward(dy, x, shape, dx);
  std::fill_n(dx, g.planes * g.H * g.W, T(0));
  for (index_t p = 0; p < g.planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    T* dxp = dx + p * g.H * g.W;
    const T* dyp = dy + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const WindowRows r = window_rows(w, g, oh);
      for (index_t ow = 0; ow < g.OW; ++ow) {
        const index_t c0 = ow * w.stride_w - g.pad_left;
        const index_t kw_lo = std::max<index_t>(0, -c0);
        const index_t kw_hi = std::min<index_t>(w.kernel_w, g.W - c0);
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

// dx of average pooling: dy / count added over each window, in the forward kernel's order
// (kernels::avg_pool_backward keeps it: each element's sum from +0 over output rows in
// ascending order, for each the inside windows by tap, then the border's by output column).
template <class Window, class T>
void avg_pool2d_backward(const Window& w, const PoolGeometry& g, const T* dy, T* dx) {
  const kernels::PoolShape shape = pool_shape(w, g);
  if (kernels::avg_pool_backward_takes<T>(shape)) {
    return kernels::avg_pool_backward(dy, shape, counts_padding(w), dx);
  }
  const index_t KW = w.kernel_w;
  const index_t SW = w.stride_w;
  std::fill_n(dx, g.planes * g.H * g.W, T(0));
  for (index_t p = 0; p < g.planes; ++p) {
    T* dxp = dx + p * g.H * g.W;
    const T* dyp = dy + p * g.OH * g.OW;
    for (index_t oh = 0; oh < g.OH; ++oh) {
      const WindowRows r = window_rows(w, g, oh);
      const T* dyr = dyp + oh * g.OW;
      const T inner_count = static_cast<T>(average_count(w, r.hi - r.lo, KW));
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
        const T share = dyr[ow] / static_cast<T>(average_count(w, r.hi - r.lo, kw_hi - kw_lo));
        for (index_t kh = r.lo; kh < r.hi; ++kh) {
          for (index_t kw = kw_lo; kw < kw_hi; ++kw) dxp[(r.first + kh) * g.W + c0 + kw] += share;
        }
      };
      for (index_t ow = 0; ow < g.lo; ++ow) border(ow);
      for (index_t ow = g.hi; ow < g.OW; ++ow) border(ow);
    }
  }
}

DUET_END_VECTORIZED

inline std::string window_text(const Pool2dWindow& w) {
  std::string s = "(kernel=" + std::to_string(w.kernel_h) + "x" + std::to_string(w.kernel_w) +
                  ", stride=" + std::to_string(w.stride_h) + "x" + std::to_string(w.stride_w) +
                  ", pad_mode=" + std::string(name_of(w.pad_mode));
  if (w.pad_mode == nn::PadMode::pad) s += ", padding=" + std::to_string(w.pad_h) + "x" + std::to_string(w.pad_w);
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

// A window known at compile time, for the kernels: its sizes are constants there, so the
// loops over a row have a constant stride the compiler vectorises, and the 2x2 case is decided
// while compiling.
template <Pool2dWindow Win>
struct FixedWindow {
  static constexpr Pool2dWindow value = Win;
  static constexpr index_t kernel_h = Win.kernel_h, kernel_w = Win.kernel_w;
  static constexpr index_t stride_h = Win.stride_h, stride_w = Win.stride_w;
  static constexpr nn::PadMode pad_mode = Win.pad_mode;
  static constexpr index_t pad_h = Win.pad_h, pad_w = Win.pad_w;
  static constexpr bool count_include_pad = Win.count_include_pad;
};

inline const Pool2dWindow& window_value(const Pool2dWindow& w) { return w; }
template <Pool2dWindow Win>
constexpr const Pool2dWindow& window_value(FixedWindow<Win>) {
  return FixedWindow<Win>::value;
}

// ONNX: MaxPool or AveragePool; pad_mode same as auto_pad SAME_UPPER (the odd padding after,
// at every size), the others' padding written out; an average counts the padding as duet's
// does (only in pad_mode pad with count_include_pad).
template <class Kind>
Interchange pool_interchange(const Pool2dWindow& w) {
  const bool padded = w.pad_mode == nn::PadMode::pad;
  using A = InterchangeAttribute;
  InterchangeNode pool{std::is_same_v<Kind, MaxPoolKind> ? "MaxPool" : "AveragePool",
                       {InterchangeInput::operand(0)},
                       {A::of("kernel_shape", {w.kernel_h, w.kernel_w}), A::of("strides", {w.stride_h, w.stride_w}),
                        w.pad_mode == nn::PadMode::same ? A::of_text("auto_pad", "SAME_UPPER")
                                                        : A::of("pads", {padded ? w.pad_h : 0, padded ? w.pad_w : 0,
                                                                         padded ? w.pad_h : 0, padded ? w.pad_w : 0})}};
  if constexpr (!std::is_same_v<Kind, MaxPoolKind>) {
    pool.attributes.push_back(A::of("count_include_pad", w.pad_mode == nn::PadMode::pad && w.count_include_pad));
  }
  return {std::move(pool)};
}

}  // namespace detail

// What the two forms of pooling share (a window fixed at compile time, Pool2dOp, or given at
// run time, Pool2dListOp): the kernels and ONNX's node. Self says its window (window()).
template <class Self, class Kind>
struct Pool2dPrimitive : Primitive<Self> {
  static constexpr int arity = 1;

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const auto w = static_cast<const Self&>(*this).window();
    detail::pool2d_forward<Kind>(w, detail::pool_geometry(detail::window_value(w), a.in_shape()), a.in<T>(),
                                 a.out<T>());
  }

  Interchange interchange(std::span<const Shape>) const {
    return detail::pool_interchange<Kind>(detail::window_value(static_cast<const Self&>(*this).window()));
  }
};

// d/dx of pooling, from dy and x.
template <class Self, class Kind>
struct Pool2dGradPrimitive : Primitive<Self> {
  static constexpr std::array reads{graph::Operand::grad, graph::Operand::input0};
  static constexpr int arity = 2;

  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return {in[1]}; }

  template <class Backend, class T>
  void run(const graph::KernelArgs& a) const {
    const auto w = static_cast<const Self&>(*this).window();
    const detail::PoolGeometry g = detail::pool_geometry(detail::window_value(w), a.in_shape(1));
    if constexpr (std::is_same_v<Kind, detail::MaxPoolKind>) {
      detail::max_pool2d_backward(w, g, a.in<T>(0), a.in<T>(1), a.out<T>());
    } else {
      detail::avg_pool2d_backward(w, g, a.in<T>(0), a.out<T>());
    }
  }
};

template <class Kind, Pool2dWindow Win, class Layer>
struct Pool2dGradOp : Pool2dGradPrimitive<Pool2dGradOp<Kind, Win, Layer>, Kind> {
  const Layer* layer;
  Pool2dGradOp(const Layer* l = nullptr) : layer(l) {}

  static constexpr detail::FixedWindow<Win> window() { return {}; }
  static std::string op_name() { return std::string(Kind::name) + "Grad" + detail::window_text(Win); }
};

// Kind pooling with window Win. Layer is the nn:: layer that captures it (named in errors), or
// void for the functional form.
template <class Kind, Pool2dWindow Win, class Layer = void>
struct Pool2dOp : Pool2dPrimitive<Pool2dOp<Kind, Win, Layer>, Kind> {
  static_assert(Win.kernel_h >= 1 && Win.kernel_w >= 1 && Win.stride_h >= 1 && Win.stride_w >= 1,
                "duet::ops: a pooling window's kernel and stride must be at least 1");
  static_assert(Win.pad_h >= 0 && Win.pad_w >= 0 && 2 * Win.pad_h <= Win.kernel_h && 2 * Win.pad_w <= Win.kernel_w,
                "duet::ops: a pooling window's padding must be at least 0 and at most half its kernel");
  using layer_type = std::conditional_t<std::is_void_v<Layer>, Pool2dOp, Layer>;

  const Layer* layer;
  Pool2dOp(const Layer* l = nullptr) : layer(l) {}

  static constexpr detail::FixedWindow<Win> window() { return {}; }
  static constexpr ShapeResult infer_static(std::span<const Shape> in) { return detail::pool2d_rule(Win, in[0]); }

  template <std::size_t K>
    requires(K == 0)
  auto grad_op() const {
    return Pool2dGradOp<Kind, Win, Layer>{layer};
  }

    static std::string op_name() { return std::string(Kind::name) + detail::window_text(Win); }
    std::string label() const {
      if constexpr (std::is_void_v<Layer>)
        return std::string(Kind::function) + detail::window_text(Win);
      else
        return layer->label();
    }
};

template <class Kind>
struct Pool2dListGradOp : Pool2dGradPrimitive<Pool2dListGradOp<Kind>, Kind> {
  Pool2dWindow win;
  const Pool2dWindow& window() const { return win; }
  static std::string op_name() { return std::string(Kind::name) + "Grad"; }
  std::string label() const { return op_name() + detail::window_text(win); }
};

// Pooling over a window given at run time (an ONNX model's, a network built at run time): one
// operation for every window, as tile(x, multiples) is for every list of multiples. Graph mode
// reads the window when it captures construct and knows the output's shape when the network
// first runs.
template <class Kind>
struct Pool2dListOp : Pool2dPrimitive<Pool2dListOp<Kind>, Kind> {
  Pool2dWindow win;

  const Pool2dWindow& window() const { return win; }
  static constexpr ShapeResult infer_static(std::span<const Shape>) { return {Shape::any()}; }
  ShapeResult infer(std::span<const Shape> in) const { return detail::pool2d_rule(win, in[0]); }

  template <std::size_t K>
  requires(K == 0) Pool2dListGradOp<Kind> grad_op()
  const { return {{}, win}; }

  static std::string op_name() { return std::string(Kind::name); }
  std::string label() const { return std::string(Kind::function) + detail::window_text(win); }
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

namespace detail {

// What is wrong with a window given at run time (Pool2dOp's static_asserts at compile time),
// empty if nothing.
inline std::string window_fault(const Pool2dWindow& w) {
  if (w.kernel_h < 1 || w.kernel_w < 1 || w.stride_h < 1 || w.stride_w < 1) {
    return "the window " + window_text(w) + " has a kernel or stride below 1";
  }
  if (w.pad_h < 0 || w.pad_w < 0 || 2 * w.pad_h > w.kernel_h || 2 * w.pad_w > w.kernel_w) {
    return "the window " + window_text(w) + " pads by less than 0 or by more than half its kernel";
  }
  if (w.pad_mode != nn::PadMode::pad && (w.pad_h != 0 || w.pad_w != 0)) {
    return "the window " + window_text(w) + " gives padding outside pad_mode pad";
  }
  return {};
}

inline const Pool2dWindow& checked_window(const Pool2dWindow& w, std::string_view function) {
  if (std::string fault = window_fault(w); !fault.empty())
    throw ValueError("duet::" + std::string(function) + ": " + fault);
  return w;
}

}  // namespace detail

// Pooling over a window given at run time, any size (rectangular, pad modes; torch's
// F.max_pool2d(x, kernel_size, stride, padding), a network built at run time, an ONNX model's
// MaxPool): a ValueError for a window Pool2dOp would refuse to compile.
template <TensorLike X>
auto max_pool2d(const X& x, const Pool2dWindow& window) {
  return apply(Pool2dListOp<detail::MaxPoolKind>{{}, detail::checked_window(window, "ops::max_pool2d")}, x);
}
template <TensorLike X>
auto avg_pool2d(const X& x, const Pool2dWindow& window) {
  return apply(Pool2dListOp<detail::AvgPoolKind>{{}, detail::checked_window(window, "ops::avg_pool2d")}, x);
}

// The square windows of the template forms, with their defaults (the stride of max_pool2d the
// kernel's size, of avg_pool2d 1), at run time.
template <TensorLike X>
auto max_pool2d(const X& x, index_t kernel, std::optional<index_t> stride = std::nullopt, index_t padding = 0) {
  const index_t s = stride.value_or(kernel);
  return max_pool2d(x, Pool2dWindow{kernel, kernel, s, s, nn::PadMode::pad, padding, padding});
}
template <TensorLike X>
auto avg_pool2d(const X& x, index_t kernel, index_t stride = 1, index_t padding = 0, bool count_include_pad = true) {
  return avg_pool2d(
      x, Pool2dWindow{kernel, kernel, stride, stride, nn::PadMode::pad, padding, padding, count_include_pad});
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
