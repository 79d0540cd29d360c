#include "data/documents.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <stdexcept>

#include "util/fs.h"

namespace zb {

void append_document_bounds(const int64_t* row, int64_t T, const DocumentDelimiter& delimiter,
                            std::vector<int32_t>& cu, int64_t& max_len) {
  const int64_t row_start = cu.back();
  int64_t piece_start = row_start;
  for (int64_t p = 1; p < T; ++p) {
    // A piece ends before position p when p's token opens a document or p - 1's closes one.
    const bool cut = delimiter.opens ? row[p] == delimiter.token : row[p - 1] == delimiter.token;
    if (!cut) continue;
    cu.push_back(static_cast<int32_t>(row_start + p));
    max_len = std::max(max_len, row_start + p - piece_start);
    piece_start = row_start + p;
  }
  cu.push_back(static_cast<int32_t>(row_start + T));
  max_len = std::max(max_len, row_start + T - piece_start);
}

namespace {

std::optional<DocumentDelimiter> read_meta(const std::string& file) {
  std::ifstream in(file);
  if (!in) return std::nullopt;
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(file + ": not valid JSON (" + e.what() + ")");
  }
  DocumentDelimiter d;
  const char* key = meta.contains("document_token") ? "document_token" : "eos";
  if (!meta.contains(key) || meta[key].is_null()) return std::nullopt;
  if (!meta[key].is_number_integer() || meta[key].get<int64_t>() < 0)
    throw std::runtime_error(file + ": \"" + key + "\" must be a token id, got " + meta[key].dump());
  d.token = meta[key].get<int64_t>();
  const std::string position = meta.value("document_token_position", std::string("closes"));
  if (position != "opens" && position != "closes")
    throw std::runtime_error(file + ": \"document_token_position\" must be \"opens\" or \"closes\", got \"" +
                             position + "\"");
  d.opens = position == "opens";
  return d;
}

}  // namespace

std::vector<std::string> split_paths(const std::string& paths) {
  std::vector<std::string> out;
  for (size_t start = 0, comma; start <= paths.size(); start = comma + 1) {
    comma = paths.find(',', start);
    if (comma == std::string::npos) comma = paths.size();
    out.push_back(paths.substr(start, comma - start));
  }
  return out;
}

std::vector<std::string> beside_dataset(std::string path, const std::string& name) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();  // "dir/"
  const std::string dir = is_directory(path) ? path : parent_directory(path);
  const std::string up = parent_directory(dir.empty() ? "." : dir);
  return {(dir.empty() ? "" : dir + "/") + name, (up.empty() ? "" : up + "/") + name};
}

std::string tokenizer_of_dataset(const std::string& paths) {
  if (paths.empty()) return "";
  for (const std::string& candidate : beside_dataset(split_paths(paths).front(), "tokenizer.json"))
    if (path_exists(candidate)) return candidate;
  return "";
}

std::optional<DocumentDelimiter> delimiter_from_meta(const std::string& paths) {
  std::optional<DocumentDelimiter> found;
  std::string found_in;
  for (const std::string& path : split_paths(paths)) {
    for (const std::string& candidate : beside_dataset(path, "meta.json")) {
      std::optional<DocumentDelimiter> d = read_meta(candidate);
      if (!d) continue;
      if (found && (found->token != d->token || found->opens != d->opens))
        throw std::runtime_error(candidate + " and " + found_in +
                                 " mark documents differently (token or position)");
      found = d;
      found_in = candidate;
      break;
    }
  }
  return found;
}

}  // namespace zb
