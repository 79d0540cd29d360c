#include "train/build.h"

#include <ATen/Context.h>

#include "config/model_config.h"
#include "ddp/ddp_engine.h"
#include "float8/float8_projections.h"
#include "fsdp/fsdp_engine.h"
#include "model/attention.h"
#include "optim/replicated_muon.h"
#include "optim/sharded_muon.h"
#include "optim/tensor_parallel_muon.h"
#include "util/device.h"
#include "util/log.h"

namespace zb {

std::unique_ptr<Llama> build_model(const Config& config, const TrainingParts& parts) {
  // Same seed on every rank: every rank draws the same initial values. Under FSDP the model's
  // parameters are shapes only, and the engine creates, initialises and shards them one at a
  // time (a 7B model would need 27 GB per rank whole); DDP keeps a whole replica anyway.
  at::manual_seed(static_cast<uint64_t>(config.runtime.seed));
  auto model = std::make_unique<Llama>(resolve_model_args(config), at::TensorOptions().device(parts.device),
                                       /*allocate_parameters=*/!parts.mesh.sharded(), parts.tp_group.get());
  model->init_weights();  // the parameters it holds: none under FSDP
  model->set_compute_dtype(parts.compute_dtype);
  model->set_kernels(parts.kernels);  // the engine's gradient sums read them from the model
  model->set_context_parallel(parts.cp_group.get(), parts.attention.cp_rotate == CpRotate::Ring);
  model->set_expert_parallel(parts.ep_group.get());
  if (config.float8.enable_float8_linear) {
    const Float8Config& f = config.float8;
    if (!f.emulate && device_compute_capability(parts.device) < 89)
      throw ConfigError(config.origin("float8.enable_float8_linear") + ": float8.enable_float8_linear needs a GPU "
                        "with FP8 tensor cores (compute capability 8.9 or more: H100, H200, L40S, RTX 4090); " +
                        (parts.device.is_cuda() ? device_name(parts.device) + " has " +
                                                      std::to_string(device_compute_capability(parts.device))
                                                : std::string("this run is on the CPU")) +
                        " (float8.emulate = true computes the same values in fp32, for tests)");
    // A GEMM's tokens: a micro-batch's rows, this rank's share of them under CP (TP gathers them).
    const int64_t tokens = gemm_tokens(config);
    if (f.enable_fsdp_float8_all_gather && !parts.mesh.sharded())
      throw ConfigError(config.origin("float8.enable_fsdp_float8_all_gather") + ": float8.enable_fsdp_float8_all_gather "
                        "is for the sharding engine (train_fsdp, train_hsdp); train_ddp gathers no weights");
    const std::vector<std::string> kept = apply_float8(*model, resolve_float8(config), tokens);
    int64_t in_fp8 = 0;
    for (int64_t l = 0; l < model->args().n_layers; ++l)
      for (const char* name : {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}) in_fp8 += model->projected_outside(l, name);
    std::string filters;
    for (const std::string& k : f.filter_fqns) filters += (filters.empty() ? "" : ", ") + k;
    log::info(strf("float8: %ld of the blocks' %ld projections in FP8, recipe %s, %s%s; left out by name: %s",
                   static_cast<long>(in_fp8),
                   static_cast<long>(7 * model->args().n_layers), f.recipe_name.c_str(),
                   f.emulate ? "emulated (the FP8 values multiplied in fp32)" : "cuBLASLt's FP8 GEMMs (_scaled_mm)",
                   f.enable_fsdp_float8_all_gather ? ", their weights gathered in FP8" : "",
                   filters.empty() ? "none" : filters.c_str()));
    if (!kept.empty()) {
      std::string names;
      for (const std::string& k : kept) names += (names.empty() ? "" : ", ") + k;
      log::warn(strf("float8: %zu projection(s) stay in %s, their dimensions (or the %ld tokens of a micro-batch) not "
                     "multiples of 16 as FP8 GEMMs need: %s",
                     kept.size(), c10::toString(parts.compute_dtype), static_cast<long>(tokens), names.c_str()));
    }
  }
  return model;
}

std::unique_ptr<ParallelModel> build_engine(const Config& config, const TrainingParts& parts) {
  const ParallelMesh& mesh = parts.mesh;
  if (!mesh.sharded() && parts.model->args().num_experts > 0)
    throw ConfigError(config.origin("model.num_experts") + ": train_ddp does not yet train a mixture of experts "
                      "(model.num_experts): train_fsdp or train_hsdp does");
  if (!mesh.sharded()) return std::make_unique<DDPEngine>(*parts.model, mesh.world(), config.train.bucket_mb);
  FSDPOptions fsdp;
  fsdp.device = parts.device;
  fsdp.compute_dtype = parts.compute_dtype;
  fsdp.reshard_after_forward = config.train.reshard_after_forward;
  fsdp.checkpoint_every = config.train.ac_ckpt;
  fsdp.keep_unsharded = parts.keep_unsharded;
  fsdp.float8_all_gather = config.float8.enable_float8_linear && config.float8.enable_fsdp_float8_all_gather;
  // DiLoCo: no gradient crosses between replicas; the outer step does, every inner_steps steps.
  const bool diloco = config.diloco.inner_steps > 0;
  return std::make_unique<FSDPEngine>(*parts.model, mesh.shard_group(), fsdp,
                                      diloco ? nullptr : mesh.replicate_group(), mesh.tp_group(), mesh.ep_group(),
                                      mesh.expert_shard_group());
}

void place_muon(Muon& muon, const Config& config, const ParallelMesh& mesh) {
  const bool split = config.parallel.muon_split_over_replicas && config.diloco.inner_steps == 0;
  if (!mesh.sharded() && mesh.world_size() > 1)
    make_muon_replicated(muon, mesh.world());
  else if (mesh.sharded() && mesh.shard_group().size() > 1)
    make_muon_sharded(muon, mesh.shard_group(), split ? mesh.replicate_group() : nullptr);
  else if (mesh.sharded() && mesh.replicate_group() && split)
    make_muon_replicated(muon, *mesh.replicate_group());  // shard groups of one: whole matrices
  if (mesh.tp_group()) make_muon_tensor_parallel(muon, *mesh.tp_group(), config.parallel.muon_tp);
}

std::string replica_fingerprint(const Config& c, const ModelArgs& a, int64_t tp) {
  return strf("tp %ld; model dim %ld layers %ld heads %ld/%ld ffn %ld vocab %ld; seq %ld batch %ld; data %s seed "
              "%ld shuffle %d; steps %ld; optimizer %s; diloco inner %ld lr %g momentum %g compression %s",
              tp, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden(), a.vocab_size, c.data.seq_length,
              c.optim.batch_size, c.data.dataset_name_or_paths.c_str(), c.runtime.seed, c.data.shuffle ? 1 : 0,
              c.optim.total_steps, c.optim.optim.type.c_str(), c.diloco.inner_steps, c.diloco.outer_lr,
              c.diloco.outer_momentum, c.diloco.compression.c_str());
}

RunData build_data(const Config& config, const TrainingParts& parts) {
  RunData d;
  // Token shards, or ZeroBand's fake documents.
  DataSources sources = make_data_sources(config, parts.model->args().vocab_size);
  d.validation = sources.validation;
  d.documents = sources.documents;
  // Asked for this rank's heads: under TP each rank attends with its share of them.
  const AttentionPath& path = parts.attention;
  const int64_t cp = path.cp;
  const ModelArgs& shape = parts.model->args();
  const TpShare heads = tp_share(shape, parts.mesh.shape().tp);
  d.attention_kernel = path.cp_ring()     ? "ring_fp32_blocks"
                       : path.cp_packed() ? "flash_varlen"
                                          : attention_kernel(parts.device, parts.compute_dtype, config.data.seq_length / cp,
                                                             heads.heads, heads.kv_heads, shape.head_dim(),
                                                             d.documents.has_value() || cp > 1, path.flash_documents,
                                                             path.cudnn_varlen);
  const ParallelMesh& mesh = parts.mesh;
  d.train = std::make_unique<DataLoader>(sources.train, static_cast<uint64_t>(config.runtime.seed),
                                         config.data.shuffle && !config.data.fake, config.optim.batch_size,
                                         config.train.micro_bs, mesh.data_parallel_rank(), mesh.data_parallel_size());
  if (d.documents) d.train->set_documents(*d.documents);
  // Batches are prepared on a background thread, in pinned memory for asynchronous GPU copies.
  d.train->start_prefetch(4, parts.device.is_cuda());
  return d;
}

TrainingParts build_training(const Config& config, ParallelMesh mesh, c10::Device device, const MemoryChoices& autos) {
  TORCH_CHECK(config.diloco.inner_steps == 0 || mesh.sharded(),
              "DiLoCo (diloco.inner_steps) runs over the shard groups of train_fsdp or train_hsdp");
  const ResolvedRun run = resolve_run(config, mesh.world_size(), mesh.engine(), device, autos);
  TrainingParts p(std::move(mesh), run);
  // Which kernel scaled_dot_product_attention may run: PyTorch's own process-wide setting.
  use_sdpa_backend(config.runtime.sdpa_backend);
  if (Communicator* tp = p.mesh.tp_group()) p.tp_group = std::make_unique<CommModelParallelGroup>(*tp);
  if (Communicator* cp = p.mesh.cp_group()) p.cp_group = std::make_unique<CommModelParallelGroup>(*cp);
  if (Communicator* ep = p.mesh.ep_group()) p.ep_group = std::make_unique<CommModelParallelGroup>(*ep);
  p.model = build_model(config, p);
  p.engine = build_engine(config, p);
  p.optimizer = std::make_unique<Optimizer>(config, p.engine->parameters(), p.kernels);
  if (Muon* muon = p.optimizer->muon()) place_muon(*muon, config, p.mesh);
  if (config.diloco.inner_steps > 0)
    p.diloco = std::make_unique<DiLoCo>(config.diloco, p.engine->parameters(), p.model->args().n_layers, p.mesh);
  if (p.diloco && !config.diloco.peers.empty())
    p.diloco->set_membership(std::make_unique<ReplicaMembership>(
        config.diloco.peers, std::chrono::seconds(config.runtime.timeout_s), p.mesh.world(),
        ReplicaPlace{p.mesh.shard_group().size(), p.mesh.shard_group().rank(), p.mesh.tp_rank()},
        replica_fingerprint(config, p.model->args(), p.mesh.shape().tp),
        config.diloco.join ? config.diloco.join_state : ""));
  p.data = build_data(config, p);
  return p;
}

}  // namespace zb
