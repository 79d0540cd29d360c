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
  if (config.data.fake) {
    out.train = std::make_shared<FakeDataset>(seed, T, V);
    out.validation = std::make_shared<FakeDataset>(seed + 1, T, V);
    return out;
  }
  if (config.data.dataset_ratio) {
    // Several datasets ("a,b") mixed by ratio ("70:30"; validate() checked the ratio).
    std::vector<std::shared_ptr<const SampleSource>> parts;
    const std::string& paths = config.data.dataset_name_or_paths;
    for (size_t start = 0, comma; start <= paths.size(); start = comma + 1) {
      comma = paths.find(',', start);
      if (comma == std::string::npos) comma = paths.size();
      parts.push_back(std::make_shared<TokenDataset>(paths.substr(start, comma - start), T, V,
                                                     config.data.reverse_data_files));
    }
    out.train = std::make_shared<MixedSource>(parts, parse_ratio(*config.data.dataset_ratio, parts.size()), seed);
  } else {
    out.train = std::make_shared<TokenDataset>(config.data.dataset_name_or_paths, T, V,
                                               config.data.reverse_data_files);
  }
  if (config.data.val_dataset_name_or_paths)
    out.validation = std::make_shared<TokenDataset>(*config.data.val_dataset_name_or_paths, T, V);
  return out;
}

}  // namespace zb
