"""Reads back what the tools for watching runs wrote (tests/e2e/test_watch.py), with the readers of the
packages that own the formats:

  watch_check.py tensorboard METRICS TB_DIR   every number of every record, exact, as float64 events
  watch_check.py wandb METRICS RUN_DIR        the same from the offline W&B run's history
  watch_check.py png FILE                     a real plot: large enough, and many colours
  watch_check.py sample TEXT HF_DIR           the samples are text the HF tokenizer round-trips
  watch_check.py make_inputs CORPUS OUT       OUT/parquet (files) and OUT/dataset (save_to_disk) of
                                              the same documents, from the corpus' val shards
  watch_check.py shards INPUTS OUT_PARQUET OUT_DATASET TOKENIZER
                                              both made the same shards, with every document's
                                              tokens (tokenizer's own encoding + EOS) in them
Exits 1 with a message on the first difference.
"""
import glob
import json
import os
import struct
import sys


def fail(text):
    sys.exit(f"watch_check: {text}")


def expected(metrics):
    """(step, tag) -> value for every number of every record: top-level numbers by name, the
    numbers of a nested object (lr, comm_bytes) as "object/key"; nulls, text and the step skipped."""
    out = {}
    for line in open(metrics):
        r = json.loads(line)
        for key, v in r.items():
            items = [(f"{key}/{k}", x) for k, x in v.items()] if isinstance(v, dict) else [(key, v)]
            for tag, x in items:
                if key != "step" and type(x) in (int, float):
                    out[(r["step"], tag)] = float(x)
    steps = {s for s, _ in out}
    if len(steps) < 2 or not any(t == "val_loss" for _, t in out) or not any(t.startswith("lr/") for _, t in out):
        fail(f"{metrics}: too little to check ({len(steps)} steps)")
    return out


def compare(want, got, where):
    missing = [k for k in want if k not in got]
    if missing:
        fail(f"{where}: {len(missing)} of {len(want)} values missing, e.g. {missing[:3]}")
    wrong = [(k, want[k], got[k]) for k in want if got[k] != want[k]]
    if wrong:
        fail(f"{where}: {len(wrong)} values differ, e.g. {wrong[:3]}")
    print(f"{where}: {len(want)} values over {len({s for s, _ in want})} steps, all exact")


