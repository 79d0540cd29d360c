// The training program behind train_fsdp and train_ddp: pretrain a Llama-style model from a TOML
// config, with the sharding engine or with data parallelism.
//
//   train_fsdp --config configs/debug/normal.toml [--dry-run] [--key value ...]
//
// One short loop wires the components together: launch -> config -> trainer (model, engine,
// optimizer, data) -> steps -> metrics, validation and checkpoints.
#include <nlohmann/json.hpp>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <optional>

#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "config/cli.h"
#include "config/config.h"
#include "config/model_config.h"
#include "dist/comm.h"
#include "dist/placement.h"
#include "dist/world.h"
#include "model/llama.h"
#include "launch/launch.h"
#include "observe/metrics.h"
#include "observe/metrics_logger.h"
#include "observe/profiler.h"
#include "plan/run_policy.h"
#include "parallel/mesh.h"
#include "train/build.h"
#include "train/checkpoint_state.h"
#include "train/trainer.h"
#include "training_program.h"
#include "util/device.h"
#include "util/fs.h"
#include "util/log.h"
#include "util/phase.h"

namespace {

using zb::strf;

// SIGTERM (preemption) and SIGINT (Ctrl-C) ask the loop to finish the current step, save and
// exit 0 (the next step, when the signal comes after the step's all-reduce: StepFlags).
volatile std::sig_atomic_t stop_requested = 0;
void request_stop(int) { stop_requested = 1; }

// A step that was not applied (plan/run_policy.h decides): a warning and on, or an error that
// stops every rank (all saw the same all-reduced values and decide the same).
void on_nonfinite_step(const zb::StepStats& s, const zb::Config& cfg, zb::CheckpointWriter& checkpoints) {
  const zb::NonfiniteDecision d = zb::decide_nonfinite(s, cfg, checkpoints.last_good());
  if (d.stop) throw std::runtime_error(d.message);
  zb::log::warn(d.message);
}

// c10 errors carry a C++ backtrace in what(); users need the message.
std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

int run(const zb::CommandLine& cl, zb::Parallelism parallelism, bool over_nodes, const zb::AdjustParts& adjust_parts) {
  zb::Config cfg = cl.config;  // train_hsdp fills in the layout
  const zb::World world = zb::detect_world();
  if (over_nodes) zb::shard_by_node(cfg, world, cl.dry_run);
  const int64_t planned_world = cl.dry_run && cl.world_size > 0 ? cl.world_size : world.size;
  if (parallelism == zb::Parallelism::DDP && cfg.parallel.cp > 1)
    throw zb::ConfigError(cfg.origin("parallel.cp") +
                          ": context parallelism composes with the sharding engine (train_fsdp, train_hsdp), not "
                          "train_ddp");
  if (parallelism == zb::Parallelism::DDP && cfg.parallel.tp > 1)
    throw zb::ConfigError(cfg.origin("parallel.tp") +
                          ": tensor parallelism composes with the sharding engine (train_fsdp, train_hsdp), not "
                          "train_ddp");
  zb::validate(cfg, planned_world);
  if (parallelism == zb::Parallelism::DDP && cfg.diloco.inner_steps > 0)
    throw zb::ConfigError(cfg.origin("diloco.inner_steps") +
                          ": DiLoCo trains the replicas of train_fsdp or train_hsdp apart (parallel.dp_replicate "
                          "shard groups); train_ddp has none");
  zb::log::init(static_cast<int>(world.rank), cfg.logging.level);
  if (const std::string w = zb::tp_across_nodes_warning(cfg, world); !w.empty() && world.rank == 0) zb::log::warn(w);
  const zb::ModelArgs args = zb::resolve_model_args(cfg);
  zb::log::info("config: " + cfg.source);
  for (const auto& line : zb::describe_run(cfg, args, planned_world, parallelism)) zb::log::info(line);

  if (cl.dry_run) {
    // Build the model on the meta device: every shape, no memory.
    zb::Llama model(args, at::TensorOptions().device(c10::kMeta));
    zb::log::info(strf("dry run: built %s parameters on the meta device",
                       zb::with_commas(model.num_params()).c_str()));
    if (parallelism == zb::Parallelism::FSDP) {
      const c10::Device planned = zb::planned_device(cfg);
      zb::check_memory(cfg, planned_world, planned, zb::memory_budget(cfg, planned, /*dry_run=*/true), cl.force,
                       /*dry_run=*/true);
    } else
      zb::log::info("memory estimate: train_fsdp only");
    return 0;
  }

  // --- process, rendezvous, trainer --------------------------------------------------------------
  const c10::Device device = zb::prepare_process(cfg, world);
  const auto rendezvous = zb::connect_rendezvous(world, std::chrono::seconds(cfg.runtime.timeout_s));
  // Which ranks share a GPU decides how the collectives travel (runtime.backend).
  const zb::Placement placement = zb::exchange_placement(*rendezvous, device);
  const zb::BackendChoice backend = zb::choose_backend(cfg.runtime.backend, device, placement);
  zb::Communicator comm(rendezvous, device, backend.transport);
  zb::log::info(strf("world: %ld process(es) via %s, rendezvous %s:%ld, collectives over %s; this is rank %ld "
                     "(local %ld)",
                     world.size, world.launcher.c_str(), world.master_addr.c_str(), world.master_port,
                     world.distributed() ? zb::transport_name(comm.transport()) : "none (one process)", world.rank,
                     world.local_rank));
  if (!backend.why.empty() && world.rank == 0 && world.distributed()) zb::log::info("collectives: " + backend.why);
  zb::log_placement(comm, device);
  // The mesh's groups first: on a GPU their NCCL communicators hold memory the budget must see.
  zb::ParallelMesh mesh(cfg, comm, parallelism);
  std::optional<zb::MemoryVerdict> memory;
  if (parallelism == zb::Parallelism::FSDP)
    memory = zb::check_memory(cfg, world.size, device,
                              zb::memory_budget(cfg, device, /*dry_run=*/false, placement.sharing_mine()), cl.force,
                              /*dry_run=*/false);
  // train.keep_unsharded as the verdict resolved it ("auto" on or off), for the trainer, the plan
  // and the run's record.
  if (memory) cfg.train.keep_unsharded = memory->keep_unsharded ? "true" : "false";
  zb::TrainingParts parts =
      zb::build_training(cfg, std::move(mesh), device,
                         memory ? std::optional<bool>(memory->reduce_every_micro_batch) : std::nullopt);
  if (adjust_parts) adjust_parts(parts);
  zb::Trainer trainer(cfg, std::move(parts));
  zb::TrainerCheckpointState run_state(trainer);  // what checkpoints save and restore
  for (const auto& line : zb::describe_trainer(trainer, cfg, device)) zb::log::info(line);
  zb::CheckpointWriter checkpoints(cfg, comm);  // first: fails at once if ckpt.path cannot be written
  if (!cfg.ckpt.init_from.empty()) zb::init_from_hf(cfg.ckpt.init_from, run_state);
  if (!cfg.ckpt.resume.empty())
    zb::load_checkpoint(zb::resolve_checkpoint(cfg, cfg.ckpt.resume), run_state, comm);
  std::signal(SIGTERM, request_stop);
  std::signal(SIGINT, request_stop);

  // --- the loop ----------------------------------------------------------------------------------
  const bool resumed = trainer.step() > 0;
  if (cfg.diloco.join) trainer.join_run();  // waits for the running run's next outer step
  zb::MetricsLogger metrics(cfg, args, comm, trainer.mesh().named_groups(), device, resumed);
  metrics.set_constant("attention_kernel", trainer.attention_kernel());
  if (memory) metrics.set_constant("predicted_peak_memory_bytes", memory->estimate.peak);
  if (world.rank == 0) zb::record_run(cfg, trainer, metrics.path(), resumed);
  // Traces beside rank 0's metrics file, on every rank.
  const std::string run_dir =
      cfg.profiling.enable_profiling
          ? comm.rendezvous().exchange("run_dir", zb::parent_directory(metrics.path())).front()
          : "";
  zb::StepProfiler profiler(cfg.profiling, run_dir, world.rank, device);
  const auto report_profile = [&](const std::optional<zb::ProfileSummary>& summary) {
    if (summary && world.rank == 0)
      for (const auto& line : summary->describe(profiler.folder())) zb::log::info(line);
  };
  // An error in a step's work with the other ranks (its training, its evaluation) names the step:
  // usually another rank died there.
  const auto failed_in = [&](int64_t step, const std::exception& e) {
    return std::runtime_error(
        strf("rank %ld failed in step %ld: %s", world.rank, step, error_text(e).c_str()) +
        (world.distributed() ? " (a collective with the other ranks failed: one of them may have "
                               "died or stopped responding; runtime.timeout_s bounds the wait)"
                             : ""));
  };
  for (int64_t step = trainer.step() + 1; step <= cfg.optim.total_steps; ++step) {
    comm.set_phase(strf("step %ld", step));  // a stall from here on is reported as this step's
    zb::StepStats s;
    profiler.step_begin(step);
    try {
      zb::Phase phase("zb.step", step);
      // The flags every rank counts in the step's all-reduce: a signal, a failed save.
      s = trainer.train_step([&] { return zb::StepFlags{stop_requested != 0, checkpoints.failed()}; });
    } catch (const std::exception& e) {
      throw failed_in(step, e);
    }
    report_profile(profiler.step_end(step));
    std::optional<double> val_loss;
    if (s.nonfinite.empty() && cfg.data.eval_interval > 0 && trainer.has_validation() &&
        (step % cfg.data.eval_interval == 0 || step == cfg.optim.total_steps))
    {
      comm.set_phase(strf("the evaluation after step %ld", step));
      try {
        val_loss = trainer.evaluate();  // every rank takes part
      } catch (const std::exception& e) {
        throw failed_in(step, e);
      }
    }
    metrics.log_step(s, val_loss);
    // For tests: the first rank stops (SIGSTOP) or dies (SIGKILL) as a machine lost mid-run would
    // leave the others, its saves finished first so that it can be restarted from them.
    for (const auto& [variable, signal] : {std::pair{"ZB_TEST_STOP_AFTER_STEP", SIGSTOP},
                                           std::pair{"ZB_TEST_KILL_AFTER_STEP", SIGKILL}})
      if (const char* at = std::getenv(variable); at && std::to_string(step) == at && world.rank == 0) {
        checkpoints.finish();
        zb::log::warn(strf("process %d: %s after step %ld (%s)", static_cast<int>(::getpid()),
                           signal == SIGSTOP ? "stops" : "dies", step, variable));
        std::raise(signal);
      }
    if (!s.nonfinite.empty()) on_nonfinite_step(s, cfg, checkpoints);  // throws to stop the run

    // All ranks stop after the same step when any got a signal or saw its save fail (counted in
    // the step's all-reduce, before its optimizer: what came after it counts at the next step).
    if (s.ranks_failed_save > 0) {
      checkpoints.finish();  // throws the failure where this rank knows it
      throw std::runtime_error("saving the checkpoint failed on another rank (see the log of rank 0)");
    }
    const bool stopping = s.ranks_stopping > 0;
    std::optional<std::string> saved;
    try {
      saved = checkpoints.save_if_due(run_state, stopping);  // written in the background
    } catch (const std::exception& e) {  // a dead rank, or this rank's own disk
      throw std::runtime_error(strf("rank %ld failed in step %ld, saving its checkpoint: %s", world.rank, step,
                                    error_text(e).c_str()));
    }
    if (saved) zb::log::info(strf("saving checkpoint %s", saved->c_str()));
    if (stopping) {
      report_profile(profiler.finish(step));
      comm.set_phase("");  // the writers' waits have their own bound
      checkpoints.finish();
      zb::log::warn(strf("stopped by a signal after step %ld%s", step,
                         saved ? " (checkpoint saved)" : " (no ckpt.path: nothing saved)"));
      return 0;
    }
  }
  report_profile(profiler.finish(cfg.optim.total_steps));
  comm.set_phase("");
  checkpoints.finish();  // the last checkpoint is on disk before we exit
  zb::log::info(strf("done: %ld steps, %s tokens in %s", cfg.optim.total_steps,
                     zb::with_commas(cfg.optim.total_steps * trainer.tokens_per_step()).c_str(),
                     zb::format_duration(metrics.elapsed_seconds()).c_str()));
  return 0;
}

}  // namespace

