#include "fsdp/sharded_muon.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <numeric>

namespace zb {

std::vector<int64_t> assign_muon_owners(const Muon& muon, int64_t world_size) {
  const auto& params = muon.params();
  std::vector<double> cost(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double r = static_cast<double>(params[i].global_shape[0]);
    const double c = static_cast<double>(params[i].global_shape[1]);
    cost[i] = r * c * std::min(r, c);
  }
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(static_cast<size_t>(world_size), 0.0);
  std::vector<int64_t> owner(params.size());
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    owner[i] = least;
    load[least] += cost[i];
  }
  return owner;
}

void make_muon_sharded(Muon& muon, Communicator& comm) {
  const std::vector<int64_t> owner = assign_muon_owners(muon, comm.size());

  muon.set_orthogonalizer([&muon, &comm, owner](const std::vector<at::Tensor>& inputs,
                                                const std::vector<const Muon::Param*>& active) {
    TORCH_CHECK(active.size() == muon.params().size(),
                "sharded Muon needs a gradient for every matrix on every rank");
    const int64_t W = comm.size(), me = comm.rank();
    const auto dtype = muon.hyper().ns_dtype;
    const size_t n = inputs.size();
    std::vector<int64_t> rows(n), cols(n), per_rank(n);  // per_rank: rows each rank sends
    for (size_t i = 0; i < n; ++i) {
      rows[i] = active[i]->global_shape[0];
      cols[i] = active[i]->global_shape[1];
      per_rank[i] = (rows[i] + W - 1) / W;
    }
    auto block = [&](size_t i) { return per_rank[i] * cols[i]; };
    const auto opts = inputs.front().options().dtype(dtype);

    // 1. Send each matrix's rows (padded to per_rank) to its owner, grouped by owner.
    std::vector<int64_t> send_splits(W, 0), recv_splits(W, 0);
    std::vector<at::Tensor> send_parts;
    for (int64_t o = 0; o < W; ++o)
      for (size_t i = 0; i < n; ++i)
        if (owner[i] == o) {
          at::Tensor part = at::zeros({block(i)}, opts);
          if (inputs[i].numel() > 0) part.narrow(0, 0, inputs[i].numel()).copy_(inputs[i].reshape({-1}));
          send_parts.push_back(part);
          send_splits[o] += block(i);
        }
    int64_t mine = 0;  // elements of my matrices from one source rank
    for (size_t i = 0; i < n; ++i)
      if (owner[i] == me) mine += block(i);
    std::fill(recv_splits.begin(), recv_splits.end(), mine);
    at::Tensor send = send_parts.empty() ? at::empty({0}, opts) : at::cat(send_parts);
    at::Tensor recv = at::empty({W * mine}, opts);
    comm.all_to_all(recv, send, recv_splits, send_splits).wait();

    // 2. Owners assemble whole matrices (source rank r's block holds rows r*per_rank...) and
    //    orthogonalise them, same-shape ones batched together.
    std::vector<size_t> owned;
    for (size_t i = 0; i < n; ++i)
      if (owner[i] == me) owned.push_back(i);
    std::vector<at::Tensor> whole;
    at::Tensor by_source = recv.view({W, mine});
    int64_t offset = 0;
    for (size_t i : owned) {
      at::Tensor padded = by_source.narrow(1, offset, block(i)).reshape({W * per_rank[i], cols[i]});
      whole.push_back(padded.narrow(0, 0, rows[i]));
      offset += block(i);
    }
    std::vector<at::Tensor> results = muon.orthogonalize_local(whole);

    // 3. Return each rank its rows of every result.
    at::Tensor back = at::zeros({W, mine}, opts);
    offset = 0;
    for (size_t k = 0; k < owned.size(); ++k) {
      const size_t i = owned[k];
      at::Tensor padded = at::zeros({W * per_rank[i], cols[i]}, opts);
      padded.narrow(0, 0, rows[i]).copy_(results[k]);
      back.narrow(1, offset, block(i)).copy_(padded.view({W, block(i)}));
      offset += block(i);
    }
    at::Tensor returned = at::empty({send.numel()}, opts);
    at::Tensor back_flat = back.view({-1});
    comm.all_to_all(returned, back_flat, send_splits, recv_splits).wait();

    // 4. My rows of each matrix, in the order they were sent.
    std::vector<at::Tensor> out(n);
    offset = 0;
    for (int64_t o = 0; o < W; ++o)
      for (size_t i = 0; i < n; ++i)
        if (owner[i] == o) {
          out[i] = returned.narrow(0, offset, inputs[i].numel()).view(inputs[i].sizes());
          offset += block(i);
        }
    return out;
  });
}

}  // namespace zb
