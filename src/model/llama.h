#pragma once
// A Llama-style decoder (ZeroBand / torchtitan layout): token embedding, pre-norm blocks with
// RMSNorm, rotary grouped-query attention and a SwiGLU MLP, a final norm and an untied head that
// returns fp32 logits. No biases.
//
// The model does not own its parameters in a module tree: it holds one at::Tensor slot per
// parameter and reads whatever tensor is in the slot when it runs. The sharding engine swaps a
// block's slots for gathered full views before the block runs and back afterwards, without
// rebuilding anything.
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/attention.h"
#include "model/feed_forward.h"
#include "model/layers.h"
#include "model/model_args.h"
#include "model/moe.h"
#include "model_parallel/tensor_parallel.h"

namespace zb {

struct NamedParameter {
  std::string name;  // e.g. "layers.3.attention.wq.weight"
  at::Tensor* slot;  // the tensor the forward reads (engines fill it; the optimizer's are theirs)
  int64_t layer = -1;  // the block it belongs to; -1: none (embedding, final norm, head)
  // Under tensor parallelism the slot holds `tp` of the whole parameter, of `global_shape`;
  // otherwise the whole (tp.dim -1, global_shape the slot's shape).
  std::vector<int64_t> global_shape;
  TpSlice tp;
  // A mixture's routed experts' stack ([E, rows, cols], the model's only 3-D parameters): split by
  // whole experts under expert parallelism.
  bool experts() const { return global_shape.size() == 3; }
};

// Another way to multiply some of a block's projections, installed on the model from outside it
// (Llama::set_projections): FP8's GEMMs (float8/float8_projections.h).
class Projections {
 public:
  virtual ~Projections() = default;
  // Whether block `layer`'s projection `name` ("wq", .., "w3") is multiplied here.
  virtual bool takes(int64_t layer, const std::string& name) const = 0;
  // x w_i^T for each of `weights`, block `layer`'s projections that this takes, sharing the input
  // x: [.., N_i] in x's dtype, in order.
  virtual std::vector<at::Tensor> linears(int64_t layer, const at::Tensor& x,
                                          const std::vector<at::Tensor>& weights) const = 0;
};

// What an engine does around the model's one pass over its stages (Llama::loss): the sharding
// engine gathers a block's parameters before it runs, prefetches the next block's and frees them
// after, as FSDP2's pre- and post-forward hooks do; DDP makes its gradient buckets' nodes before
// the first stage that reads them. Each call does nothing unless overridden.
class StageHooks {
 public:
  virtual ~StageHooks() = default;
  virtual void before_embedding() {}
  // Before block `layer` runs on `input`; `checkpointed`: under activation checkpointing.
  virtual void before_block(int64_t layer, const at::Tensor& input, bool checkpointed) {}
  virtual void after_block(int64_t layer, const at::Tensor& output) {}
  virtual void before_loss(const at::Tensor& input) {}
  // Activation checkpointing (checkpointed_block): whether block `layer` keeps only its input and
  // runs again in backward (when its input requires a gradient), and what comes before that
  // second run (the sharding engine gathers the block's parameters again into its slots).
  virtual bool checkpointed(int64_t layer) const { return false; }
  virtual void before_recompute(int64_t layer) {}
};

// What the forward keeps for backward, in bytes, as the memory estimate counts it
// (plan/memory_estimate.cpp): each figure is defined beside the forward it describes
// (llama.cpp), so a change to a layer and to its memory are made together. Per token of a
// micro-batch of N tokens, in two parts: `own` for each position the rank holds of the residual
// stream (N / tp of them under tensor parallelism, all N without) and `all` for every token
// (what the column-parallel products read of the gathered sequence, and their outputs at this
// rank's heads and FFN columns).
struct ForwardSaves {
  struct PerToken {
    int64_t own = 0, all = 0;
    int64_t bytes(int64_t tokens, int64_t tp) const { return own * (tokens / tp) + all * tokens; }
  };
  int64_t norm = 0;        // one RMSNorm, per position it normalises
  PerToken block;          // one transformer block, its output included
  PerToken moe_block;      // one whose feed-forward is a mixture of experts (args.moe_layer)
  PerToken checkpointed;   // a block under activation checkpointing: its output alone
  PerToken head;           // the final norm and the chunked loss's per-token products
  int64_t head_weight = 0; // the chunked loss's fp32 gradient of this rank's head rows, [vocab / tp, dim]
};
// `cuda`: the device's kernels (fused RMSNorm keeps less than the CPU's composite one); `tp`:
// the tensor-parallel degree (model_parallel/tensor_parallel.h; 1: none); `fused_kernels`: SwiGLU's gate as
// one node (runtime.fused_kernels, model/layers.h: it keeps one hidden-sized tensor less); `cp`:
// the context-parallel degree (model_parallel/context_parallel.h: the tokens are this rank's share of the
// rows, and attention keeps the keys and values of the whole rows, or with `cp_ring` its own and
// its output in fp32, or with `cp_packed` (runtime.cp_varlen) those its pieces of queries read,
// packed: under the causal mask half a chunk more than the whole row's).
ForwardSaves forward_saves(const ModelArgs& args, at::ScalarType compute_dtype, bool cuda, int64_t tp = 1,
                           bool fused_kernels = true, int64_t cp = 1, bool cp_ring = false, bool cp_packed = false);

class Llama {
 public:
  // Allocates every parameter (fp32 master weights, requires_grad) with `options`' device; on
  // the meta device nothing is allocated (use it to inspect shapes). With allocate_parameters =
  // false the parameters are shapes only (meta) while the rest (RoPE tables) is on `options`'
  // device: the sharding engine then creates each parameter with init_parameter, keeps its own
  // rows and frees the rest, so that no rank ever holds the whole model.
  //
  // Tensor parallelism (model_parallel/tensor_parallel.h): with a `tp` group of more than one rank, every
  // parameter is this rank's slice (parameters()[i].tp), the residual stream between stages is
  // this rank's positions [B, T/tp, D], and the loss is the whole micro-batch's on every rank.
  // Throws std::invalid_argument when the shapes do not divide (check_tensor_parallel).
  Llama(const ModelArgs& args, const at::TensorOptions& options, bool allocate_parameters = true,
        ModelParallelGroup* tp = nullptr);

