// Throughput, peak FLOPs and MFU.
#include <gtest/gtest.h>

#include "model/model_args.h"
#include "train/metrics.h"
#include "util/device.h"

#include <c10/core/Device.h>

#include <stdexcept>

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
