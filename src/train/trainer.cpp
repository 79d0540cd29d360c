#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/isfinite.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include "checkpoint/state.h"
#include "dist/row_moves.h"
#include "model/context_parallel.h"
#include "observe/metrics_logger.h"
#include "util/log.h"
#include "util/phase.h"

namespace zb {

Trainer::Trainer(const Config& config, TrainingParts parts)
    : config_(config), parts_(std::move(parts)), clock_(parts_.device) {
  schedule_ = {config.optim.sched_type, config.optim.warmup_steps, config.optim.stable_steps,
               config.optim.total_steps};
}

Trainer::Trainer(const Config& config, ParallelMesh mesh, c10::Device device,
                 std::optional<bool> reduce_every_micro_batch)
    : Trainer(config, build_training(config, std::move(mesh), device, reduce_every_micro_batch)) {}

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
  const int64_t cp = parts_.mesh.shape().cp;
  if (cp == 1) {
    in.documents = make_documents(batch.cu_seqlens, batch.max_document, T, parts_.device, parts_.compute_dtype,
                                  parts_.data.flash_documents, parts_.kernels.cudnn_varlen);
    return in;
  }
  in.documents = parts_.data.flash_documents  // runtime.cp_varlen
                     ? cp_varlen_documents(batch.cu_seqlens, B, T, parts_.mesh.cp_rank(), cp, parts_.device)
                     : cp_documents(batch.cu_seqlens, B, T, parts_.mesh.cp_rank(), cp, parts_.device,
                                    parts_.compute_dtype, config_.parallel.cp_rotate == "ring");
  in.inputs = in.inputs.index_select(1, in.documents.positions);
  in.targets = in.targets.index_select(1, in.documents.positions);
  return in;
}

StepStats Trainer::train_step(const StepFlagSource& flags) {
  ++step_;
  // DiLoCo's outer copies start from the parameters the run begins with (initial weights loaded
  // after construction included), unless a checkpoint restored them.
  if (parts_.diloco && !outer_restored_) {
    parts_.diloco->start();
    outer_restored_ = true;
  }
  if (parts_.diloco && parts_.diloco->elastic() && !in_membership_) {  // round 0, at the run's (or resume's) start
    new_membership_ = follow(parts_.diloco->join(resumed_stream_rows_, step_ - 1));
    in_membership_ = true;
  }
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
  // Whether or not the step was applied: the next step casts afresh (one cast a step, as planned).
  parts_.engine->parameters_changed();
  const int optimizer_done = clock_.mark();

  // The device's times are read once it has finished the step (the optimizer ran after the host's
  // read in agree_on_step): one wait for the step's end, which the loop's next host read would
  // make anyway.
  clock_.synchronize();
  parts_.mesh.world().settle();
  for (const ShardedParameter& p : parts_.engine->parameters()) p.tensor->mutable_grad().reset();
  // Elastic DiLoCo: the membership it began the step in, when new (round 0, a joiner's admission);
  // one this step's outer round changes to replaces it.
  stats.membership = std::exchange(new_membership_, std::nullopt);
  // DiLoCo's outer steps due after this step, once the gradients are freed (its temporaries take
  // their place).
  if (parts_.diloco) {
    stats.outer = parts_.diloco->after_step(step_, config_.optim.total_steps, parts_.data.train->stream_rows_read());
    parts_.engine->parameters_changed();
    if (stats.outer && stats.outer->round && stats.outer->round->changed) {
      stats.membership = follow(*stats.outer->round);
      if (!stats.outer->round->joined.empty()) {
        try {
          share_state(*stats.outer->round);
        } catch (const std::exception& e) {  // the joiner's loss: the next round leaves it out
          log::warn(strf("DiLoCo: sending the joiners their state failed: %s", e.what()));
        }
      }
    }
  }
  stats.learning_rates = parts_.optimizer->learning_rates(lr_multiplier);
  for (const auto& [start, forward_done, backward_done] : micro_marks) {
    stats.forward_seconds += clock_.seconds(start, forward_done);
    stats.backward_seconds += clock_.seconds(forward_done, backward_done);
  }
  stats.optimizer_seconds = clock_.seconds(optimizer_start, optimizer_done);
  return stats;
}

void Trainer::join_run() {
  TORCH_CHECK(parts_.diloco && parts_.diloco->elastic(), "joining a run needs diloco.peers");
  RoundReport round = parts_.diloco->await_admission(config_.optim.total_steps);
  const auto start = std::chrono::steady_clock::now();
  const int64_t bytes = share_state(round);
  outer_restored_ = in_membership_ = true;  // the outer copies came with the state
  parts_.engine->parameters_changed();
  follow(round);
  log::info(strf("DiLoCo: took %s bytes of state (%s) from replica %ld in %.2f s; training on after step %ld",
                 with_commas(bytes).c_str(), round.with_optimizer ? "with its optimizer state" : "outer state only",
                 round.source,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), step_));
  new_membership_ = round;
}

