#pragma once
// The run resolved once from its configuration: the mesh's shape, the dtype and kernels, how
// attention reads a micro-batch, the micro-batches of a step. The builder, the Trainer, the step
// plan, the memory estimate and the run's record read these values, not the option strings.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "config/config.h"
#include "kernels/kernel_choices.h"

namespace zb {

// The ranks that read different rows of a batch: a TP or CP group reads the same ones.
inline int64_t data_parallel_size(int64_t world_size, int64_t tp, int64_t cp) { return world_size / (tp * cp); }

// The engine that holds the parameters: sharded (FSDP, and HSDP with replicas) or replicated (DDP).
enum class EngineKind { Sharded, Replicated };

// The mesh's sizes and the arithmetic of coordinates; no process groups.
struct MeshShape {
  // The sharding engine's group: dp_shard x cp ranks (dp_shard alone without CP; torchtitan's
  // dp_shard_cp).
  int64_t dp_shard_cp = 1, replicate = 1, tp = 1, cp = 1;
  // Expert parallelism (torchtitan's ep x efsdp, carved from dp_shard x cp x tp): a replica's
  // dp_shard_cp x tp ranks, in rank order, form groups of ep ranks strided by expert_stride(); the
  // expert_stride() consecutive ranks with one EP rank shard its experts. Without TP the experts FSDP's
  // rows give shard rank s are then among those of its EP rank.
  int64_t ep = 1;

  int64_t world() const { return replicate * dp_shard_cp * tp; }
  int64_t data_parallel_size() const { return zb::data_parallel_size(world(), tp, cp); }
  int64_t replica_of(int64_t rank) const { return rank / (dp_shard_cp * tp); }  // also its shard group's number
  int64_t shard_rank_of(int64_t rank) const { return (rank / tp) % dp_shard_cp; }
  int64_t tp_rank_of(int64_t rank) const { return rank % tp; }
  int64_t cp_rank_of(int64_t rank) const { return (rank / tp) % cp; }
  int64_t data_parallel_rank_of(int64_t rank) const { return rank / (cp * tp); }  // which rows of a batch it reads
  std::vector<int64_t> tp_group_ranks(int64_t rank) const;         // consecutive
  std::vector<int64_t> cp_group_ranks(int64_t rank) const;         // strided by `tp`
  std::vector<int64_t> shard_group_ranks(int64_t rank) const;      // strided by `tp`
  std::vector<int64_t> replicate_group_ranks(int64_t rank) const;  // strided by `dp_shard_cp x tp`
  std::vector<int64_t> ep_group_ranks(int64_t rank) const;         // strided by expert_stride()
  std::vector<int64_t> expert_shard_group_ranks(int64_t rank) const;  // consecutive (torchtitan's efsdp)
  int64_t expert_stride() const { return dp_shard_cp * tp / ep; }  // also the expert shard group's size
  int64_t expert_index_of(int64_t rank) const { return rank % (dp_shard_cp * tp); }  // its place in its replica
  int64_t ep_rank_of(int64_t rank) const { return expert_index_of(rank) / expert_stride(); }
};

// The shape the config asks for on `world_size` ranks, parallel.dp_shard = -1 resolved
// (validate() checked that it multiplies out). The replicating engine (DDP) has one dimension:
// every rank a replica.
MeshShape mesh_shape(const Config& config, int64_t world_size, EngineKind engine = EngineKind::Sharded);

// Context parallelism's keys and values (parallel.cp_rotate): gathered whole in every block, or
// passed around the group a rank's block at a time (ring attention).
enum class CpRotate { AllGather, Ring };
CpRotate resolve_cp_rotate(const Config& config);

// How attention reads a micro-batch on this run's device and dtype.
struct AttentionPath {
  bool documents = false;  // model.attention = "document": causal within each packed document
  int64_t cp = 1;          // ranks each row's tokens are split over
  CpRotate cp_rotate = CpRotate::AllGather;
  // The variable-length flash kernels read the documents (a GPU, bf16, a head size they take;
  // under CP only with runtime.cp_varlen, its pieces of queries with the keys each reads, packed).
  bool flash_documents = false;
  bool cudnn_varlen = false;  // runtime.varlen_kernel = "cudnn" (KernelChoices)
  bool cp_ring() const { return cp > 1 && cp_rotate == CpRotate::Ring; }
  bool cp_packed() const { return cp > 1 && flash_documents; }
  // An additive mask in memory: document attention without the flash kernels, and CP without
  // runtime.cp_varlen ([B, 1, T/cp, T] for this rank's queries).
  bool mask() const { return !flash_documents && (documents || cp > 1); }
};
// With each row split over `cp` ranks (the mesh's). Throws ConfigError where runtime.cp_varlen
// asks for the flash kernels and they cannot run.
AttentionPath resolve_attention(const Config& config, int64_t cp, const c10::Device& device,
                                at::ScalarType compute_dtype);

// What "auto" becomes in train.reduce_every_micro_batch and train.keep_unsharded: the memory verdict
// decides it from the step's estimate (plan/run_policy.h's judge_memory); without one, off.
struct MemoryChoices {
  bool reduce_every_micro_batch = false;
  bool keep_unsharded = false;
};

struct ResolvedRun {
  EngineKind engine = EngineKind::Sharded;
  MeshShape mesh;
  c10::Device device = c10::kCPU;
  at::ScalarType compute_dtype = at::kFloat;
  KernelChoices kernels;  // the model, Muon, the gradient sums and the memory estimate
  AttentionPath attention;
  int64_t micro_batches = 1;  // per rank and step
  // Gradients reduced on every micro-batch into sharded sums, rather than summed whole in fp32 and
  // reduced on the last (train.reduce_every_micro_batch; only with more than one micro-batch).
  bool reduce_every_micro_batch = false;
  // The sharding engine keeps the parameters' casts for the step (train.keep_unsharded): only
  // where a shard group is one rank whose gradients no replicas sum (HSDP's do; DiLoCo's replicas
  // train apart).
  bool keep_unsharded = false;
};
// The run of `config` on `world_size` ranks of `engine` on `device` (validate() passed), "auto"
// settings as `autos` says.
ResolvedRun resolve_run(const Config& config, int64_t world_size, EngineKind engine, const c10::Device& device,
                        const MemoryChoices& autos = {});

}  // namespace zb
