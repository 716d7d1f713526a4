// Vec, lanes, load and store for the set whose vector_bytes is in scope: included once per
// set, inside its namespace (simd/arch.hpp), so no include guard.

template <class T>
using Vec = Vector<T, vector_bytes>;
template <class T>
inline constexpr int lanes = vector_bytes / static_cast<int>(sizeof(T));

template <class T>
[[gnu::always_inline]] inline Vec<T> load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
[[gnu::always_inline]] inline void store(T* p, Vec<T> v) {
  std::memcpy(p, &v, sizeof v);
}
