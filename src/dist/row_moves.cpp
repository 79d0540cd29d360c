#include "dist/row_moves.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "dist/comm.h"

namespace zb {

RowSpan RowSpan::overlap(const RowSpan& other) const {
  const int64_t from = std::max(first, other.first), to = std::min(end(), other.end());
  return {from, std::max<int64_t>(0, to - from)};
}

RowMoves RowMoves::plan(Communicator& group, const std::vector<RowSpan>& held, const std::vector<RowSpan>& wanted,
                        const std::vector<int64_t>& row_numel) {
  TORCH_CHECK(held.size() == wanted.size() && held.size() == row_numel.size(), "RowMoves::plan: one span each");
  const int64_t T = static_cast<int64_t>(held.size()), G = group.size();
  // Every rank's [held first, held rows, wanted first, wanted rows] per tensor.
  at::Tensor mine = at::empty({T * 4}, at::kLong);
  int64_t* m = mine.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    m[4 * t] = held[t].first;
    m[4 * t + 1] = held[t].rows;
    m[4 * t + 2] = wanted[t].first;
    m[4 * t + 3] = wanted[t].rows;
  }
  at::Tensor all = at::empty({G * T * 4}, at::TensorOptions().dtype(at::kLong).device(group.device()));
  group.all_gather(all, mine.to(group.device())).wait();
  all = all.cpu();
  const int64_t* a = all.data_ptr<int64_t>();
  const auto span_of = [&](int64_t rank, int64_t t, bool want) {
    const int64_t* s = a + (rank * T + t) * 4 + (want ? 2 : 0);
    return RowSpan{s[0], s[1]};
  };

  RowMoves moves;
  moves.held_ = held;
  moves.wanted_ = wanted;
  moves.row_numel_ = row_numel;
  moves.send_.resize(static_cast<size_t>(G));
  moves.receive_.resize(static_cast<size_t>(G));
  for (int64_t q = 0; q < G; ++q)
    for (int64_t t = 0; t < T; ++t) {
      if (const RowSpan out = held[t].overlap(span_of(q, t, true)); out.rows > 0)
        moves.send_[q].push_back({static_cast<size_t>(t), out});
      if (const RowSpan in = span_of(q, t, false).overlap(wanted[t]); in.rows > 0)
        moves.receive_[q].push_back({static_cast<size_t>(t), in});
    }
  return moves;
}

int64_t RowMoves::numel(const std::vector<Run>& runs) const {
  int64_t n = 0;
  for (const Run& r : runs) n += r.rows.rows * row_numel_[r.tensor];
  return n;
}

at::Tensor RowMoves::pack(int64_t q, const std::vector<at::Tensor>& local) const {
  std::vector<at::Tensor> parts;
  for (const Run& r : sends(q)) {
    const at::Tensor rows = local[r.tensor].reshape({held_[r.tensor].rows, row_numel_[r.tensor]});
    parts.push_back(rows.narrow(0, r.rows.first - held_[r.tensor].first, r.rows.rows).reshape({-1}));
  }
  return parts.empty() ? at::Tensor() : at::cat(parts);
}

at::Tensor RowMoves::exchange(Communicator& group, const std::vector<at::Tensor>& local,
                              const at::TensorOptions& options) const {
  std::vector<at::Tensor> packs;
  std::vector<int64_t> in_splits, out_splits;
  int64_t received = 0;
  for (int64_t q = 0; q < peers(); ++q) {
    if (at::Tensor p = pack(q, local); p.defined()) packs.push_back(p);
    in_splits.push_back(send_numel(q));
    out_splits.push_back(receive_numel(q));
    received += out_splits.back();
  }
  const at::Tensor in = packs.empty() ? at::empty({0}, options) : at::cat(packs);
  at::Tensor out = at::empty({received}, options);
  group.all_to_all(out, in, out_splits, in_splits).wait();
  return out;
}

at::Tensor RowMoves::part(int64_t q, const at::Tensor& received) const {
  int64_t offset = 0;
  for (int64_t k = 0; k < q; ++k) offset += receive_numel(k);
  return received.narrow(0, offset, receive_numel(q));
}

std::vector<at::Tensor> RowMoves::unpack(int64_t q, const at::Tensor& from_q) const {
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const Run& r : receives(q)) {
    const int64_t n = r.rows.rows * row_numel_[r.tensor];
    out.push_back(from_q.narrow(0, offset, n).view({r.rows.rows, row_numel_[r.tensor]}));
    offset += n;
  }
  return out;
}

void RowMoves::take(const at::Tensor& received, const std::vector<at::Tensor>& local) const {
  for (int64_t q = 0; q < peers(); ++q) {
    const std::vector<at::Tensor> pieces = unpack(q, part(q, received));
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Run& run = receives(q)[i];
      const RowSpan& mine = wanted_[run.tensor];
      local[run.tensor].view({mine.rows, row_numel_[run.tensor]})
          .narrow(0, run.rows.first - mine.first, run.rows.rows)
          .copy_(pieces[i]);
    }
  }
}

}  // namespace zb
