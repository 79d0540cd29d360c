#pragma once
// One parameter under the sharding engine (FSDP2's FSDPParam): its fp32 shard, the master copy
// the optimizer updates, and the storage its gathered full copy lives in while a unit is
// unsharded.
//
// Sharding: dim 0 is split into ceil(rows / W) rows per rank; rank r holds rows
// [r*rows_per_rank, min(rows, (r+1)*rows_per_rank)), possibly none. In collectives every rank
// contributes rows_per_rank rows, zero-padded, so all ranks move equal-sized blocks.
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <string>
#include <utility>
#include <vector>

namespace zb {

class FSDPParam {
 public:
  // Takes this rank's rows of `full` (the whole fp32 parameter, identical on every rank).
  FSDPParam(std::string name, at::Tensor* slot, const at::Tensor& full, int64_t rank,
            int64_t world_size, at::ScalarType compute_dtype);

  const std::string name;
  at::Tensor* const slot;               // the model's slot this parameter feeds
  const std::vector<int64_t> full_shape;
  const int64_t rows, row_numel, rows_per_rank, local_rows;

  // Elements each rank puts into a collective: rows_per_rank * row_numel.
  int64_t block_numel() const { return rows_per_rank * row_numel; }

  // [local_rows, ...] fp32 leaf that requires grad: the optimizer's parameter. Its .grad() is
  // this rank's rows of the gradient of the mean loss over all ranks.
  at::Tensor sharded;

  // Unsharded storage (compute dtype, rows * row_numel elements). Allocated while the unit is
  // unsharded, zero bytes otherwise; the tensors autograd saved in forward alias it, which is
  // why it is refilled in place for backward rather than replaced.
  bool unsharded_allocated() const { return storage_.nbytes() > 0; }
  void allocate_unsharded();
  void free_unsharded();
  // A fresh tensor over the unsharded storage (its own version counter, so refilling the
  // storage for backward does not trip autograd's in-place checks).
  at::Tensor unsharded_view() const;

  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // Copies between this parameter's full rows (`full`, [rows, ...]) and its blocks in a unit's
  // rank-major collective buffer (`blocks`, [W, unit_numel]; rank r's rows at columns
  // [offset, offset + block_numel())). At most two copies whatever W, where a loop over ranks
  // would launch W; padding rows in `blocks` are neither read nor written.
  void copy_rows_from_blocks(const at::Tensor& blocks, int64_t offset, const at::Tensor& full) const;
  void copy_rows_to_blocks(const at::Tensor& full, const at::Tensor& blocks, int64_t offset) const;

 private:
  // (full-side view, blocks-side view) pairs covering the real rows.
  std::vector<std::pair<at::Tensor, at::Tensor>> row_views(const at::Tensor& full, const at::Tensor& blocks,
                                                           int64_t offset) const;

  at::ScalarType compute_dtype_;
  c10::Storage storage_;
  size_t unsharded_nbytes_;
};

}  // namespace zb
