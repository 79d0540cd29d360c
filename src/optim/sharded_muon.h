#pragma once
// Muon on row-sharded matrices (owner computes). Momentum and the update stay on each rank's
// rows; only the orthogonalisation needs whole matrices. Every Muon matrix is owned by one rank
// (greedy balance by Newton-Schulz cost, the same on every rank). One all-to-all sends each
// rank's rows of every matrix to its owner (in the Newton-Schulz dtype), owners orthogonalise
// their whole matrices in batches of equal shape, and a second all-to-all returns each rank its
// rows of the results. Per step and rank this moves about 2 x (Muon parameters / W) elements
// each way, in two collectives, and runs Newton-Schulz once per matrix.
#include <vector>

#include "dist/comm.h"
#include "optim/muon.h"

namespace zb {

// Installs the sharded orthogonalisation stage on `muon`, whose parameters are this rank's rows
// (RowShard layout over `comm`) of matrices with the global shapes it was
// given. Every parameter must have a gradient at every step (the engine guarantees it), so that
// all ranks take part in the same collectives. Hybrid sharding: the ranks holding the same rows
// in the other shard groups own the same matrices; given them as `split_over`, the replicas
// divide those matrices between them (balanced by Newton-Schulz cost) and an all-reduce over
// them completes the set (the same values: a sum with zeros); else each does all of them.
void make_muon_sharded(Muon& muon, Communicator& comm, Communicator* split_over = nullptr);

}  // namespace zb
