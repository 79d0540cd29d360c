#include "plan/step_plan.h"

#include <c10/core/ScalarType.h>

#include <functional>

#include "ddp/ddp_engine.h"
#include "parallel/row_shard.h"
#include "model/model_args.h"
#include "config/model_config.h"
#include "model/chunked_loss.h"
#include "optim/split_newton_schulz.h"
#include "optim/muon.h"
#include "optim/optimizer.h"
#include "optim/tensor_parallel_muon.h"
#include "optim/param_groups.h"
#include "diloco/diloco.h"

namespace zb {

EngineShard engine_shard(const ParamSpec& spec, int64_t shard, int64_t ep, int64_t tp) {
  if (ep == 1 || spec.shape.size() != 3) return {spec.shape, shard, false};
  std::vector<int64_t> mine = spec.shape;
  mine[0] /= ep;
  return {mine, shard * tp / ep, true};
}

namespace {

// Appends events to a plan, one call per thing the step does.
class PlanWriter {
 public:
  explicit PlanWriter(std::vector<StepEvent>& out) : out_(out) {}

  void mark(StepEvent::Op op, int64_t unit = -1) { out_.push_back(StepEvent::mark(op, unit)); }
  void micro_batch(int64_t m) { out_.push_back(StepEvent::micro_batch_start(m)); }
  // A ring collective over `ranks` ranks of `group`, `payload` bytes (comm_bytes.h's names).
  void ring(CommKind kind, const std::string& group, int64_t ranks, int64_t payload, std::string what,
            std::string overlap, int64_t unit = -1) {
    collective(kind, group, ranks, payload, ring_counted_bytes(kind, ranks, payload), std::move(what),
               std::move(overlap), unit);
  }
  void collective(CommKind kind, const std::string& group, int64_t ranks, int64_t payload, int64_t counted,
                  std::string what, std::string overlap, int64_t unit = -1) {
    StepEvent e = StepEvent::collective(kind, group, ranks, payload, counted);
    e.unit = unit;
    e.what = std::move(what);
    e.overlap = std::move(overlap);
    out_.push_back(std::move(e));
  }

 private:
  std::vector<StepEvent>& out_;
};

// The collectives inside the model (model/llama.cpp), in the order autograd runs them.
// Tensor parallelism's (model_parallel/tensor_parallel.h) over the "tp" group: `seq`: one rank's part of a
// micro-batch's activations [micro_bs, T/tp, D] in the compute dtype (the payload of every sequence
// gather and reduce-scatter); `norm`: a norm weight's gradient; `kv`: a shared key/value weight's
// gradient (0 when the heads are split); `chunks`: the loss's chunks, in tokens. Context
// parallelism's (model_parallel/context_parallel.h) over the "cp" group: `cp_kv`: one rank's keys (or
// values) of a micro-batch [micro_bs, T/cp, Hkv * Dh] in the compute dtype.
struct ModelEvents {
  int64_t tp = 1, seq = 0, norm = 0, kv = 0;
  std::vector<int64_t> chunks;
  int64_t cp = 1, cp_kv = 0;
  bool cp_ring = false;   // parallel.cp_rotate = "ring": keys and values passed to the next rank
  int64_t ring_grad = 0;  // around a ring, the fp32 gradients of one rank's keys and values
  int64_t float8_weights = 0;  // weights the sharding engine gathers in FP8 (their amaxes gathered first)
  // Expert parallelism (model/moe.h): over `ep` ranks, in the blocks `moe` marks, the counts'
  // exchange (E int64 each) and the rows' and results' (N K rows of D each way; their split
  // follows the routing, so the plan's bytes are those of a balanced one: the rest of the group
  // gets (ep - 1) / ep of them).
  int64_t ep = 1, ep_counts = 0, ep_rows = 0;
  std::vector<bool> moe;  // per block: a mixture of experts
  // Under TP a mixture's shared experts are the TP-split MLP (none: no MLP collectives), and the
  // gradients of its gate (`gate` bytes) and, without EP, of its whole expert stacks (`experts`
  // bytes each) are summed over the group.
  bool shared_experts = false;
  int64_t experts = 0, gate = 0;

