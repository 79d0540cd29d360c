"""Checkpoints end to end with real processes: exact resumes on the same and other world sizes and
engines (train_fsdp, train_ddp, hybrid sharding), a stop by signal, a kill inside a save, refused
checkpoints and Hugging Face directories, the Hugging Face export and its round trip."""
import filecmp
import json
import os
import re
import shutil
import subprocess

from conftest import (EXPORT_HF, SMALL, TRAIN_DDP, TRAIN_FSDP, compare_losses, digest, hf_logits_match, run,
                      run_ranks, start_ranks, text_of, wait_for)


def steps_in(folder):
    return sorted(f for f in os.listdir(folder) if f.startswith("step_"))


def saved_at_4(work, world, program=TRAIN_FSDP, name="a"):
    """A straight run that saves at step 4 (of 8) into work/name, its metrics in work/name.jsonl."""
    return run_ranks(world, work / f"{name}.log", *SMALL, "--ckpt.path", work / name, "--ckpt.interval", "4",
                     "--ckpt.keep", "0", "--logging.metrics_file", work / f"{name}.jsonl", program=program)


def test_exact_resume(work):
    saved_at_4(work, 2)
    run_ranks(2, work / "b.log", *SMALL, "--ckpt.path", work / "b", "--ckpt.resume", work / "a/step_00000004",
              "--logging.metrics_file", work / "b.jsonl")
    compare_losses(work / "a.jsonl", work / "b.jsonl", 0, "saved at step 4 on 2 ranks, resumed on 2")


def test_other_world_size(work):
    saved_at_4(work, 4)
    for w in (2, 3):
        run_ranks(w, work / f"r{w}.log", *SMALL, "--ckpt.path", work / f"r{w}", "--ckpt.resume",
                  work / "a/step_00000004", "--logging.metrics_file", work / f"r{w}.jsonl")
        # fp32, different summation order only.
        compare_losses(work / "a.jsonl", work / f"r{w}.jsonl", 1e-4, f"saved on 4 ranks, resumed on {w}")
    # At half the batch (24 rows a step, then 12): the data go on from the checkpoint's stream row
    # (4 x 24), not from the step count at the new batch (4 x 12), as the next checkpoint records.
    run_ranks(2, work / "half.log", *SMALL, "--optim.batch_size", "12", "--ckpt.path", work / "half", "--ckpt.resume",
              work / "a/step_00000004")
    data = json.loads((work / "half/step_00000008/meta.json").read_text())["data"]
    print("resumed at half the batch:", data)
    assert data == {"stream_rows": 4 * 24 + 4 * 12, "batch_size": 12, "seq_length": 64}, data
    assert "reading on from stream row 96" in text_of(work / "half.log.0")


def test_signal(work):
    """SIGTERM to one rank: every rank finishes its step (or the next), saves, and exits 0."""
    ranks = start_ranks(2, work / "s.log", *SMALL, "--ckpt.path", work / "s", "--optim.total_steps", "100000",
                        "--logging.interval", "1")
    wait_for(lambda: "step 3/" in text_of(work / "s.log.0"), 20)
    ranks.procs[1].terminate()
    codes = ranks.wait()
    assert codes == [0, 0], f"a rank did not exit 0 after SIGTERM: {codes}{ranks.tails()}"
    assert re.search(r"stopped by a signal after step .* \(checkpoint saved\)", ranks.text(0)), "no stop message"
    latest = (work / "s/latest").read_text()
    print(latest)
    assert (work / "s" / latest.strip() / "meta.json").is_file(), "no checkpoint"


