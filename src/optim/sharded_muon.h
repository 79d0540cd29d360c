#pragma once
// Muon on row-sharded matrices (owner computes). Momentum and the update stay on each rank's
// rows; only the orthogonalisation needs whole matrices. Every Muon matrix is owned by one rank
// (greedy balance by Newton-Schulz cost, the same on every rank). One all-to-all sends each
// rank's rows of every matrix to its owner (in the Newton-Schulz dtype), owners orthogonalise
// their whole matrices in batches of equal shape, and a second all-to-all returns each rank its
// rows of the results. Per step and rank this moves about 2 x (Muon parameters / W) elements
// each way, in two collectives, and runs Newton-Schulz once per matrix. A mixture of experts'
// stacks [E, rows, cols] are sharded by whole experts: each rank orthogonalises its own, with no
// exchange.
#include <functional>
#include <vector>

#include "dist/comm.h"
#include "optim/muon.h"

namespace zb {

// Installs the sharded orthogonalisation stage on `muon`, whose parameters are this rank's rows
// (RowShard layout over `comm`) of matrices with the shapes it was given (the TP slices' under
// tensor parallelism, which Muon's tensor-parallel stage then completes). Every parameter must
// have a gradient at every step (the engine guarantees it), so that all ranks take part in the
// same collectives. Hybrid sharding: the ranks holding the same rows in the other shard groups own
// the same matrices; given them as `split_over`, the replicas divide those matrices between them
// (balanced by Newton-Schulz cost) and an all-reduce over them completes the set (the same values:
// a sum with zeros); else each does all of them.
void make_muon_sharded(Muon& muon, Communicator& comm, Communicator* split_over = nullptr);

// What an owner does with the whole matrices it assembled: `which` are their indices in the list
// given to orthogonalize_by_owner; returns their orthogonalisations, same shapes.
using OwnerStage =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& whole, const std::vector<size_t>& which)>;

// The exchange itself. rows[i] is this rank's block of rows (RowShard::of(shapes[i], comm.size()))
// of matrix i; owner[i] the rank of `comm` that assembles it (in `dtype`) and runs `stage` on it;
// returns this rank's rows of every result. `phase` names the two all-to-alls in profiles.
std::vector<at::Tensor> orthogonalize_by_owner(const std::vector<at::Tensor>& rows,
                                               const std::vector<std::vector<int64_t>>& shapes,
                                               const std::vector<int64_t>& owner, Communicator& comm,
                                               at::ScalarType dtype, const char* phase, const OwnerStage& stage);

}  // namespace zb
