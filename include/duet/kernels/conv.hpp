// The loops of a convolution around its matrix products (ops/conv.hpp runs them): im2col,
// which lays out the input patches one output pixel to a row, col2im, which adds such rows
// back into an image, and the products of the two gradients.
//
// Layout: images NCHW (a 1-D convolution is a 2-D one of height 1), the weight
// [out, in / groups, kh, kw], so that one output channel's weights are one contiguous row of
// depth = in / groups · kh · kw. For one sample and one group, with col[P, depth] (P output
// pixels) its patches:
//   forward           y[out_g, P]     = w[out_g, depth] · colᵀ       duet's GEMM (C = A · Bᵀ)
//   backward, data    dcol[P, depth]  = dyᵀ · w,   then col2im        Eigen
//   backward, weight  dw[out_g, depth] += dy · col                    Eigen
// The forward product is exactly gemm's C = A · Bᵀ with both operands row-major and writes
// NCHW directly, without a transpose; the gradients' products take a transposed operand and
// add over the batch, which Eigen's product does in place. Patches one pixel to a row make
// the forward product's B operand, which gemm packs in panels of rows.
#pragma once

#include <algorithm>

#include <Eigen/Core>

#include "../shape.hpp"

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

template <class T>
using ConvMatrix = ::Eigen::Matrix<T, ::Eigen::Dynamic, ::Eigen::Dynamic, ::Eigen::RowMajor>;

// f(at, i) for every element of one group's patches, in the order they are stored: `at` is
// the element's place in col[P, depth] (output pixel, then input channel, kernel row, kernel
// column), i the input element it reads within the group's channels ([in / groups, H, W]),
// or -1 in the padding. In storage order, im2col writes each row of col front to back.
template <class F>
void for_each_tap(const ConvProblem& q, F&& f) {
  index_t at = 0;
  for (index_t oh = 0; oh < q.out_height; ++oh) {
    const index_t h0 = oh * q.stride_h - q.pad_top;
    for (index_t ow = 0; ow < q.out_width; ++ow) {
      const index_t w0 = ow * q.stride_w - q.pad_left;
      const bool columns_inside = w0 >= 0 && w0 + (q.kernel_w - 1) * q.dilation_w < q.width;
      for (index_t c = 0; c < q.in_per_group(); ++c) {
        for (index_t a = 0; a < q.kernel_h; ++a) {
          const index_t h = h0 + a * q.dilation_h;
          if (h < 0 || h >= q.height) {
            for (index_t b = 0; b < q.kernel_w; ++b) f(at++, index_t{-1});
            continue;
          }
          const index_t row = c * q.image() + h * q.width;
          if (columns_inside) {
            for (index_t b = 0; b < q.kernel_w; ++b) f(at++, row + w0 + b * q.dilation_w);
          } else {
            for (index_t b = 0; b < q.kernel_w; ++b) {
              const index_t w = w0 + b * q.dilation_w;
              f(at++, w >= 0 && w < q.width ? row + w : index_t{-1});
            }
          }
        }
      }
    }
  }
}

}  // namespace detail

// col[P, depth] = the patches of x, one group's channels of one sample ([in / groups, H, W]),
// zeros where a patch reaches into the padding.
template <class T>
void im2col(const ConvProblem& q, const T* x, T* col) {
  detail::for_each_tap(q, [&](index_t at, index_t i) { col[at] = i < 0 ? T(0) : x[i]; });
}

// dx += the rows of col added back where im2col took them from.
template <class T>
void col2im_add(const ConvProblem& q, const T* col, T* dx) {
  detail::for_each_tap(q, [&](index_t at, index_t i) {
    if (i >= 0) dx[i] += col[at];
  });
}

// y[c, p] += bias[c] for the `channels` planes of `pixels` values of one sample.
template <class T>
void add_channel_bias(T* y, index_t channels, index_t pixels, const T* bias) {
  using Planes = ::Eigen::Array<T, ::Eigen::Dynamic, ::Eigen::Dynamic, ::Eigen::RowMajor>;
  ::Eigen::Map<Planes> Y(y, channels, pixels);
  Y.colwise() += ::Eigen::Map<const ::Eigen::Array<T, ::Eigen::Dynamic, 1>>(bias, channels);
}

// dcol[P, depth] = dy[out_g, P]ᵀ · w[out_g, depth]: the patches' gradient of one group.
template <class T>
void conv_patch_gradient(const ConvProblem& q, const T* dy, const T* w, T* dcol) {
  using M = detail::ConvMatrix<T>;
  const ::Eigen::Map<const M> DY(dy, q.out_per_group(), q.pixels());
  const ::Eigen::Map<const M> W(w, q.out_per_group(), q.depth());
  ::Eigen::Map<M>(dcol, q.pixels(), q.depth()).noalias() = DY.transpose() * W;
}

// dw[out_g, depth] (+)= dy[out_g, P] · col[P, depth]: one sample's part of a group's weight
// gradient.
template <class T>
void conv_weight_gradient(const ConvProblem& q, const T* dy, const T* col, T* dw, bool accumulate) {
  using M = detail::ConvMatrix<T>;
  const ::Eigen::Map<const M> DY(dy, q.out_per_group(), q.pixels());
  const ::Eigen::Map<const M> COL(col, q.pixels(), q.depth());
  ::Eigen::Map<M> DW(dw, q.out_per_group(), q.depth());
  if (accumulate) DW.noalias() += DY * COL;
  else DW.noalias() = DY * COL;
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
