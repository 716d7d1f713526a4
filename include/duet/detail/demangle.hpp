#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>
#include <utility>

#include "../backend.hpp"
#include "../config.hpp"
#include "../context.hpp"
#include "../nn/pad_mode.hpp"

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#define DUET_HAS_CXXABI 1
#endif

namespace duet::detail {

// The demangler writes an enum template argument as a cast, "(duet::Mode)0"; these are the
// spellings a user writes instead, for the enums that appear in cells' template arguments.
DUET_DETAIL_COMPILED std::string spell_enum_arguments(std::string name);

// "duet::nn::Dense<784l, 512l, float>" becomes "nn::Dense<784, 512, float>": the name a user
// wrote, for cell type names in messages and graph dumps.
DUET_DETAIL_COMPILED std::string readable_type_name(const std::type_info& type);

}  // namespace duet::detail

#ifdef DUET_DETAIL_DEFINE_COMPILED
#include "demangle_impl.hpp"
#endif
