#pragma once
// Muon under data parallelism: every rank holds every matrix and its momentum, but each matrix
// is orthogonalised once, by its owner (the same size-balanced assignment as the sharded
// version); the results are shared by one all-reduce in which each matrix is non-zero on its
// owner only.
#include "dist/comm.h"
#include "optim/muon.h"

namespace zb {

void make_muon_replicated(Muon& muon, Communicator& comm);

}  // namespace zb
