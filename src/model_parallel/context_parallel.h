#pragma once
// Context parallelism (parallel.cp): the tokens of each row split over a CP group of N ranks, which
// read the same rows. A row of T tokens is cut into 2N chunks of T/2N; rank i holds chunks i and
// 2N-1-i, in that order. Under the causal mask chunk j's queries see j+1 chunks of keys, so every
// rank's pair sees 2N+1 of them: equal work. Documents change that: a query sees only the earlier
// keys of its own document, so with documents much shorter than a chunk every rank does about the
// same (little) work whatever the split, and with documents longer than the row the causal balance
// holds; in between, the split is balanced on average over rows, not row by row.
//
// Per layer each rank gathers the keys and values of the whole row from its group (all-gather, in
// rank order: the gathered sequence is every rank's pair of chunks in turn, not the row's order),
// and its queries attend to them through a mask that says, for each query and each gathered key,
// whether the key is at or before the query in the row and in the same document. The backward
// sums the keys' and values' gradients over the group back to their owners (gather_sequence's
// backward). RoPE takes each token's position in the row.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

#include "model_parallel/attention_documents.h"
#include "model_parallel/group.h"

namespace zb {

// The positions of the row rank `rank` of `size` holds, in its order: int64 [T / size].
at::Tensor cp_positions(int64_t rank, int64_t size, int64_t T, const c10::Device& device = c10::kCPU);
// The positions of the gathered keys: every rank's cp_positions in rank order, int64 [T].
at::Tensor cp_gathered_positions(int64_t size, int64_t T, const c10::Device& device = c10::kCPU);

// What attention needs for rank `rank`'s queries against the gathered keys, for B rows of T
// tokens: an additive mask [B, 1, T / size, T] in `dtype` (0: attend, -inf: not), causal in the
// row's order and, where `cu_seqlens` is given (the loader's cumulative document lengths over the
// flattened rows, as make_documents takes them), within documents; with the rank's positions
// (cp_positions) for RoPE and for taking its tokens of the rows; with `ring` (ring_attention's) also
// the blocks of keys those queries see (one host read).
Documents cp_documents(const at::Tensor& cu_seqlens, int64_t B, int64_t T, int64_t rank, int64_t size,
                       const c10::Device& device, at::ScalarType dtype, bool ring = false);

// The same for the variable-length flash kernel (runtime.cp_varlen; on a GPU), with no mask: this
// rank's queries cut into pieces at its chunks' edges and at document boundaries, each piece
// reading its document's keys from the document's start (the row's start without `cu_seqlens`:
// the causal mask) to the piece's last token, packed from the gathered keys (Documents::key_index,
// into their flattened [B * T] in the group's order). The kernel's causal mask aligns a piece's n
// queries with the last n of its keys, so that each query sees its document up to itself.
Documents cp_varlen_documents(const at::Tensor& cu_seqlens, int64_t B, int64_t T, int64_t rank, int64_t size,
                              const c10::Device& device);

// Attention of this rank's queries over the whole row without gathering it (parallel.cp_rotate =
// "ring"): the keys and values travel around the group, one rank's block per step, while the
// current block is computed; the partial outputs combine through their log-sum-exps. `documents`
// are cp_documents' (the mask's columns in the group's order: block j is columns [j T/cp, (j+1)
// T/cp)); blocks with no visible pair are skipped. The backward sends the blocks around again, each with
// the gradient of its keys and values accumulating as it goes, and a last step home. q [B, T/cp,
// H, Dh], k and v [B, T/cp, Hkv, Dh] with Hkv dividing H; returns [B, T/cp, H*Dh], scale 1/sqrt(Dh);
// computed in fp32 (float64 for float64 inputs). `logit_max`, where given (fp32 [H]): raised in
// place to each head's largest scaled, masked score the forward computes (max_attention_logits').
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Documents& documents,
                          ModelParallelGroup& group, const at::Tensor* logit_max = nullptr);

}  // namespace zb
