// The training program behind train_fsdp, train_ddp and train_hsdp: pretrain a Llama-style model
// from a TOML config, with the sharding engine or with data parallelism.
//
//   train_fsdp --config configs/debug/normal.toml [--dry-run] [--key value ...]
//
// Setup, then the loop: launch -> config -> the run's parts (model, engine, optimizer, data) ->
// their state loaded -> TrainingLoop (train/training_loop.h): steps, metrics, evaluation, saves.
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "config/cli.h"
#include "config/config.h"
#include "config/model_config.h"
#include "launch/launch.h"
#include "parallel/mesh.h"
#include "plan/run_policy.h"
#include "train/build.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"
#include "train/training_loop.h"
#include "training_program.h"
#include "util/device.h"
#include "util/error_text.h"
#include "util/log.h"

namespace zb {

namespace {

int run(const CommandLine& cl, EngineKind engine, bool over_nodes, const AdjustParts& adjust_parts) {
  Config cfg = cl.config;  // train_hsdp fills in the layout
  const World world = detect_world();
  if (over_nodes) shard_by_node(cfg, world, cl.dry_run);
  const int64_t planned_world = cl.dry_run && cl.world_size > 0 ? cl.world_size : world.size;
  check_engine(cfg, engine);
  validate(cfg, planned_world);
  log::init(static_cast<int>(world.rank), cfg.logging.level);
  if (const std::string w = tp_across_nodes_warning(cfg, world); !w.empty() && world.rank == 0) log::warn(w);
  const ModelArgs args = resolve_model_args(cfg);
  log::info("config: " + cfg.source);
  for (const auto& line : describe_run(cfg, args, planned_world, engine)) log::info(line);
  if (cl.dry_run) {
    dry_run(cfg, args, planned_world, engine, cl.force);
    return 0;
  }

  // --- this rank in the world, the run's parts and their state -------------------------------
  const RunProcess process = join_world(cfg, world);
  Communicator& comm = *process.world;
  // The mesh's groups first: on a GPU their NCCL communicators hold memory the budget must see.
  ParallelMesh mesh(cfg, comm, engine);
  std::optional<MemoryVerdict> memory;
  if (engine == EngineKind::Sharded)
    memory = check_memory(cfg, world.size, process.device,
                          memory_budget(cfg, process.device, /*dry_run=*/false, process.placement.sharing_mine()),
                          cl.force, /*dry_run=*/false);
  TrainingParts parts = build_training(cfg, std::move(mesh), process.device, memory ? memory->autos : MemoryChoices{});
  if (adjust_parts) adjust_parts(parts);
  Trainer trainer(cfg, std::move(parts));
  TrainerCheckpointState run_state(trainer);  // what checkpoints save and restore
  for (const auto& line : describe_trainer(trainer, cfg, process.device)) log::info(line);
  CheckpointWriter checkpoints(cfg, comm);  // first: fails at once if ckpt.path cannot be written
  if (!cfg.ckpt.init_from.empty()) init_from_hf(cfg.ckpt.init_from, run_state);
  if (!cfg.ckpt.resume.empty()) load_checkpoint(resolve_checkpoint(cfg, cfg.ckpt.resume), run_state, comm);

  TrainingLoop(cfg, trainer, comm, checkpoints, run_state,
               memory ? std::optional<int64_t>(memory->estimate.peak) : std::nullopt)
      .run();
  return 0;
}

int program_main(int argc, char** argv, EngineKind engine, const char* program, bool over_nodes,
                 const AdjustParts& adjust_parts) {
  log::init(0, "info");
  // Before any tensor exists: the measurement of live tensor bytes (util/device.h).
  if (const char* count = std::getenv("ZB_COUNT_TENSOR_MEMORY"); count && std::string(count) == "1")
    count_cpu_tensor_memory();
  try {
    const CommandLine cl = parse_command_line(argc, argv);
    if (cl.help) {
      std::cout << help_text(program);
      return 0;
    }
    if (cl.print_config) {
      // Checked against the world it is for: --world-size, else the launcher's.
      validate(cl.config, cl.world_size > 0 ? cl.world_size : detect_world().size);
      std::cout << resolved_run(cl.config).dump(2) << "\n";
      return 0;
    }
    if (cl.print_plan_rank >= 0) {
      std::cout << plan_report(cl, engine, over_nodes).dump(1) << "\n";
      return 0;
    }
    return run(cl, engine, over_nodes, adjust_parts);
  } catch (const ConfigError& e) {
    log::error(std::string("config error: ") + e.what());
    return 2;
  } catch (const std::exception& e) {
    log::error("error: " + error_text(e));
    return 1;
  }
}

}  // namespace

int training_main(int argc, char** argv, EngineKind engine, const char* program, bool over_nodes,
                  const AdjustParts& adjust_parts) {
  return end_process(program_main(argc, argv, engine, program, over_nodes, adjust_parts));
}

}  // namespace zb
