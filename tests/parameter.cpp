// Parameter::derived keeps a form computed from the values until they may have changed.
// (set_data: tests/cell.cpp.)
#include "support.hpp"

#include <string>
#include <utility>
#include <vector>

namespace tests_parameter {

using namespace duet;

namespace {

// A derived form that records the values it was made from.
struct Sum {
  float total = 0;
};

Sum sum_of(const nn::Parameter& p) {
  Sum s;
  for (float v : std::as_const(p).values()) s.total += v;
  return s;
}

}  // namespace

TEST_CASE("Parameter::derived is made once, and again after any write to the values") {
  nn::Parameter p(ones({2, 2}));
  int makes = 0;
  const auto make = [&] {
    ++makes;
    return sum_of(p);
  };
  const auto first = p.derived<Sum>(make);
  CHECK(first->total == 4.0f);
  CHECK(p.derived<Sum>(make) == first);
  CHECK(makes == 1);

  p.set_data(full({2, 2}, 2.0f));
  CHECK(p.derived<Sum>(make)->total == 8.0f);
  CHECK(first->total == 4.0f);  // a form handed out stays as it was

  Tensor alias = p;  // shares the elements
  alias(0, 0) = 12.0f;
  CHECK(p.derived<Sum>(make)->total == 18.0f);

  p = nn::Parameter(zeros({2, 2}));
  CHECK(p.derived<Sum>(make)->total == 0.0f);
  CHECK(makes == 4);
  CHECK(p.derived<Sum>(make)->total == 0.0f);
  CHECK(makes == 4);
}

TEST_CASE("Parameter::derived: a form of another type replaces the one kept") {
  nn::Parameter p(ones({3}));
  CHECK(p.derived<Sum>([&] { return sum_of(p); })->total == 3.0f);
  CHECK(*p.derived<std::string>([] { return std::string("packed"); }) == "packed");
  CHECK(p.derived<Sum>([&] { return sum_of(p); })->total == 3.0f);
}

}  // namespace tests_parameter
