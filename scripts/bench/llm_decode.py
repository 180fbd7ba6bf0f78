"""Token generation of a random-weight Llama: ours on 1 and 2 ranks against transformers.

The model is a ``LlamaForCausalLM`` built from a config in code (no download):
hidden 1024, FFN 4096, 24 layers, 16 query heads and 8 KV heads (grouped-query
attention), vocabulary 32000, untied LM head: 443M parameters, 1.77 GB in
float32. ``--small`` runs a 4-layer version of it, for trying the script out.
A random prompt is followed by ``--new-tokens`` greedy tokens (batch 1).

Contenders, each in its own processes (imports, compilation and loading are
not timed; a short generation warms each one up first):

* **transformers** ``generate(do_sample=False, use_cache=True)`` in torch
  eager, one process with 1 thread and with 2 (``torch.set_num_threads``).
  Its times come from a logits processor that notes the clock at every token:
  the prefill is the time to the first token, each decode step the time
  between two tokens.
* **ours, p ranks** (p = 1, 2): :class:`tvm_distx.llm.causal_lm.CausalLM` serving a
  generation bundle (:meth:`~tvm_distx.llm.causal_lm.CausalLM.export` of
  ``CausalLM.from_pretrained(checkpoint, num_ranks=p)``, the model as
  ``save_pretrained`` wrote it, ``presets.tensor_parallel()``) on
  ``mpiexec -n p`` ranks that stay up, one TVM thread per rank. Times are
  :attr:`~tvm_distx.llm.causal_lm.CausalLM.stats`: each decode step is one call of the
  session as the caller sees it, socket round trip and argmax included.

* **llama.cpp, t threads** (t = 1, 2): ``llama-cpp-python`` built from its
  source distribution with the host's instruction set (AVX-512 here) into the
  benchmark's own cached environment, on GGUF files converted from the same
  checkpoint with llama.cpp's converter and quantize API, one per format
  (``--formats``: F32, F16, Q8_0, Q4_0); see ``_llama_cpp.py``. Used when
  that environment is present: ``--build-llama-cpp`` builds it once (10-20
  minutes on 2 cores), ``--no-llama-cpp`` leaves it out (the test suite's
  smoke run does). Each decode step is one ``Llama.eval`` of one token and
  the argmax of its logits, timed as the caller sees it, like ours.
* **ours in the matching format**: f16, q8 and q4 bundles made by
  ``CausalLM.from_pretrained(checkpoint, num_ranks=p, dtype="float16")`` or
  ``quantization="q8"|"q4"``, run as the float32 ones, where this checkout's
  ``from_pretrained`` takes those options (the report says which formats ran).

Every contender's greedy tokens are compared with those of transformers
(float32) on 1 thread; a 16-bit or quantized contender's also with those of
transformers on that format's weights (every 2-D weight encoded and decoded
by :mod:`tvm_distx.sources.formats`, whose q8 and q4 are llama.cpp's Q8_0 and
Q4_0; run once, not timed), and ours in each format with llama.cpp's in that
format. Float32 ones should agree throughout; others may part after a few
tokens (random weights leave small gaps between the top logits, and
llama.cpp's Q8_0 and Q4_0 products also round the activations to 8 bits), so
the tables give how many leading tokens agree.
The peak resident memory of every process that holds weights (``VmHWM`` of
``/proc/<pid>/status``: the transformers and llama.cpp processes; each of our
ranks) is read after the run.

**Roofline.** Decoding one token reads every weight a rank holds once (all but
the token embedding, of which it reads one row), so memory bandwidth bounds
it: the lower bound of a step is the weight bytes per rank divided by the
bandwidth one process gets. The bytes are each format's: our bundle's
weights as a rank stores them (data and scales), the GGUF file's tensors for
llama.cpp. That bandwidth is measured in the same run by a STREAM-like numpy
read (a sum, as decode reads its weights), copy and triad on 256 MiB arrays,
one thread, each kernel repeated for two seconds: once alone (for the
1-thread contenders) and once in two processes streaming during the same
seconds (per process, for 2 ranks; twice that for torch and llama.cpp on 2
threads). The read bandwidth makes the bound. A second column takes one
process's bandwidth alone for every process, as on separate machines: on
this host, where two ranks share one memory system, it is the stricter bound.
The cache read per step (under 1% of the weights here) is left out of the
bound.

**Bandwidth scaling.** On one host, two ranks share its memory system. The
report prints what two processes streaming at once got together over what
one got alone, beside the measured 2-rank speed-up. On a virtual machine it
varies with the host's other tenants from moment to moment, so it is a
reading, not a ceiling. (On separate machines each rank has its own memory.)

**Matrix-vector kernels.** ``1 x K @ (N x K)^T`` products as decode runs them,
our :class:`tvm_distx.compiler.schedule.MatvecRule` kernel (chosen by default) against
``torch.nn.functional.linear``, both on 1 thread. Each side cycles through
enough copies of the weight to exceed 256 MiB, so the weight comes from memory
as in decode, not from the caches.

Rounds launch every contender once, in an order that rotates; tables show
medians over rounds and ratios as medians of per-round ratios (min-max).

**Across hosts** (``--hosts``, as root): the 2-rank session on this host
beside the same bundle's session with one rank on each of 2 test hosts
(``scripts/testhosts``, docs/testhosts.md: namespaces on this machine, between
which MPI goes over TCP), which the script brings up and down itself. The
session copies each host its rank's share of the bundle before launch
(``CausalLM.from_bundle(..., hosts=[a, b], rsh=testhosts-rsh)``; not timed).
Each round runs both, in turns; the greedy tokens must be equal. Only decode
per token is compared: the transformers contenders, the bandwidth and the
kernels are left out. The test hosts share this machine's cores and memory:
TCP between namespaces measures the network stack, not a wire.

Usage::

    python scripts/bench/llm_decode.py --build-llama-cpp  # once: llama.cpp's environment
    python scripts/bench/llm_decode.py                  # 443M parameters, 2 rounds
    python scripts/bench/llm_decode.py --quick          # 4 layers, 1 round, no kernels
    python scripts/bench/llm_decode.py --formats f32,q8 --no-kernels
    python scripts/bench/llm_decode.py --hosts --small --rounds 3   # on 2 test hosts
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _llama_cpp  # noqa: E402
from _common import (child_env, fmt_bytes, llama_parameters, median, run_job,  # noqa: E402
                     spread, table, test_hosts, unscheduled_kernels)

import numpy as np  # noqa: E402

SCRIPT = str(Path(__file__).resolve())

#: The model (``--small`` keeps 4 layers; ``--hidden`` and ``--layers`` change it).
MODEL = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096,
         "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8}

#: ``(K, N)`` of the matrix-vector products: ``(1, K) @ W.T`` with ``W`` stored ``(N, K)``.
MATVEC_SHAPES = [(1024, 4096), (4096, 1024), (4096, 8192), (1024, 32000)]

#: The weight formats (``--formats``) and how ours is asked for each.
FORMATS = {"f32": {}, "f16": {"dtype": "float16"}, "q8": {"quantization": "q8"},
           "q4": {"quantization": "q4"}}


def our_formats(formats: list[str]) -> list[str]:
    """The ``formats`` this checkout's ``CausalLM.from_pretrained`` can serve."""
    from tvm_distx.llm.causal_lm import CausalLM

    takes = inspect.signature(CausalLM.from_pretrained).parameters
    return [f for f in formats if all(option in takes for option in FORMATS[f])]


