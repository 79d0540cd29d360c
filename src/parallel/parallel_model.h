#pragma once
// What the trainer, the optimizer and checkpoints need from a model spread over ranks, whichever
// way it is spread: the sharding engine (FSDPEngine: each rank holds row shards) or data
// parallelism (DDPEngine: each rank holds everything and gradients are all-reduced).
#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "model/llama.h"
#include "parallel/step_trace.h"

namespace zb {

// One parameter as this rank holds it: the fp32 leaf the optimizer updates and where its rows
// sit in the whole tensor.
struct ShardedParameter {
  std::string name;                   // the model's name, e.g. "layers.3.attention.wq.weight"
  at::Tensor* tensor;                 // rows [row_start, row_start + size(0)) of the whole
  std::vector<int64_t> global_shape;  // the whole tensor's shape
  int64_t row_start = 0;
  // Every rank holds the same rows (data parallelism): one rank's copy is the value.
  bool replicated = false;
  // Tensor parallelism: the first of the whole tensor's columns the rows hold (a row-parallel
  // matrix's slice), or 0 for every column; and whether every rank of the TP group holds these
  // same rows (norm weights, shared key/value heads): their rank 0's copy is the value.
  int64_t col_start = 0;
  bool tp_shared = false;
  // The whole tensor's dimension split over the TP group (-1: none) and this rank's slice's
  // shape (the tensor the data-parallel shards divide; global_shape without TP).
  int64_t tp_dim = -1;
  std::vector<int64_t> slice_shape;
};

// Whole tensors (a model on one process, as the tests' references train it).
std::vector<ShardedParameter> whole_parameters(const std::vector<NamedParameter>& params);

class ParallelModel {
 public:
  virtual ~ParallelModel() = default;
  // The mean next-token loss of tokens [B, T] against targets [B, T] (Llama::loss, through the
  // engine's gathering and hooks), attention within `documents` where given.
  virtual at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents = {}) = 0;
  // false on micro-batches before the last: gradients accumulate locally, no collective.
  virtual void set_requires_gradient_sync(bool sync) = 0;
  // After each backward: the optimizer's tensors have their (averaged) gradients, and everything
  // gathered for the backward is freed.
  virtual void finish_backward() = 0;
  // After a forward without backward (evaluation): frees whatever the forward gathered (FSDP's
  // kept casts stay, to be made again at their next use).
  virtual void reshard() = 0;
  // The optimizer (or anything else) changed the parameters: whatever the engine keeps that is
  // derived from them (FSDP's kept casts) is made again at its next use.
  virtual void parameters_changed() {}
  // Whether it keeps such casts (FSDP's train.keep_unsharded in effect).
  virtual bool keeps_unsharded() const { return false; }
  // The tensors the optimizer updates, in model order.
  virtual std::vector<ShardedParameter> parameters() = 0;
  // Clips by the global L2 norm over all ranks; returns the norm before clipping (0-d fp32;
  // parallel/clip.h: one host read of the coefficient).
  virtual at::Tensor clip_grad_norm_(double max_norm) = 0;
  // The whole fp32 value of every parameter (collective under sharding; for tests and export).
  virtual std::vector<std::pair<std::string, at::Tensor>> gather_full_parameters() = 0;
  // Which copy of the sharded state this rank holds: under hybrid sharding each shard group is a
  // replica (0, 1, ...); otherwise 0. Checkpoints save copy 0's rows only.
  virtual int64_t replica() const { return 0; }
  // This rank's place in its tensor-parallel group (0 without one).
  virtual int64_t tp_rank() const { return 0; }
  // Records the engine's own events (gathers in place, frees, block computations) into `trace`;
  // null stops it. Collectives are recorded by the communicators (Communicator::observe).
  virtual void set_trace(StepTrace* /*trace*/) {}
};

}  // namespace zb
