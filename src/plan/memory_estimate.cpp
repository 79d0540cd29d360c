#include "plan/memory_estimate.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "parallel/row_shard.h"
#include "config/resolved_run.h"
#include "model/chunked_loss.h"
#include "model/layers.h"
#include "model/model_args.h"
#include "config/model_config.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "optim/tensor_parallel_muon.h"
#include "diloco/diloco.h"
#include "plan/step_plan.h"
#include "util/log.h"

namespace zb {

namespace {

// Live bytes by kind as the replay allocates and frees; the kinds at the highest total.
class Timeline {
 public:
  void at(std::string where) { where_ = std::move(where); }
  void alloc(const std::string& kind, int64_t bytes) {
    live_[kind] += bytes;
    total_ += bytes;
    if (total_ > peak_) {
      peak_ = total_;
      at_peak_ = live_;
      peak_at_ = where_;
    }
  }
  void free(const std::string& kind, int64_t bytes) {
    live_[kind] -= bytes;
    total_ -= bytes;
  }
  int64_t live(const std::string& kind) const {
    const auto it = live_.find(kind);
    return it == live_.end() ? 0 : it->second;
  }
  int64_t peak() const { return peak_; }
  const std::string& peak_at() const { return peak_at_; }
  const std::map<std::string, int64_t>& at_peak() const { return at_peak_; }

 private:
  std::map<std::string, int64_t> live_, at_peak_;
  int64_t total_ = 0, peak_ = 0;
  std::string where_, peak_at_;
};

// One sharding unit (a block, or the root: embedding, final norm, head) as rank 0 holds it. Under
// expert parallelism a mixture's block holds its E/ep experts of each stack, sharded apart.
struct UnitSizes {
  int64_t full = 0;    // elements of all its parameters (this rank's experts of a stack)
  int64_t gathered = 0;  // elements of their unsharded storage: every rank's padded block
  int64_t local = 0;   // elements of rank 0's shards
  int64_t hidden_local = 0;  // of those, in Muon's matrices
  int64_t experts_local = 0;  // of those, in expert stacks its expert shard group holds
};

// The step's memory on rank 0, replayed over the step plan's events (plan/step_plan.h) in the
// order the engine makes them: one handler per kind of event, each allocating and freeing what
// the step does there, on a timeline that keeps the peak. Not counted under hybrid sharding: the
// unit whose reduced rows are being all-reduced over the replicas keeps them one unit longer (a
// W-th of a block, in place).
//
// Under tensor parallelism (model_parallel/tensor_parallel.h) rank 0 holds its slice of every matrix,
// this rank's heads, FFN columns and vocabulary rows, and a tp-th of each micro-batch's positions
// in the residual stream; what the column-parallel products read, the gathered sequence, is
// whole. The TP group's collectives in the plan allocate nothing counted here: a gathered
// sequence is the activation the next product keeps (ForwardSaves), and the gradients gathered
// in backward are counted where they are made.
class MemoryReplay {
 public:
  MemoryReplay(const Config& c, const StepPlan& plan, const ResolvedRun& run);

  // What the step holds from its start: shards, optimizer state, DiLoCo's copies, tables, data.
  void start_of_step();
  void visit(const StepEvent& ev);
  // After the plan's events: Muon's work, then DiLoCo's outer step.
  void optimizer_step();
  void diloco_outer_step();
  MemoryEstimate result() const;

 private:
  // Handlers, one per kind of event.
  void on_micro_batch(const StepEvent& ev);
  void on_collective(const StepEvent& ev);
  void on_unshard(int64_t u);
  void on_forward(int64_t u);
  void on_loss();
  void on_recompute(int64_t u);
  void on_reshard(int64_t u);
  void on_backward(int64_t u);
  void on_optimizer();

  // What happens between events.
  bool checkpointed(int64_t i) const { return c_.train.ac_ckpt > 0 && i % c_.train.ac_ckpt == 0; }
  // What block i keeps whole (a mixture of experts' its own), and under activation checkpointing.
  int64_t block_keeps_of(int64_t i) const { return a_.moe_layer(i) ? moe_block_keeps_ : block_keeps_; }
  int64_t keeps_of(int64_t i) const { return checkpointed(i) ? saves_.checkpointed.bytes(N_, tp_) : block_keeps_of(i); }
  std::string block_name(int64_t u) const { return "block " + std::to_string(u); }
  void partial_sums();
  void grad_shards(int64_t u);
  void finish_reduce();
  void reduce(const StepEvent& ev);
  void end_micro_batch();
  void unit_backward(int64_t u);
  void post_backward_sums(int64_t u);