def test_kill_during_save(work):
    """Saves every step, keeping one; the writers of step 5's save stop inside it on purpose (a
    test-only hook, after each rank's data file, before its index and the commit) and both ranks
    are killed with SIGKILL there. The newest complete checkpoint (step 4) must be there and load,
    and the resumed run must end with exactly the losses of a run never interrupted. Rotation
    deletes only checkpoints older than the one just saved: a newer one left by an earlier run
    (step 99 here) stays, and `latest` always names a checkpoint that exists."""
    run_ranks(2, work / "straight.log", *SMALL, "--logging.metrics_file", work / "straight.jsonl")
    k = work / "k"
    ranks = start_ranks(2, work / "k.log", *SMALL, "--ckpt.path", k, "--ckpt.interval", "1", "--ckpt.keep", "1",
                        "--logging.metrics_file", work / "k.jsonl", env={"ZB_TEST_PAUSE_SAVE_AT_STEP": "5"})
    paused = "writer paused inside the save of step 5"
    wait_for(lambda: paused in ranks.text(0) and paused in ranks.text(1), 60)
    assert "writer paused" in ranks.text(1), "the save of step 5 never paused"
    ranks.kill()
    ranks.wait()
    print(sorted(os.listdir(k)))
    assert (k / ".tmp-step_00000005").is_dir(), "the kill did not land inside the save of step 5"
    latest = (k / "latest").read_text().strip()
    assert latest == "step_00000004", f"latest is {latest}, not step_00000004"
    assert steps_in(k) == ["step_00000004"], f"keep = 1 left {steps_in(k)}"
    shutil.copytree(k / "step_00000004", k / "step_00000099")
    ranks = run_ranks(2, work / "r.log", *SMALL, "--ckpt.path", k, "--ckpt.interval", "1", "--ckpt.keep", "1",
                      "--ckpt.resume", "latest", "--logging.metrics_file", work / "r.jsonl")
    assert "resumed from" in ranks.text(0), "no resume"
    compare_losses(work / "straight.jsonl", work / "r.jsonl", 0, "killed inside the save of step 5, resumed from step 4")
    print(sorted(os.listdir(k)))
    assert (k / "latest").read_text().strip() == "step_00000008" and (k / "step_00000008/meta.json").is_file(), \
        "latest after the resumed run"
    assert steps_in(k) == ["step_00000008", "step_00000099"], f"rotation kept {steps_in(k)}"


def test_ddp_exact_resume(work):
    """train_ddp saves and resumes, bit-exact on the same world size."""
    saved_at_4(work, 2, TRAIN_DDP)
    run_ranks(2, work / "b.log", *SMALL, "--ckpt.path", work / "b", "--ckpt.resume", work / "a/step_00000004",
              "--logging.metrics_file", work / "b.jsonl", program=TRAIN_DDP)
    compare_losses(work / "a.jsonl", work / "b.jsonl", 0, "train_ddp saved at step 4 on 2 ranks, resumed on 2")


def saved_by_one_resumed_by_other(work, first, second):
    """One format for both engines: saved by one on 2 ranks, resumed by the other on 3; the losses
    follow the saving run's within fp32 summation-order noise."""
    saved_at_4(work, 2, first)
    ranks = run_ranks(3, work / "b.log", *SMALL, "--ckpt.path", work / "b", "--ckpt.resume", work / "a/step_00000004",
                      "--logging.metrics_file", work / "b.jsonl", program=second)
    assert "resumed from" in ranks.text(0), "no resume"
    compare_losses(work / "a.jsonl", work / "b.jsonl", 1e-4,
                   f"saved by {first.name} on 2 ranks, resumed by {second.name} on 3")


def test_ddp_to_fsdp(work):
    saved_by_one_resumed_by_other(work, TRAIN_DDP, TRAIN_FSDP)


def test_fsdp_to_ddp(work):
    saved_by_one_resumed_by_other(work, TRAIN_FSDP, TRAIN_DDP)


