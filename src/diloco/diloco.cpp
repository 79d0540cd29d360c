#include "diloco/diloco.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "dist/row_moves.h"
#include "parallel/row_shard.h"
#include "util/fault_points.h"
#include "util/log.h"
#include "util/phase.h"

namespace zb {

int64_t fragment_of(const std::string& name, int64_t n_layers, int64_t fragments) {
  if (name.rfind("layers.", 0) == 0) {
    const int64_t layer = std::stoll(name.substr(7));
    // Runs of n_layers / F blocks; the first n_layers % F runs one longer.
    const int64_t base = n_layers / fragments, longer = n_layers % fragments;
    const int64_t in_longer = longer * (base + 1);
    return layer < in_longer ? layer / (base + 1) : longer + (layer - in_longer) / base;
  }
  return name.rfind("tok_embeddings.", 0) == 0 ? 0 : fragments - 1;
}

// One fragment: its parameters, their outer copies, and the exchange it has in flight, if any.
struct DiLoCo::Fragment {
  int64_t index;
  std::vector<ShardedParameter> params;
  OuterNesterov outer;
  int64_t numel = 0;  // this rank's values of the fragment
  // In flight: started after some step, applied after step apply_at.
  bool in_flight = false;
  int64_t apply_at = 0;
  at::Tensor start;                  // the inner values it started from (with a delay only)
  PendingCollective first, second;   // the exchange
  at::Tensor sent, sent_tables;      // its inputs, alive until it completes
  at::Tensor received, received_tables;
  at::Tensor mean;                   // Δ̄, once the exchange is finished

