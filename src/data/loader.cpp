#include "data/loader.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <cstdlib>
#include <stdexcept>

#include "util/log.h"

namespace zb {

DataLoader::DataLoader(std::shared_ptr<const SampleSource> source, uint64_t seed, bool shuffle,
                       int64_t global_batch, int64_t micro_bs, int64_t rank, int64_t world_size)
    : source_(std::move(source)), seed_(seed), shuffle_(shuffle), global_batch_(global_batch),
      micro_bs_(micro_bs), rank_(rank), world_(world_size) {
  if (source_->num_samples() == 0) throw std::runtime_error("the dataset holds no sample");
}

const std::vector<int64_t>& DataLoader::permutation(int64_t epoch) const {
  if (epoch != cached_epoch_) {
    cached_permutation_.resize(static_cast<size_t>(source_->num_samples()));
    std::iota(cached_permutation_.begin(), cached_permutation_.end(), 0);
    std::seed_seq seq{seed_, static_cast<uint64_t>(epoch), uint64_t{0xda7a}};
    std::mt19937_64 rng(seq);
    std::shuffle(cached_permutation_.begin(), cached_permutation_.end(), rng);
    cached_epoch_ = epoch;
  }
  return cached_permutation_;
}

int64_t DataLoader::position_of(int64_t row) const {
  // Rows since the last reposition, each global batch one of the stream's steps of
  // members_ x global_batch_ rows, of which this loader's member reads its own slice.
  const int64_t per_rank = global_batch_ / world_, since = row - rows_at_base_;
  return base_ + (since / per_rank) * members_ * global_batch_ + member_ * global_batch_ + rank_ * per_rank +
         since % per_rank;
}

int64_t DataLoader::stream_rows_read() const {
  return base_ + (rows_ - rows_at_base_) / (global_batch_ / world_) * members_ * global_batch_;
}

void DataLoader::reposition(int64_t stream_rows, int64_t member, int64_t members) {
  const int depth = prefetch_depth_;
  const bool pin = pin_memory_;
  stop_prefetch();  // what it prepared was read from the old positions
  prefetch_depth_ = 0;
  base_ = stream_rows;
  rows_at_base_ = rows_;
  member_ = member;
  members_ = members;
  start_prefetch(depth, pin);
}

int64_t DataLoader::sample_at(int64_t position) const {
  const int64_t n = source_->num_samples();
  if (n < 0) return position;  // endless source: its own order
  const int64_t epoch = position / n, within = position % n;
  return shuffle_ ? permutation(epoch)[static_cast<size_t>(within)] : within;
}

Batch DataLoader::make_batch(int64_t first_row, bool pin_memory) const {
  const int64_t T = source_->seq_len();
  at::Tensor rows = at::empty({micro_bs_, T + 1}, at::kLong);
  int64_t* data = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < micro_bs_; ++j)
    source_->sample(sample_at(position_of(first_row + j)), data + j * (T + 1));
  auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(pin_memory);
  at::Tensor inputs = at::empty({micro_bs_, T}, opts), targets = at::empty({micro_bs_, T}, opts);
  inputs.copy_(rows.slice(1, 0, T));
  targets.copy_(rows.slice(1, 1, T + 1));
  Batch batch{inputs, targets, {}, 0};
  if (delimiter_) {
    std::vector<int32_t> cu{0};
    for (int64_t j = 0; j < micro_bs_; ++j)
      append_document_bounds(data + j * (T + 1), T, *delimiter_, cu, batch.max_document);
    batch.cu_seqlens = at::empty({static_cast<int64_t>(cu.size())}, opts.dtype(at::kInt));
    std::copy(cu.begin(), cu.end(), batch.cu_seqlens.data_ptr<int32_t>());
  }
  return batch;
}

Batch DataLoader::next() {
  if (prefetch_depth_ == 0) {
    Batch b = make_batch(rows_, false);
    rows_ += micro_bs_;
    return b;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !ready_.empty() || !producer_error_.empty(); });
  if (ready_.empty()) throw std::runtime_error("data loader: " + producer_error_);
  Batch b = std::move(ready_.front());
  ready_.pop_front();
  rows_ += micro_bs_;
  changed_.notify_all();
  return b;
}

void DataLoader::prefetch_loop() {
  try {
    while (true) {
      int64_t row;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || static_cast<int>(ready_.size()) < prefetch_depth_; });
        if (stopping_) return;
        row = produced_;
      }
      Batch b = make_batch(row, pin_memory_);
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      ready_.push_back(std::move(b));
      produced_ = row + micro_bs_;
      changed_.notify_all();
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    producer_error_ = e.what();
    changed_.notify_all();
  }
}

void DataLoader::start_prefetch(int depth, bool pin_memory) {
  stop_prefetch();
  if (depth <= 0) return;
  prefetch_depth_ = depth;
  pin_memory_ = pin_memory;
  produced_ = rows_;
  stopping_ = false;
  producer_ = std::thread([this] { prefetch_loop(); });
}

void DataLoader::stop_prefetch() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }
  if (producer_.joinable()) producer_.join();
  ready_.clear();
  producer_error_.clear();
}

DataLoader::~DataLoader() { stop_prefetch(); }

