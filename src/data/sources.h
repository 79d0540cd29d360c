#pragma once
// The run's data as the config describes it: token shards (one dataset, or several mixed by
// ratio) or ZeroBand's fake documents, for training and, if configured, validation. Shards are
// opened and checked here, at start-up.
#include <memory>

#include "config/config.h"
#include "data/loader.h"

namespace zb {

struct DataSources {
  std::shared_ptr<const SampleSource> train;
  std::shared_ptr<const SampleSource> validation;  // null without validation data
};

// Rows of `seq_length` tokens (from data.seq_length) with tokens below `vocab_size`.
DataSources make_data_sources(const Config& config, int64_t vocab_size);

}  // namespace zb
