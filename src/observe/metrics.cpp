#include "observe/metrics.h"

#include <cstdio>

namespace zb {

void ThroughputMeter::record(int64_t tokens, double time_s) {
  records_.emplace_back(tokens, time_s);
  while (records_.size() > window_) records_.pop_front();
}

std::optional<double> ThroughputMeter::tokens_per_second() const {
  if (records_.size() < 2) return std::nullopt;
  int64_t tokens = 0;
  for (size_t i = 1; i < records_.size(); ++i) tokens += records_[i].first;
  const double dt = records_.back().second - records_.front().second;
  if (dt <= 0) return std::nullopt;
  return static_cast<double>(tokens) / dt;
}

std::optional<double> ThroughputMeter::seconds_per_step() const {
  if (records_.size() < 2) return std::nullopt;
  return (records_.back().second - records_.front().second) /
         static_cast<double>(records_.size() - 1);
}

std::optional<double> peak_flops_for_device(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("A100")) return 312e12;
  if (has("H100")) {
    if (has("NVL")) return 835e12;
    if (has("PCIe")) return 756e12;
    return 989e12;  // SXM
  }
  if (has("H200")) return 989e12;
  return std::nullopt;
}

double mfu_percent(double flops_per_token, double tokens_per_second, double peak_flops_per_device,
                   int64_t world_size) {
  return 100.0 * flops_per_token * tokens_per_second /
         (peak_flops_per_device * static_cast<double>(world_size));
}

std::string format_duration(double seconds) {
  long s = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm%02lds", s / 3600, (s / 60) % 60, s % 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lds", s);
  return buf;
}

}  // namespace zb
