#include "data/sources.h"

#include <string>
#include <vector>

#include "data/fake_data.h"
#include "data/token_dataset.h"

namespace zb {

DataSources make_data_sources(const Config& config, int64_t V) {
  const uint64_t seed = static_cast<uint64_t>(config.runtime.seed);
  const int64_t T = config.data.seq_length;
  DataSources out;
  const bool documents = config.model.attention == "document";
  if (config.data.fake) {
    out.train = std::make_shared<FakeDataset>(seed, T, V);
    out.validation = std::make_shared<FakeDataset>(seed + 1, T, V);
    if (documents) out.documents = DocumentDelimiter{FakeDataset::kEos, /*opens=*/false};
    return out;
  }
  if (config.data.dataset_ratio) {
    // Several datasets ("a,b") mixed by ratio ("70:30"; validate() checked the ratio).
    std::vector<std::shared_ptr<const SampleSource>> parts;
    for (const std::string& path : split_paths(config.data.dataset_name_or_paths))
      parts.push_back(std::make_shared<TokenDataset>(path, T, V, config.data.reverse_data_files));
    out.train = std::make_shared<MixedSource>(parts, parse_ratio(*config.data.dataset_ratio, parts.size()), seed);
  } else {
    out.train = std::make_shared<TokenDataset>(config.data.dataset_name_or_paths, T, V,
                                               config.data.reverse_data_files);
  }
  if (config.data.val_dataset_name_or_paths)
    out.validation = std::make_shared<TokenDataset>(*config.data.val_dataset_name_or_paths, T, V);
  if (documents) {
    out.documents = config.data.document_token
                        ? DocumentDelimiter{*config.data.document_token, config.data.document_token_position == "opens"}
                        : delimiter_from_meta(config.data.dataset_name_or_paths);
    if (!out.documents)
      throw ConfigError("model.attention = \"document\" needs the token that marks documents, and neither "
                        "data.document_token nor a meta.json next to " + config.data.dataset_name_or_paths +
                        " (make_shards writes one) gives it: set data.document_token (with "
                        "data.document_token_position = \"opens\" for llm.c's GPT-2 shards), or "
                        "model.attention = \"causal\"");
  }
  return out;
}

}  // namespace zb