def key_of(kind: str, arg: int, fmt: str) -> str:
    """A contender's key: ``hf1``, ``ours2`` (float32), ``ours2-q8``, ``llama1-f32``."""
    return f"{kind}{arg}" + ("" if fmt == "f32" and kind != "llama" else f"-{fmt}")


def contenders(ranks: list[int], torch_threads: list[int], formats: list[str] = ("f32",),
               llama: list[str] = ()) -> list[tuple[str, str, str, int, str]]:
    """``(key, label, kind, ranks or threads, format)`` of every contender of this run.

    ``formats``: ours; ``llama``: llama.cpp's (none when it is not run).
    """
    def threads(t: int) -> str:
        return f"{t} thread{'s' if t > 1 else ''}"

    rows = [(f"hf{t}", f"transformers generate, torch eager, {threads(t)}", "hf", t, "f32")
            for t in torch_threads]
    for fmt in formats:
        name = "ours" if fmt == "f32" else f"ours {fmt}"
        rows += [(key_of("ours", p, fmt),
                  f"{name}, {p} rank{'s' if p > 1 else ''} over MPI (1 thread each)",
                  "ours", p, fmt) for p in ranks]
    for fmt in llama:
        rows += [(key_of("llama", t, fmt), f"llama.cpp {_llama_cpp.GGUF_TYPES[fmt]}, {threads(t)}",
                  "llama", t, fmt) for t in torch_threads]
    return rows


def checkpoint(folder: Path, config: dict, positions: int) -> None:
    """The random-weight Llama of ``config`` saved by ``save_pretrained`` in ``folder``.

    Skipped when ``folder`` already holds it (a ``complete`` file is written last).
    """
    import torch
    import transformers

    if (folder / "complete").exists():
        return
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **config, max_position_embeddings=positions, tie_word_embeddings=False)).eval()
    model.save_pretrained(folder)
    (folder / "complete").write_text("")


