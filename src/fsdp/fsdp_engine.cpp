#include "fsdp/fsdp_engine.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

#include "fsdp/fsdp_collectives.h"
#include "parallel/clip.h"
#include "util/phase.h"

namespace zb {

FSDPEngine::FSDPEngine(Llama& model, Communicator& comm, const FSDPOptions& options, Communicator* replicas,
                       Communicator* tp)
    : model_(model), comm_(comm), replicas_(replicas), tp_(tp && tp->size() > 1 ? tp : nullptr), options_(options) {
  TORCH_CHECK(model.tp_size() == (tp_ ? tp_->size() : 1), "FSDPEngine: the model is split over ", model.tp_size(),
              " ranks, the engine's TP group has ", tp_ ? tp_->size() : 1);
  // One FSDPParam per model parameter, grouped into units: a block's parameters, and the root's
  // (those of no block).
  std::vector<std::vector<FSDPParam*>> block_params(model.args().n_layers);
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
    params_.push_back(std::make_unique<FSDPParam>(np.name, np.slot, full, comm.rank(), comm.size(),
                                                  options.compute_dtype));
    FSDPParam* p = params_.back().get();
    if (options.float8_all_gather && np.layer >= 0) p->float8_gather = model.in_float8(np.layer, float8_projection(np.name));
    (np.layer >= 0 ? block_params[np.layer] : root_params).push_back(p);
    *np.slot = at::Tensor();  // the full copy is no longer needed
  }
  const int64_t L = model.args().n_layers;
  for (int64_t i = 0; i < L; ++i) {
    const bool reshard = options.reshard_after_forward && i != L - 1;
    blocks_.push_back(std::make_unique<FSDPUnit>(i, "layers." + std::to_string(i), std::move(block_params[i]),
                                                 comm, reshard, context_, replicas, options.keep_cast,
                                                 model.kernels()));
  }
  root_ = std::make_unique<FSDPUnit>(L, "root", std::move(root_params), comm, false, context_, replicas,
                                     options.keep_cast, model.kernels());
}

namespace {

// Activation checkpointing of one block: forward runs without recording a graph and keeps only
// the block's input (and the micro-batch's documents); backward (after the unit was gathered
// again by the hook on the output) recomputes the block with a graph and back-propagates through
// it, which also hands the parameter gradients to the unit.
// The micro-batch's documents, every field, kept for a recomputation.
void save_documents(torch::autograd::AutogradContext* ctx, const Documents& d) {
  const std::pair<const char*, const at::Tensor*> tensors[] = {
      {"cu_seqlens", &d.cu_seqlens}, {"cudnn_cu_seqlens", &d.cudnn_cu_seqlens}, {"mask", &d.mask},
      {"positions", &d.positions},   {"key_index", &d.key_index},               {"cu_seqlens_k", &d.cu_seqlens_k}};
  for (const auto& [name, t] : tensors)
    if (t->defined()) ctx->saved_data[name] = *t;
  ctx->saved_data["max_len"] = d.max_len;
  ctx->saved_data["max_len_k"] = d.max_len_k;
  ctx->saved_data["visible_blocks"] = d.visible_blocks;
}

Documents saved_documents(torch::autograd::AutogradContext* ctx) {
  Documents d;
  const std::pair<const char*, at::Tensor*> tensors[] = {
      {"cu_seqlens", &d.cu_seqlens}, {"cudnn_cu_seqlens", &d.cudnn_cu_seqlens}, {"mask", &d.mask},
      {"positions", &d.positions},   {"key_index", &d.key_index},               {"cu_seqlens_k", &d.cu_seqlens_k}};
  for (const auto& [name, t] : tensors)
    if (ctx->saved_data.count(name)) *t = ctx->saved_data[name].toTensor();
  d.max_len = ctx->saved_data["max_len"].toInt();
  d.max_len_k = ctx->saved_data["max_len_k"].toInt();
  d.visible_blocks = ctx->saved_data["visible_blocks"].toIntVector();
  return d;
}

struct CheckpointedBlock : torch::autograd::Function<CheckpointedBlock> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                FSDPEngine* engine, FSDPUnit* unit, int64_t layer,
                                                const Documents* documents, const at::Tensor& h) {
    ctx->saved_data["engine"] = reinterpret_cast<int64_t>(engine);
    ctx->saved_data["unit"] = reinterpret_cast<int64_t>(unit);
    ctx->saved_data["layer"] = layer;
    save_documents(ctx, *documents);
    ctx->save_for_backward({h});
    return {engine->model().block_forward(layer, h, *documents)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* engine = reinterpret_cast<FSDPEngine*>(ctx->saved_data["engine"].toInt());
    auto* unit = reinterpret_cast<FSDPUnit*>(ctx->saved_data["unit"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const Documents documents = saved_documents(ctx);
    at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::AutoGradMode grad_mode(true);
    unit->pre_backward();
    unit->fill_slots();
    engine->count_recompute(layer);
    at::Tensor out;
    {
      Phase phase("zb.recompute", layer);
      out = engine->model().block_forward(layer, input, documents);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), input.grad()};
  }
};

}  // namespace

