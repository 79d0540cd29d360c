#include "dist/compression.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace zb {

Compression parse_compression(const std::string& name) {
  if (name == "none") return Compression::None;
  if (name == "bf16") return Compression::BF16;
  if (name == "uint8") return Compression::UInt8;
  throw std::invalid_argument("compression \"" + name + "\": one of none, bf16, uint8");
}

namespace {

// The whole chunks of a flat vector in blocks of at most `group` values, then the last, shorter
// chunk if there is one: visit(first chunk, block [chunks, values per chunk]) for each.
template <typename Visit>
void for_each_block(int64_t n, int64_t chunk, int64_t group, Visit&& visit) {
  const int64_t whole = n / chunk, per_block = std::max<int64_t>(1, group / chunk);
  for (int64_t c = 0; c < whole; c += per_block) visit(c, std::min(per_block, whole - c), chunk);
  if (n % chunk) visit(whole, 1, n % chunk);
}

}  // namespace

Uint8Code quantize_uint8(const at::Tensor& values, int64_t chunk, int64_t group) {
  TORCH_CHECK(chunk > 0, "quantize_uint8: chunk must be positive");
  const at::Tensor flat = values.reshape({-1});
  const int64_t n = flat.numel(), chunks = (n + chunk - 1) / chunk;
  Uint8Code code;
  code.codes = at::empty({n}, flat.options().dtype(at::kByte));
  code.tables = at::empty({chunks, kUint8Buckets}, flat.options().dtype(at::kFloat));
  code.chunk = chunk;
  // A block of whole chunks at a time, one chunk a row, so the float64 temporaries (about 40
  // bytes a value, uint8_workspace_bytes) never span more than `group` values.
  for_each_block(n, chunk, group, [&](int64_t first, int64_t rows, int64_t width) {
    // Statistics and bucket sums in float64: a bucket's mean then carries only the table's fp32
    // rounding, and each chunk's sum is kept to that (fp32 sums of a chunk would drift by ~n·2^-24).
    const at::Tensor x = flat.narrow(0, first * chunk, rows * width).view({rows, width}).to(at::kDouble);
    // Per chunk: mean and standard deviation over its own values.
    const at::Tensor mean = x.mean(1, /*keepdim=*/true);
    at::Tensor t = x - mean;
    const at::Tensor spread = (2 * kUint8Spread) * t.square().mean(1, /*keepdim=*/true).sqrt_();
    // Position in [mean - spread·σ, mean + spread·σ] as a fraction, then the bucket. A constant
    // chunk (σ = 0, every value its mean) puts every value in the middle bucket.
    t.div_(spread.clamp_min(std::numeric_limits<double>::min())).add_(0.5);
    const at::Tensor bucket = t.mul_(kUint8Buckets).floor_().clamp_(0, kUint8Buckets - 1).to(at::kLong);
    t = at::Tensor();
    // A code stands for the mean of its bucket's values.
    const auto sums_opts = x.options();
    const at::Tensor sums = at::zeros({rows, kUint8Buckets}, sums_opts).scatter_add_(1, bucket, x);
    const at::Tensor hits =
        at::zeros({rows, kUint8Buckets}, sums_opts).scatter_add_(1, bucket, at::ones({1, 1}, sums_opts).expand_as(x));
    code.codes.narrow(0, first * chunk, rows * width).view({rows, width}).copy_(bucket);
    code.tables.narrow(0, first, rows).copy_(sums.div_(hits.clamp_min_(1)));
  });
  return code;
}

at::Tensor dequantize_uint8(const Uint8Code& code, int64_t group) {
  const int64_t n = code.codes.numel();
  at::Tensor out = at::empty({n}, code.tables.options());
  for_each_block(n, code.chunk, group, [&](int64_t first, int64_t rows, int64_t width) {
    const at::Tensor codes = code.codes.narrow(0, first * code.chunk, rows * width).view({rows, width});
    out.narrow(0, first * code.chunk, rows * width)
        .view({rows, width})
        .copy_(code.tables.narrow(0, first, rows).gather(1, codes.to(at::kLong)));
  });
  return out;
}

int64_t uint8_workspace_bytes(int64_t n, int64_t chunk, int64_t group) {
  // A block's values in float64, their centred and scaled copy, their buckets as int64, and the
  // transient of one conversion (8 bytes each); 1 KiB of float64 per chunk twice, for the sums.
  const int64_t values = std::min(n, std::max(group, chunk));
  return 40 * values + 2 * 8 * kUint8Buckets * ((values + chunk - 1) / chunk);
}

int64_t compressed_bytes(Compression c, int64_t n, int64_t chunk) {
  switch (c) {
    case Compression::None: return 4 * n;
    case Compression::BF16: return 2 * n;
    case Compression::UInt8: return n + (n + chunk - 1) / chunk * kUint8Buckets * 4;
  }
  return 0;
}

}  // namespace zb