  Fragment(int64_t i, double lr, double momentum) : index(i), outer(lr, momentum) {}
  std::vector<at::Tensor> inner() const {
    std::vector<at::Tensor> out;
    for (const ShardedParameter& p : params) out.push_back(*p.tensor);
    return out;
  }
  at::Tensor flat_inner() const {
    std::vector<at::Tensor> flat;
    for (const ShardedParameter& p : params) flat.push_back(p.tensor->detach().reshape({-1}).to(at::kFloat));
    return at::cat(flat);
  }
  // A flat fragment vector as one view per parameter, in the parameters' shapes.
  std::vector<at::Tensor> split(const at::Tensor& flat) const {
    std::vector<at::Tensor> out;
    int64_t offset = 0;
    for (const ShardedParameter& p : params) {
      out.push_back(flat.narrow(0, offset, p.tensor->numel()).view(p.tensor->sizes()));
      offset += p.tensor->numel();
    }
    return out;
  }
  void clear_exchange() {
    in_flight = false;
    first = PendingCollective();
    second = PendingCollective();
    start = sent = sent_tables = received = received_tables = mean = at::Tensor();
  }
};

DiLoCo::DiLoCo(const DilocoConfig& config, std::vector<ShardedParameter> params, int64_t n_layers,
               const ParallelMesh& mesh)
    : config_(config), compression_(parse_compression(config.compression)), shard_(mesh.shard_group()),
      replicas_(mesh.replicate_group()), tp_(mesh.tp_group()), mesh_replicas_(mesh.shape().replicate) {
  for (int64_t f = 0; f < config.fragments; ++f)
    fragments_.push_back(std::make_unique<Fragment>(f, config.outer_lr, config.outer_momentum));
  for (ShardedParameter& p : params) {
    Fragment& f = *fragments_[static_cast<size_t>(fragment_of(p.name, n_layers, config.fragments))];
    f.numel += p.tensor->numel();
    f.params.push_back(std::move(p));
  }
  start();
}

DiLoCo::~DiLoCo() = default;

void DiLoCo::start() {
  for (auto& f : fragments_) f->outer.start_from(f->inner());
}

void DiLoCo::set_membership(std::unique_ptr<ReplicaMembership> membership) {
  membership_ = std::move(membership);
  replicas_ = nullptr;  // each round's group instead
}

RoundReport DiLoCo::join(int64_t stream_rows, int64_t step) {
  return membership_->start(stream_rows, step, outer_steps_);
}

RoundReport DiLoCo::await_admission(int64_t total_steps) {
  RoundReport report = membership_->await_admission();
  restore(report.step, total_steps);
  return report;
}

void DiLoCo::exchange_in_round(Fragment& f, int64_t step, int64_t total_steps, int64_t stream_rows,
                               OuterSyncStats& stats) {
  // Outer steps are whole (validate: one fragment, no delay), so the round number is the count.
  const bool last = step == total_steps;
  stats.round = membership_->outer_round(outer_steps_ + 1, step, stream_rows, last, [&](Communicator* group) {
    f.clear_exchange();  // a retry starts again from this replica's Δ
    replicas_ = group;
    begin(f, step, total_steps, stats);
    finish(f, &stats);
  });
  replicas_ = nullptr;
}

void DiLoCo::take_outer() {
  at::NoGradGuard no_grad;
  for (auto& f : fragments_) {
    const std::vector<at::Tensor> inner = f->inner();
    for (size_t i = 0; i < inner.size(); ++i) inner[i].copy_(f->outer.outer()[i]);
  }
}

bool DiLoCo::starts_at(int64_t f, int64_t step, int64_t total_steps) const {
  const int64_t H = config_.inner_steps;
  return step == total_steps || (step + f * (H / fragments())) % H == 0;
}

int64_t DiLoCo::applies_at(int64_t start, int64_t total_steps) const {
  return std::min(start + config_.fragment_delay, total_steps);
}

void DiLoCo::begin(Fragment& f, int64_t step, int64_t total_steps, OuterSyncStats& stats) {
  // Tests: the last replica's first rank frozen here (its checkpoint writer goes on), for the test
  // to kill it, as a machine lost mid-exchange would leave the others.
  fault_point({FaultPoint::OuterStep, outer_steps_ + 1,
               replicas_ && replicas_->rank() == replicas_->size() - 1 && shard_.rank() == 0, {}});
  f.in_flight = true;
  f.apply_at = applies_at(step, total_steps);
  if (f.apply_at > step) f.start = f.flat_inner();  // the inner steps until then are kept
  // One flat vector of this rank's Δ: one exchange, and uint8's chunks span tensor boundaries.
  std::vector<at::Tensor> flat;
  for (const at::Tensor& d : f.outer.pseudo_gradients(f.inner())) flat.push_back(d.reshape({-1}));
  const at::Tensor delta = at::cat(flat);
  // A mixed generation's ranks hold different rows: one without any still owns some.
  const bool mixed = replicas_ && membership_ && !membership_->mixed_shards().empty();
  if (!replicas_ || (f.numel == 0 && !mixed)) {
    f.mean = delta;
    return;
  }
  const int64_t R = replicas_->size(), n = f.numel;
  const CommStats before = replicas_->stats();
  if (mixed) {
    f.mean = mixed_mean(f, delta);  // at once: finish() has nothing left to wait for
  } else switch (compression_) {
    case Compression::None:
      f.received = delta;
      f.first = replicas_->all_reduce_sum(f.received);
      break;
    case Compression::BF16:
      // Every replica's bf16 values, summed on arrival in fp32 (an all-reduce would add in bf16).
      f.sent = delta.to(at::kBFloat16);
      f.received = at::empty({R * n}, f.sent.options());
      f.first = replicas_->all_gather(f.received, f.sent);
      break;
    case Compression::UInt8: {
      const Uint8Code code = quantize_uint8(delta, kUint8Chunk);
      f.sent = code.codes;
      f.sent_tables = code.tables.reshape({-1});
      f.received = at::empty({R * n}, f.sent.options());
      f.received_tables = at::empty({R * f.sent_tables.numel()}, f.sent_tables.options());
      f.first = replicas_->all_gather(f.received, f.sent);
      f.second = replicas_->all_gather(f.received_tables, f.sent_tables);
      break;
    }
  }
  const CommStats after = replicas_->stats();
  for (size_t k = 0; k < after.bytes.size(); ++k) stats.bytes_across_replicas += after.bytes[k] - before.bytes[k];
}

at::Tensor DiLoCo::mixed_mean(Fragment& f, const at::Tensor& delta) {
  // A mixed generation (diloco/membership.h): the members' rows of a parameter do not line up rank
  // for rank. Each of the group's S ranks owns 1/S of every parameter's rows (RowShard over S);
  // every rank sends each owner its Δ's rows there, compressed as configured, and the owner sums
  // the members' values (in member order, in fp32) and divides. The mean goes back in fp32 to the
  // ranks holding those rows, so that every member takes the same bits.
  Communicator& group = *replicas_;
  const int64_t S = group.size(), members = static_cast<int64_t>(membership_->mixed_shards().size());
  std::vector<RowSpan> held, owned;
  std::vector<int64_t> row_numel;
  for (const ShardedParameter& p : f.params) {
    // Rows of the tensor the shards divide (under TP a slice, the same on every rank of the group:
    // one TP position), counted from the whole's first row as row_start is.
    const std::vector<int64_t>& sliced = p.slice_shape.empty() ? p.global_shape : p.slice_shape;
    const RowShard mine = RowShard::of(sliced, shard_.size()), owners = RowShard::of(sliced, S);
    const int64_t rows = p.tensor->dim() == 0 ? 1 : p.tensor->size(0);
    TORCH_CHECK(rows == mine.rows_of(shard_.rank()), p.name, ": rows not as the shard layout says");
    const int64_t origin = p.row_start - mine.first_row(shard_.rank());
    held.push_back({p.row_start, rows});
    owned.push_back({origin + owners.first_row(group.rank()), owners.rows_of(group.rank())});
    row_numel.push_back(mine.row_numel);
  }
  const at::TensorOptions fp32 = delta.options().dtype(at::kFloat);
  const RowMoves there = RowMoves::plan(group, held, owned, row_numel);
  std::vector<at::Tensor> from(static_cast<size_t>(S));  // each peer's rows for this owner, fp32
  if (compression_ == Compression::UInt8) {
    // Each peer's pack quantized by itself: one all-to-all of codes, one of their tables.
    const auto tables_of = [](int64_t n) { return (n + kUint8Chunk - 1) / kUint8Chunk * kUint8Buckets; };
    std::vector<at::Tensor> codes, tables;
    std::vector<int64_t> code_out, code_in, table_out, table_in;
    const std::vector<at::Tensor> parts = f.split(delta);
    for (int64_t q = 0; q < S; ++q) {
      if (const at::Tensor pack = there.pack(q, parts); pack.defined()) {
        const Uint8Code code = quantize_uint8(pack, kUint8Chunk);
        codes.push_back(code.codes);
        tables.push_back(code.tables.reshape({-1}));
      }
      code_out.push_back(there.send_numel(q));
      table_out.push_back(tables_of(code_out.back()));
      code_in.push_back(there.receive_numel(q));
      table_in.push_back(tables_of(code_in.back()));
    }
    const auto sum = [](const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); };
    const at::Tensor sent_codes = codes.empty() ? at::empty({0}, fp32.dtype(at::kByte)) : at::cat(codes);
    const at::Tensor sent_tables = tables.empty() ? at::empty({0}, fp32) : at::cat(tables);
    at::Tensor got_codes = at::empty({sum(code_in)}, sent_codes.options());
    at::Tensor got_tables = at::empty({sum(table_in)}, fp32);
    PendingCollective a = group.all_to_all(got_codes, sent_codes, code_in, code_out);
    PendingCollective b = group.all_to_all(got_tables, sent_tables, table_in, table_out);
    a.wait();
    b.wait();
    for (int64_t k = 0, c = 0, t = 0; k < S; c += code_in[k], t += table_in[k], ++k)
      from[k] = code_in[k] == 0 ? at::empty({0}, fp32)
                                : dequantize_uint8({got_codes.narrow(0, c, code_in[k]),
                                                    got_tables.narrow(0, t, table_in[k]).view({-1, kUint8Buckets}),
                                                    kUint8Chunk});
  } else {
    const bool bf16 = compression_ == Compression::BF16;
    const at::Tensor sent = bf16 ? delta.to(at::kBFloat16) : delta;
    const at::Tensor got = there.exchange(group, f.split(sent), sent.options());
    for (int64_t k = 0; k < S; ++k) from[k] = there.part(k, got).to(at::kFloat);
  }
  // The owner's sums: one value from each member for each of its rows.
  std::vector<at::Tensor> sums;
  for (size_t t = 0; t < owned.size(); ++t) sums.push_back(at::zeros({owned[t].rows, row_numel[t]}, fp32));
  for (int64_t k = 0; k < S; ++k) {
    const std::vector<at::Tensor> pieces = there.unpack(k, from[k]);
    for (size_t i = 0; i < pieces.size(); ++i) {
      const RowMoves::Run& run = there.receives(k)[i];
      sums[run.tensor].narrow(0, run.rows.first - owned[run.tensor].first, run.rows.rows) += pieces[i];
    }
  }
  for (at::Tensor& s : sums) s.div_(static_cast<double>(members));
  // And back: each held row from its one owner.
  const RowMoves back = RowMoves::plan(group, owned, held, row_numel);
  at::Tensor mean = at::empty({f.numel}, fp32);
  back.take(back.exchange(group, sums, fp32), f.split(mean));
  return mean;
}

