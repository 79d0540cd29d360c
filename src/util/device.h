#pragma once
// Which device to run on, its name and its peak memory.
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace zb {

// True when this LibTorch was built with CUDA and a GPU is visible.
bool cuda_available();
// "auto" -> cuda:<local_rank> when available, else cpu. "cuda" without a GPU throws.
c10::Device select_device(const std::string& requested, int64_t local_rank);
std::string device_name(const c10::Device& device);  // the GPU's name, or "cpu"
// Peak memory of this process on `device`: the CUDA caching allocator's peak allocated bytes,
// or on CPU the peak resident set size.
int64_t peak_memory_bytes(const c10::Device& device);

}  // namespace zb
