#pragma once
// Samples, their order and their split over ranks.
//
// A SampleSource gives numbered samples of seq_len + 1 tokens (inputs = row[:-1],
// targets = row[1:]). The DataLoader walks a global order of them: global batch s is positions
// [s*B, (s+1)*B) of that order, and rank r of W reads positions [r*B/W, (r+1)*B/W) of each, so
// the global batch does not depend on the world size. For a finite source the order is a
// permutation of its samples drawn from (seed, epoch) (or the plain order without shuffling),
// epoch after epoch. The loader's whole state is how many rows this rank has consumed, which a
// resume derives from the step; checkpoints also keep where the stream stood (its record "data").
#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "data/documents.h"
#include "util/stateful.h"

namespace zb {

struct Batch {
  at::Tensor inputs;   // [micro_bs, seq_len] int64
  at::Tensor targets;  // [micro_bs, seq_len] int64
  // Where the inputs' documents begin and end (model/attention.h's Documents::cu_seqlens, int32,
  // on the CPU) and the longest piece; undefined unless the loader was given a delimiter.
  at::Tensor cu_seqlens;
  int64_t max_document = 0;
};

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t num_samples() const = 0;  // -1: endless
  virtual int64_t seq_len() const = 0;
  // Fills row (seq_len + 1 tokens) with sample `index` (0 <= index < num_samples()).
  virtual void sample(int64_t index, int64_t* row) const = 0;
};

// Several sources mixed by ratio (ZeroBand's dataset_ratio), each read without replacement: every
// block of kBlock positions holds each source's share of them (its cumulative share rounded down,
// so that over the first N positions source s has floor(N c_s) - floor(N c_{s-1}) of them, c the
// cumulative weights), in an order shuffled from (seed, block). A source's k-th position reads its
// sample k in a shuffled order of its own, a new one each pass over it. Endless, the same on every
// rank and world size; a weight must be at least 2 / kBlock of the total (parse_ratio checks).
class MixedSource : public SampleSource {
 public:
  static constexpr int64_t kBlock = 4096;
  MixedSource(std::vector<std::shared_ptr<const SampleSource>> sources, std::vector<double> weights,
              uint64_t seed);
  int64_t num_samples() const override { return -1; }
  int64_t seq_len() const override { return sources_.front()->seq_len(); }
  void sample(int64_t index, int64_t* row) const override;
  // Which source position `index` draws from, and which of its samples (for tests).
  std::pair<size_t, int64_t> source_of(int64_t index) const;

 private:
  int64_t before_block(size_t s, int64_t block) const;  // source s's positions in blocks [0, block)

  std::vector<std::shared_ptr<const SampleSource>> sources_;
  std::vector<double> cumulative_;  // normalised, ending at 1
  uint64_t seed_;
  // The block read last (its sources in order, and for each position how many of its source's
  // came before it in the block) and each source's order for its pass read last: reads are mostly
  // in order, from the loader's one producer thread.
  mutable std::mutex mutex_;
  mutable int64_t cached_block_ = -1;
  mutable std::vector<uint32_t> block_sources_, block_ranks_;
  mutable std::vector<int64_t> pass_of_;
  mutable std::vector<std::vector<int64_t>> pass_order_;
};

struct LoaderState {
  int64_t rows_consumed = 0;  // by this rank
  uint64_t seed = 0;
  int64_t world_size = 1;
};

class DataLoader : public Stateful {
 public:
  DataLoader(std::shared_ptr<const SampleSource> source, uint64_t seed, bool shuffle,
             int64_t global_batch, int64_t micro_bs, int64_t rank, int64_t world_size);
  ~DataLoader();

  // Prepares up to `depth` micro-batches ahead on a background thread (in pinned host memory
  // when `pin_memory`, so that copies to the GPU can be asynchronous). The batches and the state
  // are the same as without it.
  void start_prefetch(int depth, bool pin_memory);

  // Batches then carry their rows' documents, cut at `delimiter` (data/documents.h); computed
  // with the batch, on the prefetching thread. Call before start_prefetch.
  void set_documents(const DocumentDelimiter& delimiter) { delimiter_ = delimiter; }

  // The next micro-batch of this rank (CPU tensors).
  Batch next();
  // The sample a global position maps to.
  int64_t sample_at(int64_t position) const;

  // Elastic DiLoCo's replicas share one stream (diloco/membership.h): from the next row on, each of
  // this loader's global batches is the slice `member` of `members` consecutive ones, starting at
  // stream row `stream_rows`. stream_rows_read(): where the stream stands after this loader's
  // rows (the rows it has consumed counted for every member).
  void reposition(int64_t stream_rows, int64_t member, int64_t members);
  int64_t stream_rows_read() const;

  LoaderState state() const { return {rows_, seed_, world_}; }
  // Resumes at the next unseen row. Throws if the state came from another seed or world size.
  void load_state(const LoaderState& state);

  // Checkpoints: the record {stream_rows, batch_size, seq_length}. A resume after
  // step s reads on from global batch s + 1, whatever the world size; saved at another batch size
  // it reads on from the stream row the checkpoint kept instead.
  std::string record_name() const override { return "data"; }
  StateRecord record() const override;
  void restore(const RestorePoint& at) override;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;
  Batch make_batch(int64_t first_row, bool pin_memory) const;
  int64_t position_of(int64_t row) const;  // global position of this rank's row-th row
  void stop_prefetch();
  void prefetch_loop();

  std::shared_ptr<const SampleSource> source_;
  uint64_t seed_;
  bool shuffle_;
  int64_t global_batch_, micro_bs_, rank_, world_;
  int64_t rows_ = 0;
  // reposition(): the stream row and this loader's row count there, and its slice of each step.
  int64_t base_ = 0, rows_at_base_ = 0, member_ = 0, members_ = 1;
  std::optional<DocumentDelimiter> delimiter_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_permutation_;

  // Prefetching: the producer fills `ready_` with the batches starting at row `produced_`.
  int prefetch_depth_ = 0;
  bool pin_memory_ = false;
  std::thread producer_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Batch> ready_;
  int64_t produced_ = 0;
  bool stopping_ = false;
  std::string producer_error_;
};

}  // namespace zb