  // ZeroBand's initialisation (uses the global generator: seed it first): embedding N(0, 1);
  // wq, wk, wv, w1 truncated normal std 0.02; wo, w2, w3 std 0.02/sqrt(2*(layer+1)); head
  // truncated normal std dim^-0.5 cut at 3 std; norms 1. Parameter by parameter in parameters()
  // order, each with init_parameter.
  void init_weights();
  // Fills `t`, a tensor of the shape of parameters()[i], as init_weights() fills that parameter.
  // Called for every i in order from the same generator state, on the same device, it draws the
  // same random numbers in the same order: the values equal init_weights()'s. Under tensor
  // parallelism it draws the whole parameter and keeps this rank's slice: the values are the
  // model's without it.
  void init_parameter(size_t i, at::Tensor& t) const;

  // tokens [B, T] int64 -> logits [B, T, vocab] fp32. Weights are cast to `compute_dtype` where
  // used (a no-op when they already are), so fp32 master weights get fp32 gradients. Attention
  // is causal within `documents` where given (attention.h), else over each whole row.
  at::Tensor forward(const at::Tensor& tokens, const Documents& documents = {}) const;

  // The three stages forward() chains, for engines that run code between them:
  at::Tensor embed(const at::Tensor& tokens) const;  // [B, T] -> [B, T, dim] ([B, T/tp, dim] under TP)
  at::Tensor block_forward(int64_t layer, const at::Tensor& h,
                           const Documents& documents = {}) const;  // [B, T, dim] -> same
  at::Tensor head(const at::Tensor& h) const;        // -> logits [B, T, vocab] (not under TP)
  // Training's end: the mean next-token cross-entropy of the logits head(h) gives, against
  // targets [B, T], computed in chunks of tokens without ever holding them all (chunked_loss.h).
  at::Tensor head_loss(const at::Tensor& h, const at::Tensor& targets) const;
  // embed, the blocks, head_loss: the one pass over the stages, with an engine's `hooks` around
  // each (they must outlive the backward under activation checkpointing).
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents = {},
                  StageHooks* hooks = nullptr) const;

