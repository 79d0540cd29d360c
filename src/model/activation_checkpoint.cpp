#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "model/llama.h"
#include "util/phase.h"

namespace zb {

namespace {

// The micro-batch's documents, every field, kept for a recomputation.
void save_documents(torch::autograd::AutogradContext* ctx, const Documents& d) {
  const std::pair<const char*, const at::Tensor*> tensors[] = {
      {"cu_seqlens", &d.cu_seqlens}, {"cudnn_cu_seqlens", &d.cudnn_cu_seqlens}, {"mask", &d.mask},
      {"positions", &d.positions},   {"key_index", &d.key_index},               {"cu_seqlens_k", &d.cu_seqlens_k},
      {"row_documents", &d.row_documents}};
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
      {"positions", &d.positions},   {"key_index", &d.key_index},               {"cu_seqlens_k", &d.cu_seqlens_k},
      {"row_documents", &d.row_documents}};
  for (const auto& [name, t] : tensors)
    if (ctx->saved_data.count(name)) *t = ctx->saved_data[name].toTensor();
  d.max_len = ctx->saved_data["max_len"].toInt();
  d.max_len_k = ctx->saved_data["max_len_k"].toInt();
  d.visible_blocks = ctx->saved_data["visible_blocks"].toIntVector();
  return d;
}

// Forward runs inside autograd's Function, without recording a graph, and keeps only the
// block's input and the documents; backward runs the hook, recomputes the block with a graph and
// back-propagates through it, which also hands the parameter gradients on as the plain block does.
struct CheckpointedBlock : torch::autograd::Function<CheckpointedBlock> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Llama* model,
                                                StageHooks* hooks, int64_t layer, const Documents* documents,
                                                const at::Tensor& h) {
    ctx->saved_data["model"] = reinterpret_cast<int64_t>(model);
    ctx->saved_data["hooks"] = reinterpret_cast<int64_t>(hooks);
    ctx->saved_data["layer"] = layer;
    save_documents(ctx, *documents);
    ctx->save_for_backward({h});
    return {model->block_forward(layer, h, *documents)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* model = reinterpret_cast<const Llama*>(ctx->saved_data["model"].toInt());
    auto* hooks = reinterpret_cast<StageHooks*>(ctx->saved_data["hooks"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const Documents documents = saved_documents(ctx);
    at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    at::AutoGradMode grad_mode(true);
    hooks->before_recompute(layer);
    at::Tensor out;
    {
      Phase phase("zb.recompute", layer);
      out = model->block_forward(layer, input, documents);
    }
    torch::autograd::backward({out}, {grads[0]});
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), input.grad()};
  }
};

}  // namespace

at::Tensor checkpointed_block(const Llama& model, int64_t layer, const at::Tensor& h, const Documents& documents,
                              StageHooks& hooks) {
  return CheckpointedBlock::apply(&model, &hooks, layer, &documents, h)[0];
}

}  // namespace zb
