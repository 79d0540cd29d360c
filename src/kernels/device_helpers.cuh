#pragma once
// What the kernels' translation units (kernels/*_kernel.cu) share. Host and device alike: each
// kernel's thread loop also runs on the CPU, thread by thread of an emulated grid, for the tests
// of a machine without a GPU (the *_on_host functions).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace zb::device {

#define ZB_HD __host__ __device__ __forceinline__

// Eight bf16 values (or four) loaded or stored as one 16-byte (8-byte) access, from pointers
// checked to be aligned.
struct alignas(16) Bf16x8 {
  __nv_bfloat16 v[8];
};
struct alignas(8) Bf16x4 {
  __nv_bfloat16 v[4];
};

ZB_HD float f(float x) { return x; }
ZB_HD float f(__nv_bfloat16 x) { return __bfloat162float(x); }
ZB_HD __nv_bfloat16 bf16(float x) { return __float2bfloat16_rn(x); }

// Whether `p` is aligned to `bytes` (a missing pointer is: nothing is read or written there).
inline bool aligned(const void* p, int bytes = 16) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// An elementwise kernel's grid over n values, `vector` of them a thread at a time where `vectors`:
// 256 threads a block, enough blocks for every vector (or value) once, at most 2^16 blocks (the
// threads' loops cover the rest: 2^24 threads in flight keep any current GPU's memory busy).
inline dim3 grid_for(int64_t n, int vector, bool vectors) {
  const int64_t work = vectors ? (n + vector - 1) / vector : n;
  const int64_t blocks = (work + 255) / 256;
  return dim3(static_cast<unsigned>(blocks < (1 << 16) ? blocks : (1 << 16)));
}

}  // namespace zb::device
