// Golden strings from numpy 1.24: str(np.array(values, dtype=...)) with default print options.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <duet/duet.hpp>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace tests_print {

using namespace duet;

namespace {

constexpr float fnan = std::numeric_limits<float>::quiet_NaN();
constexpr float finf = std::numeric_limits<float>::infinity();
constexpr double dnan = std::numeric_limits<double>::quiet_NaN();
constexpr double dinf = std::numeric_limits<double>::infinity();

// Element i is fn(i), in row-major order; the goldens were made with the same expression in
// float32 or float64 numpy arithmetic, which rounds as C++ does.
template <class T, class Fn>
BasicTensor<T> generate(const Shape& shape, Fn fn) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (index_t i = 0; i < t.numel(); ++i) t.data()[i] = fn(i);
  return t;
}

}  // namespace

TEST_CASE("print: float32 tensors of rank 1 to 4") {
  CHECK(to_string(Tensor(Shape{3}, {1.5f, -2.25f, 3.f})) == "[ 1.5  -2.25  3.  ]");
  CHECK(to_string(Tensor(Shape{1}, {0.5f})) == "[0.5]");
  CHECK(to_string(Tensor(Shape{2, 3}, {1.f, 2.5f, -3.f, 4.f, 5.f, 6.125f})) ==
        R"([[ 1.     2.5   -3.   ]
 [ 4.     5.     6.125]])");
  CHECK(to_string(generate<float>(Shape{2, 3, 4}, [](index_t i) { return static_cast<float>(i) * 0.5f - 6.f; })) ==
        R"([[[-6.  -5.5 -5.  -4.5]
  [-4.  -3.5 -3.  -2.5]
  [-2.  -1.5 -1.  -0.5]]

 [[ 0.   0.5  1.   1.5]
  [ 2.   2.5  3.   3.5]
  [ 4.   4.5  5.   5.5]]])");
  CHECK(to_string(generate<float>(Shape{2, 2, 2, 3}, [](index_t i) { return static_cast<float>(i) - 12.f; })) ==
        R"([[[[-12. -11. -10.]
   [ -9.  -8.  -7.]]

  [[ -6.  -5.  -4.]
   [ -3.  -2.  -1.]]]


 [[[  0.   1.   2.]
   [  3.   4.   5.]]

  [[  6.   7.   8.]
   [  9.  10.  11.]]]])");
  CHECK(to_string(generate<float>(Shape{1, 1, 2, 1}, [](index_t i) { return static_cast<float>(i) / 3.f; })) ==
        R"([[[[0.        ]
   [0.33333334]]]])");
}

TEST_CASE("print: float64 tensors") {
  CHECK(to_string(BasicTensor<double>(Shape{3}, {0.1, 0.2, 0.1 + 0.2})) == "[0.1 0.2 0.3]");
  CHECK(to_string(BasicTensor<double>(Shape{2, 2}, {1.0 / 3, 2.0 / 3, 1.0, -0.5})) ==
        R"([[ 0.33333333  0.66666667]
 [ 1.         -0.5       ]])");
  CHECK(to_string(BasicTensor<double>(Shape{3}, {12345678.9, 0.25, -1.0})) ==
        "[ 1.23456789e+07  2.50000000e-01 -1.00000000e+00]");
  CHECK(to_string(BasicTensor<double>(Shape{2}, {0.999999999, 0.5})) == "[1.  0.5]");
}

TEST_CASE("print: values that switch to scientific notation") {
  CHECK(to_string(Tensor(Shape{3}, {1e-5f, 1.f, 1e5f})) == "[1.e-05 1.e+00 1.e+05]");
  CHECK(to_string(Tensor(Shape{2}, {1.5e10f, -2.f})) == "[ 1.5e+10 -2.0e+00]");
  CHECK(to_string(Tensor(Shape{1}, {1e8f})) == "[1.e+08]");
  CHECK(to_string(Tensor(Shape{2}, {0.125f, 1000.f})) == "[1.25e-01 1.00e+03]");
  CHECK(to_string(Tensor(Shape{2}, {1.f, 1000.f})) == "[   1. 1000.]");
  CHECK(to_string(Tensor(Shape{3}, {0.1f, 1e-5f, 123.456f})) == "[1.00000e-01 1.00000e-05 1.23456e+02]");
  CHECK(to_string(Tensor(Shape{2}, {42598728.f, 1.2345678e-3f})) == "[4.2598728e+07 1.2345678e-03]");
  CHECK(to_string(BasicTensor<double>(Shape{2}, {1e100, 1e-5})) == "[1.e+100 1.e-005]");
  CHECK(to_string(BasicTensor<double>(Shape{3}, {-1e-5, 3e7, -2.5e9})) == "[-1.0e-05  3.0e+07 -2.5e+09]");
  CHECK(to_string(BasicTensor<double>(Shape{2}, {1.0 / 3 * 1e-7, 1.0})) == "[3.33333333e-08 1.00000000e+00]");
}