def cached_checkpoint(config: dict, positions: int) -> Path:
    """Where the llama.cpp runs keep the checkpoint and its GGUF files (by config and versions)."""
    import torch
    import transformers

    key = hashlib.sha256(json.dumps([config, positions, torch.__version__,
                                     transformers.__version__], sort_keys=True).encode())
    return _llama_cpp.cache_dir() / "models" / key.hexdigest()[:12] / "model"


def build(folder: Path, config: dict, prompt: int, new_tokens: int, ranks: list[int],
          formats: list[str] = ("f32",), model: Path | None = None) -> dict:
    """The checkpoint (``model``, default ``folder/model``), prompt and our bundles.

    ``folder/model`` links to ``model``; one generation bundle per format and
    rank count. Returns the weight bytes a decode step reads, per rank, by
    contender key (``whole``: the float32 model's).
    """
    from tvm_distx.bundle.manifest import read_manifest
    from tvm_distx.llm.causal_lm import CausalLM

    positions = max(512, prompt + new_tokens)
    if model is None:
        model = folder / "model"
    else:
        (folder / "model").symlink_to(model, target_is_directory=True)
    checkpoint(model, config, positions)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (1, prompt))
    np.save(folder / "ids.npy", ids)
    read = {"whole": 4 * (llama_parameters(config) - config["vocab_size"] * config["hidden_size"])}
    for fmt in formats:
        for p in ranks:
            started = time.perf_counter()
            # from the checkpoint transformers wrote, as users serve one: each block read lazily;
            # emulated ranks (threads here): writing the bundle needs no launch of MPI ranks
            with CausalLM.from_pretrained(folder / "model", num_ranks=p, backend="emulate",
                                          max_length=prompt + new_tokens, **FORMATS[fmt]) as lm:
                root = lm.export(folder / f"bundle_{fmt}_{p}")
                for name in unscheduled_kernels(lm.exe.built):
                    print(f"  warning: {fmt} on {p} rank(s): kernel {name} has no schedule of "
                          "ours (TVM's default build)", file=sys.stderr, flush=True)
            manifest = read_manifest(root)
            decode = set(manifest.weights.get("decode", ()))
            read[key_of("ours", p, fmt)] = max(
                sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize
                    for w in manifest.files_of(r)
                    if w.name in decode and "embed_tokens" not in w.name)
                for r in range(p))
            print(f"  compiled and exported {fmt} for {p} rank(s) in "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return read


# ---------------------------------------------------------------------- inside the jobs
def peak_rss(pid: int | str = "self") -> int:
    """Peak resident bytes (``VmHWM``) of a process of this host."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def hf_job(data: str, out: str, threads: int, new_tokens: int, fmt: str = "f32") -> None:
    """transformers ``generate`` in this process, torch on ``threads`` threads.

    ``fmt`` other than f32: the tokens' reference for that format, every 2-D
    weight (the linears, the embedding and the LM head, as llama.cpp's files
    have them) replaced by its value encoded in ``fmt`` and decoded
    (:mod:`tvm_distx.sources.formats`).
    """
    import torch
    import transformers

    from tvm_distx.sources.formats import decode, encode

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        Path(data) / "model", dtype=torch.float32).eval()
    if fmt != "f32":
        with torch.no_grad():
            for weight in model.parameters():
                if weight.ndim == 2:
                    weight.copy_(torch.from_numpy(decode(encode(weight.numpy(), fmt), fmt)))
    ids = torch.from_numpy(np.load(Path(data) / "ids.npy"))

    class Clock(transformers.LogitsProcessor):
        """Notes the time at every token (after its forward)."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    def generate(count: int, clock: Clock):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=count, do_sample=False, use_cache=True,
                                  eos_token_id=None, pad_token_id=0,
                                  logits_processor=transformers.LogitsProcessorList([clock]))

    generate(4, Clock())  # warm-up
    clock = Clock()
    started = time.perf_counter()
    tokens = generate(new_tokens, clock)[0].tolist()
    Path(out).write_text(json.dumps({
        "tokens": tokens, "prefill": clock.stamps[0] - started,
        "steps": list(np.diff(clock.stamps)), "rss": [peak_rss()]}))


