#pragma once
// A sharding unit (FSDP2's FSDPParamGroup): the parameters of one transformer block, or of the
// root (embedding, final norm, head), gathered together in one flat all-gather and their
// gradients reduced in one flat reduce-scatter (layouts in fsdp_collectives.h). Under expert
// parallelism a mixture-of-experts block has a second part, its routed experts' stacks, sharded
// over the fewer ranks that hold its experts: one all-gather and one reduce-scatter per part, the
// block's first, both driven by the one state machine.
//
// Two state machines, as in FSDP2:
//   sharded state   SHARDED --issue_unshard--> GATHERING --wait_unshard--> UNSHARDED --reshard--> SHARDED
//   training state  IDLE --pre_forward--> FORWARD --post_forward--> IDLE
//                   IDLE --pre_backward--> PRE_BACKWARD --post_backward--> POST_BACKWARD
//                   POST_BACKWARD --reset (the engine's finish_backward)--> IDLE
// The engine makes the pre/post forward calls around the block, pre_backward from a hook on the
// block's output gradient, and post_backward arrives from autograd once all of the unit's
// gradients are computed (a unit kept unsharded after forward goes straight from IDLE to
// POST_BACKWARD). A unit's reduce-scatter may be finished (advance_gradients) by the next unit
// that issues one, or by the engine at the end of backward (finish_gradients). Under hybrid
// sharding a third step follows it, the all-reduce of the reduced rows over the replicas:
//   gradients   NONE --post_backward--> REDUCING --advance--> REPLICATING --finish--> NONE
// (without replicas advance goes straight back to NONE), so one unit's reduce-scatter and the
// unit before's all-reduce are in flight while the next blocks compute their backward.
// With one rank in the shard group the gather is a cast of the fp32 shards into the compute
// dtype; a unit that keeps its cast (`keep_unsharded`) stays UNSHARDED from its first cast on, across
// forward, backward and micro-batches, and casts again only after its parameters changed
// (parameters_changed, or a write to a shard that advanced its version counter).
#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "fsdp/fsdp_param.h"
#include "parallel/gradient_group.h"
#include "parallel/step_trace.h"

namespace zb {

class FSDPUnit;

// What the engine's units have in flight (FSDP2's comm context). Owned by the engine.
struct FSDPCommContext {
  // The unit whose reduce-scatter is outstanding. A unit advances it before issuing its own, so
  // one unit's gradient buffers are in flight at a time (the collective still overlaps the next
  // unit's backward).
  FSDPUnit* reducing = nullptr;
  // Hybrid sharding: the unit whose all-reduce over the replicas is outstanding (the one before).
  FSDPUnit* replicating = nullptr;
  // Where the units record what they do (gathers in place, frees, gradients complete); null: not
  // recorded.
  StepTrace* trace = nullptr;
};

class FSDPUnit : public GradientGroup {
 public:
  enum class State { Sharded, Gathering, Unsharded };
  enum class TrainingState { Idle, Forward, PreBackward, PostBackward };

  // Parameters sharded over one group of ranks: `comm` (each FSDPParam's rows are its rank's).
  // Their gradients are the mean over `averaged_over` ranks' losses (pre-divided: Gloo has no
  // average): comm's ranks, or for the experts under expert parallelism the whole shard group's,
  // whose every rank routes tokens to them.
  struct Part {
    std::vector<FSDPParam*> params;
    Communicator* comm = nullptr;
    int64_t averaged_over = 1;
  };
  // `index`: the block's, or n_layers for the root. `parts`: one, or a mixture's block's two under
  // expert parallelism. `replicas`: the group that holds the same shards under hybrid sharding
  // (null for FSDP). `keep_unsharded`: with one rank in every part's group and no replicas, keep the
  // cast (above); ignored else. `kernels`: the model's, for the gradient sums.
  FSDPUnit(int64_t index, std::string name, std::vector<Part> parts, bool reshard_after_forward,
           FSDPCommContext& context, Communicator* replicas, bool keep_unsharded, const KernelChoices& kernels);

  const std::string& name() const { return name_; }
  State state() const { return state_; }
  TrainingState training_state() const { return training_state_; }
  bool reshard_after_forward() const { return reshard_after_forward_ && !keep_unsharded_; }
  bool keeps_unsharded() const { return keep_unsharded_; }
  const std::vector<FSDPParam*>& params() const { return params_; }

