// The cast of a bf16 matrix to FP8 with dynamic scales (float8/float8.h's to_float8) in one pass
// over memory: each value read once as bf16, scaled in fp32, saturated and rounded to e4m3 or e5m2,
// written as one byte; the scales come from the amaxes already reduced (one per tensor, row or
// column) and their inverses are written for the GEMM. ATen's operators take an fp32 copy,
// scale and saturate it in place and cast it: 27 bytes of memory traffic a bf16 value, against 3
// here (the amax's read, 2 more, either way).
// The numbers are ATen's: the same fp32 division for the scale, product and rounding (to nearest,
// ties to even, as c10's conversion). Plain CUDA: no LibTorch headers here.
#include <cuda_fp8.h>

#include <cmath>

#include "kernels/cuda_kernels.h"
#include "kernels/device_helpers.cuh"

namespace zb {
namespace {
using namespace device;

constexpr int kVector = 8;  // bf16 values a thread reads at once (Bf16x8), FP8 bytes it writes (8 bytes)

struct alignas(8) Bytes8 {
  unsigned char v[8];
};

// scale = max / max(amax, 1e-12), rounded down to a power of two where asked (from the exponent
// alone: frexp's s = m 2^e, m in [0.5, 1)).
ZB_HD float float8_scale(float amax, float max, bool power_of_two) {
  // A NaN amax gives a NaN scale, as ATen's clamp keeps it (rounded to a power of two it becomes a
  // finite one in both, and the NaN values themselves stay NaN).
  float s = max / (amax != amax ? amax : fmaxf(amax, 1e-12f));
  if (power_of_two) {
    int e = 0;
    frexpf(s, &e);
    s = ldexpf(1.0f, e - 1);
  }
  return s;
}

ZB_HD unsigned char to_fp8(float v, bool e5m2) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

// The amax that scales element (r, c): the tensor's, row r's or column c's.
ZB_HD int64_t amax_index(int kind, int64_t r, int64_t c) {
  return kind == kFloat8ScaleTensor ? 0 : kind == kFloat8ScaleRow ? r : c;
}

struct CastArgs {
  const __nv_bfloat16* x;
  const float* amax;
  unsigned char* out;
  float* inverse_scale;
  int64_t rows, cols;
  int kind;
  bool e5m2, power_of_two, vectors;
  float max;
};

ZB_HD void cast_one(const CastArgs& a, int64_t i, __nv_bfloat16 x, unsigned char& out) {
  const int64_t r = i / a.cols, c = i % a.cols;
  const float s = float8_scale(a.amax[amax_index(a.kind, r, c)], a.max, a.power_of_two);
  out = to_fp8(f(x) * s, a.e5m2);
  // The first element of each scale's span writes its inverse.
  if ((a.kind == kFloat8ScaleTensor && i == 0) || (a.kind == kFloat8ScaleRow && c == 0) ||
      (a.kind == kFloat8ScaleColumn && r == 0))
    a.inverse_scale[amax_index(a.kind, r, c)] = 1.0f / s;
}

// One thread's grid-stride loops: 8 values at a time where the pointers are aligned and a row
// holds whole vectors (so a vector's values share a row), then single values.
ZB_HD void cast_thread(const CastArgs& a, int64_t first, int64_t stride) {
  const int64_t n = a.rows * a.cols, n_vectors = a.vectors ? n / kVector : 0;
  for (int64_t v = first; v < n_vectors; v += stride) {
    const Bf16x8 in = reinterpret_cast<const Bf16x8*>(a.x)[v];
    Bytes8 out;
#pragma unroll
    for (int k = 0; k < kVector; ++k) cast_one(a, v * kVector + k, in.v[k], out.v[k]);
    reinterpret_cast<Bytes8*>(a.out)[v] = out;
  }
  for (int64_t i = n_vectors * kVector + first; i < n; i += stride) cast_one(a, i, a.x[i], a.out[i]);
}

__global__ void cast_to_float8_bf16(CastArgs a) {
  cast_thread(a, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              static_cast<int64_t>(gridDim.x) * blockDim.x);
}

CastArgs cast_args(const void* x, const void* amax, int kind, bool e5m2, bool power_of_two, void* out,
                   void* inverse_scale, int64_t rows, int64_t cols) {
  return {static_cast<const __nv_bfloat16*>(x), static_cast<const float*>(amax), static_cast<unsigned char*>(out),
          static_cast<float*>(inverse_scale), rows, cols, kind, e5m2, power_of_two,
          cols % kVector == 0 && aligned(x) && aligned(out, 8), e5m2 ? 57344.0f : 448.0f};
}

}  // namespace

cudaError_t launch_cast_to_float8_bf16(const void* x, const void* amax, int kind, bool e5m2, bool power_of_two,
                                       void* out, void* inverse_scale, int64_t rows, int64_t cols,
                                       cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  const CastArgs a = cast_args(x, amax, kind, e5m2, power_of_two, out, inverse_scale, rows, cols);
  cast_to_float8_bf16<<<grid_for(rows * cols, kVector, a.vectors), 256, 0, stream>>>(a);
  return cudaGetLastError();
}

void cast_to_float8_bf16_on_host(const void* x, const void* amax, int kind, bool e5m2, bool power_of_two, void* out,
                                 void* inverse_scale, int64_t rows, int64_t cols, int64_t threads) {
  const CastArgs a = cast_args(x, amax, kind, e5m2, power_of_two, out, inverse_scale, rows, cols);
  if (threads == 0) threads = static_cast<int64_t>(grid_for(rows * cols, kVector, a.vectors).x) * 256;
  for (int64_t t = 0; t < threads; ++t) cast_thread(a, t, threads);
}

}  // namespace zb
