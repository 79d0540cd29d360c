#pragma once
// The Trainer as checkpoints see it (checkpoint/state.h): its counters and the parts that own the
// rest of its state, in the order they are saved and restored. The Trainer knows nothing of
// checkpoints; this list is the whole of what joins them.
#include <cstdint>
#include <vector>

#include "checkpoint/state.h"
#include "train/trainer.h"

namespace zb {

class TrainerCheckpointState : public TrainingState {
 public:
  explicit TrainerCheckpointState(Trainer& trainer);

  ParallelModel& parallel() override { return trainer_.parallel(); }
  const ModelArgs& model_args() const override { return trainer_.model_args(); }
  StepCounters& counters() override { return trainer_.counters(); }
  int64_t tokens_per_step() const override { return trainer_.tokens_per_step(); }
  // Under DiLoCo each replica's inner state is its own: the replica is the mesh's, not the engine's.
  int64_t replica() override { return trainer_.diloco() ? trainer_.mesh().replica() : trainer_.parallel().replica(); }
  std::vector<Stateful*> owners() override { return owners_; }

 private:
  Trainer& trainer_;
  ModelState model_;  // the parameters and the optimizer's state, each replica's own under DiLoCo
  std::vector<Stateful*> owners_;
};

}  // namespace zb
