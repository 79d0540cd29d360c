// train_fsdp: pretrain a Llama-style model from a TOML config.
//
//   train_fsdp --config configs/debug/normal.toml [--dry-run] [--key value ...]
//
// One short loop wires the components together: config -> model -> optimizer groups -> data ->
// steps of (micro-batches: forward, loss, backward) + clip + optimizer + metrics.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <optional>

#include "config/cli.h"
#include "config/config.h"
#include "data/fake_data.h"
#include "model/llama.h"
#include "optim/clip.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"
#include "train/metrics.h"
#include "util/device.h"
#include "util/fs.h"
#include "util/log.h"

namespace {

using zb::strf;

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > (n < 0 ? 1 : 0); i -= 3) s.insert(i, ",");
  return s;
}

std::string default_metrics_path(const zb::Config& c) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", std::localtime(&now));
  return "outputs/" + c.name_model + "-" + stamp + "/metrics.jsonl";
}

void describe_model(const zb::Config& c, const zb::ModelArgs& a, int64_t world_size) {
  zb::log::info(strf("model: %s %s: dim %ld, %ld layers, %ld heads (%ld kv), head_dim %ld, ffn %ld, vocab %ld",
                     c.type_model.c_str(), c.name_model.c_str(), a.dim, a.n_layers, a.n_heads,
                     a.n_kv_heads, a.head_dim(), a.ffn_hidden(), a.vocab_size));
  zb::log::info(strf("parameters: %s total, %s without the token embedding",
                     with_commas(zb::count_params(a)).c_str(),
                     with_commas(zb::count_params_without_embedding(a)).c_str()));
  zb::log::info(strf("FLOPs/token: %.4g (6N + 12*L*H*Dh*T at seq_length %ld)",
                     zb::flops_per_token(a, c.data.seq_length), c.data.seq_length));
  zb::log::info(strf("batch: %ld sequences x %ld tokens = %s tokens/step; micro_bs %ld, %ld accumulation steps on %ld rank(s)",
                     c.optim.batch_size, c.data.seq_length,
                     with_commas(c.optim.batch_size * c.data.seq_length).c_str(), c.train.micro_bs,
                     zb::grad_accum_steps(c, world_size), world_size));
}

