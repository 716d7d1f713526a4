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

// c[0] + c[1] x + ... in Horner's form, unrolled (GCC 12 at -O2 unrolls no loop by itself).
template <class T, std::size_t N>
Vec<T> polynomial(const T (&c)[N], Vec<T> x) {
  Vec<T> p = splat(c[N - 1]);
#pragma GCC unroll 32
  for (int i = static_cast<int>(N) - 2; i >= 0; --i) p = fma<T>(p, x, splat(c[i]));
  return p;
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
  const Vec<T> p = polynomial(C::taylor, r);
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
  const Vec<T> p = polynomial(C::taylor, x * x);
  const Vec<T> large = T(1) - T(2) / (exp<T>(ax + ax) + T(1));
  const Vec<T> signed_large = x < T(0) ? -large : large;
  return ax < T(0.55) ? x * p : signed_large;
}

// 1 / (1 + e^-x): 0 where e^-x overflows, NaN for NaN.
template <class T>
Vec<T> sigmoid(Vec<T> x) {
  return T(1) / (T(1) + exp<T>(-x));
}

// ---- erf and the normal distribution ---------------------------------------------------------
//
// erf z for |z| < 1 by its Taylor series, z · P(z²) with the coefficients (-1)^n 2 / (√π n! (2n + 1)),
// to z^19 for float and z^33 for double (the first omitted term is below 2^-26 and 2^-56 of the
// result); above, 1 - erfc |z|, signed as z. erfc z = t · e^(Q(2.5t - 1) - z²) with t = 2 / (2 + z):
// Q(t) = ln(erfc(z) e^(z²) / t) is smooth in t over [0, 0.8], which is z from 0.5 to infinity, and
// its Chebyshev interpolant of degree 9 (float) and 24 (double), fitted in long double against
// erfcl and written in powers of 2.5t - 1, loses less than the arithmetic around it. erf is within
// 1 ulp of std::erf (tests/kernels_elementwise.cpp); erfc keeps its relative precision down to
// the smallest normal number, within about z² ulp (the rounding of z² in the exponent), which the
// normal distribution's lower tail needs and 1 - erf z would lose entirely.
template <class T>
struct ErfConstants;

template <>
struct ErfConstants<float> {
  static constexpr float taylor[] = {1.12837916709551257385f,     -0.376126389031837524607f,
                                     0.112837916709551257382f,    -0.0268661706451312517579f,
                                     0.00522397762544218784195f,  -0.000854832702345085283217f,
                                     0.000120553329817896642502f, -1.49256503584062509771e-05f,
                                     1.64621143658892474007e-06f, -1.63658446912349243169e-07f};
  static constexpr float tail[] = {
      -0.804072259846838267004f,    0.518768429751653002257f,   0.0463735628563339262622f, -0.018366706244353618095f,
      -0.00695469478643040220322f,  0.00161467101399814087258f, 0.0010997671175996117515f, -0.000223771991001458885067f,
      -0.000136268744181474582564f, 2.96618114943573985005e-05f};
};

template <>
struct ErfConstants<double> {
  static constexpr double taylor[] = {
      1.12837916709551257385,     -0.376126389031837524607,    0.112837916709551257382,    -0.0268661706451312517579,
      0.00522397762544218784195,  -0.000854832702345085283217, 0.000120553329817896642502, -1.49256503584062509771e-05,
      1.64621143658892474007e-06, -1.63658446912349243169e-07, 1.48071928158792172387e-08, -1.2290555301717927352e-09,
      9.42275906465041097021e-11, -6.71136685516411037783e-12, 4.46322426328647734475e-13, -2.78351620721092135474e-14,
      1.63426140953671518938e-15};
  static constexpr double tail[] = {
      -0.804072310106957503296,    0.518768445016172378189,    0.0463760849528252582703,    -0.018367473809385532262,
      -0.00697525468396543510783,  0.00162099493150782137526,  0.00115976089249056748383,   -0.000242661971996334796535,
      -0.000211315449775375877045, 5.45358704122711479559e-05, 3.88732269931518770177e-05,  -1.47710831932301722703e-05,
      -6.39586604464614794156e-06, 4.01048070750142926476e-06, 6.91091729265735921196e-07,  -9.73493824716342714911e-07,
      5.94048334434660318904e-08,  1.90288141652672493357e-07, -6.00517959981061721891e-08, -2.50756073683078284375e-08,
      1.86437944194040028375e-08,  1.19752030514064244916e-09, -3.34597416440374217927e-09, 1.30430635181255638602e-10,
      2.88086994260083884005e-10};
};

// erf z for |z| < 1.
template <class T>
Vec<T> erf_near_zero(Vec<T> z) {
  return z * polynomial(ErfConstants<T>::taylor, z * z);
}

// erfc z for z >= 0.5 (anything finite below).
template <class T>
Vec<T> erfc_tail(Vec<T> z) {
  const Vec<T> t = T(2) / (T(2) + z);
  return t * exp<T>(polynomial(ErfConstants<T>::tail, T(2.5) * t - T(1)) - z * z);
}

template <class T>
Vec<T> erf(Vec<T> z) {
  const Vec<T> az = z < T(0) ? -z : z;
  const Vec<T> large = T(1) - erfc_tail<T>(az);
  return az < T(1) ? erf_near_zero<T>(z) : (z < T(0) ? -large : large);
}

// Φ(x), the standard normal distribution, 0.5 (1 + erf(x / √2)): from |x| / √2 = 0.5 on as
// 0.5 erfc(|x| / √2) or 1 minus it, so that the lower tail (GELU's) keeps its digits rather than
// those 0.5 + 0.5 erf leaves, which at x = -1.4 were 6 ulp of 0.08.
template <class T>
Vec<T> normal_cdf(Vec<T> x) {
  const Vec<T> z = x * T(0.70710678118654752440);
  const Vec<T> az = z < T(0) ? -z : z;
  const Vec<T> half_tail = T(0.5) * erfc_tail<T>(az);
  const Vec<T> large = z < T(0) ? half_tail : T(1) - half_tail;
  return az < T(0.5) ? T(0.5) + T(0.5) * erf_near_zero<T>(z) : large;
}