def test_hsdp_layouts(work):
    """Hybrid sharding's checkpoints are the same format: HSDP 2x2 -> FSDP on 4 -> FSDP on 3 ->
    HSDP 2x2, each resuming the one before two steps on, and HSDP -> train_ddp -> HSDP 1x4; the
    losses follow the straight run."""
    hsdp = ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2"]
    every_2 = ["--ckpt.interval", "2", "--ckpt.keep", "0"]
    ranks = run_ranks(4, work / "a.log", *SMALL, *hsdp, "--ckpt.path", work / "a", *every_2,
                      "--logging.metrics_file", work / "a.jsonl")
    assert "hybrid sharding: parameters sharded over groups of 2" in ranks.text(0), "not hybrid"
    # The second replica (ranks 2 and 3) saves no rows: each shard is written once.
    for r in range(4):
        index = json.load(open(work / f"a/step_00000002/rank_{r:05d}.json"))
        rows = sum(1 for e in index if e["global_shape"])
        print(f"rank {r}: {rows} row entries, {len(index) - rows} scalars")
        assert (rows > 0) == (r < 2), f"replicas wrote rows twice: rank {r} saved {rows} row entries"
    run_ranks(4, work / "b.log", *SMALL, "--ckpt.path", work / "b", *every_2, "--ckpt.resume", work / "a/step_00000002",
              "--logging.metrics_file", work / "b.jsonl")
    run_ranks(3, work / "c.log", *SMALL, "--ckpt.path", work / "c", *every_2, "--ckpt.resume", work / "b/step_00000004",
              "--logging.metrics_file", work / "c.jsonl")
    run_ranks(4, work / "d.log", *SMALL, *hsdp, "--ckpt.path", work / "d", "--ckpt.resume", work / "c/step_00000006",
              "--logging.metrics_file", work / "d.jsonl")
    compare_losses(work / "a.jsonl", work / "b.jsonl", 1e-4, "HSDP 2x2 -> FSDP 4", 3, 8)
    compare_losses(work / "a.jsonl", work / "c.jsonl", 1e-4, "-> FSDP 3", 5, 8)
    compare_losses(work / "a.jsonl", work / "d.jsonl", 1e-4, "-> HSDP 2x2", 7, 8)
    # And train_ddp: on 2 ranks from HSDP's step 4, then HSDP 1x4 from DDP's step 6.
    run_ranks(2, work / "e.log", *SMALL, "--ckpt.path", work / "e", *every_2, "--ckpt.resume", work / "a/step_00000004",
              "--logging.metrics_file", work / "e.jsonl", program=TRAIN_DDP)
    run_ranks(4, work / "f.log", *SMALL, "--parallel.dp_shard", "1", "--parallel.dp_replicate", "4", "--ckpt.path",
              work / "f", "--ckpt.resume", work / "e/step_00000006", "--logging.metrics_file", work / "f.jsonl")
    compare_losses(work / "a.jsonl", work / "e.jsonl", 1e-4, "HSDP 2x2 -> DDP 2", 5, 8)
    compare_losses(work / "a.jsonl", work / "f.jsonl", 1e-4, "-> HSDP 1x4", 7, 8)


def refused(rc, out, pattern, what):
    """A run that must stop with a non-zero exit code and a message matching `pattern`."""
    assert rc != 0 and re.search(pattern, out), f"{what} (exit {rc}): {out}"


