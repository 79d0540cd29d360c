#pragma once
// Throughput, MFU and the per-step metrics record.
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>

namespace zb {

// Tokens per second over the last `window` steps (ZeroBand's PerfCounter): the tokens of all but
// the first recorded step divided by the time between the first and the last.
class ThroughputMeter {
 public:
  explicit ThroughputMeter(size_t window = 10) : window_(window) {}
  void record(int64_t tokens, double time_s);
  std::optional<double> tokens_per_second() const;  // needs two records
  std::optional<double> seconds_per_step() const;

 private:
  size_t window_;
  std::deque<std::pair<int64_t, double>> records_;
};

// Dense bf16 peak FLOP/s of one GPU from its name (A100 312e12; H100 SXM 989e12, PCIe 756e12,
// NVL 835e12; H200 989e12). Unknown names give nullopt.
std::optional<double> peak_flops_for_device(const std::string& device_name);

// Model FLOPs utilisation in percent: flops_per_token * tokens_per_second (all ranks) over the
// peak of all `world_size` devices.
double mfu_percent(double flops_per_token, double tokens_per_second, double peak_flops_per_device,
                   int64_t world_size);

// "1h02m03s" / "4m05s" / "12s".
std::string format_duration(double seconds);

}  // namespace zb
