#include "train/step_plan.h"

#include <c10/core/ScalarType.h>

#include "ddp/ddp_engine.h"
#include "parallel/row_shard.h"
#include "model/model_args.h"
#include "config/model_config.h"
#include "optim/muon.h"
#include "optim/param_groups.h"
#include "train/diloco.h"

namespace zb {

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

// The sharding engine's micro-batches (fsdp/fsdp_engine.cpp, fsdp/fsdp_unit.cpp), in the order
// it makes them: units are blocks 0..L-1 and the root L; `block[u]` is the elements unit u puts
// into a collective (its rows on each rank, padded); `group` the engine's communicator.
// `R`: the replicas the gradients are summed over (1 under DiLoCo, whose replicas train apart).
void plan_fsdp_micro_batches(PlanWriter& w, const Config& c, const StepPlan& p, int64_t L, int64_t R,
                             const std::vector<int64_t>& block, int64_t compute_bytes, const std::string& group) {
  const int64_t S = p.shard;
  const bool raf = c.train.reshard_after_forward;
  const int64_t ac = c.train.ac_ckpt;
  auto name = [L](int64_t u) { return u == L ? std::string("root") : "block " + std::to_string(u); };
  auto resharded_after_forward = [&](int64_t i) { return raf && i != L - 1; };  // the last is kept
  auto gather = [&](int64_t u, const char* overlap) {  // issue_unshard: a collective over several ranks
    if (S > 1) w.ring(CommKind::AllGather, group, S, compute_bytes * block[u], "gather " + name(u), overlap, u);
  };
  for (int64_t m = 0; m < p.micro_batches; ++m) {
    const bool sync = p.reduce_every_micro_batch || m == p.micro_batches - 1;
    int64_t reducing = -1;  // the unit whose reduce-scatter is in flight (FSDPCommContext)
    // post_backward's reduction: the unit before finishes its reduce-scatter (and under HSDP starts
    // its all-reduce over the replicas) before this one starts; one rank alone adds in place.
    // Block 0's and the root's reductions have no backward left to hide behind.
    auto reduce = [&](int64_t u) {
      if (!sync || (S == 1 && R == 1)) return;
      const char* overlap_of_previous = reducing > 0 && reducing < L ? "reduce" : "exposed";
      if (reducing >= 0 && R > 1)
        w.ring(CommKind::AllReduce, "replicate", R, 4 * block[reducing], "sum " + name(reducing) + " over the replicas",
               overlap_of_previous, reducing);
      w.ring(CommKind::ReduceScatter, group, S, 4 * block[u], "reduce " + name(u), u > 0 && u < L ? "reduce" : "exposed",
             u);
      reducing = u;
    };

    w.micro_batch(m);
    // Forward: the root (embedding, final norm, head) stays gathered to the end of backward;
    // each block is prefetched while the one before computes.
    gather(L, "exposed");
    w.mark(StepEvent::Op::Unshard, L);
    if (L > 0) gather(0, "gather");
    for (int64_t i = 0; i < L; ++i) {
      w.mark(StepEvent::Op::Unshard, i);
      if (i + 1 < L) gather(i + 1, "gather");
      w.mark(StepEvent::Op::Forward, i);
      if (resharded_after_forward(i)) w.mark(StepEvent::Op::Reshard, i);
    }
    w.mark(StepEvent::Op::Loss);
    // Backward, last block first. A block freed after forward is gathered again from a hook on
    // its output's gradient, which also prefetches the block before; the block nearest the
    // head is gathered there, the others were prefetched.
    for (int64_t i = L - 1; i >= 0; --i) {
      if (resharded_after_forward(i)) {
        if (!resharded_after_forward(i + 1)) gather(i, "regather");
        w.mark(StepEvent::Op::Unshard, i);
        if (i > 0) gather(i - 1, "regather");
      }
      if (ac > 0 && i % ac == 0) w.mark(StepEvent::Op::Recompute, i);
      // Post-backward: the gathered copy freed, the gradients reduced (or summed for later).
      w.mark(StepEvent::Op::Reshard, i);
      reduce(i);
      w.mark(StepEvent::Op::Backward, i);
    }
    w.mark(StepEvent::Op::Reshard, L);
    reduce(L);
    w.mark(StepEvent::Op::Backward, L);
    // finish_backward: the root's reduce-scatter completes, then its all-reduce over the replicas.
    if (reducing >= 0 && R > 1)
      w.ring(CommKind::AllReduce, "replicate", R, 4 * block[reducing], "sum root over the replicas", "exposed",
             reducing);
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

StepPlan plan_step(const Config& c, int64_t world_size, int64_t rank, Parallelism parallelism,
                   at::ScalarType compute_dtype, at::ScalarType ns_dtype, bool reduce_every_micro_batch) {
  StepPlan p;
  p.parallelism = parallelism;
  p.world = world_size;
  p.rank = rank;
  const ShardLayout layout = parallelism == Parallelism::FSDP ? shard_layout(c, world_size) : ShardLayout{};
  p.shard = parallelism == Parallelism::FSDP ? layout.shard : 1;
  p.replicate = parallelism == Parallelism::FSDP ? layout.replicate : world_size;
  p.micro_batches = grad_accum_steps(c, world_size);
  p.reduce_every_micro_batch = reduce_every_micro_batch && p.micro_batches > 1;

  const ModelArgs a = resolve_model_args(c);
  const std::vector<ParamSpec> specs = param_specs(a);
  const int64_t L = a.n_layers, S = p.shard, R = p.replicate;
  const int64_t ns = at::elementSize(ns_dtype);
  // Muon's matrices, in the order the optimizer holds them (model order).
  std::vector<std::vector<int64_t>> muon;
  if (c.optim.optim.type == "muon")
    for (const ParamSpec& s : specs)
      if (param_role(s.name, static_cast<int64_t>(s.shape.size())) == ParamRole::Hidden) muon.push_back(s.shape);

  PlanWriter w(p.events);
  const bool fsdp = parallelism == Parallelism::FSDP;
  const bool diloco = fsdp && c.diloco.inner_steps > 0;
  const std::string shard_group = R > 1 && fsdp ? "shard" : "world";  // the engine's communicator
  if (fsdp) {
    std::vector<int64_t> block(L + 1, 0);
    for (const ParamSpec& s : specs) block[s.layer >= 0 ? s.layer : L] += RowShard::of(s.shape, S).block_numel();
    plan_fsdp_micro_batches(w, c, p, L, diloco ? 1 : R, block, at::elementSize(compute_dtype), shard_group);
  } else {
    plan_ddp_micro_batches(w, p, specs, L, c.train.bucket_mb);
  }

  // The step's own: the gradient norm's sum of squares over the ranks holding different rows (a
  // replica computes it alone), then the mean loss (under DiLoCo each replica's) and the
  // non-finite flag over every rank.
  w.mark(StepEvent::Op::Optimizer);
  if (fsdp) w.ring(CommKind::AllReduce, shard_group, S, 4, "gradient norm", "exposed");
  w.ring(CommKind::AllReduce, "world", p.world, 4 * ((diloco ? R : 1) + 1), "loss and non-finite flag", "exposed");

  // Muon (optim/sharded_muon.cpp, optim/replicated_muon.cpp), in its Newton-Schulz dtype.
  auto total_elements = [](const std::vector<std::vector<int64_t>>& shapes) {
    int64_t n = 0;
    for (const auto& s : shapes) n += s[0] * s[1];
    return n;
  };
  const bool split = c.parallel.muon_split_over_replicas && !diloco;  // DiLoCo's momenta differ
  if (!muon.empty() && fsdp && S > 1) {
    // Every matrix's padded rows to its owner in the shard group, and its rows of the result back.
    const std::vector<int64_t> owner = assign_owners_by_cost(muon, S);
    const int64_t me = rank % S;
    int64_t total = 0, mine = 0;
    std::vector<std::vector<int64_t>> owned;
    for (size_t i = 0; i < muon.size(); ++i) {
      const int64_t b = RowShard::of(muon[i], S).block_numel();
      total += b;
      if (owner[i] == me) mine += b, owned.push_back(muon[i]);
    }
    const int64_t counted = ns * ((total - mine) + (S - 1) * mine);
    w.collective(CommKind::AllToAll, shard_group, S, ns * total, counted, "Muon: rows to their owners", "exposed");
    // The replicas own the same matrices: they split them and share the results.
    if (split && R > 1 && !owned.empty())
      w.ring(CommKind::AllReduce, "replicate", R, ns * total_elements(owned), "Muon: results over the replicas",
             "exposed");
    w.collective(CommKind::AllToAll, shard_group, S, ns * S * mine, counted, "Muon: results back", "exposed");
  } else if (!muon.empty() && ((fsdp && R > 1 && split) || (!fsdp && p.world > 1))) {
    // Whole matrices on every rank: each orthogonalises its share, one all-reduce shares them.
    w.ring(CommKind::AllReduce, fsdp ? "replicate" : "world", R, ns * total_elements(muon), "Muon: results",
           "exposed");
  }

  PlanWriter after(p.after_step);
  after.ring(CommKind::AllReduce, "world", p.world, 8, "agreement on stopping", "exposed");

  if (diloco) {  // train/diloco.cpp: each fragment's Δ, this rank's rows, flat
    StepPlan::Diloco d;
    d.inner_steps = c.diloco.inner_steps;
    d.fragments = c.diloco.fragments;
    d.fragment_delay = c.diloco.fragment_delay;
    d.compression = parse_compression(c.diloco.compression);
    d.values.assign(static_cast<size_t>(d.fragments), 0);
    for (const ParamSpec& s : specs)
      d.values[static_cast<size_t>(fragment_of(s.name, L, d.fragments))] += RowShard::of(s.shape, S).numel_of(rank % S);
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
    std::vector<StepEvent> norm;
    PlanWriter(norm).ring(CommKind::AllReduce, shard_group, S, 4, "DiLoCo: pseudo-gradient norm", "exposed");
    d.norm = norm.front();
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
  for (const auto* list : {&events, &after_step})
    for (const StepEvent& e : *list)
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
              {"norm", events({p.diloco->norm}).front()},
              {"replicate_bytes_per_period", period},
              {"replicate_bytes_per_step", static_cast<double>(period) / static_cast<double>(p.diloco->inner_steps)}};
  }
  return {
      {"parallelism", p.parallelism == Parallelism::FSDP ? "fsdp" : "ddp"},
      {"world", p.world},
      {"shard", p.shard},
      {"replicate", p.replicate},
      {"rank", p.rank},
      {"micro_batches", p.micro_batches},
      {"reduce_every_micro_batch", p.reduce_every_micro_batch},
      {"events", events(p.events)},
      {"after_step", events(p.after_step)},
      {"counted_bytes", p.counted_bytes()},
      {"diloco", diloco},
  };
}

}  // namespace zb
