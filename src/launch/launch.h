#pragma once
// What a training program does before the loop (train/training_loop.h): the refusals of its
// engine, the dry run, the process joined to the others, the run described in the log, and the
// memory check that may refuse it.
#include <c10/core/Device.h>

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/cli.h"
#include "config/config.h"
#include "dist/comm.h"
#include "dist/placement.h"
#include "dist/world.h"
#include "model/model_args.h"
#include "plan/run_policy.h"
#include "train/trainer.h"

namespace zb {

// What train_ddp cannot take: context and tensor parallelism and DiLoCo need the sharding
// engine's groups (train_fsdp, train_hsdp), and activation checkpointing is the sharding engine's
// (a key it would ignore). A ConfigError naming the key.
void check_engine(const Config& config, EngineKind engine);

// --dry-run: the model built on the meta device (every shape, no memory) and, for the sharding
// engine, the memory table for `world_size` ranks with its verdict.
void dry_run(const Config& config, const ModelArgs& args, int64_t world_size, EngineKind engine, bool force);

// This rank joined to the run: its process set up (the device it trains on, the local rank's GPU
// under runtime.device; its allocator; LibTorch's CPU threads, divided between ranks sharing a
// machine's cores), the rendezvous, and the communicator over every rank, whose collectives travel
// as the ranks' sharing of GPUs decides (runtime.backend). Rank 0 logs where every rank runs.
struct RunProcess {
  c10::Device device;
  Placement placement;
  std::unique_ptr<Communicator> world;
};
RunProcess join_world(const Config& config, const World& world);

// The run as the log describes it before it starts: model, parameters, FLOPs per token, batch and,
// for hybrid sharding, the layout.
std::vector<std::string> describe_run(const Config& config, const ModelArgs& args, int64_t world_size,
                                      EngineKind engine);
// What the trainer resolved: device and dtype, attention, optimizer groups, gradient reduction.
std::vector<std::string> describe_trainer(Trainer& trainer, const Config& config, const c10::Device& device);
// The memory verdict for a run of the sharding engine (run_policy.h), logged; a run that will not
// fit throws ConfigError with the estimate's table, unless `force` or a dry run.
MemoryVerdict check_memory(const Config& config, int64_t world_size, const c10::Device& device,
                           const MemoryBudget& budget, bool force, bool dry_run);

// --print-plan: one step of rank --print-plan of --world-size ranks (else the launcher's world) as
// the step plan lists it, with the memory verdict a launch would reach ("memory": rank 0's peak and
// the usable bytes, 0 where no budget is known; null under DDP, which is not estimated).
// `over_nodes`: train_hsdp's layout (shard_by_node).
nlohmann::json plan_report(const CommandLine& cl, EngineKind engine, bool over_nodes);

}  // namespace zb
