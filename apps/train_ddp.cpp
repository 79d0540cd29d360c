// train_ddp: the same training with data parallelism (replicated parameters, bucketed gradient
// all-reduce), the baseline of the FSDP-vs-DDP comparison. See training_program.cpp.
#include "training_program.h"

int main(int argc, char** argv) {
  return zb::training_main(argc, argv, zb::EngineKind::Replicated, "train_ddp");
}
