#include "model/attention.h"

#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_cudnn_attention_forward.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/maximum.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <tuple>

namespace zb {

bool varlen_flash_supported(const c10::Device& device, at::ScalarType dtype, int64_t head_dim) {
  return device.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf) && head_dim % 8 == 0 &&
         head_dim <= 256;
}

Documents make_documents(const at::Tensor& cu_seqlens, int64_t max_len, int64_t T, const c10::Device& device,
                         at::ScalarType dtype, bool flash, bool cudnn_varlen) {
  Documents d;
  if (!cu_seqlens.defined()) return d;
  // The kernel trusts these (a wrong total or longest piece reads out of bounds): checked here,
  // on the host copy.
  TORCH_CHECK(cu_seqlens.device().is_cpu() && cu_seqlens.scalar_type() == at::kInt && cu_seqlens.numel() >= 2,
              "make_documents: cumulative lengths must be int32 on the host, at least two");
  const at::Tensor host = cu_seqlens.contiguous();  // the loader's already is: no copy
  const int32_t* c = host.data_ptr<int32_t>();
  const int64_t N = c[host.numel() - 1];
  TORCH_CHECK(c[0] == 0 && N > 0 && N % T == 0 && max_len >= 1 && max_len <= T,
              "make_documents: malformed cumulative lengths (first 0, last a multiple of T = ", T,
              ", longest piece in [1, T]; got last ", N, ", longest ", max_len, ")");
  if (flash && cudnn_varlen) {
    // cuDNN builds (and caches) a graph for each count of sequences and longest one: the count
    // rounded up to a power of two with empty sequences at the end, and the longest taken as T,
    // so that a run meets a few graphs rather than one per micro-batch.
    const int64_t n = host.numel() - 1;
    int64_t bucket = 1;
    while (bucket < n) bucket *= 2;
    // Pinned, so that the copy does not wait: the host allocator keeps the buffer until it is done.
    at::Tensor padded = at::empty({bucket + 1}, host.options().pinned_memory(device.is_cuda()));
    padded.fill_(c[n]);
    padded.narrow(0, 0, n + 1).copy_(host);
    d.cudnn_cu_seqlens = padded.to(device, /*non_blocking=*/true);
    d.cu_seqlens = d.cudnn_cu_seqlens.narrow(0, 0, n + 1);  // flash's backward: the real sequences
    d.max_len = max_len;
    d.row_documents = document_ids(d.cu_seqlens, N / T, T);
    return d;
  }
  at::Tensor cu = cu_seqlens.to(device, /*non_blocking=*/true);
  if (flash) {
    d.cu_seqlens = cu;
    d.max_len = max_len;
    d.row_documents = document_ids(cu, N / T, T);
    return d;
  }
  const at::Tensor doc = document_ids(cu, N / T, T);
  at::Tensor causal = at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
  at::Tensor allowed = (doc.unsqueeze(2) == doc.unsqueeze(1)).logical_and_(causal).unsqueeze(1);  // [B, 1, T, T]
  d.mask = at::zeros(allowed.sizes(), at::TensorOptions().dtype(dtype).device(device))
               .masked_fill_(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  d.max_len = max_len;
  return d;
}

void use_sdpa_backend(const std::string& choice) {
  const bool all = choice == "auto";  // PyTorch's defaults: every kernel a candidate
  const bool flash = choice == "flash", cudnn = choice == "cudnn", efficient = choice == "efficient";
  if (!all && !flash && !cudnn && !efficient && choice != "math")
    throw std::invalid_argument("runtime.sdpa_backend: unknown kernel \"" + choice + "\"");
  auto& ctx = at::globalContext();
  ctx.setSDPUseFlash(all || flash);
  ctx.setSDPUseCuDNN(all || cudnn);
  ctx.setSDPUseMemEfficient(all || efficient);
  ctx.setSDPUseMath(true);  // the fallback where the chosen kernel cannot take the inputs
}

std::string attention_kernel(const c10::Device& device, at::ScalarType dtype, int64_t T, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, bool document_mask, bool flash_documents,
                             bool cudnn_varlen) {
  if (document_mask && flash_documents)
    return cudnn_varlen ? "cudnn_varlen" : "flash_varlen";
  // One row of the real shapes, in the layout attention() hands over ([B, T, H, Dh] transposed),
  // requiring gradients as in training: the dispatcher's choice depends on all of that.
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  const at::Tensor q = at::empty({1, T, heads, head_dim}, opts).transpose(1, 2).requires_grad_(true);
  const at::Tensor k = at::empty({1, T, kv_heads, head_dim}, opts).transpose(1, 2).requires_grad_(true);
  const at::Tensor v = at::empty({1, T, kv_heads, head_dim}, opts).transpose(1, 2).requires_grad_(true);
  std::optional<at::Tensor> mask;
  if (document_mask) mask = at::zeros({1, 1, T, T}, opts);
  const int64_t choice = at::_fused_sdp_choice(q, k, v, mask, /*dropout_p=*/0.0, /*is_causal=*/!document_mask,
                                               /*scale=*/std::nullopt, /*enable_gqa=*/kv_heads != heads);
  switch (static_cast<at::SDPBackend>(choice)) {
    case at::SDPBackend::math: return "math";
    case at::SDPBackend::flash_attention: return "flash_attention";
    case at::SDPBackend::efficient_attention: return "efficient_attention";
    case at::SDPBackend::cudnn_attention: return "cudnn_attention";
    case at::SDPBackend::overrideable: return "overrideable";
    default: return "none";
  }
}

namespace {

// cuDNN's softmax statistics (log-sum-exp of each query row's scaled scores, as flash's) in flash's
// layout [H, N] float. Their shape has changed between torch versions ([N, H, 1], [H, N]): taken
// from the sizes, and anything else is an error rather than a silent misreading.
at::Tensor lse_as_flash(const at::Tensor& lse, int64_t H, int64_t N) {
  at::Tensor s = lse;
  while (s.dim() > 2 && (s.size(-1) == 1 || s.size(0) == 1)) s = s.size(-1) == 1 ? s.squeeze(-1) : s.squeeze(0);
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 2 && H != N,
              "cuDNN attention's softmax statistics: unexpected shape ", lse.sizes(), " for ", H, " heads, ", N,
              " tokens");
  if (s.size(0) == H && s.size(1) == N) return s.contiguous();
  TORCH_CHECK(s.size(0) == N && s.size(1) == H, "cuDNN attention's softmax statistics: unexpected shape ",
              lse.sizes(), " for ", H, " heads, ", N, " tokens");
  return s.t().contiguous();
}

// The variable-length kernels (forward and backward, as LibTorch exposes them) joined into one
// autograd node: q [N, H, Dh], k and v [N, Hkv, Dh] over the flattened rows; causal within each
// piece that cu_seqlens delimits; the kernels handle Hkv < H themselves. Flash's forward, or with
// `cudnn_max_len` > 0 cuDNN's over `cudnn_cu_seqlens` (ATen's _cudnn_attention_forward with
// cumulative lengths: its ragged layout is this one); flash's backward either way,
// from the forward's output and log-sum-exp. Without dropout the backward reads no random state:
// flash's placeholders (slots 6 and 7) are kept as its forward returns them.
struct VarlenAttention : torch::autograd::Function<VarlenAttention> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const at::Tensor& cu_seqlens, int64_t max_len,
                                                const at::Tensor& cu_seqlens_k, int64_t max_len_k,
                                                const at::Tensor& cudnn_cu_seqlens, int64_t cudnn_max_len) {
    at::Tensor out, logsumexp, rng_state, unused;
    if (cudnn_max_len > 0) {
      auto [o, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug_mask] = at::_cudnn_attention_forward(
          q, k, v, /*attn_bias=*/std::nullopt, cudnn_cu_seqlens, cudnn_cu_seqlens, cudnn_max_len, cudnn_max_len,
          /*compute_log_sumexp=*/true, /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false);
      out = o, logsumexp = lse_as_flash(lse, q.size(1), q.size(0));
      const auto u64 = q.options().dtype(at::kUInt64);
      rng_state = at::empty({2}, u64), unused = at::empty({}, u64);
    } else {
      auto [o, lse, rng, u, debug_mask] =
          at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens_k, max_len, max_len_k, /*dropout_p=*/0.0,
                                       /*is_causal=*/true, /*return_debug_mask=*/false);
      out = o, logsumexp = lse, rng_state = rng, unused = u;
    }
    ctx->save_for_backward({q, k, v, out, logsumexp, cu_seqlens, cu_seqlens_k, rng_state, unused});
    ctx->saved_data["max_len"] = max_len;
    ctx->saved_data["max_len_k"] = max_len_k;
    return {out};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const int64_t max_len = ctx->saved_data["max_len"].toInt(), max_len_k = ctx->saved_data["max_len_k"].toInt();
    const at::Tensor dout = grads[0].contiguous();
    auto [dq, dk, dv] = at::_flash_attention_backward(dout, s[0], s[1], s[2], s[3], s[4], s[5], s[6], max_len,
                                                      max_len_k, /*dropout_p=*/0.0, /*is_causal=*/true, s[7], s[8]);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Documents& documents) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dh = q.size(3);
  if (documents.key_index.defined()) {
    // Context parallelism (cp_varlen_documents): this rank's pieces of queries, each with its keys
    // packed from the gathered ones (index_select: their gradients added back where they came from).
    const at::Tensor qf = q.reshape({B * T, H, Dh}).contiguous();
    const at::Tensor kf = k.reshape({-1, k.size(2), Dh}).index_select(0, documents.key_index);
    const at::Tensor vf = v.reshape({-1, v.size(2), Dh}).index_select(0, documents.key_index);
    const at::Tensor out = VarlenAttention::apply(qf, kf, vf, documents.cu_seqlens, documents.max_len,
                                                  documents.cu_seqlens_k, documents.max_len_k, documents.cu_seqlens,
                                                  0)[0];
    return out.view({B, T, H * Dh});
  }
  if (documents.cu_seqlens.defined()) {
    const at::Tensor qf = q.reshape({B * T, H, Dh}).contiguous(), kf = k.reshape({B * T, k.size(2), Dh}).contiguous(),
                     vf = v.reshape({B * T, v.size(2), Dh}).contiguous();
    // An autograd function takes no undefined tensor: flash's lengths stand in for cuDNN's.
    const bool cudnn = documents.cudnn_cu_seqlens.defined();
    const at::Tensor out = VarlenAttention::apply(qf, kf, vf, documents.cu_seqlens, documents.max_len,
                                                  documents.cu_seqlens, documents.max_len,
                                                  cudnn ? documents.cudnn_cu_seqlens : documents.cu_seqlens,
                                                  cudnn ? T : 0)[0];
    return out.view({B, T, H * Dh});
  }
  const bool gqa = k.size(2) != H;
  at::Tensor out = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
      documents.mask.defined() ? std::optional<at::Tensor>(documents.mask) : std::nullopt,
      /*dropout_p=*/0.0, /*is_causal=*/!documents.mask.defined(), /*scale=*/std::nullopt, /*enable_gqa=*/gqa);
  return out.transpose(1, 2).reshape({B, T, H * Dh});
}

