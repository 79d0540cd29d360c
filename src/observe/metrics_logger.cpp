#include "observe/metrics_logger.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <stdexcept>

#include "util/device.h"
#include "util/fs.h"
#include "util/log.h"

namespace zb {

namespace {
std::string default_metrics_path(const Config& c) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return "outputs/" + c.name_model + "-" + stamp + "/metrics.jsonl";
}
}  // namespace

MetricsLogger::MetricsLogger(const Config& c, const ModelArgs& args, const Communicator& world,
                             std::vector<std::pair<std::string, Communicator*>> groups, c10::Device device,
                             bool resumed)
    : config_(c), world_(world), groups_(std::move(groups)), world_before_(world.stats()),
      rank_(world.rank()), world_size_(world.size()), device_(device),
      tokens_per_step_(c.optim.batch_size * c.data.seq_length),
      flops_per_token_(flops_per_token(args, c.data.seq_length)),
      start_(std::chrono::steady_clock::now()) {
  if (c.runtime.peak_flops > 0) peak_flops_ = c.runtime.peak_flops;
  else if (device.is_cuda()) peak_flops_ = peak_flops_for_device(device_name(device));
  for (const auto& [name, group] : groups_) groups_before_.push_back(group->stats());
  meter_.record(0, 0.0);
  reset_peak_memory(device);  // the steps' peak, not set-up's
  if (rank_ != 0) return;
  path_ = c.logging.metrics_file.empty() ? default_metrics_path(c) : c.logging.metrics_file;
  make_directories(parent_directory(path_));
  file_.open(path_, resumed ? std::ios::app : std::ios::trunc);
  if (!file_) throw std::runtime_error("cannot write metrics file " + path_);
  log::info("metrics: " + path_);
}