  bool mixture(int64_t layer) const { return moe[static_cast<size_t>(layer)]; }
  bool tp_mlp(int64_t layer) const { return tp > 1 && (!mixture(layer) || shared_experts); }
  void ep_exchange(PlanWriter& w, int64_t payload, const std::string& what) const {
    w.collective(CommKind::AllToAll, "ep", ep, payload, 2 * payload / ep * (ep - 1), what, "exposed");
  }
  void moe_forward(PlanWriter& w) const {
    if (ep == 1) return;
    ep_exchange(w, ep_counts, "EP: tokens per expert");
    ep_exchange(w, ep_rows, "EP: rows to their experts (as balanced)");
    ep_exchange(w, ep_rows, "EP: results back (as balanced)");
  }
  void moe_backward(PlanWriter& w) const {
    if (ep > 1) {
      ep_exchange(w, ep_rows, "EP: results' gradients to the experts (as balanced)");
      ep_exchange(w, ep_rows, "EP: rows' gradients back (as balanced)");
    }
    if (tp == 1) return;
    if (ep == 1)  // under EP the expert shard group's reduction sums the TP ranks' (their experts differ)
      for (const char* m : {"w1", "w2", "w3"}) ring(w, CommKind::AllReduce, experts, std::string("TP: experts' ") + m + " gradient");
    ring(w, CommKind::AllReduce, gate, "TP: router gate gradient");
  }

  // One step around the ring: an all-to-all whose only parts go to the next rank and come from
  // the previous one (the same bytes each way).
  void ring_step(PlanWriter& w, int64_t payload, const std::string& what) const {
    w.collective(CommKind::AllToAll, "cp", cp, payload, 2 * payload, what, "exposed");
  }
  // Attention's keys and values: gathered whole, or cp - 1 steps around the ring.
  void cp_forward(PlanWriter& w) const {
    if (cp == 1) return;
    if (cp_ring) {
      for (int64_t s = 0; s + 1 < cp; ++s) ring_step(w, 2 * cp_kv, "CP: keys and values to the next rank");
      return;
    }
    for (const char* what : {"CP: keys of the row", "CP: values of the row"})
      w.ring(CommKind::AllGather, "cp", cp, cp_kv, what, "exposed");
  }
  // Their gradients back to their owners: the later gather's backward first; around the ring each
  // step passes the keys and values on and the gradient of the block held, and a last step takes
  // each gradient home.
  void cp_backward(PlanWriter& w) const {
    if (cp == 1) return;
    if (cp_ring) {
      for (int64_t s = 0; s < cp; ++s) {
        if (s + 1 < cp) ring_step(w, 2 * cp_kv, "CP: keys and values to the next rank");
        ring_step(w, ring_grad, "CP: their gradient to the next rank");
      }
      return;
    }
    for (const char* what : {"CP: values' gradients to their owners", "CP: keys' gradients to their owners"})
      w.ring(CommKind::ReduceScatter, "cp", cp, cp_kv, what, "exposed");
  }