  const Config& c_;
  const StepPlan& plan_;
  const ModelArgs a_;
  const c10::Device device_;
  const bool cuda_;
  const int64_t W_, tp_;  // parameters are sharded over the shard group of W_ ranks
  const TpShare share_;   // this rank's part of each dimension tensor parallelism splits
  const int64_t L_, D_, V_, H_, F_, Q_, K_;
  const int64_t N_;    // tokens per micro-batch (this rank's share of them under context parallelism)
  const int64_t own_;  // of them, the positions this rank holds in the residual stream
  const int64_t A_;    // micro-batches per step
  const int64_t e_;    // bytes of a gathered weight / activation
  const bool muon_, reduce_every_;
  // parallel.cp_rotate = "ring": the working set of ring attention (model_parallel/context_parallel.cpp),
  // in forward and in backward, bytes; 0 otherwise.
  int64_t ring_forward_ = 0, ring_backward_ = 0;
  int64_t mask_ = 0;   // the attention mask's bytes, where there is one
  std::vector<ParamSpec> specs_;
  std::vector<UnitSizes> units_;  // blocks 0..L-1, then the root
  int64_t local_ = 0, hidden_local_ = 0;
  ForwardSaves saves_;
  int64_t block_keeps_ = 0, moe_block_keeps_ = 0;
  // Gloo's reduce-scatter (the CPU's) copies its input as it starts; NCCL's does not.
  int64_t reduce_scatter_copies_ = 0;
  // One rank without replicas adds its sums straight into the shards' .grad(), no reduce-scatter;
  // so do the experts of one rank (expert parallelism over the whole shard group) without replicas.
  bool whole_gradients_ = false, whole_expert_gradients_ = false;
  // Kept casts (train.keep_unsharded): every unit's, from the step before, all step long; the
  // plan's casts then allocate nothing.
  bool keep_ = false;
  int64_t head_grad_ = 0;  // the head's gradient, made by the loss
  int64_t largest_fragment_ = 0;

