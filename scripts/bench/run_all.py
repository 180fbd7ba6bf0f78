"""Run every benchmark of issue 8 and write ``results.md`` and ``results.png`` here.

Called by ``scripts/bench/all`` (which sets up the virtualenv first). It runs,
one after the other, each in its own process:

1. ``compile_scaling.py``: our interprocedural propagation and pipeline against
   TVM's, 8 to 64 layers;
2. ``comm_volume.py --check``, then ``comm_volume.py``: bytes per rank of every
   change of placement, ours, the lower bound and DTensor;
3. ``collectives.py``: collectives on 2 ranks, ours over MPI and disco shared
   memory against mpi4py and gloo;
4. ``tp_mlp.py``: a tensor-parallel MLP forward on 1 and 2 ranks against
   DTensor on gloo and numpy;
5. ``llm_prefill.py``: time to first token of a 443M-parameter random Llama
   with ``CausalLM`` on 1 and 2 ranks against transformers (1 and 2 threads)
   and, when its cached environment is built, llama.cpp (F32).
6. ``llm_decode.py``: token generation of a 443M-parameter random Llama with
   ``CausalLM`` on 1 and 2 ranks against transformers' ``generate`` and, when
   its cached environment is built (``llm_decode.py --build-llama-cpp``),
   llama.cpp on the checkpoint's GGUF files (F32, F16, Q8_0, Q4_0), with the
   memory-bandwidth roofline and matrix-vector kernels against torch. The
   smoke run leaves llama.cpp out.

``results.md`` holds each benchmark's tables under the command that made them,
with the date, the commit and the machine; ``results.png`` plots them (six
panels). Each benchmark also prints its progress on stderr. ``--quick`` runs
reduced versions (for trying the script out; the tables then say so), and
``--smoke`` every benchmark at its smallest size (what the test suite runs, to keep
them working), and ``--only`` a subset.

Usage::

    scripts/bench/all
    scripts/bench/all --quick
    scripts/bench/all --only comm_volume tp_mlp
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: name, title, arguments of the full run, of ``--quick`` and of ``--smoke``
BENCHES = [
    ("compile_scaling", "Compile time against model depth",
     [], ["--layers", "8", "16", "--rounds", "2"], ["--layers", "2", "--rounds", "1"]),
    ("comm_volume", "Bytes moved by every change of placement",
     [], ["--meshes", "2", "2x2", "--no-min-cost"], ["--meshes", "2", "--no-min-cost"]),
    ("collectives", "Collectives on 2 ranks",
     ["--rounds", "9"], ["--sizes", "1", "4", "--rounds", "2", "--no-plain"],
     ["--sizes", "1", "--rounds", "1", "--no-plain"]),
    ("tp_mlp", "Tensor-parallel MLP forward",
     ["--rounds", "3"], ["--rounds", "1", "--samples", "2"],
     ["--shape", "8", "64", "256", "--rounds", "1", "--samples", "1", "--calls", "1"]),
    ("llm_prefill", "Llama time to first token",
     [], ["--small", "--tokens", "16", "128", "--rounds", "1"],
     ["--hidden", "64", "--layers", "1", "--tokens", "4", "8", "--ranks", "1", "2",
      "--threads", "1", "--rounds", "1", "--samples", "1", "--no-llama-cpp"]),
    ("llm_decode", "Llama token generation",
     [], ["--small", "--rounds", "1", "--kernels", "1024x4096"],
     ["--hidden", "64", "--layers", "1", "--prompt", "4", "--new-tokens", "4", "--ranks", "2",
      "--threads", "1", "--rounds", "1", "--mib", "16", "--stream-window", "0.2",
      "--kernels", "64x256", "--formats", "f32", "--no-llama-cpp"]),
]


def _shell(command: list[str]) -> str:
    return " ".join(command)


def run(name: str, args: list[str], json_path: Path) -> tuple[str, str, float]:
    """Run one benchmark; returns the command shown, its stdout and its duration."""
    shown = ["python", f"scripts/bench/{name}.py", *args]
    command = [sys.executable, str(HERE / f"{name}.py"), *args, "--json", str(json_path)]
    print(f"[bench] {_shell(shown)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.stdout.write(done.stdout)
        raise SystemExit(f"{name} failed with exit code {done.returncode}")
    print(f"[bench] {name} took {elapsed:.0f} s", file=sys.stderr, flush=True)
    return _shell(shown), done.stdout.strip(), elapsed


def check_plans(meshes: list[str]) -> tuple[str, str]:
    """``comm_volume.py --check``: its command and output."""
    args = ["--check"] + (["--meshes", *meshes] if meshes else [])
    done = subprocess.run([sys.executable, str(HERE / "comm_volume.py"), *args], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
    return _shell(["python", "scripts/bench/comm_volume.py", *args]), done.stdout.strip() + (
        "" if done.returncode == 0 else f"\n(exit status {done.returncode})")


def machine() -> str:
    """The CPU model, core count and Python / library versions."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for module in ("tvm", "numpy", "torch", "mpi4py"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except Exception:  # noqa: BLE001 - a version is only informative
            pass
    return f"{model}, {os.cpu_count()} cores; Python {platform.python_version()}, " + ", ".join(
        versions)


