#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>

#include <array>

#include "data/sources.h"
#include "ddp/ddp_engine.h"
#include "ddp/replicated_muon.h"
#include "fsdp/fsdp_engine.h"
#include "fsdp/sharded_muon.h"
#include "model/model_config.h"

namespace zb {

Trainer::Trainer(const Config& config, Communicator& comm, c10::Device device, Parallelism parallelism)
    : config_(config), comm_(comm), device_(device), clock_(device) {
  compute_dtype_ = resolve_compute_dtype(config, device);

  // Same seed on every rank: every rank builds the same full model, then keeps its shards.
  at::manual_seed(static_cast<uint64_t>(config.runtime.seed));
  model_ = std::make_unique<Llama>(resolve_model_args(config), at::TensorOptions().device(device));
  model_->init_weights();
  model_->set_compute_dtype(compute_dtype_);

  if (parallelism == Parallelism::FSDP) {
    FSDPOptions fsdp;
    fsdp.compute_dtype = compute_dtype_;
    fsdp.reshard_after_forward = config.train.reshard_after_forward;
    fsdp.checkpoint_every = config.train.ac_ckpt;
    parallel_ = std::make_unique<FSDPEngine>(*model_, comm, fsdp);
  } else {
    parallel_ = std::make_unique<DDPEngine>(*model_, comm, config.train.bucket_mb);
  }

  optimizer_ = std::make_unique<Optimizer>(config, parallel_->parameters());
  if (optimizer_->muon() && comm.size() > 1) {
    if (parallelism == Parallelism::FSDP) make_muon_sharded(*optimizer_->muon(), comm);
    else make_muon_replicated(*optimizer_->muon(), comm);
  }

  // Data: token shards, or ZeroBand's fake documents.
  const uint64_t seed = static_cast<uint64_t>(config.runtime.seed);
  DataSources sources = make_data_sources(config, model_->args().vocab_size);
  val_source_ = sources.validation;
  data_ = std::make_unique<DataLoader>(sources.train, seed, config.data.shuffle && !config.data.fake,
                                       config.optim.batch_size, config.train.micro_bs, comm.rank(),
                                       comm.size());
  // Batches are prepared on a background thread, in pinned memory for asynchronous GPU copies.
  data_->start_prefetch(4, device.is_cuda());
  schedule_ = {config.optim.sched_type, config.optim.warmup_steps, config.optim.stable_steps,
               config.optim.total_steps};
  accum_ = zb::grad_accum_steps(config, comm.size());
}

at::ScalarType Trainer::resolve_compute_dtype(const Config& config, const c10::Device& device) {
  if (config.runtime.compute_dtype == "float32") return at::kFloat;
  if (config.runtime.compute_dtype == "bfloat16") return at::kBFloat16;
  return device.is_cuda() ? at::kBFloat16 : at::kFloat;  // "auto"
}

StepStats Trainer::train_step() {
  ++step_;
  StepStats stats;
  // Phase boundaries on the device's timeline (CUDA events on a GPU): read after the step's
  // synchronisation below, so timing adds none.
  clock_.clear();
  std::vector<std::array<int, 3>> micro_marks;  // before forward, after forward, after backward
  // Forward/backward over this rank's micro-batches. Each loss is divided by the number of
  // micro-batches, so the accumulated gradient is that of the mean over the rank's samples; the
  // engine averages over ranks when it reduce-scatters on the last micro-batch.
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions().device(device_));
  for (int64_t micro = 0; micro < accum_; ++micro) {
    Batch batch = data_->next();
    at::Tensor inputs = batch.inputs.to(device_, /*non_blocking=*/true);
    at::Tensor targets = batch.targets.to(device_, /*non_blocking=*/true);
    parallel_->set_requires_gradient_sync(micro == accum_ - 1);
    const int start = clock_.mark();
    at::Tensor loss = cross_entropy(parallel_->forward(inputs), targets) / static_cast<double>(accum_);
    const int forward_done = clock_.mark();
    loss.backward();
    parallel_->finish_backward();
    micro_marks.push_back({start, forward_done, clock_.mark()});
    loss_sum += loss.detach();
  }
  const int optimizer_start = clock_.mark();
  const at::Tensor grad_norm = parallel_->clip_grad_norm_(config_.optim.max_norm);
  const double lr_multiplier = schedule_.multiplier(step_);
  optimizer_->step(lr_multiplier);
  const int optimizer_done = clock_.mark();
  for (const ShardedParameter& p : parallel_->parameters()) p.tensor->mutable_grad().reset();

  // The reported loss is the mean over the global batch: average the ranks' means.
  loss_sum /= static_cast<double>(comm_.size());
  comm_.all_reduce_sum(loss_sum).wait();
  stats.step = step_;
  // The step's one host synchronisation (the loop adds one more for its stop flag).
  stats.loss = loss_sum.item<double>();
  stats.grad_norm = grad_norm.item<double>();
  stats.learning_rates = optimizer_->learning_rates(lr_multiplier);
  for (const auto& [start, forward_done, backward_done] : micro_marks) {
    stats.forward_seconds += clock_.seconds(start, forward_done);
    stats.backward_seconds += clock_.seconds(forward_done, backward_done);
  }
  stats.optimizer_seconds = clock_.seconds(optimizer_start, optimizer_done);
  return stats;
}

double Trainer::evaluate() {
  TORCH_CHECK(val_source_, "no validation data (data.val_dataset_name_or_paths)");
  // A fresh loader each time: the same batches at every evaluation, split over the ranks.
  const int64_t per_rank = config_.data.eval_batches * config_.train.micro_bs;
  DataLoader loader(val_source_, 0, /*shuffle=*/false, per_rank * comm_.size(),
                    config_.train.micro_bs, comm_.rank(), comm_.size());
  at::NoGradGuard no_grad;
  at::Tensor sum = at::zeros({1}, at::TensorOptions().device(device_));
  for (int64_t i = 0; i < config_.data.eval_batches; ++i) {
    Batch b = loader.next();
    sum += cross_entropy(parallel_->forward(b.inputs.to(device_)), b.targets.to(device_));
    parallel_->reshard();  // frees what forward gathered
  }
  sum /= static_cast<double>(config_.data.eval_batches * comm_.size());
  comm_.all_reduce_sum(sum).wait();
  return sum.item<double>();
}

void Trainer::restore_position(int64_t step, uint64_t seed) {
  step_ = step;
  const int64_t rows = step * accum_ * config_.train.micro_bs;  // this rank's rows per step
  data_->load_state({rows, seed, comm_.size()});
}

}  // namespace zb
