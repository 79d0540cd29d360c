#pragma once
// What attention reads of a micro-batch's documents (model/attention.h): cumulative lengths for
// the variable-length kernels, or a mask. Below the model, beside the context-parallel masks
// (context_parallel.h), which are made of the same.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zb {

// The documents of one micro-batch of B rows of T tokens, as attention reads them on its device.
// Default-constructed: no documents, plain causal attention.
struct Documents {
  // Cumulative document lengths over the rows flattened in order: int32 [n + 1] from 0 to B*T,
  // with every row's start among them (a document that runs from one row into the next counts in
  // each). The flash kernel's input.
  at::Tensor cu_seqlens;
  int64_t max_len = 0;  // tokens of the longest piece
  // With runtime.varlen_kernel = "cudnn": the same lengths for cuDNN's forward, their count padded
  // to a power of two with empty sequences (cu_seqlens is a view of its start).
  at::Tensor cudnn_cu_seqlens;
  // The same as an additive mask (0: attend, -inf: not) where the flash kernel does not run.
  at::Tensor mask;
  // Under context parallelism (context_parallel.h): the positions in the row of the tokens
  // this rank holds, int64 [T / cp], for RoPE; undefined otherwise.
  at::Tensor positions;
  // Context parallelism through the variable-length kernel (cp_varlen_documents): the keys each
  // piece of queries reads, packed from the gathered ones (int64 indices into their flattened
  // [B * T]), with their own cumulative lengths (int32) and longest piece. cu_seqlens and max_len
  // are then the queries'.
  at::Tensor key_index, cu_seqlens_k;
  int64_t max_len_k = 0;
  // Around the ring (cp_documents with `ring`): for each rank's block of keys, 1 where this rank's
  // queries see any of it, read once a micro-batch (the ring skips the others in every layer).
  std::vector<int64_t> visible_blocks;
  // Where the variable-length kernels read the documents (no mask): each token's document number
  // over the whole rows, int32 [B, T] (document_ids), for the attention logits' watch
  // (max_attention_logits).
  at::Tensor row_documents;
  bool any() const { return cu_seqlens.defined() || mask.defined(); }
};

// Each token's document number over B rows of T tokens, [B, T] int32 on the device of `cu`, the
// cumulative lengths of the pieces of the flattened rows (int32, every row's start among them).
at::Tensor document_ids(const at::Tensor& cu, int64_t B, int64_t T);

}  // namespace zb