void DiLoCo::finish(Fragment& f, OuterSyncStats* stats) {
  if (f.mean.defined()) return;
  const auto start = std::chrono::steady_clock::now();
  f.first.wait();
  f.second.wait();
  if (stats) stats->seconds_waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The sum over the replicas, in replica order in fp32, so that every replica gets the same bits.
  const int64_t R = replicas_->size(), n = f.numel;
  at::Tensor sum;
  switch (compression_) {
    case Compression::None:
      sum = f.received;
      break;
    case Compression::BF16:
      sum = f.received.narrow(0, 0, n).to(at::kFloat);  // one replica's values widened at a time
      for (int64_t r = 1; r < R; ++r) sum += f.received.narrow(0, r * n, n).to(at::kFloat);
      break;
    case Compression::UInt8: {
      const at::Tensor tables = f.received_tables.view({R, -1, kUint8Buckets});
      sum = at::zeros({n}, tables.options());
      for (int64_t r = 0; r < R; ++r) sum += dequantize_uint8({f.received.narrow(0, r * n, n), tables[r], kUint8Chunk});
      break;
    }
  }
  f.mean = sum / static_cast<double>(R);
  f.sent = f.sent_tables = f.received = f.received_tables = at::Tensor();
}

void DiLoCo::apply(Fragment& f, OuterSyncStats& stats) {
  finish(f, &stats);
  const std::vector<at::Tensor> inner = f.inner();
  at::Tensor drift;  // the inner steps taken since the exchange started
  if (f.start.defined()) drift = f.flat_inner() - f.start;
  f.outer.step(f.split(f.mean), inner);
  if (drift.defined()) {
    const std::vector<at::Tensor> parts = f.split(drift);
    for (size_t i = 0; i < inner.size(); ++i) inner[i].add_(parts[i]);
  }
  ++outer_steps_;
  stats.fragments.push_back(f.index);
}