TEST_CASE("print: negative and integral values") {
  CHECK(to_string(Tensor(Shape{3}, {-1.f, -0.5f, 2.f})) == "[-1.  -0.5  2. ]");
  CHECK(to_string(Tensor(Shape{3}, {1.f, 2.f, 3.f})) == "[1. 2. 3.]");
  CHECK(to_string(Tensor(Shape{2}, {0.f, -0.f})) == "[ 0. -0.]");
  CHECK(to_string(Tensor(Shape{3}, {0.f, 0.f, 0.f})) == "[0. 0. 0.]");
  CHECK(to_string(Tensor(Shape{2, 2}, {-10.f, 100.f, 0.5f, -0.25f})) ==
        R"([[-10.   100.  ]
 [  0.5   -0.25]])");
}

TEST_CASE("print: nan and inf") {
  CHECK(to_string(Tensor(Shape{4}, {fnan, 1.f, finf, -finf})) == "[ nan   1.  inf -inf]");
  CHECK(to_string(Tensor(Shape{2}, {fnan, fnan})) == "[nan nan]");
  CHECK(to_string(Tensor(Shape{2}, {-finf, fnan})) == "[-inf  nan]");
  CHECK(to_string(Tensor(Shape{2}, {finf, 2.5f})) == "[inf 2.5]");
  CHECK(to_string(Tensor(Shape{2}, {1e-5f, fnan})) == "[1.e-05    nan]");
  CHECK(to_string(Tensor(Shape{3}, {0.125f, -finf, 1e4f})) == "[1.25e-01     -inf 1.00e+04]");
  CHECK(to_string(BasicTensor<double>(Shape{2, 2}, {1.5, dnan, -dinf, 0.0})) ==
        R"([[ 1.5  nan]
 [-inf  0. ]])");
}

TEST_CASE("print: mixed magnitudes") {
  CHECK(to_string(Tensor(Shape{3}, {0.001f, 1.f, 100.f})) == "[1.e-03 1.e+00 1.e+02]");
  CHECK(to_string(Tensor(Shape{2}, {1e-4f, 1.f})) == "[1.e-04 1.e+00]");
  CHECK(to_string(Tensor(Shape{2}, {1.2e-4f, 0.1f})) == "[0.00012 0.1    ]");
  CHECK(to_string(Tensor(Shape{1}, {99999992.f})) == "[99999992.]");
  CHECK(to_string(Tensor(Shape{2}, {42598728.f, 100000.5f})) == "[42598728.    100000.5]");
  CHECK(to_string(Tensor(Shape{3}, {0.001953125f, 0.5f, -1.25f})) == "[ 0.00195312  0.5        -1.25      ]");
}