void DataLoader::load_state(const LoaderState& state) {
  if (state.seed != seed_ || state.world_size != world_)
    throw std::runtime_error("data loader state from seed " + std::to_string(state.seed) + " on " +
                             std::to_string(state.world_size) + " ranks cannot resume seed " +
                             std::to_string(seed_) + " on " + std::to_string(world_) + " ranks");
  const int depth = prefetch_depth_;
  const bool pin = pin_memory_;
  stop_prefetch();
  prefetch_depth_ = 0;
  rows_ = state.rows_consumed;
  start_prefetch(depth, pin);  // restarts from the restored position
}

StateRecord DataLoader::record() const {
  return {{"stream_rows", stream_rows_read()}, {"batch_size", global_batch_}, {"seq_length", source_->seq_len()}};
}

void DataLoader::restore(const RestorePoint& at) {
  load_state({at.step * (global_batch_ / world_), at.seed, world_});  // this rank's rows per step
  if (!at.record) return;  // a checkpoint older than the record
  const StateRecord& saved = *at.record;
  // Saved at another batch size, the step count no longer says where the data stopped: the stream
  // position the checkpoint kept does. (Elastic replicas place themselves by it anyway.)
  if (const int64_t batch = record_value(saved, "data", "batch_size"); batch != global_batch_) {
    const int64_t rows = record_value(saved, "data", "stream_rows");
    reposition(rows, 0, 1);
    log::info(strf("data: the checkpoint's batch was %ld rows, this run's %ld: reading on from stream row %ld", batch,
                   global_batch_, rows));
  }
  if (const int64_t length = record_value(saved, "data", "seq_length"); length != source_->seq_len())
    log::warn(strf("data: the checkpoint's rows were %ld tokens, this run's %ld: the position is counted in rows, "
                   "so some text may be read again or skipped",
                   length, source_->seq_len()));
}

MixedSource::MixedSource(std::vector<std::shared_ptr<const SampleSource>> sources,
                         std::vector<double> weights, uint64_t seed)
    : sources_(std::move(sources)), seed_(seed), pass_of_(sources_.size(), -1), pass_order_(sources_.size()) {
  double total = 0;
  for (double w : weights) total += w;
  double acc = 0;
  for (double w : weights) {
    TORCH_CHECK(w / total >= 2.0 / kBlock, "MixedSource: a weight below 2/", kBlock, " of the total");
    cumulative_.push_back(acc += w / total);
  }
  cumulative_.back() = 1.0;
}

int64_t MixedSource::before_block(size_t s, int64_t block) const {
  // Positions [0, N) hold floor(N c_s) - floor(N c_{s-1}) of source s: the counts add up to N, and
  // a block adds K w_s - 2 or more of each, never a negative number (the weights are >= 2/K).
  const double N = static_cast<double>(block * kBlock);
  const auto below = [&](size_t i) { return i == 0 ? int64_t{0} : static_cast<int64_t>(std::floor(N * cumulative_[i - 1])); };
  return (s + 1 == cumulative_.size() ? block * kBlock : static_cast<int64_t>(std::floor(N * cumulative_[s]))) -
         below(s);
}

std::pair<size_t, int64_t> MixedSource::source_of(int64_t index) const {
  const int64_t block = index / kBlock, at = index % kBlock;
  std::lock_guard<std::mutex> lock(mutex_);
  if (block != cached_block_) {
    // The block's sources, each as often as its share, shuffled; then each position's rank among
    // its source's positions in the block.
    block_sources_.clear();
    for (size_t s = 0; s < sources_.size(); ++s)
      block_sources_.insert(block_sources_.end(), before_block(s, block + 1) - before_block(s, block),
                            static_cast<uint32_t>(s));
    std::seed_seq seq{seed_, static_cast<uint64_t>(block), uint64_t{0x6d1c}};
    std::mt19937_64 rng(seq);
    std::shuffle(block_sources_.begin(), block_sources_.end(), rng);
    std::vector<uint32_t> seen(sources_.size(), 0);
    block_ranks_.resize(block_sources_.size());
    for (size_t i = 0; i < block_sources_.size(); ++i) block_ranks_[i] = seen[block_sources_[i]]++;
    cached_block_ = block;
  }
  const size_t s = block_sources_[static_cast<size_t>(at)];
  return {s, before_block(s, block) + block_ranks_[static_cast<size_t>(at)]};
}

void MixedSource::sample(int64_t index, int64_t* row) const {
  const auto [s, k] = source_of(index);  // the k-th read of source s
  const SampleSource& src = *sources_[s];
  const int64_t n = src.num_samples();
  if (n <= 0) return src.sample(k, row);  // endless: its own order
  const int64_t pass = k / n;
  int64_t sample = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t>& order = pass_order_[s];
    if (pass_of_[s] != pass) {  // every sample once a pass, in an order of its own
      order.resize(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      std::seed_seq seq{seed_, static_cast<uint64_t>(s), static_cast<uint64_t>(pass), uint64_t{0x5a3e}};
      std::mt19937_64 rng(seq);
      std::shuffle(order.begin(), order.end(), rng);
      pass_of_[s] = pass;
    }
    sample = order[static_cast<size_t>(k % n)];
  }
  src.sample(sample, row);
}

}  // namespace zb
