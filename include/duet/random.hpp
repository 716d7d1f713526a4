// Seeded random numbers that are the same on every compiler and standard library.
//
// std::uniform_real_distribution and std::normal_distribution are implementation-defined, so
// duet draws its own: xoshiro256** seeded through splitmix64, uniform floats from the top
// bits, normals by Box-Muller. Both modes build their weights from this generator, which is
// why the same seed gives the same network in PyNative and graph mode.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "tensor.hpp"

namespace duet {

// Everything a Generator will draw from: its xoshiro words and a pending second normal draw.
// What a checkpoint saves of a layer's generator (Dropout's), so that training resumes with
// the masks it would have drawn.
struct GeneratorState {
  std::array<std::uint64_t, 4> words{};
  bool has_spare = false;
  double spare = 0;
  friend bool operator==(const GeneratorState&, const GeneratorState&) = default;
};

class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0) { this->seed(seed); }

  // Reseeding also drops a pending second normal draw, which belongs to the old sequence.
  void seed(std::uint64_t seed) {
    has_spare_ = false;
    for (auto& word : state_) {
      seed += 0x9E3779B97F4A7C15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      word = z ^ (z >> 31);
    }
  }

  GeneratorState state() const { return {{state_[0], state_[1], state_[2], state_[3]}, has_spare_, spare_}; }
  // All-zero words are xoshiro's one fixed point, never reached from a seed: it would draw
  // zeros for ever, so callers check (checkpoints refuse it as malformed).
  void set_state(const GeneratorState& s) {
    for (std::size_t i = 0; i < 4; ++i) state_[i] = s.words[i];
    has_spare_ = s.has_spare;
    spare_ = s.spare;
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const std::uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1), with all the precision T can hold.
  template <class T>
  T uniform01() {
    if constexpr (std::is_same_v<T, float>) {
      return static_cast<float>(next() >> 40) * 0x1.0p-24f;
    } else {
      return static_cast<T>(static_cast<double>(next() >> 11) * 0x1.0p-53);
    }
  }

  template <class T>
  T uniform(T low, T high) {
    return low + (high - low) * uniform01<T>();
  }

  // Standard normal, Box-Muller in double so float and double draws agree to float precision.
  template <class T>
  T normal() {
    if (has_spare_) {
      has_spare_ = false;
      return static_cast<T>(spare_);
    }
    double u1 = 0;
    while (u1 == 0) u1 = uniform01<double>();
    const double u2 = uniform01<double>();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return static_cast<T>(r * std::cos(2.0 * std::numbers::pi * u2));
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t state_[4]{};
  double spare_ = 0;
  bool has_spare_ = false;
};

namespace detail {
// A cell that draws from a generator of its own while it trains (Dropout). A checkpoint saved
// with an optimiser holds that generator's state, under the cell's path, and resuming from it
// restores the state: the resumed run then draws what the uninterrupted one would have.
class GeneratorOwner {
 public:
  virtual Generator& owned_generator() = 0;

 protected:
  ~GeneratorOwner() = default;
};

// A generator in a cell's tree, named "generator.<the cell's path>" ("generator" for the root):
// the name checkpoints save it under and data-parallel training broadcasts it by.
struct NamedGenerator {
  std::string name;
  Generator* generator;
};

// The generators of the cells in `cell`'s tree that own one, in its order: what checkpoints
// save and data-parallel training gives every rank from rank 0.
template <class Cell>
std::vector<NamedGenerator> named_generators(Cell& cell) {
  std::vector<NamedGenerator> out;
  for (const auto& [path, c] : cell.cells_and_names()) {
    if (auto* owner = dynamic_cast<GeneratorOwner*>(c)) {
      out.push_back({path.empty() ? "generator" : "generator." + path, &owner->owned_generator()});
    }
  }
  return out;
}

struct GlobalGenerator {
  std::mutex mutex;
  Generator generator{0};
};
inline GlobalGenerator& global_generator() {
  static GlobalGenerator g;
  return g;
}
}  // namespace detail

// Reseeds the generator that layer initialisers and the unseeded creation functions draw
// from (MindSpore's set_seed). The default seed is 0, so programs are reproducible by default.
inline void set_seed(std::uint64_t seed) {
  auto& g = detail::global_generator();
  std::lock_guard lock(g.mutex);
  g.generator.seed(seed);
}

// Runs fn(Generator&) with the global generator locked.
template <class F>
decltype(auto) with_global_generator(F&& fn) {
  auto& g = detail::global_generator();
  std::lock_guard lock(g.mutex);
  return fn(g.generator);
}

template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low, T high, Generator& gen) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (T& v : t.values()) v = gen.uniform<T>(low, high);
  return t;
}

template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape, Generator& gen) {
  auto t = BasicTensor<T>::uninitialized(shape);
  for (T& v : t.values()) v = gen.normal<T>();
  return t;
}

// Seeded: the same seed gives the same tensor, whatever else has drawn numbers.
template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low, T high, std::uint64_t seed) {
  Generator gen(seed);
  return uniform<T>(shape, low, high, gen);
}
template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape, std::uint64_t seed) {
  Generator gen(seed);
  return randn<T>(shape, gen);
}

// Unseeded: draws from the global generator (see set_seed).
template <ElementType T = float>
BasicTensor<T> uniform(const Shape& shape, T low = 0, T high = 1) {
  return with_global_generator([&](Generator& gen) { return uniform<T>(shape, low, high, gen); });
}
template <ElementType T = float>
BasicTensor<T> randn(const Shape& shape) {
  return with_global_generator([&](Generator& gen) { return randn<T>(shape, gen); });
}

}  // namespace duet
