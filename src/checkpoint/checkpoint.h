#pragma once
// Sharded checkpoints of the training state (checkpoint/state.h), in one format whatever the
// engine: each rank writes its own rows of every parameter and optimizer state (under DDP, where
// every rank holds everything, each writes the rows it would own if sharded); rank 0 adds the
// metadata. A checkpoint is written under a temporary name and renamed into
// place only after every rank has finished, so a crash during a save never damages the last good
// checkpoint. Loading reshards from the global row layout, so a checkpoint saved on W ranks
// resumes on any number of ranks, under train_fsdp or train_ddp.
//
//   <ckpt.path>/step_00000100/meta.json          format, step, tokens, world size, shapes, loader
//   <ckpt.path>/step_00000100/rank_00003.json    index: name, global shape, first row, rows, offset
//   <ckpt.path>/step_00000100/rank_00003.bin     the rows, fp32, in index order
//   <ckpt.path>/latest                           the name of the newest complete checkpoint
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>

#include "checkpoint/state.h"
#include "config/config.h"
#include "dist/comm.h"

namespace zb {

constexpr int kCheckpointFormatVersion = 1;

// Saves a run's training state after `run.step()` steps into ckpt.path. Every rank calls save()
// at the same step: it copies this rank's shards to host memory and returns; a background thread
// writes them, and rank 0 renames the checkpoint into place once every rank has written (the
// ranks count themselves in the rendezvous store, off the collectives' path). A save waits for
// the previous one; finish() waits for the last (call it before exiting).
//
// Failures: the constructor checks that every rank can create and write ckpt.path. A state with
// a non-finite value is never saved. A write that fails on any rank (disk full, quota, EIO), or
// rank 0 failing to put the checkpoint into place, makes the save fail on every rank: its
// temporary directory is removed, the previous checkpoint and `latest` stay as they were, and
// failed() turns true so that the loop can stop all ranks (every rank's writer waits for rank 0's
// outcome: none reports a save as done that is not).
class CheckpointWriter {
 public:
  // Collective when ckpt.path is set: throws on every rank if some rank cannot write there.
  CheckpointWriter(const Config& config, Communicator& comm);
  ~CheckpointWriter();
  // Returns the directory the checkpoint will have. Collective. Throws, saving nothing, when a
  // parameter or optimizer state is not finite on some rank.
  std::string save(TrainingState& run);
  // The cadence: saves (and returns the directory) every ckpt.interval steps, at the last step,
  // and when the run is `stopping` (a signal); never without ckpt.path.
  std::optional<std::string> save_if_due(TrainingState& run, bool stopping);
  // Waits for the save in flight; rethrows its error (every rank throws for a save that failed
  // on any rank).
  void finish();
  // Whether the save in flight has already failed, on this rank's knowledge; no waiting.
  bool failed() const { return failed_; }
  // The newest complete checkpoint in ckpt.path, else the one the run resumed from, else "".
  // Waits for the save in flight without throwing: a failure of it stays for finish() and failed().
  std::string last_good();

 private:
  const Config& config_;
  Communicator& comm_;
  std::thread writer_;
  int64_t saves_ = 0;                // this writer's, alike on every rank (the store's key)
  std::string error_;                // the writer's failure, read after joining it
  std::atomic<bool> failed_{false};  // set by the writer as soon as the save is known to fail
  std::atomic<bool> abandon_{false}; // the destructor on an error path: stop waiting for others
};

// The directory `spec` names: "latest" (the newest complete checkpoint in ckpt.path) or a path.
// Throws std::runtime_error when there is none.
std::string resolve_checkpoint(const Config& config, const std::string& spec);

// Loads a checkpoint into the run (each owner's tensors and record, then the step counters),
// resharding to this world size. Collective. Throws std::runtime_error naming the checkpoint for
// one that is partial, damaged or of another model; nothing is modified in that case.
void load_checkpoint(const std::string& dir, TrainingState& run, Communicator& comm);

// Starts a run from a Hugging Face model directory (as export_hf writes): every rank takes its
// rows of each parameter. Throws naming the directory for another model's shapes.
void init_from_hf(const std::string& dir, TrainingState& run);

}  // namespace zb
