"""The layers of src/ as the build enforces them (src/CMakeLists.txt, docs/DESIGN.md).

For every component, the compile command of one of its own sources (from compile_commands.json)
is asked, through the preprocessor's __has_include, which components' headers it can reach. It
must reach exactly the components below it in LAYERS (and itself): an upward include then fails
to compile; and the components' links must form no cycle. Prints PASS last.

    python tests/layers.py BUILD_DIR
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile

# Each component and the components its sources may include directly, as src/CMakeLists.txt links
# them: a name in parentheses is linked PRIVATE (its sources reach it, the components above do
# not); the others PUBLIC (reached by whatever reaches this component).
LAYERS = {
    "util": [],
    "kernels": ["util"],
    "model_parallel": [],
    "model": ["kernels", "model_parallel", "util"],
    "float8": ["model"],
    "config": ["float8", "model"],
    "data": ["config", "(util)"],
    "dist": ["util"],
    "parallel": ["config", "dist", "model"],
    "fsdp": ["parallel"],
    "ddp": ["parallel"],
    "optim": ["config", "parallel", "(util)"],
    "checkpoint": ["config", "optim", "(data)", "(util)"],
    "diloco": ["checkpoint", "config", "optim", "parallel", "(data)", "(util)"],
    "observe": ["config", "diloco", "dist", "(util)"],
    "plan": ["diloco", "observe", "optim", "parallel", "(ddp)", "(util)"],
    "train": ["checkpoint", "data", "diloco", "observe", "optim", "util", "(fsdp)", "(ddp)", "(plan)"],
    "launch": ["plan", "train", "(util)"],
}
# One header of each component, to probe with.
PROBE = {
    "util": "util/fs.h", "kernels": "kernels/kernel_choices.h", "model_parallel": "model_parallel/group.h", "model": "model/llama.h", "float8": "float8/float8_projections.h", "config": "config/config.h",
    "data": "data/loader.h", "dist": "dist/comm.h", "parallel": "parallel/parallel_model.h",
    "fsdp": "fsdp/fsdp_engine.h", "ddp": "ddp/ddp_engine.h", "optim": "optim/optimizer.h",
    "checkpoint": "checkpoint/checkpoint.h", "diloco": "diloco/diloco.h", "observe": "observe/metrics.h",
    "plan": "plan/step_plan.h", "train": "train/trainer.h", "launch": "launch/launch.h",
}


def deps(component, private=True):
    """The components `component` links: all of them, or its PUBLIC ones only."""
    return [d.strip("()") for d in LAYERS[component] if private or not d.startswith("(")]


def reach(component):
    """What a source of `component` can include: itself, what it links, and what those pass on."""
    seen, todo = {component}, deps(component)
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(deps(c, private=False))
    return seen


def flags_of(entry):
    """The include and define flags of one compile command."""
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out, i = [], 1
    while i < len(args):
        a = args[i]
        if a in ("-I", "-isystem", "-D", "-include"):
            if not args[i + 1].endswith("cmake_pch.hxx"):  # the precompiled header: LibTorch's, no layer
                out += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith(("-I", "-D", "-isystem", "-std=")):
            out.append(a)
        i += 1
    return args[0], out, entry["directory"]


def cycle():
    """A cycle among the components' links, as a list of names, or None: layers have none."""
    state = {}  # component -> "open" while its links are being walked, "done" after

    def walk(c, path):
        if state.get(c) == "open":
            return path[path.index(c):] + [c]
        if state.get(c) == "done":
            return None
        state[c] = "open"
        for d in deps(c):
            found = walk(d, path + [c])
            if found:
                return found
        state[c] = "done"
        return None

    for c in LAYERS:
        found = walk(c, [])
        if found:
            return found
    return None


def main():
    build = sys.argv[1]
    src = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "src"))
    commands = json.load(open(os.path.join(build, "compile_commands.json")))
    probe_text = "".join(
        f'#if __has_include("{h}")\nreach {c}\n#endif\n' for c, h in PROBE.items())
    failures = []
    if loop := cycle():
        failures.append("the layers link in a cycle: " + " -> ".join(loop))
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.cpp")
        open(probe, "w").write(probe_text)
        for component in LAYERS:
            # A source of the component's own library (a file may also build into another target).
            entry = next((e for e in commands
                          if os.path.dirname(os.path.normpath(e["file"])) == os.path.join(src, component)
                          and f"zb_{component}.dir" in e.get("command", " ".join(e.get("arguments", [])))), None)
            if entry is None:
                failures.append(f"{component}: no source of it in compile_commands.json")
                continue
            compiler, flags, cwd = flags_of(entry)
            out = subprocess.run([compiler, "-E", "-P", probe, *flags], cwd=cwd, capture_output=True,
                                 text=True, check=True).stdout
            got = {line.split()[1] for line in out.splitlines() if line.startswith("reach ")}
            want = reach(component)
            print(f"{component:14s} reaches {' '.join(sorted(got))}")
            if got != want:
                extra, missing = sorted(got - want), sorted(want - got)
                failures.append(f"{component}: reaches {extra} beyond its layer" if extra else
                                f"{component}: cannot reach {missing}")
    for f in failures:
        print("FAIL", f)
    if failures:
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()
