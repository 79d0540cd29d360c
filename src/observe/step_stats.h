#pragma once
// What one training step did (Trainer::train_step), for the metrics, the log and the run policy.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "diloco/diloco.h"
#include "model/moe.h"

namespace zb {

struct StepStats {
  int64_t step = 0;
  double loss = 0;       // mean over the global batch
  double grad_norm = 0;  // before clipping (under DiLoCo: the first replica's)
  // Which of the loss and the gradient norm was not finite ("" when both were): such a step is
  // never applied (no update, optimizer state untouched, the schedule does not advance).
  std::string nonfinite;
  int64_t skipped_in_a_row = 0;  // non-finite steps up to this one, in a row
  int64_t skipped_total = 0;     // over the whole run, resumes included
  std::vector<std::pair<std::string, double>> learning_rates;
  // Time of the step's phases on the device, in seconds (forward includes the loss; backward
  // includes waiting for the gradients' collectives; optimizer includes clipping): host clock on
  // CPU, CUDA events on a GPU.
  double forward_seconds = 0, backward_seconds = 0, optimizer_seconds = 0;
  // DiLoCo: each replica's mean loss over its part of the batch, and the outer step this step
  // ended with, if any.
  std::vector<double> replica_losses;
  std::optional<OuterSyncStats> outer;
  // Elastic replicas: the membership this step's round changed to (the first one at step 1).
  std::optional<RoundReport> membership;
  // A mixture of experts: each of its blocks' balance over the step.
  std::vector<ExpertBalanceStats> experts;
  // The attention logits' watch (logging.max_attention_logit, or QK-clip): each block's largest
  // logit this step, and the heads QK-clip scaled.
  std::vector<double> max_attention_logit;
  int64_t qk_clipped_heads = 0;
  // The loop's flags (StepFlags) counted over the ranks by the step's own all-reduce.
  int64_t ranks_stopping = 0, ranks_failed_save = 0;
};

}  // namespace zb
