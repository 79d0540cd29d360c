#pragma once
// The programs' GPU side as a plugin, libzb_cuda.so, loaded only where a GPU can be used.
//
// LibTorch's CUDA library (libtorch_cuda.so, with cuBLAS, cuDNN and NCCL behind it) costs a process
// that links it about 0.15 s of CPU at start-up, to load and to register its operators, GPU or not
// (a dry run's 0.39 s against 0.25 s), and the tests start hundreds of programs. So the programs link
// LibTorch's CPU library alone.
// The three translation units that call CUDA (util/device_cuda.cpp, the launches of our kernels in
// kernels/cuda_ops.cpp, the NCCL backend in dist/nccl_backend.cpp) are built into the plugin, which
// links LibTorch's CUDA library. Each of those components reaches its functions through one table it
// declares (CudaDeviceFunctions, CudaKernelFunctions, NcclFunctions), which the plugin returns from
// an extern "C" function of the same name. The caller passes its table's size, and the plugin returns
// null where its own differs: a plugin left from another build is refused rather than called.
//
// When: where this LibTorch has CUDA and the NVIDIA driver's library (libcuda.so.1) loads, before
// main (a static initialiser of util/cuda_plugin.cpp). That must come before anything asks ATen
// about CUDA, seeding a generator included: ATen decides once per process whether it has CUDA (the
// loading checks it). ZB_CUDA_PLUGIN=on loads it without a driver too (to test the loading on a CPU
// machine); =off never. Where: beside the program, in ../lib (installed) or ../src (the build tree).
#include <cstddef>
#include <stdexcept>

namespace zb {

// The plugin's entry `name`, or null where the plugin is not loaded. Throws where a driver is present
// and the plugin did not load, or where ATen was asked about CUDA before it was.
void* cuda_plugin_symbol(const char* name);

// Throws: the plugin's table `name` is not this program's (another build's plugin).
[[noreturn]] void cuda_plugin_mismatch(const char* name);

// The table the plugin's entry `name` returns, or null where the plugin is not loaded.
template <typename Table>
const Table* cuda_plugin_table(const char* name) {
  void* entry = cuda_plugin_symbol(name);
  if (!entry) return nullptr;
  const Table* table = reinterpret_cast<const Table* (*)(std::size_t)>(entry)(sizeof(Table));
  if (!table) cuda_plugin_mismatch(name);
  return table;
}

// The same where the caller cannot go on without it (it holds a GPU tensor or device): throws
// `missing` where the plugin is not loaded.
template <typename Table>
const Table& required_cuda_plugin_table(const char* name, const char* missing) {
  const Table* table = cuda_plugin_table<Table>(name);
  if (!table) throw std::runtime_error(missing);
  return *table;
}

}  // namespace zb
