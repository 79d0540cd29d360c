#include "ddp/ddp_engine.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "parallel/clip.h"
#include "parallel/gradient_group.h"

namespace zb {

// A bucket: consecutive parameters (in backward order) whose gradients are all-reduced as one
// flat tensor.
class DDPEngine::Bucket : public GradientGroup {
 public:
  Bucket(const bool& sync, Communicator& comm) : sync_(sync), comm_(comm) {}

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
    const std::vector<at::Tensor> total = accumulator_.add(grads, shapes, members_.front()->device(), sync_);
    if (!sync_) return;
    // One flat fp32 tensor in member order (a missing gradient counts as zero).
    std::vector<at::Tensor> parts;
    for (size_t j = 0; j < members_.size(); ++j)
      parts.push_back(j < total.size() && total[j].defined()
                          ? total[j].reshape({-1}).to(at::kFloat)
                          : at::zeros({members_[j]->numel()}, members_[j]->options().requires_grad(false)));
    flat_ = at::cat(parts);
    divide_for_mean_over_ranks(flat_, comm_.size());
    pending_ = comm_.all_reduce_sum(flat_);
  }

  // Waits for the all-reduce and adds the averaged gradients to the replicas' .grad().
  void finish() {
    if (!flat_.defined()) return;
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

std::vector<std::vector<size_t>> ddp_buckets(const std::vector<int64_t>& numels, double bucket_mb) {
  const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20) / 4));
  std::vector<std::vector<size_t>> buckets;
  int64_t filled = 0;  // elements in the last bucket
  for (size_t k = numels.size(); k-- > 0;) {
    if (buckets.empty() || filled + numels[k] > limit) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(k);
    filled += numels[k];
  }
  return buckets;
}

DDPEngine::DDPEngine(Llama& model, Communicator& comm, double bucket_mb) : model_(model), comm_(comm) {
  replicas_.reserve(model.parameters().size());  // buckets point into it
  std::vector<int64_t> numels;
  for (const auto& np : model.parameters()) {
    replicas_.push_back(*np.slot);
    numels.push_back(np.slot->numel());
  }
  // Where the forward first reads each parameter: 0 the embedding (the parameters before the
  // first block's), i + 1 block i, L + 1 the head (those after the last block's).
  const auto& named = model.parameters();
  const int64_t L = model.args().n_layers;
  std::vector<int64_t> stage_of(named.size());
  bool seen_block = false;
  for (size_t k = 0; k < named.size(); ++k) {
    seen_block = seen_block || named[k].layer >= 0;
    stage_of[k] = named[k].layer >= 0 ? named[k].layer + 1 : seen_block ? L + 1 : 0;
  }
  for (const std::vector<size_t>& members : ddp_buckets(numels, bucket_mb)) {
    buckets_.push_back(std::make_unique<Bucket>(sync_, comm_));
    int64_t first = L + 1;
    for (size_t k : members) {
      buckets_.back()->add(&replicas_[k]);
      buckets_.back()->slot_of.push_back(k);
      first = std::min(first, stage_of[k]);
    }
    first_stage_.push_back(first);
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
  size_t next = buckets_.size();
  const int64_t loss_stage = model_.args().n_layers + 1;
  return model_.loss(tokens, targets, documents, [&](int64_t stage) {
    while (next > 0 && first_stage_[next - 1] <= stage) buckets_[--next]->fill_slots(model_.parameters());
    if (stage == loss_stage && trace_) trace_->record(StepEvent::Op::Loss, -1);
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
