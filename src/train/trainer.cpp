#include "train/trainer.h"

#include <ATen/Context.h>
#include <array>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>

#include "data/fake_data.h"
#include "data/token_dataset.h"
#include "ddp/ddp_engine.h"
#include "ddp/replicated_muon.h"
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

  optimizer_ = std::make_unique<Optimizer>(config, parallel_->sharded_parameters(), parallel_->global_shapes());
  if (optimizer_->muon() && comm.size() > 1) {
    if (parallelism == Parallelism::FSDP) make_muon_sharded(*optimizer_->muon(), comm);
    else make_muon_replicated(*optimizer_->muon(), comm);
  }

  // Data: token shards, or ZeroBand's fake documents. Shards are checked at start-up.
  const uint64_t seed = static_cast<uint64_t>(config.runtime.seed);
  const int64_t T = config.data.seq_length, V = model_->args().vocab_size;
  std::shared_ptr<const SampleSource> train_source;
  if (config.data.fake) {
    train_source = std::make_shared<FakeDataset>(seed, T, V);
    val_source_ = std::make_shared<FakeDataset>(seed + 1, T, V);
  } else if (config.data.dataset_ratio) {
    // Several datasets ("a,b") mixed by ratio ("70:30").
    std::vector<std::shared_ptr<const SampleSource>> parts;
    std::string paths = config.data.dataset_name_or_paths;
    for (size_t start = 0, comma; start <= paths.size(); start = comma + 1) {
      comma = paths.find(',', start);
      if (comma == std::string::npos) comma = paths.size();
      parts.push_back(std::make_shared<TokenDataset>(paths.substr(start, comma - start), T, V,
                                                     config.data.reverse_data_files));
    }
    std::vector<double> weights;
    try {
      weights = parse_ratio(*config.data.dataset_ratio, parts.size());
    } catch (const std::invalid_argument& e) {
      throw ConfigError(config.origin("data.dataset_ratio") + ": " + e.what());
    }
    train_source = std::make_shared<MixedSource>(parts, weights, seed);
    if (config.data.val_dataset_name_or_paths)
      val_source_ = std::make_shared<TokenDataset>(*config.data.val_dataset_name_or_paths, T, V);
  } else {
    train_source = std::make_shared<TokenDataset>(config.data.dataset_name_or_paths, T, V,
                                                  config.data.reverse_data_files);
    if (config.data.val_dataset_name_or_paths)
      val_source_ = std::make_shared<TokenDataset>(*config.data.val_dataset_name_or_paths, T, V);
  }
  data_ = std::make_unique<DataLoader>(train_source, seed, config.data.shuffle && !config.data.fake,
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
  for (at::Tensor p : parallel_->sharded_tensors()) p.mutable_grad().reset();

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

}  // namespace zb

namespace zb {

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
    parallel_->finish_backward();  // frees what forward gathered (no gradients to reduce)
  }
  sum /= static_cast<double>(config_.data.eval_batches * comm_.size());
  comm_.all_reduce_sum(sum).wait();
  return sum.item<double>();
}

}  // namespace zb

namespace zb {

void Trainer::restore_position(int64_t step, uint64_t seed) {
  step_ = step;
  const int64_t rows = step * accum_ * config_.train.micro_bs;  // this rank's rows per step
  data_->load_state({rows, seed, comm_.size()});
}

}  // namespace zb

namespace zb {

FSDPEngine& Trainer::engine() {
  auto* fsdp = dynamic_cast<FSDPEngine*>(parallel_.get());
  if (!fsdp) throw std::runtime_error("this needs the sharding engine (train_fsdp); not available under DDP");
  return *fsdp;
}

}  // namespace zb
