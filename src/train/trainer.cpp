#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/zeros.h>

#include "fsdp/sharded_muon.h"

namespace zb {

Trainer::Trainer(const Config& config, Communicator& comm, c10::Device device)
    : config_(config), comm_(comm), device_(device) {
  compute_dtype_ = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (config.runtime.compute_dtype == "float32") compute_dtype_ = at::kFloat;
  if (config.runtime.compute_dtype == "bfloat16") compute_dtype_ = at::kBFloat16;

  // Same seed on every rank: every rank builds the same full model, then keeps its shards.
  at::manual_seed(static_cast<uint64_t>(config.runtime.seed));
  model_ = std::make_unique<Llama>(resolve_model_args(config), at::TensorOptions().device(device));
  model_->init_weights();
  model_->set_compute_dtype(compute_dtype_);

  FSDPOptions fsdp;
  fsdp.compute_dtype = compute_dtype_;
  fsdp.reshard_after_forward = config.train.reshard_after_forward;
  fsdp.checkpoint_every = config.train.ac_ckpt;
  engine_ = std::make_unique<FSDPEngine>(*model_, comm, fsdp);

  optimizer_ = std::make_unique<Optimizer>(config, engine_->sharded_parameters(), engine_->global_shapes());
  if (optimizer_->muon() && comm.size() > 1) make_muon_sharded(*optimizer_->muon(), comm);

  data_ = std::make_unique<FakeDataset>(static_cast<uint64_t>(config.runtime.seed),
                                        config.data.seq_length, model_->args().vocab_size,
                                        config.optim.batch_size, config.train.micro_bs,
                                        comm.rank(), comm.size());
  schedule_ = {config.optim.sched_type, config.optim.warmup_steps, config.optim.stable_steps,
               config.optim.total_steps};
  accum_ = zb::grad_accum_steps(config, comm.size());
}

StepStats Trainer::train_step() {
  ++step_;
  // Forward/backward over this rank's micro-batches. Each loss is divided by the number of
  // micro-batches, so the accumulated gradient is that of the mean over the rank's samples; the
  // engine averages over ranks when it reduce-scatters on the last micro-batch.
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions().device(device_));
  for (int64_t micro = 0; micro < accum_; ++micro) {
    Batch batch = data_->next();
    at::Tensor inputs = batch.inputs.to(device_, /*non_blocking=*/true);
    at::Tensor targets = batch.targets.to(device_, /*non_blocking=*/true);
    engine_->set_requires_gradient_sync(micro == accum_ - 1);
    at::Tensor loss = cross_entropy(engine_->forward(inputs), targets) / static_cast<double>(accum_);
    loss.backward();
    engine_->finish_backward();
    loss_sum += loss.detach();
  }
  const at::Tensor grad_norm = engine_->clip_grad_norm_(config_.optim.max_norm);
  const double lr_multiplier = schedule_.multiplier(step_);
  optimizer_->step(lr_multiplier);
  for (at::Tensor p : engine_->sharded_tensors()) p.mutable_grad().reset();

  // The reported loss is the mean over the global batch: average the ranks' means.
  loss_sum /= static_cast<double>(comm_.size());
  comm_.all_reduce_sum(loss_sum).wait();
  StepStats stats;
  stats.step = step_;
  stats.loss = loss_sum.item<double>();  // the step's one host synchronisation (with the norm)
  stats.grad_norm = grad_norm.item<double>();
  stats.learning_rates = optimizer_->learning_rates(lr_multiplier);
  return stats;
}

}  // namespace zb