TEST_CASE("print: long rows wrap at 75 columns") {
  CHECK(to_string(generate<float>(Shape{3, 20}, [](index_t i) { return static_cast<float>(i) / 7.f; })) ==
        R"([[0.         0.14285715 0.2857143  0.42857143 0.5714286  0.71428573
  0.85714287 1.         1.1428572  1.2857143  1.4285715  1.5714285
  1.7142857  1.8571428  2.         2.142857   2.2857144  2.4285715
  2.5714285  2.7142856 ]
 [2.857143   3.         3.142857   3.2857144  3.4285715  3.5714285
  3.7142856  3.857143   4.         4.142857   4.285714   4.428571
  4.571429   4.714286   4.857143   5.         5.142857   5.285714
  5.428571   5.571429  ]
 [5.714286   5.857143   6.         6.142857   6.285714   6.428571
  6.571429   6.714286   6.857143   7.         7.142857   7.285714
  7.428571   7.571429   7.714286   7.857143   8.         8.142858
  8.285714   8.428572  ]])");
  CHECK(to_string(
            generate<float>(Shape{30}, [](index_t i) { return i == 4 ? fnan : static_cast<float>(i) / 7.f - 2.f; })) ==
        R"([-2.         -1.8571428  -1.7142857  -1.5714285          nan -1.2857143
 -1.1428571  -1.         -0.8571428  -0.71428573 -0.57142854 -0.42857146
 -0.28571427 -0.1428572   0.          0.14285707  0.2857144   0.42857146
  0.57142854  0.7142856   0.8571429   1.          1.1428571   1.2857144
  1.4285715   1.5714285   1.7142856   1.8571429   2.          2.142857  ])");
  CHECK(to_string(generate<std::int32_t>(Shape{40}, [](index_t i) { return static_cast<std::int32_t>(i * 1000); })) ==
        R"([    0  1000  2000  3000  4000  5000  6000  7000  8000  9000 10000 11000
 12000 13000 14000 15000 16000 17000 18000 19000 20000 21000 22000 23000
 24000 25000 26000 27000 28000 29000 30000 31000 32000 33000 34000 35000
 36000 37000 38000 39000])");
  CHECK(to_string(generate<double>(Shape{2, 2, 9}, [](index_t i) { return static_cast<double>(i) * 1e5 + 0.5; })) ==
        R"([[[5.0000000e-01 1.0000050e+05 2.0000050e+05 3.0000050e+05 4.0000050e+05
   5.0000050e+05 6.0000050e+05 7.0000050e+05 8.0000050e+05]
  [9.0000050e+05 1.0000005e+06 1.1000005e+06 1.2000005e+06 1.3000005e+06
   1.4000005e+06 1.5000005e+06 1.6000005e+06 1.7000005e+06]]

 [[1.8000005e+06 1.9000005e+06 2.0000005e+06 2.1000005e+06 2.2000005e+06
   2.3000005e+06 2.4000005e+06 2.5000005e+06 2.6000005e+06]
  [2.7000005e+06 2.8000005e+06 2.9000005e+06 3.0000005e+06 3.1000005e+06
   3.2000005e+06 3.3000005e+06 3.4000005e+06 3.5000005e+06]]])");
}

