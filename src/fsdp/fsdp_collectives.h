#pragma once
// The copies around a unit's collectives (FSDP2's _fsdp_collectives): its parameters' shards into
// one all-gather block and out into their unsharded storage, and their gradients into the
// reduce-scatter's rank-major layout and back into the shards. The row copies underneath are
// parallel/row_shard.h's.
#include <ATen/core/Tensor.h>

#include <vector>

#include "fsdp/fsdp_param.h"
#include "parallel/row_shard.h"

namespace zb {

// A unit's all-gather: its parameters' shards cast into one zero-padded block (`offsets`: each
// parameter's place in the block, its padded block after the one before), and the gathered
// blocks copied out into every parameter's unsharded storage.
at::Tensor all_gather_input(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                            int64_t block_numel);
void all_gather_copy_out(const std::vector<FSDPParam*>& params, const at::Tensor& gathered, int64_t world_size);

// The same for a unit with FP8 parameters (FSDPParam::float8_gather): the block is bytes, each
// parameter's padded block in its own type (gather_bytes) at `offsets` (bytes); an FP8 one cast
// with its scale on the way in and dequantised into its storage on the way out.
at::Tensor all_gather_input_bytes(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                                  int64_t block_bytes);
void all_gather_copy_out_bytes(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                               const at::Tensor& gathered, int64_t world_size);
// One rank's FP8 parameters: the values their gather would give, the shard through FP8 and back.
void float8_round_trip(FSDPParam& p);

// A unit's reduce-scatter: the full gradients written in fp32 into the rank-major layout over
// `world_size` ranks (row r: every parameter's padded block r, in order; one _chunk_cat), each
// divided by `averaged_over`, the number of ranks whose losses the gradient averages (every
// rank's loss is a mean over its own samples, the global mean their average, and Gloo has no
// average: pre-divide, then sum; under hybrid sharding the replicas' sums are added after, and
// they count among them). A missing gradient counts as zero.
at::Tensor reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<at::Tensor>& grads,
                                int64_t block_numel, int64_t world_size, int64_t averaged_over);
// This rank's reduced block added to each parameter's sharded .grad().
void reduce_scatter_copy_out(const std::vector<FSDPParam*>& params, const std::vector<int64_t>& offsets,
                             const at::Tensor& reduced);

}  // namespace zb
