#include "model_parallel/context_parallel.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/log.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace zb {

at::Tensor cp_positions(int64_t rank, int64_t size, int64_t T, const c10::Device& device) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size && T % (2 * size) == 0, "cp_positions: rank ", rank, " of ",
              size, " for ", T, " tokens (T must divide into 2 x size chunks)");
  const int64_t c = T / (2 * size);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  return at::cat({at::arange(rank * c, (rank + 1) * c, opts), at::arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, opts)});
}

at::Tensor cp_gathered_positions(int64_t size, int64_t T, const c10::Device& device) {
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < size; ++r) all.push_back(cp_positions(r, size, T, device));
  return at::cat(all);
}

Documents cp_documents(const at::Tensor& cu_seqlens, int64_t B, int64_t T, int64_t rank, int64_t size,
                       const c10::Device& device, at::ScalarType dtype, bool ring) {
  const at::Tensor mine = cp_positions(rank, size, T, device), keys = cp_gathered_positions(size, T, device);
  at::Tensor allowed = keys.unsqueeze(0).le(mine.unsqueeze(1)).unsqueeze(0).expand({B, mine.numel(), T});  // causal
  if (cu_seqlens.defined()) {
    const at::Tensor cu = cu_seqlens.to(device);
    TORCH_CHECK(cu.scalar_type() == at::kInt && cu.numel() >= 2, "cp_documents: cumulative lengths must be int32");
    const at::Tensor doc = document_ids(cu, B, T);
    allowed = allowed.logical_and(doc.index_select(1, mine).unsqueeze(2) == doc.index_select(1, keys).unsqueeze(1));
  }
  Documents d;
  d.mask = at::zeros({B, 1, mine.numel(), T}, at::TensorOptions().dtype(dtype).device(device))
               .masked_fill_(allowed.unsqueeze(1).logical_not(), -std::numeric_limits<double>::infinity());
  if (ring) {
    const int64_t t = mine.numel();
    const at::Tensor any = allowed.reshape({B, t, size, t}).any(3).any(1).any(0).to(at::kLong).cpu();
    d.visible_blocks.assign(any.data_ptr<int64_t>(), any.data_ptr<int64_t>() + size);
  }
  d.max_len = T;
  d.positions = mine;
  return d;
}

Documents cp_varlen_documents(const at::Tensor& cu_seqlens, int64_t B, int64_t T, int64_t rank, int64_t size,
                              const c10::Device& device) {
  TORCH_CHECK(T % (2 * size) == 0, "cp_varlen_documents: ", T, " tokens do not divide into 2 x ", size, " chunks");
  const int64_t C = T / (2 * size);
  // Where each position of the row sits among the gathered keys (every rank's pair of chunks in turn).
  std::vector<int64_t> gathered_at(static_cast<size_t>(T));
  for (int64_t r = 0, i = 0; r < size; ++r)
    for (const int64_t chunk : {r, 2 * size - 1 - r})
      for (int64_t p = chunk * C; p < (chunk + 1) * C; ++p) gathered_at[static_cast<size_t>(p)] = i++;
  // Each row's document starts, in its own positions (every row starts one).
  std::vector<std::vector<int64_t>> starts(static_cast<size_t>(B), std::vector<int64_t>{0});
  if (cu_seqlens.defined()) {
    const at::Tensor cu = cu_seqlens.to(at::kCPU).to(at::kLong).contiguous();
    const int64_t* c = cu.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < cu.numel(); ++i) {
      const int64_t b = c[i] / T, p = c[i] % T;
      if (b < B && p > 0) starts[static_cast<size_t>(b)].push_back(p);
    }
  }
  std::vector<int32_t> cu_q{0}, cu_k{0};
  std::vector<int64_t> keys;
  int64_t max_q = 0, max_k = 0;
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t>& s = starts[static_cast<size_t>(b)];
    for (const int64_t chunk : {rank, 2 * size - 1 - rank}) {
      // The chunk [chunk C, (chunk + 1) C) cut where documents start inside it.
      for (int64_t a = chunk * C; a < (chunk + 1) * C;) {
        const auto next = std::upper_bound(s.begin(), s.end(), a);
        const int64_t doc_start = *(next - 1), e = std::min<int64_t>((chunk + 1) * C, next == s.end() ? T : *next);
        for (int64_t p = doc_start; p < e; ++p) keys.push_back(b * T + gathered_at[static_cast<size_t>(p)]);
        cu_q.push_back(static_cast<int32_t>(cu_q.back() + (e - a)));
        cu_k.push_back(static_cast<int32_t>(cu_k.back() + (e - doc_start)));
        max_q = std::max(max_q, e - a);
        max_k = std::max(max_k, e - doc_start);
        a = e;
      }
    }
  }
  const auto i32 = at::TensorOptions().dtype(at::kInt), i64 = at::TensorOptions().dtype(at::kLong);
  Documents d;
  d.cu_seqlens = at::tensor(cu_q, i32).to(device);
  d.cu_seqlens_k = at::tensor(cu_k, i32).to(device);
  d.key_index = at::tensor(keys, i64).to(device);
  d.max_len = max_q;
  d.max_len_k = max_k;
  d.positions = cp_positions(rank, size, T, device);
  // Each token's document over the rows (one a row without documents), for the logits' watch.
  d.row_documents = cu_seqlens.defined() ? document_ids(cu_seqlens.to(device), B, T)
                                         : at::zeros({B, T}, i32.device(device));
  return d;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Heads [B, t, h, Dh] -> [B, h, t, Dh] in `work`, key/value heads repeated to `H`.
