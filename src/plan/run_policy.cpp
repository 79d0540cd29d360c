#include "plan/run_policy.h"

#include <cmath>

#include "model/model_args_json.h"
#include "config/model_config.h"
#include "optim/optimizer.h"
#include "util/device.h"
#include "util/log.h"

namespace zb {

MemoryVerdict judge_memory(const Config& c, int64_t world_size, const c10::Device& device, const MemoryBudget& budget) {
  // The run with "auto" off, then each "auto" turned on where the estimate says so.
  auto estimate = [&](const MemoryChoices& autos) {
    return estimate_step_memory(c, resolve_run(c, world_size, EngineKind::Sharded, device, autos));
  };
  MemoryChoices autos;
  MemoryVerdict v;
  v.budget = budget;
  v.estimate = estimate(autos);
  const bool known = budget.device_bytes > 0;
  // train.reduce_every_micro_batch = "auto": sharded sums where whole ones do not fit and they need
  // less, whether or not they fit (a run started with --force anyway then takes the smaller, and a
  // refusal names the smaller).
  if (c.train.reduce_every_micro_batch == "auto" && known && v.estimate.peak > budget.usable) {
    MemoryEstimate sharded = estimate({true, false});
    if (sharded.reduce_every_micro_batch && sharded.peak < v.estimate.peak) {
      v.estimate = sharded;
      v.auto_turned_on = true;
      autos.reduce_every_micro_batch = true;
    }
  }
  // train.keep_unsharded = "auto": on a GPU, one rank per shard group keeps its casts where the
  // run fits with them (on the CPU a cast is cheap beside the step, and memory is not checked).
  if (c.train.keep_unsharded == "auto" && device.is_cuda() && known) {
    MemoryEstimate kept = estimate({autos.reduce_every_micro_batch, true});
    if (kept.keep_unsharded && kept.peak <= budget.usable) {
      v.estimate = std::move(kept);
      v.keep_unsharded_auto_on = true;
      autos.keep_unsharded = true;
    }
  }
  v.autos = autos;
  v.reduce_every_micro_batch = v.estimate.reduce_every_micro_batch;
  v.keep_unsharded = v.estimate.keep_unsharded;
  v.fits = !known || v.estimate.peak <= budget.usable;
  v.table = describe_memory(v.estimate, budget);
  return v;
}

NonfiniteDecision decide_nonfinite(const StepStats& s, const Config& c, const std::string& last_good) {
  auto number = [](double v) { return std::isnan(v) ? std::string("nan") : strf("%g", v); };
  const std::string what = strf("step %ld: the %s is not finite (loss %s, gradient norm %s), the step was not applied",
                                s.step, s.nonfinite.c_str(), number(s.loss).c_str(), number(s.grad_norm).c_str());
  const bool skip = c.train.nonfinite == "skip";
  if (skip && s.skipped_in_a_row < c.train.max_skipped_steps)
    return {false, strf("%s: skipped (%ld in a row, %ld in all; train.max_skipped_steps = %ld in a row stops the run)",
                        what.c_str(), s.skipped_in_a_row, s.skipped_total, c.train.max_skipped_steps)};
  return {true, what +
                    (skip ? strf("; %ld such steps in a row (train.max_skipped_steps)", s.skipped_in_a_row)
                          : std::string("; stopping (train.nonfinite = \"stop\")")) +
                    "; nothing saved; the last good checkpoint is " +
                    (last_good.empty() ? "none (no checkpoint yet)" : last_good)};
}

// The device runtime.device names, before any process has one ("auto": CUDA when usable).
c10::Device planned_device(const Config& c) {
  const bool cuda = c.runtime.device == "cuda" || (c.runtime.device == "auto" && cuda_available());
  return cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
}

// The run as another implementation needs it to train the same model the same way: the resolved
// shapes, batch and optimizer settings. scripts/perf/bench_peer.py builds its PyTorch twin from this.
nlohmann::json resolved_run(const Config& c) {
  const ModelArgs a = resolve_model_args(c);
  nlohmann::json model = model_args_to_json(a);
  model["head_dim"] = a.head_dim();  // derived sizes, so that the peer needs no formula
  model["ffn_hidden"] = a.ffn_hidden();
  const auto& o = c.optim;
  const c10::Device device = planned_device(c);
  const at::ScalarType compute = resolve_compute_dtype(c, device);
  const at::ScalarType ns = resolve_ns_dtype(c, device);
  nlohmann::json deterministic = nullptr;  // what runtime.deterministic sets, or null
  if (c.runtime.deterministic) {
    deterministic = nlohmann::json::object();
    for (const auto& [setting, value] : deterministic_settings()) deterministic[setting] = value;
  }
  return {
      {"name_model", c.name_model},
      {"type_model", c.type_model},
      {"project", c.project},
      {"model", model},
      {"attention", c.model.attention},
      {"num_params", count_params(a)},
      {"flops_per_token", flops_per_token(a, c.data.seq_length)},
      {"seq_length", c.data.seq_length},
      {"micro_bs", c.train.micro_bs},
      {"batch_size", o.batch_size},
      {"ac_ckpt", c.train.ac_ckpt},
      {"reshard_after_forward", c.train.reshard_after_forward},
      {"reduce_every_micro_batch", c.train.reduce_every_micro_batch},
      {"bucket_mb", c.train.bucket_mb},
      {"parallel", {{"dp_shard", c.parallel.dp_shard}, {"dp_replicate", c.parallel.dp_replicate}, {"tp", c.parallel.tp},
                    {"cp", c.parallel.cp}, {"ep", c.parallel.ep},
                    {"muon_split_over_replicas", c.parallel.muon_split_over_replicas},
                    {"muon_tp", c.parallel.muon_tp}}},
      {"diloco", c.diloco.inner_steps == 0
                     ? nlohmann::json(nullptr)
                     : nlohmann::json{{"inner_steps", c.diloco.inner_steps}, {"outer_lr", c.diloco.outer_lr},
                                      {"outer_momentum", c.diloco.outer_momentum},
                                      {"compression", c.diloco.compression}, {"fragments", c.diloco.fragments},
                                      {"fragment_delay", c.diloco.fragment_delay}}},
      {"float8", !c.float8.enable_float8_linear
                     ? nlohmann::json(nullptr)
                     : nlohmann::json{{"recipe_name", c.float8.recipe_name}, {"filter_fqns", c.float8.filter_fqns},
                                      {"emulate", c.float8.emulate}}},
      {"max_norm", o.max_norm},
      {"schedule", {{"type", o.sched_type}, {"warmup_steps", o.warmup_steps},
                    {"stable_steps", o.stable_steps}, {"total_steps", o.total_steps}}},
      {"hidden", {{"type", o.optim.type}, {"lr", o.optim.lr}, {"wd", o.optim.wd},
                  {"momentum", o.optim.momentum}, {"nesterov", o.optim.nesterov},
                  {"ns_steps", o.optim.ns_steps}, {"update_scale", o.optim.update_scale},
                  {"ns_dtype", o.optim.ns_dtype}, {"ns_coefficients", o.optim.ns_coefficients},
                  {"ns_algorithm", o.optim.ns_algorithm}}},
      {"adam", {{"lr_embedding", o.adam.lr_embedding}, {"lr_head", o.adam.lr_head},
                {"lr_norm", o.adam.lr_norm}, {"betas", {o.adam.betas1, o.adam.betas2}},
                {"eps", o.adam.eps}, {"wd", o.adam.wd}}},
      {"runtime", {{"device", c.runtime.device}, {"compute_dtype", c.runtime.compute_dtype},
                   {"seed", c.runtime.seed}, {"num_threads", c.runtime.num_threads},
                   {"peak_flops", c.runtime.peak_flops}, {"backend", c.runtime.backend},
                   {"deterministic", c.runtime.deterministic}}},
      // What "auto" resolves to on this machine, as the trainer will run it.
      {"resolved_device", device.is_cuda() ? "cuda" : "cpu"},
      {"resolved_compute_dtype", compute == at::kBFloat16 ? "bfloat16" : "float32"},
      {"resolved_ns_dtype", ns == at::kBFloat16 ? "bfloat16" : "float32"},
      {"resolved_deterministic", deterministic},
  };
}

// What this rank's device offers: on a GPU (unless runtime.device_memory_gb says) the memory
// still free once the CUDA context and every communicator exist; else from the config or the
// GPU's name. A dry run may plan for a GPU on a machine without one: then only the config says.
MemoryBudget memory_budget(const Config& cfg, const c10::Device& device, bool dry_run, int64_t sharing) {
  const bool gpu_here = device.is_cuda() && cuda_available();
  if (gpu_here && !dry_run && cfg.runtime.device_memory_gb <= 0) {
    const DeviceMemory m = device_memory(device);
    return share_budget(measured_budget(m.available, m.total), sharing);
  }
  return share_budget(planned_budget(cfg, gpu_here ? device_name(device) : ""), sharing);
}

MemoryBudget share_budget(MemoryBudget budget, int64_t sharing) {
  if (sharing <= 1 || budget.device_bytes == 0) return budget;
  budget.usable /= sharing;
  budget.how += strf("; divided between the %ld ranks that share this GPU", static_cast<long>(sharing));
  budget.shared_by = sharing;
  return budget;
}

StepPlan plan_run(const Config& c, int64_t world_size, int64_t rank, EngineKind engine,
                  MemoryVerdict* memory) {
  const c10::Device device = planned_device(c);
  // The memory verdict decides "auto" (the sharding engine's; train_ddp has neither setting).
  MemoryChoices autos;
  if (engine == EngineKind::Sharded) {
    MemoryVerdict v = judge_memory(c, world_size, device, memory_budget(c, device, /*dry_run=*/true));
    autos = v.autos;
    if (memory) *memory = std::move(v);
  }
  return plan_step(c, ParallelMesh(c, world_size, rank, engine), resolve_run(c, world_size, engine, device, autos));
}

}  // namespace zb
