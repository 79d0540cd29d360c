#include "parallel/mesh.h"

#include <c10/util/Exception.h>

#include "util/log.h"

namespace zb {

ParallelMesh::ParallelMesh(const Config& config, int64_t world_size, int64_t rank, EngineKind engine)
    : engine_(engine), shape_(mesh_shape(config, world_size, engine)), rank_(rank) {}

ParallelMesh::ParallelMesh(const Config& config, Communicator& world, EngineKind engine)
    : ParallelMesh(config, world.size(), world.rank(), engine) {
  world_ = &world;
  if (sharded() && shape_.cp > 1)
    cp_ = world.subgroup("cp" + std::to_string(rank_ / (shape_.cp * shape_.tp)) + "." + std::to_string(tp_rank()),
                         shape_.cp_group_ranks(rank_));
  if (sharded() && shape_.ep > 1) {  // within a replica (its shard and TP groups): one set per replica
    const int64_t place = shape_.expert_index_of(rank_);
    const std::string where = std::to_string(replica()) + ".";
    ep_ = world.subgroup("ep" + where + std::to_string(place % shape_.expert_stride()), shape_.ep_group_ranks(rank_));
    expert_shard_ = world.subgroup("expert_shard" + where + std::to_string(shape_.ep_rank_of(rank_)),
                                   shape_.expert_shard_group_ranks(rank_));
  }
  if (!groups_made()) return;
  const MeshShape& m = shape_;
  const int64_t r = rank_;
  // Names unique over the world: every member of a group calls subgroup() with the same one.
  const std::string tp_part = m.tp > 1 ? "." + std::to_string(tp_rank()) : "";
  shard_ = world.subgroup("shard" + std::to_string(replica()) + tp_part, m.shard_group_ranks(r));
  if (m.replicate > 1)
    replicate_ = world.subgroup("replicate" + std::to_string(r % (m.dp_shard_cp * m.tp)), m.replicate_group_ranks(r));
  if (m.tp > 1) tp_ = world.subgroup("tp" + std::to_string(r / m.tp), m.tp_group_ranks(r));
}

Communicator& ParallelMesh::world() const {
  TORCH_CHECK(world_, "a planned mesh has no process groups");
  return *world_;
}

Communicator& ParallelMesh::shard_group() const { return shard_ ? *shard_ : world(); }

bool ParallelMesh::groups_made() const { return sharded() && (shape_.replicate > 1 || shape_.tp > 1); }

const char* ParallelMesh::shard_group_name() const { return groups_made() ? "shard" : "world"; }

std::vector<std::pair<std::string, Communicator*>> ParallelMesh::named_groups() const {
  std::vector<std::pair<std::string, Communicator*>> out;
  if (shard_) out.emplace_back("shard_group", shard_.get());
  if (replicate_) out.emplace_back("replicate_group", replicate_.get());
  if (tp_) out.emplace_back("tp_group", tp_.get());
  if (cp_) out.emplace_back("cp_group", cp_.get());
  if (ep_) out.emplace_back("ep_group", ep_.get());
  if (expert_shard_) out.emplace_back("expert_shard_group", expert_shard_.get());
  return out;
}

void ParallelMesh::observe(CollectiveObserver* trace) const {
  world().observe(trace, "world");
  if (shard_) shard_->observe(trace, "shard");
  if (replicate_) replicate_->observe(trace, "replicate");
  if (tp_) tp_->observe(trace, "tp");
  if (cp_) cp_->observe(trace, "cp");
  if (ep_) ep_->observe(trace, "ep");
  if (expert_shard_) expert_shard_->observe(trace, "expert_shard");
}

void shard_by_node(Config& cfg, const World& world, bool dry_run) {
  const bool layout_given = cfg.parallel.dp_shard != -1 || cfg.parallel.dp_replicate != 1;
  if (!layout_given && dry_run)
    throw ConfigError("train_hsdp --dry-run: give the layout, --parallel.dp_shard GPUS_PER_NODE "
                      "--parallel.dp_replicate NODES (no launcher says what a node is)");
  if (!layout_given && world.local_size >= world.size)
    throw ConfigError(strf("train_hsdp shards within a node and replicates across nodes, but all %ld rank(s) "
                           "are on one node (LOCAL_WORLD_SIZE = WORLD_SIZE = %ld): use train_fsdp",
                           world.size, world.size));
  if (!layout_given) {
    const int64_t inner = cfg.parallel.tp * cfg.parallel.cp;
    if (world.local_size % inner != 0)
      throw ConfigError(strf("train_hsdp: parallel.tp x parallel.cp (%ld) must divide the %ld rank(s) of a node: "
                             "TP and CP groups stay within one", inner, world.local_size));
    cfg.parallel.dp_shard = world.local_size / inner;
    cfg.parallel.dp_replicate = world.size / world.local_size;
  }
}

std::string tp_across_nodes_warning(const Config& c, const World& world) {
  const int64_t tp = c.parallel.tp;
  if (tp <= 1 || world.local_size >= world.size || world.local_size % tp == 0) return "";
  return strf("parallel.tp = %ld spans nodes of %ld rank(s) (LOCAL_WORLD_SIZE): every block's sequence gathers "
              "and reduce-scatters cross the network between them; a tp that divides the ranks of a node "
              "keeps each TP group within one",
              tp, world.local_size);
}

}  // namespace zb
