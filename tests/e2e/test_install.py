"""`cmake --install` gives a tree that can be moved: installed into one prefix and moved to another,
train_fsdp trains from the installed presets and starts the installed metrics follower (found beside
the program, not in the source tree), which turns the run's records into TensorBoard events. It trains
with the installed GPU plugin loaded (ZB_CUDA_PLUGIN=on: src/util/cuda_plugin.h), on the CPU here."""
import glob
import re
import shutil
import subprocess

from conftest import BUILD, run, text_of, wait_for


def test_relocated(work):
    subprocess.run(["cmake", "--install", BUILD, "--prefix", work / "first"], stdout=subprocess.DEVNULL, check=True)
    shutil.move(work / "first", work / "moved")
    prefix = work / "moved"
    for f in ("bin/train_fsdp", "bin/train_ddp", "bin/train_hsdp", "bin/export_hf",
              "share/zeroband-cpp/scripts/watch/follow_metrics.py", "share/zeroband-cpp/scripts/data/make_shards.py",
              "share/zeroband-cpp/configs/debug/normal.toml", "lib/libzb_cuda.so"):
        assert (prefix / f).exists(), f"the install has no {f}"
    rc, out = run(prefix / "bin/train_fsdp", "--config", prefix / "share/zeroband-cpp/configs/debug/normal.toml",
                  "--data.fake", "--data.seq_length", "256", "--optim.total_steps", "2", "--ckpt.path", "",
                  "--runtime.num_threads", "1",
                  "--logging.metrics_file", work / "run/metrics.jsonl", "--logging.tensorboard_dir", work / "run/tb",
                  cwd=work, env={"ZB_CUDA_PLUGIN": "on"})  # nowhere near the source tree
    print(out)
    assert rc == 0, "the installed train_fsdp failed"
    assert f"GPU side of the programs loaded: {prefix}/lib/libzb_cuda.so" in out, "not the installed GPU plugin"
    assert re.search("metrics follower: .* " + re.escape(f"{prefix}/share/zeroband-cpp/scripts/watch/follow_metrics.py"),
                     out), "the follower did not come from the installed tree"
    log = work / "run/follower.log"
    wait_for(lambda: "follow_metrics: done, 2 records" in text_of(log), 60, 0.5)
    print(text_of(log))
    assert "follow_metrics: done, 2 records" in text_of(log), "the follower did not finish"
    assert glob.glob(f"{work}/run/tb/events.*"), "no TensorBoard events"
