// export_hf: a sharded checkpoint (from any number of ranks) as a Hugging Face model directory
// (model.safetensors + config.json) that transformers' LlamaForCausalLM loads, and the run's
// tokenizer where the checkpoint has one (AutoTokenizer loads it).
//
//   export_hf CHECKPOINT_DIR OUT_DIR [--check-logits]
//
// --check-logits also writes OUT_DIR/check_tokens.bin (int64) and check_logits.bin (fp32): our
// model's logits on a fixed token sequence, for comparing with transformers; and the same with
// attention within documents: check_documents.bin (int32 cumulative lengths, as the loader's)
// and check_logits_documents.bin.
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/tensor.h>
#include <ATen/core/grad_mode.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/hf_export.h"
#include "model/llama.h"
#include "util/fs.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: export_hf CHECKPOINT_DIR OUT_DIR [--check-logits]\n");
    return 2;
  }
  try {
    zb::ModelArgs args;
    const zb::TensorMap params = zb::consolidate_checkpoint(argv[1], &args);
    zb::write_hf_model(argv[2], args, params);
    std::printf("export_hf: %zu tensors of %s written to %s\n", params.size(), argv[1], argv[2]);
    const std::string tokenizer = std::string(argv[1]) + "/tokenizer.json";
    if (zb::path_exists(tokenizer)) {
      zb::write_hf_tokenizer(tokenizer, argv[2], args.max_seq_len);
      std::printf("export_hf: the run's tokenizer too (tokenizer.json, tokenizer_config.json)\n");
    }
    if (argc > 3 && std::string(argv[3]) == "--check-logits") {
      zb::Llama model(args, at::TensorOptions());
      at::NoGradGuard no_grad;
      for (const auto& p : model.parameters()) p.slot->copy_(params.at(p.name));
      const int64_t T = std::min<int64_t>(16, args.max_seq_len);
      at::Tensor tokens = ((at::arange(T, at::kLong) * 7 + 3) % args.vocab_size).unsqueeze(0);
      at::Tensor logits = model.forward(tokens).contiguous();
      // Three documents of 5, 1 and the rest of the tokens.
      const at::Tensor cu = at::tensor(std::vector<int32_t>{0, 5, 6, static_cast<int32_t>(T)}, at::kInt);
      const zb::Documents documents = zb::make_documents(cu, T - 6, T, at::kCPU, at::kFloat, /*flash=*/false);
      at::Tensor masked = model.forward(tokens, documents).contiguous();
      const std::string out = argv[2];
      auto write = [&](const std::string& name, const at::Tensor& t) {
        std::ofstream(out + "/" + name, std::ios::binary)
            .write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
      };
      write("check_tokens.bin", tokens);
      write("check_logits.bin", logits);
      write("check_documents.bin", cu);
      write("check_logits_documents.bin", masked);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "export_hf: %s\n", e.what());
    return 1;
  }
  return 0;
}