TEST_CASE("print: more than 1000 elements are summarised") {
  CHECK(to_string(generate<float>(Shape{2000}, [](index_t i) { return static_cast<float>(i); })) ==
        "[0.000e+00 1.000e+00 2.000e+00 ... 1.997e+03 1.998e+03 1.999e+03]");
  CHECK(to_string(generate<float>(Shape{64, 784}, [](index_t i) { return static_cast<float>(i % 784) / 784.f; })) ==
        R"([[0.         0.00127551 0.00255102 ... 0.99617344 0.997449   0.99872446]
 [0.         0.00127551 0.00255102 ... 0.99617344 0.997449   0.99872446]
 [0.         0.00127551 0.00255102 ... 0.99617344 0.997449   0.99872446]
 ...
 [0.         0.00127551 0.00255102 ... 0.99617344 0.997449   0.99872446]
 [0.         0.00127551 0.00255102 ... 0.99617344 0.997449   0.99872446]
 [0.         0.00127551 0.00255102 ... 0.99617344 0.997449   0.99872446]])");
  CHECK(to_string(
            generate<std::int32_t>(Shape{4, 300}, [](index_t i) { return static_cast<std::int32_t>(i * 3 - 600); })) ==
        R"([[-600 -597 -594 ...  291  294  297]
 [ 300  303  306 ... 1191 1194 1197]
 [1200 1203 1206 ... 2091 2094 2097]
 [2100 2103 2106 ... 2991 2994 2997]])");
  CHECK(to_string(generate<float>(Shape{10, 10, 20}, [](index_t i) { return static_cast<float>(i % 97) * 0.25f; })) ==
        R"([[[ 0.    0.25  0.5  ...  4.25  4.5   4.75]
  [ 5.    5.25  5.5  ...  9.25  9.5   9.75]
  [10.   10.25 10.5  ... 14.25 14.5  14.75]
  ...
  [10.75 11.   11.25 ... 15.   15.25 15.5 ]
  [15.75 16.   16.25 ... 20.   20.25 20.5 ]
  [20.75 21.   21.25 ...  0.75  1.    1.25]]

 [[ 1.5   1.75  2.   ...  5.75  6.    6.25]
  [ 6.5   6.75  7.   ... 10.75 11.   11.25]
  [11.5  11.75 12.   ... 15.75 16.   16.25]
  ...
  [12.25 12.5  12.75 ... 16.5  16.75 17.  ]
  [17.25 17.5  17.75 ... 21.5  21.75 22.  ]
  [22.25 22.5  22.75 ...  2.25  2.5   2.75]]

 [[ 3.    3.25  3.5  ...  7.25  7.5   7.75]
  [ 8.    8.25  8.5  ... 12.25 12.5  12.75]
  [13.   13.25 13.5  ... 17.25 17.5  17.75]
  ...
  [13.75 14.   14.25 ... 18.   18.25 18.5 ]
  [18.75 19.   19.25 ... 23.   23.25 23.5 ]
  [23.75 24.    0.   ...  3.75  4.    4.25]]

 ...

 [[10.5  10.75 11.   ... 14.75 15.   15.25]
  [15.5  15.75 16.   ... 19.75 20.   20.25]
  [20.5  20.75 21.   ...  0.5   0.75  1.  ]
  ...
  [21.25 21.5  21.75 ...  1.25  1.5   1.75]
  [ 2.    2.25  2.5  ...  6.25  6.5   6.75]
  [ 7.    7.25  7.5  ... 11.25 11.5  11.75]]

 [[12.   12.25 12.5  ... 16.25 16.5  16.75]
  [17.   17.25 17.5  ... 21.25 21.5  21.75]
  [22.   22.25 22.5  ...  2.    2.25  2.5 ]
  ...
  [22.75 23.   23.25 ...  2.75  3.    3.25]
  [ 3.5   3.75  4.   ...  7.75  8.    8.25]
  [ 8.5   8.75  9.   ... 12.75 13.   13.25]]

 [[13.5  13.75 14.   ... 17.75 18.   18.25]
  [18.5  18.75 19.   ... 22.75 23.   23.25]
  [23.5  23.75 24.   ...  3.5   3.75  4.  ]
  ...
  [ 0.    0.25  0.5  ...  4.25  4.5   4.75]
  [ 5.    5.25  5.5  ...  9.25  9.5   9.75]
  [10.   10.25 10.5  ... 14.25 14.5  14.75]]])");
  CHECK(to_string(generate<float>(Shape{1001}, [](index_t i) {
          return i == 500 ? 1e9f : static_cast<float>(i % 5);
        })) == "[0. 1. 2. ... 3. 4. 0.]");
  CHECK(to_string(
            generate<std::uint8_t>(Shape{3, 7, 50}, [](index_t i) { return static_cast<std::uint8_t>(i % 256); })) ==
        R"([[[  0   1   2 ...  47  48  49]
  [ 50  51  52 ...  97  98  99]
  [100 101 102 ... 147 148 149]
  ...
  [200 201 202 ... 247 248 249]
  [250 251 252 ...  41  42  43]
  [ 44  45  46 ...  91  92  93]]

 [[ 94  95  96 ... 141 142 143]
  [144 145 146 ... 191 192 193]
  [194 195 196 ... 241 242 243]
  ...
  [ 38  39  40 ...  85  86  87]
  [ 88  89  90 ... 135 136 137]
  [138 139 140 ... 185 186 187]]

 [[188 189 190 ... 235 236 237]
  [238 239 240 ...  29  30  31]
  [ 32  33  34 ...  79  80  81]
  ...
  [132 133 134 ... 179 180 181]
  [182 183 184 ... 229 230 231]
  [232 233 234 ...  23  24  25]]])");
}

