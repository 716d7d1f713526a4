// Printing tensors: `std::cout << t` and duet::to_string(t) give exactly what numpy 1.24's
// str(array) gives with the default print options, which is how MindSpore prints tensors.
//
// The code follows numpy/core/arrayprint.py (array2string, _formatArray, FloatingFormat,
// IntegerFormat); the names below refer to it. numpy's Dragon4 prints the shortest decimal that
// reads back as the same value, as std::to_chars does, and rounds the exact binary value to
// nearest, ties to even, when a precision cuts it short, as std::to_chars does too.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "config.hpp"
#include "dtype.hpp"
#include "shape.hpp"
#include "tensor.hpp"

namespace duet {

namespace detail {

// numpy's default print options.
inline constexpr std::size_t print_line_width = 75;
inline constexpr index_t print_threshold = 1000;  // more elements than this are summarised
inline constexpr index_t print_edge_items = 3;    // kept at each end of a summarised axis
inline constexpr int print_precision = 8;         // most digits after the point

// Stands for the "..." of a summarised axis where an index would be.
inline constexpr index_t print_ellipsis = -1;

// Calls fn with the indices along an axis of length n that are printed, in order, and with
// print_ellipsis where the middle ones are left out.
template <class Fn>
void for_each_printed(index_t n, bool summarise, Fn&& fn) {
  const bool gap = summarise && n > 2 * print_edge_items;
  for (index_t i = 0; i < n; ++i) {
    if (gap && i == print_edge_items) {
      fn(print_ellipsis);
      i = n - print_edge_items;
    }
    fn(i);
  }
}

// The printed elements in order: numpy computes the format from these alone (_leading_trailing).
template <class T>
void collect_printed(const T* data, const Shape& shape, int axis, bool summarise, std::vector<T>& out) {
  if (axis == shape.rank()) {
    out.push_back(*data);
    return;
  }
  const index_t stride = shape.numel_from(axis + 1);
  for_each_printed(shape[axis], summarise, [&](index_t i) {
    if (i != print_ellipsis) collect_printed(data + i * stride, shape, axis + 1, summarise, out);
  });
}

template <class... Args>
std::string chars_of(Args... args) {
  char buf[400];  // fits any double, even in fixed notation with print_precision decimals
  const auto result = std::to_chars(buf, buf + sizeof buf, args...);
  return std::string(buf, result.ptr);
}

inline std::string integer_str(std::int64_t x) { return chars_of(x); }

// A finite float in scientific notation: sign, significant digits and the exponent of the first
// digit. The shortest that reads back (precision < 0), or rounded to 1 + precision digits.
struct Decimal {
  bool negative = false;
  std::string digits;
  int exponent = 0;
};

template <class F>
Decimal decimal_of(F x, int precision = -1) {
  const std::string s = precision < 0 ? chars_of(x, std::chars_format::scientific)
                                      : chars_of(x, std::chars_format::scientific, precision);
  Decimal d;
  std::size_t i = 0;
  if (s[i] == '-') {
    d.negative = true;
    ++i;
  }
  for (; s[i] != 'e'; ++i) {
    if (s[i] != '.') d.digits += s[i];
  }
  ++i;
  if (s[i] == '+') ++i;  // from_chars rejects a leading '+'
  std::from_chars(s.data() + i, s.data() + s.size(), d.exponent);
  return d;
}

inline void trim_trailing_zeros(std::string& s, std::size_t keep) {
  while (s.size() > keep && s.back() == '0') s.pop_back();
}

// What numpy's Dragon4 writes either side of the point; the sign goes with the integer part.
struct FloatParts {
  std::string int_part;
  std::string frac_part;
  int exponent = 0;  // scientific notation only
};

// x rounded to `precision` digits after the point, trailing zeros dropped.
template <class F>
FloatParts fixed_parts(F x, int precision) {
  const std::string s = chars_of(x, std::chars_format::fixed, precision);
  const std::size_t point = s.find('.');
  FloatParts p;
  p.int_part = s.substr(0, point);
  if (point != std::string::npos) p.frac_part = s.substr(point + 1);
  trim_trailing_zeros(p.frac_part, 0);
  return p;
}

// dragon4_positional(x, precision, min_digits, unique=True, fractional=True, trim='.'), where
// precision < 0 means none and min_digits is -1 (none) or 0.
template <class F>
FloatParts positional_parts(F x, int precision, int min_digits) {
  const Decimal d = decimal_of(x);
  const int n = static_cast<int>(d.digits.size());
  const int frac_digits = n - 1 - d.exponent;
  // Past `precision`, and short of `min_digits` (as in 42598728.f, shortest 4259873e1), Dragon4
  // prints the exact digits of x, rounded.
  if (precision >= 0 && frac_digits > precision) return fixed_parts(x, precision);
  if (min_digits >= 0 && frac_digits < min_digits) return fixed_parts(x, min_digits);
  FloatParts p;
  if (d.negative) p.int_part = "-";
  if (d.exponent < 0) {
    p.int_part += '0';
    p.frac_part.assign(static_cast<std::size_t>(-d.exponent - 1), '0');
    p.frac_part += d.digits;
  } else if (d.exponent + 1 >= n) {
    p.int_part += d.digits;
    p.int_part.append(static_cast<std::size_t>(d.exponent + 1 - n), '0');
  } else {
    const auto split = static_cast<std::size_t>(d.exponent + 1);
    p.int_part += d.digits.substr(0, split);
    p.frac_part = d.digits.substr(split);
  }
  return p;
}

inline FloatParts scientific_parts(const Decimal& d) {
  FloatParts p;
  if (d.negative) p.int_part = "-";
  p.int_part += d.digits[0];
  p.frac_part = d.digits.substr(1);
  p.exponent = d.exponent;
  return p;
}

// dragon4_scientific(x, precision, unique=True, trim='.'); precision < 0 means none.
template <class F>
FloatParts scientific_parts(F x, int precision) {
  Decimal d = decimal_of(x);
  if (precision >= 0 && static_cast<int>(d.digits.size()) - 1 > precision) {
    d = decimal_of(x, precision);
    trim_trailing_zeros(d.digits, 1);
  }
  return scientific_parts(d);
}

// "e+05", "e-123": at least min_digits digits.
inline std::string exponent_str(int exponent, std::size_t min_digits) {
  std::string digits = integer_str(exponent < 0 ? -exponent : exponent);
  if (digits.size() < min_digits) digits.insert(0, min_digits - digits.size(), '0');
  return (exponent < 0 ? "e-" : "e+") + digits;
}

inline std::string pad_left(std::string s, std::size_t width) {
  if (s.size() < width) s.insert(0, width - s.size(), ' ');
  return s;
}

inline std::string pad_right(std::string s, std::size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

// str() of a numpy scalar, which is what str() of a 0-d array is.
template <class T>
std::string scalar_str(T x) {
  if constexpr (std::is_integral_v<T>) {
    return integer_str(x);
  } else {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
    const double magnitude = std::fabs(static_cast<double>(x));
    if (magnitude == 0 || (magnitude >= 1e-4 && magnitude < 1e16)) {
      const FloatParts p = positional_parts(x, -1, -1);
      return p.int_part + '.' + (p.frac_part.empty() ? "0" : p.frac_part);
    }
    const FloatParts p = scientific_parts(x, -1);
    return p.int_part + (p.frac_part.empty() ? "" : '.' + p.frac_part) + exponent_str(p.exponent, 2);
  }
}

// FloatingFormat with floatmode 'maxprec', sign '-', suppress_small off.
template <class F>
class FloatingFormat {
 public:
  explicit FloatingFormat(const std::vector<F>& data) {
    bool any_nonzero = false;
    bool any_finite = false;
    bool any_nonfinite = false;
    bool negative_inf = false;
    F max_val = 0;
    F min_val = 0;
    for (F x : data) {
      if (!std::isfinite(x)) {
        any_nonfinite = true;
        negative_inf = negative_inf || (std::isinf(x) && x < 0);
        continue;
      }
      any_finite = true;
      if (x == 0) continue;
      const F a = std::fabs(x);
      max_val = any_nonzero ? std::max(max_val, a) : a;
      min_val = any_nonzero ? std::min(min_val, a) : a;
      any_nonzero = true;
    }
    if (any_nonzero) {
      // numpy compares the limits as float64 but divides in the element type.
      const F ratio = max_val / min_val;
      exp_format_ = static_cast<double>(max_val) >= 1e8 || static_cast<double>(min_val) < 1e-4 || ratio > 1000;
    }

    if (any_finite && exp_format_) {
      std::size_t exp_digits = 0;
      for (F x : data) {
        if (!std::isfinite(x)) continue;
        const FloatParts p = scientific_parts(x, print_precision);
        pad_left_ = std::max(pad_left_, p.int_part.size());
        precision_ = std::max(precision_, p.frac_part.size());
        exp_digits = std::max(exp_digits, exponent_str(p.exponent, 2).size() - 2);  // less "e+"
      }
      exp_size_ = exp_digits;
      pad_right_ = exp_size_ + 2 + precision_;
    } else if (any_finite) {
      for (F x : data) {
        if (!std::isfinite(x)) continue;
        const FloatParts p = positional_parts(x, print_precision, -1);
        pad_left_ = std::max(pad_left_, p.int_part.size());
        pad_right_ = std::max(pad_right_, p.frac_part.size());
      }
    }

    if (any_nonfinite) {
      // Room for "nan" and "inf" (or "-inf"), right-aligned with the numbers' last column.
      const std::size_t width = negative_inf ? 4 : 3;
      if (width > pad_right_ + 1) pad_left_ = std::max(pad_left_, width - (pad_right_ + 1));
    }
  }

  std::string operator()(F x) const {
    if (std::isnan(x)) return pad_left("nan", pad_left_ + pad_right_ + 1);
    if (std::isinf(x)) return pad_left(x < 0 ? "-inf" : "inf", pad_left_ + pad_right_ + 1);
    if (exp_format_) {
      // numpy asks Dragon4 for min_digits = precision_, and it goes on past the shortest digits
      // with the exact ones: every mantissa is x rounded to precision_ digits, not zero-padded.
      const FloatParts p = scientific_parts(decimal_of(x, static_cast<int>(precision_)));
      return pad_left(p.int_part, pad_left_) + '.' + p.frac_part + exponent_str(p.exponent, exp_size_);
    }
    // numpy asks for min_digits = 0 here, but not when measuring.
    const FloatParts p = positional_parts(x, print_precision, 0);
    return pad_left(p.int_part, pad_left_) + '.' + pad_right(p.frac_part, pad_right_);
  }

 private:
  bool exp_format_ = false;
  std::size_t pad_left_ = 0;
  std::size_t pad_right_ = 0;
  std::size_t precision_ = 0;  // digits after the point of every mantissa, in exp_format_
  std::size_t exp_size_ = 0;   // digits of every exponent, in exp_format_
};

template <class I>
class IntegerFormat {
 public:
  explicit IntegerFormat(const std::vector<I>& data) {
    const auto [lo, hi] = std::minmax_element(data.begin(), data.end());
    width_ = std::max(integer_str(*lo).size(), integer_str(*hi).size());
  }

  std::string operator()(I x) const { return pad_left(integer_str(x), width_); }

 private:
  std::size_t width_ = 0;
};

// _formatArray, writing into one string. numpy measures each line from its hanging indent; here
// from the previous newline, which gives the same columns because the '['s opening a row take
// the place of the hanging indent one for one.
template <class T, class Format>
class ArrayWriter {
 public:
  ArrayWriter(const BasicTensor<T>& t, bool summarise, const Format& format)
      : data_(t.data()), shape_(t.shape()), summarise_(summarise), format_(format) {}

  std::string run() && {
    write(0, 0, print_line_width);
    return std::move(out_);
  }

 private:
  void write(int axis, index_t offset, std::size_t width) {
    const auto indent = static_cast<std::size_t>(axis) + 1;
    const bool innermost = axis == shape_.rank() - 1;
    const index_t stride = shape_.numel_from(axis + 1);
    bool first = true;
    out_ += '[';
    for_each_printed(shape_[axis], summarise_, [&](index_t i) {
      if (innermost) {
        if (!first) out_ += ' ';
        // The last column is kept for the closing ']'.
        extend_line(i == print_ellipsis ? "..." : format_(data_[offset + i]), width - 1, indent);
      } else {
        // Sub-arrays of rank n are separated by n - 1 blank lines.
        if (!first) start_line(static_cast<std::size_t>(shape_.rank() - axis - 1), indent);
        if (i == print_ellipsis) {
          out_ += "...";
        } else {
          write(axis + 1, offset + i * stride, width - 1);
        }
      }
      first = false;
    });
    out_ += ']';
  }

  // _extendLine: wraps unless the line holds nothing but its indent, since wrapping would not help.
  void extend_line(const std::string& word, std::size_t width, std::size_t indent) {
    const std::size_t column = out_.size() - line_start_;
    if (column + word.size() > width && column > indent) {
      while (out_.back() == ' ') out_.pop_back();
      start_line(1, indent);
    }
    out_ += word;
  }

  void start_line(std::size_t newlines, std::size_t indent) {
    out_.append(newlines, '\n');
    line_start_ = out_.size();
    out_.append(indent, ' ');
  }

  const T* data_;
  const Shape& shape_;
  bool summarise_;
  const Format& format_;
  std::string out_;
  std::size_t line_start_ = 0;
};

}  // namespace detail

// As numpy's str(array): "[[1.  2.5]\n [3.  4. ]]".
template <ElementType T>
std::string to_string(const BasicTensor<T>& t) {
  if (t.ndim() == 0) return detail::scalar_str(t.data()[0]);
  if (t.numel() == 0) return "[]";
  const bool summarise = t.numel() > detail::print_threshold;
  std::vector<T> printed;
  detail::collect_printed(t.data(), t.shape(), 0, summarise, printed);
  if constexpr (std::is_floating_point_v<T>) {
    const detail::FloatingFormat<T> format(printed);
    return detail::ArrayWriter<T, detail::FloatingFormat<T>>(t, summarise, format).run();
  } else {
    const detail::IntegerFormat<T> format(printed);
    return detail::ArrayWriter<T, detail::IntegerFormat<T>>(t, summarise, format).run();
  }
}

template <ElementType T, index_t... Dims>
std::string to_string(const StaticTensor<T, Dims...>& t) {
  return to_string(t.tensor());
}

template <ElementType T>
std::ostream& operator<<(std::ostream& os, const BasicTensor<T>& t) {
  return os << to_string(t);
}

template <ElementType T, index_t... Dims>
std::ostream& operator<<(std::ostream& os, const StaticTensor<T, Dims...>& t) {
  return os << to_string(t.tensor());
}

}  // namespace duet
