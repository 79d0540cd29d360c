#!/usr/bin/env python3
"""Generates text from a trained model, to read what it has learnt: a checkpoint of train_fsdp /
train_ddp (exported to Hugging Face format first, with build/apps/export_hf) or an exported
directory, loaded with transformers, prompted and decoded with the tokenizer the run trained with
(checkpoints keep the tokenizer.json of their data; export_hf passes it on).

  sample.py outputs/ckpt/step_000150 --prompt "The " [-n 3 --max-new-tokens 100 --temperature 0.8 --top-k 50]
  sample.py hf_dir --prompt "def "          # a directory export_hf wrote
  sample.py ckpt_dir --tokenizer data/corpus/tokenizer.json   # a checkpoint without one (older runs)

Sampling is seeded (--seed), so the same command prints the same samples.
"""
import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/watch/ -> the repository


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="CHECKPOINT_OR_HF_DIR")
    ap.add_argument("--prompt", default="", help="the text to continue (default: from the start of a document)")
    ap.add_argument("-n", "--num-samples", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="a tokenizer.json, where the model directory has none")
    ap.add_argument("--export-hf", default=os.path.join(ROOT, "build", "apps", "export_hf"),
                    help="the export_hf binary, for checkpoints")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    model_dir, tmp = args.model, None
    if os.path.exists(os.path.join(args.model, "meta.json")):  # one of our checkpoints
        tmp = tempfile.TemporaryDirectory(prefix="sample-")
        model_dir = tmp.name
        done = subprocess.run([args.export_hf, args.model, model_dir], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"sample: export_hf failed on {args.model}:\n{done.stderr.strip()}")
    elif not os.path.exists(os.path.join(args.model, "config.json")):
        sys.exit(f"sample: {args.model} is neither a checkpoint (meta.json) nor a Hugging Face model (config.json)")

    if args.tokenizer:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer)
    elif os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        sys.exit(f"sample: {args.model} has no tokenizer (a run on fake data, or on shards without a "
                 "tokenizer.json beside them): give the one its data were made with, --tokenizer FILE")

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    # The end-of-text token closes each document in training, so a prompt starts after one.
    start = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = torch.tensor([start + tokenizer.encode(args.prompt, add_special_tokens=False)])
    if ids.shape[1] == 0:
        sys.exit("sample: give a --prompt (the tokenizer has no end-of-text token to start from)")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=args.temperature, top_k=args.top_k,
                             max_new_tokens=args.max_new_tokens, num_return_sequences=args.num_samples,
                             pad_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
    for i, seq in enumerate(out):
        text = tokenizer.decode(seq[len(start):], skip_special_tokens=True)
        print(f"--- sample {i + 1} of {args.num_samples}" if args.num_samples > 1 else "---")
        print(text)
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
