// train_fsdp (or train_ddp, with ZB_TEST_PARALLELISM=ddp) with a fault, for tests/e2e/test_failures.py:
// at the steps ZB_TEST_NONFINITE_GRAD_STEPS lists ("3,4", counted from the process's start) the
// last rank finds a NaN in its reduced gradients, so that only the gradient norm's all-reduce
// tells the others. The fault is
// this test program's (a wrapper around the engine); the training programs carry none.
#include <algorithm>
#include <memory>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "dist/world.h"
#include "training_program.h"

namespace {

// The engine with a fault: before clipping (once a step, after the gradients are reduced), at the
// steps listed, a NaN in this rank's first non-empty gradient. Everything else is the engine's.
class PoisonedEngine : public zb::ParallelModel {
 public:
  PoisonedEngine(std::unique_ptr<zb::ParallelModel> inner, std::vector<int64_t> steps)
      : inner_(std::move(inner)), steps_(std::move(steps)) {}
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const zb::Documents& documents) override {
    return inner_->loss(tokens, targets, documents);
  }
  void set_requires_gradient_sync(bool sync) override { inner_->set_requires_gradient_sync(sync); }
  void finish_backward() override { inner_->finish_backward(); }
  void reshard() override { inner_->reshard(); }
  void parameters_changed() override { inner_->parameters_changed(); }
  bool keeps_casts() const override { return inner_->keeps_casts(); }
  std::vector<zb::ShardedParameter> parameters() override { return inner_->parameters(); }
  at::Tensor clip_grad_norm_(double max_norm) override {
    if (std::find(steps_.begin(), steps_.end(), ++step_) != steps_.end())
      for (const zb::ShardedParameter& p : inner_->parameters())
        if (p.tensor->grad().defined() && p.tensor->numel() > 0) {
          p.tensor->mutable_grad().view(-1).narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
          break;
        }
    return inner_->clip_grad_norm_(max_norm);
  }
  std::vector<std::pair<std::string, at::Tensor>> gather_full_parameters() override {
    return inner_->gather_full_parameters();
  }
  int64_t replica() const override { return inner_->replica(); }
  int64_t tp_rank() const override { return inner_->tp_rank(); }
  void set_trace(zb::StepTrace* trace) override { inner_->set_trace(trace); }

 private:
  std::unique_ptr<zb::ParallelModel> inner_;
  std::vector<int64_t> steps_;
  int64_t step_ = 0;  // clip_grad_norm_ runs once a step (Trainer::train_step)
};

}  // namespace

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
  auto poison = [steps, last_rank](zb::TrainingParts& parts) {
    if (last_rank) parts.engine = std::make_unique<PoisonedEngine>(std::move(parts.engine), steps);
  };
  return zb::training_main(argc, argv, ddp ? zb::Parallelism::DDP : zb::Parallelism::FSDP, "nonfinite_train",
                           /*over_nodes=*/false, poison);
}
