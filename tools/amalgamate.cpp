// Builds single_include/duet: duet.hpp, include/duet/duet.hpp with every duet header it reaches
// through #include "..." inlined once, in order; and each header duet.hpp leaves out because
// its library costs every program to parse (io/safetensors.hpp and nlohmann/json), as
// #include "../duet.hpp" and what that does not hold already. The outputs have no timestamp,
// so the same include/ always gives the same bytes and a test can tell when one is stale.
//
//   duet_amalgamate <include/duet> <single_include/duet>           writes them
//   duet_amalgamate --check <include/duet> <single_include/duet>   exits 1 if one is stale
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

// Names #define'd as a quoted file name, for the headers that include a file through a macro
// (kernels/detail/per_isa.hpp: #include DUET_KERNEL_BODY).
using FileMacros = std::map<std::string, std::string>;

void inline_file(const fs::path& file, std::set<fs::path>& seen, FileMacros& macros, std::ostringstream& out) {
  const fs::path canonical = fs::canonical(file);
  if (seen.contains(canonical)) return;
  std::ifstream in(canonical);
  if (!in) throw std::runtime_error("cannot read " + canonical.string());
  static const std::regex local_include(R"(^\s*#\s*include\s*"([^"]+)\"\s*$)");
  static const std::regex macro_include(R"(^\s*#\s*include\s+([A-Za-z_]\w*)\s*$)");
  static const std::regex file_macro(R"(^\s*#\s*define\s+([A-Za-z_]\w*)\s+"([^"]+)\"\s*$)");
  static const std::regex pragma_once(R"(^\s*#\s*pragma\s+once\s*$)");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  // A header without #pragma once is inlined at every include, as the preprocessor would: the
  // kernels include their per-instruction-set body once per set (kernels/gemm.hpp).
  if (std::ranges::any_of(lines, [](const std::string& l) { return std::regex_match(l, pragma_once); })) {
    seen.insert(canonical);
  }
  for (const std::string& line : lines) {
    std::smatch m;
    if (std::regex_match(line, m, local_include)) {
      inline_file(canonical.parent_path() / m[1].str(), seen, macros, out);
    } else if (std::regex_match(line, m, macro_include)) {
      const auto name = macros.find(m[1].str());
      if (name == macros.end()) {
        throw std::runtime_error(canonical.string() + " includes " + m[1].str() + ", which names no file here");
      }
      inline_file(canonical.parent_path() / name->second, seen, macros, out);
    } else if (!std::regex_match(line, pragma_once)) {
      if (std::regex_match(line, m, file_macro)) macros[m[1].str()] = m[2].str();
      out << line << '\n';
    }
  }
}

// The headers outside duet.hpp, each generated beside it at the same relative path.
const char* const opt_in_headers[] = {"io/safetensors.hpp"};

const char* const banner =
    "// duet: one neural network, two modes. Single-header edition.\n"
    "// Generated from include/duet by tools/amalgamate.cpp; edit include/, then run\n"
    "// `cmake --build <build> --target single_include`.\n"
    "#pragma once\n";

// Each output's path relative to the output directory, and its text.
std::vector<std::pair<fs::path, std::string>> amalgamate(const fs::path& from) {
  std::vector<std::pair<fs::path, std::string>> outputs;
  std::set<fs::path> in_duet;
  FileMacros macros;
  std::ostringstream duet;
  duet << banner;
  inline_file(from / "duet.hpp", in_duet, macros, duet);
  outputs.emplace_back("duet.hpp", duet.str());
  for (const fs::path header : opt_in_headers) {
    std::set<fs::path> seen = in_duet;
    std::ostringstream out;
    out << banner << "#include \"" << fs::path("duet.hpp").lexically_relative(header.parent_path()).generic_string()
        << "\"\n";
    FileMacros header_macros = macros;
    inline_file(from / header, seen, header_macros, out);
    outputs.emplace_back(header, out.str());
  }
  return outputs;
}

std::string read(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bool check = argc == 4 && std::string(argv[1]) == "--check";
    if (argc != 3 && !check) {
      std::cerr << "usage: duet_amalgamate [--check] <include/duet> <single_include/duet>\n";
      return 2;
    }
    const fs::path from = argv[check ? 2 : 1];
    const fs::path to = argv[check ? 3 : 2];
    int stale = 0;
    for (const auto& [name, text] : amalgamate(from)) {
      const fs::path output = to / name;
      if (check) {
        if (!fs::exists(output) || read(output) != text) {
          std::cerr << output.string() << " is stale: regenerate it with `cmake --build <build> --target single_include`\n";
          stale = 1;
        }
        continue;
      }
      fs::create_directories(output.parent_path());
      std::ofstream(output, std::ios::binary) << text;
    }
    return stale;
  } catch (const std::exception& e) {
    std::cerr << "duet_amalgamate: " << e.what() << '\n';
    return 2;
  }
}
