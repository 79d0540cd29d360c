// The pseudo-gradient codecs (dist/compression.h) against the same schemes computed value by
// value in float64, written out here independently of the vectorised ATen implementation.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "dist/compression.h"
#include "util/device.h"

using namespace zb;

namespace {

// The uint8 scheme in float64: per chunk, mean and standard deviation, each value's bucket in
// 256 over mean ± 4σ, and the bucket means.
struct Reference {
  std::vector<int> codes;
  std::vector<double> decoded;
  std::vector<double> fraction;  // each value's position in its buckets' span, times 256
};

Reference reference_uint8(const std::vector<double>& x, int64_t chunk) {
  Reference r;
  const int64_t n = static_cast<int64_t>(x.size());
  r.codes.resize(n);
  r.decoded.resize(n);
  r.fraction.resize(n);
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t end = std::min(n, start + chunk);
    double mean = 0, var = 0;
    for (int64_t i = start; i < end; ++i) mean += x[i];
    mean /= static_cast<double>(end - start);
    for (int64_t i = start; i < end; ++i) var += (x[i] - mean) * (x[i] - mean);
    const double sd = std::sqrt(var / static_cast<double>(end - start));
    std::vector<double> sum(256, 0.0);
    std::vector<int> hits(256, 0);
    for (int64_t i = start; i < end; ++i) {
      const double t = sd > 0 ? (x[i] - mean) / (8 * sd) + 0.5 : 0.5;
      r.fraction[i] = t * 256;
      const int c = static_cast<int>(std::min(255.0, std::max(0.0, std::floor(t * 256))));
      r.codes[i] = c;
      sum[c] += x[i];
      ++hits[c];
    }
    for (int64_t i = start; i < end; ++i) r.decoded[i] = sum[r.codes[i]] / hits[r.codes[i]];
  }
  return r;
}

}  // namespace

TEST(Compression, Uint8MatchesAFloat64QuantiserAndKeepsEachChunksSum) {
  at::manual_seed(3);
  // A pseudo-gradient-like mix: mostly small values, a few large ones (beyond ±4σ); 10,000 values
  // in chunks of 1,024, the last one (784 values) constant.
  at::Tensor x = at::randn({10000}, at::kDouble) * 1e-3;
  x.narrow(0, 100, 5).mul_(40);
  x.narrow(0, 9216, 784).fill_(2e-3);
  std::vector<double> xs(x.data_ptr<double>(), x.data_ptr<double>() + x.numel());
  const int64_t chunk = 1024;
  const Reference ref = reference_uint8(xs, chunk);
  const Uint8Code code = quantize_uint8(x.to(at::kFloat), chunk);
  ASSERT_EQ(code.codes.numel(), 10000);
  ASSERT_EQ(code.tables.sizes(), (std::vector<int64_t>{10, 256}));
  const at::Tensor decoded = dequantize_uint8(code).to(at::kDouble);
  const uint8_t* codes = code.codes.data_ptr<uint8_t>();
  int ties = 0;
  for (int64_t i = 0; i < 9216; ++i) {
    // fp32 and float64 may place a value exactly on a bucket's edge differently: such values
    // (within 1e-3 of a bucket's width of an edge) may differ by one bucket.
    const double f = ref.fraction[i];
    if (std::abs(f - std::round(f)) < 1e-3) {
      ++ties;
      EXPECT_LE(std::abs(codes[i] - ref.codes[i]), 1) << i;
      continue;
    }
    ASSERT_EQ(codes[i], ref.codes[i]) << "value " << i << " = " << xs[i];
    EXPECT_NEAR(decoded[i].item<double>(), ref.decoded[i], 1e-6 * std::abs(ref.decoded[i]) + 1e-12) << i;
  }
  EXPECT_LT(ties, 20);
  // Each chunk's sum is kept (bucket means), up to fp32 rounding.
  for (int64_t start = 0; start < x.numel(); start += chunk) {
    const int64_t n = std::min<int64_t>(chunk, x.numel() - start);
    const double want = x.narrow(0, start, n).sum().item<double>();
    const double got = decoded.narrow(0, start, n).sum().item<double>();
    EXPECT_NEAR(got, want, 1e-6 * x.narrow(0, start, n).abs().sum().item<double>()) << "chunk at " << start;
  }
  // Within ±4σ a value is off by at most one bucket's width; the constant stretch exactly.
  const double width = 8 * x.narrow(0, 0, chunk).std(/*unbiased=*/false).item<double>() / 256;
  for (int64_t i = 0; i < chunk; ++i)
    if (ref.codes[i] > 0 && ref.codes[i] < 255) EXPECT_LE(std::abs(decoded[i].item<double>() - xs[i]), width) << i;
  // A constant chunk comes back as it was (float64's σ is 0 there, fp32's a rounding's worth:
  // either way every bucket used holds only that value).
  for (int64_t i = 9216; i < 10000; ++i) EXPECT_NEAR(decoded[i].item<double>(), 2e-3, 1e-9) << i;
  EXPECT_EQ(compressed_bytes(Compression::UInt8, 10000, chunk), 10000 + 10 * 1024);
}