def test_bad_checkpoint(work):
    run_ranks(2, work / "a.log", *SMALL, "--ckpt.path", work / "a", "--optim.total_steps", "2")
    ck = work / "a/step_00000002"
    before = digest(ck)
    # Another model shape.
    rc, out = run(TRAIN_FSDP, *SMALL, "--model.dim", "64", "--ckpt.resume", ck)
    refused(rc, out, re.escape(f"checkpoint {ck}: tok_embeddings.weight has shape [1024,128] there but [1024,64] "
                               "in this model"), "other model")
    # The same shapes, split into other heads.
    rc, out = run(TRAIN_FSDP, *SMALL, "--model.n_heads", "4", "--model.n_kv_heads", "4", "--ckpt.resume", ck)
    refused(rc, out, re.escape(f"checkpoint {ck}: its model has 8 heads and 8 key/value heads, this run's 4 and 4"),
            "other heads")
    # Damaged: an index entry that claims more values than its rows hold (a read past its buffer).
    shutil.copytree(ck, work / "bad_index")
    index = json.loads((work / "bad_index/rank_00000.json").read_text())
    entry = next(e for e in index if e["name"] == "model/layers.0.attention.wq.weight")
    entry["numel"] *= 2
    (work / "bad_index/rank_00000.json").write_text(json.dumps(index))
    rc, out = run(TRAIN_FSDP, *SMALL, "--ckpt.resume", work / "bad_index")
    refused(rc, out, r"rank_00000.json: model/layers.0.attention.wq.weight's entry .* does not fit its shape "
                     r"\[128,128\] \(damaged\?\)", "damaged index")
    # Damaged: a truncated rank file, on a copy.
    shutil.copytree(ck, work / "damaged")
    os.truncate(work / "damaged/rank_00001.bin", 1000)
    rc, out = run(TRAIN_FSDP, *SMALL, "--ckpt.resume", work / "damaged")
    refused(rc, out, r"rank_00001.bin has 1000 bytes, its index .* \(truncated\?\)", "damaged")
    # Damaged: the data loader's record in meta.json, a value that is no number, then one missing.
    shutil.copytree(ck, work / "bad_record")
    meta = json.loads((work / "bad_record/meta.json").read_text())
    meta["data"]["stream_rows"] = "many"
    (work / "bad_record/meta.json").write_text(json.dumps(meta))
    rc, out = run(TRAIN_FSDP, *SMALL, "--ckpt.resume", work / "bad_record")
    refused(rc, out, re.escape("damaged meta.json: data.stream_rows is not a whole number"), "damaged record")
    del meta["data"]["stream_rows"], meta["data"]["batch_size"]
    (work / "bad_record/meta.json").write_text(json.dumps(meta))
    rc, out = run(TRAIN_FSDP, *SMALL, "--ckpt.resume", work / "bad_record")
    refused(rc, out, re.escape(f"checkpoint {work / 'bad_record'}: meta.json's \"data\" has no batch_size (damaged?)"),
            "record without a value")
    # Partial: no metadata (a save that never finished).
    shutil.copytree(ck, work / "partial")
    os.remove(work / "partial/meta.json")
    rc, out = run(TRAIN_FSDP, *SMALL, "--ckpt.resume", work / "partial")
    refused(rc, out, re.escape("not a complete checkpoint (no meta.json)"), "partial")
    assert digest(ck) == before, "the checkpoint changed"
    print("other model, other heads, damaged checkpoints, indices and records, partial checkpoints refused; the "
          "checkpoint is untouched")


def test_hf_export(work):
    """A checkpoint saved on 2 ranks, exported; transformers' LlamaForCausalLM gives our logits."""
    run_ranks(2, work / "a.log", *SMALL, "--ckpt.path", work / "a", "--optim.total_steps", "3")
    assert subprocess.run([EXPORT_HF, work / "a/step_00000003", work / "hf", "--check-logits"]).returncode == 0, "export"
    hf_logits_match(work / "hf")


# The safetensors header as (length, JSON, data), to damage a header.
def rewrite_header(folder, change):
    path = folder / "model.safetensors"
    b = path.read_bytes()
    n = int.from_bytes(b[:8], "little")
    header, data = json.loads(b[8:8 + n]), b[8 + n:]
    change(header)
    t = json.dumps(header).encode()
    t += b" " * (-len(t) % 8)
    path.write_bytes(len(t).to_bytes(8, "little") + t + data)


