#pragma once
// One training run's components wired together (torchtitan style): the model, the parallel
// engine that owns its parameters (sharded under FSDP, replicated under DDP), the optimizer on
// this rank's tensors, the data and the schedule. train_step() is one optimizer step over the
// global batch.
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/state.h"
#include "config/config.h"
#include "data/loader.h"
#include "dist/comm.h"
#include "model/llama.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "parallel/parallel_model.h"
#include "train/diloco.h"
#include "util/device.h"

namespace zb {

struct StepStats {
  int64_t step = 0;
  double loss = 0;       // mean over the global batch
  double grad_norm = 0;  // before clipping (under DiLoCo: the first replica's)
  // Which of the loss and the gradient norm was not finite ("" when both were): such a step is
  // never applied (no update, optimizer state untouched, the schedule does not advance).
  std::string nonfinite;
  int64_t skipped_in_a_row = 0;  // non-finite steps up to this one, in a row
  int64_t skipped_total = 0;     // over the whole run, resumes included
  std::vector<std::pair<std::string, double>> learning_rates;
  // Time of the step's phases on the device, in seconds (forward includes the loss; backward
  // includes waiting for the gradients' collectives; optimizer includes clipping): host clock on
  // CPU, CUDA events on a GPU.
  double forward_seconds = 0, backward_seconds = 0, optimizer_seconds = 0;
  // DiLoCo: each replica's mean loss over its part of the batch, and the outer step this step
  // ended with, if any.
  std::vector<double> replica_losses;
  std::optional<OuterSyncStats> outer;
  // The loop's flags (StepFlags) counted over the ranks by the step's own all-reduce.
  int64_t ranks_stopping = 0, ranks_failed_save = 0;
};

// What the loop asks the ranks to agree on after a step: whether any got a stop signal or saw its
// last checkpoint save fail. They travel in the step's one all-reduce of its loss (no collective,
// no host synchronisation of their own: across slow links each is a round trip), read just before
// it: what a rank notices later (in the optimizer, an evaluation, a save) counts at the next step.
struct StepFlags {
  bool stop_requested = false;
  bool save_failed = false;
};
using StepFlagSource = std::function<StepFlags()>;

enum class Parallelism { FSDP, DDP };

// Hybrid sharding's groups: shard within groups of consecutive ranks, replicate across them (both
// null for FSDP over every rank and for DDP). Made before the trainer by a program that must
// know what its communicators hold before planning memory; otherwise the trainer makes them.
// The process groups of the layout beside the world (config.h's ShardLayout): a shard group
// and, with more than one replica, a replicate group when the shard group is not the world; a
// TP group with parallel.tp > 1.
struct HybridGroups {
  std::unique_ptr<Communicator> shard, replicate, tp;
};
// Every rank calls it at the same point: on NCCL each group is split from the world's communicator.
HybridGroups make_hybrid_groups(const Config& config, Communicator& comm, Parallelism parallelism);

class Trainer : public TrainingState {
 public:
  // Builds everything; the model is initialised from runtime.seed identically on every rank and
  // then sharded (FSDP) or replicated (DDP). `config` must be validated for comm.size() ranks.
  // `reduce_every_micro_batch`: train.reduce_every_micro_batch as the memory verdict resolved it
  // (train/run_policy.h); none: as the config says, "auto" off.
  Trainer(const Config& config, Communicator& comm, c10::Device device,
          Parallelism parallelism = Parallelism::FSDP, HybridGroups groups = {},
          std::optional<bool> reduce_every_micro_batch = std::nullopt);
  ~Trainer() override;  // detaches a step trace from the communicator it does not own

  StepStats train_step(const StepFlagSource& flags = nullptr);
  // runtime.compute_dtype on `device`: "auto" is bf16 on CUDA, fp32 on CPU.
  static at::ScalarType resolve_compute_dtype(const Config& config, const c10::Device& device);
  // Mean loss over data.eval_batches micro-batches per rank of the validation data (the same
  // batches every time), averaged over ranks. Requires validation data (or fake data).
  double evaluate();
  bool has_validation() const { return static_cast<bool>(val_source_); }

