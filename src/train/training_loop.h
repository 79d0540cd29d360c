#pragma once
// The run from its first step to its last, as torchtitan's Trainer.train(): each step with the
// flags it carries to the other ranks, the evaluation cadence, the metrics, the profiler,
// checkpoint saves, what a step that is not finite decides, and the stop on a signal (SIGTERM,
// SIGINT: the step finishes, the checkpoint is saved and the run ends with exit 0). A training
// program builds the parts and loads their state (apps/training_program.cpp), then hands them here.
#include <cstdint>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "checkpoint/state.h"
#include "config/config.h"
#include "dist/comm.h"
#include "train/trainer.h"

namespace zb {

class TrainingLoop {
 public:
  // `checkpoints` saves `saved` (the trainer as checkpoints see it: train/checkpoint_state.h).
  // `predicted_peak`: the memory estimate's peak bytes, in every metrics record.
  TrainingLoop(const Config& config, Trainer& trainer, Communicator& world, CheckpointWriter& checkpoints,
               TrainingState& saved, std::optional<int64_t> predicted_peak);
  // To optim.total_steps, or to the end of the step a signal came in. A joiner of an elastic DiLoCo
  // run (diloco.join) first waits for the run's next outer step. Throws naming the step that failed.
  void run();

 private:
  const Config& config_;
  Trainer& trainer_;
  Communicator& world_;
  CheckpointWriter& checkpoints_;
  TrainingState& saved_;
  std::optional<int64_t> predicted_peak_;
};

}  // namespace zb