  void set_compute_dtype(at::ScalarType dtype) { compute_dtype_ = dtype; }
  // Which of our fused operators and kernels the forward and backward use (all by default); the
  // engines' gradient sums follow the same choices.
  void set_kernels(const KernelChoices& kernels) { kernels_ = kernels; }
  const KernelChoices& kernels() const { return kernels_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // Context parallelism (model_parallel/context_parallel.h): with a `cp` group of more than one rank, the
  // tokens given to loss() and the stages are this rank's positions of each row (cp_positions),
  // the documents are cp_documents', and every block gathers the keys and values of the whole row
  // from the group, or with `ring` passes them around it (ring_attention). Null: none.
  // Expert parallelism (model/moe.h's routed_experts_parallel): with an `ep` group of more than one
  // rank, each mixture computes the experts of this rank's part ([rank E/ep, (rank + 1) E/ep)) for
  // the rows every rank of the group routes to them, and reads those alone in its expert stacks'
  // slots, [E/ep, ...] (the sharding engine puts them there: fsdp/fsdp_engine.h). Null: none.
  void set_expert_parallel(ModelParallelGroup* ep) { ep_ = ep && ep->size() > 1 ? ep : nullptr; }
  void set_context_parallel(ModelParallelGroup* cp, bool ring = false) {
    cp_ = cp && cp->size() > 1 ? cp : nullptr;
    cp_ring_ = ring;
  }

  // Projections multiplied another way (FP8: float8/float8_projections.h's apply_float8); null:
  // all of them in the compute dtype.
  void set_projections(std::shared_ptr<const Projections> projections) { projections_ = std::move(projections); }
  // Whether block `layer`'s projection `name` ("wq", .., "w3") is multiplied by those.
  bool projected_outside(int64_t layer, const std::string& name) const {
    return projections_ && projections_->takes(layer, name);
  }

  const ModelArgs& args() const { return args_; }
  // The tensor-parallel group's size (1 without) and this rank's place in it.
  int64_t tp_size() const { return tp_ ? tp_->size() : 1; }
  int64_t tp_rank() const { return tp_ ? tp_->rank() : 0; }
  // All parameters in model order (the order of param_specs()).
  const std::vector<NamedParameter>& parameters() const { return params_; }
  std::vector<at::Tensor> parameter_tensors() const;
  int64_t num_params() const;

  TransformerBlockParams& block(int64_t layer) { return layers_[layer]; }
  // A mixture of experts' balancing state, one per block (defined only for those args.moe_layer
  // names: their bias, their tokens counted since the last step).
  std::vector<ExpertLoad>& expert_loads() { return expert_loads_; }
  const std::vector<ExpertLoad>& expert_loads() const { return expert_loads_; }
  // The attention logits' watch (optim/qk_clip.h): with it on, every training forward (and a
  // checkpointed block's recomputation, not its first pass) raises each block's fp32 [local heads]
  // to its heads' largest pre-softmax logit over the micro-batch (max_attention_logits; the ring's
  // own scores under CP's ring). Starts at -inf, as reset_attention_logits leaves it.
  void watch_attention_logits(bool on);
  const std::vector<at::Tensor>& attention_logits() const { return attention_logits_; }
  void reset_attention_logits();
  // The gradient the blocks give their auxiliary losses (model/moe.h): 1 over the micro-batches,
  // as the trainer divides each micro-batch's loss.
  void set_aux_loss_scale(double scale) {
    if (moe_) moe_->set_aux_loss_scale(scale);
  }
  at::Tensor& tok_embeddings() { return tok_embeddings_; }
  at::Tensor& norm() { return norm_; }
  at::Tensor& output() { return output_; }

  Llama(const Llama&) = delete;  // slots point into this object
  Llama& operator=(const Llama&) = delete;

 private:
  ModelArgs args_;
  ModelParallelGroup* tp_ = nullptr;  // null, or a group of 2 ranks or more
  ModelParallelGroup* cp_ = nullptr;  // the same for context parallelism
  ModelParallelGroup* ep_ = nullptr;  // and for expert parallelism
  bool cp_ring_ = false;               // its keys and values passed around the group
  // This rank's heads: query heads, and key/value heads with where they start in the whole
  // (under TP with fewer key/value heads than ranks, wk and wv stay whole on every rank and each
  // rank reads the one its query heads share).
  int64_t heads_ = 0, kv_heads_ = 0, kv_start_ = 0;
  bool kv_replicated_ = false;
  at::ScalarType compute_dtype_ = at::kFloat;
  KernelChoices kernels_;
  // h through every block, `hooks` (if any) around each.
  at::Tensor blocks(at::Tensor h, const Documents& documents, StageHooks* hooks) const;
  std::shared_ptr<const Projections> projections_;
  // The blocks' feed-forwards: dense, or a mixture of experts (model/moe.h) in the blocks
  // args.moe_layer names, each with its balancing state in expert_loads_ (empty for dense blocks).
  DenseSwiGLU dense_;
  std::unique_ptr<MixtureOfExperts> moe_;
  std::vector<ExpertLoad> expert_loads_;
  std::vector<at::Tensor> attention_logits_;  // per block, with the watch on (empty without)
  // x w_i^T for block `layer`'s projections `names` (one input): those set_projections took there,
  // the rest through the shared-input node (model/layers.h) or at::linear.
  std::vector<at::Tensor> project(int64_t layer, const std::vector<const char*>& names, const at::Tensor& x,
                                  const std::vector<at::Tensor>& weights) const;
  at::Tensor tok_embeddings_, norm_, output_;
  std::vector<TransformerBlockParams> layers_;
  RopeTables rope_;
  std::vector<NamedParameter> params_;
  // How each parameter is initialised, in parameters() order: std 0 means "fill with 1" (norms);
  // cut is where the truncated normal is clipped (0: the plain normal of the embedding).
  struct Init {
    double std = 0, cut = 0;
  };
  std::vector<Init> init_;
};

// Block `layer` of `model` on h under activation checkpointing: the forward keeps only h (and the
// documents), records no graph; the backward calls hooks.before_recompute(layer), runs the block
// again with a graph and back-propagates through it (model/activation_checkpoint.cpp). The
// gradients are the plain block's; `hooks` must outlive the backward.
at::Tensor checkpointed_block(const Llama& model, int64_t layer, const at::Tensor& h, const Documents& documents,
                              StageHooks& hooks);

// Whether `args` can be split over `tp` ranks; throws std::invalid_argument naming what does not
// divide: query heads, key/value heads (a multiple of tp, or dividing it: then each is shared),
// the FFN's hidden size and the vocabulary. tp 1 always can.
void check_tensor_parallel(const ModelArgs& args, int64_t tp);

// Mean next-token cross-entropy of logits [B, T, V] against targets [B, T].
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

// Fills `t` in place with N(mean, std) truncated to [lo, hi] (inverse-CDF sampling).
void trunc_normal_(at::Tensor& t, double mean, double std, double lo, double hi);

}  // namespace zb
