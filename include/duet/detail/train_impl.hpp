// The definitions of train.hpp's non-template functions (DUET_DETAIL_COMPILED in config.hpp):
// included at that header's end when header-only, compiled once in duet::kernels otherwise.
#pragma once

namespace duet::train {

DUET_DETAIL_COMPILED void ProgressBar::update(index_t done, double loss, index_t examples) {
  const auto now = Clock::now();
  if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  const double seconds = std::chrono::duration<double>(now - start_).count();
  const double rate = seconds > 0 ? static_cast<double>(examples) / seconds : 0;
  const double left = done > 0 ? seconds * static_cast<double>(total_ - done) / static_cast<double>(done) : 0;
  constexpr int width = 30;
  const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
  char line[256];
  std::snprintf(line, sizeof line, "\r%s [%s%s] %5lld/%lld  loss %.4f  %6.0f ex/s  ETA %d:%02d", title_.c_str(),
                std::string(static_cast<std::size_t>(filled), '#').c_str(),
                std::string(static_cast<std::size_t>(width - filled), '.').c_str(), static_cast<long long>(done),
                static_cast<long long>(total_), loss, rate, static_cast<int>(left) / 60, static_cast<int>(left) % 60);
  out_ << line << std::flush;
}

}  // namespace duet::train
