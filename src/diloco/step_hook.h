#pragma once
// DiLoCo around the Trainer's steps (train/trainer.h), which knows it only through this hook:
//   before the first step  the outer copies take the parameters (unless a checkpoint or a joiner's
//                          source set them); elastic replicas form their first generation (round 0);
//   after each step        the outer steps due then; under elastic replicas the joiners admitted
//                          take their state from the round's source, and this replica's rows of
//                          the run's stream follow its membership;
//   a joiner's start       (diloco.join) it waits for the running run's next outer step and takes
//                          the run's state there.
#include <cstdint>
#include <optional>

#include "diloco/diloco.h"

namespace zb {

class DataLoader;
class Optimizer;

// The Trainer's step counters: a joiner takes them from its source.
struct StepCounters {
  int64_t step = 0;     // steps taken, skipped ones included
  int64_t skipped = 0;  // steps not applied (not finite)
};

// What DiLoCo did after a step, for the step's record.
struct DiLoCoStepReport {
  std::optional<OuterSyncStats> outer;   // the outer steps taken, if any
  std::optional<RoundReport> membership; // elastic: this replica's membership, when new
};

class DiLoCoHook {
 public:
  // Over the run's parts, which outlive it: DiLoCo's outer optimizer, the engine holding the
  // parameters, the optimizer and the data loader (a joiner takes their state), and the replica's
  // world (its phase for the watchdog).
  DiLoCoHook(DiLoCo& diloco, ParallelModel& engine, Optimizer& optimizer, DataLoader& data, Communicator& world,
             int64_t total_steps);

  // Before step `counters.step` (1-based) runs.
  void before_step(const StepCounters& counters);
  // After its optimizer, the gradients freed (their memory holds DiLoCo's temporaries).
  DiLoCoStepReport after_step(StepCounters& counters);
  // A joiner: waits for the outer step that admits it and takes the run's state and counters.
  void join_run(StepCounters& counters);
  // A checkpoint of step `step` restored the outer copies and the exchanges in flight (and, for
  // elastic replicas, the stream row its round 0 continues from).
  void restore(int64_t step);
  void restore_stream_rows(int64_t rows) { resumed_stream_rows_ = rows; }

 private:
  // This replica's rows of the run's stream follow its new membership.
  const RoundReport& follow(const RoundReport& round);
  // A round that admitted joiners: the round's source sends and the joiners take the counters,
  // DiLoCo's outer copies (the parameters equal them then) and momentum, and the optimizer state
  // when round.with_optimizer; the other members take no part. Returns the bytes this rank took.
  int64_t share_state(const RoundReport& round, StepCounters& counters);

  DiLoCo& diloco_;
  ParallelModel& engine_;
  Optimizer& optimizer_;
  DataLoader& data_;
  Communicator& world_;
  int64_t total_steps_;
  bool outer_set_ = false;     // the outer copies hold the run's state (first step, checkpoint, source)
  bool in_membership_ = false; // elastic: round 0 done, or admitted as a joiner
  int64_t resumed_stream_rows_ = 0;
  std::optional<RoundReport> new_membership_;  // for the next step's record
};

}  // namespace zb
