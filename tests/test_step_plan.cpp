// The step plan (plan/step_plan.h) against what real steps do: on 1 to 4 processes over Gloo,
// every layout (FSDP, each hybrid-sharding split, DDP, DiLoCo, tensor parallelism with each) and every combination of resharding after
// forward, activation checkpointing and reducing on every micro-batch, the events a Trainer's
// step records (the engine's gathers, frees and hand-offs, and every collective with its group
// and bytes) must be exactly the plan's, in order.
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "config/config.h"
#include "dist/comm.h"
#include "multiprocess.h"
#include "config/resolved_run.h"
#include "plan/step_plan.h"
#include "train/trainer.h"

using namespace zb;

namespace {

const c10::Device kCpu(c10::kCPU);

struct Layout {
  EngineKind engine;
  int64_t shard;  // FSDP: ranks per shard group (the world: plain FSDP)
  std::string name;
  bool diloco = false;  // the shard groups train apart, an outer step every 2 steps
  int64_t tp = 1;       // tensor parallelism (shard x replicate x tp = world)
  std::string muon_tp = "auto";
  int64_t kv_heads = 0;  // 0: the preset's
  int64_t cp = 1;        // context parallelism (inside the shard groups: shard counts dp_shard x cp)
  std::string cp_rotate = "allgather";
};

std::vector<Layout> layouts(int64_t world) {
  std::vector<Layout> out{{EngineKind::Sharded, world, "FSDP"}, {EngineKind::Replicated, world, "DDP"}};
  for (int64_t s = 1; s < world; ++s)
    if (world % s == 0)
      out.push_back({EngineKind::Sharded, s, "HSDP " + std::to_string(s) + "x" + std::to_string(world / s)});
  for (int64_t s = 1; s <= world; ++s)
    if (world % s == 0)
      out.push_back({EngineKind::Sharded, s, "DiLoCo " + std::to_string(s) + "x" + std::to_string(world / s), true});
  // Tensor parallelism: alone (Muon's Gram mode too), under FSDP, HSDP and DiLoCo, and with key/value
  // heads shared by two ranks each.
  if (world == 2) {
    out.push_back({EngineKind::Sharded, 1, "TP 2", false, 2});
    out.push_back({EngineKind::Sharded, 1, "TP 2, Muon split over the slices", false, 2, "split"});
  }
  if (world == 4) {
    out.push_back({EngineKind::Sharded, 2, "TP 2 x FSDP 2", false, 2});
    out.push_back({EngineKind::Sharded, 1, "TP 2 x HSDP 1x2", false, 2});
    out.push_back({EngineKind::Sharded, 1, "TP 2 x DiLoCo 1x2", true, 2});
    out.push_back({EngineKind::Sharded, 1, "TP 4, shared key/value heads", false, 4, "auto", 2});
  }
  // Context parallelism: alone, under FSDP, HSDP and DiLoCo, with TP, and around the ring.
  if (world == 2) {
    out.push_back({EngineKind::Sharded, 1, "CP 2", false, 1, "auto", 0, 2});
    out.push_back({EngineKind::Sharded, 1, "CP 2, ring", false, 1, "auto", 0, 2, "ring"});
  }
  if (world == 4) {
    out.push_back({EngineKind::Sharded, 2, "CP 2 x FSDP 2", false, 1, "auto", 0, 2});
    out.push_back({EngineKind::Sharded, 1, "CP 2 x HSDP 1x2", false, 1, "auto", 0, 2});
    out.push_back({EngineKind::Sharded, 1, "CP 2 x TP 2", false, 2, "auto", 0, 2});
    out.push_back({EngineKind::Sharded, 1, "CP 4, ring", false, 1, "auto", 0, 4, "ring"});
    out.push_back({EngineKind::Sharded, 1, "CP 2 x DiLoCo 1x2", true, 1, "auto", 0, 2});
  }
  return out;
}

// Three blocks (so the last, the one before it and the others all occur), two micro-batches per
// rank, fp32, Newton-Schulz in fp32; the debug model at dim 128 (every matrix still a bucket of its
// own, rows still uneven over 3 ranks; half the time of dim 256, most of it Newton-Schulz's).
Config config(const Layout& l, int64_t world, bool reshard, int64_t ac, bool reduce_every, const std::string& opt,
              bool keep_unsharded = false) {
  std::ostringstream toml;
  toml << "name_model = \"debugmodel\"\ntype_model = \"llama2\"\n"
       << "[model]\nn_layers = 3\ndim = 128\n" << (l.kv_heads ? "n_kv_heads = " + std::to_string(l.kv_heads) + "\n" : "")
       << "[train]\nmicro_bs = 1\nac_ckpt = " << ac << "\nreshard_after_forward = " << (reshard ? "true" : "false")
       << "\nreduce_every_micro_batch = " << (reduce_every ? "true" : "false") << "\nbucket_mb = 0.05\n"
       << "keep_unsharded = " << (keep_unsharded ? "true" : "false") << "\n"
       << "[optim]\nbatch_size = " << 2 * world / (l.tp * l.cp) << "\ntotal_steps = 4\n"
       << "[optim.optim]\ntype = \"" << opt << "\"\nns_dtype = \"float32\"\n"
       << "[data]\nfake = true\nseq_length = 16\n[runtime]\ndevice = \"cpu\"\n";
  if (l.engine == EngineKind::Sharded)
    toml << "[parallel]\ndp_shard = " << l.shard << "\ndp_replicate = " << world / (l.shard * l.tp * l.cp)
         << "\ntp = " << l.tp << "\ncp = " << l.cp << "\ncp_rotate = \"" << l.cp_rotate << "\"\nmuon_tp = \""
         << l.muon_tp << "\"\n";
  if (l.diloco) toml << "[diloco]\ninner_steps = 2\n";
  Config c = load_config_string(toml.str(), "test");
  validate(c, world);
  return c;
}

std::vector<std::string> lines(const std::vector<StepEvent>& events) {
  std::vector<std::string> out;
  for (const StepEvent& e : events) out.push_back(e.describe());
  return out;
}

// Equal, or a failure that shows where the two part.
void expect_same_events(const std::vector<std::string>& traced, const std::vector<std::string>& planned,
                        const std::string& what) {
  if (traced == planned) return;
  size_t i = 0;
  while (i < traced.size() && i < planned.size() && traced[i] == planned[i]) ++i;
  std::ostringstream msg;
  msg << what << ": the step's trace and the plan part at event " << i << " (" << traced.size() << " traced, "
      << planned.size() << " planned)\n";
  const size_t after = std::getenv("ZB_PLAN_DIFF_ALL") ? 1000 : 4;
  for (size_t k = i >= 3 ? i - 3 : 0; k < std::max(traced.size(), planned.size()) && k < i + after; ++k)
    msg << "  " << k << ": traced [" << (k < traced.size() ? traced[k] : "") << "]  planned ["
        << (k < planned.size() ? planned[k] : "") << "]\n";
  ADD_FAILURE() << msg.str();
}

// `steps` traced steps of `trainer`, each equal to the plan (DiLoCo's outer step, the exchange
// then the norm, in the second); an evaluation after step `evaluate_after` (0: none).
void expect_steps_as_planned(Trainer& trainer, const StepPlan& plan, bool diloco, int steps, int evaluate_after,
                             const std::string& what,
                             const std::function<std::string(const std::string&)>& normalize = nullptr) {
  StepTrace trace;
  trainer.set_step_trace(&trace);
  for (int step = 1; step <= steps; ++step) {
    trace.clear();
    trainer.train_step();
    std::vector<StepEvent> planned = plan.events;
    if (diloco && step == 2) {
      ASSERT_TRUE(plan.diloco.has_value());
      for (const StepEvent& e : plan.diloco->exchanges.front()) planned.push_back(e);
      planned.insert(planned.end(), plan.diloco->norm.begin(), plan.diloco->norm.end());
    }
    std::vector<std::string> traced = lines(trace.events()), want = lines(planned);
    if (normalize) {
      for (std::string& l : traced) l = normalize(l);
      for (std::string& l : want) l = normalize(l);
    }
    expect_same_events(traced, want, what + ", step " + std::to_string(step));
    if (step == evaluate_after) trainer.evaluate();
  }
  trainer.set_step_trace(nullptr);
}

}  // namespace

