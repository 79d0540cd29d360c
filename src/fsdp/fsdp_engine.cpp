#include "fsdp/fsdp_engine.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace zb {

FSDPEngine::FSDPEngine(Llama& model, Communicator& comm, const FSDPOptions& options)
    : model_(model), comm_(comm), options_(options) {
  // One FSDPParam per model parameter, grouped into units: "layers.<i>." -> block i, else root.
  std::vector<std::vector<FSDPParam*>> block_params(model.args().n_layers);
  std::vector<FSDPParam*> root_params;
  for (const auto& np : model.parameters()) {
    params_.push_back(std::make_unique<FSDPParam>(np.name, np.slot, *np.slot, comm.rank(),
                                                  comm.size(), options.compute_dtype));
    FSDPParam* p = params_.back().get();
    if (np.name.rfind("layers.", 0) == 0) {
      const int64_t layer = std::stoll(np.name.substr(7, np.name.find('.', 7) - 7));
      block_params[layer].push_back(p);
    } else {
      root_params.push_back(p);
    }
    *np.slot = at::Tensor();  // the full copy is no longer needed
  }
  const int64_t L = model.args().n_layers;
  for (int64_t i = 0; i < L; ++i) {
    const bool reshard = options.reshard_after_forward && i != L - 1;
    blocks_.push_back(std::make_unique<FSDPUnit>("layers." + std::to_string(i),
                                                 std::move(block_params[i]), comm, reshard,
                                                 &reducing_));
  }
  root_ = std::make_unique<FSDPUnit>("root", std::move(root_params), comm, false, &reducing_);
}

namespace {

void fill_slots(FSDPUnit& unit) {
  const auto tensors = unit.unsharded_for_forward();
  for (size_t i = 0; i < tensors.size(); ++i) *unit.params()[i]->slot = tensors[i];
}

// Activation checkpointing of one block: forward runs without recording a graph and keeps only
// the block's input; backward (after the unit was gathered again by the hook on the output)
// recomputes the block with a graph and back-propagates through it, which also hands the
// parameter gradients to the unit.
struct CheckpointedBlock : torch::autograd::Function<CheckpointedBlock> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                FSDPEngine* engine, FSDPUnit* unit, int64_t layer,
                                                const at::Tensor& h) {
    ctx->saved_data["engine"] = reinterpret_cast<int64_t>(engine);
    ctx->saved_data["unit"] = reinterpret_cast<int64_t>(unit);
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({h});
    return {engine->model().block_forward(layer, h)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* engine = reinterpret_cast<FSDPEngine*>(ctx->saved_data["engine"].toInt());
    auto* unit = reinterpret_cast<FSDPUnit*>(ctx->saved_data["unit"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::AutoGradMode grad_mode(true);
    unit->wait_unshard();
    fill_slots(*unit);
    at::Tensor out = engine->model().block_forward(layer, input);
    engine->count_recompute();
    torch::autograd::backward({out}, {grads[0]});
    return {at::Tensor(), at::Tensor(), at::Tensor(), input.grad()};
  }
};

}  // namespace

at::Tensor FSDPEngine::forward(const at::Tensor& tokens) {
  const int64_t L = static_cast<int64_t>(blocks_.size());
  root_->wait_unshard();
  if (L > 0) blocks_[0]->issue_unshard();  // overlaps the embedding
  fill_slots(*root_);
  at::Tensor h = model_.embed(tokens);
  for (int64_t i = 0; i < L; ++i) {
    FSDPUnit& unit = *blocks_[i];
    unit.wait_unshard();
    if (i + 1 < L) blocks_[i + 1]->issue_unshard();  // prefetch: gathers while this block computes
    const bool checkpoint = options_.checkpoint_every > 0 && i % options_.checkpoint_every == 0;
    if (checkpoint && h.requires_grad()) {
      {
        at::NoGradGuard no_grad;  // plain views in the slots: the recompute records the graph
        fill_slots(unit);
      }
      h = CheckpointedBlock::apply(this, &unit, i, h)[0];
    } else {
      fill_slots(unit);
      h = model_.block_forward(i, h);
    }
    if (!unit.reshard_after_forward()) continue;
    unit.reshard();
    if (h.requires_grad()) {
      // Gradient w.r.t. this block's output is ready just before the block's backward runs:
      // gather its parameters back into the storages autograd saved, and prefetch the block
      // before it.
      FSDPUnit* previous = i > 0 ? blocks_[i - 1].get() : nullptr;
      h.register_hook([&unit, previous](const at::Tensor& grad) {
        unit.wait_unshard();
        if (previous && previous->reshard_after_forward()) previous->issue_unshard();
        return grad;
      });
    }
  }
  return model_.head(h);
}

void FSDPEngine::set_requires_gradient_sync(bool sync) {
  root_->requires_gradient_sync = sync;
  for (auto& b : blocks_) b->requires_gradient_sync = sync;
}

void FSDPEngine::finish_backward() {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) (*it)->finish_gradients();
  root_->finish_gradients();
  for (auto& b : blocks_) b->reshard();
  root_->reshard();
}

std::vector<NamedParameter> FSDPEngine::sharded_parameters() {
  std::vector<NamedParameter> out;
  for (auto& p : params_) out.push_back({p->name, &p->sharded});
  return out;
}

std::vector<std::vector<int64_t>> FSDPEngine::global_shapes() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& p : params_) out.push_back(p->full_shape);
  return out;
}

const FSDPParam* FSDPEngine::param(const std::string& name) const {
  for (const auto& p : params_)
    if (p->name == name) return p.get();
  return nullptr;
}

std::vector<at::Tensor> FSDPEngine::sharded_tensors() const {
  std::vector<at::Tensor> out;
  for (const auto& p : params_) out.push_back(p->sharded);
  return out;
}

at::Tensor FSDPEngine::clip_grad_norm_(double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params_)
    if (p->sharded.grad().defined() && p->sharded.numel() > 0) grads.push_back(p->sharded.grad());
  const auto device = params_.front()->sharded.device();
  // Shards do not overlap, so the global sum of squares is the sum of the ranks' local sums.
  at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().device(device));
  if (!grads.empty()) sum_sq += at::stack(at::_foreach_norm(grads, 2)).pow(2).sum();
  comm_.all_reduce_sum(sum_sq).wait();
  at::Tensor total = sum_sq.sqrt().squeeze(0);
  if (max_norm > 0 && !grads.empty()) {
    at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
    at::_foreach_mul_(grads, coef);
  }
  return total;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPEngine::gather_full_parameters() {
  at::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> out;
  const int64_t W = comm_.size();
  for (const auto& p : params_) {
    auto opts = p->sharded.options().requires_grad(false);
    at::Tensor in = at::zeros({p->block_numel()}, opts);
    if (p->local_rows > 0) in.narrow(0, 0, p->local_rows * p->row_numel).copy_(p->sharded.reshape({-1}));
    at::Tensor all = at::empty({W * p->block_numel()}, opts);
    comm_.all_gather(all, in).wait();
    at::Tensor full = all.view({W * p->rows_per_rank, p->row_numel}).narrow(0, 0, p->rows);
    out.emplace_back(p->name, full.reshape(p->full_shape).clone());
  }
  return out;
}

}  // namespace zb
