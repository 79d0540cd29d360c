// RMSNorm's backward on bf16 rows, with the residual stream's own gradient added in the same pass.
// A block's input h feeds both its norm and the residual add after it, so autograd sums two
// gradients of h: the norm's and the residual's. ATen's path is three kernels (the input's
// gradient, the weight's, then autograd's add: 0.41 ms a call on a 1B micro-batch on an H100,
// 2.4 times its traffic's time); here one reads the output's gradient, h and the residual's
// gradient, writes h's, and sums the weight's gradient per block (a second, small sum over blocks
// finishes it). The numbers are ATen's formula in fp32: with x_hat = h * rstd (rstd saved by the
// forward) and wg = weight * dy,
//   dh = rstd * (wg - x_hat * mean(wg * x_hat)) + residual's gradient, rounded to bf16 once,
//   dweight = sum over rows of dy * x_hat.
// Plain CUDA: no LibTorch headers here.
#include "kernels/block_reduce_host.h"
#include "kernels/cuda_kernels.h"
#include "kernels/device_helpers.cuh"

#include <cuda_bf16.h>

#include <stdexcept>
#include <vector>

// In zb: the profiler counts kernels named zb:: as ours (observe/profiler.h, kernel_kind).
namespace zb {
namespace {
using namespace device;

constexpr int kVector = 8;      // bf16 values per 16-byte access (Bf16x8)
constexpr int kThreads = 256;   // a row's threads: a multiple of 32 (the warps' shuffles)
constexpr int kMaxVectors = 4;  // a thread's share of a row: widths up to 4 * 8 * 256 = 8,192

// What one thread keeps across the rows of its block: the weight's values of its columns and its
// columns' share of dweight, in fp32.
struct ThreadState {
  float w[kMaxVectors][kVector];
  float dw[kMaxVectors][kVector];
};

ZB_HD void load_weight(ThreadState& s, const __nv_bfloat16* __restrict__ w, int64_t vectors, int thread, int threads) {
#pragma unroll
  for (int k = 0; k < kMaxVectors; ++k) {
    const int64_t j = thread + static_cast<int64_t>(k) * threads;
    for (int e = 0; e < kVector; ++e) {
      s.w[k][e] = j < vectors ? f(w[j * kVector + e]) : 0.0f;
      s.dw[k][e] = 0.0f;
    }
  }
}

// Row r, first pass: this thread's part of sum(wg * x_hat) over the row.
ZB_HD float row_dot(const ThreadState& s, const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ h,
                    float rstd, int64_t vectors, int thread, int threads) {
  float dot = 0.0f;
#pragma unroll
  for (int k = 0; k < kMaxVectors; ++k) {
    const int64_t j = thread + static_cast<int64_t>(k) * threads;
    if (j >= vectors) continue;  // (not break: the loop unrolls, the arrays stay in registers)
    const Bf16x8 g = reinterpret_cast<const Bf16x8*>(dy)[j], x = reinterpret_cast<const Bf16x8*>(h)[j];
    for (int e = 0; e < kVector; ++e) dot += s.w[k][e] * f(g.v[e]) * (f(x.v[e]) * rstd);
  }
  return dot;
}

// Row r, second pass (mean = the row's sum(wg * x_hat) / D): dh for this thread's columns, and
// their dweight accumulated. residual may be null (no gradient from the residual stream).
ZB_HD void row_write(ThreadState& s, const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ h,
                     const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ dh, float rstd,
                     float mean, int64_t vectors, int thread, int threads) {
#pragma unroll
  for (int k = 0; k < kMaxVectors; ++k) {
    const int64_t j = thread + static_cast<int64_t>(k) * threads;
    if (j >= vectors) continue;
    const Bf16x8 g = reinterpret_cast<const Bf16x8*>(dy)[j], x = reinterpret_cast<const Bf16x8*>(h)[j];
    Bf16x8 r{};
    if (residual) r = reinterpret_cast<const Bf16x8*>(residual)[j];
    Bf16x8 out;
    for (int e = 0; e < kVector; ++e) {
      const float x_hat = f(x.v[e]) * rstd, gy = f(g.v[e]);
      float d = rstd * (s.w[k][e] * gy - x_hat * mean);
      if (residual) d += f(r.v[e]);
      out.v[e] = __float2bfloat16_rn(d);
      s.dw[k][e] += gy * x_hat;
    }
    reinterpret_cast<Bf16x8*>(dh)[j] = out;
  }
}

// The block's dweight partial sums, row `block` of partial [blocks, D].
ZB_HD void store_partial(const ThreadState& s, float* __restrict__ partial, int64_t block, int64_t vectors, int thread,
                         int threads) {
  float* row = partial + block * vectors * kVector;
#pragma unroll
  for (int k = 0; k < kMaxVectors; ++k) {
    const int64_t j = thread + static_cast<int64_t>(k) * threads;
    if (j >= vectors) continue;
    for (int e = 0; e < kVector; ++e) row[j * kVector + e] = s.dw[k][e];
  }
}

__device__ float block_sum(float v, float* warps) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  v = lane < n_warps ? warps[lane] : 0.0f;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();  // warps[] is rewritten by the next row
  return v;         // every thread has the block's sum
}

__global__ void rms_norm_backward_bf16(const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ h,
                                       const __nv_bfloat16* __restrict__ w, const float* __restrict__ rstd,
                                       const __nv_bfloat16* __restrict__ residual, __nv_bfloat16* __restrict__ dh,
                                       float* __restrict__ partial, int64_t rows, int64_t D) {
  __shared__ float warps[32];
  const int64_t vectors = D / kVector;
  ThreadState s;
  load_weight(s, w, vectors, threadIdx.x, blockDim.x);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t o = r * D;
    const float dot = block_sum(row_dot(s, dy + o, h + o, rstd[r], vectors, threadIdx.x, blockDim.x), warps);
    row_write(s, dy + o, h + o, residual ? residual + o : nullptr, dh + o, rstd[r], dot / static_cast<float>(D),
              vectors, threadIdx.x, blockDim.x);
  }
  store_partial(s, partial, blockIdx.x, vectors, threadIdx.x, blockDim.x);
}

}  // namespace

