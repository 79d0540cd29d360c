#include "ddp/ddp_engine.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "parallel/clip.h"
#include "parallel/gradient_group.h"
#include "util/phase.h"

namespace zb {

// A bucket: consecutive parameters (in backward order) whose gradients are all-reduced as one
// flat tensor.
class DDPEngine::Bucket : public GradientGroup {
 public:
  Bucket(const bool& sync, Communicator& comm, const KernelChoices& kernels)
      : sync_(sync), comm_(comm), accumulator_(kernels) {}

  void add(at::Tensor* replica) { members_.push_back(replica); }

  // The model reads tensors over the replicas' storage, through the bucket's gradient node.
  void fill_slots(const std::vector<NamedParameter>& slots) {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor* p : members_) leaves.push_back(*p);
    const std::vector<at::Tensor> views = through_gradient_group(*this, leaves);
    for (size_t j = 0; j < views.size(); ++j) *slots[slot_of[j]].slot = views[j];
  }

  std::vector<at::Tensor> forward_views() override {
    std::vector<at::Tensor> out;
    for (const at::Tensor* p : members_)
      out.push_back(at::empty({0}, p->options().requires_grad(false))
                        .set_(p->storage(), p->storage_offset(), p->sizes(), p->strides()));
    return out;
  }

  void gradients_ready(const std::vector<at::Tensor>& grads) override {
    at::NoGradGuard no_grad;
    std::vector<std::vector<int64_t>> shapes;
    for (const at::Tensor* p : members_) shapes.push_back(p->sizes().vec());
    const std::vector<at::Tensor> total = accumulator_.add(grads, shapes, members_.front()->device(), sync_).sums;
    if (!sync_) return;
    // One flat fp32 tensor in member order (a missing gradient counts as zero).
    std::vector<at::Tensor> parts;
    for (size_t j = 0; j < members_.size(); ++j)
      parts.push_back(j < total.size() && total[j].defined()
                          ? total[j].reshape({-1}).to(at::kFloat)
                          : at::zeros({members_[j]->numel()}, members_[j]->options().requires_grad(false)));
    flat_ = at::cat(parts);
    divide_for_mean_over_ranks(flat_, comm_.size());
    Phase phase("zb.ddp.all_reduce");
    pending_ = comm_.all_reduce_sum(flat_);
  }

  // Waits for the all-reduce and adds the averaged gradients to the replicas' .grad().
  void finish() {
    if (!flat_.defined()) return;
    Phase phase("zb.ddp.finish_all_reduce");
    pending_.wait();
    int64_t offset = 0;
    for (at::Tensor* p : members_) {
      at::Tensor g = flat_.narrow(0, offset, p->numel()).view(p->sizes());
      offset += p->numel();
      at::Tensor& grad = p->mutable_grad();
      if (grad.defined()) grad.add_(g);
      else grad = g;  // a view of the bucket, as DDP's gradient_as_bucket_view
    }
    flat_ = at::Tensor();
  }

  std::vector<size_t> slot_of;  // each member's index in the model's parameter list

 private:
  std::vector<at::Tensor*> members_;
  const bool& sync_;
  Communicator& comm_;
  GradientAccumulator accumulator_;
  at::Tensor flat_;  // being all-reduced
  PendingCollective pending_;
};

std::vector<DDPBucket> ddp_buckets(const std::vector<int64_t>& numels, const std::vector<int64_t>& layers,
                                   int64_t n_layers, double bucket_mb) {
  std::vector<int64_t> stage_of(numels.size());
  bool seen_block = false;
  for (size_t k = 0; k < numels.size(); ++k) {
    seen_block = seen_block || layers[k] >= 0;
    stage_of[k] = layers[k] >= 0 ? layers[k] + 1 : seen_block ? n_layers + 1 : 0;
  }
  const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20) / 4));
  std::vector<DDPBucket> buckets;
  int64_t filled = 0;  // elements in the last bucket
  for (size_t k = numels.size(); k-- > 0;) {
    if (buckets.empty() || filled + numels[k] > limit) {
      buckets.push_back({{}, n_layers + 1});
      filled = 0;
    }
    buckets.back().members.push_back(k);
    buckets.back().first_stage = std::min(buckets.back().first_stage, stage_of[k]);
    filled += numels[k];
  }
  return buckets;
}

DDPEngine::DDPEngine(Llama& model, Communicator& comm, double bucket_mb) : model_(model), comm_(comm) {
  replicas_.reserve(model.parameters().size());  // buckets point into it
  std::vector<int64_t> numels, layers;
  for (const auto& np : model.parameters()) {
    replicas_.push_back(*np.slot);
    numels.push_back(np.slot->numel());
    layers.push_back(np.layer);
  }
  for (const DDPBucket& b : ddp_buckets(numels, layers, model.args().n_layers, bucket_mb)) {
    buckets_.push_back(std::make_unique<Bucket>(sync_, comm_, model.kernels()));
    for (size_t k : b.members) {
      buckets_.back()->add(&replicas_[k]);
      buckets_.back()->slot_of.push_back(k);
    }
    first_stage_.push_back(b.first_stage);
  }
}

DDPEngine::~DDPEngine() = default;

at::Tensor DDPEngine::loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents) {
  // Each bucket's gradient node is made just before the forward first reads one of its members.
  // Autograd runs the most recently made of its ready nodes first, so backward reaches a bucket as
  // soon as the block that read it first is done, and its all-reduce overlaps the rest of
  // backward (made all at the start, every bucket would wait for the end of backward). Buckets
  // are in reverse model order: filled from the last, and within a stage the lower index last, so
  // that buckets reduce in their order.
  buckets_to_fill_ = buckets_.size();
  return model_.loss(tokens, targets, documents, this);
}

void DDPEngine::reach_stage(int64_t stage, const at::Tensor& input) {
  size_t& next = buckets_to_fill_;
  while (next > 0 && first_stage_[next - 1] <= stage) buckets_[--next]->fill_slots(model_.parameters());
  if (!trace_) return;
  const int64_t loss_stage = model_.args().n_layers + 1;
  if (stage == loss_stage) trace_->record(StepEvent::Op::Loss, -1);
  // A block's backward is done when its input's gradient is: marked there (after the buckets
  // that backward completed have started their all-reduces).
  if (stage > 0 && stage < loss_stage && input.requires_grad())
    input.register_hook([trace = trace_, block = stage - 1](const at::Tensor& grad) {
      trace->record(StepEvent::Op::Backward, block);
      return grad;
    });
}

void DDPEngine::finish_backward() {
  for (auto& b : buckets_) b->finish();
}

std::vector<ShardedParameter> DDPEngine::parameters() {
  std::vector<ShardedParameter> out;
  const auto& named = model_.parameters();
  for (size_t k = 0; k < replicas_.size(); ++k)
    out.push_back({named[k].name, &replicas_[k], replicas_[k].sizes().vec(), 0, /*replicated=*/true});
  return out;
}

at::Tensor DDPEngine::clip_grad_norm_(double max_norm) {
  return zb::clip_grad_norm_(replicas_, max_norm);  // gradients are identical on every rank
}

std::vector<std::pair<std::string, at::Tensor>> DDPEngine::gather_full_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto& named = model_.parameters();
  for (size_t k = 0; k < replicas_.size(); ++k) out.emplace_back(named[k].name, replicas_[k].detach().clone());
  return out;
}

}  // namespace zb
