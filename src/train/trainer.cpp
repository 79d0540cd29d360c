#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/isfinite.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <utility>

#include "model_parallel/context_parallel.h"
#include "observe/metrics_logger.h"
#include "util/log.h"
#include "util/phase.h"

namespace zb {

Trainer::Trainer(const Config& config, TrainingParts parts)
    : config_(config), parts_(std::move(parts)), clock_(parts_.device) {
  schedule_ = {config.optim.sched_type, config.optim.warmup_steps, config.optim.stable_steps,
               config.optim.total_steps};
  if (parts_.diloco)  // over the parts as the program left them (a test may wrap the engine)
    diloco_ = std::make_unique<DiLoCoHook>(*parts_.diloco, *parts_.engine, *parts_.optimizer, *parts_.data.train,
                                           parts_.mesh.world(), config.optim.total_steps);
  if (config.logging.max_attention_logit || config.optim.optim.qk_clip_threshold > 0) {
    // A head's largest logit over the ranks whose weights it is: the world's, or a DiLoCo replica's.
    std::vector<Communicator*> over{&parts_.mesh.world()};
    if (config.diloco.inner_steps > 0 && parts_.mesh.sharded())
      over = {&parts_.mesh.shard_group(), parts_.mesh.tp_group()};
    qk_clip_ = std::make_unique<QkClip>(*parts_.model, std::move(over), config.optim.optim.qk_clip_threshold,
                                        config.optim.optim.qk_clip_alpha);
  }
  if (parts_.model->args().num_experts > 0) {
    balance_ = std::make_unique<ExpertBalance>(*parts_.model, parts_.mesh.world());
    parts_.model->set_aux_loss_scale(1.0 / static_cast<double>(parts_.accum));  // as each micro-batch's loss
  }
}

Trainer::Trainer(const Config& config, ParallelMesh mesh, c10::Device device, const MemoryChoices& autos)
    : Trainer(config, build_training(config, std::move(mesh), device, autos)) {}

Trainer::~Trainer() {
  if (trace_) set_step_trace(nullptr);
}

void Trainer::set_step_trace(StepTrace* trace) {
  trace_ = trace;
  parts_.engine->set_trace(trace);
  parts_.mesh.observe(trace);
}

Trainer::EngineInput Trainer::engine_input(const Batch& batch) const {
  EngineInput in{batch.inputs.to(parts_.device, /*non_blocking=*/true),
                 batch.targets.to(parts_.device, /*non_blocking=*/true), {}};
  const int64_t B = batch.inputs.size(0), T = batch.inputs.size(1);
  const AttentionPath& path = parts_.attention;
  const int64_t cp = path.cp;
  if (cp == 1) {
    in.documents = make_documents(batch.cu_seqlens, batch.max_document, T, parts_.device, parts_.compute_dtype,
                                  path.flash_documents, path.cudnn_varlen);
    return in;
  }
  in.documents = path.cp_packed()  // runtime.cp_varlen
                     ? cp_varlen_documents(batch.cu_seqlens, B, T, parts_.mesh.cp_rank(), cp, parts_.device)
                     : cp_documents(batch.cu_seqlens, B, T, parts_.mesh.cp_rank(), cp, parts_.device,
                                    parts_.compute_dtype, path.cp_ring());
  in.inputs = in.inputs.index_select(1, in.documents.positions);
  in.targets = in.targets.index_select(1, in.documents.positions);
  return in;
}

StepStats Trainer::train_step(const StepFlagSource& flags) {
  ++counters_.step;
  if (diloco_) diloco_->before_step(counters_);
  // Phase boundaries on the device's timeline (CUDA events on a GPU): read once the device has
  // finished the step, so timing adds no synchronisation.
  clock_.clear();
  std::vector<std::array<int, 3>> micro_marks;
  const at::Tensor loss_sum = run_micro_batches(micro_marks);

  if (trace_) trace_->record(StepEvent::Op::Optimizer, -1);
  const int optimizer_start = clock_.mark();
  at::Tensor grad_norm;
  {
    Phase phase("zb.clip");
    grad_norm = parts_.engine->clip_grad_norm_(config_.optim.max_norm);
  }
  StepStats stats = agree_on_step(loss_sum, grad_norm, flags);
  const double lr_multiplier = apply_or_skip(stats);
  // A mixture of experts' bias moves with an applied step, from the step's counts on every rank.
  if (balance_) stats.experts = balance_->step(stats.nonfinite.empty(), parts_.accum);
  // QK-clip scales the rows the optimizer just wrote (before the next step's casts of them).
  if (qk_clip_) {
    Phase phase("zb.qk_clip");
    const AttentionLogitStats logits = qk_clip_->step(stats.nonfinite.empty(), parts_.engine->parameters());
    stats.max_attention_logit = logits.max_by_layer;
    stats.qk_clipped_heads = logits.heads_clipped;
  }
  // Whether or not the step was applied: the next step casts afresh (one cast a step, as planned).
  parts_.engine->parameters_changed();
  const int optimizer_done = clock_.mark();

  // The device's times are read once it has finished the step (the optimizer ran after the host's
  // read in agree_on_step): one wait for the step's end, which the loop's next host read would
  // make anyway.
  clock_.synchronize();
  parts_.mesh.world().settle();
  for (const ShardedParameter& p : parts_.engine->parameters()) p.tensor->mutable_grad().reset();
  if (diloco_) {  // the outer steps due, once the gradients are freed (its temporaries take their place)
    DiLoCoStepReport outer = diloco_->after_step(counters_);
    stats.outer = std::move(outer.outer);
    stats.membership = std::move(outer.membership);
  }
  stats.learning_rates = parts_.optimizer->learning_rates(lr_multiplier);
  record_times(stats, micro_marks, optimizer_start, optimizer_done);
  return stats;
}

void Trainer::record_times(StepStats& stats, const std::vector<std::array<int, 3>>& marks, int optimizer_start,
                           int optimizer_done) {
  for (const auto& [start, forward_done, backward_done] : marks) {
    stats.forward_seconds += clock_.seconds(start, forward_done);
    stats.backward_seconds += clock_.seconds(forward_done, backward_done);
  }
  stats.optimizer_seconds = clock_.seconds(optimizer_start, optimizer_done);
}

void Trainer::join_run() {
  TORCH_CHECK(diloco_, "joining a run needs DiLoCo (diloco.inner_steps, diloco.peers)");
  diloco_->join_run(counters_);
}

at::Tensor Trainer::run_micro_batches(std::vector<std::array<int, 3>>& marks) {
  // Each loss is divided by the number of micro-batches, so the accumulated gradient is that of
  // the mean over the rank's samples; the engine averages over ranks when it reduces on the last
  // micro-batch (or on every one, into sharded sums).
  const int64_t accum = parts_.accum;
  ParallelModel& engine = *parts_.engine;
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions().device(parts_.device));
  for (int64_t micro = 0; micro < accum; ++micro) {
    if (trace_) trace_->record(StepEvent::micro_batch_start(micro));
    Phase micro_batch("zb.micro_batch", micro);
    Batch batch;
    {
      Phase phase("zb.data");
      batch = parts_.data.train->next();
    }
    const EngineInput in = engine_input(batch);
    engine.set_requires_gradient_sync(parts_.reduce_every_micro_batch || micro == accum - 1);
    const int start = clock_.mark();
    at::Tensor loss;
    {
      Phase phase("zb.forward");
      loss = engine.loss(in.inputs, in.targets, in.documents) / static_cast<double>(accum);
    }
    const int forward_done = clock_.mark();
    {
      Phase phase("zb.backward");
      loss.backward();
      engine.finish_backward();
    }
    marks.push_back({start, forward_done, clock_.mark()});
    loss_sum += loss.detach();
  }
  return loss_sum;
}

