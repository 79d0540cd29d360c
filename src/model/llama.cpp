#include "model/llama.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/maximum.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "model/chunked_loss.h"
#include "model_parallel/context_parallel.h"
#include "util/phase.h"

namespace zb {

void check_tensor_parallel(const ModelArgs& a, int64_t tp) {
  auto fail = [tp](const std::string& what) {
    throw std::invalid_argument("tensor parallelism over " + std::to_string(tp) + " ranks: " + what);
  };
  if (tp < 1) fail("needs at least one rank");
  if (a.n_heads % tp != 0) fail("the " + std::to_string(a.n_heads) + " attention heads do not divide into them");
  if (a.n_kv_heads % tp != 0 && tp % a.n_kv_heads != 0)
    fail("the " + std::to_string(a.n_kv_heads) +
         " key/value heads must divide into them or each be shared by a whole number of them");
  if (a.ffn_hidden() % tp != 0) fail("the FFN's hidden size " + std::to_string(a.ffn_hidden()) + " does not divide into them");
  if (a.vocab_size % tp != 0) fail("the vocabulary of " + std::to_string(a.vocab_size) + " words does not divide into them");
  // A mixture's routed experts stay whole on every rank; its shared experts split as the FFN does.
  if (const int64_t shared = a.num_shared_experts * a.expert_hidden(); a.num_experts > 0 && shared % tp != 0)
    fail("the shared experts' hidden size " + std::to_string(shared) + " does not divide into them");
}

Llama::Llama(const ModelArgs& args, const at::TensorOptions& options, bool allocate_parameters,
             ModelParallelGroup* tp)
    : args_(args), tp_(tp && tp->size() > 1 ? tp : nullptr) {
  const int64_t n = tp_size(), r = tp_rank();
  check_tensor_parallel(args, n);
  const TpShare share = tp_share(args, n);
  heads_ = share.heads;
  kv_replicated_ = share.kv_shared;
  kv_heads_ = share.kv_heads;
  kv_start_ = kv_replicated_ ? r / (n / args.n_kv_heads) : r * kv_heads_;

  // Master weights are fp32 unless the caller asks for float64 (tests compare against float64).
  auto opts = options.dtype(options.has_dtype() && options.dtype() == at::kDouble ? at::kDouble : at::kFloat);
  compute_dtype_ = opts.dtype().toScalarType();
  const auto param_opts = allocate_parameters ? opts : opts.device(c10::kMeta);
  const int64_t D = args.dim, hd = args.head_dim(), F = args.ffn_hidden(), V = args.vocab_size;
  layers_.resize(args.n_layers);
  expert_loads_.resize(args.n_layers);
  if (args.num_experts > 0) moe_ = std::make_unique<MixtureOfExperts>(args);
  // ZeroBand precomputes RoPE for twice the sequence length.
  rope_ = rope_tables(hd, 2 * args.max_seq_len, args.rope_theta, opts);

  // Parameters in param_specs() order: embedding, per block (wq wk wv wo w1 w2 w3 norms), norm,
  // head; with how each is initialised (see init_weights) and, under TP, the slice this rank
  // holds: `split` of dimension `dim` in n equal parts, this rank's the r-th (see the table in
  // model_parallel/tensor_parallel.h). torchtitan's trunc_normal_ keeps torch's default absolute cut at
  // +-2, which at std 0.02 is 100 std away: a plain normal in practice.
  int64_t layer = -1;  // of the parameters being added
  auto add = [&](std::string name, at::Tensor* slot, Init init, std::vector<int64_t> shape, int64_t dim = -1) {
    TpSlice slice;
    std::vector<int64_t> local = shape;
    if (n > 1 && dim >= 0) {
      local[dim] /= n;
      slice = {dim, r * local[dim]};
    }
    *slot = at::empty(local, param_opts).requires_grad_(true);
    params_.push_back({std::move(name), slot, layer, std::move(shape), slice});
    init_.push_back(init);
  };
  const int64_t kv_dim = kv_replicated_ ? -1 : 0;  // shared key/value heads: whole on every rank
  add("tok_embeddings.weight", &tok_embeddings_, {1.0, 0.0}, {V, D}, 0);
  for (int64_t i = 0; i < args.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    auto& b = layers_[i];
    layer = i;
    const double depth_std = 0.02 / std::sqrt(2.0 * static_cast<double>(i + 1));
    add(p + "attention.wq.weight", &b.wq, {0.02, 2.0}, {args.n_heads * hd, D}, 0);
    add(p + "attention.wk.weight", &b.wk, {0.02, 2.0}, {args.n_kv_heads * hd, D}, kv_dim);
    add(p + "attention.wv.weight", &b.wv, {0.02, 2.0}, {args.n_kv_heads * hd, D}, kv_dim);
    add(p + "attention.wo.weight", &b.wo, {depth_std, 2.0}, {D, args.n_heads * hd}, 1);
    if (args.moe_layer(i)) {
      // torchtitan's initialisation: the gate at the depth's std, each expert as a dense SwiGLU.
      const int64_t E = args.num_experts, Fe = args.expert_hidden(), S = args.num_shared_experts * Fe;
      add(p + "moe.router.gate.weight", &b.gate, {depth_std, 2.0}, {E, D});
      add(p + "moe.experts.w1", &b.experts_w1, {0.02, 2.0}, {E, Fe, D});
      add(p + "moe.experts.w2", &b.experts_w2, {depth_std, 2.0}, {E, D, Fe});
      add(p + "moe.experts.w3", &b.experts_w3, {depth_std, 2.0}, {E, Fe, D});
      if (S > 0) {
        add(p + "moe.shared_experts.w1.weight", &b.w1, {0.02, 2.0}, {S, D}, 0);
        add(p + "moe.shared_experts.w2.weight", &b.w2, {depth_std, 2.0}, {D, S}, 1);
        add(p + "moe.shared_experts.w3.weight", &b.w3, {depth_std, 2.0}, {S, D}, 0);
      }
      expert_loads_[i] = {at::zeros({E}, opts.dtype(at::kFloat)), at::zeros({E}, opts.dtype(at::kLong)),
                          at::zeros({1}, opts.dtype(at::kFloat))};
    } else {
      add(p + "feed_forward.w1.weight", &b.w1, {0.02, 2.0}, {F, D}, 0);
      add(p + "feed_forward.w2.weight", &b.w2, {depth_std, 2.0}, {D, F}, 1);
      add(p + "feed_forward.w3.weight", &b.w3, {depth_std, 2.0}, {F, D}, 0);
    }
    add(p + "attention_norm.weight", &b.attention_norm, {}, {D});
    add(p + "ffn_norm.weight", &b.ffn_norm, {}, {D});
  }
  layer = -1;
  add("norm.weight", &norm_, {}, {D});
  const double head_std = 1.0 / std::sqrt(static_cast<double>(args.dim));
  add("output.weight", &output_, {head_std, 3 * head_std}, {V, D}, 0);  // cut at 3 std
}

void trunc_normal_(at::Tensor& t, double mean, double std, double lo, double hi) {
  // Sample u uniformly between the normal CDF values of the bounds, then map back through the
  // inverse CDF: x = mean + std*sqrt(2)*erfinv(2u-1).
  auto cdf = [&](double x) { return 0.5 * (1.0 + std::erf((x - mean) / (std * std::sqrt(2.0)))); };
  const double a = cdf(lo), b = cdf(hi);
  t.uniform_(2 * a - 1, 2 * b - 1).erfinv_().mul_(std * std::sqrt(2.0)).add_(mean).clamp_(lo, hi);
}

void Llama::init_weights() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].slot->is_meta()) init_parameter(i, *params_[i].slot);
}