class StepPlanMatchesTheTrace : public ::testing::TestWithParam<int> {};

TEST_P(StepPlanMatchesTheTrace, EveryLayoutAndOption) {
  const int world = GetParam();
  multiprocess::run_ranks(world, [world](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    int checked = 0;
    for (const Layout& l : layouts(world))
      for (const bool reshard : {true, false})
        for (const int64_t ac : {0, 2})
          for (const bool reduce_every : {false, true}) {
            if (l.engine == EngineKind::Replicated && (!reshard || ac > 0)) continue;  // FSDP's options
            if (l.diloco && !(reshard && ac == 0 && reduce_every)) continue;  // the inner step and the outer
            // Under TP or CP: AdamW once, Muon with recompute, and Muon keeping blocks gathered.
            if ((l.tp > 1 || l.cp > 1) && !l.diloco && !((reshard && ac == 0 && !reduce_every) || (reshard && ac > 0 && reduce_every) ||
                                          (!reshard && ac > 0 && !reduce_every)))
              continue;
            // AdamW once per layout (no optimizer collectives), Muon everywhere else.
            const std::string opt = reshard && ac == 0 && !reduce_every ? "adamw" : "muon";
            const Config c = config(l, world, reshard, ac, reduce_every, opt);
            const std::string what = l.name + " on " + std::to_string(world) + ", reshard " +
                                     std::to_string(reshard) + ", ac_ckpt " + std::to_string(ac) +
                                     ", reduce every micro-batch " + std::to_string(reduce_every) + ", " + opt +
                                     ", rank " + std::to_string(rank);
            Trainer trainer(c, ParallelMesh(c, comm, l.engine), c10::Device(c10::kCPU));
            const StepPlan plan = plan_step(c, ParallelMesh(c, world, rank, l.engine), resolve_run(c, world, l.engine, kCpu));
            // The first step and one after it.
            expect_steps_as_planned(trainer, plan, l.diloco, 2, /*evaluate_after=*/0, what);
            ++checked;
          }
    // 8 per FSDP layout, 2 for DDP, 1 per DiLoCo layout (one per divisor of the world size), 3 per
    // TP or CP layout without DiLoCo.
    int diloco_layouts = 0, tp_layouts = 0;
    for (const Layout& l : layouts(world)) diloco_layouts += l.diloco, tp_layouts += (l.tp > 1 || l.cp > 1) && !l.diloco;
    EXPECT_EQ(checked, 8 * (static_cast<int>(layouts(world).size()) - 1 - diloco_layouts - tp_layouts) + 2 +
                           diloco_layouts + 3 * tp_layouts);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, StepPlanMatchesTheTrace, ::testing::Values(1, 2, 3, 4));

// A mixture of experts (the first block dense, a shared expert, the balancing bias) with QK-clip:
// Muon's expert stacks orthogonalised where they are, the balance's and the attention logits'
// all-reduces after the optimizer, on every FSDP, HSDP, CP, TP and DiLoCo layout, with and without
// activation checkpointing.
class StepPlanWithExperts : public ::testing::TestWithParam<int> {};

TEST_P(StepPlanWithExperts, EqualTheTrace) {
  const int world = GetParam();
  multiprocess::run_ranks(world, [world](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    int checked = 0;
    // The rows' exchanges follow the routing: their order and group are planned, their bytes (the
    // plan's are a balanced routing's) are not compared. The counts' exchange is exact.
    auto routed_bytes_aside = [](const std::string& line) {
      const bool rows = line.rfind("all_to_all ep ", 0) == 0 && line.find(" payload=32 ") == std::string::npos;
      return rows ? line.substr(0, line.find(" payload=")) + " (rows)" : line;
    };
    for (const Layout& l : layouts(world)) {
      if (l.engine != EngineKind::Sharded) continue;
      const int64_t ranks = l.shard * l.cp * l.tp;  // a replica's, which EP's groups are carved from
      for (const int64_t ep : {1, 2, 4})
        for (const int64_t ac : {0, 2}) {
          // With activation checkpointing everywhere; without it once per layout, where all of the
          // replica's ranks split the experts (the plan's AC-free passes are StepPlan's other tests').
          if (ranks % ep != 0 || (ac == 0 && ranks != ep)) continue;
          Config c = config(l, world, /*reshard=*/true, ac, /*reduce_every=*/false, "muon");
          for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
                   {"model.num_experts", "4"}, {"model.top_k", "2"}, {"model.moe_inter_dim", "64"},
                   {"model.n_dense_layers", "1"}, {"model.num_shared_experts", "1"},
                   {"model.load_balance_coeff", "0.001"}, {"parallel.ep", std::to_string(ep)},
                   {"optim.optim.qk_clip_threshold", "100"}})
            apply_override(c, key, value);
          validate(c, world);
          const std::string what = l.name + " with experts (EP " + std::to_string(ep) + ") on " + std::to_string(world) +
                                   ", ac_ckpt " + std::to_string(ac) + ", rank " + std::to_string(rank);
          Trainer trainer(c, ParallelMesh(c, comm, l.engine), c10::Device(c10::kCPU));
          const StepPlan plan = plan_step(c, ParallelMesh(c, world, rank, l.engine), resolve_run(c, world, l.engine, kCpu));
          expect_steps_as_planned(trainer, plan, l.diloco, 2, /*evaluate_after=*/1, what, routed_bytes_aside);
          ++checked;
        }
    }
    EXPECT_GT(checked, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, StepPlanWithExperts, ::testing::Values(1, 2, 4));

// Kept casts (train.keep_unsharded, one rank per shard group): in every layout where they apply,
// with and without resharding after forward and activation checkpointing, three steps' traces
// (an evaluation between the second and the third) equal the plan: each unit cast once a step, in
// the first micro-batch's forward, never freed.
class StepPlanKeepingCasts : public ::testing::TestWithParam<int> {};

TEST_P(StepPlanKeepingCasts, EqualTheTrace) {
  const int world = GetParam();
  multiprocess::run_ranks(world, [world](int rank) {
    Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
    int checked = 0;
    for (const Layout& l : layouts(world)) {
      if (l.engine != EngineKind::Sharded || l.shard != 1) continue;
      for (const bool reshard : {true, false})
        for (const int64_t ac : {0, 2}) {
          if (l.diloco && !(reshard && ac == 0)) continue;
          const Config c = config(l, world, reshard, ac, false, "muon", /*keep_unsharded=*/true);
          const StepPlan plan = plan_step(c, ParallelMesh(c, world, rank, l.engine), resolve_run(c, world, l.engine, kCpu));
          const bool replicas = world / (l.tp * l.cp) > 1 && !l.diloco;  // HSDP's: the casts are not kept
          // Nor under CP, whose shard group holds the CP group's ranks (dp_shard x cp).
          EXPECT_EQ(plan.keep_unsharded, !replicas && l.cp == 1) << l.name;
          if (!plan.keep_unsharded) continue;
          const std::string what = l.name + " on " + std::to_string(world) + ", reshard " + std::to_string(reshard) +
                                   ", ac_ckpt " + std::to_string(ac) + ", rank " + std::to_string(rank);
          Trainer trainer(c, ParallelMesh(c, comm, l.engine), c10::Device(c10::kCPU));
          EXPECT_TRUE(trainer.keeps_unsharded()) << what;
          expect_steps_as_planned(trainer, plan, l.diloco, 3, /*evaluate_after=*/2, what);
          ++checked;
        }
    }
    EXPECT_GT(checked, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, StepPlanKeepingCasts, ::testing::Values(1, 2, 4));

// Kept casts change no number: one process, two micro-batches a step, with and without
// resharding after forward and activation checkpointing, and an evaluation between steps (its
// forward reuses or remakes the casts): the same losses and the same parameters after three
// steps, bit for bit, as without keeping them.
TEST(StepPlan, KeptCastsTrainBitForBitAsWithout) {
  Communicator comm(detect_world(), c10::Device(c10::kCPU), std::chrono::seconds(60));
  const Layout fsdp{EngineKind::Sharded, 1, "FSDP"};
  for (const bool reshard : {true, false})
    for (const int64_t ac : {0, 2}) {
      auto run = [&](bool keep) {
        Config c = config(fsdp, 1, reshard, ac, false, "muon", keep);
        c.data.eval_interval = 0;
        Trainer trainer(c, ParallelMesh(c, comm, EngineKind::Sharded), c10::Device(c10::kCPU));
        EXPECT_EQ(trainer.keeps_unsharded(), keep);
        std::vector<double> losses;
        for (int step = 1; step <= 3; ++step) {
          losses.push_back(trainer.train_step().loss);
          if (step == 2) losses.push_back(trainer.evaluate());
        }
        std::vector<at::Tensor> params;
        for (auto& [name, value] : trainer.parallel().gather_full_parameters()) params.push_back(value);
        return std::make_pair(losses, params);
      };
      const auto [kept_losses, kept] = run(true);
      const auto [losses, params] = run(false);
      const std::string what = "reshard " + std::to_string(reshard) + ", ac_ckpt " + std::to_string(ac);
      EXPECT_EQ(kept_losses, losses) << what;
      ASSERT_EQ(kept.size(), params.size());
      for (size_t i = 0; i < params.size(); ++i)
        EXPECT_TRUE(at::equal(kept[i], params[i])) << what << ", tensor " << i;
    }
}

// The plan's own arithmetic where it is easy to state: plain FSDP on 4 ranks, one micro-batch,
// AdamW. Each block is gathered in forward and, but for the last, again in backward, and each
// unit's gradients reduce-scattered once; the bytes follow comm_bytes.h's convention.
TEST(StepPlan, CountsOneGatherAndOneReductionPerUnitAndPass) {
  Config c = config({EngineKind::Sharded, 4, "FSDP"}, 4, true, 0, false, "adamw");
  c.optim.batch_size = 4;  // one micro-batch each
  c.runtime.compute_dtype = "bfloat16";
  const StepPlan plan = plan_step(c, ParallelMesh(c, 4, 0, EngineKind::Sharded), resolve_run(c, 4, EngineKind::Sharded, kCpu));
  int64_t gathers = 0, reductions = 0, gathered_bytes = 0;
  for (const StepEvent& e : plan.events) {
    if (e.op != StepEvent::Op::Collective) continue;
    if (e.kind == CommKind::AllGather) ++gathers, gathered_bytes += e.payload;
    if (e.kind == CommKind::ReduceScatter) ++reductions;
    EXPECT_EQ(e.ranks, 4);
  }
  EXPECT_EQ(gathers, 1 + 3 + 2);  // the root, three blocks, then two of them again
  EXPECT_EQ(reductions, 3 + 1);
  const auto bytes = plan.counted_bytes();
  EXPECT_EQ(bytes.at("world").at("all_gather"), 2 * 3 * gathered_bytes);
  EXPECT_EQ(bytes.at("total").at("all_gather"), bytes.at("world").at("all_gather"));
}
