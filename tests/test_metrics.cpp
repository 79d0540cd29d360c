// Throughput, peak FLOPs and MFU.
#include <gtest/gtest.h>

#include "model/model_args.h"
#include "observe/metrics.h"
#include "observe/profiler.h"
#include "util/device.h"

#include <c10/core/Device.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace zb;

TEST(Metrics, ThroughputOverAWindow) {
  ThroughputMeter m(3);
  EXPECT_FALSE(m.tokens_per_second());
  m.record(100, 0.0);
  EXPECT_FALSE(m.tokens_per_second());
  m.record(100, 1.0);
  EXPECT_DOUBLE_EQ(*m.tokens_per_second(), 100.0);
  m.record(300, 2.0);
  EXPECT_DOUBLE_EQ(*m.tokens_per_second(), 200.0);  // (100 + 300) / 2 s
  m.record(300, 4.0);                               // window of 3: drops the first record
  EXPECT_DOUBLE_EQ(*m.tokens_per_second(), 200.0);  // (300 + 300) / 3 s
  EXPECT_DOUBLE_EQ(*m.seconds_per_step(), 1.5);
}

TEST(Metrics, PeakFlopsTable) {
  EXPECT_EQ(*peak_flops_for_device("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(*peak_flops_for_device("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(*peak_flops_for_device("NVIDIA H100 PCIe"), 756e12);
  EXPECT_EQ(*peak_flops_for_device("NVIDIA H100 NVL"), 835e12);
  EXPECT_EQ(*peak_flops_for_device("NVIDIA H200"), 989e12);  // ZeroBand fell through to 312e12
  EXPECT_FALSE(peak_flops_for_device("cpu"));
}

TEST(Metrics, MfuOfTheOneBPresetByHand) {
  // ZeroBand's 1B figure: 45% MFU on 8 H100 SXM at about 69.6k tokens/s per GPU.
  ModelArgs a = lookup_model_args("llama2", "1B");
  a.vocab_size = 32000;
  const double fpt = flops_per_token(a, 1024);  // 6,395,719,680
  const double tps = 8 * 69'600.0;
  const double by_hand = 100.0 * 6'395'719'680.0 * 556'800.0 / (989e12 * 8);
  EXPECT_DOUBLE_EQ(mfu_percent(fpt, tps, 989e12, 8), by_hand);
  EXPECT_NEAR(by_hand, 45.0, 0.05);
}

TEST(Metrics, DurationFormat) {
  EXPECT_EQ(format_duration(12.4), "12s");
  EXPECT_EQ(format_duration(245), "4m05s");
  EXPECT_EQ(format_duration(3723), "1h02m03s");
}

TEST(StepClock, MarksAreReadOnlyAfterTheHostSynchronised) {
  // The CPU clock keeps the GPU's rule (an event behind queued work is not ready until the host
  // waited for it): reading a mark made after the last synchronize() throws, as CUDA would.
  StepClock clock(c10::Device(c10::kCPU));
  const int a = clock.mark();
  const int b = clock.mark();
  EXPECT_THROW(clock.seconds(a, b), std::logic_error);
  clock.synchronize();
  EXPECT_GE(clock.seconds(a, b), 0.0);
  const int c = clock.mark();  // after the synchronisation: not complete yet
  EXPECT_THROW(clock.seconds(a, c), std::logic_error);
  clock.synchronize();
  EXPECT_GE(clock.seconds(a, c), clock.seconds(a, b));
  clock.clear();
  EXPECT_EQ(clock.marks(), 0);
}

// Kernel kinds from names as CUDA's libraries and ours spell them. Gradient norms (clipping) are
// reductions or other, not the layers' norms; a name in the parameter list does not count.
TEST(Profile, KernelKindsFromTheirNames) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)", "gemm"},
      {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas", "gemm"},
      {"nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"},
      {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)", "attention"},
      {"void zb::(anonymous namespace)::silu_mul_bf16(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, long)", "ours"},
      {"void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*)", "norm"},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)", "copy"},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)", "elementwise"},
      {"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, unsigned int, float, 4, 4>)", "reduce"},
      {"ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"},
      {"void at::native::(anonymous namespace)::CatArrayBatchedCopy<int, 4>(int*, int)", "copy"},
      {"void at::native::index_elementwise_kernel<128, 4>(long)", "elementwise"},
      {"void at::native::(anonymous namespace)::ag_kernel<(bool)1>(float*, int)", "other"},
      {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::LpNormFunctor<float, 2>>(TensorListMetadata<1>)", "other"},
      {"void at::native::reduce_kernel<512, 1>(Params<flash_like_name>)", "reduce"},
      {"void ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"},
  };
  for (const auto& [name, kind] : cases) EXPECT_EQ(kernel_kind(name), kind) << name;
}

