#include "dist/compression.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/floor.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <stdexcept>

namespace zb {

Compression parse_compression(const std::string& name) {
  if (name == "none") return Compression::None;
  if (name == "bf16") return Compression::BF16;
  if (name == "uint8") return Compression::UInt8;
  throw std::invalid_argument("compression \"" + name + "\": one of none, bf16, uint8");
}

Uint8Code quantize_uint8(const at::Tensor& values, int64_t chunk) {
  TORCH_CHECK(chunk > 0, "quantize_uint8: chunk must be positive");
  // Statistics and bucket sums in float64: a bucket's mean then carries only the table's fp32
  // rounding, and each chunk's sum is kept to that (fp32 sums of a chunk would drift by ~n·2^-24).
  const at::Tensor x = values.reshape({-1}).to(at::kDouble);
  const int64_t n = x.numel(), chunks = (n + chunk - 1) / chunk;
  const auto opts = x.options();
  // Each value's chunk, and per chunk: count, mean and standard deviation (over its own values).
  const at::Tensor row = at::arange(n, opts.dtype(at::kLong)).div_(chunk, "floor");
  const at::Tensor count = at::zeros({chunks}, opts).index_add_(0, row, at::ones_like(x));
  const at::Tensor mean = at::zeros({chunks}, opts).index_add_(0, row, x).div_(count);
  const at::Tensor centred = x - mean.index_select(0, row);
  const at::Tensor std = at::sqrt(at::zeros({chunks}, opts).index_add_(0, row, centred * centred).div_(count));
  // Position in [mean - spread·σ, mean + spread·σ] as a fraction, then the bucket; a constant chunk
  // (σ = 0) puts every value in the middle bucket.
  const at::Tensor width = (2 * kUint8Spread) * std.index_select(0, row);
  const at::Tensor t = at::where(width > 0, centred / width, at::zeros_like(centred)) + 0.5;
  const at::Tensor bucket = at::clamp(at::floor(t * kUint8Buckets), 0, kUint8Buckets - 1).to(at::kLong);
  // A code stands for the mean of its bucket's values.
  const at::Tensor key = row * kUint8Buckets + bucket;
  const at::Tensor sums = at::zeros({chunks * kUint8Buckets}, opts).index_add_(0, key, x);
  const at::Tensor hits = at::zeros({chunks * kUint8Buckets}, opts).index_add_(0, key, at::ones_like(x));
  Uint8Code code;
  code.codes = bucket.to(at::kByte);
  code.tables = (sums / hits.clamp_min(1)).to(at::kFloat).view({chunks, kUint8Buckets});
  code.chunk = chunk;
  return code;
}

at::Tensor dequantize_uint8(const Uint8Code& code) {
  const int64_t n = code.codes.numel();
  const at::Tensor row = at::arange(n, code.codes.options().dtype(at::kLong)).div_(code.chunk, "floor");
  return code.tables.reshape({-1}).index_select(0, row * kUint8Buckets + code.codes.to(at::kLong));
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
