// The GPU plugin (util/cuda_plugin.h) loads on a machine without a GPU when asked to
// (ZB_CUDA_PLUGIN=on, which the ctest entry cuda_plugin.loads sets; elsewhere the test skips), with
// ATen's CUDA side behind it, and hands over every function of its three tables.
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "kernels/cuda_ops.h"
#include "util/cuda_plugin.h"
#include "util/device_cuda.h"

using namespace zb;

namespace {
// Whether every entry of a table of function pointers is set.
template <typename Table>
bool complete(const Table* table) {
  static_assert(sizeof(Table) % sizeof(void (*)()) == 0, "a table of function pointers only");
  std::vector<uintptr_t> entries(sizeof(Table) / sizeof(uintptr_t));
  std::memcpy(entries.data(), table, sizeof(Table));
  for (uintptr_t e : entries)
    if (e == 0) return false;
  return !entries.empty();
}
}  // namespace

TEST(CudaPlugin, LoadsAndHandsOverEveryFunction) {
#ifndef ZB_WITH_CUDA
  GTEST_SKIP() << "this LibTorch has no CUDA";
#endif
  const char* mode = std::getenv("ZB_CUDA_PLUGIN");
  if (!mode || std::string(mode) != "on") GTEST_SKIP() << "runs with ZB_CUDA_PLUGIN=on (ctest: cuda_plugin.loads)";
  const auto* device = cuda_plugin_table<CudaDeviceFunctions>("zb_cuda_device_functions");
  const auto* kernels = cuda_plugin_table<CudaKernelFunctions>("zb_cuda_kernel_functions");
  const auto* nccl = cuda_plugin_table<NcclFunctions>("zb_nccl_functions");
  ASSERT_TRUE(device && kernels && nccl);
  EXPECT_TRUE(complete(device));
  EXPECT_TRUE(complete(kernels));
  EXPECT_TRUE(complete(nccl));
  // A program whose table differs from the plugin's (another build's plugin) gets none, and is told.
  const auto entry = reinterpret_cast<const void* (*)(std::size_t)>(cuda_plugin_symbol("zb_nccl_functions"));
  EXPECT_EQ(entry(sizeof(NcclFunctions) + sizeof(void*)), nullptr);
  try {
    cuda_plugin_mismatch("zb_nccl_functions");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("zb_nccl_functions table differs): rebuild the two together"),
              std::string::npos) << e.what();
  }
  // ATen answers with its CUDA library (the stub it has without one throws here).
  EXPECT_GT(at::detail::getCUDAHooks().versionCUDART(), 0);
}
