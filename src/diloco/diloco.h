#pragma once
// DiLoCo over the replicas of a sharded run (diloco.inner_steps > 0; arXiv 2311.08105, with
// Muon inner steps as MuLoCo, arXiv 2505.23725, and Streaming DiLoCo's fragments, 2501.18512).
// Each replica, a shard group, trains alone: its gradients are averaged within the group only,
// and its optimizer state (AdamW's moments, Muon's momentum) is its own. Every inner_steps steps
// each fragment of the model takes an outer step:
//
//   Δ = θ_outer − θ_inner                 on each rank's rows of the fragment, fp32
//   Δ̄ = mean of Δ over the replicas       through the replicate group, compressed on the way
//   outer Nesterov SGD on θ_outer with Δ̄  (optim/outer_nesterov.h), then θ_inner ← θ_outer
//
// Fragments (diloco.fragments = F): the blocks in F consecutive runs (the embedding with the
// first, the final norm and head with the last), fragment f synced at the steps t with
// (t + f·H/F) % H == 0, so that the exchanges are spread over the period and each moves 1/F of
// the model. With diloco.fragment_delay = d > 0 an exchange starts after step t and is applied
// after step t + d, overlapping d steps of inner compute; the inner steps taken meanwhile are
// kept: θ_inner ← θ_outer + (θ_inner − θ_inner at t). After the run's last step every fragment is
// synced once more, at once, so the run ends on one model.
//
// The outer copies and their momentum sit beside the shards, on the same device: 8 bytes per
// parameter over the shard group's size (plus, for an exchange in flight, 8 per parameter of its
// fragment). One replica is allowed: no traffic, the outer step alone.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/state.h"
#include "config/config.h"
#include "dist/comm.h"
#include "dist/compression.h"
#include "diloco/membership.h"
#include "optim/outer_nesterov.h"
#include "parallel/mesh.h"
#include "parallel/parallel_model.h"

namespace zb {

// What the outer steps of one training step did, for the metrics.
struct OuterSyncStats {
  int64_t outer_steps = 0;           // fragment outer steps so far (F per period; 1 per period unfragmented)
  std::vector<int64_t> fragments;    // the fragments that took an outer step in this step
  double pseudo_gradient_norm = 0;   // of their Δ̄, together, over the whole model
  int64_t bytes_across_replicas = 0; // what this rank's replicate group moved for the exchanges started
  double seconds_waited = 0;         // the host blocked on those exchanges
  double seconds = 0;                // wall time of the outer work in this step
  std::optional<RoundReport> round;  // elastic replicas: who took part (diloco/membership.h)
};

// Values per uint8 chunk: each chunk carries a 1 KiB table, 1.6% of its 64 KiB of codes.
constexpr int64_t kUint8Chunk = 65536;

// Which fragment (0 .. fragments-1) a parameter belongs to: its block's run of n_layers / F
// consecutive blocks (the first gets the extra ones); the embedding the first, the rest the last.
int64_t fragment_of(const std::string& name, int64_t n_layers, int64_t fragments);

class DiLoCo {
 public:
  // `params`: this rank's shards (the engine's parameters). From `mesh` (a live one, which must
  // outlive this): the replica's own group (the shard group), the replicate group across the
  // replicas (none for a single replica) and the TP group whose ranks hold the other slices.
  DiLoCo(const DilocoConfig& config, std::vector<ShardedParameter> params, int64_t n_layers,
         const ParallelMesh& mesh);
  ~DiLoCo();

  // The outer copies take the inner values: the start of a run (or of new initial weights).
  void start();
  // The other way: the parameters take the outer copies (a joiner, right after an outer step,
  // where the two are equal on every member).
  void take_outer();
  // Elastic replicas (diloco.peers): the outer steps go through `membership`'s rounds, each over
  // that round's members. join() is round 0: the first generation (collective, before step 1).
  void set_membership(std::unique_ptr<ReplicaMembership> membership);
  bool elastic() const { return static_cast<bool>(membership_); }
  // `stream_rows`, `step`: where a resumed replica's checkpoint left the stream and the steps.
  RoundReport join(int64_t stream_rows, int64_t step);
  // A joiner (diloco.join): waits for the outer step that admits it; the schedule then continues
  // after the step the report names. The others' part is DiLoCoHook::share_state.
  RoundReport await_admission(int64_t total_steps);
  // Elastic, a round that admitted joiners: the group its source sends their state over (null for
  // the members that take no part; ReplicaMembership::transfer_group).
  std::unique_ptr<Communicator> transfer_group(const RoundReport& round) { return membership_->transfer_group(round); }
  // After step `step`'s optimizer (1-based; collective): the outer steps due then, if any.
  // `stream_rows`: elastic replicas only, the run's data stream read by then (data/loader.h).
  std::optional<OuterSyncStats> after_step(int64_t step, int64_t total_steps, int64_t stream_rows = 0);

  // For checkpoints: the outer copies and momentum ("diloco/outer/<name>",
  // "diloco/momentum/<name>"), sharded like the parameters and the same on every replica; for an
  // exchange in flight, its Δ̄ and the inner values it started from ("diloco/in_flight/..."), waited
  // for first.
  std::vector<StateTensor> state();
  // Before a checkpoint of step `step` is loaded into state(): makes room for the exchanges
  // in flight then. After it is loaded, restore(step) picks the schedule up there.
  void prepare_restore(int64_t step, int64_t total_steps);
  void restore(int64_t step, int64_t total_steps);

  int64_t fragments() const { return static_cast<int64_t>(fragments_.size()); }
  int64_t inner_steps() const { return config_.inner_steps; }
  int64_t replicas() const { return mesh_replicas_; }  // in this run's mesh (elastic replicas: its own)

 private:
  struct Fragment;
  // Whether fragment f starts an exchange after step `step`, and when one started at `start` applies.
  bool starts_at(int64_t f, int64_t step, int64_t total_steps) const;
  int64_t applies_at(int64_t start, int64_t total_steps) const;
  void begin(Fragment& f, int64_t step, int64_t total_steps, OuterSyncStats& stats);
  // Waits for the exchange (once) and leaves Δ̄ in f.mean.
  void finish(Fragment& f, OuterSyncStats* stats);
  void apply(Fragment& f, OuterSyncStats& stats);
  // Elastic, a mixed generation (members with different shard counts): Δ̄ from this rank's Δ.
  at::Tensor mixed_mean(Fragment& f, const at::Tensor& delta);
  // Elastic: begin and finish f's exchange in a membership round (retried over fewer members if a
  // member fails in it).
  void exchange_in_round(Fragment& f, int64_t step, int64_t total_steps, int64_t stream_rows, OuterSyncStats& stats);

  DilocoConfig config_;
  Compression compression_;
  Communicator& shard_;
  Communicator* replicas_;
  Communicator* tp_;
  int64_t mesh_replicas_;
  std::vector<std::unique_ptr<Fragment>> fragments_;
  int64_t outer_steps_ = 0;
  std::unique_ptr<ReplicaMembership> membership_;
};

}  // namespace zb
