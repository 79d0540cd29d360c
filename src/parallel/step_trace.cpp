#include "parallel/step_trace.h"

namespace zb {

const char* step_op_name(StepEvent::Op op) {
  switch (op) {
    case StepEvent::Op::MicroBatch: return "micro_batch";
    case StepEvent::Op::Unshard: return "unshard";
    case StepEvent::Op::Forward: return "forward";
    case StepEvent::Op::Loss: return "loss";
    case StepEvent::Op::Recompute: return "recompute";
    case StepEvent::Op::Backward: return "backward";
    case StepEvent::Op::Reshard: return "reshard";
    case StepEvent::Op::Collective: return "collective";
    case StepEvent::Op::Optimizer: return "optimizer";
  }
  return "?";
}

std::string StepEvent::describe() const {
  switch (op) {
    case Op::MicroBatch: return "micro_batch " + std::to_string(micro_batch);
    case Op::Optimizer: return "optimizer";
    case Op::Loss: return "loss";
    case Op::Collective:
      return std::string(comm_kind_name(kind)) + " " + group + " ranks=" + std::to_string(ranks) +
             " payload=" + std::to_string(payload) + " counted=" + std::to_string(counted) +
             (unit >= 0 ? " unit " + std::to_string(unit) : "");
    default: return std::string(step_op_name(op)) + " unit " + std::to_string(unit);
  }
}

StepEvent StepEvent::mark(Op op, int64_t unit) {
  StepEvent e;
  e.op = op;
  e.unit = unit;
  return e;
}

StepEvent StepEvent::micro_batch_start(int64_t micro_batch) {
  StepEvent e = mark(Op::MicroBatch);
  e.micro_batch = micro_batch;
  return e;
}

StepEvent StepEvent::collective(CommKind kind, std::string group, int64_t ranks, int64_t payload, int64_t counted) {
  StepEvent e = mark(Op::Collective);
  e.kind = kind;
  e.group = std::move(group);
  e.ranks = ranks;
  e.payload = payload;
  e.counted = counted;
  return e;
}

void StepTrace::collective(CommKind kind, const std::string& group, int64_t ranks, int64_t payload,
                           int64_t counted) {
  StepEvent e = StepEvent::collective(kind, group, ranks, payload, counted);
  e.unit = unit_;
  record(std::move(e));
}

}  // namespace zb