  // Steps taken, skipped ones included: the data's position and the checkpoint cadence follow it.
  int64_t step() const override { return step_; }
  // Steps not applied because they were not finite; the schedule is at step() - skipped_steps().
  int64_t skipped_steps() const override { return skipped_; }
  // After loading a checkpoint: continue after `step` steps (`skipped` of them not applied), the
  // data at the next global batch (the loader's position follows from the step, whatever the
  // world size).
  void restore_position(int64_t step, int64_t skipped, uint64_t seed) override;
  void prepare_restore(int64_t step) override;
  int64_t grad_accum_steps() const { return accum_; }
  // Gradients reduced on every micro-batch into sharded sums (train.reduce_every_micro_batch),
  // rather than summed whole in fp32 and reduced on the last.
  bool reduces_every_micro_batch() const { return reduce_every_micro_batch_; }
  // The engine keeps the parameters' casts for the step (train.keep_unsharded, one rank per shard group).
  bool keeps_unsharded() const { return parallel_->keeps_casts(); }
  int64_t tokens_per_step() const override { return config_.optim.batch_size * config_.data.seq_length; }
  const ModelArgs& model_args() const override { return model_->args(); }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // The token documents are cut at (model.attention = "document"), and whether the flash kernel
  // computes attention within them.
  const std::optional<DocumentDelimiter>& documents() const { return documents_; }
  bool flash_documents() const { return flash_documents_; }
  // The attention kernel the steps run (model/attention.h's attention_kernel).
  const std::string& attention_kernel() const { return attention_kernel_; }
  ParallelModel& parallel() override { return *parallel_; }
  // Under DiLoCo: the inner state under this replica's name, and the outer copies.
  std::vector<StateTensor> state() override;
  int64_t replica() override { return replica_; }
  // Hybrid sharding's groups by name ("shard_group": within a node under train_hsdp,
  // "replicate_group": across nodes), for the metrics' bytes by group; empty otherwise.
  std::vector<std::pair<std::string, Communicator*>> communication_groups() const;
  int64_t data_rows_consumed() const override { return data_->state().rows_consumed; }
  Optimizer& optimizer() override { return *optimizer_; }
  // Records every step's events into `trace` from now on (the engine's, the collectives of every
  // communicator the step uses, and the micro-batch and optimizer marks), for comparison with
  // the step plan (train/step_plan.h); null stops it. The caller clears it between steps.
  void set_step_trace(StepTrace* trace);
  // Called on every rank once the step's gradients are reduced, before they are clipped: where
  // tests put faults (tests/nonfinite_train.cpp). Production runs set none.
  using GradientHook = std::function<void(int64_t step, ParallelModel& model)>;
  void set_gradient_hook(GradientHook hook) { gradient_hook_ = std::move(hook); }

 private:
  Config config_;
  Communicator& comm_;
  c10::Device device_;
  at::ScalarType compute_dtype_;
  // Hybrid sharding's groups (both null for FSDP over every rank and for DDP): before the engine,
  // which uses them, so that they outlive it.
  std::unique_ptr<Communicator> shard_comm_, replicate_comm_, tp_comm_;
  std::unique_ptr<TensorParallelGroup> tp_group_;  // the model's view of tp_comm_
  std::unique_ptr<Llama> model_;
  std::unique_ptr<ParallelModel> parallel_;
  std::unique_ptr<Optimizer> optimizer_;
  // DiLoCo: the replicas (shard groups) train alone between outer steps. replica_ is this rank's
  // shard group under hybrid sharding (0 otherwise), replicas_ how many train apart (1 unless
  // DiLoCo). The outer copies start from the first step's parameters unless a checkpoint set them.
  std::unique_ptr<DiLoCo> diloco_;
  int64_t replica_ = 0, replicas_ = 1;
  int64_t data_rank_ = 0, data_ranks_ = 1;  // which rows of each batch this rank reads, of how many
  bool outer_restored_ = false;
  std::unique_ptr<DataLoader> data_;
  std::shared_ptr<const SampleSource> val_source_;
  std::optional<DocumentDelimiter> documents_;  // model.attention = "document"
  bool flash_documents_ = false;                // documents by the varlen flash kernel (attention.h)
  std::string attention_kernel_;
  LrSchedule schedule_;
  int64_t accum_ = 1;
  bool reduce_every_micro_batch_ = false;
  int64_t step_ = 0;
  int64_t skipped_ = 0, skipped_in_a_row_ = 0;
  GradientHook gradient_hook_;
  StepClock clock_;  // the phases of the current step
  StepTrace* trace_ = nullptr;

  // The batch's documents as attention reads them on this device (none without documents_).
  Documents documents_of(const Batch& batch) const;
};

}  // namespace zb
