#pragma once
// The run's record of each step: one JSON line in the metrics file and, every logging.interval
// steps, one console line (rank 0 only). Throughput is measured over the last 10 steps; MFU needs
// the device's peak (runtime.peak_flops, or known GPUs).
#include <c10/core/Device.h>

#include <chrono>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "dist/comm.h"
#include "model/model_args.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace zb {

class MetricsLogger {
 public:
  // Opens the metrics file on rank 0 (logging.metrics_file, by default
  // outputs/<model>-<time>/metrics.jsonl), appending to it when the run `resumed` (records of
  // steps repeated after a resume come later in the file: the last record of a step is the one
  // that counts); the clock starts here.
  MetricsLogger(const Config& config, const ModelArgs& args, int64_t rank, int64_t world_size,
                c10::Device device, bool resumed);

  // Records a step: `comm` is what the collectives moved and waited during it (all of them), and
  // `by_group` the part of it in each named group of ranks (hybrid sharding's; may be empty).
  void log_step(const StepStats& step, const CommStats& comm, std::optional<double> val_loss,
                const std::vector<std::pair<std::string, CommStats>>& by_group = {});
  // A value every record carries (the attention kernel that ran, the predicted peak memory).
  void set_constant(const std::string& key, const std::string& value) { texts_.emplace_back(key, value); }
  void set_constant(const std::string& key, int64_t value) { numbers_.emplace_back(key, value); }
  double elapsed_seconds() const;
  // The metrics file (rank 0; "" elsewhere).
  const std::string& path() const { return path_; }

 private:
  const Config& config_;
  int64_t rank_, world_size_;
  c10::Device device_;
  int64_t tokens_per_step_;
  double flops_per_token_;
  std::optional<double> peak_flops_;
  std::chrono::steady_clock::time_point start_;
  ThroughputMeter meter_{10};
  std::string path_;
  std::ofstream file_;
  std::vector<std::pair<std::string, std::string>> texts_;
  std::vector<std::pair<std::string, int64_t>> numbers_;
};

// The difference of two snapshots of a communicator's statistics.
CommStats operator-(const CommStats& after, const CommStats& before);

// 1234567 -> "1,234,567".
std::string with_commas(int64_t n);

}  // namespace zb
