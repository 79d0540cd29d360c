#pragma once
// A run's policy, apart from the mechanics that carry it out (the trainer, the engines) and from
// the program that reports it: whether the run fits in its device's memory and whether its
// gradients are reduced on every micro-batch, and what the run does after a step that was not
// applied. Each is a function of the config and what was measured, tested on its own.
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "train/memory_estimate.h"
#include "train/trainer.h"

namespace zb {

struct MemoryVerdict {
  MemoryEstimate estimate;  // of the step as it will run
  bool fits = true;         // within the budget, or no budget to check against (the CPU)
  // train.reduce_every_micro_batch resolved: as set, or for "auto" on only when the run fits
  // only that way.
  bool reduce_every_micro_batch = false;
  bool auto_turned_on = false;     // "auto" chose it
  std::vector<std::string> table;  // the estimate and the budget, as lines (describe_memory)
};
// The sharding engine's runs (train_fsdp, train_hsdp) of `world_size` ranks on `device`.
MemoryVerdict judge_memory(const Config& config, int64_t world_size, const c10::Device& device,
                           const MemoryBudget& budget);

// After a step that was not applied (its loss or gradient norm not finite, StepStats::nonfinite):
// under train.nonfinite = "skip" the run goes on, until train.max_skipped_steps such steps in a
// row; otherwise it stops, saving nothing of this state. The message names the step, its values
// and the last good checkpoint ("" if none).
struct NonfiniteDecision {
  bool stop = false;
  std::string message;
};
NonfiniteDecision decide_nonfinite(const StepStats& step, const Config& config, const std::string& last_good);

}  // namespace zb
