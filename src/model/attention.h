#pragma once
// The block's attention: causal over each row, or causal within each document of a packed row
// (ZeroBand's training mask: query q sees key kv when q >= kv and doc[q] == doc[kv]; positions,
// and so RoPE, run on across documents as ZeroBand's do).
//
// Two ways to compute the document mask, one result:
//   - CUDA, bf16/fp16: the variable-length flash kernel. The micro-batch's rows, flattened, are one
//     list of sequences given by cumulative lengths: no mask in memory, no padding, and no work
//     spent on pairs the mask removes.
//   - elsewhere (the CPU, fp32/float64): a block-diagonal causal mask [B, 1, T, T] added to the
//     scores in scaled_dot_product_attention (0 or -inf, in the compute dtype: a boolean mask
//     would be converted to that, and kept for backward, by every block).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "model_parallel/attention_documents.h"

namespace zb {

// Whether attention on `device` in `dtype` with heads of `head_dim` runs the flash kernel.
bool varlen_flash_supported(const c10::Device& device, at::ScalarType dtype, int64_t head_dim);

// From the loader's cumulative lengths (CPU int32, rows of T tokens) to what attention reads on
// `device`: the lengths themselves when `flash`, else the mask in `dtype` (the compute dtype).
// `cudnn_varlen` (KernelChoices, runtime.varlen_kernel = "cudnn"): document attention by cuDNN's
// forward over the same cumulative lengths (q, k, v ragged as [N, H, Dh]) with flash's backward,
// rather than LibTorch's variable-length flash kernels both ways. torch 2.11's cuDNN varlen
// backward takes head_dim for the longest sequence (pytorch/pytorch#186142) and returned wrong
// gradients on an H100; the forward is right but a third of flash's speed there: a choice to
// measure again on a later torch.
Documents make_documents(const at::Tensor& cu_seqlens, int64_t max_len, int64_t T, const c10::Device& device,
                         at::ScalarType dtype, bool flash, bool cudnn_varlen = false);

// Which kernel scaled_dot_product_attention may run (runtime.sdpa_backend): "auto" leaves the
// choice to PyTorch with every kernel a candidate (on an H100 torch 2.11 is said to prefer cuDNN's
// attention: the metrics say which ran);
// "flash", "cudnn", "efficient" or "math" keep that one and the unfused math as the only
// candidates. Process-wide; call before the first attention.
void use_sdpa_backend(const std::string& choice);

// The kernel attention runs for a micro-batch of rows of T tokens on `device` in `dtype` (what
// the metrics report): "flash_varlen" (or "cudnn_varlen") for documents by the flash kernels (or
// cuDNN's forward and flash's backward), else the name of
// PyTorch's choice for scaled_dot_product_attention on these shapes ("flash_attention",
// "cudnn_attention", "efficient_attention", "math"), asked of the dispatcher itself.
std::string attention_kernel(const c10::Device& device, at::ScalarType dtype, int64_t T, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, bool document_mask, bool flash_documents,
                             bool cudnn_varlen = false);

// Grouped-query attention: q [B, T, H, Dh], k and v [B, T, Hkv, Dh] with Hkv dividing H; returns
// [B, T, H*Dh], softmax scale 1/sqrt(Dh). Causal, within `documents` where given.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const Documents& documents = {});

// The largest logit q·k/√Dh each query head takes over the keys attention lets it see, fp32 [H]
// (no gradient): q [B, Tq, H, Dh], k [B, Tk, Hkv, Dh] as attention() takes them, under CP the whole
// rows' keys gathered (in the group's order: their positions `key_positions`, int64 [Tk]; else
// 0..Tk-1) and the queries at documents.positions. Where documents.mask is defined it says which
// keys a query sees; else causal in the row's positions, within documents.row_documents where
// given. The scores are made anew in fp32, a chunk of queries at a time (about 4M of them, 32M on
// a GPU): the fused kernels do not return them.
at::Tensor max_attention_logits(const at::Tensor& q, const at::Tensor& k, const Documents& documents,
                                const at::Tensor& key_positions = {});

}  // namespace zb
