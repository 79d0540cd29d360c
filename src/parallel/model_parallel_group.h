#pragma once
// The model's tensor-parallel collectives (model_parallel/tensor_parallel.h) on a process group: the
// ranks of one TP group ([parallel] tp consecutive ranks). Each call waits for its result (on
// CUDA: orders the compute stream after it; the host goes on).
#include <functional>
#include <memory>
#include <vector>

#include "dist/comm.h"
#include "model_parallel/tensor_parallel.h"

namespace zb {

class CommModelParallelGroup : public ModelParallelGroup {
 public:
  explicit CommModelParallelGroup(Communicator& comm) : comm_(comm) {}
  int64_t size() const override { return comm_.size(); }
  int64_t rank() const override { return comm_.rank(); }
  void all_gather(const at::Tensor& out, const at::Tensor& in) override { comm_.all_gather(out, in).wait(); }
  void reduce_scatter_sum(const at::Tensor& out, const at::Tensor& in) override {
    comm_.reduce_scatter_sum(out, in).wait();
  }
  void all_reduce_sum(const at::Tensor& t) override { comm_.all_reduce_sum(t).wait(); }
  void all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits) override {
    comm_.all_to_all(out, in, out_splits, in_splits).wait();
  }
  // An all-to-all whose only parts go to the next rank and come from the previous one.
  std::function<void()> start_ring_shift(const at::Tensor& out, const at::Tensor& in) override {
    const int64_t n = size(), me = rank();
    std::vector<int64_t> to(n, 0), from(n, 0);
    to[(me + 1) % n] = in.numel();
    from[(me + n - 1) % n] = out.numel();
    auto pending = std::make_shared<PendingCollective>(comm_.all_to_all(out.view(-1), in.view(-1), from, to));
    return [pending] { pending->wait(); };
  }

 private:
  Communicator& comm_;
};

}  // namespace zb