def tensorboard(metrics, logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(logdir, size_guidance={"tensors": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["tensors"]:
        for e in acc.Tensors(tag):
            got[(e.step, tag)] = float(tensor_util.make_ndarray(e.tensor_proto))
    compare(expected(metrics), got, f"TensorBoard {logdir}")


def wandb_records(path):
    """The records of a W&B run file: its 7-byte header, then a LevelDB-style log of 32 KiB blocks
    (each chunk: crc32 4, length 2, type 1: full / first / middle / last) holding wandb's protobuf
    Records, decoded with the wandb package's own message class."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    if data[:4] != b":W&B":
        fail(f"{path}: not a W&B run file")
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too small for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb(metrics, run_dir):
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    if len(files) != 1:
        fail(f"expected one offline W&B run under {run_dir}/wandb, found {files}")
    got, config = {}, None
    for record in wandb_records(files[0]):
        if record.HasField("history"):
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step")
            for k, v in items.items():
                if not k.startswith("_"):
                    got[(step, k)] = float(v)
        if record.HasField("run") and record.run.config.update:
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    compare(expected(metrics), got, f"W&B {files[0]}")
    resolved = json.load(open(os.path.join(run_dir, "metrics.config.json")))
    if not config or config.get("model") != resolved["model"] or config.get("project") != resolved["project"]:
        fail(f"the W&B run's config is not the resolved run: {config}")
    print("W&B config: the resolved run (metrics.config.json)")


def png(path):
    import matplotlib.image
    import numpy as np
    size = os.path.getsize(path)
    image = matplotlib.image.imread(path)
    colours = len(np.unique(image.reshape(-1, image.shape[-1]), axis=0))
    print(f"{path}: {size} bytes, {image.shape[1]} x {image.shape[0]}, {colours} colours")
    if size < 20_000 or image.shape[0] < 400 or colours < 50:
        fail(f"{path} does not look like a plot of two runs")


def sample(text_file, hf_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = open(text_file).read()
    samples = [s.strip("\n") for s in text.split("--- sample")[1:]]
    if len(samples) != 2 or not all(s.split("\n", 1)[1].startswith("The ") for s in samples):
        fail(f"expected two samples continuing the prompt, got: {text!r}")
    for s in samples:
        body = s.split("\n", 1)[1]
        ids = tok.encode(body, add_special_tokens=False)
        if len(ids) < 10 or tok.decode(ids) != body:
            fail(f"sample does not round-trip through the tokenizer: {body!r}")
    print(f"{len(samples)} samples of {[len(s) for s in samples]} characters")


def documents_of(corpus):
    """The corpus' validation documents as text: its shards decoded, split at EOS."""
    import numpy as np
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(corpus, "tokenizer.json"))
    eos = json.load(open(os.path.join(corpus, "meta.json")))["eos"]
    tokens = np.concatenate([np.fromfile(f, dtype=np.uint16, offset=1024)
                             for f in sorted(glob.glob(os.path.join(corpus, "val", "*.bin")))])
    ends = np.flatnonzero(tokens == eos)
    docs = [tok.decode(tokens[a + 1:b].tolist()) for a, b in zip(np.r_[-1, ends[:-1]], ends)]
    return [d for d in docs if d][:60]


def make_inputs(corpus, out):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = documents_of(corpus)
    os.makedirs(os.path.join(out, "parquet", "part"), exist_ok=True)
    half = len(docs) // 2  # two files, one a level down, as fineweb-edu's directories
    pq.write_table(pa.table({"text": docs[:half], "id": list(range(half))}), os.path.join(out, "parquet", "a.parquet"))
    pq.write_table(pa.table({"text": docs[half:]}), os.path.join(out, "parquet", "part", "b.parquet"))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(os.path.join(out, "dataset"))
    json.dump(docs, open(os.path.join(out, "documents.json"), "w"))
    print(f"{len(docs)} documents as parquet files and as a saved dataset")


def shards(inputs, out_parquet, out_dataset, tokenizer):
    import numpy as np
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    docs = json.load(open(os.path.join(inputs, "documents.json")))
    for split in ("train", "val"):
        a = sorted(glob.glob(os.path.join(out_parquet, split, "*.bin")))
        b = sorted(glob.glob(os.path.join(out_dataset, split, "*.bin")))
        if [os.path.basename(f) for f in a] != [os.path.basename(f) for f in b] or \
                any(open(x, "rb").read() != open(y, "rb").read() for x, y in zip(a, b)):
            fail(f"{split}: the parquet directory and the saved dataset made different shards")
    meta = json.load(open(os.path.join(out_parquet, "meta.json")))
    if sum(meta["documents"].values()) != len(docs):
        fail(f"meta.json counts {meta['documents']} documents, the inputs have {len(docs)}")
    made = sorted(np.concatenate([np.fromfile(f, dtype=np.uint16, offset=1024)
                                  for s in ("train", "val") for f in sorted(glob.glob(os.path.join(out_parquet, s, "*.bin")))]
                                 ).tolist())
    want = sorted(t for d in docs for t in tok.encode(d, add_special_tokens=False).ids + [eos])
    if made != want:
        fail(f"the shards hold {len(made)} tokens, the documents encode to {len(want)} (or other ones)")
    if open(os.path.join(out_parquet, "tokenizer.json")).read() == "":
        fail("no tokenizer.json beside the shards")
    print(f"{len(docs)} documents, {len(made)} tokens, the same shards from both inputs")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
