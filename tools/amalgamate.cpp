// Builds single_include/duet/duet.hpp: include/duet/duet.hpp with every duet header it
// reaches through #include "..." inlined once, in order. The output has no timestamp, so the
// same include/ always gives the same bytes and a test can tell when it is stale.
//
//   duet_amalgamate <include/duet/duet.hpp> <output>           writes output
//   duet_amalgamate --check <include/duet/duet.hpp> <output>   exits 1 if output is stale
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

void inline_file(const fs::path& file, std::set<fs::path>& seen, std::ostringstream& out) {
  const fs::path canonical = fs::canonical(file);
  if (seen.contains(canonical)) return;
  std::ifstream in(canonical);
  if (!in) throw std::runtime_error("cannot read " + canonical.string());
  static const std::regex local_include(R"(^\s*#\s*include\s*"([^"]+)\"\s*$)");
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
      inline_file(canonical.parent_path() / m[1].str(), seen, out);
    } else if (!std::regex_match(line, pragma_once)) {
      out << line << '\n';
    }
  }
}

std::string amalgamate(const fs::path& entry) {
  std::ostringstream out;
  out << "// duet: one neural network, two modes. Single-header edition.\n"
         "// Generated from include/duet by tools/amalgamate.cpp; edit include/, then run\n"
         "// `cmake --build <build> --target single_include`.\n"
         "#pragma once\n";
  std::set<fs::path> seen;
  inline_file(entry, seen, out);
  return out.str();
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
      std::cerr << "usage: duet_amalgamate [--check] <include/duet/duet.hpp> <output>\n";
      return 2;
    }
    const fs::path entry = argv[check ? 2 : 1];
    const fs::path output = argv[check ? 3 : 2];
    const std::string text = amalgamate(entry);
    if (check) {
      if (!fs::exists(output) || read(output) != text) {
        std::cerr << output.string() << " is stale: regenerate it with `cmake --build <build> --target single_include`\n";
        return 1;
      }
      return 0;
    }
    fs::create_directories(output.parent_path());
    std::ofstream(output, std::ios::binary) << text;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "duet_amalgamate: " << e.what() << '\n';
    return 2;
  }
}
