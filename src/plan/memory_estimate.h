#pragma once
// Peak memory per rank of a training step under the sharding engine, predicted before launch
// (--dry-run, and before training starts) from the config and the run resolved from it.
//
// The prediction replays the step's allocations in the order the engine makes them (forward
// block by block, the chunked loss, backward in reverse, the optimizer) and keeps what is live at
// the highest point, by kind: parameter shards, optimizer state, gathered blocks and their
// collective buffers, gradient accumulators, saved activations, the loss's chunks, data batches.
// Rank 0 is the one predicted (the first ranks hold whole row blocks, the last may hold fewer).
// What each operation keeps for backward is listed where it is counted (memory_estimate.cpp);
// the CPU's figures are checked against a count of live tensor bytes (scripts/perf/memory_check.sh).
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/resolved_run.h"

namespace zb {

struct MemoryEstimate {
  struct Part {
    std::string what;
    int64_t bytes = 0;
  };
  int64_t peak = 0;             // bytes, rank 0
  std::string peak_at;          // where in the step ("backward of block 3", ...)
  std::vector<Part> at_peak;    // what is live then, largest first
  int64_t activations_per_micro_batch = 0;  // saved for backward over all blocks, as configured
  int64_t activations_without_checkpointing = 0;
  // Expert parallelism: the experts' saved activations are counted for a balanced routing, N K
  // rows to each rank's experts a micro-batch. Its bound, every routed row of the EP group to this
  // rank's experts (ep N K), would keep this much more (0 without EP).
  int64_t skewed_routing_extra = 0;
  bool reduce_every_micro_batch = false;
  bool keep_unsharded = false;  // train.keep_unsharded in effect (one rank per shard group)
};

// Rank 0 of the sharding engine's run `run` (config/resolved_run.h), on its device's kernels (a
// GPU's fused RMSNorm and flash attention save less than the CPU's).
MemoryEstimate estimate_step_memory(const Config& c, const ResolvedRun& run);

// The memory one device offers: runtime.device_memory_gb if set, else known GPUs by name (H100
// and H200 SXM); 0 when unknown (the CPU: nothing is checked).
int64_t device_memory_bytes(const Config& c, const std::string& device_name);

// What a run may plan to use of a device's memory before it has one: 90% of it. The rest is left
// for what the estimate does not count: the CUDA context, NCCL's buffers, the caching allocator's
// rounding and fragmentation, library workspaces.
int64_t usable_memory_bytes(int64_t device_bytes);

// The memory a run may plan to use, and how that was decided (for the table).
struct MemoryBudget {
  int64_t device_bytes = 0;  // the device's whole memory; 0 when unknown (nothing is checked)
  int64_t usable = 0;  // for this rank: its share where ranks share the device
  std::string how;
  int64_t shared_by = 1;  // ranks on the device
};
// Before launch (dry runs, or runtime.device_memory_gb set): 90% of device_memory_bytes.
MemoryBudget planned_budget(const Config& c, const std::string& device_name);
// On the GPU itself once the CUDA context and every communicator exist: `available` (free memory
// plus what this process's caching allocator holds) less gpu_reserve_bytes, for what is neither
// modelled nor there yet: cuBLAS/cuDNN workspaces, kernels loaded on first use, rounding.
MemoryBudget measured_budget(int64_t available, int64_t total);
// 5% of the device, at least 2 GiB (not yet measured on a GPU: scripts/gpu/gpu_check.sh reports the
// estimate against the peak).
int64_t gpu_reserve_bytes(int64_t total);

// The estimate as a table of lines, with the budget and whether the peak fits in it.
std::vector<std::string> describe_memory(const MemoryEstimate& e, const MemoryBudget& budget);

}  // namespace zb