std::optional<OuterSyncStats> DiLoCo::after_step(int64_t step, int64_t total_steps, int64_t stream_rows) {
  at::NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();
  OuterSyncStats stats;
  bool any = false;
  at::Tensor squares;  // Σ Δ̄² over this rank's rows of the fragments applied
  auto apply_and_count = [&](Fragment& f) {
    Phase phase("zb.outer_step", f.index);
    apply(f, stats);
    // A tensor every rank of the TP group holds alike (norm weights, shared key/value heads)
    // counts on its rank 0 only.
    at::Tensor s;
    const std::vector<at::Tensor> parts = f.split(f.mean);
    for (size_t i = 0; i < parts.size(); ++i) {
      if (tp_ && f.params[i].tp_shared && tp_->rank() != 0) continue;
      const at::Tensor part = parts[i].square().sum().reshape({1});
      s = s.defined() ? s + part : part;
    }
    if (!s.defined()) s = at::zeros({1}, f.mean.options());
    squares = squares.defined() ? squares + s : s;
    f.clear_exchange();
  };
  // Exchanges in flight that are due (all of them after the last step), then those starting now.
  for (auto& f : fragments_)
    if (f->in_flight && (f->apply_at == step || step == total_steps)) {
      any = true;
      apply_and_count(*f);
    }
  for (auto& f : fragments_)
    if (starts_at(f->index, step, total_steps)) {
      any = true;
      Phase phase("zb.outer_exchange", f->index);
      if (membership_)
        exchange_in_round(*f, step, total_steps, stream_rows, stats);
      else
        begin(*f, step, total_steps, stats);
      if (f->apply_at == step) apply_and_count(*f);
    }
  if (membership_ && step == total_steps) membership_->finish();
  if (!any) return std::nullopt;
  if (squares.defined()) {
    // ‖Δ̄‖ over the model: the replicas hold the same Δ̄, the shard group the model's rows, the
    // TP group their slices.
    shard_.all_reduce_sum(squares).wait();
    if (tp_) tp_->all_reduce_sum(squares).wait();
    stats.pseudo_gradient_norm = std::sqrt(squares.item<double>());
  }
  stats.outer_steps = outer_steps_;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

std::vector<StateTensor> DiLoCo::state() {
  std::vector<StateTensor> out;
  for (auto& f : fragments_) {
    const auto& outer = f->outer.outer();
    const auto& momentum = f->outer.momentum_buffers();
    for (size_t i = 0; i < f->params.size(); ++i) {
      const ShardedParameter& p = f->params[i];
      out.push_back(state_tensor("diloco/outer/" + p.name, outer[i], p));
      out.push_back(state_tensor("diloco/momentum/" + p.name, momentum[i], p));
    }
    if (!f->in_flight) continue;
    finish(*f, nullptr);  // its Δ̄ is what a resume needs; it is applied when due all the same
    const std::vector<at::Tensor> mean = f->split(f->mean);
    const std::vector<at::Tensor> start = f->start.defined() ? f->split(f->start) : std::vector<at::Tensor>{};
    for (size_t i = 0; i < f->params.size(); ++i) {
      const ShardedParameter& p = f->params[i];
      out.push_back(state_tensor("diloco/in_flight/mean/" + p.name, mean[i], p));
      if (!start.empty())  // each replica's own
        out.push_back(state_tensor("diloco/in_flight/start/" + p.name, start[i], p, /*per_replica=*/true));
    }
  }
  return out;
}

void DiLoCo::prepare_restore(int64_t step, int64_t total_steps) {
  const int64_t H = config_.inner_steps;
  for (auto& f : fragments_) {
    f->clear_exchange();
    // Its latest start at or before `step` (starts are H apart and a delay is shorter than H).
    for (int64_t t = step; t > std::max<int64_t>(0, step - H); --t)
      if (starts_at(f->index, t, total_steps)) {
        if (applies_at(t, total_steps) > step) {
          f->in_flight = true;
          f->apply_at = applies_at(t, total_steps);
          f->mean = at::zeros({f->numel}, f->outer.outer().front().options());
          f->start = at::zeros({f->numel}, f->mean.options());
        }
        break;
      }
  }
}

void DiLoCo::restore(int64_t step, int64_t total_steps) {
  outer_steps_ = 0;  // the fragment outer steps applied by `step`
  for (int64_t t = 1; t <= step; ++t)
    for (auto& f : fragments_)
      if (starts_at(f->index, t, total_steps) && applies_at(t, total_steps) <= step) ++outer_steps_;
}

}  // namespace zb