StepStats Trainer::agree_on_step(const at::Tensor& loss_sum, const at::Tensor& grad_norm,
                                 const StepFlagSource& flag_source) {
  // One all-reduce of [losses..., non-finite norms, stopping, failed saves]: the mean loss over the
  // global batch (the ranks' means averaged), how many ranks see a non-finite gradient norm (under
  // DDP each computes it from its own replica), so that every rank takes the same decision on
  // applying the step, and how many raise each of the loop's flags. Under DiLoCo each replica's
  // mean has its own slot; the loss is their mean, and every replica skips a step that is not
  // finite on any, so that steps stay aligned.
  Communicator& world = parts_.mesh.world();
  // DiLoCo's replicas (shard groups) train apart: each has its own slot for its mean loss.
  const int64_t replicas = parts_.diloco ? parts_.mesh.shape().replicate : 1;
  const at::Tensor norm = grad_norm.reshape({1}).to(at::kFloat);
  const int64_t slot = parts_.diloco ? parts_.mesh.replica() : 0;
  at::Tensor reduced = at::zeros({replicas + 3}, loss_sum.options());
  reduced.narrow(0, slot, 1).copy_(loss_sum / static_cast<double>(world.size() / replicas));
  reduced.narrow(0, replicas, 1).copy_(at::isfinite(norm).logical_not().to(at::kFloat));
  const StepFlags flags = flag_source ? flag_source() : StepFlags{};  // as late as the all-reduce allows
  if (flags.stop_requested) reduced.narrow(0, replicas + 1, 1).fill_(1.0);
  if (flags.save_failed) reduced.narrow(0, replicas + 2, 1).fill_(1.0);
  world.all_reduce_sum(reduced).wait();
  // The host reads the result before the optimizer: whether to apply the step depends on it.
  const at::Tensor host = at::cat({reduced, norm}).cpu();
  StepStats stats;
  stats.step = counters_.step;
  for (int64_t r = 0; r < replicas; ++r) stats.loss += host[r].item<double>() / static_cast<double>(replicas);
  if (replicas > 1)
    for (int64_t r = 0; r < replicas; ++r) stats.replica_losses.push_back(host[r].item<double>());
  stats.ranks_stopping = std::lround(host[replicas + 1].item<double>());
  stats.ranks_failed_save = std::lround(host[replicas + 2].item<double>());
  stats.grad_norm = host[replicas + 3].item<double>();
  if (host[replicas].item<double>() > 0 && std::isfinite(stats.grad_norm))  // not finite on another rank
    stats.grad_norm = std::numeric_limits<double>::quiet_NaN();
  return stats;
}

