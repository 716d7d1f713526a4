#include <doctest/doctest.h>

#include <duet/duet.hpp>

namespace tests_shape {

using duet::dyn;
using duet::Shape;

TEST_CASE("Shape: rank, axes from the end, element count") {
  constexpr Shape s{64, 1, 28, 28};
  static_assert(s.rank() == 4 && s[-1] == 28 && s.numel() == 64 * 28 * 28 && s.is_concrete());
  CHECK(s.numel_from(1) == 784);
  CHECK(to_string(s) == "[64, 1, 28, 28]");
  CHECK(to_string(Shape{}) == "[]");
  CHECK(Shape{}.numel() == 1);
}

TEST_CASE("Shape: dynamic dimensions and unknown leading dimensions are patterns, not sizes") {
  constexpr Shape batch{dyn, 784};
  static_assert(!batch.is_concrete() && batch.numel() == dyn && batch.numel_from(1) == 784);
  CHECK(to_string(batch) == "[?, 784]");
  Shape tail = Shape::any();
  CHECK(to_string(tail) == "[...]");
  tail.push_back(512);
  CHECK(to_string(tail) == "[..., 512]");
  CHECK(tail.numel() == dyn);
  CHECK_FALSE(tail == Shape{512});
}

TEST_CASE("Shape: invalid dimensions and axes are rejected with duet errors") {
  CHECK_THROWS_AS(Shape({2, -3}), duet::ValueError);
  CHECK_THROWS_AS(Shape({1, 2, 3, 4, 5, 6, 7, 8, 9}), duet::ValueError);
  CHECK_THROWS_WITH_AS((Shape{2, 3}[2]), "duet::Shape: axis 2 is out of range for rank 2", duet::IndexError);
  CHECK_THROWS_AS((Shape{2, 3}[-3]), duet::IndexError);
}

TEST_CASE("StaticShape carries its value in the type") {
  static_assert(duet::StaticShape<dyn, 1, 28, 28>::value == Shape{dyn, 1, 28, 28});
  constexpr Shape s = duet::shape<3, 4>;
  static_assert(s.numel() == 12);
}

}  // namespace tests_shape
