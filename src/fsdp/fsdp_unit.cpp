#include "fsdp/fsdp_unit.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>

#include "fsdp/fsdp_collectives.h"
#include "util/phase.h"

namespace zb {

namespace {
const char* state_name(FSDPUnit::TrainingState s) {
  switch (s) {
    case FSDPUnit::TrainingState::Idle: return "IDLE";
    case FSDPUnit::TrainingState::Forward: return "FORWARD";
    case FSDPUnit::TrainingState::PreBackward: return "PRE_BACKWARD";
    case FSDPUnit::TrainingState::PostBackward: return "POST_BACKWARD";
  }
  return "?";
}
}  // namespace

FSDPUnit::FSDPUnit(int64_t index, std::string name, std::vector<Part> parts, bool reshard_after_forward,
                   FSDPCommContext& context, Communicator* replicas, bool keep_unsharded, const KernelChoices& kernels)
    : index_(index), name_(std::move(name)), replicas_(replicas), reshard_after_forward_(reshard_after_forward),
      keep_unsharded_(keep_unsharded && !replicas), context_(context), accumulator_(kernels) {
  parts_.reserve(parts.size());
  for (Part& part : parts) {
    if (part.params.empty()) continue;
    Shards& s = parts_.emplace_back();
    s.first = params_.size();
    s.comm = part.comm;
    s.averaged_over = part.averaged_over;
    for (FSDPParam* p : part.params) {
      s.offsets.push_back(s.block_numel);
      s.block_numel += p->shard.block_numel();
      s.byte_offsets.push_back(s.block_bytes);
      s.block_bytes += p->gather_bytes();
      s.bytes = s.bytes || p->float8_gather;
      params_.push_back(p);
    }
    s.params = std::move(part.params);
    keep_unsharded_ = keep_unsharded_ && s.alone();
  }
}

void FSDPUnit::transition(std::initializer_list<TrainingState> from, TrainingState to, const char* call) {
  TORCH_CHECK(std::find(from.begin(), from.end(), training_state_) != from.end(), "FSDP unit ", name_,
              ": ", call, " in state ", state_name(training_state_));
  training_state_ = to;
}

// --- the calls the engine makes -------------------------------------------------------------------

void FSDPUnit::pre_forward() {
  transition({TrainingState::Idle}, TrainingState::Forward, "pre_forward");
  wait_unshard();
  fill_slots();
}

void FSDPUnit::post_forward() {
  transition({TrainingState::Forward}, TrainingState::Idle, "post_forward");
  if (reshard_after_forward()) reshard();
}

void FSDPUnit::pre_backward() {
  // Again from PRE_BACKWARD when an activation-checkpointing recompute follows the hook.
  transition({TrainingState::Idle, TrainingState::PreBackward}, TrainingState::PreBackward, "pre_backward");
  wait_unshard();
}

void FSDPUnit::post_backward(const std::vector<at::Tensor>& grads) {
  Phase phase("zb.fsdp.post_backward", name_);
  transition({TrainingState::Idle, TrainingState::PreBackward}, TrainingState::PostBackward, "post_backward");
  at::NoGradGuard no_grad;
  // Every node that used this unit's parameters has run (they produced these gradients): the
  // gathered copies can go now rather than at the end of backward (a kept cast stays).
  if (!keep_unsharded_) reshard();
  std::vector<std::vector<int64_t>> shapes;
  for (FSDPParam* p : params_) shapes.push_back(p->full_shape);
  const GradientTotals total =
      accumulator_.add(grads, shapes, params_.front()->sharded.device(), requires_gradient_sync);
  if (requires_gradient_sync) {
    for (Shards& part : parts_) {
      if (part.alone() && !replicas_) add_whole_gradients(part, total);
      else start_reduction(part, total.sums);
    }
  }
  trace(StepEvent::Op::Backward);
}

void FSDPUnit::start_reduction(Shards& part, const std::vector<at::Tensor>& total) {
  Phase phase("zb.fsdp.reduce_scatter", name_);
  const auto first = total.begin() + static_cast<std::ptrdiff_t>(std::min(part.first, total.size()));
  const auto last = total.begin() + static_cast<std::ptrdiff_t>(std::min(part.first + part.params.size(), total.size()));
  at::Tensor reduce_in = reduce_scatter_input(part.params, {first, last}, part.block_numel, part.comm->size(),
                                              part.averaged_over * (replicas_ ? replicas_->size() : 1));
  if (context_.reducing && context_.reducing != this) context_.reducing->advance_gradients();
  StepTrace::UnitScope as_mine(context_.trace, index_);
  context_.reducing = this;
  part.reduce_out = at::empty({part.block_numel}, reduce_in.options());
  part.reduce = part.comm->reduce_scatter_sum(part.reduce_out, reduce_in);
  grad_state_ = GradState::Reducing;
}

void FSDPUnit::advance_gradients() {
  if (grad_state_ != GradState::Reducing) return;
  Phase phase("zb.fsdp.finish_reduce_scatter", name_);  // wait, then the replicas' all-reduce
  if (context_.reducing == this) context_.reducing = nullptr;
  for (Shards& part : parts_) part.reduce.wait();  // also releases the collective's input buffer
  if (!replicas_) return complete_gradients();
  // Every replica reduced the same rows over its own samples: their sum is the global mean.
  if (context_.replicating && context_.replicating != this) context_.replicating->finish_gradients();
  context_.replicating = this;
  StepTrace::UnitScope as_mine(context_.trace, index_);
  for (Shards& part : parts_)
    if (part.reduce_out.defined()) part.replicate = replicas_->all_reduce_sum(part.reduce_out);
  grad_state_ = GradState::Replicating;
}

void FSDPUnit::finish_gradients() {
  advance_gradients();
  if (grad_state_ != GradState::Replicating) return;
  Phase phase("zb.fsdp.finish_all_reduce", name_);
  if (context_.replicating == this) context_.replicating = nullptr;
  for (Shards& part : parts_) part.replicate.wait();
  complete_gradients();
}

void FSDPUnit::add_whole_gradients(const Shards& part, const GradientTotals& total) {
  // One rank and no replicas: its sums are the mean's gradient, every row of it. Added as they
  // are (the fp32 copy of a compute-dtype gradient is exact), without the collective's staging.
  // The accumulator's own sums (several micro-batches) become the gradients themselves where they
  // fit as they are: no copy. The experts of one rank under expert parallelism have gradients
  // from every rank of the shard group: divided by their number, in fp32, as the collective's
  // pre-division does.
  const double n = static_cast<double>(part.averaged_over);
  for (size_t k = 0; k < part.params.size(); ++k) {
    const size_t i = part.first + k;
    const at::Tensor& sharded = params_[i]->sharded;
    at::Tensor& grad = params_[i]->sharded.mutable_grad();
    const at::Tensor& g = i < total.sums.size() ? total.sums[i] : at::Tensor();
    if (grad.defined()) {
      if (g.defined()) grad.add_(n == 1 ? g : g.to(at::kFloat).div(n));
    } else if (!g.defined()) {
      grad = at::zeros_like(sharded);
    } else if (n == 1 && total.owned && g.scalar_type() == sharded.scalar_type() && g.sizes() == sharded.sizes() &&
               g.device() == sharded.device() && g.is_contiguous()) {
      grad = g;
    } else {
      grad = g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
      if (n != 1) grad.div_(n);
    }
  }
}

void FSDPUnit::complete_gradients() {
  for (Shards& part : parts_) {
    if (!part.reduce_out.defined()) continue;
    reduce_scatter_copy_out(part.params, part.offsets, part.reduce_out);
    part.reduce_out = at::Tensor();
  }
  grad_state_ = GradState::None;
}

// --- the sharded state ----------------------------------------------------------------------------

void FSDPUnit::issue_unshard() {
  if (state_ != State::Sharded) return;
  Phase phase("zb.fsdp.all_gather", name_);
  for (Shards& part : parts_) {
    // One rank holds every row: wait_unshard casts the shards straight into place, no buffers.
    if (part.alone()) continue;
    part.gather_in = part.bytes ? all_gather_input_bytes(part.params, part.byte_offsets, part.block_bytes)
                                : all_gather_input(part.params, part.offsets, part.block_numel);
    part.gather_out = at::empty({part.gather_in.numel() * part.comm->size()}, part.gather_in.options());
    StepTrace::UnitScope as_mine(context_.trace, index_);
    part.gather = part.comm->all_gather(part.gather_out, part.gather_in);
  }
  state_ = State::Gathering;
}

void FSDPUnit::wait_unshard() {
  if (state_ == State::Unsharded) {
    if (!keep_unsharded_ || cast_is_current()) return;
    Phase phase("zb.fsdp.wait_unshard", name_);
    cast_shards(params_);  // into the storages it keeps
    trace(StepEvent::Op::Unshard);
    return;
  }
  Phase phase("zb.fsdp.wait_unshard", name_);
  if (state_ == State::Sharded) issue_unshard();
  for (Shards& part : parts_) {
    part.gather.wait();
    if (part.alone()) cast_shards(part.params);
    else if (part.bytes) all_gather_copy_out_bytes(part.params, part.byte_offsets, part.gather_out, part.comm->size());
    else all_gather_copy_out(part.params, part.gather_out, part.comm->size());
    part.gather_in = at::Tensor();
    part.gather_out = at::Tensor();
  }
  state_ = State::Unsharded;
  trace(StepEvent::Op::Unshard);
}

void FSDPUnit::cast_shards(const std::vector<FSDPParam*>& params) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> into, from;
  for (FSDPParam* p : params) {
    p->allocate_unsharded();
    into.push_back(p->padded_blocks());  // one rank: its rows are the whole, unpadded
    from.push_back(p->sharded.detach().view({1, -1}));
  }
  at::_foreach_copy_(into, from);  // fp32 -> compute dtype, in one launch where CUDA can
  for (FSDPParam* p : params)
    if (p->float8_gather) float8_round_trip(*p);  // what a gather would deliver
  if (!keep_unsharded_) return;
  cast_versions_.clear();  // a kept cast: every part is one rank's, cast together
  for (FSDPParam* p : params_) cast_versions_.push_back(static_cast<int64_t>(p->sharded._version()));
  cast_current_ = true;
}

