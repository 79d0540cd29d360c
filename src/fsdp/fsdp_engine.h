#pragma once
// The sharding engine (FSDP2's fully_shard, applied to every block and to the root): it owns
// the model's parameters as row shards and drives the model's forward block by block, gathering
// each unit just before it runs, prefetching the next one, freeing it after use, gathering it
// again ahead of its backward and reduce-scattering its gradients as soon as they are complete.
//
//   engine.set_requires_gradient_sync(last micro-batch?)
//   loss = engine.loss(tokens, targets); loss.backward();
//   engine.finish_backward();            // sharded .grad()s are ready after this
//   engine.clip_grad_norm_(1.0); optimizer.step(...) on engine.parameters()
//
// The engine drives each unit through its calls (pre_forward, post_forward, pre_backward from a
// hook on the block's output gradient; post_backward comes from autograd) and owns the
// communication context the units share.
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "dist/comm.h"
#include "fsdp/fsdp_param.h"
#include "fsdp/fsdp_unit.h"
#include "model/llama.h"
#include "parallel/parallel_model.h"

namespace zb {

struct FSDPOptions {
  at::ScalarType compute_dtype = at::kFloat;  // dtype of gathered parameters and activations
  // Free each block's gathered parameters after its forward and gather them again for backward
  // (the last block is kept: backward needs it first). The root (embedding, final norm, head)
  // stays gathered from forward to the end of backward.
  bool reshard_after_forward = true;
  // Activation checkpointing: 0 off; N recomputes the forward of every N-th block (layer % N == 0)
  // during backward instead of keeping its activations (only its input is kept).
  int64_t checkpoint_every = 0;
  // With one rank in the shard group and no replicas (gathering is a cast): keep every unit's
  // cast for the whole step and across steps, cast again after the parameters change (once a
  // step), instead of after each free. Costs the whole model in the compute dtype;
  // reshard_after_forward then frees nothing (train.keep_unsharded).
  bool keep_unsharded = false;
  // Gather the weights the model multiplies in FP8 as e4m3 bytes (float8.enable_fsdp_float8_all_gather),
  // with power-of-two scales from one all-gather of their shards' amaxes after each change.
  bool float8_all_gather = false;
  // Where the shards live; parameters the model left on the meta device (Llama's
  // allocate_parameters = false) are created here one at a time.
  c10::Device device = c10::kCPU;
};

// The engine drives the model's pass through its stages (StageHooks, model/llama.h).
class FSDPEngine : public ParallelModel, private StageHooks {
 public:
  // Shards every parameter of `model` (whose values must be identical on all ranks) over `comm`
  // and frees the full copies; the model's slots are refilled with gathered tensors during
  // forward. Hybrid sharding (HSDP): `comm` is this rank's shard group and `replicas` the ranks
  // holding the same shards in the other groups, over which the reduced gradients are summed.
  // Tensor parallelism: `model` holds this rank's slices (Llama's TP group, `tp` here): the engine
  // shards those, and reports them in the whole model's coordinates.
  // Expert parallelism (the model's EP group, `ep` here): of each mixture's expert stacks the
  // engine keeps this rank's experts ([rank E/ep, (rank + 1) E/ep)) and shards them over
  // `expert_shards`, the ranks of the shard and TP groups that hold the same experts (MeshShape's
  // expert_shard_group_ranks): a block gathers its own experts alone, as its unit's second part.
  FSDPEngine(Llama& model, Communicator& comm, const FSDPOptions& options, Communicator* replicas = nullptr,
             Communicator* tp = nullptr, Communicator* ep = nullptr, Communicator* expert_shards = nullptr);

  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents = {}) override;
  // false on the micro-batches before the last: gradients accumulate unsharded, no collective.
  void set_requires_gradient_sync(bool sync) override;
  // Waits for the outstanding reduce-scatters, fills the sharded gradients and frees every
  // gathered parameter. Call after each backward.
  void finish_backward() override;
  void reshard() override;
  void parameters_changed() override;
  bool keeps_unsharded() const override { return root_->keeps_unsharded(); }

  // The optimizer's view: sharded fp32 parameters under their model names, with their rows.
  std::vector<ShardedParameter> parameters() override;
  // Clips the sharded gradients by the global L2 norm over all ranks (one all-reduce) and returns
  // the norm before clipping.
  at::Tensor clip_grad_norm_(double max_norm) override;
  // The whole fp32 value of every parameter, gathered from the shards (collective).
  std::vector<std::pair<std::string, at::Tensor>> gather_full_parameters() override;
  int64_t replica() const override { return replicas_ ? replicas_->rank() : 0; }
  int64_t tp_rank() const override { return tp_ ? tp_->rank() : 0; }

  const std::vector<std::unique_ptr<FSDPUnit>>& blocks() const { return blocks_; }
  const FSDPUnit& root() const { return *root_; }
  // Block forwards recomputed in backward so far (activation checkpointing).
  int64_t blocks_recomputed() const { return blocks_recomputed_; }
  void set_trace(StepTrace* trace) override { context_.trace = trace; }

 private:
  // Around the model's stages: the root gathered and the first block prefetched before the
  // embedding; each block gathered before it runs (plain views when checkpointed), the next one
  // prefetched, and after it freed, with a hook on its output that gathers it again for backward;
  // a checkpointed block gathered again into its slots before it runs a second time.
  void before_embedding() override;
  void before_block(int64_t layer, const at::Tensor& input, bool checkpointed) override;
  void after_block(int64_t layer, const at::Tensor& output) override;
  void before_loss(const at::Tensor& input) override;
  bool checkpointed(int64_t layer) const override;
  void before_recompute(int64_t layer) override;

  // FP8 all-gather: every FP8 weight's scale from the largest |value| of its shards over the
  // shard group (one all-gather of an amax per weight), at the first forward after
  // parameters_changed() (which every rank calls alike: the collective stays matched).
  void update_float8_scales();
  bool float8_scales_stale_ = true;

  Llama& model_;
  Communicator& comm_;
  Communicator* replicas_;
  Communicator* tp_;
  Communicator* ep_;             // null without expert parallelism
  Communicator* expert_shards_;  // with it, where this rank's experts are sharded
  FSDPOptions options_;
  // Whether parameter i is held as this rank's experts, sharded over expert_shards_.
  bool split_over_ep(size_t i) const { return ep_ && model_.parameters()[i].experts(); }
  void reset_units();  // every unit back to IDLE (and SHARDED, or its kept cast)
  std::vector<std::unique_ptr<FSDPParam>> params_;  // in model order
  std::vector<std::unique_ptr<FSDPUnit>> blocks_;
  std::unique_ptr<FSDPUnit> root_;
  FSDPCommContext context_;  // what the units have in flight
  int64_t blocks_recomputed_ = 0;
};

}  // namespace zb
