#pragma once
// Moving rows of tensors between ranks that hold them in different layouts: replicas sharded over
// different numbers of ranks (elastic DiLoCo's mixed generations and joiners, diloco/membership.h).
//
// Each rank of a group holds one run of rows of each tensor (possibly none) and wants another
// run. A plan, made from one all-gather of every rank's runs, says which rows each rank sends each
// other rank: the overlap of what it holds with what that rank wants. A row held by several ranks
// (one per replica, say) reaches its wanter once from each. The data then crosses in one
// all-to-all, each peer's rows packed tensor after tensor; callers that compress pack and unpack
// per peer themselves.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zb {

class Communicator;

struct RowSpan {
  int64_t first = 0, rows = 0;
  int64_t end() const { return first + rows; }
  RowSpan overlap(const RowSpan& other) const;
};

class RowMoves {
 public:
  // A run of rows of one tensor between this rank and one peer.
  struct Run {
    size_t tensor = 0;
    RowSpan rows;
  };

  // Collective over `group`. Per tensor t: `held[t]` the rows this rank holds, `wanted[t]` those it
  // wants, `row_numel[t]` the elements in a row (the same on every rank).
  static RowMoves plan(Communicator& group, const std::vector<RowSpan>& held, const std::vector<RowSpan>& wanted,
                       const std::vector<int64_t>& row_numel);

  // What this rank sends peer q and receives from peer q, in tensor order, and their elements.
  const std::vector<Run>& sends(int64_t q) const { return send_[static_cast<size_t>(q)]; }
  const std::vector<Run>& receives(int64_t q) const { return receive_[static_cast<size_t>(q)]; }
  int64_t send_numel(int64_t q) const { return numel(sends(q)); }
  int64_t receive_numel(int64_t q) const { return numel(receives(q)); }
  int64_t peers() const { return static_cast<int64_t>(send_.size()); }

  // The rows this rank sends peer q, flat: `local[t]` holds rows held[t] of tensor t (any shape).
  at::Tensor pack(int64_t q, const std::vector<at::Tensor>& local) const;
  // Every peer's pack in peer order, through one all-to-all; returns the rows received, flat, in
  // peer order (receives(q) of each), of `options`' dtype and device, as `local` must be.
  at::Tensor exchange(Communicator& group, const std::vector<at::Tensor>& local,
                      const at::TensorOptions& options) const;
  // Peer q's part of exchange()'s result.
  at::Tensor part(int64_t q, const at::Tensor& received) const;
  // The runs of peer q's part of a received buffer as [rows, row_numel] views, in receives(q)'s order.
  std::vector<at::Tensor> unpack(int64_t q, const at::Tensor& from_q) const;
  // Every run of exchange()'s result copied into place: `local[t]` holds rows wanted[t] of tensor t
  // (any shape). For layouts where each wanted row has one holder; a caller that receives several
  // copies of a row (one per replica) sums them from unpack() instead.
  void take(const at::Tensor& received, const std::vector<at::Tensor>& local) const;

 private:
  int64_t numel(const std::vector<Run>& runs) const;
  std::vector<std::vector<Run>> send_, receive_;
  std::vector<RowSpan> held_, wanted_;
  std::vector<int64_t> row_numel_;
};

}  // namespace zb
