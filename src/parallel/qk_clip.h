#pragma once
// The attention logits' watch and QK-clip (Kimi K2's MuonClip). The model records each block's
// largest pre-softmax logit q·k/√Dh per head over a step's training forwards (Llama's
// watch_attention_logits). Once a step, after the optimizer, this takes each head's largest over
// every rank that computed some of it (a MAX all-reduce over the world of [layers, heads]: the
// ranks of a TP group hold different heads, those of the data and CP groups different tokens;
// under DiLoCo over the replica's own ranks),
// reports each block's largest, and, with a threshold τ > 0 and the step applied, scales the
// heads that passed it: S the head's largest logit, γ = τ / S, its query rows (wq) times γ^α and
// its key rows (wk) times γ^(1-α). A key head shared by several query heads (GQA) takes the
// smallest γ of them, so every head's logits come back to τ at most. Every other tensor, and the
// rows of heads below τ, stay as they are, bit for bit. The rows are the fp32 ones the engine
// holds (its shards, FSDP's and TP's slices alike: by their row_start).
#include <vector>

#include "dist/comm.h"
#include "model/llama.h"
#include "parallel/parallel_model.h"

namespace zb {

struct AttentionLogitStats {
  std::vector<double> max_by_layer;  // each block's largest logit over its heads
  int64_t heads_clipped = 0;         // over every block, this step
};

class QkClip {
 public:
  // `threshold` 0: the watch alone. `over`: groups whose ranks' largest logits count, one MAX
  // all-reduce each: the world; under DiLoCo, whose replicas train apart, a replica's shard and TP
  // groups (the null ones skipped).
  QkClip(Llama& model, std::vector<Communicator*> over, double threshold, double alpha);
  ~QkClip();
  // After the optimizer; every rank calls it. `apply`: the step was applied (else the logits are
  // reported, nothing is clipped). The watch starts again either way.
  AttentionLogitStats step(bool apply, const std::vector<ShardedParameter>& params);

 private:
  Llama& model_;
  std::vector<Communicator*> over_;
  double threshold_, alpha_;
};

}  // namespace zb
