#include "fsdp/fsdp_engine.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <optional>

#include "float8/float8.h"
#include "fsdp/fsdp_collectives.h"
#include "parallel/clip.h"
#include "util/phase.h"

namespace zb {

FSDPEngine::FSDPEngine(Llama& model, Communicator& comm, const FSDPOptions& options, Communicator* replicas,
                       Communicator* tp, Communicator* ep, Communicator* expert_shards)
    : model_(model), comm_(comm), replicas_(replicas), tp_(tp && tp->size() > 1 ? tp : nullptr),
      ep_(ep && ep->size() > 1 ? ep : nullptr), expert_shards_(expert_shards), options_(options) {
  TORCH_CHECK(model.tp_size() == (tp_ ? tp_->size() : 1), "FSDPEngine: the model is split over ", model.tp_size(),
              " ranks, the engine's TP group has ", tp_ ? tp_->size() : 1);
  const int64_t tp_size = tp_ ? tp_->size() : 1;
  TORCH_CHECK(!ep_ || (expert_shards_ && expert_shards_->size() * ep_->size() == comm.size() * tp_size),
              "FSDPEngine: experts split over ", ep_ ? ep_->size() : 1, " ranks need the group of the ",
              comm.size() * tp_size / (ep_ ? ep_->size() : 1), " shard and TP ranks that hold the same experts");
  // One FSDPParam per model parameter, grouped into units: a block's parameters (and under expert
  // parallelism its experts, apart), and the root's (those of no block).
  const int64_t L = model.args().n_layers;
  std::vector<std::vector<FSDPParam*>> block_params(L), expert_params(L);
  std::vector<FSDPParam*> root_params;
  // A parameter on the meta device is created whole, initialised, sharded and freed before the
  // next: in model order from the same seed on every rank, so every rank draws the model's
  // initial values and keeps its rows without ever holding more than one parameter unsharded.
  const auto& named = model.parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    const NamedParameter& np = named[i];
    at::Tensor full = *np.slot;
    if (full.is_meta()) {
      full = at::empty(full.sizes(), full.options().device(options.device));
      model.init_parameter(i, full);
    }
    const bool experts = split_over_ep(i);
    if (experts) {  // this rank's experts, whole, are what its expert shard group divides
      const int64_t local = full.size(0) / ep_->size();
      full = full.narrow(0, ep_->rank() * local, local);
    }
    Communicator& over = experts ? *expert_shards_ : comm;
    params_.push_back(std::make_unique<FSDPParam>(np.name, np.slot, full, over.rank(), over.size(),
                                                  options.compute_dtype));
    FSDPParam* p = params_.back().get();
    // The projections multiplied outside the model are FP8's (float8/float8_projections.h).
    if (options.float8_all_gather && np.layer >= 0)
      p->float8_gather = model.projected_outside(np.layer, float8_projection(np.name));
    (np.layer < 0 ? root_params : experts ? expert_params[np.layer] : block_params[np.layer]).push_back(p);
    *np.slot = at::Tensor();  // the full copy is no longer needed
  }
  // Every rank of the shard group routes tokens to every expert: the experts' gradients are the
  // mean over all of them, like the block's. (Under TP each rank routes its own positions: the
  // expert shard group's sums take in the TP ranks' too, as the TP group's sum of a whole weight's.)
  const int64_t averaged_over = comm.size();
  for (int64_t i = 0; i < L; ++i) {
    const bool reshard = options.reshard_after_forward && i != L - 1;
    std::vector<FSDPUnit::Part> parts{{std::move(block_params[i]), &comm, averaged_over}};
    if (!expert_params[i].empty()) parts.push_back({std::move(expert_params[i]), expert_shards_, averaged_over});
    blocks_.push_back(std::make_unique<FSDPUnit>(i, "layers." + std::to_string(i), std::move(parts), reshard, context_,
                                                 replicas, options.keep_unsharded, model.kernels()));
  }
  root_ = std::make_unique<FSDPUnit>(L, "root", std::vector<FSDPUnit::Part>{{std::move(root_params), &comm, averaged_over}},
                                     false, context_, replicas, options.keep_unsharded, model.kernels());
}

