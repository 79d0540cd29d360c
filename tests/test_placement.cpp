// Ranks that share a GPU (issue: every layout on one GPU): where each rank runs, which backend the
// collectives take (dist/placement.h), the memory each rank may plan on, and what
// runtime.deterministic sets. The collectives through host memory themselves: tests/test_comm.cpp.
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include "config/config.h"
#include "dist/placement.h"
#include "launch/launch.h"
#include "plan/run_policy.h"
#include "util/device.h"

using namespace zb;

namespace {
const c10::Device kCpu(c10::kCPU);
const c10::Device kGpu(c10::kCUDA, 0);  // chosen for, never touched: nothing runs on it
const std::string kConfigs = std::string(ZB_SOURCE_DIR) + "/configs/";

Placement placed(std::vector<RankPlace> ranks, int64_t rank = 0) { return {std::move(ranks), rank}; }

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// A GPU is one PCI address on one host: two ranks on one are sharing it; the same address on
// two hosts, or each rank's own GPU seen as cuda:0 (one visible GPU per rank), is not sharing.
TEST(Placement, RanksShareAGpuOnlyWhereHostAndAddressAreTheSame) {
  const Placement one_gpu = placed({{"a", "0000:18:00.0"}, {"a", "0000:18:00.0"}, {"a", "0000:18:00.0"}}, 1);
  EXPECT_EQ(one_gpu.sharing_mine(), 3);
  EXPECT_EQ(one_gpu.most_sharing(), 3);
  const Placement own = placed({{"a", "0000:18:00.0"}, {"a", "0000:2a:00.0"}, {"b", "0000:18:00.0"}});
  EXPECT_EQ(own.sharing_mine(), 1);
  EXPECT_EQ(own.most_sharing(), 1);
  // Four ranks on two GPUs, as LOCAL_RANK % 2 places them: two on each.
  const Placement two_each = placed({{"a", "0000:18:00.0"}, {"a", "0000:2a:00.0"}, {"a", "0000:18:00.0"},
                                     {"a", "0000:2a:00.0"}}, 3);
  EXPECT_EQ(two_each.sharing_mine(), 2);
  // CPU ranks share cores, not a device.
  EXPECT_EQ(placed({{"a", "cpu"}, {"a", "cpu"}}).most_sharing(), 1);
}

// Ranks share the GPUs of their machine in turn.
TEST(Placement, LocalRanksTakeTheGpusInTurn) {
  EXPECT_EQ(gpu_for_local_rank(0, 1), 0);
  EXPECT_EQ(gpu_for_local_rank(3, 1), 0);
  EXPECT_EQ(gpu_for_local_rank(3, 2), 1);
  EXPECT_EQ(gpu_for_local_rank(5, 8), 5);
}

TEST(Placement, AutoTakesNcclOnlyWhereEveryRankHasItsOwnGpu) {
  const Placement own = placed({{"a", "0000:18:00.0"}, {"a", "0000:2a:00.0"}});
  const Placement shared = placed({{"a", "0000:18:00.0"}, {"a", "0000:18:00.0"}});
  EXPECT_EQ(choose_backend("auto", kGpu, own).transport, Transport::Nccl);
  EXPECT_EQ(choose_backend("auto", kGpu, own).why, "");
  const BackendChoice auto_shared = choose_backend("auto", kGpu, shared);
  EXPECT_EQ(auto_shared.transport, Transport::GlooThroughHost);
  EXPECT_NE(auto_shared.why.find("2 ranks share the GPU 0000:18:00.0 on a"), std::string::npos) << auto_shared.why;
  // Asked for: Gloo on GPUs of their own too (through host memory); NCCL refused on a shared GPU.
  EXPECT_EQ(choose_backend("gloo", kGpu, own).transport, Transport::GlooThroughHost);
  EXPECT_EQ(choose_backend("nccl", kGpu, own).transport, Transport::Nccl);
  const std::string refused = message_of([&] { choose_backend("nccl", kGpu, shared); });
  EXPECT_NE(refused.find("NCCL takes one rank per GPU, but 2 ranks share the GPU 0000:18:00.0"), std::string::npos)
      << refused;
  // The CPU: Gloo, whatever "auto" or "gloo"; NCCL refused, by the config check before any rank starts.
  const Placement cpu = placed({{"a", "cpu"}, {"a", "cpu"}});
  EXPECT_EQ(choose_backend("auto", kCpu, cpu).transport, Transport::Gloo);
  EXPECT_EQ(choose_backend("gloo", kCpu, cpu).transport, Transport::Gloo);
  EXPECT_THROW(choose_backend("nccl", kCpu, cpu), std::invalid_argument);
  Config c = load_config_file(kConfigs + "debug/normal.toml");
  c.runtime.device = "cpu";
  c.runtime.backend = "nccl";
  EXPECT_NE(message_of([&] { validate(c, 2); }).find("runtime.backend"), std::string::npos);
  c.runtime.backend = "gloo";
  EXPECT_NO_THROW(validate(c, 2));
  apply_override(c, "runtime.backend", "mpi");
  EXPECT_NE(message_of([&] { validate(c, 2); }).find("runtime.backend = \"mpi\" is not one of auto | nccl | gloo"),
            std::string::npos);
}

// Ranks on one GPU divide what it offers; the verdict and the refusal say so.
TEST(Placement, RanksSharingAGpuDivideItsMemory) {
  Config c = load_config_file(kConfigs + "150M/H100.toml");
  c.runtime.device = "cuda";
  c.runtime.device_memory_gb = 80;
  const MemoryBudget whole = memory_budget(c, kGpu, /*dry_run=*/true);
  const MemoryBudget half = memory_budget(c, kGpu, /*dry_run=*/true, /*sharing=*/2);
  EXPECT_EQ(whole.usable, 72'000'000'000);
  EXPECT_EQ(half.usable, 36'000'000'000);
  EXPECT_EQ(half.device_bytes, whole.device_bytes);
  EXPECT_NE(half.how.find("divided between the 2 ranks that share this GPU"), std::string::npos) << half.how;
  EXPECT_EQ(share_budget(whole, 1).usable, whole.usable);
  EXPECT_EQ(share_budget(MemoryBudget{}, 4).usable, 0);  // the CPU: nothing to divide or check
  // The 150M preset's micro-batch of 64 fits one rank per H100 (about 30 GiB) but not four on one.
  EXPECT_TRUE(judge_memory(c, 4, kGpu, whole).fits);
  const MemoryBudget quarter = memory_budget(c, kGpu, /*dry_run=*/true, 4);
  EXPECT_FALSE(judge_memory(c, 4, kGpu, quarter).fits);
  const std::string refused = message_of([&] { check_memory(c, 4, kGpu, quarter, false, false); });
  EXPECT_NE(refused.find("in its share of the GPU (4 ranks share it"), std::string::npos) << refused;
}

// runtime.deterministic: ATen's switches as set, the cuBLAS workspace in the environment, and the
// run's record says what was set. Process-wide: restored after.
TEST(Placement, DeterministicModeSetsAtenAndCublasAndIsRecorded) {
  auto& ctx = at::globalContext();
  const bool algorithms = ctx.deterministicAlgorithms(), fill = ctx.deterministicFillUninitializedMemory();
  const bool cudnn = ctx.deterministicCuDNN(), benchmark = ctx.benchmarkCuDNN();
  const char* before = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  const std::optional<std::string> workspace = before ? std::optional<std::string>(before) : std::nullopt;
  ::unsetenv("CUBLAS_WORKSPACE_CONFIG");

  use_deterministic_algorithms();
  EXPECT_TRUE(ctx.deterministicAlgorithms());
  EXPECT_FALSE(ctx.deterministicAlgorithmsWarnOnly());  // warn-only leaves flash's backward nondeterministic
  EXPECT_TRUE(ctx.deterministicCuDNN());
  EXPECT_FALSE(ctx.benchmarkCuDNN());
  ASSERT_NE(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");

  ctx.setDeterministicAlgorithms(algorithms, false);
  ctx.setDeterministicFillUninitializedMemory(fill);
  ctx.setDeterministicCuDNN(cudnn);
  ctx.setBenchmarkCuDNN(benchmark);
  if (workspace) ::setenv("CUBLAS_WORKSPACE_CONFIG", workspace->c_str(), 1);
  else ::unsetenv("CUBLAS_WORKSPACE_CONFIG");

  Config c = load_config_file(kConfigs + "debug/normal.toml");
  c.runtime.device = "cpu";
  EXPECT_TRUE(resolved_run(c).at("resolved_deterministic").is_null());
  c.runtime.deterministic = true;
  const nlohmann::json run = resolved_run(c);
  EXPECT_EQ(run.at("runtime").at("deterministic"), true);
  EXPECT_EQ(run.at("resolved_deterministic").at("aten_deterministic_algorithms"), "true");
  EXPECT_EQ(run.at("resolved_deterministic").at("flash_attention_backward"), "deterministic");
}