bool rms_norm_backward_bf16_takes(int64_t D) {
  return D > 0 && D % kVector == 0 && D <= static_cast<int64_t>(kMaxVectors) * kVector * kThreads;
}

int64_t rms_norm_backward_bf16_blocks(int64_t rows) {
  // Enough blocks to fill a GPU several times over; each keeps its columns' dweight in registers
  // across its rows, so fewer blocks also mean a smaller second sum.
  return rows < 1024 ? rows : 1024;
}

cudaError_t launch_rms_norm_backward_bf16(const void* dy, const void* h, const void* w, const void* rstd,
                                          const void* residual, void* dh, void* partial, int64_t rows, int64_t D,
                                          cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rms_norm_backward_bf16<<<static_cast<int>(rms_norm_backward_bf16_blocks(rows)), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(dy), static_cast<const __nv_bfloat16*>(h),
      static_cast<const __nv_bfloat16*>(w), static_cast<const float*>(rstd),
      static_cast<const __nv_bfloat16*>(residual), static_cast<__nv_bfloat16*>(dh), static_cast<float*>(partial), rows,
      D);
  return cudaGetLastError();
}

void rms_norm_backward_bf16_on_host(const void* dy, const void* h, const void* w, const void* rstd,
                                    const void* residual, void* dh, void* partial, int64_t rows, int64_t D,
                                    int64_t blocks, int threads) {
  if (rows == 0) return;
  if (blocks == 0) blocks = rms_norm_backward_bf16_blocks(rows);
  if (threads == 0) threads = kThreads;
  const int64_t vectors = D / kVector;
  if (vectors > static_cast<int64_t>(threads) * kMaxVectors)
    throw std::invalid_argument("rms_norm_backward_bf16_on_host: a row wider than its threads cover");
  const auto* g = static_cast<const __nv_bfloat16*>(dy);
  const auto* x = static_cast<const __nv_bfloat16*>(h);
  const auto* res = static_cast<const __nv_bfloat16*>(residual);
  const auto* rs = static_cast<const float*>(rstd);
  for (int64_t b = 0; b < blocks; ++b) {
    std::vector<ThreadState> state(threads);
    for (int t = 0; t < threads; ++t) load_weight(state[t], static_cast<const __nv_bfloat16*>(w), vectors, t, threads);
    for (int64_t r = b; r < rows; r += blocks) {
      const int64_t o = r * D;
      std::vector<float> parts(threads);
      for (int t = 0; t < threads; ++t) parts[t] = row_dot(state[t], g + o, x + o, rs[r], vectors, t, threads);
      const float dot = combine_as_shuffles(parts, 0.0f, [](float a, float b) { return a + b; });
      for (int t = 0; t < threads; ++t)
        row_write(state[t], g + o, x + o, res ? res + o : nullptr, static_cast<__nv_bfloat16*>(dh) + o, rs[r],
                  dot / static_cast<float>(D), vectors, t, threads);
    }
    for (int t = 0; t < threads; ++t) store_partial(state[t], static_cast<float*>(partial), b, vectors, t, threads);
  }
}

}  // namespace zb
