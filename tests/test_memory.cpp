// The memory estimate's bookkeeping, checked against sizes computed here independently (the
// measured comparison with real runs is tests' memory.estimate_matches_measured and
// scripts/perf/memory_check.sh).
#include <gtest/gtest.h>

#include <string>

#include "config/config.h"
#include "model/model_args.h"
#include "config/model_config.h"
#include "config/resolved_run.h"
#include "plan/memory_estimate.h"

using namespace zb;

namespace {

const std::string kConfigs = std::string(ZB_SOURCE_DIR) + "/configs/";

// The estimate for `world` GPUs (their kernels, bf16), gradients reduced on every micro-batch or
// summed whole.
MemoryEstimate on_gpus(Config c, int64_t world, bool reduce_every_micro_batch) {
  c.train.reduce_every_micro_batch = reduce_every_micro_batch ? "true" : "false";
  const ResolvedRun run = resolve_run(c, world, EngineKind::Sharded, c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(run.compute_dtype, at::kBFloat16);
  return estimate_step_memory(c, run);
}

int64_t part(const MemoryEstimate& e, const std::string& what) {
  for (const auto& p : e.at_peak)
    if (p.what == what) return p.bytes;
  return 0;
}

int64_t num_params(const ModelArgs& a) {
  int64_t n = 0;
  for (const ParamSpec& p : param_specs(a)) n += p.numel();
  return n;
}

}  // namespace

// 7B on 8 ranks (32 micro-batches each): the unsharded fp32 sums of every parameter's gradient
// are live through the accumulation (4 bytes x 6.7 B parameters); reducing every micro-batch
// removes them.
TEST(MemoryEstimate, GradientSumsAreWholeUnlessReducedEveryMicroBatch) {
  Config c = load_config_file(kConfigs + "7B/H100.toml");
  const int64_t P = num_params(resolve_model_args(c));
  const MemoryEstimate whole = on_gpus(c, 8, false);
  const MemoryEstimate sharded = on_gpus(c, 8, true);
  EXPECT_EQ(part(whole, "gradient accumulators (fp32)"), 4 * P);
  EXPECT_FALSE(whole.reduce_every_micro_batch);
  EXPECT_EQ(part(sharded, "gradient accumulators (fp32)"), 0);
  EXPECT_TRUE(sharded.reduce_every_micro_batch);
  EXPECT_LT(sharded.peak, whole.peak - 4 * P + 4 * P / 8 + (1ll << 30));
  // One micro-batch per rank: nothing to accumulate either way.
  c.optim.batch_size = 8 * c.train.micro_bs;
  EXPECT_FALSE(on_gpus(c, 8, true).reduce_every_micro_batch);
}

// Parameter shards and optimizer state are a world-size-th of the model (rows padded to whole
// blocks: within a row per matrix), fp32; AdamW keeps two moments per element.
TEST(MemoryEstimate, ShardsAndAdamStateAreAWorldSizeth) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  c.optim.optim.type = "adamw";
  const ModelArgs a = resolve_model_args(c);
  const int64_t P = num_params(a);
  int64_t one_row_each = 0;  // rank 0 holds at most one row more of each tensor than P / W
  for (const ParamSpec& p : param_specs(a)) one_row_each += p.numel() / p.shape[0];
  for (int64_t W : {1, 4, 8}) {
    const MemoryEstimate e = on_gpus(c, W, false);
    const double shards = static_cast<double>(part(e, "parameter shards (fp32)"));
    EXPECT_NEAR(shards, 4.0 * P / W, 4.0 * one_row_each) << W;
    EXPECT_EQ(part(e, "optimizer state (fp32)"), 2 * part(e, "parameter shards (fp32)")) << W;
  }
}

// Activation checkpointing keeps only each checkpointed block's output; every other block keeps
// what its operations save. The peak of a checkpointed run is lower.
TEST(MemoryEstimate, CheckpointedBlocksKeepOnlyTheirOutput) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  const ModelArgs a = resolve_model_args(c);
  const int64_t N = c.train.micro_bs * c.data.seq_length, bf16 = 2;
  c.train.ac_ckpt = 0;
  const MemoryEstimate off = on_gpus(c, 8, false);
  c.train.ac_ckpt = 1;
  const MemoryEstimate every = on_gpus(c, 8, false);
  c.train.ac_ckpt = 2;
  const MemoryEstimate half = on_gpus(c, 8, false);
  EXPECT_EQ(every.activations_per_micro_batch, a.n_layers * bf16 * a.dim * N);
  EXPECT_EQ(off.activations_per_micro_batch, off.activations_without_checkpointing);
  const int64_t per_block = off.activations_per_micro_batch / a.n_layers;
  EXPECT_EQ(half.activations_per_micro_batch, a.n_layers / 2 * (per_block + bf16 * a.dim * N));
  EXPECT_LT(every.peak, half.peak);
  EXPECT_LT(half.peak, off.peak);
}