at::Tensor FSDPEngine::loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents) {
  at::Tensor loss = model_.loss(tokens, targets, documents, this);
  root_->post_forward();  // the root stays gathered until its backward
  return loss;
}

void FSDPEngine::before_embedding() {
  if (options_.float8_all_gather) update_float8_scales();  // before any gather: a no-op until the weights change
  root_->pre_forward();
  if (!blocks_.empty()) blocks_[0]->issue_unshard();  // overlaps the embedding
}

void FSDPEngine::before_block(int64_t layer, const at::Tensor& /*input*/, bool checkpointed) {
  {
    std::optional<at::NoGradGuard> plain;  // checkpointed: plain views, the recompute records the graph
    if (checkpointed) plain.emplace();
    blocks_[layer]->pre_forward();
  }
  if (layer + 1 < static_cast<int64_t>(blocks_.size()))
    blocks_[layer + 1]->issue_unshard();  // prefetch: gathers while this block computes
  if (context_.trace) context_.trace->record(StepEvent::Op::Forward, layer);
}

void FSDPEngine::after_block(int64_t layer, const at::Tensor& output) {
  FSDPUnit& unit = *blocks_[layer];
  unit.post_forward();
  if (unit.reshard_after_forward() && output.requires_grad()) {
    // Gradient w.r.t. this block's output is ready just before the block's backward runs:
    // gather its parameters back into the storages autograd saved, and prefetch the block
    // before it.
    FSDPUnit* previous = layer > 0 ? blocks_[layer - 1].get() : nullptr;
    output.register_hook([&unit, previous](const at::Tensor& grad) {
      unit.pre_backward();
      if (previous && previous->reshard_after_forward()) previous->issue_unshard();
      return grad;
    });
  }
}

void FSDPEngine::before_loss(const at::Tensor& /*input*/) {
  if (context_.trace) context_.trace->record(StepEvent::Op::Loss, -1);
}

bool FSDPEngine::checkpointed(int64_t layer) const {
  return options_.checkpoint_every > 0 && layer % options_.checkpoint_every == 0;
}

void FSDPEngine::before_recompute(int64_t layer) {
  FSDPUnit& unit = *blocks_[layer];
  unit.pre_backward();
  unit.fill_slots();
  ++blocks_recomputed_;
  if (context_.trace) context_.trace->record(StepEvent::Op::Recompute, layer);
}

void FSDPEngine::set_requires_gradient_sync(bool sync) {
  root_->requires_gradient_sync = sync;
  for (auto& b : blocks_) b->requires_gradient_sync = sync;
}

void FSDPEngine::update_float8_scales() {
  std::vector<FSDPParam*> fp8;
  for (auto& p : params_)
    if (p->float8_gather) fp8.push_back(p.get());
  if (fp8.empty() || !float8_scales_stale_) return;
  at::NoGradGuard no_grad;
  Phase phase("zb.fsdp.float8_scales");
  std::vector<at::Tensor> amax;
  for (FSDPParam* p : fp8)
    amax.push_back(p->sharded.numel() > 0 ? p->sharded.detach().abs().amax()
                                          : at::zeros({}, p->sharded.options().requires_grad(false)));
  at::Tensor local = at::stack(amax), global = local;
  if (comm_.size() > 1) {
    at::Tensor all = at::empty({comm_.size() * local.numel()}, local.options());
    StepTrace::UnitScope as_root(context_.trace, static_cast<int64_t>(blocks_.size()));  // the plan's
    comm_.all_gather(all, local).wait();
    global = all.view({comm_.size(), -1}).amax(0);
  }
  const at::Tensor scales = float8_scale(global, at::kFloat8_e4m3fn, /*power_of_two=*/true);
  for (size_t i = 0; i < fp8.size(); ++i) fp8[i]->float8_scale = scales[static_cast<int64_t>(i)].clone();
  float8_scales_stale_ = false;
}

