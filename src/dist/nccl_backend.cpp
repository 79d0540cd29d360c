// NCCL for CUDA tensors (compiled when LibTorch has CUDA). The only translation unit that
// includes ProcessGroupNCCL.hpp (it pulls in CUDA and nccl.h).
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "dist/comm.h"

namespace zb {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(world.local_rank));
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(world.rank),
                                                     static_cast<int>(world.size), opts);
}

}  // namespace zb
