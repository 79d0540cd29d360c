"""Watching runs, end to end with the real programs (tests/reference/watch_check.py reads back with
the readers of the packages that own the formats; the corpus is data/python-docs):

follower  a 20-step run with wandb = true and logging.tensorboard_dir (W&B offline): rank 0's
          follower turns every record into TensorBoard events and a W&B run, read back with
          tensorboard's event reader and wandb's own record reader, every scalar of every step
          exact; the follower run again after the fact gives the same events.
resumed   a run resumed from a checkpoint appends to its metrics: its follower reads past the
          earlier run's final step to the new records, and continues the same W&B run.
no_wandb  wandb = true where the follower's Python has no wandb: one warning, training goes on.
plot      plot_runs.py draws two runs into one PNG.
sample    sample.py generates from a checkpoint of the quick start and from its HF export with the
          tokenizer the checkpoint kept: the same text both ways.
shards    make_shards on a directory of parquet files and on a saved `datasets` dataset (the same
          documents: the same shards), and train_fsdp on the parquet directory names the
          make_shards command.
"""
import filecmp
import gzip
import json
import shutil
import subprocess

from conftest import CONFIGS, EXPORT_HF, PYTHON, REFERENCE, SOURCE, TRAIN_FSDP, run, text_of, wait_for

DATA = SOURCE / "data" / "python-docs"
RUN = ["--config", CONFIGS / "debug/quickstart.toml", "--train.micro_bs", "4", "--optim.batch_size", "4",
       "--data.seq_length", "128", "--optim.total_steps", "20", "--optim.warmup_steps", "2", "--data.eval_interval", "10",
       "--optim.optim.ns_dtype", "float32", "--runtime.num_threads", "1",
       "--data.dataset_name_or_paths", DATA / "train", "--data.val_dataset_name_or_paths", DATA / "val"]
OFFLINE = {"WANDB_MODE": "offline"}


def check(*args):
    """tests/reference/watch_check.py CHECK ARGS...: passes or names the first difference."""
    assert subprocess.run([PYTHON, REFERENCE / "watch_check.py", *map(str, args)]).returncode == 0, \
        f"watch_check {args}"


def trains(*args, env=None):
    """A run that must succeed: its output."""
    rc, out = run(TRAIN_FSDP, *RUN, *args, env=env)
    assert rc == 0, f"run (exit {rc}): {out[-3000:]}"
    return out


def wait_follower(folder):
    """The follower is detached: waits for its last line in the log beside the metrics."""
    log = folder / "follower.log"
    assert wait_for(lambda: "follow_metrics: done" in text_of(log), 120, 0.5), \
        f"the follower did not finish within 120 s:\n{text_of(log)}"
    return log.read_text()


def test_follower(work):
    out = trains("--wandb", "true", "--logging.tensorboard_dir", work / "tb", "--logging.metrics_file",
                 work / "run/metrics.jsonl", "--ckpt.path", "", env=OFFLINE)
    lines = [line for line in out.splitlines() if "metrics follower" in line]
    print("\n".join(lines))
    assert lines, "no line about the follower"
    print(wait_follower(work / "run"))
    check("tensorboard", work / "run/metrics.jsonl", work / "tb")
    check("wandb", work / "run/metrics.jsonl", work / "run")
    after = subprocess.run([PYTHON, SOURCE / "scripts/watch/follow_metrics.py", work / "run/metrics.jsonl",
                            "--tensorboard", work / "tb2"])
    assert after.returncode == 0, "after the fact"
    check("tensorboard", work / "run/metrics.jsonl", work / "tb2")


def test_resumed(work):
    both = ["--wandb", "true", "--logging.tensorboard_dir", work / "tb", "--logging.metrics_file",
            work / "run/metrics.jsonl", "--optim.total_steps", "6", "--data.eval_interval", "3", "--ckpt.path",
            work / "ckpt", "--ckpt.interval", "3", "--ckpt.keep", "0"]
    trains(*both, env=OFFLINE)
    log = wait_follower(work / "run")
    assert "done, 6 records" in log, f"first follower: {log}"
    first_id = (work / "run/metrics.wandb_id").read_text()
    shutil.move(work / "run/follower.log", work / "first_follower.log")
    trains(*both, "--ckpt.resume", work / "ckpt/step_00000003", env=OFFLINE)
    log = wait_follower(work / "run")
    print(log)
    # 6 records of the first run, then steps 4-6 again: 9, not a stop at the first run's step 6.
    assert "done, 9 records" in log, "the resumed run's follower stopped early"
    assert (work / "run/metrics.wandb_id").read_text() == first_id, "a new W&B run for the resumed training"
    assert f"({first_id.strip()})" in log, f"the follower did not continue W&B run {first_id}"


def test_no_wandb(work):
    # The same Python without its site-packages: no wandb there.
    python = work / "python-without-wandb"
    python.write_text(f'#!/bin/sh\nexec "{PYTHON}" -S "$@"\n')
    python.chmod(0o755)
    out = trains("--optim.total_steps", "4", "--wandb", "true", "--logging.metrics_file", work / "run/metrics.jsonl",
                 "--ckpt.path", "", env={"ZB_PYTHON": python})
    assert "done: 4 steps" in out, f"training did not finish: {out}"
    log = work / "run/follower.log"
    wait_for(lambda: "wandb is not installed" in text_of(log), 30, 0.5)
    warning = [line for line in text_of(log).splitlines() if "warning: wandb is not installed" in line]
    print("\n".join(warning))
    assert warning, "no warning in the follower's log"
    assert "warning: wandb is not installed" in out, "no warning on the trainer's stderr"


