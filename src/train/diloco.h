#pragma once
// DiLoCo over the replicas of a sharded run (diloco.inner_steps > 0; arXiv 2311.08105, with
// Muon inner steps as MuLoCo, arXiv 2505.23725). Each replica, a shard group, trains alone: its
// gradients are averaged within the group only, and its optimizer state (AdamW's moments, Muon's
// momentum) is its own. Every inner_steps steps, and after the run's last, an outer step:
//
//   Δ = θ_outer − θ_inner                 on each rank's rows, fp32
//   Δ̄ = mean of Δ over the replicas       through the replicate group, compressed on the way
//   outer Nesterov SGD on θ_outer with Δ̄  (optim/outer_nesterov.h), then θ_inner ← θ_outer
//
// The outer copies and their momentum sit beside the shards, on the same device: 8 bytes per
// parameter over the shard group's size. One replica is allowed: no traffic, the outer step alone.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "config/config.h"
#include "dist/comm.h"
#include "dist/compression.h"
#include "optim/outer_nesterov.h"
#include "parallel/parallel_model.h"

namespace zb {

// What one outer step did, for the metrics.
struct OuterSyncStats {
  int64_t outer_step = 0;               // 1, 2, ...
  double pseudo_gradient_norm = 0;      // of Δ̄, over the whole model
  int64_t bytes_across_replicas = 0;    // what this rank's replicate group moved for it
  double seconds = 0;                   // wall time of the outer step, the exchange included
};

// Values per uint8 chunk: each chunk carries a 1 KiB table, 1.6% of its 64 KiB of codes.
constexpr int64_t kUint8Chunk = 65536;

class DiLoCo {
 public:
  // `params`: this rank's shards (the engine's parameters); `shard`: the replica's own group;
  // `replicas`: this rank's replicate group (null for a single replica).
  DiLoCo(const DilocoConfig& config, std::vector<ShardedParameter> params, Communicator& shard,
         Communicator* replicas);

  // Whether step `step` (1-based) ends with an outer step: every inner_steps and the run's last.
  bool due(int64_t step, int64_t total_steps) const;
  // The outer copies take the inner values: the start of a run (or of new initial weights).
  void start();
  // One outer step (collective over the replicate and shard groups).
  OuterSyncStats sync();
  // The outer copies and momentum for checkpoints ("diloco/outer/<name>", "diloco/momentum/<name>"),
  // sharded like the parameters; every replica holds the same.
  std::vector<StateTensor> state() const;
  int64_t replicas() const { return replicas_ ? replicas_->size() : 1; }
  int64_t outer_steps() const { return outer_steps_; }
  void set_outer_steps(int64_t n) { outer_steps_ = n; }

 private:
  // The mean over the replicas of `flat` (fp32), exchanged as the compression says and summed
  // in fp32, in replica order, so every replica gets the same bits.
  at::Tensor average_over_replicas(const at::Tensor& flat);
  std::vector<at::Tensor> inner_tensors() const;

  DilocoConfig config_;
  Compression compression_;
  std::vector<ShardedParameter> params_;
  Communicator& shard_;
  Communicator* replicas_;
  OuterNesterov outer_;
  int64_t outer_steps_ = 0;
};

}  // namespace zb
