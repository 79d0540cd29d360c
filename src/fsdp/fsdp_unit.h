#pragma once
// A sharding unit (FSDP2's FSDPParamGroup): the parameters of one transformer block, or of the
// root (embedding, final norm, head), gathered together in one flat all-gather and their
// gradients reduced in one flat reduce-scatter.
//
// States: SHARDED --issue_unshard--> GATHERING --wait_unshard--> UNSHARDED --reshard--> SHARDED.
// Flat layout of both collectives: rank-major blocks of S elements, S = sum over parameters of
// rows_per_rank * row_numel; inside a block, parameters in order, each zero-padded to
// rows_per_rank rows.
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "fsdp/fsdp_param.h"

namespace zb {

class FSDPUnit {
 public:
  enum class State { Sharded, Gathering, Unsharded };

  // `reducing` is shared by the engine's units: the unit whose reduce-scatter is in flight. A
  // unit finishes it before issuing its own, so one unit's gradient buffers are in flight at a
  // time (the collective still overlaps the next unit's backward).
  FSDPUnit(std::string name, std::vector<FSDPParam*> params, Communicator& comm,
           bool reshard_after_forward, FSDPUnit** reducing);

  const std::string& name() const { return name_; }
  State state() const { return state_; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  const std::vector<FSDPParam*>& params() const { return params_; }

  // Casts the shards into the flat input and starts the all-gather (no-op unless SHARDED).
  void issue_unshard();
  // Waits for the all-gather and copies each parameter's rows out into its unsharded storage.
  void wait_unshard();
  // Frees the unsharded storages.
  void reshard();

  // Tensors for the model's slots, produced through an autograd node whose backward hands the
  // unit's gradients to reduce_gradients() once all of them are computed. Requires UNSHARDED.
  std::vector<at::Tensor> unsharded_for_forward();

  // Called from that backward. Frees the gathered parameters, accumulates the gradients into fp32
  // unsharded buffers and, when `sync` is set (the last micro-batch), pre-divides by the world
  // size and starts the reduce-scatter.
  void reduce_gradients(const std::vector<at::Tensor>& grads, bool sync);
  // Waits for the reduce-scatter and adds this rank's rows to each sharded parameter's .grad().
  void finish_gradients();

  bool requires_gradient_sync = true;

 private:
  std::string name_;
  std::vector<FSDPParam*> params_;
  std::vector<int64_t> offsets_;  // of each parameter inside a rank's block
  int64_t block_numel_ = 0;       // S
  Communicator& comm_;
  bool reshard_after_forward_;
  FSDPUnit** reducing_;
  State state_ = State::Sharded;

  at::Tensor gather_in_, gather_out_;
  PendingCollective gather_;
  std::vector<at::Tensor> grad_accumulators_;  // fp32 unsharded, across micro-batches
  at::Tensor reduce_out_;
  PendingCollective reduce_;
};

}  // namespace zb