// The profile's summary from events laid out by hand as a GPU trace would have them (two steps
// of 1 s): the GPU's busy time is the union of its kernels, compute and NCCL apart, so a
// collective beside compute is hidden and one alone is exposed; phases on the host and the GPU
// are summed by name without their detail.
TEST(Profile, SummaryReadsTheGpuTimelineFromItsKernels) {
  using Kind = ProfileEvent::Kind;
  const uint64_t ms = 1000000;
  std::vector<ProfileEvent> events;
  for (uint64_t step = 0; step < 2; ++step) {
    const uint64_t t = step * 1000 * ms;
    events.push_back({Kind::Phase, "zb.forward", t, t + 300 * ms});
    events.push_back({Kind::Phase, "zb.fsdp.all_gather layers.0", t, t + 10 * ms});
    events.push_back({Kind::Phase, "zb.fsdp.all_gather layers.1", t + 10 * ms, t + 30 * ms});
    events.push_back({Kind::Operator, "aten::mm", t + 50 * ms, t + 51 * ms});
    events.push_back({Kind::Operator, "aten::mm", t + 60 * ms, t + 61 * ms});
    events.push_back({Kind::DevicePhase, "zb.forward", t + 5 * ms, t + 505 * ms});
    // Compute 100-400 and 350-600 (overlapping streams: 500 ms covered), NCCL 550-650 (50 ms
    // beside compute, 50 exposed) and 800-850 (exposed): busy 100-650 and 800-850, 600 ms.
    events.push_back({Kind::Kernel, "sm90_xmma_gemm_bf16", t + 100 * ms, t + 400 * ms});
    events.push_back({Kind::Kernel, "void flash_fwd_kernel<Traits<(bool)1, 128>>(Params, int)", t + 350 * ms, t + 600 * ms});
    events.push_back({Kind::Kernel, "void at::native::(anonymous namespace)::ag_kernel<(bool)1>(float*, int)", t + 550 * ms, t + 555 * ms});
    events.push_back({Kind::Kernel, "ncclDevKernel_AllGather_RING_LL", t + 550 * ms, t + 650 * ms});
    events.push_back({Kind::Kernel, "ncclDevKernel_ReduceScatter_Sum_f32", t + 800 * ms, t + 850 * ms});
  }
  const ProfileSummary s = summarize_events(events, 7, 8, 2.0);
  EXPECT_DOUBLE_EQ(s.seconds_per_step, 1.0);
  EXPECT_EQ(s.kernels_per_step, 5);
  EXPECT_EQ(s.ops_per_step, 2);
  EXPECT_NEAR(s.gpu_busy_seconds_per_step, 0.600, 1e-12);
  EXPECT_NEAR(s.gpu_compute_seconds_per_step, 0.500, 1e-12);
  EXPECT_NEAR(s.gpu_nccl_seconds_per_step, 0.150, 1e-12);
  ASSERT_EQ(s.phases.size(), 2u);
  EXPECT_EQ(s.phases[0].name, "zb.forward");
  EXPECT_EQ(s.phases[1].name, "zb.fsdp.all_gather");
  EXPECT_NEAR(s.phases[1].seconds_per_step, 0.030, 1e-12);
  EXPECT_DOUBLE_EQ(s.phases[1].count_per_step, 2);
  ASSERT_EQ(s.device_phases.size(), 1u);
  EXPECT_NEAR(s.device_phases[0].seconds_per_step, 0.500, 1e-12);
  ASSERT_EQ(s.top_ops.size(), 1u);
  EXPECT_NEAR(s.top_ops[0].seconds_per_step, 0.002, 1e-12);
  // Kernels by their own time, the name without "void " and its argument list: gemm (300 ms a
  // step), flash (250), the all-gather (100), the reduce-scatter (50) and a 5 ms kernel in an
  // anonymous namespace (inside the busy time already).
  ASSERT_EQ(s.top_kernels.size(), 5u);
  EXPECT_EQ(s.top_kernels[0].name, "sm90_xmma_gemm_bf16");
  EXPECT_NEAR(s.top_kernels[0].seconds_per_step, 0.300, 1e-12);
  EXPECT_DOUBLE_EQ(s.top_kernels[0].count_per_step, 1);
  EXPECT_EQ(s.top_kernels[1].name, "flash_fwd_kernel<Traits<(bool)1, 128>>");
  EXPECT_NEAR(s.top_kernels[1].seconds_per_step, 0.250, 1e-12);
  EXPECT_EQ(s.top_kernels[3].name, "ncclDevKernel_ReduceScatter_Sum_f32");
  EXPECT_EQ(s.top_kernels[4].name, "at::native::(anonymous namespace)::ag_kernel<(bool)1>");
  const std::vector<std::string> lines = s.describe("traces");
  ASSERT_GE(lines.size(), 4u);
  EXPECT_NE(lines[1].find("busy 0.6000 of 1.0000 (60.0%), compute kernels 0.5000, NCCL kernels 0.1500 of which 0.1000 "
                          "exposed (no compute beside them), idle 0.4000"),
            std::string::npos)
      << lines[1];
  EXPECT_NE(lines[2].find("phases on the host (s/step): zb.forward 0.3000"), std::string::npos) << lines[2];
  EXPECT_NE(lines[3].find("phases on the GPU (s/step): zb.forward 0.5000"), std::string::npos) << lines[3];
  // By kind: gemm 0.3, attention 0.25, nccl 0.15, other (the anonymous-namespace kernel) 0.005.
  ASSERT_EQ(s.kernel_kinds.size(), 4u);
  EXPECT_EQ(s.kernel_kinds[0].name, "gemm");
  EXPECT_EQ(s.kernel_kinds[1].name, "attention");
  EXPECT_EQ(s.kernel_kinds[2].name, "nccl");
  EXPECT_NEAR(s.kernel_kinds[2].seconds_per_step, 0.150, 1e-12);
  EXPECT_DOUBLE_EQ(s.kernel_kinds[2].count_per_step, 2);
  EXPECT_EQ(s.kernel_kinds[3].name, "other");
  ASSERT_EQ(lines.size(), 7u);
  EXPECT_NE(lines[5].find("GPU kernels by kind (s/step): gemm 0.3000 (43%), attention 0.2500 (35%), nccl 0.1500 (21%), "
                          "other 0.0050 (1%)"),
            std::string::npos)
      << lines[5];
  EXPECT_NE(lines[6].find("longest GPU kernels (s/step): sm90_xmma_gemm_bf16 0.3000 (x1), flash_fwd_kernel<Traits<(bool)1, "
                          "128>> 0.2500 (x1)"),
            std::string::npos)
      << lines[6];
}
