#include "train/diloco.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>

#include "util/log.h"
#include "util/phase.h"

namespace zb {

DiLoCo::DiLoCo(const DilocoConfig& config, std::vector<ShardedParameter> params, Communicator& shard,
               Communicator* replicas)
    : config_(config), compression_(parse_compression(config.compression)), params_(std::move(params)),
      shard_(shard), replicas_(replicas && replicas->size() > 1 ? replicas : nullptr),
      outer_(config.outer_lr, config.outer_momentum) {
  start();
}

bool DiLoCo::due(int64_t step, int64_t total_steps) const {
  return step % config_.inner_steps == 0 || step == total_steps;
}

std::vector<at::Tensor> DiLoCo::inner_tensors() const {
  std::vector<at::Tensor> out;
  for (const ShardedParameter& p : params_) out.push_back(*p.tensor);
  return out;
}

void DiLoCo::start() { outer_.start_from(inner_tensors()); }

at::Tensor DiLoCo::average_over_replicas(const at::Tensor& flat) {
  if (!replicas_) return flat;
  const int64_t R = replicas_->size(), n = flat.numel();
  at::Tensor sum;
  switch (compression_) {
    case Compression::None:
      sum = flat.clone();
      replicas_->all_reduce_sum(sum).wait();
      break;
    case Compression::BF16: {
      // Every replica's bf16 values, summed here in fp32 (an all-reduce would add in bf16).
      at::Tensor all = at::empty({R * n}, flat.options().dtype(at::kBFloat16));
      replicas_->all_gather(all, flat.to(at::kBFloat16)).wait();
      sum = all.view({R, n}).to(at::kFloat).sum(0);
      break;
    }
    case Compression::UInt8: {
      const Uint8Code mine = quantize_uint8(flat, kUint8Chunk);
      at::Tensor codes = at::empty({R * n}, mine.codes.options());
      at::Tensor tables = at::empty({R * mine.tables.numel()}, mine.tables.options());
      replicas_->all_gather(codes, mine.codes).wait();
      replicas_->all_gather(tables, mine.tables.reshape({-1})).wait();
      const at::Tensor table_rows = tables.view({R, -1, kUint8Buckets});
      sum = at::zeros({n}, flat.options());
      for (int64_t r = 0; r < R; ++r)
        sum += dequantize_uint8({codes.narrow(0, r * n, n), table_rows[r], kUint8Chunk});
      break;
    }
  }
  return sum / static_cast<double>(R);
}

OuterSyncStats DiLoCo::sync() {
  Phase phase("zb.outer_step");
  at::NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();
  const CommStats before = replicas_ ? replicas_->stats() : CommStats{};
  // For tests: the last replica's first rank dies at the start of this outer step, as a machine
  // lost mid-exchange would leave the others.
  if (const char* kill = std::getenv("ZB_TEST_KILL_IN_OUTER_STEP");
      kill && std::to_string(outer_steps_ + 1) == kill && replicas_ && replicas_->rank() == replicas_->size() - 1 &&
      shard_.rank() == 0) {
    log::warn(strf("outer step %ld: this rank kills itself (ZB_TEST_KILL_IN_OUTER_STEP)", outer_steps_ + 1));
    std::raise(SIGKILL);
  }
  const std::vector<at::Tensor> inner = inner_tensors();
  // One flat vector of this rank's Δ: one exchange, and uint8's chunks span tensor boundaries.
  std::vector<at::Tensor> flat_deltas;
  for (const at::Tensor& d : outer_.pseudo_gradients(inner)) flat_deltas.push_back(d.reshape({-1}));
  const at::Tensor mean = average_over_replicas(at::cat(flat_deltas));
  std::vector<at::Tensor> averaged;
  int64_t offset = 0;
  for (const at::Tensor& t : inner) {
    averaged.push_back(mean.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  // ‖Δ̄‖ over the model: the replicas hold the same Δ̄, the shard group the model's rows.
  at::Tensor squares = mean.square().sum().reshape({1});
  shard_.all_reduce_sum(squares).wait();
  outer_.step(averaged, inner);

  OuterSyncStats stats;
  stats.outer_step = ++outer_steps_;
  stats.pseudo_gradient_norm = std::sqrt(squares.item<double>());
  if (replicas_)
    for (size_t k = 0; k < before.bytes.size(); ++k)
      stats.bytes_across_replicas += replicas_->stats().bytes[k] - before.bytes[k];
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

std::vector<StateTensor> DiLoCo::state() const {
  std::vector<StateTensor> out;
  const auto& outer = outer_.outer();
  const auto& momentum = outer_.momentum_buffers();
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardedParameter& p = params_[i];
    out.push_back({"diloco/outer/" + p.name, outer[i], p.global_shape, p.row_start, p.replicated});
    out.push_back({"diloco/momentum/" + p.name, momentum[i], p.global_shape, p.row_start, p.replicated});
  }
  return out;
}

}  // namespace zb