TEST_CASE("print: integer tensors") {
  CHECK(to_string(BasicTensor<std::int32_t>(Shape{3}, {-5, 120, 7})) == "[ -5 120   7]");
  CHECK(to_string(BasicTensor<std::int32_t>(Shape{2, 2}, {1, -1, 10, 0})) ==
        R"([[ 1 -1]
 [10  0]])");
  CHECK(to_string(BasicTensor<std::uint8_t>(Shape{4}, {0, 255, 7, 42})) == "[  0 255   7  42]");
  CHECK(to_string(BasicTensor<std::int64_t>(Shape{2}, {1234567890123, -1})) == "[1234567890123            -1]");
  CHECK(to_string(BasicTensor<std::int64_t>(Shape{1}, {std::numeric_limits<std::int64_t>::min()})) ==
        "[-9223372036854775808]");
}

TEST_CASE("print: 0-d tensors print as scalars") {
  CHECK(to_string(Tensor(Shape{}, {2.5f})) == "2.5");
  CHECK(to_string(Tensor(Shape{}, {1.f})) == "1.0");
  CHECK(to_string(Tensor(Shape{}, {-0.f})) == "-0.0");
  CHECK(to_string(Tensor(Shape{}, {0.1f})) == "0.1");
  CHECK(to_string(Tensor(Shape{}, {1e16f})) == "1e+16");
  CHECK(to_string(Tensor(Shape{}, {1e-4f})) == "1e-04");
  CHECK(to_string(Tensor(Shape{}, {123456789012345.6f})) == "123456790000000.0");
  CHECK(to_string(Tensor(Shape{}, {fnan})) == "nan");
  CHECK(to_string(Tensor(Shape{}, {-finf})) == "-inf");
  CHECK(to_string(BasicTensor<double>(Shape{}, {1.5e-5})) == "1.5e-05");
  CHECK(to_string(BasicTensor<double>(Shape{}, {123456789012345.6})) == "123456789012345.6");
  CHECK(to_string(BasicTensor<std::int32_t>(Shape{}, {-7})) == "-7");
  CHECK(to_string(BasicTensor<std::uint8_t>(Shape{}, {200})) == "200");
}

TEST_CASE("print: empty tensors") {
  CHECK(to_string(Tensor(Shape{0})) == "[]");
  CHECK(to_string(Tensor(Shape{2, 0})) == "[]");
  CHECK(to_string(BasicTensor<std::int32_t>(Shape{0, 3})) == "[]");
}

