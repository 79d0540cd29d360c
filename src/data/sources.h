#pragma once
// The run's data as the config describes it: token shards (one dataset, or several mixed by
// ratio) or ZeroBand's fake documents, for training and, if configured, validation. Shards are
// opened and checked here, at start-up.
#include <memory>
#include <optional>

#include "config/config.h"
#include "data/documents.h"
#include "data/loader.h"

namespace zb {

struct DataSources {
  std::shared_ptr<const SampleSource> train;
  std::shared_ptr<const SampleSource> validation;  // null without validation data
  // With model.attention = "document": the token that marks documents (fake data: its EOS,
  // closing; shards: data.document_token, else their meta.json).
  std::optional<DocumentDelimiter> documents;
};

// Rows of `seq_length` tokens (from data.seq_length) with tokens below `vocab_size`. Throws
// ConfigError when document attention is asked for and nothing says how documents are marked.
DataSources make_data_sources(const Config& config, int64_t vocab_size);

}  // namespace zb