def commit() -> str:
    """The commit, and whether the work tree differs from it (read-only git calls)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True).stdout.strip()
        return sha + (" with local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------- the plots
def plot(data: dict, path: Path) -> None:
    """Six panels from the benchmarks' JSON (the panels of missing benchmarks stay empty)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import statistics

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    (a_compile, a_volume, a_mlp), coll_axes = axes[0], axes[1]
    for ax in axes.flat:
        ax.grid(alpha=0.3)

    rows = data.get("compile_scaling")
    if rows:
        layers = [r["layers"] for r in rows]
        for key, label, style in (("ours_prop", "ours PropagateSharding", "o-"),
                                  ("tvm_prop", "TVM PropagateSharding (after inlining)", "s-"),
                                  ("ours_dist", "ours distribute", "o--"),
                                  ("tvm_dist", "TVM pipeline (with inlining)", "s--")):
            a_compile.plot(layers, [r[key] for r in rows], style, label=label)
        a_compile.set_xscale("log", base=2)
        a_compile.set_yscale("log")
        a_compile.set_xticks(layers, [str(v) for v in layers])
        a_compile.set_xlabel("layers (one private function each)")
        a_compile.set_ylabel("seconds (median)")
        a_compile.set_title("Compile time against depth")
        a_compile.legend(fontsize=8)

    totals = data.get("comm_volume")
    if totals:
        meshes = [t["mesh"] for t in totals]
        series = [("ours", "ours"), ("ours_collectives", "ours, collectives only"),
                  ("dtensor", "DTensor (default)"), ("dtensor_min_cost", "DTensor min-cost")]
        series = [(k, label) for k, label in series if k in totals[0]]
        width = 0.8 / len(series)
        for i, (key, label) in enumerate(series):
            a_volume.bar([m + i * width for m in range(len(meshes))],
                         [t[key] / t["bound"] for t in totals], width, label=label)
        a_volume.axhline(1.0, color="black", lw=0.8)
        a_volume.set_xticks([m + width * (len(series) - 1) / 2 for m in range(len(meshes))],
                            meshes)
        a_volume.set_xlabel("mesh")
        a_volume.set_ylabel("total bytes received / lower bound")
        a_volume.set_title("Redistribution volume, all transitions of a rank-3 tensor")
        a_volume.legend(fontsize=8)

    mlp = data.get("tp_mlp")
    if mlp:
        keys = list(mlp["labels"])
        values = [statistics.median(mlp["times"][k]) * 1e3 for k in keys]
        a_mlp.barh(range(len(keys)), values, color=[
            "tab:blue" if k.startswith("ours") else "tab:orange" if k == "dtensor"
            else "tab:gray" for k in keys])
        a_mlp.set_yticks(range(len(keys)), [mlp["labels"][k] for k in keys], fontsize=8)
        a_mlp.invert_yaxis()
        a_mlp.set_xlabel("ms per forward (median)")
        batch, hidden, ffn = mlp.get("shape", (64, 2048, 8192))
        a_mlp.set_title(f"TP MLP {batch}x{hidden} -> {ffn} -> {hidden}")

    coll = data.get("collectives")
    if coll:
        sizes, times = coll["sizes"], coll["times"]
        styles = {"vm": ("(a) ours MPI via VM", "o-"),
                  "vminto": ("(a') ours MPI via VM, fixed output", "o:"),
                  "raw": ("(b) mpi4py", "s-"),
                  "raw2": ("(b'') mpi4py, two outputs in turn", "s--"),
                  "rawtvm": ("(b') mpi4py on TVM buffers", "s:"),
                  "shm": ("(c) ours disco shm", "o--"), "gloo": ("(d) gloo", "^-")}
        for ax, op in zip(coll_axes, ("allreduce", "allgather", "alltoall")):
            for key, (label, style) in styles.items():
                if f"{key} {op} {sizes[0]}" not in times:
                    continue
                rate = [mib / 1024 / statistics.median(times[f"{key} {op} {mib}"])
                        for mib in sizes]
                ax.plot(sizes, rate, style, label=label)
            plain = coll.get("plain_malloc")
            if plain:
                rate = [mib / 1024 / statistics.median(plain[f"vm {op} {mib}"]) for mib in sizes]
                ax.plot(sizes, rate, "o-.", color="tab:blue", alpha=0.5,
                        label="(a) without the huge-page tunable")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_xlabel("MiB per rank")
            ax.set_ylabel("GiB/s per rank (input size / time)")
            ax.set_title(f"{op}, 2 ranks")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="reduced runs, to try it out")
    size.add_argument("--smoke", action="store_true",
                      help="every benchmark at its smallest size (what the test suite runs)")
    parser.add_argument("--only", nargs="*", choices=[b[0] for b in BENCHES], default=None)
    parser.add_argument("--out", type=Path, default=HERE,
                        help="where results.md and results.png go (default: scripts/bench)")
    opts = parser.parse_args(argv)

    started = time.perf_counter()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()
    sections, data = [], {}
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp:
        for number, (name, title, full, quick, smoke) in enumerate(BENCHES, start=1):
            if opts.only is not None and name not in opts.only:
                continue
            args = smoke if opts.smoke else quick if opts.quick else full
            text = [f"## {number}. {title}", ""]
            if name == "comm_volume":
                meshes = []
                if "--meshes" in args:
                    for token in args[args.index("--meshes") + 1:]:
                        if token.startswith("--"):
                            break
                        meshes.append(token)
                command, output = check_plans(meshes)
                text += [f"`{command}`", "", "```text", output, "```", ""]
            command, output, elapsed = run(name, args, Path(tmp) / f"{name}.json")
            text += [f"`{command}` ({elapsed:.0f} s)", "", output, ""]
            sections.append("\n".join(text))
            data[name] = json.loads((Path(tmp) / f"{name}.json").read_text())
    load_after = os.getloadavg()
    total = time.perf_counter() - started

    mode = " --quick" if opts.quick else " --smoke" if opts.smoke else ""
    header = [
        "# Benchmark results (issue 8)", "",
        f"Made by `scripts/bench/all{mode}` on {when} "
        f"({total / 60:.1f} min), commit {commit()}.", "",
        f"Machine: {machine()}. Load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after: the cores may be shared, so compare the ratios, which "
        "are measured side by side in the same run (contenders alternate, medians of "
        "repeats).", "",
    ]
    if opts.quick or opts.smoke:
        header += ["**Reduced sizes and repeats: not for quoting.**", ""]
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "results.md").write_text("\n".join(header + sections).rstrip() + "\n")
    plot(data, opts.out / "results.png")
    print(f"[bench] wrote {opts.out / 'results.md'} and {opts.out / 'results.png'} "
          f"in {total / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
