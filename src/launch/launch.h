#pragma once
// What a training program does around the Trainer, so that the program itself is only its loop:
// the process's device and threads, the run described in the log, the memory check that may
// refuse it, and the resolved run written beside its metrics.
#include <c10/core/Device.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/cli.h"
#include "config/config.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "model/model_args.h"
#include "plan/run_policy.h"
#include "train/trainer.h"

namespace zb {

// Sets this rank's process up for a run: the device it trains on (runtime.device, the local rank's
// GPU), its allocator, LibTorch's CPU threads (ranks sharing a machine's cores divide them), and a
// file-size limit turned into a write error instead of a kill.
c10::Device prepare_process(const Config& config, const World& world);

// The run as the log describes it before it starts: model, parameters, FLOPs per token, batch and,
// for hybrid sharding, the layout.
std::vector<std::string> describe_run(const Config& config, const ModelArgs& args, int64_t world_size,
                                      Parallelism parallelism);
// What the trainer resolved: device and dtype, attention, optimizer groups, gradient reduction.
std::vector<std::string> describe_trainer(Trainer& trainer, const Config& config, const c10::Device& device);
// Where every rank runs (host, device, GPU and its PCI bus), logged by rank 0: a wrong binding
// shows here. Every rank calls it.
void log_placement(const Communicator& comm, const c10::Device& device);

// The memory verdict for a run of the sharding engine (run_policy.h), logged; a run that will not
// fit throws ConfigError with the estimate's table, unless `force` or a dry run.
MemoryVerdict check_memory(const Config& config, int64_t world_size, const c10::Device& device,
                           const MemoryBudget& budget, bool force, bool dry_run);

// --print-plan: one step of rank --print-plan of --world-size ranks (else the launcher's world) as
// the step plan lists it, with the memory verdict a launch would reach ("memory": rank 0's peak and
// the usable bytes, 0 where no budget is known; null under DDP, which is not estimated).
// `over_nodes`: train_hsdp's layout (shard_by_node).
nlohmann::json plan_report(const CommandLine& cl, Parallelism parallelism, bool over_nodes);

// Rank 0: the resolved run beside the metrics file (<stem>.config.json, the W&B run's config), and
// the metrics follower started when W&B or TensorBoard is on.
void record_run(const Config& config, const Trainer& trainer, const std::string& metrics_path, bool resumed);

}  // namespace zb