void FSDPEngine::finish_backward() {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) (*it)->finish_gradients();
  root_->finish_gradients();
  reset_units();
}

void FSDPEngine::reset_units() {
  for (auto& b : blocks_) b->reset();
  root_->reset();
}

void FSDPEngine::reshard() {
  reset_units();
  // After evaluation: kept casts are made again at the next step's first use, as after any step
  // (the step's plan casts each unit once).
  parameters_changed();
}

void FSDPEngine::parameters_changed() {
  float8_scales_stale_ = true;
  for (auto& b : blocks_) b->parameters_changed();
  root_->parameters_changed();
}

std::vector<ShardedParameter> FSDPEngine::parameters() {
  // This rank's rows of the model's tensor; under TP that tensor is itself a slice of the whole.
  std::vector<ShardedParameter> out;
  const auto& named = model_.parameters();
  for (size_t i = 0; i < params_.size(); ++i) {
    const FSDPParam& p = *params_[i];
    const TpSlice& tp = named[i].tp;
    ShardedParameter s{p.name, &params_[i]->sharded, named[i].global_shape, p.first_row(), false};
    if (tp.dim == 0) s.row_start += tp.start;
    if (split_over_ep(i)) s.row_start += ep_->rank() * p.full_shape[0];  // after the EP ranks' before
    if (tp.dim == 1) s.col_start = tp.start;
    s.tp_shared = tp_ && !tp.split() && !split_over_ep(i);  // the TP ranks hold other experts
    s.tp_dim = tp.dim;
    // What the shard group's ranks divide between them: the TP slice, or a whole expert stack (its
    // EP ranks' experts together).
    s.slice_shape = split_over_ep(i) ? named[i].global_shape : p.full_shape;
    out.push_back(std::move(s));
  }
  return out;
}

at::Tensor FSDPEngine::clip_grad_norm_(double max_norm) {
  std::vector<at::Tensor> shards;
  std::vector<bool> counted;  // a tensor every rank of the TP group holds alike counts once
  const auto& named = model_.parameters();
  for (size_t i = 0; i < params_.size(); ++i) {
    shards.push_back(params_[i]->sharded);
    counted.push_back(!tp_ || named[i].tp.split() || split_over_ep(i) || tp_->rank() == 0);
  }
  // Shards do not overlap: the global sum of squares is the sum of the shard group's, and of the
  // TP group's (every replica holds the same gradients and computes the same norm). A replica's
  // experts are divided over its shard and TP ranks both.
  return zb::clip_grad_norm_(shards, max_norm, {&comm_, tp_}, counted);
}

std::vector<std::pair<std::string, at::Tensor>> FSDPEngine::gather_full_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& named = model_.parameters();
  for (size_t i = 0; i < params_.size(); ++i) {
    const FSDPParam& p = *params_[i];
    // Each rank's part of `whole` from `group`, side by side along `dim`, in rank order.
    auto side_by_side = [](const at::Tensor& whole, Communicator& group, int64_t dim) {
      at::Tensor slices = at::empty({group.size(), whole.numel()}, whole.options());
      group.all_gather(slices, whole.contiguous()).wait();
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < group.size(); ++r) parts.push_back(slices[r].view(whole.sizes()));
      return at::cat(parts, dim);
    };
    const bool experts = split_over_ep(i);
    at::Tensor whole = gather_whole(p.shard, p.full_shape, p.sharded, experts ? *expert_shards_ : comm_);
    if (experts) whole = side_by_side(whole, *ep_, 0);  // the EP group's experts
    if (tp_ && named[i].tp.split()) whole = side_by_side(whole, *tp_, named[i].tp.dim);  // the TP group's slices
    out.emplace_back(p.name, whole);
  }
  return out;
}

}  // namespace zb
