// Test support: the seed network, an independent naive reference, tolerant comparison.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <duet/duet.hpp>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace duet_test {

// The seed tutorial's network.
template <auto M = duet::CONTEXT_MODE>
struct SeedNetwork : duet::nn::Cell<SeedNetwork<M>, M> {
  duet::nn::Flatten flatten;
  duet::nn::SequentialCell<duet::nn::Dense<784, 512>, duet::nn::ReLU, duet::nn::Dense<512, 512>, duet::nn::ReLU,
                           duet::nn::Dense<512, 10>>
      dense_relu_sequential;
  DUET_CELL_MEMBERS(flatten, dense_relu_sequential);

  auto construct(auto x) { return dense_relu_sequential(flatten(x)); }
};

// One fully connected layer as plain data, for the reference.
struct Layer {
  std::vector<double> weight;  // [out, in], row-major
  std::vector<double> bias;    // [out]
  duet::index_t in = 0;
  duet::index_t out = 0;
  bool relu = false;
};

template <class T>
Layer layer_of(const duet::BasicTensor<T>& weight, const duet::BasicTensor<T>& bias, bool relu) {
  Layer l;
  l.out = weight.dim(0);
  l.in = weight.dim(1);
  l.weight.assign(weight.data(), weight.data() + weight.numel());
  l.bias.assign(bias.data(), bias.data() + bias.numel());
  l.relu = relu;
  return l;
}

// Plain loops in double precision: rows of x (flattened) through each layer in turn.
inline std::vector<double> reference_forward(const std::vector<double>& x, duet::index_t rows,
                                             const std::vector<Layer>& layers) {
  std::vector<double> a = x;
  for (const Layer& l : layers) {
    std::vector<double> y(static_cast<std::size_t>(rows * l.out));
    for (duet::index_t r = 0; r < rows; ++r) {
      for (duet::index_t o = 0; o < l.out; ++o) {
        double s = l.bias[static_cast<std::size_t>(o)];
        for (duet::index_t i = 0; i < l.in; ++i) {
          s += a[static_cast<std::size_t>(r * l.in + i)] * l.weight[static_cast<std::size_t>(o * l.in + i)];
        }
        y[static_cast<std::size_t>(r * l.out + o)] = l.relu ? std::max(s, 0.0) : s;
      }
    }
    a = std::move(y);
  }
  return a;
}

template <auto M>
std::vector<Layer> layers_of(SeedNetwork<M>& net) {
  auto& seq = net.dense_relu_sequential;
  return {layer_of(seq.template get<0>().weight, seq.template get<0>().bias, true),
          layer_of(seq.template get<2>().weight, seq.template get<2>().bias, true),
          layer_of(seq.template get<4>().weight, seq.template get<4>().bias, false)};
}

template <class T>
std::vector<double> values_of(const duet::BasicTensor<T>& t) {
  return std::vector<double>(t.data(), t.data() + t.numel());
}

// Marks a case whose body runs under every instruction set itself (for_each_isa, or a loop of
// its own over them): the whole-suite reruns under DUET_ISA=avx2 and baseline skip it
// (tests/CMakeLists.txt), since they would only repeat it: under the clang stage's ASan, each
// rerun took 260 s, and the GEMM's cases alone take 250 s when run one by one.
// TEST_CASE("name" * duet_test::every_isa).
inline const doctest::test_suite every_isa("every_isa");

// Runs body once under each instruction set this CPU runs (so a machine with AVX-512 tests all
// three sets of kernels in one process), then restores the set the process started with.
template <class Body>
void for_each_isa(Body&& body) {
  struct Restore {
    duet::kernels::Isa saved = duet::kernels::active_isa();
    ~Restore() { duet::kernels::set_active_isa(saved); }
  } restore;
  for (duet::kernels::Isa isa : duet::kernels::all_isas) {
    if (!duet::kernels::cpu_supports(isa)) continue;
    duet::kernels::set_active_isa(isa);
    CAPTURE(duet::kernel_isa());
    body();
  }
}

// Largest |a - b| relative to the largest |b| (at least 1): the "1e-5 relative" of the tests.
inline double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0;
  double scale = 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

using Bytes = std::vector<unsigned char>;

// A fresh directory under the system's temporary one, removed with everything in it.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static std::atomic<int> serial{0};
    path = std::filesystem::temp_directory_path() /
           ("duet_test_" + std::to_string(::getpid()) + "_" + std::to_string(serial.fetch_add(1)));
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { std::filesystem::remove_all(path); }

  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

inline Bytes read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

inline void write_file(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Every parameter's bytes, in the cell's order: what "bit-identical" compares.
template <duet::ElementType T>
Bytes parameter_bytes(duet::nn::BasicDynamicCell<T>& cell) {
  Bytes out;
  for (const auto& [name, p] : cell.parameters()) {
    const auto* b = reinterpret_cast<const unsigned char*>(p->data());
    out.insert(out.end(), b, b + p->numel() * static_cast<duet::index_t>(sizeof(T)));
  }
  return out;
}

template <class F>
std::string format_error_of(F&& f) {
  try {
    f();
  } catch (const duet::FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected a duet::FormatError, got: " << e.what());
  }
  FAIL("expected a duet::FormatError, nothing was thrown");
  return {};
}

// Restores the global mode when a test ends, whatever it set.
struct ModeGuard {
  duet::Mode saved = duet::get_context().mode;
  ~ModeGuard() { duet::set_context({.mode = saved}); }
};

}  // namespace duet_test
