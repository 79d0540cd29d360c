#include "checkpoint/checkpoint.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <dirent.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "checkpoint/hf_export.h"
#include "util/fs.h"
#include "util/log.h"

namespace zb {
namespace {

using json = nlohmann::json;

std::string step_name(int64_t step) { return strf("step_%08ld", step); }
std::string rank_name(int64_t rank, const char* ext) { return strf("rank_%05ld.%s", rank, ext); }

// One tensor of this rank: rows [row_start, row_start + rows) of a global tensor, or a scalar
// (rows = -1) that every rank holds whole.
struct Entry {
  std::string name;
  at::Tensor tensor;  // this rank's rows (fp32) or the scalar
  std::vector<int64_t> global_shape;
  int64_t row_start = 0, rows = -1;
};

// Every tensor that makes up the training state, with its place in the global layout.
std::vector<Entry> state_entries(Trainer& trainer, int64_t rank) {
  std::vector<Entry> out;
  auto place = [&](const std::string& name, const at::Tensor& t, const std::string& param_name) {
    Entry e{name, t, {}, 0, -1};
    if (t.dim() > 0) {
      const FSDPParam* p = trainer.engine().param(param_name);
      TORCH_CHECK(p, "no parameter ", param_name, " for state ", name);
      e.global_shape = p->full_shape;
      e.row_start = std::min(p->rows, rank * p->rows_per_rank);
      e.rows = p->local_rows;
    }
    out.push_back(e);
  };
  for (const auto& np : trainer.engine().sharded_parameters())
    place("model/" + np.name, *np.slot, np.name);
  for (const auto& st : trainer.optimizer().state()) {
    const std::string param_name = st.name.substr(0, st.name.rfind('.'));
    place("optim/" + st.name, st.tensor, param_name);
  }
  return out;
}

void write_all(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("write to " + path + " failed: " + std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
  ::fsync(fd);  // on disk before the checkpoint is renamed into place
  ::close(fd);
}

}  // namespace

namespace {

// Rank 0, once every rank's files are complete: metadata, rename into place, latest, pruning.
void publish(const std::string& root, int64_t step, const std::string& tmp_dir,
             const std::string& final_dir, const json& meta, int64_t keep) {
  write_all(tmp_dir + "/meta.json", meta.dump(1));
  // Into place: an older checkpoint of the same step moves aside first and goes only after.
  const std::string aside = root + "/.old-" + step_name(step);
  if (path_exists(final_dir)) {
    remove_tree(aside);
    if (::rename(final_dir.c_str(), aside.c_str()) != 0)
      throw std::runtime_error("cannot move " + final_dir + " aside");
  }
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp_dir + " to " + final_dir);
  remove_tree(aside);
  write_all(root + "/latest.tmp", step_name(step) + "\n");
  ::rename((root + "/latest.tmp").c_str(), (root + "/latest").c_str());
  if (keep > 0) {
    std::vector<std::string> steps;
    if (DIR* dir = ::opendir(root.c_str())) {
      while (dirent* e = ::readdir(dir))
        if (std::strncmp(e->d_name, "step_", 5) == 0) steps.push_back(e->d_name);
      ::closedir(dir);
    }
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) remove_tree(root + "/" + steps[i]);
  }
}

}  // namespace

CheckpointWriter::~CheckpointWriter() {
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
    throw std::runtime_error("saving the checkpoint failed: " + e);
  }
}

std::string CheckpointWriter::save(Trainer& trainer) {
  finish();  // one save at a time
  const std::string root = config_.ckpt.path;
  const int64_t step = trainer.step();
  const std::string final_dir = root + "/" + step_name(step);
  const std::string tmp_dir = root + "/.tmp-" + step_name(step);
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
    for (const Entry& e : state_entries(trainer, comm_.rank())) {
      at::Tensor host = e.tensor.detach().to(at::kCPU, at::kFloat).contiguous();
      index.push_back({{"name", e.name}, {"global_shape", e.global_shape}, {"row_start", e.row_start},
                       {"rows", e.rows}, {"offset", bytes->size()}, {"numel", host.numel()}});
      bytes->append(static_cast<const char*>(host.data_ptr()), host.numel() * sizeof(float));
    }
  }
  json meta;
  if (comm_.rank() == 0) {
    json shapes = json::object();
    for (const auto& np : trainer.engine().sharded_parameters())
      shapes[np.name] = trainer.engine().param(np.name)->full_shape;
    const ModelArgs& a = trainer.model_args();
    meta = {
        {"format", "zeroband-cpp checkpoint"},
        {"version", kCheckpointFormatVersion},
        {"step", step},
        {"tokens_seen", step * trainer.tokens_per_step()},
        {"world_size", comm_.size()},
        {"config", config_.source},
        {"name_model", config_.name_model},
        {"type_model", config_.type_model},
        {"seed", config_.runtime.seed},
        {"shapes", shapes},
        {"model_args", {{"dim", a.dim}, {"n_layers", a.n_layers}, {"n_heads", a.n_heads},
                        {"n_kv_heads", a.n_kv_heads}, {"vocab_size", a.vocab_size},
                        {"multiple_of", a.multiple_of}, {"ffn_dim_multiplier", a.ffn_dim_multiplier},
                        {"norm_eps", a.norm_eps}, {"rope_theta", a.rope_theta},
                        {"max_seq_len", a.max_seq_len}}},
        {"data_rows_consumed_per_rank", trainer.data().state().rows_consumed},
    };
  }
  const auto store = comm_.store();
  const int64_t rank = comm_.rank(), world = comm_.size(), keep = config_.ckpt.keep;
  const std::string done_key = "zb/ckpt/" + std::to_string(step) + "/written";
  const std::string complete_key = "zb/ckpt/" + std::to_string(step) + "/complete";
  writer_ = std::thread([=] {
    try {
      write_all(tmp_dir + "/" + rank_name(rank, "bin"), *bytes);
      write_all(tmp_dir + "/" + rank_name(rank, "json"), index.dump());
      if (store) {
        // The last rank to finish announces it; rank 0 waits for that, then publishes.
        if (store->add(done_key, 1) == world) store->set(complete_key, std::vector<uint8_t>{1});
        if (rank == 0) store->wait({complete_key}, std::chrono::hours(24));
      }
      if (rank == 0) publish(root, step, tmp_dir, final_dir, meta, keep);
    } catch (const std::exception& e) {
      error_ = e.what();
    }
  });
  return final_dir;
}

