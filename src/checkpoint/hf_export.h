#pragma once
// Hugging Face format: a consolidated model.safetensors plus config.json that transformers'
// LlamaForCausalLM loads (MixtralForCausalLM for a mixture of experts Mixtral can hold: its
// router's weight is block_sparse_moe.gate, each expert's w1/w2/w3 a tensor of its own), and the
// way back.
//
// Names: tok_embeddings -> model.embed_tokens, layers.i.attention.w{q,k,v,o} ->
// model.layers.i.self_attn.{q,k,v,o}_proj, feed_forward.w1/w2/w3 -> mlp.gate_proj/down_proj/
// up_proj, attention_norm -> input_layernorm, ffn_norm -> post_attention_layernorm, norm ->
// model.norm, output -> lm_head.
// RoPE: our rotation pairs adjacent features (2i, 2i+1) of a head; Hugging Face's pairs i with
// i + head_dim/2 ("rotate half"). Exporting reorders the rows of every head of wq and wk so that
// row 2i goes to i and row 2i+1 to i + head_dim/2; importing undoes it.
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "model/model_args.h"

namespace zb {

using TensorMap = std::map<std::string, at::Tensor>;  // our parameter names -> full fp32 tensors

// The full parameters stored in a sharded checkpoint (any world size), and its model's shapes.
TensorMap consolidate_checkpoint(const std::string& ckpt_dir, ModelArgs* args);

// Writes OUT/model.safetensors (fp32, tensors in name order) and OUT/config.json.
void write_hf_model(const std::string& out_dir, const ModelArgs& args, const TensorMap& params);
// Copies a checkpoint's tokenizer.json into OUT with a tokenizer_config.json, so that
// transformers' AutoTokenizer loads it (its end/beginning-of-text tokens by make_shards' names).
void write_hf_tokenizer(const std::string& tokenizer_json, const std::string& out_dir, int64_t max_length);
// Reads such a directory back into our names and layout; fills `args` from config.json.
TensorMap read_hf_model(const std::string& dir, ModelArgs* args);

// The RoPE row reordering for one [heads * head_dim, in] matrix, and its inverse.
at::Tensor rope_rows_to_hf(const at::Tensor& w, int64_t heads);
at::Tensor rope_rows_from_hf(const at::Tensor& w, int64_t heads);

}  // namespace zb
