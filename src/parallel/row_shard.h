#pragma once
// Who owns which rows of a tensor sharded over W ranks: the one definition every part of the
// project uses (the sharding engine, sharded Muon, checkpoints, tests).
//
// Dim 0 is split into ceil(rows / W) rows per rank: rank r owns rows
// [r * rows_per_rank, min(rows, (r + 1) * rows_per_rank)), possibly none (the last ranks of a
// tensor with fewer rows than ranks). In collectives every rank contributes rows_per_rank rows,
// zero-padded, so all ranks move equal-sized blocks.
//
// A collective buffer `blocks` is [W, S]: rank r's block is row r, S elements. A tensor occupies
// columns [offset, offset + shard.block_numel()) of every block, its rank-r rows first, then zero
// padding up to rows_per_rank rows. Every user of that padded layout (FSDP units, sharded Muon,
// gathering whole parameters) goes through the functions below.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zb {

class Communicator;

struct RowShard {
  int64_t rows = 0;           // of the whole tensor
  int64_t row_numel = 1;      // elements per row (the product of the other dimensions)
  int64_t rows_per_rank = 0;  // ceil(rows / W): each rank's block in a collective
  int64_t world_size = 1;

  // The layout of a tensor of `shape` over `world_size` ranks (a 0-d tensor counts as one row).
  static RowShard of(const std::vector<int64_t>& shape, int64_t world_size) {
    RowShard s;
    s.rows = shape.empty() ? 1 : shape[0];
    for (size_t d = 1; d < shape.size(); ++d) s.row_numel *= shape[d];
    s.world_size = world_size;
    s.rows_per_rank = (s.rows + world_size - 1) / world_size;
    return s;
  }

  // The rank that owns row r.
  int64_t owner(int64_t row) const { return row / rows_per_rank; }
  // Rank r's first row and number of rows (none past the end).
  int64_t first_row(int64_t rank) const { return std::min(rows, rank * rows_per_rank); }
  int64_t rows_of(int64_t rank) const {
    return std::clamp<int64_t>(rows - rank * rows_per_rank, 0, rows_per_rank);
  }
  int64_t numel_of(int64_t rank) const { return rows_of(rank) * row_numel; }
  // Elements each rank puts into a collective (its rows, padded).
  int64_t block_numel() const { return rows_per_rank * row_numel; }
  // Ranks [0, full_ranks()) hold rows_per_rank rows; the next one the remaining partial_rows().
  int64_t full_ranks() const { return rows_per_rank > 0 ? rows / rows_per_rank : 0; }
  int64_t partial_rows() const { return rows_per_rank > 0 ? rows % rows_per_rank : 0; }
};

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

// The whole value of one sharded tensor (`local`: this rank's rows), gathered from every rank.
at::Tensor gather_whole(const RowShard& shard, const std::vector<int64_t>& shape,
                        const at::Tensor& local, Communicator& comm);

}  // namespace zb