  void ring(PlanWriter& w, CommKind kind, int64_t payload, const std::string& what) const {
    w.ring(kind, "tp", tp, payload, what, "exposed");
  }
  // The embedding's vocabulary slices summed and split into each rank's positions.
  void embedding_forward(PlanWriter& w) const {
    if (tp > 1) ring(w, CommKind::ReduceScatter, seq, "TP: embedding to sequence parts");
  }
  void embedding_backward(PlanWriter& w) const {
    if (tp > 1) ring(w, CommKind::AllGather, seq, "TP: embedding gradient, whole sequence");
  }
  // A block: the sequence gathered before attention's and the MLP's column-parallel products, the
  // row-parallel products' partial sums reduce-scattered back (a recompute does it again). A
  // mixture routes its own positions (EP's exchanges) before its shared experts run.
  void block_forward(PlanWriter& w, int64_t layer) const {
    if (tp > 1) ring(w, CommKind::AllGather, seq, "TP: sequence for the attention");
    cp_forward(w);
    if (tp > 1) ring(w, CommKind::ReduceScatter, seq, "TP: attention partial sums");
    if (mixture(layer)) moe_forward(w);
    if (!tp_mlp(layer)) return;
    ring(w, CommKind::AllGather, seq, "TP: sequence for the MLP");
    ring(w, CommKind::ReduceScatter, seq, "TP: MLP partial sums");
  }
  // Its backward, the MLP first: each gather's backward a reduce-scatter and the reverse, then (a
  // mixture's routed experts: EP's exchanges back, the whole weights' sums over TP) the norm
  // weight's gradient summed over the group (and the shared key/value weights', wv's first).
  // Attention's backward gives the keys' and values' gradients, which go back to their owners
  // over the CP group.
  void block_backward(PlanWriter& w, int64_t layer) const {
    if (tp_mlp(layer)) {
      ring(w, CommKind::AllGather, seq, "TP: MLP output gradient");
      ring(w, CommKind::ReduceScatter, seq, "TP: MLP input gradient");
    }
    if (mixture(layer)) moe_backward(w);
    if (tp > 1) {
      ring(w, CommKind::AllReduce, norm, "TP: MLP norm weight gradient");
      ring(w, CommKind::AllGather, seq, "TP: attention output gradient");
    }
    cp_backward(w);
    if (tp == 1) return;
    ring(w, CommKind::ReduceScatter, seq, "TP: attention input gradient");
    ring(w, CommKind::AllReduce, norm, "TP: attention norm weight gradient");
    if (kv > 0)
      for (const char* m : {"wv", "wk"}) ring(w, CommKind::AllReduce, kv, std::string("TP: shared ") + m + " gradient");
  }
  // The head: the sequence gathered, per chunk each rank's log-sum-exp and target logit gathered
  // (fp32 pairs); in backward the gather's reduce-scatter and the final norm's gradient.
  void loss(PlanWriter& w) const {
    if (tp == 1) return;
    ring(w, CommKind::AllGather, seq, "TP: sequence for the head");
    for (const int64_t n : chunks) ring(w, CommKind::AllGather, 4 * 2 * n, "TP: loss chunk's log-sum-exp and target");
    ring(w, CommKind::ReduceScatter, seq, "TP: head input gradient");
    ring(w, CommKind::AllReduce, norm, "TP: final norm weight gradient");
  }
};

// The sharding engine's micro-batches (fsdp/fsdp_engine.cpp, fsdp/fsdp_unit.cpp), in the order
// it makes them: units are blocks 0..L-1 and the root L, each with one or two parts (UnitParts);
// `group` the engine's communicator.
// `R`: the replicas the gradients are summed over (1 under DiLoCo, whose replicas train apart).
// FP8 all-gather (float8.enable_fsdp_float8_all_gather): whether the sharding engine gathers
// parameter `s` in FP8 (those the model multiplies in FP8, float8/float8.h).
bool gathered_in_float8(const Config& c, const ParamSpec& s) {
  const Float8Linears f8 = resolve_float8(c);
  return f8.fsdp_all_gather && s.shape.size() == 2 && f8.takes(s.name, s.shape[0], s.shape[1], gemm_tokens(c));
}

// What each unit puts into its collectives (FSDPUnit): per part, the elements of its rows on each
// rank (padded) and the bytes of its all-gather block (the compute dtype's; with an FP8 weight
// among them, each parameter's block in its own type rounded up to 16 bytes:
// FSDPParam::gather_bytes). Part 0 is the unit's over the shard group; `experts` the mixture's
// expert stacks under expert parallelism, over `expert_ranks` (empty blocks where there are none).
struct UnitParts {
  std::vector<int64_t> block, gather_bytes;
  std::vector<int64_t> experts, expert_gather_bytes;
  int64_t expert_ranks = 1;
};

UnitParts unit_parts(const Config& c, const std::vector<ParamSpec>& specs, int64_t L, int64_t S, int64_t tp,
                     int64_t compute_bytes) {
  UnitParts u;
  u.block.assign(L + 1, 0);
  u.gather_bytes.assign(L + 1, 0);
  u.experts.assign(L + 1, 0);
  u.expert_gather_bytes.assign(L + 1, 0);
  u.expert_ranks = S * tp / c.parallel.ep;
  std::vector<int64_t> bytes(L + 1, 0);
  std::vector<bool> fp8(L + 1, false);
  for (const ParamSpec& s : specs) {
    const size_t i = static_cast<size_t>(s.layer >= 0 ? s.layer : L);
    const EngineShard held = engine_shard(s, S, c.parallel.ep, tp);
    const int64_t n = held.rows().block_numel();
    if (held.experts) {
      u.experts[i] += n;
      u.expert_gather_bytes[i] += n * compute_bytes;
      continue;
    }
    const bool f = gathered_in_float8(c, s);
    u.block[i] += n;
    u.gather_bytes[i] += n * compute_bytes;
    bytes[i] += (n * (f ? 1 : compute_bytes) + 15) / 16 * 16;
    fp8[i] = fp8[i] || f;
  }
  for (size_t i = 0; i < bytes.size(); ++i)
    if (fp8[i]) u.gather_bytes[i] = bytes[i];
  return u;
}

void plan_fsdp_micro_batches(PlanWriter& w, const Config& c, const StepPlan& p, int64_t L, int64_t R,
                             const UnitParts& parts, const std::string& group, const ModelEvents& model) {
  const int64_t S = p.shard, Se = parts.expert_ranks;
  const std::vector<int64_t>& block = parts.block;
  const bool raf = c.train.reshard_after_forward;
  const int64_t ac = c.train.ac_ckpt;
  // Kept casts (one rank): each unit is cast in the first micro-batch's forward and never freed.
  const bool keep = p.keep_unsharded;
  auto name = [L](int64_t u) { return u == L ? std::string("root") : "block " + std::to_string(u); };
  auto resharded_after_forward = [&](int64_t i) { return raf && !keep && i != L - 1; };  // the last is kept
  auto has_experts = [&](int64_t u) { return parts.experts[static_cast<size_t>(u)] > 0; };
  auto gather = [&](int64_t u, const char* overlap) {  // issue_unshard: a collective over several ranks
    if (S > 1) w.ring(CommKind::AllGather, group, S, parts.gather_bytes[u], "gather " + name(u), overlap, u);
    if (has_experts(u) && Se > 1)
      w.ring(CommKind::AllGather, "expert_shard", Se, parts.expert_gather_bytes[u], "gather " + name(u) + "'s experts",
             overlap, u);
  };
  for (int64_t m = 0; m < p.micro_batches; ++m) {
    const bool sync = p.reduce_every_micro_batch || m == p.micro_batches - 1;
    int64_t reducing = -1;  // the unit whose reduce-scatter is in flight (FSDPCommContext)
    // post_backward's reduction: the unit before finishes its reduce-scatter (and under HSDP starts
    // its all-reduce over the replicas) before this one starts; one rank alone adds in place.
    // Block 0's and the root's reductions have no backward left to hide behind.
    // A part of one rank without replicas adds its sums in place (its experts too).
    auto replicate = [&](int64_t u, const char* overlap) {  // the replicas' sums of u's reduced rows
      w.ring(CommKind::AllReduce, "replicate", R, 4 * block[u], "sum " + name(u) + " over the replicas", overlap, u);
      if (has_experts(u))
        w.ring(CommKind::AllReduce, "replicate", R, 4 * parts.experts[u], "sum " + name(u) + "'s experts over the replicas",
               overlap, u);
    };
    auto reduce = [&](int64_t u) {
      // (Under TP a shard group of one can hold experts over several ranks: TP's.)
      const bool experts_reduced = has_experts(u) && (Se > 1 || R > 1);
      if (!sync || (S == 1 && R == 1 && !experts_reduced)) return;
      const char* overlap_of_previous = reducing > 0 && reducing < L ? "reduce" : "exposed";
      if (reducing >= 0 && R > 1) replicate(reducing, overlap_of_previous);
      const char* overlap = u > 0 && u < L ? "reduce" : "exposed";
      if (S > 1 || R > 1) w.ring(CommKind::ReduceScatter, group, S, 4 * block[u], "reduce " + name(u), overlap, u);
      if (experts_reduced)
        w.ring(CommKind::ReduceScatter, "expert_shard", Se, 4 * parts.experts[u], "reduce " + name(u) + "'s experts",
               overlap, u);
      reducing = u;
    };

    w.micro_batch(m);
    // Forward: the root (embedding, final norm, head) stays gathered to the end of backward;
    // each block is prefetched while the one before computes.
    const bool cast = !keep || m == 0;  // whether forward gathers (casts) the units
    // FP8 all-gather: the weights changed in the last step, so their scales first (an amax each).
    if (m == 0 && model.float8_weights > 0 && S > 1)
      w.ring(CommKind::AllGather, group, S, 4 * model.float8_weights, kFloat8AmaxGather, "exposed", L);
    gather(L, "exposed");
    if (cast) w.mark(StepEvent::Op::Unshard, L);
    if (L > 0) gather(0, "gather");
    model.embedding_forward(w);
    for (int64_t i = 0; i < L; ++i) {
      if (cast) w.mark(StepEvent::Op::Unshard, i);
      if (i + 1 < L) gather(i + 1, "gather");
      w.mark(StepEvent::Op::Forward, i);
      model.block_forward(w, i);
      if (resharded_after_forward(i)) w.mark(StepEvent::Op::Reshard, i);
    }
    w.mark(StepEvent::Op::Loss);
    model.loss(w);
    // Backward, last block first. A block freed after forward is gathered again from a hook on
    // its output's gradient, which also prefetches the block before; the block nearest the
    // head is gathered there, the others were prefetched.
    for (int64_t i = L - 1; i >= 0; --i) {
      if (resharded_after_forward(i)) {
        if (!resharded_after_forward(i + 1)) gather(i, "regather");
        w.mark(StepEvent::Op::Unshard, i);
        if (i > 0) gather(i - 1, "regather");
      }
      if (ac > 0 && i % ac == 0) {
        w.mark(StepEvent::Op::Recompute, i);
        model.block_forward(w, i);
      }
      model.block_backward(w, i);
      // Post-backward: the gathered copy freed, the gradients reduced (or summed for later).
      if (!keep) w.mark(StepEvent::Op::Reshard, i);
      reduce(i);
      w.mark(StepEvent::Op::Backward, i);
    }
    model.embedding_backward(w);
    if (!keep) w.mark(StepEvent::Op::Reshard, L);
    reduce(L);
    w.mark(StepEvent::Op::Backward, L);
    // finish_backward: the root's reduce-scatter completes, then its all-reduce over the replicas.
    if (reducing >= 0 && R > 1) replicate(reducing, "exposed");
  }
}

// Data parallelism (ddp/ddp_engine.cpp): a bucket's all-reduce starts when backward is done with
// the stage of the forward that first read it (the loss, a block, the embedding), so all but the
// embedding's overlap the rest of backward.
void plan_ddp_micro_batches(PlanWriter& w, const StepPlan& p, const std::vector<ParamSpec>& specs, int64_t L,
                            double bucket_mb) {
  std::vector<int64_t> numels, layers;
  for (const ParamSpec& s : specs) numels.push_back(s.numel()), layers.push_back(s.layer);
  const std::vector<DDPBucket> buckets = ddp_buckets(numels, layers, L, bucket_mb);
  for (int64_t m = 0; m < p.micro_batches; ++m) {
    const bool sync = p.reduce_every_micro_batch || m == p.micro_batches - 1;
    auto reduce_stage = [&](int64_t stage) {  // the buckets first read at `stage`, in their order
      for (size_t b = 0; sync && b < buckets.size(); ++b) {
        if (buckets[b].first_stage != stage) continue;
        int64_t n = 0;
        for (size_t k : buckets[b].members) n += numels[k];
        w.ring(CommKind::AllReduce, "world", p.world, 4 * n, "gradient bucket " + std::to_string(b),
               stage > 0 ? "reduce" : "exposed");
      }
    };
    w.micro_batch(m);
    w.mark(StepEvent::Op::Loss);
    reduce_stage(L + 1);
    for (int64_t i = L - 1; i >= 0; --i) {
      reduce_stage(i + 1);
      w.mark(StepEvent::Op::Backward, i);
    }
    reduce_stage(0);
  }
}

}  // namespace

StepPlan plan_step(const Config& c, const ParallelMesh& mesh, const ResolvedRun& run) {
  StepPlan p;
  const EngineKind engine = mesh.engine();
  const int64_t world_size = mesh.world_size(), rank = mesh.rank();
  p.engine = engine;
  p.world = world_size;
  p.rank = rank;
  p.shard = mesh.shape().dp_shard_cp;
  p.replicate = mesh.shape().replicate;
  p.tp = mesh.shape().tp;
  p.cp = mesh.shape().cp;
  p.micro_batches = run.micro_batches;
  p.reduce_every_micro_batch = run.reduce_every_micro_batch;
  p.keep_unsharded = run.keep_unsharded;

  const ModelArgs a = resolve_model_args(c);
  const int64_t L = a.n_layers, S = p.shard, R = p.replicate, tp = p.tp;
  const std::vector<ParamSpec> specs = param_specs(a, tp);  // this rank's slices under TP
  const int64_t ns = at::elementSize(resolve_ns_dtype(c, run.device));
  const int64_t shard_rank = mesh.shard_rank();  // its place in its shard group
  // Its place among the ranks holding its experts (parallel.ep > 1): consecutive in its replica.
  const int64_t expert_place = mesh.shape().expert_index_of(rank) % mesh.shape().expert_stride();
  // Muon's matrices, in the order the optimizer holds them (model order), with their whole shapes
  // and how TP splits them.
  std::vector<ParamSpec> muon;
  if (c.optim.optim.type == "muon")
    for (const ParamSpec& s : specs)
      if (param_role(s.name, static_cast<int64_t>(s.shape.size())) == ParamRole::Hidden) muon.push_back(s);

  PlanWriter w(p.events);
  const bool fsdp = engine == EngineKind::Sharded;
  const bool diloco = fsdp && c.diloco.inner_steps > 0;
  // The engine's communicator: the world unless groups were made.
  const std::string shard_group = mesh.shard_group_name();
  if (fsdp) {
    const int64_t compute_bytes = at::elementSize(run.compute_dtype);
    const UnitParts parts = unit_parts(c, specs, L, S, tp, compute_bytes);
    ModelEvents model_events;
    for (const ParamSpec& s : specs) model_events.float8_weights += gathered_in_float8(c, s);
    // Under context parallelism a rank's tokens are its share of each row (T / cp of them), and
    // its keys and values are its TP share of the key/value heads.
    const int64_t T = c.data.seq_length / p.cp;
    if (p.cp > 1) {
      model_events.cp = p.cp;
      model_events.cp_kv = compute_bytes * c.train.micro_bs * T * tp_share(a, tp).kv_heads * a.head_dim();
      model_events.cp_ring = run.attention.cp_ring();
      model_events.ring_grad = 2 * 4 * c.train.micro_bs * T * tp_share(a, tp).kv_heads * a.head_dim();
    }
    for (int64_t i = 0; i < L; ++i) model_events.moe.push_back(a.moe_layer(i));
    model_events.shared_experts = a.num_shared_experts > 0;
    model_events.experts = compute_bytes * (a.num_experts / c.parallel.ep) * a.expert_hidden() * a.dim;
    model_events.gate = compute_bytes * a.num_experts * a.dim;
    if (c.parallel.ep > 1) {  // a rank routes its own positions: T / tp of each row under TP
      model_events.ep = c.parallel.ep;
      model_events.ep_counts = 8 * a.num_experts;
      model_events.ep_rows = compute_bytes * c.train.micro_bs * (T / tp) * a.top_k * a.dim;
    }
    if (tp > 1) {
      model_events.tp = tp;
      model_events.seq = compute_bytes * c.train.micro_bs * (T / tp) * a.dim;
      model_events.norm = compute_bytes * a.dim;
      const TpShare share = tp_share(a, tp);
      if (share.kv_shared) model_events.kv = compute_bytes * a.n_kv_heads * a.head_dim() * a.dim;
      // The head's chunks over the whole sequence, sized by the rank's slice of the vocabulary.
      const int64_t n = c.train.micro_bs * T;
      const int64_t chunk = loss_chunk_tokens(share.vocab, run.device.is_cuda());
      for (int64_t start = 0; start < n; start += chunk) model_events.chunks.push_back(std::min(chunk, n - start));
    }
    plan_fsdp_micro_batches(w, c, p, L, diloco ? 1 : R, parts, shard_group, model_events);
  } else {
    plan_ddp_micro_batches(w, p, specs, L, c.train.bucket_mb);
  }

  // The step's own: the gradient norm's sum of squares over the ranks holding different rows (a
  // replica computes it alone), then the mean loss (under DiLoCo each replica's), the non-finite
  // flag and the loop's two flags (StepFlags: stop, failed save) over every rank.
  w.mark(StepEvent::Op::Optimizer);
  if (fsdp) w.ring(CommKind::AllReduce, shard_group, S, 4, "gradient norm", "exposed");
  if (tp > 1) w.ring(CommKind::AllReduce, "tp", tp, 4, "gradient norm over the TP group", "exposed");
  w.ring(CommKind::AllReduce, "world", p.world, 4 * ((diloco ? R : 1) + 3), "loss and flags", "exposed");

  // Muon (optim/sharded_muon.cpp, optim/replicated_muon.cpp, optim/tensor_parallel_muon.cpp), in
  // its Newton-Schulz dtype. Owners are chosen by the whole matrices' cost, the same on every rank.
  auto total_elements = [](const std::vector<ParamSpec>& matrices) {
    int64_t n = 0;
    for (const auto& m : matrices) n += m.numel();
    return n;
  };
  auto whole_shapes = [](const std::vector<ParamSpec>& matrices) {
    std::vector<std::vector<int64_t>> out;
    for (const ParamSpec& m : matrices) out.push_back(m.whole);
    return out;
  };
  // An owner exchange over `ranks` ranks of `group` (orthogonalize_by_owner): rows of `shapes` to
  // their owners, then `middle` (what the owner does), then the results back.
  auto owner_exchange = [&](const std::string& group, int64_t ranks, int64_t me,
                            const std::vector<std::vector<int64_t>>& shapes, const std::vector<int64_t>& owner,
                            const std::string& what, const std::function<void()>& middle) {
    int64_t total = 0, mine = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t b = RowShard::of(shapes[i], ranks).block_numel();
      total += b;
      if (owner[i] == me) mine += b;
    }
    const int64_t counted = ns * ((total - mine) + (ranks - 1) * mine);
    w.collective(CommKind::AllToAll, group, ranks, ns * total, counted, what + ": rows to their owners", "exposed");
    middle();
    w.collective(CommKind::AllToAll, group, ranks, ns * ranks * mine, counted, what + ": results back", "exposed");
  };
  // The TP group completing the matrices `held` (their slices): gram matrices one by one, then
  // the split ones gathered to owners in the group (a column slice as rows of the transpose).
  auto tensor_parallel_stage = [&](const std::vector<ParamSpec>& held) {
    if (tp == 1) return;
    std::vector<std::vector<int64_t>> gathered, gathered_whole;
    for (const ParamSpec& m : held) {
      if (m.tp_dim < 0) continue;
      const std::vector<int64_t>& whole = m.whole;
      if (muon_tp_splits(c.parallel.muon_tp, m.tp_dim, whole[0], whole[1], tp, c.optim.optim.ns_steps)) {
        w.ring(CommKind::AllReduce, "tp", tp, ns, "Muon: " + m.name + "'s norm over the TP group", "exposed");
        for (int64_t k = 0; k < c.optim.optim.ns_steps; ++k)
          w.ring(CommKind::AllReduce, "tp", tp, ns * split_newton_schulz_gram_numel(m.tp_dim, whole[0], whole[1]),
                 "Muon: " + m.name + "'s Gram matrix", "exposed");
        continue;
      }
      gathered.push_back(m.tp_dim == 1 ? std::vector<int64_t>{whole[1], whole[0]} : whole);
      gathered_whole.push_back(whole);
    }
    if (!gathered.empty())
      owner_exchange("tp", tp, rank % tp, gathered, assign_owners_by_cost(gathered_whole, tp), "Muon over TP", [] {});
  };
  // Whole (TP-local) matrices every rank of `group` holds alike: each orthogonalises its share,
  // one all-reduce shares them.
  auto split_stage = [&](const std::string& group, int64_t ranks, int64_t me, const std::vector<ParamSpec>& held) {
    const std::vector<int64_t> owner = assign_owners_by_cost(whole_shapes(held), ranks);
    std::vector<ParamSpec> mine;
    for (size_t i = 0; i < held.size(); ++i)
      if (owner[i] == me) mine.push_back(held[i]);
    tensor_parallel_stage(mine);
    if (!held.empty()) w.ring(CommKind::AllReduce, group, ranks, ns * total_elements(held), "Muon: results", "exposed");
  };
  const bool split = c.parallel.muon_split_over_replicas && !diloco;  // DiLoCo's momenta differ
  const int64_t replica = mesh.shape().replica_of(rank);  // under DDP every rank is a replica
  if (!muon.empty() && fsdp && S > 1) {
    // Every matrix's padded rows to its owner in the shard group, and its rows of the result back.
    // (A mixture of experts' stacks are sharded by whole experts, orthogonalised where they are.)
    std::vector<ParamSpec> matrices;
    for (const ParamSpec& m : muon)
      if (m.shape.size() == 2) matrices.push_back(m);
    std::vector<std::vector<int64_t>> slices;
    for (const ParamSpec& m : matrices) slices.push_back(m.shape);
    const std::vector<int64_t> owner = assign_owners_by_cost(whole_shapes(matrices), S);
    std::vector<ParamSpec> owned;
    for (size_t i = 0; i < matrices.size(); ++i)
      if (owner[i] == shard_rank) owned.push_back(matrices[i]);
    owner_exchange(shard_group, S, shard_rank, slices, owner, "Muon", [&] {
      // The replicas own the same matrices: they split them and share the results.
      if (split && R > 1) split_stage("replicate", R, replica, owned);
      else tensor_parallel_stage(owned);
    });
  } else if (!muon.empty() && fsdp && R > 1 && split) {
    // Shard groups of one: whole slices, and the rank's own experts of each stack (under TP over
    // several ranks, their rows of them).
    std::vector<ParamSpec> held = muon;
    for (ParamSpec& m : held)
      if (const EngineShard e = engine_shard(m, S, c.parallel.ep, tp); e.experts)
        m.shape = {e.rows().rows_of(expert_place), m.shape[1], m.shape[2]};
    split_stage("replicate", R, replica, held);
  } else if (!muon.empty() && !fsdp && p.world > 1) {
    split_stage("world", p.world, rank, muon);
  } else if (!muon.empty()) {
    tensor_parallel_stage(muon);
  }

