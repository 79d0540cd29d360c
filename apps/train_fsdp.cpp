// train_fsdp: pretraining with the sharding engine (FSDP2-style). See training_program.cpp.
#include "training_program.h"

int main(int argc, char** argv) {
  return zb::training_main(argc, argv, zb::EngineKind::Sharded, "train_fsdp");
}
