#include "parallel/row_shard.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <utility>

#include "dist/comm.h"

namespace zb {

namespace {

// (full-side view, blocks-side view) pairs covering the real rows: the ranks with a full block
// as one [ranks, rows_per_rank, row_numel] view each side, then the partial rank's rows.
std::vector<std::pair<at::Tensor, at::Tensor>> row_views(const RowShard& s, const at::Tensor& full,
                                                         const at::Tensor& blocks, int64_t offset) {
  const int64_t W = blocks.size(0), complete = s.full_ranks(), rest = s.partial_rows();
  at::Tensor padded = blocks.narrow(1, offset, s.block_numel()).view({W, s.rows_per_rank, s.row_numel});
  at::Tensor flat = full.reshape({s.rows, s.row_numel});
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  if (complete > 0)
    out.emplace_back(flat.narrow(0, 0, complete * s.rows_per_rank).view({complete, s.rows_per_rank, s.row_numel}),
                     padded.narrow(0, 0, complete));
  if (rest > 0)
    out.emplace_back(flat.narrow(0, complete * s.rows_per_rank, rest), padded[complete].narrow(0, 0, rest));
  return out;
}

}  // namespace

void copy_full_to_blocks(const RowShard& shard, const at::Tensor& full, const at::Tensor& blocks,
                         int64_t offset) {
  for (auto& [src, dst] : row_views(shard, full, blocks, offset)) dst.copy_(src);
}

void copy_blocks_to_full(const RowShard& shard, const at::Tensor& blocks, int64_t offset,
                         const at::Tensor& full) {
  for (auto& [dst, src] : row_views(shard, full, blocks, offset)) dst.copy_(src);
}

at::Tensor full_rows_of_blocks(const RowShard& shard, const at::Tensor& blocks) {
  return blocks.reshape({shard.world_size * shard.rows_per_rank, shard.row_numel}).narrow(0, 0, shard.rows);
}

at::Tensor gather_whole(const RowShard& shard, const std::vector<int64_t>& shape,
                        const at::Tensor& local, Communicator& comm) {
  at::NoGradGuard no_grad;
  auto opts = local.options().requires_grad(false);
  at::Tensor in = at::zeros({shard.block_numel()}, opts);
  if (local.numel() > 0) in.narrow(0, 0, local.numel()).copy_(local.reshape({-1}));
  at::Tensor all = at::empty({shard.world_size * shard.block_numel()}, opts);
  comm.all_gather(all, in).wait();
  return full_rows_of_blocks(shard, all.view({shard.world_size, -1})).reshape(shape).clone();
}

}  // namespace zb
