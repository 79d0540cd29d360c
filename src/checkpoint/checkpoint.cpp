#include "checkpoint/checkpoint.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/stack.h>
#include <dirent.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "checkpoint/hf_export.h"
#include "checkpoint/state.h"
#include "data/documents.h"
#include "parallel/row_shard.h"
#include "model/model_args_json.h"
#include "util/fault_points.h"
#include "util/fs.h"
#include "util/log.h"
#include "util/phase.h"

namespace zb {
namespace {

using json = nlohmann::json;

std::string step_name(int64_t step) { return strf("step_%08ld", step); }
std::string rank_name(int64_t rank, const char* ext) { return strf("rank_%05ld.%s", rank, ext); }

// What this rank writes of one state tensor: rows [row_start, row_start + rows) of the whole
// (under tensor parallelism, of a matrix split by columns: their columns [col_start, col_start +
// cols); cols -1: all), or (rows = -1) a scalar every rank holds. A replicated tensor is written
// once over the ranks: each writes the rows it would own if it were sharded.
struct Entry {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  int64_t row_start = 0, rows = -1, col_start = 0, cols = -1;
};

// A block of the whole's columns, not all of them.
bool column_block(const StateTensor& t) {
  return t.global_shape.size() == 2 && t.local.dim() == 2 && t.local.size(1) != t.global_shape[1];
}

Entry entry_to_write(const StateTensor& t, int64_t rank, int64_t world_size) {
  if (t.global_shape.empty()) return {t.name, t.local, {}, 0, -1};
  if (column_block(t)) return {t.name, t.local, t.global_shape, t.row_start, t.local.size(0), t.col_start, t.local.size(1)};
  if (!t.replicated) return {t.name, t.local, t.global_shape, t.row_start, t.local.size(0)};
  const RowShard shard = RowShard::of(t.global_shape, world_size);
  const int64_t start = shard.first_row(rank), rows = shard.rows_of(rank);
  return {t.name, t.local.narrow(0, start - t.row_start, rows), t.global_shape, start, rows};
}

// pread of exactly n bytes, or an error naming the file.
void read_exact(const std::string& path, char* out, int64_t n, int64_t offset) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  int64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, static_cast<size_t>(n - done), offset + done);
    if (got <= 0) {
      const std::string why = got < 0 ? std::strerror(errno) : "unexpected end of file";
      ::close(fd);
      throw std::runtime_error(strf("reading %ld bytes at offset %ld of %s failed: %s", n, offset + done,
                                    path.c_str(), why.c_str()));
    }
    done += got;
  }
  ::close(fd);
}

// Writes the whole file and flushes it to disk, or throws naming the file and the OS error (a
// full disk or a quota shows up as a short write, or only at fsync or close on network file
// systems).
void write_all(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path + ": " + std::strerror(errno));
  auto fail = [&](const char* what) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return std::runtime_error(strf("%s %s failed: %s", what, path.c_str(), why.c_str()));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw fail(strf("writing %zu bytes at offset %zu of", bytes.size() - done, done).c_str());
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) throw fail("fsync of");  // on disk before the checkpoint is renamed into place
  if (::close(fd) != 0) throw std::runtime_error("closing " + path + " failed: " + std::strerror(errno));
}