void Llama::init_parameter(size_t i, at::Tensor& t) const {
  at::NoGradGuard no_grad;
  const Init& init = init_.at(i);
  const NamedParameter& p = params_[i];
  TORCH_CHECK(t.sizes() == p.slot->sizes(), "init_parameter: ", p.name, " has shape ", p.slot->sizes(), ", not ",
              t.sizes());
  // Under TP the whole parameter is drawn, so that every slice has the values of the whole.
  at::Tensor whole = p.tp.split() ? at::empty(p.global_shape, t.options()) : t;
  if (init.std == 0) whole.fill_(1.0);
  else if (init.cut == 0) whole.normal_(0.0, init.std);
  else trunc_normal_(whole, 0.0, init.std, -init.cut, init.cut);
  if (p.tp.split()) t.copy_(whole.narrow(p.tp.dim, p.tp.start, t.size(p.tp.dim)));
}

void Llama::watch_attention_logits(bool on) {
  attention_logits_.clear();
  if (!on) return;
  for (int64_t l = 0; l < args_.n_layers; ++l)
    attention_logits_.push_back(at::empty({heads_}, at::TensorOptions().dtype(at::kFloat).device(rope_.cis.device())));
  reset_attention_logits();
}

void Llama::reset_attention_logits() {
  for (at::Tensor& t : attention_logits_) t.fill_(-std::numeric_limits<double>::infinity());
}

