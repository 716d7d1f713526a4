// What elementwise kernels need beyond vector.hpp, written once on the set's Vec<T>, fma and
// sqrt: a tag that names the set, broadcasts, tails, horizontal reductions and exp. Included
// once per set, inside its namespace and target region (simd/arch.hpp), so no include guard.

// The set this copy is compiled for, as a type: a kernel written once (kernels/optim.hpp) is a
// function template taking Target first, so that simd/dispatch.hpp reaches the set's copy by
// argument-dependent lookup.
struct Target {};

// x in every lane, as one broadcast: x - (+0) is x for every x, -0 and NaN included, so the
// compilers fold the subtraction away. The loop over the lanes it replaces became masked
// broadcasts and blends under g++ 12 -O3 -march=native (AVX-512), and pushed the direct
// convolution's tile out of the registers.
template <class T>
Vec<T> splat(T x) {
  return x - Vec<T>{};
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
