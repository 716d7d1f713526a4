#pragma once

#include <cstdlib>
#include <memory>
#include <string>
#include <typeinfo>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#define DUET_HAS_CXXABI 1
#endif

namespace duet::detail {

// "duet::nn::Dense<784l, 512l, float>" becomes "nn::Dense<784, 512, float>": the name a user
// wrote, for cell type names in messages and graph dumps.
inline std::string readable_type_name(const std::type_info& type) {
  std::string name = type.name();
#ifdef DUET_HAS_CXXABI
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(type.name(), nullptr, nullptr, &status),
                                                   std::free);
  if (status == 0 && demangled) name = demangled.get();
#endif
  for (std::size_t at; (at = name.find("duet::")) != std::string::npos;) name.erase(at, 6);
  // Integer template arguments of type long print with an 'l' suffix.
  std::string out;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const bool digit_before = i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9';
    const bool closes = i + 1 < name.size() && (name[i + 1] == ',' || name[i + 1] == '>');
    if (name[i] == 'l' && digit_before && closes) continue;
    out += name[i];
  }
  return out;
}

}  // namespace duet::detail
