"""Where documents come from, end to end on the embedded corpus (data/python-docs: train/, val/,
meta.json; one process, 2 steps each)."""
import glob
import json
import re
import shutil

from conftest import CONFIGS, SOURCE, TRAIN_FSDP, run

DATA = SOURCE / "data" / "python-docs"
COMMON = ["--config", CONFIGS / "debug/quickstart.toml", "--model.vocab_size", "1024", "--train.micro_bs", "2",
          "--data.eval_interval", "0", "--data.val_dataset_name_or_paths", DATA / "val", "--optim.batch_size", "2",
          "--optim.total_steps", "2", "--optim.warmup_steps", "1", "--data.seq_length", "128",
          "--optim.optim.ns_dtype", "float32", "--ckpt.path", ""]


def trains(*args):
    """A run that must succeed: its output."""
    rc, out = run(TRAIN_FSDP, *COMMON, *args)
    assert rc == 0, f"exit code {rc}: {out}"
    return out


def test_from_meta():
    """make_shards' meta.json next to the shards says which token ends a document."""
    out = trains("--data.dataset_name_or_paths", DATA / "train")
    eos = json.load(open(DATA / "meta.json"))["eos"]
    assert f"attention: within documents, split after token {eos}" in out, f"no line naming the document token: {out}"


def test_no_delimiter(work):
    """Shards without meta.json: document attention refuses to start (exit 2, both ways out named);
    with data.document_token, or with causal attention, the same shards train."""
    for f in glob.glob(f"{DATA}/val/*.bin"):
        shutil.copy(f, work)
    shards = ["--data.dataset_name_or_paths", work]
    rc, out = run(TRAIN_FSDP, *COMMON, *shards)
    print("\n".join(out.splitlines()[-2:]))
    assert rc == 2, f"exit code {rc}, expected 2"
    assert re.search(r'model.attention = "document" needs the token that marks documents.*set data.document_token',
                     out), "message"
    out = trains(*shards, "--data.document_token", "0")
    assert "split after token 0" in out, f"token not used: {out}"
    out = trains(*shards, "--data.document_token", "0", "--data.document_token_position", "opens")
    assert "split before token 0" in out, f"position not used: {out}"
    trains(*shards, "--model.attention", "causal")
