#include "train/memory_estimate.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "parallel/row_shard.h"
#include "model/attention.h"
#include "model/chunked_loss.h"
#include "model/layers.h"
#include "model/model_args.h"
#include "config/model_config.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "optim/tensor_parallel_muon.h"
#include "train/diloco.h"
#include "train/step_plan.h"
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

// One sharding unit (a block, or the root: embedding, final norm, head) as rank 0 holds it.
struct UnitSizes {
  int64_t full = 0;    // elements of all its parameters
  int64_t gathered = 0;  // elements of their unsharded storage: every rank's padded block
  int64_t block = 0;   // elements rank 0 puts into a collective (its rows, padded)
  int64_t local = 0;   // elements of rank 0's shards
  int64_t hidden_local = 0;  // of those, in Muon's matrices
};

}  // namespace

MemoryEstimate estimate_step_memory(const Config& c, int64_t world_size, at::ScalarType compute_dtype, bool cuda,
                                    bool reduce_every_micro_batch) {
  // The step as the engine runs it, on rank 0 (train/step_plan.h): its events are walked in order,
  // each allocating and freeing what it does. Not counted under hybrid sharding: the unit whose
  // reduced rows are being all-reduced over the replicas keeps them one unit longer (a W-th of a
  // block, in place).
  //
  // Under tensor parallelism (model/tensor_parallel.h) rank 0 holds its slice of every matrix,
  // this rank's heads, FFN columns and vocabulary rows, and a tp-th of each micro-batch's positions
  // in the residual stream; what the column-parallel products read, the gathered sequence, is
  // whole. The TP group's collectives in the plan allocate nothing counted here: a gathered
  // sequence is the activation the next product keeps (ForwardSaves), and the gradients gathered
  // in backward are counted where they are made.
  const c10::Device device = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  const StepPlan plan = plan_step(c, world_size, /*rank=*/0, Parallelism::FSDP, compute_dtype,
                                  resolve_ns_dtype(c, device), reduce_every_micro_batch, cuda);
  const int64_t W = plan.shard;  // parameters are sharded over the shard group
  const int64_t tp = plan.tp;
  const ModelArgs a = resolve_model_args(c);
  // This rank's part of each dimension tensor parallelism splits (all of it without).
  const TpShare share = tp_share(a, tp);
  const int64_t L = a.n_layers, D = a.dim, V = share.vocab, H = share.heads, F = share.ffn;
  const int64_t Q = H * a.head_dim(), K = share.kv_heads * a.head_dim();
  const int64_t N = c.train.micro_bs * c.data.seq_length;  // tokens per micro-batch
  const int64_t own = N / tp;  // of them, the positions this rank holds in the residual stream
  const int64_t A = plan.micro_batches;                     // micro-batches per step
  const int64_t e = at::elementSize(compute_dtype);          // bytes of a gathered weight / activation
  const bool muon = c.optim.optim.type == "muon";
  const bool reduce_every = plan.reduce_every_micro_batch;
  // Document attention without the flash kernel reads an additive mask [B, 1, T, T] in the
  // compute dtype, made once per micro-batch and shared by every block (attention.h).
  const bool flash = varlen_flash_supported(device, compute_dtype, a.head_dim());
  const int64_t mask = c.model.attention == "document" && !flash ? e * c.data.seq_length * N : 0;

  // Units: blocks 0..L-1, then the root.
  std::vector<UnitSizes> units(L + 1);
  const std::vector<ParamSpec> specs = param_specs(a, tp);  // this rank's slices under TP
  for (const ParamSpec& p : specs) {
    UnitSizes& u = p.layer >= 0 ? units[p.layer] : units[L];
    const RowShard s = RowShard::of(p.shape, W);
    u.full += p.numel();
    u.gathered += W * s.block_numel();
    u.block += s.block_numel();
    u.local += s.numel_of(0);
    if (muon && param_role(p.name, static_cast<int64_t>(p.shape.size())) == ParamRole::Hidden) {
      u.hidden_local += s.numel_of(0);
    }
  }
  int64_t local = 0, hidden_local = 0;
  for (const auto& u : units) {
    local += u.local;
    hidden_local += u.hidden_local;
  }

  // What the forward keeps for backward (defined beside it: model/llama.h's forward_saves).
  const std::vector<std::string> unfused = split_operator_names(c.runtime.unfused);
  const bool fused_gate =
      c.runtime.fused_kernels && std::find(unfused.begin(), unfused.end(), "gate") == unfused.end();
  const ForwardSaves saves = forward_saves(a, compute_dtype, cuda, tp, fused_gate);
  const int64_t block_keeps = saves.block.bytes(N, tp);
  auto checkpointed = [&](int64_t i) { return c.train.ac_ckpt > 0 && i % c.train.ac_ckpt == 0; };
  auto keeps_of = [&](int64_t i) { return checkpointed(i) ? saves.checkpointed.bytes(N, tp) : block_keeps; };  // block i

  Timeline t;
  // Gloo's reduce-scatter (the CPU's) copies its input as it starts; NCCL's does not.
  const int64_t reduce_scatter_copies = cuda ? 0 : 1;
  // Under TP a block's forward ends with the MLP's partial sums [N, D] and their copy in the
  // order the reduce-scatter sends them (model/tensor_parallel.cpp), freed once it is done.
  auto partial_sums = [&] {
    if (tp == 1) return;
    const int64_t bytes = (2 + reduce_scatter_copies) * e * D * N;
    t.alloc("activations", bytes);
    t.free("activations", bytes);
  };
  // --- held through the step ----------------------------------------------------------------------
  t.at("start of the step");
  t.alloc("parameter shards (fp32)", 4 * local);
  // AdamW: two moments per element; Muon: one momentum buffer per element of its matrices.
  t.alloc("optimizer state (fp32)", 4 * (2 * (local - hidden_local) + hidden_local));
  // DiLoCo (train/diloco.h): the outer copies and their momentum; with a fragment delay, an
  // exchange in flight between steps holds its fragment's Δ̄ and start values.
  int64_t largest_fragment = 0;
  if (plan.diloco) {
    largest_fragment = *std::max_element(plan.diloco->values.begin(), plan.diloco->values.end());
    t.alloc("DiLoCo outer copies and momentum (fp32)", 8 * local);
    if (plan.diloco->fragment_delay > 0) t.alloc("DiLoCo exchange in flight", 8 * largest_fragment);
  }
  // RoPE table: complex64 for 2 * max_seq_len positions.
  t.alloc("RoPE table", 8 * 2 * a.max_seq_len * (a.head_dim() / 2));
  // The loader's prefetched micro-batches (4) and the one in use: inputs and targets, int64.
  t.alloc("data batches", (4 + 1) * 2 * 8 * N);

  // A gather's input and output buffers (the plan has no all-gather with one rank: the shards are
  // cast straight into place).
  auto gather_buffers = [&](const UnitSizes& u) { return e * u.block * (W + 1); };
  std::vector<int64_t> gathering(L + 1, 0);  // each unit's all-gather buffers in flight
  const UnitSizes* reducing = nullptr;  // the unit whose reduce-scatter is in flight
  std::vector<bool> has_grad(L + 1, false);  // a unit's shards have their .grad() this step
  auto grad_shards = [&](size_t u) {  // made the first time a unit's gradients land
    if (!has_grad[u]) t.alloc("gradient shards (fp32)", 4 * units[u].local);
    has_grad[u] = true;
  };
  auto finish_reduce = [&] {  // the reduced rows go into the shards' .grad()
    if (!reducing) return;
    t.free("reduce-scatter buffers", 4 * reducing->block * (W + 1));
    grad_shards(static_cast<size_t>(reducing - units.data()));
    reducing = nullptr;
  };
  auto reduce = [&](const UnitSizes& u) {  // a reduce-scatter: its input, the one before done, its output
    t.alloc("reduce-scatter buffers", 4 * W * u.block);
    finish_reduce();
    t.alloc("reduce-scatter buffers", 4 * u.block);
    t.alloc("reduce-scatter buffers", reduce_scatter_copies * 4 * W * u.block);
    t.free("reduce-scatter buffers", reduce_scatter_copies * 4 * W * u.block);
    reducing = &u;
  };
  // One rank without replicas adds its sums straight into the shards' .grad(), no reduce-scatter.
  const bool whole_gradients = W == 1 && plan.replicate == 1;
  // Kept casts (train.keep_unsharded): every unit's, from the step before, all step long; the
  // plan's casts then allocate nothing.
  const bool keep = plan.keep_unsharded;
  if (keep)
    for (const UnitSizes& u : units) t.alloc("gathered parameters", e * u.gathered);
  const int64_t head_grad = e * V * D;  // the head's gradient, made by the loss (below)

  int64_t m = -1;         // the micro-batch under way
  bool backward = false;  // its backward has begun
  bool sync = false;      // its gradients are reduced
  std::string mb;         // its name in the timeline
  auto end_micro_batch = [&] {  // finish_backward
    if (m < 0) return;
    finish_reduce();
    t.free("attention mask", mask);
  };
  // A unit's backward, up to its post-backward (block u's, or for the root the embedding's).
  auto unit_backward = [&](int64_t u, const std::string& block) {
    if (u < L) {
      t.at("backward of " + block + mb);
      // Most memory in the block's backward is at the MLP's product (measured with the
      // counting allocator: the recompute adds exactly block_keeps, its backward 2 F per token
      // plus w2's weight gradient). w2's backward hands back the product's gradient [N, F] and
      // w2's weight gradient [D, F] and frees the product it kept; the gate's backward
      // (silu_mul) then makes the gradients of w1's and w3's outputs, two more [N, F]. Under TP w2's
      // backward reads the output's gradient gathered whole, [N, D], freed when it is done.
      if (tp > 1) t.alloc("activation gradients", e * D * N);
      t.alloc("activation gradients", e * F * N);
      t.alloc("parameter gradients", e * D * F);
      if (tp > 1) t.free("activation gradients", e * D * N);
      t.free("activations", e * F * N);
      t.alloc("activation gradients", 2 * e * F * N);
      t.free("activation gradients", 3 * e * F * N);
      if (cuda) {
        // Attention's backward on the GPU (the flash kernels; FA2's buffers): an fp32
        // accumulator for dq of [N + 128 per sequence, H, Dh rounded up to 32 or 64] and fp32
        // row sums [sequences, H, T rounded up to 128], beside the gradients of q, k and v
        // (and, under grouped-query attention, of k and v at every query head before they
        // are summed down). Sequences counted as one per row: each further document in a
        // row adds 128 rows of dq.
        const int64_t B = c.train.micro_bs, T = c.data.seq_length, Dh = a.head_dim();
        const int64_t round = Dh <= 128 ? 32 : 64;
        const int64_t dh_rounded = (Dh + round - 1) / round * round;
        const int64_t work = 4 * (N + 128 * B) * H * dh_rounded + 4 * B * H * ((T + 127) / 128 * 128) +
                             e * (Q + 2 * K) * N + (K < Q ? 2 * e * Q * N : 0);
        t.alloc("attention backward", work);
        t.free("attention backward", work);
      }
      t.free("activations", keeps_of(u) - e * F * N + (checkpointed(u) ? block_keeps : 0));
      t.alloc("parameter gradients", e * (units[u].full - D * F));
    } else {
      // The embedding's gradient (dense, [V, D]), the last of backward.
      t.at("backward of the embedding" + mb);
      t.alloc("parameter gradients", e * V * D);
      t.free("activation gradients", e * D * own);
    }
  };
  // Its post-backward's sums: the fp32 accumulators of the first micro-batch, or the shards' .grad().
  auto post_backward_sums = [&](int64_t u) {
    if (A > 1 && !reduce_every && m == 0) t.alloc("gradient accumulators (fp32)", 4 * units[u].full);
    if (sync && whole_gradients) grad_shards(static_cast<size_t>(u));
  };
  for (const StepEvent& ev : plan.events) {
    const int64_t u = ev.unit;
    const std::string block = "block " + std::to_string(u);
    switch (ev.op) {
      case StepEvent::Op::MicroBatch:
        end_micro_batch();
        m = ev.micro_batch;
        backward = false;
        sync = reduce_every || m == A - 1;
        mb = A > 1 ? " (micro-batch " + std::to_string(m + 1) + ")" : "";
        t.at("forward" + mb);
        t.alloc("attention mask", mask);
        break;
      case StepEvent::Op::Collective:
        if (ev.group == "tp") break;  // inside the model (see above)
        if (ev.kind == CommKind::AllGather) {
          gathering[u] = gather_buffers(units[u]);
          t.alloc("all-gather buffers", gathering[u]);
        } else if (ev.kind == CommKind::ReduceScatter) {
          reduce(units[u]);
        }
        break;
      case StepEvent::Op::Unshard:
        if (backward) t.at("backward of " + block + mb);
        if (!keep) t.alloc("gathered parameters", e * units[u].gathered);
        t.free("all-gather buffers", gathering[u]);
        gathering[u] = 0;
        break;
      case StepEvent::Op::Forward:
        if (u == 0) t.alloc("activations", e * D * own);  // the embedding's output, block 0's input
        t.at("forward of " + block + mb);
        t.alloc("activations", keeps_of(u));
        partial_sums();
        break;
      case StepEvent::Op::Loss: {
        // The loss in chunks (chunked_loss.h): while a chunk's logits exist, fp32 [chunk, V] and
        // log-sum-exp's temporary of their size; in a compute dtype other than fp32 also the
        // gradient cast back, and on the CPU the product before the cast and the weight
        // gradient's product before it is added to the fp32 sum (on CUDA the GEMMs write fp32).
        t.at("loss" + mb);
        const int64_t chunk = std::min(N, loss_chunk_tokens(V, cuda));
        const int64_t head_keeps = saves.head.bytes(N, tp) + saves.head_weight;
        t.alloc("activations", head_keeps);
        const int64_t logits = e == 4 ? chunk * V * 8
                               : cuda ? chunk * V * (8 + e)
                                      : chunk * V * (8 + 2 * e) + e * V * D;
        t.alloc("loss chunk", logits);
        t.free("loss chunk", logits);
        // Its backward scales the saved gradients in place: the fp32 [V, D] becomes the head's
        // gradient (or is cast to the compute dtype, its fp32 copy then freed), which waits with
        // the root's others until the embedding's; the final norm hands back the gradient at
        // this rank's positions.
        t.at("backward of the loss" + mb);
        if (e != 4) t.alloc("parameter gradients", head_grad);
        t.free("activations", saves.head_weight);
        if (e == 4) t.alloc("parameter gradients", head_grad);
        t.alloc("activation gradients", e * D * own);
        // Freed: what the loss kept, and the last block's output (only the final norm kept it).
        // From here each block's backward frees what it kept, its own output excepted (gone
        // already) and its input included (the same size): what it kept, in all.
        t.free("activations", head_keeps - saves.head_weight + e * D * own);
        backward = true;
        break;
      }
      case StepEvent::Op::Recompute:
        t.at("backward of " + block + mb);
        t.alloc("activations", block_keeps);
        partial_sums();
        break;
      case StepEvent::Op::Reshard:
        if (!backward) {  // after the block's forward
          t.free("gathered parameters", e * units[u].gathered);
          break;
        }
        // In backward: the unit's gradients are computed, then its post-backward frees the
        // gathered copy and sums its gradients (or hands them to the reduce-scatter that follows).
        unit_backward(u, block);
        t.free("gathered parameters", e * units[u].gathered);
        post_backward_sums(u);
        break;
      case StepEvent::Op::Backward:  // its post-backward is done
        if (keep) {  // no Reshard: the same backward, the cast kept
          unit_backward(u, block);
          post_backward_sums(u);
        }
        if (sync && A > 1 && !reduce_every) t.free("gradient accumulators (fp32)", 4 * units[u].full);
        t.free("parameter gradients", u < L ? e * units[u].full : e * V * D + head_grad);
        break;
      case StepEvent::Op::Optimizer:
        end_micro_batch();
        m = -1;
        break;
    }
  }

  // --- optimizer --------------------------------------------------------------------------------
  t.at("optimizer step");
  if (muon) {
    // Nesterov's blend of gradient and momentum (fp32, on the shards). Then, over several ranks,
    // the owner exchange (sharded_muon.cpp), in ns_dtype, each buffer freed once copied on: each
    // matrix's padded rows gathered into send parts and their concatenation, the rows received
    // from every rank, the owner's whole matrices (a W-th of them); after Newton-Schulz the rows
    // to send back and those returned. Under TP what the owner holds whole is its TP slice; the
    // TP stage (tensor_parallel_muon.cpp) gathers a split matrix's slices to one TP rank by the
    // same exchange, a tp-th of them each, unless it runs Newton-Schulz on the slices themselves
    // (the Gram mode) or the matrix is whole on every TP rank (shared key/value heads).
    // Newton-Schulz runs same-shape matrices as one batch: their stack, the normalised iterate,
    // X Xᵀ and its polynomial (k m x m for k matrices with m the short side) and the next iterate.
    const int64_t ns = at::elementSize(resolve_ns_dtype(c, cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU)));
    // (rows, cols, ranks sharing them) of what Newton-Schulz runs on -> matrices
    std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> groups;
    int64_t hidden_slices = 0, hidden_block = 0, tp_gathered = 0;
    for (const ParamSpec& p : specs)
      if (param_role(p.name, static_cast<int64_t>(p.shape.size())) == ParamRole::Hidden) {
        hidden_slices += p.numel();
        hidden_block += RowShard::of(p.shape, W).block_numel();
        const std::vector<int64_t>& whole = p.whole;
        const bool gathered = p.tp_dim >= 0 && !muon_tp_uses_gram(c.parallel.muon_tp, p.tp_dim, whole[0], whole[1], tp,
                                                                   c.optim.optim.ns_steps);
        if (gathered) tp_gathered += p.numel();
        const std::vector<int64_t>& run = gathered ? whole : p.shape;
        ++groups[{run[0], run[1], gathered ? W * tp : W}];
      }
    const std::string work = "optimizer work";
    // Into an exchange: `sent` elements out, `owned` assembled; the whole matrices are left.
    auto exchange_in = [&](int64_t sent, int64_t owned) {
      t.alloc(work, ns * 2 * sent);  // send parts, their concatenation
      t.free(work, ns * sent);
      t.alloc(work, ns * owned);  // received
      t.free(work, ns * sent);
      t.alloc(work, ns * owned);  // whole
      t.free(work, ns * owned);
    };
    // Out of it, once the stage made `results` bytes: the rows to send back, then what returns.
    auto exchange_out = [&](int64_t sent, int64_t owned, int64_t results) {
      t.free(work, ns * owned);  // whole
      t.alloc(work, ns * owned);  // back
      t.free(work, results);
      t.alloc(work, ns * sent);  // returned: this rank's rows of every result
      t.free(work, ns * owned);
    };
    t.alloc(work, 4 * hidden_local);  // the blend
    const int64_t owned = (hidden_slices + W - 1) / W;       // size-balanced owners
    const int64_t tp_owned = (tp_gathered + W - 1) / W;      // of those, what the TP stage moves
    const int64_t in_bytes = W > 1 || tp_owned > 0 ? ns : 4;  // what Newton-Schulz is handed
    if (W > 1) exchange_in(hidden_block, owned);
    if (tp_owned > 0) exchange_in(tp_owned, tp_owned);
    int64_t results = 0, tp_results = 0;  // of the data-parallel owner's matrices; of those gathered over TP
    for (const auto& [shape, count] : groups) {
      const auto [rows, cols, ranks] = shape;
      const int64_t k = (count + ranks - 1) / ranks, g = k * rows * cols;
      const int64_t m = std::min(rows, cols);
      const int64_t temps = in_bytes * g + ns * (2 * g + 2 * k * m * m);
      t.alloc(work, temps);
      t.free(work, temps);
      t.alloc(work, ns * g);  // the result, kept until every group is done
      (ranks > W ? tp_results : results) += ns * g;
    }
    if (tp_owned > 0) {
      exchange_out(tp_owned, tp_owned, tp_results);
      results += ns * tp_owned;  // what the TP stage returned is the data-parallel stage's result
    }
    if (W > 1) exchange_out(hidden_block, owned, results);
  }

  if (plan.diloco) {
    // After the step's gradients and the optimizer's temporaries are freed: a fragment's Δ as
    // tensors and flat, then what the exchange receives (the flat Δ itself for fp32; every
    // replica's bf16 values or codes with their tables otherwise) and Δ̄; uint8's codec works in
    // blocks beside them.
    t.at("DiLoCo outer step");
    t.free("optimizer work", t.live("optimizer work"));
    t.free("gradient shards (fp32)", t.live("gradient shards (fp32)"));
    const int64_t n = largest_fragment;
    const Compression compression = plan.diloco->compression;
    const int64_t received =
        compression == Compression::None ? 0 : plan.replicate * compressed_bytes(compression, n, kUint8Chunk);
    const int64_t codec = compression == Compression::UInt8 ? uint8_workspace_bytes(n, kUint8Chunk) : 0;
    t.alloc("DiLoCo outer step", 8 * n + received + codec);
  }

  MemoryEstimate est;
  est.peak = t.peak();
  est.peak_at = t.peak_at();
  for (const auto& [what, bytes] : t.at_peak())
    if (bytes > 0) est.at_peak.push_back({what, bytes});
  std::sort(est.at_peak.begin(), est.at_peak.end(), [](const auto& x, const auto& y) { return x.bytes > y.bytes; });
  est.activations_without_checkpointing = block_keeps * L;
  for (int64_t i = 0; i < L; ++i) est.activations_per_micro_batch += keeps_of(i);
  est.reduce_every_micro_batch = reduce_every;
  est.keep_unsharded = keep;
  return est;
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
