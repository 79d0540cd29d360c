#pragma once
#include "train/trainer.h"

namespace zb {
// The whole program: command line, launch, training loop, logs, metrics, checkpoints.
int training_main(int argc, char** argv, Parallelism parallelism, const char* program);
}  // namespace zb
