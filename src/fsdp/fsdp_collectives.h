#pragma once
// The copies around the sharding engine's collectives (FSDP2's _fsdp_collectives): between a
// parameter's full rows, its rank-major padded collective buffer and this rank's shard. The
// layout is RowShard's; every user of the padded layout (units, sharded Muon, gathering whole
// parameters) goes through these functions.
//
// A collective buffer `blocks` is [W, S]: rank r's block is row r, S elements. A tensor occupies
// columns [offset, offset + shard.block_numel()) of every block, its rank-r rows first, then zero
// padding up to rows_per_rank rows.
#include <ATen/core/Tensor.h>

#include <vector>

#include "dist/comm.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/row_shard.h"

namespace zb {

// full [rows, ...] -> every rank's rows in `blocks` (padding untouched). At most two copies
// whatever W (the ranks with a full block, then the partial one), where a loop over ranks would
// launch W.
void copy_full_to_blocks(const RowShard& shard, const at::Tensor& full, const at::Tensor& blocks,
                         int64_t offset);
// The reverse: every rank's rows out of `blocks` into full [rows, ...].
void copy_blocks_to_full(const RowShard& shard, const at::Tensor& blocks, int64_t offset,
                         const at::Tensor& full);
// A [W, block_numel] buffer of one tensor's blocks viewed as its padded rows, cut to the real
// rows: [rows, row_numel] (a view; for tensors that are the only occupant of the buffer).
at::Tensor full_rows_of_blocks(const RowShard& shard, const at::Tensor& blocks);

// A unit's all-gather: its parameters' shards cast into one zero-padded block (`offsets`: each
// parameter's place in the block), and the gathered blocks copied out into every parameter's
// unsharded storage.
at::Tensor all_gather_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                            int64_t block_numel);
void all_gather_copy_out(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                         const at::Tensor& gathered, int64_t world_size);

// A unit's reduce-scatter: the full fp32 gradients written into the rank-major layout, each
// divided by the number of ranks that contribute, W x `replicas` (every rank's loss is a mean over
// its own samples, the global mean their average, and Gloo has no average: pre-divide, then sum;
// under hybrid sharding the replicas' sums are added after). A missing gradient counts as zero.
at::Tensor reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                                const std::vector<at::Tensor>& grads, int64_t block_numel,
                                int64_t world_size, int64_t replicas = 1);
// This rank's reduced block added to each parameter's sharded .grad().
void reduce_scatter_copy_out(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                             const at::Tensor& reduced);

// The whole value of one sharded tensor (`local`: this rank's rows), gathered from every rank.
at::Tensor gather_whole(const RowShard& shard, const std::vector<int64_t>& shape,
                        const at::Tensor& local, Communicator& comm);

}  // namespace zb