// The step_* checkpoints in `root`, oldest first.
std::vector<std::string> checkpoints_in(const std::string& root) {
  std::vector<std::string> steps;
  if (DIR* dir = ::opendir(root.c_str())) {
    while (dirent* e = ::readdir(dir))
      if (std::strncmp(e->d_name, "step_", 5) == 0) steps.push_back(e->d_name);
    ::closedir(dir);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Keeps the `keep` newest checkpoints up to `newest` (the one `latest` now names): only older
// ones go. Newer ones, left by an earlier run that this one resumed behind, are not this
// rotation's to delete. A victim is renamed away first, so a kill during the deletion never
// leaves a half-deleted directory that looks like a checkpoint.
void rotate(const std::string& root, const std::string& newest, int64_t keep) {
  if (keep <= 0) return;
  std::vector<std::string> older;
  for (const std::string& name : checkpoints_in(root))
    if (name < newest) older.push_back(name);
  for (size_t i = 0; i + static_cast<size_t>(keep - 1) < older.size(); ++i) {
    const std::string doomed = root + "/.deleting-" + older[i];
    if (::rename((root + "/" + older[i]).c_str(), doomed.c_str()) == 0) remove_tree(doomed);
  }
}

// Every owner's tensors, in the owners' order; a per-replica one under its replica's name.
std::vector<StateTensor> state_of(TrainingState& run) {
  std::vector<StateTensor> out;
  for (Stateful* owner : run.owners())
    for (StateTensor& t : owner->tensors()) {
      if (t.per_replica) t.name = "replica_" + std::to_string(run.replica()) + "/" + t.name;
      out.push_back(std::move(t));
    }
  return out;
}

// Rank 0, once every rank's files are complete: metadata, rename into place, latest (prune() after).
void publish(const std::string& root, int64_t step, const std::string& tmp_dir,
             const std::string& final_dir, const json& meta) {
  write_all(tmp_dir + "/meta.json", meta.dump(1));
  // The tokenizer the run's data were made with: samples and the HF export decode with it. One
  // gone since the start costs the checkpoint its tokenizer, not the run.
  if (meta.contains("tokenizer_source")) {
    std::string tokenizer;
    try {
      tokenizer = read_file(meta["tokenizer_source"].get<std::string>());
    } catch (const std::exception& e) {
      log::warn(std::string("checkpoint without its tokenizer: ") + e.what());
    }
    if (!tokenizer.empty()) write_all(tmp_dir + "/tokenizer.json", tokenizer);
  }
  // Into place: an older checkpoint of the same step moves aside first and goes only after. Each
  // directory is synced before the next move, so that after a crash (power lost included) the disk
  // holds the new checkpoint whole before `latest` names it, and `latest` before older ones go.
  sync_directory(tmp_dir);
  const std::string aside = root + "/.old-" + step_name(step);
  if (path_exists(final_dir)) {
    remove_tree(aside);
    if (::rename(final_dir.c_str(), aside.c_str()) != 0)
      throw std::runtime_error("cannot move " + final_dir + " aside: " + std::strerror(errno));
  }
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp_dir + " to " + final_dir + ": " + std::strerror(errno));
  write_all(root + "/latest.tmp", step_name(step) + "\n");
  if (::rename((root + "/latest.tmp").c_str(), (root + "/latest").c_str()) != 0)
    throw std::runtime_error("cannot rename " + root + "/latest.tmp to latest: " + std::strerror(errno));
  sync_directory(root);
}

// Rank 0, once the checkpoint of `step` is published and the other ranks told: the copy moved
// aside and the checkpoints beyond `keep`. What fails here costs disk space, not the checkpoint.
void prune(const std::string& root, int64_t step, int64_t keep) {
  try {
    remove_tree(root + "/.old-" + step_name(step));
    rotate(root, step_name(step), keep);
  } catch (const std::exception& e) {
    log::warn(strf("checkpoint of step %ld saved, but removing older ones failed: %s", step, e.what()));
  }
}

}  // namespace

CheckpointWriter::CheckpointWriter(const Config& config, Communicator& comm) : config_(config), comm_(comm) {
  const std::string& root = config.ckpt.path;
  if (root.empty()) return;
  // Hours into a run is no time to learn that checkpoints cannot be written: every rank creates
  // the directory and writes (and removes) a small file there now.
  std::string error;
  try {
    make_directories(root);
    const std::string probe = root + "/.write-test-" + rank_name(comm.rank(), "tmp");
    write_all(probe, std::string(4096, 'x'));
    ::unlink(probe.c_str());
  } catch (const std::exception& e) {
    error = e.what();
  }
  const int64_t failing = comm.count_over_ranks({!error.empty()})[0];
  if (!error.empty()) throw std::runtime_error("checkpoint directory (ckpt.path) is not writable: " + error);
  if (failing > 0)
    throw std::runtime_error(strf("checkpoint directory (ckpt.path) %s is not writable from %ld rank(s); "
                                  "see their logs", root.c_str(), failing));
}

CheckpointWriter::~CheckpointWriter() {
  // On an error path the other ranks may never count themselves in: stop waiting for them.
  abandon_ = true;
  try {
    finish();
  } catch (const std::exception& e) {
    log::error(std::string("checkpoint: ") + e.what());
  }
}

void CheckpointWriter::finish() {
  if (writer_.joinable()) writer_.join();
  if (!error_.empty()) {
    const std::string e = error_;
    error_.clear();
    failed_ = false;
    throw std::runtime_error("saving the checkpoint failed: " + e);
  }
}

