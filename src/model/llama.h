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
#include <string>
#include <vector>

#include "model/attention.h"
#include "model/float8.h"
#include "model/layers.h"
#include "model/model_args.h"
#include "model/tensor_parallel.h"

namespace zb {

struct NamedParameter {
  std::string name;  // e.g. "layers.3.attention.wq.weight"
  at::Tensor* slot;  // the tensor the forward reads (engines fill it; the optimizer's are theirs)
  int64_t layer = -1;  // the block it belongs to; -1: none (embedding, final norm, head)
  // Under tensor parallelism the slot holds `tp` of the whole parameter, of `global_shape`;
  // otherwise the whole (tp.dim -1, global_shape the slot's shape).
  std::vector<int64_t> global_shape;
  TpSlice tp;
};

struct TransformerBlockParams {
  at::Tensor wq, wk, wv, wo;  // attention
  at::Tensor w1, w2, w3;      // feed_forward
  at::Tensor attention_norm, ffn_norm;
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
  PerToken checkpointed;   // a block under activation checkpointing: its output alone
  PerToken head;           // the final norm and the chunked loss's per-token products
  int64_t head_weight = 0; // the chunked loss's fp32 gradient of this rank's head rows, [vocab / tp, dim]
};
// `cuda`: the device's kernels (fused RMSNorm keeps less than the CPU's composite one); `tp`:
// the tensor-parallel degree (model/tensor_parallel.h; 1: none); `fused_kernels`: SwiGLU's gate as
// one node (runtime.fused_kernels, model/layers.h: it keeps one hidden-sized tensor less); `cp`:
// the context-parallel degree (model/context_parallel.h: the tokens are this rank's share of the
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
  // Tensor parallelism (model/tensor_parallel.h): with a `tp` group of more than one rank, every
  // parameter is this rank's slice (parameters()[i].tp), the residual stream between stages is
  // this rank's positions [B, T/tp, D], and the loss is the whole micro-batch's on every rank.
  // Throws std::invalid_argument when the shapes do not divide (check_tensor_parallel).
  Llama(const ModelArgs& args, const at::TensorOptions& options, bool allocate_parameters = true,
        TensorParallelGroup* tp = nullptr);

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
  // embed..head_loss; `before_stage(s, input)`, where given, runs before each stage: 0 the
  // embedding (input undefined), i + 1 block i, n_layers + 1 the loss, with the stage's input
  // (an engine's hook: DDP makes its buckets' nodes there).
  using StageHook = std::function<void(int64_t stage, const at::Tensor& input)>;
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const Documents& documents = {},
                  const StageHook& before_stage = {}) const;

  void set_compute_dtype(at::ScalarType dtype) { compute_dtype_ = dtype; }
  // Which of our fused operators and kernels the forward and backward use (all by default); the
  // engines' gradient sums follow the same choices.
  void set_kernels(const KernelChoices& kernels) { kernels_ = kernels; }
  const KernelChoices& kernels() const { return kernels_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // Context parallelism (model/context_parallel.h): with a `cp` group of more than one rank, the
  // tokens given to loss() and the stages are this rank's positions of each row (cp_positions),
  // the documents are cp_documents', and every block gathers the keys and values of the whole row
  // from the group, or with `ring` passes them around it (ring_attention). Null: none.
  void set_context_parallel(TensorParallelGroup* cp, bool ring = false) {
    cp_ = cp && cp->size() > 1 ? cp : nullptr;
    cp_ring_ = ring;
  }

  // Float8 linears (model/float8.h): the block projections not filtered out and whose shapes FP8
  // GEMMs take, with `tokens` in a micro-batch's GEMMs, multiply in FP8. Returns the names of
  // those left in the compute dtype because of their shape (for the start-up log).
  std::vector<std::string> set_float8(const Float8Linears& float8, int64_t tokens);
  // Whether block `layer`'s projection `name` ("wq", .., "w3") runs in FP8.
  bool in_float8(int64_t layer, const std::string& name) const;

  const ModelArgs& args() const { return args_; }
  // The tensor-parallel group's size (1 without) and this rank's place in it.
  int64_t tp_size() const { return tp_ ? tp_->size() : 1; }
  int64_t tp_rank() const { return tp_ ? tp_->rank() : 0; }
  // All parameters in model order (the order of param_specs()).
  const std::vector<NamedParameter>& parameters() const { return params_; }
  std::vector<at::Tensor> parameter_tensors() const;
  int64_t num_params() const;

  TransformerBlockParams& block(int64_t layer) { return layers_[layer]; }
  at::Tensor& tok_embeddings() { return tok_embeddings_; }
  at::Tensor& norm() { return norm_; }
  at::Tensor& output() { return output_; }

  Llama(const Llama&) = delete;  // slots point into this object
  Llama& operator=(const Llama&) = delete;

 private:
  ModelArgs args_;
  TensorParallelGroup* tp_ = nullptr;  // null, or a group of 2 ranks or more
  TensorParallelGroup* cp_ = nullptr;  // the same for context parallelism
  bool cp_ring_ = false;               // its keys and values passed around the group
  // This rank's heads: query heads, and key/value heads with where they start in the whole
  // (under TP with fewer key/value heads than ranks, wk and wv stay whole on every rank and each
  // rank reads the one its query heads share).
  int64_t heads_ = 0, kv_heads_ = 0, kv_start_ = 0;
  bool kv_replicated_ = false;
  at::ScalarType compute_dtype_ = at::kFloat;
  KernelChoices kernels_;
  Float8Linears float8_;
  std::vector<std::vector<std::string>> float8_names_;  // per block, its projections in FP8
  // x w_i^T for block `layer`'s projections `names` (one input): in FP8 where set_float8 put them
  // (model/float8.h), else through the shared-input node (model/layers.h) or at::linear.
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

// Whether `args` can be split over `tp` ranks; throws std::invalid_argument naming what does not
// divide: query heads, key/value heads (a multiple of tp, or dividing it: then each is shared),
// the FFN's hidden size and the vocabulary. tp 1 always can.
void check_tensor_parallel(const ModelArgs& args, int64_t tp);

// Mean next-token cross-entropy of logits [B, T, V] against targets [B, T].
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

// Fills `t` in place with N(mean, std) truncated to [lo, hi] (inverse-CDF sampling).
void trunc_normal_(at::Tensor& t, double mean, double std, double lo, double hi);

}  // namespace zb
