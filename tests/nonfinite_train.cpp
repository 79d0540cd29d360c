// train_fsdp (or train_ddp, with ZB_TEST_PARALLELISM=ddp) with a fault, for tests/failures.sh:
// at the steps ZB_TEST_NONFINITE_GRAD_STEPS lists ("3,4") the last rank finds a NaN in its
// reduced gradients, so that only the gradient norm's all-reduce tells the others. The fault is
// this test program's (Trainer::set_gradient_hook); the training programs carry none.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dist/world.h"
#include "training_program.h"

int main(int argc, char** argv) {
  std::vector<int64_t> steps;
  if (const char* list = std::getenv("ZB_TEST_NONFINITE_GRAD_STEPS")) {
    std::stringstream in(list);
    for (std::string item; std::getline(in, item, ',');) steps.push_back(std::stoll(item));
  }
  const char* parallelism = std::getenv("ZB_TEST_PARALLELISM");
  const bool ddp = parallelism && std::string(parallelism) == "ddp";
  const zb::World world = zb::detect_world();
  const bool last_rank = world.rank == world.size - 1;
  auto poison = [steps, last_rank](int64_t step, zb::ParallelModel& model) {
    if (!last_rank || std::find(steps.begin(), steps.end(), step) == steps.end()) return;
    for (const zb::ShardedParameter& p : model.parameters())
      if (p.tensor->grad().defined() && p.tensor->numel() > 0) {
        p.tensor->mutable_grad().view(-1).narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
        return;
      }
  };
  return zb::training_main(argc, argv, ddp ? zb::Parallelism::DDP : zb::Parallelism::FSDP, "nonfinite_train",
                           /*over_nodes=*/false, poison);
}