def test_bad_import(work):
    """Damaged Hugging Face directories and checkpoints: one line naming the file and the problem,
    exit 1, before any training (each check below takes well under a second)."""
    run_ranks(2, work / "a.log", *SMALL, "--ckpt.path", work / "a", "--optim.total_steps", "1")
    ck = work / "a/step_00000001"
    assert subprocess.run([EXPORT_HF, ck, work / "hf"], stdout=subprocess.DEVNULL).returncode == 0, "export"

    def damaged(name, change):
        """A copy of the export, changed by change(folder)."""
        shutil.rmtree(work / name, ignore_errors=True)
        shutil.copytree(work / "hf", work / name)
        change(work / name)
        return work / name

    def init_refused(folder, pattern, *args):
        """init_from folder fails with exit 1 and pattern (a regular expression), untrained."""
        rc, out = run(TRAIN_FSDP, *SMALL, "--ckpt.init_from", folder, *args)
        print(next((line for line in out.splitlines() if "error: " in line), ""))
        assert rc == 1 and re.search(pattern, out) and "step 1/" not in out, f"init_from {folder} (exit {rc}): {out}"

    def edit_config(folder, change):
        c = json.load(open(folder / "config.json"))
        change(c)
        json.dump(c, open(folder / "config.json", "w"))

    d = damaged("nokey", lambda f: edit_config(f, lambda c: c.pop("hidden_size")))
    init_refused(d, re.escape(f"{d}/config.json: missing key 'hidden_size'"))
    d = damaged("notjson", lambda f: open(f / "config.json", "a").write("}"))
    init_refused(d, re.escape(f"{d}/config.json: not valid JSON"))
    d = damaged("truncated", lambda f: os.truncate(f / "model.safetensors", os.path.getsize(f / "model.safetensors") - 1000))
    init_refused(d, re.escape(f"{d}/model.safetensors: ") + r"model\.[a-z_.0-9]+: data_offsets \[[0-9]+, [0-9]+\] "
                 r"outside the file's [0-9]+ data bytes \(truncated\?\)")
    d = damaged("stub", lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00"))
    init_refused(d, re.escape(f"{d}/model.safetensors: 2 bytes, shorter than the 8-byte header length"))
    d = damaged("dtype", lambda f: rewrite_header(f, lambda h: h["model.norm.weight"].update(dtype="F16")))
    init_refused(d, re.escape(f"{d}/model.safetensors: model.norm.weight has dtype F16, expected F32"))

    def halve(h):
        e = h["model.norm.weight"]
        e["shape"] = [e["shape"][0] // 2, 2]
    d = damaged("shape", lambda f: rewrite_header(f, halve))
    init_refused(d, re.escape(f"{d}/model.safetensors: model.norm.weight has shape [64,2], but config.json's model "
                              "needs [128]"))
    d = damaged("missing", lambda f: rewrite_header(f, lambda h: h.pop("lm_head.weight")))
    init_refused(d, re.escape(f"{d}/model.safetensors: no tensor lm_head.weight"))
    init_refused(work / "hf", re.escape(f"model {work / 'hf'}: tok_embeddings.weight has shape [1024,128] there but "
                                        "[1024,64] in this run's model (a model of another size?)"), "--model.dim", "64")

    # export_hf on damaged checkpoints.
    def export_refused(folder, pattern):
        rc, out = run(EXPORT_HF, folder, work / "out")
        print(out)
        assert rc == 1 and re.search(pattern, out), f"export_hf {folder} (exit {rc}): {out}"

    def copy(name):
        shutil.copytree(ck, work / name)
        return work / name
    c = copy("c1")
    os.truncate(c / "rank_00001.bin", 1000)
    export_refused(c, re.escape(f"export_hf: {c}/rank_00001.bin has 1000 bytes, but model/") +
                   r"[a-z_.0-9]+'s rows end at byte [0-9]+ \(truncated\?\)")
    c = copy("c2")
    os.remove(c / "meta.json")
    export_refused(c, re.escape(f"export_hf: checkpoint {c}: not a complete checkpoint (no meta.json)"))
    c = copy("c3")
    (c / "rank_00000.json").write_text('[{"name": \n')
    export_refused(c, re.escape(f"export_hf: {c}/rank_00000.json: not valid JSON"))
    c = copy("c4")
    os.remove(c / "rank_00001.bin")
    export_refused(c, re.escape(f"export_hf: cannot read {c}/rank_00001.bin: No such file or directory"))


def test_hf_roundtrip(work):
    """export -> import as a run's initial weights (2 ranks, one step at lr 0: the linear schedule's
    multiplier is 0 at its last step) -> checkpoint -> export: the same bytes."""
    run_ranks(2, work / "a.log", *SMALL, "--ckpt.path", work / "a", "--optim.total_steps", "3")
    assert subprocess.run([EXPORT_HF, work / "a/step_00000003", work / "hf1"]).returncode == 0, "export 1"
    ranks = run_ranks(2, work / "b.log", *SMALL, "--ckpt.path", work / "b", "--ckpt.init_from", work / "hf1",
                      "--optim.sched_type", "linear", "--optim.warmup_steps", "0", "--optim.total_steps", "1")
    assert "initial weights from" in ranks.text(0), "no import"
    assert subprocess.run([EXPORT_HF, work / "b/step_00000001", work / "hf2"]).returncode == 0, "export 2"
    for f in ("model.safetensors", "config.json"):
        assert filecmp.cmp(work / "hf1" / f, work / "hf2" / f, shallow=False), f"{f} differs"
    print(f"export -> import -> export: byte-identical ({os.path.getsize(work / 'hf1/model.safetensors')} bytes)")
