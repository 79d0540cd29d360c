#pragma once
// Muon under data parallelism: every rank holds every matrix and its momentum, but each matrix
// is orthogonalised once, by its owner (the same size-balanced assignment as the sharded
// version); the results are shared by one all-reduce in which each matrix is non-zero on its
// owner only.
#include <vector>

#include "dist/comm.h"
#include "optim/muon.h"

namespace zb {

void make_muon_replicated(Muon& muon, Communicator& comm);

// The exchange itself, for whole matrices every rank of `comm` holds alike: rank owner[i]
// orthogonalises matrix i (Muon::orthogonalize_held; inputs[i] belongs to params[i]), and one
// all-reduce (in the Newton-Schulz dtype; each value non-zero on exactly one rank, so the sum is
// exact) gives every rank all the results. Sharded Muon uses it across hybrid sharding's replicas.
std::vector<at::Tensor> orthogonalize_once(const Muon& muon, const std::vector<at::Tensor>& inputs,
                                           const std::vector<const Muon::Param*>& params,
                                           const std::vector<int64_t>& owner, Communicator& comm);

}  // namespace zb
