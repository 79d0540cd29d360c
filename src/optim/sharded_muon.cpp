#include "optim/sharded_muon.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "optim/replicated_muon.h"
#include "parallel/row_shard.h"
#include "util/phase.h"

namespace zb {

void make_muon_sharded(Muon& muon, Communicator& comm, Communicator* split_over) {
  const std::vector<int64_t> owner = assign_muon_owners(muon, comm.size());
  Communicator* split = split_over && split_over->size() > 1 ? split_over : nullptr;

  muon.set_orthogonalizer([&muon, &comm, owner, split](const std::vector<at::Tensor>& inputs,
                                                       const std::vector<const Muon::Param*>& active) {
    TORCH_CHECK(active.size() == muon.params().size(),
                "sharded Muon needs a gradient for every matrix on every rank");
    const int64_t W = comm.size(), me = comm.rank();
    const auto dtype = muon.hyper().ns_dtype;
    const size_t n = inputs.size();
    std::vector<RowShard> shard(n);  // each matrix's rows over the ranks
    for (size_t i = 0; i < n; ++i) shard[i] = RowShard::of(active[i]->global_shape, W);
    const auto opts = inputs.front().options().dtype(dtype);

    // 1. Send each matrix's rows (padded to its block) to its owner, grouped by owner.
    std::vector<int64_t> send_splits(W, 0), recv_splits(W, 0);
    std::vector<at::Tensor> send_parts;
    for (int64_t o = 0; o < W; ++o)
      for (size_t i = 0; i < n; ++i)
        if (owner[i] == o) {
          at::Tensor part = at::zeros({shard[i].block_numel()}, opts);
          if (inputs[i].numel() > 0) part.narrow(0, 0, inputs[i].numel()).copy_(inputs[i].reshape({-1}));
          send_parts.push_back(part);
          send_splits[o] += shard[i].block_numel();
        }
    int64_t mine = 0;  // elements of my matrices from one source rank
    std::vector<size_t> owned;
    for (size_t i = 0; i < n; ++i)
      if (owner[i] == me) owned.push_back(i), mine += shard[i].block_numel();
    std::fill(recv_splits.begin(), recv_splits.end(), mine);
    at::Tensor send = send_parts.empty() ? at::empty({0}, opts) : at::cat(send_parts);
    at::Tensor recv = at::empty({W * mine}, opts);
    {
      Phase phase("zb.muon.all_to_all");  // each matrix's rows to its owner
      comm.all_to_all(recv, send, recv_splits, send_splits).wait();
    }

    // 2. Owners assemble whole matrices (source rank r's block holds r's rows) and orthogonalise
    //    them, same-shape ones batched together.
    std::vector<at::Tensor> whole;
    at::Tensor by_source = recv.view({W, mine});
    int64_t offset = 0;
    for (size_t i : owned) {
      at::Tensor m = at::empty(active[i]->global_shape, opts);
      copy_blocks_to_full(shard[i], by_source, offset, m);
      whole.push_back(m);
      offset += shard[i].block_numel();
    }
    std::vector<at::Tensor> results;
    if (split) {
      // The replicas own the same matrices: they divide them as ranks divide all of them.
      std::vector<std::vector<int64_t>> shapes;
      for (const at::Tensor& m : whole) shapes.push_back(m.sizes().vec());
      results = orthogonalize_once(muon, whole, assign_owners_by_cost(shapes, split->size()), *split);
    } else {
      results = muon.orthogonalize_local(whole);
    }

    // 3. Return each rank its rows of every result.
    at::Tensor back = at::zeros({W, mine}, opts);
    offset = 0;
    for (size_t k = 0; k < owned.size(); ++k) {
      copy_full_to_blocks(shard[owned[k]], results[k], back, offset);
      offset += shard[owned[k]].block_numel();
    }
    at::Tensor returned = at::empty({send.numel()}, opts);
    at::Tensor back_flat = back.view({-1});
    {
      Phase phase("zb.muon.all_to_all");  // the orthogonalised rows back
      comm.all_to_all(returned, back_flat, send_splits, recv_splits).wait();
    }

    // 4. My rows of each matrix, in the order they were sent.
    std::vector<at::Tensor> out(n);
    offset = 0;
    for (int64_t o = 0; o < W; ++o)
      for (size_t i = 0; i < n; ++i)
        if (owner[i] == o) {
          out[i] = returned.narrow(0, offset, inputs[i].numel()).view(inputs[i].sizes());
          offset += shard[i].block_numel();
        }
    return out;
  });
}

}  // namespace zb
