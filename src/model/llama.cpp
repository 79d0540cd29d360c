#include "model/llama.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <cmath>

#include "model/chunked_loss.h"
#include "util/phase.h"

namespace zb {

Llama::Llama(const ModelArgs& args, const at::TensorOptions& options, bool allocate_parameters) : args_(args) {
  // Master weights are fp32 unless the caller asks for float64 (tests compare against float64).
  auto opts = options.dtype(options.has_dtype() && options.dtype() == at::kDouble ? at::kDouble : at::kFloat);
  compute_dtype_ = opts.dtype().toScalarType();
  const auto param_opts = allocate_parameters ? opts : opts.device(c10::kMeta);
  auto param = [&](std::initializer_list<int64_t> shape) {
    return at::empty(shape, param_opts).requires_grad_(true);
  };
  const int64_t D = args.dim, hd = args.head_dim(), F = args.ffn_hidden();
  tok_embeddings_ = param({args.vocab_size, D});
  layers_.resize(args.n_layers);
  for (auto& b : layers_) {
    b.wq = param({args.n_heads * hd, D});
    b.wk = param({args.n_kv_heads * hd, D});
    b.wv = param({args.n_kv_heads * hd, D});
    b.wo = param({D, args.n_heads * hd});
    b.w1 = param({F, D});
    b.w2 = param({D, F});
    b.w3 = param({F, D});
    b.attention_norm = param({D});
    b.ffn_norm = param({D});
  }
  norm_ = param({D});
  output_ = param({args.vocab_size, D});
  // ZeroBand precomputes RoPE for twice the sequence length.
  rope_ = rope_tables(hd, 2 * args.max_seq_len, args.rope_theta, opts);

  // Slots in param_specs() order: embedding, per block (wq wk wv wo w1 w2 w3 norms), norm, head;
  // with how each is initialised (see init_weights). torchtitan's trunc_normal_ keeps torch's
  // default absolute cut at +-2, which at std 0.02 is 100 std away: a plain normal in practice.
  int64_t layer = -1;  // of the parameters being added
  auto add = [&](std::string name, at::Tensor* slot, Init init) {
    params_.push_back({std::move(name), slot, layer});
    init_.push_back(init);
  };
  add("tok_embeddings.weight", &tok_embeddings_, {1.0, 0.0});
  for (int64_t i = 0; i < args.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    auto& b = layers_[i];
    layer = i;
    const double depth_std = 0.02 / std::sqrt(2.0 * static_cast<double>(i + 1));
    add(p + "attention.wq.weight", &b.wq, {0.02, 2.0});
    add(p + "attention.wk.weight", &b.wk, {0.02, 2.0});
    add(p + "attention.wv.weight", &b.wv, {0.02, 2.0});
    add(p + "attention.wo.weight", &b.wo, {depth_std, 2.0});
    add(p + "feed_forward.w1.weight", &b.w1, {0.02, 2.0});
    add(p + "feed_forward.w2.weight", &b.w2, {depth_std, 2.0});
    add(p + "feed_forward.w3.weight", &b.w3, {depth_std, 2.0});
    add(p + "attention_norm.weight", &b.attention_norm, {});
    add(p + "ffn_norm.weight", &b.ffn_norm, {});
  }
  layer = -1;
  add("norm.weight", &norm_, {});
  const double head_std = 1.0 / std::sqrt(static_cast<double>(args.dim));
  add("output.weight", &output_, {head_std, 3 * head_std});  // cut at 3 std
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
  TORCH_CHECK(t.sizes() == params_[i].slot->sizes(), "init_parameter: ", params_[i].name, " has shape ",
              params_[i].slot->sizes(), ", not ", t.sizes());
  if (init.std == 0) t.fill_(1.0);
  else if (init.cut == 0) t.normal_(0.0, init.std);
  else trunc_normal_(t, 0.0, init.std, -init.cut, init.cut);
}

at::Tensor Llama::block_forward(int64_t layer, const at::Tensor& h, const Documents& documents) const {
  Phase phase("zb.block_forward", layer);
  const auto& b = layers_[layer];
  const auto dt = compute_dtype_;
  const int64_t B = h.size(0), T = h.size(1), hd = args_.head_dim();
  const double eps = args_.norm_eps;

  at::Tensor x = rms_norm(h, b.attention_norm, eps);
  at::Tensor q = at::linear(x, b.wq.to(dt)).view({B, T, args_.n_heads, hd});
  at::Tensor k = at::linear(x, b.wk.to(dt)).view({B, T, args_.n_kv_heads, hd});
  at::Tensor v = at::linear(x, b.wv.to(dt)).view({B, T, args_.n_kv_heads, hd});
  at::Tensor attn = attention(apply_rope(q, rope_), apply_rope(k, rope_), v, documents);
  at::Tensor h2 = h + at::linear(attn, b.wo.to(dt));
  return h2 + swiglu(rms_norm(h2, b.ffn_norm, eps), b.w1.to(dt), b.w2.to(dt), b.w3.to(dt));
}

ForwardSaves forward_saves(const ModelArgs& a, at::ScalarType compute_dtype, bool cuda) {
  const int64_t e = at::elementSize(compute_dtype), D = a.dim, H = a.n_heads, F = a.ffn_hidden();
  const int64_t Q = a.n_heads * a.head_dim(), K = a.n_kv_heads * a.head_dim();
  ForwardSaves s;
  // An RMSNorm keeps its fp32 rstd, and on the CPU (composite kernel) also the normalised input
  // before the weight (fp32; for a bf16 input also the input cast to fp32); on CUDA the fused
  // kernel keeps only rstd (its input is kept anyway).
  s.norm = cuda ? 4 : (e == 4 ? 4 * D + 4 : 8 * D + 4);
  // block_forward: its two norms; the normed input x of wq/wk/wv (D); q and k after RoPE (Q, K);
  // v (K); attention's output (Q; its layout is already [B, T, H*Dh], so wo reads it as is) and
  // fp32 log-sum-exp per head (H); the residual h2 (D, kept by the second norm); the normed y of
  // w1/w3 (D); w1's output (SiLU's input), SiLU's output, w3's output and their product (w2's
  // input): 4 F; and the block's output (D), which the next block keeps as its input.
  s.block = 2 * s.norm + e * (4 * D + 2 * Q + 2 * K + 4 * F) + 4 * H;
  s.checkpointed = e * D;  // its input is the block before's output
  // head_loss: the final norm keeps as a block's norm does, and the normed x [N, D]; the chunked
  // loss makes the gradient in the forward: dx [N, D] and the head's fp32 [V, D].
  s.head = s.norm + 2 * e * D;
  s.head_weight = 4 * a.vocab_size * D;
  return s;
}

at::Tensor Llama::embed(const at::Tensor& tokens) const {
  return at::embedding(tok_embeddings_.to(compute_dtype_), tokens);
}

at::Tensor Llama::head(const at::Tensor& h) const {
  at::Tensor x = rms_norm(h, norm_, args_.norm_eps);
  // fp32 logits for the loss (float64 stays float64).
  return at::linear(x, output_.to(compute_dtype_)).to(compute_dtype_ == at::kDouble ? at::kDouble : at::kFloat);
}

at::Tensor Llama::head_loss(const at::Tensor& h, const at::Tensor& targets) const {
  Phase phase("zb.loss");
  at::Tensor x = rms_norm(h, norm_, args_.norm_eps);
  return chunked_cross_entropy(x.reshape({-1, args_.dim}), output_.to(compute_dtype_), targets,
                               loss_chunk_tokens(args_.vocab_size, output_.is_cuda()));
}

at::Tensor Llama::loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents,
                       const StageHook& before_stage) const {
  const int64_t L = args_.n_layers;
  if (before_stage) before_stage(0, at::Tensor());
  at::Tensor h = embed(tokens);
  for (int64_t i = 0; i < L; ++i) {
    if (before_stage) before_stage(i + 1, h);
    h = block_forward(i, h, documents);
  }
  if (before_stage) before_stage(L + 1, h);
  return head_loss(h, targets);
}

at::Tensor Llama::forward(const at::Tensor& tokens, const Documents& documents) const {
  at::Tensor h = embed(tokens);
  for (int64_t i = 0; i < args_.n_layers; ++i) h = block_forward(i, h, documents);
  return head(h);
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
