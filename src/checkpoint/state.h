#pragma once
// What a checkpoint holds, gathered from the components that own it: the parallel engine's
// parameters (as this rank holds them: shards or replicas), the optimizer's state for each
// parameter, and the run's position (steps, data). Checkpoints depend on this, not on the engines
// or the trainer: the Trainer (train/trainer.h) implements TrainingState.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "model/model_args.h"
#include "optim/optimizer.h"
#include "parallel/parallel_model.h"

namespace zb {

// One tensor of the training state as this rank holds it.
struct StateTensor {
  std::string name;                   // "model/<param>" or "optim/<param>.<key>"
  at::Tensor local;                   // rows [row_start, row_start + local.size(0)) of the whole
  std::vector<int64_t> global_shape;  // empty: a scalar (AdamW's step), the same on every rank
  int64_t row_start = 0;
  bool replicated = false;            // every rank holds the same rows
  // Each replica holds its own value under its own name (DiLoCo's inner state, "replica_<r>/..."):
  // every replica writes it. Otherwise one copy is written, the first replica's.
  bool per_replica = false;
  // Tensor parallelism (ShardedParameter): the rows' first column in the whole (a block of
  // columns when local.size(1) is less than the whole's), and whether every rank of the TP group
  // holds the same rows (TP rank 0 writes them).
  int64_t col_start = 0;
  bool tp_shared = false;
};

// A tensor shaped like this rank's part of parameter `p` (the parameter itself, or state kept
// for it), placed where p's part sits in the whole.
StateTensor state_tensor(const std::string& name, const at::Tensor& local, const ShardedParameter& p,
                         bool per_replica = false);

// Every tensor of the training state, parameters first, in a fixed order. An optimizer state
// tensor sits where its parameter does.
std::vector<StateTensor> training_state(ParallelModel& parallel, const Optimizer& optimizer);

// A run as checkpoints see it: what they save and what they restore.
// Where a checkpoint left the training data: rows of the run's data stream read (data/loader.h's
// stream_rows_read), at its batch size and row length.
struct DataPosition {
  int64_t stream_rows = 0, batch_size = 0, seq_length = 0;
};

class TrainingState {
 public:
  virtual ~TrainingState() = default;
  virtual ParallelModel& parallel() = 0;
  virtual Optimizer& optimizer() = 0;
  // Everything saved and restored: by default training_state(parallel(), optimizer()).
  virtual std::vector<StateTensor> state() { return training_state(parallel(), optimizer()); }
  // Which copy of the state this rank holds (ParallelModel::replica() by default).
  virtual int64_t replica() { return parallel().replica(); }
  virtual const ModelArgs& model_args() const = 0;
  // Steps taken (skipped ones included) and of those not applied.
  virtual int64_t step() const = 0;
  virtual int64_t skipped_steps() const = 0;
  virtual int64_t tokens_per_step() const = 0;
  // Rows of the training data each rank has consumed (recorded for inspection; a resume derives
  // the position from the step).
  virtual int64_t data_rows_consumed() const = 0;
  // Before a checkpoint of `step` steps is loaded into state(): what it holds may depend on the
  // step (DiLoCo's exchanges in flight).
  virtual void prepare_restore(int64_t /*step*/) {}
  // Continue after `step` steps, `skipped` of them not applied, with the data seeded by `seed`;
  // `data`: where the checkpoint left the data stream (absent in older checkpoints).
  virtual void restore_position(int64_t step, int64_t skipped, uint64_t seed, std::optional<DataPosition> data) = 0;
  // Elastic DiLoCo: the rows of the run's data stream read by then (data/loader.h), saved with the
  // checkpoint and handed back on a resume.
  virtual int64_t stream_rows() const { return 0; }
  virtual void restore_stream_rows(int64_t /*rows*/) {}
};

}  // namespace zb
