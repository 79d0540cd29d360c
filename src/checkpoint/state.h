#pragma once
// A run as checkpoints see it: its step counters, its parameters' shapes, and the parts that own
// the rest of its state (util/stateful.h), in the order they are saved and restored. Checkpoints
// depend on this, not on the engines or the trainer: train/checkpoint_state.h lists the Trainer's
// parts.
#include <cstdint>
#include <string>
#include <vector>

#include "model/model_args.h"
#include "optim/optimizer.h"
#include "parallel/parallel_model.h"
#include "util/stateful.h"

namespace zb {

// The Trainer's step counters: a checkpoint saves them ("step", "skipped_steps") and a resume (or
// a DiLoCo joiner, from its source) sets them.
struct StepCounters {
  int64_t step = 0;     // steps taken, skipped ones included
  int64_t skipped = 0;  // steps not applied (not finite)
};

// A tensor shaped like this rank's part of parameter `p` (the parameter itself, or state kept
// for it), placed where p's part sits in the whole.
StateTensor state_tensor(const std::string& name, const at::Tensor& local, const ShardedParameter& p,
                         bool per_replica = false);

// The engine's parameters ("model/<param>") and the optimizer's state for them
// ("optim/<param>.<key>", placed where its parameter is), parameters first, in a fixed order.
// `per_replica` (DiLoCo): each replica's own, but for the scalars (AdamW's step).
class ModelState : public Stateful {
 public:
  ModelState(ParallelModel& parallel, const Optimizer& optimizer, bool per_replica)
      : parallel_(parallel), optimizer_(optimizer), per_replica_(per_replica) {}
  std::vector<StateTensor> tensors() override;

 private:
  ParallelModel& parallel_;
  const Optimizer& optimizer_;
  bool per_replica_;
};

class TrainingState {
 public:
  virtual ~TrainingState() = default;
  // The parameters: their shapes name the model a checkpoint must match; told when they changed.
  virtual ParallelModel& parallel() = 0;
  virtual const ModelArgs& model_args() const = 0;
  virtual StepCounters& counters() = 0;
  virtual int64_t tokens_per_step() const = 0;
  // Which copy of the replicated state this rank holds: copy 0 writes it, and a per-replica
  // tensor is saved as "replica_<r>/<name>".
  virtual int64_t replica() = 0;
  // The parts that own the state, in the order they are saved and restored.
  virtual std::vector<Stateful*> owners() = 0;
};

}  // namespace zb
