#pragma once
// Data parallelism (the baseline for the FSDP-vs-DDP comparison): every rank holds all fp32
// parameters; gradients are averaged with all-reduces over buckets of about `bucket_mb`, each
// launched during backward as soon as all of its gradients are computed (so it overlaps the rest
// of backward), and none on micro-batches before the last.
//
// Buckets take the parameters in reverse model order (the order backward produces them). Each
// bucket feeds the model through an identity autograd node whose backward receives the bucket's
// gradients together: the same mechanism as the sharding engine's units.
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "dist/comm.h"
#include "model/parallel_model.h"

namespace zb {

class DDPEngine : public ParallelModel {
 public:
  struct Bucket;

  DDPEngine(Llama& model, Communicator& comm, double bucket_mb);
  ~DDPEngine() override;

  at::Tensor forward(const at::Tensor& tokens) override;
  void set_requires_gradient_sync(bool sync) override { sync_ = sync; }
  void finish_backward() override;
  std::vector<NamedParameter> sharded_parameters() override { return params_; }
  std::vector<std::vector<int64_t>> global_shapes() const override;
  std::vector<at::Tensor> sharded_tensors() const override;
  at::Tensor clip_grad_norm_(double max_norm) override;

  // Called by a bucket's autograd node.
  void bucket_ready(Bucket& bucket, const std::vector<at::Tensor>& grads);

 private:
  Llama& model_;
  Communicator& comm_;
  std::vector<at::Tensor> masters_;       // the parameters (leaves), in model order
  std::vector<NamedParameter> params_;    // names -> masters_
  std::vector<std::unique_ptr<Bucket>> buckets_;
  bool sync_ = true;
};

}  // namespace zb