at::Tensor Llama::block_forward(int64_t layer, const at::Tensor& h, const Documents& documents) const {
  Phase phase("zb.block_forward", layer);
  const auto& b = layers_[layer];
  const auto dt = compute_dtype_;
  const int64_t hd = args_.head_dim();
  const double eps = args_.norm_eps;
  // Without TP these are the identity. Under TP (model_parallel/tensor_parallel.h) h holds this rank's
  // positions: each norm runs on them, the sequence is gathered whole before the column-parallel
  // products (this rank's heads, its FFN columns) and the row-parallel ones' partial sums are
  // reduce-scattered back to this rank's positions.
  auto shared = [&](const at::Tensor& w) { return tp_ ? replicated_weight(w, *tp_) : w; };
  auto whole_sequence = [&](const at::Tensor& x) { return tp_ ? gather_sequence(x, *tp_) : x; };
  auto own_positions = [&](const at::Tensor& y) { return tp_ ? reduce_scatter_sequence(y, *tp_) : y; };
  at::Tensor wk = b.wk, wv = b.wv;
  if (kv_replicated_) {  // every rank holds all key/value heads and reads the one it needs
    wk = shared(wk).narrow(0, kv_start_ * hd, kv_heads_ * hd);
    wv = shared(wv).narrow(0, kv_start_ * hd, kv_heads_ * hd);
  }

  // Each norm's input also goes on in the residual stream: rms_norm_residual hands it back, so that
  // on a GPU both of its gradients meet in the norm's backward (layers.h).
  auto [h_on, x_here] = rms_norm_residual(h, shared(b.attention_norm), eps, kernels_);
  at::Tensor x = whole_sequence(x_here);
  const int64_t B = x.size(0), T = x.size(1);
  const std::vector<at::Tensor> qkv = project(layer, {"wq", "wk", "wv"}, x, {b.wq.to(dt), wk.to(dt), wv.to(dt)});
  at::Tensor q = qkv[0].view({B, T, heads_, hd});
  at::Tensor k = qkv[1].view({B, T, kv_heads_, hd});
  at::Tensor v = qkv[2].view({B, T, kv_heads_, hd});
  // Under CP this rank's tokens are its positions of the row: RoPE at those positions, and the
  // keys and values of the whole row gathered from the group (in the group's order, which
  // cp_documents' mask follows).
  TORCH_CHECK(!cp_ || documents.positions.defined(), "context parallelism: the documents carry no positions "
              "(cp_documents makes them)");
  const RopeTables rope = cp_ ? RopeTables{rope_.cis.index_select(0, documents.positions)} : rope_;
  q = apply_rope(q, rope, kernels_);
  k = apply_rope(k, rope, kernels_);
  // The logits' watch: in a forward that trains (a checkpointed block's recomputation).
  const at::Tensor* logits =
      !attention_logits_.empty() && at::GradMode::is_enabled() ? &attention_logits_[static_cast<size_t>(layer)] : nullptr;
  at::Tensor attn;
  if (cp_ && cp_ring_) {
    attn = ring_attention(q, k, v, documents, *cp_, logits);
  } else {
    if (cp_) {
      k = gather_sequence(k, *cp_);
      v = gather_sequence(v, *cp_);
    }
    if (logits) {
      const at::Tensor key_positions = cp_ ? cp_gathered_positions(cp_->size(), k.size(1), k.device()) : at::Tensor();
      logits->copy_(at::maximum(*logits, max_attention_logits(q, k, documents, key_positions)));
    }
    attn = attention(q, k, v, documents);
  }
  // (Separate statements: the order of operations, and so of TP's collectives in backward, is the
  // step plan's; a call's arguments have none.)
  // Without TP each output linear and its residual add are one operation (residual_linear); under
  // TP the reduce-scatter comes between them.
  const at::Tensor after_attention = tp_ || projected_outside(layer, "wo")
                                        ? h_on + own_positions(project(layer, {"wo"}, attn, {b.wo.to(dt)})[0])
                                        : residual_linear(h_on, attn, b.wo.to(dt), kernels_);
  auto [h2, y_here] = rms_norm_residual(after_attention, shared(b.ffn_norm), eps, kernels_);
  const bool moe = args_.moe_layer(layer);
  const BlockContext context{layer, b, dt, kernels_, tp_, moe ? &expert_loads_[layer] : nullptr, ep_,
                             [&](const std::vector<const char*>& names, const at::Tensor& x,
                                 const std::vector<at::Tensor>& weights) { return project(layer, names, x, weights); },
                             [&](const char* name) { return projected_outside(layer, name); }};
  return moe ? moe_->forward(context, h2, y_here) : dense_.forward(context, h2, y_here);
}

