#include "util/device.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sys/resource.h>

#include <stdexcept>

namespace zb {

#ifdef ZB_WITH_CUDA
// device_cuda.cpp: the only translation unit that includes CUDA headers.
std::string cuda_device_name(int index);
int64_t cuda_peak_memory_bytes(int index);
#endif

bool cuda_available() { return at::hasCUDA() && at::detail::getCUDAHooks().deviceCount() > 0; }

c10::Device select_device(const std::string& requested, int64_t local_rank) {
  if (requested == "cpu") return c10::Device(c10::kCPU);
  if (requested == "cuda" && !cuda_available())
    throw std::runtime_error("runtime.device = \"cuda\" but no CUDA device is available");
  if (requested == "cuda" || (requested == "auto" && cuda_available())) {
    const int64_t n = at::detail::getCUDAHooks().deviceCount();
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % n));
  }
  return c10::Device(c10::kCPU);
}

std::string device_name(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return cuda_device_name(device.index());
#endif
  return device.str();
}

int64_t peak_memory_bytes(const c10::Device& device) {
#ifdef ZB_WITH_CUDA
  if (device.is_cuda()) return cuda_peak_memory_bytes(device.index());
#endif
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace zb