bool FSDPUnit::cast_is_current() const {
  if (!cast_current_ || cast_versions_.size() != params_.size()) return false;
  for (size_t i = 0; i < params_.size(); ++i)
    if (static_cast<int64_t>(params_[i]->sharded._version()) != cast_versions_[i]) return false;
  return true;
}

void FSDPUnit::reshard() {
  Phase phase("zb.fsdp.reshard", name_);
  for (Shards& part : parts_) {
    part.gather.wait();  // never free under an in-flight collective
    part.gather_in = at::Tensor();
    part.gather_out = at::Tensor();
  }
  if (state_ == State::Unsharded) trace(StepEvent::Op::Reshard);
  for (FSDPParam* p : params_) p->free_unsharded();
  state_ = State::Sharded;
}

void FSDPUnit::reset() {
  finish_gradients();
  if (!keep_unsharded_) reshard();
  training_state_ = TrainingState::Idle;
}

void FSDPUnit::fill_slots() {
  TORCH_CHECK(state_ == State::Unsharded, "unit ", name_, " used before it was gathered");
  std::vector<at::Tensor> shards;
  for (FSDPParam* p : params_) shards.push_back(p->sharded);
  const std::vector<at::Tensor> views = through_gradient_group(*this, shards);
  for (size_t i = 0; i < views.size(); ++i) *params_[i]->slot = views[i];
}

std::vector<at::Tensor> FSDPUnit::forward_views() {
  std::vector<at::Tensor> out;
  for (FSDPParam* p : params_) out.push_back(p->unsharded_view());
  return out;
}

}  // namespace zb