  // A mixture of experts' balance (parallel/expert_balance.cpp), after the optimizer: each MoE
  // block's counts and auxiliary loss, float64, summed over every rank.
  if (a.moe_layers() > 0)
    w.ring(CommKind::AllReduce, "world", p.world, 8 * a.moe_layers() * (a.num_experts + 1), "expert counts", "exposed");
  // The attention logits' watch (parallel/qk_clip.cpp): every head's largest logit, fp32 [L, H],
  // the largest over every rank (a DiLoCo replica's: its shard and TP groups); then QK-clip's
  // scaling, no collective.
  if (c.logging.max_attention_logit || c.optim.optim.qk_clip_threshold > 0) {
    const std::string what = "attention logits' maxima";
    if (!diloco) w.ring(CommKind::AllReduce, "world", p.world, 4 * L * a.n_heads, what, "exposed");
    if (diloco) w.ring(CommKind::AllReduce, shard_group, S, 4 * L * a.n_heads, what, "exposed");
    if (diloco && tp > 1) w.ring(CommKind::AllReduce, "tp", tp, 4 * L * a.n_heads, what, "exposed");
  }

  if (diloco) {  // diloco/diloco.cpp: each fragment's Δ, this rank's rows, flat
    StepPlan::Diloco d;
    d.inner_steps = c.diloco.inner_steps;
    d.fragments = c.diloco.fragments;
    d.fragment_delay = c.diloco.fragment_delay;
    d.compression = parse_compression(c.diloco.compression);
    d.values.assign(static_cast<size_t>(d.fragments), 0);
    for (const ParamSpec& s : specs) {
      const EngineShard held = engine_shard(s, S, c.parallel.ep, tp);
      d.values[static_cast<size_t>(fragment_of(s.name, L, d.fragments))] +=
          held.rows().numel_of(held.experts ? expert_place : shard_rank);
    }
    for (int64_t f = 0; f < d.fragments; ++f) {
      std::vector<StepEvent> events;
      PlanWriter x(events);
      const int64_t n = d.values[static_cast<size_t>(f)];
      const std::string what = "DiLoCo: fragment " + std::to_string(f) + "'s pseudo-gradients";
      if (R > 1 && n > 0) {
        if (d.compression == Compression::None) x.ring(CommKind::AllReduce, "replicate", R, 4 * n, what, "outer");
        if (d.compression == Compression::BF16) x.ring(CommKind::AllGather, "replicate", R, 2 * n, what, "outer");
        if (d.compression == Compression::UInt8) {  // the codes, then the chunks' tables
          x.ring(CommKind::AllGather, "replicate", R, n, what + " (codes)", "outer");
          x.ring(CommKind::AllGather, "replicate", R, compressed_bytes(Compression::UInt8, n, kUint8Chunk) - n,
                 what + " (tables)", "outer");
        }
      }
      d.exchanges.push_back(std::move(events));
    }
    PlanWriter norm(d.norm);
    norm.ring(CommKind::AllReduce, shard_group, S, 4, "DiLoCo: pseudo-gradient norm", "exposed");
    if (tp > 1) norm.ring(CommKind::AllReduce, "tp", tp, 4, "DiLoCo: pseudo-gradient norm over the TP group", "exposed");
    p.diloco = std::move(d);
  }
  return p;
}

