#pragma once
// The ranks that share one forward of the model between them: a tensor-parallel group (each holds
// a slice of every large matrix, model_parallel/tensor_parallel.h), a context-parallel one (each
// holds a share of every row's tokens, model_parallel/context_parallel.h) or an expert-parallel one
// (each holds some of a mixture's experts, model_parallel/expert_parallel.h). The model and these
// primitives ask for the group's collectives through this interface, below the process groups;
// the parallel layer implements it on a Communicator (parallel/model_parallel_group.h).
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace zb {

class ModelParallelGroup {
 public:
  virtual ~ModelParallelGroup() = default;
  virtual int64_t size() const = 0;
  virtual int64_t rank() const = 0;
  // Each returns once the result may be read by what runs next on the tensors' device.
  // out (flat, size() * in.numel()) = every rank's `in`, in rank order.
  virtual void all_gather(const at::Tensor& out, const at::Tensor& in) = 0;
  // out (flat, in.numel() / size()) = this rank's slice of the sum over ranks of `in`.
  virtual void reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in) = 0;
  virtual void all_reduce_sum(const at::Tensor& t) = 0;
  // Flat tensors: sends in's parts to the ranks in order (in_splits[j] elements to rank j) and
  // receives into out's parts from them (out_splits[s] elements from rank s).
  virtual void all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                          const std::vector<int64_t>& in_splits) = 0;
  // One step around the ring (context parallelism's ring attention, context_parallel.h):
  // starts sending `in` to the next rank (rank + 1 mod size) and receiving the previous rank's into
  // `out` (flat, as many elements); the returned function waits for it, so that the caller
  // computes while the step is under way.
  virtual std::function<void()> start_ring_shift(const at::Tensor& out, const at::Tensor& in) = 0;
};

}  // namespace zb