at::Tensor FSDPEngine::loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents) {
  const int64_t L = static_cast<int64_t>(blocks_.size());
  if (options_.float8_all_gather) update_float8_scales();  // before any gather: a no-op until the weights change
  root_->pre_forward();
  if (L > 0) blocks_[0]->issue_unshard();  // overlaps the embedding
  at::Tensor h = model_.embed(tokens);
  for (int64_t i = 0; i < L; ++i) {
    FSDPUnit& unit = *blocks_[i];
    const bool checkpoint = options_.checkpoint_every > 0 && i % options_.checkpoint_every == 0 &&
                            h.requires_grad();
    {
      std::optional<at::NoGradGuard> plain;  // checkpointed: plain views, the recompute records the graph
      if (checkpoint) plain.emplace();
      unit.pre_forward();
    }
    if (i + 1 < L) blocks_[i + 1]->issue_unshard();  // prefetch: gathers while this block computes
    if (context_.trace) context_.trace->record(StepEvent::Op::Forward, i);
    h = checkpoint ? CheckpointedBlock::apply(this, &unit, i, &documents, h)[0] : model_.block_forward(i, h, documents);
    unit.post_forward();
    if (unit.reshard_after_forward() && h.requires_grad()) {
      // Gradient w.r.t. this block's output is ready just before the block's backward runs:
      // gather its parameters back into the storages autograd saved, and prefetch the block
      // before it.
      FSDPUnit* previous = i > 0 ? blocks_[i - 1].get() : nullptr;
      h.register_hook([&unit, previous](const at::Tensor& grad) {
        unit.pre_backward();
        if (previous && previous->reshard_after_forward()) previous->issue_unshard();
        return grad;
      });
    }
  }
  if (context_.trace) context_.trace->record(StepEvent::Op::Loss, -1);
  at::Tensor loss = model_.head_loss(h, targets);
  root_->post_forward();  // the root stays gathered until its backward
  return loss;
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
    if (tp.dim == 1) s.col_start = tp.start;
    s.tp_shared = tp_ && !tp.split();
    s.tp_dim = tp.dim;
    s.slice_shape = p.full_shape;
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
    counted.push_back(!tp_ || named[i].tp.split() || tp_->rank() == 0);
  }
  // Shards do not overlap: the global sum of squares is the sum of the shard group's, and of the
  // TP group's (every replica holds the same gradients and computes the same norm).
  return zb::clip_grad_norm_(shards, max_norm, {&comm_, tp_}, counted);
}

std::vector<std::pair<std::string, at::Tensor>> FSDPEngine::gather_full_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& named = model_.parameters();
  for (size_t i = 0; i < params_.size(); ++i) {
    const FSDPParam& p = *params_[i];
    at::Tensor whole = gather_whole(p.shard, p.full_shape, p.sharded, comm_);
    if (tp_ && named[i].tp.split()) {  // the TP group's slices, side by side along their dimension
      at::Tensor slices = at::empty({tp_->size(), whole.numel()}, whole.options());
      tp_->all_gather(slices, whole.contiguous()).wait();
      std::vector<at::Tensor> parts;
      for (int64_t r = 0; r < tp_->size(); ++r) parts.push_back(slices[r].view(whole.sizes()));
      whole = at::cat(parts, named[i].tp.dim);
    }
    out.emplace_back(p.name, whole);
  }
  return out;
}

}  // namespace zb
