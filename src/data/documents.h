#pragma once
// Where documents begin and end in packed rows, for document-causal attention
// (model/attention.h).
//
// Documents are packed back to back into the token stream, marked by one token: either after
// each document's last token ("closes": make_shards writes <|endoftext|> there; ZeroBand's fake
// data uses EOS = 1) or before each document's first ("opens": llm.c's GPT-2 shards put
// <|endoftext|> there). A closing token belongs to the document it closes; an opening one to the
// document it opens. Every row is cut on its own: a document that runs from one row into the next
// is a piece of each.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zb {

struct DocumentDelimiter {
  int64_t token = -1;
  bool opens = false;  // false: the token closes a document
};

// Appends to `cu` (cumulative lengths, starting with 0 before the first row) the ends of the
// pieces of one row of `T` input tokens, and raises `max_len` to the longest.
void append_document_bounds(const int64_t* row, int64_t T, const DocumentDelimiter& delimiter,
                            std::vector<int32_t>& cu, int64_t& max_len);

// The delimiter of token shards from the meta.json that make_shards writes next to them: in a
// directory named by `paths` (comma-separated) or in its parent (OUT/meta.json for OUT/train).
// "document_token" and "document_token_position" ("opens" or "closes") where present, else
// "eos", which closes. nullopt when no meta.json says; throws std::runtime_error naming the file
// when one is unreadable or two disagree.
std::optional<DocumentDelimiter> delimiter_from_meta(const std::string& paths);

// "a,b,c" -> {"a", "b", "c"}: the dataset paths of data.dataset_name_or_paths.
std::vector<std::string> split_paths(const std::string& paths);

// Where a dataset's companion files (meta.json, tokenizer.json) are looked for: the shards'
// directory, then its parent (make_shards writes them in OUT, the shards in OUT/train and OUT/val).
std::vector<std::string> beside_dataset(std::string path, const std::string& name);
// The tokenizer the first dataset of `paths` was made with ("" if none is found or no paths).
std::string tokenizer_of_dataset(const std::string& paths);

}  // namespace zb
