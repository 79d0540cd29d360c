#pragma once
// The Trainer as checkpoints see it (checkpoint/state.h): what they save and what they restore.
// The Trainer knows nothing of checkpoints; this adapter is the whole of what joins them.
#include <cstdint>
#include <vector>

#include "checkpoint/state.h"
#include "train/trainer.h"

namespace zb {

class TrainerCheckpointState : public TrainingState {
 public:
  explicit TrainerCheckpointState(Trainer& trainer) : trainer_(trainer) {}

  ParallelModel& parallel() override { return trainer_.parallel(); }
  Optimizer& optimizer() override { return trainer_.optimizer(); }
  // The engine's and the optimizer's tensors; under DiLoCo they are each replica's own, under its
  // name ("replica_<r>/..."), beside the outer copies the replicas share.
  std::vector<StateTensor> state() override;
  int64_t replica() override { return trainer_.mesh().replica(); }
  const ModelArgs& model_args() const override { return trainer_.model_args(); }
  int64_t step() const override { return trainer_.step(); }
  int64_t skipped_steps() const override { return trainer_.skipped_steps(); }
  int64_t tokens_per_step() const override { return trainer_.tokens_per_step(); }
  int64_t data_rows_consumed() const override { return trainer_.data_rows_consumed(); }
  // DiLoCo's exchanges in flight at `step` take room in state() before the load.
  void prepare_restore(int64_t step) override;
  void restore_position(int64_t step, int64_t skipped, uint64_t seed, std::optional<DataPosition> data) override {
    trainer_.restore_position(step, skipped, seed, data);
  }
  int64_t stream_rows() const override { return trainer_.stream_rows_read(); }
  void restore_stream_rows(int64_t rows) override { trainer_.restore_stream_rows(rows); }

 private:
  Trainer& trainer_;
};

}  // namespace zb
