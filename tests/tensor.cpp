#include <doctest/doctest.h>

#include <cstdint>
#include <duet/duet.hpp>
#include <type_traits>

namespace tests_tensor {

using duet::Shape;
using duet::Tensor;

TEST_CASE("Tensor: creation functions fill every element") {
  const Tensor z = duet::zeros({2, 3});
  const Tensor o = duet::ones({2, 3});
  const Tensor f = duet::full({4}, 2.5f);
  CHECK(z.shape() == Shape{2, 3});
  CHECK(z.numel() == 6);
  for (float v : z.values()) CHECK(v == 0.0f);
  for (float v : o.values()) CHECK(v == 1.0f);
  for (float v : f.values()) CHECK(v == 2.5f);
  CHECK(Tensor({2, 2}).values()[3] == 0.0f);
  CHECK(Tensor::dtype() == duet::float32);
  CHECK(duet::zeros<double>({1}).dtype() == duet::float64);
}

TEST_CASE("Tensor: construction from a shape and values, element access") {
  Tensor t({2, 3}, {1, 2, 3, 4, 5, 6});
  CHECK(t(0, 0) == 1);
  CHECK(t(1, 2) == 6);
  CHECK(t(-1, -1) == 6);
  t(1, 0) = 40;
  CHECK(t.data()[3] == 40);
  CHECK_THROWS_WITH_AS(Tensor({2, 2}, {1, 2, 3}), "duet::Tensor: shape [2, 2] holds 4 elements, got 3 values",
                       duet::ShapeError);
  CHECK_THROWS_WITH_AS(t(2, 0), "duet::Tensor: index 2 is out of range for axis 0 of [2, 3]", duet::IndexError);
  CHECK_THROWS_AS(t(0), duet::IndexError);
  CHECK(Tensor(Shape{}, {3.5f}).item() == 3.5f);
  CHECK_THROWS_AS(t.item(), duet::ShapeError);
}

TEST_CASE("Tensor: copies share elements, clone does not") {
  Tensor a = duet::zeros({3});
  Tensor b = a;
  b(0) = 7;
  CHECK(a(0) == 7);
  CHECK(a.shares_storage_with(b));
  Tensor c = a.clone();
  c(0) = 1;
  CHECK(a(0) == 7);
  CHECK_FALSE(a.shares_storage_with(c));
}

TEST_CASE("Tensor: version moves with every non-const access, through any handle sharing the elements") {
  Tensor a = duet::zeros({2, 3});
  const Tensor& read_only = a;
  const std::uint64_t v0 = a.version();
  (void)read_only.data();
  (void)read_only(1, 2);
  (void)read_only.values();
  CHECK(a.version() == v0);
  a.data()[0] = 1;
  const std::uint64_t v1 = a.version();
  CHECK(v1 != v0);
  Tensor copy = a;
  copy(0, 1) = 2;
  CHECK(a.version() != v1);
  const std::uint64_t v2 = a.version();
  a.reshape({3, 2}).values()[5] = 3;
  CHECK(a.version() != v2);
  const std::uint64_t v3 = a.version();
  Tensor other = a.clone();
  other(0, 0) = 4;
  CHECK(a.version() == v3);  // a clone has elements of its own
}

TEST_CASE("Tensor: reshape and operator[] are views") {
  Tensor t({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor r = t.reshape({3, -1});
  CHECK(r.shape() == Shape{3, 2});
  CHECK(r.shares_storage_with(t));
  r(2, 1) = 60;
  CHECK(t(1, 2) == 60);
  Tensor row = t[1];
  CHECK(row.shape() == Shape{3});
  CHECK(row(0) == 4);
  row(0) = 41;
  CHECK(t(1, 0) == 41);
  CHECK(t[-2](0) == 1);
  CHECK_THROWS_WITH_AS(t.reshape({4, 2}), "duet::Tensor::reshape: cannot view [2, 3] (6 elements) as [4, 2]",
                       duet::ShapeError);
  CHECK_THROWS_AS(t.reshape({-1, -1}), duet::ShapeError);
  CHECK_THROWS_AS(t[2], duet::IndexError);
}

TEST_CASE("Tensor: shapes with unknown or too many elements are rejected before allocating") {
  CHECK_THROWS_AS(Tensor(Shape{duet::dyn, 3}), duet::ShapeError);
  CHECK_THROWS_AS(Tensor(Shape{1ll << 40, 1ll << 40}), duet::ValueError);
  const Tensor empty = duet::zeros({0, 5});
  CHECK(empty.numel() == 0);
  CHECK(Tensor().numel() == 0);
}

TEST_CASE("Tensor: elements are 64-byte aligned for the kernels") {
  for (duet::index_t n : {1, 3, 100, 5000}) {
    const Tensor t = duet::zeros({n});
    CHECK(reinterpret_cast<std::uintptr_t>(t.data()) % 64 == 0);
  }
}

TEST_CASE("StaticTensor: the shape is in the type and checked on adoption") {
  auto s = duet::ones(duet::shape<2, 3>);
  static_assert(std::is_same_v<decltype(s), duet::StaticTensor<float, 2, 3>>);
  static_assert(decltype(s)::static_shape == Shape{2, 3});
  CHECK(s(1, 2) == 1.0f);
  const Tensor& dynamic = s;
  CHECK(dynamic.shape() == Shape{2, 3});
  duet::StaticTensor<float, duet::dyn, 3> batch(duet::zeros({5, 3}));
  CHECK(batch.shape() == Shape{5, 3});
  CHECK_THROWS_WITH_AS((duet::StaticTensor<float, duet::dyn, 3>(duet::zeros({5, 4}))),
                       "duet::StaticTensor[?, 3]: got a tensor of shape [5, 4]", duet::ShapeError);
}

}  // namespace tests_tensor