int64_t StepPlan::Diloco::replicate_bytes_per_period() const {
  int64_t bytes = 0;
  for (const auto& events : exchanges)
    for (const StepEvent& e : events) bytes += e.counted;
  return bytes;
}

std::map<std::string, std::map<std::string, int64_t>> StepPlan::counted_bytes() const {
  std::map<std::string, std::map<std::string, int64_t>> bytes;
  for (const StepEvent& e : events)
    if (e.op == StepEvent::Op::Collective) {
      bytes[e.group][comm_kind_name(e.kind)] += e.counted;
      bytes["total"][comm_kind_name(e.kind)] += e.counted;
    }
  return bytes;
}

nlohmann::json plan_to_json(const StepPlan& p) {
  auto events = [](const std::vector<StepEvent>& list) {
    nlohmann::json out = nlohmann::json::array();
    int64_t micro = -1;
    for (const StepEvent& e : list) {
      if (e.op == StepEvent::Op::MicroBatch) micro = e.micro_batch;
      if (e.op == StepEvent::Op::Optimizer) micro = -1;
      nlohmann::json j = {{"op", step_op_name(e.op)}};
      if (micro >= 0) j["micro_batch"] = micro;
      if (e.unit >= 0) j["unit"] = e.unit;
      if (e.op == StepEvent::Op::Collective) {
        j["kind"] = comm_kind_name(e.kind);
        j["group"] = e.group;
        j["ranks"] = e.ranks;
        j["payload"] = e.payload;
        j["counted"] = e.counted;
        j["overlap"] = e.overlap;
      }
      if (!e.what.empty()) j["what"] = e.what;
      out.push_back(std::move(j));
    }
    return out;
  };
  nlohmann::json diloco = nullptr;
  if (p.diloco) {
    nlohmann::json exchanges = nlohmann::json::array();
    for (const auto& x : p.diloco->exchanges) exchanges.push_back(events(x));
    const int64_t period = p.diloco->replicate_bytes_per_period();
    diloco = {{"inner_steps", p.diloco->inner_steps},
              {"fragments", p.diloco->fragments},
              {"fragment_delay", p.diloco->fragment_delay},
              {"exchanges", exchanges},
              {"norm", events(p.diloco->norm)},
              {"replicate_bytes_per_period", period},
              {"replicate_bytes_per_step", static_cast<double>(period) / static_cast<double>(p.diloco->inner_steps)}};
  }
  return {
      {"parallelism", p.engine == EngineKind::Sharded ? "fsdp" : "ddp"},
      {"world", p.world},
      {"shard", p.shard},
      {"replicate", p.replicate},
      {"tp", p.tp},
      {"cp", p.cp},
      {"rank", p.rank},
      {"micro_batches", p.micro_batches},
      {"reduce_every_micro_batch", p.reduce_every_micro_batch},
      {"keep_unsharded", p.keep_unsharded},
      {"events", events(p.events)},
      {"counted_bytes", p.counted_bytes()},
      {"diloco", diloco},
  };
}

}  // namespace zb