def ours_job(data: str, out: str, ranks: int, new_tokens: int, hosts: str | None = None,
             rsh: str | None = None, fmt: str = "f32") -> None:
    """A session on our generation bundle of format ``fmt``, one TVM thread per rank.

    ``hosts`` (``"a,b"``) and ``rsh`` place the ranks on other hosts; their
    memory is then not read (their processes are not this host's).
    """
    from tvm_distx.llm.causal_lm import CausalLM

    ids = np.load(Path(data) / "ids.npy")
    where = {"hosts": hosts, "rsh": rsh} if hosts else {}
    with CausalLM.from_bundle(Path(data) / f"bundle_{fmt}_{ranks}",
                              env={"TVM_NUM_THREADS": "1"}, **where) as lm:
        def memory() -> list[int]:
            return [] if hosts else [peak_rss(r.pid) for r in lm.session.ranks]

        # the ranks load their weights at the first call: before it, their runtime alone
        runtime = memory()
        lm.generate(ids, max_new_tokens=4)  # warm-up: every rank loads its weights
        tokens = lm.generate(ids, max_new_tokens=new_tokens)[0].tolist()
        stats = lm.stats
        rss = memory()
    Path(out).write_text(json.dumps({"tokens": tokens, "prefill": stats.prefill_seconds,
                                     "steps": list(stats.per_step), "rss": rss, "runtime": runtime,
                                     "comm": stats.bytes_per_token}))


def stream_job(out: str, start: float, mib: int, window: float = 2.0) -> None:
    """:func:`stream` from the wall-clock time ``start`` (jobs started together overlap)."""
    Path(out).write_text(json.dumps(stream(mib, start, window)))


#: Seconds each kernel of :func:`stream` runs: long enough that processes started
#: together stream at the same time for nearly all of it.
STREAM_WINDOW = 2.0


def stream(mib: int, start: float | None = None,
           window: float = STREAM_WINDOW) -> dict[str, float]:
    """STREAM-like read, copy and triad on float64 arrays of ``mib`` MiB, bytes/s.

    Each kernel repeats for ``window`` seconds (:data:`STREAM_WINDOW`) from its own slot of
    wall-clock time (``start``, then every window plus a margin), so that
    processes started together measure the bandwidth each gets while all of
    them stream (a best-of-few short trial would pick a moment when the others
    paused). Read is a sum (a decode step reads its weights); copy moves 2
    arrays, triad 3 (STREAM's counting: the write-allocate read is not
    counted). The triad runs in chunks that stay in L2 so numpy needs no
    array-sized temporary.
    """
    n = (mib << 20) // 8
    a, b, c = np.zeros(n), np.ones(n), np.full(n, 2.0)
    chunk = 1 << 15
    tmp = np.empty(chunk)

    def read():
        b.sum()

    def copy():
        np.copyto(a, b)

    def triad():
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            np.multiply(c[lo:hi], 3.0, out=tmp[:hi - lo])
            np.add(b[lo:hi], tmp[:hi - lo], out=a[lo:hi])

    start = time.time() if start is None else start
    result = {}
    for slot, (name, kernel, arrays) in enumerate((("read", read, 1), ("copy", copy, 2),
                                                   ("triad", triad, 3))):
        time.sleep(max(0.0, start + slot * (window + 0.5) - time.time()))
        began, runs = time.perf_counter(), 0
        while time.perf_counter() - began < window:
            kernel()
            runs += 1
        result[name] = runs * arrays * n * 8 / (time.perf_counter() - began)
    return result


def matvec_kernel(k: int, n: int):
    """Our compiled ``(1, k) @ W.T`` for ``W`` stored ``(n, k)``, scheduled by default rules."""
    import tvm
    from tvm import relax

    from tvm_distx.compiler.pipeline import legalize_ops
    from tvm_distx.compiler.schedule import RULE_ATTR, schedule_module, x86_target

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(out)
    target = x86_target()  # as our ranks are compiled; TVM_NUM_THREADS=1 runs it on one
    mod = schedule_module(legalize_ops(bb.get()), target)
    (kernel,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    rule = kernel.attrs.get(RULE_ATTR, None) if kernel.attrs is not None else None
    built = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}),
                        target=target).mod
    return built["main"], str(rule)


