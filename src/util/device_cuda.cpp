// util/device.h's GPU side, in the GPU plugin (util/cuda_plugin.h).
#include <ATen/Context.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "util/device_cuda.h"

namespace zb {
namespace {

std::string cuda_device_name(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "cuda:" + std::to_string(index);
  return prop.name;
}

int cuda_compute_capability(int index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return 0;
  return prop.major * 10 + prop.minor;
}

std::string cuda_pci_bus_id(int index) {
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof id, index) != cudaSuccess) return "unknown";
  return id;
}

// The caching allocator exists only once LibTorch has initialised CUDA (lazily, at the first CUDA
// tensor): before that its statistics throw "Invalid device argument". The memory check asks
// before anything is on the device.
void initialise_cuda() { at::globalContext().lazyInitDevice(at::kCUDA); }

void cuda_reset_peak_memory(int index) {
  initialise_cuda();
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

int64_t cuda_peak_memory_bytes(int index) {
  initialise_cuda();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

DeviceMemory cuda_device_memory(int index) {
  initialise_cuda();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t cached = stats.reserved_bytes[all].current - stats.allocated_bytes[all].current;
  return {static_cast<int64_t>(free) + cached, static_cast<int64_t>(total)};
}

void configure_cuda_allocator() {
  // The sharding engine allocates and frees buffers of many sizes every step (each unit's
  // all-gather output and reduce-scatter input, the root's differing from the blocks'):
  // expandable segments grow one mapping instead of leaving holes between fixed-size blocks. A
  // user's PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF wins.
  if (std::getenv("PYTORCH_CUDA_ALLOC_CONF") || std::getenv("PYTORCH_ALLOC_CONF")) return;
  c10::CachingAllocator::setAllocatorSettings("expandable_segments:True");
}

void* cuda_event_create() {
  cudaEvent_t event;
  C10_CUDA_CHECK(cudaEventCreate(&event));
  return event;
}

void cuda_event_record(void* event) {
  C10_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), c10::cuda::getCurrentCUDAStream()));
}

double cuda_event_seconds(void* from, void* to) {
  float ms = 0;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(from), static_cast<cudaEvent_t>(to)));
  return ms / 1e3;
}

void cuda_event_synchronize(void* event) { C10_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

void cuda_event_destroy(void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

}  // namespace
}  // namespace zb

extern "C" const zb::CudaDeviceFunctions* zb_cuda_device_functions(std::size_t table_bytes) {
  using namespace zb;
  if (table_bytes != sizeof(CudaDeviceFunctions)) return nullptr;
  static const CudaDeviceFunctions table{cuda_device_name,       cuda_pci_bus_id,          cuda_compute_capability,
                                         cuda_peak_memory_bytes, cuda_reset_peak_memory,   cuda_device_memory,
                                         configure_cuda_allocator, cuda_event_create,      cuda_event_record,
                                         cuda_event_seconds,     cuda_event_synchronize,   cuda_event_destroy};
  return &table;
}
