#pragma once
// util/device.h's GPU side, in the GPU plugin (util/cuda_plugin.h): util/device_cuda.cpp fills the
// table, util/device.cpp calls through it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "util/device.h"

namespace zb {

struct CudaDeviceFunctions {
  std::string (*device_name)(int index);
  std::string (*pci_bus_id)(int index);
  int (*compute_capability)(int index);
  int64_t (*peak_memory_bytes)(int index);
  void (*reset_peak_memory)(int index);
  DeviceMemory (*device_memory)(int index);
  void (*configure_allocator)();
  void* (*event_create)();
  void (*event_record)(void* event);
  double (*event_seconds)(void* from, void* to);
  void (*event_synchronize)(void* event);
  void (*event_destroy)(void* event);
};

}  // namespace zb

// The plugin's entry for this table.
extern "C" const zb::CudaDeviceFunctions* zb_cuda_device_functions(std::size_t table_bytes);
