#pragma once
#include "train/trainer.h"

namespace zb {
// The whole program: command line, launch, training loop, logs, metrics, checkpoints.
// `over_nodes` (train_hsdp): hybrid sharding with a shard group per node (its LOCAL_WORLD_SIZE
// ranks) replicated across the nodes, unless the config's [parallel] says otherwise.
// `gradient_hook`: the trainer's (Trainer::set_gradient_hook), for test programs' faults.
int training_main(int argc, char** argv, Parallelism parallelism, const char* program, bool over_nodes = false,
                  const Trainer::GradientHook& gradient_hook = {});
}  // namespace zb
