#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/isfinite.h>

#include <array>
#include <cmath>
#include <limits>

#include "data/sources.h"
#include "ddp/ddp_engine.h"
#include "fsdp/fsdp_engine.h"
#include "config/model_config.h"
#include "model/layers.h"
#include "optim/replicated_muon.h"
#include "optim/sharded_muon.h"
#include "optim/tensor_parallel_muon.h"
#include "parallel/tensor_parallel_group.h"
#include "util/phase.h"

namespace zb {

std::vector<std::pair<std::string, Communicator*>> Trainer::communication_groups() const {
  std::vector<std::pair<std::string, Communicator*>> out;
  if (shard_comm_) out.emplace_back("shard_group", shard_comm_.get());
  if (replicate_comm_) out.emplace_back("replicate_group", replicate_comm_.get());
  if (tp_comm_) out.emplace_back("tp_group", tp_comm_.get());
  return out;
}

HybridGroups make_hybrid_groups(const Config& config, Communicator& comm, Parallelism parallelism) {
  HybridGroups groups;
  const ShardLayout layout = shard_layout(config, comm.size());
  if (parallelism != Parallelism::FSDP || (layout.replicate == 1 && layout.tp == 1)) return groups;
  const int64_t r = comm.rank();
  const std::string tp_part = layout.tp > 1 ? "." + std::to_string(r % layout.tp) : "";
  groups.shard = comm.subgroup("shard" + std::to_string(layout.shard_group_of(r)) + tp_part,
                               layout.shard_group_ranks(r));
  if (layout.replicate > 1)
    groups.replicate = comm.subgroup("replicate" + std::to_string(r % (layout.shard * layout.tp)),
                                     layout.replicate_group_ranks(r));
  if (layout.tp > 1) groups.tp = comm.subgroup("tp" + std::to_string(r / layout.tp), layout.tp_group_ranks(r));
  return groups;
}

Trainer::Trainer(const Config& config, Communicator& comm, c10::Device device, Parallelism parallelism,
                 HybridGroups groups, std::optional<bool> reduce_every_micro_batch)
    : config_(config), comm_(comm), device_(device), clock_(device) {
  compute_dtype_ = resolve_compute_dtype(config, device);

  // Same seed on every rank: every rank draws the same initial values. Under FSDP the model's
  // parameters are shapes only, and the engine creates, initialises and shards them one at a
  // time (a 7B model would need 27 GB per rank whole); DDP keeps a whole replica anyway.
  // Hybrid sharding: shard within groups of consecutive ranks, replicate across them; tensor
  // parallelism within groups of consecutive ranks inside those.
  if (!groups.shard) groups = make_hybrid_groups(config, comm, parallelism);
  shard_comm_ = std::move(groups.shard);
  replicate_comm_ = std::move(groups.replicate);
  tp_comm_ = std::move(groups.tp);
  if (tp_comm_) tp_group_ = std::make_unique<CommTensorParallelGroup>(*tp_comm_);
  const ShardLayout layout = shard_layout(config, comm.size());
  data_rank_ = layout.data_parallel_rank(comm.rank());
  data_ranks_ = data_parallel_size(config, comm.size());

  at::manual_seed(static_cast<uint64_t>(config.runtime.seed));
  const bool sharded = parallelism == Parallelism::FSDP;
  model_ = std::make_unique<Llama>(resolve_model_args(config), at::TensorOptions().device(device),
                                   /*allocate_parameters=*/!sharded, tp_group_.get());
  model_->init_weights();  // the parameters it holds: none under FSDP
  model_->set_compute_dtype(compute_dtype_);
  Communicator* shard_comm = shard_comm_ ? shard_comm_.get() : &comm;
  // DiLoCo: no gradient crosses between replicas; the outer step does, every inner_steps steps.
  const bool diloco = config.diloco.inner_steps > 0;
  TORCH_CHECK(!diloco || sharded, "DiLoCo (diloco.inner_steps) runs over the shard groups of train_fsdp or train_hsdp");
  if (sharded) replica_ = layout.shard_group_of(comm.rank());
  if (diloco) replicas_ = layout.replicate;
  if (sharded) {
    FSDPOptions fsdp;
    fsdp.device = device;
    fsdp.compute_dtype = compute_dtype_;
    fsdp.reshard_after_forward = config.train.reshard_after_forward;
    fsdp.checkpoint_every = config.train.ac_ckpt;
    fsdp.keep_cast = config.train.keep_unsharded == "true";  // "auto" is resolved by the memory verdict
    parallel_ = std::make_unique<FSDPEngine>(*model_, *shard_comm, fsdp, diloco ? nullptr : replicate_comm_.get(),
                                             tp_comm_.get());
  } else {
    parallel_ = std::make_unique<DDPEngine>(*model_, comm, config.train.bucket_mb);
  }

  optimizer_ = std::make_unique<Optimizer>(config, parallel_->parameters());
  // Sharded Muon: matrices' owners inside the shard group. Replicas own the same matrices (of the
  // same, already all-reduced momentum): they split them, or each does all of them. Under DiLoCo
  // the replicas' momenta differ: each does its own.
  if (Muon* muon = optimizer_->muon()) {
    const bool split = config.parallel.muon_split_over_replicas && !diloco;
    if (!sharded && comm.size() > 1)
      make_muon_replicated(*muon, comm);
    else if (sharded && shard_comm->size() > 1)
      make_muon_sharded(*muon, *shard_comm, split ? replicate_comm_.get() : nullptr);
    else if (sharded && replicate_comm_ && split)
      make_muon_replicated(*muon, *replicate_comm_);  // shard groups of one: whole matrices
    // Under TP what the above assemble are slices: the TP group completes each matrix.
    if (tp_comm_) make_muon_tensor_parallel(*muon, *tp_comm_, config.parallel.muon_tp);
  }

  if (diloco)
    diloco_ = std::make_unique<DiLoCo>(config.diloco, parallel_->parameters(), model_->args().n_layers, *shard_comm,
                                       replicate_comm_.get(), tp_comm_.get());

  // Data: token shards, or ZeroBand's fake documents.
  const uint64_t seed = static_cast<uint64_t>(config.runtime.seed);
  DataSources sources = make_data_sources(config, model_->args().vocab_size);
  val_source_ = sources.validation;
  documents_ = sources.documents;
  flash_documents_ = varlen_flash_supported(device, compute_dtype_, model_->args().head_dim());
  use_sdpa_backend(config.runtime.sdpa_backend);
  use_varlen_kernel(config.runtime.varlen_kernel);
  use_fused_kernels(config.runtime.fused_kernels);
  if (config.runtime.fused_kernels) leave_unfused(split_operator_names(config.runtime.unfused));
  // Asked for this rank's heads: under TP each rank attends with its share of them.
  const ModelArgs& shape = model_->args();
  const TpShare heads = tp_share(shape, tp_comm_ ? tp_comm_->size() : 1);
  attention_kernel_ = zb::attention_kernel(device, compute_dtype_, config.data.seq_length, heads.heads,
                                           heads.kv_heads, shape.head_dim(), documents_.has_value(), flash_documents_);
  data_ = std::make_unique<DataLoader>(sources.train, seed, config.data.shuffle && !config.data.fake,
                                       config.optim.batch_size, config.train.micro_bs, data_rank_, data_ranks_);
  if (documents_) data_->set_documents(*documents_);
  // Batches are prepared on a background thread, in pinned memory for asynchronous GPU copies.
  data_->start_prefetch(4, device.is_cuda());
  schedule_ = {config.optim.sched_type, config.optim.warmup_steps, config.optim.stable_steps,
               config.optim.total_steps};
  accum_ = zb::grad_accum_steps(config, comm.size());
  reduce_every_micro_batch_ =
      reduce_every_micro_batch.value_or(config.train.reduce_every_micro_batch == "true") && accum_ > 1;
}

Trainer::~Trainer() {
  if (trace_) set_step_trace(nullptr);
}

void Trainer::set_step_trace(StepTrace* trace) {
  trace_ = trace;
  parallel_->set_trace(trace);
  comm_.observe(trace, "world");
  if (shard_comm_) shard_comm_->observe(trace, "shard");
  if (replicate_comm_) replicate_comm_->observe(trace, "replicate");
  if (tp_comm_) tp_comm_->observe(trace, "tp");
}

Documents Trainer::documents_of(const Batch& batch) const {
  return make_documents(batch.cu_seqlens, batch.max_document, batch.inputs.size(1), device_, compute_dtype_,
                        flash_documents_);
}

at::ScalarType Trainer::resolve_compute_dtype(const Config& config, const c10::Device& device) {
  if (config.runtime.compute_dtype == "float32") return at::kFloat;
  if (config.runtime.compute_dtype == "bfloat16") return at::kBFloat16;
  return device.is_cuda() ? at::kBFloat16 : at::kFloat;  // "auto"
}

StepStats Trainer::train_step(const StepFlagSource& flag_source) {
  ++step_;
  StepStats stats;
  // DiLoCo's outer copies start from the parameters the run begins with (initial weights loaded
  // after construction included), unless a checkpoint restored them.
  if (diloco_ && !outer_restored_) {
    diloco_->start();
    outer_restored_ = true;
  }
  // Phase boundaries on the device's timeline (CUDA events on a GPU): read after the step's
  // synchronisation below, so timing adds none.
  clock_.clear();
  std::vector<std::array<int, 3>> micro_marks;  // before forward, after forward, after backward
  // Forward/backward over this rank's micro-batches. Each loss is divided by the number of
  // micro-batches, so the accumulated gradient is that of the mean over the rank's samples; the
  // engine averages over ranks when it reduce-scatters on the last micro-batch.
  at::Tensor loss_sum = at::zeros({1}, at::TensorOptions().device(device_));
  for (int64_t micro = 0; micro < accum_; ++micro) {
    if (trace_) trace_->record(StepEvent::micro_batch_start(micro));
    Phase micro_batch("zb.micro_batch", micro);
    Batch batch;
    {
      Phase phase("zb.data");
      batch = data_->next();
    }
    at::Tensor inputs = batch.inputs.to(device_, /*non_blocking=*/true);
    at::Tensor targets = batch.targets.to(device_, /*non_blocking=*/true);
    // Reduced now, or summed locally until the last micro-batch (the engines' accumulators).
    parallel_->set_requires_gradient_sync(reduce_every_micro_batch_ || micro == accum_ - 1);
    const int start = clock_.mark();
    const Documents documents = documents_of(batch);
    at::Tensor loss;
    {
      Phase phase("zb.forward");
      loss = parallel_->loss(inputs, targets, documents) / static_cast<double>(accum_);
    }
    const int forward_done = clock_.mark();
    {
      Phase phase("zb.backward");
      loss.backward();
      parallel_->finish_backward();
    }
    micro_marks.push_back({start, forward_done, clock_.mark()});
    loss_sum += loss.detach();
  }
  if (gradient_hook_) gradient_hook_(step_, *parallel_);
  if (trace_) trace_->record(StepEvent::Op::Optimizer, -1);
  const int optimizer_start = clock_.mark();
  at::Tensor grad_norm;
  {
    Phase phase("zb.clip");
    grad_norm = parallel_->clip_grad_norm_(config_.optim.max_norm);
  }
  // One all-reduce: the mean loss over the global batch (the ranks' means averaged), how many
  // ranks see a non-finite gradient norm (under DDP each computes it from its own replica), so
  // that every rank takes the same decision on applying the step, and how many raise each of the
  // loop's flags.
  // Under DiLoCo each replica's mean has its own slot (replicas_ of them, then the counts); the loss
  // is their mean. Every replica skips a step that is not finite on any, so that steps stay aligned.
  const at::Tensor norm = grad_norm.reshape({1}).to(at::kFloat);
  const int64_t slot = diloco_ ? replica_ : 0;
  at::Tensor reduced = at::zeros({replicas_ + 3}, loss_sum.options());
  reduced.narrow(0, slot, 1).copy_(loss_sum / static_cast<double>(comm_.size() / replicas_));
  reduced.narrow(0, replicas_, 1).copy_(at::isfinite(norm).logical_not().to(at::kFloat));
  const StepFlags flags = flag_source ? flag_source() : StepFlags{};  // as late as the all-reduce allows
  if (flags.stop_requested) reduced.narrow(0, replicas_ + 1, 1).fill_(1.0);
  if (flags.save_failed) reduced.narrow(0, replicas_ + 2, 1).fill_(1.0);
  comm_.all_reduce_sum(reduced).wait();
  // The step's host synchronisation before the optimizer (the clock's below ends the step).
  const at::Tensor host = at::cat({reduced, norm}).cpu();
  stats.step = step_;
  for (int64_t r = 0; r < replicas_; ++r) stats.loss += host[r].item<double>() / static_cast<double>(replicas_);
  if (replicas_ > 1)
    for (int64_t r = 0; r < replicas_; ++r) stats.replica_losses.push_back(host[r].item<double>());
  stats.ranks_stopping = std::lround(host[replicas_ + 1].item<double>());
  stats.ranks_failed_save = std::lround(host[replicas_ + 2].item<double>());
  stats.grad_norm = host[replicas_ + 3].item<double>();
  if (host[replicas_].item<double>() > 0 && std::isfinite(stats.grad_norm))  // not finite on another rank
    stats.grad_norm = std::numeric_limits<double>::quiet_NaN();
  const double lr_multiplier = schedule_.multiplier(step_ - skipped_);  // skipped steps do not count
  if (std::isfinite(stats.loss) && std::isfinite(stats.grad_norm)) {
    Phase phase("zb.optimizer");
    optimizer_->step(lr_multiplier);
    skipped_in_a_row_ = 0;
  } else {  // not applied: parameters, momentum and Adam state stay as they are
    stats.nonfinite = !std::isfinite(stats.loss) ? (std::isfinite(stats.grad_norm) ? "loss" : "loss and gradient norm")
                                                 : "gradient norm";
    ++skipped_;
    ++skipped_in_a_row_;
  }
  // Whether or not the step was applied: the next step casts afresh (one cast a step, as planned).
  parallel_->parameters_changed();
  const int optimizer_done = clock_.mark();
  // The device's times are read once it has finished the step (the optimizer ran after the host's
  // read above): one wait for the step's end, which the loop's next host read would make anyway.
  clock_.synchronize();
  comm_.settle();
  for (const ShardedParameter& p : parallel_->parameters()) p.tensor->mutable_grad().reset();
  // DiLoCo's outer steps due after this step, once the gradients are freed (its temporaries take
  // their place).
  if (diloco_) {
    stats.outer = diloco_->after_step(step_, config_.optim.total_steps);
    parallel_->parameters_changed();
  }
  stats.skipped_in_a_row = skipped_in_a_row_;
  stats.skipped_total = skipped_;
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
  Phase phase("zb.evaluate");
  // A fresh loader each time: the same batches at every evaluation, split over the ranks.
  const int64_t per_rank = config_.data.eval_batches * config_.train.micro_bs;
  DataLoader loader(val_source_, 0, /*shuffle=*/false, per_rank * data_ranks_, config_.train.micro_bs, data_rank_,
                    data_ranks_);
  if (documents_) loader.set_documents(*documents_);
  at::NoGradGuard no_grad;
  at::Tensor sum = at::zeros({1}, at::TensorOptions().device(device_));
  for (int64_t i = 0; i < config_.data.eval_batches; ++i) {
    Batch b = loader.next();
    sum += parallel_->loss(b.inputs.to(device_), b.targets.to(device_), documents_of(b));
    parallel_->reshard();  // frees what forward gathered
  }
  sum /= static_cast<double>(config_.data.eval_batches * comm_.size());
  comm_.all_reduce_sum(sum).wait();
  const double mean = sum.item<double>();
  comm_.settle();
  return mean;
}

std::vector<StateTensor> Trainer::state() {
  std::vector<StateTensor> state = training_state(*parallel_, *optimizer_);
  if (!diloco_) return state;
  // The inner parameters and optimizer state are each replica's own; the outer ones are shared.
  for (StateTensor& t : state) t.per_replica = !t.global_shape.empty();
  for (StateTensor& t : diloco_->state()) state.push_back(std::move(t));
  for (StateTensor& t : state)
    if (t.per_replica) t.name = "replica_" + std::to_string(replica_) + "/" + t.name;
  return state;
}

void Trainer::prepare_restore(int64_t step) {
  if (diloco_) diloco_->prepare_restore(step, config_.optim.total_steps);
}

void Trainer::restore_position(int64_t step, int64_t skipped, uint64_t seed) {
  if (diloco_) {  // the checkpoint held the outer copies and the exchanges in flight
    outer_restored_ = true;
    diloco_->restore(step, config_.optim.total_steps);
  }
  step_ = step;
  skipped_ = skipped;
  skipped_in_a_row_ = 0;
  const int64_t rows = step * accum_ * config_.train.micro_bs;  // this rank's rows per step
  data_->load_state({rows, seed, data_ranks_});
}

}  // namespace zb
