#include "ddp/ddp_engine.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include "optim/clip.h"

namespace zb {

struct DDPEngine::Bucket {
  std::vector<size_t> members;  // indices into masters_
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  at::Tensor accumulated;  // fp32 flat, across micro-batches
  at::Tensor flat;         // being all-reduced
  PendingCollective pending;
};

namespace {

// Identity from a bucket's parameters to tensors over the same storage; its backward hands the
// bucket's gradients to the engine, and gives the parameters none itself.
struct BucketForward : torch::autograd::Function<BucketForward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                DDPEngine* engine, DDPEngine::Bucket* bucket,
                                                at::TensorList params) {
    ctx->saved_data["engine"] = reinterpret_cast<int64_t>(engine);
    ctx->saved_data["bucket"] = reinterpret_cast<int64_t>(bucket);
    ctx->saved_data["n"] = static_cast<int64_t>(params.size());
    torch::autograd::variable_list out;
    for (const at::Tensor& p : params)
      out.push_back(at::empty({0}, p.options().requires_grad(false))
                        .set_(p.storage(), p.storage_offset(), p.sizes(), p.strides()));
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* engine = reinterpret_cast<DDPEngine*>(ctx->saved_data["engine"].toInt());
    auto* bucket = reinterpret_cast<DDPEngine::Bucket*>(ctx->saved_data["bucket"].toInt());
    engine->bucket_ready(*bucket, grads);
    return torch::autograd::variable_list(static_cast<size_t>(ctx->saved_data["n"].toInt()) + 2);
  }
};

}  // namespace

DDPEngine::DDPEngine(Llama& model, Communicator& comm, double bucket_mb) : model_(model), comm_(comm) {
  masters_.reserve(model.parameters().size());  // params_ points into it
  for (const auto& np : model.parameters()) {
    masters_.push_back(*np.slot);
    params_.push_back({np.name, &masters_.back()});
  }
  // Buckets in reverse model order, each up to bucket_mb of fp32 gradients (a larger parameter
  // gets a bucket of its own).
  const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb * (1 << 20) / 4));
  for (size_t k = masters_.size(); k-- > 0;) {
    if (buckets_.empty() || buckets_.back()->numel + masters_[k].numel() > limit)
      buckets_.push_back(std::make_unique<Bucket>());
    Bucket& b = *buckets_.back();
    b.members.push_back(k);
    b.offsets.push_back(b.numel);
    b.numel += masters_[k].numel();
  }
}

DDPEngine::~DDPEngine() = default;

at::Tensor DDPEngine::forward(const at::Tensor& tokens) {
  const auto slots = model_.parameters();
  for (auto& b : buckets_) {
    std::vector<at::Tensor> members;
    for (size_t k : b->members) members.push_back(masters_[k]);
    const auto views = BucketForward::apply(this, b.get(), at::TensorList(members));
    for (size_t j = 0; j < b->members.size(); ++j) *slots[b->members[j]].slot = views[j];
  }
  return model_.forward(tokens);
}

void DDPEngine::bucket_ready(Bucket& b, const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  const auto device = masters_.front().device();
  if (!b.accumulated.defined()) b.accumulated = at::zeros({b.numel}, at::TensorOptions().device(device));
  for (size_t j = 0; j < b.members.size(); ++j)
    if (j < grads.size() && grads[j].defined())
      b.accumulated.narrow(0, b.offsets[j], grads[j].numel()).add_(grads[j].reshape({-1}));
  if (!sync_) return;
  // The mean over ranks: pre-divide, then sum (Gloo has no average).
  b.flat = b.accumulated / static_cast<double>(comm_.size());
  b.accumulated = at::Tensor();
  b.pending = comm_.all_reduce_sum(b.flat);
}

void DDPEngine::finish_backward() {
  at::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    if (!b->flat.defined()) continue;
    b->pending.wait();
    for (size_t j = 0; j < b->members.size(); ++j) {
      at::Tensor& p = masters_[b->members[j]];
      at::Tensor g = b->flat.narrow(0, b->offsets[j], p.numel()).view(p.sizes());
      at::Tensor& grad = p.mutable_grad();
      if (grad.defined()) grad.add_(g);
      else grad = g;  // a view of the bucket, as DDP's gradient_as_bucket_view
    }
    b->flat = at::Tensor();
  }
}

std::vector<std::vector<int64_t>> DDPEngine::global_shapes() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& m : masters_) out.push_back(m.sizes().vec());
  return out;
}

std::vector<at::Tensor> DDPEngine::sharded_tensors() const { return masters_; }

at::Tensor DDPEngine::clip_grad_norm_(double max_norm) {
  return zb::clip_grad_norm_(masters_, max_norm);  // gradients are identical on every rank
}

}  // namespace zb
