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

// The functions below run on N vectors at once, each step on all N before the next step
// (DUET_EACH_VECTOR): a processor overlaps the N independent chains of dependent operations (a
// polynomial's Horner steps are FMAs of 4 cycles' latency in a row), which it does not do across
// the iterations of a loop that runs them one vector at a time: on Zen 5, a chain of 20 FMAs
// took 7.2 ns a vector alone and 3.1 ns four at a time. Each vector sees the same operations
// whatever N is, so every N gives the same bits.

// p = c[0] + c[1] x + ... in Horner's form, unrolled (GCC 12 at -O2 unrolls no loop by itself).
template <int N, class T, std::size_t C>
void polynomial(const T (&c)[C], const Vec<T> (&x)[N], Vec<T> (&p)[N]) {
  DUET_EACH_VECTOR(j) p[j] = splat(c[C - 1]);
#pragma GCC unroll 32
  for (int i = static_cast<int>(C) - 2; i >= 0; --i) DUET_EACH_VECTOR(j) p[j] = fma<T>(p[j], x[j], splat(c[i]));
}

// ---- exp ---------------------------------------------------------------------------------
//
// e^x = 2^k · e^r with k = round(x / ln 2) and |r| <= ln 2 / 2, r = x - k·ln 2 in two parts
// (Cody and Waite: k·ln2_hi is exact, so r loses nothing to cancellation), e^r by its Taylor
// polynomial (degree 7 for float, 13 for double: the first omitted term is below 2^-27 and
// 2^-57 of the result) in Horner's form, and 2^k built in the exponent bits. 2^k is applied in
// two halves, so that a result near the top of the range, or subnormal at the bottom, is
// rounded once, as std::exp's is (AVX-512 does that in one instruction, scale_by_power_of_2). tests/kernels_elementwise.cpp requires 2 ulp of std::exp
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

template <int N, class T>
void exp(Vec<T> (&x)[N]) {
  using C = ExpConstants<T>;
  Vec<T> k[N], r[N], p[N];
  DUET_EACH_VECTOR(j) {
    // Comparisons with NaN are false, so NaN passes both clamps and stays NaN to the end.
    x[j] = x[j] < C::lowest ? splat(C::lowest) : x[j];
    x[j] = x[j] > C::highest ? splat(C::highest) : x[j];
    k[j] = (x[j] * C::log2e + C::round_shift) - C::round_shift;
    r[j] = fma<T>(k[j], splat(-C::ln2_hi), x[j]);
    r[j] = fma<T>(k[j], splat(-C::ln2_lo), r[j]);
  }
  polynomial<N>(C::taylor, r, p);
  DUET_EACH_VECTOR(j) {
    if constexpr (scales_in_one_step) {
      x[j] = scale_by_power_of_2<T>(p[j], k[j]);
    } else {
      const Vec<T> half = k[j] * T(0.5) + C::round_shift;
      const Vec<T> rest = (k[j] - (half - C::round_shift)) + C::round_shift;
      x[j] = p[j] * exp2_of_shifted<T>(half) * exp2_of_shifted<T>(rest);
    }
  }
}

template <class T>
Vec<T> exp(Vec<T> x) {
  Vec<T> v[1] = {x};
  exp<1, T>(v);
  return v[0];
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

template <int N, class T>
void tanh(Vec<T> (&x)[N]) {
  Vec<T> ax[N], x2[N], p[N], e[N];
  DUET_EACH_VECTOR(j) {
    ax[j] = x[j] < T(0) ? -x[j] : x[j];
    x2[j] = x[j] * x[j];
    e[j] = ax[j] + ax[j];
  }
  polynomial<N>(TanhConstants<T>::taylor, x2, p);
  exp<N, T>(e);
  DUET_EACH_VECTOR(j) {
    const Vec<T> large = T(1) - T(2) / (e[j] + T(1));
    const Vec<T> signed_large = x[j] < T(0) ? -large : large;
    x[j] = ax[j] < T(0.55) ? x[j] * p[j] : signed_large;
  }
}

// 1 / (1 + e^-x): 0 where e^-x overflows, NaN for NaN.
template <int N, class T>
void sigmoid(Vec<T> (&x)[N]) {
  Vec<T> e[N];
  DUET_EACH_VECTOR(j) e[j] = -x[j];
  exp<N, T>(e);
  DUET_EACH_VECTOR(j) x[j] = T(1) / (T(1) + e[j]);
}

// ---- erf and the normal distribution ---------------------------------------------------------
//
// erf z for |z| < 1 by its Taylor series, z · P(z²) with the coefficients (-1)^n 2 / (√π n! (2n + 1)),
// to z^19 for float and z^37 for double (the first omitted term is below 2^-25 and 2^-61 of the
// result); above, 1 - erfc |z|, signed as z. erfc z = t · e^(Q(2t - 1) - z²) with t = 2 / (2 + z):
// Q(t) = ln(erfc(z) e^(z²) / t) is smooth in t over [0, 1], which is z from 0 to infinity, and
// its Chebyshev interpolant of degree 9 (float) and 24 (double), fitted in long double against
// erfcl and written in powers of 2t - 1, loses less than the arithmetic around it. erf is within
// 2 ulp of erfl (tests/kernels_elementwise.cpp; the 2 where the alternating series sums near
// |z| = 1); erfc keeps its relative precision for every z >= 0 down to the smallest normal
// number, within about z² ulp (the rounding of z² in the exponent), which the normal
// distribution's lower tail needs and 1 - erf z would lose entirely.
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
      -0.67179408367841774634f,     0.672643020857003147439f,  0.0473433338506980931626f,  -0.0468854046305139267823f,
      -0.00987486175324638563373f,  0.0087412051769647986562f, 0.00177826779659609884869f, -0.00209815570172401950197f,
      -0.000208744839562954170864f, 0.00035555684646217458611f};
};