def test_plot(work):
    for lr in ("0.02", "0.01"):
        trains("--optim.total_steps", "6", "--data.eval_interval", "3", "--wandb", "false", "--optim.optim.lr", lr,
               "--logging.metrics_file", work / f"lr{lr}/metrics.jsonl", "--ckpt.path", "")
    plot = subprocess.run([PYTHON, SOURCE / "scripts/watch/plot_runs.py", work / "lr0.02", work / "lr0.01/metrics.jsonl",
                           "-o", work / "runs.png", "--log-loss"])
    assert plot.returncode == 0, "plot_runs"
    check("png", work / "runs.png")


def test_sample(work):
    trains("--wandb", "false", "--ckpt.path", work / "ckpt", "--logging.metrics_file", work / "run/metrics.jsonl")
    ckpt = work / "ckpt" / (work / "ckpt/latest").read_text().strip()
    assert filecmp.cmp(ckpt / "tokenizer.json", DATA / "tokenizer.json", shallow=False), \
        "the checkpoint did not keep the data's tokenizer"
    assert subprocess.run([EXPORT_HF, ckpt, work / "hf"]).returncode == 0, "export_hf"
    sample = ["--prompt", "The ", "-n", "2", "--max-new-tokens", "30", "--seed", "3"]
    script = SOURCE / "scripts/watch/sample.py"
    from_ckpt = subprocess.run([PYTHON, script, ckpt, *sample, "--export-hf", EXPORT_HF], stdout=subprocess.PIPE)
    assert from_ckpt.returncode == 0, "sample.py on the checkpoint"
    from_hf = subprocess.run([PYTHON, script, work / "hf", *sample], stdout=subprocess.PIPE)
    assert from_hf.returncode == 0, "sample.py on the export"
    print(from_ckpt.stdout.decode())
    assert from_ckpt.stdout == from_hf.stdout, "different samples from the checkpoint and its export"
    (work / "from_ckpt.txt").write_bytes(from_ckpt.stdout)
    check("sample", work / "from_ckpt.txt", work / "hf")


def test_shards(work):
    check("make_inputs", DATA, work / "in")  # parquet files and a saved dataset of the same documents
    for kind in ("parquet", "dataset"):
        rc, out = run(PYTHON, SOURCE / "scripts/data/make_shards.py", work / f"out-{kind}", work / "in" / kind,
                      "--tokenizer", DATA / "tokenizer.json", "--val-fraction", "0.1", "--shard-tokens", "20000")
        assert rc == 0, f"make_shards {kind}: {out[-2000:]}"
        print(([line for line in out.splitlines() if "tokens/s" in line] or [""])[-1])
    check("shards", work / "in", work / "out-parquet", work / "out-dataset", DATA / "tokenizer.json")
    rc, out = run(TRAIN_FSDP, *RUN, "--wandb", "false", "--data.dataset_name_or_paths", work / "in/parquet",
                  "--ckpt.path", "")
    assert rc != 0, "trained on a parquet directory"
    print("\n".join(out.splitlines()[-4:]))
    assert f"scripts/data/make_shards.py {work}/in/parquet-shards {work}/in/parquet --tokenizer" in out, \
        "no make_shards command in the error"
    # What is not text stays out of the shards: hidden files are left out, a compressed one refused;
    # and so are settings and inputs that would make no dataset.
    bad = work / "bad"
    (bad / "dir/.cache").mkdir(parents=True)
    (bad / "dir/doc.txt").write_text("one document\n")
    (bad / "dir/.gitattributes").write_text("*.parquet filter=lfs\n")
    (bad / "dir/.cache/state").write_bytes(b"\x00\x01")
    (bad / "docs.jsonl.gz").write_bytes(gzip.compress(b'{"text": "compressed"}\n' * 50))
    (bad / "empty.jsonl").write_text("")
    (bad / "null.jsonl").write_text('{"text": null}\n')
    shards = [PYTHON, SOURCE / "scripts/data/make_shards.py"]
    tokenizer = ["--tokenizer", DATA / "tokenizer.json"]
    rc, out = run(*shards, bad / "out", bad / "dir", *tokenizer, "--val-fraction", "0")
    assert rc == 0 and json.loads((bad / "out/meta.json").read_text())["documents"] == {"train": 1, "val": 0}, out
    for args, error in (((bad / "docs.jsonl.gz",), "docs.jsonl.gz is not UTF-8 text (compressed or binary?)"),
                        ((bad / "dir", "--shard-tokens", "0"), "--shard-tokens must be in [1, 2^31), got 0"),
                        ((bad / "empty.jsonl",), "no training text in"),
                        ((bad / "null.jsonl",), 'null.jsonl:1: "text" is NoneType, not a string')):
        rc, out = run(*shards, bad / "refused", *args, *tokenizer)
        assert rc != 0 and error in out, f"make_shards {args}: exit {rc}: {out[-1000:]}"
