#include "launch/launch.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <optional>

#include "dist/rendezvous.h"
#include "model/layers.h"
#include "model/llama.h"
#include "observe/metrics_logger.h"
#include "util/device.h"
#include "util/log.h"

namespace zb {

namespace {

// This rank's process for a run: its device, allocator and CPU threads. A file-size limit (ulimit
// -f, some quotas) would kill the process in the middle of a write; ignored, the write fails with
// EFBIG and the error names the file.
c10::Device prepare_process(const Config& config, const World& world) {
  std::signal(SIGXFSZ, SIG_IGN);
  if (config.runtime.deterministic) use_deterministic_algorithms();  // before any GPU work
  const c10::Device device = select_device(config.runtime.device, world.local_rank);
  use_device(device);
  configure_allocator(device);
  if (config.runtime.num_threads > 0) {
    at::set_num_threads(static_cast<int>(config.runtime.num_threads));
  } else if (!device.is_cuda() && world.local_size > 1 && !std::getenv("OMP_NUM_THREADS")) {
    // Ranks on one machine's CPU share its cores: LibTorch's default of every core per process
    // would have them fight over each (torchrun sets OMP_NUM_THREADS=1 itself; mpirun does not).
    at::set_num_threads(std::max<int>(1, at::get_num_threads() / static_cast<int>(world.local_size)));
  }
  return device;
}

void log_placement(const Communicator& comm, const c10::Device& device) {
  const World& w = comm.world();
  const std::string gpu =
      device.is_cuda() ? strf(", %s, PCI %s", device_name(device).c_str(), device_pci_bus_id(device).c_str()) : "";
  const auto placement = comm.rendezvous().exchange(
      "placement", strf("rank %ld (local %ld) on %s: %s%s", w.rank, w.local_rank, host_name().c_str(),
                        device.str().c_str(), gpu.c_str()));
  if (w.rank == 0)
    for (const auto& line : placement) log::info("placement: " + line);
}

}  // namespace

void check_engine(const Config& config, EngineKind engine) {
  if (engine != EngineKind::Replicated) return;
  const auto refuse = [&](const char* key, const std::string& why) { throw ConfigError(config.origin(key) + ": " + why); };
  if (config.parallel.cp > 1)
    refuse("parallel.cp", "context parallelism composes with the sharding engine (train_fsdp, train_hsdp), not train_ddp");
  if (config.parallel.tp > 1)
    refuse("parallel.tp", "tensor parallelism composes with the sharding engine (train_fsdp, train_hsdp), not train_ddp");
  if (config.diloco.inner_steps > 0)
    refuse("diloco.inner_steps", "DiLoCo trains the replicas of train_fsdp or train_hsdp apart (parallel.dp_replicate "
                                 "shard groups); train_ddp has none");
  if (config.train.ac_ckpt > 0)
    refuse("train.ac_ckpt", "activation checkpointing is the sharding engine's (train_fsdp, train_hsdp); train_ddp "
                            "keeps every block's activations");
}

void dry_run(const Config& config, const ModelArgs& args, int64_t world_size, EngineKind engine, bool force) {
  Llama model(args, at::TensorOptions().device(c10::kMeta));
  log::info(strf("dry run: built %s parameters on the meta device", with_commas(model.num_params()).c_str()));
  if (engine != EngineKind::Sharded) {
    log::info("memory estimate: train_fsdp only");
    return;
  }
  const c10::Device planned = planned_device(config);
  check_memory(config, world_size, planned, memory_budget(config, planned, /*dry_run=*/true), force, /*dry_run=*/true);
}

RunProcess join_world(const Config& config, const World& world) {
  const c10::Device device = prepare_process(config, world);
  const auto rendezvous = connect_rendezvous(world, std::chrono::seconds(config.runtime.timeout_s));
  // Which ranks share a GPU decides how the collectives travel (runtime.backend).
  const Placement placement = exchange_placement(*rendezvous, device);
  const BackendChoice backend = choose_backend(config.runtime.backend, device, placement);
  auto comm = std::make_unique<Communicator>(rendezvous, device, backend.transport);
  log::info(strf("world: %ld process(es) via %s, rendezvous %s:%ld, collectives over %s; this is rank %ld (local %ld)",
                 world.size, world.launcher.c_str(), world.master_addr.c_str(), world.master_port,
                 world.distributed() ? transport_name(comm->transport()) : "none (one process)", world.rank,
                 world.local_rank));
  if (!backend.why.empty() && world.rank == 0 && world.distributed()) log::info("collectives: " + backend.why);
  log_placement(*comm, device);
  return {device, placement, std::move(comm)};
}

std::vector<std::string> describe_run(const Config& c, const ModelArgs& a, int64_t world_size,
                                      EngineKind engine) {
  std::vector<std::string> lines = {
      strf("model: %s %s: dim %ld, %ld layers, %ld heads (%ld kv), head_dim %ld, ffn %ld, vocab %ld",
           c.type_model.c_str(), c.name_model.c_str(), a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim(),
           a.ffn_hidden(), a.vocab_size),
      strf("parameters: %s total, %s without the token embedding", with_commas(count_params(a)).c_str(),
           with_commas(count_params_without_embedding(a)).c_str()),
      strf("FLOPs/token: %.4g (6N + 12*L*H*Dh*T at seq_length %ld%s)", flops_per_token(a, c.data.seq_length),
           c.data.seq_length,
           c.model.attention == "document" ? "; attention counted over whole rows, as ZeroBand, though the document "
                                             "mask skips pairs: MFU is comparable, tokens/s is the measure"
                                           : ""),
      strf("batch: %ld sequences x %ld tokens = %s tokens/step; micro_bs %ld, %ld accumulation steps on %ld rank(s)",
           c.optim.batch_size, c.data.seq_length, with_commas(c.optim.batch_size * c.data.seq_length).c_str(),
           c.train.micro_bs, grad_accum_steps(c, world_size), world_size),
  };
  const MeshShape layout = mesh_shape(c, world_size);
  if (layout.tp > 1)
    lines.push_back(strf("tensor parallelism: groups of %ld consecutive ranks split every matrix (heads, FFN "
                         "columns, vocabulary) and every sequence between them; %ld group(s) read different rows",
                         layout.tp, layout.data_parallel_size()));
  if (layout.cp > 1)
    lines.push_back(strf("context parallelism: groups of %ld ranks split each row's %ld tokens (rank i of a group "
                         "holds chunks i and %ld-i of %ld tokens), gathering keys and values in every block; the "
                         "parameters are sharded over %ld ranks (dp_shard x cp)",
                         layout.cp, c.data.seq_length, 2 * layout.cp - 1, c.data.seq_length / (2 * layout.cp),
                         layout.dp_shard_cp));
  if (layout.tp > 1 && c.optim.optim.type == "muon")
    lines.push_back(strf("Muon under tensor parallelism (parallel.muon_tp = %s): %s", c.parallel.muon_tp.c_str(),
                         c.parallel.muon_tp == "split"
                             ? "Newton-Schulz on the slices, one Gram matrix all-reduced over the TP group per iteration"
                         : c.parallel.muon_tp == "gather"
                             ? "each split matrix gathered to one owner in the TP group, orthogonalised whole"
                             : "per matrix, a gather to an owner or Newton-Schulz over the slices, whichever moves "
                               "fewer bytes (gather, for Llama's shapes)"));
  if (engine == EngineKind::Sharded && c.diloco.inner_steps > 0 && !c.diloco.peers.empty()) {
    lines.push_back(strf("DiLoCo over elastic replicas: this launch is one replica of %ld rank(s), meeting the others "
                         "at diloco.peers %s; every %ld steps an outer Nesterov step (lr %g, momentum %g) on the "
                         "pseudo-gradients averaged over the replicas present, sent as %s; %ld rows a step per replica",
                         layout.dp_shard_cp * layout.tp, c.diloco.peers.c_str(), c.diloco.inner_steps, c.diloco.outer_lr,
                         c.diloco.outer_momentum, c.diloco.compression.c_str(), c.optim.batch_size));
  } else if (engine == EngineKind::Sharded && c.diloco.inner_steps > 0) {
    lines.push_back(strf("DiLoCo: %ld replica(s) of %ld rank(s) train apart (gradients averaged within a "
                         "replica only); every %ld steps an outer Nesterov step (lr %g, momentum %g) on the "
                         "pseudo-gradients averaged over the replicas, sent as %s",
                         layout.replicate, layout.dp_shard_cp * layout.tp, c.diloco.inner_steps, c.diloco.outer_lr,
                         c.diloco.outer_momentum, c.diloco.compression.c_str()));
    if (c.diloco.fragments > 1)
      lines.push_back(strf("DiLoCo streaming: %ld fragments of blocks, one exchange every %ld steps, each applied "
                           "%ld step(s) after it starts",
                           c.diloco.fragments, c.diloco.inner_steps / c.diloco.fragments, c.diloco.fragment_delay));
  } else if (engine == EngineKind::Sharded && layout.replicate > 1) {
    lines.push_back(strf("hybrid sharding: parameters sharded over groups of %ld %s, replicated %ld "
                         "times (gradients: reduce-scatter in the group, then all-reduce over the replicas)",
                         layout.dp_shard_cp, layout.tp > 1 ? "ranks (one per TP group)" : "consecutive ranks",
                         layout.replicate));
  }
  return lines;
}

std::vector<std::string> describe_trainer(Trainer& trainer, const Config& c, const c10::Device& device) {
  std::vector<std::string> lines = {strf("device: %s (%s), compute dtype %s, %d CPU threads, reshard_after_forward %s%s",
                                         device.str().c_str(), device_name(device).c_str(),
                                         c10::toString(trainer.compute_dtype()), at::get_num_threads(),
                                         c.train.reshard_after_forward ? "true" : "false",
                                         trainer.keeps_unsharded() ? ", casts kept for the step (train.keep_unsharded)"
                                                                   : "")};
  if (device.is_cuda())
    lines.push_back(!c.runtime.fused_kernels ? "kernels: ATen's operators alone (runtime.fused_kernels = false)"
                    : trainer.compute_dtype() == at::kBFloat16 && fused_kernels_run_on(device)
                        ? "kernels: ours for RoPE, SwiGLU's gate and the loss's logit gradient in bf16 "
                          "(runtime.fused_kernels = true)"
                        : "kernels: ATen's for RoPE, SwiGLU's gate and the loss's logit gradient (ours take bf16, "
                          "on a GPU this build has their image for)");
  if (const auto& d = trainer.documents())
    lines.push_back(strf("attention: within documents, split %s token %ld (%s), kernel %s", d->opens ? "before" : "after",
                         static_cast<long>(d->token),
                         trainer.flash_documents() ? "variable-length kernel" : "additive mask through SDPA",
                         trainer.attention_kernel().c_str()));
  else
    lines.push_back(strf("attention: causal over whole rows, kernel %s (runtime.sdpa_backend = %s)",
                         trainer.attention_kernel().c_str(), c.runtime.sdpa_backend.c_str()));
  for (const auto& line : trainer.optimizer().describe()) lines.push_back("optimizer " + line);
  if (trainer.grad_accum_steps() > 1)
    lines.push_back(trainer.reduces_every_micro_batch()
                        ? strf("gradients: reduced on each of the %ld micro-batches, summed in fp32 shards",
                               trainer.grad_accum_steps())
                        : strf("gradients: summed whole in fp32 over %ld micro-batches, reduced on the last "
                               "(train.reduce_every_micro_batch = true saves that memory for more traffic)",
                               trainer.grad_accum_steps()));
  return lines;
}

MemoryVerdict check_memory(const Config& config, int64_t world_size, const c10::Device& device,
                           const MemoryBudget& budget, bool force, bool dry_run) {
  const MemoryVerdict v = judge_memory(config, world_size, device, budget);
  if (v.auto_turned_on)
    log::info(v.fits ? "train.reduce_every_micro_batch = auto: on (the run fits only with sharded gradient sums)"
                     : "train.reduce_every_micro_batch = auto: on (whole gradient sums need more, and neither fits)");
  if (v.keep_unsharded_auto_on)
    log::info("train.keep_unsharded = auto: on (one rank: the parameters' casts kept for the step, and the run "
              "fits with them)");
  if (v.fits || dry_run || force) {
    for (const auto& line : v.table) (v.fits ? log::info : log::warn)(line);
    if (!v.fits && !dry_run) log::warn("--force: training anyway");
    return v;
  }
  std::string table;
  for (const auto& line : v.table) table += "\n" + line;
  const std::string where =
      v.budget.shared_by > 1
          ? strf("in its share of the GPU (%ld ranks share it: fewer ranks on it, ", static_cast<long>(v.budget.shared_by))
          : std::string("in one device's memory (");
  throw ConfigError("the run is predicted not to fit " + where +
                    "smaller train.micro_bs, train.ac_ckpt, more ranks; --force to try anyway):" + table);
}

nlohmann::json plan_report(const CommandLine& cl, EngineKind engine, bool over_nodes) {
  Config cfg = cl.config;
  const World world = detect_world();
  if (over_nodes) shard_by_node(cfg, world, /*dry_run=*/cl.world_size > 0);
  const int64_t world_size = cl.world_size > 0 ? cl.world_size : world.size;
  validate(cfg, world_size);
  if (cl.print_plan_rank >= world_size)
    throw ConfigError(strf("--print-plan %ld: there are only %ld rank(s) (--world-size)", cl.print_plan_rank,
                           world_size));
  std::optional<MemoryVerdict> memory;
  if (engine == EngineKind::Sharded) memory.emplace();
  nlohmann::json plan =
      plan_to_json(plan_run(cfg, world_size, cl.print_plan_rank, engine, memory ? &*memory : nullptr));
  if (memory) {
    plan["memory"] = {{"peak_bytes", memory->estimate.peak},
                      {"peak_at", memory->estimate.peak_at},
                      {"usable_bytes", memory->budget.usable},
                      {"fits", memory->fits}};
  } else {
    plan["memory"] = nullptr;
  }
  return plan;
}

}  // namespace zb
