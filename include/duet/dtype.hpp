// Element types a tensor may hold, and their MindSpore names.
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace duet {

enum class DType : std::uint8_t { float32, float64, int32, int64, uint8 };

template <class T>
inline constexpr bool is_element_type_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int32_t> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::uint8_t>;

template <class T>
concept ElementType = is_element_type_v<T>;

template <ElementType T>
inline constexpr DType dtype_of = std::is_same_v<T, float>          ? DType::float32
                                  : std::is_same_v<T, double>       ? DType::float64
                                  : std::is_same_v<T, std::int32_t> ? DType::int32
                                  : std::is_same_v<T, std::int64_t> ? DType::int64
                                                                    : DType::uint8;

inline constexpr DType float32 = DType::float32;
inline constexpr DType float64 = DType::float64;
inline constexpr DType int32 = DType::int32;
inline constexpr DType int64 = DType::int64;
inline constexpr DType uint8 = DType::uint8;

constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::float32:
      return "Float32";
    case DType::float64:
      return "Float64";
    case DType::int32:
      return "Int32";
    case DType::int64:
      return "Int64";
    case DType::uint8:
      return "UInt8";
  }
  return "?";
}

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::float32:
      return 4;
    case DType::float64:
      return 8;
    case DType::int32:
      return 4;
    case DType::int64:
      return 8;
    case DType::uint8:
      return 1;
  }
  return 0;
}

}  // namespace duet