at::Tensor max_attention_logits(const at::Tensor& q, const at::Tensor& k, const Documents& documents,
                                const at::Tensor& key_positions) {
  at::NoGradGuard no_grad;
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), Dh = q.size(3), Tk = k.size(1), Hkv = k.size(2);
  const auto work = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dh));
  const double inf = std::numeric_limits<double>::infinity();
  // Query head h reads key head h / (H / Hkv): the queries as [B, Hkv, H / Hkv x n, Dh] against
  // the keys as [B, Hkv, Dh, Tk] (one batched product, the keys not repeated).
  const int64_t G = H / Hkv;
  const at::Tensor keys = k.to(work).permute({0, 2, 3, 1});
  // Without a mask: causal in the row's positions, within each document.
  const auto index = q.options().dtype(at::kLong);
  const at::Tensor q_pos = documents.positions.defined() ? documents.positions : at::arange(Tq, index);
  const at::Tensor k_pos = key_positions.defined() ? key_positions : at::arange(Tk, index);
  at::Tensor q_doc, k_doc;
  if (!documents.mask.defined() && documents.row_documents.defined()) {
    q_doc = documents.row_documents.index_select(1, q_pos);
    k_doc = documents.row_documents.index_select(1, k_pos);
  }
  at::Tensor best = at::full({H}, -inf, q.options().dtype(work));
  // Queries a chunk at a time: at most about 4M scores in memory (32M, 128 MiB, on a GPU).
  const int64_t budget = q.is_cuda() ? int64_t{1} << 25 : int64_t{1} << 22;
  const int64_t chunk = std::max<int64_t>(1, budget / std::max<int64_t>(1, B * H * Tk));
  // Queries and keys both in the row's order (no CP): a chunk of queries sees no key after its last.
  const bool row_order = !documents.positions.defined() && !key_positions.defined() && Tq == Tk;
  for (int64_t s = 0; s < Tq; s += chunk) {
    const int64_t n = std::min(chunk, Tq - s), m = row_order ? s + n : Tk;  // m: the keys it may see
    const at::Tensor queries =
        q.narrow(1, s, n).to(work).reshape({B, n, Hkv, G, Dh}).permute({0, 2, 3, 1, 4}).reshape({B, Hkv, G * n, Dh});
    at::Tensor scores = at::matmul(queries, keys.narrow(3, 0, m)).mul_(scale).view({B, Hkv, G, n, m});
    if (documents.mask.defined()) {
      scores.add_(documents.mask.narrow(2, s, n).narrow(3, 0, m).to(work).unsqueeze(1));  // [B, 1, 1, n, m]
    } else {
      at::Tensor seen = (q_pos.narrow(0, s, n).unsqueeze(1) >= k_pos.narrow(0, 0, m).unsqueeze(0)).unsqueeze(0);
      if (q_doc.defined())
        seen = seen.logical_and(q_doc.narrow(1, s, n).unsqueeze(2) == k_doc.narrow(1, 0, m).unsqueeze(1));
      scores.masked_fill_(seen.logical_not().view({seen.size(0), 1, 1, n, m}), -inf);  // [B or 1, n, m]
    }
    best = at::maximum(best, scores.amax({0, 3, 4}).reshape({H}));
  }
  return best.to(at::kFloat);
}

}  // namespace zb