  // --- the calls the engine makes ---
  // Waits for the parameters (gathering them if no prefetch did) and puts tensors into the
  // model's slots, produced through the unit's gradient node.
  void pre_forward();
  // The block ran: free its gathered parameters if the unit reshards after forward.
  void post_forward();
  // The gradient of the block's output is ready: gather the parameters again for its backward.
  void pre_backward();
  // From autograd: frees the gathered parameters, accumulates the gradients over micro-batches
  // and, on the last one (`requires_gradient_sync`), starts the reduce-scatter.
  void post_backward(const std::vector<at::Tensor>& grads);
  // Waits for the reduce-scatters (if any are in flight), then adds this rank's rows to each sharded
  // parameter's .grad(), or, with replicas, starts their all-reduces.
  void advance_gradients();
  // All of that, and waits for the all-reduce: the sharded .grad()s are complete.
  void finish_gradients();

  // --- the sharded state ---
  // Casts the shards into each part's flat input and starts its all-gather (no-op unless SHARDED).
  void issue_unshard();
  // Waits for the all-gathers and copies each parameter's rows out into its unsharded storage.
  void wait_unshard();
  // Frees the unsharded storages.
  void reshard();
  // Back to IDLE and SHARDED (a unit that keeps its cast: UNSHARDED), whatever was in progress
  // (the engine, after each backward and after evaluation).
  void reset();
  // The shards were changed (the optimizer stepped): a kept cast is made again at its next use.
  void parameters_changed() { cast_current_ = false; }
  // Puts the unsharded parameters into the model's slots through the unit's gradient node
  // (requires UNSHARDED; pre_forward does it, and an activation-checkpointing recompute).
  void fill_slots();

  bool requires_gradient_sync = true;

  // GradientGroup
  std::vector<at::Tensor> forward_views() override;
  void gradients_ready(const std::vector<at::Tensor>& grads) override { post_backward(grads); }

 private:
  // A part and what it has in flight.
  struct Shards {
    std::vector<FSDPParam*> params;
    size_t first = 0;  // where its parameters start in params_
    Communicator* comm = nullptr;
    int64_t averaged_over = 1;
    std::vector<int64_t> offsets;  // of each parameter inside a rank's block
    int64_t block_numel = 0;       // sum over parameters of their padded blocks
    // With FP8 parameters (FSDPParam::float8_gather) the block is bytes: these instead.
    bool bytes = false;
    std::vector<int64_t> byte_offsets;
    int64_t block_bytes = 0;
    at::Tensor gather_in, gather_out, reduce_out;
    PendingCollective gather, reduce, replicate;
    bool alone() const { return comm->size() == 1; }
  };

  void transition(std::initializer_list<TrainingState> from, TrainingState to, const char* call);
  // The reduced rows into each sharded parameter's .grad(); back to NONE.
  void complete_gradients();
  // One rank without replicas: the step's sums straight into the .grad()s (divided where the mean
  // is over more ranks).
  void add_whole_gradients(const Shards& part, const GradientTotals& total);
  // The reduce-scatter of a part's sums (the unit before finishes its own first).
  void start_reduction(Shards& part, const std::vector<at::Tensor>& total);
  // One rank: the shards cast into the unsharded storages, in one launch where CUDA can.
  void cast_shards(const std::vector<FSDPParam*>& params);
  // A kept cast that still holds the shards' values.
  bool cast_is_current() const;

  void trace(StepEvent::Op op) {
    if (context_.trace) context_.trace->record(op, index_);
  }

  int64_t index_;
  std::string name_;
  std::vector<FSDPParam*> params_;  // every part's, in order
  std::vector<Shards> parts_;
  Communicator* replicas_;
  bool reshard_after_forward_;
  bool keep_unsharded_;
  bool cast_current_ = false;
  std::vector<int64_t> cast_versions_;  // of each shard when it was cast
  FSDPCommContext& context_;
  State state_ = State::Sharded;
  TrainingState training_state_ = TrainingState::Idle;

  GradientAccumulator accumulator_;  // fp32 unsharded sums across micro-batches
  enum class GradState { None, Reducing, Replicating };
  GradState grad_state_ = GradState::None;
};

}  // namespace zb