// A fragment of a large model is hundreds of millions of values a rank: the codec works through
// it a block of chunks at a time, so its temporaries stay within uint8_workspace_bytes however
// long the vector, and the result is the one of a single pass (per chunk, the same statistics).
TEST(Compression, Uint8WorksInBoundedBlocksWithTheResultOfOnePass) {
  count_cpu_tensor_memory();
  const c10::Device cpu(c10::kCPU);
  at::manual_seed(5);
  const int64_t chunk = 1024, group = 4 * chunk, n = 40 * chunk + 300;  // 10 blocks, then a short chunk
  const at::Tensor x = at::randn({n}) * 1e-3;
  const Uint8Code whole = quantize_uint8(x, chunk, /*group=*/n);

  reset_peak_memory(cpu);
  const int64_t before = peak_memory_bytes(cpu);
  const Uint8Code code = quantize_uint8(x, chunk, group);
  const int64_t results = n + 41 * kUint8Buckets * 4;  // codes and tables
  const int64_t temporaries = peak_memory_bytes(cpu) - before - results;
  EXPECT_LE(temporaries, uint8_workspace_bytes(n, chunk, group));
  EXPECT_LT(uint8_workspace_bytes(n, chunk, group), 8 * n);  // less than one float64 copy of the whole
  reset_peak_memory(cpu);
  const at::Tensor decoded = dequantize_uint8(code, group);
  EXPECT_LE(peak_memory_bytes(cpu) - before - results - 4 * n, uint8_workspace_bytes(n, chunk, group));

  ASSERT_EQ(code.tables.sizes(), whole.tables.sizes());
  // Blocks and one pass sum each chunk in their own order: a value on a bucket's edge may differ.
  const int64_t differ = code.codes.ne(whole.codes).sum().item<int64_t>();
  EXPECT_LE(differ, 5);
  EXPECT_LE((code.codes.to(at::kInt) - whole.codes.to(at::kInt)).abs().max().item<int>(), 1);
  if (differ == 0) EXPECT_TRUE(at::allclose(code.tables, whole.tables, 1e-6, 1e-12));
  EXPECT_TRUE(at::allclose(decoded, dequantize_uint8(whole), 1e-5, 1e-6));
}

TEST(Compression, Bf16RoundTripIsWithinItsRelativePrecision) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({4096}, at::kDouble) * 1e-2;
  const at::Tensor back = x.to(at::kFloat).to(at::kBFloat16).to(at::kDouble);
  // bf16 keeps 8 significant bits (7 stored): rounding to nearest is off by at most 2^-8 of the value
  // (relative), computed here against the float64 value.
  const at::Tensor rel = ((back - x).abs() / x.abs()).max();
  EXPECT_LE(rel.item<double>(), std::ldexp(1.0, -8) * (1 + 1e-6));
  EXPECT_EQ(compressed_bytes(Compression::BF16, 4096, 1024), 8192);
  EXPECT_EQ(parse_compression("uint8"), Compression::UInt8);
  EXPECT_THROW(parse_compression("int4"), std::invalid_argument);
}