double Trainer::apply_or_skip(StepStats& stats) {
  const double lr_multiplier = schedule_.multiplier(counters_.step - counters_.skipped);  // skipped steps do not count
  if (std::isfinite(stats.loss) && std::isfinite(stats.grad_norm)) {
    Phase phase("zb.optimizer");
    parts_.optimizer->step(lr_multiplier);
    skipped_in_a_row_ = 0;
  } else {  // not applied: parameters, momentum and Adam state stay as they are
    stats.nonfinite = !std::isfinite(stats.loss) ? (std::isfinite(stats.grad_norm) ? "loss" : "loss and gradient norm")
                                                 : "gradient norm";
    ++counters_.skipped;
    ++skipped_in_a_row_;
  }
  stats.skipped_in_a_row = skipped_in_a_row_;
  stats.skipped_total = counters_.skipped;
  return lr_multiplier;
}

double Trainer::evaluate() {
  TORCH_CHECK(parts_.data.validation, "no validation data (data.val_dataset_name_or_paths)");
  Phase phase("zb.evaluate");
  // A fresh loader each time: the same batches at every evaluation, split over the ranks.
  const int64_t per_rank = config_.data.eval_batches * config_.train.micro_bs;
  const ParallelMesh& mesh = parts_.mesh;
  DataLoader loader(parts_.data.validation, 0, /*shuffle=*/false, per_rank * mesh.data_parallel_size(),
                    config_.train.micro_bs, mesh.data_parallel_rank(), mesh.data_parallel_size());
  if (parts_.data.documents) loader.set_documents(*parts_.data.documents);
  at::NoGradGuard no_grad;
  at::Tensor sum = at::zeros({1}, at::TensorOptions().device(parts_.device));
  for (int64_t i = 0; i < config_.data.eval_batches; ++i) {
    Batch b = loader.next();
    const EngineInput in = engine_input(b);
    sum += parts_.engine->loss(in.inputs, in.targets, in.documents);
    parts_.engine->reshard();  // frees what forward gathered
  }
  Communicator& world = mesh.world();
  sum /= static_cast<double>(config_.data.eval_batches * world.size());
  world.all_reduce_sum(sum).wait();
  const double mean = sum.item<double>();
  world.settle();
  return mean;
}

}  // namespace zb