int64_t Trainer::share_state(const RoundReport& round) {
  // Only the source and the joiners: the other members' links stay free.
  const std::unique_ptr<Communicator> group = parts_.diloco->transfer_group(round);
  if (!group) return 0;
  // A large state over a slow link takes longer than runtime.timeout_s; no collective of this
  // replica's world completes meanwhile, so its watchdog stands down (the group's own collectives
  // time out each). The loop's phase again after (apps/training_program.cpp).
  Communicator& world = parts_.mesh.world();
  world.set_phase("");
  const bool taking = !round.sends_state();
  at::Tensor counters = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  counters.data_ptr<int64_t>()[0] = step_;
  counters.data_ptr<int64_t>()[1] = skipped_;
  group->broadcast(counters, 0).wait();  // rank 0: the source's first shard rank
  step_ = counters[0].item<int64_t>();
  skipped_ = counters[1].item<int64_t>();
  int64_t bytes = taking ? counters.numel() * 8 : 0;
  at::NoGradGuard no_grad;
  std::vector<StateTensor> state = training_state(*parts_.engine, *parts_.optimizer);
  for (StateTensor& t : parts_.diloco->state()) state.push_back(std::move(t));
  // Not the parameters: right after the outer step they equal the outer copies on every member.
  std::vector<StateTensor> shared;
  for (StateTensor& t : state)
    if (t.name.rfind("model/", 0) != 0 && (round.with_optimizer || t.name.rfind("optim/", 0) != 0))
      shared.push_back(std::move(t));
  // The source's rows of each tensor go to the joiners' ranks that hold them in their own layout
  // (their shard counts may differ; dist/row_moves.h), a dtype at a time. A tensor every rank
  // holds whole (a scalar, replicated rows) comes from the source's rank 0.
  std::map<at::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t i = 0; i < shared.size(); ++i) by_dtype[shared[i].local.scalar_type()].push_back(i);
  for (const auto& [dtype, indices] : by_dtype) {
    std::vector<RowSpan> held, wanted;
    std::vector<int64_t> row_numel;
    std::vector<at::Tensor> local;
    for (size_t i : indices) {
      const StateTensor& t = shared[i];
      const bool whole = t.global_shape.empty() || t.replicated;
      const int64_t rows = t.local.dim() == 0 ? 1 : t.local.size(0);
      const RowSpan mine{whole ? 0 : t.row_start, rows};
      held.push_back(taking || (whole && group->rank() != 0) ? RowSpan{} : mine);
      wanted.push_back(taking ? mine : RowSpan{});
      int64_t per_row = 1;  // from the shape: a rank may hold no rows
      for (int64_t d = 1; d < t.local.dim(); ++d) per_row *= t.local.size(d);
      row_numel.push_back(per_row);
      local.push_back(t.local);
    }
    const RowMoves moves = RowMoves::plan(*group, held, wanted, row_numel);
    const at::Tensor got = moves.exchange(*group, local, local.front().options());
    bytes += got.numel() * static_cast<int64_t>(got.element_size());
    moves.take(got, local);
  }
  group->settle();
  if (taking) parts_.diloco->take_outer();
  world.set_phase(strf("step %ld", step_));
  return bytes;
}

RoundReport Trainer::follow(const RoundReport& round) {
  const Quorum& q = round.membership();
  parts_.data.train->reposition(q.stream_rows, round.member_index, static_cast<int64_t>(q.members.size()));
  return round;
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
  stats.step = step_;
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
  const double lr_multiplier = schedule_.multiplier(step_ - skipped_);  // skipped steps do not count
  if (std::isfinite(stats.loss) && std::isfinite(stats.grad_norm)) {
    Phase phase("zb.optimizer");
    parts_.optimizer->step(lr_multiplier);
    skipped_in_a_row_ = 0;
  } else {  // not applied: parameters, momentum and Adam state stay as they are
    stats.nonfinite = !std::isfinite(stats.loss) ? (std::isfinite(stats.grad_norm) ? "loss" : "loss and gradient norm")
                                                 : "gradient norm";
    ++skipped_;
    ++skipped_in_a_row_;
  }
  stats.skipped_in_a_row = skipped_in_a_row_;
  stats.skipped_total = skipped_;
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

void Trainer::restore_position(int64_t step, int64_t skipped, uint64_t seed, std::optional<DataPosition> data) {
  if (parts_.diloco) {  // the checkpoint held the outer copies and the exchanges in flight
    outer_restored_ = true;
    parts_.diloco->restore(step, config_.optim.total_steps);
  }
  step_ = step;
  skipped_ = skipped;
  skipped_in_a_row_ = 0;
  const int64_t rows = step * parts_.accum * config_.train.micro_bs;  // this rank's rows per step
  parts_.data.train->load_state({rows, seed, parts_.mesh.data_parallel_size()});
  // Saved at another batch size, the step count no longer says where the data stopped: the stream
  // position the checkpoint kept does (elastic replicas place themselves by it anyway).
  if (data && data->batch_size != config_.optim.batch_size && config_.diloco.peers.empty()) {
    parts_.data.train->reposition(data->stream_rows, 0, 1);
    log::info(strf("data: the checkpoint's batch was %ld rows, this run's %ld: reading on from stream row %ld",
                   data->batch_size, config_.optim.batch_size, data->stream_rows));
  }
  if (data && data->seq_length != config_.data.seq_length)
    log::warn(strf("data: the checkpoint's rows were %ld tokens, this run's %ld: the position is counted in rows, "
                   "so some text may be read again or skipped",
                   data->seq_length, config_.data.seq_length));
}

}  // namespace zb