int run(const zb::CommandLine& cl) {
  const zb::Config& cfg = cl.config;
  // Multi-process runs arrive with the sharding engine; refuse them clearly until then.
  const char* ws_env = std::getenv("WORLD_SIZE");
  const int64_t world_size = ws_env ? std::atoll(ws_env) : 1;
  if (world_size != 1)
    throw zb::ConfigError(strf("WORLD_SIZE=%ld: this build trains on a single process only", world_size));
  zb::validate(cfg, world_size);
  zb::log::init(0, cfg.logging.level);
  const zb::ModelArgs args = zb::resolve_model_args(cfg);
  zb::log::info("config: " + cfg.source);
  describe_model(cfg, args, world_size);

  if (cl.dry_run) {
    // Build the model on the meta device: every shape, no memory.
    zb::Llama model(args, at::TensorOptions().device(c10::kMeta));
    zb::log::info(strf("dry run: built %s parameters on the meta device",
                       with_commas(model.num_params()).c_str()));
    return 0;
  }
  if (!cfg.data.fake)
    throw zb::ConfigError(cfg.origin("data.fake") +
                          ": data.fake = false, but reading token datasets is not implemented "
                          "yet; set data.fake = true");

  // --- device, precision, threads, seed -------------------------------------------------------
  const c10::Device device = zb::select_device(cfg.runtime.device, 0);
  at::ScalarType dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (cfg.runtime.compute_dtype == "float32") dtype = at::kFloat;
  if (cfg.runtime.compute_dtype == "bfloat16") dtype = at::kBFloat16;
  if (cfg.runtime.num_threads > 0) at::set_num_threads(static_cast<int>(cfg.runtime.num_threads));
  at::manual_seed(static_cast<uint64_t>(cfg.runtime.seed));
  zb::log::info(strf("device: %s (%s), compute dtype %s, %d CPU threads",
                     device.str().c_str(), zb::device_name(device).c_str(),
                     c10::toString(dtype), at::get_num_threads()));

  // --- model ----------------------------------------------------------------------------------
  zb::Llama model(args, at::TensorOptions().device(device));
  model.init_weights();
  model.set_compute_dtype(dtype);

  // --- optimizer: Muon for the hidden matrices, AdamW for embedding, head, norms -------------
  zb::Optimizer optimizer(cfg, model.parameters());
  for (const auto& line : optimizer.describe()) zb::log::info("optimizer " + line);
  zb::LrSchedule schedule{cfg.optim.sched_type, cfg.optim.warmup_steps, cfg.optim.stable_steps,
                          cfg.optim.total_steps};

  // --- data -----------------------------------------------------------------------------------
  zb::FakeDataset data(static_cast<uint64_t>(cfg.runtime.seed), cfg.data.seq_length, args.vocab_size,
                       cfg.optim.batch_size, cfg.train.micro_bs, /*rank=*/0, world_size);
  const int64_t accum = zb::grad_accum_steps(cfg, world_size);
  const int64_t tokens_per_step = cfg.optim.batch_size * cfg.data.seq_length;

  // --- metrics --------------------------------------------------------------------------------
  const double flops_per_token = zb::flops_per_token(args, cfg.data.seq_length);
  std::optional<double> peak_flops;
  if (cfg.runtime.peak_flops > 0) peak_flops = cfg.runtime.peak_flops;
  else if (device.is_cuda()) peak_flops = zb::peak_flops_for_device(zb::device_name(device));
  const std::string metrics_path =
      cfg.logging.metrics_file.empty() ? default_metrics_path(cfg) : cfg.logging.metrics_file;
  zb::make_directories(zb::parent_directory(metrics_path));
  std::ofstream metrics(metrics_path);
  if (!metrics) throw std::runtime_error("cannot write metrics file " + metrics_path);
  zb::log::info("metrics: " + metrics_path);

  // --- the loop -------------------------------------------------------------------------------
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(clock::now() - start).count(); };
  zb::ThroughputMeter meter(10);
  meter.record(0, seconds());
  const std::vector<at::Tensor> params = model.parameter_tensors();
  for (int64_t step = 1; step <= cfg.optim.total_steps; ++step) {
    // Forward/backward over the micro-batches; each loss is divided by the number of
    // micro-batches so the accumulated gradient is that of the mean over the whole batch.
    at::Tensor loss_sum = at::zeros({}, at::TensorOptions().device(device));
    for (int64_t micro = 0; micro < accum; ++micro) {
      zb::Batch batch = data.next();
      at::Tensor inputs = batch.inputs.to(device, /*non_blocking=*/true);
      at::Tensor targets = batch.targets.to(device, /*non_blocking=*/true);
      at::Tensor loss = zb::cross_entropy(model.forward(inputs), targets) / static_cast<double>(accum);
      loss.backward();
      loss_sum += loss.detach();
    }
    const at::Tensor grad_norm = zb::clip_grad_norm_(params, cfg.optim.max_norm);
    const double lr_mult = schedule.multiplier(step);
    optimizer.step(lr_mult);
    for (at::Tensor p : params) p.mutable_grad().reset();

    // Reading the loss synchronises with the device once per step.
    const double loss = loss_sum.item<double>();
    const double norm = grad_norm.item<double>();
    meter.record(tokens_per_step, seconds());
    const auto tps = meter.tokens_per_second();
    const auto sps = meter.seconds_per_step();
    std::optional<double> mfu;
    if (tps && peak_flops) mfu = zb::mfu_percent(flops_per_token, *tps, *peak_flops, world_size);
    const int64_t peak_mem = zb::peak_memory_bytes(device);

    nlohmann::json record = {
        {"step", step},
        {"loss", loss},
        {"perplexity", std::exp(loss)},
        {"grad_norm", norm},
        {"total_tokens", step * tokens_per_step},
        {"time", seconds()},
        {"tokens_per_second", tps ? nlohmann::json(*tps) : nlohmann::json(nullptr)},
        {"mfu", mfu ? nlohmann::json(*mfu) : nlohmann::json(nullptr)},
        {"peak_memory_bytes", peak_mem},
    };
    const auto lrs = optimizer.learning_rates(lr_mult);
    for (const auto& [group, lr] : lrs) record["lr"][group] = lr;
    metrics << record.dump() << "\n" << std::flush;

    if (step % cfg.logging.interval == 0 || step == cfg.optim.total_steps) {
      const double eta = sps ? *sps * static_cast<double>(cfg.optim.total_steps - step) : 0.0;
      std::string lr_text;
      for (const auto& [group, lr] : lrs) lr_text += (lr_text.empty() ? "" : " ") + group + ":" + strf("%.3g", lr);
      zb::log::info(strf("step %ld/%ld | loss %.4f | lr %s | grad_norm %.3f | tok/s %s | mfu %s | mem %.2f GiB | eta %s",
                         step, cfg.optim.total_steps, loss, lr_text.c_str(),
                         norm, tps ? with_commas(static_cast<int64_t>(*tps)).c_str() : "-",
                         mfu ? strf("%.1f%%", *mfu).c_str() : "n/a",
                         static_cast<double>(peak_mem) / (1 << 30), zb::format_duration(eta).c_str()));
    }
  }
  zb::log::info(strf("done: %ld steps, %s tokens in %s", cfg.optim.total_steps,
                     with_commas(cfg.optim.total_steps * tokens_per_step).c_str(),
                     zb::format_duration(seconds()).c_str()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  zb::log::init(0, "info");
  try {
    const zb::CommandLine cl = zb::parse_command_line(argc, argv);
    if (cl.help) {
      std::cout << zb::help_text("train_fsdp");
      return 0;
    }
    return run(cl);
  } catch (const zb::ConfigError& e) {
    zb::log::error(std::string("config error: ") + e.what());
    return 2;
  } catch (const std::exception& e) {
    zb::log::error(std::string("error: ") + e.what());
    return 1;
  }
}
