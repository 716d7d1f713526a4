// The CPU's name as /proc/cpuinfo gives it, for the context a benchmark prints with its table
// (a timing means something only beside the machine it was taken on).
#pragma once

#include <fstream>
#include <string>

namespace duet_bench {

inline std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

}  // namespace duet_bench