TEST_CASE("print: a batch of 64 x 10 logits is printed in full") {
  // 640 elements, under numpy's threshold of 1000. In numpy:
  //   (np.array([(i * 7919 + 13) % 2001 - 1000 for i in range(640)], np.float32)
  //    * np.float32(0.00137)).reshape(64, 10)
  const Tensor logits = generate<float>(
      Shape{64, 10}, [](index_t i) { return static_cast<float>((i * 7919 + 13) % 2001 - 1000) * 0.00137f; });
  CHECK(to_string(logits) ==
        R"([[-1.3521899   1.27273     1.1562799   1.03983     0.92337996  0.80692995
   0.69048     0.57403     0.45757997  0.34113   ]
 [ 0.22467999  0.10822999 -0.00822    -0.12467    -0.24112    -0.35757
  -0.47401997 -0.59046996 -0.70691997 -0.82337   ]
 [-0.93982    -1.05627    -1.17272    -1.2891699   1.33575     1.2192999
   1.10285     0.98639995  0.86995     0.7535    ]
 [ 0.63705     0.52059996  0.40414998  0.2877      0.17125     0.0548
  -0.06165    -0.17809999 -0.29455    -0.41099998]
 [-0.52744997 -0.6439     -0.76035    -0.87679994 -0.99324995 -1.1097
  -1.2261499  -1.3426      1.2823199   1.16587   ]
 [ 1.04942     0.93297     0.81652     0.70006996  0.58361995  0.46716997
   0.35072     0.23426999  0.11781999  0.00137   ]
 [-0.11508    -0.23153    -0.34798    -0.46442997 -0.58088    -0.69733
  -0.81377995 -0.93022996 -1.04668    -1.1631299 ]
 [-1.27958     1.34534     1.22889     1.11244     0.99599     0.87953997
   0.76308995  0.64664     0.53019     0.41373998]
 [ 0.29729     0.18084     0.06439    -0.05206    -0.16850999 -0.28496
  -0.40140998 -0.51786    -0.63431    -0.75075996]
 [-0.86721    -0.98366    -1.1001099  -1.21656    -1.33301     1.2919099
   1.17546     1.0590099   0.94255996  0.82610995]
 [ 0.70966     0.59321     0.47675997  0.36031     0.24385999  0.12741
   0.01096    -0.10549    -0.22194    -0.33839   ]
 [-0.45483997 -0.57128996 -0.68773997 -0.80419    -0.92064    -1.03709
  -1.15354    -1.26999     1.3549299   1.23848   ]
 [ 1.12203     1.00558     0.88913     0.77268     0.65623     0.53977996
   0.42332998  0.30688     0.19043     0.07398   ]
 [-0.04247    -0.15891999 -0.27537    -0.39181998 -0.50826997 -0.62472
  -0.74117    -0.85762    -0.97406995 -1.0905199 ]
 [-1.20697    -1.3234199   1.3015      1.18505     1.0685999   0.95215
   0.8357      0.71924996  0.60279995  0.48634997]
 [ 0.3699      0.25345     0.137       0.02055    -0.0959     -0.21235
  -0.3288     -0.44524997 -0.5617     -0.67815   ]
 [-0.79459995 -0.91104996 -1.0274999  -1.14395    -1.2603999   1.36452
   1.24807     1.1316199   1.01517     0.89871997]
 [ 0.78226995  0.66582     0.54937     0.43291998  0.31647     0.20002
   0.08357    -0.03288    -0.14932999 -0.26578   ]
 [-0.38222998 -0.49868    -0.61513    -0.73157996 -0.84803    -0.96448
  -1.08093    -1.19738    -1.3138299   1.31109   ]
 [ 1.1946399   1.07819     0.96173996  0.84528995  0.72884     0.61239
   0.49593997  0.37949     0.26304     0.14659   ]
 [ 0.03014    -0.08631    -0.20276    -0.31921    -0.43565997 -0.55210996
  -0.66855997 -0.78501    -0.90146    -1.01791   ]
 [-1.13436    -1.2508099  -1.36726     1.2576599   1.14121     1.02476
   0.90831     0.79186     0.67541     0.55895996]
 [ 0.44250998  0.32606     0.20961     0.09316    -0.02329    -0.13973999
  -0.25619    -0.37263998 -0.48909    -0.60554   ]
 [-0.72199    -0.83844    -0.95488995 -1.07134    -1.1877899  -1.30424
   1.3206799   1.20423     1.08778     0.97133   ]
 [ 0.85488     0.73842996  0.62197995  0.50553     0.38908     0.27262998
   0.15618     0.03973    -0.07672    -0.19317   ]
 [-0.30962    -0.42606997 -0.54252    -0.65897    -0.77541995 -0.89186996
  -1.00832    -1.1247699  -1.24122    -1.35767   ]
 [ 1.26725     1.1508      1.0343499   0.91789997  0.80144995  0.685
   0.56855     0.45209998  0.33565     0.21919999]
 [ 0.10275    -0.0137     -0.13014999 -0.24659999 -0.36304998 -0.4795
  -0.59595    -0.71239996 -0.82885    -0.9453    ]
 [-1.0617499  -1.1782     -1.29465     1.3302699   1.21382     1.0973699
   0.98091996  0.86446995  0.74802     0.63157   ]
 [ 0.51511997  0.39867     0.28221998  0.16577     0.04932    -0.06713
  -0.18358    -0.30003    -0.41647997 -0.53292996]
 [-0.64937997 -0.76583    -0.88228    -0.99872994 -1.11518    -1.23163
  -1.3480799   1.27684     1.16039     1.04394   ]
 [ 0.92749     0.81104     0.69459     0.57813996  0.46168998  0.34524
   0.22878999  0.11234    -0.00411    -0.12056   ]
 [-0.23700999 -0.35345998 -0.46991    -0.58636    -0.70281    -0.81926
  -0.93570995 -1.05216    -1.16861    -1.2850599 ]
 [ 1.33986     1.22341     1.1069599   0.99051     0.87406     0.75760996
   0.64115995  0.52471     0.40826     0.29180998]
 [ 0.17536     0.05891    -0.05754    -0.17399    -0.29044    -0.40688998
  -0.52334    -0.63979    -0.75623995 -0.87268996]
 [-0.98914    -1.10559    -1.2220399  -1.33849     1.28643     1.1699799
   1.05353     0.93707997  0.82062995  0.70418   ]
 [ 0.58773     0.47127998  0.35483     0.23837999  0.12193     0.00548
  -0.11097    -0.22741999 -0.34386998 -0.46032   ]
 [-0.57677    -0.69321996 -0.80967    -0.92612    -1.04257    -1.15902
  -1.2754699   1.34945     1.2329999   1.11655   ]
 [ 1.0001      0.88364995  0.7672      0.65075     0.53429997  0.41785
   0.30139998  0.18495     0.0685     -0.04795   ]
 [-0.1644     -0.28085    -0.39729998 -0.51374996 -0.63019997 -0.74665
  -0.8631     -0.97954994 -1.096      -1.2124499 ]
 [-1.3289      1.2960199   1.17957     1.06312     0.94667     0.83022
   0.71377     0.59731996  0.48086998  0.36442   ]
 [ 0.24796999  0.13152     0.01507    -0.10138    -0.21782999 -0.33427998
  -0.45073    -0.56718    -0.68363    -0.80008   ]
 [-0.91652995 -1.03298    -1.1494299  -1.26588     1.3590399   1.24259
   1.12614     1.0096899   0.89324     0.77678996]
 [ 0.66033995  0.54389     0.42744     0.31098998  0.19454     0.07809
  -0.03836    -0.15481    -0.27126    -0.38770998]
 [-0.50416    -0.62061    -0.73705995 -0.85350996 -0.96996    -1.0864099
  -1.20286    -1.31931     1.30561     1.18916   ]
 [ 1.0727099   0.95625997  0.83980995  0.72336     0.60691     0.49045998
   0.37401     0.25755998  0.14110999  0.02466   ]
 [-0.09179    -0.20823999 -0.32468998 -0.44114    -0.55759    -0.67403996
  -0.79049    -0.90694    -1.0233899  -1.13984   ]
 [-1.25629     1.3686299   1.25218     1.1357299   1.01928     0.90282995
   0.78638     0.66993     0.55347997  0.43703   ]
 [ 0.32057998  0.20413     0.08768    -0.02877    -0.14522    -0.26167
  -0.37811998 -0.49457    -0.61101997 -0.72747   ]
 [-0.84392    -0.96036994 -1.07682    -1.19327    -1.3097199   1.3152
   1.19875     1.0823      0.96585     0.8494    ]
 [ 0.73295     0.61649996  0.50005     0.3836      0.26714998  0.15069999
   0.03425    -0.0822     -0.19864999 -0.31509998]
 [-0.43155    -0.548      -0.66445    -0.7809     -0.89734995 -1.0138
  -1.13025    -1.2466999  -1.36315     1.26177   ]
 [ 1.1453199   1.02887     0.91242     0.79596996  0.67951995  0.56307
   0.44662     0.33016998  0.21372     0.09727   ]
 [-0.01918    -0.13563    -0.25208    -0.36852998 -0.48498    -0.60143
  -0.71787995 -0.83432996 -0.95078    -1.06723   ]
 [-1.1836799  -1.30013     1.32479     1.2083399   1.09189     0.97543997
   0.85898995  0.74254     0.62609     0.50964   ]
 [ 0.39319     0.27673998  0.16028999  0.04384    -0.07261    -0.18905999
  -0.30550998 -0.42196    -0.53841    -0.65485996]
 [-0.77131    -0.88776    -1.00421    -1.12066    -1.2371099  -1.35356
   1.2713599   1.15491     1.03846     0.92200994]
 [ 0.80556     0.68911     0.57265997  0.45621     0.33975998  0.22331
   0.10686    -0.00959    -0.12604    -0.24249   ]
 [-0.35893998 -0.47539    -0.59183997 -0.70829    -0.82474    -0.94118994
  -1.05764    -1.1740899  -1.29054     1.3343799 ]
 [ 1.21793     1.10148     0.98503     0.86858     0.75213     0.63567996
   0.51923     0.40278     0.28632998  0.16987999]
 [ 0.05343    -0.06302    -0.17946999 -0.29591998 -0.41237    -0.52882
  -0.64527    -0.76172    -0.87816995 -0.99461997]
 [-1.1110699  -1.22752    -1.34397     1.28095     1.1645      1.0480499
   0.9316      0.81514996  0.69869995  0.58225   ]
 [ 0.4658      0.34934998  0.2329      0.11645     0.         -0.11645
  -0.2329     -0.34934998 -0.4658     -0.58225   ]
 [-0.69869995 -0.81514996 -0.9316     -1.0480499  -1.1645     -1.28095
   1.34397     1.22752     1.1110699   0.99461997]])");
}

