// validate(): everything about a run that can be checked before any work starts, so that a bad
// configuration fails at once with the key and where it was set, not minutes into a launch.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include "config/fields.h"
#include "config/model_config.h"
#include "config/resolved_run.h"
#include "kernels/kernel_choices.h"
#include "model/llama.h"

namespace zb {

void validate(const Config& c, int64_t world_size) {
  auto fail = [&](const std::string& key, const std::string& msg) {
    throw ConfigError(c.origin(key) + ": " + msg);
  };
  auto positive = [&](const std::string& key, double value) {
    if (!(value > 0)) fail(key, key + " must be > 0, got " + show(value));
  };
  auto non_negative = [&](const std::string& key, double value) {
    if (!(value >= 0)) fail(key, key + " must be >= 0, got " + show(value));
  };

  if (world_size < 1) throw ConfigError("world size must be >= 1, got " + std::to_string(world_size));

  // Enumerations, from the schema's choices; first, since the model lookup needs a known
  // type_model. get() and show() both quote strings, so shown values compare like the values.
  for (const Field& f : schema()) {
    if (f.choices.empty()) continue;
    const std::string value = f.get(c);
    if (std::none_of(f.choices.begin(), f.choices.end(),
                     [&](const std::string& choice) { return show(choice) == value; }))
      fail(f.key, f.key + " = " + value + " is not one of " + join_choices(f.choices));
  }

  // Our fused operators left to ATen, by name: as KernelChoices reads them.
  try {
    resolve_kernel_choices(c);
  } catch (const std::invalid_argument& e) {
    fail("runtime.unfused", e.what());
  }

  // Model shapes.
  const ModelArgs a = resolve_model_args(c);
  positive("model.dim", a.dim);
  positive("model.n_layers", a.n_layers);
  positive("model.n_heads", a.n_heads);
  positive("model.n_kv_heads", a.n_kv_heads);
  positive("model.vocab_size", a.vocab_size);
  if (c.data.fake && a.vocab_size < 4)  // fake rows draw tokens from [3, vocab) after the end token 1
    fail("model.vocab_size", "data.fake needs a vocabulary of at least 4 tokens, got " + show(a.vocab_size));
  positive("model.multiple_of", a.multiple_of);
  non_negative("model.ffn_dim_multiplier", a.ffn_dim_multiplier);  // 0: none
  positive("model.norm_eps", a.norm_eps);
  positive("model.rope_theta", a.rope_theta);
  if (a.dim % a.n_heads != 0)
    fail("model.n_heads", "n_heads (" + show(a.n_heads) + ") must divide dim (" + show(a.dim) + ")");
  if (a.n_heads % a.n_kv_heads != 0)
    fail("model.n_kv_heads", "n_kv_heads (" + show(a.n_kv_heads) + ") must divide n_heads (" +
                                 show(a.n_heads) + ")");
  if (a.head_dim() % 2 != 0)
    fail("model.dim", "head dimension dim/n_heads = " + show(a.head_dim()) +
                              " must be even for rotary embeddings");

  // Mixture of experts: the router's numbers fit the experts (route() checks the same).
  non_negative("model.num_experts", a.num_experts);
  if (a.num_experts > 0) {
    const int64_t E = a.num_experts;
    if (a.top_k < 1 || a.top_k > E)
      fail("model.top_k", "model.top_k (" + show(a.top_k) + ") must be between 1 and model.num_experts (" + show(E) + ")");
    non_negative("model.moe_inter_dim", a.moe_inter_dim);
    non_negative("model.num_shared_experts", a.num_shared_experts);
    if (a.n_dense_layers < 0 || a.n_dense_layers >= a.n_layers)
      fail("model.n_dense_layers", "model.n_dense_layers (" + show(a.n_dense_layers) +
                                       ") must leave at least one of the " + show(a.n_layers) + " blocks a mixture of experts");
    positive("model.route_scale", a.route_scale);
    non_negative("model.load_balance_coeff", a.load_balance_coeff);
    non_negative("model.aux_loss_coeff", a.aux_loss_coeff);
    non_negative("model.num_expert_groups", a.num_expert_groups);
    if (const int64_t G = a.num_expert_groups; G > 0) {
      if (E % G != 0)
        fail("model.num_expert_groups", "model.num_expert_groups (" + show(G) + ") must divide model.num_experts (" +
                                            show(E) + ")");
      if (a.num_limited_groups < 1 || a.num_limited_groups > G)
        fail("model.num_limited_groups", "model.num_limited_groups (" + show(a.num_limited_groups) +
                                             ") must be between 1 and model.num_expert_groups (" + show(G) + ")");
      if (a.top_k > a.num_limited_groups * (E / G))
        fail("model.top_k", "model.top_k (" + show(a.top_k) + ") is more than the " +
                                show(a.num_limited_groups * (E / G)) + " experts of the model.num_limited_groups (" +
                                show(a.num_limited_groups) + ") groups a token chooses in");
    } else if (a.num_limited_groups != 0) {
      fail("model.num_limited_groups", "model.num_limited_groups is group routing's: it needs model.num_expert_groups");
    }
    // What does not yet compose with experts, each by the key that asks for it.
    if (c.float8.enable_float8_linear)
      fail("float8.enable_float8_linear", "float8.enable_float8_linear: a mixture of experts' grouped products "
                                          "(model.num_experts) have no FP8 path yet");
    // Tensor parallelism's ranks each route their own positions of a sequence, as CP's do.
    for (const auto& [key, n] : {std::pair<const char*, int64_t>{"parallel.cp", c.parallel.cp}, {"parallel.tp", c.parallel.tp}})
      if (a.aux_loss_coeff > 0 && n > 1)
        fail("model.aux_loss_coeff", "model.aux_loss_coeff: the sequence-wise auxiliary loss needs each sequence's "
                                     "tokens on one rank, but " + std::string(key) + " (" + show(n) + ") splits them");
  } else {
    for (const char* key : {"model.top_k", "model.moe_inter_dim", "model.num_shared_experts", "model.n_dense_layers",
                            "model.score_func", "model.route_norm", "model.route_scale", "model.num_expert_groups",
                            "model.num_limited_groups", "model.load_balance_coeff", "model.aux_loss_coeff"})
      if (c.origins.count(key))
        fail(key, std::string(key) + " is a mixture of experts' setting, but model.num_experts is 0 (every block dense)");
  }

  // Training and batch arithmetic.
  positive("train.micro_bs", c.train.micro_bs);
  non_negative("train.ac_ckpt", c.train.ac_ckpt);
  positive("train.bucket_mb", c.train.bucket_mb);
  positive("train.max_skipped_steps", c.train.max_skipped_steps);
  positive("optim.batch_size", c.optim.batch_size);
  positive("parallel.tp", c.parallel.tp);
  positive("parallel.cp", c.parallel.cp);
  const int64_t tp = c.parallel.tp;
  if (world_size % tp != 0)
    fail("parallel.tp", "parallel.tp (" + show(tp) + ") must divide the world size (" + show(world_size) + ")");
  if (world_size % (tp * c.parallel.cp) != 0)
    fail("parallel.cp", "parallel.cp (" + show(c.parallel.cp) + ") x parallel.tp (" + show(tp) +
                            ") must divide the world size (" + show(world_size) + ")");
  if (c.optim.batch_size % (data_parallel_size(c, world_size) * c.train.micro_bs) != 0)
    fail("optim.batch_size", "optim.batch_size (" + show(c.optim.batch_size) + ") must be divisible by world size (" +
                                 show(world_size) + ")" + (tp > 1 ? " / parallel.tp (" + show(tp) + ")" : "") +
                                 (c.parallel.cp > 1 ? " / parallel.cp (" + show(c.parallel.cp) + ")" : "") +
                                 " x train.micro_bs (" + show(c.train.micro_bs) + ")");
  positive("parallel.dp_replicate", c.parallel.dp_replicate);
  if (c.parallel.dp_shard != -1) positive("parallel.dp_shard", c.parallel.dp_shard);
  const int64_t cp = c.parallel.cp;
  if (tp * cp * resolved_dp_shard(c, world_size) * c.parallel.dp_replicate != world_size) {
    const bool rest = c.parallel.dp_shard == -1;
    fail(rest ? "parallel.dp_replicate" : "parallel.dp_shard",
         (tp > 1 ? "parallel.tp (" + show(tp) + ") x " : std::string()) +
             (cp > 1 ? "parallel.cp (" + show(cp) + ") x " : std::string()) + "parallel.dp_shard (" +
             (rest ? std::string("-1, the rest") : show(c.parallel.dp_shard)) + ") x parallel.dp_replicate (" +
             show(c.parallel.dp_replicate) + ") must equal the world size (" + show(world_size) + ")");
  }
  positive("parallel.ep", c.parallel.ep);
  if (const int64_t ep = c.parallel.ep; ep > 1) {
    const int64_t shard = resolved_dp_shard(c, world_size) * cp;
    if (a.num_experts == 0)
      fail("parallel.ep", "parallel.ep (" + show(ep) + ") splits a mixture's experts, but model.num_experts is 0");
    if (shard * tp % ep != 0)
      fail("parallel.ep", "parallel.ep (" + show(ep) + ") must divide a replica's " + show(shard * tp) +
                              " ranks (parallel.dp_shard x parallel.cp x parallel.tp)");
    if (a.num_experts % ep != 0)
      fail("parallel.ep", "parallel.ep (" + show(ep) + ") must divide model.num_experts (" + show(a.num_experts) + ")");
    // Elastic replicas of other layouts meet by the shard layout's rows (diloco/diloco.cpp's mixed_mean).
    if (!c.diloco.peers.empty() && a.num_experts % shard != 0)
      fail("parallel.ep", "parallel.ep (" + show(ep) + ") with elastic replicas (diloco.peers): model.num_experts (" +
                              show(a.num_experts) + ") must divide over the shard group's " + show(shard) +
                              " ranks, so that a rank's experts are its rows of the shard layout");
    if (!c.diloco.peers.empty() && tp > 1)
      fail("parallel.ep", "parallel.ep (" + show(ep) + ") with elastic replicas (diloco.peers) and parallel.tp (" +
                              show(tp) + "): the experts are divided over the TP ranks too, not as the shard layout's "
                              "rows that mixed generations meet by; use parallel.tp = 1 or fixed replicas");
  }
  if (cp > 1) {
    if (c.data.seq_length % (2 * cp) != 0)
      fail("parallel.cp", "parallel.cp (" + show(cp) + "): data.seq_length (" + show(c.data.seq_length) +
                              ") must divide into 2 x cp chunks, two for each rank of a CP group");
    if (c.data.seq_length % (2 * cp) == 0 && (c.data.seq_length / cp) % tp != 0)
      fail("parallel.cp", "parallel.cp (" + show(cp) + ") x parallel.tp (" + show(tp) + "): a rank's share of a row (" +
                              show(c.data.seq_length / cp) + " tokens) must divide over the TP group");
  }
  if (tp > 1) {
    try {
      check_tensor_parallel(a, tp);
    } catch (const std::invalid_argument& e) {
      fail("parallel.tp", std::string("parallel.tp = ") + show(tp) + ": " + e.what());
    }
    if (c.data.seq_length % tp != 0)
      fail("parallel.tp", "parallel.tp (" + show(tp) + ") must divide data.seq_length (" + show(c.data.seq_length) +
                              "): each rank of a TP group holds an equal part of every sequence");
  }
  positive("data.seq_length", c.data.seq_length);
  non_negative("data.num_workers", c.data.num_workers);
  non_negative("data.eval_interval", c.data.eval_interval);
  if (c.data.document_token) {
    non_negative("data.document_token", *c.data.document_token);
    if (*c.data.document_token >= a.vocab_size)
      fail("data.document_token", "data.document_token (" + show(*c.data.document_token) +
                                      ") is not below the vocabulary of " + show(a.vocab_size));
  }
  positive("data.eval_batches", c.data.eval_batches);
  if (c.data.eval_interval > 0 && !c.data.val_dataset_name_or_paths && !c.data.fake)
    fail("data.eval_interval", "data.eval_interval is set but data.val_dataset_name_or_paths is not");
  // Mixed datasets: one ratio part per comma-separated path. Fake data reads neither.
  if (c.data.dataset_ratio && !c.data.fake) {
    const std::string& paths = c.data.dataset_name_or_paths;
    const auto n_paths = static_cast<size_t>(1 + std::count(paths.begin(), paths.end(), ','));
    try {
      parse_ratio(*c.data.dataset_ratio, n_paths);
    } catch (const std::invalid_argument& e) {
      fail("data.dataset_ratio", e.what());
    }
  }

  // Schedule.
  positive("optim.total_steps", c.optim.total_steps);
  non_negative("optim.warmup_steps", c.optim.warmup_steps);
  if (c.optim.sched_type == "wsd-sqrt" &&
      !(c.optim.warmup_steps <= c.optim.stable_steps && c.optim.stable_steps <= c.optim.total_steps))
    fail("optim.stable_steps", "wsd-sqrt needs warmup_steps (" + show(c.optim.warmup_steps) +
                                   ") <= stable_steps (" + show(c.optim.stable_steps) +
                                   ") <= total_steps (" + show(c.optim.total_steps) + ")");
  non_negative("optim.max_norm", c.optim.max_norm);

  // Optimizer.
  positive("optim.optim.lr", c.optim.optim.lr);
  non_negative("optim.optim.wd", c.optim.optim.wd);
  if (!(c.optim.optim.momentum >= 0 && c.optim.optim.momentum < 1))
    fail("optim.optim.momentum", "optim.optim.momentum must be in [0, 1), got " + show(c.optim.optim.momentum));
  positive("optim.optim.ns_steps", c.optim.optim.ns_steps);
  non_negative("optim.optim.qk_clip_threshold", c.optim.optim.qk_clip_threshold);
  if (!(c.optim.optim.qk_clip_alpha >= 0 && c.optim.optim.qk_clip_alpha <= 1))
    fail("optim.optim.qk_clip_alpha",
         "optim.optim.qk_clip_alpha must be in [0, 1], got " + show(c.optim.optim.qk_clip_alpha));
  positive("optim.adam.lr_embedding", c.optim.adam.lr_embedding);
  positive("optim.adam.lr_head", c.optim.adam.lr_head);
  positive("optim.adam.lr_norm", c.optim.adam.lr_norm);
  for (const char* key : {"optim.adam.betas1", "optim.adam.betas2"}) {
    const double b = std::string(key) == "optim.adam.betas1" ? c.optim.adam.betas1 : c.optim.adam.betas2;
    if (!(b >= 0 && b < 1)) fail(key, std::string(key) + " must be in [0, 1), got " + show(b));
  }
  positive("optim.adam.eps", c.optim.adam.eps);
  non_negative("optim.adam.wd", c.optim.adam.wd);

  // Ours.
  non_negative("runtime.num_threads", c.runtime.num_threads);
  non_negative("runtime.peak_flops", c.runtime.peak_flops);
  non_negative("runtime.device_memory_gb", c.runtime.device_memory_gb);
  positive("runtime.timeout_s", c.runtime.timeout_s);
  if (c.runtime.backend == "nccl" && c.runtime.device == "cpu")
    fail("runtime.backend", "runtime.backend = \"nccl\" carries GPU tensors, but runtime.device = \"cpu\"");
  non_negative("ckpt.interval", c.ckpt.interval);
  non_negative("ckpt.keep", c.ckpt.keep);
  if (c.ckpt.resume == "latest" && c.ckpt.path.empty())
    fail("ckpt.resume", "ckpt.resume = \"latest\" needs ckpt.path");
  positive("logging.interval", c.logging.interval);
  positive("profiling.profile_freq", c.profiling.profile_freq);
  positive("profiling.profile_active", c.profiling.profile_active);
  if (c.profiling.profile_active > c.profiling.profile_freq)
    fail("profiling.profile_active", "profiling.profile_active (" + show(c.profiling.profile_active) +
                                         ") must not exceed profiling.profile_freq (" + show(c.profiling.profile_freq) + ")");
  if (c.profiling.enable_profiling && c.profiling.nvtx)
    fail("profiling.nvtx", "profiling.nvtx and profiling.enable_profiling are two uses of the one profiler of a "
                           "process: choose one (nvtx for Nsight Systems, enable_profiling for traces)");

  if (c.runtime.cp_varlen && (c.parallel.cp == 1 || c.parallel.cp_rotate != "allgather" || c.runtime.device == "cpu"))
    fail("runtime.cp_varlen", "runtime.cp_varlen is context parallelism's variable-length kernel: it needs "
                              "parallel.cp above 1, parallel.cp_rotate = \"allgather\" and a GPU");

  // Float8 linears: the other keys mean nothing without enable_float8_linear. Without emulate the
  // GEMMs are the GPU's (the device is checked when it is known, train/build.cpp).
  if (!c.float8.enable_float8_linear) {
    for (const auto& [key, where] : c.origins)
      if (key.rfind("float8.", 0) == 0 && key != "float8.enable_float8_linear")
        fail(key, key + " is set but float8.enable_float8_linear is false: set it to train with FP8 linears");
  } else if (c.float8.enable_fsdp_float8_all_gather && c.float8.recipe_name != "tensorwise") {
    fail("float8.enable_fsdp_float8_all_gather", "float8.enable_fsdp_float8_all_gather casts each weight with one "
                                                 "scale: it needs float8.recipe_name = \"tensorwise\", not " +
                                                     show(c.float8.recipe_name));
  } else if (c.origins.count("float8.precompute_float8_dynamic_scale_for_fsdp")) {
    const std::string key = "float8.precompute_float8_dynamic_scale_for_fsdp";
    if (!c.float8.enable_fsdp_float8_all_gather)
      fail(key, key + " is about the FP8 all-gather's scales, but float8.enable_fsdp_float8_all_gather is false");
    if (!c.float8.precompute_float8_dynamic_scale_for_fsdp)
      fail(key, key + " = false is not offered: the FP8 all-gather always computes the whole model's scales in one "
                      "collective a step, the same scales as weight by weight (leave it out, or true)");
  }
  if (c.float8.enable_float8_linear && !c.float8.emulate) {
    if (c.runtime.device == "cpu")
      fail("float8.enable_float8_linear", "float8.enable_float8_linear needs a GPU with FP8 tensor cores, but "
                                          "runtime.device = \"cpu\" (float8.emulate = true computes the same values "
                                          "in fp32 on any device, for tests)");
    if (c.runtime.compute_dtype == "float32")
      fail("float8.enable_float8_linear", "float8.enable_float8_linear writes its products in bfloat16, but "
                                          "runtime.compute_dtype = \"float32\" (use bfloat16 or auto, or "
                                          "float8.emulate = true)");
  }

  // DiLoCo: on when inner_steps > 0; its other keys mean nothing otherwise.
  non_negative("diloco.inner_steps", c.diloco.inner_steps);
  if (c.diloco.inner_steps == 0) {
    for (const auto& [key, where] : c.origins)
      if (key.rfind("diloco.", 0) == 0 && key != "diloco.inner_steps")
        fail(key, key + " is set but diloco.inner_steps is 0 (DiLoCo off): set inner_steps to turn it on");
  } else {
    positive("diloco.outer_lr", c.diloco.outer_lr);
    if (!(c.diloco.outer_momentum >= 0 && c.diloco.outer_momentum < 1))
      fail("diloco.outer_momentum", "diloco.outer_momentum must be in [0, 1), got " + show(c.diloco.outer_momentum));
    positive("diloco.fragments", c.diloco.fragments);
    if (c.diloco.fragments > a.n_layers)
      fail("diloco.fragments", "diloco.fragments (" + show(c.diloco.fragments) + ") must not exceed the model's " +
                                   show(a.n_layers) + " blocks");
    if (c.diloco.inner_steps % c.diloco.fragments != 0)
      fail("diloco.fragments", "diloco.fragments (" + show(c.diloco.fragments) + ") must divide diloco.inner_steps (" +
                                   show(c.diloco.inner_steps) + "): the fragments' exchanges are spread evenly");
    if (!(c.diloco.fragment_delay >= 0 && c.diloco.fragment_delay < c.diloco.inner_steps))
      fail("diloco.fragment_delay", "diloco.fragment_delay must be in [0, diloco.inner_steps = " +
                                        show(c.diloco.inner_steps) + "), got " + show(c.diloco.fragment_delay));
    if (!c.diloco.peers.empty()) {
      const std::string& p = c.diloco.peers;
      const size_t colon = p.rfind(':');
      const std::string port = colon == std::string::npos ? "" : p.substr(colon + 1);
      if (colon == 0 || port.empty() || port.find_first_not_of("0123456789") != std::string::npos ||
          port.size() > 5 || std::stol(port) < 1 || std::stol(port) > 65535)
        fail("diloco.peers", "diloco.peers must be \"host:port\" (where diloco_peers serves), got \"" + p + "\"");
      if (c.parallel.dp_replicate != 1)
        fail("parallel.dp_replicate", "with diloco.peers each launch is one replica: parallel.dp_replicate must be 1, "
                                      "got " + show(c.parallel.dp_replicate) + " (start one launch per replica)");
      if (c.diloco.fragments != 1)
        fail("diloco.fragments", "elastic replicas (diloco.peers) take whole outer steps: diloco.fragments must be 1");
      // A step still in flight would outlive its round: a resume, a joiner or a lost peer would
      // find the replicas' outer state and round numbers apart.
      if (c.diloco.fragment_delay != 0)
        fail("diloco.fragment_delay", "elastic replicas (diloco.peers) apply each outer step in its own round: "
                                      "diloco.fragment_delay must be 0");
    } else {
      for (const char* key : {"diloco.join", "diloco.join_state"})
        if (c.origins.count(key)) fail(key, std::string(key) + " is for elastic replicas: set diloco.peers");
    }
  }
}

int64_t resolved_dp_shard(const Config& c, int64_t world_size) {
  return c.parallel.dp_shard == -1 ? world_size / (c.parallel.tp * c.parallel.cp * c.parallel.dp_replicate)
                                   : c.parallel.dp_shard;
}

int64_t data_parallel_size(const Config& c, int64_t world_size) {
  return data_parallel_size(world_size, c.parallel.tp, c.parallel.cp);
}

int64_t grad_accum_steps(const Config& c, int64_t world_size) {
  // validate() checked that the batch divides.
  return c.optim.batch_size / (data_parallel_size(c, world_size) * c.train.micro_bs);
}

std::vector<double> parse_ratio(const std::string& ratio, size_t expected_count) {
  std::vector<double> out;
  size_t start = 0;
  while (start <= ratio.size()) {
    size_t colon = ratio.find(':', start);
    if (colon == std::string::npos) colon = ratio.size();
    const std::string part = ratio.substr(start, colon - start);
    char* end = nullptr;
    const double w = std::strtod(part.c_str(), &end);
    if (part.empty() || *end != '\0' || !(w > 0) || !std::isfinite(w))
      throw std::invalid_argument("dataset_ratio \"" + ratio + "\": '" + part + "' is not a positive number");
    out.push_back(w);
    start = colon + 1;
  }
  if (out.size() != expected_count)
    throw std::invalid_argument("dataset_ratio \"" + ratio + "\" has " + std::to_string(out.size()) +
                                " parts for " + std::to_string(expected_count) + " datasets");
  // The mix holds each dataset's share of every 4096 rows (data/loader.h's MixedSource): a share
  // must come to 2 rows of them at least.
  double total = 0;
  for (double w : out) total += w;
  for (double w : out)
    if (w / total < 2.0 / 4096)
      throw std::invalid_argument("dataset_ratio \"" + ratio + "\": a part below 1/2048 of the total (" + show(w) +
                                  " of " + show(total) + ")");
  return out;
}

}  // namespace zb
