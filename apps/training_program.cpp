// The training program behind train_fsdp and train_ddp: pretrain a Llama-style model from a TOML
// config, with the sharding engine or with data parallelism.
//
//   train_fsdp --config configs/debug/normal.toml [--dry-run] [--key value ...]
//
// One short loop wires the components together: launch -> config -> trainer (model, engine,
// optimizer, data) -> steps -> metrics, validation and checkpoints.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "config/cli.h"
#include "config/config.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "model/llama.h"
#include "config/model_config.h"
#include "train/metrics.h"
#include "train/metrics_follower.h"
#include "train/metrics_logger.h"
#include "train/run_policy.h"
#include "train/step_plan.h"
#include "train/trainer.h"
#include "training_program.h"
#include "util/device.h"
#include "util/fs.h"
#include "util/log.h"

namespace {

using zb::strf;

// SIGTERM (preemption) and SIGINT (Ctrl-C) ask the loop to finish the current step, save and
// exit 0.
volatile std::sig_atomic_t stop_requested = 0;
void request_stop(int) { stop_requested = 1; }

// A step that was not applied (train/run_policy.h decides): a warning and on, or an error that
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

void describe_model(const zb::Config& c, const zb::ModelArgs& a, int64_t world_size) {
  zb::log::info(strf("model: %s %s: dim %ld, %ld layers, %ld heads (%ld kv), head_dim %ld, ffn %ld, vocab %ld",
                     c.type_model.c_str(), c.name_model.c_str(), a.dim, a.n_layers, a.n_heads,
                     a.n_kv_heads, a.head_dim(), a.ffn_hidden(), a.vocab_size));
  zb::log::info(strf("parameters: %s total, %s without the token embedding",
                     zb::with_commas(zb::count_params(a)).c_str(),
                     zb::with_commas(zb::count_params_without_embedding(a)).c_str()));
  zb::log::info(strf("FLOPs/token: %.4g (6N + 12*L*H*Dh*T at seq_length %ld%s)",
                     zb::flops_per_token(a, c.data.seq_length), c.data.seq_length,
                     c.model.attention == "document" ? "; attention counted over whole rows, as ZeroBand, "
                                                       "though the document mask skips pairs: MFU is comparable, "
                                                       "tokens/s is the measure"
                                                     : ""));
  zb::log::info(strf("batch: %ld sequences x %ld tokens = %s tokens/step; micro_bs %ld, %ld accumulation steps on %ld rank(s)",
                     c.optim.batch_size, c.data.seq_length,
                     zb::with_commas(c.optim.batch_size * c.data.seq_length).c_str(), c.train.micro_bs,
                     zb::grad_accum_steps(c, world_size), world_size));
}

// The memory verdict for this run (FSDP only; train/run_policy.h), logged; a run that will not
// fit stops here (config error, exit 2) unless --force or a dry run. Returns the verdict.
zb::MemoryVerdict check_memory(const zb::Config& cfg, int64_t world_size, const c10::Device& device,
                               const zb::MemoryBudget& budget, bool force, bool dry_run) {
  const zb::MemoryVerdict v = zb::judge_memory(cfg, world_size, device, budget);
  if (v.auto_turned_on)
    zb::log::info("train.reduce_every_micro_batch = auto: on (the run fits only with sharded gradient sums)");
  if (v.fits || dry_run || force) {
    for (const auto& line : v.table) (v.fits ? zb::log::info : zb::log::warn)(line);
    if (!v.fits && !dry_run) zb::log::warn("--force: training anyway");
    return v;
  }
  std::string table;
  for (const auto& line : v.table) table += "\n" + line;
  throw zb::ConfigError(strf("the run is predicted not to fit in one device's memory (smaller train.micro_bs, "
                             "train.ac_ckpt, more ranks; --force to try anyway):") + table);
}

// --print-plan: one step of the run as the step plan lists it, for a rank of --world-size ranks
// (else the launcher's world).
nlohmann::json plan_json(const zb::CommandLine& cl, zb::Parallelism parallelism, bool over_nodes) {
  zb::Config cfg = cl.config;
  const zb::World world = zb::detect_world();
  if (over_nodes) zb::shard_by_node(cfg, world, /*dry_run=*/cl.world_size > 0);
  const int64_t world_size = cl.world_size > 0 ? cl.world_size : world.size;
  zb::validate(cfg, world_size);
  if (cl.print_plan_rank >= world_size)
    throw zb::ConfigError(strf("--print-plan %ld: there are only %ld rank(s) (--world-size)", cl.print_plan_rank,
                               world_size));
  return zb::plan_to_json(zb::plan_run(cfg, world_size, cl.print_plan_rank, parallelism));
}

int run(const zb::CommandLine& cl, zb::Parallelism parallelism, bool over_nodes,
        const zb::Trainer::GradientHook& gradient_hook) {
  zb::Config cfg = cl.config;  // train_hsdp fills in the layout
  const zb::World world = zb::detect_world();
  if (over_nodes) zb::shard_by_node(cfg, world, cl.dry_run);
  const int64_t planned_world = cl.dry_run && cl.world_size > 0 ? cl.world_size : world.size;
  zb::validate(cfg, planned_world);
  zb::log::init(static_cast<int>(world.rank), cfg.logging.level);
  const zb::ModelArgs args = zb::resolve_model_args(cfg);
  zb::log::info("config: " + cfg.source);
  describe_model(cfg, args, planned_world);
  if (const zb::ShardLayout layout = zb::shard_layout(cfg, planned_world);
      parallelism == zb::Parallelism::FSDP && layout.replicate > 1)
    zb::log::info(strf("hybrid sharding: parameters sharded over groups of %ld consecutive ranks, replicated "
                       "%ld times (gradients: reduce-scatter in the group, then all-reduce over the replicas)",
                       layout.shard, layout.replicate));

  if (cl.dry_run) {
    // Build the model on the meta device: every shape, no memory.
    zb::Llama model(args, at::TensorOptions().device(c10::kMeta));
    zb::log::info(strf("dry run: built %s parameters on the meta device",
                       zb::with_commas(model.num_params()).c_str()));
    if (parallelism == zb::Parallelism::FSDP) {
      const c10::Device planned = zb::planned_device(cfg);
      check_memory(cfg, planned_world, planned, zb::memory_budget(cfg, planned, /*dry_run=*/true), cl.force,
                   /*dry_run=*/true);
    } else
      zb::log::info("memory estimate: train_fsdp only");
    return 0;
  }

  // --- processes, device, threads ---------------------------------------------------------------
  // A file-size limit (ulimit -f, some quotas) would kill the process in the middle of a write;
  // ignored, the write fails with EFBIG and the error names the file.
  std::signal(SIGXFSZ, SIG_IGN);
  const c10::Device device = zb::select_device(cfg.runtime.device, world.local_rank);
  zb::configure_allocator(device);
  if (cfg.runtime.num_threads > 0) {
    at::set_num_threads(static_cast<int>(cfg.runtime.num_threads));
  } else if (!device.is_cuda() && world.local_size > 1 && !std::getenv("OMP_NUM_THREADS")) {
    // Ranks on one machine's CPU share its cores: LibTorch's default of every core per process
    // would have them fight over each (torchrun sets OMP_NUM_THREADS=1 itself; mpirun does not).
    at::set_num_threads(std::max<int>(1, at::get_num_threads() / static_cast<int>(world.local_size)));
  }
  zb::Communicator comm(world, device, std::chrono::seconds(cfg.runtime.timeout_s));
  zb::log::info(strf("world: %ld process(es) via %s, rendezvous %s:%ld; this is rank %ld (local %ld)",
                     world.size, world.launcher.c_str(), world.master_addr.c_str(), world.master_port,
                     world.rank, world.local_rank));
  // Which device, which physical GPU, on which host, for every rank: a wrong binding shows here.
  const auto placement = comm.rendezvous().exchange(
      "placement", strf("rank %ld (local %ld) on %s: %s%s", world.rank, world.local_rank, zb::host_name().c_str(),
                        device.str().c_str(),
                        device.is_cuda() ? strf(", %s, PCI %s", zb::device_name(device).c_str(),
                                                zb::device_pci_bus_id(device).c_str()).c_str()
                                         : ""));
  if (world.rank == 0)
    for (const auto& line : placement) zb::log::info("placement: " + line);

  // --- model, sharding engine, optimizer, data ---------------------------------------------------
  // Hybrid sharding's groups first: on a GPU their NCCL communicators hold memory the budget
  // must see.
  zb::HybridGroups groups = zb::make_hybrid_groups(cfg, comm, parallelism);
  std::optional<zb::MemoryVerdict> memory;
  if (parallelism == zb::Parallelism::FSDP)
    memory = check_memory(cfg, world.size, device, zb::memory_budget(cfg, device, /*dry_run=*/false), cl.force, false);
  zb::Trainer trainer(cfg, comm, device, parallelism, std::move(groups),
                      memory ? std::optional<bool>(memory->reduce_every_micro_batch) : std::nullopt);
  trainer.set_gradient_hook(gradient_hook);
  zb::log::info(strf("device: %s (%s), compute dtype %s, %d CPU threads, reshard_after_forward %s",
                     device.str().c_str(), zb::device_name(device).c_str(),
                     c10::toString(trainer.compute_dtype()), at::get_num_threads(),
                     cfg.train.reshard_after_forward ? "true" : "false"));
  if (const auto& d = trainer.documents())
    zb::log::info(strf("attention: within documents, split %s token %ld (%s), kernel %s", d->opens ? "before" : "after",
                       static_cast<long>(d->token),
                       trainer.flash_documents() ? "variable-length flash kernel" : "additive mask through SDPA",
                       trainer.attention_kernel().c_str()));
  else
    zb::log::info(strf("attention: causal over whole rows, kernel %s (runtime.sdpa_backend = %s)",
                       trainer.attention_kernel().c_str(), cfg.runtime.sdpa_backend.c_str()));
  for (const auto& line : trainer.optimizer().describe()) zb::log::info("optimizer " + line);
  if (trainer.grad_accum_steps() > 1)
    zb::log::info(trainer.reduces_every_micro_batch()
                      ? strf("gradients: reduced on each of the %ld micro-batches, summed in fp32 shards",
                             trainer.grad_accum_steps())
                      : strf("gradients: summed whole in fp32 over %ld micro-batches, reduced on the last "
                             "(train.reduce_every_micro_batch = true saves that memory for more traffic)",
                             trainer.grad_accum_steps()));
  zb::CheckpointWriter checkpoints(cfg, comm);  // first: fails at once if ckpt.path cannot be written
  if (!cfg.ckpt.init_from.empty()) zb::init_from_hf(cfg.ckpt.init_from, trainer);
  if (!cfg.ckpt.resume.empty())
    zb::load_checkpoint(zb::resolve_checkpoint(cfg, cfg.ckpt.resume), trainer, comm);
  std::signal(SIGTERM, request_stop);
  std::signal(SIGINT, request_stop);

  // --- the loop ----------------------------------------------------------------------------------
  zb::MetricsLogger metrics(cfg, args, world.rank, world.size, device, /*resumed=*/trainer.step() > 0);
  metrics.set_constant("attention_kernel", trainer.attention_kernel());
  if (memory) metrics.set_constant("predicted_peak_memory_bytes", memory->estimate.peak);
  if (world.rank == 0) {
    // The resolved run beside its metrics (<stem>.config.json; the W&B run's config).
    if (const std::string path = zb::run_config_path(metrics.path()); !path.empty()) {
      nlohmann::json run = zb::resolved_run(cfg);
      run["resolved_reduce_every_micro_batch"] = trainer.reduces_every_micro_batch();
      std::ofstream(path) << run.dump(2) << "\n";
    }
    zb::start_metrics_follower(cfg, metrics.path(), /*resumed=*/trainer.step() > 0);
  }
  // What the hybrid-sharding groups (if any) have moved so far, by group.
  const auto group_stats = [&trainer] {
    std::vector<std::pair<std::string, zb::CommStats>> out;
    for (const auto& [name, group] : trainer.communication_groups()) out.emplace_back(name, group->stats());
    return out;
  };
  zb::CommStats before = comm.stats();
  for (int64_t step = trainer.step() + 1; step <= cfg.optim.total_steps; ++step) {
    comm.set_phase(strf("step %ld", step));  // a stall from here on is reported as this step's
    auto by_group = group_stats();
    zb::StepStats s;
    try {
      s = trainer.train_step();
    } catch (const std::exception& e) {
      throw std::runtime_error(
          strf("rank %ld failed in step %ld: %s", world.rank, step, error_text(e).c_str()) +
          (world.distributed() ? " (a collective with the other ranks failed: one of them may have "
                                 "died or stopped responding; runtime.timeout_s bounds the wait)"
                               : ""));
    }
    std::optional<double> val_loss;
    if (s.nonfinite.empty() && cfg.data.eval_interval > 0 && trainer.has_validation() &&
        (step % cfg.data.eval_interval == 0 || step == cfg.optim.total_steps))
    {
      comm.set_phase(strf("the evaluation after step %ld", step));
      val_loss = trainer.evaluate();  // every rank takes part
    }
    const auto groups_after = group_stats();
    for (size_t g = 0; g < by_group.size(); ++g) by_group[g].second = groups_after[g].second - by_group[g].second;
    metrics.log_step(s, comm.stats() - before, val_loss, by_group);
    before = comm.stats();  // the agreement on stopping below counts in the next step's record
    if (!s.nonfinite.empty()) on_nonfinite_step(s, cfg, checkpoints);  // throws to stop the run

    // All ranks stop after the same step when any got a signal or saw its save fail.
    const std::vector<int64_t> ranks_with = comm.count_over_ranks({stop_requested != 0, checkpoints.failed()});
    if (ranks_with[1] > 0) {
      checkpoints.finish();  // throws the failure where this rank knows it
      throw std::runtime_error("saving the checkpoint failed on another rank (see the log of rank 0)");
    }
    const bool stopping = ranks_with[0] > 0;
    const auto saved = checkpoints.save_if_due(trainer, stopping);  // written in the background
    if (saved) zb::log::info(strf("saving checkpoint %s", saved->c_str()));
    if (stopping) {
      comm.set_phase("");  // the writers' waits have their own bound
      checkpoints.finish();
      zb::log::warn(strf("stopped by a signal after step %ld%s", step,
                         saved ? " (checkpoint saved)" : " (no ckpt.path: nothing saved)"));
      return 0;
    }
  }
  comm.set_phase("");
  checkpoints.finish();  // the last checkpoint is on disk before we exit
  zb::log::info(strf("done: %ld steps, %s tokens in %s", cfg.optim.total_steps,
                     zb::with_commas(cfg.optim.total_steps * trainer.tokens_per_step()).c_str(),
                     zb::format_duration(metrics.elapsed_seconds()).c_str()));
  return 0;
}

}  // namespace

namespace zb {

int training_main(int argc, char** argv, Parallelism parallelism, const char* program, bool over_nodes,
                  const Trainer::GradientHook& gradient_hook) {
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
      zb::validate(cl.config, zb::detect_world().size);  // the world the launcher variables describe
      std::cout << zb::resolved_run(cl.config).dump(2) << "\n";
      return 0;
    }
    if (cl.print_plan_rank >= 0) {
      std::cout << plan_json(cl, parallelism, over_nodes).dump(1) << "\n";
      return 0;
    }
    return run(cl, parallelism, over_nodes, gradient_hook);
  } catch (const zb::ConfigError& e) {
    zb::log::error(std::string("config error: ") + e.what());
    return 2;
  } catch (const std::exception& e) {
    zb::log::error("error: " + error_text(e));
    return 1;
  }
}

}  // namespace zb
