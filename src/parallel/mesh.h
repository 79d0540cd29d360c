#pragma once
// The parallel mesh: how a run's ranks are arranged, each rank's coordinates in that arrangement
// and the process groups along its dimensions. The trainer, the step plan, the memory estimate,
// DiLoCo, Muon and checkpoints all read it here rather than each rebuilding a part of it.
//
// Four dimensions, outermost first: dp_replicate x dp_shard x cp x tp. Rank
//   r = ((replica x dp_shard + d) x cp + c) x tp + t
// is member t of its TP group (tp consecutive ranks), member c of its CP group (cp ranks strided
// by tp), member d x cp + c of its shard group (the ranks of its replica with the same t: FSDP
// shards over dp_shard x cp, torchtitan's dp_shard_cp) and member `replica` of its replicate group
// (the ranks with its d, c and t in every replica). Without TP or CP: member r % shard of shard
// group r / shard, and member r / shard of replicate group r % shard. A TP or CP group reads the
// same rows of a batch; the dp_shard x replicate data-parallel ranks read different ones.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "config/resolved_run.h"
#include "dist/comm.h"
#include "dist/world.h"

namespace zb {

class ParallelMesh {
 public:
  // A planned run's mesh (the step plan, the memory estimate): coordinates, no process groups.
  ParallelMesh(const Config& config, int64_t world_size, int64_t rank, EngineKind engine);
  // A live run's mesh: the groups along the dimensions are made from `world`, which must outlive
  // the mesh. Every rank calls it at the same point (on NCCL each group is split from the world's
  // communicator). Groups exist only where they differ from the world and hold more than one
  // rank's worth of work: a shard group when there are replicas or TP, a replicate group with
  // more than one replica, a TP group with tp > 1, a CP group with cp > 1. DDP makes none.
  ParallelMesh(const Config& config, Communicator& world, EngineKind engine);
  ParallelMesh(ParallelMesh&&) = default;

  EngineKind engine() const { return engine_; }
  bool sharded() const { return engine_ == EngineKind::Sharded; }
  const MeshShape& shape() const { return shape_; }
  int64_t rank() const { return rank_; }
  int64_t world_size() const { return shape_.world(); }
  // This rank's coordinates. replica(): its shard group's number under the sharding engine, 0
  // under DDP (whose ranks are replicas of one state).
  int64_t replica() const { return sharded() ? shape_.replica_of(rank_) : 0; }
  int64_t shard_rank() const { return shape_.shard_rank_of(rank_); }
  int64_t tp_rank() const { return shape_.tp_rank_of(rank_); }
  int64_t cp_rank() const { return shape_.cp_rank_of(rank_); }
  int64_t data_parallel_rank() const { return shape_.data_parallel_rank_of(rank_); }
  int64_t data_parallel_size() const { return shape_.data_parallel_size(); }

  // A live mesh's groups. shard_group(): the sharding engine's (the world where none was made).
  Communicator& world() const;
  Communicator& shard_group() const;
  Communicator* replicate_group() const { return replicate_.get(); }
  Communicator* tp_group() const { return tp_.get(); }
  Communicator* cp_group() const { return cp_.get(); }
  Communicator* ep_group() const { return ep_.get(); }  // parallel.ep > 1 only
  // The ranks the sharding engine shards this rank's experts over (parallel.ep > 1 only; TP's ranks
  // among them; a group of one, local, when ep is the replica's dp_shard x cp x tp ranks).
  Communicator* expert_shard_group() const { return expert_shard_.get(); }
  // The name the step plan and the step trace give the sharding engine's group: "shard" when a
  // group was made, else "world".
  const char* shard_group_name() const;
  // The groups made, by the names the metrics give their bytes ("shard_group", "replicate_group",
  // "tp_group", "cp_group", "ep_group", "expert_shard_group"); empty when there are none.
  std::vector<std::pair<std::string, Communicator*>> named_groups() const;
  // Reports every communicator's collectives to `trace` (null stops it).
  void observe(CollectiveObserver* trace) const;

 private:
  bool groups_made() const;

  EngineKind engine_;
  MeshShape shape_;
  int64_t rank_ = 0;
  Communicator* world_ = nullptr;  // a live mesh's
  std::unique_ptr<Communicator> shard_, replicate_, tp_, cp_, ep_, expert_shard_;
};

// train_hsdp's mesh: one shard group per node (LOCAL_WORLD_SIZE ranks), replicated across nodes,
// unless the config's [parallel] keys say. One node has nothing to replicate across (train_fsdp
// is the program for it); a dry run has no launcher to say what a node is. Both are config errors.
void shard_by_node(Config& config, const World& world, bool dry_run);

// Tensor parallelism meant to stay within a node: a warning (empty when none) where the launcher's
// nodes (LOCAL_WORLD_SIZE ranks each, consecutive) split a TP group, so that every block's
// sequence gathers and reduce-scatters would cross the network. Not an error: some machines join
// nodes by NVLink.
std::string tp_across_nodes_warning(const Config& config, const World& world);

}  // namespace zb