TEST_CASE("print: operator<< and static tensors") {
  const Tensor t(Shape{2, 2}, {1.f, 2.5f, -3.f, 4.f});
  std::ostringstream os;
  os << t;
  CHECK(os.str() == "[[ 1.   2.5]\n [-3.   4. ]]");

  const StaticTensor<float, 2, 2> s(t);
  CHECK(to_string(s) == "[[ 1.   2.5]\n [-3.   4. ]]");
  std::ostringstream ss;
  ss << s << ' ' << zeros<std::int32_t>(shape<3>);
  CHECK(ss.str() == "[[ 1.   2.5]\n [-3.   4. ]] [0 0 0]");
}

namespace {
// The seed network's shape, with its hidden activation recorded.
struct Recorded : nn::Cell<Recorded> {
  nn::Dense<4, 3> fc1;
  nn::ReLU relu;
  nn::Dense<3, 2> fc2;
  DUET_CELL_MEMBERS(fc1, relu, fc2);
  auto construct(auto x) { return fc2(record_value(relu(fc1(x)), "hidden")); }
};
}  // namespace

TEST_CASE("record_value: a graph's intermediate value, read after the call, the same in both modes") {
  const Mode saved = get_context().mode;
  Recorded net;
  const Tensor x = randn({5, 4}, 3);
  const Tensor hidden = net.relu(net.fc1(x));
  std::vector<std::vector<float>> seen;
  for (const Mode mode : {PYNATIVE_MODE, GRAPH_MODE}) {
    set_context({.mode = mode});
    {
      const Tensor no_recorder = net(x);  // nothing is kept, nothing fails
      CHECK(no_recorder.shape() == Shape{5, 2});
    }
    ValueRecorder recorder;
    const Tensor y = net(x);
    REQUIRE(recorder.contains("hidden"));
    CHECK(recorder.tags() == std::vector<std::string>{"hidden"});
    const Tensor& h = recorder.get("hidden");
    CHECK(h.shape() == Shape{5, 3});
    seen.emplace_back(h.data(), h.data() + h.numel());
    CHECK(std::equal(h.data(), h.data() + h.numel(), hidden.data()));
    CHECK_THROWS_WITH_AS(recorder.get("output"),
                         "duet::ValueRecorder: no value was recorded under 'output' (recorded: 'hidden')", ValueError);
    CHECK_THROWS_WITH_AS(recorder.get<double>("hidden"),
                         "duet::ValueRecorder: 'hidden' holds Float32 values, asked for Float64", ValueError);
  }
  set_context({.mode = saved});
  // In a jitted function, at O2, and in a PIJit trace's replay.
  for (int call = 0; call < 2; ++call) {
    ValueRecorder recorder;
    auto o2 = jit<JitConfig{.jit_level = O2}>([&](auto v) { return record_value(net.fc1(v) * 2.0f, "scaled"); });
    o2(x);
    const Tensor expected = net.fc1(x) * 2.0f;
    CHECK(std::equal(expected.data(), expected.data() + expected.numel(), recorder.get("scaled").data()));
  }
  auto traced = jit([&](const Tensor& v) { return record_value(net.fc1(v), "traced"); }, {.mode = JitMode::PIJit});
  traced(x);  // the trace
  ValueRecorder recorder;
  traced(x);  // a replay
  const Tensor expected = net.fc1(x);
  REQUIRE(recorder.contains("traced"));
  CHECK(std::equal(expected.data(), expected.data() + expected.numel(), recorder.get("traced").data()));
}

}  // namespace tests_print