def kernels_job(out: str, shapes: list[tuple[int, int]], rounds: int, mib: int) -> None:
    """Our matrix-vector kernels against ``torch.nn.functional.linear``, 1 thread each.

    Every round also measures :func:`stream`'s bandwidth, the kernels' yardstick.
    """
    import torch
    import tvm

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = []
    for k, n in shapes:
        func, rule = matvec_kernel(k, n)
        nbytes = 4 * k * n
        cold = mib << 20  # the weight copies cycled through: past the caches
        copies = max(1, math.ceil(cold / nbytes))
        x = rng.standard_normal((1, k), dtype="float32")
        weights = [rng.standard_normal((n, k), dtype="float32") for _ in range(copies)]
        ours = [(tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(
            np.zeros((1, n), "float32"))) for w in weights]
        tx, theirs = torch.from_numpy(x), [torch.from_numpy(w) for w in weights]
        func(*ours[0])
        np.testing.assert_allclose(ours[0][2].numpy(), x @ weights[0].T, rtol=1e-3,
                                   atol=1e-3 * math.sqrt(k))
        reps = max(1, (4 * cold) // (nbytes * copies))

        def timed(call, args) -> float:
            for a in args:
                call(a)
            began = time.perf_counter()
            for _ in range(reps):
                for a in args:
                    call(a)
            return (time.perf_counter() - began) / (reps * len(args))

        t_ours, t_torch, bw = [], [], []
        for _ in range(rounds):
            t_torch.append(timed(lambda w: torch.nn.functional.linear(tx, w), theirs))
            t_ours.append(timed(lambda a: func(*a), ours))
            bw.append(stream(mib)["read"])
        rows.append({"k": k, "n": n, "rule": rule, "bytes": nbytes, "ours": t_ours,
                     "torch": t_torch, "bandwidth": bw})
    Path(out).write_text(json.dumps(rows))


# ---------------------------------------------------------------------- the controller
def launch(kind: str, arg, folder: Path, new_tokens: int, timeout: float,
           where: tuple[str, ...] = (), fmt: str = "f32", gguf: str | None = None) -> dict:
    """Run one contender's job; returns its JSON.

    ``where``: ours' ``--on-hosts`` and ``--rsh``; ``fmt``: ours' bundle format;
    ``gguf``: llama.cpp's file (its job runs on the llama.cpp environment's Python).
    """
    key = key_of(kind, arg, fmt)
    out = folder / f"{key}.json"
    out.unlink(missing_ok=True)
    threads = "1" if kind == "ours" else str(arg)
    if kind == "llama":
        command = [str(_llama_cpp.python(_llama_cpp.cache_dir())), _llama_cpp.__file__,
                   "--job", gguf, "--threads", str(arg)]
    else:
        command = [sys.executable, SCRIPT, f"--{kind}-job", str(arg), "--format", fmt, *where]
    command += ["--data", str(folder), "--out", str(out), "--new-tokens", str(new_tokens)]
    env = child_env(OMP_NUM_THREADS=threads, TVM_NUM_THREADS="1")
    return run_job(key, command, env, out, timeout)


def bandwidth(folder: Path, processes: int, mib: int, window: float = STREAM_WINDOW) -> float:
    """Bytes/s one process gets when ``processes`` run the stream job at once (median)."""
    start = time.time() + 1.5  # every process allocated and waiting
    outs = [folder / f"stream{processes}_{i}.json" for i in range(processes)]
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    jobs = [subprocess.Popen([sys.executable, SCRIPT, "--stream-job", str(start), "--out",
                              str(o), "--mib", str(mib), "--stream-window", str(window)],
                             env=env) for o in outs]
    if any(j.wait(timeout=300) for j in jobs):
        raise SystemExit("the bandwidth job failed")
    return median(json.loads(o.read_text())["read"] for o in outs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 layers: a quick run")
    parser.add_argument("--quick", action="store_true",
                        help="a try-out: --small, 1 round, no kernels, 1 s bandwidth windows")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="weight formats, comma-separated (default: %(default)s)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--build-llama-cpp", action="store_true",
                        help="build llama.cpp's cached environment if absent (10-20 min)")
    parser.add_argument("--llama-cpp-sdist", help="a local llama_cpp_python sdist to build")
    parser.add_argument("--rounds", type=int, default=2, help="launches of every contender")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2], help="our rank counts")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2],
                        help="threads of the transformers and llama.cpp contenders")
    parser.add_argument("--hidden", type=int, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--kernels", nargs="*", default=None, metavar="KxN",
                        help="matrix-vector shapes (default: decode's, see MATVEC_SHAPES)")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    parser.add_argument("--mib", type=int, default=256, help="MiB per array of the stream job")
    parser.add_argument("--stream-window", type=float, default=STREAM_WINDOW,
                        help="seconds each kernel of the bandwidth job runs")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--json", help="also write the per-round figures to this JSON file")
    parser.add_argument("--hosts", action="store_true",
                        help="2 ranks on 2 test hosts beside 2 on this host; needs root")
    parser.add_argument("--on-hosts", help=argparse.SUPPRESS)
    parser.add_argument("--rsh", help=argparse.SUPPRESS)
    parser.add_argument("--hf-job", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ours-job", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--format", default="f32", help=argparse.SUPPRESS)
    parser.add_argument("--stream-job", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--kernels-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    shapes = ([tuple(int(v) for v in s.lower().split("x")) for s in opts.kernels]
              if opts.kernels else MATVEC_SHAPES)
    if opts.hf_job:
        hf_job(opts.data, opts.out, opts.hf_job, opts.new_tokens, opts.format)
        return 0
    if opts.ours_job:
        ours_job(opts.data, opts.out, opts.ours_job, opts.new_tokens, opts.on_hosts, opts.rsh,
                 opts.format)
        return 0
    if opts.stream_job:
        stream_job(opts.out, opts.stream_job, opts.mib, opts.stream_window)
        return 0
    if opts.kernels_job:
        kernels_job(opts.out, shapes, opts.rounds, opts.mib)
        return 0

    if opts.quick:
        opts.small, opts.rounds, opts.no_kernels, opts.stream_window = True, 1, True, 1.0
    config = dict(MODEL)
    if opts.small:
        config["num_hidden_layers"] = 4
    if opts.hidden:
        heads = max(4, opts.hidden // 64)
        config.update(hidden_size=opts.hidden, num_attention_heads=heads,
                      num_key_value_heads=max(2, heads // 2),
                      intermediate_size=4 * opts.hidden,
                      vocab_size=max(64, opts.hidden * 32))
    if opts.layers:
        config["num_hidden_layers"] = opts.layers
    if opts.hosts:
        return across_hosts(opts, config)
    formats = [f.strip() for f in opts.formats.split(",") if f.strip()]
    if unknown := sorted(set(formats) - set(FORMATS)):
        raise SystemExit(f"unknown formats {unknown}: choose from {', '.join(FORMATS)}")
    ours = our_formats(formats)
    llama, note = _llama_cpp.select(formats, opts.no_llama_cpp, opts.build_llama_cpp,
                                    opts.llama_cpp_sdist)
    rows = contenders(opts.ranks, opts.threads, ours, llama)
    started = time.perf_counter()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp:
        folder = Path(tmp)
        # llama.cpp's files are cached beside the checkpoint, so it is kept too
        model = cached_checkpoint(config, max(512, opts.prompt + opts.new_tokens)) if llama \
            else None
        read = build(folder, config, opts.prompt, opts.new_tokens, opts.ranks, ours, model)
        gguf = _llama_cpp.gguf_files(model, llama, _llama_cpp.cache_dir(),
                                     config["vocab_size"]) if llama else {}
        read.update({key_of("llama", t, fmt): gguf[fmt]["bytes"]
                     for fmt in llama for t in opts.threads})
        # each 16-bit or quantized format's reference tokens: transformers on its weights
        refs = {fmt: launch("hf", 1, folder, opts.new_tokens, opts.timeout, fmt=fmt)["tokens"]
                for fmt in formats if fmt != "f32" and any(f == fmt for *_, f in rows)}
        runs: dict[str, list[dict]] = {key: [] for key, *_ in rows}
        bw: dict[int, list[float]] = {1: [], 2: []}
        kernel_rows = None
        for r in range(opts.rounds):
            order = rows[r % len(rows):] + rows[:r % len(rows)]
            for key, _, kind, arg, fmt in order:
                got = launch(kind, arg, folder, opts.new_tokens, opts.timeout, fmt=fmt,
                             gguf=gguf.get(fmt, {}).get("path"))
                runs[key].append(got)
                print(f"  round {r + 1}: {key} prefill {got['prefill'] * 1e3:.0f} ms, "
                      f"decode {median(got['steps']) * 1e3:.1f} ms/token", file=sys.stderr,
                      flush=True)
            for processes in (1, 2):
                bw[processes].append(bandwidth(folder, processes, opts.mib,
                                               opts.stream_window))
            print(f"  round {r + 1}: bandwidth {bw[1][-1] / 1e9:.1f} GB/s alone, "
                  f"{bw[2][-1] / 1e9:.1f} GB/s per process with two", file=sys.stderr, flush=True)
        if not opts.no_kernels:
            out = folder / "kernels.json"
            command = [sys.executable, SCRIPT, "--kernels-job", "--out", str(out),
                       "--rounds", str(max(3, 2 * opts.rounds)), "--mib", str(opts.mib),
                       "--kernels",
                       *[f"{k}x{n}" for k, n in shapes]]
            kernel_rows = run_job("kernels", command, child_env(
                OMP_NUM_THREADS="1", TVM_NUM_THREADS="1"), out, opts.timeout)
    elapsed = time.perf_counter() - started
    load.append(os.getloadavg()[0])
    report(opts, config, rows, runs, bw, read, kernel_rows, elapsed, load,
           {"formats": formats, "ours": ours, "llama": note, "gguf": gguf, "refs": refs})
    return 0


def report(opts, config: dict, rows, runs: dict, bw: dict, read: dict, kernel_rows,
           elapsed: float, load: list[float], about: dict) -> None:
    """Print the tables (and write the JSON) of a finished run.

    ``about``: the formats asked for (``formats``), ours among them (``ours``),
    the llama.cpp line (``llama``) and its files (``gguf``).
    """
    reference = runs[rows[0][0]][0]["tokens"]
    step = {key: [median(run["steps"]) for run in runs[key]] for key in runs}
    table_rows, fractions = [], {}
    for key, label, kind, arg, fmt in rows:
        procs = arg if kind == "ours" else 1
        threads = 1 if kind == "ours" else arg  # one process's threads share its bandwidth
        per_proc = bw[2] if arg == 2 else bw[1]  # two ranks or two threads share the memory
        nbytes = read.get(key, read["whole"])
        bound = [nbytes / (b * threads) for b in per_proc]
        fractions[key] = [lo / t for lo, t in zip(bound, step[key])]
        # as if every process had one process's bandwidth to itself (separate machines)
        alone = [nbytes / (b * threads) / t for b, t in zip(bw[1], step[key])]
        same = []
        for tokens in (reference, about["refs"].get(fmt)):
            if tokens is not None:
                agree = min(_llama_cpp.agreeing(run["tokens"], tokens, opts.prompt)
                            for run in runs[key])
                same.append("yes" if agree == opts.new_tokens
                            else f"first {agree} of {opts.new_tokens}")
        rss = max(max(run["rss"]) for run in runs[key])
        # what the weights and the caches add to a rank's runtime (ours: before the first call)
        added = max(max(p - b for p, b in zip(run["rss"], run["runtime"])) for run in runs[key]
                    ) if kind == "ours" else None
        table_rows.append((
            label, f"{median(run['prefill'] for run in runs[key]) * 1e3:.0f}",
            f"{median(step[key]) * 1e3:.1f}", f"{1 / median(step[key]):.1f}",
            " / ".join(same),
            f"{fmt_bytes(rss)} x {procs}", "-" if added is None else fmt_bytes(added),
            f"{fmt_bytes(nbytes)}", f"{median(bound) * 1e3:.1f}",
            f"{median(fractions[key]):.2f} ({spread(fractions[key])})",
            f"{median(alone):.2f} ({spread(alone)})"))
    print(f"Llama decode, {llama_parameters(config) / 1e6:.0f}M parameters "
          f"({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, FFN "
          f"{config['intermediate_size']}, vocabulary {config['vocab_size']}), checkpoint in "
          f"float32, formats {', '.join(about['formats'])} (ours in "
          f"{', '.join(about['ours']) or 'none'}), prompt "
          f"{opts.prompt} tokens + {opts.new_tokens} greedy tokens, batch 1, "
          f"{os.cpu_count()} cores (load average {load[0]:.1f} before, {load[1]:.1f} after), "
          f"{opts.rounds} round{'s' if opts.rounds > 1 else ''} ({elapsed:.0f} s)\n\n"
          f"{about['llama']}\n")
    print(table(["contender", "prefill ms", "decode ms/token (median)", "tokens/s",
                 "tokens = transformers 1 thread (/ on the format's weights)",
                 "peak RSS per process",
                 "of which weights and cache (peak - rank before loading)",
                 "weights read per token per process", "roofline ms/token",
                 "fraction of roofline (min-max)",
                 "fraction at one process's bandwidth each (min-max)"], table_rows))
    if about["gguf"]:
        print()
        print(_llama_cpp.against_ours(opts.prompt, opts.new_tokens, rows, runs, step,
                                      about, key_of))
    scaling = [2 * two / one for one, two in zip(bw[1], bw[2])]
    print(f"\nBandwidth (STREAM-like numpy read, 2 s per kernel, 1 thread per process): "
          f"{median(bw[1]) / 1e9:.1f} GB/s for one process alone, "
          f"{median(bw[2]) / 1e9:.1f} GB/s per process with two streaming at once: two "
          f"processes together got {median(scaling):.2f}x ({spread(scaling)}) the bandwidth of "
          "one (it varies with the host's other tenants from moment to moment).")
    comparisons = []

    def ratio(label: str, slow: str, fast: str) -> None:
        if slow in step and fast in step:
            values = [a / b for a, b in zip(step[slow], step[fast])]
            comparisons.append((label, f"{median(values):.2f} ({spread(values)})"))

    ratio("decode: ours 2 ranks vs ours 1 rank (1-rank time / 2-rank time)", "ours1", "ours2")
    if "ours1" in step and "ours2" in step:
        values = [a / b / c for a, b, c in zip(step["ours1"], step["ours2"], scaling)]
        comparisons.append(("decode: that speed-up over the measured bandwidth scaling",
                            f"{median(values):.2f} ({spread(values)})"))
    ratio("decode: ours 1 rank vs transformers 1 thread (theirs / ours)", "hf1", "ours1")
    ratio("decode: ours 2 ranks vs transformers 2 threads (theirs / ours)", "hf2", "ours2")
    ratio("decode: ours 2 ranks vs transformers 1 thread (theirs / ours)", "hf1", "ours2")
    if comparisons:
        print()
        print(table(["comparison", "ratio (min-max)"], comparisons))
    if kernel_rows:
        lines = []
        for row in kernel_rows:
            ours, theirs = median(row["ours"]), median(row["torch"])
            ratios = [t / o for o, t in zip(row["ours"], row["torch"])]
            share = [row["bytes"] / o / b for o, b in zip(row["ours"], row["bandwidth"])]
            lines.append((f"1x{row['k']} @ {row['k']}x{row['n']}", row["rule"],
                          fmt_bytes(row["bytes"]), f"{theirs * 1e6:.0f}", f"{ours * 1e6:.0f}",
                          f"{row['bytes'] / theirs / 1e9:.1f}", f"{row['bytes'] / ours / 1e9:.1f}",
                          f"{median(share):.2f}",
                          f"{median(ratios):.2f} ({spread(ratios)})"))
        print("\nMatrix-vector products, weight stored (N, K), float32, 1 thread, weights from "
              "memory (copies cycled past the caches); the bandwidth is measured in the same "
              "process, once per round:\n")
        print(table(["x @ W.T", "our rule", "weight", "torch linear us", "ours us",
                     "torch GB/s", "ours GB/s", "ours / bandwidth", "speed-up vs torch "
                     "(min-max)"], lines))
    if opts.json:
        Path(opts.json).write_text(json.dumps({
            "labels": {key: label for key, label, *_ in rows}, "steps": step,
            "prefill": {k: [run["prefill"] for run in v] for k, v in runs.items()},
            "fractions": fractions, "bandwidth": bw, "read": read, "kernels": kernel_rows,
            "parameters": llama_parameters(config), "gguf": about["gguf"],
            "tokens": {k: [run["tokens"] for run in v] for k, v in runs.items()}}))


def across_hosts(opts, config: dict) -> int:
    """``--hosts``: decode of 2 ranks on this host and on 2 test hosts, in turns; the table."""
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {"one": [], "two": []}
    with tempfile.TemporaryDirectory(prefix="tvm-distx-bench-") as tmp, test_hosts(2) as hosts:
        folder = Path(tmp)
        build(folder, config, opts.prompt, opts.new_tokens, [2])
        names = hosts["TESTHOSTS_NAMES"].split(",")
        where = {"one": (), "two": ("--on-hosts", ",".join(names),
                                    "--rsh", hosts["TESTHOSTS_RSH"])}
        for r in range(opts.rounds):
            for side in ("one", "two") if r % 2 == 0 else ("two", "one"):
                got = launch("ours", 2, folder, opts.new_tokens, opts.timeout, where[side])
                runs[side].append(got)
                print(f"  round {r + 1}: on {side} host{'s' if side == 'two' else ''}, prefill {got['prefill'] * 1e3:.0f} ms, "
                      f"decode {median(got['steps']) * 1e3:.1f} ms/token", file=sys.stderr,
                      flush=True)
    tokens = {tuple(run["tokens"]) for side in runs.values() for run in side}
    if len(tokens) != 1:
        raise SystemExit(f"the greedy tokens differ between the runs: {sorted(tokens)}")
    step = {side: [median(run["steps"]) for run in got] for side, got in runs.items()}
    ratios = [b / a for a, b in zip(step["one"], step["two"])]
    rows = [(label, f"{median(run['prefill'] for run in runs[side]) * 1e3:.0f}",
             f"{median(step[side]) * 1e3:.1f}", f"{1 / median(step[side]):.1f}",
             "-" if side == "one" else f"{median(ratios):.2f} ({spread(ratios)})", "yes")
            for side, label in (("one", "2 ranks on this host (shared memory)"),
                                ("two", f"1 rank on each of {names[0]} and {names[1]} (TCP)"))]
    print(f"Llama decode, {llama_parameters(config) / 1e6:.0f}M parameters "
          f"({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, FFN "
          f"{config['intermediate_size']}, vocabulary {config['vocab_size']}), float32, prompt "
          f"{opts.prompt} tokens + {opts.new_tokens} greedy tokens, batch 1, 2 ranks of 1 "
          f"thread, {os.cpu_count()} cores, {opts.rounds} rounds "
          f"({time.perf_counter() - started:.0f} s); each rank receives "
          f"{fmt_bytes(runs['one'][0]['comm'])} per token\n")
    print(table(["ranks", "prefill ms", "decode ms/token (median)", "tokens/s",
                 "ratio two hosts / one host (min-max)", "same tokens"], rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"steps": step, "runs": runs,
                                               "parameters": llama_parameters(config)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
