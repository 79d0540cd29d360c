#include "fsdp/fsdp_collectives.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <utility>

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

at::Tensor all_gather_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                            int64_t block_numel) {
  at::NoGradGuard no_grad;
  const FSDPParam& first = *params.front();
  auto opts = at::TensorOptions().dtype(first.compute_dtype()).device(first.sharded.device());
  at::Tensor block = at::zeros({block_numel}, opts);  // zeros: the padding rows
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam* p = params[i];
    if (p->local_rows() == 0) continue;
    block.narrow(0, offsets[i], p->sharded.numel())
        .copy_(p->sharded.detach().reshape({-1}));  // casts fp32 -> compute dtype
  }
  return block;
}

void all_gather_copy_out(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                         const at::Tensor& gathered, int64_t world_size) {
  at::NoGradGuard no_grad;
  at::Tensor blocks = gathered.view({world_size, -1});
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    p->allocate_unsharded();
    copy_blocks_to_full(p->shard, blocks, offsets[i], p->unsharded_view());
  }
}

at::Tensor reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                                const std::vector<at::Tensor>& grads, int64_t block_numel,
                                int64_t world_size, int64_t replicas) {
  at::NoGradGuard no_grad;
  const auto device = params.front()->sharded.device();
  at::Tensor blocks = at::zeros({world_size, block_numel}, at::TensorOptions().device(device));
  for (size_t i = 0; i < params.size(); ++i)
    if (i < grads.size() && grads[i].defined())
      copy_full_to_blocks(params[i]->shard, grads[i], blocks, offsets[i]);  // casts to fp32
  blocks.div_(static_cast<double>(world_size * replicas));
  return blocks.view({-1});
}

void reduce_scatter_copy_out(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                             const at::Tensor& reduced) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    at::Tensor g = reduced.narrow(0, offsets[i], p->sharded.numel()).view(p->sharded.sizes());
    at::Tensor& grad = p->sharded.mutable_grad();
    if (grad.defined()) grad.add_(g);
    else grad = g.clone();
  }
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
