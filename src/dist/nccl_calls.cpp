// The NCCL backends of dist/comm.h, called through the GPU plugin's table (util/cuda_plugin.h).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dist/comm.h"
#include "util/cuda_plugin.h"

namespace zb {

namespace {
const NcclFunctions& nccl() {
  static const NcclFunctions& table = required_cuda_plugin_table<NcclFunctions>(
      "zb_nccl_functions", "NCCL needs the GPU side of the programs (libzb_cuda.so), which is not loaded here: no "
                           "NVIDIA driver, or a LibTorch without CUDA");
  return table;
}
}  // namespace

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, const World& world,
                                                    const c10::Device& device, std::chrono::milliseconds timeout) {
  return nccl().make(store, world, device, timeout);
}

c10::intrusive_ptr<c10d::Backend> split_nccl_backend(const c10::intrusive_ptr<c10d::Backend>& parent,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::vector<int64_t>& ranks,
                                                     std::chrono::milliseconds timeout) {
  return nccl().split(parent, store, ranks, timeout);
}

}  // namespace zb
