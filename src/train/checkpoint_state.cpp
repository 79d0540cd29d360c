#include "train/checkpoint_state.h"

#include <string>
#include <utility>

namespace zb {

std::vector<StateTensor> TrainerCheckpointState::state() {
  std::vector<StateTensor> state = training_state(trainer_.parallel(), trainer_.optimizer());
  DiLoCo* diloco = trainer_.diloco();
  if (!diloco) return state;
  // The inner parameters and optimizer state are each replica's own; the outer ones are shared.
  for (StateTensor& t : state) t.per_replica = !t.global_shape.empty();
  for (StateTensor& t : diloco->state()) state.push_back(std::move(t));
  for (StateTensor& t : state)
    if (t.per_replica) t.name = "replica_" + std::to_string(trainer_.mesh().replica()) + "/" + t.name;
  return state;
}

void TrainerCheckpointState::prepare_restore(int64_t step) {
  if (DiLoCo* diloco = trainer_.diloco()) diloco->prepare_restore(step, trainer_.config().optim.total_steps);
}

}  // namespace zb
