#pragma once
// Tensor parallelism inside the model (issue 30): the ranks of a TP group each hold a slice of
// every large matrix and compute their part of each layer, Megatron's layout with sequence
// parallelism.
//
//   residual stream, norms      each rank holds T/tp positions of every row: [B, T/tp, D]
//   wq wk wv w1 w3 (columns)    all-gather the sequence, then this rank's heads / FFN columns
//   wo w2 (rows)                partial sums over the ranks, reduce-scattered back along the sequence
//   embedding, head             this rank's rows of the vocabulary; the loss combines the ranks'
//                               log-sum-exps (chunked_loss.h), so no rank holds all the logits
//   norm weights                whole on every rank; their gradients, from each rank's own
//                               positions, are summed over the group in backward
//
// The model sits below the process groups (src/CMakeLists.txt): it asks for collectives through
// ModelParallelGroup (model_parallel/group.h), which the parallel layer implements on a Communicator.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "model_parallel/group.h"

namespace zb {

// [B, t, ...] on every rank -> [B, size*t, ...]: the whole sequence, rank r's positions at
// [r*t, (r+1)*t). Backward: the gradient's sum over ranks, reduce-scattered back to [B, t, ...].
at::Tensor gather_sequence(const at::Tensor& x, ModelParallelGroup& group);
// [B, T, ...] partial sums on every rank -> this rank's positions [B, T/size, ...] of their sum.
// Backward: the gradient's positions all-gathered back to [B, T, ...].
at::Tensor reduce_scatter_sequence(const at::Tensor& x, ModelParallelGroup& group);
// `w` itself; backward sums its gradient over the group. For weights every rank holds whole but
// applies to its own positions or heads (norm weights; key/value heads shared by several ranks).
at::Tensor replicated_weight(const at::Tensor& w, ModelParallelGroup& group);

// Which part of a whole parameter a rank's tensor is under tensor parallelism: rows (dim 0) or
// columns (dim 1) [start, start + its size along dim); dim -1: the whole, on every rank.
struct TpSlice {
  int64_t dim = -1;
  int64_t start = 0;
  bool split() const { return dim >= 0; }
};

}  // namespace zb
