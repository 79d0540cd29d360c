// train_hsdp: pretraining with hybrid sharding, ZeroBand's name for it: the sharding engine over
// each node's ranks, its shards replicated across the nodes, so that only the gradients' all-reduce
// crosses the slower network between nodes. See training_program.cpp.
#include "training_program.h"

int main(int argc, char** argv) {
  return zb::training_main(argc, argv, zb::EngineKind::Sharded, "train_hsdp", /*over_nodes=*/true);
}
