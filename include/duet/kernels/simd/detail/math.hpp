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

// ---- tanh and the sigmoid ---------------------------------------------------------------
//
// tanh x for |x| < 0.55 by its Taylor series, x · P(x²) (the coefficients 2^2n (2^2n - 1) B_2n /
// (2n)!, to x^19 for float and x^35 for double: the first omitted term is below 2^-30 and 2^-54
// of the result), where 1 - 2 / (e^2|x| + 1) would lose the small result to cancellation; above,
// that formula on exp, signed as x (e^2|x| overflowing to inf gives 1). NaN stays NaN, -0 stays
// -0. Within a few ulp of std::tanh (tests/kernels_elementwise.cpp): a recurrent cell's gates
// called libm's tanhf and expf once per element, half of an LSTM's training step.
template <class T>
struct TanhConstants;

template <>
struct TanhConstants<float> {
  static constexpr float taylor[] = {1.0f,
                                     -0.3333333333333333f,
                                     0.13333333333333333f,
                                     -0.05396825396825397f,
                                     0.021869488536155203f,
                                     -0.008863235529902197f,
                                     0.003592128036572481f,
                                     -0.0014558343870513183f,
                                     0.000590027440945586f,
                                     -0.00023912911424355248f};
};

template <>
struct TanhConstants<double> {
  static constexpr double taylor[] = {1.0,
                                      -0.3333333333333333,
                                      0.13333333333333333,
                                      -0.05396825396825397,
                                      0.021869488536155203,
                                      -0.008863235529902197,
                                      0.003592128036572481,
                                      -0.0014558343870513183,
                                      0.000590027440945586,
                                      -0.00023912911424355248,
                                      9.691537956929451e-05,
                                      -3.927832388331683e-05,
                                      1.5918905069328964e-05,
                                      -6.451689215655431e-06,
                                      2.6147711512907546e-06,
                                      -1.0597268320104654e-06,
                                      4.294911078273806e-07,
                                      -1.7406618963571648e-07};
};

template <class T>
Vec<T> tanh(Vec<T> x) {
  using C = TanhConstants<T>;
  const Vec<T> ax = x < T(0) ? -x : x;
  const Vec<T> x2 = x * x;
  constexpr int terms = static_cast<int>(sizeof C::taylor / sizeof(T));
  Vec<T> p = splat(C::taylor[terms - 1]);
  for (int i = terms - 2; i >= 0; --i) p = fma<T>(p, x2, splat(C::taylor[i]));
  const Vec<T> large = T(1) - T(2) / (exp<T>(ax + ax) + T(1));
  const Vec<T> signed_large = x < T(0) ? -large : large;
  return ax < T(0.55) ? x * p : signed_large;
}

// 1 / (1 + e^-x): 0 where e^-x overflows, NaN for NaN.
template <class T>
Vec<T> sigmoid(Vec<T> x) {
  return T(1) / (T(1) + exp<T>(-x));
}
