// The run's policy (plan/run_policy.h) on its own: the memory verdict that resolves
// train.reduce_every_micro_batch and stops runs that will not fit, and what a step that was not
// applied does to the run.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "config/config.h"
#include "plan/run_policy.h"

using namespace zb;

namespace {
const std::string kConfigs = std::string(ZB_SOURCE_DIR) + "/configs/";
const c10::Device kGpu(c10::kCUDA, 0);  // planned for, as a dry run does: nothing runs on it
}  // namespace

// The 7B preset on 8 H100s of 80 GB (planned: 90% usable) fits only when its gradients are
// reduced on every micro-batch (the whole fp32 sums of 6.7 B parameters would not fit beside the
// rest): "auto" turns that on, "false" does not fit, "true" fits without "auto" deciding.
TEST(RunPolicy, AutoReducesEveryMicroBatchOnlyWhereTheRunFitsOnlySo) {
  Config c = load_config_file(kConfigs + "7B/H100.toml");
  c.runtime.device_memory_gb = 80;
  const MemoryBudget budget = planned_budget(c, "");
  ASSERT_GT(budget.usable, 0);
  c.train.reduce_every_micro_batch = "auto";
  const MemoryVerdict automatic = judge_memory(c, 8, kGpu, budget);
  EXPECT_TRUE(automatic.fits);
  EXPECT_TRUE(automatic.reduce_every_micro_batch);
  EXPECT_TRUE(automatic.auto_turned_on);
  EXPECT_LE(automatic.estimate.peak, budget.usable);

  c.train.reduce_every_micro_batch = "false";
  const MemoryVerdict whole = judge_memory(c, 8, kGpu, budget);
  EXPECT_FALSE(whole.fits);
  EXPECT_FALSE(whole.reduce_every_micro_batch);
  EXPECT_GT(whole.estimate.peak, budget.usable);
  EXPECT_NE(whole.table.back().find("DOES NOT FIT"), std::string::npos) << whole.table.back();

  c.train.reduce_every_micro_batch = "true";
  const MemoryVerdict sharded = judge_memory(c, 8, kGpu, budget);
  EXPECT_TRUE(sharded.fits && sharded.reduce_every_micro_batch);
  EXPECT_FALSE(sharded.auto_turned_on);
  EXPECT_EQ(sharded.estimate.peak, automatic.estimate.peak);
}

// A run that fits as it is keeps "auto" off; with no device memory known (the CPU) nothing is
// checked and every run fits.
TEST(RunPolicy, AutoStaysOffWhereTheRunFitsAndTheCpuIsNotChecked) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  c.runtime.device_memory_gb = 80;
  const MemoryVerdict v = judge_memory(c, 8, kGpu, planned_budget(c, ""));
  EXPECT_TRUE(v.fits);
  EXPECT_FALSE(v.reduce_every_micro_batch || v.auto_turned_on);
  Config huge = load_config_file(kConfigs + "7B/H100.toml");
  const MemoryVerdict cpu = judge_memory(huge, 1, c10::Device(c10::kCPU), MemoryBudget{});
  EXPECT_TRUE(cpu.fits);
  EXPECT_FALSE(cpu.reduce_every_micro_batch);
}

// train.keep_unsharded = "auto": the 1B preset on one GPU of 80 GB keeps its casts (they fit),
// its peak higher by at most the whole model's bf16 cast; on 8 GPUs (8 ranks a shard group) they
// do not apply; where only the run without them fits, or on the CPU, it stays off.
TEST(RunPolicy, AutoKeepsTheCastsOnOneGpuWhereTheRunFitsWithThem) {
  Config c = load_config_file(kConfigs + "1B/H100.toml");
  c.runtime.device_memory_gb = 80;
  const MemoryVerdict kept = judge_memory(c, 1, kGpu, planned_budget(c, ""));
  EXPECT_TRUE(kept.fits && kept.keep_unsharded && kept.keep_unsharded_auto_on && kept.estimate.keep_unsharded);
  c.train.keep_unsharded = "false";
  const MemoryVerdict freed = judge_memory(c, 1, kGpu, planned_budget(c, ""));
  EXPECT_FALSE(freed.keep_unsharded || freed.keep_unsharded_auto_on);
  const int64_t cast = 2 * 1'055'991'808;  // every parameter in bf16
  EXPECT_GT(kept.estimate.peak, freed.estimate.peak);
  EXPECT_LE(kept.estimate.peak, freed.estimate.peak + cast);
  c.train.keep_unsharded = "auto";
  EXPECT_FALSE(judge_memory(c, 8, kGpu, planned_budget(c, "")).keep_unsharded);
  // A device between the two peaks (usable: 90% of it): the run fits only with the casts freed.
  c.runtime.device_memory_gb = (freed.estimate.peak + kept.estimate.peak) / 2.0 / 0.9 / 1e9;
  const MemoryVerdict between = judge_memory(c, 1, kGpu, planned_budget(c, ""));
  EXPECT_TRUE(between.fits);
  EXPECT_FALSE(between.keep_unsharded || between.keep_unsharded_auto_on);
  EXPECT_FALSE(judge_memory(c, 1, c10::Device(c10::kCPU), MemoryBudget{}).keep_unsharded);
  c.train.keep_unsharded = "true";  // asked for: in effect wherever it applies
  EXPECT_TRUE(judge_memory(c, 1, c10::Device(c10::kCPU), MemoryBudget{}).keep_unsharded);
}

