#include "parallel/qk_clip.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

namespace zb {

QkClip::QkClip(Llama& model, std::vector<Communicator*> over, double threshold, double alpha)
    : model_(model), over_(std::move(over)), threshold_(threshold), alpha_(alpha) {
  model_.watch_attention_logits(true);
}

QkClip::~QkClip() { model_.watch_attention_logits(false); }

AttentionLogitStats QkClip::step(bool apply, const std::vector<ShardedParameter>& params) {
  at::NoGradGuard no_grad;
  const ModelArgs& a = model_.args();
  const int64_t L = a.n_layers, H = a.n_heads, Hkv = a.n_kv_heads, Dh = a.head_dim();
  // This rank's heads (its TP slice: heads [tp_rank h, (tp_rank + 1) h)) in the whole [L, H];
  // -inf elsewhere, so that the MAX over the world fills in every head.
  const std::vector<at::Tensor>& mine = model_.attention_logits();
  const int64_t h = mine.front().size(0), first = model_.tp_rank() * h;
  at::Tensor all = at::full({L, H}, -std::numeric_limits<double>::infinity(), mine.front().options());
  all.narrow(1, first, h).copy_(at::stack(mine));
  for (Communicator* group : over_)
    if (group) group->all_reduce_max(all).wait();
  model_.reset_attention_logits();

  AttentionLogitStats stats;
  const at::Tensor S = all.to(at::kDouble).cpu();  // one host read a step
  for (int64_t l = 0; l < L; ++l) stats.max_by_layer.push_back(S[l].max().item<double>());
  if (!apply || threshold_ <= 0) return stats;

  // γ per query head (1 below τ), and per key head the smallest of its query heads'.
  const at::Tensor gamma = at::where(S > threshold_, threshold_ / S, at::ones_like(S));  // [L, H]
  const at::Tensor kv_gamma = std::get<0>(gamma.view({L, Hkv, H / Hkv}).min(2));  // [L, Hkv]
  stats.heads_clipped = (S > threshold_).sum().item<int64_t>();
  if (stats.heads_clipped == 0) return stats;
  for (const ShardedParameter& p : params) {
    // "layers.<l>.attention.wq.weight" or ".wk.weight": rows of heads, Dh each.
    const std::string& n = p.name;
    const bool query = n.size() > 20 && n.compare(n.size() - 20, 20, ".attention.wq.weight") == 0;
    const bool key = n.size() > 20 && n.compare(n.size() - 20, 20, ".attention.wk.weight") == 0;
    if ((!query && !key) || p.tensor->numel() == 0) continue;
    const int64_t l = std::stol(n.substr(7, n.find('.', 7) - 7));
    const at::Tensor by_head = query ? gamma[l].pow(alpha_) : kv_gamma[l].pow(1.0 - alpha_);
    if ((by_head < 1.0).sum().item<int64_t>() == 0) continue;
    // Each held row's factor: its head's, from the row's place in the whole (row_start counts
    // the TP slice's rows before it too). A factor of 1 leaves a row's bits as they were.
    const at::Tensor per_row = by_head.repeat_interleave(Dh).narrow(0, p.row_start, p.tensor->size(0));
    p.tensor->mul_(per_row.to(p.tensor->options()).unsqueeze(1));
  }
  return stats;
}

}  // namespace zb
