#pragma once
// One definition of a training step: the ordered events one rank's step makes, built from the
// layout (FSDP, HSDP or DDP; world and group sizes), the model's shapes and the step's options
// (reshard after forward, activation checkpointing, micro-batches, reduce every micro-batch,
// buckets, the optimizer). For each micro-batch: gathers (with the prefetches in the order the
// engine issues them), parameters in place, block forwards, frees, recomputes, gradients handed
// over, reduce-scatters and the replicas' all-reduces; then the step's own collectives (the
// gradient norm, the loss with the loop's flags, Muon's exchanges). The loop adds none.
//
// The engines record what they do into a StepTrace (parallel/step_trace.h); tests check that the
// trace of a real step equals the plan over the grid of layouts and options. What models the
// step reads the plan: `train_fsdp --print-plan` prints it as JSON, which scripts/perf/scale_model.py
// turns into bytes by group and a time model, and the bytes are those the metrics count.
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/resolved_run.h"
#include "dist/compression.h"
#include "model/model_args.h"
#include "parallel/mesh.h"
#include "parallel/row_shard.h"
#include "parallel/step_trace.h"

namespace zb {

// How the sharding engine holds a parameter (fsdp/fsdp_engine.h): its rows over the shard group's
// `shard` ranks; under expert parallelism (ep > 1) a routed experts' stack is this rank's E/ep
// experts, over the shard x tp / ep ranks that hold them (the "expert_shard" group: its unit's
// second part; MeshShape::expert_stride).
struct EngineShard {
  std::vector<int64_t> shape;  // what is sharded: the parameter, or this rank's experts of it
  int64_t ranks = 1;
  bool experts = false;
  RowShard rows() const { return RowShard::of(shape, ranks); }
};
EngineShard engine_shard(const ParamSpec& spec, int64_t shard, int64_t ep, int64_t tp);

// What the plan calls the FP8 all-gather's gather of the weights' amaxes (a step's first).
inline constexpr const char* kFloat8AmaxGather = "FP8 weights' amaxes";

struct StepPlan {
  // What it was made for.
  EngineKind engine = EngineKind::Sharded;
  int64_t world = 1, shard = 1, replicate = 1, tp = 1, cp = 1, rank = 0;
  int64_t micro_batches = 1;
  bool reduce_every_micro_batch = false;
  // One rank per shard group keeping its casts (train.keep_unsharded "true"): each unit is cast
  // once, in the first micro-batch's forward, and never freed.
  bool keep_unsharded = false;
  // Trainer::train_step's events, in order.
  std::vector<StepEvent> events;

  // Bytes counted per group ("world", "shard", "replicate") and kind over the events: one step's
  // record from the second on, in a step without evaluation or a checkpoint save (their
  // collectives count in the record of the step they follow). "total" sums the groups. Under
  // DiLoCo an inner step's; the outer steps' are below.
  std::map<std::string, std::map<std::string, int64_t>> counted_bytes() const;

  // DiLoCo (diloco.inner_steps > 0): the steps above are inner steps (no gradient crosses between
  // replicas). Each fragment's outer step adds, after the step it falls in (diloco/diloco.h), its
  // exchange over the replicate group (none with one replica) and, in the step its Δ̄ is applied,
  // the norm's sum over the shard group.
  struct Diloco {
    int64_t inner_steps = 0, fragments = 1, fragment_delay = 0;
    Compression compression = Compression::None;
    std::vector<int64_t> values;                     // this rank's values of each fragment
    std::vector<std::vector<StepEvent>> exchanges;  // per fragment
    std::vector<StepEvent> norm;                     // the outer steps' norm: shard group, then TP group
    // The exchanges' counted bytes over one period of inner_steps steps (every fragment once).
    int64_t replicate_bytes_per_period() const;
  };
  std::optional<Diloco> diloco;
};

// The plan of the mesh's rank (config validated for its world) in `run` as resolve_run resolved it
// (config/resolved_run.h): its dtypes, micro-batches, per-micro-batch reduction and kept casts; on
// a GPU the loss's chunks are sized for it (model/chunked_loss.h), and TP's per-chunk gathers
// follow them.
StepPlan plan_step(const Config& config, const ParallelMesh& mesh, const ResolvedRun& run);

// The plan as JSON: layout, events (each with its notes) and counted bytes.
nlohmann::json plan_to_json(const StepPlan& plan);

}  // namespace zb