namespace {
StepStats nonfinite_step(int64_t step, int64_t in_a_row, int64_t total) {
  StepStats s;
  s.step = step;
  s.loss = 3.25;
  s.grad_norm = std::numeric_limits<double>::quiet_NaN();
  s.nonfinite = "gradient norm";
  s.skipped_in_a_row = in_a_row;
  s.skipped_total = total;
  return s;
}
}  // namespace

TEST(RunPolicy, NonfiniteStepsStopOrAreSkippedUpToTheLimit) {
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  c.train.nonfinite = "stop";
  NonfiniteDecision d = decide_nonfinite(nonfinite_step(7, 1, 1), c, "ck/step_00000004");
  EXPECT_TRUE(d.stop);
  EXPECT_EQ(d.message,
            "step 7: the gradient norm is not finite (loss 3.25, gradient norm nan), the step was not applied; "
            "stopping (train.nonfinite = \"stop\"); nothing saved; the last good checkpoint is ck/step_00000004");

  c.train.nonfinite = "skip";
  c.train.max_skipped_steps = 2;
  d = decide_nonfinite(nonfinite_step(7, 1, 3), c, "");
  EXPECT_FALSE(d.stop);
  EXPECT_EQ(d.message,
            "step 7: the gradient norm is not finite (loss 3.25, gradient norm nan), the step was not applied: "
            "skipped (1 in a row, 3 in all; train.max_skipped_steps = 2 in a row stops the run)");
  d = decide_nonfinite(nonfinite_step(8, 2, 4), c, "");
  EXPECT_TRUE(d.stop);
  EXPECT_NE(d.message.find("; 2 such steps in a row (train.max_skipped_steps); nothing saved; "
                           "the last good checkpoint is none (no checkpoint yet)"),
            std::string::npos)
      << d.message;
}

// train_hsdp's layout: a shard group per node from the launcher's local size, the config's keys
// winning where set; one node, or a dry run without the keys, is refused with what to do.
TEST(RunPolicy, HybridShardingTakesOneShardGroupPerNode) {
  World world;
  world.size = 16;
  world.local_size = 8;
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  shard_by_node(c, world, /*dry_run=*/false);
  EXPECT_EQ(c.parallel.dp_shard, 8);
  EXPECT_EQ(c.parallel.dp_replicate, 2);

  Config given = load_config_file(kConfigs + "debug/normal.toml");
  given.parallel.dp_shard = 4;
  given.parallel.dp_replicate = 4;
  shard_by_node(given, world, /*dry_run=*/true);
  EXPECT_EQ(given.parallel.dp_shard, 4);
  EXPECT_EQ(given.parallel.dp_replicate, 4);

  Config one_node = load_config_file(kConfigs + "debug/normal.toml");
  world.local_size = 16;
  EXPECT_THROW(
      {
        try {
          shard_by_node(one_node, world, false);
        } catch (const ConfigError& e) {
          EXPECT_NE(std::string(e.what()).find("use train_fsdp"), std::string::npos) << e.what();
          throw;
        }
      },
      ConfigError);
  EXPECT_THROW(shard_by_node(one_node, world, /*dry_run=*/true), ConfigError);
}