double MetricsLogger::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void MetricsLogger::log_step(const StepStats& s, std::optional<double> val_loss) {
  // What the collectives did since the last record: the difference of two snapshots.
  auto since = [](const CommStats& now, CommStats& before) {
    CommStats d;
    for (size_t k = 0; k < d.bytes.size(); ++k) d.bytes[k] = now.bytes[k] - before.bytes[k];
    d.wait_seconds = now.wait_seconds - before.wait_seconds;
    before = now;
    return d;
  };
  const CommStats comm = since(world_.stats(), world_before_);
  std::vector<std::pair<std::string, CommStats>> by_group;
  for (size_t g = 0; g < groups_.size(); ++g)
    by_group.emplace_back(groups_[g].first, since(groups_[g].second->stats(), groups_before_[g]));
  const double now = elapsed_seconds();
  meter_.record(tokens_per_step_, now);
  if (rank_ != 0) return;
  const auto tps = meter_.tokens_per_second();
  const auto sps = meter_.seconds_per_step();
  std::optional<double> mfu;
  if (tps && peak_flops_) mfu = mfu_percent(flops_per_token_, *tps, *peak_flops_, world_size_);
  const int64_t peak_mem = peak_memory_bytes(device_);
  using json = nlohmann::json;
  json record = {
      {"step", s.step},
      {"loss", s.loss},
      {"perplexity", std::exp(s.loss)},
      {"grad_norm", s.grad_norm},  // NaN and infinities are written as null
      {"skipped_steps", s.skipped_total},  // steps not applied because they were not finite
      {"total_tokens", s.step * tokens_per_step_},
      {"time", now},
      {"tokens_per_second", tps ? json(*tps) : json(nullptr)},
      {"mfu", mfu ? json(*mfu) : json(nullptr)},
      {"peak_memory_bytes", peak_mem},
      {"comm_wait_seconds", comm.wait_seconds},
      {"forward_seconds", s.forward_seconds},
      {"backward_seconds", s.backward_seconds},
      {"optimizer_seconds", s.optimizer_seconds},
  };
  if (val_loss) record["val_loss"] = *val_loss;
  if (!s.replica_losses.empty()) record["replica_losses"] = s.replica_losses;  // DiLoCo
  if (s.outer)
    record["outer_step"] = {{"outer_steps", s.outer->outer_steps},
                            {"fragments", s.outer->fragments},
                            {"pseudo_gradient_norm", s.outer->pseudo_gradient_norm},
                            {"bytes_across_replicas", s.outer->bytes_across_replicas},
                            {"seconds_waited", s.outer->seconds_waited},
                            {"seconds", s.outer->seconds}};
  if (s.outer && s.outer->round)  // elastic replicas: whose pseudo-gradients the average took
    record["outer_step"].update({{"generation", s.outer->round->quorum.generation},
                                 {"members", s.outer->round->quorum.members},
                                 {"attempts", s.outer->round->attempts}});
  if (s.membership) {
    const Quorum& m = s.membership->membership();
    record["membership"] = {{"generation", m.generation},           {"members", m.members},
                            {"change", m.change},                   {"member_index", s.membership->member_index},
                            {"stream_rows", m.stream_rows},         {"joined", s.membership->joined},
                            {"seconds_lost", s.membership->seconds_lost}};
  }
  // A mixture of experts, by block: its busiest and idlest expert's tokens over the mean, its
  // auxiliary loss and its bias's spread.
  for (const ExpertBalanceStats& e : s.experts)
    record["experts"]["layers." + std::to_string(e.layer)] = {{"max_load", e.max_load},
                                                              {"min_load", e.min_load},
                                                              {"aux_loss", e.aux_loss},
                                                              {"bias_spread", e.bias_spread}};
  // The attention logits' watch: each block's largest logit, and the heads QK-clip scaled.
  for (size_t l = 0; l < s.max_attention_logit.size(); ++l)
    record["max_attention_logit"]["layers." + std::to_string(l)] = s.max_attention_logit[l];
  if (!s.max_attention_logit.empty()) record["qk_clipped_heads"] = s.qk_clipped_heads;
  for (const auto& [key, value] : texts_) record[key] = value;
  for (const auto& [key, value] : numbers_) record[key] = value;
  if (!s.nonfinite.empty()) record["nonfinite"] = s.nonfinite;  // this step was not applied
  for (const auto& [group, lr] : s.learning_rates) record["lr"][group] = lr;
  for (size_t k = 0; k < static_cast<size_t>(CommKind::Count); ++k)
    record["comm_bytes"][comm_kind_name(static_cast<CommKind>(k))] = comm.bytes[k];
  for (const auto& [group, stats] : by_group)
    for (size_t k = 0; k < static_cast<size_t>(CommKind::Count); ++k)
      record["comm_bytes_" + group][comm_kind_name(static_cast<CommKind>(k))] = stats.bytes[k];
  file_ << record.dump() << "\n" << std::flush;

  const int64_t total = config_.optim.total_steps;
  if (s.step % config_.logging.interval == 0 || s.step == total) {
    const double eta = sps ? *sps * static_cast<double>(total - s.step) : 0.0;
    std::string lr_text;
    for (const auto& [group, lr] : s.learning_rates)
      lr_text += (lr_text.empty() ? "" : " ") + group + ":" + strf("%.3g", lr);
    log::info(strf("step %ld/%ld | loss %.4f | lr %s | grad_norm %.3f | tok/s %s | mfu %s | mem %.2f GiB | eta %s",
                   s.step, total, s.loss, lr_text.c_str(), s.grad_norm,
                   tps ? with_commas(static_cast<int64_t>(*tps)).c_str() : "-",
                   mfu ? strf("%.1f%%", *mfu).c_str() : "n/a",
                   static_cast<double>(peak_mem) / (1 << 30), format_duration(eta).c_str()));
  }
  if (!s.experts.empty() && (s.step % config_.logging.interval == 0 || s.step == total)) {
    double busiest = 0, idlest = 1e300;  // over the blocks
    for (const ExpertBalanceStats& e : s.experts) busiest = std::max(busiest, e.max_load), idlest = std::min(idlest, e.min_load);
    log::info(strf("step %ld/%ld | experts: busiest %.2fx the mean tokens, idlest %.2fx (over %zu blocks)", s.step, total,
                   busiest, idlest, s.experts.size()));
  }
  if (!s.max_attention_logit.empty() && (s.step % config_.logging.interval == 0 || s.step == total)) {
    const auto top = std::max_element(s.max_attention_logit.begin(), s.max_attention_logit.end());
    log::info(strf("step %ld/%ld | attention: largest logit %.2f (block %ld), %ld head(s) clipped", s.step, total, *top,
                   static_cast<long>(top - s.max_attention_logit.begin()), static_cast<long>(s.qk_clipped_heads)));
  }
  if (val_loss) log::info(strf("step %ld/%ld | val_loss %.4f", s.step, total, *val_loss));
  if (s.outer && !s.outer->fragments.empty()) {
    std::string which;
    for (int64_t f : s.outer->fragments) which += (which.empty() ? "" : ",") + std::to_string(f);
    log::info(strf("step %ld/%ld | outer step (fragment %s; %ld so far) | pseudo-gradient norm %.4f | %s bytes across "
                   "replicas | waited %.3f s",
                   s.step, total, which.c_str(), s.outer->outer_steps, s.outer->pseudo_gradient_norm,
                   with_commas(s.outer->bytes_across_replicas).c_str(), s.outer->seconds_waited));
  }
  if (s.membership) {
    const Quorum& m = s.membership->membership();
    log::info(strf("step %ld/%ld | DiLoCo membership: generation %ld, replicas %s%s; this one reads slice %ld of %zu "
                   "of each step from stream row %ld; %.2f s lost",
                   s.step, total, m.generation, id_list(m.members).c_str(), m.change.empty() ? "" : (" (" + m.change + ")").c_str(),
                   s.membership->member_index, m.members.size(), m.stream_rows, s.membership->seconds_lost));
  }
}

}  // namespace zb
