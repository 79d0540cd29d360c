#pragma once
// A run's parts, built from its config on its mesh: the model, the engine that spreads it over the
// ranks, the optimizer with Muon placed on the mesh, DiLoCo's outer optimizer and the data. Each
// part owns its state; the Trainer (train/trainer.h) wires them into one step. A program may look
// at or wrap a part between building and training (tests/faulty_train.cpp wraps the engine).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "config/config.h"
#include "config/resolved_run.h"
#include "data/loader.h"
#include "data/sources.h"
#include "kernels/kernel_choices.h"
#include "model/llama.h"
#include "optim/optimizer.h"
#include "parallel/mesh.h"
#include "parallel/parallel_model.h"
#include "parallel/model_parallel_group.h"
#include "diloco/diloco.h"

namespace zb {

// The training data and how attention reads it.
struct RunData {
  std::unique_ptr<DataLoader> train;                // this rank's rows of every global batch
  std::shared_ptr<const SampleSource> validation;   // null without validation data
  std::optional<DocumentDelimiter> documents;       // model.attention = "document"
  std::string attention_kernel;                     // model/attention.h's attention_kernel
};

// In the order they are destroyed last to first: what a part uses is declared before it.
struct TrainingParts {
  // The run's values as resolve_run resolved them from the config (config/resolved_run.h).
  TrainingParts(ParallelMesh mesh, const ResolvedRun& run)
      : mesh(std::move(mesh)), device(run.device), compute_dtype(run.compute_dtype), kernels(run.kernels),
        attention(run.attention), accum(run.micro_batches), reduce_every_micro_batch(run.reduce_every_micro_batch),
        keep_unsharded(run.keep_unsharded) {}

  ParallelMesh mesh;
  c10::Device device;
  at::ScalarType compute_dtype;
  KernelChoices kernels;    // the model, Muon, the gradient sums
  AttentionPath attention;  // the Trainer's documents, the model's ring, the kernel the metrics name
  std::unique_ptr<ModelParallelGroup> tp_group;  // the model's view of the mesh's TP group
  std::unique_ptr<ModelParallelGroup> cp_group;  // and of its CP group
  std::unique_ptr<ModelParallelGroup> ep_group;  // and of its EP group
  std::unique_ptr<Llama> model;
  std::unique_ptr<ParallelModel> engine;          // FSDPEngine or DDPEngine
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<DiLoCo> diloco;                 // diloco.inner_steps > 0 only
  RunData data;
  int64_t accum = 1;                              // micro-batches per step on this rank
  bool reduce_every_micro_batch = false;          // into sharded sums (train.reduce_every_micro_batch)
  bool keep_unsharded = false;                    // the engine keeps its casts (train.keep_unsharded)
};

// Everything from the config; the model is initialised from runtime.seed identically on every rank
// and then sharded (FSDP) or replicated (DDP). `config` must be validated for the mesh's world.
// `autos`: what "auto" in train.reduce_every_micro_batch and train.keep_unsharded became (the
// memory verdict's, plan/run_policy.h); by default off.
TrainingParts build_training(const Config& config, ParallelMesh mesh, c10::Device device,
                             const MemoryChoices& autos = {});

// The parts one at a time, in the order build_training calls them.
std::unique_ptr<Llama> build_model(const Config& config, const TrainingParts& parts);
std::unique_ptr<ParallelModel> build_engine(const Config& config, const TrainingParts& parts);
// Sharded Muon: each matrix's owner inside the shard group. Replicas own the same matrices (of the
// same, already all-reduced momentum): they split them, or each does all of them. Under DiLoCo the
// replicas' momenta differ: each does its own. Under TP what those assemble are slices: the TP
// group completes each matrix.
void place_muon(Muon& muon, const Config& config, const ParallelMesh& mesh);
RunData build_data(const Config& config, const TrainingParts& parts);
// Elastic DiLoCo: what every replica of a run must share (its TP degree, the model, the data and
// batch, the schedule, the optimizers), as one line; a replica that differs is refused. Shard
// counts may differ (diloco/membership.h).
std::string replica_fingerprint(const Config& config, const ModelArgs& args, int64_t tp);

}  // namespace zb