template <>
struct ErfConstants<double> {
  static constexpr double taylor[] = {
      1.12837916709551257385,     -0.376126389031837524607,    0.112837916709551257382,    -0.0268661706451312517579,
      0.00522397762544218784195,  -0.000854832702345085283217, 0.000120553329817896642502, -1.49256503584062509771e-05,
      1.64621143658892474007e-06, -1.63658446912349243169e-07, 1.48071928158792172387e-08, -1.2290555301717927352e-09,
      9.42275906465041097021e-11, -6.71136685516411037783e-12, 4.46322426328647734475e-13, -2.78351620721092135474e-14,
      1.63426140953671518938e-15, -9.06397084280867247875e-17, 4.76334804051506811955e-18};
  static constexpr double tail[] = {
      -0.671794084056692265849,    0.672643223977657672707,     0.0473433068418981498125,
      -0.0468956102312720705227,   -0.00987268936574783631856,  0.00882493855985966455033,
      0.00175893353816674306851,   -0.00234581253581085225079,  -0.000146246584008342395129,
      0.000673679022073946365232,  -9.37372609383635424518e-05, -0.000174303673812419290802,
      7.14120244245419755237e-05,  3.17457540610810440314e-05,  -3.0223416693573312841e-05,
      1.4190136504055317371e-07,   8.6397113166469807762e-06,   -2.96571045680593670116e-06,
      -1.38559298392237906229e-06, 1.28494604609841189811e-06,  -5.72764304251904832266e-08,
      -2.90179104922572150837e-07, 8.34738284538616426356e-08,  2.99117164104245603095e-08,
      -1.37784627440851181746e-08};
};

// erf z for |z| < 1.
template <int N, class T>
void erf_near_zero(const Vec<T> (&z)[N], Vec<T> (&out)[N]) {
  Vec<T> z2[N];
  DUET_EACH_VECTOR(j) z2[j] = z[j] * z[j];
  polynomial<N>(ErfConstants<T>::taylor, z2, out);
  DUET_EACH_VECTOR(j) out[j] = z[j] * out[j];
}

// erfc z for z >= 0.
template <int N, class T>
void erfc_nonnegative(const Vec<T> (&z)[N], Vec<T> (&out)[N]) {
  Vec<T> t[N], u[N], q[N];
  DUET_EACH_VECTOR(j) {
    t[j] = T(2) / (T(2) + z[j]);
    u[j] = T(2) * t[j] - T(1);
  }
  polynomial<N>(ErfConstants<T>::tail, u, q);
  DUET_EACH_VECTOR(j) out[j] = q[j] - z[j] * z[j];
  exp<N, T>(out);
  DUET_EACH_VECTOR(j) out[j] = t[j] * out[j];
}

template <int N, class T>
void erf(Vec<T> (&z)[N]) {
  Vec<T> az[N], tail[N], near[N];
  DUET_EACH_VECTOR(j) az[j] = z[j] < T(0) ? -z[j] : z[j];
  erfc_nonnegative<N, T>(az, tail);
  erf_near_zero<N, T>(z, near);
  DUET_EACH_VECTOR(j) {
    const Vec<T> large = T(1) - tail[j];
    z[j] = az[j] < T(1) ? near[j] : (z[j] < T(0) ? -large : large);
  }
}

// Φ(x), the standard normal distribution, 0.5 (1 + erf(x / √2)), as 0.5 erfc(|x| / √2) or 1 minus
// it: one formula on every lane, and the lower tail (GELU's) keeps its digits, which
// 0.5 + 0.5 erf would lose (at x = -1.4 it left 6 ulp of 0.08, and in float nothing below -6).
template <int N, class T>
void normal_cdf(const Vec<T> (&x)[N], Vec<T> (&out)[N]) {
  Vec<T> az[N], tail[N];
  DUET_EACH_VECTOR(j) {
    const Vec<T> z = x[j] * T(0.70710678118654752440);
    az[j] = z < T(0) ? -z : z;
  }
  erfc_nonnegative<N, T>(az, tail);
  DUET_EACH_VECTOR(j) out[j] = x[j] < T(0) ? T(0.5) * tail[j] : T(1) - T(0.5) * tail[j];
}
