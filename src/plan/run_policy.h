#pragma once
// A run's policy, apart from the mechanics that carry it out (the trainer, the engines) and from
// the program that reports it: how the run resolves (its layout across nodes, the memory it may
// plan on, its description for other tools), whether it fits in its device's memory and whether
// its gradients are reduced on every micro-batch, and what it does after a step that was not
// applied. Each is a function of the config and what was measured, tested on its own
// (tests/test_run_policy.cpp).
#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "dist/world.h"
#include "plan/memory_estimate.h"
#include "plan/step_plan.h"
#include "observe/step_stats.h"

namespace zb {

struct MemoryVerdict {
  MemoryEstimate estimate;  // of the step as it will run
  MemoryBudget budget;      // what it was judged against
  bool fits = true;         // within the budget, or no budget to check against (the CPU)
  // train.reduce_every_micro_batch resolved: as set, or for "auto" on where the run does not fit
  // with whole fp32 sums (and needs less so, whether or not it then fits).
  bool reduce_every_micro_batch = false;
  bool auto_turned_on = false;     // "auto" chose it
  // train.keep_unsharded resolved: in effect ("true", or "auto" on a GPU where the run fits with
  // the casts kept), for one rank per shard group only.
  bool keep_unsharded = false;
  bool keep_unsharded_auto_on = false;  // "auto" chose it
  MemoryChoices autos;  // both "auto" answers, for resolve_run (config/resolved_run.h)
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

// The run as another implementation needs it to train the same model the same way: the resolved
// shapes, batch and optimizer settings, and what "auto" resolves to on this machine
// (--print-config; scripts/perf/bench_peer.py builds its PyTorch twin from it).
nlohmann::json resolved_run(const Config& config);

// What this rank's device offers: on a GPU (unless runtime.device_memory_gb says) the memory
// still free once the CUDA context and every communicator exist; else from the config or the
// GPU's name. A dry run may plan for a GPU on a machine without one: then only the config says.
// `sharing` ranks on one GPU (dist/placement.h) each get that share of it (share_budget).
MemoryBudget memory_budget(const Config& config, const c10::Device& device, bool dry_run, int64_t sharing = 1);
// `budget` divided between `sharing` ranks on its device; as it is for one, or for an unknown device.
MemoryBudget share_budget(MemoryBudget budget, int64_t sharing);

// The device a run of this config trains on, whether or not this machine has it (dry runs and
// plans for a GPU made on a CPU): runtime.device, "auto" being CUDA where CUDA is usable here.
c10::Device planned_device(const Config& config);

// One step of `rank` of `world_size` as the step plan lists it, resolved as a launch of it would
// be on its planned device: dtypes, and train.reduce_every_micro_batch = "auto" by a dry run's
// memory verdict (which knows the device's memory from runtime.device_memory_gb, or the GPU's
// name where this machine has it). `memory`, when given, receives that verdict (the sharding
// engine only; left alone for train_ddp).
StepPlan plan_run(const Config& config, int64_t world_size, int64_t rank, EngineKind engine,
                  MemoryVerdict* memory = nullptr);

}  // namespace zb