// The memory a run may plan on: nothing to check on the CPU; runtime.device_memory_gb, where set,
// is the device's memory and 90% of it usable.
TEST(RunPolicy, MemoryBudgetFromTheDeviceOrTheConfig) {
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  EXPECT_EQ(memory_budget(c, c10::Device(c10::kCPU), false).device_bytes, 0);
  c.runtime.device_memory_gb = 10;
  const MemoryBudget b = memory_budget(c, kGpu, /*dry_run=*/true);
  EXPECT_EQ(b.device_bytes, 10'000'000'000);
  EXPECT_EQ(b.usable, 9'000'000'000);
}

// What other tools read: the resolved run names what "auto" became here, and the plan of a run
// resolves "auto" for reducing every micro-batch as the memory verdict does.
TEST(RunPolicy, ResolvedRunAndPlanSayWhatAutoBecame) {
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  c.runtime.device = "cpu";
  const nlohmann::json run = resolved_run(c);
  EXPECT_EQ(run.at("resolved_device"), "cpu");
  EXPECT_EQ(run.at("resolved_compute_dtype"), "float32");  // auto on the CPU
  EXPECT_EQ(run.at("resolved_ns_dtype"), "float32");
  EXPECT_EQ(run.at("num_params"), 2229504);

  Config big = load_config_file(kConfigs + "7B/H100.toml");
  big.runtime.device = "cpu";  // a CPU's memory is not checked, so "auto" stays off
  EXPECT_FALSE(plan_run(big, 8, 0, EngineKind::Sharded).reduce_every_micro_batch);
  // Planned for the GPU the config names, from this machine without one: bf16, and "auto" on
  // where the run fits only so (as a launch there would decide).
  big.runtime.device = "cuda";
  big.runtime.device_memory_gb = 80;
  EXPECT_EQ(resolved_run(big).at("resolved_compute_dtype"), "bfloat16");
  EXPECT_TRUE(plan_run(big, 8, 0, EngineKind::Sharded).reduce_every_micro_batch);
  EXPECT_FALSE(plan_run(big, 256, 0, EngineKind::Sharded).reduce_every_micro_batch);  // fits with 256 shards
  big.runtime.device = "cpu";
  big.train.reduce_every_micro_batch = "true";
  EXPECT_TRUE(plan_run(big, 8, 0, EngineKind::Sharded).reduce_every_micro_batch);
}

// The plan of a run carries the verdict a launch would reach (what --print-plan reports and the
// scale model's peak column reads): the 70B preset fits no single node of 80 GB GPUs, fits on 64
// with every micro-batch reduced, and the verdict is the memory check's own.
TEST(RunPolicy, PlanReportsTheMemoryVerdictOfTheLaunch) {
  Config c = load_config_file(kConfigs + "70B/H100.toml");
  c.runtime.device = "cuda";
  c.runtime.device_memory_gb = 80;
  MemoryVerdict one_node, eight_nodes;
  plan_run(c, 8, 0, EngineKind::Sharded, &one_node);
  const StepPlan plan = plan_run(c, 64, 0, EngineKind::Sharded, &eight_nodes);
  EXPECT_FALSE(one_node.fits);
  EXPECT_GT(one_node.estimate.peak, int64_t{12} * 68'976'648'192 / 8);  // fp32 masters, gradients, momentum
  // Fitting neither way, "auto" takes the smaller: sharded sums (what --force would train with).
  EXPECT_TRUE(one_node.reduce_every_micro_batch);
  c.train.reduce_every_micro_batch = "false";
  MemoryVerdict whole_sums;
  plan_run(c, 8, 0, EngineKind::Sharded, &whole_sums);
  EXPECT_GT(whole_sums.estimate.peak, one_node.estimate.peak);
  c.train.reduce_every_micro_batch = "auto";
  EXPECT_TRUE(eight_nodes.fits);
  EXPECT_TRUE(plan.reduce_every_micro_batch);
  EXPECT_TRUE(eight_nodes.reduce_every_micro_batch);
  const c10::Device gpu(c10::kCUDA);
  const MemoryVerdict direct = judge_memory(c, 64, gpu, memory_budget(c, gpu, /*dry_run=*/true));
  EXPECT_EQ(eight_nodes.estimate.peak, direct.estimate.peak);
  EXPECT_EQ(eight_nodes.budget.usable, direct.budget.usable);
  EXPECT_LT(eight_nodes.estimate.peak, eight_nodes.budget.usable);
  // Tensor parallelism inside each node, FSDP across: TP 8 x FSDP 8 fits too, with less saved per micro-batch.
  c.parallel.tp = 8;
  MemoryVerdict tp8;
  plan_run(c, 64, 0, EngineKind::Sharded, &tp8);
  EXPECT_TRUE(tp8.fits);
  EXPECT_LT(tp8.estimate.activations_per_micro_batch, eight_nodes.estimate.activations_per_micro_batch);
  // train_ddp's plans leave the verdict alone (the estimate is the sharding engine's).
  MemoryVerdict untouched;
  c.parallel.tp = 1;
  plan_run(c, 64, 0, EngineKind::Replicated, &untouched);
  EXPECT_EQ(untouched.estimate.peak, 0);
}

// A TP group split by the launcher's nodes is said at start-up; one within a node is not.
TEST(RunPolicy, WarnsWhereATensorParallelGroupSpansNodes) {
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  World two_nodes;
  two_nodes.size = 8;
  two_nodes.local_size = 4;
  c.parallel.tp = 8;
  const std::string w = tp_across_nodes_warning(c, two_nodes);
  EXPECT_NE(w.find("parallel.tp = 8 spans nodes of 4 rank(s)"), std::string::npos) << w;
  for (int64_t tp : {1, 2, 4}) {
    c.parallel.tp = tp;
    EXPECT_EQ(tp_across_nodes_warning(c, two_nodes), "") << tp;
  }
  World one_node;
  one_node.size = one_node.local_size = 8;
  c.parallel.tp = 8;
  EXPECT_EQ(tp_across_nodes_warning(c, one_node), "");
}
