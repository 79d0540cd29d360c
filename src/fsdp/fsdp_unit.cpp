#include "fsdp/fsdp_unit.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

namespace zb {

namespace {

// Identity in forward from the sharded parameters to their gathered full copies; in backward it
// receives the gradients of all of the unit's full parameters at once and passes them to the
// unit, which reduce-scatters them into the sharded .grad() itself (so the collective overlaps
// the rest of backward). Its own input gradients are left undefined.
struct GatherForward : torch::autograd::Function<GatherForward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                FSDPUnit* unit, at::TensorList shards) {
    ctx->saved_data["unit"] = reinterpret_cast<int64_t>(unit);
    ctx->saved_data["n"] = static_cast<int64_t>(shards.size());
    torch::autograd::variable_list out;
    for (FSDPParam* p : unit->params()) out.push_back(p->unsharded_view());
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* unit = reinterpret_cast<FSDPUnit*>(ctx->saved_data["unit"].toInt());
    unit->reduce_gradients(grads, unit->requires_gradient_sync);
    // No gradient for the unit pointer nor (here) for the shards.
    return torch::autograd::variable_list(static_cast<size_t>(ctx->saved_data["n"].toInt()) + 1);
  }
};

}  // namespace

FSDPUnit::FSDPUnit(std::string name, std::vector<FSDPParam*> params, Communicator& comm,
                   bool reshard_after_forward, FSDPUnit** reducing)
    : name_(std::move(name)), params_(std::move(params)), comm_(comm),
      reshard_after_forward_(reshard_after_forward), reducing_(reducing) {
  for (FSDPParam* p : params_) {
    offsets_.push_back(block_numel_);
    block_numel_ += p->block_numel();
  }
}

void FSDPUnit::issue_unshard() {
  if (state_ != State::Sharded) return;
  at::NoGradGuard no_grad;
  const auto& first = params_.front()->sharded;
  auto opts = at::TensorOptions().dtype(params_.front()->compute_dtype()).device(first.device());
  gather_in_ = at::zeros({block_numel_}, opts);  // zeros: the padding rows
  for (size_t i = 0; i < params_.size(); ++i) {
    const FSDPParam* p = params_[i];
    if (p->local_rows == 0) continue;
    gather_in_.narrow(0, offsets_[i], p->local_rows * p->row_numel)
        .copy_(p->sharded.detach().reshape({-1}));  // casts fp32 -> compute dtype
  }
  gather_out_ = at::empty({block_numel_ * comm_.size()}, opts);
  gather_ = comm_.all_gather(gather_out_, gather_in_);
  state_ = State::Gathering;
}

void FSDPUnit::wait_unshard() {
  if (state_ == State::Unsharded) return;
  if (state_ == State::Sharded) issue_unshard();
  gather_.wait();
  at::NoGradGuard no_grad;
  const int64_t W = comm_.size();
  at::Tensor blocks = gather_out_.view({W, block_numel_});
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam* p = params_[i];
    p->allocate_unsharded();
    p->copy_rows_from_blocks(blocks, offsets_[i], p->unsharded_view());
  }
  gather_in_ = at::Tensor();
  gather_out_ = at::Tensor();
  state_ = State::Unsharded;
}

void FSDPUnit::reshard() {
  gather_.wait();  // never free under an in-flight collective
  for (FSDPParam* p : params_) p->free_unsharded();
  gather_in_ = at::Tensor();
  gather_out_ = at::Tensor();
  state_ = State::Sharded;
}

std::vector<at::Tensor> FSDPUnit::unsharded_for_forward() {
  TORCH_CHECK(state_ == State::Unsharded, "unit ", name_, " used before it was gathered");
  torch::autograd::variable_list shards;
  for (FSDPParam* p : params_) shards.push_back(p->sharded);
  return GatherForward::apply(this, at::TensorList(shards));
}

void FSDPUnit::reduce_gradients(const std::vector<at::Tensor>& grads, bool sync) {
  at::NoGradGuard no_grad;
  // Every node that used this unit's parameters has run (they produced these gradients): the
  // gathered copies can go now rather than at the end of backward.
  reshard();
  const auto device = params_.front()->sharded.device();
  auto grad_of = [&](size_t i) { return i < grads.size() ? grads[i] : at::Tensor(); };
  if (!sync || !grad_accumulators_.empty()) {
    // Accumulate across micro-batches in fp32 (a missing gradient counts as zero).
    if (grad_accumulators_.empty())
      for (FSDPParam* p : params_)
        grad_accumulators_.push_back(at::zeros(p->full_shape, at::TensorOptions().device(device)));
    for (size_t i = 0; i < params_.size(); ++i)
      if (grad_of(i).defined()) grad_accumulators_[i].add_(grad_of(i));
    if (!sync) return;
  }
  const std::vector<at::Tensor>& total = grad_accumulators_.empty() ? grads : grad_accumulators_;

  // Each rank's loss is a mean over its own samples; the global mean is their average, so every
  // rank pre-divides by W and the reduce-scatter sums (Gloo has no average). Written straight
  // into the flat rank-major layout, cast to fp32 on the way.
  const int64_t W = comm_.size();
  at::Tensor reduce_in = at::zeros({W, block_numel_}, at::TensorOptions().device(device));
  for (size_t i = 0; i < params_.size(); ++i) {
    const FSDPParam* p = params_[i];
    if (i >= total.size() || !total[i].defined()) continue;
    p->copy_rows_to_blocks(total[i], reduce_in, offsets_[i]);
  }
  reduce_in.div_(static_cast<double>(W));
  grad_accumulators_.clear();
  if (*reducing_ && *reducing_ != this) (*reducing_)->finish_gradients();
  *reducing_ = this;
  reduce_out_ = at::empty({block_numel_}, at::TensorOptions().device(device));
  at::Tensor flat_in = reduce_in.view({-1});
  reduce_ = comm_.reduce_scatter_sum(reduce_out_, flat_in);
}

void FSDPUnit::finish_gradients() {
  if (*reducing_ == this) *reducing_ = nullptr;
  if (!reduce_out_.defined()) return;
  reduce_.wait();  // also releases the collective's input buffer
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam* p = params_[i];
    std::vector<int64_t> shape = p->full_shape;
    shape[0] = p->local_rows;
    at::Tensor g = reduce_out_.narrow(0, offsets_[i], p->local_rows * p->row_numel).view(shape);
    at::Tensor& grad = p->sharded.mutable_grad();
    if (grad.defined()) grad.add_(g);
    else grad = g.clone();
  }
  reduce_out_ = at::Tensor();
}

}  // namespace zb