std::string CheckpointWriter::last_good() {
  // Waits for the save in flight but keeps its failure, if any, for finish() and failed() to
  // report (the loop stops every rank on it).
  if (writer_.joinable()) writer_.join();
  if (!config_.ckpt.path.empty() && path_exists(config_.ckpt.path + "/latest"))
    return resolve_checkpoint(config_, "latest");
  return config_.ckpt.resume.empty() ? "" : resolve_checkpoint(config_, config_.ckpt.resume);
}

std::string CheckpointWriter::save(TrainingState& run) {
  Phase phase("zb.checkpoint_save");  // this rank's copy to host memory; the disk is written after
  finish();  // one save at a time
  const std::string root = config_.ckpt.path;
  const int64_t step = run.counters().step;
  const std::string final_dir = root + "/" + step_name(step);
  const std::string tmp_dir = root + "/.tmp-" + step_name(step);
  const std::vector<StateTensor> state = state_of(run);

  // Never a checkpoint of a state that is not finite: it would rotate good ones out. (A step whose
  // loss or gradient norm is not finite is never applied, but an applied update can still
  // overflow.) One reduction per tensor on the device, one flag over the ranks.
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> finite;
    for (const StateTensor& t : state)
      if (t.local.numel() > 0) finite.push_back(at::isfinite(t.local).all());
    const bool bad = !finite.empty() && !at::stack(finite).all().item<bool>();
    if (comm_.count_over_ranks({bad})[0] > 0)
      throw std::runtime_error(strf("the state after step %ld holds non-finite values (parameters or optimizer "
                                    "state): no checkpoint written", step));
  }

  if (comm_.rank() == 0) {
    make_directories(root);
    remove_tree(tmp_dir);  // a save that crashed earlier
    make_directories(tmp_dir);
  }
  comm_.barrier();  // the directory exists for everyone

  // This rank's rows, copied to host memory now; the disk is written in the background.
  auto bytes = std::make_shared<std::string>();
  json index = json::array();
  {
    at::NoGradGuard no_grad;
    const bool another_replica = run.replica() != 0;  // hybrid sharding: copy 0 saves the rows
    const bool another_tp_rank = run.parallel().tp_rank() != 0;  // TP: rank 0 saves what the group shares
    for (const StateTensor& t : state) {
      if (another_replica && !t.replicated && !t.per_replica && !t.global_shape.empty()) continue;
      if (another_tp_rank && t.tp_shared) continue;
      const Entry e = entry_to_write(t, comm_.rank(), comm_.size());
      at::Tensor host = e.tensor.detach().to(at::kCPU, at::kFloat).contiguous();
      index.push_back({{"name", e.name}, {"global_shape", e.global_shape}, {"row_start", e.row_start},
                       {"rows", e.rows}, {"offset", bytes->size()}, {"numel", host.numel()}});
      if (e.cols >= 0) {
        index.back()["col_start"] = e.col_start;
        index.back()["cols"] = e.cols;
      }
      bytes->append(static_cast<const char*>(host.data_ptr()), host.numel() * sizeof(float));
    }
  }
  json meta;
  if (comm_.rank() == 0) {
    json shapes = json::object();
    for (const ShardedParameter& p : run.parallel().parameters()) shapes[p.name] = p.global_shape;
    meta = {
        {"format", "zeroband-cpp checkpoint"},
        {"version", kCheckpointFormatVersion},
        {"step", step},
        {"skipped_steps", run.counters().skipped},
        {"tokens_seen", step * run.tokens_per_step()},
        {"world_size", comm_.size()},
        {"config", config_.source},
        {"name_model", config_.name_model},
        {"type_model", config_.type_model},
        {"seed", config_.runtime.seed},
        {"shapes", shapes},
        {"model_args", model_args_to_json(run.model_args())},
    };
    for (Stateful* owner : run.owners())  // each part's record under its name ("data", "diloco")
      if (const std::string name = owner->record_name(); !name.empty()) meta[name] = owner->record();
    if (const std::string t = config_.data.fake ? "" : tokenizer_of_dataset(config_.data.dataset_name_or_paths);
        !t.empty())
      meta["tokenizer_source"] = t;
  }
  const auto store = comm_.rendezvous().store();
  const int64_t rank = comm_.rank(), world = comm_.size(), keep = config_.ckpt.keep;
  // The ranks' agreement on this save: one key per checkpoint directory (a process that saves
  // the same step into two places, or twice, meets no earlier save's counts).
  const std::string key = "zb/ckpt/" + final_dir + "/" + std::to_string(saves_++);
  const std::chrono::seconds timeout(config_.runtime.timeout_s);
  writer_ = std::thread([=] {
    std::string error;
    try {
      write_all(tmp_dir + "/" + rank_name(rank, "bin"), *bytes);
      fault_point({FaultPoint::InSave, step, /*chosen=*/true, {}});  // tests: a save cut off here
      write_all(tmp_dir + "/" + rank_name(rank, "json"), index.dump());
    } catch (const std::exception& e) {
      error = strf("rank %ld: %s", rank, e.what());
      failed_ = true;
    }
    // Waits for `done()` every 20 ms; false when abandoned or past `limit`.
    auto wait_until = [this](auto done, std::chrono::seconds limit) {
      const auto deadline = std::chrono::steady_clock::now() + limit;
      while (!done()) {
        if (abandon_ || std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      return true;
    };
    if (store) {
      // Every rank counts itself in, failed or not (a failure first leaves its message); the last
      // one announces that all are done, and every rank then learns whether any failed.
      try {
        if (!error.empty()) store->set(key + "/failed", std::vector<uint8_t>(error.begin(), error.end()));
        if (store->add(key + "/written", 1) == world) store->set(key + "/complete", std::vector<uint8_t>{1});
        if (!wait_until([&] { return store->check({key + "/complete"}); }, std::chrono::hours(24))) return;
        if (error.empty() && store->check({key + "/failed"})) {
          const std::vector<uint8_t> other = store->get(key + "/failed");
          error = std::string(other.begin(), other.end());
        }
      } catch (const std::exception& e) {  // rank 0, which holds the store, is gone
        if (error.empty()) error = strf("rank %ld: lost the other ranks during the save: %s", rank, e.what());
      }
    }
    if (rank == 0) {
      try {
        if (error.empty()) publish(root, step, tmp_dir, final_dir, meta);
      } catch (const std::exception& e) {
        error = strf("rank 0: %s", e.what());
      }
      if (!error.empty()) {
        try {
          remove_tree(tmp_dir);  // the previous checkpoint and latest are untouched
        } catch (const std::exception& e) {
          log::error(e.what());
        }
      }
    }
    if (store) {
      // Rank 0's outcome (putting the checkpoint into place can fail there alone): every rank
      // waits for it, so that none reports a save as done that is not.
      try {
        if (rank == 0) {
          store->set(key + "/published", std::vector<uint8_t>(error.begin(), error.end()));
        } else if (wait_until([&] { return store->check({key + "/published"}); }, timeout)) {
          const std::vector<uint8_t> outcome = store->get(key + "/published");
          if (error.empty() && !outcome.empty()) error = std::string(outcome.begin(), outcome.end());
        } else if (error.empty() && !abandon_) {
          error = strf("rank %ld: rank 0 did not say within runtime.timeout_s whether the checkpoint is in place",
                       rank);
        }
      } catch (const std::exception& e) {  // rank 0, which holds the store, is gone
        if (error.empty()) error = strf("rank %ld: lost rank 0 while it put the checkpoint in place: %s", rank, e.what());
      }
    }
    if (rank == 0 && error.empty()) prune(root, step, keep);
    if (!error.empty()) failed_ = true;
    error_ = error;
    if (store) {
      // The store lives in rank 0's process: it stays until every rank has read the outcome.
      try {
        store->add(key + "/read", 1);
        if (rank == 0) wait_until([&] { return store->add(key + "/read", 0) == world; }, timeout);
      } catch (const std::exception&) {
        // Rank 0 exited as this rank was done: nothing is left to read.
      }
    }
  });
  return final_dir;
}

std::optional<std::string> CheckpointWriter::save_if_due(TrainingState& run, bool stopping) {
  const auto& c = config_.ckpt;
  const int64_t step = run.counters().step;
  if (c.path.empty()) return std::nullopt;
  if (!(stopping || step == config_.optim.total_steps || (c.interval > 0 && step % c.interval == 0)))
    return std::nullopt;
  return save(run);
}

// Saved weights against the model that reads them, for what the shapes do not show: the heads
// split the same matrices differently (refused, naming both); RoPE's base and the norms' epsilon
// change what the weights compute, as a long-context phase may mean to (said, not refused).
void check_same_model(const ModelArgs& saved, const ModelArgs& run, const std::string& where) {
  if (saved.n_heads != run.n_heads || saved.n_kv_heads != run.n_kv_heads)
    throw std::runtime_error(strf("%s: its model has %ld heads and %ld key/value heads, this run's %ld and %ld: the "
                                  "attention weights would be read as other heads (another model?)",
                                  where.c_str(), saved.n_heads, saved.n_kv_heads, run.n_heads, run.n_kv_heads));
  if (saved.num_experts != run.num_experts || saved.n_dense_layers != run.n_dense_layers)
    throw std::runtime_error(strf("%s: its model has %ld experts from block %ld on, this run's %ld from block %ld "
                                  "(model.num_experts, model.n_dense_layers; another model?)",
                                  where.c_str(), saved.num_experts, saved.n_dense_layers, run.num_experts,
                                  run.n_dense_layers));
  if (saved.num_experts > 0 &&
      (saved.top_k != run.top_k || saved.score_func != run.score_func || saved.route_norm != run.route_norm ||
       saved.route_scale != run.route_scale || saved.num_expert_groups != run.num_expert_groups ||
       saved.num_limited_groups != run.num_limited_groups))
    log::warn(strf("%s: its model routes tokens another way (top_k %ld, %s%s, scale %g, groups %ld/%ld) than this "
                   "run's (top_k %ld, %s%s, scale %g, groups %ld/%ld): the experts are trained on from here as this "
                   "run routes",
                   where.c_str(), saved.top_k, saved.score_func.c_str(), saved.route_norm ? " renormalised" : "",
                   saved.route_scale, saved.num_expert_groups, saved.num_limited_groups, run.top_k,
                   run.score_func.c_str(), run.route_norm ? " renormalised" : "", run.route_scale,
                   run.num_expert_groups, run.num_limited_groups));
  if (saved.rope_theta != run.rope_theta)
    log::warn(strf("%s: its model has rope_theta %g, this run's %g: positions are encoded anew from here", where.c_str(),
                   saved.rope_theta, run.rope_theta));
  if (saved.norm_eps != run.norm_eps)
    log::warn(strf("%s: its model has norm_eps %g, this run's %g", where.c_str(), saved.norm_eps, run.norm_eps));
}

// A rank index's entry against the whole tensor's shape, before any read it steers: its rows (and
// column block) inside the tensor, and its value count theirs, so that a damaged index is an error
// and not a read past a buffer. What is wrong, or "".
std::string entry_problem(const json& e, const std::vector<int64_t>& shape, const std::string& file) {
  const int64_t a = e["row_start"], n = e["rows"], numel = e["numel"], offset = e["offset"];
  int64_t row_numel = 1;
  for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
  if (const int64_t cols = e.value("cols", int64_t{-1}); cols >= 0) {
    const int64_t c = e.value("col_start", int64_t{0});
    if (shape.size() != 2 || c < 0 || cols > shape[1] - c) row_numel = -1;
    else row_numel = cols;
  }
  if (offset < 0 || a < 0 || n < 0 || n > shape.at(0) - a || row_numel < 0 || numel != n * row_numel)
    return file + ": " + e["name"].get<std::string>() + "'s entry " + e.dump() + " does not fit its shape " +
           json(shape).dump() + " (damaged?)";
  return "";
}

std::string resolve_checkpoint(const Config& config, const std::string& spec) {
  if (spec != "latest") return spec;
  const std::string latest = config.ckpt.path + "/latest";
  if (!path_exists(latest)) throw std::runtime_error("no checkpoint to resume in " + config.ckpt.path + " (no 'latest')");
  std::string name = read_file(latest);
  name.erase(name.find_last_not_of(" \n") + 1);
  return config.ckpt.path + "/" + name;
}

void load_checkpoint(const std::string& dir, TrainingState& run, Communicator& comm) {
  auto fail = [&](const std::string& what) { return std::runtime_error("checkpoint " + dir + ": " + what); };
  if (!path_exists(dir + "/meta.json")) throw fail("not a complete checkpoint (no meta.json)");
  json meta;
  try {
    meta = json::parse(read_file(dir + "/meta.json"));
  } catch (const json::exception& e) {
    throw fail(std::string("damaged meta.json: ") + e.what());
  }
  if (meta.value("format", "") != "zeroband-cpp checkpoint" || meta.value("version", 0) != kCheckpointFormatVersion)
    throw fail("unknown format or version");
  // Same model: every parameter with the same global shape.
  const json& shapes = meta["shapes"];
  const std::vector<ShardedParameter> params = run.parallel().parameters();
  for (const ShardedParameter& p : params) {
    if (!shapes.contains(p.name)) throw fail("it holds no parameter " + p.name + " (another model?)");
    const std::vector<int64_t> have = shapes[p.name];
    if (have != p.global_shape)
      throw fail(p.name + " has shape " + json(have).dump() + " there but " + json(p.global_shape).dump() +
                 " in this model (another model?)");
  }
  if (shapes.size() != params.size())
    throw fail("it holds " + std::to_string(shapes.size()) + " parameters, this model " +
               std::to_string(params.size()));
  ModelArgs saved_args;
  try {
    saved_args = model_args_from_json(meta.at("model_args"));
  } catch (const std::exception& e) {
    throw fail(std::string("damaged meta.json: ") + e.what());
  }
  check_same_model(saved_args, run.model_args(), "checkpoint " + dir);

  // Every saved rank's index, and its file checked against it.
  const int64_t saved_world = meta["world_size"];
  std::vector<json> indices(static_cast<size_t>(saved_world));
  std::vector<std::string> files(static_cast<size_t>(saved_world));
  for (int64_t s = 0; s < saved_world; ++s) {
    const std::string idx_path = dir + "/" + rank_name(s, "json");
    const std::string bin_path = dir + "/" + rank_name(s, "bin");
    if (!path_exists(idx_path) || !path_exists(bin_path)) throw fail("missing the files of rank " + std::to_string(s));
    try {
      indices[s] = json::parse(read_file(idx_path));
    } catch (const json::exception& e) {
      throw fail("damaged " + rank_name(s, "json") + ": " + e.what());
    }
    struct stat st {};
    if (::stat(bin_path.c_str(), &st) != 0) throw fail("cannot stat " + rank_name(s, "bin") + ": " + std::strerror(errno));
    int64_t expected = 0;
    try {
      for (const auto& e : indices[s])
        expected = std::max<int64_t>(expected, e.at("offset").get<int64_t>() + 4 * e.at("numel").get<int64_t>());
    } catch (const json::exception& e) {
      throw fail("damaged " + rank_name(s, "json") + ": " + e.what());
    }
    if (st.st_size != expected)
      throw fail(rank_name(s, "bin") + " has " + std::to_string(st.st_size) + " bytes, its index " +
                 std::to_string(expected) + " (truncated?)");
    files[s] = bin_path;
  }

  // Read everything first (nothing is modified if anything is missing), then copy in.
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;  // (destination, loaded value)
  // Where the run continues, and each part's record there (none in a checkpoint saved without it).
  const int64_t step = meta["step"];
  const std::vector<Stateful*> owners = run.owners();
  std::vector<RestorePoint> points;
  for (Stateful* owner : owners) {
    RestorePoint& at = points.emplace_back(RestorePoint{step, static_cast<uint64_t>(meta["seed"].get<int64_t>()), {}});
    const std::string name = owner->record_name();
    if (name.empty() || !meta.contains(name)) continue;
    at.record.emplace();
    for (const auto& [key, value] : meta[name].items()) {
      if (!value.is_number_integer()) throw fail("damaged meta.json: " + name + "." + key + " is not a whole number");
      (*at.record)[key] = value.get<int64_t>();
    }
  }
  for (size_t i = 0; i < owners.size(); ++i) owners[i]->prepare_restore(points[i]);
  try {  // an index entry without a field it needs: named, not a raw JSON error
    for (const StateTensor& t : state_of(run)) {
      at::Tensor value = at::empty(t.local.sizes(), at::kFloat);
      char* out = static_cast<char*>(value.data_ptr());
      const bool scalar = t.global_shape.empty();
      // This rank needs rows [b, b + m) of the whole (columns [c, c + w) of a column block); every
      // saved rank's overlapping rows (and columns) are read.
      const int64_t b = t.row_start, m = scalar ? 0 : t.local.size(0);
      const bool block = column_block(t);
      const int64_t c = block ? t.col_start : 0, w = block ? t.local.size(1) : (t.global_shape.size() == 2 ? t.global_shape[1] : 0);
      int64_t values_read = 0;
      bool found = false;
      for (int64_t s = 0; s < saved_world && !(found && scalar); ++s) {
        for (const auto& ie : indices[s]) {
          if (ie["name"] != t.name) continue;
          found = true;
          const int64_t offset = ie["offset"];
          if (scalar) {  // any rank's copy
            if (offset < 0 || ie["numel"] != 1)
              throw fail(rank_name(s, "json") + ": " + t.name + "'s entry " + ie.dump() + " is not a scalar's (damaged?)");
            read_exact(files[s], out, 4, offset);
          } else {
            // Overlap of the saved rows [a, a+n) with mine [b, b+m).
            const int64_t a = ie["row_start"], n = ie["rows"];
            const int64_t lo = std::max(a, b), hi = std::min(a + n, b + m);
            const int64_t saved_cols = ie.value("cols", int64_t{-1});
            if (const std::string problem = entry_problem(ie, t.global_shape, rank_name(s, "json")); !problem.empty())
              throw fail(problem);
            if (hi > lo && saved_cols < 0 && !block) {  // whole rows on both sides: one read
              const int64_t rn = ie["numel"].get<int64_t>() / std::max<int64_t>(1, n);
              read_exact(files[s], out + (lo - b) * rn * 4, (hi - lo) * rn * 4, offset + (lo - a) * rn * 4);
              values_read += (hi - lo) * rn;
            } else if (hi > lo) {  // a matrix split by columns on either side: row by row, the common columns
              const int64_t sc = saved_cols < 0 ? 0 : ie.value("col_start", int64_t{0});
              const int64_t sw = saved_cols < 0 ? t.global_shape.at(1) : saved_cols;
              const int64_t clo = std::max(sc, c), chi = std::min(sc + sw, c + w);
              for (int64_t row = lo; row < hi && chi > clo; ++row)
                read_exact(files[s], out + ((row - b) * w + (clo - c)) * 4, (chi - clo) * 4,
                           offset + ((row - a) * sw + (clo - sc)) * 4);
              if (chi > clo) values_read += (hi - lo) * (chi - clo);
            }
          }
          break;
        }
      }
      if (!found) {
        const bool diloco = t.per_replica || t.name.rfind("diloco/", 0) == 0;
        throw fail("it holds no " + t.name +
                   (diloco ? " (saved without DiLoCo, or with fewer replicas?)" : " (saved with another optimizer, or with DiLoCo?)"));
      }
      if (!scalar && values_read != t.local.numel())
        throw fail(strf("%s: found %ld of the %ld values this rank needs", t.name.c_str(), values_read,
                        static_cast<int64_t>(t.local.numel())));
      assignments.emplace_back(t.local, value);
    }
  } catch (const json::exception& e) {
    throw fail(std::string("damaged rank index: ") + e.what());
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, value] : assignments) dst.copy_(value.to(dst.device()).view(dst.sizes()));

  try {
    for (size_t i = 0; i < owners.size(); ++i) owners[i]->restore(points[i]);
  } catch (const std::runtime_error& e) {
    throw fail(e.what());
  }
  run.counters() = {step, meta.value("skipped_steps", int64_t{0})};
  run.parallel().parameters_changed();
  log::info(strf("resumed from %s: step %ld, saved on %ld rank(s), now on %ld", dir.c_str(), step,
                 saved_world, comm.size()));
}

void init_from_hf(const std::string& dir, TrainingState& run) {
  ModelArgs args;
  const TensorMap full = read_hf_model(dir, &args);
  check_same_model(args, run.model_args(), "model " + dir);
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;
  for (const ShardedParameter& p : run.parallel().parameters()) {
    const auto it = full.find(p.name);
    if (it == full.end()) throw std::runtime_error("model " + dir + ": no " + p.name);
    if (it->second.sizes().vec() != p.global_shape)
      throw std::runtime_error("model " + dir + ": " + p.name + " has shape " + json(it->second.sizes().vec()).dump() +
                               " there but " + json(p.global_shape).dump() +
                               " in this run's model (a model of another size?)");
    at::Tensor rows = it->second.narrow(0, p.row_start, p.tensor->size(0));
    if (p.tensor->dim() == 2 && p.tensor->size(1) != rows.size(1)) rows = rows.narrow(1, p.col_start, p.tensor->size(1));
    assignments.emplace_back(*p.tensor, rows);
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, value] : assignments) dst.copy_(value);
  run.parallel().parameters_changed();
  log::info("initial weights from " + dir);
}

}  // namespace zb
