// 64-bit FNV-1a: what ranks compare in one collective (their networks' descriptions, their first
// batches, the order their loaders cut shards from) is hashed first, the same on every rank.
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace duet::detail {

// Continues from h.
inline std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h = 14695981039346656037ull) {
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// The bytes of a value, as this machine stores them (the ranks run on one kind of machine).
template <class V>
  requires std::is_trivially_copyable_v<V>
std::uint64_t fnv1a_of(const V& value, std::uint64_t h = 14695981039346656037ull) {
  return fnv1a({reinterpret_cast<const char*>(&value), sizeof value}, h);
}

}  // namespace duet::detail
