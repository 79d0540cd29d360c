#include "diloco/step_hook.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include <chrono>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/state.h"
#include "data/loader.h"
#include "dist/row_moves.h"
#include "optim/optimizer.h"
#include "util/log.h"

namespace zb {

DiLoCoHook::DiLoCoHook(DiLoCo& diloco, ParallelModel& engine, Optimizer& optimizer, DataLoader& data,
                       Communicator& world, int64_t total_steps)
    : diloco_(diloco), engine_(engine), optimizer_(optimizer), data_(data), world_(world), total_steps_(total_steps) {}

void DiLoCoHook::before_step(const StepCounters& counters) {
  // The outer copies start from the parameters the run begins with (initial weights loaded after
  // construction included).
  if (!outer_set_) {
    diloco_.start();
    outer_set_ = true;
  }
  if (diloco_.elastic() && !in_membership_) {  // round 0, at the run's (or resume's) start
    new_membership_ = follow(diloco_.join(resumed_stream_rows_, counters.step - 1));
    in_membership_ = true;
  }
}

DiLoCoStepReport DiLoCoHook::after_step(StepCounters& counters) {
  // The membership the step began in, when new (round 0, a joiner's admission); one this step's
  // outer round changes to replaces it.
  DiLoCoStepReport report{diloco_.after_step(counters.step, total_steps_, data_.stream_rows_read()),
                          std::exchange(new_membership_, std::nullopt)};
  engine_.parameters_changed();
  if (report.outer && report.outer->round && report.outer->round->changed) {
    report.membership = follow(*report.outer->round);
    if (!report.outer->round->joined.empty()) {
      try {
        share_state(*report.outer->round, counters);
      } catch (const std::exception& e) {  // the joiner's loss: the next round leaves it out
        log::warn(strf("DiLoCo: sending the joiners their state failed: %s", e.what()));
      }
    }
  }
  return report;
}

void DiLoCoHook::join_run(StepCounters& counters) {
  TORCH_CHECK(diloco_.elastic(), "joining a run needs diloco.peers");
  RoundReport round = diloco_.await_admission(total_steps_);
  const auto start = std::chrono::steady_clock::now();
  const int64_t bytes = share_state(round, counters);
  outer_set_ = in_membership_ = true;  // the outer copies came with the state
  engine_.parameters_changed();
  follow(round);
  log::info(strf("DiLoCo: took %s bytes of state (%s) from replica %ld in %.2f s; training on after step %ld",
                 with_commas(bytes).c_str(), round.with_optimizer ? "with its optimizer state" : "outer state only",
                 round.source, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                 counters.step));
  new_membership_ = round;
}

StateRecord DiLoCoHook::record() const {
  StateRecord r{{"inner_steps", diloco_.inner_steps()}, {"replicas", diloco_.replicas()}};
  if (diloco_.elastic()) r["stream_rows"] = data_.stream_rows_read();
  return r;
}

void DiLoCoHook::restore(const RestorePoint& at) {
  outer_set_ = true;  // the checkpoint held the outer copies
  diloco_.restore(at.step, total_steps_);
  if (at.record && at.record->count("stream_rows")) resumed_stream_rows_ = at.record->at("stream_rows");
}

const RoundReport& DiLoCoHook::follow(const RoundReport& round) {
  const Quorum& q = round.membership();
  data_.reposition(q.stream_rows, round.member_index, static_cast<int64_t>(q.members.size()));
  return round;
}

int64_t DiLoCoHook::share_state(const RoundReport& round, StepCounters& counters) {
  // Only the source and the joiners: the other members' links stay free.
  const std::unique_ptr<Communicator> group = diloco_.transfer_group(round);
  if (!group) return 0;
  // A large state over a slow link takes longer than runtime.timeout_s; no collective of this
  // replica's world completes meanwhile, so its watchdog stands down (the group's own collectives
  // time out each). The loop's phase again after (train/training_loop.cpp).
  world_.set_phase("");
  const bool taking = !round.sends_state();
  at::Tensor sent = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  sent.data_ptr<int64_t>()[0] = counters.step;
  sent.data_ptr<int64_t>()[1] = counters.skipped;
  group->broadcast(sent, 0).wait();  // rank 0: the source's first shard rank
  counters.step = sent.data_ptr<int64_t>()[0];
  counters.skipped = sent.data_ptr<int64_t>()[1];
  int64_t bytes = taking ? sent.numel() * 8 : 0;
  at::NoGradGuard no_grad;
  std::vector<StateTensor> state = ModelState(engine_, optimizer_, /*per_replica=*/false).tensors();
  for (StateTensor& t : tensors()) state.push_back(std::move(t));
  // Not the parameters: right after the outer step they equal the outer copies on every member.
  std::vector<StateTensor> shared;
  for (StateTensor& t : state)
    if (t.name.rfind("model/", 0) != 0 && (round.with_optimizer || t.name.rfind("optim/", 0) != 0))
      shared.push_back(std::move(t));
  // The source's rows of each tensor go to the joiners' ranks that hold them in their own layout
  // (their shard counts may differ; dist/row_moves.h), a dtype at a time. A tensor every rank
  // holds whole (a scalar, replicated rows) comes from the source's rank 0.
  std::map<at::ScalarType, std::vector<size_t>> by_dtype;
  for (size_t i = 0; i < shared.size(); ++i) by_dtype[shared[i].local.scalar_type()].push_back(i);
  for (const auto& [dtype, indices] : by_dtype) {
    std::vector<RowSpan> held, wanted;
    std::vector<int64_t> row_numel;
    std::vector<at::Tensor> local;
    for (size_t i : indices) {
      const StateTensor& t = shared[i];
      const bool whole = t.global_shape.empty() || t.replicated;
      const int64_t rows = t.local.dim() == 0 ? 1 : t.local.size(0);
      const RowSpan mine{whole ? 0 : t.row_start, rows};
      held.push_back(taking || (whole && group->rank() != 0) ? RowSpan{} : mine);
      wanted.push_back(taking ? mine : RowSpan{});
      int64_t per_row = 1;  // from the shape: a rank may hold no rows
      for (int64_t d = 1; d < t.local.dim(); ++d) per_row *= t.local.size(d);
      row_numel.push_back(per_row);
      local.push_back(t.local);
    }
    const RowMoves moves = RowMoves::plan(*group, held, wanted, row_numel);
    const at::Tensor got = moves.exchange(*group, local, local.front().options());
    bytes += got.numel() * static_cast<int64_t>(got.element_size());
    moves.take(got, local);
  }
  group->settle();
  if (taking) diloco_.take_outer();
  world_.set_phase(strf("step %ld", counters.step));
  return bytes;
}

}  // namespace zb