std::string resolve_checkpoint(const Config& config, const std::string& spec) {
  if (spec != "latest") return spec;
  const std::string latest = config.ckpt.path + "/latest";
  if (!path_exists(latest)) throw std::runtime_error("no checkpoint to resume in " + config.ckpt.path + " (no 'latest')");
  std::string name = read_file(latest);
  name.erase(name.find_last_not_of(" \n") + 1);
  return config.ckpt.path + "/" + name;
}

void load_checkpoint(const std::string& dir, Trainer& trainer, Communicator& comm) {
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
  for (const auto& np : trainer.engine().sharded_parameters()) {
    const auto& want = trainer.engine().param(np.name)->full_shape;
    if (!shapes.contains(np.name)) throw fail("it holds no parameter " + np.name + " (another model?)");
    const std::vector<int64_t> have = shapes[np.name];
    if (have != want)
      throw fail(np.name + " has shape " + json(have).dump() + " there but " + json(want).dump() +
                 " in this model (another model?)");
  }
  if (shapes.size() != trainer.engine().sharded_parameters().size())
    throw fail("it holds " + std::to_string(shapes.size()) + " parameters, this model " +
               std::to_string(trainer.engine().sharded_parameters().size()));

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
    ::stat(bin_path.c_str(), &st);
    int64_t expected = 0;
    for (const auto& e : indices[s]) expected = std::max<int64_t>(expected, e["offset"].get<int64_t>() + 4 * e["numel"].get<int64_t>());
    if (st.st_size != expected)
      throw fail(rank_name(s, "bin") + " has " + std::to_string(st.st_size) + " bytes, its index " +
                 std::to_string(expected) + " (truncated?)");
    files[s] = bin_path;
  }

  // Read everything first (nothing is modified if anything is missing), then copy in.
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;  // (destination, loaded value)
  for (const Entry& e : state_entries(trainer, comm.rank())) {
    at::Tensor value = at::empty(e.tensor.sizes(), at::kFloat);
    char* out = static_cast<char*>(value.data_ptr());
    bool found = false;
    for (int64_t s = 0; s < saved_world && !(found && e.rows < 0); ++s) {
      for (const auto& ie : indices[s]) {
        if (ie["name"] != e.name) continue;
        found = true;
        const int64_t offset = ie["offset"];
        const int fd = ::open(files[s].c_str(), O_RDONLY);
        if (e.rows < 0) {  // a scalar: any rank's copy
          ::pread(fd, out, 4, offset);
        } else {
          // Overlap of the saved rows [a, a+n) with mine [b, b+m).
          const int64_t a = ie["row_start"], n = ie["rows"], b = e.row_start, m = e.rows;
          const int64_t lo = std::max(a, b), hi = std::min(a + n, b + m);
          if (hi > lo) {
            const int64_t rn = ie["numel"].get<int64_t>() / std::max<int64_t>(1, n);
            ::pread(fd, out + (lo - b) * rn * 4, static_cast<size_t>((hi - lo) * rn * 4),
                    offset + (lo - a) * rn * 4);
          }
        }
        ::close(fd);
        break;
      }
    }
    if (!found) throw fail("it holds no " + e.name + " (saved with another optimizer?)");
    assignments.emplace_back(e.tensor, value);
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, value] : assignments) dst.copy_(value.to(dst.device()).view(dst.sizes()));

  const int64_t step = meta["step"];
  trainer.restore_position(step, static_cast<uint64_t>(meta["seed"].get<int64_t>()));
  log::info(strf("resumed from %s: step %ld, saved on %ld rank(s), now on %ld", dir.c_str(), step,
                 saved_world, comm.size()));
}

void init_from_hf(const std::string& dir, Trainer& trainer) {
  ModelArgs args;
  const TensorMap full = read_hf_model(dir, &args);
  std::vector<std::pair<at::Tensor, at::Tensor>> assignments;
  for (const auto& np : trainer.engine().sharded_parameters()) {
    const FSDPParam* p = trainer.engine().param(np.name);
    const auto it = full.find(np.name);
    if (it == full.end() || it->second.sizes().vec() != p->full_shape)
      throw std::runtime_error("model " + dir + ": " + np.name + " is missing or has another shape than " +
                               json(p->full_shape).dump() + " (another model?)");
    const int64_t start = std::min(p->rows, trainer.engine().comm().rank() * p->rows_per_rank);
    assignments.emplace_back(*np.slot, it->second.narrow(0, start, p->local_rows));
  }
  at::NoGradGuard no_grad;
  for (auto& [dst, value] : assignments) dst.copy_(value);
  log::info("initial weights from " + dir);
}

}  // namespace zb
