#pragma once
// Float8 linears ([float8], torchtitan's names): a block's projections (wq, wk, wv, wo, w1, w2, w3)
// multiply in FP8 on Hopper's tensor cores, twice bf16's rate. Each GEMM's operands are cast to
// FP8 with dynamic scales (the amax of the tensor, or of each row, taken as it comes), multiplied
// by ATen's _scaled_mm (cuBLASLt), and the product written in the compute dtype. Master weights,
// optimizers and checkpoints do not change: the weights are cast on the fly, as for bf16.
//
// The recipes (what torchao's Float8Linear calls them):
//   tensorwise          one scale per tensor; input and weight in e4m3, the output's gradient in
//                       e5m2 (more range, less precision); the fastest.
//   rowwise             a scale per row along the GEMM's inner dimension, rounded down to a power
//                       of two (so scaling itself rounds nothing); everything e4m3.
//   rowwise_with_gw_hp  rowwise, but the weight's gradient, the GEMM that sums over every token,
//                       stays in the compute dtype.
//
// emulate: the same FP8 values (scaled, saturated, rounded to the FP8 grid) multiplied in fp32
// on any device: what the tests check against float64, and against the GPU's GEMMs.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace zb {

enum class Float8Recipe { Tensorwise, Rowwise, RowwiseWithGwHp };
Float8Recipe float8_recipe(const std::string& name);  // std::invalid_argument for an unknown one
std::string float8_recipe_name(Float8Recipe recipe);

// The largest finite value of an FP8 type (e4m3fn 448, e5m2 57344).
double float8_max(at::ScalarType fp8);

// An FP8 tensor and the factor that brings it back: value = data * inverse_scale, with
// inverse_scale fp32, 0-d (one per tensor) or [rows, 1] (one per row).
struct Float8Tensor {
  at::Tensor data, inverse_scale;
  at::Tensor dequantised() const;  // fp32
};

// x [rows, cols] cast to `fp8`: scale = max / amax (of the whole, or of each row when `rowwise`),
// rounded down to a power of two when `power_of_two`, x * scale saturated to +-max and rounded to
// the nearest FP8 value. An all-zero tensor or row gets the scale of an amax of 1e-12. On a GPU in
// bf16 our kernel casts in one pass (kernels/cuda_ops.h; `our_kernel` false: ATen's operators),
// elsewhere ATen's operators on an fp32 copy: the same values.
Float8Tensor to_float8(const at::Tensor& x, at::ScalarType fp8, bool rowwise, bool power_of_two,
                       bool our_kernel = true);

// a [M, K] times b [N, K] transposed: [M, N] in `out_dtype`. On CUDA through _scaled_mm unless
// `emulate`; else the dequantised operands multiplied in fp32.
at::Tensor float8_mm(const Float8Tensor& a, const Float8Tensor& b, at::ScalarType out_dtype, bool emulate,
                     bool fast_accumulation = false);

// x [.., K] w_i [N_i, K]^T for each weight under `recipe`, as one autograd node: [.., N_i] in x's
// dtype, x cast once for all. The forward keeps x and the weights as they came and casts them
// again in the backward, along the axes each GEMM needs.
// `weight_power_of_two`: tensorwise weight scales rounded down to powers of two (Float8Linears'
// fsdp_all_gather).
std::vector<at::Tensor> float8_linears(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                       Float8Recipe recipe, bool emulate, bool weight_power_of_two = false);
// One weight.
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& w, Float8Recipe recipe, bool emulate,
                         bool weight_power_of_two = false);

// Whether FP8 GEMMs take a projection of `in` x `out` features (both multiples of 16), and the
// tokens of a micro-batch (the weight gradient's inner dimension, also a multiple of 16).
bool float8_takes(int64_t in_features, int64_t out_features, int64_t tokens);

// What the model runs in FP8 (apply_float8, float8/float8_projections.h): every block projection whose name contains
// none of `filter_fqns` and whose shape float8_takes.
struct Float8Linears {
  bool enabled = false;
  Float8Recipe recipe = Float8Recipe::Tensorwise;
  bool emulate = false;
  std::vector<std::string> filter_fqns;  // names (or parts of names) left in the compute dtype
  // The sharding engine gathers these weights in FP8 (float8.enable_fsdp_float8_all_gather,
  // tensorwise): their scales are powers of two, so that the gathered bytes, dequantised into the
  // compute dtype, cast back to themselves exactly in the GEMM.
  bool fsdp_all_gather = false;
  // Whether the projection `name` ("layers.3.attention.wq") is filtered out.
  bool filtered(const std::string& name) const;
  // Whether the parameter `param_name` ("layers.3.attention.wq.weight"), [out, in] on this rank,
  // multiplies in FP8 with `tokens` in a micro-batch's GEMMs; `shape_refused`, where given, is set
  // when only its shape kept it out.
  bool takes(const std::string& param_name, int64_t out, int64_t in, int64_t tokens,
             bool* shape_refused = nullptr) const;
};

// x cast to `fp8` with the given scale (fp32, 0-d): saturated, rounded to nearest.
at::Tensor to_float8_with_scale(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8);
// The scale that takes `amax` (a tensor of them) to the top of `fp8`'s range: max / max(amax,
// 1e-12) in fp32, rounded down to a power of two when `power_of_two`.
at::Tensor float8_scale(const at::Tensor& amax, at::ScalarType fp8, bool power_of_two);
// Which block projection ("wq" .. "w3") the parameter `param_name` ("layers.3.attention.wq.weight")
// is the weight of; "" for any other parameter.
std::string float8_projection(const std::string& param_name);

}  // namespace zb