namespace zb {

namespace {

int program_main(int argc, char** argv, Parallelism parallelism, const char* program, bool over_nodes,
                 const AdjustParts& adjust_parts) {
  zb::log::init(0, "info");
  // Before any tensor exists: the measurement of live tensor bytes (util/device.h).
  if (const char* count = std::getenv("ZB_COUNT_TENSOR_MEMORY"); count && std::string(count) == "1")
    zb::count_cpu_tensor_memory();
  try {
    const zb::CommandLine cl = zb::parse_command_line(argc, argv);
    if (cl.help) {
      std::cout << zb::help_text(program);
      return 0;
    }
    if (cl.print_config) {
      // Checked against the world it is for: --world-size, else the launcher's.
      zb::validate(cl.config, cl.world_size > 0 ? cl.world_size : zb::detect_world().size);
      std::cout << zb::resolved_run(cl.config).dump(2) << "\n";
      return 0;
    }
    if (cl.print_plan_rank >= 0) {
      std::cout << zb::plan_report(cl, parallelism, over_nodes).dump(1) << "\n";
      return 0;
    }
    return run(cl, parallelism, over_nodes, adjust_parts);
  } catch (const zb::ConfigError& e) {
    zb::log::error(std::string("config error: ") + e.what());
    return 2;
  } catch (const std::exception& e) {
    zb::log::error("error: " + error_text(e));
    return 1;
  }
}

}  // namespace

int training_main(int argc, char** argv, Parallelism parallelism, const char* program, bool over_nodes,
                  const AdjustParts& adjust_parts) {
  return end_process(program_main(argc, argv, parallelism, program, over_nodes, adjust_parts));
}

}  // namespace zb
