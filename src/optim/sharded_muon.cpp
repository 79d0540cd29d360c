#include "optim/sharded_muon.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "optim/replicated_muon.h"
#include "parallel/row_shard.h"
#include "util/phase.h"

namespace zb {

std::vector<at::Tensor> orthogonalize_by_owner(const std::vector<at::Tensor>& rows,
                                               const std::vector<std::vector<int64_t>>& shapes,
                                               const std::vector<int64_t>& owner, Communicator& comm,
                                               at::ScalarType dtype, const char* phase, const OwnerStage& stage) {
  const int64_t W = comm.size(), me = comm.rank();
  const size_t n = rows.size();
  if (n == 0) return {};
  std::vector<RowShard> shard(n);  // each matrix's rows over the ranks
  for (size_t i = 0; i < n; ++i) shard[i] = RowShard::of(shapes[i], W);
  const auto opts = rows.front().options().dtype(dtype);

  // 1. Send each matrix's rows (padded to its block) to its owner, grouped by owner.
  std::vector<int64_t> send_splits(W, 0), recv_splits(W, 0);
  std::vector<at::Tensor> send_parts;
  for (int64_t o = 0; o < W; ++o)
    for (size_t i = 0; i < n; ++i)
      if (owner[i] == o) {
        at::Tensor part = at::zeros({shard[i].block_numel()}, opts);
        if (rows[i].numel() > 0) part.narrow(0, 0, rows[i].numel()).copy_(rows[i].reshape({-1}));
        send_parts.push_back(part);
        send_splits[o] += shard[i].block_numel();
      }
  int64_t mine = 0;  // elements of my matrices from one source rank
  std::vector<size_t> owned;
  for (size_t i = 0; i < n; ++i)
    if (owner[i] == me) owned.push_back(i), mine += shard[i].block_numel();
  std::fill(recv_splits.begin(), recv_splits.end(), mine);
  // Each buffer is freed as soon as it has been copied on: the owner's share of every matrix is
  // held several times over otherwise (memory_estimate.cpp counts them as they are here).
  at::Tensor send = at::cat(send_parts);
  send_parts.clear();
  const int64_t sent = send.numel();
  at::Tensor recv = at::empty({W * mine}, opts);
  {
    Phase p(phase);  // each matrix's rows to its owner
    comm.all_to_all(recv, send, recv_splits, send_splits).wait();
  }
  send.reset();

  // 2. The owner assembles whole matrices (source rank r's block holds r's rows) and runs the stage.
  std::vector<at::Tensor> whole;
  at::Tensor by_source = recv.view({W, mine});
  int64_t offset = 0;
  for (size_t i : owned) {
    at::Tensor m = at::empty(shapes[i], opts);
    copy_blocks_to_full(shard[i], by_source, offset, m);
    whole.push_back(m);
    offset += shard[i].block_numel();
  }
  recv.reset();
  by_source.reset();
  std::vector<at::Tensor> results = stage(whole, owned);
  whole.clear();

  // 3. Return each rank its rows of every result.
  at::Tensor back = at::zeros({W, mine}, opts);
  offset = 0;
  for (size_t k = 0; k < owned.size(); ++k) {
    copy_full_to_blocks(shard[owned[k]], results[k], back, offset);
    offset += shard[owned[k]].block_numel();
  }
  results.clear();
  at::Tensor returned = at::empty({sent}, opts);
  at::Tensor back_flat = back.view({-1});
  {
    Phase p(phase);  // the orthogonalised rows back
    comm.all_to_all(returned, back_flat, send_splits, recv_splits).wait();
  }

  // 4. My rows of each matrix, in the order they were sent.
  std::vector<at::Tensor> out(n);
  offset = 0;
  for (int64_t o = 0; o < W; ++o)
    for (size_t i = 0; i < n; ++i)
      if (owner[i] == o) {
        out[i] = returned.narrow(0, offset, rows[i].numel()).view(rows[i].sizes());
        offset += shard[i].block_numel();
      }
  return out;
}

void make_muon_sharded(Muon& muon, Communicator& comm, Communicator* split_over) {
  // A mixture of experts' stack [E, rows, cols] is sharded by experts: each of a rank's rows is a
  // whole expert's matrix, which it orthogonalises where it is, with no exchange. The 2-D
  // matrices go to their owners.
  std::vector<size_t> matrices, stacks;
  std::vector<std::vector<int64_t>> matrix_shapes;
  for (size_t i = 0; i < muon.params().size(); ++i) {
    const Muon::Param& p = muon.params()[i];
    if (p.slice_shape.size() == 3) {
      stacks.push_back(i);
    } else {
      matrices.push_back(i);
      matrix_shapes.push_back(p.global_shape);
    }
  }
  const std::vector<int64_t> owner = assign_owners_by_cost(matrix_shapes, comm.size());
  Communicator* split = split_over && split_over->size() > 1 ? split_over : nullptr;

  muon.set_orthogonalizer([&muon, &comm, owner, split, matrices, stacks](const std::vector<at::Tensor>& inputs,
                                                                         const std::vector<const Muon::Param*>& active) {
    TORCH_CHECK(active.size() == muon.params().size(),
                "sharded Muon needs a gradient for every matrix on every rank");
    std::vector<at::Tensor> out(inputs.size());
    std::vector<at::Tensor> held;  // this rank's experts of every stack
    for (size_t i : stacks) held.push_back(inputs[i]);
    const std::vector<at::Tensor> experts = muon.orthogonalize_local(held);
    for (size_t k = 0; k < stacks.size(); ++k) out[stacks[k]] = experts[k];

    std::vector<at::Tensor> rows;
    std::vector<std::vector<int64_t>> shapes;  // what the rows are rows of: the TP slice under TP
    for (size_t i : matrices) rows.push_back(inputs[i]), shapes.push_back(active[i]->slice_shape);
    auto stage = [&](const std::vector<at::Tensor>& whole, const std::vector<size_t>& which) {
      std::vector<const Muon::Param*> of;
      std::vector<std::vector<int64_t>> global;
      for (size_t k : which) of.push_back(active[matrices[k]]), global.push_back(active[matrices[k]]->global_shape);
      if (!split) return muon.orthogonalize_held(whole, of);
      // The replicas own the same matrices: they divide them as ranks divide all of them.
      return orthogonalize_once(muon, whole, of, assign_owners_by_cost(global, split->size()), *split);
    };
    const std::vector<at::Tensor> results =
        orthogonalize_by_owner(rows, shapes, owner, comm, muon.hyper().ns_dtype, "zb.muon.all_to_all", stage);
    for (size_t k = 0; k < matrices.size(); ++k) out[matrices[k]] = results[k];
    return out;
  });
}

}  // namespace zb
