#include <doctest/doctest.h>

#include <duet/duet.hpp>

namespace tests_context {

TEST_CASE("the context starts in PyNative mode and set_context changes only what it names") {
  CHECK(duet::get_context().mode == duet::PYNATIVE_MODE);
  duet::set_context({.mode = duet::GRAPH_MODE});
  CHECK(duet::get_context().mode == duet::GRAPH_MODE);
  duet::set_context({});
  CHECK(duet::get_context().mode == duet::GRAPH_MODE);
  CHECK(duet::effective_mode(duet::CONTEXT_MODE) == duet::GRAPH_MODE);
  CHECK(duet::effective_mode(duet::PYNATIVE_MODE) == duet::PYNATIVE_MODE);
  duet::set_context({.mode = duet::PYNATIVE_MODE});
  CHECK(duet::effective_mode(duet::CONTEXT_MODE) == duet::PYNATIVE_MODE);
}

TEST_CASE("CONTEXT_MODE is not a mode the context can be set to") {
  CHECK_THROWS_AS(duet::set_context({.mode = duet::CONTEXT_MODE}), duet::ValueError);
}

TEST_CASE("inside an eager call, cells that follow the context run eagerly whatever the global mode") {
  duet::set_context({.mode = duet::GRAPH_MODE});
  {
    duet::EagerScope scope;
    CHECK(duet::effective_mode(duet::CONTEXT_MODE) == duet::PYNATIVE_MODE);
    CHECK(duet::effective_mode(duet::GRAPH_MODE) == duet::GRAPH_MODE);
  }
  CHECK(duet::effective_mode(duet::CONTEXT_MODE) == duet::GRAPH_MODE);
  duet::set_context({.mode = duet::PYNATIVE_MODE});
}

}  // namespace tests_context