  Timeline t_;
  std::vector<int64_t> gathering_;  // each unit's all-gather buffers in flight
  int64_t reducing_ = -1;           // the unit whose reduce-scatters are in flight
  int64_t reducing_bytes_ = 0;      // their buffers
  std::vector<bool> has_grad_;      // a unit's shards have their .grad() this step
  std::vector<bool> has_expert_grad_;  // and its experts, where they are added whole
  int64_t m_ = -1;                  // the micro-batch under way
  bool backward_ = false;           // its backward has begun
  bool sync_ = false;               // its gradients are reduced
  std::string mb_;                  // its name in the timeline
};

MemoryReplay::MemoryReplay(const Config& c, const StepPlan& plan, const ResolvedRun& run)
    : c_(c),
      plan_(plan),
      a_(resolve_model_args(c)),
      device_(run.device),
      cuda_(run.device.is_cuda()),
      W_(plan.shard),
      tp_(plan.tp),
      share_(tp_share(a_, tp_)),
      L_(a_.n_layers),
      D_(a_.dim),
      V_(share_.vocab),
      H_(share_.heads),
      F_(share_.ffn),
      Q_(share_.heads * a_.head_dim()),
      K_(share_.kv_heads * a_.head_dim()),
      N_(c.train.micro_bs * c.data.seq_length / plan.cp),
      own_(N_ / tp_),
      A_(plan.micro_batches),
      e_(at::elementSize(run.compute_dtype)),
      muon_(c.optim.optim.type == "muon"),
      reduce_every_(plan.reduce_every_micro_batch) {
  // Document attention without the flash kernel reads an additive mask [B, 1, T, T] in the
  // compute dtype, made once per micro-batch and shared by every block (attention.h).
  // Under context parallelism the mask is made unless runtime.cp_varlen, for this rank's queries
  // [B, 1, T/cp, T].
  const AttentionPath& attention = run.attention;
  mask_ = attention.mask() ? e_ * c.data.seq_length * N_ : 0;

  units_.resize(static_cast<size_t>(L_ + 1));
  specs_ = param_specs(a_, tp_);  // this rank's slices under TP
  for (const ParamSpec& p : specs_) {
    UnitSizes& u = p.layer >= 0 ? units_[static_cast<size_t>(p.layer)] : units_[static_cast<size_t>(L_)];
    const EngineShard held = engine_shard(p, W_, c.parallel.ep, tp_);
    const RowShard s = held.rows();
    int64_t numel = 1;
    for (const int64_t n : held.shape) numel *= n;
    u.full += numel;
    u.gathered += held.ranks * s.block_numel();
    u.local += s.numel_of(0);
    if (held.experts) u.experts_local += s.numel_of(0);
    if (muon_ && param_role(p.name, static_cast<int64_t>(p.shape.size())) == ParamRole::Hidden) {
      u.hidden_local += s.numel_of(0);
    }
  }
  for (const auto& u : units_) {
    local_ += u.local;
    hidden_local_ += u.hidden_local;
  }

  // What the forward keeps for backward (defined beside it: model/llama.h's forward_saves).
  saves_ = forward_saves(a_, run.compute_dtype, cuda_, tp_, run.kernels.on(Fused::Gate), plan.cp,
                         attention.cp_ring(), attention.cp_packed());
  if (attention.cp_ring()) {
    // A block of the ring is this rank's t = T/cp queries against one rank's t keys, in fp32: the
    // scores turned into probabilities in place ([B, H, t, t]), the block's keys and values at
    // every query head and two partial outputs ([B, t, H, Dh] each), and the block held and the
    // one arriving. Backward: the probabilities and their gradient; the keys and values and the
    // queries' gradient; the blocks held and arriving, with their gradients in fp32.
    const int64_t t = c.data.seq_length / plan.cp, scores = 4 * c.train.micro_bs * H_ * t * t;
    const int64_t kv = 2 * K_ * N_;  // one rank's keys and values, elements
    ring_forward_ = scores + 4 * 4 * Q_ * N_ + 2 * e_ * kv;
    ring_backward_ = 2 * scores + 3 * 4 * Q_ * N_ + 2 * e_ * kv + 2 * 4 * kv;
  }
  block_keeps_ = saves_.block.bytes(N_, tp_);
  moe_block_keeps_ = saves_.moe_block.bytes(N_, tp_);
  reduce_scatter_copies_ = cuda_ ? 0 : 1;
  whole_gradients_ = W_ == 1 && plan.replicate == 1;
  whole_expert_gradients_ = c.parallel.ep == W_ * tp_ && plan.replicate == 1;
  keep_ = plan.keep_unsharded;
  head_grad_ = e_ * V_ * D_;
  gathering_.assign(static_cast<size_t>(L_ + 1), 0);
  has_grad_.assign(static_cast<size_t>(L_ + 1), false);
  has_expert_grad_.assign(static_cast<size_t>(L_ + 1), false);
}

// Under TP a block's forward ends with the MLP's partial sums [N, D] and their copy in the order
// the reduce-scatter sends them (model_parallel/tensor_parallel.cpp), freed once it is done.
void MemoryReplay::partial_sums() {
  if (tp_ == 1) return;
  const int64_t bytes = (2 + reduce_scatter_copies_) * e_ * D_ * N_;
  t_.alloc("activations", bytes);
  t_.free("activations", bytes);
}

void MemoryReplay::start_of_step() {
  t_.at("start of the step");
  t_.alloc("parameter shards (fp32)", 4 * local_);
  // AdamW: two moments per element; Muon: one momentum buffer per element of its matrices.
  t_.alloc("optimizer state (fp32)", 4 * (2 * (local_ - hidden_local_) + hidden_local_));
  // DiLoCo (diloco/diloco.h): the outer copies and their momentum; with a fragment delay, an
  // exchange in flight between steps holds its fragment's Δ̄ and start values.
  if (plan_.diloco) {
    largest_fragment_ = *std::max_element(plan_.diloco->values.begin(), plan_.diloco->values.end());
    t_.alloc("DiLoCo outer copies and momentum (fp32)", 8 * local_);
    if (plan_.diloco->fragment_delay > 0) t_.alloc("DiLoCo exchange in flight", 8 * largest_fragment_);
  }
  // RoPE table: complex64 for 2 * max_seq_len positions.
  t_.alloc("RoPE table", 8 * 2 * a_.max_seq_len * (a_.head_dim() / 2));
  // The loader's prefetched micro-batches (4) and the one in use: inputs and targets, int64.
  t_.alloc("data batches", (4 + 1) * 2 * 8 * N_);
  if (keep_)
    for (const UnitSizes& u : units_) t_.alloc("gathered parameters", e_ * u.gathered);
}

void MemoryReplay::grad_shards(int64_t u) {  // made the first time a unit's gradients land
  // (Experts added whole got theirs at the post-backward: post_backward_sums.)
  const UnitSizes& sizes = units_[static_cast<size_t>(u)];
  const int64_t local = whole_expert_gradients_ ? sizes.local - sizes.experts_local : sizes.local;
  if (!has_grad_[static_cast<size_t>(u)]) t_.alloc("gradient shards (fp32)", 4 * local);
  has_grad_[static_cast<size_t>(u)] = true;
}

void MemoryReplay::finish_reduce() {  // the reduced rows go into the shards' .grad()
  if (reducing_ < 0) return;
  t_.free("reduce-scatter buffers", reducing_bytes_);
  grad_shards(reducing_);
  reducing_ = -1;
  reducing_bytes_ = 0;
}

// A reduce-scatter of `ev.payload` bytes a rank over `ev.ranks`: its input; the unit before done
// (a unit's second part, its experts, follows its first); its output.
void MemoryReplay::reduce(const StepEvent& ev) {
  const int64_t in = ev.ranks * ev.payload;
  t_.alloc("reduce-scatter buffers", in);
  if (reducing_ != ev.unit) finish_reduce();
  t_.alloc("reduce-scatter buffers", ev.payload);
  t_.alloc("reduce-scatter buffers", reduce_scatter_copies_ * in);
  t_.free("reduce-scatter buffers", reduce_scatter_copies_ * in);
  reducing_ = ev.unit;
  reducing_bytes_ += in + ev.payload;
}

void MemoryReplay::end_micro_batch() {  // finish_backward
  if (m_ < 0) return;
  finish_reduce();
  t_.free("attention mask", mask_);
}

// A unit's backward, up to its post-backward (block u's, or for the root the embedding's).
void MemoryReplay::unit_backward(int64_t u) {
  if (u == L_) {
    // The embedding's gradient (dense, [V, D]), the last of backward.
    t_.at("backward of the embedding" + mb_);
    t_.alloc("parameter gradients", e_ * V_ * D_);
    t_.free("activation gradients", e_ * D_ * own_);
    return;
  }
  const int64_t e = e_, D = D_, N = N_;
  // A mixture of experts: the K routed experts' and the shared ones' hidden sizes per token.
  const int64_t F = a_.moe_layer(u) ? (a_.top_k + a_.num_shared_experts) * a_.expert_hidden() : F_;
  t_.at("backward of " + block_name(u) + mb_);
  // Most memory in the block's backward is at the MLP's product (measured with the counting
  // allocator: the recompute adds exactly block_keeps, its backward 2 F per token plus w2's weight
  // gradient). w2's backward hands back the product's gradient [N, F] and w2's weight gradient
  // [D, F] and frees the product it kept; the gate's backward (silu_mul) then makes the gradients
  // of w1's and w3's outputs, two more [N, F]. Under TP w2's backward reads the output's gradient
  // gathered whole, [N, D], freed when it is done.
  if (tp_ > 1) t_.alloc("activation gradients", e * D * N);
  t_.alloc("activation gradients", e * F * N);
  t_.alloc("parameter gradients", e * D * F);
  if (tp_ > 1) t_.free("activation gradients", e * D * N);
  t_.free("activations", e * F * N);
  t_.alloc("activation gradients", 2 * e * F * N);
  t_.free("activation gradients", 3 * e * F * N);
  t_.alloc("ring attention", ring_backward_);
  t_.free("ring attention", ring_backward_);
  if (cuda_) {
    // Attention's backward on the GPU (the flash kernels; FA2's buffers): an fp32 accumulator for
    // dq of [N + 128 per sequence, H, Dh rounded up to 32 or 64] and fp32 row sums [sequences, H,
    // T rounded up to 128], beside the gradients of q, k and v (and, under grouped-query
    // attention, of k and v at every query head before they are summed down). Sequences counted
    // as one per row: each further document in a row adds 128 rows of dq.
    const int64_t B = c_.train.micro_bs, T = c_.data.seq_length, Dh = a_.head_dim(), H = H_, Q = Q_, K = K_;
    const int64_t round = Dh <= 128 ? 32 : 64;
    const int64_t dh_rounded = (Dh + round - 1) / round * round;
    const int64_t work = 4 * (N + 128 * B) * H * dh_rounded + 4 * B * H * ((T + 127) / 128 * 128) +
                         e * (Q + 2 * K) * N + (K < Q ? 2 * e * Q * N : 0);
    t_.alloc("attention backward", work);
    t_.free("attention backward", work);
  }
  t_.free("activations", keeps_of(u) - e * F * N + (checkpointed(u) ? block_keeps_of(u) : 0));
  t_.alloc("parameter gradients", e * (units_[static_cast<size_t>(u)].full - D * F));
}

// Its post-backward's sums: the fp32 accumulators of the first micro-batch, or the shards' .grad().
void MemoryReplay::post_backward_sums(int64_t u) {
  if (A_ > 1 && !reduce_every_ && m_ == 0) t_.alloc("gradient accumulators (fp32)", 4 * units_[static_cast<size_t>(u)].full);
  if (sync_ && whole_gradients_) grad_shards(u);
  if (sync_ && whole_expert_gradients_ && !has_expert_grad_[static_cast<size_t>(u)]) {
    t_.alloc("gradient shards (fp32)", 4 * units_[static_cast<size_t>(u)].experts_local);
    has_expert_grad_[static_cast<size_t>(u)] = true;
  }
}

void MemoryReplay::visit(const StepEvent& ev) {
  switch (ev.op) {
    case StepEvent::Op::MicroBatch: return on_micro_batch(ev);
    case StepEvent::Op::Collective: return on_collective(ev);
    case StepEvent::Op::Unshard: return on_unshard(ev.unit);
    case StepEvent::Op::Forward: return on_forward(ev.unit);
    case StepEvent::Op::Loss: return on_loss();
    case StepEvent::Op::Recompute: return on_recompute(ev.unit);
    case StepEvent::Op::Reshard: return on_reshard(ev.unit);
    case StepEvent::Op::Backward: return on_backward(ev.unit);
    case StepEvent::Op::Optimizer: return on_optimizer();
  }
}

void MemoryReplay::on_micro_batch(const StepEvent& ev) {
  end_micro_batch();
  m_ = ev.micro_batch;
  backward_ = false;
  sync_ = reduce_every_ || m_ == A_ - 1;
  mb_ = A_ > 1 ? " (micro-batch " + std::to_string(m_ + 1) + ")" : "";
  t_.at("forward" + mb_);
  t_.alloc("attention mask", mask_);
}

void MemoryReplay::on_collective(const StepEvent& ev) {
  if (ev.group == "tp" || ev.group == "cp") return;  // inside the model (see above)
  const auto u = static_cast<size_t>(ev.unit);
  if (ev.kind == CommKind::AllGather) {
    if (ev.what == kFloat8AmaxGather) return;  // a float each
    // A gather's input and output buffers (the plan has no all-gather with one rank: the shards
    // are cast straight into place), at the bytes it moves (FP8 weights: one a value); a unit's
    // experts have theirs beside the block's.
    gathering_[u] += ev.payload * (ev.ranks + 1);
    t_.alloc("all-gather buffers", ev.payload * (ev.ranks + 1));
  } else if (ev.kind == CommKind::ReduceScatter) {
    reduce(ev);
  }
}

void MemoryReplay::on_unshard(int64_t u) {
  if (backward_) t_.at("backward of " + block_name(u) + mb_);
  if (!keep_) t_.alloc("gathered parameters", e_ * units_[static_cast<size_t>(u)].gathered);
  t_.free("all-gather buffers", gathering_[static_cast<size_t>(u)]);
  gathering_[static_cast<size_t>(u)] = 0;
}

void MemoryReplay::on_forward(int64_t u) {
  if (u == 0) t_.alloc("activations", e_ * D_ * own_);  // the embedding's output, block 0's input
  t_.at("forward of " + block_name(u) + mb_);
  t_.alloc("activations", keeps_of(u));
  t_.alloc("ring attention", ring_forward_);
  t_.free("ring attention", ring_forward_);
  partial_sums();
}

void MemoryReplay::on_loss() {
  // The loss in chunks (chunked_loss.h): while a chunk's logits exist, fp32 [chunk, V] and
  // log-sum-exp's temporary of their size; in a compute dtype other than fp32 also the gradient
  // cast back, and on the CPU the product before the cast and the weight gradient's product before
  // it is added to the fp32 sum (on CUDA the GEMMs write fp32).
  const int64_t e = e_, V = V_, D = D_;
  t_.at("loss" + mb_);
  const int64_t chunk = std::min(N_, loss_chunk_tokens(V, cuda_));
  const int64_t head_keeps = saves_.head.bytes(N_, tp_) + saves_.head_weight;
  t_.alloc("activations", head_keeps);
  const int64_t logits = e == 4 ? chunk * V * 8 : cuda_ ? chunk * V * (8 + e) : chunk * V * (8 + 2 * e) + e * V * D;
  t_.alloc("loss chunk", logits);
  t_.free("loss chunk", logits);
  // Its backward scales the saved gradients in place: the fp32 [V, D] becomes the head's gradient
  // (or is cast to the compute dtype, its fp32 copy then freed), which waits with the root's
  // others until the embedding's; the final norm hands back the gradient at this rank's positions.
  t_.at("backward of the loss" + mb_);
  if (e != 4) t_.alloc("parameter gradients", head_grad_);
  t_.free("activations", saves_.head_weight);
  if (e == 4) t_.alloc("parameter gradients", head_grad_);
  t_.alloc("activation gradients", e * D * own_);
  // Freed: what the loss kept, and the last block's output (only the final norm kept it). From
  // here each block's backward frees what it kept, its own output excepted (gone already) and its
  // input included (the same size): what it kept, in all.
  t_.free("activations", head_keeps - saves_.head_weight + e * D * own_);
  backward_ = true;
}

void MemoryReplay::on_recompute(int64_t u) {
  t_.at("backward of " + block_name(u) + mb_);
  t_.alloc("activations", block_keeps_of(u));
  partial_sums();
}

void MemoryReplay::on_reshard(int64_t u) {
  const int64_t gathered = e_ * units_[static_cast<size_t>(u)].gathered;
  if (!backward_) {  // after the block's forward
    t_.free("gathered parameters", gathered);
    return;
  }
  // In backward: the unit's gradients are computed, then its post-backward frees the gathered
  // copy and sums its gradients (or hands them to the reduce-scatter that follows).
  unit_backward(u);
  t_.free("gathered parameters", gathered);
  post_backward_sums(u);
}

void MemoryReplay::on_backward(int64_t u) {  // its post-backward is done
  if (keep_) {  // no Reshard: the same backward, the cast kept
    unit_backward(u);
    post_backward_sums(u);
  }
  const int64_t full = units_[static_cast<size_t>(u)].full;
  if (sync_ && A_ > 1 && !reduce_every_) t_.free("gradient accumulators (fp32)", 4 * full);
  t_.free("parameter gradients", u < L_ ? e_ * full : e_ * V_ * D_ + head_grad_);
}

void MemoryReplay::on_optimizer() {
  end_micro_batch();
  m_ = -1;
}

void MemoryReplay::optimizer_step() {
  t_.at("optimizer step");
  if (!muon_) return;
  // Nesterov's blend of gradient and momentum (fp32, on the shards). Then, over several ranks, the
  // owner exchange (sharded_muon.cpp), in ns_dtype, each buffer freed once copied on: each
  // matrix's padded rows gathered into send parts and their concatenation, the rows received from
  // every rank, the owner's whole matrices (a W-th of them); after Newton-Schulz the rows to send
  // back and those returned. Under TP what the owner holds whole is its TP slice; the TP stage
  // (tensor_parallel_muon.cpp) gathers a split matrix's slices to one TP rank by the same
  // exchange, a tp-th of them each, unless it runs Newton-Schulz on the slices themselves (the
  // Gram mode) or the matrix is whole on every TP rank (shared key/value heads). Newton-Schulz
  // runs same-shape matrices as one batch: their stack, the normalised iterate, X Xᵀ and its
  // polynomial (k m x m for k matrices with m the short side) and the next iterate. Gram
  // Newton-Schulz (optim.optim.ns_algorithm) normalises in fp32 (a copy and its quotient), then
  // holds the iterate, a rebuilt one, and R, Z, Q and R P (k m x m each) in its own dtype.
  const int64_t W = W_, tp = tp_;
  const at::ScalarType ns_dtype = resolve_ns_dtype(c_, device_);
  const int64_t ns = at::elementSize(ns_dtype), gram_ns = at::elementSize(gram_newton_schulz_dtype(ns_dtype));
  const NsCoefficients& coefficients = ns_coefficients(c_.optim.optim.ns_coefficients);
  // (rows, cols, ranks sharing them, 0 or an expert stack's number: Muon batches each stack
  // apart) of what Newton-Schulz runs on -> matrices
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, int64_t> groups;
  int64_t stacks = 0;
  int64_t hidden_slices = 0, hidden_block = 0, tp_gathered = 0;
  for (const ParamSpec& p : specs_)
    if (param_role(p.name, static_cast<int64_t>(p.shape.size())) == ParamRole::Hidden) {
      if (p.shape.size() == 3) {  // an expert stack: the rank's own experts, orthogonalised where they are
        groups[{p.shape[1], p.shape[2], 1, ++stacks}] += engine_shard(p, W, c_.parallel.ep, tp).rows().rows_per_rank;
        continue;
      }
      hidden_slices += p.numel();
      hidden_block += RowShard::of(p.shape, W).block_numel();
      const std::vector<int64_t>& whole = p.whole;
      const bool gathered = p.tp_dim >= 0 && !muon_tp_splits(c_.parallel.muon_tp, p.tp_dim, whole[0], whole[1], tp,
                                                                 c_.optim.optim.ns_steps);
      if (gathered) tp_gathered += p.numel();
      const std::vector<int64_t>& run = gathered ? whole : p.shape;
      ++groups[{run[0], run[1], gathered ? W * tp : W, 0}];
    }
  const std::string work = "optimizer work";
  // Into an exchange: `sent` elements out, `owned` assembled; the whole matrices are left.
  auto exchange_in = [&](int64_t sent, int64_t owned) {
    t_.alloc(work, ns * 2 * sent);  // send parts, their concatenation
    t_.free(work, ns * sent);
    t_.alloc(work, ns * owned);  // received
    t_.free(work, ns * sent);
    t_.alloc(work, ns * owned);  // whole
    t_.free(work, ns * owned);
  };
  // Out of it, once the stage made `results` bytes: the rows to send back, then what returns.
  auto exchange_out = [&](int64_t sent, int64_t owned, int64_t results) {
    t_.free(work, ns * owned);  // whole
    t_.alloc(work, ns * owned);  // back
    t_.free(work, results);
    t_.alloc(work, ns * sent);  // returned: this rank's rows of every result
    t_.free(work, ns * owned);
  };
  t_.alloc(work, 4 * hidden_local_);  // the blend
  const int64_t owned = (hidden_slices + W - 1) / W;       // size-balanced owners
  const int64_t tp_owned = (tp_gathered + W - 1) / W;      // of those, what the TP stage moves
  const int64_t in_bytes = W > 1 || tp_owned > 0 ? ns : 4;  // what Newton-Schulz is handed
  if (W > 1) exchange_in(hidden_block, owned);
  if (tp_owned > 0) exchange_in(tp_owned, tp_owned);
  int64_t results = 0, tp_results = 0;  // of the data-parallel owner's matrices; of those gathered over TP
  for (const auto& [shape, count] : groups) {
    const auto [rows, cols, ranks, stack] = shape;
    const int64_t k = (count + ranks - 1) / ranks, g = k * rows * cols;
    const int64_t m = std::min(rows, cols);
    const bool gram = c_.optim.optim.ns_algorithm == "gram" &&
                      gram_newton_schulz_pays(rows, cols, c_.optim.optim.ns_steps, coefficients);
    const int64_t temps = gram ? in_bytes * g + std::max(8 * g + gram_ns * g, gram_ns * (2 * g + 4 * k * m * m))
                               : in_bytes * g + ns * (2 * g + 2 * k * m * m);
    t_.alloc(work, temps);
    t_.free(work, temps);
    t_.alloc(work, ns * g);  // the result, kept until every group is done
    (ranks > W ? tp_results : results) += ns * g;
  }
  if (tp_owned > 0) {
    exchange_out(tp_owned, tp_owned, tp_results);
    results += ns * tp_owned;  // what the TP stage returned is the data-parallel stage's result
  }
  if (W > 1) exchange_out(hidden_block, owned, results);
}

void MemoryReplay::diloco_outer_step() {
  if (!plan_.diloco) return;
  // After the step's gradients and the optimizer's temporaries are freed: a fragment's Δ as
  // tensors and flat, then what the exchange receives (the flat Δ itself for fp32; every
  // replica's bf16 values or codes with their tables otherwise) and Δ̄; uint8's codec works in
  // blocks beside them.
  t_.at("DiLoCo outer step");
  t_.free("optimizer work", t_.live("optimizer work"));
  t_.free("gradient shards (fp32)", t_.live("gradient shards (fp32)"));
  const int64_t n = largest_fragment_;
  const Compression compression = plan_.diloco->compression;
  const int64_t received =
      compression == Compression::None ? 0 : plan_.replicate * compressed_bytes(compression, n, kUint8Chunk);
  const int64_t codec = compression == Compression::UInt8 ? uint8_workspace_bytes(n, kUint8Chunk) : 0;
  t_.alloc("DiLoCo outer step", 8 * n + received + codec);
}

MemoryEstimate MemoryReplay::result() const {
  MemoryEstimate est;
  est.peak = t_.peak();
  est.peak_at = t_.peak_at();
  for (const auto& [what, bytes] : t_.at_peak())
    if (bytes > 0) est.at_peak.push_back({what, bytes});
  std::sort(est.at_peak.begin(), est.at_peak.end(), [](const auto& x, const auto& y) { return x.bytes > y.bytes; });
  for (int64_t i = 0; i < L_; ++i) est.activations_without_checkpointing += block_keeps_of(i);
  for (int64_t i = 0; i < L_; ++i) est.activations_per_micro_batch += keeps_of(i);
  // What the experts keep per row they compute (ForwardSaves::moe_block's routed part: the row and
  // its four hidden-sized products), for (ep - 1) N K rows more: in every MoE block that keeps its
  // activations, or once in a checkpointed one's recomputation.
  const int64_t ep = c_.parallel.ep;
  if (ep > 1) {
    const int64_t more = e_ * (ep - 1) * N_ * a_.top_k * (D_ + 4 * a_.expert_hidden());
    bool recomputed = false;
    for (int64_t i = 0; i < L_; ++i) {
      if (!a_.moe_layer(i)) continue;
      if (!checkpointed(i)) est.skewed_routing_extra += more;
      recomputed = recomputed || checkpointed(i);
    }
    if (recomputed) est.skewed_routing_extra += more;
  }
  est.reduce_every_micro_batch = reduce_every_;
  est.keep_unsharded = keep_;
  return est;
}

}  // namespace

MemoryEstimate estimate_step_memory(const Config& c, const ResolvedRun& run) {
  const StepPlan plan = plan_step(c, ParallelMesh(c, run.mesh.world(), /*rank=*/0, EngineKind::Sharded), run);
  MemoryReplay replay(c, plan, run);
  replay.start_of_step();
  for (const StepEvent& ev : plan.events) replay.visit(ev);
  replay.optimizer_step();
  replay.diloco_outer_step();
  return replay.result();
}

int64_t device_memory_bytes(const Config& c, const std::string& name) {
  if (c.runtime.device_memory_gb > 0) return static_cast<int64_t>(c.runtime.device_memory_gb * 1e9);
  // The total nvidia-smi reports for the SXM parts (the spec sheets' 80 and 141 GB).
  constexpr int64_t MiB = 1 << 20;
  if (name.find("H200") != std::string::npos) return 143771 * MiB;
  if (name.find("H100") != std::string::npos) return 81559 * MiB;
  return 0;
}

int64_t usable_memory_bytes(int64_t device_bytes) { return device_bytes / 10 * 9; }

MemoryBudget planned_budget(const Config& c, const std::string& device_name) {
  MemoryBudget b;
  b.device_bytes = device_memory_bytes(c, device_name);
  b.usable = usable_memory_bytes(b.device_bytes);
  b.how = strf("90%% of %.2f GiB (%s)", static_cast<double>(b.device_bytes) / (1 << 30),
               c.runtime.device_memory_gb > 0 ? "runtime.device_memory_gb" : "the GPU's name");
  return b;
}

MemoryBudget measured_budget(int64_t available, int64_t total) {
  MemoryBudget b;
  b.device_bytes = total;
  const int64_t reserve = gpu_reserve_bytes(total);
  b.usable = std::max<int64_t>(0, available - reserve);
  b.how = strf("%.2f GiB free with every communicator made, less %.2f GiB kept for workspaces and rounding",
               static_cast<double>(available) / (1 << 30), static_cast<double>(reserve) / (1 << 30));
  return b;
}

int64_t gpu_reserve_bytes(int64_t total) { return std::max<int64_t>(int64_t{2} << 30, total / 20); }

std::vector<std::string> describe_memory(const MemoryEstimate& e, const MemoryBudget& budget) {
  auto gib = [](int64_t b) { return strf("%9.2f GiB", static_cast<double>(b) / (1 << 30)); };
  std::vector<std::string> lines;
  lines.push_back(strf("predicted peak memory per rank: %s (%ld bytes), at the %s", gib(e.peak).c_str(),
                       static_cast<long>(e.peak), e.peak_at.c_str()));
  for (const auto& p : e.at_peak) lines.push_back(strf("  %-32s %s", p.what.c_str(), gib(p.bytes).c_str()));
  lines.push_back(strf("  saved activations per micro-batch: %s as configured, %s without activation checkpointing",
                       gib(e.activations_per_micro_batch).c_str(), gib(e.activations_without_checkpointing).c_str()));
  if (e.skewed_routing_extra > 0)
    lines.push_back(strf("  expert parallelism: counted for a balanced routing; every routed row to one rank's experts "
                         "would keep up to %s more there",
                         gib(e.skewed_routing_extra).c_str()));
  lines.push_back(std::string("  gradients: ") + (e.reduce_every_micro_batch ? "reduced on every micro-batch (sharded sums)"
                                                                              : "summed whole until the last micro-batch"));
  if (budget.device_bytes > 0)
    lines.push_back(strf("device memory %.2f GiB; usable %.2f GiB: %s: %s",
                         static_cast<double>(budget.device_bytes) / (1 << 30),
                         static_cast<double>(budget.usable) / (1 << 30), budget.how.c_str(),
                         e.peak <= budget.usable ? "fits" : "DOES NOT FIT"));
  else
    lines.push_back("device memory: unknown (runtime.device_memory_gb sets it); not checked");
  return lines;
}

}  // namespace zb
