// DUET_CELL_MEMBERS(a, b, ...): makes a cell a Boost.Hana Struct over the listed members,
// without naming the class (so it works inside class templates too). Each member becomes a
// (name, accessor) pair, which is how cells find their children and parameters by name. A
// member cell that construct calls but the list leaves out is refused at its first call.
#pragma once

#include <boost/hana/pair.hpp>
#include <boost/hana/string.hpp>
#include <boost/hana/tuple.hpp>

#define DUET_DETAIL_MEMBER(m)                                           \
  ::boost::hana::make_pair(BOOST_HANA_STRING(#m), [](auto&& self) -> decltype(auto) { \
    return (static_cast<decltype(self)&&>(self).m);                     \
  })

#define DUET_DETAIL_EXPAND(x) x
#define DUET_DETAIL_FE_1(f, a) f(a)
#define DUET_DETAIL_FE_2(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_1(f, __VA_ARGS__))
#define DUET_DETAIL_FE_3(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_2(f, __VA_ARGS__))
#define DUET_DETAIL_FE_4(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_3(f, __VA_ARGS__))
#define DUET_DETAIL_FE_5(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_4(f, __VA_ARGS__))
#define DUET_DETAIL_FE_6(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_5(f, __VA_ARGS__))
#define DUET_DETAIL_FE_7(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_6(f, __VA_ARGS__))
#define DUET_DETAIL_FE_8(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_7(f, __VA_ARGS__))
#define DUET_DETAIL_FE_9(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_8(f, __VA_ARGS__))
#define DUET_DETAIL_FE_10(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_9(f, __VA_ARGS__))
#define DUET_DETAIL_FE_11(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_10(f, __VA_ARGS__))
#define DUET_DETAIL_FE_12(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_11(f, __VA_ARGS__))
#define DUET_DETAIL_FE_13(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_12(f, __VA_ARGS__))
#define DUET_DETAIL_FE_14(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_13(f, __VA_ARGS__))
#define DUET_DETAIL_FE_15(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_14(f, __VA_ARGS__))
#define DUET_DETAIL_FE_16(f, a, ...) f(a), DUET_DETAIL_EXPAND(DUET_DETAIL_FE_15(f, __VA_ARGS__))
#define DUET_DETAIL_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, N, ...) N
#define DUET_DETAIL_FOR_EACH(f, ...)                                                                        \
  DUET_DETAIL_EXPAND(DUET_DETAIL_PICK(__VA_ARGS__, DUET_DETAIL_FE_16, DUET_DETAIL_FE_15, DUET_DETAIL_FE_14, \
                                      DUET_DETAIL_FE_13, DUET_DETAIL_FE_12, DUET_DETAIL_FE_11,              \
                                      DUET_DETAIL_FE_10, DUET_DETAIL_FE_9, DUET_DETAIL_FE_8,                \
                                      DUET_DETAIL_FE_7, DUET_DETAIL_FE_6, DUET_DETAIL_FE_5,                 \
                                      DUET_DETAIL_FE_4, DUET_DETAIL_FE_3, DUET_DETAIL_FE_2,                 \
                                      DUET_DETAIL_FE_1)(f, __VA_ARGS__))

// Up to 16 members; a cell with more groups them into sub-cells.
#define DUET_CELL_MEMBERS(...)                                                              \
  struct hana_accessors_impl {                                                              \
    static constexpr auto apply() {                                                         \
      return ::boost::hana::make_tuple(__VA_OPT__(DUET_DETAIL_FOR_EACH(DUET_DETAIL_MEMBER, __VA_ARGS__))); \
    }                                                                                       \
  }
