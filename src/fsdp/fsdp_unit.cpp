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

FSDPUnit::FSDPUnit(int64_t index, std::string name, std::vector<FSDPParam*> params, Communicator& comm,
                   bool reshard_after_forward, FSDPCommContext& context, Communicator* replicas, bool keep_unsharded,
                   const KernelChoices& kernels)
    : index_(index), name_(std::move(name)), params_(std::move(params)), comm_(comm), replicas_(replicas),
      reshard_after_forward_(reshard_after_forward), keep_unsharded_(keep_unsharded && comm.size() == 1 && !replicas),
      context_(context), accumulator_(kernels) {
  for (FSDPParam* p : params_) {
    offsets_.push_back(block_numel_);
    block_numel_ += p->shard.block_numel();
    byte_offsets_.push_back(block_bytes_);
    block_bytes_ += p->gather_bytes();
    bytes_ = bytes_ || p->float8_gather;
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
  if (requires_gradient_sync && comm_.size() == 1 && !replicas_) add_whole_gradients(total);
  else if (requires_gradient_sync) start_reduction(total.sums);
  trace(StepEvent::Op::Backward);
}

void FSDPUnit::start_reduction(const std::vector<at::Tensor>& total) {
  Phase phase("zb.fsdp.reduce_scatter", name_);
  at::Tensor reduce_in =
      reduce_scatter_input(params_, total, block_numel_, comm_.size(), replicas_ ? replicas_->size() : 1);
  if (context_.reducing && context_.reducing != this) context_.reducing->advance_gradients();
  StepTrace::UnitScope as_mine(context_.trace, index_);
  context_.reducing = this;
  reduce_out_ = at::empty({block_numel_}, reduce_in.options());
  reduce_ = comm_.reduce_scatter_sum(reduce_out_, reduce_in);
  grad_state_ = GradState::Reducing;
}

void FSDPUnit::advance_gradients() {
  if (grad_state_ != GradState::Reducing) return;
  Phase phase("zb.fsdp.finish_reduce_scatter", name_);  // wait, then the replicas' all-reduce
  if (context_.reducing == this) context_.reducing = nullptr;
  reduce_.wait();  // also releases the collective's input buffer
  if (!replicas_) return complete_gradients();
  // Every replica reduced the same rows over its own samples: their sum is the global mean.
  if (context_.replicating && context_.replicating != this) context_.replicating->finish_gradients();
  context_.replicating = this;
  StepTrace::UnitScope as_mine(context_.trace, index_);
  replicate_ = replicas_->all_reduce_sum(reduce_out_);
  grad_state_ = GradState::Replicating;
}

void FSDPUnit::finish_gradients() {
  advance_gradients();
  if (grad_state_ != GradState::Replicating) return;
  Phase phase("zb.fsdp.finish_all_reduce", name_);
  if (context_.replicating == this) context_.replicating = nullptr;
  replicate_.wait();
  complete_gradients();
}

void FSDPUnit::add_whole_gradients(const GradientTotals& total) {
  // One rank and no replicas: its sums are the mean's gradient, every row of it. Added as they
  // are (the fp32 copy of a compute-dtype gradient is exact), without the collective's staging.
  // The accumulator's own sums (several micro-batches) become the gradients themselves where they
  // fit as they are: no copy.
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& sharded = params_[i]->sharded;
    at::Tensor& grad = params_[i]->sharded.mutable_grad();
    const at::Tensor& g = i < total.sums.size() ? total.sums[i] : at::Tensor();
    if (grad.defined()) {
      if (g.defined()) grad.add_(g);
    } else if (!g.defined()) {
      grad = at::zeros_like(sharded);
    } else if (total.owned && g.scalar_type() == sharded.scalar_type() && g.sizes() == sharded.sizes() &&
               g.device() == sharded.device() && g.is_contiguous()) {
      grad = g;
    } else {
      grad = g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
  }
}

void FSDPUnit::complete_gradients() {
  reduce_scatter_copy_out(params_, offsets_, reduce_out_);
  reduce_out_ = at::Tensor();
  grad_state_ = GradState::None;
}

// --- the sharded state ----------------------------------------------------------------------------

void FSDPUnit::issue_unshard() {
  if (state_ != State::Sharded) return;
  Phase phase("zb.fsdp.all_gather", name_);
  // One rank holds every row: wait_unshard casts the shards straight into place, no buffers.
  if (comm_.size() > 1) {
    gather_in_ = bytes_ ? all_gather_input_bytes(params_, byte_offsets_, block_bytes_)
                        : all_gather_input(params_, offsets_, block_numel_);
    gather_out_ = at::empty({gather_in_.numel() * comm_.size()}, gather_in_.options());
    StepTrace::UnitScope as_mine(context_.trace, index_);
    gather_ = comm_.all_gather(gather_out_, gather_in_);
  }
  state_ = State::Gathering;
}

void FSDPUnit::wait_unshard() {
  if (state_ == State::Unsharded) {
    if (!keep_unsharded_ || cast_is_current()) return;
    Phase phase("zb.fsdp.wait_unshard", name_);
    cast_shards();  // into the storages it keeps
    trace(StepEvent::Op::Unshard);
    return;
  }
  Phase phase("zb.fsdp.wait_unshard", name_);
  if (state_ == State::Sharded) issue_unshard();
  gather_.wait();
  if (comm_.size() == 1) cast_shards();
  else if (bytes_) all_gather_copy_out_bytes(params_, byte_offsets_, gather_out_, comm_.size());
  else all_gather_copy_out(params_, gather_out_, comm_.size());
  gather_in_ = at::Tensor();
  gather_out_ = at::Tensor();
  state_ = State::Unsharded;
  trace(StepEvent::Op::Unshard);
}

void FSDPUnit::cast_shards() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> into, from;
  cast_versions_.clear();
  for (FSDPParam* p : params_) {
    p->allocate_unsharded();
    into.push_back(p->padded_blocks());  // one rank: its rows are the whole, unpadded
    from.push_back(p->sharded.detach().view({1, -1}));
    cast_versions_.push_back(static_cast<int64_t>(p->sharded._version()));
  }
  at::_foreach_copy_(into, from);  // fp32 -> compute dtype, in one launch where CUDA can
  for (FSDPParam* p : params_)
    if (p->float8_gather) float8_round_trip(*p);  // what a gather would deliver
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
  gather_.wait();  // never free under an in-flight collective
  if (state_ == State::Unsharded) trace(StepEvent::Op::Reshard);
  for (FSDPParam* p : params_) p->free_unsharded();
  gather_in_ = at::Tensor();
  gather_out_ = at::Tensor();
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