// SwiGLU's gate as one node (runtime.fused_kernels, the default) keeps w1's and w3's outputs but
// not SiLU's output as well: one [tokens, hidden] tensor less per block than ATen's nodes (the
// measured side: memory.estimate_matches_measured, and BENCHMARKS.md's table with it off).
TEST(MemoryEstimate, TheFusedGateKeepsOneHiddenTensorLessPerBlock) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  const ModelArgs a = resolve_model_args(c);
  const int64_t N = c.train.micro_bs * c.data.seq_length, bf16 = 2;
  const MemoryEstimate fused = on_gpus(c, 8, false);
  c.runtime.fused_kernels = false;
  const MemoryEstimate aten = on_gpus(c, 8, false);
  EXPECT_EQ(aten.activations_per_micro_batch - fused.activations_per_micro_batch,
            a.n_layers * bf16 * a.ffn_hidden() * N);
  EXPECT_LT(fused.peak, aten.peak);
}

// Tensor parallelism on 8 ranks (TP t x FSDP 8/t, the 7B preset, whose 32 key/value heads divide
// into every degree): each rank still holds an eighth of the parameters and of Adam's state, now
// its TP slices sharded over fewer ranks. Of a block's saved activations only the two gathered
// sequences (the inputs of the column-parallel products, [N, D] each) stay whole; everything else,
// the residual stream's positions and the heads' and FFN columns' products, is a t-th: so t times
// the activations at degree t exceed those without TP by exactly (t - 1) whole [N, D] pairs per block.
TEST(MemoryEstimate, TensorParallelismSplitsAllButTheGatheredSequences) {
  Config c = load_config_file(kConfigs + "7B/H100.toml");
  c.optim.optim.type = "adamw";
  const ModelArgs a = resolve_model_args(c);
  const int64_t P = num_params(a), N = c.train.micro_bs * c.data.seq_length, bf16 = 2;
  int64_t one_row_each = 0;
  for (const ParamSpec& p : param_specs(a)) one_row_each += p.numel() / p.shape[0];
  c.train.ac_ckpt = 0;
  const MemoryEstimate none = on_gpus(c, 8, true);
  int64_t last_peak = none.peak;
  for (int64_t t : {2, 4, 8}) {
    c.parallel.tp = t;
    c.train.ac_ckpt = 0;
    const MemoryEstimate e = on_gpus(c, 8, true);
    EXPECT_NEAR(static_cast<double>(part(e, "parameter shards (fp32)")), 4.0 * P / 8, 4.0 * one_row_each) << t;
    EXPECT_EQ(part(e, "optimizer state (fp32)"), 2 * part(e, "parameter shards (fp32)")) << t;
    EXPECT_EQ(t * e.activations_per_micro_batch - none.activations_per_micro_batch,
              a.n_layers * (t - 1) * 2 * bf16 * a.dim * N)
        << t;
    EXPECT_LT(e.peak, last_peak) << t;  // what TP is for: less of a block's activations per rank
    last_peak = e.peak;
    // Checkpointed, a block keeps its output: this rank's positions only.
    c.train.ac_ckpt = 1;
    EXPECT_EQ(on_gpus(c, 8, true).activations_per_micro_batch,
              a.n_layers * bf16 * a.dim * N / t)
        << t;
  }
}

TEST(MemoryEstimate, DeviceMemoryFromTheConfigElseTheGpusName) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  constexpr int64_t MiB = 1 << 20;
  EXPECT_EQ(device_memory_bytes(c, "NVIDIA H100 80GB HBM3"), 81559 * MiB);
  EXPECT_EQ(device_memory_bytes(c, "NVIDIA H200"), 143771 * MiB);
  EXPECT_EQ(device_memory_bytes(c, "cpu"), 0);
  c.runtime.device_memory_gb = 40;
  EXPECT_EQ(device_memory_bytes(c, "NVIDIA H100 80GB HBM3"), 40'000'000'000);
  EXPECT_EQ(usable_memory_bytes(40'000'000'000), 36'000'000'000);
  EXPECT_EQ(planned_budget(c, "NVIDIA H100 80GB HBM3").usable, 36'000'000'000);
  // On the GPU: what is free once the communicators exist, less the reserve (5%, at least 2 GiB).
  constexpr int64_t GiB = int64_t{1} << 30;
  EXPECT_EQ(measured_budget(70 * GiB, 80 * GiB).usable, 66 * GiB);
  EXPECT_EQ(measured_budget(20 * GiB, 24 * GiB).usable, 18 * GiB);
  EXPECT_EQ(measured_budget(GiB, 24 * GiB).usable, 0);
}