at::Tensor heads_first(const at::Tensor& x, int64_t H, at::ScalarType work) {
  at::Tensor y = x.transpose(1, 2).to(work);
  return y.size(1) == H ? y : y.repeat_interleave(H / y.size(1), 1);
}

// [B, H, t, Dh] gradients of repeated heads -> [B, t, Hkv, Dh], each key/value head's summed.
at::Tensor kv_heads_back(const at::Tensor& g, int64_t Hkv) {
  const int64_t B = g.size(0), H = g.size(1), t = g.size(2), Dh = g.size(3);
  return g.view({B, Hkv, H / Hkv, t, Dh}).sum(2).transpose(1, 2);
}

// One rank's keys and values as the buffer that travels around the ring: keys, then values, flat.
at::Tensor pack(const at::Tensor& k, const at::Tensor& v) {
  return at::cat({k.contiguous().view(-1), v.contiguous().view(-1)});
}

// The keys and values in such a buffer (of keys shaped as `k`, values as `v`) at every query
// head, [B, H, t, Dh] each in `work`.
std::pair<at::Tensor, at::Tensor> unpack(const at::Tensor& held, const at::Tensor& k, const at::Tensor& v,
                                         int64_t H, at::ScalarType work) {
  return {heads_first(held.narrow(0, 0, k.numel()).view(k.sizes()), H, work),
          heads_first(held.narrow(0, k.numel(), v.numel()).view(v.sizes()), H, work)};
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  // visible: Documents::visible_blocks, as 0/1.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& mask, const std::vector<int64_t>& visible, ModelParallelGroup* group,
                               const at::Tensor* logit_max) {
    const int64_t n = group->size(), me = group->rank();
    const int64_t B = q.size(0), t = q.size(1), H = q.size(2), Dh = q.size(3);
    const auto work = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const double scale = 1.0 / std::sqrt(static_cast<double>(Dh));
    const at::Tensor qh = heads_first(q, H, work);
    at::Tensor out = at::zeros({B, H, t, Dh}, qh.options());
    at::Tensor lse = at::full({B, H, t, 1}, -std::numeric_limits<double>::infinity(), qh.options());
    // The block held travels as one buffer: keys then values, in their own dtype.
    at::Tensor held = pack(k, v);
    for (int64_t s = 0; s < n; ++s) {
      const int64_t owner = (me - s + n) % n;  // whose keys and values are held now
      at::Tensor next = at::empty_like(held);
      std::function<void()> arrived = s + 1 < n ? group->start_ring_shift(next, held) : std::function<void()>();
      if (visible[owner]) {
        const auto [kb, vb] = unpack(held, k, v, H, work);
        const at::Tensor m = mask.narrow(3, owner * t, t).to(work);
        // One [B, H, t, t] buffer: the scaled, masked scores, then their exponentials in place.
        at::Tensor p = at::matmul(qh, kb.transpose(2, 3));
        p.mul_(scale).add_(m);
        if (logit_max) logit_max->copy_(at::maximum(*logit_max, p.amax({0, 2, 3}).to(logit_max->scalar_type())));
        // Rows that see nothing of this block: their log-sum-exp is -inf and they add nothing.
        at::Tensor row_max = std::get<0>(p.max(3, /*keepdim=*/true));
        row_max = at::where(at::isfinite(row_max), row_max, at::zeros_like(row_max));
        p.sub_(row_max).exp_();
        const at::Tensor sum = p.sum(3, /*keepdim=*/true);
        const at::Tensor block_lse = at::log(sum) + row_max;
        // A row that sees something sums to at least 1 (its maximum's term); one that sees nothing
        // to 0, over a numerator of 0.
        const at::Tensor block_out = at::matmul(p, vb) / sum.clamp_min(1.0);
        const at::Tensor total = at::logaddexp(lse, block_lse);
        const at::Tensor finite = at::isfinite(total);
        const at::Tensor zero = at::zeros_like(total);
        out = out * at::where(finite, at::exp(lse - total), zero) + block_out * at::where(finite, at::exp(block_lse - total), zero);
        lse = total;
      }
      if (arrived) {
        arrived();
        held = next;
      }
    }
    ctx->save_for_backward({q, k, v, mask, out, lse});
    ctx->saved_data["visible"] = visible;
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return {out.transpose(1, 2).reshape({B, t, H * Dh}).to(q.scalar_type())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<ModelParallelGroup*>(ctx->saved_data["group"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &mask = saved[3], &out = saved[4], &lse = saved[5];
    const int64_t n = group->size(), me = group->rank();
    const int64_t B = q.size(0), t = q.size(1), H = q.size(2), Dh = q.size(3), Hkv = k.size(2);
    const auto work = out.scalar_type();
    const double scale = 1.0 / std::sqrt(static_cast<double>(Dh));
    const std::vector<int64_t> visible = ctx->saved_data["visible"].toIntVector();
    const at::Tensor qh = heads_first(q, H, work);
    const at::Tensor dout = grads[0].view({B, t, H, Dh}).transpose(1, 2).to(work);
    const at::Tensor delta = (dout * out).sum(3, /*keepdim=*/true);  // rowsum(dO o O)
    at::Tensor dq = at::zeros_like(qh);
    // The keys and values travel as in forward; the gradient of the block held travels with it
    // (in the work dtype), and after the last block one more step takes it home.
    at::Tensor held = pack(k, v);
    at::Tensor held_grad = at::zeros({k.numel() + v.numel()}, qh.options());
    for (int64_t s = 0; s < n; ++s) {
      const int64_t owner = (me - s + n) % n;
      at::Tensor next = at::empty_like(held);
      std::function<void()> arrived = s + 1 < n ? group->start_ring_shift(next, held) : std::function<void()>();
      if (visible[owner]) {
        const auto [kb, vb] = unpack(held, k, v, H, work);
        const at::Tensor m = mask.narrow(3, owner * t, t).to(work);
        // Two [B, H, t, t] buffers: the probabilities (recomputed from the final log-sum-exp) and
        // their gradient, turned into the scores' in place.
        at::Tensor p = at::matmul(qh, kb.transpose(2, 3));
        p.mul_(scale).add_(m).sub_(lse).exp_();
        const at::Tensor dv = at::matmul(p.transpose(2, 3), dout);
        at::Tensor ds = at::matmul(dout, vb.transpose(2, 3));
        ds.sub_(delta).mul_(p);
        dq += at::matmul(ds, kb) * scale;
        const at::Tensor dk = at::matmul(ds.transpose(2, 3), qh) * scale;
        held_grad += pack(kv_heads_back(dk, Hkv), kv_heads_back(dv, Hkv));
      }
      at::Tensor next_grad = at::empty_like(held_grad);
      std::function<void()> grad_arrived = group->start_ring_shift(next_grad, held_grad);
      if (arrived) {
        arrived();
        held = next;
      }
      grad_arrived();
      held_grad = next_grad;
    }
    // After n steps the gradient held is of this rank's own keys and values.
    const at::Tensor dk = held_grad.narrow(0, 0, k.numel()).view(k.sizes()).to(k.scalar_type());
    const at::Tensor dv = held_grad.narrow(0, k.numel(), v.numel()).view(v.sizes()).to(v.scalar_type());
    return {dq.transpose(1, 2).to(q.scalar_type()), dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Documents& documents,
                          ModelParallelGroup& group, const at::Tensor* logit_max) {
  const at::Tensor& mask = documents.mask;
  TORCH_CHECK(mask.defined() && mask.dim() == 4 && mask.size(2) == q.size(1) && mask.size(3) == q.size(1) * group.size() &&
                  static_cast<int64_t>(documents.visible_blocks.size()) == group.size(),
              "ring_attention: the documents must be cp_documents' with ring (a [B, 1, T/cp, T] mask and its visible "
              "blocks)");
  return RingAttention::apply(q, k, v, mask, documents.visible_blocks, &group, logit_max)[0];
}

}  // namespace zb
