#include "data/loader.h"

#include <ATen/ops/empty.h>

#include <numeric>
#include <random>
#include <stdexcept>

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

int64_t DataLoader::next_position() const {
  const int64_t per_rank = global_batch_ / world_;
  return (rows_ / per_rank) * global_batch_ + rank_ * per_rank + rows_ % per_rank;
}

int64_t DataLoader::sample_at(int64_t position) const {
  const int64_t n = source_->num_samples();
  if (n < 0) return position;  // endless source: its own order
  const int64_t epoch = position / n, within = position % n;
  return shuffle_ ? permutation(epoch)[static_cast<size_t>(within)] : within;
}

Batch DataLoader::next() {
  const int64_t T = source_->seq_len();
  at::Tensor rows = at::empty({micro_bs_, T + 1}, at::kLong);
  int64_t* data = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < micro_bs_; ++j, ++rows_)
    source_->sample(sample_at(next_position()), data + j * (T + 1));
  return {rows.slice(1, 0, T).contiguous(), rows.slice(1, 1, T + 1).contiguous()};
}

void DataLoader::load_state(const LoaderState& state) {
  if (state.seed != seed_ || state.world_size != world_)
    throw std::runtime_error("data loader state from seed " + std::to_string(state.seed) + " on " +
                             std::to_string(state.world_size) + " ranks cannot resume seed " +
                             std::to_string(seed_) + " on " + std::to_string(world_) + " ranks");
  rows_ = state.rows_consumed;
}

}  // namespace zb
