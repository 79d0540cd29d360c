#pragma once
// Data parallelism (the baseline for the FSDP-vs-DDP comparison): every rank holds all fp32
// parameters; gradients are averaged with all-reduces over buckets of about `bucket_mb`, each
// launched during backward as soon as all of its gradients are computed (so it overlaps the rest
// of backward), and none on micro-batches before the last.
//
// Buckets take the parameters in reverse model order (the order backward produces them). Each
// bucket is a GradientGroup (parallel/gradient_group.h), the same mechanism as the sharding
// engine's units.
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "dist/comm.h"
#include "parallel/parallel_model.h"

namespace zb {

// The buckets: indices of the model's parameters (their element counts `numels` and blocks
// `layers`, -1 for none, in model order) taken in reverse model order, each bucket up to
// `bucket_mb` MiB of fp32 gradients (a larger parameter gets a bucket of its own), with the stage
// of the forward that first reads one of its members: 0 the embedding (the parameters before the
// first block's), i + 1 block i, n_layers + 1 the loss (those after the last block's). The
// engine's and the step plan's one definition.
struct DDPBucket {
  std::vector<size_t> members;
  int64_t first_stage = 0;
};
std::vector<DDPBucket> ddp_buckets(const std::vector<int64_t>& numels, const std::vector<int64_t>& layers,
                                   int64_t n_layers, double bucket_mb);

// The engine follows the model's pass through its stages (StageHooks, model/llama.h).
class DDPEngine : public ParallelModel, private StageHooks {
 public:
  DDPEngine(Llama& model, Communicator& comm, double bucket_mb);
  ~DDPEngine() override;

  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents = {}) override;
  void set_requires_gradient_sync(bool sync) override { sync_ = sync; }
  void finish_backward() override;
  void reshard() override {}  // nothing is gathered
  // The replicas: every rank holds every row.
  std::vector<ShardedParameter> parameters() override;
  at::Tensor clip_grad_norm_(double max_norm) override;
  std::vector<std::pair<std::string, at::Tensor>> gather_full_parameters() override;
  void set_trace(StepTrace* trace) override { trace_ = trace; }

 private:
  class Bucket;
  // Stage `stage` (as ddp_buckets numbers them) is about to read `input` (undefined for the
  // embedding): the buckets it reads first get their nodes, and the trace its marks.
  void reach_stage(int64_t stage, const at::Tensor& input);
  void before_embedding() override { reach_stage(0, at::Tensor()); }
  void before_block(int64_t layer, const at::Tensor& input, bool) override { reach_stage(layer + 1, input); }
  void before_loss(const at::Tensor& input) override { reach_stage(model_.args().n_layers + 1, input); }

  Llama& model_;
  Communicator& comm_;
  std::vector<at::Tensor> replicas_;  // the parameters (fp32 leaves), in model order
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<int64_t> first_stage_;  // each bucket's: where forward first reads a member (loss())
  size_t buckets_to_fill_ = 0;  // in this forward: buckets_[0, buckets_to_fill_) have no node yet
  bool sync_ = true;
  StepTrace* trace_ = nullptr;
};

}  // namespace zb
