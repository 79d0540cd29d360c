#include "train/training_loop.h"

#include <nlohmann/json.hpp>

#include <csignal>
#include <fstream>
#include <stdexcept>
#include <string>

#include "observe/metrics_follower.h"
#include "observe/metrics_logger.h"
#include "observe/profiler.h"
#include "plan/run_policy.h"
#include "util/error_text.h"
#include "util/fault_points.h"
#include "util/fs.h"
#include "util/log.h"
#include "util/phase.h"

namespace zb {

namespace {

// SIGTERM (preemption) and SIGINT (Ctrl-C) ask the loop to finish the current step, save and
// end (the next step, when the signal comes after the step's all-reduce: StepFlags).
volatile std::sig_atomic_t stop_requested = 0;
void request_stop(int) { stop_requested = 1; }

// Rank 0: the resolved run beside the metrics file (<stem>.config.json, the W&B run's config), and
// the metrics follower started when W&B or TensorBoard is on.
void record_run(const Config& config, const Trainer& trainer, const std::string& metrics_path, bool resumed) {
  if (const std::string path = run_config_path(metrics_path); !path.empty()) {
    nlohmann::json run = resolved_run(config);
    run["resolved_reduce_every_micro_batch"] = trainer.reduces_every_micro_batch();
    run["resolved_keep_unsharded"] = trainer.keeps_unsharded();
    const MeshShape& mesh = trainer.mesh().shape();
    run["resolved_mesh"] = {{"dp_shard_cp", mesh.dp_shard_cp}, {"dp_replicate", mesh.replicate}, {"tp", mesh.tp},
                            {"cp", mesh.cp}};
    const AttentionPath& attention = trainer.attention();
    run["resolved_attention"] = {{"kernel", trainer.attention_kernel()},
                                 {"flash_documents", attention.flash_documents},
                                 {"mask", attention.mask()},
                                 {"cp_ring", attention.cp_ring()}};
    std::ofstream(path) << run.dump(2) << "\n";
  }
  start_metrics_follower(config, metrics_path, resumed);
}

}  // namespace

TrainingLoop::TrainingLoop(const Config& config, Trainer& trainer, Communicator& world, CheckpointWriter& checkpoints,
                           TrainingState& saved, std::optional<int64_t> predicted_peak)
    : config_(config),
      trainer_(trainer),
      world_(world),
      checkpoints_(checkpoints),
      saved_(saved),
      predicted_peak_(predicted_peak) {}

void TrainingLoop::run() {
  const Config& cfg = config_;
  const int64_t rank = world_.rank();
  std::signal(SIGTERM, request_stop);
  std::signal(SIGINT, request_stop);
  const bool resumed = trainer_.step() > 0;
  if (cfg.diloco.join) trainer_.join_run();  // waits for the running run's next outer step
  MetricsLogger metrics(cfg, trainer_.model_args(), world_, trainer_.mesh().named_groups(), trainer_.device(),
                        resumed);
  metrics.set_constant("attention_kernel", trainer_.attention_kernel());
  if (predicted_peak_) metrics.set_constant("predicted_peak_memory_bytes", *predicted_peak_);
  if (rank == 0) record_run(cfg, trainer_, metrics.path(), resumed);
  // Traces beside rank 0's metrics file, on every rank.
  const std::string run_dir =
      cfg.profiling.enable_profiling ? world_.rendezvous().exchange("run_dir", parent_directory(metrics.path())).front()
                                     : "";
  StepProfiler profiler(cfg.profiling, run_dir, rank, trainer_.device());
  const auto report_profile = [&](const std::optional<ProfileSummary>& summary) {
    if (summary && rank == 0)
      for (const auto& line : summary->describe(profiler.folder())) log::info(line);
  };
  // An error in a step's work with the other ranks (its training, its evaluation) names the step:
  // usually another rank died there.
  const bool distributed = world_.size() > 1;
  const auto failed_in = [&](int64_t step, const std::exception& e) {
    return std::runtime_error(
        strf("rank %ld failed in step %ld: %s", rank, step, error_text(e).c_str()) +
        (distributed ? " (a collective with the other ranks failed: one of them may have died or stopped "
                       "responding; runtime.timeout_s bounds the wait)"
                     : ""));
  };

  for (int64_t step = trainer_.step() + 1; step <= cfg.optim.total_steps; ++step) {
    world_.set_phase(strf("step %ld", step));  // a stall from here on is reported as this step's
    StepStats s;
    profiler.step_begin(step);
    try {
      Phase phase("zb.step", step);
      // The flags every rank counts in the step's all-reduce: a signal, a failed save.
      s = trainer_.train_step([&] { return StepFlags{stop_requested != 0, checkpoints_.failed()}; });
    } catch (const std::exception& e) {
      throw failed_in(step, e);
    }
    report_profile(profiler.step_end(step));
    std::optional<double> val_loss;
    if (s.nonfinite.empty() && cfg.data.eval_interval > 0 && trainer_.has_validation() &&
        (step % cfg.data.eval_interval == 0 || step == cfg.optim.total_steps))
    {
      world_.set_phase(strf("the evaluation after step %ld", step));
      try {
        val_loss = trainer_.evaluate();  // every rank takes part
      } catch (const std::exception& e) {
        throw failed_in(step, e);
      }
    }
    metrics.log_step(s, val_loss);
    fault_point({FaultPoint::AfterStep, step, rank == 0, [&] { checkpoints_.finish(); }});
    if (!s.nonfinite.empty()) {  // every rank saw the same all-reduced values and decides the same
      const NonfiniteDecision d = decide_nonfinite(s, cfg, checkpoints_.last_good());
      if (d.stop) throw std::runtime_error(d.message);
      log::warn(d.message);
    }

    // All ranks stop after the same step when any got a signal or saw its save fail (counted in
    // the step's all-reduce, before its optimizer: what came after it counts at the next step).
    if (s.ranks_failed_save > 0) {
      checkpoints_.finish();  // throws the failure where this rank knows it
      throw std::runtime_error("saving the checkpoint failed on another rank (see the log of rank 0)");
    }
    const bool stopping = s.ranks_stopping > 0;
    std::optional<std::string> saved;
    try {
      saved = checkpoints_.save_if_due(saved_, stopping);  // written in the background
    } catch (const std::exception& e) {  // a dead rank, or this rank's own disk
      throw std::runtime_error(
          strf("rank %ld failed in step %ld, saving its checkpoint: %s", rank, step, error_text(e).c_str()));
    }
    if (saved) log::info(strf("saving checkpoint %s", saved->c_str()));
    if (stopping) {
      report_profile(profiler.finish(step));
      world_.set_phase("");  // the writers' waits have their own bound
      checkpoints_.finish();
      log::warn(strf("stopped by a signal after step %ld%s", step,
                     saved ? " (checkpoint saved)" : " (no ckpt.path: nothing saved)"));
      return;
    }
  }
  report_profile(profiler.finish(cfg.optim.total_steps));
  world_.set_phase("");
  checkpoints_.finish();  // the last checkpoint is on disk before we exit
  log::info(strf("done: %ld steps, %s tokens in %s", cfg.optim.total_steps,
                 with_commas(cfg.optim.total_steps * trainer_.tokens_per_step()).c_str(),
                 format_duration(metrics.elapsed_seconds()).c_str()));
}

}  // namespace zb
