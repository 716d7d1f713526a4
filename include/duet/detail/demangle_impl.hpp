// The definitions of detail/demangle.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::detail {

DUET_DETAIL_COMPILED std::string spell_enum_arguments(std::string name) {
  const auto spelled = [](auto value, std::string_view cast, std::string spelling) {
    return std::pair{std::string(cast) + std::to_string(static_cast<int>(value)), std::move(spelling)};
  };
  const std::pair<std::string, std::string> spellings[] = {
      spelled(Mode::graph, "(Mode)", "GRAPH_MODE"),
      spelled(Mode::pynative, "(Mode)", "PYNATIVE_MODE"),
      spelled(Mode::context, "(Mode)", "CONTEXT_MODE"),
      spelled(nn::PadMode::same, "(nn::PadMode)", "nn::PadMode::same"),
      spelled(nn::PadMode::valid, "(nn::PadMode)", "nn::PadMode::valid"),
      spelled(nn::PadMode::pad, "(nn::PadMode)", "nn::PadMode::pad"),
      spelled(Reduction::none, "(Reduction)", "Reduction::none"),
      spelled(Reduction::mean, "(Reduction)", "Reduction::mean"),
      spelled(Reduction::sum, "(Reduction)", "Reduction::sum"),
      spelled(Reduction::batchmean, "(Reduction)", "Reduction::batchmean"),
  };
  for (const auto& [cast, spelling] : spellings) {
    for (std::size_t at; (at = name.find(cast)) != std::string::npos;) name.replace(at, cast.size(), spelling);
  }
  return name;
}

DUET_DETAIL_COMPILED std::string readable_type_name(const std::type_info& type) {
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
  return spell_enum_arguments(std::move(out));
}

}  // namespace duet::detail
