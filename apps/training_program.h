#pragma once
#include <functional>

#include "parallel/mesh.h"
#include "train/build.h"

namespace zb {
// What a test program may do to a run's parts between building and training (wrap the engine to
// put a fault in it: tests/faulty_train.cpp). The training programs pass none.
using AdjustParts = std::function<void(TrainingParts& parts)>;
// The whole program: command line, launch, training loop, logs, metrics, checkpoints.
// `over_nodes` (train_hsdp): hybrid sharding with a shard group per node (its LOCAL_WORLD_SIZE
// ranks) replicated across the nodes, unless the config's [parallel] says otherwise. Ends the
// process with its exit code where no CUDA context exists (util/device.h's end_process).
int training_main(int argc, char** argv, EngineKind engine, const char* program, bool over_nodes = false,
                  const AdjustParts& adjust_parts = {});
}  // namespace zb
