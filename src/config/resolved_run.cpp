#include "config/resolved_run.h"

#include "config/model_config.h"
#include "model/attention.h"

namespace zb {

std::vector<int64_t> MeshShape::tp_group_ranks(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t t = 0; t < tp; ++t) out.push_back(rank / tp * tp + t);
  return out;
}

std::vector<int64_t> MeshShape::cp_group_ranks(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t c = 0; c < cp; ++c) out.push_back(rank / (cp * tp) * cp * tp + c * tp + rank % tp);
  return out;
}

std::vector<int64_t> MeshShape::shard_group_ranks(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < dp_shard_cp; ++s) out.push_back(replica_of(rank) * dp_shard_cp * tp + s * tp + rank % tp);
  return out;
}

std::vector<int64_t> MeshShape::replicate_group_ranks(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < replicate; ++i) out.push_back(i * dp_shard_cp * tp + rank % (dp_shard_cp * tp));
  return out;
}

std::vector<int64_t> MeshShape::ep_group_ranks(int64_t rank) const {
  const int64_t stride = expert_stride(), first = rank - expert_index_of(rank) + expert_index_of(rank) % stride;
  std::vector<int64_t> out;
  for (int64_t j = 0; j < ep; ++j) out.push_back(first + j * stride);
  return out;
}

std::vector<int64_t> MeshShape::expert_shard_group_ranks(int64_t rank) const {
  const int64_t stride = expert_stride(), first = rank - expert_index_of(rank) % stride;
  std::vector<int64_t> out;
  for (int64_t j = 0; j < stride; ++j) out.push_back(first + j);
  return out;
}

MeshShape mesh_shape(const Config& c, int64_t world_size, EngineKind engine) {
  MeshShape s;
  if (engine == EngineKind::Replicated) {
    s.replicate = world_size;
    return s;
  }
  s.replicate = c.parallel.dp_replicate;
  s.tp = c.parallel.tp;
  s.cp = c.parallel.cp;
  s.dp_shard_cp = resolved_dp_shard(c, world_size) * s.cp;
  s.ep = c.parallel.ep;
  return s;
}

CpRotate resolve_cp_rotate(const Config& c) {
  return c.parallel.cp_rotate == "ring" ? CpRotate::Ring : CpRotate::AllGather;
}

AttentionPath resolve_attention(const Config& c, int64_t cp, const c10::Device& device,
                                at::ScalarType compute_dtype) {
  AttentionPath a;
  a.documents = c.model.attention == "document";
  a.cp = cp;
  a.cp_rotate = resolve_cp_rotate(c);
  a.cudnn_varlen = resolve_kernel_choices(c).cudnn_varlen;
  const bool flash = varlen_flash_supported(device, compute_dtype, resolve_model_args(c).head_dim());
  if (a.cp > 1 && c.runtime.cp_varlen && !flash)
    throw ConfigError(c.origin("runtime.cp_varlen") + ": runtime.cp_varlen needs the variable-length flash "
                      "kernel: a GPU, bf16 and a head size it takes");
  a.flash_documents = flash && (a.cp == 1 || c.runtime.cp_varlen);
  return a;
}

ResolvedRun resolve_run(const Config& c, int64_t world_size, EngineKind engine, const c10::Device& device,
                        const MemoryChoices& autos) {
  ResolvedRun r;
  r.engine = engine;
  r.mesh = mesh_shape(c, world_size, engine);
  r.device = device;
  r.compute_dtype = resolve_compute_dtype(c, device);
  r.kernels = resolve_kernel_choices(c);
  r.attention = resolve_attention(c, r.mesh.cp, device, r.compute_dtype);
  r.micro_batches = grad_accum_steps(c, world_size);
  const std::string& reduce = c.train.reduce_every_micro_batch;
  r.reduce_every_micro_batch =
      (reduce == "true" || (reduce == "auto" && autos.reduce_every_micro_batch)) && r.micro_batches > 1;
  const std::string& keep = c.train.keep_unsharded;
  r.keep_unsharded = engine == EngineKind::Sharded && r.mesh.dp_shard_cp == 1 &&
                     (r.mesh.ep == 1 || r.mesh.expert_stride() == 1) &&  // under TP: experts over tp / ep
                     (r.mesh.replicate == 1 || c.diloco.inner_steps > 0) &&
                     (keep == "true" || (keep == "auto" && autos.keep_unsharded));
  return r;
}

}  // namespace zb