std::vector<at::Tensor> Llama::project(int64_t layer, const std::vector<const char*>& names, const at::Tensor& x,
                                       const std::vector<at::Tensor>& weights) const {
  std::vector<at::Tensor> outside, other;
  for (size_t i = 0; i < names.size(); ++i) (projected_outside(layer, names[i]) ? outside : other).push_back(weights[i]);
  std::vector<at::Tensor> from_outside = outside.empty() ? outside : projections_->linears(layer, x, outside);
  std::vector<at::Tensor> rest = other.size() > 1    ? shared_input_linears(x, other, kernels_)
                                 : other.size() == 1 ? std::vector<at::Tensor>{at::linear(x, other[0])}
                                                     : other;
  std::vector<at::Tensor> out;
  size_t a = 0, b = 0;
  for (const char* name : names) out.push_back(projected_outside(layer, name) ? from_outside[a++] : rest[b++]);
  return out;
}

ForwardSaves forward_saves(const ModelArgs& a, at::ScalarType compute_dtype, bool cuda, int64_t tp,
                           bool fused_kernels, int64_t cp, bool cp_ring, bool cp_packed) {
  const int64_t e = at::elementSize(compute_dtype), D = a.dim, hd = a.head_dim();
  const TpShare share = tp_share(a, tp);  // this rank's heads and FFN columns (all without TP)
  const int64_t H = share.heads, F = share.ffn, Q = H * hd, K = share.kv_heads * hd;
  ForwardSaves s;
  // An RMSNorm keeps its fp32 rstd, and on the CPU (composite kernel) also the normalised input
  // before the weight (fp32; for a bf16 input also the input cast to fp32); on CUDA the fused
  // kernel keeps only rstd (its input is kept anyway).
  s.norm = cuda ? 4 : (e == 4 ? 4 * D + 4 : 8 * D + 4);
  // block_forward: at the rank's own positions its two norms, the residual h2 (D, kept by the
  // second norm) and the block's output (D), which the next block keeps as its input. For every
  // token: the normed input x of wq/wk/wv (D) and y of w1/w3 (D), gathered whole under TP; q and k
  // after RoPE (Q, K); v (K); attention's output (Q; its layout is already [B, T, H*Dh], so wo
  // reads it as is) and fp32 log-sum-exp per head (H); w1's and w3's outputs (the gate's inputs,
  // silu_mul keeps no more; ATen's silu and mul nodes also SiLU's output) and the gate's output
  // (w2's input): 3 F, or 4.
  // Under context parallelism (per token of this rank's share of the row) attention keeps the
  // keys and values gathered whole, cp times this rank's; around a ring its own, and its output
  // in fp32 beside the one wo reads; packed for the variable-length kernel, what its pieces read:
  // rank r's chunks r and 2cp-1-r of a causal row read (r+1) and (2cp-r) chunks of keys, 2cp+1
  // chunks in all, cp + 1/2 times its own (documents read fewer).
  const int64_t mlp = (fused_kernels ? 3 : 4) * F;
  const int64_t kv_kept_twice = cp == 1 || cp_ring ? 2 : cp_packed ? 2 * cp + 1 : 2 * cp;  // both k and v
  s.block = {2 * s.norm + 2 * e * D, e * (2 * D + 2 * Q + kv_kept_twice * K + mlp) + 4 * H + (cp_ring ? 4 * Q : 0)};
  // A mixture of experts' block keeps the block's attention part and, for the feed-forward, per
  // token it routes: the router's scores (fp32, E; on a GPU also x cast to fp32, the gate's input)
  // and its choice (int64 K: the sort's order, read by the rows' gather and the combine's), the
  // weights (fp32 K); each of the K rows of x the experts read (D), their w1/w3 outputs, SiLU's
  // output and the gate's output (4 Fe: ATen's silu and mul nodes), the results in fp32 for the
  // weighted sum (4 D); and the shared experts as the dense SwiGLU of their width keeps its
  // products. Under TP a rank routes its own positions (their normed x, D, read by the gate) and
  // its columns of the shared experts read the gathered sequence (none without shared experts).
  if (a.num_experts > 0) {
    const int64_t K = a.top_k, Fe = a.expert_hidden(), S = a.num_shared_experts * Fe / tp;
    const int64_t router = 4 * a.num_experts + (e == 4 ? 0 : 4 * D) + 2 * 8 * K + 4 * K;
    const int64_t routed = e * K * (D + 4 * Fe) + 4 * K * D;
    const int64_t shared = S > 0 ? e * (fused_kernels ? 3 : 4) * S : 0;
    const int64_t local_x = tp > 1 ? e * D : 0, no_gathered_x = tp > 1 && S == 0 ? e * D : 0;
    s.moe_block = {s.block.own + router + routed + local_x, s.block.all - e * mlp + shared - no_gathered_x};
  }
  s.checkpointed = {e * D, 0};  // its input is the block before's output
  // head_loss: the final norm at the rank's positions; the normed x [N, D] (gathered whole under
  // TP) and the gradient the chunked loss makes in the forward, dx [N, D]; the head's fp32 rows.
  s.head = {s.norm, 2 * e * D};
  s.head_weight = 4 * share.vocab * D;
  return s;
}

