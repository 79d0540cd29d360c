#pragma once
// One parameter under the sharding engine (FSDP2's FSDPParam): its fp32 shard, the master copy
// the optimizer updates, and the storage its gathered full copy lives in while a unit is
// unsharded. Which rows this rank holds is `shard` (RowShard: rows per rank, padding).
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <string>
#include <vector>

#include "parallel/row_shard.h"

namespace zb {

class FSDPParam {
 public:
  // Takes this rank's rows of `full` (the whole fp32 parameter, identical on every rank).
  FSDPParam(std::string name, at::Tensor* slot, const at::Tensor& full, int64_t rank,
            int64_t world_size, at::ScalarType compute_dtype);

  const std::string name;
  at::Tensor* const slot;               // the model's slot this parameter feeds
  const std::vector<int64_t> full_shape;
  const RowShard shard;
  const int64_t rank;

  int64_t first_row() const { return shard.first_row(rank); }
  int64_t local_rows() const { return shard.rows_of(rank); }

  // [local_rows, ...] fp32 leaf that requires grad: the optimizer's parameter. Its .grad() is
  // this rank's rows of the gradient of the mean loss over all ranks.
  at::Tensor sharded;

  // Unsharded storage (compute dtype): every rank's padded block of rows in rank order, as the
  // all-gather delivers them, so one split-copy per unit fills every parameter's storage (the
  // padding, under a row per rank, follows the last row). Allocated while the unit is
  // unsharded, zero bytes otherwise; the tensors autograd saved in forward alias it, which is
  // why it is refilled in place for backward rather than replaced.
  bool unsharded_allocated() const { return storage_.nbytes() > 0; }
  void allocate_unsharded();
  void free_unsharded();
  // A fresh tensor over the unsharded storage's real rows, in the parameter's shape (its own
  // version counter, so refilling the storage for backward does not trip autograd's in-place
  // checks).
  at::Tensor unsharded_view() const;
  // The whole storage as [world_size, block_numel]: rank r's padded block is row r.
  at::Tensor padded_blocks() const;

  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // FP8 all-gather (FSDPOptions::float8_all_gather, for the weights the model multiplies in FP8):
  // its rows travel as e4m3 bytes cast with `float8_scale` (fp32, 0-d, a power of two: the
  // engine's, from the whole weight's amax) and are dequantised into the unsharded storage, exactly.
  bool float8_gather = false;
  at::Tensor float8_scale;
  // The bytes its padded block takes in a unit's all-gather: one a value in FP8, else the compute
  // dtype's; rounded up to 16, so that the next parameter's block stays aligned.
  int64_t gather_bytes() const;

 private:
  at::ScalarType compute_dtype_;
  c10::Storage storage_;
  size_t unsharded_nbytes_;
};

}  // namespace zb
