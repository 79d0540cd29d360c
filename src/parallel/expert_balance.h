#pragma once
// A mixture of experts' balancing across the ranks (model/moe.h): once a step, before the
// optimizer, the tokens each expert got are summed over every rank that routed some (one
// all-reduce for all blocks), DeepSeek-V3's bias moves by them (model.load_balance_coeff), and
// the counts start again. The biases are training state: saved in checkpoints, the same on every
// rank.
#include <vector>

#include "dist/comm.h"
#include "model/llama.h"
#include "util/stateful.h"

namespace zb {

class ExpertBalance : public Stateful {
 public:
  // `ranks`: every rank that routes tokens of the batch (the world; they all hold every block's
  // router); both outlive this.
  ExpertBalance(Llama& model, Communicator& ranks);
  // After the micro-batches of a step: sums the counts (and the auxiliary losses' values) over
  // the ranks; with `apply` (the step is applied) each bias moves. The counts start again either
  // way. `micro_batches`: those the sums are over, for the mean auxiliary loss. Every rank calls it.
  std::vector<ExpertBalanceStats> step(bool apply, int64_t micro_batches);

  std::vector<StateTensor> tensors() override;

 private:
  Llama& model_;
  Communicator& ranks_;
  std::vector<int64_t> layers_;  // the mixture-of-experts blocks
};

}  // namespace zb