at::Tensor Llama::embed(const at::Tensor& tokens) const {
  const at::Tensor w = tok_embeddings_.to(compute_dtype_);
  if (!tp_) return at::embedding(w, tokens);
  // This rank's rows are words [start, start + V): the others' tokens get zeros here and their
  // vectors from the rank that holds them, in the sum the reduce-scatter makes.
  const int64_t V = w.size(0), start = tp_rank() * V;
  const at::Tensor local = tokens - start;
  const at::Tensor here = local.ge(0).logical_and(local.lt(V)).unsqueeze(-1).to(compute_dtype_);
  return reduce_scatter_sequence(at::embedding(w, local.clamp(0, V - 1)) * here, *tp_);
}

at::Tensor Llama::head(const at::Tensor& h) const {
  TORCH_CHECK(!tp_, "Llama::head: the whole logits are not made under tensor parallelism (head_loss is)");
  at::Tensor x = rms_norm(h, norm_, args_.norm_eps);
  // fp32 logits for the loss (float64 stays float64).
  return at::linear(x, output_.to(compute_dtype_)).to(compute_dtype_ == at::kDouble ? at::kDouble : at::kFloat);
}

at::Tensor Llama::head_loss(const at::Tensor& h, const at::Tensor& targets) const {
  Phase phase("zb.loss");
  // The final norm through the same node (no residual after it): on a GPU its backward is our kernel.
  at::Tensor x = rms_norm_residual(h, tp_ ? replicated_weight(norm_, *tp_) : norm_, args_.norm_eps, kernels_).second;
  if (tp_) x = gather_sequence(x, *tp_);  // every rank scores every token on its words
  const int64_t V = output_.size(0);
  return chunked_cross_entropy(x.reshape({-1, args_.dim}), output_.to(compute_dtype_), targets,
                               loss_chunk_tokens(V, output_.is_cuda()), tp_, tp_rank() * V, kernels_);
}

at::Tensor Llama::blocks(at::Tensor h, const Documents& documents, StageHooks* hooks) const {
  for (int64_t i = 0; i < args_.n_layers; ++i) {
    const bool checkpoint = hooks && hooks->checkpointed(i) && h.requires_grad();
    if (hooks) hooks->before_block(i, h, checkpoint);
    h = checkpoint ? checkpointed_block(*this, i, h, documents, *hooks) : block_forward(i, h, documents);
    if (hooks) hooks->after_block(i, h);
  }
  return h;
}

at::Tensor Llama::loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents,
                       StageHooks* hooks) const {
  if (hooks) hooks->before_embedding();
  const at::Tensor h = blocks(embed(tokens), documents, hooks);
  if (hooks) hooks->before_loss(h);
  return head_loss(h, targets);
}

at::Tensor Llama::forward(const at::Tensor& tokens, const Documents& documents) const {
  return head(blocks(embed(tokens), documents, nullptr));
}

std::vector<at::Tensor> Llama::parameter_tensors() const {
  std::vector<at::Tensor> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(*p.slot);
  return out;
}

int64_t Llama::num_params() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.slot->numel();
  return n;
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

}  // namespace zb
