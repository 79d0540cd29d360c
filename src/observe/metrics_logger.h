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
#include "observe/metrics.h"
#include "observe/step_stats.h"

namespace zb {

class MetricsLogger {
 public:
  // Opens the metrics file on rank 0 (logging.metrics_file, by default
  // outputs/<model>-<time>/metrics.jsonl), appending to it when the run `resumed` (records of
  // steps repeated after a resume come later in the file: the last record of a step is the one
  // that counts); the clock starts here. Each record counts what `world`'s collectives (its
  // subgroups' included) moved and waited since the last one, and the part of it in each of
  // `groups` (hybrid sharding's, by name; may be empty).
  MetricsLogger(const Config& config, const ModelArgs& args, const Communicator& world,
                std::vector<std::pair<std::string, Communicator*>> groups, c10::Device device, bool resumed);

  // Records a step (and the collectives since the last record: a step's record also holds what
  // the loop did with the other ranks after the previous one).
  void log_step(const StepStats& step, std::optional<double> val_loss);
  // A value every record carries (the attention kernel that ran, the predicted peak memory).
  void set_constant(const std::string& key, const std::string& value) { texts_.emplace_back(key, value); }
  void set_constant(const std::string& key, int64_t value) { numbers_.emplace_back(key, value); }
  double elapsed_seconds() const;
  // The metrics file (rank 0; "" elsewhere).
  const std::string& path() const { return path_; }

 private:
  const Config& config_;
  const Communicator& world_;
  std::vector<std::pair<std::string, Communicator*>> groups_;
  CommStats world_before_;                // snapshots at the last record
  std::vector<CommStats> groups_before_;
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

}  // namespace zb
