#pragma once
// Pseudo-gradients crossing slow links in fewer bits: DiLoCo's outer exchange between replicas
// (diloco/diloco.h, diloco.compression).
//
//   bf16   each value rounded to bfloat16 (8 significant bits), 2 bytes a value.
//   uint8  the values cut into chunks; in each chunk, 256 equal buckets span mean ± 4 standard
//          deviations (values beyond fall into the end buckets), a value's code is its bucket and
//          a code stands for the mean of the values that fell into it (a 256-entry fp32 table sent
//          with the chunk; computed in float64, sent in fp32). Each bucket's sum is kept, so the
//          chunk's sum is too, up to the table's fp32 rounding; a value within the span is off
//          by at most one bucket's width, 8σ/256.
//          1 byte a value plus 1 KiB a chunk.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace zb {

enum class Compression { None, BF16, UInt8 };
// "none", "bf16", "uint8"; throws std::invalid_argument naming the value otherwise.
Compression parse_compression(const std::string& name);

constexpr double kUint8Spread = 4.0;  // buckets span mean ± this many standard deviations
constexpr int64_t kUint8Buckets = 256;

struct Uint8Code {
  at::Tensor codes;   // uint8 [n]: each value's bucket
  at::Tensor tables;  // fp32 [chunks, 256]: the mean of the values in each bucket (0 where none)
  int64_t chunk = 0;  // values per chunk (the last may hold fewer)
};

// Values worked on at once: the temporaries of a 7B model's fragment (hundreds of millions of
// values a rank) stay within uint8_workspace_bytes, about 160 MiB.
constexpr int64_t kUint8Group = int64_t{1} << 22;

// `values`: any shape, read as a flat fp32 vector.
Uint8Code quantize_uint8(const at::Tensor& values, int64_t chunk, int64_t group = kUint8Group);
// fp32 [n], on the codes' device.
at::Tensor dequantize_uint8(const Uint8Code& code, int64_t group = kUint8Group);
// The most bytes of temporaries quantize_uint8 and dequantize_uint8 hold beside their inputs and
// results, for n values (the memory estimate's share of an outer step).
int64_t uint8_workspace_bytes(int64_t n, int64_t chunk, int64_t group = kUint8Group);
// What crosses the link for n values.
int64_t compressed_bytes(Compression c, int64_t n, int64_t chunk);

}  // namespace zb
