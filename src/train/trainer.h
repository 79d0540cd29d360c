#pragma once
// One training run's parts (train/build.h) wired together, torchtitan style: the model, the
// parallel engine that owns its parameters (sharded under FSDP, replicated under DDP), the
// optimizer on this rank's tensors, the data and the schedule; DiLoCo's outer optimizer is a hook
// around the steps (diloco/step_hook.h). train_step() is one optimizer step over the global batch,
// and reads as its parts: run_micro_batches, clipping, agree_on_step (the step's one all-reduce)
// and apply_or_skip. The loop of steps is train/training_loop.h's; checkpoints see the Trainer's
// parts that own state through a list of them (train/checkpoint_state.h).
#include <ATen/core/Tensor.h>

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "optim/lr_schedule.h"
#include "parallel/mesh.h"
#include "train/build.h"
#include "diloco/diloco.h"
#include "diloco/step_hook.h"
#include "parallel/expert_balance.h"
#include "parallel/qk_clip.h"
#include "observe/step_stats.h"
#include "util/device.h"

namespace zb {

// What the loop asks the ranks to agree on after a step: whether any got a stop signal or saw its
// last checkpoint save fail. They travel in the step's one all-reduce of its loss (no collective,
// no host synchronisation of their own: across slow links each is a round trip), read just before
// it: what a rank notices later (in the optimizer, an evaluation, a save) counts at the next step.
struct StepFlags {
  bool stop_requested = false;
  bool save_failed = false;
};
using StepFlagSource = std::function<StepFlags()>;

class Trainer {
 public:
  // Trains the parts build_training made (`config` as it was built from).
  Trainer(const Config& config, TrainingParts parts);
  // Builds the parts and trains them (build_training's arguments).
  Trainer(const Config& config, ParallelMesh mesh, c10::Device device, const MemoryChoices& autos = {});
  ~Trainer();  // detaches a step trace from the communicators it does not own

  StepStats train_step(const StepFlagSource& flags = nullptr);
  // Mean loss over data.eval_batches micro-batches per rank of the validation data (the same
  // batches every time), averaged over ranks. Requires validation data (or fake data).
  double evaluate();
  bool has_validation() const { return static_cast<bool>(parts_.data.validation); }

  // Steps taken, skipped ones included: the data's position and the checkpoint cadence follow it.
  int64_t step() const { return counters_.step; }
  // Steps not applied because they were not finite; the schedule is at step() - skipped_steps().
  int64_t skipped_steps() const { return counters_.skipped; }
  // A checkpoint's resume (or a DiLoCo joiner) sets them: the loop continues after counters().step.
  StepCounters& counters() { return counters_; }
  int64_t grad_accum_steps() const { return parts_.accum; }
  // Elastic DiLoCo (diloco.join): waits for the running run's next outer step, takes its state
  // from a live replica and continues after that step (step() says which).
  void join_run();
  // Gradients reduced on every micro-batch into sharded sums (train.reduce_every_micro_batch),
  // rather than summed whole in fp32 and reduced on the last.
  bool reduces_every_micro_batch() const { return parts_.reduce_every_micro_batch; }
  // The engine keeps the parameters' casts for the step (train.keep_unsharded, one rank per shard group).
  bool keeps_unsharded() const { return parts_.engine->keeps_unsharded(); }
  int64_t tokens_per_step() const { return config_.optim.batch_size * config_.data.seq_length; }
  const ModelArgs& model_args() const { return parts_.model->args(); }
  at::ScalarType compute_dtype() const { return parts_.compute_dtype; }
  const ParallelMesh& mesh() const { return parts_.mesh; }
  c10::Device device() const { return parts_.device; }
  // The token documents are cut at (model.attention = "document"), and whether the flash kernel
  // computes attention within them.
  const std::optional<DocumentDelimiter>& documents() const { return parts_.data.documents; }
  bool flash_documents() const { return parts_.attention.flash_documents; }
  const AttentionPath& attention() const { return parts_.attention; }
  // The attention kernel the steps run (model/attention.h's attention_kernel).
  const std::string& attention_kernel() const { return parts_.data.attention_kernel; }
  ParallelModel& parallel() { return *parts_.engine; }
  DiLoCo* diloco() { return parts_.diloco.get(); }  // null unless diloco.inner_steps
  const Config& config() const { return config_; }
  DataLoader& data_loader() { return *parts_.data.train; }
  DiLoCoHook* diloco_hook() { return diloco_.get(); }  // null unless diloco.inner_steps
  ExpertBalance* expert_balance() { return balance_.get(); }  // null unless model.num_experts
  Optimizer& optimizer() { return *parts_.optimizer; }
  // Records every step's events into `trace` from now on (the engine's, the collectives of every
  // communicator the step uses, and the micro-batch and optimizer marks), for comparison with
  // the step plan (plan/step_plan.h); null stops it. The caller clears it between steps.
  void set_step_trace(StepTrace* trace);

 private:
  // The micro-batches' forward and backward: the sum of their losses (each divided by their
  // number) on the device; each one's phase marks on the clock go to `marks`.
  at::Tensor run_micro_batches(std::vector<std::array<int, 3>>& marks);
  // The step's one all-reduce and host read: the loss over the global batch, whether any rank saw
  // a non-finite gradient norm, and the loop's flags. Every rank reads the same values.
  StepStats agree_on_step(const at::Tensor& loss_sum, const at::Tensor& grad_norm, const StepFlagSource& flags);
  // The optimizer's step at the schedule's multiplier, or none when the step was not finite
  // (parameters and optimizer state untouched, the schedule does not advance). Returns the
  // multiplier.
  double apply_or_skip(StepStats& stats);
  // What the engine takes of a batch on this device: its rows' tokens and targets with their
  // documents as attention reads them (none without documents); under context parallelism this
  // rank's positions of the rows (model_parallel/context_parallel.h) and the mask they attend through.
  struct EngineInput {
    at::Tensor inputs, targets;
    Documents documents;
  };
  EngineInput engine_input(const Batch& batch) const;
  // The step's times on the device, read from clock_: each micro-batch's forward and backward
  // (`marks`), the optimizer's from clipping on.
  void record_times(StepStats& stats, const std::vector<std::array<int, 3>>& marks, int optimizer_start,
                    int optimizer_done);
  Config config_;
  TrainingParts parts_;
  std::unique_ptr<DiLoCoHook> diloco_;  // diloco.inner_steps > 0 only
  std::unique_ptr<ExpertBalance> balance_;  // a mixture of experts only
  std::unique_ptr<QkClip> qk_clip_;  // logging.max_attention_logit or optim.optim.qk_clip_threshold
  LrSchedule schedule_;
  StepCounters counters_;
  int64_t skipped_in_a_row_ = 0;
  StepClock clock_;  // the phases of the current step
  StepTrace* trace_ = nullptr;
};

}  // namespace zb
