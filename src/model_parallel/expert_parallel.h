#pragma once
// Expert parallelism's exchanges (model/moe.h's routed_experts_parallel): the ranks of an
// expert-parallel group hold a mixture's experts in equal consecutive parts (rank j: experts
// [j E/ep, (j+1) E/ep)); each routes its own tokens, sends every assignment's row to the rank that
// holds its expert, and gets the results back the same way.
#include <ATen/core/Tensor.h>

#include <vector>

#include "model_parallel/group.h"

namespace zb {

// How many rows each rank sends this rank's experts: from `counts` [E] (this rank's assignments
// per expert, any device), every rank's, exchanged; returns [ep, E / ep] int64 on the host, row s
// what rank s sends to each of this rank's experts. (The splits of the rows' exchange are host
// numbers: this waits for the device.)
at::Tensor exchange_expert_counts(const at::Tensor& counts, ModelParallelGroup& group);

// rows [R, D]: send[j] of them (consecutive, in rank order) to rank j; returns [sum(recv), D], the
// recv[s] rows from rank s in rank order. Its backward sends the gradients back the other way.
at::Tensor exchange_rows(const at::Tensor& rows, const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                         ModelParallelGroup& group);

}  // namespace zb
