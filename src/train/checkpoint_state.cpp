#include "train/checkpoint_state.h"

namespace zb {

TrainerCheckpointState::TrainerCheckpointState(Trainer& trainer)
    : trainer_(trainer), model_(trainer.parallel(), trainer.optimizer(), trainer.diloco() != nullptr) {
  owners_ = {&model_, &trainer.data_loader()};
  if (Stateful* diloco = trainer.diloco_hook()) owners_.push_back(diloco);
  if (Stateful* balance = trainer.expert_balance()) owners_.push_back(balance);
}

}  // namespace zb
