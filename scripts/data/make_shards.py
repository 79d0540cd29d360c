#!/usr/bin/env python3
"""Turn raw text into token shards for train_fsdp.

    make_shards.py OUT INPUT... [--tokenizer tokenizer.json | --train-vocab N]
                   [--val-fraction 0.01] [--shard-tokens 10000000] [--bos]

INPUT: files or directories (searched recursively, hidden ones left out), as datasets are kept: by
extension, .jsonl/.json are JSON lines with a "text" field (one document per line); .parquet has a
"text" column (fineweb-edu's layout: a directory of parquet files); anything else is UTF-8 text,
one document per file (a file with NUL bytes or much that is not UTF-8, compressed or binary, is
refused, named). A directory that a Hugging Face `datasets` dataset was saved to (save_to_disk) is
read with datasets.load_from_disk: its "text" column, every split in turn.

Tokenizer: a Hugging Face tokenizer.json (e.g. the Mistral/Llama-2 one), or, with --train-vocab,
a byte-level BPE of that vocabulary size trained on the inputs themselves; either way it is kept
as OUT/tokenizer.json, which checkpoints of runs on these shards copy (for sampling and export). Documents are separated by the end-of-text token (plus a beginning token
with --bos). A deterministic --val-fraction of the documents goes to OUT/val, the rest to
OUT/train, in shards of --shard-tokens tokens, in llm.c's format: a 256 x int32 header (magic
20240520 and version 1 for uint16 tokens, 20240801 and 7 for uint32; then the token count) and
the tokens. OUT/meta.json records the counts and the token that ends each document (train_fsdp
reads it for attention within documents). Encoding uses every core (the tokenizers library
encodes each batch of documents in parallel); a progress bar shows documents and tokens/s.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

EOS = "<|endoftext|>"
BOS = "<|begin_of_text|>"


def is_saved_dataset(directory):
    # What datasets' save_to_disk leaves: dataset_dict.json (several splits) or state.json with
    # dataset_info.json (one).
    has = lambda name: os.path.exists(os.path.join(directory, name))
    return has("dataset_dict.json") or (has("state.json") and has("dataset_info.json"))


def iter_files(inputs):
    """Files to read, in a stable order (depth first, names sorted at each level: a directory's
    files, then its subdirectories'); a saved `datasets` dataset comes as its directory."""
    for item in inputs:
        if os.path.isdir(item):
            for root, dirs, files in os.walk(item):
                # Hidden ones (.git, .cache, .gitattributes: a download's bookkeeping) hold no text.
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                if is_saved_dataset(root):
                    dirs[:] = []  # its files are the dataset's, read as one
                    yield root
                    continue
                for name in sorted(files):
                    if not name.startswith("."):
                        yield os.path.join(root, name)
        elif os.path.exists(item):
            yield item
        else:
            sys.exit(f"make_shards: input {item} does not exist")


def iter_saved_dataset(directory):
    try:
        import datasets
    except ImportError:
        sys.exit(f"make_shards: {directory} is a saved Hugging Face dataset; reading it needs the "
                 "datasets package (pip install datasets)")
    loaded = datasets.load_from_disk(directory)
    splits = loaded.values() if isinstance(loaded, datasets.DatasetDict) else [loaded]
    for split in splits:
        if "text" not in split.column_names:
            sys.exit(f"make_shards: {directory}: no \"text\" column (it has {split.column_names})")
        for batch in split.select_columns(["text"]).iter(batch_size=1000):
            yield from batch["text"]


def iter_documents(inputs):
    for path in iter_files(inputs):
        if os.path.isdir(path):
            yield from iter_saved_dataset(path)
        elif path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            text = json.loads(line)["text"]
                        except (ValueError, KeyError, TypeError) as e:
                            sys.exit(f"make_shards: {path}:{n}: not a JSON object with \"text\" ({e!r})")
                        if not isinstance(text, str):
                            sys.exit(f"make_shards: {path}:{n}: \"text\" is {type(text).__name__}, not a string")
                        yield text
        elif path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                sys.exit("make_shards: reading parquet needs pyarrow (pip install pyarrow)")
            # A batch of rows at a time: a parquet file may hold gigabytes of text.
            for batch in pq.ParquetFile(path).iter_batches(columns=["text"], batch_size=10_000):
                yield from batch.column("text").to_pylist()
        else:
            yield plain_text(path)


def plain_text(path):
    """A text file's contents; a file that is not text (NUL bytes, or more than 1% of it not UTF-8:
    compressed or binary) ends the run, named, rather than going into the shards as garbage."""
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", errors="replace")
    if b"\x00" in data or text.count("\ufffd") > max(8, len(text) // 100):
        sys.exit(f"make_shards: {path} is not UTF-8 text (compressed or binary?): decompress it, or leave it out")
    return text


def train_tokenizer(documents, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def special_id(tok, names):
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


class ShardWriter:
    def __init__(self, directory, shard_tokens, wide):
        self.dir, self.shard_tokens, self.wide = directory, shard_tokens, wide
        self.buf, self.count, self.files, self.tokens = [], 0, 0, 0
        os.makedirs(directory, exist_ok=True)

    def add(self, ids):
        self.buf.append(np.asarray(ids, dtype=np.uint32 if self.wide else np.uint16))
        self.count += len(ids)
        while self.count >= self.shard_tokens:
            self.flush(self.shard_tokens)

    def flush(self, n=None):
        if not self.buf:
            return
        allt = np.concatenate(self.buf)
        n = len(allt) if n is None else n
        head, rest = allt[:n], allt[n:]
        header = np.zeros(256, dtype=np.int32)
        header[0], header[1], header[2] = (20240801, 7, n) if self.wide else (20240520, 1, n)
        path = os.path.join(self.dir, f"shard_{self.files:06d}.bin")
        with open(path + ".tmp", "wb") as f:
            f.write(header.tobytes())
            f.write(head.tobytes())
        os.replace(path + ".tmp", path)  # never leave a half-written shard under its name
        self.files += 1
        self.tokens += n
        self.buf, self.count = ([rest], len(rest)) if len(rest) else ([], 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--tokenizer", help="Hugging Face tokenizer.json")
    ap.add_argument("--train-vocab", type=int, help="train a byte-level BPE of this vocabulary size")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--shard-tokens", type=int, default=10_000_000)
    ap.add_argument("--bos", action="store_true", help="also put the beginning token before each document")
    ap.add_argument("--batch", type=int, default=1024, help="documents encoded together (in parallel)")
    args = ap.parse_args()
    if bool(args.tokenizer) == bool(args.train_vocab):
        sys.exit("make_shards: give exactly one of --tokenizer and --train-vocab")
    if not 1 <= args.shard_tokens < 2**31:  # the header's count is an int32
        sys.exit(f"make_shards: --shard-tokens must be in [1, 2^31), got {args.shard_tokens}")
    if not 0 <= args.val_fraction < 1:
        sys.exit(f"make_shards: --val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.batch < 1:
        sys.exit(f"make_shards: --batch must be at least 1, got {args.batch}")

    os.makedirs(args.out, exist_ok=True)
    if args.train_vocab:
        tok = train_tokenizer(iter_documents(args.inputs), args.train_vocab)
    else:
        tok = Tokenizer.from_file(args.tokenizer)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    eos = special_id(tok, [EOS, "</s>", "<|end_of_text|>", "<eos>"])
    bos = special_id(tok, [BOS, "<s>", "<bos>"])
    if eos is None:
        sys.exit("make_shards: the tokenizer has no end-of-text token")
    if args.bos and bos is None:
        sys.exit("make_shards: --bos but the tokenizer has no beginning token")
    vocab = tok.get_vocab_size()
    wide = vocab > 65536
    writers = {s: ShardWriter(os.path.join(args.out, s), args.shard_tokens, wide) for s in ("train", "val")}
    counts = {"train": 0, "val": 0}
    start, batch = time.time(), []
    progress = tqdm(unit=" documents", desc="make_shards", file=sys.stderr, mininterval=1)

    def encode(batch):
        for index, text, enc in zip((i for i, _ in batch), (t for _, t in batch),
                                    tok.encode_batch([t for _, t in batch], add_special_tokens=False)):
            ids = ([bos] if args.bos else []) + enc.ids + [eos]
            # A document's split depends on its position only: reruns give the same split.
            h = int(hashlib.sha256(str(index).encode()).hexdigest()[:8], 16) / 2**32
            split = "val" if h < args.val_fraction else "train"
            writers[split].add(ids)
            counts[split] += 1
        rate = sum(w.tokens + w.count for w in writers.values()) / max(1e-9, time.time() - start)
        progress.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
        progress.update(len(batch))

    for i, text in enumerate(iter_documents(args.inputs)):
        batch.append((i, text))
        if len(batch) == args.batch:
            encode(batch)
            batch = []
    if batch:
        encode(batch)
    for w in writers.values():
        w.flush()
    progress.close()
    seconds = time.time() - start
    total = sum(w.tokens for w in writers.values())
    print(f"make_shards: {total:,} tokens in {seconds:.1f} s, {total / max(seconds, 1e-9):,.0f} tokens/s "
          f"({os.cpu_count()} cores)", file=sys.stderr)
    # document_token / document_token_position: how train_fsdp finds documents (its default
    # attention is within documents): the end-of-text token after each one.
    meta = {"vocab_size": vocab, "eos": eos, "bos": bos if args.bos else None,
            "document_token": eos, "document_token_position": "closes",
            "documents": counts, "tokens": {s: w.tokens for s, w in writers.items()},
            "shards": {s: w.files for s, w in writers.items()}}
    if writers["train"].tokens == 0:
        sys.exit(f"make_shards: no training text in {' '.join(args.inputs)} ({counts['train']} documents): nothing "
                 "to train on")
    if writers["val"].tokens == 0 and args.val_fraction > 0:
        print(f"make_shards: warning: none of the {sum(counts.values())} documents fell in val (--val-fraction "
              f"{args.val_fraction}): OUT/val is empty, which train_fsdp refuses as a held-out set", file=sys.stderr)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"make_shards: {json.dumps(meta)}")


if __name__ == "__main__":
    main()
